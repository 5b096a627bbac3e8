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

/// Encoders for the plain float types: little-endian element by element, F16 and BF16 rounding to
/// nearest even. (Values beyond F16's range would become infinities: `quant::quantize` refuses
/// them before calling this.)
pub fn quantize_f32(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn quantize_f16(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|&v| f32_to_f16(v).to_le_bytes())
        .collect()
}

pub fn quantize_bf16(x: &[f32]) -> Vec<u8> {
    x.iter()
        .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
        .collect()
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

    #[test]
    fn float_encoders_round_trip() {
        let x = [1.0f32, -2.5, 1.0e-3, 3.0e4, 0.1];
        let f32s = dequantize_to_vec(GgmlType::F32, &quantize_f32(&x), 5).unwrap();
        assert_eq!(f32s, x);
        // F16 keeps 11 significant bits, BF16 8: relative errors 2^-11 and 2^-8 at most.
        let h = dequantize_to_vec(GgmlType::F16, &quantize_f16(&x), 5).unwrap();
        let b = dequantize_to_vec(GgmlType::BF16, &quantize_bf16(&x), 5).unwrap();
        for ((a, h), b) in x.iter().zip(&h).zip(&b) {
            assert!((a - h).abs() <= a.abs() * 2f32.powi(-11), "{a} vs f16 {h}");
            assert!((a - b).abs() <= a.abs() * 2f32.powi(-8), "{a} vs bf16 {b}");
        }
        assert_eq!(quantize_f16(&[1.0]), vec![0x00, 0x3c]);
        assert_eq!(quantize_bf16(&[-0.5]), vec![0x00, 0xbf]);
    }
}
