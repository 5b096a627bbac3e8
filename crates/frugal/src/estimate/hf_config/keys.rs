//! The keys a `config.json` may hold (used, or known to be irrelevant to memory), and typed,
//! bounded reads of them.

use serde_json::{Map, Value};

use super::{EstimateError, Result};

/// Keys read by this parser (in any of the model types).
pub(super) const USED: &[&str] = &[
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
pub(super) const IRRELEVANT: &[&str] = &[
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
pub(super) const MAX_FIELD: u64 = 1 << 32;
/// Most layers accepted (checked before anything loops over them).
pub(super) const MAX_LAYERS: u64 = 1 << 14;

/// Typed, bounded reads of a config's keys, naming the key in every error.
pub(super) struct Reader<'a> {
    pub obj: &'a Map<String, Value>,
    pub origin: String,
}

impl Reader<'_> {
    pub(super) fn bad(&self, field: &str, reason: impl Into<String>) -> EstimateError {
        EstimateError::BadField {
            origin: self.origin.clone(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }

    /// A non-negative integer field; `null` counts as absent.
    pub(super) fn u64(&self, key: &str) -> Result<Option<u64>> {
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

    pub(super) fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.bad(key, format!("expected true or false, found {v}"))),
        }
    }

    pub(super) fn str(&self, key: &str) -> Result<Option<&str>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.bad(key, format!("expected a string, found {v}"))),
        }
    }

    /// The first of several spellings of one quantity; spellings that disagree are an error.
    pub(super) fn one_of(&self, keys: &[&str]) -> Result<Option<u64>> {
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

    pub(super) fn require(&self, keys: &[&str], why: &str) -> Result<u64> {
        self.one_of(keys)?
            .ok_or_else(|| EstimateError::MissingField {
                origin: self.origin.clone(),
                field: keys[0].to_string(),
                why: why.to_string(),
            })
    }

    pub(super) fn u64_list(&self, key: &str) -> Result<Vec<u64>> {
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
pub(super) const KNOWN_TYPES: &[&str] = &[
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
