//! Open a GGUF model and print what frugal sees in it.
//!
//! ```sh
//! cargo run --release -p frugal --example load [MODEL.gguf | smollm2-135m | gemma3-270m]
//! ```
//!
//! Without an argument it opens the reference model that `frugal fetch` puts in the cache.

mod common;

use frugal::model::Model;
use frugal::tokenizer::Tokenizer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = common::model_path();
    // Validates the file, reads the configuration from its metadata and maps the weights.
    let model = Model::load(&path)?;
    let c = &model.config;
    println!("{}", path.display());
    println!(
        "architecture {}: {} layers, width {}, FFN {}, {} query heads and {} KV heads of {}",
        c.arch, c.n_layers, c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim
    );
    println!(
        "vocabulary {} tokens, trained context {}, latent attention: {}, experts: {}",
        c.n_vocab,
        c.n_ctx_train,
        c.mla.is_some(),
        c.moe.is_some()
    );

    // Bytes per stored tensor type.
    let mut by_type = std::collections::BTreeMap::<String, u64>::new();
    for t in model.file.tensors() {
        *by_type.entry(t.ty.to_string()).or_default() += t.n_bytes();
    }
    for (ty, bytes) in &by_type {
        println!("  {ty:>8}: {:.2} MiB", *bytes as f64 / (1 << 20) as f64);
    }

    // The tokenizer lives in the same file.
    let tok = Tokenizer::from_gguf(&model.file)?;
    let ids = tok.encode("The capital of France is", false)?;
    println!("\"The capital of France is\" -> {ids:?}");
    Ok(())
}
