//! `frugal report attention`: what each attention layout gives up to shrink the cache, measured
//! in one run on one model (`docs/attention-layouts.md` and its charts).
//!
//! Layouts: the original (SmolLM2's GQA with 3 KV heads), MHA (every query head its own KV head,
//! copied exactly), MQA (one mean-pooled KV head) and MLA at several latent ranks (calibrated,
//! activation-aware). For each:
//! - KV bytes per token as the cache stores them (a real cache filled by a real prefill, its
//!   buffers measured) and as `frugal estimate` computes them from the converted file;
//! - held-out perplexity and KL to the original, training-free and after distillation from the
//!   original at a stated token budget;
//! - decode tokens/s at two context depths;
//! - the cache against the weights at a long context.
//!
//! Every converted model is held in memory; nothing is written but the report and its charts.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::surgery::{self, AttentionLayout, Factorization, MlaTarget};
use frugal::tokenizer::Tokenizer;
use frugal_lab::build::{self, Layout};
use frugal_lab::heal::{self, Recovery};
use frugal_lab::size::{self, Footprint};
use frugal_lab::timing::{self, SpeedTest};
use frugal_train::Params;
use frugal_train::data::corpus_from_files;
use frugal_train::teacher::OnlineTeachers;
use frugal_train::trainer::{EvalPoint, evaluate};

use super::bench::plot::{self, Chart, Series};
use super::common::{self, ModelArgs, human_bytes};
use super::train::parse_count;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Text whose activations guide the MLA conversions (RoPE pairs, activation-aware latent)
    #[arg(long)]
    pub calibration: PathBuf,
    /// Calibration tokens taken from the start of --calibration
    #[arg(long = "calibration-tokens", default_value_t = 2048)]
    pub calibration_tokens: usize,
    /// Text files to distil on; the last --heldout fraction of their windows is held out and
    /// is what every perplexity and KL is measured on
    #[arg(long = "data", num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Fraction of the windows held out
    #[arg(long = "heldout", default_value_t = 0.1)]
    pub heldout: f64,
    /// MLA latent ranks to convert to
    #[arg(long = "ranks", value_delimiter = ',', default_value = "64,96,160")]
    pub ranks: Vec<usize>,
    /// Dims of MLA's shared RoPE key
    #[arg(long = "rope-dims", default_value_t = 32)]
    pub rope_dims: usize,
    /// Distillation tokens that each approximate layout gets to recover (k/M suffixes; 0 skips
    /// recovery)
    #[arg(long = "tokens", default_value = "32k")]
    pub tokens: String,
    /// Tokens per training sequence
    #[arg(long = "seq", default_value_t = 256)]
    pub seq: usize,
    /// Sequences per step
    #[arg(long = "batch", default_value_t = 4)]
    pub batch: usize,
    /// Peak learning rate of the recovery
    #[arg(long = "lr", default_value_t = 3e-4)]
    pub lr: f32,
    /// Held-out evaluations during each recovery (the curve's points)
    #[arg(long = "points", default_value_t = 4)]
    pub points: usize,
    /// Held-out windows per evaluation (0: all)
    #[arg(long = "eval-windows", default_value_t = 16)]
    pub eval_windows: usize,
    /// Context depths of the decode measurement
    #[arg(long = "depths", value_delimiter = ',', default_value = "512,4096")]
    pub depths: Vec<usize>,
    /// Tokens generated per decode measurement
    #[arg(long = "gen", default_value_t = 32)]
    pub gen_tokens: usize,
    /// Repetitions of each decode measurement (the median is reported)
    #[arg(long = "reps", default_value_t = 3)]
    pub reps: usize,
    /// Context at which the cache is set against the weights
    #[arg(long = "long-context", default_value_t = 8192)]
    pub long_context: usize,
    /// Seed of every recovery run
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Where the report (attention-layouts.md) and its charts go
    #[arg(long = "out", default_value = "docs")]
    pub out: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// One layout's measurements.
struct Row {
    name: String,
    /// Values one token caches per layer.
    values_per_layer: usize,
    /// f16 cache bytes per token over all layers, measured on a filled cache.
    kv_bytes_measured: usize,
    /// The same from `frugal estimate`'s arithmetic on the converted file.
    kv_bytes_estimated: u128,
    weight_bytes: u64,
    /// Whether the conversion computes the original's function (no recovery needed).
    exact: bool,
    before: (f64, Option<f64>),
    history: Vec<EvalPoint>,
    /// Decode tokens/s at each of `--depths`.
    decode: Vec<f64>,
}

impl Row {
    fn after(&self) -> Option<&EvalPoint> {
        self.history.last().filter(|p| p.tokens > 0)
    }
}

pub fn run(a: Args) -> Result<()> {
    frugal_train::keep_freed_memory();
    let path = common::model_path(&a.model)?;
    let source = GgufFile::open(&path)?;
    let tok = Tokenizer::from_gguf(&source)?;
    let data = corpus_from_files(&tok, &a.data, a.seq, a.heldout)?;
    let original = Model::load(&path)?;
    ensure!(
        original.config.mla.is_none(),
        "the report starts from a per-head (MHA/GQA) model; {} is already latent",
        path.display()
    );
    let c = original.config.clone();
    let text = std::fs::read_to_string(&a.calibration)
        .with_context(|| format!("reading {}", a.calibration.display()))?;
    let mut calib_tokens = tok.encode(&text, false)?;
    calib_tokens.truncate(a.calibration_tokens.max(2));
    eprintln!("calibrating on {} tokens...", calib_tokens.len());
    let calib = surgery::calibrate(&original, &calib_tokens, 512.min(c.n_ctx_train))?;
    drop(original);

    let mut teacher = Model::load(&path)?;
    teacher.set_activations(Activations::Q8);
    let teachers = OnlineTeachers {
        models: vec![(teacher, 1.0)],
    };
    let per_step = a.seq * a.batch;
    let run_opts = heal::run_options();
    let recovery = Recovery {
        seq: a.seq,
        batch: a.batch,
        lr: a.lr,
        probe: None,
        points: a.points,
        eval_windows: a.eval_windows,
        seed: a.seed,
        run: run_opts,
    };
    let steps = recovery.steps(parse_count(&a.tokens)?);

    let mut layouts: Vec<(String, Layout)> = vec![
        (
            format!("MHA ({} KV heads)", c.n_head),
            Layout::Heads(AttentionLayout::Mha),
        ),
        (format!("GQA-{} (original)", c.n_head_kv), Layout::Original),
        (
            "MQA (1 KV head)".into(),
            Layout::Heads(AttentionLayout::Mqa),
        ),
    ];
    for &rank in &a.ranks {
        layouts.push((
            format!("MLA rank {rank} + {} RoPE", a.rope_dims),
            Layout::Latent(MlaTarget {
                rank,
                rope_dims: a.rope_dims,
                factorization: Factorization::Activations,
            }),
        ));
    }

    let mut rows = Vec::new();
    let mut models = Vec::new();
    for (name, layout) in layouts {
        eprintln!("layout: {name}");
        let (file, exact) = build::convert_layout(&source, &layout, &calib)?;
        let weight_bytes = Footprint::of(&file).bytes;
        let mut model = Model::from_file(file)?;
        let kv = size::kv_per_token_f16(&model.file, &model, &name)?;
        let s = model.config.cache_shape();
        let values_per_layer = s.k_dim() + s.v_dim();

        let params = Params::from_model(&model)?;
        let before = evaluate(
            &params,
            &data.heldout,
            a.eval_windows,
            a.batch,
            Some(&teachers),
            run_opts,
        )?;
        eprintln!(
            "  training-free: held-out PPL {:.2}, KL {:.4}",
            before.0.exp(),
            before.1.unwrap_or(f64::NAN)
        );
        let history = if exact || steps == 0 {
            Vec::new()
        } else {
            let progress = common::training_progress(steps);
            (recovery.distil(params, steps, &data, &teachers, false, progress)?).history
        };

        model.set_activations(Activations::Q8);
        models.push(model);
        rows.push(Row {
            name,
            values_per_layer,
            kv_bytes_measured: kv.measured,
            kv_bytes_estimated: kv.estimated,
            weight_bytes,
            exact,
            before,
            history,
            decode: Vec::new(),
        });
    }

    // Decode speed last, every layout back to back and round-robin within each repetition, so
    // that the machine's drift over the run falls on all of them alike.
    for &depth in &a.depths {
        let test = SpeedTest {
            prompt: 0,
            gen_tokens: a.gen_tokens,
            depth,
            reps: 1,
        };
        let timed = timing::back_to_back(
            models.len(),
            a.reps,
            |_| None,
            |i| test.measure(&models[i]),
            |t| {
                eprintln!(
                    "decode at depth {depth}, run {}: {}: {:.1} tok/s",
                    t.round + 1,
                    rows[t.candidate].name,
                    t.speed.decode
                )
            },
        )?;
        for (r, t) in rows.iter_mut().zip(&timed.candidates) {
            r.decode.push(t.speed.decode);
        }
    }

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let assets = a.out.join("attention-layouts");
    let charts = write_charts(&rows, &a, &assets);
    let md = report(
        &a,
        &rows,
        &path.display().to_string(),
        steps * per_step,
        &charts,
    );
    let out = a.out.join("attention-layouts.md");
    std::fs::write(&out, md).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

/// The charts' Markdown (or why there are none).
fn write_charts(rows: &[Row], a: &Args, dir: &std::path::Path) -> String {
    let point = |r: &Row, ppl: f64| (r.kv_bytes_measured as f64, ppl);
    let mut by_bytes: Vec<&Row> = rows.iter().collect();
    by_bytes.sort_by_key(|r| r.kv_bytes_measured);
    let quality = Chart {
        title: "Held-out perplexity against KV-cache bytes per token".into(),
        x_desc: "KV-cache bytes per token (f16, all layers)",
        y_desc: "held-out perplexity",
        series: vec![
            Series {
                name: "training-free".into(),
                points: by_bytes
                    .iter()
                    .map(|r| point(r, r.before.0.exp()))
                    .collect(),
            },
            Series {
                name: format!("after {} distillation tokens", a.tokens),
                points: by_bytes
                    .iter()
                    .map(|r| point(r, r.after().map_or(r.before.0.exp(), |p| p.ppl)))
                    .collect(),
            },
        ],
        y_fmt: |v| format!("{v:.0}"),
    };
    let curves = Chart {
        title: "Recovery: held-out perplexity against distillation tokens".into(),
        x_desc: "distillation tokens",
        y_desc: "held-out perplexity",
        series: rows
            .iter()
            .filter(|r| r.after().is_some())
            .map(|r| Series {
                name: r.name.clone(),
                points: r
                    .history
                    .iter()
                    .filter(|p| p.tokens > 0)
                    .map(|p| (p.tokens as f64, p.ppl))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.0}"),
    };
    let decode = Chart {
        title: "Decode speed against context depth".into(),
        x_desc: "context depth (tokens)",
        y_desc: "decode tokens/s",
        series: rows
            .iter()
            .map(|r| Series {
                name: r.name.clone(),
                points: a
                    .depths
                    .iter()
                    .zip(&r.decode)
                    .map(|(&d, &t)| (d as f64, t))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.0}"),
    };
    plot::embed(
        &[
            (&quality, "ppl-vs-kv-bytes", "perplexity against KV bytes"),
            (&curves, "recovery", "recovery curves"),
            (&decode, "decode-vs-depth", "decode speed against depth"),
        ],
        dir,
        "attention-layouts",
    )
}

fn report(a: &Args, rows: &[Row], model: &str, budget: usize, charts: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Attention layouts, measured\n");
    let _ = writeln!(
        s,
        "Generated by `frugal report attention --calibration {} --data {} --ranks {} --rope-dims {} --tokens {} --seq {} --batch {} --lr {} --depths {} --seed {}` on {model} ({} threads). Do not edit: rerun the command.\n",
        a.calibration.display(),
        a.data
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" "),
        a.ranks
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(","),
        a.rope_dims,
        a.tokens,
        a.seq,
        a.batch,
        a.lr,
        a.depths
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(","),
        a.seed,
        rayon::current_num_threads(),
    );
    let _ = writeln!(
        s,
        "Each layout is converted from the original in memory (`frugal convert --attention ...`; MLA calibrated on the first {} tokens of `{}`, activation-aware factorization). Perplexity and KL(original ‖ layout) are measured on the held-out windows of the data ({} windows of {} tokens, never trained on; the training engine's forward in its own precision, so the original's KL is the floor of the measurement, not zero). \"After\" is after {budget} tokens of distillation from the original (KL at τ = 2, AdamW lr {}, cosine schedule); exact layouts need none. KV bytes are for an f16 cache: *measured* is what a real cache of the converted model's shape stores for one token (`KvCache::measured_bytes_per_token`); *estimate* is `frugal estimate`'s arithmetic on the converted file. Decode is the median of {} runs of {} tokens after a prompt of the given depth, 8-bit activations, measured after all the training with the layouts taking turns within each run.\n",
        a.calibration_tokens,
        a.calibration.display(),
        a.eval_windows,
        a.seq,
        a.lr,
        a.reps,
        a.gen_tokens,
    );
    let original = rows.iter().find(|r| r.name.contains("original"));
    let base_bytes = original.map_or(1, |r| r.kv_bytes_measured) as f64;
    let _ = write!(
        s,
        "| layout | cached values / token / layer | KV bytes / token (measured) | (estimate) | vs original | PPL before | KL before | PPL after | KL after |"
    );
    for d in &a.depths {
        let _ = write!(s, " decode @{d} tok/s |");
    }
    let _ = writeln!(
        s,
        " cache @{} | weights | cache / weights |",
        a.long_context
    );
    let _ = write!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for _ in &a.depths {
        let _ = write!(s, "---:|");
    }
    let _ = writeln!(s, "---:|---:|---:|");
    for r in rows {
        let (ppl_after, kl_after) = match r.after() {
            Some(p) => (
                format!("{:.2}", p.ppl),
                format!("{:.4}", p.kl.unwrap_or(f64::NAN)),
            ),
            None if r.exact => ("(exact)".into(), "(exact)".into()),
            None => ("-".into(), "-".into()),
        };
        let agree = if r.kv_bytes_estimated == r.kv_bytes_measured as u128 {
            format!("{} ✓", r.kv_bytes_estimated)
        } else {
            format!("{} ✗", r.kv_bytes_estimated)
        };
        let cache = (r.kv_bytes_measured * a.long_context) as u64;
        let _ = write!(
            s,
            "| {} | {} | {} | {agree} | {:.3}x | {:.2} | {:.4} | {ppl_after} | {kl_after} |",
            r.name,
            r.values_per_layer,
            r.kv_bytes_measured,
            r.kv_bytes_measured as f64 / base_bytes,
            r.before.0.exp(),
            r.before.1.unwrap_or(f64::NAN),
        );
        for t in &r.decode {
            let _ = write!(s, " {t:.1} |");
        }
        let _ = writeln!(
            s,
            " {} | {} | {:.2} |",
            human_bytes(cache),
            human_bytes(r.weight_bytes),
            cache as f64 / r.weight_bytes as f64
        );
    }
    let _ = writeln!(s);
    s.push_str(charts);
    if let Some(o) = original {
        let target = o.before.0.exp() * 1.15;
        let small: Vec<&Row> = rows
            .iter()
            .filter(|r| (r.kv_bytes_measured as f64) <= base_bytes / 3.0 + 0.5)
            .collect();
        let best = small
            .iter()
            .map(|r| (r, r.after().map_or(r.before.0.exp(), |p| p.ppl)))
            .min_by(|x, y| x.1.total_cmp(&y.1));
        let _ = writeln!(s, "## Targets\n");
        match best {
            Some((r, ppl)) => {
                let _ = writeln!(
                    s,
                    "- A layout at ≤ 1/3 of the original cache within 15% of its perplexity ({:.2} × 1.15 = {target:.2}): best is {} at {ppl:.2} — {}.",
                    o.before.0.exp(),
                    r.name,
                    if ppl <= target {
                        "met"
                    } else {
                        "not met at this budget"
                    }
                );
            }
            None => {
                let _ = writeln!(s, "- No layout measured at ≤ 1/3 of the original cache.");
            }
        }
        if let Some(&o_last) = o.decode.last() {
            let depth = a.depths.last().copied().unwrap_or(0);
            for r in rows.iter().filter(|r| r.name.starts_with("MLA")) {
                if let Some(&t) = r.decode.last() {
                    let _ = writeln!(
                        s,
                        "- {} decode at depth {depth}: {t:.1} tok/s against the original's {o_last:.1} ({:.2}x) — {}.",
                        r.name,
                        t / o_last,
                        if t >= o_last { "not slower" } else { "slower" }
                    );
                }
            }
        }
    }
    s
}
