//! `frugal bench speculate`: for each drafter, the acceptance rate, the tokens per target pass
//! and the decode speed-up over plain decoding measured in the same run, beside the speed-up
//! Leviathan et al.'s formula predicts from the measured acceptance, draft length and cost
//! ratio. Two kinds of prompt: input-grounded (rewrite or edit a given text or code: the output
//! copies the input, n-gram's home) and open generation.
//!
//! Runs are greedy, so every drafter must produce the plain run's tokens; the bench checks it
//! and fails otherwise. Plain and speculative runs alternate within each repetition, and the
//! reported speed-up is the median over repetitions of the per-repetition ratio, so a noisy
//! neighbour affects both sides alike.

use frugal::bench::median;
use std::time::Instant;

use anyhow::{Context, Result};
use frugal::chat::{ChatTemplate, Message};
use frugal::generate::{GenerateOptions, Generation, Session};
use frugal::model::Model;
use frugal::sample::SamplerParams;
use frugal::speculate::{PassCost, SpecOptions, SpecStats};
use frugal::tokenizer::Tokenizer;

use super::OutputArgs;
use super::plot::{Chart, Series};
use crate::commands::common::{self, EngineArgs, ModelArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Drafters to measure, comma-separated (as --speculate takes them; K is the maximum)
    #[arg(
        long = "drafters",
        default_value = "ngram,self:4,self:8",
        value_delimiter = ','
    )]
    pub drafters: Vec<String>,
    /// Fixed draft lengths to sweep for the chart (besides the adaptive run)
    #[arg(long = "k", default_value = "1,2,4,8", value_delimiter = ',')]
    pub ks: Vec<usize>,
    /// Tokens generated per prompt
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128)]
    pub max_tokens: usize,
    /// Repetitions (medians are reported)
    #[arg(long = "reps", default_value_t = 3)]
    pub reps: usize,
    /// Only the adaptive runs (no K sweep)
    #[arg(long = "no-sweep")]
    pub no_sweep: bool,
    /// Also run each draft: model with its head restricted to its first N token ids (FR-Spec)
    #[arg(long = "draft-vocab", value_name = "N")]
    pub draft_vocab: Option<usize>,
    /// Cost of each verified row after the first, relative to a decode step, as the adaptive
    /// draft length of a model-based drafter assumes it (default: frugal's built-in figure)
    #[arg(long = "row-cost", value_name = "V")]
    pub row_cost: Option<f64>,
    /// Cost of the first verified row (default: --row-cost when given, else the built-in
    /// figure)
    #[arg(long = "first-row-cost", value_name = "V")]
    pub first_row_cost: Option<f64>,
    /// Print the bench's prompts (JSON: input-grounded and open) and exit, to run a peer on
    /// the same ones (`scripts/speculate-vs-llama-server`)
    #[arg(long = "list-prompts")]
    pub list_prompts: bool,
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Prompts whose answer copies much of the prompt.
const GROUNDED: [&str; 3] = [
    "Rewrite the following paragraph, keeping every sentence but replacing the word \"river\" with \"stream\":\n\nThe river starts in the mountains, where snow melts in spring. The river runs through three towns and a forest. In summer the river is slow and warm, and children swim in the river near the old bridge. In autumn the river carries leaves down to the sea.",
    "Add a docstring to this Python function and return the whole function:\n\ndef moving_average(values, window):\n    if window <= 0:\n        raise ValueError(\"window must be positive\")\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n            total -= values[i - window]\n        if i >= window - 1:\n            out.append(total / window)\n    return out",
    "Copy this list, sorted alphabetically, one item per line:\n\npear\napple\norange\nbanana\ncherry\ngrape\nlemon\nmango\npeach\nplum\napricot\nkiwi",
];

/// Prompts with nothing to copy.
const OPEN: [&str; 3] = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five tips for learning to play the guitar.",
];

struct Run {
    tokens: Vec<u32>,
    seconds: f64,
    decoded: usize,
    spec: Option<SpecStats>,
}

fn plain(model: &Model, tok: &Tokenizer, a: &Args, ids: &[u32]) -> Result<Run> {
    let kv = a.engine.kv_options()?;
    let mut s = Session::with_options(
        model,
        ids.len() + a.max_tokens + 1,
        true,
        &kv,
        a.engine.attention()?,
    )?;
    let g = s.generate(tok, ids, &options(a), |_| {})?;
    Ok(run_of(g, None))
}

fn options(a: &Args) -> GenerateOptions {
    GenerateOptions {
        max_tokens: a.max_tokens,
        stop: Vec::new(),
        sampler: SamplerParams::greedy(),
    }
}

fn run_of(g: Generation, spec: Option<SpecStats>) -> Run {
    Run {
        seconds: g.stats.decode_seconds,
        decoded: g.stats.decode_tokens,
        tokens: g.tokens,
        spec,
    }
}

fn speculative(
    model: &Model,
    tok: &Tokenizer,
    a: &Args,
    ids: &[u32],
    o: &SpecOptions,
) -> Result<(Run, f64)> {
    let kv = a.engine.kv_options()?;
    let ctx = ids.len() + a.max_tokens + 1;
    let mut s = common::speculator(model, ctx, &kv, a.engine.attention()?, o)?;
    for v in [a.row_cost, a.first_row_cost].into_iter().flatten() {
        anyhow::ensure!(
            v.is_finite() && v >= 0.0,
            "a row cost is a fraction of a decode step (0 or more), not {v}"
        );
    }
    if let Some(v) = a.row_cost {
        s.pass_cost = PassCost::flat(v);
    }
    if let Some(v) = a.first_row_cost {
        s.pass_cost.first_row = v;
    }
    let cost = s.draft_cost();
    let (g, st) = s.generate(tok, ids, &options(a), |_| {})?;
    Ok((run_of(g, Some(st)), cost))
}

/// Leviathan et al.: expected tokens per pass and the wall-time speed-up for acceptance `a`,
/// draft length `k` and draft cost ratio `c` (verification assumed to cost one decode step).
fn leviathan(a: f64, k: f64, c: f64) -> (f64, f64) {
    let a = a.clamp(0.0, 0.9999);
    let e = (1.0 - a.powf(k + 1.0)) / (1.0 - a);
    (e, e / (k * c + 1.0))
}

/// The measured relative time of a pass over `rows` tokens, interpolated between the measured
/// row counts.
fn pass_cost(costs: &[(usize, f64)], rows: f64) -> f64 {
    let mut prev = (1.0, 1.0);
    for &(n, r) in costs {
        let n = n as f64;
        if rows <= n {
            let t = if n > prev.0 {
                (rows - prev.0) / (n - prev.0)
            } else {
                0.0
            };
            return prev.1 + t * (r - prev.1);
        }
        prev = (n, r);
    }
    prev.1
}

#[derive(serde::Serialize)]
struct Row {
    drafter: String,
    kind: &'static str,
    k: String,
    acceptance: f64,
    tokens_per_pass: f64,
    mean_draft: f64,
    speedup: f64,
    cost_ratio: f64,
    predicted_tokens_per_pass: f64,
    predicted_speedup: f64,
    /// Leviathan's expected tokens per pass over this machine's cost of such a pass.
    predicted_with_pass_cost: f64,
    plain_tok_s: f64,
    spec_tok_s: f64,
}

/// Time of a target pass over `rows` new tokens after a 128-token prefix, relative to a
/// one-token decode step (median of `reps` x 10 passes each): what a verification of `rows - 1`
/// drafted tokens costs. On a memory-bound accelerator this stays near 1; on a CPU the extra
/// rows are extra arithmetic.
fn pass_costs(model: &Model, a: &Args, rows: &[usize]) -> Result<Vec<(usize, f64)>> {
    let kv = a.engine.kv_options()?;
    let mut cache = model.new_seq_cache(256, &kv)?;
    let mut s = frugal::model::Scratch::new(a.engine.attention()?);
    let v = model.config.n_vocab as u32;
    let prefix: Vec<u32> = (0..128u32).map(|i| (i * 7919 + 13) % (v - 1) + 1).collect();
    model.forward(&prefix, &mut cache, &mut s, frugal::model::Logits::Last)?;
    let mut time = |n: usize| -> Result<f64> {
        let toks: Vec<u32> = (0..n as u32)
            .map(|i| (i * 104_729 + 7) % (v - 1) + 1)
            .collect();
        let mut t = Vec::new();
        for _ in 0..10 * a.reps {
            let t0 = Instant::now();
            model.forward(&toks, &mut cache, &mut s, frugal::model::Logits::All)?;
            t.push(t0.elapsed().as_secs_f64());
            cache.truncate(prefix.len());
        }
        Ok(median(&t))
    };
    let one = time(1)?;
    rows.iter().map(|&n| Ok((n, time(n)? / one))).collect()
}

pub fn run(a: Args) -> Result<()> {
    if a.list_prompts {
        let prompts = serde_json::json!({ "input-grounded": GROUNDED, "open": OPEN });
        println!("{prompts}");
        return Ok(());
    }
    anyhow::ensure!(
        a.reps > 0 && a.max_tokens > 0,
        "--reps and --max-tokens must be at least 1"
    );
    let mut specs = Vec::new();
    for d in &a.drafters {
        let o: SpecOptions = d.parse().map_err(anyhow::Error::msg)?;
        if let (Some(n), frugal::speculate::Method::Draft { .. }) = (a.draft_vocab, &o.method) {
            let fr = SpecOptions {
                draft_vocab: Some(n),
                ..o.clone()
            };
            specs.push((d.clone(), o));
            specs.push((format!("{d} (head: first {n} ids)"), fr));
        } else {
            specs.push((d.clone(), o));
        }
    }
    let (model, tok) = common::load(&a.model)?;
    let template = ChatTemplate::from_gguf(&model.file)?;
    let encode = |p: &str| -> Result<Vec<u32>> {
        let text = template.render(&[Message::new("user", p)], true)?;
        Ok(tok.encode(&text, true)?)
    };
    let costs = pass_costs(&model, &a, &[1, 2, 3, 4, 5, 6, 7, 9, 17])?;
    if !a.output.json {
        println!("cost of one target pass over R tokens, relative to a one-token decode step:");
        println!();
        println!("| R | relative time | per extra row |");
        println!("|---:|---:|---:|");
        for &(n, r) in &costs {
            let per = if n > 1 {
                format!("{:.3}", (r - 1.0) / (n - 1) as f64)
            } else {
                "-".into()
            };
            println!("| {n} | {r:.2} | {per} |");
        }
        println!();
    }
    let kinds: [(&'static str, &[&str]); 2] = [("input-grounded", &GROUNDED), ("open", &OPEN)];
    let mut rows = Vec::new();
    let t_all = Instant::now();
    for (name, base) in &specs {
        let mut variants: Vec<(String, SpecOptions)> = vec![("adaptive".to_string(), base.clone())];
        if !a.no_sweep {
            for &k in &a.ks {
                anyhow::ensure!(k > 0, "--k values must be at least 1");
                variants.push((
                    k.to_string(),
                    SpecOptions {
                        k,
                        adaptive: false,
                        ..base.clone()
                    },
                ));
            }
        }
        for (kind, prompts) in kinds {
            let ids: Vec<Vec<u32>> = prompts.iter().map(|p| encode(p)).collect::<Result<_>>()?;
            for (kname, o) in &variants {
                let mut ratios = Vec::new();
                let (mut plain_rate, mut spec_rate) = (Vec::new(), Vec::new());
                let mut tot = SpecStats::default();
                let (mut decoded, mut cost) = (0usize, 0.0);
                for _ in 0..a.reps {
                    let (mut tp, mut ts, mut np, mut ns) = (0.0, 0.0, 0usize, 0usize);
                    for p in &ids {
                        let want = plain(&model, &tok, &a, p)?;
                        let (got, c) = speculative(&model, &tok, &a, p, o)
                            .with_context(|| format!("--speculate {name}"))?;
                        anyhow::ensure!(
                            got.tokens == want.tokens,
                            "--speculate {name} (K {kname}) changed the greedy output: a bug"
                        );
                        cost = c;
                        (tp, np) = (tp + want.seconds, np + want.decoded);
                        (ts, ns) = (ts + got.seconds, ns + got.decoded);
                        let st = got.spec.expect("speculative runs have stats");
                        tot.passes += st.passes;
                        tot.drafted += st.drafted;
                        tot.accepted += st.accepted;
                        tot.drafted_passes += st.drafted_passes;
                        decoded += got.decoded;
                    }
                    let (rp, rs) = (np as f64 / tp, ns as f64 / ts);
                    plain_rate.push(rp);
                    spec_rate.push(rs);
                    ratios.push(rs / rp);
                }
                let alpha = tot.acceptance();
                let mean_draft = tot.drafted as f64 / tot.drafted_passes.max(1) as f64;
                let (pe, ps) = leviathan(alpha, mean_draft, cost);
                let draft_share = tot.drafted_passes as f64 / tot.passes.max(1) as f64;
                let pass = 1.0 + draft_share * (pass_cost(&costs, mean_draft + 1.0) - 1.0);
                let pc = pe / (mean_draft * cost * draft_share + pass);
                let row = Row {
                    drafter: name.clone(),
                    kind,
                    k: kname.clone(),
                    acceptance: alpha,
                    tokens_per_pass: decoded as f64 / tot.passes.max(1) as f64,
                    mean_draft,
                    speedup: median(&ratios),
                    cost_ratio: cost,
                    predicted_tokens_per_pass: pe,
                    predicted_speedup: ps,
                    predicted_with_pass_cost: pc,
                    plain_tok_s: median(&plain_rate),
                    spec_tok_s: median(&spec_rate),
                };
                if !a.output.json {
                    eprintln!(
                        "{name} {kind} K {kname}: acceptance {:.2}, {:.2} tokens/pass, {:.2}x ({:.0} s so far)",
                        row.acceptance,
                        row.tokens_per_pass,
                        row.speedup,
                        t_all.elapsed().as_secs_f64()
                    );
                }
                rows.push(row);
            }
        }
    }
    if a.output.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_table(&a, &rows);
    }
    let mut series = Vec::new();
    // Chart labels name files by their stem, not their directory.
    let label = |name: &str| -> String {
        match name.split_once(':') {
            Some((kind @ ("draft" | "heads"), rest)) => {
                let (path, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let stem = std::path::Path::new(path)
                    .file_stem()
                    .map_or(path.into(), |s| s.to_string_lossy());
                format!(
                    "{kind}:{stem}{}{tail}",
                    if tail.is_empty() { "" } else { " " }
                )
            }
            _ => name.to_string(),
        }
    };
    for (name, _) in &specs {
        for kind in ["input-grounded", "open"] {
            let pts = |pred: bool| -> Vec<(f64, f64)> {
                rows.iter()
                    .filter(|r| &r.drafter == name && r.kind == kind)
                    .filter_map(|r| {
                        let k: f64 = r.k.parse().ok()?;
                        Some((k, if pred { r.predicted_speedup } else { r.speedup }))
                    })
                    .collect()
            };
            series.push(Series {
                name: format!("{}, {kind}: measured", label(name)),
                points: pts(false),
            });
            series.push(Series {
                name: format!("{}, {kind}: Leviathan formula", label(name)),
                points: pts(true),
            });
        }
    }
    if !a.no_sweep {
        a.output.chart(
            &Chart {
                title: format!(
                    "Speculative decoding: decode speed-up over plain against the draft length K ({} threads)",
                    rayon::current_num_threads()
                ),
                x_desc: "draft length K (tokens)",
                y_desc: "speed-up over plain decoding",
                series,
                y_fmt: |v| format!("{v:.2}x"),
            },
            "speculative",
        )?;
    }
    Ok(())
}

fn print_table(a: &Args, rows: &[Row]) {
    println!(
        "greedy, {} tokens per prompt, {} prompts per kind, median of {} repetitions, {} threads",
        a.max_tokens,
        GROUNDED.len(),
        a.reps,
        rayon::current_num_threads()
    );
    println!();
    println!(
        "| drafter | prompts | K | acceptance | tokens/pass | mean draft | cost ratio c | speed-up | Leviathan: tokens/pass | Leviathan: speed-up | with this CPU's pass cost | plain tok/s | speculative tok/s |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.3} | {:.2}x | {:.2} | {:.2}x | {:.2}x | {:.1} | {:.1} |",
            r.drafter,
            r.kind,
            r.k,
            r.acceptance,
            r.tokens_per_pass,
            r.mean_draft,
            r.cost_ratio,
            r.speedup,
            r.predicted_tokens_per_pass,
            r.predicted_speedup,
            r.predicted_with_pass_cost,
            r.plain_tok_s,
            r.spec_tok_s
        );
    }
}
