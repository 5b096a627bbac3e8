//! The distillation stage of the search: pulled last, and only when no cheaper point meets
//! every target. The structural candidates (cuts, layouts, experts) closest to the targets are distilled from the base on the
//! calibration text, quantized again as before, and measured through every rung (and timed
//! when they meet the quality targets).

use super::*;
use funnel::quality_ok;

impl Search<'_> {
    pub(super) fn distill_stage(&mut self) -> Result<()> {
        if !self.levers(Lever::Distill) {
            return Ok(());
        }
        if self.meets_all() {
            self.state
                .refused
                .push("distill: not pulled: a cheaper point meets every target".to_string());
            return Ok(());
        }
        // A cut, a layout or experts, then quantization: the structural candidates healing
        // applies to (the float model after the change is what trains).
        let mut cands: Vec<&Point> = self
            .state
            .points
            .iter()
            .filter(|p| {
                p.latest().is_some()
                    && !p
                        .dropped
                        .as_deref()
                        .is_some_and(|d| d.starts_with("cannot run"))
                    && matches!(
                        p.recipe.stages.as_slice(),
                        [
                            Stage::Prune(_) | Stage::Attention { .. } | Stage::Moe { .. },
                            Stage::Quant { .. }
                        ]
                    )
            })
            .collect();
        if cands.is_empty() {
            self.state.refused.push(
                "distill: no cut candidate to heal (add the prune lever, or no cut was taken)"
                    .to_string(),
            );
            return Ok(());
        }
        cands.sort_by(|a, b| self.shortfall(a).total_cmp(&self.shortfall(b)));
        let recipes: Vec<Recipe> = cands
            .iter()
            .take(self.cfg.funnel.distill_candidates)
            .map(|p| {
                let mut stages = p.recipe.stages.clone();
                stages.insert(
                    1,
                    Stage::Distill {
                        tokens: self.cfg.funnel.distill_tokens,
                        seed: 0,
                    },
                );
                Recipe {
                    stages,
                    runtime: p.recipe.runtime,
                }
            })
            .collect();
        let rungs = self.cfg.funnel.rungs.clone();
        for r in recipes {
            if self.out_of_time() {
                break;
            }
            let k = self.add_built(r)?;
            self.say(format!("distilled {k}"));
            for &tokens in &rungs {
                self.quality(&k, tokens)?;
            }
            let p = &self.state.points[self.index[&k]];
            if self.needs_speed() && quality_ok(&self.cfg.targets, p) {
                self.speed(&k)?;
            }
        }
        self.save()
    }
}
