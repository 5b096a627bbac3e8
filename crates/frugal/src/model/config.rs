//! Every hyperparameter of a Llama-family model, read from GGUF metadata and validated.

use super::features::Features;
use super::moe::MoeConfig;
use crate::gguf::{GgufError, GgufFile};

/// Architectures frugal runs. `llama` and `mistral` follow the Llama layout (no biases, SwiGLU,
/// RoPE in the interleaved-pair layout); `deepseek2` is the same block with multi-head latent
/// attention (dense FFN layers only, no query compression); `gemma3` is the Llama skeleton with
/// the switches of [`Features`].
pub const SUPPORTED_ARCHS: &[&str] = &["llama", "mistral", "deepseek2", "gemma3"];

/// Multi-head latent attention (DeepSeek-V2's MLA, llama.cpp's `deepseek2`): each token caches
/// one RMS-normed latent of `kv_lora_rank` values and one RoPE key of `rope_dim` values shared
/// by all heads. Head `h`'s key is `[W_uk_h c | k_pe]` (`nope_dim + rope_dim` values) and its
/// value `W_uv_h c` (`v_dim`), computed from the latent `c` only when needed: decode absorbs
/// `W_uk_h` into the query and `W_uv_h` into the output instead.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Mla {
    pub kv_lora_rank: usize,
    /// Per-head key dims without position (the part the latent gives).
    pub nope_dim: usize,
    /// Dims of the shared RoPE key, and of each query head's rotated tail.
    pub rope_dim: usize,
    /// Per-head value dims.
    pub v_dim: usize,
}

impl Mla {
    /// Values of one cached row: the latent, then the RoPE key.
    pub fn row_dim(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }
}

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
    /// Number of dimensions of each head that RoPE rotates: the leading ones, or under MLA the
    /// trailing ones of each query head and the whole shared RoPE key.
    pub rope_dim: usize,
    /// Latent attention; `None` for per-head keys and values (MHA, GQA, MQA). Under MLA,
    /// `head_dim` is a query head's width (`nope_dim + rope_dim`) and `n_head_kv` is 1.
    pub mla: Option<Mla>,
    /// Routed experts in every layer's FFN (`n_ff` is then one expert's width); `None` for a
    /// dense FFN.
    pub moe: Option<MoeConfig>,
    /// How the block differs from Llama's (all off for Llama).
    pub features: Features,
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
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(
                "attention.key_length",
                format!("head dimension {head_dim} must be even and positive"),
            ));
        }
        // (MLA's absorbed value is the latent, shorter than its key: checked in `read_mla`.)
        if arch != "deepseek2"
            && let Some(v) = f.u32_opt(&key("attention.value_length"))?
            && v as usize != head_dim
        {
            return Err(bad(
                "attention.value_length",
                format!("{v} differs from key length {head_dim}"),
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
        let mla = if arch == "deepseek2" {
            Some(read_mla(f, &key, n_layers, n_head_kv, rope_dim)?)
        } else {
            None
        };
        // Under MLA a query head is nope + rope wide; `key_length` is the absorbed row.
        let head_dim = mla.map_or(head_dim, |m| m.nope_dim + m.rope_dim);
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
        // Position scaling (linear, YaRN: Gemma 3 4B-27B's global layers, long-context Llama
        // files) is not implemented: such a file would run with positions off by the factor.
        let scaling = f.str_opt(&key("rope.scaling.type"))?;
        let factor = f.f32_opt(&key("rope.scaling.factor"))?;
        if scaling.is_some_and(|t| t != "none") || factor.is_some_and(|x| x != 0.0 && x != 1.0) {
            return Err(bad(
                "rope.scaling.type",
                format!(
                    "RoPE scaling {:?} with factor {:?} is not supported (positions would be wrong)",
                    scaling.unwrap_or("(unset)"),
                    factor
                ),
            ));
        }
        // Experts in a latent-attention file would sit behind `leading_dense_block_count`,
        // which `read_mla` refuses below the layer count.
        let moe = if mla.is_none() {
            MoeConfig::from_gguf(f, &arch)?
        } else {
            None
        };
        let features = Features::from_gguf(f, &arch, n_embd)?;
        Ok(Config {
            features,
            moe,
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
            mla,
        })
    }

    /// Width of the concatenated query heads.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of the concatenated key (or value) heads of a per-head layout.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// What the cache holds per position and layer: keys and values per KV head, or MLA's
    /// one latent row.
    pub fn cache_shape(&self) -> crate::kv::CacheShape {
        match self.mla {
            Some(m) => crate::kv::CacheShape::keys_only(m.row_dim()),
            None => crate::kv::CacheShape::new(self.n_head_kv, self.head_dim),
        }
    }

    /// Width of the attention output, the input of the output projection.
    pub fn attn_dim(&self) -> usize {
        match self.mla {
            Some(m) => self.n_head * m.v_dim,
            None => self.q_dim(),
        }
    }

    /// The rings the sliding-window layers' caches keep (see [`crate::kv::Rings`]): each
    /// window, the keys before it a flash tile may start at, and one pass. None without
    /// windows.
    pub fn cache_rings(&self) -> crate::kv::Rings {
        if self.features.sliding.is_none() {
            return crate::kv::Rings::none();
        }
        let lookback = crate::attention::window_lookback(self.head_dim);
        crate::kv::Rings::for_windows(
            (0..self.n_layers).map(|l| self.features.window(l)),
            lookback,
        )
    }

    /// KV-cache elements per token over all layers, as the cache stores them.
    pub fn kv_elements_per_token(&self) -> usize {
        let s = self.cache_shape();
        self.n_layers * (s.k_dim() + s.v_dim())
    }
}

/// Reads `deepseek2`'s latent attention keys, in the layout llama.cpp writes since it stores
/// MLA absorbed: one KV head of `key_length = kv_lora_rank + rope` (`value_length =
/// kv_lora_rank`), with the per-head sizes under `key_length_mla` / `value_length_mla`.
fn read_mla(
    f: &GgufFile,
    key: &dyn Fn(&str) -> String,
    n_layers: usize,
    n_head_kv: usize,
    rope_dim: usize,
) -> Result<Mla, GgufError> {
    let bad = |k: &str, reason: String| GgufError::BadValue {
        key: key(k),
        reason,
    };
    let need = |k: &str| {
        f.u32_opt(&key(k))?.map(|v| v as usize).ok_or_else(|| {
            bad(
                k,
                "missing: frugal reads MLA files in llama.cpp's absorbed layout \
                 (attn_k_b / attn_v_b and the *_mla lengths)"
                    .into(),
            )
        })
    };
    let rank = need("attention.kv_lora_rank")?;
    let k_mla = need("attention.key_length_mla")?;
    let v_dim = need("attention.value_length_mla")?;
    if let Some(q) = f.u32_opt(&key("attention.q_lora_rank"))?
        && q != 0
    {
        return Err(bad(
            "attention.q_lora_rank",
            format!("query compression (rank {q}) is not supported; only attn_q (rank 0)"),
        ));
    }
    let dense = f
        .u32_opt(&key("leading_dense_block_count"))?
        .map_or(n_layers, |v| v as usize);
    if dense < n_layers {
        return Err(bad(
            "leading_dense_block_count",
            format!(
                "{dense} of {n_layers} layers dense: mixture-of-experts layers are not supported"
            ),
        ));
    }
    if n_head_kv != 1 {
        return Err(bad(
            "attention.head_count_kv",
            format!("{n_head_kv}: an absorbed MLA file has one KV head"),
        ));
    }
    if rank == 0 || v_dim == 0 || k_mla <= rope_dim || rope_dim == 0 || !rope_dim.is_multiple_of(2)
    {
        return Err(bad(
            "attention.key_length_mla",
            format!(
                "latent rank {rank}, key length {k_mla}, value length {v_dim}, RoPE dims \
                 {rope_dim}: the rank and lengths must be positive, the RoPE part even and \
                 shorter than the key"
            ),
        ));
    }
    for (k, want) in [
        ("attention.key_length", rank + rope_dim),
        ("attention.value_length", rank),
    ] {
        if let Some(v) = f.u32_opt(&key(k))?
            && v as usize != want
        {
            return Err(bad(k, format!("{v}, expected {want} (latent rank + RoPE)")));
        }
    }
    Ok(Mla {
        kv_lora_rank: rank,
        nope_dim: k_mla - rope_dim,
        rope_dim,
        v_dim,
    })
}
