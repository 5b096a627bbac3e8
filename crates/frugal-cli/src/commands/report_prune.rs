//! `frugal report prune`: fewer weights, measured in one run on one model (`docs/pruning.md`).
//!
//! Rows: the dense model as stored, the dense model re-encoded in the pruned rows' value format
//! (the fair speed baseline: same bytes per stored weight), every method at every unstructured
//! sparsity and N:M pattern (stored densely), and every structured removal. For each: the
//! fraction of block weights that are zero, parameters and bytes, perplexity and KL to the
//! dense model on a held-out text, prefill and decode speed against the dense baseline in the
//! same run; for the rows asked, the same after distillation from the dense model (the sparsity
//! pattern kept by masked updates).
//!
//! The study itself is [`frugal_lab::prune_study`]: here the flags become its plan, and
//! its rows a table and charts.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use frugal::convert::Target;
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;
use frugal::surgery::prune::structured::StructuredTarget;
use frugal::surgery::prune::{Method, Pattern};
use frugal::tokenizer::Tokenizer;
use frugal_lab::candidate::Candidate;
use frugal_lab::heal::{self, Recovery};
use frugal_lab::prune_study::{self, Inputs, Kind, Plan, Row, Study, base_of};
use frugal_lab::timing::SpeedTest;
use frugal_train::data::corpus_from_files;
use frugal_train::teacher::OnlineTeachers;

use super::bench::plot::{self, Chart, Series};
use super::common::{self, ModelArgs, human_bytes};
use super::train::parse_count;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Text whose activations score the weights (Wanda, SparseGPT, structured importance)
    #[arg(long)]
    pub calibration: PathBuf,
    /// Calibration tokens taken from the start of --calibration
    #[arg(long = "calibration-tokens", default_value_t = 2048)]
    pub calibration_tokens: usize,
    /// Held-out text every perplexity and KL is measured on
    #[arg(long)]
    pub text: PathBuf,
    /// Evaluation window in tokens
    #[arg(long = "ctx", default_value_t = 256)]
    pub ctx: usize,
    /// Tokens of --text evaluated
    #[arg(long = "eval-tokens", default_value_t = 4096)]
    pub eval_tokens: usize,
    /// Methods of the unstructured and N:M rows
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "magnitude,wanda,sparsegpt"
    )]
    pub methods: Vec<Method>,
    /// Unstructured sparsities
    #[arg(long, value_delimiter = ',', default_value = "0.3,0.5,0.7")]
    pub sparsities: Vec<f64>,
    /// N:M patterns
    #[arg(long, value_delimiter = ',', default_value = "2:4,4:8")]
    pub patterns: Vec<String>,
    /// Structured removals, `;`-separated (each as `frugal prune --structured`)
    #[arg(
        long,
        value_delimiter = ';',
        default_value = "ffn:0.25;heads:1;layers:6"
    )]
    pub structured: Vec<String>,
    /// Storage of the pruned matrices (and of the dense baseline). Its 2:4 rows are also
    /// measured in the compressed 2:4 storage of the same values (q8_0 -> q8_0_24), and its
    /// unstructured rows also as bitmaps (q8_0 only)
    #[arg(long = "format", default_value = "q8_0")]
    pub format: String,
    /// Also measure the first method's 2:4 row with 4-bit values: dense Q4_0 against Q4_0_24,
    /// beside a dense Q4_0 baseline
    #[arg(long = "four-bit", default_value_t = true, action = clap::ArgAction::Set)]
    pub four_bit: bool,
    /// Text files to distil on (recovery); the last --heldout fraction is held out
    #[arg(long = "data", num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    #[arg(long = "heldout", default_value_t = 0.1)]
    pub heldout: f64,
    /// Rows recovered by distillation: METHOD@PATTERN (wanda@0.5, wanda@2:4) or `structured`
    /// (every structured row), comma-separated
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "wanda@0.5,wanda@2:4,structured"
    )]
    pub recover: Vec<String>,
    /// Distillation tokens per recovered row (k/M suffixes; 0 skips recovery)
    #[arg(long = "tokens", default_value = "16k")]
    pub tokens: String,
    #[arg(long = "seq", default_value_t = 256)]
    pub seq: usize,
    #[arg(long = "batch", default_value_t = 4)]
    pub batch: usize,
    #[arg(long = "lr", default_value_t = 3e-4)]
    pub lr: f32,
    /// Prefill tokens of the speed test
    #[arg(short = 'p', long = "prompt", default_value_t = 256)]
    pub prompt: usize,
    /// Decode tokens of the speed test
    #[arg(short = 'n', long = "gen", default_value_t = 64)]
    pub gen_tokens: usize,
    /// Repetitions of each speed test (median reported; rows take turns within a repetition)
    #[arg(long = "reps", default_value_t = 3)]
    pub reps: usize,
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Where the report (pruning.md) and its charts go
    #[arg(long = "out", default_value = "docs")]
    pub out: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(a: Args) -> Result<()> {
    frugal_train::keep_freed_memory();
    let path = common::model_path(&a.model)?;
    let mut original = Model::load(&path)?;
    original.set_activations(Activations::Q8);
    let tok = Tokenizer::from_gguf(&original.file)?;
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
    let format = GgmlType::from_name(&a.format)
        .with_context(|| format!("--format {}: not a GGUF type", a.format))?;
    // The structured and healed rows are re-encoded in it: it must be a type `quantize` writes.
    let _: Target = a
        .format
        .parse()
        .map_err(|e| anyhow::anyhow!("--format {}: {e}", a.format))?;
    let patterns = a
        .patterns
        .iter()
        .map(|p| p.parse().map_err(anyhow::Error::msg))
        .collect::<Result<Vec<Pattern>>>()?;
    let structured = a
        .structured
        .iter()
        .map(|spec| Ok((spec.clone(), spec.parse().map_err(anyhow::Error::msg)?)))
        .collect::<Result<Vec<(String, StructuredTarget)>>>()?;
    let data = corpus_from_files(&tok, &a.data, a.seq, a.heldout)?;
    let teacher = {
        let mut t = Model::load(&path)?;
        t.set_activations(Activations::Q8);
        t
    };
    let teachers = OnlineTeachers {
        models: vec![(teacher, 1.0)],
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
    let steps = recovery.steps(parse_count(&a.tokens)?);
    let plan = Plan {
        methods: a.methods.clone(),
        sparsities: a.sparsities.clone(),
        patterns,
        structured,
        format,
        four_bit: a.four_bit,
        recover: a.recover.clone(),
        heal_steps: steps,
        speed: SpeedTest::once(a.prompt, a.gen_tokens),
        reps: a.reps,
    };
    let work = std::env::temp_dir().join(format!("frugal-report-prune-{}", std::process::id()));
    let inputs = Inputs {
        base: &original,
        stored: std::fs::read(&path)?,
        calib: &calib,
        eval: &eval_ids,
        ctx: a.ctx,
        data: &data,
        teachers: &teachers,
        recovery,
        work: &work,
    };
    let study = prune_study::run(&plan, inputs, &mut common::lab_progress())?;

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let rows = &study.rows;
    let charts = write_charts(rows, &a.methods, &a.out.join("pruning"));
    let model = path.display().to_string();
    let md = report(&a, &study, &model, steps, &charts);
    let out = a.out.join("pruning.md");
    std::fs::write(&out, md).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

/// The figures the report reads of a row.
fn ppl(r: &Row) -> f64 {
    r.candidate.quality.ppl
}

fn bytes(r: &Row) -> u64 {
    r.candidate.size.bytes
}

/// Decode over the row's baseline (the median of back-to-back ratios).
fn speedup(r: &Row) -> f64 {
    r.candidate.speed.vs_base.decode
}

fn write_charts(rows: &[Row], methods: &[Method], dir: &Path) -> String {
    let quality = Chart {
        title: "Perplexity against unstructured sparsity (training-free)".into(),
        x_desc: "fraction of block weights removed",
        y_desc: "perplexity",
        series: methods
            .iter()
            .map(|m| Series {
                name: m.to_string(),
                points: rows
                    .iter()
                    .filter(|r| r.kind == Kind::Unstructured && r.key.starts_with(&format!("{m}@")))
                    .map(|r| (r.zeros, ppl(r)))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.0}"),
    };
    type Pick = fn(&Row) -> bool;
    let kinds: [(&str, Pick); 5] = [
        ("unstructured, stored densely", |r| {
            r.kind == Kind::Unstructured && !r.bitmap
        }),
        ("unstructured, bitmap", |r| r.bitmap),
        ("N:M, stored densely", |r| {
            r.kind == Kind::NofM && !r.key.ends_with("+compressed")
        }),
        ("2:4, compressed", |r| r.key.ends_with("+compressed")),
        ("structured", |r| r.kind == Kind::Structured),
    ];
    let speed = Chart {
        title: "Decode speed against weight bytes".into(),
        x_desc: "file bytes (MiB)",
        y_desc: "decode tok/s over the dense model of the same format",
        series: kinds
            .iter()
            .map(|(name, pick)| Series {
                name: (*name).into(),
                points: rows
                    .iter()
                    .filter(|r| pick(r))
                    .map(|r| (bytes(r) as f64 / (1u64 << 20) as f64, speedup(r)))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.2}"),
    };
    // Where a bitmap starts to pay: decode against sparsity, dense storage and bitmap.
    let breakeven = Chart {
        title: "Unstructured sparsity: stored densely or as a bitmap".into(),
        x_desc: "fraction of block weights zero",
        y_desc: "decode tok/s over the dense model of the same format",
        series: [false, true]
            .iter()
            .map(|&bm| Series {
                name: if bm { "bitmap" } else { "stored densely" }.into(),
                points: rows
                    .iter()
                    .filter(|r| r.kind == Kind::Unstructured && r.bitmap == bm)
                    .map(|r| (r.zeros, speedup(r)))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.2}"),
    };
    plot::embed(
        &[
            (&quality, "ppl-vs-sparsity", "perplexity against sparsity"),
            (
                &speed,
                "decode-vs-bytes",
                "decode speed against weight bytes",
            ),
            (
                &breakeven,
                "bitmap-breakeven",
                "decode speed of dense and bitmap storage against sparsity",
            ),
        ],
        dir,
        "pruning",
    )
}

fn report(a: &Args, study: &Study, model: &str, steps: usize, charts: &str) -> String {
    let rows = &study.rows;
    let mut s = String::new();
    let list = |v: &[String]| v.join(",");
    let _ = writeln!(s, "# Pruning, measured\n");
    let _ = writeln!(
        s,
        "Generated by `frugal report prune --calibration {} --text {} --ctx {} --eval-tokens {} --methods {} --sparsities {} --patterns {} --structured '{}' --format {} --data {} --recover {} --tokens {} --seed {}` on {model} ({} threads). Do not edit: rerun the command.\n",
        a.calibration.display(),
        a.text.display(),
        a.ctx,
        a.eval_tokens,
        a.methods
            .iter()
            .map(|m| m.to_string())
            .collect::<Vec<_>>()
            .join(","),
        a.sparsities
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(","),
        list(&a.patterns),
        a.structured.join(";"),
        a.format,
        a.data
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" "),
        list(&a.recover),
        a.tokens,
        a.seed,
        rayon::current_num_threads(),
    );
    let _ = writeln!(
        s,
        "Scores come from {} calibration tokens of `{}`. Perplexity and KL(dense ‖ pruned) are measured on {} tokens of `{}` in windows of {} (8-bit activations, against the dense model as stored). The unstructured and N:M rows keep every matrix's shape and store the zeros densely in {}; \"dense, {}\" is the same model without zeros in that format, the fair baseline for their speed (the `base` column names each row's baseline: same value format, nothing pruned; structured rows are re-encoded in {} too). \"Bitmap\" rows are the same files held at run time as bitmaps of their nonzero bytes, \"compressed\" rows the same 2:4 weights in the compressed 2:4 storage (kept values plus 2-bit positions; a frugal-only GGUF type); both compute exactly the logits of their densely stored twin (a test checks it bit for bit; 4-bit compressed rows agree with Q4_0 to a few ulps), so their quality columns repeat and only bytes and speed differ. \"After\" is after {} steps × {} tokens of distillation from the dense model on the --data text (KL at τ = 2, AdamW lr {}, zeros held by masked updates), re-encoded in {}. Speed: prefill of {} tokens and decode of {} tokens, the median of {} runs, all rows taking turns within each run, each run starting at another row; each model is loaded alone for its timing, right after its baseline, and the speed-up is the median of those back-to-back ratios.\n\nBytes per 32 weights: Q8_0 34, its 2:4 compression Q8_0_24 22 (0.65x); Q4_0 18, Q4_0_24 14 (0.78x); a Q8_0 bitmap 2 (scale) + 4 (mask) + one byte per nonzero, so 6 + 32(1 - s) at sparsity s, below Q8_0 from s = 12.5% on. The output head (tied embedding, about a fifth of the bytes a decode step reads) is never pruned.\n",
        study.calibration_tokens,
        a.calibration.display(),
        a.eval_tokens,
        a.text.display(),
        a.ctx,
        a.format,
        a.format,
        a.format,
        steps,
        a.seq * a.batch,
        a.lr,
        a.format,
        a.prompt,
        a.gen_tokens,
        a.reps,
    );
    let _ = writeln!(
        s,
        "| model | zero weights | parameters | file | bits / weight | PPL | KL | PPL after | KL after | prefill tok/s | vs base | decode tok/s | vs base | base |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    );
    for r in rows {
        let (pa, ka) = r.after.map_or(("-".into(), "-".into()), |q| {
            (format!("{:.2}", q.ppl), format!("{:.4}", q.kl_mean))
        });
        let b = base_of(rows, r);
        let Candidate {
            name,
            size,
            quality,
            speed,
        } = &r.candidate;
        let _ = writeln!(
            s,
            "| {} | {:.1}% | {:.1}M | {} | {:.2} | {:.2} | {:.4} | {pa} | {ka} | {:.1} | {:.2}x | {:.1} | {:.2}x | {} |",
            name,
            100.0 * r.zeros,
            size.params as f64 / 1e6,
            human_bytes(size.bytes),
            size.bits_per_weight(),
            quality.ppl,
            quality.kl_mean,
            speed.speed.prefill,
            speed.vs_base.prefill,
            speed.speed.decode,
            speed.vs_base.decode,
            b.map_or("-", |b| b.candidate.name.as_str()),
        );
    }
    let _ = writeln!(s);
    s.push_str(charts);
    let _ = writeln!(s, "## Targets\n");
    let find = |k: &str| rows.iter().find(|r| r.key == k);
    if let (Some(w), Some(m)) = (find("wanda@0.5"), find("magnitude@0.5")) {
        let _ = writeln!(
            s,
            "- Wanda's PPL below magnitude's at 50% unstructured: {:.2} against {:.2} — {}.",
            ppl(w),
            ppl(m),
            if ppl(w) < ppl(m) { "met" } else { "not met" }
        );
    }
    // A decode step reads every weight once (the head is the tied embedding), so where decode
    // is bound by memory bandwidth its speed-up cannot pass the ratio of the files' bytes.
    let ceiling = |r: &Row| {
        base_of(rows, r).map_or(String::new(), |b| {
            format!(
                " The file is {:.1}% smaller than {}: {:.2}x fewer bytes read per step, the speed-up if decode were bound by memory bandwidth alone (past it, what is saved is compute).",
                100.0 * (1.0 - bytes(r) as f64 / bytes(b) as f64),
                b.candidate.name,
                bytes(b) as f64 / bytes(r) as f64
            )
        })
    };
    if let Some(f) = rows
        .iter()
        .find(|r| r.key == "structured" && r.candidate.name.contains("ffn:"))
    {
        let _ = writeln!(
            s,
            "- {} decodes at {:.2}x the dense model in {} (target ≥ 1.15x) — {}.{}",
            f.candidate.name,
            speedup(f),
            a.format,
            if speedup(f) >= 1.15 { "met" } else { "not met" },
            ceiling(f)
        );
    }
    let compressed: Vec<&Row> = rows
        .iter()
        .filter(|r| r.key.ends_with("+compressed"))
        .collect();
    if compressed.is_empty() {
        let _ = writeln!(
            s,
            "- 2:4 in the compressed storage decoding ≥ 1.3x faster than dense: no compressed rows in this run (the compressed storage takes q8_0 or q4_0 values and a 2:4 pattern)."
        );
    }
    for r in compressed {
        let b = base_of(rows, r).map_or("-", |b| b.candidate.name.as_str());
        let _ = writeln!(
            s,
            "- {} decodes at {:.2}x {b} (target ≥ 1.3x) — {}.{}",
            r.candidate.name,
            speedup(r),
            if speedup(r) >= 1.3 { "met" } else { "not met" },
            ceiling(r)
        );
    }
    // Where a bitmap starts to pay: per sparsity measured, the median over the methods.
    let mut levels: Vec<(f64, Vec<f64>)> = Vec::new();
    for r in rows.iter().filter(|r| r.bitmap) {
        let z = (r.zeros * 100.0).round() / 100.0;
        match levels.iter_mut().find(|(l, _)| *l == z) {
            Some((_, v)) => v.push(speedup(r)),
            None => levels.push((z, vec![speedup(r)])),
        }
    }
    levels.sort_by(|x, y| x.0.total_cmp(&y.0));
    if !levels.is_empty() {
        let med: Vec<(f64, f64)> = levels
            .into_iter()
            .map(|(z, mut v)| {
                v.sort_by(f64::total_cmp);
                (z, v[v.len() / 2])
            })
            .collect();
        let list: Vec<String> = med
            .iter()
            .map(|(z, v)| format!("{:.0}% {v:.2}x", 100.0 * z))
            .collect();
        let pays = med.iter().position(|(_, v)| *v > 1.0);
        let base = rows
            .iter()
            .find(|r| r.bitmap)
            .and_then(|r| base_of(rows, r))
            .map_or("-", |b| b.candidate.name.as_str());
        let _ = writeln!(
            s,
            "- Bitmap storage against {base} (decode, median over the methods at each sparsity): {}. {}",
            list.join(", "),
            match pays {
                Some(0) => format!(
                    "It pays already at {:.0}%, the lowest sparsity measured.",
                    100.0 * med[0].0
                ),
                Some(k) => format!(
                    "It starts to pay between {:.0}% and {:.0}% zeros on this CPU.",
                    100.0 * med[k - 1].0,
                    100.0 * med[k].0
                ),
                None => "It did not pay at any sparsity measured.".into(),
            }
        );
    }
    s
}
