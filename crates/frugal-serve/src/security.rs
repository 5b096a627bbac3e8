//! What stands between the network and the endpoints: API keys, CORS, the body size limit and
//! the request timeout. Each is well-kept middleware (tower-http's `cors` and
//! `validate-request`, tower's `timeout`, axum's `DefaultBodyLimit`) whose refusals are answered
//! in OpenAI's error shape, so clients raise the right exception.
//!
//! Layers, outermost first: CORS (so a preflight is answered without a key, and refusals still
//! carry the CORS headers a browser needs to read them), the timeout, then, on the API routes
//! only, the key check; the body limit applies where a handler reads the body ([`Body`]).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tower::ServiceBuilder;
use tower::timeout::TimeoutLayer;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};
use tower_http::validate_request::{ValidateRequest, ValidateRequestHeaderLayer};

use crate::error::ApiError;
use crate::routes::App;

/// The keys `--api-key` gives; empty when the API is open. Its `Debug` shows how many, never
/// the keys.
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<[String]>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.0.len())
    }
}

impl ApiKeys {
    /// Refuses keys a client could not send in an `Authorization` header as they are.
    pub fn new(keys: Vec<String>) -> anyhow::Result<Self> {
        for k in &keys {
            anyhow::ensure!(
                !k.is_empty() && k.bytes().all(|b| b.is_ascii_graphic()),
                "an API key must be printable ASCII without spaces, and not empty"
            );
        }
        Ok(ApiKeys(keys.into()))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether `given` is one of the keys, comparing every key in full so the time taken does
    /// not tell an attacker how much of a guess was right.
    fn accepts(&self, given: &[u8]) -> bool {
        self.0
            .iter()
            .fold(false, |ok, k| ok | same_bytes(k.as_bytes(), given))
    }
}

fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

impl<B> ValidateRequest<B> for ApiKeys {
    type ResponseBody = axum::body::Body;

    fn validate(&mut self, req: &mut Request<B>) -> Result<(), Response> {
        let header = req.headers().get(header::AUTHORIZATION);
        let token = header.and_then(|v| {
            let (scheme, token) = v.as_bytes().split_at(v.as_bytes().len().min(7));
            scheme.eq_ignore_ascii_case(b"bearer ").then_some(token)
        });
        match token {
            Some(t) if self.accepts(t.trim_ascii()) => Ok(()),
            Some(_) => Err(ApiError::unauthorized("incorrect API key provided").into_response()),
            None => Err(ApiError::unauthorized(
                "no API key provided: send it as the header Authorization: Bearer KEY",
            )
            .into_response()),
        }
    }
}

/// The key check, for the routes that need it (none when the server has no keys).
pub fn require_key(keys: &ApiKeys) -> Option<ValidateRequestHeaderLayer<ApiKeys>> {
    (!keys.is_empty()).then(|| ValidateRequestHeaderLayer::custom(keys.clone()))
}

/// Wraps the whole router in the timeout and CORS layers.
pub fn outer_layers(
    router: Router,
    timeout: Option<Duration>,
    cors_origins: &[String],
) -> anyhow::Result<Router> {
    let mut router = router;
    if let Some(t) = timeout {
        // Dropping the handler's future drops its event channel: the scheduler frees the
        // sequence at its next step. Streams, whose handler returns at once, keep the same
        // deadline in `routes::stream`.
        let secs = t.as_secs_f64();
        router = router.layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(
                    move |_: tower::BoxError| async move { ApiError::timeout(secs) },
                ))
                .layer(TimeoutLayer::new(t)),
        );
    }
    if let Some(cors) = cors(cors_origins)? {
        router = router.layer(cors);
    }
    Ok(router)
}

/// CORS for the given origins (`*`: any); `None` without origins: no CORS headers at all.
/// Request headers are mirrored because OpenAI's browser client sends its own (`x-stainless-*`)
/// besides `Authorization`, which a wildcard would not cover. No credentials: the API key
/// travels in a header the page sets.
fn cors(origins: &[String]) -> anyhow::Result<Option<CorsLayer>> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let mut list = Vec::with_capacity(origins.len());
        for o in origins {
            list.push(origin(o)?);
        }
        AllowOrigin::list(list)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers([header::RETRY_AFTER])
            .max_age(Duration::from_secs(3600)),
    ))
}

/// An origin as browsers send it: `scheme://host[:port]`, no path, no trailing slash.
fn origin(o: &str) -> anyhow::Result<HeaderValue> {
    let rest = o
        .strip_prefix("http://")
        .or_else(|| o.strip_prefix("https://"));
    anyhow::ensure!(
        rest.is_some_and(|r| !r.is_empty() && !r.contains('/')),
        "--cors-origin {o:?}: an origin is scheme://host[:port] (e.g. https://example.com, no path or trailing slash), or *"
    );
    Ok(HeaderValue::from_str(o)?)
}

/// A request body, read within `--max-body-bytes` (axum's `DefaultBodyLimit`); a body over the
/// limit is a 413, and any other failure to read it a 400, both as OpenAI errors.
pub struct Body(pub Bytes);

impl FromRequest<Arc<App>> for Body {
    type Rejection = ApiError;

    async fn from_request(req: Request, app: &Arc<App>) -> Result<Self, ApiError> {
        match Bytes::from_request(req, app).await {
            Ok(b) => Ok(Body(b)),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(ApiError::too_large(app.max_body_bytes()))
            }
            Err(e) => Err(ApiError::invalid(
                format!("reading the request body: {}", e.body_text()),
                None,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_in_full_and_refuse_unusable_ones() {
        let k = ApiKeys::new(vec!["sk-one".into(), "sk-two".into()]).unwrap();
        assert!(k.accepts(b"sk-one") && k.accepts(b"sk-two"));
        assert!(!k.accepts(b"sk-on") && !k.accepts(b"sk-one2") && !k.accepts(b""));
        assert!(ApiKeys::new(vec![String::new()]).is_err());
        assert!(ApiKeys::new(vec!["has space".into()]).is_err());
        assert_eq!(format!("{k:?}"), "ApiKeys(2 keys)");
    }

    #[test]
    fn origins_must_be_bare() {
        assert!(origin("https://example.com").is_ok());
        assert!(origin("http://localhost:3000").is_ok());
        assert!(origin("https://example.com/").is_err());
        assert!(origin("example.com").is_err());
        assert!(cors(&["*".into()]).unwrap().is_some());
        assert!(cors(&[]).unwrap().is_none());
    }
}
