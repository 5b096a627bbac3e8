//! The last lever: speculative decoding, paired with the chosen model on the user's kind of
//! prompt.
//!
//! Speculation changes how a file runs, not the file, and its output is exactly the plain
//! output (greedy here, and checked), so it costs no quality; whether it pays depends on the
//! prompts. Prompt lookup pays where the answer copies the prompt, an early exit or a draft
//! model where the drafts agree with the model and cost little next to a verification pass.
//! So each drafter is timed on the user's prompts (`--prompts`, else windows of the evaluation
//! text), plain and speculative generation alternating prompt by prompt with the base's plain
//! generation, and taken only at a measured speed-up of [`REWARD`] or more.

use std::path::Path;

use anyhow::{Context, Result, ensure};
use frugal::attention::Attention;
use frugal::bench::median;
use frugal::generate::{GenerateOptions, Session};
use frugal::kv::KvOptions;
use frugal::model::Model;
use frugal::sample::SamplerParams;
use frugal::speculate::{SpecOptions, Speculator};
use frugal::tokenizer::Tokenizer;
use serde::{Deserialize, Serialize};

use super::recipe::Recipe;

/// The speed-up over plain decoding a drafter must show to be paired (the same bar as a cut:
/// below it the gain is within a shared machine's drift).
pub const REWARD: f64 = 1.04;

/// Tokens generated per prompt and run.
pub const GEN_TOKENS: usize = 64;

/// Prompts cut from the evaluation text when none are given, and their length in tokens.
const EVAL_PROMPTS: usize = 3;
const EVAL_PROMPT_TOKENS: usize = 128;

/// The line that separates prompts in a `--prompts` file.
pub const SEPARATOR: &str = "---";

/// One drafter tried with the chosen model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trial {
    /// As `--speculate` takes it (`draft:draft.gguf` for a draft built from a point).
    pub drafter: String,
    /// The chosen point it was tried with.
    pub target: String,
    /// Decode speed with speculation over the chosen model's plain decode, median of rounds.
    pub speedup: f64,
    /// The same over the base's plain decode.
    pub over_base: f64,
    /// Share of drafted tokens kept.
    pub acceptance: f64,
    /// Tokens chosen per target pass.
    pub tokens_per_pass: f64,
    pub plain_tok_s: f64,
    pub spec_tok_s: f64,
    pub base_tok_s: f64,
    /// At or above [`REWARD`] and the best of the trials.
    pub taken: bool,
}

/// The pairing written into `recipe.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Pairing {
    /// As `--speculate` takes it.
    pub drafter: String,
    /// The draft model's recipe, for a `draft:` drafter (rebuilt into `draft.gguf`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft: Option<Recipe>,
    pub speedup: f64,
}

/// A drafter to try: the `--speculate` text, and for a draft model the point it is built from.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub drafter: String,
    pub draft_key: Option<String>,
}

/// The file name a paired draft model is written under, beside `model.gguf`.
pub const DRAFT_FILE: &str = "draft.gguf";

/// Prompt lookup, and early exits after a quarter and after half of the layers (a model too
/// shallow for one gets none).
pub fn drafters(n_layers: usize) -> Vec<Candidate> {
    let mut out = vec![Candidate {
        drafter: "ngram".to_string(),
        draft_key: None,
    }];
    let mut exits: Vec<usize> = vec![n_layers / 4, n_layers / 2];
    exits.retain(|&l| l >= 1 && l < n_layers);
    exits.dedup();
    out.extend(exits.into_iter().map(|l| Candidate {
        drafter: format!("self:{l}"),
        draft_key: None,
    }));
    out
}

/// The user's prompts: the `---`-separated prompts of `path`, or windows of `eval` (the text
/// the user evaluates on stands for what they run). Each prompt leaves room for
/// [`GEN_TOKENS`] in the model's context of `n_ctx`.
pub fn prompts(
    path: Option<&Path>,
    tok: &Tokenizer,
    eval: &[u32],
    n_ctx: usize,
) -> Result<Vec<Vec<u32>>> {
    let room = n_ctx.saturating_sub(GEN_TOKENS + 1);
    let Some(path) = path else {
        let len = EVAL_PROMPT_TOKENS.min(room).min(eval.len());
        ensure!(
            len >= 1,
            "no room for a prompt: the context of {n_ctx} holds only the {GEN_TOKENS} generated tokens"
        );
        let stride = (eval.len() - len) / EVAL_PROMPTS;
        return Ok((0..EVAL_PROMPTS)
            .map(|i| eval[i * stride..i * stride + len].to_vec())
            .collect());
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines().chain(std::iter::once(SEPARATOR)) {
        if line.trim() == SEPARATOR {
            let p = cur.trim();
            if !p.is_empty() {
                out.push(tok.encode(p, true)?);
            }
            cur.clear();
        } else {
            cur.push_str(line);
            cur.push('\n');
        }
    }
    ensure!(
        !out.is_empty(),
        "{}: no prompt (prompts are separated by lines holding only {SEPARATOR})",
        path.display()
    );
    if let Some((i, p)) = out.iter().enumerate().find(|(_, p)| p.len() > room) {
        anyhow::bail!(
            "{}: prompt {} has {} tokens; with the {GEN_TOKENS} generated it exceeds the model's context of {n_ctx}",
            path.display(),
            i + 1,
            p.len()
        );
    }
    Ok(out)
}

/// How a model runs in the trial.
pub struct Runner<'a> {
    pub model: &'a Model,
    pub kv: KvOptions,
}

/// Times `drafter` (with `draft` as its model, for a draft drafter) on `prompts`: per round,
/// prompt by prompt, the base plain, the chosen model plain and the chosen model speculative,
/// in an order that turns with the round. Fails if speculation changed a token.
pub fn trial(
    base: &Runner,
    chosen: &Runner,
    cand: &Candidate,
    draft: Option<Model>,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    rounds: usize,
) -> Result<Trial> {
    let opts: SpecOptions = cand
        .drafter
        .parse()
        .map_err(|e: String| anyhow::anyhow!(e))?;
    let options = GenerateOptions {
        max_tokens: GEN_TOKENS,
        stop: Vec::new(),
        sampler: SamplerParams::greedy(),
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let ctx = longest + GEN_TOKENS + 1;
    let mut spec = Speculator::new(
        chosen.model,
        ctx,
        &chosen.kv,
        Attention::default(),
        &opts,
        draft,
    )?;
    let (mut ratios, mut over_base) = (Vec::new(), Vec::new());
    let (mut plain_rate, mut spec_rate, mut base_rate) = (Vec::new(), Vec::new(), Vec::new());
    let (mut drafted, mut accepted, mut passes, mut chosen_tokens) = (0, 0, 0, 0);
    for round in 0..rounds.max(1) {
        // Seconds and tokens: base plain, chosen plain, chosen speculative.
        let mut secs = [0.0f64; 3];
        let mut toks = [0usize; 3];
        for (i, p) in prompts.iter().enumerate() {
            let mut plain_tokens = None;
            let mut spec_tokens = None;
            for turn in 0..3 {
                match (turn + round + i) % 3 {
                    j @ (0 | 1) => {
                        let r = if j == 0 { base } else { chosen };
                        let mut s =
                            Session::with_options(r.model, ctx, true, &r.kv, Attention::default())?;
                        let g = s.generate(tok, p, &options, |_| {})?;
                        secs[j] += g.stats.decode_seconds;
                        toks[j] += g.stats.decode_tokens;
                        if j == 1 {
                            plain_tokens = Some(g.tokens);
                        }
                    }
                    _ => {
                        let (g, st) = spec.generate(tok, p, &options, |_| {})?;
                        secs[2] += g.stats.decode_seconds;
                        toks[2] += g.stats.decode_tokens;
                        if round == 0 {
                            drafted += st.drafted;
                            accepted += st.accepted;
                            passes += st.passes;
                            chosen_tokens += g.stats.decode_tokens;
                        }
                        spec_tokens = Some(g.tokens);
                    }
                }
            }
            ensure!(
                plain_tokens == spec_tokens,
                "speculative decoding with {} changed the output of prompt {i}: a bug, not a trade-off",
                cand.drafter
            );
        }
        let rate = |j: usize| toks[j] as f64 / secs[j].max(1e-9);
        base_rate.push(rate(0));
        plain_rate.push(rate(1));
        spec_rate.push(rate(2));
        ratios.push(rate(2) / rate(1));
        over_base.push(rate(2) / rate(0));
    }
    Ok(Trial {
        drafter: cand.drafter.clone(),
        target: String::new(),
        speedup: median(&ratios),
        over_base: median(&over_base),
        acceptance: accepted as f64 / drafted.max(1) as f64,
        tokens_per_pass: chosen_tokens as f64 / passes.max(1) as f64,
        plain_tok_s: median(&plain_rate),
        spec_tok_s: median(&spec_rate),
        base_tok_s: median(&base_rate),
        taken: false,
    })
}

/// Marks the best trial at or above `reward` as taken and returns it.
pub fn choose(trials: &mut [Trial], reward: f64) -> Option<&Trial> {
    let best = trials
        .iter()
        .enumerate()
        .filter(|(_, t)| t.speedup >= reward)
        .max_by(|a, b| a.1.speedup.total_cmp(&b.1.speedup))
        .map(|(i, _)| i)?;
    trials[best].taken = true;
    Some(&trials[best])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, speedup: f64) -> Trial {
        Trial {
            drafter: name.into(),
            target: String::new(),
            speedup,
            over_base: speedup,
            acceptance: 0.5,
            tokens_per_pass: 1.5,
            plain_tok_s: 1.0,
            spec_tok_s: speedup,
            base_tok_s: 1.0,
            taken: false,
        }
    }

    #[test]
    fn the_fastest_drafter_over_the_bar_is_taken() {
        let mut ts = vec![t("ngram", 1.02), t("self:4", 1.30), t("self:8", 1.10)];
        assert_eq!(choose(&mut ts, REWARD).unwrap().drafter, "self:4");
        assert_eq!(
            ts.iter().map(|t| t.taken).collect::<Vec<_>>(),
            [false, true, false]
        );
        let mut slow = vec![t("ngram", 1.03), t("self:4", 0.8)];
        assert!(choose(&mut slow, REWARD).is_none());
        assert!(slow.iter().all(|t| !t.taken));
    }

    #[test]
    fn drafters_leave_out_exits_a_model_cannot_take() {
        let names = |n| {
            drafters(n)
                .into_iter()
                .map(|c| c.drafter)
                .collect::<Vec<_>>()
        };
        assert_eq!(names(30), ["ngram", "self:7", "self:15"]);
        assert_eq!(names(2), ["ngram", "self:1"]);
        assert_eq!(names(1), ["ngram"]);
    }
}
