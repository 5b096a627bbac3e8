//! `frugal bench`: measurements that print tables (and write log-log charts, SVG and PNG).
//!
//! Without a subcommand: model throughput in llama-bench's terms (`model.rs`: pp N, tg N, the
//! decode roofline). Subcommands, one file each: `kv` (the cost the KV cache removes),
//! `attention` (naive vs flash kernels), `context` (KV bytes against the weights as the context
//! grows).

pub mod alloc;
mod attention;
mod batch;
mod context;
mod kv;
mod kv_depth;
mod model;
pub mod plot;
mod speculate;
mod train;

use std::path::PathBuf;

use anyhow::Result;

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    #[command(flatten)]
    pub model: model::Args,
}

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Time per generated token with and without the KV cache as the sequence grows.
    Kv(kv::Args),
    /// Naive vs flash attention: time and peak extra memory per call, prefill and decode.
    Attention(attention::Args),
    /// KV-cache bytes against context length for each KV type, against the weight bytes.
    Context(context::Args),
    /// Batched decoding (as llama-batched-bench): B sequences prefill and then decode together;
    /// aggregate tokens/s against B.
    Batch(batch::Args),
    /// Speculative decoding: acceptance, tokens per pass and speed-up over plain decoding for
    /// each drafter, beside Leviathan et al.'s prediction, on input-grounded and open prompts.
    Speculate(speculate::Args),
    /// Training tokens/s of the model and of layer-dropped students, and the fraction of the
    /// GEMM peak (measured in the same run) the step's products reach.
    Train(train::Args),
}

/// Where charts go.
#[derive(clap::Args, Clone, Debug)]
pub struct OutputArgs {
    /// Directory for the charts (NAME.svg and NAME.png)
    #[arg(long = "out", default_value = ".")]
    pub out: PathBuf,
    /// Print the table only, write no chart
    #[arg(long = "no-plot")]
    pub no_plot: bool,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
}

impl OutputArgs {
    /// Writes the chart unless --no-plot; reports the files on stderr. A machine without a
    /// font still gets the table (the measurement), with a note instead of the chart.
    fn chart(&self, chart: &plot::Chart, stem: &str) -> Result<()> {
        if self.no_plot {
            return Ok(());
        }
        match plot::write(chart, &self.out, stem) {
            Ok(paths) => {
                for p in paths {
                    eprintln!("wrote {}", p.display());
                }
            }
            Err(e) if e.to_string().contains("font") => eprintln!("note: no chart: {e}"),
            Err(e) => return Err(e),
        }
        Ok(())
    }
}

pub fn run(a: Args) -> Result<()> {
    match a.command {
        None => model::run(a.model),
        Some(BenchCommand::Kv(a)) => kv::run(a),
        Some(BenchCommand::Attention(a)) => attention::run(a),
        Some(BenchCommand::Context(a)) => context::run(a),
        Some(BenchCommand::Train(a)) => train::run(a),
        Some(BenchCommand::Batch(a)) => batch::run(a),
        Some(BenchCommand::Speculate(a)) => speculate::run(a),
    }
}
