//! The funnel's rules: which points can still win, which are dominated, which go on to the
//! next rung, and which are worth timing.

use super::*;

/// Whether `p` is sure to miss a quality or memory target, the measurement's noise allowed for.
pub(super) fn surely_fails(t: &Target, p: &Point) -> bool {
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
pub(super) fn quality_ok(targets: &[Target], p: &Point) -> bool {
    let m = p.measured();
    targets
        .iter()
        .filter(|t| !t.metric.is_speed())
        .all(|t| t.met(&m) == Some(true))
}

pub(super) fn act_slow(p: &Point) -> u8 {
    u8::from(p.recipe.runtime.activations == Activations::F32)
}

pub(super) fn mem(p: &Point) -> u64 {
    p.memory.map_or(u64::MAX, |m| m.total())
}

/// Plain Pareto dominance on (KL, memory, weight bytes, f32 activations).
pub(super) fn dominates(a: &Point, b: &Point) -> bool {
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
pub(super) fn dominates_within_noise(targets: &[Target], a: &Point, b: &Point) -> bool {
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
    pub(super) fn alive(&self, keys: &[String]) -> Vec<String> {
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
    pub(super) fn drop_losers(&mut self, keys: &[String]) {
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
    pub(super) fn shortfall(&self, p: &Point) -> f64 {
        let m = p.measured();
        self.cfg
            .targets
            .iter()
            .filter_map(|t| t.shortfall(&m))
            .sum()
    }

    /// At most half of `active` (at least 3), by Pareto layers; within a layer, those meeting
    /// the quality targets, then the smallest, first.
    pub(super) fn halve(&mut self, active: Vec<String>) -> Vec<String> {
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

    pub(super) fn needs_speed(&self) -> bool {
        self.cfg.objective.needs_speed() || self.cfg.targets.iter().any(|t| t.metric.is_speed())
    }

    pub(super) fn speed_test(&self) -> SpeedTest {
        let f = &self.cfg.funnel;
        let prefill = self.cfg.targets.iter().any(|t| t.metric == Metric::Prefill)
            || self.cfg.objective == crate::optimize::target::Objective::Prefill;
        SpeedTest {
            prompt: if prefill { f.prompt.max(1) } else { 0 },
            gen_tokens: f.gen_tokens,
            depth: 0,
            reps: 1,
        }
    }

    /// The points that can still be the fastest: meeting the quality and memory targets, with
    /// weights within 15% of the smallest such point's (8-bit activations before f32).
    pub(super) fn contenders(&self, active: &[String]) -> Vec<String> {
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
}
