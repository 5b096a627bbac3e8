//! The AVX-512 VNNI kernel of integer scores against a Q8_0 key cache (see `q8_keys` for the
//! arithmetic, and its portable twin, which gives the same bits).
//!
//! Sixteen keys at a time: for each 32-value block, the sixteen keys' bytes are transposed so
//! that 32-bit lane `j` of vector `c` holds bytes `4c..4c+4` of key `j` (three rounds of
//! two-source permutes, 24 per block, shared by every query row). Then one `vpdpbusd` per four
//! dimensions and query part (`hi`, `lo`) multiplies a query row's four bytes, broadcast, into
//! all sixteen keys at once: sixty-four multiply-adds per instruction, against sixteen for an
//! f32 FMA, and no decoding of the keys to f32 at all. `vpdpbusd` multiplies unsigned by signed
//! bytes, so the keys are offset by 128 (an exclusive-or of the sign bit) and the offset's
//! share, computed once per call, is subtracted: the integer dots are exact either way.

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::kernel::TileKernel;
use super::q8_keys::{BLOCK_BYTES, KeyRows, QuantQueries};
use crate::cpu::{Avx512, Avx512Vnni};
use crate::kv::Q8_0_BLOCK;

// The transpose's permutes. Before round 1, vector p holds keys 2p (lanes 0..8) and 2p+1
// (lanes 8..16), lane = dword of the block. Each round swaps one bit of the vector index with
// one bit of the lane index (indices 16.. take the second source); after round 3 vector c
// holds dword c of the sixteen keys in key order. Derived by tracking every (key, dword) through
// the three layouts; `transposes_sixteen_keys` checks the result against plain indexing.
const EVEN1: [i32; 16] = [0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30];
const ODD1: [i32; 16] = [1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31];
const EVEN2: [i32; 16] = [0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29];
const ODD2: [i32; 16] = [2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31];
const EVEN3: [i32; 16] = [0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27];
const ODD3: [i32; 16] = [4, 12, 5, 13, 6, 14, 7, 15, 20, 28, 21, 29, 22, 30, 23, 31];

/// The bytes of block `b` of sixteen keys (`ptrs`), each offset by 128 and transposed: lane `j`
/// of vector `c` is bytes `4c..4c+4` of key `j`.
///
/// # Safety
/// Every pointer has `(b + 1) * BLOCK_BYTES` readable bytes.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn transposed_block(ptrs: &[*const u8; 16], b: usize) -> [__m512i; 8] {
    let at = b * BLOCK_BYTES + 2;
    let sign = _mm512_set1_epi32(0x8080_8080u32 as i32);
    // SAFETY: forwarded; the loads are 32 bytes at `at`, inside each key's block `b`.
    unsafe {
        let z: [__m512i; 8] = std::array::from_fn(|p| {
            let lo = _mm256_loadu_si256(ptrs[2 * p].add(at).cast());
            let hi = _mm256_loadu_si256(ptrs[2 * p + 1].add(at).cast());
            _mm512_xor_si512(
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi),
                sign,
            )
        });
        let idx = |a: &[i32; 16]| _mm512_loadu_si512(a.as_ptr().cast());
        let (e1, o1) = (idx(&EVEN1), idx(&ODD1));
        let y: [__m512i; 8] = std::array::from_fn(|o| {
            let (a, b) = (z[o & !1], z[o | 1]);
            _mm512_permutex2var_epi32(a, if o & 1 == 0 { e1 } else { o1 }, b)
        });
        let (e2, o2) = (idx(&EVEN2), idx(&ODD2));
        let x: [__m512i; 8] = std::array::from_fn(|o| {
            // Vectors o and o^2 pair up; the lower of each pair takes the even lanes.
            let base = (o & 4) | (o & 1);
            let (a, b) = (y[base], y[base | 2]);
            _mm512_permutex2var_epi32(a, if o & 2 == 0 { e2 } else { o2 }, b)
        });
        let (e3, o3) = (idx(&EVEN3), idx(&ODD3));
        std::array::from_fn(|o| {
            let (a, b) = (x[o & 3], x[(o & 3) | 4]);
            _mm512_permutex2var_epi32(a, if o & 4 == 0 { e3 } else { o3 }, b)
        })
    }
}

/// `s[i][j] = score(query row0 + i, key j)` for `R` rows and keys `0..jn` of `keys`, into `s`
/// (`R x bc`), with the bits of `q8_keys::scores`. Sixteen keys per
/// round; columns past `jn` up to the next multiple of 16 (or the tile's end) hold scores of
/// whatever key stands in for them and must be ignored. Each round of keys reports to `ahead`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,avx2")]
pub(super) fn scores_q8<const R: usize>(
    _: Avx512Vnni,
    qq: &QuantQueries,
    row0: usize,
    hd: usize,
    keys: &KeyRows,
    jn: usize,
    bc: usize,
    s: &mut [f32],
    ahead: &mut Ahead,
) {
    let nb = hd / Q8_0_BLOCK;
    assert!(
        hd.is_multiple_of(Q8_0_BLOCK)
            && keys.head_bytes() == nb * BLOCK_BYTES
            && (1..=keys.len().min(bc)).contains(&jn)
            && s.len() >= R * bc
            && qq.hi.len() >= (row0 + R) * hd
            && qq.lo.len() >= (row0 + R) * hd
            && qq.scales.len() >= (row0 + R) * nb
            && qq.offsets.len() >= (row0 + R) * nb,
        "q8 scores: shapes"
    );
    // The next tile's keys, a tile on where it continues this one (`Ahead::leads`): each
    // round asks for its keys' lines that far ahead, into L2, as the column scores do
    // (`kernels_columns::score_segments`); the hardware prefetchers alone fall behind from
    // memory.
    let lead = ahead.leads()[0];
    let mut j = 0;
    // SAFETY: every key pointer is one of keys 0..jn, each a whole stored head; query
    // reads are inside rows row0..row0+R of `qq` (checked); stores are masked to row i's `bc`
    // columns of `s`.
    unsafe {
        while j < jn {
            // Keys past `jn` repeat key j: real bytes, scores to be ignored.
            let ptrs: [*const u8; 16] =
                std::array::from_fn(|t| keys.ptr(if j + t < jn { j + t } else { j }));
            ahead.advance(16.min(jn - j));
            if lead > 0 {
                super::kernels_avx2::hint_lines::<_MM_HINT_T1>(
                    ptrs[0].wrapping_add(lead),
                    16.min(jn - j) * keys.head_bytes(),
                );
            }
            let mut acc = [_mm512_setzero_ps(); R];
            for b in 0..nb {
                let mut sc = [0u16; 16];
                for (x, p) in sc.iter_mut().zip(&ptrs) {
                    *x = u16::from_le_bytes([*p.add(b * BLOCK_BYTES), *p.add(b * BLOCK_BYTES + 1)]);
                }
                let ks = _mm512_cvtph_ps(_mm256_loadu_si256(sc.as_ptr().cast()));
                let t = transposed_block(&ptrs, b);
                for (i, a) in acc.iter_mut().enumerate() {
                    let r = row0 + i;
                    let at = r * hd + b * Q8_0_BLOCK;
                    let (hi, lo) = (qq.hi.as_ptr().add(at), qq.lo.as_ptr().add(at));
                    let (mut dh, mut dl) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                    for (c, tc) in t.iter().enumerate() {
                        let h = std::ptr::read_unaligned(hi.add(4 * c).cast::<i32>());
                        let l = std::ptr::read_unaligned(lo.add(4 * c).cast::<i32>());
                        dh = _mm512_dpbusd_epi32(dh, *tc, _mm512_set1_epi32(h));
                        dl = _mm512_dpbusd_epi32(dl, *tc, _mm512_set1_epi32(l));
                    }
                    // 128 hi.k + lo.k, each with its 128-offset, less the offsets' sum.
                    let d = _mm512_sub_epi32(
                        _mm512_add_epi32(_mm512_slli_epi32::<7>(dh), dl),
                        _mm512_set1_epi32(qq.offsets[r * nb + b]),
                    );
                    let w = _mm512_mul_ps(_mm512_set1_ps(qq.scales[r * nb + b]), ks);
                    *a = _mm512_add_ps(*a, _mm512_mul_ps(_mm512_cvtepi32_ps(d), w));
                }
            }
            let mask = ((1u32 << (bc - j).min(16)) - 1) as __mmask16;
            for (i, a) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(s.as_mut_ptr().add(i * bc + j), mask, *a);
            }
            j += 16;
        }
    }
}

/// The VNNI level of the tile loop: the AVX-512 level's operations, with the integer scores
/// against a Q8_0 key cache taken by the kernel above.
impl TileKernel for Avx512Vnni {
    type Below = Avx512;

    #[inline(always)]
    fn below(self) -> Avx512 {
        self.avx512()
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
        ahead: &mut Ahead,
    ) {
        // SAFETY: the token proves the kernel's features.
        unsafe { scores_q8::<R>(self, qq, row0, hd, keys, jn, bc, s, ahead) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::q8_keys;

    #[test]
    fn transposes_sixteen_keys() {
        if crate::cpu::token_for_test::<Avx512Vnni>("transposes_sixteen_keys").is_none() {
            return;
        }
        let rows: Vec<Vec<u8>> = (0..16)
            .map(|j| {
                (0..BLOCK_BYTES * 2)
                    .map(|x| (j * 7 + x * 13) as u8)
                    .collect()
            })
            .collect();
        let ptrs: [*const u8; 16] = std::array::from_fn(|j| rows[j].as_ptr());
        for b in 0..2 {
            // SAFETY: the token proves AVX-512 F; every row has two blocks.
            let t = unsafe { transposed_block(&ptrs, b) };
            for (c, tc) in t.iter().enumerate() {
                let mut lanes = [0u8; 64];
                // SAFETY: 64 bytes into a 64-byte array.
                unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), *tc) };
                for j in 0..16 {
                    for e in 0..4 {
                        let want = rows[j][b * BLOCK_BYTES + 2 + 4 * c + e] ^ 0x80;
                        assert_eq!(lanes[4 * j + e], want, "block {b} dword {c} key {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn vnni_scores_have_the_portable_bits() {
        let Some(t) =
            crate::cpu::token_for_test::<Avx512Vnni>("vnni_scores_have_the_portable_bits")
        else {
            return;
        };
        q8_keys::check_kernel_bits(
            5,
            // SAFETY: the token proves the kernel's features.
            &|qq, r, hd, k, jn, bc, s, a| unsafe { scores_q8::<4>(t, qq, r, hd, k, jn, bc, s, a) },
            // SAFETY: as above.
            &|qq, r, hd, k, jn, bc, s, a| unsafe { scores_q8::<3>(t, qq, r, hd, k, jn, bc, s, a) },
        );
    }
}
