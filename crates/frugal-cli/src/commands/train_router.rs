//! `frugal train-router`: trains a MoE model's routers to imitate the dense FFN the experts
//! came from (the teacher), experts frozen, with no balancing, the Switch auxiliary loss or
//! DeepSeek's selection bias, and reports the routing statistics step by step.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;
use frugal_lab::router::{Phase, Plan, quarters, train_routers};
use frugal_train::router::{Balance, Teacher};

use super::train::parse_count;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The MoE model whose routers to train (from `frugal moefy`, or any llama-layout MoE)
    #[arg(short = 'm', long = "model", required = true)]
    pub model: PathBuf,
    /// The dense model the experts came from, whose FFN outputs the routed layers learn to
    /// match [default: the default model, SmolLM2-135M-Instruct Q4_1]
    #[arg(long = "teacher")]
    pub teacher: Option<PathBuf>,
    /// Text to train on
    #[arg(long = "data", required = true)]
    pub data: PathBuf,
    /// none, aux:ALPHA (the Switch auxiliary loss, weight ALPHA) or bias:GAMMA (DeepSeek's
    /// auxiliary-loss-free selection bias, moved GAMMA per step)
    #[arg(long = "balance", default_value = "none")]
    pub balance: Balance,
    /// Tokens to train on (k and M suffixes); the text is repeated when shorter
    #[arg(long = "tokens", default_value = "50k")]
    pub tokens: String,
    /// Tokens per optimizer step (whole windows of --ctx)
    #[arg(long = "batch", default_value_t = 512)]
    pub batch: usize,
    /// Window the teacher reads at once
    #[arg(long = "ctx", default_value_t = 256)]
    pub ctx: usize,
    #[arg(long = "lr", default_value_t = 1e-4)]
    pub lr: f32,
    /// Weight of the reconstruction term (the chosen experts' weights) against the selection
    /// cross-entropy; 0 trains only which experts are chosen
    #[arg(long = "recon", default_value_t = 1.0)]
    pub recon: f32,
    /// One JSON line per step (the routing statistics the charts of `report moe` draw)
    #[arg(long = "log", value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// The GGUF file to write
    #[arg(long = "out", required = true)]
    pub out: PathBuf,
    /// Print the summary as one JSON object
    #[arg(long)]
    pub json: bool,
}

/// The run's routing, early and late.
#[derive(serde::Serialize)]
struct Summary {
    balance: String,
    tokens: u64,
    steps: usize,
    seconds: f64,
    /// Means over the first and the last quarter of the steps.
    first: Phase,
    last: Phase,
}

pub fn run(a: Args) -> Result<()> {
    ensure!(
        a.model != a.out,
        "the output would overwrite the model ({}); choose another path",
        a.out.display()
    );
    ensure!(a.ctx > 0, "--ctx must be at least 1");
    ensure!(
        a.recon.is_finite() && a.recon >= 0.0 && a.lr.is_finite() && a.lr > 0.0,
        "--recon must be at least 0 and --lr positive"
    );
    ensure!(
        a.batch >= a.ctx && a.batch.is_multiple_of(a.ctx),
        "--batch {} must be a whole number of --ctx {} windows",
        a.batch,
        a.ctx
    );
    let tokens = parse_count(&a.tokens)?;
    let student =
        Model::load(&a.model).with_context(|| format!("loading {}", a.model.display()))?;
    let teacher_path = match &a.teacher {
        Some(p) => p.clone(),
        None => frugal::fetch::ensure_default_model(|m| eprintln!("{m}"))?,
    };
    let mut teacher_model = Model::load(&teacher_path)
        .with_context(|| format!("loading the teacher {}", teacher_path.display()))?;
    // 8-bit activations into the quantized matrices, as `frugal generate` runs it.
    teacher_model.set_activations(Activations::Q8);
    let teacher = Teacher::new(&teacher_model, &student)?;
    let text = std::fs::read_to_string(&a.data)
        .with_context(|| format!("reading {}", a.data.display()))?;
    let ids = Tokenizer::from_gguf(&teacher_model.file)?.encode(&text, false)?;
    ensure!(
        ids.len() >= a.ctx,
        "{} holds {} tokens, less than one window of --ctx {}",
        a.data.display(),
        ids.len(),
        a.ctx
    );
    let mut log = match &a.log {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let t0 = Instant::now();
    let mut last = Instant::now();
    let plan = Plan {
        ctx: a.ctx,
        batch: a.batch,
        tokens,
        balance: a.balance,
        lr: a.lr,
        recon: a.recon,
    };
    let steps = plan.steps();
    let (tr, reports) = train_routers(&student, &teacher, &ids, &plan, |step, r| {
        if let Some(f) = &mut log {
            writeln!(f, "{}", serde_json::to_string(r)?)?;
        }
        if last.elapsed().as_secs_f64() > 10.0 || step + 1 == steps || step == 0 {
            eprintln!(
                "step {}/{steps}: missed {:.3} of the dense output, busiest expert {:.2}x the mean \
                 (worst layer {:.2}x), load CV {:.2}, entropy {:.2} nats",
                step + 1,
                r.rel_err,
                r.max_over_mean,
                r.worst_max_over_mean,
                r.cv,
                r.entropy
            );
            last = Instant::now();
        }
        Ok(())
    })?;
    if let Some(mut f) = log {
        f.flush()?;
    }
    let used = (steps * a.batch) as u64;
    tr.to_gguf(&student.file, used)
        .write_file(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let (first, last) = quarters(&reports);
    let s = Summary {
        balance: a.balance.to_string(),
        tokens: used,
        steps,
        seconds: t0.elapsed().as_secs_f64(),
        first,
        last,
    };
    if a.json {
        println!("{}", serde_json::to_string(&s)?);
        return Ok(());
    }
    println!(
        "trained {} routers on {used} tokens ({steps} steps, balance {}, {:.0} s)",
        tr.n_layers(),
        s.balance,
        s.seconds
    );
    for (name, p) in [("first quarter", &s.first), ("last quarter", &s.last)] {
        println!(
            "{name}: missed {:.3} of the dense output; {:.2} of the choices the oracle's; \
             busiest expert {:.2}x the mean load (worst layer {:.2}x); load CV {:.2}; entropy \
             {:.2} nats",
            p.rel_err, p.oracle_hit, p.max_over_mean, p.worst_max_over_mean, p.cv, p.entropy
        );
    }
    println!("wrote {}", a.out.display());
    Ok(())
}
