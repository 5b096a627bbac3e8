//! `frugal report moe`: mixture of experts, measured in one run on one model (`docs/moe.md`).
//!
//! Three parts. (1) The dense model and its MoE variants as `moefy` builds them (E experts,
//! top-k, the neuron split, a shared expert, an upcycled copy): total and active parameters,
//! perplexity and KL to the dense model, the routing's load, and prefill and decode speed
//! against the dense model in the same run. (2) Router training on one variant under each
//! balancing mode: the busiest expert's load step by step (the collapse and its cure) and the
//! quality after. (3) Distillation of whole MoE models from the dense one (experts, routers
//! and the rest trained together), at a stated token budget.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use frugal::convert::Target;
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;
use frugal_lab::build;
use frugal_lab::heal::{self, Recovery};
use frugal_lab::moe::{MoeQuality, Variant, measure};
use frugal_lab::router::{Phase, Plan, quarters, train_routers};
use frugal_lab::timing::{self, SpeedTest};
use frugal_train::data::corpus_from_files;
use frugal_train::model::RunOptions;
use frugal_train::router::{Balance, StepReport, Teacher};
use frugal_train::teacher::OnlineTeachers;

use super::bench::plot::{self, Chart, Series};
use super::common::{self, ModelArgs};
use super::train::parse_count;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Calibration text: the co-activation split, the fitted router, the shared expert
    #[arg(long)]
    pub calibration: PathBuf,
    #[arg(long = "calibration-tokens", default_value_t = 2048)]
    pub calibration_tokens: usize,
    /// Held-out text every perplexity, KL and routing load is measured on
    #[arg(long)]
    pub text: PathBuf,
    #[arg(long = "ctx", default_value_t = 256)]
    pub ctx: usize,
    /// Tokens of --text evaluated
    #[arg(long = "eval-tokens", default_value_t = 2048)]
    pub eval_tokens: usize,
    /// Variants: EXK (E experts, top-K, co-activation split, fitted router), EXKw (k-means on
    /// the weights, centroid router: no data), sN+EXK (N neurons kept as a shared expert),
    /// upEXK (E copies of the FFN, top-K)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8x1,8x2,8x4,16x2,16x4,8x2w,s512+8x2,up4x1"
    )]
    pub variants: Vec<String>,
    /// Text the routers train on and distillation reads (the last --heldout of it held out)
    #[arg(long = "data", num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    #[arg(long = "heldout", default_value_t = 0.1)]
    pub heldout: f64,
    /// The variant whose routers train under each balancing mode
    #[arg(long = "balance-on", default_value = "s512+8x2")]
    pub balance_on: String,
    /// Balancing modes compared (as `train-router --balance`)
    #[arg(
        long = "balance",
        value_delimiter = ',',
        default_value = "none,aux:1,aux:3,bias:0.0001,bias:0.0003,bias:0.001"
    )]
    pub balance: Vec<Balance>,
    /// Router-training tokens per mode (k/M suffixes)
    #[arg(long = "router-tokens", default_value = "24k")]
    pub router_tokens: String,
    #[arg(long = "router-batch", default_value_t = 256)]
    pub router_batch: usize,
    #[arg(long = "router-lr", default_value_t = 1e-4)]
    pub router_lr: f32,
    /// Variants distilled as whole models from the dense one (0 tokens skips)
    #[arg(
        long = "distill",
        value_delimiter = ',',
        default_value = "8x2,s512+8x2"
    )]
    pub distill: Vec<String>,
    /// Distillation tokens per variant (k/M suffixes)
    #[arg(long = "distill-tokens", default_value = "32k")]
    pub distill_tokens: String,
    #[arg(long = "seq", default_value_t = 256)]
    pub seq: usize,
    #[arg(long = "batch", default_value_t = 8)]
    pub batch: usize,
    #[arg(long = "lr", default_value_t = 1e-3)]
    pub lr: f32,
    /// Switch balancing-loss weights distillation runs with (0: none), one run per weight and
    /// variant
    #[arg(long = "distill-aux", value_delimiter = ',', default_value = "0,1")]
    pub distill_aux: Vec<f32>,
    /// Prefill tokens of the speed test
    #[arg(short = 'p', long = "prompt", default_value_t = 256)]
    pub prompt: usize,
    /// Decode tokens of the speed test
    #[arg(short = 'n', long = "gen", default_value_t = 64)]
    pub gen_tokens: usize,
    /// Repetitions of each speed test (the median of back-to-back ratios is reported)
    #[arg(long = "reps", default_value_t = 3)]
    pub reps: usize,
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Where the report (moe.md) and its charts go
    #[arg(long = "out", default_value = "docs")]
    pub out: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// A variant as built, with its speed against the dense model.
struct VariantRow {
    variant: Variant,
    total: u64,
    active: u64,
    active_ffn: f64,
    q: MoeQuality,
    pp: f64,
    tg: f64,
    vs_pp: f64,
    vs_tg: f64,
}

/// A router-training run of one balancing mode.
struct BalanceRow {
    balance: Balance,
    steps: Vec<StepReport>,
    first: Phase,
    last: Phase,
    q: MoeQuality,
    seconds: f64,
}

/// A whole-model distillation of one variant.
struct DistillRow {
    variant: Variant,
    /// Weight of the Switch balancing loss during the run.
    aux: f32,
    before: MoeQuality,
    after: MoeQuality,
    tokens: usize,
    seconds: f64,
}

pub fn run(a: Args) -> Result<()> {
    frugal_train::keep_freed_memory();
    let variants: Vec<Variant> = a
        .variants
        .iter()
        .map(|s| s.parse().map_err(anyhow::Error::msg))
        .collect::<Result<_>>()?;
    let balance_on: Variant = a.balance_on.parse().map_err(anyhow::Error::msg)?;
    let distill: Vec<Variant> = a
        .distill
        .iter()
        .map(|s| s.parse().map_err(anyhow::Error::msg))
        .collect::<Result<_>>()?;
    let path = common::model_path(&a.model)?;
    let mut dense = Model::from_file(GgufFile::from_bytes(std::fs::read(&path)?)?)?;
    ensure!(
        dense.config.moe.is_none(),
        "{} is already a MoE model: report moe starts from a dense one",
        path.display()
    );
    dense.set_activations(Activations::Q8);
    let tok = Tokenizer::from_gguf(&dense.file)?;
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let mut calib = tok.encode(&read(&a.calibration)?, false)?;
    calib.truncate(a.calibration_tokens);
    let calib_ctx = 512.min(calib.len());
    let mut eval_ids = tok.encode(&read(&a.text)?, false)?;
    eval_ids.truncate(a.eval_tokens);
    ensure!(
        eval_ids.len() > a.ctx,
        "--text holds {} tokens, fewer than one window of {}",
        eval_ids.len(),
        a.ctx
    );
    let dense_q = measure(&dense, &dense, &eval_ids, a.ctx)?;

    // 1. The variants as built.
    let mut rows = Vec::new();
    let mut models = Vec::new();
    for v in &variants {
        eprintln!("building {} ({})", v.spec, v.describe());
        let b = v.build(&dense, &calib, calib_ctx, a.seed)?;
        let m = build::load(b.bytes, false)?;
        let q = measure(&m, &dense, &eval_ids, a.ctx)?;
        eprintln!(
            "  {:.1}M of {:.1}M parameters active, PPL {:.2}, KL {:.3}, busiest {:.2}x",
            b.report.active_params as f64 / 1e6,
            b.report.total_params as f64 / 1e6,
            q.ppl,
            q.kl,
            q.busiest
        );
        rows.push(VariantRow {
            variant: v.clone(),
            total: b.report.total_params,
            active: b.report.active_params,
            active_ffn: b.active_ffn,
            q,
            pp: 0.0,
            tg: 0.0,
            vs_pp: 1.0,
            vs_tg: 1.0,
        });
        models.push(m);
    }
    let dense_speed = time_variants(&a, &dense, &models, &mut rows)?;

    // A variant measured above is reloaded from its bytes, not rebuilt (a co-activation split
    // takes a minute).
    let rebuild = |v: &Variant| -> Result<Model> {
        match variants.iter().position(|x| x == v) {
            Some(i) => build::load(models[i].file.raw_bytes().to_vec(), false),
            None => build::load(v.build(&dense, &calib, calib_ctx, a.seed)?.bytes, false),
        }
    };

    // 2. Router training under each balancing mode.
    let train_text: String = a
        .data
        .iter()
        .map(|p| read(p))
        .collect::<Result<Vec<_>>>()?
        .join("\n");
    let train_ids = tok.encode(&train_text, false)?;
    let router_tokens = parse_count(&a.router_tokens)?;
    ensure!(
        a.router_batch >= a.ctx && a.router_batch.is_multiple_of(a.ctx),
        "--router-batch {} must be a whole number of --ctx {} windows",
        a.router_batch,
        a.ctx
    );
    let mut balance_rows = Vec::new();
    let balance_model = if a.balance.is_empty() || router_tokens == 0 {
        None
    } else {
        eprintln!("router training on {}", balance_on.spec);
        Some(rebuild(&balance_on)?)
    };
    if let Some(student) = &balance_model {
        let teacher = Teacher::new(&dense, student)?;
        for &balance in &a.balance {
            let plan = Plan {
                ctx: a.ctx,
                batch: a.router_batch,
                tokens: router_tokens,
                balance,
                lr: a.router_lr,
                recon: 1.0,
            };
            let t0 = std::time::Instant::now();
            let steps = plan.steps();
            let (tr, reports) = train_routers(student, &teacher, &train_ids, &plan, |i, r| {
                eprint!(
                    "\r  {balance}: step {}/{steps}, busiest {:.2}x   ",
                    i + 1,
                    r.max_over_mean
                );
                Ok(())
            })?;
            let seconds = t0.elapsed().as_secs_f64();
            let used = (steps * a.router_batch) as u64;
            let m = build::load(tr.to_gguf(&student.file, used).to_bytes()?, false)?;
            let q = measure(&m, &dense, &eval_ids, a.ctx)?;
            eprintln!(
                "\r  {balance}: PPL {:.2}, busiest {:.2}x on the text",
                q.ppl, q.busiest
            );
            let (first, last) = quarters(&reports);
            balance_rows.push(BalanceRow {
                balance,
                first,
                last,
                steps: reports,
                q,
                seconds,
            });
        }
    }

    // 3. Distillation of whole MoE models.
    let distill_tokens = parse_count(&a.distill_tokens)?;
    let mut distill_rows = Vec::new();
    if distill_tokens > 0 && !distill.is_empty() {
        let data = corpus_from_files(&tok, &a.data, a.seq, a.heldout)?;
        let teachers = OnlineTeachers {
            models: vec![(build::load(dense.file.raw_bytes().to_vec(), false)?, 1.0)],
        };
        let recovery = Recovery {
            seq: a.seq,
            batch: a.batch,
            lr: a.lr,
            points: 4,
            eval_windows: 16,
            seed: a.seed,
            run: heal::run_options(),
        };
        let steps = recovery.steps(distill_tokens);
        let q8: Target = "q8_0".parse().map_err(anyhow::Error::msg)?;
        for (v, &aux) in distill
            .iter()
            .flat_map(|v| a.distill_aux.iter().map(move |x| (v, x)))
        {
            eprintln!("distilling {} ({steps} steps, aux {aux})", v.spec);
            let recovery = Recovery {
                run: RunOptions {
                    moe_aux: aux,
                    ..recovery.run
                },
                ..recovery
            };
            let m = rebuild(v)?;
            let before = match rows.iter().find(|r| &r.variant == v) {
                Some(r) => r.q,
                None => measure(&m, &dense, &eval_ids, a.ctx)?,
            };
            let t0 = std::time::Instant::now();
            let progress = common::training_progress(steps);
            let (_, h) = recovery.heal(&m, steps, &data, &teachers, (false, q8), progress)?;
            let seconds = t0.elapsed().as_secs_f64();
            let after = measure(&h, &dense, &eval_ids, a.ctx)?;
            eprintln!("  PPL {:.2} -> {:.2}", before.ppl, after.ppl);
            distill_rows.push(DistillRow {
                variant: v.clone(),
                aux,
                before,
                after,
                tokens: steps * a.seq * a.batch,
                seconds,
            });
        }
    }

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let charts = write_charts(&rows, &balance_rows, &distill_rows, &a.out.join("moe"));
    let md = report(
        &a,
        &path.display().to_string(),
        (&dense_q, dense_speed),
        &rows,
        (&balance_on, &balance_rows),
        &distill_rows,
        &charts,
    );
    let out = a.out.join("moe.md");
    std::fs::write(&out, md).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

/// Prefill and decode of every variant against the dense model, timed back to back (the dense
/// model right before each variant) and repeated; each ratio is the median of those pairs.
/// Returns the dense model's median speeds.
fn time_variants(
    a: &Args,
    dense: &Model,
    models: &[Model],
    rows: &mut [VariantRow],
) -> Result<(f64, f64)> {
    let test = SpeedTest::once(a.prompt, a.gen_tokens);
    let n = models.len();
    let timed = timing::back_to_back(
        n,
        a.reps,
        |_| Some(n),
        |i| test.measure(models.get(i).unwrap_or(dense)),
        |t| {
            let (p, tg, v) = (
                t.speed.prefill,
                t.speed.decode,
                t.vs_base.unwrap_or_default(),
            );
            eprintln!(
                "speed, run {}: {}: pp {p:.1} tg {tg:.1} ({:.2}x, {:.2}x the dense model)",
                t.round + 1,
                rows[t.candidate].variant.spec,
                v.prefill,
                v.decode
            );
        },
    )?;
    for (r, t) in rows.iter_mut().zip(&timed.candidates) {
        (r.pp, r.tg) = (t.speed.prefill, t.speed.decode);
        (r.vs_pp, r.vs_tg) = (t.vs_base.prefill, t.vs_base.decode);
    }
    let d = timed.baseline(n);
    Ok((d.prefill, d.decode))
}

fn write_charts(
    rows: &[VariantRow],
    balance: &[BalanceRow],
    distill: &[DistillRow],
    dir: &Path,
) -> String {
    let collapse = Chart {
        title: "Busiest expert over the mean load while the routers train".into(),
        x_desc: "step",
        y_desc: "busiest / mean (mean over layers)",
        series: balance
            .iter()
            .map(|b| Series {
                name: b.balance.to_string(),
                points: b
                    .steps
                    .iter()
                    .map(|s| (s.step as f64 + 1.0, s.max_over_mean))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.1}"),
    };
    let mut quality_series = vec![Series {
        name: "as built".into(),
        points: rows
            .iter()
            .map(|r| (r.active as f64 / 1e6, r.q.kl))
            .collect(),
    }];
    let mut alphas: Vec<f32> = distill.iter().map(|d| d.aux).collect();
    alphas.sort_by(f32::total_cmp);
    alphas.dedup();
    for alpha in alphas {
        quality_series.push(Series {
            name: format!("distilled, balancing α = {alpha}"),
            points: distill
                .iter()
                .filter(|d| d.aux == alpha)
                .filter_map(|d| {
                    rows.iter()
                        .find(|r| r.variant == d.variant)
                        .map(|r| (r.active as f64 / 1e6, d.after.kl))
                })
                .collect(),
        });
    }
    let mut quality = Chart {
        title: "KL to the dense model against active parameters".into(),
        x_desc: "active parameters per token (M)",
        y_desc: "mean KL (nats)",
        series: quality_series,
        y_fmt: |v| {
            if v < 0.1 {
                format!("{v:.3}")
            } else {
                format!("{v:.1}")
            }
        },
    };
    let mut speed = Chart {
        title: "Decode speed against active parameters".into(),
        x_desc: "active parameters per token (M)",
        y_desc: "decode tok/s over the dense model",
        series: vec![Series {
            name: "MoE variants".into(),
            points: rows
                .iter()
                .map(|r| (r.active as f64 / 1e6, r.vs_tg))
                .collect(),
        }],
        y_fmt: |v| format!("{v:.2}"),
    };
    // Several variants share an active size (8x2 and 16x4): points in order of x, so each
    // series is drawn as one line left to right.
    for series in quality.series.iter_mut().chain(speed.series.iter_mut()) {
        series
            .points
            .sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    }
    plot::embed(
        &[
            (
                &collapse,
                "balance",
                "busiest expert load per step, per balancing mode",
            ),
            (&quality, "kl-vs-active", "KL against active parameters"),
            (
                &speed,
                "decode-vs-active",
                "decode speed against active parameters",
            ),
        ],
        dir,
        "moe",
    )
}

fn report(
    a: &Args,
    model: &str,
    (dense_q, (dense_pp, dense_tg)): (&MoeQuality, (f64, f64)),
    rows: &[VariantRow],
    (balance_on, balance): (&Variant, &[BalanceRow]),
    distill: &[DistillRow],
    charts: &str,
) -> String {
    let mut s = String::new();
    let files = |v: &[PathBuf]| {
        v.iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    };
    let _ = writeln!(s, "# Mixture of experts, measured\n");
    let _ = writeln!(
        s,
        "Generated by `frugal report moe --calibration {} --text {} --ctx {} --eval-tokens {} --variants {} --data {} --balance-on {} --balance {} --router-tokens {} --distill {} --distill-tokens {} --lr {} --seed {}` on {model} ({} threads). Do not edit: rerun the command.\n",
        a.calibration.display(),
        a.text.display(),
        a.ctx,
        a.eval_tokens,
        a.variants.join(","),
        files(&a.data),
        a.balance_on,
        a.balance
            .iter()
            .map(|b| b.to_string())
            .collect::<Vec<_>>()
            .join(","),
        a.router_tokens,
        a.distill.join(","),
        a.distill_tokens,
        a.lr,
        a.seed,
        rayon::current_num_threads(),
    );
    let _ = writeln!(
        s,
        "Every variant is built from the dense model by `frugal moefy` ({} calibration tokens of `{}`). Perplexity, KL(dense ‖ variant) and the routing load are measured on {} tokens of `{}` in windows of {} (8-bit activations). *Busiest* is the busiest expert's share of the routed slots over the mean share (1 when balanced, at most E/k), the mean over the layers, and the worst layer; *active FFN* the share of the dense FFN's neurons a token runs. Speed: prefill of {} tokens and decode of {} tokens, each variant timed right after the dense model, {} times; the ratio is the median of those back-to-back ratios.\n",
        a.calibration_tokens,
        a.calibration.display(),
        a.eval_tokens,
        a.text.display(),
        a.ctx,
        a.prompt,
        a.gen_tokens,
        a.reps,
    );
    let _ = writeln!(s, "## The variants as built\n");
    let _ = writeln!(
        s,
        "| model | active FFN | parameters | active / token | PPL | KL | busiest (worst layer) | load CV | prefill tok/s | vs dense | decode tok/s | vs dense |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let _ = writeln!(
        s,
        "| dense | 100% | - | - | {:.2} | 0 | - | - | {dense_pp:.1} | 1.00x | {dense_tg:.1} | 1.00x |",
        dense_q.ppl
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} | {:.1}% | {:.1}M | {:.1}M | {} | {:.3} | {:.2}x ({:.2}x) | {:.2} | {:.1} | {:.2}x | {:.1} | {:.2}x |",
            r.variant.describe(),
            100.0 * r.active_ffn,
            r.total as f64 / 1e6,
            r.active as f64 / 1e6,
            fmt_ppl(r.q.ppl),
            r.q.kl,
            r.q.busiest,
            r.q.worst,
            r.q.cv,
            r.pp,
            r.vs_pp,
            r.tg,
            r.vs_tg,
        );
    }
    let _ = writeln!(s);
    if !balance.is_empty() {
        let steps = balance[0].steps.len();
        let _ = writeln!(s, "## Router training and load balancing\n");
        let _ = writeln!(
            s,
            "The routers of **{}** trained with `frugal train-router` ({steps} steps of {} tokens of --data, lr {}, experts frozen, the dense model's FFN input and output as teacher), once per balancing mode. *During training*: means over the first and the last quarter of the steps, on the training text. *After*: on the evaluation text.\n",
            balance_on.describe(),
            a.router_batch,
            a.router_lr,
        );
        let _ = writeln!(
            s,
            "| balance | busiest, first → last quarter | worst layer, last | share of the dense output missed | PPL after | KL after | busiest after (worst layer) | load CV after | seconds |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for b in balance {
            let _ = writeln!(
                s,
                "| {} | {:.2}x → {:.2}x | {:.2}x | {:.3} → {:.3} | {} | {:.3} | {:.2}x ({:.2}x) | {:.2} | {:.0} |",
                b.balance,
                b.first.max_over_mean,
                b.last.max_over_mean,
                b.last.worst_max_over_mean,
                b.first.rel_err,
                b.last.rel_err,
                fmt_ppl(b.q.ppl),
                b.q.kl,
                b.q.busiest,
                b.q.worst,
                b.q.cv,
                b.seconds,
            );
        }
        let _ = writeln!(
            s,
            "\nHow the routers train (`crates/frugal-train/src/router.rs`): each routed layer from the dense model's FFN input and output at that layer, experts frozen. Every expert runs on every token; the k experts that alone close most of the gap to the dense output are the token's oracle set, learned by cross-entropy; the relative reconstruction error trains the weights among the chosen (the top-k choice itself has no gradient, and under renormalized weights an unchosen expert gets none). Collapse comes from the data: one expert holds neurons useful to most tokens, so it is among most tokens' best k, and a linear router learns that marginal. `moefy` builds its routers soft (probabilities within about 10⁻³ of 1/E, so the renormalized weights stay near the 1/k that reproduces the dense sum), so a selection bias must step below that spread: a larger γ decides the choice alone and sends every token to the same experts. The training text's windows differ in difficulty, so the first and last quarters also differ by the data they saw.\n"
        );
    }
    if !distill.is_empty() {
        let _ = writeln!(s, "## Distillation of the whole MoE model\n");
        let _ = writeln!(
            s,
            "Every parameter trained (experts, routers, attention, norms, embedding; the selection bias, if any, held), the dense model as teacher: KL at τ = 2, AdamW lr {} with 5% warmup and a cosine decay, {} tokens per step of --data, then stored in Q8_0; with the Switch balancing loss at weight α in every routed layer (`distill --moe-aux α`), or without it (α = 0).\n",
            a.lr,
            a.seq * a.batch
        );
        let _ = writeln!(
            s,
            "| model | balancing loss α | tokens | PPL as built | KL as built | PPL after | KL after | busiest after (worst layer) | seconds |"
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for d in distill {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.3} | {} | {:.3} | {:.2}x ({:.2}x) | {:.0} |",
                d.variant.describe(),
                d.aux,
                d.tokens,
                fmt_ppl(d.before.ppl),
                d.before.kl,
                fmt_ppl(d.after.ppl),
                d.after.kl,
                d.after.busiest,
                d.after.worst,
                d.seconds,
            );
        }
        let _ = writeln!(s);
    }
    s.push_str(charts);
    let _ = writeln!(s, "## Targets\n");
    for r in rows
        .iter()
        .filter(|r| !r.variant.upcycle && (r.active_ffn - 0.25).abs() < 1e-9)
    {
        let _ = writeln!(
            s,
            "- {} (25% of the FFN active) decodes at {:.2}x the dense model (target ≥ 1.4x) — {}.",
            r.variant.describe(),
            r.vs_tg,
            if r.vs_tg >= 1.4 { "met" } else { "not met" }
        );
    }
    let none = balance.iter().find(|b| b.balance == Balance::None);
    for b in balance.iter().filter(|b| b.balance != Balance::None) {
        let _ = writeln!(
            s,
            "- With `{}` the busiest expert ends training at {:.2}x the mean (last quarter; on the evaluation text {:.2}x), without balancing {} (target: under 1.5x, where none exceeds 3x) — {}.",
            b.balance,
            b.last.max_over_mean,
            b.q.busiest,
            none.map_or("not run".to_string(), |n| format!(
                "{:.2}x ({:.2}x)",
                n.last.max_over_mean, n.q.busiest
            )),
            if b.last.max_over_mean < 1.5 && none.is_some_and(|n| n.last.max_over_mean > 3.0) {
                "met on the training text"
            } else {
                "not met"
            }
        );
    }
    s
}

/// Perplexities run from 3 to 10⁵ here: fixed decimals for small ones, scientific for huge.
fn fmt_ppl(p: f64) -> String {
    if p < 1e4 {
        format!("{p:.2}")
    } else {
        format!("{p:.2e}")
    }
}
