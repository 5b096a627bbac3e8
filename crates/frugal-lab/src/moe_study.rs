//! Mixture of experts made from a dense model, measured in one run: the study behind
//! `frugal report moe` (`docs/moe.md`). Three parts:
//! 1. the variants as [`Variant::build`] makes them: parameters, quality and routing load
//!    against the dense model, and speed timed back to back with it;
//! 2. one variant's routers trained under each balancing mode ([`crate::router`]): the
//!    busiest expert's load step by step (the collapse and its cure) and the quality after;
//! 3. whole MoE models distilled from the dense one (experts, routers and the rest trained
//!    together), with and without the Switch balancing loss.

use std::time::Instant;

use anyhow::Result;
use frugal::convert::Target;
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal_train::data::Corpus;
use frugal_train::model::RunOptions;
use frugal_train::router::{Balance, StepReport, Teacher};
use frugal_train::teacher::OnlineTeachers;

use crate::build;
use crate::heal::Recovery;
use crate::moe::{MoeQuality, Variant, measure};
use crate::progress::{self, OnProgress, Progress};
use crate::router::{self, Phase};
use crate::timing::{self, Paired, Speed, SpeedTest};

/// The dense model and the texts every part reads.
pub struct Inputs<'a> {
    /// The dense model (8-bit activations).
    pub dense: &'a Model,
    /// What the co-activation split, the fitted routers and the shared expert read.
    pub calib: &'a [u32],
    /// Held-out text of every perplexity, KL and routing load, in windows of `ctx`.
    pub eval: &'a [u32],
    pub ctx: usize,
    pub seed: u64,
}

/// Part 2: router training on one variant, once per balancing mode.
pub struct Balancing<'a> {
    pub on: Variant,
    pub modes: Vec<Balance>,
    /// The text the routers train on, in windows of the study's `ctx`.
    pub text: &'a [u32],
    /// Tokens per mode (0 skips the part).
    pub tokens: usize,
    /// Tokens per step: a whole number of windows.
    pub batch: usize,
    pub lr: f32,
}

/// Part 3: whole-model distillation of each variant, once per balancing-loss weight.
pub struct Distilling<'a> {
    pub variants: Vec<Variant>,
    /// Switch balancing-loss weights (0: none).
    pub aux: Vec<f32>,
    /// Distillation tokens per run.
    pub tokens: usize,
    pub data: &'a Corpus,
    pub recovery: Recovery,
}

/// What the study builds and runs.
pub struct Plan<'a> {
    pub variants: Vec<Variant>,
    /// Each turn's speed test; every variant takes `reps` turns, each right after the dense
    /// model.
    pub speed: SpeedTest,
    pub reps: usize,
    pub balancing: Option<Balancing<'a>>,
    pub distilling: Option<Distilling<'a>>,
}

/// A variant as built, with its speed against the dense model.
#[derive(Clone, Debug)]
pub struct VariantRow {
    pub variant: Variant,
    pub total: u64,
    pub active: u64,
    /// Share of the dense FFN's neurons a token runs.
    pub active_ffn: f64,
    pub q: MoeQuality,
    pub speed: Paired,
}

/// A router-training run of one balancing mode.
#[derive(Clone, Debug)]
pub struct BalanceRow {
    pub balance: Balance,
    pub steps: Vec<StepReport>,
    /// Means over the first and the last quarter of the steps.
    pub first: Phase,
    pub last: Phase,
    /// On the evaluation text, after training.
    pub q: MoeQuality,
    pub seconds: f64,
}

/// A whole-model distillation of one variant.
#[derive(Clone, Debug)]
pub struct DistillRow {
    pub variant: Variant,
    /// Weight of the Switch balancing loss during the run.
    pub aux: f32,
    pub before: MoeQuality,
    pub after: MoeQuality,
    pub tokens: usize,
    pub seconds: f64,
}

/// What the study measured.
pub struct Study {
    /// The dense model against itself (its perplexity; the rest zero).
    pub dense: MoeQuality,
    /// The dense model's median speed over its turns as the baseline.
    pub dense_speed: Speed,
    pub variants: Vec<VariantRow>,
    pub balance: Vec<BalanceRow>,
    pub distill: Vec<DistillRow>,
}

/// Runs the three parts of `plan` on `inputs.dense`.
pub fn run(plan: &Plan, inputs: &Inputs, progress: OnProgress) -> Result<Study> {
    let dense = measure(inputs.dense, inputs.dense, inputs.eval, inputs.ctx)?;
    let mut built = build_variants(inputs, &plan.variants, progress)?;
    let names: Vec<&str> = plan.variants.iter().map(|v| v.spec.as_str()).collect();
    let test = (&plan.speed, plan.reps);
    let (speeds, dense_speed) = time_variants(inputs.dense, &built.models, test, &names, progress)?;
    for (r, s) in built.rows.iter_mut().zip(speeds) {
        r.speed = s;
    }
    let balance = match &plan.balancing {
        Some(b) if !b.modes.is_empty() && b.tokens > 0 => {
            progress(Progress::Line(format!("router training on {}", b.on.spec)));
            let student = built.load(inputs, &b.on)?;
            balancing(inputs, &student, b, progress)?
        }
        _ => Vec::new(),
    };
    let distill = match &plan.distilling {
        Some(d) if d.tokens > 0 && !d.variants.is_empty() => {
            distilling(inputs, &built, d, progress)?
        }
        _ => Vec::new(),
    };
    Ok(Study {
        dense,
        dense_speed,
        variants: built.rows,
        balance,
        distill,
    })
}

/// Part 1's variants as built and measured, and their models (for the later parts to reuse).
struct Built {
    /// Their speed is filled in by [`time_variants`].
    rows: Vec<VariantRow>,
    models: Vec<Model>,
}

impl Built {
    /// `v`'s model: reloaded from its bytes when part 1 built it (a co-activation split takes a
    /// minute), built otherwise.
    fn load(&self, inputs: &Inputs, v: &Variant) -> Result<Model> {
        match self.rows.iter().position(|r| &r.variant == v) {
            Some(k) => build::load(self.models[k].file.raw_bytes().to_vec(), false),
            None => {
                let i = inputs;
                let calib_ctx = 512.min(i.calib.len());
                build::load(v.build(i.dense, i.calib, calib_ctx, i.seed)?.bytes, false)
            }
        }
    }
}

/// Builds and measures every variant (speed left for [`time_variants`]).
fn build_variants(inputs: &Inputs, variants: &[Variant], progress: OnProgress) -> Result<Built> {
    let calib_ctx = 512.min(inputs.calib.len());
    let mut rows = Vec::new();
    let mut models = Vec::new();
    for v in variants {
        progress(Progress::Line(format!(
            "building {} ({})",
            v.spec,
            v.describe()
        )));
        let b = v.build(inputs.dense, inputs.calib, calib_ctx, inputs.seed)?;
        let m = build::load(b.bytes, false)?;
        let q = measure(&m, inputs.dense, inputs.eval, inputs.ctx)?;
        progress(Progress::Line(format!(
            "  {:.1}M of {:.1}M parameters active, PPL {:.2}, KL {:.3}, busiest {:.2}x",
            b.report.active_params as f64 / 1e6,
            b.report.total_params as f64 / 1e6,
            q.ppl,
            q.kl,
            q.busiest
        )));
        rows.push(VariantRow {
            variant: v.clone(),
            total: b.report.total_params,
            active: b.report.active_params,
            active_ffn: b.active_ffn,
            q,
            speed: Paired {
                speed: Speed::default(),
                vs_base: Speed::default(),
            },
        });
        models.push(m);
    }
    Ok(Built { rows, models })
}

/// Prefill and decode of every model of `models` against `dense`, timed back to back (the
/// dense model right before each) for `reps` rounds; each ratio is the median of those pairs.
/// Returns each model's speeds and the dense model's median speed. `names` name the models in
/// progress lines.
pub fn time_variants(
    dense: &Model,
    models: &[Model],
    (test, reps): (&SpeedTest, usize),
    names: &[&str],
    progress: OnProgress,
) -> Result<(Vec<Paired>, Speed)> {
    let n = models.len();
    let timed = timing::back_to_back(
        n,
        reps,
        |_| Some(n),
        |i| test.measure(models.get(i).unwrap_or(dense)),
        |t| {
            let (p, tg, v) = (
                t.speed.prefill,
                t.speed.decode,
                t.vs_base.unwrap_or_default(),
            );
            progress(Progress::Line(format!(
                "speed, run {}: {}: pp {p:.1} tg {tg:.1} ({:.2}x, {:.2}x the dense model)",
                t.round + 1,
                names[t.candidate],
                v.prefill,
                v.decode
            )));
        },
    )?;
    let dense_speed = timed.baseline(n);
    Ok((timed.candidates, dense_speed))
}

/// Part 2: `student`'s routers trained against the dense FFN under each mode of `b`, each run
/// from the same start, then measured on the evaluation text.
pub fn balancing(
    inputs: &Inputs,
    student: &Model,
    b: &Balancing,
    progress: OnProgress,
) -> Result<Vec<BalanceRow>> {
    let teacher = Teacher::new(inputs.dense, student)?;
    let mut rows = Vec::new();
    for &balance in &b.modes {
        let plan = router::Plan {
            ctx: inputs.ctx,
            batch: b.batch,
            tokens: b.tokens,
            balance,
            lr: b.lr,
            recon: 1.0,
        };
        let t0 = Instant::now();
        let steps = plan.steps();
        let (tr, reports) = router::train_routers(student, &teacher, b.text, &plan, |i, r| {
            progress(Progress::Status(format!(
                "  {balance}: step {}/{steps}, busiest {:.2}x",
                i + 1,
                r.max_over_mean
            )));
            Ok(())
        })?;
        let seconds = t0.elapsed().as_secs_f64();
        let used = (steps * b.batch) as u64;
        let m = build::load(tr.to_gguf(&student.file, used).to_bytes()?, false)?;
        let q = measure(&m, inputs.dense, inputs.eval, inputs.ctx)?;
        progress(Progress::Line(format!(
            "  {balance}: PPL {:.2}, busiest {:.2}x on the text",
            q.ppl, q.busiest
        )));
        let (first, last) = router::quarters(&reports);
        rows.push(BalanceRow {
            balance,
            first,
            last,
            steps: reports,
            q,
            seconds,
        });
    }
    Ok(rows)
}

/// Part 3: every variant of `d` distilled from the dense model once per balancing-loss weight,
/// re-encoded in Q8_0 and measured (its quality as built taken from part 1 when measured
/// there).
fn distilling(
    inputs: &Inputs,
    built: &Built,
    d: &Distilling,
    progress: OnProgress,
) -> Result<Vec<DistillRow>> {
    let teachers = OnlineTeachers {
        models: vec![(
            build::load(inputs.dense.file.raw_bytes().to_vec(), false)?,
            1.0,
        )],
    };
    let steps = d.recovery.steps(d.tokens);
    let q8 = Target::Stored(GgmlType::Q8_0);
    let runs = d
        .variants
        .iter()
        .flat_map(|v| d.aux.iter().map(move |&x| (v, x)));
    let mut rows = Vec::new();
    for (v, aux) in runs {
        progress(Progress::Line(format!(
            "distilling {} ({steps} steps, aux {aux})",
            v.spec
        )));
        let recovery = Recovery {
            run: RunOptions {
                moe_aux: aux,
                ..d.recovery.run
            },
            ..d.recovery
        };
        let m = built.load(inputs, v)?;
        let before = match built.rows.iter().find(|r| &r.variant == v) {
            Some(r) => r.q,
            None => measure(&m, inputs.dense, inputs.eval, inputs.ctx)?,
        };
        let t0 = Instant::now();
        let on_event = progress::training(&mut *progress, steps);
        let (_, h) = recovery.heal(&m, steps, d.data, &teachers, (false, q8), on_event)?;
        let seconds = t0.elapsed().as_secs_f64();
        let after = measure(&h, inputs.dense, inputs.eval, inputs.ctx)?;
        progress(Progress::Line(format!(
            "  PPL {:.2} -> {:.2}",
            before.ppl, after.ppl
        )));
        rows.push(DistillRow {
            variant: v.clone(),
            aux,
            before,
            after,
            tokens: steps * d.recovery.seq * d.recovery.batch,
            seconds,
        });
    }
    Ok(rows)
}
