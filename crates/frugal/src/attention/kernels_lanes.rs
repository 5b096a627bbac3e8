//! How the in-place loops read each cache format: eight ([`Lanes`], AVX2) or sixteen
//! ([`Lanes16`], AVX-512) stored values widened to f32 lanes, with the decoder's own arithmetic
//! (F16C, a shift for bf16, the block scale times each byte for Q8_0), so a tile read in place
//! has the bits of the same tile decoded first.

use std::arch::x86_64::*;

use crate::kv::{KvType, Q8_0_BLOCK};

/// f32 values.
pub(super) struct F32Lanes;
/// f16 values.
pub(super) struct F16Lanes;
/// bf16 values.
pub(super) struct Bf16Lanes;
/// Q8_0 blocks.
pub(super) struct Q8Lanes;

/// Eight stored values widened to f32 lanes: how the in-place loops read each format.
pub(super) trait Lanes {
    /// The stored format.
    const TY: KvType;
    /// Values `d..d + 8` of the stored row at `row` (unaligned; `d` a multiple of 8).
    ///
    /// # Safety
    /// The row holds at least `d + 8` values of `TY` (whole blocks for Q8_0), and the caller runs
    /// with AVX2 and F16C.
    unsafe fn load8(row: *const u8, d: usize) -> __m256;

    /// Whether vectors are best read in pairs ([`Self::load16`] shares work between them).
    const PAIRED: bool = false;

    /// Values `d..d + 16` (`d` a multiple of 16): two [`Self::load8`]s, which a format may
    /// share work between.
    ///
    /// # Safety
    /// As for [`Self::load8`], with `d + 16` values.
    #[inline(always)]
    unsafe fn load16(row: *const u8, d: usize) -> [__m256; 2] {
        // SAFETY: forwarded to the caller.
        unsafe { [Self::load8(row, d), Self::load8(row, d + 8)] }
    }
}

impl Lanes for F32Lanes {
    const TY: KvType = KvType::F32;
    #[inline(always)]
    unsafe fn load8(row: *const u8, d: usize) -> __m256 {
        // SAFETY: forwarded to the caller.
        unsafe { _mm256_loadu_ps(row.add(4 * d).cast()) }
    }
}

impl Lanes for F16Lanes {
    const TY: KvType = KvType::F16;
    #[inline(always)]
    unsafe fn load8(row: *const u8, d: usize) -> __m256 {
        // SAFETY: forwarded to the caller.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * d).cast())) }
    }
}

impl Lanes for Bf16Lanes {
    const TY: KvType = KvType::Bf16;
    #[inline(always)]
    unsafe fn load8(row: *const u8, d: usize) -> __m256 {
        // SAFETY: forwarded to the caller.
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(row.add(2 * d).cast()),
            )))
        }
    }
}

/// Q8_0 values as its decoder gives them: the block's f16 scale times each byte, one f32
/// product (the widenings are exact), so the bits are those of a decoded tile.
impl Lanes for Q8Lanes {
    const TY: KvType = KvType::Q8_0;
    const PAIRED: bool = true;
    #[inline(always)]
    unsafe fn load8(row: *const u8, d: usize) -> __m256 {
        let block = row.wrapping_add(d / Q8_0_BLOCK * (Q8_0_BLOCK + 2));
        // SAFETY: forwarded to the caller: the block's two scale bytes and 32 value bytes are
        // inside the row.
        unsafe {
            let bits = u16::from_le_bytes([*block, *block.add(1)]);
            let scale = _mm256_cvtph_ps(_mm_set1_epi16(bits as i16));
            let ints = _mm_loadl_epi64(block.add(2 + d % Q8_0_BLOCK).cast());
            _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ints)))
        }
    }

    /// Sixteen values of one block (`d` a multiple of 16), its scale widened once.
    #[inline(always)]
    unsafe fn load16(row: *const u8, d: usize) -> [__m256; 2] {
        let block = row.wrapping_add(d / Q8_0_BLOCK * (Q8_0_BLOCK + 2));
        // SAFETY: forwarded to the caller: the block's two scale bytes and 32 value bytes are
        // inside the row.
        unsafe {
            let bits = u16::from_le_bytes([*block, *block.add(1)]);
            let scale = _mm256_cvtph_ps(_mm_set1_epi16(bits as i16));
            let ints = _mm_loadu_si128(block.add(2 + d % Q8_0_BLOCK).cast());
            let widen = |x: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
            [
                _mm256_mul_ps(scale, widen(ints)),
                _mm256_mul_ps(scale, widen(_mm_srli_si128::<8>(ints))),
            ]
        }
    }
}

/// Sixteen stored values widened to f32 lanes: how the in-place loops read each format.
pub(super) trait Lanes16 {
    /// The stored format.
    const TY: KvType;
    /// Values `d..d + 16` of the stored row at `row` (`d` a multiple of 16), as f32.
    ///
    /// # Safety
    /// The row has `TY.bytes(d + 16)` readable bytes, and the caller runs with AVX-512 F.
    unsafe fn load16(row: *const u8, d: usize) -> __m512;
}

impl Lanes16 for F32Lanes {
    const TY: KvType = KvType::F32;
    #[inline(always)]
    unsafe fn load16(row: *const u8, d: usize) -> __m512 {
        // SAFETY: forwarded to the caller.
        unsafe { _mm512_loadu_ps(row.add(4 * d).cast()) }
    }
}

impl Lanes16 for F16Lanes {
    const TY: KvType = KvType::F16;
    #[inline(always)]
    unsafe fn load16(row: *const u8, d: usize) -> __m512 {
        // SAFETY: forwarded to the caller.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(row.add(2 * d).cast())) }
    }
}

impl Lanes16 for Bf16Lanes {
    const TY: KvType = KvType::Bf16;
    #[inline(always)]
    unsafe fn load16(row: *const u8, d: usize) -> __m512 {
        // SAFETY: forwarded to the caller.
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(row.add(2 * d).cast()),
            )))
        }
    }
}

/// Q8_0 values as its decoder gives them: the block's f16 scale times each byte, one f32
/// product (the widenings are exact), so the bits are those of a decoded tile.
impl Lanes16 for Q8Lanes {
    const TY: KvType = KvType::Q8_0;
    #[inline(always)]
    unsafe fn load16(row: *const u8, d: usize) -> __m512 {
        let block = row.wrapping_add(d / 32 * 34);
        // SAFETY: forwarded to the caller: the block's two scale bytes and 32 value bytes are
        // inside the row.
        unsafe {
            let bits = u16::from_le_bytes([*block, *block.add(1)]);
            let scale = _mm512_cvtph_ps(_mm256_set1_epi16(bits as i16));
            let ints = _mm_loadu_si128(block.add(2 + d % 32).cast());
            _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ints)))
        }
    }
}
