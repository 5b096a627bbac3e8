//! Small random Llama models written as real GGUF files, so tests can exercise every head layout
//! (MHA, GQA, MQA) and storage format end to end without downloading anything.
//!
//! The vocabulary is the 256 byte-level tokens plus two control tokens, with no merges: every
//! byte of text is one token, which keeps tokenization predictable in tests.

use std::borrow::Cow;

use crate::gguf::{GgufWriter, TensorData, Value, ValueType};
use crate::quant::GgmlType;

/// The shape and storage of a synthetic model.
#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ctx: usize,
    /// Storage type of the linear layers (norms stay F32).
    pub ty: GgmlType,
    /// Whether to write a separate `output.weight` instead of tying it to the embedding.
    pub untied_output: bool,
    pub seed: u64,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        SyntheticSpec {
            n_layers: 2,
            n_embd: 64,
            n_ff: 96,
            n_head: 4,
            n_head_kv: 2,
            n_ctx: 256,
            ty: GgmlType::F32,
            untied_output: false,
            seed: 1,
        }
    }
}

/// Byte tokens first (token id = byte value), then `<|endoftext|>` (EOS) and `<|im_end|>`.
pub const SYNTHETIC_VOCAB: usize = 258;

fn encode(ty: GgmlType, w: &[f32]) -> Vec<u8> {
    crate::quant::quantize(ty, w)
        .unwrap_or_else(|e| panic!("synthetic models cannot be stored as {ty}: {e}"))
}

/// Writes the model described by `spec` as GGUF bytes.
pub fn build(spec: &SyntheticSpec) -> Vec<u8> {
    let mut state = spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let hd = spec.n_embd / spec.n_head;
    let mut w = GgufWriter::new();
    let s = |v: &str| Value::String(v.into());
    let u = |v: usize| Value::U32(v as u32);
    w.set("general.architecture", s("llama"));
    w.set("general.name", s("synthetic"));
    w.set("llama.block_count", u(spec.n_layers));
    w.set("llama.context_length", u(spec.n_ctx));
    w.set("llama.embedding_length", u(spec.n_embd));
    w.set("llama.feed_forward_length", u(spec.n_ff));
    w.set("llama.attention.head_count", u(spec.n_head));
    w.set("llama.attention.head_count_kv", u(spec.n_head_kv));
    w.set("llama.rope.freq_base", Value::F32(10_000.0));
    w.set("llama.rope.dimension_count", u(hd));
    w.set("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    let byte_chars = crate::tokenizer::byte_level_chars();
    let mut tokens: Vec<Value> = byte_chars
        .iter()
        .map(|c| Value::String(c.to_string()))
        .collect();
    tokens.push(s("<|endoftext|>"));
    tokens.push(s("<|im_end|>"));
    let mut types = vec![Value::I32(1); 256];
    types.extend([Value::I32(3), Value::I32(3)]);
    w.set("tokenizer.ggml.model", s("gpt2"));
    w.set("tokenizer.ggml.pre", s("default"));
    w.set(
        "tokenizer.ggml.tokens",
        Value::Array(ValueType::String, tokens),
    );
    w.set(
        "tokenizer.ggml.token_type",
        Value::Array(ValueType::I32, types),
    );
    w.set(
        "tokenizer.ggml.merges",
        Value::Array(ValueType::String, vec![]),
    );
    w.set("tokenizer.ggml.eos_token_id", u(256));
    w.set("tokenizer.ggml.bos_token_id", u(256));
    w.set("tokenizer.ggml.add_bos_token", Value::Bool(false));

    let mut push = |name: String, dims: Vec<u64>, ty: GgmlType, scale: f32, offset: f32| {
        let n: u64 = dims.iter().product();
        let vals: Vec<f32> = (0..n).map(|_| rnd() * scale + offset).collect();
        w.tensors.push(TensorData {
            name,
            dims,
            ty,
            data: Cow::Owned(encode(ty, &vals)),
        });
    };
    let (d, ff, q, kv) = (
        spec.n_embd as u64,
        spec.n_ff as u64,
        (spec.n_head * hd) as u64,
        (spec.n_head_kv * hd) as u64,
    );
    let std_in = |fan_in: u64| 2.0 / (fan_in as f32).sqrt();
    push(
        "token_embd.weight".into(),
        vec![d, SYNTHETIC_VOCAB as u64],
        spec.ty,
        1.0,
        0.0,
    );
    for l in 0..spec.n_layers {
        let name = |t: &str| format!("blk.{l}.{t}.weight");
        push(name("attn_norm"), vec![d], GgmlType::F32, 0.2, 1.0);
        push(name("attn_q"), vec![d, q], spec.ty, std_in(d), 0.0);
        push(name("attn_k"), vec![d, kv], spec.ty, std_in(d), 0.0);
        push(name("attn_v"), vec![d, kv], spec.ty, std_in(d), 0.0);
        push(name("attn_output"), vec![q, d], spec.ty, std_in(q), 0.0);
        push(name("ffn_norm"), vec![d], GgmlType::F32, 0.2, 1.0);
        push(name("ffn_gate"), vec![d, ff], spec.ty, std_in(d), 0.0);
        push(name("ffn_up"), vec![d, ff], spec.ty, std_in(d), 0.0);
        push(name("ffn_down"), vec![ff, d], spec.ty, std_in(ff), 0.0);
    }
    push(
        "output_norm.weight".into(),
        vec![d],
        GgmlType::F32,
        0.2,
        1.0,
    );
    if spec.untied_output {
        push(
            "output.weight".into(),
            vec![d, SYNTHETIC_VOCAB as u64],
            spec.ty,
            1.0,
            0.0,
        );
    }
    w.to_bytes()
        .expect("synthetic tensors have consistent sizes")
}
