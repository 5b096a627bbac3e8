//! Fewer weights, every way the engine stores them, measured on one model in one run: the study
//! behind `frugal report prune` (`docs/pruning.md`).
//!
//! The rows: the dense model as stored; the dense model re-encoded in the pruned rows' value
//! format (their fair speed baseline: the same bytes per stored weight); every method at every
//! unstructured sparsity and N:M pattern, stored densely, and where the engine has the kernels
//! also held as bitmaps (unstructured, Q8_0) and in the compressed 2:4 storage; optionally the
//! first method's 2:4 row with 4-bit values beside a dense Q4_0 baseline; every structured
//! removal. Each row is measured for its zeros, size and quality against the dense model; the
//! rows asked are healed by distillation and measured again; then all are timed, each right
//! after its baseline.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use frugal::convert::Target;
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::{GgmlType, kernels, sparse};
use frugal::surgery::prune::structured::StructuredTarget;
use frugal::surgery::prune::{self, Method, Pattern, PruneStats};
use frugal_train::data::Corpus;
use frugal_train::teacher::OnlineTeachers;

use crate::build;
use crate::candidate::Candidate;
use crate::heal::Recovery;
use crate::progress::{self, OnProgress, Progress};
use crate::quality::{self, Quality};
use crate::size::{self, Footprint};
use crate::timing::{self, Paired, SpeedTest};

/// What a row's weights lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Kind {
    Dense,
    Unstructured,
    NofM,
    Structured,
}

/// What the study builds and how it measures.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Methods of the unstructured and N:M rows.
    pub methods: Vec<Method>,
    pub sparsities: Vec<f64>,
    /// N:M patterns.
    pub patterns: Vec<Pattern>,
    /// Structured removals, each with the spec it was written as (its row's name).
    pub structured: Vec<(String, StructuredTarget)>,
    /// Storage of the pruned matrices and of their dense baseline.
    pub format: GgmlType,
    /// Also the first method's 2:4 row with 4-bit values, dense and compressed, beside a dense
    /// Q4_0 baseline.
    pub four_bit: bool,
    /// Keys of the rows healed: `method@pattern` (`wanda@0.5`, `wanda@2:4`), or `structured`
    /// for every structured row.
    pub recover: Vec<String>,
    /// Distillation steps per healed row (0: none healed).
    pub heal_steps: usize,
    /// Each turn's speed test; every row takes `reps` turns.
    pub speed: SpeedTest,
    pub reps: usize,
}

/// What the study measures against and with.
pub struct Inputs<'a> {
    /// The dense model (8-bit activations): every row's quality is measured against it.
    pub base: &'a Model,
    /// Its file's bytes as stored: the first row.
    pub stored: Vec<u8>,
    /// Text whose activations score the weights (Wanda, SparseGPT, structured importance).
    pub calib: &'a [u32],
    /// Held-out text of every perplexity and KL, in windows of `ctx`.
    pub eval: &'a [u32],
    pub ctx: usize,
    /// Healing: the text it trains on, the teacher, the schedule.
    pub data: &'a Corpus,
    pub teachers: &'a OnlineTeachers,
    pub recovery: Recovery,
    /// Scratch directory for the rows' files while they wait to be timed (created, then
    /// removed).
    pub work: &'a Path,
}

/// One row, measured.
#[derive(Clone, Debug)]
pub struct Row {
    pub candidate: Candidate,
    /// `method@pattern` (with `+bitmap`, `+compressed`, `/q4` where those apply),
    /// `structured`, or `dense`, `dense-format`, `dense-q4`.
    pub key: String,
    pub kind: Kind,
    /// Fraction of the block matrices' weights that are zero.
    pub zeros: f64,
    /// Quality against the dense model after healing, for the rows healed.
    pub after: Option<Quality>,
    /// The key of the row its speed is compared with (same value format, nothing pruned).
    pub base: String,
    /// Held as an unstructured bitmap at run time (`Model::use_bitmap_storage`).
    pub bitmap: bool,
}

/// What the study measured.
pub struct Study {
    pub rows: Vec<Row>,
    /// Calibration tokens the scores read.
    pub calibration_tokens: usize,
}

/// The row `r`'s speed is compared with.
pub fn base_of<'a>(rows: &'a [Row], r: &Row) -> Option<&'a Row> {
    rows.iter().find(|b| b.key == r.base)
}

/// Builds every row of `plan` from `inputs.base`, measures each, heals the rows asked, and
/// times them all.
pub fn run(plan: &Plan, mut inputs: Inputs, progress: OnProgress) -> Result<Study> {
    progress(Progress::Line(format!(
        "calibrating on {} tokens...",
        inputs.calib.len()
    )));
    let ctx = 512.min(inputs.calib.len());
    let sparsegpt = plan.methods.contains(&Method::SparseGpt);
    let stats = prune::collect(inputs.base, inputs.calib, ctx, sparsegpt)?;
    let stored = std::mem::take(&mut inputs.stored);
    let made = build_rows(plan, &inputs.base.file, stored, &stats, progress)?;
    std::fs::create_dir_all(inputs.work)
        .with_context(|| format!("creating {}", inputs.work.display()))?;
    let rows = measure_and_time(plan, &inputs, made, progress);
    let _ = std::fs::remove_dir_all(inputs.work);
    Ok(Study {
        rows: rows?,
        calibration_tokens: stats.tokens,
    })
}

/// A row as built: its file, and how it is named, compared and held.
struct Made {
    name: String,
    key: String,
    kind: Kind,
    base: String,
    bitmap: bool,
    bytes: Vec<u8>,
}

impl Made {
    fn new(name: String, key: &str, kind: Kind, base: &str, bytes: Vec<u8>) -> Made {
        Made {
            name,
            key: key.into(),
            kind,
            base: base.into(),
            bitmap: false,
            bytes,
        }
    }
}

/// Every row's file, in the report's order.
fn build_rows(
    plan: &Plan,
    file: &GgufFile,
    stored: Vec<u8>,
    stats: &PruneStats,
    progress: OnProgress,
) -> Result<Vec<Made>> {
    let dense_in = |format| {
        build::pruned(
            file,
            None,
            Method::Magnitude,
            Pattern::Unstructured(0.0),
            format,
        )
    };
    let f = plan.format;
    let mut made = vec![
        Made::new(
            "dense (as stored)".into(),
            "dense",
            Kind::Dense,
            "dense",
            stored,
        ),
        Made::new(
            format!("dense, {}", f.name()),
            "dense-format",
            Kind::Dense,
            "dense-format",
            dense_in(f)?,
        ),
    ];
    made.extend(pruned_rows(plan, file, stats, progress)?);
    if let Some(&method) = plan.methods.first().filter(|_| plan.four_bit) {
        progress(Progress::Line(format!(
            "pruning: {method} 2:4, 4-bit values"
        )));
        let two_four = Pattern::NofM { n: 2, m: 4 };
        let q4 = |format| build::pruned(file, Some(stats), method, two_four, format);
        made.extend([
            Made::new(
                "dense, Q4_0".into(),
                "dense-q4",
                Kind::Dense,
                "dense-q4",
                dense_in(GgmlType::Q4_0)?,
            ),
            Made::new(
                format!("{method}, 2:4, Q4_0"),
                &format!("{method}@2:4/q4"),
                Kind::NofM,
                "dense-q4",
                q4(GgmlType::Q4_0)?,
            ),
            Made::new(
                format!("{method}, 2:4, compressed Q4_0_24"),
                &format!("{method}@2:4/q4+compressed"),
                Kind::NofM,
                "dense-q4",
                q4(GgmlType::Q4_0_24)?,
            ),
        ]);
    }
    for (spec, t) in &plan.structured {
        progress(Progress::Line(format!("pruning: structured {spec}")));
        // Re-encoded in the rows' value format, so that its baseline is the dense model in the
        // same format: in the file as stored the head is Q8_0 beside 4-bit layers, a heavier
        // share of every step that no layer surgery touches.
        let (q, r) = build::structured(file, stats, t, Target::Stored(f))?;
        let what = format!(
            "structured {spec} (FFN {}, heads {}/{}, {} layers)",
            r.n_ff.1,
            r.n_head.1,
            r.n_head_kv.1,
            r.kept_layers.len()
        );
        made.push(Made::new(
            what,
            "structured",
            Kind::Structured,
            "dense-format",
            q.raw_bytes().to_vec(),
        ));
    }
    Ok(made)
}

/// Every method at every sparsity and pattern in the plan's format: stored densely, and also
/// as a bitmap (unstructured, where the kernels exist) and compressed (2:4, where the format
/// has a compressed twin).
fn pruned_rows(
    plan: &Plan,
    file: &GgufFile,
    stats: &PruneStats,
    progress: OnProgress,
) -> Result<Vec<Made>> {
    let format = plan.format;
    let compressed = sparse::sparse_type(format);
    let bitmaps = format == GgmlType::Q8_0 && kernels::sparse_available(kernels::detect());
    let patterns = plan
        .sparsities
        .iter()
        .map(|&s| (Pattern::Unstructured(s), Kind::Unstructured))
        .chain(plan.patterns.iter().map(|&p| (p, Kind::NofM)));
    let patterns: Vec<(Pattern, Kind)> = patterns.collect();
    let two_four = Pattern::NofM { n: 2, m: 4 };
    let prune_to =
        |method, pattern, format| build::pruned(file, Some(stats), method, pattern, format);
    let mut made = Vec::new();
    for &method in &plan.methods {
        for &(pattern, kind) in &patterns {
            progress(Progress::Line(format!("pruning: {method} {pattern}")));
            let key = match pattern {
                Pattern::Unstructured(s) => format!("{method}@{s}"),
                Pattern::NofM { n, m } => format!("{method}@{n}:{m}"),
            };
            let bytes = prune_to(method, pattern, format)?;
            let row =
                |name: String, key: &str, bytes| Made::new(name, key, kind, "dense-format", bytes);
            if kind == Kind::Unstructured && bitmaps {
                made.push(Made {
                    bitmap: true,
                    ..row(
                        format!("{method}, {pattern}, bitmap"),
                        &format!("{key}+bitmap"),
                        bytes.clone(),
                    )
                });
            }
            made.push(row(format!("{method}, {pattern}"), &key, bytes));
            if let Some(c) = compressed.filter(|_| pattern == two_four) {
                made.push(row(
                    format!("{method}, {pattern}, compressed {}", c.name()),
                    &format!("{key}+compressed"),
                    prune_to(method, pattern, c)?,
                ));
            }
        }
    }
    Ok(made)
}

/// A row measured but not yet timed.
struct Untimed {
    made: Made,
    size: Footprint,
    zeros: f64,
    quality: Quality,
    after: Option<Quality>,
}

/// Measures every row, healing those asked, then times them all (each right after its
/// baseline) and puts the rows together.
fn measure_and_time(
    plan: &Plan,
    inputs: &Inputs,
    made: Vec<Made>,
    progress: OnProgress,
) -> Result<Vec<Row>> {
    // Each row's bytes wait on disk for the speed runs: holding 30-odd models in memory at once
    // made some of them decode measurably slower than the same file alone in a process
    // (structured ffn:0.25 0.99x in-process against 1.18x as separate `frugal bench` runs, same
    // minutes), so each is loaded only while it is timed.
    let mut files = Vec::new();
    let mut measured = Vec::new();
    for m in made {
        let file = inputs.work.join(format!("row{}.gguf", files.len()));
        std::fs::write(&file, &m.bytes).with_context(|| format!("writing {}", file.display()))?;
        files.push(file);
        measured.push(measure(plan, inputs, m, progress)?);
    }
    let speeds = time(plan, &measured, &files, progress)?;
    Ok(measured
        .into_iter()
        .zip(speeds)
        .map(|(u, speed)| Row {
            candidate: Candidate {
                name: u.made.name,
                size: u.size,
                quality: u.quality,
                speed,
            },
            key: u.made.key,
            kind: u.made.kind,
            zeros: u.zeros,
            after: u.after,
            base: u.made.base,
            bitmap: u.made.bitmap,
        })
        .collect())
}

/// Whether the plan heals the row `m` (never a bitmap row: it computes its twin's logits).
fn heals(plan: &Plan, m: &Made) -> bool {
    let asked = |k: &str| plan.recover.iter().any(|r| r == k);
    plan.heal_steps > 0
        && !m.bitmap
        && (asked(&m.key) || (m.kind == Kind::Structured && asked("structured")))
}

/// One row's zeros, size and quality against the dense model, and after healing if asked.
fn measure(plan: &Plan, inputs: &Inputs, mut made: Made, progress: OnProgress) -> Result<Untimed> {
    progress(Progress::Line(format!("measuring: {}", made.name)));
    let m = build::load(std::mem::take(&mut made.bytes), made.bitmap)?;
    let size = Footprint::of(&m.file);
    let zeros = size::zero_fraction(&m.file)?;
    let quality = quality::against(&m, inputs.base, inputs.eval, inputs.ctx)?;
    let after = if heals(plan, &made) {
        progress(Progress::Line(format!("recovering: {}", made.name)));
        // Structured rows have no zeros to keep; the others keep theirs by masked updates.
        let how = (made.kind != Kind::Structured, Target::Stored(plan.format));
        let steps = plan.heal_steps;
        let on_event = progress::training(&mut *progress, steps);
        let r = &inputs.recovery;
        let (_, h) = r.heal(&m, steps, inputs.data, inputs.teachers, how, on_event)?;
        Some(quality::against(&h, inputs.base, inputs.eval, inputs.ctx)?)
    } else {
        None
    };
    Ok(Untimed {
        made,
        size,
        zeros,
        quality,
        after,
    })
}

/// Every row timed for `plan.reps` rounds, rows taking turns within each round, each right
/// after its baseline: on a shared machine the load drifts within a run, and a ratio of two
/// neighbouring measurements cancels most of it.
fn time(
    plan: &Plan,
    rows: &[Untimed],
    files: &[PathBuf],
    progress: OnProgress,
) -> Result<Vec<Paired>> {
    let base_index: Vec<usize> = rows
        .iter()
        .map(|r| {
            let base = |b: &Untimed| b.made.key == r.made.base;
            rows.iter().position(base).unwrap_or(0)
        })
        .collect();
    let timed = timing::back_to_back(
        rows.len(),
        plan.reps,
        |i| Some(base_index[i]),
        |i| {
            let bytes = std::fs::read(&files[i])
                .with_context(|| format!("reading {}", files[i].display()))?;
            plan.speed
                .measure(&build::load(bytes, rows[i].made.bitmap)?)
        },
        |t| {
            let (p, tg) = (t.speed.prefill, t.speed.decode);
            progress(Progress::Line(format!(
                "speed, run {}: {}: pp {p:.1} tg {tg:.1}{}",
                t.round + 1,
                rows[t.candidate].made.name,
                t.vs_base.map_or(String::new(), |v| format!(
                    " ({:.2}x, {:.2}x its baseline)",
                    v.prefill, v.decode
                ))
            )));
        },
    )?;
    Ok(timed.candidates)
}
