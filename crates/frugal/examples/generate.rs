//! Generate text: the prompt through the chat template, 8-bit activations, sampling, streaming.
//!
//! ```sh
//! cargo run --release -p frugal --example generate [MODEL.gguf] ["Write a haiku about caches"]
//! ```
//!
//! Without a model argument it uses the reference model that `frugal fetch` puts in the cache.

mod common;

use std::io::Write;

use frugal::chat::{ChatTemplate, Message};
use frugal::generate::{GenerateOptions, Session};
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::sample::SamplerParams;
use frugal::tokenizer::Tokenizer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = common::model_path();
    let prompt = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "Write a haiku about caches.".into());

    let mut model = Model::load(&path)?;
    // The `frugal` command's default: block-quantized weights multiply 8-bit activations with
    // integer kernels, as llama.cpp runs quantized files. `Activations::F32` is exact.
    model.set_activations(Activations::Q8);
    let tok = Tokenizer::from_gguf(&model.file)?;

    // The model's own chat template (from the file), with the assistant's turn opened.
    let text =
        ChatTemplate::from_gguf(&model.file)?.render(&[Message::new("user", &prompt)], true)?;
    let ids = tok.encode(&text, true)?;

    let opts = GenerateOptions {
        max_tokens: 128,
        stop: Vec::new(),
        sampler: SamplerParams {
            temperature: 0.7,
            seed: 42,
            ..SamplerParams::default()
        },
    };
    // A session owns the KV cache (paged, f32 by default); it can be reused across chat turns.
    let ctx = 2048.min(model.config.n_ctx_train);
    let mut session = Session::new(&model, ctx, true)?;
    let mut out = std::io::stdout().lock();
    let g = session.generate(&tok, &ids, &opts, |piece| {
        let _ = out.write_all(piece.as_bytes());
        let _ = out.flush();
    })?;
    let s = &g.stats;
    eprintln!(
        "\n[{:?}] prompt {} tok, prefill {:.1} tok/s, {} generated at {:.1} tok/s, KV cache {} KiB",
        g.stop_reason,
        s.prompt_tokens,
        s.prefill_tokens_per_s(),
        s.generated_tokens,
        s.decode_tokens_per_s(),
        s.kv_cache_bytes / 1024
    );
    Ok(())
}
