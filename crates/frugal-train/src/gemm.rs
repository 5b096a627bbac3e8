//! Matrix products of the training engine (placeholder: plain loops, replaced by the blocked
//! kernels).

use rayon::prelude::*;

/// A strided view of an f32 matrix: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `rows x cols` matrix.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transposed view.
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.rs + j * self.cs]
    }
}

/// Which arithmetic the products use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

/// `c (a.rows x b.cols, row-major) = (c if accumulate, else 0) + a . b`.
pub fn matmul(a: MatRef, b: MatRef, c: &mut [f32], accumulate: bool, precision: Precision) {
    assert_eq!(a.cols, b.rows);
    assert_eq!(c.len(), a.rows * b.cols);
    let round = |x: f32| match precision {
        Precision::F32 => x,
        Precision::Bf16 => bf16_round(x),
    };
    let n = b.cols;
    if n == 0 {
        return;
    }
    c.par_chunks_mut(n).enumerate().for_each(|(i, row)| {
        for (j, out) in row.iter_mut().enumerate() {
            let mut s = 0f32;
            for p in 0..a.cols {
                s += round(a.at(i, p)) * round(b.at(p, j));
            }
            *out = if accumulate { *out + s } else { s };
        }
    });
}

/// Reference for [`Precision::Bf16`].
pub fn matmul_bf16_reference(a: MatRef, b: MatRef, c: &mut [f32], accumulate: bool) {
    matmul(a, b, c, accumulate, Precision::Bf16)
}

/// Reference for [`Precision::F32`].
pub fn matmul_f32_reference(a: MatRef, b: MatRef, c: &mut [f32], accumulate: bool) {
    matmul(a, b, c, accumulate, Precision::F32)
}

/// Rounds to the nearest bf16 (ties to even).
pub fn bf16_round(x: f32) -> f32 {
    let b = x.to_bits();
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(r)
}

/// What [`Precision::Bf16`] runs on.
pub fn bf16_backend() -> &'static str {
    "f32 loops (placeholder)"
}

/// GFLOP/s of a large product.
pub fn peak_gflops(_precision: Precision, _threads: usize) -> f64 {
    0.0
}
