//! `/v1/embeddings`: one vector per input, the final hidden state after the final norm, pooled
//! over the input's tokens (`--pooling mean|last`) and L2-normalized.
//!
//! Inputs go through the scheduler like prompts: each is a sequence computed in the shared
//! batches, in prefill chunks behind the running decodes, so an embedding of a long input never
//! stalls the streams already generating, and the KV budget and `--parallel` bound embeddings
//! as they bound generation. A batch of inputs is submitted at once and batched together.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use frugal::model::pooling::normalize;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::engine::{Event, GenRequest};
use crate::error::ApiError;
use crate::routes::{App, Ready, check_model};
use crate::security::Body;
use crate::validate::{self, EmbeddingInputs, input_param};

pub async fn embeddings(
    State(app): State<Arc<App>>,
    Body(body): Body,
) -> Result<Response, ApiError> {
    let req = validate::embedding(&body)?;
    let r = app.ready()?;
    check_model(r, req.model.as_deref())?;
    let dims = match req.dimensions {
        Some(k) if k > r.n_embd => {
            return Err(ApiError::invalid(
                format!(
                    "dimensions must be at most the model's width, {}, got {k}",
                    r.n_embd
                ),
                Some("dimensions"),
            ));
        }
        Some(k) => k,
        None => r.n_embd,
    };
    let inputs = tokens(r, &req.inputs, req.single)?;
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let pending = submit(&app, r, inputs)?;
    let mut data = Vec::with_capacity(pending.len());
    for (i, mut rx) in pending.into_iter().enumerate() {
        let mut v = loop {
            match rx.recv().await {
                Some(Event::Embedding(v)) => break v,
                Some(Event::Admitted { .. }) => {}
                Some(Event::Failed(msg)) => {
                    return Err(ApiError::invalid_at(msg, input_param(req.single, i)));
                }
                Some(Event::Token { .. } | Event::Finished { .. }) | None => {
                    return Err(ApiError::internal("the scheduler dropped the request"));
                }
            }
        };
        if dims < v.len() {
            // OpenAI's text-embedding-3 shortening: the first `dims` values, normalized again.
            v.truncate(dims);
            v = normalize(&v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>());
        }
        let embedding = if req.base64 {
            Value::String(base64(&v))
        } else {
            json!(v)
        };
        data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
    }
    Ok(axum::Json(json!({
        "object": "list",
        "data": data,
        "model": r.names[0],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }))
    .into_response())
}

/// Each input's token ids (text is tokenized with the model's special tokens, as a prompt);
/// every input must fit the context.
fn tokens(r: &Ready, inputs: &EmbeddingInputs, single: bool) -> Result<Vec<Vec<u32>>, ApiError> {
    let vocab = r.tok.vocab_size();
    let mut out = Vec::with_capacity(inputs.len());
    for i in 0..inputs.len() {
        let param = input_param(single, i);
        let ids = match inputs {
            EmbeddingInputs::Texts(v) => r
                .tok
                .encode(&v[i], true)
                .map_err(|e| ApiError::invalid_at(e.to_string(), param.clone()))?,
            EmbeddingInputs::Tokens(v) => v[i].clone(),
        };
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid_at(
                format!("token {bad} is outside the vocabulary of {vocab}"),
                param,
            ));
        }
        if ids.len() > r.ctx {
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid_at(
                    format!(
                        "{param} has {} tokens; this model's context holds {}",
                        ids.len(),
                        r.ctx
                    ),
                    param,
                )
            });
        }
        out.push(ids);
    }
    Ok(out)
}

/// Queues every input (admission control counts the request once: a batch is one request to
/// a client) and returns their event channels, in order.
fn submit(
    app: &App,
    r: &Ready,
    inputs: Vec<Vec<u32>>,
) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, ApiError> {
    if app.shutting_down.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let submit = app.admit(r)?;
    let mut out = Vec::with_capacity(inputs.len());
    for prompt in inputs {
        let (tx, rx) = mpsc::unbounded_channel();
        r.metrics.submitted();
        let req = GenRequest {
            prompt,
            n: 1,
            max_tokens: 0,
            min_tokens: 0,
            sampler: Default::default(),
            stop: Vec::new(),
            logprobs: None,
            constraint: None,
            embed: Some(app.cfg.pooling),
            events: tx,
        };
        if submit.send(req).is_err() {
            r.metrics.dequeued(true);
            return Err(ApiError::unavailable("the scheduler has stopped"));
        }
        out.push(rx);
    }
    Ok(out)
}

/// Standard base64 (with padding) of the values as little-endian f32 bytes: what OpenAI sends
/// for `encoding_format: "base64"`.
pub fn base64(v: &[f32]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                out.push(ABC[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::base64;

    #[test]
    fn base64_is_the_standard_alphabet_with_padding() {
        // 1.0f32 is 00 00 80 3f; 2.0 is 00 00 00 40.
        assert_eq!(base64(&[1.0]), "AACAPw==");
        assert_eq!(base64(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64(&[1.0, 2.0, -0.5]), "AACAPwAAAEAAAAC/");
        assert_eq!(base64(&[]), "");
    }
}
