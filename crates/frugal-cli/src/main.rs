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
    /// Measure what the efficiency levers cost and save: tables and charts.
    #[command(subcommand)]
    Bench(commands::bench::BenchCommand),
    /// Describe a GGUF file: metadata, tensors, parameter and KV-cache sizes.
    Info(commands::info::Args),
    /// Download the default model (SmolLM2-135M-Instruct, Q4_1) into the cache.
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
    let result = match cli.command {
        Command::Generate(a) => commands::generate::run(a),
        Command::Chat(a) => commands::chat::run(a),
        Command::Eval(c) => commands::eval::run(c),
        Command::Bench(c) => commands::bench::run(c),
        Command::Info(a) => commands::info::run(a),
        Command::Fetch(a) => commands::fetch::run(a),
    };
    if let Err(e) = result {
        // One line naming the problem; never a backtrace.
        let msg = format!("{e:#}").replace('\n', " ");
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}
