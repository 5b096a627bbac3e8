//! `frugal report moe`: mixture of experts, measured in one run on one model (`docs/moe.md`).
//!
//! Three parts. (1) The dense model and its MoE variants as `moefy` builds them (E experts,
//! top-k, the neuron split, a shared expert, an upcycled copy): total and active parameters,
//! perplexity and KL to the dense model, the routing's load, and prefill and decode speed
//! against the dense model in the same run. (2) Router training on one variant under each
//! balancing mode: the busiest expert's load step by step (the collapse and its cure) and the
//! quality after. (3) Distillation of whole MoE models from the dense one (experts, routers
//! and the rest trained together), at a stated token budget.
//!
//! The study itself is [`frugal_lab::moe_study`]: here the flags become its plan, and
//! its rows a table and charts.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;
use frugal_lab::heal::{self, Recovery};
use frugal_lab::moe::Variant;
use frugal_lab::moe_study::{self, Balancing, Distilling, Inputs, Plan, Study};
use frugal_lab::timing::SpeedTest;
use frugal_train::data::corpus_from_files;
use frugal_train::router::Balance;

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

pub fn run(a: Args) -> Result<()> {
    frugal_train::keep_freed_memory();
    let parse = |specs: &[String]| -> Result<Vec<Variant>> {
        specs
            .iter()
            .map(|s| s.parse().map_err(anyhow::Error::msg))
            .collect()
    };
    let variants = parse(&a.variants)?;
    let balance_on: Variant = a.balance_on.parse().map_err(anyhow::Error::msg)?;
    let distill = parse(&a.distill)?;
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
    let mut eval_ids = tok.encode(&read(&a.text)?, false)?;
    eval_ids.truncate(a.eval_tokens);
    ensure!(
        eval_ids.len() > a.ctx,
        "--text holds {} tokens, fewer than one window of {}",
        eval_ids.len(),
        a.ctx
    );
    let train_text: String = a
        .data
        .iter()
        .map(|p| read(p))
        .collect::<Result<Vec<_>>>()?
        .join("\n");
    let train_ids = tok.encode(&train_text, false)?;
    ensure!(
        a.router_batch >= a.ctx && a.router_batch.is_multiple_of(a.ctx),
        "--router-batch {} must be a whole number of --ctx {} windows",
        a.router_batch,
        a.ctx
    );
    let distill_tokens = parse_count(&a.distill_tokens)?;
    let data = match distill_tokens > 0 && !distill.is_empty() {
        true => Some(corpus_from_files(&tok, &a.data, a.seq, a.heldout)?),
        false => None,
    };
    let recovery = Recovery {
        seq: a.seq,
        batch: a.batch,
        lr: a.lr,
        probe: None,
        points: 4,
        eval_windows: 16,
        seed: a.seed,
        run: heal::run_options(),
    };
    let plan = Plan {
        variants,
        speed: SpeedTest::once(a.prompt, a.gen_tokens),
        reps: a.reps,
        balancing: Some(Balancing {
            on: balance_on.clone(),
            modes: a.balance.clone(),
            text: &train_ids,
            tokens: parse_count(&a.router_tokens)?,
            batch: a.router_batch,
            lr: a.router_lr,
        }),
        distilling: data.as_ref().map(|data| Distilling {
            variants: distill,
            aux: a.distill_aux.clone(),
            tokens: distill_tokens,
            data,
            recovery,
        }),
    };
    let inputs = Inputs {
        dense: &dense,
        calib: &calib,
        eval: &eval_ids,
        ctx: a.ctx,
        seed: a.seed,
    };
    let study = moe_study::run(&plan, &inputs, &mut common::lab_progress())?;

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let charts = write_charts(&study, &a.out.join("moe"));
    let md = report(
        &a,
        &path.display().to_string(),
        &study,
        &balance_on,
        &charts,
    );
    let out = a.out.join("moe.md");
    std::fs::write(&out, md).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

fn write_charts(study: &Study, dir: &Path) -> String {
    let (rows, balance, distill) = (&study.variants, &study.balance, &study.distill);
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
                .map(|r| (r.active as f64 / 1e6, r.speed.vs_base.decode))
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

fn report(a: &Args, model: &str, study: &Study, balance_on: &Variant, charts: &str) -> String {
    let (rows, balance, distill) = (&study.variants, &study.balance, &study.distill);
    let (dense_pp, dense_tg) = (study.dense_speed.prefill, study.dense_speed.decode);
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
        study.dense.ppl
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
            r.speed.speed.prefill,
            r.speed.vs_base.prefill,
            r.speed.speed.decode,
            r.speed.vs_base.decode,
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
        let vs_dense = r.speed.vs_base.decode;
        let _ = writeln!(
            s,
            "- {} (25% of the FFN active) decodes at {:.2}x the dense model (target ≥ 1.4x) — {}.",
            r.variant.describe(),
            vs_dense,
            if vs_dense >= 1.4 { "met" } else { "not met" }
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
