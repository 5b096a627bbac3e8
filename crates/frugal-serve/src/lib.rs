//! `frugal serve`: an OpenAI-compatible HTTP server (axum on tokio) over the engine's batched
//! forward pass and paged KV pool.
//!
//! - [`routes`]: the endpoints: chat and text completions, models, health, metrics, tokenize
//!   (their answers, one JSON body or server-sent chunks, are built in `answer.rs`);
//!   [`embeddings`]: `/v1/embeddings`; [`responses`]: `/v1/responses`.
//! - [`engine`]: the scheduler thread: continuous batching, chunked prefill, prefix caching,
//!   preemption by recompute, cancellation.
//! - [`api`] and [`validate`]: request bodies, and what they may say (every OpenAI field is
//!   honoured or refused by name); [`error`]: OpenAI error objects; [`metrics`]: Prometheus.
//! - [`security`]: API keys, CORS, the body size limit and the request timeout.
//! - [`structured`]: `response_format` and forced tool calls by constrained decoding;
//!   [`tools`]: `tools` and `tool_choice`, and tool calls read from the output.
//! - [`page`]: the page at `/`: a chat with the model and the server's live metrics.
//!
//! The HTTP side validates and tokenizes, then hands the scheduler a [`engine::GenRequest`] with
//! a channel on which tokens come back; a client that goes away drops that channel, which the
//! scheduler notices at its next step and frees the sequence's blocks.

mod answer;
pub mod api;
pub mod embeddings;
pub mod engine;
pub mod error;
pub mod metrics;
pub mod page;
pub mod responses;
pub mod routes;
pub mod security;
pub mod structured;
pub mod tools;
pub mod validate;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use frugal::chat::ChatTemplate;
use frugal::kv::KvFormat;
use frugal::model::Model;
use frugal::tokenizer::Tokenizer;

pub use routes::App;
pub use security::ApiKeys;

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Sequences running at once.
    pub parallel: usize,
    /// Requests queued beyond the running ones before new ones get 429.
    pub max_queue: usize,
    /// Longest sequence, prompt plus generation (`None`: the model's trained context); never
    /// more than the KV budget holds.
    pub ctx: Option<usize>,
    /// Bytes of KV cache for all sequences together.
    pub kv_budget: usize,
    pub kv_format: KvFormat,
    pub kv_block: usize,
    /// Tokens per forward pass (decode steps plus prefill chunks).
    pub batch_tokens: usize,
    pub prefix_cache: bool,
    pub attention: frugal::attention::Attention,
    /// Compute threads.
    pub threads: usize,
    /// Prompt-lookup speculation: (longest suffix n, most drafted tokens K).
    pub speculate: Option<(usize, usize)>,
    /// With speculation, retrieval drafting from this datastore where prompt lookup finds
    /// nothing (`--speculate store:FILE`).
    pub store: Option<Arc<frugal::speculate::store::Datastore>>,
    /// Requests to the API (not to health, readiness and metrics) need one of these as
    /// `Authorization: Bearer KEY`; none: the API is open.
    pub api_keys: ApiKeys,
    /// Origins browsers may call the API from (`*`: any); none: no CORS headers.
    pub cors_origins: Vec<String>,
    /// Largest request body (413 beyond).
    pub max_body_bytes: usize,
    /// Longest a request may take, streamed or not (504 and its generation stopped beyond).
    pub request_timeout: Option<Duration>,
    /// Interval of the comment lines that keep an idle event stream alive.
    pub sse_keep_alive: Duration,
    /// How `/v1/embeddings` pools a sequence's hidden states.
    pub pooling: frugal::model::Pooling,
}

/// Default `max_body_bytes`: a full context of text or token ids with room to spare.
pub const DEFAULT_MAX_BODY_BYTES: usize = 8 << 20;

/// A loaded model, ready to serve.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// The names requests may use; the first is what `/v1/models` lists.
    pub names: Vec<String>,
    /// The model file (`root` in `/v1/models`).
    pub root: String,
}

/// Binds, answers `/health` with 503 while `load` runs on a blocking thread, then serves until
/// SIGTERM or Ctrl-C: stops accepting, lets the requests in flight finish, and returns.
pub async fn run(
    cfg: ServeConfig,
    load: impl FnOnce() -> anyhow::Result<Loaded> + Send + 'static,
) -> anyhow::Result<()> {
    let app = Arc::new(App::new(cfg.clone()));
    let router = routes::router(app.clone())?;
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| anyhow::anyhow!("binding {}:{}: {e}", cfg.host, cfg.port))?;
    let addr: SocketAddr = listener.local_addr()?;
    eprintln!("frugal serve: listening on http://{addr}");
    if !cfg.api_keys.is_empty() {
        eprintln!(
            "frugal serve: the API needs a key ({} accepted); /health, /livez, /readyz and /metrics stay open",
            cfg.api_keys.len()
        );
    } else if !addr.ip().is_loopback() {
        eprintln!(
            "frugal serve: warning: listening on {} without --api-key: anyone who can reach it may use it",
            addr.ip()
        );
    }
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    let loading = app.clone();
    tokio::task::spawn_blocking(move || match load().and_then(|l| loading.install(l)) {
        Ok(()) => eprintln!("frugal serve: model loaded"),
        Err(e) => {
            let _ = failed_tx.send(e);
        }
    });
    let failure = Arc::new(std::sync::Mutex::new(None));
    let failure_slot = failure.clone();
    let stopping = app.clone();
    let shutdown = async move {
        tokio::select! {
            _ = shutdown_signal() => eprintln!("frugal serve: shutting down; finishing requests in flight"),
            Ok(e) = failed_rx => {
                *failure_slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        }
        stopping.begin_shutdown();
    };
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await?;
    app.close();
    match failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(e) => Err(e.context("loading the model")),
        None => Ok(()),
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
