//! Router training: a MoE model's routers learn to imitate the dense FFN its experts came from
//! (the teacher), experts frozen, with no balancing, the Switch auxiliary loss or DeepSeek's
//! selection bias (`frugal_train::router`); here the run over a text and the routing it
//! reached early and late.

use anyhow::{Result, ensure};
use frugal::model::Model;
use frugal_train::router::{Balance, RouterConfig, RouterTrainer, StepReport, Teacher};

/// The routing statistics averaged over a stretch of steps.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Phase {
    pub rel_err: f64,
    /// Share of the chosen experts in their token's oracle set.
    pub oracle_hit: f64,
    pub cv: f64,
    pub max_over_mean: f64,
    pub worst_max_over_mean: f64,
    pub entropy: f64,
}

/// The means of `r`'s statistics.
pub fn phase(r: &[StepReport]) -> Phase {
    let n = r.len().max(1) as f64;
    let mean = |f: fn(&StepReport) -> f64| r.iter().map(f).sum::<f64>() / n;
    Phase {
        rel_err: mean(|s| s.rel_err),
        oracle_hit: mean(|s| s.oracle_hit),
        cv: mean(|s| s.cv),
        max_over_mean: mean(|s| s.max_over_mean),
        worst_max_over_mean: mean(|s| s.worst_max_over_mean),
        entropy: mean(|s| s.entropy),
    }
}

/// The means over the first and the last quarter of the steps: collapse (or its cure) shows as
/// the busiest expert's load moving between them.
pub fn quarters(r: &[StepReport]) -> (Phase, Phase) {
    let q = (r.len() / 4).max(1);
    (
        phase(&r[..q.min(r.len())]),
        phase(&r[r.len().saturating_sub(q)..]),
    )
}

/// A router-training run: windows of `ctx` tokens, `batch` tokens per step, `tokens` in all.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub ctx: usize,
    pub batch: usize,
    pub tokens: usize,
    pub balance: Balance,
    pub lr: f32,
    /// Weight of the reconstruction term (the chosen experts' weights) against the selection
    /// cross-entropy.
    pub recon: f32,
}

impl Plan {
    pub fn steps(&self) -> usize {
        self.tokens.div_ceil(self.batch).max(1)
    }
}

/// Trains `student`'s routers against `teacher` on `ids` (cut into windows, repeated when the
/// text is shorter than the run), calling `on_step` after each step.
pub fn train_routers(
    student: &Model,
    teacher: &Teacher,
    ids: &[u32],
    plan: &Plan,
    mut on_step: impl FnMut(usize, &StepReport) -> Result<()>,
) -> Result<(RouterTrainer, Vec<StepReport>)> {
    ensure!(
        ids.len() >= plan.ctx,
        "the text holds {} tokens, less than one window of {}",
        ids.len(),
        plan.ctx
    );
    let windows: Vec<&[u32]> = ids.chunks_exact(plan.ctx).collect();
    let per_step = plan.batch / plan.ctx;
    let steps = plan.steps();
    let mut tr = RouterTrainer::new(
        student,
        &RouterConfig {
            balance: plan.balance,
            lr: plan.lr,
            steps,
            warmup: (steps / 20).max(1),
            recon: plan.recon,
        },
    )?;
    let mut reports = Vec::with_capacity(steps);
    for step in 0..steps {
        let batch: Vec<&[u32]> = (0..per_step)
            .map(|i| windows[(step * per_step + i) % windows.len()])
            .collect();
        let acts = teacher.activations(&batch)?;
        let r = tr.step(&acts.inputs, &acts.targets)?;
        on_step(step, &r)?;
        reports.push(r);
    }
    Ok((tr, reports))
}
