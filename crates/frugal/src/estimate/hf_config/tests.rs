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
