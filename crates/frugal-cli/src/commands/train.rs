//! `frugal train` (next-token training of any model) and `frugal distill` (a student trained
//! to imitate one or more teachers). Both drive `frugal_train::trainer`; this file only parses
//! flags, builds the student and the teacher signal, shows progress and writes the result.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;
use frugal_train::data::{Corpus, corpus_from_files, split, teacher_samples};
use frugal_train::gemm::{self, Precision};
use frugal_train::hidden::HiddenKind;
use frugal_train::loss::Divergence;
use frugal_train::model::RunOptions;
use frugal_train::optim::{AdamWConfig, Schedule};
use frugal_train::output::{Provenance, write_model};
use frugal_train::student::{
    Importance, StudentConfig, choose_layers, keep_layers, layer_importance,
};
use frugal_train::teacher::{OnlineTeachers, TopKCache};
use frugal_train::trainer::{
    Event, HiddenConfig, LossConfig, LrProbe, Signal, TrainConfig, Trainer,
};
use frugal_train::{Params, checkpoint};
use indicatif::{ProgressBar, ProgressStyle};

use super::common::human_bytes;

/// Flags shared by `train` and `distill`.
#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// Text files to train on (tokenized into windows; the last --heldout of them held out)
    #[arg(long = "data", num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Fraction of the windows held out for evaluation
    #[arg(long = "heldout", default_value_t = 0.1)]
    pub heldout: f64,
    /// Training tokens (k and M suffixes: 200k); rounded up to whole optimizer steps
    #[arg(long = "tokens", default_value = "100k")]
    pub tokens: String,
    /// Tokens per training sequence
    #[arg(long = "seq", default_value_t = 512)]
    pub seq: usize,
    /// Sequences per micro-batch
    #[arg(long = "batch", default_value_t = 4)]
    pub batch: usize,
    /// Micro-batches accumulated into one optimizer step
    #[arg(long = "accum", default_value_t = 1)]
    pub accum: usize,
    /// Peak learning rate (AdamW): a number, or auto (probed before the run: from 3e-4 down by
    /// √10 at a time, each rate a few steps from the starting weights, scored on held-out
    /// text, the best kept), or auto:MAX (probed from MAX down)
    #[arg(long = "lr", default_value = "auto")]
    pub lr: String,
    /// Warmup steps [default: 5% of the steps]
    #[arg(long = "warmup")]
    pub warmup: Option<usize>,
    /// Final learning rate as a fraction of the peak (cosine decay)
    #[arg(long = "min-lr-ratio", default_value_t = 0.1)]
    pub min_lr_ratio: f32,
    /// Decoupled weight decay on matrices
    #[arg(long = "weight-decay", default_value_t = 0.1)]
    pub weight_decay: f32,
    /// AdamW's second-moment decay
    #[arg(long = "beta2", default_value_t = 0.95)]
    pub beta2: f32,
    /// Clip the global gradient norm to this (0: off)
    #[arg(long = "clip", default_value_t = 1.0)]
    pub clip: f64,
    /// Do not train the tensors matching this glob (repeatable), e.g. token_embd.weight
    #[arg(long = "freeze", value_name = "GLOB")]
    pub freeze: Vec<String>,
    /// Seed for initialization, data order and teacher samples: the same seed, the same run
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Arithmetic of the matrix products: bf16 (bf16 inputs, f32 accumulation, on AMX or
    /// AVX512-BF16 where the CPU has them), f32, or auto (bf16 where the hardware has it)
    #[arg(long = "precision", default_value = "auto")]
    pub precision: String,
    /// Recompute each layer's activations in the backward instead of keeping them all: about
    /// half the peak memory (2.4 GiB against 5.2 GiB for the 135M model at 4 x 512), 20-30%
    /// slower
    #[arg(long = "recompute")]
    pub recompute: bool,
    /// A MoE student's load balancing: weight α of the Switch loss α·E·Σ f_i·P_i added in
    /// every routed layer (0: none; without it the routers are free to collapse)
    #[arg(long = "moe-aux", default_value_t = 0.0)]
    pub moe_aux: f32,
    /// Evaluate on the held-out windows every N steps (0: start and end only)
    #[arg(long = "eval-every", default_value_t = 0)]
    pub eval_every: usize,
    /// Held-out windows per evaluation (0: all)
    #[arg(long = "eval-windows", default_value_t = 8)]
    pub eval_windows: usize,
    /// Checkpoint file (parameters, optimizer state, step); with --resume, continue from it
    #[arg(long = "checkpoint")]
    pub checkpoint: Option<PathBuf>,
    /// Write the checkpoint every N steps (0: at the end only)
    #[arg(long = "save-every", default_value_t = 0)]
    pub save_every: usize,
    /// Continue the run saved in --checkpoint (same flags required)
    #[arg(long = "resume")]
    pub resume: bool,
    /// The GGUF file to write
    #[arg(long = "out")]
    pub out: PathBuf,
    /// Storage type of the written model: f32, or any type `frugal quantize` writes
    #[arg(long = "type", default_value = "f32")]
    pub ty: String,
    /// Write every step and evaluation as a JSON line to this file
    #[arg(long = "log")]
    pub log: Option<PathBuf>,
    /// Print a JSON summary instead of text
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct TrainCmd {
    /// The model to train (any GGUF frugal runs) [default: SmolLM2-135M-Instruct]
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub train: TrainArgs,
}

#[derive(clap::Args, Debug)]
pub struct DistillCmd {
    /// Teacher model (repeatable: several teachers are an ensemble, their distributions averaged)
    #[arg(long = "teacher", required = true, value_parser = super::common::model_arg)]
    pub teachers: Vec<PathBuf>,
    /// Weight of each teacher in the ensemble (one per --teacher) [default: equal]
    #[arg(long = "teacher-weight")]
    pub teacher_weights: Vec<f32>,
    /// The student: keep-layers:N (the N most important teacher layers), keep-layers:0,3,7
    /// (those layers), config:FILE.json (another architecture: n_layers, n_embd, n_ff, n_head,
    /// n_head_kv, head_dim, init = teacher|random), self (the teacher itself), or a GGUF path
    #[arg(long = "student")]
    pub student: String,
    /// How keep-layers:N measures layer importance: loss (loss increase when the layer is
    /// skipped) or bi (block influence, 1 - cos(input, output))
    #[arg(long = "importance", default_value = "loss")]
    pub importance: String,
    /// Keep the student's zeros at zero (masked updates), so a pruned model keeps its sparsity
    /// pattern; on by default for a student written by `frugal prune`
    #[arg(long = "keep-sparsity")]
    pub keep_sparsity: bool,
    /// Weight of the soft (teacher) loss; the hard-label loss gets 1 - alpha
    #[arg(long = "alpha", default_value_t = 1.0)]
    pub alpha: f32,
    /// Softmax temperature of the soft targets (the loss is scaled by τ²)
    #[arg(long = "temperature", default_value_t = 2.0)]
    pub temperature: f32,
    /// Use the reverse KL, KL(student ‖ teacher) (mode-seeking), instead of the forward KL
    #[arg(long = "reverse-kl")]
    pub reverse_kl: bool,
    /// Weight of a hidden-state loss between student and teacher layer outputs (0: off)
    #[arg(long = "hidden-loss", default_value_t = 0.0)]
    pub hidden_loss: f32,
    /// Hidden-state distance: cosine or mse
    #[arg(long = "hidden-kind", default_value = "cosine")]
    pub hidden_kind: String,
    /// Student:teacher layer pairs for the hidden-state loss, e.g. 4:12,9:29 [default: last:last]
    #[arg(long = "hidden-layers")]
    pub hidden_layers: Option<String>,
    /// Cache the teacher's top-K log-probabilities in --teacher-cache and train from it (offline
    /// signal) instead of running the teacher beside the student
    #[arg(long = "topk")]
    pub topk: Option<usize>,
    /// The top-k cache file: built if missing, reused if present
    #[arg(long = "teacher-cache")]
    pub teacher_cache: Option<PathBuf>,
    /// With no --data: windows sampled from the teacher (temperature 1, seeded) to train on
    #[arg(long = "samples", default_value_t = 64)]
    pub samples: usize,
    /// Activations of the teacher's products (its fast quantized path by default)
    #[arg(long = "teacher-activations", default_value = "q8")]
    pub teacher_activations: Activations,
    #[command(flatten)]
    pub train: TrainArgs,
}

/// `200k`, `1.5M`, `4096`.
pub fn parse_count(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1e3),
        Some('m' | 'M') => (&t[..t.len() - 1], 1e6),
        _ => (t, 1.0),
    };
    let v: f64 = num
        .parse()
        .with_context(|| format!("{s:?} is not a count (200k, 1M, 4096)"))?;
    ensure!(
        v.is_finite() && v > 0.0 && v * mult < 1e12,
        "{s:?} is out of range"
    );
    Ok((v * mult).round() as usize)
}

/// `--precision`: auto (bf16 where the CPU multiplies bf16 in hardware), bf16 or f32.
pub fn precision(s: &str) -> Result<Precision> {
    Ok(match s {
        "f32" => Precision::F32,
        "bf16" => Precision::Bf16,
        "auto" => frugal_lab::heal::auto_precision(),
        other => bail!("unknown precision {other:?}: use auto, bf16 or f32"),
    })
}

/// The run's configuration from the flags.
fn train_config(a: &TrainArgs, loss: LossConfig) -> Result<TrainConfig> {
    ensure!(
        a.seq > 1 && a.batch > 0 && a.accum > 0,
        "--seq must be at least 2, --batch and --accum at least 1"
    );
    ensure!(
        (0.0..1.0).contains(&a.heldout),
        "--heldout must be in [0, 1)"
    );
    let (lr, _) = learning_rate(&a.lr)?;
    ensure!(
        a.moe_aux.is_finite() && a.moe_aux >= 0.0,
        "--moe-aux must be a weight of at least 0"
    );
    let per_step = a.seq * a.batch * a.accum;
    let steps = parse_count(&a.tokens)?.div_ceil(per_step);
    let warmup = a.warmup.unwrap_or((steps / 20).max(1)).min(steps);
    Ok(TrainConfig {
        seq: a.seq,
        batch: a.batch,
        accum: a.accum,
        steps,
        schedule: Schedule {
            lr,
            warmup,
            total: steps,
            min_ratio: a.min_lr_ratio,
        },
        adamw: AdamWConfig {
            beta2: a.beta2,
            weight_decay: a.weight_decay,
            ..Default::default()
        },
        clip: a.clip,
        freeze: a.freeze.clone(),
        seed: a.seed,
        run: RunOptions {
            precision: precision(&a.precision)?,
            recompute: a.recompute,
            moe_aux: a.moe_aux,
        },
        loss,
        eval_every: a.eval_every,
        eval_windows: a.eval_windows,
        checkpoint: a.checkpoint.clone(),
        save_every: a.save_every,
    })
}

/// `--lr`: the peak rate (the probe's ceiling under `auto`) and whether to probe.
fn learning_rate(s: &str) -> Result<(f32, bool)> {
    let (value, probe) = match s.strip_prefix("auto") {
        Some("") => return Ok((LrProbe::default().max, true)),
        Some(rest) => (
            rest.strip_prefix(':')
                .with_context(|| format!("--lr {s:?}: use a number, auto or auto:MAX"))?,
            true,
        ),
        None => (s, false),
    };
    let lr: f32 = value
        .parse()
        .with_context(|| format!("--lr {s:?}: use a number, auto or auto:MAX"))?;
    ensure!(lr.is_finite() && lr > 0.0, "--lr must be positive");
    Ok((lr, probe))
}

fn load_corpus(tok: &Tokenizer, a: &TrainArgs) -> Result<Corpus> {
    Ok(corpus_from_files(tok, &a.data, a.seq, a.heldout)?)
}

pub fn run_train(c: TrainCmd) -> Result<()> {
    frugal_train::keep_freed_memory();
    let path = super::common::model_path(&super::common::ModelArgs {
        model: c.model.clone(),
        activations: Activations::F32,
        quantize_on_load: None,
        sparse_bitmap: None,
    })?;
    let model = Model::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let tok = Tokenizer::from_gguf(&model.file)?;
    ensure!(
        !c.train.data.is_empty(),
        "frugal train needs --data FILE... (text to train on)"
    );
    let data = load_corpus(&tok, &c.train)?;
    let params = Params::from_model(&model)?;
    let cfg = train_config(&c.train, LossConfig::default())?;
    let prov = Provenance {
        mode: "train".into(),
        base: Some(frugal::fetch::sha256_file(&path)?),
        student: path.display().to_string(),
        loss: "ce".into(),
        temperature: 1.0,
        seed: c.train.seed,
        ..Default::default()
    };
    let trainer = Trainer::new(params, cfg, &data, Signal::None, None)?;
    drive(trainer, &c.train, &model.file, prov)
}

pub fn run_distill(c: DistillCmd) -> Result<()> {
    frugal_train::keep_freed_memory();
    ensure!(
        c.teacher_weights.is_empty() || c.teacher_weights.len() == c.teachers.len(),
        "give one --teacher-weight per --teacher ({} teachers, {} weights)",
        c.teachers.len(),
        c.teacher_weights.len()
    );
    ensure!((0.0..=1.0).contains(&c.alpha), "--alpha must be in [0, 1]");
    ensure!(
        c.temperature.is_finite() && c.temperature > 0.0,
        "--temperature must be positive"
    );
    let mut models = Vec::new();
    let mut hashes = Vec::new();
    for (i, p) in c.teachers.iter().enumerate() {
        let mut m = Model::load(p).with_context(|| format!("loading teacher {}", p.display()))?;
        m.set_activations(c.teacher_activations);
        if let Some((first, _)) = models.first() {
            let first: &Model = first;
            ensure!(
                first.config.n_vocab == m.config.n_vocab,
                "teacher {} has a vocabulary of {}, the first teacher {}",
                p.display(),
                m.config.n_vocab,
                first.config.n_vocab
            );
        }
        hashes.push(frugal::fetch::sha256_file(p)?);
        models.push((m, c.teacher_weights.get(i).copied().unwrap_or(1.0)));
    }
    let teachers = OnlineTeachers { models };
    let (first, _) = &teachers.models[0];
    let tok = Tokenizer::from_gguf(&first.file)?;
    // The student's starting weights decode from the first teacher's file (already open).
    let t_params = Params::from_model(first)?;

    // Data: text files, or the teacher's own samples.
    let data = if c.train.data.is_empty() {
        ensure!(
            c.samples >= 2,
            "--samples must be at least 2 (one window to train on, one held out)"
        );
        let bar = bar(c.samples as u64, "sampling the teacher", c.train.json);
        let w = teacher_samples(first, &tok, c.samples, c.train.seq, c.train.seed, |d, _| {
            bar.set_position(d as u64)
        })?;
        bar.finish_and_clear();
        split(
            w,
            c.train.heldout.max(1.0 / c.samples as f64),
            "the teacher's samples",
        )?
    } else {
        load_corpus(&tok, &c.train)?
    };

    // The student.
    let mut kept = Vec::new();
    let (student, template) = build_student(&c, &t_params, &data, &mut kept)?;
    if student.config.n_vocab != t_params.config.n_vocab {
        return Err(frugal_train::TrainError::VocabMismatch {
            student: student.config.n_vocab,
            teacher: t_params.config.n_vocab,
        }
        .into());
    }
    let hidden = if c.hidden_loss > 0.0 {
        let kind: HiddenKind = c.hidden_kind.parse().map_err(anyhow::Error::msg)?;
        let pairs = match &c.hidden_layers {
            Some(s) => parse_pairs(s)?,
            None => vec![(student.config.n_layers - 1, t_params.config.n_layers - 1)],
        };
        Some(HiddenConfig {
            weight: c.hidden_loss,
            kind,
            pairs,
        })
    } else {
        None
    };
    let loss = LossConfig {
        alpha: c.alpha,
        temperature: c.temperature,
        divergence: if c.reverse_kl {
            Divergence::Reverse
        } else {
            Divergence::Forward
        },
        hidden,
    };
    let cfg = train_config(&c.train, loss.clone())?;
    let cache = match c.topk {
        None => None,
        Some(k) => {
            let path = c.teacher_cache.clone().context(
                "--topk needs --teacher-cache FILE (built if missing, reused if present)",
            )?;
            Some(if path.exists() {
                TopKCache::load(&path)?
            } else {
                let b = bar(
                    data.train.len() as u64,
                    "caching the teacher's top-k",
                    c.train.json,
                );
                let cache =
                    TopKCache::build(&teachers, &data.train, k, |d, _| b.set_position(d as u64))?;
                b.finish_and_clear();
                cache.save(&path)?;
                cache
            })
        }
    };
    if let Some(cache) = &cache
        && !c.train.json
    {
        eprintln!(
            "teacher cache: top-{} of {} tokens; mass outside the top-k {:.4}, KL(truncated ‖ full) {:.4} nats per token",
            cache.k, cache.n_vocab, cache.mean_missing_mass, cache.mean_truncation_kl
        );
    }
    let signal = match &cache {
        Some(cache) => Signal::Cached(cache),
        None => Signal::Online(&teachers),
    };
    let prov = Provenance {
        mode: "distill".into(),
        teachers: hashes,
        base: None,
        student: c.student.clone(),
        loss: describe_loss(&loss, cache.as_ref().map(|c| c.k)),
        temperature: c.temperature,
        seed: c.train.seed,
        kept_layers: kept,
        ..Default::default()
    };
    let mut trainer = Trainer::new(student, cfg, &data, signal, Some(&teachers))?;
    let pruned = template
        .metadata()
        .iter()
        .any(|(k, _)| k == "frugal.prune.pattern");
    if c.keep_sparsity || pruned {
        let held = trainer.keep_sparsity();
        if !c.train.json {
            eprintln!(
                "keeping the sparsity pattern: {held} zero weights stay zero (masked updates)"
            );
        }
    }
    drive(trainer, &c.train, &template, prov)
}

/// The student named by `--student`, and the GGUF whose metadata its output carries.
fn build_student(
    c: &DistillCmd,
    teacher: &Params,
    data: &Corpus,
    kept: &mut Vec<usize>,
) -> Result<(Params, GgufFile)> {
    let template = || GgufFile::open(&c.teachers[0]).map_err(anyhow::Error::from);
    let s = c.student.as_str();
    if let Some(spec) = s.strip_prefix("keep-layers:") {
        let keep: Vec<usize> = if spec.contains(',') {
            spec.split(',')
                .map(|v| v.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .with_context(|| {
                    format!("--student keep-layers:{spec}: not a list of layer numbers")
                })?
        } else {
            let n: usize = spec
                .parse()
                .with_context(|| format!("--student keep-layers:{spec}: not a layer count"))?;
            ensure!(
                n >= 1 && n <= teacher.config.n_layers,
                "keep-layers:{n}: the teacher has {} layers",
                teacher.config.n_layers
            );
            let how: Importance = c.importance.parse().map_err(anyhow::Error::msg)?;
            let calib = data.train.first(4);
            let mut t = teacher.clone();
            let imp = layer_importance(&mut t, &calib, how, precision(&c.train.precision)?);
            let keep = choose_layers(&imp, n);
            if !c.train.json {
                let list: Vec<String> = imp
                    .iter()
                    .enumerate()
                    .map(|(i, v)| format!("{i}:{v:.3}"))
                    .collect();
                eprintln!("layer importance ({}): {}", c.importance, list.join(" "));
                eprintln!("keeping layers {keep:?}");
            }
            keep
        };
        *kept = keep.clone();
        return Ok((keep_layers(teacher, &keep)?, template()?));
    }
    if let Some(file) = s.strip_prefix("config:") {
        let sc = StudentConfig::load(Path::new(file))?;
        return Ok((sc.build(teacher, c.train.seed)?, template()?));
    }
    if s == "self" {
        return Ok((teacher.clone(), template()?));
    }
    let p = Path::new(s);
    ensure!(
        p.exists(),
        "--student {s:?}: not keep-layers:N, config:FILE, self, or an existing GGUF file"
    );
    let m = Model::load(p).with_context(|| format!("loading the student {}", p.display()))?;
    let params = Params::from_model(&m)?;
    Ok((params, GgufFile::open(p)?))
}

fn parse_pairs(s: &str) -> Result<Vec<(usize, usize)>> {
    s.split(',')
        .map(|p| {
            let (a, b) = p
                .split_once(':')
                .with_context(|| format!("--hidden-layers {p:?}: expected STUDENT:TEACHER"))?;
            Ok((a.trim().parse()?, b.trim().parse()?))
        })
        .collect()
}

fn describe_loss(l: &LossConfig, topk: Option<usize>) -> String {
    let div = match l.divergence {
        Divergence::Forward => "kl(teacher||student)",
        Divergence::Reverse => "kl(student||teacher)",
    };
    let mut s = format!(
        "{:.2}*ce + {:.2}*{div}(tau={})*tau^2",
        1.0 - l.alpha,
        l.alpha,
        l.temperature
    );
    if let Some(k) = topk {
        s += &format!(" [teacher top-{k} cached]");
    }
    if let Some(h) = &l.hidden {
        s += &format!(" + {}*{:?}(hidden {:?})", h.weight, h.kind, h.pairs);
    }
    s
}

fn bar(len: u64, msg: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b.set_message(msg.to_string());
    b
}

/// Runs the trainer with a progress bar and a log, then writes the model.
/// Probes the peak learning rate from `ceiling` down ([`Trainer::probe_learning_rate`]),
/// printing each trial.
fn probe_learning_rate(t: &mut Trainer, ceiling: f32, json: bool) -> Result<()> {
    let probe = LrProbe {
        max: ceiling,
        ..LrProbe::default()
    };
    if !json {
        eprintln!(
            "probing the learning rate: {} steps per rate from {ceiling:.1e} down",
            probe.steps
        );
    }
    let choice = t.probe_learning_rate(probe, |trial| {
        if !json {
            eprintln!("  lr {:.1e}: held-out {:.4}", trial.lr, trial.score);
        }
    })?;
    if !json {
        eprintln!(
            "learning rate {:.1e} (held-out {:.4} before any step{})",
            choice.lr,
            choice.start,
            if choice.improved() {
                ""
            } else {
                "; no rate improved on it within the probe"
            }
        );
    }
    Ok(())
}

fn drive(mut t: Trainer, a: &TrainArgs, template: &GgufFile, mut prov: Provenance) -> Result<()> {
    let (ceiling, probe) = learning_rate(&a.lr)?;
    let mut resumed = false;
    if a.resume {
        let ck = a
            .checkpoint
            .as_ref()
            .context("--resume needs --checkpoint FILE")?;
        if ck.exists() {
            if probe {
                // The probe ran when the run started; its choice is in the checkpoint.
                t.cfg.schedule.lr = checkpoint::saved_learning_rate(ck)?;
            }
            checkpoint::resume(&mut t, ck)?;
            resumed = true;
            if !a.json {
                eprintln!("resumed from {} at step {}", ck.display(), t.step);
            }
        }
    }
    if probe && !resumed {
        probe_learning_rate(&mut t, ceiling, a.json)?;
    }
    prov.lr = t.cfg.schedule.lr;
    let mut log = match &a.log {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => None,
    };
    let steps = t.cfg.steps;
    let per_step = t.cfg.tokens_per_step();
    let precision = t.cfg.run.precision;
    if !a.json {
        eprintln!(
            "training {} parameters ({} layers) for {steps} steps x {per_step} tokens; products {} ({}), activations {}",
            t.params.n_params(),
            t.params.config.n_layers,
            match precision {
                Precision::F32 => "f32",
                Precision::Bf16 => "bf16 x bf16 -> f32",
            },
            if precision == Precision::Bf16 {
                gemm::bf16_backend()
            } else {
                "f32 kernels"
            },
            if t.cfg.run.recompute {
                "recomputed per layer"
            } else {
                "kept"
            }
        );
    }
    let bar = bar(steps as u64, "train", a.json);
    bar.set_position(t.step as u64);
    bar.set_style(
        ProgressStyle::with_template("[{bar:30}] {pos}/{len} steps {msg} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let t0 = std::time::Instant::now();
    let mut speeds = Vec::new();
    let mut write_log = |v: serde_json::Value| {
        if let Some(f) = log.as_mut() {
            use std::io::Write;
            let _ = writeln!(f, "{v}");
        }
    };
    let result = t.run(|e| match e {
        Event::Step(s) => {
            speeds.push(s.tokens_per_s);
            bar.set_position(s.step as u64);
            bar.set_message(format!(
                "loss {:.3} (ce {:.3} kl {:.4}) {:.0} tok/s",
                s.objective, s.ce, s.kl, s.tokens_per_s
            ));
            write_log(serde_json::json!({"event": "step", "stats": s}));
        }
        Event::Eval(p) => {
            if !a.json {
                bar.println(format!(
                    "step {:>5} ({} tokens): held-out ppl {:.3}{}",
                    p.step,
                    p.tokens,
                    p.ppl,
                    p.kl.map(|k| format!(", KL to teacher {k:.4}"))
                        .unwrap_or_default()
                ));
            }
            write_log(serde_json::json!({"event": "eval", "point": p}));
        }
        Event::Saved(p) => {
            write_log(serde_json::json!({"event": "checkpoint", "path": p.display().to_string()}))
        }
    });
    bar.finish_and_clear();
    if let Err(e) = result {
        if let Some(ck) = &a.checkpoint
            && ck.exists()
        {
            bail!("{e} ({})", ck.display());
        }
        return Err(e.into());
    }
    prov.tokens = (t.step * per_step) as u64;
    write_model(&t.params, template, &prov, Some(&a.ty), &a.out)?;
    let mut sorted = speeds.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    let peak = frugal::bench::peak_rss_bytes();
    let first = t.history.first().cloned().unwrap_or_default();
    let last = t.history.last().cloned().unwrap_or_default();
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "out": a.out.display().to_string(),
                "steps": t.step,
                "tokens": prov.tokens,
                "seconds": t0.elapsed().as_secs_f64(),
                "tokens_per_s_median": median,
                "peak_rss_bytes": peak,
                "precision": format!("{precision:?}"),
                "heldout_start": first,
                "heldout_end": last,
                "history": t.history,
                "provenance": prov,
            })
        );
    } else {
        println!(
            "wrote {} ({} tokens in {:.0} s, median {:.0} tokens/s; peak memory {}); held-out ppl {:.3} -> {:.3}{}",
            a.out.display(),
            prov.tokens,
            t0.elapsed().as_secs_f64(),
            median,
            peak.map(human_bytes).unwrap_or_else(|| "unknown".into()),
            first.ppl,
            last.ppl,
            match (first.kl, last.kl) {
                (Some(x), Some(y)) => format!(", KL to teacher {x:.4} -> {y:.4}"),
                _ => String::new(),
            }
        );
    }
    Ok(())
}
