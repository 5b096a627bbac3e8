//! Dot products of sparse grouped weights (`quant::sparse_matrix`) with 8-bit activations:
//! each stored vector expanded to its 32 dense bytes by `vpexpandb` (AVX-512 VBMI2), zeros in the
//! dropped places, then the dense Q8_0 kernel's arithmetic (`x86_int8`): `|w| * (x * sign(w))`
//! through `vpdpbusd`, the two halves' integer sums added, one fused multiply-add per block. A
//! 2:4 vector is 16 bytes read instead of 32; the multiply-adds stay those of the dense kernel
//! (the dropped half multiplies zeros), so the gain is the bytes that never cross the memory bus.

use std::arch::x86_64::*;

use crate::quant::act::Q8Row;
use crate::quant::packed::GROUP;
use crate::quant::sparse_matrix::{HEAD, Values};

/// `out[t][r] = dot(row r of the group, xs[t])` for a sparse group.
///
/// # Safety
/// `group` holds a whole sparse group covering `xs[t].qs.len()` elements (a multiple of 32,
/// equal for all t; `d` holds one scale per 32), laid out as `values` says, and then at least
/// 32 more bytes (`SparseMatrix::group_padded`), and the CPU has the features below.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi2")]
pub unsafe fn dot_sparse_vbmi2<const T: usize>(
    values: Values,
    group: &[u8],
    xs: &[Q8Row; T],
    out: &mut [[f32; GROUP]; T],
) {
    // SAFETY: forwarded.
    unsafe {
        match values {
            Values::Int8 => inner::<T, BITMAP>(group, xs, out),
            Values::Half => inner::<T, HALF>(group, xs, out),
            Values::Nibbles => inner::<T, NIBBLES>(group, xs, out),
        }
    }
}

const BITMAP: u8 = 0;
const HALF: u8 = 1;
const NIBBLES: u8 = 2;

/// [`dot_sparse_vbmi2`] for one value storage (`V`: `BITMAP`, `HALF` or `NIBBLES`).
///
/// # Safety
/// As for the dispatcher.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi2")]
unsafe fn inner<const T: usize, const V: u8>(
    group: &[u8],
    xs: &[Q8Row; T],
    out: &mut [[f32; GROUP]; T],
) {
    let ncols = xs[0].qs.len() / 32;
    let low = _mm_set1_epi8(0x0f);
    let eight = _mm_set1_epi8(8);
    let mut acc = [_mm256_setzero_ps(); T];
    let end = group.as_ptr_range().end;
    // SAFETY (whole body): the caller guarantees the group's layout, so every column's header
    // (HEAD bytes) and values (popcount(masks) bytes, or 64 for nibbles) lie inside `group`;
    // the masked loads read only the selected bytes; activation block c spans 32 bytes at 32c
    // of each `xs[t].qs`, whose `d` holds ncols entries.
    unsafe {
        let mut p = group.as_ptr();
        for c in 0..ncols {
            let d8 = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            let masks: [u32; 8] =
                std::array::from_fn(|i| std::ptr::read_unaligned(p.add(16 + 4 * i) as *const u32));
            let mut v = p.add(HEAD);
            _mm_prefetch(v.wrapping_add(1024) as *const i8, _MM_HINT_T0);
            _mm_prefetch(v.wrapping_add(1024 + 64) as *const i8, _MM_HINT_T0);
            let w: [__m256i; 8] = if V == NIBBLES {
                let mut w = [_mm256_setzero_si256(); 8];
                for ch in 0..4 {
                    let raw = _mm_loadu_si128(v.add(16 * ch) as *const __m128i);
                    let lo = _mm_sub_epi8(_mm_and_si128(raw, low), eight);
                    let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight);
                    w[2 * ch] = _mm256_maskz_expand_epi8(masks[2 * ch], _mm256_castsi128_si256(lo));
                    w[2 * ch + 1] =
                        _mm256_maskz_expand_epi8(masks[2 * ch + 1], _mm256_castsi128_si256(hi));
                }
                v = v.add(64);
                w
            } else if V == HALF {
                let w = std::array::from_fn(|i| {
                    let raw = _mm_loadu_si128(v.add(16 * i) as *const __m128i);
                    _mm256_maskz_expand_epi8(masks[i], _mm256_castsi128_si256(raw))
                });
                v = v.add(128);
                w
            } else {
                // A plain 32-byte load expanded in registers: the memory form of `vpexpandb`
                // measured 2-3x slower on this CPU. The matrix's buffer is padded so the load
                // never leaves it.
                std::array::from_fn(|i| {
                    let raw = _mm256_loadu_si256(v as *const __m256i);
                    v = v.add(masks[i].count_ones() as usize);
                    _mm256_maskz_expand_epi8(masks[i], raw)
                })
            };
            debug_assert!(v <= end);
            let wu: [__m256i; 8] = std::array::from_fn(|i| _mm256_sign_epi8(w[i], w[i]));
            for t in 0..T {
                let xp = xs[t].qs.as_ptr().add(32 * c);
                let mut isum = [_mm256_setzero_si256(); 2];
                for i in 0..8 {
                    let xa = _mm256_set1_epi32(std::ptr::read_unaligned(xp.add(4 * i) as *const i32));
                    let xa = _mm256_sign_epi8(xa, w[i]);
                    isum[i / 4] = _mm256_dpbusd_epi32(isum[i / 4], wu[i], xa);
                }
                let dx = _mm256_set1_ps(*xs[t].d.get_unchecked(c));
                let isum = _mm256_add_epi32(isum[0], isum[1]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, dx), acc[t]);
            }
            p = v;
        }
        for t in 0..T {
            _mm256_storeu_ps(
                out[t].as_mut_ptr(),
                _mm256_add_ps(acc[t], _mm256_setzero_ps()),
            );
        }
    }
}
