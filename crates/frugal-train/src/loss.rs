//! Losses on the logits, each with its gradient: hard-label cross-entropy, and soft targets
//! from one or several teachers (Hinton et al.: KL(p_teacher^τ ‖ p_student^τ)·τ², or the reverse
//! KL), mixed by a weight α:
//!
//! `loss = (1 - α)·CE(y, softmax(z)) + α·τ²·D(p^τ, q^τ)`, with `q^τ = softmax(z/τ)`.
//!
//! Gradients with respect to the student's logits `z`:
//! - CE: `softmax(z) - onehot(y)`;
//! - forward KL `Σ p (ln p - ln q)`: `(q - p)/τ`, so `τ(q - p)` after the τ² factor;
//! - reverse KL `Σ q (ln q - ln p)`: `q_j (f_j - Σ_i q_i f_i)/τ` with `f = ln q - ln p`, times τ².
//!
//! Each is averaged over the rows of an optimizer step: [`Objective::rows`] writes the
//! gradient already divided by that count.

use std::ops::Range;

use rayon::prelude::*;

use crate::math::{exp_fast, max_f32, sum_map, sum_map2, sum_map3};

/// Loss totals over some rows.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LossSums {
    /// Rows counted.
    pub rows: usize,
    /// Σ cross-entropy of the labels (nats).
    pub ce: f64,
    /// Σ divergence from the teacher at temperature τ (nats, without the τ² factor).
    pub kl: f64,
    /// Σ of the weighted objective that the gradient is of.
    pub objective: f64,
}

impl LossSums {
    pub fn add(&mut self, o: &LossSums) {
        self.rows += o.rows;
        self.ce += o.ce;
        self.kl += o.kl;
        self.objective += o.objective;
    }

    pub fn mean_ce(&self) -> f64 {
        self.ce / self.rows.max(1) as f64
    }
    pub fn mean_kl(&self) -> f64 {
        self.kl / self.rows.max(1) as f64
    }
    pub fn mean_objective(&self) -> f64 {
        self.objective / self.rows.max(1) as f64
    }
}

/// Something that scores rows of logits and, when asked, turns them into its gradient.
pub trait Objective: Sync {
    /// `logits` holds rows `rows` of the batch (`rows.len() x vocabulary`). With `grad`, each
    /// row is overwritten by the gradient of the objective with respect to it.
    fn rows(&self, rows: Range<usize>, logits: &mut [f32], grad: bool) -> LossSums;
}

/// Which divergence the soft targets use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Divergence {
    /// KL(p_teacher ‖ q_student): mass-covering (Hinton).
    #[default]
    Forward,
    /// KL(q_student ‖ p_teacher): mode-seeking (MiniLLM).
    Reverse,
}

/// The teacher's distribution for the rows of a batch.
pub enum TeacherRows<'a> {
    /// Full logits of one or more teachers (`rows x vocabulary` each) with mixing weights; the
    /// teacher distribution is the weighted mean of their softmaxes at temperature τ.
    Dense(Vec<(&'a [f32], f32)>),
    /// The `k` most likely tokens of each row with their log-probabilities at τ = 1 (a cached
    /// teacher): the distribution at τ is renormalized over those `k`.
    TopK {
        k: usize,
        ids: &'a [u32],
        logp: &'a [f32],
    },
}

/// The labels (and optionally a teacher) of a batch, and how to weigh them.
pub struct Targets<'a> {
    /// The next token of each row.
    pub labels: &'a [u32],
    pub teacher: Option<TeacherRows<'a>>,
    /// Weight of the soft loss; the hard loss gets `1 - alpha`.
    pub alpha: f32,
    pub temperature: f32,
    pub divergence: Divergence,
    /// Rows in the whole optimizer step (the gradient is of the mean over them).
    pub step_rows: usize,
}

impl<'a> Targets<'a> {
    /// Hard labels only: next-token cross-entropy, averaged over `labels`.
    pub fn hard(labels: &'a [u32]) -> Self {
        Targets {
            labels,
            teacher: None,
            alpha: 0.0,
            temperature: 1.0,
            divergence: Divergence::Forward,
            step_rows: labels.len(),
        }
    }
}

impl Objective for Targets<'_> {
    fn rows(&self, rows: Range<usize>, logits: &mut [f32], grad: bool) -> LossSums {
        let nv = logits.len() / rows.len().max(1);
        let scale = 1.0 / self.step_rows.max(1) as f32;
        let parts: Vec<LossSums> = logits
            .par_chunks_mut(nv)
            .zip(rows.clone())
            .map_init(
                || (vec![0f32; nv], vec![0f32; nv]),
                |(p, lp), (z, r)| self.row(r, z, p, lp, grad, scale),
            )
            .collect();
        let mut s = LossSums::default();
        for p in &parts {
            s.add(p);
        }
        s
    }
}

impl Targets<'_> {
    /// One row: the losses, and with `grad` the scaled gradient written over `z`.
    /// `p` and `lp` are scratch rows (the teacher's probabilities and log-probabilities).
    fn row(
        &self,
        r: usize,
        z: &mut [f32],
        p: &mut [f32],
        lp: &mut [f32],
        grad: bool,
        scale: f32,
    ) -> LossSums {
        let y = self.labels[r] as usize;
        let (tau, alpha) = (self.temperature, self.alpha);
        let lse = log_sum_exp(z, 1.0);
        let ce = lse - f64::from(z[y]);
        let mut out = LossSums {
            rows: 1,
            ce,
            kl: 0.0,
            objective: f64::from(1.0 - alpha) * ce,
        };
        let Some(teacher) = self.teacher.as_ref().filter(|_| alpha > 0.0) else {
            if grad {
                // (softmax(z) - onehot(y)) / rows, in one pass.
                let lse = lse as f32;
                z.iter_mut().for_each(|v| *v = exp_fast(*v - lse) * scale);
                z[y] -= scale;
            }
            return out;
        };
        // Teacher distribution at τ: p (and ln p where the divergence needs it).
        teacher_row(teacher, r, tau, p, lp);
        // Student at τ: ln q = z/τ - lse_τ.
        let lse_t = log_sum_exp(z, tau);
        let lset = lse_t as f32;
        let kl = match self.divergence {
            // Σ p (ln p - ln q) over the teacher's support (p = 0 contributes nothing, also
            // where a top-k teacher has ln p = -inf).
            Divergence::Forward => sum_map3(p, lp, z, |p, lp, z| {
                if p > 0.0 {
                    p * (lp - (z / tau - lset))
                } else {
                    0.0
                }
            }),
            // Σ q (ln q - ln p).
            Divergence::Reverse => sum_map2(z, lp, |z, lp| {
                let lq = z / tau - lset;
                exp_fast(lq) * (lq - lp)
            }),
        };
        out.kl = kl.max(0.0);
        out.objective += f64::from(alpha * tau * tau) * out.kl;
        if grad {
            // Hard part: (1-α)(softmax(z) - onehot); soft part per the divergence.
            let (wh, ws) = ((1.0 - alpha) * scale, alpha * tau * scale);
            let lse1 = lse as f32;
            match self.divergence {
                Divergence::Forward => {
                    for i in 0..z.len() {
                        let q1 = exp_fast(z[i] - lse1);
                        let qt = exp_fast(z[i] / tau - lset);
                        z[i] = wh * q1 + ws * (qt - p[i]);
                    }
                }
                Divergence::Reverse => {
                    // E_q[ln q - ln p] is the reverse KL itself.
                    let mean_f = kl as f32;
                    for i in 0..z.len() {
                        let q1 = exp_fast(z[i] - lse1);
                        let lq = z[i] / tau - lset;
                        let qt = exp_fast(lq);
                        z[i] = wh * q1 + ws * qt * (lq - lp[i] - mean_f);
                    }
                }
            }
            z[y] -= wh;
        }
        out
    }
}

/// Fills `p` and `lp` with the teacher's probabilities and log-probabilities at `tau` for row `r`.
fn teacher_row(t: &TeacherRows, r: usize, tau: f32, p: &mut [f32], lp: &mut [f32]) {
    match t {
        TeacherRows::Dense(teachers) => {
            let nv = p.len();
            if let [(logits, _)] = teachers.as_slice() {
                let z = &logits[r * nv..(r + 1) * nv];
                let lse = log_sum_exp(z, tau) as f32;
                for i in 0..nv {
                    lp[i] = z[i] / tau - lse;
                    p[i] = exp_fast(lp[i]);
                }
                return;
            }
            let total: f32 = teachers.iter().map(|(_, w)| w).sum();
            p.fill(0.0);
            for (logits, w) in teachers {
                let z = &logits[r * nv..(r + 1) * nv];
                let lse = log_sum_exp(z, tau) as f32;
                let w = w / total;
                for i in 0..nv {
                    p[i] += w * exp_fast(z[i] / tau - lse);
                }
            }
            for i in 0..nv {
                // A mixture's probability can underflow only where every member's does; its
                // log is then floored (only the reverse KL reads it there, weighted by q).
                lp[i] = p[i].max(1e-38).ln();
            }
        }
        TeacherRows::TopK { k, ids, logp } => {
            let (ids, logp) = (&ids[r * k..(r + 1) * k], &logp[r * k..(r + 1) * k]);
            p.fill(0.0);
            lp.fill(f32::NEG_INFINITY);
            let max = logp.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let sum: f64 = logp.iter().map(|&v| f64::from((v - max) / tau).exp()).sum();
            let lse = max / tau + sum.ln() as f32;
            for (&id, &v) in ids.iter().zip(logp) {
                lp[id as usize] = v / tau - lse;
                p[id as usize] = (v / tau - lse).exp();
            }
        }
    }
}

/// `ln Σ exp(z/τ)` (f32 terms, blocks accumulated in f64; see [`sum_map`]).
pub fn log_sum_exp(z: &[f32], tau: f32) -> f64 {
    let max = max_f32(z) / tau;
    // τ = 1 (every hard-label row) skips a division per element.
    let sum = if tau == 1.0 {
        sum_map(z, |v| exp_fast(v - max))
    } else {
        sum_map(z, |v| exp_fast(v / tau - max))
    };
    f64::from(max) + sum.ln()
}
