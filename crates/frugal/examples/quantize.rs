//! Re-encode a model in another storage format, then measure what the rounding cost against
//! the original (perplexity, KL divergence, top-token agreement) on a short text.
//!
//! ```sh
//! cargo run --release -p frugal --example quantize [MODEL.gguf] [TYPE] [OUT.gguf]
//! ```
//!
//! TYPE defaults to q4_k (any `frugal quantize --type` name: q8_0, q6_k, q5_0, q4_0, mxfp4, ...).
//! With OUT the file is also written (a standard GGUF that llama.cpp runs). The CLI equivalent
//! is `frugal quantize IN OUT --type TYPE --keep 'blk.*.ffn_down.weight=q8_0'`.

mod common;

use frugal::convert::{self, Action, Policy, Rule, Target};
use frugal::eval;
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;

const CTX: usize = 256;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = common::model_path();
    let target: Target = std::env::args()
        .nth(2)
        .unwrap_or_else(|| "q4_k".into())
        .parse()?;

    // A mixed-precision policy: every matrix in the target type, the FFN down-projections at
    // Q8_0 (rules are globs over tensor names; the first match wins). Norms stay F32 and the
    // embedding and output head Q8_0 by default.
    let mut policy = Policy::new(target);
    policy.rules = vec!["blk.*.ffn_down.weight=q8_0".parse::<Rule>()?];

    let source = GgufFile::open(&path)?;
    let (file, report) = convert::quantize_in_memory(&source, &policy, |_, _| {})?;
    let encoded = report
        .tensors
        .iter()
        .filter(|t| t.action == Action::Encode)
        .count();
    println!(
        "{}: {encoded} tensors re-encoded, weights {:.2} MiB -> {:.2} MiB",
        report.target,
        report.bytes_before as f64 / (1 << 20) as f64,
        report.bytes_after as f64 / (1 << 20) as f64
    );
    for (ty, params) in report.types_after() {
        println!("  {ty:>8}: {params} parameters");
    }
    if let Some(out) = std::env::args().nth(3) {
        convert::quantize_file(&source, &policy, &out, |_, _| {})?;
        println!("wrote {out}");
    }

    // Both models with 8-bit activations, as the `frugal` command runs them.
    let mut original = Model::from_file(source)?;
    let mut quantized = Model::from_file(file)?;
    for m in [&mut original, &mut quantized] {
        m.set_activations(Activations::Q8);
        m.config.set_context(CTX);
    }
    let tok = Tokenizer::from_gguf(&original.file)?;
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3")
        .unwrap_or_else(|_| SAMPLE.repeat(40));
    let mut tokens = tok.encode(&text, false)?;
    tokens.truncate(8 * CTX);

    let c = eval::compare(&quantized, &original, &tokens, CTX, |_, _| {})?;
    println!(
        "PPL {:.4} (original {:.4}), mean KL {:.5}, 99% KL {:.4}, same top token {:.2}% over {} positions",
        c.model.ppl,
        c.reference.ppl,
        c.kl_mean,
        c.kl_p99,
        100.0 * c.top1_agreement,
        c.positions
    );
    Ok(())
}

const SAMPLE: &str = "The cache holds the keys and values of every earlier position, so a \
    decode step runs one token through the weights and attention reads what is cached. ";
