//! Multi-head latent attention's keys and values for training (deepseek2's MLA), forward and
//! backward. Training runs the decompressed form: every token's latent is taken up to per-head
//! keys and values and ordinary multi-head attention runs over them, which is the same function
//! the inference engine's absorbed decode computes (tested there), with plain matrix products
//! for the backward.
//!
//! Forward, for the normed block input `xn` (one row per token):
//! ```text
//! c    = xn · W_a[..rank]^T            raw latent            (n x rank)
//! pe   = rope(xn · W_a[rank..]^T)      shared RoPE key       (n x rope)
//! cn   = rmsnorm(c) ⊙ g                normed latent         (what the cache stores)
//! k_h  = [cn · K_b,h^T | pe]           head h's key          (nope + rope)
//! v_h  = [cn · V_b,h^T | 0]            head h's value, zero-padded to the key's width
//! ```
//! The padding lets one attention over heads of one width serve keys and values of different
//! widths; the padded output columns are zero and are dropped before the output projection.

use crate::gemm::Precision;
use crate::ops::{self, Rope};
use frugal::ops::zeroed;

/// MLA's sizes, from `frugal::model::Mla`, with the head count.
#[derive(Clone, Copy, Debug)]
pub struct LatentDims {
    pub n_head: usize,
    pub rank: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
}

impl LatentDims {
    pub fn new(m: &frugal::model::Mla, n_head: usize) -> Self {
        LatentDims {
            n_head,
            rank: m.kv_lora_rank,
            nope: m.nope_dim,
            rope: m.rope_dim,
            v_dim: m.v_dim,
        }
    }

    /// Width of one head's key (and of its padded value).
    pub fn head_dim(&self) -> usize {
        self.nope + self.rope
    }
}

/// The latent block's weights: `kv_a` (`rank + rope` rows), the latent norm, and the
/// up-projections (`n_head*nope x rank`, `n_head*v_dim x rank`).
pub struct LatentWeights<'a> {
    pub kv_a: &'a [f32],
    /// What the latent rows of `kv_a` are multiplied by (their training scale:
    /// `params::Stored::ScaledRows`).
    pub latent_scale: f32,
    pub norm: &'a [f32],
    pub k_b: &'a [f32],
    pub v_b: &'a [f32],
}

/// Gradients of [`LatentWeights`], added to.
pub struct LatentGrads<'a> {
    pub kv_a: &'a mut [f32],
    pub norm: &'a mut [f32],
    pub k_b: &'a mut [f32],
    pub v_b: &'a mut [f32],
}

/// What the backward reads: the raw latent, its reciprocal RMS and the normed latent.
#[derive(Default, Debug)]
pub struct LatentActs {
    c: Vec<f32>,
    rstd: Vec<f32>,
    cn: Vec<f32>,
}

impl LatentActs {
    pub fn bytes(&self) -> usize {
        4 * (self.c.capacity() + self.rstd.capacity() + self.cn.capacity())
    }
}

/// Keys and values (`n x n_head x head_dim` each, values zero-padded) from the normed input.
#[allow(clippy::too_many_arguments)]
pub fn kv_forward(
    dims: LatentDims,
    w: &LatentWeights,
    xn: &[f32],
    d: usize,
    (rope, seq, eps): (&Rope, usize, f32),
    a: &mut LatentActs,
    k: &mut [f32],
    v: &mut [f32],
    prec: Precision,
) {
    let LatentDims {
        n_head,
        rank,
        nope,
        rope: rd,
        v_dim,
    } = dims;
    let (n, hd) = (xn.len() / d, dims.head_dim());
    let (wc, wpe) = w.kv_a.split_at(rank * d);
    ops::linear_forward(xn, wc, d, zeroed(&mut a.c, n * rank), prec);
    if w.latent_scale != 1.0 {
        a.c.iter_mut().for_each(|v| *v *= w.latent_scale);
    }
    let mut pe = vec![0f32; n * rd];
    ops::linear_forward(xn, wpe, d, &mut pe, prec);
    ops::rope(&mut pe, (1, rd, 0), seq, rope, false);
    ops::rmsnorm_forward(
        &a.c,
        w.norm,
        eps,
        zeroed(&mut a.cn, n * rank),
        zeroed(&mut a.rstd, n),
    );
    let mut kn = vec![0f32; n * n_head * nope];
    ops::linear_forward(&a.cn, w.k_b, rank, &mut kn, prec);
    let mut vv = vec![0f32; n * n_head * v_dim];
    ops::linear_forward(&a.cn, w.v_b, rank, &mut vv, prec);
    for t in 0..n {
        let pe_t = &pe[t * rd..(t + 1) * rd];
        for h in 0..n_head {
            let kh = &mut k[(t * n_head + h) * hd..][..hd];
            kh[..nope].copy_from_slice(&kn[(t * n_head + h) * nope..][..nope]);
            kh[nope..].copy_from_slice(pe_t);
            let vh = &mut v[(t * n_head + h) * hd..][..hd];
            vh[..v_dim].copy_from_slice(&vv[(t * n_head + h) * v_dim..][..v_dim]);
            vh[v_dim..].fill(0.0);
        }
    }
}

/// Backward of [`kv_forward`]: from the gradients at the keys and (padded) values, adds the
/// weights' gradients into `g` and the gradient at the normed input into `dxn`.
#[allow(clippy::too_many_arguments)]
pub fn kv_backward(
    dims: LatentDims,
    w: &LatentWeights,
    xn: &[f32],
    d: usize,
    (rope, seq): (&Rope, usize),
    a: &LatentActs,
    dk: &[f32],
    dv: &[f32],
    dxn: &mut [f32],
    g: LatentGrads,
    prec: Precision,
) {
    let LatentDims {
        n_head,
        rank,
        nope,
        rope: rd,
        v_dim,
    } = dims;
    let (n, hd) = (xn.len() / d, dims.head_dim());
    // Split the per-head gradients: position-free key parts and values go to the latent; the
    // RoPE parts of every head add up on the one shared key.
    let mut dkn = vec![0f32; n * n_head * nope];
    let mut dvv = vec![0f32; n * n_head * v_dim];
    let mut dpe = vec![0f32; n * rd];
    for t in 0..n {
        let dpe_t = &mut dpe[t * rd..(t + 1) * rd];
        for h in 0..n_head {
            let dkh = &dk[(t * n_head + h) * hd..][..hd];
            dkn[(t * n_head + h) * nope..][..nope].copy_from_slice(&dkh[..nope]);
            for (s, &x) in dpe_t.iter_mut().zip(&dkh[nope..]) {
                *s += x;
            }
            dvv[(t * n_head + h) * v_dim..][..v_dim]
                .copy_from_slice(&dv[(t * n_head + h) * hd..][..v_dim]);
        }
    }
    let mut dcn = vec![0f32; n * rank];
    ops::linear_backward(
        &a.cn,
        w.k_b,
        &dkn,
        Some((&mut dcn, false)),
        Some(g.k_b),
        rank,
        prec,
    );
    ops::linear_backward(
        &a.cn,
        w.v_b,
        &dvv,
        Some((&mut dcn, true)),
        Some(g.v_b),
        rank,
        prec,
    );
    let mut dc = vec![0f32; n * rank];
    ops::rmsnorm_backward(&a.c, w.norm, &a.rstd, &dcn, &mut dc, g.norm);
    if w.latent_scale != 1.0 {
        dc.iter_mut().for_each(|v| *v *= w.latent_scale);
    }
    ops::rope(&mut dpe, (1, rd, 0), seq, rope, true);
    let (wc, wpe) = w.kv_a.split_at(rank * d);
    let (gc, gpe) = g.kv_a.split_at_mut(rank * d);
    ops::linear_backward(xn, wc, &dc, Some((dxn, true)), Some(gc), d, prec);
    ops::linear_backward(xn, wpe, &dpe, Some((dxn, true)), Some(gpe), d, prec);
}

/// Drops the zero padding of each head's output: `n x n_head x head_dim` to `n x n_head x v_dim`.
pub fn compact_heads(dims: LatentDims, att: &[f32], out: &mut [f32]) {
    let (hd, vd) = (dims.head_dim(), dims.v_dim);
    for (o, a) in out.chunks_exact_mut(vd).zip(att.chunks_exact(hd)) {
        o.copy_from_slice(&a[..vd]);
    }
}

/// The inverse of [`compact_heads`] for gradients: the padded columns get zero.
pub fn pad_heads(dims: LatentDims, datt: &[f32], out: &mut [f32]) {
    let (hd, vd) = (dims.head_dim(), dims.v_dim);
    for (o, a) in out.chunks_exact_mut(hd).zip(datt.chunks_exact(vd)) {
        o[..vd].copy_from_slice(a);
        o[vd..].fill(0.0);
    }
}
