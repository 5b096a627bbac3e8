//! The search: candidates from the ladder's stages, evaluated through a funnel that spends
//! its time where a point can still win.
//!
//! 1. The bank: the base encoded once in every allowed format.
//! 2. Sensitivity: each group alone at the probe format, KL on the calibration text; the
//!    allocation turns it into one mix per bits-per-weight budget of the sweep.
//! 3. Rung 0: every weight recipe (uniform formats and mixes), KL on the first tokens of the
//!    evaluation text; then the best weight recipes with other KV-cache formats and activation
//!    precisions.
//! 4. Each next rung (successive halving): the points that can still meet the quality and
//!    memory targets and are not dominated, at most half of them (by Pareto layers of KL,
//!    memory and weight bytes), on more tokens.
//! 5. Speed, back to back with the base, only for the contenders: points that meet the
//!    quality and memory targets and whose weights are within 15% of the smallest such
//!    point's (decode reads the weights; the rest cannot be the fastest).
//!
//! Every evaluation is keyed by its recipe and written to `frontier.json` at once, so a killed
//! run resumes where it stopped. The budget stops the search between evaluations and still
//! leaves a result.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use frugal::eval::EvalOptions;
use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvOptions, KvType};
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;

use super::quant::{self, Bank, Costs, Group, Mix};
use super::recipe::{BaseId, Lever, Recipe, RecipeFile, Runtime, VERSION};
use super::target::{Metric, Target, Unit};
use super::{Config, Point, Rung, Sensitivity, SpeedPoint, State};
use crate::timing::{self, SpeedTest};
use crate::{quality, size};

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
        eval,
        bank: Bank::new(),
        mixes: HashMap::new(),
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
    eval: Vec<u32>,
    bank: Bank,
    /// The weights of each key's recipe.
    mixes: HashMap<String, Mix>,
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

/// Whether `p` is sure to miss a quality or memory target, the measurement's noise allowed for.
fn surely_fails(t: &Target, p: &Point) -> bool {
    let Some(q) = p.latest() else {
        return false;
    };
    let n = q.positions.max(1) as f64;
    match t.metric {
        Metric::Kl => q.kl_mean - 2.0 * q.kl_stderr > t.value,
        Metric::P99Kl => q.kl_p99 > 1.25 * t.value,
        Metric::Ppl => {
            let margin = 2.0 * q.ppl_stderr / q.base_ppl;
            match t.unit {
                Unit::Change => q.ppl_change() - margin > t.value,
                _ => q.ppl - 2.0 * q.ppl_stderr > t.value,
            }
        }
        Metric::Top1 => q.top1 + 2.0 * (q.top1 * (1.0 - q.top1) / n).sqrt() < t.value,
        Metric::Memory => p.memory.is_some_and(|m| m.total() as f64 > t.value),
        Metric::Decode | Metric::Prefill => false,
    }
}

/// Whether `p` meets every quality and memory target at its point estimates.
fn quality_ok(targets: &[Target], p: &Point) -> bool {
    let m = p.measured();
    targets
        .iter()
        .filter(|t| !t.metric.is_speed())
        .all(|t| t.met(&m) == Some(true))
}

fn act_slow(p: &Point) -> u8 {
    u8::from(p.recipe.runtime.activations == Activations::F32)
}

fn mem(p: &Point) -> u64 {
    p.memory.map_or(u64::MAX, |m| m.total())
}

/// Plain Pareto dominance on (KL, memory, weight bytes, f32 activations).
fn dominates(a: &Point, b: &Point) -> bool {
    let (Some(qa), Some(qb)) = (a.latest(), b.latest()) else {
        return false;
    };
    let le = qa.kl_mean <= qb.kl_mean
        && mem(a) <= mem(b)
        && a.weight_bytes <= b.weight_bytes
        && act_slow(a) <= act_slow(b);
    let lt = qa.kl_mean < qb.kl_mean
        || mem(a) < mem(b)
        || a.weight_bytes < b.weight_bytes
        || act_slow(a) < act_slow(b);
    le && lt
}

/// Dominance the funnel drops by: `a` costs no more than `b` anywhere and less somewhere, and
/// `b`'s KL is not better than `a`'s by more than the noise of their difference (unless that
/// difference decides a quality target).
fn dominates_within_noise(targets: &[Target], a: &Point, b: &Point) -> bool {
    let (Some(qa), Some(qb)) = (a.latest(), b.latest()) else {
        return false;
    };
    let noise = (qa.kl_stderr.powi(2) + qb.kl_stderr.powi(2)).sqrt();
    let costs_le =
        mem(a) <= mem(b) && a.weight_bytes <= b.weight_bytes && act_slow(a) <= act_slow(b);
    let costs_lt = mem(a) < mem(b) || a.weight_bytes < b.weight_bytes || act_slow(a) < act_slow(b);
    let kl_ok = qa.kl_mean <= qb.kl_mean + noise;
    let targets_ok = quality_ok(targets, a) || !quality_ok(targets, b);
    costs_le && kl_ok && targets_ok && (costs_lt || qa.kl_mean < qb.kl_mean - noise)
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
        let variants = self.runtime_variants(&keys);
        for k in &variants {
            self.quality(k, rungs[0])?;
        }
        keys.extend(variants);
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
        if self.needs_speed() {
            // About three contenders, each timed with the base per round; a decode step costs
            // about ten tokens of a batched pass.
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
        self.mixes.insert(key.clone(), mix);
        if !self.index.contains_key(&key) {
            self.index.insert(key.clone(), self.state.points.len());
            self.state.points.push(Point {
                key: key.clone(),
                recipe,
                bpw: bytes as f64 * 8.0 / params.max(1) as f64,
                weight_bytes: bytes,
                memory: None,
                predicted_kl,
                quality: Vec::new(),
                speed: None,
                build_seconds: secs,
                dropped: None,
                pareto: false,
                feasible: None,
            });
        }
        key
    }

    /// The model of a key's recipe, set up to run as the recipe says.
    fn model(&self, key: &str) -> Result<Model> {
        let p = &self.state.points[self.index[key]];
        let bytes = if p.recipe.stages.is_empty() {
            self.base_file.raw_bytes().to_vec()
        } else {
            self.bank.assemble(&self.mixes[key])?
        };
        let mut m = crate::build::load(bytes, false)?;
        m.set_activations(p.recipe.runtime.activations);
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

    /// Sensitivity of each group, and the mixes it allocates under the budget sweep.
    fn mixes_by_sensitivity(
        &mut self,
        palette: &[GgmlType],
        groups: &[Group],
    ) -> Result<Vec<(Mix, Option<f64>)>> {
        let hi = palette[0];
        let probe = if palette.contains(&GgmlType::Q4_K) {
            GgmlType::Q4_K
        } else {
            palette[palette.len() / 2]
        };
        let probe_i = palette.iter().position(|&t| t == probe).unwrap_or(0);
        let reference = self.sensitivity("(none)", &Mix::uniform(hi), probe)?;
        let mut sens = Vec::new();
        for g in groups {
            let mut mix = Mix::uniform(hi);
            for t in &g.tensors {
                mix.per_tensor.insert(t.clone(), probe);
            }
            let Some(kl) = self.sensitivity(&g.name, &mix, probe)? else {
                return Ok(Vec::new());
            };
            sens.push((kl - reference.unwrap_or(0.0)).max(0.0));
        }
        let mut noise = Vec::new();
        for &t in palette {
            noise.push(quant::group_noise(&self.base_file, &self.bank, groups, t)?);
        }
        let bits = quant::group_bits(&self.bank, groups, palette);
        let costs = Costs::new(palette.to_vec(), bits, &sens, &noise, probe_i);
        let params: u64 = groups.iter().map(|g| g.params).sum();
        let (lo, hi_bpw) = (
            costs
                .bits
                .iter()
                .map(|b| b.iter().copied().fold(f64::MAX, f64::min))
                .sum::<f64>(),
            costs
                .bits
                .iter()
                .map(|b| b.iter().copied().fold(0.0, f64::max))
                .sum::<f64>(),
        );
        let step = self.cfg.funnel.bpw_step;
        let mut out = Vec::new();
        let mut bpw = (lo / params as f64 / step).ceil() * step;
        while bpw * params as f64 <= hi_bpw {
            if let Some(choice) = quant::allocate(&costs, bpw * params as f64) {
                let formats: Vec<GgmlType> = choice.iter().map(|&i| palette[i]).collect();
                let predicted = reference.unwrap_or(0.0) + costs.kl_of(&choice);
                out.push((Mix::from_groups(groups, &formats), Some(predicted)));
            }
            bpw += step;
        }
        self.say(format!(
            "sensitivity of {} groups at {}: {} mixes from {:.2} to {:.2} bits per weight",
            groups.len(),
            quant::type_name(probe),
            out.len(),
            lo / params as f64,
            hi_bpw / params as f64
        ));
        Ok(out)
    }

    /// KL on the calibration text of `mix` (cached in the state by group), `None` out of time.
    fn sensitivity(&mut self, group: &str, mix: &Mix, probe: GgmlType) -> Result<Option<f64>> {
        let probe = quant::type_name(probe);
        if let Some(s) = self
            .state
            .sensitivity
            .iter()
            .find(|s| s.group == group && s.probe == probe)
        {
            return Ok(Some(s.kl));
        }
        if self.out_of_time_keeping(self.speed_reserve()) {
            return Ok(None);
        }
        let mut m = crate::build::load(self.bank.assemble(mix)?, false)?;
        m.set_activations(Activations::Q8);
        let ctx = self.cfg.funnel.ctx;
        let n = self.calib.len() / ctx * ctx;
        let q = quality::against(&m, &self.base, &self.calib[..n], ctx)?;
        self.evaluations += 1;
        self.state.sensitivity.push(Sensitivity {
            group: group.to_string(),
            probe: probe.clone(),
            kl: q.kl_mean,
            kl_stderr: q.kl_stderr,
        });
        self.save()?;
        self.say(format!(
            "sensitivity {group} at {probe}: KL {:.5} ± {:.5}",
            q.kl_mean, q.kl_stderr
        ));
        Ok(Some(q.kl_mean))
    }

    /// The best weight recipes (first Pareto layer, those meeting the quality targets first)
    /// with one runtime setting changed: KV-cache f16 and q8_0 (`kv`), activations q8-full and
    /// f32 (`quant`).
    fn runtime_variants(&mut self, keys: &[String]) -> Vec<String> {
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
        let base_keys: Vec<String> = front
            .iter()
            .take(self.cfg.funnel.runtime_variants)
            .map(|p| p.key.clone())
            .collect();
        let mut runtimes = Vec::new();
        if self.levers(Lever::Kv) {
            for kv in [KvType::F16, KvType::Q8_0] {
                runtimes.push(Runtime {
                    kv,
                    ..Runtime::default()
                });
            }
        }
        if self.levers(Lever::Quant) {
            for activations in [Activations::Q8Full, Activations::F32] {
                runtimes.push(Runtime {
                    activations,
                    ..Runtime::default()
                });
            }
        }
        let mut out = Vec::new();
        for k in base_keys {
            let p = &self.state.points[self.index[&k]];
            let recipe = p.recipe.clone();
            let float = p.recipe.stages.iter().all(|s| match s {
                super::recipe::Stage::Quant { format, .. } => {
                    matches!(format.as_str(), "f16" | "bf16" | "f32")
                }
            });
            let mix = self.mixes[&k].clone();
            for &r in &runtimes {
                // Float weights always take f32 activations: nothing to vary.
                if float && r.activations != Activations::Q8 {
                    continue;
                }
                out.push(self.add_point(
                    recipe.with_runtime(r),
                    mix.clone(),
                    p_pred(&self.state, &k),
                ));
            }
        }
        out
    }

    fn alive(&self, keys: &[String]) -> Vec<String> {
        keys.iter()
            .filter(|k| {
                let p = &self.state.points[self.index[*k]];
                p.dropped.is_none() && !p.quality.is_empty()
            })
            .cloned()
            .collect()
    }

    /// Drops, among `keys`, the points sure to miss a quality or memory target and those
    /// dominated (within the noise).
    fn drop_losers(&mut self, keys: &[String]) {
        let alive = self.alive(keys);
        let targets = self.cfg.targets.clone();
        let mut drops: Vec<(String, String)> = Vec::new();
        for k in &alive {
            let p = &self.state.points[self.index[k]];
            if let Some(t) = targets.iter().find(|t| surely_fails(t, p)) {
                drops.push((k.clone(), format!("cannot meet {t}")));
                continue;
            }
            if let Some(a) = alive.iter().find(|a| {
                *a != k && dominates_within_noise(&targets, &self.state.points[self.index[*a]], p)
            }) {
                drops.push((k.clone(), format!("dominated by {a}")));
            }
        }
        // Never drop every point: keep the closest one.
        if drops.len() == alive.len()
            && let Some(best) = alive.iter().min_by(|a, b| {
                let s = |k: &String| self.shortfall(&self.state.points[self.index[k]]);
                s(a).total_cmp(&s(b))
            })
        {
            drops.retain(|(k, _)| k != best);
        }
        for (k, why) in drops {
            self.point_mut(&k).dropped = Some(why);
        }
    }

    /// The sum of relative shortfalls over the targets measured.
    fn shortfall(&self, p: &Point) -> f64 {
        let m = p.measured();
        self.cfg
            .targets
            .iter()
            .filter_map(|t| t.shortfall(&m))
            .sum()
    }

    /// At most half of `active` (at least 3), by Pareto layers; within a layer, those meeting
    /// the quality targets, then the smallest, first.
    fn halve(&mut self, active: Vec<String>) -> Vec<String> {
        let cap = active.len().div_ceil(2).max(3);
        if active.len() <= cap {
            return active;
        }
        let targets = self.cfg.targets.clone();
        let mut rest: Vec<String> = active.clone();
        let mut kept: Vec<String> = Vec::new();
        while kept.len() < cap && !rest.is_empty() {
            let pts = |k: &String| &self.state.points[self.index[k]];
            let mut layer: Vec<String> = rest
                .iter()
                .filter(|k| !rest.iter().any(|o| dominates(pts(o), pts(k))))
                .cloned()
                .collect();
            layer.sort_by_key(|k| (!quality_ok(&targets, pts(k)), pts(k).weight_bytes));
            rest.retain(|k| !layer.contains(k));
            kept.extend(layer.into_iter().take(cap - kept.len()));
        }
        for k in active.iter().filter(|k| !kept.contains(k)) {
            self.point_mut(k).dropped = Some("halved: behind the Pareto layers kept".to_string());
        }
        kept
    }

    fn needs_speed(&self) -> bool {
        self.cfg.objective.needs_speed() || self.cfg.targets.iter().any(|t| t.metric.is_speed())
    }

    fn speed_test(&self) -> SpeedTest {
        let f = &self.cfg.funnel;
        let prefill = self.cfg.targets.iter().any(|t| t.metric == Metric::Prefill)
            || self.cfg.objective == super::target::Objective::Prefill;
        SpeedTest {
            prompt: if prefill { f.prompt.max(1) } else { 0 },
            gen_tokens: f.gen_tokens,
            depth: 0,
            reps: 1,
        }
    }

    /// The points that can still be the fastest: meeting the quality and memory targets, with
    /// weights within 15% of the smallest such point's (8-bit activations before f32).
    fn contenders(&self, active: &[String]) -> Vec<String> {
        let targets = &self.cfg.targets;
        let mut ok: Vec<&Point> = active
            .iter()
            .map(|k| &self.state.points[self.index[k]])
            .filter(|p| quality_ok(targets, p))
            .collect();
        ok.sort_by_key(|p| (act_slow(p), p.weight_bytes));
        let Some(first) = ok.first() else {
            return Vec::new();
        };
        let limit = first.weight_bytes as f64 * 1.15;
        let slow = act_slow(first);
        ok.iter()
            .filter(|p| act_slow(p) == slow && p.weight_bytes as f64 <= limit)
            .map(|p| p.key.clone())
            .collect()
    }

    /// When no measured point meets the speed targets, times up to three smaller points that
    /// miss a quality target, so that the report can say which constraint binds.
    fn measure_closest_if_short(&mut self, active: &[String]) -> Result<()> {
        let meets_all = self.state.points.iter().any(|p| {
            let m = p.measured();
            self.cfg.targets.iter().all(|t| t.met(&m) == Some(true))
        });
        if meets_all {
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

    /// Marks the frontier and the feasible points, picks the best, says which constraint binds
    /// when none meets every target, and writes `frontier.json`, `recipe.toml` and
    /// `model.gguf`.
    fn finish(&mut self) -> Result<()> {
        let done = std::mem::take(&mut self.done);
        merge(&mut self.state, &done, &self.index);
        let targets = self.cfg.targets.clone();
        let pts = &self.state.points;
        let pareto: Vec<bool> = pts
            .iter()
            .map(|p| p.latest().is_some() && !pts.iter().any(|q| dominates(q, p)))
            .collect();
        for (p, par) in self.state.points.iter_mut().zip(pareto) {
            p.pareto = par;
            let m = p.measured();
            let met: Vec<Option<bool>> = targets.iter().map(|t| t.met(&m)).collect();
            p.feasible = if met.contains(&Some(false)) {
                Some(false)
            } else if met.contains(&None) || p.latest().is_none() {
                None
            } else {
                Some(true)
            };
        }
        let objective = self.cfg.objective;
        let chosen = self
            .state
            .points
            .iter()
            .filter(|p| p.feasible == Some(true))
            .filter_map(|p| objective.score(&p.measured()).map(|s| (p, s)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(p, _)| p.key.clone());
        self.state.chosen = chosen.clone();
        self.state.binding.clear();
        self.state.closest.clear();
        if chosen.is_none() {
            self.explain_infeasible();
        }
        self.noise_warnings();
        self.state.status = match (&self.stopped, self.cut) {
            (Some(s), _) => s.clone(),
            (None, true) => "done (KL funnel cut short by the budget)".to_string(),
            (None, false) => "done".to_string(),
        };
        self.save()?;
        if let Some(key) = chosen {
            let p = self.state.point(&key).context("chosen point")?.clone();
            let file = RecipeFile {
                frugal_version: VERSION.to_string(),
                base: self.state.base.clone(),
                recipe: p.recipe.clone(),
                measured: Some(p.measured()),
            };
            file.write(&self.dir.join("recipe.toml"))?;
            let built = p.recipe.build(&self.base_file)?;
            super::write_atomic(&self.dir.join("model.gguf"), built.raw_bytes())?;
        }
        Ok(())
    }

    /// For each target: whether some point meets all the others (then it is the one that
    /// binds, and the closest value is said), and the points closest to meeting them all.
    fn explain_infeasible(&mut self) {
        let targets = self.cfg.targets.clone();
        let measured: Vec<(&Point, Vec<Option<f64>>)> = self
            .state
            .points
            .iter()
            .map(|p| {
                let m = p.measured();
                (p, targets.iter().map(|t| t.shortfall(&m)).collect())
            })
            .collect();
        let mut binding = Vec::new();
        for (i, t) in targets.iter().enumerate() {
            let others_met = measured.iter().filter(|(_, s)| {
                s.iter().enumerate().all(|(j, x)| j == i || *x == Some(0.0)) && s[i].is_some()
            });
            if let Some((p, _)) = others_met.min_by(|a, b| {
                a.1[i]
                    .unwrap_or(f64::MAX)
                    .total_cmp(&b.1[i].unwrap_or(f64::MAX))
            }) {
                let v = t.read(&p.measured()).unwrap_or(f64::NAN);
                binding.push(format!(
                    "{t} binds: the best point meeting the other targets reaches {} ({})",
                    fmt_value(t, v),
                    p.key
                ));
            }
        }
        if binding.is_empty() {
            binding.push(format!(
                "no single target binds: every measured point misses more than one of {}",
                targets
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        let mut closest: Vec<(&Point, f64)> = measured
            .iter()
            .filter(|(_, s)| s.iter().all(Option::is_some))
            .map(|(p, s)| (*p, s.iter().flatten().sum()))
            .collect();
        closest.sort_by(|a, b| a.1.total_cmp(&b.1));
        self.state.closest = closest.iter().take(3).map(|(p, _)| p.key.clone()).collect();
        self.state.binding = binding;
    }

    /// Warns where two neighbours on the frontier differ in KL by less than the noise of the
    /// difference, and where the chosen point's KL is within noise of a bound.
    fn noise_warnings(&mut self) {
        let mut front: Vec<&Point> = self
            .state
            .points
            .iter()
            .filter(|p| p.pareto && p.latest().is_some())
            .collect();
        front.sort_by_key(|p| p.weight_bytes);
        let mut w = Vec::new();
        for pair in front.windows(2) {
            let (a, b) = (pair[0].latest().unwrap(), pair[1].latest().unwrap());
            let noise = (a.kl_stderr.powi(2) + b.kl_stderr.powi(2)).sqrt();
            if (a.kl_mean - b.kl_mean).abs() < noise {
                w.push(format!(
                    "KL of {} ({:.5}) and {} ({:.5}) differ by less than the noise ({:.5}): their order is not measured",
                    pair[0].key, a.kl_mean, pair[1].key, b.kl_mean, noise
                ));
            }
        }
        if let Some(c) = self
            .state
            .chosen
            .as_deref()
            .and_then(|k| self.state.point(k))
            && let Some(q) = c.latest()
        {
            for t in self.cfg.targets.iter().filter(|t| t.metric == Metric::Kl) {
                if (t.value - q.kl_mean).abs() < 2.0 * q.kl_stderr {
                    w.push(format!(
                        "the chosen point's KL {:.5} ± {:.5} is within twice the noise of {t}",
                        q.kl_mean, q.kl_stderr
                    ));
                }
            }
        }
        self.state.warnings = w;
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

/// Checks a config before a search starts: targets present, the levers built, the funnel sane.
pub fn check(config: &Config) -> Result<()> {
    ensure!(
        !config.targets.is_empty(),
        "give at least one --target (e.g. --target 'decode >= 5x' --target 'kl <= 0.05')"
    );
    ensure!(
        !config.funnel.rungs.is_empty() && config.funnel.ctx >= 4,
        "the funnel needs at least one rung and a window of 4 tokens"
    );
    for l in &config.levers {
        if !l.built() {
            bail!("lever {:?} is not built yet in this version", l.name());
        }
    }
    Ok(())
}
