//! Dot products of sparse grouped weights (`quant::sparse_matrix`) with 8-bit activations
//! (AVX-512 VBMI2 and VNNI). Each 32-bit lane of a 512-bit register accumulates one of the
//! group's sixteen rows. Per column, each stored vector is expanded to its 64 dense bytes by
//! `vpexpandb` (zeros in the dropped places) and meets four activation bytes broadcast to every
//! lane in one `vpdpbusd`. That instruction multiplies unsigned by signed bytes, so the
//! activations come biased by 128 (`x + 128`, unsigned) and `128 * sum(w)`, one more `vpdpbusd`
//! per vector shared by every token of the call, is taken off: the integer sum is exactly
//! `sum(w * x)`. It is then scaled exactly as the dense Q8_0 kernel scales its own (one fused
//! multiply-add by `d_w * d_x` per block), so the outputs are the same bits.
//!
//! A 2:4 vector is 32 bytes read instead of 64; the multiply-adds stay those of a dense vector
//! (the dropped half multiplies zeros), so the gain is the bytes that never cross the memory bus.
//! The values are loaded with plain loads and expanded in registers: the memory form of
//! `vpexpandb` measured 2-3x slower on this CPU.

use std::arch::x86_64::*;

use crate::cpu::Vbmi2;
use crate::quant::sparse_matrix::{HEAD, ROWS, Values};

const BITMAP: u8 = 0;
const HALF: u8 = 1;
const NIBBLES: u8 = 2;
/// Prefetch distance in bytes (a few columns ahead).
const AHEAD: usize = 1024;

/// `out[t][r] = dot(row r of the group, xs[t])` for a sparse group.
///
/// # Safety
/// `group` holds a whole sparse group of `d[t].len() * 32` columns laid out as `values` says,
/// and then at least 64 more bytes (`SparseMatrix::group_padded`); for `Int8`, `columns` holds
/// each column's start within it. Every `xs[t]` holds `32 * d[t].len()` biased codes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi2")]
pub unsafe fn dot_sparse_vbmi2<const T: usize>(
    _: Vbmi2,
    values: Values,
    group: &[u8],
    columns: &[u32],
    xs: &[&[u8]; T],
    d: &[&[f32]; T],
    out: &mut [[f32; ROWS]; T],
) {
    // SAFETY: forwarded.
    unsafe {
        match values {
            Values::Int8 => inner::<T, BITMAP>(group, columns, xs, d, out),
            Values::Half => inner::<T, HALF>(group, columns, xs, d, out),
            Values::Nibbles => inner::<T, NIBBLES>(group, columns, xs, d, out),
        }
    }
}

/// [`dot_sparse_vbmi2`] for one value storage (`V`: `BITMAP`, `HALF` or `NIBBLES`).
///
/// # Safety
/// As for the dispatcher.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi2")]
unsafe fn inner<const T: usize, const V: u8>(
    group: &[u8],
    columns: &[u32],
    xs: &[&[u8]; T],
    d: &[&[f32]; T],
    out: &mut [[f32; ROWS]; T],
) {
    let ncols = d[0].len();
    let low = _mm256_set1_epi8(0x0f);
    let eight = _mm256_set1_epi8(8);
    let bias = _mm512_set1_epi8(-128);
    // A fixed-size column's bytes (for the bitmap, about a half-full one's).
    let stride = HEAD + if V == HALF || V == BITMAP { 256 } else { 128 };
    let mut acc = [_mm512_setzero_ps(); T];
    // SAFETY: (whole body) the caller guarantees the group's layout, so every column's header
    // (HEAD bytes) and values lie inside `group`, and each whole-vector load (at most 64 bytes
    // from where a vector's values start) inside it or its 64 bytes of padding; activation
    // block c spans 32 bytes at 32c of each `xs[t]`, whose `d[t]` holds ncols entries.
    unsafe {
        let base = group.as_ptr();
        for c in 0..ncols {
            let p = if V == BITMAP {
                base.add(*columns.get_unchecked(c) as usize)
            } else {
                base.add(c * stride)
            };
            let d16 = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
            let mask = |i: usize| std::ptr::read_unaligned(p.add(2 * ROWS + 8 * i) as *const u64);
            let v = p.add(HEAD);
            // Every line of the column `AHEAD` bytes on (a column spans up to 6 lines).
            for l in 0..(stride.min(HEAD + 256)).div_ceil(64) {
                _mm_prefetch(p.wrapping_add(AHEAD + 64 * l) as *const i8, _MM_HINT_T0);
            }
            let w: [__m512i; 8] = if V == NIBBLES {
                let mut w = [_mm512_setzero_si512(); 8];
                for ch in 0..4 {
                    let raw = _mm256_loadu_si256(v.add(32 * ch) as *const __m256i);
                    let lo = _mm256_sub_epi8(_mm256_and_si256(raw, low), eight);
                    let hi =
                        _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), eight);
                    w[2 * ch] = _mm512_maskz_expand_epi8(mask(2 * ch), _mm512_castsi256_si512(lo));
                    w[2 * ch + 1] =
                        _mm512_maskz_expand_epi8(mask(2 * ch + 1), _mm512_castsi256_si512(hi));
                }
                w
            } else if V == HALF {
                std::array::from_fn(|i| {
                    let raw = _mm256_loadu_si256(v.add(32 * i) as *const __m256i);
                    _mm512_maskz_expand_epi8(mask(i), _mm512_castsi256_si512(raw))
                })
            } else {
                let mut at = v;
                std::array::from_fn(|i| {
                    let m = mask(i);
                    let raw = _mm512_loadu_si512(at as *const __m512i);
                    at = at.add(m.count_ones() as usize);
                    _mm512_maskz_expand_epi8(m, raw)
                })
            };
            // 128 * sum(w) per row, for every token of the call.
            let mut corr = _mm512_setzero_si512();
            for wi in &w {
                corr = _mm512_dpbusd_epi32(corr, bias, *wi);
            }
            for t in 0..T {
                let xp = xs[t].as_ptr().add(32 * c);
                let mut isum = [_mm512_setzero_si512(); 2];
                for (i, wi) in w.iter().enumerate() {
                    let xa =
                        _mm512_set1_epi32(std::ptr::read_unaligned(xp.add(4 * i) as *const i32));
                    isum[i % 2] = _mm512_dpbusd_epi32(isum[i % 2], xa, *wi);
                }
                let isum = _mm512_sub_epi32(_mm512_add_epi32(isum[0], isum[1]), corr);
                let dx = _mm512_set1_ps(*d[t].get_unchecked(c));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d16, dx), acc[t]);
            }
        }
        for t in 0..T {
            // + 0 as the dense kernel adds its (zero) offset: a -0 sum becomes +0 there too.
            _mm512_storeu_ps(
                out[t].as_mut_ptr(),
                _mm512_add_ps(acc[t], _mm512_setzero_ps()),
            );
        }
    }
}
