//! Tool calling: `tools` and `tool_choice` on chat completions, in the Hermes / Qwen2.5 format
//! that tool-calling chat templates render: the model writes
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, which becomes OpenAI's
//! `tool_calls`.
//!
//! With `tool_choice` `required` or a named function the call is forced by constrained
//! decoding (the wrapper text, then JSON whose `arguments` match the function's `parameters`),
//! so it is always valid; with `auto` the model's free output is parsed, and text that is not a
//! well-formed call stays text.

use llguidance::api::TopLevelGrammar;
use serde_json::{Value, json};

use crate::api::ChatMessage;
use crate::error::ApiError;
use crate::structured::with_layout;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// What `tool_choice` asks.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    Auto,
    None,
    Required,
    Named(String),
}

/// A request's tools, validated.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The `tools` list as sent (the template renders it).
    pub list: Vec<Value>,
    pub choice: Choice,
}

impl Tools {
    /// Reads `tools` and `tool_choice`; `None` when there are no tools.
    pub fn parse(tools: Option<&Value>, choice: Option<&Value>) -> Result<Option<Tools>, ApiError> {
        let bad = |m: String, p: &'static str| Err(ApiError::invalid(m, Some(p)));
        let list = match tools {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(v)) => v.clone(),
            Some(_) => return bad("tools must be a list".into(), "tools"),
        };
        for (i, t) in list.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return bad(format!("tools[{i}].type must be \"function\""), "tools");
            }
            let f = t.get("function");
            if f.and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .is_none()
            {
                return bad(
                    format!("tools[{i}].function.name must be a string"),
                    "tools",
                );
            }
            match f.and_then(|f| f.get("parameters")) {
                None | Some(Value::Object(_)) => {}
                Some(_) => {
                    return bad(
                        format!("tools[{i}].function.parameters must be a JSON Schema object"),
                        "tools",
                    );
                }
            }
        }
        let choice = match choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "auto" => Choice::Auto,
                "none" => Choice::None,
                "required" => Choice::Required,
                other => {
                    return bad(
                        format!("tool_choice {other:?} is not one of auto, none, required"),
                        "tool_choice",
                    );
                }
            },
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => {
                    Choice::Named(name.to_string())
                }
                _ => {
                    return bad(
                        "tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                        "tool_choice",
                    );
                }
            },
        };
        if list.is_empty() {
            return match choice {
                Choice::Auto | Choice::None => Ok(None),
                _ => bad(
                    "tool_choice asks for a tool call but tools is empty".into(),
                    "tool_choice",
                ),
            };
        }
        if let Choice::Named(n) = &choice
            && !list.iter().any(|t| name_of(t) == Some(n.as_str()))
        {
            return bad(
                format!("tool_choice names {n:?}, which is not in tools"),
                "tool_choice",
            );
        }
        Ok(Some(Tools { list, choice }))
    }

    /// What the template receives as `tools` (none for `tool_choice: none`).
    pub fn for_template(&self) -> Option<&[Value]> {
        (self.choice != Choice::None).then_some(&self.list[..])
    }

    /// Whether the output is read for tool calls.
    pub fn parses_calls(&self) -> bool {
        self.choice != Choice::None
    }

    /// The grammar that forces one call (`required`: of any tool; named: of that one).
    pub fn grammar(&self) -> Option<TopLevelGrammar> {
        let call = |t: &Value| {
            let params = t
                .pointer("/function/parameters")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            json!({
                "type": "object",
                "properties": {"name": {"const": name_of(t)}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let schema = match &self.choice {
            Choice::Auto | Choice::None => return None,
            Choice::Required => json!({"anyOf": self.list.iter().map(call).collect::<Vec<_>>()}),
            Choice::Named(n) => call(self.list.iter().find(|t| name_of(t) == Some(n))?),
        };
        let lark = format!(
            "start: {open:?} call {close:?}\ncall: %json {schema}\n",
            open = format!("{OPEN}\n"),
            close = format!("\n{CLOSE}"),
            schema = with_layout(schema)
        );
        Some(TopLevelGrammar::from_lark(lark))
    }
}

fn name_of(t: &Value) -> Option<&str> {
    t.pointer("/function/name").and_then(Value::as_str)
}

/// The messages as the template sees them: text content, and an assistant turn's
/// `tool_calls` with `arguments` as an object (templates write it with `tojson`).
pub fn template_messages(messages: &[ChatMessage]) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        // A developer message is a system message to a template.
        let role = match m.role.as_str() {
            "developer" => "system",
            r => r,
        };
        let mut v = json!({"role": role, "content": m.text()});
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_null()) {
            let Value::Array(calls) = calls else {
                return Err(ApiError::invalid(
                    "tool_calls must be a list",
                    Some("messages"),
                ));
            };
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    if let Some(a) = c.pointer_mut("/function/arguments")
                        && let Some(parsed) = a.as_str().and_then(|s| serde_json::from_str(s).ok())
                    {
                        *a = parsed;
                    }
                    c
                })
                .collect();
            v["tool_calls"] = Value::Array(calls);
        }
        if let Some(id) = &m.tool_call_id {
            v["tool_call_id"] = json!(id);
        }
        if let Some(n) = &m.name {
            v["name"] = json!(n);
        }
        out.push(v);
    }
    Ok(out)
}

/// A call read from the output.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub name: String,
    /// The arguments as a JSON string (OpenAI's shape).
    pub arguments: String,
}

impl Call {
    /// The body of one `<tool_call>` block, if it is a well-formed call.
    fn parse(body: &str) -> Option<Call> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?.to_string();
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            None => "{}".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(a) => a.to_string(),
        };
        Some(Call { name, arguments })
    }

    /// OpenAI's `tool_calls` entry.
    pub fn to_json(&self, id: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}})
    }
}

/// A piece of output: text to show, or a call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(Call),
}

/// Splits streamed text into text and calls as it arrives: text goes out at once except what
/// may be the start of a `<tool_call>` block, which is held until its `</tool_call>`.
#[derive(Default, Debug)]
pub struct CallSplitter {
    held: String,
}

impl CallSplitter {
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.held.find(OPEN) {
                Some(start) => {
                    let Some(end) = self.held[start..].find(CLOSE).map(|e| start + e) else {
                        emit_text(&mut out, &self.held[..start]);
                        self.held.drain(..start);
                        return out;
                    };
                    emit_text(&mut out, &self.held[..start]);
                    let body = &self.held[start + OPEN.len()..end];
                    match Call::parse(body) {
                        Some(c) => out.push(Piece::Call(c)),
                        None => emit_text(&mut out, &self.held[start..end + CLOSE.len()]),
                    }
                    self.held.drain(..end + CLOSE.len());
                }
                None => {
                    // Keep a tail that could still grow into `<tool_call>`.
                    let keep = (1..OPEN.len())
                        .rev()
                        .find(|&k| self.held.ends_with(&OPEN[..k]))
                        .unwrap_or(0);
                    let cut = self.held.len() - keep;
                    emit_text(&mut out, &self.held[..cut]);
                    self.held.drain(..cut);
                    return out;
                }
            }
        }
    }

    /// The end of the output: an unterminated block is a call if its JSON is complete.
    pub fn finish(&mut self) -> Vec<Piece> {
        let rest = std::mem::take(&mut self.held);
        let mut out = Vec::new();
        match rest.strip_prefix(OPEN).and_then(Call::parse) {
            Some(c) => out.push(Piece::Call(c)),
            None => emit_text(&mut out, &rest),
        }
        out
    }
}

fn emit_text(out: &mut Vec<Piece>, t: &str) {
    if !t.is_empty() {
        out.push(Piece::Text(t.to_string()));
    }
}

/// A whole output split into its text (trimmed; `None` if empty) and its calls.
pub fn split_all(text: &str) -> (Option<String>, Vec<Call>) {
    let mut s = CallSplitter::default();
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let (mut content, mut calls) = (String::new(), Vec::new());
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    let content = content.trim();
    let content = if content.is_empty() && !calls.is_empty() {
        None
    } else {
        Some(content.to_string())
    };
    (content, calls)
}

/// A fresh call id.
pub fn call_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let x = t ^ N
        .fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    format!("call_{:016x}", x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
    }

    #[test]
    fn tool_choice_shapes() {
        let t = Tools::parse(Some(&weather()), None).unwrap().unwrap();
        assert_eq!(t.choice, Choice::Auto);
        assert!(t.grammar().is_none());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = Tools::parse(Some(&weather()), Some(&named))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, Choice::Named("get_weather".into()));
        assert!(t.grammar().is_some());
        let none = Tools::parse(Some(&weather()), Some(&json!("none")))
            .unwrap()
            .unwrap();
        assert!(none.for_template().is_none() && !none.parses_calls());
        for (tools, choice, param) in [
            (
                weather(),
                json!({"type": "function", "function": {"name": "nope"}}),
                "tool_choice",
            ),
            (weather(), json!("sometimes"), "tool_choice"),
            (json!([]), json!("required"), "tool_choice"),
            (json!([{"type": "function"}]), json!("auto"), "tools"),
            (json!({"a": 1}), json!("auto"), "tools"),
        ] {
            let e = Tools::parse(Some(&tools), Some(&choice)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{tools} {choice}");
        }
        assert!(Tools::parse(None, None).unwrap().is_none());
    }

    #[test]
    fn calls_are_split_from_streamed_text() {
        let out =
            "Let me check. <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let mut s = CallSplitter::default();
        let mut pieces = Vec::new();
        for ch in out.chars() {
            pieces.extend(s.push(&ch.to_string()));
        }
        pieces.extend(s.finish());
        let text: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                Piece::Call(_) => None,
            })
            .collect();
        assert_eq!(text, "Let me check. ");
        assert_eq!(
            pieces.last(),
            Some(&Piece::Call(Call {
                name: "f".into(),
                arguments: "{\"x\":1}".into()
            }))
        );
        let (content, calls) = split_all("<tool_call>{\"name\": \"g\", \"arguments\": \"{}\"}");
        assert_eq!((content, calls.len()), (None, 1));
        let (content, calls) = split_all("a <tool_call>not json</tool_call> b <tool");
        assert_eq!(
            content.as_deref(),
            Some("a <tool_call>not json</tool_call> b <tool")
        );
        assert!(calls.is_empty());
    }

    #[test]
    fn assistant_calls_reach_the_template_with_object_arguments() {
        let m: ChatMessage = serde_json::from_value(json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 2}"}}]}))
        .unwrap();
        let v = template_messages(&[m]).unwrap();
        assert_eq!(
            v[0]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 2})
        );
        assert_eq!(v[0]["content"], json!(""));
    }
}
