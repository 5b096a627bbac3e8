//! A decode step's key tiles in one pass with AVX-512, for a paged cache that keeps keys by
//! column and values by row (f32, f16 or bf16 keys; values of any format): the scores stay in
//! registers for the row maximum and the exponentials, and the tile's keys and values are found
//! from the block table once per sixteen keys. The last tile, which the cache's end cuts short
//! on most steps, takes the pass too, as a tile of the sixteen-key segments that hold its keys
//! (`softmax_partial`): through the general loop it cost more than a whole tile here (one
//! attention call at 63 cached positions, three KV heads, f16, one thread: 3.6 us, against
//! 2.6 at 64), and every call at a depth short of one tile took it alone.
//!
//! The general tile loop (`tile_loop`) runs the same steps as separate kernels: scores stored,
//! then read back for the maximum, again for the exponentials, and each kernel locates its own
//! keys and values and plans the next tile's lines through `Ahead`. With the cache in L3 that
//! bookkeeping was a seventh of decode attention, and a kernel's entry and exit a sixth.
//!
//! Every value is computed with the operations of the general loop in the same order: each
//! score the chain of multiply-adds over the dimensions in order (`score_segments`), the
//! maximum over the tile, the exponentials and their sums in eight-lane partial sums taken in
//! key order (`exp_rows`), each weighted output the chain of multiply-adds over the keys in
//! order (`weighted_values`) and the running output rescaled, then added to. So the bits are
//! the general loop's (`tests::fused_decode_tiles_give_the_bits_of_the_tile_loop`).

use std::arch::x86_64::*;

use super::flash::{Job, Span};
use super::kernels_lanes::{Bf16Lanes, F16Lanes, F32Lanes, Lanes16, Q8Lanes};
use super::tile_loop::{Tiles, grow};
use crate::cpu::Avx512;
use crate::kv::{HeadAddr, KvType, KvView};

mod steps;

use steps::{
    fold_tile, rebase, score_column, scores, segment_weights, softmax, softmax_partial,
    store_scores, sum_lanes, weigh_key, weighted_all,
};

/// Sixteen keys: one vector of AVX-512 lanes.
const SEG: usize = 16;

/// The most segments a tile has: 64 keys, a 64-wide head's tile.
const MAX_SEGS: usize = 4;

/// Where the tiles of `k` and `v` lie, when they can take the fused pass: keys by column in
/// blocks of a whole number of segments, values by row back to back within a block (both in
/// per-head regions of blocks of a power of two positions), a tile of whole segments and heads
/// of whole vectors. `None` when they cannot.
pub(super) fn fused_views<'a>(
    k: &KvView<'a>,
    v: &KvView<'a>,
    hd: usize,
    bc: usize,
) -> Option<(HeadAddr<'a>, HeadAddr<'a>)> {
    let shapes = k.columns()
        && matches!(k.ty(), KvType::F32 | KvType::F16 | KvType::Bf16)
        && v.head_rows_back_to_back()
        && k.block_size().is_multiple_of(SEG)
        && v.block_size().is_multiple_of(SEG)
        && bc.is_multiple_of(SEG)
        && (1..=MAX_SEGS).contains(&(bc / SEG))
        && hd.is_multiple_of(SEG);
    if !shapes {
        return None;
    }
    k.head_addr(hd).zip(v.head_addr(hd))
}

/// Where a tile's segments lie: each segment's keys (its first column) and its sixteen value
/// rows back to back; and the next tile's, to request as this one is computed (this tile's
/// own past the cache's end).
pub(super) struct TileAt {
    pub(super) keys: [*const u8; MAX_SEGS],
    pub(super) values: [*const u8; MAX_SEGS],
    pub(super) next_keys: [*const u8; MAX_SEGS],
    pub(super) next_values: [*const u8; MAX_SEGS],
}

impl TileAt {
    /// Keys `j0..j0 + 16 n` of head `kvh`, and the `n` segments after them: `k` and `v` are
    /// the [`HeadAddr`]s [`fused_views`] gave for views that hold `len` positions; `j0` is a
    /// multiple of sixteen and the keys are in the cache.
    pub(super) fn locate(
        k: &HeadAddr,
        v: &HeadAddr,
        len: usize,
        kvh: usize,
        j0: usize,
        n: usize,
    ) -> Self {
        let null = [std::ptr::null(); MAX_SEGS];
        let mut at = TileAt {
            keys: null,
            values: null,
            next_keys: null,
            next_values: null,
        };
        for w in 0..n {
            let p = j0 + SEG * w;
            at.keys[w] = std::ptr::without_provenance(k.at(kvh, p));
            at.values[w] = std::ptr::without_provenance(v.at(kvh, p));
            let next = p + SEG * n;
            // Past the cache's end the next tile's requests go to this tile's own lines,
            // already at hand. The sixteen keys' share of their block's bytes: the block's
            // segments together cover it, whatever order its columns interleave them in.
            (at.next_keys[w], at.next_values[w]) = if next < len {
                (
                    std::ptr::without_provenance(k.share_at(kvh, next)),
                    std::ptr::without_provenance(v.at(kvh, next)),
                )
            } else {
                (at.keys[w], at.values[w])
            };
        }
        at
    }
}

/// A run of consecutive tiles one query block takes in the fused pass.
pub(super) struct Run<'a> {
    pub(super) k: &'a HeadAddr<'a>,
    pub(super) v: &'a HeadAddr<'a>,
    /// Positions the cache holds.
    pub(super) len: usize,
    pub(super) kvh: usize,
    /// The first tile's first key, a multiple of sixteen, and how many tiles of `bc` keys.
    pub(super) j0: usize,
    pub(super) tiles: usize,
    /// Keys per tile, a multiple of sixteen, and bytes from one key column to the next.
    pub(super) bc: usize,
    pub(super) column: usize,
    pub(super) hd: usize,
    /// Keys of the run's last tile that are in the cache: `bc`, or fewer for decode's last
    /// tile, whose last segment the cache fills only in part (more than `bc - 16`: every
    /// segment holds at least one).
    pub(super) valid: usize,
    /// A run over several key chunks: where each chunk's result goes. `None`: one running
    /// result, the one [`tiles`] is given.
    pub(super) chunks: Option<ChunkParts>,
}

impl<'a> Run<'a> {
    /// Tiles `j0..` of KV head `kvh` in the views of `job` (`k` and `v` their addresses from
    /// [`fused_views`]): `tiles` tiles of `tile` keys, `valid` of the last one in the cache.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        job: &Job,
        k: &'a HeadAddr<'a>,
        v: &'a HeadAddr<'a>,
        kvh: usize,
        j0: usize,
        (tiles, tile, valid): (usize, usize, usize),
        chunks: Option<ChunkParts>,
    ) -> Self {
        Run {
            k,
            v,
            len: job.k.len(),
            kvh,
            j0,
            tiles,
            bc: tile,
            column: job.k.block_size() * job.k.ty().bytes(1),
            hd: job.s.head_dim,
            valid,
            chunks,
        }
    }
}

/// Where a run over consecutive key chunks leaves each chunk's result, so that one pass reads
/// them all without a stop between chunks (every chunk's result is the one it has alone). Chunk
/// `c` of the run (from 0) starts `c * stride` floats past `base`: its rows' outputs
/// (`R x hd`), their maxima (`R`), their sums (`R`), set to an empty result before the run.
/// A chunk is `per_chunk` tiles.
#[derive(Copy, Clone)]
pub(super) struct ChunkParts {
    pub(super) base: *mut f32,
    pub(super) stride: usize,
    pub(super) per_chunk: usize,
}

impl ChunkParts {
    /// Chunk `c`'s output, maxima and sums for `R` rows of `hd`.
    ///
    /// # Safety
    /// Chunk `c` is one of the run's, and nothing else uses its part while these live.
    unsafe fn part<'p, const R: usize>(
        &self,
        c: usize,
        hd: usize,
    ) -> (&'p mut [f32], &'p mut [f32], &'p mut [f32]) {
        // SAFETY: as the caller guarantees; a part holds `R x hd + 2 R` floats.
        let part = unsafe {
            std::slice::from_raw_parts_mut(self.base.add(c * self.stride), R * hd + 2 * R)
        };
        let (acc, ml) = part.split_at_mut(R * hd);
        let (m, l) = ml.split_at_mut(R);
        (acc, m, l)
    }
}

/// `run.tiles` tiles of keys for `R` query rows that all see every key of them: for each, the
/// scores, the online softmax's update of `m`, `l` and `acc` (`R` rows, `acc` `R x hd`), and
/// the weighted values. `q` holds the rows' queries, scaled (`R x hd`); `s` and `p` are
/// scratch for `R x bc` scores and weights. `keys` and `values` are the two views' types.
///
/// The next tile's scores are computed before this tile's weighted sum: the softmax is a chain
/// of dependent steps (maximum, correction, exponentials, sums) that the weighted sum waits
/// for, and the next tile's multiply-adds, which depend on none of it, fill the wait. The
/// scores go to `s` once the softmax has read it; the weighted sum reads `p`. Same operations
/// on the same values, so the same bits. (The closures in these kernels must be inlined, which
/// the workspace's 4 codegen units do; with the default 16 they are not.) For tiles of 64 keys and heads of 64 dimensions the softmax
/// itself runs inside that loop too, a segment at a time ([`step`]).
///
/// # Safety
/// `run` has addresses of views that pass [`fused_views`], and its tiles are whole and in the
/// cache.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tiles<const R: usize>(
    _: Avx512,
    keys: KvType,
    values: KvType,
    run: &Run,
    q: &[f32],
    s: &mut [f32],
    p: &mut [f32],
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) {
    let (hd, bc) = (run.hd, run.bc);
    let n = bc / SEG;
    assert!(
        (1..=MAX_SEGS).contains(&n)
            && bc.is_multiple_of(SEG)
            && run.j0.is_multiple_of(SEG)
            && run.tiles >= 1
            && run.valid <= bc
            && run.valid + SEG > bc
            && run.j0 + (run.tiles - 1) * bc + run.valid <= run.len
            && q.len() >= R * hd
            && s.len() >= R * bc
            && p.len() >= R * bc
            && acc.len() >= R * hd
            && m.len() >= R
            && l.len() >= R
            && hd.is_multiple_of(SEG)
            && run.chunks.is_none_or(|c| c.per_chunk >= 1),
        "fused decode tiles: shapes"
    );
    macro_rules! by_values {
        ($k:ty, $n:literal) => {
            match values {
                KvType::F32 => tiles_n::<$k, F32Lanes, R, $n>(run, q, s, p, acc, m, l),
                KvType::F16 => tiles_n::<$k, F16Lanes, R, $n>(run, q, s, p, acc, m, l),
                KvType::Bf16 => tiles_n::<$k, Bf16Lanes, R, $n>(run, q, s, p, acc, m, l),
                KvType::Q8_0 => tiles_n::<$k, Q8Lanes, R, $n>(run, q, s, p, acc, m, l),
            }
        };
    }
    macro_rules! by_count {
        ($k:ty) => {
            match n {
                1 => by_values!($k, 1),
                2 => by_values!($k, 2),
                3 => by_values!($k, 3),
                _ => by_values!($k, 4),
            }
        };
    }
    // SAFETY: the token proves `tiles_n`'s features; the caller guarantees the run, the shapes
    // are checked above.
    unsafe {
        match keys {
            KvType::F32 => by_count!(F32Lanes),
            KvType::F16 => by_count!(F16Lanes),
            KvType::Bf16 => by_count!(Bf16Lanes),
            KvType::Q8_0 => unreachable!("Q8_0 keys are kept by rows"),
        }
    }
}

/// The tiles from `j0` of `span` (`nb` keys of the tile at `j0`, keys up to `hi` visible to the
/// block) that the fused pass takes for a query block of `R` rows: the run of whole tiles every
/// row sees whole (none past its position or before its window), or the last tile when the
/// cache ends inside it (decode's last keys), as a run of one tile of the sixteen-key segments
/// that hold them. `views` are those [`fused_views`] gave for the job's cache. Returns the
/// keys taken; 0 when the tile at `j0` is not one of these (the tile loop takes it).
#[allow(clippy::too_many_arguments)]
pub(super) fn span_tiles<const R: usize>(
    w: Avx512,
    job: &Job,
    span: Span,
    (ka, va): (&HeadAddr, &HeadAddr),
    j0: usize,
    nb: usize,
    hi: usize,
    t: &mut Tiles,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) -> usize {
    let (s, bc) = (job.s, job.bc);
    let whole_or_last = nb == bc || j0 + nb == job.k.len();
    let seen_whole =
        job.pos0 + span.t0 + 1 >= j0 + nb && s.first_visible(job.pos0 + span.t1 - 1) <= j0;
    if !(whole_or_last && seen_whole) {
        return 0;
    }
    let (tiles, tile, valid) = if nb == bc {
        ((hi.min(job.pos0 + span.t0 + 1) - j0) / bc, bc, bc)
    } else {
        (1, nb.next_multiple_of(SEG), nb)
    };
    let run = Run::new(job, ka, va, span.kvh, j0, (tiles, tile, valid), None);
    // SAFETY: the views are those `fused_views` took; the run's tiles are whole and in the
    // cache (`j0 + tiles * bc <= hi <= len`; `j0` a multiple of the tile, itself of sixteen),
    // or it is one tile whose `valid` keys end the cache, in segments of blocks the cache
    // holds (blocks are whole segments, `fused_views`).
    unsafe { tiles_in::<R>(w, job, &run, t, acc, m, l) };
    (run.tiles - 1) * bc + run.valid
}

/// [`tiles`] for the views of `job`, with the scratch of `t`: the rows' scaled queries in
/// `t.q` (`R x hd`), the scores and weights in `t.kt` and `t.s`.
///
/// # Safety
/// As [`tiles`].
pub(super) unsafe fn tiles_in<const R: usize>(
    w: Avx512,
    job: &Job,
    run: &Run,
    t: &mut Tiles,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) {
    let (hd, bc) = (run.hd, run.bc);
    // SAFETY: forwarded.
    unsafe {
        tiles::<R>(
            w,
            job.k.ty(),
            job.v.ty(),
            run,
            &t.q[..R * hd],
            &mut t.kt[..R * bc],
            &mut t.s[..R * bc],
            &mut acc[..R * hd],
            &mut m[..R],
            &mut l[..R],
        )
    }
}

#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn tiles_n<LK: Lanes16, LV: Lanes16, const R: usize, const N: usize>(
    run: &Run,
    q: &[f32],
    s: &mut [f32],
    p: &mut [f32],
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) {
    let whole = SEG * N;
    // SAFETY: forwarded; every tile located is whole and in the cache (`tiles` checked).
    // No closures here: in a build of many codegen units a closure may stay a function of its
    // own, outside these target features.
    unsafe {
        // Tile t's scores are in `s` as each step begins; the step scores tile t + 1 between
        // tile t's softmax and its weighted sum (see `tiles`).
        let mut at = TileAt::locate(run.k, run.v, run.len, run.kvh, run.j0, N);
        scores::<LK, R, N>(&at, run.column, q, run.hd, s, run.bc);
        let (mut acc, mut m, mut l) = (acc, m, l);
        for t in 0..run.tiles {
            // The first tile of the run's next chunk: on into that chunk's result.
            if let Some(c) = &run.chunks
                && t > 0
                && t.is_multiple_of(c.per_chunk)
            {
                (acc, m, l) = c.part::<R>(t / c.per_chunk, run.hd);
            }
            if t + 1 == run.tiles {
                // Only the last tile may be partial.
                let corr = if run.valid == whole {
                    softmax::<R, N>(s, p, run.bc, m, l)
                } else {
                    softmax_partial::<R, N>(s, p, run.bc, m, l, run.valid)
                };
                weighted_all::<LV, R, N>(&at, p, run.bc, run.hd, acc, &corr, run.valid);
                break;
            }
            let j0 = run.j0 + (t + 1) * run.bc;
            let next = TileAt::locate(run.k, run.v, run.len, run.kvh, j0, N);
            if N == 4 && run.hd == 64 {
                step::<LK, LV, R>(&at, &next, run.column, q, s, p, run.bc, acc, m, l);
            } else {
                let corr = softmax::<R, N>(s, p, run.bc, m, l);
                scores::<LK, R, N>(&next, run.column, q, run.hd, s, run.bc);
                weighted_all::<LV, R, N>(&at, p, run.bc, run.hd, acc, &corr, whole);
            }
            at = next;
        }
    }
}

/// One whole tile `at` of 64 keys, for heads of 64 dimensions, and the next tile's scores,
/// in one loop: the tile's softmax (its scores are in `s`), its weighted values, and `next`'s
/// scores, which go to `s` after the loop.
///
/// Step `j` scores column `j` of `next`'s keys and weighs key `j` of `at`'s values, so that the
/// key and value streams are read side by side. The softmax is spread through the same loop:
/// the rows' new maxima and corrections come first, then the exponentials a segment of sixteen
/// keys at a time, each computed half a segment before its keys are weighed. Work done in one
/// block between the loads stops the loads for its length, and from memory a stop costs more
/// than its own time: the loads that follow it start behind, with nothing in flight. Spread
/// through the loop, the same work hides behind the loads.
///
/// Every value has the operations and order of the separate steps, so the same bits: each
/// score the chain over the columns in order ([`steps::scores`]), each output the chain over
/// the keys in order ([`steps::weighted`]), the maxima, corrections and sums as
/// [`steps::softmax`] takes them (each exponential lane by lane `exp16_grid`'s, the sums a
/// segment's two halves in key order). Requests as [`steps::scores`] and [`steps::weighted`]
/// make them.
///
/// # Safety
/// As [`tiles`], with `N = 4` (64 keys a tile), `hd = 64` and `at` and `next` whole tiles.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn step<LK: Lanes16, LV: Lanes16, const R: usize>(
    at: &TileAt,
    next: &TileAt,
    column: usize,
    q: &[f32],
    s: &mut [f32],
    p: &mut [f32],
    bc: usize,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
) {
    const N: usize = 4;
    const W: usize = 4;
    const HD: usize = 64;
    let es = LK::TY.bytes(1);
    let every = (64 / (SEG * es)).max(1);
    let hbv = LV::TY.bytes(HD);
    let lines = (SEG * hbv).div_ceil(64);
    let rate = (lines << 16).div_ceil(SEG);
    let (qp, sp, pp, op) = (q.as_ptr(), s.as_ptr(), p.as_mut_ptr(), acc.as_mut_ptr());
    // SAFETY: as `scores`, `softmax` and `weighted` for these shapes (`tiles` checked them).
    unsafe {
        let mut a = [[_mm512_setzero_ps(); N]; R];
        for (i, ai) in a.iter_mut().enumerate() {
            for (w, aw) in ai.iter_mut().enumerate() {
                *aw = _mm512_loadu_ps(sp.add(i * bc + SEG * w));
            }
        }
        let (m_new, corr) = rebase::<R, N>(&mut a, m);
        let mut sums = [_mm256_setzero_ps(); R];
        segment_weights::<R>(sp, pp, bc, 0, &m_new, &mut sums);
        let mut sa = [[_mm512_setzero_ps(); N]; R];
        let mut wa = [[_mm512_setzero_ps(); W]; R];
        let mut done = 0;
        for j in 0..HD {
            // Key j of this tile: row r of segment w.
            let (w, r) = (j / SEG, j % SEG);
            if r == SEG / 2 && w + 1 < N {
                segment_weights::<R>(sp, pp, bc, w + 1, &m_new, &mut sums);
            }
            if j % every == 0 {
                let step = j / every;
                for w in 0..N {
                    _mm_prefetch::<_MM_HINT_T1>(next.next_keys[w].add(64 * step).cast());
                }
            }
            score_column::<LK, R, N>(next, column, qp, HD, j, &mut sa);
            if r == 0 {
                done = 0;
            }
            let due = (((r + 1) * rate) >> 16).min(lines);
            for line in done..due {
                _mm_prefetch::<_MM_HINT_T1>(at.next_values[w].add(64 * line).cast());
            }
            done = due;
            weigh_key::<LV, R, W>(at.values[w].add(r * hbv), pp, bc, j, 0, &mut wa);
        }
        store_scores::<R, N>(&sa, s, bc);
        fold_tile::<R, W>(&wa, op, HD, 0, &corr);
        for i in 0..R {
            l[i] = l[i] * corr[i] + sum_lanes(sums[i]);
            m[i] = m_new[i];
        }
    }
}

/// One call's fused split-KV decode ([`super::flash::Plan::Fused`]): the kernel for its rows
/// and where its keys and values lie.
#[derive(Copy, Clone)]
pub(super) struct Fused<'a> {
    w: Avx512,
    run: FusedChunks,
    ka: HeadAddr<'a>,
    va: HeadAddr<'a>,
}

impl<'a> Fused<'a> {
    /// The fused pass for a split-KV decode of `n` tokens over chunks of `chunk` keys, where
    /// it applies: one token whose three or four query rows (its heads of a KV head) take whole
    /// tiles of a multiple of sixteen keys from f32, f16 or bf16 keys kept by column
    /// ([`fused_views`]), with AVX-512 allowed (`job.fused`).
    pub(super) fn plan(job: &Job<'a>, n: usize, chunk: usize) -> Option<Self> {
        let s = job.s;
        let w = job.fused.filter(|_| n == 1)?;
        if !job.bc.is_multiple_of(16) || !chunk.is_multiple_of(job.bc) {
            return None;
        }
        let run: FusedChunks = match s.n_head / s.n_head_kv {
            3 => fused_chunks::<3>,
            4 => fused_chunks::<4>,
            _ => return None,
        };
        let (ka, va) = fused_views(&job.k, &job.v, s.head_dim, job.bc)?;
        Some(Self { w, run, ka, va })
    }

    /// [`fused_chunks`] over keys `keys` (from a chunk's start) of KV head `kvh`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run(
        &self,
        job: &Job,
        kvh: usize,
        keys: std::ops::Range<usize>,
        chunk: usize,
        parts: &mut [f32],
        stride: usize,
        t: &mut Tiles,
    ) {
        (self.run)(
            self.w, job, kvh, &self.ka, &self.va, keys, chunk, parts, stride, t,
        )
    }
}

/// [`fused_chunks`] for a number of rows.
pub(super) type FusedChunks = fn(
    Avx512,
    &Job,
    usize,
    &HeadAddr,
    &HeadAddr,
    std::ops::Range<usize>,
    usize,
    &mut [f32],
    usize,
    &mut Tiles,
);

/// [`super::tile_loop::chunk_run`]'s fused run for `R` rows (one token's query heads of KV
/// head `kvh`) over `keys` (from a chunk's start): the whole tiles as one run, then the cache's
/// last keys, when they end inside a tile, as a run of one tile of the segments that hold them
/// (as [`super::tile_loop::block`] takes them).
#[allow(clippy::too_many_arguments)]
pub(super) fn fused_chunks<const R: usize>(
    w: Avx512,
    job: &Job,
    kvh: usize,
    ka: &HeadAddr,
    va: &HeadAddr,
    keys: std::ops::Range<usize>,
    chunk: usize,
    parts: &mut [f32],
    stride: usize,
    t: &mut Tiles,
) {
    let s = job.s;
    let hd = s.head_dim;
    let bc = job.bc;
    let (lo, hi) = (keys.start, keys.end);
    let nchunks = (hi - lo).div_ceil(chunk);
    assert!(
        parts.len() >= nchunks * stride && stride >= R * hd + 2 * R,
        "fused chunks: parts"
    );
    grow(&mut t.q, R * hd);
    grow(&mut t.kt, R * bc);
    grow(&mut t.s, R * bc);
    for g in 0..R {
        let src = &job.q[(kvh * R + g) * hd..][..hd];
        for (d, &x) in t.q[g * hd..][..hd].iter_mut().zip(src) {
            *d = x * job.scale;
        }
    }
    // Every chunk starts from an empty result.
    for part in parts.chunks_mut(stride).take(nchunks) {
        let (acc, ml) = part.split_at_mut(R * hd);
        acc.fill(0.0);
        ml[..R].fill(f32::NEG_INFINITY);
        ml[R..2 * R].fill(0.0);
    }
    let whole = (hi - lo) / bc;
    let chunks = ChunkParts {
        base: parts.as_mut_ptr(),
        stride,
        per_chunk: chunk / bc,
    };
    let mut go = |r: &Run, first: usize| {
        // SAFETY: `fused_views` took the views; the run's tiles are whole and in the
        // cache, or one tile whose `valid` keys end it (as in `span_tiles`). Chunk `first`
        // onwards of `parts` are this call's, each `stride` floats, checked above.
        unsafe {
            let (acc, m, l) = chunks.part::<R>(first, hd);
            tiles_in::<R>(w, job, r, t, acc, m, l)
        }
    };
    if whole > 0 {
        go(
            &Run::new(job, ka, va, kvh, lo, (whole, bc, bc), Some(chunks)),
            0,
        );
    }
    let end = lo + whole * bc;
    if end < hi {
        let nb = hi - end;
        let tile = nb.next_multiple_of(16);
        go(
            &Run::new(job, ka, va, kvh, end, (1, tile, nb), None),
            (end - lo) / chunk,
        );
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::super::flash::flash_paths;
    use super::super::{AttnShape, AttnWorkspace};
    use crate::cpu::Avx512;
    use crate::kv::{CacheShape, KvFormat, KvPool, KvSequence, KvType};

    /// Decode rows over a paged pool that keeps keys by column take the fused pass for their
    /// whole tiles. Every row gets the bits of the same call with the pass turned off (the
    /// general tile loop) and of a prefill computing it among all the rows: keys of each
    /// format the pass reads, values of every format, blocks of 16 and 32 positions (and of
    /// 8, which the pass leaves to the general loop), groups of three and four query heads,
    /// 64- and 128-wide heads, lengths across several chunks with a short last tile, and a
    /// window.
    #[test]
    fn fused_decode_tiles_give_the_bits_of_the_tile_loop() {
        if crate::cpu::token_for_test::<Avx512>("fused_decode_tiles_give_the_bits_of_the_tile_loop")
            .is_none()
        {
            return;
        }
        let level = crate::cpu::level();
        let shapes = [
            (9, 3, 64, None),
            (8, 2, 64, None),
            (4, 1, 128, None),
            (9, 3, 64, Some(200)),
        ];
        let types = [
            (KvType::F16, KvType::F16),
            (KvType::F32, KvType::Bf16),
            (KvType::Bf16, KvType::Q8_0),
            (KvType::F16, KvType::F32),
            (KvType::F32, KvType::F32),
        ];
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for (n_head, n_head_kv, head_dim, window) in shapes {
            let s = AttnShape {
                n_head,
                n_head_kv,
                head_dim,
                window,
            };
            let (q_dim, kv_dim) = (n_head * head_dim, n_head_kv * head_dim);
            let len = 600;
            let mut random = |n: usize, amp: f32| -> Vec<f32> {
                (0..n).map(|_| rng.random_range(-amp..amp)).collect()
            };
            let (q, k, v) = (
                random(len * q_dim, 1.5),
                random(len * kv_dim, 1.5),
                random(len * kv_dim, 1.0),
            );
            for (kt, vt) in types {
                for bs in [16, 32, 8] {
                    let format = KvFormat { k: kt, v: vt };
                    let shape = CacheShape::new(n_head_kv, head_dim);
                    let mut pool = KvPool::new(1, shape, format, bs, len / bs + 2).unwrap();
                    let id = pool.add_sequence(len);
                    let mut ws = AttnWorkspace::default();
                    let (mut fused, mut general) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                    for t in 0..len {
                        let mut seq = pool.slot(id);
                        seq.reserve(1).unwrap();
                        let row = t * kv_dim..(t + 1) * kv_dim;
                        seq.append(0, &k[row.clone()], &v[row]);
                        seq.commit(1);
                        let (kv, vv) = pool.layer(id, 0);
                        let rows = t * q_dim..(t + 1) * q_dim;
                        let qt = &q[rows.clone()];
                        flash_paths(
                            s,
                            qt,
                            kv,
                            vv,
                            t,
                            &mut fused[rows.clone()],
                            &mut ws,
                            level,
                            true,
                        );
                        flash_paths(s, qt, kv, vv, t, &mut general[rows], &mut ws, level, false);
                    }
                    let (kv, vv) = pool.layer(id, 0);
                    let mut prefill = vec![0f32; q.len()];
                    flash_paths(s, &q, kv, vv, 0, &mut prefill, &mut ws, level, true);
                    let what = format!("{s:?} {format} blocks of {bs}");
                    assert_eq!(
                        bits(&fused),
                        bits(&general),
                        "{what}: fused against the loop"
                    );
                    assert_eq!(
                        bits(&fused),
                        bits(&prefill),
                        "{what}: decode against prefill"
                    );
                }
            }
        }
    }
}
