//! Sparse weights re-laid out at load time for the expand-then-multiply kernels.
//!
//! The layout follows `quant::packed`'s Q8_0 layout (groups of eight rows; per 32-element
//! column, eight 32-byte vectors `i` holding elements `4i..4i+4` of the eight rows, byte
//! `4r + j` = row r's element `4i + j`), but only the kept bytes are stored, with a 32-bit mask
//! per vector saying which bytes they are. Per group and column:
//!
//! ```text
//! d[8]      f16 scales of the eight rows                      16 bytes
//! mask[8]   u32: bit b of mask i = byte b of vector i kept    32 bytes
//! values    Int8:    the kept bytes of vector 0, then 1, ... popcount(masks) bytes
//!           Nibbles: 4 x 16 bytes; chunk c's low nibbles are vector 2c's 16 kept codes,
//!                    its high nibbles vector 2c+1's, each stored as code + 8
//! ```
//!
//! One layout serves three storages. Compressed 2:4 (`Q8_0_24`, `Q4_0_24`): every vector keeps
//! exactly 16 bytes (two of each row's four), so 8-bit values take 48 + 128 = 176 bytes per
//! eight rows and 32 columns where dense Q8_0 takes 272, and 4-bit ones 112 where Q4_0 takes 144.
//! An unstructured bitmap (from a dense Q8_0 matrix with zeros): each vector keeps its nonzero
//! bytes, however many. The kernel (`kernels::dot_sparse`) expands each vector back to its 32
//! dense bytes in one instruction (`vpexpandb`, AVX-512 VBMI2, zeros elsewhere) and then runs
//! exactly the dense Q8_0 kernel's arithmetic, so a sparse matrix's products are the same bits as
//! the dense Q8_0 matrix of the same weights.

use rayon::prelude::*;

use super::act::{Q8Acts, Q8Row};
use super::kernels;
use super::matmul::par_row_groups;
use super::packed::GROUP;
use super::sparse::{self, KEPT, QK};
use super::{GgmlType, QuantError, WeightMatrix, f16_to_f32};

/// How the kept values are stored.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Values {
    /// One signed byte per kept value, any number per vector (a bitmap).
    Int8,
    /// One signed byte per kept value, exactly 16 per vector (2:4): every vector's bytes start
    /// at a fixed offset, so no load waits for a population count.
    Half,
    /// One 4-bit code per kept value, exactly 16 per vector (2:4).
    Nibbles,
}

impl Values {
    /// Whether every vector keeps exactly 16 bytes.
    pub fn fixed(self) -> bool {
        self != Values::Int8
    }
}

/// Header bytes of a column: eight f16 scales and eight masks.
pub const HEAD: usize = 16 + 32;
/// Readable bytes after the last group (see [`SparseMatrix::pack`]).
pub const PAD: usize = 32;

/// A weight matrix in the sparse grouped layout; its products take 8-bit activations.
#[derive(Clone, Debug)]
pub struct SparseMatrix {
    /// The stored type it was built from (Q8_0 for a bitmap, or a compressed 2:4 type).
    pub source: GgmlType,
    pub values: Values,
    pub rows: usize,
    pub cols: usize,
    /// Kept weights (including a 2:4 block's kept zeros).
    pub kept: usize,
    data: Vec<u8>,
    /// Byte offset of each group, and the end.
    starts: Vec<usize>,
}

/// One row's block: its scale bytes, 32 dense signed codes, and which elements are kept.
fn row_block(ty: GgmlType, blk: &[u8]) -> ([u8; 2], [i8; QK], u32) {
    let d = [blk[0], blk[1]];
    match ty {
        GgmlType::Q8_0 => {
            let codes: [i8; QK] = std::array::from_fn(|e| blk[2 + e] as i8);
            let mask = (0..QK).fold(0u32, |m, e| m | (u32::from(codes[e] != 0) << e));
            (d, codes, mask)
        }
        _ => {
            let b = sparse::read_block(ty, blk);
            let mut codes = [0i8; QK];
            let mut mask = 0u32;
            for k in 0..KEPT {
                codes[b.elements[k] as usize] = b.codes[k];
                mask |= 1 << b.elements[k];
            }
            (d, codes, mask)
        }
    }
}

impl SparseMatrix {
    /// Builds the layout from a compressed 2:4 matrix (`Q8_0_24`, `Q4_0_24`) or, as an
    /// unstructured bitmap, from a dense Q8_0 one (keeping its nonzero codes).
    pub fn pack(w: &WeightMatrix) -> Result<Self, QuantError> {
        let values = match w.ty {
            GgmlType::Q8_0 => Values::Int8,
            GgmlType::Q8_0_24 => Values::Half,
            GgmlType::Q4_0_24 => Values::Nibbles,
            ty => return Err(QuantError::Unsupported(ty)),
        };
        let nb = w.cols / QK;
        let bb = w.ty.block_bytes();
        let groups: Vec<(Vec<u8>, usize)> = (0..w.rows.div_ceil(GROUP))
            .into_par_iter()
            .map(|g| {
                let mut out = Vec::new();
                let mut kept = 0;
                for b in 0..nb {
                    let rows: [([u8; 2], [i8; QK], u32); GROUP] = std::array::from_fn(|r| {
                        let row = g * GROUP + r;
                        if row < w.rows {
                            row_block(w.ty, &w.row(row)[b * bb..(b + 1) * bb])
                        } else if values.fixed() {
                            // Padding rows keep two zeros of every four, so every vector
                            // still holds 16 codes.
                            ([0; 2], [0; QK], 0x3333_3333)
                        } else {
                            ([0; 2], [0; QK], 0)
                        }
                    });
                    for (d, ..) in &rows {
                        out.extend_from_slice(d);
                    }
                    // Vector i's mask and kept bytes (rows ascending, elements ascending).
                    let mut vectors: [(u32, Vec<i8>); 8] = Default::default();
                    for (i, (mask, vals)) in vectors.iter_mut().enumerate() {
                        for (r, (_, codes, m)) in rows.iter().enumerate() {
                            for j in 0..4 {
                                if m >> (4 * i + j) & 1 == 1 {
                                    *mask |= 1 << (4 * r + j);
                                    vals.push(codes[4 * i + j]);
                                }
                            }
                        }
                    }
                    for (mask, _) in &vectors {
                        out.extend_from_slice(&mask.to_le_bytes());
                    }
                    match values {
                        Values::Int8 | Values::Half => {
                            for (_, vals) in &vectors {
                                kept += vals.len();
                                out.extend(vals.iter().map(|&v| v as u8));
                            }
                        }
                        Values::Nibbles => {
                            for c in 0..4 {
                                let (lo, hi) = (&vectors[2 * c].1, &vectors[2 * c + 1].1);
                                debug_assert!(lo.len() == 16 && hi.len() == 16);
                                kept += 32;
                                out.extend(
                                    lo.iter()
                                        .zip(hi)
                                        .map(|(&l, &h)| ((l + 8) as u8) | (((h + 8) as u8) << 4)),
                                );
                            }
                        }
                    }
                }
                (out, kept)
            })
            .collect();
        let mut starts = Vec::with_capacity(groups.len() + 1);
        let mut data = Vec::with_capacity(groups.iter().map(|g| g.0.len()).sum::<usize>() + 32);
        let mut kept = 0;
        for (g, k) in groups {
            starts.push(data.len());
            data.extend_from_slice(&g);
            kept += k;
        }
        starts.push(data.len());
        // The kernels load 32 bytes at a time from where a vector's values start; the padding
        // keeps the last load inside the buffer.
        data.resize(data.len() + PAD, 0);
        // Kept padding rows are not weights.
        let padding = w.rows.div_ceil(GROUP) * GROUP - w.rows;
        if values.fixed() {
            kept -= padding * w.cols / 2;
        }
        Ok(SparseMatrix {
            source: w.ty,
            values,
            rows: w.rows,
            cols: w.cols,
            kept,
            data,
            starts,
        })
    }

    /// Bytes of group `g` (rows `8g..8g+8`).
    pub fn group(&self, g: usize) -> &[u8] {
        &self.data[self.starts[g]..self.starts[g + 1]]
    }

    /// Group `g` followed by the [`PAD`] bytes after it (the next group's, or the padding), for
    /// kernels that load whole vectors.
    pub(crate) fn group_padded(&self, g: usize) -> &[u8] {
        &self.data[self.starts[g]..self.starts[g + 1] + PAD]
    }

    /// Heap bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len() + self.starts.len() * std::mem::size_of::<usize>()
    }

    /// The fraction of weights not stored.
    pub fn sparsity(&self) -> f64 {
        1.0 - self.kept as f64 / (self.rows * self.cols) as f64
    }
}

/// The fraction of a dense Q8_0 matrix's codes that are zero (what a bitmap would drop).
pub fn zero_fraction(w: &WeightMatrix) -> Option<f64> {
    if w.ty != GgmlType::Q8_0 {
        return None;
    }
    let zeros: usize = w
        .data
        .par_chunks(34 * 1024)
        .map(|c| {
            c.chunks_exact(34)
                .map(|b| b[2..].iter().filter(|&&q| q == 0).count())
                .sum::<usize>()
        })
        .sum();
    Some(zeros as f64 / (w.rows * w.cols) as f64)
}

/// Column `c` of a group: its header, then where its values start and how many bytes they take.
fn column_values(values: Values, column: &[u8]) -> ([u32; 8], usize) {
    let masks: [u32; 8] = std::array::from_fn(|i| {
        u32::from_le_bytes(column[16 + 4 * i..20 + 4 * i].try_into().expect("4 bytes"))
    });
    let len = match values {
        Values::Int8 => masks.iter().map(|m| m.count_ones() as usize).sum(),
        Values::Half => 128,
        Values::Nibbles => 64,
    };
    (masks, len)
}

/// Scalar kernel: each vector expanded back to its 32 dense bytes, then the dense Q8_0
/// arithmetic in the same order as the SIMD kernels (the two halves' integer sums added, then
/// one fused multiply-add per block), so the results are the same bits.
pub fn dot_group_scalar(values: Values, group: &[u8], x: Q8Row, out: &mut [f32; GROUP]) {
    let ncols = x.qs.len() / QK;
    let mut acc = [0f32; GROUP];
    let mut at = 0;
    for c in 0..ncols {
        let column = &group[at..];
        let (masks, len) = column_values(values, column);
        let vals = &column[HEAD..HEAD + len];
        let dense = expand_column(values, &masks, vals);
        for (r, a) in acc.iter_mut().enumerate() {
            let d = f16_to_f32(u16::from_le_bytes([column[2 * r], column[2 * r + 1]]));
            let isum: i32 = (0..QK)
                .map(|e| {
                    let w = dense[e / 4][4 * r + e % 4];
                    i32::from(w) * i32::from(x.qs[QK * c + e])
                })
                .sum();
            *a = (isum as f32).mul_add(d * x.d[c], *a);
        }
        at += HEAD + len;
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = a + 0.0;
    }
}

/// The eight dense 32-byte vectors of one column.
fn expand_column(values: Values, masks: &[u32; 8], vals: &[u8]) -> [[i8; 32]; 8] {
    let mut dense = [[0i8; 32]; 8];
    let mut at = 0;
    for (i, (m, v)) in masks.iter().zip(dense.iter_mut()).enumerate() {
        let mut k = 0;
        for (b, vb) in v.iter_mut().enumerate() {
            if m >> b & 1 == 1 {
                *vb = match values {
                    Values::Int8 | Values::Half => vals[at + k] as i8,
                    Values::Nibbles => {
                        let byte = vals[16 * (i / 2) + k];
                        let nib = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                        nib as i8 - 8
                    }
                };
                k += 1;
            }
        }
        if values != Values::Nibbles {
            at += k;
        }
    }
    dense
}

/// Output rows per parallel task for one token (8 groups), and for many.
const MATVEC_ROWS: usize = 32;
const MATMUL_ROWS: usize = 16;
/// Tokens per kernel call for many tokens: each column's expanded weights serve four tokens.
const TOKENS_PER_CALL: usize = 4;

/// `y[t] = W x[t]` for every activation row (`y` is `n x rows`, token-major), tiled as
/// `packed::matmul_packed` is.
pub fn matmul_sparse(w: &SparseMatrix, x: &Q8Acts, y: &mut [f32]) {
    let (n, k) = (x.n, x.k);
    assert_eq!(k, w.cols, "matmul input length");
    assert_eq!(y.len(), n * w.rows, "matmul output length");
    let isa = kernels::detect();
    let tile = if n == 1 { MATVEC_ROWS } else { MATMUL_ROWS };
    par_row_groups(w.rows, n, tile, y, |r0, rows, out| {
        for gi in 0..rows.div_ceil(GROUP) {
            let g = r0 / GROUP + gi;
            let mut t = 0;
            while t + TOKENS_PER_CALL <= n {
                let xs: [Q8Row<'_>; TOKENS_PER_CALL] = std::array::from_fn(|i| x.row(t + i));
                let mut o = [[0f32; GROUP]; TOKENS_PER_CALL];
                kernels::dot_sparse(isa, w, g, &xs, &mut o);
                for (dt, ot) in o.iter().enumerate() {
                    out.put(t + dt, gi * GROUP, ot);
                }
                t += TOKENS_PER_CALL;
            }
            for t in t..n {
                let mut o = [[0f32; GROUP]; 1];
                kernels::dot_sparse(isa, w, g, &[x.row(t)], &mut o);
                out.put(t, gi * GROUP, &o[0]);
            }
        }
    });
}

#[cfg(test)]
mod tests;
