//! Plain floating-point storage: F32, F16 (IEEE half) and BF16 (truncated f32).

use half::{bf16, f16};

pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

pub fn f32_to_f16(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

pub fn bf16_to_f32(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// Round-to-nearest-even, as ggml's conversion does.
pub fn f32_to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

pub(super) fn decode_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

pub(super) fn decode_f16(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

pub(super) fn decode_bf16(bytes: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec};

    #[test]
    fn hand_built_halves_decode() {
        // 1.0 = 0x3c00, -2.0 = 0xc000, 65504 = 0x7bff (f16 max), smallest subnormal 0x0001.
        let bytes: Vec<u8> = [0x3c00u16, 0xc000, 0x7bff, 0x0001]
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        let v = dequantize_to_vec(GgmlType::F16, &bytes, 4).unwrap();
        assert_eq!(v, vec![1.0, -2.0, 65504.0, 2f32.powi(-24)]);
        // bf16: 1.0 = 0x3f80, -0.5 = 0xbf00, 3.140625 = 0x4049.
        let bytes: Vec<u8> = [0x3f80u16, 0xbf00, 0x4049]
            .iter()
            .flat_map(|b| b.to_le_bytes())
            .collect();
        let v = dequantize_to_vec(GgmlType::BF16, &bytes, 3).unwrap();
        assert_eq!(v, vec![1.0, -0.5, 3.140625]);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_f16(-2.0), 0xc000);
    }
}
