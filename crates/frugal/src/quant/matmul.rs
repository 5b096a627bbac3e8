//! Threaded matrix products over any supported stored format.
//!
//! `matvec` (decode): one activation vector, parallel over chunks of output rows, each row
//! dequantized in registers by `kernels::dot_row`.
//! `matmul` (prefill): many activation rows. Each task dequantizes a tile of weight rows once into
//! an f32 buffer that stays in L2, then multiplies it against every token with the register-blocked
//! `kernels::gemm_f32`, so the dequantization cost is amortized over the whole batch.

use rayon::prelude::*;

use super::kernels;
use super::{GgmlType, QuantError, dequantize, is_supported};

/// A row-major matrix of `rows` x `cols` elements stored as `ty`, borrowed from a model file.
#[derive(Copy, Clone, Debug)]
pub struct WeightMatrix<'a> {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> WeightMatrix<'a> {
    /// Checks the format is supported and `data` holds exactly `rows` x `cols` elements.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self, QuantError> {
        if !is_supported(ty) {
            return Err(QuantError::Unsupported(ty));
        }
        let expected = ty
            .bytes_for(cols as u64)
            .and_then(|b| b.checked_mul(rows as u64))
            .unwrap_or(u64::MAX);
        if expected != data.len() as u64 {
            return Err(QuantError::BadLength {
                ty,
                n: rows * cols,
                expected: expected as usize,
                got: data.len(),
            });
        }
        Ok(WeightMatrix {
            ty,
            rows,
            cols,
            data,
        })
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Decodes row `r` into `out` (length `cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        dequantize(self.ty, self.row(r), out).expect("validated at construction");
    }
}

/// Output rows per parallel task in `matvec`: large enough to amortize scheduling, small enough
/// to balance two or more threads on the 576-row projections.
const MATVEC_CHUNK: usize = 32;
/// Weight rows dequantized per task in `matmul` (16 x 1536 f32 = 96 KiB, resident in L2).
const MATMUL_TILE: usize = 16;

/// `y = W x` for one activation vector (`x.len() == cols`, `y.len() == rows`).
pub fn matvec(w: &WeightMatrix, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), w.cols, "matvec input length");
    assert_eq!(y.len(), w.rows, "matvec output length");
    let isa = kernels::detect();
    let rb = w.row_bytes();
    y.par_chunks_mut(MATVEC_CHUNK)
        .enumerate()
        .for_each(|(c, ys)| {
            let r0 = c * MATVEC_CHUNK;
            for (i, yv) in ys.iter_mut().enumerate() {
                let r = r0 + i;
                *yv = kernels::dot_row(isa, w.ty, &w.data[r * rb..(r + 1) * rb], x);
            }
        });
}

/// `y[t] = W x[t]` for `n` activation rows: `x` is `n x cols`, `y` is `n x rows`, both row-major.
pub fn matmul(w: &WeightMatrix, x: &[f32], n: usize, y: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul input length");
    assert_eq!(y.len(), n * w.rows, "matmul output length");
    if n == 1 {
        return matvec(w, x, y);
    }
    let isa = kernels::detect();
    let k = w.cols;
    // Each task writes its tile transposed (rows x n); the tiles are then scattered into y.
    let mut yt = vec![0f32; w.rows * n];
    yt.par_chunks_mut(MATMUL_TILE * n)
        .enumerate()
        .for_each_init(
            || vec![0f32; MATMUL_TILE * k],
            |tile, (c, out)| {
                let r0 = c * MATMUL_TILE;
                let rows = out.len() / n;
                for i in 0..rows {
                    w.dequantize_row(r0 + i, &mut tile[i * k..(i + 1) * k]);
                }
                kernels::gemm_f32(isa, &tile[..rows * k], x, k, out);
            },
        );
    scatter_transposed(&yt, n, w.rows, y);
}

/// `y[t][r] = yt[r][t]`.
pub(super) fn scatter_transposed(yt: &[f32], n: usize, rows: usize, y: &mut [f32]) {
    y.par_chunks_mut(rows).enumerate().for_each(|(t, yrow)| {
        for (r, v) in yrow.iter_mut().enumerate() {
            *v = yt[r * n + t];
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_q4_1;

    #[test]
    fn matmul_equals_matvec_per_token() {
        let (rows, cols, n) = (37, 64, 9);
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 31 % 17) as f32 - 8.0) / 8.0)
            .collect();
        let data = quantize_q4_1(&wf);
        let w = WeightMatrix::new(GgmlType::Q4_1, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 6.0)
            .collect();
        let mut y = vec![0f32; n * rows];
        matmul(&w, &x, n, &mut y);
        for t in 0..n {
            let mut yv = vec![0f32; rows];
            matvec(&w, &x[t * cols..(t + 1) * cols], &mut yv);
            for r in 0..rows {
                let (a, b) = (y[t * rows + r], yv[r]);
                assert!(
                    (a - b).abs() <= 1e-4 * (1.0 + a.abs()),
                    "t={t} r={r}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn constructor_checks_sizes_and_types() {
        assert!(WeightMatrix::new(GgmlType::Q4_1, 2, 32, &[0; 40]).is_ok());
        assert!(WeightMatrix::new(GgmlType::Q4_1, 2, 32, &[0; 39]).is_err());
        assert_eq!(
            WeightMatrix::new(GgmlType::Q3_K, 1, 256, &[0; 110]).unwrap_err(),
            QuantError::Unsupported(GgmlType::Q3_K)
        );
    }
}
