//! Operand tiles of the AMX int8 products of Q8_0 weights with 8-bit activations
//! ([`super::q8_0_tiles`]), and their scalar twin.
//!
//! AMX's `TDPBSSD` multiplies a tile of 16 rows of signed bytes (A: here 16 activation rows,
//! 32 bytes of one 32-element unit each) by a tile in VNNI order (B: 8 rows of 64 bytes, row
//! `q` holding elements `4q..4q+4` of 16 weight rows) into 16 x 16 exact i32 sums. Q8_0 has one
//! scale per row and unit, so every unit is its own `TDPBSSD` into a zeroed C tile, and its i32
//! sums are then scaled and accumulated in f32 exactly as the VNNI kernel does for each row and
//! token (`x86_int8`: `acc = fma(f32(isum), d_w * d_x, acc)` per unit in order, then
//! `acc + 0.0`), so a token's outputs are the same bits whether it came through the tiles or
//! alone through the one-token kernel.
//!
//! The tiles are made per product from the packed layout (`quant::packed`, whose Q8_0 unit is
//! eight vectors of 32 bytes, vector `i` = elements `4i..4i+4` of eight rows: half a B tile
//! row) and from [`Q8Acts`](crate::quant::act::Q8Acts), each with its scales beside it, so
//! every tile load reads 512 contiguous, 64-byte aligned bytes.

/// Rows of an activation tile (tokens) and weight rows of a weight tile.
pub const TILE_ROWS: usize = 16;

/// One unit (32 elements) of 16 activation rows, A-tile order: bytes `32t..32t + 32` are row
/// `t`'s integers; `d[t]` its scale. Rows past the product's last are zero.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct ActTile {
    pub codes: [i8; 512],
    pub d: [f32; 16],
}

impl ActTile {
    pub const ZERO: ActTile = ActTile {
        codes: [0; 512],
        d: [0.0; 16],
    };
}

/// One unit of 16 weight rows, B-tile order: byte `64q + 4n + e` is element `4q + e` of row `n`;
/// `d[n]` the row's f16 scale as stored. Rows past the matrix's last are zero.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct WeightTile {
    pub codes: [i8; 512],
    pub d: [u16; 16],
}

impl WeightTile {
    pub const ZERO: WeightTile = WeightTile {
        codes: [0; 512],
        d: [0; 16],
    };
}

/// Scalar twin of [`super::q8_0_tiles`]: for every activation row `t` of the token blocks of
/// `acts` (`units` tiles each) and row block `j` of `weights`, `put(t, 16 j, &out)` with
/// `out[n] = dot(weight row 16j + n, activation row t)`, in the same float operations.
pub fn q8_0_tiles_scalar(
    acts: &[ActTile],
    weights: &[WeightTile],
    units: usize,
    mut put: impl FnMut(usize, usize, &[f32; TILE_ROWS]),
) {
    let (ta, tb) = (acts.len() / units, weights.len() / units);
    for i in 0..ta {
        for j in 0..tb {
            for t in 0..TILE_ROWS {
                let out: [f32; TILE_ROWS] = std::array::from_fn(|n| {
                    let mut acc = 0f32;
                    for c in 0..units {
                        let (a, b) = (&acts[i * units + c], &weights[j * units + c]);
                        let isum: i32 = (0..32)
                            .map(|e| {
                                let w = b.codes[64 * (e / 4) + 4 * n + e % 4];
                                i32::from(a.codes[32 * t + e]) * i32::from(w)
                            })
                            .sum();
                        let dw = crate::quant::f16_to_f32(b.d[n]);
                        acc = (isum as f32).mul_add(dw * a.d[t], acc);
                    }
                    acc + 0.0
                });
                put(TILE_ROWS * i + t, TILE_ROWS * j, &out);
            }
        }
    }
}
