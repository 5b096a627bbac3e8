//! Q8_0 products of many activation rows on AMX's int8 tiles (prefill): the packed groups and
//! the 8-bit activations re-laid out as tiles ([`kernels::tiles`]), then
//! [`kernels::q8_0_tiles`]. Every output is the same bits as the VNNI kernel's (the integer
//! unit sums are exact either way and the float steps are the same), so a token's logits do not
//! depend on how many tokens it was computed with.
//!
//! The activations are laid out once per product, before the parallel section (every task reads
//! all of them); each task lays out its own 32 weight rows (two pairs of packed groups) and runs
//! every token over them, so the weights are re-laid out once per product too.

use super::{GROUP, PackedMatrix, par_row_groups};
use crate::cpu;
use crate::quant::GgmlType;
use crate::quant::act::Q8Acts;
use crate::quant::kernels::{
    self,
    tiles::{ActTile, TILE_ROWS, WeightTile},
};
use crate::quant::unit::UNIT;

/// Activation rows from which a Q8_0 product takes the tiles: below, the VNNI kernels
/// (a token count is padded to a whole tile of 16, and a short product pays for laying out the
/// weights).
pub const MIN_TOKENS: usize = 16;

/// Weight rows per parallel task: two weight tiles, the kernel's block.
const TASK_ROWS: usize = 2 * TILE_ROWS;

thread_local! {
    /// The caller's activation tiles (reused across products).
    static ACTS: std::cell::RefCell<Vec<ActTile>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A task's weight tiles.
    static WEIGHTS: std::cell::RefCell<Vec<WeightTile>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// The AMX token, where a product of `n` rows of `x` with `w` should take the tiles.
pub fn amx_for(w: &PackedMatrix, n: usize) -> Option<cpu::Amx> {
    (n >= MIN_TOKENS && w.ty == GgmlType::Q8_0)
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

/// `y[t] = W x[t]` for every row of `x` through the tiles (`w` Q8_0; `y` is `n x rows`,
/// token-major).
pub fn matmul_tiles(kernel: TileKernel, w: &PackedMatrix, x: &Q8Acts, y: &mut [f32]) {
    let (n, k) = (x.n, x.k);
    assert!(
        w.ty == GgmlType::Q8_0 && k == w.cols && y.len() == n * w.rows,
        "matmul_tiles: a Q8_0 matrix of {} columns and {} outputs",
        k,
        n * w.rows
    );
    let units = k / UNIT;
    ACTS.with_borrow_mut(|acts| {
        act_tiles(x, acts);
        let acts = &acts[..];
        par_row_groups(w.rows, n, TASK_ROWS, y, |r0, rows, out| {
            WEIGHTS.with_borrow_mut(|weights| {
                weight_tiles(w, r0, rows, weights);
                let put = |t: usize, i0: usize, v: &[f32; TILE_ROWS]| {
                    if t < n && i0 < rows {
                        out.put(t, i0, v);
                    }
                };
                match kernel {
                    TileKernel::Amx(t) => kernels::q8_0_tiles(t, acts, weights, units, put),
                    TileKernel::Scalar => {
                        kernels::tiles::q8_0_tiles_scalar(acts, weights, units, put)
                    }
                }
            })
        });
    });
}

/// Lays out the rows of `x` as activation tiles: `tiles[i * units + c]` = unit `c` of rows
/// `16 i .. 16 i + 16` (rows past the last zero), one parallel task per 16 rows.
fn act_tiles(x: &Q8Acts, tiles: &mut Vec<ActTile>) {
    let units = x.k / UNIT;
    let blocks = x.n.div_ceil(TILE_ROWS);
    tiles.resize(blocks * units, ActTile::ZERO);
    let shared = SharedTiles(tiles.as_mut_ptr());
    crate::team::for_each(blocks, |i| {
        // SAFETY: task i alone writes tiles i * units .. (i + 1) * units, which `tiles` holds
        // (resized above), and nothing reads them before the section ends.
        let block = unsafe { std::slice::from_raw_parts_mut(shared.at(i * units), units) };
        for tt in 0..TILE_ROWS {
            let t = TILE_ROWS * i + tt;
            if t >= x.n {
                for tile in block.iter_mut() {
                    tile.codes[UNIT * tt..UNIT * (tt + 1)].fill(0);
                    tile.d[tt] = 0.0;
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
        }
    });
}

/// The activation tiles, written by disjoint parallel tasks.
#[derive(Copy, Clone)]
struct SharedTiles(*mut ActTile);
// SAFETY: `act_tiles`' tasks write disjoint tiles.
unsafe impl Send for SharedTiles {}
// SAFETY: as above.
unsafe impl Sync for SharedTiles {}

impl SharedTiles {
    /// Tile `i` (a method, so closures capture the whole `Sync` wrapper).
    fn at(self, i: usize) -> *mut ActTile {
        self.0.wrapping_add(i)
    }
}

/// Lays out rows `r0..r0 + rows` of `w` (`r0` a multiple of 16) as weight tiles:
/// `tiles[j * units + c]` = unit `c` of rows `r0 + 16 j ..`, from packed groups `2j` and
/// `2j + 1` of the task (row `q` of a tile: vector `q` of the first group's unit, then the
/// second's; a group past the task's rows zero).
fn weight_tiles(w: &PackedMatrix, r0: usize, rows: usize, tiles: &mut Vec<WeightTile>) {
    let l = super::layout(GgmlType::Q8_0).expect("Q8_0 is packed");
    let (col, units) = (l.column_bytes(), w.cols / UNIT);
    debug_assert!(r0.is_multiple_of(TILE_ROWS) && l.unit == 8 * 32 && l.head == 2 * GROUP);
    tiles.clear();
    tiles.resize(rows.div_ceil(TILE_ROWS) * units, WeightTile::ZERO);
    for (j, block) in tiles.chunks_exact_mut(units).enumerate() {
        for h in 0..2 {
            if TILE_ROWS * j + GROUP * h >= rows {
                break;
            }
            let group = w.group(r0 / GROUP + 2 * j + h);
            for (c, tile) in block.iter_mut().enumerate() {
                let column = &group[c * col..(c + 1) * col];
                for (r, d) in tile.d[GROUP * h..GROUP * (h + 1)].iter_mut().enumerate() {
                    *d = u16::from_le_bytes([column[2 * r], column[2 * r + 1]]);
                }
                let data = &column[l.head..l.head + l.unit];
                for (q, v) in data.chunks_exact(32).enumerate() {
                    let dst: &mut [i8; 32] = (&mut tile.codes[64 * q + 32 * h..][..32])
                        .try_into()
                        .expect("half a tile row");
                    let v: &[u8; 32] = v.try_into().expect("a vector");
                    *dst = v.map(|b| b as i8);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::WeightMatrix;
    use crate::quant::kernels::{Isa, scalar};

    /// `n` Q8_0 blocks of random bytes (every code, -128 included) with random f16 scales of
    /// both signs.
    fn random_q8_0(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out: Vec<u8> = (0..n * 34).map(|_| next() as u8).collect();
        for b in out.chunks_exact_mut(34) {
            let v = (next() % 2000) as f32 / 1000.0 - 1.0;
            b[..2].copy_from_slice(&crate::quant::f32_to_f16(v * 0.05).to_le_bytes());
        }
        out
    }

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

    /// The tiles give every output the VNNI kernel's bits, through AMX and through the scalar
    /// twin, on ragged shapes: token counts around whole tiles and pairs of tiles, row counts
    /// that leave a task with one weight tile or half of one, several units.
    #[test]
    fn tiles_give_the_vnni_bits() {
        let amx = cpu::token_for_test::<cpu::Amx>("tiles_give_the_vnni_bits");
        let vnni = cpu::Avx512Vnni::get().map(Isa::Avx512Vnni);
        let shapes = [
            (8, 32, 16),
            (13, 96, 17),
            (40, 256, 35),
            (72, 512, 50),
            (33, 160, 64),
            (96, 64, 31),
            (24, 1024, 16),
        ];
        for (si, &(rows, cols, n)) in shapes.iter().enumerate() {
            let data = random_q8_0(rows * cols / 32, 11 + si as u64);
            let wm = WeightMatrix::new(GgmlType::Q8_0, rows, cols, &data).unwrap();
            let p = PackedMatrix::pack(&wm).unwrap();
            let x = random_acts(n, cols, 5 + si as u64);
            let mut scalar_y = vec![0f32; n * rows];
            matmul_tiles(TileKernel::Scalar, &p, &x, &mut scalar_y);
            // The reference kernel, up to its f32 summation order.
            for t in 0..n {
                for r in 0..rows {
                    let want = scalar::dot_q8(GgmlType::Q8_0, wm.row(r), x.row(t));
                    let got = scalar_y[t * rows + r];
                    let tol = 1e-5 * (1.0 + want.abs()) * cols as f32 / 32.0;
                    assert!((got - want).abs() <= tol, "{rows}x{cols} n{n} t{t} r{r}");
                }
            }
            if let Some(isa) = vnni {
                let mut y = vec![0f32; n * rows];
                super::super::matmul_by_groups(isa, &p, &x, &mut y);
                assert_eq!(
                    bits(&scalar_y),
                    bits(&y),
                    "scalar twin vs VNNI {rows}x{cols} n{n}"
                );
            }
            if let Some(t) = amx {
                let mut y = vec![0f32; n * rows];
                matmul_tiles(TileKernel::Amx(t), &p, &x, &mut y);
                assert_eq!(
                    bits(&scalar_y),
                    bits(&y),
                    "AMX vs scalar twin {rows}x{cols} n{n}"
                );
                // And through the dispatch every product takes.
                let mut y2 = vec![0f32; n * rows];
                super::super::matmul_packed(&p, &x, &mut y2);
                assert_eq!(bits(&y), bits(&y2), "dispatch {rows}x{cols} n{n}");
            }
        }
    }
}
