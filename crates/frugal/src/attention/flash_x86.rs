//! AVX2+FMA versions of flash attention's three inner loops, for `R` query rows at a time:
//! scores against a transposed key tile, the exponentials of a score row, and the weighted sum
//! of value rows. Their scalar twins are the portable functions in `flash`; `tests` compares the
//! two.

use std::arch::x86_64::*;

use super::flash::{
    EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MIN, EXP_POLY, EXP_ROUND, R, exp_approx,
};

/// `s[i][j] = q_i . k_j` for `R` rows and keys `0..jn` of a transposed tile (`kt[c * bc + j]`),
/// sixteen (or eight) keys by `R` rows in registers: each key vector loaded serves `R` rows.
/// Columns past `jn` up to the next multiple of 8 are computed on whatever the tile holds there.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn scores(q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
    let hd = q.len() / R;
    assert!(
        bc.is_multiple_of(8) && jn <= bc && kt.len() >= hd * bc && s.len() >= R * bc,
        "flash scores: tile shapes"
    );
    let (qp, kp, sp) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
    let mut j = 0;
    // SAFETY: every read is kt[c * bc + j + 0..16] with c < hd and j + 16 <= bc (or + 8 for
    // the single-chunk step), or q[i * hd + c] with i < R; writes are s[i * bc + j ..] in bounds.
    unsafe {
        while j < jn {
            if j + 16 <= bc && jn - j > 8 {
                let mut a = [[_mm256_setzero_ps(); 2]; R];
                for c in 0..hd {
                    let k0 = _mm256_loadu_ps(kp.add(c * bc + j));
                    let k1 = _mm256_loadu_ps(kp.add(c * bc + j + 8));
                    for (i, ai) in a.iter_mut().enumerate() {
                        let qc = _mm256_broadcast_ss(&*qp.add(i * hd + c));
                        ai[0] = _mm256_fmadd_ps(qc, k0, ai[0]);
                        ai[1] = _mm256_fmadd_ps(qc, k1, ai[1]);
                    }
                }
                for (i, ai) in a.iter().enumerate() {
                    _mm256_storeu_ps(sp.add(i * bc + j), ai[0]);
                    _mm256_storeu_ps(sp.add(i * bc + j + 8), ai[1]);
                }
                j += 16;
            } else {
                let mut a = [_mm256_setzero_ps(); R];
                for c in 0..hd {
                    let k0 = _mm256_loadu_ps(kp.add(c * bc + j));
                    for (i, ai) in a.iter_mut().enumerate() {
                        let qc = _mm256_broadcast_ss(&*qp.add(i * hd + c));
                        *ai = _mm256_fmadd_ps(qc, k0, *ai);
                    }
                }
                for (i, ai) in a.iter().enumerate() {
                    _mm256_storeu_ps(sp.add(i * bc + j), *ai);
                }
                j += 8;
            }
        }
    }
}

/// Eight lanes of `exp_approx`, operation for operation (no fused multiply-adds), so the two
/// give the same bits.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)),
        _mm256_setzero_ps(),
    );
    let round = _mm256_set1_ps(EXP_ROUND);
    let t = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), round);
    let n = _mm256_sub_ps(t, round);
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_HI))),
        _mm256_mul_ps(n, _mm256_set1_ps(EXP_LN2_LO)),
    );
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    let er = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
        _mm256_set1_ps(1.0),
    );
    let bits = _mm256_slli_epi32(
        _mm256_add_epi32(
            _mm256_sub_epi32(
                _mm256_castps_si256(t),
                _mm256_set1_epi32(EXP_ROUND.to_bits() as i32),
            ),
            _mm256_set1_epi32(127),
        ),
        23,
    );
    _mm256_mul_ps(er, _mm256_castsi256_ps(bits))
}

/// `s[j] = exp(s[j] - max)` for every element; returns their sum (eight partial sums, then
/// added: a different order from the scalar loop's, within the same few ulps).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn exp_row(s: &mut [f32], max: f32) -> f32 {
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

/// `pv[i] = sum_j p[i][j] * v_j` for `R` rows (`p` is `R x bc`, `v` row-major, `hd` per key, a
/// multiple of 16), keys `0..jn`: sixteen outputs by `R` rows in registers, each loaded value
/// vector serving `R` rows.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn weighted_values(
    p: &[f32],
    bc: usize,
    v: &[f32],
    hd: usize,
    jn: usize,
    pv: &mut [f32],
) {
    assert!(
        hd.is_multiple_of(16)
            && jn <= bc
            && p.len() >= R * bc
            && v.len() >= jn * hd
            && pv.len() >= R * hd,
        "flash weighted values: tile shapes"
    );
    let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), pv.as_mut_ptr());
    // SAFETY: reads v[j * hd + d0 ..+16] with j < jn, d0 + 16 <= hd, and p[i * bc + j] with
    // i < R, j < jn <= bc; writes pv[i * hd + d0 ..+16]: all inside the checked lengths.
    unsafe {
        for d0 in (0..hd).step_by(16) {
            let mut a = [[_mm256_setzero_ps(); 2]; R];
            for j in 0..jn {
                let v0 = _mm256_loadu_ps(vp.add(j * hd + d0));
                let v1 = _mm256_loadu_ps(vp.add(j * hd + d0 + 8));
                for (i, ai) in a.iter_mut().enumerate() {
                    let pj = _mm256_broadcast_ss(&*pp.add(i * bc + j));
                    ai[0] = _mm256_fmadd_ps(pj, v0, ai[0]);
                    ai[1] = _mm256_fmadd_ps(pj, v1, ai[1]);
                }
            }
            for (i, ai) in a.iter().enumerate() {
                _mm256_storeu_ps(op.add(i * hd + d0), ai[0]);
                _mm256_storeu_ps(op.add(i * hd + d0 + 8), ai[1]);
            }
        }
    }
}
