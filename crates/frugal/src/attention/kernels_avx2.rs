//! AVX2+FMA versions of flash attention's three inner loops, for `R` query rows at a time:
//! scores against a transposed key tile, the exponentials of a score row, and the weighted sum
//! of value rows. Their scalar twins are the portable functions in `kernel`; `tests` compares the
//! two.
//!
//! The key transpose and the weighted values read cached rows in place when the cache holds
//! f32, f16 or bf16 (and the values when it holds Q8_0): each load of eight stored values widens
//! them to f32 lanes (F16C, a shift for bf16, the block scale times each byte for Q8_0), so a
//! narrow cache costs no separate decode pass and less memory traffic. The widening is the
//! decoder's own arithmetic, so the bits are those of decoding the tile first.

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::kernel::{Columns, Portable, Rows, TileKernel};
use super::kernels_lanes::{Bf16Lanes, F16Lanes, F32Lanes, Lanes, Q8Lanes};
use super::q8_keys::{KeyRows, QuantQueries};
use crate::cpu::Avx2;
use crate::kv::{KvType, Q8_0_BLOCK};

use super::kernel::{EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MIN, EXP_POLY, EXP_ROUND, exp_approx};

/// `s[i][j] = q_i . k_j` for `R` rows and keys `0..jn` of a transposed tile (`kt[c * bc + j]`),
/// twenty-four, sixteen or eight keys by `R` rows in registers: each key vector loaded serves `R`
/// rows, and each score is one chain of multiply-adds over the dimensions in order.
/// Columns past `jn` up to the next multiple of 8 are computed on whatever the tile holds there.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn scores<const R: usize>(
    _: Avx2,
    q: &[f32],
    kt: &[f32],
    bc: usize,
    jn: usize,
    s: &mut [f32],
) {
    let hd = q.len() / R;
    assert!(
        bc.is_multiple_of(8) && jn <= bc && kt.len() >= hd * bc && s.len() >= R * bc,
        "flash scores: tile shapes"
    );
    let (qp, kp, sp) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
    let mut j = 0;
    // SAFETY: every read is kt[c * bc + j + 0..8W] with c < hd and j + 8W <= bc, or
    // q[i * hd + c] with i < R; writes are s[i * bc + j ..+8W] in bounds.
    unsafe {
        while j < jn {
            // Three vectors of keys when three rows or fewer leave registers for them: nine
            // independent chains of multiply-adds keep both FMA pipes busy where six (two
            // vectors by three rows, decode of a GQA group of three) waited on their latency.
            let key = |c: usize, w: usize| _mm256_loadu_ps(kp.add(c * bc + j + 8 * w));
            if R <= 3 && j + 24 <= bc && jn - j > 16 {
                score_keys::<R, 3>(qp, hd, key, ColumnHint::NONE, sp.add(j), bc);
                j += 24;
            } else if j + 16 <= bc && jn - j > 8 {
                score_keys::<R, 2>(qp, hd, key, ColumnHint::NONE, sp.add(j), bc);
                j += 16;
            } else {
                score_keys::<R, 1>(qp, hd, key, ColumnHint::NONE, sp.add(j), bc);
                j += 8;
            }
        }
    }
}

/// Lines for [`score_keys`] to ask for as it reads keys kept by column, one stream of them:
/// at dimension `c` with `c & mask == 0`, the line at `at + c * stride`.
#[derive(Copy, Clone)]
pub(super) struct LineHint {
    at: *const u8,
    stride: usize,
    mask: usize,
}

impl LineHint {
    /// The lines of the `len` bytes from `at`, asked for over the `hd` columns of a block: a
    /// share of whole lines' bytes per column, one request every few columns, requests at
    /// most a line apart. Every line is asked for while a share is at most a line (a block of
    /// up to sixteen positions, any format); of a longer share only the first line is. A
    /// request per column at most, at a multiple of a fixed stride, keeps the column loop a
    /// few pointer additions longer.
    pub(super) fn spread(at: *const u8, len: usize, hd: usize) -> LineHint {
        let first = at.wrapping_sub(at as usize % 64);
        let whole = (at as usize % 64 + len).next_multiple_of(64);
        let stride = whole.div_ceil(hd.max(1)).max(1);
        let mask = (1usize << (64 / stride).max(1).ilog2()) - 1;
        LineHint {
            at: first,
            stride,
            mask,
        }
    }

    /// The lines asked for over `hd` columns, in order (for tests).
    #[cfg(test)]
    pub(super) fn requested(&self, hd: usize) -> Vec<usize> {
        (0..hd)
            .filter(|c| c & self.mask == 0)
            .map(|c| (self.at as usize + c * self.stride) / 64)
            .collect()
    }

    #[inline(always)]
    fn column(&self, c: usize) {
        if c & self.mask == 0 {
            // SAFETY: prefetching is a hint that never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.at.wrapping_add(c * self.stride).cast()) };
        }
    }
}

/// What [`score_keys`] asks for as it reads: the next tile's keys, and this tile's values
/// (see `Ahead::leads`).
#[derive(Copy, Clone)]
pub(super) struct ColumnHint {
    pub(super) keys: Option<LineHint>,
    pub(super) values: Option<LineHint>,
}

impl ColumnHint {
    pub(super) const NONE: ColumnHint = ColumnHint {
        keys: None,
        values: None,
    };
}

/// Scores of `8W` keys for `R` rows: `W` vectors of keys by `R` rows of accumulators, each a
/// chain of multiply-adds over the dimensions in order; key vector `w` of dimension `c` comes
/// from `key(c, w)` (a transposed tile, or a block of keys kept by column), row `i`'s scores go
/// to `s[i * bc ..+8W]`.
///
/// # Safety
/// `key` reads inside its source, and `q[i * hd + c]` for
/// `i < R`, `c < hd` and `s[i * bc ..+8W]` lie inside the caller's slices.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn score_keys<const R: usize, const W: usize>(
    qp: *const f32,
    hd: usize,
    key: impl Fn(usize, usize) -> __m256,
    hint: ColumnHint,
    sp: *mut f32,
    bc: usize,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        let mut a = [[_mm256_setzero_ps(); W]; R];
        for c in 0..hd {
            if let Some(h) = hint.keys {
                h.column(c);
            }
            if let Some(h) = hint.values {
                h.column(c);
            }
            let k: [__m256; W] = std::array::from_fn(|w| key(c, w));
            for (i, ai) in a.iter_mut().enumerate() {
                let qc = _mm256_broadcast_ss(&*qp.add(i * hd + c));
                for (aw, &kw) in ai.iter_mut().zip(&k) {
                    *aw = _mm256_fmadd_ps(qc, kw, *aw);
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            for (w, &aw) in ai.iter().enumerate() {
                _mm256_storeu_ps(sp.add(i * bc + 8 * w), aw);
            }
        }
    }
}

/// Eight lanes of `exp_approx`, operation for operation (no fused multiply-adds), so the two
/// give the same bits.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    let [e] = exp8s([x]);
    e
}

/// [`exp8`] of `N` vectors at once, each step taken across all of them: the exponential is one
/// chain of some thirty dependent operations, and `N` independent chains side by side keep the
/// vector units busy where one chain waits on its own latency (the core's scheduler holds too
/// few of a lone chain's operations to overlap many vectors of it). Each lane's operations and
/// their order are `exp8`'s, so the bits are too.
// Indexed loops: each step written across the N vectors in the same shape.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8s<const N: usize>(x: [__m256; N]) -> [__m256; N] {
    let round = _mm256_set1_ps(EXP_ROUND);
    let (mut t, mut r, mut p) = ([round; N], [round; N], [_mm256_set1_ps(EXP_POLY[0]); N]);
    let mut x = x;
    for i in 0..N {
        x[i] = _mm256_min_ps(
            _mm256_max_ps(x[i], _mm256_set1_ps(EXP_MIN)),
            _mm256_setzero_ps(),
        );
    }
    for i in 0..N {
        t[i] = _mm256_add_ps(_mm256_mul_ps(x[i], _mm256_set1_ps(EXP_LOG2E)), round);
    }
    for i in 0..N {
        let n = _mm256_sub_ps(t[i], round);
        r[i] = _mm256_sub_ps(
            _mm256_sub_ps(x[i], _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI))),
            _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)),
        );
    }
    for &c in &EXP_POLY[1..] {
        for i in 0..N {
            p[i] = _mm256_add_ps(_mm256_mul_ps(p[i], r[i]), _mm256_set1_ps(c));
        }
    }
    for i in 0..N {
        let er = _mm256_add_ps(
            _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p[i], r[i]), r[i]), r[i]),
            _mm256_set1_ps(1.0),
        );
        let bits = _mm256_slli_epi32(
            _mm256_add_epi32(
                _mm256_sub_epi32(
                    _mm256_castps_si256(t[i]),
                    _mm256_set1_epi32(EXP_ROUND.to_bits() as i32),
                ),
                _mm256_set1_epi32(127),
            ),
            23,
        );
        x[i] = _mm256_mul_ps(er, _mm256_castsi256_ps(bits));
    }
    x
}

/// The largest element of `s` (`-inf` when empty), NaNs ignored: the value of the scalar
/// `fold(-inf, f32::max)`, eight lanes at a time. That fold is a serial chain of NaN-aware
/// maxima (a compare and a blend each, four cycles of latency per score), which at decode cost
/// as much as the scores themselves; the maximum of a set does not depend on the order it is
/// taken in, so the value is the same (a zero's sign aside, which changes no `exp` after it).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn row_max(_: Avx2, s: &[f32]) -> f32 {
    let mut acc = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        // SAFETY: c is 8 floats. MAXPS returns its second operand when either is NaN, so a
        // NaN score leaves the running maximum (never NaN itself) as it was.
        unsafe { acc = _mm256_max_ps(_mm256_loadu_ps(c.as_ptr()), acc) };
    }
    let mut lanes = [0f32; 8];
    // SAFETY: lanes is 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    lanes
        .iter()
        .chain(chunks.remainder())
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x))
}

/// `s[j] = exp(s[j] - max)` for every element; returns their sum (eight partial sums, then
/// added: a different order from the scalar loop's, within the same few ulps).
#[target_feature(enable = "avx2,fma")]
pub(super) fn exp_row(_: Avx2, s: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: c is 8 floats.
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: lanes is 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut sum = lanes.iter().sum::<f32>();
    for x in chunks.into_remainder() {
        *x = exp_approx(*x - max);
        sum += *x;
    }
    sum
}

/// [`exp_row`] of `R` rows at once (rows `i * stride + lo..i * stride + hi` of `s`, each less
/// its own `max[i]`): the rows' exponentials side by side ([`exp8s`]) rather than one row's
/// chain after another. Each row's values and sum are `exp_row`'s bits.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn exp_rows<const R: usize>(
    _: Avx2,
    s: &mut [f32],
    stride: usize,
    lo: usize,
    hi: usize,
    max: [f32; R],
) -> [f32; R] {
    assert!(lo <= hi && (R == 0 || (R - 1) * stride + hi <= s.len()));
    let mut m = [_mm256_setzero_ps(); R];
    for (mi, &x) in m.iter_mut().zip(&max) {
        *mi = _mm256_set1_ps(x);
    }
    let mut acc = [_mm256_setzero_ps(); R];
    let whole = lo + (hi - lo) / 8 * 8;
    let base = s.as_mut_ptr();
    let mut j = lo;
    while j < whole {
        // SAFETY: rows i < R hold j + 8 <= hi values at offset i * stride (asserted above).
        unsafe {
            let mut x = [_mm256_setzero_ps(); R];
            for (i, xi) in x.iter_mut().enumerate() {
                *xi = _mm256_sub_ps(_mm256_loadu_ps(base.add(i * stride + j)), m[i]);
            }
            let e = exp8s(x);
            for i in 0..R {
                _mm256_storeu_ps(base.add(i * stride + j), e[i]);
                acc[i] = _mm256_add_ps(acc[i], e[i]);
            }
        }
        j += 8;
    }
    let mut sums = [0f32; R];
    for (i, sum) in sums.iter_mut().enumerate() {
        let mut lanes = [0f32; 8];
        // SAFETY: lanes is 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i]) };
        *sum = lanes.iter().sum::<f32>();
        for x in &mut s[i * stride + whole..i * stride + hi] {
            *x = exp_approx(*x - max[i]);
            *sum += *x;
        }
    }
    sums
}

/// `exp_approx` of up to eight values in one vector: the same bits, without a chain of thirty
/// scalar operations per value. Takes no token: the AVX-512 decode steps call it from their own
/// target features; callers without them hold an [`Avx2`].
#[target_feature(enable = "avx2,fma")]
pub(super) fn exp_lanes<const N: usize>(x: [f32; N]) -> [f32; N] {
    const { assert!(N <= 8) };
    let mut lanes = [0f32; 8];
    // `exp_approx` takes `x.min(0.0)` first, which also maps NaN to 0 (`exp8`'s clamp would map
    // it to its floor).
    for (l, &v) in lanes.iter_mut().zip(&x) {
        *l = v.min(0.0);
    }
    // SAFETY: lanes is 8 floats.
    unsafe {
        let e = exp8(_mm256_loadu_ps(lanes.as_ptr()));
        _mm256_storeu_ps(lanes.as_mut_ptr(), e);
    }
    std::array::from_fn(|i| lanes[i])
}

/// Asks for the lines of the `len` bytes at `at` (a hint: any address will do), into the
/// cache level `HINT` names (`_MM_HINT_T0`: L1; `_MM_HINT_T1`: L2).
#[inline(always)]
pub(super) fn hint_lines<const HINT: i32>(at: *const u8, len: usize) {
    let (first, last) = (at as usize >> 6, (at as usize + len.max(1) - 1) >> 6);
    for line in first..=last {
        // SAFETY: prefetching is a hint that never faults, whatever the address.
        unsafe { _mm_prefetch::<HINT>(std::ptr::without_provenance(line << 6)) };
    }
}

/// Whether the key transpose reads a cache of type `ty` in place (every format but Q8_0, whose
/// keys are scored in integers instead, see `kernels_q8_avx2`). The weighted values read every
/// format in place.
pub(super) fn reads_in_place(ty: KvType) -> bool {
    matches!(ty, KvType::F32 | KvType::F16 | KvType::Bf16)
}

/// `pv[i] (+)= sum_j p[i][j] * v_j` for `R` rows and keys `0..jn`: `p` is `R x bc` (row `i` at
/// `i * bc`), value row `j` is `hd` values of type `ty` (any format; `hd` a multiple of
/// 16) at byte `j * stride` of `v` (a decoded tile, or the cache itself read in place).
/// Thirty-two or sixteen outputs by `R` rows in registers, each loaded value vector serving `R`
/// rows, and each output one chain of multiply-adds over the keys in order. With
/// `accumulate` the sums continue from `pv`, so a tile taken in several runs (a paged cache's
/// blocks) gives the same bits as in one.
#[allow(clippy::too_many_arguments)]
pub(super) fn weighted_values<const R: usize>(
    _: Avx2,
    p: &[f32],
    bc: usize,
    v: &[u8],
    stride: usize,
    ty: KvType,
    hd: usize,
    jn: usize,
    pv: &mut [f32],
    accumulate: bool,
    ahead: &mut Ahead,
) {
    let a = ahead;
    // SAFETY: the token proves `weighted`'s features; it checks the shapes.
    unsafe {
        match ty {
            KvType::F32 => weighted::<F32Lanes, R>(p, bc, v, stride, hd, jn, pv, accumulate, a),
            KvType::F16 => weighted::<F16Lanes, R>(p, bc, v, stride, hd, jn, pv, accumulate, a),
            KvType::Bf16 => weighted::<Bf16Lanes, R>(p, bc, v, stride, hd, jn, pv, accumulate, a),
            KvType::Q8_0 => weighted::<Q8Lanes, R>(p, bc, v, stride, hd, jn, pv, accumulate, a),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weighted<L: Lanes, const R: usize>(
    p: &[f32],
    bc: usize,
    v: &[u8],
    stride: usize,
    hd: usize,
    jn: usize,
    pv: &mut [f32],
    accumulate: bool,
    ahead: &mut Ahead,
) {
    assert!(
        hd.is_multiple_of(16)
            && jn >= 1
            && jn <= bc
            && p.len() >= (R - 1) * bc + jn
            && v.len() >= (jn - 1) * stride + L::TY.bytes(hd)
            && pv.len() >= R * hd,
        "flash weighted values: tile shapes"
    );
    let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), pv.as_mut_ptr());
    // SAFETY: reads values d0..d0 + 8W of the row at byte j * stride of v with j < jn,
    // d0 + 8W <= hd, and p[i * bc + j] with i < R, j < jn; reads and writes
    // pv[i * hd + d0 ..+8W]: all inside the checked lengths (unaligned loads: the cache's bytes
    // carry no alignment).
    unsafe {
        let mut d0 = 0;
        while d0 < hd {
            // Twenty-four outputs a pass for three rows or fewer: nine independent chains of
            // multiply-adds, where sixteen outputs by three rows (decode of a GQA group of
            // three) gave six that waited on their latency. Thirty-two (twelve sums, three
            // weights and a value: all sixteen registers) leave the compiler two sums short, and
            // their spill and reload at every key puts a store in two chains.
            // Sixteen otherwise and for what is left, eight for a last odd vector; Q8_0 keeps
            // sixteen, which share a block scale.
            if R <= 3 && !L::PAIRED && d0 + 24 <= hd {
                weigh_pass::<L, R, 3>(pp, bc, vp, stride, hd, jn, op, accumulate, ahead, d0);
                d0 += 24;
            } else if !L::PAIRED && d0 + 16 > hd {
                weigh_pass::<L, R, 1>(pp, bc, vp, stride, hd, jn, op, accumulate, ahead, d0);
                d0 += 8;
            } else {
                weigh_pass::<L, R, 2>(pp, bc, vp, stride, hd, jn, op, accumulate, ahead, d0);
                d0 += 16;
            }
        }
    }
}

/// Outputs `d0..d0 + 8W` of [`weighted`]'s `R` rows: `W` vectors by `R` rows of accumulators,
/// each a chain of multiply-adds over the keys in order. The rows' weights of a key are
/// broadcast first and each value vector is loaded as it is used (twenty-four outputs by three
/// rows: nine sums, three weights and one value in registers); Q8_0 loads its pairs
/// of vectors first, which share a block scale. Reports the keys to `ahead` on the first pass
/// (`d0 == 0`).
///
/// # Safety
/// As for [`weighted`]'s body, with `d0 + 8W <= hd` (`W` even and `d0` a multiple of 16
/// where `L` reads pairs of vectors).
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weigh_pass<L: Lanes, const R: usize, const W: usize>(
    pp: *const f32,
    bc: usize,
    vp: *const u8,
    stride: usize,
    hd: usize,
    jn: usize,
    op: *mut f32,
    accumulate: bool,
    ahead: &mut Ahead,
    d0: usize,
) {
    // SAFETY: forwarded to the caller.
    unsafe {
        let mut a = [[_mm256_setzero_ps(); W]; R];
        if accumulate {
            for (i, ai) in a.iter_mut().enumerate() {
                for (w, aw) in ai.iter_mut().enumerate() {
                    *aw = _mm256_loadu_ps(op.add(i * hd + d0 + 8 * w));
                }
            }
        }
        debug_assert!(!L::PAIRED || W.is_multiple_of(2));
        // The value lines `Ahead::leads` ahead as each row is read, on the first pass.
        let lead = if d0 == 0 { ahead.leads()[1] } else { 0 };
        let row_bytes = L::TY.bytes(hd);
        let mut row = vp;
        for j in 0..jn {
            if d0 == 0 {
                ahead.advance(1);
                if lead > 0 {
                    hint_lines::<_MM_HINT_T0>(row.wrapping_add(lead), row_bytes);
                }
            }
            let pj: [__m256; R] =
                std::array::from_fn(|i| _mm256_broadcast_ss(&*pp.add(i * bc + j)));
            let mut weigh = |w: usize, v: __m256| {
                for (ai, &p) in a.iter_mut().zip(&pj) {
                    ai[w] = _mm256_fmadd_ps(p, v, ai[w]);
                }
            };
            if L::PAIRED {
                for h in 0..W / 2 {
                    let [v0, v1] = L::load16(row, d0 + 16 * h);
                    weigh(2 * h, v0);
                    weigh(2 * h + 1, v1);
                }
            } else {
                for w in 0..W {
                    weigh(w, L::load8(row, d0 + 8 * w));
                }
            }
            row = row.add(stride);
        }
        for (i, ai) in a.iter().enumerate() {
            for (w, &aw) in ai.iter().enumerate() {
                _mm256_storeu_ps(op.add(i * hd + d0 + 8 * w), aw);
            }
        }
    }
}

/// `kt[c * bc + j0 + j] = row_j[c]` for `m` rows of `hd` values of type `ty` (any format; `hd`
/// a multiple of 8, of 32 for Q8_0) at byte `j * stride` of `src`: the transposed key tile `scores`
/// reads, filled eight rows by eight columns at a time with in-register 8x8 transposes, straight
/// from the cache (the scalar twin is `kernel::Portable`'s `transpose_keys`).
#[allow(clippy::too_many_arguments)]
pub(super) fn transpose_rows(
    _: Avx2,
    src: &[u8],
    stride: usize,
    ty: KvType,
    m: usize,
    hd: usize,
    kt: &mut [f32],
    bc: usize,
    j0: usize,
    ahead: &mut Ahead,
) {
    let a = ahead;
    // SAFETY: the token proves `transpose`'s features; it checks the shapes.
    unsafe {
        match ty {
            KvType::F32 => transpose::<F32Lanes>(src, stride, m, hd, kt, bc, j0, a),
            KvType::F16 => transpose::<F16Lanes>(src, stride, m, hd, kt, bc, j0, a),
            KvType::Bf16 => transpose::<Bf16Lanes>(src, stride, m, hd, kt, bc, j0, a),
            KvType::Q8_0 => transpose::<Q8Lanes>(src, stride, m, hd, kt, bc, j0, a),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose<L: Lanes>(
    src: &[u8],
    stride: usize,
    m: usize,
    hd: usize,
    kt: &mut [f32],
    bc: usize,
    j0: usize,
    ahead: &mut Ahead,
) {
    assert!(
        hd.is_multiple_of(8)
            && m >= 1
            && j0 + m <= bc
            && kt.len() >= hd * bc
            && src.len() >= (m - 1) * stride + L::TY.bytes(hd),
        "flash key transpose: tile shapes"
    );
    let (sp, kp) = (src.as_ptr(), kt.as_mut_ptr());
    // SAFETY: reads values c0..c0 + 8 of the row at byte (j + i) * stride with j + i < m and
    // c0 + 8 <= hd; writes kt[(c0 + c) * bc + j0 + j ..+8] with j0 + j + 8 <= j0 + m <= bc; the
    // tail reads the row's first hd values into a local: all inside the checked lengths.
    unsafe {
        let row = |j: usize| sp.add(j * stride);
        let mut j = 0;
        while j + 8 <= m {
            ahead.advance(8);
            for c0 in (0..hd).step_by(8) {
                let r: [__m256; 8] = std::array::from_fn(|i| L::load8(row(j + i), c0));
                let t: [__m256; 8] = std::array::from_fn(|i| {
                    let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
                    if i % 2 == 0 {
                        _mm256_unpacklo_ps(a, b)
                    } else {
                        _mm256_unpackhi_ps(a, b)
                    }
                });
                // u[4h + q] holds element 4h.. of column q (and q + 4 in the upper half).
                let u: [__m256; 8] = std::array::from_fn(|i| {
                    let (h, q) = (i / 4, i % 4);
                    let (a, b) = (t[4 * h + q / 2], t[4 * h + 2 + q / 2]);
                    if q % 2 == 0 {
                        _mm256_shuffle_ps::<0x44>(a, b)
                    } else {
                        _mm256_shuffle_ps::<0xEE>(a, b)
                    }
                });
                for c in 0..8 {
                    let col = if c < 4 {
                        _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c])
                    } else {
                        _mm256_permute2f128_ps::<0x31>(u[c - 4], u[c])
                    };
                    _mm256_storeu_ps(kp.add((c0 + c) * bc + j0 + j), col);
                }
            }
            j += 8;
        }
        // The last rows one at a time, eight columns per load, scattered down the columns.
        let mut lanes = [0f32; 8];
        for jj in j..m {
            ahead.advance(1);
            for c0 in (0..hd).step_by(8) {
                _mm256_storeu_ps(lanes.as_mut_ptr(), L::load8(row(jj), c0));
                for (c, &x) in lanes.iter().enumerate() {
                    *kp.add((c0 + c) * bc + j0 + jj) = x;
                }
            }
        }
    }
}

/// The AVX2 level of the tile loop: the loops above, the integer Q8_0 scores of
/// `kernels_q8_avx2` (heads of up to `MAX_BLOCKS` blocks) and the column kernels of
/// `kernels_columns`. Each call from code compiled without AVX2 is sound because the token
/// proves the features.
impl TileKernel for Avx2 {
    type Below = Portable;

    #[inline(always)]
    fn below(self) -> Portable {
        Portable
    }

    #[inline(always)]
    fn keys_in_place(self, ty: KvType) -> bool {
        reads_in_place(ty)
    }

    #[inline(always)]
    fn values_in_place(self) -> bool {
        true
    }

    #[inline(always)]
    fn columns(self) -> Option<Columns> {
        Some(Columns {
            avx2: self,
            wide: None,
        })
    }

    #[inline(always)]
    fn transpose_keys(
        self,
        k: Rows,
        n: usize,
        hd: usize,
        kt: &mut [f32],
        bc: usize,
        at: usize,
        ahead: &mut Ahead,
    ) {
        transpose_rows(self, k.bytes, k.stride, k.ty, n, hd, kt, bc, at, ahead)
    }

    #[inline(always)]
    fn scores<const R: usize>(self, q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
        // SAFETY: the token proves the loop's features.
        unsafe { scores::<R>(self, q, kt, bc, jn, s) }
    }

    #[inline(always)]
    fn scores_q8<const R: usize>(
        self,
        qq: &QuantQueries,
        row0: usize,
        hd: usize,
        keys: &KeyRows,
        jn: usize,
        bc: usize,
        s: &mut [f32],
        ahead: &mut Ahead,
    ) {
        if hd > super::kernels_q8_avx2::MAX_BLOCKS * Q8_0_BLOCK {
            return self
                .below()
                .scores_q8::<R>(qq, row0, hd, keys, jn, bc, s, ahead);
        }
        // SAFETY: the token proves the kernel's features.
        unsafe {
            super::kernels_q8_avx2::scores_q8::<R>(self, qq, row0, hd, keys, jn, bc, s, ahead)
        }
    }

    #[inline(always)]
    fn row_max(self, s: &[f32]) -> f32 {
        // SAFETY: the token proves the loop's features.
        unsafe { row_max(self, s) }
    }

    #[inline(always)]
    fn exp_row(self, s: &mut [f32], max: f32) -> f32 {
        // SAFETY: the token proves the loop's features.
        unsafe { exp_row(self, s, max) }
    }

    #[inline(always)]
    fn exp_rows<const R: usize>(
        self,
        s: &mut [f32],
        stride: usize,
        lo: usize,
        hi: usize,
        max: [f32; R],
    ) -> [f32; R] {
        // SAFETY: the token proves the loop's features.
        unsafe { exp_rows::<R>(self, s, stride, lo, hi, max) }
    }

    #[inline(always)]
    fn exp_lanes<const N: usize>(self, x: [f32; N]) -> [f32; N] {
        // SAFETY: the token proves AVX2 and FMA.
        unsafe { exp_lanes(x) }
    }

    #[inline(always)]
    fn weighted_values<const R: usize>(
        self,
        p: &[f32],
        bc: usize,
        v: Rows,
        hd: usize,
        jn: usize,
        pv: &mut [f32],
        accumulate: bool,
        ahead: &mut Ahead,
    ) {
        let (b, st, ty) = (v.bytes, v.stride, v.ty);
        weighted_values::<R>(self, p, bc, b, st, ty, hd, jn, pv, accumulate, ahead)
    }
}
