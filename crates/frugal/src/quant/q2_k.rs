//! Q2_K (ggml's, bit-compatible): 256-weight super-blocks of 2-bit codes with a 4-bit scale and
//! a 4-bit min per 16 weights.
//!
//! 84 bytes per 256 weights (2.625 bits each): `scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`.
//! Sub-block n (16 weights) has `S = scales[n]`, scale `d * (S & 15)` and min `dmin * (S >> 4)`;
//! weight `w = 128h + 32j + 16k + l` (h < 2, j < 4, k < 2, l < 16) takes the bits `2j..2j+2` of
//! `qs[32h + 16k + l]` as its code q, and its value is `d * (S & 15) * q - dmin * (S >> 4)`.
//! (The code planes are Q3_K's low bits.)
//!
//! The coarsest K-quant: with four levels per weight, the fitted min matters as much as the
//! scale, so both are fitted per sub-block and both get their own super-scale.

use super::float::{f16_to_f32, f32_to_f16};
use super::k_quants::{QK_K, fit_asymmetric, grid_error, half};

pub const Q2_K_BYTES: usize = 84;

/// The 2-bit code of weight `w` of a block.
pub(super) fn code(block: &[u8], w: usize) -> u8 {
    (block[16 + 32 * (w / 128) + w % 32] >> (2 * ((w / 32) % 4))) & 3
}

#[inline]
pub(super) fn decode_q2_k(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(Q2_K_BYTES))
    {
        let (d, dmin) = (half(&b[80..]), half(&b[82..]));
        for (n, ys) in y.chunks_exact_mut(16).enumerate() {
            let dl = d * f32::from(b[n] & 0x0f);
            let ml = dmin * f32::from(b[n] >> 4);
            for (l, v) in ys.iter_mut().enumerate() {
                *v = dl * f32::from(code(b, 16 * n + l)) - ml;
            }
        }
    }
}

/// Encoder for Q2_K: per sub-block of 16 a fitted (scale, min) on 0..=3
/// (`k_quants::fit_asymmetric`), both quantized to 4 bits against the super-block maxima, then
/// each sub-block's pair moved by up to a step either way where that stores it better (with
/// only 16 levels, rounding each independently is often a step off the best pair), and every
/// weight re-rounded on the decoder's grid.
pub fn quantize_q2_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * Q2_K_BYTES);
    for blk in x.chunks_exact(QK_K) {
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        for (n, sub) in blk.chunks_exact(16).enumerate() {
            let (a, b) = fit_asymmetric(sub, None, 3.0);
            scales[n] = a;
            mins[n] = -b;
        }
        let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
        let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
        let (d_bits, dmin_bits) = (f32_to_f16(max_scale / 15.0), f32_to_f16(max_min / 15.0));
        let (d, dmin) = (f16_to_f32(d_bits), f16_to_f32(dmin_bits));
        let to4 = |v: f32, step: f32| -> i32 {
            if step > 0.0 {
                (v / step).round().clamp(0.0, 15.0) as i32
            } else {
                0
            }
        };
        let mut sc = [0u8; 16];
        for (n, sub) in blk.chunks_exact(16).enumerate() {
            let (l0, m0) = (to4(scales[n], d), to4(mins[n], dmin));
            let mut best = (l0, m0);
            let err =
                |l: i32, m: i32| grid_error(sub, None, d * l as f32, -(dmin * m as f32), 0.0, 3.0);
            let mut best_err = err(l0, m0);
            for l in (l0 - 1).max(0)..=(l0 + 1).min(15) {
                for m in (m0 - 1).max(0)..=(m0 + 1).min(15) {
                    let e = err(l, m);
                    if e < best_err {
                        best = (l, m);
                        best_err = e;
                    }
                }
            }
            sc[n] = best.0 as u8 | ((best.1 as u8) << 4);
        }
        let mut qs = [0u8; 64];
        for (w, &v) in blk.iter().enumerate() {
            let s = sc[w / 16];
            let dl = d * f32::from(s & 0x0f);
            let ml = dmin * f32::from(s >> 4);
            let q = if dl != 0.0 {
                ((v + ml) / dl).round().clamp(0.0, 3.0) as u8
            } else {
                0
            };
            qs[32 * (w / 128) + w % 32] |= q << (2 * ((w / 32) % 4));
        }
        out.extend_from_slice(&sc);
        out.extend_from_slice(&qs);
        out.extend_from_slice(&d_bits.to_le_bytes());
        out.extend_from_slice(&dmin_bits.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec, research::snr_db};

    use crate::quant::test_signal::sample;

    #[test]
    fn hand_built_block_decodes() {
        // d = 0.5, dmin = 0.25; sub-block n has scale n and min 15 - n; weight w has code
        // w % 4, written straight from the format's description.
        let mut b: Vec<u8> = (0..16u8).map(|n| n | ((15 - n) << 4)).collect();
        let mut qs = [0u8; 64];
        for h in 0..2 {
            for j in 0..4 {
                for k in 0..2 {
                    for l in 0..16 {
                        let w = 128 * h + 32 * j + 16 * k + l;
                        qs[32 * h + 16 * k + l] |= ((w % 4) as u8) << (2 * j);
                    }
                }
            }
        }
        b.extend_from_slice(&qs);
        b.extend_from_slice(&[0x00, 0x38, 0x00, 0x34]);
        let v = dequantize_to_vec(GgmlType::Q2_K, &b, 256).unwrap();
        for (w, &x) in v.iter().enumerate() {
            let n = (w / 16) as f32;
            let want = 0.5 * n * (w % 4) as f32 - 0.25 * (15.0 - n);
            assert_eq!(x, want, "weight {w}");
        }
    }

    #[test]
    fn round_trip_within_bounds() {
        let x = sample(512);
        let bytes = quantize_q2_k(&x);
        assert_eq!(bytes.len(), 2 * Q2_K_BYTES);
        let y = dequantize_to_vec(GgmlType::Q2_K, &bytes, 512).unwrap();
        for (bx, by) in x.chunks(256).zip(y.chunks(256)) {
            let (lo, hi) = bx
                .iter()
                .fold((0f32, 0f32), |(l, h), &v| (l.min(v), h.max(v)));
            for (sx, sy) in bx.chunks(16).zip(by.chunks(16)) {
                let (slo, shi) = sx
                    .iter()
                    .fold((0f32, 0f32), |(l, h), &v| (l.min(v), h.max(v)));
                // Half of the sub-block's step (its range, with 0, over 3), plus what the 4-bit
                // scale and min can move the grid: half a step of each super-scale (about 1/15
                // of the super-block's largest step or min), the scale's times the top code 3;
                // 5% of the range more for the least-squares fits' steps exceeding range / 3.
                let (d, dmin) = ((hi - lo) / 3.0 / 15.0, -lo / 15.0);
                let tol = (shi - slo) * (1.0 / 6.0 + 0.05) + 1.5 * d + 0.5 * dmin + 1e-6;
                for (a, b) in sx.iter().zip(sy) {
                    assert!((a - b).abs() <= tol, "{a} vs {b} (tol {tol})");
                }
            }
        }
        // Two bits: better than 7 dB on this data (a 2-bit uniform grid gives about 9.5).
        let snr = snr_db(&x, &y);
        assert!(snr > 7.0, "Q2_K {snr:.2} dB");
    }
}
