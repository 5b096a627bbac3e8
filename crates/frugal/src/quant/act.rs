//! Activations quantized to 8 bits per block of 32, so matrix products with block-quantized
//! weights run on integer dot products (as llama.cpp does with its Q8_0/Q8_1 activation blocks).
//!
//! Per block: a scale `d = absmax / 127`, 32 signed bytes `q = round(x / d)`, and `s = d * sum(q)`,
//! which lets formats with an offset (Q4_1's minimum, Q4_0's -8) apply it once per block instead of
//! once per element: `sum((dw*qw + m) * (dx*qx)) = dw*dx*sum(qw*qx) + m*s`. Formats with a
//! minimum per 16 elements (Q2_K) take the same sum per half block, `s16`. llama.cpp's Q8_K
//! (one scale per 256, for its K-quant products) fills the same fields, each block of 32
//! holding its super-block's scale, so the same kernels read both.

pub const QK: usize = 32;

pub use super::k_quants::QK_K;

/// The precision of the activations fed to matrix products: a lever of its own.
///
/// On SmolLM2-135M's Q4_1 file (GPL-3 text, ctx 512, KL from the exact model): `q8` costs a mean
/// KL of 0.0023 and `q8-full` 0.0031 (llama.cpp: 0.0031), at the same decode speed: decode is
/// bound by reading the weights, and the output head's f32 path reads the same bytes.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub enum Activations {
    /// Exact f32 arithmetic on the dequantized weights (what llama.cpp's F32 file computes).
    #[default]
    #[serde(rename = "f32")]
    F32,
    /// 8 bits per block of 32 into every block-quantized matrix (integer dot products), except
    /// a Q8_0 output head, which takes 15 bits ([`WideActs`], two byte products per element)
    /// because its error reaches the token distribution directly instead of being averaged by
    /// later layers. Any other head format takes 8 bits, as llama.cpp computes: an f32 head
    /// product read a Q6_K head at a fraction of the speed (a 1B Q4_K_M file decoded at 0.38x
    /// llama.cpp). Float weights (F32, F16, BF16) always take f32 activations.
    #[serde(rename = "q8")]
    Q8,
    /// 8 bits into every block-quantized matrix, the output head included, in llama.cpp's
    /// blocks: one scale per 256 values (its Q8_K) into K-quant and IQ4_XS products, per 32
    /// into the rest. What llama.cpp computes on a quantized file.
    #[serde(rename = "q8-full")]
    Q8Full,
}

impl Activations {
    /// Whether any product takes 8-bit activations.
    pub fn quantized(self) -> bool {
        self != Activations::F32
    }
}

impl std::fmt::Display for Activations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Activations::F32 => "f32",
            Activations::Q8 => "q8",
            Activations::Q8Full => "q8-full",
        })
    }
}

impl std::str::FromStr for Activations {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "exact" => Ok(Activations::F32),
            "q8" | "q8_0" | "int8" => Ok(Activations::Q8),
            "q8-full" | "q8_full" | "q8-all" => Ok(Activations::Q8Full),
            other => Err(format!(
                "unknown activation precision {other:?} (expected f32, q8 or q8-full)"
            )),
        }
    }
}

/// `n` rows of `k` activations (k a multiple of 32), quantized block by block.
#[derive(Default, Debug, Clone)]
pub struct Q8Acts {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    /// `d * sum(q)` of each half block (elements 0..16 and 16..32): two per block.
    pub s16: Vec<f32>,
    pub k: usize,
    pub n: usize,
}

/// One quantized row.
#[derive(Copy, Clone, Debug)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
    /// Two per block (see [`Q8Acts::s16`]).
    pub s16: &'a [f32],
}

impl Q8Acts {
    /// Quantizes `x` (`n x k`, row-major), reusing the buffers.
    pub fn quantize(&mut self, x: &[f32], k: usize) {
        self.quantize_with(super::kernels::detect(), x, k);
    }

    /// [`Self::quantize`] at a given instruction-set level (the levels give the same bytes).
    pub fn quantize_with(&mut self, isa: super::kernels::Isa, x: &[f32], k: usize) {
        assert!(
            k > 0 && k.is_multiple_of(QK) && x.len().is_multiple_of(k),
            "Q8Acts::quantize: {} values are not rows of {k} (a multiple of {QK})",
            x.len()
        );
        self.shape_for(x.len(), k);
        #[cfg(target_arch = "x86_64")]
        if let Some(t) = isa.avx2() {
            // SAFETY: the token proves the kernel's features.
            unsafe {
                quantize_blocks_avx2(t, x, &mut self.qs, &mut self.d, &mut self.s, &mut self.s16)
            };
            return;
        }
        let _ = isa;
        let blocks = x
            .chunks_exact(QK)
            .zip(self.qs.chunks_exact_mut(QK))
            .zip(self.d.iter_mut().zip(self.s.iter_mut()))
            .zip(self.s16.chunks_exact_mut(2));
        for (((xb, qb), (d, s)), s16) in blocks {
            let halves;
            (*d, *s, halves) = quantize_block(xb, qb);
            s16.copy_from_slice(&halves);
        }
    }

    /// Quantizes `x` (`n x k`, `k` a multiple of [`QK_K`]) as llama.cpp's Q8_K does for the
    /// products of its K-quant formats, so that `q8-full` computes what llama.cpp computes on
    /// those files: one scale per 256 values, `d = max / -127` where `max` is the value of the
    /// largest magnitude, `q = round_half_even(x / d)`. Each block of 32 gets a copy of its
    /// super-block's scale, and `s`/`s16` are `d` times the block's and half blocks' integer
    /// sums (llama.cpp's `bsums`), so the same kernels read either form.
    pub fn quantize_super_blocks(&mut self, x: &[f32], k: usize) {
        assert!(
            k > 0 && k.is_multiple_of(QK_K) && x.len().is_multiple_of(k),
            "Q8Acts::quantize_super_blocks: {} values are not rows of {k} (a multiple of {QK_K})",
            x.len()
        );
        self.shape_for(x.len(), k);
        const PER: usize = QK_K / QK;
        let supers = x
            .chunks_exact(QK_K)
            .zip(self.qs.chunks_exact_mut(QK_K))
            .zip(self.d.chunks_exact_mut(PER))
            .zip(
                self.s
                    .chunks_exact_mut(PER)
                    .zip(self.s16.chunks_exact_mut(2 * PER)),
            );
        for (((xs, qs), d), (s, s16)) in supers {
            let max = xs
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            if max == 0.0 {
                qs.fill(0);
                d.fill(0.0);
                s.fill(0.0);
                s16.fill(0.0);
                continue;
            }
            let iscale = -127.0 / max;
            for (q, &v) in qs.iter_mut().zip(xs) {
                *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
            }
            let scale = 1.0 / iscale;
            d.fill(scale);
            for (h, q16) in s16.iter_mut().zip(qs.chunks_exact(QK / 2)) {
                *h = scale * q16.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
            }
            for (b, q32) in s.iter_mut().zip(qs.chunks_exact(QK)) {
                *b = scale * q32.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
            }
        }
    }

    /// Sizes the buffers for `len` values in rows of `k`.
    fn shape_for(&mut self, len: usize, k: usize) {
        self.k = k;
        self.n = len / k;
        self.qs.resize(len, 0);
        self.d.resize(len / QK, 0.0);
        self.s.resize(len / QK, 0.0);
        self.s16.resize(2 * (len / QK), 0.0);
    }

    pub fn row(&self, t: usize) -> Q8Row<'_> {
        let nb = self.k / QK;
        Q8Row {
            qs: &self.qs[t * self.k..(t + 1) * self.k],
            d: &self.d[t * nb..(t + 1) * nb],
            s: &self.s[t * nb..(t + 1) * nb],
            s16: &self.s16[2 * t * nb..2 * (t + 1) * nb],
        }
    }
}

/// Rows of [`Q8Acts`] taken two at a time and interleaved for the two-token kernels: per block
/// of 32, the pair's bytes in 4-byte granules (`a[0..4], b[0..4], a[4..8], b[4..8], ...`), and
/// the pair's scales and sums side by side, so one 64-bit broadcast feeds both tokens.
#[derive(Default, Debug, Clone)]
pub struct PairActs {
    pub qs: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub k: usize,
    pub pairs: usize,
}

/// `out = a[0..4], b[0..4], a[4..8], b[4..8], ...`: two rows' bytes in 4-byte granules, so
/// one 64-bit broadcast holds both tokens' next four values.
fn interleave4<T: Copy>(out: &mut [T], a: &[T], b: &[T]) {
    for ((o, x), y) in out
        .chunks_exact_mut(8)
        .zip(a.chunks_exact(4))
        .zip(b.chunks_exact(4))
    {
        o[..4].copy_from_slice(x);
        o[4..].copy_from_slice(y);
    }
}

/// One interleaved pair of rows.
#[derive(Copy, Clone, Debug)]
pub struct PairRow<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl PairActs {
    /// Interleaves the rows of `x` two by two (reusing the buffers). An odd last row is left
    /// out: the kernels take it as their one-token tail, on the same unpacked weights.
    pub fn fill(&mut self, x: &Q8Acts) {
        let (k, nb) = (x.k, x.k / QK);
        self.k = k;
        self.pairs = x.n / 2;
        self.qs.resize(self.pairs * 2 * k, 0);
        self.d.resize(self.pairs * 2 * nb, 0.0);
        self.s.resize(self.pairs * 2 * nb, 0.0);
        for p in 0..self.pairs {
            let (a, b) = (x.row(2 * p), x.row(2 * p + 1));
            interleave4(&mut self.qs[p * 2 * k..(p + 1) * 2 * k], a.qs, b.qs);
            for blk in 0..nb {
                let i = (p * nb + blk) * 2;
                (self.d[i], self.d[i + 1]) = (a.d[blk], b.d[blk]);
                (self.s[i], self.s[i + 1]) = (a.s[blk], b.s[blk]);
            }
        }
    }

    pub fn row(&self, p: usize) -> PairRow<'_> {
        let nb2 = 2 * (self.k / QK);
        PairRow {
            qs: &self.qs[p * 2 * self.k..(p + 1) * 2 * self.k],
            d: &self.d[p * nb2..(p + 1) * nb2],
            s: &self.s[p * nb2..(p + 1) * nb2],
        }
    }
}

/// The largest magnitude of a [`WideActs`] integer: 127 x 128, so that both bytes of the split
/// `q = 128 hi + lo` fit the unsigned-by-signed byte products without saturating (`hi` in
/// -127..=127, `lo` in 0..=127).
pub const WIDE_MAX: i32 = 127 * 128;

/// `n` rows of `k` activations quantized to 15-bit integers per block of 32 (`d = absmax /
/// 16256`, `q = round(x / d)`), stored as two byte planes `q = 128 hi + lo`: 128 times finer than
/// [`Q8Acts`] at twice the integer products. The output head takes these under
/// `Activations::Q8` (its Q8_0 weights meet them with the same packed kernels' byte products).
#[derive(Default, Debug, Clone)]
pub struct WideActs {
    pub hi: Vec<i8>,
    pub lo: Vec<u8>,
    /// The same integers `128 hi + lo` as sixteen-bit words (for AVX2, which multiplies words
    /// exactly where its byte products would saturate).
    pub words: Vec<i16>,
    pub d: Vec<f32>,
    /// Sum of the block's integers (for kernels that bias the weights to unsigned).
    pub qsum: Vec<i32>,
    pub k: usize,
    pub n: usize,
}

/// One row of [`WideActs`].
#[derive(Copy, Clone, Debug)]
pub struct WideRow<'a> {
    pub hi: &'a [i8],
    pub lo: &'a [u8],
    pub words: &'a [i16],
    pub d: &'a [f32],
    pub qsum: &'a [i32],
}

impl WideRow<'_> {
    /// The integer at element `e`.
    pub fn q(&self, e: usize) -> i32 {
        128 * i32::from(self.hi[e]) + i32::from(self.lo[e])
    }
}

impl WideActs {
    /// Quantizes `x` (`n x k`, row-major), reusing the buffers. Scalar: the head's input is one
    /// row of the model width per token.
    pub fn quantize(&mut self, x: &[f32], k: usize) {
        assert!(
            k > 0 && k.is_multiple_of(QK) && x.len().is_multiple_of(k),
            "WideActs::quantize: {} values are not rows of {k} (a multiple of {QK})",
            x.len()
        );
        self.k = k;
        self.n = x.len() / k;
        self.hi.resize(x.len(), 0);
        self.lo.resize(x.len(), 0);
        self.words.resize(x.len(), 0);
        self.d.resize(x.len() / QK, 0.0);
        self.qsum.resize(x.len() / QK, 0);
        for (b, xb) in x.chunks_exact(QK).enumerate() {
            let mut qsum = 0;
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / WIDE_MAX as f32;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (i, &v) in xb.iter().enumerate() {
                let r = v * id;
                let q = ((r + 0.5f32.copysign(r)) as i32).clamp(-WIDE_MAX, WIDE_MAX);
                let hi = q.div_euclid(128);
                self.hi[b * QK + i] = hi as i8;
                self.lo[b * QK + i] = (q - 128 * hi) as u8;
                self.words[b * QK + i] = q as i16; // |q| <= WIDE_MAX < 2^15
                qsum += q;
            }
            self.d[b] = d;
            self.qsum[b] = qsum;
        }
    }

    pub fn row(&self, t: usize) -> WideRow<'_> {
        let nb = self.k / QK;
        WideRow {
            hi: &self.hi[t * self.k..(t + 1) * self.k],
            lo: &self.lo[t * self.k..(t + 1) * self.k],
            words: &self.words[t * self.k..(t + 1) * self.k],
            d: &self.d[t * nb..(t + 1) * nb],
            qsum: &self.qsum[t * nb..(t + 1) * nb],
        }
    }
}

/// One block: `d = absmax / 127`, `q = round(x / d)` (half away from zero), returns `(d, d *
/// sum(q), [d * sum(q[..16]), d * sum(q[16..])])`. The reference for [`quantize_blocks_avx2`].
fn quantize_block(xb: &[f32], qb: &mut [i8]) -> (f32, f32, [f32; 2]) {
    // Eight running maxima, one per lane, so the scan vectorizes (max is exact in any order).
    let mut lanes = [0f32; 8];
    for c in xb.chunks_exact(8) {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut half = [0i32; 2];
    for (i, (q, &v)) in qb.iter_mut().zip(xb).enumerate() {
        // Round half away from zero with a truncating conversion, which vectorizes
        // (`f32::round` is a library call per element on baseline x86-64).
        let r = v * id;
        *q = (r + 0.5f32.copysign(r)) as i32 as i8;
        half[i / 16] += i32::from(*q);
    }
    let sum = half[0] + half[1];
    (d, d * sum as f32, [d * half[0] as f32, d * half[1] as f32])
}

/// [`quantize_block`] over every block of `x` (`qs` as long, `d` and `s` one per block) in
/// AVX2, the same operations lane by lane (so the same bytes), eight blocks at a time: their
/// maxima first, then `d = amax / 127` and `1 / d` for all eight in two vector divisions (the
/// same IEEE division per lane), then each block scaled, rounded and packed. Block by block, each
/// block's two scalar divisions ended a chain of dependent steps the next block's had to wait
/// behind: decode's 1,536-wide row took 1,144 TSC ticks in L1 (Zen 4).
///
/// `qs` is as long as `x`, a whole number of blocks, `d` and `s` hold one value per block and
/// `s16` two (asserted).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_blocks_avx2(
    _: crate::cpu::Avx2,
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    s16: &mut [f32],
) {
    use std::arch::x86_64::*;
    let nb = d.len();
    assert!(
        x.len() == nb * QK && qs.len() == x.len() && s.len() == nb && s16.len() == 2 * nb,
        "quantize_blocks_avx2: shapes"
    );
    // The sum of a vector's eight i32 lanes.
    let hsum = |v: __m256i| {
        let t4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let t2 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0b00_00_11_10));
        _mm_cvtsi128_si32(_mm_add_epi32(t2, _mm_shuffle_epi32(t2, 0b00_00_00_01)))
    };
    let sign = _mm256_set1_ps(-0.0);
    let half = _mm256_set1_ps(0.5);
    let (xp, qp) = (x.as_ptr(), qs.as_mut_ptr());
    let mut b0 = 0;
    while b0 < nb {
        let n = (nb - b0).min(8);
        let mut amax = [0f32; 8];
        // SAFETY: (whole loop) block b's 32 floats and 32 bytes lie at 32 b of `x` and `qs`,
        // b < nb (asserted above).
        unsafe {
            for (j, a) in amax.iter_mut().enumerate().take(n) {
                let p = xp.add(QK * (b0 + j));
                let m = _mm256_max_ps(
                    _mm256_max_ps(
                        _mm256_andnot_ps(sign, _mm256_loadu_ps(p)),
                        _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(8))),
                    ),
                    _mm256_max_ps(
                        _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(16))),
                        _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(24))),
                    ),
                );
                let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
                let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                *a = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
            }
            let dv = _mm256_div_ps(_mm256_loadu_ps(amax.as_ptr()), _mm256_set1_ps(127.0));
            // 1 / d where d > 0, else 0 (a zero block, or NaN).
            let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(dv, _mm256_setzero_ps());
            let iv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0), dv), positive);
            let (mut ds, mut ids) = ([0f32; 8], [0f32; 8]);
            _mm256_storeu_ps(ds.as_mut_ptr(), dv);
            _mm256_storeu_ps(ids.as_mut_ptr(), iv);
            for j in 0..n {
                let b = b0 + j;
                let p = xp.add(QK * b);
                let id = _mm256_set1_ps(ids[j]);
                let mut q = [_mm256_setzero_si256(); 4];
                for (i, qi) in q.iter_mut().enumerate() {
                    let r = _mm256_mul_ps(_mm256_loadu_ps(p.add(8 * i)), id);
                    // 0.5 with r's sign, then truncate: round half away from zero.
                    let h = _mm256_or_ps(half, _mm256_and_ps(r, sign));
                    *qi = _mm256_cvttps_epi32(_mm256_add_ps(r, h));
                }
                // Elements 0..16 are q[0], q[1]; 16..32 are q[2], q[3].
                let lo = hsum(_mm256_add_epi32(q[0], q[1]));
                let hi = hsum(_mm256_add_epi32(q[2], q[3]));
                let sum = lo + hi;
                // i32 -> i16 -> i8 packs interleave the 128-bit halves; one permute restores the
                // order.
                let w16a = _mm256_packs_epi32(q[0], q[1]);
                let w16b = _mm256_packs_epi32(q[2], q[3]);
                let w8 = _mm256_packs_epi16(w16a, w16b);
                let ordered =
                    _mm256_permutevar8x32_epi32(w8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(qp.add(QK * b) as *mut __m256i, ordered);
                d[b] = ds[j];
                s[b] = ds[j] * sum as f32;
                s16[2 * b] = ds[j] * lo as f32;
                s16[2 * b + 1] = ds[j] * hi as f32;
            }
        }
        b0 += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's own Q8_K bytes (its `quantize_row_q8_K_ref`, through
    /// `scripts/llama-cpp-q8k.c`) for four super-blocks: a positive largest value, a negative
    /// outlier, exact halves, zeros. Every byte and scale equal, and the sums its `bsums` hold.
    #[test]
    fn super_blocks_are_llama_cpp_q8_k() {
        let f: serde_json::Value =
            serde_json::from_str(include_str!("testdata/llama_cpp_q8_k.json")).unwrap();
        let nums = |k: &str| -> Vec<f64> {
            f[k].as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        };
        let x: Vec<f32> = nums("x").iter().map(|&v| v as f32).collect();
        let (d, qs, bsums) = (nums("d"), nums("qs"), nums("bsums"));
        let mut a = Q8Acts::default();
        a.quantize_super_blocks(&x, x.len());
        for (i, (&got, &want)) in a.qs.iter().zip(&qs).enumerate() {
            assert_eq!(f64::from(got), want, "byte {i}");
        }
        for (b, &want) in d.iter().enumerate() {
            for blk in 0..QK_K / QK {
                assert_eq!(
                    a.d[b * QK_K / QK + blk],
                    want as f32,
                    "super-block {b} scale"
                );
            }
        }
        for (j, &want) in bsums.iter().enumerate() {
            let s16 = a.s16[j];
            let dd = a.d[j / 2];
            let sum = if dd == 0.0 { 0.0 } else { f64::from(s16 / dd) };
            assert!((sum - want).abs() < 1e-3, "bsum {j}: {sum} vs {want}");
        }
    }

    #[test]
    fn quantized_activations_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..96)
            .map(|i| ((i * 29 % 31) as f32 - 15.0) * 0.37)
            .collect();
        let mut a = Q8Acts::default();
        a.quantize(&x, 96);
        for b in 0..3 {
            let mut sum = 0f32;
            for i in 0..32 {
                let q = a.qs[b * 32 + i];
                sum += f32::from(q);
                let err = (f32::from(q) * a.d[b] - x[b * 32 + i]).abs();
                assert!(err <= a.d[b] * 0.5 + 1e-6, "{err}");
            }
            assert!((a.s[b] - a.d[b] * sum).abs() < 1e-5);
            let lo: i32 = a.qs[b * 32..b * 32 + 16]
                .iter()
                .map(|&q| i32::from(q))
                .sum();
            let hi: i32 = a.qs[b * 32 + 16..b * 32 + 32]
                .iter()
                .map(|&q| i32::from(q))
                .sum();
            assert_eq!(a.s16[2 * b], a.d[b] * lo as f32);
            assert_eq!(a.s16[2 * b + 1], a.d[b] * hi as f32);
        }
    }

    #[test]
    fn wide_activations_split_into_two_bytes_within_half_a_fine_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 29 % 31) as f32 - 15.0) * 0.37)
            .collect();
        let mut a = WideActs::default();
        a.quantize(&x, 64);
        let row = a.row(0);
        for (e, &v) in x.iter().enumerate() {
            assert!((-127..=127).contains(&i32::from(row.hi[e])) && row.lo[e] <= 127);
            let d = row.d[e / QK];
            assert!(
                (row.q(e) as f32 * d - v).abs() <= d * 0.5 + 1e-6,
                "element {e}"
            );
        }
        for b in 0..2 {
            let sum: i32 = (32 * b..32 * (b + 1)).map(|e| row.q(e)).sum();
            assert_eq!(row.qsum[b], sum);
        }
        // The absmax maps to the top of the range.
        assert!((0..32).any(|e| row.q(e).abs() == WIDE_MAX));
    }

    #[test]
    fn every_level_quantizes_to_the_same_bytes() {
        // Ties at exactly half a step, zeros, a zero block and large values.
        let mut x: Vec<f32> = (0..320)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 0.013)
            .collect();
        x[0] = 127.0;
        x[1] = 0.5;
        x[2] = -0.5;
        x[3] = 1.5;
        x[64..96].fill(0.0);
        let mut reference = Q8Acts::default();
        reference.quantize_with(crate::quant::kernels::Isa::Scalar, &x, 160);
        let mut fast = Q8Acts::default();
        fast.quantize(&x, 160);
        assert_eq!(reference.qs, fast.qs);
        assert_eq!(reference.d, fast.d);
        assert_eq!(reference.s, fast.s);
        assert_eq!(reference.s16, fast.s16);
        // Rows of 1 to 20 blocks and decode's 48, at scales over many binades (the fast path
        // takes blocks eight at a time: whole eights and every remainder).
        for blocks in (1..=20).chain([48]) {
            let k = blocks * QK;
            let x: Vec<f32> = (0..2 * k)
                .map(|i| {
                    let scale = 2f32.powi((i / QK % 17) as i32 - 8);
                    ((i * 7919 % 1013) as f32 - 506.0) * 0.013 * scale
                })
                .collect();
            reference.quantize_with(crate::quant::kernels::Isa::Scalar, &x, k);
            fast.quantize(&x, k);
            assert_eq!(reference.qs, fast.qs, "{blocks} blocks");
            assert_eq!(reference.d, fast.d, "{blocks} blocks");
            assert_eq!(reference.s, fast.s, "{blocks} blocks");
            assert_eq!(reference.s16, fast.s16, "{blocks} blocks");
        }
    }
}

/// Rows of [`WideActs`] two at a time, interleaved like [`PairActs`]: both byte planes in
/// 4-byte granules per token, the scales and integer sums side by side.
#[derive(Default, Debug, Clone)]
pub struct WidePairActs {
    pub hi: Vec<i8>,
    pub lo: Vec<u8>,
    pub d: Vec<f32>,
    pub qsum: Vec<i32>,
    pub k: usize,
    pub pairs: usize,
}

/// One interleaved pair of [`WideActs`] rows.
#[derive(Copy, Clone, Debug)]
pub struct WidePairRow<'a> {
    pub hi: &'a [i8],
    pub lo: &'a [u8],
    pub d: &'a [f32],
    pub qsum: &'a [i32],
}

impl WidePairActs {
    /// Interleaves the rows of `x` two by two, leaving out an odd last row (as
    /// [`PairActs::fill`]).
    pub fn fill(&mut self, x: &WideActs) {
        let (k, nb) = (x.k, x.k / QK);
        self.k = k;
        self.pairs = x.n / 2;
        self.hi.resize(self.pairs * 2 * k, 0);
        self.lo.resize(self.pairs * 2 * k, 0);
        self.d.resize(self.pairs * 2 * nb, 0.0);
        self.qsum.resize(self.pairs * 2 * nb, 0);
        for p in 0..self.pairs {
            let (a, b) = (x.row(2 * p), x.row(2 * p + 1));
            let span = p * 2 * k..(p + 1) * 2 * k;
            interleave4(&mut self.hi[span.clone()], a.hi, b.hi);
            interleave4(&mut self.lo[span], a.lo, b.lo);
            for blk in 0..nb {
                let i = (p * nb + blk) * 2;
                (self.d[i], self.d[i + 1]) = (a.d[blk], b.d[blk]);
                (self.qsum[i], self.qsum[i + 1]) = (a.qsum[blk], b.qsum[blk]);
            }
        }
    }

    pub fn row(&self, p: usize) -> WidePairRow<'_> {
        let nb2 = 2 * (self.k / QK);
        WidePairRow {
            hi: &self.hi[p * 2 * self.k..(p + 1) * 2 * self.k],
            lo: &self.lo[p * 2 * self.k..(p + 1) * 2 * self.k],
            d: &self.d[p * nb2..(p + 1) * nb2],
            qsum: &self.qsum[p * nb2..(p + 1) * nb2],
        }
    }
}
