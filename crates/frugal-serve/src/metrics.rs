//! Counters, gauges and histograms of the server, rendered in the Prometheus text format.
//!
//! Every metric has frugal's own name (`frugal_*`) and, where a gateway reads one, vLLM's name
//! too (`vllm:*`, labelled `model_name`): the Gateway API Inference Extension's model-server
//! protocol asks for the queued requests, the running requests and the KV-cache utilization,
//! and vLLM's names are the ones its endpoint picker and llm-d already know.

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use frugal::model::RoutingStats;

/// Latency buckets (seconds) for time to first token and end-to-end latency.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// Inter-token latency buckets (seconds).
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5,
    1.0, 2.5,
];

#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), plus one for +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cum = 0;
        let sep = if labels.is_empty() { "" } else { "," };
        for (i, &b) in self.bounds.iter().enumerate() {
            cum += self.counts[i];
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        cum += self.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// Request outcomes counted by `frugal_requests_total`.
pub const OUTCOMES: [&str; 5] = ["stop", "length", "cancelled", "error", "rejected"];

/// Everything `/metrics` reports. Shared by the HTTP handlers and the scheduler thread.
#[derive(Debug)]
pub struct Metrics {
    model_name: String,
    block_size: usize,
    total_blocks: usize,
    outcomes: [AtomicU64; 5],
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    prefix_queries: AtomicU64,
    prefix_hits: AtomicU64,
    preemptions: AtomicU64,
    spec_drafted: AtomicU64,
    spec_accepted: AtomicU64,
    /// Requests submitted and not yet admitted (the HTTP side's admission control reads it).
    queued: AtomicUsize,
    running: AtomicUsize,
    waiting: AtomicUsize,
    blocks_used: AtomicUsize,
    blocks_free: AtomicUsize,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    e2e: Mutex<Histogram>,
    /// A MoE model's routing since the server started (`None` for a dense model).
    routing: Mutex<Option<RoutingStats>>,
}

impl Metrics {
    pub fn new(model_name: &str, block_size: usize, total_blocks: usize) -> Self {
        Metrics {
            model_name: model_name.to_string(),
            block_size,
            total_blocks,
            outcomes: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_queries: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            spec_drafted: AtomicU64::new(0),
            spec_accepted: AtomicU64::new(0),
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            blocks_used: AtomicUsize::new(0),
            blocks_free: AtomicUsize::new(total_blocks),
            ttft: Mutex::new(Histogram::new(LATENCY_BUCKETS)),
            itl: Mutex::new(Histogram::new(ITL_BUCKETS)),
            e2e: Mutex::new(Histogram::new(LATENCY_BUCKETS)),
            routing: Mutex::new(None),
        }
    }

    /// Counts a MoE model's routing: the scheduler hands over each step's counts (and gets
    /// them back zeroed).
    pub fn routed(&self, step: &mut RoutingStats) {
        let mut r = self.routing.lock().unwrap_or_else(|e| e.into_inner());
        match r.as_mut() {
            Some(total) => total.absorb(step),
            None => {
                let mut total = RoutingStats::new(step.load.len(), step.n_expert);
                total.absorb(step);
                *r = Some(total);
            }
        }
    }

    /// Requests waiting for admission (in the channel or the scheduler's queue).
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Relaxed)
    }

    pub fn submitted(&self) {
        self.queued.fetch_add(1, Ordering::Relaxed);
    }

    /// A request left the queue without being admitted (cancelled while waiting, or failed).
    pub fn dequeued(&self, first: bool) {
        if first {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// A sequence was admitted with `prompt` tokens, `cached` of them from the prefix cache.
    /// `first`: the request's first admission (not a choice after the first, not a recompute).
    pub fn admitted(&self, first: bool, prompt: usize, cached: usize) {
        if first {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            self.prompt_tokens
                .fetch_add(prompt as u64, Ordering::Relaxed);
        }
        self.prefix_queries
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.prefix_hits.fetch_add(cached as u64, Ordering::Relaxed);
    }

    pub fn finished(&self, outcome: &str) {
        if let Some(i) = OUTCOMES.iter().position(|&o| o == outcome) {
            self.outcomes[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn generated(&self, n: u64) {
        self.generation_tokens.fetch_add(n, Ordering::Relaxed);
    }

    pub fn preempted(&self) {
        self.preemptions.fetch_add(1, Ordering::Relaxed);
    }

    /// A speculative draft of `drafted` tokens of which `accepted` were kept.
    pub fn speculated(&self, drafted: usize, accepted: usize) {
        self.spec_drafted
            .fetch_add(drafted as u64, Ordering::Relaxed);
        self.spec_accepted
            .fetch_add(accepted as u64, Ordering::Relaxed);
    }

    pub fn ttft(&self, d: Duration) {
        observe(&self.ttft, d.as_secs_f64());
    }

    pub fn itl(&self, d: Duration) {
        observe(&self.itl, d.as_secs_f64());
    }

    pub fn e2e(&self, seconds: f64) {
        observe(&self.e2e, seconds);
    }

    pub fn set_gauges(&self, running: usize, waiting: usize, used: usize, free: usize) {
        self.running.store(running, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.blocks_used.store(used, Ordering::Relaxed);
        self.blocks_free.store(free, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let model = format!("model_name=\"{}\"", escape(&self.model_name));
        let mut metric = |name: &str, kind: &str, help: &str, lines: &[(String, String)]| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in lines {
                if labels.is_empty() {
                    let _ = writeln!(o, "{name} {v}");
                } else {
                    let _ = writeln!(o, "{name}{{{labels}}} {v}");
                }
            }
        };
        let one = |v: String| vec![(String::new(), v)];
        let with_model = |v: String| vec![(model.clone(), v)];
        let outcomes: Vec<(String, String)> = OUTCOMES
            .iter()
            .zip(&self.outcomes)
            .map(|(k, v)| (format!("outcome=\"{k}\""), get(v).to_string()))
            .collect();
        metric(
            "frugal_requests_total",
            "counter",
            "Requests by outcome: stop (end of text or a stop string), length (max_tokens or the context), cancelled (the client went away or the request timed out), error, rejected (queue full).",
            &outcomes,
        );
        let (prompt, generation) = (get(&self.prompt_tokens), get(&self.generation_tokens));
        let (queries, hits) = (get(&self.prefix_queries), get(&self.prefix_hits));
        let running = self.running.load(Ordering::Relaxed);
        // Sequences in the scheduler's queue, or requests still on their way to it.
        let waiting = self.waiting.load(Ordering::Relaxed).max(self.queued());
        let (used, free) = (
            self.blocks_used.load(Ordering::Relaxed),
            self.blocks_free.load(Ordering::Relaxed),
        );
        let usage = used as f64 / self.total_blocks.max(1) as f64;
        for (names, kind, help, v) in [
            (
                ["frugal_prompt_tokens_total", "vllm:prompt_tokens_total"],
                "counter",
                "Prompt tokens of admitted requests (cached ones included).",
                prompt.to_string(),
            ),
            (
                [
                    "frugal_generation_tokens_total",
                    "vllm:generation_tokens_total",
                ],
                "counter",
                "Tokens generated.",
                generation.to_string(),
            ),
            (
                [
                    "frugal_prefix_cache_queries_total",
                    "vllm:prefix_cache_queries_total",
                ],
                "counter",
                "Prompt tokens looked up in the prefix cache (recomputed ones included).",
                queries.to_string(),
            ),
            (
                [
                    "frugal_prefix_cache_hit_tokens_total",
                    "vllm:prefix_cache_hits_total",
                ],
                "counter",
                "Prompt tokens whose keys and values came from the prefix cache.",
                hits.to_string(),
            ),
            (
                ["frugal_requests_running", "vllm:num_requests_running"],
                "gauge",
                "Sequences in the running batch.",
                running.to_string(),
            ),
            (
                ["frugal_requests_waiting", "vllm:num_requests_waiting"],
                "gauge",
                "Sequences waiting for admission.",
                waiting.to_string(),
            ),
            (
                ["frugal_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"],
                "gauge",
                "Fraction of KV blocks held by sequences (0-1).",
                format!("{usage}"),
            ),
        ] {
            metric(names[0], kind, help, &one(v.clone()));
            metric(names[1], kind, help, &with_model(v));
        }
        metric(
            "frugal_kv_blocks_used",
            "gauge",
            "KV blocks held by sequences.",
            &one(used.to_string()),
        );
        metric(
            "frugal_kv_blocks_free",
            "gauge",
            "KV blocks free, cached ones without a sequence included (evicted on demand).",
            &one(free.to_string()),
        );
        metric(
            "frugal_preemptions_total",
            "counter",
            "Sequences preempted (freed and later recomputed) because the pool ran out.",
            &one(get(&self.preemptions).to_string()),
        );
        metric(
            "frugal_spec_draft_tokens_total",
            "counter",
            "Tokens drafted by speculation (--speculate: prompt lookup, retrieval).",
            &one(get(&self.spec_drafted).to_string()),
        );
        metric(
            "frugal_spec_accepted_tokens_total",
            "counter",
            "Drafted tokens the model accepted.",
            &one(get(&self.spec_accepted).to_string()),
        );
        metric(
            "vllm:cache_config_info",
            "gauge",
            "KV cache configuration (labels).",
            &[(
                format!(
                    "{model},block_size=\"{}\",num_gpu_blocks=\"{}\"",
                    self.block_size, self.total_blocks
                ),
                "1".into(),
            )],
        );
        for (hist, names, help) in [
            (
                &self.ttft,
                [
                    "frugal_time_to_first_token_seconds",
                    "vllm:time_to_first_token_seconds",
                ],
                "Time from arrival to the first generated token.",
            ),
            (
                &self.itl,
                [
                    "frugal_inter_token_latency_seconds",
                    "vllm:inter_token_latency_seconds",
                ],
                "Time between consecutive tokens of a sequence.",
            ),
            (
                &self.e2e,
                [
                    "frugal_e2e_request_latency_seconds",
                    "vllm:e2e_request_latency_seconds",
                ],
                "Time from arrival to the last token.",
            ),
        ] {
            let h = hist.lock().unwrap_or_else(|e| e.into_inner());
            for (name, labels) in [(names[0], String::new()), (names[1], model.clone())] {
                let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
                h.render(&mut o, name, &labels);
            }
        }
        self.render_routing(&mut o);
        o
    }

    /// Per layer of a MoE model: tokens per expert (a counter), the busiest expert over the
    /// mean, the load's coefficient of variation and the mean routing entropy (gauges over
    /// everything routed since the start), and the three most co-selected pairs.
    fn render_routing(&self, o: &mut String) {
        let r = self.routing.lock().unwrap_or_else(|e| e.into_inner());
        let Some(stats) = r.as_ref() else {
            return;
        };
        let layers: Vec<_> = (0..stats.load.len())
            .filter_map(|l| stats.layer(l))
            .collect();
        let mut family = |name: &str, kind: &str, help: &str, lines: Vec<String>| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for l in lines {
                let _ = writeln!(o, "{name}{l}");
            }
        };
        family(
            "frugal_moe_expert_tokens_total",
            "counter",
            "Tokens routed to each expert of each layer.",
            stats
                .load
                .iter()
                .enumerate()
                .flat_map(|(l, load)| {
                    load.iter()
                        .enumerate()
                        .map(move |(e, n)| format!("{{layer=\"{l}\",expert=\"{e}\"}} {n}"))
                })
                .collect(),
        );
        let per_layer = |f: fn(&frugal::model::moe::LayerRouting) -> f64| -> Vec<String> {
            layers
                .iter()
                .map(|l| format!("{{layer=\"{}\"}} {}", l.layer, f(l)))
                .collect()
        };
        family(
            "frugal_moe_busiest_over_mean",
            "gauge",
            "The busiest expert's load over the mean load, per layer (1 when balanced).",
            per_layer(|l| l.max_over_mean),
        );
        family(
            "frugal_moe_load_cv",
            "gauge",
            "Coefficient of variation of the experts' loads, per layer (0 when balanced).",
            per_layer(|l| l.cv),
        );
        family(
            "frugal_moe_routing_entropy_nats",
            "gauge",
            "Mean entropy of a token's routing probabilities, per layer (at most ln E).",
            per_layer(|l| l.entropy),
        );
        family(
            "frugal_moe_top_pair_tokens",
            "gauge",
            "Tokens that chose both experts of the layer's most co-selected pairs (rank 1-3).",
            layers
                .iter()
                .flat_map(|l| {
                    l.top_pairs.iter().enumerate().map(move |(i, (a, b, n))| {
                        format!(
                            "{{layer=\"{}\",rank=\"{}\",a=\"{a}\",b=\"{b}\"}} {n}",
                            l.layer,
                            i + 1
                        )
                    })
                })
                .collect(),
        );
    }
}

fn observe(h: &Mutex<Histogram>, v: f64) {
    h.lock().unwrap_or_else(|e| e.into_inner()).observe(v);
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_has_help_and_type_and_histograms_are_cumulative() {
        let m = Metrics::new("smollm2", 16, 100);
        m.submitted();
        m.admitted(true, 30, 16);
        m.ttft(Duration::from_millis(30));
        m.ttft(Duration::from_millis(300));
        m.finished("stop");
        let text = m.render();
        let mut last = "";
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                last = rest.split(' ').next().unwrap();
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                assert!(name.starts_with(last), "{name} has no HELP");
            }
        }
        assert!(text.contains("frugal_requests_total{outcome=\"stop\"} 1"));
        assert!(text.contains("vllm:prefix_cache_hits_total{model_name=\"smollm2\"} 16"));
        assert!(text.contains("frugal_time_to_first_token_seconds_bucket{le=\"0.04\"} 1"));
        assert!(text.contains("frugal_time_to_first_token_seconds_bucket{le=\"+Inf\"} 2"));
        assert_eq!(m.queued(), 0);
        assert!(
            !text.contains("frugal_moe_"),
            "a dense model has no routing"
        );
    }

    #[test]
    fn routing_is_summed_across_steps_and_rendered_per_layer() {
        use frugal::model::moe::Route;
        let m = Metrics::new("moe", 16, 100);
        let mut step = RoutingStats::new(2, 4);
        let probs = [0.4, 0.3, 0.2, 0.1];
        for experts in [[0, 1], [0, 2], [0, 1]] {
            let r = Route {
                experts: experts.to_vec(),
                weights: vec![0.5, 0.5],
            };
            step.record(1, &r, &probs);
        }
        m.routed(&mut step);
        assert_eq!(step.tokens, vec![0, 0], "the step's counts are handed over");
        step.record(
            1,
            &Route {
                experts: vec![3, 0],
                weights: vec![0.5, 0.5],
            },
            &probs,
        );
        m.routed(&mut step);
        let text = m.render();
        assert!(text.contains("frugal_moe_expert_tokens_total{layer=\"1\",expert=\"0\"} 4"));
        assert!(text.contains("frugal_moe_expert_tokens_total{layer=\"1\",expert=\"3\"} 1"));
        // 4 of 8 slots on expert 0: 0.5 of the load against a mean of 0.25.
        assert!(text.contains("frugal_moe_busiest_over_mean{layer=\"1\"} 2"));
        assert!(
            text.contains("frugal_moe_top_pair_tokens{layer=\"1\",rank=\"1\",a=\"0\",b=\"1\"} 2")
        );
        assert!(
            !text.contains("busiest_over_mean{layer=\"0\"}"),
            "layer 0 routed nothing"
        );
    }
}
