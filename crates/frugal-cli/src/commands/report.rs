//! `frugal report`: tables that combine several measurements of frugal's own.
//!
//! `report quant` is the format table of docs/quantization.md: for each storage format, the
//! model is re-encoded in memory from the source file (norms F32, embedding/output Q8_0, as
//! `quantize` does), then measured: bits per weight and size, perplexity and KL divergence against the
//! exact dequantization of the source (one pass over the same windows), and pp/tg throughput.

use std::path::PathBuf;

use anyhow::{Context, Result};
use frugal::convert::Target;
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;
use frugal_lab::size::{self, Footprint};
use frugal_lab::timing::SpeedTest;
use frugal_lab::{build, quality};

use super::common::{self, ModelArgs};

#[derive(clap::Subcommand, Debug)]
pub enum ReportCommand {
    /// Every storage format side by side: bits/weight, size, PPL, KL to the exact model, speed.
    Quant(QuantArgs),
    /// The distillation experiment (docs/distillation.md): a third-depth student as cut, after
    /// hard-label training and after distillation at several temperatures, cached top-k, an
    /// ensemble, another architecture; curves and speeds.
    Distill(super::report_distill::Args),
    /// Attention layouts (docs/attention-layouts.md): MHA, the original GQA, MQA and MLA at
    /// several ranks: KV bytes per token, quality before and after distillation, decode speed.
    Attention(super::report_attention::Args),
    /// Pruning (docs/pruning.md): magnitude, Wanda and SparseGPT at several sparsities and N:M
    /// patterns, structured removal; quality before and after recovery, bytes, speed.
    Prune(super::report_prune::Args),
    /// Mixture of experts (docs/moe.md): MoEfied and upcycled variants, router training under
    /// each balancing mode, whole-model distillation; parameters, quality, routing load, speed.
    Moe(super::report_moe::Args),
    /// The composition matrix (docs/composition.md): each lever alone, pairs and the full
    /// ladder on each model, measured in one run, and what composed better than any lever.
    Composition(super::report_composition::Args),
}

#[derive(clap::Args, Debug)]
pub struct QuantArgs {
    /// The text to score
    #[arg(long)]
    pub text: PathBuf,
    /// Window length in tokens
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Formats to measure (GGUF types or research formats); `source` is the file as it is
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "f16,q8_0,q6_k,q5_0,q4_k,source,q4_0,mxfp4"
    )]
    pub types: Vec<String>,
    /// Prefill tokens of the speed test (0 skips)
    #[arg(short = 'p', long = "prompt", default_value_t = 512)]
    pub prompt: usize,
    /// Generated tokens of the speed test (0 skips)
    #[arg(short = 'n', long = "gen", default_value_t = 128)]
    pub gen_tokens: usize,
    /// Activation precisions to measure each format under (q8, q8-full, f32), comma-separated;
    /// default: the --activations value. Float formats always run f32.
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<Activations>,
    /// Print one JSON object instead of a Markdown table
    #[arg(long)]
    pub json: bool,
    /// Formats to measure again with importance-weighted encoding (needs --calibration):
    /// `Q4_0 + imatrix` rows beside the plain ones
    #[arg(
        long = "imatrix-types",
        value_delimiter = ',',
        default_value = "q4_0,q5_0,q4_k"
    )]
    pub imatrix_types: Vec<String>,
    #[command(flatten)]
    pub calib: common::CalibrationArgs,
    /// Other GGUF files of the same model to score in the same table, as LABEL=FILE (for
    /// instance llama.cpp's `llama-quantize --imatrix` outputs); repeatable
    #[arg(long = "file", value_name = "LABEL=FILE")]
    pub files: Vec<String>,
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(c: ReportCommand) -> Result<()> {
    match c {
        ReportCommand::Quant(a) => quant(a),
        ReportCommand::Distill(a) => super::report_distill::run(a),
        ReportCommand::Attention(a) => super::report_attention::run(a),
        ReportCommand::Prune(a) => super::report_prune::run(a),
        ReportCommand::Composition(a) => super::report_composition::run(a),
        ReportCommand::Moe(a) => super::report_moe::run(a),
    }
}

#[derive(serde::Serialize)]
struct Row {
    format: String,
    activations: Activations,
    bits_per_weight: f64,
    weight_bytes: u64,
    ppl: f64,
    ppl_stderr: f64,
    kl_mean: f64,
    kl_p99: f64,
    top1_agreement: f64,
    pp_tokens_per_s: Option<f64>,
    tg_tokens_per_s: Option<f64>,
}

fn quant(a: QuantArgs) -> Result<()> {
    let path = common::model_path(&a.model)?;
    let text = std::fs::read_to_string(&a.text)
        .with_context(|| format!("reading {} (as UTF-8 text)", a.text.display()))?;
    let source = GgufFile::open(&path).with_context(|| format!("loading {}", path.display()))?;
    let tok = Tokenizer::from_gguf(&source)?;
    let tokens = tok.encode(&text, false)?;
    // The reference: the source's weights, dequantized exactly (f32 activations).
    let reference = Model::load(&path)?;
    let modes = if a.modes.is_empty() {
        vec![a.model.activations]
    } else {
        a.modes.clone()
    };
    let importance = a.calib.importance(&reference)?.map(std::sync::Arc::new);
    // What each row measures: a format encoded from the source (plain, or weighted by the
    // calibration's importance), the source itself, or another file.
    enum Variant<'a> {
        Source,
        Encoded(&'a str, bool),
        File(&'a str, &'a str),
    }
    let mut variants: Vec<Variant> = Vec::new();
    for name in &a.types {
        variants.push(if name == "source" {
            Variant::Source
        } else {
            Variant::Encoded(name, false)
        });
        if importance.is_some() && a.imatrix_types.iter().any(|t| t.eq_ignore_ascii_case(name)) {
            variants.push(Variant::Encoded(name, true));
        }
    }
    for f in &a.files {
        let (label, file) = f
            .split_once('=')
            .with_context(|| format!("--file {f:?} is not LABEL=FILE"))?;
        variants.push(Variant::File(label, file));
    }
    let mut rows = Vec::new();
    for v in &variants {
        let (mut model, label) = match *v {
            Variant::Source => {
                let m = Model::load(&path)?;
                let label = format!(
                    "{} (source)",
                    size::dominant_type(&m.file).unwrap_or_default()
                );
                (m, label)
            }
            Variant::Encoded(name, weighted) => {
                let target: Target = name.parse()?;
                let weights = importance.clone().filter(|_| weighted);
                let file = build::quantized(&source, target, weights)?;
                let label = if weighted {
                    format!("{} + imatrix", name.to_uppercase())
                } else {
                    name.to_uppercase()
                };
                (Model::from_file(file)?, label)
            }
            Variant::File(label, file) => {
                let m = Model::load(file).with_context(|| format!("loading {file}"))?;
                (m, label.to_string())
            }
        };
        let size = Footprint::of(&model.file);
        let speed = SpeedTest::once(a.prompt, a.gen_tokens);
        for &mode in &modes {
            model.set_activations(mode);
            if rows
                .iter()
                .any(|r: &Row| r.format == label && r.activations == model.activations)
            {
                continue; // a float format under another mode: the same f32 run
            }
            eprintln!("{label} ({}): scoring...", model.activations);
            let q = quality::against(&model, &reference, &tokens, a.ctx)?;
            let t = speed.measure(&model)?;
            let measured = |v: f64| (v > 0.0).then_some(v);
            rows.push(Row {
                format: label.clone(),
                activations: model.activations,
                bits_per_weight: size.bits_per_weight(),
                weight_bytes: size.bytes,
                ppl: q.ppl,
                ppl_stderr: q.ppl_stderr,
                kl_mean: q.kl_mean,
                kl_p99: q.kl_p99,
                top1_agreement: q.top1,
                pp_tokens_per_s: measured(t.prefill),
                tg_tokens_per_s: measured(t.decode),
            });
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({ "model": path.display().to_string(), "ctx": a.ctx, "threads": rayon::current_num_threads(), "reference_ppl": reference_ppl(&reference, &tokens, a.ctx)?, "rows": rows })
        );
        return Ok(());
    }
    println!(
        "| format | activations | bits/weight | weights | PPL | mean KL | 99% KL | same top | pp{} tok/s | tg{} tok/s |",
        a.prompt, a.gen_tokens
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let speed = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.1}"));
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {} | {:.4} ± {:.3} | {:.5} | {:.4} | {:.2}% | {} | {} |",
            r.format,
            r.activations,
            r.bits_per_weight,
            common::human_bytes(r.weight_bytes),
            r.ppl,
            r.ppl_stderr,
            r.kl_mean,
            r.kl_p99,
            100.0 * r.top1_agreement,
            speed(r.pp_tokens_per_s),
            speed(r.tg_tokens_per_s)
        );
    }
    println!(
        "\n{} scored tokens, ctx {}, {} threads; reference PPL {:.4}; KL and top-1 against the exact dequantization of the source (f32 activations).",
        (tokens.len() / a.ctx) * (a.ctx - 1 - a.ctx / 2),
        a.ctx,
        rayon::current_num_threads(),
        reference_ppl(&reference, &tokens, a.ctx)?
    );
    Ok(())
}

fn reference_ppl(reference: &Model, tokens: &[u32], ctx: usize) -> Result<f64> {
    Ok(frugal::eval::perplexity(reference, tokens, ctx, |_, _| {})?.ppl)
}
