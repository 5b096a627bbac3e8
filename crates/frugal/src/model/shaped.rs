//! Random-weight GGUF files with the exact shape of a catalog model and the tensor types a
//! llama-quantize mix gives it: what decode and prefill cost at a size people run can be
//! measured (by frugal, and by llama.cpp on the same file) before downloading the model.
//!
//! The weights are random, so the file is for speed only. Every tensor of the real file is
//! there with its real shape and type (llama-quantize's per-tensor rules for the mix, from
//! `src/llama-quant.cpp`); the vocabulary is as long as the model's, of placeholder pieces.
//! RoPE scaling metadata is left out: it changes no cost.

use std::borrow::Cow;
use std::path::Path;

use crate::estimate::catalog::CatalogEntry;
use crate::gguf::{Array, GgufError, GgufWriter, TensorData, Value};
use crate::quant::{self, GgmlType};

/// A llama-quantize file type (`--type` of `frugal bench --shape`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Mix {
    F16,
    Q8_0,
    Q4_0,
    Q2K,
    Q3KM,
    /// Q4_K, with Q6_K for the output and for attn_v / ffn_down in the layers
    /// `use_more_bits` picks.
    Q4KM,
    Q5KM,
    IQ4XS,
}

/// Where a matrix sits, as llama-quantize's rules (`llama_tensor_get_type`) tell them apart.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Role {
    Embedding,
    Output,
    AttnV,
    AttnOutput,
    FfnDown,
    Other,
}

/// One matrix of a file: its role, its layer `layer` of `n_layers`, whether the embedding
/// doubles as the output, the length of its rows, and the query heads per KV head.
#[derive(Copy, Clone, Debug)]
pub struct Spot {
    pub role: Role,
    pub layer: usize,
    pub n_layers: usize,
    pub tied: bool,
    pub cols: usize,
    pub n_gqa: usize,
}

impl Mix {
    pub const ALL: [Mix; 8] = [
        Mix::F16,
        Mix::Q8_0,
        Mix::Q4_0,
        Mix::Q2K,
        Mix::Q3KM,
        Mix::Q4KM,
        Mix::Q5KM,
        Mix::IQ4XS,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mix::F16 => "f16",
            Mix::Q8_0 => "q8_0",
            Mix::Q4_0 => "q4_0",
            Mix::Q2K => "q2_k",
            Mix::Q3KM => "q3_k_m",
            Mix::Q4KM => "q4_k_m",
            Mix::Q5KM => "q5_k_m",
            Mix::IQ4XS => "iq4_xs",
        }
    }

    pub fn from_name(s: &str) -> Option<Mix> {
        Mix::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(s))
    }

    /// The type llama-quantize (without an importance matrix) gives the matrix at `at`: a
    /// K-quant whose 256-weight blocks do not divide the rows falls back as its
    /// `tensor_type_fallback` does (Q6_K to Q8_0, Q4_K to Q5_0, ...; F16 if even that fails).
    pub fn tensor_type(self, at: Spot) -> GgmlType {
        let ty = self.preferred_type(at);
        if at.cols.is_multiple_of(ty.block_size()) {
            return ty;
        }
        let fallback = match ty {
            GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
            GgmlType::Q4_K => GgmlType::Q5_0,
            GgmlType::Q5_K => GgmlType::Q5_1,
            GgmlType::Q6_K => GgmlType::Q8_0,
            GgmlType::IQ4_XS => GgmlType::IQ4_NL,
            other => other,
        };
        if at.cols.is_multiple_of(fallback.block_size()) {
            fallback
        } else {
            GgmlType::F16
        }
    }

    fn preferred_type(self, at: Spot) -> GgmlType {
        use GgmlType::*;
        let base = match self {
            Mix::F16 => return F16,
            Mix::Q8_0 => return Q8_0,
            Mix::Q4_0 => Q4_0,
            Mix::Q2K => Q2_K,
            Mix::Q3KM => Q3_K,
            Mix::Q4KM => Q4_K,
            Mix::Q5KM => Q5_K,
            Mix::IQ4XS => IQ4_XS,
        };
        let more = use_more_bits(at.layer, at.n_layers);
        match (at.role, self) {
            (Role::Output, _) => Q6_K,
            (Role::Embedding, _) if at.tied => Q6_K,
            (Role::AttnV, Mix::Q2K) => {
                if at.n_gqa >= 4 {
                    Q4_K
                } else {
                    Q3_K
                }
            }
            (Role::AttnV, Mix::Q3KM) => {
                if at.layer < 2 {
                    Q5_K
                } else {
                    Q4_K
                }
            }
            (Role::AttnV, Mix::Q4KM) => {
                if more {
                    Q6_K
                } else {
                    Q4_K
                }
            }
            (Role::AttnV, Mix::Q5KM) => {
                if more {
                    Q6_K
                } else {
                    Q5_K
                }
            }
            (Role::AttnV, Mix::IQ4XS) => {
                if at.n_gqa >= 4 {
                    Q5_K
                } else {
                    IQ4_XS
                }
            }
            (Role::FfnDown, Mix::Q2K) => Q3_K,
            (Role::FfnDown, Mix::Q3KM) => {
                if at.layer < at.n_layers / 16 {
                    Q5_K
                } else {
                    Q4_K
                }
            }
            (Role::FfnDown, Mix::Q4KM) => {
                if more {
                    Q6_K
                } else {
                    Q4_K
                }
            }
            (Role::FfnDown, Mix::Q5KM) => {
                if more {
                    Q6_K
                } else {
                    Q5_K
                }
            }
            (Role::FfnDown, Mix::IQ4XS) => {
                if at.layer < at.n_layers / 8 {
                    Q5_K
                } else {
                    IQ4_XS
                }
            }
            (Role::AttnOutput, Mix::Q2K) => Q3_K,
            (Role::AttnOutput, Mix::Q3KM) => Q4_K,
            _ => base,
        }
    }
}

/// llama-quantize's `use_more_bits`: the first and last eighth of the layers and every third
/// between.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The GGUF architecture frugal writes for a catalog family, or why not.
fn arch_of(e: &CatalogEntry) -> Result<&'static str, String> {
    if e.arch != "dense" || e.kv_lora_rank.is_some() || e.sliding_window.is_some() {
        return Err(format!(
            "{}: only dense models without windows or latent attention get a shaped file",
            e.id
        ));
    }
    Ok(match e.family.as_str() {
        "llama2" | "llama3" | "smollm2" | "tinyllama" | "mistral" => "llama",
        "qwen2.5" => "qwen2",
        other => return Err(format!("{}: family {other:?} has no shaped file", e.id)),
    })
}

/// Blocks of random weights (normal-ish, standard deviation `std`) encoded as `ty`, drawn
/// from a pool so that a file of billions of weights is written at memory speed.
struct Pool {
    blocks: Vec<u8>,
    block_bytes: usize,
    block_len: usize,
}

impl Pool {
    fn new(ty: GgmlType, std: f32, rnd: &mut impl FnMut() -> f32) -> Pool {
        let n_blocks = 256;
        let block_len = ty.block_size();
        let vals: Vec<f32> = (0..n_blocks * block_len)
            .map(|_| (rnd() + rnd() + rnd()) * std)
            .collect();
        let blocks = quant::quantize(ty, &vals).expect("finite values of a supported type");
        Pool {
            block_bytes: blocks.len() / n_blocks,
            blocks,
            block_len,
        }
    }

    /// `n` elements (whole blocks) of pool blocks in pseudo-random order.
    fn tensor(&self, n: usize, state: &mut u64) -> Vec<u8> {
        let count = n / self.block_len;
        let mut out = Vec::with_capacity(count * self.block_bytes);
        let n_pool = self.blocks.len() / self.block_bytes;
        for _ in 0..count {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            let b = (*state >> 32) as usize % n_pool;
            out.extend_from_slice(&self.blocks[b * self.block_bytes..][..self.block_bytes]);
        }
        out
    }
}

/// Writes the shaped file of catalog model `e` in mix `mix` to `path`.
pub fn write(e: &CatalogEntry, mix: Mix, path: &Path) -> Result<(), GgufError> {
    let arch = arch_of(e).map_err(|reason| GgufError::BadValue {
        key: "family".into(),
        reason,
    })?;
    let bad_shape = |reason: String| GgufError::BadValue {
        key: "shape".into(),
        reason,
    };
    let (l, d, ff, nh, nkv, hd, nv) = (
        e.num_layers as usize,
        e.hidden_size as usize,
        e.intermediate_size as usize,
        e.num_attention_heads as usize,
        e.num_kv_heads as usize,
        e.head_dim as usize,
        e.vocab_size as usize,
    );
    let tied = e.tie_word_embeddings.unwrap_or(false);
    let mut w = GgufWriter::new();
    let s = |v: &str| Value::String(v.into());
    let u = |v: usize| Value::U32(v as u32);
    let key = |k: &str| format!("{arch}.{k}");
    w.set("general.architecture", s(arch));
    w.set(
        "general.name",
        s(&format!("{} shape, random weights", e.name)),
    );
    w.set(&key("block_count"), u(l));
    w.set(
        &key("context_length"),
        u(e.max_position_embeddings as usize),
    );
    w.set(&key("embedding_length"), u(d));
    w.set(&key("feed_forward_length"), u(ff));
    w.set(&key("attention.head_count"), u(nh));
    w.set(&key("attention.head_count_kv"), u(nkv));
    if hd * nh != d {
        w.set(&key("attention.key_length"), u(hd));
        w.set(&key("attention.value_length"), u(hd));
    }
    w.set(
        &key("rope.freq_base"),
        Value::F32(e.rope_theta.unwrap_or(1e4) as f32),
    );
    w.set(&key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    let mut tokens: Vec<String> = crate::tokenizer::byte_level_chars()
        .iter()
        .map(|c| c.to_string())
        .collect();
    if nv < tokens.len() + 1 {
        return Err(bad_shape(format!("a vocabulary of {nv} is too small")));
    }
    tokens.extend((tokens.len()..nv - 1).map(|i| format!("<|piece_{i}|>")));
    tokens.push("<|endoftext|>".into());
    let mut types = vec![1i32; nv];
    types[nv - 1] = 3;
    w.set("tokenizer.ggml.model", s("gpt2"));
    w.set("tokenizer.ggml.pre", s("default"));
    w.set("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    w.set("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    w.set("tokenizer.ggml.merges", Value::Array(Array::String(vec![])));
    w.set("tokenizer.ggml.eos_token_id", u(nv - 1));
    w.set("tokenizer.ggml.bos_token_id", u(nv - 1));

    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        }
    };
    let mut pools: Vec<(GgmlType, Pool)> = Vec::new();
    let mut push = |name: String, dims: Vec<u64>, ty: GgmlType, state: &mut u64| {
        let n = dims.iter().product::<u64>() as usize;
        let data = if ty == GgmlType::F32 {
            quant::quantize_f32(&vec![1.0; n])
        } else {
            if !pools.iter().any(|(t, _)| *t == ty) {
                pools.push((ty, Pool::new(ty, 0.05, &mut rnd)));
            }
            let pool = &pools.iter().find(|(t, _)| *t == ty).expect("made above").1;
            pool.tensor(n, state)
        };
        w.tensors.push(TensorData {
            name,
            dims,
            ty,
            data: Cow::Owned(data),
        });
    };
    let (d64, ff64, q64, kv64) = (d as u64, ff as u64, (nh * hd) as u64, (nkv * hd) as u64);
    // By input width (the rows' length decides the fallback).
    let ty = |role, layer, cols: u64| {
        mix.tensor_type(Spot {
            role,
            layer,
            n_layers: l,
            tied,
            cols: cols as usize,
            n_gqa: nh / nkv.max(1),
        })
    };
    let t = ty(Role::Embedding, 0, d64);
    push(
        "token_embd.weight".into(),
        vec![d64, nv as u64],
        t,
        &mut state,
    );
    for i in 0..l {
        let n = |s: &str| format!("blk.{i}.{s}.weight");
        push(n("attn_norm"), vec![d64], GgmlType::F32, &mut state);
        push(
            n("attn_q"),
            vec![d64, q64],
            ty(Role::Other, i, d64),
            &mut state,
        );
        push(
            n("attn_k"),
            vec![d64, kv64],
            ty(Role::Other, i, d64),
            &mut state,
        );
        push(
            n("attn_v"),
            vec![d64, kv64],
            ty(Role::AttnV, i, d64),
            &mut state,
        );
        if e.qkv_bias == Some(true) {
            for (t, w) in [("attn_q", q64), ("attn_k", kv64), ("attn_v", kv64)] {
                push(
                    format!("blk.{i}.{t}.bias"),
                    vec![w],
                    GgmlType::F32,
                    &mut state,
                );
            }
        }
        push(
            n("attn_output"),
            vec![q64, d64],
            ty(Role::AttnOutput, i, q64),
            &mut state,
        );
        push(n("ffn_norm"), vec![d64], GgmlType::F32, &mut state);
        push(
            n("ffn_gate"),
            vec![d64, ff64],
            ty(Role::Other, i, d64),
            &mut state,
        );
        push(
            n("ffn_up"),
            vec![d64, ff64],
            ty(Role::Other, i, d64),
            &mut state,
        );
        push(
            n("ffn_down"),
            vec![ff64, d64],
            ty(Role::FfnDown, i, ff64),
            &mut state,
        );
    }
    push(
        "output_norm.weight".into(),
        vec![d64],
        GgmlType::F32,
        &mut state,
    );
    if !tied {
        let t = ty(Role::Output, 0, d64);
        push("output.weight".into(), vec![d64, nv as u64], t, &mut state);
    }
    w.write_file(path)
}

/// The shaped file of catalog model `name` in `mix`, in `$FRUGAL_HOME/shapes`: written on first
/// use (`log` hears about it), reused after.
pub fn ensure(
    name: &str,
    mix: Mix,
    log: &mut dyn FnMut(&str),
) -> Result<std::path::PathBuf, GgufError> {
    let cat = crate::estimate::catalog::Catalog::builtin().map_err(|e| GgufError::BadValue {
        key: "catalog".into(),
        reason: e.to_string(),
    })?;
    let e = cat.find(name).map_err(|e| GgufError::BadValue {
        key: "shape".into(),
        reason: e.to_string(),
    })?;
    let dir = crate::fetch::home().join("shapes");
    let path = dir.join(format!("{}.{}.gguf", e.id, mix.name()));
    if !path.exists() {
        std::fs::create_dir_all(&dir)
            .map_err(|err| GgufError::Write(format!("{}: {err}", dir.display())))?;
        log(&format!(
            "writing {} ({} shape, {}, random weights)",
            path.display(),
            e.name,
            mix.name()
        ));
        write(e, mix, &path)?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(role: Role, layer: usize, n_layers: usize, tied: bool, cols: usize) -> Spot {
        Spot {
            role,
            layer,
            n_layers,
            tied,
            cols,
            n_gqa: 4,
        }
    }

    #[test]
    fn mixes_give_the_types_llama_quantize_does() {
        // 16 layers: 0, 1 (first eighth), 14, 15 (last eighth), and 4, 7, 10, 13 between.
        let more: Vec<usize> = (0..16)
            .filter(|&i| {
                Mix::Q4KM.tensor_type(at(Role::FfnDown, i, 16, false, 2048)) == GgmlType::Q6_K
            })
            .collect();
        assert_eq!(more, [0, 1, 4, 7, 10, 13, 14, 15]);
        let t = |m: Mix, role, layer, tied, cols| m.tensor_type(at(role, layer, 16, tied, cols));
        assert_eq!(t(Mix::Q4KM, Role::Other, 4, false, 2048), GgmlType::Q4_K);
        assert_eq!(t(Mix::Q4KM, Role::Embedding, 0, true, 2048), GgmlType::Q6_K);
        assert_eq!(
            t(Mix::Q4KM, Role::Embedding, 0, false, 2048),
            GgmlType::Q4_K
        );
        assert_eq!(t(Mix::Q8_0, Role::Output, 0, false, 2048), GgmlType::Q8_0);
        assert_eq!(t(Mix::Q4_0, Role::Output, 0, false, 2048), GgmlType::Q6_K);
        assert_eq!(t(Mix::Q2K, Role::AttnV, 3, false, 2048), GgmlType::Q4_K);
        assert_eq!(
            t(Mix::Q2K, Role::AttnOutput, 3, false, 2048),
            GgmlType::Q3_K
        );
        assert_eq!(t(Mix::Q3KM, Role::AttnV, 1, false, 2048), GgmlType::Q5_K);
        assert_eq!(t(Mix::Q3KM, Role::FfnDown, 0, false, 8192), GgmlType::Q5_K);
        assert_eq!(t(Mix::Q3KM, Role::FfnDown, 1, false, 8192), GgmlType::Q4_K);
        assert_eq!(t(Mix::Q5KM, Role::AttnV, 2, false, 2048), GgmlType::Q5_K);
        assert_eq!(t(Mix::IQ4XS, Role::FfnDown, 1, false, 8192), GgmlType::Q5_K);
        assert_eq!(t(Mix::IQ4XS, Role::Other, 5, false, 2048), GgmlType::IQ4_XS);
        assert_eq!(Mix::from_name("Q4_K_M"), Some(Mix::Q4KM));
        // SmolLM2's 576-wide rows: Q4_K falls back to Q5_0, a tied Q6_K embedding to Q8_0,
        // IQ4_XS to IQ4_NL.
        let s = |m: Mix, role, cols| m.tensor_type(at(role, 3, 30, true, cols));
        assert_eq!(s(Mix::Q4KM, Role::Other, 576), GgmlType::Q5_0);
        assert_eq!(s(Mix::Q4KM, Role::Embedding, 576), GgmlType::Q8_0);
        assert_eq!(s(Mix::IQ4XS, Role::Other, 576), GgmlType::IQ4_NL);
        assert_eq!(s(Mix::Q5KM, Role::FfnDown, 1536), GgmlType::Q5_K);
    }
}
