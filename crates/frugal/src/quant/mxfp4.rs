//! MXFP4 (OCP Microscaling Formats v1.0): blocks of 32 FP4 E2M1 values sharing one E8M0 scale,
//! as ggml stores it (17 bytes, 4.25 bits per weight).
//!
//! Layout: byte 0 is the shared scale `e` (an 8-bit biased exponent, scale = 2^(e - 127); 0xFF is
//! NaN in the spec), then 16 bytes of nibbles: element j in the low nibble of byte 1 + j and
//! element j + 16 in the high nibble (the same split order as Q4_0, not the interleaved order some
//! other MXFP4 stores use). A nibble is sign (bit 3), 2 exponent bits, 1 mantissa bit: magnitudes
//! 0, 0.5, 1, 1.5, 2, 3, 4, 6.
//!
//! A power-of-two scale is free to apply in hardware but can only approximate the absmax within a
//! factor of two, which is what this format trades against Q4_0's f16 scale.

pub const QK_MXFP4: usize = 32;
pub const MXFP4_BYTES: usize = 17;

/// E2M1 values by nibble (bit 3 is the sign).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The E8M0 scale 2^(e - 127) as an f32, exact for every e (2^-127 is an f32 subnormal; 0xFF,
/// NaN in the spec, is decoded as 2^128 = inf and refused at load).
pub fn e8m0_to_f32(e: u8) -> f32 {
    if e == 0 {
        f32::from_bits(0x0040_0000)
    } else if e == 0xff {
        f32::INFINITY
    } else {
        f32::from_bits(u32::from(e) << 23)
    }
}

#[inline]
pub(super) fn decode_mxfp4(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK_MXFP4)
        .zip(bytes.chunks_exact(MXFP4_BYTES))
    {
        let d = e8m0_to_f32(b[0]);
        for j in 0..16 {
            o[j] = d * E2M1[usize::from(b[1 + j] & 0x0f)];
            o[j + 16] = d * E2M1[usize::from(b[1 + j] >> 4)];
        }
    }
}

/// The nibble whose value is nearest to `v` (ties to the smaller magnitude, which is also the
/// even mantissa in the upper binades).
fn nearest_e2m1(v: f32) -> u8 {
    let a = v.abs();
    let mut best = 0u8;
    for (i, &m) in E2M1[..8].iter().enumerate() {
        if (m - a).abs() < (E2M1[usize::from(best)] - a).abs() {
            best = i as u8;
        }
    }
    if v < 0.0 && best != 0 { best | 8 } else { best }
}

fn encode_block(x: &[f32], e: u8) -> (f32, [u8; 16]) {
    let d = e8m0_to_f32(e);
    let inv = 1.0 / d;
    let mut qs = [0u8; 16];
    let mut err = 0f32;
    for j in 0..16 {
        let lo = nearest_e2m1(x[j] * inv);
        let hi = nearest_e2m1(x[j + 16] * inv);
        err += (x[j] - d * E2M1[usize::from(lo)]).powi(2);
        err += (x[j + 16] - d * E2M1[usize::from(hi)]).powi(2);
        qs[j] = lo | (hi << 4);
    }
    (err, qs)
}

/// Encoder: the spec's shared exponent, floor(log2(absmax)) - 2 (so the absmax lands in [4, 8)
/// and the largest element, 6, covers it up to clipping), and one binade up (no clipping, coarser
/// steps); whichever gives the smaller squared error is kept. Elements round to the nearest E2M1.
pub fn quantize_mxfp4(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_MXFP4 * MXFP4_BYTES);
    for chunk in x.chunks(QK_MXFP4) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let e = if amax > 0.0 && amax.is_finite() {
            (amax.log2().floor() as i32 - 2 + 127).clamp(0, 253) as u8
        } else {
            0
        };
        let (err0, qs0) = encode_block(chunk, e);
        let (err1, qs1) = encode_block(chunk, e + 1);
        let (e, qs) = if err1 < err0 { (e + 1, qs1) } else { (e, qs0) };
        out.push(e);
        out.extend_from_slice(&qs);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec};

    #[test]
    fn hand_built_block_decodes() {
        // e = 126: scale 0.5. Byte j holds nibble j in the low half (elements 0..16 run through
        // all 16 codes) and nibble 15 - j in the high half.
        let mut b = vec![126u8];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = dequantize_to_vec(GgmlType::MXFP4, &b, 32).unwrap();
        let mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for j in 0..16 {
            let code = |c: usize| if c < 8 { mags[c] } else { -mags[c - 8] };
            assert_eq!(v[j], 0.5 * code(j), "element {j}");
            assert_eq!(v[j + 16], 0.5 * code(15 - j), "element {}", j + 16);
        }
        // Extreme scales are exact powers of two.
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-63) * 2f32.powi(-64));
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
    }

    #[test]
    fn encoder_picks_the_spec_exponent_and_rounds_to_nearest() {
        // absmax 6.0: floor(log2 6) - 2 = 0, so e = 127 (scale 1) and 6, -3 are exact; 0.7 and
        // 1.3 round to the nearest codes. One binade up (scale 2) would cost 0.18 of squared
        // error against 0.08, so it is not taken.
        let mut x = [0f32; 32];
        x[0] = 6.0;
        x[1] = -3.0;
        x[2] = 0.7; // nearest 0.5
        x[17] = 1.3; // nearest 1.5
        let b = quantize_mxfp4(&x);
        assert_eq!(b.len(), 17);
        assert_eq!(b[0], 127);
        let y = dequantize_to_vec(GgmlType::MXFP4, &b, 32).unwrap();
        assert_eq!(&y[..3], &[6.0, -3.0, 0.5]);
        assert_eq!(y[17], 1.5);
    }

    #[test]
    fn encoder_round_trips_within_a_step() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 * (1 + i / 64) as f32)
            .collect();
        let y = dequantize_to_vec(GgmlType::MXFP4, &quantize_mxfp4(&x), 256).unwrap();
        for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
            let amax = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
            // Spec exponent: amax is in [4, 8) units, rounding costs at most 1 unit (half the
            // 4..6 gap) <= amax / 4 and clipping [6, 8) to 6 costs amax - 6 units < amax / 4.
            // One binade up: amax is in [2, 4) units, the widest gap below 4 is 1 unit, so at
            // most half a unit <= amax / 4. Either way amax / 4 per element.
            for (a, b) in bx.iter().zip(by) {
                assert!((a - b).abs() <= amax / 4.0 + 1e-6, "{a} vs {b}");
            }
        }
    }
}
