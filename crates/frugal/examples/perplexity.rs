//! Score a text: perplexity as llama.cpp's `llama-perplexity` computes it, then what a Q8_0
//! KV cache costs against the f32 one (KL divergence, top-token agreement).
//!
//! ```sh
//! cargo run --release -p frugal --example perplexity [MODEL.gguf] [TEXT_FILE]
//! ```
//!
//! Defaults: the reference model that `frugal fetch` puts in the cache, and the GPL-3 text
//! (`/usr/share/common-licenses/GPL-3`). The CLI equivalent is
//! `frugal eval perplexity --text FILE --kv-type q8_0 --kld`.

mod common;

use frugal::eval::{self, EvalOptions};
use frugal::kv::{KvFormat, KvOptions, KvType};
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;

const CTX: usize = 512;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = common::model_path();
    let text_path = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "/usr/share/common-licenses/GPL-3".into());
    let text = std::fs::read_to_string(&text_path)?;

    let mut model = Model::load(&path)?;
    model.set_activations(Activations::Q8);
    model.config.set_context(CTX);
    let tok = Tokenizer::from_gguf(&model.file)?;
    let tokens = tok.encode(&text, false)?;

    // Non-overlapping windows of CTX tokens; the second half of each window is scored.
    let p = eval::perplexity(&model, &tokens, CTX, |done, total| {
        eprint!("\rwindow {done}/{total}");
    })?;
    eprintln!();
    println!(
        "{text_path}: PPL {:.4} ± {:.3} over {} tokens ({} windows of {CTX})",
        p.ppl, p.ppl_stderr, p.tokens, p.windows
    );

    // The same model run two ways in one pass: a Q8_0 KV cache against the default f32 cache.
    let q8_cache = EvalOptions {
        kv: KvOptions {
            format: KvFormat::both(KvType::Q8_0),
            ..KvOptions::default()
        },
        ..EvalOptions::default()
    };
    let c = eval::compare_with(
        (&model, &q8_cache),
        (&model, &EvalOptions::default()),
        &tokens,
        CTX,
        |_, _| {},
    )?;
    println!(
        "Q8_0 KV cache: PPL {:.4}, mean KL {:.6} (99%: {:.6}) against the f32 cache, same top token {:.2}%",
        c.model.ppl,
        c.kl_mean,
        c.kl_p99,
        100.0 * c.top1_agreement
    );
    Ok(())
}
