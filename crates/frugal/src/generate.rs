//! The decoding loop: prefill the prompt, then sample, stream and feed back one token at a time.
//!
//! A [`Session`] owns the KV cache and scratch buffers so a chat can keep its cache between
//! turns: a new prompt that extends the cached tokens only prefills the new part. With the cache
//! disabled every step re-runs the whole sequence, which shows the quadratic cost the cache removes.

use std::time::Instant;

use crate::attention::Attention;
use crate::error::{Error, Result};
use crate::kv::{KvOptions, KvSequence, SeqCache};
use crate::model::{Logits, Model, RoutingStats, Scratch};
use crate::sample::{Sampler, SamplerParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub sampler: SamplerParams,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    MaxTokens,
    StopString,
    /// The context length was reached.
    ContextFull,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens actually run through the model (fewer when a chat reuses its cache).
    pub prefill_tokens: usize,
    pub generated_tokens: usize,
    /// Forward passes after the prefill (one token each, or a speculative draft's check).
    pub decode_steps: usize,
    /// Tokens those passes chose (equal to the passes without speculation).
    pub decode_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub kv_cache_bytes: usize,
}

impl GenerationStats {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_seconds.max(1e-9)
    }

    /// Decode speed: tokens chosen after the prefill (with sampling) per second.
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_seconds.max(1e-9)
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub stop_reason: StopReason,
    pub stats: GenerationStats,
}

pub struct Session<'m> {
    model: &'m Model,
    kv: SeqCache,
    scratch: Scratch,
    /// Tokens whose keys and values are in `kv`.
    cached: Vec<u32>,
    use_kv_cache: bool,
}

impl<'m> Session<'m> {
    /// A session with room for `ctx` tokens. Without the KV cache, every step recomputes the
    /// whole sequence (the cache is then only the scratch space of a single pass).
    pub fn new(model: &'m Model, ctx: usize, use_kv_cache: bool) -> Result<Self> {
        Self::with_options(
            model,
            ctx,
            use_kv_cache,
            &KvOptions::default(),
            Attention::default(),
        )
    }

    /// A session whose cache stores keys and values as `kv` says and whose attention is
    /// `attention`.
    pub fn with_options(
        model: &'m Model,
        ctx: usize,
        use_kv_cache: bool,
        kv: &KvOptions,
        attention: Attention,
    ) -> Result<Self> {
        Ok(Session {
            model,
            kv: model.new_seq_cache(ctx, kv)?,
            scratch: Scratch::new(attention),
            cached: Vec::new(),
            use_kv_cache,
        })
    }

    /// Starts counting how the router sends tokens to experts (a MoE model; nothing for a
    /// dense one): read them with [`Self::routing`].
    pub fn record_routing(&mut self) {
        if let Some(m) = self.model.config.moe {
            self.scratch.moe.stats =
                Some(RoutingStats::new(self.model.config.n_layers, m.n_expert));
        }
    }

    /// The routing counted since [`Self::record_routing`] (prompt and generated tokens).
    pub fn routing(&self) -> Option<&RoutingStats> {
        self.scratch.moe.stats.as_ref()
    }

    pub fn ctx(&self) -> usize {
        self.kv.capacity()
    }

    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes_in_use()
    }

    /// Runs `new` tokens after those cached; returns the last position's logits.
    fn feed(&mut self, new: &[u32]) -> Result<&[f32]> {
        if self.use_kv_cache {
            self.cached.extend_from_slice(new);
            self.model
                .forward(new, &mut self.kv, &mut self.scratch, Logits::Last)
        } else {
            self.cached.extend_from_slice(new);
            self.kv.clear();
            self.model
                .forward(&self.cached, &mut self.kv, &mut self.scratch, Logits::Last)
        }
    }

    /// Generates a continuation of `prompt`, calling `on_text` with each piece of text as soon
    /// as it is complete. Cached tokens shared with `prompt` are reused.
    pub fn generate(
        &mut self,
        tok: &Tokenizer,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation> {
        check_prompt(prompt, self.ctx(), opts)?;
        // Reuse the longest cached prefix, but always run at least the last prompt token.
        let keep = if self.use_kv_cache {
            reusable_prefix(&self.cached, prompt)
        } else {
            0
        };
        // A sliding-window ring cannot go back past what it still holds: then start over.
        let keep = if keep < self.kv.rewind_floor() {
            0
        } else {
            keep
        };
        self.kv.truncate(keep);
        self.cached.truncate(keep);

        let mut stats = GenerationStats {
            prompt_tokens: prompt.len(),
            prefill_tokens: prompt.len() - keep,
            ..Default::default()
        };
        let mut sampler = Sampler::new(opts.sampler.clone());
        let mut out = Emitter::new(tok, prompt, opts, self.ctx());

        let t0 = Instant::now();
        let mut next = {
            let logits = self.feed(&prompt[keep..])?;
            sampler.sample_with(logits, out.history(), out.generated())
        };
        stats.prefill_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let stop_reason = loop {
            if let Some(stop) = out.push(next, &mut on_text) {
                break stop;
            }
            let logits = self.feed(&[next])?;
            next = sampler.sample_with(logits, out.history(), out.generated());
            stats.decode_steps += 1;
            stats.decode_tokens += 1;
        };
        stats.decode_seconds = t1.elapsed().as_secs_f64();
        stats.kv_cache_bytes = self.kv.bytes_in_use();
        Ok(out.finish(stop_reason, stats, &mut on_text))
    }
}

/// How many leading tokens of `cached` a new pass over `tokens` (not empty) can keep: their
/// common prefix, less the last token of `tokens`, which must run to give its logits.
pub fn reusable_prefix(cached: &[u32], tokens: &[u32]) -> usize {
    let common = cached
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count();
    common.min(tokens.len().saturating_sub(1))
}

/// A prompt must hold at least one token and fit the context, and the sampler settings must be
/// in range.
pub fn check_prompt(prompt: &[u32], ctx: usize, opts: &GenerateOptions) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::EmptyInput);
    }
    if prompt.len() > ctx {
        return Err(Error::PromptTooLong {
            prompt: prompt.len(),
            ctx,
        });
    }
    opts.sampler.validate().map_err(Error::Invalid)
}

/// The output side of a decoding loop, shared by plain and speculative decoding so both stop at
/// the same token for the same reason: takes generated tokens one at a time, streams their text
/// (held back while it could be the start of a stop string), and says when generation ends.
pub struct Emitter<'t> {
    tok: &'t Tokenizer,
    max_tokens: usize,
    ctx: usize,
    prompt_len: usize,
    /// The prompt and every generated token.
    history: Vec<u32>,
    text: String,
    decoder: StreamDecoder,
    stop_filter: StopFilter,
}

impl<'t> Emitter<'t> {
    pub fn new(tok: &'t Tokenizer, prompt: &[u32], opts: &GenerateOptions, ctx: usize) -> Self {
        Emitter {
            tok,
            max_tokens: opts.max_tokens,
            ctx,
            prompt_len: prompt.len(),
            history: prompt.to_vec(),
            text: String::new(),
            decoder: StreamDecoder::default(),
            stop_filter: StopFilter::new(&opts.stop),
        }
    }

    /// The prompt followed by the tokens generated so far.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// The tokens generated so far.
    pub fn generated(&self) -> &[u32] {
        &self.history[self.prompt_len..]
    }

    /// Takes the next generated token; returns why generation stops, if it does. An
    /// end-of-generation token stops before it is kept. The context is full once every
    /// position holds a token the model has seen, that is when the token just kept would have
    /// nowhere to go.
    pub fn push(&mut self, token: u32, on_text: &mut impl FnMut(&str)) -> Option<StopReason> {
        if self.tok.is_end_of_generation(token) {
            return Some(StopReason::EndOfGeneration);
        }
        self.history.push(token);
        let piece = self.decoder.push(self.tok.token_bytes(token, false));
        let (emit, hit) = self.stop_filter.push(&piece);
        self.text.push_str(&emit);
        on_text(&emit);
        if hit {
            return Some(StopReason::StopString);
        }
        if self.history.len() - self.prompt_len >= self.max_tokens {
            return Some(StopReason::MaxTokens);
        }
        // Positions the model has run: the prompt and every kept token but the last.
        if self.history.len() > self.ctx {
            return Some(StopReason::ContextFull);
        }
        None
    }

    /// Flushes held-back text and returns the generation.
    pub fn finish(
        mut self,
        stop_reason: StopReason,
        mut stats: GenerationStats,
        on_text: &mut impl FnMut(&str),
    ) -> Generation {
        if stop_reason != StopReason::StopString {
            let rest = self.decoder.finish();
            let (mut emit, _) = self.stop_filter.push(&rest);
            emit.push_str(&self.stop_filter.flush());
            self.text.push_str(&emit);
            on_text(&emit);
        }
        let tokens = self.history.split_off(self.prompt_len);
        stats.generated_tokens = tokens.len();
        Generation {
            text: self.text,
            tokens,
            stop_reason,
            stats,
        }
    }
}

/// Holds back text that could be the start of a stop string, and reports when one completes.
#[derive(Clone, Debug)]
pub struct StopFilter {
    stops: Vec<String>,
    held: String,
}

impl StopFilter {
    pub fn new(stops: &[String]) -> Self {
        StopFilter {
            stops: stops.to_vec(),
            held: String::new(),
        }
    }

    /// Returns the text safe to emit and whether a stop string was found (text from the stop
    /// string on is dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let first_hit = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_hit {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                let suffix = &self.held[i..];
                if suffix.len() > keep && s.starts_with(suffix) {
                    keep = suffix.len();
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The text held back, once generation has ended without a stop string.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_prefixes_and_cuts_at_the_stop() {
        let stops = vec!["\n\nUser:".to_string()];
        let mut f = StopFilter::new(&stops);
        assert_eq!(f.push("Hello"), ("Hello".into(), false));
        assert_eq!(f.push(" there\n"), (" there".into(), false));
        assert_eq!(f.push("\nUs"), ("".into(), false));
        assert_eq!(f.push("er: hi"), ("".into(), true));
        let mut f = StopFilter::new(&stops);
        assert_eq!(f.push("a\n"), ("a".into(), false));
        assert_eq!(f.push("b"), ("\nb".into(), false));
    }
}
