//! The attention-layout stage of the search: pulled only when a memory target binds (no
//! measured point meets the memory and quality targets together), because a new layout
//! trades quality for KV bytes and only a memory target asks for that. Each layout the model
//! can take is combined with the best weight recipes and measured at the first rung; the
//! distillation stage may heal them later.

use super::*;
use crate::optimize::attention;
use funnel::quality_ok;

impl Search<'_> {
    pub(super) fn attention_stage(&mut self, keys: &[String]) -> Result<Vec<String>> {
        if !self.levers(Lever::Attention) {
            return Ok(Vec::new());
        }
        let (layouts, refused) = attention::layouts(&self.base.config);
        self.state.refused.extend(refused);
        let refuse = |s: &mut Self, why: &str| {
            s.state
                .refused
                .push(format!("attention: not pulled: {why}"));
        };
        if !self.cfg.targets.iter().any(|t| t.metric == Metric::Memory) {
            refuse(
                self,
                "no memory target (a layout trades quality for KV bytes)",
            );
            return Ok(Vec::new());
        }
        if self
            .state
            .points
            .iter()
            .any(|p| quality_ok(&self.cfg.targets, p))
        {
            refuse(self, "a point already meets the memory and quality targets");
            return Ok(Vec::new());
        }
        let weights = self.best_weights(keys);
        let rung = self.cfg.funnel.rungs[0];
        let mut out = Vec::new();
        for layout in layouts {
            for w in &weights {
                if self.out_of_time_keeping(self.speed_reserve()) {
                    return Ok(out);
                }
                let recipe = Recipe {
                    stages: vec![
                        Stage::Attention {
                            layout: layout.clone(),
                        },
                        w.stages[0].clone(),
                    ],
                    runtime: w.runtime,
                };
                let k = self.add_built(recipe)?;
                self.quality(&k, rung)?;
                out.push(k);
            }
        }
        Ok(out)
    }
}
