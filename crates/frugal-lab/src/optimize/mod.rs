//! `frugal optimize`: the cheapest model that meets a set of targets, found by pulling frugal's
//! levers in order and measuring the candidates on this machine.
//!
//! - [`target`]: the constraints (`decode >= 5x`, `kl <= 0.05`, `memory <= 150MiB`, ...) and
//!   the objective maximized among the points that meet them.
//! - [`recipe`]: a point as the ladder's stages plus runtime settings; `recipe.toml` rebuilds
//!   it byte for byte from the same base and version, and refuses any other.
//! - [`prune`]: the pruning stage (structured removal and sparse zeros), taken only where a
//!   measured speed-up over the dense twin says this CPU rewards the cut.
//! - [`attention`]: the attention-layout stage (fewer KV groups, latent attention), pulled
//!   when a memory target binds.
//! - [`distill`]: the distillation stage (a cut candidate trained on the base's outputs),
//!   pulled only when no cheaper point meets the targets.
//! - [`quant`]: the quantization stage (uniform formats, sensitivity-allocated mixes).
//! - [`composition`]: the composition matrix (each lever alone, pairs, the full ladder)
//!   measured in one run, and what it says.
//! - [`search`]: the funnel (successive halving on KL, speed only for the points that can
//!   still win), its budget, and `frontier.json` kept on disk after every evaluation.

pub mod attention;
pub mod composition;
pub mod distill;
pub mod experts;
pub mod prune;
pub mod quant;
pub mod recipe;
pub mod search;
pub mod speculate;
pub mod target;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::quality::Quality;
use crate::size::Memory;
use recipe::{BaseId, Lever, Recipe};
use target::{Measured, Objective, Target};

/// How hard the search looks: the funnel's token counts, the groups' granularity, the
/// budget sweep and the speed test.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Funnel {
    /// KL window in tokens (the second half of each window is scored, as `frugal eval`).
    pub ctx: usize,
    /// Calibration tokens each group's sensitivity is measured on.
    pub calibration_tokens: usize,
    /// Evaluation tokens at each rung: every candidate at the first, the survivors (at most
    /// half, by Pareto layers) at each next.
    pub rungs: Vec<usize>,
    /// Layer bands per role (`ffn_down.weight[0-9]`, ...): the allocation's granularity.
    pub bands: usize,
    /// Steps of the bits-per-weight budget sweep.
    pub bpw_step: f64,
    /// Weight recipes (from the first Pareto layer) tried with other KV and activation
    /// settings.
    pub runtime_variants: usize,
    /// Prefill tokens timed (0: not timed unless a target or the objective reads prefill).
    pub prompt: usize,
    /// Decode tokens timed per run.
    pub gen_tokens: usize,
    /// Back-to-back rounds against the base per candidate.
    pub rounds: usize,
    /// Stop after this many evaluations (what a killed run leaves; for tests).
    #[serde(default)]
    pub max_evaluations: Option<usize>,
    /// Calibration tokens the cuts score weights on (their activations).
    #[serde(default = "default_prune_tokens")]
    pub prune_tokens: usize,
    /// Weight recipes (from the first Pareto layer) each taken cut is combined with, in both
    /// orders.
    #[serde(default = "default_structural_variants")]
    pub structural_variants: usize,
    /// The decode speed-up over its dense twin a cut must show to be taken
    /// ([`prune::REWARD`]; tests take every cut with 0).
    #[serde(default = "default_prune_reward")]
    pub prune_reward: f64,
    /// Training tokens of each distillation.
    #[serde(default = "default_distill_tokens")]
    pub distill_tokens: usize,
    /// Cut candidates distilled (the closest to meeting the targets first).
    #[serde(default = "default_distill_candidates")]
    pub distill_candidates: usize,
    /// The speed-up over plain decoding a drafter must show to be paired
    /// ([`speculate::REWARD`]; tests pair the fastest with 0).
    #[serde(default = "default_speculate_reward")]
    pub speculate_reward: f64,
}

fn default_speculate_reward() -> f64 {
    speculate::REWARD
}

fn default_distill_tokens() -> usize {
    16384
}

fn default_distill_candidates() -> usize {
    2
}

fn default_prune_reward() -> f64 {
    prune::REWARD
}

fn default_prune_tokens() -> usize {
    2048
}

fn default_structural_variants() -> usize {
    3
}

impl Default for Funnel {
    fn default() -> Self {
        Funnel {
            ctx: 256,
            calibration_tokens: 512,
            rungs: vec![512, 1024, 2048, 4096],
            bands: 3,
            bpw_step: 0.5,
            runtime_variants: 4,
            prompt: 64,
            gen_tokens: 32,
            rounds: 3,
            max_evaluations: None,
            prune_tokens: default_prune_tokens(),
            structural_variants: default_structural_variants(),
            prune_reward: default_prune_reward(),
            distill_tokens: default_distill_tokens(),
            distill_candidates: default_distill_candidates(),
            speculate_reward: default_speculate_reward(),
        }
    }
}

/// Everything a search needs (kept in `frontier.json`, so that `--resume DIR` needs nothing
/// else).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub model: PathBuf,
    pub calibration: PathBuf,
    pub eval: PathBuf,
    pub targets: Vec<Target>,
    pub objective: Objective,
    /// The context `memory` targets count the KV cache at (batch 1).
    pub context: usize,
    pub budget_seconds: f64,
    pub levers: Vec<Lever>,
    pub funnel: Funnel,
    /// The user's kind of prompt, `---`-separated, that speculative decoding is timed on
    /// (windows of the evaluation text when none).
    #[serde(default)]
    pub prompts: Option<PathBuf>,
}

/// Quality at one rung of the funnel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rung {
    pub tokens: usize,
    pub quality: Quality,
}

/// Speed measured back to back with the base.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SpeedPoint {
    pub decode: f64,
    pub prefill: f64,
    pub decode_ratio: f64,
    pub prefill_ratio: f64,
    pub base_decode: f64,
    pub base_prefill: f64,
}

/// One evaluated point of the space.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub key: String,
    pub recipe: Recipe,
    /// Bits per weight over every tensor.
    pub bpw: f64,
    pub weight_bytes: u64,
    /// Weights plus a KV cache of `context` tokens.
    pub memory: Option<Memory>,
    /// The KL the allocation predicted (mixes only).
    pub predicted_kl: Option<f64>,
    pub quality: Vec<Rung>,
    pub speed: Option<SpeedPoint>,
    /// Seconds building it from the base takes (the encoders' time for its formats).
    pub build_seconds: f64,
    /// Why the funnel stopped evaluating it.
    pub dropped: Option<String>,
    pub pareto: bool,
    /// Whether it meets every target (`None`: not every target measured).
    pub feasible: Option<bool>,
}

impl Point {
    /// A point not measured yet: its recipe, its size (`bytes` of weights over `params`), what
    /// building it costs, and why it cannot run (if it cannot be built).
    pub fn unmeasured(
        key: String,
        recipe: Recipe,
        (bytes, params): (u64, u64),
        build_seconds: f64,
        predicted_kl: Option<f64>,
        dropped: Option<String>,
    ) -> Point {
        Point {
            key,
            recipe,
            bpw: bytes as f64 * 8.0 / params.max(1) as f64,
            weight_bytes: bytes,
            memory: None,
            predicted_kl,
            quality: Vec::new(),
            speed: None,
            build_seconds,
            dropped,
            pareto: false,
            feasible: None,
        }
    }

    /// Quality at its latest rung.
    pub fn latest(&self) -> Option<&Quality> {
        self.quality.last().map(|r| &r.quality)
    }

    /// What targets read of it.
    pub fn measured(&self) -> Measured {
        let q = self.latest();
        let s = self.speed;
        Measured {
            kl: q.map(|q| q.kl_mean),
            p99kl: q.map(|q| q.kl_p99),
            ppl: q.map(|q| q.ppl),
            ppl_change: q.map(|q| q.ppl_change()),
            top1: q.map(|q| q.top1),
            memory: self.memory.map(|m| m.total() as f64),
            decode: s.map(|s| s.decode),
            decode_ratio: s.map(|s| s.decode_ratio),
            prefill: s.map(|s| s.prefill),
            prefill_ratio: s.map(|s| s.prefill_ratio),
        }
    }
}

/// A group's measured sensitivity: KL on the calibration text with only this group at the
/// probe format (the rest at the widest).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sensitivity {
    pub group: String,
    pub probe: String,
    pub kl: f64,
    pub kl_stderr: f64,
}

/// `frontier.json`: the search's whole state, rewritten after every evaluation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct State {
    pub frugal_version: String,
    pub config: Config,
    pub base: BaseId,
    pub refused: Vec<String>,
    /// Each cut timed against its dense twin, and whether it was taken.
    #[serde(default)]
    pub gates: Vec<prune::Gate>,
    /// Each drafter timed with the chosen point, and whether it was paired with it.
    #[serde(default)]
    pub speculation: Vec<speculate::Trial>,
    pub sensitivity: Vec<Sensitivity>,
    pub points: Vec<Point>,
    pub chosen: Option<String>,
    /// The constraints no point meets (when none meets every one), with the closest values.
    pub binding: Vec<String>,
    /// The points closest to meeting every target (when none does).
    pub closest: Vec<String>,
    pub warnings: Vec<String>,
    /// `running`, `done`, or why it stopped early (`budget`).
    pub status: String,
}

impl State {
    pub fn read(dir: &Path) -> Result<State> {
        let p = dir.join("frontier.json");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        write_atomic(
            &dir.join("frontier.json"),
            serde_json::to_string_pretty(self)?.as_bytes(),
        )
    }

    pub fn point(&self, key: &str) -> Option<&Point> {
        self.points.iter().find(|p| p.key == key)
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename: a reader (or a killed run)
/// sees the old file or the new one, never half of one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// Rebuilds a recipe's model into `out/model.gguf` (and copies the recipe there), refusing a
/// recipe from another base or version. `base` and `calibration` override the paths the
/// recipe names (the calibration text is read when a stage scores weights on it).
pub fn rebuild(
    recipe_path: &Path,
    base: Option<&Path>,
    calibration: Option<&Path>,
    out: &Path,
) -> Result<recipe::RecipeFile> {
    let r = recipe::RecipeFile::read(recipe_path)?;
    let base_path = base.map_or_else(|| PathBuf::from(&r.base.path), Path::to_path_buf);
    let id = BaseId::of(&base_path)?;
    r.check(&id)?;
    let file = frugal::gguf::GgufFile::open(&base_path)?;
    let draft_recipe = r.speculate.as_ref().and_then(|s| s.draft.as_ref());
    let cal = match (
        &r.calibration,
        r.recipe.needs_calibration_with(draft_recipe),
    ) {
        (Some(c), true) => c.load(calibration, &file)?,
        (None, true) => anyhow::bail!(
            "the recipe prunes but does not say which calibration text scored the cut"
        ),
        _ => prune::Calibration::default(),
    };
    let built = r.recipe.build(&file, &cal)?;
    let draft = r
        .speculate
        .as_ref()
        .and_then(|s| s.draft.as_ref())
        .map(|d| d.build(&file, &cal))
        .transpose()?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_atomic(&out.join("model.gguf"), built.raw_bytes())?;
    if let Some(d) = draft {
        write_atomic(&out.join(speculate::DRAFT_FILE), d.raw_bytes())?;
    }
    r.write(&out.join("recipe.toml"))?;
    Ok(r)
}
