//! 5-bit block formats with 32 weights per block (ggml's Q5_0 and Q5_1, bit-compatible).
//!
//! The low four bits of each weight are packed like Q4: element j in the low nibble of `qs[j]`,
//! element j + 16 in the high nibble. The fifth bit of element i is bit i of the little-endian
//! 32-bit word `qh`.
//! - Q5_0 (22 bytes: f16 d, u32 qh, 16 bytes qs): value = d * (q - 16).
//! - Q5_1 (24 bytes: f16 d, f16 m, u32 qh, 16 bytes qs): value = d * q + m.
//!
//! One more bit than Q4 halves the step for 10% more bytes (5.5 / 6.0 bits per weight), which is
//! why llama.cpp falls back to Q5_0 where a K-quant's 256-wide super-block does not fit a row.

use super::float::{f16_to_f32, f32_to_f16};

pub const QK5: usize = 32;
pub const Q5_0_BYTES: usize = 22;
pub const Q5_1_BYTES: usize = 24;

/// The 32 five-bit values of a block in element order, from the packed nibbles and high bits.
fn unpack(qs: &[u8], qh: u32) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// Packs 32 five-bit values into (qh, qs).
fn pack(q: &[u8; 32]) -> (u32, [u8; 16]) {
    let mut qs = [0u8; 16];
    let mut qh = 0u32;
    for j in 0..16 {
        qs[j] = (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4);
        qh |= u32::from(q[j] >> 4) << j;
        qh |= u32::from(q[j + 16] >> 4) << (j + 16);
    }
    (qh, qs)
}

fn half(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

fn word(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

#[inline]
pub(super) fn decode_q5_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK5)
        .zip(bytes.chunks_exact(Q5_0_BYTES))
    {
        let d = half(b);
        for (x, q) in o.iter_mut().zip(unpack(&b[6..22], word(&b[2..6]))) {
            *x = d * (f32::from(q) - 16.0);
        }
    }
}

#[inline]
pub(super) fn decode_q5_1(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK5)
        .zip(bytes.chunks_exact(Q5_1_BYTES))
    {
        let (d, m) = (half(b), half(&b[2..]));
        for (x, q) in o.iter_mut().zip(unpack(&b[8..24], word(&b[4..8]))) {
            *x = d * f32::from(q) + m;
        }
    }
}

/// Encoder in the manner of ggml's reference: the signed absmax of the block maps to -16 (the
/// end of the grid that exists), so the scale carries the sign and the absmax is exact.
pub fn quantize_q5_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK5 * Q5_0_BYTES);
    for chunk in x.chunks(QK5) {
        let max = super::fit::signed_absmax(chunk);
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; 32];
        for (qi, &v) in q.iter_mut().zip(chunk) {
            *qi = (v * id + 16.5).floor().clamp(0.0, 31.0) as u8;
        }
        let (qh, qs) = pack(&q);
        out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
        out.extend_from_slice(&qh.to_le_bytes());
        out.extend_from_slice(&qs);
    }
    out
}

/// Writes one Q5_0 block from its stored scale and 32 codes (`0..32`, element order).
pub(super) fn pack_q5_0_block(d: u16, codes: &[u8; 32], out: &mut Vec<u8>) {
    let (qh, qs) = pack(codes);
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend_from_slice(&qs);
}

/// Encoder: minimum and (max - min) / 31, rounding to the nearest step.
pub fn quantize_q5_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK5 * Q5_1_BYTES);
    for chunk in x.chunks(QK5) {
        let min = chunk.iter().copied().fold(f32::INFINITY, f32::min);
        let max = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; 32];
        for (qi, &v) in q.iter_mut().zip(chunk) {
            *qi = ((v - min) * id + 0.5).floor().clamp(0.0, 31.0) as u8;
        }
        let (qh, qs) = pack(&q);
        out.extend_from_slice(&f32_to_f16(d).to_le_bytes());
        out.extend_from_slice(&f32_to_f16(min).to_le_bytes());
        out.extend_from_slice(&qh.to_le_bytes());
        out.extend_from_slice(&qs);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec};

    #[test]
    fn hand_built_q5_0_block_decodes() {
        // d = 0.5 (f16 0x3800). Element i has q = i (0..31): nibble i % 16, high bit i >= 16,
        // so qh has bits 16..31 set and byte j = j | (j << 4).
        let mut b = vec![0x00, 0x38];
        b.extend_from_slice(&0xffff_0000u32.to_le_bytes());
        b.extend((0..16u8).map(|j| j | (j << 4)));
        let v = dequantize_to_vec(GgmlType::Q5_0, &b, 32).unwrap();
        for (i, &x) in v.iter().enumerate() {
            assert_eq!(x, 0.5 * (i as f32 - 16.0), "element {i}");
        }
        // Only element 3's high bit set: q[3] = 16 + 3.
        let mut b = vec![0x00, 0x3c]; // d = 1
        b.extend_from_slice(&(1u32 << 3).to_le_bytes());
        b.extend((0..16u8).map(|j| j | (j << 4)));
        let v = dequantize_to_vec(GgmlType::Q5_0, &b, 32).unwrap();
        assert_eq!(v[3], 3.0);
        assert_eq!(v[4], 4.0 - 16.0);
        assert_eq!(v[19], 3.0 - 16.0);
    }

    #[test]
    fn hand_built_q5_1_block_decodes() {
        // d = 0.25 (0x3400), m = -2.0 (0xc000); element i: q = 31 - i.
        let mut b = vec![0x00, 0x34, 0x00, 0xc0];
        let q: Vec<u8> = (0..32u8).map(|i| 31 - i).collect();
        let mut qh = 0u32;
        for (i, &qi) in q.iter().enumerate() {
            qh |= u32::from(qi >> 4) << i;
        }
        b.extend_from_slice(&qh.to_le_bytes());
        b.extend((0..16).map(|j| (q[j] & 15) | ((q[j + 16] & 15) << 4)));
        let v = dequantize_to_vec(GgmlType::Q5_1, &b, 32).unwrap();
        for (i, &x) in v.iter().enumerate() {
            assert_eq!(x, 0.25 * (31 - i) as f32 - 2.0, "element {i}");
        }
    }

    #[test]
    fn encoders_round_trip_within_a_step() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 53 % 61) as f32 - 30.0) * 0.031 + if i == 77 { 3.0 } else { 0.0 })
            .collect();
        for (ty, bytes) in [
            (GgmlType::Q5_0, quantize_q5_0(&x)),
            (GgmlType::Q5_1, quantize_q5_1(&x)),
        ] {
            assert_eq!(bytes.len(), ty.bytes_for(128).unwrap() as usize);
            let y = dequantize_to_vec(ty, &bytes, 128).unwrap();
            for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
                let amax = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
                let (lo, hi) = bx
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(l, h), &v| (l.min(v), h.max(v)));
                // Q5_0: the step is absmax / 16 and the side opposite the absmax clips at +15
                // steps, so up to one full step. Q5_1: half of (max - min) / 31. Plus the f16
                // rounding of the scale (relative 2^-11, times up to 16 steps) and of the minimum.
                let tol = if ty == GgmlType::Q5_0 {
                    amax / 16.0 + amax * 1e-3
                } else {
                    (hi - lo) / 62.0 + amax * 2e-3
                };
                for (a, b) in bx.iter().zip(by) {
                    assert!((a - b).abs() <= tol, "{ty}: {a} vs {b} (tol {tol})");
                }
            }
        }
    }

    #[test]
    fn five_bits_beat_four() {
        // The same data through Q4_0 and Q5_0: one more bit should roughly halve the RMS error.
        let x: Vec<f32> = (0..1024)
            .map(|i| ((i as f32 * 0.37).sin() + (i as f32 * 0.011).cos()) * 0.5)
            .collect();
        let rms = |ty: GgmlType, b: &[u8]| {
            let y = dequantize_to_vec(ty, b, x.len()).unwrap();
            (x.iter().zip(&y).map(|(a, b)| (a - b).powi(2)).sum::<f32>() / x.len() as f32).sqrt()
        };
        let e4 = rms(GgmlType::Q4_0, &crate::quant::quantize_q4_0(&x));
        let e5 = rms(GgmlType::Q5_0, &quantize_q5_0(&x));
        assert!(e5 < 0.65 * e4, "Q5_0 rms {e5} vs Q4_0 rms {e4}");
    }
}
