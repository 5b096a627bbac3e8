//! `frugal report prune`: fewer weights, measured in one run on one model (`docs/pruning.md`).
//!
//! Rows: the dense model as stored, the dense model re-encoded in the pruned rows' value format
//! (the fair speed baseline: same bytes per stored weight), every method at every unstructured
//! sparsity and N:M pattern (stored densely), and every structured removal. For each: the
//! fraction of block weights that are zero, parameters and bytes, perplexity and KL to the
//! dense model on a held-out text, prefill and decode speed against the dense baseline in the
//! same run; for the rows asked, the same after distillation from the dense model (the sparsity
//! pattern kept by masked updates).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use frugal::convert::{Policy, Target, quantize_file};
use frugal::eval::{self, EvalOptions};
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;
use frugal::surgery::prune::structured::{self, StructuredTarget};
use frugal::surgery::prune::{self, Method, Pattern, PruneTarget};
use frugal::tokenizer::Tokenizer;
use frugal_train::Params;
use frugal_train::data::corpus_from_files;
use frugal_train::model::RunOptions;
use frugal_train::teacher::OnlineTeachers;

use super::bench::plot::{self, Chart, Series};
use super::common::{self, ModelArgs, human_bytes};
use super::recovery::Recovery;
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
    /// Storage of the pruned matrices (and of the dense baseline)
    #[arg(long = "format", default_value = "q8_0")]
    pub format: String,
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

/// One row's measurements.
struct Row {
    name: String,
    /// `method@pattern`, `structured`, or `dense`.
    key: String,
    kind: Kind,
    /// Fraction of the block matrices' weights that are zero.
    zeros: f64,
    params: u64,
    bytes: u64,
    ppl: f64,
    kl: f64,
    after: Option<(f64, f64)>,
    pp: f64,
    tg: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Dense,
    Unstructured,
    NofM,
    Structured,
}

/// Parameters, bytes and the zero fraction of the block matrices of a file.
fn sizes(f: &GgufFile) -> Result<(u64, u64, f64)> {
    let (mut p, mut b, mut blk, mut z) = (0u64, 0u64, 0u64, 0u64);
    for t in f.tensors() {
        p += t.n_elements();
        b += t.n_bytes();
        if t.name.starts_with("blk.") && t.dims.len() == 2 {
            let (info, bytes) = f.tensor(&t.name)?;
            let x = frugal::quant::dequantize_to_vec(info.ty, bytes, info.n_elements() as usize)?;
            blk += x.len() as u64;
            z += x.iter().filter(|&&v| v == 0.0).count() as u64;
        }
    }
    Ok((p, b, z as f64 / blk.max(1) as f64))
}

/// A model from GGUF bytes, with 8-bit activations.
fn model_of(bytes: Vec<u8>) -> Result<Model> {
    let mut m = Model::from_file(GgufFile::from_bytes(bytes)?)?;
    m.set_activations(Activations::Q8);
    Ok(m)
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
    let target_fmt: Target = a
        .format
        .parse()
        .map_err(|e| anyhow::anyhow!("--format {}: {e}", a.format))?;
    eprintln!("calibrating on {} tokens...", calib.len());
    let ctx = 512.min(calib.len());
    let stats = prune::collect(
        &original,
        &calib,
        ctx,
        a.methods.contains(&Method::SparseGpt),
    )?;
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
        points: 4,
        eval_windows: 16,
        seed: a.seed,
        run: RunOptions {
            precision: super::train::precision("auto")?,
            recompute: false,
        },
    };
    let steps = recovery.steps(parse_count(&a.tokens)?);
    let work = std::env::temp_dir().join(format!("frugal-report-prune-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;

    // (name, key, kind, file bytes)
    let mut made: Vec<(String, String, Kind, Vec<u8>)> = Vec::new();
    made.push((
        "dense (as stored)".into(),
        "dense".into(),
        Kind::Dense,
        std::fs::read(&path)?,
    ));
    let dense_fmt = prune::prune_weights(
        &original.file,
        None,
        PruneTarget {
            method: Method::Magnitude,
            pattern: Pattern::Unstructured(0.0),
            format,
        },
    )?
    .0
    .to_bytes()?;
    made.push((
        format!("dense, {}", format.name()),
        "dense-format".into(),
        Kind::Dense,
        dense_fmt,
    ));
    let mut patterns: Vec<(Pattern, Kind)> = a
        .sparsities
        .iter()
        .map(|&s| (Pattern::Unstructured(s), Kind::Unstructured))
        .collect();
    for p in &a.patterns {
        patterns.push((p.parse().map_err(anyhow::Error::msg)?, Kind::NofM));
    }
    for &method in &a.methods {
        for &(pattern, kind) in &patterns {
            eprintln!("pruning: {method} {pattern}");
            let target = PruneTarget {
                method,
                pattern,
                format,
            };
            let (w, _) = prune::prune_weights(&original.file, Some(&stats), target)?;
            let key = match pattern {
                Pattern::Unstructured(s) => format!("{method}@{s}"),
                Pattern::NofM { n, m } => format!("{method}@{n}:{m}"),
            };
            made.push((format!("{method}, {pattern}"), key, kind, w.to_bytes()?));
        }
    }
    for spec in &a.structured {
        let t: StructuredTarget = spec.parse().map_err(anyhow::Error::msg)?;
        eprintln!("pruning: structured {spec}");
        let (w, r) = structured::prune_structured(&original.file, &stats, &t, None)?;
        let what = format!(
            "structured {spec} (FFN {}, heads {}/{}, {} layers)",
            r.n_ff.1,
            r.n_head.1,
            r.n_head_kv.1,
            r.kept_layers.len()
        );
        made.push((what, "structured".into(), Kind::Structured, w.to_bytes()?));
    }

    let mut rows = Vec::new();
    let mut models = Vec::new();
    for (name, key, kind, bytes) in made {
        eprintln!("measuring: {name}");
        let f = GgufFile::from_bytes(bytes.clone())?;
        let (params, file_bytes, zeros) = sizes(&f)?;
        let m = model_of(bytes)?;
        let cmp = eval::compare(&m, &original, &eval_ids, a.ctx, |_, _| {})?;
        let recover = steps > 0
            && (a.recover.iter().any(|r| r == &key)
                || (kind == Kind::Structured && a.recover.iter().any(|r| r == "structured")));
        let after = if recover {
            eprintln!("recovering: {name}");
            let student = Params::from_model(&m)?;
            let keep = kind != Kind::Structured;
            let (_, healed) = recovery.distil(student, steps, &data, &teachers, keep)?;
            let f32_bytes = healed.to_gguf(&m.file).to_bytes()?;
            let tmp = work.join("healed.gguf");
            quantize_file(
                &GgufFile::from_bytes(f32_bytes)?,
                &Policy::new(target_fmt),
                &tmp,
                |_, _| {},
            )?;
            let mut h = Model::load(&tmp)?;
            h.set_activations(Activations::Q8);
            let c = eval::compare(&h, &original, &eval_ids, a.ctx, |_, _| {})?;
            Some((c.model.ppl, c.kl_mean))
        } else {
            None
        };
        rows.push(Row {
            name,
            key,
            kind,
            zeros,
            params,
            bytes: file_bytes,
            ppl: cmp.model.ppl,
            kl: cmp.kl_mean,
            after,
            pp: 0.0,
            tg: 0.0,
        });
        models.push(m);
    }
    let _ = std::fs::remove_dir_all(&work);

    // Speed last, rows taking turns within each repetition.
    let opts = EvalOptions::default();
    let (mut pps, mut tgs) = (vec![Vec::new(); rows.len()], vec![Vec::new(); rows.len()]);
    for rep in 0..a.reps.max(1) {
        for (i, m) in models.iter().enumerate() {
            pps[i].push(frugal::bench::prefill(m, a.prompt, 1, &opts)?.median);
            tgs[i].push(frugal::bench::decode(m, a.gen_tokens, 1, &opts)?.median);
            eprintln!(
                "speed, run {}: {}: pp {:.1} tg {:.1}",
                rep + 1,
                rows[i].name,
                pps[i][rep],
                tgs[i][rep]
            );
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    for ((r, p), t) in rows.iter_mut().zip(pps).zip(tgs) {
        r.pp = median(p);
        r.tg = median(t);
    }

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let charts = write_charts(&rows, &a.methods, &a.out.join("pruning"));
    let md = report(
        &a,
        &rows,
        &path.display().to_string(),
        steps,
        &charts,
        &stats,
    );
    let out = a.out.join("pruning.md");
    std::fs::write(&out, md).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {}", out.display());
    Ok(())
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
                    .map(|r| (r.zeros, r.ppl))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.0}"),
    };
    let base = rows
        .iter()
        .find(|r| r.key == "dense-format")
        .map_or(1.0, |r| r.tg);
    let kinds = [
        (Kind::Unstructured, "unstructured, stored densely"),
        (Kind::NofM, "N:M, stored densely"),
        (Kind::Structured, "structured"),
    ];
    let speed = Chart {
        title: "Decode speed against weight bytes".into(),
        x_desc: "weight bytes (MiB)",
        y_desc: "decode tok/s over the dense baseline",
        series: kinds
            .iter()
            .map(|(k, name)| Series {
                name: (*name).into(),
                points: rows
                    .iter()
                    .filter(|r| r.kind == *k)
                    .map(|r| (r.bytes as f64 / (1u64 << 20) as f64, r.tg / base))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.2}"),
    };
    let mut md = String::new();
    for (chart, stem, alt) in [
        (&quality, "ppl-vs-sparsity", "perplexity against sparsity"),
        (
            &speed,
            "decode-vs-bytes",
            "decode speed against weight bytes",
        ),
    ] {
        if chart.series.iter().all(|s| s.points.is_empty()) {
            continue;
        }
        match plot::write(chart, dir, stem) {
            Ok(_) => {
                let _ = writeln!(md, "![{alt}](pruning/{stem}.svg)\n");
            }
            Err(e) => {
                let _ = writeln!(md, "(no chart {stem}: {e})\n");
            }
        }
    }
    md
}

fn report(
    a: &Args,
    rows: &[Row],
    model: &str,
    steps: usize,
    charts: &str,
    stats: &prune::PruneStats,
) -> String {
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
        "Scores come from {} calibration tokens of `{}`. Perplexity and KL(dense ‖ pruned) are measured on {} tokens of `{}` in windows of {} (8-bit activations, against the dense model as stored). The unstructured and N:M rows keep every matrix's shape and store the zeros densely in {}; the dense {} row is the same model without zeros in that format, the fair baseline for their speed. \"After\" is after {} steps × {} tokens of distillation from the dense model on the --data text (KL at τ = 2, AdamW lr {}, zeros held by masked updates), re-encoded in {}. Speed: prefill of {} tokens and decode of {} tokens, the median of {} runs, all rows taking turns within each run.\n",
        stats.tokens,
        a.calibration.display(),
        a.eval_tokens,
        a.text.display(),
        a.ctx,
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
    let base = rows.iter().find(|r| r.key == "dense-format");
    let (bpp, btg) = base.map_or((1.0, 1.0), |r| (r.pp, r.tg));
    let _ = writeln!(
        s,
        "| model | zero weights | parameters | weights | bits / weight | PPL | KL | PPL after | KL after | prefill tok/s | vs dense | decode tok/s | vs dense |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in rows {
        let (pa, ka) = r.after.map_or(("-".into(), "-".into()), |(p, k)| {
            (format!("{p:.2}"), format!("{k:.4}"))
        });
        let _ = writeln!(
            s,
            "| {} | {:.1}% | {:.1}M | {} | {:.2} | {:.2} | {:.4} | {pa} | {ka} | {:.1} | {:.2}x | {:.1} | {:.2}x |",
            r.name,
            100.0 * r.zeros,
            r.params as f64 / 1e6,
            human_bytes(r.bytes),
            r.bytes as f64 * 8.0 / r.params as f64,
            r.ppl,
            r.kl,
            r.pp,
            r.pp / bpp,
            r.tg,
            r.tg / btg,
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
            w.ppl,
            m.ppl,
            if w.ppl < m.ppl { "met" } else { "not met" }
        );
    }
    if let Some(f) = rows
        .iter()
        .find(|r| r.key == "structured" && r.name.contains("ffn:"))
    {
        let _ = writeln!(
            s,
            "- {} decodes at {:.2}x the dense model (target ≥ 1.15x) — {}.",
            f.name,
            f.tg / btg,
            if f.tg / btg >= 1.15 { "met" } else { "not met" }
        );
    }
    let _ = writeln!(
        s,
        "- 2:4 in a compressed format decoding ≥ 1.3x faster than dense: not measured here yet; the 2:4 rows above are stored densely and run the dense kernels."
    );
    s
}
