//! AVX2 (+F16C) decoders of cached rows: attention decodes every tile of a non-f32 cache on
//! every step, so at long context these loops are the cache's read path. Each gives the same
//! bits as the scalar decoder in `format.rs` (conversions from f16, bf16 and i8 to f32 are exact,
//! and Q8_0's scale multiply is the same single f32 product), which a test checks on every format.

use std::arch::x86_64::*;

/// Whether the CPU runs these decoders (checked once per process by the standard library's
/// cached detection).
#[inline]
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

/// `out[i] = f16 value i of src` (`src.len() == 2 * out.len()`).
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn decode_f16(src: &[u8], out: &mut [f32]) {
    assert_eq!(src.len(), 2 * out.len(), "f16 decode lengths");
    let n = out.len();
    let (sp, op) = (src.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    // SAFETY: reads 16 bytes at 2i and writes 8 f32s at i with i + 8 <= n (checked lengths).
    unsafe {
        while i + 8 <= n {
            let h = _mm_loadu_si128(sp.add(2 * i).cast());
            _mm256_storeu_ps(op.add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
    }
    for j in i..n {
        out[j] = half::f16::from_bits(u16::from_le_bytes([src[2 * j], src[2 * j + 1]])).to_f32();
    }
}

/// `out[i] = bf16 value i of src`: the top half of an f32, widened by a shift.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn decode_bf16(src: &[u8], out: &mut [f32]) {
    assert_eq!(src.len(), 2 * out.len(), "bf16 decode lengths");
    let n = out.len();
    let (sp, op) = (src.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    // SAFETY: as in `decode_f16`.
    unsafe {
        while i + 8 <= n {
            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(sp.add(2 * i).cast()));
            _mm256_storeu_si256(op.add(i).cast(), _mm256_slli_epi32::<16>(h));
            i += 8;
        }
    }
    for j in i..n {
        out[j] = f32::from_bits(u32::from(u16::from_le_bytes([src[2 * j], src[2 * j + 1]])) << 16);
    }
}

/// Q8_0 blocks (an f16 scale, 32 signed bytes) to f32: `d * q` per value.
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn decode_q8_0(src: &[u8], out: &mut [f32]) {
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
