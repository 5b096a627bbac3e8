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
//!
//! The study itself is [`frugal_lab::distill_study`]: here the flags become its plan, and
//! its rows a table and charts.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use frugal::gguf::GgufFile;
use frugal::tokenizer::Tokenizer;
use frugal_lab::distill_study::{self, Arch, Ensemble, Inputs, Plan, RunResult, Study, TopK};
use frugal_lab::heal::{self, Recovery};
use frugal_lab::timing::SpeedTest;
use frugal_train::data::{Corpus, corpus_from_files};
use frugal_train::gemm::{self, Precision};

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

pub fn run(a: Args) -> Result<()> {
    frugal_train::keep_freed_memory();
    let teacher_path = common::model_path(&a.model)?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(&teacher_path)?)?;
    let data = corpus_from_files(&tok, &a.data, a.seq, a.heldout)?;
    let plan = Plan {
        student_layers: a.student_layers,
        tokens: parse_count(&a.tokens)?,
        temperatures: a.temperatures.clone(),
        recovery: Recovery {
            seq: a.seq,
            batch: a.batch,
            lr: a.lr,
            probe: None,
            points: a.points,
            eval_windows: a.eval_windows,
            seed: a.seed,
            run: heal::run_options(),
        },
        topk: a.topk,
        ensemble_tokens: parse_count(&a.ensemble_tokens).unwrap_or(0),
        arch: !a.no_arch,
        speed: SpeedTest {
            prompt: 256,
            gen_tokens: 64,
            depth: 0,
            reps: 3,
        },
    };
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let assets = a.out.join("distillation");
    std::fs::create_dir_all(&assets)?;
    let inputs = Inputs {
        teacher: &teacher_path,
        data: &data,
        work: &assets,
    };
    let study = distill_study::run(&plan, &inputs, &mut common::lab_progress())?;

    // Charts and the report.
    let chart = Chart {
        title: "Held-out perplexity against training tokens".into(),
        x_desc: "training tokens",
        y_desc: "held-out perplexity",
        series: study
            .results
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
    let teacher = teacher_path.display().to_string();
    let md = report(
        &a,
        &study,
        &ReportData {
            teacher,
            chart_note,
            prec: plan.recovery.run.precision,
            corpus: &data,
            speed: plan.speed,
        },
    );
    let path = a.out.join("distillation.md");
    std::fs::write(&path, md).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// What the report reads beside the study.
struct ReportData<'a> {
    teacher: String,
    chart_note: String,
    prec: Precision,
    corpus: &'a Corpus,
    /// The speed test of the teacher and the students.
    speed: SpeedTest,
}

/// The top-k note: what the cache holds and what its truncation costs.
fn topk_note(c: &TopK) -> String {
    format!(
        "The top-{} cache covers {} windows ({} positions): on average {:.4} of the teacher's probability mass lies outside the top {}, so renormalizing costs KL(p̃ ‖ p) = −ln P_k = {:.4} nats per position; the file takes {} MiB against {} MiB for full f32 logits.",
        c.k, c.windows, c.positions, c.missing_mass, c.k, c.truncation_kl, c.mib, c.full_mib,
    )
}

fn ensemble_note(e: &Ensemble) -> String {
    format!(
        "The second teacher is the teacher fine-tuned on the training windows for {} tokens (hard labels, lr {:.0e}): held-out PPL {:.3} → {:.3}. The ensemble averages the two teachers' probabilities with equal weights; KL in the table is still measured against the original teacher.",
        e.tokens, e.lr, e.before, e.after
    )
}

/// The student of another architecture as initialized.
fn arch_desc(arch: &Arch) -> String {
    let nc = &arch.config;
    format!(
        "{} layers, width {}, FFN {}, {} query / {} KV heads of {} ({:.1}M parameters), initialized from the kept teacher layers' leading channels, heads and FFN units; as initialized: held-out PPL {:.2}, KL {:.3}",
        nc.n_layers,
        nc.n_embd,
        nc.n_ff,
        nc.n_head,
        nc.n_head_kv,
        nc.head_dim,
        arch.params as f64 / 1e6,
        arch.eval.0.exp(),
        arch.eval.1.unwrap_or(f64::NAN)
    )
}

fn report(a: &Args, study: &Study, d: &ReportData) -> String {
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
        study.steps,
        study.per_step,
        study.steps * study.per_step,
        a.lr,
        if a.eval_windows == 0 {
            d.corpus.heldout.len()
        } else {
            a.eval_windows.min(d.corpus.heldout.len())
        }
    );
    let imp: Vec<String> = study
        .importance
        .iter()
        .enumerate()
        .map(|(i, v)| format!("{i}: {v:+.3}"))
        .collect();
    let _ = writeln!(
        s,
        "## The student\n\nThe teacher's layers ranked by the held-out loss increase when each one alone is skipped (nats; first and last always kept):\n\n`{}`\n\nKept: `{:?}` ({} of {} layers).\n",
        imp.join(", "),
        study.keep,
        study.keep.len(),
        study.importance.len()
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
        study.importance.len(),
        study.teacher_eval.0.exp()
    );
    let _ = writeln!(
        s,
        "| student, as cut | none | {:.3} | {:.4} | — |",
        study.cut_eval.0.exp(),
        study.cut_eval.1.unwrap_or(f64::NAN)
    );
    for r in &study.results {
        let l = r.last();
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
    if let Some(hard) = study.results.first() {
        let h = hard.last();
        let soft: Vec<&RunResult> = study
            .results
            .iter()
            .filter(|r| r.name.starts_with("distilled, τ"))
            .collect();
        if let Some(best) = soft
            .iter()
            .min_by(|a, b| a.last().ppl.total_cmp(&b.last().ppl))
        {
            let b = best.last();
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
    if let Some(t) = &study.topk {
        let _ = writeln!(s, "{}\n", topk_note(t));
    }
    if let Some(e) = &study.ensemble {
        let _ = writeln!(s, "{}\n", ensemble_note(e));
    }
    if let Some(arch) = &study.arch {
        let _ = writeln!(
            s,
            "The student of another architecture: {}. Its loss adds 0.5 × (1 − cos) between its last layer's output and the teacher's, through a learned student-to-teacher-width projection.\n",
            arch_desc(arch)
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
        study
            .results
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
        "---|".repeat(study.results.first().map(|r| r.history.len()).unwrap_or(0))
    );
    for r in &study.results {
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
    let t = &study.teacher;
    let (t_pp, t_tg) = (t.speed.prefill, t.speed.decode);
    let _ = writeln!(
        s,
        "\n## Speed, same run, all stored as {} (8-bit activations)\n",
        study.format
    );
    let _ = writeln!(
        s,
        "| model | layers | parameters | prefill {} tok/s | decode {} tok/s | prefill speed-up | decode speed-up |",
        d.speed.prompt, d.speed.gen_tokens
    );
    let _ = writeln!(s, "|---|---|---|---|---|---|---|");
    let _ = writeln!(
        s,
        "| teacher | {} | {:.1}M | {t_pp:.0} | {t_tg:.0} | 1.00x | 1.00x |",
        t.layers,
        t.params as f64 / 1e6
    );
    for r in &study.students {
        let (pp, tg) = (r.speed.prefill, r.speed.decode);
        let _ = writeln!(
            s,
            "| student: {} | {} | {:.1}M | {pp:.0} | {tg:.0} | {:.2}x | {:.2}x |",
            r.name,
            r.layers,
            r.params as f64 / 1e6,
            pp / t_pp,
            tg / t_tg
        );
    }
    let _ = writeln!(
        s,
        "\nThe layer-dropped students keep the teacher's embedding and output head ({:.1}M of its {:.1}M parameters), which every token still pays for, so a third of the layers costs more than a third of the time.",
        study.head_params as f64 / 1e6,
        t.params as f64 / 1e6
    );
    s
}
