//! The speculative decoding loop: draft, verify in one pass, keep the accepted prefix, drop the
//! rest from the caches, repeat.
//!
//! Output goes through the same [`Emitter`] as plain decoding, one token at a time, so stop
//! strings, end-of-generation tokens, `max_tokens` and a full context end generation at the same
//! token for the same reason.

use std::time::Instant;

use super::draft_model::DraftModel;
use super::heads::{DraftHeads, HeadWeights};
use super::ngram;
use super::rule::{self, Workspace};
use super::store::{Datastore, Retrieval};
use super::target::Target;
use super::{Method, SpecOptions};
use crate::attention::Attention;
use crate::error::{Error, Result};
use crate::generate::{Emitter, GenerateOptions, Generation, GenerationStats};
use crate::kv::KvOptions;
use crate::model::{Config, Logits, Model};
use crate::sample::{Sampler, SamplerParams};
use crate::tokenizer::Tokenizer;

/// Where draft tokens come from.
pub enum Drafter {
    /// Prompt lookup, with its own draft length per match length.
    Ngram(ngram::Lookup),
    /// The target's own first layers (the split lives in the target's caches).
    EarlyExit,
    Model(Box<DraftModel>),
    /// Draft heads, after prompt lookup when it is given: a copy in progress is the cheaper and
    /// longer draft, and the heads guess where the text is not copying anything.
    Heads {
        heads: Box<DraftHeads>,
        lookup: Option<ngram::Lookup>,
    },
    /// Prompt lookup, then retrieval from a datastore where the context has no match.
    Store {
        lookup: ngram::Lookup,
        retrieval: Box<Retrieval>,
    },
}

/// What speculation did during one generation.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SpecStats {
    /// Target passes after the prefill (each verifies one draft, possibly empty).
    pub passes: usize,
    /// Passes that verified at least one drafted token.
    pub drafted_passes: usize,
    pub drafted: usize,
    pub accepted: usize,
    pub draft_seconds: f64,
    pub verify_seconds: f64,
}

impl SpecStats {
    /// Share of drafted tokens the target kept.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// What a verification pass costs, relative to a one-token decode step, as the adaptive draft
/// length assumes it: `1 + first_row + (k - 1) row` to check `k` drafted tokens.
///
/// The first extra row costs the most. A one-token step is bound by reading the weights and
/// has arithmetic to spare; with a second row the arithmetic no longer hides behind the reads,
/// and the step turns compute-bound. Measured on SmolLM2-135M Q4_1, 2 threads
/// (`frugal bench speculate`'s pass-cost table, three runs in a row): two rows 1.20-1.33,
/// three 1.39-1.55, five 1.68-1.82, nine 2.04-2.30, seventeen 3.04-3.27. One flat figure per
/// row either overrates long drafts or underrates short ones: at 0.12 a one-token draft with
/// acceptance 0.28 looked worth 1.10x and ran at 0.84-0.89x.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PassCost {
    /// The first drafted token's row.
    pub first_row: f64,
    /// Each row after it.
    pub row: f64,
}

impl PassCost {
    /// Every row costing `row`.
    pub const fn flat(row: f64) -> Self {
        PassCost {
            first_row: row,
            row,
        }
    }

    /// The extra cost of verifying `k` drafted tokens.
    pub fn rows(&self, k: usize) -> f64 {
        match k {
            0 => 0.0,
            k => self.first_row + (k - 1) as f64 * self.row,
        }
    }
}

/// The pass cost a model-based drafter (draft heads, a draft model, an early exit) assumes:
/// 0.25 for the first row, 0.12 for each after it, which fits the quieter of the measured runs
/// (1.25, 1.37, 1.61, 2.09, 3.05 at 2 to 17 rows). Such drafters mostly weigh a short draft
/// against none, which the first row's cost decides: draft heads with acceptance 0.27-0.29 ran
/// at 0.84-0.91x under a flat 0.12 and at 0.98x (both kinds of prompt) under this.
pub const DEFAULT_PASS_COST: PassCost = PassCost {
    first_row: 0.25,
    row: 0.12,
};

/// The pass cost prompt lookup assumes: a flat 0.12 per row. Its drafts are a copy in progress
/// or nothing, and it weighs long drafts against shorter ones more than against none; measured
/// on the same build, input-grounded prompts ran at 1.90x and 1.89x under this and at 1.74x
/// and 1.78x under [`DEFAULT_PASS_COST`] (alternating runs, 3 repetitions each).
pub const LOOKUP_PASS_COST: PassCost = PassCost::flat(0.12);

/// Chooses the draft length from the acceptance seen so far. For each draft position `j` it
/// keeps a (decayed) estimate of `a_j`, the chance that token `j` is kept given that the ones
/// before it were; the expected tokens per pass of a `k`-token draft are then
/// `1 + sum_{i<=k} prod_{j<=i} a_j` (Leviathan et al.'s `(1 - a^(k+1)) / (1 - a)` when every
/// `a_j` is the same), over a pass cost of `1 + k c + rows(k)`: `c` is the drafter's cost per
/// token and `rows(k)` the [`PassCost`] of `k` more verified rows, both relative to a plain
/// decode step. Position by
/// position matters for prompt lookup, whose drafts are either a long copy or wrong at once.
/// The choice depends on the tokens only (not on timings), so a seeded run repeats exactly.
/// When no draft length pays it decodes plainly, drafting one token after `PROBE` passes to
/// notice when acceptance recovers, and twice as many passes after each probe that does not
/// bring it back (up to `MAX_PROBE`): a draft model must catch up on every token since its last
/// draft, so frequent probes would cost more than they find.
#[derive(Clone, Debug)]
pub struct DraftLength {
    k_max: usize,
    adaptive: bool,
    draft_cost: f64,
    pass: PassCost,
    /// Per draft position: decayed counts of tokens kept and of tokens tried.
    kept: Vec<f64>,
    tried: Vec<f64>,
    plain_passes: usize,
    /// Plain passes before the next probe.
    probe_every: usize,
}

const PROBE: usize = 16;
const MAX_PROBE: usize = 512;
const DECAY: f64 = 0.9;

impl DraftLength {
    pub fn new(k_max: usize, adaptive: bool, draft_cost: f64, pass: PassCost) -> Self {
        DraftLength {
            k_max,
            adaptive,
            draft_cost,
            pass,
            kept: vec![0.0; k_max],
            tried: vec![0.0; k_max],
            plain_passes: 0,
            probe_every: PROBE,
        }
    }

    /// The chance that draft token `j` is kept once those before it were, given `prior`, the
    /// previous position's estimate (0.5 for the first): two pseudo-tokens at it, so a
    /// position not tried yet is expected to do as well as the one before it: a run of kept
    /// copies lengthens the draft by more than one token per pass, where a prior of 0.5 at
    /// every position would hold it back until each position had been tried on its own.
    fn alpha(&self, j: usize, prior: f64) -> f64 {
        ((self.kept[j] + 2.0 * prior) / (self.tried[j] + 2.0)).min(0.999)
    }

    /// The draft length for the next pass.
    pub fn next_k(&mut self) -> usize {
        if !self.adaptive {
            return self.k_max;
        }
        let (mut best, mut best_rate) = (0, 1.0);
        let (mut expected, mut run, mut a) = (1.0, 1.0, 0.5);
        for k in 1..=self.k_max {
            a = self.alpha(k - 1, a);
            run *= a;
            expected += run;
            let rate = expected / (1.0 + k as f64 * self.draft_cost + self.pass.rows(k));
            if rate > best_rate {
                (best, best_rate) = (k, rate);
            }
        }
        if best > 0 {
            self.plain_passes = 0;
            self.probe_every = PROBE;
            return best;
        }
        self.plain_passes += 1;
        if self.plain_passes >= self.probe_every {
            self.plain_passes = 0;
            self.probe_every = (self.probe_every * 2).min(MAX_PROBE);
            return 1;
        }
        0
    }

    /// A pass kept `kept` of `drafted` tokens (the first rejection ends the run, so positions
    /// after it were not tried).
    pub fn record(&mut self, drafted: usize, kept: usize) {
        for j in 0..drafted.min(kept + 1).min(self.k_max) {
            self.tried[j] = self.tried[j] * DECAY + 1.0;
            self.kept[j] = self.kept[j] * DECAY + if j < kept { 1.0 } else { 0.0 };
        }
    }
}

/// A generation session whose decode steps are speculative.
pub struct Speculator<'m> {
    target: Target<'m>,
    drafter: Drafter,
    opts: SpecOptions,
    /// Tokens whose keys and values are in the target's cache.
    cached: Vec<u32>,
    /// What a verification pass costs relative to a decode step (see [`PassCost`]).
    pub pass_cost: PassCost,
    ws: Workspace,
    /// The target's last hidden state at the position of the latest chosen token (what draft
    /// heads read).
    last_hidden: Vec<f32>,
    /// The context followed by the tokens drafted so far (the early exit's penalties read it).
    seq: Vec<u32>,
    /// The latest draft came from prompt lookup (`ngram+heads`), which keeps its own lengths.
    from_lookup: bool,
}

impl<'m> Speculator<'m> {
    /// A speculative session over `model` with room for `ctx` tokens. A `draft:` method uses
    /// `draft` when given, else loads the file it names (with the target's activation
    /// precision); a `heads:` method loads its heads file.
    pub fn new(
        model: &'m Model,
        ctx: usize,
        kv: &KvOptions,
        attention: Attention,
        opts: &SpecOptions,
        draft: Option<Model>,
    ) -> Result<Self> {
        let mut opts = opts.clone();
        let (drafter, exit) = match (&opts.method, draft) {
            (Method::Ngram { n }, None) => (
                Drafter::Ngram(ngram::Lookup::new(
                    *n,
                    opts.k,
                    opts.adaptive,
                    LOOKUP_PASS_COST,
                )),
                None,
            ),
            (Method::EarlyExit { layers }, None) => {
                let n_layers = model.config.n_layers;
                if *layers >= n_layers {
                    return Err(Error::Invalid(format!(
                        "--speculate self:{layers}: the early exit must come before the last of the model's {n_layers} layers"
                    )));
                }
                (Drafter::EarlyExit, Some(*layers))
            }
            (Method::Draft { path }, d) => {
                let d = match d {
                    Some(d) => d,
                    None => {
                        let mut d = Model::load(path)?;
                        d.set_activations(model.activations);
                        d
                    }
                };
                let d = DraftModel::new(d, model, ctx, kv, attention, opts.draft_vocab)?;
                (Drafter::Model(Box::new(d)), None)
            }
            (Method::Heads { path, .. }, None) => {
                let w = HeadWeights::read(path)?;
                (Self::heads_drafter(model, w, &mut opts)?, None)
            }
            (Method::Store { path }, None) => {
                let store = Datastore::read(path)?;
                (Self::store_drafter(model, store, &opts)?, None)
            }
            (_, Some(_)) => {
                return Err(Error::Invalid(
                    "a draft model was given to a drafter that takes none".into(),
                ));
            }
        };
        Self::assemble(Target::new(model, ctx, kv, attention, exit)?, drafter, opts)
    }

    /// Speculation with draft heads already in memory (tests, training reports); `opts` names
    /// a `heads` method (its path is not read).
    pub fn with_heads(
        model: &'m Model,
        ctx: usize,
        kv: &KvOptions,
        attention: Attention,
        opts: &SpecOptions,
        heads: HeadWeights,
    ) -> Result<Self> {
        let mut opts = opts.clone();
        let drafter = Self::heads_drafter(model, heads, &mut opts)?;
        let target = Target::new(model, ctx, kv, attention, None)?;
        Self::assemble(target, drafter, opts)
    }

    /// The heads drafter for `opts` (a `heads` method), with prompt lookup first when it asks.
    /// Prompt lookup may draft up to K; the heads draft at most their number.
    fn heads_drafter(model: &Model, w: HeadWeights, opts: &mut SpecOptions) -> Result<Drafter> {
        let Method::Heads { lookup, .. } = opts.method else {
            return Err(Error::Invalid(
                "draft heads were given to a drafter that takes none".into(),
            ));
        };
        let heads = Box::new(DraftHeads::new(w, model)?);
        let lookup = lookup.map(|n| ngram::Lookup::new(n, opts.k, opts.adaptive, LOOKUP_PASS_COST));
        if lookup.is_none() {
            opts.k = opts.k.min(heads.len());
        }
        Ok(Drafter::Heads { heads, lookup })
    }

    /// Speculation with a datastore already in memory (tests, reports); `opts` names a `store`
    /// method (its path is not read).
    pub fn with_store(
        model: &'m Model,
        ctx: usize,
        kv: &KvOptions,
        attention: Attention,
        opts: &SpecOptions,
        store: Datastore,
    ) -> Result<Self> {
        let drafter = Self::store_drafter(model, store, opts)?;
        let target = Target::new(model, ctx, kv, attention, None)?;
        Self::assemble(target, drafter, opts.clone())
    }

    /// Prompt lookup, then `store`, which must hold this model's token ids.
    fn store_drafter(model: &Model, store: Datastore, opts: &SpecOptions) -> Result<Drafter> {
        let n_vocab = model.config.n_vocab;
        if store.n_vocab() != n_vocab {
            return Err(Error::Invalid(format!(
                "the datastore holds token ids of a vocabulary of {}, this model has {n_vocab}: build it with this model",
                store.n_vocab()
            )));
        }
        Ok(Drafter::Store {
            lookup: ngram::Lookup::new(
                super::DEFAULT_NGRAM,
                opts.k,
                opts.adaptive,
                LOOKUP_PASS_COST,
            ),
            retrieval: Box::new(Retrieval::new(
                std::sync::Arc::new(store),
                super::store::DEFAULT_MATCH,
                opts.k,
                opts.adaptive,
                LOOKUP_PASS_COST,
            )),
        })
    }

    fn assemble(target: Target<'m>, drafter: Drafter, opts: SpecOptions) -> Result<Self> {
        Ok(Speculator {
            target,
            drafter,
            opts,
            cached: Vec::new(),
            pass_cost: DEFAULT_PASS_COST,
            ws: Workspace::default(),
            last_hidden: Vec::new(),
            seq: Vec::new(),
            from_lookup: false,
        })
    }

    pub fn ctx(&self) -> usize {
        self.target.ctx()
    }

    /// The drafter's cost per drafted token relative to a target decode step, from the
    /// multiply-adds of the matrix products each runs per token.
    pub fn draft_cost(&self) -> f64 {
        let target = self.target.model;
        let c = &target.config;
        let full = macs_per_token(c, c.n_layers, c.n_vocab);
        match &self.drafter {
            Drafter::Ngram(_) | Drafter::Store { .. } => 0.0,
            Drafter::EarlyExit => match self.opts.method {
                Method::EarlyExit { layers } => macs_per_token(c, layers, c.n_vocab) / full,
                _ => 1.0,
            },
            Drafter::Model(d) => d.macs_per_token() / full,
            Drafter::Heads { heads, .. } => heads.macs_per_head() / full,
        }
    }

    /// Generates a continuation of `prompt` as [`Session::generate`](crate::generate::Session)
    /// does, with the same tokens under greedy decoding and the same distribution when sampling.
    pub fn generate(
        &mut self,
        tok: &Tokenizer,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str),
    ) -> Result<(Generation, SpecStats)> {
        crate::generate::check_prompt(prompt, self.ctx(), opts)?;
        let keep = crate::generate::reusable_prefix(&self.cached, prompt);
        self.target.truncate(keep);
        self.cached.truncate(keep);

        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            prefill_tokens: prompt.len() - keep,
            ..Default::default()
        };
        let mut spec = SpecStats::default();
        let mut sampler = Sampler::new(opts.sampler.clone());
        // The draft's own stream, so drafting does not shift the verifier's draws.
        let mut draft_sampler = Sampler::new(SamplerParams {
            seed: opts.sampler.seed ^ 0x5eed_d4af_7000_0001,
            ..opts.sampler.clone()
        });
        let mut adapt = DraftLength::new(
            self.opts.k,
            self.opts.adaptive,
            self.draft_cost(),
            self.pass_cost,
        );
        let mut out = Emitter::new(tok, prompt, opts, self.ctx());
        let n_vocab = self.target.model.config.n_vocab;
        let gen_start = prompt.len();

        let t0 = Instant::now();
        let mut next = {
            let logits = self.target.forward(&prompt[keep..], Logits::Last)?;
            sampler.sample_with(logits, out.history(), out.generated())
        };
        self.cached.extend_from_slice(&prompt[keep..]);
        self.keep_hidden(prompt.len() - keep - 1);
        stats.prefill_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut draft = Vec::new();
        let mut q: Vec<Vec<(u32, f32)>> = Vec::new();
        let mut feed = Vec::new();
        let stop_reason = 'outer: loop {
            if let Some(stop) = out.push(next, &mut on_text) {
                break stop;
            }
            // Draft at most what fits in the context and what max_tokens can still use.
            let room = self.ctx().saturating_sub(self.target.len() + 1);
            let wanted = opts.max_tokens.saturating_sub(out.generated().len() + 1);
            let cap = self.opts.k.min(room).min(wanted);
            // Prompt lookup chooses its length from the match it finds (see `ngram::Lookup`);
            // the heads' length is chosen only when lookup drafts nothing.
            let k = match self.drafter {
                Drafter::Ngram(_) | Drafter::Store { .. } => cap,
                Drafter::Heads {
                    lookup: Some(_), ..
                } => cap,
                _ => adapt.next_k().min(cap),
            };
            let td = Instant::now();
            let stochastic = self.draft(
                out.history(),
                gen_start,
                k,
                &mut adapt,
                &mut draft_sampler,
                &mut draft,
                &mut q,
            )?;
            spec.draft_seconds += td.elapsed().as_secs_f64();

            let tv = Instant::now();
            feed.clear();
            feed.push(next);
            feed.extend_from_slice(&draft);
            let base = self.target.len();
            let rows = self.target.forward(&feed, Logits::All)?;
            let v = rule::verify(
                rows,
                n_vocab,
                &draft,
                stochastic.then(|| &q[..draft.len()]),
                out.history(),
                gen_start,
                &mut sampler,
                &mut self.ws,
            );
            self.keep_hidden(v.accepted);
            // Keep the last accepted token and the kept drafts; drop the rejected positions.
            self.target.truncate(base + 1 + v.accepted);
            self.cached.extend_from_slice(&feed[..1 + v.accepted]);
            spec.verify_seconds += tv.elapsed().as_secs_f64();
            spec.passes += 1;
            spec.drafted += draft.len();
            spec.accepted += v.accepted;
            spec.drafted_passes += usize::from(!draft.is_empty());
            match &mut self.drafter {
                Drafter::Ngram(l) => l.record(draft.len(), v.accepted),
                Drafter::Heads {
                    lookup: Some(l), ..
                } if self.from_lookup => l.record(draft.len(), v.accepted),
                Drafter::Store { lookup, .. } if self.from_lookup => {
                    lookup.record(draft.len(), v.accepted)
                }
                Drafter::Store { retrieval, .. } => retrieval.record(draft.len(), v.accepted),
                _ => adapt.record(draft.len(), v.accepted),
            }
            stats.decode_steps += 1;
            stats.decode_tokens += 1 + v.accepted;
            for &t in &draft[..v.accepted] {
                if let Some(stop) = out.push(t, &mut on_text) {
                    break 'outer stop;
                }
            }
            next = v.next;
        };
        stats.decode_seconds = t1.elapsed().as_secs_f64();
        stats.kv_cache_bytes = self.target.kv_bytes();
        Ok((out.finish(stop_reason, stats, &mut on_text), spec))
    }

    /// Keeps the hidden state of `row` of the last target pass, if the drafter reads it.
    fn keep_hidden(&mut self, row: usize) {
        if let Drafter::Heads { .. } = self.drafter {
            let d = self.target.model.config.n_embd;
            let h = &self.target.scratch.hidden()[row * d..(row + 1) * d];
            self.last_hidden.clear();
            self.last_hidden.extend_from_slice(h);
        }
    }

    /// Fills `draft` with up to `k` tokens after `context`; returns whether they were sampled
    /// (with their distributions in `q`) rather than chosen deterministically. `adapt` chooses
    /// the heads' length when prompt lookup, tried first, drafts nothing.
    #[allow(clippy::too_many_arguments)]
    fn draft(
        &mut self,
        context: &[u32],
        gen_start: usize,
        k: usize,
        adapt: &mut DraftLength,
        sampler: &mut Sampler,
        draft: &mut Vec<u32>,
        q: &mut Vec<Vec<(u32, f32)>>,
    ) -> Result<bool> {
        draft.clear();
        self.from_lookup = false;
        if k == 0 {
            return Ok(false);
        }
        let sampled = sampler.params.temperature > 0.0;
        match &mut self.drafter {
            Drafter::Ngram(l) => {
                l.propose(context, k, draft);
                Ok(false)
            }
            Drafter::Store { lookup, retrieval } => {
                lookup.propose(context, k, draft);
                self.from_lookup = !draft.is_empty();
                if draft.is_empty() {
                    retrieval.propose(context, k, draft);
                }
                Ok(false)
            }
            Drafter::Model(d) => {
                d.propose(context, gen_start, k, sampler, draft, q)?;
                Ok(sampled)
            }
            Drafter::Heads { heads, lookup } => {
                let mut k = k;
                if let Some(l) = lookup {
                    l.propose(context, k, draft);
                    if !draft.is_empty() {
                        self.from_lookup = true;
                        return Ok(false);
                    }
                    k = adapt.next_k().min(k).min(heads.len());
                    if k == 0 {
                        return Ok(false);
                    }
                }
                let m = self.target.model;
                heads.propose(
                    m,
                    &self.last_hidden,
                    context,
                    gen_start,
                    k,
                    sampler,
                    draft,
                    q,
                )?;
                Ok(sampled)
            }
            Drafter::EarlyExit => {
                let seq = &mut self.seq;
                seq.clear();
                seq.extend_from_slice(context);
                let mut token = *context.last().expect("the context holds the last token");
                for i in 0..k {
                    let logits = self.target.exit_step(token)?;
                    token = super::draft_token(sampler, logits, seq, gen_start, i, q);
                    draft.push(token);
                    seq.push(token);
                }
                Ok(sampled)
            }
        }
    }
}

/// Multiply-adds of the matrix products for one token through `layers` layers and a head of
/// `head_rows` tokens.
pub(crate) fn macs_per_token(c: &Config, layers: usize, head_rows: usize) -> f64 {
    let attn = c.n_embd * (2 * c.q_dim() + 2 * c.kv_dim());
    let ffn = 3 * c.n_embd * c.n_ff;
    (layers * (attn + ffn) + c.n_embd * head_rows) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `passes` one-token drafts, a fraction `rate` of them kept (spread evenly).
    fn feed(d: &mut DraftLength, passes: usize, rate: f64) {
        for i in 0..passes {
            let kept = ((i + 1) as f64 * rate).floor() > (i as f64 * rate).floor();
            d.record(1, usize::from(kept));
        }
    }

    /// The draft length follows acceptance and what a pass costs: a one-token draft kept 20%
    /// of the time (estimated 0.25: the prior's two pseudo-tokens at 0.5 beside a decayed
    /// window of ten passes) pays under a flat 0.12 per row (1.25 tokens for 1.16) but not
    /// once the first row costs 0.25 (1.25 for 1.29), where it falls back to plain decoding
    /// with a probe every 16 passes; drafts that are always kept grow to the cap; a fixed
    /// length ignores everything.
    #[test]
    fn draft_length_follows_acceptance_and_pass_cost() {
        let mut flat = DraftLength::new(4, true, 0.04, PassCost::flat(0.12));
        let mut split = DraftLength::new(4, true, 0.04, DEFAULT_PASS_COST);
        feed(&mut flat, 200, 0.2);
        feed(&mut split, 200, 0.2);
        assert_eq!(flat.next_k(), 1);
        let ks: Vec<usize> = (0..PROBE).map(|_| split.next_k()).collect();
        assert!(ks[..PROBE - 1].iter().all(|&k| k == 0), "{ks:?}");
        assert_eq!(ks[PROBE - 1], 1, "a probe after {PROBE} plain passes");

        let mut sure = DraftLength::new(6, true, 0.04, DEFAULT_PASS_COST);
        for _ in 0..50 {
            let k = sure.next_k();
            sure.record(k, k);
        }
        assert_eq!(sure.next_k(), 6);

        let mut fixed = DraftLength::new(3, false, 0.04, DEFAULT_PASS_COST);
        feed(&mut fixed, 100, 0.0);
        assert_eq!(fixed.next_k(), 3);

        assert_eq!(DEFAULT_PASS_COST.rows(0), 0.0);
        assert!((DEFAULT_PASS_COST.rows(3) - 0.49).abs() < 1e-12);
        assert!((LOOKUP_PASS_COST.rows(3) - 0.36).abs() < 1e-12);
    }
}
