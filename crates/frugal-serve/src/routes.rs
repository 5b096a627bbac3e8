//! The HTTP endpoints.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use frugal::chat::ChatTemplate;
use frugal::tokenizer::Tokenizer;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::api::{self, Prompt};
use crate::engine::{self, EngineConfig, Event, GenRequest, TokenLogprob};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::page;
use crate::security::{self, Body};
use crate::structured::{self, Constraint, Grammars};
use crate::tools::{self, CallSplitter, Piece, Tools};
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
enum Kind {
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
    let queued = r.metrics.queued();
    if queued >= app.cfg.max_queue {
        r.metrics.finished("rejected");
        return Err(ApiError::queue_full(queued));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let submit = app
        .submit
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .ok_or_else(|| ApiError::unavailable("the server is shutting down"))?;
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

/// What the response's JSON needs besides the events.
struct Output {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    n: usize,
    prompt_tokens: usize,
    tok: Arc<Tokenizer>,
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

async fn collect(
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
fn stream(
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
