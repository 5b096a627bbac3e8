//! Scoring text: perplexity the way llama.cpp's `llama-perplexity` computes it, so the figures
//! compare directly.
//!
//! The tokenized text is cut into non-overlapping windows of `n_ctx` tokens; each window is run
//! from an empty cache and only its second half is scored (positions `n_ctx/2 .. n_ctx-1`
//! predicting the next token), so every scored token has at least `n_ctx/2` tokens of context.
//!
//! [`compare`] scores a model and a reference (say a quantized file and the F32 file it came
//! from) in one pass over the same windows and measures, at every scored position, the KL
//! divergence of the model's next-token distribution from the reference's and whether their
//! top tokens agree: perplexity alone hides errors that cancel on average, KL does not. The
//! two sides can also be one model run two ways (a quantized KV cache against the f32 one).

use crate::attention::Attention;
use crate::error::{Error, Result};
use crate::kv::{KvOptions, KvSequence};
use crate::model::{Logits, Model, RoutingStats, Scratch};
use crate::ops::log_sum_exp;

/// How a model runs while scoring: its KV-cache format and layout and its attention kernel.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    pub kv: KvOptions,
    pub attention: Attention,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Perplexity {
    pub ppl: f64,
    /// Standard error of the PPL estimate (delta method on the mean NLL, as llama.cpp).
    pub ppl_stderr: f64,
    /// Tokens scored.
    pub tokens: usize,
    pub windows: usize,
    pub ctx: usize,
    /// Mean negative log-likelihood (nats per token).
    pub nll: f64,
    /// PPL of each window alone.
    pub window_ppl: Vec<f64>,
}

/// Running sums of the negative log-likelihoods of scored tokens.
#[derive(Default)]
struct NllSums {
    sum: f64,
    sum2: f64,
    count: usize,
    window_sum: f64,
    window_count: usize,
    window_ppl: Vec<f64>,
}

impl NllSums {
    fn add(&mut self, nll: f64) {
        self.sum += nll;
        self.sum2 += nll * nll;
        self.count += 1;
        self.window_sum += nll;
        self.window_count += 1;
    }

    fn end_window(&mut self) {
        self.window_ppl
            .push((self.window_sum / self.window_count.max(1) as f64).exp());
        self.window_sum = 0.0;
        self.window_count = 0;
    }

    fn finish(self, windows: usize, ctx: usize) -> Perplexity {
        let mean = self.sum / self.count as f64;
        let var = self.sum2 / self.count as f64 - mean * mean;
        let ppl = mean.exp();
        let stderr = if var > 0.0 && self.count > 1 {
            (var / (self.count - 1) as f64).sqrt() * ppl
        } else {
            0.0
        };
        Perplexity {
            ppl,
            ppl_stderr: stderr,
            tokens: self.count,
            windows,
            ctx,
            nll: mean,
            window_ppl: self.window_ppl,
        }
    }
}

/// Checks the window size against the text and returns the number of windows.
fn window_count(tokens: &[u32], n_ctx: usize) -> Result<usize> {
    if n_ctx < 4 {
        return Err(Error::Invalid(format!(
            "context {n_ctx} is too small to score (need at least 4)"
        )));
    }
    let windows = tokens.len() / n_ctx;
    if windows == 0 {
        return Err(Error::Invalid(format!(
            "the text has {} tokens, fewer than one window of {n_ctx}",
            tokens.len()
        )));
    }
    Ok(windows)
}

/// The token that starts every window: BOS for a model that is meant to see it first
/// (`tokenizer.ggml.add_bos_token`), as llama.cpp's perplexity does, so each window starts the
/// way the model was trained (Gemma without BOS is far worse: 20.3 against 13.9 on GPL-3).
/// Only the context changes: the scored positions are the second half of the window.
fn window_bos(model: &Model) -> Result<Option<u32>> {
    let f = &model.file;
    if f.bool_opt("tokenizer.ggml.add_bos_token")? != Some(true) {
        return Ok(None);
    }
    Ok(f.u32_opt("tokenizer.ggml.bos_token_id")?
        .filter(|&b| (b as usize) < model.config.n_vocab))
}

/// Computes the perplexity of `tokens` with windows of `n_ctx` (default cache and attention).
/// `progress(done, total)` is called after each window.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    n_ctx: usize,
    progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    perplexity_with(model, tokens, n_ctx, &EvalOptions::default(), progress)
}

/// [`perplexity`] with the cache format, layout and attention of `opts`.
pub fn perplexity_with(
    model: &Model,
    tokens: &[u32],
    n_ctx: usize,
    opts: &EvalOptions,
    progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    perplexity_routed(model, tokens, n_ctx, opts, false, progress).map(|(p, _)| p)
}

/// [`perplexity_with`], also counting, when `record` is set and the model has experts, how the
/// router sent every position of every window (`--moe-stats`).
pub fn perplexity_routed(
    model: &Model,
    tokens: &[u32],
    n_ctx: usize,
    opts: &EvalOptions,
    record: bool,
    mut progress: impl FnMut(usize, usize),
) -> Result<(Perplexity, Option<RoutingStats>)> {
    let windows = window_count(tokens, n_ctx)?;
    let first = n_ctx / 2;
    let mut kv = model.new_seq_cache(n_ctx, &opts.kv)?;
    let mut scratch = Scratch::new(opts.attention);
    if let (true, Some(m)) = (record, model.config.moe) {
        scratch.moe.stats = Some(RoutingStats::new(model.config.n_layers, m.n_expert));
    }
    let mut sums = NllSums::default();
    let nv = model.config.n_vocab;
    let bos = window_bos(model)?;
    let mut window = Vec::with_capacity(n_ctx);
    for w in 0..windows {
        let mut chunk = &tokens[w * n_ctx..(w + 1) * n_ctx];
        if let Some(b) = bos {
            window.clear();
            window.push(b);
            window.extend_from_slice(&chunk[1..]);
            chunk = &window;
        }
        kv.clear();
        let logits = model.forward(
            chunk,
            &mut kv as &mut dyn KvSequence,
            &mut scratch,
            Logits::From(first),
        )?;
        for j in first..n_ctx - 1 {
            let row = &logits[(j - first) * nv..(j - first + 1) * nv];
            sums.add(log_sum_exp(row) - f64::from(row[chunk[j + 1] as usize]));
        }
        sums.end_window();
        progress(w + 1, windows);
    }
    Ok((sums.finish(windows, n_ctx), scratch.moe.stats.take()))
}

/// A model scored against a reference on the same positions: both perplexities and how far the
/// model's next-token distribution is from the reference's (what llama.cpp's perplexity tool
/// reports with `--kl-divergence`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Comparison {
    pub model: Perplexity,
    pub reference: Perplexity,
    /// Positions compared (the scored positions).
    pub positions: usize,
    /// Mean over positions of KL(reference || model) = sum_v p_ref(v) (ln p_ref(v) - ln p(v)),
    /// in nats.
    pub kl_mean: f64,
    /// Standard error of the mean KL.
    pub kl_stderr: f64,
    pub kl_median: f64,
    /// 99th percentile of the per-position KL (linear interpolation between order statistics).
    pub kl_p99: f64,
    pub kl_max: f64,
    /// Fraction of positions where both put the same token first.
    pub top1_agreement: f64,
}

/// The `q`-quantile of sorted values, interpolating linearly between neighbours.
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// KL(p || q) of the softmax distributions of two logit rows, in f64 (rounding can leave a tiny
/// negative sum for identical distributions: clamped to 0).
pub fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_sum_exp(p), log_sum_exp(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = f64::from(a) - lp;
            la.exp() * (la - (f64::from(b) - lq))
        })
        .sum::<f64>()
        .max(0.0)
}

/// Scores `tokens` with `model` and `reference` (default cache and attention) in one pass.
pub fn compare(
    model: &Model,
    reference: &Model,
    tokens: &[u32],
    n_ctx: usize,
    progress: impl FnMut(usize, usize),
) -> Result<Comparison> {
    let d = EvalOptions::default();
    compare_with((model, &d), (reference, &d), tokens, n_ctx, progress)
}

/// Scores `tokens` with a model and a reference, each run with its own options, in one pass over
/// the same windows (as [`perplexity`] cuts them), and compares their distributions at every
/// scored position. The two may be one model run two ways.
pub fn compare_with(
    (model, opts): (&Model, &EvalOptions),
    (reference, ref_opts): (&Model, &EvalOptions),
    tokens: &[u32],
    n_ctx: usize,
    mut progress: impl FnMut(usize, usize),
) -> Result<Comparison> {
    let nv = model.config.n_vocab;
    if reference.config.n_vocab != nv {
        return Err(Error::Invalid(format!(
            "the reference model has a vocabulary of {}, the model {nv}: their distributions cannot be compared",
            reference.config.n_vocab
        )));
    }
    let windows = window_count(tokens, n_ctx)?;
    let first = n_ctx / 2;
    let (mut kv, mut kv_ref) = (
        model.new_seq_cache(n_ctx, &opts.kv)?,
        reference.new_seq_cache(n_ctx, &ref_opts.kv)?,
    );
    let (mut s, mut s_ref) = (
        Scratch::new(opts.attention),
        Scratch::new(ref_opts.attention),
    );
    let (mut sums, mut sums_ref) = (NllSums::default(), NllSums::default());
    let mut kls = Vec::with_capacity(windows * (n_ctx - 1 - first));
    let mut agree = 0usize;
    for w in 0..windows {
        let chunk = &tokens[w * n_ctx..(w + 1) * n_ctx];
        kv.clear();
        kv_ref.clear();
        let logits = model.forward(
            chunk,
            &mut kv as &mut dyn KvSequence,
            &mut s,
            Logits::From(first),
        )?;
        let logits_ref = reference.forward(
            chunk,
            &mut kv_ref as &mut dyn KvSequence,
            &mut s_ref,
            Logits::From(first),
        )?;
        for j in first..n_ctx - 1 {
            let r = (j - first) * nv..(j - first + 1) * nv;
            let (row, row_ref) = (&logits[r.clone()], &logits_ref[r]);
            let next = chunk[j + 1] as usize;
            sums.add(log_sum_exp(row) - f64::from(row[next]));
            sums_ref.add(log_sum_exp(row_ref) - f64::from(row_ref[next]));
            kls.push(kl_divergence(row_ref, row));
            agree += usize::from(argmax(row) == argmax(row_ref));
        }
        sums.end_window();
        sums_ref.end_window();
        progress(w + 1, windows);
    }
    let n = kls.len() as f64;
    let mean = kls.iter().sum::<f64>() / n;
    let var = kls.iter().map(|k| (k - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let mut sorted = kls;
    sorted.sort_by(f64::total_cmp);
    Ok(Comparison {
        model: sums.finish(windows, n_ctx),
        reference: sums_ref.finish(windows, n_ctx),
        positions: sorted.len(),
        kl_mean: mean,
        kl_stderr: (var / n).sqrt(),
        kl_median: quantile(&sorted, 0.5),
        kl_p99: quantile(&sorted, 0.99),
        kl_max: sorted.last().copied().unwrap_or(0.0),
        top1_agreement: agree as f64 / n,
    })
}
