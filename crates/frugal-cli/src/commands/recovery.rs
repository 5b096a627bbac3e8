//! Recovery by distillation as the reports run it: a student (a converted or pruned model)
//! distilled from the original with the KL at τ = 2, AdamW with 5% warmup and a cosine decay to
//! 10%, the gradient clipped at 1, and held-out evaluations along the way.

use anyhow::Result;
use frugal_train::Params;
use frugal_train::data::Corpus;
use frugal_train::loss::Divergence;
use frugal_train::model::RunOptions;
use frugal_train::optim::{AdamWConfig, Schedule};
use frugal_train::teacher::OnlineTeachers;
use frugal_train::trainer::{EvalPoint, Event, LossConfig, Signal, TrainConfig, Trainer};

/// How every recovery of one report trains.
pub struct Recovery {
    pub seq: usize,
    pub batch: usize,
    pub lr: f32,
    /// Held-out evaluations during a run (the curve's points).
    pub points: usize,
    pub eval_windows: usize,
    pub seed: u64,
    pub run: RunOptions,
}

impl Recovery {
    /// Optimizer steps for a budget of `tokens`.
    pub fn steps(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.seq * self.batch)
    }

    /// Distils `student` from `teachers` for `steps` steps (keeping its zeros at zero when
    /// `keep_sparsity`); the held-out curve and the trained parameters.
    pub fn distil(
        &self,
        student: Params,
        steps: usize,
        data: &Corpus,
        teachers: &OnlineTeachers,
        keep_sparsity: bool,
    ) -> Result<(Vec<EvalPoint>, Params)> {
        let cfg = TrainConfig {
            seq: self.seq,
            batch: self.batch,
            accum: 1,
            steps,
            schedule: Schedule {
                lr: self.lr,
                warmup: (steps / 20).max(1),
                total: steps,
                min_ratio: 0.1,
            },
            adamw: AdamWConfig::default(),
            clip: 1.0,
            freeze: Vec::new(),
            seed: self.seed,
            run: self.run,
            loss: LossConfig {
                alpha: 1.0,
                temperature: 2.0,
                divergence: Divergence::Forward,
                hidden: None,
            },
            eval_every: (steps / self.points.max(1)).max(1),
            eval_windows: self.eval_windows,
            checkpoint: None,
            save_every: 0,
        };
        let mut t = Trainer::new(student, cfg, data, Signal::Online(teachers), Some(teachers))?;
        if keep_sparsity {
            t.keep_sparsity();
        }
        t.run(|e| match e {
            Event::Step(s) => eprint!(
                "\r  step {}/{steps} loss {:.3} {:.0} tok/s   ",
                s.step, s.objective, s.tokens_per_s
            ),
            Event::Eval(p) => eprintln!(
                "\r  {} tokens: held-out PPL {:.2}, KL {:.4}            ",
                p.tokens,
                p.ppl,
                p.kl.unwrap_or(f64::NAN)
            ),
            Event::Saved(_) => {}
        })?;
        Ok((t.history.clone(), t.params))
    }
}
