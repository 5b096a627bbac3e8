//! Integer dot products of packed block-quantized weights (see `quant::packed`) with 8-bit
//! activations (x86), for every block format.
//!
//! Each i32 lane accumulates one of the group's eight rows. Per 32-element unit the weights are
//! unpacked in registers into eight vectors `w[i]` (elements 4i..4i+4 of the eight rows): nibbles
//! masked out of four loads (bit pairs out of two for Q2_K and Q3_K), plus the fifth bit (Q5_0,
//! Q5_1, Q5_K), top two bits (Q6_K) or third bit (Q3_K) shifted into place, or looked up (MXFP4's
//! E2M1 codes, IQ4's table). Each `w[i]` meets four activation bytes broadcast to all lanes; the
//! eight integer sums (per half, for formats with a scale per 16) are converted once and scaled by
//! the eight rows' scales times `dx`. Unsigned weights use the u8 x i8 product directly and add a
//! per-format offset times the activation block sum `s` (Q4_0's -8d, Q5_0's -16d, the Q4_1/Q5_1
//! minimum, Q4_K's and Q5_K's -dmin*m; Q2_K's per half against `s16`); signed weights (Q8_0,
//! MXFP4, Q6_K, Q3_K, IQ4_NL, IQ4_XS) go through `|w| * (x * sign(w))`. The u8 x i8 step is
//! `maddubs + madd` on AVX2 and a single `vpdpbusd` with AVX-512 VNNI; one macro writes both so
//! they cannot drift apart. The AVX2 kernels hint the weights' lines ahead ([`prefetch_lines`]),
//! the VNNI kernels where the CPU gains from it ([`super::hint_weights`]).

use std::arch::x86_64::*;

use super::avx2::PREFETCH;
use crate::quant::GgmlType;
use crate::quant::act::{Q8Row, WideRow};
use crate::quant::iq4::KVALUES;
use crate::quant::packed::{GROUP, layout};
use crate::quant::unit::{FORMATS, MXFP4_INT, scale_per_half, signed_codes};

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
pub(super) unsafe fn nibbles(data: *const u8) -> [__m256i; 8] {
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
pub(super) unsafe fn add_fifth_bits(w: &mut [__m256i; 8], hi: *const u8) {
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

/// The eight weight vectors of a unit of bit pairs (Q2_K's codes, Q3_K's low bits): `w[4c+i]`
/// the pairs at bits 2i..2i+2 of chunk c (elements 4(4c+i)..4(4c+i)+4).
///
/// # Safety
/// `data` points at 64 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn crumbs(data: *const u8) -> [__m256i; 8] {
    let mask = _mm256_set1_epi8(3);
    // SAFETY: the caller guarantees 2 x 32 readable bytes.
    let raw: [__m256i; 2] =
        std::array::from_fn(|c| unsafe { _mm256_loadu_si256(data.add(32 * c) as *const __m256i) });
    std::array::from_fn(|i| _mm256_and_si256(move_bits(raw[i / 4], 2 * (i % 4) as i32, 0), mask))
}

/// Adds Q3_K's third bits (32 bytes at `hi`, arranged as Q5's fifth bits) and recentres the
/// 3-bit codes to signed `code - 4`.
///
/// # Safety
/// `hi` points at 32 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn add_third_bits(w: &mut [__m256i; 8], hi: *const u8) {
    // SAFETY: the caller guarantees 32 readable bytes.
    let h = unsafe { _mm256_loadu_si256(hi as *const __m256i) };
    let bit2 = _mm256_set1_epi8(0x04);
    let bias = _mm256_set1_epi8(4);
    for (i, wi) in w.iter_mut().enumerate() {
        let third = _mm256_and_si256(move_bits(h, i as i32, 2), bit2);
        *wi = _mm256_sub_epi8(_mm256_or_si256(*wi, third), bias);
    }
}

/// Eight rows' Q2_K scale bytes at `p` (scale in the low nibble, min in the high) as f32
/// `[scales, mins]`.
///
/// # Safety
/// `p` points at 8 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn nibble_scales(p: *const u8) -> [__m256; 2] {
    // SAFETY: the caller guarantees 8 readable bytes.
    let v = _mm256_cvtepu8_epi32(unsafe { _mm_loadl_epi64(p as *const __m128i) });
    [
        _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0f))),
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v)),
    ]
}

/// The 16 integers a 4-bit code stands for, broadcast to both lanes, for the formats that look
/// them up (MXFP4's E2M1 integers, IQ4's table; the others ignore it).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn code_table(ty: GgmlType) -> __m256i {
    let table: &[i8; 16] = if ty == GgmlType::MXFP4 {
        &MXFP4_INT
    } else {
        &KVALUES
    };
    // SAFETY: the table is 16 bytes.
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(table.as_ptr() as *const __m128i) })
}

/// A column's per-row scales for eight rows: `d` (f32), and the offset factor `m` the unit
/// scales build on (Q4_0's -8d, Q5_0's -16d, Q4_1/Q5_1's minimum, the K-quants' dmin; zero for
/// the signed formats).
///
/// # Safety
/// `blk` points at a whole packed column of `ty`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn column_scales(ty: GgmlType, blk: *const u8) -> (__m256, __m256) {
    // SAFETY: the header holds the scales read for `ty` (caller).
    unsafe {
        let d8 = match ty {
            GgmlType::MXFP4 => e8m0_halves(blk),
            _ => halves(blk),
        };
        let m8 = match ty {
            GgmlType::Q4_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-8.0)),
            GgmlType::Q5_0 => _mm256_mul_ps(d8, _mm256_set1_ps(-16.0)),
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q2_K => {
                halves(blk.add(16))
            }
            _ => _mm256_setzero_ps(),
        };
        (d8, m8)
    }
}

/// Unit `u`'s scales and offset factors for eight rows, per half (the two are equal for the
/// formats with one scale per unit): `[sc_a, sc_b, mn_a, mn_b]`, from the column's
/// [`column_scales`]. The offsets are taken as `+mn * s`, or `-mn * s` for the formats
/// [`offset_negated`].
///
/// # Safety
/// `blk` points at a whole packed column of `ty`, `u` one of its units.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn unit_scales(
    ty: GgmlType,
    blk: *const u8,
    d8: __m256,
    m8: __m256,
    u: usize,
) -> [__m256; 4] {
    // SAFETY: the header holds unit u's scales (caller).
    unsafe {
        match ty {
            GgmlType::Q4_K | GgmlType::Q5_K => {
                let sc = _mm256_mul_ps(d8, byte_scales(blk.add(32 + 8 * u), false));
                let mn = _mm256_mul_ps(m8, byte_scales(blk.add(96 + 8 * u), false));
                [sc, sc, mn, mn]
            }
            GgmlType::Q6_K | GgmlType::Q3_K => [
                _mm256_mul_ps(d8, byte_scales(blk.add(16 + 16 * u), true)),
                _mm256_mul_ps(d8, byte_scales(blk.add(24 + 16 * u), true)),
                m8,
                m8,
            ],
            GgmlType::Q2_K => {
                let [sa, ma] = nibble_scales(blk.add(32 + 16 * u));
                let [sb, mb] = nibble_scales(blk.add(40 + 16 * u));
                [
                    _mm256_mul_ps(d8, sa),
                    _mm256_mul_ps(d8, sb),
                    _mm256_mul_ps(m8, ma),
                    _mm256_mul_ps(m8, mb),
                ]
            }
            GgmlType::IQ4_XS => {
                let sc = _mm256_mul_ps(d8, byte_scales(blk.add(16 + 8 * u), true));
                [sc, sc, m8, m8]
            }
            _ => [d8, d8, m8, m8],
        }
    }
}

/// A unit's weights for eight rows as the integers the kernels multiply: `w[i]` = elements
/// `4i..4i+4` of the eight rows, unsigned codes for the formats with an offset, signed integers
/// for the others (Q6_K's `code - 32`, Q3_K's `code - 4`, the looked-up IQ4 and MXFP4 values,
/// Q8_0's bytes). `lut` is [`code_table`]`(ty)`.
///
/// # Safety
/// `data` points at the unit's `layout(ty).unit` packed bytes.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn unit_codes(ty: GgmlType, data: *const u8, lut: __m256i) -> [__m256i; 8] {
    // SAFETY: the unit's bytes are readable (caller).
    unsafe {
        let mut w = match ty {
            GgmlType::Q8_0 => {
                std::array::from_fn(|i| _mm256_loadu_si256(data.add(32 * i) as *const __m256i))
            }
            GgmlType::Q3_K | GgmlType::Q2_K => crumbs(data),
            _ => nibbles(data),
        };
        match ty {
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => {
                add_fifth_bits(&mut w, data.add(128))
            }
            GgmlType::Q6_K => add_top_pairs(&mut w, data.add(128)),
            GgmlType::Q3_K => add_third_bits(&mut w, data.add(64)),
            GgmlType::MXFP4 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => {
                for wi in w.iter_mut() {
                    *wi = _mm256_shuffle_epi8(lut, *wi);
                }
            }
            _ => {}
        }
        w
    }
}

/// Whether `ty`'s offsets are taken as `-mn * s` (mn = dmin * m, stored positive) rather than
/// `+mn * s`.
pub(super) fn offset_negated(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q2_K)
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
pub(super) unsafe fn byte_scales(p: *const u8, signed: bool) -> __m256 {
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
pub(super) unsafe fn halves(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 16 readable bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
}

/// Prefetch hints for every cache line that `[p, p + len)` touches, `PREFETCH` bytes ahead
/// (never fault). Callers walk a group's bytes as consecutive ranges, so every line of the
/// stream is asked for: a hint per 64 bytes from a range's start (as this used to be, per
/// unit and skipping the column headers) left one line in five of a Q4_1 group to a demand
/// miss, and a decode step stalled on those loads.
///
/// The AVX2 kernels always ask (measured on Zen 2, where they gained 4-11%); the VNNI kernels
/// ask where [`super::hint_weights`] says so. On Intel's AVX-512 Xeons they gain a third of
/// decode speed (same-run A/B, 2 threads: Llama-3.2-1B-shaped Q4_K_M 23.5-24.0 -> 32.3-33.3
/// tok/s, Q8_0 20.5-20.6 -> 21.3, SmolLM2 Q4_1 208-209 -> 263-268; prefill of 256 tokens 1%
/// faster). On Zen 4 the VNNI kernels run faster with no hints at all, the hardware prefetchers alone streaming the
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
const KINDS: [GgmlType; FORMATS.len()] = FORMATS;

macro_rules! dot_packed_kernel {
    (
        $name:ident,
        $inner:ident,
        $wide:ident,
        $features:literal,
        $token:ty,
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
        /// all t, a multiple of 32; `lo` and `d` to match).
        #[target_feature(enable = $features)]
        pub unsafe fn $wide<const T: usize>(
            _: $token,
            group: &[u8],
            xs: &[WideRow; T],
            out: &mut [[f32; GROUP]; T],
        ) {
            let l = layout(GgmlType::Q8_0).expect("packed type");
            let col = l.column_bytes();
            let ncols = xs[0].hi.len() / 32;
            debug_assert!(group.len() >= ncols * col);
            let mut acc = [_mm256_setzero_ps(); T];
            // SAFETY: (whole body) column c spans base + c*col .. base + (c+1)*col inside
            // `group`; activation block c spans 32 elements at 32c of each `hi`, `lo` and
            // `words`, and `d` and `qsum` hold ncols entries.
            unsafe {
                let base = group.as_ptr();
                let hints = $prefetch || super::hint_weights();
                for c in 0..ncols {
                    let blk = base.add(c * col);
                    let d8 = halves(blk);
                    let data = blk.add(l.head);
                    if hints {
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
        /// for all t, a multiple of the layout's span).
        #[target_feature(enable = $features)]
        pub unsafe fn $name<const T: usize>(
            _: $token,
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
                    Some(8) => $inner::<T, 8>(group, xs, out),
                    Some(9) => $inner::<T, 9>(group, xs, out),
                    Some(10) => $inner::<T, 10>(group, xs, out),
                    Some(11) => $inner::<T, 11>(group, xs, out),
                    Some(12) => $inner::<T, 12>(group, xs, out),
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
            let signed = signed_codes(ty);
            // Scales per half (16 elements): the two integer half sums are kept apart.
            let per_half = scale_per_half(ty);
            let negated = offset_negated(ty);
            // AVX2 with unsigned codes of at most 5 bits: `maddubs` pair sums (at most
            // 2 x 31 x 128 = 7,936, or 3,840 for 4 bits) are added in 16 bits, `short` (4, or 8
            // for 4-bit codes) at a time, before one widening `madd` (at most 31,744 or
            // 30,720 < 32,767: exact, so the sums and bits are those of widening each product)
            // into the half's sum (a `short` of 8 puts the whole unit in the second, for formats
            // that add the two). Q2_K's 2-bit codes take 4, so its halves stay apart.
            // 0: every product widened at once.
            let short = if $biased || signed || ty == GgmlType::Q6_K {
                0
            } else if matches!(
                ty,
                GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K | GgmlType::Q2_K
            ) {
                4
            } else {
                8
            };
            let lut = code_table(ty);
            let mut acc = [_mm256_setzero_ps(); T];
            let mut offset = [_mm256_setzero_ps(); T];
            // SAFETY: (whole body) column c spans base + c*col .. base + (c+1)*col inside
            // `group`, its header the first l.head bytes and unit u the l.unit bytes at
            // l.head + u*l.unit; activation block b spans 32 bytes at 32b inside each
            // `xs[t].qs`, whose `d` and `s` hold ncols * units entries and `s16` twice that.
            unsafe {
                let base = group.as_ptr();
                let hints = $prefetch || super::hint_weights();
                for c in 0..ncols {
                    let blk = base.add(c * col);
                    // Per-column scales of the eight rows (per-unit ones are read below).
                    let (d8, m8) = column_scales(ty, blk);
                    for u in 0..units {
                        let data = blk.add(l.head + u * l.unit);
                        if hints {
                            let (share, len) = unit_share(blk, col, units, u);
                            prefetch_lines(share, len);
                        }
                        let b = c * units + u;
                        let w = unit_codes(ty, data, lut);
                        // Signed weights: |w| as the unsigned operand, the sign moved onto x.
                        let wu: [__m256i; 8] = if signed {
                            std::array::from_fn(|i| _mm256_sign_epi8(w[i], w[i]))
                        } else {
                            w
                        };
                        // This unit's scales and offset factors, per half.
                        let [sc_a, sc_b, mn_a, mn_b] = unit_scales(ty, blk, d8, m8, u);
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
                                        isum[i / 4] = _mm256_add_epi32(isum[i / 4], wide);
                                        p16 = _mm256_setzero_si256();
                                    }
                                }
                            }
                            let dx = _mm256_set1_ps(*xs[t].d.get_unchecked(b));
                            if per_half {
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
                            if ty == GgmlType::Q2_K {
                                let s16 = xs[t].s16.as_ptr().add(2 * b);
                                let (sa, sb) = (_mm256_set1_ps(*s16), _mm256_set1_ps(*s16.add(1)));
                                offset[t] = _mm256_fnmadd_ps(mn_a, sa, offset[t]);
                                offset[t] = _mm256_fnmadd_ps(mn_b, sb, offset[t]);
                            } else if !signed {
                                let s = _mm256_set1_ps(*xs[t].s.get_unchecked(b));
                                if negated {
                                    offset[t] = _mm256_fnmadd_ps(mn_a, s, offset[t]);
                                } else {
                                    offset[t] = _mm256_fmadd_ps(mn_a, s, offset[t]);
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
    crate::cpu::Avx2,
    udot_avx2,
    false,
    true
);
dot_packed_kernel!(
    dot_packed_vnni,
    vnni_kind,
    dot_wide_vnni,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    crate::cpu::Avx512Vnni,
    udot_vnni,
    true,
    false
);
