//! The model's own greedy answers: the corpus draft heads train on (`train-heads`) and a
//! retrieval datastore holds (`build-store`). Drafters learn what the model says, so the
//! prompts should look like the requests it will serve: chat requests read from a file, or
//! drawn from passages of a text (a third raw text to continue, the rest chat requests about
//! the passage or one of its words).

use anyhow::{Result, ensure};
use frugal::chat::{ChatTemplate, Message};
use frugal::model::Model;
use frugal::tokenizer::Tokenizer;
use frugal_train::heads;

/// A prompt followed by the model's answer, and the prompt's length in tokens.
pub type Sequence = (Vec<u32>, usize);

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

/// Each request as a user message in the model's chat template, tokenized.
pub fn request_prompts(
    requests: &[&str],
    template: &ChatTemplate,
    tok: &Tokenizer,
) -> Result<Vec<Vec<u32>>> {
    requests.iter().map(|r| chat(r, template, tok)).collect()
}

fn chat(request: &str, template: &ChatTemplate, tok: &Tokenizer) -> Result<Vec<u32>> {
    let text = template.render(&[Message::new("user", request)], true)?;
    Ok(tok.encode(&text, true)?)
}

/// `n` prompts drawn from passages of ~48 tokens spread over `text`: a third raw text to
/// continue, the others chat requests about the passage or about one of its words, so the
/// drafters mostly see the model answering as an assistant, the way it is used.
pub fn passage_prompts(
    text: &str,
    n: usize,
    template: &ChatTemplate,
    tok: &Tokenizer,
) -> Result<Vec<Vec<u32>>> {
    let ids = tok.encode(text, false)?;
    ensure!(
        ids.len() >= 64,
        "the text is too short to draw prompts from ({} tokens, 64 needed)",
        ids.len()
    );
    let span = 48.min(ids.len());
    let stride = ((ids.len() - span) / n).max(1);
    let mut prompts = Vec::with_capacity(n);
    for i in 0..n {
        let at = (i * stride) % (ids.len() - span + 1);
        let passage = &ids[at..at + span];
        let prompt = match request_about(&tok.decode(passage), i) {
            None => passage.to_vec(),
            Some(r) => chat(&r, template, tok)?,
        };
        prompts.push(prompt);
    }
    Ok(prompts)
}

/// The `i`-th prompt's chat request about `passage`, or `None` for raw text (every third).
fn request_about(passage: &str, i: usize) -> Option<String> {
    match i % 3 {
        0 => None,
        1 => Some(format!("{}\n\n{passage}", ASKS[(i / 3) % ASKS.len()])),
        _ => {
            let words: Vec<&str> = passage
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
    }
}

/// The model's greedy answers of `gen_len` tokens to `prompts` (16 at a time, each stopping at
/// an end of generation); `progress` gets the tokens generated so far.
pub fn generate(
    model: &Model,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    gen_len: usize,
    progress: impl FnMut(usize),
) -> Result<Vec<Sequence>> {
    let eog = |t: u32| tok.is_end_of_generation(t);
    Ok(heads::generate_corpus(
        model, prompts, gen_len, 16, &eog, progress,
    )?)
}

/// Whether `seqs` fit a model of `n_vocab` tokens: every id in range, every prompt at least one
/// token (its last position is the first trained) and no longer than its sequence.
pub fn fits(seqs: &[Sequence], n_vocab: usize) -> bool {
    seqs.iter()
        .all(|(s, p)| (1..=s.len()).contains(p) && s.iter().all(|&t| (t as usize) < n_vocab))
}
