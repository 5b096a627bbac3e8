//! Checking a draft against the target: which drafted tokens to keep and which token comes next.
//!
//! The target has scored the last accepted token followed by the K drafted ones in one pass, so
//! row `i` of its logits is the distribution of the token after draft token `i` (row 0: after
//! the last accepted token). Both rules below give the target's own output:
//! - greedy: keep draft token `i` while it is the token plain decoding would pick from row `i`;
//!   the first mismatch is replaced by that pick. Token for token the same as plain decoding,
//!   because the rows are the same bits as one-token passes (see `model::forward`).
//! - sampling (Leviathan et al. 2023, Chen et al. 2023): keep draft token `x ~ q` with
//!   probability `min(1, p(x) / q(x))`; on the first rejection draw from `max(0, p - q)`,
//!   normalized. If all K are kept, draw a bonus token from the last row. The kept tokens are then
//!   distributed exactly as the target's. `p` and `q` are the sampler's distributions after
//!   every setting (penalties, top-k, top-p, min-p, temperature), computed the same way for both.
//!   A deterministic drafter (n-gram) is the case `q(x) = 1`.

use crate::sample::Sampler;

/// What a verification decided.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Drafted tokens kept, from the first.
    pub accepted: usize,
    /// The target's token after them: the correction of the first rejected draft token, or the
    /// bonus token when every one was kept.
    pub next: u32,
}

/// Reusable buffers of a verification (no allocation once warm).
#[derive(Default, Debug)]
pub struct Workspace {
    seq: Vec<u32>,
    p: Vec<(u32, f32)>,
    dense: Vec<f32>,
    residual: Vec<(u32, f32)>,
}

/// Verifies `draft` against the target's `rows` (`draft.len() + 1` rows of `n_vocab` logits).
/// `history` is every token so far (prompt and generated, ending with the last accepted one),
/// of which `history[gen_start..]` were generated (for the presence and frequency penalties).
/// `q[i]` is the distribution draft token `i` was drawn from, or `None` for a deterministic
/// drafter. The sampler's own stream draws the acceptance tests and the replacement.
#[allow(clippy::too_many_arguments)]
pub fn verify(
    rows: &[f32],
    n_vocab: usize,
    draft: &[u32],
    q: Option<&[Vec<(u32, f32)>]>,
    history: &[u32],
    gen_start: usize,
    sampler: &mut Sampler,
    ws: &mut Workspace,
) -> Verdict {
    debug_assert_eq!(rows.len(), (draft.len() + 1) * n_vocab);
    ws.seq.clear();
    ws.seq.extend_from_slice(history);
    ws.seq.extend_from_slice(draft);
    let h = history.len();
    let greedy = sampler.params.temperature <= 0.0;
    for (i, row) in rows.chunks_exact(n_vocab).enumerate() {
        let (seen, generated) = (&ws.seq[..h + i], &ws.seq[gen_start..h + i]);
        if greedy {
            let pick = sampler.sample_with(row, seen, generated);
            if i < draft.len() && pick == draft[i] {
                continue;
            }
            return Verdict {
                accepted: i,
                next: pick,
            };
        }
        sampler.distribution(row, seen, generated, &mut ws.p);
        if i == draft.len() {
            let next = sampler.draw(&ws.p).unwrap_or(ws.p[0].0);
            return Verdict { accepted: i, next };
        }
        let x = draft[i];
        let px = prob_of(&ws.p, x);
        let qx = q.map_or(1.0, |q| prob_of(&q[i], x));
        if accept(sampler.uniform(), px, qx) {
            continue;
        }
        // Rejected: the residual max(0, p - q), normalized (draw normalizes).
        ws.dense.clear();
        ws.dense.resize(n_vocab, 0.0);
        for &(t, pt) in &ws.p {
            ws.dense[t as usize] = pt;
        }
        match q {
            Some(q) => q[i].iter().for_each(|&(t, qt)| ws.dense[t as usize] -= qt),
            None => ws.dense[x as usize] -= 1.0,
        }
        ws.residual.clear();
        ws.residual.extend(
            ws.p.iter()
                .map(|&(t, _)| (t, ws.dense[t as usize].max(0.0))),
        );
        // p and q equal up to rounding: the residual is empty; p itself is then right.
        let next = sampler
            .draw(&ws.residual)
            .or_else(|| sampler.draw(&ws.p))
            .unwrap_or(ws.p[0].0);
        return Verdict { accepted: i, next };
    }
    unreachable!("verify needs draft.len() + 1 rows")
}

fn prob_of(dist: &[(u32, f32)], t: u32) -> f32 {
    dist.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1)
}

/// The acceptance test `u < min(1, p / q)` for a uniform `u` in [0, 1), written without the
/// division. Unit tests can break it on purpose to check that the statistical tests notice.
fn accept(u: f32, p: f32, q: f32) -> bool {
    #[cfg(test)]
    if tests::BROKEN.with(|b| b.get()) {
        return true;
    }
    u * q < p
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sample::SamplerParams;
    use std::cell::Cell;

    thread_local! {
        /// Accept every drafted token (the draft's distribution instead of the target's).
        pub(crate) static BROKEN: Cell<bool> = const { Cell::new(false) };
    }

    /// Pearson's statistic of `observed` counts against `expected` probabilities, pooling the
    /// cells expected to hold fewer than 5 into one; returns (statistic, degrees of freedom).
    pub(crate) fn chi_square(observed: &[u64], expected: &[f64]) -> (f64, usize) {
        let n: u64 = observed.iter().sum();
        let (mut stat, mut cells) = (0.0, 0usize);
        let (mut pool_o, mut pool_e) = (0.0, 0.0);
        for (&o, &p) in observed.iter().zip(expected) {
            let e = p * n as f64;
            if e < 5.0 {
                pool_o += o as f64;
                pool_e += e;
                continue;
            }
            stat += (o as f64 - e).powi(2) / e;
            cells += 1;
        }
        if pool_e > 0.0 {
            stat += (pool_o - pool_e).powi(2) / pool_e.max(1e-9);
            cells += 1;
        }
        (stat, cells.saturating_sub(1))
    }

    /// The chi-square value exceeded with probability 0.001 under the null hypothesis
    /// (Wilson-Hilferty: within about 1% of the exact quantile for 3 or more degrees of freedom).
    pub(crate) fn chi_square_critical_0001(df: usize) -> f64 {
        let k = df as f64;
        let z = 3.090_232; // the standard normal's 0.999 quantile
        k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
    }

    fn softmax(l: &[f32]) -> Vec<f64> {
        let m = l.iter().cloned().fold(f32::MIN, f32::max);
        let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    /// One drafted token from a draft distribution unlike the target's: the first kept token must
    /// still follow the target's distribution; with the rule broken it follows the draft's.
    fn first_token_counts(broken: bool) -> (Vec<u64>, Vec<f64>) {
        let target = [2.0f32, 1.0, 0.5, 0.0, -0.5, 1.5];
        let draft = [0.0f32, 2.0, 1.0, 1.0, 0.5, -1.0];
        let params = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        };
        let n_vocab = target.len();
        let mut rows = target.to_vec();
        rows.extend_from_slice(&target);
        let mut verifier = Sampler::new(SamplerParams {
            seed: 11,
            ..params.clone()
        });
        let mut drafter = Sampler::new(SamplerParams { seed: 12, ..params });
        let mut ws = Workspace::default();
        let mut q = vec![Vec::new()];
        let mut counts = vec![0u64; n_vocab];
        BROKEN.with(|b| b.set(broken));
        for _ in 0..20_000 {
            drafter.distribution(&draft, &[], &[], &mut q[0]);
            let d = drafter.draw(&q[0]).unwrap();
            let v = verify(
                &rows,
                n_vocab,
                &[d],
                Some(&q),
                &[],
                0,
                &mut verifier,
                &mut ws,
            );
            let first = if v.accepted == 1 { d } else { v.next };
            counts[first as usize] += 1;
        }
        BROKEN.with(|b| b.set(false));
        (counts, softmax(&target))
    }

    #[test]
    fn kept_tokens_follow_the_target_and_a_broken_rule_is_caught() {
        let (counts, expected) = first_token_counts(false);
        let (stat, df) = chi_square(&counts, &expected);
        assert!(
            stat < chi_square_critical_0001(df),
            "chi-square {stat:.1} (df {df}): {counts:?}"
        );
        let (counts, expected) = first_token_counts(true);
        let (stat, df) = chi_square(&counts, &expected);
        assert!(
            stat > chi_square_critical_0001(df),
            "the broken rule passed: chi-square {stat:.1} (df {df})"
        );
    }

    #[test]
    fn greedy_keeps_matching_tokens_and_corrects_the_first_mismatch() {
        let n_vocab = 4;
        // Rows pick 2, 3, 1, 0 greedily.
        let rows = [
            0.0, 0.0, 1.0, 0.0, //
            0.0, 0.0, 0.0, 1.0, //
            0.0, 1.0, 0.0, 0.0, //
            1.0, 0.0, 0.0, 0.0,
        ];
        let mut s = Sampler::new(SamplerParams::greedy());
        let mut ws = Workspace::default();
        let v = verify(&rows, n_vocab, &[2, 3, 0], None, &[1], 0, &mut s, &mut ws);
        assert_eq!(
            v,
            Verdict {
                accepted: 2,
                next: 1
            }
        );
        let v = verify(&rows, n_vocab, &[2, 3, 1], None, &[1], 0, &mut s, &mut ws);
        assert_eq!(
            v,
            Verdict {
                accepted: 3,
                next: 0
            }
        );
        let v = verify(&rows[..4], n_vocab, &[], None, &[1], 0, &mut s, &mut ws);
        assert_eq!(
            v,
            Verdict {
                accepted: 0,
                next: 2
            }
        );
    }

    #[test]
    fn a_deterministic_draft_is_kept_with_the_targets_probability() {
        // q(x) = 1: keep x with probability p(x); otherwise draw from p without x.
        let target = [1.0f32, 0.0, 0.5];
        let params = SamplerParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 5,
            ..Default::default()
        };
        let mut rows = target.to_vec();
        rows.extend_from_slice(&target);
        let mut s = Sampler::new(params);
        let mut ws = Workspace::default();
        let mut counts = vec![0u64; 3];
        for _ in 0..20_000 {
            let v = verify(&rows, 3, &[1], None, &[], 0, &mut s, &mut ws);
            counts[if v.accepted == 1 { 1 } else { v.next as usize }] += 1;
        }
        let (stat, df) = chi_square(&counts, &softmax(&target));
        assert!(stat < chi_square_critical_0001(df), "{stat} {counts:?}");
    }
}
