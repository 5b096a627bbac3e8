//! The HTTP layer without a model: the router of a server whose model is still loading answers
//! a valid generation request with 503, so each refusal that must come first (API key, CORS,
//! body size, validation) is seen as the client would see it, in OpenAI's error shape.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Method, Request, StatusCode, header};
use frugal_serve::{ApiKeys, App, ServeConfig, routes};
use serde_json::Value;
use tower::ServiceExt;

fn config() -> ServeConfig {
    ServeConfig {
        host: "127.0.0.1".into(),
        port: 0,
        parallel: 1,
        max_queue: 1,
        ctx: None,
        kv_budget: 1 << 20,
        kv_format: Default::default(),
        kv_block: 16,
        batch_tokens: 16,
        prefix_cache: true,
        attention: Default::default(),
        threads: 1,
        speculate: None,
        store: None,
        api_keys: ApiKeys::default(),
        cors_origins: vec![],
        max_body_bytes: frugal_serve::DEFAULT_MAX_BODY_BYTES,
        request_timeout: Some(Duration::from_secs(60)),
        sse_keep_alive: Duration::from_secs(15),
        pooling: Default::default(),
    }
}

fn router(change: impl FnOnce(&mut ServeConfig)) -> Router {
    let mut cfg = config();
    change(&mut cfg);
    routes::router(Arc::new(App::new(cfg))).expect("a valid configuration")
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    /// The OpenAI error object, checked for shape.
    fn error(&self) -> serde_json::Map<String, Value> {
        let v: Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)));
        let err = v["error"].as_object().expect("an error object").clone();
        for k in ["message", "type", "param", "code"] {
            assert!(err.contains_key(k), "no {k} in {err:?}");
        }
        err
    }

    fn param(&self) -> String {
        self.error()["param"].as_str().unwrap_or("").to_owned()
    }
}

async fn send(router: &Router, req: Request<Body>) -> Answer {
    let r = router.clone().oneshot(req).await.expect("infallible");
    let status = r.status();
    let headers = r.headers().clone();
    let body = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .expect("a body")
        .to_vec();
    Answer {
        status,
        headers,
        body,
    }
}

fn get(path: &str, key: Option<&str>) -> Request<Body> {
    let mut b = Request::get(path);
    if let Some(k) = key {
        b = b.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    b.body(Body::empty()).unwrap()
}

fn post(path: &str, key: Option<&str>, body: impl Into<Body>) -> Request<Body> {
    let mut b = Request::post(path).header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = key {
        b = b.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    b.body(body.into()).unwrap()
}

const CHAT: &str = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}"#;

#[tokio::test]
async fn api_keys_guard_the_api_and_leave_health_open() {
    let r = router(|c| c.api_keys = ApiKeys::new(vec!["sk-a".into(), "sk-b".into()]).unwrap());
    for path in ["/v1/models", "/models"] {
        let a = send(&r, get(path, None)).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{path}");
        assert_eq!(a.error()["code"], "invalid_api_key");
        assert_eq!(a.headers[header::WWW_AUTHENTICATE], "Bearer");
        let a = send(&r, get(path, Some("sk-c"))).await;
        assert_eq!(
            a.status,
            StatusCode::UNAUTHORIZED,
            "{path} with a wrong key"
        );
    }
    for key in [None, Some("sk-"), Some("sk-aa")] {
        let a = send(&r, post("/v1/chat/completions", key, CHAT)).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{key:?}");
        let a = send(&r, post("/tokenize", key, r#"{"content":"a"}"#)).await;
        assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{key:?}");
    }
    // Either key passes (and meets the model still loading).
    for key in ["sk-a", "sk-b"] {
        let a = send(&r, post("/v1/chat/completions", Some(key), CHAT)).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{key}");
        let a = send(&r, get("/v1/models", Some(key))).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{key}");
    }
    // "bearer" in any case, as RFC 6750's scheme names are.
    let req = Request::get("/v1/models")
        .header(header::AUTHORIZATION, "bearer sk-b")
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&r, req).await.status, StatusCode::SERVICE_UNAVAILABLE);
    // Probes need no key: loading is 503 (not 401), liveness 200.
    for path in ["/health", "/v1/health", "/readyz", "/metrics"] {
        let a = send(&r, get(path, None)).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE, "{path}");
    }
    assert_eq!(send(&r, get("/livez", None)).await.status, StatusCode::OK);
}

#[tokio::test]
async fn without_keys_the_api_is_open() {
    let r = router(|_| {});
    let a = send(&r, get("/v1/models", None)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
}

fn preflight(origin: &str) -> Request<Body> {
    Request::builder()
        .method(Method::OPTIONS)
        .uri("/v1/chat/completions")
        .header(header::ORIGIN, origin)
        .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
        .header(
            header::ACCESS_CONTROL_REQUEST_HEADERS,
            "authorization, content-type, x-stainless-os",
        )
        .body(Body::empty())
        .unwrap()
}

#[tokio::test]
async fn cors_answers_listed_origins_only() {
    let r = router(|c| {
        c.cors_origins = vec!["https://a.example".into(), "http://localhost:3000".into()];
        c.api_keys = ApiKeys::new(vec!["sk-a".into()]).unwrap();
    });
    for origin in ["https://a.example", "http://localhost:3000"] {
        let a = send(&r, preflight(origin)).await;
        assert!(a.status.is_success(), "{origin}: {}", a.status);
        assert_eq!(a.headers[header::ACCESS_CONTROL_ALLOW_ORIGIN], origin);
        let headers = a.headers[header::ACCESS_CONTROL_ALLOW_HEADERS]
            .to_str()
            .unwrap();
        assert!(headers.contains("authorization"), "{headers}");
        let methods = a.headers[header::ACCESS_CONTROL_ALLOW_METHODS]
            .to_str()
            .unwrap();
        assert!(methods.contains("POST"), "{methods}");
    }
    let a = send(&r, preflight("https://b.example")).await;
    assert!(!a.headers.contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN));
    // A refusal carries the header too, so the page can read the error.
    let req = Request::get("/v1/models")
        .header(header::ORIGIN, "https://a.example")
        .body(Body::empty())
        .unwrap();
    let a = send(&r, req).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        a.headers[header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://a.example"
    );

    let any = router(|c| c.cors_origins = vec!["*".into()]);
    let a = send(&any, preflight("https://b.example")).await;
    assert_eq!(a.headers[header::ACCESS_CONTROL_ALLOW_ORIGIN], "*");

    let none = router(|_| {});
    let a = send(&none, preflight("https://a.example")).await;
    assert!(!a.headers.contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN));
}

#[test]
fn a_malformed_origin_is_a_startup_error() {
    let mut cfg = config();
    cfg.cors_origins = vec!["https://a.example/".into()];
    assert!(routes::router(Arc::new(App::new(cfg))).is_err());
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_in_openai_shape() {
    let r = router(|c| c.max_body_bytes = 1024);
    let big = format!(r#"{{"prompt":"{}","max_tokens":1}}"#, "x".repeat(2000));
    let a = send(&r, post("/v1/completions", None, big.clone())).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(a.error()["code"], "request_too_large");
    // Chunked, without a Content-Length.
    let chunks: Vec<Vec<u8>> = big.into_bytes().chunks(100).map(<[u8]>::to_vec).collect();
    let body = Body::from_stream(async_stream::stream! {
        for c in chunks {
            yield Ok::<_, std::io::Error>(c);
        }
    });
    let a = send(&r, post("/v1/chat/completions", None, body)).await;
    assert_eq!(a.status, StatusCode::PAYLOAD_TOO_LARGE);
    a.error();
    // Under the limit: through to the loading model.
    let a = send(&r, post("/v1/completions", None, r#"{"prompt":"hi"}"#)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn refusals_name_their_field_before_the_model_is_needed() {
    let r = router(|_| {});
    for (path, body, param) in [
        ("/v1/completions", r#"{"prompt":"hi","tools":[]}"#, "tools"),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"hi"}],"temperatur":1}"#,
            "temperatur",
        ),
        (
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user"}]}"#,
            "messages[0].content",
        ),
        ("/v1/completions", r#"{"prompt":"hi","echo":true}"#, "echo"),
        (
            "/v1/completions",
            r#"{"prompt":"hi","max_tokens":"ten"}"#,
            "max_tokens",
        ),
        ("/v1/completions", r#"{"prompt":"hi","n":0}"#, "n"),
        (
            "/tokenize",
            r#"{"content":"hi","with_pieces":true}"#,
            "with_pieces",
        ),
        (
            "/v1/embeddings",
            r#"{"input":"hi","encoding_format":"int8"}"#,
            "encoding_format",
        ),
        ("/v1/embeddings", r#"{"input":["hi",""]}"#, "input[1]"),
        ("/v1/responses", r#"{"input":"hi","store":true}"#, "store"),
        (
            "/v1/responses",
            r#"{"input":"hi","previous_response_id":"resp_1"}"#,
            "previous_response_id",
        ),
    ] {
        let a = send(&r, post(path, None, body)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(a.param(), param, "{body}");
        assert_eq!(a.error()["type"], "invalid_request_error");
    }
    // Valid embeddings and responses requests reach the loading model (the routes exist).
    let a = send(&r, post("/v1/embeddings", None, r#"{"input":"hi"}"#)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    let a = send(&r, post("/v1/responses", None, r#"{"input":"hi"}"#)).await;
    assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
    for body in ["{\"prompt\": ", "", "[]", "null"] {
        let a = send(&r, post("/v1/completions", None, body)).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body:?}");
        a.error();
    }
}

/// The page at `/` loads without a key (it asks for one itself), while the model loads, and
/// carries what the browser test and a person need: the chat form, the stop button, the
/// metrics panel, the key field. Its policy keeps it talking to this server only.
#[tokio::test]
async fn the_page_is_open_and_holds_the_chat_and_the_metrics() {
    let keyed = router(|c| c.api_keys = ApiKeys::new(vec!["sk-a".into()]).unwrap());
    for r in [router(|_| {}), keyed] {
        let a = send(&r, get("/", None)).await;
        assert_eq!(a.status, StatusCode::OK);
        assert_eq!(a.headers[header::CONTENT_TYPE], "text/html; charset=utf-8");
        let csp = a.headers[header::CONTENT_SECURITY_POLICY].to_str().unwrap();
        assert!(
            csp.contains("connect-src 'self'") && csp.contains("default-src 'none'"),
            "{csp}"
        );
        let html = String::from_utf8(a.body).unwrap();
        assert_eq!(html, frugal_serve::page::PAGE);
        for id in [
            "chat-form",
            "prompt",
            "send",
            "stop",
            "messages",
            "metrics",
            "m-running",
            "m-queued",
            "m-kv-used",
            "m-kv-total",
            "m-tps",
            "m-gen-tokens",
            "m-prefix-rate",
            "model-name",
            "api-key",
        ] {
            assert!(html.contains(&format!("id=\"{id}\"")), "no element {id}");
        }
        // Every form control has a label (ids of inputs, textareas and selects).
        let controls = ["<input", "<textarea", "<select"]
            .into_iter()
            .flat_map(|tag| html.split(tag).skip(1));
        for control in controls {
            let id = control
                .split("id=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .expect("a control with an id");
            assert!(html.contains(&format!("for=\"{id}\"")), "no label for {id}");
        }
        // Self-contained: nothing loaded from elsewhere.
        for outside in ["src=\"http", "href=\"http", "//cdn", "@import"] {
            assert!(!html.contains(outside), "{outside}");
        }
    }
}
