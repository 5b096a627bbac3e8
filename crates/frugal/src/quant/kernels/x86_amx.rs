//! AMX int8 (`TDPBSSD`) products of Q8_0 weights with 8-bit activations (see `tiles` for the
//! operands and why every unit is its own tile product).
//!
//! Tile registers (palette 1): tmm0, tmm1 activation tiles (16 tokens x 32 bytes), tmm2, tmm3
//! weight tiles (8 rows x 64 bytes), tmm4..tmm7 the 16 x 16 i32 products of four units in
//! flight. Per unit: two tile loads, one `TDPBSSD`, one tile store into an aligned buffer, then
//! the f32 scaling of the stored sums with AVX-512, one vector of 16 weight rows per token,
//! into 16 accumulators that stay in registers for the whole row (a 2 x 2 block of tiles kept
//! its 64 accumulators in memory, and their loads and stores ran the kernel at a fifth of the
//! vector units' pace). Stable Rust has no AMX intrinsics, so the tile instructions are
//! `asm!` (as in the training crate's bf16 kernel).

use std::arch::asm;
use std::arch::x86_64::*;

use super::tiles::{ActTile, TILE_ROWS, WeightTile};
use crate::cpu::{Amx, TileConfig};

/// Palette 1: A tiles 16 x 32 bytes, B tiles 8 x 64 bytes (K = 32: one unit), C tiles 16 x 64.
static CONFIG: TileConfig = TileConfig::palette1(
    [32, 32, 64, 64, 64, 64, 64, 64],
    [16, 16, 8, 8, 16, 16, 16, 16],
);

/// Loads the tile configuration on this thread.
pub fn configure(amx: Amx) {
    amx.load_tiles(&CONFIG);
}

/// Returns the tiles to their initial state (the thread's XSAVE area stops carrying them).
pub fn release(amx: Amx) {
    amx.release_tiles();
}

/// Product tiles in flight: unit `c` goes to tmm(4 + c % 4) from tmm(c % 2) and tmm(2 + c % 2),
/// and its sums are stored three units later, so a product's latency (and its store's) is
/// spread over four units of vector work.
const SLOTS: usize = 4;

/// Units ahead whose tiles are asked into L1.
const AHEAD: usize = 8;

/// Cache lines of an [`ActTile`] or a [`WeightTile`] (codes and scales).
const TILE_LINES: usize = std::mem::size_of::<ActTile>() / 64;
const _: () = assert!(std::mem::size_of::<WeightTile>() == 64 * TILE_LINES);

/// Issues unit `c`'s product: zero its C tile, load its two operand tiles, `TDPBSSD`.
///
/// # Safety
/// The tile configuration is loaded; `c` indexes `acts` and `weights`.
#[inline(always)]
unsafe fn issue(acts: &[ActTile], weights: &[WeightTile], c: usize) {
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
    match c % SLOTS {
        0 => product!("tmm0", "tmm2", "tmm4"),
        1 => product!("tmm1", "tmm3", "tmm5"),
        2 => product!("tmm0", "tmm2", "tmm6"),
        _ => product!("tmm1", "tmm3", "tmm7"),
    }
}

/// Stores unit `c`'s sums (its C tile) to `s`.
///
/// # Safety
/// The tile configuration is loaded; `s` points at 1 KiB of writable memory.
#[inline(always)]
unsafe fn store(c: usize, s: *mut Sums) {
    macro_rules! tile_store {
        ($c:literal) => {
            // SAFETY: the configuration is loaded; the store writes 16 rows of 64 bytes at
            // stride 64, the 1 KiB at `s` (contract).
            unsafe {
                asm!(
                    concat!("tilestored [{s} + {s64}*1], ", $c),
                    s = in(reg) s,
                    s64 = in(reg) 64usize,
                    options(nostack),
                )
            }
        };
    }
    match c % SLOTS {
        0 => tile_store!("tmm4"),
        1 => tile_store!("tmm5"),
        2 => tile_store!("tmm6"),
        _ => tile_store!("tmm7"),
    }
}

/// One C tile of i32 sums, `[t][n]`.
#[repr(C, align(64))]
struct Sums([[i32; 16]; 16]);

/// Outputs of one block: `out[t][n]` = token `t` against weight row `n`.
pub type BlockOut = [[f32; TILE_ROWS]; TILE_ROWS];

/// One activation tile's 16 tokens times one weight tile's 16 rows, over `units` units
/// (`acts[c]`, `weights[c]`). The 16 accumulators stay in registers; the products of units
/// `c + 1 .. c + 4` run while unit `c`'s sums are scaled ([`SLOTS`]).
///
/// # Safety
/// [`configure`] ran on this thread and [`release`] has not since; `acts` and `weights` hold
/// `units >= 1` tiles each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn q8_0_block(
    _: Amx,
    acts: &[ActTile],
    weights: &[WeightTile],
    units: usize,
    out: &mut BlockOut,
) {
    debug_assert!(units >= 1 && acts.len() >= units && weights.len() >= units);
    let mut sums = std::mem::MaybeUninit::<[Sums; SLOTS]>::uninit();
    let sums = sums.as_mut_ptr() as *mut Sums;
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    for c in 0..(SLOTS - 1).min(units) {
        // SAFETY: the configuration is loaded (contract); c < units.
        unsafe { issue(acts, weights, c) };
    }
    for c in 0..units {
        if c + SLOTS - 1 < units {
            // SAFETY: as above.
            unsafe { issue(acts, weights, c + SLOTS - 1) };
        }
        if c + AHEAD < units {
            // The tiles of unit c + AHEAD into L1: they stream from L2 (a row's tiles are tens
            // to hundreds of KiB), and the tile loads waited on them.
            for p in [
                acts[c + AHEAD].codes.as_ptr(),
                weights[c + AHEAD].codes.as_ptr(),
            ] {
                for line in 0..TILE_LINES {
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * line));
                }
            }
        }
        // SAFETY: `sums` has SLOTS tiles.
        let s = unsafe { sums.add(c % SLOTS) };
        // SAFETY: the configuration is loaded; `s` is 1 KiB, 64-byte aligned.
        unsafe { store(c, s) };
        // Unit c's sums, scaled as the VNNI kernel scales them: fma(f32(isum), d_w * d_x, acc).
        // SAFETY: 16 f16 scales, 32 bytes.
        let dw =
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(weights[c].d.as_ptr() as *const __m256i) });
        for ((tt, &d), a) in acts[c].d.iter().enumerate().zip(acc.iter_mut()) {
            let dx = _mm512_set1_ps(d);
            // SAFETY: row tt of the 16 rows of 16 i32 just stored in `s`.
            let isum = unsafe { _mm512_loadu_epi32((s as *const i32).add(16 * tt)) };
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx), *a);
        }
    }
    // The VNNI kernel's last step adds its (zero) offsets: -0.0 becomes +0.0 there too.
    for (o, &a) in out.iter_mut().zip(&acc) {
        // SAFETY: 16 f32 of `out`.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), _mm512_add_ps(a, _mm512_setzero_ps())) };
    }
}
