//! A model description from a Hugging Face `config.json`.
//!
//! Covers the Llama family (Llama, Mistral, Qwen2/3, Phi-3, Gemma, SmolLM, TinyLlama), the
//! expert keys of Mixtral, Qwen-MoE, DeepSeek and gpt-oss, DeepSeek's MLA keys, sliding-window
//! keys (`sliding_window`, `use_sliding_window`, `max_window_layers`, `layer_types`), and the
//! GPT-2 and Falcon key spellings. Every key is either used, known to be irrelevant to memory,
//! or reported as unrecognised; where two keys say the same thing and disagree, that is an
//! error rather than a pick.

mod keys;
#[cfg(test)]
mod tests;
mod window;

use serde_json::Value;

use super::catalog::moe_layer_count;
use super::desc::{Attention, Ffn, Layout, Mla, ModelDesc, Moe, Norm, Origin};
use super::{EstimateError, Result};
use keys::{IRRELEVANT, KNOWN_TYPES, MAX_LAYERS, Reader, USED};
use window::sliding_window;

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

    let layout = layout(&r, &model_type, new_arch)?;

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

    let attention = latent_attention(&r, path, &mut warnings)?;
    let head_dim = match &attention {
        Attention::Mla(m) => m.qk_nope_head_dim.max(1),
        Attention::Standard => head_dim,
    };

    let moe = experts(&r, path, ff, n_layers)?;
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

/// The block's layout (FFN kind, norms, biases) from the model type and the keys that refine it.
fn layout(r: &Reader, model_type: &str, new_arch: bool) -> Result<Layout> {
    let mut layout = Layout::default();
    match model_type {
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
    Ok(layout)
}

/// Standard attention, or multi-head latent attention when `kv_lora_rank` is given (with the
/// keys it requires).
fn latent_attention(r: &Reader, path: &str, warnings: &mut Vec<String>) -> Result<Attention> {
    Ok(match r.u64("kv_lora_rank")? {
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
    })
}

/// The routed experts, when the config has any: their count, width, shared experts and which
/// layers carry them (`ff` is the dense FFN width, which Mixtral and gpt-oss experts reuse).
fn experts(r: &Reader, path: &str, ff: u64, n_layers: u64) -> Result<Option<Moe>> {
    let experts = r.one_of(&["num_local_experts", "num_experts", "n_routed_experts"])?;
    let per_tok = r.one_of(&["num_experts_per_tok", "experts_per_token"])?;
    Ok(match experts {
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
    })
}

/// The model's name when the config gives none: the file's stem, or for `config.json` the
/// folder it sits in.
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
