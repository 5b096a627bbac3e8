//! Distillation, measured in one run on one teacher, one corpus, one seed and one token budget:
//! the study behind `frugal report distill` (`docs/distillation.md`).
//! - a student with a fraction of the teacher's layers ([`crate::student::layer_dropped`]),
//!   evaluated as cut;
//! - the same student after hard-label training, and after distillation at each temperature;
//! - distillation from the teacher's cached top-k (and what the truncation costs);
//! - an ensemble of two teachers (the teacher and a copy fine-tuned on the corpus: "teacher
//!   correction") collapsed into one student;
//! - a student of another architecture ([`crate::student::narrower`]) with a hidden-state term
//!   through a learned projection;
//! - the students' speed against the teacher's, in the teacher's storage format.
//!
//! Every run trains the same steps on the same data with the same seed, so that the runs
//! differ only by what they learn from.

use std::path::Path;

use anyhow::{Result, ensure};
use frugal::gguf::GgufFile;
use frugal::model::{Config, Model};
use frugal::quant::act::Activations;
use frugal_train::Params;
use frugal_train::data::Corpus;
use frugal_train::hidden::HiddenKind;
use frugal_train::output::{Provenance, write_model};
use frugal_train::teacher::{OnlineTeachers, TopKCache};
use frugal_train::trainer::{EvalPoint, HiddenConfig, LossConfig, Signal, Trainer, evaluate};

use crate::heal::{self, Recovery, soft};
use crate::progress::{self, OnProgress, Progress};
use crate::size;
use crate::student;
use crate::timing::{Speed, SpeedTest};

/// What the study runs.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Layers the student keeps (`None`: a third of the teacher's, rounded up).
    pub student_layers: Option<usize>,
    /// Training tokens of every run.
    pub tokens: usize,
    /// Distillation temperatures compared.
    pub temperatures: Vec<f32>,
    /// How every run trains: its sequence, batch, learning rate, held-out evaluations, seed
    /// and precision.
    pub recovery: Recovery,
    /// Top-k of the cached-teacher run (0 skips it).
    pub topk: usize,
    /// Tokens of the fine-tuning that makes the ensemble's second teacher (0 skips the
    /// ensemble).
    pub ensemble_tokens: usize,
    /// Whether to train the student of another architecture.
    pub arch: bool,
    /// The speed test of the teacher and of the students timed.
    pub speed: SpeedTest,
}

/// What the study reads and where it writes.
pub struct Inputs<'a> {
    /// The teacher's file.
    pub teacher: &'a Path,
    /// Training and held-out windows of every run.
    pub data: &'a Corpus,
    /// Where the second teacher and the students timed are written while they are measured
    /// (removed after).
    pub work: &'a Path,
}

/// One training run's outcome.
pub struct RunResult {
    pub name: String,
    /// Held-out evaluations, the first before any step.
    pub history: Vec<EvalPoint>,
    /// The median training throughput over the steps.
    pub tokens_per_s: f64,
    pub params: Params,
}

impl RunResult {
    /// The final held-out evaluation.
    pub fn last(&self) -> EvalPoint {
        self.history.last().cloned().unwrap_or_default()
    }
}

/// The top-k cache of the cached-teacher run.
#[derive(Clone, Copy, Debug)]
pub struct TopK {
    pub k: usize,
    pub windows: usize,
    pub positions: usize,
    /// Mean probability mass outside the top k.
    pub missing_mass: f64,
    /// Mean `KL(p̃ ‖ p) = -ln P_k` (nats): what renormalizing over the top k costs.
    pub truncation_kl: f64,
    /// The cache's ids and log-probabilities, and full f32 logits for the same positions.
    pub mib: usize,
    pub full_mib: usize,
}

/// The ensemble's second teacher: the teacher fine-tuned on the training windows.
#[derive(Clone, Copy, Debug)]
pub struct Ensemble {
    pub tokens: usize,
    pub lr: f32,
    /// Held-out perplexity before and after the fine-tuning.
    pub before: f64,
    pub after: f64,
}

/// The student of another architecture as initialized.
#[derive(Clone, Debug)]
pub struct Arch {
    pub config: Config,
    pub params: usize,
    /// Held-out loss and KL to the teacher before training.
    pub eval: (f64, Option<f64>),
}

/// A student's speed (or the teacher's) in the teacher's storage format.
#[derive(Clone, Debug)]
pub struct Timed {
    pub name: String,
    pub layers: usize,
    pub params: usize,
    pub speed: Speed,
}

/// What the study measured.
pub struct Study {
    /// Per teacher layer: the loss increase (nats) when that layer alone is skipped.
    pub importance: Vec<f64>,
    /// The teacher layers the student keeps.
    pub keep: Vec<usize>,
    /// Held-out loss, and KL to the teacher, of the teacher and of the student as cut.
    pub teacher_eval: (f64, Option<f64>),
    pub cut_eval: (f64, Option<f64>),
    /// Every run, hard labels first.
    pub results: Vec<RunResult>,
    pub steps: usize,
    /// Tokens per step.
    pub per_step: usize,
    pub topk: Option<TopK>,
    pub ensemble: Option<Ensemble>,
    pub arch: Option<Arch>,
    /// The teacher's storage type (lowercase), every timed model's.
    pub format: String,
    pub teacher: Timed,
    /// The hard-label student, the best distilled one and the other architecture's.
    pub students: Vec<Timed>,
    /// Embedding and output head parameters of the teacher.
    pub head_params: usize,
}

/// Runs every run of `plan` on `inputs`.
pub fn run(plan: &Plan, inputs: &Inputs, progress: OnProgress) -> Result<Study> {
    let teacher_file = GgufFile::open(inputs.teacher)?;
    let mut teacher = Model::load(inputs.teacher)?;
    let t_params = Params::from_model(&teacher)?;
    teacher.set_activations(Activations::Q8);
    let teachers = OnlineTeachers {
        models: vec![(teacher, 1.0)],
    };
    let t_layers = t_params.config.n_layers;
    let n_layers = plan.student_layers.unwrap_or(t_layers.div_ceil(3));
    ensure!(
        n_layers >= 1 && n_layers < t_layers,
        "the student's layers ({n_layers}) must be at least 1 and below the teacher's {t_layers}"
    );
    let r = &plan.recovery;
    let per_step = r.seq * r.batch;
    let steps = plan.tokens.div_ceil(per_step).max(1);
    let data = inputs.data;

    // The student as cut.
    progress(Progress::Line("measuring layer importance...".into()));
    let run_opts = r.run;
    let prec = run_opts.precision;
    let student::Cut {
        importance,
        keep,
        params: cut,
    } = student::layer_dropped(&t_params, n_layers, &data.train.first(4), prec)?;
    let heldout = |p: &Params, t: Option<&OnlineTeachers>| -> Result<(f64, Option<f64>)> {
        Ok(evaluate(
            p,
            &data.heldout,
            r.eval_windows,
            r.batch,
            t,
            run_opts,
        )?)
    };
    let teacher_eval = heldout(&t_params, None)?;
    let cut_eval = heldout(&cut, Some(&teachers))?;

    let mut runs = Runs {
        recovery: r,
        steps,
        data,
        teachers: &teachers,
        progress,
        results: Vec::new(),
    };
    runs.go(
        "hard labels",
        cut.clone(),
        LossConfig::default(),
        Signal::None,
        None,
    )?;
    for &tau in &plan.temperatures {
        let name = format!("distilled, τ = {tau}");
        runs.go(
            &name,
            cut.clone(),
            soft(tau),
            Signal::Online(&teachers),
            None,
        )?;
    }
    let topk = match plan.topk {
        0 => None,
        k => Some(runs.cached(&cut, k)?),
    };
    let ensemble = match plan.ensemble_tokens {
        0 => None,
        tokens => Some(runs.ensemble(&cut, &t_params, tokens, inputs, &teacher_file)?),
    };
    let arch = match plan.arch {
        false => None,
        true => Some(runs.arch(&t_params, &keep, n_layers, heldout)?),
    };
    let Runs {
        results, progress, ..
    } = runs;

    // Speed: teacher and students in the teacher's storage format, same run.
    progress(Progress::Line("measuring speed...".into()));
    let format = size::dominant_type(&teacher_file).map_or("q8_0".into(), str::to_lowercase);
    let teacher = Timed {
        name: "teacher".into(),
        layers: t_layers,
        params: t_params.n_params(),
        speed: speed_of(inputs.teacher, &plan.speed)?,
    };
    let students = time_students(plan, inputs, &results, (&teacher_file, &format), &keep)?;
    Ok(Study {
        importance,
        keep,
        teacher_eval,
        cut_eval,
        results,
        steps,
        per_step,
        topk,
        ensemble,
        arch,
        format,
        teacher,
        students,
        head_params: t_params.token_embd.data.len()
            + t_params.output.as_ref().map_or(0, |o| o.data.len()),
    })
}

/// `path` loaded as the reports run models (8-bit activations), timed by `test`.
pub fn speed_of(path: &Path, test: &SpeedTest) -> Result<Speed> {
    let mut m = Model::load(path)?;
    m.set_activations(Activations::Q8);
    test.measure(&m)
}

/// The run (after the hard-label one) with the lowest final held-out PPL.
pub fn best_index(results: &[RunResult]) -> usize {
    (1..results.len())
        .min_by(|&a, &b| results[a].last().ppl.total_cmp(&results[b].last().ppl))
        .unwrap_or(0)
}

/// The runs of one study: all train `steps` steps on `data` on `recovery`'s schedule, and are
/// evaluated against the teacher.
struct Runs<'a, 'p> {
    recovery: &'a Recovery,
    steps: usize,
    data: &'a Corpus,
    teachers: &'a OnlineTeachers,
    progress: OnProgress<'p>,
    results: Vec<RunResult>,
}

impl Runs<'_, '_> {
    /// Trains `student` with `loss` from `signal`, its held-out KL against `eval_t` (the
    /// teacher when `None`), and keeps the outcome as `name`.
    fn go(
        &mut self,
        name: &str,
        student: Params,
        loss: LossConfig,
        signal: Signal,
        eval_t: Option<&OnlineTeachers>,
    ) -> Result<()> {
        (self.progress)(Progress::Line(format!("run: {name}")));
        let run = heal::train(
            student,
            self.recovery.config(loss, self.steps),
            self.data,
            (signal, eval_t.or(Some(self.teachers))),
            (false, self.recovery.probe),
            progress::training(&mut *self.progress, self.steps),
        )?;
        self.results.push(RunResult {
            name: name.into(),
            history: run.history,
            tokens_per_s: run.tokens_per_s,
            params: run.params,
        });
        Ok(())
    }

    /// Distillation at τ = 2 from the teacher's top-`k` cached over the training windows.
    fn cached(&mut self, cut: &Params, k: usize) -> Result<TopK> {
        let cache = TopKCache::build(self.teachers, &self.data.train, k, |_, _| {})?;
        let topk = TopK {
            k: cache.k,
            windows: cache.windows,
            positions: cache.windows * cache.seq,
            missing_mass: cache.mean_missing_mass,
            truncation_kl: cache.mean_truncation_kl,
            mib: (cache.ids.len() * 8) >> 20,
            full_mib: (cache.windows * cache.seq * cache.n_vocab * 4) >> 20,
        };
        let name = format!("distilled, τ = 2, cached top-{k}");
        let teachers = self.teachers;
        let signal = Signal::Cached(&cache);
        self.go(&name, cut.clone(), soft(2.0), signal, Some(teachers))?;
        Ok(topk)
    }

    /// Distillation at τ = 2 from an ensemble: the teacher and a copy fine-tuned on the
    /// training windows for `tokens` tokens (hard labels, a third of the learning rate).
    fn ensemble(
        &mut self,
        cut: &Params,
        t_params: &Params,
        tokens: usize,
        inputs: &Inputs,
        teacher_file: &GgufFile,
    ) -> Result<Ensemble> {
        (self.progress)(Progress::Line("fine-tuning the second teacher...".into()));
        let r = self.recovery;
        let per_step = r.seq * r.batch;
        let ens_steps = tokens.div_ceil(per_step).max(1);
        let mut c = r.config(LossConfig::default(), ens_steps);
        c.schedule.lr = r.lr / 3.0;
        c.eval_every = 0;
        let mut ft = Trainer::new(t_params.clone(), c, self.data, Signal::None, None)?;
        ft.run(|_| {})?;
        let summary = Ensemble {
            tokens: ens_steps * per_step,
            lr: r.lr / 3.0,
            before: ft.history.first().map(|p| p.ppl).unwrap_or(0.0),
            after: ft.history.last().map(|p| p.ppl).unwrap_or(0.0),
        };
        let second = inputs.work.join("teacher-tuned.gguf");
        let prov = Provenance {
            mode: "train".into(),
            student: "teacher".into(),
            loss: "ce".into(),
            temperature: 1.0,
            tokens: summary.tokens as u64,
            lr: r.lr / 3.0,
            seed: r.seed,
            ..Default::default()
        };
        write_model(&ft.params, teacher_file, &prov, Some("q8_0"), &second)?;
        drop(ft);
        let q8 = |p: &Path| -> Result<Model> {
            let mut m = Model::load(p)?;
            m.set_activations(Activations::Q8);
            Ok(m)
        };
        let ensemble = OnlineTeachers {
            models: vec![(q8(inputs.teacher)?, 1.0), (q8(&second)?, 1.0)],
        };
        let teachers = self.teachers;
        let name = "distilled from the ensemble, τ = 2";
        let result = self.go(
            name,
            cut.clone(),
            soft(2.0),
            Signal::Online(&ensemble),
            Some(teachers),
        );
        drop(ensemble);
        let _ = std::fs::remove_file(&second);
        result.map(|()| summary)
    }

    /// A student two thirds as wide, initialized from `keep`'s layers, distilled at τ = 2
    /// with 0.5 × (1 − cos) between its last layer's output and the teacher's.
    fn arch(
        &mut self,
        t_params: &Params,
        keep: &[usize],
        n_layers: usize,
        heldout: impl Fn(&Params, Option<&OnlineTeachers>) -> Result<(f64, Option<f64>)>,
    ) -> Result<Arch> {
        let narrow = student::narrower(t_params, keep, self.recovery.seed)?;
        let mut loss = soft(2.0);
        loss.hidden = Some(HiddenConfig {
            weight: 0.5,
            kind: HiddenKind::Cosine,
            pairs: vec![(n_layers - 1, t_params.config.n_layers - 1)],
        });
        let arch = Arch {
            config: narrow.config.clone(),
            params: narrow.n_params(),
            eval: heldout(&narrow, Some(self.teachers))?,
        };
        let teachers = self.teachers;
        let name = "other architecture, τ = 2 + hidden cosine";
        self.go(name, narrow, loss, Signal::Online(teachers), None)?;
        Ok(arch)
    }
}

/// The hard-label student, the best distilled one and the other architecture's, each written
/// in the teacher's storage `format` and timed (then removed).
fn time_students(
    plan: &Plan,
    inputs: &Inputs,
    results: &[RunResult],
    (teacher_file, format): (&GgufFile, &str),
    keep: &[usize],
) -> Result<Vec<Timed>> {
    let r = &plan.recovery;
    let tokens = plan.tokens.div_ceil(r.seq * r.batch).max(1) * r.seq * r.batch;
    let best = best_index(results);
    let mut timed = Vec::new();
    for (i, run) in results.iter().enumerate() {
        if i != 0 && !run.name.starts_with("other") && i != best {
            continue;
        }
        let p = inputs.work.join(format!("student-{i}.gguf"));
        let prov = Provenance {
            mode: "distill".into(),
            student: run.name.clone(),
            tokens: tokens as u64,
            lr: r.lr,
            seed: r.seed,
            kept_layers: keep.to_vec(),
            ..Default::default()
        };
        write_model(&run.params, teacher_file, &prov, Some(format), &p)?;
        let speed = speed_of(&p, &plan.speed);
        let _ = std::fs::remove_file(&p);
        timed.push(Timed {
            name: run.name.clone(),
            layers: run.params.config.n_layers,
            params: run.params.n_params(),
            speed: speed?,
        });
    }
    Ok(timed)
}
