//! Sliding-window attention from the keys that declare it (`sliding_window`,
//! `use_sliding_window`, `max_window_layers`, `layer_types`).

use serde_json::Value;

use super::Reader;
use crate::estimate::desc::SlidingWindow;
use crate::estimate::{EstimateError, Result};

/// The sliding window of the config, if any: its width, which layers use it, and the notes and
/// warnings the keys call for.
pub(super) fn sliding_window(
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
