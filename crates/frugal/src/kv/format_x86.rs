//! AVX2 (+F16C) decoders of cached rows: attention decodes every tile of a non-f32 cache on
//! every step, so at long context these loops are the cache's read path. Each gives the same
//! bits as the scalar decoder in `format.rs` (conversions from f16, bf16 and i8 to f32 are exact,
//! and Q8_0's scale multiply is the same single f32 product), which a test checks on every format.

use std::arch::x86_64::*;

use crate::cpu::Avx2;

/// Decodes the leading multiple of eight f16 values of `src` into `out`
/// (`src.len() == 2 * out.len()`) and returns how many it decoded; the caller finishes the
/// rest with the scalar decoder.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn decode_f16(t: Avx2, src: &[u8], out: &mut [f32]) -> usize {
    widen_halves(t, src, out, |h| _mm256_cvtph_ps(h))
}

/// [`decode_f16`] for bf16: the top half of an f32, widened by a shift.
#[target_feature(enable = "avx2")]
pub(super) fn decode_bf16(t: Avx2, src: &[u8], out: &mut [f32]) -> usize {
    widen_halves(t, src, out, |h| {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    })
}

/// Widens eight 16-bit values at a time with `widen` over the whole vectors of `out`; returns
/// how many values that was.
#[inline(always)]
fn widen_halves(_: Avx2, src: &[u8], out: &mut [f32], widen: impl Fn(__m128i) -> __m256) -> usize {
    assert_eq!(src.len(), 2 * out.len(), "16-bit decode lengths");
    let whole = out.len() / 8 * 8;
    let (sp, op) = (src.as_ptr(), out.as_mut_ptr());
    // SAFETY: reads 16 bytes at 2i and writes 8 f32s at i with i + 8 <= whole <= out.len(),
    // inside the checked lengths; the token proves the AVX store.
    unsafe {
        for i in (0..whole).step_by(8) {
            _mm256_storeu_ps(op.add(i), widen(_mm_loadu_si128(sp.add(2 * i).cast())));
        }
    }
    whole
}

/// Encodes the leading multiple of eight values of `src` as f16 into `dst`
/// (`dst.len() == 2 * src.len()`), rounding to nearest even as the scalar encoder does, and
/// returns how many it encoded. Every value but a NaN gets the scalar encoder's bits (a NaN
/// stays a NaN of the same sign; its payload may differ). Decode appends every new key and
/// value of every layer: the scalar conversion took 2.3 µs a layer of SmolLM2 (384 values), on
/// the thread the others wait for.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn encode_f16(_: Avx2, src: &[f32], dst: &mut [u8]) -> usize {
    assert_eq!(dst.len(), 2 * src.len(), "f16 encode lengths");
    let whole = src.len() / 8 * 8;
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    // SAFETY: reads 8 f32s at i and writes 16 bytes at 2i with i + 8 <= whole, inside the
    // checked lengths.
    unsafe {
        for i in (0..whole).step_by(8) {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(sp.add(i)));
            _mm_storeu_si128(dp.add(2 * i).cast(), h);
        }
    }
    whole
}

/// Q8_0 blocks (an f16 scale, 32 signed bytes) to f32: `d * q` per value.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn decode_q8_0(_: Avx2, src: &[u8], out: &mut [f32]) {
    const BLOCK: usize = super::format::Q8_0_BLOCK;
    assert!(
        out.len().is_multiple_of(BLOCK) && src.len() == out.len() / BLOCK * (BLOCK + 2),
        "q8_0 decode lengths"
    );
    for (o, b) in out.chunks_exact_mut(BLOCK).zip(src.chunks_exact(BLOCK + 2)) {
        let d = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        // SAFETY: `b` holds 2 + 32 bytes and `o` 32 f32s.
        unsafe {
            let dv = _mm256_set1_ps(d);
            let q = b.as_ptr().add(2);
            for k in 0..4 {
                let bytes = _mm_loadl_epi64(q.add(8 * k).cast());
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * k), _mm256_mul_ps(dv, v));
            }
        }
    }
}
