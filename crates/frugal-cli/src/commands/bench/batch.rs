//! `frugal bench batch`: what batching many sequences into one pass buys, in the terms of
//! llama.cpp's `llama-batched-bench`: B sequences each prefill PP prompt tokens (one batched
//! pass per chunk), then generate TG tokens together, one batched decode step at a time.
//! S_TG = B x TG / T_TG is the aggregate decode rate a server gets from B streams.

use std::time::Instant;

use anyhow::Result;
use frugal::model::{Scratch, Segment};

use crate::commands::common::{self, EngineArgs, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sequences decoded together, a comma-separated list
    #[arg(long = "batch", default_value = "1,2,4,8,16,32", value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence
    #[arg(long = "pp", default_value_t = 128)]
    pub pp: usize,
    /// Tokens generated per sequence
    #[arg(long = "tg", default_value_t = 64)]
    pub tg: usize,
    /// Print one JSON object
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(a: Args) -> Result<()> {
    anyhow::ensure!(a.pp > 0 && a.tg > 0, "--pp and --tg must be at least 1");
    let kv = a.engine.kv_options()?;
    let block = match kv.layout {
        frugal::kv::KvLayout::Paged { block_size } => block_size,
        frugal::kv::KvLayout::Contiguous => 16,
    };
    let (model, _) = common::load(&a.model)?;
    let v = model.config.n_vocab;
    let mut rows = Vec::new();
    if !a.json {
        println!(
            "| B | PP | TG | T_PP s | S_PP tok/s | T_TG s | S_TG tok/s | ms/step | speed-up |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
    }
    let mut base = None;
    for &b in &a.batch {
        anyhow::ensure!(b > 0, "--batch sizes must be at least 1");
        let per = (a.pp + a.tg).div_ceil(block) + 1;
        let mut pool = model.new_kv_pool(kv.format, block, b * per)?;
        let mut s = Scratch::new(a.engine.attention()?);
        let ids: Vec<_> = (0..b).map(|_| pool.add_sequence(a.pp + a.tg + 1)).collect();
        let prompts: Vec<Vec<u32>> = (0..b)
            .map(|i| {
                (0..a.pp)
                    .map(|t| ((t * 7919 + i * 104_729) % (v - 1)) as u32 + 1)
                    .collect()
            })
            .collect();
        // Prefill in chunks of 512 tokens across the sequences, as a server would.
        let t0 = Instant::now();
        let mut next = vec![0u32; b];
        let mut fed = vec![0usize; b];
        while fed.iter().any(|&f| f < a.pp) {
            let mut budget = 512;
            let mut segs = Vec::new();
            let mut order = Vec::new();
            for i in 0..b {
                if fed[i] < a.pp && budget > 0 {
                    let n = (a.pp - fed[i]).min(budget);
                    segs.push(Segment {
                        seq: ids[i],
                        tokens: &prompts[i][fed[i]..fed[i] + n],
                        logits: fed[i] + n == a.pp,
                        all_logits: false,
                    });
                    order.push((i, fed[i] + n == a.pp));
                    fed[i] += n;
                    budget -= n;
                }
            }
            let logits = model.forward_batch(&segs, &mut pool, &mut s)?;
            let mut row = 0;
            for (i, last) in order {
                if last {
                    next[i] = argmax(&logits[row * v..(row + 1) * v]);
                    row += 1;
                }
            }
        }
        let t_pp = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for _ in 0..a.tg {
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let segs: Vec<Segment> = ids
                .iter()
                .zip(&toks)
                .map(|(&seq, t)| Segment {
                    seq,
                    tokens: t,
                    logits: true,
                    all_logits: false,
                })
                .collect();
            let logits = model.forward_batch(&segs, &mut pool, &mut s)?;
            for (i, n) in next.iter_mut().enumerate() {
                *n = argmax(&logits[i * v..(i + 1) * v]);
            }
        }
        let t_tg = t1.elapsed().as_secs_f64();
        let s_tg = (b * a.tg) as f64 / t_tg;
        let s_pp = (b * a.pp) as f64 / t_pp;
        let speedup = s_tg / *base.get_or_insert(s_tg);
        let ms = 1e3 * t_tg / a.tg as f64;
        if !a.json {
            println!(
                "| {b} | {} | {} | {t_pp:.3} | {s_pp:.1} | {t_tg:.3} | {s_tg:.1} | {ms:.2} | {speedup:.2}x |",
                a.pp, a.tg
            );
        }
        rows.push(serde_json::json!({
            "batch": b, "pp": a.pp, "tg": a.tg, "t_pp": t_pp, "s_pp": s_pp,
            "t_tg": t_tg, "s_tg": s_tg, "ms_per_step": ms, "speedup": speedup,
        }));
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({"threads": rayon::current_num_threads(), "rows": rows})
        );
    }
    Ok(())
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0 as u32
}
