//! The search: candidates from the ladder's stages, evaluated through a funnel that spends
//! its time where a point can still win.
//!
//! 1. The bank: the base encoded once in every allowed format.
//! 2. Sensitivity: each group alone at the probe format, KL on the calibration text; the
//!    allocation turns it into one mix per bits-per-weight budget of the sweep.
//! 3. Rung 0: every weight recipe (uniform formats and mixes), KL on the first tokens of the
//!    evaluation text; then the best weight recipes with other KV-cache formats and activation
//!    precisions.
//! 4. The pruning stage: each cut timed against its dense twin; the cuts this CPU rewards
//!    combined with the best weight recipes, before and after quantization, and measured at
//!    rung 0 with the rest.
//! 5. Each next rung (successive halving): the points that can still meet the quality and
//!    memory targets and are not dominated, at most half of them (by Pareto layers of KL,
//!    memory and weight bytes), on more tokens.
//! 6. Speed, back to back with the base, only for the contenders: points that meet the
//!    quality and memory targets and whose weights are within 15% of the smallest such
//!    point's (decode reads the weights; the rest cannot be the fastest).
//!
//! Every evaluation is keyed by its recipe and written to `frontier.json` at once, so a killed
//! run resumes where it stopped. The budget stops the search between evaluations and still
//! leaves a result.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use frugal::eval::EvalOptions;
use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvOptions, KvType};
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;

use super::prune::Calibration;
use super::quant::{self, Bank, Costs, Group, Mix};
use super::recipe::{BaseId, CalibrationId, Lever, Recipe, RecipeFile, Runtime, Stage, VERSION};
use super::target::{Metric, Target, Unit};
use super::{Config, Point, Rung, Sensitivity, SpeedPoint, State};
use crate::timing::{self, SpeedTest};
use crate::{quality, size};

mod attention_stage;
mod distill_stage;
mod finish;
mod funnel;
mod sensitivity;
mod speculate_stage;
mod structural_stage;
mod variants;

use funnel::{act_slow, dominates, quality_ok};

/// Calibration tokens kept for the stages that read them (distillation trains on them).
const MAX_CALIBRATION: usize = 1 << 16;

/// What the search tells its caller as it goes.
#[derive(Clone, Debug)]
pub enum Progress {
    /// Before the first evaluation: the space and the time it should take.
    Plan {
        weight_recipes: usize,
        runtimes: usize,
        /// Evaluations the funnel should make (KL and speed).
        evaluations: usize,
        estimated_seconds: f64,
        budget_seconds: f64,
    },
    /// A step done, in words.
    Step(String),
}

/// What a search returns.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub state: State,
    /// Evaluations made by this run (those found in a resumed state are not counted).
    pub evaluations: usize,
}

/// Runs (or, with `resume`, continues) a search writing into `dir`.
pub fn run(
    config: Config,
    dir: &Path,
    resume: Option<State>,
    progress: &mut dyn FnMut(Progress),
) -> Result<Outcome> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let base_id = BaseId::of(&config.model)?;
    let state = match resume {
        Some(s) => {
            ensure!(
                s.base.sha256 == base_id.sha256,
                "{} changed since the search began (its hash differs): start a new search",
                config.model.display()
            );
            ensure!(
                s.frugal_version == VERSION,
                "the search was begun by frugal {}, this is {VERSION}: start a new search",
                s.frugal_version
            );
            s
        }
        None => State {
            frugal_version: VERSION.to_string(),
            config: config.clone(),
            base: base_id,
            refused: Vec::new(),
            gates: Vec::new(),
            speculation: Vec::new(),
            sensitivity: Vec::new(),
            points: Vec::new(),
            chosen: None,
            binding: Vec::new(),
            closest: Vec::new(),
            warnings: Vec::new(),
            status: "running".to_string(),
        },
    };
    let base_file = GgufFile::open(&config.model)?;
    let base = crate::build::load_file(GgufFile::open(&config.model)?, false)?;
    let tok = Tokenizer::from_gguf(&base.file)?;
    let read = |p: &Path| -> Result<Vec<u32>> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        Ok(tok.encode(&text, false)?)
    };
    let f = &config.funnel;
    let mut calib = read(&config.calibration)?;
    let cal = Calibration {
        tokens: calib[..calib.len().min(MAX_CALIBRATION)].to_vec(),
        ctx: f.ctx,
        cut_tokens: f.prune_tokens,
    };
    let mut eval = read(&config.eval)?;
    ensure!(
        calib.len() >= f.ctx,
        "{} has {} tokens, fewer than one window of {}",
        config.calibration.display(),
        calib.len(),
        f.ctx
    );
    ensure!(
        eval.len() >= f.ctx,
        "{} has {} tokens, fewer than one window of {}",
        config.eval.display(),
        eval.len(),
        f.ctx
    );
    // Read now, so that a bad prompts file fails before the search rather than after it.
    let prompts = if config.levers.contains(&Lever::Speculate) {
        super::speculate::prompts(
            config.prompts.as_deref(),
            &tok,
            &eval,
            base.config.n_ctx_train,
        )?
    } else {
        Vec::new()
    };
    calib.truncate(f.calibration_tokens.max(f.ctx));
    eval.truncate(f.rungs.iter().copied().max().unwrap_or(f.ctx));
    // A resumed search replays its decisions on the measurements it already has: each is
    // handed back (not measured again) when the replay reaches it, so that every decision sees
    // what it saw the first time.
    let mut state = state;
    let mut done = Done::default();
    for p in &mut state.points {
        for r in p.quality.drain(..) {
            done.quality.insert((p.key.clone(), r.tokens), r.quality);
        }
        if let Some(sp) = p.speed.take() {
            done.speed.insert(p.key.clone(), sp);
        }
        if !p
            .dropped
            .as_deref()
            .is_some_and(|d| d.starts_with("cannot run"))
        {
            p.dropped = None;
        }
    }
    let mut s = Search {
        done,
        index: state
            .points
            .iter()
            .enumerate()
            .map(|(i, p)| (p.key.clone(), i))
            .collect(),
        state,
        cfg: config,
        dir,
        base_file,
        base,
        calib,
        cal,
        eval,
        prompts,
        bank: Bank::new(),
        mixes: HashMap::new(),
        stage_mixes: HashMap::new(),
        structural: HashMap::new(),
        start: Instant::now(),
        evaluations: 0,
        stopped: None,
        cut: false,
        progress,
    };
    s.search()?;
    s.finish()?;
    Ok(Outcome {
        evaluations: s.evaluations,
        state: s.state,
    })
}

/// Measurements a resumed search found on disk.
#[derive(Default)]
struct Done {
    quality: HashMap<(String, usize), crate::quality::Quality>,
    speed: HashMap<String, SpeedPoint>,
}

struct Search<'a> {
    done: Done,
    cfg: Config,
    dir: &'a Path,
    state: State,
    index: HashMap<String, usize>,
    base_file: GgufFile,
    base: Model,
    calib: Vec<u32>,
    /// What the cuts score weights on.
    cal: Calibration,
    eval: Vec<u32>,
    /// What speculative decoding is timed on.
    prompts: Vec<Vec<u32>>,
    bank: Bank,
    /// The weights of each quantization-only key's recipe.
    mixes: HashMap<String, Mix>,
    /// The mix of each quantization stage seen (by its text), for recipes that start with it.
    stage_mixes: HashMap<String, Mix>,
    /// The base with its leading structural stages applied (cuts, distillation), by their
    /// text.
    structural: HashMap<String, GgufFile>,
    start: Instant,
    evaluations: usize,
    stopped: Option<String>,
    /// The KL funnel was cut short to leave the budget's last fifth to timing.
    cut: bool,
    progress: &'a mut dyn FnMut(Progress),
}

fn runtime_options(r: &Runtime) -> EvalOptions {
    EvalOptions {
        kv: KvOptions {
            format: KvFormat::both(r.kv),
            ..Default::default()
        },
        ..Default::default()
    }
}

impl Search<'_> {
    fn say(&mut self, s: String) {
        (self.progress)(Progress::Step(s));
    }

    /// Whether to stop before the next evaluation: the budget spent, the evaluation limit
    /// reached, or (KL evaluations, when speeds are still to be measured) less than a fifth of
    /// the budget left, which the timing keeps.
    fn out_of_time(&mut self) -> bool {
        self.out_of_time_keeping(0.0)
    }

    fn out_of_time_keeping(&mut self, reserve: f64) -> bool {
        if self.stopped.is_some() {
            return true;
        }
        let left = self.cfg.budget_seconds - self.start.elapsed().as_secs_f64();
        if left <= 0.0 {
            self.stopped = Some("budget".to_string());
        } else if self
            .cfg
            .funnel
            .max_evaluations
            .is_some_and(|m| self.evaluations >= m)
        {
            self.stopped = Some("evaluation limit".to_string());
        } else if left < reserve {
            if !self.cut {
                self.cut = true;
                let msg = format!(
                    "KL funnel stopped with {:.0} s left: the rest of the budget times the contenders",
                    left
                );
                self.say(msg);
            }
            return true;
        }
        self.stopped.is_some()
    }

    /// What the KL evaluations leave for timing.
    fn speed_reserve(&self) -> f64 {
        if self.needs_speed() {
            0.2 * self.cfg.budget_seconds
        } else {
            0.0
        }
    }

    /// Writes `frontier.json`, the measurements a resumed search has not replayed yet
    /// included (a run killed during the replay loses nothing).
    fn save(&self) -> Result<()> {
        if self.done.quality.is_empty() && self.done.speed.is_empty() {
            return self.state.write(self.dir);
        }
        let mut state = self.state.clone();
        merge(&mut state, &self.done, &self.index);
        state.write(self.dir)
    }

    fn point_mut(&mut self, key: &str) -> &mut Point {
        &mut self.state.points[self.index[key]]
    }

    fn levers(&self, l: Lever) -> bool {
        self.cfg.levers.contains(&l)
    }

    fn search(&mut self) -> Result<()> {
        // The formats this base can take.
        let formats = quant::formats_for(&self.base_file);
        self.state.refused = formats
            .refused
            .iter()
            .map(|r| format!("quant {r}"))
            .collect();
        if !self.levers(Lever::Quant) {
            self.state
                .refused
                .push("quant: not in --levers (weights stay as they are)".to_string());
        }
        let allowed: Vec<GgmlType> = if self.levers(Lever::Quant) {
            formats.allowed.clone()
        } else {
            Vec::new()
        };
        let palette: Vec<GgmlType> = allowed
            .iter()
            .copied()
            .filter(|t| !matches!(t, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32))
            .collect();
        let groups = quant::groups(&self.base_file, self.cfg.funnel.bands);

        // The plan, on the first format's encoding time and one window of the base.
        let t0 = Instant::now();
        if let Some(&first) = palette.first().or(allowed.first()) {
            self.bank.add(&self.base_file, first)?;
        }
        let build_s = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let ctx = self.cfg.funnel.ctx;
        quality::against(&self.base, &self.base, &self.calib[..ctx], ctx)?;
        let per_token = t0.elapsed().as_secs_f64() / (2 * ctx) as f64 * 1.6;
        self.plan(
            allowed.len(),
            palette.len(),
            groups.len(),
            build_s,
            per_token,
        );

        for &t in &allowed {
            self.bank.add(&self.base_file, t)?;
        }
        self.say(format!("encoded the base in {} formats", allowed.len()));

        // Uniform formats (and the base as it is, without the quant lever).
        let mut weights: Vec<(Mix, Option<f64>)> =
            allowed.iter().map(|&t| (Mix::uniform(t), None)).collect();
        // Mixes, by measured sensitivity under the budget sweep.
        if palette.len() >= 2 && !self.out_of_time() {
            weights.extend(self.mixes_by_sensitivity(&palette, &groups)?);
        }
        let mut keys = Vec::new();
        let mut seen: Vec<Vec<GgmlType>> = Vec::new();
        for (mix, predicted) in weights {
            let types = self.effective_types(&mix);
            if seen.contains(&types) {
                continue;
            }
            seen.push(types);
            let recipe = Recipe {
                stages: vec![mix.stage(&self.base_file)],
                runtime: Runtime::default(),
            };
            keys.push(self.add_point(recipe, mix, predicted));
        }
        if allowed.is_empty() {
            let recipe = Recipe {
                stages: Vec::new(),
                runtime: Runtime::default(),
            };
            let mix = Mix::uniform(formats.base.unwrap_or(GgmlType::F32));
            keys.push(self.add_point(recipe, mix, None));
        }
        self.save()?;

        // Rung 0 for the weights, then their best with other runtime settings.
        let rungs = self.cfg.funnel.rungs.clone();
        for k in &keys {
            self.quality(k, rungs[0])?;
        }
        self.drop_losers(&keys);
        let mut variants = self.runtime_variants(&keys);
        variants.extend(self.imatrix_variants(&keys)?);
        for k in &variants {
            self.quality(k, rungs[0])?;
        }
        keys.extend(variants);
        self.drop_losers(&keys);
        let cuts = self.structural_stage(&keys)?;
        let layouts = self.attention_stage(&keys)?;
        keys.extend(cuts);
        keys.extend(layouts);
        self.drop_losers(&keys);
        self.save()?;

        // Successive halving.
        let mut active: Vec<String> = self.alive(&keys);
        for &tokens in &rungs[1..] {
            active = self.halve(active);
            for k in &active {
                self.quality(k, tokens)?;
            }
            self.drop_losers(&active);
            active = self.alive(&active);
            self.save()?;
        }

        // Speed for the contenders.
        if self.needs_speed() {
            let contenders = self.contenders(&active);
            for k in &contenders {
                self.speed(k)?;
            }
            self.measure_closest_if_short(&active)?;
        }
        self.distill_stage()?;
        Ok(())
    }

    fn plan(&mut self, formats: usize, palette: usize, groups: usize, build_s: f64, tok_s: f64) {
        let f = self.cfg.funnel.clone();
        let mixes = if palette >= 2 {
            let (lo, hi) = (2.5f64, 9.0f64);
            ((hi - lo) / f.bpw_step).ceil() as usize
        } else {
            0
        };
        let weights = formats.max(1) + mixes;
        let kv = if self.levers(Lever::Kv) { 2 } else { 0 };
        let act = if self.levers(Lever::Quant) { 2 } else { 0 };
        let runtimes = 1 + kv + act;
        let variants = f.runtime_variants.min(weights) * (kv + act);
        let mut evals = groups + 1 + weights + variants;
        let mut seconds = formats as f64 * build_s
            + (groups + 1) as f64 * f.calibration_tokens as f64 * tok_s
            + (weights + variants) as f64 * f.rungs[0] as f64 * tok_s;
        let mut n = weights + variants;
        for &r in &f.rungs[1..] {
            n = n.div_ceil(2).max(3).min(n);
            evals += n;
            seconds += n as f64 * r as f64 * tok_s;
        }
        // A decode step costs about ten tokens of a batched pass.
        let timing = f.rounds as f64 * f.gen_tokens as f64 * 10.0 * tok_s * 2.0;
        if self.levers(Lever::Prune) {
            // Each cut: scored on the calibration, built in two formats and timed against its
            // twin; half of them taken, each then built and measured in both orders.
            let cuts = super::prune::trials(&self.base.config, self.float_base()).len();
            let per_cut = f.prune_tokens as f64 * tok_s + 4.0 * build_s + timing;
            let taken = cuts.div_ceil(2) * (2 + 2 * f.structural_variants);
            evals += cuts + taken;
            seconds +=
                cuts as f64 * per_cut + taken as f64 * (2.0 * build_s + f.rungs[0] as f64 * tok_s);
        }
        if self.needs_speed() {
            // About three contenders, each timed with the base per round.
            let per =
                f.rounds as f64 * (f.gen_tokens as f64 * 10.0 + f.prompt as f64) * tok_s * 1.5;
            evals += 3;
            seconds += 3.0 * per;
        }
        (self.progress)(Progress::Plan {
            weight_recipes: weights,
            runtimes,
            evaluations: evals,
            estimated_seconds: seconds,
            budget_seconds: self.cfg.budget_seconds,
        });
    }

    /// The storage type of every tensor in `mix` (fallbacks applied): two mixes with the same
    /// types are the same file.
    fn effective_types(&self, mix: &Mix) -> Vec<GgmlType> {
        self.base_file
            .tensors()
            .iter()
            .map(|t| {
                if !quant::quantizable(&t.name, &t.dims) {
                    return t.ty;
                }
                let f = mix.format_of(&t.name);
                self.bank
                    .get(f)
                    .and_then(|b| b.tensor(&t.name).ok())
                    .map_or(f, |(i, _)| i.ty)
            })
            .collect()
    }

    fn add_point(&mut self, recipe: Recipe, mix: Mix, predicted_kl: Option<f64>) -> String {
        let key = recipe.key();
        let (mut bytes, mut params) = (0u64, 0u64);
        let mut secs = 0.0;
        let total: u64 = self
            .base_file
            .tensors()
            .iter()
            .map(|t| t.n_elements())
            .sum();
        for t in self.base_file.tensors() {
            params += t.n_elements();
            if quant::quantizable(&t.name, &t.dims) && !recipe.stages.is_empty() {
                let f = mix.format_of(&t.name);
                bytes += self.bank.tensor_bytes(&t.name, f);
                secs += self.bank.seconds(f) * t.n_elements() as f64 / total as f64;
            } else {
                bytes += t.n_bytes();
            }
        }
        if let Some(st) = recipe.stages.first() {
            self.stage_mixes.insert(st.to_string(), mix.clone());
        }
        self.mixes.insert(key.clone(), mix);
        if !self.index.contains_key(&key) {
            self.index.insert(key.clone(), self.state.points.len());
            self.state.points.push(Point::unmeasured(
                key.clone(),
                recipe,
                (bytes, params),
                secs,
                predicted_kl,
                None,
            ));
        }
        key
    }

    /// The file of a key's recipe: the bank's assembly for quantization alone, the stages
    /// (their structural prefix cached) otherwise. `--recipe` rebuilds through
    /// [`Recipe::build`], and a test holds the two to the same bytes.
    fn built_file(&mut self, key: &str) -> Result<GgufFile> {
        let p = &self.state.points[self.index[key]];
        if p.recipe.stages.is_empty() {
            Ok(GgufFile::from_bytes(self.base_file.raw_bytes().to_vec())?)
        } else if p.recipe.quant_only() {
            Ok(GgufFile::from_bytes(self.bank.assemble(&self.mixes[key])?)?)
        } else {
            let stages = p.recipe.stages.clone();
            self.build_stages(&stages)
        }
    }

    /// The model of a key's recipe, set up to run as the recipe says.
    fn model(&mut self, key: &str) -> Result<Model> {
        let activations = self.state.points[self.index[key]]
            .recipe
            .runtime
            .activations;
        let file = self.built_file(key)?;
        let mut m = crate::build::load_file(file, false)?;
        m.set_activations(activations);
        Ok(m)
    }

    /// KL of `key` on the first `tokens` evaluation tokens, unless measured (or out of time).
    fn quality(&mut self, key: &str, tokens: usize) -> Result<()> {
        let p = &self.state.points[self.index[key]];
        if p.dropped.is_some() || p.quality.iter().any(|r| r.tokens == tokens) {
            return Ok(());
        }
        let runtime = p.recipe.runtime;
        if let Some(q) = self.done.quality.remove(&(key.to_string(), tokens)) {
            self.point_mut(key)
                .quality
                .push(Rung { tokens, quality: q });
            return Ok(());
        }
        if self.out_of_time_keeping(self.speed_reserve()) {
            return Ok(());
        }
        let opts = runtime_options(&runtime);
        let t0 = Instant::now();
        let m = self.model(key)?;
        let ctx = self.cfg.funnel.ctx;
        let n = tokens.min(self.eval.len()) / ctx * ctx;
        let q = match quality::against_with(
            (&m, &opts),
            (&self.base, &EvalOptions::default()),
            &self.eval[..n],
            ctx,
        ) {
            Ok(q) => q,
            Err(e) => {
                // A setting this model cannot take (a Q8_0 cache on heads not a multiple of
                // 32 wide): skipped with the reason.
                self.point_mut(key).dropped = Some(format!("cannot run: {e:#}"));
                self.save()?;
                return Ok(());
            }
        };
        let memory = size::Memory::at(&m, self.cfg.context, KvFormat::both(runtime.kv))?;
        self.evaluations += 1;
        let p = self.point_mut(key);
        p.quality.push(Rung { tokens, quality: q });
        p.memory = Some(memory);
        let line = format!(
            "KL {:.5} ± {:.5} on {} tokens  {:.2} bpw  {:.1} s  {key}",
            q.kl_mean,
            q.kl_stderr,
            n,
            p.bpw,
            t0.elapsed().as_secs_f64()
        );
        self.save()?;
        self.say(line);
        Ok(())
    }

    /// Up to `n` of `keys`' first Pareto layer: those meeting the quality targets first, then
    /// the smallest.
    fn front(&self, keys: &[String], n: usize) -> Vec<String> {
        let alive = self.alive(keys);
        let pts: Vec<&Point> = alive
            .iter()
            .map(|k| &self.state.points[self.index[k]])
            .collect();
        let mut front: Vec<&Point> = pts
            .iter()
            .copied()
            .filter(|p| !pts.iter().any(|q| dominates(q, p)))
            .collect();
        let targets = &self.cfg.targets;
        front.sort_by_key(|p| (!quality_ok(targets, p), p.weight_bytes));
        front.iter().take(n).map(|p| p.key.clone()).collect()
    }

    /// Whether some measured point meets every target.
    fn meets_all(&self) -> bool {
        self.state.points.iter().any(|p| {
            let m = p.measured();
            self.cfg.targets.iter().all(|t| t.met(&m) == Some(true))
        })
    }

    /// When no measured point meets the speed targets, times up to three smaller points that
    /// miss a quality target, so that the report can say which constraint binds.
    fn measure_closest_if_short(&mut self, active: &[String]) -> Result<()> {
        if self.meets_all() {
            return Ok(());
        }
        let min_ok = self
            .contenders(active)
            .iter()
            .map(|k| self.state.points[self.index[k]].weight_bytes)
            .min()
            .unwrap_or(u64::MAX);
        let mut smaller: Vec<&Point> = self
            .state
            .points
            .iter()
            .filter(|p| p.latest().is_some() && p.speed.is_none() && p.weight_bytes < min_ok)
            .filter(|p| act_slow(p) == 0)
            .collect();
        smaller.sort_by(|a, b| self.shortfall(a).total_cmp(&self.shortfall(b)));
        let keys: Vec<String> = smaller.iter().take(3).map(|p| p.key.clone()).collect();
        for k in keys {
            self.speed(&k)?;
        }
        Ok(())
    }

    /// Times `key` back to back with the base, unless measured (or out of time).
    fn speed(&mut self, key: &str) -> Result<()> {
        if let Some(sp) = self.done.speed.remove(key) {
            self.point_mut(key).speed = Some(sp);
            return Ok(());
        }
        if self.state.points[self.index[key]].speed.is_some() || self.out_of_time() {
            return Ok(());
        }
        let m = self.model(key)?;
        let opts = runtime_options(&self.state.points[self.index[key]].recipe.runtime);
        let test = self.speed_test();
        let base = &self.base;
        let r = timing::back_to_back(
            1,
            self.cfg.funnel.rounds,
            |_| Some(1),
            |s| {
                if s == 0 {
                    test.measure_with(&m, &opts)
                } else {
                    test.measure(base)
                }
            },
            |_| {},
        )?;
        let (c, b) = (r.candidates[0], r.baseline(1));
        self.evaluations += 1;
        let sp = SpeedPoint {
            decode: c.speed.decode,
            prefill: c.speed.prefill,
            decode_ratio: c.vs_base.decode,
            prefill_ratio: c.vs_base.prefill,
            base_decode: b.decode,
            base_prefill: b.prefill,
        };
        self.point_mut(key).speed = Some(sp);
        self.save()?;
        self.say(format!(
            "decode {:.1} tok/s, {:.2}x the base ({:.1} tok/s)  {key}",
            sp.decode, sp.decode_ratio, sp.base_decode
        ));
        Ok(())
    }
}

/// Puts measurements not replayed back into their points.
fn merge(state: &mut State, done: &Done, index: &HashMap<String, usize>) {
    for ((key, tokens), q) in &done.quality {
        if let Some(&i) = index.get(key) {
            let p = &mut state.points[i];
            p.quality.push(Rung {
                tokens: *tokens,
                quality: *q,
            });
            p.quality.sort_by_key(|r| r.tokens);
        }
    }
    for (key, sp) in &done.speed {
        if let Some(&i) = index.get(key) {
            state.points[i].speed = Some(*sp);
        }
    }
}

fn p_pred(state: &State, key: &str) -> Option<f64> {
    state.point(key).and_then(|p| p.predicted_kl)
}

/// A target's figure as its bound is written.
pub fn fmt_value(t: &Target, v: f64) -> String {
    match (t.metric, t.unit) {
        (_, Unit::Ratio) => format!("{v:.2}x"),
        (_, Unit::TokPerSec) => format!("{v:.1} tok/s"),
        (_, Unit::Change) => format!("{:+.2}%", v * 100.0),
        (Metric::Memory, _) => format!("{:.1} MiB", v / 1048576.0),
        (Metric::Top1, _) => format!("{:.2}%", v * 100.0),
        _ => format!("{v:.5}"),
    }
}

/// Each target as written, with the figure `m` reads for it (`-` when not measured).
pub fn readings(targets: &[Target], m: &super::target::Measured) -> Vec<(String, String)> {
    targets
        .iter()
        .map(|t| {
            let v = t
                .read(m)
                .map_or_else(|| "-".to_string(), |v| fmt_value(t, v));
            (t.to_string(), v)
        })
        .collect()
}

/// Checks a config before a search starts: targets and levers present, the funnel sane.
pub fn check(config: &Config) -> Result<()> {
    ensure!(
        !config.targets.is_empty(),
        "give at least one --target (e.g. --target 'decode >= 5x' --target 'kl <= 0.05')"
    );
    ensure!(
        !config.funnel.rungs.is_empty() && config.funnel.ctx >= 4,
        "the funnel needs at least one rung and a window of 4 tokens"
    );
    ensure!(!config.levers.is_empty(), "--levers names no lever");
    Ok(())
}
