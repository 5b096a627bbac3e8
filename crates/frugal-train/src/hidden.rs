//! The hidden-state loss: a student layer's output matched to a teacher layer's output, by MSE
//! or cosine distance, through a learned linear map `P` (teacher width x student width) where
//! the widths differ. Minitron and DistilBERT add such terms to the logit loss when depth is cut.
//!
//! With `h' = h Pᵀ` (or `h' = h`) per row and teacher row `t`:
//! - MSE `mean((h' - t)²)`: `∂/∂h' = 2 (h' - t) / width`;
//! - cosine `1 - cos(h', t)`: `∂/∂h' = -(t / (|h'||t|) - cos · h' / |h'|²)`;
//!
//! then `∂/∂h = ∂/∂h' · P` and `∂/∂P = (∂/∂h')ᵀ h`. Both are averaged over the step's rows.

use rayon::prelude::*;

use crate::gemm::Precision;
use crate::ops::{linear_backward, linear_forward};

/// How hidden states are compared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HiddenKind {
    Mse,
    #[default]
    Cosine,
}

impl std::str::FromStr for HiddenKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mse" => Ok(HiddenKind::Mse),
            "cosine" | "cos" => Ok(HiddenKind::Cosine),
            _ => Err(format!(
                "unknown hidden-state loss {s:?}: use mse or cosine"
            )),
        }
    }
}

/// The loss summed over the rows of `h` (student, `rows x ds`) against `t` (teacher,
/// `rows x dt`), scaled by `weight / step_rows`, and its gradients: into `dh` (overwritten) and,
/// with a projection `p` (`dt x ds`), into `dp` (added).
#[allow(clippy::too_many_arguments)]
pub fn hidden_loss(
    kind: HiddenKind,
    h: &[f32],
    t: &[f32],
    p: Option<(&[f32], &mut [f32])>,
    ds: usize,
    dt: usize,
    weight: f32,
    step_rows: usize,
    dh: &mut [f32],
    prec: Precision,
) -> f64 {
    let rows = h.len() / ds;
    let projected;
    let hp: &[f32] = match &p {
        Some((pm, _)) => {
            let mut y = vec![0f32; rows * dt];
            linear_forward(h, pm, ds, &mut y, prec);
            projected = y;
            &projected
        }
        None => h,
    };
    let scale = weight / step_rows.max(1) as f32;
    let mut dhp = vec![0f32; rows * dt];
    let loss: f64 = dhp
        .par_chunks_mut(dt)
        .zip(hp.par_chunks(dt).zip(t.par_chunks(dt)))
        .map(|(g, (a, b))| match kind {
            HiddenKind::Mse => {
                let mut s = 0f64;
                for i in 0..dt {
                    let e = a[i] - b[i];
                    s += f64::from(e) * f64::from(e);
                    g[i] = scale * 2.0 * e / dt as f32;
                }
                s / dt as f64
            }
            HiddenKind::Cosine => {
                let dot: f64 = a
                    .iter()
                    .zip(b)
                    .map(|(&x, &y)| f64::from(x) * f64::from(y))
                    .sum();
                let na = a
                    .iter()
                    .map(|&x| f64::from(x).powi(2))
                    .sum::<f64>()
                    .sqrt()
                    .max(1e-12);
                let nb = b
                    .iter()
                    .map(|&x| f64::from(x).powi(2))
                    .sum::<f64>()
                    .sqrt()
                    .max(1e-12);
                let cos = dot / (na * nb);
                for i in 0..dt {
                    let d = f64::from(b[i]) / (na * nb) - cos * f64::from(a[i]) / (na * na);
                    g[i] = -scale * d as f32;
                }
                1.0 - cos
            }
        })
        .sum();
    match p {
        Some((pm, dp)) => linear_backward(h, pm, &dhp, Some((dh, false)), Some(dp), ds, prec),
        None => dh.copy_from_slice(&dhp),
    }
    loss * f64::from(weight)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::normal;
    use rand::SeedableRng;

    /// Central differences of the loss (see `gradcheck` for the tolerance's reasoning).
    #[allow(clippy::needless_range_loop)]
    fn check(kind: HiddenKind, project: bool) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let (rows, ds, dt) = (3, 5, if project { 7 } else { 5 });
        let mut r = |n: usize| (0..n).map(|_| normal(&mut rng)).collect::<Vec<f32>>();
        let (h, t, p) = (r(rows * ds), r(rows * dt), r(dt * ds));
        let f = |h: &[f32], p: &[f32]| {
            let mut dh = vec![0f32; rows * ds];
            let mut dp = vec![0f32; dt * ds];
            let pp = project.then_some((p, &mut dp[..]));
            hidden_loss(kind, h, &t, pp, ds, dt, 0.7, rows, &mut dh, Precision::F32) / rows as f64
        };
        let (mut dh, mut dp) = (vec![0f32; rows * ds], vec![0f32; dt * ds]);
        hidden_loss(
            kind,
            &h,
            &t,
            project.then_some((&p[..], &mut dp[..])),
            ds,
            dt,
            0.7,
            rows,
            &mut dh,
            Precision::F32,
        );
        let eps = 2e-3f32;
        let num = |x: &[f32], i: usize, which: bool| {
            let mut a = x.to_vec();
            a[i] += eps;
            let lp = if which { f(&a, &p) } else { f(&h, &a) };
            a[i] -= 2.0 * eps;
            let lm = if which { f(&a, &p) } else { f(&h, &a) };
            (lp - lm) / (2.0 * f64::from(eps))
        };
        for i in 0..h.len() {
            let n = num(&h, i, true);
            assert!(
                (n - f64::from(dh[i])).abs() <= 2e-2 * n.abs().max(f64::from(dh[i]).abs()) + 2e-4,
                "dh[{i}] {n} vs {}",
                dh[i]
            );
        }
        if project {
            for i in 0..p.len() {
                let n = num(&p, i, false);
                assert!(
                    (n - f64::from(dp[i])).abs()
                        <= 2e-2 * n.abs().max(f64::from(dp[i]).abs()) + 2e-4,
                    "dp[{i}] {n} vs {}",
                    dp[i]
                );
            }
        }
    }

    #[test]
    fn hidden_losses_match_finite_differences() {
        check(HiddenKind::Mse, false);
        check(HiddenKind::Mse, true);
        check(HiddenKind::Cosine, false);
        check(HiddenKind::Cosine, true);
    }
}
