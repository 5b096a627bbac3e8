//! Activations quantized to 8 bits per block of 32, so matrix products with block-quantized
//! weights run on integer dot products (as llama.cpp does with its Q8_0/Q8_1 activation blocks).
//!
//! Per block: a scale `d = absmax / 127`, 32 signed bytes `q = round(x / d)`, and `s = d * sum(q)`,
//! which lets formats with an offset (Q4_1's minimum, Q4_0's -8) apply it once per block instead of
//! once per element: `sum((dw*qw + m) * (dx*qx)) = dw*dx*sum(qw*qx) + m*s`.

pub const QK: usize = 32;

/// The precision of the activations fed to matrix products: a lever of its own.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// Exact f32 arithmetic on the dequantized weights (what llama.cpp's F32 file computes).
    #[default]
    F32,
    /// 8 bits per block of 32 for block-quantized weights: integer dot products, as llama.cpp
    /// runs quantized files. Float weights (F32, F16, BF16) keep f32 activations.
    Q8,
}

impl std::str::FromStr for Activations {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "exact" => Ok(Activations::F32),
            "q8" | "q8_0" | "int8" => Ok(Activations::Q8),
            other => Err(format!(
                "unknown activation precision {other:?} (expected f32 or q8)"
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
    pub k: usize,
    pub n: usize,
}

/// One quantized row.
#[derive(Copy, Clone, Debug)]
pub struct Q8Row<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl Q8Acts {
    /// Quantizes `x` (`n x k`, row-major), reusing the buffers.
    pub fn quantize(&mut self, x: &[f32], k: usize) {
        debug_assert!(k.is_multiple_of(QK) && x.len().is_multiple_of(k));
        self.k = k;
        self.n = x.len() / k;
        self.qs.resize(x.len(), 0);
        self.d.resize(x.len() / QK, 0.0);
        self.s.resize(x.len() / QK, 0.0);
        for (b, (xb, qb)) in x
            .chunks_exact(QK)
            .zip(self.qs.chunks_exact_mut(QK))
            .enumerate()
        {
            // Eight running maxima, one per lane, so the scan vectorizes (max is exact in any
            // order).
            let mut lanes = [0f32; 8];
            for c in xb.chunks_exact(8) {
                for (m, &v) in lanes.iter_mut().zip(c) {
                    *m = m.max(v.abs());
                }
            }
            let amax = lanes.iter().fold(0f32, |m, &v| m.max(v));
            let d = amax / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (q, &v) in qb.iter_mut().zip(xb) {
                // Round half away from zero with a truncating conversion, which vectorizes
                // (`f32::round` is a library call per element on baseline x86-64).
                let r = v * id;
                *q = (r + 0.5f32.copysign(r)) as i32 as i8;
                sum += i32::from(*q);
            }
            self.d[b] = d;
            self.s[b] = d * sum as f32;
        }
    }

    pub fn row(&self, t: usize) -> Q8Row<'_> {
        let nb = self.k / QK;
        Q8Row {
            qs: &self.qs[t * self.k..(t + 1) * self.k],
            d: &self.d[t * nb..(t + 1) * nb],
            s: &self.s[t * nb..(t + 1) * nb],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }
}
