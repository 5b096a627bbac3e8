//! SparseGPT (Frantar & Alistarh, arXiv 2301.00774): prune one matrix so that its outputs on
//! calibration inputs change least, by removing weights in column order and, after each column,
//! moving the error it leaves onto the columns not yet visited (the Optimal Brain Surgeon update
//! with the inverse Hessian `H⁻¹`, `H = XᵀX`). Masks are chosen per block of [`BLOCK`] columns
//! from `w² / [H⁻¹]_jj²` (adaptive mask selection), or per group of M for N:M.
//!
//! One-shot from the dense model's activations: every layer's Gram matrix comes from the
//! original forward, not from the already-pruned layers below it (the paper's sequential
//! variant), which keeps calibration to one pass.

use nalgebra::DMatrix;
use rayon::prelude::*;

use super::mask::Pattern;

/// Columns whose masks are chosen together (the paper's 128).
pub const BLOCK: usize = 128;

/// Dampening added to the Hessian's diagonal, as a fraction of its mean (the paper's 1%).
const DAMP: f64 = 0.01;

/// Prunes `w` (`rows x cols`, row-major) in place to `pattern`, given the Gram matrix
/// `gram = XᵀX` (`cols x cols`) of its inputs. Returns the keep-mask, or why the Hessian could
/// not be factored (non-finite activations).
pub fn prune(
    w: &mut [f32],
    rows: usize,
    cols: usize,
    gram: &[f64],
    pattern: Pattern,
) -> Result<Vec<bool>, String> {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(gram.len(), cols * cols);
    let mut h = DMatrix::from_row_slice(cols, cols, gram);
    // Inputs that are always zero carry no information: their weights go (they never matter).
    let dead: Vec<bool> = (0..cols).map(|j| h[(j, j)] == 0.0).collect();
    let mean_diag = (0..cols).map(|j| h[(j, j)]).sum::<f64>() / cols as f64;
    let damp = DAMP * mean_diag.max(f64::MIN_POSITIVE);
    for j in 0..cols {
        if dead[j] {
            h[(j, j)] = 1.0;
        }
        h[(j, j)] += damp;
    }
    // U upper triangular with H⁻¹ = UᵀU: the row j of U holds the update the error of column j
    // spreads over columns j.. (the Cholesky form of the OBS recursion).
    let not_pd =
        || "the calibration Gram matrix is not positive definite (non-finite activations?)";
    let hinv = h.cholesky().ok_or_else(not_pd)?.inverse();
    let u = hinv.cholesky().ok_or_else(not_pd)?.l().transpose();
    let u: Vec<f64> = (0..cols * cols).map(|i| u[(i / cols, i % cols)]).collect();

    let mut keep = vec![true; rows * cols];
    let mut wd: Vec<f64> = w.iter().map(|&v| f64::from(v)).collect();
    for (r, row) in wd.chunks_exact_mut(cols).enumerate() {
        for j in 0..cols {
            if dead[j] {
                row[j] = 0.0;
                keep[r * cols + j] = false;
            }
        }
    }
    for b0 in (0..cols).step_by(BLOCK) {
        let b1 = (b0 + BLOCK).min(cols);
        let nb = b1 - b0;
        // Adaptive mask of the block for unstructured sparsity: the lowest w²/d² over the whole
        // block (all rows), as the paper does.
        if let Pattern::Unstructured(s) = pattern {
            let mut scores: Vec<(f64, usize)> = Vec::with_capacity(rows * nb);
            for r in 0..rows {
                for j in b0..b1 {
                    let d = u[j * cols + j];
                    scores.push((wd[r * cols + j].powi(2) / (d * d), r * cols + j));
                }
            }
            let n_drop = ((rows * nb) as f64 * s).round() as usize;
            scores.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
            for &(_, i) in scores.iter().take(n_drop) {
                keep[i] = false;
            }
        }
        // Rows are independent from here on: each moves its own errors.
        let errs: Vec<Vec<f64>> = wd
            .par_chunks_mut(cols)
            .zip(keep.par_chunks_mut(cols))
            .map(|(row, kr)| {
                let mut err = vec![0f64; nb];
                for j in b0..b1 {
                    if let Pattern::NofM { n, m } = pattern
                        && j % m == 0
                    {
                        let g1 = (j + m).min(cols);
                        let mut idx: Vec<usize> = (j..g1).collect();
                        idx.sort_by(|&a, &b| {
                            let sa = row[a].powi(2) / u[a * cols + a].powi(2);
                            let sb = row[b].powi(2) / u[b * cols + b].powi(2);
                            sb.total_cmp(&sa).then(a.cmp(&b))
                        });
                        for &i in idx.iter().skip(n) {
                            kr[i] = false;
                        }
                    }
                    let d = u[j * cols + j];
                    let q = if kr[j] { row[j] } else { 0.0 };
                    let e = (row[j] - q) / d;
                    row[j] = q;
                    for k in j + 1..b1 {
                        row[k] -= e * u[j * cols + k];
                    }
                    err[j - b0] = e;
                }
                // The block's errors onto the columns after it.
                for k in b1..cols {
                    let mut acc = 0f64;
                    for (jj, &e) in err.iter().enumerate() {
                        acc += e * u[(b0 + jj) * cols + k];
                    }
                    row[k] -= acc;
                }
                err
            })
            .collect();
        drop(errs);
    }
    for (o, (&v, &k)) in w.iter_mut().zip(wd.iter().zip(&keep)) {
        *o = if k { v as f32 } else { 0.0 };
    }
    Ok(keep)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }

    /// Reconstruction beats dropping the same weights: on correlated inputs SparseGPT's output
    /// error `||X (W - W_s)ᵀ||²` is below that of keeping the same mask without the update, and
    /// below magnitude pruning's at the same sparsity.
    #[test]
    fn reconstruction_lowers_the_output_error() {
        let (rows, cols, n) = (8, 32, 256);
        let mut seed = 7;
        // Inputs with a shared component, so columns are correlated (what makes OBS pay).
        let x: Vec<f64> = (0..n)
            .flat_map(|_| {
                let common = lcg(&mut seed);
                (0..cols)
                    .map(|j| common * (1.0 + j as f64 / cols as f64) + 0.3 * lcg(&mut seed))
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut gram = vec![0f64; cols * cols];
        for r in x.chunks_exact(cols) {
            for i in 0..cols {
                for j in 0..cols {
                    gram[i * cols + j] += r[i] * r[j];
                }
            }
        }
        let w: Vec<f32> = (0..rows * cols).map(|_| lcg(&mut seed) as f32).collect();
        let out_err = |ws: &[f32]| -> f64 {
            x.chunks_exact(cols)
                .map(|xr| {
                    (0..rows)
                        .map(|r| {
                            (0..cols)
                                .map(|j| xr[j] * f64::from(w[r * cols + j] - ws[r * cols + j]))
                                .sum::<f64>()
                                .powi(2)
                        })
                        .sum::<f64>()
                })
                .sum()
        };
        for pattern in [Pattern::Unstructured(0.5), Pattern::NofM { n: 2, m: 4 }] {
            let mut ws = w.clone();
            let keep = prune(&mut ws, rows, cols, &gram, pattern).unwrap();
            let kept = keep.iter().filter(|&&k| k).count();
            assert_eq!(kept, rows * cols / 2, "{pattern}");
            assert!(ws.iter().zip(&keep).all(|(&v, &k)| k || v == 0.0));
            if let Pattern::NofM { n, m } = pattern {
                for g in keep.chunks(m) {
                    assert_eq!(g.iter().filter(|&&k| k).count(), n);
                }
            }
            let masked: Vec<f32> = w
                .iter()
                .zip(&keep)
                .map(|(&v, &k)| if k { v } else { 0.0 })
                .collect();
            let mut mag = w.clone();
            for row in mag.chunks_exact_mut(cols) {
                let mut k = vec![false; cols];
                let s: Vec<f64> = row.iter().map(|v| f64::from(v.abs())).collect();
                super::super::mask::row_mask(&s, pattern, &mut k);
                row.iter_mut().zip(&k).for_each(|(v, &k)| {
                    if !k {
                        *v = 0.0
                    }
                });
            }
            let (e_sgpt, e_mask, e_mag) = (out_err(&ws), out_err(&masked), out_err(&mag));
            assert!(
                e_sgpt < 0.8 * e_mask && e_sgpt < 0.8 * e_mag,
                "{pattern}: SparseGPT {e_sgpt:.3}, same mask {e_mask:.3}, magnitude {e_mag:.3}"
            );
        }
    }
}
