//! `frugal optimize`: flags and printing. The search is `frugal_lab::optimize`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use frugal_lab::optimize::recipe::Lever;
use frugal_lab::optimize::search::{self, Progress};
use frugal_lab::optimize::target::{Objective, Target, parse_budget};
use frugal_lab::optimize::{self, Config, Funnel, Point, State};

use super::common::human_bytes;
use super::optimize_chart;

/// The search's time when `--budget` is not given (the default: at most 45 minutes).
const DEFAULT_BUDGET: &str = "45m";

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The base model (GGUF; F32 or F16 gets every format, a quantized base those at or below
    /// its own)
    #[arg(short = 'm', long = "model", value_parser = super::common::model_arg)]
    pub model: Option<PathBuf>,
    /// Calibration text: the groups' sensitivity is measured on it
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Held-out text: every candidate's quality (KL to the base) is measured on it
    #[arg(long, value_name = "FILE")]
    pub eval: Option<PathBuf>,
    /// A constraint (repeatable): 'decode >= 5x', 'prefill >= 2x', 'decode >= 300tok/s',
    /// 'kl <= 0.05', 'p99kl <= 0.3', 'ppl <= +2%', 'top1 >= 0.9', 'memory <= 150MiB'
    #[arg(long = "target", value_name = "TARGET")]
    pub targets: Vec<String>,
    /// What to maximize among the points meeting every target: decode, prefill, memory, kl
    #[arg(long, default_value = "decode")]
    pub objective: String,
    /// The context (batch 1) memory targets count the KV cache at
    #[arg(long, default_value_t = 4096)]
    pub context: usize,
    /// Time for the search: it stops there and still leaves a result (45m, 90s, 1h30m;
    /// default 45m, or with --resume the search's own)
    #[arg(long)]
    pub budget: Option<String>,
    /// The ladder's stages to use: prune, attention, moe, distill, quant, kv, speculate (moe
    /// only when named). Attention is pulled only when a memory target binds, distill only
    /// when no cheaper point meets every target, speculate on the chosen point
    #[arg(long, default_value = "prune,attention,distill,quant,kv,speculate")]
    pub levers: String,
    /// The kind of prompt the model will serve, prompts separated by lines holding only
    /// '---': speculative decoding is timed on them (default: windows of --eval)
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// Evaluation tokens at each rung of the funnel (comma-separated, growing)
    #[arg(long, default_value = "512,1024,2048,4096")]
    pub rungs: String,
    /// Output directory: frontier.json, frontier.svg, frontier.html, recipe.toml, model.gguf
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Continue the search in DIR without redoing finished candidates
    #[arg(long, value_name = "DIR", conflicts_with_all = ["recipe", "out"])]
    pub resume: Option<PathBuf>,
    /// Rebuild a recipe's model (byte for byte) into --out
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub recipe: Option<PathBuf>,
    /// Draw frontier.svg and frontier.html again from DIR/frontier.json (no search)
    #[arg(long, value_name = "DIR", conflicts_with_all = ["resume", "recipe", "out"])]
    pub chart: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    if let Some(dir) = &a.chart {
        return chart(&State::read(dir)?, dir);
    }
    if let Some(recipe) = &a.recipe {
        let out = a.out.as_ref().context("--recipe needs --out DIR")?;
        let r = optimize::rebuild(recipe, a.model.as_deref(), a.calibration.as_deref(), out)?;
        println!(
            "rebuilt {} ({}) from {} into {}",
            out.join("model.gguf").display(),
            r.recipe.key(),
            r.base.path,
            out.display()
        );
        return Ok(());
    }
    let (config, dir, resume) = match &a.resume {
        Some(dir) => {
            let state = State::read(dir)?;
            let mut config = state.config.clone();
            if let Some(b) = &a.budget {
                config.budget_seconds = parse_budget(b).map_err(anyhow::Error::msg)?;
            }
            (config, dir.clone(), Some(state))
        }
        None => (config(&a)?, a.out.clone().context("give --out DIR")?, None),
    };
    search::check(&config)?;
    let mut progress = |p: Progress| match p {
        Progress::Plan {
            weight_recipes,
            runtimes,
            evaluations,
            estimated_seconds,
            budget_seconds,
        } => eprintln!(
            "space: {weight_recipes} weight recipes x {runtimes} runtime settings = {} points; the funnel evaluates about {evaluations}; estimated {:.0} min (budget {:.0} min)",
            weight_recipes * runtimes,
            estimated_seconds / 60.0,
            budget_seconds / 60.0
        ),
        Progress::Step(s) => eprintln!("{s}"),
    };
    let out = search::run(config, &dir, resume, &mut progress)?;
    print_outcome(&out.state, out.evaluations, &dir);
    // The search's result is on disk already: a chart that cannot be drawn costs a warning,
    // not the run.
    if let Err(e) = chart(&out.state, &dir) {
        eprintln!("warning: {e:#}");
    }
    Ok(())
}

/// Writes `frontier.svg` and `frontier.html` beside `frontier.json` and says so; an error
/// when either could not be made (the page is still written when only the drawing failed).
fn chart(state: &State, dir: &Path) -> Result<()> {
    let w = optimize_chart::write(state, dir).context("writing the frontier chart")?;
    match w.svg {
        Ok(svg) => {
            println!("wrote {} and {}", svg.display(), w.html.display());
            Ok(())
        }
        Err(e) => {
            println!("wrote {}", w.html.display());
            bail!("no frontier chart drawn: {e}")
        }
    }
}

fn config(a: &Args) -> Result<Config> {
    let model = super::common::input_model(a.model.as_deref())?;
    let targets = a
        .targets
        .iter()
        .map(|t| t.parse::<Target>().map_err(anyhow::Error::msg))
        .collect::<Result<Vec<_>>>()?;
    let Some(calibration) = a.calibration.clone() else {
        bail!("give --calibration FILE (the text the sensitivity is measured on)");
    };
    let Some(eval) = a.eval.clone() else {
        bail!("give --eval FILE (held-out text, other than the calibration)");
    };
    let rungs = a
        .rungs
        .split(',')
        .map(|r| r.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--rungs {:?}: comma-separated token counts", a.rungs))?;
    Ok(Config {
        model,
        calibration,
        eval,
        targets,
        objective: a
            .objective
            .parse::<Objective>()
            .map_err(anyhow::Error::msg)?,
        context: a.context,
        budget_seconds: parse_budget(a.budget.as_deref().unwrap_or(DEFAULT_BUDGET))
            .map_err(anyhow::Error::msg)?,
        levers: Lever::parse_list(&a.levers)?,
        funnel: Funnel {
            rungs,
            ..Funnel::default()
        },
        prompts: a.prompts.clone(),
    })
}

fn row(p: &Point, chosen: bool) -> String {
    let q = p.latest();
    format!(
        "{} {:>5.2} {:>9} {:>8} {:>7} {:>10}  {}",
        if chosen { "*" } else { " " },
        p.bpw,
        q.map_or("-".into(), |q| format!("{:.5}", q.kl_mean)),
        q.map_or("-".into(), |q| format!("{:.4}", q.kl_stderr)),
        p.speed
            .map_or("-".into(), |s| format!("{:.2}x", s.decode_ratio)),
        p.memory.map_or("-".into(), |m| human_bytes(m.total())),
        p.key
    )
}

fn print_outcome(s: &State, evaluations: usize, dir: &Path) {
    println!(
        "{} points evaluated ({} by this run); status: {}",
        s.points.iter().filter(|p| p.latest().is_some()).count(),
        evaluations,
        s.status
    );
    for r in &s.refused {
        println!("skipped {r}");
    }
    for g in &s.gates {
        println!("{} as {}: {}", g.cut, g.format, g.reason);
    }
    println!("  bpw        KL    ± KL  decode     memory  recipe (frontier and timed points)");
    let mut shown: Vec<&Point> = s
        .points
        .iter()
        .filter(|p| p.pareto || p.speed.is_some())
        .collect();
    shown.sort_by_key(|p| p.weight_bytes);
    for p in shown {
        println!("{}", row(p, s.chosen.as_deref() == Some(&p.key)));
    }
    for t in &s.speculation {
        println!(
            "speculate {}: {:.2}x over plain decoding, {:.2}x over the base (acceptance {:.2}, {:.2} tokens per pass){}",
            t.drafter,
            t.speedup,
            t.over_base,
            t.acceptance,
            t.tokens_per_pass,
            if t.taken { ": paired" } else { "" }
        );
    }
    for w in &s.warnings {
        println!("warning: {w}");
    }
    match &s.chosen {
        Some(k) => {
            let p = s.point(k).expect("chosen point");
            let met: Vec<String> = search::readings(&s.config.targets, &p.measured())
                .into_iter()
                .map(|(t, v)| format!("{t}: {v}"))
                .collect();
            println!("chosen: {k} ({})", met.join(", "));
            let r = p.recipe.runtime;
            let model = dir.join("model.gguf");
            let run = format!(
                "-m {} --kv-type {} --activations {}",
                model.display(),
                r.kv,
                r.activations
            );
            match s.speculation.iter().find(|t| t.taken) {
                Some(t) if t.drafter.starts_with("ngram") => {
                    println!("run it with: frugal serve {run} --speculate {}", t.drafter)
                }
                Some(t) => {
                    let drafter = match t.drafter.strip_prefix("draft:") {
                        Some(f) => format!("draft:{}", dir.join(f).display()),
                        None => t.drafter.clone(),
                    };
                    println!("run it with: frugal chat {run} --speculate {drafter}");
                    println!(
                        "or serve it with: frugal serve {run} (the server drafts by prompt lookup only)"
                    );
                }
                None => println!("run it with: frugal serve {run}"),
            }
            println!(
                "wrote {}, {} and {}",
                dir.join("frontier.json").display(),
                dir.join("recipe.toml").display(),
                dir.join("model.gguf").display()
            );
        }
        None => {
            println!("no point meets every target");
            for b in &s.binding {
                println!("  {b}");
            }
            for k in &s.closest {
                println!("  closest: {k}");
            }
            println!("wrote {}", dir.join("frontier.json").display());
        }
    }
}
