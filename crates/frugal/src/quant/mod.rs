//! Tensor storage formats and the matrix products that read them.
//!
//! Weights stay in their stored format (inside the memory map) and are dequantized inside the
//! kernels. Each format has a plain scalar decoder here (the reference every SIMD kernel is tested
//! against); `kernels` holds the dot products per instruction set and `matmul` the threaded
//! matrix-vector (decode) and matrix-matrix (prefill) products.

pub mod act;
mod float;
pub mod kernels;
mod matmul;
pub mod packed;
mod q4;
mod q8;
mod types;

pub use float::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use matmul::{WeightMatrix, matmul, matvec};
pub use q4::{BlockQ4_0, BlockQ4_1, quantize_q4_0, quantize_q4_1};
pub use q8::{BlockQ8_0, quantize_q8_0};
pub use types::GgmlType;

/// Errors from decoding stored tensors.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum QuantError {
    #[error(
        "tensor type {0} is not supported for computation (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)"
    )]
    Unsupported(GgmlType),
    #[error("{ty} row of {n} elements needs {expected} bytes, got {got}")]
    BadLength {
        ty: GgmlType,
        n: usize,
        expected: usize,
        got: usize,
    },
}

/// Whether frugal has kernels for `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
            | GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
    )
}

/// Scalar reference: decodes `out.len()` elements stored as `ty` in `bytes`.
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
