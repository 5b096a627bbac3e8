//! `/v1/responses`, OpenAI's newer API, for text in and out: the input items become chat
//! messages (`instructions` a system message first) and go the chat path — the model's chat
//! template, the scheduler, its stop handling — and the answer is one assistant message item.
//!
//! The server is stateless: nothing is stored, so `store: true`, `previous_response_id` and
//! conversations are refused (`validate`).
//!
//! Streamed, the events are OpenAI's for one text message, each an SSE event named by its
//! `type` and numbered by `sequence_number`: `response.created`, `response.in_progress`,
//! `response.output_item.added`, `response.content_part.added`, `response.output_text.delta`
//! (one per piece of text), `response.output_text.done`, `response.content_part.done`,
//! `response.output_item.done`, then `response.completed`, or `response.incomplete` when
//! `max_output_tokens` (or the context) ended it. There is no `[DONE]` line.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::engine::{Event, Finish};
use crate::error::ApiError;
use crate::routes::{self, App, StreamLimits, check_model};
use crate::security::Body;
use crate::validate::{self, Responses};

pub async fn responses(
    State(app): State<Arc<App>>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = validate::responses(&body)?;
    let r = app.ready()?;
    check_model(r, req.model.as_deref())?;
    let prompt = routes::chat_prompt(r, &req.messages, None, "input")?;
    let prompt_tokens = prompt.len();
    let rx = routes::submit(&app, r, prompt, &req.sampling, None, None).map_err(|mut e| {
        if e.code == Some("context_length_exceeded") {
            e.param = Some("input".into());
        }
        e
    })?;
    let id = routes::rand_id() ^ req.sampling.params.seed;
    let head = Head {
        id: format!("resp_{id:016x}"),
        msg_id: format!("msg_{:016x}", id.rotate_left(29)),
        created_at: routes::now_secs(),
        model: r.names[0].clone(),
        prompt_tokens,
        req,
    };
    if head.req.sampling.stream {
        Ok(stream(head, rx, routes::stream_limits(&app, arrived)))
    } else {
        collect(head, rx).await
    }
}

/// What the response object says besides the generated text.
struct Head {
    id: String,
    msg_id: String,
    created_at: u64,
    model: String,
    prompt_tokens: usize,
    req: Responses,
}

/// The generation so far.
#[derive(Default)]
struct Answer {
    text: String,
    finish: Option<Finish>,
    output_tokens: usize,
    cached: usize,
}

impl Answer {
    /// Takes one event; `Ok(Some(piece))` is new text, `Err` a failed request.
    fn take(&mut self, e: Option<Event>) -> Result<Option<String>, ApiError> {
        match e {
            Some(Event::Admitted { cached }) => {
                self.cached = cached;
                Ok(None)
            }
            Some(Event::Token { text, .. }) => {
                self.text.push_str(&text);
                Ok(Some(text))
            }
            Some(Event::Finished {
                reason,
                text,
                completion_tokens,
                ..
            }) => {
                self.text.push_str(&text);
                self.finish = Some(reason);
                self.output_tokens = completion_tokens;
                Ok(Some(text))
            }
            Some(Event::Failed(msg)) => Err(ApiError::invalid(msg, None)),
            Some(Event::Embedding(_)) | None => {
                Err(ApiError::internal("the scheduler dropped the request"))
            }
        }
    }

    fn status(&self) -> &'static str {
        match self.finish {
            None => "in_progress",
            Some(Finish::Stop) => "completed",
            Some(Finish::Length) => "incomplete",
        }
    }
}

impl Head {
    fn message(&self, a: &Answer, content: Vec<Value>) -> Value {
        json!({
            "id": self.msg_id,
            "type": "message",
            "status": a.status(),
            "role": "assistant",
            "content": content,
        })
    }

    /// The response object: in progress (no output yet), or finished with its message.
    fn response(&self, a: &Answer) -> Value {
        let done = a.finish.is_some();
        let output = if done {
            vec![self.message(a, vec![text_part(&a.text)])]
        } else {
            vec![]
        };
        let usage = done.then(|| {
            json!({
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": a.cached, "cache_write_tokens": 0},
                "output_tokens": a.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + a.output_tokens,
            })
        });
        let q = &self.req;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": done.then(routes::now_secs),
            "status": a.status(),
            "error": null,
            "incomplete_details": (a.finish == Some(Finish::Length))
                .then(|| json!({"reason": "max_output_tokens"})),
            "instructions": q.instructions,
            "max_output_tokens": q.max_output_tokens,
            "metadata": if q.metadata.is_null() { json!({}) } else { q.metadata.clone() },
            "model": self.model,
            "output": output,
            "parallel_tool_calls": false,
            "previous_response_id": null,
            "reasoning": null,
            "store": false,
            "temperature": q.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "top_p": q.top_p,
            "truncation": "disabled",
            "usage": usage,
        })
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

async fn collect(head: Head, mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut a = Answer::default();
    while a.finish.is_none() {
        a.take(rx.recv().await)?;
    }
    Ok(axum::Json(head.response(&a)).into_response())
}

/// The event stream (see the module's doc). Dropping it drops `rx`, which cancels the
/// generation: when the client goes away, and at the deadline, where it ends with an OpenAI
/// error event, as chat's stream does.
fn stream(head: Head, mut rx: mpsc::UnboundedReceiver<Event>, limits: StreamLimits) -> Response {
    let (deadline, timeout) = match limits.deadline {
        Some((d, t)) => (d, Some(t)),
        None => (Instant::now(), None),
    };
    let body = async_stream::stream! {
        let mut seq = 0u64;
        let mut event = |kind: &str, mut data: Value| {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(seq);
            seq += 1;
            let e = SseEvent::default().event(kind);
            Ok::<SseEvent, Infallible>(
                e.json_data(&data)
                    .unwrap_or_else(|_| SseEvent::default().comment("unserializable event")),
            )
        };
        let error = |e: ApiError| Ok::<SseEvent, Infallible>(
            SseEvent::default().json_data(e.body())
                .unwrap_or_else(|_| SseEvent::default().comment("unserializable event")),
        );
        let expired = tokio::time::sleep_until(deadline);
        tokio::pin!(expired);
        let mut a = Answer::default();
        let at = json!({"item_id": head.msg_id, "output_index": 0, "content_index": 0});
        let with = |extra: Value| {
            let mut v = at.clone();
            if let (Some(v), Value::Object(extra)) = (v.as_object_mut(), extra) {
                v.extend(extra);
            }
            v
        };
        yield event("response.created", json!({"response": head.response(&a)}));
        yield event("response.in_progress", json!({"response": head.response(&a)}));
        yield event(
            "response.output_item.added",
            json!({"output_index": 0, "item": head.message(&a, vec![])}),
        );
        yield event("response.content_part.added", with(json!({"part": text_part("")})));
        while a.finish.is_none() {
            let next = tokio::select! {
                biased;
                () = &mut expired, if timeout.is_some() => None,
                e = rx.recv() => Some(e),
            };
            let Some(next) = next else {
                yield error(ApiError::timeout(timeout.map_or(0.0, |t| t.as_secs_f64())));
                return;
            };
            match a.take(next) {
                Ok(Some(piece)) if !piece.is_empty() => {
                    yield event(
                        "response.output_text.delta",
                        with(json!({"delta": piece, "logprobs": []})),
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    yield error(e);
                    return;
                }
            }
        }
        yield event("response.output_text.done", with(json!({"text": a.text, "logprobs": []})));
        yield event("response.content_part.done", with(json!({"part": text_part(&a.text)})));
        yield event(
            "response.output_item.done",
            json!({"output_index": 0, "item": head.message(&a, vec![text_part(&a.text)])}),
        );
        let last = if a.finish == Some(Finish::Length) {
            "response.incomplete"
        } else {
            "response.completed"
        };
        yield event(last, json!({"response": head.response(&a)}));
    };
    Sse::new(body)
        .keep_alive(KeepAlive::new().interval(limits.keep_alive))
        .into_response()
}
