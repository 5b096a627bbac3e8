//! Block-quantized weights re-laid out at load time for the 8-bit-activation kernels.
//!
//! GGUF stores each row's blocks one after another, and each block starts with its f16 scale(s).
//! A matrix-vector kernel then converts scales one at a time and walks several separate row
//! streams. Here rows are taken in groups of four and, for each block column, the four rows'
//! scales are stored together, followed by their four data blocks:
//!
//! ```text
//! Q4_0: d[4] (4 x f16)            qs[4][16]   72 bytes per block column
//! Q4_1: d[4] (4 x f16) m[4] (f16) qs[4][16]   80 bytes
//! Q8_0: d[4] (4 x f16)            qs[4][32]  136 bytes
//! ```
//!
//! so one instruction converts four scales, one activation block feeds four rows, and a group is
//! a single sequential stream (what the prefetcher handles best). This is the same idea as
//! llama.cpp's load-time repacking. The last group is padded with zero rows.

use rayon::prelude::*;

use super::act::{Q8Acts, Q8Row};
use super::kernels::{self, Isa};
use super::matmul::scatter_transposed;
use super::{GgmlType, QuantError, WeightMatrix, f16_to_f32};

/// Rows per packed group.
pub const GROUP: usize = 4;

/// A weight matrix in the grouped layout; its products take 8-bit activations.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: Vec<u8>,
}

/// (bytes of the scale header, bytes of one row's data block) per block column.
pub fn layout(ty: GgmlType) -> Option<(usize, usize)> {
    match ty {
        GgmlType::Q4_0 => Some((8, 16)),
        GgmlType::Q4_1 => Some((16, 16)),
        GgmlType::Q8_0 => Some((8, 32)),
        _ => None,
    }
}

/// Bytes of one block column of a group.
pub fn column_bytes(ty: GgmlType) -> usize {
    layout(ty).map_or(0, |(h, q)| h + GROUP * q)
}

impl PackedMatrix {
    /// Repacks `w` (Q4_0, Q4_1 or Q8_0).
    pub fn pack(w: &WeightMatrix) -> Result<Self, QuantError> {
        let (head, qbytes) = layout(w.ty).ok_or(QuantError::Unsupported(w.ty))?;
        let nb = w.cols / 32;
        let col = head + GROUP * qbytes;
        let groups = w.rows.div_ceil(GROUP);
        let src_block = w.ty.block_bytes();
        let scale_bytes = src_block - qbytes;
        let mut data = vec![0u8; groups * nb * col];
        data.par_chunks_mut(nb * col)
            .enumerate()
            .for_each(|(g, out)| {
                for r in 0..GROUP {
                    let row = g * GROUP + r;
                    if row >= w.rows {
                        break; // zero rows: d = 0 contributes nothing
                    }
                    let src = w.row(row);
                    for b in 0..nb {
                        let blk = &src[b * src_block..(b + 1) * src_block];
                        let dst = &mut out[b * col..(b + 1) * col];
                        // Scales: d of row r at 2r; for Q4_1 the minimum m at 8 + 2r.
                        dst[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                        if scale_bytes == 4 {
                            dst[8 + 2 * r..8 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                        }
                        dst[head + r * qbytes..head + (r + 1) * qbytes]
                            .copy_from_slice(&blk[scale_bytes..]);
                    }
                }
            });
        Ok(PackedMatrix {
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            data,
        })
    }

    fn group_bytes(&self) -> usize {
        self.cols / 32 * column_bytes(self.ty)
    }

    /// Bytes of group `g` (rows `4g..4g+4`).
    pub fn group(&self, g: usize) -> &[u8] {
        let gb = self.group_bytes();
        &self.data[g * gb..(g + 1) * gb]
    }

    /// Heap bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// Scalar reference on the packed layout: exact integer block sums, then the scales.
pub fn dot_group_scalar(ty: GgmlType, group: &[u8], x: Q8Row, out: &mut [f32; GROUP]) {
    let (head, qbytes) = layout(ty).expect("packed type");
    let col = head + GROUP * qbytes;
    let half = |b: &[u8]| f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    *out = [0.0; GROUP];
    for (b, xq) in x.qs.chunks_exact(32).enumerate() {
        let blk = &group[b * col..(b + 1) * col];
        for (r, o) in out.iter_mut().enumerate() {
            let dw = half(&blk[2 * r..]);
            let q = &blk[head + r * qbytes..head + (r + 1) * qbytes];
            let (isum, offset) = match ty {
                GgmlType::Q8_0 => (
                    q.iter()
                        .zip(xq)
                        .map(|(&w, &a)| i32::from(w as i8) * i32::from(a))
                        .sum::<i32>(),
                    0.0,
                ),
                _ => {
                    let m = if ty == GgmlType::Q4_0 {
                        -8.0 * dw
                    } else {
                        half(&blk[8 + 2 * r..])
                    };
                    let mut s = 0i32;
                    for j in 0..16 {
                        s += i32::from(q[j] & 0x0f) * i32::from(xq[j])
                            + i32::from(q[j] >> 4) * i32::from(xq[j + 16]);
                    }
                    (s, m * x.s[b])
                }
            };
            *o += isum as f32 * (dw * x.d[b]) + offset;
        }
    }
}

/// Output rows per parallel task in `matvec_packed` (8 groups).
const MATVEC_ROWS: usize = 32;
/// Rows per parallel task in `matmul_packed`.
const MATMUL_ROWS: usize = 16;

fn dot_group(isa: Isa, ty: GgmlType, group: &[u8], x: Q8Row, out: &mut [f32; GROUP]) {
    kernels::dot_packed(isa, ty, group, x, out)
}

/// `y = W x` for one quantized activation row.
pub fn matvec_packed(w: &PackedMatrix, x: Q8Row, y: &mut [f32]) {
    assert_eq!(x.qs.len(), w.cols, "matvec input length");
    assert_eq!(y.len(), w.rows, "matvec output length");
    let isa = kernels::detect();
    y.par_chunks_mut(MATVEC_ROWS)
        .enumerate()
        .for_each(|(c, ys)| {
            let g0 = c * MATVEC_ROWS / GROUP;
            for (i, yg) in ys.chunks_mut(GROUP).enumerate() {
                let mut out = [0f32; GROUP];
                dot_group(isa, w.ty, w.group(g0 + i), x, &mut out);
                yg.copy_from_slice(&out[..yg.len()]);
            }
        });
}

/// `y[t] = W x[t]` for every quantized activation row (`y` is `n x rows`). Each task takes a
/// tile of rows (in L1/L2) and sweeps every token over it.
pub fn matmul_packed(w: &PackedMatrix, x: &Q8Acts, y: &mut [f32]) {
    let n = x.n;
    assert_eq!(x.k, w.cols, "matmul input length");
    assert_eq!(y.len(), n * w.rows, "matmul output length");
    if n == 1 {
        return matvec_packed(w, x.row(0), y);
    }
    let isa = kernels::detect();
    let mut yt = vec![0f32; w.rows * n];
    yt.par_chunks_mut(MATMUL_ROWS * n)
        .enumerate()
        .for_each(|(c, out)| {
            let r0 = c * MATMUL_ROWS;
            let rows = out.len() / n;
            for t in 0..n {
                let xr = x.row(t);
                for gi in 0..rows.div_ceil(GROUP) {
                    let mut o = [0f32; GROUP];
                    dot_group(isa, w.ty, w.group(r0 / GROUP + gi), xr, &mut o);
                    for (j, &v) in o.iter().enumerate().take(rows - gi * GROUP) {
                        out[(gi * GROUP + j) * n + t] = v;
                    }
                }
            }
        });
    scatter_transposed(&yt, n, w.rows, y);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kernels::scalar;
    use crate::quant::{quantize_q4_0, quantize_q4_1, quantize_q8_0};

    #[test]
    fn packed_products_equal_the_reference_on_the_original_rows() {
        // 7 rows: one full group and a padded one; 5 blocks per row.
        let (rows, cols) = (7, 160);
        let wf: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        let x: Vec<f32> = (0..3 * cols)
            .map(|i| ((i * 11 % 19) as f32 - 9.0) / 3.0)
            .collect();
        let mut acts = Q8Acts::default();
        acts.quantize(&x, cols);
        for (ty, data) in [
            (GgmlType::Q4_0, quantize_q4_0(&wf)),
            (GgmlType::Q4_1, quantize_q4_1(&wf)),
            (GgmlType::Q8_0, quantize_q8_0(&wf)),
        ] {
            let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let p = PackedMatrix::pack(&w).unwrap();
            let mut y = vec![0f32; 3 * rows];
            matmul_packed(&p, &acts, &mut y);
            for t in 0..3 {
                let mut yv = vec![0f32; rows];
                matvec_packed(&p, acts.row(t), &mut yv);
                for r in 0..rows {
                    let want = scalar::dot_q8(ty, w.row(r), acts.row(t));
                    let tol = 1e-5 * (1.0 + want.abs()) * cols as f32 / 32.0;
                    assert!(
                        (y[t * rows + r] - want).abs() <= tol,
                        "{ty} t{t} r{r}: {} vs {want}",
                        y[t * rows + r]
                    );
                    assert!((yv[r] - want).abs() <= tol, "{ty} matvec t{t} r{r}");
                }
                // And the scalar packed kernel agrees with the original-layout reference.
                let mut o = [0f32; GROUP];
                dot_group_scalar(ty, p.group(0), acts.row(t), &mut o);
                for (r, v) in o.iter().enumerate() {
                    let want = scalar::dot_q8(ty, w.row(r), acts.row(t));
                    assert!(
                        (v - want).abs() <= 1e-5 * (1.0 + want.abs()) * 5.0,
                        "{ty} scalar packed r{r}"
                    );
                }
            }
        }
    }
}
