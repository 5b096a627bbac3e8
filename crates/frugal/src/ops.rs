//! Element-wise building blocks of the forward pass.

use crate::model::features::RopeStyle;

/// RMSNorm: `out = x / sqrt(mean(x^2) + eps) * w`, row by row (`x` is `n x w.len()`).
/// The mean is accumulated in f64, as ggml does.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * scale * g;
        }
    }
}

/// Rotary position embedding tables: `cos`/`sin` of `pos * base^(-2i/rope_dim)` for each
/// position and each rotated pair, computed in f64; and which dimensions form the pairs.
#[derive(Default, Debug)]
pub struct RopeTable {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    half: usize,
    pub style: RopeStyle,
}

impl RopeTable {
    /// Fills the tables for positions `pos0..pos0+n` (reusing the buffers).
    pub fn fill(&mut self, pos0: usize, n: usize, rope_dim: usize, base: f32) {
        self.cos.clear();
        self.sin.clear();
        self.extend(pos0, n, rope_dim, base);
    }

    /// Appends rows for positions `pos0..pos0+n` (the next segment of a batch).
    pub fn extend(&mut self, pos0: usize, n: usize, rope_dim: usize, base: f32) {
        self.half = rope_dim / 2;
        for p in pos0..pos0 + n {
            for i in 0..self.half {
                let inv_freq = f64::from(base).powf(-2.0 * i as f64 / rope_dim as f64);
                let theta = p as f64 * inv_freq;
                self.cos.push(theta.cos() as f32);
                self.sin.push(theta.sin() as f32);
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
        let row = n_heads * head_dim;
        for (t, xr) in x.chunks_exact_mut(row).enumerate() {
            let cos = &self.cos[t * self.half..(t + 1) * self.half];
            let sin = &self.sin[t * self.half..(t + 1) * self.half];
            for head in xr.chunks_exact_mut(head_dim) {
                let head = &mut head[offset..];
                for i in 0..self.half {
                    let (ia, ib) = match self.style {
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + self.half),
                    };
                    let (a, b) = (head[ia], head[ib]);
                    head[ia] = a * cos[i] - b * sin[i];
                    head[ib] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

/// [`rms_norm`] in place on the first `w.len()` values of each row of `stride` values.
pub fn rms_norm_prefix(x: &mut [f32], stride: usize, w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(stride) {
        let xr = &mut xr[..d];
        let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = *v * scale * g;
        }
    }
}

/// SwiGLU: `gate = silu(gate) * up`, in place.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// GeGLU: `gate = gelu(gate) * up`, in place, with GELU's tanh approximation
/// `0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))` (what Gemma was trained with).
pub fn geglu_tanh(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh()) * u;
    }
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
