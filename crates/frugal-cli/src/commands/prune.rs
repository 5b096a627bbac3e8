//! `frugal prune`: fewer weights. Unstructured or N:M sparsity by magnitude, Wanda or
//! SparseGPT (the matrices keep their shapes and get exact zeros), or structured removal of FFN
//! neurons, KV groups and layers (the tensors shrink). Writes a GGUF that llama.cpp loads.

use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use frugal::eval;
use frugal::gguf::{GgufFile, GgufWriter};
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal::surgery::prune::structured::{self, StructuredTarget};
use frugal::surgery::prune::{self, Method, Pattern, PruneTarget};

use super::common::{CalibrationArgs, human_bytes};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model to prune (GGUF, a Llama-family model)
    #[arg(value_parser = super::common::model_arg)]
    pub input: PathBuf,
    /// The GGUF file to write
    pub output: PathBuf,
    /// How weights are scored: magnitude (|w|), wanda (|w|·||x||, needs --calibration) or
    /// sparsegpt (layer-wise reconstruction, needs --calibration)
    #[arg(long = "method", default_value = "wanda")]
    pub method: Method,
    /// Fraction of each row's weights removed (unstructured)
    #[arg(long = "sparsity", conflicts_with = "pattern")]
    pub sparsity: Option<f64>,
    /// N:M sparsity: keep N of every M consecutive weights of a row (2:4, 4:8)
    #[arg(long = "pattern", value_name = "N:M")]
    pub pattern: Option<String>,
    /// Storage of the pruned matrices: a format that stores exact zeros (q8_0, q4_0, q5_0, q6_k,
    /// f16, bf16, f32), or with --pattern 2:4 the compressed 2:4 storage q8_0_24 (5.5 bits per
    /// weight) or q4_0_24 (3.5), which only frugal reads
    #[arg(long = "format", default_value = "q8_0")]
    pub format: String,
    /// Structured removal instead: `ffn:FRACTION` (neurons of every layer), `heads:N` (KV groups
    /// of every layer, with their query heads), `layers:N` (whole layers), comma-separated
    #[arg(long = "structured", value_name = "SPEC", conflicts_with_all = ["sparsity", "pattern"])]
    pub structured: Option<String>,
    /// How layers are ranked for `layers:N`: bi (block influence, 1 - cos(input, output)) or
    /// loss (the calibration loss increase when the layer is skipped: one evaluation per layer)
    #[arg(long = "layer-importance", default_value = "bi")]
    pub layer_importance: String,
    /// The calibration text (Wanda, SparseGPT and structured importance)
    #[command(flatten)]
    pub calib: CalibrationArgs,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
}

fn calibration_tokens(a: &Args, model: &Model) -> Result<Vec<u32>> {
    a.calib.tokens(model)?.context(
        "this pruning reads activations: give --calibration FILE (a text of at least one window)",
    )
}

fn write(a: &Args, w: &GgufWriter) -> Result<()> {
    let tmp = a.output.with_extension("tmp.gguf");
    w.write_file(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &a.output).with_context(|| format!("writing {}", a.output.display()))
}

pub fn run(mut a: Args) -> Result<()> {
    a.input = super::common::input_model(Some(&a.input))?;
    ensure!(
        a.input != a.output,
        "the output would overwrite the input ({}); choose another path",
        a.input.display()
    );
    let model = Model::load(&a.input)?;
    if let Some(spec) = &a.structured {
        return run_structured(&a, &model, spec);
    }
    let pattern: Pattern = match (a.sparsity, &a.pattern) {
        (Some(s), None) => {
            let p = Pattern::Unstructured(s);
            p.check(1).map_err(anyhow::Error::msg)?;
            p
        }
        (None, Some(p)) => p.parse().map_err(anyhow::Error::msg)?,
        _ => bail!("give --sparsity S (unstructured), --pattern N:M, or --structured SPEC"),
    };
    let format = GgmlType::from_name(&a.format)
        .with_context(|| format!("--format {}: not a GGUF type", a.format))?;
    let stats = if a.method.needs_calibration() {
        let ids = calibration_tokens(&a, &model)?;
        Some(prune::collect(
            &model,
            &ids,
            a.calib.calibration_ctx,
            a.method == Method::SparseGpt,
        )?)
    } else {
        None
    };
    let t0 = std::time::Instant::now();
    let target = PruneTarget {
        method: a.method,
        pattern,
        format,
    };
    let (w, r) = prune::prune_weights(&model.file, stats.as_ref(), target)?;
    write(&a, &w)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "{} -> {}: {} ({}), {} matrices, {:.1}% of {} weights zero, stored as {}: {} -> {} ({:.1} s)",
        a.input.display(),
        a.output.display(),
        r.pattern,
        r.method,
        r.matrices,
        100.0 * r.sparsity(),
        r.weights,
        r.format,
        human_bytes(r.bytes_before),
        human_bytes(r.bytes_after),
        t0.elapsed().as_secs_f64()
    );
    if frugal::quant::sparse::is_sparse(format) {
        println!(
            "stored compressed: the kept half and 2-bit positions, {:.1} bits per weight. Only frugal reads {} (llama.cpp refuses type {}); `frugal quantize {} DENSE.gguf --type {}` writes the same weights densely",
            format.bits_per_weight(),
            a.output.display(),
            format,
            a.output.display(),
            frugal::quant::sparse::dense_type(format)
                .map_or("q8_0", |t| t.name())
                .to_lowercase()
        );
    } else {
        println!(
            "stored densely: the zeros take the bytes and the multiply-adds they did; distill to recover (frugal distill --teacher {} --student {})",
            a.input.display(),
            a.output.display()
        );
    }
    Ok(())
}

fn run_structured(a: &Args, model: &Model, spec: &str) -> Result<()> {
    let target: StructuredTarget = spec
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--structured {e}"))?;
    let ids = calibration_tokens(a, model)?;
    let stats = prune::collect(model, &ids, a.calib.calibration_ctx, false)?;
    let importance = match a.layer_importance.as_str() {
        "bi" => None,
        "loss" if target.layers > 0 => Some(loss_importance(model, &ids, a.calib.calibration_ctx)?),
        "loss" => None,
        other => bail!("--layer-importance {other:?}: use bi or loss"),
    };
    let (w, r) = structured::prune_structured(&model.file, &stats, &target, importance)?;
    write(a, &w)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "{} -> {}: FFN {} -> {}, heads {}/{} -> {}/{}, layers {} -> {} (kept {:?})",
        a.input.display(),
        a.output.display(),
        r.n_ff.0,
        r.n_ff.1,
        r.n_head.0,
        r.n_head_kv.0,
        r.n_head.1,
        r.n_head_kv.1,
        r.layer_importance.len(),
        r.kept_layers.len(),
        r.kept_layers
    );
    println!(
        "parameters {} -> {} ({:.1}%), weights {} -> {}",
        r.params.0,
        r.params.1,
        100.0 * r.params.1 as f64 / r.params.0 as f64,
        human_bytes(r.bytes.0),
        human_bytes(r.bytes.1)
    );
    Ok(())
}

/// Each layer's importance as the calibration loss increase when it is skipped.
fn loss_importance(model: &Model, ids: &[u32], ctx: usize) -> Result<Vec<f64>> {
    let base = eval::perplexity(model, ids, ctx, |_, _| {})?.nll;
    let n = model.config.n_layers;
    let mut out = Vec::with_capacity(n);
    for l in 0..n {
        let keep: Vec<usize> = (0..n).filter(|&k| k != l).collect();
        let w = structured::drop_layers(&model.file, &keep)?;
        let m = Model::from_file(GgufFile::from_bytes(w.to_bytes()?)?)?;
        let nll = eval::perplexity(&m, ids, ctx, |_, _| {})?.nll;
        eprint!("\rlayer importance by loss: {}/{n}", l + 1);
        out.push(nll - base);
    }
    eprintln!();
    Ok(out)
}
