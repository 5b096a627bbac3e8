//! `frugal bench attention`: the naive and flash kernels on random inputs of the model's shape,
//! prefill (every position attends, causal) and decode (one query over the whole context).
//!
//! Time is the best of several warm calls (at least one, more while under a time budget; a
//! case whose first call takes over 2 s is timed by that call alone).
//! Peak extra memory is measured: the first call of each case runs on a fresh thread pool, so
//! the per-thread buffers it needs are allocated inside the measurement, and the counting
//! allocator reports the high-water mark of the heap bytes those threads hold (inputs and
//! output were allocated before, elsewhere, and are not counted).

use std::time::Instant;

use anyhow::{Result, ensure};
use frugal::attention::{Attention, AttnShape, AttnWorkspace, attend};
use frugal::kv::{CacheShape, KvCache, KvFormat, KvSequence, KvType};
use rand::{Rng, SeedableRng};

use super::plot::{Chart, Series, fmt_bytes, fmt_seconds};
use super::{OutputArgs, alloc};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sequence lengths (comma-separated)
    #[arg(
        long = "seq",
        value_delimiter = ',',
        default_value = "64,128,256,512,1024,2048,4096,8192"
    )]
    pub seq: Vec<usize>,
    /// Query heads [default: the reference model's 9]
    #[arg(long = "heads", default_value_t = 9)]
    pub heads: usize,
    /// KV heads [default: the reference model's 3]
    #[arg(long = "kv-heads", default_value_t = 3)]
    pub kv_heads: usize,
    #[arg(long = "head-dim", default_value_t = 64)]
    pub head_dim: usize,
    /// Storage format of the cached keys and values: f32, f16, bf16 or q8_0
    #[arg(long = "kv-type", default_value = "f32")]
    pub kv_type: String,
    /// Worker threads [default: all cores]
    #[arg(short = 't', long = "threads")]
    pub threads: Option<usize>,
    /// Seconds of repeated calls per case, after the first
    #[arg(long = "budget", default_value_t = 0.3)]
    pub budget: f64,
    /// Skip the prefill cases (they dominate the run time at long lengths)
    #[arg(long = "decode-only")]
    pub decode_only: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(serde::Serialize, Clone, Copy, Default)]
struct Cell {
    seconds: f64,
    extra_bytes: usize,
}

#[derive(serde::Serialize)]
struct Row {
    seq: usize,
    prefill_naive: Option<Cell>,
    prefill_flash: Option<Cell>,
    decode_naive: Cell,
    decode_flash: Cell,
    /// max |flash - naive| / max |naive| over the output rows of the prefill (or decode) case.
    max_rel_diff: f64,
}

pub fn run(a: Args) -> Result<()> {
    ensure!(
        !a.seq.is_empty() && a.seq.iter().all(|&s| s > 0),
        "--seq needs positive lengths"
    );
    ensure!(
        a.kv_heads > 0 && a.heads.is_multiple_of(a.kv_heads),
        "--heads must be a multiple of --kv-heads"
    );
    ensure!(a.head_dim > 0, "--head-dim must be at least 1");
    let ty: KvType = a.kv_type.parse()?;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    ensure!(threads > 0, "--threads must be at least 1");
    let s = AttnShape {
        n_head: a.heads,
        n_head_kv: a.kv_heads,
        head_dim: a.head_dim,
        window: None,
    };
    let (q_dim, kv_dim) = (a.heads * a.head_dim, a.kv_heads * a.head_dim);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    let mut rows = Vec::new();
    if !a.output.json {
        println!(
            "attention kernels: {} heads / {} KV heads x {}, KV {ty}, {threads} threads (time: best warm call; memory: peak heap of the call's threads)",
            a.heads, a.kv_heads, a.head_dim
        );
        println!(
            "{:>6} | {:>10} {:>10} {:>7} {:>10} {:>10} | {:>10} {:>10} {:>7} {:>10} {:>10} | {:>8}",
            "seq",
            "pre naive",
            "pre flash",
            "speedup",
            "naive mem",
            "flash mem",
            "dec naive",
            "dec flash",
            "speedup",
            "naive mem",
            "flash mem",
            "max diff"
        );
    }
    for &len in &a.seq {
        let mut cache = KvCache::with_format(
            1,
            CacheShape::new(a.kv_heads, a.head_dim),
            len,
            KvFormat::both(ty),
        )?;
        let k: Vec<f32> = (0..len * kv_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let v: Vec<f32> = (0..len * kv_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        cache.reserve(len)?;
        cache.append(0, &k, &v);
        cache.commit(len);
        drop((k, v));
        let q: Vec<f32> = (0..len * q_dim)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let mut out_n = vec![0f32; q.len()];
        let mut out_f = vec![0f32; q.len()];
        let (kv_k, kv_v) = cache.layer(0);
        let case = |kind: Attention, q: &[f32], pos0: usize, out: &mut [f32]| -> Result<Cell> {
            let call = |out: &mut [f32], ws: &mut AttnWorkspace| {
                attend(kind, s, q, kv_k, kv_v, pos0, out, ws)
            };
            // Cold call on fresh threads: measures the memory the call itself needs.
            let id = alloc::new_id();
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .start_handler(move |_| alloc::join(id))
                .build()?;
            pool.broadcast(|_| ()); // every thread up before counting starts
            alloc::begin(id);
            let t0 = Instant::now();
            let mut ws = AttnWorkspace::default();
            pool.install(|| call(out, &mut ws));
            let cold = t0.elapsed().as_secs_f64();
            let extra = alloc::finish();
            // Warm calls within the budget; the best is the figure.
            let mut best = cold;
            let mut spent = 0.0;
            let mut n = 0;
            while (spent < a.budget || n == 0) && !(n == 0 && cold > 2.0) {
                let t = Instant::now();
                pool.install(|| call(out, &mut ws));
                let dt = t.elapsed().as_secs_f64();
                best = best.min(dt);
                spent += dt;
                n += 1;
            }
            Ok(Cell {
                seconds: best,
                extra_bytes: extra,
            })
        };
        let (pn, pf, diff) = if a.decode_only {
            (None, None, None)
        } else {
            let pn = case(Attention::Naive, &q, 0, &mut out_n)?;
            let pf = case(Attention::Flash, &q, 0, &mut out_f)?;
            (
                Some(pn),
                Some(pf),
                Some(max_rel_diff(&out_f, &out_n, a.head_dim)),
            )
        };
        let qd = &q[(len - 1) * q_dim..];
        let dn = case(Attention::Naive, qd, len - 1, &mut out_n[..q_dim])?;
        let df = case(Attention::Flash, qd, len - 1, &mut out_f[..q_dim])?;
        let diff =
            diff.unwrap_or_else(|| max_rel_diff(&out_f[..q_dim], &out_n[..q_dim], a.head_dim));
        let row = Row {
            seq: len,
            prefill_naive: pn,
            prefill_flash: pf,
            decode_naive: dn,
            decode_flash: df,
            max_rel_diff: diff,
        };
        if !a.output.json {
            let t = |c: Option<Cell>| c.map_or("-".into(), |c| fmt_seconds(c.seconds));
            let m = |c: Option<Cell>| c.map_or("-".into(), |c| fmt_bytes(c.extra_bytes as f64));
            let sp = |n: Option<Cell>, f: Option<Cell>| match (n, f) {
                (Some(n), Some(f)) => format!("{:.2}x", n.seconds / f.seconds),
                _ => "-".into(),
            };
            println!(
                "{:>6} | {:>10} {:>10} {:>7} {:>10} {:>10} | {:>10} {:>10} {:>7} {:>10} {:>10} | {:>8.1e}",
                len,
                t(pn),
                t(pf),
                sp(pn, pf),
                m(pn),
                m(pf),
                t(Some(dn)),
                t(Some(df)),
                sp(Some(dn), Some(df)),
                m(Some(dn)),
                m(Some(df)),
                diff
            );
        }
        rows.push(row);
    }
    if a.output.json {
        println!(
            "{}",
            serde_json::json!({"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "kv_type": ty, "threads": threads, "rows": rows})
        );
    }
    let series = |name: &str, f: &dyn Fn(&Row) -> Option<f64>| Series {
        name: name.into(),
        points: rows
            .iter()
            .filter_map(|r| f(r).map(|y| (r.seq as f64, y)))
            .collect(),
    };
    let mut time = vec![
        series("decode, naive", &|r| Some(r.decode_naive.seconds)),
        series("decode, flash", &|r| Some(r.decode_flash.seconds)),
    ];
    let mut mem = vec![
        series("decode, naive", &|r| {
            Some(r.decode_naive.extra_bytes as f64)
        }),
        series("decode, flash", &|r| {
            Some(r.decode_flash.extra_bytes as f64)
        }),
    ];
    if !a.decode_only {
        time.insert(
            0,
            series("prefill, naive", &|r| r.prefill_naive.map(|c| c.seconds)),
        );
        time.insert(
            1,
            series("prefill, flash", &|r| r.prefill_flash.map(|c| c.seconds)),
        );
        mem.insert(
            0,
            series("prefill, naive", &|r| {
                r.prefill_naive.map(|c| c.extra_bytes as f64)
            }),
        );
        mem.insert(
            1,
            series("prefill, flash", &|r| {
                r.prefill_flash.map(|c| c.extra_bytes as f64)
            }),
        );
    }
    let title = |what: &str| {
        format!(
            "{what} per attention call ({} heads / {} KV x {}, KV {ty}, {threads} threads)",
            a.heads, a.kv_heads, a.head_dim
        )
    };
    a.output.chart(
        &Chart {
            title: title("Time"),
            x_desc: "sequence length (tokens)",
            y_desc: "seconds",
            series: time,
            y_fmt: fmt_seconds,
        },
        "attention-time",
    )?;
    a.output.chart(
        &Chart {
            title: title("Peak extra memory"),
            x_desc: "sequence length (tokens)",
            y_desc: "bytes",
            series: mem,
            y_fmt: fmt_bytes,
        },
        "attention-memory",
    )?;
    Ok(())
}

fn max_rel_diff(a: &[f32], b: &[f32], hd: usize) -> f64 {
    a.chunks_exact(hd)
        .zip(b.chunks_exact(hd))
        .map(|(x, y)| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
            let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            f64::from(d / scale)
        })
        .fold(0f64, f64::max)
}
