//! The best weight recipes of rung 0 tried another way: run with another KV-cache format or
//! activation precision (runtime settings, the same file), or encoded again with importance
//! weighting from the calibration text (another file of the same size).

use super::*;

/// The formats `frugal quantize --calibration` encodes by importance.
const WEIGHTED: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q4_K];

impl Search<'_> {
    /// The best weight recipes (first Pareto layer, those meeting the quality targets first)
    /// with one runtime setting changed: KV-cache f16 and q8_0 (`kv`), activations q8-full and
    /// f32 (`quant`).
    pub(super) fn runtime_variants(&mut self, keys: &[String]) -> Vec<String> {
        let base_keys = self.front(keys, self.cfg.funnel.runtime_variants);
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
                Stage::Quant { format, .. } => matches!(format.as_str(), "f16" | "bf16" | "f32"),
                _ => false,
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

    /// The best weight recipes (as [`Self::runtime_variants`] picks them) whose mix holds a
    /// format with a weighted encoder, encoded again by each column's importance on the
    /// calibration text (llama.cpp's imatrix): the same bytes, other roundings.
    pub(super) fn imatrix_variants(&mut self, keys: &[String]) -> Result<Vec<String>> {
        if !self.levers(Lever::Quant) {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for k in self.front(keys, self.cfg.funnel.runtime_variants) {
            let p = &self.state.points[self.index[&k]];
            let [
                Stage::Quant {
                    format,
                    keep,
                    imatrix: false,
                },
            ] = p.recipe.stages.as_slice()
            else {
                continue;
            };
            let mix = &self.mixes[&k];
            let weighted = self.base_file.tensors().iter().any(|t| {
                quant::quantizable(&t.name, &t.dims) && WEIGHTED.contains(&mix.format_of(&t.name))
            });
            if !weighted {
                continue;
            }
            let recipe = Recipe {
                stages: vec![Stage::Quant {
                    format: format.clone(),
                    keep: keep.clone(),
                    imatrix: true,
                }],
                runtime: p.recipe.runtime,
            };
            out.push(self.add_built(recipe)?);
        }
        Ok(out)
    }
}
