//! Every hyperparameter of a Llama-family model, read from GGUF metadata and validated.

use crate::gguf::{GgufError, GgufFile};

/// Architectures whose GGUF tensors follow the Llama layout (no biases, SwiGLU, RoPE in the
/// interleaved-pair layout).
pub const SUPPORTED_ARCHS: &[&str] = &["llama", "mistral"];

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Config {
    pub arch: String,
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// Number of leading dimensions of each head that RoPE rotates.
    pub rope_dim: usize,
}

impl Config {
    /// Reads the configuration from GGUF metadata, checking that the numbers are consistent.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, GgufError> {
        let arch = f.str("general.architecture")?.to_string();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            return Err(GgufError::BadValue {
                key: "general.architecture".into(),
                reason: format!(
                    "architecture {arch:?} is not supported (supported: {SUPPORTED_ARCHS:?})"
                ),
            });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let get = |k: &str| f.u32(&key(k)).map(|v| v as usize);
        let n_layers = get("block_count")?;
        let n_embd = get("embedding_length")?;
        let n_ff = get("feed_forward_length")?;
        let n_head = get("attention.head_count")?;
        let n_head_kv = match f.u32_opt(&key("attention.head_count_kv"))? {
            Some(v) => v as usize,
            None => n_head,
        };
        let bad = |k: &str, reason: String| GgufError::BadValue {
            key: key(k),
            reason,
        };
        if n_head == 0 || n_head_kv == 0 || n_layers == 0 || n_embd == 0 || n_ff == 0 {
            return Err(bad(
                "attention.head_count",
                "layer, width and head counts must be positive".into(),
            ));
        }
        if n_head % n_head_kv != 0 {
            return Err(bad(
                "attention.head_count_kv",
                format!("{n_head} query heads are not a multiple of {n_head_kv} KV heads"),
            ));
        }
        let head_dim = match f.u32_opt(&key("attention.key_length"))? {
            Some(v) => v as usize,
            None => {
                if n_embd % n_head != 0 {
                    return Err(bad(
                        "embedding_length",
                        format!("{n_embd} is not divisible by {n_head} heads"),
                    ));
                }
                n_embd / n_head
            }
        };
        if let Some(v) = f.u32_opt(&key("attention.value_length"))?
            && v as usize != head_dim
        {
            return Err(bad(
                "attention.value_length",
                format!("{v} differs from key length {head_dim}"),
            ));
        }
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(
                "attention.key_length",
                format!("head dimension {head_dim} must be even and positive"),
            ));
        }
        let rope_dim = match f.u32_opt(&key("rope.dimension_count"))? {
            Some(v) => v as usize,
            None => head_dim,
        };
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(bad(
                "rope.dimension_count",
                format!("{rope_dim} must be even and at most {head_dim}"),
            ));
        }
        let n_vocab = match f.get("tokenizer.ggml.tokens") {
            Some(_) => f.array("tokenizer.ggml.tokens")?.len(),
            None => f
                .tensor_info("token_embd.weight")
                .map(|t| t.dims.get(1).copied().unwrap_or(0) as usize)
                .ok_or_else(|| GgufError::MissingTensor {
                    tensor: "token_embd.weight".into(),
                })?,
        };
        let rms_eps = f.f32(&key("attention.layer_norm_rms_epsilon"))?;
        let rope_base = f.f32_opt(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        if !(rms_eps.is_finite() && rms_eps > 0.0 && rope_base.is_finite() && rope_base > 1.0) {
            return Err(bad(
                "rope.freq_base",
                format!("eps {rms_eps} or rope base {rope_base} out of range"),
            ));
        }
        Ok(Config {
            n_ctx_train: get("context_length")?,
            arch,
            n_layers,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_vocab,
            rms_eps,
            rope_base,
            rope_dim,
        })
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of the concatenated key (or value) heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// What the cache holds per position and layer.
    pub fn cache_shape(&self) -> crate::kv::CacheShape {
        crate::kv::CacheShape::new(self.n_head_kv, self.head_dim)
    }

    /// KV-cache elements per token: 2 (K and V) x layers x KV heads x head dimension.
    pub fn kv_elements_per_token(&self) -> usize {
        2 * self.n_layers * self.kv_dim()
    }
}
