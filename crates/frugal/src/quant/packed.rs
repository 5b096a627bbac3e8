//! Block-quantized weights re-laid out at load time for the 8-bit-activation kernels.
//!
//! GGUF stores each row's blocks one after another, each starting with its f16 scale(s). Here
//! rows are taken in groups of eight and, for each block column, the group's scales are stored
//! together, followed by the data interleaved four elements at a time across the eight rows:
//!
//! ```text
//! Q4_0: d[8]        then 4 chunks of 32 bytes   144 bytes per block column (8 x 18)
//! Q4_1: d[8] m[8]   then 4 chunks of 32 bytes   160 bytes                 (8 x 20)
//! Q8_0: d[8]        then 8 chunks of 32 bytes   272 bytes                 (8 x 34)
//! ```
//!
//! A chunk holds 4 bytes per row. For Q8_0, chunk c holds elements 4c..4c+4 of each row. For the
//! 4-bit formats, chunk c covers elements 8c..8c+8: byte j of a row is element 8c+j in its low
//! nibble and element 8c+4+j in its high nibble. So one 32-byte load, masked (or shifted), is
//! eight rows' next four weights, and one `vpdpbusd` against four activation bytes broadcast to
//! all lanes adds them into eight per-row sums: the lanes are the rows, one conversion and one
//! scale multiply finish a block for eight rows at once, and no horizontal sums are needed. The
//! same bytes as the file, in a single sequential stream per group. (llama.cpp's load-time
//! repacking follows the same idea.) The last group is padded with zero rows.

use rayon::prelude::*;

use super::act::{Q8Acts, Q8Row};
use super::kernels;
use super::matmul::par_row_tiles;
use super::{GgmlType, QuantError, WeightMatrix, f16_to_f32};

/// Rows per packed group.
pub const GROUP: usize = 8;

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
        GgmlType::Q4_0 => Some((2 * GROUP, 16)),
        GgmlType::Q4_1 => Some((4 * GROUP, 16)),
        GgmlType::Q8_0 => Some((2 * GROUP, 32)),
        _ => None,
    }
}

/// The 4 bytes of row `r` in chunk `c` of a packed block column, from the row's original
/// data bytes `q` (16 packed nibble bytes or 32 signed bytes).
fn chunk_bytes(ty: GgmlType, q: &[u8], c: usize) -> [u8; 4] {
    match ty {
        GgmlType::Q8_0 => [q[4 * c], q[4 * c + 1], q[4 * c + 2], q[4 * c + 3]],
        _ => {
            // Element e of the original block: low nibble of q[e] for e < 16, high of q[e-16].
            let nib = |e: usize| if e < 16 { q[e] & 0x0f } else { q[e - 16] >> 4 };
            std::array::from_fn(|j| nib(8 * c + j) | (nib(8 * c + 4 + j) << 4))
        }
    }
}

/// Inverse of [`chunk_bytes`] for one element: the integer weight at element `e` of row `r`.
fn weight_at(ty: GgmlType, data: &[u8], r: usize, e: usize) -> i32 {
    match ty {
        GgmlType::Q8_0 => i32::from(data[(e / 4) * 4 * GROUP + 4 * r + e % 4] as i8),
        _ => {
            let (c, k) = (e / 8, e % 8);
            let byte = data[c * 4 * GROUP + 4 * r + k % 4];
            i32::from(if k < 4 { byte & 0x0f } else { byte >> 4 })
        }
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
                        // Scales: d of row r at 2r; for Q4_1 the minimum m after the eight d.
                        dst[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                        if scale_bytes == 4 {
                            dst[2 * GROUP + 2 * r..2 * GROUP + 2 * r + 2]
                                .copy_from_slice(&blk[2..4]);
                        }
                        let q = &blk[scale_bytes..];
                        for c in 0..qbytes / 4 {
                            let at = head + c * 4 * GROUP + 4 * r;
                            dst[at..at + 4].copy_from_slice(&chunk_bytes(w.ty, q, c));
                        }
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
            let isum: i32 = (0..32)
                .map(|e| weight_at(ty, &blk[head..], r, e) * i32::from(xq[e]))
                .sum();
            let offset = match ty {
                GgmlType::Q8_0 => 0.0,
                GgmlType::Q4_0 => -8.0 * dw * x.s[b],
                _ => half(&blk[2 * GROUP + 2 * r..]) * x.s[b],
            };
            *o += isum as f32 * (dw * x.d[b]) + offset;
        }
    }
}

/// Output rows per parallel task in `matvec_packed` (8 groups).
const MATVEC_ROWS: usize = 32;
/// Rows per parallel task in `matmul_packed`.
const MATMUL_ROWS: usize = 16;

/// Tokens per kernel call in `matmul_packed`: each block's unpacked weights serve four tokens.
const TOKENS_PER_CALL: usize = 4;

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
                let mut out = [[0f32; GROUP]; 1];
                kernels::dot_packed(isa, w.ty, w.group(g0 + i), &[x], &mut out);
                yg.copy_from_slice(&out[0][..yg.len()]);
            }
        });
}

/// `y[t] = W x[t]` for every quantized activation row (`y` is `n x rows`). Each task takes a
/// tile of rows (in L1/L2) and sweeps every token over it, four tokens per kernel call.
pub fn matmul_packed(w: &PackedMatrix, x: &Q8Acts, y: &mut [f32]) {
    let n = x.n;
    assert_eq!(x.k, w.cols, "matmul input length");
    assert_eq!(y.len(), n * w.rows, "matmul output length");
    if n == 1 {
        return matvec_packed(w, x.row(0), y);
    }
    let isa = kernels::detect();
    par_row_tiles(w.rows, n, MATMUL_ROWS, y, |r0, rows, out| {
        for gi in 0..rows.div_ceil(GROUP) {
            let group = w.group(r0 / GROUP + gi);
            let valid = (rows - gi * GROUP).min(GROUP);
            let mut store = |t0: usize, o: &[[f32; GROUP]]| {
                for (dt, ot) in o.iter().enumerate() {
                    let at = (t0 + dt) * rows + gi * GROUP;
                    out[at..at + valid].copy_from_slice(&ot[..valid]);
                }
            };
            let mut t = 0;
            while t + TOKENS_PER_CALL <= n {
                let xs: [Q8Row; TOKENS_PER_CALL] = std::array::from_fn(|i| x.row(t + i));
                let mut o = [[0f32; GROUP]; TOKENS_PER_CALL];
                kernels::dot_packed(isa, w.ty, group, &xs, &mut o);
                store(t, &o);
                t += TOKENS_PER_CALL;
            }
            for t in t..n {
                let mut o = [[0f32; GROUP]; 1];
                kernels::dot_packed(isa, w.ty, group, &[x.row(t)], &mut o);
                store(t, &o);
            }
        }
    });
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
        // 9 tokens: two calls of the four-token kernel and one single-token call.
        let n = 9;
        let x: Vec<f32> = (0..n * cols)
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
            let mut y = vec![0f32; n * rows];
            matmul_packed(&p, &acts, &mut y);
            for t in 0..n {
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
                for (r, v) in o.iter().enumerate().take(rows) {
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
