//! The end of a search: the frontier marked, the best point chosen (or the binding constraint
//! named), the outputs written, and the warnings where two points' quality is within noise.

use super::*;

impl Search<'_> {
    /// Marks the frontier and the feasible points, picks the best, says which constraint binds
    /// when none meets every target, and writes `frontier.json`, `recipe.toml` and
    /// `model.gguf`.
    pub(super) fn finish(&mut self) -> Result<()> {
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
            let speculate = self.speculate_stage(&key)?;
            self.save()?;
            let p = self.state.point(&key).context("chosen point")?.clone();
            let draft = speculate.as_ref().and_then(|s| s.draft.clone());
            let needs = p.recipe.needs_calibration_with(draft.as_ref());
            let file = RecipeFile {
                frugal_version: VERSION.to_string(),
                encoders: Some(super::super::recipe::encoder_fingerprint().to_string()),
                base: self.state.base.clone(),
                recipe: p.recipe.clone(),
                calibration: if needs {
                    Some(CalibrationId::of(&self.cfg.calibration, &self.cal)?)
                } else {
                    None
                },
                measured: Some(p.measured()),
                speculate,
            };
            file.write(&self.dir.join("recipe.toml"))?;
            let built = self.built_file(&key)?;
            super::super::write_atomic(&self.dir.join("model.gguf"), built.raw_bytes())?;
            let draft_path = self.dir.join(crate::optimize::speculate::DRAFT_FILE);
            match draft.map(|d| d.key()) {
                Some(k) => {
                    let d = self.built_file(&k)?;
                    super::super::write_atomic(&draft_path, d.raw_bytes())?;
                }
                None if draft_path.exists() => std::fs::remove_file(&draft_path)?,
                None => {}
            }
        }
        Ok(())
    }

    /// For each target: whether some point meets all the others (then it is the one that
    /// binds, and the closest value is said), and the points closest to meeting them all.
    pub(super) fn explain_infeasible(&mut self) {
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
    pub(super) fn noise_warnings(&mut self) {
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
