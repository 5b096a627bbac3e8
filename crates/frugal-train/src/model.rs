//! The training forward and backward of a Llama-family model, top to bottom.
//!
//! The forward keeps what the backward needs. With `recompute`, it keeps only each layer's
//! input (one `rows x n_embd` buffer per layer) and the backward recomputes the layer's
//! activations just before it needs them: one extra forward of the layers buys a peak of one
//! layer's activations instead of all of them (activation checkpointing at layer granularity).
//! The output head is computed in chunks of rows, and each chunk's loss gradient goes straight
//! back through the head, so the `rows x vocabulary` logits never exist whole.

use rayon::prelude::*;

use crate::attention::{self, AttnDims};
use crate::gemm::Precision;
use crate::latent::{self, LatentActs, LatentDims, LatentGrads, LatentWeights};
use crate::loss::{LossSums, Objective};
use crate::moe::{self, MoeActs};
use crate::ops::{self, Rope};
use crate::params::{FfnParams, KvParams, LayerParams, Params};

/// Rows of logits computed at once by the head: large enough that the head's products run near
/// the GEMM's speed (m = 1024), small enough that the logits stay 200 MB, not `rows x vocabulary`.
const HEAD_CHUNK: usize = 1024;

/// How the products run, what the forward keeps, and the balancing term routed layers add.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunOptions {
    pub precision: Precision,
    /// Keep only layer inputs and recompute the rest during the backward.
    pub recompute: bool,
    /// Weight α of the Switch load-balancing loss `α E Σ f_i P_i` each routed layer adds to
    /// its gradient (0: none). It is not part of the returned loss sums.
    pub moe_aux: f32,
}

/// A batch of `batch` sequences of `seq` tokens each (row `b*seq + t`), every one from position 0.
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    pub batch: usize,
    pub seq: usize,
}

/// Everything one layer's backward reads.
#[derive(Default, Debug)]
pub struct LayerActs {
    xn1: Vec<f32>,
    rstd1: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    probs: Vec<f32>,
    att: Vec<f32>,
    /// Latent attention: the latent's activations, and the attention output without each
    /// head's value padding (the output projection's input).
    latent: LatentActs,
    att_v: Vec<f32>,
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
            &self.probs,
            &self.att,
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

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.clear();
    v.resize(n, 0.0);
    &mut v[..]
}

/// The state a forward leaves for the backward.
pub struct Saved {
    /// Input of layer `l` at index `l`; the last entry is the final residual stream.
    pub residual: Vec<Vec<f32>>,
    acts: Vec<Option<LayerActs>>,
    xf: Vec<f32>,
    rstd_f: Vec<f32>,
    rope: Rope,
    dims: AttnDims,
}

impl Saved {
    /// Bytes of activations held between the forward and the backward.
    pub fn bytes(&self) -> usize {
        let acts: usize = self.acts.iter().flatten().map(LayerActs::bytes).sum();
        acts + 4 * (self.residual.iter().map(Vec::len).sum::<usize>() + self.xf.len())
    }
}

/// Hidden-state targets injected into the backward: `(layer, gradient of the loss with respect
/// to that layer's output)`, computed by the caller from [`Saved::residual`].
pub type HiddenGrads = Vec<(usize, Vec<f32>)>;

impl Params {
    fn dims(&self, b: &Batch) -> AttnDims {
        let c = &self.config;
        AttnDims {
            batch: b.batch,
            seq: b.seq,
            n_head: c.n_head,
            // Latent attention runs decompressed: every head has its own key and value.
            n_head_kv: if c.mla.is_some() {
                c.n_head
            } else {
                c.n_head_kv
            },
            head_dim: c.head_dim,
        }
    }

    fn latent_dims(&self) -> Option<LatentDims> {
        self.config
            .mla
            .map(|m| LatentDims::new(&m, self.config.n_head))
    }

    /// One transformer block: `x_out = x + attn(norm(x))`, then `+= ffn(norm(.))`.
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        lp: &LayerParams,
        x: &[f32],
        rope: &Rope,
        dims: AttnDims,
        a: &mut LayerActs,
        x_out: &mut [f32],
        prec: Precision,
    ) {
        let c = &self.config;
        let (d, n) = (c.n_embd, x.len() / c.n_embd);
        let (qd, ad, ff) = (c.q_dim(), c.attn_dim(), c.n_ff);
        // Attention: norm -> Q, K, V -> RoPE -> causal attention -> output projection.
        ops::rmsnorm_forward(
            x,
            &lp.attn_norm.data,
            c.rms_eps,
            sized(&mut a.xn1, n * d),
            sized(&mut a.rstd1, n),
        );
        ops::linear_forward(&a.xn1, &lp.wq.data, d, sized(&mut a.q, n * qd), prec);
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
                ops::linear_forward(&a.xn1, &wk.data, d, sized(&mut a.k, n * kd), prec);
                ops::linear_forward(&a.xn1, &wv.data, d, sized(&mut a.v, n * kd), prec);
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
                    (rope, dims.seq, c.rms_eps),
                    &mut a.latent,
                    sized(&mut a.k, n * kd),
                    sized(&mut a.v, n * kd),
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
            sized(&mut a.probs, dims.probs_len()),
            sized(&mut a.att, n * qd),
            prec,
        );
        if let Some(ld) = self.latent_dims() {
            latent::compact_heads(ld, &a.att, sized(&mut a.att_v, n * ad));
        }
        let mut x_mid = std::mem::take(&mut a.x_mid);
        ops::linear_forward(
            a.attn_out(),
            &lp.wo.data,
            ad,
            sized(&mut x_mid, n * d),
            prec,
        );
        a.x_mid = x_mid;
        let x_mid = &mut a.x_mid[..];
        x_mid.par_iter_mut().zip(x).for_each(|(m, &r)| *m += r);
        // Feed-forward: norm -> SwiGLU(gate, up) -> down projection, or routed experts.
        ops::rmsnorm_forward(
            &a.x_mid,
            &lp.ffn_norm.data,
            c.rms_eps,
            sized(&mut a.xn2, n * d),
            sized(&mut a.rstd2, n),
        );
        match (&lp.ffn, &c.moe) {
            (FfnParams::Dense(f), _) => {
                ops::linear_forward(&a.xn2, &f.gate.data, d, sized(&mut a.g, n * ff), prec);
                ops::linear_forward(&a.xn2, &f.up.data, d, sized(&mut a.u, n * ff), prec);
                ops::swiglu_forward(&a.g, &a.u, sized(&mut a.h, n * ff));
                ops::linear_forward(&a.h, &f.down.data, ff, x_out, prec);
            }
            (FfnParams::Routed(r), Some(m)) => {
                moe::routed_forward(m, r, &a.xn2, d, ff, &mut a.moe, x_out, prec);
            }
            (FfnParams::Routed(_), None) => unreachable!("routed tensors without Config::moe"),
        }
        x_out
            .par_iter_mut()
            .zip(&a.x_mid)
            .for_each(|(o, &m)| *o += m);
    }

    /// Backward of [`layer_forward`](Self::layer_forward): `dx` holds the gradient of the
    /// layer's output on entry and of its input on return; parameter gradients are added to `gl`.
    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        lp: &LayerParams,
        x: &[f32],
        rope: &Rope,
        dims: AttnDims,
        a: &LayerActs,
        dx: &mut [f32],
        gl: &mut LayerParams,
        (prec, moe_aux): (Precision, f32),
    ) {
        let c = &self.config;
        let (d, n) = (c.n_embd, x.len() / c.n_embd);
        let (qd, ad, ff) = (c.q_dim(), c.attn_dim(), c.n_ff);
        let kd = dims.n_head_kv * c.head_dim;
        // Feed-forward block; the residual passes dx through unchanged.
        let mut dxn = vec![0f32; n * d];
        match (&lp.ffn, &mut gl.ffn, &c.moe) {
            (FfnParams::Dense(f), FfnParams::Dense(gf), _) => {
                let mut dh = vec![0f32; n * ff];
                ops::linear_backward(
                    &a.h,
                    &f.down.data,
                    dx,
                    Some((&mut dh, false)),
                    Some(&mut gf.down.data),
                    ff,
                    prec,
                );
                let (mut dg, mut du) = (vec![0f32; n * ff], vec![0f32; n * ff]);
                ops::swiglu_backward(&a.g, &a.u, &dh, &mut dg, &mut du);
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
                    (&a.xn2, d, ff),
                    &a.moe,
                    dx,
                    &mut dxn,
                    gr,
                    (prec, moe_aux),
                );
            }
            _ => unreachable!("gradients laid out as the parameters"),
        }
        // dx now becomes the gradient at x_mid.
        ops::rmsnorm_backward(
            &a.x_mid,
            &lp.ffn_norm.data,
            &a.rstd2,
            &dxn,
            dx,
            &mut gl.ffn_norm.data,
        );
        // Attention block.
        let mut datt = vec![0f32; n * ad];
        ops::linear_backward(
            a.attn_out(),
            &lp.wo.data,
            dx,
            Some((&mut datt, false)),
            Some(&mut gl.wo.data),
            ad,
            prec,
        );
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
        let q_rope = c.mla.map_or(0, |m| m.nope_dim);
        ops::rope(
            &mut dq,
            (c.n_head, c.head_dim, q_rope),
            dims.seq,
            rope,
            true,
        );
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

    /// The forward through every layer and the final norm, keeping what the backward needs.
    pub fn forward(&self, b: &Batch, opts: RunOptions) -> Saved {
        let c = &self.config;
        let (d, n) = (c.n_embd, b.tokens.len());
        let dims = self.dims(b);
        let rope = Rope::new(b.seq, c.rope_dim, c.rope_base);
        let mut x = vec![0f32; n * d];
        ops::embedding_forward(&self.token_embd.data, b.tokens, d, &mut x);
        let mut residual = Vec::with_capacity(c.n_layers + 1);
        let mut acts = Vec::with_capacity(c.n_layers);
        let mut scratch = LayerActs::default();
        for lp in &self.layers {
            let mut out = vec![0f32; n * d];
            if opts.recompute {
                self.layer_forward(lp, &x, &rope, dims, &mut scratch, &mut out, opts.precision);
                acts.push(None);
            } else {
                let mut a = LayerActs::default();
                self.layer_forward(lp, &x, &rope, dims, &mut a, &mut out, opts.precision);
                acts.push(Some(a));
            }
            residual.push(std::mem::replace(&mut x, out));
        }
        let (mut xf, mut rstd_f) = (vec![0f32; n * d], vec![0f32; n]);
        ops::rmsnorm_forward(&x, &self.output_norm.data, c.rms_eps, &mut xf, &mut rstd_f);
        residual.push(x);
        Saved {
            residual,
            acts,
            xf,
            rstd_f,
            rope,
            dims,
        }
    }

    /// The head, chunk by chunk: logits, the objective's loss and logit gradient, and that
    /// gradient back through the head. Returns the loss sums and the gradient at the final
    /// norm's output (`None` for `grads` evaluates the loss only).
    fn head_pass(
        &self,
        s: &Saved,
        obj: &dyn Objective,
        mut grads: Option<&mut Params>,
        prec: Precision,
    ) -> (LossSums, Vec<f32>) {
        let c = &self.config;
        let (d, nv) = (c.n_embd, c.n_vocab);
        let n = s.xf.len() / d;
        let head = &self.head().data;
        let mut sums = LossSums::default();
        let mut dxf = vec![0f32; if grads.is_some() { n * d } else { 0 }];
        let mut logits = vec![0f32; HEAD_CHUNK.min(n) * nv];
        for r0 in (0..n).step_by(HEAD_CHUNK) {
            let r1 = (r0 + HEAD_CHUNK).min(n);
            let xr = &s.xf[r0 * d..r1 * d];
            let lg = &mut logits[..(r1 - r0) * nv];
            ops::linear_forward(xr, head, d, lg, prec);
            sums.add(&obj.rows(r0..r1, lg, grads.is_some()));
            if let Some(g) = grads.as_deref_mut() {
                let dhead = match g.output.as_mut() {
                    Some(o) => &mut o.data,
                    None => &mut g.token_embd.data,
                };
                ops::linear_backward(
                    xr,
                    head,
                    lg,
                    Some((&mut dxf[r0 * d..r1 * d], false)),
                    Some(dhead),
                    d,
                    prec,
                );
            }
        }
        (sums, dxf)
    }

    /// The loss of a batch, without gradients (held-out evaluation).
    pub fn loss(&self, b: &Batch, obj: &dyn Objective, prec: Precision) -> LossSums {
        let s = self.forward(
            b,
            RunOptions {
                precision: prec,
                recompute: true,
                ..RunOptions::default()
            },
        );
        self.head_pass(&s, obj, None, prec).0
    }

    /// Logits of every row (`rows x n_vocab`), for tests and small evaluations.
    pub fn logits(&self, b: &Batch, prec: Precision) -> Vec<f32> {
        let s = self.forward(
            b,
            RunOptions {
                precision: prec,
                recompute: true,
                ..RunOptions::default()
            },
        );
        let mut out = vec![0f32; b.tokens.len() * self.config.n_vocab];
        ops::linear_forward(&s.xf, &self.head().data, self.config.n_embd, &mut out, prec);
        out
    }

    /// Forward and backward of one batch: adds the gradients of `obj` (and of the hidden-state
    /// terms `hidden`, gradients at layer outputs) into `grads` and returns the loss sums. The
    /// caller may look at `saved.residual` between [`forward`](Self::forward) and this call.
    pub fn backward(
        &self,
        b: &Batch,
        saved: Saved,
        obj: &dyn Objective,
        hidden: HiddenGrads,
        grads: &mut Params,
        opts: RunOptions,
    ) -> LossSums {
        let c = &self.config;
        let prec = opts.precision;
        let (sums, dxf) = self.head_pass(&saved, obj, Some(grads), prec);
        let Saved {
            residual,
            mut acts,
            rstd_f,
            rope,
            dims,
            ..
        } = saved;
        let n_layers = c.n_layers;
        let mut dx = vec![0f32; dxf.len()];
        ops::rmsnorm_backward(
            &residual[n_layers],
            &self.output_norm.data,
            &rstd_f,
            &dxf,
            &mut dx,
            &mut grads.output_norm.data,
        );
        drop(dxf);
        let mut scratch = LayerActs::default();
        for l in (0..n_layers).rev() {
            for (_, g) in hidden.iter().filter(|(hl, _)| *hl == l) {
                dx.par_iter_mut().zip(g).for_each(|(a, &b)| *a += b);
            }
            let x = &residual[l];
            let lp = &self.layers[l];
            let a = match acts[l].take() {
                Some(a) => {
                    scratch = a;
                    &scratch
                }
                None => {
                    let mut out = vec![0f32; x.len()];
                    self.layer_forward(lp, x, &rope, dims, &mut scratch, &mut out, prec);
                    &scratch
                }
            };
            let gl = &mut grads.layers[l];
            self.layer_backward(lp, x, &rope, dims, a, &mut dx, gl, (prec, opts.moe_aux));
        }
        ops::embedding_backward(&mut grads.token_embd.data, b.tokens, c.n_embd, &dx);
        sums
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
