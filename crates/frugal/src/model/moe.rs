//! Mixture-of-experts feed-forward blocks: the configuration read from GGUF, the router, and
//! the experts' products grouped by expert.
//!
//! A MoE layer replaces the FFN by `n_expert` SwiGLU experts of `n_ff` neurons and a router
//! (`ffn_gate_inp`, `n_expert x n_embd`). Per token (as llama.cpp's `build_moe_ffn`): router
//! logits in f32, probabilities by softmax (or sigmoid), the `n_used` highest of probability
//! plus an optional selection-only bias (DeepSeek's auxiliary-loss-free balancing), their
//! probabilities renormalized to sum to one and scaled, and the output `sum_k w_k E_k(x)` in
//! selection order, plus an optional always-on shared expert. Experts are stored as llama.cpp
//! stores them: 3-D tensors `ffn_{gate,up,down}_exps` of the experts' matrices one after another,
//! so expert `e` is an ordinary matrix inside the tensor and runs on the same kernels.
//!
//! In a pass over many rows the tokens are grouped by expert, so each selected expert's weights
//! are read once per pass; a row's result depends only on the row (every product is row by
//! row), so a token gives the same bits alone or in any batch.

use super::Model;
use crate::gguf::{GgufError, GgufFile};
use crate::ops::sized;
use crate::quant::{ActBuffers, Matrix, ProductInput};

use crate::quant::matmul;

/// How router logits become expert probabilities.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Gating {
    /// Softmax over all experts (Mixtral, llama.cpp's default).
    Softmax,
    /// An independent sigmoid per expert (DeepSeek-V3).
    Sigmoid,
}

impl Gating {
    /// The value of llama.cpp's `expert_gating_func` key.
    pub fn gguf_id(self) -> u32 {
        match self {
            Gating::Softmax => 1,
            Gating::Sigmoid => 2,
        }
    }
}

/// The mixture-of-experts features of a model (every layer routed).
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
pub struct MoeConfig {
    /// Experts per layer.
    pub n_expert: usize,
    /// Experts each token is routed to (top-k).
    pub n_used: usize,
    pub gating: Gating,
    /// Whether the selected experts' probabilities are renormalized to sum to one.
    pub norm_weights: bool,
    /// Factor on the (renormalized) weights.
    pub weights_scale: f32,
    /// Neurons of the always-on shared expert (`ffn_*_shexp`); 0 for none.
    pub n_ff_shared: usize,
}

/// Most experts per layer frugal accepts (a bound before anything is sized from the count).
pub const MAX_EXPERTS: usize = 1024;

impl MoeConfig {
    /// Reads `{arch}.expert_count` and the keys that go with it; `None` for a dense model.
    pub fn from_gguf(f: &GgufFile, arch: &str) -> Result<Option<Self>, GgufError> {
        let key = |k: &str| format!("{arch}.{k}");
        let bad = |k: &str, reason: String| GgufError::BadValue {
            key: key(k),
            reason,
        };
        let n_expert = match f.u32_opt(&key("expert_count"))? {
            None | Some(0) => return Ok(None),
            Some(e) => e as usize,
        };
        if n_expert > MAX_EXPERTS {
            return Err(bad(
                "expert_count",
                format!("{n_expert} experts (at most {MAX_EXPERTS})"),
            ));
        }
        let n_used = f
            .u32_opt(&key("expert_used_count"))?
            .ok_or_else(|| bad("expert_used_count", "missing beside expert_count".into()))?
            as usize;
        if n_used == 0 || n_used > n_expert {
            return Err(bad(
                "expert_used_count",
                format!("{n_used} experts per token: must be between 1 and the {n_expert} experts"),
            ));
        }
        let gating = match f.u32_opt(&key("expert_gating_func"))? {
            None | Some(1) => Gating::Softmax,
            Some(2) => Gating::Sigmoid,
            Some(g) => {
                return Err(bad(
                    "expert_gating_func",
                    format!("{g}: frugal runs 1 (softmax) and 2 (sigmoid)"),
                ));
            }
        };
        let weights_scale = f.f32_opt(&key("expert_weights_scale"))?.unwrap_or(1.0);
        if !(weights_scale.is_finite() && weights_scale > 0.0) {
            return Err(bad(
                "expert_weights_scale",
                format!("{weights_scale}: must be finite and positive"),
            ));
        }
        Ok(Some(MoeConfig {
            n_expert,
            n_used,
            gating,
            norm_weights: f.bool_opt(&key("expert_weights_norm"))?.unwrap_or(true),
            weights_scale,
            n_ff_shared: f
                .u32_opt(&key("expert_shared_feed_forward_length"))?
                .unwrap_or(0) as usize,
        }))
    }

    /// Whether llama.cpp's `llama` architecture computes this routing: it always takes softmax,
    /// renormalizes and does not scale (`build_moe_ffn` with fixed arguments).
    pub fn llama_cpp_compatible(&self) -> bool {
        self.gating == Gating::Softmax && self.norm_weights && self.weights_scale == 1.0
    }
}

/// The three matrices of one SwiGLU block: `down(silu(gate x) * up x)`.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

/// A routed layer's weights.
#[derive(Clone, Debug)]
pub struct Experts {
    /// `ffn_gate_inp`: one row of router weights per expert.
    pub router: Matrix,
    pub experts: Vec<Mlp>,
    /// The always-on shared expert.
    pub shared: Option<Mlp>,
    /// `exp_probs_b.bias`: added to the probabilities to choose experts, not to weigh them.
    pub selection_bias: Option<Vec<f32>>,
}

/// One token's routing: the chosen experts in selection order and their weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Route {
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// Routes one token from its router logits (`n_expert` values): probabilities, top-`n_used`
/// by probability plus `bias` (ties to the lower index), weights from the unbiased
/// probabilities, renormalized and scaled as `m` says. Writes `probs` (the probabilities, for
/// statistics and the balancing losses).
pub fn route(
    m: &MoeConfig,
    logits: &[f32],
    bias: Option<&[f32]>,
    probs: &mut Vec<f32>,
    out: &mut Route,
) {
    probs.clear();
    match m.gating {
        Gating::Softmax => {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            probs.extend(logits.iter().map(|&l| (l - max).exp()));
            let sum: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|p| *p /= sum);
        }
        Gating::Sigmoid => probs.extend(logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp()))),
    }
    let score = |e: usize| probs[e] + bias.map_or(0.0, |b| b[e]);
    out.experts.clear();
    out.weights.clear();
    for _ in 0..m.n_used {
        // Selection by repeated maximum: k is small, and the order is the selection order.
        let mut best: Option<usize> = None;
        for e in 0..m.n_expert {
            if out.experts.contains(&(e as u32)) {
                continue;
            }
            // `>` keeps the lower index on ties; a NaN score is never chosen over a number.
            if best.is_none_or(|b| score(e) > score(b) || score(b).is_nan()) {
                best = Some(e);
            }
        }
        let e = best.expect("n_used <= n_expert");
        out.experts.push(e as u32);
        out.weights.push(probs[e]);
    }
    if m.norm_weights {
        let sum: f32 = out.weights.iter().sum();
        if sum > 0.0 {
            out.weights.iter_mut().for_each(|w| *w /= sum);
        }
    }
    if m.weights_scale != 1.0 {
        out.weights.iter_mut().for_each(|w| *w *= m.weights_scale);
    }
}

/// Routing counts gathered while the model runs (`--moe-stats`): per layer, how many tokens
/// chose each expert, how often each pair of experts was chosen together, and the summed
/// entropy of the routing probabilities.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutingStats {
    pub n_expert: usize,
    /// `[layer][expert]`: tokens routed to the expert.
    pub load: Vec<Vec<u64>>,
    /// `[layer][a * n_expert + b]`, `a < b`: tokens that chose both.
    pub pairs: Vec<Vec<u64>>,
    /// `[layer]`: summed entropy (nats) of the tokens' routing probabilities.
    pub entropy: Vec<f64>,
    /// `[layer]`: tokens routed.
    pub tokens: Vec<u64>,
}

impl RoutingStats {
    pub fn new(n_layers: usize, n_expert: usize) -> Self {
        RoutingStats {
            n_expert,
            load: vec![vec![0; n_expert]; n_layers],
            pairs: vec![vec![0; n_expert * n_expert]; n_layers],
            entropy: vec![0.0; n_layers],
            tokens: vec![0; n_layers],
        }
    }

    /// Adds `from`'s counts into these and zeroes `from` (a server gathers each step's routing
    /// into its running totals). Shapes that differ are left alone: they are not one model's.
    pub fn absorb(&mut self, from: &mut RoutingStats) {
        if from.n_expert != self.n_expert || from.load.len() != self.load.len() {
            return;
        }
        for (a, b) in self.load.iter_mut().zip(&mut from.load) {
            a.iter_mut()
                .zip(b.iter_mut())
                .for_each(|(a, b)| *a += std::mem::take(b));
        }
        for (a, b) in self.pairs.iter_mut().zip(&mut from.pairs) {
            a.iter_mut()
                .zip(b.iter_mut())
                .for_each(|(a, b)| *a += std::mem::take(b));
        }
        for (a, b) in self.entropy.iter_mut().zip(&mut from.entropy) {
            *a += std::mem::take(b);
        }
        for (a, b) in self.tokens.iter_mut().zip(&mut from.tokens) {
            *a += std::mem::take(b);
        }
    }

    /// Counts one token's routing at `layer` (`probs`: its routing probabilities).
    pub fn record(&mut self, layer: usize, route: &Route, probs: &[f32]) {
        let Some(load) = self.load.get_mut(layer) else {
            return;
        };
        for (i, &a) in route.experts.iter().enumerate() {
            load[a as usize] += 1;
            for &b in &route.experts[i + 1..] {
                let (a, b) = (a.min(b) as usize, a.max(b) as usize);
                self.pairs[layer][a * self.n_expert + b] += 1;
            }
        }
        // Entropy of the normalized probabilities (sigmoid gates are normalized first).
        let sum: f32 = probs.iter().sum();
        if sum > 0.0 {
            self.entropy[layer] -= probs
                .iter()
                .map(|&p| (p / sum) as f64)
                .filter(|&p| p > 0.0)
                .map(|p| p * p.ln())
                .sum::<f64>();
        }
        self.tokens[layer] += 1;
    }
}

/// One layer's routing, summarized.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayerRouting {
    pub layer: usize,
    pub tokens: u64,
    /// Each expert's share of the routed slots (sums to 1).
    pub load: Vec<f64>,
    /// The busiest expert's load over the mean load (1 when balanced).
    pub max_over_mean: f64,
    /// Coefficient of variation of the loads (0 when balanced).
    pub cv: f64,
    /// Mean entropy of a token's routing probabilities, in nats (at most ln E).
    pub entropy: f64,
    /// The most often co-selected pairs: (expert a, expert b, tokens).
    pub top_pairs: Vec<(usize, usize, u64)>,
}

impl RoutingStats {
    /// Layer `layer` summarized, or `None` when it routed nothing.
    pub fn layer(&self, layer: usize) -> Option<LayerRouting> {
        let load = self.load.get(layer)?;
        let slots: u64 = load.iter().sum();
        if slots == 0 {
            return None;
        }
        let share: Vec<f64> = load.iter().map(|&l| l as f64 / slots as f64).collect();
        let mean = 1.0 / self.n_expert as f64;
        let var = share.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / self.n_expert as f64;
        let e = self.n_expert;
        let mut pairs: Vec<(usize, usize, u64)> = (0..e)
            .flat_map(|a| (a + 1..e).map(move |b| (a, b)))
            .map(|(a, b)| (a, b, self.pairs[layer][a * e + b]))
            .filter(|p| p.2 > 0)
            .collect();
        pairs.sort_by(|x, y| y.2.cmp(&x.2).then((x.0, x.1).cmp(&(y.0, y.1))));
        pairs.truncate(3);
        Some(LayerRouting {
            layer,
            tokens: self.tokens[layer],
            max_over_mean: share.iter().copied().fold(0.0, f64::max) / mean,
            cv: var.sqrt() / mean,
            entropy: self.entropy[layer] / self.tokens[layer].max(1) as f64,
            load: share,
            top_pairs: pairs,
        })
    }
}

/// Buffers of the experts' products, reused across passes.
#[derive(Default, Debug)]
pub struct MoeScratch {
    logits: Vec<f32>,
    probs: Vec<f32>,
    routes: Vec<Route>,
    /// Per expert: the (row, selection slot) pairs routed to it this layer.
    assigned: Vec<Vec<(usize, usize)>>,
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    y: Vec<f32>,
    /// Each row's expert outputs by selection slot (`n x n_used x n_embd`).
    slots: Vec<f32>,
    /// The gathered rows, quantized; and the experts' hidden rows, quantized.
    xq: ActBuffers,
    acts: ActBuffers,
    /// Routing statistics, gathered when set.
    pub stats: Option<RoutingStats>,
}

impl Model {
    /// The routed FFN of layer `layer` for the `n` rows of `x` (normalized, `n x n_embd`;
    /// `x_forms` the buffers of its integer forms), written into `out`.
    pub(super) fn experts_ffn(
        &self,
        layer: usize,
        w: &Experts,
        x: &[f32],
        x_forms: &mut ActBuffers,
        s: &mut MoeScratch,
        out: &mut [f32],
    ) {
        let act = self.activations;
        let m = self.config.moe.expect("a routed layer has a MoE config");
        let d = self.config.n_embd;
        let ff = self.config.n_ff;
        let n = x.len() / d;
        let k = m.n_used;
        // The router, in f32 (which experts a token gets must not hinge on activation
        // rounding), row by row: the f32 matrix-matrix kernel sums in another order than the
        // matrix-vector one, and a row's routing must not depend on its batch.
        let logits = sized(&mut s.logits, n * m.n_expert);
        let router = w.router.view();
        for (xr, lr) in x.chunks_exact(d).zip(logits.chunks_exact_mut(m.n_expert)) {
            matmul(&router, xr, 1, lr);
        }
        s.routes.resize_with(n, Route::default);
        s.assigned.resize_with(m.n_expert, Vec::new);
        s.assigned.iter_mut().for_each(Vec::clear);
        for (t, route) in s.routes.iter_mut().enumerate() {
            let row = &s.logits[t * m.n_expert..(t + 1) * m.n_expert];
            self::route(&m, row, w.selection_bias.as_deref(), &mut s.probs, route);
            for (slot, &e) in route.experts.iter().enumerate() {
                s.assigned[e as usize].push((t, slot));
            }
            if let Some(st) = &mut s.stats {
                st.record(layer, route, &s.probs);
            }
        }
        // Each chosen expert once, over the rows routed to it.
        let mut xin = ProductInput::new(x, d, act, x_forms);
        let slots = sized(&mut s.slots, n * k * d);
        for (e, rows) in s.assigned.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let r = rows.len();
            let y = sized(&mut s.y, r * d);
            if r == n {
                // Every row (decode, or all experts active): no gathering.
                let (gate, up, acts) = (&mut s.gate, &mut s.up, &mut s.acts);
                self.mlp(&w.experts[e], &mut xin, ff, gate, up, acts, y);
            } else {
                let xg = sized(&mut s.x, r * d);
                for (dst, &(t, _)) in xg.chunks_exact_mut(d).zip(rows) {
                    dst.copy_from_slice(&x[t * d..(t + 1) * d]);
                }
                // Quantized per row, so a gathered row has the bytes it has in `xin`.
                let mut xg = ProductInput::new(xg, d, act, &mut s.xq);
                let (gate, up, acts) = (&mut s.gate, &mut s.up, &mut s.acts);
                self.mlp(&w.experts[e], &mut xg, ff, gate, up, acts, y);
            }
            for (src, &(t, slot)) in s.y.chunks_exact(d).zip(rows) {
                slots[(t * k + slot) * d..][..d].copy_from_slice(src);
            }
        }
        // Weighted sum in selection order, then the shared expert.
        for (t, route) in s.routes.iter().enumerate() {
            let o = &mut out[t * d..(t + 1) * d];
            o.fill(0.0);
            for (slot, &wt) in route.weights.iter().enumerate() {
                let y = &slots[(t * k + slot) * d..][..d];
                o.iter_mut().zip(y).for_each(|(o, &y)| *o += wt * y);
            }
        }
        if let Some(sh) = &w.shared {
            let y = sized(&mut s.y, n * d);
            let (gate, up, acts) = (&mut s.gate, &mut s.up, &mut s.acts);
            self.mlp(sh, &mut xin, m.n_ff_shared, gate, up, acts, y);
            out.iter_mut()
                .zip(&s.y[..n * d])
                .for_each(|(o, &y)| *o += y);
        }
    }
}

#[cfg(test)]
mod tests;
