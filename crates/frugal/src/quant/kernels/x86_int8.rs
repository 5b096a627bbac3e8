//! Integer dot products of packed block-quantized weights (see `quant::packed`) with 8-bit
//! activations (x86), for every block format.
//!
//! Each i32 lane accumulates one of the group's eight rows. Per 32-element unit the weights are
//! unpacked in registers into eight vectors `w[i]` (elements 4i..4i+4 of the eight rows): nibbles
//! masked out of four loads, plus the fifth bit (Q5) or top two bits (Q6_K) shifted into place,
//! or looked up (MXFP4's E2M1 codes). Each `w[i]` meets four activation bytes broadcast to all
//! lanes; the eight integer sums are converted once and scaled by the eight rows' scales times
//! `dx`. Unsigned weights use the u8 x i8 product directly and add a per-format offset times the
//! activation block sum `s` (Q4_0's -8d, Q5_0's -16d, the Q4_1/Q5_1 minimum, Q4_K's -dmin*m);
//! signed weights (Q8_0, MXFP4, Q6_K) go through `|w| * (x * sign(w))`. The u8 x i8 step is
//! `maddubs + madd` on AVX2 and a single `vpdpbusd` with AVX-512 VNNI; one macro writes both so
//! they cannot drift apart. Only the AVX2 kernels hint the weights' lines ahead
//! ([`prefetch_lines`]).

use std::arch::x86_64::*;

use super::avx2::PREFETCH;
use crate::quant::GgmlType;
use crate::quant::act::{PairRow, Q8Row, WidePairRow, WideRow};
use crate::quant::packed::{GROUP, layout};
use crate::quant::unit::{FORMATS, MXFP4_INT};

#[target_feature(enable = "avx2")]
#[inline]
fn udot_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
    )
}

#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
fn udot_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

/// The eight weight vectors of a 4-bit unit: `w[2c]` the low nibbles of chunk c (elements
/// 8c..8c+4), `w[2c+1]` the high nibbles (elements 8c+4..8c+8).
///
/// # Safety
/// `data` points at 128 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn nibbles(data: *const u8) -> [__m256i; 8] {
    let mask = _mm256_set1_epi8(0x0f);
    // SAFETY: the caller guarantees 4 x 32 readable bytes.
    let raw: [__m256i; 4] =
        std::array::from_fn(|c| unsafe { _mm256_loadu_si256(data.add(32 * c) as *const __m256i) });
    std::array::from_fn(|i| {
        let v = raw[i / 2];
        if i % 2 == 0 {
            _mm256_and_si256(v, mask)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(v, 4), mask)
        }
    })
}

/// Moves bit `from` of every byte of `h` to bit `to` (and leaves other bits to be masked).
#[target_feature(enable = "avx2")]
#[inline]
fn move_bits(h: __m256i, from: i32, to: i32) -> __m256i {
    // 16-bit shifts: bits crossing into the neighbouring byte land outside the mask.
    if to >= from {
        _mm256_sll_epi16(h, _mm_cvtsi32_si128(to - from))
    } else {
        _mm256_srl_epi16(h, _mm_cvtsi32_si128(from - to))
    }
}

/// Adds Q5's fifth bits (32 bytes at `hi`: byte j of each row word, bit i = element 4i+j).
///
/// # Safety
/// `hi` points at 32 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn add_fifth_bits(w: &mut [__m256i; 8], hi: *const u8) {
    // SAFETY: the caller guarantees 32 readable bytes.
    let h = unsafe { _mm256_loadu_si256(hi as *const __m256i) };
    let bit4 = _mm256_set1_epi8(0x10);
    for (i, wi) in w.iter_mut().enumerate() {
        *wi = _mm256_or_si256(*wi, _mm256_and_si256(move_bits(h, i as i32, 4), bit4));
    }
}

/// Adds Q6_K's top bit pairs (2 x 32 bytes at `hi`: in word k, byte j bits 2i..2i+2 = element
/// 4(4k+i)+j) and recentres the 6-bit codes to signed `code - 32`.
///
/// # Safety
/// `hi` points at 64 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn add_top_pairs(w: &mut [__m256i; 8], hi: *const u8) {
    // SAFETY: the caller guarantees 64 readable bytes.
    let h: [__m256i; 2] =
        std::array::from_fn(|k| unsafe { _mm256_loadu_si256(hi.add(32 * k) as *const __m256i) });
    let bits45 = _mm256_set1_epi8(0x30);
    let bias = _mm256_set1_epi8(32);
    for (i, wi) in w.iter_mut().enumerate() {
        let top = _mm256_and_si256(move_bits(h[i / 4], 2 * (i % 4) as i32, 4), bits45);
        *wi = _mm256_sub_epi8(_mm256_or_si256(*wi, top), bias);
    }
}

/// Eight rows' E8M0 scales (8 bytes at `e`) as f32 halves, 2^(e-127) / 2, exact for every e
/// (e = 0 gives the subnormal 2^-128 through the floor of the bit pattern).
///
/// # Safety
/// `e` points at 8 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn e8m0_halves(e: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 8 readable bytes.
    let bytes = unsafe { _mm_loadl_epi64(e as *const __m128i) };
    let bits = _mm256_slli_epi32(_mm256_cvtepu8_epi32(bytes), 23);
    let bits = _mm256_max_epi32(bits, _mm256_set1_epi32(0x0040_0000));
    _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5))
}

/// Eight unsigned (or, with `signed`, signed) byte scales at `p` as f32.
///
/// # Safety
/// `p` points at 8 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn byte_scales(p: *const u8, signed: bool) -> __m256 {
    // SAFETY: the caller guarantees 8 readable bytes.
    let bytes = unsafe { _mm_loadl_epi64(p as *const __m128i) };
    _mm256_cvtepi32_ps(if signed {
        _mm256_cvtepi8_epi32(bytes)
    } else {
        _mm256_cvtepu8_epi32(bytes)
    })
}

/// Eight rows' f16 values at `p` as f32.
///
/// # Safety
/// `p` points at 16 readable bytes.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn halves(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 16 readable bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

/// Prefetch hints for every cache line that `[p, p + len)` touches, `PREFETCH` bytes ahead
/// (never fault). Callers walk a group's bytes as consecutive ranges, so every line of the
/// stream is asked for: a hint per 64 bytes from a range's start (as this used to be, per
/// unit and skipping the column headers) left one line in five of a Q4_1 group to a demand
/// miss, and a decode step stalled on those loads.
///
/// Only the AVX2 kernels ask (measured on Zen 2, where they gained 4-11%). On Zen 4 the VNNI
/// kernels run faster with no hints at all, the hardware prefetchers alone streaming the
/// weights (same-process A/B, SmolLM2 Q4_1, 2 threads, median ms a token; the cache at
/// depth 4,096 f16): decode at depth 0 2.69-3.42 against 3.10-3.49 with these hints (1 thread:
/// 3.39 against 4.17), at depth 4,096 6.47-6.53 against 6.99 (1 thread: 10.8 against 11.7),
/// prefill of 512 tokens 4% faster. Hints into L2 (`T1`, `T2`) fell between the two.
#[target_feature(enable = "avx2")]
#[inline]
fn prefetch_lines(p: *const u8, len: usize) {
    let ahead = p.wrapping_add(PREFETCH);
    let skew = ahead as usize % 64;
    let mut at = 0;
    while at < skew + len {
        _mm_prefetch(
            ahead.wrapping_sub(skew).wrapping_add(at) as *const i8,
            _MM_HINT_T0,
        );
        at += 64;
    }
}

/// The bytes of column `blk` (`col` bytes, `units` units) whose lines unit `u` asks for: an
/// even share, so a column of many units (Q4_K, Q6_K) is not asked for in one burst.
#[inline]
fn unit_share(blk: *const u8, col: usize, units: usize, u: usize) -> (*const u8, usize) {
    let (a, b) = (u * col / units, (u + 1) * col / units);
    (blk.wrapping_add(a), b - a)
}

/// The packed formats, indexed by the kernels' const parameter so each format gets its own
/// compiled loop (every `ty == ...` below folds to a constant).
const KINDS: [GgmlType; 8] = FORMATS;

macro_rules! dot_packed_kernel {
    (
        $name:ident,
        $inner:ident,
        $wide:ident,
        $features:literal,
        $udot:ident,
        $biased:literal,
        $prefetch:literal
    ) => {
        /// Dot products of one packed group of eight Q8_0 rows with `T` rows of 15-bit
        /// activations `q = 128 hi + lo` (`act::WideActs`): with VNNI two byte products per four
        /// elements, `(w + 128) * hi` and `(w + 128) * lo`, then `128 * hi_sum + lo_sum` less
        /// `128 * sum(q)`; with AVX2 one word product per two elements, `w * q`. Exact in i32
        /// either way, so the same sums.
        ///
        /// # Safety
        /// `group` holds a whole packed Q8_0 group covering `xs[t].hi.len()` elements (equal for
        /// all t, a multiple of 32; `lo` and `d` to match), and the CPU has the features this
        /// kernel is compiled for.
        #[target_feature(enable = $features)]
        pub unsafe fn $wide<const T: usize>(
            group: &[u8],
            xs: &[WideRow; T],
            out: &mut [[f32; GROUP]; T],
        ) {
            let l = layout(GgmlType::Q8_0).expect("packed type");
            let col = l.column_bytes();
            let ncols = xs[0].hi.len() / 32;
            debug_assert!(group.len() >= ncols * col);
            let mut acc = [_mm256_setzero_ps(); T];
            // SAFETY (whole body): column c spans base + c*col .. base + (c+1)*col inside
            // `group`; activation block c spans 32 elements at 32c of each `hi`, `lo` and
            // `words`, and `d` and `qsum` hold ncols entries.
            unsafe {
                let base = group.as_ptr();
                for c in 0..ncols {
                    let blk = base.add(c * col);
                    let d8 = halves(blk);
                    let data = blk.add(l.head);
                    if $prefetch {
                        prefetch_lines(blk, col);
                    }
                    let w: [__m256i; 8] = std::array::from_fn(|i| {
                        _mm256_loadu_si256(data.add(32 * i) as *const __m256i)
                    });
                    // Biased (VNNI): the weights as unsigned w + 128 (a sign-bit flip), both
                    // activation planes as the signed operand, and 128 * sum(q) taken off at the
                    // end. AVX2's `maddubs` would saturate those 255 x 127 pairs, so there the
                    // weights are widened to words once per unit, and `madd` multiplies them by
                    // the integers `q` as words (`act::WideActs::words`): a pair is at most
                    // 2 x 128 x 16,256, and a lane's sixteen products stay below 2^26.
                    let wu: [__m256i; 8] =
                        std::array::from_fn(|i| _mm256_xor_si256(w[i], _mm256_set1_epi8(-128)));
                    // Words of rows 0..4 ([0]) and 4..8 ([1]), four elements each, of w[i].
                    // (`wu` serves the biased kernel, `ww` the other; `$biased` is a constant,
                    // so each compiled kernel keeps only its own.)
                    let ww: [[__m256i; 2]; 8] = std::array::from_fn(|i| {
                        [
                            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(w[i])),
                            _mm256_cvtepi8_epi16(_mm256_extracti128_si256::<1>(w[i])),
                        ]
                    });
                    let order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
                    for t in 0..T {
                        let isum = if $biased {
                            let hp = xs[t].hi.as_ptr().add(32 * c);
                            let lp = xs[t].lo.as_ptr().add(32 * c);
                            let mut ih = _mm256_setzero_si256();
                            let mut il = _mm256_setzero_si256();
                            for i in 0..8 {
                                let h = _mm256_set1_epi32(std::ptr::read_unaligned(
                                    hp.add(4 * i) as *const i32
                                ));
                                let lo = _mm256_set1_epi32(std::ptr::read_unaligned(
                                    lp.add(4 * i) as *const i32
                                ));
                                ih = $udot(ih, wu[i], h);
                                il = $udot(il, wu[i], lo);
                            }
                            let isum = _mm256_add_epi32(_mm256_slli_epi32(ih, 7), il);
                            let bias = 128 * *xs[t].qsum.get_unchecked(c);
                            _mm256_sub_epi32(isum, _mm256_set1_epi32(bias))
                        } else {
                            let qp = xs[t].words.as_ptr().add(32 * c);
                            let mut a = _mm256_setzero_si256();
                            let mut b = _mm256_setzero_si256();
                            for (i, [w0, w1]) in ww.iter().enumerate() {
                                // Elements 4i..4i+4 of the token, in every row's lanes.
                                let q = _mm256_set1_epi64x(std::ptr::read_unaligned(
                                    qp.add(4 * i) as *const i64
                                ));
                                a = _mm256_add_epi32(a, _mm256_madd_epi16(*w0, q));
                                b = _mm256_add_epi32(b, _mm256_madd_epi16(*w1, q));
                            }
                            // a: two lanes per row 0..4, b: per row 4..8; pairwise sums give
                            // rows 0, 1, 4, 5 | 2, 3, 6, 7, put in order.
                            _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a, b), order)
                        };
                        let dx = _mm256_set1_ps(*xs[t].d.get_unchecked(c));
                        acc[t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum),
                            _mm256_mul_ps(d8, dx),
                            acc[t],
                        );
                    }
                }
                for t in 0..T {
                    _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t]);
                }
            }
        }

        /// Dot products of one packed group of eight rows with `T` activation rows:
        /// `out[t][r] = dot(row r, xs[t])`. The unpacked weights of each unit are reused for
        /// all `T` tokens (prefill); decode uses `T = 1`.
        ///
        /// # Safety
        /// `group` holds a whole packed group of `ty` covering `xs[t].qs.len()` elements (equal
        /// for all t, a multiple of the layout's span), and the CPU has the features this kernel
        /// is compiled for.
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const T: usize>(
            ty: GgmlType,
            group: &[u8],
            xs: &[Q8Row; T],
            out: &mut [[f32; GROUP]; T],
        ) {
            // SAFETY: forwarded from the caller.
            unsafe {
                match KINDS.iter().position(|&k| k == ty) {
                    Some(0) => $inner::<T, 0>(group, xs, out),
                    Some(1) => $inner::<T, 1>(group, xs, out),
                    Some(2) => $inner::<T, 2>(group, xs, out),
                    Some(3) => $inner::<T, 3>(group, xs, out),
                    Some(4) => $inner::<T, 4>(group, xs, out),
                    Some(5) => $inner::<T, 5>(group, xs, out),
                    Some(6) => $inner::<T, 6>(group, xs, out),
                    Some(7) => $inner::<T, 7>(group, xs, out),
                    _ => unreachable!("{ty} has no packed layout"),
                }
            }
        }

        /// [`$name`] for the format `KINDS[K]`.
        ///
        /// # Safety
        /// As for the dispatcher.
        #[target_feature(enable = $features)]
        unsafe fn $inner<const T: usize, const K: usize>(
            group: &[u8],
            xs: &[Q8Row; T],
            out: &mut [[f32; GROUP]; T],
        ) {
            let ty = KINDS[K];
            let l = layout(ty).expect("packed type");
            let col = l.column_bytes();
            let units = l.units();
            let ncols = xs[0].qs.len() / l.span;
            debug_assert!(group.len() >= ncols * col);
            let signed = matches!(ty, GgmlType::Q8_0 | GgmlType::MXFP4 | GgmlType::Q6_K);
            // AVX2 with unsigned codes of at most 5 bits: `maddubs` pair sums (at most
            // 2 x 31 x 128 = 7,936, or 3,840 for 4 bits) are added in 16 bits, `short` (4, or 8
            // for 4-bit codes) at a time, before one widening `madd` (at most 31,744 or
            // 30,720 < 32,767: exact, so the sums and bits are those of widening each product).
            // 0: every product widened at once.
            let short = if $biased || signed || ty == GgmlType::Q6_K {
                0
            } else if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
                4
            } else {
                8
            };
            // SAFETY: MXFP4_INT is 16 bytes.
            let lut = _mm256_broadcastsi128_si256(unsafe {
                _mm_loadu_si128(MXFP4_INT.as_ptr() as *const __m128i)
            });
            let mut acc = [_mm256_setzero_ps(); T];
            let mut offset = [_mm256_setzero_ps(); T];
            // SAFETY (whole body): column c spans base + c*col .. base + (c+1)*col inside
            // `group`, its header the first l.head bytes and unit u the l.unit bytes at
            // l.head + u*l.unit; activation block b spans 32 bytes at 32b inside each
            // `xs[t].qs`, whose `d` and `s` hold ncols * units entries.
            unsafe {
                let base = group.as_ptr();
                for c in 0..ncols {
                    let blk = base.add(c * col);
                    // Per-column scales of the eight rows (per-unit ones are read below).
                    let d8 = match ty {
                        GgmlType::MXFP4 => e8m0_halves(blk),
                        _ => halves(blk),
                    };
                    let m8 = match ty {
                        GgmlType::Q4_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-8.0)),
                        GgmlType::Q5_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-16.0)),
                        // Q4_1/Q5_1's minimum; Q4_K's dmin.
                        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K => halves(blk.add(16)),
                        _ => _mm256_setzero_ps(),
                    };
                    for u in 0..units {
                        let data = blk.add(l.head + u * l.unit);
                        if $prefetch {
                            let (share, len) = unit_share(blk, col, units, u);
                            prefetch_lines(share, len);
                        }
                        let b = c * units + u;
                        let mut w = if ty == GgmlType::Q8_0 {
                            std::array::from_fn(|i| {
                                _mm256_loadu_si256(data.add(32 * i) as *const __m256i)
                            })
                        } else {
                            nibbles(data)
                        };
                        match ty {
                            GgmlType::Q5_0 | GgmlType::Q5_1 => {
                                add_fifth_bits(&mut w, data.add(128))
                            }
                            GgmlType::Q6_K => add_top_pairs(&mut w, data.add(128)),
                            GgmlType::MXFP4 => {
                                for wi in w.iter_mut() {
                                    *wi = _mm256_shuffle_epi8(lut, *wi);
                                }
                            }
                            _ => {}
                        }
                        // Signed weights: |w| as the unsigned operand, the sign moved onto x.
                        let wu: [__m256i; 8] = if signed {
                            std::array::from_fn(|i| _mm256_sign_epi8(w[i], w[i]))
                        } else {
                            w
                        };
                        // This unit's scales (per half for Q6_K) and offset factor.
                        let (sc_a, sc_b, mn) = match ty {
                            GgmlType::Q4_K => (
                                _mm256_mul_ps(d8, byte_scales(blk.add(32 + 8 * u), false)),
                                d8,
                                _mm256_mul_ps(m8, byte_scales(blk.add(96 + 8 * u), false)),
                            ),
                            GgmlType::Q6_K => (
                                _mm256_mul_ps(d8, byte_scales(blk.add(16 + 16 * u), true)),
                                _mm256_mul_ps(d8, byte_scales(blk.add(24 + 16 * u), true)),
                                m8,
                            ),
                            _ => (d8, d8, m8),
                        };
                        for t in 0..T {
                            let xp = xs[t].qs.as_ptr().add(32 * b);
                            let mut isum = [_mm256_setzero_si256(); 2];
                            let mut p16 = _mm256_setzero_si256();
                            for i in 0..8 {
                                let xa = _mm256_set1_epi32(std::ptr::read_unaligned(
                                    xp.add(4 * i) as *const i32
                                ));
                                let xa = if signed {
                                    _mm256_sign_epi8(xa, w[i])
                                } else {
                                    xa
                                };
                                if short == 0 {
                                    isum[i / 4] = $udot(isum[i / 4], wu[i], xa);
                                } else {
                                    p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(wu[i], xa));
                                    if (i + 1) % short == 0 {
                                        let wide = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
                                        isum[0] = _mm256_add_epi32(isum[0], wide);
                                        p16 = _mm256_setzero_si256();
                                    }
                                }
                            }
                            let dx = _mm256_set1_ps(*xs[t].d.get_unchecked(b));
                            if ty == GgmlType::Q6_K {
                                acc[t] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(isum[0]),
                                    _mm256_mul_ps(sc_a, dx),
                                    acc[t],
                                );
                                acc[t] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(isum[1]),
                                    _mm256_mul_ps(sc_b, dx),
                                    acc[t],
                                );
                            } else {
                                let isum = _mm256_add_epi32(isum[0], isum[1]);
                                acc[t] = _mm256_fmadd_ps(
                                    _mm256_cvtepi32_ps(isum),
                                    _mm256_mul_ps(sc_a, dx),
                                    acc[t],
                                );
                            }
                            if !signed {
                                let s = _mm256_set1_ps(*xs[t].s.get_unchecked(b));
                                if ty == GgmlType::Q4_K {
                                    offset[t] = _mm256_fnmadd_ps(mn, s, offset[t]);
                                } else {
                                    offset[t] = _mm256_fmadd_ps(mn, s, offset[t]);
                                }
                            }
                        }
                    }
                }
                for t in 0..T {
                    _mm256_storeu_ps(out[t].as_mut_ptr(), _mm256_add_ps(acc[t], offset[t]));
                }
            }
        }
    };
}

dot_packed_kernel!(
    dot_packed_avx2,
    avx2_kind,
    dot_wide_avx2,
    "avx2,fma,f16c",
    udot_avx2,
    false,
    true
);
dot_packed_kernel!(
    dot_packed_vnni,
    vnni_kind,
    dot_wide_vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    udot_vnni,
    true,
    false
);

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
/// multiple of the layout's span), and the CPU has AVX2, FMA, F16C and AVX-512 F, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot_pairs_vnni<const P: usize>(
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
    // SAFETY (whole body): as in the one-token kernel; activation block b of a pair spans 64
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
/// equal the tail's `hi.len()` (the same for all pairs, a multiple of 32), and the CPU has AVX2, FMA, F16C and AVX-512 F, VL, VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot_wide_pairs_vnni<const P: usize>(
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
    // SAFETY (whole body): column c spans base + c*col inside `group`; activation block c of
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
