//! A decode step's key tiles in one pass with AVX-512, for a paged cache that keeps keys by
//! column and values by row (f32, f16 or bf16 keys; values of any format): the scores stay in
//! registers for the row maximum and the exponentials, and the tile's keys and values are found
//! from the block table once per sixteen keys. The last tile, which the cache's end cuts short
//! on most steps, takes the pass too, as a tile of the sixteen-key segments that hold its keys
//! (`softmax_partial`): through the general loop it cost more than a whole tile here (one
//! attention call at 63 cached positions, three KV heads, f16, one thread: 3.6 us, against
//! 2.6 at 64), and every call at a depth short of one tile took it alone.
//!
//! The general tile loop (`flash_span`) runs the same steps as separate kernels: scores stored,
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

use super::flash_avx512::{Bf16Lanes, F16Lanes, F32Lanes, Lanes16, Q8Lanes, exp16_grid};
use super::flash_x86::exp_lanes;
use crate::kv::{HeadAddr, KvType, KvView};

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
/// In one thread with a tile in L1 (f16, 64 keys, three rows, Zen 4) a tile takes about 1,670
/// TSC ticks: scores 690, weighted values 700, softmax 250 (360 with the exponentials one
/// vector after another rather than side by side, `exp16_grid`).
///
/// The next tile's scores are computed before this tile's weighted sum: the softmax is a chain
/// of dependent steps (maximum, correction, exponentials, sums) that the weighted sum waits
/// for, and the next tile's multiply-adds, which depend on none of it, fill the wait. The
/// scores go to `s` once the softmax has read it; the weighted sum reads `p`. Same operations
/// on the same values, so the same bits. Same-process A/B, f16, depth 4,096: attention alone
/// 5.21 -> 4.86 ms a step on one thread, 2.85 -> 2.72 on two; whole decode 2.4-3.7% faster a
/// token on two threads, 2.5% on one. (An earlier A/B found this order 10% slower from
/// memory. Its harness was most likely built with the default 16 codegen units, and there the
/// closures in these kernels are not inlined, which makes them 30-45% slower; the
/// workspace builds with 4.) For tiles of 64 keys and heads of 64 dimensions the softmax
/// itself runs inside that loop too, a segment at a time ([`step`]).
///
/// # Safety
/// The CPU has AVX-512 F, VL and DQ, AVX2, FMA and F16C; `run` has addresses of views that
/// pass [`fused_views`], and its tiles are whole and in the cache.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tiles<const R: usize>(
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
    // SAFETY: forwarded (the caller has the features; the shapes are checked above).
    unsafe {
        match keys {
            KvType::F32 => by_count!(F32Lanes),
            KvType::F16 => by_count!(F16Lanes),
            KvType::Bf16 => by_count!(Bf16Lanes),
            KvType::Q8_0 => unreachable!("Q8_0 keys are kept by rows"),
        }
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

/// A tile's scores into `s` (row `i` at `i * bc`), each the chain of multiply-adds over the
/// dimensions in order (column `c` of a segment's keys `c * column` bytes past its first).
/// The next tile's key lines are asked for over the columns, into L2 (see `score_segments`).
/// This tile's value lines are not asked for again: [`weighted_all`] asked for them a tile
/// ahead. (f32 values used to be asked for twice. Each request holds one of the core's few
/// outstanding-miss slots whether or not the line is on its way already: without the second
/// request, attention alone at depth 4,096 on one thread went 9.92 -> 8.92 ms a step, 10 of
/// 10 pairs, and whole decode 2.4% faster a token on one thread, 1.8% on two; for 16-bit
/// values the second request had already been dropped for the same reason.)
///
/// # Safety
/// As [`tiles`], for a tile `at` of `N` segments.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn scores<LK: Lanes16, const R: usize, const N: usize>(
    at: &TileAt,
    column: usize,
    q: &[f32],
    hd: usize,
    s: &mut [f32],
    bc: usize,
) {
    let es = LK::TY.bytes(1);
    // Columns per line of a segment's keys.
    let every = (64 / (SEG * es)).max(1);
    let qp = q.as_ptr();
    // SAFETY: key loads read sixteen values at c * column of a segment (c < hd), inside the
    // block `locate` found; q and s are read and written inside the lengths `tiles` checked.
    // Prefetches never fault.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); N]; R];
        // Line `step` of each segment's next keys at step `step` (a step is a line of this
        // segment's keys).
        let (mut c, mut step) = (0, 0);
        while c < hd {
            let end = (c + every).min(hd);
            for w in 0..N {
                _mm_prefetch::<_MM_HINT_T1>(at.next_keys[w].add(64 * step).cast());
            }
            for cc in c..end {
                score_column::<LK, R, N>(at, column, qp, hd, cc, &mut a);
            }
            c = end;
            step += 1;
        }
        store_scores::<R, N>(&a, s, bc);
    }
}

/// The online softmax over a tile's scores: the tile's maximum per row (a NaN score is passed
/// over, as MAXPS returns its second operand), the exponentials into `p` with their sums in
/// eight-lane partial sums taken in key order (`exp_rows`), `m` and `l` updated. Returns the
/// rows' corrections of what they had accumulated.
///
/// # Safety
/// As [`tiles`].
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn softmax<const R: usize, const N: usize>(
    s: &[f32],
    p: &mut [f32],
    bc: usize,
    m: &mut [f32],
    l: &mut [f32],
) -> [f32; R] {
    let (sp, pp) = (s.as_ptr(), p.as_mut_ptr());
    // SAFETY: s and p hold R x bc, bc >= 16 N (`tiles` checked).
    unsafe {
        let mut a = [[_mm512_setzero_ps(); N]; R];
        for (i, ai) in a.iter_mut().enumerate() {
            for (w, aw) in ai.iter_mut().enumerate() {
                *aw = _mm512_loadu_ps(sp.add(i * bc + SEG * w));
            }
        }
        let (m_new, corr) = rebase::<R, N>(&mut a, m);
        let e = exp16_grid::<R, N>(a);
        for (i, ei) in e.iter().enumerate() {
            let mut s8 = _mm256_setzero_ps();
            for (w, &e) in ei.iter().enumerate() {
                _mm512_storeu_ps(pp.add(i * bc + SEG * w), e);
                s8 = _mm256_add_ps(s8, _mm512_castps512_ps256(e));
                s8 = _mm256_add_ps(s8, _mm512_extractf32x8_ps::<1>(e));
            }
            let sum = sum_lanes(s8);
            l[i] = l[i] * corr[i] + sum;
            m[i] = m_new[i];
        }
        corr
    }
}

/// The rows' new maxima (the running `m` against the tile's scores `a`), the corrections of
/// what they had accumulated (`exp(m - m_new)`), and the scores shifted by them, ready for the
/// exponentials: the steps [`softmax`] and [`softmax_partial`] share.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
fn rebase<const R: usize, const N: usize>(
    a: &mut [[__m512; N]; R],
    m: &[f32],
) -> ([f32; R], [f32; R]) {
    let mut m_new = [0f32; R];
    for (i, ai) in a.iter().enumerate() {
        let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
        for &aw in ai.iter() {
            mx = _mm512_max_ps(aw, mx);
        }
        // No lane of `mx` is NaN: across lanes the maximum is the same whatever order it is
        // taken in (but for the sign of a zero, which no exponential sees).
        m_new[i] = m[i].max(_mm512_reduce_max_ps(mx));
    }
    let mut shift = [0f32; R];
    for (i, x) in shift.iter_mut().enumerate() {
        *x = m[i] - m_new[i];
    }
    // SAFETY: the features `exp_lanes` needs are this function's.
    let corr = unsafe { exp_lanes::<R>(shift) };
    for (ai, &mi) in a.iter_mut().zip(&m_new) {
        let mv = _mm512_set1_ps(mi);
        for aw in ai.iter_mut() {
            *aw = _mm512_sub_ps(*aw, mv);
        }
    }
    (m_new, corr)
}

/// [`softmax`] over a tile of which only the first `valid` keys are in the cache (decode's
/// last tile, `16 (N - 1) < valid < 16 N`): the lanes past them are left out of the maximum and
/// weigh 0, and the sums are taken as `exp_rows` takes them over `valid` keys, the general
/// loop's way: eight-lane partial sums over the whole eights, those lanes added in order, then
/// the keys after them one by one. So the bits are the general loop's for the same keys.
///
/// # Safety
/// As [`tiles`], with `valid` as above.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn softmax_partial<const R: usize, const N: usize>(
    s: &[f32],
    p: &mut [f32],
    bc: usize,
    m: &mut [f32],
    l: &mut [f32],
    valid: usize,
) -> [f32; R] {
    debug_assert!(valid < SEG * N && valid + SEG > SEG * N);
    let (sp, pp) = (s.as_ptr(), p.as_mut_ptr());
    let mut keep: [__mmask16; N] = [0; N];
    for (w, k) in keep.iter_mut().enumerate() {
        let n = valid.saturating_sub(SEG * w).min(SEG);
        *k = ((1u32 << n) - 1) as __mmask16;
    }
    // SAFETY: s and p hold R x bc, bc >= 16 N (`tiles` checked); the masked loads read only
    // the scores of keys in the cache.
    unsafe {
        let none = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut a = [[none; N]; R];
        for (i, ai) in a.iter_mut().enumerate() {
            for (w, aw) in ai.iter_mut().enumerate() {
                *aw = _mm512_mask_loadu_ps(none, keep[w], sp.add(i * bc + SEG * w));
            }
        }
        let (m_new, corr) = rebase::<R, N>(&mut a, m);
        let e = exp16_grid::<R, N>(a);
        // Eight-key groups wholly in the cache.
        let eights = valid / 8;
        for (i, ei) in e.iter().enumerate() {
            let mut s8 = _mm256_setzero_ps();
            for (w, &e) in ei.iter().enumerate() {
                _mm512_storeu_ps(pp.add(i * bc + SEG * w), _mm512_maskz_mov_ps(keep[w], e));
                if 2 * w < eights {
                    s8 = _mm256_add_ps(s8, _mm512_castps512_ps256(e));
                }
                if 2 * w + 1 < eights {
                    s8 = _mm256_add_ps(s8, _mm512_extractf32x8_ps::<1>(e));
                }
            }
            let mut sum = sum_lanes(s8);
            for j in 8 * eights..valid {
                sum += *pp.add(i * bc + j);
            }
            l[i] = l[i] * corr[i] + sum;
            m[i] = m_new[i];
        }
        corr
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
/// through the loop, the same work hides behind the loads. Same-process A/Bs at depth 4,096,
/// attention alone, against the softmax as one block before the loop: f32 cache 12-14% less
/// time a step on one thread (16 of 16 pairs, twice), 2-4% on two; f16 7% less on one thread
/// and 6% on two (40 of 40), measured with runs over several chunks; bf16 the same time.
/// (An earlier f16 A/B on two threads, before runs crossed chunks, found the spread 15%
/// slower; a later one with a call per chunk found it 4% faster.) Skipped altogether, a wrong
/// result kept only as a bound, the softmax would save another 3%.
///
/// Every value has the operations and order of the separate steps, so the same bits: each
/// score the chain over the columns in order ([`scores`]), each output the chain over the keys
/// in order ([`weighted`]), the maxima, corrections and sums as [`softmax`] takes them (each
/// exponential lane by lane `exp16_grid`'s, the sums a segment's two halves in key order).
/// Requests as [`scores`] and [`weighted`] make them.
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

/// The weights of segment `w` (keys `16 w..16 w + 16`) of `R` rows: each row's scores at `sp`
/// less its new maximum, their exponentials into `pp` (row `i` at `i * bc`), added to the
/// rows' eight-lane sums low half then high half, as [`softmax`] adds them.
///
/// # Safety
/// `sp` and `pp` point at `R x bc` values, `bc >= 16 (w + 1)`.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn segment_weights<const R: usize>(
    sp: *const f32,
    pp: *mut f32,
    bc: usize,
    w: usize,
    m_new: &[f32; R],
    sums: &mut [__m256; R],
) {
    let mut x = [[_mm512_setzero_ps(); 1]; R];
    for (i, xi) in x.iter_mut().enumerate() {
        // SAFETY: inside R x bc, as the caller guarantees.
        let si = unsafe { _mm512_loadu_ps(sp.add(i * bc + SEG * w)) };
        xi[0] = _mm512_sub_ps(si, _mm512_set1_ps(m_new[i]));
    }
    let e = exp16_grid::<R, 1>(x);
    for (i, ei) in e.iter().enumerate() {
        // SAFETY: as above.
        unsafe { _mm512_storeu_ps(pp.add(i * bc + SEG * w), ei[0]) };
        sums[i] = _mm256_add_ps(sums[i], _mm512_castps512_ps256(ei[0]));
        sums[i] = _mm256_add_ps(sums[i], _mm512_extractf32x8_ps::<1>(ei[0]));
    }
}

/// The eight lanes of `v` added in lane order, as `iter().sum()` adds them, taken out of the
/// register one by one rather than stored and read back.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
fn sum_lanes(v: __m256) -> f32 {
    let (lo, hi) = (_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let lanes = [
        _mm_cvtss_f32(lo),
        _mm_cvtss_f32(_mm_movehdup_ps(lo)),
        _mm_cvtss_f32(_mm_movehl_ps(lo, lo)),
        _mm_cvtss_f32(_mm_shuffle_ps::<0b11_11_11_11>(lo, lo)),
        _mm_cvtss_f32(hi),
        _mm_cvtss_f32(_mm_movehdup_ps(hi)),
        _mm_cvtss_f32(_mm_movehl_ps(hi, hi)),
        _mm_cvtss_f32(_mm_shuffle_ps::<0b11_11_11_11>(hi, hi)),
    ];
    lanes.iter().sum()
}

/// The running outputs (dimensions `d0..d0 + 16 W` of `R` rows of `hd` at `op`) rescaled by
/// `corr` and a tile's weighted values `a` added.
///
/// # Safety
/// `op` points at `R x hd` values, `d0 + 16 W <= hd`.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn fold_tile<const R: usize, const W: usize>(
    a: &[[__m512; W]; R],
    op: *mut f32,
    hd: usize,
    d0: usize,
    corr: &[f32; R],
) {
    for (i, ai) in a.iter().enumerate() {
        let ci = _mm512_set1_ps(corr[i]);
        for (x, &ax) in ai.iter().enumerate() {
            // SAFETY: inside R x hd, as the caller guarantees.
            unsafe {
                let o = op.add(i * hd + d0 + 16 * x);
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(o), ci), ax));
            }
        }
    }
}

/// Scores held in registers into `s` (row `i` at `i * bc`).
///
/// # Safety
/// `s` holds `R x bc`, `bc >= 16 N`.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn store_scores<const R: usize, const N: usize>(
    a: &[[__m512; N]; R],
    s: &mut [f32],
    bc: usize,
) {
    let sp = s.as_mut_ptr();
    for (i, ai) in a.iter().enumerate() {
        for (w, &aw) in ai.iter().enumerate() {
            // SAFETY: inside R x bc, as the caller guarantees.
            unsafe { _mm512_storeu_ps(sp.add(i * bc + SEG * w), aw) };
        }
    }
}

/// Column `c` of a tile's keys (sixteen from each of its `N` segments) times the rows' query
/// value `c`, added to the rows' scores `a`: one step of every score's chain.
///
/// # Safety
/// `c < hd`, inside the blocks of `at`; `qp` points at `R x hd` queries.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn score_column<LK: Lanes16, const R: usize, const N: usize>(
    at: &TileAt,
    column: usize,
    qp: *const f32,
    hd: usize,
    c: usize,
    a: &mut [[__m512; N]; R],
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let mut k = [_mm512_setzero_ps(); N];
        for (w, kw) in k.iter_mut().enumerate() {
            *kw = LK::load16(at.keys[w].add(c * column), 0);
        }
        add_outer::<R, N>(a, &k, qp.add(c), hd);
    }
}

/// `a[i][x] += s[i * stride] * v[x]`: each row's scalar times every vector, one multiply-add
/// of each chain.
///
/// # Safety
/// `s` points at `R` values `stride` apart.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn add_outer<const R: usize, const K: usize>(
    a: &mut [[__m512; K]; R],
    v: &[__m512; K],
    s: *const f32,
    stride: usize,
) {
    for (i, ai) in a.iter_mut().enumerate() {
        // SAFETY: as the caller guarantees.
        let si = _mm512_set1_ps(unsafe { *s.add(i * stride) });
        for (ax, &vx) in ai.iter_mut().zip(v) {
            *ax = _mm512_fmadd_ps(si, vx, *ax);
        }
    }
}

/// Dimensions `d0..d0 + 16 W` of key `j`'s value row `row` times the rows' weights of key
/// `j`, added to the rows' sums `a`: one step of every output's chain.
///
/// # Safety
/// `row` holds the dimensions; `pp` points at `R x bc` weights, `j < bc`.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn weigh_key<LV: Lanes16, const R: usize, const W: usize>(
    row: *const u8,
    pp: *const f32,
    bc: usize,
    j: usize,
    d0: usize,
    a: &mut [[__m512; W]; R],
) {
    // SAFETY: as the caller guarantees.
    unsafe {
        let mut vals = [_mm512_setzero_ps(); W];
        for (x, vx) in vals.iter_mut().enumerate() {
            *vx = LV::load16(row, d0 + 16 * x);
        }
        add_outer::<R, W>(a, &vals, pp.add(j), bc);
    }
}

/// The tile's weighted values over its first `valid` keys (all of a whole tile's), 64
/// dimensions a pass, each output the chain of multiply-adds over the keys in order; then the
/// running output rescaled by `corr` and the tile's added.
/// The next tile's value rows are asked for as this tile's are read, the only request for
/// them (see [`scores`]).
///
/// # Safety
/// As [`tiles`].
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn weighted_all<LV: Lanes16, const R: usize, const N: usize>(
    at: &TileAt,
    p: &[f32],
    bc: usize,
    hd: usize,
    acc: &mut [f32],
    corr: &[f32; R],
    valid: usize,
) {
    let pp = p.as_ptr();
    let mut d0 = 0;
    // SAFETY: forwarded.
    unsafe {
        while d0 < hd {
            let ahead = (d0 == 0).then_some(&at.next_values);
            match hd - d0 {
                64.. => weighted::<LV, R, N, 4>(at, ahead, pp, bc, hd, d0, acc, corr, valid),
                32.. => weighted::<LV, R, N, 2>(at, ahead, pp, bc, hd, d0, acc, corr, valid),
                _ => weighted::<LV, R, N, 1>(at, ahead, pp, bc, hd, d0, acc, corr, valid),
            }
            d0 += match hd - d0 {
                64.. => 64,
                32.. => 32,
                _ => 16,
            };
        }
    }
}

/// Dimensions `d0..d0 + 16 W` of the tile's weighted values over its first `valid` keys,
/// added to `acc` rescaled by `corr`; the rows of `ahead` asked for as this tile's are read.
///
/// # Safety
/// As [`tiles`], with `d0 + 16 W <= hd`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
unsafe fn weighted<LV: Lanes16, const R: usize, const N: usize, const W: usize>(
    at: &TileAt,
    ahead: Option<&[*const u8; MAX_SEGS]>,
    pp: *const f32,
    bc: usize,
    hd: usize,
    d0: usize,
    acc: &mut [f32],
    corr: &[f32; R],
    valid: usize,
) {
    let hbv = LV::TY.bytes(hd);
    let op = acc.as_mut_ptr();
    // SAFETY: value loads read row r < 16 of a segment's rows; p and acc are read and written
    // inside the lengths `tiles` checked. Prefetches never fault.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); W]; R];
        // The rows ahead at the pace of this tile's rows (fixed point).
        let lines = (SEG * hbv).div_ceil(64);
        let rate = if ahead.is_some() {
            (lines << 16).div_ceil(SEG)
        } else {
            0
        };
        for w in 0..N {
            let rows = at.values[w];
            let next = ahead.map_or(rows, |a| a[w]);
            let mut done = 0;
            // The segment's rows in the cache (all sixteen but in a partial last tile).
            for r in 0..valid.saturating_sub(SEG * w).min(SEG) {
                let row = rows.add(r * hbv);
                let due = (((r + 1) * rate) >> 16).min(lines);
                for line in done..due {
                    _mm_prefetch::<_MM_HINT_T1>(next.add(64 * line).cast());
                }
                done = due;
                weigh_key::<LV, R, W>(row, pp, bc, SEG * w + r, d0, &mut a);
            }
        }
        fold_tile::<R, W>(&a, op, hd, d0, corr);
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::super::flash::flash_paths;
    use super::super::{AttnShape, AttnWorkspace};
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
        if !super::super::flash_avx512::available() {
            return;
        }
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
                            true,
                            true,
                        );
                        flash_paths(s, qt, kv, vv, t, &mut general[rows], &mut ws, true, false);
                    }
                    let (kv, vv) = pool.layer(id, 0);
                    let mut prefill = vec![0f32; q.len()];
                    flash_paths(s, &q, kv, vv, 0, &mut prefill, &mut ws, true, true);
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
