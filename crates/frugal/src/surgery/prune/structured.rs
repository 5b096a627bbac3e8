//! Structured pruning: remove whole units so the tensors themselves shrink, chosen by measured
//! importance on calibration text (Minitron's activation-based recipe, arXiv 2407.14679).
//!
//! - **FFN neurons**: neuron `j`'s contribution to the block's output over the calibration
//!   tokens is `h_j(t) · W_down[:, j]`, whose norm is exactly `||h_j||₂ · ||W_down[:, j]||₂`;
//!   the lowest go (rows of gate and up, columns of down).
//! - **KV groups**: a KV head with the query heads that read it, so that the cache shrinks
//!   with the heads. A group's importance is its query heads' output through the output
//!   projection, `sqrt(Σ_c ||o_c||² ||W_o[:, c]||²)` over their columns (the columns taken as
//!   independent).
//! - **Layers**: block influence `1 - cos(input, output)` (ShortGPT), or any importance the
//!   caller measured (the loss increase when a layer is skipped, from [`drop_layers`] files).
//!   The first and last layers are always kept.
//!
//! Every layer keeps the same widths: frugal's `Config` has one FFN width and one head count,
//! and uniform layers keep each kernel's shapes identical across the stack. (llama.cpp would
//! read per-layer arrays for `feed_forward_length` and `head_count`, so non-uniform widths are
//! possible in the format; frugal does not produce them.) Removing a fraction of the FFN rounds
//! the kept width to the block size of the down projection's format.

use std::borrow::Cow;

use super::stats::{self, PruneStats};
use crate::gguf::{GgufFile, GgufWriter, TensorData, Value};
use crate::model::{Config, Site};
use crate::quant::{self, GgmlType};

use super::super::SurgeryError;

/// What to remove.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct StructuredTarget {
    /// Fraction of every layer's FFN neurons removed.
    pub ffn: f64,
    /// KV groups removed from every layer.
    pub kv_groups: usize,
    /// Whole layers removed.
    pub layers: usize,
}

impl std::str::FromStr for StructuredTarget {
    type Err = String;
    /// `ffn:0.25,heads:1,layers:6` (any subset, any order).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut t = StructuredTarget::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once(':')
                .ok_or_else(|| format!("{part:?}: expected ffn:FRACTION, heads:N or layers:N"))?;
            let bad = || format!("{part:?}: not a number");
            match k {
                "ffn" => t.ffn = v.parse().map_err(|_| bad())?,
                "heads" => t.kv_groups = v.parse().map_err(|_| bad())?,
                "layers" => t.layers = v.parse().map_err(|_| bad())?,
                _ => return Err(format!("{part:?}: unknown unit {k:?} (ffn, heads, layers)")),
            }
        }
        if !(0.0..1.0).contains(&t.ffn) {
            return Err(format!(
                "ffn:{}: the fraction of neurons removed must be in [0, 1)",
                t.ffn
            ));
        }
        if t == StructuredTarget::default() {
            return Err(format!("{s:?} removes nothing"));
        }
        Ok(t)
    }
}

/// What was removed and what is left.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StructuredReport {
    pub target: StructuredTarget,
    pub n_ff: (usize, usize),
    pub n_head: (usize, usize),
    pub n_head_kv: (usize, usize),
    /// Layers kept, in the original numbering.
    pub kept_layers: Vec<usize>,
    /// Per original layer: the KV groups kept.
    pub kept_groups: Vec<Vec<usize>>,
    /// Per original layer: the FFN neurons kept.
    pub kept_neurons: Vec<Vec<usize>>,
    pub layer_importance: Vec<f64>,
    pub params: (u64, u64),
    pub bytes: (u64, u64),
}

/// The indices of the `keep` highest scores, in ascending index order (ties to the lower index).
fn top(scores: &[f64], keep: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(keep);
    idx.sort_unstable();
    idx
}

/// The `n` layers to keep: the first, the last and the most important of the rest.
pub fn layers_to_keep(importance: &[f64], n: usize) -> Vec<usize> {
    let l = importance.len();
    if n >= l {
        return (0..l).collect();
    }
    let inner: Vec<f64> = importance[1..l - 1].to_vec();
    let mut keep = vec![0];
    keep.extend(top(&inner, n.saturating_sub(2)).iter().map(|i| i + 1));
    if n > 1 {
        keep.push(l - 1);
    }
    keep
}

pub(crate) fn matrix<'a, 'b>(
    w: &'b GgufWriter<'a>,
    name: &str,
) -> Result<&'b TensorData<'a>, SurgeryError> {
    w.tensors
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| SurgeryError::Invalid(format!("{name} is missing")))
}

/// Rows `ranges` of a matrix, byte for byte (rows are whole blocks in every format).
pub(crate) fn select_rows(t: &TensorData, rows: &[std::ops::Range<usize>]) -> TensorData<'static> {
    let n_rows = t.dims[1] as usize;
    let rb = t.data.len() / n_rows;
    let mut out = Vec::new();
    let mut kept = 0;
    for r in rows {
        out.extend_from_slice(&t.data[r.start * rb..r.end * rb]);
        kept += r.len();
    }
    TensorData {
        name: t.name.clone(),
        dims: vec![t.dims[0], kept as u64],
        ty: t.ty,
        data: Cow::Owned(out),
    }
}

/// Columns `cols` of a matrix: decoded, selected, re-encoded in its own format.
fn select_cols(t: &TensorData, cols: &[usize]) -> Result<TensorData<'static>, SurgeryError> {
    let (n_cols, n_rows) = (t.dims[0] as usize, t.dims[1] as usize);
    if !cols.len().is_multiple_of(t.ty.block_size()) {
        return Err(SurgeryError::Invalid(format!(
            "{}: {} kept columns do not fill {} blocks of {}",
            t.name,
            cols.len(),
            t.ty,
            t.ty.block_size()
        )));
    }
    let x = quant::dequantize_to_vec(t.ty, &t.data, n_rows * n_cols)
        .map_err(|e| SurgeryError::Quant(t.name.clone(), e))?;
    let mut y = Vec::with_capacity(n_rows * cols.len());
    for row in x.chunks_exact(n_cols) {
        y.extend(cols.iter().map(|&c| row[c]));
    }
    Ok(TensorData {
        name: t.name.clone(),
        dims: vec![cols.len() as u64, n_rows as u64],
        ty: t.ty,
        data: Cow::Owned(
            quant::quantize(t.ty, &y).map_err(|e| SurgeryError::Quant(t.name.clone(), e))?,
        ),
    })
}

/// `||W[:, c]||²` for every column of a matrix.
fn col_norms_sq(t: &TensorData) -> Result<Vec<f64>, SurgeryError> {
    let (n_cols, n_rows) = (t.dims[0] as usize, t.dims[1] as usize);
    let x = quant::dequantize_to_vec(t.ty, &t.data, n_rows * n_cols)
        .map_err(|e| SurgeryError::Quant(t.name.clone(), e))?;
    let mut n = vec![0f64; n_cols];
    for row in x.chunks_exact(n_cols) {
        for (s, &v) in n.iter_mut().zip(row) {
            *s += f64::from(v) * f64::from(v);
        }
    }
    Ok(n)
}

/// `file` without the layers not in `keep` (renumbered; `block_count` updated).
pub fn drop_layers<'a>(file: &'a GgufFile, keep: &[usize]) -> Result<GgufWriter<'a>, SurgeryError> {
    let c = Config::from_gguf(file)?;
    let mut w = GgufWriter::from_file(file);
    keep_layers_in(&mut w, &c, keep)?;
    Ok(w)
}

fn keep_layers_in(w: &mut GgufWriter, c: &Config, keep: &[usize]) -> Result<(), SurgeryError> {
    if keep.is_empty() || keep.iter().any(|&l| l >= c.n_layers) {
        return Err(SurgeryError::Invalid(format!(
            "layers {keep:?}: a model needs at least one of its {} layers",
            c.n_layers
        )));
    }
    let block = |name: &str| -> Option<(usize, String)> {
        let rest = name.strip_prefix("blk.")?;
        let (l, suffix) = rest.split_once('.')?;
        Some((l.parse().ok()?, suffix.to_string()))
    };
    let mut out = Vec::with_capacity(w.tensors.len());
    for t in std::mem::take(&mut w.tensors) {
        match block(&t.name) {
            None => out.push(t),
            Some((l, suffix)) => {
                if let Some(new) = keep.iter().position(|&k| k == l) {
                    out.push(TensorData {
                        name: format!("blk.{new}.{suffix}"),
                        ..t
                    });
                }
            }
        }
    }
    w.tensors = out;
    w.set(
        &format!("{}.block_count", c.arch),
        Value::U32(keep.len() as u32),
    );
    Ok(())
}

/// Parameters and bytes of a writer's tensors.
fn count(w: &GgufWriter) -> (u64, u64) {
    w.tensors.iter().fold((0, 0), |(p, b), t| {
        (p + t.dims.iter().product::<u64>(), b + t.data.len() as u64)
    })
}

/// Removes what `target` asks from `file`, by the importances in `stats` (and `layer_importance`
/// when given, else block influence).
pub fn prune_structured<'a>(
    file: &'a GgufFile,
    stats: &PruneStats,
    target: &StructuredTarget,
    layer_importance: Option<Vec<f64>>,
) -> Result<(GgufWriter<'a>, StructuredReport), SurgeryError> {
    let c = Config::from_gguf(file)?;
    if c.mla.is_some() {
        return Err(SurgeryError::Invalid(
            "structured pruning of latent-attention files is not supported".into(),
        ));
    }
    if stats.inputs.len() != c.n_layers {
        return Err(SurgeryError::Invalid(format!(
            "calibration statistics for {} layers, the model has {}",
            stats.inputs.len(),
            c.n_layers
        )));
    }
    if target.kv_groups >= c.n_head_kv {
        return Err(SurgeryError::Invalid(format!(
            "heads:{}: removing {} of the {} KV groups of every layer would leave no attention",
            target.kv_groups, target.kv_groups, c.n_head_kv
        )));
    }
    if target.layers >= c.n_layers {
        return Err(SurgeryError::Invalid(format!(
            "layers:{}: the model has {} layers; at least one must stay",
            target.layers, c.n_layers
        )));
    }
    let before = GgufWriter::from_file(file);
    let down_ty: GgmlType = matrix(&before, "blk.0.ffn_down.weight")?.ty;
    let bs = down_ty.block_size().max(1);
    let removed = ((c.n_ff as f64) * target.ffn).round() as usize;
    let n_ff = ((c.n_ff - removed) / bs * bs).max(bs.min(c.n_ff));
    let (group, hd) = (c.n_head / c.n_head_kv, c.head_dim);
    let n_kv = c.n_head_kv - target.kv_groups;
    let li = layer_importance.unwrap_or_else(|| stats.block_influence.clone());
    if li.len() != c.n_layers {
        return Err(SurgeryError::Invalid(format!(
            "{} layer importances for {} layers",
            li.len(),
            c.n_layers
        )));
    }
    let kept_layers = layers_to_keep(&li, c.n_layers - target.layers);

    let mut w = GgufWriter::from_file(file);
    let mut kept_groups = Vec::new();
    let mut kept_neurons = Vec::new();
    for l in 0..c.n_layers {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let mut replace = Vec::new();
        let st = &stats.inputs[l];
        if n_ff < c.n_ff {
            let down = matrix(&w, &name("ffn_down"))?;
            let h = &st[stats::site_index(Site::FfnDownInput).expect("an input site")];
            let dn = col_norms_sq(down)?;
            let score: Vec<f64> = h.sq.iter().zip(&dn).map(|(a, b)| (a * b).sqrt()).collect();
            let keep = top(&score, n_ff);
            let rows: Vec<_> = keep.iter().map(|&j| j..j + 1).collect();
            replace.push(select_rows(matrix(&w, &name("ffn_gate"))?, &rows));
            replace.push(select_rows(matrix(&w, &name("ffn_up"))?, &rows));
            replace.push(select_cols(down, &keep)?);
            kept_neurons.push(keep);
        } else {
            kept_neurons.push((0..c.n_ff).collect());
        }
        if n_kv < c.n_head_kv {
            let wo = matrix(&w, &name("attn_output"))?;
            let o = &st[stats::site_index(Site::AttnOutput).expect("an input site")];
            let on = col_norms_sq(wo)?;
            let score: Vec<f64> = (0..c.n_head_kv)
                .map(|g| {
                    let cols = g * group * hd..(g + 1) * group * hd;
                    cols.map(|k| o.sq[k] * on[k]).sum::<f64>().sqrt()
                })
                .collect();
            let keep = top(&score, n_kv);
            let q_rows: Vec<_> = keep
                .iter()
                .map(|&g| g * group * hd..(g + 1) * group * hd)
                .collect();
            let kv_rows: Vec<_> = keep.iter().map(|&g| g * hd..(g + 1) * hd).collect();
            let o_cols: Vec<usize> = q_rows.iter().flat_map(|r| r.clone()).collect();
            replace.push(select_rows(matrix(&w, &name("attn_q"))?, &q_rows));
            replace.push(select_rows(matrix(&w, &name("attn_k"))?, &kv_rows));
            replace.push(select_rows(matrix(&w, &name("attn_v"))?, &kv_rows));
            replace.push(select_cols(wo, &o_cols)?);
            kept_groups.push(keep);
        } else {
            kept_groups.push((0..c.n_head_kv).collect());
        }
        for r in replace {
            let slot = w
                .tensors
                .iter_mut()
                .find(|t| t.name == r.name)
                .expect("replacements are of existing tensors");
            *slot = r;
        }
    }
    let arch = c.arch.clone();
    let u = |v: usize| Value::U32(v as u32);
    w.set(&format!("{arch}.feed_forward_length"), u(n_ff));
    w.set(&format!("{arch}.attention.head_count"), u(n_kv * group));
    w.set(&format!("{arch}.attention.head_count_kv"), u(n_kv));
    // The head width no longer follows from n_embd / n_head: say it.
    w.set(&format!("{arch}.attention.key_length"), u(hd));
    w.set(&format!("{arch}.attention.value_length"), u(hd));
    let (p0, b0) = count(&before);
    keep_layers_in(&mut w, &c, &kept_layers)?;
    let (p1, b1) = count(&w);
    let report = StructuredReport {
        target: target.clone(),
        n_ff: (c.n_ff, n_ff),
        n_head: (c.n_head, n_kv * group),
        n_head_kv: (c.n_head_kv, n_kv),
        kept_layers,
        kept_groups,
        kept_neurons,
        layer_importance: li,
        params: (p0, p1),
        bytes: (b0, b1),
    };
    w.set(
        "frugal.prune.structured",
        Value::String(format!(
            "ffn:{},heads:{},layers:{}",
            target.ffn, target.kv_groups, target.layers
        )),
    );
    Ok((w, report))
}
