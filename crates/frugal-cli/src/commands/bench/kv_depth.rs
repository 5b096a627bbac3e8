//! The depth curve of `frugal bench kv`: decode speed after a prompt of D cached tokens (as
//! `llama-bench -d D`), beside the roofline at that depth. Each step reads the weights once and
//! every cached key and value once, so the bytes per token grow with D and the bound falls;
//! long context costs through the cache, and this shows how close decode stays to that bound.

use anyhow::Result;
use frugal::eval::EvalOptions;
use frugal::model::Model;

use super::plot::{Chart, Series};

#[derive(serde::Serialize)]
pub struct DepthRow {
    pub depth: usize,
    pub tg_tokens_per_s: f64,
    pub weight_bytes_per_token: u64,
    pub kv_bytes_per_token: u64,
    /// Read bandwidth of a working set of one step's bytes (bytes/s).
    pub read_bandwidth: f64,
    pub roofline_tokens_per_s: f64,
    pub fraction_of_roofline: f64,
}

/// Decode `n` tokens after each depth (median of `reps`), and the bound: weight plus KV bytes
/// per token over the measured bandwidth of a working set that size.
pub fn measure(
    model: &Model,
    opts: &EvalOptions,
    depths: &[usize],
    n: usize,
    reps: usize,
    quiet: bool,
) -> Result<Vec<DepthRow>> {
    let weights = frugal::bench::weight_bytes_per_token(model);
    if !quiet {
        println!();
        println!(
            "decode after D cached tokens (tg{n}, median of {reps}), against the roofline: weight + KV bytes per token over the read bandwidth of that working set"
        );
        println!(
            "{:>6} | {:>9} | {:>12} | {:>12} | {:>11} | {:>9}",
            "D", "tg tok/s", "KV MiB/token", "bandwidth", "bound tok/s", "of bound"
        );
    }
    let mut rows = Vec::new();
    for &depth in depths {
        let tg = frugal::bench::decode_at(model, n, depth, reps, opts)?;
        let kv = frugal::bench::kv_bytes_per_token(model, opts, depth, n);
        let bytes = weights + kv;
        let bw = frugal::bench::read_bandwidth(bytes as usize, 5);
        let bound = bw / bytes as f64;
        let row = DepthRow {
            depth,
            tg_tokens_per_s: tg.median,
            weight_bytes_per_token: weights,
            kv_bytes_per_token: kv,
            read_bandwidth: bw,
            roofline_tokens_per_s: bound,
            fraction_of_roofline: tg.median / bound,
        };
        if !quiet {
            println!(
                "{:>6} | {:>9.1} | {:>12.1} | {:>7.1} GB/s | {:>11.1} | {:>8.0}%",
                depth,
                row.tg_tokens_per_s,
                kv as f64 / (1 << 20) as f64,
                bw / 1e9,
                bound,
                100.0 * row.fraction_of_roofline
            );
        }
        rows.push(row);
    }
    Ok(rows)
}

/// Decode speed and its bound against depth.
pub fn chart(rows: &[DepthRow], kv_format: &str) -> Chart<'static> {
    Chart {
        title: format!(
            "Decode speed vs cached depth ({} threads, {kv_format} cache)",
            rayon::current_num_threads()
        ),
        x_desc: "tokens already in the cache (D)",
        y_desc: "tokens/s",
        series: vec![
            Series {
                name: "roofline: (weight + KV bytes per token) / bandwidth".into(),
                points: rows
                    .iter()
                    .map(|r| (r.depth as f64, r.roofline_tokens_per_s))
                    .collect(),
            },
            Series {
                name: "measured decode".into(),
                points: rows
                    .iter()
                    .map(|r| (r.depth as f64, r.tg_tokens_per_s))
                    .collect(),
            },
        ],
        y_fmt: |v| format!("{v:.0}"),
    }
}
