//! Converting a trained GQA (or MHA) Llama model to multi-head latent attention, written in
//! llama.cpp's `deepseek2` layout so that both engines run it.
//!
//! MLA caches one latent per token instead of per-head keys and values, plus one RoPE key that
//! all heads share. Two things must change to get there (MHA2MLA, arXiv 2502.14837; TransMLA,
//! arXiv 2502.07864):
//!
//! 1. **Partial RoPE with a shared key.** Only `rope_dims` dims per head keep their rotation;
//!    the rest become position-free ("NoPE"). The file's one RoPE key has a standard frequency
//!    schedule (`base'^(-2j/rope_dims)`), so the frequency pairs kept must be `0, s, 2s, ...` of
//!    the original schedule (then `base' = base^(s * rope_dims / rope_dim)`): the stride `s` is
//!    chosen by each pair's measured contribution to the attention scores,
//!    `mean ||q_pair|| * ||k_pair||` over calibration text (MHA2MLA's 2-norm criterion, summed
//!    over layers since the schedule is per file), weighted by how much the pair rotates over a
//!    window (what removing its rotation costs). Unweighted, the criterion keeps the slow pairs,
//!    whose norms are largest: on SmolLM2 at `mla:96:32` that choice gave PPL 257, the fast
//!    pairs 129. Sharing one key across KV heads is a
//!    per-pair PCA over the heads' keys (TransMLA's RoRoPE idea): the top principal direction
//!    `u` of the heads' 2-D key components is the shared key, and each query head's rotated part
//!    is scaled by its head's `u` entry; RoPE commutes with that mixing because the same `u`
//!    acts on both components of a pair.
//! 2. **A joint low-rank latent** for the position-free keys and the values of every KV head,
//!    `[W_k_nope; W_v] ~ Up * Down`. Two ways: an SVD of the weights alone, or activation-aware
//!    (a PCA of the outputs `[W_k_nope; W_v] x` on calibration inputs, with the keys first
//!    rescaled to the values' energy so neither dominates, as TransMLA balances them).
//!
//! llama.cpp always RMS-normalizes the latent (`attn_kv_a_norm`); a factorization gives an
//! unnormalized one. The down-projection is therefore scaled by a small `alpha` so that the
//! latent's mean square is far below the norm's epsilon, where RMSNorm is linear
//! (`x / sqrt(mean(x^2) + eps) ~ x / sqrt(eps)`), and the norm weight `sqrt(eps) / alpha` undoes
//! it. Those tiny weights need a float format with a wide exponent: `attn_kv_a_mqa` is written
//! as F32 (as are the small `attn_k_b` / `attn_v_b`); every other tensor keeps its bytes.

use std::borrow::Cow;

use nalgebra::{DMatrix, SymmetricEigen};

use crate::gguf::{GgufFile, GgufWriter, TensorData, Value};
use crate::kv::KvOptions;
use crate::model::{Config, Logits, Model, Observer, Scratch, Site};
use crate::quant::{self, GgmlType};

use super::SurgeryError;

/// How the joint key/value latent is factorized.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Factorization {
    /// Truncated SVD of the stacked projection weights.
    Svd,
    /// PCA of the projections' outputs on calibration inputs (keys balanced against values).
    Activations,
}

impl std::str::FromStr for Factorization {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "svd" | "weights" => Ok(Factorization::Svd),
            "activations" | "activation-aware" | "pca" => Ok(Factorization::Activations),
            _ => Err(format!(
                "unknown factorization {s:?} (expected svd or activations)"
            )),
        }
    }
}

impl std::fmt::Display for Factorization {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Factorization::Svd => "svd",
            Factorization::Activations => "activations",
        })
    }
}

/// The target of an MLA conversion.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MlaTarget {
    /// Latent values per token and layer (`kv_lora_rank`).
    pub rank: usize,
    /// Dims of the shared RoPE key (even).
    pub rope_dims: usize,
    pub factorization: Factorization,
}

/// The normalized attention inputs of every layer on calibration text (`rows x n_embd` each).
pub struct Calibration {
    pub inputs: Vec<Vec<f32>>,
    pub rows: usize,
}

struct Collect<'a>(&'a mut [Vec<f32>]);

impl Observer for Collect<'_> {
    fn observe(&mut self, layer: usize, site: Site, x: &[f32], _width: usize) {
        if site == Site::AttnInput {
            self.0[layer].extend_from_slice(x);
        }
    }
}

/// Runs `tokens` through `model` in windows of `ctx` and keeps every layer's attention inputs.
pub fn calibrate(model: &Model, tokens: &[u32], ctx: usize) -> Result<Calibration, SurgeryError> {
    let c = &model.config;
    if tokens.len() < 2 || ctx == 0 {
        return Err(SurgeryError::Invalid(
            "calibration needs at least two tokens of text".into(),
        ));
    }
    let mut inputs = vec![Vec::new(); c.n_layers];
    let mut kv = model
        .new_seq_cache(ctx, &KvOptions::default())
        .map_err(|e| SurgeryError::Invalid(e.to_string()))?;
    let mut s = Scratch::default();
    for w in tokens.chunks(ctx) {
        kv.clear();
        model
            .forward_observed(
                w,
                &mut kv,
                &mut s,
                Logits::Last,
                Some(&mut Collect(&mut inputs)),
            )
            .map_err(|e| SurgeryError::Invalid(e.to_string()))?;
    }
    Ok(Calibration {
        inputs,
        rows: tokens.len(),
    })
}

/// What a conversion chose and kept, layer by layer.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MlaReport {
    pub target: MlaTarget,
    /// Stride of the kept frequency pairs (`0, s, 2s, ...` of the original schedule).
    pub rope_stride: usize,
    /// Each candidate stride's share of the measured RoPE contribution it keeps.
    pub stride_scores: Vec<(usize, f64)>,
    pub rope_base: f32,
    /// Per layer: the share of the kept pairs' key energy the shared key holds (1 for MQA).
    pub shared_key_energy: Vec<f64>,
    /// Per layer: the share of the factorized outputs' energy (SVD: of the weights') the latent
    /// keeps.
    pub latent_energy: Vec<f64>,
    /// Cache values per token and layer, before and after.
    pub cache_values_before: usize,
    pub cache_values_after: usize,
    pub calibration_rows: usize,
}

/// The most the latent can usefully hold: the rows it factorizes (position-free keys of every
/// KV head, then their values). A rank at or above it saves nothing.
pub fn lossless_rank(c: &Config, rope_dims: usize) -> usize {
    c.n_head_kv * (c.head_dim - rope_dims) + c.n_head_kv * c.head_dim
}

/// Converts `file` to MLA, guided by `calib` (its model's attention inputs on calibration text,
/// from [`calibrate`]).
pub fn convert_to_mla<'a>(
    file: &'a GgufFile,
    calib: &Calibration,
    target: MlaTarget,
) -> Result<(GgufWriter<'a>, MlaReport), SurgeryError> {
    let c = Config::from_gguf(file)?;
    let bad = |m: String| Err(SurgeryError::Invalid(m));
    if c.mla.is_some() || !matches!(c.arch.as_str(), "llama" | "mistral") {
        return bad(format!(
            "mla: the source must be a Llama-family MHA or GQA model, not {}",
            c.arch
        ));
    }
    let r = target.rope_dims;
    if r == 0 || !r.is_multiple_of(2) || r > c.rope_dim || r >= c.head_dim {
        return bad(format!(
            "mla: {r} RoPE dims must be even, positive, at most the {} the model rotates and \
             fewer than its head dimension {}",
            c.rope_dim, c.head_dim
        ));
    }
    let full = lossless_rank(&c, r);
    if target.rank == 0 || target.rank >= full {
        return bad(format!(
            "mla:{}: the latent rank must be below {full}, the {} position-free keys and \
             values it factorizes (at or above it the cache saves nothing)",
            target.rank, full
        ));
    }
    build(file, &c, calib, target)
}

fn dequant(file: &GgufFile, name: &str) -> Result<(DMatrix<f64>, GgmlType), SurgeryError> {
    let (info, bytes) = file.tensor(name)?;
    let (cols, rows) = (info.dims[0] as usize, info.n_rows());
    let v = quant::dequantize_to_vec(info.ty, bytes, rows * cols)
        .map_err(|e| SurgeryError::Quant(name.into(), e))?;
    Ok((
        DMatrix::from_row_iterator(rows, cols, v.iter().map(|&x| f64::from(x))),
        info.ty,
    ))
}

fn rows_of(m: &DMatrix<f64>, idx: &[usize]) -> DMatrix<f64> {
    DMatrix::from_fn(idx.len(), m.ncols(), |i, j| m[(idx[i], j)])
}

fn f32_tensor(
    name: String,
    dims: Vec<u64>,
    data: impl IntoIterator<Item = f64>,
) -> TensorData<'static> {
    let bytes: Vec<u8> = data
        .into_iter()
        .flat_map(|x| (x as f32).to_le_bytes())
        .collect();
    TensorData {
        name,
        dims,
        ty: GgmlType::F32,
        data: Cow::Owned(bytes),
    }
}

/// The top `k` eigenvectors (columns, largest eigenvalue first) of a symmetric matrix, and the
/// share of the trace they hold.
fn top_eigen(m: DMatrix<f64>, k: usize) -> (DMatrix<f64>, f64) {
    let e = SymmetricEigen::new(m);
    let mut order: Vec<usize> = (0..e.eigenvalues.len()).collect();
    order.sort_by(|&a, &b| e.eigenvalues[b].total_cmp(&e.eigenvalues[a]));
    let total: f64 = e.eigenvalues.iter().map(|v| v.max(0.0)).sum();
    let kept: f64 = order[..k].iter().map(|&i| e.eigenvalues[i].max(0.0)).sum();
    let vecs = DMatrix::from_fn(e.eigenvectors.nrows(), k, |r, j| {
        e.eigenvectors[(r, order[j])]
    });
    (vecs, if total > 0.0 { kept / total } else { 1.0 })
}

/// The conversion proper (`target` already checked against the model).
fn build<'a>(
    file: &'a GgufFile,
    c: &Config,
    calib: &Calibration,
    target: MlaTarget,
) -> Result<(GgufWriter<'a>, MlaReport), SurgeryError> {
    let (hd, nkv, nh, d) = (c.head_dim, c.n_head_kv, c.n_head, c.n_embd);
    let group = nh / nkv;
    let (rank, rd) = (target.rank, target.rope_dims);
    let nope = hd - rd;
    let pairs_src = c.rope_dim / 2;
    let kept_pairs = rd / 2;
    if calib.inputs.len() != c.n_layers || calib.inputs.iter().any(|x| x.len() != calib.rows * d) {
        return Err(SurgeryError::Invalid(
            "calibration inputs do not match the model".into(),
        ));
    }
    let xs: Vec<DMatrix<f64>> = calib
        .inputs
        .iter()
        .map(|x| DMatrix::from_row_iterator(calib.rows, d, x.iter().map(|&v| f64::from(v))))
        .collect();

    // Pass 1: every pair's contribution, and every pair's key covariance across KV heads.
    let mut contrib = vec![0f64; pairs_src];
    let mut cov: Vec<Vec<DMatrix<f64>>> = Vec::with_capacity(c.n_layers);
    for (l, x) in xs.iter().enumerate() {
        let (wq, _) = dequant(file, &format!("blk.{l}.attn_q.weight"))?;
        let (wk, _) = dequant(file, &format!("blk.{l}.attn_k.weight"))?;
        let q = x * wq.transpose();
        let k = x * wk.transpose();
        let mut layer_cov = Vec::with_capacity(pairs_src);
        for p in 0..pairs_src {
            let mut sigma = DMatrix::<f64>::zeros(nkv, nkv);
            for t in 0..calib.rows {
                let kn = |g: usize| {
                    let (a, b) = (k[(t, g * hd + 2 * p)], k[(t, g * hd + 2 * p + 1)]);
                    (a, b)
                };
                for h in 0..nh {
                    let (a, b) = (q[(t, h * hd + 2 * p)], q[(t, h * hd + 2 * p + 1)]);
                    let (ka, kb) = kn(h / group);
                    contrib[p] += (a * a + b * b).sqrt() * (ka * ka + kb * kb).sqrt();
                }
                for g in 0..nkv {
                    for g2 in 0..nkv {
                        let ((a, b), (a2, b2)) = (kn(g), kn(g2));
                        sigma[(g, g2)] += a * a2 + b * b2;
                    }
                }
            }
            layer_cov.push(sigma);
        }
        cov.push(layer_cov);
    }
    // What dropping a pair's rotation costs: a score q.R(theta d)k becomes q.k, off by about
    // |q||k| |sin(theta d / 2)| at distance d. Slow pairs barely rotate over a window and lose
    // little, however large their norms (which the plain 2-norm criterion would keep); so each
    // pair's contribution is weighted by the mean |sin(theta d / 2)| over d = 1..WINDOW.
    const WINDOW: usize = 512;
    for (p, cp) in contrib.iter_mut().enumerate() {
        let theta = f64::from(c.rope_base).powf(-2.0 * p as f64 / c.rope_dim as f64);
        let w: f64 = (1..=WINDOW)
            .map(|dist| (theta * dist as f64 / 2.0).sin().abs())
            .sum::<f64>()
            / WINDOW as f64;
        *cp *= w;
    }
    let total: f64 = contrib.iter().sum::<f64>().max(f64::MIN_POSITIVE);
    let max_stride = if kept_pairs > 1 {
        (pairs_src - 1) / (kept_pairs - 1)
    } else {
        pairs_src
    };
    let stride_scores: Vec<(usize, f64)> = (1..=max_stride.max(1))
        .map(|s| {
            let kept: f64 = (0..kept_pairs).map(|j| contrib[s * j]).sum();
            (s, kept / total)
        })
        .collect();
    let stride = stride_scores
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|&(s, _)| s)
        .unwrap_or(1);
    let kept: Vec<usize> = (0..kept_pairs).map(|j| stride * j).collect();
    let rope_dims: Vec<usize> = kept.iter().flat_map(|&p| [2 * p, 2 * p + 1]).collect();
    let nope_dims: Vec<usize> = (0..hd).filter(|x| !rope_dims.contains(x)).collect();
    let rope_base = (f64::from(c.rope_base)).powf((stride * rd) as f64 / c.rope_dim as f64) as f32;

    // Pass 2: the new attention tensors of each layer.
    let mut w = GgufWriter::from_file(file);
    let mut new_tensors: Vec<TensorData<'a>> = Vec::new();
    let (mut shared_key_energy, mut latent_energy) = (Vec::new(), Vec::new());
    let eps = f64::from(c.rms_eps);
    for (l, x) in xs.iter().enumerate() {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let (wq, q_ty) = dequant(file, &name("attn_q"))?;
        let (wk, _) = dequant(file, &name("attn_k"))?;
        let (wv, _) = dequant(file, &name("attn_v"))?;
        // Shared RoPE key: per kept pair, the top direction across KV heads.
        let mut u = Vec::with_capacity(kept_pairs);
        let (mut held, mut all) = (0.0, 0.0);
        for &p in &kept {
            let sigma = cov[l][p].clone();
            all += sigma.trace();
            let (v, share) = top_eigen(sigma.clone(), 1);
            held += share * sigma.trace();
            let mut col: Vec<f64> = v.column(0).iter().copied().collect();
            if col.iter().sum::<f64>() < 0.0 {
                col.iter_mut().for_each(|a| *a = -*a);
            }
            u.push(col);
        }
        shared_key_energy.push(if all > 0.0 { held / all } else { 1.0 });
        let mut k_pe = DMatrix::<f64>::zeros(rd, d);
        for (j, &p) in kept.iter().enumerate() {
            for (g, &ug) in u[j].iter().enumerate() {
                for e in 0..2 {
                    let src = wk.row(g * hd + 2 * p + e) * ug;
                    let mut dst = k_pe.row_mut(2 * j + e);
                    dst += src;
                }
            }
        }
        // Queries: [position-free dims | kept pairs scaled by their head's share of the key].
        let mut q_new = DMatrix::<f64>::zeros(nh * hd, d);
        for h in 0..nh {
            let g = h / group;
            for (i, &dim) in nope_dims.iter().enumerate() {
                q_new.set_row(h * hd + i, &wq.row(h * hd + dim));
            }
            for (j, &p) in kept.iter().enumerate() {
                for e in 0..2 {
                    q_new.set_row(
                        h * hd + nope + 2 * j + e,
                        &(wq.row(h * hd + 2 * p + e) * u[j][g]),
                    );
                }
            }
        }
        // The stacked projections the latent replaces: position-free keys, then values.
        let k_rows: Vec<usize> = (0..nkv)
            .flat_map(|g| nope_dims.iter().map(move |&dim| g * hd + dim))
            .collect();
        let m_k = rows_of(&wk, &k_rows);
        let (down, up, energy) = match target.factorization {
            Factorization::Svd => {
                let m = stack(&m_k, &wv);
                let svd = m.clone().svd(true, true);
                let (uu, vt) = (svd.u.expect("u"), svd.v_t.expect("v_t"));
                let mut order: Vec<usize> = (0..svd.singular_values.len()).collect();
                order.sort_by(|&a, &b| svd.singular_values[b].total_cmp(&svd.singular_values[a]));
                let s2: f64 = svd.singular_values.iter().map(|s| s * s).sum();
                let kept2: f64 = order[..rank]
                    .iter()
                    .map(|&i| svd.singular_values[i].powi(2))
                    .sum();
                let down = DMatrix::from_fn(rank, d, |i, j| vt[(order[i], j)]);
                let up = DMatrix::from_fn(m.nrows(), rank, |i, j| {
                    uu[(i, order[j])] * svd.singular_values[order[j]]
                });
                (down, up, kept2 / s2.max(f64::MIN_POSITIVE))
            }
            Factorization::Activations => {
                let (yk, yv) = (x * m_k.transpose(), x * wv.transpose());
                let beta = (yk.norm_squared() / yv.norm_squared().max(f64::MIN_POSITIVE)).sqrt();
                let beta = if beta > 0.0 { beta } else { 1.0 };
                let m = stack(&(&m_k / beta), &wv);
                let y = x * m.transpose();
                let (basis, share) = top_eigen(y.transpose() * &y, rank);
                let down = basis.transpose() * &m;
                let mut up = basis;
                for i in 0..m_k.nrows() {
                    let mut row = up.row_mut(i);
                    row *= beta;
                }
                (down, up, share)
            }
        };
        latent_energy.push(energy);
        // Make RMSNorm linear on the latent: its mean square far below eps.
        let lat = x * down.transpose();
        let mean_sq = lat
            .row_iter()
            .map(|r| r.norm_squared() / rank as f64)
            .fold(0.0, f64::max)
            .max(f64::MIN_POSITIVE);
        let alpha = (1e-4 * eps / mean_sq).sqrt();
        let kv_a = stack(&(&down * alpha), &k_pe);
        let n_k = nkv * nope;
        let k_b = (0..nh).flat_map(|h| {
            let g = h / group;
            let up = &up;
            (0..rank).flat_map(move |r| (0..nope).map(move |n| up[(g * nope + n, r)]))
        });
        let v_b = (0..nh).flat_map(|h| {
            let g = h / group;
            let up = &up;
            (0..hd).flat_map(move |j| (0..rank).map(move |r| up[(n_k + g * hd + j, r)]))
        });
        new_tensors.push(f32_tensor(
            name("attn_kv_a_mqa"),
            vec![d as u64, (rank + rd) as u64],
            kv_a.transpose().iter().copied().collect::<Vec<_>>(),
        ));
        new_tensors.push(f32_tensor(
            name("attn_kv_a_norm"),
            vec![rank as u64],
            std::iter::repeat_n(eps.sqrt() / alpha, rank),
        ));
        new_tensors.push(f32_tensor(
            name("attn_k_b"),
            vec![nope as u64, rank as u64, nh as u64],
            k_b.collect::<Vec<_>>(),
        ));
        new_tensors.push(f32_tensor(
            name("attn_v_b"),
            vec![rank as u64, hd as u64, nh as u64],
            v_b.collect::<Vec<_>>(),
        ));
        // The query rows keep the source's type (re-encoded: some rows are scaled).
        let q_vals: Vec<f32> = q_new.transpose().iter().map(|&v| v as f32).collect();
        let q_bytes =
            quant::quantize(q_ty, &q_vals).map_err(|e| SurgeryError::Quant(name("attn_q"), e))?;
        new_tensors.push(TensorData {
            name: name("attn_q"),
            dims: vec![d as u64, (nh * hd) as u64],
            ty: q_ty,
            data: Cow::Owned(q_bytes),
        });
    }
    // Replace the per-head projections with the latent ones, in layer order.
    let drop = |n: &str| {
        n.ends_with(".attn_q.weight")
            || n.ends_with(".attn_k.weight")
            || n.ends_with(".attn_v.weight")
    };
    let mut out = Vec::with_capacity(w.tensors.len() + new_tensors.len());
    let mut fresh = new_tensors.into_iter().peekable();
    for t in std::mem::take(&mut w.tensors) {
        if t.name.ends_with(".attn_output.weight") {
            let prefix = t.name.trim_end_matches("attn_output.weight").to_string();
            while let Some(n) = fresh.next_if(|n| n.name.starts_with(&prefix)) {
                out.push(n);
            }
        }
        if !drop(&t.name) {
            out.push(t);
        }
    }
    out.extend(fresh);
    w.tensors = out;
    // Metadata: the llama keys under deepseek2, then what MLA adds.
    let arch = c.arch.clone();
    w.metadata = w
        .metadata
        .drain(..)
        .map(|(k, v)| match k.strip_prefix(&format!("{arch}.")) {
            Some(rest) => (format!("deepseek2.{rest}"), v),
            None => (k, v),
        })
        .collect();
    let u32v = |v: usize| Value::U32(v as u32);
    w.set("general.architecture", Value::String("deepseek2".into()));
    for (k, v) in [
        ("attention.head_count_kv", u32v(1)),
        ("attention.kv_lora_rank", u32v(rank)),
        ("attention.q_lora_rank", u32v(0)),
        ("attention.key_length", u32v(rank + rd)),
        ("attention.value_length", u32v(rank)),
        ("attention.key_length_mla", u32v(hd)),
        ("attention.value_length_mla", u32v(hd)),
        ("rope.dimension_count", u32v(rd)),
        ("rope.freq_base", Value::F32(rope_base)),
        ("leading_dense_block_count", u32v(c.n_layers)),
        ("expert_feed_forward_length", u32v(c.n_ff)),
        ("expert_shared_count", u32v(0)),
    ] {
        w.set(&format!("deepseek2.{k}"), v);
    }
    let report = MlaReport {
        target,
        rope_stride: stride,
        stride_scores,
        rope_base,
        shared_key_energy,
        latent_energy,
        cache_values_before: 2 * nkv * hd,
        cache_values_after: rank + rd,
        calibration_rows: calib.rows,
    };
    Ok((w, report))
}

/// `[a; b]`, rows of `a` then rows of `b`.
fn stack(a: &DMatrix<f64>, b: &DMatrix<f64>) -> DMatrix<f64> {
    let mut m = DMatrix::zeros(a.nrows() + b.nrows(), a.ncols());
    m.rows_mut(0, a.nrows()).copy_from(a);
    m.rows_mut(a.nrows(), b.nrows()).copy_from(b);
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::{SyntheticSpec, build as build_model};

    /// A synthetic MQA model that rotates only the first half of each head: MLA can represent
    /// it exactly (one KV head needs no shared-key approximation, the unrotated dims are already
    /// position-free), so a full-rank conversion must reproduce its logits.
    fn partial_rope_mqa() -> Vec<u8> {
        let src = build_model(&SyntheticSpec {
            n_head: 4,
            n_head_kv: 1,
            n_embd: 64,
            ..Default::default()
        });
        let f = GgufFile::from_bytes(src).unwrap();
        let mut w = GgufWriter::from_file(&f);
        w.set("llama.rope.dimension_count", Value::U32(8));
        w.to_bytes().unwrap()
    }

    fn logits(bytes: Vec<u8>, tokens: &[u32]) -> Vec<f32> {
        let m = Model::from_file(GgufFile::from_bytes(bytes).unwrap()).unwrap();
        let mut kv = m.new_seq_cache(64, &KvOptions::default()).unwrap();
        m.forward(tokens, &mut kv, &mut Scratch::default(), Logits::All)
            .unwrap()
            .to_vec()
    }

    #[test]
    fn a_full_rank_conversion_of_a_representable_model_is_exact() {
        let src = partial_rope_mqa();
        let tokens: Vec<u32> = b"Multi-head latent attention!"
            .iter()
            .map(|&b| u32::from(b))
            .collect();
        let model = Model::from_file(GgufFile::from_bytes(src.clone()).unwrap()).unwrap();
        let calib = calibrate(&model, &tokens, 16).unwrap();
        let f = GgufFile::from_bytes(src.clone()).unwrap();
        let c = Config::from_gguf(&f).unwrap();
        let full = lossless_rank(&c, 8);
        assert_eq!(full, 8 + 16);
        let want = logits(src.clone(), &tokens);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for factorization in [Factorization::Svd, Factorization::Activations] {
            let target = MlaTarget {
                rank: full,
                rope_dims: 8,
                factorization,
            };
            // The public entry refuses a rank that saves nothing...
            assert!(convert_to_mla(&f, &calib, target).is_err());
            // ...which is exactly the rank that must be lossless.
            let (w, r) = build(&f, &c, &calib, target).unwrap();
            assert_eq!(r.rope_stride, 1);
            assert!(r.shared_key_energy.iter().all(|&e| (e - 1.0).abs() < 1e-9));
            assert!(r.latent_energy.iter().all(|&e| e > 1.0 - 1e-9), "{r:?}");
            let got = logits(w.to_bytes().unwrap(), &tokens);
            let err = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale;
            // f64 factorizations stored as f32, and RMSNorm at 1e-4 of its epsilon: ~1e-5.
            assert!(err < 1e-3, "{factorization}: {err}");
        }
        // A smaller rank is an approximation, and the report says how much it keeps.
        let target = MlaTarget {
            rank: 12,
            rope_dims: 8,
            factorization: Factorization::Activations,
        };
        let (w, r) = convert_to_mla(&f, &calib, target).unwrap();
        assert!(r.latent_energy.iter().all(|&e| e < 1.0 && e > 0.3), "{r:?}");
        let cfg = Config::from_gguf(&GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).unwrap();
        assert_eq!(cfg.mla.map(|m| m.row_dim()), Some(12 + 8));
    }

    #[test]
    fn bad_targets_are_refused_with_the_reason() {
        let src = partial_rope_mqa();
        let model = Model::from_file(GgufFile::from_bytes(src.clone()).unwrap()).unwrap();
        let calib = calibrate(&model, &[1, 2, 3, 4], 4).unwrap();
        let f = GgufFile::from_bytes(src).unwrap();
        let t = |rank, rope_dims| MlaTarget {
            rank,
            rope_dims,
            factorization: Factorization::Svd,
        };
        let e = |r, d| {
            convert_to_mla(&f, &calib, t(r, d))
                .err()
                .unwrap()
                .to_string()
        };
        assert!(e(24, 8).contains("below 24"), "{}", e(24, 8));
        assert!(e(0, 8).contains("below"));
        assert!(e(8, 3).contains("even"));
        assert!(e(8, 16).contains("at most the 8"));
    }
}
