//! `/v1/responses` bodies: the fields as in [`RESPONSES_UNSUPPORTED`]'s rules, the input items
//! as chat messages for the template, and the sampling fields as chat's.

use serde_json::Value;

use super::{RESPONSES_UNSUPPORTED, Sampling, check_fields, decode, fields, read_object, require};
use crate::api::{Common, Content, InputItem, ResponseInput, ResponsesRequest};
use crate::error::ApiError;
use frugal::chat::Message;

/// A responses request, checked.
#[derive(Debug)]
pub struct Responses {
    pub model: Option<String>,
    /// `instructions` as a system message, then the input.
    pub messages: Vec<Message>,
    pub sampling: Sampling,
    /// What the response object echoes.
    pub instructions: Option<String>,
    pub max_output_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub metadata: Value,
}

/// A `/v1/responses` body.
pub fn responses(body: &[u8]) -> Result<Responses, ApiError> {
    let value = read_object(body)?;
    let object = value.as_object().expect("read_object returns objects");
    check_fields(
        object,
        &[fields::<ResponsesRequest>()],
        RESPONSES_UNSUPPORTED,
        "",
    )?;
    require(object, "input")?;
    let req: ResponsesRequest = decode(&value)?;
    let mut messages = Vec::new();
    if let Some(i) = req.instructions.as_deref().filter(|i| !i.is_empty()) {
        messages.push(Message::new("system", i));
    }
    match &req.input {
        ResponseInput::Text(t) => messages.push(Message::new("user", t)),
        ResponseInput::Items(items) if items.is_empty() => {
            return Err(ApiError::invalid(
                "input must hold at least one item",
                Some("input"),
            ));
        }
        ResponseInput::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                messages.push(input_message(i, item)?);
            }
        }
    }
    let max_output_tokens = match req.max_output_tokens {
        Some(v) if v < 1 => {
            return Err(ApiError::invalid(
                format!("max_output_tokens must be at least 1, got {v}"),
                Some("max_output_tokens"),
            ));
        }
        v => v,
    };
    let common = Common {
        max_tokens: max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        stream: req.stream,
        ..Common::default()
    };
    let sampling = common.sampling()?;
    Ok(Responses {
        model: req.model,
        messages,
        max_output_tokens: sampling.max_tokens,
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        sampling,
        instructions: req.instructions,
        metadata: object.get("metadata").cloned().unwrap_or(Value::Null),
    })
}

/// One input item as a chat message: a message item (`type` `"message"` or absent) with a role
/// and text content. An assistant message may carry the `id` and `status` of the output item it
/// repeats, and `output_text` parts their `annotations` and `logprobs`, so a client can send a
/// response's output back as history.
fn input_message(i: usize, item: &InputItem) -> Result<Message, ApiError> {
    let at = |what: &str| format!("input[{i}]{what}");
    match item.kind.as_deref() {
        None | Some("message") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                at(".type"),
                &format!(" (input items of type {other:?}: only messages)"),
            ));
        }
    }
    check_fields(&item.extra, &[&["id", "status"]], &[], &at("."))?;
    let role = match item.role.as_deref() {
        Some("system" | "developer") => "system",
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some(other) => {
            return Err(ApiError::invalid_at(
                format!(
                    "unknown role {other:?} in input[{i}] (system, developer, user or assistant)"
                ),
                at(".role"),
            ));
        }
        None => {
            return Err(ApiError::invalid_at(
                format!("input[{i}] needs a role"),
                at(".role"),
            ));
        }
    };
    let text = match &item.content {
        None => {
            return Err(ApiError::invalid_at(
                format!("input[{i}] needs content"),
                at(".content"),
            ));
        }
        Some(Content::Text(t)) => t.clone(),
        Some(Content::Parts(parts)) if parts.is_empty() => {
            return Err(ApiError::invalid_at(
                format!("input[{i}].content is an empty list of parts"),
                at(".content"),
            ));
        }
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                let part = |what: &str| at(&format!(".content[{j}]{what}"));
                let extra: &[&str] = match p.kind.as_str() {
                    "input_text" => &[],
                    "output_text" => &["annotations", "logprobs"],
                    other => {
                        return Err(ApiError::unsupported(
                            part(".type"),
                            &format!(
                                " (content parts of type {other:?}: only input_text and output_text)"
                            ),
                        ));
                    }
                };
                check_fields(&p.extra, &[extra], &[], &part("."))?;
                match &p.text {
                    Some(t) => text.push_str(t),
                    None => {
                        return Err(ApiError::invalid_at(
                            format!("input[{i}].content[{j}] is a text part without text"),
                            part(".text"),
                        ));
                    }
                }
            }
            text
        }
    };
    Ok(Message::new(role, &text))
}
