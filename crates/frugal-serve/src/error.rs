//! Errors as OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status, so every OpenAI client raises the right exception.

use std::borrow::Cow;

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    /// The request field to blame, as OpenAI names it (`messages[0].content`).
    pub param: Option<Cow<'static, str>>,
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429 and 503).
    pub retry_after: Option<u32>,
    /// `x-should-retry: false`: OpenAI's clients retry 408, 429 and 5xx on their own unless
    /// told not to, and retrying a request that ran out of time only spends that time again.
    pub no_retry: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            no_retry: false,
        }
    }

    /// 400: the request is wrong; `param` names the field when one is to blame.
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            param: param.map(Cow::Borrowed),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400 naming a field by its path (`messages[2].role`).
    pub fn invalid_at(message: impl Into<String>, param: impl Into<Cow<'static, str>>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400: an OpenAI field this server does not implement (and a value that asks for it).
    pub fn unsupported(param: impl Into<Cow<'static, str>>, why: &str) -> Self {
        let param = param.into();
        ApiError {
            code: Some("unsupported_parameter"),
            ..Self::invalid_at(format!("not supported by this server: {param}{why}"), param)
        }
    }

    /// 400: a field no OpenAI endpoint of this kind has.
    pub fn unknown_field(param: impl Into<Cow<'static, str>>) -> Self {
        let param = param.into();
        ApiError {
            code: Some("unknown_parameter"),
            ..Self::invalid_at(format!("unknown field {param}"), param)
        }
    }

    /// 401: no API key, or not one of the server's (`--api-key`).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message)
        }
    }

    /// 413: the body is larger than `--max-body-bytes`.
    pub fn too_large(limit: usize) -> Self {
        ApiError {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!(
                    "the request body is larger than this server accepts ({limit} bytes, --max-body-bytes)"
                ),
            )
        }
    }

    /// 504: the request ran longer than `--request-timeout`; its generation has been stopped.
    pub fn timeout(secs: f64) -> Self {
        ApiError {
            code: Some("request_timeout"),
            no_retry: true,
            ..Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                format!(
                    "the request did not finish within {secs} s (--request-timeout); its generation was stopped"
                ),
            )
        }
    }

    /// 400: prompt and generation do not fit the context.
    pub fn context(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            param: Some(Cow::Borrowed("messages")),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    pub fn model_not_found(model: &str, served: &str) -> Self {
        ApiError {
            param: Some(Cow::Borrowed("model")),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("the model {model:?} does not exist; this server serves {served:?}"),
            )
        }
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("no route {path}"),
        )
    }

    /// 429: the queue is full; retry after a second.
    pub fn queue_full(queued: usize) -> Self {
        ApiError {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                format!("the server is at capacity ({queued} requests queued); retry later"),
            )
        }
    }

    /// 503: the model is still loading, or the server is shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable_error",
                message,
            )
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.no_retry {
            r.headers_mut().insert(
                HeaderName::from_static("x-should-retry"),
                HeaderValue::from_static("false"),
            );
        }
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}
