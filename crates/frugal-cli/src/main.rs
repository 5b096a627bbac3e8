//! The `frugal` command. Argument parsing, progress and printing only: the engine is the
//! `frugal` library.

mod commands;

/// Counts heap bytes so `frugal bench` can report measured peak memory (negligible overhead).
#[global_allocator]
static ALLOC: commands::bench::alloc::Counting = commands::bench::alloc::Counting;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "frugal",
    version,
    about = "Run, measure and shrink LLMs on the CPU: every efficiency lever is a switch whose cost frugal measures."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Worker threads [default: all cores]
    #[arg(short = 't', long = "threads", global = true)]
    threads: Option<usize>,
}

#[derive(Subcommand)]
enum Command {
    /// Continue a prompt, streaming tokens as they are generated.
    Generate(commands::generate::Args),
    /// Chat interactively using the model's own chat template.
    Chat(commands::chat::Args),
    /// Measure model quality on a text.
    #[command(subcommand)]
    Eval(commands::eval::EvalCommand),
    /// Describe a GGUF file: metadata, tensors, parameter and KV-cache sizes, and what frugal
    /// and llama.cpp cannot run in it.
    Info(commands::info::Args),
    /// The token ids of a text, as llama-tokenize prints them (a vocab-only file will do).
    Tokenize(commands::tokenize::Args),
    /// Measure throughput (pp N / tg N, as llama-bench) or, with a subcommand, what a lever
    /// costs and saves (kv, attention, context): tables and charts.
    Bench(commands::bench::Args),
    /// Write a model in another storage format (mixed precision: norms F32, embedding Q8_0).
    Quantize(commands::quantize::Args),
    /// Model surgery on the attention layout: regroup the KV heads (mha, gqa:G, mqa) or convert
    /// to latent attention (mla:RANK).
    Convert(commands::convert::Args),
    /// Fewer weights: unstructured or N:M sparsity (magnitude, Wanda, SparseGPT), or structured
    /// removal of FFN neurons, KV groups and layers.
    Prune(commands::prune::Args),
    /// Dense to mixture of experts: split each FFN into routed experts (fewer active
    /// parameters) or upcycle it into copies (more total parameters).
    Moefy(commands::moefy::Args),
    /// Analyze a model's numbers: outliers and what they cost each quantization scheme.
    #[command(subcommand)]
    Analyze(commands::analyze::AnalyzeCommand),
    /// Reports that combine measurements: `report quant` is the format table.
    #[command(subcommand)]
    Report(commands::report::ReportCommand),
    /// The cheapest model that meets targets (`--target 'decode >= 5x' --target 'kl <= 0.05'`):
    /// the levers searched on this machine, a Pareto frontier and a recipe.
    Optimize(commands::optimize::Args),
    /// Estimate KV-cache and memory needs for a model at a context length.
    Estimate(commands::estimate::Args),
    /// Train a model on text (next-token cross-entropy), from any GGUF frugal runs.
    Train(commands::train::TrainCmd),
    /// Train a student to imitate one or more teachers (knowledge distillation): layer-dropped,
    /// another architecture, any GGUF, or the teacher itself.
    Distill(commands::train::DistillCmd),
    /// Train draft heads for speculative decoding (`--speculate heads:FILE`) on the model's own
    /// generations, the model frozen.
    TrainHeads(commands::train_heads::Args),
    /// Build a datastore of the model's own answers for retrieval drafting
    /// (`--speculate store:FILE`).
    BuildStore(commands::build_store::Args),
    /// Train a MoE model's routers to imitate the dense FFN its experts came from, with no
    /// balancing, the Switch auxiliary loss or DeepSeek's selection bias.
    TrainRouter(commands::train_router::Args),
    /// Serve the model over an OpenAI-compatible HTTP API: continuous batching, prefix caching,
    /// admission control, Prometheus metrics.
    Serve(commands::serve::Args),
    /// Download a known model into the cache: smollm2-135m (the default, SmolLM2-135M-Instruct Q4_1) or gemma3-270m
    Fetch(commands::fetch::Args),
}

fn main() {
    // A closed pipe (`frugal info | head`) ends the program quietly; any other panic is a bug,
    // reported on one line without a backtrace.
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("unknown panic");
        if msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("internal error (a bug in frugal, please report it): {msg}{at}");
    }));
    let cli = Cli::parse();
    // Run the command on a pool thread: the decode loop then hands each matrix product to a
    // worker that is still spinning, instead of waking a sleeping one from outside the pool.
    let result = thread_pool(cli.threads).and_then(|pool| pool.install(|| run(cli.command)));
    if let Err(e) = result {
        // One line naming the problem; never a backtrace.
        let msg = format!("{e:#}").replace('\n', " ");
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}

fn thread_pool(threads: Option<usize>) -> anyhow::Result<rayon::ThreadPool> {
    let mut b = rayon::ThreadPoolBuilder::new();
    if let Some(n) = threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        b = b.num_threads(n);
    }
    Ok(b.build()?)
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Generate(a) => commands::generate::run(a),
        Command::Chat(a) => commands::chat::run(a),
        Command::Eval(c) => commands::eval::run(c),
        Command::Info(a) => commands::info::run(a),
        Command::Tokenize(a) => commands::tokenize::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Quantize(a) => commands::quantize::run(a),
        Command::Convert(a) => commands::convert::run(a),
        Command::Prune(a) => commands::prune::run(a),
        Command::Moefy(a) => commands::moefy::run(a),
        Command::Analyze(c) => commands::analyze::run(c),
        Command::Report(c) => commands::report::run(c),
        Command::Estimate(a) => commands::estimate::run(a),
        Command::Optimize(a) => commands::optimize::run(a),
        Command::Fetch(a) => commands::fetch::run(a),
        Command::Serve(a) => commands::serve::run(a),
        Command::Train(a) => commands::train::run_train(a),
        Command::Distill(a) => commands::train::run_distill(a),
        Command::TrainHeads(a) => commands::train_heads::run(a),
        Command::BuildStore(a) => commands::build_store::run(a),
        Command::TrainRouter(a) => commands::train_router::run(a),
    }
}
