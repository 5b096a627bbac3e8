//! Choosing the peak learning rate by measurement before a run starts.
//!
//! Adam's first update moves every weight by about the learning rate whatever its gradient's
//! size, so the rate a model tolerates depends on how strongly its layers amplify a change of
//! weights. Gemma 3 scales the inputs of its products by norm weights near 26 (SmolLM2's are
//! near 1): a rate that heals SmolLM2 (3e-4) sends Gemma 3 270M's held-out KL from 0.08 to 8 in
//! one step, while 1e-5 heals it (0.179 → 0.098 in 8k tokens). No single default serves both,
//! so the rate is probed: from the ceiling down by √10 at a time, each rate takes a few steps
//! from the starting weights on the run's first batches and is scored on the held-out windows;
//! the search stops once a rate scores worse than a larger one that already improved on the
//! start. The weights, the optimizer and the data order are restored after every trial, so the
//! run that follows is the run that the chosen rate would have made without the probe.

use super::Trainer;
use crate::data::Order;
use crate::error::{Result, TrainError};
use crate::optim::Schedule;

/// How the probe searches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrProbe {
    /// The largest rate, tried first.
    pub max: f32,
    /// How many rates at most, each 1/√10 of the one before.
    pub candidates: usize,
    /// Optimizer steps each rate takes, at a constant rate, before it is scored.
    pub steps: usize,
}

impl Default for LrProbe {
    fn default() -> Self {
        LrProbe {
            max: 3e-4,
            candidates: 6,
            steps: 2,
        }
    }
}

/// One rate tried: its held-out score (KL to the teacher when the run distils, else
/// cross-entropy) after the probe's steps; infinite when the steps diverged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrTrial {
    pub lr: f32,
    pub score: f64,
}

/// The probe's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct LrChoice {
    /// The held-out score before any step.
    pub start: f64,
    pub trials: Vec<LrTrial>,
    /// The rate the run now uses: the largest whose improvement on the start is within a
    /// tenth of the best trial's (the best trial when none improved).
    pub lr: f32,
}

impl LrChoice {
    /// Whether any rate improved on the starting weights within the probe's steps.
    pub fn improved(&self) -> bool {
        self.trials.iter().any(|t| t.score < self.start)
    }
}

impl Trainer<'_> {
    /// Probes the peak learning rate as [`LrProbe`] says, sets it as the run's, and returns what
    /// was measured (`on` sees each trial as it finishes). Only before the first step.
    pub fn probe_learning_rate(
        &mut self,
        probe: LrProbe,
        mut on: impl FnMut(&LrTrial),
    ) -> Result<LrChoice> {
        if self.step != 0 {
            return Err(TrainError::Invalid(
                "the learning rate is probed before the first step, not in a resumed run".into(),
            ));
        }
        if !(probe.max.is_finite() && probe.max > 0.0) || probe.candidates == 0 || probe.steps == 0
        {
            return Err(TrainError::Invalid(format!(
                "a learning-rate probe needs a positive ceiling, rates and steps: {probe:?}"
            )));
        }
        let start_params = self.params.clone();
        let start_projectors = self.projectors.clone();
        let schedule = self.cfg.schedule.clone();
        let start_eval = self.evaluate()?;
        let start = self.score(&start_eval);
        let mut trials: Vec<LrTrial> = Vec::new();
        let mut best: Option<LrTrial> = None;
        for k in 0..probe.candidates {
            let lr = probe.max * 10f32.powf(-(k as f32) / 2.0);
            self.cfg.schedule = Schedule {
                lr,
                warmup: 0,
                total: probe.steps,
                min_ratio: 1.0,
            };
            let outcome = (0..probe.steps)
                .try_for_each(|_| self.train_step().map(drop))
                .and_then(|()| self.evaluate().map(|e| self.score(&e)));
            self.restart(&start_params, &start_projectors);
            let score = match outcome {
                Ok(score) => score,
                Err(TrainError::NonFinite { .. }) => f64::INFINITY,
                Err(e) => {
                    self.cfg.schedule = schedule;
                    return Err(e);
                }
            };
            let trial = LrTrial { lr, score };
            on(&trial);
            trials.push(trial);
            match best {
                // Ties go to the smaller rate unless a larger one already improved.
                Some(b) if b.score < score || (b.score == score && b.score < start) => {
                    if b.score < start {
                        break;
                    }
                }
                _ => best = Some(trial),
            }
        }
        let lr = match best {
            // The largest rate within a tenth of the best improvement: the probe's few steps
            // under-credit a larger rate, whose first (sign-like) Adam steps cost it most.
            Some(b) if b.score < start => {
                let enough = start - 0.9 * (start - b.score);
                trials
                    .iter()
                    .find(|t| t.score <= enough)
                    .map_or(b.lr, |t| t.lr)
            }
            Some(b) => b.lr,
            None => schedule.lr,
        };
        self.cfg.schedule = Schedule { lr, ..schedule };
        self.start_eval = Some(start_eval);
        Ok(LrChoice { start, trials, lr })
    }

    /// The held-out score the probe compares: KL to the teacher when one is at hand and the
    /// run learns from it, else cross-entropy. A diverged model scores infinity.
    fn score(&self, e: &super::EvalPoint) -> f64 {
        let s = match e.kl {
            Some(kl) if self.cfg.loss.alpha > 0.0 => kl,
            _ => e.ce,
        };
        if s.is_finite() { s } else { f64::INFINITY }
    }

    /// Back to the starting weights, a fresh optimizer and the first batch.
    fn restart(&mut self, params: &crate::Params, projectors: &[Option<crate::Tensor>]) {
        self.params.clone_from(params);
        self.projectors = projectors.to_vec();
        for m in &mut self.opt.moments {
            m.m.fill(0.0);
            m.v.fill(0.0);
        }
        self.opt.t = 0;
        self.step = 0;
        self.order = Order::new(self.cfg.seed, self.data.train.len());
    }
}
