//! Every operation of the Llama forward pass, each as a forward and a hand-written backward.
//!
//! Layout: activations are row-major `rows x width` with one row per token; a batch is `B`
//! sequences of `T` tokens, row `b*T + t`. Backward functions take the forward's inputs (or
//! what it saved) and the gradient of its output, and *add* into parameter gradients, so
//! gradient accumulation across micro-batches is free. Reductions over rows (a norm's weight
//! gradient) are summed in fixed chunks in a fixed order: results do not depend on the number
//! of threads.

use rayon::prelude::*;

use crate::gemm::{MatRef, Precision, matmul};
use crate::math::{exp_fast, sigmoid};

/// Rows per task in row-parallel loops, and per partial sum in reductions (fixed, so that
/// reductions are deterministic).
const ROW_CHUNK: usize = 64;

/// `y (n x out) = x (n x in) . W^T`, with `W` stored `out x in` as in GGUF.
pub fn linear_forward(x: &[f32], w: &[f32], n_in: usize, y: &mut [f32], prec: Precision) {
    let n_out = w.len() / n_in;
    let n = x.len() / n_in;
    matmul(
        MatRef::new(x, n, n_in),
        MatRef::new(w, n_out, n_in).t(),
        y,
        false,
        prec,
    );
}

/// Backward of [`linear_forward`]: `dx (+)= dy . W` and `dW += dy^T . x`. `dx` is skipped when
/// `None` (the input needs no gradient).
pub fn linear_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx: Option<(&mut [f32], bool)>,
    dw: Option<&mut [f32]>,
    n_in: usize,
    prec: Precision,
) {
    let n_out = w.len() / n_in;
    let n = x.len() / n_in;
    if let Some((dx, accumulate)) = dx {
        matmul(
            MatRef::new(dy, n, n_out),
            MatRef::new(w, n_out, n_in),
            dx,
            accumulate,
            prec,
        );
    }
    if let Some(dw) = dw {
        matmul(
            MatRef::new(dy, n, n_out).t(),
            MatRef::new(x, n, n_in),
            dw,
            true,
            prec,
        );
    }
}

/// Token embedding: row `i` of `x` is row `tokens[i]` of the table.
pub fn embedding_forward(table: &[f32], tokens: &[u32], d: usize, x: &mut [f32]) {
    for (row, &t) in x.chunks_exact_mut(d).zip(tokens) {
        let t = t as usize;
        row.copy_from_slice(&table[t * d..(t + 1) * d]);
    }
}

/// Backward of [`embedding_forward`]: scatters each row's gradient into its token's row.
pub fn embedding_backward(dtable: &mut [f32], tokens: &[u32], d: usize, dx: &[f32]) {
    for (row, &t) in dx.chunks_exact(d).zip(tokens) {
        let t = t as usize;
        for (g, &v) in dtable[t * d..(t + 1) * d].iter_mut().zip(row) {
            *g += v;
        }
    }
}

/// RMSNorm `y = x / sqrt(mean(x²) + eps) * w` per row; saves each row's reciprocal RMS. The mean
/// of squares is accumulated in f64, as the inference engine (and ggml) does.
pub fn rmsnorm_forward(x: &[f32], w: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]) {
    let d = w.len();
    y.par_chunks_mut(d * ROW_CHUNK)
        .zip(x.par_chunks(d * ROW_CHUNK))
        .zip(rstd.par_chunks_mut(ROW_CHUNK))
        .for_each(|((yc, xc), rc)| {
            for ((yr, xr), r) in yc.chunks_exact_mut(d).zip(xc.chunks_exact(d)).zip(rc) {
                let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
                *r = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
                for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                    *o = v * *r * g;
                }
            }
        });
}

/// Backward of [`rmsnorm_forward`]: `dx += r (dy⊙w) - x r³/d Σ(dy⊙w⊙x)`, `dw += Σ_rows dy⊙x r`.
pub fn rmsnorm_backward(
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let d = w.len();
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(d * ROW_CHUNK)
        .zip(x.par_chunks(d * ROW_CHUNK))
        .zip(dy.par_chunks(d * ROW_CHUNK))
        .zip(rstd.par_chunks(ROW_CHUNK))
        .map(|(((dxc, xc), dyc), rc)| {
            let mut dwp = vec![0f32; d];
            for (((dxr, xr), dyr), &r) in dxc
                .chunks_exact_mut(d)
                .zip(xc.chunks_exact(d))
                .zip(dyc.chunks_exact(d))
                .zip(rc)
            {
                let mut dot = 0f32;
                for i in 0..d {
                    dot += dyr[i] * w[i] * xr[i];
                    dwp[i] += dyr[i] * xr[i] * r;
                }
                let c = dot * r * r * r / d as f32;
                for i in 0..d {
                    dxr[i] += r * dyr[i] * w[i] - xr[i] * c;
                }
            }
            dwp
        })
        .collect();
    for p in partials {
        for (g, v) in dw.iter_mut().zip(p) {
            *g += v;
        }
    }
}

/// Rotary embedding tables for positions `0..n`: `cos`/`sin` of `pos * base^(-2i/rope_dim)`,
/// computed in f64 as the inference engine does.
#[derive(Clone, Debug, Default)]
pub struct Rope {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half: usize,
}

impl Rope {
    pub fn new(n: usize, rope_dim: usize, base: f32) -> Self {
        let half = rope_dim / 2;
        let mut r = Rope {
            cos: Vec::with_capacity(n * half),
            sin: Vec::with_capacity(n * half),
            half,
        };
        for p in 0..n {
            for i in 0..half {
                let inv_freq = f64::from(base).powf(-2.0 * i as f64 / rope_dim as f64);
                let theta = p as f64 * inv_freq;
                r.cos.push(theta.cos() as f32);
                r.sin.push(theta.sin() as f32);
            }
        }
        r
    }

    pub fn positions(&self) -> usize {
        self.cos.len().checked_div(self.half).unwrap_or(0)
    }
}

/// Rotates adjacent pairs `(2i, 2i+1)` of the first `rope_dim` dims of every head by the angle
/// of the row's position (`row % seq`), or by minus that angle (`inverse`: the backward, since
/// a rotation's transpose is its inverse).
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    seq: usize,
    table: &Rope,
    inverse: bool,
) {
    let width = n_heads * head_dim;
    let h = table.half;
    let sign = if inverse { -1.0 } else { 1.0 };
    x.par_chunks_mut(width * ROW_CHUNK)
        .enumerate()
        .for_each(|(c, xc)| {
            for (i, row) in xc.chunks_exact_mut(width).enumerate() {
                let pos = (c * ROW_CHUNK + i) % seq;
                let cos = &table.cos[pos * h..(pos + 1) * h];
                let sin = &table.sin[pos * h..(pos + 1) * h];
                for head in row.chunks_exact_mut(head_dim) {
                    for j in 0..h {
                        let (a, b) = (head[2 * j], head[2 * j + 1]);
                        let s = sign * sin[j];
                        head[2 * j] = a * cos[j] - b * s;
                        head[2 * j + 1] = a * s + b * cos[j];
                    }
                }
            }
        });
}

/// SwiGLU `h = silu(g) * u`.
pub fn swiglu_forward(g: &[f32], u: &[f32], h: &mut [f32]) {
    h.par_chunks_mut(4096)
        .zip(g.par_chunks(4096).zip(u.par_chunks(4096)))
        .for_each(|(hc, (gc, uc))| {
            for ((o, &a), &b) in hc.iter_mut().zip(gc).zip(uc) {
                *o = a * sigmoid(a) * b;
            }
        });
}

/// Backward of [`swiglu_forward`]: `dg = dh u σ(g)(1 + g(1-σ(g)))`, `du = dh silu(g)`.
pub fn swiglu_backward(g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
    dg.par_chunks_mut(4096)
        .zip(du.par_chunks_mut(4096))
        .zip(
            g.par_chunks(4096)
                .zip(u.par_chunks(4096))
                .zip(dh.par_chunks(4096)),
        )
        .for_each(|((dgc, duc), ((gc, uc), dhc))| {
            for i in 0..gc.len() {
                let (a, b, d) = (gc[i], uc[i], dhc[i]);
                let s = sigmoid(a);
                dgc[i] = d * b * s * (1.0 + a * (1.0 - s));
                duc[i] = d * a * s;
            }
        });
}

/// The shape of causal grouped-query attention over a batch of `batch` sequences of `seq`.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub batch: usize,
    pub seq: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

impl AttnDims {
    fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }
    fn kv_width(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
    /// Elements of the saved probabilities: `batch x heads x seq x seq`.
    pub fn probs_len(&self) -> usize {
        self.batch * self.n_head * self.seq * self.seq
    }
}

/// A head's (or KV head's) `seq x head_dim` block inside a `rows x width` activation.
fn head_view<'a>(x: &'a [f32], dims: &AttnDims, width: usize, b: usize, h: usize) -> MatRef<'a> {
    let off = b * dims.seq * width + h * dims.head_dim;
    MatRef {
        data: &x[off..],
        rows: dims.seq,
        cols: dims.head_dim,
        rs: width,
        cs: 1,
    }
}

/// Query rows per block of the causal attention: block `[r0, r1)` only meets keys `0..r1`, so
/// the products skip most of the masked upper triangle (56% of the full work at 512 tokens).
/// (Unit tests use blocks of 2, so their short sequences cross several blocks.)
const QUERY_BLOCK: usize = if cfg!(test) { 2 } else { 64 };

/// Causal attention `o = softmax(q k^T / sqrt(hd) + mask) v` per sequence and head; query head
/// `h` reads KV head `h / (n_head / n_head_kv)`. Saves the probabilities (`probs`, zero above
/// the diagonal) for the backward.
pub fn attention_forward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    probs: &mut [f32],
    out: &mut [f32],
    prec: Precision,
) {
    let (t, hd, qw, kw) = (dims.seq, dims.head_dim, dims.q_width(), dims.kv_width());
    let group = dims.n_head / dims.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    let heads: Vec<Vec<f32>> = probs
        .par_chunks_mut(t * t)
        .enumerate()
        .map(|(bh, p)| {
            let (b, h) = (bh / dims.n_head, bh % dims.n_head);
            let qh = head_view(q, &dims, qw, b, h);
            let kh = head_view(k, &dims, kw, b, h / group);
            let vh = head_view(v, &dims, kw, b, h / group);
            let mut o = vec![0f32; t * hd];
            let mut s = vec![0f32; QUERY_BLOCK.min(t) * t];
            for r0 in (0..t).step_by(QUERY_BLOCK) {
                let (r1, nq) = ((r0 + QUERY_BLOCK).min(t), QUERY_BLOCK.min(t - r0));
                let sb = &mut s[..nq * r1];
                matmul(rows_of(qh, r0, nq), rows_of(kh, 0, r1).t(), sb, false, prec);
                for (i, row) in sb.chunks_exact_mut(r1).enumerate() {
                    softmax_causal(&mut row[..=r0 + i], scale);
                    row[r0 + i + 1..].fill(0.0);
                    let pr = &mut p[(r0 + i) * t..(r0 + i + 1) * t];
                    pr[..r1].copy_from_slice(row);
                    pr[r1..].fill(0.0);
                }
                matmul(
                    MatRef::new(sb, nq, r1),
                    rows_of(vh, 0, r1),
                    &mut o[r0 * hd..r1 * hd],
                    false,
                    prec,
                );
            }
            o
        })
        .collect();
    for (bh, o) in heads.iter().enumerate() {
        let (b, h) = (bh / dims.n_head, bh % dims.n_head);
        for (i, r) in o.chunks_exact(hd).enumerate() {
            let off = (b * t + i) * qw + h * hd;
            out[off..off + hd].copy_from_slice(r);
        }
    }
}

/// Rows `r0..r0+n` of a view.
fn rows_of(m: MatRef<'_>, r0: usize, n: usize) -> MatRef<'_> {
    MatRef {
        data: &m.data[r0 * m.rs..],
        rows: n,
        ..m
    }
}

/// `row = softmax(row * scale)` (the row holds the unmasked scores of one query).
fn softmax_causal(row: &mut [f32], scale: f32) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) * scale;
    let mut sum = 0f32;
    for v in row.iter_mut() {
        *v = exp_fast(*v * scale - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// Backward of [`attention_forward`], given its saved `probs` and output `o`: with
/// `dP = dO V^T` and `dS = P ⊙ (dP - rowsum(dO ⊙ O))`, `dQ = dS K / sqrt(hd)`,
/// `dK = dS^T Q / sqrt(hd)`, `dV = P^T dO`, over the same causal blocks as the forward. Tasks
/// run per KV head, so the query heads that share it add into its gradient in a fixed order.
/// Overwrites `dq`, `dk`, `dv`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    probs: &[f32],
    o: &[f32],
    d_o: &[f32],
    dims: AttnDims,
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    prec: Precision,
) {
    let (t, hd, qw, kw) = (dims.seq, dims.head_dim, dims.q_width(), dims.kv_width());
    let group = dims.n_head / dims.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    // One task per (sequence, KV head): returns dQ of its query heads, and its dK, dV.
    let parts: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..dims.batch * dims.n_head_kv)
        .into_par_iter()
        .map(|bg| {
            let (b, g) = (bg / dims.n_head_kv, bg % dims.n_head_kv);
            let kh = head_view(k, &dims, kw, b, g);
            let vh = head_view(v, &dims, kw, b, g);
            let mut dqs = vec![0f32; group * t * hd];
            let mut dkg = vec![0f32; t * hd];
            let mut dvg = vec![0f32; t * hd];
            let mut ds = vec![0f32; QUERY_BLOCK.min(t) * t];
            for (j, dqh) in dqs.chunks_exact_mut(t * hd).enumerate() {
                let h = g * group + j;
                let p = &probs[(b * dims.n_head + h) * t * t..][..t * t];
                let doh = head_view(d_o, &dims, qw, b, h);
                let oh = head_view(o, &dims, qw, b, h);
                let qh = head_view(q, &dims, qw, b, h);
                for r0 in (0..t).step_by(QUERY_BLOCK) {
                    let (r1, nq) = ((r0 + QUERY_BLOCK).min(t), QUERY_BLOCK.min(t - r0));
                    let dsb = &mut ds[..nq * r1];
                    matmul(
                        rows_of(doh, r0, nq),
                        rows_of(vh, 0, r1).t(),
                        dsb,
                        false,
                        prec,
                    );
                    for (i, dsr) in dsb.chunks_exact_mut(r1).enumerate() {
                        let row = r0 + i;
                        let mut dot = 0f32;
                        for c in 0..hd {
                            dot += doh.data[row * qw + c] * oh.data[row * qw + c];
                        }
                        let pr = &p[row * t..row * t + r1];
                        for jj in 0..=row {
                            dsr[jj] = pr[jj] * (dsr[jj] - dot) * scale;
                        }
                        dsr[row + 1..].fill(0.0);
                    }
                    let dsm = MatRef::new(dsb, nq, r1);
                    matmul(
                        dsm,
                        rows_of(kh, 0, r1),
                        &mut dqh[r0 * hd..r1 * hd],
                        false,
                        prec,
                    );
                    matmul(
                        dsm.t(),
                        rows_of(qh, r0, nq),
                        &mut dkg[..r1 * hd],
                        true,
                        prec,
                    );
                    let pb = MatRef {
                        data: &p[r0 * t..],
                        rows: nq,
                        cols: r1,
                        rs: t,
                        cs: 1,
                    };
                    matmul(
                        pb.t(),
                        rows_of(doh, r0, nq),
                        &mut dvg[..r1 * hd],
                        true,
                        prec,
                    );
                }
            }
            (dqs, dkg, dvg)
        })
        .collect();
    for (bg, (dqs, dkg, dvg)) in parts.iter().enumerate() {
        let (b, g) = (bg / dims.n_head_kv, bg % dims.n_head_kv);
        for i in 0..t {
            let row = b * t + i;
            for j in 0..group {
                let h = g * group + j;
                dq[row * qw + h * hd..][..hd].copy_from_slice(&dqs[(j * t + i) * hd..][..hd]);
            }
            dk[row * kw + g * hd..][..hd].copy_from_slice(&dkg[i * hd..][..hd]);
            dv[row * kw + g * hd..][..hd].copy_from_slice(&dvg[i * hd..][..hd]);
        }
    }
}
