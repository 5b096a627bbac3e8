//! Scores against a Q8_0 key cache, computed in integers as llama.cpp computes them.
//!
//! A Q8_0 key is 32-value blocks of signed bytes, each block with an f16 scale. Decoding it to
//! f32 and taking a float dot product (what attention did before) spends more multiply-adds
//! and conversions per key than a 16-bit cache while reading only half the bytes: at depth
//! 4,096 the step was compute-bound at 32% of its memory roofline. Instead each query row is
//! quantized once per call to Q8_0-style blocks in two parts, `q ~ d (hi + lo / 128)`: `hi`
//! with ggml's Q8_0 rule (d = block absmax / 127), `lo` the rounded remainder in 1/128 steps
//! (at most 64 in size). A score is then
//!
//! `s = sum over blocks b of  (128 x hi.k + lo.k) * ((d_b / 128) * key scale_b)`
//!
//! with the blocks added in order from zero. The integer dots are exact, so the only error
//! beyond the stored key's is the query's remainder rounding, at most 1/256 of a Q8_0 step
//! (finer than an f16 query). llama.cpp quantizes the query to plain Q8_0 (`hi` alone),
//! which raises the q8_0 cache's KL divergence by about 40%; the second part removes for one more multiply per four dimensions. The f32 arithmetic after the
//! integer dots is the same operations in the same order on every path (this portable twin,
//! the VNNI kernel in `kernels_vnni`, and naive attention), so a row's scores have the same bits
//! whichever computes them.

use std::marker::PhantomData;

use half::f16;

use super::flash::MAX_KEY_TILE;
use crate::kv::Q8_0_BLOCK;

/// Bytes of one stored Q8_0 block: the f16 scale, then 32 signed bytes.
pub(super) const BLOCK_BYTES: usize = 34;

/// Query rows quantized in two parts: `hi` and `lo` (`rows x hd` each), the same values as
/// sixteen-bit words `128 hi + lo` (for the AVX2 kernel, which multiplies words), and per row
/// and block the scale `d / 128` of `128 hi + lo`, and `128 x` that combination's sum (the VNNI
/// kernel multiplies unsigned bytes, so it offsets the keys by 128 and subtracts this
/// afterwards).
#[derive(Default, Debug)]
pub(super) struct QuantQueries {
    pub hi: Vec<i8>,
    pub lo: Vec<i8>,
    pub words: Vec<i16>,
    pub scales: Vec<f32>,
    pub offsets: Vec<i32>,
}

impl QuantQueries {
    /// Quantizes `q` (rows of `hd` values, `hd` a multiple of 32), reusing the buffers.
    pub fn quantize(&mut self, q: &[f32], hd: usize) {
        debug_assert!(hd.is_multiple_of(Q8_0_BLOCK) && q.len().is_multiple_of(hd));
        for v in [&mut self.hi, &mut self.lo] {
            v.clear();
            v.resize(q.len(), 0);
        }
        self.scales.clear();
        self.offsets.clear();
        self.words.clear();
        for ((x, hi), lo) in q
            .chunks_exact(Q8_0_BLOCK)
            .zip(self.hi.chunks_exact_mut(Q8_0_BLOCK))
            .zip(self.lo.chunks_exact_mut(Q8_0_BLOCK))
        {
            let d = quantize_block(x, hi, lo);
            self.scales.push(d / 128.0);
            let from = self.words.len();
            let words = hi.iter().zip(lo.iter());
            self.words
                .extend(words.map(|(&h, &l)| 128 * i16::from(h) + i16::from(l)));
            let sum: i32 = self.words[from..].iter().map(|&w| i32::from(w)).sum();
            self.offsets.push(128 * sum);
        }
    }
}

impl QuantQueries {
    /// Empties the rows, keeping the buffers.
    pub fn clear(&mut self) {
        self.hi.clear();
        self.lo.clear();
        self.words.clear();
        self.scales.clear();
        self.offsets.clear();
    }

    /// Appends rows `rows` of `src` (rows of `hd` values).
    pub fn extend_from(&mut self, src: &QuantQueries, rows: std::ops::Range<usize>, hd: usize) {
        let nb = hd / Q8_0_BLOCK;
        let (v, b) = (
            rows.start * hd..rows.end * hd,
            rows.start * nb..rows.end * nb,
        );
        self.hi.extend_from_slice(&src.hi[v.clone()]);
        self.lo.extend_from_slice(&src.lo[v.clone()]);
        self.words.extend_from_slice(&src.words[v]);
        self.scales.extend_from_slice(&src.scales[b.clone()]);
        self.offsets.extend_from_slice(&src.offsets[b]);
    }

    /// Appends `n` zero rows (a padded block's missing rows score 0 against every key).
    pub fn pad(&mut self, n: usize, hd: usize) {
        let nb = hd / Q8_0_BLOCK;
        self.hi.resize(self.hi.len() + n * hd, 0);
        self.lo.resize(self.lo.len() + n * hd, 0);
        self.words.resize(self.words.len() + n * hd, 0);
        self.scales.resize(self.scales.len() + n * nb, 0.0);
        self.offsets.resize(self.offsets.len() + n * nb, 0);
    }
}

/// `t` rounded to the nearest integer, halves away from zero (as `f32::round`, which is a
/// library call without SSE4.1; this runs a few thousand times per step), for `|t| <= 128`.
#[inline(always)]
fn round_half_away(t: f32) -> f32 {
    let i = t as i32 as f32; // truncated: exact, |t| <= 128
    let frac = t - i;
    i + f32::from(u8::from(frac >= 0.5)) - f32::from(u8::from(frac <= -0.5))
}

/// Quantizes 32 values: `hi` with ggml's Q8_0 rule (the scale `d` maps the absolute maximum to
/// 127; values round half away from zero), `lo` the remainder `x / d - hi` (within +-1/2) in
/// steps of 1/128, so `x ~ d (hi + lo / 128)` to within `d / 256`. Returns `d`, kept in f32: a
/// query is quantized once per call, and rounding `d` to f16 would only add error.
pub(super) fn quantize_block(x: &[f32], hi: &mut [i8], lo: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
    for ((h, l), &v) in hi.iter_mut().zip(lo.iter_mut()).zip(x) {
        // |t| <= 127 up to rounding for finite input; the clamp (and `as`, which saturates and
        // sends NaN to 0) keeps a hostile activation from wrapping around.
        let t = (v * inv).clamp(-128.0, 128.0);
        let r = round_half_away(t);
        *h = r as i8;
        *l = round_half_away((t - r) * 128.0).clamp(-64.0, 64.0) as i8;
    }
    d
}

/// The score of one quantized query row (`hi` and `lo` of `hd` values, one scale per block)
/// against one stored key (`hd / 32` Q8_0 blocks).
#[inline]
pub(super) fn score(hi: &[i8], lo: &[i8], scales: &[f32], key: &[u8]) -> f32 {
    let mut s = 0f32;
    for (((h, l), &qs), k) in hi
        .chunks_exact(Q8_0_BLOCK)
        .zip(lo.chunks_exact(Q8_0_BLOCK))
        .zip(scales)
        .zip(key.chunks_exact(BLOCK_BYTES))
    {
        let ks = f16::from_bits(u16::from_le_bytes([k[0], k[1]])).to_f32();
        let dot = |q: &[i8]| -> i32 {
            q.iter()
                .zip(&k[2..])
                .map(|(&a, &b)| i32::from(a) * i32::from(b as i8))
                .sum()
        };
        s += (128 * dot(h) + dot(l)) as f32 * (qs * ks);
    }
    s
}

/// Where a tile's keys lie: one pointer per key to its whole stored head (`head_bytes`),
/// checked once per run of keys as the run is added, so the kernels read a key without a check
/// of their own (a per-key slice check would cost a sixth of the VNNI kernel's time).
pub(super) struct KeyRows<'a> {
    ptrs: [*const u8; MAX_KEY_TILE],
    len: usize,
    head_bytes: usize,
    _data: PhantomData<&'a [u8]>,
}

impl<'a> KeyRows<'a> {
    pub fn new(head_bytes: usize) -> Self {
        KeyRows {
            ptrs: [std::ptr::null(); MAX_KEY_TILE],
            len: 0,
            head_bytes,
            _data: PhantomData,
        }
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Appends `m` keys, `stride` bytes apart from the start of `bytes`.
    pub fn push_run(&mut self, bytes: &'a [u8], stride: usize, m: usize) {
        assert!(
            m >= 1
                && self.len + m <= MAX_KEY_TILE
                && bytes.len() >= (m - 1) * stride + self.head_bytes,
            "q8 key rows: run of {m} at stride {stride} in {} bytes",
            bytes.len()
        );
        for (r, p) in self.ptrs[self.len..self.len + m].iter_mut().enumerate() {
            *p = bytes[r * stride..].as_ptr();
        }
        self.len += m;
    }

    /// Key `j`'s stored head: `head_bytes` readable bytes for as long as `'a`.
    #[inline(always)]
    pub fn ptr(&self, j: usize) -> *const u8 {
        assert!(j < self.len);
        self.ptrs[j]
    }

    /// Key `j`'s stored head.
    pub fn get(&self, j: usize) -> &'a [u8] {
        // SAFETY: `push_run` checked that `head_bytes` bytes from this pointer lie inside a
        // slice borrowed for `'a`.
        unsafe { std::slice::from_raw_parts(self.ptr(j), self.head_bytes) }
    }

    pub fn head_bytes(&self) -> usize {
        self.head_bytes
    }
}

/// `s[i][j] = score(query i, key j)` for `R` quantized rows (from row `row0` of `qq`) and keys
/// `0..jn` of `keys`, into `s` (`R x bc`): the portable twin of `kernels_vnni::scores_q8`.
pub(super) fn scores<const R: usize>(
    qq: &QuantQueries,
    row0: usize,
    hd: usize,
    keys: &KeyRows,
    jn: usize,
    bc: usize,
    s: &mut [f32],
) {
    let nb = hd / Q8_0_BLOCK;
    for i in 0..R {
        let r = row0 + i;
        let (hi, lo) = (&qq.hi[r * hd..][..hd], &qq.lo[r * hd..][..hd]);
        let scales = &qq.scales[r * nb..][..nb];
        for j in 0..jn {
            s[i * bc + j] = score(hi, lo, scales, keys.get(j));
        }
    }
}

/// A SIMD kernel of [`scores`]' signature (plus the next tile's prefetches), with its token:
/// what each level's `TileKernel::scores_q8` runs and [`check_kernel_bits`] checks.
#[cfg(all(test, target_arch = "x86_64"))]
type ScoresKernel<'a> = &'a dyn Fn(
    &QuantQueries,
    usize,
    usize,
    &KeyRows,
    usize,
    usize,
    &mut [f32],
    &mut super::ahead::Ahead,
);

/// Random queries and keys (head dims 32 to 192, tiles of several widths, `jn` anywhere in the
/// tile, large and tiny scales, one key holding both ends of the byte range, -128 included):
/// `k4` and `k3` (a SIMD kernel for 4 and 3 rows, with its token) give the bits of the portable
/// [`scores`].
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) fn check_kernel_bits(seed: u64, k4: ScoresKernel, k3: ScoresKernel) {
    use crate::kv::KvType;
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    for &(hd, bc) in &[(64, 64), (32, 128), (128, 32), (96, 40), (192, 16)] {
        for &amp in &[1e-3f32, 1.0, 300.0] {
            let rows = 8;
            let q: Vec<f32> = (0..rows * hd)
                .map(|_| rng.random_range(-amp..amp))
                .collect();
            let mut qq = QuantQueries::default();
            qq.quantize(&q, hd);
            let hb = KvType::Q8_0.bytes(hd);
            let stored: Vec<Vec<u8>> = (0..bc)
                .map(|j| {
                    let k: Vec<f32> = (0..hd).map(|_| rng.random_range(-amp..amp)).collect();
                    let mut b = vec![0u8; hb];
                    KvType::Q8_0.encode(&k, &mut b);
                    if j == 3 {
                        for blk in b.chunks_exact_mut(BLOCK_BYTES) {
                            for (x, v) in blk[2..].iter_mut().enumerate() {
                                *v = if x % 2 == 0 { 0x80 } else { 0x7f };
                            }
                        }
                    }
                    b
                })
                .collect();
            let mut keys = KeyRows::new(hb);
            for key in &stored {
                keys.push_run(key, 0, 1);
            }
            for jn in [1, 7, 8, 9, 16, 17, bc - 1, bc]
                .into_iter()
                .filter(|&jn| jn <= bc)
            {
                for row0 in [0, 4] {
                    let mut want = vec![0f32; 4 * bc];
                    let mut got = vec![f32::NAN; 4 * bc];
                    let mut got3 = vec![f32::NAN; 3 * bc];
                    scores::<4>(&qq, row0, hd, &keys, jn, bc, &mut want);
                    let ahead = &mut super::ahead::Ahead::default();
                    k4(&qq, row0, hd, &keys, jn, bc, &mut got, ahead);
                    k3(&qq, row0, hd, &keys, jn, bc, &mut got3, ahead);
                    for i in 0..4 {
                        for j in 0..jn {
                            let w = want[i * bc + j].to_bits();
                            assert_eq!(got[i * bc + j].to_bits(), w, "hd {hd} row {i} key {j}");
                            if i < 3 {
                                assert_eq!(got3[i * bc + j].to_bits(), w, "3 rows: hd {hd}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvType;

    /// Each query value is within 1/256 of a Q8_0 step of `d (hi + lo / 128)`, and the integer
    /// score is the float dot product of the two dequantized rows up to f32 rounding (the
    /// integer part is exact).
    #[test]
    fn integer_scores_are_the_dot_of_the_dequantized_rows() {
        let hd = 64;
        let q: Vec<f32> = (0..hd)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        let k: Vec<f32> = (0..hd)
            .map(|i| ((i * 11 % 17) as f32 - 8.0) * 0.7)
            .collect();
        let mut key = vec![0u8; KvType::Q8_0.bytes(hd)];
        KvType::Q8_0.encode(&k, &mut key);
        let mut qq = QuantQueries::default();
        qq.quantize(&q, hd);
        let mut kd = vec![0f32; hd];
        crate::quant::dequantize(crate::quant::GgmlType::Q8_0, &key, &mut kd).unwrap();
        let qd: Vec<f32> = (0..hd)
            .map(|c| (128.0 * f32::from(qq.hi[c]) + f32::from(qq.lo[c])) * qq.scales[c / 32])
            .collect();
        for (c, (&a, &b)) in q.iter().zip(&qd).enumerate() {
            let step = 128.0 * qq.scales[c / 32];
            assert!((a - b).abs() <= step / 256.0 * 1.001, "dim {c}: {a} {b}");
            assert!(qq.lo[c].abs() <= 64);
        }
        let want: f64 = qd
            .iter()
            .zip(&kd)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum();
        let got = score(&qq.hi, &qq.lo, &qq.scales, &key);
        assert!(
            ((got as f64) - want).abs() < 1e-5 * want.abs().max(1.0),
            "{got} {want}"
        );
        // 128 x the sums of 128 hi + lo, for the VNNI kernel's offset.
        for b in 0..2 {
            let sum: i32 = (b * 32..b * 32 + 32)
                .map(|c| 128 * i32::from(qq.hi[c]) + i32::from(qq.lo[c]))
                .sum();
            assert_eq!(qq.offsets[b], 128 * sum);
        }
    }

    #[test]
    fn rounding_is_f32_round_on_its_range() {
        let mut t = -128.0f32;
        while t <= 128.0 {
            for x in [t, t.next_up(), t.next_down()] {
                if x.abs() <= 128.0 {
                    assert_eq!(round_half_away(x), x.round(), "{x}");
                }
            }
            t += 1.0 / 64.0;
        }
        for x in [0.49999997f32, -0.49999997, 0.5, -0.5, 2.5, -2.5] {
            assert_eq!(round_half_away(x), x.round(), "{x}");
        }
        assert_eq!(round_half_away(f32::NAN) as i8, 0);
    }

    #[test]
    fn a_zero_or_hostile_query_block_quantizes_without_panicking() {
        let (mut hi, mut lo) = ([0i8; 32], [0i8; 32]);
        assert_eq!(quantize_block(&[0.0; 32], &mut hi, &mut lo), 0.0);
        assert!(hi.iter().chain(&lo).all(|&v| v == 0));
        let mut x = [1.0f32; 32];
        x[3] = f32::NAN;
        x[5] = f32::INFINITY;
        quantize_block(&x, &mut hi, &mut lo); // saturating casts: no panic, no wrap
        x[5] = f32::MAX;
        x[6] = -f32::MAX;
        quantize_block(&x, &mut hi, &mut lo);
    }
}
