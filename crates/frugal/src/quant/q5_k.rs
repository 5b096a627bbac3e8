//! Q5_K (ggml's, bit-compatible): Q4_K's super-block with a fifth bit per weight.
//!
//! 176 bytes per 256 weights (5.5 bits each): f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and
//! mins for 8 sub-blocks of 32 (packed as Q4_K's, `k_quants::scale_min`), 32 bytes `qh`, 128
//! bytes `qs`. Sub-block j: value = d * sc_j * q - dmin * m_j with q in 0..32. In each 64-weight
//! chunk c, `qs[32c + l]` holds the low four bits of weight 64c + l (low nibble) and 64c + 32 + l
//! (high nibble); bit j of `qh[l]` is the fifth bit of weight 32j + l.
//!
//! One more bit than Q4_K halves the step for 22% more bytes, the usual choice where Q4_K
//! costs too much quality (llama.cpp's Q5_K_M files).

use super::float::{f16_to_f32, f32_to_f16};
use super::k_quants::{QK_K, fit_asymmetric, half, pack_scale_min, scale_min};

pub const Q5_K_BYTES: usize = 176;

/// The 5-bit code of weight `32 j + l` of a block (`j` the sub-block, `l < 32`).
pub(super) fn code(block: &[u8], j: usize, l: usize) -> u8 {
    let (qh, qs) = (&block[16..48], &block[48..176]);
    let byte = qs[32 * (j / 2) + l];
    let low = if j.is_multiple_of(2) {
        byte & 0x0f
    } else {
        byte >> 4
    };
    low | (((qh[l] >> j) & 1) << 4)
}

#[inline]
pub(super) fn decode_q5_k(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(Q5_K_BYTES))
    {
        let (d, dmin) = (half(b), half(&b[2..]));
        for j in 0..8 {
            let (sc, m) = scale_min(j, &b[4..16]);
            let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
            for l in 0..32 {
                y[32 * j + l] = dl * f32::from(code(b, j, l)) - ml;
            }
        }
    }
}

/// Encoder for Q5_K: per sub-block of 32 a fitted (scale, min) on 0..=31, both quantized to 6
/// bits against the super-block maxima, then every weight re-rounded on the grid the decoder
/// will use (as [`super::quantize_q4_k`], one bit finer).
pub fn quantize_q5_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * Q5_K_BYTES);
    for blk in x.chunks_exact(QK_K) {
        let mut scales = [0f32; 8];
        let mut mins = [0f32; 8];
        for (j, sub) in blk.chunks_exact(32).enumerate() {
            let (a, b) = fit_asymmetric(sub, None, 31.0);
            scales[j] = a;
            mins[j] = -b;
        }
        let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
        let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
        let to6 = |v: f32, max: f32| -> u8 {
            if max > 0.0 {
                (v * 63.0 / max).round().clamp(0.0, 63.0) as u8
            } else {
                0
            }
        };
        let ls: [u8; 8] = std::array::from_fn(|j| to6(scales[j], max_scale));
        let lm: [u8; 8] = std::array::from_fn(|j| to6(mins[j], max_min));
        let (d_bits, dmin_bits) = (f32_to_f16(max_scale / 63.0), f32_to_f16(max_min / 63.0));
        let (d, dmin) = (f16_to_f32(d_bits), f16_to_f32(dmin_bits));
        let mut qh = [0u8; 32];
        let mut qs = [0u8; 128];
        for (j, sub) in blk.chunks_exact(32).enumerate() {
            let step = d * f32::from(ls[j]);
            let off = dmin * f32::from(lm[j]);
            let inv = if step != 0.0 { 1.0 / step } else { 0.0 };
            for (l, &v) in sub.iter().enumerate() {
                let q = ((v + off) * inv).round().clamp(0.0, 31.0) as u8;
                qs[32 * (j / 2) + l] |= (q & 0x0f) << (4 * (j % 2));
                qh[l] |= (q >> 4) << j;
            }
        }
        out.extend_from_slice(&d_bits.to_le_bytes());
        out.extend_from_slice(&dmin_bits.to_le_bytes());
        out.extend_from_slice(&pack_scale_min(&ls, &lm));
        out.extend_from_slice(&qh);
        out.extend_from_slice(&qs);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec, quantize_q4_k, research::snr_db};

    use crate::quant::test_signal::sample;

    #[test]
    fn hand_built_block_decodes() {
        // d = 0.5, dmin = 0.25; sub-block j has scale j + 1 (21.. for j >= 4, so the split high
        // bits are used) and min 2j (40.. likewise); weight w has code w % 32, so all five bits
        // vary.
        let ls = [1u8, 2, 3, 4, 21, 22, 23, 24];
        let lm = [0u8, 2, 4, 6, 40, 42, 44, 46];
        let mut b = vec![0x00, 0x38, 0x00, 0x34];
        b.extend_from_slice(&pack_scale_min(&ls, &lm));
        let mut qh = [0u8; 32];
        let mut qs = [0u8; 128];
        for w in 0..256 {
            let (j, l, q) = (w / 32, w % 32, (w % 32) as u8);
            qs[32 * (j / 2) + l] |= (q & 15) << (4 * (j % 2));
            qh[l] |= (q >> 4) << j;
        }
        b.extend_from_slice(&qh);
        b.extend_from_slice(&qs);
        let v = dequantize_to_vec(GgmlType::Q5_K, &b, 256).unwrap();
        for (w, &x) in v.iter().enumerate() {
            let j = w / 32;
            let want = 0.5 * f32::from(ls[j]) * (w % 32) as f32 - 0.25 * f32::from(lm[j]);
            assert_eq!(x, want, "weight {w}");
        }
    }

    #[test]
    fn round_trip_within_bounds_and_finer_than_q4_k() {
        let x = sample(512);
        let bytes = quantize_q5_k(&x);
        assert_eq!(bytes.len(), 2 * Q5_K_BYTES);
        let y = dequantize_to_vec(GgmlType::Q5_K, &bytes, 512).unwrap();
        for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
            let (lo, hi) = bx
                .iter()
                .fold((0f32, 0f32), |(l, h), &v| (l.min(v), h.max(v)));
            // The sub-block range (with 0) over 31 steps, plus the slack of the 6-bit scale and
            // min (half of 1/63 of the super-block maxima, each stretching the grid).
            let range = hi - lo;
            let tol = range / 31.0 + 0.06 * range;
            for (a, b) in bx.iter().zip(by) {
                assert!((a - b).abs() <= tol, "{a} vs {b} (tol {tol})");
            }
        }
        // One more bit: at least 5 dB (ideally 6) over Q4_K.
        let q4 = dequantize_to_vec(GgmlType::Q4_K, &quantize_q4_k(&x), 512).unwrap();
        let (s5, s4) = (snr_db(&x, &y), snr_db(&x, &q4));
        assert!(s5 > s4 + 5.0, "Q5_K {s5:.2} dB vs Q4_K {s4:.2} dB");
    }
}
