//! Integer dot products of packed block-quantized weights (see `quant::packed`) with 8-bit
//! activations (x86).
//!
//! Per 32-element block: the weight bytes are widened to 32 unsigned (Q4) or signed (Q8) bytes,
//! multiplied with the activation bytes and summed to eight i32 lanes, converted once, and scaled
//! by `d_w * d_x` into an f32 accumulator. The u8 x i8 step is `maddubs + madd` on AVX2 and a
//! single `vpdpbusd` with AVX-512 VNNI; one macro writes both so they cannot drift apart.

use std::arch::x86_64::*;

use super::avx2::PREFETCH;
use crate::quant::GgmlType;
use crate::quant::act::Q8Row;
use crate::quant::packed::{GROUP, layout};

#[target_feature(enable = "avx2")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[target_feature(enable = "avx2")]
#[inline]
fn udot_avx2(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
fn udot_vnni(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

macro_rules! dot_packed_kernel {
    ($name:ident, $features:literal, $udot:ident) => {
        /// Dot products of one packed group of four rows with the activations `x`.
        ///
        /// # Safety
        /// `group` holds a whole packed group of `ty` covering `x.qs.len()` elements, and the
        /// CPU has the features this kernel is compiled for.
        #[target_feature(enable = $features)]
        pub unsafe fn $name(ty: GgmlType, group: &[u8], x: Q8Row, out: &mut [f32; GROUP]) {
            let (head, qbytes) = layout(ty).expect("packed type");
            let col = head + GROUP * qbytes;
            let nb = x.qs.len() / 32;
            debug_assert!(group.len() >= nb * col && x.d.len() >= nb && x.s.len() >= nb);
            let base = group.as_ptr();
            let xp = x.qs.as_ptr();
            let mut acc = [_mm256_setzero_ps(); GROUP];
            let mut offset = _mm_setzero_ps();
            let lane = [
                _mm256_set1_epi32(0),
                _mm256_set1_epi32(1),
                _mm256_set1_epi32(2),
                _mm256_set1_epi32(3),
            ];
            // SAFETY (whole body): block column b spans base + b*col .. base + (b+1)*col inside
            // `group`; activation block b is xp + 32b inside `x.qs`; `x.d`, `x.s` hold nb
            // entries. Prefetches are hints that never fault.
            unsafe {
                for b in 0..nb {
                    let blk = base.add(b * col);
                    _mm_prefetch(blk.wrapping_add(PREFETCH) as *const i8, _MM_HINT_T0);
                    _mm_prefetch(blk.wrapping_add(PREFETCH + 64) as *const i8, _MM_HINT_T0);
                    let xq = _mm256_loadu_si256(xp.add(b * 32) as *const __m256i);
                    let (dx, sx) = (*x.d.get_unchecked(b), *x.s.get_unchecked(b));
                    // Four rows' scales in one conversion, times the activation scale.
                    let d4 = _mm_cvtph_ps(_mm_loadl_epi64(blk as *const __m128i));
                    let s4 = _mm_mul_ps(d4, _mm_set1_ps(dx));
                    let s8 = _mm256_set_m128(s4, s4);
                    match ty {
                        GgmlType::Q8_0 => {
                            for r in 0..GROUP {
                                let w =
                                    _mm256_loadu_si256(blk.add(head + r * 32) as *const __m256i);
                                // Signed x signed through the unsigned x signed instruction:
                                // |w| * (x * sign(w)).
                                let p = $udot(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
                                let sc = _mm256_permutevar8x32_ps(s8, lane[r]);
                                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[r]);
                            }
                        }
                        _ => {
                            // Offsets: Q4_1's minimum m, or Q4_0's -8d, times sum(x) = s.
                            let m4 = if ty == GgmlType::Q4_0 {
                                _mm_mul_ps(d4, _mm_set1_ps(-8.0))
                            } else {
                                _mm_cvtph_ps(_mm_loadl_epi64(blk.add(8) as *const __m128i))
                            };
                            offset = _mm_fmadd_ps(m4, _mm_set1_ps(sx), offset);
                            let mask = _mm_set1_epi8(0x0f);
                            for r in 0..GROUP {
                                let w = _mm_loadu_si128(blk.add(head + r * 16) as *const __m128i);
                                let lo = _mm_and_si128(w, mask);
                                let hi = _mm_and_si128(_mm_srli_epi16(w, 4), mask);
                                let p = $udot(_mm256_set_m128i(hi, lo), xq);
                                let sc = _mm256_permutevar8x32_ps(s8, lane[r]);
                                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[r]);
                            }
                        }
                    }
                }
            }
            let mut off = [0f32; GROUP];
            // SAFETY: `off` has room for four f32.
            unsafe { _mm_storeu_ps(off.as_mut_ptr(), offset) };
            for r in 0..GROUP {
                out[r] = hsum(acc[r]) + off[r];
            }
        }
    };
}

dot_packed_kernel!(dot_packed_avx2, "avx2,fma,f16c", udot_avx2);
dot_packed_kernel!(
    dot_packed_vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    udot_vnni
);
