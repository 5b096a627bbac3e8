//! `frugal bench context`: how much memory the KV cache of one sequence takes as the context
//! grows, for each KV type, against the bytes of the weights; and the context at which the
//! cache outgrows the weights. The bytes are read from a real paged cache filled to each length
//! (so they include the unused tail of the last block), not from a formula.

use anyhow::{Result, ensure};
use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvPool, KvType};
use frugal::model::Config;

use super::OutputArgs;
use super::plot::{Chart, Series, fmt_bytes};
use crate::commands::common::{self, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Longest context [default: the model's trained context]
    #[arg(long = "max-ctx")]
    pub max_ctx: Option<usize>,
    /// Positions per block of the paged cache
    #[arg(long = "kv-block", default_value_t = 16)]
    pub kv_block: usize,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

pub fn run(a: Args) -> Result<()> {
    ensure!(a.kv_block > 0, "--kv-block must be at least 1");
    let path = common::model_path(&a.model)?;
    let f = GgufFile::open(&path)?;
    let c = Config::from_gguf(&f)?;
    let weights: u64 = f.tensors().iter().map(|t| t.n_bytes()).sum();
    let max = a.max_ctx.unwrap_or(c.n_ctx_train);
    ensure!(max >= 1, "--max-ctx must be at least 1");
    let mut ctxs: Vec<usize> = std::iter::successors(Some(128usize), |&x| Some(x * 2))
        .take_while(|&x| x < max)
        .collect();
    ctxs.push(max);
    let types: Vec<KvType> = KvType::ALL
        .into_iter()
        .filter(|t| c.head_dim.is_multiple_of(t.granule()))
        .collect();
    let mut table: Vec<Vec<usize>> = Vec::new();
    for &t in &types {
        let mut col = Vec::new();
        for &ctx in &ctxs {
            let blocks = ctx.div_ceil(a.kv_block);
            let mut pool = KvPool::with_rings(
                c.n_layers,
                c.cache_shape(),
                KvFormat::both(t),
                a.kv_block,
                blocks,
                c.cache_rings(),
            )?;
            let id = pool.add_sequence(ctx);
            // In passes a sliding-window ring can take (it then stops growing).
            let mut held = 0;
            while held < ctx {
                let n = (ctx - held).min(pool.max_chunk());
                pool.reserve(id, n)?;
                pool.commit(id, n);
                held += n;
            }
            col.push(pool.bytes_in_use());
        }
        table.push(col);
    }
    let per_token: Vec<usize> = types
        .iter()
        .map(|&t| {
            c.cache_shape()
                .bytes_per_token(c.n_layers, KvFormat::both(t))
        })
        .collect();
    // Where the cache (windowed layers capped at their rings) first outgrows the weights;
    // infinite when it never does.
    let rings = c.cache_rings();
    let crossing: Vec<f64> = types
        .iter()
        .map(|&t| {
            let at = |n: usize| {
                frugal::kv::bytes_at(c.n_layers, c.cache_shape(), KvFormat::both(t), &rings, n)
            };
            let (mut lo, mut hi) = (0usize, 1usize << 40);
            if at(hi) <= weights as u128 {
                return f64::INFINITY;
            }
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if at(mid) > weights as u128 {
                    hi = mid
                } else {
                    lo = mid
                }
            }
            hi as f64
        })
        .collect();
    if a.output.json {
        let cols: serde_json::Map<String, serde_json::Value> = types
            .iter()
            .zip(&table)
            .map(|(t, col)| (t.name().to_string(), serde_json::json!(col)))
            .collect();
        let cross: serde_json::Map<String, serde_json::Value> = types
            .iter()
            .zip(&crossing)
            .map(|(t, x)| (t.name().to_string(), serde_json::json!(x)))
            .collect();
        let bpt: serde_json::Map<String, serde_json::Value> = types
            .iter()
            .zip(&per_token)
            .map(|(t, x)| (t.name().to_string(), serde_json::json!(x)))
            .collect();
        println!(
            "{}",
            serde_json::json!({"weights_bytes": weights, "contexts": ctxs, "kv_bytes": cols, "bytes_per_token": bpt, "context_where_kv_exceeds_weights": cross})
        );
    } else {
        println!(
            "KV cache of one sequence ({} layers x {} KV heads x {} head dim, blocks of {}) vs weights {}",
            c.n_layers,
            c.n_head_kv,
            c.head_dim,
            a.kv_block,
            fmt_bytes(weights as f64)
        );
        print!("{:>8}", "context");
        for t in &types {
            print!(" | {:>10}", t.name());
        }
        println!();
        for (i, ctx) in ctxs.iter().enumerate() {
            print!("{ctx:>8}");
            for col in &table {
                let mark = if col[i] as u64 > weights { "*" } else { " " };
                print!(" | {:>9}{mark}", fmt_bytes(col[i] as f64));
            }
            println!();
        }
        print!("{:>8}", "B/token");
        for b in &per_token {
            print!(" | {b:>10}");
        }
        println!();
        println!("* = the cache is larger than the weights. It outgrows them at:");
        for (t, x) in types.iter().zip(&crossing) {
            println!(
                "  {:<5} {x:>8.0} tokens{}",
                t.name(),
                if *x <= max as f64 {
                    ""
                } else {
                    " (beyond this context)"
                }
            );
        }
    }
    let mut series: Vec<Series> = types
        .iter()
        .zip(&table)
        .map(|(t, col)| Series {
            name: format!(
                "KV cache, {t} (> weights from {:.0} tokens)",
                crossing[types.iter().position(|x| x == t).unwrap_or(0)]
            ),
            points: ctxs
                .iter()
                .zip(col)
                .map(|(&x, &y)| (x as f64, y as f64))
                .collect(),
        })
        .collect();
    series.push(Series {
        name: format!("weights ({})", fmt_bytes(weights as f64)),
        points: vec![
            (ctxs[0] as f64, weights as f64),
            (max as f64, weights as f64),
        ],
    });
    a.output.chart(
        &Chart {
            title: format!(
                "KV cache of one sequence vs context length ({} layers, {} KV heads x {})",
                c.n_layers, c.n_head_kv, c.head_dim
            ),
            x_desc: "context (tokens)",
            y_desc: "bytes",
            series,
            y_fmt: fmt_bytes,
        },
        "kv-context",
    )?;
    Ok(())
}
