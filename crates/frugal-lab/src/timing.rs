//! Speed, measured so that candidates compare fairly on a shared machine.
//!
//! A machine's load drifts within a run: the same file decodes measurably faster one minute than
//! the next. So a candidate is timed right after its baseline, and its speed-up is the median of
//! those back-to-back ratios, which cancels most of the drift; the candidates take turns within
//! each round, each round starting at another one, so that no candidate always runs first.

use anyhow::Result;
use frugal::bench::{self, median};
use frugal::eval::EvalOptions;
use frugal::model::Model;

/// One speed test, in llama-bench's terms: prefill of `prompt` tokens in one batch and decode of
/// `gen_tokens` single-token steps, both after `depth` tokens already in the cache; each the
/// median of `reps` timed runs after a warm-up. A count of 0 skips that half.
#[derive(Clone, Copy, Debug)]
pub struct SpeedTest {
    pub prompt: usize,
    pub gen_tokens: usize,
    pub depth: usize,
    pub reps: usize,
}

/// Tokens per second (0 where the test was skipped).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Speed {
    pub prefill: f64,
    pub decode: f64,
}

impl Speed {
    /// Each figure over the baseline's (1 where the baseline's was not measured).
    pub fn over(self, base: Speed) -> Speed {
        let ratio = |x: f64, b: f64| if b > 0.0 { x / b } else { 1.0 };
        Speed {
            prefill: ratio(self.prefill, base.prefill),
            decode: ratio(self.decode, base.decode),
        }
    }

    /// The median of each figure over `runs` (0 for none).
    pub fn median(runs: &[Speed]) -> Speed {
        let pick = |f: fn(&Speed) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        Speed {
            prefill: pick(|s| s.prefill),
            decode: pick(|s| s.decode),
        }
    }
}

impl SpeedTest {
    /// Prefill `prompt` and decode `gen_tokens` tokens from an empty cache, once each after a
    /// warm-up (what the reports time in every turn).
    pub fn once(prompt: usize, gen_tokens: usize) -> SpeedTest {
        SpeedTest {
            prompt,
            gen_tokens,
            depth: 0,
            reps: 1,
        }
    }

    /// Times `model` as it is set up (its activation precision), with the default cache and
    /// attention.
    pub fn measure(&self, model: &Model) -> Result<Speed> {
        self.measure_with(model, &EvalOptions::default())
    }

    /// [`SpeedTest::measure`] with a cache format and attention of its own.
    pub fn measure_with(&self, model: &Model, opts: &EvalOptions) -> Result<Speed> {
        let reps = self.reps.max(1);
        let prefill = match self.prompt {
            0 => 0.0,
            n => bench::prefill_at(model, n, self.depth, reps, opts)?.median,
        };
        let decode = match self.gen_tokens {
            0 => 0.0,
            n => bench::decode_at(model, n, self.depth, reps, opts)?.median,
        };
        Ok(Speed { prefill, decode })
    }
}

/// A candidate's speed: the median of its own runs, and the median of its ratios to the
/// baseline timed right before it (1 without a baseline).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Paired {
    pub speed: Speed,
    pub vs_base: Speed,
}

/// One candidate's turn in a round, for progress reports.
#[derive(Clone, Copy, Debug)]
pub struct Turn {
    /// Round, from 0.
    pub round: usize,
    pub candidate: usize,
    pub speed: Speed,
    /// Over the baseline timed right before, if it has one.
    pub vs_base: Option<Speed>,
}

/// What [`back_to_back`] measured.
#[derive(Clone, Debug)]
pub struct BackToBack {
    /// One per candidate, in order.
    pub candidates: Vec<Paired>,
    /// Every run of a subject timed as a baseline: (subject, speed).
    pub baseline_runs: Vec<(usize, Speed)>,
}

impl BackToBack {
    /// The median speed of `subject` over its runs as a baseline (0 if it never was one).
    pub fn baseline(&self, subject: usize) -> Speed {
        let runs: Vec<Speed> = self
            .baseline_runs
            .iter()
            .filter(|(s, _)| *s == subject)
            .map(|&(_, v)| v)
            .collect();
        Speed::median(&runs)
    }
}

/// Times `candidates` subjects (0..candidates) for `rounds` rounds, candidates taking turns
/// within a round, each round starting at another one. `baseline(i)` names the subject
/// candidate `i` is compared with (another candidate, or an index past the candidates for a
/// model outside them), timed right before it; `None`, or `i` itself, means no baseline.
/// `time(subject)` measures one subject (loading it first if it wants: models can wait on disk).
pub fn back_to_back(
    candidates: usize,
    rounds: usize,
    baseline: impl Fn(usize) -> Option<usize>,
    mut time: impl FnMut(usize) -> Result<Speed>,
    mut on_turn: impl FnMut(&Turn),
) -> Result<BackToBack> {
    let rounds = rounds.max(1);
    let mut own = vec![Vec::new(); candidates];
    let mut ratios = vec![Vec::new(); candidates];
    let mut baseline_runs = Vec::new();
    for round in 0..rounds {
        let start = round * candidates / rounds;
        for i in (0..candidates).map(|k| (k + start) % candidates) {
            let base = match baseline(i).filter(|&b| b != i) {
                Some(b) => {
                    let s = time(b)?;
                    baseline_runs.push((b, s));
                    Some(s)
                }
                None => None,
            };
            let speed = time(i)?;
            own[i].push(speed);
            let vs_base = base.map(|b| speed.over(b));
            ratios[i].extend(vs_base);
            on_turn(&Turn {
                round,
                candidate: i,
                speed,
                vs_base,
            });
        }
    }
    let candidates = own
        .iter()
        .zip(&ratios)
        .map(|(own, ratios)| Paired {
            speed: Speed::median(own),
            vs_base: if ratios.is_empty() {
                Speed {
                    prefill: 1.0,
                    decode: 1.0,
                }
            } else {
                Speed::median(ratios)
            },
        })
        .collect();
    Ok(BackToBack {
        candidates,
        baseline_runs,
    })
}

/// One candidate against its base, back to back for `rounds` rounds: the candidate's speed and
/// ratios, and the base's median speed.
pub fn against(
    candidate: &Model,
    base: &Model,
    test: &SpeedTest,
    rounds: usize,
) -> Result<(Paired, Speed)> {
    let r = back_to_back(
        1,
        rounds,
        |_| Some(1),
        |s| test.measure(if s == 0 { candidate } else { base }),
        |_| {},
    )?;
    Ok((r.candidates[0], r.baseline(1)))
}
