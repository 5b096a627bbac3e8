//! The OpenAI request bodies, and their validation into what the scheduler runs.
//!
//! Fields the server does not know are accepted and ignored (benchmarks send extras such as
//! `ignore_eos` or `repetition_penalty`); fields it knows are type-checked, and a wrong type or
//! an out-of-range value is a 400 naming the field.

use serde::Deserialize;

use crate::error::ApiError;
use frugal::sample::SamplerParams;

/// `stop`: one string or a list of them.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Clone, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and length fields both endpoints share.
#[derive(Deserialize, Debug, Clone, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's and llama-server's extensions, which benchmarks send: never end at the
    /// end-of-text token, or not before `min_tokens`.
    #[serde(default)]
    pub ignore_eos: bool,
    pub min_tokens: Option<i64>,
    /// Structured output (see [`crate::structured`]): OpenAI's `response_format`, or
    /// llama-server's bare `json_schema`.
    pub response_format: Option<serde_json::Value>,
    pub json_schema: Option<serde_json::Value>,
}

/// A chat message; `content` is a string or a list of text parts.
#[derive(Deserialize, Debug, Clone)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls, a tool result's call id and a tool's name (see [`crate::tools`]).
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug, Clone)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

impl ChatMessage {
    /// The message's text: a string, or its text parts joined (other parts are refused).
    pub fn text(&self) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(t)) => Ok(t.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                format!(
                                    "content parts of type {kind:?} are not supported (only text)"
                                ),
                                Some("messages"),
                            ));
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Deserialize, Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: Common,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<i64>,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
}

/// `prompt`: a string, a list of one string, or token ids.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(flatten)]
    pub common: Common,
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub echo: bool,
}

#[derive(Deserialize, Debug, Clone)]
pub struct TokenizeRequest {
    pub content: String,
    #[serde(default)]
    pub add_special: bool,
}

#[derive(Deserialize, Debug, Clone)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

/// Parses a JSON body, turning serde's message into a 400 that names the problem.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof => {
                "malformed JSON"
            }
            _ => "invalid request",
        };
        ApiError::invalid(format!("{what}: {e}"), None)
    })
}

/// Sampling and limits validated.
#[derive(Clone, Debug)]
pub struct Sampling {
    pub params: SamplerParams,
    /// Requested `max_tokens`, if any.
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Generated tokens before which the end-of-text token cannot be sampled (`usize::MAX`
    /// with `ignore_eos`).
    pub min_tokens: usize,
}

/// Most choices per request.
pub const MAX_N: i64 = 16;

impl Common {
    /// Checks every sampling field's range; `parallel` bounds `n`.
    pub fn sampling(&self) -> Result<Sampling, ApiError> {
        let bad = |msg: String, param: &'static str| Err(ApiError::invalid(msg, Some(param)));
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => Some(("max_completion_tokens", v)),
            (None, Some(v)) => Some(("max_tokens", v)),
            (None, None) => None,
        };
        let max_tokens = match max_tokens {
            Some((name, v)) if v < 1 => {
                return bad(format!("{name} must be at least 1, got {v}"), name);
            }
            Some((_, v)) => Some(usize::try_from(v).unwrap_or(usize::MAX)),
            None => None,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return bad(
                format!("temperature must be in [0, 2], got {temperature}"),
                "temperature",
            );
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {top_p}"), "top_p");
        }
        let top_k = match self.top_k.unwrap_or(0) {
            // -1 is vLLM's "off".
            k if k <= 0 => 0,
            k => usize::try_from(k).unwrap_or(usize::MAX),
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return bad(format!("min_p must be in [0, 1], got {min_p}"), "min_p");
        }
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return bad(format!("n must be between 1 and {MAX_N}, got {n}"), "n");
        }
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return bad(
                format!("at most 4 stop sequences, got {}", stop.len()),
                "stop",
            );
        }
        let min_tokens = match (self.ignore_eos, self.min_tokens) {
            (true, _) => usize::MAX,
            (false, None) => 0,
            (false, Some(m)) if m < 0 => {
                return bad(
                    format!("min_tokens must be at least 0, got {m}"),
                    "min_tokens",
                );
            }
            (false, Some(m)) => usize::try_from(m).unwrap_or(usize::MAX),
        };
        if let (Some(max), true) = (max_tokens, min_tokens != usize::MAX && min_tokens > 0)
            && min_tokens > max
        {
            return bad(
                format!("min_tokens {min_tokens} exceeds max_tokens {max}"),
                "min_tokens",
            );
        }
        let seed = match self.seed {
            Some(s) => s as u64,
            None => rand_seed(),
        };
        let params = SamplerParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            seed,
        };
        params.validate().map_err(|e| ApiError::invalid(e, None))?;
        Ok(Sampling {
            params,
            max_tokens,
            n: n as usize,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            min_tokens,
        })
    }
}

/// A seed for a request that gave none: different for every request.
fn rand_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    t ^ COUNTER
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_are_ignored_and_wrong_types_named() {
        let r: CompletionRequest = parse(
            br#"{"model":"m","prompt":"hi","max_tokens":5,"ignore_eos":true,"repetition_penalty":1.0}"#,
        )
        .unwrap();
        assert_eq!(r.common.sampling().unwrap().max_tokens, Some(5));
        let e = parse::<CompletionRequest>(br#"{"prompt":"hi","max_tokens":"ten"}"#).unwrap_err();
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let e = parse::<CompletionRequest>(b"{\"prompt\": ").unwrap_err();
        assert!(e.message.starts_with("malformed JSON"), "{}", e.message);
        let r: ChatRequest = parse(br#"{"messages":[],"max_tokens":-3}"#).unwrap();
        assert!(r.common.sampling().is_err());
    }
}
