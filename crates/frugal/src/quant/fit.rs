//! Scale fits for encoders whose codes stand for the values of a fixed signed table: Q3_K's
//! integers -4..=3 and IQ4's non-uniform 16 values. A block `x` is stored as `s * table[q]`
//! with one scale `s` and, per element, the code `q` of the nearest table value.
//!
//! Rounding `x / s` to the nearest table value for a given `s` is easy; the scale is not,
//! because the error as a function of `s` has a local minimum wherever a code changes. So the
//! fit tries scales that put the block's largest magnitude at or near either end of the table,
//! refits each by least squares for the codes it chose, and keeps the one with the smallest
//! squared error (as llama.cpp's IQ4 and K-quant encoders search).

/// The value of largest magnitude, sign kept (the first of equal magnitudes; 0 for none): the
/// end of a symmetric grid the scale maps to.
pub(super) fn signed_absmax(x: &[f32]) -> f32 {
    x.iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// Index of the entry of the ascending `table` nearest to `v` (the lower one on a tie): the
/// number of midpoints between neighbours that `v` lies above. Counting all of them (no
/// branches) costs less than a binary search's mispredicted branches on tables this short.
pub(super) fn nearest(table: &[f32], v: f32) -> usize {
    table
        .windows(2)
        .map(|w| usize::from(v > 0.5 * (w[0] + w[1])))
        .sum()
}

/// Squared error of `x` stored with scale `s` and the nearest code for each element.
pub(super) fn table_error(x: &[f32], table: &[f32], s: f32) -> f32 {
    if s == 0.0 {
        return x.iter().map(|v| v * v).sum();
    }
    let inv = 1.0 / s;
    x.iter()
        .map(|&v| (s * table[nearest(table, v * inv)] - v).powi(2))
        .sum()
}

/// The least-squares scale for the codes `s` chooses: `sum(t x) / sum(t t)`, or `s` itself when
/// every code's value is zero.
fn refit(x: &[f32], table: &[f32], s: f32) -> f32 {
    let inv = 1.0 / s;
    let (mut tx, mut tt) = (0f32, 0f32);
    for &v in x {
        let t = table[nearest(table, v * inv)];
        tx += t * v;
        tt += t * t;
    }
    if tt > 0.0 { tx / tt } else { s }
}

/// The scale that stores `x` with the smallest squared error on `table` (ascending, with a
/// negative first and a positive last entry) among: the largest magnitude `max` mapped to each
/// end of the table, stretched or shrunk by up to 8% in steps of 2%, each refitted by least
/// squares for the codes it chose. 0 for an all-zero block.
///
/// Only the refitted scales are scored: for the codes a candidate chose the least-squares scale
/// errs no more than the candidate, and re-choosing the nearest codes for it errs no more again.
pub(super) fn fit_table_scale(x: &[f32], table: &[f32]) -> f32 {
    let max = signed_absmax(x);
    if max == 0.0 {
        return 0.0;
    }
    let (lo, hi) = (table[0], table[table.len() - 1]);
    let mut best = max / lo;
    let mut best_err = table_error(x, table, best);
    for end in [lo, hi] {
        for k in -4..=4 {
            let s = refit(x, table, max / (end * (1.0 + 0.02 * k as f32)));
            if !s.is_finite() || s == 0.0 {
                continue;
            }
            let err = table_error(x, table, s);
            if err < best_err {
                best = s;
                best_err = err;
            }
        }
    }
    best
}

/// Of the quantized sub-scales `l - 1`, `l`, `l + 1` (within `lmin..=lmax`), the one whose
/// scale `d * l` stores `x` with the smallest error: rounding each sub-block's fitted scale to
/// the super-block's grid independently can land one step from the better grid point.
pub(super) fn best_step(x: &[f32], table: &[f32], d: f32, l: i32, lmin: i32, lmax: i32) -> i32 {
    let mut best = l;
    let mut best_err = table_error(x, table, d * l as f32);
    for c in [l - 1, l + 1] {
        if (lmin..=lmax).contains(&c) {
            let err = table_error(x, table, d * c as f32);
            if err < best_err {
                best = c;
                best_err = err;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_picks_the_closest_entry() {
        let t = [-4.0, -3.0, -1.0, 2.0, 6.0];
        let cases = [
            (-9.0, 0),
            (-3.6, 0),
            (-3.4, 1),
            (-2.0, 1), // tie: the lower one
            (0.4, 2),
            (0.6, 3),
            (0.5, 2), // tie at the midpoint of -1 and 2
            (4.1, 4),
            (99.0, 4),
        ];
        for (v, want) in cases {
            assert_eq!(nearest(&t, v), want, "{v}");
        }
    }

    #[test]
    fn a_block_on_the_grid_is_fitted_exactly() {
        let table: Vec<f32> = (-4..=3).map(|v| v as f32).collect();
        let x: Vec<f32> = (0..16).map(|i| 0.25 * ((i % 8) as f32 - 4.0)).collect();
        let s = fit_table_scale(&x, &table);
        assert!(table_error(&x, &table, s) < 1e-10, "scale {s}");
        assert_eq!(fit_table_scale(&[0.0; 16], &table), 0.0);
    }
}
