//! Training draft heads (Medusa-1) on the target's own generations, with the target frozen.
//!
//! 1. [`generate_corpus`]: the target continues prompts greedily, many sequences per batched
//!    pass, so the heads learn what the target itself says next (self-distillation: the drafts
//!    they make at inference are checked against exactly that).
//! 2. One more pass over each sequence keeps the normalized last hidden state `z` of every
//!    generated position: the heads' only input, computed once.
//! 3. [`train`]: head `j` at position `t` learns the token at `t + 1 + j` with cross-entropy,
//!    through its residual block `u = z + SiLU(W z + b)` and the target's frozen output matrix,
//!    restricted to the most frequent tokens of the corpus (FR-Spec) so each step costs a sixth
//!    of the full vocabulary's.
//!
//! The backward (`head_backward`) is checked against finite differences in the tests.

use frugal::kv::KvFormat;
use frugal::model::{Logits, Model, Scratch, Segment};
use frugal::ops::rms_norm;
use frugal::speculate::HeadWeights;
use frugal::speculate::heads::token_features;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, TrainError};
use crate::gemm::{MatRef, Precision, matmul};
use crate::optim::{AdamW, AdamWConfig, Schedule};
use crate::params::Tensor;

/// Greedy continuations of `prompts`, `n_new` tokens each (fewer when the model ends the text),
/// decoded together in batched passes of up to `batch` sequences. Returns each prompt followed
/// by its continuation, and the prompt lengths.
pub fn generate_corpus(
    model: &Model,
    prompts: &[Vec<u32>],
    n_new: usize,
    batch: usize,
    eog: &dyn Fn(u32) -> bool,
    mut progress: impl FnMut(usize),
) -> Result<Vec<(Vec<u32>, usize)>> {
    let mut out = Vec::with_capacity(prompts.len());
    let block = 16;
    let mut done_tokens = 0;
    for group in prompts.chunks(batch.max(1)) {
        let per: usize = group
            .iter()
            .map(|p| (p.len() + n_new).div_ceil(block) + 1)
            .sum();
        let mut pool = model.new_kv_pool(KvFormat::default(), block, per)?;
        let ids: Vec<_> = group
            .iter()
            .map(|p| pool.add_sequence(p.len() + n_new + 1))
            .collect();
        let mut seqs: Vec<Vec<u32>> = group.to_vec();
        let mut s = Scratch::default();
        // Prefill each prompt (one segment each), then decode all together.
        let segs: Vec<Segment> = group
            .iter()
            .zip(&ids)
            .map(|(p, &seq)| Segment {
                seq,
                tokens: p,
                logits: true,
                all_logits: false,
            })
            .collect();
        let v = model.config.n_vocab;
        let logits = model.forward_batch(&segs, &mut pool, &mut s)?;
        let mut next: Vec<u32> = logits.chunks_exact(v).map(argmax).collect();
        let mut live: Vec<bool> = vec![true; group.len()];
        for _ in 0..n_new {
            let mut segs = Vec::new();
            let mut order = Vec::new();
            for i in 0..group.len() {
                if !live[i] {
                    continue;
                }
                if eog(next[i]) {
                    live[i] = false;
                    continue;
                }
                seqs[i].push(next[i]);
                done_tokens += 1;
                order.push(i);
            }
            if order.is_empty() {
                break;
            }
            let toks: Vec<[u32; 1]> = order.iter().map(|&i| [next[i]]).collect();
            for (k, &i) in order.iter().enumerate() {
                segs.push(Segment {
                    seq: ids[i],
                    tokens: &toks[k],
                    logits: true,
                    all_logits: false,
                });
            }
            let logits = model.forward_batch(&segs, &mut pool, &mut s)?;
            for (row, &i) in logits.chunks_exact(v).zip(&order) {
                next[i] = argmax(row);
            }
            progress(done_tokens);
        }
        out.extend(seqs.into_iter().zip(group.iter().map(|p| p.len())));
    }
    Ok(out)
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &x) in row.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0 as u32
}

/// Training data for the heads: `z` (normalized last hidden state) of every position from the
/// last prompt token on, and the tokens that follow it.
pub struct HeadCorpus {
    pub n_embd: usize,
    /// Rows of `n_embd`.
    pub z: Vec<f32>,
    /// For row `r`: the tokens after its position (up to the number of heads + 1), the first
    /// being the target's own next token.
    pub next: Vec<Vec<u32>>,
    /// The first row of each sequence, in order (held-out rows are whole sequences).
    pub seq_starts: Vec<usize>,
}

/// Runs each sequence once more to keep `z` at its generated positions.
pub fn hidden_states(
    model: &Model,
    seqs: &[(Vec<u32>, usize)],
    n_heads: usize,
) -> Result<HeadCorpus> {
    let c = &model.config;
    let d = c.n_embd;
    let mut corpus = HeadCorpus {
        n_embd: d,
        z: Vec::new(),
        next: Vec::new(),
        seq_starts: Vec::new(),
    };
    let mut s = Scratch::default();
    for (seq, prompt_len) in seqs {
        if *prompt_len == 0 || seq.len() <= *prompt_len || seq.len() > c.n_ctx_train.max(1) {
            continue;
        }
        let mut kv = model.new_seq_cache(seq.len(), &Default::default())?;
        model.forward(seq, &mut kv, &mut s, Logits::Last)?;
        let h = s.hidden();
        corpus.seq_starts.push(corpus.next.len());
        let mut z = vec![0.0; d];
        for t in prompt_len - 1..seq.len() - 1 {
            rms_norm(
                &h[t * d..(t + 1) * d],
                &model.weights.output_norm,
                c.rms_eps,
                &mut z,
            );
            corpus.z.extend_from_slice(&z);
            let end = (t + 2 + n_heads).min(seq.len());
            corpus.next.push(seq[t + 1..end].to_vec());
        }
    }
    Ok(corpus)
}

/// The vocabulary the heads score, `size` token ids ordered by id: the tokens most frequent among
/// the corpus targets, topped up with the lowest ids not yet in (a BPE vocabulary is numbered in
/// merge order, roughly by frequency in the tokenizer's own training text), so a narrow corpus
/// does not leave out common words it happens to lack.
pub fn frequent_tokens(corpus: &HeadCorpus, size: usize, n_vocab: usize) -> Vec<u32> {
    let mut counts = std::collections::HashMap::<u32, usize>::new();
    for n in &corpus.next {
        for &t in n {
            *counts.entry(t).or_default() += 1;
        }
    }
    let mut by_count: Vec<(u32, usize)> = counts.into_iter().collect();
    by_count.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    by_count.truncate(size);
    let mut keep = vec![false; n_vocab];
    for &(t, _) in &by_count {
        if let Some(k) = keep.get_mut(t as usize) {
            *k = true;
        }
    }
    let mut missing = size.saturating_sub(by_count.len());
    for k in keep.iter_mut() {
        if missing == 0 {
            break;
        }
        if !*k {
            *k = true;
            missing -= 1;
        }
    }
    (0..n_vocab as u32).filter(|&t| keep[t as usize]).collect()
}

#[derive(Clone, Debug)]
pub struct HeadsConfig {
    pub n_heads: usize,
    /// Tokens the heads score (FR-Spec); 0 keeps the whole vocabulary.
    pub vocab: usize,
    pub steps: usize,
    pub batch: usize,
    pub lr: f32,
    pub seed: u64,
    /// Heads also read the previous token's embedding (see `frugal::speculate::heads`).
    pub token_input: bool,
    /// Share of the sequences kept out of training to measure the heads on (0 to 0.5).
    pub holdout: f64,
}

/// What training reports per head: the mean cross-entropy and the top-1 accuracy of the last
/// quarter of the steps, and on the held-out sequences the accuracy and the chained accuracy
/// (this head and every one before it right: the share of drafts of this length fully kept).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct HeadReport {
    pub loss: f64,
    pub accuracy: f64,
    pub held_out_accuracy: f64,
    pub held_out_chain: f64,
}

/// A head's forward on a batch: its input `x` (`n x din`: `z`, or `z` and the previous token's
/// features, the first `d` columns `z` being the residual), its `w` (`d x din`) and `b`, and the
/// output rows `out` (`v x d`).
struct HeadForward {
    /// `x W^T + b`, before the SiLU.
    pre: Vec<f32>,
    /// `sigmoid(pre)`.
    sig: Vec<f32>,
    /// `z + SiLU(pre)` scored against `out`: `n x v`.
    logits: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn head_forward(
    x: &[f32],
    n: usize,
    d: usize,
    w: &[f32],
    b: &[f32],
    out: &[f32],
    v: usize,
) -> HeadForward {
    let p = Precision::F32;
    let din = x.len() / n.max(1);
    let mut pre = vec![0.0; n * d];
    matmul(
        MatRef::new(x, n, din),
        MatRef::new(w, d, din).t(),
        &mut pre,
        false,
        p,
    );
    let mut u = vec![0.0; n * d];
    let mut sig = vec![0.0; n * d];
    for i in 0..n * d {
        let a = pre[i] + b[i % d];
        pre[i] = a;
        let s = 1.0 / (1.0 + (-a).exp());
        sig[i] = s;
        u[i] = x_at(x, din, d, i) + a * s;
    }
    let mut logits = vec![0.0; n * v];
    matmul(
        MatRef::new(&u, n, d),
        MatRef::new(out, v, d).t(),
        &mut logits,
        false,
        p,
    );
    HeadForward { pre, sig, logits }
}

/// One head's forward and backward on a batch (the arguments of [`head_forward`]), targets as
/// indices into the rows of `out` (`None`: not scored). Adds the gradients of the mean
/// cross-entropy to `gw` and `gb`; returns (sum of losses, scored rows, correct top-1).
#[allow(clippy::too_many_arguments)]
fn head_backward(
    x: &[f32],
    n: usize,
    d: usize,
    w: &[f32],
    b: &[f32],
    out: &[f32],
    v: usize,
    targets: &[Option<usize>],
    gw: &mut [f32],
    gb: &mut [f32],
) -> (f64, usize, usize) {
    let p = Precision::F32;
    let din = x.len() / n.max(1);
    let HeadForward {
        pre,
        sig,
        mut logits,
    } = head_forward(x, n, d, w, b, out, v);
    // Softmax cross-entropy; dlogits = (softmax - onehot) / scored.
    let counted = targets.iter().filter(|t| t.is_some()).count();
    let scored = counted.max(1);
    let (mut loss, mut correct) = (0.0f64, 0);
    for (row, t) in logits.chunks_exact_mut(v).zip(targets) {
        let Some(t) = *t else {
            row.iter_mut().for_each(|x| *x = 0.0);
            continue;
        };
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let top = row.iter().position(|&x| x == max).unwrap_or(0);
        correct += usize::from(top == t);
        let mut sum = 0.0f64;
        for x in row.iter_mut() {
            *x = (*x - max).exp();
            sum += f64::from(*x);
        }
        loss += sum.ln() - f64::from(row[t].ln());
        let inv = (1.0 / sum) as f32 / scored as f32;
        row.iter_mut().for_each(|x| *x *= inv);
        row[t] -= 1.0 / scored as f32;
    }
    // du = dlogits out; da = du * SiLU'(pre), SiLU'(a) = s (1 + a (1 - s))
    let mut du = vec![0.0; n * d];
    matmul(
        MatRef::new(&logits, n, v),
        MatRef::new(out, v, d),
        &mut du,
        false,
        p,
    );
    for i in 0..n * d {
        du[i] *= sig[i] * (1.0 + pre[i] * (1.0 - sig[i]));
        gb[i % d] += du[i];
    }
    // gW += da^T x
    matmul(
        MatRef::new(&du, n, d).t(),
        MatRef::new(x, n, din),
        gw,
        true,
        p,
    );
    (loss, counted, correct)
}

/// Element `i` of the `n x d` residual `z`: the first `d` columns of the `n x din` input.
fn x_at(x: &[f32], din: usize, d: usize, i: usize) -> f32 {
    x[(i / d) * din + i % d]
}

/// Trains `cfg.n_heads` heads for `model` on `corpus`, keeping a share `cfg.holdout` of its
/// sequences out of training to measure the heads on.
pub fn train(
    model: &Model,
    corpus: &HeadCorpus,
    cfg: &HeadsConfig,
    mut progress: impl FnMut(usize, &[HeadReport]),
) -> Result<(HeadWeights, Vec<HeadReport>)> {
    let c = &model.config;
    let d = c.n_embd;
    if cfg.n_heads == 0 || cfg.batch == 0 {
        return Err(TrainError::Invalid(
            "at least one head and a batch of at least one".into(),
        ));
    }
    if !(0.0..=0.5).contains(&cfg.holdout) {
        return Err(TrainError::Invalid(format!(
            "the held-out share must be 0 to 0.5, not {}",
            cfg.holdout
        )));
    }
    // Held-out rows: every `1 / holdout`-th sequence, whole, so held-out positions come from
    // every kind of prompt and none of their neighbours train.
    let every = if cfg.holdout > 0.0 {
        (1.0 / cfg.holdout).round() as usize
    } else {
        usize::MAX
    };
    let (mut train_rows, mut held) = (Vec::new(), Vec::new());
    for (i, &start) in corpus.seq_starts.iter().enumerate() {
        let end = corpus
            .seq_starts
            .get(i + 1)
            .copied()
            .unwrap_or(corpus.next.len());
        let dst = if i % every == every - 1 {
            &mut held
        } else {
            &mut train_rows
        };
        dst.extend(start..end);
    }
    let rows = train_rows.len();
    if rows == 0 {
        return Err(TrainError::Invalid(
            "no training positions: the corpus is empty".into(),
        ));
    }
    let vocab = if cfg.vocab == 0 || cfg.vocab >= c.n_vocab {
        None
    } else {
        Some(frequent_tokens(corpus, cfg.vocab, c.n_vocab))
    };
    let ids: Vec<u32> = vocab
        .clone()
        .unwrap_or_else(|| (0..c.n_vocab as u32).collect());
    let index: std::collections::HashMap<u32, usize> =
        ids.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    let v = ids.len();
    // The frozen output rows the heads score, in f32.
    let out_m = model.weights.output.view();
    let mut out = vec![0.0; v * d];
    for (row, &t) in out.chunks_exact_mut(d).zip(&ids) {
        out_m.dequantize_row(t as usize, row);
    }
    let shape = HeadWeights::identity(cfg.n_heads, d, c.n_vocab, vocab, cfg.token_input);
    let din = shape.input_len();
    let mut params: Vec<Tensor> = Vec::new();
    for j in 0..cfg.n_heads {
        params.push(Tensor::matrix(format!("heads.{j}.weight"), d, din));
        params.push(Tensor::vector(format!("heads.{j}.bias"), d));
    }
    let mut opt = AdamW::new(
        AdamWConfig {
            weight_decay: 0.0,
            ..Default::default()
        },
        params.iter().map(|t| t.data.len()),
    );
    let sched = Schedule {
        lr: cfg.lr,
        warmup: (cfg.steps / 20).max(1),
        total: cfg.steps,
        min_ratio: 0.1,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let mut order = train_rows;
    order.shuffle(&mut rng);
    let mut cursor = 0;
    let mut reports = vec![HeadReport::default(); cfg.n_heads];
    let mut tail: Vec<(f64, usize, usize)> = vec![(0.0, 0, 0); cfg.n_heads];
    let n = cfg.batch.min(rows);
    let mut x = vec![0.0; n * din];
    for step in 0..cfg.steps {
        let mut batch = Vec::with_capacity(n);
        for _ in 0..n {
            if cursor == rows {
                order.shuffle(&mut rng);
                cursor = 0;
            }
            batch.push(order[cursor]);
            cursor += 1;
        }
        let mut grads: Vec<Tensor> = params.iter().map(Tensor::zeros_like).collect();
        for j in 0..cfg.n_heads {
            let targets = head_inputs(model, corpus, &batch, j, din, &index, &mut x);
            let (gw, gb) = grads.split_at_mut(2 * j + 1);
            let (loss, scored, correct) = head_backward(
                &x,
                n,
                d,
                &params[2 * j].data,
                &params[2 * j + 1].data,
                &out,
                v,
                &targets,
                &mut gw[2 * j].data,
                &mut gb[0].data,
            );
            if !loss.is_finite() {
                return Err(TrainError::NonFinite {
                    step,
                    what: "the loss".into(),
                    tensor: format!("heads.{j}"),
                });
            }
            if step >= cfg.steps - cfg.steps.div_ceil(4) {
                let t = &mut tail[j];
                (t.0, t.1, t.2) = (t.0 + loss, t.1 + scored, t.2 + correct);
            }
            reports[j] = HeadReport {
                loss: loss / scored.max(1) as f64,
                accuracy: correct as f64 / scored.max(1) as f64,
                ..Default::default()
            };
        }
        let trainable = vec![true; params.len()];
        let mut pr: Vec<&mut Tensor> = params.iter_mut().collect();
        let gr: Vec<&Tensor> = grads.iter().collect();
        opt.update(&mut pr, &gr, &trainable, sched.lr_at(step));
        progress(step, &reports);
    }
    let mut reports: Vec<HeadReport> = tail
        .iter()
        .map(|&(l, s, c)| HeadReport {
            loss: l / s.max(1) as f64,
            accuracy: c as f64 / s.max(1) as f64,
            ..Default::default()
        })
        .collect();
    let mut w = shape;
    for (j, h) in w.heads.iter_mut().enumerate() {
        h.0.clone_from(&params[2 * j].data);
        h.1.clone_from(&params[2 * j + 1].data);
    }
    // Held out: each head's accuracy, and the chain (this head and all before it right).
    let mut right = vec![0usize; cfg.n_heads];
    let mut chain_right = vec![0usize; cfg.n_heads];
    let mut chain_alive = vec![true; held.len()];
    let mut scored = vec![0usize; cfg.n_heads];
    for (bi, batch) in held.chunks(cfg.batch).enumerate() {
        let base = bi * cfg.batch;
        let mut xb = vec![0.0; batch.len() * din];
        for j in 0..cfg.n_heads {
            let targets = head_inputs(model, corpus, batch, j, din, &index, &mut xb);
            let (wm, b) = &w.heads[j];
            let mut logits_top = vec![None; batch.len()];
            head_top1(&xb, batch.len(), d, wm, b, &out, v, &mut logits_top);
            for (i, (t, top)) in targets.iter().zip(&logits_top).enumerate() {
                // A position too near its sequence's end has no token to guess.
                if corpus.next[batch[i]].len() <= j + 1 {
                    chain_alive[base + i] = false;
                    continue;
                }
                scored[j] += 1;
                let ok = t.is_some() && t == top;
                right[j] += usize::from(ok);
                chain_alive[base + i] &= ok;
                chain_right[j] += usize::from(chain_alive[base + i]);
            }
        }
    }
    for j in 0..cfg.n_heads {
        let s = scored[j].max(1) as f64;
        reports[j].held_out_accuracy = right[j] as f64 / s;
        reports[j].held_out_chain = chain_right[j] as f64 / s;
    }
    Ok((w, reports))
}

/// Fills `x` with head `j`'s inputs for the corpus rows `batch` (`z`, then the features of the
/// token before the one head `j` guesses) and returns its targets as indices into the scored
/// vocabulary (`None`: past the sequence's end, or outside the vocabulary).
fn head_inputs(
    model: &Model,
    corpus: &HeadCorpus,
    batch: &[usize],
    j: usize,
    din: usize,
    index: &std::collections::HashMap<u32, usize>,
    x: &mut [f32],
) -> Vec<Option<usize>> {
    let d = corpus.n_embd;
    for (dst, &r) in x.chunks_exact_mut(din).zip(batch) {
        dst[..d].copy_from_slice(&corpus.z[r * d..(r + 1) * d]);
        if din > d {
            // next[r][j] is the token before head j's target next[r][j + 1].
            let prev = corpus.next[r].get(j).copied().unwrap_or(0);
            token_features(model, prev, &mut dst[d..]);
        }
    }
    batch
        .iter()
        .map(|&r| {
            corpus.next[r]
                .get(j + 1)
                .and_then(|t| index.get(t).copied())
        })
        .collect()
}

/// Each row's top-1 index into the scored vocabulary, for evaluation.
#[allow(clippy::too_many_arguments)]
fn head_top1(
    x: &[f32],
    n: usize,
    d: usize,
    w: &[f32],
    b: &[f32],
    out: &[f32],
    v: usize,
    top: &mut [Option<usize>],
) {
    let f = head_forward(x, n, d, w, b, out, v);
    for (row, t) in f.logits.chunks_exact(v).zip(top.iter_mut()) {
        let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        *t = row.iter().position(|&x| x == max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head's analytic gradient against central differences of its loss, in f64 terms:
    /// f32 products with a step of 1e-2 on O(1) values give differences good to about 1e-3
    /// relative, so 2% (plus an absolute 1e-4) separates a right gradient from a wrong one.
    /// Both inputs: `z` alone, and `z` with the previous token's features (twice as wide, the
    /// residual from its first half only).
    #[test]
    fn head_backward_matches_finite_differences() {
        let (n, d, v) = (5, 6, 7);
        for din in [d, 2 * d] {
            let mut state = 7u64;
            let mut rnd = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            };
            let x: Vec<f32> = (0..n * din).map(|_| rnd() * 2.0).collect();
            let w: Vec<f32> = (0..d * din).map(|_| rnd()).collect();
            let b: Vec<f32> = (0..d).map(|_| rnd()).collect();
            let out: Vec<f32> = (0..v * d).map(|_| rnd() * 2.0).collect();
            let targets = vec![Some(1), None, Some(6), Some(0), Some(3)];
            let loss = |w: &[f32], b: &[f32]| {
                let (mut gw, mut gb) = (vec![0.0; d * din], vec![0.0; d]);
                let (l, s, _) = head_backward(&x, n, d, w, b, &out, v, &targets, &mut gw, &mut gb);
                l / s as f64
            };
            let (mut gw, mut gb) = (vec![0.0; d * din], vec![0.0; d]);
            head_backward(&x, n, d, &w, &b, &out, v, &targets, &mut gw, &mut gb);
            let h = 1e-2;
            let check = |analytic: f32, plus: f64, minus: f64, what: &str| {
                let numeric = (plus - minus) / (2.0 * h as f64);
                let err = (f64::from(analytic) - numeric).abs();
                assert!(
                    err <= 0.02 * numeric.abs() + 1e-4,
                    "input {din}, {what}: analytic {analytic}, numeric {numeric}"
                );
            };
            for i in 0..d * din {
                let (mut wp, mut wm) = (w.clone(), w.clone());
                wp[i] += h;
                wm[i] -= h;
                check(gw[i], loss(&wp, &b), loss(&wm, &b), &format!("W[{i}]"));
            }
            for i in 0..d {
                let (mut bp, mut bm) = (b.clone(), b.clone());
                bp[i] += h;
                bm[i] -= h;
                check(gb[i], loss(&w, &bp), loss(&w, &bm), &format!("b[{i}]"));
            }
            // The evaluation path picks the top-1 of the same logits.
            let mut top = vec![None; n];
            head_top1(&x, n, d, &w, &b, &out, v, &mut top);
            let f = head_forward(&x, n, d, &w, &b, &out, v);
            for (row, t) in f.logits.chunks_exact(v).zip(&top) {
                let best = (0..v).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
                assert_eq!(*t, Some(best));
            }
        }
    }
}
