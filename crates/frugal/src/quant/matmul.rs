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
    par_row_tiles(w.rows, n, MATMUL_TILE, y, |r0, rows, out| {
        // Dequantize the tile once (it stays in L2), then run every token over it.
        TILE.with_borrow_mut(|tile| {
            tile.resize(MATMUL_TILE * k, 0.0);
            for i in 0..rows {
                w.dequantize_row(r0 + i, &mut tile[i * k..(i + 1) * k]);
            }
            kernels::gemm_f32(isa, &tile[..rows * k], x, k, out);
        });
    });
}

thread_local! {
    /// Per-thread dequantized weight tile of `matmul`.
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Per-thread output tile of `par_row_tiles`.
    static OUT_TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A pointer shared by tasks that write disjoint elements.
#[derive(Copy, Clone)]
struct SharedOut(*mut f32);
// SAFETY: `par_row_tiles` and `par_row_groups` hand each task a disjoint set of output elements.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper, not its field).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// Runs `tile(r0, rows, out)` in parallel for every tile of `tile_rows` weight rows, where `out`
/// (`n x rows`, token-major) receives `y[t][r0 + i]` at `out[t * rows + i]`; then copies each
/// token's run of `rows` outputs into `y` (`n x total_rows`). Tasks own disjoint row ranges, so
/// each writes contiguous, disjoint runs of `y` with no transposition pass afterwards.
pub(super) fn par_row_tiles(
    total_rows: usize,
    n: usize,
    tile_rows: usize,
    y: &mut [f32],
    tile: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    par_row_groups(total_rows, n, tile_rows, y, |r0, rows, out| {
        OUT_TILE.with_borrow_mut(|buf| {
            buf.resize(tile_rows * n, 0.0);
            let buf = &mut buf[..rows * n];
            tile(r0, rows, buf);
            for t in 0..n {
                out.put_run(t, &buf[t * rows..(t + 1) * rows]);
            }
        });
    });
}

/// The outputs of one task of [`par_row_groups`]: rows `r0..r0 + rows` of every token of `y`.
pub(super) struct RowsOut {
    out: SharedOut,
    total_rows: usize,
    n: usize,
    r0: usize,
    rows: usize,
}

impl RowsOut {
    /// Writes all of this task's rows of token `t` (`vals.len()` must be the task's row count).
    pub(super) fn put_run(&mut self, t: usize, vals: &[f32]) {
        assert!(
            t < self.n && vals.len() == self.rows,
            "RowsOut::put_run outside the task"
        );
        // SAFETY: rows r0..r0 + rows of token t belong to this task alone (checked above), and y
        // holds n * total_rows elements.
        unsafe {
            let dst = self.out.ptr().add(t * self.total_rows + self.r0);
            std::ptr::copy_nonoverlapping(vals.as_ptr(), dst, self.rows);
        }
    }

    /// Writes `vals` to `y[t][r0 + i0 ..]`, clipped to this task's rows.
    #[inline]
    pub(super) fn put<const W: usize>(&mut self, t: usize, i0: usize, vals: &[f32; W]) {
        assert!(
            t < self.n && i0 < self.rows,
            "RowsOut::put outside the task"
        );
        let valid = (self.rows - i0).min(W);
        // SAFETY: the row range r0 + i0 .. r0 + i0 + valid lies inside this task's rows of token
        // t (checked above), which no other task writes, and y holds n * total_rows elements.
        unsafe {
            let dst = self.out.ptr().add(t * self.total_rows + self.r0 + i0);
            if valid == W {
                std::ptr::write_unaligned(dst as *mut [f32; W], *vals);
            } else {
                std::ptr::copy_nonoverlapping(vals.as_ptr(), dst, valid);
            }
        }
    }
}

/// Runs `task(r0, rows, out)` in parallel for every tile of `tile_rows` weight rows, each writing
/// its rows of every token straight into `y` (`n x total_rows`, token-major) through `out`.
pub(super) fn par_row_groups(
    total_rows: usize,
    n: usize,
    tile_rows: usize,
    y: &mut [f32],
    task: impl Fn(usize, usize, &mut RowsOut) + Sync,
) {
    par_row_groups_many([total_rows], n, tile_rows, [y], |_, r0, rows, out| {
        task(r0, rows, out)
    });
}

/// [`par_row_groups`] over several products at once, as one parallel section: `task(m, r0,
/// rows, out)` for every tile of `tile_rows` rows of every output `ys[m]` (`n x rows[m]`,
/// token-major). Small products of one input (a layer's keys and values next to its queries)
/// then share one section's start and end, where each would wait for its own last tile.
pub(super) fn par_row_groups_many<const M: usize>(
    rows: [usize; M],
    n: usize,
    tile_rows: usize,
    ys: [&mut [f32]; M],
    task: impl Fn(usize, usize, usize, &mut RowsOut) + Sync,
) {
    for (y, r) in ys.iter().zip(rows) {
        assert_eq!(y.len(), r * n);
    }
    let tiles: [usize; M] = rows.map(|r| r.div_ceil(tile_rows));
    let outs = ys.map(|y| SharedOut(y.as_mut_ptr()));
    crate::team::for_each(tiles.iter().sum(), |mut c| {
        let mut m = 0;
        while c >= tiles[m] {
            c -= tiles[m];
            m += 1;
        }
        let r0 = c * tile_rows;
        let mut w = RowsOut {
            out: outs[m],
            total_rows: rows[m],
            n,
            r0,
            rows: tile_rows.min(rows[m] - r0),
        };
        task(m, r0, w.rows, &mut w);
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
            WeightMatrix::new(GgmlType::IQ3_S, 1, 256, &[0; 110]).unwrap_err(),
            QuantError::Unsupported(GgmlType::IQ3_S)
        );
    }
}
