//! One transformer block's training forward and backward, top to bottom, reading the same
//! `Config` switches as the inference forward (`frugal::model::Features`): attention biases,
//! per-head query/key norms, NeoX or interleaved RoPE (scaled as the inference tables are),
//! a sliding window and a query scale, norms after attention and after the FFN, and the FFN's
//! gate nonlinearity. Llama's block is the one with every switch off.

use frugal::ops::zeroed;
use rayon::prelude::*;

use crate::attention::{self, AttnDims};
use crate::gemm::Precision;
use crate::latent::{self, LatentActs, LatentDims, LatentGrads, LatentWeights};
use crate::moe::{self, MoeActs};
use crate::ops::{self, Rope};
use crate::params::{FfnParams, KvParams, LayerParams, Params, Tensor};

/// How one layer runs: its attention's shape (window, score scale), the RoPE table of its kind
/// of layer (Gemma 3's local layers have their own), the products' precision, and the weight
/// of a routed FFN's balancing loss in the backward.
#[derive(Clone, Copy)]
pub struct LayerRun<'a> {
    pub dims: AttnDims,
    pub rope: &'a Rope,
    pub prec: Precision,
    pub moe_aux: f32,
}

/// Everything one layer's backward reads.
#[derive(Default, Debug)]
pub struct LayerActs {
    xn1: Vec<f32>,
    rstd1: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Queries and keys before their per-head norms, and the norms' reciprocal RMS (empty
    /// without `qk_norm`).
    q_pre: Vec<f32>,
    k_pre: Vec<f32>,
    rstd_q: Vec<f32>,
    rstd_k: Vec<f32>,
    probs: Vec<f32>,
    att: Vec<f32>,
    /// Latent attention: the latent's activations, and the attention output without each
    /// head's value padding (the output projection's input).
    latent: LatentActs,
    att_v: Vec<f32>,
    /// The attention and FFN outputs before their post-norms, and those norms' reciprocal RMS
    /// (empty without `post_norms`).
    attn_pre: Vec<f32>,
    rstd_pa: Vec<f32>,
    ffn_pre: Vec<f32>,
    rstd_pf: Vec<f32>,
    x_mid: Vec<f32>,
    xn2: Vec<f32>,
    rstd2: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    h: Vec<f32>,
    /// A routed FFN's routing and per-expert activations (empty for a dense FFN).
    moe: MoeActs,
}

impl LayerActs {
    pub fn bytes(&self) -> usize {
        4 * [
            &self.xn1,
            &self.rstd1,
            &self.q,
            &self.k,
            &self.v,
            &self.q_pre,
            &self.k_pre,
            &self.rstd_q,
            &self.rstd_k,
            &self.probs,
            &self.att,
            &self.attn_pre,
            &self.rstd_pa,
            &self.ffn_pre,
            &self.rstd_pf,
            &self.x_mid,
            &self.xn2,
            &self.rstd2,
            &self.g,
            &self.u,
            &self.h,
            &self.att_v,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>()
            + self.latent.bytes()
            + self.moe.bytes()
    }

    /// The output projection's input: the heads' values.
    fn attn_out(&self) -> &[f32] {
        if self.att_v.is_empty() {
            &self.att
        } else {
            &self.att_v
        }
    }
}

/// RMSNorm of every `w.len()`-wide head of `x`, in place; `pre` keeps the input and `rstd` each
/// head's reciprocal RMS.
fn head_norm_forward(
    x: &mut Vec<f32>,
    pre: &mut Vec<f32>,
    rstd: &mut Vec<f32>,
    w: &Tensor,
    eps: f32,
) {
    std::mem::swap(x, pre);
    let n = pre.len();
    ops::rmsnorm_forward(
        pre,
        &w.data,
        eps,
        zeroed(x, n),
        zeroed(rstd, n / w.data.len()),
    );
}

/// Backward of [`head_norm_forward`]: the gradient at its input; the weight's is added to `dw`.
fn head_norm_backward(
    pre: &[f32],
    w: &Tensor,
    rstd: &[f32],
    dy: &[f32],
    dw: &mut Tensor,
) -> Vec<f32> {
    let mut dx = vec![0f32; pre.len()];
    ops::rmsnorm_backward(pre, &w.data, rstd, dy, &mut dx, &mut dw.data);
    dx
}

/// Adds `b`'s gradient (the column sums of `dy`) when the projection has a bias.
fn bias_grad(dy: &[f32], b: &mut Option<Tensor>) {
    if let Some(b) = b {
        ops::bias_backward(dy, &mut b.data);
    }
}

impl Params {
    pub(crate) fn latent_dims(&self) -> Option<LatentDims> {
        self.config
            .mla
            .map(|m| LatentDims::new(&m, self.config.n_head))
    }

    /// One transformer block: `x_out = x + post(attn(norm(x)))`, then `+= post(ffn(norm(.)))`
    /// (`post` is the identity without post-norms).
    pub(crate) fn layer_forward(
        &self,
        lp: &LayerParams,
        x: &[f32],
        run: LayerRun,
        a: &mut LayerActs,
        x_out: &mut [f32],
    ) {
        let c = &self.config;
        let LayerRun {
            dims, rope, prec, ..
        } = run;
        let (d, n, eps) = (c.n_embd, x.len() / c.n_embd, c.rms_eps);
        let (qd, ad) = (c.q_dim(), c.attn_dim());
        // Attention: norm -> Q, K, V (+ biases) -> per-head norms -> RoPE -> causal attention
        // -> output projection (+ bias) -> post-norm.
        ops::rmsnorm_forward(
            x,
            &lp.attn_norm.data,
            eps,
            zeroed(&mut a.xn1, n * d),
            zeroed(&mut a.rstd1, n),
        );
        let b = &lp.biases;
        ops::linear_forward(&a.xn1, &lp.wq.data, d, zeroed(&mut a.q, n * qd), prec);
        if let Some(bq) = &b.q {
            ops::bias_forward(&mut a.q, &bq.data);
        }
        if let Some(w) = &lp.norms.q {
            head_norm_forward(&mut a.q, &mut a.q_pre, &mut a.rstd_q, w, eps);
        }
        // RoPE rotates a query head's leading dims, or under MLA its trailing ones.
        let q_rope = c.mla.map_or(0, |m| m.nope_dim);
        ops::rope(
            &mut a.q,
            (c.n_head, c.head_dim, q_rope),
            dims.seq,
            rope,
            false,
        );
        let kd = dims.n_head_kv * c.head_dim;
        match (&lp.kv, self.latent_dims()) {
            (KvParams::Heads { wk, wv }, _) => {
                ops::linear_forward(&a.xn1, &wk.data, d, zeroed(&mut a.k, n * kd), prec);
                ops::linear_forward(&a.xn1, &wv.data, d, zeroed(&mut a.v, n * kd), prec);
                if let Some(bk) = &b.k {
                    ops::bias_forward(&mut a.k, &bk.data);
                }
                if let Some(bv) = &b.v {
                    ops::bias_forward(&mut a.v, &bv.data);
                }
                if let Some(w) = &lp.norms.k {
                    head_norm_forward(&mut a.k, &mut a.k_pre, &mut a.rstd_k, w, eps);
                }
                ops::rope(
                    &mut a.k,
                    (c.n_head_kv, c.head_dim, 0),
                    dims.seq,
                    rope,
                    false,
                );
                a.att_v.clear();
            }
            (kv @ KvParams::Latent { .. }, Some(ld)) => {
                latent::kv_forward(
                    ld,
                    &latent_weights(kv),
                    &a.xn1,
                    d,
                    (rope, dims.seq, eps),
                    &mut a.latent,
                    zeroed(&mut a.k, n * kd),
                    zeroed(&mut a.v, n * kd),
                    prec,
                );
            }
            (KvParams::Latent { .. }, None) => unreachable!("latent tensors without Config::mla"),
        }
        attention::attention_forward(
            &a.q,
            &a.k,
            &a.v,
            dims,
            zeroed(&mut a.probs, dims.probs_len()),
            zeroed(&mut a.att, n * qd),
            prec,
        );
        if let Some(ld) = self.latent_dims() {
            latent::compact_heads(ld, &a.att, zeroed(&mut a.att_v, n * ad));
        }
        let post = lp.norms.post_attn.as_ref();
        let mut y = std::mem::take(if post.is_some() {
            &mut a.attn_pre
        } else {
            &mut a.x_mid
        });
        ops::linear_forward(a.attn_out(), &lp.wo.data, ad, zeroed(&mut y, n * d), prec);
        if let Some(bo) = &b.o {
            ops::bias_forward(&mut y, &bo.data);
        }
        match post {
            None => a.x_mid = y,
            Some(w) => {
                a.attn_pre = y;
                ops::rmsnorm_forward(
                    &a.attn_pre,
                    &w.data,
                    eps,
                    zeroed(&mut a.x_mid, n * d),
                    zeroed(&mut a.rstd_pa, n),
                );
            }
        }
        a.x_mid.par_iter_mut().zip(x).for_each(|(m, &r)| *m += r);
        // Feed-forward: norm -> gated FFN (or routed experts) -> post-norm.
        ops::rmsnorm_forward(
            &a.x_mid,
            &lp.ffn_norm.data,
            eps,
            zeroed(&mut a.xn2, n * d),
            zeroed(&mut a.rstd2, n),
        );
        match &lp.norms.post_ffn {
            None => self.ffn_forward(lp, a, x_out, prec),
            Some(w) => {
                let mut y = std::mem::take(&mut a.ffn_pre);
                self.ffn_forward(lp, a, zeroed(&mut y, n * d), prec);
                a.ffn_pre = y;
                ops::rmsnorm_forward(&a.ffn_pre, &w.data, eps, x_out, zeroed(&mut a.rstd_pf, n));
            }
        }
        x_out
            .par_iter_mut()
            .zip(&a.x_mid)
            .for_each(|(o, &m)| *o += m);
    }

    /// The FFN of `a.xn2` into `out`: `down(act(gate x) * up x)`, or the routed experts.
    fn ffn_forward(&self, lp: &LayerParams, a: &mut LayerActs, out: &mut [f32], prec: Precision) {
        let c = &self.config;
        let (d, ff) = (c.n_embd, c.n_ff);
        let n = a.xn2.len() / d;
        match (&lp.ffn, &c.moe) {
            (FfnParams::Dense(f), _) => {
                ops::linear_forward(&a.xn2, &f.gate.data, d, zeroed(&mut a.g, n * ff), prec);
                ops::linear_forward(&a.xn2, &f.up.data, d, zeroed(&mut a.u, n * ff), prec);
                ops::gated_forward(c.features.ffn_act, &a.g, &a.u, zeroed(&mut a.h, n * ff));
                ops::linear_forward(&a.h, &f.down.data, ff, out, prec);
            }
            (FfnParams::Routed(r), Some(m)) => {
                let act = c.features.ffn_act;
                moe::routed_forward(m, r, &a.xn2, d, (ff, act), &mut a.moe, out, prec);
            }
            (FfnParams::Routed(_), None) => unreachable!("routed tensors without Config::moe"),
        }
    }

    /// Backward of [`layer_forward`](Self::layer_forward): `dx` holds the gradient of the
    /// layer's output on entry and of its input on return; parameter gradients are added to `gl`.
    pub(crate) fn layer_backward(
        &self,
        lp: &LayerParams,
        x: &[f32],
        run: LayerRun,
        a: &LayerActs,
        dx: &mut [f32],
        gl: &mut LayerParams,
    ) {
        let c = &self.config;
        let LayerRun {
            dims,
            rope,
            prec,
            moe_aux,
        } = run;
        let (d, n) = (c.n_embd, x.len() / c.n_embd);
        let (qd, ad, ff) = (c.q_dim(), c.attn_dim(), c.n_ff);
        let kd = dims.n_head_kv * c.head_dim;
        // Feed-forward block, through its post-norm; the residual passes dx through unchanged.
        let dffn = match (&lp.norms.post_ffn, &mut gl.norms.post_ffn) {
            (Some(w), Some(gw)) => {
                let mut t = vec![0f32; n * d];
                ops::rmsnorm_backward(&a.ffn_pre, &w.data, &a.rstd_pf, dx, &mut t, &mut gw.data);
                Some(t)
            }
            _ => None,
        };
        let dy = dffn.as_deref().unwrap_or(dx);
        let mut dxn = vec![0f32; n * d];
        match (&lp.ffn, &mut gl.ffn, &c.moe) {
            (FfnParams::Dense(f), FfnParams::Dense(gf), _) => {
                let mut dh = vec![0f32; n * ff];
                ops::linear_backward(
                    &a.h,
                    &f.down.data,
                    dy,
                    Some((&mut dh, false)),
                    Some(&mut gf.down.data),
                    ff,
                    prec,
                );
                let (mut dg, mut du) = (vec![0f32; n * ff], vec![0f32; n * ff]);
                ops::gated_backward(c.features.ffn_act, &a.g, &a.u, &dh, &mut dg, &mut du);
                drop(dh);
                ops::linear_backward(
                    &a.xn2,
                    &f.gate.data,
                    &dg,
                    Some((&mut dxn, false)),
                    Some(&mut gf.gate.data),
                    d,
                    prec,
                );
                ops::linear_backward(
                    &a.xn2,
                    &f.up.data,
                    &du,
                    Some((&mut dxn, true)),
                    Some(&mut gf.up.data),
                    d,
                    prec,
                );
            }
            (FfnParams::Routed(r), FfnParams::Routed(gr), Some(m)) => {
                moe::routed_backward(
                    m,
                    r,
                    (&a.xn2, d, ff, c.features.ffn_act),
                    &a.moe,
                    dy,
                    &mut dxn,
                    gr,
                    (prec, moe_aux),
                );
            }
            _ => unreachable!("gradients laid out as the parameters"),
        }
        drop(dffn);
        // dx now becomes the gradient at x_mid.
        ops::rmsnorm_backward(
            &a.x_mid,
            &lp.ffn_norm.data,
            &a.rstd2,
            &dxn,
            dx,
            &mut gl.ffn_norm.data,
        );
        // Attention block: post-norm, output bias and projection.
        let dproj = match (&lp.norms.post_attn, &mut gl.norms.post_attn) {
            (Some(w), Some(gw)) => {
                let mut t = vec![0f32; n * d];
                ops::rmsnorm_backward(&a.attn_pre, &w.data, &a.rstd_pa, dx, &mut t, &mut gw.data);
                Some(t)
            }
            _ => None,
        };
        let dy = dproj.as_deref().unwrap_or(dx);
        bias_grad(dy, &mut gl.biases.o);
        let mut datt = vec![0f32; n * ad];
        ops::linear_backward(
            a.attn_out(),
            &lp.wo.data,
            dy,
            Some((&mut datt, false)),
            Some(&mut gl.wo.data),
            ad,
            prec,
        );
        drop(dproj);
        if let Some(ld) = self.latent_dims() {
            let mut padded = vec![0f32; n * qd];
            latent::pad_heads(ld, &datt, &mut padded);
            datt = padded;
        }
        let (mut dq, mut dk, mut dv) = (vec![0f32; n * qd], vec![0f32; n * kd], vec![0f32; n * kd]);
        attention::attention_backward(
            &a.q, &a.k, &a.v, &a.probs, &a.att, &datt, dims, &mut dq, &mut dk, &mut dv, prec,
        );
        drop(datt);
        // Queries: RoPE's transpose, the per-head norm, the bias, the projection.
        let q_rope = c.mla.map_or(0, |m| m.nope_dim);
        ops::rope(
            &mut dq,
            (c.n_head, c.head_dim, q_rope),
            dims.seq,
            rope,
            true,
        );
        if let (Some(w), Some(gw)) = (&lp.norms.q, &mut gl.norms.q) {
            dq = head_norm_backward(&a.q_pre, w, &a.rstd_q, &dq, gw);
        }
        bias_grad(&dq, &mut gl.biases.q);
        ops::linear_backward(
            &a.xn1,
            &lp.wq.data,
            &dq,
            Some((&mut dxn, false)),
            Some(&mut gl.wq.data),
            d,
            prec,
        );
        match (&lp.kv, &mut gl.kv, self.latent_dims()) {
            (KvParams::Heads { wk, wv }, KvParams::Heads { wk: gk, wv: gv }, _) => {
                ops::rope(&mut dk, (c.n_head_kv, c.head_dim, 0), dims.seq, rope, true);
                if let (Some(w), Some(gw)) = (&lp.norms.k, &mut gl.norms.k) {
                    dk = head_norm_backward(&a.k_pre, w, &a.rstd_k, &dk, gw);
                }
                bias_grad(&dk, &mut gl.biases.k);
                bias_grad(&dv, &mut gl.biases.v);
                ops::linear_backward(
                    &a.xn1,
                    &wk.data,
                    &dk,
                    Some((&mut dxn, true)),
                    Some(&mut gk.data),
                    d,
                    prec,
                );
                ops::linear_backward(
                    &a.xn1,
                    &wv.data,
                    &dv,
                    Some((&mut dxn, true)),
                    Some(&mut gv.data),
                    d,
                    prec,
                );
            }
            (
                kv @ KvParams::Latent { .. },
                KvParams::Latent {
                    kv_a,
                    kv_a_norm,
                    k_b,
                    v_b,
                },
                Some(ld),
            ) => latent::kv_backward(
                ld,
                &latent_weights(kv),
                &a.xn1,
                d,
                (rope, dims.seq),
                &a.latent,
                &dk,
                &dv,
                &mut dxn,
                LatentGrads {
                    kv_a: &mut kv_a.data,
                    norm: &mut kv_a_norm.data,
                    k_b: &mut k_b.data,
                    v_b: &mut v_b.data,
                },
                prec,
            ),
            _ => unreachable!("gradients laid out as the parameters"),
        }
        ops::rmsnorm_backward(
            x,
            &lp.attn_norm.data,
            &a.rstd1,
            &dxn,
            dx,
            &mut gl.attn_norm.data,
        );
    }
}

/// The latent block's weights as slices (the caller has matched `KvParams::Latent`).
fn latent_weights(kv: &KvParams) -> LatentWeights<'_> {
    match kv {
        KvParams::Latent {
            kv_a,
            kv_a_norm,
            k_b,
            v_b,
        } => LatentWeights {
            kv_a: &kv_a.data,
            latent_scale: kv_a.row_scale(),
            norm: &kv_a_norm.data,
            k_b: &k_b.data,
            v_b: &v_b.data,
        },
        KvParams::Heads { .. } => unreachable!("per-head keys have no latent weights"),
    }
}
