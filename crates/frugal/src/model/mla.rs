//! Multi-head latent attention's own operations (DeepSeek-V2, arXiv 2405.04434, section 2.1).
//!
//! A token caches `[c | k_pe]`: the RMS-normed latent `c` (`kv_lora_rank` values) and the
//! rotated key `k_pe` (`rope_dim`) that every head shares. Head `h` attends with the key
//! `[W_uk_h c | k_pe]` and the value `W_uv_h c`. Two ways compute the same scores:
//!
//! - **absorbed** (decode): `q_nope . (W_uk_h c) = (W_uk_h^T q_nope) . c`, so each query head is
//!   taken into latent space once (`k_b[h] = W_uk_h^T`) and attention runs as MQA over the
//!   cached rows themselves (one KV "head" of `kv_lora_rank + rope_dim`), values included: the
//!   attended row's latent part, times `v_b[h] = W_uv_h`, is the head's output. Nothing per
//!   head is ever built for past tokens, which is why the cache can stay compressed.
//! - **decompressed** (prefill may prefer it): every cached row's per-head keys and values are
//!   rebuilt and ordinary MHA runs over them; cheaper per score when many queries share the
//!   rebuilt keys, and the check that absorption is only a reordering of the same sums.
//!
//! The attention kernels scale scores by `1/sqrt(head_dim)` of the rows they see; MLA's scale is
//! `1/sqrt(nope_dim + rope_dim)` (llama.cpp's `key_length_mla`), so absorbed queries are
//! pre-multiplied by the ratio of the two.

use super::Model;
use super::config::Mla;
use super::forward::{AttnSpaces, add_bias, attend_segments};
use super::weights::{KvProjection, LayerWeights};
use crate::attention::{Attention, AttnShape, AttnWorkspace, attend};
use crate::kv::{KvBatch, KvView};
use crate::ops::{RopeTable, dot, rms_norm_prefix, sized};
use crate::quant::{Matrix, ProductInput};

/// Which of the two equivalent computations a pass uses for latent attention.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LatentPath {
    /// Queries taken into the latent space; attention over the cached rows (what decode needs).
    #[default]
    Absorbed,
    /// Per-head keys and values rebuilt from the cached rows; plain MHA over them.
    Decompressed,
}

impl std::str::FromStr for LatentPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "absorbed" => Ok(LatentPath::Absorbed),
            "decompressed" => Ok(LatentPath::Decompressed),
            _ => Err(format!(
                "unknown latent attention path {s:?} (expected absorbed or decompressed)"
            )),
        }
    }
}

impl std::fmt::Display for LatentPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LatentPath::Absorbed => "absorbed",
            LatentPath::Decompressed => "decompressed",
        })
    }
}

/// `y = M x` for a row-major `M` of `x.len()` columns.
fn matvec(m: &[f32], x: &[f32], y: &mut [f32]) {
    for (yv, row) in y.iter_mut().zip(m.chunks_exact(x.len())) {
        *yv = dot(row, x);
    }
}

/// `y = M^T x` for a row-major `M` of `y.len()` columns (`x.len()` rows).
fn matvec_t(m: &[f32], x: &[f32], y: &mut [f32]) {
    y.fill(0.0);
    for (&xv, row) in x.iter().zip(m.chunks_exact(y.len())) {
        for (yv, &a) in y.iter_mut().zip(row) {
            *yv += xv * a;
        }
    }
}

/// Absorbed queries: for each of the `q.len() / (n_head * head_dim)` tokens and each head,
/// `qa = [k_b[h] q_nope | q_pe] * sqrt(row / head_dim)` (`row = kv_lora_rank + rope_dim`).
pub(super) fn absorb_queries(m: &Mla, n_head: usize, k_b: &[f32], q: &[f32], qa: &mut [f32]) {
    let (rank, nope) = (m.kv_lora_rank, m.nope_dim);
    let (hd, row) = (nope + m.rope_dim, m.row_dim());
    let scale = (row as f32 / hd as f32).sqrt();
    for (qt, at) in q
        .chunks_exact(n_head * hd)
        .zip(qa.chunks_exact_mut(n_head * row))
    {
        for h in 0..n_head {
            let (qh, ah) = (&qt[h * hd..(h + 1) * hd], &mut at[h * row..(h + 1) * row]);
            matvec(
                &k_b[h * rank * nope..(h + 1) * rank * nope],
                &qh[..nope],
                &mut ah[..rank],
            );
            ah[rank..].copy_from_slice(&qh[nope..]);
            ah.iter_mut().for_each(|x| *x *= scale);
        }
    }
}

/// Head outputs from attended rows: `att[t][h] = v_b[h] lo[t][h][..kv_lora_rank]`.
pub(super) fn expand_values(m: &Mla, n_head: usize, v_b: &[f32], lo: &[f32], att: &mut [f32]) {
    let (rank, vd, row) = (m.kv_lora_rank, m.v_dim, m.row_dim());
    for (lt, at) in lo
        .chunks_exact(n_head * row)
        .zip(att.chunks_exact_mut(n_head * vd))
    {
        for h in 0..n_head {
            matvec(
                &v_b[h * vd * rank..(h + 1) * vd * rank],
                &lt[h * row..h * row + rank],
                &mut at[h * vd..(h + 1) * vd],
            );
        }
    }
}

/// Rebuilds per-head keys `[W_uk_h c | k_pe]` and values `W_uv_h c` (zero-padded to the key
/// width, so one head width serves both) for every cached row `[c | k_pe]` of `rows`.
pub(super) fn decompress(
    m: &Mla,
    n_head: usize,
    k_b: &[f32],
    v_b: &[f32],
    rows: &[f32],
    k: &mut [f32],
    v: &mut [f32],
) {
    let (rank, nope, vd, row) = (m.kv_lora_rank, m.nope_dim, m.v_dim, m.row_dim());
    let hd = nope + m.rope_dim;
    for ((r, kt), vt) in rows
        .chunks_exact(row)
        .zip(k.chunks_exact_mut(n_head * hd))
        .zip(v.chunks_exact_mut(n_head * hd))
    {
        let (c, pe) = r.split_at(rank);
        for h in 0..n_head {
            let kh = &mut kt[h * hd..(h + 1) * hd];
            matvec_t(
                &k_b[h * rank * nope..(h + 1) * rank * nope],
                c,
                &mut kh[..nope],
            );
            kh[nope..].copy_from_slice(pe);
            let vh = &mut vt[h * hd..(h + 1) * hd];
            matvec(&v_b[h * vd * rank..(h + 1) * vd * rank], c, &mut vh[..vd]);
            vh[vd..].fill(0.0);
        }
    }
}

/// Buffers of the decompressed path, reused across passes: one sequence's cached rows, their
/// per-head keys and values, and every row's attention output.
#[derive(Default, Debug)]
pub(super) struct DecompressBufs {
    rows: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    out: Vec<f32>,
}

/// The decompressed path for every segment of a pass (`(kv, layer, segs)`: the batch's caches,
/// the layer, and each segment's first position, first row and rows): its cached rows' per-head
/// keys and values rebuilt, plain MHA over them (`q` is `n x n_head x head_dim`), each head's
/// value dims kept in `att` (`n x n_head x v_dim`).
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_decompressed(
    m: &Mla,
    n_head: usize,
    kind: Attention,
    (k_b, v_b): (&[f32], &[f32]),
    q: &[f32],
    (kv, layer, segs): (&dyn KvBatch, usize, &[(usize, usize, usize)]),
    bufs: &mut DecompressBufs,
    ws: &mut AttnWorkspace,
    att: &mut [f32],
) {
    let (hd, row) = (m.nope_dim + m.rope_dim, m.row_dim());
    let q_dim = n_head * hd;
    let mha = AttnShape {
        n_head,
        n_head_kv: n_head,
        head_dim: hd,
        window: None,
    };
    let out = sized(&mut bufs.out, q.len());
    for (i, &(pos0, r0, len)) in segs.iter().enumerate() {
        let (kl, _) = kv.layer(i, layer);
        let total = kl.len();
        let rows = sized(&mut bufs.rows, total * row);
        kl.decode_head(0, row, 0, total, rows);
        let kf = sized(&mut bufs.k, total * q_dim);
        let vf = sized(&mut bufs.v, total * q_dim);
        decompress(m, n_head, k_b, v_b, rows, kf, vf);
        attend(
            kind,
            mha,
            &q[r0 * q_dim..(r0 + len) * q_dim],
            KvView::from_f32(kf, q_dim),
            KvView::from_f32(vf, q_dim),
            pos0,
            &mut out[r0 * q_dim..(r0 + len) * q_dim],
            ws,
        );
    }
    for (o, a) in out.chunks_exact(hd).zip(att.chunks_exact_mut(m.v_dim)) {
        a.copy_from_slice(&o[..m.v_dim]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Absorption is a reordering of the same sums: the absorbed score of a query against a
    /// row equals the decompressed one.
    #[test]
    fn absorbed_scores_equal_decompressed_scores() {
        let m = Mla {
            kv_lora_rank: 6,
            nope_dim: 4,
            rope_dim: 2,
            v_dim: 3,
        };
        let n_head = 2;
        let f = |i: usize, s: f32| (i as f32 * 0.37 + s).sin() * 0.9;
        let k_b: Vec<f32> = (0..n_head * 6 * 4).map(|i| f(i, 0.1)).collect();
        let v_b: Vec<f32> = (0..n_head * 3 * 6).map(|i| f(i, 0.7)).collect();
        let q: Vec<f32> = (0..n_head * 6).map(|i| f(i, 1.3)).collect();
        let row: Vec<f32> = (0..8).map(|i| f(i, 2.1)).collect();
        let mut qa = vec![0f32; n_head * 8];
        absorb_queries(&m, n_head, &k_b, &q, &mut qa);
        let (mut k, mut v) = (vec![0f32; n_head * 6], vec![0f32; n_head * 6]);
        decompress(&m, n_head, &k_b, &v_b, &row, &mut k, &mut v);
        let scale = (8.0f32 / 6.0).sqrt();
        for h in 0..n_head {
            let absorbed: f32 = (0..8).map(|i| qa[h * 8 + i] * row[i]).sum::<f32>() / scale;
            let plain: f32 = (0..6).map(|i| q[h * 6 + i] * k[h * 6 + i]).sum();
            assert!((absorbed - plain).abs() < 1e-5, "{absorbed} vs {plain}");
        }
        // Values: expanding an attended row gives the decompressed value.
        let lo: Vec<f32> = (0..n_head).flat_map(|_| row.clone()).collect();
        let mut att = vec![0f32; n_head * 3];
        expand_values(&m, n_head, &v_b, &lo, &mut att);
        for h in 0..n_head {
            for j in 0..3 {
                assert!((att[h * 3 + j] - v[h * 6 + j]).abs() < 1e-5);
            }
            assert_eq!(&v[h * 6 + 3..h * 6 + 6], &[0.0; 3]);
        }
    }
}

/// Latent attention's buffers within a pass: the cached rows of the new tokens, the absorbed
/// queries and attended rows (`n x n_head x row`), and the decompressed path's.
#[derive(Default, Debug)]
pub(super) struct LatentBufs {
    rows: Vec<f32>,
    q: Vec<f32>,
    out: Vec<f32>,
    dec: DecompressBufs,
}

/// Where latent attention runs: the cache's layer, the pass's RoPE angles and segments, and
/// which attention kernel and which of the two computations it uses.
pub(super) struct At<'a> {
    pub layer: usize,
    pub rope: &'a RopeTable,
    pub segs: &'a [(usize, usize, usize)],
    pub kind: Attention,
    pub path: LatentPath,
}

impl Model {
    /// One layer's latent attention over the rows of `x`: the queries (into `q`) and the
    /// cached row `[RMSNorm(latent) | RoPE(k_pe)]` of each new token, appended to the cache,
    /// then attention by `at.path`, each head's values into `att`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn latent_attention(
        &self,
        lw: &LayerWeights,
        at: At,
        x: &mut ProductInput,
        q: &mut [f32],
        kv: &mut dyn KvBatch,
        bufs: &mut LatentBufs,
        spaces: &mut AttnSpaces,
        att: &mut [f32],
    ) {
        let c = &self.config;
        let KvProjection::Latent {
            kv_a,
            kv_a_norm,
            k_b,
            v_b,
        } = &lw.kv
        else {
            unreachable!("latent attention runs on a latent layer");
        };
        let m = c.mla.expect("latent weights come with an MLA config");
        let (n, rank, row) = (x.rows(), m.kv_lora_rank, m.row_dim());
        let lat = sized(&mut bufs.rows, n * row);
        Matrix::apply_many([&lw.wq, kv_a], x, [&mut *q, &mut *lat]);
        add_bias(q, lw.biases.q.as_deref());
        rms_norm_prefix(lat, row, kv_a_norm, c.rms_eps);
        at.rope.apply_at(q, c.n_head, c.head_dim, m.nope_dim);
        at.rope.apply_at(lat, 1, row, rank);
        for (i, &(_, r0, len)) in at.segs.iter().enumerate() {
            kv.append(i, at.layer, &lat[r0 * row..(r0 + len) * row], &[]);
        }
        match at.path {
            LatentPath::Absorbed => {
                let qa = sized(&mut bufs.q, n * c.n_head * row);
                absorb_queries(&m, c.n_head, k_b, q, qa);
                let lo = sized(&mut bufs.out, n * c.n_head * row);
                let mqa = AttnShape {
                    n_head: c.n_head,
                    n_head_kv: 1,
                    head_dim: row,
                    window: None,
                };
                attend_segments(at.kind, mqa, qa, &*kv, at.layer, at.segs, lo, spaces);
                expand_values(&m, c.n_head, v_b, lo, att);
            }
            LatentPath::Decompressed => attend_decompressed(
                &m,
                c.n_head,
                at.kind,
                (k_b, v_b),
                q,
                (&*kv, at.layer, at.segs),
                &mut bufs.dec,
                spaces.one(),
                att,
            ),
        }
    }
}
