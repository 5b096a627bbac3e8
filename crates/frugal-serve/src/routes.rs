//! The HTTP endpoints.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use frugal::chat::ChatTemplate;
use frugal::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

pub(crate) use crate::answer::StreamLimits;
use crate::answer::{Output, collect, stream};
use crate::api::{self, Prompt};
use crate::engine::{self, EngineConfig, Event, GenRequest};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::page;
use crate::security::{self, Body};
use crate::structured::{self, Constraint, Grammars};
use crate::tools::Tools;
use crate::validate::{self, Sampling};
use crate::{Loaded, ServeConfig};

/// What every handler shares.
pub struct App {
    pub(crate) cfg: ServeConfig,
    ready: OnceLock<Ready>,
    pub(crate) shutting_down: AtomicBool,
    /// The scheduler's inbox; taken at shutdown so the scheduler ends once idle.
    pub(crate) submit: Mutex<Option<mpsc::UnboundedSender<GenRequest>>>,
}

/// The parts that exist once the model has loaded.
pub(crate) struct Ready {
    pub(crate) names: Vec<String>,
    root: String,
    pub(crate) tok: Arc<Tokenizer>,
    pub(crate) template: ChatTemplate,
    pub(crate) metrics: Arc<Metrics>,
    created: u64,
    /// Longest sequence: `--ctx`, or what the KV budget holds if that is less.
    pub(crate) ctx: usize,
    /// The model's width: the length of an embedding.
    pub(crate) n_embd: usize,
    /// The vocabulary indexed for constrained decoding (`None` if that failed).
    grammars: Option<Grammars>,
}

impl App {
    /// Admission control for one request (however many sequences it holds): refused with 429
    /// when `--max-queue` requests wait, else the scheduler's queue to send it on.
    pub(crate) fn admit(&self, r: &Ready) -> Result<mpsc::UnboundedSender<GenRequest>, ApiError> {
        let queued = r.metrics.queued();
        if queued >= self.cfg.max_queue {
            r.metrics.finished("rejected");
            return Err(ApiError::queue_full(queued));
        }
        self.submit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| ApiError::unavailable("the server is shutting down"))
    }

    pub fn new(cfg: ServeConfig) -> Self {
        App {
            cfg,
            ready: OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            submit: Mutex::new(None),
        }
    }

    /// Sizes the KV pool from the budget, starts the scheduler and opens for requests.
    pub fn install(&self, l: Loaded) -> anyhow::Result<()> {
        let c = &self.cfg;
        anyhow::ensure!(c.kv_block > 0, "--kv-block must be at least 1");
        anyhow::ensure!(c.parallel > 0, "--parallel must be at least 1");
        let probe = l.model.new_kv_pool(c.kv_format, c.kv_block, 0)?;
        let blocks = c.kv_budget / probe.block_bytes().max(1);
        anyhow::ensure!(
            blocks > 0,
            "a KV budget of {} bytes holds no block of {} positions ({} bytes each)",
            c.kv_budget,
            c.kv_block,
            probe.block_bytes()
        );
        let pool = l.model.new_kv_pool(c.kv_format, c.kv_block, blocks)?;
        if let Some(store) = &c.store {
            anyhow::ensure!(
                store.n_vocab() == l.model.config.n_vocab,
                "the datastore holds token ids of a vocabulary of {}, this model has {}: build it with this model",
                store.n_vocab(),
                l.model.config.n_vocab
            );
        }
        let ctx = c
            .ctx
            .unwrap_or(l.model.config.n_ctx_train)
            .min(blocks * c.kv_block);
        eprintln!(
            "frugal serve: {} as {:?}; KV pool {blocks} blocks of {} tokens ({} tokens, {} MiB); context {ctx}; {} parallel",
            l.root,
            l.names[0],
            c.kv_block,
            blocks * c.kv_block,
            (blocks * probe.block_bytes()) >> 20,
            c.parallel
        );
        let metrics = Arc::new(Metrics::new(&l.names[0], c.kv_block, blocks));
        let n_embd = l.model.config.n_embd;
        let tok = Arc::new(l.tokenizer);
        let t0 = std::time::Instant::now();
        let grammars = match Grammars::new(tok.clone(), l.model.config.n_vocab) {
            Ok(g) => {
                eprintln!(
                    "frugal serve: vocabulary indexed for structured output in {:.0} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
                Some(g)
            }
            Err(e) => {
                eprintln!("frugal serve: structured output unavailable: {e:#}");
                None
            }
        };
        let submit = engine::spawn(
            l.model,
            tok.clone(),
            pool,
            EngineConfig {
                parallel: c.parallel,
                ctx,
                batch_tokens: c.batch_tokens,
                prefix_cache: c.prefix_cache,
                attention: c.attention,
                threads: c.threads,
                speculate: c.speculate,
                store: c.store.clone(),
            },
            metrics.clone(),
        )?;
        *self.submit.lock().unwrap_or_else(|p| p.into_inner()) = Some(submit);
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let _ = self.ready.set(Ready {
            names: l.names,
            root: l.root,
            tok,
            template: l.template,
            metrics,
            created,
            ctx,
            grammars,
            n_embd,
        });
        Ok(())
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// Drops the scheduler's inbox: it finishes what it holds and exits.
    pub fn close(&self) {
        self.submit.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    pub(crate) fn ready(&self) -> Result<&Ready, ApiError> {
        self.ready
            .get()
            .ok_or_else(|| ApiError::unavailable("Loading model"))
    }

    fn ctx(&self) -> usize {
        self.ready.get().map_or(0, |r| r.ctx)
    }

    pub fn max_body_bytes(&self) -> usize {
        self.cfg.max_body_bytes
    }
}

type AppState = State<Arc<App>>;

/// The endpoints with their middleware ([`security`]). Health, readiness and metrics stay open
/// when the server has API keys: orchestrators and Prometheus probe them without one, and they
/// tell nothing about what clients ask. So does the page at `/` ([`page`]), which asks for the
/// key itself.
pub fn router(app: Arc<App>) -> anyhow::Result<Router> {
    let open = Router::new()
        .route("/", get(page::page))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/livez", get(|| async { (StatusCode::OK, "ok") }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics));
    let mut api = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/embeddings", post(crate::embeddings::embeddings))
        .route("/embeddings", post(crate::embeddings::embeddings))
        .route("/v1/responses", post(crate::responses::responses))
        .route("/responses", post(crate::responses::responses))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize));
    if let Some(keys) = security::require_key(&app.cfg.api_keys) {
        api = api.route_layer(keys);
    }
    let cfg = &app.cfg;
    let router = open
        .merge(api)
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .layer(DefaultBodyLimit::max(cfg.max_body_bytes));
    security::outer_layers(
        router.with_state(app.clone()),
        cfg.request_timeout,
        &cfg.cors_origins,
    )
}

async fn health(State(app): AppState) -> Response {
    match app.ready() {
        Ok(_) => axum::Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Ready for traffic: loaded and not shutting down (a gateway stops routing here first).
async fn readyz(State(app): AppState) -> Response {
    if app.shutting_down.load(Ordering::Relaxed) {
        return ApiError::unavailable("shutting down").into_response();
    }
    match app.ready() {
        Ok(_) => (StatusCode::OK, "ready").into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(app): AppState) -> Response {
    match app.ready() {
        Ok(r) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            r.metrics.render(),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

async fn models(State(app): AppState) -> Result<Response, ApiError> {
    let r = app.ready()?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": r.names[0],
            "object": "model",
            "created": r.created,
            "owned_by": "frugal",
            "root": r.root,
            "max_model_len": app.ctx(),
        }],
    }))
    .into_response())
}

async fn tokenize(State(app): AppState, Body(body): Body) -> Result<Response, ApiError> {
    let req: api::TokenizeRequest = validate::plain(&body)?;
    let r = app.ready()?;
    let tokens = r
        .tok
        .encode(&req.content, req.add_special)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("content")))?;
    Ok(axum::Json(json!({ "tokens": tokens })).into_response())
}

async fn detokenize(State(app): AppState, Body(body): Body) -> Result<Response, ApiError> {
    let req: api::DetokenizeRequest = validate::plain(&body)?;
    let r = app.ready()?;
    if let Some(&bad) = req
        .tokens
        .iter()
        .find(|&&t| t as usize >= r.tok.vocab_size())
    {
        return Err(ApiError::invalid(
            format!(
                "token {bad} is outside the vocabulary of {}",
                r.tok.vocab_size()
            ),
            Some("tokens"),
        ));
    }
    Ok(axum::Json(json!({ "content": r.tok.decode(&req.tokens) })).into_response())
}

/// Which endpoint a generation answers: the response shapes differ.
#[derive(Copy, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    /// A chat whose output is read for tool calls.
    ChatTools,
    Text,
}

async fn chat(State(app): AppState, Body(body): Body) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = validate::chat(&body)?;
    let r = app.ready()?;
    check_model(r, req.model.as_deref())?;
    let tools = Tools::parse(req.tools.as_ref(), req.tool_choice.as_ref())?;
    let prompt = chat_prompt(
        r,
        &req.messages,
        tools.as_ref().and_then(Tools::for_template),
        "messages",
    )?;
    let mut constraint = structured::request_constraint(r.grammars.as_ref(), &req.common)?;
    if let Some(g) = tools.as_ref().and_then(Tools::grammar) {
        if constraint.is_some() {
            return Err(ApiError::invalid(
                "a forced tool call (tool_choice required or a named function) cannot also follow response_format",
                Some("tool_choice"),
            ));
        }
        let grammars = r.grammars.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "forced tool calls are unavailable: this model's vocabulary could not be indexed",
                Some("tool_choice"),
            )
        })?;
        constraint = Some(grammars.compile(g).map_err(|e| {
            ApiError::invalid(format!("invalid tool parameters: {e}"), Some("tools"))
        })?);
    }
    let kind = match tools.as_ref().is_some_and(Tools::parses_calls) {
        true => Kind::ChatTools,
        false => Kind::Chat,
    };
    let job = Job {
        kind,
        prompt,
        sampling: req.sampling,
        logprobs: req.logprobs,
        constraint,
        arrived,
    };
    generate(&app, r, job).await
}

/// The messages (and the tools, when given) through the chat template with the generation
/// prompt, as token ids; `param` names the field they came from.
pub(crate) fn chat_prompt<M: serde::Serialize>(
    r: &Ready,
    messages: &[M],
    tools: Option<&[Value]>,
    param: &'static str,
) -> Result<Vec<u32>, ApiError> {
    let text = r
        .template
        .render_with_tools(messages, tools, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some(param)))?;
    r.tok
        .encode(&text, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some(param)))
}

async fn completions(State(app): AppState, Body(body): Body) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = validate::completion(&body)?;
    let r = app.ready()?;
    check_model(r, req.model.as_deref())?;
    let encode = |t: &str| {
        r.tok
            .encode(t, false)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))
    };
    let prompt = match &req.prompt {
        Prompt::Text(t) => encode(t)?,
        Prompt::Texts(v) if v.len() == 1 => encode(&v[0])?,
        Prompt::Tokens(ids) => ids.clone(),
        Prompt::TokenLists(v) if v.len() == 1 => v[0].clone(),
        _ => {
            return Err(ApiError::invalid(
                "one prompt per request (send several requests; they are batched anyway)",
                Some("prompt"),
            ));
        }
    };
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= r.tok.vocab_size()) {
        return Err(ApiError::invalid(
            format!(
                "token {bad} is outside the vocabulary of {}",
                r.tok.vocab_size()
            ),
            Some("prompt"),
        ));
    }
    let constraint = structured::request_constraint(r.grammars.as_ref(), &req.common)?;
    let job = Job {
        kind: Kind::Text,
        prompt,
        sampling: req.sampling,
        logprobs: req.logprobs,
        constraint,
        arrived,
    };
    generate(&app, r, job).await
}

pub(crate) fn check_model(r: &Ready, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !r.names.iter().any(|n| n == m) => {
            Err(ApiError::model_not_found(m, &r.names[0]))
        }
        _ => Ok(()),
    }
}

/// A validated generation request, as both endpoints hand it on.
struct Job {
    kind: Kind,
    prompt: Vec<u32>,
    sampling: Sampling,
    logprobs: Option<usize>,
    /// A grammar every choice follows (`response_format`, a forced tool call).
    constraint: Option<Constraint>,
    /// When the handler started: a stream's `--request-timeout` deadline counts from here.
    arrived: Instant,
}

/// Submits and answers (streamed or not).
async fn generate(app: &Arc<App>, r: &Ready, job: Job) -> Result<Response, ApiError> {
    let Job {
        kind,
        prompt,
        sampling: s,
        logprobs,
        constraint,
        arrived,
    } = job;
    let prompt_tokens = prompt.len();
    let rx = submit(app, r, prompt, &s, logprobs, constraint)?;
    let out = Output {
        kind,
        id: format!(
            "{}-{:016x}",
            if kind != Kind::Text {
                "chatcmpl"
            } else {
                "cmpl"
            },
            s.params.seed ^ rand_id()
        ),
        created: now_secs(),
        model: r.names[0].clone(),
        n: s.n,
        prompt_tokens,
        tok: r.tok.clone(),
    };
    if s.stream {
        Ok(stream(
            out,
            rx,
            s.include_usage,
            stream_limits(app, arrived),
        ))
    } else {
        collect(out, rx).await
    }
}

/// Validates lengths, applies admission control and queues a generation; its events come on
/// the returned channel.
pub(crate) fn submit(
    app: &App,
    r: &Ready,
    prompt: Vec<u32>,
    s: &Sampling,
    logprobs: Option<usize>,
    constraint: Option<Constraint>,
) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    if app.shutting_down.load(Ordering::Relaxed) {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let ctx = app.ctx();
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    if prompt.len() >= ctx {
        return Err(ApiError::context(format!(
            "the prompt has {} tokens; the context holds {ctx} (prompt and at least one generated token)",
            prompt.len()
        )));
    }
    let max_tokens = match s.max_tokens {
        Some(m) if prompt.len().saturating_add(m) > ctx => {
            return Err(ApiError::context(format!(
                "this model's context holds {ctx} tokens; the prompt has {} and max_tokens asks for {m} more",
                prompt.len()
            )));
        }
        Some(m) => m,
        None => ctx - prompt.len(),
    };
    let submit = app.admit(r)?;
    let (tx, rx) = mpsc::unbounded_channel();
    r.metrics.submitted();
    let req = GenRequest {
        prompt,
        n: s.n,
        max_tokens,
        min_tokens: s.min_tokens,
        sampler: s.params.clone(),
        stop: s.stop.clone(),
        logprobs,
        constraint,
        embed: None,
        events: tx,
    };
    if submit.send(req).is_err() {
        r.metrics.dequeued(true);
        return Err(ApiError::unavailable("the scheduler has stopped"));
    }
    Ok(rx)
}

/// The limits of a stream whose request arrived at `arrived`.
pub(crate) fn stream_limits(app: &App, arrived: Instant) -> StreamLimits {
    StreamLimits {
        deadline: app.cfg.request_timeout.map(|t| (arrived + t, t)),
        keep_alive: app.cfg.sse_keep_alive,
    }
}

pub(crate) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn rand_id() -> u64 {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(1);
    now_secs().rotate_left(17) ^ N.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
}
