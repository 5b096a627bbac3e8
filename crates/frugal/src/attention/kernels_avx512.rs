//! AVX-512 versions of flash attention's score, exponential and weighted-value
//! loops: the arithmetic of the AVX2 loops in `kernels_avx2`, sixteen lanes at a time instead of
//! eight. Every output is summed in the same order as there (the scores over the head
//! dimensions, the weighted values over the keys, the exponentials' sum over eight partial
//! lanes), so the bits are those of the AVX2 loops, tested against them; only the count of
//! instructions changes.
//!
//! Why it pays: at long context a decode step is mostly attention (90 MiB of f16 cache per
//! token at depth 4,096 for SmolLM2), and the AVX2 loops issue one FMA per eight multiply-adds
//! plus a load, a widening and a broadcast around them; twice the lanes halve that count. The
//! weighted values also take a 64-wide row of values in one pass over the tile's keys, where
//! the AVX2 loop passes over the keys once per 16 dimensions.

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::kernel::{Columns, Rows, TileKernel};
use super::kernels_lanes::{Bf16Lanes, F16Lanes, F32Lanes, Lanes16, Q8Lanes};
use crate::cpu::{Avx2, Avx512};
use crate::kv::KvType;

use super::kernel::{EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MIN, EXP_POLY, EXP_ROUND, exp_approx};

/// The lanes of columns `j..j + 16` that lie inside a tile `bc` wide.
#[inline(always)]
fn lanes_mask(j: usize, bc: usize) -> __mmask16 {
    let n = (bc - j).min(16);
    ((1u32 << n) - 1) as __mmask16
}

/// `s[i][j] = q_i . k_j` for `R` rows and keys `0..jn` of a transposed tile (`kt[c * bc + j]`),
/// as `kernels_avx2::scores` computes it (each score a chain of fused multiply-adds over the head
/// dimensions in order, from zero), sixty-four, thirty-two or sixteen keys by `R` rows in
/// registers. Columns past `jn` up to the next multiple of 16 (or the tile's end) are computed
/// on whatever the tile holds there.
#[target_feature(enable = "avx512f")]
pub(super) fn scores<const R: usize>(
    _: Avx512,
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
    // SAFETY: full-width reads are kt[c * bc + j ..+ 16 W] with c < hd and j + 16 W <= bc,
    // masked ones stay below bc, q[i * hd + c] has i < R; writes are s[i * bc + j ..] inside
    // row i's bc columns (masked at the tile's end).
    unsafe {
        while j < jn {
            let left = jn - j;
            if left > 32 && j + 64 <= bc {
                scores_w::<R, 4>(qp, kp, sp, hd, bc, j);
                j += 64;
            } else if left > 16 && j + 32 <= bc {
                scores_w::<R, 2>(qp, kp, sp, hd, bc, j);
                j += 32;
            } else {
                let mask = lanes_mask(j, bc);
                let mut a = [_mm512_setzero_ps(); R];
                for c in 0..hd {
                    let k = _mm512_maskz_loadu_ps(mask, kp.add(c * bc + j));
                    for (i, ai) in a.iter_mut().enumerate() {
                        let qc = _mm512_set1_ps(*qp.add(i * hd + c));
                        *ai = _mm512_fmadd_ps(qc, k, *ai);
                    }
                }
                for (i, ai) in a.iter().enumerate() {
                    _mm512_mask_storeu_ps(sp.add(i * bc + j), mask, *ai);
                }
                j += 16;
            }
        }
    }
}

/// Keys `j..j + 16 W` of [`scores`], `W` vectors by `R` rows of accumulators.
///
/// # Safety
/// As [`scores`], with `j + 16 W <= bc`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn scores_w<const R: usize, const W: usize>(
    qp: *const f32,
    kp: *const f32,
    sp: *mut f32,
    hd: usize,
    bc: usize,
    j: usize,
) {
    // SAFETY: forwarded from `scores`.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); W]; R];
        for c in 0..hd {
            let k: [__m512; W] =
                std::array::from_fn(|w| _mm512_loadu_ps(kp.add(c * bc + j + 16 * w)));
            for (i, ai) in a.iter_mut().enumerate() {
                let qc = _mm512_set1_ps(*qp.add(i * hd + c));
                for (aw, kw) in ai.iter_mut().zip(&k) {
                    *aw = _mm512_fmadd_ps(qc, *kw, *aw);
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            for (w, aw) in ai.iter().enumerate() {
                _mm512_storeu_ps(sp.add(i * bc + j + 16 * w), *aw);
            }
        }
    }
}

/// Sixteen lanes of `exp_approx`, operation for operation as `kernels_avx2::exp8` (no fused
/// multiply-adds), so all three give the same bits.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)),
        _mm512_setzero_ps(),
    );
    let round = _mm512_set1_ps(EXP_ROUND);
    let t = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), round);
    let n = _mm512_sub_ps(t, round);
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_HI))),
        _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_LO)),
    );
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
    }
    let er = _mm512_add_ps(
        _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
        _mm512_set1_ps(1.0),
    );
    let bits = _mm512_slli_epi32(
        _mm512_add_epi32(
            _mm512_sub_epi32(
                _mm512_castps_si512(t),
                _mm512_set1_epi32(EXP_ROUND.to_bits() as i32),
            ),
            _mm512_set1_epi32(127),
        ),
        23,
    );
    _mm512_mul_ps(er, _mm512_castsi512_ps(bits))
}

/// [`exp16`] of an `R x N` grid of vectors, each step taken across all of them: one vector's
/// exponential is a chain of some thirty dependent operations, too long for the core's
/// scheduler to overlap many of them when they come one after another. Lane for lane the same
/// operations in the same order, so the same bits.
// Indexed loops: each step written across the grid in the same shape.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) fn exp16_grid<const R: usize, const N: usize>(x: [[__m512; N]; R]) -> [[__m512; N]; R] {
    let round = _mm512_set1_ps(EXP_ROUND);
    let mut x = x;
    for xi in &mut x {
        for xw in xi.iter_mut() {
            *xw = _mm512_min_ps(
                _mm512_max_ps(*xw, _mm512_set1_ps(EXP_MIN)),
                _mm512_setzero_ps(),
            );
        }
    }
    let mut t = [[round; N]; R];
    for i in 0..R {
        for w in 0..N {
            t[i][w] = _mm512_add_ps(_mm512_mul_ps(x[i][w], _mm512_set1_ps(EXP_LOG2E)), round);
        }
    }
    let mut r = [[round; N]; R];
    for i in 0..R {
        for w in 0..N {
            let n = _mm512_sub_ps(t[i][w], round);
            r[i][w] = _mm512_sub_ps(
                _mm512_sub_ps(x[i][w], _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_HI))),
                _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_LO)),
            );
        }
    }
    let mut p = [[_mm512_set1_ps(EXP_POLY[0]); N]; R];
    for &c in &EXP_POLY[1..] {
        for i in 0..R {
            for w in 0..N {
                p[i][w] = _mm512_add_ps(_mm512_mul_ps(p[i][w], r[i][w]), _mm512_set1_ps(c));
            }
        }
    }
    let mut e = p;
    for i in 0..R {
        for w in 0..N {
            let er = _mm512_add_ps(
                _mm512_add_ps(
                    _mm512_mul_ps(_mm512_mul_ps(p[i][w], r[i][w]), r[i][w]),
                    r[i][w],
                ),
                _mm512_set1_ps(1.0),
            );
            let bits = _mm512_slli_epi32(
                _mm512_add_epi32(
                    _mm512_sub_epi32(
                        _mm512_castps_si512(t[i][w]),
                        _mm512_set1_epi32(EXP_ROUND.to_bits() as i32),
                    ),
                    _mm512_set1_epi32(127),
                ),
                23,
            );
            e[i][w] = _mm512_mul_ps(er, _mm512_castsi512_ps(bits));
        }
    }
    e
}

/// `s[j] = exp(s[j] - max)` for every element; returns their sum, with the bits of
/// `kernels_avx2::exp_row`: its eight partial sums take elements `i, i + 8, i + 16, ...` in
/// order, so each sixteen-lane exponential is added to them as its lower half, then its
/// upper half; a last group of eight is one half-used vector, and the remainder goes one by
/// one after the partial sums are added, as there.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2")]
pub(super) fn exp_row(_: Avx512, s: &mut [f32], max: f32) -> f32 {
    let m = _mm512_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = s.chunks_exact_mut(16);
    for c in &mut chunks {
        // SAFETY: c is 16 floats.
        unsafe {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m));
            _mm512_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
            acc = _mm256_add_ps(acc, _mm512_extractf32x8_ps::<1>(e));
        }
    }
    let rest = chunks.into_remainder();
    let (eight, tail) = rest.split_at_mut(rest.len() / 8 * 8);
    if !eight.is_empty() {
        // SAFETY: eight is 8 floats; the upper lanes are masked off on load and store.
        unsafe {
            let e = exp16(_mm512_sub_ps(
                _mm512_maskz_loadu_ps(0xff, eight.as_ptr()),
                m,
            ));
            _mm512_mask_storeu_ps(eight.as_mut_ptr(), 0xff, e);
            acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
        }
    }
    let mut lanes = [0f32; 8];
    // SAFETY: lanes is 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let mut sum = lanes.iter().sum::<f32>();
    for x in tail {
        *x = exp_approx(*x - max);
        sum += *x;
    }
    sum
}

/// `pv[i] (+)= sum_j p[i][j] * v_j`, as `kernels_avx2::weighted_values` computes it (each output
/// a chain of fused multiply-adds over the keys in order), with the same arguments: `p` is
/// `R x bc`, value row `j` is `hd` values of type `ty` (`hd` a multiple of 16) at byte
/// `j * stride` of `v`. Up to sixty-four outputs by `R` rows in registers, so a 64-wide head
/// takes one pass over the keys. A Q8_0 row (which the AVX2 loops do not read) is widened as
/// its decoder widens it, so the bits are those of the same loop over a decoded tile.
#[allow(clippy::too_many_arguments)]
pub(super) fn weighted_values<const R: usize>(
    _: Avx512,
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
#[target_feature(enable = "avx512f")]
unsafe fn weighted<L: Lanes16, const R: usize>(
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
    let mut d0 = 0;
    // SAFETY: the shapes are checked above; each call covers dimensions d0..d0 + 16 W <= hd.
    unsafe {
        while d0 < hd {
            match hd - d0 {
                64.. => {
                    weighted_w::<L, R, 4>(p, bc, v, stride, hd, jn, pv, accumulate, d0, ahead);
                    d0 += 64;
                }
                32.. => {
                    weighted_w::<L, R, 2>(p, bc, v, stride, hd, jn, pv, accumulate, d0, ahead);
                    d0 += 32;
                }
                _ => {
                    weighted_w::<L, R, 1>(p, bc, v, stride, hd, jn, pv, accumulate, d0, ahead);
                    d0 += 16;
                }
            }
        }
    }
}

/// Dimensions `d0..d0 + 16 W` of [`weighted`].
///
/// # Safety
/// As [`weighted`], with `d0 + 16 W <= hd`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn weighted_w<L: Lanes16, const R: usize, const W: usize>(
    p: &[f32],
    bc: usize,
    v: &[u8],
    stride: usize,
    hd: usize,
    jn: usize,
    pv: &mut [f32],
    accumulate: bool,
    d0: usize,
    ahead: &mut Ahead,
) {
    let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), pv.as_mut_ptr());
    // SAFETY: reads values d0..d0 + 16 W <= hd of the row at byte j * stride of v with j < jn, and p[i * bc + j] with i < R, j < jn; reads and writes
    // pv[i * hd + d0 ..+ 16 W]: all inside the lengths `weighted` checked.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); W]; R];
        if accumulate {
            for (i, ai) in a.iter_mut().enumerate() {
                for (w, aw) in ai.iter_mut().enumerate() {
                    *aw = _mm512_loadu_ps(op.add(i * hd + d0 + 16 * w));
                }
            }
        }
        // The value lines `Ahead::leads` ahead as each row is read, on the first pass.
        let lead = if d0 == 0 { ahead.leads()[1] } else { 0 };
        for j in 0..jn {
            let row = vp.add(j * stride);
            if d0 == 0 {
                ahead.advance(1);
                if lead > 0 {
                    super::kernels_avx2::hint_lines::<_MM_HINT_T1>(
                        row.wrapping_add(lead),
                        L::TY.bytes(hd),
                    );
                }
            }
            let vals: [__m512; W] = std::array::from_fn(|w| L::load16(row, d0 + 16 * w));
            for (i, ai) in a.iter_mut().enumerate() {
                let pj = _mm512_set1_ps(*pp.add(i * bc + j));
                for (aw, vw) in ai.iter_mut().zip(&vals) {
                    *aw = _mm512_fmadd_ps(pj, *vw, *aw);
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            for (w, aw) in ai.iter().enumerate() {
                _mm512_storeu_ps(op.add(i * hd + d0 + 16 * w), *aw);
            }
        }
    }
}

/// The AVX-512 level of the tile loop: scores, a row's exponentials and weighted values
/// sixteen lanes wide, the rest (key transposes, integer scores, row maxima, rows of
/// exponentials side by side) at the AVX2 level, whose loops inline into the tile loop (a call
/// apiece to this level's would cost more than the eight-lane maxima of a tile's few scores). Each call from code compiled without AVX-512 is sound because the
/// token proves the features.
impl TileKernel for Avx512 {
    type Below = Avx2;

    #[inline(always)]
    fn below(self) -> Avx2 {
        self.avx2()
    }

    #[inline(always)]
    fn columns(self) -> Option<Columns> {
        Some(Columns {
            avx2: self.avx2(),
            wide: Some(self),
        })
    }

    #[inline(always)]
    fn wide(self) -> Option<Avx512> {
        Some(self)
    }

    #[inline(always)]
    fn scores<const R: usize>(self, q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
        // SAFETY: the token proves the loop's features.
        unsafe { scores::<R>(self, q, kt, bc, jn, s) }
    }

    #[inline(always)]
    fn exp_row(self, s: &mut [f32], max: f32) -> f32 {
        // SAFETY: the token proves the loop's features.
        unsafe { exp_row(self, s, max) }
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

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::super::kernels_avx2;
    use super::{Ahead, Avx512};
    use crate::kv::KvType;

    fn random(n: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// Every loop here against its AVX2 twin, bit for bit: tiles whose width is not a multiple
    /// of 16 (24), key counts around every vector width, the three stored formats read in
    /// place from strided rows, and sums continued across two runs of rows.
    #[test]
    fn avx512_loops_give_the_avx2_bits() {
        let Some(t) = crate::cpu::token_for_test::<Avx512>("avx512_loops_give_the_avx2_bits")
        else {
            return;
        };
        same_bits::<3>(t);
        same_bits::<4>(t);
    }

    fn same_bits<const R: usize>(t: Avx512) {
        let t2 = t.avx2();
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for (hd, bc) in [(64, 64), (128, 32), (16, 24), (48, 40)] {
            let q = random(R * hd, &mut rng);
            let kt = random(hd * bc, &mut rng);
            for jn in [1, 7, 8, 9, 15, 16, 17, 31, 33, 47, 49, bc - 1, bc] {
                if jn > bc {
                    continue;
                }
                let (mut a, mut b) = (vec![0f32; R * bc], vec![0f32; R * bc]);
                // SAFETY: the tokens prove both loops' features.
                unsafe {
                    kernels_avx2::scores::<R>(t2, &q, &kt, bc, jn, &mut a);
                    super::scores::<R>(t, &q, &kt, bc, jn, &mut b);
                }
                for i in 0..R {
                    for j in 0..jn {
                        assert_eq!(
                            a[i * bc + j].to_bits(),
                            b[i * bc + j].to_bits(),
                            "score {i},{j} (hd {hd}, jn {jn})"
                        );
                    }
                }
                let mut row: Vec<f32> = a[..jn].iter().map(|x| 3.0 * x).collect();
                row[jn / 2] = -7.0;
                let (mut e2, mut e5) = (row.clone(), row.clone());
                // SAFETY: as above.
                let (s2, s5) = unsafe {
                    (
                        kernels_avx2::exp_row(t2, &mut e2, 1.25),
                        super::exp_row(t, &mut e5, 1.25),
                    )
                };
                assert_eq!(s2.to_bits(), s5.to_bits(), "exp sum, jn {jn}");
                assert_eq!(e2, e5, "exponentials, jn {jn}");

                let p: Vec<f32> = random(R * bc, &mut rng).iter().map(|x| x.abs()).collect();
                let vals = random(bc * hd, &mut rng);
                for ty in [KvType::F32, KvType::F16, KvType::Bf16] {
                    // Rows of the stored type, spread apart as a paged cache holds them.
                    let width = if ty == KvType::F32 { 4 } else { 2 };
                    let stride = 3 * width * hd + 8;
                    let mut v = vec![0u8; bc * stride];
                    for (j, row) in vals.chunks_exact(hd).enumerate() {
                        for (c, &x) in row.iter().enumerate() {
                            let at = j * stride + width * c;
                            match ty {
                                KvType::F32 => v[at..at + 4].copy_from_slice(&x.to_le_bytes()),
                                KvType::F16 => v[at..at + 2]
                                    .copy_from_slice(&half::f16::from_f32(x).to_le_bytes()),
                                _ => v[at..at + 2]
                                    .copy_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
                            }
                        }
                    }
                    let split = jn / 2;
                    let run = |wide: bool, out: &mut Vec<f32>| {
                        out.clear();
                        out.resize(R * hd, 0.0);
                        #[allow(clippy::type_complexity)]
                        let f: &dyn Fn(
                            &[f32],
                            &[u8],
                            usize,
                            &mut [f32],
                            bool,
                            &mut Ahead,
                        ) = if wide {
                            &|p, v, jn, out, acc, ahead| {
                                super::weighted_values::<R>(
                                    t, p, bc, v, stride, ty, hd, jn, out, acc, ahead,
                                )
                            }
                        } else {
                            &|p, v, jn, out, acc, ahead| {
                                kernels_avx2::weighted_values::<R>(
                                    t2, p, bc, v, stride, ty, hd, jn, out, acc, ahead,
                                )
                            }
                        };
                        let ahead = &mut super::Ahead::default();
                        // The runs cover keys 0..split and split..jn.
                        if split > 0 {
                            f(&p, &v, split, out, false, ahead);
                        }
                        f(
                            &p[split..],
                            &v[split * stride..],
                            jn - split,
                            out,
                            split > 0,
                            ahead,
                        );
                    };
                    let (mut o2, mut o5) = (Vec::new(), Vec::new());
                    run(false, &mut o2);
                    run(true, &mut o5);
                    assert_eq!(o2, o5, "weighted values, {ty:?}, hd {hd}, jn {jn}");
                }
            }
        }
    }
}
