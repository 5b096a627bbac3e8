//! Training the routers of a mixture-of-experts model to imitate the dense FFN its experts came
//! from, with the experts frozen, and with or without load balancing.
//!
//! Every routed layer trains at once from one pass of the dense teacher: token `t`'s FFN input
//! `x` is the teacher's (as MoEfication trains its routers, layer by layer), its target `τ` the
//! teacher's FFN output. The router gives logits `l = R x`, probabilities `p = softmax(l)` (or
//! sigmoid), the top-k set `S` by `p + b` and weights `w_i = s p_i / Σ_S p` (`s` the file's
//! weight scale; no division when the file does not renormalize); the layer's output is
//! `y = Σ_S w_i E_i(x) (+ shared(x))`. Two terms train the router:
//!
//! - **Which experts** (selection). Top-k is a step function: its choice gets no gradient, and
//!   under renormalized weights an expert outside `S` gets none at all (the output does not
//!   change when the chosen probabilities scale together), so the reconstruction loss alone
//!   only reweighs experts already chosen (and moving those logits moves other tokens' choices
//!   blindly: measured, the error then rises). The selection is therefore taught directly, as
//!   MoEfication's learned "MLP selection" is: every expert runs on every token, the `k` with
//!   the largest gain `2⟨τ − base, u_i⟩ − |u_i|²` (how much expert `i` alone, at the uniform
//!   weight `u_i = (s/k) E_i(x)`, closes the gap to the dense output) are the token's oracle set
//!   `O`, and the router learns it by cross-entropy `−(1/k) Σ_O log p_i` (softmax; a binary
//!   cross-entropy per expert under sigmoid gating): `∂/∂l = p − q`, `q` uniform on `O`.
//! - **How much each** (weights): the relative error `|y − τ|² / |τ|²`, averaged over the
//!   step's tokens (per token, so that the few tokens whose FFN outputs are a hundred times
//!   the others', the first of a window among them, do not decide alone), with
//!   `g_i = ∂/∂w_i = 2 (y − τ)·E_i(x) / (B |τ|²)`; renormalized,
//!   `∂/∂p_j = (s g_j − Σ_S w_i g_i) / Σ_S p` for `j ∈ S`; then softmax
//!   `∂/∂l = p ⊙ (∂/∂p − p·∂/∂p)` (sigmoid: `∂/∂p · p (1 − p)`).
//!
//! `∂/∂R = (∂/∂l)ᵀ X` summed over both, and over tokens averaged.
//!
//! Balancing, three ways ([`Balance`]):
//! - `none`;
//! - `aux:α`: the Switch Transformer's loss `α E Σ_i f_i P_i`, with `f_i` the share of this
//!   step's routed slots expert `i` took (a constant, as in the paper) and `P_i` its mean
//!   probability, so `∂/∂p_{t,i} = α E f_i / B`: a busy expert's probability is pushed down for
//!   every token, which lifts the idle ones through the softmax;
//! - `bias:γ`: DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the
//!   probabilities for selection only, moved by `γ sign(mean load − load_i)` after each step.
//!   It is written as `exp_probs_b.bias` (frugal reads it; llama.cpp's `llama` architecture
//!   does not).
//!
//! [`mixture_backward`] is checked against finite differences in the tests.

use frugal::gguf::{GgufFile, GgufWriter, TensorData, Value};
use frugal::model::features::FfnAct;
use frugal::model::moe::{Gating, Mlp, Route, route};
use frugal::model::{Ffn, Logits, Model, MoeConfig, Observer, RoutingStats, Scratch, Site};
use frugal::quant::Matrix;
use frugal::quant::{GgmlType, dequantize_to_vec, quantize_f32};
use rayon::prelude::*;

use crate::error::{Result, TrainError};
use crate::gemm::Precision;
use crate::moe::route_backward;
use crate::ops::{gated_forward, linear_backward, linear_forward};
use crate::optim::{AdamW, AdamWConfig, Schedule};
use crate::params::Tensor;

/// How the routers are kept balanced while they train.
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "kind", content = "rate", rename_all = "lowercase")]
pub enum Balance {
    None,
    /// The Switch auxiliary loss, with its weight α.
    Aux(f32),
    /// The selection bias, with its step γ.
    Bias(f32),
}

impl std::str::FromStr for Balance {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let rate = |v: &str, what: &str| -> std::result::Result<f32, String> {
            match v.parse::<f32>() {
                Ok(r) if r.is_finite() && r > 0.0 => Ok(r),
                _ => Err(format!(
                    "{what} {v:?}: a positive number, as aux:0.01 or bias:0.001"
                )),
            }
        };
        match s.split_once(':') {
            None if s == "none" => Ok(Balance::None),
            Some(("aux", v)) => Ok(Balance::Aux(rate(v, "the auxiliary loss weight")?)),
            Some(("bias", v)) => Ok(Balance::Bias(rate(v, "the bias step")?)),
            _ => Err(format!(
                "unknown balancing {s:?}: use none, aux:ALPHA (Switch loss) or bias:GAMMA \
                 (DeepSeek's selection bias)"
            )),
        }
    }
}

impl std::fmt::Display for Balance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Balance::None => write!(f, "none"),
            Balance::Aux(a) => write!(f, "aux:{a}"),
            Balance::Bias(g) => write!(f, "bias:{g}"),
        }
    }
}

/// The optimizer settings of a router run.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    pub balance: Balance,
    pub lr: f32,
    /// Updates the run takes (for the learning-rate schedule).
    pub steps: usize,
    pub warmup: usize,
    /// Weight of the reconstruction term against the selection cross-entropy (0: the
    /// router learns only which experts to choose).
    pub recon: f32,
}

/// The precision of the experts' and the teacher's products: bf16 inputs, f32 sums (the
/// training engine's mixed precision, on AMX where the CPU has it). Every expert runs on every
/// token each step, which in f32 took 80% of a step; the products only supply targets and
/// outputs to compare, never weights that are written back. The router's own products stay
/// f32.
const EXPERT_PRECISION: Precision = Precision::Bf16;

/// One gated FFN block in f32, matrices as GGUF stores them (`out x in`), with the family's
/// gate nonlinearity.
struct F32Mlp {
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
    n_ff: usize,
    act: FfnAct,
}

fn decode(l: &Matrix, file: &GgufFile) -> Result<Vec<f32>> {
    let bytes = &file.raw_bytes()[l.file_range()];
    dequantize_to_vec(l.ty, bytes, l.rows * l.cols)
        .map_err(|e| TrainError::Invalid(format!("{}: {e}", l.name)))
}

impl F32Mlp {
    fn new(m: &Mlp, file: &GgufFile, act: FfnAct) -> Result<Self> {
        Ok(F32Mlp {
            gate: decode(&m.gate, file)?,
            up: decode(&m.up, file)?,
            down: decode(&m.down, file)?,
            n_ff: m.gate.rows,
            act,
        })
    }

    /// `down(act(gate x) * up x)` for the rows of `x` (`n x d`), into `out` (`n x d`), with
    /// products in [`EXPERT_PRECISION`].
    fn forward(&self, x: &[f32], d: usize, out: &mut [f32]) {
        let n = x.len() / d;
        let p = EXPERT_PRECISION;
        let mut g = vec![0f32; n * self.n_ff];
        let mut u = vec![0f32; n * self.n_ff];
        linear_forward(x, &self.gate, d, &mut g, p);
        linear_forward(x, &self.up, d, &mut u, p);
        let mut h = vec![0f32; n * self.n_ff];
        gated_forward(self.act, &g, &u, &mut h);
        linear_forward(&h, &self.down, self.n_ff, out, p);
    }
}

/// One routed layer: frozen experts, the router being trained, the selection bias.
struct RoutedLayer {
    experts: Vec<F32Mlp>,
    shared: Option<F32Mlp>,
    /// Selection bias: the file's, or zeros under `bias:γ`; `None` when neither.
    bias: Option<Vec<f32>>,
}

/// A step's loss for one layer, summed over its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MixtureLoss {
    /// `|y_t − τ_t|² / |τ_t|²` averaged over tokens: the share of the dense output missed.
    pub rel_err: f64,
    /// The selection cross-entropy, averaged over tokens.
    pub ce: f64,
    /// The auxiliary balancing loss (0 without it).
    pub aux: f64,
}

/// The loss of `B` routed tokens of one layer and its gradient with respect to the router
/// logits (written to `dlogits`, `B x E`). `probs` (`B x E`) and `routes` are what [`route`]
/// gave; `slots` (`B x k x d`) each chosen expert's output in selection order; `base`
/// (`B x d`, or empty) what the layer adds whatever the routing (the shared expert); `target`
/// (`B x d`) the dense FFN's output; `oracle` (`B x k`, or empty) each token's best experts.
/// The loss is `recon` times `|y_t − τ_t|² / |τ_t|²` averaged over tokens (the returned
/// `rel_err` is without the factor), plus the selection cross-entropy averaged over
/// tokens, plus the auxiliary loss when `aux` gives its weight.
#[allow(clippy::too_many_arguments)]
pub fn mixture_backward(
    m: &MoeConfig,
    probs: &[f32],
    routes: &[Route],
    slots: &[f32],
    base: &[f32],
    target: &[f32],
    oracle: &[u32],
    recon: f32,
    aux: Option<f32>,
    dlogits: &mut [f32],
) -> MixtureLoss {
    let e = m.n_expert;
    let k = m.n_used;
    let b = routes.len();
    let d = target.len() / b.max(1);
    // Each expert's share of this step's routed slots (`f_i`, held constant).
    let mut share = vec![0f32; e];
    for r in routes {
        for &x in &r.experts {
            share[x as usize] += 1.0 / (b * k) as f32;
        }
    }
    let per: Vec<(f64, f64)> = dlogits
        .par_chunks_mut(e)
        .enumerate()
        .map(|(t, dl)| {
            let r = &routes[t];
            let p = &probs[t * e..(t + 1) * e];
            let tau = &target[t * d..(t + 1) * d];
            let mut y: Vec<f32> = if base.is_empty() {
                vec![0.0; d]
            } else {
                base[t * d..(t + 1) * d].to_vec()
            };
            for (slot, &w) in r.weights.iter().enumerate() {
                let o = &slots[(t * k + slot) * d..][..d];
                y.iter_mut().zip(o).for_each(|(y, &o)| *y += w * o);
            }
            let mut sq = 0f64;
            let mut tsq = 0f64;
            for (&yi, &ti) in y.iter().zip(tau) {
                sq += f64::from(yi - ti).powi(2);
                tsq += f64::from(ti).powi(2);
            }
            // ∂/∂w for each slot, then ∂/∂p.
            let tsq = tsq.max(f64::MIN_POSITIVE);
            let c = (2.0 * f64::from(recon) / (tsq * b as f64)) as f32;
            let g: Vec<f32> = (0..r.experts.len())
                .map(|slot| {
                    let o = &slots[(t * k + slot) * d..][..d];
                    c * y
                        .iter()
                        .zip(tau)
                        .zip(o)
                        .map(|((&yi, &ti), &oi)| (yi - ti) * oi)
                        .sum::<f32>()
                })
                .collect();
            let extra: Option<Vec<f32>> = aux.map(|alpha| {
                (0..e)
                    .map(|i| alpha * e as f32 * share[i] / b as f32)
                    .collect()
            });
            route_backward(m, p, r, &g, extra.as_deref(), dl);
            // The selection: `p − q` (softmax) or per-expert `p − y` (sigmoid), over `B`.
            let mut ce = 0f64;
            if !oracle.is_empty() {
                let o = &oracle[t * k..(t + 1) * k];
                let inv_b = 1.0 / b as f32;
                let tiny = 1e-30f64;
                match m.gating {
                    Gating::Softmax => {
                        for i in 0..e {
                            let q = if o.contains(&(i as u32)) {
                                1.0 / k as f32
                            } else {
                                0.0
                            };
                            dl[i] += inv_b * (p[i] - q);
                            if q > 0.0 {
                                ce -= f64::from(q) * f64::from(p[i]).max(tiny).ln();
                            }
                        }
                    }
                    Gating::Sigmoid => {
                        for i in 0..e {
                            let y = if o.contains(&(i as u32)) { 1.0 } else { 0.0 };
                            dl[i] += inv_b * (p[i] - y);
                            let pi = f64::from(p[i]);
                            ce -= if y > 0.0 {
                                pi.max(tiny).ln()
                            } else {
                                (1.0 - pi).max(tiny).ln()
                            };
                        }
                    }
                }
            }
            (sq / tsq, ce)
        })
        .collect();
    let aux_loss = aux.map_or(0.0, |alpha| {
        (0..e)
            .map(|i| {
                let mean_p: f64 =
                    (0..b).map(|t| f64::from(probs[t * e + i])).sum::<f64>() / b.max(1) as f64;
                f64::from(alpha) * e as f64 * f64::from(share[i]) * mean_p
            })
            .sum()
    });
    MixtureLoss {
        rel_err: per.iter().map(|p| p.0).sum::<f64>() / b.max(1) as f64,
        ce: per.iter().map(|p| p.1).sum::<f64>() / b.max(1) as f64,
        aux: aux_loss,
    }
}

/// Each token's `k` best experts (`B x k`): the largest gains `2⟨τ − base, u_i⟩ − |u_i|²`,
/// `u_i` expert `i`'s output (`table`, `E x B x d`) at the uniform weight `s / k`.
pub fn oracle_sets(
    m: &MoeConfig,
    d: usize,
    table: &[f32],
    base: &[f32],
    target: &[f32],
) -> Vec<u32> {
    let (e, k) = (m.n_expert, m.n_used);
    let b = target.len() / d;
    let w = m.weights_scale / k as f32;
    let mut out = vec![0u32; b * k];
    out.par_chunks_mut(k).enumerate().for_each(|(t, o)| {
        let tau = &target[t * d..(t + 1) * d];
        let gap: Vec<f32> = if base.is_empty() {
            tau.to_vec()
        } else {
            tau.iter()
                .zip(&base[t * d..(t + 1) * d])
                .map(|(a, b)| a - b)
                .collect()
        };
        let mut gains: Vec<(f32, u32)> = (0..e)
            .map(|i| {
                let u = &table[(i * b + t) * d..][..d];
                let g: f32 = gap
                    .iter()
                    .zip(u)
                    .map(|(&g, &u)| 2.0 * g * w * u - (w * u) * (w * u))
                    .sum();
                (g, i as u32)
            })
            .collect();
        gains.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for (dst, g) in o.iter_mut().zip(&gains) {
            *dst = g.1;
        }
    });
    out
}

/// What one update did, over all layers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepReport {
    pub step: usize,
    pub lr: f32,
    /// `|y − τ|² / |τ|²`, mean over the step's tokens and the layers: the share of the dense
    /// FFNs' output the routed layers miss.
    pub rel_err: f64,
    /// The selection cross-entropy, mean over layers.
    pub ce: f64,
    /// Share of the chosen experts that are in their token's oracle set, over all layers.
    pub oracle_hit: f64,
    /// The auxiliary loss, summed over layers.
    pub aux: f64,
    /// Load coefficient of variation, mean over layers.
    pub cv: f64,
    /// The busiest expert's load over the mean load: mean over layers, and the worst layer.
    pub max_over_mean: f64,
    pub worst_max_over_mean: f64,
    /// Mean routing entropy (nats), mean over layers.
    pub entropy: f64,
}

/// The routers of a MoE model being trained.
pub struct RouterTrainer {
    moe: MoeConfig,
    d: usize,
    layers: Vec<RoutedLayer>,
    /// One `E x d` router per layer, and their gradients.
    routers: Vec<Tensor>,
    grads: Vec<Tensor>,
    adam: AdamW,
    schedule: Schedule,
    balance: Balance,
    recon: f32,
    step: usize,
}

impl RouterTrainer {
    /// Decodes `student`'s experts and routers to f32; fails for a dense model.
    pub fn new(student: &Model, cfg: &RouterConfig) -> Result<Self> {
        let c = &student.config;
        let moe = c
            .moe
            .ok_or_else(|| TrainError::Invalid("the model has no routed layers to train".into()))?;
        let mut layers = Vec::new();
        let mut routers = Vec::new();
        for (l, lw) in student.weights.layers.iter().enumerate() {
            let Ffn::Experts(x) = &lw.ffn else {
                return Err(TrainError::Invalid(format!("layer {l} is dense")));
            };
            let mut r = Tensor::matrix(
                format!("blk.{l}.ffn_gate_inp.weight"),
                moe.n_expert,
                c.n_embd,
            );
            r.data = decode(&x.router, &student.file)?;
            routers.push(r);
            let bias = match (&x.selection_bias, cfg.balance) {
                (Some(b), _) => Some(b.clone()),
                (None, Balance::Bias(_)) => Some(vec![0.0; moe.n_expert]),
                (None, _) => None,
            };
            layers.push(RoutedLayer {
                experts: x
                    .experts
                    .iter()
                    .map(|m| F32Mlp::new(m, &student.file, c.features.ffn_act))
                    .collect::<Result<_>>()?,
                shared: x
                    .shared
                    .as_ref()
                    .map(|m| F32Mlp::new(m, &student.file, c.features.ffn_act))
                    .transpose()?,
                bias,
            });
        }
        let grads = routers.iter().map(Tensor::zeros_like).collect();
        let adam = AdamW::new(
            AdamWConfig {
                weight_decay: 0.0,
                ..AdamWConfig::default()
            },
            routers.iter().map(|r| r.data.len()),
        );
        Ok(RouterTrainer {
            moe,
            d: c.n_embd,
            layers,
            routers,
            grads,
            adam,
            schedule: Schedule {
                lr: cfg.lr,
                warmup: cfg.warmup,
                total: cfg.steps,
                min_ratio: 0.1,
            },
            balance: cfg.balance,
            recon: cfg.recon,
            step: 0,
        })
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// One update of every router from a step's teacher activations: `inputs[l]` and
    /// `targets[l]` the FFN inputs and outputs of layer `l` (`B x d` each).
    pub fn step(&mut self, inputs: &[Vec<f32>], targets: &[Vec<f32>]) -> Result<StepReport> {
        let (m, d) = (self.moe, self.d);
        let (e, k) = (m.n_expert, m.n_used);
        let mut stats = RoutingStats::new(self.layers.len(), e);
        let mut rel = 0f64;
        let mut aux = 0f64;
        let mut ce = 0f64;
        let (mut hits, mut slots_total) = (0usize, 0usize);
        let alpha = match self.balance {
            Balance::Aux(a) => Some(a),
            _ => None,
        };
        let n_layers = self.layers.len();
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let (x, tau) = (&inputs[l], &targets[l]);
            if x.len() != tau.len() || !x.len().is_multiple_of(d) || x.is_empty() {
                return Err(TrainError::Shape(format!(
                    "layer {l}: {} inputs and {} targets for width {d}",
                    x.len(),
                    tau.len()
                )));
            }
            let b = x.len() / d;
            let mut logits = vec![0f32; b * e];
            linear_forward(x, &self.routers[l].data, d, &mut logits, Precision::F32);
            let mut probs = vec![0f32; b * e];
            let mut routes = vec![Route::default(); b];
            let mut p = Vec::new();
            for t in 0..b {
                route(
                    &m,
                    &logits[t * e..(t + 1) * e],
                    layer.bias.as_deref(),
                    &mut p,
                    &mut routes[t],
                );
                probs[t * e..(t + 1) * e].copy_from_slice(&p);
                stats.record(l, &routes[t], &p);
            }
            // Every expert on every row (the oracle needs them all), then the chosen ones'.
            let mut table = vec![0f32; e * b * d];
            for (ex, out) in layer.experts.iter().zip(table.chunks_exact_mut(b * d)) {
                ex.forward(x, d, out);
            }
            let mut slots = vec![0f32; b * k * d];
            for (t, r) in routes.iter().enumerate() {
                for (slot, &ex) in r.experts.iter().enumerate() {
                    slots[(t * k + slot) * d..][..d]
                        .copy_from_slice(&table[(ex as usize * b + t) * d..][..d]);
                }
            }
            let mut base = Vec::new();
            if let Some(sh) = &layer.shared {
                base = vec![0f32; b * d];
                sh.forward(x, d, &mut base);
            }
            let oracle = oracle_sets(&m, d, &table, &base, tau);
            for (r, o) in routes.iter().zip(oracle.chunks_exact(k)) {
                hits += r.experts.iter().filter(|x| o.contains(x)).count();
            }
            slots_total += b * k;
            let mut dlogits = vec![0f32; b * e];
            let loss = mixture_backward(
                &m,
                &probs,
                &routes,
                &slots,
                &base,
                tau,
                &oracle,
                self.recon,
                alpha,
                &mut dlogits,
            );
            if !(loss.rel_err.is_finite() && dlogits.iter().all(|g| g.is_finite())) {
                return Err(TrainError::NonFinite {
                    step: self.step,
                    what: "the router loss".into(),
                    tensor: self.routers[l].name.clone(),
                });
            }
            rel += loss.rel_err / n_layers as f64;
            ce += loss.ce / n_layers as f64;
            aux += loss.aux;
            let g = &mut self.grads[l].data;
            g.fill(0.0);
            linear_backward(
                x,
                &self.routers[l].data,
                &dlogits,
                None,
                Some(g),
                d,
                Precision::F32,
            );
            if let (Balance::Bias(gamma), Some(bias)) = (self.balance, &mut layer.bias) {
                let mean = (b * k) as f64 / e as f64;
                for (bi, &load) in bias.iter_mut().zip(&stats.load[l]) {
                    // Up when under the mean load, down when over, still when at it.
                    match (load as f64).total_cmp(&mean) {
                        std::cmp::Ordering::Less => *bi += gamma,
                        std::cmp::Ordering::Greater => *bi -= gamma,
                        std::cmp::Ordering::Equal => {}
                    }
                }
            }
        }
        let lr = self.schedule.lr_at(self.step);
        let mut params: Vec<&mut Tensor> = self.routers.iter_mut().collect();
        let grads: Vec<&Tensor> = self.grads.iter().collect();
        let trainable = vec![true; grads.len()];
        self.adam.update(&mut params, &grads, &trainable, lr);
        let summaries: Vec<_> = (0..self.layers.len())
            .filter_map(|l| stats.layer(l))
            .collect();
        let n = summaries.len().max(1) as f64;
        let report = StepReport {
            step: self.step,
            lr,
            rel_err: rel,
            ce,
            oracle_hit: hits as f64 / slots_total.max(1) as f64,
            aux,
            cv: summaries.iter().map(|s| s.cv).sum::<f64>() / n,
            max_over_mean: summaries.iter().map(|s| s.max_over_mean).sum::<f64>() / n,
            worst_max_over_mean: summaries
                .iter()
                .map(|s| s.max_over_mean)
                .fold(0.0, f64::max),
            entropy: summaries.iter().map(|s| s.entropy).sum::<f64>() / n,
        };
        self.step += 1;
        Ok(report)
    }

    /// `student_file` with the trained routers (F32) and, where there is one, the selection
    /// bias, with `frugal.train.*` metadata saying how they were trained.
    pub fn to_gguf<'a>(&self, student_file: &'a GgufFile, tokens: u64) -> GgufWriter<'a> {
        let mut w = GgufWriter::from_file(student_file);
        for (l, (r, layer)) in self.routers.iter().zip(&self.layers).enumerate() {
            let mut new = vec![TensorData {
                name: r.name.clone(),
                dims: vec![self.d as u64, self.moe.n_expert as u64],
                ty: GgmlType::F32,
                data: quantize_f32(&r.data).into(),
            }];
            if let Some(b) = &layer.bias {
                new.push(TensorData {
                    name: format!("blk.{l}.exp_probs_b.bias"),
                    dims: vec![self.moe.n_expert as u64],
                    ty: GgmlType::F32,
                    data: quantize_f32(b).into(),
                });
            }
            for t in new {
                match w.tensors.iter().position(|x| x.name == t.name) {
                    Some(i) => w.tensors[i] = t,
                    None => {
                        // After the layer's router, as llama.cpp's converters order them.
                        let at = w
                            .tensors
                            .iter()
                            .position(|x| x.name == r.name)
                            .map_or(w.tensors.len(), |i| i + 1);
                        w.tensors.insert(at, t);
                    }
                }
            }
        }
        w.set("frugal.train.mode", Value::String("router".into()));
        w.set(
            "frugal.train.balance",
            Value::String(self.balance.to_string()),
        );
        w.set("frugal.train.tokens", Value::U64(tokens));
        w
    }
}

/// The dense teacher's FFN inputs and outputs at every layer, for one step's windows.
pub struct TeacherActivations {
    /// `[layer]`: `B x d` FFN inputs.
    pub inputs: Vec<Vec<f32>>,
    /// `[layer]`: `B x d` FFN outputs.
    pub targets: Vec<Vec<f32>>,
}

/// The dense teacher, with its down projections in f32 to turn the observed SwiGLU products
/// into FFN outputs.
pub struct Teacher<'m> {
    model: &'m Model,
    downs: Vec<Vec<f32>>,
}

struct Capture<'a> {
    downs: &'a [Vec<f32>],
    d: usize,
    acts: TeacherActivations,
}

impl Observer for Capture<'_> {
    fn observe(&mut self, layer: usize, site: Site, x: &[f32], width: usize) {
        match site {
            Site::FfnInput => self.acts.inputs[layer].extend_from_slice(x),
            Site::FfnDownInput => {
                let mut y = vec![0f32; x.len() / width * self.d];
                linear_forward(x, &self.downs[layer], width, &mut y, EXPERT_PRECISION);
                self.acts.targets[layer].extend_from_slice(&y);
            }
            _ => {}
        }
    }
}

impl<'m> Teacher<'m> {
    /// Checks that `teacher` is dense and shaped as `student`, and decodes its down
    /// projections.
    pub fn new(teacher: &'m Model, student: &Model) -> Result<Self> {
        let (t, s) = (&teacher.config, &student.config);
        if t.moe.is_some() {
            return Err(TrainError::Invalid(
                "the teacher must be the dense model the experts came from".into(),
            ));
        }
        if (t.n_layers, t.n_embd, t.n_vocab) != (s.n_layers, s.n_embd, s.n_vocab) {
            return Err(TrainError::Shape(format!(
                "teacher {} layers of width {} over {} tokens, student {} of {} over {}",
                t.n_layers, t.n_embd, t.n_vocab, s.n_layers, s.n_embd, s.n_vocab
            )));
        }
        let downs = teacher
            .weights
            .layers
            .iter()
            .map(|lw| match &lw.ffn {
                Ffn::Dense(m) => decode(&m.down, &teacher.file),
                Ffn::Experts(_) => unreachable!("checked dense"),
            })
            .collect::<Result<_>>()?;
        Ok(Teacher {
            model: teacher,
            downs,
        })
    }

    /// Runs `windows` through the teacher, each from an empty cache, keeping every layer's FFN
    /// input and output.
    pub fn activations(&self, windows: &[&[u32]]) -> Result<TeacherActivations> {
        let c = &self.model.config;
        let mut cap = Capture {
            downs: &self.downs,
            d: c.n_embd,
            acts: TeacherActivations {
                inputs: vec![Vec::new(); c.n_layers],
                targets: vec![Vec::new(); c.n_layers],
            },
        };
        let ctx = windows.iter().map(|w| w.len()).max().unwrap_or(0);
        let mut kv = self
            .model
            .new_seq_cache(ctx.max(1), &frugal::kv::KvOptions::default())?;
        let mut s = Scratch::default();
        for w in windows {
            kv.clear();
            self.model
                .forward_observed(w, &mut kv, &mut s, Logits::Last, Some(&mut cap))?;
        }
        Ok(cap.acts)
    }
}

#[cfg(test)]
mod tests;
