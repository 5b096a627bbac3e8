//! What each fuzz target does with one input. Every function must return for any bytes: an
//! error is a fine answer, a panic, a hang or an allocation the input did not pay for is a bug.
//! The AFL harnesses in `fuzz/` call these; `tests/corpus.rs` replays the committed corpora and
//! every input that ever crashed through the same functions in `cargo test`.

use std::sync::OnceLock;

use frugal::chat::{ChatTemplate, Message};
use frugal::gguf::{GgufFile, GgufWriter, Value};
use frugal::model::Model;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::{GgmlType, WeightMatrix, dequantize, matvec};
use frugal::tokenizer::{StreamDecoder, Tokenizer};
use frugal_serve::api::{DetokenizeRequest, TokenizeRequest};
use frugal_serve::validate;

/// A target's body: one input, any bytes.
pub type Target = fn(&[u8]);

/// The targets, by the name their corpus directory and harness carry.
pub const TARGETS: [(&str, Target); 5] = [
    ("gguf", gguf),
    ("tokenizer", tokenizer),
    ("chat_template", chat_template),
    ("quant_blocks", quant_blocks),
    ("serve_request", serve_request),
];

/// Builds what the targets share (the synthetic model's tokenizer, the chat templates) once:
/// a harness calls this before its fuzz loop, so the processes AFL forks inherit them instead
/// of building them again every few thousand inputs.
pub fn warm_up() {
    tokenizer(b"warm up");
    chat_template(b"\x00\x01warm up");
}

/// A GGUF file: header, metadata, tensor infos and data offsets, then the model built from it
/// (config, tokenizer, weights). Inputs are small, so whatever loads is small too.
pub fn gguf(data: &[u8]) {
    if let Ok(f) = GgufFile::from_bytes(data.to_vec()) {
        for (_, v) in f.metadata() {
            let _ = v.display_short(4);
        }
        let _ = Model::from_file(f);
    }
}

/// A small synthetic model's file: its byte-level BPE tokenizer and ChatML template.
fn synthetic() -> &'static GgufFile {
    static FILE: OnceLock<GgufFile> = OnceLock::new();
    FILE.get_or_init(|| {
        GgufFile::from_bytes(build(&SyntheticSpec::default())).expect("the synthetic model")
    })
}

/// Encoding arbitrary text (with and without special tokens) and decoding arbitrary ids, in
/// one call and streamed a token at a time.
pub fn tokenizer(data: &[u8]) {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    let tok = TOK.get_or_init(|| Tokenizer::from_gguf(synthetic()).expect("its tokenizer"));
    let text = String::from_utf8_lossy(data);
    for special in [false, true] {
        if let Ok(ids) = tok.encode(&text, special) {
            let _ = tok.decode(&ids);
        }
    }
    // Ids from the bytes, most of them out of the vocabulary.
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) | u32::from(*c.get(1).unwrap_or(&0)) << 8)
        .collect();
    let _ = tok.decode(&ids);
    let mut stream = StreamDecoder::default();
    for &id in &ids {
        let _ = stream.push(tok.token_bytes(id, id % 2 == 0));
    }
    let _ = stream.finish();
}

/// Rendering arbitrary messages with the built-in templates (ChatML for llama, Gemma's for
/// gemma3): the first byte picks the template, then each message is a role byte and text up to
/// a zero byte.
pub fn chat_template(data: &[u8]) {
    static TEMPLATES: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    let templates = TEMPLATES.get_or_init(|| {
        ["llama", "gemma3"]
            .iter()
            .map(|arch| {
                let mut w = GgufWriter::new();
                w.set("general.architecture", Value::String((*arch).into()));
                let f = GgufFile::from_bytes(w.to_bytes().expect("a header")).expect("a file");
                ChatTemplate::from_gguf(&f).expect("a built-in template")
            })
            .collect()
    });
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let template = &templates[pick as usize % templates.len()];
    const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];
    let messages: Vec<Message> = rest
        .split(|&b| b == 0)
        .filter_map(|m| m.split_first())
        .map(|(&role, text)| {
            let role = ROLES
                .get(role as usize % (ROLES.len() + 1))
                .copied()
                .unwrap_or("nonsense");
            Message::new(role, &String::from_utf8_lossy(text))
        })
        .collect();
    let _ = template.render(&messages, pick & 0x80 != 0);
}

/// Quantized blocks of any format (the first byte picks it), scales included: NaN, infinities
/// and subnormals decode without a panic through the scalar decoder and through the product
/// kernels (whatever the CPU runs).
pub fn quant_blocks(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Some(ty) = GgmlType::from_id(u32::from(pick) % 48) else {
        return;
    };
    let (block, bytes) = (ty.block_size(), ty.block_bytes());
    if block == 0 || bytes == 0 {
        return;
    }
    let n_blocks = rest.len() / bytes;
    let raw = &rest[..n_blocks * bytes];
    let n = n_blocks * block;
    let mut out = vec![0f32; n];
    let _ = dequantize(ty, raw, &mut out);
    if n > 0
        && let Ok(w) = WeightMatrix::new(ty, 1, n, raw)
    {
        let x: Vec<f32> = (0..n).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut y = [0f32; 1];
        matvec(&w, &x, &mut y);
    }
}

/// Request bodies as the server parses and validates them before any model work.
pub fn serve_request(data: &[u8]) {
    let _ = validate::chat(data);
    let _ = validate::completion(data);
    let _ = validate::plain::<TokenizeRequest>(data);
    let _ = validate::plain::<DetokenizeRequest>(data);
}
