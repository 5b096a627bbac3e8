//! Two-token integer kernels (AVX-512 VNNI): each unit's unpacked weights widened to 512 bits
//! so one instruction serves a pair of tokens (see [`dot_pairs_vnni`]), for the unsigned-code
//! formats and for Q8_0 against 15-bit activations. They reuse the one-token kernels' unpacking
//! (`x86_int8`) and give each token the same bits.

use std::arch::x86_64::*;

use super::x86_int8::{add_fifth_bits, byte_scales, halves, nibbles};
use crate::cpu::Avx512Vnni;
use crate::quant::GgmlType;
use crate::quant::act::{PairRow, Q8Row, WidePairRow, WideRow};
use crate::quant::packed::{GROUP, layout};

/// The formats [`dot_pairs_vnni`] handles: unsigned codes plus a per-row offset, so no sign has
/// to move onto the activations (AVX-512 has no `vpsignb`).
pub fn pairs_supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q4_K
    )
}

/// Dot products of one packed group of eight rows with `P` pairs of tokens, two tokens per
/// 512-bit instruction: each unit's eight weight vectors are widened once to sixteen lanes,
/// every row twice (lane `2r + j` = row `r` for token `j` of the pair), and meet the pair's
/// interleaved activation bytes broadcast as one 64-bit value (`act::PairActs`). Each lane
/// runs exactly the float operations of the one-token kernel in the same order (integer sums
/// are exact), so a token's outputs are the same bits whichever kernel computed them. An odd
/// token (`tail`) rides on the same unpacked weights through the one-token kernel's 256-bit
/// operations, so a pass over an odd number of tokens unpacks each unit once and computes no
/// padding lane.
///
/// # Safety
/// `group` holds a whole packed group of `ty` (one of [`pairs_supported`]) covering the
/// pairs' `qs.len() / 2` elements, which equal the tail's `qs.len()` (the same for all pairs, a
/// multiple of the layout's span).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot_pairs_vnni<const P: usize>(
    _: Avx512Vnni,
    ty: GgmlType,
    group: &[u8],
    xs: &[PairRow; P],
    out: &mut [[[f32; GROUP]; 2]; P],
    tail: Option<(Q8Row, &mut [f32; GROUP])>,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match ty {
            GgmlType::Q4_0 => pairs_inner::<P, 0>(group, xs, out, tail),
            GgmlType::Q4_1 => pairs_inner::<P, 1>(group, xs, out, tail),
            GgmlType::Q5_0 => pairs_inner::<P, 2>(group, xs, out, tail),
            GgmlType::Q5_1 => pairs_inner::<P, 3>(group, xs, out, tail),
            GgmlType::Q4_K => pairs_inner::<P, 4>(group, xs, out, tail),
            _ => unreachable!("{ty} is not a pair-kernel format"),
        }
    }
}

const PAIR_KINDS: [GgmlType; 5] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
];

/// [`dot_pairs_vnni`] for the format `PAIR_KINDS[K]`.
///
/// # Safety
/// As for [`dot_pairs_vnni`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn pairs_inner<const P: usize, const K: usize>(
    group: &[u8],
    xs: &[PairRow; P],
    out: &mut [[[f32; GROUP]; 2]; P],
    mut tail: Option<(Q8Row, &mut [f32; GROUP])>,
) {
    let ty = PAIR_KINDS[K];
    let l = layout(ty).expect("packed type");
    let col = l.column_bytes();
    let units = l.units();
    let ncols = xs[0].qs.len() / 2 / l.span;
    debug_assert!(group.len() >= ncols * col);
    // Lane j takes element j / 2: every row (or scale) twice, once per token of the pair.
    let dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    let widen_i = |v: __m256i| _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(v));
    let widen_f = |v: __m256| _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(v));
    let mut acc = [_mm512_setzero_ps(); P];
    let mut offset = [_mm512_setzero_ps(); P];
    // The odd token's accumulators (the one-token kernel's, on the unwidened weights).
    let (mut acc1, mut offset1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    // SAFETY: (whole body) as in the one-token kernel; activation block b of a pair spans 64
    // bytes at 64b of its `qs`, and its `d` and `s` hold two entries per block; the odd
    // token's block b spans 32 bytes at 32b of its `qs`, with one `d` and `s` per block.
    unsafe {
        let base = group.as_ptr();
        for c in 0..ncols {
            let blk = base.add(c * col);
            let d8 = halves(blk);
            let m8 = match ty {
                GgmlType::Q4_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-8.0)),
                GgmlType::Q5_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-16.0)),
                _ => halves(blk.add(16)),
            };
            for u in 0..units {
                let data = blk.add(l.head + u * l.unit);
                let b = c * units + u;
                let mut w = nibbles(data);
                if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
                    add_fifth_bits(&mut w, data.add(128));
                }
                let (sc, mn) = match ty {
                    GgmlType::Q4_K => (
                        _mm256_mul_ps(d8, byte_scales(blk.add(32 + 8 * u), false)),
                        _mm256_mul_ps(m8, byte_scales(blk.add(96 + 8 * u), false)),
                    ),
                    _ => (d8, m8),
                };
                let wz: [__m512i; 8] = std::array::from_fn(|i| widen_i(w[i]));
                let (scz, mnz) = (widen_f(sc), widen_f(mn));
                for p in 0..P {
                    let xp = xs[p].qs.as_ptr().add(64 * b);
                    let mut isum = [_mm512_setzero_si512(); 2];
                    for i in 0..8 {
                        let xa = _mm512_set1_epi64(std::ptr::read_unaligned(
                            xp.add(8 * i) as *const i64
                        ));
                        isum[i / 4] = _mm512_dpbusd_epi32(isum[i / 4], wz[i], xa);
                    }
                    let pair = |v: &[f32]| {
                        _mm512_castpd_ps(_mm512_set1_pd(std::ptr::read_unaligned(
                            v.as_ptr().add(2 * b) as *const f64,
                        )))
                    };
                    let isum = _mm512_add_epi32(isum[0], isum[1]);
                    acc[p] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(isum),
                        _mm512_mul_ps(scz, pair(xs[p].d)),
                        acc[p],
                    );
                    let s = pair(xs[p].s);
                    offset[p] = if ty == GgmlType::Q4_K {
                        _mm512_fnmadd_ps(mnz, s, offset[p])
                    } else {
                        _mm512_fmadd_ps(mnz, s, offset[p])
                    };
                }
                // The odd token: exactly the one-token VNNI kernel's operations for this unit.
                if let Some((x1, _)) = &tail {
                    let xp = x1.qs.as_ptr().add(32 * b);
                    let mut isum = [_mm256_setzero_si256(); 2];
                    for (i, &wi) in w.iter().enumerate() {
                        let xa = _mm256_set1_epi32(std::ptr::read_unaligned(
                            xp.add(4 * i) as *const i32
                        ));
                        isum[i / 4] = _mm256_dpbusd_epi32(isum[i / 4], wi, xa);
                    }
                    let dx = _mm256_set1_ps(*x1.d.get_unchecked(b));
                    let isum = _mm256_add_epi32(isum[0], isum[1]);
                    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, dx), acc1);
                    let s = _mm256_set1_ps(*x1.s.get_unchecked(b));
                    offset1 = if ty == GgmlType::Q4_K {
                        _mm256_fnmadd_ps(mn, s, offset1)
                    } else {
                        _mm256_fmadd_ps(mn, s, offset1)
                    };
                }
            }
        }
        for p in 0..P {
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_add_ps(acc[p], offset[p]));
            for r in 0..GROUP {
                out[p][0][r] = lanes[2 * r];
                out[p][1][r] = lanes[2 * r + 1];
            }
        }
        if let Some((_, o)) = tail.as_mut() {
            _mm256_storeu_ps(o.as_mut_ptr(), _mm256_add_ps(acc1, offset1));
        }
    }
}

/// [`dot_pairs_vnni`] for 15-bit activations against Q8_0 rows (the output head): the biased
/// one-token wide kernel's arithmetic (`(w + 128)` against both byte planes, `128 * sum(q)`
/// taken off), two tokens per instruction, and an odd `tail` token on that kernel's 256-bit
/// operations. The same bits per token as that kernel.
///
/// # Safety
/// `group` holds a whole packed Q8_0 group covering the pairs' `hi.len() / 2` elements, which
/// equal the tail's `hi.len()` (the same for all pairs, a multiple of 32).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot_wide_pairs_vnni<const P: usize>(
    _: Avx512Vnni,
    group: &[u8],
    xs: &[WidePairRow; P],
    out: &mut [[[f32; GROUP]; 2]; P],
    mut tail: Option<(WideRow, &mut [f32; GROUP])>,
) {
    let l = layout(GgmlType::Q8_0).expect("packed type");
    let col = l.column_bytes();
    let ncols = xs[0].hi.len() / 64;
    debug_assert!(group.len() >= ncols * col);
    let dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    let mut acc = [_mm512_setzero_ps(); P];
    let mut acc1 = _mm256_setzero_ps();
    // SAFETY: (whole body) column c spans base + c*col inside `group`; activation block c of
    // a pair spans 64 bytes at 64c of `hi` and `lo`, and `d` and `qsum` hold two entries per
    // block; the odd token's block c spans 32 bytes at 32c, one `d` and `qsum` per block.
    unsafe {
        let base = group.as_ptr();
        for c in 0..ncols {
            let blk = base.add(c * col);
            let d8y = halves(blk);
            let d8 = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(d8y));
            let data = blk.add(l.head);
            let wb: [__m256i; 8] = std::array::from_fn(|i| {
                let w = _mm256_loadu_si256(data.add(32 * i) as *const __m256i);
                _mm256_xor_si256(w, _mm256_set1_epi8(-128))
            });
            let wu: [__m512i; 8] = std::array::from_fn(|i| {
                _mm512_permutexvar_epi32(dup, _mm512_castsi256_si512(wb[i]))
            });
            for p in 0..P {
                let hp = xs[p].hi.as_ptr().add(64 * c);
                let lp = xs[p].lo.as_ptr().add(64 * c);
                let mut ih = _mm512_setzero_si512();
                let mut il = _mm512_setzero_si512();
                for (i, &wi) in wu.iter().enumerate() {
                    let h =
                        _mm512_set1_epi64(std::ptr::read_unaligned(hp.add(8 * i) as *const i64));
                    let lo =
                        _mm512_set1_epi64(std::ptr::read_unaligned(lp.add(8 * i) as *const i64));
                    ih = _mm512_dpbusd_epi32(ih, wi, h);
                    il = _mm512_dpbusd_epi32(il, wi, lo);
                }
                let mut isum = _mm512_add_epi32(_mm512_slli_epi32(ih, 7), il);
                let qsum = _mm512_set1_epi64(std::ptr::read_unaligned(
                    xs[p].qsum.as_ptr().add(2 * c) as *const i64,
                ));
                isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(qsum, 7));
                let dx = _mm512_castpd_ps(_mm512_set1_pd(std::ptr::read_unaligned(
                    xs[p].d.as_ptr().add(2 * c) as *const f64,
                )));
                acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d8, dx), acc[p]);
            }
            // The odd token: the biased one-token wide kernel's operations for this column.
            if let Some((x1, _)) = &tail {
                let hp = x1.hi.as_ptr().add(32 * c);
                let lp = x1.lo.as_ptr().add(32 * c);
                let mut ih = _mm256_setzero_si256();
                let mut il = _mm256_setzero_si256();
                for (i, &wi) in wb.iter().enumerate() {
                    let h =
                        _mm256_set1_epi32(std::ptr::read_unaligned(hp.add(4 * i) as *const i32));
                    let lo =
                        _mm256_set1_epi32(std::ptr::read_unaligned(lp.add(4 * i) as *const i32));
                    ih = _mm256_dpbusd_epi32(ih, wi, h);
                    il = _mm256_dpbusd_epi32(il, wi, lo);
                }
                let mut isum = _mm256_add_epi32(_mm256_slli_epi32(ih, 7), il);
                let bias = 128 * *x1.qsum.get_unchecked(c);
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(bias));
                let dx = _mm256_set1_ps(*x1.d.get_unchecked(c));
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8y, dx), acc1);
            }
        }
        for p in 0..P {
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), acc[p]);
            for r in 0..GROUP {
                out[p][0][r] = lanes[2 * r];
                out[p][1][r] = lanes[2 * r + 1];
            }
        }
        if let Some((_, o)) = tail.as_mut() {
            _mm256_storeu_ps(o.as_mut_ptr(), acc1);
        }
    }
}
