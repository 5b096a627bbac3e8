//! The training loop, one for plain next-token training and for distillation: micro-batches
//! accumulated into an optimizer step, the teacher's signal (none, online, or a cached top-k),
//! clipping, AdamW on a warmup-cosine schedule, held-out evaluation, checkpoints, and a stop
//! at the first non-finite loss or gradient.

use std::path::PathBuf;
use std::time::Instant;

use frugal::convert::glob_match;

use crate::data::{Corpus, Order, Windows};
use crate::error::{Result, TrainError};
use crate::hidden::{HiddenKind, hidden_loss};
use crate::loss::{Divergence, LossSums, Targets, TeacherRows};
use crate::model::{Batch, RunOptions};
use crate::moe::SELECTION_BIAS;
use crate::optim::{AdamW, AdamWConfig, Schedule, clip};
use crate::params::{Params, Tensor};
use crate::teacher::{OnlineTeachers, TopKCache};

mod probe;
pub use probe::{LrChoice, LrProbe, LrTrial};

/// The loss of a run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LossConfig {
    /// Weight of the soft (teacher) loss; the hard-label loss gets `1 - alpha`.
    pub alpha: f32,
    pub temperature: f32,
    pub divergence: Divergence,
    pub hidden: Option<HiddenConfig>,
}

impl Default for LossConfig {
    fn default() -> Self {
        LossConfig {
            alpha: 0.0,
            temperature: 1.0,
            divergence: Divergence::Forward,
            hidden: None,
        }
    }
}

/// Hidden-state terms: student layer outputs matched to teacher layer outputs.
#[derive(Clone, Debug, serde::Serialize)]
pub struct HiddenConfig {
    pub weight: f32,
    pub kind: HiddenKind,
    /// `(student layer, teacher layer)` pairs.
    pub pairs: Vec<(usize, usize)>,
}

/// Everything that shapes a run (and must match when it is resumed).
#[derive(Clone, Debug, serde::Serialize)]
pub struct TrainConfig {
    pub seq: usize,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step.
    pub accum: usize,
    pub steps: usize,
    pub schedule: Schedule,
    pub adamw: AdamWConfig,
    /// Global gradient-norm bound (0: no clipping).
    pub clip: f64,
    /// Glob patterns of tensors that are not trained (`token_embd.weight`, `blk.*.attn_*`).
    pub freeze: Vec<String>,
    pub seed: u64,
    #[serde(skip)]
    pub run: RunOptions,
    pub loss: LossConfig,
    /// Evaluate on the held-out windows every this many steps (0: only at the end).
    pub eval_every: usize,
    /// Held-out windows evaluated (0: all).
    pub eval_windows: usize,
    #[serde(skip)]
    pub checkpoint: Option<PathBuf>,
    /// Write the checkpoint every this many steps (0: only at the end).
    pub save_every: usize,
}

impl TrainConfig {
    pub fn tokens_per_step(&self) -> usize {
        self.seq * self.batch * self.accum
    }
}

/// Where the soft targets come from.
pub enum Signal<'a> {
    /// Hard labels only.
    None,
    Online(&'a OnlineTeachers),
    Cached(&'a TopKCache),
}

/// One optimizer step's figures.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StepStats {
    pub step: usize,
    pub tokens: usize,
    pub objective: f64,
    pub ce: f64,
    pub kl: f64,
    pub hidden: f64,
    pub lr: f32,
    pub grad_norm: f64,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

/// A held-out evaluation.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct EvalPoint {
    pub step: usize,
    pub tokens: usize,
    pub ce: f64,
    pub ppl: f64,
    /// Mean KL(teacher ‖ student) at τ = 1, when a teacher is at hand.
    pub kl: Option<f64>,
}

/// What the loop reports as it goes.
pub enum Event<'e> {
    Step(&'e StepStats),
    Eval(&'e EvalPoint),
    Saved(&'e std::path::Path),
}

/// A run in progress.
pub struct Trainer<'a> {
    pub params: Params,
    /// Learned maps from student to teacher width, one per hidden pair where widths differ.
    pub projectors: Vec<Option<Tensor>>,
    pub opt: AdamW,
    /// Optimizer steps taken.
    pub step: usize,
    pub cfg: TrainConfig,
    pub history: Vec<EvalPoint>,
    data: &'a Corpus,
    signal: Signal<'a>,
    /// Teachers for held-out KL (and the hidden targets when the signal is cached).
    eval_teachers: Option<&'a OnlineTeachers>,
    order: Order,
    trainable: Vec<bool>,
    /// Per parameter tensor, the positions held at zero ([`keep_sparsity`](Self::keep_sparsity)):
    /// a bitset, one bit per weight.
    masks: Vec<Option<Vec<u64>>>,
    grads: Params,
    proj_grads: Vec<Option<Tensor>>,
    /// The held-out evaluation of the starting weights when the learning-rate probe made it
    /// (the run's first point, not measured twice).
    start_eval: Option<EvalPoint>,
}

impl<'a> Trainer<'a> {
    pub fn new(
        params: Params,
        cfg: TrainConfig,
        data: &'a Corpus,
        signal: Signal<'a>,
        eval_teachers: Option<&'a OnlineTeachers>,
    ) -> Result<Self> {
        let nv = params.config.n_vocab;
        if cfg.seq == 0 || cfg.batch == 0 || cfg.accum == 0 {
            return Err(TrainError::Invalid(
                "sequence length, batch and accumulation must be positive".into(),
            ));
        }
        if data.train.seq != cfg.seq || data.train.is_empty() {
            return Err(TrainError::Invalid(format!(
                "the data has {} training windows of {} tokens; the run needs windows of {}",
                data.train.len(),
                data.train.seq,
                cfg.seq
            )));
        }
        if let Some(&bad) = data
            .train
            .tokens
            .iter()
            .chain(&data.heldout.tokens)
            .find(|&&t| t as usize >= nv)
        {
            return Err(TrainError::Invalid(format!(
                "token {bad} of the data is outside the model's vocabulary of {nv}"
            )));
        }
        match &signal {
            Signal::Online(t) if t.n_vocab() != nv => {
                return Err(TrainError::VocabMismatch {
                    student: nv,
                    teacher: t.n_vocab(),
                });
            }
            Signal::Cached(c) => {
                c.check(&data.train, nv)?;
                if cfg.loss.divergence == Divergence::Reverse {
                    return Err(TrainError::Invalid(
                        "the reverse KL needs the teacher's full distribution (it is infinite where the top-k cache has no mass): run the teacher online".into(),
                    ));
                }
            }
            _ => {}
        }
        if matches!(signal, Signal::None) && cfg.loss.alpha > 0.0 {
            return Err(TrainError::Invalid(
                "a soft-target weight without a teacher".into(),
            ));
        }
        let ds = params.config.n_embd;
        let mut projectors = Vec::new();
        if let Some(h) = &cfg.loss.hidden {
            let t: &OnlineTeachers = match (&signal, eval_teachers) {
                (Signal::Online(t), _) => t,
                (_, Some(t)) => t,
                _ => {
                    return Err(TrainError::Invalid(
                        "a hidden-state loss needs a teacher model".into(),
                    ));
                }
            };
            let tc = &t.models[0].0.config;
            let mut rng_seed = cfg.seed ^ 0x5151;
            for &(sl, tl) in &h.pairs {
                if sl >= params.config.n_layers || tl >= tc.n_layers {
                    return Err(TrainError::Invalid(format!(
                        "hidden pair {sl}:{tl} is out of range: the student has {} layers, the teacher {}",
                        params.config.n_layers, tc.n_layers
                    )));
                }
                projectors.push((tc.n_embd != ds).then(|| {
                    rng_seed += 1;
                    projector(sl, tc.n_embd, ds, rng_seed)
                }));
            }
        }
        let trainable: Vec<bool> = params
            .tensors()
            .iter()
            .map(|t| {
                // A selection bias is set by balancing, not by gradients (it has none).
                !t.name.ends_with(SELECTION_BIAS)
                    && !cfg.freeze.iter().any(|g| glob_match(g, &t.name))
            })
            .chain(projectors.iter().flatten().map(|_| true))
            .collect();
        let sizes: Vec<usize> = params
            .tensors()
            .iter()
            .map(|t| t.data.len())
            .chain(projectors.iter().flatten().map(|t| t.data.len()))
            .collect();
        let grads = params.zeros_like();
        let proj_grads = projectors
            .iter()
            .map(|p| p.as_ref().map(Tensor::zeros_like))
            .collect();
        Ok(Trainer {
            opt: AdamW::new(cfg.adamw.clone(), sizes),
            order: Order::new(cfg.seed, data.train.len()),
            params,
            projectors,
            step: 0,
            cfg,
            history: Vec::new(),
            data,
            signal,
            eval_teachers,
            trainable,
            masks: Vec::new(),
            grads,
            proj_grads,
            start_eval: None,
        })
    }

    /// Keeps the student's sparsity pattern: every matrix weight that is exactly zero now stays
    /// zero through training (a pruned model's pattern, unstructured or N:M). Returns how many
    /// weights are held. The block matrices are what pruning touches; the embedding, the head,
    /// norms and matrices without zeros train freely.
    pub fn keep_sparsity(&mut self) -> u64 {
        let mut held = 0u64;
        self.masks = self
            .params
            .tensors()
            .iter()
            .map(|t| {
                if t.vector || !t.name.starts_with("blk.") || !t.data.contains(&0.0) {
                    return None;
                }
                let mut bits = vec![0u64; t.data.len().div_ceil(64)];
                for (i, &v) in t.data.iter().enumerate() {
                    if v == 0.0 {
                        bits[i / 64] |= 1 << (i % 64);
                        held += 1;
                    }
                }
                Some(bits)
            })
            .collect();
        held
    }

    /// The inputs and labels of the windows at run positions `first..first + n`.
    fn gather(&mut self, first: usize, n: usize) -> (Vec<usize>, Vec<u32>, Vec<u32>) {
        let seq = self.cfg.seq;
        let idx: Vec<usize> = (first..first + n).map(|i| self.order.window(i)).collect();
        let mut inputs = Vec::with_capacity(n * seq);
        let mut labels = Vec::with_capacity(n * seq);
        for &w in &idx {
            let win = self.data.train.get(w);
            inputs.extend_from_slice(&win[..seq]);
            labels.extend_from_slice(&win[1..]);
        }
        (idx, inputs, labels)
    }

    /// One optimizer step over `accum` micro-batches.
    pub fn train_step(&mut self) -> Result<StepStats> {
        let t0 = Instant::now();
        let cfg = self.cfg.clone();
        let run = cfg.run;
        let step_rows = cfg.tokens_per_step();
        self.grads
            .tensors_mut()
            .into_iter()
            .for_each(|t| t.data.fill(0.0));
        self.proj_grads
            .iter_mut()
            .flatten()
            .for_each(|t| t.data.fill(0.0));
        let mut sums = LossSums::default();
        let mut hidden_total = 0f64;
        let hidden_teacher_layers: Vec<usize> = cfg
            .loss
            .hidden
            .iter()
            .flat_map(|h| h.pairs.iter().map(|p| p.1))
            .collect();
        for micro in 0..cfg.accum {
            let first = (self.step * cfg.accum + micro) * cfg.batch;
            let (idx, inputs, labels) = self.gather(first, cfg.batch);
            // The teacher's view of this micro-batch.
            let online = match (&self.signal, self.eval_teachers) {
                (Signal::Online(t), _) => Some(t.run(&inputs, cfg.seq, &hidden_teacher_layers)?),
                (_, Some(t)) if !hidden_teacher_layers.is_empty() => {
                    Some(t.run(&inputs, cfg.seq, &hidden_teacher_layers)?)
                }
                _ => None,
            };
            let (mut topk_ids, mut topk_logp) = (Vec::new(), Vec::new());
            let teacher = match &self.signal {
                Signal::None => None,
                Signal::Online(t) => online.as_ref().map(|o| o.rows(t)),
                Signal::Cached(c) => {
                    for &w in &idx {
                        let (i, l) = c.window(w);
                        topk_ids.extend_from_slice(i);
                        topk_logp.extend_from_slice(l);
                    }
                    Some(TeacherRows::TopK {
                        k: c.k,
                        ids: &topk_ids,
                        logp: &topk_logp,
                    })
                }
            };
            let targets = Targets {
                labels: &labels,
                teacher,
                alpha: cfg.loss.alpha,
                temperature: cfg.loss.temperature,
                divergence: cfg.loss.divergence,
                step_rows,
            };
            let b = Batch {
                tokens: &inputs,
                batch: cfg.batch,
                seq: cfg.seq,
            };
            let saved = self.params.forward(&b, run);
            let mut hidden_grads = Vec::new();
            if let (Some(h), Some(o)) = (&cfg.loss.hidden, &online) {
                let ds = self.params.config.n_embd;
                for (pi, &(sl, tl)) in h.pairs.iter().enumerate() {
                    let target = &o
                        .hidden
                        .iter()
                        .find(|(l, _)| *l == tl)
                        .ok_or_else(|| {
                            TrainError::Invalid(format!(
                                "the teacher produced no output for layer {tl}"
                            ))
                        })?
                        .1;
                    let hs = &saved.residual[sl + 1];
                    let dt = target.len() / inputs.len();
                    let mut dh = vec![0f32; hs.len()];
                    let proj = match (&self.projectors[pi], &mut self.proj_grads[pi]) {
                        (Some(p), Some(g)) => Some((&p.data[..], &mut g.data[..])),
                        _ => None,
                    };
                    hidden_total += hidden_loss(
                        h.kind,
                        hs,
                        target,
                        proj,
                        ds,
                        dt,
                        h.weight,
                        step_rows,
                        &mut dh,
                        run.precision,
                    );
                    hidden_grads.push((sl, dh));
                }
            }
            let s = self
                .params
                .backward(&b, saved, &targets, hidden_grads, &mut self.grads, run);
            sums.add(&s);
        }
        let objective = (sums.objective + hidden_total) / sums.rows.max(1) as f64;
        if !objective.is_finite() {
            // Name the parameter that made it so, if one is not finite.
            let culprit = self
                .params
                .tensors()
                .iter()
                .chain(self.projectors.iter().flatten().collect::<Vec<_>>().iter())
                .find(|t| t.data.iter().any(|v| !v.is_finite()))
                .map(|t| t.name.clone())
                .unwrap_or_else(|| {
                    "the logits (every parameter is finite: the activations overflowed)".into()
                });
            return Err(self.non_finite("the loss", &culprit));
        }
        // Masked updates: a zero of the pattern gets no gradient, so AdamW (whose moments start
        // at zero) never moves it and weight decay has nothing to shrink: it stays exactly 0.
        for (g, mask) in self.grads.tensors_mut().into_iter().zip(&self.masks) {
            if let Some(bits) = mask {
                for (i, v) in g.data.iter_mut().enumerate() {
                    if bits[i / 64] >> (i % 64) & 1 == 1 {
                        *v = 0.0;
                    }
                }
            }
        }
        // Clip over the trained tensors only.
        let mut trained: Vec<&mut Tensor> = self
            .grads
            .tensors_mut()
            .into_iter()
            .chain(self.proj_grads.iter_mut().flatten())
            .zip(&self.trainable)
            .filter_map(|(g, &t)| t.then_some(g))
            .collect();
        let grad_norm = clip(&mut trained, cfg.clip);
        if !grad_norm.is_finite() {
            let name = self
                .grads
                .tensors()
                .iter()
                .find(|t| t.data.iter().any(|v| !v.is_finite()))
                .map(|t| t.name.clone())
                .unwrap_or_else(|| "a hidden-state projection".into());
            return Err(self.non_finite("the gradient", &name));
        }
        let lr = cfg.schedule.lr_at(self.step);
        {
            let mut params: Vec<&mut Tensor> = self
                .params
                .tensors_mut()
                .into_iter()
                .chain(self.projectors.iter_mut().flatten())
                .collect();
            let grads: Vec<&Tensor> = self
                .grads
                .tensors()
                .into_iter()
                .chain(self.proj_grads.iter().flatten())
                .collect();
            self.opt.update(&mut params, &grads, &self.trainable, lr);
        }
        if let Some(t) = self
            .params
            .tensors()
            .iter()
            .find(|t| t.data.iter().any(|v| !v.is_finite()))
        {
            let name = t.name.clone();
            return Err(self.non_finite("a parameter after the update", &name));
        }
        self.step += 1;
        let seconds = t0.elapsed().as_secs_f64();
        let rows = sums.rows.max(1) as f64;
        Ok(StepStats {
            step: self.step,
            tokens: self.step * step_rows,
            objective,
            ce: sums.ce / rows,
            kl: sums.kl / rows,
            hidden: hidden_total / rows,
            lr,
            grad_norm,
            seconds,
            tokens_per_s: step_rows as f64 / seconds,
        })
    }

    fn non_finite(&self, what: &str, tensor: &str) -> TrainError {
        TrainError::NonFinite {
            step: self.step + 1,
            what: what.into(),
            tensor: tensor.into(),
        }
    }

    /// Held-out cross-entropy and perplexity (and KL to the teacher when one is at hand).
    pub fn evaluate(&self) -> Result<EvalPoint> {
        let ce_kl = evaluate(
            &self.params,
            &self.data.heldout,
            self.cfg.eval_windows,
            self.cfg.batch,
            self.eval_teacher(),
            self.cfg.run,
        )?;
        Ok(EvalPoint {
            step: self.step,
            tokens: self.step * self.cfg.tokens_per_step(),
            ce: ce_kl.0,
            ppl: ce_kl.0.exp(),
            kl: ce_kl.1,
        })
    }

    fn eval_teacher(&self) -> Option<&'a OnlineTeachers> {
        match (&self.signal, self.eval_teachers) {
            (_, Some(t)) => Some(t),
            (Signal::Online(t), None) => Some(t),
            _ => None,
        }
    }

    /// Runs to `cfg.steps`, evaluating and checkpointing as configured.
    pub fn run(&mut self, mut on: impl FnMut(Event)) -> Result<()> {
        if self.step == 0 {
            let e = match self.start_eval.take() {
                Some(e) => e,
                None => self.evaluate()?,
            };
            on(Event::Eval(&e));
            self.history.push(e);
        }
        while self.step < self.cfg.steps {
            let s = self.train_step()?;
            on(Event::Step(&s));
            let last = self.step == self.cfg.steps;
            if last || (self.cfg.eval_every > 0 && self.step.is_multiple_of(self.cfg.eval_every)) {
                let e = self.evaluate()?;
                on(Event::Eval(&e));
                self.history.push(e);
            }
            if let Some(path) = self.cfg.checkpoint.clone()
                && (last
                    || (self.cfg.save_every > 0 && self.step.is_multiple_of(self.cfg.save_every)))
            {
                crate::checkpoint::save(self, &path)?;
                on(Event::Saved(&path));
            }
        }
        Ok(())
    }
}

/// A projection from student width `ds` to teacher width `dt`, initialized near a truncated
/// identity (a student initialized from the teacher's first channels starts matched).
fn projector(layer: usize, dt: usize, ds: usize, seed: u64) -> Tensor {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut t = Tensor::matrix(format!("distill.proj.{layer}.weight"), dt, ds);
    for (i, v) in t.data.iter_mut().enumerate() {
        let (r, c) = (i / ds, i % ds);
        *v = if r == c { 1.0 } else { 0.0 } + crate::params::normal(&mut rng) * 0.01;
    }
    t
}

/// Mean cross-entropy of `params` on held-out windows (the first `limit`, 0 for all), and the
/// mean KL from `teacher` at τ = 1 when given.
pub fn evaluate(
    params: &Params,
    heldout: &Windows,
    limit: usize,
    batch: usize,
    teacher: Option<&OnlineTeachers>,
    run: RunOptions,
) -> Result<(f64, Option<f64>)> {
    let n = if limit == 0 {
        heldout.len()
    } else {
        limit.min(heldout.len())
    };
    let seq = heldout.seq;
    let mut sums = LossSums::default();
    let mut kl = LossSums::default();
    for first in (0..n).step_by(batch.max(1)) {
        let m = batch.min(n - first);
        let mut inputs = Vec::with_capacity(m * seq);
        let mut labels = Vec::with_capacity(m * seq);
        for w in first..first + m {
            inputs.extend_from_slice(&heldout.get(w)[..seq]);
            labels.extend_from_slice(&heldout.get(w)[1..]);
        }
        let b = Batch {
            tokens: &inputs,
            batch: m,
            seq,
        };
        let out = match teacher {
            Some(t) => Some(t.run(&inputs, seq, &[])?),
            None => None,
        };
        let targets = Targets {
            labels: &labels,
            teacher: out.as_ref().zip(teacher).map(|(o, t)| o.rows(t)),
            // α = 1 makes the objective the KL itself; the CE is reported alongside.
            alpha: if teacher.is_some() { 1.0 } else { 0.0 },
            temperature: 1.0,
            divergence: Divergence::Forward,
            step_rows: labels.len(),
        };
        let s = params.loss(&b, &targets, run.precision);
        sums.add(&s);
        kl.add(&s);
    }
    Ok((sums.mean_ce(), teacher.map(|_| kl.mean_kl())))
}
