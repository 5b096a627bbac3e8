//! AdamW with decoupled weight decay (Loshchilov & Hutter), global-norm gradient clipping, and
//! a learning rate that warms up linearly and then decays on a cosine.

use rayon::prelude::*;

use crate::params::Tensor;

/// Hyperparameters of the optimizer.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay, applied to matrices only (not to norm weights).
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// The two moments of one tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Moments {
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// AdamW's state: the moments of every trained tensor, by position in the tensor list.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    pub config: AdamWConfig,
    /// Updates taken so far (for bias correction).
    pub t: u64,
    pub moments: Vec<Moments>,
}

impl AdamW {
    pub fn new(config: AdamWConfig, sizes: impl IntoIterator<Item = usize>) -> Self {
        AdamW {
            config,
            t: 0,
            moments: sizes
                .into_iter()
                .map(|n| Moments {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                })
                .collect(),
        }
    }

    /// One update of every tensor whose `trainable` flag is set:
    /// `m = β1 m + (1-β1) g`, `v = β2 v + (1-β2) g²`,
    /// `θ -= lr (m̂ / (sqrt(v̂) + ε) + λ θ)` with bias-corrected `m̂`, `v̂`.
    pub fn update(
        &mut self,
        params: &mut [&mut Tensor],
        grads: &[&Tensor],
        trainable: &[bool],
        lr: f32,
    ) {
        assert_eq!(params.len(), self.moments.len());
        self.t += 1;
        let c = self.config.clone();
        let bc1 = 1.0 - c.beta1.powi(self.t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.t as i32);
        params
            .par_iter_mut()
            .zip(grads.par_iter())
            .zip(self.moments.par_iter_mut())
            .zip(trainable.par_iter())
            .filter(|(_, t)| **t)
            .for_each(|(((p, g), mo), _)| {
                let wd = if p.vector { 0.0 } else { c.weight_decay };
                p.data
                    .par_chunks_mut(1 << 14)
                    .zip(g.data.par_chunks(1 << 14))
                    .zip(
                        mo.m.par_chunks_mut(1 << 14)
                            .zip(mo.v.par_chunks_mut(1 << 14)),
                    )
                    .for_each(|((pc, gc), (mc, vc))| {
                        for i in 0..pc.len() {
                            let gi = gc[i];
                            mc[i] = c.beta1 * mc[i] + (1.0 - c.beta1) * gi;
                            vc[i] = c.beta2 * vc[i] + (1.0 - c.beta2) * gi * gi;
                            let mh = mc[i] / bc1;
                            let vh = vc[i] / bc2;
                            pc[i] -= lr * (mh / (vh.sqrt() + c.eps) + wd * pc[i]);
                        }
                    });
            });
    }
}

/// The global L2 norm of the gradients (summed in f64 per tensor, then in a fixed order).
pub fn global_norm(grads: &[&Tensor]) -> f64 {
    let per: Vec<f64> = grads
        .par_iter()
        .map(|g| {
            g.data
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>()
        })
        .collect();
    per.iter().sum::<f64>().sqrt()
}

/// Scales the gradients so their global norm is at most `max_norm`; returns the norm before.
pub fn clip(grads: &mut [&mut Tensor], max_norm: f64) -> f64 {
    let norm = global_norm(&grads.iter().map(|g| &**g).collect::<Vec<_>>());
    if max_norm > 0.0 && norm > max_norm {
        let s = (max_norm / norm) as f32;
        grads
            .par_iter_mut()
            .for_each(|g| g.data.iter_mut().for_each(|v| *v *= s));
    }
    norm
}

/// Linear warmup to `lr` over `warmup` steps, then cosine decay to `lr * min_ratio` at `total`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Schedule {
    pub lr: f32,
    pub warmup: usize,
    pub total: usize,
    pub min_ratio: f32,
}

impl Schedule {
    /// The learning rate of update `step` (0-based).
    pub fn lr_at(&self, step: usize) -> f32 {
        if step < self.warmup {
            return self.lr * (step + 1) as f32 / self.warmup as f32;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f32 / span as f32).min(1.0);
        let cos = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        self.lr * (self.min_ratio + (1.0 - self.min_ratio) * cos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays() {
        let s = Schedule {
            lr: 1.0,
            warmup: 10,
            total: 110,
            min_ratio: 0.1,
        };
        assert!((s.lr_at(0) - 0.1).abs() < 1e-6);
        assert!((s.lr_at(9) - 1.0).abs() < 1e-6);
        assert!((s.lr_at(10) - 1.0).abs() < 1e-6);
        assert!((s.lr_at(60) - 0.55).abs() < 1e-6);
        assert!((s.lr_at(110) - 0.1).abs() < 1e-6);
        assert!((s.lr_at(500) - 0.1).abs() < 1e-6);
    }

    #[test]
    fn adamw_first_step_moves_each_weight_by_lr() {
        // With bias correction, the first step is lr * sign(g) (plus decay) whatever |g| is.
        let mut p = Tensor::matrix("w", 1, 3);
        p.data = vec![1.0, -2.0, 0.5];
        let mut g = Tensor::matrix("w", 1, 3);
        g.data = vec![0.3, -1e-3, 4.0];
        let mut opt = AdamW::new(
            AdamWConfig {
                weight_decay: 0.5,
                eps: 0.0,
                ..Default::default()
            },
            [3],
        );
        opt.update(&mut [&mut p], &[&g], &[true], 0.1);
        let want = [
            1.0 - 0.1 * (1.0 + 0.5),
            -2.0 + 0.1 * (1.0 + 0.5 * 2.0),
            0.5 - 0.1 * (1.0 + 0.25),
        ];
        for (a, b) in p.data.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

    #[test]
    fn clipping_bounds_the_global_norm() {
        let mut a = Tensor::matrix("a", 1, 2);
        a.data = vec![3.0, 0.0];
        let mut b = Tensor::vector("b", 1);
        b.data = vec![4.0];
        let n = clip(&mut [&mut a, &mut b], 1.0);
        assert!((n - 5.0).abs() < 1e-12);
        assert!((global_norm(&[&a, &b]) - 1.0).abs() < 1e-6);
    }
}
