//! Element-wise building blocks of the forward pass.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use crate::cpu;

/// Sum of `v * v` over `x`, in f64: eight partial sums over the values `k, k + 8, k + 16, ...`,
/// added in order, then the tail. One sum in sequence was a chain of dependent f64 additions,
/// four cycles each: 0.7 us for a 576-wide row, 61 rows a decode step, all on one thread
/// between parallel sections (decode at depth 16, same-process A/B: 1.5-2.0% faster a token).
/// The partial sums change the f64 result in its last bits at most, far below the f32 scale it
/// becomes.
#[inline]
fn sum_squares(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += f64::from(v) * f64::from(v);
        }
    }
    let mut sum = acc.iter().sum::<f64>();
    for &v in tail {
        sum += f64::from(v) * f64::from(v);
    }
    sum
}

/// RMSNorm: `out = x / sqrt(mean(x^2) + eps) * w`, row by row (`x` is `n x w.len()`).
/// The mean is accumulated in f64, as ggml does.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match vector_level() {
        // SAFETY: the token proves the loop's features.
        VectorLevel::Avx512(t) => return unsafe { rms_norm_avx512(t, x, w, eps, out) },
        // SAFETY: as above.
        VectorLevel::Avx2(t) => return unsafe { rms_norm_avx2(t, x, w, eps, out) },
        VectorLevel::None => {}
    }
    rms_norm_body(x, w, eps, out);
}

/// [`rms_norm`]'s loop, compiled for each [`VectorLevel`]: the eight partial sums are one
/// vector of f64 lanes, the same operations on each lane at every width (same bits). In L1,
/// a 576-wide row took 364 TSC ticks in the baseline build (two f64 lanes a vector).
#[inline(always)]
fn rms_norm_body(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss = sum_squares(xr);
        let scale = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// `$avx2` and `$avx512`: the loop `$body` compiled for AVX2 and FMA, and for AVX-512 besides
/// (the same operations on each value, so the same bits at each [`VectorLevel`]).
///
/// Each takes its level's token.
macro_rules! at_vector_levels {
    ($body:ident => $avx2:ident, $avx512:ident ($($arg:ident: $ty:ty),*)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn $avx2(_: cpu::Avx2, $($arg: $ty),*) {
            $body($($arg),*);
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f,avx2,fma")]
        fn $avx512(_: cpu::Avx512, $($arg: $ty),*) {
            $body($($arg),*);
        }
    };
}

at_vector_levels!(rms_norm_body => rms_norm_avx2, rms_norm_avx512(
    x: &[f32], w: &[f32], eps: f32, out: &mut [f32]
));

/// Which dimensions of a head RoPE rotates together.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: GGUF Llama files (their Q and K rows are permuted to it).
    #[default]
    Interleaved,
    /// Split halves `(i, i + rope_dim/2)`: GPT-NeoX's layout (Gemma, Qwen, Phi-3).
    Neox,
}

/// How a model stretches RoPE's angles past the context it was first trained on, as ggml's
/// `rope` computes them: pair `i` at position `p` turns by `p * base^(-2i/d) / factor_i`
/// (`te`), scaled by `freq_scale` (`ti = freq_scale * te`); under YaRN the low-frequency
/// pairs take `ti`, the high-frequency ones `te`, with a linear ramp between; cos and sin are
/// multiplied by `mscale`. The default changes nothing, to the bit.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct RopeScaling {
    /// One divisor per rotated pair: Llama 3's `rope_freqs` (its long-context frequency
    /// correction), Phi-3's long or short factors.
    pub freq_factors: Option<Vec<f32>>,
    /// `1 / factor` of linear (position-interpolation) and YaRN scaling.
    pub freq_scale: f32,
    pub yarn: Option<Yarn>,
    /// Multiplies cos and sin, so each attention score by its square: Phi-3's
    /// `rope.scaling.attn_factor`, times YaRN's `1 + 0.1 ln(factor)`.
    pub mscale: f32,
}

impl Default for RopeScaling {
    fn default() -> Self {
        RopeScaling {
            freq_factors: None,
            freq_scale: 1.0,
            yarn: None,
            mscale: 1.0,
        }
    }
}

/// YaRN's ramp between interpolated and extrapolated pairs (ggml's `rope_yarn_corr_dims`).
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
pub struct Yarn {
    /// The context the model was trained on before scaling.
    pub orig_ctx: usize,
    /// Pairs that turn more than `beta_fast` times over `orig_ctx` keep their frequency.
    pub beta_fast: f32,
    /// Pairs that turn fewer than `beta_slow` times are fully interpolated.
    pub beta_slow: f32,
}

impl RopeScaling {
    /// Whether this changes any angle (the plain table is then used as is).
    pub fn is_identity(&self) -> bool {
        *self == RopeScaling::default()
    }

    /// Per pair: the angle's multiplier before and after the ramp (`1/factor_i`, and
    /// `freq_scale/factor_i`), and the ramp's weight on the unscaled angle.
    fn pairs(&self, rope_dim: usize, base: f32) -> Vec<(f64, f64, f64)> {
        let half = rope_dim / 2;
        let corr = self.yarn.map(|y| {
            // Pair index at which a pair turns `b` times over the original context.
            let c = |b: f32| {
                let n = y.orig_ctx as f64 / (f64::from(b) * 2.0 * std::f64::consts::PI);
                rope_dim as f64 * n.ln() / (2.0 * f64::from(base).ln())
            };
            let lo = c(y.beta_fast).floor().max(0.0);
            let hi = c(y.beta_slow).ceil().min(rope_dim as f64 - 1.0);
            (lo, hi)
        });
        (0..half)
            .map(|i| {
                let ff = self.freq_factors.as_ref().map_or(1.0, |f| f64::from(f[i]));
                let ramp = corr.map_or(0.0, |(lo, hi)| {
                    let y = (i as f64 - lo) / (hi - lo).max(0.001);
                    1.0 - y.clamp(0.0, 1.0)
                });
                (1.0 / ff, f64::from(self.freq_scale) / ff, ramp)
            })
            .collect()
    }
}

/// Rotary position embedding tables: `cos`/`sin` of `pos * base^(-2i/rope_dim)` for each
/// position and each rotated pair, computed in f64 (then scaled: [`RopeScaling`]); and which
/// dimensions form the pairs.
#[derive(Default, Debug)]
pub struct RopeTable {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    half: usize,
    pub style: RopeStyle,
    /// The angle transform applied by [`Self::extend`] (set with [`Self::set_scaling`]).
    scaling: RopeScaling,
    /// [`RopeScaling::pairs`] for the rotated width and base they were computed for, kept
    /// so that a decode step does not allocate.
    pairs: Vec<(f64, f64, f64)>,
    pairs_for: Option<(usize, u32)>,
}

impl RopeTable {
    /// Selects the angle transform of the rows [`Self::extend`] adds next.
    pub fn set_scaling(&mut self, scaling: &RopeScaling) {
        if self.scaling != *scaling {
            self.scaling = scaling.clone();
            self.pairs_for = None;
        }
    }

    /// Fills the tables for positions `pos0..pos0+n` (reusing the buffers).
    pub fn fill(&mut self, pos0: usize, n: usize, rope_dim: usize, base: f32) {
        self.cos.clear();
        self.sin.clear();
        self.extend(pos0, n, rope_dim, base);
    }

    /// Appends rows for positions `pos0..pos0+n` (the next segment of a batch).
    pub fn extend(&mut self, pos0: usize, n: usize, rope_dim: usize, base: f32) {
        self.half = rope_dim / 2;
        if self.scaling.is_identity() {
            for p in pos0..pos0 + n {
                for i in 0..self.half {
                    let inv_freq = f64::from(base).powf(-2.0 * i as f64 / rope_dim as f64);
                    let theta = p as f64 * inv_freq;
                    self.cos.push(theta.cos() as f32);
                    self.sin.push(theta.sin() as f32);
                }
            }
            return;
        }
        if self.pairs_for != Some((rope_dim, base.to_bits())) {
            self.pairs = self.scaling.pairs(rope_dim, base);
            self.pairs_for = Some((rope_dim, base.to_bits()));
        }
        let ms = f64::from(self.scaling.mscale);
        for p in pos0..pos0 + n {
            for (i, &(unscaled, scaled, ramp)) in self.pairs.iter().enumerate() {
                let theta = p as f64 * f64::from(base).powf(-2.0 * i as f64 / rope_dim as f64);
                let th = theta * scaled * (1.0 - ramp) + theta * unscaled * ramp;
                self.cos.push((th.cos() * ms) as f32);
                self.sin.push((th.sin() * ms) as f32);
            }
        }
    }

    /// Rotates the first `rope_dim` dims of each head in `x` (`n x n_heads*head_dim`) by the
    /// angle of its row's position: pairs `(2i, 2i+1)` (GGUF Llama files) or, NeoX style,
    /// `(i, i + rope_dim/2)`.
    pub fn apply(&self, x: &mut [f32], n_heads: usize, head_dim: usize) {
        self.apply_at(x, n_heads, head_dim, 0);
    }

    /// [`apply`](Self::apply) to the `rope_dim` dims of each head that start at `offset`
    /// (latent attention rotates the tail of each query head and of each cached row).
    pub fn apply_at(&self, x: &mut [f32], n_heads: usize, head_dim: usize, offset: usize) {
        #[cfg(target_arch = "x86_64")]
        match vector_level() {
            VectorLevel::Avx512(t) => {
                // SAFETY: the token proves the loop's features.
                return unsafe { self.rotate_avx512(t, x, n_heads, head_dim, offset) };
            }
            VectorLevel::Avx2(t) => {
                // SAFETY: as above.
                return unsafe { self.rotate_avx2(t, x, n_heads, head_dim, offset) };
            }
            VectorLevel::None => {}
        }
        self.rotate(x, n_heads, head_dim, offset);
    }

    /// [`apply_at`](Self::apply_at)'s loop: each pair `a*cos - b*sin`, `a*sin + b*cos`, the
    /// style chosen once per head so the pairs' loop vectorizes (the same operations on each
    /// pair at every vector width, so the same bits). With the style matched per pair it did
    /// not: decode's 12 heads of 64 took 936 TSC ticks a layer in L1 (Zen 4).
    #[inline(always)]
    fn rotate(&self, x: &mut [f32], n_heads: usize, head_dim: usize, offset: usize) {
        let (row, half) = (n_heads * head_dim, self.half);
        for (t, xr) in x.chunks_exact_mut(row).enumerate() {
            let cos = &self.cos[t * half..(t + 1) * half];
            let sin = &self.sin[t * half..(t + 1) * half];
            for head in xr.chunks_exact_mut(head_dim) {
                let head = &mut head[offset..offset + 2 * half];
                match self.style {
                    RopeStyle::Interleaved => {
                        for ((p, &c), &s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                            let (a, b) = (p[0], p[1]);
                            p[0] = a * c - b * s;
                            p[1] = a * s + b * c;
                        }
                    }
                    RopeStyle::Neox => {
                        let (lo, hi) = head.split_at_mut(half);
                        for (((a, b), &c), &s) in lo.iter_mut().zip(hi).zip(cos).zip(sin) {
                            let (va, vb) = (*a, *b);
                            *a = va * c - vb * s;
                            *b = va * s + vb * c;
                        }
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn rotate_avx2(
        &self,
        _: cpu::Avx2,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        offset: usize,
    ) {
        self.rotate(x, n_heads, head_dim, offset);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn rotate_avx512(
        &self,
        _: cpu::Avx512,
        x: &mut [f32],
        n_heads: usize,
        head_dim: usize,
        offset: usize,
    ) {
        self.rotate(x, n_heads, head_dim, offset);
    }
}

/// [`rms_norm`] in place on the first `w.len()` values of each row of `stride` values.
pub fn rms_norm_prefix(x: &mut [f32], stride: usize, w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(stride) {
        let xr = &mut xr[..d];
        let ss = sum_squares(xr);
        let scale = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// SwiGLU: `gate = silu(gate) * up`, in place, `silu(g) = g / (1 + e^-g)` with the vectorizable
/// [`exp_poly`] (within 2 ulp of libm's, as llama.cpp's own vector `expf` is): a libm call per
/// value kept decode's 1,536-wide FFN serial on one thread, 4% of a SmolLM2 decode step.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    let level = vector_level();
    gated_in_chunks(gate, up, |g, u| {
        #[cfg(target_arch = "x86_64")]
        match level {
            // SAFETY: the token proves the loop's features.
            VectorLevel::Avx512(t) => return unsafe { swiglu_avx512(t, g, u) },
            // SAFETY: as above.
            VectorLevel::Avx2(t) => return unsafe { swiglu_avx2(t, g, u) },
            VectorLevel::None => {}
        }
        swiglu_portable(g, u);
    });
}

/// The widest vectors the element-wise loops are compiled for on this CPU: the same loop body
/// at every level (the same operations on each value, so the same bits), sixteen values a
/// vector with AVX-512 (SwiGLU over decode's 1,536 values in L1: 2,730 -> 1,660 TSC ticks on
/// Zen 4, where the AVX2 build is bound by the instructions' rate, not their width).
#[cfg(target_arch = "x86_64")]
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum VectorLevel {
    None,
    Avx2(cpu::Avx2),
    Avx512(cpu::Avx512),
}

#[cfg(target_arch = "x86_64")]
fn vector_level() -> VectorLevel {
    vector_level_at(cpu::level())
}

/// The vector level of a [`cpu::Level`], where it runs here.
#[cfg(target_arch = "x86_64")]
fn vector_level_at(level: cpu::Level) -> VectorLevel {
    if let Some(t) = level.avx512() {
        VectorLevel::Avx512(t)
    } else if let Some(t) = level.avx2() {
        VectorLevel::Avx2(t)
    } else {
        VectorLevel::None
    }
}

/// [`swiglu`] on one chunk; the portable build is the scalar twin of the AVX2 one.
#[inline(always)]
fn swiglu_body(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = x / (1.0 + exp_poly(-x)) * u;
    }
}

fn swiglu_portable(gate: &mut [f32], up: &[f32]) {
    swiglu_body(gate, up);
}

at_vector_levels!(swiglu_body => swiglu_avx2, swiglu_avx512(gate: &mut [f32], up: &[f32]));

/// Runs `f` on matching chunks of `gate` and `up` in parallel.
fn gated_in_chunks(gate: &mut [f32], up: &[f32], f: impl Fn(&mut [f32], &[f32]) + Sync) {
    gate.par_chunks_mut(ELEMENTWISE_CHUNK)
        .zip(up.par_chunks(ELEMENTWISE_CHUNK))
        .for_each(|(g, u)| f(g, u));
}

/// Values per parallel task of an element-wise operation: big enough that a task outweighs
/// its scheduling, small enough that a prefill's FFN (rows x n_ff) spreads over the threads.
/// Every value is computed alone, so the split never changes a bit.
const ELEMENTWISE_CHUNK: usize = 16 * 1024;

/// GeGLU: `gate = gelu(gate) * up`, in place, with GELU's tanh approximation
/// `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))` (what Gemma was trained with), computed
/// as `g / (1 + exp(-2 sqrt(2/pi) (g + 0.044715 g^3)))` (the same function: `(1 + tanh u) / 2`
/// is `sigmoid(2u)`) with a vectorizable `exp` ([`exp_poly`]): one exponential and a division
/// per value instead of libm's tanh, which made the GELU a quarter of Gemma's prefill.
pub fn geglu_tanh(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    let level = vector_level();
    gated_in_chunks(gate, up, |g, u| {
        #[cfg(target_arch = "x86_64")]
        match level {
            // SAFETY: the token proves the loop's features.
            VectorLevel::Avx512(t) => return unsafe { geglu_tanh_avx512(t, g, u) },
            // SAFETY: as above.
            VectorLevel::Avx2(t) => return unsafe { geglu_tanh_avx2(t, g, u) },
            VectorLevel::None => {}
        }
        geglu_tanh_portable(g, u);
    });
}

/// [`geglu_tanh`] on one chunk; the portable build is the scalar twin of the AVX2 one (the
/// same operations in the same order: the same bits).
#[inline(always)]
fn geglu_tanh_body(gate: &mut [f32], up: &[f32]) {
    // -2 sqrt(2/pi), and that times 0.044715.
    const A: f32 = -1.595_769_2;
    const B: f32 = -0.071_354_815;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        let z = x * (A + B * (x * x));
        *g = x / (1.0 + exp_poly(z)) * u;
    }
}

fn geglu_tanh_portable(gate: &mut [f32], up: &[f32]) {
    geglu_tanh_body(gate, up);
}

at_vector_levels!(geglu_tanh_body => geglu_tanh_avx2, geglu_tanh_avx512(
    gate: &mut [f32], up: &[f32]
));

/// `e^x` without branches, so loops over it vectorize (a libm call per value cost a quarter of
/// prefill attention, and of Gemma's GELU): range reduction `x = n ln2 + r` with ln2 in two
/// parts (Cody-Waite), Cephes' degree-6 polynomial for `e^r` on `|r| <= ln2/2`, then `2^n`
/// through the exponent bits; within 2 ulp. Inputs are clamped to `[-87, 88]`: below, the
/// result is e^-87 (~1.6e-38) rather than 0 (no subnormals); above, ~1.65e38 rather than
/// infinity. Attention's AVX2 twin computes the same bits from the same constants.
#[inline(always)]
pub fn exp_poly(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let t = x * EXP_LOG2E + EXP_ROUND;
    let n = t - EXP_ROUND;
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let p = EXP_POLY[1..].iter().fold(EXP_POLY[0], |p, &c| p * r + c);
    let er = p * r * r + r + 1.0;
    // t's low mantissa bits are n (its ulp is 1 between 2^23 and 2^24): 2^n without a
    // float-to-int conversion.
    er * f32::from_bits(
        t.to_bits()
            .wrapping_sub(EXP_ROUND.to_bits())
            .wrapping_add(127)
            << 23,
    )
}

/// Constants of [`exp_poly`].
pub(crate) const EXP_MIN: f32 = -87.0;
pub(crate) const EXP_MAX: f32 = 88.0;
pub(crate) const EXP_LOG2E: f32 = std::f32::consts::LOG2_E;
pub(crate) const EXP_LN2_HI: f32 = 0.693_359_4;
pub(crate) const EXP_LN2_LO: f32 = -2.121_944_4e-4;
/// Adding and subtracting 1.5 * 2^23 rounds to the nearest integer in any vector unit.
pub(crate) const EXP_ROUND: f32 = 12_582_912.0;
/// Cephes' expf polynomial, highest degree first.
pub(crate) const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_2e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `a . b` in eight interleaved partial sums, so it vectorizes (a single running sum would
/// serialize every addition, and the compiler may not reorder it).
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `v` resized to `n` values (growing only when it must), as a slice: a reusable buffer of a
/// pass, so steady-state steps do not allocate.
pub fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

/// [`sized`] with every value zero: a buffer that is accumulated into.
pub fn zeroed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    &mut v[..]
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `ln(sum(exp(logits)))`, accumulated in f64: the normalizer of a log-softmax, so a token's
/// log-probability is `logit - log_sum_exp`.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from(l - max).exp()).sum();
    f64::from(max) + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vector level this CPU has, after the portable loop: each must give its bits.
    #[cfg(target_arch = "x86_64")]
    fn levels() -> Vec<VectorLevel> {
        let mut v: Vec<VectorLevel> = crate::cpu::levels_for_tests()
            .into_iter()
            .map(vector_level_at)
            .collect();
        v.dedup();
        v
    }

    /// Values over several binades, both signs, zeros and the far tails.
    fn spread(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let u = (x >> 8) as f32 / (1 << 24) as f32 - 0.5;
                match i % 97 {
                    0 => 0.0,
                    1 => -120.0,
                    2 => 95.0,
                    _ => u * 2f32.powi((i % 13) as i32 - 4),
                }
            })
            .collect()
    }

    /// SwiGLU, GeGLU and RMSNorm compiled for each vector level give the portable loop's bits,
    /// over lengths with and without a tail past the widest vector.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn element_wise_levels_give_the_portable_bits() {
        for n in [1, 7, 16, 33, 576, 1_536, 1_541] {
            let (g, u) = (spread(n, 1), spread(n, 2));
            let (mut want_s, mut want_g) = (g.clone(), g.clone());
            swiglu_portable(&mut want_s, &u);
            geglu_tanh_portable(&mut want_g, &u);
            let w: Vec<f32> = spread(n, 3).iter().map(|v| 1.0 + v).collect();
            let mut want_n = vec![0f32; 2 * n];
            let rows = [g.clone(), u.clone()].concat();
            rms_norm_body(&rows, &w, 1e-5, &mut want_n);
            for level in levels() {
                let (mut s, mut ge, mut nr) = (g.clone(), g.clone(), vec![0f32; 2 * n]);
                match level {
                    VectorLevel::None => {
                        swiglu_portable(&mut s, &u);
                        geglu_tanh_portable(&mut ge, &u);
                        rms_norm_body(&rows, &w, 1e-5, &mut nr);
                    }
                    // SAFETY: the token proves the loops' features.
                    VectorLevel::Avx2(t) => unsafe {
                        swiglu_avx2(t, &mut s, &u);
                        geglu_tanh_avx2(t, &mut ge, &u);
                        rms_norm_avx2(t, &rows, &w, 1e-5, &mut nr);
                    },
                    // SAFETY: as above.
                    VectorLevel::Avx512(t) => unsafe {
                        swiglu_avx512(t, &mut s, &u);
                        geglu_tanh_avx512(t, &mut ge, &u);
                        rms_norm_avx512(t, &rows, &w, 1e-5, &mut nr);
                    },
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&s), bits(&want_s), "swiglu, {level:?}, n = {n}");
                assert_eq!(bits(&ge), bits(&want_g), "geglu, {level:?}, n = {n}");
                assert_eq!(bits(&nr), bits(&want_n), "rms_norm, {level:?}, n = {n}");
            }
        }
    }

    /// RoPE at each vector level against the pair-by-pair form it replaced (the dimensions of a
    /// pair looked up per pair), both styles, rows at different positions, a rotated tail past
    /// an offset (latent attention) and a head wider than the rotated part: the same bits.
    #[test]
    fn rope_levels_give_the_pairwise_bits() {
        fn pairwise(t: &RopeTable, x: &mut [f32], n_heads: usize, hd: usize, offset: usize) {
            for (r, xr) in x.chunks_exact_mut(n_heads * hd).enumerate() {
                let cos = &t.cos[r * t.half..(r + 1) * t.half];
                let sin = &t.sin[r * t.half..(r + 1) * t.half];
                for head in xr.chunks_exact_mut(hd) {
                    let head = &mut head[offset..];
                    for i in 0..t.half {
                        let (ia, ib) = match t.style {
                            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                            RopeStyle::Neox => (i, i + t.half),
                        };
                        let (a, b) = (head[ia], head[ib]);
                        head[ia] = a * cos[i] - b * sin[i];
                        head[ib] = a * sin[i] + b * cos[i];
                    }
                }
            }
        }
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            for (hd, rope_dim, offset) in [(64, 64, 0), (128, 64, 0), (96, 32, 64), (64, 16, 8)] {
                let mut t = RopeTable {
                    style,
                    ..Default::default()
                };
                t.fill(5, 3, rope_dim, 10_000.0);
                let x = spread(3 * 9 * hd, 4);
                let mut want = x.clone();
                pairwise(&t, &mut want, 9, hd, offset);
                let mut got = x.clone();
                t.apply_at(&mut got, 9, hd, offset);
                assert_eq!(got, want, "{style:?}, {hd}/{rope_dim}/{offset}");
                #[cfg(target_arch = "x86_64")]
                for level in levels() {
                    let mut got = x.clone();
                    match level {
                        VectorLevel::None => t.rotate(&mut got, 9, hd, offset),
                        // SAFETY: the token proves the loop's features.
                        VectorLevel::Avx2(c) => unsafe {
                            t.rotate_avx2(c, &mut got, 9, hd, offset)
                        },
                        // SAFETY: as above.
                        VectorLevel::Avx512(c) => unsafe {
                            t.rotate_avx512(c, &mut got, 9, hd, offset)
                        },
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{style:?}, {level:?}");
                }
            }
        }
    }

    /// The eight partial sums against one sum in sequence, for lengths with and without a tail
    /// past the last eight: all terms are positive, so each sum is within `n` roundings (unit
    /// roundoff 2^-53) of the exact one, and the two within `n x 2^-52` of each other relative
    /// (6.4e-14 at n = 576). A dropped tail or partial sum moves the result by a whole term,
    /// at least 4e-4 of it for these inputs.
    #[test]
    fn partial_sums_of_squares_match_one_sequence() {
        for n in [1, 7, 8, 9, 63, 64, 65, 576] {
            let x: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let sequential: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let got = sum_squares(&x);
            assert!(
                (got - sequential).abs() <= n as f64 * f64::EPSILON * sequential,
                "n {n}: {got} against {sequential}"
            );
        }
    }

    /// The vectorized GELU against the tanh form in f64: within 4e-6 relative plus 1e-9. The
    /// exponential is within 2 ulp, but its argument `x (a + b x^2)` is rounded to f32 first
    /// (three roundings) and `e^z` turns z's absolute error (up to ~1e-6 at |z| ~ 10, the
    /// negative tail) into that relative error; measured 1.6e-6 at worst. The AVX2 build gives
    /// the portable build's bits.
    #[test]
    fn geglu_matches_the_tanh_form_and_its_twin() {
        let n = 40_000;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 7e-4).collect();
        let u: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut fast = g.clone();
        geglu_tanh(&mut fast, &u);
        for ((&x, &u), &y) in g.iter().zip(&u).zip(&fast) {
            let x64 = f64::from(x);
            let t = ((2.0 / std::f64::consts::PI).sqrt() * (x64 + 0.044715 * x64.powi(3))).tanh();
            let want = 0.5 * x64 * (1.0 + t) * f64::from(u);
            let tol = 4e-6 * want.abs() + 1e-9;
            assert!(
                (f64::from(y) - want).abs() <= tol,
                "gelu({x}) * {u} = {y}, want {want}"
            );
        }
        let mut twin = g.clone();
        for (gc, uc) in twin
            .chunks_mut(ELEMENTWISE_CHUNK)
            .zip(u.chunks(ELEMENTWISE_CHUNK))
        {
            geglu_tanh_portable(gc, uc);
        }
        assert_eq!(twin, fast);
        // Far tails: 0 below, the identity above, never NaN.
        let mut ext = [-1e4f32, -50.0, 50.0, 1e4];
        geglu_tanh(&mut ext, &[1.0; 4]);
        assert_eq!(ext.map(|v| v.abs() < 1e-30 || v > 1.0), [true; 4]);
        assert_eq!(&ext[2..], &[50.0, 1e4]);
    }

    /// The vectorized SiLU against `g / (1 + e^-g)` in f64: within 3e-7 relative plus 1e-30
    /// (the exponential's 2 ulp, damped by `1 + e^-g`, plus the division's and the product's
    /// roundings). The AVX2 build gives the portable build's bits; far tails give 0 and the
    /// identity, never NaN.
    #[test]
    fn swiglu_matches_the_exact_form_and_its_twin() {
        let n = 40_000;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 2e-3).collect();
        let u: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let mut fast = g.clone();
        swiglu(&mut fast, &u);
        for ((&x, &u), &y) in g.iter().zip(&u).zip(&fast) {
            let x64 = f64::from(x);
            let want = x64 / (1.0 + (-x64).exp()) * f64::from(u);
            let tol = 3e-7 * want.abs() + 1e-30;
            assert!(
                (f64::from(y) - want).abs() <= tol,
                "silu({x}) * {u} = {y}, want {want}"
            );
        }
        let mut twin = g.clone();
        for (gc, uc) in twin
            .chunks_mut(ELEMENTWISE_CHUNK)
            .zip(u.chunks(ELEMENTWISE_CHUNK))
        {
            swiglu_portable(gc, uc);
        }
        assert_eq!(twin, fast);
        let mut ext = [-1e4f32, -100.0, 100.0, 1e4];
        swiglu(&mut ext, &[1.0; 4]);
        assert_eq!(ext.map(|v| v.abs() < 1e-30 || v >= 100.0), [true; 4]);
        assert_eq!(&ext[2..], &[100.0, 1e4]);
    }

    #[test]
    fn rms_norm_unit_rms() {
        let mut out = [0.0; 4];
        rms_norm(
            &[2.0, -2.0, 2.0, -2.0],
            &[1.0, 1.0, 0.5, 1.0],
            0.0,
            &mut out,
        );
        assert_eq!(out, [1.0, -1.0, 0.5, -1.0]);
    }

    #[test]
    fn rope_rotates_pairs_by_position() {
        let mut t = RopeTable::default();
        t.fill(1, 1, 4, 10_000.0);
        // Pair 0 turns by 1 rad, pair 1 by 1/100 rad.
        let mut x = [1.0, 0.0, 1.0, 0.0];
        t.apply(&mut x, 1, 4);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        assert!((x[2] - 0.01f32.cos()).abs() < 1e-6 && (x[3] - 0.01f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn neox_rope_rotates_split_halves() {
        let mut t = RopeTable {
            style: RopeStyle::Neox,
            ..Default::default()
        };
        t.fill(1, 1, 4, 10_000.0);
        // Pair 0 is dims (0, 2) and turns by 1 rad; pair 1, dims (1, 3), by 1/100 rad.
        let mut x = [1.0, 1.0, 0.0, 0.0];
        t.apply(&mut x, 1, 4);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        assert!((x[1] - 0.01f32.cos()).abs() < 1e-6 && (x[3] - 0.01f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn geglu_matches_gelu_values() {
        // gelu_tanh(1) = 0.841192, gelu_tanh(-1) = -0.158808, gelu(0) = 0.
        let mut g = [1.0f32, -1.0, 0.0];
        geglu_tanh(&mut g, &[2.0, 1.0, 5.0]);
        assert!((g[0] - 2.0 * 0.841_192).abs() < 1e-5, "{g:?}");
        assert!((g[1] + 0.158_808).abs() < 1e-5, "{g:?}");
        assert_eq!(g[2], 0.0);
    }

    #[test]
    fn log_sum_exp_normalizes() {
        let logits = [1.0f32, 2.0, 3.0];
        let lse = log_sum_exp(&logits);
        let s: f64 = logits.iter().map(|&v| (f64::from(v) - lse).exp()).sum();
        assert!((s - 1.0).abs() < 1e-12);
    }
}
