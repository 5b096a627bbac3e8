//! `frugal convert`: model surgery on the attention layout: KV heads regrouped (MHA, GQA, MQA)
//! or converted to multi-head latent attention (MLA, calibrated).

use std::path::PathBuf;

use anyhow::{Context, Result};
use frugal::gguf::{GgufFile, GgufWriter};
use frugal::model::Model;
use frugal::surgery::{self, AttentionLayout, Factorization, MlaTarget};
use frugal::tokenizer::Tokenizer;

use super::common::human_bytes;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model to read (GGUF, a Llama-family GQA or MHA model)
    #[arg(value_parser = super::common::model_arg)]
    pub input: PathBuf,
    /// The GGUF file to write
    pub output: PathBuf,
    /// The attention layout to write: `mha` (every query head its own KV head: exact, the
    /// largest cache), `gqa:G` (G KV heads, each the mean of the heads its query heads read, as
    /// the GQA paper builds them), `mqa` (one KV head for all), or `mla:RANK[:ROPE_DIMS]`
    /// (latent attention: a latent of RANK values plus a shared RoPE key of ROPE_DIMS, default
    /// 16, per token and layer; needs --calibration; written as llama.cpp's deepseek2)
    #[arg(long = "attention", value_name = "LAYOUT")]
    pub attention: String,
    /// Text whose activations calibrate an MLA conversion (RoPE pairs kept, shared key, latent)
    #[arg(long = "calibration", value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Calibration tokens taken from the start of --calibration
    #[arg(long = "calibration-tokens", default_value_t = 2048)]
    pub calibration_tokens: usize,
    /// How MLA factorizes the keys and values into the latent: `activations` (PCA of their
    /// outputs on the calibration text) or `svd` (of the weights alone)
    #[arg(long = "factorization", default_value = "activations")]
    pub factorization: Factorization,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
}

/// Writes the converted file, and the report as JSON when asked (then returns true: nothing more
/// to print).
fn write(a: &Args, w: &GgufWriter, report: &impl serde::Serialize) -> Result<bool> {
    w.write_file(&a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(report)?);
    }
    Ok(a.json)
}

/// `mla:RANK[:ROPE_DIMS]`, or `None` for a regrouping layout.
fn parse_mla(s: &str, factorization: Factorization) -> Result<Option<MlaTarget>> {
    let Some(rest) = s
        .to_ascii_lowercase()
        .strip_prefix("mla:")
        .map(str::to_string)
    else {
        return Ok(None);
    };
    let mut parts = rest.split(':');
    let num = |p: Option<&str>, what: &str| -> Result<Option<usize>> {
        p.map(|v| {
            v.parse::<usize>()
                .map_err(|_| anyhow::anyhow!("{s}: the {what} must be a whole number, not {v:?}"))
        })
        .transpose()
    };
    let rank = num(parts.next(), "latent rank")?
        .ok_or_else(|| anyhow::anyhow!("{s}: give the latent rank, e.g. mla:96"))?;
    let rope_dims = num(parts.next(), "RoPE dims")?.unwrap_or(16);
    anyhow::ensure!(parts.next().is_none(), "{s}: expected mla:RANK[:ROPE_DIMS]");
    Ok(Some(MlaTarget {
        rank,
        rope_dims,
        factorization,
    }))
}

pub fn run(mut a: Args) -> Result<()> {
    a.input = super::common::input_model(Some(&a.input))?;
    anyhow::ensure!(
        a.input != a.output,
        "the output would overwrite the input ({}); choose another path",
        a.input.display()
    );
    if let Some(target) = parse_mla(&a.attention, a.factorization)? {
        return run_mla(&a, target);
    }
    let layout: AttentionLayout = a.attention.parse().map_err(anyhow::Error::msg)?;
    let file = GgufFile::open(&a.input)?;
    let (w, report) = surgery::convert_attention(&file, layout)
        .with_context(|| format!("converting {}", a.input.display()))?;
    if write(&a, &w, &report)? {
        return Ok(());
    }
    println!(
        "{} -> {}: {} query heads, KV heads {} -> {} ({} copied exactly, {} mean-pooled)",
        a.input.display(),
        a.output.display(),
        report.n_head,
        report.kv_heads_before,
        report.kv_heads_after,
        report.heads_copied,
        report.heads_pooled,
    );
    println!(
        "KV cache per token: {} -> {} values ({:.2}x); K/V projections {} -> {}",
        report.kv_elements_before,
        report.kv_elements_after,
        report.kv_elements_after as f64 / report.kv_elements_before as f64,
        human_bytes(report.kv_weight_bytes_before),
        human_bytes(report.kv_weight_bytes_after),
    );
    if report.exact() {
        println!("exact: the new file computes the same function");
    } else {
        println!(
            "approximate: pooled heads change the function; distill to recover \
             (frugal distill --teacher {} --student {})",
            a.input.display(),
            a.output.display()
        );
    }
    Ok(())
}

fn run_mla(a: &Args, target: MlaTarget) -> Result<()> {
    let calib_path = a.calibration.as_ref().ok_or_else(|| {
        anyhow::anyhow!(
            "mla needs --calibration FILE: a text whose activations guide the conversion"
        )
    })?;
    let text = std::fs::read_to_string(calib_path)
        .with_context(|| format!("reading {}", calib_path.display()))?;
    let model = Model::load(&a.input)?;
    let tok = Tokenizer::from_gguf(&model.file)?;
    let mut tokens = tok.encode(&text, false)?;
    tokens.truncate(a.calibration_tokens.max(2));
    let t0 = std::time::Instant::now();
    let calib = surgery::calibrate(&model, &tokens, 512)?;
    // The model's own map of the file (f32 activations: nothing was repacked or released).
    let (w, report) = surgery::convert_to_mla(&model.file, &calib, target)
        .with_context(|| format!("converting {}", a.input.display()))?;
    if write(a, &w, &report)? {
        return Ok(());
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    println!(
        "{} -> {}: MLA, latent {} + RoPE key {} = {} cached values per token and layer (was {}: {:.2}x), {} factorization, {} calibration tokens, {:.1} s",
        a.input.display(),
        a.output.display(),
        target.rank,
        target.rope_dims,
        report.cache_values_after,
        report.cache_values_before,
        report.cache_values_after as f64 / report.cache_values_before as f64,
        target.factorization,
        report.calibration_rows,
        t0.elapsed().as_secs_f64()
    );
    println!(
        "RoPE: pairs 0, {s}, {}, ... kept (stride {s}, {:.1}% of the measured q.k contribution; rope base {}); shared key holds {:.1}% of their key energy (mean over layers)",
        2 * report.rope_stride,
        100.0
            * report
                .stride_scores
                .iter()
                .find(|x| x.0 == report.rope_stride)
                .map_or(0.0, |x| x.1),
        report.rope_base,
        100.0 * mean(&report.shared_key_energy),
        s = report.rope_stride,
    );
    println!(
        "latent keeps {:.1}% of the position-free keys' and values' energy (mean over layers); distill to recover the rest",
        100.0 * mean(&report.latent_energy)
    );
    Ok(())
}
