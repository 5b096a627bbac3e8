//! Dot-product kernels per instruction set, behind runtime dispatch.
//!
//! Two kernel shapes cover the forward pass:
//! - [`dot_row`]: one stored (quantized) row against an f32 vector, dequantizing in registers
//!   (the decode matrix-vector product);
//! - [`gemm_f32`]: a dequantized f32 weight tile against a block of f32 activations, register
//!   blocked so each loaded weight vector feeds several tokens (the prefill matrix-matrix product).
//!
//! `scalar` is the reference for both; the SIMD versions must agree with it up to f32 summation
//! order, which the tests below bound.

#[cfg(target_arch = "x86_64")]
mod avx2;
pub mod scalar;
pub mod tiles;
#[cfg(target_arch = "x86_64")]
mod x86_amx;
#[cfg(target_arch = "x86_64")]
mod x86_int8;
#[cfg(target_arch = "x86_64")]
mod x86_pairs;
#[cfg(target_arch = "x86_64")]
mod x86_sparse;

use super::GgmlType;
use super::act::{PairRow, Q8Row, WidePairRow, WideRow};
use super::packed::{self, GROUP};
use super::sparse_matrix::{self, SparseMatrix};
use crate::cpu;

/// The instruction set the kernels run with: a [`cpu`] level with the token that proves it, so
/// a value of `Isa` is itself the proof its kernels may run.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2(cpu::Avx2),
    /// AVX2 plus AVX-512 VNNI (with VL) for the integer dot products.
    Avx512Vnni(cpu::Avx512Vnni),
}

impl Isa {
    /// The kernels' instruction set at a [`cpu::Level`] (VNNI's for `avx512-vnni` and above,
    /// AVX2's for `avx2` and `avx512`), where it runs here.
    pub fn at(level: cpu::Level) -> Isa {
        if let Some(t) = level.avx512_vnni() {
            Isa::Avx512Vnni(t)
        } else if let Some(t) = level.avx2() {
            Isa::Avx2(t)
        } else {
            Isa::Scalar
        }
    }

    /// The AVX2 token every level above `Scalar` holds.
    #[inline]
    pub fn avx2(self) -> Option<cpu::Avx2> {
        match self {
            Isa::Scalar => None,
            Isa::Avx2(t) => Some(t),
            Isa::Avx512Vnni(t) => Some(t.avx2()),
        }
    }
}

/// The best instruction set this CPU supports, capped by `FRUGAL_ISA` (see [`cpu`]; cached).
pub fn detect() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| Isa::at(cpu::level()))
}

/// Whether the AVX-512 VNNI products hint the weights' cache lines ahead of their reads: on
/// Intel's Xeons the hardware prefetchers alone leave a decode step waiting on its weights (the
/// hints gain a third of decode speed there), on AMD's Zen 4 the hints cost 5-20% (see
/// `x86_int8::prefetch_lines`). `FRUGAL_PREFETCH=0` or `1` overrides the vendor's default.
/// The hints change no result, only when the bytes arrive.
pub fn hint_weights() -> bool {
    static HINTS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HINTS.get_or_init(|| match std::env::var("FRUGAL_PREFETCH").as_deref() {
        Ok("0") => false,
        Ok("1") => true,
        _ => cpu::vendor_is_intel(),
    })
}

/// `sum_i w[i] * x[i]` where `w` is one row of `x.len()` elements stored as `ty`.
/// The caller guarantees `ty` is supported and `row` has the right length.
#[inline]
pub fn dot_row(isa: Isa, ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match isa.avx2() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the kernel's features; the caller guarantees the row.
        Some(t) => unsafe { avx2::dot_row(t, ty, row, x) },
        _ => scalar::dot_row(ty, row, x),
    }
}

/// `out[t * rows + r] = dot(w[r], x[t])` for a tile of `rows` f32 weight rows of length `k` and
/// `n` activation rows of length `k` (token-major output).
#[inline]
pub fn gemm_f32(isa: Isa, w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    match isa.avx2() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the kernel's features.
        Some(t) => unsafe { avx2::gemm_f32(t, w, x, k, out) },
        _ => scalar::gemm_f32(w, x, k, out),
    }
}

/// Dot products of one packed group of eight block-quantized rows (see `quant::packed`)
/// with `T` rows of 8-bit activations: `out[t][r] = dot(row r, xs[t])`.
#[inline]
pub fn dot_packed<const T: usize>(
    isa: Isa,
    ty: GgmlType,
    group: &[u8],
    xs: &[Q8Row; T],
    out: &mut [[f32; GROUP]; T],
) {
    let cols = xs[0].qs.len();
    let span = packed::layout(ty).map_or(0, |l| l.span);
    assert!(
        span > 0
            && cols.is_multiple_of(span)
            && xs.iter().all(|x| x.qs.len() == cols
                && x.d.len() == cols / 32
                && x.s.len() == cols / 32
                && x.s16.len() == cols / 16)
            && group.len() >= cols / span * packed::column_bytes(ty),
        "dot_packed: group does not match the activations"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the kernel's features; sizes checked above.
        Isa::Avx2(t) => unsafe { x86_int8::dot_packed_avx2::<T>(t, ty, group, xs, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512Vnni(t) => unsafe { x86_int8::dot_packed_vnni::<T>(t, ty, group, xs, out) },
        _ => {
            for (x, o) in xs.iter().zip(out.iter_mut()) {
                packed::dot_group_scalar(ty, group, *x, o);
            }
        }
    }
}

/// Whether [`dot_sparse`] has a SIMD kernel on `isa` (AVX-512 VBMI2's `vpexpandb` on top of the
/// VNNI level). Without one, compressed 2:4 matrices are expanded to their dense twin at load,
/// which computes the same values at the dense speed.
pub fn sparse_available(isa: Isa) -> bool {
    sparse_token(isa).is_some()
}

/// The token [`dot_sparse`]'s SIMD kernel needs, where `isa` has it.
fn sparse_token(isa: Isa) -> Option<cpu::Vbmi2> {
    match isa {
        Isa::Avx512Vnni(_) if cfg!(target_arch = "x86_64") => cpu::Vbmi2::get(),
        _ => None,
    }
}

/// Dot products of group `g` of a sparse matrix (see `quant::sparse_matrix`) with `T` rows of
/// 8-bit activations: `out[t][r] = dot(row 16g + r, xs[t])`, the same bits at every level.
/// `biased[t]` holds `xs[t]`'s codes plus 128 (`sparse_matrix::BiasedActs`), which the SIMD
/// kernel multiplies.
#[inline]
pub fn dot_sparse<const T: usize>(
    isa: Isa,
    w: &SparseMatrix,
    g: usize,
    xs: &[Q8Row; T],
    biased: &[&[u8]; T],
    out: &mut [[f32; sparse_matrix::ROWS]; T],
) {
    let cols = w.cols;
    assert!(
        xs.iter()
            .zip(biased)
            .all(|(x, b)| x.qs.len() == cols && b.len() == cols && x.d.len() == cols / 32),
        "dot_sparse: the activations do not match the matrix"
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = sparse_token(isa) {
        // SAFETY: the token proves the kernel's features; a SparseMatrix's groups are whole groups of its
        // columns with their column table (built by `SparseMatrix::pack`, never modified), and
        // `group_padded` adds the readable bytes after the group that whole-vector loads need;
        // the activations' lengths were checked above.
        unsafe {
            let d: [&[f32]; T] = std::array::from_fn(|t| xs[t].d);
            return x86_sparse::dot_sparse_vbmi2::<T>(
                t,
                w.values,
                w.group_padded(g),
                w.column_starts(g),
                biased,
                &d,
                out,
            );
        }
    }
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        sparse_matrix::dot_group_scalar(w.values, w.group(g), *x, o);
    }
}

/// Whether [`dot_pairs`] runs for `ty` on `isa` (AVX-512 VNNI, unsigned-code formats).
pub fn pairs_available(isa: Isa, ty: GgmlType) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(isa, Isa::Avx512Vnni(_)) && x86_pairs::pairs_supported(ty)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, ty);
        false
    }
}

/// Dot products of one packed group with `P` interleaved pairs of 8-bit activation rows
/// (`act::PairActs`), two tokens per instruction: `out[p][j][r] = dot(row r, token j of pair
/// p)`, the same bits as [`dot_packed`] gives each token. Only where [`pairs_available`].
#[inline]
pub fn dot_pairs<const P: usize>(
    isa: Isa,
    ty: GgmlType,
    group: &[u8],
    xs: &[PairRow; P],
    out: &mut [[[f32; GROUP]; 2]; P],
    tail: Option<(Q8Row, &mut [f32; GROUP])>,
) {
    let cols = xs[0].qs.len() / 2;
    let span = packed::layout(ty).map_or(0, |l| l.span);
    assert!(
        pairs_available(isa, ty)
            && span > 0
            && cols.is_multiple_of(span)
            && xs.iter().all(|x| {
                x.qs.len() == 2 * cols && x.d.len() == cols / 16 && x.s.len() == cols / 16
            })
            && tail.as_ref().is_none_or(|(x, _)| {
                x.qs.len() == cols && x.d.len() == cols / 32 && x.s.len() == cols / 32
            })
            && group.len() >= cols / span * packed::column_bytes(ty),
        "dot_pairs: group does not match the activations, or no pair kernel for {ty}"
    );
    #[cfg(target_arch = "x86_64")]
    if let Isa::Avx512Vnni(t) = isa {
        // SAFETY: the token proves the kernel's features; sizes checked above.
        unsafe { x86_pairs::dot_pairs_vnni::<P>(t, ty, group, xs, out, tail) }
    }
}

/// [`dot_pairs`] for 15-bit activations against Q8_0 rows (the output head); available where
/// [`pairs_available`] holds for Q8_0's level (AVX-512 VNNI).
#[inline]
pub fn dot_wide_pairs<const P: usize>(
    isa: Isa,
    group: &[u8],
    xs: &[WidePairRow; P],
    out: &mut [[[f32; GROUP]; 2]; P],
    tail: Option<(WideRow, &mut [f32; GROUP])>,
) {
    let cols = xs[0].hi.len() / 2;
    assert!(
        matches!(isa, Isa::Avx512Vnni(_))
            && cols.is_multiple_of(32)
            && xs.iter().all(|x| {
                x.hi.len() == 2 * cols
                    && x.lo.len() == 2 * cols
                    && x.d.len() == cols / 16
                    && x.qsum.len() == cols / 16
            })
            && tail.as_ref().is_none_or(|(x, _)| {
                x.hi.len() == cols
                    && x.lo.len() == cols
                    && x.d.len() == cols / 32
                    && x.qsum.len() == cols / 32
            })
            && group.len() >= cols / 32 * packed::column_bytes(GgmlType::Q8_0),
        "dot_wide_pairs: group does not match the activations, or no AVX-512 VNNI"
    );
    #[cfg(target_arch = "x86_64")]
    if let Isa::Avx512Vnni(t) = isa {
        // SAFETY: the token proves the kernel's features; sizes checked above.
        unsafe { x86_pairs::dot_wide_pairs_vnni::<P>(t, group, xs, out, tail) }
    }
}

/// AMX products of weight tiles with 8-bit activation tiles (see [`tiles`]) for a format that
/// goes through them as `f`: for every activation row `t` of the token blocks of `acts`
/// (`units` tiles each, one per unit, with their block sums `act_sums`) and every row block `j`
/// of `weights` (the same, with their offset factors `mins`), `put(t, 16 j, &out)` with
/// `out[n]` = row `16 j + n` times activation row `t`, the same bits as [`dot_packed`] gives at
/// the VNNI level and [`tiles::unit_tiles_scalar`] everywhere. Blocks of 16 tokens by 16 rows,
/// tokens outer; the tile configuration is loaded for the call and released after it, so a
/// thread holds no tile state between calls. `act_sums` and `mins` are read only where the
/// format has offsets.
#[allow(clippy::too_many_arguments)]
pub fn unit_tiles(
    amx: cpu::Amx,
    f: tiles::TileFormat,
    acts: &[tiles::ActTile],
    act_sums: &[tiles::Sums],
    weights: &[tiles::WeightTile],
    mins: &[tiles::Sums],
    units: usize,
    mut put: impl FnMut(usize, usize, &[f32; tiles::TILE_ROWS]),
) {
    assert!(
        units > 0
            && acts.len().is_multiple_of(units)
            && weights.len().is_multiple_of(units)
            && (!f.offsets || (act_sums.len() == acts.len() && mins.len() == weights.len())),
        "unit_tiles: tiles are not whole blocks of {units} units"
    );
    #[cfg(target_arch = "x86_64")]
    {
        use tiles::TILE_ROWS as R;
        let (ta, tb) = (acts.len() / units, weights.len() / units);
        let mut out: x86_amx::BlockOut = [[0.0; R]; R];
        x86_amx::configure(amx, f);
        for i in 0..ta {
            let blk = i * units..(i + 1) * units;
            let (a, s) = (&acts[blk.clone()], act_sums.get(blk).unwrap_or(&[]));
            for j in 0..tb {
                let blk = j * units..(j + 1) * units;
                let (w, m) = (&weights[blk.clone()], mins.get(blk).unwrap_or(&[]));
                // SAFETY: the token proves AMX (and the AVX-512 every AMX CPU has); the
                // configuration for `f` was loaded above on this thread and is released below,
                // with no other tile code in between; `a` and `w` hold `units` tiles each, and
                // with offsets `s` and `m` too (asserted above).
                unsafe {
                    match (f.halves, f.offsets) {
                        (false, false) => {
                            x86_amx::unit_block::<false, false>(amx, a, s, w, m, units, &mut out)
                        }
                        (false, true) => {
                            x86_amx::unit_block::<false, true>(amx, a, s, w, m, units, &mut out)
                        }
                        (true, false) => {
                            x86_amx::unit_block::<true, false>(amx, a, s, w, m, units, &mut out)
                        }
                        (true, true) => {
                            x86_amx::unit_block::<true, true>(amx, a, s, w, m, units, &mut out)
                        }
                    }
                };
                for (t, o) in out.iter().enumerate() {
                    put(R * i + t, R * j, o);
                }
            }
        }
        x86_amx::release(amx);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = amx;
        tiles::unit_tiles_scalar(f, acts, act_sums, weights, mins, units, put);
    }
}

/// Unpacks one row block of 16 rows of a `ty` matrix (packed groups `groups[0]` and, unless
/// past the matrix's rows, `groups[1]`) into weight tiles and offset factors, one per unit
/// (see [`tiles::WeightTile`]); `None` where this CPU has no vector kernel for it (the caller's
/// scalar layout gives the same bytes).
pub fn pack_weight_tiles(
    ty: GgmlType,
    groups: [Option<&[u8]>; 2],
    tiles: &mut [tiles::WeightTile],
    mins: &mut [tiles::Sums],
) -> Option<()> {
    let l = packed::layout(ty)?;
    let units = tiles.len();
    assert!(
        mins.len() == units
            && units.is_multiple_of(l.units())
            && groups
                .iter()
                .flatten()
                .all(|g| g.len() >= units / l.units() * l.column_bytes()),
        "pack_weight_tiles: the groups do not hold {units} units"
    );
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = detect().avx2() {
        // SAFETY: the token proves the kernel's features; the sizes are checked above.
        unsafe { x86_amx::pack_weight_block(t, ty, groups, tiles, mins) };
        return Some(());
    }
    None
}

/// Dot products of one packed group of eight Q8_0 rows with `T` rows of 15-bit activations
/// (`act::WideActs`): `out[t][r] = dot(row r, xs[t])`.
#[inline]
pub fn dot_packed_wide<const T: usize>(
    isa: Isa,
    group: &[u8],
    xs: &[WideRow; T],
    out: &mut [[f32; GROUP]; T],
) {
    let cols = xs[0].hi.len();
    assert!(
        cols.is_multiple_of(32)
            && xs.iter().all(|x| x.hi.len() == cols
                && x.lo.len() == cols
                && x.words.len() == cols
                && x.d.len() == cols / 32
                && x.qsum.len() == cols / 32)
            && group.len() >= cols / 32 * packed::column_bytes(GgmlType::Q8_0),
        "dot_packed_wide: group does not match the activations"
    );
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the token proves the kernel's features; sizes checked above.
        Isa::Avx2(t) => unsafe { x86_int8::dot_wide_avx2::<T>(t, group, xs, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512Vnni(t) => unsafe { x86_int8::dot_wide_vnni::<T>(t, group, xs, out) },
        _ => {
            for (x, o) in xs.iter().zip(out.iter_mut()) {
                packed::dot_group_wide_scalar(group, *x, o);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::dequantize_to_vec;
    use proptest::prelude::*;

    fn encode(ty: GgmlType, w: &[f32]) -> Vec<u8> {
        crate::quant::quantize(ty, w).expect("a format with a reference encoder")
    }

    /// Every kernel level this CPU can run (the CPU levels that differ in their kernels).
    fn levels() -> Vec<Isa> {
        let mut v: Vec<Isa> = cpu::levels_for_tests().into_iter().map(Isa::at).collect();
        v.dedup();
        v
    }

    /// Bound for two f32 sums of the same `k` products in different orders: each partial sum can
    /// carry a relative error of about k * eps of the sum of absolute values.
    fn tol(k: usize, abs_sum: f32) -> f32 {
        (k as f32) * f32::EPSILON * abs_sum + 1e-6
    }

    /// `n` blocks of `ty` of random bytes, every code pattern possible, with finite f16 scales
    /// of both signs (MXFP4: exponents near 1).
    pub(crate) fn random_blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let bb = ty.block_bytes();
        let mut out: Vec<u8> = (0..n * bb).map(|_| next() as u8).collect();
        for b in out.chunks_exact_mut(bb) {
            if ty == GgmlType::MXFP4 {
                b[0] = 120 + (next() % 16) as u8;
                continue;
            }
            for &o in crate::quant::f16_scale_offsets(ty) {
                let v = (next() % 2000) as f32 / 1000.0 - 1.0;
                b[o..o + 2].copy_from_slice(&crate::quant::f32_to_f16(v * 0.05).to_le_bytes());
            }
        }
        out
    }

    /// Every packed kernel against the scalar reference on random blocks (every code, scale
    /// and min a format can hold, which the encoders may never write, such as IQ4's -127
    /// everywhere) and activations at the extremes of their range (whole blocks of ±127, where
    /// a saturating or wrongly signed byte product would show): the integer sums are exact at
    /// every level, and only the f32 accumulation of the scaled sums differs in order, bounded
    /// by `tol` as above.
    #[test]
    fn int8_kernels_match_scalar_on_random_blocks() {
        let k = 512;
        for (i, ty) in crate::quant::unit::FORMATS.into_iter().enumerate() {
            let data = random_blocks(ty, GROUP * k / ty.block_size(), 7 + i as u64);
            let wm = crate::quant::WeightMatrix::new(ty, GROUP, k, &data).unwrap();
            let p = crate::quant::packed::PackedMatrix::pack(&wm).unwrap();
            // Block b: all +1, all -1, alternating, or a ramp (the ends quantize to ±127).
            let x: Vec<f32> = (0..k)
                .map(|e| match (e / 32) % 4 {
                    0 => 1.0,
                    1 => -1.0,
                    2 => {
                        if e % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        }
                    }
                    _ => (e % 32) as f32 / 15.5 - 1.0,
                })
                .collect();
            let mut acts = crate::quant::act::Q8Acts::default();
            acts.quantize(&x, k);
            for isa in levels() {
                let mut out = [[0f32; GROUP]; 2];
                dot_packed(isa, ty, p.group(0), &[acts.row(0); 2], &mut out);
                for r in 0..GROUP {
                    let reference = scalar::dot_q8(ty, wm.row(r), acts.row(0));
                    let deq = dequantize_to_vec(ty, wm.row(r), k).unwrap();
                    let abs_sum: f32 = deq.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                    for o in &out {
                        assert!(
                            (reference - o[r]).abs() <= tol(k, abs_sum),
                            "{ty} {isa:?} row {r}: {reference} vs {}",
                            o[r]
                        );
                    }
                }
            }
        }
    }

    proptest! {
        #[test]
        fn simd_dot_matches_scalar(
            ty_i in 0usize..crate::quant::SUPPORTED.len() - 2,
            blocks in 1usize..12,
            extra in 0usize..32,
            seed in any::<u64>(),
        ) {
            let ty = crate::quant::SUPPORTED[ty_i];
            // (The last two, the compressed 2:4 types, take sparse input: tested on their own.)
            prop_assume!(!crate::quant::sparse::is_sparse(ty));
            // Float rows may have any length; block formats need whole blocks.
            let k = if ty.block_size() == 1 { blocks * 32 + extra } else { blocks.div_ceil(ty.block_size() / 32) * ty.block_size() };
            let mut s = seed | 1;
            let mut rnd = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5 };
            let w: Vec<f32> = (0..k).map(|_| rnd() * 4.0).collect();
            let x: Vec<f32> = (0..k).map(|_| rnd()).collect();
            let row = encode(ty, &w);
            let deq = dequantize_to_vec(ty, &row, k).unwrap();
            let abs_sum: f32 = deq.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let reference = scalar::dot_row(ty, &row, &x);
            let fast = dot_row(detect(), ty, &row, &x);
            prop_assert!((reference - fast).abs() <= tol(k, abs_sum), "{ty} k={k}: {reference} vs {fast}");
        }

        #[test]
        fn int8_dot_matches_scalar_at_every_level(ty_i in 0usize..crate::quant::unit::FORMATS.len(), blocks in 1usize..40, seed in any::<u64>()) {
            let ty = crate::quant::unit::FORMATS[ty_i];
            // Whole blocks of the format: 32 elements, or 256 for the K-quants.
            let k = if ty.block_size() == 256 { blocks.div_ceil(4) * 256 } else { blocks * 32 };
            let mut s = seed | 1;
            let mut rnd = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5 };
            let w: Vec<f32> = (0..k).map(|_| rnd() * 3.0).collect();
            let x: Vec<f32> = (0..k).map(|_| rnd() * 10.0).collect();
            let row = encode(ty, &w);
            let mut acts = crate::quant::act::Q8Acts::default();
            acts.quantize(&x, k);
            let reference = scalar::dot_q8(ty, &row, acts.row(0));
            // The integer block sums are exact everywhere; only the f32 accumulation of the
            // scaled block sums differs in order.
            let deq = dequantize_to_vec(ty, &row, k).unwrap();
            let abs_sum: f32 = deq.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            // Eight copies of the row, packed as one group, at every level, for 1 and 3 tokens.
            let eight: Vec<f32> = (0..GROUP).flat_map(|_| w.iter().copied()).collect();
            let data = encode(ty, &eight);
            let wm = crate::quant::WeightMatrix::new(ty, GROUP, k, &data).unwrap();
            let p = crate::quant::packed::PackedMatrix::pack(&wm).unwrap();
            for isa in levels() {
                let mut out = [[0f32; GROUP]; 1];
                dot_packed(isa, ty, p.group(0), &[acts.row(0)], &mut out);
                let mut out3 = [[0f32; GROUP]; 3];
                dot_packed(isa, ty, p.group(0), &[acts.row(0); 3], &mut out3);
                for o in out.iter().chain(&out3).flatten() {
                    prop_assert!((reference - o).abs() <= tol(k, abs_sum), "{ty} {isa:?} k={k}: {reference} vs {o}");
                }
            }
            // And 8-bit activations stay close to the exact f32 product: each activation moves by
            // at most half a step (absmax/254) of its block.
            let exact: f32 = deq.iter().zip(&x).map(|(a, b)| a * b).sum();
            let bound: f32 = deq.chunks(32).zip(x.chunks(32)).map(|(wb, xb)| {
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                wb.iter().map(|v| v.abs()).sum::<f32>() * amax / 254.0
            }).sum();
            prop_assert!((reference - exact).abs() <= bound * 1.01 + 1e-4, "{reference} vs exact {exact}");
        }

        #[test]
        fn wide_dot_matches_scalar_at_every_level(blocks in 1usize..40, seed in any::<u64>()) {
            let k = blocks * 32;
            let mut s = seed | 1;
            let mut rnd = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5 };
            let w: Vec<f32> = (0..GROUP * k).map(|_| rnd() * 3.0).collect();
            let x: Vec<f32> = (0..k).map(|_| rnd() * 10.0).collect();
            let data = encode(GgmlType::Q8_0, &w);
            let wm = crate::quant::WeightMatrix::new(GgmlType::Q8_0, GROUP, k, &data).unwrap();
            let p = crate::quant::packed::PackedMatrix::pack(&wm).unwrap();
            let mut acts = crate::quant::act::WideActs::default();
            acts.quantize(&x, k);
            for isa in levels() {
                let mut out3 = [[0f32; GROUP]; 3];
                dot_packed_wide(isa, p.group(0), &[acts.row(0); 3], &mut out3);
                for (r, &o) in out3[2].iter().enumerate() {
                    let reference = scalar::dot_wide_q8_0(wm.row(r), acts.row(0));
                    let deq = dequantize_to_vec(GgmlType::Q8_0, wm.row(r), k).unwrap();
                    let abs_sum: f32 = deq.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                    prop_assert!((reference - o).abs() <= tol(k, abs_sum), "{isa:?} k={k} r{r}: {reference} vs {o}");
                }
            }
        }

        #[test]
        fn simd_gemm_matches_scalar(rows in 1usize..7, n in 1usize..11, k in 1usize..100, seed in any::<u64>()) {
            let mut s = seed | 1;
            let mut rnd = || { s ^= s << 13; s ^= s >> 7; s ^= s << 17; (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5 };
            let w: Vec<f32> = (0..rows * k).map(|_| rnd()).collect();
            let x: Vec<f32> = (0..n * k).map(|_| rnd()).collect();
            let mut a = vec![0f32; rows * n];
            let mut b = vec![0f32; rows * n];
            scalar::gemm_f32(&w, &x, k, &mut a);
            gemm_f32(detect(), &w, &x, k, &mut b);
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                prop_assert!((p - q).abs() <= tol(k, k as f32 * 0.25), "entry {i}: {p} vs {q}");
            }
        }
    }
}
