//! `frugal moefy`: a dense model into a mixture of experts. `--experts E --top-k K` splits every
//! FFN's neurons into E experts (fewer active parameters); `--upcycle E` copies the FFN E times
//! (more total parameters, the same active ones). Writes a GGUF in llama.cpp's MoE layout.

use std::path::PathBuf;

use super::common::CalibrationArgs;
use anyhow::{Context, Result, bail, ensure};
use frugal::model::Model;
use frugal::surgery::moe::{self, MoeReport, MoefyTarget, RouterInit, Split};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The dense model (GGUF, a Llama-family model)
    #[arg(value_parser = super::common::model_arg)]
    pub input: PathBuf,
    /// The GGUF file to write
    pub output: PathBuf,
    /// Experts per layer to split each FFN's neurons into (equal widths of whole blocks)
    #[arg(long = "experts", conflicts_with = "upcycle")]
    pub experts: Option<usize>,
    /// Sparse upcycling instead: this many copies of each FFN
    #[arg(long = "upcycle", value_name = "E")]
    pub upcycle: Option<usize>,
    /// Experts each token is routed to
    #[arg(long = "top-k", default_value_t = 2)]
    pub top_k: usize,
    /// How neurons are grouped: weights (k-means on the gate rows, no data) or coactivation
    /// (k-means on how neurons fire together over --calibration)
    #[arg(long = "split", default_value = "coactivation")]
    pub split: String,
    /// How the router is built: centroid (mean gate row of each expert, no data) or fit (least
    /// squares from the FFN input to each expert's activation over --calibration)
    #[arg(long = "router", default_value = "fit")]
    pub router: String,
    /// Neurons of every FFN kept always active as a shared expert (the most active over
    /// --calibration, as CMoE does); the rest are split into the routed experts
    #[arg(long = "shared", default_value_t = 0)]
    pub shared: usize,
    /// Upcycling: noise added to each copy, as a fraction of each matrix's RMS
    #[arg(long = "noise", default_value_t = 0.01)]
    pub noise: f32,
    /// The calibration text (the co-activation split, the fitted router, the shared expert)
    #[command(flatten)]
    pub calib: CalibrationArgs,
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object instead of text
    #[arg(long)]
    pub json: bool,
}

pub fn run(mut a: Args) -> Result<()> {
    a.input = super::common::input_model(Some(&a.input))?;
    ensure!(
        a.input != a.output,
        "the output would overwrite the input ({}); choose another path",
        a.input.display()
    );
    let model = Model::load(&a.input)?;
    let t0 = std::time::Instant::now();
    let (w, r) = match (a.experts, a.upcycle) {
        (Some(e), None) => {
            let split = match a.split.as_str() {
                "weights" => Split::Weights,
                "coactivation" => Split::Coactivation,
                s => bail!("--split {s:?}: use weights or coactivation"),
            };
            let router = match a.router.as_str() {
                "centroid" => RouterInit::Centroid,
                "fit" => RouterInit::Fit,
                s => bail!("--router {s:?}: use centroid or fit"),
            };
            let ids = a.calib.tokens(&model)?;
            let target = MoefyTarget {
                n_expert: e,
                n_used: a.top_k,
                split,
                router,
                shared: a.shared,
                seed: a.seed,
            };
            let calib = ids.as_deref().map(|t| (t, a.calib.calibration_ctx));
            moe::moefy(&model.file, &model, calib, &target)?
        }
        (None, Some(e)) => moe::upcycle(&model.file, e, a.top_k, a.noise, a.seed)?,
        _ => bail!("give --experts E (split the FFN) or --upcycle E (copy it)"),
    };
    // Atomic: written beside the output, then renamed.
    w.write_file(&a.output)
        .with_context(|| format!("writing {}", a.output.display()))?;
    report(&a, &r, t0.elapsed().as_secs_f64())
}

fn report(a: &Args, r: &MoeReport, secs: f64) -> Result<()> {
    if a.json {
        println!("{}", serde_json::to_string(r)?);
        return Ok(());
    }
    println!(
        "{} -> {}: {} experts of {} neurons per layer, {} per token ({secs:.1} s)",
        a.input.display(),
        a.output.display(),
        r.n_expert,
        r.expert_width,
        r.n_used
    );
    println!(
        "parameters: {:.1}M total, {:.1}M active per token ({:.0}%)",
        r.total_params as f64 / 1e6,
        r.active_params as f64 / 1e6,
        100.0 * r.active_params as f64 / r.total_params as f64
    );
    Ok(())
}
