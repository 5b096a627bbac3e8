//! AVX2 + FMA + F16C kernels. Weights are dequantized in registers (never written back to
//! memory) and accumulated in f32, 8 lanes at a time.

use std::arch::x86_64::*;

use super::scalar;
use crate::cpu::Avx2;
use crate::quant::GgmlType;

/// How far ahead of the current block to prefetch weights (bytes). The hardware prefetcher alone
/// left the streaming matrix-vector kernels at a third of their in-cache speed on the reference VM.
pub(super) const PREFETCH: usize = 1024;

#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Decodes the little-endian f16 at the start of `b` with F16C (a library call per block
/// would cost more than the block's arithmetic).
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) fn f16_scalar(b: &[u8]) -> f32 {
    let bits = u16::from_le_bytes([b[0], b[1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Accumulates `acc += (q * d + m) . x` for one 32-element 4-bit block: `qs` are the 16 packed
/// bytes (low nibbles elements 0..16, high nibbles 16..32).
///
/// # Safety
/// `qs` points at 16 readable bytes and `x` at 32 readable floats.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q4_block(acc: __m256, qs: *const u8, d: __m256, m: __m256, x: *const f32) -> __m256 {
    // SAFETY: the caller guarantees the 16 bytes at `qs` and the 32 floats at `x`.
    unsafe {
        let bytes = _mm_loadu_si128(qs as *const __m128i);
        let mask = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(bytes, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
        let parts = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
        let mut acc = acc;
        for (i, p) in parts.into_iter().enumerate() {
            let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(p));
            let w = _mm256_fmadd_ps(q, d, m);
            acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(x.add(8 * i)), acc);
        }
        acc
    }
}

/// # Safety
/// `row` holds `x.len()` elements of `ty` (whole blocks).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_row(_: Avx2, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    let xp = x.as_ptr();
    let rp = row.as_ptr();
    // SAFETY: block b of the row lies at b * block_bytes of `row` (which holds `x.len()`
    // elements of `ty`, the caller's contract), its elements at b * block_size of `x`; every read
    // stays inside a block, and prefetches never fault.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        match ty {
            GgmlType::Q4_0 => {
                for b in 0..k / 32 {
                    let blk = &row[b * 18..b * 18 + 18];
                    _mm_prefetch(
                        blk.as_ptr().wrapping_add(PREFETCH) as *const i8,
                        _MM_HINT_T0,
                    );
                    let d = f16_scalar(blk);
                    acc = q4_block(
                        acc,
                        rp.add(b * 18 + 2),
                        _mm256_set1_ps(d),
                        _mm256_set1_ps(-8.0 * d),
                        xp.add(b * 32),
                    );
                }
                hsum(acc)
            }
            GgmlType::Q4_1 => {
                for b in 0..k / 32 {
                    let blk = &row[b * 20..b * 20 + 20];
                    _mm_prefetch(
                        blk.as_ptr().wrapping_add(PREFETCH) as *const i8,
                        _MM_HINT_T0,
                    );
                    let (d, m) = (f16_scalar(blk), f16_scalar(&blk[2..]));
                    acc = q4_block(
                        acc,
                        rp.add(b * 20 + 4),
                        _mm256_set1_ps(d),
                        _mm256_set1_ps(m),
                        xp.add(b * 32),
                    );
                }
                hsum(acc)
            }
            GgmlType::Q8_0 => {
                for b in 0..k / 32 {
                    _mm_prefetch(rp.wrapping_add(b * 34 + PREFETCH) as *const i8, _MM_HINT_T0);
                    let d = _mm256_set1_ps(f16_scalar(&row[b * 34..]));
                    let mut blk = _mm256_setzero_ps();
                    for i in 0..4 {
                        let q8 = _mm_loadl_epi64(rp.add(b * 34 + 2 + 8 * i) as *const __m128i);
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                        blk = _mm256_fmadd_ps(q, _mm256_loadu_ps(xp.add(b * 32 + 8 * i)), blk);
                    }
                    acc = _mm256_fmadd_ps(blk, d, acc);
                }
                hsum(acc)
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let full = k / 8 * 8;
                let mut acc2 = _mm256_setzero_ps();
                let mut i = 0;
                while i < full {
                    _mm_prefetch(
                        rp.wrapping_add(i * ty.block_bytes() + PREFETCH) as *const i8,
                        _MM_HINT_T0,
                    );
                    let w = match ty {
                        GgmlType::F32 => _mm256_loadu_ps(rp.add(4 * i) as *const f32),
                        GgmlType::F16 => {
                            _mm256_cvtph_ps(_mm_loadu_si128(rp.add(2 * i) as *const __m128i))
                        }
                        _ => {
                            let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(
                                rp.add(2 * i) as *const __m128i
                            ));
                            _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
                        }
                    };
                    if (i / 8) % 2 == 0 {
                        acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp.add(i)), acc);
                    } else {
                        acc2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp.add(i)), acc2);
                    }
                    i += 8;
                }
                let eb = ty.block_bytes();
                hsum(_mm256_add_ps(acc, acc2)) + scalar::dot_row(ty, &row[full * eb..], &x[full..])
            }
            _ => {
                // Formats without a hand-written f32 kernel: decode one block (32 or a 256-wide
                // super-block) into registers-sized stack memory with the reference decoder
                // (inlined here, so compiled with AVX2), then a fused multiply-add dot.
                let bs = ty.block_size();
                let bb = ty.block_bytes();
                let mut buf = [0f32; 256];
                for (b, blk) in row.chunks_exact(bb).enumerate().take(k / bs) {
                    _mm_prefetch(
                        blk.as_ptr().wrapping_add(PREFETCH) as *const i8,
                        _MM_HINT_T0,
                    );
                    crate::quant::dequantize(ty, blk, &mut buf[..bs])
                        .expect("caller validated the row");
                    for i in (0..bs).step_by(8) {
                        acc = _mm256_fmadd_ps(
                            _mm256_loadu_ps(buf.as_ptr().add(i)),
                            _mm256_loadu_ps(xp.add(b * bs + i)),
                            acc,
                        );
                    }
                }
                hsum(acc)
            }
        }
    }
}

/// Register-blocked f32 tile product: 2 weight rows x 4 tokens per step, 8 accumulators, so
/// each loaded vector is used 2 or 4 times.
#[target_feature(enable = "avx2,fma")]
pub fn gemm_f32(_: Avx2, w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    let rows = w.len() / k;
    let n = x.len() / k;
    let k8 = k / 8 * 8;
    let tail =
        |a: &[f32], b: &[f32]| -> f32 { a[k8..k].iter().zip(&b[k8..k]).map(|(p, q)| p * q).sum() };
    // SAFETY: rows r, r + 1 < rows = w.len() / k of `w` and tokens t..t + 4 <= n = x.len() / k
    // of `x` are read at offsets below k8 <= k; `dot_f32` gets slices of equal length.
    unsafe {
        let mut r = 0;
        while r + 2 <= rows {
            let w0 = w.as_ptr().add(r * k);
            let w1 = w.as_ptr().add((r + 1) * k);
            let mut t = 0;
            while t + 4 <= n {
                let xs = [0, 1, 2, 3].map(|j| x.as_ptr().add((t + j) * k));
                let mut a0 = [_mm256_setzero_ps(); 4];
                let mut a1 = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                while i < k8 {
                    let v0 = _mm256_loadu_ps(w0.add(i));
                    let v1 = _mm256_loadu_ps(w1.add(i));
                    for j in 0..4 {
                        let xv = _mm256_loadu_ps(xs[j].add(i));
                        a0[j] = _mm256_fmadd_ps(v0, xv, a0[j]);
                        a1[j] = _mm256_fmadd_ps(v1, xv, a1[j]);
                    }
                    i += 8;
                }
                for j in 0..4 {
                    let xt = &x[(t + j) * k..(t + j + 1) * k];
                    out[(t + j) * rows + r] = hsum(a0[j]) + tail(&w[r * k..(r + 1) * k], xt);
                    out[(t + j) * rows + r + 1] =
                        hsum(a1[j]) + tail(&w[(r + 1) * k..(r + 2) * k], xt);
                }
                t += 4;
            }
            for t in t..n {
                for rr in r..r + 2 {
                    out[t * rows + rr] = dot_f32(&w[rr * k..(rr + 1) * k], &x[t * k..(t + 1) * k]);
                }
            }
            r += 2;
        }
        for rr in r..rows {
            for t in 0..n {
                out[t * rows + rr] = dot_f32(&w[rr * k..(rr + 1) * k], &x[t * k..(t + 1) * k]);
            }
        }
    }
}

/// # Safety
/// `b` is at least as long as `a`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let k = a.len();
    let k8 = k / 8 * 8;
    // SAFETY: the reads are a[i..i + 8] and b[i..i + 8] with i + 8 <= k8 <= a.len() <= b.len().
    unsafe {
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < k8 {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc,
            );
            i += 8;
        }
        hsum(acc)
            + a[k8..]
                .iter()
                .zip(&b[k8..])
                .map(|(p, q)| p * q)
                .sum::<f32>()
    }
}
