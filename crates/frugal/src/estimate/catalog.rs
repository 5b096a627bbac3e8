//! The built-in catalog: architecture facts of well-known models, each with its source.
//!
//! The facts live in a data file (`data/model-catalog.json`), not in code, so that they can be
//! checked against their sources and extended without touching the arithmetic. Names resolve
//! case-insensitively: an exact id wins, else a unique prefix (`mixtral-8x7b` finds
//! `mixtral-8x7b-v0.1`); an unknown or ambiguous name fails with the nearest ids.

use std::sync::OnceLock;

use serde::Deserialize;

use super::desc::{Attention, Ffn, Layout, Mla, ModelDesc, Moe, Norm, Origin, SlidingWindow};
use super::{EstimateError, Result};

const CATALOG_JSON: &str = include_str!("../../data/model-catalog.json");

/// Per-model layout overrides in the data file; absent fields take `layout_default`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayoutSpec {
    ffn: Option<String>,
    norm: Option<String>,
    norms_per_layer: Option<u64>,
    qkv_bias: Option<bool>,
    out_bias: Option<bool>,
    mlp_bias: Option<bool>,
    learned_positions: Option<bool>,
    qk_norm: Option<bool>,
    attention_sinks: Option<bool>,
}

/// One model of the catalog, field for field as in the data file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CatalogEntry {
    pub id: String,
    pub name: String,
    pub hf_repo: Option<String>,
    pub family: String,
    pub arch: String,
    pub attention: String,
    pub params_total_published: Option<f64>,
    pub params_active_published: Option<f64>,
    pub params_published_note: Option<String>,
    pub num_layers: u64,
    pub hidden_size: u64,
    pub num_attention_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub intermediate_size: u64,
    pub vocab_size: u64,
    pub vocab_size_note: Option<String>,
    pub max_position_embeddings: u64,
    pub context_length_published: Option<u64>,
    pub tie_word_embeddings: Option<bool>,
    pub rope_theta: Option<f64>,
    pub qkv_bias: Option<bool>,
    pub sliding_window: Option<u64>,
    pub sliding_window_layers: Option<String>,
    pub sliding_window_pattern: Option<String>,
    pub num_experts: Option<u64>,
    pub experts_per_token: Option<u64>,
    pub shared_experts: Option<u64>,
    pub expert_intermediate_size: Option<u64>,
    pub first_dense_layers: Option<u64>,
    pub moe_layer_freq: Option<u64>,
    pub kv_lora_rank: Option<u64>,
    pub q_lora_rank: Option<u64>,
    pub qk_nope_head_dim: Option<u64>,
    pub qk_rope_head_dim: Option<u64>,
    pub v_head_dim: Option<u64>,
    pub source: String,
    #[serde(default)]
    pub unverified: Vec<String>,
    #[serde(default)]
    pub notes: Vec<String>,
    layout: Option<LayoutSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    #[allow(dead_code)]
    about: String,
    layout_default: LayoutSpec,
    models: Vec<CatalogEntry>,
}

/// The parsed catalog.
#[derive(Debug)]
pub struct Catalog {
    layout_default: LayoutSpec,
    pub models: Vec<CatalogEntry>,
}

impl Catalog {
    /// The catalog compiled into the library, parsed once.
    pub fn builtin() -> Result<&'static Catalog> {
        static CAT: OnceLock<std::result::Result<Catalog, String>> = OnceLock::new();
        CAT.get_or_init(|| Catalog::parse(CATALOG_JSON).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| EstimateError::Catalog(e.clone()))
    }

    /// Parses a catalog in the data file's format.
    pub fn parse(text: &str) -> Result<Catalog> {
        let f: CatalogFile =
            serde_json::from_str(text).map_err(|e| EstimateError::Catalog(e.to_string()))?;
        let mut ids: Vec<String> = f.models.iter().map(|m| m.id.to_ascii_lowercase()).collect();
        ids.sort();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(EstimateError::Catalog(format!("duplicate id {}", w[0])));
        }
        Ok(Catalog {
            layout_default: f.layout_default,
            models: f.models,
        })
    }

    /// Finds an entry: exact id (any case), else a unique id prefix.
    pub fn find(&self, name: &str) -> Result<&CatalogEntry> {
        let q = name.trim().to_ascii_lowercase();
        if let Some(m) = self.models.iter().find(|m| m.id.eq_ignore_ascii_case(&q)) {
            return Ok(m);
        }
        let prefixed: Vec<&CatalogEntry> = if q.is_empty() {
            Vec::new()
        } else {
            self.models
                .iter()
                .filter(|m| m.id.to_ascii_lowercase().starts_with(&q))
                .collect()
        };
        match prefixed.as_slice() {
            [one] => Ok(one),
            [] => Err(EstimateError::UnknownModel {
                name: name.to_string(),
                suggestions: self.suggest(&q, 3),
            }),
            many => Err(EstimateError::AmbiguousModel {
                name: name.to_string(),
                matches: many.iter().map(|m| m.id.clone()).collect(),
            }),
        }
    }

    /// The `n` ids closest to `q` by edit distance (against the whole id and against the id's
    /// prefix of the same length, so that a misspelt short name still finds its family).
    pub fn suggest(&self, q: &str, n: usize) -> Vec<String> {
        let mut scored: Vec<(usize, &str)> = self
            .models
            .iter()
            .map(|m| {
                let id = m.id.to_ascii_lowercase();
                let prefix: String = id.chars().take(q.chars().count()).collect();
                let d = levenshtein(q, &id).min(levenshtein(q, &prefix) + 1);
                (d, m.id.as_str())
            })
            .collect();
        scored.sort();
        scored
            .into_iter()
            .take(n)
            .map(|(_, id)| id.to_string())
            .collect()
    }

    /// The description of a catalog model.
    pub fn describe(&self, name: &str) -> Result<ModelDesc> {
        let e = self.find(name)?;
        self.to_desc(e)
    }

    /// Builds the description of one entry, with its notes and unverified fields carried over.
    pub fn to_desc(&self, e: &CatalogEntry) -> Result<ModelDesc> {
        let origin = format!("{} (catalog)", e.id);
        let bad = |field: &str, reason: String| EstimateError::BadField {
            origin: origin.clone(),
            field: field.to_string(),
            reason,
        };
        let spec = e.layout.clone().unwrap_or_default();
        let d = &self.layout_default;
        let ffn = match spec.ffn.as_ref().or(d.ffn.as_ref()).map(String::as_str) {
            Some("gated") | None => Ffn::Gated,
            Some("plain") => Ffn::Plain,
            Some(other) => return Err(bad("layout.ffn", format!("unknown value {other:?}"))),
        };
        let norm = match spec.norm.as_ref().or(d.norm.as_ref()).map(String::as_str) {
            Some("rms") | None => Norm::Rms,
            Some("layernorm") => Norm::LayerNorm,
            Some(other) => return Err(bad("layout.norm", format!("unknown value {other:?}"))),
        };
        let flag = |a: Option<bool>, b: Option<bool>| a.or(b).unwrap_or(false);
        let mut warnings = Vec::new();
        let qkv_bias = match (e.qkv_bias, spec.qkv_bias) {
            (Some(v), _) => v,
            (None, Some(v)) => v,
            (None, None) => {
                warnings.push("qkv_bias unknown; assumed no bias".to_string());
                false
            }
        };
        let layout = Layout {
            ffn,
            norm,
            norms_per_layer: spec.norms_per_layer.or(d.norms_per_layer).unwrap_or(2),
            qkv_bias,
            out_bias: flag(spec.out_bias, d.out_bias),
            mlp_bias: flag(spec.mlp_bias, d.mlp_bias),
            learned_positions: flag(spec.learned_positions, d.learned_positions),
            qk_norm: flag(spec.qk_norm, d.qk_norm),
            attention_sinks: flag(spec.attention_sinks, d.attention_sinks),
        };
        let tie_embeddings = match e.tie_word_embeddings {
            Some(v) => v,
            None => {
                warnings.push(
                    "tie_word_embeddings unknown; assumed tied (one table for input and output)"
                        .to_string(),
                );
                true
            }
        };
        let attention = match e.kv_lora_rank {
            None => Attention::Standard,
            Some(r) => Attention::Mla(Mla {
                kv_lora_rank: r,
                q_lora_rank: e.q_lora_rank,
                qk_nope_head_dim: e
                    .qk_nope_head_dim
                    .ok_or_else(|| bad("qk_nope_head_dim", "required with kv_lora_rank".into()))?,
                qk_rope_head_dim: e
                    .qk_rope_head_dim
                    .ok_or_else(|| bad("qk_rope_head_dim", "required with kv_lora_rank".into()))?,
                v_head_dim: e
                    .v_head_dim
                    .ok_or_else(|| bad("v_head_dim", "required with kv_lora_rank".into()))?,
            }),
        };
        let sliding_window = match e.sliding_window {
            None => None,
            Some(w) => {
                let (layers, pattern) = match e.sliding_window_pattern.as_deref() {
                    Some("all") => (e.num_layers, format!("all {} layers", e.num_layers)),
                    Some("alternate") => (
                        e.num_layers.div_ceil(2),
                        "every other layer (even indices)".to_string(),
                    ),
                    other => {
                        return Err(bad(
                            "sliding_window_pattern",
                            format!("expected \"all\" or \"alternate\", found {other:?}"),
                        ));
                    }
                };
                Some(SlidingWindow {
                    window: w,
                    layers,
                    pattern,
                    cached: w,
                })
            }
        };
        let moe = match e.num_experts {
            None => None,
            Some(experts) => {
                let first = e.first_dense_layers.unwrap_or(0);
                let freq = e.moe_layer_freq.unwrap_or(1);
                if freq == 0 {
                    return Err(bad("moe_layer_freq", "must be at least 1".into()));
                }
                let expert_ff = e.expert_intermediate_size.ok_or_else(|| {
                    bad(
                        "expert_intermediate_size",
                        "required with num_experts".into(),
                    )
                })?;
                let shared = e.shared_experts.unwrap_or(0);
                Some(Moe {
                    experts,
                    experts_per_token: e.experts_per_token.ok_or_else(|| {
                        bad("experts_per_token", "required with num_experts".into())
                    })?,
                    expert_ff,
                    shared_experts: shared,
                    shared_ff: shared.saturating_mul(expert_ff),
                    moe_layers: moe_layer_count(e.num_layers, first, freq, &[]),
                })
            }
        };
        let mut notes = e.notes.clone();
        if let Some(v) = &e.vocab_size_note {
            notes.push(format!("vocab: {v}"));
        }
        if let Some(s) = &e.sliding_window_layers {
            notes.push(format!("sliding window: {s}"));
        }
        warnings.extend(e.unverified.iter().map(|u| format!("unverified: {u}")));
        let desc = ModelDesc {
            id: e.id.clone(),
            name: e.name.clone(),
            origin: Origin::Catalog,
            source: e.source.clone(),
            hf_repo: e.hf_repo.clone(),
            family: e.family.clone(),
            n_layers: e.num_layers,
            hidden: e.hidden_size,
            n_heads: e.num_attention_heads,
            n_kv_heads: e.num_kv_heads,
            head_dim: e.head_dim,
            ff: e.intermediate_size,
            vocab: e.vocab_size,
            max_context: Some(e.max_position_embeddings),
            published_context: e.context_length_published,
            tie_embeddings,
            layout,
            attention,
            sliding_window,
            moe,
            params_total_published: e.params_total_published,
            params_active_published: e.params_active_published,
            params_published_note: e.params_published_note.clone(),
            file_params: None,
            notes,
            warnings,
        };
        desc.validate()?;
        Ok(desc)
    }
}

/// Layers with experts: layer `i` (from 0) is MoE when `i >= first_dense`,
/// `i % freq == 0` and it is not listed in `dense_list` (DeepSeek's `first_k_dense_replace` and
/// `moe_layer_freq` rule; Qwen's `mlp_only_layers`).
pub(crate) fn moe_layer_count(
    n_layers: u64,
    first_dense: u64,
    freq: u64,
    dense_list: &[u64],
) -> u64 {
    (0..n_layers)
        .filter(|i| *i >= first_dense && i % freq.max(1) == 0 && !dense_list.contains(i))
        .count() as u64
}

/// Edit distance (insertions, deletions, substitutions), by characters.
pub fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, ca) in a.chars().enumerate() {
        cur[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimate_catalog_parses_and_every_model_validates() {
        let c = Catalog::builtin().unwrap();
        assert!(c.models.len() >= 27, "{}", c.models.len());
        for e in &c.models {
            assert!(!e.source.trim().is_empty(), "{} has no source", e.id);
            let d = c.to_desc(e).unwrap_or_else(|err| panic!("{}: {err}", e.id));
            assert_eq!(d.id, e.id);
        }
    }

    #[test]
    fn estimate_catalog_holds_every_reference_model() {
        // The 27 models of the reference list; the catalog may grow, never shrink.
        let c = Catalog::builtin().unwrap();
        for id in [
            "gpt-3-175b",
            "llama-2-7b",
            "llama-2-13b",
            "llama-2-70b",
            "llama-3-8b",
            "llama-3-70b",
            "llama-3.1-405b",
            "mistral-7b-v0.1",
            "mixtral-8x7b-v0.1",
            "mixtral-8x22b-v0.1",
            "falcon-7b",
            "falcon-40b",
            "qwen2.5-0.5b",
            "qwen2.5-7b",
            "qwen2.5-72b",
            "gemma-2-9b",
            "deepseek-v2",
            "deepseek-v2-lite",
            "deepseek-v3",
            "smollm2-135m",
            "smollm2-360m",
            "smollm2-1.7b",
            "tinyllama-1.1b",
            "phi-3-mini-4k",
            "qwen3-30b-a3b",
            "gpt-oss-20b",
            "gpt-oss-120b",
        ] {
            assert_eq!(c.find(id).unwrap().id, id);
        }
    }

    #[test]
    fn estimate_catalog_name_resolution() {
        let c = Catalog::builtin().unwrap();
        assert_eq!(c.find("LLAMA-3-70B").unwrap().id, "llama-3-70b");
        assert_eq!(c.find("mixtral-8x7b").unwrap().id, "mixtral-8x7b-v0.1");
        // An exact id beats the longer ids it prefixes.
        assert_eq!(c.find("deepseek-v2").unwrap().id, "deepseek-v2");
        match c.find("llama-2-7") {
            Err(EstimateError::AmbiguousModel { matches, .. }) => {
                assert_eq!(matches, ["llama-2-7b", "llama-2-70b"])
            }
            other => panic!("{other:?}"),
        }
        match c.find("lama-3-70b") {
            Err(EstimateError::UnknownModel { suggestions, .. }) => {
                assert_eq!(suggestions[0], "llama-3-70b")
            }
            other => panic!("{other:?}"),
        }
        let msg = c.find("mixtrall-8x7b").unwrap_err().to_string();
        assert!(msg.contains("did you mean mixtral-8x7b-v0.1"), "{msg}");
        assert!(matches!(
            c.find(""),
            Err(EstimateError::UnknownModel { .. })
        ));
    }

    #[test]
    fn estimate_levenshtein_basics() {
        assert_eq!(levenshtein("kitten", "sitting"), 3);
        assert_eq!(levenshtein("", "abc"), 3);
        assert_eq!(levenshtein("abc", "abc"), 0);
    }

    #[test]
    fn estimate_catalog_rejects_bad_data() {
        assert!(Catalog::parse("{").is_err());
        let dup = r#"{"about":"","layout_default":{},"models":[]}"#;
        assert!(Catalog::parse(dup).unwrap().models.is_empty());
        let unknown = r#"{"about":"","layout_default":{},"models":[],"extra":1}"#;
        assert!(Catalog::parse(unknown).is_err());
    }
}
