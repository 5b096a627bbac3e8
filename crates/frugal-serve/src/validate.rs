//! What a request may say. Every field of OpenAI's chat completions, completions, embeddings and
//! responses requests is either honoured or refused with a 400 whose `param` names it; nothing
//! is dropped silently.
//!
//! A body is read as a JSON object and its keys are sorted into four kinds:
//! - honoured: the fields of the request types in [`crate::api`] (found from their `Deserialize`
//!   impls, so adding a field there is all it takes to honour it);
//! - accepted and ignored: [`IGNORED`], fields that change nothing a client can observe;
//! - not supported: OpenAI fields this server does not implement ([`CHAT_UNSUPPORTED`],
//!   [`COMPLETION_UNSUPPORTED`], [`MESSAGE_UNSUPPORTED`], [`RESPONSES_UNSUPPORTED`]), refused as "not supported by this
//!   server" unless `null` or a value that asks for nothing (`echo: false`);
//! - anything else: "unknown field".
//!
//! Then the body is decoded (a wrong type names the field's path, `messages[0].content`) and
//! every value is range-checked: [`Common::sampling`], [`messages`], the log-probability fields.

use frugal::sample::SamplerParams;
use serde::Deserializer;
use serde::de::{DeserializeOwned, Visitor};
use serde_json::{Map, Value};

use crate::api::{
    ChatMessage, ChatRequest, Common, CompletionRequest, Content, EmbeddingRequest, Prompt, Stop,
};
use crate::error::ApiError;

/// An OpenAI request field this server does not implement.
pub struct Unsupported {
    pub name: &'static str,
    /// JSON values that ask for nothing beyond what the server does (the API's defaults, such
    /// as `false` for `echo`): accepted. `null` always is.
    pub no_op: &'static [&'static str],
    /// Why, for the error message (may be empty).
    pub why: &'static str,
}

const fn refuse(name: &'static str, why: &'static str) -> Unsupported {
    Unsupported {
        name,
        no_op: &[],
        why,
    }
}

const fn refuse_unless(
    name: &'static str,
    no_op: &'static [&'static str],
    why: &'static str,
) -> Unsupported {
    Unsupported { name, no_op, why }
}

const FUNCTIONS: &str = "the deprecated functions API: use tools";

/// The fields of `/v1/chat/completions` this server does not implement. Implementing one means
/// deleting its line here and adding the field to [`ChatRequest`] or [`Common`] (a test fails
/// while a name is in both).
pub const CHAT_UNSUPPORTED: &[Unsupported] = &[
    refuse_unless(
        "parallel_tool_calls",
        &["true"],
        "a forced call is one call; with tool_choice auto the model may make several",
    ),
    refuse("functions", FUNCTIONS),
    refuse_unless("function_call", &["\"none\""], FUNCTIONS),
    refuse_unless("logit_bias", &["{}"], ""),
    refuse("audio", "the server answers in text only"),
    refuse_unless(
        "modalities",
        &[r#"["text"]"#],
        "the server answers in text only",
    ),
    refuse("prediction", "predicted outputs are not implemented"),
    refuse_unless("store", &["false"], "completions are not stored"),
    refuse_unless("service_tier", &["\"auto\"", "\"default\""], ""),
    refuse("reasoning_effort", ""),
    refuse("verbosity", ""),
    refuse("web_search_options", ""),
    refuse_unless(
        "repetition_penalty",
        &["1"],
        "vLLM's extension; presence_penalty and frequency_penalty are honoured",
    ),
];

/// The fields of `/v1/completions` this server does not implement (see [`CHAT_UNSUPPORTED`]).
pub const COMPLETION_UNSUPPORTED: &[Unsupported] = &[
    refuse_unless("best_of", &["1"], ""),
    refuse_unless("echo", &["false"], ""),
    refuse_unless("suffix", &["\"\""], "insertion is not implemented"),
    refuse_unless("logit_bias", &["{}"], ""),
    refuse_unless(
        "repetition_penalty",
        &["1"],
        "vLLM's extension; presence_penalty and frequency_penalty are honoured",
    ),
];

/// The fields of `/v1/embeddings` this server does not implement: none (OpenAI's request has
/// `input`, `model`, `encoding_format`, `dimensions` and `user`).
pub const EMBEDDING_UNSUPPORTED: &[Unsupported] = &[];

const STATELESS: &str = "the server is stateless: it stores no responses or conversations";
/// Tools are honoured on `/v1/chat/completions`, not yet on `/v1/responses`.
const TOOLS: &str = "tools are honoured on /v1/chat/completions, not on /v1/responses";

/// The fields of `/v1/responses` this server does not implement (see [`CHAT_UNSUPPORTED`]).
/// `store` may be `false` or absent: the official clients send it only when the caller sets it,
/// so an absent `store` means this server's stateless default, not OpenAI's server-side `true`.
pub const RESPONSES_UNSUPPORTED: &[Unsupported] = &[
    refuse_unless("store", &["false"], STATELESS),
    refuse("previous_response_id", STATELESS),
    refuse("conversation", STATELESS),
    refuse_unless("background", &["false"], STATELESS),
    refuse("prompt", STATELESS),
    refuse("context_management", STATELESS),
    refuse("tools", TOOLS),
    refuse_unless("tool_choice", &["\"none\""], TOOLS),
    refuse("parallel_tool_calls", TOOLS),
    refuse("max_tool_calls", TOOLS),
    refuse_unless(
        "text",
        &["{}", r#"{"format": {"type": "text"}}"#],
        "structured output is not implemented",
    ),
    refuse_unless(
        "reasoning",
        &["{}"],
        "the server does not separate reasoning",
    ),
    refuse_unless("include", &["[]"], ""),
    refuse_unless(
        "truncation",
        &["\"disabled\""],
        "an input longer than the context is refused, never truncated",
    ),
    refuse(
        "top_logprobs",
        "log-probabilities are not implemented on this endpoint",
    ),
    refuse_unless(
        "stream_options",
        &["{}", r#"{"include_obfuscation": false}"#],
        "stream obfuscation is not implemented",
    ),
    refuse_unless("service_tier", &["\"auto\"", "\"default\""], ""),
    refuse("moderation", ""),
    refuse("prompt_cache_options", ""),
    refuse_unless("prompt_cache_retention", &["\"in_memory\""], ""),
];

/// The fields of a chat message besides `role` and `content` this server does not implement.
pub const MESSAGE_UNSUPPORTED: &[Unsupported] = &[
    refuse("function_call", FUNCTIONS),
    refuse("refusal", ""),
    refuse("audio", "the server reads text only"),
];

/// Fields accepted and ignored on both endpoints: they label a request for the provider's
/// bookkeeping (abuse monitoring, stored-completion metadata, cache routing: this server's prefix
/// cache needs no hint) and change nothing in the answer.
pub const IGNORED: &[&str] = &["user", "safety_identifier", "prompt_cache_key", "metadata"];

/// Most choices per request.
pub const MAX_N: i64 = 16;
/// Most alternatives per token: OpenAI's limits for chat (`top_logprobs`) and completions
/// (`logprobs`).
pub const MAX_TOP_LOGPROBS: i64 = 20;
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;
/// OpenAI's limit on stop sequences.
pub const MAX_STOP: usize = 4;
/// OpenAI's limit on the inputs of one embeddings request.
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// A chat request, checked, with its messages as the chat template takes them.
#[derive(Debug)]
pub struct Chat {
    pub model: Option<String>,
    /// Role, content, and a turn's tool calls or a tool result's call id
    /// ([`crate::tools::template_messages`]).
    pub messages: Vec<Value>,
    /// `tools` and `tool_choice` as sent ([`crate::tools::Tools::parse`] reads them).
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub sampling: Sampling,
    /// `Some(k)`: each token's log-probability and its `k` most likely alternatives.
    pub logprobs: Option<usize>,
    /// The fields every generation shares, for `response_format` ([`crate::structured`]).
    pub common: Common,
}

/// A completions request, checked.
#[derive(Debug)]
pub struct Completion {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub sampling: Sampling,
    pub logprobs: Option<usize>,
    pub common: Common,
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

/// A `/v1/chat/completions` body.
pub fn chat(body: &[u8]) -> Result<Chat, ApiError> {
    let value = read_object(body)?;
    let object = value.as_object().expect("read_object returns objects");
    check_fields(
        object,
        &[fields::<ChatRequest>(), fields::<Common>()],
        CHAT_UNSUPPORTED,
        "",
    )?;
    require(object, "messages")?;
    let mut req: ChatRequest = decode(&value)?;
    req.common = decode(&value)?;
    let messages = messages(&req.messages)?;
    let logprobs = match (req.logprobs.unwrap_or(false), req.top_logprobs) {
        (false, None) => None,
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs needs logprobs: true",
                Some("top_logprobs"),
            ));
        }
        (true, None) => Some(0),
        (true, Some(k)) if (0..=MAX_TOP_LOGPROBS).contains(&k) => Some(k as usize),
        (true, Some(k)) => {
            return Err(ApiError::invalid(
                format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}"),
                Some("top_logprobs"),
            ));
        }
    };
    Ok(Chat {
        sampling: req.common.sampling()?,
        model: req.common.model.clone(),
        messages,
        tools: req.tools,
        tool_choice: req.tool_choice,
        logprobs,
        common: req.common,
    })
}

/// A `/v1/completions` body.
pub fn completion(body: &[u8]) -> Result<Completion, ApiError> {
    let value = read_object(body)?;
    let object = value.as_object().expect("read_object returns objects");
    check_fields(
        object,
        &[fields::<CompletionRequest>(), fields::<Common>()],
        COMPLETION_UNSUPPORTED,
        "",
    )?;
    require(object, "prompt")?;
    let mut req: CompletionRequest = decode(&value)?;
    req.common = decode(&value)?;
    let logprobs = match req.logprobs {
        None => None,
        Some(k) if (0..=MAX_COMPLETION_LOGPROBS).contains(&k) => Some(k as usize),
        Some(k) => {
            return Err(ApiError::invalid(
                format!("logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {k}"),
                Some("logprobs"),
            ));
        }
    };
    Ok(Completion {
        sampling: req.common.sampling()?,
        model: req.common.model.clone(),
        prompt: req.prompt,
        logprobs,
        common: req.common,
    })
}

/// An embeddings request, checked: its inputs as text or token ids, none empty.
#[derive(Debug)]
pub struct Embedding {
    pub model: Option<String>,
    pub inputs: EmbeddingInputs,
    /// The request gave one input (a string or one list of token ids), not a list of them.
    pub single: bool,
    /// `encoding_format: "base64"`: little-endian f32 bytes in base64 (the official client's
    /// default) rather than a list of numbers.
    pub base64: bool,
    /// Keep only the first `dimensions` values (then normalize again); at least 1, checked
    /// against the model's width by the handler.
    pub dimensions: Option<usize>,
}

#[derive(Debug)]
pub enum EmbeddingInputs {
    Texts(Vec<String>),
    Tokens(Vec<Vec<u32>>),
}

impl EmbeddingInputs {
    pub fn len(&self) -> usize {
        match self {
            EmbeddingInputs::Texts(v) => v.len(),
            EmbeddingInputs::Tokens(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A `/v1/embeddings` body.
pub fn embedding(body: &[u8]) -> Result<Embedding, ApiError> {
    let value = read_object(body)?;
    let object = value.as_object().expect("read_object returns objects");
    check_fields(
        object,
        &[fields::<EmbeddingRequest>()],
        EMBEDDING_UNSUPPORTED,
        "",
    )?;
    require(object, "input")?;
    let req: EmbeddingRequest = decode(&value)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("encoding_format must be \"float\" or \"base64\", got {other:?}"),
                Some("encoding_format"),
            ));
        }
    };
    let dimensions = match req.dimensions {
        None => None,
        Some(k) if k >= 1 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
        Some(k) => {
            return Err(ApiError::invalid(
                format!("dimensions must be at least 1, got {k}"),
                Some("dimensions"),
            ));
        }
    };
    let single = matches!(req.input, Prompt::Text(_) | Prompt::Tokens(_));
    let inputs = match req.input {
        Prompt::Text(t) => EmbeddingInputs::Texts(vec![t]),
        Prompt::Texts(v) => EmbeddingInputs::Texts(v),
        Prompt::Tokens(t) => EmbeddingInputs::Tokens(vec![t]),
        Prompt::TokenLists(v) => EmbeddingInputs::Tokens(v),
    };
    if inputs.is_empty() || inputs.len() > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            format!(
                "input must hold between 1 and {MAX_EMBEDDING_INPUTS} inputs, got {}",
                inputs.len()
            ),
            Some("input"),
        ));
    }
    let empty = match &inputs {
        EmbeddingInputs::Texts(v) => v.iter().position(String::is_empty),
        EmbeddingInputs::Tokens(v) => v.iter().position(Vec::is_empty),
    };
    if let Some(i) = empty {
        return Err(ApiError::invalid_at(
            "an input is empty: there is nothing to embed",
            input_param(single, i),
        ));
    }
    Ok(Embedding {
        model: req.model,
        inputs,
        single,
        base64,
        dimensions,
    })
}

/// The `param` naming input `i`: `input` when the request gave one, else `input[i]`.
pub fn input_param(single: bool, i: usize) -> String {
    if single {
        "input".into()
    } else {
        format!("input[{i}]")
    }
}

/// A body of one of the server's own endpoints (`/tokenize`): its fields and no others.
pub fn plain<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let value = read_object(body)?;
    let object = value.as_object().expect("read_object returns objects");
    check_fields(object, &[fields::<T>()], &[], "")?;
    decode(&value)
}

/// The body as a JSON object; malformed JSON is a 400 saying where.
fn read_object(body: &[u8]) -> Result<Value, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("malformed JSON: {e}"), None))?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
        ));
    }
    Ok(value)
}

fn require(object: &Map<String, Value>, name: &'static str) -> Result<(), ApiError> {
    if object.get(name).is_none_or(Value::is_null) {
        return Err(ApiError::invalid(
            format!("missing required field {name}"),
            Some(name),
        ));
    }
    Ok(())
}

/// Refuses every key of `object` that is neither one of `known`, nor [`IGNORED`] (at the top
/// level), nor an unsupported field set to `null` or one of its no-op values. `prefix` is the
/// object's path (`messages[1].`), for the error's `param`.
fn check_fields(
    object: &Map<String, Value>,
    known: &[&[&str]],
    unsupported: &[Unsupported],
    prefix: &str,
) -> Result<(), ApiError> {
    for (key, value) in object {
        if known.iter().any(|k| k.contains(&key.as_str()))
            || (prefix.is_empty() && IGNORED.contains(&key.as_str()))
        {
            continue;
        }
        let param = format!("{prefix}{key}");
        let Some(u) = unsupported.iter().find(|u| u.name == key) else {
            return Err(ApiError::unknown_field(param));
        };
        if value.is_null() || u.no_op.iter().any(|n| same_json(value, n)) {
            continue;
        }
        let mut detail = String::new();
        if !u.why.is_empty() {
            detail = format!(" ({})", u.why);
        }
        if !u.no_op.is_empty() {
            detail.push_str(&format!("; only {} is accepted", u.no_op.join(" or ")));
        }
        return Err(ApiError::unsupported(param, &detail));
    }
    Ok(())
}

/// `value` equals the JSON text `literal` (numbers by value: `1.0` is `1`).
fn same_json(value: &Value, literal: &str) -> bool {
    match (value, serde_json::from_str::<Value>(literal)) {
        (Value::Number(a), Ok(Value::Number(b))) => a.as_f64() == b.as_f64(),
        (_, Ok(b)) => *value == b,
        (_, Err(_)) => false,
    }
}

/// Decodes a request type from the body; a wrong type names the field's path.
fn decode<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            ApiError::invalid(format!("invalid request: {inner}"), None)
        } else {
            ApiError::invalid_at(format!("invalid {path}: {inner}"), path)
        }
    })
}

/// The field names a derived `Deserialize` reads: what it passes to `deserialize_struct`.
fn fields<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Probe<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Probe<'_> {
        type Error = serde::de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(serde::de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(serde::de::Error::custom("fields read"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
            bytes byte_buf option unit unit_struct newtype_struct seq tuple
            tuple_struct map enum identifier ignored_any
        }
    }
    let mut out: &'static [&'static str] = &[];
    let _ = T::deserialize(Probe(&mut out));
    out
}

/// Checks the messages and gives them as the chat template takes them: user, system,
/// developer and tool messages need content (a developer message is a system message to a
/// template); an assistant message needs content or `tool_calls`.
pub fn messages(msgs: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::invalid(
            "messages must hold at least one message",
            Some("messages"),
        ));
    }
    for (i, m) in msgs.iter().enumerate() {
        check_fields(
            &m.extra,
            &[],
            MESSAGE_UNSUPPORTED,
            &format!("messages[{i}]."),
        )?;
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            "function" => {
                return Err(ApiError::unsupported(
                    format!("messages[{i}].role"),
                    &format!(" (role {:?}: {FUNCTIONS})", m.role),
                ));
            }
            other => {
                return Err(ApiError::invalid_at(
                    format!(
                        "unknown role {other:?} in messages[{i}] (system, developer, user, assistant or tool)"
                    ),
                    format!("messages[{i}].role"),
                ));
            }
        };
        let at = |what: &str| format!("messages[{i}].content{what}");
        match &m.content {
            None if role == "assistant" && m.tool_calls.as_ref().is_some_and(|c| !c.is_null()) => {}
            None => {
                let why = if role == "assistant" {
                    " or tool_calls"
                } else {
                    ""
                };
                return Err(ApiError::invalid_at(
                    format!("messages[{i}] ({}) needs content{why}", m.role),
                    at(""),
                ));
            }
            Some(Content::Text(_)) => {}
            Some(Content::Parts(parts)) => {
                if parts.is_empty() {
                    return Err(ApiError::invalid_at(
                        format!("messages[{i}].content is an empty list of parts"),
                        at(""),
                    ));
                }
                for (j, p) in parts.iter().enumerate() {
                    if p.kind != "text" {
                        return Err(ApiError::unsupported(
                            at(&format!("[{j}].type")),
                            &format!(" (content parts of type {:?}: only text)", p.kind),
                        ));
                    }
                    check_fields(&p.extra, &[], &[], &at(&format!("[{j}].")))?;
                    if p.text.is_none() {
                        return Err(ApiError::invalid_at(
                            format!("messages[{i}].content[{j}] is a text part without text"),
                            at(&format!("[{j}].text")),
                        ));
                    }
                }
            }
        }
    }
    crate::tools::template_messages(msgs)
}

impl Common {
    /// Checks every sampling field's range, with OpenAI's limits where OpenAI has the field.
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
        if !(0.0..=1.0).contains(&top_p) {
            return bad(format!("top_p must be in [0, 1], got {top_p}"), "top_p");
        }
        let top_k = match self.top_k.unwrap_or(0) {
            // -1 is vLLM's "off".
            k if k <= 0 => 0,
            k => usize::try_from(k).unwrap_or(usize::MAX),
        };
        // top_p 0 (OpenAI accepts it) keeps the smallest nucleus: the most likely token alone.
        let (top_p, top_k) = if top_p == 0.0 {
            (1.0, 1)
        } else {
            (top_p, top_k)
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return bad(format!("min_p must be in [0, 1], got {min_p}"), "min_p");
        }
        let presence_penalty = self.presence_penalty.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&presence_penalty) {
            return bad(
                format!("presence_penalty must be in [-2, 2], got {presence_penalty}"),
                "presence_penalty",
            );
        }
        let frequency_penalty = self.frequency_penalty.unwrap_or(0.0);
        if !(-2.0..=2.0).contains(&frequency_penalty) {
            return bad(
                format!("frequency_penalty must be in [-2, 2], got {frequency_penalty}"),
                "frequency_penalty",
            );
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
        if stop.len() > MAX_STOP {
            return bad(
                format!("at most {MAX_STOP} stop sequences, got {}", stop.len()),
                "stop",
            );
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return bad(
                "stream_options is only allowed with stream: true".into(),
                "stream_options",
            );
        }
        let min_tokens = match (self.ignore_eos.unwrap_or(false), self.min_tokens) {
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
            presence_penalty,
            frequency_penalty,
            seed,
        };
        // Every field was checked above; this guards the sampler's own invariants.
        params.validate().map_err(|e| ApiError::invalid(e, None))?;
        Ok(Sampling {
            params,
            max_tokens,
            n: n as usize,
            stop: stop.into_iter().filter(|s| !s.is_empty()).collect(),
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
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

mod responses;
pub use responses::{Responses, responses};

#[cfg(test)]
mod tests;
