//! `frugal report distill`: the distillation experiment behind `docs/distillation.md`, measured
//! in one run on one teacher, one corpus, one seed and one token budget:
//! - a student with a third of the teacher's layers (chosen by the loss increase when each is
//!   skipped), evaluated as cut;
//! - the same student after hard-label training, and after distillation at each temperature;
//! - distillation from the teacher's cached top-k (and what the truncation costs);
//! - an ensemble of two teachers (the teacher and a copy fine-tuned on the corpus: "teacher
//!   correction") collapsed into one student;
//! - a student of another architecture (narrower, fewer heads) initialized from the teacher's
//!   leading channels, with a hidden-state term through a learned projection;
//! - the held-out perplexity curve of each run against training tokens, and the students'
//!   prefill and decode speed against the teacher's, in the same format, in the same run.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;
use frugal_lab::heal::{self, Recovery, soft};
use frugal_lab::timing::{Speed, SpeedTest};
use frugal_lab::{size, student};
use frugal_train::Params;
use frugal_train::data::{Corpus, corpus_from_files};
use frugal_train::gemm::{self, Precision};
use frugal_train::hidden::HiddenKind;
use frugal_train::output::{Provenance, write_model};
use frugal_train::teacher::{OnlineTeachers, TopKCache};
use frugal_train::trainer::{EvalPoint, HiddenConfig, LossConfig, Signal, Trainer, evaluate};

use super::bench::plot::{self, Chart, Series};
use super::common::{self, ModelArgs};
use super::train::parse_count;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Text files to train on; the last --heldout fraction of their windows is held out
    #[arg(long = "data", num_args = 1.., required = true)]
    pub data: Vec<PathBuf>,
    /// Fraction of the windows held out
    #[arg(long = "heldout", default_value_t = 0.1)]
    pub heldout: f64,
    /// Training tokens of every run (k/M suffixes)
    #[arg(long = "tokens", default_value = "48k")]
    pub tokens: String,
    /// Layers the student keeps [default: a third of the teacher's]
    #[arg(long = "student-layers")]
    pub student_layers: Option<usize>,
    /// Distillation temperatures to compare
    #[arg(long = "temperatures", value_delimiter = ',', default_value = "1,2,4")]
    pub temperatures: Vec<f32>,
    /// Tokens per sequence
    #[arg(long = "seq", default_value_t = 256)]
    pub seq: usize,
    /// Sequences per step
    #[arg(long = "batch", default_value_t = 4)]
    pub batch: usize,
    /// Peak learning rate
    #[arg(long = "lr", default_value_t = 3e-4)]
    pub lr: f32,
    /// Held-out evaluations per run (the curve's points)
    #[arg(long = "points", default_value_t = 6)]
    pub points: usize,
    /// Held-out windows per evaluation (0: all)
    #[arg(long = "eval-windows", default_value_t = 16)]
    pub eval_windows: usize,
    /// Top-k of the cached-teacher run (0 skips it)
    #[arg(long = "topk", default_value_t = 64)]
    pub topk: usize,
    /// Tokens of the fine-tuning that makes the ensemble's second teacher (0 skips the ensemble)
    #[arg(long = "ensemble-tokens", default_value = "16k")]
    pub ensemble_tokens: String,
    /// Skip the student of another architecture
    #[arg(long = "no-arch")]
    pub no_arch: bool,
    /// Seed of every run
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Where the report (distillation.md), its charts and the students go
    #[arg(long = "out", default_value = "docs")]
    pub out: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
}

/// One run's outcome.
struct RunResult {
    name: String,
    history: Vec<EvalPoint>,
    tokens_per_s: f64,
    params: Params,
}

/// Prefill of 256 and decode of 64 tokens, each the median of 3 runs, 8-bit activations.
fn speed_of(path: &Path) -> Result<(f64, f64)> {
    let mut m = Model::load(path)?;
    m.set_activations(Activations::Q8);
    let test = SpeedTest {
        prompt: 256,
        gen_tokens: 64,
        depth: 0,
        reps: 3,
    };
    let Speed { prefill, decode } = test.measure(&m)?;
    Ok((prefill, decode))
}

pub fn run(a: Args) -> Result<()> {
    frugal_train::keep_freed_memory();
    let teacher_path = common::model_path(&a.model)?;
    let teacher_file = GgufFile::open(&teacher_path)?;
    let tok = Tokenizer::from_gguf(&teacher_file)?;
    let data = corpus_from_files(&tok, &a.data, a.seq, a.heldout)?;
    let mut teacher = Model::load(&teacher_path)?;
    let t_params = Params::from_model(&teacher)?;
    teacher.set_activations(Activations::Q8);
    let teachers = OnlineTeachers {
        models: vec![(teacher, 1.0)],
    };
    let n_layers = a
        .student_layers
        .unwrap_or(t_params.config.n_layers.div_ceil(3));
    ensure!(
        n_layers >= 1 && n_layers < t_params.config.n_layers,
        "--student-layers must be below the teacher's {}",
        t_params.config.n_layers
    );
    let tokens = parse_count(&a.tokens)?;
    let per_step = a.seq * a.batch;
    let steps = tokens.div_ceil(per_step).max(1);
    let run_opts = heal::run_options();
    let prec = run_opts.precision;
    let recovery = Recovery {
        seq: a.seq,
        batch: a.batch,
        lr: a.lr,
        points: a.points,
        eval_windows: a.eval_windows,
        seed: a.seed,
        run: run_opts,
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let assets = a.out.join("distillation");
    std::fs::create_dir_all(&assets)?;

    // The student as cut.
    eprintln!("measuring layer importance...");
    let student::Cut {
        importance,
        keep,
        params: cut,
    } = student::layer_dropped(&t_params, n_layers, &data.train.first(4), prec)?;
    let teacher_eval = evaluate(
        &t_params,
        &data.heldout,
        a.eval_windows,
        a.batch,
        None,
        run_opts,
    )?;
    let cut_eval = evaluate(
        &cut,
        &data.heldout,
        a.eval_windows,
        a.batch,
        Some(&teachers),
        run_opts,
    )?;

    let mut results: Vec<RunResult> = Vec::new();
    let go = |name: &str,
              student: Params,
              loss: LossConfig,
              signal: Signal,
              eval_t: Option<&OnlineTeachers>,
              data: &Corpus|
     -> Result<RunResult> {
        eprintln!("run: {name}");
        let run = heal::train(
            student,
            recovery.config(loss, steps),
            data,
            (signal, eval_t.or(Some(&teachers))),
            false,
            common::training_progress(steps),
        )?;
        Ok(RunResult {
            name: name.into(),
            history: run.history,
            tokens_per_s: run.tokens_per_s,
            params: run.params,
        })
    };
    results.push(go(
        "hard labels",
        cut.clone(),
        LossConfig::default(),
        Signal::None,
        None,
        &data,
    )?);
    for &tau in &a.temperatures {
        results.push(go(
            &format!("distilled, τ = {tau}"),
            cut.clone(),
            soft(tau),
            Signal::Online(&teachers),
            None,
            &data,
        )?);
    }
    let mut topk_note = String::new();
    if a.topk > 0 {
        let cache = TopKCache::build(&teachers, &data.train, a.topk, |_, _| {})?;
        topk_note = format!(
            "The top-{} cache covers {} windows ({} positions): on average {:.4} of the teacher's probability mass lies outside the top {}, so renormalizing costs KL(p̃ ‖ p) = −ln P_k = {:.4} nats per position; the file takes {} MiB against {} MiB for full f32 logits.",
            cache.k,
            cache.windows,
            cache.windows * cache.seq,
            cache.mean_missing_mass,
            cache.k,
            cache.mean_truncation_kl,
            (cache.ids.len() * 8) >> 20,
            (cache.windows * cache.seq * cache.n_vocab * 4) >> 20,
        );
        results.push(go(
            &format!("distilled, τ = 2, cached top-{}", a.topk),
            cut.clone(),
            soft(2.0),
            Signal::Cached(&cache),
            Some(&teachers),
            &data,
        )?);
    }
    // Ensemble: the teacher and a copy fine-tuned on the corpus.
    let ens_tokens = parse_count(&a.ensemble_tokens).unwrap_or(0);
    let mut ensemble_note = String::new();
    if ens_tokens > 0 {
        eprintln!("fine-tuning the second teacher...");
        let ens_steps = ens_tokens.div_ceil(per_step).max(1);
        let mut c = recovery.config(LossConfig::default(), ens_steps);
        c.schedule.lr = a.lr / 3.0;
        c.eval_every = 0;
        let mut ft = Trainer::new(t_params.clone(), c, &data, Signal::None, None)?;
        ft.run(|_| {})?;
        let (before, after) = (
            ft.history.first().map(|p| p.ppl).unwrap_or(0.0),
            ft.history.last().map(|p| p.ppl).unwrap_or(0.0),
        );
        let second = assets.join("teacher-tuned.gguf");
        let prov = Provenance {
            mode: "train".into(),
            student: "teacher".into(),
            loss: "ce".into(),
            temperature: 1.0,
            tokens: (ens_steps * per_step) as u64,
            seed: a.seed,
            ..Default::default()
        };
        write_model(&ft.params, &teacher_file, &prov, Some("q8_0"), &second)?;
        drop(ft);
        let mut m2 = Model::load(&second)?;
        m2.set_activations(Activations::Q8);
        let mut t1 = Model::load(&teacher_path)?;
        t1.set_activations(Activations::Q8);
        let ensemble = OnlineTeachers {
            models: vec![(t1, 1.0), (m2, 1.0)],
        };
        ensemble_note = format!(
            "The second teacher is the teacher fine-tuned on the training windows for {} tokens (hard labels, lr {:.0e}): held-out PPL {before:.3} → {after:.3}. The ensemble averages the two teachers' probabilities with equal weights; KL in the table is still measured against the original teacher.",
            ens_steps * per_step,
            a.lr / 3.0
        );
        results.push(go(
            "distilled from the ensemble, τ = 2",
            cut.clone(),
            soft(2.0),
            Signal::Online(&ensemble),
            Some(&teachers),
            &data,
        )?);
    }
    // Another architecture: narrower (384 wide, 6 heads, 2 KV heads, FFN 1024).
    let mut arch_desc = String::new();
    if !a.no_arch {
        let c = &t_params.config;
        let narrow = student::narrower(&t_params, &keep, a.seed)?;
        let nc = &narrow.config;
        arch_desc = format!(
            "{} layers, width {}, FFN {}, {} query / {} KV heads of {} ({:.1}M parameters), initialized from the kept teacher layers' leading channels, heads and FFN units",
            nc.n_layers,
            nc.n_embd,
            nc.n_ff,
            nc.n_head,
            nc.n_head_kv,
            nc.head_dim,
            narrow.n_params() as f64 / 1e6
        );
        let mut loss = soft(2.0);
        loss.hidden = Some(HiddenConfig {
            weight: 0.5,
            kind: HiddenKind::Cosine,
            pairs: vec![(n_layers - 1, c.n_layers - 1)],
        });
        let cut_arch = evaluate(
            &narrow,
            &data.heldout,
            a.eval_windows,
            a.batch,
            Some(&teachers),
            run_opts,
        )?;
        arch_desc += &format!(
            "; as initialized: held-out PPL {:.2}, KL {:.3}",
            cut_arch.0.exp(),
            cut_arch.1.unwrap_or(f64::NAN)
        );
        results.push(go(
            "other architecture, τ = 2 + hidden cosine",
            narrow,
            loss,
            Signal::Online(&teachers),
            None,
            &data,
        )?);
    }

    // Speed: teacher and students in the teacher's storage format, same run.
    eprintln!("measuring speed...");
    let ty = size::dominant_type(&teacher_file).map_or("q8_0".into(), str::to_lowercase);
    let (t_pp, t_tg) = speed_of(&teacher_path)?;
    let mut speed_rows = Vec::new();
    let mut written = Vec::new();
    for (i, r) in results.iter().enumerate() {
        if i != 0 && !r.name.starts_with("other") && i != best_index(&results) {
            continue;
        }
        let p = assets.join(format!("student-{i}.gguf"));
        let prov = Provenance {
            mode: "distill".into(),
            student: r.name.clone(),
            tokens: (steps * per_step) as u64,
            seed: a.seed,
            kept_layers: keep.clone(),
            ..Default::default()
        };
        write_model(&r.params, &teacher_file, &prov, Some(&ty), &p)?;
        let (pp, tg) = speed_of(&p)?;
        speed_rows.push((
            r.name.clone(),
            r.params.config.n_layers,
            r.params.n_params(),
            pp,
            tg,
        ));
        written.push(p);
    }

    // Charts and the report.
    let chart = Chart {
        title: "Held-out perplexity against training tokens".into(),
        x_desc: "training tokens",
        y_desc: "held-out perplexity",
        series: results
            .iter()
            .map(|r| Series {
                name: r.name.clone(),
                points: r
                    .history
                    .iter()
                    .filter(|p| p.tokens > 0)
                    .map(|p| (p.tokens as f64, p.ppl))
                    .collect(),
            })
            .collect(),
        y_fmt: |v| format!("{v:.0}"),
    };
    let chart_note = match plot::write(&chart, &assets, "heldout-ppl") {
        Ok(_) => "![held-out perplexity against training tokens](distillation/heldout-ppl.svg)\n"
            .to_string(),
        Err(e) => format!("(no chart: {e})\n"),
    };
    let md = report(
        &a,
        &ReportData {
            teacher: teacher_path.display().to_string(),
            teacher_eval,
            keep: &keep,
            importance: &importance,
            cut_eval,
            results: &results,
            steps,
            per_step,
            topk_note,
            ensemble_note,
            arch_desc,
            speed: (
                ty,
                t_pp,
                t_tg,
                t_params.n_params(),
                t_params.config.n_layers,
                &speed_rows,
            ),
            chart_note,
            prec,
            corpus: &data,
            head_params: t_params.token_embd.data.len()
                + t_params.output.as_ref().map_or(0, |o| o.data.len()),
        },
    );
    let path = a.out.join("distillation.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    for p in written {
        let _ = std::fs::remove_file(p);
    }
    let _ = std::fs::remove_file(assets.join("teacher-tuned.gguf"));
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// The run (after the hard-label one) with the lowest final held-out PPL.
fn best_index(results: &[RunResult]) -> usize {
    (1..results.len())
        .min_by(|&a, &b| last(&results[a]).ppl.total_cmp(&last(&results[b]).ppl))
        .unwrap_or(0)
}

fn last(r: &RunResult) -> EvalPoint {
    r.history.last().cloned().unwrap_or_default()
}

/// Speed rows: the teacher's format, prefill and decode tokens/s, parameters and layers, then
/// `(run, layers, parameters, prefill, decode)` per measured student.
type Speeds<'a> = (
    String,
    f64,
    f64,
    usize,
    usize,
    &'a [(String, usize, usize, f64, f64)],
);

struct ReportData<'a> {
    teacher: String,
    teacher_eval: (f64, Option<f64>),
    keep: &'a [usize],
    importance: &'a [f64],
    cut_eval: (f64, Option<f64>),
    results: &'a [RunResult],
    steps: usize,
    per_step: usize,
    topk_note: String,
    ensemble_note: String,
    arch_desc: String,
    speed: Speeds<'a>,
    chart_note: String,
    prec: Precision,
    corpus: &'a Corpus,
    /// Embedding and output head parameters of the teacher.
    head_params: usize,
}

fn report(a: &Args, d: &ReportData) -> String {
    let mut s = String::new();
    let files: Vec<String> = a
        .data
        .iter()
        .map(|p| format!("`{}`", p.display()))
        .collect();
    let _ = writeln!(s, "# Distillation, measured\n");
    let _ = writeln!(
        s,
        "Generated by `frugal report distill --data {} --tokens {} --seq {} --batch {} --lr {} --seed {}` on {} ({} threads; products {}). Do not edit: rerun the command.\n",
        a.data
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(" "),
        a.tokens,
        a.seq,
        a.batch,
        a.lr,
        a.seed,
        d.teacher,
        rayon::current_num_threads(),
        match d.prec {
            Precision::Bf16 => format!("bf16 × bf16 → f32 on {}", gemm::bf16_backend()),
            Precision::F32 => "f32".into(),
        }
    );
    let _ = writeln!(
        s,
        "Data: {} — {} training windows and {} held-out windows of {} tokens (the held-out windows are the last {:.0}% of the text, never trained on). Every run below trains {} steps × {} tokens = {} tokens with the same seed, data order, AdamW (lr {}, warmup 5%, cosine to 10%, clip 1.0) and evaluates on the same {} held-out windows.\n",
        files.join(", "),
        d.corpus.train.len(),
        d.corpus.heldout.len(),
        a.seq,
        100.0 * a.heldout,
        d.steps,
        d.per_step,
        d.steps * d.per_step,
        a.lr,
        if a.eval_windows == 0 {
            d.corpus.heldout.len()
        } else {
            a.eval_windows.min(d.corpus.heldout.len())
        }
    );
    let imp: Vec<String> = d
        .importance
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{i}: {v:+.3}"))
        .collect();
    let _ = writeln!(
        s,
        "## The student\n\nThe teacher's layers ranked by the held-out loss increase when each one alone is skipped (nats; first and last always kept):\n\n`{}`\n\nKept: `{:?}` ({} of {} layers).\n",
        imp.join(", "),
        d.keep,
        d.keep.len(),
        d.importance.len()
    );
    let _ = writeln!(s, "## Quality\n");
    let _ = writeln!(
        s,
        "| model | training | held-out PPL | KL to teacher (nats/token) | training tokens/s |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|");
    let _ = writeln!(
        s,
        "| teacher ({} layers) | — | {:.3} | 0 | — |",
        d.importance.len(),
        d.teacher_eval.0.exp()
    );
    let _ = writeln!(
        s,
        "| student, as cut | none | {:.3} | {:.4} | — |",
        d.cut_eval.0.exp(),
        d.cut_eval.1.unwrap_or(f64::NAN)
    );
    for r in d.results {
        let l = last(r);
        let _ = writeln!(
            s,
            "| student | {} | {:.3} | {:.4} | {:.0} |",
            r.name,
            l.ppl,
            l.kl.unwrap_or(f64::NAN),
            r.tokens_per_s
        );
    }
    // What the soft targets bought.
    if let Some(hard) = d.results.first() {
        let h = last(hard);
        let soft: Vec<&RunResult> = d
            .results
            .iter()
            .filter(|r| r.name.starts_with("distilled, τ"))
            .collect();
        if let Some(best) = soft
            .iter()
            .min_by(|a, b| last(a).ppl.total_cmp(&last(b).ppl))
        {
            let b = last(best);
            let dp = 100.0 * (h.ppl - b.ppl) / h.ppl;
            let dk = 100.0 * (h.kl.unwrap_or(0.0) - b.kl.unwrap_or(0.0))
                / h.kl.unwrap_or(1.0).max(1e-12);
            let verdict = if b.ppl < h.ppl * 0.99 {
                format!(
                    "Soft targets bought something here: the best distillation ({}) reached held-out PPL {:.3} against {:.3} for hard labels ({dp:.1}% lower) and KL to the teacher {:.4} against {:.4} ({dk:.0}% lower), for the same tokens, steps and data.",
                    best.name,
                    b.ppl,
                    h.ppl,
                    b.kl.unwrap_or(f64::NAN),
                    h.kl.unwrap_or(f64::NAN)
                )
            } else if b.kl.unwrap_or(f64::MAX) < h.kl.unwrap_or(0.0) * 0.95 {
                format!(
                    "Soft targets moved the student closer to the teacher (KL {:.4} against {:.4} for hard labels, {dk:.0}% lower) but did not lower held-out PPL meaningfully ({:.3} against {:.3}).",
                    b.kl.unwrap_or(f64::NAN),
                    h.kl.unwrap_or(f64::NAN),
                    b.ppl,
                    h.ppl
                )
            } else {
                format!(
                    "Soft targets bought nothing measurable here: the best distillation ({}) ended at PPL {:.3} and KL {:.4}, hard labels at {:.3} and {:.4}.",
                    best.name,
                    b.ppl,
                    b.kl.unwrap_or(f64::NAN),
                    h.ppl,
                    h.kl.unwrap_or(f64::NAN)
                )
            };
            let _ = writeln!(s, "\n{verdict}\n");
        }
    }
    if !d.topk_note.is_empty() {
        let _ = writeln!(s, "{}\n", d.topk_note);
    }
    if !d.ensemble_note.is_empty() {
        let _ = writeln!(s, "{}\n", d.ensemble_note);
    }
    if !d.arch_desc.is_empty() {
        let _ = writeln!(
            s,
            "The student of another architecture: {}. Its loss adds 0.5 × (1 − cos) between its last layer's output and the teacher's, through a learned student-to-teacher-width projection.\n",
            d.arch_desc
        );
    }
    let _ = writeln!(
        s,
        "## Held-out perplexity during training\n\n{}",
        d.chart_note
    );
    let _ = writeln!(
        s,
        "| run | {} |",
        d.results
            .first()
            .map(|r| r
                .history
                .iter()
                .map(|p| format!("{} tok", p.tokens))
                .collect::<Vec<_>>()
                .join(" | "))
            .unwrap_or_default()
    );
    let _ = writeln!(
        s,
        "|---|{}",
        "---|".repeat(d.results.first().map(|r| r.history.len()).unwrap_or(0))
    );
    for r in d.results {
        let _ = writeln!(
            s,
            "| {} | {} |",
            r.name,
            r.history
                .iter()
                .map(|p| format!("{:.2}", p.ppl))
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    let (ty, t_pp, t_tg, t_n, t_l, rows) = &d.speed;
    let _ = writeln!(
        s,
        "\n## Speed, same run, all stored as {ty} (8-bit activations)\n"
    );
    let _ = writeln!(
        s,
        "| model | layers | parameters | prefill 256 tok/s | decode 64 tok/s | prefill speed-up | decode speed-up |"
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    let _ = writeln!(
        s,
        "| teacher | {t_l} | {:.1}M | {t_pp:.0} | {t_tg:.0} | 1.00x | 1.00x |",
        *t_n as f64 / 1e6
    );
    for (name, l, n, pp, tg) in rows.iter() {
        let _ = writeln!(
            s,
            "| student: {name} | {l} | {:.1}M | {pp:.0} | {tg:.0} | {:.2}x | {:.2}x |",
            *n as f64 / 1e6,
            pp / t_pp,
            tg / t_tg
        );
    }
    let _ = writeln!(
        s,
        "\nThe layer-dropped students keep the teacher's embedding and output head ({:.1}M of its {:.1}M parameters), which every token still pays for, so a third of the layers costs more than a third of the time.",
        d.head_params as f64 / 1e6,
        *t_n as f64 / 1e6
    );
    s
}
