//! Sparse weights re-laid out at load time for the expand-then-multiply kernels.
//!
//! Rows are taken in groups of sixteen (one per 32-bit lane of a 512-bit register). Per
//! 32-element column a group has eight 64-byte vectors `i` holding elements `4i..4i+4` of the
//! sixteen rows (byte `4r + j` = row r's element `4i + j`, as `quant::packed` lays out eight
//! rows), but only the kept bytes are stored, with a 64-bit mask per vector saying which bytes
//! they are. Per group and column:
//!
//! ```text
//! d[16]     f16 scales of the sixteen rows                    32 bytes
//! mask[8]   u64: bit b of mask i = byte b of vector i kept    64 bytes
//! values    Int8:    the kept bytes of vector 0, then 1, ... popcount(masks) bytes
//!           Half:    the same with exactly 32 per vector      256 bytes
//!           Nibbles: 4 x 32 bytes; chunk c's low nibbles are vector 2c's 32 kept codes,
//!                    its high nibbles vector 2c+1's, each stored as code + 8
//! ```
//!
//! One layout serves three storages. Compressed 2:4 (`Q8_0_24` as `Half`, `Q4_0_24` as
//! `Nibbles`): every vector keeps exactly two of each row's four bytes, so 8-bit values take
//! 352 bytes per sixteen rows and 32 columns where dense Q8_0 takes 544 (0.65x), and 4-bit ones
//! 224 where Q4_0 takes 288 (0.78x). An unstructured bitmap (`Int8`, from a dense Q8_0 matrix
//! with zeros): each vector keeps its nonzero bytes, however many, and a table gives where each
//! column starts. The kernel (`kernels::dot_sparse`) expands each vector back to its 64 dense
//! bytes in one instruction (`vpexpandb`, AVX-512 VBMI2, zeros elsewhere) and multiplies it
//! with the activations' four bytes broadcast to every lane; the integer sums are exact and are
//! scaled exactly as the dense Q8_0 kernel scales its own, so a sparse matrix's products are the
//! same bits as the dense Q8_0 matrix of the same weights.

use rayon::prelude::*;

use super::act::{Q8Acts, Q8Row};
use super::kernels;
use super::matmul::par_row_groups;
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

/// Rows per group.
pub const ROWS: usize = 16;
/// Header bytes of a column: sixteen f16 scales and eight masks.
pub const HEAD: usize = 2 * ROWS + 8 * 8;
/// Readable bytes after the last group (see [`SparseMatrix::pack`]).
pub const PAD: usize = 64;

/// A weight matrix in the sparse grouped layout; its products take 8-bit activations.
#[derive(Clone, Debug)]
pub struct SparseMatrix {
    pub values: Values,
    pub rows: usize,
    pub cols: usize,
    /// Kept weights (including a 2:4 block's kept zeros).
    pub kept: usize,
    data: Vec<u8>,
    /// Byte offset of each group, and the end.
    starts: Vec<usize>,
    /// For `Int8`: where each column of each group starts, from the group's start
    /// (`cols / 32` entries per group), so no column waits for the previous one's counts.
    columns: Vec<u32>,
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
        let groups: Vec<(Vec<u8>, Vec<u32>, usize)> = (0..w.rows.div_ceil(ROWS))
            .into_par_iter()
            .map(|g| {
                let mut out = Vec::new();
                let mut columns = Vec::with_capacity(nb);
                let mut kept = 0;
                for b in 0..nb {
                    columns.push(out.len() as u32);
                    let rows: [([u8; 2], [i8; QK], u32); ROWS] = std::array::from_fn(|r| {
                        let row = g * ROWS + r;
                        if row < w.rows {
                            row_block(w.ty, &w.row(row)[b * bb..(b + 1) * bb])
                        } else if values.fixed() {
                            // Padding rows keep two zeros of every four, so every vector
                            // still holds 32 codes.
                            ([0; 2], [0; QK], 0x3333_3333)
                        } else {
                            ([0; 2], [0; QK], 0)
                        }
                    });
                    for (d, ..) in &rows {
                        out.extend_from_slice(d);
                    }
                    // Vector i's mask and kept bytes (rows ascending, elements ascending).
                    let mut vectors: [(u64, Vec<i8>); 8] = Default::default();
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
                                debug_assert!(lo.len() == 32 && hi.len() == 32);
                                kept += 64;
                                out.extend(
                                    lo.iter()
                                        .zip(hi)
                                        .map(|(&l, &h)| ((l + 8) as u8) | (((h + 8) as u8) << 4)),
                                );
                            }
                        }
                    }
                }
                (out, columns, kept)
            })
            .collect();
        let mut starts = Vec::with_capacity(groups.len() + 1);
        let mut data = Vec::with_capacity(groups.iter().map(|g| g.0.len()).sum::<usize>() + PAD);
        let mut columns = Vec::new();
        let mut kept = 0;
        for (g, cols, k) in groups {
            starts.push(data.len());
            data.extend_from_slice(&g);
            if values == Values::Int8 {
                columns.extend_from_slice(&cols);
            }
            kept += k;
        }
        starts.push(data.len());
        // The kernels load a whole vector's worth of bytes from where its values start; the
        // padding keeps the last load inside the buffer.
        data.resize(data.len() + PAD, 0);
        // Kept padding rows are not weights.
        let padding = w.rows.div_ceil(ROWS) * ROWS - w.rows;
        if values.fixed() {
            kept -= padding * w.cols / 2;
        }
        Ok(SparseMatrix {
            values,
            rows: w.rows,
            cols: w.cols,
            kept,
            data,
            starts,
            columns,
        })
    }

    /// Bytes of group `g` (rows `16g..16g+16`).
    pub fn group(&self, g: usize) -> &[u8] {
        &self.data[self.starts[g]..self.starts[g + 1]]
    }

    /// Where each column of group `g` starts within it (`Int8` only; empty otherwise).
    pub fn column_starts(&self, g: usize) -> &[u32] {
        let nc = self.cols / QK;
        self.columns.get(g * nc..(g + 1) * nc).unwrap_or(&[])
    }

    /// Group `g` followed by the [`PAD`] bytes after it (the next group's, or the padding), for
    /// kernels that load whole vectors.
    pub(crate) fn group_padded(&self, g: usize) -> &[u8] {
        &self.data[self.starts[g]..self.starts[g + 1] + PAD]
    }

    /// Heap bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
            + self.starts.len() * std::mem::size_of::<usize>()
            + self.columns.len() * std::mem::size_of::<u32>()
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

/// A column's masks, and how many bytes its values take.
fn column_values(values: Values, column: &[u8]) -> ([u64; 8], usize) {
    let masks: [u64; 8] = std::array::from_fn(|i| {
        let at = 2 * ROWS + 8 * i;
        u64::from_le_bytes(column[at..at + 8].try_into().expect("8 bytes"))
    });
    let len = match values {
        Values::Int8 => masks.iter().map(|m| m.count_ones() as usize).sum(),
        Values::Half => 256,
        Values::Nibbles => 128,
    };
    (masks, len)
}

/// Scalar kernel: each vector expanded back to its 64 dense bytes, the exact integer sum of
/// each row's block, then one fused multiply-add per block with the scales the SIMD kernel uses
/// (so the results are the same bits).
pub fn dot_group_scalar(values: Values, group: &[u8], x: Q8Row, out: &mut [f32; ROWS]) {
    let ncols = x.qs.len() / QK;
    let mut acc = [0f32; ROWS];
    let mut at = 0;
    for c in 0..ncols {
        let column = &group[at..];
        let (masks, len) = column_values(values, column);
        let dense = expand_column(values, &masks, &column[HEAD..HEAD + len]);
        for (r, a) in acc.iter_mut().enumerate() {
            let d = f16_to_f32(u16::from_le_bytes([column[2 * r], column[2 * r + 1]]));
            let isum: i32 = (0..QK)
                .map(|e| i32::from(dense[e / 4][4 * r + e % 4]) * i32::from(x.qs[QK * c + e]))
                .sum();
            *a = (isum as f32).mul_add(d * x.d[c], *a);
        }
        at += HEAD + len;
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = a + 0.0;
    }
}

/// The eight dense 64-byte vectors of one column.
fn expand_column(values: Values, masks: &[u64; 8], vals: &[u8]) -> [[i8; 64]; 8] {
    let mut dense = [[0i8; 64]; 8];
    let mut at = 0;
    for (i, (m, v)) in masks.iter().zip(dense.iter_mut()).enumerate() {
        let mut k = 0;
        for (b, vb) in v.iter_mut().enumerate() {
            if m >> b & 1 == 1 {
                *vb = match values {
                    Values::Int8 | Values::Half => vals[at + k] as i8,
                    Values::Nibbles => {
                        let byte = vals[32 * (i / 2) + k];
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

/// Output rows per parallel task for one token (2 groups), and for many.
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
    BIASED.with_borrow_mut(|biased| {
        biased.fill(x);
        let biased = &*biased;
        par_row_groups(w.rows, n, tile, y, |r0, rows, out| {
            for gi in 0..rows.div_ceil(ROWS) {
                let g = r0 / ROWS + gi;
                let mut t = 0;
                while t + TOKENS_PER_CALL <= n {
                    let xs: [Q8Row<'_>; TOKENS_PER_CALL] = std::array::from_fn(|i| x.row(t + i));
                    let bs: [&[u8]; TOKENS_PER_CALL] = std::array::from_fn(|i| biased.row(t + i));
                    let mut o = [[0f32; ROWS]; TOKENS_PER_CALL];
                    kernels::dot_sparse(isa, w, g, &xs, &bs, &mut o);
                    for (dt, ot) in o.iter().enumerate() {
                        out.put(t + dt, gi * ROWS, ot);
                    }
                    t += TOKENS_PER_CALL;
                }
                for t in t..n {
                    let mut o = [[0f32; ROWS]; 1];
                    kernels::dot_sparse(isa, w, g, &[x.row(t)], &[biased.row(t)], &mut o);
                    out.put(t, gi * ROWS, &o[0]);
                }
            }
        })
    });
}

/// The activation codes plus 128 (a sign-bit flip), as unsigned bytes: the unsigned operand of
/// `vpdpbusd` against signed weights (the kernel takes `128 * sum(w)` off again, exactly).
#[derive(Default)]
pub struct BiasedActs {
    k: usize,
    qs: Vec<u8>,
}

impl BiasedActs {
    /// Refills from `x` (reusing the buffer).
    pub fn fill(&mut self, x: &Q8Acts) {
        self.k = x.k;
        self.qs.resize(x.n * x.k, 0);
        for (t, out) in self.qs.chunks_exact_mut(x.k.max(1)).enumerate() {
            for (o, &q) in out.iter_mut().zip(x.row(t).qs) {
                *o = (q as u8) ^ 0x80;
            }
        }
    }

    pub fn row(&self, t: usize) -> &[u8] {
        &self.qs[t * self.k..(t + 1) * self.k]
    }
}

thread_local! {
    /// The caller's biased activations for [`matmul_sparse`] (reused across products).
    static BIASED: std::cell::RefCell<BiasedActs> = std::cell::RefCell::new(BiasedActs::default());
}

#[cfg(test)]
mod tests;
