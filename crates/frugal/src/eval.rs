//! Scoring text: perplexity the way llama.cpp's `llama-perplexity` computes it, so the figures
//! compare directly.
//!
//! The tokenized text is cut into non-overlapping windows of `n_ctx` tokens; each window is run
//! from an empty cache and only its second half is scored (positions `n_ctx/2 .. n_ctx-1`
//! predicting the next token), so every scored token has at least `n_ctx/2` tokens of context.

use crate::error::{Error, Result};
use crate::model::{Logits, Model, Scratch};
use crate::ops::log_sum_exp;

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

/// Computes the perplexity of `tokens` with windows of `n_ctx`. `progress(done, total)` is called
/// after each window.
pub fn perplexity(
    model: &Model,
    tokens: &[u32],
    n_ctx: usize,
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
    let mut kv = model.new_cache(n_ctx)?;
    let mut scratch = Scratch::default();
    let (mut sum, mut sum2, mut count) = (0f64, 0f64, 0usize);
    let mut window_ppl = Vec::with_capacity(windows);
    for w in 0..windows {
        let chunk = &tokens[w * n_ctx..(w + 1) * n_ctx];
        kv.clear();
        let logits = model.forward(chunk, &mut kv, &mut scratch, Logits::From(first))?;
        let nv = model.config.n_vocab;
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
    })
}
