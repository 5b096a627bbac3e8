//! A generation's answer in OpenAI's shapes: gathered into one JSON body, or streamed as
//! server-sent chunks (with `--request-timeout` and keep-alive), for chat, chat with tools and
//! completions alike.

use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use frugal::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::engine::{Event, TokenLogprob};
use crate::error::ApiError;
use crate::routes::Kind;
use crate::tools::{self, CallSplitter, Piece};

/// What the response's JSON needs besides the events.
pub(crate) struct Output {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) n: usize,
    pub(crate) prompt_tokens: usize,
    pub(crate) tok: Arc<Tokenizer>,
}

impl Output {
    fn usage(&self, completion: usize, cached: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat | Kind::ChatTools, false) => "chat.completion",
            (Kind::Chat | Kind::ChatTools, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("frugal-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        })
    }

    fn piece(&self, t: u32) -> String {
        String::from_utf8_lossy(self.tok.token_bytes(t, false)).into_owned()
    }

    /// Chat log-probability entries of tokens.
    fn chat_logprobs(&self, items: &[(u32, TokenLogprob)]) -> Value {
        let entry = |t: u32, lp: f32| {
            json!({
                "token": self.piece(t),
                "logprob": lp,
                "bytes": self.tok.token_bytes(t, false),
            })
        };
        let content: Vec<Value> = items
            .iter()
            .map(|(t, l)| {
                let mut e = entry(*t, l.logprob);
                e["top_logprobs"] = l.top.iter().map(|a| entry(a.token, a.logprob)).collect();
                e
            })
            .collect();
        json!({ "content": content })
    }

    /// Completions log-probabilities: parallel lists, `text_offset` into the generated text.
    fn text_logprobs(&self, items: &[(u32, TokenLogprob)], offset0: usize) -> Value {
        let mut offset = offset0;
        let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        for (t, l) in items {
            let p = self.piece(*t);
            offsets.push(offset);
            offset += p.len();
            tokens.push(p);
            lps.push(l.logprob);
            let top: serde_json::Map<String, Value> = l
                .top
                .iter()
                .map(|a| (self.piece(a.token), json!(a.logprob)))
                .collect();
            tops.push(Value::Object(top));
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }
}

/// One choice as it accumulates.
#[derive(Default)]
struct Choice {
    text: String,
    logprobs: Vec<(u32, TokenLogprob)>,
    finish: Option<&'static str>,
    tokens: usize,
}

pub(crate) async fn collect(
    out: Output,
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<Response, ApiError> {
    let mut choices: Vec<Choice> = (0..out.n).map(|_| Choice::default()).collect();
    let mut cached = 0;
    let mut open = out.n;
    while open > 0 {
        match rx.recv().await {
            Some(Event::Admitted { cached: c }) => cached = c,
            Some(Event::Token {
                choice,
                token,
                text,
                logprob,
            }) => {
                let c = &mut choices[choice];
                c.text.push_str(&text);
                if let Some(l) = logprob {
                    c.logprobs.push((token, l));
                }
            }
            Some(Event::Finished {
                choice,
                reason,
                text,
                completion_tokens,
            }) => {
                let c = &mut choices[choice];
                c.text.push_str(&text);
                c.finish = Some(reason.as_str());
                c.tokens = completion_tokens;
                open -= 1;
            }
            Some(Event::Failed(msg)) => return Err(ApiError::invalid(msg, None)),
            Some(Event::Embedding(_)) | None => {
                return Err(ApiError::internal("the scheduler dropped the request"));
            }
        }
    }
    let completion: usize = choices.iter().map(|c| c.tokens).sum();
    let with_logprobs = choices.iter().any(|c| !c.logprobs.is_empty());
    let list: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let lp = if !with_logprobs {
                Value::Null
            } else if out.kind != Kind::Text {
                out.chat_logprobs(&c.logprobs)
            } else {
                out.text_logprobs(&c.logprobs, 0)
            };
            match out.kind {
                Kind::Chat => json!({
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp,
                    "finish_reason": c.finish,
                }),
                Kind::ChatTools => {
                    let (content, calls) = tools::split_all(&c.text);
                    let mut message = json!({"role": "assistant", "content": content});
                    let mut finish = c.finish;
                    if !calls.is_empty() {
                        let list: Vec<Value> =
                            calls.iter().map(|k| k.to_json(&tools::call_id())).collect();
                        message["tool_calls"] = Value::Array(list);
                        finish = Some("tool_calls");
                    }
                    json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
                }
                Kind::Text => json!({
                    "index": i,
                    "text": c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish,
                }),
            }
        })
        .collect();
    let mut body = out.envelope(false, Value::Array(list));
    body["usage"] = out.usage(completion, cached);
    Ok(axum::Json(body).into_response())
}

/// `--request-timeout` and `--sse-keep-alive` as a stream applies them.
pub(crate) struct StreamLimits {
    /// When the stream must end, and the timeout that set it (for the message).
    pub(crate) deadline: Option<(Instant, std::time::Duration)>,
    pub(crate) keep_alive: std::time::Duration,
}

/// Server-sent events in the OpenAI chunk format, ending with `data: [DONE]`, with a comment
/// line every `keep_alive` while nothing else is sent (a queued request or a long prefill would
/// otherwise look like a dead connection to proxies).
///
/// Dropping the stream drops `rx`, which cancels the request: when the client goes away, and at
/// the deadline, where the stream ends with an OpenAI error event (no `[DONE]`).
pub(crate) fn stream(
    out: Output,
    mut rx: mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
    limits: StreamLimits,
) -> Response {
    let sse = |v: &Value| {
        let e = SseEvent::default();
        Ok::<SseEvent, Infallible>(
            e.json_data(v)
                .unwrap_or_else(|_| SseEvent::default().comment("unserializable event")),
        )
    };
    let (deadline, timeout) = match limits.deadline {
        Some((d, t)) => (d, Some(t)),
        None => (Instant::now(), None),
    };
    let body = async_stream::stream! {
        let expired = tokio::time::sleep_until(deadline);
        tokio::pin!(expired);
        let chunk = |choices: Value| {
            let mut c = out.envelope(true, choices);
            if include_usage {
                c["usage"] = Value::Null;
            }
            c
        };
        if out.kind != Kind::Text {
            let first: Vec<Value> = (0..out.n)
                .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
                .collect();
            yield sse(&chunk(Value::Array(first)));
        }
        let (mut cached, mut completion, mut open) = (0, 0, out.n);
        let mut offsets = vec![0usize; out.n];
        // With tools: each choice's text split into text and calls, and its calls so far.
        let mut splitters: Vec<CallSplitter> = (0..out.n).map(|_| CallSplitter::default()).collect();
        let mut calls = vec![0usize; out.n];
        let delta = |i: usize, text: &str, lp: Value, finish: Option<&str>, offsets: &mut Vec<usize>| {
            offsets[i] += text.len();
            match out.kind {
                Kind::Chat | Kind::ChatTools => {
                    let d = if finish.is_some() && text.is_empty() { json!({}) } else { json!({"content": text}) };
                    json!([{"index": i, "delta": d, "logprobs": lp, "finish_reason": finish}])
                }
                Kind::Text => json!([{"index": i, "text": text, "logprobs": lp, "finish_reason": finish}]),
            }
        };
        while open > 0 {
            let next = tokio::select! {
                biased;
                () = &mut expired, if timeout.is_some() => None,
                e = rx.recv() => Some(e),
            };
            let Some(next) = next else {
                let secs = timeout.map_or(0.0, |t| t.as_secs_f64());
                yield sse(&ApiError::timeout(secs).body());
                return;
            };
            match next {
                Some(Event::Admitted { cached: c }) => cached = c,
                Some(Event::Token { choice, text, .. }) if out.kind == Kind::ChatTools => {
                    for p in splitters[choice].push(&text) {
                        for d in tool_deltas(choice, p, &mut calls[choice]) {
                            yield sse(&chunk(d));
                        }
                    }
                }
                Some(Event::Finished { choice, reason, text, completion_tokens }) if out.kind == Kind::ChatTools => {
                    completion += completion_tokens;
                    open -= 1;
                    let mut pieces = splitters[choice].push(&text);
                    pieces.extend(splitters[choice].finish());
                    for p in pieces {
                        for d in tool_deltas(choice, p, &mut calls[choice]) {
                            yield sse(&chunk(d));
                        }
                    }
                    let reason = if calls[choice] > 0 { "tool_calls" } else { reason.as_str() };
                    yield sse(&chunk(json!([{"index": choice, "delta": {}, "logprobs": null, "finish_reason": reason}])));
                }
                Some(Event::Token { choice, token, text, logprob }) => {
                    let lp = match &logprob {
                        None => Value::Null,
                        Some(l) if out.kind != Kind::Text => out.chat_logprobs(&[(token, l.clone())]),
                        Some(l) => out.text_logprobs(&[(token, l.clone())], offsets[choice]),
                    };
                    if text.is_empty() && lp.is_null() {
                        continue; // nothing to show yet (a partial character or a held stop prefix)
                    }
                    let d = delta(choice, &text, lp, None, &mut offsets);
                    yield sse(&chunk(d));
                }
                Some(Event::Finished { choice, reason, text, completion_tokens }) => {
                    completion += completion_tokens;
                    open -= 1;
                    let d = delta(choice, &text, Value::Null, Some(reason.as_str()), &mut offsets);
                    yield sse(&chunk(d));
                }
                Some(Event::Failed(msg)) => {
                    // As llama-server: the error as a data event, and no [DONE].
                    yield sse(&ApiError::invalid(msg, None).body());
                    return;
                }
                Some(Event::Embedding(_)) | None => {
                    yield sse(&ApiError::internal("the scheduler dropped the request").body());
                    return;
                }
            }
        }
        if include_usage {
            let mut u = out.envelope(true, json!([]));
            u["usage"] = out.usage(completion, cached);
            yield sse(&u);
        }
        yield Ok(SseEvent::default().data("[DONE]"));
    };
    Sse::new(body)
        .keep_alive(KeepAlive::new().interval(limits.keep_alive))
        .into_response()
}

/// The streamed chunks' choices for one piece of a tools answer: text as content, a call as
/// OpenAI's two tool-call deltas (id and name, then the arguments).
fn tool_deltas(choice: usize, p: Piece, calls: &mut usize) -> Vec<Value> {
    let one =
        |d: Value| json!([{"index": choice, "delta": d, "logprobs": null, "finish_reason": null}]);
    match p {
        Piece::Text(t) => vec![one(json!({"content": t}))],
        Piece::Call(c) => {
            let k = *calls;
            *calls += 1;
            let head = json!({"tool_calls": [{"index": k, "id": tools::call_id(), "type": "function",
                "function": {"name": c.name, "arguments": ""}}]});
            let args =
                json!({"tool_calls": [{"index": k, "function": {"arguments": c.arguments}}]});
            vec![one(head), one(args)]
        }
    }
}
