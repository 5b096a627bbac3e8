//! The scheduler: one thread owns the model and the KV pool and advances every running
//! sequence by one batched forward pass per iteration (continuous batching, as Orca).
//!
//! Each iteration:
//! 1. takes new requests from the channel and drops sequences whose client went away (the
//!    receiving end of their event channel is closed), freeing their blocks at once;
//! 2. admits waiting sequences, first come first served, while there is a slot (`parallel`)
//!    and the pool has blocks for the prompt; a prompt first attaches the longest prefix of
//!    its full blocks that the pool has cached, and computes only the rest;
//! 3. builds the batch under a token budget: one token for every decoding sequence first, then
//!    chunks of prompts (chunked prefill, as Sarathi), so a long prompt never stalls the
//!    streams already running;
//! 4. when the pool cannot hold the batch, preempts the most recently admitted sequence: its
//!    blocks are freed (cached ones stay cached) and it goes back to the front of the queue to
//!    be recomputed later from its prompt and what it has generated so far (vLLM V1's policy);
//! 5. runs the pass, registers newly filled blocks in the prefix cache, samples the next token
//!    of every sequence whose input is all computed, and streams it out.
//!
//! A sequence's tokens are the same whatever ran beside it: the forward pass gives each row the
//! same bits alone or batched, chunked or not, recomputed or not (`Model::forward_batch`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use frugal::attention::Attention;
use frugal::generate::StopFilter;
use frugal::kv::prefix::{BlockHash, extend_block_hashes};
use frugal::kv::{KvPool, SeqId};
use frugal::model::{Model, Pooler, Pooling, RoutingStats, Scratch, Segment};
use frugal::ops::log_sum_exp;
use frugal::sample::{Sampler, SamplerParams};
use frugal::speculate::store::{DEFAULT_MATCH, Datastore, Retrieval};
use frugal::speculate::{LOOKUP_PASS_COST, ngram, rule};
use frugal::tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc;

use crate::metrics::Metrics;
use crate::structured::Constraint;

mod speculation;

/// Why a choice ended, in OpenAI's words.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// One alternative of a log-probability list.
#[derive(Clone, Debug)]
pub struct TopLogprob {
    pub token: u32,
    pub logprob: f32,
}

/// The log-probability of a generated token under the model (before any sampling
/// transformation), and the most likely alternatives when asked for.
#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub logprob: f32,
    pub top: Vec<TopLogprob>,
}

/// What the scheduler tells a request's handler.
#[derive(Debug)]
pub enum Event {
    /// The prompt of choice 0 was admitted; `cached` of its tokens came from the prefix cache.
    Admitted { cached: usize },
    /// A generated token of `choice` and the text it completes (possibly empty: an incomplete
    /// UTF-8 character, or text held back as the possible start of a stop string).
    Token {
        choice: usize,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// `choice` ended; `text` is what was still held back.
    Finished {
        choice: usize,
        reason: Finish,
        text: String,
        completion_tokens: usize,
    },
    /// The request cannot be served (its tokens can never fit the pool).
    Failed(String),
    /// An embedding request's vector (its only event besides `Admitted`).
    Embedding(Vec<f32>),
}

/// A request as the scheduler receives it: tokens and sampling, already validated.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    /// Choices (`n`): independent continuations of the same prompt.
    pub n: usize,
    pub max_tokens: usize,
    /// Before this many generated tokens the end-of-generation tokens cannot be sampled
    /// (`usize::MAX`: never, `ignore_eos`).
    pub min_tokens: usize,
    pub sampler: SamplerParams,
    pub stop: Vec<String>,
    /// `Some(k)`: report each token's log-probability and its `k` most likely alternatives.
    pub logprobs: Option<usize>,
    /// `Some`: an embedding. The prompt is computed in the batches like any other (chunked
    /// prefill keeps a long input from stalling the decodes), its hidden states are pooled, and
    /// the vector is sent as [`Event::Embedding`]; nothing is generated (`n` 1, `max_tokens` 0).
    pub embed: Option<Pooling>,
    /// Where the scheduler sends this request's events. Unbounded on purpose: the scheduler
    /// must never wait for a client, and a bounded channel would leave it the choice between
    /// blocking on a slow reader (stalling every sequence in the batch) and cancelling a client
    /// that is merely behind. What a slow reader can make it buffer is bounded anyway: one
    /// `Token` per generated token, so at most `n * (max_tokens + 1) + 1` events, and
    /// `max_tokens` never exceeds the context. A reader that stops reading is ended by
    /// `--request-timeout`; one that disconnects drops the receiver, and the scheduler frees
    /// its sequences at its next step (`Seq::cancelled`).
    /// A grammar every choice's output must follow (`response_format`, forced tool calls);
    /// each choice gets its own copy.
    pub constraint: Option<Constraint>,
    pub events: mpsc::UnboundedSender<Event>,
}

/// The scheduler's limits.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Sequences running at once.
    pub parallel: usize,
    /// Longest sequence (prompt + generation).
    pub ctx: usize,
    /// Tokens per forward pass: decode steps plus prefill chunks.
    pub batch_tokens: usize,
    pub prefix_cache: bool,
    /// Attention kernel (both are exact).
    pub attention: Attention,
    /// Threads of the scheduler's compute pool.
    pub threads: usize,
    /// Prompt-lookup speculation: (longest suffix n, most drafted tokens K).
    pub speculate: Option<(usize, usize)>,
    /// With speculation, retrieval from this datastore where prompt lookup finds nothing.
    pub store: Option<Arc<Datastore>>,
}

/// Speculation runs only while at most this many sequences decode: in a larger batch the step
/// is compute-bound, and the extra rows of a draft cost about as much as the tokens they save.
const SPECULATE_MAX_BATCH: usize = 4;

/// What the choices of one request share.
struct Shared {
    events: mpsc::UnboundedSender<Event>,
    stop: Vec<String>,
    logprobs: Option<usize>,
    max_tokens: usize,
    min_tokens: usize,
    prompt_len: usize,
    /// Choice 0 has computed the prompt: the other choices may start (and find its blocks in
    /// the prefix cache instead of computing the prompt again).
    prompt_done: AtomicBool,
    arrived: Instant,
}

/// One choice of a request: a sequence in the pool while it runs.
struct Seq {
    shared: Arc<Shared>,
    choice: usize,
    /// Prompt, then every generated token: what a recompute after preemption must feed.
    tokens: Vec<u32>,
    /// The slot in the pool while running.
    kv: Option<SeqId>,
    /// Tokens whose keys and values are in the pool.
    computed: usize,
    generated: usize,
    sampler: Sampler,
    decoder: StreamDecoder,
    stop: StopFilter,
    /// Chained hashes of the full blocks of `tokens` computed so far, and how many of them are
    /// registered in the pool.
    hashes: Vec<BlockHash>,
    registered: usize,
    last_token_at: Option<Instant>,
    /// Ended by a stop string (the text from it on is never sent).
    stop_hit: bool,
    /// Admitted before (it is back in the queue after a preemption): its request has left the
    /// admission queue already.
    admitted_before: bool,
    /// With speculation: prompt lookup with its draft length policy, and this step's draft.
    lookup: Option<ngram::Lookup>,
    /// Retrieval from the server's datastore, and whether this step's draft came from it.
    retrieval: Option<Retrieval>,
    from_store: bool,
    draft: Vec<u32>,
    /// The grammar the output follows: its mask applies before every sample, and such a
    /// sequence never speculates.
    constraint: Option<Box<Constraint>>,
    /// An embedding's hidden states so far.
    embed: Option<Pooler>,
}

impl Seq {
    fn cancelled(&self) -> bool {
        self.shared.events.is_closed()
    }
}

/// Starts the scheduler. Requests arrive on the returned channel; dropping every sender ends
/// it once the sequences in flight have finished. It runs on a worker of its own compute pool,
/// so each product of a step is handed to workers that are still spinning.
pub fn spawn(
    model: Model,
    tok: Arc<Tokenizer>,
    pool: KvPool,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<mpsc::UnboundedSender<GenRequest>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let workers = rayon::ThreadPoolBuilder::new()
        .num_threads(cfg.threads.max(1))
        .thread_name(|i| format!("frugal-compute-{i}"))
        .build()?;
    let mut scratch = Scratch::new(cfg.attention);
    // A MoE model counts its routing for /metrics.
    if let Some(m) = model.config.moe {
        scratch.moe.stats = Some(RoutingStats::new(model.config.n_layers, m.n_expert));
    }
    std::thread::Builder::new()
        .name("frugal-scheduler".into())
        .spawn(move || {
            let s = Scheduler {
                model,
                tok,
                pool,
                cfg,
                metrics,
                scratch,
                waiting: VecDeque::new(),
                running: Vec::new(),
                verify_ws: rule::Workspace::default(),
            };
            workers.install(move || s.run(rx))
        })?;
    Ok(tx)
}

struct Scheduler {
    model: Model,
    tok: Arc<Tokenizer>,
    pool: KvPool,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    scratch: Scratch,
    waiting: VecDeque<Seq>,
    /// In admission order (the last one is preempted first).
    running: Vec<Seq>,
    verify_ws: rule::Workspace,
}

impl Scheduler {
    fn run(mut self, mut rx: mpsc::UnboundedReceiver<GenRequest>) {
        let mut open = true;
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                if !open {
                    return;
                }
                // Idle: sleep until a request arrives (or every sender is gone).
                match rx.blocking_recv() {
                    Some(r) => self.enqueue(r),
                    None => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(r) => self.enqueue(r),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.drop_cancelled();
            self.admit();
            self.publish_gauges();
            // (The step publishes them again when sequences finish: the loop may then sleep.)
            if !self.step() {
                // Nothing could run (waiting for blocks that no running sequence will free
                // is impossible: admission checks the total); avoid spinning.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn enqueue(&mut self, r: GenRequest) {
        let shared = Arc::new(Shared {
            events: r.events,
            stop: r.stop,
            logprobs: r.logprobs,
            max_tokens: r.max_tokens,
            min_tokens: r.min_tokens,
            prompt_len: r.prompt.len(),
            prompt_done: AtomicBool::new(false),
            arrived: Instant::now(),
        });
        let bs = self.pool.block_size();
        let need = (r.prompt.len() + r.max_tokens).div_ceil(bs);
        if need > self.pool.total_blocks() {
            self.metrics.finished("error");
            self.metrics.dequeued(true);
            let _ = shared.events.send(Event::Failed(format!(
                "the prompt and max_tokens need {need} KV blocks of {bs} tokens; the KV budget holds {}",
                self.pool.total_blocks()
            )));
            return;
        }
        let constraint = r.constraint.map(Box::new);
        let n_embd = self.model.config.n_embd;
        let embed = r.embed.map(|p| Pooler::new(p, n_embd));
        // Speculation drafts tokens to generate; an embedding generates none.
        let speculate = self.cfg.speculate.filter(|_| embed.is_none());
        for choice in 0..r.n {
            let mut params = r.sampler.clone();
            params.seed = params.seed.wrapping_add(choice as u64);
            self.waiting.push_back(Seq {
                shared: shared.clone(),
                choice,
                tokens: r.prompt.clone(),
                kv: None,
                computed: 0,
                generated: 0,
                sampler: Sampler::new(params),
                decoder: StreamDecoder::default(),
                stop: StopFilter::new(&shared.stop),
                hashes: Vec::new(),
                registered: 0,
                last_token_at: None,
                stop_hit: false,
                admitted_before: false,
                lookup: speculate.map(|(n, k)| ngram::Lookup::new(n, k, true, LOOKUP_PASS_COST)),
                retrieval: speculate.zip(self.cfg.store.clone()).map(|((_, k), st)| {
                    Retrieval::new(st, DEFAULT_MATCH, k, true, LOOKUP_PASS_COST)
                }),
                from_store: false,
                draft: Vec::new(),
                constraint: constraint.as_ref().map(|c| Box::new(c.fork())),
                embed: embed.clone(),
            });
        }
    }

    /// Ends every sequence whose client has gone: its blocks return to the pool now.
    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                let s = self.running.remove(i);
                self.release(&s);
                if s.choice == 0 {
                    self.metrics.finished("cancelled");
                }
            } else {
                i += 1;
            }
        }
        let metrics = &self.metrics;
        self.waiting.retain(|s| {
            if !s.cancelled() {
                return true;
            }
            if s.choice == 0 {
                metrics.finished("cancelled");
                metrics.dequeued(!s.admitted_before);
            }
            false
        });
    }

    fn release(&mut self, s: &Seq) {
        if let Some(id) = s.kv {
            // The id was created by this scheduler and removed nowhere else.
            let _ = self.pool.remove(id);
        }
    }

    /// Admits waiting sequences in order while a slot and the blocks for their prompt exist.
    fn admit(&mut self) {
        let bs = self.pool.block_size();
        while self.running.len() < self.cfg.parallel {
            let Some(s) = self.waiting.front() else {
                return;
            };
            if s.choice > 0 && !s.shared.prompt_done.load(Ordering::Relaxed) {
                // Wait for choice 0 to compute the prompt; later requests may go first.
                match self
                    .waiting
                    .iter()
                    .position(|w| w.choice == 0 || w.shared.prompt_done.load(Ordering::Relaxed))
                {
                    Some(j) => {
                        let w = self.waiting.remove(j).expect("index from position");
                        self.waiting.push_front(w);
                        continue;
                    }
                    None => return,
                }
            }
            let mut hashes = std::mem::take(&mut self.waiting[0].hashes);
            let tokens = &self.waiting[0].tokens;
            extend_block_hashes(&mut hashes, tokens, bs);
            // Always leave at least the last token to compute: its logits start generation.
            let max_cached = (tokens.len() - 1) / bs;
            // Mean pooling needs every token's state: none may come from the cache.
            let every_row = self.waiting[0]
                .embed
                .as_ref()
                .is_some_and(|p| p.pooling().needs_every_row());
            let cached_blocks = if self.cfg.prefix_cache && !every_row {
                self.pool.cached_prefix(&hashes).min(max_cached)
            } else {
                0
            };
            // Blocks for the rest of the prompt, plus one per running sequence so the decode
            // steps already promised do not immediately force a preemption.
            let need = tokens.len().div_ceil(bs) - cached_blocks + self.running.len();
            // Cached blocks this prompt attaches are counted free but will not be evicted.
            if need + cached_blocks > self.pool.free_blocks() && !self.running.is_empty() {
                self.waiting[0].hashes = hashes;
                return;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            s.hashes = hashes;
            let id = self.pool.add_sequence(self.cfg.ctx);
            let got = if self.cfg.prefix_cache {
                self.pool.attach_prefix(id, &s.hashes, cached_blocks)
            } else {
                0
            };
            s.kv = Some(id);
            s.computed = got * bs;
            s.registered = got;
            let first = s.choice == 0 && !s.admitted_before;
            s.admitted_before = true;
            self.metrics.admitted(first, s.tokens.len(), s.computed);
            if first {
                let _ = s.shared.events.send(Event::Admitted { cached: s.computed });
            }
            self.running.push(s);
        }
    }

    fn publish_gauges(&self) {
        self.metrics.set_gauges(
            self.running.len(),
            self.waiting.len(),
            self.pool.blocks_in_use(),
            self.pool.free_blocks(),
        );
    }

    /// One forward pass over the batch; false when nothing could run.
    fn step(&mut self) -> bool {
        self.draft();
        let plan = self.plan();
        if plan.is_empty() {
            return false;
        }
        // A decoding sequence's draft rides behind its token, appended for the pass only.
        for &(i, n) in &plan {
            let s = &mut self.running[i];
            s.draft.truncate(n - 1);
            if s.tokens.len() - s.computed == 1 && !s.draft.is_empty() {
                let d = std::mem::take(&mut s.draft);
                s.tokens.extend_from_slice(&d);
                s.draft = d;
            } else {
                s.draft.clear();
            }
        }
        let segs: Vec<Segment> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                Segment {
                    seq: s.kv.expect("running sequences hold a slot"),
                    tokens: &s.tokens[s.computed..s.computed + n],
                    logits: s.computed + n == s.tokens.len() && s.embed.is_none(),
                    all_logits: !s.draft.is_empty(),
                }
            })
            .collect();
        // The scratch (which holds the logits) is moved out for the step, so the logits can be
        // read in place while the sequences are advanced.
        let mut scratch = std::mem::take(&mut self.scratch);
        match self
            .model
            .forward_batch(&segs, &mut self.pool, &mut scratch)
        {
            Ok(_) => {}
            Err(e) => {
                self.scratch = scratch;
                // The plan fits the pool, so this is a bug or a bad token id: fail the
                // sequences of this batch rather than the server.
                for &(i, _) in plan.iter().rev() {
                    let s = self.running.remove(i);
                    self.release(&s);
                    self.metrics.finished("error");
                    let _ = s.shared.events.send(Event::Failed(e.to_string()));
                }
                return true;
            }
        }
        let (v, d) = (self.model.config.n_vocab, self.model.config.n_embd);
        let (logits, hidden) = (scratch.logits(v), scratch.hidden());
        // `row`: the next row of the logits; `first`: the segment's first row of the batch.
        let (mut row, mut first) = (0, 0);
        let mut done = Vec::new();
        for &(i, n) in &plan {
            let batch_rows = first * d..(first + n) * d;
            first += n;
            if let Some(p) = self.running[i].embed.as_mut() {
                p.push(&self.model, &hidden[batch_rows]);
                self.running[i].computed += n;
                self.register_blocks(i);
                let s = &self.running[i];
                if s.computed == s.tokens.len() {
                    done.push((i, Finish::Stop));
                }
                continue;
            }
            if !self.running[i].draft.is_empty() {
                let rows = &logits[row * v..(row + n) * v];
                row += n;
                if let Some(reason) = self.verify(i, rows) {
                    done.push((i, reason));
                }
                continue;
            }
            self.running[i].computed += n;
            self.register_blocks(i);
            let s = &self.running[i];
            if s.computed < s.tokens.len() {
                continue; // a prompt chunk before the last
            }
            let l = &logits[row * v..(row + 1) * v];
            row += 1;
            if s.choice == 0 && s.generated == 0 {
                s.shared.prompt_done.store(true, Ordering::Relaxed);
            }
            if let Some(reason) = self.advance(i, l) {
                done.push((i, reason));
            }
        }
        if let Some(step) = scratch.moe.stats.as_mut() {
            self.metrics.routed(step);
        }
        self.scratch = scratch;
        // Finished sequences leave the batch and the counters and gauges are updated before
        // their clients hear of it, so /metrics read after a response already shows it.
        let mut finished = Vec::with_capacity(done.len());
        for &(i, reason) in done.iter().rev() {
            let s = self.running.remove(i);
            self.release(&s);
            if s.choice == 0 {
                self.metrics.finished(reason.as_str());
                self.metrics.e2e(s.shared.arrived.elapsed().as_secs_f64());
            }
            finished.push((s, reason));
        }
        if !finished.is_empty() {
            self.publish_gauges();
        }
        for (mut s, reason) in finished {
            if let Some(p) = &s.embed {
                let _ = s.shared.events.send(Event::Embedding(p.finish()));
                continue;
            }
            let mut text = String::new();
            if !s.stop_hit {
                let rest = s.decoder.finish();
                let (emit, hit) = s.stop.push(&rest);
                text = emit;
                if !hit {
                    text.push_str(&s.stop.flush());
                }
            }
            let _ = s.shared.events.send(Event::Finished {
                choice: s.choice,
                reason,
                text,
                completion_tokens: s.generated,
            });
        }
        true
    }

    /// Which running sequences feed how many tokens this step: decodes first, then prompt
    /// chunks, within the token budget; preempts the newest sequences until the pool can hold
    /// the plan.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        loop {
            let mut budget = self.cfg.batch_tokens.max(1);
            let mut plan = Vec::new();
            for (i, s) in self.running.iter().enumerate() {
                if s.tokens.len() - s.computed == 1 && budget > 0 {
                    // The token, then as much of its draft as the budget allows.
                    let n = (1 + s.draft.len()).min(budget);
                    plan.push((i, n));
                    budget -= n;
                }
            }
            for (i, s) in self.running.iter().enumerate() {
                let rest = s.tokens.len() - s.computed;
                if rest > 1 && budget > 0 {
                    // A sliding-window ring takes at most one chunk per pass.
                    let n = rest.min(budget).min(self.pool.max_chunk());
                    plan.push((i, n));
                    budget -= n;
                }
            }
            plan.sort_unstable();
            let bs = self.pool.block_size();
            let need: usize = plan
                .iter()
                .map(|&(i, n)| {
                    let s = &self.running[i];
                    let have = s.computed.div_ceil(bs);
                    (s.computed + n).div_ceil(bs) - have
                })
                .sum();
            if need <= self.pool.free_blocks() || self.running.len() <= 1 {
                return plan;
            }
            self.preempt();
        }
    }

    /// Frees the newest running sequence's blocks and queues it first, to be recomputed.
    fn preempt(&mut self) {
        let Some(mut s) = self.running.pop() else {
            return;
        };
        self.release(&s);
        s.kv = None;
        s.computed = 0;
        s.registered = 0;
        if let Some(p) = &mut s.embed {
            p.reset();
        }
        self.metrics.preempted();
        self.waiting.push_front(s);
    }

    /// Registers the blocks of sequence `i` that became full and computed.
    fn register_blocks(&mut self, i: usize) {
        if !self.cfg.prefix_cache {
            return;
        }
        let bs = self.pool.block_size();
        let s = &mut self.running[i];
        let full = s.computed / bs;
        if full <= s.registered {
            return;
        }
        extend_block_hashes(&mut s.hashes, &s.tokens[..full * bs], bs);
        let id = s.kv.expect("running");
        for b in s.registered..full {
            self.pool.register_block(id, b, s.hashes[b]);
        }
        s.registered = full;
    }

    /// Samples sequence `i`'s next token from `logits` and streams it; returns why the
    /// sequence ends, if it does.
    fn advance(&mut self, i: usize, logits: &[f32]) -> Option<Finish> {
        let tok = self.tok.clone();
        let s = &mut self.running[i];
        let generated = &s.tokens[s.shared.prompt_len..];
        // Before `min_tokens`, the end-of-generation tokens cannot be drawn (vLLM's min_tokens).
        let banned = if s.generated < s.shared.min_tokens {
            tok.end_of_generation_ids()
        } else {
            &[]
        };
        let next = match s.constraint.as_mut() {
            None => s
                .sampler
                .sample_banning(logits, &s.tokens, generated, banned),
            Some(c) => match c.mask(logits) {
                Some(masked) => {
                    let next = s
                        .sampler
                        .sample_banning(masked, &s.tokens, generated, banned);
                    // The bans may have left nothing the grammar allows.
                    if masked[next as usize] == f32::NEG_INFINITY {
                        return Some(Finish::Stop);
                    }
                    next
                }
                None => return Some(Finish::Stop),
            },
        };
        self.emit(i, next, logits)
    }

    /// Streams `next`, the token chosen for sequence `i` from `logits`; returns why the sequence
    /// ends, if it does.
    fn emit(&mut self, i: usize, next: u32, logits: &[f32]) -> Option<Finish> {
        let tok = self.tok.clone();
        let ctx = self.cfg.ctx;
        let s = &mut self.running[i];
        let now = Instant::now();
        match s.last_token_at {
            None if s.choice == 0 => self.metrics.ttft(now - s.shared.arrived),
            Some(t) => self.metrics.itl(now - t),
            None => {}
        }
        s.last_token_at = Some(now);
        if tok.is_end_of_generation(next) {
            return Some(Finish::Stop);
        }
        let grammar_done = match s.constraint.as_mut() {
            None => false,
            Some(c) => !c.commit(next) || c.is_done(),
        };
        let logprob = s.shared.logprobs.map(|k| token_logprob(logits, next, k));
        s.tokens.push(next);
        s.generated += 1;
        self.metrics.generated(1);
        let piece = s.decoder.push(tok.token_bytes(next, false));
        let (text, hit) = s.stop.push(&piece);
        let _ = s.shared.events.send(Event::Token {
            choice: s.choice,
            token: next,
            text,
            logprob,
        });
        if hit {
            s.stop_hit = true;
            Some(Finish::Stop)
        } else if grammar_done {
            Some(Finish::Stop)
        } else if s.generated >= s.shared.max_tokens || s.tokens.len() >= ctx {
            Some(Finish::Length)
        } else {
            None
        }
    }
}

/// The model's log-probability of `token` and its `k` most likely tokens.
fn token_logprob(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
    let lse = log_sum_exp(logits);
    let lp = |t: u32| (f64::from(logits[t as usize]) - lse) as f32;
    let mut top: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(top.len());
    let by = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    if k > 0 && k < top.len() {
        top.select_nth_unstable_by(k - 1, by);
    }
    top.truncate(k);
    top.sort_unstable_by(by);
    TokenLogprob {
        logprob: lp(token),
        top: top
            .into_iter()
            .map(|t| TopLogprob {
                token: t,
                logprob: lp(t),
            })
            .collect(),
    }
}
