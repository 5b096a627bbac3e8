//! A weight matrix as the forward applies it: the matrix owns its stored form (its bytes in
//! the file's map, a repacked copy for integer products, or a sparse one) and knows which form
//! of the activations its kernel reads, so a caller hands it a [`ProductInput`] and gets the product
//! without choosing a kernel.

use std::ops::Range;
use std::sync::Arc;

use super::act::{Activations, Q8Acts, WideActs};
use super::packed::{PackedMatrix, matmul_packed, matvec_packed_many};
use super::sparse_matrix::{SparseMatrix, matmul_sparse};
use super::{GgmlType, WeightMatrix, matmul};
use crate::gguf::SharedBytes;

/// The form of the activations a matrix's kernel reads.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum ActForm {
    /// f32 rows, products on the stored bytes.
    #[default]
    F32,
    /// 8 bits per block of 32 with a scale per block ([`Q8Acts::quantize`]).
    Blocks,
    /// 8 bits with a scale per 256 values ([`Q8Acts::quantize_super_blocks`]): llama.cpp's
    /// Q8_K, what it feeds its K-quant products.
    SuperBlocks,
    /// 15 bits per block of 32 ([`WideActs`]).
    Wide,
}

/// Where the matrix's values are read from.
#[derive(Clone, Debug)]
enum Stored {
    /// The file's bytes, in their stored format.
    Mapped,
    /// The grouped layout of `quant::packed` for integer products.
    Packed(Arc<PackedMatrix>),
    /// The sparse grouped layout of `quant::sparse_matrix`.
    Sparse(Arc<SparseMatrix>),
}

/// A `rows x cols` weight matrix in format `ty`.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// The file image holding the stored bytes, and their range in it.
    file: SharedBytes,
    range: Range<usize>,
    stored: Stored,
    /// The activations the kernel of `stored` reads under quantized activations.
    form: ActForm,
}

/// Whether llama.cpp feeds a format's products Q8_K activations (its `vec_dot_type`): the
/// K-quants and IQ4_XS. The 32-value formats take Q8_0 or Q8_1, which [`ActForm::Blocks`] is.
pub fn reads_super_blocks(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS)
}

impl Matrix {
    /// The matrix stored at `range` of `file` (its size and blocks checked by the caller).
    pub fn mapped(
        name: String,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        file: SharedBytes,
        range: Range<usize>,
    ) -> Self {
        Matrix {
            name,
            ty,
            rows,
            cols,
            file,
            range,
            stored: Stored::Mapped,
            form: ActForm::F32,
        }
    }

    /// Rows `first..first + rows` of a mapped matrix as a matrix of their own, named `name`
    /// (a part of a fused projection, or one expert of a stacked tensor: rows are stored one
    /// after another, so a run of them is a byte range of its own).
    pub fn row_range(&self, name: String, first: usize, rows: usize) -> Self {
        assert!(
            matches!(self.stored, Stored::Mapped) && first + rows <= self.rows,
            "Matrix::row_range: rows {first}..{} of {} ({})",
            first + rows,
            self.rows,
            self.name
        );
        let row_bytes = self.range.len() / self.rows;
        let start = self.range.start + first * row_bytes;
        Matrix::mapped(
            name,
            self.ty,
            rows,
            self.cols,
            self.file.clone(),
            start..start + rows * row_bytes,
        )
    }

    /// The stored bytes, borrowed from the file's map.
    pub fn view(&self) -> WeightMatrix<'_> {
        WeightMatrix {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            data: &self.file.as_slice()[self.range.clone()],
        }
    }

    /// The byte range of the matrix in the file.
    pub fn file_range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The repacked copy, when the matrix has one.
    pub fn packed(&self) -> Option<&PackedMatrix> {
        match &self.stored {
            Stored::Packed(p) => Some(p),
            _ => None,
        }
    }

    /// The sparse copy, when the matrix has one.
    pub fn sparse(&self) -> Option<&SparseMatrix> {
        match &self.stored {
            Stored::Sparse(s) => Some(s),
            _ => None,
        }
    }

    /// Whether products read the file's bytes (no copy was made).
    pub fn is_mapped(&self) -> bool {
        matches!(self.stored, Stored::Mapped)
    }

    /// Bytes of the copy held on the heap (0 when mapped).
    pub fn heap_bytes(&self) -> usize {
        match &self.stored {
            Stored::Mapped => 0,
            Stored::Packed(p) => p.bytes(),
            Stored::Sparse(s) => s.bytes(),
        }
    }

    /// Bytes one product reads: the copy's, or the stored bytes when there is none.
    pub fn bytes_read(&self) -> usize {
        match &self.stored {
            Stored::Mapped => self.range.len(),
            _ => self.heap_bytes(),
        }
    }

    /// The activation form products take under quantized activations.
    pub fn act_form(&self) -> ActForm {
        self.form
    }

    /// Reads from now on from `p`, a repacked copy of this matrix, and releases the file's
    /// pages of the stored bytes (they fault back in if read again).
    pub fn store_packed(&mut self, p: Arc<PackedMatrix>) {
        self.stored = Stored::Packed(p);
        self.form = ActForm::Blocks;
        self.file.release(self.range.clone());
    }

    /// Reads from now on from `s`, a sparse copy of this matrix (see [`Self::store_packed`]).
    pub fn store_sparse(&mut self, s: Arc<SparseMatrix>) {
        self.stored = Stored::Sparse(s);
        self.form = ActForm::Blocks;
        self.file.release(self.range.clone());
    }

    /// Chooses the activations the integer kernel reads under `act`: llama.cpp's forms under
    /// `q8-full` (Q8_K for the formats it gives them), and under `q8` 32-value blocks, or 15
    /// bits into a Q8_0 output head (`head`), whose error reaches the token distribution
    /// directly instead of being averaged by later layers.
    pub fn choose_act_form(&mut self, act: Activations, head: bool) {
        self.form = match (&self.stored, act) {
            (Stored::Mapped, _) | (_, Activations::F32) => ActForm::F32,
            (Stored::Sparse(_), _) => ActForm::Blocks,
            (Stored::Packed(p), Activations::Q8) if head && p.ty == GgmlType::Q8_0 => ActForm::Wide,
            (Stored::Packed(p), Activations::Q8Full) if reads_super_blocks(p.ty) => {
                ActForm::SuperBlocks
            }
            (Stored::Packed(_), _) => ActForm::Blocks,
        };
    }

    /// The form this product reads its input in.
    fn form_for(&self, x: &ProductInput) -> ActForm {
        if x.quantized { self.form } else { ActForm::F32 }
    }

    /// `y = W x` for every row of `x` (`y` is `rows of x x self.rows`, row-major).
    pub fn apply(&self, x: &mut ProductInput, y: &mut [f32]) {
        assert_eq!(
            x.k, self.cols,
            "{}: input rows of {} values",
            self.name, x.k
        );
        match (self.form_for(x), &self.stored) {
            (ActForm::F32, _) | (_, Stored::Mapped) => {
                matmul(&self.view(), x.x, x.x.len() / x.k, y)
            }
            (_, Stored::Sparse(s)) => matmul_sparse(s, x.blocks(), y),
            (ActForm::Blocks, Stored::Packed(p)) => matmul_packed(p, x.blocks(), y),
            (ActForm::SuperBlocks, Stored::Packed(p)) => matmul_packed(p, x.super_blocks(), y),
            (ActForm::Wide, Stored::Packed(p)) => matmul_packed(p, x.wide(), y),
        }
    }

    /// `ys[m] = W_m x` for products of the same input, as [`Self::apply`] computes each: a
    /// single row (decode) into repacked matrices reading one activation form runs in one
    /// parallel section ([`matvec_packed_many`]); anything else one product after another.
    /// A layer's keys and values are a third of its queries' size each, and as sections of
    /// their own they took as long as the queries (TSC-stamped decode phases, Zen 4).
    pub fn apply_many<const M: usize>(ws: [&Matrix; M], x: &mut ProductInput, ys: [&mut [f32]; M]) {
        let form = ws[0].form_for(x);
        let packed: Option<[&PackedMatrix; M]> = (x.rows() == 1
            && form != ActForm::F32
            && ws
                .iter()
                .all(|w| w.form_for(x) == form && w.packed().is_some()))
        .then(|| ws.map(|w| w.packed().expect("checked above")));
        match (packed, form) {
            (Some(p), ActForm::Blocks) => matvec_packed_many(p, x.blocks(), ys),
            (Some(p), ActForm::SuperBlocks) => matvec_packed_many(p, x.super_blocks(), ys),
            (Some(p), ActForm::Wide) => matvec_packed_many(p, x.wide(), ys),
            _ => {
                for (w, y) in ws.into_iter().zip(ys) {
                    w.apply(x, y);
                }
            }
        }
    }
}

/// The buffers of an input's integer forms, reused from product to product.
#[derive(Default, Debug, Clone)]
pub struct ActBuffers {
    blocks: Q8Acts,
    super_blocks: Q8Acts,
    wide: WideActs,
    /// Which of the three hold the current input.
    made: [bool; 3],
}

/// The input rows of one or more products (`k` values each), and each integer form of them a
/// product asks for, made once and shared by the products that read the same input.
pub struct ProductInput<'a> {
    x: &'a [f32],
    k: usize,
    quantized: bool,
    buf: &'a mut ActBuffers,
}

impl<'a> ProductInput<'a> {
    /// Rows of `k` values; `act` says whether products may take integer activations.
    pub fn new(x: &'a [f32], k: usize, act: Activations, buf: &'a mut ActBuffers) -> Self {
        assert!(
            k > 0 && x.len().is_multiple_of(k),
            "{} values are not rows of {k}",
            x.len()
        );
        buf.made = [false; 3];
        ProductInput {
            x,
            k,
            quantized: act.quantized(),
            buf,
        }
    }

    pub fn rows(&self) -> usize {
        self.x.len() / self.k
    }

    /// The rows in 8 bits per block of 32.
    pub fn blocks(&mut self) -> &Q8Acts {
        if !self.buf.made[0] {
            self.buf.blocks.quantize(self.x, self.k);
            self.buf.made[0] = true;
        }
        &self.buf.blocks
    }

    /// The rows as llama.cpp's Q8_K.
    pub fn super_blocks(&mut self) -> &Q8Acts {
        if !self.buf.made[1] {
            self.buf.super_blocks.quantize_super_blocks(self.x, self.k);
            self.buf.made[1] = true;
        }
        &self.buf.super_blocks
    }

    /// The rows in 15 bits per block of 32.
    pub fn wide(&mut self) -> &WideActs {
        if !self.buf.made[2] {
            self.buf.wide.quantize(self.x, self.k);
            self.buf.made[2] = true;
        }
        &self.buf.wide
    }
}
