//! A model description from a Hugging Face `config.json`.
//!
//! Covers the Llama family (Llama, Mistral, Qwen2/3, Phi-3, Gemma, SmolLM, TinyLlama), the
//! expert keys of Mixtral, Qwen-MoE, DeepSeek and gpt-oss, DeepSeek's MLA keys, sliding-window
//! keys (`sliding_window`, `use_sliding_window`, `max_window_layers`, `layer_types`), and the
//! GPT-2 and Falcon key spellings. Every key is either used, known to be irrelevant to memory,
//! or reported as unrecognised; where two keys say the same thing and disagree, that is an
//! error rather than a pick.

use serde_json::{Map, Value};

use super::catalog::moe_layer_count;
use super::desc::{Attention, Ffn, Layout, Mla, ModelDesc, Moe, Norm, Origin, SlidingWindow};
use super::{EstimateError, Result};

/// Keys read by this parser (in any of the model types).
const USED: &[&str] = &[
    "model_type",
    "architectures",
    "_name_or_path",
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "hidden_size",
    "n_embd",
    "d_model",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "num_kv_heads",
    "n_head_kv",
    "multi_query",
    "head_dim",
    "intermediate_size",
    "ffn_hidden_size",
    "n_inner",
    "vocab_size",
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "bias",
    "new_decoder_architecture",
    "parallel_attn",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "sliding_window_pattern",
    "num_local_experts",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "moe_intermediate_size",
    "n_shared_experts",
    "shared_expert_intermediate_size",
    "first_k_dense_replace",
    "moe_layer_freq",
    "decoder_sparse_step",
    "mlp_only_layers",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_nextn_predict_layers",
    "rope_scaling",
    "text_config",
];

/// Keys that do not change the memory arithmetic (token ids, numerics, training knobs).
const IRRELEVANT: &[&str] = &[
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "hidden_act",
    "hidden_activation",
    "activation_function",
    "initializer_range",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "rope_local_base_freq",
    "rotary_dim",
    "partial_rotary_factor",
    "attention_dropout",
    "hidden_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "scale_attn_weights",
    "reorder_and_upcast_attn",
    "scale_attn_by_inverse_layer_idx",
    "pretraining_tp",
    "router_aux_loss_coef",
    "output_router_logits",
    "router_jitter_noise",
    "aux_loss_alpha",
    "seq_aux",
    "ep_size",
    "n_group",
    "topk_group",
    "topk_method",
    "norm_topk_prob",
    "routed_scaling_factor",
    "scoring_func",
    "swiglu_limit",
    "initial_context_length",
    "use_mrope",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "quantization_config",
    "auto_map",
    "alibi",
    "original_max_position_embeddings",
    "embedding_multiplier",
    "logits_scaling",
    "is_decoder",
    "task_specific_params",
    "tokenizer_class",
    "attention_probs_dropout_prob",
    "hidden_dropout_prob",
    "use_qk_norm",
    "qk_layernorm",
];

/// Largest value accepted for any integer field.
const MAX_FIELD: u64 = 1 << 32;
/// Most layers accepted (checked before anything loops over them).
const MAX_LAYERS: u64 = 1 << 14;

struct Reader<'a> {
    obj: &'a Map<String, Value>,
    origin: String,
}

impl Reader<'_> {
    fn bad(&self, field: &str, reason: impl Into<String>) -> EstimateError {
        EstimateError::BadField {
            origin: self.origin.clone(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }

    /// A non-negative integer field; `null` counts as absent.
    fn u64(&self, key: &str) -> Result<Option<u64>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => {
                let n = match (v.as_u64(), v.as_f64()) {
                    (Some(u), _) => u,
                    (None, Some(f)) if f >= 0.0 && f.fract() == 0.0 && f < 9e15 => f as u64,
                    _ => {
                        return Err(
                            self.bad(key, format!("expected a non-negative integer, found {v}"))
                        );
                    }
                };
                // No architecture field comes near 2^32; larger values are corrupt, and
                // refusing them here keeps every product below from overflowing.
                if n > MAX_FIELD {
                    return Err(self.bad(key, format!("{n} is implausibly large")));
                }
                Ok(Some(n))
            }
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.bad(key, format!("expected true or false, found {v}"))),
        }
    }

    fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.bad(key, format!("expected a string, found {v}"))),
        }
    }

    /// The first of several spellings of one quantity; spellings that disagree are an error.
    fn one_of(&self, keys: &[&str]) -> Result<Option<u64>> {
        let mut found: Option<(u64, &str)> = None;
        for k in keys {
            if let Some(v) = self.u64(k)? {
                match found {
                    None => found = Some((v, k)),
                    Some((prev, pk)) if prev != v => {
                        return Err(EstimateError::Contradiction {
                            origin: self.origin.clone(),
                            reason: format!("`{pk}` is {prev} but `{k}` is {v}"),
                        });
                    }
                    _ => {}
                }
            }
        }
        Ok(found.map(|(v, _)| v))
    }

    fn require(&self, keys: &[&str], why: &str) -> Result<u64> {
        self.one_of(keys)?
            .ok_or_else(|| EstimateError::MissingField {
                origin: self.origin.clone(),
                field: keys[0].to_string(),
                why: why.to_string(),
            })
    }

    fn u64_list(&self, key: &str) -> Result<Vec<u64>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .ok_or_else(|| self.bad(key, "expected a list of layer indices"))
                })
                .collect(),
            Some(v) => Err(self.bad(key, format!("expected a list, found {v}"))),
        }
    }
}

/// Model types whose layout this parser knows; anything else is read as Llama-like, with a
/// warning saying so.
const KNOWN_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "falcon",
    "gpt2",
];

/// Parses a `config.json`. `path` names the file in messages.
pub fn from_config_json(text: &str, path: &str) -> Result<ModelDesc> {
    let v: Value = serde_json::from_str(text).map_err(|e| EstimateError::BadJson {
        path: path.to_string(),
        reason: e.to_string(),
    })?;
    let top = v.as_object().ok_or_else(|| EstimateError::BadJson {
        path: path.to_string(),
        reason: "the top level is not a JSON object".into(),
    })?;
    let mut warnings = Vec::new();
    let mut notes = Vec::new();
    // Multimodal checkpoints nest the language model's keys under text_config.
    let obj = match top.get("text_config") {
        Some(Value::Object(t))
            if !t.contains_key("model_type") || top.get("num_hidden_layers").is_none() =>
        {
            notes.push("read the language model's keys from text_config".to_string());
            t
        }
        _ => top,
    };
    let r = Reader {
        obj,
        origin: path.to_string(),
    };
    let model_type = r.str("model_type")?.unwrap_or("").to_ascii_lowercase();
    if model_type.is_empty() {
        warnings.push("no model_type; read as a Llama-style model".to_string());
    } else if !KNOWN_TYPES.contains(&model_type.as_str()) {
        warnings.push(format!(
            "model_type {model_type:?} is not one this parser knows; assumed a Llama-style layout (gated FFN, RMSNorm, no biases)"
        ));
    }
    for k in obj.keys() {
        if !USED.contains(&k.as_str()) && !IRRELEVANT.contains(&k.as_str()) {
            warnings.push(format!("unrecognised field `{k}` ignored"));
        }
    }

    let n_layers = r.require(
        &["num_hidden_layers", "n_layer", "num_layers"],
        "the number of layers",
    )?;
    if n_layers > MAX_LAYERS {
        return Err(r.bad(
            "num_hidden_layers",
            format!("{n_layers} layers is more than {MAX_LAYERS}"),
        ));
    }
    let hidden = r.require(&["hidden_size", "n_embd", "d_model"], "the hidden size")?;
    let n_heads = r.require(
        &["num_attention_heads", "n_head"],
        "the number of attention heads",
    )?;
    let is_falcon = model_type == "falcon";
    let is_gpt2 = model_type == "gpt2";
    let kv_key = r.one_of(&["num_key_value_heads", "num_kv_heads", "n_head_kv"])?;
    let multi_query = r.bool("multi_query")?;
    let new_arch = r.bool("new_decoder_architecture")?.unwrap_or(false);
    let n_kv_heads = match (kv_key, multi_query) {
        (Some(kv), Some(true)) if kv != 1 && !(is_falcon && new_arch) => {
            return Err(EstimateError::Contradiction {
                origin: path.to_string(),
                reason: format!("multi_query is true but the KV head count is {kv}"),
            });
        }
        // Falcon reads num_kv_heads only with the new decoder architecture.
        (Some(kv), _) if !is_falcon || new_arch => kv,
        (_, Some(true)) => 1,
        _ => {
            if !is_falcon && !is_gpt2 {
                notes.push("no num_key_value_heads: one KV head per attention head (MHA)".into());
            }
            n_heads
        }
    };
    if n_heads == 0 || n_kv_heads == 0 {
        return Err(EstimateError::Invalid {
            origin: path.to_string(),
            reason: "attention and KV head counts must be at least 1".into(),
        });
    }
    let head_dim = match r.u64("head_dim")? {
        Some(hd) if !model_type.starts_with("deepseek") => {
            if hd * n_heads != hidden {
                notes.push(format!(
                    "head_dim {hd} x {n_heads} heads = {} differs from hidden size {hidden} (allowed: the attention width is set separately)",
                    hd * n_heads
                ));
            }
            hd
        }
        _ => {
            if hidden % n_heads != 0 {
                return Err(EstimateError::Invalid {
                    origin: path.to_string(),
                    reason: format!(
                        "hidden size {hidden} is not divisible by {n_heads} heads and no head_dim is given"
                    ),
                });
            }
            hidden / n_heads
        }
    };
    let vocab = r.require(&["vocab_size"], "the vocabulary size")?;
    let max_context = r.one_of(&[
        "max_position_embeddings",
        "n_positions",
        "max_sequence_length",
        "seq_length",
    ])?;
    if max_context.is_none() {
        warnings.push("no max_position_embeddings: the maximum context is unknown".into());
    }
    if let Some(Value::Object(rs)) = obj.get("rope_scaling")
        && let Some(orig) = rs
            .get("original_max_position_embeddings")
            .and_then(Value::as_u64)
    {
        notes.push(format!(
            "rope_scaling extends an original context of {orig} positions"
        ));
    }

    // Layout.
    let mut layout = Layout::default();
    match model_type.as_str() {
        "gpt2" => {
            layout.ffn = Ffn::Plain;
            layout.norm = Norm::LayerNorm;
            layout.qkv_bias = true;
            layout.out_bias = true;
            layout.mlp_bias = true;
            layout.learned_positions = true;
        }
        "falcon" => {
            layout.ffn = Ffn::Plain;
            layout.norm = Norm::LayerNorm;
            let parallel = r.bool("parallel_attn")?.unwrap_or(true);
            layout.norms_per_layer = if new_arch || !parallel { 2 } else { 1 };
            let bias = r.bool("bias")?.unwrap_or(false);
            layout.qkv_bias = bias;
            layout.out_bias = bias;
            layout.mlp_bias = bias;
        }
        "qwen2" | "qwen2_moe" => layout.qkv_bias = true,
        "qwen3" | "qwen3_moe" => layout.qk_norm = true,
        "gemma2" => layout.norms_per_layer = 4,
        "gemma3_text" => {
            layout.norms_per_layer = 4;
            layout.qk_norm = true;
        }
        "gpt_oss" => {
            layout.qkv_bias = true;
            layout.out_bias = true;
            layout.mlp_bias = true;
            layout.attention_sinks = true;
        }
        _ => {}
    }
    if let Some(b) = r.bool("attention_bias")? {
        // Llama's attention_bias puts a bias on q, k, v and o.
        layout.qkv_bias = b;
        if model_type != "gpt_oss" {
            layout.out_bias = b;
        }
    }
    if let Some(b) = r.bool("mlp_bias")? {
        layout.mlp_bias = b;
    }

    let ff = match r.one_of(&["intermediate_size", "ffn_hidden_size", "n_inner"])? {
        Some(v) => v,
        None if is_falcon || is_gpt2 => 4 * hidden,
        None => 0,
    };

    let tie_default = matches!(
        model_type.as_str(),
        "gemma" | "gemma2" | "gemma3_text" | "gpt2" | "falcon"
    );
    let tie_embeddings = match r.bool("tie_word_embeddings")? {
        Some(b) => b,
        None => {
            if !KNOWN_TYPES.contains(&model_type.as_str()) {
                warnings.push(format!(
                    "tie_word_embeddings absent; assumed {}",
                    if tie_default { "tied" } else { "untied" }
                ));
            }
            tie_default
        }
    };

    // Multi-head latent attention.
    let attention = match r.u64("kv_lora_rank")? {
        None => {
            for k in ["qk_rope_head_dim", "qk_nope_head_dim", "q_lora_rank"] {
                if r.u64(k)?.is_some() {
                    warnings.push(format!("`{k}` given without kv_lora_rank: ignored"));
                }
            }
            Attention::Standard
        }
        Some(rank) => {
            let need = |k: &str| -> Result<u64> {
                r.u64(k)?.ok_or_else(|| EstimateError::MissingField {
                    origin: path.to_string(),
                    field: k.to_string(),
                    why: "required with kv_lora_rank (multi-head latent attention)".into(),
                })
            };
            Attention::Mla(Mla {
                kv_lora_rank: rank,
                q_lora_rank: r.u64("q_lora_rank")?,
                qk_nope_head_dim: need("qk_nope_head_dim")?,
                qk_rope_head_dim: need("qk_rope_head_dim")?,
                v_head_dim: need("v_head_dim")?,
            })
        }
    };
    let head_dim = match &attention {
        Attention::Mla(m) => m.qk_nope_head_dim.max(1),
        Attention::Standard => head_dim,
    };

    // Experts.
    let experts = r.one_of(&["num_local_experts", "num_experts", "n_routed_experts"])?;
    let per_tok = r.one_of(&["num_experts_per_tok", "experts_per_token"])?;
    let moe = match experts {
        None | Some(0) => {
            if per_tok.is_some_and(|k| k > 0) && experts.is_none() {
                return Err(EstimateError::Contradiction {
                    origin: path.to_string(),
                    reason: "num_experts_per_tok is given but no expert count".into(),
                });
            }
            None
        }
        Some(e) => {
            let k = per_tok.ok_or_else(|| EstimateError::MissingField {
                origin: path.to_string(),
                field: "num_experts_per_tok".into(),
                why: "required with an expert count".into(),
            })?;
            let expert_ff = match r.u64("moe_intermediate_size")? {
                Some(v) => v,
                // Mixtral and gpt-oss size their experts with intermediate_size.
                None if ff > 0 => ff,
                None => {
                    return Err(EstimateError::MissingField {
                        origin: path.to_string(),
                        field: "moe_intermediate_size".into(),
                        why: "the width of each expert".into(),
                    });
                }
            };
            let shared_n = r.u64("n_shared_experts")?.unwrap_or(0);
            let shared_ff = match r.u64("shared_expert_intermediate_size")? {
                Some(v) if shared_n > 0 && v != shared_n * expert_ff => {
                    return Err(EstimateError::Contradiction {
                        origin: path.to_string(),
                        reason: format!(
                            "{shared_n} shared experts of width {expert_ff} but shared_expert_intermediate_size is {v}"
                        ),
                    });
                }
                Some(v) => v,
                None => shared_n * expert_ff,
            };
            let shared_experts = if shared_n > 0 {
                shared_n
            } else {
                u64::from(shared_ff > 0)
            };
            let first = r.u64("first_k_dense_replace")?.unwrap_or(0);
            let freq = match (r.u64("moe_layer_freq")?, r.u64("decoder_sparse_step")?) {
                (Some(0), _) | (_, Some(0)) => {
                    return Err(r.bad("moe_layer_freq", "must be at least 1"));
                }
                (Some(f), _) => f,
                (None, Some(s)) => s,
                (None, None) => 1,
            };
            let dense_list = r.u64_list("mlp_only_layers")?;
            // Qwen's decoder_sparse_step counts from layer 1: layer i has experts when
            // (i + 1) % step == 0; DeepSeek's moe_layer_freq counts from 0.
            let moe_layers = if r.u64("decoder_sparse_step")?.is_some() {
                (0..n_layers)
                    .filter(|i| (i + 1) % freq == 0 && !dense_list.contains(i))
                    .count() as u64
            } else {
                moe_layer_count(n_layers, first, freq, &dense_list)
            };
            Some(Moe {
                experts: e,
                experts_per_token: k,
                expert_ff,
                shared_experts,
                shared_ff,
                moe_layers,
            })
        }
    };
    if let Some(n) = r.u64("num_nextn_predict_layers")?
        && n > 0
    {
        notes.push(format!(
            "{n} multi-token-prediction layer(s) in the checkpoint are not counted"
        ));
    }

    // Sliding windows.
    let sliding_window = sliding_window(&r, &model_type, n_layers, &mut notes, &mut warnings)?;

    let name = r
        .str("_name_or_path")?
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| file_stem(path));
    let desc = ModelDesc {
        id: file_stem(path),
        name,
        origin: Origin::HfConfig,
        source: path.to_string(),
        hf_repo: None,
        family: if model_type.is_empty() {
            "unknown".into()
        } else {
            model_type.clone()
        },
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
        file_params: None,
        notes,
        warnings,
    };
    desc.validate()?;
    Ok(desc)
}

fn sliding_window(
    r: &Reader,
    model_type: &str,
    n_layers: u64,
    notes: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Result<Option<SlidingWindow>> {
    let window = r.u64("sliding_window")?;
    let use_sw = r.bool("use_sliding_window")?;
    let layer_types = match r.obj.get("layer_types") {
        Some(Value::Array(a)) => {
            let mut sliding = 0u64;
            for t in a {
                match t.as_str() {
                    Some("sliding_attention") => sliding += 1,
                    Some("full_attention") => {}
                    _ => return Err(r.bad("layer_types", format!("unknown layer type {t}"))),
                }
            }
            if a.len() as u64 != n_layers {
                return Err(EstimateError::Contradiction {
                    origin: r.origin.clone(),
                    reason: format!(
                        "layer_types lists {} layers but num_hidden_layers is {n_layers}",
                        a.len()
                    ),
                });
            }
            Some(sliding)
        }
        None | Some(Value::Null) => None,
        Some(v) => return Err(r.bad("layer_types", format!("expected a list, found {v}"))),
    };
    let Some(w) = window else {
        if layer_types.is_some_and(|s| s > 0) {
            return Err(EstimateError::MissingField {
                origin: r.origin.clone(),
                field: "sliding_window".into(),
                why: "layer_types has sliding layers but no window size".into(),
            });
        }
        return Ok(None);
    };
    if use_sw == Some(false) {
        notes.push(format!(
            "sliding_window {w} is set but use_sliding_window is false: every layer attends to the full context"
        ));
        return Ok(None);
    }
    let (layers, pattern) = if let Some(s) = layer_types {
        (s, format!("{s} of {n_layers} layers (layer_types)"))
    } else {
        match model_type {
            "gemma2" => (
                n_layers.div_ceil(2),
                "every other layer (even indices)".to_string(),
            ),
            "gpt_oss" => (
                n_layers.div_ceil(2),
                "every other layer (even indices)".to_string(),
            ),
            "gemma3_text" => {
                let p = r.u64("sliding_window_pattern")?.unwrap_or(6).max(1);
                (
                    n_layers - n_layers / p,
                    format!("all but every {p}th layer"),
                )
            }
            "qwen2" | "qwen2_moe" | "qwen3" | "qwen3_moe" => {
                let first = r.u64("max_window_layers")?.unwrap_or(0).min(n_layers);
                (
                    n_layers - first,
                    format!("layers {first} and above (max_window_layers)"),
                )
            }
            "mistral" | "mixtral" | "phi3" => (n_layers, format!("all {n_layers} layers")),
            _ => {
                warnings.push(format!(
                    "sliding_window {w} with no layer_types: assumed to apply to all {n_layers} layers"
                ));
                (n_layers, format!("all {n_layers} layers (assumed)"))
            }
        }
    };
    if layers == 0 {
        return Ok(None);
    }
    Ok(Some(SlidingWindow {
        window: w,
        layers,
        pattern,
        cached: w,
    }))
}

fn file_stem(path: &str) -> String {
    let p = std::path::Path::new(path);
    // config.json says nothing by its name: use the folder it sits in.
    let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or(path);
    if stem == "config"
        && let Some(dir) = p
            .parent()
            .and_then(|d| d.file_name())
            .and_then(|s| s.to_str())
    {
        return dir.to_string();
    }
    stem.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::memory::ParamCount;
    use crate::estimate::{Format, KvShape};

    const LLAMA2_7B: &str = r#"{
      "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
      "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
      "tie_word_embeddings": false, "torch_dtype": "float16", "transformers_version": "4.31.0.dev0",
      "use_cache": true, "vocab_size": 32000 }"#;

    const DEEPSEEK_V3: &str = r#"{
      "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
      "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432,
      "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
      "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
      "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
      "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
      "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
      "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
      "scoring_func": "sigmoid", "tie_word_embeddings": false, "topk_group": 4,
      "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280 }"#;

    #[test]
    fn estimate_config_json_llama_matches_catalog() {
        let d = from_config_json(LLAMA2_7B, "Llama-2-7b-hf/config.json").unwrap();
        assert_eq!(d.id, "Llama-2-7b-hf");
        assert!(d.warnings.is_empty(), "{:?}", d.warnings);
        let s = KvShape::of_model(&d);
        assert_eq!(s.bytes_per_sequence(&d, 4096, Format::F16), 2 << 30);
        let cat = crate::estimate::Catalog::builtin()
            .unwrap()
            .describe("llama-2-7b")
            .unwrap();
        assert_eq!(ParamCount::of(&d).unwrap(), ParamCount::of(&cat).unwrap());
    }

    #[test]
    fn estimate_config_json_deepseek_v3_mla_and_experts() {
        let d = from_config_json(DEEPSEEK_V3, "config.json").unwrap();
        assert_eq!(KvShape::of_model(&d).elements_per_layer, 576);
        let m = d.moe.as_ref().unwrap();
        assert_eq!((m.experts, m.experts_per_token, m.moe_layers), (256, 8, 58));
        let p = ParamCount::of(&d).unwrap();
        assert!((p.total as f64 / 671e9 - 1.0).abs() < 0.02);
        assert!((p.active as f64 / 37e9 - 1.0).abs() < 0.02);
        assert!(d.notes.iter().any(|n| n.contains("multi-token-prediction")));
    }

    #[test]
    fn estimate_config_json_mixtral_and_qwen_moe_keys() {
        let mixtral = r#"{"model_type":"mixtral","hidden_size":4096,"intermediate_size":14336,
          "num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":8,
          "num_local_experts":8,"num_experts_per_tok":2,"vocab_size":32000,
          "max_position_embeddings":32768,"sliding_window":null,"tie_word_embeddings":false}"#;
        let d = from_config_json(mixtral, "m.json").unwrap();
        let p = ParamCount::of(&d).unwrap();
        assert!((p.total as f64 / 46.7e9 - 1.0).abs() < 0.02);
        assert!(d.sliding_window.is_none());
        let qwen = r#"{"model_type":"qwen2_moe","hidden_size":2048,"intermediate_size":5632,
          "num_attention_heads":16,"num_hidden_layers":24,"num_key_value_heads":16,
          "num_experts":60,"num_experts_per_tok":4,"moe_intermediate_size":1408,
          "shared_expert_intermediate_size":5632,"decoder_sparse_step":1,"mlp_only_layers":[],
          "vocab_size":151936,"max_position_embeddings":8192,"sliding_window":32768,
          "use_sliding_window":false,"max_window_layers":21,"tie_word_embeddings":false}"#;
        let d = from_config_json(qwen, "q.json").unwrap();
        let m = d.moe.as_ref().unwrap();
        assert_eq!((m.shared_ff, m.moe_layers, m.shared_experts), (5632, 24, 1));
        assert!(d.sliding_window.is_none(), "use_sliding_window false");
        assert!(d.layout.qkv_bias);
    }

    #[test]
    fn estimate_config_json_sliding_window_patterns() {
        let base = |extra: &str| {
            format!(
                r#"{{"hidden_size":1024,"intermediate_size":4096,"num_attention_heads":8,
                "num_hidden_layers":4,"num_key_value_heads":2,"vocab_size":1000,
                "max_position_embeddings":8192{extra}}}"#
            )
        };
        let d = from_config_json(
            &base(r#","model_type":"mistral","sliding_window":4096"#),
            "a.json",
        )
        .unwrap();
        assert_eq!(d.sliding_window.unwrap().layers, 4);
        let d = from_config_json(
            &base(r#","model_type":"gemma2","sliding_window":4096"#),
            "a.json",
        )
        .unwrap();
        assert_eq!(d.sliding_window.unwrap().layers, 2);
        let d = from_config_json(
            &base(
                r#","model_type":"gpt_oss","sliding_window":128,"num_local_experts":4,"num_experts_per_tok":2,
                "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"]"#,
            ),
            "a.json",
        )
        .unwrap();
        assert_eq!(d.sliding_window.as_ref().unwrap().layers, 2);
        assert!(d.layout.attention_sinks);
        // An unknown model type with a window: applied to all layers, and said so.
        let d = from_config_json(
            &base(r#","model_type":"newthing","sliding_window":512"#),
            "a.json",
        )
        .unwrap();
        assert!(d.warnings.iter().any(|w| w.contains("assumed to apply")));
        assert!(d.warnings.iter().any(|w| w.contains("newthing")));
    }

    #[test]
    fn estimate_config_json_reports_unknown_and_contradictory_fields() {
        let d = from_config_json(
            &LLAMA2_7B.replace("\"use_cache\"", "\"frobnicate\""),
            "c.json",
        )
        .unwrap();
        assert!(
            d.warnings.iter().any(|w| w.contains("`frobnicate`")),
            "{:?}",
            d.warnings
        );
        let contra = LLAMA2_7B.replace("\"use_cache\": true", "\"n_layer\": 40");
        assert!(matches!(
            from_config_json(&contra, "c.json"),
            Err(EstimateError::Contradiction { .. })
        ));
        let mla_partial = LLAMA2_7B.replace("\"use_cache\": true", "\"kv_lora_rank\": 512");
        assert!(matches!(
            from_config_json(&mla_partial, "c.json"),
            Err(EstimateError::MissingField { .. })
        ));
    }

    #[test]
    fn estimate_config_json_bad_input_is_a_typed_error() {
        let cases: [(&str, &str); 11] = [
            (
                &LLAMA2_7B.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": 1e15"),
                "implausibly large",
            ),
            (
                &LLAMA2_7B.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": 100000"),
                "more than",
            ),
            (
                &LLAMA2_7B.replace(
                    "\"hidden_size\": 4096",
                    "\"head_dim\": 4294967297, \"hidden_size\": 4096",
                ),
                "implausibly large",
            ),
            ("{not json", "not a valid config.json"),
            ("[1,2]", "not a JSON object"),
            (
                r#"{"hidden_size":4096}"#,
                "missing field `num_hidden_layers`",
            ),
            (
                &LLAMA2_7B.replace("\"num_attention_heads\": 32", "\"num_attention_heads\": 0"),
                "at least 1",
            ),
            (
                &LLAMA2_7B.replace("\"num_key_value_heads\": 32", "\"num_key_value_heads\": 5"),
                "do not divide",
            ),
            (
                &LLAMA2_7B.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": \"32\""),
                "non-negative integer",
            ),
            (
                &LLAMA2_7B.replace("\"num_hidden_layers\": 32", "\"num_hidden_layers\": -1"),
                "non-negative integer",
            ),
            (
                &LLAMA2_7B.replace("\"hidden_size\": 4096", "\"hidden_size\": 4097"),
                "not divisible",
            ),
        ];
        for (text, want) in cases {
            let e = from_config_json(text, "c.json").unwrap_err().to_string();
            assert!(e.contains(want), "{e:?} lacks {want:?}");
        }
    }
}
