//! The operations the tile loop asks of an instruction-set level: a tile's key transpose, its
//! scores, each row's maximum, the exponentials and their sum, and the weighted values. Each
//! level implements them with the same operations in the same order, so every level gives the
//! same bits; the tile loop (`tile_loop::block_body`) is written once over them.
//!
//! So far the portable level ([`Portable`], the scalar twin that the compiler vectorizes) goes
//! through the trait; the AVX2, AVX-512 and VNNI leaves (`kernels_*`) are still called from
//! the tile loop directly (issue 55).

use super::tile_loop;

/// One instruction-set level's tile operations (see the module docs). `R` is the number of
/// query rows computed together, `bc` the tile's width in keys, `hd` the head dimension.
pub(super) trait TileKernel: Copy {
    /// Keys `0..n` of `k` (row-major, `hd` per key) into the transposed tile
    /// (`kt[c * bc + j]`).
    fn transpose_keys(self, k: &[f32], n: usize, hd: usize, kt: &mut [f32], bc: usize);

    /// `s[i][j] = q_i . k_j` for `R` rows (`q` is `R x hd`) and keys `0..jn` of the
    /// transposed tile `kt`, into `s` (`R x bc`); columns past `jn` up to the next multiple
    /// of 8 must be ignored.
    fn scores<const R: usize>(self, q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]);

    /// The largest of `s` (`-inf` for none).
    fn row_max(self, s: &[f32]) -> f32;

    /// `s[j] = exp(s[j] - max)` for every element; returns their sum.
    fn exp_row(self, s: &mut [f32], max: f32) -> f32;

    /// `pv[i] = sum_j p[i][j] * v_j` for `R` rows (`p` is `R x bc`, `v` row-major with `hd`
    /// per key, keys `0..jn`).
    fn weighted_values<const R: usize>(
        self,
        p: &[f32],
        bc: usize,
        v: &[f32],
        hd: usize,
        jn: usize,
        pv: &mut [f32],
    );
}

/// The portable level: plain loops the compiler vectorizes (the scalar twin of the SIMD
/// leaves, whose bits they define).
#[derive(Copy, Clone, Debug)]
pub(super) struct Portable;

impl TileKernel for Portable {
    #[inline(always)]
    fn transpose_keys(self, k: &[f32], n: usize, hd: usize, kt: &mut [f32], bc: usize) {
        for j in 0..n {
            for c in 0..hd {
                kt[c * bc + j] = k[j * hd + c];
            }
        }
    }

    #[inline(always)]
    fn scores<const R: usize>(self, q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
        tile_loop::scores::<R>(q, kt, bc, jn, s)
    }

    #[inline(always)]
    fn row_max(self, s: &[f32]) -> f32 {
        s.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x))
    }

    #[inline(always)]
    fn exp_row(self, s: &mut [f32], max: f32) -> f32 {
        tile_loop::exp_row(s, max)
    }

    #[inline(always)]
    fn weighted_values<const R: usize>(
        self,
        p: &[f32],
        bc: usize,
        v: &[f32],
        hd: usize,
        jn: usize,
        pv: &mut [f32],
    ) {
        tile_loop::weighted_values::<R>(p, bc, v, hd, jn, pv)
    }
}
