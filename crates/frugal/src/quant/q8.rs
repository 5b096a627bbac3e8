//! Q8_0: blocks of 32 signed bytes sharing one f16 scale (34 bytes, 8.5 bits per weight).
//! Value i of a block is `d * qs[i]`.

use super::float::{f16_to_f32, f32_to_f16};

pub const QK8_0: usize = 32;

/// One Q8_0 block as laid out in the file.
#[derive(Copy, Clone, Debug, PartialEq)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; QK8_0],
}

impl BlockQ8_0 {
    pub const BYTES: usize = 34;

    pub fn read(b: &[u8]) -> Self {
        let mut qs = [0i8; QK8_0];
        for (q, &byte) in qs.iter_mut().zip(&b[2..34]) {
            *q = byte as i8;
        }
        BlockQ8_0 {
            d: u16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }

    pub fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.d.to_le_bytes());
        out.extend(self.qs.iter().map(|&q| q as u8));
    }
}

pub(super) fn decode_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK8_0)
        .zip(bytes.chunks_exact(BlockQ8_0::BYTES))
    {
        let blk = BlockQ8_0::read(b);
        let d = f16_to_f32(blk.d);
        for (x, &q) in o.iter_mut().zip(&blk.qs) {
            *x = d * f32::from(q);
        }
    }
}

/// Reference encoder (ggml's `quantize_row_q8_0_ref`): d = absmax / 127, q = round(x / d).
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK8_0 * BlockQ8_0::BYTES);
    for chunk in x.chunks(QK8_0) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; QK8_0];
        for (q, &v) in qs.iter_mut().zip(chunk) {
            *q = (v * id).round() as i8;
        }
        BlockQ8_0 {
            d: f32_to_f16(d),
            qs,
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
    fn hand_built_block_decodes() {
        // d = 0.5 (f16 0x3800); qs = -16..16.
        let mut b = vec![0x00, 0x38];
        b.extend((-16i8..16).map(|q| q as u8));
        let v = dequantize_to_vec(GgmlType::Q8_0, &b, 32).unwrap();
        let want: Vec<f32> = (-16..16).map(|q| q as f32 * 0.5).collect();
        assert_eq!(v, want);
    }

    #[test]
    fn encoder_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.1)
            .collect();
        let bytes = quantize_q8_0(&x);
        let y = dequantize_to_vec(GgmlType::Q8_0, &bytes, 64).unwrap();
        for (blk_x, blk_y) in x.chunks(32).zip(y.chunks(32)) {
            let amax = blk_x.iter().fold(0f32, |m, v| m.max(v.abs()));
            // Half a quantization step plus the f16 rounding of the scale.
            let tol = amax / 127.0 * 0.5 + amax * 1e-3;
            for (a, b) in blk_x.iter().zip(blk_y) {
                assert!((a - b).abs() <= tol, "{a} vs {b}");
            }
        }
    }
}
