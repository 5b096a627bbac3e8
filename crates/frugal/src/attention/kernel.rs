//! The operations the tile loop asks of an instruction-set level: a tile's key transpose, its
//! scores (against f32 keys or, over a Q8_0 key cache, in integers), each row's maximum, the
//! exponentials and their sum, and the weighted values. The tile loop (`tile_loop`) is written
//! once over [`TileKernel`]; each level implements it:
//!
//! - [`Portable`]: plain loops the compiler vectorizes, the scalar twin whose arithmetic the
//!   SIMD leaves repeat (here and in `q8_keys`);
//! - [`Avx2`] (`kernels_avx2`, `kernels_q8_avx2`), [`Avx512`] (`kernels_avx512`) and
//!   [`Avx512Vnni`] (`kernels_vnni`): the capability tokens themselves, each level taking the
//!   operations it has no faster form of from the level below.
//!
//! Each score, maximum and weighted value is the same chain of operations in the same order at
//! every level. The sums of exponentials are the one difference: the SIMD levels keep eight
//! partial sums, the portable one a single chain (a few ulps apart).
//!
//! Keys kept by column (a paged pool's f32, f16 and bf16 key blocks) are read by [`Columns`],
//! which only the SIMD levels have.

use super::ahead::Ahead;
use super::q8_keys::{self, KeyRows, QuantQueries};
use crate::cpu::Avx512;
use crate::kv::KvType;

#[cfg(target_arch = "x86_64")]
pub(super) use super::kernels_columns::Columns;

/// Rows of values of one type: row `j` is `hd` values of `ty` at byte `j * stride` of `bytes`
/// (a decoded f32 tile, or the cache read in place).
#[derive(Copy, Clone)]
pub(super) struct Rows<'a> {
    pub(super) bytes: &'a [u8],
    pub(super) stride: usize,
    pub(super) ty: KvType,
}

impl<'a> Rows<'a> {
    /// Rows of an f32 tile (`hd` values per row, back to back).
    pub(super) fn f32(tile: &'a [f32], hd: usize) -> Self {
        Rows {
            // SAFETY: any initialized f32 is 4 initialized bytes, u8 has alignment 1, and the
            // length is the same memory measured in bytes.
            bytes: unsafe {
                std::slice::from_raw_parts(tile.as_ptr().cast::<u8>(), std::mem::size_of_val(tile))
            },
            stride: 4 * hd,
            ty: KvType::F32,
        }
    }

    /// Rows `0..n` as one f32 slice, where they are an f32 tile back to back (`None` for any
    /// other rows).
    fn as_f32(&self, n: usize, hd: usize) -> Option<&'a [f32]> {
        if self.ty != KvType::F32 || self.stride != 4 * hd {
            return None;
        }
        // SAFETY: f32 has no invalid bit patterns; `align_to` only hands out aligned floats.
        let (head, floats, _) = unsafe { self.bytes.align_to::<f32>() };
        (head.is_empty() && floats.len() >= n * hd).then(|| &floats[..n * hd])
    }

    /// Rows `0..n` decoded into f32, back to back (the scalar reading of any format).
    fn decode(&self, n: usize, hd: usize) -> Vec<f32> {
        let mut out = vec![0.0; n * hd];
        let hb = self.ty.bytes(hd);
        for (j, row) in out.chunks_exact_mut(hd).enumerate() {
            self.ty
                .decode_scalar(&self.bytes[j * self.stride..][..hb], row);
        }
        out
    }
}

/// One instruction-set level's tile operations (see the module docs). `R` is the number of
/// query rows computed together, `bc` the tile's width in keys, `hd` the head dimension.
///
/// Every operation defaults to the level below's: a level implements only what it has a
/// faster form of. [`Portable`], the bottom, implements every one.
pub(super) trait TileKernel: Copy {
    /// The level below, whose operations this one takes where it has none of its own.
    type Below: TileKernel;

    fn below(self) -> Self::Below;

    /// Whether keys of type `ty` are transposed (or, kept by column, scored) where they lie in
    /// the cache rather than decoded into an f32 tile first. The values are the same either way.
    #[inline(always)]
    fn keys_in_place(self, ty: KvType) -> bool {
        self.below().keys_in_place(ty)
    }

    /// Whether values (of any type) are weighted where they lie in the cache rather than
    /// decoded into an f32 tile first. The bits are the same either way.
    #[inline(always)]
    fn values_in_place(self) -> bool {
        self.below().values_in_place()
    }

    /// The kernels for keys kept by column, where this level has them.
    #[inline(always)]
    fn columns(self) -> Option<Columns> {
        self.below().columns()
    }

    /// The AVX-512 token, for decode's fused pass (`decode_fused`), where this level has it.
    #[inline(always)]
    fn wide(self) -> Option<Avx512> {
        self.below().wide()
    }

    /// Rows `0..n` of `k` into columns `at..at + n` of the transposed tile
    /// (`kt[c * bc + at + j] = k_j[c]`).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn transpose_keys(
        self,
        k: Rows,
        n: usize,
        hd: usize,
        kt: &mut [f32],
        bc: usize,
        at: usize,
        ahead: &mut Ahead,
    ) {
        self.below().transpose_keys(k, n, hd, kt, bc, at, ahead)
    }

    /// `s[i][j] = q_i . k_j` for `R` rows (`q` is `R x hd`) and keys `0..jn` of the
    /// transposed tile `kt`, into `s` (`R x bc`); columns past `jn` up to the next multiple
    /// of 8 must be ignored.
    #[inline(always)]
    fn scores<const R: usize>(self, q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
        self.below().scores::<R>(q, kt, bc, jn, s)
    }

    /// [`TileKernel::scores`] over a Q8_0 key cache, in integers: rows `row0..row0 + R` of the
    /// quantized queries `qq` against keys `0..jn` of `keys` (see `q8_keys`).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn scores_q8<const R: usize>(
        self,
        qq: &QuantQueries,
        row0: usize,
        hd: usize,
        keys: &KeyRows,
        jn: usize,
        bc: usize,
        s: &mut [f32],
        ahead: &mut Ahead,
    ) {
        self.below()
            .scores_q8::<R>(qq, row0, hd, keys, jn, bc, s, ahead)
    }

    /// The largest of `s` (`-inf` for none).
    #[inline(always)]
    fn row_max(self, s: &[f32]) -> f32 {
        self.below().row_max(s)
    }

    /// `s[j] = exp(s[j] - max)` for every element; returns their sum.
    #[inline(always)]
    fn exp_row(self, s: &mut [f32], max: f32) -> f32 {
        self.below().exp_row(s, max)
    }

    /// [`TileKernel::exp_row`] of `R` rows at once: row `i` is `s[i * stride + lo..i * stride
    /// + hi]`, less `max[i]`; the same bits as row by row.
    #[inline(always)]
    fn exp_rows<const R: usize>(
        self,
        s: &mut [f32],
        stride: usize,
        lo: usize,
        hi: usize,
        max: [f32; R],
    ) -> [f32; R] {
        self.below().exp_rows::<R>(s, stride, lo, hi, max)
    }

    /// `exp_approx` of each of `x` (at most eight): the same bits.
    #[inline(always)]
    fn exp_lanes<const N: usize>(self, x: [f32; N]) -> [f32; N] {
        self.below().exp_lanes(x)
    }

    /// `pv[i] (+)= sum_j p[i][j] * v_j` for `R` rows (`p` is `R x bc`) and keys `0..jn` of
    /// `v`; with `accumulate` the sums continue from `pv`, so a tile taken in several runs
    /// gives the bits of one.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn weighted_values<const R: usize>(
        self,
        p: &[f32],
        bc: usize,
        v: Rows,
        hd: usize,
        jn: usize,
        pv: &mut [f32],
        accumulate: bool,
        ahead: &mut Ahead,
    ) {
        self.below()
            .weighted_values::<R>(p, bc, v, hd, jn, pv, accumulate, ahead)
    }
}

/// The portable level: plain loops the compiler vectorizes (the scalar twin of the SIMD
/// leaves, whose bits they define).
#[derive(Copy, Clone, Debug)]
pub(super) struct Portable;

/// The bottom level: every operation its own (a default would call itself).
impl TileKernel for Portable {
    type Below = Portable;

    fn below(self) -> Portable {
        self
    }

    fn keys_in_place(self, _: KvType) -> bool {
        false
    }

    fn values_in_place(self) -> bool {
        false
    }

    fn columns(self) -> Option<Columns> {
        None
    }

    fn wide(self) -> Option<Avx512> {
        None
    }

    #[inline(always)]
    fn transpose_keys(
        self,
        k: Rows,
        n: usize,
        hd: usize,
        kt: &mut [f32],
        bc: usize,
        at: usize,
        _: &mut Ahead,
    ) {
        let decoded;
        let k = match k.as_f32(n, hd) {
            Some(k) => k,
            None => {
                decoded = k.decode(n, hd);
                &decoded
            }
        };
        for j in 0..n {
            for c in 0..hd {
                kt[c * bc + at + j] = k[j * hd + c];
            }
        }
    }

    #[inline(always)]
    fn scores<const R: usize>(self, q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
        scores::<R>(q, kt, bc, jn, s)
    }

    #[inline(always)]
    fn scores_q8<const R: usize>(
        self,
        qq: &QuantQueries,
        row0: usize,
        hd: usize,
        keys: &KeyRows,
        jn: usize,
        bc: usize,
        s: &mut [f32],
        _: &mut Ahead,
    ) {
        q8_keys::scores::<R>(qq, row0, hd, keys, jn, bc, s)
    }

    #[inline(always)]
    fn row_max(self, s: &[f32]) -> f32 {
        s.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x))
    }

    #[inline(always)]
    fn exp_row(self, s: &mut [f32], max: f32) -> f32 {
        exp_row(s, max)
    }

    #[inline(always)]
    fn exp_rows<const R: usize>(
        self,
        s: &mut [f32],
        stride: usize,
        lo: usize,
        hi: usize,
        max: [f32; R],
    ) -> [f32; R] {
        std::array::from_fn(|i| exp_row(&mut s[i * stride + lo..i * stride + hi], max[i]))
    }

    #[inline(always)]
    fn exp_lanes<const N: usize>(self, x: [f32; N]) -> [f32; N] {
        x.map(exp_approx)
    }

    #[inline(always)]
    fn weighted_values<const R: usize>(
        self,
        p: &[f32],
        bc: usize,
        v: Rows,
        hd: usize,
        jn: usize,
        pv: &mut [f32],
        accumulate: bool,
        _: &mut Ahead,
    ) {
        match v.as_f32(jn, hd) {
            Some(v) => weighted_values::<R>(p, bc, v, hd, jn, pv, accumulate),
            None => weighted_values::<R>(p, bc, &v.decode(jn, hd), hd, jn, pv, accumulate),
        }
    }
}

/// `s[j] = exp(s[j] - max)`; returns their sum, one chain in key order (the SIMD levels keep
/// eight partial sums: a few ulps apart).
#[inline(always)]
pub(super) fn exp_row(s: &mut [f32], max: f32) -> f32 {
    let mut sum = 0f32;
    for x in s.iter_mut() {
        *x = exp_approx(*x - max);
        sum += *x;
    }
    sum
}

/// `e^x` for `x <= 0` ([`crate::ops::exp_poly`]; inputs below -87 give e^-87, as a softmax
/// weight next to the row maximum's 1 indistinguishable from 0).
#[inline(always)]
pub(super) fn exp_approx(x: f32) -> f32 {
    crate::ops::exp_poly(x.min(0.0))
}

/// Constants of [`exp_approx`] (shared with its SIMD twins, which must compute the same bits).
#[cfg(target_arch = "x86_64")]
pub(super) use crate::ops::{EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MIN, EXP_POLY, EXP_ROUND};

/// `s[i][j] = q_i . k_j` for `R` query rows (`q` is `R x hd`) and keys `0..jn` of a tile stored
/// transposed (`kt[c * bc + j]`), into `s` (`R x bc`). Eight keys by `R` rows at a time, their
/// sums in registers across the head dimension: each loaded key vector serves `R` rows. Each sum
/// still runs over `c` in order, as the plain loop does. Key columns past `jn` up to the next
/// multiple of 8 are computed on whatever the tile holds there and must be ignored.
#[inline(always)]
pub(super) fn scores<const R: usize>(q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
    const W: usize = 8;
    let hd = q.len() / R;
    let mut j = 0;
    while j < jn {
        if j + W > bc {
            // A tile width that is not a multiple of 8: finish column by column.
            for jj in j..jn {
                for i in 0..R {
                    s[i * bc + jj] = (0..hd)
                        .map(|c| q[i * hd + c] * kt[c * bc + jj])
                        .fold(0.0, |a, b| a + b);
                }
            }
            break;
        }
        let mut a = [[0f32; W]; R];
        for c in 0..hd {
            let k = &kt[c * bc + j..c * bc + j + W];
            for (i, ai) in a.iter_mut().enumerate() {
                let qc = q[i * hd + c];
                for (x, &kv) in ai.iter_mut().zip(k) {
                    *x += qc * kv;
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            s[i * bc + j..i * bc + j + W].copy_from_slice(ai);
        }
        j += W;
    }
}

/// `pv[i] (+)= sum_j p[i][j] * v_j` for `R` rows (`p` is `R x bc`, `v` row-major with `hd` per
/// key, keys `0..jn`). Sixteen output values by `R` rows stay in registers across the keys:
/// each loaded value vector serves `R` rows. Each sum still runs over `j` in order, from 0 or,
/// with `accumulate`, from `pv`.
#[inline(always)]
pub(super) fn weighted_values<const R: usize>(
    p: &[f32],
    bc: usize,
    v: &[f32],
    hd: usize,
    jn: usize,
    pv: &mut [f32],
    accumulate: bool,
) {
    const W: usize = 16;
    let mut d0 = 0;
    while d0 + W <= hd {
        let mut a = [[0f32; W]; R];
        if accumulate {
            for (i, ai) in a.iter_mut().enumerate() {
                ai.copy_from_slice(&pv[i * hd + d0..i * hd + d0 + W]);
            }
        }
        for j in 0..jn {
            let vj = &v[j * hd + d0..j * hd + d0 + W];
            for (i, ai) in a.iter_mut().enumerate() {
                let pj = p[i * bc + j];
                for (x, &vv) in ai.iter_mut().zip(vj) {
                    *x += pj * vv;
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            pv[i * hd + d0..i * hd + d0 + W].copy_from_slice(ai);
        }
        d0 += W;
    }
    if d0 < hd {
        for i in 0..R {
            let out = &mut pv[i * hd + d0..(i + 1) * hd];
            if !accumulate {
                out.fill(0.0);
            }
            for j in 0..jn {
                let pj = p[i * bc + j];
                for (a, &b) in out.iter_mut().zip(&v[j * hd + d0..(j + 1) * hd]) {
                    *a += pj * b;
                }
            }
        }
    }
}

/// Off x86-64 no level reads keys kept by column: the type has no values.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Copy, Clone)]
pub(super) enum Columns {}

#[cfg(not(target_arch = "x86_64"))]
impl Columns {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn widen_keys(
        self,
        _: &crate::kv::KvView,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: &mut [f32],
        _: usize,
        _: &mut Ahead,
    ) {
        match self {}
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn tile_scores<const R: usize>(
        self,
        _: &[f32],
        _: &crate::kv::KvView,
        _: &crate::kv::KvView,
        _: usize,
        _: usize,
        _: usize,
        _: usize,
        _: &mut [f32],
        _: usize,
        _: &mut Ahead,
    ) {
        match self {}
    }
}
