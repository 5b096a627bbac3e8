//! `frugal bench kv`: what the KV cache saves. At each sequence length L, the time of one
//! generation step with the cache (one token attends to L-1 cached positions) and without it
//! (the whole sequence of L tokens recomputed, as `--no-kv-cache` does), on the real model.
//!
//! Without the cache a step costs O(L) (every layer re-runs over L tokens; attention inside it
//! even O(L^2)), so generating N tokens costs O(N^2); with it a step is nearly constant (the
//! weights dominate; only attention grows with L), so N tokens cost O(N). The totals for N
//! tokens are the sums of the measured per-step curve (linear between measured lengths).
//!
//! Then the depth curve (`kv_depth`): decode speed after D cached tokens against the roofline
//! at that depth, up to the long contexts where the cache's bytes rival the weights'.

use std::time::Instant;

use anyhow::{Result, ensure};
use frugal::kv::KvSequence;
use frugal::model::{Logits, Scratch};

use super::OutputArgs;
use super::plot::{Chart, Series, fitted_exponent, fmt_seconds};
use crate::commands::common::{self, EngineArgs, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sequence lengths at which a step is timed (comma-separated)
    #[arg(
        long = "points",
        value_delimiter = ',',
        default_value = "16,32,64,128,256,384,512,768,1024"
    )]
    pub points: Vec<usize>,
    /// Cached decode steps timed per length (the fastest is reported)
    #[arg(long = "reps", default_value_t = 5)]
    pub reps: usize,
    /// Depths of the depth curve: decode after D cached tokens, against the roofline
    /// (comma-separated; 0 alone for just the start) [default: 0,512,1024,2048,4096, those
    /// that fit the model's context]
    #[arg(long = "depths", value_delimiter = ',')]
    pub depths: Option<Vec<usize>>,
    /// Tokens decoded at each depth (median of 3 runs)
    #[arg(long = "depth-tokens", default_value_t = 32)]
    pub depth_tokens: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(serde::Serialize)]
struct Row {
    len: usize,
    cached_step_s: f64,
    recompute_step_s: f64,
}

pub fn run(a: Args) -> Result<()> {
    let mut points = a.points.clone();
    points.sort_unstable();
    points.dedup();
    ensure!(
        points.first().is_some_and(|&p| p >= 2),
        "--points needs lengths of at least 2"
    );
    ensure!(a.reps > 0, "--reps must be at least 1");
    let (kv_opts, attention) = (a.engine.kv_options()?, a.engine.attention()?);
    let (model, _tok) = common::load(&a.model)?;
    let max = *points.last().expect("checked non-empty");
    ensure!(
        max <= model.config.n_ctx_train,
        "--points go past the model's context of {}",
        model.config.n_ctx_train
    );
    ensure!(a.depth_tokens > 0, "--depth-tokens must be at least 1");
    let fits = |d: usize| d + a.depth_tokens <= model.config.n_ctx_train;
    let depths: Vec<usize> = match &a.depths {
        Some(d) => {
            ensure!(
                d.iter().all(|&d| fits(d)),
                "--depths plus --depth-tokens go past the model's context of {}",
                model.config.n_ctx_train
            );
            d.clone()
        }
        None => [0, 512, 1024, 2048, 4096]
            .into_iter()
            .filter(|&d| fits(d))
            .collect(),
    };
    // Any valid ids do: the cost of a step does not depend on which tokens they are.
    let nv = model.config.n_vocab as u32;
    let tokens: Vec<u32> = (0..max as u32)
        .map(|i| (i.wrapping_mul(7919) + 100) % nv)
        .collect();
    let mut kv = model.new_seq_cache(max, &kv_opts)?;
    let mut scratch = Scratch::new(attention);
    let mut rows = Vec::new();
    if !a.output.json {
        println!(
            "one generation step at sequence length L ({} threads, attention {attention}, KV {})",
            rayon::current_num_threads(),
            kv_opts.format
        );
        println!(
            "{:>6} | {:>12} | {:>14} | {:>7}",
            "L", "with cache", "recompute all", "ratio"
        );
    }
    for &len in &points {
        // Without the cache: the whole sequence through the model (this also fills the cache).
        kv.clear();
        let t = Instant::now();
        model.forward(&tokens[..len], &mut kv, &mut scratch, Logits::Last)?;
        let recompute = t.elapsed().as_secs_f64();
        // With it: the last token against L-1 cached positions, repeated.
        let mut times = Vec::with_capacity(a.reps);
        for _ in 0..a.reps {
            kv.truncate(len - 1);
            let t = Instant::now();
            model.forward(&tokens[len - 1..len], &mut kv, &mut scratch, Logits::Last)?;
            times.push(t.elapsed().as_secs_f64());
        }
        // The fastest: on a shared machine, slower repeats are other programs' time.
        let cached = times.iter().copied().fold(f64::INFINITY, f64::min);
        if !a.output.json {
            println!(
                "{len:>6} | {:>12} | {:>14} | {:>6.1}x",
                fmt_seconds(cached),
                fmt_seconds(recompute),
                recompute / cached
            );
        }
        rows.push(Row {
            len,
            cached_step_s: cached,
            recompute_step_s: recompute,
        });
        debug_assert_eq!(kv.len(), len);
    }
    let step_c: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.len as f64, r.cached_step_s))
        .collect();
    let step_r: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.len as f64, r.recompute_step_s))
        .collect();
    let (tot_c, tot_r) = (cumulative(&step_c), cumulative(&step_r));
    // Exponents over the upper half of the lengths, where fixed per-call costs have faded.
    let upper = |v: &[(f64, f64)]| v[v.len() / 2..].to_vec();
    let (ec, er) = (
        fitted_exponent(&upper(&step_c)),
        fitted_exponent(&upper(&step_r)),
    );
    let (tc, tr) = (
        fitted_exponent(&upper(&tot_c)),
        fitted_exponent(&upper(&tot_r)),
    );
    let n = max as f64;
    let (sum_c, sum_r) = (
        tot_c.last().map_or(0.0, |p| p.1),
        tot_r.last().map_or(0.0, |p| p.1),
    );
    let eval_opts = frugal::eval::EvalOptions {
        kv: kv_opts,
        attention,
    };
    let depth_rows = super::kv_depth::measure(
        &model,
        &eval_opts,
        &depths,
        a.depth_tokens,
        3,
        a.output.json,
    )?;
    if a.output.json {
        println!(
            "{}",
            serde_json::json!({
                "attention": attention, "kv": kv_opts, "threads": rayon::current_num_threads(), "rows": rows,
                "depth_curve": depth_rows,
                "total_seconds": {"tokens": max, "with_cache": sum_c, "recompute": sum_r},
                "step_exponent": {"with_cache": ec, "recompute": er},
                "total_exponent": {"with_cache": tc, "recompute": tr},
            })
        );
    } else {
        println!(
            "total for {max} tokens (sum of the measured per-step curve): with cache {}, recomputing {} ({:.0}x)",
            fmt_seconds(sum_c),
            fmt_seconds(sum_r),
            sum_r / sum_c
        );
        println!(
            "fitted exponents (upper half of L): per step L^{ec:.2} with cache vs L^{er:.2} recomputing; total N^{tc:.2} vs N^{tr:.2}"
        );
        println!(
            "average step over the {n:.0} tokens: {} with cache, {} recomputing",
            fmt_seconds(sum_c / n),
            fmt_seconds(sum_r / n)
        );
    }
    let title = format!(
        "Generation step time vs sequence length ({} threads)",
        rayon::current_num_threads()
    );
    a.output.chart(
        &Chart {
            title,
            x_desc: "sequence length L (tokens)",
            y_desc: "seconds",
            series: vec![
                Series {
                    name: format!("step, recompute all (~L^{er:.2})"),
                    points: step_r,
                },
                Series {
                    name: format!("step, with KV cache (~L^{ec:.2})"),
                    points: step_c,
                },
                Series {
                    name: format!("total for L tokens, recompute (~L^{tr:.2})"),
                    points: tot_r,
                },
                Series {
                    name: format!("total for L tokens, with cache (~L^{tc:.2})"),
                    points: tot_c,
                },
            ],
            y_fmt: fmt_seconds,
        },
        "kv-cache",
    )?;
    if !depth_rows.is_empty() {
        let format = kv_opts.format.to_string();
        a.output
            .chart(&super::kv_depth::chart(&depth_rows, &format), "kv-depth")?;
    }
    Ok(())
}

/// Running total of step times for lengths 1..=L at each measured L, interpolating linearly
/// between measured lengths (and holding the first value below the first).
fn cumulative(steps: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let at = |l: f64| -> f64 {
        match steps.iter().position(|p| p.0 >= l) {
            Some(0) => steps[0].1,
            Some(i) => {
                let (a, b) = (steps[i - 1], steps[i]);
                a.1 + (b.1 - a.1) * (l - a.0) / (b.0 - a.0)
            }
            None => steps.last().map_or(0.0, |p| p.1),
        }
    };
    let mut out = Vec::new();
    let mut total = 0.0;
    let mut l = 1.0;
    for &(x, _) in steps {
        while l <= x {
            total += at(l);
            l += 1.0;
        }
        out.push((x, total));
    }
    out
}
