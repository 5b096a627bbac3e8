//! Operand tiles of the AMX int8 products of packed weights with 8-bit activations
//! ([`super::unit_tiles`]), and their scalar twin.
//!
//! AMX's `TDPBSSD` multiplies a tile of 16 rows of signed bytes (A: here 16 activation rows,
//! the bytes of one 32-element unit each) by a tile in VNNI order (B: rows of 64 bytes, row `q`
//! holding elements `4q..4q+4` of 16 weight rows) into 16 x 16 exact i32 sums. Every format
//! has a scale per row and unit (or per half unit), so every unit (or half) is its own
//! `TDPBSSD` into a zeroed C tile, and its i32 sums are then scaled and accumulated in f32
//! exactly as the VNNI kernel (`x86_int8`) does for each row and token: per unit in order,
//! `acc = fma(f32(isum), sc * d_x, acc)` (twice, one per half, for the formats scaled per 16
//! elements), the offsets `off = fma(mn, s_x, off)` in a chain of their own, then `acc + off`.
//! So a token's outputs are the same bits whether it came through the tiles or alone through
//! the one-token kernel.
//!
//! The weights are the integers the VNNI kernel multiplies (unsigned codes for the formats with
//! an offset, signed integers for the others: all fit a signed byte), unpacked per product from
//! the packed layout (`quant::packed`), with their scales as f32 beside them; the activations
//! are [`Q8Acts`](crate::quant::act::Q8Acts) re-laid out, each tile load reading contiguous,
//! 64-byte aligned bytes.

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

/// One unit of 16 weight rows, B-tile order: byte `64q + 4n + e` is element `4q + e` of row `n`
/// (so the first half unit is bytes `0..256`); `sc[h][n]` the row's scale for half `h` (both
/// halves equal for the formats scaled per unit). Rows past the matrix's last are zero.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub struct WeightTile {
    pub codes: [i8; 512],
    pub sc: [[f32; 16]; 2],
}

impl WeightTile {
    pub const ZERO: WeightTile = WeightTile {
        codes: [0; 512],
        sc: [[0.0; 16]; 2],
    };
}

/// Per-half values of one unit for 16 rows: a weight tile's offset factors `mn` (signed so the
/// offset is always `+mn * s`), or an activation tile's block sums `s` (per unit in `[0]`, or
/// per half).
pub type Sums = [[f32; TILE_ROWS]; 2];

/// How a format's units go through the tiles.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct TileFormat {
    /// Scales per 16 elements: two K = 16 products a unit (Q6_K, Q3_K, Q2_K).
    pub halves: bool,
    /// Offsets against the activations' block sums (the unsigned-code formats).
    pub offsets: bool,
}

impl TileFormat {
    /// The halves that carry a scale (and an offset, with [`Self::offsets`]).
    pub fn scaled_halves(self) -> usize {
        if self.halves { 2 } else { 1 }
    }
}

/// Scalar twin of [`super::unit_tiles`]: for every activation row `t` of the token blocks of
/// `acts` (`units` tiles each, with `act_sums` beside them) and row block `j` of `weights` (with
/// `mins`), `put(t, 16 j, &out)` with `out[n] = dot(weight row 16j + n, activation row t)`, in the
/// same float operations.
pub fn unit_tiles_scalar(
    f: TileFormat,
    acts: &[ActTile],
    act_sums: &[Sums],
    weights: &[WeightTile],
    mins: &[Sums],
    units: usize,
    mut put: impl FnMut(usize, usize, &[f32; TILE_ROWS]),
) {
    let (ta, tb) = (acts.len() / units, weights.len() / units);
    let halves = f.scaled_halves();
    let span = 32 / halves;
    for i in 0..ta {
        for j in 0..tb {
            for t in 0..TILE_ROWS {
                let out: [f32; TILE_ROWS] = std::array::from_fn(|n| {
                    let (mut acc, mut off) = (0f32, 0f32);
                    for c in 0..units {
                        let (a, b) = (&acts[i * units + c], &weights[j * units + c]);
                        for h in 0..halves {
                            let isum: i32 = (span * h..span * (h + 1))
                                .map(|e| {
                                    let w = b.codes[64 * (e / 4) + 4 * n + e % 4];
                                    i32::from(a.codes[32 * t + e]) * i32::from(w)
                                })
                                .sum();
                            acc = (isum as f32).mul_add(b.sc[h][n] * a.d[t], acc);
                            if f.offsets {
                                let (m, s) = (mins[j * units + c][h][n], act_sums[i * units + c]);
                                off = m.mul_add(s[h][t], off);
                            }
                        }
                    }
                    acc + off
                });
                put(TILE_ROWS * i + t, TILE_ROWS * j, &out);
            }
        }
    }
}
