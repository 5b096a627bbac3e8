//! The AVX2 kernel of integer scores against a Q8_0 key cache, for CPUs without AVX-512 VNNI
//! (see `q8_keys` for the arithmetic, and its portable twin, which gives the same bits).
//!
//! AVX2's byte multiply (`vpmaddubsw`) takes one unsigned operand and saturates its 16-bit pair
//! sums, so it cannot take a query part of up to 127 against a key offset into unsigned bytes.
//! Instead each query block is kept as sixteen-bit words `128 hi + lo` (at most 16,320 in size,
//! made once per call) and each key block is widened to words once per eight keys, shared by the
//! `R` rows: one `vpmaddwd` then multiplies sixteen pairs and adds them into eight 32-bit lanes,
//! exactly (a pair is at most 2 x 16,320 x 128). Lanes run along the head dimension, so a key's
//! block sum is a horizontal one: eight keys' lanes are reduced together by a tree of pairwise
//! additions (`vphaddd`), leaving key `t`'s block sum in lane `t`, one vector per eight keys, on
//! which the block's scales are applied in f32 as the portable twin applies them.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::ahead::Ahead;
use super::q8_keys::{BLOCK_BYTES, KeyRows, QuantQueries};
use crate::cpu::Avx2;
use crate::kv::Q8_0_BLOCK;

/// Keys per round: one 32-bit lane each in the reduced block sums.
const KEYS: usize = 8;

/// The most 32-value blocks a head may have here (a head dimension of 512): the widened keys of
/// one round live on the stack.
pub(super) const MAX_BLOCKS: usize = 16;

/// `s[i][j] = score(query row0 + i, key j)` for `R` rows and keys `0..jn` of `keys`, into `s`
/// (`R x bc`, `bc` a multiple of 8), with the bits of `q8_keys::scores`. Eight keys per round;
/// columns past `jn` up to the next multiple of 8 hold scores of whatever key stands in for
/// them and must be ignored. Each round of keys reports to `ahead`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn scores_q8<const R: usize>(
    _: Avx2,
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
            && (1..=MAX_BLOCKS).contains(&nb)
            && bc.is_multiple_of(KEYS)
            && keys.head_bytes() == nb * BLOCK_BYTES
            && (1..=keys.len().min(bc)).contains(&jn)
            && s.len() >= R * bc
            && qq.words.len() >= (row0 + R) * hd
            && qq.scales.len() >= (row0 + R) * nb,
        "q8 scores: shapes"
    );
    // Block b of key t as 32 words: wide[b][t] (two vectors), written for b < nb before it is
    // read. Left uninitialized: zeroing its 8 KiB on every call cost ~2% of a decode step.
    let mut wide = [[[MaybeUninit::<__m256i>::uninit(); 2]; KEYS]; MAX_BLOCKS];
    let mut j = 0;
    // SAFETY: every key pointer is one of keys 0..jn, each a whole stored head of `nb` blocks
    // (the loads are the 32 value bytes of block b < nb); `wide` is read only for blocks b < nb,
    // all written first in each round; query reads are inside rows
    // row0..row0+R of `qq` (checked); stores are s[i * bc + j..+8] with j + 8 <= bc.
    unsafe {
        while j < jn {
            // Keys past `jn` repeat key j: real bytes, scores to be ignored.
            let ptrs: [*const u8; KEYS] =
                std::array::from_fn(|t| keys.ptr(if j + t < jn { j + t } else { j }));
            ahead.advance(KEYS.min(jn - j));
            for (b, wb) in wide[..nb].iter_mut().enumerate() {
                for (w, p) in wb.iter_mut().zip(&ptrs) {
                    let at = p.add(b * BLOCK_BYTES + 2);
                    w[0].write(_mm256_cvtepi8_epi16(_mm_loadu_si128(at.cast())));
                    w[1].write(_mm256_cvtepi8_epi16(_mm_loadu_si128(at.add(16).cast())));
                }
            }
            let mut acc = [_mm256_setzero_ps(); R];
            for (b, wb) in wide[..nb].iter().enumerate() {
                let mut sc = [0u16; KEYS];
                for (x, p) in sc.iter_mut().zip(&ptrs) {
                    *x = u16::from_le_bytes([*p.add(b * BLOCK_BYTES), *p.add(b * BLOCK_BYTES + 1)]);
                }
                let ks = _mm256_cvtph_ps(_mm_loadu_si128(sc.as_ptr().cast()));
                for (i, a) in acc.iter_mut().enumerate() {
                    let r = row0 + i;
                    let qw = qq.words.as_ptr().add(r * hd + b * Q8_0_BLOCK);
                    let (q0, q1) = (
                        _mm256_loadu_si256(qw.cast()),
                        _mm256_loadu_si256(qw.add(16).cast()),
                    );
                    let part = |t: usize| {
                        let [k0, k1] = wb[t].map(|w| w.assume_init());
                        _mm256_add_epi32(_mm256_madd_epi16(k0, q0), _mm256_madd_epi16(k1, q1))
                    };
                    // Pairwise sums: after two rounds, the low half of `x` holds the four-lane
                    // sums of keys 0..4's low halves and its high half their high halves.
                    let x = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(part(0), part(1)),
                        _mm256_hadd_epi32(part(2), part(3)),
                    );
                    let y = _mm256_hadd_epi32(
                        _mm256_hadd_epi32(part(4), part(5)),
                        _mm256_hadd_epi32(part(6), part(7)),
                    );
                    let dot = _mm256_add_epi32(
                        _mm256_permute2x128_si256::<0x20>(x, y),
                        _mm256_permute2x128_si256::<0x31>(x, y),
                    );
                    let w = _mm256_mul_ps(_mm256_set1_ps(qq.scales[r * nb + b]), ks);
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(_mm256_cvtepi32_ps(dot), w));
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(s.as_mut_ptr().add(i * bc + j), *a);
            }
            j += KEYS;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::q8_keys;

    #[test]
    fn avx2_scores_have_the_portable_bits() {
        let Some(t) = crate::cpu::token_for_test::<Avx2>("avx2_scores_have_the_portable_bits")
        else {
            return;
        };
        q8_keys::check_kernel_bits(
            9,
            // SAFETY: the token proves the kernel's features.
            &|qq, r, hd, k, jn, bc, s, a| unsafe { scores_q8::<4>(t, qq, r, hd, k, jn, bc, s, a) },
            // SAFETY: as above.
            &|qq, r, hd, k, jn, bc, s, a| unsafe { scores_q8::<3>(t, qq, r, hd, k, jn, bc, s, a) },
        );
    }
}
