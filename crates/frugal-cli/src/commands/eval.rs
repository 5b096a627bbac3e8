//! `frugal eval`: quality measurements.

use std::path::PathBuf;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use frugal::attention::Attention;
use frugal::eval::EvalOptions;
use frugal::kv::{KvLayout, KvOptions};

use super::common::{self, EngineArgs, ModelArgs};

#[derive(clap::Subcommand, Debug)]
pub enum EvalCommand {
    /// Perplexity of a text, computed as llama.cpp's llama-perplexity does (non-overlapping
    /// windows of --ctx tokens, the second half of each scored).
    Perplexity(PerplexityArgs),
}

#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    /// The text file to score
    #[arg(long)]
    pub text: PathBuf,
    /// Window length in tokens
    #[arg(short = 'c', long = "ctx", default_value_t = 512)]
    pub ctx: usize,
    /// Also run the reference path (f32 KV cache, naive attention) on every window and report
    /// the KL divergence of this configuration from it
    #[arg(long)]
    pub kld: bool,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(c: EvalCommand) -> Result<()> {
    match c {
        EvalCommand::Perplexity(a) => perplexity(a),
    }
}

fn perplexity(a: PerplexityArgs) -> Result<()> {
    let bytes = std::fs::read(&a.text).with_context(|| format!("reading {}", a.text.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (at byte {})",
            a.text.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let opts = EvalOptions {
        kv: a.engine.kv_options()?,
        attention: a.engine.attention()?,
        baseline: a.kld.then_some((
            KvOptions {
                layout: KvLayout::Contiguous,
                ..KvOptions::default()
            },
            Attention::Naive,
        )),
    };
    let (model, tok) = common::load(&a.model)?;
    let tokens = tok.encode(&text, false)?;
    let bar = ProgressBar::new((tokens.len() / a.ctx.max(1)) as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} windows, eta {eta}")
            .expect("valid template"),
    );
    bar.set_message("perplexity");
    let t0 = std::time::Instant::now();
    let r = frugal::eval::perplexity_with(&model, &tokens, a.ctx, &opts, |done, _| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["text_tokens"] = tokens.len().into();
        v["seconds"] = secs.into();
        v["tokens_per_s"] = ((r.windows * r.ctx) as f64 / secs).into();
        v["attention"] = serde_json::to_value(opts.attention)?;
        v["kv"] = serde_json::to_value(opts.kv)?;
        v["kv_bytes_per_token"] = opts
            .kv
            .format
            .bytes_per_token(model.config.n_layers, model.config.kv_dim())
            .into();
        println!("{v}");
    } else {
        let windows: Vec<String> = r.window_ppl.iter().map(|p| format!("{p:.3}")).collect();
        println!("per-window PPL: {}", windows.join(" "));
        println!(
            "PPL = {:.4} +/- {:.4} ({} tokens scored in {} windows of {}; {} text tokens; {:.1} s, {:.0} tok/s)",
            r.ppl,
            r.ppl_stderr,
            r.tokens,
            r.windows,
            r.ctx,
            tokens.len(),
            secs,
            (r.windows * r.ctx) as f64 / secs
        );
        println!(
            "attention {}, KV cache {} ({} B per token)",
            opts.attention,
            opts.kv.format,
            opts.kv
                .format
                .bytes_per_token(model.config.n_layers, model.config.kv_dim())
        );
        if let Some(kl) = &r.kl {
            println!(
                "vs f32 KV + naive attention (PPL {:.4}): mean KLD {:.6}, 99% KLD {:.6}, max KLD {:.6}, same top token {:.2}%",
                kl.baseline_ppl,
                kl.mean_kld,
                kl.p99_kld,
                kl.max_kld,
                100.0 * kl.same_top
            );
        }
    }
    Ok(())
}
