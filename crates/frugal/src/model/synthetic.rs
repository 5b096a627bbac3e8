//! Small random Llama models written as real GGUF files, so tests can exercise every head layout
//! (MHA, GQA, MQA) and storage format end to end without downloading anything. The same block
//! can be written as a `deepseek2` file (latent attention), with routed experts, as a `gemma3`
//! file (Gemma 3's extra norms, windows and head width), as `qwen2` / `qwen3`, or as `phi3`
//! (fused matrices, partial rotary, long/short RoPE factors).
//!
//! The vocabulary is the 256 byte-level tokens plus two control tokens, with no merges: every
//! byte of text is one token, which keeps tokenization predictable in tests.

use std::borrow::Cow;

use super::config::Mla;
use super::moe::Gating;
use crate::gguf::{Array, GgufWriter, TensorData, Value};
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
    /// Latent attention: a `deepseek2` file in llama.cpp's absorbed layout (`n_head_kv` is
    /// then ignored; the up-projections are stored as F32).
    pub mla: Option<Mla>,
    /// Routed experts in every layer (`n_ff` is then each expert's width).
    pub moe: Option<SyntheticMoe>,
    /// Gemma 3's block: a `gemma3` file (not combinable with `mla`).
    pub gemma: Option<SyntheticGemma>,
    /// A `qwen2` or `qwen3` file (not combinable with `mla` or `gemma`).
    pub qwen: Option<SyntheticQwen>,
    /// A `phi3` file (not combinable with `mla`, `gemma`, `qwen` or `moe`).
    pub phi3: Option<SyntheticPhi3>,
    /// RoPE scaling metadata and Llama 3's frequency factors.
    pub rope: SyntheticRope,
}

/// The Qwen files llama.cpp's converter writes: Qwen 2 and 2.5 (`qwen2`) with Q, K and V
/// biases; Qwen 3 (`qwen3`) with `attention.key_length` / `value_length` (a head width of its
/// own) and `attn_q_norm` / `attn_k_norm` per head, no biases.
#[derive(Clone, Debug)]
pub enum SyntheticQwen {
    Qwen2,
    Qwen3 { head_dim: usize },
}

/// RoPE scaling written into a synthetic file.
#[derive(Clone, Debug, Default)]
pub struct SyntheticRope {
    /// Writes `rope_freqs.weight`: one factor per rotated pair, from 1 (high frequencies) up
    /// to 8 (low ones), Llama 3's shape of correction.
    pub freq_factors: bool,
    /// `rope.scaling.type`, `rope.scaling.factor` and, when given,
    /// `rope.scaling.original_context_length`.
    pub scaling: Option<(String, f32, Option<usize>)>,
    /// Writes `rope_freqs.weight` as llama.cpp's converter does for Hugging Face's `llama3`
    /// rope type ([`super::relabel::llama3_factors`] over the head width and RoPE base), in
    /// place of `freq_factors`' made-up shape.
    pub llama3: Option<Llama3Rope>,
}

/// Hugging Face's `llama3` RoPE parameters (`rope_scaling` of Llama 3.1 / 3.2).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: usize,
}

/// What a `phi3` file carries beyond a Llama one, as llama.cpp's converter writes it: Q, K and
/// V fused into `attn_qkv` (Q's rows, then K's, then V's), gate and up fused into `ffn_up`
/// (gate's rows first), no `ffn_gate`, an `output.weight` always (llama.cpp's phi3 requires
/// one), `rope.dimension_count` for a partial rotary width; optionally long and short RoPE
/// factors.
#[derive(Clone, Debug)]
pub struct SyntheticPhi3 {
    /// `rope.dimension_count`: the leading dims of each head RoPE rotates (the head width for
    /// full rotary).
    pub rope_dim: usize,
    /// `Some(orig)`: `rope_factors_long.weight` and `rope_factors_short.weight` (drawn in
    /// `[1, 4)`, one per rotated pair), `rope.scaling.original_context_length = orig` and the
    /// `rope.scaling.attn_factor` the converter writes for `longrope`:
    /// `sqrt(1 + ln(s) / ln(orig))` with `s = n_ctx / orig` (1 when `s <= 1`).
    pub long_rope: Option<usize>,
}

/// What a `gemma3` file carries beyond a Llama one: the metadata llama.cpp's converter writes
/// (`attention.key_length` / `value_length`, `attention.sliding_window`, and no
/// `rope.dimension_count`), and per layer `attn_q_norm` / `attn_k_norm` (`head_dim`) and
/// `post_attention_norm` / `post_ffw_norm` (`n_embd`). The output is tied unless
/// [`SyntheticSpec::untied_output`] says otherwise, as in Gemma's files. Norm weights are
/// stored around 1, as the converter stores them (it adds Gemma's `1 +` to the checkpoint).
#[derive(Clone, Debug)]
pub struct SyntheticGemma {
    /// Width of each query, key and value head (Gemma 3 270M: 256 with `n_embd` 640 and four
    /// heads), independent of `n_embd / n_head`.
    pub head_dim: usize,
    /// `attention.sliding_window`: keys a query of a local layer sees, itself included.
    pub window: usize,
    /// `attention.sliding_window_pattern`; `None` leaves the key out (llama.cpp's converter does
    /// not write it; readers take 6).
    pub period: Option<usize>,
    /// `rope.freq_base`: the global layers' RoPE base (the local ones use 10000).
    pub rope_base: f32,
}

impl Default for SyntheticGemma {
    fn default() -> Self {
        SyntheticGemma {
            head_dim: 32,
            window: 5,
            period: Some(3),
            rope_base: 1_000_000.0,
        }
    }
}

/// The experts of a synthetic MoE model (a `llama` file in llama.cpp's MoE layout).
#[derive(Clone, Debug)]
pub struct SyntheticMoe {
    pub n_expert: usize,
    pub n_used: usize,
    pub gating: Gating,
    /// Neurons of a shared expert; 0 for none.
    pub n_ff_shared: usize,
    /// Whether to write a selection bias (`exp_probs_b.bias`).
    pub selection_bias: bool,
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
            mla: None,
            moe: None,
            gemma: None,
            qwen: None,
            phi3: None,
            rope: SyntheticRope::default(),
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
    assert!(
        spec.gemma.is_none() || spec.mla.is_none(),
        "a synthetic model is gemma3 or deepseek2, not both"
    );
    assert!(
        spec.qwen.is_none() || (spec.gemma.is_none() && spec.mla.is_none()),
        "a synthetic qwen model is not also gemma3 or deepseek2"
    );
    assert!(
        spec.phi3.is_none()
            || (spec.gemma.is_none() && spec.mla.is_none() && spec.qwen.is_none())
                && spec.moe.is_none(),
        "a synthetic phi3 model is not also gemma3, qwen, deepseek2 or MoE"
    );
    assert!(
        !(spec.rope.freq_factors && spec.rope.llama3.is_some()),
        "one set of rope_freqs: made-up or Llama 3's"
    );
    let hd = match (&spec.gemma, &spec.qwen) {
        (Some(g), _) => g.head_dim,
        (_, Some(SyntheticQwen::Qwen3 { head_dim })) => *head_dim,
        _ => spec.n_embd / spec.n_head,
    };
    let mut w = GgufWriter::new();
    let s = |v: &str| Value::String(v.into());
    let u = |v: usize| Value::U32(v as u32);
    let arch = match (&spec.mla, &spec.gemma, &spec.qwen) {
        (Some(_), _, _) => "deepseek2",
        (None, Some(_), _) => "gemma3",
        (None, None, Some(SyntheticQwen::Qwen2)) => "qwen2",
        (None, None, Some(SyntheticQwen::Qwen3 { .. })) => "qwen3",
        (None, None, None) if spec.phi3.is_some() => "phi3",
        (None, None, None) => "llama",
    };
    let key = |k: &str| format!("{arch}.{k}");
    w.set("general.architecture", s(arch));
    w.set("general.name", s("synthetic"));
    w.set(&key("block_count"), u(spec.n_layers));
    w.set(&key("context_length"), u(spec.n_ctx));
    w.set(&key("embedding_length"), u(spec.n_embd));
    w.set(&key("feed_forward_length"), u(spec.n_ff));
    w.set(&key("attention.head_count"), u(spec.n_head));
    let rope_base = spec.gemma.as_ref().map_or(10_000.0, |g| g.rope_base);
    w.set(&key("rope.freq_base"), Value::F32(rope_base));
    let eps = if spec.gemma.is_some() { 1e-6 } else { 1e-5 };
    w.set(&key("attention.layer_norm_rms_epsilon"), Value::F32(eps));
    match (&spec.mla, &spec.gemma) {
        (None, Some(g)) => {
            w.set(&key("attention.head_count_kv"), u(spec.n_head_kv));
            w.set(&key("attention.key_length"), u(hd));
            w.set(&key("attention.value_length"), u(hd));
            w.set(&key("attention.sliding_window"), u(g.window));
            if let Some(p) = g.period {
                w.set(&key("attention.sliding_window_pattern"), u(p));
            }
        }
        (None, None) => {
            w.set(&key("attention.head_count_kv"), u(spec.n_head_kv));
            match &spec.qwen {
                // What llama.cpp's converter writes: no RoPE width (it is the head's).
                Some(SyntheticQwen::Qwen2) => {}
                Some(SyntheticQwen::Qwen3 { .. }) => {
                    w.set(&key("attention.key_length"), u(hd));
                    w.set(&key("attention.value_length"), u(hd));
                }
                None => match &spec.phi3 {
                    Some(p) => {
                        assert!(p.rope_dim <= hd && p.rope_dim % 2 == 0);
                        w.set(&key("rope.dimension_count"), u(p.rope_dim));
                        if let Some(orig) = p.long_rope {
                            w.set(&key("rope.scaling.original_context_length"), u(orig));
                            let s = spec.n_ctx as f64 / orig as f64;
                            let attn = if s > 1.0 {
                                (1.0 + s.ln() / (orig as f64).ln()).sqrt()
                            } else {
                                1.0
                            };
                            w.set(&key("rope.scaling.attn_factor"), Value::F32(attn as f32));
                        }
                    }
                    None => w.set(&key("rope.dimension_count"), u(hd)),
                },
            }
        }
        (Some(m), _) => {
            // What llama.cpp's converter writes for a dense model without query compression.
            w.set(&key("attention.head_count_kv"), u(1));
            w.set(&key("attention.kv_lora_rank"), u(m.kv_lora_rank));
            w.set(&key("attention.q_lora_rank"), u(0));
            w.set(&key("attention.key_length"), u(m.row_dim()));
            w.set(&key("attention.value_length"), u(m.kv_lora_rank));
            w.set(&key("attention.key_length_mla"), u(m.nope_dim + m.rope_dim));
            w.set(&key("attention.value_length_mla"), u(m.v_dim));
            w.set(&key("rope.dimension_count"), u(m.rope_dim));
            w.set(&key("leading_dense_block_count"), u(spec.n_layers));
            w.set(&key("expert_feed_forward_length"), u(spec.n_ff));
            w.set(&key("expert_shared_count"), u(0));
        }
    }
    if let Some(m) = &spec.moe {
        w.set(&key("expert_count"), u(m.n_expert));
        w.set(&key("expert_used_count"), u(m.n_used));
        if m.gating != Gating::Softmax {
            w.set(&key("expert_gating_func"), u(m.gating.gguf_id() as usize));
        }
        if m.n_ff_shared > 0 {
            w.set(&key("expert_shared_feed_forward_length"), u(m.n_ff_shared));
        }
    }
    if let Some((kind, factor, orig)) = &spec.rope.scaling {
        w.set(&key("rope.scaling.type"), s(kind));
        w.set(&key("rope.scaling.factor"), Value::F32(*factor));
        if let Some(o) = orig {
            w.set(&key("rope.scaling.original_context_length"), u(*o));
        }
    }
    let byte_chars = crate::tokenizer::byte_level_chars();
    let mut tokens: Vec<String> = byte_chars.iter().map(|c| c.to_string()).collect();
    tokens.push("<|endoftext|>".into());
    tokens.push("<|im_end|>".into());
    let mut types = vec![1i32; 256];
    types.extend([3, 3]);
    w.set("tokenizer.ggml.model", s("gpt2"));
    w.set("tokenizer.ggml.pre", s("default"));
    w.set("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    w.set("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    w.set("tokenizer.ggml.merges", Value::Array(Array::String(vec![])));
    w.set("tokenizer.ggml.eos_token_id", u(256));
    w.set("tokenizer.ggml.bos_token_id", u(256));
    w.set("tokenizer.ggml.add_bos_token", Value::Bool(false));

    if spec.rope.freq_factors {
        let pairs = hd / 2;
        let f: Vec<f32> = (0..pairs)
            .map(|i| 1.0 + 7.0 * (i as f32 / (pairs - 1).max(1) as f32).powi(2))
            .collect();
        w.tensors.push(TensorData {
            name: "rope_freqs.weight".into(),
            dims: vec![pairs as u64],
            ty: GgmlType::F32,
            data: Cow::Owned(encode(GgmlType::F32, &f)),
        });
    }
    if let Some(l3) = &spec.rope.llama3 {
        let f = super::relabel::llama3_factors(
            hd,
            rope_base,
            l3.factor,
            l3.low_freq_factor,
            l3.high_freq_factor,
            l3.original_context,
        );
        w.tensors.push(TensorData {
            name: "rope_freqs.weight".into(),
            dims: vec![f.len() as u64],
            ty: GgmlType::F32,
            data: Cow::Owned(encode(GgmlType::F32, &f)),
        });
    }
    if let Some(SyntheticPhi3 {
        rope_dim,
        long_rope: Some(_),
    }) = &spec.phi3
    {
        for kind in ["long", "short"] {
            let f: Vec<f32> = (0..rope_dim / 2).map(|_| 2.5 + 3.0 * rnd()).collect();
            w.tensors.push(TensorData {
                name: format!("rope_factors_{kind}.weight"),
                dims: vec![(rope_dim / 2) as u64],
                ty: GgmlType::F32,
                data: Cow::Owned(encode(GgmlType::F32, &f)),
            });
        }
    }
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
        match spec.mla {
            None if spec.phi3.is_some() => {
                push(
                    name("attn_qkv"),
                    vec![d, q + 2 * kv],
                    spec.ty,
                    std_in(d),
                    0.0,
                );
                push(name("attn_output"), vec![q, d], spec.ty, std_in(q), 0.0);
            }
            None => {
                push(name("attn_q"), vec![d, q], spec.ty, std_in(d), 0.0);
                push(name("attn_k"), vec![d, kv], spec.ty, std_in(d), 0.0);
                push(name("attn_v"), vec![d, kv], spec.ty, std_in(d), 0.0);
                if matches!(spec.qwen, Some(SyntheticQwen::Qwen2)) {
                    let bias = |t: &str| format!("blk.{l}.{t}.bias");
                    push(bias("attn_q"), vec![q], GgmlType::F32, 0.5, 0.0);
                    push(bias("attn_k"), vec![kv], GgmlType::F32, 0.5, 0.0);
                    push(bias("attn_v"), vec![kv], GgmlType::F32, 0.5, 0.0);
                }
                if spec.gemma.is_some() || matches!(spec.qwen, Some(SyntheticQwen::Qwen3 { .. })) {
                    let h = hd as u64;
                    push(name("attn_q_norm"), vec![h], GgmlType::F32, 0.2, 1.0);
                    push(name("attn_k_norm"), vec![h], GgmlType::F32, 0.2, 1.0);
                }
                push(name("attn_output"), vec![q, d], spec.ty, std_in(q), 0.0);
                if spec.gemma.is_some() {
                    let n = name("post_attention_norm");
                    push(n, vec![d], GgmlType::F32, 0.2, 1.0);
                }
            }
            Some(m) => {
                let (rank, h) = (m.kv_lora_rank as u64, spec.n_head as u64);
                let qm = h * (m.nope_dim + m.rope_dim) as u64;
                let row = m.row_dim() as u64;
                let att = h * m.v_dim as u64;
                push(name("attn_q"), vec![d, qm], spec.ty, std_in(d), 0.0);
                push(name("attn_kv_a_mqa"), vec![d, row], spec.ty, std_in(d), 0.0);
                push(name("attn_kv_a_norm"), vec![rank], GgmlType::F32, 0.2, 1.0);
                let (nope, vd) = (m.nope_dim as u64, m.v_dim as u64);
                let f32 = GgmlType::F32;
                push(
                    name("attn_k_b"),
                    vec![nope, rank, h],
                    f32,
                    std_in(rank),
                    0.0,
                );
                push(name("attn_v_b"), vec![rank, vd, h], f32, std_in(rank), 0.0);
                push(name("attn_output"), vec![att, d], spec.ty, std_in(att), 0.0);
            }
        }
        push(name("ffn_norm"), vec![d], GgmlType::F32, 0.2, 1.0);
        if spec.gemma.is_some() {
            push(name("post_ffw_norm"), vec![d], GgmlType::F32, 0.2, 1.0);
        }
        match &spec.moe {
            None if spec.phi3.is_some() => {
                push(name("ffn_up"), vec![d, 2 * ff], spec.ty, std_in(d), 0.0);
                push(name("ffn_down"), vec![ff, d], spec.ty, std_in(ff), 0.0);
            }
            None => {
                push(name("ffn_gate"), vec![d, ff], spec.ty, std_in(d), 0.0);
                push(name("ffn_up"), vec![d, ff], spec.ty, std_in(d), 0.0);
                push(name("ffn_down"), vec![ff, d], spec.ty, std_in(ff), 0.0);
            }
            Some(m) => {
                let e = m.n_expert as u64;
                // A router wide enough that tokens really pick different experts.
                push(
                    name("ffn_gate_inp"),
                    vec![d, e],
                    GgmlType::F32,
                    4.0 * std_in(d),
                    0.0,
                );
                push(
                    name("ffn_gate_exps"),
                    vec![d, ff, e],
                    spec.ty,
                    std_in(d),
                    0.0,
                );
                push(name("ffn_up_exps"), vec![d, ff, e], spec.ty, std_in(d), 0.0);
                push(
                    name("ffn_down_exps"),
                    vec![ff, d, e],
                    spec.ty,
                    std_in(ff),
                    0.0,
                );
                if m.n_ff_shared > 0 {
                    let sh = m.n_ff_shared as u64;
                    push(name("ffn_gate_shexp"), vec![d, sh], spec.ty, std_in(d), 0.0);
                    push(name("ffn_up_shexp"), vec![d, sh], spec.ty, std_in(d), 0.0);
                    push(
                        name("ffn_down_shexp"),
                        vec![sh, d],
                        spec.ty,
                        std_in(sh),
                        0.0,
                    );
                }
                if m.selection_bias {
                    let bias = format!("blk.{l}.exp_probs_b.bias");
                    push(bias, vec![e], GgmlType::F32, 0.2, 0.0);
                }
            }
        }
    }
    push(
        "output_norm.weight".into(),
        vec![d],
        GgmlType::F32,
        0.2,
        1.0,
    );
    if spec.untied_output || spec.phi3.is_some() {
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
