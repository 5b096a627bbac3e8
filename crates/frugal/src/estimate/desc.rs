//! What the arithmetic needs to know about a model, whichever source it came from.
//!
//! Three sources feed one [`ModelDesc`]: the catalog (facts with a citation), a GGUF file's
//! metadata (what llama.cpp will actually allocate for), and a Hugging Face `config.json` (what a
//! checkpoint declares). Each parser maps its own keys and reports, in `warnings`, every field
//! it did not understand and every default it had to assume, because an estimate built on a
//! silently guessed field looks exactly as confident as a right one.

use std::path::Path;

use serde::Serialize;

use super::{EstimateError, Result};

/// Where a description came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    Catalog,
    Gguf,
    HfConfig,
}

impl Origin {
    pub fn label(&self) -> &'static str {
        match self {
            Origin::Catalog => "catalog",
            Origin::Gguf => "GGUF metadata",
            Origin::HfConfig => "config.json",
        }
    }
}

/// Feed-forward block shape: gated (SwiGLU/GeGLU: gate, up and down matrices) or plain
/// (up and down, as in GPT-2 and Falcon).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ffn {
    Gated,
    Plain,
}

/// Normalization: RMSNorm has a weight per channel, LayerNorm a weight and a bias.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    Rms,
    LayerNorm,
}

/// The per-layer structure the parameter count depends on beyond the widths. The default is
/// the Llama layout, which most open models follow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Layout {
    pub ffn: Ffn,
    pub norm: Norm,
    pub norms_per_layer: u64,
    /// Biases on the query, key and value projections (Qwen2, GPT-2, gpt-oss).
    pub qkv_bias: bool,
    /// A bias on the attention output projection.
    pub out_bias: bool,
    /// Biases on the FFN (and, for experts, the router) projections.
    pub mlp_bias: bool,
    /// A learned position table of max_context rows (GPT-2/GPT-3) instead of RoPE.
    pub learned_positions: bool,
    /// A per-head RMSNorm on queries and keys (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// One learned attention-sink logit per head (gpt-oss).
    pub attention_sinks: bool,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            ffn: Ffn::Gated,
            norm: Norm::Rms,
            norms_per_layer: 2,
            qkv_bias: false,
            out_bias: false,
            mlp_bias: false,
            learned_positions: false,
            qk_norm: false,
            attention_sinks: false,
        }
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3): keys and values are rebuilt from one
/// compressed latent of `kv_lora_rank` elements per token, plus one small key that carries the
/// rotary position (`qk_rope_head_dim`), shared by all heads. Only those two are cached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mla {
    pub kv_lora_rank: u64,
    /// Rank of the query compression; `None` when queries are projected directly.
    pub q_lora_rank: Option<u64>,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

/// Attention as the cache sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Attention {
    /// Multi-head, grouped-query or multi-query attention: each layer caches a key and a value
    /// vector of `head_dim` for each of `n_kv_heads`.
    Standard,
    Mla(Mla),
}

/// Layers that attend only to the last `window` positions, and so cache at most that many.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SlidingWindow {
    pub window: u64,
    /// How many of the model's layers are windowed; the others cache every position.
    pub layers: u64,
    /// Which layers, in words (e.g. "all 32 layers", "every other layer (even indices)").
    pub pattern: String,
    /// Positions a windowed layer's cache holds: the window itself in the published
    /// arithmetic (catalog, config.json); for a GGUF file frugal runs, frugal's ring (the
    /// window, the keys a flash tile may start before it, and one pass of up to 512 tokens),
    /// so the figures are what `frugal info` and the cache itself give.
    pub cached: u64,
}

/// Mixture of experts: each MoE layer holds `experts` FFNs of width `expert_ff` and runs
/// `experts_per_token` of them, plus always-on shared experts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Moe {
    pub experts: u64,
    pub experts_per_token: u64,
    pub expert_ff: u64,
    pub shared_experts: u64,
    /// Total FFN width of the shared experts in one layer (shared_experts x their width).
    pub shared_ff: u64,
    /// Layers with experts; the rest have a dense FFN of the model's `ff` width.
    pub moe_layers: u64,
}

/// Parameters as counted from a file's tensors (GGUF): the ground truth the config arithmetic
/// is checked against.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FileParams {
    pub total: u64,
    /// Excluding the input embedding table and unused experts (scaled by used/total).
    pub active: u64,
    /// Bytes of all tensors as stored.
    pub bytes: u64,
    /// Bytes by stored type: (type name, tensors, bytes).
    pub by_type: Vec<(String, u64, u64)>,
}

/// Everything the estimate needs about one model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelDesc {
    /// Catalog id, or the file name.
    pub id: String,
    pub name: String,
    pub origin: Origin,
    /// The citation (catalog) or the path (files).
    pub source: String,
    pub hf_repo: Option<String>,
    /// Architecture family (`llama`, `deepseek_v3`, ...).
    pub family: String,
    pub n_layers: u64,
    pub hidden: u64,
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
    /// Width of the dense FFN (unused when every layer has experts).
    pub ff: u64,
    pub vocab: u64,
    /// Longest context the configuration accepts (`max_position_embeddings`).
    pub max_context: Option<u64>,
    /// Context length the authors publish, where it differs from the configuration's.
    pub published_context: Option<u64>,
    pub tie_embeddings: bool,
    pub layout: Layout,
    pub attention: Attention,
    pub sliding_window: Option<SlidingWindow>,
    pub moe: Option<Moe>,
    pub params_total_published: Option<f64>,
    pub params_active_published: Option<f64>,
    pub params_published_note: Option<String>,
    pub file_params: Option<FileParams>,
    /// Facts worth knowing next to the figures (from the catalog or the parser).
    pub notes: Vec<String>,
    /// Fields not understood, contradictions resolved, defaults assumed.
    pub warnings: Vec<String>,
}

/// Largest accepted width, head count or vocabulary: generous for any real model, small
/// enough that no product of them can overflow.
const MAX_DIM: u64 = 1 << 24;
/// Most layers accepted.
const MAX_LAYERS: u64 = 1 << 14;

impl ModelDesc {
    /// Where the description came from, for error messages.
    pub fn origin_text(&self) -> String {
        format!("{} ({})", self.id, self.origin.label())
    }

    /// Checks the numbers the arithmetic divides by or relies on; called by every parser.
    pub fn validate(&self) -> Result<()> {
        let invalid = |reason: String| EstimateError::Invalid {
            origin: self.origin_text(),
            reason,
        };
        for (what, v, max) in [
            ("layers", self.n_layers, MAX_LAYERS),
            ("hidden size", self.hidden, MAX_DIM),
            ("attention heads", self.n_heads, MAX_DIM),
            ("KV heads", self.n_kv_heads, MAX_DIM),
            ("head dimension", self.head_dim, MAX_DIM),
            ("vocabulary size", self.vocab, MAX_DIM),
        ] {
            if v == 0 {
                return Err(invalid(format!("{what} is 0; it must be at least 1")));
            }
            if v > max {
                return Err(invalid(format!("{what} is {v}, more than {max}")));
            }
        }
        if self.ff > MAX_DIM {
            return Err(invalid(format!("FFN width {} is too large", self.ff)));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(invalid(format!(
                "{} KV heads do not divide {} attention heads (each KV head must serve a whole group of query heads)",
                self.n_kv_heads, self.n_heads
            )));
        }
        if let Some(c) = self.max_context
            && (c == 0 || c > super::MAX_CONTEXT)
        {
            return Err(invalid(format!("maximum context {c} is out of range")));
        }
        let dense_layers = self
            .n_layers
            .saturating_sub(self.moe.as_ref().map_or(0, |m| m.moe_layers));
        if dense_layers > 0 && self.ff == 0 {
            return Err(invalid(
                "FFN width is 0 but some layers have a dense FFN".into(),
            ));
        }
        if let Attention::Mla(m) = &self.attention {
            if m.kv_lora_rank == 0 || m.qk_rope_head_dim == 0 || m.v_head_dim == 0 {
                return Err(invalid(
                    "MLA ranks and head dimensions must be at least 1".into(),
                ));
            }
            for v in [
                m.kv_lora_rank,
                m.qk_rope_head_dim,
                m.qk_nope_head_dim,
                m.v_head_dim,
                m.q_lora_rank.unwrap_or(0),
            ] {
                if v > MAX_DIM {
                    return Err(invalid(format!("MLA dimension {v} is too large")));
                }
            }
        }
        if let Some(w) = &self.sliding_window {
            if w.window == 0 {
                return Err(invalid("sliding window of 0 tokens".into()));
            }
            if w.layers > self.n_layers {
                return Err(invalid(format!(
                    "{} windowed layers but only {} layers",
                    w.layers, self.n_layers
                )));
            }
        }
        if let Some(m) = &self.moe {
            if m.experts == 0 || m.experts > MAX_DIM {
                return Err(invalid(format!(
                    "expert count {} is out of range",
                    m.experts
                )));
            }
            if m.experts_per_token == 0 || m.experts_per_token > m.experts {
                return Err(invalid(format!(
                    "{} experts per token with {} experts",
                    m.experts_per_token, m.experts
                )));
            }
            if m.expert_ff == 0 || m.expert_ff > MAX_DIM || m.shared_ff > MAX_DIM {
                return Err(invalid(format!(
                    "expert FFN width {} is out of range",
                    m.expert_ff
                )));
            }
            if m.moe_layers > self.n_layers {
                return Err(invalid(format!(
                    "{} MoE layers but only {} layers",
                    m.moe_layers, self.n_layers
                )));
            }
        }
        Ok(())
    }

    /// The attention type in words: `GQA (8 KV heads for 64 query heads)`.
    pub fn attention_label(&self) -> String {
        match &self.attention {
            Attention::Mla(m) => format!(
                "MLA (latent rank {} + {} RoPE key dims, {} heads)",
                m.kv_lora_rank, m.qk_rope_head_dim, self.n_heads
            ),
            Attention::Standard => standard_label(self.n_heads, self.n_kv_heads),
        }
    }

    /// The query/key and value head dimensions attention multiplies with (they differ under
    /// MLA, whose query-key dot product includes the RoPE part).
    pub fn attention_dims(&self) -> (u64, u64) {
        match &self.attention {
            Attention::Mla(m) => (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim),
            Attention::Standard => (self.head_dim, self.head_dim),
        }
    }
}

/// MHA, MQA or GQA, named from the head counts.
pub fn standard_label(n_heads: u64, n_kv: u64) -> String {
    if n_kv == n_heads {
        format!("MHA ({n_heads} heads)")
    } else if n_kv == 1 {
        format!("MQA (1 KV head for {n_heads} query heads)")
    } else {
        format!("GQA ({n_kv} KV heads for {n_heads} query heads)")
    }
}

/// Reads a model description from a path: a GGUF file, a `config.json`, or a directory
/// holding a `config.json`.
pub fn from_path(path: &Path) -> Result<ModelDesc> {
    let shown = path.display().to_string();
    let io = |source| EstimateError::Io {
        path: shown.clone(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    let file = if meta.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let mut magic = [0u8; 4];
    let is_gguf = {
        use std::io::Read;
        let mut f = std::fs::File::open(&file).map_err(|source| EstimateError::Io {
            path: file.display().to_string(),
            source,
        })?;
        f.read(&mut magic).map_err(io)? == 4 && magic == crate::gguf::MAGIC
    };
    if is_gguf {
        let g = crate::gguf::GgufFile::open(&file)?;
        super::gguf_desc::from_gguf(&g, &file.display().to_string())
    } else {
        let text = std::fs::read_to_string(&file).map_err(|source| EstimateError::Io {
            path: file.display().to_string(),
            source,
        })?;
        super::hf_config::from_config_json(&text, &file.display().to_string())
    }
}

/// Parses config.json text (for tests in sibling modules).
#[cfg(test)]
pub(crate) fn resolve_json_for_tests(text: &str) -> Result<ModelDesc> {
    super::hf_config::from_config_json(text, "config.json")
}

/// Resolves what the user typed: an existing path (GGUF or config.json) or a catalog name.
/// Something that looks like a path but does not exist is reported as a missing file rather
/// than as an unknown model name.
pub fn resolve(spec: &str) -> Result<ModelDesc> {
    let p = Path::new(spec);
    if p.exists() {
        return from_path(p);
    }
    let looks_like_path = spec.contains('/')
        || spec.contains('\\')
        || spec.to_ascii_lowercase().ends_with(".gguf")
        || spec.to_ascii_lowercase().ends_with(".json");
    if looks_like_path {
        return Err(EstimateError::Io {
            path: spec.to_string(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        });
    }
    super::catalog::Catalog::builtin()?.describe(spec)
}
