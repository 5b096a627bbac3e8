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
    /// the KL divergence of this configuration from it. With 8-bit activations (the default) any
    /// difference upstream moves some roundings by a whole step, a floor of about 0.002 even for
    /// an exact change of kernel; add `--activations f32` to measure the cache alone
    #[arg(long)]
    pub kld: bool,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
    /// A reference model (e.g. the F32 file from `frugal quantize --type f32`): both are scored in
    /// the same pass, and the KL divergence of the model's next-token distribution from the
    /// reference's and their top-1 agreement are reported (as llama.cpp's --kl-divergence)
    #[arg(long = "reference", value_name = "BASE.gguf", value_parser = common::model_arg)]
    pub reference: Option<PathBuf>,
    /// A mixture-of-experts model: also print, per layer, how the router sent the scored text's
    /// tokens to experts (as `generate --moe-stats`)
    #[arg(long = "moe-stats")]
    pub moe_stats: bool,
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
    anyhow::ensure!(
        !a.moe_stats || (a.reference.is_none() && !a.kld),
        "--moe-stats counts the model's own pass: drop --reference / --kld"
    );
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
    };
    // The reference path of the same model: f32 contiguous cache, naive attention.
    let baseline = EvalOptions {
        kv: KvOptions {
            layout: KvLayout::Contiguous,
            ..KvOptions::default()
        },
        attention: Attention::Naive,
    };
    let (mut model, tok) = common::load(&a.model)?;
    model.config.set_context(a.ctx);
    let tokens = tok.encode(&text, false)?;
    let bar = ProgressBar::new((tokens.len() / a.ctx.max(1)) as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} windows, eta {eta}")
            .expect("valid template"),
    );
    bar.set_message("perplexity");
    if let Some(reference) = &a.reference {
        anyhow::ensure!(
            !a.kld,
            "--kld and --reference both name what to compare against: give one"
        );
        bar.set_message("perplexity + KL");
        let base = common::load_model(&common::input_model(Some(reference))?, None)?;
        return compare(
            &a,
            (&model, &opts),
            (&base, &EvalOptions::default()),
            &tokens,
            bar,
        );
    }
    if a.kld {
        bar.set_message("perplexity + KL");
        return compare(&a, (&model, &opts), (&model, &baseline), &tokens, bar);
    }
    let t0 = std::time::Instant::now();
    let (r, routing) =
        frugal::eval::perplexity_routed(&model, &tokens, a.ctx, &opts, a.moe_stats, |done, _| {
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
        v["kv_bytes_per_token"] = model
            .config
            .cache_shape()
            .bytes_per_token(model.config.n_layers, opts.kv.format)
            .into();
        if let Some(r) = &routing {
            let layers: Vec<_> = (0..r.load.len()).filter_map(|l| r.layer(l)).collect();
            v["moe_stats"] = serde_json::to_value(layers)?;
        }
        println!("{v}");
    } else {
        if let Some(r) = &routing {
            super::generate::print_routing(r);
        }
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
            model
                .config
                .cache_shape()
                .bytes_per_token(model.config.n_layers, opts.kv.format)
        );
    }
    Ok(())
}

fn compare(
    a: &PerplexityArgs,
    model: (&frugal::model::Model, &EvalOptions),
    reference: (&frugal::model::Model, &EvalOptions),
    tokens: &[u32],
    bar: ProgressBar,
) -> Result<()> {
    let t0 = std::time::Instant::now();
    let c = frugal::eval::compare_with(model, reference, tokens, a.ctx, |done, _| {
        bar.set_position(done as u64)
    })?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    if a.json {
        let mut v = serde_json::to_value(&c.model)?;
        v["text_tokens"] = tokens.len().into();
        v["seconds"] = secs.into();
        v["reference_ppl"] = c.reference.ppl.into();
        v["reference_ppl_stderr"] = c.reference.ppl_stderr.into();
        v["reference_window_ppl"] = serde_json::to_value(&c.reference.window_ppl)?;
        v["kl_mean"] = c.kl_mean.into();
        v["kl_stderr"] = c.kl_stderr.into();
        v["kl_median"] = c.kl_median.into();
        v["kl_p99"] = c.kl_p99.into();
        v["kl_max"] = c.kl_max.into();
        v["top1_agreement"] = c.top1_agreement.into();
        v["positions"] = c.positions.into();
        println!("{v}");
    } else {
        println!(
            "PPL = {:.4} +/- {:.4}; reference PPL = {:.4} +/- {:.4} ({} tokens scored in {} windows of {}; {:.1} s)",
            c.model.ppl,
            c.model.ppl_stderr,
            c.reference.ppl,
            c.reference.ppl_stderr,
            c.model.tokens,
            c.model.windows,
            c.model.ctx,
            secs
        );
        println!(
            "KL divergence from the reference: mean {:.6} +/- {:.6}, median {:.6}, 99% {:.6}, max {:.6} nats",
            c.kl_mean, c.kl_stderr, c.kl_median, c.kl_p99, c.kl_max
        );
        println!(
            "same top token: {:.2}% of {} positions",
            100.0 * c.top1_agreement,
            c.positions
        );
    }
    Ok(())
}
