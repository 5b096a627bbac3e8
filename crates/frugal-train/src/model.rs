//! The training forward and backward of a model, top to bottom: embedding, the blocks
//! ([`crate::layer`]), the final norm and the head.
//!
//! The forward keeps what the backward needs. With `recompute`, it keeps only each layer's
//! input (one `rows x n_embd` buffer per layer) and the backward recomputes the layer's
//! activations just before it needs them: one extra forward of the layers buys a peak of one
//! layer's activations instead of all of them (activation checkpointing at layer granularity).
//! The output head is computed in chunks of rows, and each chunk's loss gradient goes straight
//! back through the head, so the `rows x vocabulary` logits never exist whole.

use rayon::prelude::*;

use frugal::ops::RopeScaling;

use crate::attention::AttnDims;
use crate::gemm::Precision;
use crate::layer::{LayerActs, LayerRun};
use crate::loss::{LossSums, Objective};
use crate::ops::{self, Rope};
use crate::params::Params;

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

/// The state a forward leaves for the backward.
pub struct Saved {
    /// Input of layer `l` at index `l`; the last entry is the final residual stream.
    pub residual: Vec<Vec<f32>>,
    acts: Vec<Option<LayerActs>>,
    xf: Vec<f32>,
    rstd_f: Vec<f32>,
    ropes: Ropes,
    dims: AttnDims,
}

/// The RoPE tables of a batch's positions: the (global) layers', with the configuration's
/// scaling, and the local layers' when they have a base of their own (Gemma 3), unscaled as
/// the inference engine rotates them.
struct Ropes {
    global: Rope,
    local: Option<Rope>,
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
        let plain = 1.0 / (c.head_dim as f32).sqrt();
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
            window: None,
            // The inference engine applies a family's query scale to per-head attention only.
            scale: match c.mla {
                None => c.features.query_scale.unwrap_or(plain),
                Some(_) => plain,
            },
        }
    }

    fn ropes(&self, seq: usize) -> Ropes {
        let c = &self.config;
        let style = c.features.rope;
        let local = c.features.sliding.and_then(|s| s.local_rope_base);
        Ropes {
            global: Rope::new(seq, c.rope_dim, c.rope_base, style, &c.rope_scaling),
            local: local
                .map(|base| Rope::new(seq, c.rope_dim, base, style, &RopeScaling::default())),
        }
    }

    /// Layer `l`'s attention: its window (if it is a local layer) and RoPE table.
    fn layer_run<'a>(
        &self,
        l: usize,
        dims: AttnDims,
        ropes: &'a Ropes,
        opts: RunOptions,
    ) -> LayerRun<'a> {
        let window = self.config.features.window(l);
        let rope = match (window, &ropes.local) {
            (Some(_), Some(local)) => local,
            _ => &ropes.global,
        };
        LayerRun {
            dims: AttnDims { window, ..dims },
            rope,
            prec: opts.precision,
            moe_aux: opts.moe_aux,
        }
    }

    /// The forward through every layer and the final norm, keeping what the backward needs.
    pub fn forward(&self, b: &Batch, opts: RunOptions) -> Saved {
        let c = &self.config;
        let (d, n) = (c.n_embd, b.tokens.len());
        let dims = self.dims(b);
        let ropes = self.ropes(b.seq);
        let mut x = vec![0f32; n * d];
        ops::embedding_forward(&self.token_embd.data, b.tokens, d, &mut x);
        if let Some(s) = c.features.embd_scale {
            ops::scale(&mut x, s);
        }
        let mut residual = Vec::with_capacity(c.n_layers + 1);
        let mut acts = Vec::with_capacity(c.n_layers);
        let mut scratch = LayerActs::default();
        for (l, lp) in self.layers.iter().enumerate() {
            let mut out = vec![0f32; n * d];
            let run = self.layer_run(l, dims, &ropes, opts);
            if opts.recompute {
                self.layer_forward(lp, &x, run, &mut scratch, &mut out);
                acts.push(None);
            } else {
                let mut a = LayerActs::default();
                self.layer_forward(lp, &x, run, &mut a, &mut out);
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
            ropes,
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
            ropes,
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
            let run = self.layer_run(l, dims, &ropes, opts);
            let a = match acts[l].take() {
                Some(a) => {
                    scratch = a;
                    &scratch
                }
                None => {
                    let mut out = vec![0f32; x.len()];
                    self.layer_forward(lp, x, run, &mut scratch, &mut out);
                    &scratch
                }
            };
            let gl = &mut grads.layers[l];
            self.layer_backward(lp, x, run, a, &mut dx, gl);
        }
        if let Some(s) = c.features.embd_scale {
            ops::scale(&mut dx, s);
        }
        ops::embedding_backward(&mut grads.token_embd.data, b.tokens, c.n_embd, &dx);
        sums
    }
}
