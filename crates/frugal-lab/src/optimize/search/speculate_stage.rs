//! The speculation stage: the last lever, pulled on the chosen point only (it changes no
//! quality, so it cannot change which point meets the quality targets). Each drafter is timed
//! with the chosen model on the user's prompts ([`speculate::trial`]); the fastest one at
//! [`speculate::REWARD`] or more is paired with it in `recipe.toml`.
//!
//! Drafters: prompt lookup, early exits of the chosen model, and a draft model built from the
//! search's own smallest point when it holds at most half the chosen point's weight bytes
//! (a pruned and quantized model drafting for a lightly quantized one is a composition of
//! levers no single command makes).

use super::*;
use crate::optimize::speculate::{self, Candidate, Pairing, Runner};

/// A draft model must hold at most this share of the chosen model's weight bytes: a draft
/// costs its weights' reading per drafted token, and above half of the target's the drafts
/// cannot pay at the acceptance a different model reaches.
const DRAFT_SHARE: f64 = 0.5;

/// The least top-1 agreement with the base a draft model's point must show.
const DRAFT_TOP1: f64 = 0.5;

impl Search<'_> {
    /// Times the drafters with `chosen` and returns the pairing taken, if any pays.
    pub(super) fn speculate_stage(&mut self, chosen: &str) -> Result<Option<Pairing>> {
        if !self.levers(Lever::Speculate) {
            return Ok(None);
        }
        let p = self.state.point(chosen).context("chosen point")?.clone();
        let mut cands = speculate::drafters(self.base.config.n_layers);
        if let Some(d) = self.draft_point(&p) {
            cands.push(Candidate {
                drafter: format!("draft:{}", speculate::DRAFT_FILE),
                draft_key: Some(d),
            });
        } else {
            self.state.refused.push(format!(
                "speculate draft model: no measured point holds at most {:.0}% of the chosen point's weights with top-1 agreement of {DRAFT_TOP1} or more",
                DRAFT_SHARE * 100.0
            ));
        }
        // A resumed search keeps the trials it made with this point.
        self.state.speculation.retain(|t| t.target == chosen);
        let tok = Tokenizer::from_gguf(&self.base.file)?;
        let prompts = self.prompts.clone();
        let model = self.model(chosen)?;
        let runner = Runner {
            model: &model,
            kv: runtime_options(&p.recipe.runtime).kv,
        };
        let mut trials = Vec::new();
        for c in &cands {
            if let Some(t) = self
                .state
                .speculation
                .iter()
                .find(|t| t.drafter == c.drafter)
            {
                trials.push(t.clone());
                continue;
            }
            if self.stopped.is_some()
                || self.cfg.budget_seconds < self.start.elapsed().as_secs_f64()
            {
                self.state.refused.push(format!(
                    "speculate {}: not timed, the budget is spent",
                    c.drafter
                ));
                continue;
            }
            let draft = match &c.draft_key {
                Some(k) => Some(self.model(k)?),
                None => None,
            };
            let base = Runner {
                model: &self.base,
                kv: KvOptions::default(),
            };
            let mut t = speculate::trial(
                &base,
                &runner,
                c,
                draft,
                &tok,
                &prompts,
                self.cfg.funnel.rounds,
            )?;
            t.target = chosen.to_string();
            self.evaluations += 1;
            (self.progress)(Progress::Step(format!(
                "speculate {}: {:.2}x over plain decoding (acceptance {:.2}, {:.2} tokens per pass)",
                t.drafter, t.speedup, t.acceptance, t.tokens_per_pass
            )));
            trials.push(t);
        }
        trials.iter_mut().for_each(|t| t.taken = false);
        let taken = speculate::choose(&mut trials, self.cfg.funnel.speculate_reward).cloned();
        self.state.speculation = trials;
        let pairing = taken.map(|t| Pairing {
            draft: cands
                .iter()
                .find(|c| c.drafter == t.drafter)
                .and_then(|c| c.draft_key.as_deref())
                .and_then(|k| self.state.point(k))
                .map(|p| p.recipe.clone()),
            drafter: t.drafter,
            speedup: t.speedup,
        });
        if pairing.is_none() {
            self.state.refused.push(format!(
                "speculate: no drafter reached {:.2}x over plain decoding on these prompts",
                self.cfg.funnel.speculate_reward
            ));
        }
        Ok(pairing)
    }

    /// The smallest measured point whose weights are at most [`DRAFT_SHARE`] of `chosen`'s
    /// and whose top-1 agreement is at least [`DRAFT_TOP1`].
    fn draft_point(&self, chosen: &Point) -> Option<String> {
        self.state
            .points
            .iter()
            .filter(|q| (q.weight_bytes as f64) <= DRAFT_SHARE * chosen.weight_bytes as f64)
            .filter(|q| q.latest().is_some_and(|r| r.top1 >= DRAFT_TOP1))
            .min_by_key(|q| q.weight_bytes)
            .map(|q| q.key.clone())
    }
}
