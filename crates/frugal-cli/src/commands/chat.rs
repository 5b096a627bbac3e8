//! `frugal chat`: an interactive conversation rendered with the model's chat template. The KV
//! cache is kept between turns, so each turn only prefills what is new.

use std::io::{BufRead, Write};

use anyhow::Result;
use frugal::chat::{ChatTemplate, Message};
use frugal::generate::{GenerateOptions, Session, StopReason};

use super::common::{self, ModelArgs, RunArgs, SamplingArgs, SpecArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A system message to start the conversation with
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub run: RunArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

pub fn run(a: Args) -> Result<()> {
    // Flags first: a typo fails before the model loads.
    let (kv_opts, attention) = (a.run.engine.kv_options()?, a.run.engine.attention()?);
    let spec = a.spec.options()?;
    anyhow::ensure!(
        spec.is_none() || !a.run.no_kv_cache,
        "--speculate needs the KV cache (it drops rejected positions from it)"
    );
    let (mut model, tok) = common::load(&a.model)?;
    let template = ChatTemplate::from_gguf(&model.file)?;
    let ctx = common::context_len(&a.run, &mut model)?;
    // Either session keeps its cache between turns.
    let (mut plain, mut speculative) = match &spec {
        None => (
            Some(Session::with_options(
                &model,
                ctx,
                !a.run.no_kv_cache,
                &kv_opts,
                attention,
            )?),
            None,
        ),
        Some(o) => (
            None,
            Some(common::speculator(&model, ctx, &kv_opts, attention, o)?),
        ),
    };
    let opts = GenerateOptions {
        max_tokens: a.sampling.max_tokens,
        stop: a.sampling.stop.clone(),
        sampler: a.sampling.params(),
    };
    let start: Vec<Message> = a.system.iter().map(|s| Message::new("system", s)).collect();
    let mut history = start.clone();
    eprintln!(
        "chat with {} — /reset clears the history, /exit (or end of input) quits",
        model.config.arch
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|_| anyhow::anyhow!("stdin is not valid UTF-8"))?;
        let input = line.trim();
        match input {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history = start.clone();
                eprintln!("(history cleared)");
                continue;
            }
            _ => {}
        }
        history.push(Message::new("user", input));
        let prompt = tok.encode(&template.render(&history, true)?, true)?;
        if prompt.len() >= ctx {
            history.pop();
            eprintln!(
                "error: the conversation ({} tokens) no longer fits the context of {ctx}; /reset to start over",
                prompt.len()
            );
            continue;
        }
        let mut out = std::io::stdout().lock();
        let stream = |piece: &str| {
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        };
        let g = match (&mut plain, &mut speculative) {
            (Some(session), _) => session.generate(&tok, &prompt, &opts, stream)?,
            (_, Some(s)) => s.generate(&tok, &prompt, &opts, stream)?.0,
            (None, None) => unreachable!("one session exists"),
        };
        writeln!(out)?;
        let s = &g.stats;
        eprintln!(
            "[{} prompt tok ({} new) | prefill {:.1} tok/s | decode {:.1} tok/s | KV {}]",
            s.prompt_tokens,
            s.prefill_tokens,
            s.prefill_tokens_per_s(),
            s.decode_tokens_per_s(),
            common::human_bytes(s.kv_cache_bytes as u64)
        );
        if g.stop_reason == StopReason::ContextFull {
            eprintln!("note: the context is full; /reset to start over");
        }
        history.push(Message::new("assistant", g.text.trim()));
    }
    Ok(())
}
