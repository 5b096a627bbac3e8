//! The training forward and backward of a routed (mixture-of-experts) feed-forward block, so the
//! whole-model loop (distillation, fine-tuning) trains a MoE file's experts and routers together.
//!
//! The forward is the inference engine's (`frugal::model::moe`): router logits `l = R x` in
//! f32, probabilities by softmax or sigmoid, the top-k by probability plus the selection bias,
//! weights `w = s p_S / Σ_S p` (or `s p_S` unnormalized), and `y = Σ_S w_i E_i(x) + shared(x)`.
//! Tokens are grouped by expert, so each expert's matrices are one product over its tokens.
//!
//! The backward:
//! - through each chosen expert with its weight: `dE_i = w_i dy`, then the gated FFN's
//!   backward (SwiGLU, or GeGLU for a GELU family);
//! - into the router through the weights only: `g_i = dy · E_i(x)` per chosen slot, then the
//!   renormalization and the gating (`route_backward`). The choice itself is a step function
//!   without a gradient, so an expert outside a token's top-k gets no gradient from that token
//!   (under renormalization the chosen ones trade weight among themselves); which experts a
//!   token takes moves only as the logits do. That is the standard MoE gradient (Switch,
//!   Mixtral); `router.rs` adds a selection term for the router-only stage.
//!
//! The selection bias (`exp_probs_b.bias`) is a constant here: the trainer never moves it.

use frugal::model::MoeConfig;
use frugal::model::features::FfnAct;
use frugal::model::moe::{Gating, Route, route};
use frugal::ops::zeroed;

use crate::gemm::Precision;
use crate::ops;
use crate::params::{Stored, Tensor};

/// A plain gated block's matrices: `down(act(gate x) * up x)`.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseFfn {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

impl DenseFfn {
    /// Zero matrices `ffn_{gate,up,down}{suffix}` of block `l`, `ff` neurons wide.
    pub fn zeros(l: usize, suffix: &str, d: usize, ff: usize) -> Self {
        let n = |s: &str| format!("blk.{l}.{s}{suffix}.weight");
        DenseFfn {
            gate: Tensor::matrix(n("ffn_gate"), ff, d),
            up: Tensor::matrix(n("ffn_up"), ff, d),
            down: Tensor::matrix(n("ffn_down"), d, ff),
        }
    }

    pub fn tensors(&self) -> [&Tensor; 3] {
        [&self.gate, &self.up, &self.down]
    }

    pub fn tensors_mut(&mut self) -> [&mut Tensor; 3] {
        [&mut self.gate, &mut self.up, &mut self.down]
    }
}

/// A routed block: the router, the experts stacked as llama.cpp stores them (expert `e`'s
/// matrix is the `e`-th block of rows), an optional shared expert and selection bias.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutedFfn {
    /// `ffn_gate_inp`: `n_expert x n_embd`.
    pub router: Tensor,
    /// `ffn_gate_exps`, `ffn_up_exps`: `(n_expert * n_ff) x n_embd`; `ffn_down_exps`:
    /// `(n_expert * n_embd) x n_ff`; each stored 3-D with the expert outermost.
    pub experts: DenseFfn,
    pub shared: Option<DenseFfn>,
    /// `exp_probs_b.bias`, used for selection only and never trained.
    pub selection_bias: Option<Tensor>,
}

/// The name ending of the selection-bias tensor, which the trainer keeps frozen.
pub const SELECTION_BIAS: &str = "exp_probs_b.bias";

impl RoutedFfn {
    /// Zero tensors of block `l` for `m`'s routing, experts `ff` neurons wide.
    pub fn zeros(m: &MoeConfig, l: usize, d: usize, ff: usize) -> Self {
        let e = m.n_expert;
        let mut experts = DenseFfn {
            gate: Tensor::matrix(format!("blk.{l}.ffn_gate_exps.weight"), e * ff, d),
            up: Tensor::matrix(format!("blk.{l}.ffn_up_exps.weight"), e * ff, d),
            down: Tensor::matrix(format!("blk.{l}.ffn_down_exps.weight"), e * d, ff),
        };
        for t in experts.tensors_mut() {
            t.stored = Stored::Heads { heads: e };
        }
        RoutedFfn {
            router: Tensor::matrix(format!("blk.{l}.ffn_gate_inp.weight"), e, d),
            experts,
            shared: (m.n_ff_shared > 0).then(|| DenseFfn::zeros(l, "_shexp", d, m.n_ff_shared)),
            selection_bias: None,
        }
    }

    /// The file's order: router, experts, shared expert, bias.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.router];
        v.extend(self.experts.tensors());
        if let Some(s) = &self.shared {
            v.extend(s.tensors());
        }
        v.extend(self.selection_bias.as_ref());
        v
    }

    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.router];
        v.extend(self.experts.tensors_mut());
        if let Some(s) = &mut self.shared {
            v.extend(s.tensors_mut());
        }
        v.extend(self.selection_bias.as_mut());
        v
    }
}

/// One SwiGLU block's activations over its rows.
#[derive(Default, Debug)]
pub struct SwigluActs {
    g: Vec<f32>,
    u: Vec<f32>,
    h: Vec<f32>,
}

impl SwigluActs {
    fn bytes(&self) -> usize {
        4 * (self.g.capacity() + self.u.capacity() + self.h.capacity())
    }
}

/// `out = down(act(gate x) * up x)` over the rows of `x`, keeping the activations.
#[allow(clippy::too_many_arguments)]
fn mlp_forward(
    x: &[f32],
    (gate, up, down): (&[f32], &[f32], &[f32]),
    d: usize,
    (ff, act): (usize, FfnAct),
    a: &mut SwigluActs,
    out: &mut [f32],
    prec: Precision,
) {
    let n = x.len() / d;
    ops::linear_forward(x, gate, d, zeroed(&mut a.g, n * ff), prec);
    ops::linear_forward(x, up, d, zeroed(&mut a.u, n * ff), prec);
    ops::gated_forward(act, &a.g, &a.u, zeroed(&mut a.h, n * ff));
    ops::linear_forward(&a.h, down, ff, out, prec);
}

/// Backward of [`mlp_forward`]: `dx (+)= ...` (added when `accumulate`), weight gradients
/// added into `grads`.
#[allow(clippy::too_many_arguments)]
fn mlp_backward(
    x: &[f32],
    (gate, up, down): (&[f32], &[f32], &[f32]),
    d: usize,
    (ff, act): (usize, FfnAct),
    a: &SwigluActs,
    dy: &[f32],
    dx: (&mut [f32], bool),
    grads: (&mut [f32], &mut [f32], &mut [f32]),
    prec: Precision,
) {
    let n = x.len() / d;
    let mut dh = vec![0f32; n * ff];
    ops::linear_backward(
        &a.h,
        down,
        dy,
        Some((&mut dh, false)),
        Some(grads.2),
        ff,
        prec,
    );
    let (mut dg, mut du) = (vec![0f32; n * ff], vec![0f32; n * ff]);
    ops::gated_backward(act, &a.g, &a.u, &dh, &mut dg, &mut du);
    drop(dh);
    let (dx, accumulate) = dx;
    ops::linear_backward(x, gate, &dg, Some((dx, accumulate)), Some(grads.0), d, prec);
    ops::linear_backward(x, up, &du, Some((dx, true)), Some(grads.1), d, prec);
}

/// What a routed block's backward reads.
#[derive(Default, Debug)]
pub struct MoeActs {
    /// Router probabilities, `n x n_expert`.
    probs: Vec<f32>,
    routes: Vec<Route>,
    /// Per expert, the (token, slot) pairs it serves, in token order.
    members: Vec<Vec<(u32, u32)>>,
    /// Per expert, its activations over its tokens and its outputs (`tokens x d`).
    experts: Vec<SwigluActs>,
    outputs: Vec<Vec<f32>>,
    shared: SwigluActs,
}

impl MoeActs {
    pub fn bytes(&self) -> usize {
        let outs: usize = self.outputs.iter().map(Vec::capacity).sum();
        let members: usize = self.members.iter().map(Vec::capacity).sum();
        4 * (self.probs.capacity() + outs)
            + 8 * members
            + self.experts.iter().map(SwigluActs::bytes).sum::<usize>()
            + self.shared.bytes()
    }

    /// Tokens routed to each expert in the last forward.
    pub fn load(&self) -> Vec<usize> {
        self.members.iter().map(Vec::len).collect()
    }
}

/// Rows `members` of `x` (`? x d`), gathered into one matrix.
fn gather(x: &[f32], d: usize, members: &[(u32, u32)]) -> Vec<f32> {
    let mut out = Vec::with_capacity(members.len() * d);
    for &(t, _) in members {
        let t = t as usize;
        out.extend_from_slice(&x[t * d..(t + 1) * d]);
    }
    out
}

/// Expert `e`'s three matrices inside the stacked tensors of `n` experts.
fn expert(ffn: &DenseFfn, e: usize, n: usize) -> (&[f32], &[f32], &[f32]) {
    let (g, u, dn) = (&ffn.gate.data, &ffn.up.data, &ffn.down.data);
    let (sg, sd) = (g.len() / n, dn.len() / n);
    (
        &g[e * sg..(e + 1) * sg],
        &u[e * sg..(e + 1) * sg],
        &dn[e * sd..(e + 1) * sd],
    )
}

fn expert_mut(ffn: &mut DenseFfn, e: usize, n: usize) -> (&mut [f32], &mut [f32], &mut [f32]) {
    let (sg, sd) = (ffn.gate.data.len() / n, ffn.down.data.len() / n);
    (
        &mut ffn.gate.data[e * sg..(e + 1) * sg],
        &mut ffn.up.data[e * sg..(e + 1) * sg],
        &mut ffn.down.data[e * sd..(e + 1) * sd],
    )
}

fn dense(ffn: &DenseFfn) -> (&[f32], &[f32], &[f32]) {
    (&ffn.gate.data, &ffn.up.data, &ffn.down.data)
}

/// The routed block over the rows of `x` (`n x d`, the normalized FFN input): writes `out`
/// (`n x d`) and keeps what [`routed_backward`] needs. Router products in f32 (a choice must
/// not flip with the precision of the products), experts in `prec`.
#[allow(clippy::too_many_arguments)]
pub fn routed_forward(
    m: &MoeConfig,
    p: &RoutedFfn,
    x: &[f32],
    d: usize,
    (ff, act): (usize, FfnAct),
    a: &mut MoeActs,
    out: &mut [f32],
    prec: Precision,
) {
    let (n, ne) = (x.len() / d, m.n_expert);
    let mut logits = vec![0f32; n * ne];
    ops::linear_forward(x, &p.router.data, d, &mut logits, Precision::F32);
    let bias = p.selection_bias.as_ref().map(|b| &b.data[..]);
    a.probs.clear();
    a.routes.resize_with(n, Route::default);
    a.members = vec![Vec::new(); ne];
    let mut probs = Vec::with_capacity(ne);
    for (t, l) in logits.chunks_exact(ne).enumerate() {
        route(m, l, bias, &mut probs, &mut a.routes[t]);
        a.probs.extend_from_slice(&probs);
        for (slot, &e) in a.routes[t].experts.iter().enumerate() {
            a.members[e as usize].push((t as u32, slot as u32));
        }
    }
    match &p.shared {
        Some(s) => mlp_forward(
            x,
            dense(s),
            d,
            (m.n_ff_shared, act),
            &mut a.shared,
            out,
            prec,
        ),
        None => out.fill(0.0),
    }
    a.experts.resize_with(ne, SwigluActs::default);
    a.outputs.resize_with(ne, Vec::new);
    for e in 0..ne {
        let rows = a.members[e].len();
        if rows == 0 {
            a.outputs[e].clear();
            continue;
        }
        let xe = gather(x, d, &a.members[e]);
        let mut ye = vec![0f32; rows * d];
        mlp_forward(
            &xe,
            expert(&p.experts, e, ne),
            d,
            (ff, act),
            &mut a.experts[e],
            &mut ye,
            prec,
        );
        a.outputs[e] = ye;
    }
    // Each token sums its experts in selection order (as the inference engine does), so the
    // result does not depend on how tokens were grouped.
    let mut row_of = vec![0u32; n * m.n_used];
    for members in &a.members {
        for (i, &(t, slot)) in members.iter().enumerate() {
            row_of[t as usize * m.n_used + slot as usize] = i as u32;
        }
    }
    for (t, o) in out.chunks_exact_mut(d).enumerate() {
        let r = &a.routes[t];
        for (slot, (&e, &w)) in r.experts.iter().zip(&r.weights).enumerate() {
            let i = row_of[t * m.n_used + slot] as usize;
            let y = &a.outputs[e as usize][i * d..(i + 1) * d];
            o.iter_mut().zip(y).for_each(|(o, &y)| *o += w * y);
        }
    }
}

/// Backward of [`routed_forward`]: `dy` is the gradient at the block's output; writes the
/// gradient at its input into `dx` (overwritten) and adds the parameter gradients into `g`.
/// With `aux > 0` the Switch balancing loss `aux E Σ_i f_i P_i` of these `n` tokens adds
/// `aux E f_i / n` to every token's `∂/∂p_i` ([`aux_loss`] gives its value): `f_i` the share of
/// the routed slots expert `i` took, held constant as in the paper, `P_i` its mean probability.
#[allow(clippy::too_many_arguments)]
pub fn routed_backward(
    m: &MoeConfig,
    p: &RoutedFfn,
    (x, d, ff, act): (&[f32], usize, usize, FfnAct),
    a: &MoeActs,
    dy: &[f32],
    dx: &mut [f32],
    g: &mut RoutedFfn,
    (prec, aux): (Precision, f32),
) {
    let (n, ne, k) = (x.len() / d, m.n_expert, m.n_used);
    match (&p.shared, &mut g.shared) {
        (Some(s), Some(gs)) => {
            let [gg, gu, gd] = gs.tensors_mut();
            mlp_backward(
                x,
                dense(s),
                d,
                (m.n_ff_shared, act),
                &a.shared,
                dy,
                (dx, false),
                (&mut gg.data, &mut gu.data, &mut gd.data),
                prec,
            );
        }
        _ => dx.fill(0.0),
    }
    // ∂/∂w per (token, slot): the output gradient against that expert's output.
    let mut dw = vec![0f32; n * k];
    for e in 0..ne {
        let members = &a.members[e];
        if members.is_empty() {
            continue;
        }
        let ye = &a.outputs[e];
        let mut dye = vec![0f32; members.len() * d];
        for (i, &(t, slot)) in members.iter().enumerate() {
            let (t, slot) = (t as usize, slot as usize);
            let dyt = &dy[t * d..(t + 1) * d];
            let yi = &ye[i * d..(i + 1) * d];
            dw[t * k + slot] = dyt.iter().zip(yi).map(|(a, b)| a * b).sum();
            let w = a.routes[t].weights[slot];
            dye[i * d..(i + 1) * d]
                .iter_mut()
                .zip(dyt)
                .for_each(|(o, &v)| *o = w * v);
        }
        let xe = gather(x, d, members);
        let mut dxe = vec![0f32; members.len() * d];
        mlp_backward(
            &xe,
            expert(&p.experts, e, ne),
            d,
            (ff, act),
            &a.experts[e],
            &dye,
            (&mut dxe, false),
            expert_mut(&mut g.experts, e, ne),
            prec,
        );
        for (i, &(t, _)) in members.iter().enumerate() {
            let t = t as usize;
            dx[t * d..(t + 1) * d]
                .iter_mut()
                .zip(&dxe[i * d..(i + 1) * d])
                .for_each(|(o, &v)| *o += v);
        }
    }
    let balance: Option<Vec<f32>> = (aux > 0.0).then(|| {
        let slots = (n * k).max(1) as f32;
        a.members
            .iter()
            .map(|mem| aux * ne as f32 * (mem.len() as f32 / slots) / n.max(1) as f32)
            .collect()
    });
    let mut dlogits = vec![0f32; n * ne];
    for (t, dl) in dlogits.chunks_exact_mut(ne).enumerate() {
        route_backward(
            m,
            &a.probs[t * ne..(t + 1) * ne],
            &a.routes[t],
            &dw[t * k..(t + 1) * k],
            balance.as_deref(),
            dl,
        );
    }
    ops::linear_backward(
        x,
        &p.router.data,
        &dlogits,
        Some((dx, true)),
        Some(&mut g.router.data),
        d,
        Precision::F32,
    );
}

/// The Switch balancing loss `aux E Σ_i f_i P_i` of the tokens of the last forward.
pub fn aux_loss(m: &MoeConfig, a: &MoeActs, aux: f32) -> f64 {
    let (ne, n) = (m.n_expert, a.routes.len());
    let slots = (n * m.n_used).max(1) as f64;
    (0..ne)
        .map(|i| {
            let f = a.members[i].len() as f64 / slots;
            let p: f64 =
                (0..n).map(|t| f64::from(a.probs[t * ne + i])).sum::<f64>() / n.max(1) as f64;
            f * p
        })
        .sum::<f64>()
        * f64::from(aux)
        * ne as f64
}

/// One token's gradient at its router logits (`dl`, overwritten) from the gradient at each
/// chosen slot's weight (`dw`, selection order): through the renormalization and scale, then
/// the gating. `extra`, when given, is added to `∂/∂p` first (a balancing loss's gradient).
pub fn route_backward(
    m: &MoeConfig,
    p: &[f32],
    r: &Route,
    dw: &[f32],
    extra: Option<&[f32]>,
    dl: &mut [f32],
) {
    let e = m.n_expert;
    let scale = m.weights_scale;
    let mut dp = vec![0f32; e];
    if m.norm_weights {
        let ps: f32 = r.experts.iter().map(|&x| p[x as usize]).sum();
        if ps > 0.0 {
            let wg: f32 = r.weights.iter().zip(dw).map(|(w, g)| w * g).sum();
            for (slot, &x) in r.experts.iter().enumerate() {
                dp[x as usize] = (scale * dw[slot] - wg) / ps;
            }
        }
    } else {
        for (slot, &x) in r.experts.iter().enumerate() {
            dp[x as usize] = scale * dw[slot];
        }
    }
    if let Some(extra) = extra {
        dp.iter_mut().zip(extra).for_each(|(a, &b)| *a += b);
    }
    match m.gating {
        Gating::Softmax => {
            let pdp: f32 = p.iter().zip(&dp).map(|(p, g)| p * g).sum();
            for i in 0..e {
                dl[i] = p[i] * (dp[i] - pdp);
            }
        }
        Gating::Sigmoid => {
            for i in 0..e {
                dl[i] = dp[i] * p[i] * (1.0 - p[i]);
            }
        }
    }
}
