//! The structural stages of the search, pruning and (when asked for) conversion to experts:
//! each cut or conversion timed against its dense twin, and those this CPU rewards combined
//! with the best weight recipes, in both orders where the stage can follow quantization (cut,
//! then quantize; quantize, then cut), built and measured at the first rung with everything
//! else.

use super::*;
use crate::optimize::prune::{self, Gate, Trial};

/// Decode tokens and back-to-back rounds a gate times (at least).
const GATE_TOKENS: usize = 128;
const GATE_ROUNDS: usize = 5;

impl Search<'_> {
    /// Runs the stage after rung 0 of the weight recipes `keys`; returns the keys of the
    /// candidates it added (measured at rung 0).
    pub(super) fn structural_stage(&mut self, keys: &[String]) -> Result<Vec<String>> {
        let float = self.float_base();
        let mut trials = Vec::new();
        if self.levers(Lever::Prune) {
            trials = prune::trials(&self.base.config, float);
            if !float {
                self.state.refused.push(
                    "prune: sparse cuts need float weights to score and store; a quantized base takes structured cuts only"
                        .to_string(),
                );
            }
        }
        if self.levers(Lever::Moe) {
            let (moe, refused) = crate::optimize::experts::trials(&self.base.config, float);
            trials.extend(moe);
            self.state.refused.extend(refused);
        }
        let weights = self.best_weights(keys);
        let mut out: Vec<String> = Vec::new();
        let rung = self.cfg.funnel.rungs[0];
        for t in trials {
            if self.out_of_time_keeping(self.speed_reserve()) {
                break;
            }
            let Some(gate) = self.gate(&t)? else {
                continue;
            };
            if !gate.taken {
                continue;
            }
            let cut = t.cut.clone();
            let after = t.after();
            let mut recipes = vec![(t.pruned(), Runtime::default())];
            if let Some(a) = &after {
                recipes.push(([t.dense(), vec![a.clone()]].concat(), Runtime::default()));
            }
            if t.takes_any_format() {
                for w in &weights {
                    let q = w.stages[0].clone();
                    recipes.push((vec![cut.clone(), q.clone()], w.runtime));
                    if after.is_some() {
                        recipes.push((vec![q, cut.clone()], w.runtime));
                    }
                }
            }
            for (stages, runtime) in recipes {
                let recipe = Recipe { stages, runtime };
                if out.contains(&recipe.key()) {
                    continue;
                }
                let k = self.add_built(recipe)?;
                self.quality(&k, rung)?;
                out.push(k);
            }
        }
        Ok(out)
    }

    /// The best weight recipes of `keys` (the first Pareto layer, `structural_variants` of
    /// them), with the runtime settings they were measured with: what structural stages are
    /// combined with.
    pub(super) fn best_weights(&self, keys: &[String]) -> Vec<Recipe> {
        self.front(keys, self.cfg.funnel.structural_variants)
            .iter()
            .map(|k| self.state.points[self.index[k]].recipe.clone())
            .filter(|r| r.stages.len() == 1)
            .collect()
    }

    /// Whether the base's matrices are floats (every cut can be scored and stored).
    pub(super) fn float_base(&self) -> bool {
        quant::formats_for(&self.base_file)
            .base
            .is_some_and(|t| matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16))
    }

    /// Times `t`'s cut against its dense twin (or finds the timing a resumed search made);
    /// `None` when out of time.
    fn gate(&mut self, t: &Trial) -> Result<Option<Gate>> {
        if let Some(g) = self
            .state
            .gates
            .iter()
            .find(|g| g.cut == t.cut && g.format == t.format && g.dense == t.dense)
        {
            return Ok(Some(g.clone()));
        }
        if self.out_of_time_keeping(self.speed_reserve()) {
            return Ok(None);
        }
        let reward = self.cfg.funnel.prune_reward;
        let gate = match self.time_cut(t) {
            Ok(speedup) => {
                let taken = speedup >= reward;
                let reason = if taken {
                    format!("decode {speedup:.2}x its dense twin ({})", t.dense)
                } else {
                    format!(
                        "decode {speedup:.2}x its dense twin ({}), under the {reward:.2}x this CPU must reward a cut with: not taken",
                        t.dense
                    )
                };
                Gate {
                    cut: t.cut.clone(),
                    format: t.format.clone(),
                    dense: t.dense.clone(),
                    speedup,
                    taken,
                    reason,
                }
            }
            // A cut this model cannot take (too few layers, rows the pattern does not
            // divide): skipped with the reason.
            Err(e) => Gate {
                cut: t.cut.clone(),
                format: t.format.clone(),
                dense: t.dense.clone(),
                speedup: 0.0,
                taken: false,
                reason: format!("cannot be made: {e:#}"),
            },
        };
        self.evaluations += 1;
        let line = format!("{} as {}: {}", gate.cut, gate.format, gate.reason);
        self.state.gates.push(gate.clone());
        self.save()?;
        self.say(line);
        Ok(Some(gate))
    }

    /// Decode speed of `t`'s pruned model over its dense twin, timed back to back.
    fn time_cut(&mut self, t: &Trial) -> Result<f64> {
        let pruned = crate::build::load_file(self.build_stages(&t.pruned())?, false)?;
        let dense = crate::build::load_file(self.build_stages(&t.dense())?, false)?;
        // Longer than a contender's timing: the gate decides from a few percent, and 32
        // tokens at 200 tok/s timed three times spread by ±10% on this VM (a dense-stored
        // unstructured cut, which cannot be faster, read 1.09x).
        let test = SpeedTest {
            prompt: 0,
            gen_tokens: self.cfg.funnel.gen_tokens.max(GATE_TOKENS),
            ..self.speed_test()
        };
        let r = timing::back_to_back(
            1,
            self.cfg.funnel.rounds.max(GATE_ROUNDS),
            |_| Some(1),
            |s| {
                if s == 0 {
                    test.measure(&pruned)
                } else {
                    test.measure(&dense)
                }
            },
            |_| {},
        )?;
        Ok(r.candidates[0].vs_base.decode)
    }

    /// Adds the point of a recipe with a structural stage, built to count its bytes (one that
    /// cannot be built is added dropped, with the reason).
    pub(super) fn add_built(&mut self, recipe: Recipe) -> Result<String> {
        let key = recipe.key();
        if self.index.contains_key(&key) {
            return Ok(key);
        }
        let t0 = Instant::now();
        let built = self.build_stages(&recipe.stages);
        let build_seconds = t0.elapsed().as_secs_f64();
        let (bytes, params, dropped) = match built {
            Ok(f) => {
                let (b, p) = f.tensors().iter().fold((0u64, 0u64), |(b, p), t| {
                    (b + t.n_bytes(), p + t.n_elements())
                });
                (b, p, None)
            }
            Err(e) => (0, 1, Some(format!("cannot run: {e:#}"))),
        };
        self.index.insert(key.clone(), self.state.points.len());
        self.state.points.push(Point::unmeasured(
            key.clone(),
            recipe,
            (bytes, params),
            build_seconds,
            None,
            dropped,
        ));
        Ok(key)
    }

    /// The base with `stages` applied: the leading structural stages (cuts, distillation:
    /// the slow ones, shared by many recipes) from a cache of their results, a leading
    /// quantization from the bank, the rest applied in turn.
    pub(super) fn build_stages(&mut self, stages: &[Stage]) -> Result<GgufFile> {
        let n = stages
            .iter()
            .take_while(|s| !matches!(s, Stage::Quant { .. }))
            .count();
        let mut cur: Option<GgufFile> = None;
        let mut cached: Option<String> = None;
        let mut rest = stages;
        if n > 0 {
            for i in 1..=n {
                let key = prefix_key(&stages[..i]);
                if self.structural.contains_key(&key) {
                    continue;
                }
                let src = match i {
                    1 => &self.base_file,
                    _ => &self.structural[&prefix_key(&stages[..i - 1])],
                };
                let f = stages[i - 1].apply(src, &self.base_file, &self.cal)?;
                self.structural.insert(key, f);
            }
            cached = Some(prefix_key(&stages[..n]));
            rest = &stages[n..];
        } else if let Some(q) = stages.first()
            && let Some(mix) = self.stage_mixes.get(&q.to_string())
        {
            cur = Some(GgufFile::from_bytes(self.bank.assemble(mix)?)?);
            rest = &stages[1..];
        }
        for s in rest {
            let src = match (&cur, &cached) {
                (Some(f), _) => f,
                (None, Some(key)) => &self.structural[key],
                (None, None) => &self.base_file,
            };
            cur = Some(s.apply(src, &self.base_file, &self.cal)?);
        }
        if let Some(f) = cur {
            return Ok(f);
        }
        let bytes = match &cached {
            Some(key) => self.structural[key].raw_bytes().to_vec(),
            None => self.base_file.raw_bytes().to_vec(),
        };
        Ok(GgufFile::from_bytes(bytes)?)
    }
}

/// The cache key of a run of leading stages.
fn prefix_key(stages: &[Stage]) -> String {
    let names: Vec<String> = stages.iter().map(|s| s.to_string()).collect();
    names.join(" | ")
}
