//! Scalar functions the element-wise loops call hundreds of millions of times per step, written
//! without branches or library calls so the loops vectorize.

/// `e^x` to within 2 ulp for x in [-87, 88] (tested against `f32::exp`); inputs outside are
/// clamped to that range. Range reduction `x = n ln2 + r` with ln2 split in two parts, then a degree-6
/// polynomial for `e^r` on |r| <= ln2/2, and `2^n` built in the exponent bits.
#[inline(always)]
pub fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 88.0);
    // Round to nearest by adding and subtracting 1.5·2²³ (exact for |x·log2e| < 2²²; a library
    // `rint` call would stop the loop from vectorizing).
    const SHIFT: f32 = 12_582_912.0;
    let n = (x * LOG2E + SHIFT) - SHIFT;
    let r = x - n * LN2_HI - n * LN2_LO;
    // Taylor coefficients 1/k! (the error of the truncated series on |r| <= 0.347 is < 1e-8).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    let bits = ((n as i32 + 127) as u32) << 23;
    p * f32::from_bits(bits)
}

/// The logistic function `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_fast(-x))
}

/// Lanes of the partial sums below: a sum accumulated in one variable is a chain of dependent
/// additions that the compiler may not reorder (strict IEEE semantics), so it cannot vectorize;
/// sixteen independent partial sums can.
const LANES: usize = 16;
/// Elements per f32 block before it is added into the f64 total (bounds f32 rounding).
const BLOCK: usize = 256;

/// `Σ f(a_i)`: f32 partial sums in 16 lanes per block of 256, blocks added in f64. The order is
/// fixed by the length alone, so results are reproducible.
#[inline(always)]
pub fn sum_map(a: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    sum_map2(a, a, |x, _| f(x))
}

/// `Σ f(a_i, b_i)` in the order of [`sum_map`].
#[inline(always)]
pub fn sum_map2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    sum_map3(a, b, a, |x, y, _| f(x, y))
}

/// `Σ f(a_i, b_i, c_i)` in the order of [`sum_map`].
#[inline(always)]
pub fn sum_map3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f64 {
    let n = a.len().min(b.len()).min(c.len());
    let mut total = 0f64;
    for ((ab, bb), cb) in a[..n]
        .chunks(BLOCK)
        .zip(b[..n].chunks(BLOCK))
        .zip(c[..n].chunks(BLOCK))
    {
        let mut lanes = [0f32; LANES];
        let (mut ai, mut bi, mut ci) = (
            ab.chunks_exact(LANES),
            bb.chunks_exact(LANES),
            cb.chunks_exact(LANES),
        );
        for ((x, y), z) in (&mut ai).zip(&mut bi).zip(&mut ci) {
            for l in 0..LANES {
                lanes[l] += f(x[l], y[l], z[l]);
            }
        }
        let mut s: f32 = lanes.iter().sum();
        for ((&x, &y), &z) in ai
            .remainder()
            .iter()
            .zip(bi.remainder())
            .zip(ci.remainder())
        {
            s += f(x, y, z);
        }
        total += f64::from(s);
    }
    total
}

/// The largest element (NEG_INFINITY for an empty slice), in 16 lanes.
#[inline(always)]
pub fn max_f32(a: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut it = a.chunks_exact(LANES);
    for x in &mut it {
        for l in 0..LANES {
            lanes[l] = lanes[l].max(x[l]);
        }
    }
    let m = lanes.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    it.remainder().iter().fold(m, |m, &v| m.max(v))
}

/// `row = exp(row * scale - shift)` in place; returns the sum of the new values (16 lanes).
#[inline(always)]
pub fn exp_in_place_sum(row: &mut [f32], scale: f32, shift: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut it = row.chunks_exact_mut(LANES);
    for x in &mut it {
        for l in 0..LANES {
            x[l] = exp_fast(x[l] * scale - shift);
            lanes[l] += x[l];
        }
    }
    let mut s: f32 = lanes.iter().sum();
    for v in it.into_remainder() {
        *v = exp_fast(*v * scale - shift);
        s += *v;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_fast_is_within_two_ulp() {
        let mut worst = 0;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp_fast(x), x.exp());
            worst = worst.max(ulps(a, b));
            x += 0.000_731;
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(exp_fast(-200.0), (-87.0f32).exp());
        assert!(exp_fast(0.0) == 1.0);
    }

    #[test]
    fn lane_sums_match_plain_sums() {
        for n in [0, 1, 15, 16, 17, 255, 256, 257, 1000] {
            let a: Vec<f32> = (0..n)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01)
                .collect();
            let want: f64 = a.iter().map(|&x| f64::from(x * x)).sum();
            assert!(
                (sum_map(&a, |x| x * x) - want).abs() <= 1e-5 * want.max(1.0),
                "{n}"
            );
            let m = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max_f32(&a), m);
            let mut r = a.clone();
            let s = exp_in_place_sum(&mut r, 2.0, 0.5);
            let want: f64 = a.iter().map(|&x| f64::from(x * 2.0 - 0.5).exp()).sum();
            assert!((f64::from(s) - want).abs() <= 1e-5 * want.max(1.0), "{n}");
        }
    }

    #[test]
    fn sigmoid_matches_the_definition() {
        for i in -400..400 {
            let x = i as f32 * 0.05;
            let want = 1.0 / (1.0 + (-f64::from(x)).exp());
            assert!((f64::from(sigmoid(x)) - want).abs() < 1e-6, "{x}");
        }
    }
}
