//! Quality against the base: what a candidate gives up, on the same text and the same windows.
//!
//! Both models score every window in one pass (`frugal::eval::compare_with`), and the
//! candidate's next-token distribution is compared with the base's at every scored position:
//! KL(base ‖ candidate) in nats (mean and 99th percentile, the tail that averages hide), the
//! share of positions where both put the same token first, and the perplexity of each.

use anyhow::Result;
use frugal::eval::{self, EvalOptions};
use frugal::model::Model;

/// A candidate measured against its base.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Quality {
    pub ppl: f64,
    pub ppl_stderr: f64,
    pub base_ppl: f64,
    /// Mean over positions of KL(base ‖ candidate), nats.
    pub kl_mean: f64,
    /// Standard error of `kl_mean` (the measurement's noise).
    pub kl_stderr: f64,
    /// 99th percentile of the per-position KL.
    pub kl_p99: f64,
    /// Fraction of positions where both put the same token first.
    pub top1: f64,
    pub positions: usize,
}

impl Quality {
    /// The perplexity's relative change from the base's (0.05: 5% higher).
    pub fn ppl_change(&self) -> f64 {
        self.ppl / self.base_ppl - 1.0
    }
}

/// `candidate` against `base` on `tokens` in windows of `ctx` (default cache and attention for
/// both; each model's own activation precision).
pub fn against(candidate: &Model, base: &Model, tokens: &[u32], ctx: usize) -> Result<Quality> {
    let d = EvalOptions::default();
    against_with((candidate, &d), (base, &d), tokens, ctx)
}

/// [`against`], each model run with its own options (the two may be one model run two ways).
pub fn against_with(
    candidate: (&Model, &EvalOptions),
    base: (&Model, &EvalOptions),
    tokens: &[u32],
    ctx: usize,
) -> Result<Quality> {
    let c = eval::compare_with(candidate, base, tokens, ctx, |_, _| {})?;
    Ok(Quality {
        ppl: c.model.ppl,
        ppl_stderr: c.model.ppl_stderr,
        base_ppl: c.reference.ppl,
        kl_mean: c.kl_mean,
        kl_stderr: c.kl_stderr,
        kl_p99: c.kl_p99,
        top1: c.top1_agreement,
        positions: c.positions,
    })
}
