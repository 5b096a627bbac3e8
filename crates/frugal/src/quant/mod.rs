//! Tensor storage formats and the matrix products that read them.
//!
//! Weights stay in their stored format (inside the memory map) and are dequantized inside the
//! kernels. Each format has a plain scalar decoder here (the reference every SIMD kernel is tested
//! against); `kernels` holds the dot products per instruction set and `matmul` the threaded
//! matrix-vector (decode) and matrix-matrix (prefill) products.

pub mod act;
mod fit;
mod float;
pub mod iq4;
pub mod k_quants;
pub mod kernels;
mod matmul;
pub mod matrix;
pub mod mxfp4;
#[cfg(test)]
mod oracle_tests;
pub mod packed;
pub mod q2_k;
pub mod q3_k;
mod q4;
pub mod q5;
pub mod q5_k;
mod q8;
pub mod research;
pub mod sparse;
pub mod sparse_matrix;
mod types;
pub mod unit;
pub mod weighted;

pub use float::{
    bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, quantize_bf16, quantize_f16, quantize_f32,
};
pub use iq4::{quantize_iq4_nl, quantize_iq4_xs};
pub use k_quants::{quantize_q4_k, quantize_q6_k};
pub use matmul::{WeightMatrix, matmul, matvec};
pub use matrix::{ActBuffers, ActForm, Matrix, ProductInput};
pub use mxfp4::quantize_mxfp4;
pub use q2_k::quantize_q2_k;
pub use q3_k::quantize_q3_k;
pub use q4::{BlockQ4_0, BlockQ4_1, quantize_q4_0, quantize_q4_1};
pub use q5::{quantize_q5_0, quantize_q5_1};
pub use q5_k::quantize_q5_k;
pub use q8::{BlockQ8_0, quantize_q8_0};
pub use types::GgmlType;

/// Every type frugal can decode and compute with, in the order help texts list them.
pub const SUPPORTED: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q6_K,
    GgmlType::Q5_K,
    GgmlType::Q5_1,
    GgmlType::Q5_0,
    GgmlType::Q4_K,
    GgmlType::Q4_1,
    GgmlType::Q4_0,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::Q3_K,
    GgmlType::Q2_K,
    GgmlType::Q8_0_24,
    GgmlType::Q4_0_24,
];

/// Errors from encoding or decoding stored tensors.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    #[error(
        "tensor type {0} is not supported for computation (supported: F32, F16, BF16, Q8_0, Q6_K, Q5_K, Q5_1, Q5_0, Q4_K, Q4_1, Q4_0, IQ4_NL, IQ4_XS, MXFP4, Q3_K, Q2_K, Q8_0_24, Q4_0_24)"
    )]
    Unsupported(GgmlType),
    #[error("{ty} row of {n} elements needs {expected} bytes, got {got}")]
    BadLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        got: usize,
    },
    #[error("{n} elements are not a whole number of {ty} blocks of {}", ty.block_size())]
    NotWholeBlocks { ty: GgmlType, n: usize },
    #[error("{ty} cannot store the value {value} (out of its range)")]
    OutOfRange { ty: GgmlType, value: f32 },
    #[error("the input holds a non-finite value ({value}) at element {index}")]
    NonFinite { value: f32, index: usize },
    #[error(
        "{ty} keeps 2 of every 4 weights, but the group at element {element} has more than 2 nonzero values (prune with --pattern 2:4 first)"
    )]
    NotSparse { ty: GgmlType, element: usize },
    #[error("{ty} block {block} (byte {offset}): {reason}")]
    CorruptBlock {
        ty: GgmlType,
        block: usize,
        offset: usize,
        reason: &'static str,
    },
    #[error("importance-weighted encoding: {0}")]
    BadImportance(String),
}

/// Whether frugal can decode `ty` (and so compute with it: the matrix products fall back to the
/// scalar decoder for formats without a SIMD kernel).
pub fn is_supported(ty: GgmlType) -> bool {
    SUPPORTED.contains(&ty)
}

/// Encodes `x` as `ty` (a whole number of blocks). Every supported type has an encoder.
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    if !x.len().is_multiple_of(ty.block_size()) {
        return Err(QuantError::NotWholeBlocks { ty, n: x.len() });
    }
    if let Some((index, &value)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(QuantError::NonFinite { value, index });
    }
    if ty == GgmlType::F16
        && let Some(&value) = x.iter().find(|v| v.abs() > 65504.0)
    {
        return Err(QuantError::OutOfRange { ty, value });
    }
    Ok(match ty {
        GgmlType::F32 => quantize_f32(x),
        GgmlType::F16 => quantize_f16(x),
        GgmlType::BF16 => quantize_bf16(x),
        GgmlType::Q8_0 => quantize_q8_0(x),
        GgmlType::Q6_K => quantize_q6_k(x),
        GgmlType::Q5_1 => quantize_q5_1(x),
        GgmlType::Q5_0 => quantize_q5_0(x),
        GgmlType::Q4_K => quantize_q4_k(x),
        GgmlType::Q4_1 => quantize_q4_1(x),
        GgmlType::Q4_0 => quantize_q4_0(x),
        GgmlType::MXFP4 => quantize_mxfp4(x),
        GgmlType::Q5_K => quantize_q5_k(x),
        GgmlType::Q3_K => quantize_q3_k(x),
        GgmlType::Q2_K => quantize_q2_k(x),
        GgmlType::IQ4_NL => quantize_iq4_nl(x),
        GgmlType::IQ4_XS => quantize_iq4_xs(x),
        GgmlType::Q8_0_24 | GgmlType::Q4_0_24 => sparse::quantize(ty, x)?,
        _ => unreachable!("checked by is_supported"),
    })
}

/// Where a block's scales sit: byte offsets of its f16 scales within the block.
pub(crate) fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        GgmlType::Q8_0_24 | GgmlType::Q4_0_24 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q3_K => &[108],
        GgmlType::Q2_K => &[80, 82],
        _ => &[],
    }
}

/// Checks every block scale of a stored tensor: a NaN or infinite scale (or MXFP4's NaN
/// exponent 0xFF) turns its whole block into NaN or infinity, which would silently poison every
/// activation downstream; this finds it at load instead. Float tensors are not scanned (their
/// values are the weights themselves; a scan would read every byte of the file at load).
pub fn check_blocks(ty: GgmlType, bytes: &[u8]) -> Result<(), QuantError> {
    let bb = ty.block_bytes();
    if ty == GgmlType::MXFP4 {
        if let Some(block) = bytes.chunks_exact(bb).position(|b| b[0] == 0xff) {
            return Err(QuantError::CorruptBlock {
                ty,
                block,
                offset: block * bb,
                reason: "its E8M0 scale is 0xFF (NaN)",
            });
        }
        return Ok(());
    }
    let offsets = f16_scale_offsets(ty);
    if offsets.is_empty() {
        return Ok(());
    }
    for (block, b) in bytes.chunks_exact(bb).enumerate() {
        for &o in offsets {
            let h = u16::from_le_bytes([b[o], b[o + 1]]);
            if h & 0x7c00 == 0x7c00 {
                return Err(QuantError::CorruptBlock {
                    ty,
                    block,
                    offset: block * bb + o,
                    reason: if h & 0x03ff != 0 {
                        "its f16 scale is NaN"
                    } else {
                        "its f16 scale is infinite"
                    },
                });
            }
        }
    }
    Ok(())
}

/// Scalar reference: decodes `out.len()` elements stored as `ty` in `bytes`.
#[inline]
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    if !is_supported(ty) {
        return Err(QuantError::Unsupported(ty));
    }
    let expected = ty
        .bytes_for(out.len() as u64)
        .map(|b| b as usize)
        .filter(|&b| b == bytes.len());
    if expected.is_none() {
        return Err(QuantError::BadLength {
            ty,
            n: out.len(),
            expected: ty.bytes_for(out.len() as u64).unwrap_or(0) as usize,
            got: bytes.len(),
        });
    }
    match ty {
        GgmlType::F32 => float::decode_f32(bytes, out),
        GgmlType::F16 => float::decode_f16(bytes, out),
        GgmlType::BF16 => float::decode_bf16(bytes, out),
        GgmlType::Q8_0 => q8::decode_q8_0(bytes, out),
        GgmlType::Q4_0 => q4::decode_q4_0(bytes, out),
        GgmlType::Q4_1 => q4::decode_q4_1(bytes, out),
        GgmlType::Q5_0 => q5::decode_q5_0(bytes, out),
        GgmlType::Q5_1 => q5::decode_q5_1(bytes, out),
        GgmlType::Q4_K => k_quants::decode_q4_k(bytes, out),
        GgmlType::Q6_K => k_quants::decode_q6_k(bytes, out),
        GgmlType::MXFP4 => mxfp4::decode_mxfp4(bytes, out),
        GgmlType::Q5_K => q5_k::decode_q5_k(bytes, out),
        GgmlType::Q3_K => q3_k::decode_q3_k(bytes, out),
        GgmlType::Q2_K => q2_k::decode_q2_k(bytes, out),
        GgmlType::IQ4_NL => iq4::decode_iq4_nl(bytes, out),
        GgmlType::IQ4_XS => iq4::decode_iq4_xs(bytes, out),
        GgmlType::Q8_0_24 | GgmlType::Q4_0_24 => sparse::decode(ty, bytes, out),
        _ => unreachable!("checked by is_supported"),
    }
    Ok(())
}

/// Decodes a whole tensor to f32 (allocates; for tools and tests, not for the forward pass).
pub fn dequantize_to_vec(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, QuantError> {
    let mut out = vec![0f32; n];
    dequantize(ty, bytes, &mut out)?;
    Ok(out)
}

/// The signal the encoders' round-trip tests fit: a wave whose scale grows block by block,
/// with a 4x outlier every 97 values (each encoder must place its scales around both).
#[cfg(test)]
pub(crate) mod test_signal {
    pub fn sample(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let base = (i as f32 * 0.731).sin() * (1.0 + (i / 32) as f32 * 0.3);
                if i % 97 == 5 { base * 4.0 } else { base }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_type_encodes_and_decodes() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 7 % 19) as f32 - 9.0) * 0.05)
            .collect();
        // The compressed 2:4 types take 2:4-sparse input: keep the first two of every four.
        let x24: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 4 < 2 { v } else { 0.0 })
            .collect();
        for &ty in SUPPORTED {
            let x = if sparse::is_sparse(ty) { &x24 } else { &x };
            let b = quantize(ty, x).unwrap();
            assert_eq!(b.len() as u64, ty.bytes_for(512).unwrap(), "{ty}");
            let y = dequantize_to_vec(ty, &b, 512).unwrap();
            // The 4-bit formats keep the error within a quarter of the range (0.45 each way),
            // Q3_K's 8 levels within a third and Q2_K's 4 within half.
            let bound = match ty {
                GgmlType::Q2_K => 0.5,
                GgmlType::Q3_K => 0.34,
                _ => 0.25,
            };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= bound, "{ty}: {a} vs {b}");
            }
            check_blocks(ty, &b).unwrap();
        }
        assert_eq!(
            quantize(GgmlType::Q4_K, &x[..480]),
            Err(QuantError::NotWholeBlocks {
                ty: GgmlType::Q4_K,
                n: 480
            })
        );
        assert!(matches!(
            quantize(GgmlType::Q8_0, &[f32::NAN; 32]),
            Err(QuantError::NonFinite { index: 0, .. })
        ));
        assert!(matches!(
            quantize(GgmlType::F16, &[1e6]),
            Err(QuantError::OutOfRange { .. })
        ));
        assert_eq!(
            quantize(GgmlType::IQ2_XS, &x),
            Err(QuantError::Unsupported(GgmlType::IQ2_XS))
        );
    }

    #[test]
    fn corrupt_scales_are_found() {
        // 2:4-sparse, so the compressed types take it too.
        let x: Vec<f32> = (0..512)
            .map(|i| if i % 4 < 2 { 0.5 } else { 0.0 })
            .collect();
        for &ty in SUPPORTED.iter().filter(|t| t.block_size() > 1) {
            let mut b = quantize(ty, &x).unwrap();
            let bb = ty.block_bytes();
            // Poison the second block's (first) scale.
            match ty {
                GgmlType::MXFP4 => b[bb] = 0xff,
                _ => {
                    let o = bb + f16_scale_offsets(ty)[0];
                    b[o..o + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
                }
            }
            match check_blocks(ty, &b) {
                Err(QuantError::CorruptBlock { block: 1, .. }) => {}
                other => panic!("{ty}: {other:?}"),
            }
        }
        // An infinite Q4_1 minimum is found too.
        let mut b = quantize(GgmlType::Q4_1, &x).unwrap();
        b[2..4].copy_from_slice(&0xfc00u16.to_le_bytes());
        let e = check_blocks(GgmlType::Q4_1, &b).unwrap_err();
        assert!(e.to_string().contains("infinite"), "{e}");
        // So are the second scales of the K-quants with two (Q5_K's dmin at 2, Q2_K's at 82),
        // at the right block and byte.
        for (ty, at) in [(GgmlType::Q5_K, 2), (GgmlType::Q2_K, 82)] {
            let mut b = quantize(ty, &x).unwrap();
            let o = ty.block_bytes() + at;
            b[o..o + 2].copy_from_slice(&0x7c00u16.to_le_bytes());
            assert_eq!(
                check_blocks(ty, &b),
                Err(QuantError::CorruptBlock {
                    ty,
                    block: 1,
                    offset: o,
                    reason: "its f16 scale is infinite"
                })
            );
        }
    }
}
