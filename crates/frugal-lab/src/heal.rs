//! Healing a candidate by distillation from the base, then storing it again.
//!
//! Every lever that changes the function (pruning, a conversion, a MoE split, a student) loses
//! some quality that training recovers: the candidate learns the base's next-token
//! distribution (KL at τ = 2), AdamW with 5% warmup and a cosine decay to 10%, the gradient
//! clipped at 1, held-out evaluations along the way. Training runs on f32 parameters, so the
//! healed model is re-quantized to a storage format before it is measured like any other.

use anyhow::Result;
use frugal::convert::Target;
use frugal::model::Model;
use frugal_train::Params;
use frugal_train::data::Corpus;
use frugal_train::gemm::{self, Precision};
use frugal_train::loss::Divergence;
use frugal_train::model::RunOptions;
use frugal_train::optim::{AdamWConfig, Schedule};
use frugal_train::teacher::OnlineTeachers;
use frugal_train::trainer::{EvalPoint, Event, LossConfig, LrProbe, Signal, TrainConfig, Trainer};

/// How every training run of one experiment trains.
#[derive(Clone, Copy, Debug)]
pub struct Recovery {
    pub seq: usize,
    pub batch: usize,
    /// The peak learning rate, or the probe's ceiling when `probe` is set.
    pub lr: f32,
    /// Choose the peak rate by measurement before training ([`LrProbe`]), from `lr` down.
    pub probe: Option<LrProbe>,
    /// Held-out evaluations during a run (the curve's points).
    pub points: usize,
    /// Held-out windows per evaluation (0: all).
    pub eval_windows: usize,
    pub seed: u64,
    pub run: RunOptions,
}

/// A finished training run.
pub struct Run {
    /// Held-out evaluations, the first before any step.
    pub history: Vec<EvalPoint>,
    /// The median training throughput over the steps.
    pub tokens_per_s: f64,
    /// The peak learning rate it trained at (the probe's choice when probed).
    pub lr: f32,
    pub params: Params,
}

/// bf16 products where the CPU multiplies bf16 in hardware (twice the f32 rate on AMX and
/// AVX-512 BF16), f32 elsewhere.
pub fn auto_precision() -> Precision {
    if gemm::bf16_backend().starts_with("f32") {
        Precision::F32
    } else {
        Precision::Bf16
    }
}

/// How the reports' runs train: [`auto_precision`], activations kept rather than recomputed
/// (the models are small enough to hold them).
pub fn run_options() -> RunOptions {
    RunOptions {
        precision: auto_precision(),
        recompute: false,
        ..RunOptions::default()
    }
}

/// The distillation loss of a recovery: forward KL at temperature `tau`, no hard labels.
pub fn soft(tau: f32) -> LossConfig {
    LossConfig {
        alpha: 1.0,
        temperature: tau,
        divergence: Divergence::Forward,
        hidden: None,
    }
}

/// Trains `student` as `cfg` says on `data` from `signal` (the soft targets; `eval` scores
/// the held-out KL), keeping its zeros at zero when `keep_sparsity`, at a peak learning rate
/// probed from the configured one down when `probe` is set.
pub fn train(
    student: Params,
    cfg: TrainConfig,
    data: &Corpus,
    (signal, eval): (Signal, Option<&OnlineTeachers>),
    (keep_sparsity, probe): (bool, Option<LrProbe>),
    mut on_event: impl FnMut(Event),
) -> Result<Run> {
    let mut t = Trainer::new(student, cfg, data, signal, eval)?;
    if keep_sparsity {
        t.keep_sparsity();
    }
    if let Some(probe) = probe {
        t.probe_learning_rate(probe, |_| {})?;
    }
    let mut speeds = Vec::new();
    t.run(|e| {
        if let Event::Step(s) = &e {
            speeds.push(s.tokens_per_s);
        }
        on_event(e);
    })?;
    speeds.sort_by(f64::total_cmp);
    Ok(Run {
        history: t.history.clone(),
        tokens_per_s: speeds.get(speeds.len() / 2).copied().unwrap_or(0.0),
        lr: t.cfg.schedule.lr,
        params: t.params,
    })
}

impl Recovery {
    /// Optimizer steps for a budget of `tokens`.
    pub fn steps(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.seq * self.batch)
    }

    /// A run of `steps` steps with `loss` on this recovery's schedule.
    pub fn config(&self, loss: LossConfig, steps: usize) -> TrainConfig {
        TrainConfig {
            seq: self.seq,
            batch: self.batch,
            accum: 1,
            steps,
            schedule: Schedule {
                lr: self.lr,
                warmup: (steps / 20).max(1),
                total: steps,
                min_ratio: 0.1,
            },
            adamw: AdamWConfig::default(),
            clip: 1.0,
            freeze: Vec::new(),
            seed: self.seed,
            run: self.run,
            loss,
            eval_every: (steps / self.points.max(1)).max(1),
            eval_windows: self.eval_windows,
            checkpoint: None,
            save_every: 0,
        }
    }

    /// Distils `student` from `teachers` for `steps` steps (KL at τ = 2).
    pub fn distil(
        &self,
        student: Params,
        steps: usize,
        data: &Corpus,
        teachers: &OnlineTeachers,
        keep_sparsity: bool,
        on_event: impl FnMut(Event),
    ) -> Result<Run> {
        train(
            student,
            self.config(soft(2.0), steps),
            data,
            (Signal::Online(teachers), Some(teachers)),
            (keep_sparsity, self.probe),
            on_event,
        )
    }

    /// `candidate` distilled from `teachers` for `steps` steps, then re-encoded in `format` and
    /// loaded as the reports run candidates ([`crate::build::load`]): the held-out curve and the
    /// healed model.
    pub fn heal(
        &self,
        candidate: &Model,
        steps: usize,
        data: &Corpus,
        teachers: &OnlineTeachers,
        (keep_sparsity, format): (bool, Target),
        on_event: impl FnMut(Event),
    ) -> Result<(Vec<EvalPoint>, Model)> {
        let student = Params::from_model(candidate)?;
        let run = self.distil(student, steps, data, teachers, keep_sparsity, on_event)?;
        let f32_file =
            frugal::gguf::GgufFile::from_bytes(run.params.to_gguf(&candidate.file).to_bytes()?)?;
        let q = crate::build::quantized(&f32_file, format, None)?;
        Ok((run.history, crate::build::load_file(q, false)?))
    }
}
