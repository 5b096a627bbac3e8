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
//! This file is the driver: the call's plan, chosen once ([`plan`]: query blocks for prefill,
//! key chunks split across threads for decode, fused where AVX-512 allows), which spans of
//! rows and keys run where, and how their results merge. The files under it, by role:
//!
//! - `decode_split`: decode across key chunks and their merge; `decode_fused`: its fused
//!   AVX-512 pass over whole tiles (f32, f16, bf16 keys by column).
//! - `tile_loop`: one span's tile loop (prefill's query blocks, and decode's chunks where the
//!   fused pass does not apply), written once over `kernel::TileKernel`, whose level it picks
//!   once per span.
//! - `kernel`: the trait (key transposes, scores, row maxima, exponentials, weighted values)
//!   and its portable level, the scalar twin; `kernels_avx2`, `kernels_avx512`, `kernels_vnni`:
//!   the trait at the AVX2, AVX-512 and VNNI levels, with `kernels_q8_avx2` (Q8_0 keys) and
//!   `kernels_columns` (keys kept by column) and `kernels_lanes` (each cache format widened
//!   as loaded); `q8_keys`: integer scores' portable twin.
//!   `ahead`: the next tile's prefetches.
//!
//! A decode step reads in three files: this one (the plan), `decode_split` (chunks across
//! threads, merged) and `tile_loop` (one chunk, tile by tile), or `decode_fused` in its place.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
pub(super) use super::decode_fused::Fused;
use super::decode_split::split_kv;
use super::q8_keys::QuantQueries;
use super::tile_loop::{TILES, block, exp_approx, grow};
use super::{AttnShape, AttnWorkspace, OutPtr};
use crate::cpu::{self, Avx2, Avx512, Avx512Vnni, Level};
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
/// a multiple of 8, the width the SIMD kernels transpose and weigh keys in (any other width
/// would send every step down the scalar path).
pub fn key_tile(head_dim: usize) -> usize {
    (KV_TILE_BYTES / (8 * head_dim.max(1)) / 8 * 8).clamp(8, MAX_KEY_TILE)
}

/// Query tokens per block for heads of `head_dim` with `group` query heads per KV head.
pub fn query_block(head_dim: usize, group: usize) -> usize {
    (Q_BLOCK_BYTES / (8 * head_dim.max(1)) / group.max(1)).clamp(1, 64)
}

#[derive(Copy, Clone)]
pub(super) struct Job<'a> {
    pub(super) s: AttnShape,
    pub(super) q: &'a [f32],
    pub(super) k: KvView<'a>,
    pub(super) v: KvView<'a>,
    pub(super) pos0: usize,
    pub(super) bc: usize,
    pub(super) scale: f32,
    /// The AVX2 loops (the portable ones without).
    pub(super) simd: Option<Avx2>,
    /// The score, exponential and weighted-value loops in AVX-512 (same bits).
    pub(super) wide: Option<Avx512>,
    /// Scores against a Q8_0 key cache by the VNNI kernel (same bits).
    pub(super) vnni: Option<Avx512Vnni>,
    /// Over a Q8_0 key cache: every query row (`token x n_head`), scaled and quantized.
    pub(super) qq: Option<&'a QuantQueries>,
    /// Decode's whole tiles over keys by column in one AVX-512 pass (same bits).
    pub(super) fused: Option<Avx512>,
}

/// Query tokens `t0..t1` of the heads of KV head `kvh` against keys `lo..hi`.
#[derive(Copy, Clone)]
pub(super) struct Span {
    pub(super) kvh: usize,
    pub(super) t0: usize,
    pub(super) t1: usize,
    pub(super) lo: usize,
    pub(super) hi: usize,
}

/// Off x86-64 there is no fused decode pass: [`Plan::Fused`] is never chosen.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Copy, Clone)]
pub(super) enum Fused<'a> {
    #[allow(dead_code)] // never constructed: the type only stands in for the x86-64 one
    Never(std::convert::Infallible, std::marker::PhantomData<&'a ()>),
}

#[cfg(not(target_arch = "x86_64"))]
impl<'a> Fused<'a> {
    fn plan(_: &Job<'a>, _: usize, _: usize) -> Option<Self> {
        None
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        _: &Job,
        _: usize,
        _: std::ops::Range<usize>,
        _: usize,
        _: &mut [f32],
        _: usize,
        _: &mut super::tile_loop::Tiles,
    ) {
        match *self {
            Self::Never(never, _) => match never {},
        }
    }
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
    flash_paths(s, q, k, v, pos0, out, ws, cpu::level(), true);
}

/// `flash` at the instruction-set level chosen by the caller (tests run each).
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_with(
    s: AttnShape,
    q: &[f32],
    k: KvView,
    v: KvView,
    pos0: usize,
    out: &mut [f32],
    ws: &mut AttnWorkspace,
    level: Level,
) {
    flash_paths(s, q, k, v, pos0, out, ws, level, true);
}

/// `flash` at instruction-set level `level`, and whether decode's whole tiles may take the
/// fused pass (`decode_fused`; tests compare it with the general tile loop).
#[allow(clippy::too_many_arguments)]
pub(super) fn flash_paths(
    s: AttnShape,
    q: &[f32],
    k: KvView,
    v: KvView,
    pos0: usize,
    out: &mut [f32],
    ws: &mut AttnWorkspace,
    level: Level,
    fused: bool,
) {
    let hd = s.head_dim;
    let q_dim = s.n_head * hd;
    let n = q.len() / q_dim;
    let scale = 1.0 / (hd as f32).sqrt();
    let AttnWorkspace {
        partials,
        done,
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
        simd: level.avx2().filter(|_| cfg!(target_arch = "x86_64")),
        wide: level.avx512().filter(|_| cfg!(target_arch = "x86_64")),
        vnni: level.avx512_vnni().filter(|_| cfg!(target_arch = "x86_64")),
        qq: k_q8.then_some(&*qq),
        fused: level
            .avx512()
            .filter(|_| fused && cfg!(target_arch = "x86_64")),
    };
    let optr = OutPtr(out.as_mut_ptr());
    match plan(&job, n) {
        Plan::Blocks => blocks(&job, n, optr),
        Plan::SplitKv { c0, nchunks } => split_kv(&job, n, c0, nchunks, None, partials, done, optr),
        Plan::Fused { c0, nchunks, fused } => {
            split_kv(&job, n, c0, nchunks, Some(&fused), partials, done, optr)
        }
    }
}

/// How one call runs, chosen once by [`plan`]. Every plan computes the same chunks with the
/// same arithmetic and merges them in the same order (see [`key_chunk`]), so the choice
/// changes no bit.
enum Plan<'a> {
    /// Prefill, and decode short of two key chunks: FlashAttention-2 over (KV head, query
    /// block), each block running its key chunks one after another ([`blocks`]).
    Blocks,
    /// Decode across key chunks (flash-decoding): chunks `c0..c0 + nchunks` in parallel, each
    /// through the tile loop, merged in order ([`split_kv`]).
    SplitKv { c0: usize, nchunks: usize },
    /// [`Plan::SplitKv`] with each thread's run of chunks read in one fused AVX-512 pass
    /// (`decode_fused`).
    Fused {
        c0: usize,
        nchunks: usize,
        fused: Fused<'a>,
    },
}

/// The plan for `n` query tokens of `job`: a few query rows over two or more visible key
/// chunks split the keys across threads (fused where [`Fused::plan`] allows); anything else
/// runs by query block.
fn plan<'a>(job: &Job<'a>, n: usize) -> Plan<'a> {
    let s = job.s;
    let (hd, group) = (s.head_dim, s.n_head / s.n_head_kv);
    let chunk = key_chunk(hd);
    let nchunks = (job.pos0 + n).div_ceil(chunk);
    // Under a sliding window, chunks wholly before the first query's window are skipped: no
    // row sees them, and merging a chunk a row does not see changes nothing, so the result is
    // the same bits as computing them.
    let c0 = s.first_visible(job.pos0) / chunk;
    if n > query_block(hd, group) || nchunks - c0 < 2 {
        return Plan::Blocks;
    }
    let nchunks = nchunks - c0;
    match Fused::plan(job, n, chunk) {
        Some(fused) => Plan::Fused { c0, nchunks, fused },
        None => Plan::SplitKv { c0, nchunks },
    }
}

/// FlashAttention-2: parallel over (KV head, query block), the longest blocks first. Each
/// block runs its key chunks one after another, merging each into the running result.
fn blocks(job: &Job, n: usize, optr: OutPtr) {
    let s = job.s;
    let (hd, group) = (s.head_dim, s.n_head / s.n_head_kv);
    let q_dim = s.n_head * hd;
    let (pos0, len) = (job.pos0, job.pos0 + n);
    let br = query_block(hd, group);
    let chunk = key_chunk(hd);
    let nqb = n.div_ceil(br);
    let task = |i: usize| {
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
            block(job, span(first), acc, m, l, t);
            for c in first + 1..hi.div_ceil(chunk) {
                block(job, span(c), acc_c, m_c, l_c, t);
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
    };
    if nqb == 1 {
        // One query block (decode short of two key chunks): a task per KV head, all the same
        // length, through the forward pass's team (rayon's jobs a team's helper only looks for
        // between polls, so there the owner would run most of them itself).
        crate::team::for_each(s.n_head_kv, task);
    } else {
        (0..s.n_head_kv * nqb).into_par_iter().for_each(task);
    }
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

/// Rows merged side by side: one vector of eight exponentials a side per chunk.
pub(super) const MERGE_LANES: usize = 8;

/// Flash-decoding's merge for rows `rows` of the call's (KV head, row) pairs (at most
/// [`MERGE_LANES`]): each row's chunk results `0..nchunks` merged in order as
/// [`merge_partial`] merges them, into the output row `out(row)`, then normalized. The rows'
/// rescaling factors are taken side by side, eight exponentials in one vector
/// (`kernels_avx2::exp_lanes`, the scalar bits): one row's merges are a chain of two scalar
/// exponentials a chunk, and row after row the chains ran one after another on the thread
/// that merges while the others waited (at depth 4,096, a twentieth of the step's serial
/// work).
#[allow(clippy::too_many_arguments)]
pub(super) fn merge_chunks<'o>(
    parts: &[f32],
    nchunks: usize,
    stride: usize,
    rows: usize,
    hd: usize,
    which: std::ops::Range<usize>,
    simd: Option<Avx2>,
    out: impl Fn(usize) -> &'o mut [f32],
) {
    let n = which.len();
    assert!(n <= MERGE_LANES, "flash merge: at most {MERGE_LANES} rows");
    // Row `row` (a KV head's row `row % rows`) of chunk `c`: its output, maximum and sum.
    let at = |row: usize, c: usize| {
        let p = &parts[((row / rows) * nchunks + c) * stride..][..stride];
        let r = row % rows;
        (
            &p[r * hd..(r + 1) * hd],
            p[rows * hd + r],
            p[rows * hd + rows + r],
        )
    };
    let mut outs: [&mut [f32]; MERGE_LANES] = Default::default();
    let (mut m, mut l) = ([0f32; MERGE_LANES], [0f32; MERGE_LANES]);
    for (i, row) in which.clone().enumerate() {
        let (acc, m0, l0) = at(row, 0);
        outs[i] = out(row);
        outs[i].copy_from_slice(acc);
        (m[i], l[i]) = (m0, l0);
    }
    for c in 1..nchunks {
        let (mut mn, mut da, mut db) = (
            [0f32; MERGE_LANES],
            [0f32; MERGE_LANES],
            [0f32; MERGE_LANES],
        );
        for (i, row) in which.clone().enumerate() {
            let (_, mc, _) = at(row, c);
            mn[i] = m[i].max(mc);
            (da[i], db[i]) = (m[i] - mn[i], mc - mn[i]);
        }
        let (a, b) = (exp_batch(da, simd), exp_batch(db, simd));
        for (i, row) in which.clone().enumerate() {
            let (acc_c, _, lc) = at(row, c);
            // A chunk none of whose keys the row sees changes nothing.
            if lc == 0.0 {
                continue;
            }
            l[i] = l[i] * a[i] + lc * b[i];
            scale_add(outs[i], a[i], acc_c, b[i], simd);
            m[i] = mn[i];
        }
    }
    for i in 0..n {
        let inv = 1.0 / l[i];
        outs[i].iter_mut().for_each(|x| *x *= inv);
    }
}

/// `exp_approx` of eight values: side by side in one vector where the CPU has AVX2 and FMA
/// (the same bits).
fn exp_batch(x: [f32; MERGE_LANES], simd: Option<Avx2>) -> [f32; MERGE_LANES] {
    #[cfg(target_arch = "x86_64")]
    if simd.is_some() {
        // SAFETY: the token proves AVX2 and FMA.
        return unsafe { super::kernels_avx2::exp_lanes(x) };
    }
    let _ = simd;
    x.map(exp_approx)
}

/// `acc[d] = acc[d] * a + y[d] * b`, as [`merge_partial`] computes it (no fused multiply-add:
/// the same bits however wide the vectors).
fn scale_add(acc: &mut [f32], a: f32, y: &[f32], b: f32, simd: Option<Avx2>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = simd {
        // SAFETY: the token proves the loop's features.
        return unsafe { scale_add_avx2(t, acc, a, y, b) };
    }
    let _ = simd;
    scale_add_body(acc, a, y, b);
}

#[inline(always)]
fn scale_add_body(acc: &mut [f32], a: f32, y: &[f32], b: f32) {
    for (x, &y) in acc.iter_mut().zip(y) {
        *x = *x * a + y * b;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn scale_add_avx2(_: Avx2, acc: &mut [f32], a: f32, y: &[f32], b: f32) {
    scale_add_body(acc, a, y, b)
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
