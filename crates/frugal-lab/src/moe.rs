//! Dense to mixture of experts: the variants `frugal moefy` builds (a split into routed experts,
//! with or without a shared expert, or an upcycled copy), and a MoE model's quality against the
//! dense one with the routing's load.

use anyhow::Result;
use frugal::eval::{self, EvalOptions};
use frugal::model::Model;
use frugal::surgery::moe::{self, MoeReport, MoefyTarget, RouterInit, Split};

/// One MoE variant of a dense model.
#[derive(Clone, Debug, PartialEq)]
pub struct Variant {
    /// As written: `8x2`, `8x2w`, `s512+8x2`, `up4x1`.
    pub spec: String,
    pub n_expert: usize,
    pub n_used: usize,
    /// Neurons kept as an always-on shared expert.
    pub shared: usize,
    pub upcycle: bool,
    /// k-means on the gate rows and centroid routers (no data), instead of co-activation and
    /// fitted routers.
    pub weights: bool,
}

impl std::str::FromStr for Variant {
    type Err = String;
    fn from_str(spec: &str) -> std::result::Result<Self, String> {
        let bad = || {
            format!(
                "variant {spec:?}: write EXK (8x2), EXKw (weights split), sN+EXK (shared \
                 expert of N neurons) or upEXK (upcycled)"
            )
        };
        let (shared, rest) = match spec.strip_prefix('s').and_then(|r| r.split_once('+')) {
            Some((n, r)) => (n.parse().map_err(|_| bad())?, r),
            None => (0, spec),
        };
        let (upcycle, rest) = match rest.strip_prefix("up") {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let (weights, rest) = match rest.strip_suffix('w') {
            Some(r) => (true, r),
            None => (false, rest),
        };
        let (e, k) = rest.split_once('x').ok_or_else(bad)?;
        let (n_expert, n_used) = (e.parse().map_err(|_| bad())?, k.parse().map_err(|_| bad())?);
        if upcycle && (weights || shared > 0) {
            return Err(bad());
        }
        Ok(Variant {
            spec: spec.into(),
            n_expert,
            n_used,
            shared,
            upcycle,
            weights,
        })
    }
}

/// A variant as built.
pub struct Built {
    /// The GGUF file.
    pub bytes: Vec<u8>,
    pub report: MoeReport,
    /// Share of the dense FFN's neurons a token runs.
    pub active_ffn: f64,
}

impl Variant {
    /// In words, for tables.
    pub fn describe(&self) -> String {
        if self.upcycle {
            return format!("upcycled: {} copies, top-{}", self.n_expert, self.n_used);
        }
        let shared = if self.shared > 0 {
            format!("shared {} + ", self.shared)
        } else {
            String::new()
        };
        let how = if self.weights {
            "weight k-means, centroid router"
        } else {
            "co-activation, fitted router"
        };
        format!(
            "{shared}{} experts, top-{} ({how})",
            self.n_expert, self.n_used
        )
    }

    /// The variant of `dense`, the split and routers from its activations over `calib` in
    /// windows of `ctx` (an upcycle or a weights split reads none).
    pub fn build(&self, dense: &Model, calib: &[u32], ctx: usize, seed: u64) -> Result<Built> {
        let (w, r) = if self.upcycle {
            moe::upcycle(&dense.file, self.n_expert, self.n_used, 0.01, seed)?
        } else {
            let t = MoefyTarget {
                n_expert: self.n_expert,
                n_used: self.n_used,
                split: if self.weights {
                    Split::Weights
                } else {
                    Split::Coactivation
                },
                router: if self.weights {
                    RouterInit::Centroid
                } else {
                    RouterInit::Fit
                },
                shared: self.shared,
                seed,
            };
            moe::moefy(&dense.file, dense, Some((calib, ctx)), &t)?
        };
        let active_ffn = if self.upcycle {
            1.0
        } else {
            (self.shared + r.n_used * r.expert_width) as f64 / dense.config.n_ff as f64
        };
        Ok(Built {
            bytes: w.to_bytes()?,
            report: r,
            active_ffn,
        })
    }
}

/// A MoE model's quality against the dense one, and how its routers spread the tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct MoeQuality {
    pub ppl: f64,
    pub kl: f64,
    /// The busiest expert's share of the routed slots over the mean share (1 when balanced),
    /// the mean over the layers and the worst layer.
    pub busiest: f64,
    pub worst: f64,
    /// Load coefficient of variation and routing entropy, means over the layers.
    pub cv: f64,
    pub entropy: f64,
}

/// `m` against `dense` on `ids` in windows of `ctx`, with its routing load on the same text
/// (all zero for a dense model).
pub fn measure(m: &Model, dense: &Model, ids: &[u32], ctx: usize) -> Result<MoeQuality> {
    let c = crate::quality::against(m, dense, ids, ctx)?;
    let mut q = MoeQuality {
        ppl: c.ppl,
        kl: c.kl_mean,
        ..MoeQuality::default()
    };
    let (_, stats) =
        eval::perplexity_routed(m, ids, ctx, &EvalOptions::default(), true, |_, _| {})?;
    if let Some(s) = stats {
        let layers: Vec<_> = (0..m.config.n_layers).filter_map(|l| s.layer(l)).collect();
        let n = layers.len().max(1) as f64;
        q.busiest = layers.iter().map(|l| l.max_over_mean).sum::<f64>() / n;
        q.worst = layers.iter().map(|l| l.max_over_mean).fold(0.0, f64::max);
        q.cv = layers.iter().map(|l| l.cv).sum::<f64>() / n;
        q.entropy = layers.iter().map(|l| l.entropy).sum::<f64>() / n;
    }
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::Variant;

    #[test]
    fn variant_specs_parse_and_bad_ones_are_refused() {
        let v: Variant = "s512+8x2".parse().unwrap();
        assert_eq!(
            (v.shared, v.n_expert, v.n_used, v.upcycle),
            (512, 8, 2, false)
        );
        let v: Variant = "16x4w".parse().unwrap();
        assert!(v.weights && v.n_expert == 16 && v.n_used == 4);
        let v: Variant = "up4x1".parse().unwrap();
        assert!(v.upcycle && v.n_expert == 4 && v.n_used == 1);
        for bad in [
            "8", "x2", "8x", "s+8x2", "sup+4x1", "s8+up4x1", "up4x1w", "8y2",
        ] {
            assert!(bad.parse::<Variant>().is_err(), "{bad}");
        }
    }
}
