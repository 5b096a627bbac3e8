//! The OpenAI request bodies as serde reads them.
//!
//! These types only say which fields exist and their JSON types; [`crate::validate`] reads a
//! body, refuses the fields they do not have (naming them), decodes them, and checks every
//! value's range. Optional fields are `Option`s so that `null` means "the default", as in
//! OpenAI's API.

use serde::Deserialize;
use serde_json::{Map, Value};

/// `stop`: one string or a list of them.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged, expecting = "a string or a list of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
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
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's and llama-server's extensions, which benchmarks send: never end at the
    /// end-of-text token, or not before `min_tokens`.
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    /// Structured output (see [`crate::structured`]): OpenAI's `response_format`, or
    /// llama-server's bare `json_schema`.
    pub response_format: Option<serde_json::Value>,
    pub json_schema: Option<serde_json::Value>,
}

/// A chat message; `content` is a string or a list of text parts. `extra` holds the fields
/// OpenAI's messages have and this server does not implement (`name`, `tool_calls`, ...), so
/// validation can refuse them by name.
#[derive(Deserialize, Debug, Clone)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// An assistant turn's calls, a tool result's call id and a tool's name (see [`crate::tools`]).
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
#[serde(untagged, expecting = "a string or a list of content parts")]
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
    /// An image part's `image_url` and the like: refused by validation.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl ChatMessage {
    /// The message's text: a string, or its text parts joined (validation has refused other
    /// parts; here they contribute nothing).
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter(|p| p.kind == "text")
                .filter_map(|p| p.text.as_deref())
                .collect(),
        }
    }
}

/// `/v1/chat/completions`. `common` is decoded from the same body by validation (serde's
/// `flatten` would hide the field names validation needs).
#[derive(Deserialize, Debug, Clone)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    #[serde(skip)]
    pub common: Common,
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
}

/// `prompt`: a string, a list of one string, or token ids.
#[derive(Deserialize, Debug, Clone)]
#[serde(
    untagged,
    expecting = "a string, a list of strings, a list of token ids or a list of lists of token ids"
)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// `/v1/completions`; `common` as in [`ChatRequest`].
#[derive(Deserialize, Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub logprobs: Option<i64>,
    #[serde(skip)]
    pub common: Common,
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

/// `/v1/embeddings`: `input` takes the shapes of `prompt`, one embedding per string or list of
/// token ids.
#[derive(Deserialize, Debug, Clone)]
pub struct EmbeddingRequest {
    pub input: Prompt,
    pub model: Option<String>,
    pub encoding_format: Option<String>,
    pub dimensions: Option<i64>,
}

/// `/v1/responses`: the text fields of OpenAI's Responses API.
#[derive(Deserialize, Debug, Clone)]
pub struct ResponsesRequest {
    pub input: ResponseInput,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub stream: Option<bool>,
    pub model: Option<String>,
}

/// `input`: a user message's text, or a list of input items.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged, expecting = "a string or a list of input items")]
pub enum ResponseInput {
    Text(String),
    Items(Vec<InputItem>),
}

/// An input item; validation accepts message items only (`extra` holds the fields it names).
#[derive(Deserialize, Debug, Clone)]
pub struct InputItem {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}
