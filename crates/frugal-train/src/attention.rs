//! Causal grouped-query attention (optionally in a sliding window) for training: forward (saving the probabilities) and
//! backward, as matrix products over blocks of queries.
//!
//! Work is split per (sequence, KV head): the query heads that share a KV head are stacked
//! into one matrix, so each product reads K and V once for the whole group (3 query heads per
//! KV head in SmolLM2) and the products are 3x taller. Queries go in blocks of
//! [`QUERY_BLOCK`]: block `[r0, r1)` meets only keys `0..r1`, which skips most of the masked
//! upper triangle. Each task writes its own heads' outputs and its KV head's gradients, and the
//! heads of a group add into those in a fixed order: results do not depend on threads.

use rayon::prelude::*;

use crate::gemm::{MatRef, Precision, matmul};
use crate::math::{exp_in_place_sum, max_f32};

/// The shape of causal grouped-query attention over a batch of `batch` sequences of `seq`.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub batch: usize,
    pub seq: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Sliding window: the query at position `p` sees the keys at `p + 1 - window ..= p`
    /// (the inference engine's `AttnShape::window`); `None` for every earlier key.
    pub window: Option<usize>,
    /// The factor on the scores: `1/sqrt(head_dim)`, or a family's own query scale.
    pub scale: f32,
}

impl AttnDims {
    fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }
    fn kv_width(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
    fn group(&self) -> usize {
        self.n_head / self.n_head_kv
    }
    /// Elements of the saved probabilities: `batch x heads x seq x seq`.
    pub fn probs_len(&self) -> usize {
        self.batch * self.n_head * self.seq * self.seq
    }

    /// The first key the query at position `row` sees.
    fn first_key(&self, row: usize) -> usize {
        self.window.map_or(0, |w| (row + 1).saturating_sub(w))
    }
}

/// Query rows per block: 64 at 512 tokens does 56% of the full score matrix's work.
/// (Unit tests use blocks of 2, so their short sequences cross several blocks.)
const QUERY_BLOCK: usize = if cfg!(test) { 2 } else { 64 };

/// Rows `r0..r0+n` of head `h` (columns `h*hd..`) of sequence `b` in a `rows x width` activation.
fn head_rows<'a>(
    x: &'a [f32],
    d: &AttnDims,
    width: usize,
    b: usize,
    h: usize,
    r0: usize,
    n: usize,
) -> MatRef<'a> {
    MatRef {
        data: &x[(b * d.seq + r0) * width + h * d.head_dim..],
        rows: n,
        cols: d.head_dim,
        rs: width,
        cs: 1,
    }
}

/// Copies rows `r0..r0+n` of the group's query heads, stacked head after head, into `out`
/// (`group*n x hd`).
fn stack(x: &[f32], d: &AttnDims, b: usize, g: usize, r0: usize, n: usize, out: &mut [f32]) {
    let (hd, w) = (d.head_dim, d.q_width());
    for j in 0..d.group() {
        let h = g * d.group() + j;
        for i in 0..n {
            let src = &x[(b * d.seq + r0 + i) * w + h * hd..][..hd];
            out[(j * n + i) * hd..][..hd].copy_from_slice(src);
        }
    }
}

/// `row = softmax(row * scale)` (the row holds the unmasked scores of one query).
fn softmax_scaled(row: &mut [f32], scale: f32) {
    let max = max_f32(row) * scale;
    let inv = 1.0 / exp_in_place_sum(row, scale, max);
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// Per (sequence, KV head) task: the group's outputs, stacked `group x seq x hd`.
type GroupOut = Vec<f32>;

/// Causal attention `o = softmax(scale q k^T + mask) v` (the mask hides later keys, and keys
/// before a sliding window); query head `h` reads KV head `h / (n_head / n_head_kv)`. Saves the
/// probabilities (`probs`, `batch x heads x seq x seq`, zero where masked) for the backward.
pub fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d: AttnDims,
    probs: &mut [f32],
    out: &mut [f32],
    prec: Precision,
) {
    let (t, hd, kw, group) = (d.seq, d.head_dim, d.kv_width(), d.group());
    let scale = d.scale;
    let outs: Vec<GroupOut> = probs
        .par_chunks_mut(group * t * t)
        .enumerate()
        .map(|(bg, p)| {
            let (b, g) = (bg / d.n_head_kv, bg % d.n_head_kv);
            let nb = QUERY_BLOCK.min(t);
            let (mut qs, mut s) = (vec![0f32; group * nb * hd], vec![0f32; group * nb * t]);
            let mut os = vec![0f32; group * nb * hd];
            let mut o = vec![0f32; group * t * hd];
            for r0 in (0..t).step_by(QUERY_BLOCK) {
                let (r1, n) = ((r0 + QUERY_BLOCK).min(t), QUERY_BLOCK.min(t - r0));
                stack(q, &d, b, g, r0, n, &mut qs[..group * n * hd]);
                let sb = &mut s[..group * n * r1];
                let (kh, vh) = (
                    head_rows(k, &d, kw, b, g, 0, r1),
                    head_rows(v, &d, kw, b, g, 0, r1),
                );
                matmul(
                    MatRef::new(&qs[..group * n * hd], group * n, hd),
                    kh.t(),
                    sb,
                    false,
                    prec,
                );
                for (ri, row) in sb.chunks_exact_mut(r1).enumerate() {
                    let (j, i) = (ri / n, ri % n);
                    let first = d.first_key(r0 + i);
                    softmax_scaled(&mut row[first..=r0 + i], scale);
                    row[..first].fill(0.0);
                    row[r0 + i + 1..].fill(0.0);
                    let pr = &mut p[(j * t + r0 + i) * t..][..t];
                    pr[..r1].copy_from_slice(row);
                    pr[r1..].fill(0.0);
                }
                let ob = &mut os[..group * n * hd];
                matmul(MatRef::new(sb, group * n, r1), vh, ob, false, prec);
                for j in 0..group {
                    o[(j * t + r0) * hd..(j * t + r1) * hd]
                        .copy_from_slice(&ob[j * n * hd..(j + 1) * n * hd]);
                }
            }
            o
        })
        .collect();
    for (bg, o) in outs.iter().enumerate() {
        let (b, g) = (bg / d.n_head_kv, bg % d.n_head_kv);
        for j in 0..group {
            let h = g * group + j;
            for i in 0..t {
                let off = (b * t + i) * d.q_width() + h * hd;
                out[off..off + hd].copy_from_slice(&o[(j * t + i) * hd..][..hd]);
            }
        }
    }
}

/// Backward of [`attention_forward`], given its saved `probs` and output `o`: with
/// `dP = dO V^T` and `dS = P ⊙ (dP - rowsum(dO ⊙ O))`, `dQ = scale dS K`,
/// `dK = scale dS^T Q`, `dV = P^T dO`, over the same blocks and groups as the forward (masked
/// keys have `P = 0`, so they get no gradient). Overwrites `dq`, `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    o: &[f32],
    d_o: &[f32],
    d: AttnDims,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    prec: Precision,
) {
    let (t, hd, kw, group) = (d.seq, d.head_dim, d.kv_width(), d.group());
    let scale = d.scale;
    // Per task: the group's dQ rows (stacked) and the KV head's dK, dV.
    let parts: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..d.batch * d.n_head_kv)
        .into_par_iter()
        .map(|bg| {
            let (b, g) = (bg / d.n_head_kv, bg % d.n_head_kv);
            let p = &probs[bg * group * t * t..(bg + 1) * group * t * t];
            let nb = QUERY_BLOCK.min(t);
            let mut dqs = vec![0f32; group * t * hd];
            let (mut dkg, mut dvg) = (vec![0f32; t * hd], vec![0f32; t * hd]);
            let (mut qs, mut dos, mut os) = (
                vec![0f32; group * nb * hd],
                vec![0f32; group * nb * hd],
                vec![0f32; group * nb * hd],
            );
            let (mut ds, mut ps) = (vec![0f32; group * nb * t], vec![0f32; group * nb * t]);
            let mut dqb = vec![0f32; group * nb * hd];
            for r0 in (0..t).step_by(QUERY_BLOCK) {
                let (r1, n) = ((r0 + QUERY_BLOCK).min(t), QUERY_BLOCK.min(t - r0));
                let m = group * n;
                stack(q, &d, b, g, r0, n, &mut qs[..m * hd]);
                stack(d_o, &d, b, g, r0, n, &mut dos[..m * hd]);
                stack(o, &d, b, g, r0, n, &mut os[..m * hd]);
                let (kh, vh) = (
                    head_rows(k, &d, kw, b, g, 0, r1),
                    head_rows(v, &d, kw, b, g, 0, r1),
                );
                let dsb = &mut ds[..m * r1];
                let dom = MatRef::new(&dos[..m * hd], m, hd);
                matmul(dom, vh.t(), dsb, false, prec);
                let psb = &mut ps[..m * r1];
                for (ri, (dsr, psr)) in dsb
                    .chunks_exact_mut(r1)
                    .zip(psb.chunks_exact_mut(r1))
                    .enumerate()
                {
                    let (j, i) = (ri / n, ri % n);
                    let row = r0 + i;
                    let dot: f32 = dos[ri * hd..(ri + 1) * hd]
                        .iter()
                        .zip(&os[ri * hd..(ri + 1) * hd])
                        .map(|(a, b)| a * b)
                        .sum();
                    psr.copy_from_slice(&p[(j * t + row) * t..][..r1]);
                    for jj in 0..=row {
                        dsr[jj] = psr[jj] * (dsr[jj] - dot) * scale;
                    }
                    dsr[row + 1..].fill(0.0);
                }
                let dsm = MatRef::new(dsb, m, r1);
                matmul(dsm, kh, &mut dqb[..m * hd], false, prec);
                for j in 0..group {
                    dqs[(j * t + r0) * hd..(j * t + r1) * hd]
                        .copy_from_slice(&dqb[j * n * hd..(j + 1) * n * hd]);
                }
                matmul(
                    dsm.t(),
                    MatRef::new(&qs[..m * hd], m, hd),
                    &mut dkg[..r1 * hd],
                    true,
                    prec,
                );
                matmul(
                    MatRef::new(psb, m, r1).t(),
                    dom,
                    &mut dvg[..r1 * hd],
                    true,
                    prec,
                );
            }
            (dqs, dkg, dvg)
        })
        .collect();
    for (bg, (dqs, dkg, dvg)) in parts.iter().enumerate() {
        let (b, g) = (bg / d.n_head_kv, bg % d.n_head_kv);
        unstack_all(dqs, &d, b, g, dq);
        for i in 0..t {
            let row = b * t + i;
            dk[row * kw + g * hd..][..hd].copy_from_slice(&dkg[i * hd..][..hd]);
            dv[row * kw + g * hd..][..hd].copy_from_slice(&dvg[i * hd..][..hd]);
        }
    }
}

/// Scatters a group's stacked `group x seq x hd` rows into the heads' columns of `x`.
fn unstack_all(rows: &[f32], d: &AttnDims, b: usize, g: usize, x: &mut [f32]) {
    let t = d.seq;
    let hd = d.head_dim;
    for j in 0..d.group() {
        // One head at a time: rows j*t .. (j+1)*t are that head's, as `unstack` with n = t
        // would read them for a group of one.
        let h = g * d.group() + j;
        for i in 0..t {
            x[(b * t + i) * d.q_width() + h * hd..][..hd]
                .copy_from_slice(&rows[(j * t + i) * hd..][..hd]);
        }
    }
}
