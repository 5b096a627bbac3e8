//! Pruning: fewer weights. Three families, each writing a standard GGUF:
//!
//! - **Unstructured and N:M** ([`prune_weights`]): the seven matrices of every block keep their
//!   shapes and get exact zeros where a score says a weight matters least: magnitude `|w|`, Wanda
//!   `|w|·||x_j||₂` (inputs' norms on calibration text), or SparseGPT's reconstruction
//!   ([`sparsegpt`]). Stored densely the file has the same bytes and the same multiply-adds: no
//!   faster, which is the point the pruning report makes in numbers.
//! - **Structured** ([`structured`]): whole FFN neurons, KV groups (a KV head with the query
//!   heads that read it) and layers removed, chosen by measured importance; the tensors shrink
//!   and so do the bytes and the multiply-adds.
//!
//! The zeros must survive the storage format: formats with a per-block offset (Q4_1, Q5_1, the
//! K-quants with mins) cannot store an exact zero, so pruned matrices are re-encoded in a format
//! that can (`--format`, Q8_0 by default) and every pruned position is checked after encoding.

pub mod mask;
pub mod sparsegpt;
pub mod stats;
pub mod structured;

use std::borrow::Cow;

use rayon::prelude::*;

pub use mask::Pattern;
pub use stats::{PruneStats, collect};

use super::SurgeryError;
use crate::gguf::{GgufFile, GgufWriter, Value};
use crate::model::Config;
use crate::quant::{self, GgmlType};

/// How a weight's importance is scored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// `|w|`: needs no data.
    Magnitude,
    /// `|w| · ||x_j||₂` (Sun et al. 2023), compared within each output row.
    Wanda,
    /// Layer-wise reconstruction with the inverse Hessian (Frantar & Alistarh 2023).
    SparseGpt,
}

impl Method {
    /// Whether the method reads calibration activations.
    pub fn needs_calibration(self) -> bool {
        self != Method::Magnitude
    }
}

impl std::str::FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "magnitude" => Ok(Method::Magnitude),
            "wanda" => Ok(Method::Wanda),
            "sparsegpt" => Ok(Method::SparseGpt),
            _ => Err(format!(
                "unknown pruning method {s:?}: use magnitude, wanda or sparsegpt"
            )),
        }
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Method::Magnitude => "magnitude",
            Method::Wanda => "wanda",
            Method::SparseGpt => "sparsegpt",
        })
    }
}

/// What [`prune_weights`] does.
#[derive(Clone, Copy, Debug)]
pub struct PruneTarget {
    pub method: Method,
    pub pattern: Pattern,
    /// Storage of the pruned matrices; it must store zeros exactly.
    pub format: GgmlType,
}

/// What a pruning did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PruneReport {
    pub method: Method,
    pub pattern: Pattern,
    pub format: String,
    pub matrices: usize,
    pub weights: u64,
    /// Weights that are zero after pruning (including any that were zero before).
    pub zeros: u64,
    /// Bytes of the pruned matrices before and after (dense storage: the format decides).
    pub bytes_before: u64,
    pub bytes_after: u64,
}

impl PruneReport {
    pub fn sparsity(&self) -> f64 {
        self.zeros as f64 / self.weights.max(1) as f64
    }
}

/// The block matrices pruning touches: `(layer, GGUF name, input site index)`.
fn block_matrices(c: &Config) -> Vec<(usize, String, usize)> {
    (0..c.n_layers)
        .flat_map(|l| {
            stats::MATRICES.iter().map(move |(suffix, site)| {
                (
                    l,
                    format!("blk.{l}.{suffix}.weight"),
                    stats::site_index(*site).expect("matrix inputs are input sites"),
                )
            })
        })
        .collect()
}

/// Prunes every block matrix of `file` to `target` (`stats` from [`collect`] when the method
/// reads activations; with Gram matrices for SparseGPT).
pub fn prune_weights<'a>(
    file: &'a GgufFile,
    stats: Option<&PruneStats>,
    target: PruneTarget,
) -> Result<(GgufWriter<'a>, PruneReport), SurgeryError> {
    let c = Config::from_gguf(file)?;
    if c.mla.is_some() {
        return Err(SurgeryError::Invalid(
            "pruning latent-attention (deepseek2) files is not supported: prune the per-head \
             model, then convert"
                .into(),
        ));
    }
    let stats = match (target.method.needs_calibration(), stats) {
        (true, None) => {
            return Err(SurgeryError::Invalid(format!(
                "{} needs calibration activations (--calibration FILE)",
                target.method
            )));
        }
        (_, s) => s,
    };
    if target.method == Method::SparseGpt
        && stats.is_some_and(|s| s.inputs.iter().flatten().any(|i| i.gram.is_none()))
    {
        return Err(SurgeryError::Invalid(
            "sparsegpt needs Gram matrices: collect the statistics with gram = true".into(),
        ));
    }
    if quant::sparse::is_sparse(target.format)
        && !matches!(target.pattern, Pattern::NofM { n, m: 4 } if n <= 2)
    {
        return Err(SurgeryError::Invalid(format!(
            "{} is the compressed 2:4 storage: it keeps at most 2 of every 4 weights, so it \
             needs --pattern 2:4 (got {}); store other patterns densely (q8_0, q4_0)",
            target.format, target.pattern
        )));
    }
    let mut w = GgufWriter::from_file(file);
    let mut report = PruneReport {
        method: target.method,
        pattern: target.pattern,
        format: target.format.name().to_string(),
        matrices: 0,
        weights: 0,
        zeros: 0,
        bytes_before: 0,
        bytes_after: 0,
    };
    for (layer, name, site) in block_matrices(&c) {
        let t = w
            .tensors
            .iter_mut()
            .find(|t| t.name == name)
            .ok_or_else(|| SurgeryError::Invalid(format!("{name} is missing")))?;
        let (cols, rows) = match t.dims[..] {
            [c, r] => (c as usize, r as usize),
            _ => {
                return Err(SurgeryError::Invalid(format!(
                    "{name}: shape {:?} is not a matrix",
                    t.dims
                )));
            }
        };
        target
            .pattern
            .check(cols)
            .map_err(|e| SurgeryError::Invalid(format!("{name}: {e}")))?;
        if !cols.is_multiple_of(target.format.block_size()) {
            return Err(SurgeryError::Invalid(format!(
                "{name}: rows of {cols} do not fill {} blocks of {}",
                target.format,
                target.format.block_size()
            )));
        }
        let mut x = quant::dequantize_to_vec(t.ty, &t.data, rows * cols)
            .map_err(|e| SurgeryError::Quant(name.clone(), e))?;
        let input = stats.map(|s| &s.inputs[layer][site]);
        if let Some(i) = input
            && i.width != cols
        {
            return Err(SurgeryError::Invalid(format!(
                "{name}: {cols} inputs, but the calibration saw {}",
                i.width
            )));
        }
        let keep = match target.method {
            Method::SparseGpt => {
                let gram = input
                    .and_then(|i| i.gram.as_deref())
                    .expect("checked above");
                sparsegpt::prune(&mut x, rows, cols, gram, target.pattern)
                    .map_err(|e| SurgeryError::Invalid(format!("{name}: {e}")))?
            }
            Method::Magnitude | Method::Wanda => {
                // Magnitude ignores activations even when they were collected.
                let norms = input
                    .filter(|_| target.method == Method::Wanda)
                    .map(|i| i.norms());
                let mut keep = vec![false; rows * cols];
                x.par_chunks_mut(cols)
                    .zip(keep.par_chunks_mut(cols))
                    .for_each(|(row, kr)| {
                        let scores: Vec<f64> = match &norms {
                            Some(n) => row
                                .iter()
                                .zip(n)
                                .map(|(&v, &nj)| f64::from(v.abs()) * nj)
                                .collect(),
                            None => row.iter().map(|&v| f64::from(v.abs())).collect(),
                        };
                        mask::row_mask(&scores, target.pattern, kr);
                        row.iter_mut().zip(kr.iter()).for_each(|(v, &k)| {
                            if !k {
                                *v = 0.0;
                            }
                        });
                    });
                keep
            }
        };
        let bytes =
            quant::quantize(target.format, &x).map_err(|e| SurgeryError::Quant(name.clone(), e))?;
        // Every pruned weight must read back as exactly zero.
        let back = quant::dequantize_to_vec(target.format, &bytes, rows * cols)
            .map_err(|e| SurgeryError::Quant(name.clone(), e))?;
        if let Some(i) = keep.iter().zip(&back).position(|(&k, &v)| !k && v != 0.0) {
            return Err(SurgeryError::Invalid(format!(
                "{name}: {} does not store an exact zero (weight {i} reads back as {}); use a \
                 format without a per-block offset: q8_0, q4_0, q5_0, q6_k, f16, bf16 or f32",
                target.format, back[i]
            )));
        }
        report.matrices += 1;
        report.weights += (rows * cols) as u64;
        report.zeros += back.iter().filter(|&&v| v == 0.0).count() as u64;
        report.bytes_before += t.data.len() as u64;
        report.bytes_after += bytes.len() as u64;
        t.ty = target.format;
        t.data = Cow::Owned(bytes);
    }
    let s = |v: String| Value::String(v);
    w.set("frugal.prune.method", s(target.method.to_string()));
    w.set("frugal.prune.pattern", s(target.pattern.to_string()));
    w.set(
        "frugal.prune.sparsity",
        Value::F32(report.sparsity() as f32),
    );
    Ok((w, report))
}

#[cfg(test)]
mod tests;
