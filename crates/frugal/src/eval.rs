//! Scoring text: perplexity the way llama.cpp's `llama-perplexity` computes it, so the figures
//! compare directly.
//!
//! The tokenized text is cut into non-overlapping windows of `n_ctx` tokens; each window is run
//! from an empty cache and only its second half is scored (positions `n_ctx/2 .. n_ctx-1`
//! predicting the next token), so every scored token has at least `n_ctx/2` tokens of context.

use crate::attention::Attention;
use crate::error::{Error, Result};
use crate::kv::{KvOptions, KvSequence};
use crate::model::{Logits, Model, Scratch};
use crate::ops::log_sum_exp;

/// How the model runs while scoring.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    pub kv: KvOptions,
    pub attention: Attention,
    /// Also run every window with this cache and attention, and report how far the
    /// distributions above moved from it ([`KlStats`]).
    pub baseline: Option<(KvOptions, Attention)>,
}

/// Divergence of the evaluated configuration from the baseline, over the scored tokens (as
/// llama.cpp's `--kl-divergence`: KL(baseline || evaluated) of the next-token distributions).
#[derive(Clone, Debug, serde::Serialize)]
pub struct KlStats {
    pub mean_kld: f64,
    pub p99_kld: f64,
    pub max_kld: f64,
    /// Fraction of scored positions whose most likely token is the same.
    pub same_top: f64,
    pub baseline_ppl: f64,
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
    /// Present when a baseline was given.
    pub kl: Option<KlStats>,
}

/// Computes the perplexity of `tokens` with windows of `n_ctx`. `progress(done, total)` is called
/// after each window.
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
    mut progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
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
    let first = n_ctx / 2;
    let mut kv = model.new_seq_cache(n_ctx, &opts.kv)?;
    let mut scratch = Scratch::new(opts.attention);
    let mut base = match &opts.baseline {
        Some((kv_opts, att)) => Some((model.new_seq_cache(n_ctx, kv_opts)?, Scratch::new(*att))),
        None => None,
    };
    let (mut klds, mut same_top, mut base_nll) = (Vec::new(), 0usize, 0f64);
    let (mut sum, mut sum2, mut count) = (0f64, 0f64, 0usize);
    let mut window_ppl = Vec::with_capacity(windows);
    for w in 0..windows {
        let chunk = &tokens[w * n_ctx..(w + 1) * n_ctx];
        kv.clear();
        let logits = model.forward(chunk, &mut kv, &mut scratch, Logits::From(first))?;
        let nv = model.config.n_vocab;
        if let Some((bkv, bscratch)) = &mut base {
            bkv.clear();
            let blogits = model.forward(
                chunk,
                bkv as &mut dyn KvSequence,
                bscratch,
                Logits::From(first),
            )?;
            for j in first..n_ctx - 1 {
                let r = (j - first) * nv..(j - first + 1) * nv;
                let (p, q) = (&blogits[r.clone()], &logits[r]);
                klds.push(kl_divergence(p, q));
                same_top += usize::from(argmax(p) == argmax(q));
                base_nll += log_sum_exp(p) - f64::from(p[chunk[j + 1] as usize]);
            }
        }
        let mut wsum = 0f64;
        for j in first..n_ctx - 1 {
            let row = &logits[(j - first) * nv..(j - first + 1) * nv];
            let nll = log_sum_exp(row) - f64::from(row[chunk[j + 1] as usize]);
            wsum += nll;
            sum += nll;
            sum2 += nll * nll;
            count += 1;
        }
        window_ppl.push((wsum / (n_ctx - 1 - first) as f64).exp());
        progress(w + 1, windows);
    }
    let mean = sum / count as f64;
    let var = sum2 / count as f64 - mean * mean;
    let ppl = mean.exp();
    let stderr = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(Perplexity {
        ppl,
        ppl_stderr: stderr,
        tokens: count,
        windows,
        ctx: n_ctx,
        nll: mean,
        window_ppl,
        kl: base.map(|_| {
            klds.sort_by(f64::total_cmp);
            let n = klds.len().max(1);
            KlStats {
                mean_kld: klds.iter().sum::<f64>() / n as f64,
                p99_kld: klds[((n as f64 * 0.99) as usize).min(n - 1)],
                max_kld: klds.last().copied().unwrap_or(0.0),
                same_top: same_top as f64 / n as f64,
                baseline_ppl: (base_nll / n as f64).exp(),
            }
        }),
    })
}

/// KL(p || q) of the softmax distributions of two logit rows, in f64.
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

fn argmax(x: &[f32]) -> usize {
    (0..x.len())
        .max_by(|&a, &b| x[a].total_cmp(&x[b]))
        .unwrap_or(0)
}
