//! Every hyperparameter of a Llama-family model, read from GGUF metadata and validated.

use super::features::{BlockShape, Features};
use super::moe::MoeConfig;
use crate::gguf::{GgufError, GgufFile};
use crate::ops::{RopeScaling, Yarn};

/// Architectures frugal runs. `llama` and `mistral` follow the Llama layout (SwiGLU, RoPE in the
/// interleaved-pair layout, Llama 3's frequency factors where the file has them); `deepseek2` is
/// the same block with multi-head latent attention (dense FFN layers only, no query
/// compression); `qwen2`, `qwen3` and `gemma3` are the Llama skeleton with the switches of
/// [`Features`]; `phi3` is the Llama block with fused Q/K/V and gate/up matrices (split at
/// load), a partial rotary width and long/short RoPE factors.
pub const SUPPORTED_ARCHS: &[&str] = &[
    "llama",
    "mistral",
    "deepseek2",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma3",
];

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
    /// How the (global) layers' RoPE angles are scaled; the default changes nothing.
    pub rope_scaling: RopeScaling,
    /// Phi-3's two sets of RoPE factors: llama.cpp uses the long ones when the context a
    /// sequence is given exceeds the original context, the short ones otherwise
    /// ([`Config::set_context`] chooses; loading chooses for the training context).
    pub long_rope: Option<LongRope>,
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
        let n_ctx_train = get("context_length")?;
        let rope_scaling = read_rope_scaling(f, &arch, rope_dim, n_ctx_train)?;
        let long_rope = LongRope::from_gguf(f, &arch, rope_dim, n_ctx_train)?;
        // Experts in a latent-attention file would sit behind `leading_dense_block_count`,
        // which `read_mla` refuses below the layer count.
        let moe = if mla.is_none() {
            MoeConfig::from_gguf(f, &arch)?
        } else {
            None
        };
        let shape = BlockShape {
            n_layers,
            n_embd,
            n_head,
        };
        let features = Features::from_gguf(f, &arch, shape)?;
        let mut c = Config {
            features,
            moe,
            n_ctx_train,
            rope_scaling,
            long_rope,
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
        };
        c.set_context(n_ctx_train);
        Ok(c)
    }

    /// Chooses what depends on the context a sequence is given: Phi-3's long or short RoPE
    /// factors.
    pub fn set_context(&mut self, ctx: usize) {
        if let Some(l) = &self.long_rope {
            let f = if ctx > l.orig_ctx { &l.long } else { &l.short };
            self.rope_scaling.freq_factors = f.clone();
        }
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

/// The RoPE scaling llama.cpp applies to `arch`'s file: `rope.scaling.type` (`none`, `linear`
/// or `yarn`; llama.cpp's default is linear), `rope.scaling.factor` (or the older
/// `rope.scale_linear`; absent or 0 means 1), `rope.scaling.attn_factor`, YaRN's
/// `rope.scaling.original_context_length` (default: the training context) with llama.cpp's
/// fixed betas for these families (32 and 1: it reads the file's only for other families), and
/// a `llama` file's `rope_freqs.weight`, one divisor per rotated pair.
fn read_rope_scaling(
    f: &GgufFile,
    arch: &str,
    rope_dim: usize,
    n_ctx_train: usize,
) -> Result<RopeScaling, GgufError> {
    let key = |k: &str| format!("{arch}.{k}");
    let bad = |k: &str, reason: String| GgufError::BadValue {
        key: key(k),
        reason,
    };
    let kind = f.str_opt(&key("rope.scaling.type"))?.unwrap_or("linear");
    let factor = match f.f32_opt(&key("rope.scaling.factor"))? {
        Some(v) => Some(v),
        None => f.f32_opt(&key("rope.scale_linear"))?,
    };
    let factor = factor.filter(|&v| v != 0.0).unwrap_or(1.0);
    if !(factor.is_finite() && factor > 0.0) {
        return Err(bad(
            "rope.scaling.factor",
            format!("{factor} is not positive"),
        ));
    }
    let attn_factor = f.f32_opt(&key("rope.scaling.attn_factor"))?.unwrap_or(1.0);
    if !(attn_factor.is_finite() && attn_factor > 0.0) {
        return Err(bad(
            "rope.scaling.attn_factor",
            format!("{attn_factor} is not positive"),
        ));
    }
    let mut s = RopeScaling {
        mscale: attn_factor,
        ..Default::default()
    };
    match kind {
        "none" => {}
        "linear" => s.freq_scale = 1.0 / factor,
        // Phi-3's long/short factors (tensors, read with `LongRope`); the angle scale is
        // linear's, as llama.cpp computes it for this type.
        "longrope" if arch == "phi3" => s.freq_scale = 1.0 / factor,
        "yarn" => {
            s.freq_scale = 1.0 / factor;
            let orig = f
                .u32_opt(&key("rope.scaling.original_context_length"))?
                .map_or(n_ctx_train, |v| v as usize);
            if orig == 0 {
                return Err(bad(
                    "rope.scaling.original_context_length",
                    "must be positive".into(),
                ));
            }
            s.yarn = Some(Yarn {
                orig_ctx: orig,
                beta_fast: 32.0,
                beta_slow: 1.0,
            });
            // ggml multiplies cos and sin by `1 + 0.1 ln(1/freq_scale)` under YaRN.
            s.mscale *= 1.0 + 0.1 * (1.0 / s.freq_scale).ln();
        }
        other => {
            return Err(bad(
                "rope.scaling.type",
                format!(
                    "{other:?} is not supported (none, linear and yarn are; longrope for phi3)"
                ),
            ));
        }
    }
    if let Some(info) = f.tensor_info(ROPE_FREQS) {
        if !matches!(arch, "llama" | "mistral") {
            return Err(GgufError::BadTensor {
                tensor: ROPE_FREQS.into(),
                offset: info.info_offset,
                reason: format!("frequency factors are read only for llama files, not {arch}"),
            });
        }
        s.freq_factors = Some(freq_factors(f, ROPE_FREQS, rope_dim)?);
    }
    // llama.cpp's deepseek2 folds YaRN into the attention scale as well; not implemented.
    if arch == "deepseek2" && !s.is_identity() {
        return Err(bad(
            "rope.scaling.type",
            format!("RoPE scaling ({kind}, factor {factor}) is not supported for latent attention"),
        ));
    }
    Ok(s)
}

/// Phi-3's long and short RoPE factors (`rope_factors_long.weight`,
/// `rope_factors_short.weight`, one divisor per rotated pair, either optional as in llama.cpp),
/// and the context past which the long ones apply (`rope.scaling.original_context_length`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct LongRope {
    pub orig_ctx: usize,
    pub long: Option<Vec<f32>>,
    pub short: Option<Vec<f32>>,
}

impl LongRope {
    fn from_gguf(
        f: &GgufFile,
        arch: &str,
        rope_dim: usize,
        n_ctx_train: usize,
    ) -> Result<Option<Self>, GgufError> {
        let (long, short) = ("rope_factors_long.weight", "rope_factors_short.weight");
        let read = |name: &str| {
            f.tensor_info(name)
                .map(|_| freq_factors(f, name, rope_dim))
                .transpose()
        };
        let (l, s) = (read(long)?, read(short)?);
        if l.is_none() && s.is_none() {
            return Ok(None);
        }
        if arch != "phi3" {
            let name = if l.is_some() { long } else { short };
            return Err(GgufError::BadTensor {
                tensor: name.into(),
                offset: f.tensor_info(name).map_or(0, |t| t.info_offset),
                reason: format!("long/short RoPE factors are read only for phi3, not {arch}"),
            });
        }
        let orig_ctx = f
            .u32_opt(&format!("{arch}.rope.scaling.original_context_length"))?
            .map_or(n_ctx_train, |v| v as usize);
        Ok(Some(LongRope {
            orig_ctx,
            long: l,
            short: s,
        }))
    }
}

/// Llama 3's RoPE frequency factors (one global tensor llama.cpp shares by every layer).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// Every tensor of RoPE factors, read with the configuration.
pub(super) const ROPE_FACTOR_TENSORS: [&str; 3] = [
    ROPE_FREQS,
    "rope_factors_long.weight",
    "rope_factors_short.weight",
];

/// A tensor of one positive, finite divisor per rotated pair.
fn freq_factors(f: &GgufFile, name: &str, rope_dim: usize) -> Result<Vec<f32>, GgufError> {
    let (info, bytes) = f.tensor(name)?;
    let bad = |reason: String| GgufError::BadTensor {
        tensor: name.into(),
        offset: info.info_offset,
        reason,
    };
    if info.dims != [(rope_dim / 2) as u64] {
        return Err(bad(format!(
            "shape {:?}, expected [{}] (one factor per rotated pair)",
            info.dims,
            rope_dim / 2
        )));
    }
    let v = crate::quant::dequantize_to_vec(info.ty, bytes, rope_dim / 2)
        .map_err(|e| bad(e.to_string()))?;
    if let Some((i, x)) = v
        .iter()
        .enumerate()
        .find(|(_, x)| !(x.is_finite() && **x > 0.0))
    {
        return Err(bad(format!("factor {i} is {x}, not a positive number")));
    }
    Ok(v)
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
