//! Q3_K (ggml's, bit-compatible): 256-weight super-blocks of 3-bit signed codes with a signed
//! 6-bit scale per 16 weights.
//!
//! 110 bytes per 256 weights (3.4375 bits each): `hmask[32]`, `qs[64]`, `scales[12]`, f16 `d`.
//! Weight `w = 128h + 32j + 16k + l` (h < 2, j < 4, k < 2, l < 16) takes the two bits `2j..2j+2`
//! of `qs[32h + 16k + l]` as `low` and bit `4h + j` of `hmask[16k + l]` as `high`, and its value
//! is `d * S * (low - (high ? 0 : 4))` with `S = s[w / 16] - 32` from the 6-bit scales `s`: the
//! code `low + 4 high` in 0..8 stands for the integer `code - 4` in -4..=3.
//!
//! Scale packing (12 bytes `b`, i < 4): `s[i]` and `s[4 + i]` keep their low four bits in the low
//! nibbles of `b[i]` and `b[4 + i]`, `s[8 + i]` and `s[12 + i]` in the high nibbles of the same;
//! their top two bits are the bit pairs 0, 1, 2, 3 of `b[8 + i]` for `s[i]`, `s[4 + i]`,
//! `s[8 + i]`, `s[12 + i]`.

use super::fit::{best_step, fit_table_scale, nearest};
use super::float::{f16_to_f32, f32_to_f16};
use super::k_quants::{QK_K, half};

pub const Q3_K_BYTES: usize = 110;

/// The integers a code stands for, ascending (code `c` is `GRID[c]`).
const GRID: [f32; 8] = [-4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0];

/// The 16 signed sub-block scales `S = s - 32` from the 12 packed bytes.
pub(super) fn scales(b: &[u8]) -> [i8; 16] {
    std::array::from_fn(|n| {
        let i = n % 4;
        let (low, top) = match n / 4 {
            0 => (b[i] & 0x0f, b[8 + i] & 3),
            1 => (b[4 + i] & 0x0f, (b[8 + i] >> 2) & 3),
            2 => (b[i] >> 4, (b[8 + i] >> 4) & 3),
            _ => (b[4 + i] >> 4, b[8 + i] >> 6),
        };
        ((low | (top << 4)) as i8) - 32
    })
}

/// Inverse of [`scales`] (each in -32..=31).
fn pack_scales(sc: &[i8; 16]) -> [u8; 12] {
    let s: [u8; 16] = std::array::from_fn(|n| (sc[n] + 32) as u8);
    let mut b = [0u8; 12];
    for i in 0..4 {
        b[i] = (s[i] & 0x0f) | ((s[8 + i] & 0x0f) << 4);
        b[4 + i] = (s[4 + i] & 0x0f) | ((s[12 + i] & 0x0f) << 4);
        b[8 + i] =
            (s[i] >> 4) | ((s[4 + i] >> 4) << 2) | ((s[8 + i] >> 4) << 4) | ((s[12 + i] >> 4) << 6);
    }
    b
}

/// The 3-bit code (0..8, standing for `code - 4`) of weight `w` of a block.
pub(super) fn code(block: &[u8], w: usize) -> u8 {
    let (hmask, qs) = (&block[..32], &block[32..96]);
    let low = (qs[32 * (w / 128) + w % 32] >> (2 * ((w / 32) % 4))) & 3;
    let high = (hmask[w % 32] >> (w / 32)) & 1;
    low | (high << 2)
}

#[inline]
pub(super) fn decode_q3_k(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(Q3_K_BYTES))
    {
        let d = half(&b[108..]);
        let sc = scales(&b[96..108]);
        for (n, ys) in y.chunks_exact_mut(16).enumerate() {
            let dl = d * f32::from(sc[n]);
            for (l, v) in ys.iter_mut().enumerate() {
                *v = dl * f32::from(code(b, 16 * n + l) as i8 - 4);
            }
        }
    }
}

/// Encoder for Q3_K: per sub-block of 16 the scale that fits the block best on the grid
/// -4..=3 (`fit::fit_table_scale`), the sixteen scales quantized to signed 6 bits against the
/// largest (which maps to -32), each then moved by a step where that stores its sub-block
/// better, and every weight re-rounded on the decoder's grid.
pub fn quantize_q3_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * Q3_K_BYTES);
    for blk in x.chunks_exact(QK_K) {
        let fitted: [f32; 16] =
            std::array::from_fn(|n| fit_table_scale(&blk[16 * n..][..16], &GRID));
        let max = super::fit::signed_absmax(&fitted);
        let d_bits = f32_to_f16(max / -32.0);
        let d = f16_to_f32(d_bits);
        let inv_d = if d != 0.0 { 1.0 / d } else { 0.0 };
        let sc: [i8; 16] = std::array::from_fn(|n| {
            let sub = &blk[16 * n..][..16];
            let l = (fitted[n] * inv_d).round().clamp(-32.0, 31.0) as i32;
            best_step(sub, &GRID, d, l, -32, 31) as i8
        });
        let mut hmask = [0u8; 32];
        let mut qs = [0u8; 64];
        for (w, &v) in blk.iter().enumerate() {
            let step = d * f32::from(sc[w / 16]);
            let c = if step != 0.0 {
                nearest(&GRID, v / step) as u8
            } else {
                4
            };
            qs[32 * (w / 128) + w % 32] |= (c & 3) << (2 * ((w / 32) % 4));
            hmask[w % 32] |= (c >> 2) << (w / 32);
        }
        out.extend_from_slice(&hmask);
        out.extend_from_slice(&qs);
        out.extend_from_slice(&pack_scales(&sc));
        out.extend_from_slice(&d_bits.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec, research::snr_db};

    use crate::quant::test_signal::sample;

    #[test]
    fn scale_packing_round_trips_every_value() {
        for start in 0..64 {
            let sc: [i8; 16] = std::array::from_fn(|n| ((start + 5 * n) % 64) as i8 - 32);
            assert_eq!(scales(&pack_scales(&sc)), sc);
        }
    }

    #[test]
    fn hand_built_block_decodes() {
        // d = 0.5; sub-block n has S = 2n - 15 (both signs); weight w has code w % 8, written
        // straight from the format's description (not through `code`).
        let sc: [i8; 16] = std::array::from_fn(|n| 2 * n as i8 - 15);
        let mut hmask = [0u8; 32];
        let mut qs = [0u8; 64];
        for h in 0..2 {
            for j in 0..4 {
                for k in 0..2 {
                    for l in 0..16 {
                        let w = 128 * h + 32 * j + 16 * k + l;
                        let c = (w % 8) as u8;
                        qs[32 * h + 16 * k + l] |= (c & 3) << (2 * j);
                        hmask[16 * k + l] |= (c >> 2) << (4 * h + j);
                    }
                }
            }
        }
        let mut b = hmask.to_vec();
        b.extend_from_slice(&qs);
        b.extend_from_slice(&pack_scales(&sc));
        b.extend_from_slice(&[0x00, 0x38]);
        let v = dequantize_to_vec(GgmlType::Q3_K, &b, 256).unwrap();
        for (w, &x) in v.iter().enumerate() {
            let want = 0.5 * f32::from(sc[w / 16]) * ((w % 8) as f32 - 4.0);
            assert_eq!(x, want, "weight {w}");
        }
    }

    #[test]
    fn round_trip_within_bounds() {
        let x = sample(512);
        let bytes = quantize_q3_k(&x);
        assert_eq!(bytes.len(), 2 * Q3_K_BYTES);
        let y = dequantize_to_vec(GgmlType::Q3_K, &bytes, 512).unwrap();
        for (sx, sy) in x.chunks(256).zip(y.chunks(256)) {
            let super_max = sx.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (bx, by) in sx.chunks(16).zip(sy.chunks(16)) {
                // The grid reaches 4 steps one way and 3 the other, so a step of a third of the
                // sub-block's largest magnitude stores it within half a step; rounding the
                // scale to the super-block's 6-bit grid (steps of about a 32nd of the largest
                // scale, itself about a third of the super-block's largest magnitude) moves
                // the outermost code (4) by up to half such a step.
                let amax = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
                let tol = amax / 6.0 + 4.0 * 0.5 * super_max / 3.0 / 32.0 + 1e-6;
                for (a, b) in bx.iter().zip(by) {
                    assert!((a - b).abs() <= tol, "{a} vs {b} (tol {tol})");
                }
            }
        }
        // Three bits: better than 12 dB on this data (a 3-bit uniform grid gives about 15).
        let snr = snr_db(&x, &y);
        assert!(snr > 12.0, "Q3_K {snr:.2} dB");
    }
}
