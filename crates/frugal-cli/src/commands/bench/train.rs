//! `frugal bench train`: training tokens/s of the model and of layer-dropped students (batch x
//! sequence tokens per step, AdamW, the same loop `frugal train` runs), the FLOPs of a step's
//! products, and the fraction of the machine's matrix-multiply peak they reach, with that peak
//! measured by a GEMM microbenchmark in the same run.

use anyhow::{Result, ensure};
use frugal::model::{Config, Model};
use frugal_train::Params;
use frugal_train::data::{Corpus, Windows};
use frugal_train::gemm::{self, Precision};
use frugal_train::model::RunOptions;
use frugal_train::optim::{AdamWConfig, Schedule};
use frugal_train::student::keep_layers;
use frugal_train::trainer::{LossConfig, Signal, TrainConfig, Trainer};
use rand::{Rng, SeedableRng};

use crate::commands::common::{self, ModelArgs};
use crate::commands::train::precision;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Layer counts to measure: the model itself and students keeping that many of its layers
    /// (evenly spaced)
    #[arg(long = "layers", value_delimiter = ',', default_value = "30,10")]
    pub layers: Vec<usize>,
    /// Sequences per step
    #[arg(long = "batch", default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence
    #[arg(long = "seq", default_value_t = 512)]
    pub seq: usize,
    /// Timed steps (after one warm-up step); the median is reported
    #[arg(long = "steps", default_value_t = 3)]
    pub steps: usize,
    /// Arithmetic of the products: auto (bf16 where the CPU has it), bf16 or f32
    #[arg(long = "precision", default_value = "auto")]
    pub precision: String,
    /// Recompute each layer's activations in the backward instead of keeping them all
    #[arg(long = "recompute")]
    pub recompute: bool,
    /// Print one JSON object
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// FLOPs of one training step's matrix products (2 per multiply-add): every linear layer and
/// the head forward, input gradient and weight gradient; attention's score and value products
/// over the causal blocks the kernels compute (forward 2, backward 4); plus one more forward of
/// the layers when activations are recomputed.
pub fn step_flops(c: &Config, batch: usize, seq: usize, recompute: bool) -> f64 {
    let tokens = (batch * seq) as f64;
    let (d, q, kv, ff, v) = (
        c.n_embd as f64,
        c.q_dim() as f64,
        c.kv_dim() as f64,
        c.n_ff as f64,
        c.n_vocab as f64,
    );
    let per_layer_linear = d * q + 2.0 * d * kv + q * d + 3.0 * d * ff;
    let linear_fwd = 2.0 * tokens * per_layer_linear * c.n_layers as f64;
    let head_fwd = 2.0 * tokens * d * v;
    // Causal blocks of 64 queries: block ending at r1 meets r1 keys.
    let block = 64usize;
    let pairs: usize = (0..seq)
        .step_by(block)
        .map(|r0| (block.min(seq - r0)) * (r0 + block).min(seq))
        .sum();
    let attn_fwd = 2.0 * 2.0 * (pairs * batch * c.n_head * c.head_dim) as f64 * c.n_layers as f64;
    let layers_fwd = linear_fwd + attn_fwd;
    let fwd = layers_fwd + head_fwd;
    3.0 * fwd + if recompute { layers_fwd } else { 0.0 }
}

#[derive(serde::Serialize)]
struct Row {
    layers: usize,
    params: usize,
    tokens_per_s: f64,
    step_s: Vec<f64>,
    products_gflops: f64,
    /// Of the peak of the precision the products run in.
    fraction_of_peak: f64,
    /// Of the f32 GEMM peak (above 1 when bf16 products beat what f32 can do at all).
    fraction_of_f32_peak: f64,
}

pub fn run(a: Args) -> Result<()> {
    frugal_train::keep_freed_memory();
    ensure!(
        a.steps > 0 && a.batch > 0 && a.seq > 1,
        "--steps, --batch must be positive and --seq at least 2"
    );
    let path = common::model_path(&a.model)?;
    let model = Model::load(&path)?;
    let full = Params::from_model(&model)?;
    let prec = precision(&a.precision)?;
    let threads = rayon::current_num_threads();
    let peak = gemm::peak_gflops(prec, threads);
    let peak_f32 = if prec == Precision::F32 {
        peak
    } else {
        gemm::peak_gflops(Precision::F32, threads)
    };
    // Random tokens: speed does not depend on the text.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let nv = full.config.n_vocab as u32;
    let n_windows = 2 * a.batch;
    let tokens: Vec<u32> = (0..n_windows * (a.seq + 1))
        .map(|_| rng.random_range(0..nv))
        .collect();
    let data = Corpus {
        train: Windows {
            seq: a.seq,
            tokens: tokens.clone(),
        },
        heldout: Windows {
            seq: a.seq,
            tokens: tokens[..a.seq + 1].to_vec(),
        },
    };
    let mut rows = Vec::new();
    for &layers in &a.layers {
        ensure!(
            layers >= 1 && layers <= full.config.n_layers,
            "--layers {layers}: the model has {} layers",
            full.config.n_layers
        );
        let l = full.config.n_layers;
        let keep: Vec<usize> = (0..layers)
            .map(|i| {
                if layers == 1 {
                    0
                } else {
                    i * (l - 1) / (layers - 1)
                }
            })
            .collect();
        let params = keep_layers(&full, &keep)?;
        let cfg = TrainConfig {
            seq: a.seq,
            batch: a.batch,
            accum: 1,
            steps: a.steps + 1,
            schedule: Schedule {
                lr: 1e-5,
                warmup: 1,
                total: a.steps + 1,
                min_ratio: 1.0,
            },
            adamw: AdamWConfig::default(),
            clip: 1.0,
            freeze: Vec::new(),
            seed: 0,
            run: RunOptions {
                precision: prec,
                recompute: a.recompute,
                ..RunOptions::default()
            },
            loss: LossConfig::default(),
            eval_every: 0,
            eval_windows: 1,
            checkpoint: None,
            save_every: 0,
        };
        let n_params = params.n_params();
        let flops = step_flops(&params.config, a.batch, a.seq, cfg.run.recompute);
        let mut t = Trainer::new(params, cfg, &data, Signal::None, None)?;
        t.train_step()?;
        let mut times: Vec<f64> = (0..a.steps)
            .map(|_| t.train_step().map(|s| s.seconds))
            .collect::<Result<_, _>>()?;
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let gflops = flops / median / 1e9;
        rows.push(Row {
            layers,
            params: n_params,
            tokens_per_s: (a.batch * a.seq) as f64 / median,
            step_s: times,
            products_gflops: gflops,
            fraction_of_peak: gflops / peak,
            fraction_of_f32_peak: gflops / peak_f32,
        });
    }
    let backend = match prec {
        Precision::Bf16 => format!("bf16 x bf16 -> f32 ({})", gemm::bf16_backend()),
        Precision::F32 => "f32".into(),
    };
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "framework": "frugal",
                "model": path.display().to_string(),
                "batch": a.batch, "seq": a.seq, "threads": threads,
                "precision": backend,
                "recompute": a.recompute,
                "gemm_peak_gflops": peak,
                "gemm_peak_f32_gflops": peak_f32,
                "rows": rows,
            })
        );
        return Ok(());
    }
    println!(
        "training, batch {} x {} tokens, {threads} threads, products {backend}, activations {}",
        a.batch,
        a.seq,
        if a.recompute { "recomputed" } else { "kept" }
    );
    println!("GEMM peak measured now: {peak:.0} GFLOP/s ({backend}), f32 {peak_f32:.0} GFLOP/s");
    println!(
        "| layers | parameters | tokens/s | step (s) | products GFLOP/s | of GEMM peak | of f32 GEMM peak |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {:.1}M | {:.1} | {:.2} | {:.0} | {:.0}% | {:.0}% |",
            r.layers,
            r.params as f64 / 1e6,
            r.tokens_per_s,
            r.step_s[r.step_s.len() / 2],
            r.products_gflops,
            100.0 * r.fraction_of_peak,
            100.0 * r.fraction_of_f32_peak
        );
    }
    Ok(())
}
