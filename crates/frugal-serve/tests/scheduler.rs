//! The scheduler on a small model the test builds: continuous batching, chunked prefill,
//! prefix caching, preemption and cancellation change which sequences share a pass, never the
//! tokens a sequence gets. The reference for every sequence is the single-sequence decoding
//! loop (`Session::generate`, what `frugal generate` runs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use frugal::generate::{GenerateOptions, Session};
use frugal::gguf::GgufFile;
use frugal::kv::KvFormat;
use frugal::model::Gating;
use frugal::model::synthetic::{SyntheticMoe, SyntheticSpec, build};
use frugal::model::{Model, Pooling, Scratch};
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;
use frugal::sample::SamplerParams;
use frugal::speculate::store::Datastore;
use frugal::tokenizer::Tokenizer;
use frugal_serve::engine::{self, EngineConfig, Event, GenRequest};
use frugal_serve::metrics::Metrics;
use tokio::sync::mpsc;

fn model() -> (Model, Tokenizer) {
    model_with(None)
}

/// The test model, dense or with routed experts in every layer.
fn model_with(moe: Option<SyntheticMoe>) -> (Model, Tokenizer) {
    let spec = SyntheticSpec {
        n_layers: 2,
        n_embd: 64,
        n_ff: 128,
        n_head: 4,
        n_head_kv: 2,
        n_ctx: 1024,
        ty: GgmlType::Q4_1,
        seed: 7,
        moe,
        ..Default::default()
    };
    let file = GgufFile::from_bytes(build(&spec)).unwrap();
    let tok = Tokenizer::from_gguf(&file).unwrap();
    let mut m = Model::from_file(file).unwrap();
    m.set_activations(Activations::Q8);
    (m, tok)
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 7919) >> 9) % 256)
        .collect()
}

/// Greedy tokens of `p` alone, as `frugal generate --temp 0` computes them.
fn alone(m: &Model, tok: &Tokenizer, p: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut s = Session::new(m, 1024, true).unwrap();
    let opts = GenerateOptions {
        max_tokens,
        stop: vec![],
        sampler: SamplerParams::greedy(),
    };
    s.generate(tok, p, &opts, |_| {}).unwrap().tokens
}

struct Server {
    submit: mpsc::UnboundedSender<GenRequest>,
    metrics: Arc<Metrics>,
}

fn server(blocks: usize, parallel: usize, batch_tokens: usize, prefix_cache: bool) -> Server {
    server_spec(blocks, parallel, batch_tokens, prefix_cache, None)
}

fn server_spec(
    blocks: usize,
    parallel: usize,
    batch_tokens: usize,
    prefix_cache: bool,
    speculate: Option<(usize, usize)>,
) -> Server {
    server_of(
        model(),
        blocks,
        parallel,
        batch_tokens,
        prefix_cache,
        speculate,
        None,
    )
}

fn server_of(
    (m, tok): (Model, Tokenizer),
    blocks: usize,
    parallel: usize,
    batch_tokens: usize,
    prefix_cache: bool,
    speculate: Option<(usize, usize)>,
    store: Option<Arc<Datastore>>,
) -> Server {
    let pool = m.new_kv_pool(KvFormat::default(), 16, blocks).unwrap();
    let metrics = Arc::new(Metrics::new("synthetic", 16, blocks));
    let cfg = EngineConfig {
        parallel,
        ctx: 1024,
        batch_tokens,
        prefix_cache,
        attention: Default::default(),
        threads: 2,
        speculate,
        store,
    };
    let submit = engine::spawn(m, Arc::new(tok), pool, cfg, metrics.clone()).unwrap();
    Server { submit, metrics }
}

fn request(s: &Server, p: &[u32], max_tokens: usize) -> mpsc::UnboundedReceiver<Event> {
    request_min(s, p, max_tokens, 0)
}

fn request_min(
    s: &Server,
    p: &[u32],
    max_tokens: usize,
    min_tokens: usize,
) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    s.metrics.submitted();
    s.submit
        .send(GenRequest {
            prompt: p.to_vec(),
            n: 1,
            max_tokens,
            min_tokens,
            sampler: SamplerParams::greedy(),
            stop: vec![],
            logprobs: None,
            constraint: None,
            embed: None,
            events: tx,
        })
        .unwrap();
    rx
}

/// Tokens of a request's only choice, and how many prompt tokens came from the cache.
fn tokens(mut rx: mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, usize) {
    let (mut out, mut cached) = (Vec::new(), 0);
    loop {
        match rx.blocking_recv().expect("the scheduler answers") {
            Event::Admitted { cached: c } => cached = c,
            Event::Token { token, .. } => out.push(token),
            Event::Finished { .. } => return (out, cached),
            Event::Failed(e) => panic!("request failed: {e}"),
            Event::Embedding(_) => panic!("an embedding answered a generation"),
        }
    }
}

/// The value of counter `name` in the metrics' text (0 when absent).
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or(0)
}

fn cases() -> Vec<(Vec<u32>, usize)> {
    [(5, 20), (70, 12), (300, 16), (33, 25), (600, 8), (17, 30)]
        .iter()
        .enumerate()
        .map(|(i, &(len, max))| (prompt(len, i as u32), max))
        .collect()
}

#[test]
fn prompt_lookup_speculation_gives_the_lone_tokens() {
    let (m, tok) = model();
    // Prompts that repeat a motif, so prompt lookup finds drafts; 3 requests speculate (a
    // small batch), 8 do not until most have finished.
    for n_requests in [3, 8] {
        let cases: Vec<(Vec<u32>, usize)> = (0..n_requests)
            .map(|i| {
                let motif = prompt(10, 40 + i as u32);
                let mut p = motif.clone();
                p.extend(prompt(15, 60 + i as u32));
                p.extend_from_slice(&motif);
                p.extend_from_slice(&motif[..5]);
                (p, 24 + i)
            })
            .collect();
        let want: Vec<_> = cases.iter().map(|(p, n)| alone(&m, &tok, p, *n)).collect();
        let s = server_spec(512, 16, 64, true, Some((3, 6)));
        let rxs: Vec<_> = cases.iter().map(|(p, n)| request(&s, p, *n)).collect();
        for (i, (rx, w)) in rxs.into_iter().zip(&want).enumerate() {
            assert_eq!(&tokens(rx).0, w, "{n_requests} requests: request {i}");
        }
        let text = s.metrics.render();
        assert!(
            metric(&text, "frugal_spec_draft_tokens_total") > 0,
            "{text}"
        );
    }
}

/// Retrieval drafting in the server: a datastore of the answers themselves, every fourth
/// token changed, drafts where prompt lookup finds nothing. The tokens stay the lone ones. The
/// test model answers each prompt with one token repeated, which prompt lookup copies from the
/// second decode step on; at the first, a prompt without that token gives lookup nothing to
/// match, and only the store drafts: with at most 3 sequences decoding (under the batch limit,
/// so every step drafts) more drafted tokens are kept than by prompt lookup alone.
#[test]
fn retrieval_speculation_gives_the_lone_tokens() {
    let (m, tok) = model();
    // Each prompt loses the token its answer starts with until the answer starts with another.
    let mut cases = cases();
    for (p, n) in &mut cases {
        for _ in 0..64 {
            let first = alone(&m, &tok, p, *n)[0];
            if !p.contains(&first) || p.iter().all(|&t| t == first) {
                break;
            }
            p.retain(|&t| t != first);
        }
    }
    let want: Vec<_> = cases.iter().map(|(p, n)| alone(&m, &tok, p, *n)).collect();
    let n_vocab = m.config.n_vocab;
    let docs: Vec<Vec<u32>> = want
        .iter()
        .map(|w| {
            let mut d = w.clone();
            for (j, t) in d.iter_mut().enumerate() {
                if j % 4 == 3 {
                    *t = (*t + 1) % n_vocab as u32;
                }
            }
            d
        })
        .collect();
    let store = Arc::new(Datastore::new(docs.iter().map(Vec::as_slice), n_vocab).unwrap());
    assert!(
        (0..cases.len()).any(|i| !cases[i].0.contains(&want[i][0])),
        "no prompt lacks its answer's first token"
    );
    let mut kept = Vec::new();
    for store in [None, Some(store)] {
        let s = server_of(model(), 512, 3, 64, true, Some((3, 6)), store);
        let rxs: Vec<_> = cases.iter().map(|(p, n)| request(&s, p, *n)).collect();
        for (i, (rx, w)) in rxs.into_iter().zip(&want).enumerate() {
            assert_eq!(&tokens(rx).0, w, "request {i}");
        }
        let text = s.metrics.render();
        kept.push(metric(&text, "frugal_spec_accepted_tokens_total"));
    }
    assert!(
        kept[1] > kept[0],
        "the store keeps more drafts than lookup alone: {kept:?}"
    );
}

#[test]
fn concurrent_requests_get_their_lone_tokens() {
    let (m, tok) = model();
    let cases = cases();
    let want: Vec<_> = cases.iter().map(|(p, n)| alone(&m, &tok, p, *n)).collect();
    // A small token budget forces chunked prefill beside the decode steps.
    let s = server(512, 16, 48, true);
    let rxs: Vec<_> = cases.iter().map(|(p, n)| request(&s, p, *n)).collect();
    for (i, (rx, w)) in rxs.into_iter().zip(&want).enumerate() {
        assert_eq!(&tokens(rx).0, w, "request {i}");
    }
}

#[test]
fn a_repeated_prefix_is_computed_once_and_changes_nothing() {
    let (m, tok) = model();
    let s = server(512, 4, 256, true);
    let base = prompt(100, 9);
    let (first, cached) = tokens(request(&s, &base, 10));
    assert_eq!(cached, 0);
    // The same 96 tokens (six full blocks) and another ending.
    let mut other = base[..96].to_vec();
    other.extend(prompt(30, 3));
    let (got, cached) = tokens(request(&s, &other, 10));
    assert_eq!(cached, 96);
    assert_eq!(got, alone(&m, &tok, &other, 10));
    // The identical prompt again: everything but the last token from the cache.
    let (again, cached) = tokens(request(&s, &base, 10));
    assert_eq!((again, cached), (first, 96));
}

#[test]
fn preempted_sequences_are_recomputed_to_the_same_tokens() {
    let (m, tok) = model();
    // Short prompts are admitted at once; their generations outgrow the 24 blocks (384
    // positions) of the pool together, so the newest are preempted and recomputed.
    let cases: Vec<_> = (0..5)
        .map(|i| (prompt(20 + i, 40 + i as u32), 120))
        .collect();
    let s = server(24, 6, 128, false);
    let rxs: Vec<_> = cases.iter().map(|(p, n)| request(&s, p, *n)).collect();
    for (i, (rx, (p, n))) in rxs.into_iter().zip(&cases).enumerate() {
        assert_eq!(tokens(rx).0, alone(&m, &tok, p, *n), "request {i}");
    }
    let text = s.metrics.render();
    let pre = text
        .lines()
        .find_map(|l| l.strip_prefix("frugal_preemptions_total "))
        .unwrap();
    assert!(
        pre.parse::<u64>().unwrap() > 0,
        "the pool was too small: {pre}"
    );
    // A recomputed request leaves the admission queue once, not at every readmission.
    assert_eq!(s.metrics.queued(), 0);
}

#[test]
fn a_client_that_goes_away_frees_its_blocks() {
    let s = server(512, 4, 256, false);
    let mut rx = request(&s, &prompt(50, 1), 500);
    let mut seen = 0;
    while seen < 3 {
        if let Event::Token { .. } = rx.blocking_recv().unwrap() {
            seen += 1;
        }
    }
    drop(rx);
    let t = Instant::now();
    loop {
        let text = s.metrics.render();
        let used = text.contains("frugal_kv_blocks_used 0\n");
        let cancelled = text.contains("frugal_requests_total{outcome=\"cancelled\"} 1\n");
        if used && cancelled {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{text}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A MoE model served in batches gives every sequence its lone tokens, and `/metrics` counts
/// every routed token: per layer, `k` expert slots for each token the model ran.
/// A client that never reads holds nothing up: its sequence generates to its end while the
/// request beside it is served (the scheduler never waits on an event channel), and every event
/// waits for it in order.
#[test]
fn a_reader_that_never_reads_holds_nothing_up() {
    let s = server(512, 2, 256, false);
    let stalled = request_min(&s, &prompt(20, 3), 300, 300);
    let (other, _) = tokens(request_min(&s, &prompt(30, 4), 40, 40));
    assert_eq!(other.len(), 40);
    let t = Instant::now();
    loop {
        let text = s.metrics.render();
        let ended = metric(&text, "frugal_requests_total{outcome=\"length\"}");
        if ended == 2 && metric(&text, "frugal_requests_running") == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the unread request did not run to its end:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let (got, _) = tokens(stalled);
    assert_eq!(got.len(), 300);
}

#[test]
fn moe_model_batches_exactly_and_reports_its_routing() {
    let moe = SyntheticMoe {
        n_expert: 4,
        n_used: 2,
        gating: Gating::Softmax,
        n_ff_shared: 0,
        selection_bias: false,
    };
    let (m, tok) = model_with(Some(moe.clone()));
    let s = server_of(model_with(Some(moe)), 512, 16, 64, false, None, None);
    let rxs: Vec<_> = cases()
        .iter()
        .map(|(p, max)| (request(&s, p, *max), p.clone(), *max))
        .collect();
    let mut computed = 0;
    for (rx, p, max) in rxs {
        let (got, _) = tokens(rx);
        assert_eq!(got, alone(&m, &tok, &p, max), "prompt of {}", p.len());
        // The prompt, and every generated token but the last, went through the model.
        computed += p.len() + got.len() - 1;
    }
    let text = s.metrics.render();
    for layer in 0..2 {
        let routed: u64 = (0..4)
            .map(|e| {
                let key =
                    format!("frugal_moe_expert_tokens_total{{layer=\"{layer}\",expert=\"{e}\"}} ");
                let line = text.lines().find(|l| l.starts_with(&key)).expect(&key);
                line[key.len()..].parse::<u64>().unwrap()
            })
            .sum();
        assert_eq!(routed, 2 * computed as u64, "layer {layer}");
    }
    assert!(text.contains("frugal_moe_busiest_over_mean{layer=\"1\"}"));
}

fn embed_request(s: &Server, p: &[u32], pooling: Pooling) -> mpsc::UnboundedReceiver<Event> {
    let (tx, rx) = mpsc::unbounded_channel();
    s.metrics.submitted();
    s.submit
        .send(GenRequest {
            prompt: p.to_vec(),
            n: 1,
            max_tokens: 0,
            min_tokens: 0,
            sampler: SamplerParams::greedy(),
            stop: vec![],
            logprobs: None,
            constraint: None,
            embed: Some(pooling),
            events: tx,
        })
        .unwrap();
    rx
}

fn embedding(mut rx: mpsc::UnboundedReceiver<Event>) -> Vec<f32> {
    loop {
        match rx.blocking_recv().expect("the scheduler answers") {
            Event::Admitted { .. } => {}
            Event::Embedding(v) => return v,
            e => panic!("an embedding request got {e:?}"),
        }
    }
}

#[test]
fn embeddings_batched_with_generation_equal_their_lone_vectors() {
    let (m, tok) = model();
    let mut sc = Scratch::default();
    // A budget of 48 tokens splits the longer inputs into prefill chunks beside the decodes;
    // the prefix cache is on, so a repeated input would be served from it where pooling allows.
    let s = server(512, 16, 48, true);
    let gen_cases = cases();
    let gens: Vec<_> = gen_cases.iter().map(|(p, n)| request(&s, p, *n)).collect();
    let inputs: Vec<_> = [3, 70, 200, 1, 70]
        .iter()
        .enumerate()
        .map(|(i, &len)| prompt(len, 100 + (i as u32 % 3)))
        .collect();
    for pooling in [Pooling::Mean, Pooling::Last] {
        let rxs: Vec<_> = inputs
            .iter()
            .map(|p| embed_request(&s, p, pooling))
            .collect();
        for (i, rx) in rxs.into_iter().enumerate() {
            let got = embedding(rx);
            let want = m.sentence_embedding(&inputs[i], pooling, &mut sc).unwrap();
            assert_eq!(got.len(), m.config.n_embd);
            let diff = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-6, "{pooling:?} input {i}: {diff}");
        }
    }
    for (i, (rx, (p, n))) in gens.into_iter().zip(&gen_cases).enumerate() {
        assert_eq!(tokens(rx).0, alone(&m, &tok, p, *n), "generation {i}");
    }
    // Inputs 1 and 4 are the same tokens: the same vector; others differ.
    let a = embedding(embed_request(&s, &inputs[1], Pooling::Mean));
    let b = embedding(embed_request(&s, &inputs[4], Pooling::Mean));
    let c = embedding(embed_request(&s, &inputs[2], Pooling::Mean));
    assert_eq!(a, b);
    assert_ne!(a, c);
}
