//! Throughput measurements in llama-bench's terms, so figures compare directly:
//! `pp N` = prefill of N tokens in one batch from an empty cache; `tg N` = N single-token decode
//! steps from an empty cache; either after a prefix of `depth` tokens (`-d`). Plus the machine's read bandwidth and the decode roofline it
//! implies (every weight byte is read once per generated token).

use std::time::Instant;

use rayon::prelude::*;

use crate::error::Result;
use crate::eval::EvalOptions;
use crate::kv::{KvSequence, SeqCache};
use crate::model::{Logits, Model, Scratch};

/// Repeated timings of one test, in tokens per second.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Throughput {
    pub tokens: usize,
    pub runs: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Throughput {
    fn from_runs(tokens: usize, mut runs: Vec<f64>) -> Self {
        runs.sort_by(f64::total_cmp);
        let median = if runs.is_empty() {
            0.0
        } else if runs.len() % 2 == 1 {
            runs[runs.len() / 2]
        } else {
            (runs[runs.len() / 2 - 1] + runs[runs.len() / 2]) / 2.0
        };
        Throughput {
            tokens,
            min: runs.first().copied().unwrap_or(0.0),
            max: runs.last().copied().unwrap_or(0.0),
            median,
            runs,
        }
    }
}

/// Deterministic pseudo-random token ids (what is fed does not change the cost).
fn tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % n_vocab as u64) as u32
        })
        .collect()
}

/// Prefill: `n` tokens in one batch from an empty cache (run as `opts` says), `reps` times
/// after one warm-up.
pub fn prefill(model: &Model, n: usize, reps: usize, opts: &EvalOptions) -> Result<Throughput> {
    prefill_at(model, n, 0, reps, opts)
}

/// Decode: `n` single-token steps from an empty cache (run as `opts` says), `reps` times after
/// one warm-up.
pub fn decode(model: &Model, n: usize, reps: usize, opts: &EvalOptions) -> Result<Throughput> {
    decode_at(model, n, 0, reps, opts)
}

/// Times `step` (which processes `toks` into the cache) `reps` times after one warm-up, each
/// from a cache holding the same `depth` positions (computed once, untimed).
fn timed_at(
    model: &Model,
    toks: &[u32],
    depth: usize,
    reps: usize,
    opts: &EvalOptions,
    step: impl Fn(&[u32], &mut SeqCache, &mut Scratch) -> Result<()>,
) -> Result<Throughput> {
    let n = toks.len();
    let mut s = Scratch::new(opts.attention);
    let mut kv = model.new_seq_cache(depth + n, &opts.kv)?;
    // The prefix in chunks, as a server would prefill it: one call's score matrix stays bounded.
    for chunk in tokens(depth, model.config.n_vocab, 3).chunks(512) {
        model.forward(chunk, &mut kv as &mut dyn KvSequence, &mut s, Logits::Last)?;
    }
    let mut runs = Vec::with_capacity(reps);
    for rep in 0..=reps {
        kv.truncate(depth);
        let t = Instant::now();
        step(toks, &mut kv, &mut s)?;
        if rep > 0 {
            runs.push(n as f64 / t.elapsed().as_secs_f64());
        }
    }
    Ok(Throughput::from_runs(n, runs))
}

/// [`prefill`] after a prefix of `depth` tokens in the cache (llama-bench's `pp N @ dD`).
pub fn prefill_at(
    model: &Model,
    n: usize,
    depth: usize,
    reps: usize,
    opts: &EvalOptions,
) -> Result<Throughput> {
    let toks = tokens(n, model.config.n_vocab, 1);
    timed_at(model, &toks, depth, reps, opts, |toks, kv, s| {
        model.forward(toks, kv as &mut dyn KvSequence, s, Logits::Last)?;
        Ok(())
    })
}

/// [`decode`] after a prefix of `depth` tokens in the cache (llama-bench's `tg N @ dD`): where
/// long context costs, since every step reads the whole cache.
pub fn decode_at(
    model: &Model,
    n: usize,
    depth: usize,
    reps: usize,
    opts: &EvalOptions,
) -> Result<Throughput> {
    let toks = tokens(n, model.config.n_vocab, 2);
    timed_at(model, &toks, depth, reps, opts, |toks, kv, s| {
        for &tok in toks {
            model.forward(&[tok], kv as &mut dyn KvSequence, s, Logits::Last)?;
        }
        Ok(())
    })
}

/// Read bandwidth in bytes per second: a parallel sum over a buffer far larger than the caches
/// (256 MiB), best of five passes.
pub fn read_bandwidth() -> f64 {
    const BYTES: usize = 256 << 20;
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                // Eight independent lanes so the adds never limit the load rate.
                let mut acc = [0u64; 8];
                for ch in c.chunks_exact(8) {
                    for (a, &v) in acc.iter_mut().zip(ch) {
                        *a = a.wrapping_add(v);
                    }
                }
                acc.iter().fold(0u64, |x, &y| x.wrapping_add(y))
            })
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.max(BYTES as f64 / t.elapsed().as_secs_f64());
    }
    best
}

/// Weight bytes one decode step reads: every matrix once (in the layout the kernels use) plus
/// one embedding row and the norms.
pub fn weight_bytes_per_token(model: &Model) -> u64 {
    let w = &model.weights;
    let matrices: u64 = w
        .matrices()
        .map(|m| match (&m.sparse, &m.packed) {
            (Some(s), _) => s.bytes() as u64,
            (None, Some(p)) => p.bytes() as u64,
            (None, None) => m.view(&model.file).data.len() as u64,
        })
        .sum();
    let norms: usize = w
        .layers
        .iter()
        .map(|l| l.attn_norm.len() + l.ffn_norm.len())
        .sum::<usize>()
        + w.output_norm.len();
    let embd_row = w.token_embd.view(&model.file).row_bytes() as u64;
    matrices + embd_row + 4 * norms as u64
}

/// Peak resident memory of this process so far (Linux `VmHWM`), or `None` where unavailable.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
