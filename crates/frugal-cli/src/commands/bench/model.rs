//! `frugal bench`: prefill and decode throughput in llama-bench's terms (pp N, tg N), with the
//! decode roofline of the machine.

use anyhow::Result;
use frugal::model::shaped::Mix;

use crate::commands::common::{self, EngineArgs, ModelArgs};
use frugal::eval::EvalOptions;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Prompt tokens processed in one batch (pp test); 0 skips it
    #[arg(short = 'p', long = "prompt", default_value_t = 512)]
    pub prompt: usize,
    /// Tokens generated one at a time (tg test); 0 skips it
    #[arg(short = 'n', long = "gen", default_value_t = 128)]
    pub gen_tokens: usize,
    /// Tokens already in the cache before each test (as llama-bench's -d): decode at depth D
    /// reads D cached positions every step, which is where long context costs
    #[arg(short = 'd', long = "depth", default_value_t = 0)]
    pub depth: usize,
    /// Timed repetitions of each test (after one warm-up); the median is reported
    #[arg(short = 'r', long = "reps", default_value_t = 3)]
    pub reps: usize,
    /// Also measure the read bandwidth and report decode against its bound: the fastest pass
    /// of all, the passes around each run, and one pass before each step of one more run
    #[arg(long)]
    pub roofline: bool,
    /// Print one JSON object
    #[arg(long)]
    pub json: bool,
    /// Bench a random-weight file with the exact shape of this catalog model (llama-3.2-1b,
    /// qwen2.5-1.5b, llama-3.1-8b, smollm2-135m, ...), written once to $FRUGAL_HOME/shapes:
    /// the speed at that size before downloading it; llama.cpp can bench the same file
    #[arg(long, conflicts_with = "model")]
    pub shape: Option<String>,
    /// The shaped file's llama-quantize mix: f16, q8_0, q4_0, q2_k, q3_k_m, q4_k_m, q5_k_m or
    /// iq4_xs
    #[arg(long = "type", default_value = "q4_k_m", requires = "shape")]
    pub mix: String,
    /// Print the shaped file's path (writing it first if needed) and exit
    #[arg(long, requires = "shape")]
    pub print_path: bool,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(mut a: Args) -> Result<()> {
    anyhow::ensure!(a.reps > 0, "--reps must be at least 1");
    if let Some(shape) = &a.shape {
        let mix = Mix::from_name(&a.mix).ok_or_else(|| {
            let names: Vec<_> = Mix::ALL.iter().map(|m| m.name()).collect();
            anyhow::anyhow!("--type {}: expected one of {}", a.mix, names.join(", "))
        })?;
        let path = frugal::model::shaped::ensure(shape, mix, &mut |m| eprintln!("{m}"))?;
        if a.print_path {
            println!("{}", path.display());
            return Ok(());
        }
        a.model.model = Some(path);
    }
    let path = common::model_path(&a.model)?;
    let (model, _) = common::load(&a.model)?;
    let opts = EvalOptions {
        kv: a.engine.kv_options()?,
        attention: a.engine.attention()?,
    };
    let threads = rayon::current_num_threads();
    let weight_bytes = frugal::bench::weight_bytes_per_token(&model);
    let kv_bytes = frugal::bench::kv_bytes_per_token(&model, &opts, a.depth, a.gen_tokens);
    let bytes_per_token = weight_bytes + kv_bytes;
    // The bound: what one decode step reads, over the bandwidth of a working set that size read
    // again and again (from the last-level cache when it fits, as the weights then are), taken
    // before and after the tests and the higher kept (a neighbour on a shared machine slows a
    // measurement, never speeds it); the memory's own bandwidth beside it. One working set
    // serves every measurement.
    let probe = a
        .roofline
        .then(|| frugal::bench::ReadProbe::new(bytes_per_token as usize));
    let bandwidth_before = probe.as_ref().map(|p| p.fastest(9));
    let pp = if a.prompt > 0 {
        Some(frugal::bench::prefill_at(
            &model, a.prompt, a.depth, a.reps, &opts,
        )?)
    } else {
        None
    };
    // With the roofline, the bandwidth is also measured between the decode runs: on a shared
    // machine it moves between runs, so each run is compared with the bound measured beside it
    // (the higher of the two measurements around it) as well as with the highest of all.
    let mut probes = Vec::new();
    let tg = if a.gen_tokens > 0 {
        let (t, p) =
            frugal::bench::decode_probed(&model, a.gen_tokens, a.depth, a.reps, &opts, || {
                probe.as_ref().map(|p| p.fastest(3))
            })?;
        probes = p.into_iter().flatten().collect();
        Some(t)
    } else {
        None
    };
    let bandwidth = probe.as_ref().zip(bandwidth_before).map(|(p, before)| {
        probes
            .iter()
            .fold(before.max(p.fastest(9)), |m, &b| m.max(b))
    });
    // Run i against the higher of the bandwidths measured just before and just after it.
    let paired: Vec<f64> = match &tg {
        Some(t) if probes.len() == t.runs.len() + 1 => t
            .runs
            .iter()
            .zip(probes.windows(2))
            .map(|(&run, bw)| run * bytes_per_token as f64 / bw[0].max(bw[1]))
            .collect(),
        _ => Vec::new(),
    };
    // Step by step: each decode step right after one pass over the same bytes (see
    // `frugal::bench::decode_paired`): the step's bound at the bandwidth of that moment.
    let stepwise: Vec<f64> = match &probe {
        Some(p) if a.gen_tokens > 0 => {
            frugal::bench::decode_paired(&model, a.gen_tokens, a.depth, &opts, p)?
                .into_iter()
                .map(|(step, bw)| bytes_per_token as f64 / bw / step)
                .collect()
        }
        _ => Vec::new(),
    };
    let dram_bandwidth = a
        .roofline
        .then(|| frugal::bench::read_bandwidth(frugal::bench::DRAM_WORKING_SET, 3));
    let llc = frugal::bench::last_level_cache_bytes();
    let bound = bandwidth.map(|bw| bw / bytes_per_token as f64);
    let fraction = match (&tg, bound) {
        (Some(t), Some(b)) => Some(t.median / b),
        _ => None,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if a.json {
        let out = serde_json::json!({
            "model": name,
            "threads": threads,
            "activations": model.activations,
            "attention": opts.attention,
            "kv": opts.kv,
            "pp_tokens": a.prompt,
            "tg_tokens": a.gen_tokens,
            "depth": a.depth,
            "pp_tokens_per_s": pp.as_ref().map(|t| t.median),
            "tg_tokens_per_s": tg.as_ref().map(|t| t.median),
            "pp": pp,
            "tg": tg,
            "weight_bytes_per_token": weight_bytes,
            "kv_bytes_per_token": kv_bytes,
            "bytes_per_token": bytes_per_token,
            "read_bandwidth_bytes_per_s": bandwidth,
            "dram_read_bandwidth_bytes_per_s": dram_bandwidth,
            "last_level_cache_bytes": llc,
            "tg_roofline_tokens_per_s": bound,
            "tg_fraction_of_roofline": fraction,
            "tg_fraction_of_roofline_beside_each_run": paired,
            "tg_fraction_of_roofline_beside_each_run_median":
                (!paired.is_empty()).then(|| frugal::bench::median(&paired)),
            "tg_fraction_of_roofline_step_by_step": stepwise,
            "tg_fraction_of_roofline_step_by_step_median":
                (!stepwise.is_empty()).then(|| frugal::bench::median(&stepwise)),
        });
        println!("{out}");
        return Ok(());
    }
    println!(
        "model {name} | {threads} threads | activations {} | attention {} | KV {}",
        model.activations, opts.attention, opts.kv.format
    );
    let at = if a.depth > 0 {
        format!(" @ d{}", a.depth)
    } else {
        String::new()
    };
    if let Some(t) = &pp {
        println!(
            "pp{:<5}{at} {:8.1} tok/s  (median of {}; min {:.1}, max {:.1})",
            a.prompt,
            t.median,
            t.runs.len(),
            t.min,
            t.max
        );
    }
    if let Some(t) = &tg {
        println!(
            "tg{:<5}{at} {:8.1} tok/s  (median of {}; min {:.1}, max {:.1})",
            a.gen_tokens,
            t.median,
            t.runs.len(),
            t.min,
            t.max
        );
    }
    if let (Some(bw), Some(b)) = (bandwidth, bound) {
        let fits = match llc {
            Some(l) if bytes_per_token <= l => {
                format!(
                    ", which fits the {} last-level cache",
                    common::human_bytes(l)
                )
            }
            Some(l) => format!(
                ", larger than the {} last-level cache",
                common::human_bytes(l)
            ),
            None => String::new(),
        };
        println!(
            "roofline: {} per token ({} weights + {} KV cache) / {:.1} GB/s (a working set that size read repeatedly{fits}) = {:.0} tok/s bound{}",
            common::human_bytes(bytes_per_token),
            common::human_bytes(weight_bytes),
            common::human_bytes(kv_bytes),
            bw / 1e9,
            b,
            fraction
                .map(|f| format!("; decode reaches {:.0}% of it", f * 100.0))
                .unwrap_or_default()
        );
        if !paired.is_empty() {
            let pct = |f: f64| f * 100.0;
            println!(
                "run by run, each against the bandwidth measured just before and after it: decode reaches {:.0}% of its bound (median of {}; {:.0}-{:.0}%)",
                pct(frugal::bench::median(&paired)),
                paired.len(),
                pct(paired.iter().copied().fold(f64::INFINITY, f64::min)),
                pct(paired.iter().copied().fold(0.0, f64::max)),
            );
        }
        if !stepwise.is_empty() {
            let mut sorted = stepwise.clone();
            sorted.sort_by(f64::total_cmp);
            let at = |q: f64| 100.0 * frugal::eval::quantile(&sorted, q);
            let over = sorted.iter().filter(|&&f| f > 1.0).count();
            println!(
                "step by step, each right after one pass over the same bytes: decode reaches {:.0}% of its bound (median of {} steps; 10th-90th percentile {:.0}-{:.0}%; {over} above 100%)",
                100.0 * frugal::bench::median(&stepwise),
                sorted.len(),
                at(0.1),
                at(0.9),
            );
        }
        if let Some(d) = dram_bandwidth {
            println!(
                "memory: {:.1} GB/s over a {} working set = {:.0} tok/s if every byte came from memory",
                d / 1e9,
                common::human_bytes(frugal::bench::DRAM_WORKING_SET as u64),
                d / bytes_per_token as f64
            );
        }
    }
    Ok(())
}
