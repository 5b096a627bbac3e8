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
//! Tiles entirely above the causal diagonal are never loaded; under a sliding window, neither
//! are the tiles and chunks wholly before the first row's window (a row masks the keys of a
//! tile that fall before its own window by weighing them 0, so its bits do not depend on where
//! the other rows of its block start).
//!
//! Keys are taken in fixed chunks of absolute positions ([`key_chunk`]): each chunk produces
//! `(m, l, acc)` for its keys, and the chunks merge in order by rescaling to the common
//! maximum. Decode (a few query rows) over a long context has too few (KV head, query block)
//! tasks to keep the threads busy, so there the chunks run in parallel (flash-decoding) and are
//! merged afterwards, in the same order with the same arithmetic: a row's output is the same
//! bits whichever path computed it and whatever rows it was computed with.
//!
//! The inner loops are written so the compiler vectorizes them (scores are computed against a
//! transposed key tile: no horizontal sums); on x86-64 the same code is also compiled for
//! AVX2+FMA and picked at run time. The portable build of the same source is the scalar twin.

use std::cell::RefCell;

use rayon::prelude::*;

use super::ahead::Ahead;
use super::q8_keys::{self, KeyRows, QuantQueries};
use super::{AttnShape, AttnWorkspace, OutPtr};
use crate::kv::{KvType, KvView};

/// One K tile plus one V tile (f32) fit in this much L1.
const KV_TILE_BYTES: usize = 32 * 1024;
/// Query rows (tokens x heads sharing a KV head) of a block: their queries and accumulators
/// (`rows x head_dim x 8` bytes) fit in this much L2.
const Q_BLOCK_BYTES: usize = 128 * 1024;
/// Keys per chunk (rounded up to whole tiles), see [`key_chunk`]: long enough that the merge
/// of a chunk costs little next to computing it, short enough that decode over a context of a
/// few hundred tokens already has several chunks to spread across threads.
const MIN_SPLIT_KEYS: usize = 256;

/// The most keys a tile holds ([`key_tile`]'s upper clamp).
pub(super) const MAX_KEY_TILE: usize = 256;

/// Keys per tile: 64 for head_dim 64, 32 for head_dim 128, 16 for MLA's 192-value rows; always
/// a multiple of 8, the width the SIMD kernels transpose and weigh keys in (a tile of 21 keys
/// for 192-wide rows sent every step down the scalar path: 2.2x slower decode, measured).
pub fn key_tile(head_dim: usize) -> usize {
    (KV_TILE_BYTES / (8 * head_dim.max(1)) / 8 * 8).clamp(8, MAX_KEY_TILE)
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
    /// The block's queries quantized, over a Q8_0 key cache.
    qq: QuantQueries,
    /// The next tile's cache lines, requested as this tile's keys are computed.
    ahead: Ahead,
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
    /// With `simd`: the score, exponential and weighted-value loops in AVX-512 (same bits).
    wide: bool,
    /// With `simd`: scores against a Q8_0 key cache by the VNNI kernel (same bits).
    vnni: bool,
    /// Over a Q8_0 key cache: every query row (`token x n_head`), scaled and quantized.
    qq: Option<&'a QuantQueries>,
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
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn wide_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::flash_avx512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::flash_vnni::available()
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
    let scale = 1.0 / (hd as f32).sqrt();
    let AttnWorkspace {
        partials,
        qscaled,
        qq,
    } = ws;
    // A Q8_0 key cache is scored in integers against the queries quantized (see `q8_keys`),
    // once per call rather than once per key chunk.
    let k_q8 = k.ty() == KvType::Q8_0;
    if k_q8 {
        qscaled.clear();
        qscaled.extend(q.iter().map(|&x| x * scale));
        qq.quantize(qscaled, hd);
    }
    let job = Job {
        s,
        q,
        k,
        v,
        pos0,
        bc: key_tile(hd),
        scale,
        simd,
        wide: simd && wide_available(),
        vnni: simd && vnni_available(),
        qq: k_q8.then_some(&*qq),
    };
    let br = query_block(hd, group);
    let chunk = key_chunk(hd);
    let optr = OutPtr(out.as_mut_ptr());
    let nchunks = len.div_ceil(chunk);
    // Under a sliding window, chunks wholly before the first query's window are skipped: no
    // row sees them, and merging a chunk a row does not see changes nothing, so the result is
    // the same bits as computing them.
    let c0 = s.first_visible(pos0) / chunk;

    // Flash-decoding: a few query rows over several key chunks compute the chunks in parallel
    // and merge them in order (the result is the same as the tiled path's, see `key_chunk`).
    if n <= br && nchunks - c0 >= 2 {
        let nchunks = nchunks - c0;
        let rows = n * group;
        let stride = rows * (hd + 2);
        let total = s.n_head_kv * nchunks * stride;
        if partials.len() < total {
            partials.resize(total, 0.0);
        }
        let parts = &mut partials[..total];
        crate::team::for_each_part(parts, stride, |i, part| {
            let (kvh, c) = (i / nchunks, c0 + i % nchunks);
            let (acc, ml) = part.split_at_mut(rows * hd);
            let (m, l) = ml.split_at_mut(rows);
            let span = Span {
                kvh,
                t0: 0,
                t1: n,
                lo: c * chunk,
                hi: ((c + 1) * chunk).min(len),
            };
            TILES.with_borrow_mut(|t| block(&job, span, acc, m, l, t));
        });
        // Merge each row's chunks in order, then normalize.
        let parts = &*parts;
        for kvh in 0..s.n_head_kv {
            let part = |c: usize| &parts[(kvh * nchunks + c) * stride..][..stride];
            for r in 0..rows {
                let (tok, h) = (r / group, kvh * group + r % group);
                // SAFETY: sequential here; row (tok, h) is inside `out`.
                let o = unsafe { optr.row(tok * q_dim + h * hd, hd) };
                let p0 = part(0);
                o.copy_from_slice(&p0[r * hd..(r + 1) * hd]);
                let (mut mr, mut lr) = (p0[rows * hd + r], p0[rows * hd + rows + r]);
                for c in 1..nchunks {
                    let p = part(c);
                    merge_partial(
                        o,
                        &mut mr,
                        &mut lr,
                        &p[r * hd..(r + 1) * hd],
                        p[rows * hd + r],
                        p[rows * hd + rows + r],
                    );
                }
                let inv = 1.0 / lr;
                o.iter_mut().for_each(|a| *a *= inv);
            }
        }
        return;
    }

    // FlashAttention-2: parallel over (KV head, query block), the longest blocks first. Each
    // block runs its key chunks one after another, merging each into the running result.
    let nqb = n.div_ceil(br);
    (0..s.n_head_kv * nqb).into_par_iter().for_each(|i| {
        let (qb, kvh) = (nqb - 1 - i / s.n_head_kv, i % s.n_head_kv);
        let (t0, t1) = (qb * br, ((qb + 1) * br).min(n));
        TILES.with_borrow_mut(|t| {
            let rows = (t1 - t0) * group;
            // Taken out of the tiles so `block` can borrow the rest of them.
            let (mut acc_buf, mut m_buf, mut l_buf) = (
                std::mem::take(&mut t.acc),
                std::mem::take(&mut t.m),
                std::mem::take(&mut t.l),
            );
            grow(&mut acc_buf, 2 * rows * hd);
            grow(&mut m_buf, 2 * rows);
            grow(&mut l_buf, 2 * rows);
            let (acc, acc_c) = acc_buf.split_at_mut(rows * hd);
            let (m, m_c) = m_buf.split_at_mut(rows);
            let (l, l_c) = l_buf.split_at_mut(rows);
            // Keys past the block's last query are never visible to it.
            let hi = len.min(pos0 + t1);
            let first = s.first_visible(pos0 + t0) / chunk;
            let span = |c: usize| Span {
                kvh,
                t0,
                t1,
                lo: c * chunk,
                hi: ((c + 1) * chunk).min(len),
            };
            block(&job, span(first), acc, m, l, t);
            for c in first + 1..hi.div_ceil(chunk) {
                block(&job, span(c), acc_c, m_c, l_c, t);
                for r in 0..rows {
                    let (ar, ac) = (&mut acc[r * hd..(r + 1) * hd], &acc_c[r * hd..(r + 1) * hd]);
                    merge_partial(ar, &mut m[r], &mut l[r], ac, m_c[r], l_c[r]);
                }
            }
            for r in 0..rows {
                let (tok, h) = (t0 + r / group, kvh * group + r % group);
                // SAFETY: (token, head) rows of this block belong to this task alone.
                let o = unsafe { optr.row(tok * q_dim + h * hd, hd) };
                let inv = 1.0 / l[r];
                for (a, &b) in o.iter_mut().zip(&acc[r * hd..(r + 1) * hd]) {
                    *a = b * inv;
                }
            }
            (t.acc, t.m, t.l) = (acc_buf, m_buf, l_buf);
        });
    });
}

/// Keys per chunk: attention runs over fixed chunks of keys at absolute positions
/// (`0..chunk`, `chunk..2*chunk`, ...) and merges each chunk's partial result into the running
/// one in order, whichever path runs. So a query row's output depends only on its own query
/// and keys, never on which other rows share its call, how a prompt was split into calls, or
/// whether decode split the keys across threads: greedy output is the same token for token
/// alone, batched, with chunked prefill or with a prefix from the cache. A multiple of the key
/// tile, so tiles never straddle a chunk.
pub fn key_chunk(head_dim: usize) -> usize {
    MIN_SPLIT_KEYS.next_multiple_of(key_tile(head_dim))
}

/// Merges a chunk's partial result `(acc_c, m_c, l_c)` into the running `(acc, m, l)`: both
/// rescaled to the common maximum. A chunk none of whose keys the row sees (`l_c == 0`)
/// changes nothing.
#[inline]
fn merge_partial(acc: &mut [f32], m: &mut f32, l: &mut f32, acc_c: &[f32], m_c: f32, l_c: f32) {
    if l_c == 0.0 {
        return;
    }
    let mn = m.max(m_c);
    let (a, b) = (exp_approx(*m - mn), exp_approx(m_c - mn));
    *l = *l * a + l_c * b;
    for (x, &y) in acc.iter_mut().zip(acc_c) {
        *x = *x * a + y * b;
    }
    *m = mn;
}

/// The bytes of `v` (what the strided SIMD kernels read, from a decoded tile or the cache).
#[cfg(target_arch = "x86_64")]
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any initialized f32 is 4 initialized bytes, u8 has alignment 1, and the length is
    // the same memory measured in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

fn block(job: &Job, span: Span, acc: &mut [f32], m: &mut [f32], l: &mut [f32], t: &mut Tiles) {
    let rows = (span.t1 - span.t0) * (job.s.n_head / job.s.n_head_kv);
    // Three rows at a time when four would pad the block by more than a tenth: a decode step
    // (or a short verification) of a GQA model whose KV heads serve three query heads each
    // (SmolLM2) would otherwise compute a fourth, empty row beside every three. Measured at
    // depth 4,096 with an f16 cache: +10% decode (median of three same-run A/B pairs). Long
    // blocks keep four, which shares each key and value load more widely.
    if rows.is_multiple_of(3) && 10 * (rows.next_multiple_of(R) - rows) > rows {
        block_rows::<3>(job, span, acc, m, l, t)
    } else {
        block_rows::<R>(job, span, acc, m, l, t)
    }
}

fn block_rows<const RR: usize>(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    #[cfg(target_arch = "x86_64")]
    if job.simd {
        // SAFETY: `simd` is only set when the CPU has AVX2, FMA and F16C.
        return unsafe { block_avx2::<RR>(job, span, acc, m, l, t) };
    }
    block_body::<RR>(job, span, acc, m, l, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_avx2<const R: usize>(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    block_body::<R>(job, span, acc, m, l, t)
}

/// Query rows computed together by default: their scores and outputs share every load of a key
/// or value (three for GQA groups of three; see `block`). Every row's sums run in the same
/// order whatever the count, so the bits do not depend on it.
pub(super) const R: usize = 4;

/// Leaves, for each row of `span`, the unnormalized output in `acc` (`rows x head_dim`), the
/// running max in `m` and the running sum in `l` over the visible keys of `span.lo..span.hi`,
/// `R` query rows at a time.
#[inline(always)]
fn block_body<const R: usize>(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    let s = job.s;
    let hd = s.head_dim;
    let group = s.n_head / s.n_head_kv;
    let q_dim = s.n_head * hd;
    let bc = job.bc;
    let rows = (span.t1 - span.t0) * group;
    // The explicit AVX2 inner loops need whole vectors of keys and head dimensions.
    let fast =
        cfg!(target_arch = "x86_64") && job.simd && bc.is_multiple_of(8) && hd.is_multiple_of(16);
    // Rows are taken R at a time; the last block is padded with zero queries (never stored).
    let padded = rows.next_multiple_of(R);
    grow(&mut t.q, padded * hd);
    grow(&mut t.kraw, bc * hd);
    grow(&mut t.kt, bc * hd);
    grow(&mut t.vt, bc * hd);
    grow(&mut t.s, R * bc);
    grow(&mut t.pv, R * hd);
    // Queries of the block, pre-scaled by 1/sqrt(d): row r = token (r / group), head (r % group);
    // over a Q8_0 key cache, the same rows of the call's quantized queries.
    if let Some(qq) = job.qq {
        t.qq.clear();
        for tok in span.t0..span.t1 {
            let first = tok * s.n_head + span.kvh * group;
            t.qq.extend_from(qq, first..first + group, hd);
        }
        t.qq.pad(padded - rows, hd);
    }
    let k_q8 = job.qq.is_some();
    for tok in (span.t0..span.t1).filter(|_| !k_q8) {
        for g in 0..group {
            let r = (tok - span.t0) * group + g;
            let h = span.kvh * group + g;
            let src = &job.q[tok * q_dim + h * hd..][..hd];
            for (d, &x) in t.q[r * hd..][..hd].iter_mut().zip(src) {
                *d = x * job.scale;
            }
        }
    }
    t.q[rows * hd..padded * hd].fill(0.0);
    // Where each key of a tile lies, for the integer scores (its keys may lie in several runs).
    let mut key_rows = KeyRows::new(KvType::Q8_0.bytes(hd));
    acc[..rows * hd].fill(0.0);
    m[..rows].fill(f32::NEG_INFINITY);
    l[..rows].fill(0.0);
    // Keys past the last query of the block are above the diagonal for every row: never read.
    let hi = span.hi.min(job.pos0 + span.t1);
    // Under a window, tiles wholly before the first row's window are never read either (tiles
    // stay at the same absolute offsets from the chunk start).
    let first = s.first_visible(job.pos0 + span.t0);
    let mut j0 = span.lo + first.saturating_sub(span.lo) / bc * bc;
    // The cache rows of the first tile at once, then each next tile's spread over this one's
    // work (`ahead`). The last tile's plan reaches into the keys after the span: a thread takes
    // a run of consecutive chunks of one KV head (the team claims runs, `crate::team`), so
    // that is most often the first tile of its next chunk, which would otherwise start cold.
    for kv in [&job.k, &job.v] {
        if j0 < kv.len() {
            kv.prefetch_head(span.kvh, hd, j0, (kv.len() - j0).min(bc));
        }
    }
    while j0 < hi {
        let nb = (hi - j0).min(bc);
        t.ahead.plan(&job.k, &job.v, span.kvh, hd, j0 + nb, bc, nb);
        // The cache is read in place on the SIMD path: f32, f16 or bf16 keys transposed
        // straight from it, Q8_0 keys scored in integers where they lie, values of every
        // format weighted where they lie, widened as they are loaded.
        #[cfg(target_arch = "x86_64")]
        let (k_in_place, v_fmt_in_place) =
            (fast && super::flash_x86::reads_in_place(job.k.ty()), fast);
        #[cfg(not(target_arch = "x86_64"))]
        let (k_in_place, v_fmt_in_place) = (false, false);
        // A few rows over keys kept by column: scored straight from the cache, no tile.
        let direct = k_in_place && job.k.columns() && rows <= R && !job.wide;
        if k_q8 {
            key_rows.clear();
            while key_rows.len() < nb {
                let j = key_rows.len();
                let (bytes, stride, m) = job.k.head_run(span.kvh, hd, j0 + j, nb - j);
                key_rows.push_run(bytes, stride, m);
            }
        } else if direct {
            // Keys kept by column are scored where they lie (below), one block at a time.
        } else if k_in_place && job.k.columns() {
            // Keys kept by column: each block's columns widened into the tile's.
            let mut j = 0;
            while j < nb {
                let (bytes, bs, off, m) = job.k.head_block(span.kvh, hd, j0 + j, nb - j);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                unsafe {
                    super::flash_columns::widen_columns(
                        bytes,
                        job.k.ty(),
                        bs,
                        off,
                        m,
                        hd,
                        &mut t.kt,
                        bc,
                        j,
                        &mut t.ahead,
                    )
                };
                j += m;
            }
        } else if k_in_place {
            let mut j = 0;
            while j < nb {
                let (bytes, stride, m) = job.k.head_run(span.kvh, hd, j0 + j, nb - j);
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                unsafe {
                    super::flash_x86::transpose_rows(
                        bytes,
                        stride,
                        job.k.ty(),
                        m,
                        hd,
                        &mut t.kt,
                        bc,
                        j,
                        &mut t.ahead,
                    )
                };
                j += m;
            }
        } else {
            job.k
                .decode_head(span.kvh, hd, j0, nb, &mut t.kraw[..nb * hd]);
            if fast {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                unsafe {
                    super::flash_x86::transpose_rows(
                        f32_bytes(&t.kraw[..nb * hd]),
                        4 * hd,
                        KvType::F32,
                        nb,
                        hd,
                        &mut t.kt,
                        bc,
                        0,
                        &mut t.ahead,
                    )
                };
            } else {
                for j in 0..nb {
                    for c in 0..hd {
                        t.kt[c * bc + j] = t.kraw[j * hd + c];
                    }
                }
            }
        }
        // Values in place only for a few rows (decode): more rows re-read the tile once per
        // R of them, which a decoded tile serves from L1. The bits are the same either way.
        let v_in_place = v_fmt_in_place && rows <= 2 * R;
        if !v_in_place {
            job.v
                .decode_head(span.kvh, hd, j0, nb, &mut t.vt[..nb * hd]);
        }
        for rb in (0..rows).step_by(R) {
            // Visible keys of this tile per row: `js..jn` (causal: up to the row's own
            // position; under a window, from its first visible key). A row that sees none of
            // the tile has `jn == 0`.
            let mut js = [0usize; R];
            let jn: [usize; R] = std::array::from_fn(|i| {
                let pos = job.pos0 + span.t0 + (rb + i) / group;
                js[i] = s.first_visible(pos).saturating_sub(j0).min(nb);
                let end = (pos + 1).saturating_sub(j0).min(nb);
                if rb + i < rows && js[i] < end { end } else { 0 }
            });
            let jmax = jn.iter().copied().max().unwrap_or(0);
            if jmax == 0 {
                continue; // every row's part of the tile is in the future
            }
            let sb = &mut t.s[..R * bc];
            let qb = &t.q[rb * hd..(rb + R) * hd];
            if k_q8 {
                let keys = &key_rows;
                #[cfg(target_arch = "x86_64")]
                {
                    let simd = if job.vnni {
                        Some(super::flash_vnni::scores_q8::<R> as q8_keys::ScoresKernel<R>)
                    } else if fast && hd <= super::flash_q8_avx2::MAX_BLOCKS * crate::kv::Q8_0_BLOCK
                    {
                        Some(super::flash_q8_avx2::scores_q8::<R> as q8_keys::ScoresKernel<R>)
                    } else {
                        None
                    };
                    match simd {
                        // SAFETY: `vnni` is only set when the CPU has what that kernel needs;
                        // `fast` implies AVX2, FMA and F16C.
                        Some(kernel) => unsafe {
                            kernel(&t.qq, rb, hd, keys, jmax, bc, sb, &mut t.ahead)
                        },
                        None => q8_keys::scores::<R>(&t.qq, rb, hd, keys, jmax, bc, sb),
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                q8_keys::scores::<R>(&t.qq, rb, hd, keys, jmax, bc, sb);
            } else if direct {
                let mut j = 0;
                while j < jmax {
                    let (bytes, bs, off, m) = job.k.head_block(span.kvh, hd, j0 + j, jmax - j);
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `direct` implies `fast`: the CPU has AVX2, FMA and F16C.
                    unsafe {
                        super::flash_columns::scores_columns::<R>(
                            qb,
                            bytes,
                            job.k.ty(),
                            bs,
                            off,
                            m,
                            &mut sb[j..],
                            bc,
                            &mut t.ahead,
                        )
                    };
                    j += m;
                }
            } else if fast {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                unsafe {
                    if job.wide {
                        super::flash_avx512::scores::<R>(qb, &t.kt, bc, jmax, sb)
                    } else {
                        super::flash_x86::scores::<R>(qb, &t.kt, bc, jmax, sb)
                    }
                };
            } else {
                scores::<R>(qb, &t.kt, bc, jmax, sb);
            }
            let mut corr = [0f32; R];
            for (i, &n_i) in jn.iter().enumerate() {
                let sr = &mut sb[i * bc..i * bc + jmax];
                if n_i == 0 {
                    sr.fill(0.0);
                    continue;
                }
                let r = rb + i;
                let j_s = js[i];
                let tile_max = if fast {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                    unsafe {
                        if job.wide {
                            super::flash_avx512::row_max(&sr[j_s..n_i])
                        } else {
                            super::flash_x86::row_max(&sr[j_s..n_i])
                        }
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!()
                } else {
                    sr[j_s..n_i]
                        .iter()
                        .fold(f32::NEG_INFINITY, |a, &x| a.max(x))
                };
                let m_new = m[r].max(tile_max);
                // exp(-inf) ~ 0 on the first tile: nothing accumulated yet to rescale.
                corr[i] = exp_approx(m[r] - m_new);
                let sum = if fast {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                    unsafe {
                        if job.wide {
                            super::flash_avx512::exp_row(&mut sr[j_s..n_i], m_new)
                        } else {
                            super::flash_x86::exp_row(&mut sr[j_s..n_i], m_new)
                        }
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!()
                } else {
                    exp_row(&mut sr[j_s..n_i], m_new)
                };
                // Keys outside the row's view weigh 0: adding 0 x v changes no bits.
                sr[..j_s].fill(0.0);
                sr[n_i..].fill(0.0);
                l[r] = l[r] * corr[i] + sum;
                m[r] = m_new;
            }
            // The tile's p.v is summed on its own, then added: two-level summation keeps the
            // rounding error growing with (tile + tiles) rather than with every key.
            let pv = &mut t.pv[..R * hd];
            if v_in_place {
                // The tile's runs (a paged cache's blocks) in order, each continuing the sums.
                let mut j = 0;
                while j < jmax {
                    let (bytes, stride, m) = job.v.head_run(span.kvh, hd, j0 + j, jmax - j);
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                    unsafe {
                        let weighted = if job.wide {
                            super::flash_avx512::weighted_values::<R>
                        } else {
                            super::flash_x86::weighted_values::<R>
                        };
                        let ty = job.v.ty();
                        weighted(
                            &sb[j..],
                            bc,
                            bytes,
                            stride,
                            ty,
                            hd,
                            m,
                            pv,
                            j > 0,
                            &mut t.ahead,
                        )
                    };
                    j += m;
                }
            } else if fast {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `fast` implies the CPU has AVX2, FMA and F16C.
                unsafe {
                    let weighted = if job.wide {
                        super::flash_avx512::weighted_values::<R>
                    } else {
                        super::flash_x86::weighted_values::<R>
                    };
                    weighted(
                        sb,
                        bc,
                        f32_bytes(&t.vt[..nb * hd]),
                        4 * hd,
                        KvType::F32,
                        hd,
                        jmax,
                        pv,
                        false,
                        &mut t.ahead,
                    )
                };
            } else {
                weighted_values::<R>(sb, bc, &t.vt, hd, jmax, pv);
            }
            for (i, &n_i) in jn.iter().enumerate() {
                if n_i == 0 {
                    continue;
                }
                let ar = &mut acc[(rb + i) * hd..][..hd];
                for (a, &b) in ar.iter_mut().zip(&pv[i * hd..(i + 1) * hd]) {
                    *a = *a * corr[i] + b;
                }
            }
        }
        t.ahead.finish();
        j0 += nb;
    }
}

/// `s[j] = exp(s[j] - max)`; returns their sum (the scalar twin of `flash_x86::exp_row`).
#[inline(always)]
pub(super) fn exp_row(s: &mut [f32], max: f32) -> f32 {
    let mut sum = 0f32;
    for x in s.iter_mut() {
        *x = exp_approx(*x - max);
        sum += *x;
    }
    sum
}

/// `e^x` for `x <= 0` ([`crate::ops::exp_poly`]; inputs below -87 give e^-87, as a softmax
/// weight next to the row maximum's 1 indistinguishable from 0).
#[inline(always)]
pub(super) fn exp_approx(x: f32) -> f32 {
    crate::ops::exp_poly(x.min(0.0))
}

/// Constants of [`exp_approx`] (shared with its AVX2 twin, which must compute the same bits).
pub(super) use crate::ops::{EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MIN, EXP_POLY, EXP_ROUND};

/// `s[i][j] = q_i . k_j` for `R` query rows (`q` is `R x hd`) and keys `0..jn` of a tile stored
/// transposed (`kt[c * bc + j]`), into `s` (`R x bc`). Eight keys by `R` rows at a time, their
/// sums in registers across the head dimension: each loaded key vector serves `R` rows. Each sum
/// still runs over `c` in order, as the plain loop does. Key columns past `jn` up to the next
/// multiple of 8 are computed on whatever the tile holds there and must be ignored.
#[inline(always)]
pub(super) fn scores<const R: usize>(q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
    const W: usize = 8;
    let hd = q.len() / R;
    let mut j = 0;
    while j < jn {
        if j + W > bc {
            // A tile width that is not a multiple of 8: finish column by column.
            for jj in j..jn {
                for i in 0..R {
                    s[i * bc + jj] = (0..hd)
                        .map(|c| q[i * hd + c] * kt[c * bc + jj])
                        .fold(0.0, |a, b| a + b);
                }
            }
            break;
        }
        let mut a = [[0f32; W]; R];
        for c in 0..hd {
            let k = &kt[c * bc + j..c * bc + j + W];
            for (i, ai) in a.iter_mut().enumerate() {
                let qc = q[i * hd + c];
                for (x, &kv) in ai.iter_mut().zip(k) {
                    *x += qc * kv;
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            s[i * bc + j..i * bc + j + W].copy_from_slice(ai);
        }
        j += W;
    }
}

/// `pv[i] = sum_j p[i][j] * v_j` for `R` rows (`p` is `R x bc`, `v` row-major with `hd` per key,
/// keys `0..jn`). Sixteen output values by `R` rows stay in registers across the keys: each
/// loaded value vector serves `R` rows. Each sum still runs over `j` in order.
#[inline(always)]
pub(super) fn weighted_values<const R: usize>(
    p: &[f32],
    bc: usize,
    v: &[f32],
    hd: usize,
    jn: usize,
    pv: &mut [f32],
) {
    const W: usize = 16;
    let mut d0 = 0;
    while d0 + W <= hd {
        let mut a = [[0f32; W]; R];
        for j in 0..jn {
            let vj = &v[j * hd + d0..j * hd + d0 + W];
            for (i, ai) in a.iter_mut().enumerate() {
                let pj = p[i * bc + j];
                for (x, &vv) in ai.iter_mut().zip(vj) {
                    *x += pj * vv;
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            pv[i * hd + d0..i * hd + d0 + W].copy_from_slice(ai);
        }
        d0 += W;
    }
    if d0 < hd {
        for i in 0..R {
            let out = &mut pv[i * hd + d0..(i + 1) * hd];
            out.fill(0.0);
            for j in 0..jn {
                let pj = p[i * bc + j];
                for (a, &b) in out.iter_mut().zip(&v[j * hd + d0..(j + 1) * hd]) {
                    *a += pj * b;
                }
            }
        }
    }
}
