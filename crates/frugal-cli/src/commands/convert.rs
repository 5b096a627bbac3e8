//! `frugal convert`: model surgery on the attention layout (KV heads regrouped: MHA, GQA, MQA).

use std::path::PathBuf;

use anyhow::{Context, Result};
use frugal::gguf::GgufFile;
use frugal::surgery::{self, AttentionLayout};

use super::common::human_bytes;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model to read (GGUF, a Llama-family GQA or MHA model)
    pub input: PathBuf,
    /// The GGUF file to write
    pub output: PathBuf,
    /// The attention layout to write: `mha` (every query head its own KV head: exact, the
    /// largest cache), `gqa:G` (G KV heads, each the mean of the heads its query heads read, as
    /// the GQA paper builds them) or `mqa` (one KV head for all)
    #[arg(long = "attention", value_name = "LAYOUT")]
    pub attention: AttentionLayout,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<()> {
    anyhow::ensure!(
        a.input != a.output,
        "the output would overwrite the input ({}); choose another path",
        a.input.display()
    );
    let file = GgufFile::open(&a.input)?;
    let (w, report) = surgery::convert_attention(&file, a.attention)
        .with_context(|| format!("converting {}", a.input.display()))?;
    w.write_file(&a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
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
