//! The model's own greedy answers, the corpus that draft heads train on (`train-heads`) and that
//! a retrieval datastore holds (`build-store`): generated from chat requests or from passages of a
//! text, or read back from a generations file.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use frugal::chat::{ChatTemplate, Message};
use frugal::model::Model;
use frugal::tokenizer::Tokenizer;
use frugal_train::heads;

use super::train::parse_count;

/// Chat requests about a passage, and about one of its words.
const ASKS: [&str; 3] = [
    "Summarize this text:",
    "Explain this in simple words:",
    "What questions does this text raise?",
];
const TOPICS: [&str; 16] = [
    "Write a short story about",
    "Explain to a ten-year-old what this is:",
    "Give me five tips about",
    "Write a poem about",
    "What are the pros and cons of",
    "Describe the history of",
    "Write a friendly email to a colleague about",
    "List three common mistakes people make with",
    "How would you teach a beginner about",
    "Write a product description for something called",
    "Compare two different approaches to",
    "Write a dialogue between two friends about",
    "What is the most interesting fact about",
    "Give step-by-step instructions involving",
    "Write a short news report about",
    "Answer briefly: why does anyone care about",
];

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
    pub fn sequences(&self, model: &Model, tok: &Tokenizer) -> Result<Vec<(Vec<u32>, usize)>> {
        let tokens = parse_count(&self.tokens)?;
        anyhow::ensure!(self.gen_len > 0, "--gen must be at least 1");
        if let Some(p) = self.generations.as_ref().filter(|p| p.exists()) {
            let json =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let seqs: Vec<(Vec<u32>, usize)> = serde_json::from_str(&json)
                .with_context(|| format!("{}: not a generations file", p.display()))?;
            let n_vocab = model.config.n_vocab;
            anyhow::ensure!(
                seqs.iter()
                    // A prompt of at least one token: its last position is the first trained.
                    .all(|(s, p)| (1..=s.len()).contains(p)
                        && s.iter().all(|&t| (t as usize) < n_vocab)),
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
) -> Result<Vec<(Vec<u32>, usize)>> {
    let template = ChatTemplate::from_gguf(&model.file)?;
    let n_prompts = tokens.div_ceil(a.gen_len).max(1);
    let prompts = match &a.prompts {
        Some(p) => request_prompts(p, n_prompts, &template, tok)?,
        None => passage_prompts(&a.data, n_prompts, &template, tok)?,
    };
    let t0 = Instant::now();
    let eog = |t: u32| tok.is_end_of_generation(t);
    let mut last = Instant::now();
    let seqs = heads::generate_corpus(model, &prompts, a.gen_len, 16, &eog, |n| {
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

/// Up to `n` chat prompts, one per non-empty line of `path`, each a user message.
fn request_prompts(
    path: &std::path::Path,
    n: usize,
    template: &ChatTemplate,
    tok: &Tokenizer,
) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let requests: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .take(n)
        .collect();
    anyhow::ensure!(
        !requests.is_empty(),
        "{}: no requests (one per line)",
        path.display()
    );
    if requests.len() < n {
        eprintln!(
            "{}: {} requests, fewer than the {n} that --tokens asks for; using each once",
            path.display(),
            requests.len()
        );
    }
    requests
        .iter()
        .map(|r| {
            let chat = template.render(&[Message::new("user", r)], true)?;
            Ok(tok.encode(&chat, true)?)
        })
        .collect()
}

/// `n` prompts drawn from passages of ~48 tokens spread over the `data` texts: a third raw
/// text to continue, the others chat requests about the passage or one of its words.
fn passage_prompts(
    data: &[PathBuf],
    n: usize,
    template: &ChatTemplate,
    tok: &Tokenizer,
) -> Result<Vec<Vec<u32>>> {
    let mut text = String::new();
    for p in data {
        text.push_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        );
        text.push('\n');
    }
    let ids = tok.encode(&text, false)?;
    anyhow::ensure!(
        ids.len() >= 64,
        "the --data text is too short to draw prompts from"
    );
    let span = 48.min(ids.len());
    let stride = ((ids.len() - span) / n).max(1);
    let mut prompts = Vec::with_capacity(n);
    for i in 0..n {
        let at = (i * stride) % (ids.len() - span + 1);
        let passage = &ids[at..at + span];
        // A third of the prompts: raw text to continue; the others chat requests, about the
        // passage or about one of its words, so the heads mostly see the model answering as an
        // assistant, the way it is used.
        let msg = tok.decode(passage);
        let request = match i % 3 {
            0 => None,
            1 => Some(format!("{}\n\n{msg}", ASKS[(i / 3) % ASKS.len()])),
            _ => {
                let words: Vec<&str> = msg
                    .split(|c: char| !c.is_alphabetic())
                    .filter(|w| w.len() >= 5)
                    .collect();
                let word = words
                    .get((i / 3) % words.len().max(1))
                    .copied()
                    .unwrap_or("time");
                Some(format!(
                    "{} {}",
                    TOPICS[(i / 3) % TOPICS.len()],
                    word.to_lowercase()
                ))
            }
        };
        match request {
            None => prompts.push(passage.to_vec()),
            Some(r) => {
                let chat = template.render(&[Message::new("user", &r)], true)?;
                prompts.push(tok.encode(&chat, true)?);
            }
        }
    }
    Ok(prompts)
}
