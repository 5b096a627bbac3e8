//! Per-group sensitivity (each group alone at the probe format, KL on the calibration text)
//! and the mixes it allocates, one per bits-per-weight budget of the sweep.

use super::*;

impl Search<'_> {
    /// Sensitivity of each group, and the mixes it allocates under the budget sweep.
    pub(super) fn mixes_by_sensitivity(
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
    pub(super) fn sensitivity(
        &mut self,
        group: &str,
        mix: &Mix,
        probe: GgmlType,
    ) -> Result<Option<f64>> {
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
}
