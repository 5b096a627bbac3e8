//! `frugal quantize`: write a model in another storage format (a mixed-precision policy).

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use frugal::convert::{self, Action, Policy, Rule, Target};
use frugal::gguf::GgufFile;
use frugal::surgery::importance::Importance;

use super::common::human_bytes;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model to read (GGUF)
    #[arg(value_parser = super::common::model_arg)]
    pub input: PathBuf,
    /// The GGUF file to write
    pub output: PathBuf,
    /// Target type for the weight matrices: f32, f16, bf16, q8_0, q6_k, q5_k, q5_1, q5_0, q4_k,
    /// q4_1, q4_0, iq4_xs, iq4_nl, mxfp4, q3_k, q2_k. (f32 gives the exact dequantization: the
    /// reference for KL measurements.)
    #[arg(long = "type", value_name = "TYPE")]
    pub ty: String,
    /// Override the type of the tensors matching a glob, e.g. `--keep 'blk.*.ffn_down.weight=q8_0'`
    /// (repeatable; first match wins). Defaults: 1-D tensors stay F32, the embedding and output
    /// are kept at Q8_0 (or the target, if it is a float type).
    #[arg(long = "keep", value_name = "TENSOR_GLOB=TYPE")]
    pub keep: Vec<String>,
    /// Print one JSON object (with the per-tensor plan) instead of text
    #[arg(long)]
    pub json: bool,
    /// With --calibration: importance-weighted encoding (as llama.cpp's imatrix). The mean
    /// square of each matrix input column over the text weights each block's least-squares
    /// fit (Q4_0, Q5_0, Q4_K; other formats are encoded as usual). The file stays standard GGUF.
    #[command(flatten)]
    pub calib: super::common::CalibrationArgs,
    /// Importance from llama.cpp's `llama-imatrix` output (its GGUF format) instead of
    /// measuring it with --calibration
    #[arg(long = "imatrix", value_name = "FILE", conflicts_with = "calibration")]
    pub imatrix: Option<PathBuf>,
}

pub fn run(mut a: Args) -> Result<()> {
    a.input = super::common::input_model(Some(&a.input))?;
    let target: Target = a.ty.parse()?;
    let rules = a
        .keep
        .iter()
        .map(|r| r.parse::<Rule>())
        .collect::<Result<Vec<_>, _>>()?;
    let mut policy = Policy::new(target);
    policy.rules = rules;
    anyhow::ensure!(
        a.input != a.output,
        "the output would overwrite the input ({}); choose another path",
        a.input.display()
    );
    let file = GgufFile::open(&a.input)?;
    let t0 = std::time::Instant::now();
    if a.calib.calibration.is_some() {
        let model = frugal::model::Model::load(&a.input)
            .with_context(|| format!("loading {} for calibration", a.input.display()))?;
        policy.importance = a.calib.importance(&model)?.map(std::sync::Arc::new);
    } else if let Some(path) = &a.imatrix {
        let imp = Importance::read_llama_imatrix(path)?;
        eprintln!(
            "importance of {} matrices from {}",
            imp.len(),
            path.display()
        );
        policy = policy.with_importance(imp);
    }
    let report = convert::quantize_file(&file, &policy, &a.output, |_, _| {})
        .with_context(|| format!("writing {}", a.output.display()))?;
    let secs = t0.elapsed().as_secs_f64();

    // Already-quantized sources: allowed, but each rounding adds to the previous one's error.
    let mut requant: BTreeMap<&str, usize> = BTreeMap::new();
    for t in report
        .tensors
        .iter()
        .filter(|t| t.action != Action::Keep && !matches!(t.from.name(), "F32" | "F16" | "BF16"))
    {
        *requant.entry(t.from.name()).or_default() += 1;
    }
    if !requant.is_empty() {
        let list: Vec<String> = requant.iter().map(|(k, v)| format!("{v} {k}")).collect();
        eprintln!(
            "warning: re-quantizing already quantized tensors ({}): the new rounding error adds to the old one; quantize from an F32/F16/BF16 source when you have one",
            list.join(", ")
        );
    }
    // Fallbacks, one line per distinct reason (a model has the same shapes in every layer).
    let mut fallbacks: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for t in &report.tensors {
        if let Some(n) = t.note.as_deref().filter(|n| n.contains("stored as")) {
            fallbacks.entry(n).or_default().push(&t.name);
        }
    }
    for (why, names) in &fallbacks {
        eprintln!(
            "note: {} tensors ({}{}): {why}",
            names.len(),
            names[0],
            if names.len() > 1 { ", ..." } else { "" }
        );
    }

    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["seconds"] = secs.into();
        v["output"] = a.output.display().to_string().into();
        println!("{v}");
        return Ok(());
    }
    let ratio = report.bytes_after as f64 / report.bytes_before.max(1) as f64;
    println!(
        "wrote {} ({target}): tensor data {} -> {} ({:.1}% of the original), {:.1} s",
        a.output.display(),
        human_bytes(report.bytes_before),
        human_bytes(report.bytes_after),
        100.0 * ratio,
        secs
    );
    let n_params: u64 = report.types_after().iter().map(|(_, n)| n).sum();
    for (ty, n) in report.types_after() {
        println!(
            "  {:<6} {:>12} parameters ({:.1}%)",
            ty.name(),
            n,
            100.0 * n as f64 / n_params.max(1) as f64
        );
    }
    let kept = report
        .tensors
        .iter()
        .filter(|t| t.action == Action::Keep)
        .count();
    let weighted = report.tensors.iter().filter(|t| t.weighted()).count();
    println!(
        "  {} tensors re-encoded{}, {} copied unchanged{}",
        report.tensors.len() - kept,
        if weighted > 0 {
            format!(" ({weighted} importance-weighted)")
        } else {
            String::new()
        },
        kept,
        report
            .file_type
            .map(|f| format!("; general.file_type = {f}"))
            .unwrap_or_default()
    );
    Ok(())
}
