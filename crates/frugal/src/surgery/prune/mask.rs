//! Which weights a pattern keeps, given a score per weight: within each output row (Wanda
//! compares weights only against others of the same output), either the highest `1 - s` of the
//! row (unstructured) or the `n` highest of every group of `m` consecutive inputs (N:M, the
//! pattern sparse tensor cores and frugal's compressed 2:4 kernels exploit).

/// A sparsity pattern.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum Pattern {
    /// Remove the fraction `s` of each row's weights, wherever they are.
    Unstructured(f64),
    /// Keep `n` of every `m` consecutive weights of a row.
    NofM { n: usize, m: usize },
}

impl Pattern {
    /// The fraction of weights removed.
    pub fn sparsity(&self) -> f64 {
        match *self {
            Pattern::Unstructured(s) => s,
            Pattern::NofM { n, m } => 1.0 - n as f64 / m as f64,
        }
    }

    /// Checks the pattern against rows of `cols` weights.
    pub fn check(&self, cols: usize) -> Result<(), String> {
        match *self {
            Pattern::Unstructured(s) if !(0.0..1.0).contains(&s) => Err(format!(
                "sparsity {s} is outside [0, 1): it is the fraction of weights removed"
            )),
            Pattern::NofM { n, m } if n == 0 || n >= m => Err(format!(
                "{n}:{m} keeps {n} of every {m} weights: it needs 0 < {n} < {m}"
            )),
            Pattern::NofM { n, m } if !cols.is_multiple_of(m) => Err(format!(
                "{n}:{m}: groups of {m} do not divide rows of {cols} weights"
            )),
            _ => Ok(()),
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pattern::Unstructured(s) => write!(f, "{:.0}% unstructured", s * 100.0),
            Pattern::NofM { n, m } => write!(f, "{n}:{m}"),
        }
    }
}

impl std::str::FromStr for Pattern {
    type Err = String;
    /// `2:4` (N:M), or a sparsity such as `0.5` (unstructured).
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some((n, m)) = s.split_once(':') {
            let p = |v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{s:?}: expected N:M with whole numbers, e.g. 2:4"))
            };
            let pat = Pattern::NofM { n: p(n)?, m: p(m)? };
            pat.check(pat_m(&pat))?;
            return Ok(pat);
        }
        let v: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: expected a sparsity in [0, 1) or N:M"))?;
        let pat = Pattern::Unstructured(v);
        pat.check(1)?;
        Ok(pat)
    }
}

fn pat_m(p: &Pattern) -> usize {
    match p {
        Pattern::NofM { m, .. } => *m,
        Pattern::Unstructured(_) => 1,
    }
}

/// The keep-mask of one row from its scores (higher is more important). Ties go to the lower
/// index, so a mask is reproducible.
pub fn row_mask(scores: &[f64], pattern: Pattern, keep: &mut [bool]) {
    let rank = |idx: &mut Vec<usize>, s: &[f64]| {
        idx.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
    };
    match pattern {
        Pattern::Unstructured(s) => {
            let n = scores.len();
            let drop = ((n as f64) * s).round() as usize;
            let mut idx: Vec<usize> = (0..n).collect();
            rank(&mut idx, scores);
            keep.fill(false);
            for &i in &idx[..n - drop.min(n)] {
                keep[i] = true;
            }
        }
        Pattern::NofM { n, m } => {
            let mut idx = Vec::with_capacity(m);
            for (sg, kg) in scores.chunks(m).zip(keep.chunks_mut(m)) {
                idx.clear();
                idx.extend(0..sg.len());
                rank(&mut idx, sg);
                kg.fill(false);
                for &i in idx.iter().take(n) {
                    kg[i] = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unstructured_keeps_the_highest_of_each_row() {
        let s = [0.1, 5.0, 3.0, 0.2, 4.0, 0.0];
        let mut k = [false; 6];
        row_mask(&s, Pattern::Unstructured(0.5), &mut k);
        assert_eq!(k, [false, true, true, false, true, false]);
        row_mask(&s, Pattern::Unstructured(0.0), &mut k);
        assert!(k.iter().all(|&x| x));
    }

    #[test]
    fn n_of_m_keeps_n_in_every_group() {
        let s = [1.0, 4.0, 2.0, 3.0, 9.0, 9.0, 0.0, 1.0];
        let mut k = [false; 8];
        row_mask(&s, Pattern::NofM { n: 2, m: 4 }, &mut k);
        // Group 2 ties 9.0 / 9.0: both kept; group 1 keeps 4.0 and 3.0.
        assert_eq!(k, [false, true, false, true, true, true, false, false]);
    }

    #[test]
    fn patterns_parse_and_refuse_nonsense() {
        assert_eq!("2:4".parse::<Pattern>(), Ok(Pattern::NofM { n: 2, m: 4 }));
        assert_eq!("0.5".parse::<Pattern>(), Ok(Pattern::Unstructured(0.5)));
        for bad in ["1", "-0.1", "4:4", "0:4", "2:x", "nan"] {
            assert!(bad.parse::<Pattern>().is_err(), "{bad}");
        }
        assert!(Pattern::NofM { n: 2, m: 4 }.check(6).is_err());
        assert!(Pattern::NofM { n: 4, m: 8 }.check(576).is_ok());
    }
}
