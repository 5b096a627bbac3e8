//! Products of many activation rows with packed weights on AMX's int8 tiles (prefill): the
//! packed groups unpacked to integer tiles with their scales, the 8-bit activations re-laid
//! out as tiles ([`kernels::tiles`]), then [`kernels::unit_tiles`]. Every output is the same
//! bits as the VNNI kernel's (the integer unit sums are exact either way and the float steps
//! are the same), so a token's logits do not depend on how many tokens it was computed with.
//!
//! The activations are laid out once per product, before the parallel section (every task reads
//! all of them); each task unpacks its own 32 weight rows (two pairs of packed groups) and runs
//! every token over them, so the weights are unpacked once per product too.

use super::{GROUP, PackedMatrix, par_row_groups};
use crate::cpu;
use crate::quant::GgmlType;
use crate::quant::act::Q8Acts;
use crate::quant::kernels::{
    self,
    tiles::{ActTile, Sums, TILE_ROWS, TileFormat, WeightTile},
};
use crate::quant::unit::{UNIT, int_of, scale_per_half, signed_codes};

/// Activation rows from which a product takes the tiles: below, the VNNI kernels (a token
/// count is padded to a whole tile of 16, and a short product pays for unpacking the weights).
pub const MIN_TOKENS: usize = 16;

/// The same for the formats with a two-token VNNI kernel (`kernels::pairs_available`: Q4_0,
/// Q4_1, Q5_0, Q5_1, Q4_K), which stays faster up to about two tiles' worth of tokens: the
/// tiles cost about as much for 17 to 32 tokens, the pair kernel grows with every token.
pub const MIN_TOKENS_PAIRS: usize = 28;

/// Weight rows per parallel task: two weight tiles, the kernel's block.
const TASK_ROWS: usize = 2 * TILE_ROWS;

thread_local! {
    /// The caller's activation tiles and their block sums (reused across products).
    static ACTS: std::cell::RefCell<(Vec<ActTile>, Vec<Sums>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// A task's weight tiles and offset factors.
    static WEIGHTS: std::cell::RefCell<(Vec<WeightTile>, Vec<Sums>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// How `ty`'s units go through the tiles: every format with a packed layout.
pub fn tile_format(ty: GgmlType) -> Option<TileFormat> {
    super::layout(ty)?;
    Some(TileFormat {
        halves: scale_per_half(ty),
        offsets: !signed_codes(ty),
    })
}

/// The AMX token, where a product of `n` rows of `x` with `w` should take the tiles.
pub fn amx_for(w: &PackedMatrix, n: usize) -> Option<cpu::Amx> {
    let min = if kernels::pairs_available(kernels::detect(), w.ty) {
        MIN_TOKENS_PAIRS
    } else {
        MIN_TOKENS
    };
    (n >= min && tile_format(w.ty).is_some())
        .then(cpu::Amx::get)
        .flatten()
}

/// How [`matmul_tiles`] multiplies the tiles: AMX, or the scalar twin (tests).
#[derive(Copy, Clone, Debug)]
pub enum TileKernel {
    Amx(cpu::Amx),
    #[cfg_attr(not(test), allow(dead_code))]
    Scalar,
}

/// `y[t] = W x[t]` for every row of `x` through the tiles (`y` is `n x rows`, token-major).
pub fn matmul_tiles(kernel: TileKernel, w: &PackedMatrix, x: &Q8Acts, y: &mut [f32]) {
    let (n, k) = (x.n, x.k);
    let f = tile_format(w.ty);
    assert!(
        f.is_some() && k == w.cols && y.len() == n * w.rows,
        "matmul_tiles: a packed matrix of {} columns and {} outputs",
        k,
        n * w.rows
    );
    let f = f.expect("checked above");
    let units = k / UNIT;
    ACTS.with_borrow_mut(|(acts, act_sums)| {
        act_tiles(x, w.ty, acts, act_sums);
        let (acts, act_sums) = (&acts[..], &act_sums[..]);
        par_row_groups(w.rows, n, TASK_ROWS, y, |r0, rows, out| {
            WEIGHTS.with_borrow_mut(|(weights, mins)| {
                weight_tiles(kernel, w, r0, rows, weights, mins);
                let put = |t: usize, i0: usize, v: &[f32; TILE_ROWS]| {
                    if t < n && i0 < rows {
                        out.put(t, i0, v);
                    }
                };
                match kernel {
                    TileKernel::Amx(t) => {
                        kernels::unit_tiles(t, f, acts, act_sums, weights, mins, units, put)
                    }
                    TileKernel::Scalar => kernels::tiles::unit_tiles_scalar(
                        f, acts, act_sums, weights, mins, units, put,
                    ),
                }
            })
        });
    });
}

/// Lays out the rows of `x` as activation tiles: `tiles[i * units + c]` = unit `c` of rows
/// `16 i .. 16 i + 16` (rows past the last zero), one parallel task per 16 rows; and, for a
/// format with offsets, their block sums beside them (`s` per unit, or `s16` per half for the
/// formats with a min per half).
fn act_tiles(x: &Q8Acts, ty: GgmlType, tiles: &mut Vec<ActTile>, sums: &mut Vec<Sums>) {
    let units = x.k / UNIT;
    let blocks = x.n.div_ceil(TILE_ROWS);
    let offsets = !signed_codes(ty);
    let per_half = crate::quant::unit::min_per_half(ty);
    tiles.resize(blocks * units, ActTile::ZERO);
    sums.resize(
        if offsets { blocks * units } else { 0 },
        [[0.0; TILE_ROWS]; 2],
    );
    let shared = SharedTiles(tiles.as_mut_ptr(), sums.as_mut_ptr());
    crate::team::for_each(blocks, |i| {
        // SAFETY: task i alone writes tiles (and sums) i * units .. (i + 1) * units, which
        // `tiles` (and, with offsets, `sums`) hold (resized above), and nothing reads them
        // before the section ends.
        let block = unsafe { std::slice::from_raw_parts_mut(shared.tile(i * units), units) };
        let block_sums: &mut [Sums] = if offsets {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts_mut(shared.sums(i * units), units) }
        } else {
            &mut []
        };
        for tt in 0..TILE_ROWS {
            let t = TILE_ROWS * i + tt;
            if t >= x.n {
                for tile in block.iter_mut() {
                    tile.codes[UNIT * tt..UNIT * (tt + 1)].fill(0);
                    tile.d[tt] = 0.0;
                }
                for s in block_sums.iter_mut() {
                    s[0][tt] = 0.0;
                    s[1][tt] = 0.0;
                }
                continue;
            }
            let row = x.row(t);
            let units_in = row.qs.chunks_exact(UNIT).zip(row.d);
            for (tile, (q, &d)) in block.iter_mut().zip(units_in) {
                let dst: &mut [i8; UNIT] = (&mut tile.codes[UNIT * tt..UNIT * (tt + 1)])
                    .try_into()
                    .expect("a unit");
                *dst = q.try_into().expect("a unit");
                tile.d[tt] = d;
            }
            for (c, s) in block_sums.iter_mut().enumerate() {
                if per_half {
                    s[0][tt] = row.s16[2 * c];
                    s[1][tt] = row.s16[2 * c + 1];
                } else {
                    s[0][tt] = row.s[c];
                }
            }
        }
    });
}

/// The activation tiles and their sums, written by disjoint parallel tasks.
#[derive(Copy, Clone)]
struct SharedTiles(*mut ActTile, *mut Sums);
// SAFETY: `act_tiles`' tasks write disjoint tiles.
unsafe impl Send for SharedTiles {}
// SAFETY: as above.
unsafe impl Sync for SharedTiles {}

impl SharedTiles {
    /// Tile `i` (methods, so closures capture the whole `Sync` wrapper).
    fn tile(self, i: usize) -> *mut ActTile {
        self.0.wrapping_add(i)
    }

    /// Sums `i`.
    fn sums(self, i: usize) -> *mut Sums {
        self.1.wrapping_add(i)
    }
}

/// Unpacks rows `r0..r0 + rows` of `w` (`r0` a multiple of 16) into weight tiles and offset
/// factors: `tiles[j * units + c]` = unit `c` of rows `r0 + 16 j ..`, from packed groups `2j`
/// and `2j + 1` of the task (a group past the task's rows zero). The vector unpacking where the
/// CPU has it (always with AMX), else (and for the scalar twin) [`weight_block_scalar`]: the
/// same bytes.
fn weight_tiles(
    kernel: TileKernel,
    w: &PackedMatrix,
    r0: usize,
    rows: usize,
    tiles: &mut Vec<WeightTile>,
    mins: &mut Vec<Sums>,
) {
    let units = w.cols / UNIT;
    debug_assert!(r0.is_multiple_of(TILE_ROWS));
    let blocks = rows.div_ceil(TILE_ROWS);
    tiles.resize(blocks * units, WeightTile::ZERO);
    mins.resize(blocks * units, [[0.0; TILE_ROWS]; 2]);
    for (j, (tb, mb)) in tiles
        .chunks_exact_mut(units)
        .zip(mins.chunks_exact_mut(units))
        .enumerate()
    {
        let groups: [Option<&[u8]>; 2] = std::array::from_fn(|h| {
            (TILE_ROWS * j + GROUP * h < rows).then(|| w.group(r0 / GROUP + 2 * j + h))
        });
        let packed = match kernel {
            TileKernel::Amx(_) => kernels::pack_weight_tiles(w.ty, groups, tb, mb),
            TileKernel::Scalar => None,
        };
        if packed.is_none() {
            weight_block_scalar(w.ty, groups, tb, mb);
        }
    }
}

/// Scalar twin of [`kernels::pack_weight_tiles`]: each unit read back from the packed layout
/// (`packed_unit`), its codes as the integers the VNNI kernel multiplies (unsigned codes for
/// the formats with offsets, where Q4_0's and Q5_0's centring goes into the offset), its
/// scales, and its offset factor as `+mn * s` (Q4_0's `-8d`, Q5_0's `-16d`, the negated min of
/// the K-quants, Q4_1's and Q5_1's min).
fn weight_block_scalar(
    ty: GgmlType,
    groups: [Option<&[u8]>; 2],
    tiles: &mut [WeightTile],
    mins: &mut [Sums],
) {
    let l = super::layout(ty).expect("packed type");
    let (col, upc) = (l.column_bytes(), l.units());
    for (h, group) in groups.into_iter().enumerate() {
        for (b, (tile, m)) in tiles.iter_mut().zip(mins.iter_mut()).enumerate() {
            let (c, u) = (b / upc, b % upc);
            for r in 0..GROUP {
                let n = GROUP * h + r;
                let Some(group) = group else {
                    for e in 0..UNIT {
                        tile.codes[64 * (e / 4) + 4 * n + e % 4] = 0;
                    }
                    for (sc, mn) in tile.sc.iter_mut().zip(m.iter_mut()) {
                        (sc[n], mn[n]) = (0.0, 0.0);
                    }
                    continue;
                };
                let pu = super::packed_unit(ty, &group[c * col..(c + 1) * col], r, u);
                for (e, &code) in pu.codes.iter().enumerate() {
                    let v = match ty {
                        GgmlType::Q4_0 | GgmlType::Q5_0 => i32::from(code),
                        _ => int_of(ty, code),
                    };
                    tile.codes[64 * (e / 4) + 4 * n + e % 4] = v as i8;
                }
                for (k, (sc, mn)) in tile.sc.iter_mut().zip(m.iter_mut()).enumerate() {
                    sc[n] = pu.scale[k];
                    mn[n] = match ty {
                        GgmlType::Q4_0 => pu.scale[k] * -8.0,
                        GgmlType::Q5_0 => pu.scale[k] * -16.0,
                        _ => pu.min[k],
                    };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::WeightMatrix;
    use crate::quant::kernels::tests::random_blocks;
    use crate::quant::kernels::{Isa, scalar};
    use crate::quant::unit::FORMATS;

    /// Activations of varied block magnitudes (some blocks all zero, some at the extremes).
    fn random_acts(n: usize, k: usize, seed: u64) -> Q8Acts {
        let mut s = seed | 1;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let x: Vec<f32> = (0..n * k)
            .map(|i| match (i / 32) % 7 {
                0 => 0.0,
                1 => 1e-3 * rnd(),
                2 => {
                    if i % 2 == 0 {
                        -1.0
                    } else {
                        1.0
                    }
                }
                b => rnd() * (b * b) as f32,
            })
            .collect();
        let mut q = Q8Acts::default();
        q.quantize(&x, k);
        q
    }

    fn bits(y: &[f32]) -> Vec<u32> {
        y.iter().map(|v| v.to_bits()).collect()
    }

    /// A random packed matrix of `ty` (every code, scale and min the format can hold).
    fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        random_blocks(ty, rows * cols / ty.block_size(), seed)
    }

    /// Shapes around whole tiles and pairs of tiles: token counts of 16 and more, row counts
    /// that leave a task with one weight tile or half of one; the columns whole super-blocks.
    const SHAPES: [(usize, usize, usize); 6] = [
        (8, 256, 16),
        (13, 512, 17),
        (40, 256, 35),
        (72, 512, 50),
        (33, 768, 31),
        (24, 1024, 16),
    ];

    /// For every format, the tiles give every output the VNNI kernel's bits, through AMX and
    /// through the scalar twin, and the scalar twin stays within the f32 reordering bound of the
    /// reference kernel.
    #[test]
    fn tiles_give_the_vnni_bits() {
        let amx = cpu::token_for_test::<cpu::Amx>("tiles_give_the_vnni_bits");
        let vnni = cpu::Avx512Vnni::get().map(Isa::Avx512Vnni);
        for (fi, ty) in FORMATS.into_iter().enumerate() {
            for (si, &(rows, cols, n)) in SHAPES.iter().enumerate() {
                let seed = (100 * fi + si) as u64;
                let data = random_matrix(ty, rows, cols, 11 + seed);
                let wm = WeightMatrix::new(ty, rows, cols, &data).unwrap();
                let p = PackedMatrix::pack(&wm).unwrap();
                let x = random_acts(n, cols, 5 + seed);
                let mut scalar_y = vec![0f32; n * rows];
                matmul_tiles(TileKernel::Scalar, &p, &x, &mut scalar_y);
                // The reference kernel, up to its f32 summation order: each partial sum can
                // carry a relative error of about cols * eps of the sum of absolute products.
                let deq: Vec<Vec<f32>> = (0..rows)
                    .map(|r| crate::quant::dequantize_to_vec(ty, wm.row(r), cols).unwrap())
                    .collect();
                for t in 0..n {
                    let xt = x.row(t);
                    for r in 0..rows {
                        let want = scalar::dot_q8(ty, wm.row(r), xt);
                        let got = scalar_y[t * rows + r];
                        let abs: f32 = (0..cols)
                            .map(|e| (deq[r][e] * f32::from(xt.qs[e]) * xt.d[e / 32]).abs())
                            .sum();
                        let tol = cols as f32 * f32::EPSILON * abs + 1e-6;
                        assert!(
                            (got - want).abs() <= tol,
                            "{ty} {rows}x{cols} n{n} t{t} r{r}: {got} vs {want}"
                        );
                    }
                }
                if let Some(isa) = vnni {
                    let mut y = vec![0f32; n * rows];
                    super::super::matmul_by_groups(isa, &p, &x, &mut y);
                    assert_eq!(
                        bits(&scalar_y),
                        bits(&y),
                        "scalar twin vs VNNI {ty} {rows}x{cols} n{n}"
                    );
                }
                if let Some(t) = amx {
                    let mut y = vec![0f32; n * rows];
                    matmul_tiles(TileKernel::Amx(t), &p, &x, &mut y);
                    assert_eq!(
                        bits(&scalar_y),
                        bits(&y),
                        "AMX vs scalar twin {ty} {rows}x{cols} n{n}"
                    );
                    // And through the dispatch every product takes.
                    let mut y2 = vec![0f32; n * rows];
                    super::super::matmul_packed(&p, &x, &mut y2);
                    assert_eq!(bits(&y), bits(&y2), "dispatch {ty} {rows}x{cols} n{n}");
                }
            }
        }
    }

    /// The vector unpacking writes the scalar layout's bytes for every format, with and without
    /// the second group of a row block.
    #[test]
    fn vector_unpacking_gives_the_scalar_tiles() {
        for (fi, ty) in FORMATS.into_iter().enumerate() {
            let (rows, cols) = (16, 512);
            let data = random_matrix(ty, rows, cols, 31 + fi as u64);
            let wm = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            let p = PackedMatrix::pack(&wm).unwrap();
            let units = cols / UNIT;
            for second in [true, false] {
                let groups = [Some(p.group(0)), second.then(|| p.group(1))];
                let mut want = (vec![WeightTile::ZERO; units], vec![[[7.0; 16]; 2]; units]);
                weight_block_scalar(ty, groups, &mut want.0, &mut want.1);
                let mut got = (vec![WeightTile::ZERO; units], vec![[[9.0; 16]; 2]; units]);
                if kernels::pack_weight_tiles(ty, groups, &mut got.0, &mut got.1).is_none() {
                    eprintln!("skipped: no vector unpacking on this CPU");
                    return;
                }
                for u in 0..units {
                    let (w, g) = (&want.0[u], &got.0[u]);
                    assert_eq!(w.codes, g.codes, "{ty} unit {u} codes");
                    let fb = |s: &[[f32; 16]; 2]| s.map(|h| h.map(f32::to_bits));
                    assert_eq!(fb(&w.sc), fb(&g.sc), "{ty} unit {u} scales");
                    assert_eq!(fb(&want.1[u]), fb(&got.1[u]), "{ty} unit {u} offsets");
                }
            }
        }
    }
}
