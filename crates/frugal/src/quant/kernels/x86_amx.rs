//! AMX int8 (`TDPBSSD`) products of Q8_0 weights with 8-bit activations (see `tiles` for the
//! operands and why every unit is its own tile product).
//!
//! Tile registers (palette 1): tmm0, tmm1 the activation tiles of tokens 0..16 and 16..32
//! (16 rows x 32 bytes), tmm2, tmm3 the weight tiles of rows 0..16 and 16..32 (8 rows x 64
//! bytes), tmm4..tmm7 the four 16 x 16 i32 products (C00, C01, C10, C11). Per unit: four tile
//! loads, four `TDPBSSD`, four tile stores into an aligned buffer, then the f32 scaling of the
//! stored sums with AVX-512, one vector of 16 weight rows per token. The products of unit
//! `c + 1` are issued before the sums of unit `c` are scaled, so the tile unit's latency hides
//! behind the vector work. Stable Rust has no AMX intrinsics, so the tile instructions are
//! `asm!` (as in the training crate's bf16 kernel).

use std::arch::asm;
use std::arch::x86_64::*;

use super::tiles::{ActTile, TILE_ROWS, WeightTile};
use crate::cpu::Amx;

/// The 64-byte `LDTILECFG` operand.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// Palette 1: A tiles 16 x 32 bytes, B tiles 8 x 64 bytes (K = 32: one unit), C tiles 16 x 64.
static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [32, 32, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 8, 8, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// Loads the tile configuration on this thread.
pub fn configure(_: Amx) {
    // SAFETY: the token proves AMX and the OS's permission; CONFIG is a valid palette-1
    // configuration, 64-byte aligned.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
}

/// Returns the tiles to their initial state (the thread's XSAVE area stops carrying them).
pub fn release(_: Amx) {
    // SAFETY: the token proves AMX; TILERELEASE has no operands.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// Four C tiles of i32 sums: `[2i + j][t][n]` for activation tile `i`, weight tile `j`.
#[repr(C, align(64))]
struct Sums([[[i32; 16]; 16]; 4]);

/// Outputs of one block: `out[t][j][n]` = token `t` (0..16 MT) against row `16j + n`.
pub type BlockOut = [[[f32; TILE_ROWS]; 2]; 2 * TILE_ROWS];

/// `MT` activation tiles (16 tokens each) times `NT` weight tiles (16 rows each), over
/// `units` units: `acts[i * units + c]`, `weights[j * units + c]`. Absent tiles (MT or NT of
/// 1) are computed from the first one's operands and dropped.
///
/// # Safety
/// [`configure`] ran on this thread and [`release`] has not since; `acts` holds `MT * units`
/// tiles and `weights` `NT * units`, `units >= 1`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub unsafe fn q8_0_block<const MT: usize, const NT: usize>(
    _: Amx,
    acts: &[ActTile],
    weights: &[WeightTile],
    units: usize,
    out: &mut BlockOut,
) {
    debug_assert!(
        (1..=2).contains(&MT)
            && (1..=2).contains(&NT)
            && units >= 1
            && acts.len() >= MT * units
            && weights.len() >= NT * units
    );
    let mut sums: [Sums; 2] = [const { Sums([[[0; 16]; 16]; 4]) }; 2];
    let mut acc = [[_mm512_setzero_ps(); 2]; 2 * TILE_ROWS];
    // Unit c's four products into tmm4..tmm7.
    let issue = |c: usize| {
        let a0 = &acts[c];
        let a1 = &acts[if MT == 2 { units + c } else { c }];
        let b0 = &weights[c];
        let b1 = &weights[if NT == 2 { units + c } else { c }];
        // SAFETY: the configuration is loaded (contract); each load reads the 512 code bytes
        // of one tile (16 rows at stride 32, or 8 at stride 64).
        unsafe {
            asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                "tileloadd tmm0, [{a0} + {s32}*1]",
                "tileloadd tmm2, [{b0} + {s64}*1]",
                "tdpbssd tmm4, tmm0, tmm2",
                "tileloadd tmm3, [{b1} + {s64}*1]",
                "tdpbssd tmm5, tmm0, tmm3",
                "tileloadd tmm1, [{a1} + {s32}*1]",
                "tdpbssd tmm6, tmm1, tmm2",
                "tdpbssd tmm7, tmm1, tmm3",
                a0 = in(reg) a0.codes.as_ptr(),
                a1 = in(reg) a1.codes.as_ptr(),
                b0 = in(reg) b0.codes.as_ptr(),
                b1 = in(reg) b1.codes.as_ptr(),
                s32 = in(reg) 32usize,
                s64 = in(reg) 64usize,
                options(nostack, readonly),
            );
        }
    };
    let store = |s: &mut Sums| {
        // SAFETY: the configuration is loaded; each store writes 16 rows of 64 bytes at stride
        // 64 into one 1 KiB tile of `s`.
        unsafe {
            asm!(
                "tilestored [{c} + {s64}*1], tmm4",
                "tilestored [{c} + {s64}*1 + 1024], tmm5",
                "tilestored [{c} + {s64}*1 + 2048], tmm6",
                "tilestored [{c} + {s64}*1 + 3072], tmm7",
                c = in(reg) s.0.as_mut_ptr(),
                s64 = in(reg) 64usize,
                options(nostack),
            );
        }
    };
    issue(0);
    store(&mut sums[0]);
    for c in 0..units {
        if c + 1 < units {
            issue(c + 1);
        }
        // Unit c's sums, scaled as the VNNI kernel scales them: fma(f32(isum), d_w * d_x, acc).
        let s = &sums[c & 1];
        let dw: [__m512; 2] = std::array::from_fn(|j| {
            let b = &weights[if j < NT { j * units + c } else { c }];
            // SAFETY: 16 f16 scales, 32 bytes.
            _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(b.d.as_ptr() as *const __m256i) })
        });
        for i in 0..MT {
            for (tt, &d) in acts[i * units + c].d.iter().enumerate() {
                let dx = _mm512_set1_ps(d);
                let t = TILE_ROWS * i + tt;
                for (j, &dwj) in dw.iter().enumerate().take(NT) {
                    // SAFETY: a row of 16 i32 inside `s`.
                    let isum = unsafe { _mm512_loadu_epi32(s.0[2 * i + j][tt].as_ptr()) };
                    acc[t][j] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(isum),
                        _mm512_mul_ps(dwj, dx),
                        acc[t][j],
                    );
                }
            }
        }
        if c + 1 < units {
            store(&mut sums[(c + 1) & 1]);
        }
    }
    // The VNNI kernel's last step adds its (zero) offsets: -0.0 becomes +0.0 there too.
    for (o, a) in out.iter_mut().zip(&acc).take(TILE_ROWS * MT) {
        for (oj, &aj) in o.iter_mut().zip(a).take(NT) {
            // SAFETY: 16 f32 of `out`.
            unsafe { _mm512_storeu_ps(oj.as_mut_ptr(), _mm512_add_ps(aj, _mm512_setzero_ps())) };
        }
    }
}
