//! Integer dot products of packed block-quantized weights (see `quant::packed`) with 8-bit
//! activations (x86).
//!
//! Each i32 lane accumulates one of the group's eight rows; per block, the eight integer sums are
//! converted once and scaled by the eight `d_w` times `d_x` into an f32 accumulator. The
//! u8 x i8 step is `maddubs + madd` on AVX2 and a single `vpdpbusd` with AVX-512 VNNI; one macro
//! writes both so they cannot drift apart.

use std::arch::x86_64::*;

use super::avx2::PREFETCH;
use crate::quant::GgmlType;
use crate::quant::act::Q8Row;
use crate::quant::packed::{GROUP, layout};

#[target_feature(enable = "avx2")]
#[inline]
fn udot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
    )
}

#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
fn udot_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

macro_rules! dot_packed_kernel {
    ($name:ident, $features:literal, $udot:ident) => {
        /// Dot products of one packed group of eight rows with `T` activation rows:
        /// `out[t][r] = dot(row r, xs[t])`. The unpacked weights of each block are reused for
        /// all `T` tokens (prefill); decode uses `T = 1`.
        ///
        /// # Safety
        /// `group` holds a whole packed group of `ty` covering `xs[t].qs.len()` elements (equal
        /// for all t), and the CPU has the features this kernel is compiled for.
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const T: usize>(
            ty: GgmlType,
            group: &[u8],
            xs: &[Q8Row; T],
            out: &mut [[f32; GROUP]; T],
        ) {
            let (head, qbytes) = layout(ty).expect("packed type");
            let col = head + GROUP * qbytes;
            let nb = xs[0].qs.len() / 32;
            debug_assert!(group.len() >= nb * col);
            let base = group.as_ptr();
            let mut acc = [_mm256_setzero_ps(); T];
            let mut offset = [_mm256_setzero_ps(); T];
            let mask = _mm256_set1_epi8(0x0f);
            // SAFETY (whole body): block column b spans base + b*col .. base + (b+1)*col inside
            // `group`; activation block b spans 32 bytes at 32b inside each `xs[t].qs`, whose
            // `d` and `s` hold nb entries. Prefetches are hints that never fault.
            unsafe {
                for b in 0..nb {
                    let blk = base.add(b * col);
                    _mm_prefetch(blk.wrapping_add(PREFETCH) as *const i8, _MM_HINT_T0);
                    _mm_prefetch(blk.wrapping_add(PREFETCH + 64) as *const i8, _MM_HINT_T0);
                    _mm_prefetch(blk.wrapping_add(PREFETCH + 128) as *const i8, _MM_HINT_T0);
                    // Eight rows' scales in one conversion.
                    let d8 = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
                    let data = blk.add(head);
                    if ty == GgmlType::Q8_0 {
                        let w: [__m256i; 8] = std::array::from_fn(|c| {
                            _mm256_loadu_si256(data.add(32 * c) as *const __m256i)
                        });
                        let wabs: [__m256i; 8] =
                            std::array::from_fn(|c| _mm256_sign_epi8(w[c], w[c]));
                        for t in 0..T {
                            let xp = xs[t].qs.as_ptr().add(32 * b);
                            let mut isum = _mm256_setzero_si256();
                            for c in 0..8 {
                                let xa = _mm256_set1_epi32(std::ptr::read_unaligned(
                                    xp.add(4 * c) as *const i32
                                ));
                                // Signed x signed through unsigned x signed: |w| * (x * sign(w)).
                                isum = $udot(isum, wabs[c], _mm256_sign_epi8(xa, w[c]));
                            }
                            let sc = _mm256_mul_ps(d8, _mm256_set1_ps(*xs[t].d.get_unchecked(b)));
                            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[t]);
                        }
                    } else {
                        // Offsets: Q4_1's minimum m, or Q4_0's -8d, times sum(x) = s.
                        let m8 = if ty == GgmlType::Q4_0 {
                            _mm256_mul_ps(d8, _mm256_set1_ps(-8.0))
                        } else {
                            _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * GROUP) as *const __m128i))
                        };
                        let w: [__m256i; 4] = std::array::from_fn(|c| {
                            _mm256_loadu_si256(data.add(32 * c) as *const __m256i)
                        });
                        let lo: [__m256i; 4] =
                            std::array::from_fn(|c| _mm256_and_si256(w[c], mask));
                        let hi: [__m256i; 4] = std::array::from_fn(|c| {
                            _mm256_and_si256(_mm256_srli_epi16(w[c], 4), mask)
                        });
                        for t in 0..T {
                            let xp = xs[t].qs.as_ptr().add(32 * b);
                            let mut isum = _mm256_setzero_si256();
                            for c in 0..4 {
                                let xa = _mm256_set1_epi32(std::ptr::read_unaligned(
                                    xp.add(8 * c) as *const i32
                                ));
                                let xb = _mm256_set1_epi32(std::ptr::read_unaligned(
                                    xp.add(8 * c + 4) as *const i32,
                                ));
                                isum = $udot(isum, lo[c], xa);
                                isum = $udot(isum, hi[c], xb);
                            }
                            let sc = _mm256_mul_ps(d8, _mm256_set1_ps(*xs[t].d.get_unchecked(b)));
                            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[t]);
                            offset[t] = _mm256_fmadd_ps(
                                m8,
                                _mm256_set1_ps(*xs[t].s.get_unchecked(b)),
                                offset[t],
                            );
                        }
                    }
                }
                for t in 0..T {
                    _mm256_storeu_ps(out[t].as_mut_ptr(), _mm256_add_ps(acc[t], offset[t]));
                }
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
