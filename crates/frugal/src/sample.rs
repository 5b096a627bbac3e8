//! Choosing the next token from logits: greedy, or temperature sampling narrowed by top-k,
//! top-p and min-p, after a repetition penalty; seeded so the same seed gives the same text.
//!
//! The order follows llama.cpp's default chain: penalties, top-k, top-p, min-p, temperature, draw.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SamplerParams {
    /// 0 selects greedy decoding.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables; values > 1 discourage tokens seen in the last `repeat_last_n`.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    /// OpenAI's penalties over the generated tokens, each in [-2, 2] (0 disables):
    /// `logit -= presence * [count > 0] + frequency * count`.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplerParams {
    pub fn greedy() -> Self {
        SamplerParams {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Rejects values outside their meaningful ranges.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top-p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min-p {} must be in [0, 1]", self.min_p));
        }
        for (name, v) in [
            ("presence penalty", self.presence_penalty),
            ("frequency penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} {v} must be in [-2, 2]"));
            }
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return Err(format!(
                "repeat penalty {} must be > 0",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

pub struct Sampler {
    pub params: SamplerParams,
    rng: ChaCha8Rng,
    /// Reused every step (no allocation once warm): (token, logit) pairs and their weights.
    candidates: Vec<(u32, f32)>,
    weights: Vec<f32>,
}

impl Sampler {
    pub fn new(params: SamplerParams) -> Self {
        Sampler {
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            params,
            candidates: Vec::new(),
            weights: Vec::new(),
        }
    }

    /// Picks the next token given the logits and the tokens so far (for the penalty).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.sample_with(logits, history, &[])
    }

    /// [`sample`](Self::sample) with the presence and frequency penalties applied over
    /// `generated` (the tokens generated so far).
    pub fn sample_with(&mut self, logits: &[f32], history: &[u32], generated: &[u32]) -> u32 {
        self.sample_banning(logits, history, generated, &[])
    }

    /// [`sample_with`](Self::sample_with) as if the logits of the `banned` ids were -inf (a
    /// server's `min_tokens` bans the end-of-generation tokens), without copying the logits.
    pub fn sample_banning(
        &mut self,
        logits: &[f32],
        history: &[u32],
        generated: &[u32],
        banned: &[u32],
    ) -> u32 {
        if let Some(id) = self.narrow(logits, history, generated, banned) {
            return id;
        }
        // A draw from the renormalized weights.
        let total: f32 = self.weights.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (&(id, _), &w) in self.candidates.iter().zip(self.weights.iter()) {
            if r < w {
                return id;
            }
            r -= w;
        }
        self.candidates[self.candidates.len() - 1].0
    }

    /// The distribution [`sample_with`](Self::sample_with) draws from, after every setting:
    /// `(token, probability)` pairs summing to 1, most likely first; greedy decoding gives one
    /// token with probability 1. Speculative sampling compares the draft's and the target's.
    pub fn distribution(
        &mut self,
        logits: &[f32],
        history: &[u32],
        generated: &[u32],
        out: &mut Vec<(u32, f32)>,
    ) {
        out.clear();
        if let Some(id) = self.narrow(logits, history, generated, &[]) {
            out.push((id, 1.0));
            return;
        }
        let total: f32 = self.weights.iter().sum();
        out.extend(
            self.candidates
                .iter()
                .zip(&self.weights)
                .map(|(&(id, _), &w)| (id, w / total)),
        );
    }

    /// A uniform draw in [0, 1) from the sampler's seeded stream.
    pub fn uniform(&mut self) -> f32 {
        self.rng.random::<f32>()
    }

    /// A draw from `weights` (token, weight >= 0), proportional to the weights; `None` when they
    /// sum to zero.
    pub fn draw(&mut self, weights: &[(u32, f32)]) -> Option<u32> {
        let total: f32 = weights.iter().map(|w| w.1).sum();
        if total.is_nan() || total <= 0.0 {
            return None;
        }
        let mut r = self.rng.random::<f32>() * total;
        let mut last = None;
        for &(id, w) in weights {
            if w > 0.0 {
                if r < w {
                    return Some(id);
                }
                r -= w;
                last = Some(id);
            }
        }
        last
    }

    /// Applies the penalties and, unless greedy, the top-k, top-p and min-p cut-offs, leaving
    /// the surviving candidates (most likely first) in `candidates` and their weights at the
    /// sampling temperature in `weights`. Greedy decoding returns the chosen token instead.
    fn narrow(
        &mut self,
        logits: &[f32],
        history: &[u32],
        generated: &[u32],
        banned: &[u32],
    ) -> Option<u32> {
        let p = &self.params;
        let penalized =
            p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 || p.repeat_penalty != 1.0;
        if p.temperature <= 0.0 && !penalized {
            // Plain greedy: the largest logit, without building the candidate list (a server
            // takes this per sequence per step).
            return Some(if banned.is_empty() {
                argmax_logits(logits)
            } else {
                let all = logits
                    .iter()
                    .copied()
                    .enumerate()
                    .map(|(i, l)| (i as u32, l));
                argmax(all.filter(|(i, _)| !banned.contains(i)))
            });
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        for &t in banned {
            if let Some(e) = c.get_mut(t as usize) {
                e.1 = f32::NEG_INFINITY;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            // Each distinct token once: its count is how often it appears in `generated`.
            let mut seen: Vec<u32> = generated.to_vec();
            seen.sort_unstable();
            for run in seen.chunk_by(|a, b| a == b) {
                if let Some(e) = c.get_mut(run[0] as usize) {
                    e.1 -= p.presence_penalty + p.frequency_penalty * run.len() as f32;
                }
            }
        }
        if p.repeat_penalty != 1.0 {
            let recent = &history[history.len().saturating_sub(p.repeat_last_n)..];
            for &t in recent {
                if let Some(e) = c.get_mut(t as usize) {
                    // Shrink toward zero either way, as llama.cpp (and CTRL) do.
                    e.1 = if e.1 > 0.0 {
                        e.1 / p.repeat_penalty
                    } else {
                        e.1 * p.repeat_penalty
                    };
                }
            }
        }
        if p.temperature <= 0.0 {
            return Some(argmax(c.iter().copied()));
        }
        // Sort descending by logit (ties by id for determinism).
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        // Probabilities at temperature 1 for the top-p and min-p cut-offs, as llama.cpp does.
        let max = c[0].1;
        let probs = &mut self.weights;
        probs.clear();
        probs.extend(c.iter().map(|&(_, l)| (l - max).exp()));
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, &q) in probs.iter().enumerate() {
                cum += q;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * probs[0];
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        c.truncate(keep);
        // Weights at the sampling temperature.
        let weights = &mut self.weights;
        weights.clear();
        weights.extend(c.iter().map(|&(_, l)| ((l - max) / p.temperature).exp()));
        None
    }
}

/// [`argmax`] over a whole logit row, in two passes the compiler vectorizes: the largest value
/// (sixteen running maxima, which ignore NaN as `argmax`'s `>` does), then its first position.
fn argmax_logits(logits: &[f32]) -> u32 {
    const W: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; W];
    let mut chunks = logits.chunks_exact(W);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    if max == f32::NEG_INFINITY {
        return 0;
    }
    logits.iter().position(|&x| x == max).unwrap_or(0) as u32
}

/// The first id with the largest logit (id 0 when every logit is NaN or -inf).
fn argmax(c: impl Iterator<Item = (u32, f32)>) -> u32 {
    c.fold((0u32, f32::NEG_INFINITY), |best, (i, l)| {
        if l > best.1 { (i, l) } else { best }
    })
    .0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vectorized_argmax_is_the_first_largest() {
        let mut rows: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN; 40],
            vec![f32::NEG_INFINITY; 33],
            vec![1.0; 50],
            (0..100).map(|i| ((i * 7919) % 101) as f32).collect(),
        ];
        let mut r = rows[4].clone();
        r[3] = f32::NAN;
        r[97] = 1000.0;
        r[98] = 1000.0;
        rows.push(r);
        for row in rows {
            let want = argmax(row.iter().copied().enumerate().map(|(i, l)| (i as u32, l)));
            assert_eq!(argmax_logits(&row), want, "{row:?}");
        }
    }

    #[test]
    fn banning_equals_sampling_from_masked_logits() {
        let logits: Vec<f32> = (0..64).map(|i| ((i * 37 % 29) as f32) / 7.0).collect();
        let banned = [logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32];
        let mut masked = logits.clone();
        masked[banned[0] as usize] = f32::NEG_INFINITY;
        let history = [3u32, 5, 3];
        for params in [
            SamplerParams::greedy(),
            SamplerParams {
                repeat_penalty: 1.3,
                ..SamplerParams::greedy()
            },
            SamplerParams {
                temperature: 0.9,
                top_k: 20,
                seed: 4,
                ..SamplerParams::default()
            },
        ] {
            let (mut a, mut b) = (Sampler::new(params.clone()), Sampler::new(params));
            for _ in 0..20 {
                let x = a.sample_banning(&logits, &history, &history, &banned);
                let y = b.sample_with(&masked, &history, &history);
                assert_eq!(x, y);
                assert_ne!(x, banned[0]);
            }
        }
    }

    #[test]
    fn greedy_takes_the_largest() {
        let mut s = Sampler::new(SamplerParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[]), 1);
    }

    #[test]
    fn repeat_penalty_can_change_the_choice() {
        let mut s = Sampler::new(SamplerParams {
            repeat_penalty: 2.0,
            ..SamplerParams::greedy()
        });
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9], &[1]), 3);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_repeats() {
        let mut s = Sampler::new(SamplerParams {
            top_k: 1,
            temperature: 1.0,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5], &[]), 1);
        }
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(SamplerParams {
                seed,
                temperature: 1.5,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..Default::default()
            });
            (0..30).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        // One dominant token: min-p 0.5 leaves only it; top-p 0.5 too.
        let logits = [10.0, 0.0, 0.0, 0.0];
        for params in [
            SamplerParams {
                min_p: 0.5,
                top_p: 1.0,
                top_k: 0,
                temperature: 5.0,
                ..Default::default()
            },
            SamplerParams {
                min_p: 0.0,
                top_p: 0.5,
                top_k: 0,
                temperature: 5.0,
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(params);
            for _ in 0..50 {
                assert_eq!(s.sample(&logits, &[]), 0);
            }
        }
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens() {
        let logits = [2.0, 1.9, 0.0];
        let mut s = Sampler::new(SamplerParams {
            presence_penalty: 0.15,
            ..SamplerParams::greedy()
        });
        assert_eq!(
            s.sample_with(&logits, &[], &[0]),
            1,
            "presence: 2.0 - 0.15 < 1.9"
        );
        let mut s = Sampler::new(SamplerParams {
            frequency_penalty: 0.04,
            ..SamplerParams::greedy()
        });
        assert_eq!(s.sample_with(&logits, &[], &[0, 0]), 0, "2.0 - 0.08 > 1.9");
        assert_eq!(
            s.sample_with(&logits, &[], &[0, 0, 0]),
            1,
            "2.0 - 0.12 < 1.9"
        );
        assert!(
            SamplerParams {
                presence_penalty: 2.5,
                ..SamplerParams::greedy()
            }
            .validate()
            .is_err()
        );
    }
}
