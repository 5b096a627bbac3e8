//! Flags shared by several commands, and the model loading they share.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use frugal::attention::Attention;
use frugal::convert::{self, Action, Policy, Target};
use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvLayout, KvOptions, KvType};
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::sample::SamplerParams;
use frugal::speculate::{SpecOptions, Speculator};
use frugal::surgery::importance::Importance;
use frugal::tokenizer::Tokenizer;

#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// GGUF model file, or a known model's name (smollm2-135m, gemma3-270m), fetched on first
    /// use [default: smollm2-135m, SmolLM2-135M-Instruct Q4_1, in $FRUGAL_HOME or ~/.cache/frugal]
    #[arg(short = 'm', long = "model", value_parser = model_arg)]
    pub model: Option<PathBuf>,
    /// Activation precision in products with block-quantized weights: q8 (8 bits per block of
    /// 32 and integer kernels, as llama.cpp runs quantized files; a Q8_0 output head takes 15
    /// bits), q8-full (exactly as llama.cpp: the head at 8 bits too, and K-quant products on
    /// its Q8_K, one scale per 256) or f32 (exact arithmetic on the dequantized weights)
    #[arg(long = "activations", default_value = "q8")]
    pub activations: Activations,
    /// Re-quantize the weights in memory at load time (in-situ quantization): a GGUF type
    /// (q8_0, q6_k, q5_k, q5_1, q5_0, q4_k, q4_1, q4_0, iq4_xs, iq4_nl, mxfp4, q3_k, q2_k, f16,
    /// bf16, f32) is re-encoded for real;
    /// a research format (int8-tensor, int8-channel, int4-b32, ..., fp8-e4m3, fp8-e5m2, nf4) is
    /// simulated: quantized, then dequantized into F32 weights the model runs on. Norms stay F32
    /// and the embedding/output at 8 bits, as `frugal quantize` does.
    #[arg(long = "quantize-on-load", value_name = "TYPE")]
    pub quantize_on_load: Option<String>,
    /// Store each Q8_0 layer matrix with at least this fraction of zero weights (a pruned model)
    /// as a bitmap of its nonzero bytes, multiplied by the sparse kernels (AVX-512 VBMI2, 8-bit
    /// activations). `frugal report prune` measures the sparsity from which it pays.
    #[arg(long = "sparse-bitmap", value_name = "MIN_SPARSITY")]
    pub sparse_bitmap: Option<f64>,
}

/// The calibration text of model surgery (`prune`, `moefy`): the activations it reads.
#[derive(clap::Args, Clone, Debug)]
pub struct CalibrationArgs {
    /// Calibration text: the activations that guide the surgery
    #[arg(long = "calibration", value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// Calibration tokens taken from the start of --calibration
    #[arg(long = "calibration-tokens", default_value_t = 2048)]
    pub calibration_tokens: usize,
    /// Calibration window in tokens (the text must hold at least one)
    #[arg(long = "calibration-ctx", default_value_t = 512)]
    pub calibration_ctx: usize,
}

impl CalibrationArgs {
    /// The first `--calibration-tokens` token ids of the text, in `model`'s vocabulary, or
    /// `None` without `--calibration`.
    pub fn tokens(&self, model: &Model) -> Result<Option<Vec<u32>>> {
        let Some(path) = &self.calibration else {
            return Ok(None);
        };
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut ids = Tokenizer::from_gguf(&model.file)?.encode(&text, false)?;
        ids.truncate(self.calibration_tokens);
        Ok(Some(ids))
    }

    /// The column importance of `model`'s matrices over the calibration text (weighted
    /// quantization), or `None` without `--calibration`.
    pub fn importance(&self, model: &Model) -> Result<Option<Importance>> {
        let Some(ids) = self.tokens(model)? else {
            return Ok(None);
        };
        let imp = Importance::collect(model, &ids, self.calibration_ctx)?;
        eprintln!(
            "importance of {} matrices' input columns over {} calibration tokens",
            imp.len(),
            imp.tokens
        );
        Ok(Some(imp))
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct RunArgs {
    /// Context length in tokens [default: the model's trained context]
    #[arg(short = 'c', long = "ctx")]
    pub ctx: Option<usize>,
    /// Recompute every position of the prefix at each step instead of caching keys and values
    /// (shows the quadratic cost the KV cache removes)
    #[arg(long = "no-kv-cache")]
    pub no_kv_cache: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// How attention is computed and how the KV cache stores keys and values.
#[derive(clap::Args, Clone, Debug)]
pub struct EngineArgs {
    /// Attention kernel: flash (tiled, online softmax) or naive (full score matrix); both exact
    #[arg(long = "attention", default_value = "flash")]
    pub attention: String,
    /// Storage format of cached keys and values: f32, f16, bf16 or q8_0
    #[arg(long = "kv-type", default_value = "f32")]
    pub kv_type: String,
    /// Format of cached keys only (overrides --kv-type)
    #[arg(long = "kv-type-k")]
    pub kv_type_k: Option<String>,
    /// Format of cached values only (overrides --kv-type)
    #[arg(long = "kv-type-v")]
    pub kv_type_v: Option<String>,
    /// KV cache layout: paged (blocks from a pool) or contiguous
    #[arg(long = "kv-layout", default_value = "paged")]
    pub kv_layout: String,
    /// Positions per block of the paged KV cache
    #[arg(long = "kv-block", default_value_t = 16)]
    pub kv_block: usize,
}

impl EngineArgs {
    pub fn attention(&self) -> Result<Attention> {
        Ok(self.attention.parse::<Attention>()?)
    }

    /// The KV formats and layout the flags ask for; unknown names are errors naming the choices.
    pub fn kv_options(&self) -> Result<KvOptions> {
        let both: KvType = self.kv_type.parse()?;
        let k = match &self.kv_type_k {
            Some(t) => t.parse()?,
            None => both,
        };
        let v = match &self.kv_type_v {
            Some(t) => t.parse()?,
            None => both,
        };
        let layout = match self.kv_layout.to_ascii_lowercase().as_str() {
            "paged" => {
                anyhow::ensure!(self.kv_block > 0, "--kv-block must be at least 1");
                KvLayout::Paged {
                    block_size: self.kv_block,
                }
            }
            "contiguous" => KvLayout::Contiguous,
            other => anyhow::bail!("unknown KV layout {other:?}: expected paged or contiguous"),
        };
        Ok(KvOptions {
            format: KvFormat { k, v },
            layout,
        })
    }
}

#[derive(clap::Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Maximum tokens to generate
    #[arg(short = 'n', long = "max-tokens", default_value_t = 256)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 is greedy
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the k most likely tokens (0 = off)
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off)
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than min-p times the most likely (0 = off)
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalize tokens seen in the last 64 (1 = off)
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed: the same seed gives the same text
    #[arg(long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Stop when this text is generated (repeatable)
    #[arg(long = "stop")]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplerParams {
        SamplerParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: 64,
            seed: self.seed,
            ..SamplerParams::default()
        }
    }
}

/// Speculative decoding: a drafter proposes tokens, the model checks them in one pass; the
/// output is exactly the model's own.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SpecArgs {
    /// Speculative decoding with a drafter: ngram[:N][:K] (prompt lookup, no model),
    /// self:L[:K] (the model's first L layers and its head), draft:FILE[:K] (a smaller model with
    /// the same vocabulary); K is the most tokens drafted per pass. Greedy output is token for
    /// token the same as without; sampling keeps the model's distribution exactly
    #[arg(long = "speculate", value_name = "DRAFTER")]
    pub speculate: Option<String>,
    /// Draft K tokens every pass instead of adapting the draft length to the acceptance
    #[arg(long = "speculate-fixed", requires = "speculate")]
    pub fixed: bool,
    /// A draft model scores only its first N token ids (FR-Spec: a BPE vocabulary is numbered
    /// by merge order, so roughly the N most frequent); the output is unchanged
    #[arg(long = "draft-vocab", value_name = "N", requires = "speculate")]
    pub draft_vocab: Option<usize>,
}

impl SpecArgs {
    /// The parsed drafter, if any (errors name the accepted forms).
    pub fn options(&self) -> Result<Option<SpecOptions>> {
        let Some(s) = &self.speculate else {
            return Ok(None);
        };
        let mut o: SpecOptions = s.parse().map_err(anyhow::Error::msg)?;
        o.adaptive = !self.fixed;
        anyhow::ensure!(
            self.draft_vocab.is_none()
                || matches!(o.method, frugal::speculate::Method::Draft { .. }),
            "--draft-vocab applies to a draft: model"
        );
        anyhow::ensure!(
            self.draft_vocab != Some(0),
            "--draft-vocab must be at least 1"
        );
        o.draft_vocab = self.draft_vocab;
        Ok(Some(o))
    }
}

/// A speculative session for `model` (a `draft:` model is loaded with the target's activation
/// precision, a `heads:` file read).
pub fn speculator<'m>(
    model: &'m Model,
    ctx: usize,
    kv: &KvOptions,
    attention: Attention,
    spec: &SpecOptions,
) -> Result<Speculator<'m>> {
    Speculator::new(model, ctx, kv, attention, spec, None)
        .with_context(|| format!("setting up speculative decoding ({:?})", spec.method))
}

/// Parses a model argument: a path, or a known model's short name resolved to its place in
/// the cache (`-m gemma3-270m`). Use as `#[arg(value_parser = model_arg)]`.
pub fn model_arg(s: &str) -> Result<PathBuf, String> {
    if s.is_empty() {
        return Err("empty model path".into());
    }
    Ok(frugal::fetch::resolve_model_arg(Path::new(s)))
}

/// The model path given (a known model fetched if it is not in the cache yet), or the default
/// model (fetched if missing).
pub fn model_path(args: &ModelArgs) -> Result<PathBuf> {
    input_model(args.model.as_deref())
}

/// A model a command reads: the path given (fetched first when it names a known model not yet
/// in the cache), or the default model.
pub fn input_model(path: Option<&Path>) -> Result<PathBuf> {
    let mut log = |m: &str| eprintln!("{m}");
    match path {
        Some(p) => Ok(frugal::fetch::ensure_model_path(p, &mut log)?),
        None => Ok(frugal::fetch::ensure_default_model(log)?),
    }
}

/// Loads the model and its tokenizer.
pub fn load(args: &ModelArgs) -> Result<(Model, Tokenizer)> {
    let path = model_path(args)?;
    let mut model = load_model(&path, args.quantize_on_load.as_deref())?;
    model.set_activations(args.activations);
    if let Some(min) = args.sparse_bitmap {
        anyhow::ensure!(
            (0.0..=1.0).contains(&min),
            "--sparse-bitmap {min}: give a fraction of zero weights in [0, 1]"
        );
        let n = model.use_bitmap_storage(min);
        eprintln!("sparse bitmap: {n} matrices with at least {min} of their weights zero");
    }
    let tok = Tokenizer::from_gguf(&model.file)
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    Ok((model, tok))
}

/// Opens a model file, re-quantizing it in memory first when `quantize_on_load` names a type
/// (the summary goes to stderr).
pub fn load_model(path: &Path, quantize_on_load: Option<&str>) -> Result<Model> {
    let loading = || format!("loading {}", path.display());
    let Some(ty) = quantize_on_load else {
        return Model::load(path).with_context(loading);
    };
    let target: Target = ty.parse()?;
    let file = GgufFile::open(path).with_context(loading)?;
    let t0 = std::time::Instant::now();
    let (file, report) = convert::quantize_in_memory(&file, &Policy::new(target), |_, _| {})
        .with_context(|| format!("quantizing {} to {target} on load", path.display()))?;
    let count = |a: Action| report.tensors.iter().filter(|t| t.action == a).count();
    eprintln!(
        "quantize-on-load {target}: {} tensors re-encoded, {} simulated (quantized, then held as F32), {} kept; {} -> {} of weights in memory ({:.1} s){}",
        count(Action::Encode),
        count(Action::Simulate),
        count(Action::Keep),
        human_bytes(report.bytes_before),
        human_bytes(report.bytes_after),
        t0.elapsed().as_secs_f64(),
        if report.fallbacks.is_empty() {
            String::new()
        } else {
            format!(
                "; {} tensors fell back to another type (rows not a whole number of blocks)",
                report.fallbacks.len()
            )
        }
    );
    Model::from_file(file).with_context(loading)
}

/// The context length to use: the flag, else the model's trained context; the model's
/// context-dependent choices (Phi-3's RoPE factors) follow it.
pub fn context_len(run: &RunArgs, model: &mut Model) -> Result<usize> {
    let ctx = run.ctx.unwrap_or(model.config.n_ctx_train);
    anyhow::ensure!(ctx > 0, "--ctx must be at least 1");
    model.config.set_context(ctx);
    Ok(ctx)
}

/// Human units with binary prefixes (KiB = 1024 bytes).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// Reads all of stdin as UTF-8 text.
pub fn read_stdin() -> Result<String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::io::stdin()
        .read_to_end(&mut bytes)
        .context("reading stdin")?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "stdin is not valid UTF-8 (at byte {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// Prints a training run's progress on stderr: the step line rewritten in place, a line per
/// held-out evaluation.
pub fn training_progress(steps: usize) -> impl FnMut(frugal_train::trainer::Event) {
    use frugal_train::trainer::Event;
    move |e| match e {
        Event::Step(s) => eprint!(
            "\r  step {}/{steps} loss {:.3} {:.0} tok/s   ",
            s.step, s.objective, s.tokens_per_s
        ),
        Event::Eval(p) => eprintln!(
            "\r  {} tokens: held-out PPL {:.2}, KL {:.4}            ",
            p.tokens,
            p.ppl,
            p.kl.unwrap_or(f64::NAN)
        ),
        Event::Saved(_) => {}
    }
}

/// Prints a lab study's progress on stderr: lines as they come, a step counter rewritten in
/// place, training runs as [`training_progress`] does.
pub fn lab_progress() -> impl FnMut(frugal_lab::progress::Progress) {
    use frugal_lab::progress::Progress;
    let mut in_place = false;
    move |p| match p {
        Progress::Line(s) => {
            eprintln!("{}{s}", if in_place { "\r" } else { "" });
            in_place = false;
        }
        Progress::Status(s) => {
            eprint!("\r{s}   ");
            in_place = true;
        }
        Progress::Train { steps, event } => training_progress(steps)(event),
    }
}
