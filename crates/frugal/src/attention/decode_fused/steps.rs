//! The steps a fused decode tile is made of ([`super`]): scores, the online softmax, weighted
//! values, and the pieces they share, each value computed with the general loop's operations in
//! its order.

use std::arch::x86_64::*;

use super::super::kernels_avx2::exp_lanes;
use super::super::kernels_avx512::exp16_grid;
use super::super::kernels_lanes::Lanes16;
use super::{MAX_SEGS, SEG, TileAt};

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
/// As [`super::tiles`], for a tile `at` of `N` segments.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn scores<LK: Lanes16, const R: usize, const N: usize>(
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
/// As [`super::tiles`].
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn softmax<const R: usize, const N: usize>(
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
pub(super) fn rebase<const R: usize, const N: usize>(
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
    let corr = exp_lanes::<R>(shift);
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
/// As [`super::tiles`], with `valid` as above.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn softmax_partial<const R: usize, const N: usize>(
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

/// The weights of segment `w` (keys `16 w..16 w + 16`) of `R` rows: each row's scores at `sp`
/// less its new maximum, their exponentials into `pp` (row `i` at `i * bc`), added to the
/// rows' eight-lane sums low half then high half, as [`softmax`] adds them.
///
/// # Safety
/// `sp` and `pp` point at `R x bc` values, `bc >= 16 (w + 1)`.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn segment_weights<const R: usize>(
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
pub(super) fn sum_lanes(v: __m256) -> f32 {
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
pub(super) unsafe fn fold_tile<const R: usize, const W: usize>(
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
pub(super) unsafe fn store_scores<const R: usize, const N: usize>(
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
pub(super) unsafe fn score_column<LK: Lanes16, const R: usize, const N: usize>(
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
pub(super) unsafe fn add_outer<const R: usize, const K: usize>(
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
pub(super) unsafe fn weigh_key<LV: Lanes16, const R: usize, const W: usize>(
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
/// As [`super::tiles`].
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn weighted_all<LV: Lanes16, const R: usize, const N: usize>(
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
/// As [`super::tiles`], with `d0 + 16 W <= hd`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn weighted<LV: Lanes16, const R: usize, const N: usize, const W: usize>(
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
