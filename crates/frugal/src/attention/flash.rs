//! Flash attention: exact attention in tiles, with an online softmax.
//!
//! For a block of query rows and a tile of keys, the scores `s = q k^T` are computed for the tile
//! only. Each row keeps its running maximum `m` and running sum `l = sum exp(s - m)`, and an
//! unnormalized output `acc = sum exp(s - m) v`. When a tile raises the maximum to `m'`, the
//! old sum and output are rescaled by `exp(m - m')`: afterwards they are exactly what they would
//! have been had `m'` been used from the start. After the last tile, `out = acc / l`. So the
//! softmax never needs the whole score row, and memory beyond the output is one tile of keys,
//! values and scores per thread, whatever the sequence length.
//!
//! Loop order (FlashAttention-2): the outer, parallel loop is over (KV head, query block); each
//! task streams the key/value tiles once for all its query rows, including the `group` query
//! heads that share the KV head under GQA, so a decoded tile is reused by every row of the block.
//! Tiles entirely above the causal diagonal are never loaded.
//!
//! Decode (a few query rows) over a long context has too few (KV head, query block) tasks to
//! keep the threads busy, so the key range is split instead (flash-decoding): each split
//! produces `(m, l, acc)` for its keys, and the splits merge exactly by rescaling each to the
//! common maximum: `l = sum_i l_i exp(m_i - M)`, `acc = sum_i acc_i exp(m_i - M)`.
//!
//! The inner loops are written so the compiler vectorizes them (scores are computed against a
//! transposed key tile: no horizontal sums); on x86-64 the same code is also compiled for
//! AVX2+FMA and picked at run time. The portable build of the same source is the scalar twin.

use std::cell::RefCell;

use rayon::prelude::*;

use super::{AttnShape, AttnWorkspace, OutPtr};
use crate::kv::KvView;

/// One K tile plus one V tile (f32) fit in this much L1.
const KV_TILE_BYTES: usize = 32 * 1024;
/// Query rows (tokens x heads sharing a KV head) of a block: their queries and accumulators
/// (`rows x head_dim x 8` bytes) fit in this much L2.
const Q_BLOCK_BYTES: usize = 128 * 1024;
/// A split of the key range shorter than this is not worth a task of its own.
const MIN_SPLIT_KEYS: usize = 256;

/// Keys per tile: 64 for head_dim 64, 32 for head_dim 128.
pub fn key_tile(head_dim: usize) -> usize {
    (KV_TILE_BYTES / (8 * head_dim.max(1))).clamp(8, 256)
}

/// Query tokens per block for heads of `head_dim` with `group` query heads per KV head.
pub fn query_block(head_dim: usize, group: usize) -> usize {
    (Q_BLOCK_BYTES / (8 * head_dim.max(1)) / group.max(1)).clamp(1, 64)
}

/// Per-thread tiles, reused across calls (bounded by the tile sizes, not the sequence).
#[derive(Default)]
struct Tiles {
    q: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    kraw: Vec<f32>,
    kt: Vec<f32>,
    vt: Vec<f32>,
    s: Vec<f32>,
    pv: Vec<f32>,
}

thread_local! {
    static TILES: RefCell<Tiles> = RefCell::new(Tiles::default());
}

#[derive(Copy, Clone)]
struct Job<'a> {
    s: AttnShape,
    q: &'a [f32],
    k: KvView<'a>,
    v: KvView<'a>,
    pos0: usize,
    bc: usize,
    scale: f32,
    simd: bool,
}

/// Query tokens `t0..t1` of the heads of KV head `kvh` against keys `lo..hi`.
#[derive(Copy, Clone)]
struct Span {
    kvh: usize,
    t0: usize,
    t1: usize,
    lo: usize,
    hi: usize,
}

/// Flash attention; see [`super::attend`] for the argument layout.
pub fn flash(
    s: AttnShape,
    q: &[f32],
    k: KvView,
    v: KvView,
    pos0: usize,
    out: &mut [f32],
    ws: &mut AttnWorkspace,
) {
    flash_with(s, q, k, v, pos0, out, ws, simd_available());
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `flash` with the instruction set chosen by the caller (tests run both).
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_with(
    s: AttnShape,
    q: &[f32],
    k: KvView,
    v: KvView,
    pos0: usize,
    out: &mut [f32],
    ws: &mut AttnWorkspace,
    simd: bool,
) {
    let hd = s.head_dim;
    let q_dim = s.n_head * hd;
    let n = q.len() / q_dim;
    let len = pos0 + n;
    let group = s.n_head / s.n_head_kv;
    let job = Job {
        s,
        q,
        k,
        v,
        pos0,
        bc: key_tile(hd),
        scale: 1.0 / (hd as f32).sqrt(),
        simd,
    };
    let br = query_block(hd, group);
    let optr = OutPtr(out.as_mut_ptr());

    // Flash-decoding: one query block over a long context is split along the keys.
    let threads = rayon::current_num_threads();
    let nsplit = (2 * threads)
        .div_ceil(s.n_head_kv)
        .min(len / MIN_SPLIT_KEYS);
    if n <= br && nsplit >= 2 {
        let chunk = len.div_ceil(nsplit).next_multiple_of(job.bc);
        let nsplit = len.div_ceil(chunk);
        let rows = n * group;
        let stride = rows * (hd + 2);
        let total = s.n_head_kv * nsplit * stride;
        if ws.partials.len() < total {
            ws.partials.resize(total, 0.0);
        }
        let parts = &mut ws.partials[..total];
        parts
            .par_chunks_mut(stride)
            .enumerate()
            .for_each(|(i, part)| {
                let (kvh, sp) = (i / nsplit, i % nsplit);
                let (acc, ml) = part.split_at_mut(rows * hd);
                let (m, l) = ml.split_at_mut(rows);
                let span = Span {
                    kvh,
                    t0: 0,
                    t1: n,
                    lo: sp * chunk,
                    hi: ((sp + 1) * chunk).min(len),
                };
                TILES.with_borrow_mut(|t| block(&job, span, acc, m, l, t));
            });
        // Merge the splits of each row by log-sum-exp.
        for kvh in 0..s.n_head_kv {
            let part = |sp: usize| &parts[(kvh * nsplit + sp) * stride..][..stride];
            for r in 0..rows {
                let (tok, h) = (r / group, kvh * group + r % group);
                let mmax =
                    (0..nsplit).fold(f32::NEG_INFINITY, |a, sp| a.max(part(sp)[rows * hd + r]));
                // SAFETY: sequential here; row (tok, h) is inside `out`.
                let o = unsafe { optr.row(tok * q_dim + h * hd, hd) };
                o.fill(0.0);
                let mut lsum = 0f32;
                for sp in 0..nsplit {
                    let p = part(sp);
                    let w = (p[rows * hd + r] - mmax).exp();
                    if w == 0.0 {
                        continue;
                    }
                    lsum += w * p[rows * hd + rows + r];
                    for (a, &b) in o.iter_mut().zip(&p[r * hd..(r + 1) * hd]) {
                        *a += w * b;
                    }
                }
                let inv = 1.0 / lsum;
                o.iter_mut().for_each(|a| *a *= inv);
            }
        }
        return;
    }

    // FlashAttention-2: parallel over (KV head, query block), the longest blocks first.
    let nqb = n.div_ceil(br);
    (0..s.n_head_kv * nqb).into_par_iter().for_each(|i| {
        let (qb, kvh) = (nqb - 1 - i / s.n_head_kv, i % s.n_head_kv);
        let (t0, t1) = (qb * br, ((qb + 1) * br).min(n));
        let span = Span {
            kvh,
            t0,
            t1,
            lo: 0,
            hi: len,
        };
        TILES.with_borrow_mut(|t| {
            let rows = (t1 - t0) * group;
            let mut acc = std::mem::take(&mut t.acc);
            let mut m = std::mem::take(&mut t.m);
            let mut l = std::mem::take(&mut t.l);
            grow(&mut acc, rows * hd);
            grow(&mut m, rows);
            grow(&mut l, rows);
            block(&job, span, &mut acc, &mut m, &mut l, t);
            for r in 0..rows {
                let (tok, h) = (t0 + r / group, kvh * group + r % group);
                // SAFETY: (token, head) rows of this block belong to this task alone.
                let o = unsafe { optr.row(tok * q_dim + h * hd, hd) };
                let inv = 1.0 / l[r];
                for (a, &b) in o.iter_mut().zip(&acc[r * hd..(r + 1) * hd]) {
                    *a = b * inv;
                }
            }
            (t.acc, t.m, t.l) = (acc, m, l);
        });
    });
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

fn block(job: &Job, span: Span, acc: &mut [f32], m: &mut [f32], l: &mut [f32], t: &mut Tiles) {
    #[cfg(target_arch = "x86_64")]
    if job.simd {
        // SAFETY: `simd` is only set when the CPU has AVX2 and FMA.
        return unsafe { block_avx2(job, span, acc, m, l, t) };
    }
    block_body(job, span, acc, m, l, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    block_body(job, span, acc, m, l, t)
}

/// Leaves, for each row of `span`, the unnormalized output in `acc` (`rows x head_dim`), the
/// running max in `m` and the running sum in `l` over the visible keys of `span.lo..span.hi`.
#[inline(always)]
fn block_body(job: &Job, span: Span, acc: &mut [f32], m: &mut [f32], l: &mut [f32], t: &mut Tiles) {
    let s = job.s;
    let hd = s.head_dim;
    let group = s.n_head / s.n_head_kv;
    let q_dim = s.n_head * hd;
    let bc = job.bc;
    let rows = (span.t1 - span.t0) * group;
    grow(&mut t.q, rows * hd);
    grow(&mut t.kraw, bc * hd);
    grow(&mut t.kt, bc * hd);
    grow(&mut t.vt, bc * hd);
    grow(&mut t.s, bc);
    grow(&mut t.pv, hd);
    // Queries of the block, pre-scaled by 1/sqrt(d): row r = token (r / group), head (r % group).
    for tok in span.t0..span.t1 {
        for g in 0..group {
            let r = (tok - span.t0) * group + g;
            let h = span.kvh * group + g;
            let src = &job.q[tok * q_dim + h * hd..][..hd];
            for (d, &x) in t.q[r * hd..][..hd].iter_mut().zip(src) {
                *d = x * job.scale;
            }
        }
    }
    acc[..rows * hd].fill(0.0);
    m[..rows].fill(f32::NEG_INFINITY);
    l[..rows].fill(0.0);
    // Keys past the last query of the block are above the diagonal for every row: never read.
    let hi = span.hi.min(job.pos0 + span.t1);
    let mut j0 = span.lo;
    while j0 < hi {
        let nb = (hi - j0).min(bc);
        job.k
            .decode_head(span.kvh, hd, j0, nb, &mut t.kraw[..nb * hd]);
        for j in 0..nb {
            for c in 0..hd {
                t.kt[c * bc + j] = t.kraw[j * hd + c];
            }
        }
        job.v
            .decode_head(span.kvh, hd, j0, nb, &mut t.vt[..nb * hd]);
        for r in 0..rows {
            let visible = job.pos0 + span.t0 + r / group + 1;
            if visible <= j0 {
                continue; // this row's part of the tile is all in the future
            }
            let jn = (visible - j0).min(nb);
            let sr = &mut t.s[..jn];
            scores(&t.q[r * hd..][..hd], &t.kt, bc, sr);
            let tile_max = sr.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
            let m_new = m[r].max(tile_max);
            // exp(-inf) = 0 on the first tile: nothing accumulated yet to rescale.
            let corr = (m[r] - m_new).exp();
            let mut sum = 0f32;
            for x in sr.iter_mut() {
                *x = (*x - m_new).exp();
                sum += *x;
            }
            l[r] = l[r] * corr + sum;
            m[r] = m_new;
            // The tile's p.v is summed on its own, then added: two-level summation keeps the
            // rounding error growing with (tile + tiles) rather than with every key.
            let pv = &mut t.pv[..hd];
            weighted_values(sr, &t.vt, hd, pv);
            let ar = &mut acc[r * hd..][..hd];
            for (a, &b) in ar.iter_mut().zip(pv.iter()) {
                *a = *a * corr + b;
            }
        }
        j0 += nb;
    }
}

/// `s[j] = q . k_j` for the keys of a tile stored transposed (`kt[c * bc + j]`). Eight keys at a
/// time, their sums held in registers across the head dimension; each sum still runs over `c`
/// in order, so the result is the same as the plain loop's.
#[inline(always)]
fn scores(q: &[f32], kt: &[f32], bc: usize, s: &mut [f32]) {
    const W: usize = 8;
    let jn = s.len();
    let mut j = 0;
    while j + W <= jn {
        let mut a = [0f32; W];
        for (c, &qc) in q.iter().enumerate() {
            let k = &kt[c * bc + j..c * bc + j + W];
            for i in 0..W {
                a[i] += qc * k[i];
            }
        }
        s[j..j + W].copy_from_slice(&a);
        j += W;
    }
    for (jj, x) in s.iter_mut().enumerate().skip(j) {
        *x = 0.0;
        for (c, &qc) in q.iter().enumerate() {
            *x += qc * kt[c * bc + jj];
        }
    }
}

/// `pv = sum_j p[j] * v_j` (`v` row-major, `hd` per key). 32 output values at a time stay in
/// registers across the keys; each still sums over `j` in order, as the plain loop does.
#[inline(always)]
fn weighted_values(p: &[f32], v: &[f32], hd: usize, pv: &mut [f32]) {
    const W: usize = 32;
    let mut d0 = 0;
    while d0 + W <= hd {
        let mut a = [0f32; W];
        for (j, &pj) in p.iter().enumerate() {
            let vj = &v[j * hd + d0..j * hd + d0 + W];
            for i in 0..W {
                a[i] += pj * vj[i];
            }
        }
        pv[d0..d0 + W].copy_from_slice(&a);
        d0 += W;
    }
    if d0 < hd {
        pv[d0..].fill(0.0);
        for (j, &pj) in p.iter().enumerate() {
            for (a, &b) in pv[d0..].iter_mut().zip(&v[j * hd + d0..(j + 1) * hd]) {
                *a += pj * b;
            }
        }
    }
}
