//! The model's own greedy answers, the corpus that draft heads train on (`train-heads`) and that
//! a retrieval datastore holds (`build-store`): generated from chat requests or from passages of a
//! text, or read back from a generations file.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use frugal::chat::ChatTemplate;
use frugal::model::Model;
use frugal::tokenizer::Tokenizer;
use frugal_lab::corpus::{self, Sequence};

use super::train::parse_count;

#[derive(clap::Args, Debug)]
pub struct CorpusArgs {
    /// Text whose passages prompt the generations (a third as raw text to continue, the rest
    /// as chat requests about the passage or one of its words)
    #[arg(long = "data", num_args = 1.., required_unless_present = "prompts", conflicts_with = "prompts")]
    pub data: Vec<PathBuf>,
    /// Chat requests, one per line, each answered by the model as a user message: the
    /// generations then follow the requests the model will serve (as EAGLE and Medusa heads
    /// train on ShareGPT conversations). Up to --tokens / --gen of them are used
    #[arg(long = "prompts", value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// Tokens the model generates (k and M suffixes)
    #[arg(long = "tokens", default_value = "100k")]
    pub tokens: String,
    /// Tokens generated per prompt
    #[arg(long = "gen", default_value_t = 128)]
    pub gen_len: usize,
    /// Keep the generations in this JSON file, and reuse them when it exists (train heads or
    /// build a datastore from the same answers without generating them again)
    #[arg(long = "generations", value_name = "FILE")]
    pub generations: Option<PathBuf>,
}

impl CorpusArgs {
    /// Each prompt followed by the model's greedy answer, and the prompt's length: read from
    /// `--generations` when that file exists (checked against the model's vocabulary), else
    /// generated (and saved there when it is given).
    pub fn sequences(&self, model: &Model, tok: &Tokenizer) -> Result<Vec<Sequence>> {
        let tokens = parse_count(&self.tokens)?;
        anyhow::ensure!(self.gen_len > 0, "--gen must be at least 1");
        if let Some(p) = self.generations.as_ref().filter(|p| p.exists()) {
            let json =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let seqs: Vec<Sequence> = serde_json::from_str(&json)
                .with_context(|| format!("{}: not a generations file", p.display()))?;
            anyhow::ensure!(
                corpus::fits(&seqs, model.config.n_vocab),
                "{}: holds token ids outside this model's vocabulary or bad prompt lengths",
                p.display()
            );
            eprintln!(
                "reusing {} generated sequences from {}",
                seqs.len(),
                p.display()
            );
            return Ok(seqs);
        }
        let seqs = generate(self, tokens, model, tok)?;
        if let Some(p) = &self.generations {
            std::fs::write(p, serde_json::to_string(&seqs)?)
                .with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(seqs)
    }
}

/// The model's greedy answers to its prompts (the `--prompts` requests, or passages of the
/// `--data` text): each prompt followed by its continuation, and the prompt's length.
fn generate(
    a: &CorpusArgs,
    tokens: usize,
    model: &Model,
    tok: &Tokenizer,
) -> Result<Vec<Sequence>> {
    let template = ChatTemplate::from_gguf(&model.file)?;
    let n_prompts = tokens.div_ceil(a.gen_len).max(1);
    let prompts = match &a.prompts {
        Some(p) => {
            let text = read(p)?;
            let requests: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .take(n_prompts)
                .collect();
            anyhow::ensure!(
                !requests.is_empty(),
                "{}: no requests (one per line)",
                p.display()
            );
            if requests.len() < n_prompts {
                eprintln!(
                    "{}: {} requests, fewer than the {n_prompts} that --tokens asks for; using each once",
                    p.display(),
                    requests.len()
                );
            }
            corpus::request_prompts(&requests, &template, tok)?
        }
        None => {
            let mut text = String::new();
            for p in &a.data {
                text.push_str(&read(p)?);
                text.push('\n');
            }
            corpus::passage_prompts(&text, n_prompts, &template, tok)
                .context("drawing prompts from the --data text")?
        }
    };
    let t0 = Instant::now();
    let mut last = Instant::now();
    let seqs = corpus::generate(model, tok, &prompts, a.gen_len, |n| {
        if last.elapsed().as_secs_f64() > 10.0 {
            eprintln!(
                "generating: {n} tokens ({:.0} s)",
                t0.elapsed().as_secs_f64()
            );
            last = Instant::now();
        }
    })?;
    let generated: usize = seqs.iter().map(|(s, p)| s.len() - p).sum();
    eprintln!(
        "generated {generated} tokens from {} prompts in {:.0} s",
        prompts.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(seqs)
}

fn read(p: &std::path::Path) -> Result<String> {
    std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
}
