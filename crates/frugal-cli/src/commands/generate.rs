//! `frugal generate`: continue a prompt, streaming the text, then print a stats line.

use std::io::Write;

use anyhow::Result;
use frugal::chat::{ChatTemplate, Message};
use frugal::generate::{GenerateOptions, Session, StopReason};

use super::common::{self, ModelArgs, RunArgs, SamplingArgs, SpecArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The prompt, or `-` to read it from stdin
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object (text, token ids, stats) instead of streaming
    #[arg(long)]
    pub json: bool,
    /// A mixture-of-experts model: print, per layer, each expert's share of the routed tokens,
    /// the busiest expert over the mean, the routing entropy and the most co-selected pairs
    #[arg(long = "moe-stats")]
    pub moe_stats: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

pub fn run(a: Args) -> Result<()> {
    // Flags first: a typo fails before the model loads.
    let (kv_opts, attention) = (a.run.engine.kv_options()?, a.run.engine.attention()?);
    let spec_opts = a.spec.options()?;
    anyhow::ensure!(
        spec_opts.is_none() || !a.run.no_kv_cache,
        "--speculate needs the KV cache (it drops rejected positions from it)"
    );
    let prompt = if a.prompt == "-" {
        common::read_stdin()?
    } else {
        a.prompt.clone()
    };
    anyhow::ensure!(!prompt.is_empty(), "the prompt is empty");
    let (mut model, tok) = common::load(&a.model)?;
    let ids = if a.chat {
        let text =
            ChatTemplate::from_gguf(&model.file)?.render(&[Message::new("user", &prompt)], true)?;
        tok.encode(&text, true)?
    } else {
        tok.encode(&prompt, false)?
    };
    let ctx = common::context_len(&a.run, &mut model)?;
    let opts = GenerateOptions {
        max_tokens: a.sampling.max_tokens,
        stop: a.sampling.stop.clone(),
        sampler: a.sampling.params(),
    };
    let mut stdout = std::io::stdout().lock();
    let json = a.json;
    let stream = |piece: &str| {
        if !json {
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    };
    anyhow::ensure!(
        !a.moe_stats || spec_opts.is_none(),
        "--moe-stats counts plain decoding's routing: drop --speculate"
    );
    anyhow::ensure!(
        !a.moe_stats || model.config.moe.is_some(),
        "--moe-stats: this model has no experts (its FFN is dense)"
    );
    let mut routing = None;
    let (g, spec) = match &spec_opts {
        None => {
            let mut session =
                Session::with_options(&model, ctx, !a.run.no_kv_cache, &kv_opts, attention)?;
            if a.moe_stats {
                session.record_routing();
            }
            let g = session.generate(&tok, &ids, &opts, stream)?;
            routing = session.routing().cloned();
            (g, None)
        }
        Some(so) => {
            let mut s = common::speculator(&model, ctx, &kv_opts, attention, so)?;
            let (g, st) = s.generate(&tok, &ids, &opts, stream)?;
            (g, Some(st))
        }
    };
    let s = &g.stats;
    if json {
        let out = serde_json::json!({
            "prompt": prompt,
            "prompt_token_ids": ids,
            "text": g.text,
            "tokens": g.tokens,
            "stop_reason": g.stop_reason,
            "stats": {
                "prompt_tokens": s.prompt_tokens,
                "generated_tokens": s.generated_tokens,
                "prefill_tokens_per_s": s.prefill_tokens_per_s(),
                "decode_tokens_per_s": s.decode_tokens_per_s(),
                "prefill_seconds": s.prefill_seconds,
                "decode_seconds": s.decode_seconds,
                "kv_cache_bytes": s.kv_cache_bytes,
                "kv_cache": !a.run.no_kv_cache,
                "peak_rss_bytes": frugal::bench::peak_rss_bytes(),
                "model_file_bytes": model.file.file_len(),
                "activations": model.activations,
                "kv": kv_opts,
                "attention": attention,
                "threads": rayon::current_num_threads(),
                "speculate": a.spec.speculate,
                "speculation": spec,
            },
            "moe_stats": routing.as_ref().map(|r| (0..r.load.len()).filter_map(|l| r.layer(l)).collect::<Vec<_>>()),
        });
        writeln!(stdout, "{out}")?;
    } else {
        writeln!(stdout)?;
    }
    if let (Some(r), false) = (&routing, json) {
        print_routing(r);
    }
    if let Some(sp) = &spec {
        eprintln!(
            "speculate {}: {} passes for {} tokens ({:.2} per pass) | {} drafted, {} accepted ({:.0}%)",
            a.spec.speculate.as_deref().unwrap_or(""),
            sp.passes,
            s.generated_tokens,
            s.generated_tokens as f64 / sp.passes.max(1) as f64,
            sp.drafted,
            sp.accepted,
            100.0 * sp.acceptance(),
        );
    }
    if g.stop_reason == StopReason::ContextFull {
        eprintln!("note: stopped because the context of {ctx} tokens is full (raise --ctx)");
    }
    eprintln!(
        "prompt {} tok | prefill {:.1} tok/s | decode {:.1} tok/s ({} generated, {}) | KV cache {} | peak RSS {} | {} threads",
        s.prompt_tokens,
        s.prefill_tokens_per_s(),
        s.decode_tokens_per_s(),
        s.generated_tokens,
        match g.stop_reason {
            StopReason::EndOfGeneration => "end of text",
            StopReason::MaxTokens => "max tokens",
            StopReason::StopString => "stop string",
            StopReason::ContextFull => "context full",
        },
        common::human_bytes(s.kv_cache_bytes as u64),
        frugal::bench::peak_rss_bytes().map_or("n/a".into(), common::human_bytes),
        rayon::current_num_threads(),
    );
    Ok(())
}

/// The routing table `--moe-stats` prints (to stderr, beside the stats line).
pub fn print_routing(r: &frugal::model::RoutingStats) {
    eprintln!(
        "routing: layer | tokens | max/mean | CV | entropy (of ln {} = {:.2}) | load per expert (%) | top pairs",
        r.n_expert,
        (r.n_expert as f64).ln()
    );
    for l in (0..r.load.len()).filter_map(|l| r.layer(l)) {
        let load: Vec<String> = l.load.iter().map(|s| format!("{:.0}", 100.0 * s)).collect();
        let pairs: Vec<String> = l
            .top_pairs
            .iter()
            .map(|(a, b, n)| format!("{a}+{b}:{n}"))
            .collect();
        eprintln!(
            "  {:>3} | {} | {:.2} | {:.2} | {:.2} | {} | {}",
            l.layer,
            l.tokens,
            l.max_over_mean,
            l.cv,
            l.entropy,
            load.join(" "),
            pairs.join(" ")
        );
    }
}
