//! The pruning stage of the ladder: fewer weights, taken only where this CPU rewards the
//! pattern.
//!
//! Two kinds of cut, both as `frugal prune` makes them:
//! - **structured**: whole FFN neurons or layers removed (the tensors shrink, so do the bytes a
//!   decode step reads);
//! - **sparse**: N:M or unstructured zeros scored by Wanda. Stored densely a zero is still read
//!   and multiplied; only a compressed 2:4 type (`q8_0_24`, `q4_0_24`) skips it.
//!
//! Whether a cut pays is measured, not assumed: the search times each one against its dense
//! twin in the same format ([`Gate`]) and builds candidates only from those faster by at least
//! [`REWARD`]. A cut is tried in both orders, before quantization (scored on the float model's
//! activations, then quantized) and after it (scored on the quantized model's, re-encoded in
//! its own format), because the two orders round differently and the literature disagrees on
//! which is better.

use std::fmt;

use anyhow::{Context, Result, ensure};
use frugal::gguf::GgufFile;
use frugal::model::Config;
use frugal::quant::GgmlType;
use frugal::surgery::prune::structured::StructuredTarget;
use frugal::surgery::prune::{self, Method, Pattern};
use serde::{Deserialize, Serialize};

use super::quant::type_name;
use super::recipe::Stage;

/// The decode speed-up over the dense twin a cut must show to be taken: above the spread of
/// three back-to-back rounds on a shared machine (2-3%), and enough to be worth its KL.
pub const REWARD: f64 = 1.04;

/// The calibration text a recipe's stages read: cuts score weights on the activations of its
/// first `cut_tokens` tokens (in windows of `ctx`); distillation trains on all of `tokens`.
#[derive(Clone, Debug, Default)]
pub struct Calibration {
    pub tokens: Vec<u32>,
    pub ctx: usize,
    pub cut_tokens: usize,
}

impl Calibration {
    /// The tokens the cuts read: whole windows of the first `cut_tokens`.
    pub fn for_cuts(&self) -> &[u32] {
        let n = self.cut_tokens.min(self.tokens.len());
        &self.tokens[..n / self.ctx.max(1) * self.ctx.max(1)]
    }
}

/// One cut.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Prune {
    /// `frugal prune --structured SPEC`: `ffn:FRACTION`, `layers:N`, `heads:N`.
    Structured { remove: String },
    /// `frugal prune --method METHOD --pattern PATTERN --format STORE`: zeros in every block
    /// matrix, stored in `store` (f32 when a quantization stage follows).
    Sparse {
        method: String,
        pattern: String,
        store: String,
    },
}

impl fmt::Display for Prune {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Prune::Structured { remove } => write!(f, "prune {remove}"),
            Prune::Sparse {
                method,
                pattern,
                store,
            } if store == "f32" => write!(f, "prune {method} {pattern}"),
            Prune::Sparse {
                method,
                pattern,
                store,
            } => write!(f, "prune {method} {pattern} as {store}"),
        }
    }
}

impl Prune {
    /// `file` with this cut, scored on `cal`'s activations through `file` itself.
    pub fn apply(&self, file: &GgufFile, cal: &Calibration) -> Result<GgufFile> {
        let tokens = cal.for_cuts();
        ensure!(
            cal.ctx > 0 && tokens.len() >= cal.ctx,
            "{self}: needs calibration text (at least one window of {} tokens)",
            cal.ctx
        );
        let sparse_method = match self {
            Prune::Structured { .. } => None,
            Prune::Sparse { method, .. } => {
                Some(method.parse::<Method>().map_err(anyhow::Error::msg)?)
            }
        };
        // The activations the scores read (with Gram matrices for SparseGPT); magnitude
        // pruning reads none, so the model is not even loaded.
        let stats = if sparse_method.is_none_or(Method::needs_calibration) {
            let model =
                crate::build::load_file(GgufFile::from_bytes(file.raw_bytes().to_vec())?, false)?;
            let gram = sparse_method == Some(Method::SparseGpt);
            Some(prune::collect(&model, tokens, cal.ctx, gram)?)
        } else {
            None
        };
        let bytes = match self {
            Prune::Structured { remove } => {
                let target: StructuredTarget = remove
                    .parse()
                    .map_err(anyhow::Error::msg)
                    .context("prune")?;
                let stats = stats.as_ref().expect("structured cuts read activations");
                prune::structured::prune_structured(file, stats, &target, None)?
                    .0
                    .to_bytes()?
            }
            Prune::Sparse { pattern, store, .. } => {
                let pattern: Pattern = pattern.parse().map_err(anyhow::Error::msg)?;
                let format = GgmlType::from_name(store)
                    .with_context(|| format!("{store}: not a GGUF type"))?;
                let method = sparse_method.expect("parsed above");
                crate::build::pruned(file, stats.as_ref(), method, pattern, format)?
            }
        };
        Ok(GgufFile::from_bytes(bytes)?)
    }
}

/// A structural stage (a cut, or a conversion to experts) and the quantization it is timed
/// with: the candidate `[cut, Quant(format)]` against its dense twin `[Quant(dense)]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trial {
    pub cut: Stage,
    /// The cut's storage after quantization (a compressed 2:4 type for sparse cuts that have
    /// one).
    pub format: String,
    /// The dense twin's format.
    pub dense: String,
}

impl Trial {
    /// The pruned candidate of the gate: the cut on the float base, then quantized.
    pub fn pruned(&self) -> Vec<Stage> {
        vec![
            self.cut.clone(),
            Stage::Quant {
                format: self.format.clone(),
                keep: Vec::new(),
                imatrix: false,
            },
        ]
    }

    /// The dense twin it is timed against.
    pub fn dense(&self) -> Vec<Stage> {
        vec![Stage::Quant {
            format: self.dense.clone(),
            keep: Vec::new(),
            imatrix: false,
        }]
    }

    /// The cut, when the stage is one.
    pub fn prune(&self) -> Option<&Prune> {
        match &self.cut {
            Stage::Prune(p) => Some(p),
            _ => None,
        }
    }

    /// The same cut made after the twin's quantization (scored on the quantized model), in
    /// the pruned storage; `None` for a stage that reads float weights (experts are split
    /// from the float FFN).
    pub fn after(&self) -> Option<Stage> {
        let p = match self.prune()? {
            Prune::Structured { .. } => self.prune()?.clone(),
            Prune::Sparse {
                method, pattern, ..
            } => Prune::Sparse {
                method: method.clone(),
                pattern: pattern.clone(),
                store: self.format.clone(),
            },
        };
        Some(Stage::Prune(p))
    }

    /// Whether the weight stages of other candidates can follow the stage (structured cuts
    /// and experts: any format; sparse cuts keep their own storage).
    pub fn takes_any_format(&self) -> bool {
        !matches!(self.cut, Stage::Prune(Prune::Sparse { .. }))
    }
}

/// What timing a cut against its dense twin found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gate {
    /// A cut or a conversion to experts (a bare cut in searches begun before experts were a
    /// stage, read as one).
    #[serde(deserialize_with = "stage_or_cut")]
    pub cut: Stage,
    pub format: String,
    pub dense: String,
    /// Decode speed of the pruned model over its dense twin, timed back to back.
    pub speedup: f64,
    /// Whether the search builds candidates from it (speed-up at least [`REWARD`]).
    pub taken: bool,
    pub reason: String,
}

fn stage_or_cut<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Stage, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Stage(Stage),
        Cut(Prune),
    }
    Ok(match Either::deserialize(d)? {
        Either::Stage(s) => s,
        Either::Cut(p) => Stage::Prune(p),
    })
}

/// The cuts worth timing on a model of this shape: FFN neurons in steps of whole K-quant
/// blocks (so that every format still tiles the narrower matrices), a few layers, 2:4 zeros in
/// both compressed types, and half the weights unstructured (stored densely: the pattern the
/// gate is there to refuse on a CPU without sparse kernels).
pub fn trials(c: &Config, float_base: bool) -> Vec<Trial> {
    let mut out = Vec::new();
    let q8 = type_name(GgmlType::Q8_0);
    let structured = |remove: String| Trial {
        cut: Stage::Prune(Prune::Structured { remove }),
        format: q8.clone(),
        dense: q8.clone(),
    };
    let step = if c.n_ff.is_multiple_of(256) { 256 } else { 32 };
    for k in 1..=2 {
        let removed = k * step;
        if removed * 2 <= c.n_ff {
            out.push(structured(format!(
                "ffn:{:.6}",
                removed as f64 / c.n_ff as f64
            )));
        }
    }
    let mut layers = vec![2, c.n_layers / 8];
    layers.dedup();
    for n in layers {
        if n >= 2 && n * 4 <= c.n_layers {
            out.push(structured(format!("layers:{n}")));
        }
    }
    // Sparse cuts need the float weights to score and re-store: a quantized base has only the
    // structured ones.
    if float_base && c.n_embd.is_multiple_of(32) && c.n_ff.is_multiple_of(32) {
        for (sparse, dense) in [
            (GgmlType::Q8_0_24, GgmlType::Q8_0),
            (GgmlType::Q4_0_24, GgmlType::Q4_0),
        ] {
            out.push(Trial {
                cut: Stage::Prune(Prune::Sparse {
                    method: Method::Wanda.to_string(),
                    pattern: "2:4".to_string(),
                    store: type_name(GgmlType::F32),
                }),
                format: type_name(sparse),
                dense: type_name(dense),
            });
        }
        out.push(Trial {
            cut: Stage::Prune(Prune::Sparse {
                method: Method::Wanda.to_string(),
                pattern: "0.5".to_string(),
                store: type_name(GgmlType::F32),
            }),
            format: q8.clone(),
            dense: q8,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gate written before experts were a stage holds a bare cut; it still reads (a search
    /// begun then resumes), and a gate written now round-trips.
    #[test]
    fn gates_read_bare_cuts_and_stages() {
        let old = r#"{"cut":{"kind":"structured","remove":"layers:2"},"format":"q8_0","dense":"q8_0","speedup":1.1,"taken":true,"reason":"r"}"#;
        let g: Gate = serde_json::from_str(old).unwrap();
        assert_eq!(
            g.cut,
            Stage::Prune(Prune::Structured {
                remove: "layers:2".into()
            })
        );
        let moe = Gate {
            cut: Stage::Moe {
                variant: "s512+8x2".into(),
                seed: 1,
            },
            ..g
        };
        let back: Gate = serde_json::from_str(&serde_json::to_string(&moe).unwrap()).unwrap();
        assert_eq!(back, moe);
    }
}
