//! One estimate: every number for one model, context, batch and set of options, computed once
//! so that the text and JSON outputs cannot disagree.

use serde::Serialize;

use super::desc::ModelDesc;
use super::kv::{AttentionVariant, KvShape, crossover_context};
use super::memory::{ParamCount, rel_diff, weight_bytes};
use super::serving::{Device, ServingTable, contexts, table};
use super::{EstimateError, Format, Result, to_u64};

/// What to estimate.
#[derive(Clone, Debug)]
pub struct Options {
    /// Tokens per sequence; `None` means the model's maximum context.
    pub context: Option<u64>,
    pub batch: u64,
    pub kv_type: Format,
    /// Weight format for the side-by-side figures; `None` means bf16, or the stored bytes of a
    /// GGUF file.
    pub weights: Option<Format>,
    pub compare: Vec<AttentionVariant>,
    pub devices: Vec<Device>,
    pub devices_per_replica: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            context: None,
            batch: 1,
            kv_type: Format::F16,
            weights: None,
            compare: Vec::new(),
            devices: Vec::new(),
            devices_per_replica: 1,
        }
    }
}

/// Weights in one format.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WeightsRow {
    pub format: Format,
    pub bits_per_weight: f64,
    pub bytes: u64,
}

/// A published parameter count and how far the computed one is from it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PublishedCheck {
    pub published: f64,
    pub computed: u64,
    /// computed / published - 1.
    pub rel_diff: f64,
}

/// The model with its attention converted.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CompareRow {
    pub variant: String,
    pub label: String,
    pub kv_elements_per_token_per_layer: u64,
    pub kv_bytes_per_token: u64,
    /// At the estimate's context and batch.
    pub kv_cache_bytes: u64,
    /// Relative to the model's own attention.
    pub ratio: f64,
    /// Attention parameters per layer change with the conversion; this is the model's own
    /// shape's cache formula with the variant's numbers.
    pub formula: String,
}

/// Everything `frugal estimate` reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    pub model: ModelDesc,
    pub attention: String,
    pub context: u64,
    pub batch: u64,
    pub kv_type: Format,
    pub kv_bits_per_element: f64,
    pub kv_elements_per_token_per_layer: u64,
    pub kv_elements_per_token: u64,
    /// Bytes one token adds to the cache, all layers (below any sliding window).
    pub kv_bytes_per_token: u64,
    /// `2 (K and V) x 32 layers x 8 KV heads x 128 head_dim x 2 B (f16)`.
    pub kv_formula: String,
    /// One sequence of `context` tokens, windows applied.
    pub kv_cache_bytes_per_sequence: u64,
    /// `batch` sequences of `context` tokens.
    pub kv_cache_bytes: u64,
    /// Layers holding every position, layers windowed, positions a windowed layer holds.
    pub kv_full_layers: u64,
    pub kv_window_layers: u64,
    pub kv_window_positions: u64,
    pub params: ParamCount,
    pub params_total: u64,
    pub params_active: u64,
    pub params_total_published: Option<PublishedCheck>,
    pub params_active_published: Option<PublishedCheck>,
    /// Every weight format, every tensor in that format.
    pub weights_by_format: Vec<WeightsRow>,
    /// The format used for the comparisons below (`"stored"` for a GGUF file's own bytes).
    pub weights_format: String,
    pub weights_bytes: u64,
    /// kv_cache_bytes / weights_bytes.
    pub kv_to_weights_ratio: f64,
    /// First context at which one sequence's cache is larger than the weights (`None`: never).
    pub crossover_context_one_sequence: Option<u64>,
    /// The same for `batch` sequences.
    pub crossover_context_batch: Option<u64>,
    pub compare: Vec<CompareRow>,
    pub compare_note: Option<String>,
    pub serving: ServingTable,
    /// Remarks on this particular estimate (a context past the model's maximum, ...).
    pub remarks: Vec<String>,
}

/// Computes the estimate.
pub fn estimate(desc: &ModelDesc, o: &Options) -> Result<Estimate> {
    let context = match o.context {
        Some(c) => c,
        None => desc.max_context.ok_or_else(|| EstimateError::NoContext {
            origin: desc.origin_text(),
        })?,
    };
    if o.batch == 0 || o.batch > 1 << 24 {
        return Err(EstimateError::Invalid {
            origin: "options".into(),
            reason: format!("batch {} must be from 1 to 2^24", o.batch),
        });
    }
    if o.devices_per_replica == 0 || o.devices_per_replica > 1 << 16 {
        return Err(EstimateError::Invalid {
            origin: "options".into(),
            reason: "devices per replica must be at least 1".into(),
        });
    }
    let shape = KvShape::of_model(desc);
    let f = o.kv_type;
    let per_seq = shape.bytes_per_sequence(desc, context, f);
    let kv_cache = per_seq * o.batch as u128;
    let (full, windowed, held) = super::kv::split_layers(desc, context);

    let params = ParamCount::of(desc)?;
    let check = |published: Option<f64>, computed: u64| {
        published
            .filter(|p| *p > 0.0)
            .map(|published| PublishedCheck {
                published,
                computed,
                rel_diff: rel_diff(computed as f64, published),
            })
    };
    let weights_by_format = Format::WEIGHTS
        .iter()
        .map(|&wf| {
            Ok(WeightsRow {
                format: wf,
                bits_per_weight: wf.bits(),
                bytes: to_u64(weight_bytes(params.total, wf), "weight bytes")?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let (weights_format, weights_bytes) = match (o.weights, &desc.file_params) {
        (Some(wf), _) => (wf.name().to_string(), weight_bytes(params.total, wf)),
        (None, Some(fp)) => ("stored".to_string(), fp.bytes as u128),
        (None, None) => ("bf16".to_string(), weight_bytes(params.total, Format::Bf16)),
    };
    let weights_bytes = to_u64(weights_bytes, "weight bytes")?;

    let compare = o
        .compare
        .iter()
        .map(|v| {
            let s = KvShape::of_variant(desc, v);
            let bytes = s.bytes_per_sequence(desc, context, f) * o.batch as u128;
            Ok(CompareRow {
                variant: v.name(),
                label: s.label.clone(),
                kv_elements_per_token_per_layer: s.elements_per_layer,
                kv_bytes_per_token: to_u64(s.bytes_per_token(desc, f), "KV bytes per token")?,
                kv_cache_bytes: to_u64(bytes, "KV cache")?,
                ratio: s.elements_per_layer as f64 / shape.elements_per_layer as f64,
                formula: s.formula(desc, f),
            })
        })
        .collect::<Result<Vec<_>>>()?;

    let mut remarks = Vec::new();
    if let Some(m) = desc.max_context
        && context > m
    {
        remarks.push(format!(
            "the context of {} tokens is longer than the model's maximum of {}: \
             the figures are what the cache would take, not something the model supports",
            super::grouped(context as u128),
            super::grouped(m as u128)
        ));
    }
    let max = desc.max_context.unwrap_or(context).max(context);
    let serving = table(
        desc,
        &shape,
        f,
        weights_bytes,
        params.active,
        &o.devices,
        o.devices_per_replica,
        &contexts(max, Some(context)),
    )?;

    Ok(Estimate {
        attention: desc.attention_label(),
        context,
        batch: o.batch,
        kv_type: f,
        kv_bits_per_element: f.bits(),
        kv_elements_per_token_per_layer: shape.elements_per_layer,
        kv_elements_per_token: shape.elements_per_token(desc),
        kv_bytes_per_token: to_u64(shape.bytes_per_token(desc, f), "KV bytes per token")?,
        kv_formula: shape.formula(desc, f),
        kv_cache_bytes_per_sequence: to_u64(per_seq, "KV cache per sequence")?,
        kv_cache_bytes: to_u64(kv_cache, "KV cache")?,
        kv_full_layers: full,
        kv_window_layers: windowed,
        kv_window_positions: held,
        params_total: params.total,
        params_active: params.active,
        params_total_published: check(desc.params_total_published, params.total),
        params_active_published: check(desc.params_active_published, params.active),
        weights_by_format,
        weights_format,
        weights_bytes,
        kv_to_weights_ratio: kv_cache as f64 / weights_bytes.max(1) as f64,
        crossover_context_one_sequence: crossover_context(
            &shape,
            desc,
            f,
            1,
            weights_bytes as u128,
        ),
        crossover_context_batch: crossover_context(&shape, desc, f, o.batch, weights_bytes as u128),
        compare_note: (!compare.is_empty()).then(|| {
            "Cache sizes only: the quality cost of converting the attention (and the retraining it \
             needs) is not estimated here."
                .to_string()
        }),
        compare,
        params,
        serving,
        remarks,
        model: desc.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::Catalog;

    fn desc(id: &str) -> ModelDesc {
        Catalog::builtin().unwrap().describe(id).unwrap()
    }

    #[test]
    fn estimate_report_defaults_and_batch() {
        let d = desc("llama-2-7b");
        let e = estimate(&d, &Options::default()).unwrap();
        assert_eq!((e.context, e.batch, e.kv_type), (4096, 1, Format::F16));
        assert_eq!(e.kv_cache_bytes, 2 << 30);
        let e8 = estimate(
            &d,
            &Options {
                batch: 8,
                ..Options::default()
            },
        )
        .unwrap();
        assert_eq!(e8.kv_cache_bytes, 16 << 30);
        assert_eq!(e8.weights_format, "bf16");
        assert_eq!(e8.weights_bytes, e8.params_total * 2);
        let json = serde_json::to_value(&e8).unwrap();
        for k in [
            "kv_bytes_per_token",
            "kv_cache_bytes",
            "weights_bytes",
            "params_total",
            "params_active",
            "context",
            "batch",
            "kv_type",
        ] {
            assert!(json.get(k).is_some(), "{k}");
        }
        assert_eq!(json["kv_type"], "f16");
    }

    #[test]
    fn estimate_report_compare_ratios() {
        let d = desc("llama-2-7b");
        let o = Options {
            compare: ["mha", "gqa:8", "mqa", "mla:512"]
                .iter()
                .map(|s| AttentionVariant::parse(s, &d).unwrap())
                .collect(),
            ..Options::default()
        };
        let e = estimate(&d, &o).unwrap();
        let r: Vec<f64> = e.compare.iter().map(|c| c.ratio).collect();
        assert_eq!(r, [1.0, 0.25, 1.0 / 32.0, 576.0 / 8192.0]);
        assert!(e.compare_note.unwrap().contains("quality"));
    }

    #[test]
    fn estimate_report_deepseek_v3_32k_f16() {
        let d = desc("deepseek-v3");
        let e = estimate(
            &d,
            &Options {
                context: Some(32 * 1024),
                ..Options::default()
            },
        )
        .unwrap();
        // 576 elements x 61 layers x 2 B = 70,272 B per token.
        assert_eq!(e.kv_bytes_per_token, 576 * 61 * 2);
        assert_eq!(e.kv_cache_bytes, 576 * 61 * 2 * 32768);
        assert!(e.params_active < e.params_total / 10);
    }

    #[test]
    fn estimate_report_remarks_on_a_context_past_the_maximum() {
        let d = desc("llama-3-8b");
        let o = Options {
            context: Some(32768),
            ..Options::default()
        };
        let e = estimate(&d, &o).unwrap();
        assert_eq!(e.remarks.len(), 1);
        assert!(e.remarks[0].contains("32,768"), "{}", e.remarks[0]);
        assert_eq!(e.serving.rows.last().unwrap().context, 32768);
        assert!(
            estimate(&d, &Options::default())
                .unwrap()
                .remarks
                .is_empty()
        );
    }

    fn any_size() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![
            4 => 1u64..8,
            2 => Just(64),
            2 => Just(4096),
            1 => Just(0),
            1 => 1u64..100_000,
            1 => Just(1 << 32),
            1 => any::<u64>(),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(2000))]

        /// Whatever numbers a config.json holds, describing and estimating it returns a value
        /// or an error, never a panic or an overflow.
        #[test]
        fn estimate_any_config_json_never_panics(
            layers in any_size(), kv in any_size(), group in any_size(), hd in any_size(),
            ff in any_size(), vocab in any_size(), ctx in any_size(), experts in any_size(),
            k in any_size(), rank in any_size(), window in any_size(), batch in any_size(),
            use_moe: bool, use_mla: bool, use_window: bool,
        ) {
            // Mostly consistent shapes (heads a multiple of KV heads, hidden = heads x head_dim),
            // with every size drawn from small, typical, boundary and arbitrary values.
            let heads = kv.saturating_mul(group);
            let hidden = heads.saturating_mul(hd);
            let mut j = serde_json::json!({
                "model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
                "num_attention_heads": heads, "num_key_value_heads": kv,
                "intermediate_size": ff, "vocab_size": vocab, "max_position_embeddings": ctx,
            });
            if use_moe {
                j["num_local_experts"] = experts.into();
                j["num_experts_per_tok"] = k.into();
            }
            if use_mla {
                j["kv_lora_rank"] = rank.into();
                j["qk_rope_head_dim"] = 64.into();
                j["qk_nope_head_dim"] = 128.into();
                j["v_head_dim"] = 128.into();
            }
            if use_window {
                j["sliding_window"] = window.into();
            }
            if let Ok(d) = crate::estimate::desc::resolve_json_for_tests(&j.to_string()) {
                let variants: Vec<AttentionVariant> = ["mha", "mqa", "gqa:1", "mla:512"]
                    .iter()
                    .filter_map(|v| AttentionVariant::parse(v, &d).ok())
                    .collect();
                let o = Options {
                    context: Some(ctx.clamp(1, 1 << 30)),
                    batch,
                    compare: variants,
                    devices: vec![crate::estimate::Device::custom(80 << 30, "d")],
                    ..Options::default()
                };
                let _ = estimate(&d, &o);
            }
        }
    }

    #[test]
    fn estimate_report_needs_a_context() {
        let mut d = desc("llama-2-7b");
        d.max_context = None;
        assert!(matches!(
            estimate(&d, &Options::default()),
            Err(EstimateError::NoContext { .. })
        ));
        let o = Options {
            batch: 0,
            context: Some(10),
            ..Options::default()
        };
        assert!(estimate(&d, &o).is_err());
    }
}
