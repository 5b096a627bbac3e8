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
    fn sigmoid_matches_the_definition() {
        for i in -400..400 {
            let x = i as f32 * 0.05;
            let want = 1.0 / (1.0 + (-f64::from(x)).exp());
            assert!((f64::from(sigmoid(x)) - want).abs() < 1e-6, "{x}");
        }
    }
}
