//! AMX int8 (`TDPBSSD`) products of packed weights with 8-bit activations (see `tiles` for the
//! operands and why every unit is its own tile product), and the unpacking of packed groups
//! into weight tiles.
//!
//! Tile registers (palette 1), formats scaled per unit: tmm0, tmm1 activation tiles (16 tokens
//! x 32 bytes), tmm2, tmm3 weight tiles (8 rows x 64 bytes), tmm4..tmm7 the 16 x 16 i32 products
//! of four units in flight. Formats scaled per half unit: tmm0, tmm1 the two halves of an
//! activation tile (16 x 16 bytes, K = 16), tmm2, tmm3 the two halves of a weight tile (4 x 64),
//! tmm4..tmm7 the half products of two units in flight. Per unit: the tile loads, one `TDPBSSD`
//! per product, one tile store each into an aligned buffer, then the f32 scaling of the stored
//! sums with AVX-512, one vector of 16 weight rows per token, into 16 accumulators that stay in
//! registers for the whole row (a 2 x 2 block of tiles kept its 64 accumulators in memory, and
//! their loads and stores ran the kernel at a fifth of the vector units' pace). The offsets
//! (unsigned-code formats) are a chain of their own, added after. Stable Rust has no AMX
//! intrinsics, so the tile instructions are `asm!` (as in the training crate's bf16 kernel).

use std::arch::asm;
use std::arch::x86_64::*;

use super::tiles::{ActTile, Sums, TILE_ROWS, TileFormat, WeightTile};
use super::x86_int8::{code_table, column_scales, offset_negated, unit_codes, unit_scales};
use crate::cpu::{Amx, Avx2, TileConfig};
use crate::quant::GgmlType;
use crate::quant::packed::{GROUP, layout};

/// Formats scaled per unit: A tiles 16 x 32 bytes, B tiles 8 x 64 bytes (K = 32), C 16 x 64.
static UNITS: TileConfig = TileConfig::palette1(
    [32, 32, 64, 64, 64, 64, 64, 64],
    [16, 16, 8, 8, 16, 16, 16, 16],
);

/// Formats scaled per half unit: A tiles 16 x 16 bytes, B tiles 4 x 64 bytes (K = 16).
static HALVES: TileConfig = TileConfig::palette1(
    [16, 16, 64, 64, 64, 64, 64, 64],
    [16, 16, 4, 4, 16, 16, 16, 16],
);

/// Loads the tile configuration for format `f` on this thread.
pub fn configure(amx: Amx, f: TileFormat) {
    amx.load_tiles(if f.halves { &HALVES } else { &UNITS });
}

/// Returns the tiles to their initial state (the thread's XSAVE area stops carrying them).
pub fn release(amx: Amx) {
    amx.release_tiles();
}

/// Units ahead whose tiles are asked into L1.
const AHEAD: usize = 8;

/// Cache lines of an [`ActTile`] and of a [`WeightTile`] (codes and scales).
const ACT_LINES: usize = std::mem::size_of::<ActTile>() / 64;
const WEIGHT_LINES: usize = std::mem::size_of::<WeightTile>() / 64;

/// Units in flight: four C tiles hold four units' products, or two units' half products.
const fn slots(halves: bool) -> usize {
    if halves { 2 } else { 4 }
}

/// Issues unit `c`'s products: zero its C tiles, load its operand tiles, `TDPBSSD`.
///
/// # Safety
/// The configuration for `HALVES` is loaded; `c` indexes `acts` and `weights`.
#[inline(always)]
unsafe fn issue<const HALVES: bool>(acts: &[ActTile], weights: &[WeightTile], c: usize) {
    let (a, b) = (acts[c].codes.as_ptr(), weights[c].codes.as_ptr());
    macro_rules! product {
        ($a:literal, $b:literal, $c:literal) => {
            // SAFETY: the configuration is loaded (contract); each load reads the 512 code
            // bytes of one tile (16 rows at stride 32, or 8 at stride 64).
            unsafe {
                asm!(
                    concat!("tilezero ", $c),
                    concat!("tileloadd ", $a, ", [{a} + {s32}*1]"),
                    concat!("tileloadd ", $b, ", [{b} + {s64}*1]"),
                    concat!("tdpbssd ", $c, ", ", $a, ", ", $b),
                    a = in(reg) a,
                    b = in(reg) b,
                    s32 = in(reg) 32usize,
                    s64 = in(reg) 64usize,
                    options(nostack, readonly),
                )
            }
        };
    }
    macro_rules! halves {
        ($c0:literal, $c1:literal) => {
            // SAFETY: the configuration is loaded (contract); the loads read each half's bytes:
            // 16 rows of 16 at stride 32 from the activation codes (offsets 0 and 16), 4 rows
            // of 64 from the weight codes (offsets 0 and 256).
            unsafe {
                asm!(
                    concat!("tilezero ", $c0),
                    concat!("tilezero ", $c1),
                    "tileloadd tmm0, [{a} + {s32}*1]",
                    "tileloadd tmm1, [{a1} + {s32}*1]",
                    "tileloadd tmm2, [{b} + {s64}*1]",
                    "tileloadd tmm3, [{b1} + {s64}*1]",
                    concat!("tdpbssd ", $c0, ", tmm0, tmm2"),
                    concat!("tdpbssd ", $c1, ", tmm1, tmm3"),
                    a = in(reg) a,
                    a1 = in(reg) a.wrapping_add(16),
                    b = in(reg) b,
                    b1 = in(reg) b.wrapping_add(256),
                    s32 = in(reg) 32usize,
                    s64 = in(reg) 64usize,
                    options(nostack, readonly),
                )
            }
        };
    }
    if HALVES {
        match c % 2 {
            0 => halves!("tmm4", "tmm5"),
            _ => halves!("tmm6", "tmm7"),
        }
    } else {
        match c % 4 {
            0 => product!("tmm0", "tmm2", "tmm4"),
            1 => product!("tmm1", "tmm3", "tmm5"),
            2 => product!("tmm0", "tmm2", "tmm6"),
            _ => product!("tmm1", "tmm3", "tmm7"),
        }
    }
}

/// Stores unit `c`'s sums (its C tiles) to `s` (one [`ISums`] per product).
///
/// # Safety
/// The configuration for `HALVES` is loaded; `s` points at one (two with `HALVES`) writable
/// [`ISums`].
#[inline(always)]
unsafe fn store<const HALVES: bool>(c: usize, s: *mut ISums) {
    macro_rules! tile_store {
        ($c:literal, $s:expr) => {
            // SAFETY: the configuration is loaded; the store writes 16 rows of 64 bytes at
            // stride 64, one ISums (contract).
            unsafe {
                asm!(
                    concat!("tilestored [{s} + {s64}*1], ", $c),
                    s = in(reg) $s,
                    s64 = in(reg) 64usize,
                    options(nostack),
                )
            }
        };
    }
    let s1 = s.wrapping_add(1);
    if HALVES {
        match c % 2 {
            0 => {
                tile_store!("tmm4", s);
                tile_store!("tmm5", s1);
            }
            _ => {
                tile_store!("tmm6", s);
                tile_store!("tmm7", s1);
            }
        }
    } else {
        match c % 4 {
            0 => tile_store!("tmm4", s),
            1 => tile_store!("tmm5", s),
            2 => tile_store!("tmm6", s),
            _ => tile_store!("tmm7", s),
        }
    }
}

/// One C tile of i32 sums, `[t][n]`.
#[repr(C, align(64))]
struct ISums([[i32; 16]; 16]);

/// Outputs of one block: `out[t][n]` = token `t` against weight row `n`.
pub type BlockOut = [[f32; TILE_ROWS]; TILE_ROWS];

/// One activation tile's 16 tokens times one weight tile's 16 rows, over `units` units
/// (`acts[c]`, `weights[c]`, with the block sums `act_sums[c]` and offset factors `mins[c]`
/// where the format has offsets). The 16 accumulators stay in registers; the products of the
/// next units run while unit `c`'s sums are scaled ([`slots`]).
///
/// # Safety
/// [`configure`] ran for this format (`HALVES`) on this thread and [`release`] has not since;
/// `acts` and `weights` hold `units >= 1` tiles each, and with `OFFSETS` `act_sums` and `mins`
/// as many.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn unit_block<const HALVES: bool, const OFFSETS: bool>(
    _: Amx,
    acts: &[ActTile],
    act_sums: &[Sums],
    weights: &[WeightTile],
    mins: &[Sums],
    units: usize,
    out: &mut BlockOut,
) {
    debug_assert!(units >= 1 && acts.len() >= units && weights.len() >= units);
    debug_assert!(!OFFSETS || (act_sums.len() >= units && mins.len() >= units));
    let slots = slots(HALVES);
    let halves = if HALVES { 2 } else { 1 };
    let mut sums = std::mem::MaybeUninit::<[ISums; 4]>::uninit();
    let sums = sums.as_mut_ptr() as *mut ISums;
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    for c in 0..(slots - 1).min(units) {
        // SAFETY: the configuration is loaded (contract); c < units.
        unsafe { issue::<HALVES>(acts, weights, c) };
    }
    for c in 0..units {
        if c + slots - 1 < units {
            // SAFETY: as above.
            unsafe { issue::<HALVES>(acts, weights, c + slots - 1) };
        }
        if c + AHEAD < units {
            // The tiles of unit c + AHEAD into L1: they stream from L2 (a row's tiles are tens
            // to hundreds of KiB), and the tile loads waited on them.
            let (a, w) = (&acts[c + AHEAD], &weights[c + AHEAD]);
            let a = a as *const ActTile as *const i8;
            let w = w as *const WeightTile as *const i8;
            for line in 0..ACT_LINES {
                _mm_prefetch::<_MM_HINT_T0>(a.wrapping_add(64 * line));
            }
            for line in 0..WEIGHT_LINES {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(64 * line));
            }
        }
        // SAFETY: `sums` has 4 tiles: a unit's one (or two) at its slot.
        let s = unsafe { sums.add(halves * (c % slots)) };
        // SAFETY: the configuration is loaded; `s` is 1 KiB (2 KiB), 64-byte aligned.
        unsafe { store::<HALVES>(c, s) };
        // Unit c's sums, scaled as the VNNI kernel scales them: fma(f32(isum), sc * d_x, acc),
        // the first half before the second.
        for h in 0..halves {
            // SAFETY: 16 f32 scales.
            let sc = unsafe { _mm512_loadu_ps(weights[c].sc[h].as_ptr()) };
            for ((tt, &d), a) in acts[c].d.iter().enumerate().zip(acc.iter_mut()) {
                let dx = _mm512_set1_ps(d);
                // SAFETY: row tt of the 16 rows of 16 i32 just stored in `s + h`.
                let isum = unsafe { _mm512_loadu_epi32((s.add(h) as *const i32).add(16 * tt)) };
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, dx), *a);
            }
        }
    }
    if !OFFSETS {
        // The VNNI kernel's last step adds its (zero) offsets: -0.0 becomes +0.0 there too.
        for (o, &a) in out.iter_mut().zip(&acc) {
            // SAFETY: 16 f32 of `out`.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), _mm512_add_ps(a, _mm512_setzero_ps())) };
        }
        return;
    }
    for (o, &a) in out.iter_mut().zip(&acc) {
        // SAFETY: 16 f32 of `out`.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), a) };
    }
    // The offsets, their own chain in unit order (and half order), as the VNNI kernel's.
    let mut off = [_mm512_setzero_ps(); TILE_ROWS];
    for (m, s) in mins[..units].iter().zip(&act_sums[..units]) {
        for h in 0..halves {
            // SAFETY: 16 f32.
            let mn = unsafe { _mm512_loadu_ps(m[h].as_ptr()) };
            for (o, &sx) in off.iter_mut().zip(&s[h]) {
                *o = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx), *o);
            }
        }
    }
    for (o, f) in out.iter_mut().zip(off) {
        // SAFETY: 16 f32 of `out`, written above.
        unsafe {
            let a = _mm512_loadu_ps(o.as_ptr());
            _mm512_storeu_ps(o.as_mut_ptr(), _mm512_add_ps(a, f));
        }
    }
}

/// Unpacks one row block of 16 rows (packed groups `groups[0]` and `groups[1]`, the second
/// absent past the matrix's last rows) of a `ty` matrix into `tiles` (one per unit of the
/// rows' `tiles.len()` units) and the offset factors `mins` (as many): the integers, scales and
/// offset factors the VNNI kernel computes (`x86_int8`), stored (offsets negated where that
/// kernel subtracts them, so every offset is `+mn * s`).
///
/// # Safety
/// Each group holds the packed columns of all `tiles.len()` units; `mins.len() ==
/// tiles.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn pack_weight_block(
    _: Avx2,
    ty: GgmlType,
    groups: [Option<&[u8]>; 2],
    tiles: &mut [WeightTile],
    mins: &mut [Sums],
) {
    let l = layout(ty).expect("packed type");
    let (col, upc) = (l.column_bytes(), l.units());
    let lut = code_table(ty);
    let sign = _mm256_set1_ps(if offset_negated(ty) { -0.0 } else { 0.0 });
    debug_assert!(mins.len() == tiles.len() && tiles.len().is_multiple_of(upc));
    for (h, group) in groups.into_iter().enumerate() {
        let lanes = GROUP * h..GROUP * (h + 1);
        let Some(group) = group else {
            for (t, m) in tiles.iter_mut().zip(mins.iter_mut()) {
                for i in 0..8 {
                    t.codes[64 * i + 32 * h..][..32].fill(0);
                }
                for (sc, mn) in t.sc.iter_mut().zip(m.iter_mut()) {
                    sc[lanes.clone()].fill(0.0);
                    mn[lanes.clone()].fill(0.0);
                }
            }
            continue;
        };
        debug_assert!(group.len() >= tiles.len() / upc * col);
        // SAFETY: (whole loop) column c spans c * col .. (c + 1) * col of `group` (contract);
        // every store writes 32 bytes inside one tile's codes, or 8 f32 inside a scale row.
        unsafe {
            for (c, (tc, mc)) in tiles
                .chunks_exact_mut(upc)
                .zip(mins.chunks_exact_mut(upc))
                .enumerate()
            {
                let blk = group.as_ptr().add(c * col);
                let (d8, m8) = column_scales(ty, blk);
                for (u, (tile, m)) in tc.iter_mut().zip(mc.iter_mut()).enumerate() {
                    let w = unit_codes(ty, blk.add(l.head + u * l.unit), lut);
                    for (i, wi) in w.iter().enumerate() {
                        let dst = tile.codes.as_mut_ptr().add(64 * i + 32 * h);
                        _mm256_storeu_si256(dst as *mut __m256i, *wi);
                    }
                    let [sc_a, sc_b, mn_a, mn_b] = unit_scales(ty, blk, d8, m8, u);
                    _mm256_storeu_ps(tile.sc[0].as_mut_ptr().add(GROUP * h), sc_a);
                    _mm256_storeu_ps(tile.sc[1].as_mut_ptr().add(GROUP * h), sc_b);
                    _mm256_storeu_ps(m[0].as_mut_ptr().add(GROUP * h), _mm256_xor_ps(mn_a, sign));
                    _mm256_storeu_ps(m[1].as_mut_ptr().add(GROUP * h), _mm256_xor_ps(mn_b, sign));
                }
            }
        }
    }
}
