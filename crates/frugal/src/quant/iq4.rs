//! IQ4_NL and IQ4_XS (ggml's, bit-compatible): 4-bit codes standing for the 16 non-uniform
//! values of [`KVALUES`], denser near zero where weights are, times a block scale.
//!
//! - IQ4_NL (18 bytes per 32 weights, 4.5 bits each): f16 `d`, `qs[16]`. Weight l < 16 is
//!   `d * K[qs[l] & 15]`, weight 16 + l is `d * K[qs[l] >> 4]`.
//! - IQ4_XS (136 bytes per 256, 4.25 bits each): f16 `d`, u16 `scales_h`, `scales_l[4]`,
//!   `qs[128]`. Sub-block ib < 8 (32 weights) has the 6-bit `ls` with low bits nibble `ib % 2`
//!   of `scales_l[ib / 2]` and top bits the bit pair `2 ib` of `scales_h`, scale
//!   `d * (ls - 32)`, and its codes in `qs[16 ib..16 ib + 16]` packed as IQ4_NL's.

use super::fit::{best_step, fit_table_scale, nearest};
use super::float::{f16_to_f32, f32_to_f16};
use super::k_quants::{QK_K, half};

pub const IQ4_NL_BYTES: usize = 18;
pub const IQ4_XS_BYTES: usize = 136;

/// The values the 16 codes stand for (ascending).
pub const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// [`KVALUES`] as f32, for the encoders' searches.
const TABLE: [f32; 16] = {
    let mut t = [0f32; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = KVALUES[i] as f32;
        i += 1;
    }
    t
};

fn value(code: u8) -> f32 {
    f32::from(KVALUES[usize::from(code & 0x0f)])
}

/// Decodes 32 weights from their 16 code bytes with scale `dl`.
fn decode_codes(qs: &[u8], dl: f32, y: &mut [f32]) {
    for (l, &q) in qs.iter().enumerate() {
        y[l] = dl * value(q);
        y[16 + l] = dl * value(q >> 4);
    }
}

/// Packs the nearest codes of 32 weights for scale `dl` (code 8, the value 1, for `dl = 0`:
/// every code decodes to 0 then).
fn encode_codes(x: &[f32], dl: f32, qs: &mut [u8]) {
    let inv = if dl != 0.0 { 1.0 / dl } else { 0.0 };
    let c = |v: f32| {
        if dl != 0.0 {
            nearest(&TABLE, v * inv) as u8
        } else {
            8
        }
    };
    for l in 0..16 {
        qs[l] = c(x[l]) | (c(x[16 + l]) << 4);
    }
}

/// Sub-block `ib`'s signed scale step `ls - 32` of an IQ4_XS block.
pub(super) fn xs_scale(block: &[u8], ib: usize) -> i8 {
    let scales_h = u16::from_le_bytes([block[2], block[3]]);
    let low = (block[4 + ib / 2] >> (4 * (ib % 2))) & 0x0f;
    let top = ((scales_h >> (2 * ib)) & 3) as u8;
    (low | (top << 4)) as i8 - 32
}

#[inline]
pub(super) fn decode_iq4_nl(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out
        .chunks_exact_mut(32)
        .zip(bytes.chunks_exact(IQ4_NL_BYTES))
    {
        decode_codes(&b[2..18], half(b), y);
    }
}

#[inline]
pub(super) fn decode_iq4_xs(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(IQ4_XS_BYTES))
    {
        let d = half(b);
        for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
            let dl = d * f32::from(xs_scale(b, ib));
            decode_codes(&b[8 + 16 * ib..][..16], dl, ys);
        }
    }
}

/// Encoder for IQ4_NL: per block the scale that stores it best with the nearest table values
/// (`fit::fit_table_scale`), rounded to f16, then each weight's nearest code for that scale.
pub fn quantize_iq4_nl(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * IQ4_NL_BYTES);
    for blk in x.chunks_exact(32) {
        let d_bits = f32_to_f16(fit_table_scale(blk, &TABLE));
        let mut qs = [0u8; 16];
        encode_codes(blk, f16_to_f32(d_bits), &mut qs);
        out.extend_from_slice(&d_bits.to_le_bytes());
        out.extend_from_slice(&qs);
    }
    out
}

/// Encoder for IQ4_XS: per sub-block of 32 the best-fitting scale as for IQ4_NL, the eight
/// quantized to signed 6 bits against the largest (which maps to -32), each moved by a step
/// where that stores its sub-block better, and each weight's nearest code for its final scale.
pub fn quantize_iq4_xs(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * IQ4_XS_BYTES);
    for blk in x.chunks_exact(QK_K) {
        let fitted: [f32; 8] =
            std::array::from_fn(|ib| fit_table_scale(&blk[32 * ib..][..32], &TABLE));
        let max = super::fit::signed_absmax(&fitted);
        let d_bits = f32_to_f16(max / -32.0);
        let d = f16_to_f32(d_bits);
        let inv_d = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut scales_h = 0u16;
        let mut scales_l = [0u8; 4];
        let mut qs = [0u8; 128];
        for (ib, sub) in blk.chunks_exact(32).enumerate() {
            let l = (fitted[ib] * inv_d).round().clamp(-32.0, 31.0) as i32;
            let l = best_step(sub, &TABLE, d, l, -32, 31);
            let ls = (l + 32) as u8;
            scales_l[ib / 2] |= (ls & 0x0f) << (4 * (ib % 2));
            scales_h |= u16::from(ls >> 4) << (2 * ib);
            encode_codes(sub, d * l as f32, &mut qs[16 * ib..16 * ib + 16]);
        }
        out.extend_from_slice(&d_bits.to_le_bytes());
        out.extend_from_slice(&scales_h.to_le_bytes());
        out.extend_from_slice(&scales_l);
        out.extend_from_slice(&qs);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec, quantize_q4_0, research::snr_db};

    use crate::quant::test_signal::sample;

    #[test]
    fn hand_built_blocks_decode() {
        // IQ4_NL, d = 0.5: weight l has code l % 16 in the low nibbles, 15 - l % 16 in the high.
        let mut b = vec![0x00, 0x38];
        b.extend((0..16u8).map(|l| l | ((15 - l) << 4)));
        let v = dequantize_to_vec(GgmlType::IQ4_NL, &b, 32).unwrap();
        for (w, &x) in v.iter().enumerate() {
            let c = if w < 16 { w } else { 15 - (w - 16) };
            assert_eq!(x, 0.5 * f32::from(KVALUES[c]), "weight {w}");
        }
        // IQ4_XS, d = 0.25: sub-block ib has ls = 9 ib (0..=63 with top bits set from ib 2),
        // weight l of it the code (l + ib) % 16.
        let ls: [u8; 8] = std::array::from_fn(|ib| (9 * ib) as u8);
        let mut scales_h = 0u16;
        let mut scales_l = [0u8; 4];
        for (ib, &s) in ls.iter().enumerate() {
            scales_l[ib / 2] |= (s & 15) << (4 * (ib % 2));
            scales_h |= u16::from(s >> 4) << (2 * ib);
        }
        let mut b = vec![0x00, 0x34];
        b.extend_from_slice(&scales_h.to_le_bytes());
        b.extend_from_slice(&scales_l);
        for ib in 0..8 {
            b.extend((0..16).map(|l| (((l + ib) % 16) | (((l + 16 + ib) % 16) << 4)) as u8));
        }
        let v = dequantize_to_vec(GgmlType::IQ4_XS, &b, 256).unwrap();
        for (w, &x) in v.iter().enumerate() {
            let (ib, l) = (w / 32, w % 32);
            let dl = 0.25 * (f32::from(ls[ib]) - 32.0);
            assert_eq!(x, dl * f32::from(KVALUES[(l + ib) % 16]), "weight {w}");
        }
    }

    #[test]
    fn round_trip_within_bounds_and_better_than_q4_0() {
        let x = sample(512);
        for ty in [GgmlType::IQ4_NL, GgmlType::IQ4_XS] {
            let bytes = if ty == GgmlType::IQ4_NL {
                quantize_iq4_nl(&x)
            } else {
                quantize_iq4_xs(&x)
            };
            assert_eq!(bytes.len() as u64, ty.bytes_for(512).unwrap());
            let y = dequantize_to_vec(ty, &bytes, 512).unwrap();
            for (sx, sy) in x.chunks(256).zip(y.chunks(256)) {
                let super_max = sx.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (bx, by) in sx.chunks(32).zip(sy.chunks(32)) {
                    // The widest gap of the table (24, between 89 and 113, near the ends where
                    // few weights are) at a scale of at most amax / 113 gives an error of at
                    // most 12/113 of the block's largest magnitude; IQ4_XS's 6-bit scales
                    // (steps of a 32nd of the largest, about amax / 127) can move the outermost
                    // value (127) by half such a step more.
                    let amax = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let mut tol = amax * 12.0 / 113.0 * 1.1 + 1e-6;
                    if ty == GgmlType::IQ4_XS {
                        tol += 0.5 * super_max / 32.0;
                    }
                    for (a, b) in bx.iter().zip(by) {
                        assert!((a - b).abs() <= tol, "{ty}: {a} vs {b} (tol {tol})");
                    }
                }
            }
            // The non-uniform table beats Q4_0's uniform grid at the same 4 bits.
            let q4 = dequantize_to_vec(GgmlType::Q4_0, &quantize_q4_0(&x), 512).unwrap();
            let (s, s4) = (snr_db(&x, &y), snr_db(&x, &q4));
            assert!(s > s4, "{ty} {s:.2} dB vs Q4_0 {s4:.2} dB");
        }
    }

    #[test]
    fn zero_blocks_are_exact() {
        let x = vec![0f32; 256];
        for b in [quantize_iq4_nl(&x), quantize_iq4_xs(&x)] {
            let ty = if b.len() == 8 * IQ4_NL_BYTES {
                GgmlType::IQ4_NL
            } else {
                GgmlType::IQ4_XS
            };
            assert!(
                dequantize_to_vec(ty, &b, 256)
                    .unwrap()
                    .iter()
                    .all(|&v| v == 0.0)
            );
        }
    }
}
