//! `frugal train-heads`: draft heads for speculative decoding (`--speculate heads:FILE`),
//! trained on the model's own greedy generations with the model frozen.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use frugal_train::heads::{self, HeadsConfig};

use super::common::{self, ModelArgs};
use super::corpus::CorpusArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Number of heads: head j guesses the token j + 1 places after the model's next one
    #[arg(long = "heads", default_value_t = 3)]
    pub heads: usize,
    /// Tokens the heads score: the most frequent in the generations (FR-Spec); 0 = all
    #[arg(long = "vocab", default_value_t = 8192)]
    pub vocab: usize,
    /// Optimizer steps (default: two passes over the positions)
    #[arg(long = "steps")]
    pub steps: Option<usize>,
    /// Positions per step
    #[arg(long = "batch", default_value_t = 256)]
    pub batch: usize,
    #[arg(long = "lr", default_value_t = 1e-3)]
    pub lr: f32,
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Medusa-1 heads that read only the hidden state (default: each head also reads the
    /// embedding of the token before the one it guesses)
    #[arg(long = "hidden-only")]
    pub hidden_only: bool,
    /// Share of the generated sequences kept out of training to measure the heads on
    #[arg(long = "holdout", default_value_t = 0.05)]
    pub holdout: f64,
    /// Output heads file (GGUF)
    #[arg(long = "out", required = true)]
    pub out: PathBuf,
    #[command(flatten)]
    pub corpus: CorpusArgs,
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(a: Args) -> Result<()> {
    anyhow::ensure!(a.heads >= 1 && a.heads <= 16, "--heads must be 1 to 16");
    anyhow::ensure!(a.corpus.gen_len > a.heads, "--gen must exceed --heads");
    anyhow::ensure!(a.batch > 0, "--batch must be at least 1");
    anyhow::ensure!(
        (0.0..=0.5).contains(&a.holdout),
        "--holdout must be 0 to 0.5"
    );
    let (model, tok) = common::load(&a.model)?;
    let seqs = a.corpus.sequences(&model, &tok)?;
    let corpus = heads::hidden_states(&model, &seqs, a.heads)?;
    let positions = corpus.next.len();
    let steps = a
        .steps
        .unwrap_or_else(|| (2 * positions).div_ceil(a.batch).max(1));
    let cfg = HeadsConfig {
        n_heads: a.heads,
        vocab: a.vocab,
        steps,
        batch: a.batch,
        lr: a.lr,
        seed: a.seed,
        token_input: !a.hidden_only,
        holdout: a.holdout,
    };
    let t1 = Instant::now();
    let mut last = Instant::now();
    let (w, reports) = heads::train(&model, &corpus, &cfg, |step, r| {
        if last.elapsed().as_secs_f64() > 10.0 || step + 1 == steps {
            let accs: Vec<String> = r.iter().map(|h| format!("{:.2}", h.accuracy)).collect();
            eprintln!(
                "step {}/{steps}: top-1 accuracy per head [{}]",
                step + 1,
                accs.join(", ")
            );
            last = Instant::now();
        }
    })?;
    w.write(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "trained {} heads on {positions} positions ({steps} steps of {}, {:.0} s); vocabulary {}",
        a.heads,
        a.batch,
        t1.elapsed().as_secs_f64(),
        w.vocab.as_ref().map_or(model.config.n_vocab, |v| v.len())
    );
    for (j, r) in reports.iter().enumerate() {
        let held = if a.holdout > 0.0 {
            format!(
                "; held out: top-1 {:.3}, with every earlier head right {:.3}",
                r.held_out_accuracy, r.held_out_chain
            )
        } else {
            String::new()
        };
        println!(
            "head {}: predicts token t+{}: loss {:.3}, top-1 accuracy {:.3} (last quarter of training){held}",
            j + 1,
            j + 2,
            r.loss,
            r.accuracy
        );
    }
    println!("wrote {}", a.out.display());
    Ok(())
}
