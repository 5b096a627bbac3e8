//! A model description from a GGUF file's metadata, with the parameter count checked against
//! the file's own tensors.
//!
//! GGUF keys are `{arch}.block_count`, `{arch}.attention.head_count_kv` and so on. The reader
//! here is more lenient than [`crate::model::Config`], which must refuse architectures frugal
//! cannot run: estimating memory needs only the shapes, so any architecture with the standard
//! keys is described, and a missing key is named.

use crate::gguf::{GgufFile, Value};

use super::desc::{
    Attention, Ffn, FileParams, Layout, Mla, ModelDesc, Moe, Norm, Origin, SlidingWindow,
};
use super::{EstimateError, Result};

/// Builds the description; `path` names the file in messages.
/// The fraction of tensor `name`'s parameters a token uses, where `share` of the routed experts
/// run per token: none of the embedding tables (looked up, not multiplied), `share` of the
/// stacked experts (`*_exps`), all of the rest.
pub fn active_fraction(name: &str, share: f64) -> f64 {
    if name == "token_embd.weight" || name == "position_embd.weight" {
        0.0
    } else if name.contains("_exps.") {
        share
    } else {
        1.0
    }
}

pub fn from_gguf(f: &GgufFile, path: &str) -> Result<ModelDesc> {
    let arch = f.str("general.architecture")?.to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let opt = |k: &str| -> Result<Option<u64>> { Ok(f.u32_opt(&key(k))?.map(u64::from)) };
    let req = |k: &str| -> Result<u64> { Ok(u64::from(f.u32(&key(k))?)) };
    let mut notes = Vec::new();
    let mut warnings = Vec::new();

    let n_layers = req("block_count")?;
    let hidden = req("embedding_length")?;
    let n_heads = req("attention.head_count")?;
    let n_kv_heads = opt("attention.head_count_kv")?.unwrap_or(n_heads);
    let ff = opt("feed_forward_length")?.unwrap_or(0);
    let max_context = opt("context_length")?;
    if n_heads == 0 || n_kv_heads == 0 {
        return Err(EstimateError::Invalid {
            origin: path.to_string(),
            reason: "attention and KV head counts must be at least 1".into(),
        });
    }

    let kv_lora = opt("attention.kv_lora_rank")?;
    let rope_dim = opt("rope.dimension_count")?;
    let attention = match kv_lora {
        None => Attention::Standard,
        Some(rank) => {
            // Files converted since llama.cpp stores MLA in its absorbed form keep the
            // per-head sizes under the *_mla keys.
            let k_len = opt("attention.key_length_mla")?.or(opt("attention.key_length")?);
            let v_len = opt("attention.value_length_mla")?.or(opt("attention.value_length")?);
            let rope = rope_dim.ok_or_else(|| missing(path, &key("rope.dimension_count")))?;
            let k_len = k_len.ok_or_else(|| missing(path, &key("attention.key_length")))?;
            let v_len = v_len.ok_or_else(|| missing(path, &key("attention.value_length")))?;
            if k_len <= rope {
                return Err(EstimateError::Invalid {
                    origin: path.to_string(),
                    reason: format!("key length {k_len} is not larger than the RoPE part {rope}"),
                });
            }
            Attention::Mla(Mla {
                kv_lora_rank: rank,
                q_lora_rank: opt("attention.q_lora_rank")?,
                qk_nope_head_dim: k_len - rope,
                qk_rope_head_dim: rope,
                v_head_dim: v_len,
            })
        }
    };
    let head_dim = match &attention {
        Attention::Mla(m) => m.qk_nope_head_dim,
        Attention::Standard => match opt("attention.key_length")? {
            Some(k) => {
                if let Some(v) = opt("attention.value_length")?
                    && v != k
                {
                    warnings.push(format!(
                            "value length {v} differs from key length {k}; the estimate uses {k} for both"
                        ));
                }
                k
            }
            None => {
                if hidden % n_heads != 0 {
                    return Err(EstimateError::Invalid {
                        origin: path.to_string(),
                        reason: format!(
                            "embedding length {hidden} is not divisible by {n_heads} heads"
                        ),
                    });
                }
                hidden / n_heads
            }
        },
    };

    let vocab = match opt("vocab_size")? {
        Some(v) => v,
        None => match f.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
            Some(a) => a.len() as u64,
            None => f
                .tensor_info("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .ok_or_else(|| missing(path, "tokenizer.ggml.tokens"))?,
        },
    };

    let experts = opt("expert_count")?.filter(|&e| e > 0);
    let moe = match experts {
        None => None,
        Some(e) => {
            let k = opt("expert_used_count")?
                .ok_or_else(|| missing(path, &key("expert_used_count")))?;
            let expert_ff = opt("expert_feed_forward_length")?.unwrap_or(ff);
            let shared_n = opt("expert_shared_count")?.unwrap_or(0);
            let shared_ff = match opt("expert_shared_feed_forward_length")? {
                Some(v) => v,
                None => shared_n * expert_ff,
            };
            let first = opt("leading_dense_block_count")?.unwrap_or(0);
            Some(Moe {
                experts: e,
                experts_per_token: k,
                expert_ff,
                shared_experts: if shared_n > 0 {
                    shared_n
                } else {
                    u64::from(shared_ff > 0)
                },
                shared_ff,
                moe_layers: n_layers.saturating_sub(first),
            })
        }
    };

    let has = |name: &str| f.tensor_info(name).is_some();
    let has_tensors = !f.tensors().is_empty();
    let mut layout = Layout::default();
    match arch.as_str() {
        "gpt2" => {
            layout.ffn = Ffn::Plain;
            layout.norm = Norm::LayerNorm;
            layout.out_bias = true;
            layout.mlp_bias = true;
            layout.learned_positions = true;
        }
        "falcon" => {
            layout.ffn = Ffn::Plain;
            layout.norm = Norm::LayerNorm;
            layout.norms_per_layer = if has("blk.0.attn_norm_2.weight") {
                2
            } else {
                1
            };
        }
        "qwen3" | "qwen3moe" => layout.qk_norm = true,
        "gemma2" | "gemma3" => layout.norms_per_layer = 4,
        "gpt-oss" => {
            layout.out_bias = true;
            layout.mlp_bias = true;
            layout.attention_sinks = true;
        }
        _ => {}
    }
    if has_tensors {
        layout.qkv_bias = has("blk.0.attn_q.bias") || has("blk.0.attn_qkv.bias");
    } else if matches!(arch.as_str(), "qwen2" | "qwen2moe" | "gpt2" | "gpt-oss") {
        layout.qkv_bias = true;
    }
    let tie_embeddings = if has_tensors {
        !has("output.weight")
    } else {
        warnings.push("no tensors in the file: output head assumed untied".into());
        false
    };

    let sliding_window = match opt("attention.sliding_window")?.filter(|&w| w > 0) {
        None => None,
        Some(w) => {
            let (layers, pattern) = match arch.as_str() {
                "gemma2" | "gpt-oss" => (
                    n_layers.div_ceil(2),
                    "every other layer (even indices)".to_string(),
                ),
                "gemma3" => {
                    let p = opt("attention.sliding_window_pattern")
                        .ok()
                        .flatten()
                        .unwrap_or(6)
                        .max(1);
                    (
                        n_layers - n_layers / p,
                        format!("all but every {p}th layer"),
                    )
                }
                _ => {
                    warnings.push(format!(
                        "sliding window {w}: assumed to apply to all {n_layers} layers"
                    ));
                    (n_layers, format!("all {n_layers} layers (assumed)"))
                }
            };
            // A file frugal runs is estimated as frugal caches it: each windowed layer in a
            // ring a little longer than its window (see `kv::Rings`).
            let cached = if crate::model::SUPPORTED_ARCHS.contains(&arch.as_str()) {
                let lookback = crate::attention::window_lookback(head_dim as usize);
                let ring = crate::kv::ring_rows(w as usize, lookback) as u64;
                notes.push(format!(
                    "frugal's cache: each windowed layer holds at most {ring} positions (the \
                     window of {w}, {lookback} before it that a flash tile may start at, and one \
                     pass of up to {} tokens)",
                    crate::kv::RING_CHUNK
                ));
                ring
            } else {
                w
            };
            Some(SlidingWindow {
                window: w,
                layers,
                pattern,
                cached,
            })
        }
    };

    let file_params = if has_tensors {
        let mut total = 0u64;
        let mut active = 0f64;
        let mut bytes = 0u64;
        let mut by_type: Vec<(String, u64, u64)> = Vec::new();
        let share = moe
            .as_ref()
            .map_or(1.0, |m| m.experts_per_token as f64 / m.experts as f64);
        for t in f.tensors() {
            let n = t.n_elements();
            total = total.saturating_add(n);
            bytes = bytes.saturating_add(t.n_bytes());
            active += n as f64 * active_fraction(&t.name, share);
            let ty = t.ty.name().to_string();
            match by_type.iter_mut().find(|e| e.0 == ty) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += t.n_bytes();
                }
                None => by_type.push((ty, 1, t.n_bytes())),
            }
        }
        notes.push(format!(
            "{} tensors in the file; parameters also counted from them",
            f.tensors().len()
        ));
        Some(FileParams {
            total,
            active: active.round() as u64,
            bytes,
            by_type,
        })
    } else {
        None
    };

    let file_name = std::path::Path::new(path)
        .file_name()
        .and_then(|s| s.to_str())
        .unwrap_or(path)
        .to_string();
    let desc = ModelDesc {
        id: file_name.clone(),
        name: f
            .str_opt("general.name")
            .ok()
            .flatten()
            .map(str::to_string)
            .unwrap_or(file_name),
        origin: Origin::Gguf,
        source: path.to_string(),
        hf_repo: None,
        family: arch.clone(),
        n_layers,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ff,
        vocab,
        max_context,
        published_context: None,
        tie_embeddings,
        layout,
        attention,
        sliding_window,
        moe,
        params_total_published: None,
        params_active_published: None,
        params_published_note: None,
        file_params,
        notes,
        warnings,
    };
    desc.validate()?;
    Ok(desc)
}

fn missing(path: &str, key: &str) -> EstimateError {
    EstimateError::MissingField {
        origin: path.to_string(),
        field: key.to_string(),
        why: "needed for the estimate".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::memory::ParamCount;
    use crate::estimate::{Format, KvShape};
    use crate::gguf::GgufWriter;

    /// SmolLM2-135M's metadata as in the reference file (no tensors).
    fn smollm2_meta() -> GgufWriter<'static> {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("llama".into()));
        w.set("general.name", Value::String("SmolLM2 135M".into()));
        for (k, v) in [
            ("llama.block_count", 30u32),
            ("llama.embedding_length", 576),
            ("llama.feed_forward_length", 1536),
            ("llama.attention.head_count", 9),
            ("llama.attention.head_count_kv", 3),
            ("llama.context_length", 8192),
            ("llama.vocab_size", 49152),
            ("llama.rope.dimension_count", 64),
        ] {
            w.set(k, Value::U32(v));
        }
        w
    }

    #[test]
    fn estimate_gguf_metadata_gives_reference_kv() {
        let bytes = smollm2_meta().to_bytes().unwrap();
        let f = GgufFile::from_bytes(bytes).unwrap();
        let d = from_gguf(&f, "smol.gguf").unwrap();
        assert_eq!(d.name, "SmolLM2 135M");
        assert_eq!((d.n_layers, d.n_kv_heads, d.head_dim), (30, 3, 64));
        let s = KvShape::of_model(&d);
        // Reference sheet: 23,040 B per token in f16.
        assert_eq!(s.bytes_per_token(&d, Format::F16), 23_040);
        assert!(d.file_params.is_none());
    }

    #[test]
    fn estimate_gguf_missing_and_zero_fields_are_errors() {
        let mut w = smollm2_meta();
        w.metadata.retain(|(k, _)| k != "llama.block_count");
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        assert!(
            from_gguf(&f, "x.gguf")
                .unwrap_err()
                .to_string()
                .contains("block_count")
        );
        let mut w = smollm2_meta();
        w.set("llama.attention.head_count_kv", Value::U32(2));
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        assert!(
            from_gguf(&f, "x.gguf")
                .unwrap_err()
                .to_string()
                .contains("do not divide")
        );
        let mut w = smollm2_meta();
        w.set("llama.attention.head_count", Value::U32(0));
        let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
        assert!(from_gguf(&f, "x.gguf").is_err());
    }

    #[test]
    fn estimate_gguf_real_file_params_match_config_arithmetic() {
        // The reference model, where it has been fetched; the arithmetic must reproduce the
        // file's own tensor count exactly (134,515,008).
        let Some(path) = crate::fetch::reference_model_for_tests() else {
            return;
        };
        let f = GgufFile::open(&path).unwrap();
        let d = from_gguf(&f, &path.display().to_string()).unwrap();
        let fp = d.file_params.as_ref().unwrap();
        assert_eq!(fp.total, 134_515_008);
        assert_eq!(ParamCount::of(&d).unwrap().total, fp.total);
        assert!(d.tie_embeddings);
    }
}
