//! 4-bit block formats with 32 weights per block. The 16 data bytes hold element j in the low
//! nibble of byte j and element j + 16 in the high nibble.
//! - Q4_0 (18 bytes): f16 scale d; value = d * (q - 8).
//! - Q4_1 (20 bytes): f16 scale d and f16 minimum m; value = d * q + m.

use super::float::{f16_to_f32, f32_to_f16};

pub const QK4: usize = 32;

#[derive(Copy, Clone, Debug, PartialEq)]
pub struct BlockQ4_0 {
    pub d: u16,
    pub qs: [u8; QK4 / 2],
}

#[derive(Copy, Clone, Debug, PartialEq)]
pub struct BlockQ4_1 {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; QK4 / 2],
}

impl BlockQ4_0 {
    pub const BYTES: usize = 18;

    pub fn read(b: &[u8]) -> Self {
        let mut qs = [0u8; 16];
        qs.copy_from_slice(&b[2..18]);
        BlockQ4_0 {
            d: u16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }
}

impl BlockQ4_1 {
    pub const BYTES: usize = 20;

    pub fn read(b: &[u8]) -> Self {
        let mut qs = [0u8; 16];
        qs.copy_from_slice(&b[4..20]);
        BlockQ4_1 {
            d: u16::from_le_bytes([b[0], b[1]]),
            m: u16::from_le_bytes([b[2], b[3]]),
            qs,
        }
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend_from_slice(&self.m.to_le_bytes());
        out.extend_from_slice(&self.qs);
    }
}

/// The 32 unsigned nibbles of a block in element order.
fn nibbles(qs: &[u8; 16]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = qs[j] & 0x0f;
        q[j + 16] = qs[j] >> 4;
    }
    q
}

fn pack(q: &[u8; 32]) -> [u8; 16] {
    let mut qs = [0u8; 16];
    for j in 0..16 {
        qs[j] = q[j] | (q[j + 16] << 4);
    }
    qs
}

pub(super) fn decode_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK4)
        .zip(bytes.chunks_exact(BlockQ4_0::BYTES))
    {
        let blk = BlockQ4_0::read(b);
        let d = f16_to_f32(blk.d);
        for (x, q) in o.iter_mut().zip(nibbles(&blk.qs)) {
            *x = d * (f32::from(q) - 8.0);
        }
    }
}

pub(super) fn decode_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK4)
        .zip(bytes.chunks_exact(BlockQ4_1::BYTES))
    {
        let blk = BlockQ4_1::read(b);
        let (d, m) = (f16_to_f32(blk.d), f16_to_f32(blk.m));
        for (x, q) in o.iter_mut().zip(nibbles(&blk.qs)) {
            *x = d * f32::from(q) + m;
        }
    }
}

/// Reference encoder (ggml's `quantize_row_q4_0_ref`): the signed absmax maps to -8.
pub fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK4 * BlockQ4_0::BYTES);
    for chunk in x.chunks(QK4) {
        let max = super::fit::signed_absmax(chunk);
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; 32];
        for (qi, &v) in q.iter_mut().zip(chunk) {
            *qi = ((v * id + 8.5) as i32).clamp(0, 15) as u8;
        }
        BlockQ4_0 {
            d: f32_to_f16(d),
            qs: pack(&q),
        }
        .write(&mut out);
    }
    out
}

/// Writes one Q4_0 block from its stored scale and 32 codes (`0..16`, element order).
pub(super) fn pack_q4_0_block(d: u16, codes: &[u8; 32], out: &mut Vec<u8>) {
    BlockQ4_0 { d, qs: pack(codes) }.write(out);
}

/// Reference encoder (ggml's `quantize_row_q4_1_ref`): min and (max - min) / 15.
pub fn quantize_q4_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK4 * BlockQ4_1::BYTES);
    for chunk in x.chunks(QK4) {
        let min = chunk.iter().copied().fold(f32::INFINITY, f32::min);
        let max = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0u8; 32];
        for (qi, &v) in q.iter_mut().zip(chunk) {
            *qi = (((v - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        }
        BlockQ4_1 {
            d: f32_to_f16(d),
            m: f32_to_f16(min),
            qs: pack(&q),
        }
        .write(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec};

    #[test]
    fn hand_built_q4_0_block_decodes() {
        // d = 2.0 (f16 0x4000); byte j = low nibble j%16, high nibble 15 - j%16.
        let mut b = vec![0x00, 0x40];
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = dequantize_to_vec(GgmlType::Q4_0, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(v[j], 2.0 * (j as f32 - 8.0));
            assert_eq!(v[j + 16], 2.0 * ((15 - j) as f32 - 8.0));
        }
    }

    #[test]
    fn hand_built_q4_1_block_decodes() {
        // d = 0.5 (0x3800), m = -1.0 (0xbc00).
        let mut b = vec![0x00, 0x38, 0x00, 0xbc];
        b.extend((0..16u8).map(|j| j | (j << 4)));
        let v = dequantize_to_vec(GgmlType::Q4_1, &b, 32).unwrap();
        for j in 0..16 {
            assert_eq!(v[j], 0.5 * j as f32 - 1.0);
            assert_eq!(v[j + 16], 0.5 * j as f32 - 1.0);
        }
    }

    #[test]
    fn encoders_round_trip_within_a_step() {
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 53 % 29) as f32 - 14.0) * 0.07)
            .collect();
        for (ty, bytes) in [
            (GgmlType::Q4_0, quantize_q4_0(&x)),
            (GgmlType::Q4_1, quantize_q4_1(&x)),
        ] {
            let y = dequantize_to_vec(ty, &bytes, 96).unwrap();
            for (bx, by) in x.chunks(32).zip(y.chunks(32)) {
                let amax = bx.iter().fold(0f32, |m, v| m.max(v.abs()));
                // Q4_1: half a step of (max - min) / 15. Q4_0: its grid is absmax / 8 per step
                // and the side opposite the absmax clips at +7 steps, so one full step. Plus the
                // f16 rounding of the scales.
                let step = if ty == GgmlType::Q4_0 {
                    amax / 8.0
                } else {
                    2.0 * amax / 15.0 * 0.5
                };
                let tol = step + amax * 2e-3;
                for (a, b) in bx.iter().zip(by) {
                    assert!((a - b).abs() <= tol, "{ty}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn wrong_length_is_an_error() {
        assert!(dequantize_to_vec(GgmlType::Q4_1, &[0; 19], 32).is_err());
        assert!(dequantize_to_vec(GgmlType::IQ3_S, &[0; 110], 256).is_err());
    }
}
