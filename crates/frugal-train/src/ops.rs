//! Every operation of the forward pass, each as a forward and a hand-written backward.
//!
//! Layout: activations are row-major `rows x width` with one row per token; a batch is `B`
//! sequences of `T` tokens, row `b*T + t`. Backward functions take the forward's inputs (or
//! what it saved) and the gradient of its output, and *add* into parameter gradients, so
//! gradient accumulation across micro-batches is free. Reductions over rows (a norm's weight
//! gradient) are summed in fixed chunks in a fixed order: results do not depend on the number
//! of threads.

use rayon::prelude::*;

use frugal::model::features::FfnAct;
use frugal::ops::{RopeScaling, RopeStyle, RopeTable};

use crate::gemm::{MatRef, Precision, matmul};
use crate::math::sigmoid;

/// Rows per task in row-parallel loops, and per partial sum in reductions (fixed, so that
/// reductions are deterministic).
const ROW_CHUNK: usize = 64;

/// `y (n x out) = x (n x in) . W^T`, with `W` stored `out x in` as in GGUF.
pub fn linear_forward(x: &[f32], w: &[f32], n_in: usize, y: &mut [f32], prec: Precision) {
    let n_out = w.len() / n_in;
    let n = x.len() / n_in;
    matmul(
        MatRef::new(x, n, n_in),
        MatRef::new(w, n_out, n_in).t(),
        y,
        false,
        prec,
    );
}

/// Backward of [`linear_forward`]: `dx (+)= dy . W` and `dW += dy^T . x`. `dx` is skipped when
/// `None` (the input needs no gradient).
pub fn linear_backward(
    x: &[f32],
    w: &[f32],
    dy: &[f32],
    dx: Option<(&mut [f32], bool)>,
    dw: Option<&mut [f32]>,
    n_in: usize,
    prec: Precision,
) {
    let n_out = w.len() / n_in;
    let n = x.len() / n_in;
    if let Some((dx, accumulate)) = dx {
        matmul(
            MatRef::new(dy, n, n_out),
            MatRef::new(w, n_out, n_in),
            dx,
            accumulate,
            prec,
        );
    }
    if let Some(dw) = dw {
        matmul(
            MatRef::new(dy, n, n_out).t(),
            MatRef::new(x, n, n_in),
            dw,
            true,
            prec,
        );
    }
}

/// Token embedding: row `i` of `x` is row `tokens[i]` of the table.
pub fn embedding_forward(table: &[f32], tokens: &[u32], d: usize, x: &mut [f32]) {
    for (row, &t) in x.chunks_exact_mut(d).zip(tokens) {
        let t = t as usize;
        row.copy_from_slice(&table[t * d..(t + 1) * d]);
    }
}

/// Backward of [`embedding_forward`]: scatters each row's gradient into its token's row.
pub fn embedding_backward(dtable: &mut [f32], tokens: &[u32], d: usize, dx: &[f32]) {
    for (row, &t) in dx.chunks_exact(d).zip(tokens) {
        let t = t as usize;
        for (g, &v) in dtable[t * d..(t + 1) * d].iter_mut().zip(row) {
            *g += v;
        }
    }
}

/// RMSNorm `y = x / sqrt(mean(x²) + eps) * w` per row; saves each row's reciprocal RMS. The mean
/// of squares is accumulated in f64, as the inference engine (and ggml) does.
pub fn rmsnorm_forward(x: &[f32], w: &[f32], eps: f32, y: &mut [f32], rstd: &mut [f32]) {
    let d = w.len();
    y.par_chunks_mut(d * ROW_CHUNK)
        .zip(x.par_chunks(d * ROW_CHUNK))
        .zip(rstd.par_chunks_mut(ROW_CHUNK))
        .for_each(|((yc, xc), rc)| {
            for ((yr, xr), r) in yc.chunks_exact_mut(d).zip(xc.chunks_exact(d)).zip(rc) {
                let ss: f64 = xr.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
                *r = (1.0 / (ss / d as f64 + f64::from(eps)).sqrt()) as f32;
                for ((o, &v), &g) in yr.iter_mut().zip(xr).zip(w) {
                    *o = v * *r * g;
                }
            }
        });
}

/// Backward of [`rmsnorm_forward`]: `dx += r (dy⊙w) - x r³/d Σ(dy⊙w⊙x)`, `dw += Σ_rows dy⊙x r`.
pub fn rmsnorm_backward(
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let d = w.len();
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(d * ROW_CHUNK)
        .zip(x.par_chunks(d * ROW_CHUNK))
        .zip(dy.par_chunks(d * ROW_CHUNK))
        .zip(rstd.par_chunks(ROW_CHUNK))
        .map(|(((dxc, xc), dyc), rc)| {
            let mut dwp = vec![0f32; d];
            for (((dxr, xr), dyr), &r) in dxc
                .chunks_exact_mut(d)
                .zip(xc.chunks_exact(d))
                .zip(dyc.chunks_exact(d))
                .zip(rc)
            {
                let mut dot = 0f32;
                for i in 0..d {
                    dot += dyr[i] * w[i] * xr[i];
                    dwp[i] += dyr[i] * xr[i] * r;
                }
                let c = dot * r * r * r / d as f32;
                for i in 0..d {
                    dxr[i] += r * dyr[i] * w[i] - xr[i] * c;
                }
            }
            dwp
        })
        .collect();
    for p in partials {
        for (g, v) in dw.iter_mut().zip(p) {
            *g += v;
        }
    }
}

/// Rotary embedding tables for positions `0..n`: per position and rotated pair, the `cos` and
/// `sin` the inference engine rotates by ([`RopeTable`]: frequency factors, linear and YaRN
/// scaling with YaRN's magnitude scale, Phi-3's long or short factors), and which dimensions
/// form the pairs. Taking them from the same code is what makes a scaled RoPE train as it runs.
#[derive(Clone, Debug, Default)]
pub struct Rope {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub half: usize,
    pub style: RopeStyle,
}

impl Rope {
    pub fn new(
        n: usize,
        rope_dim: usize,
        base: f32,
        style: RopeStyle,
        scaling: &RopeScaling,
    ) -> Self {
        let mut t = RopeTable::default();
        t.style = style;
        t.set_scaling(scaling);
        t.fill(0, n, rope_dim, base);
        Rope {
            cos: std::mem::take(&mut t.cos),
            sin: std::mem::take(&mut t.sin),
            half: rope_dim / 2,
            style,
        }
    }

    pub fn positions(&self) -> usize {
        self.cos.len().checked_div(self.half).unwrap_or(0)
    }
}

/// Rotates the `rope_dim` dims from `offset` of every head (the leading dims in most families,
/// the trailing ones of an MLA query head) by the angle of the row's position (`row % seq`):
/// adjacent pairs `(2i, 2i+1)` or, NeoX style, `(i, i + rope_dim/2)`. With `transpose` it
/// applies the transposed matrix `[[c, s], [-s, c]]` instead, which is the backward (and,
/// unless YaRN or an attention factor scales `cos` and `sin`, the inverse rotation).
pub fn rope(
    x: &mut [f32],
    (n_heads, head_dim, offset): (usize, usize, usize),
    seq: usize,
    table: &Rope,
    transpose: bool,
) {
    let width = n_heads * head_dim;
    let h = table.half;
    let sign = if transpose { -1.0 } else { 1.0 };
    // Where pair `j`'s two values sit in the rotated span.
    let (stride, second) = match table.style {
        RopeStyle::Interleaved => (2, 1),
        RopeStyle::Neox => (1, h),
    };
    x.par_chunks_mut(width * ROW_CHUNK)
        .enumerate()
        .for_each(|(c, xc)| {
            for (i, row) in xc.chunks_exact_mut(width).enumerate() {
                let pos = (c * ROW_CHUNK + i) % seq;
                let cos = &table.cos[pos * h..(pos + 1) * h];
                let sin = &table.sin[pos * h..(pos + 1) * h];
                for head in row.chunks_exact_mut(head_dim) {
                    let head = &mut head[offset..];
                    for j in 0..h {
                        let (ia, ib) = (stride * j, stride * j + second);
                        let (a, b) = (head[ia], head[ib]);
                        let s = sign * sin[j];
                        head[ia] = a * cos[j] - b * s;
                        head[ib] = a * s + b * cos[j];
                    }
                }
            }
        });
}

/// Adds `bias` to every row of `y` (rows of `bias.len()`).
pub fn bias_forward(y: &mut [f32], bias: &[f32]) {
    let d = bias.len();
    y.par_chunks_mut(d * ROW_CHUNK).for_each(|yc| {
        for row in yc.chunks_exact_mut(d) {
            row.iter_mut().zip(bias).for_each(|(v, &b)| *v += b);
        }
    });
}

/// Backward of [`bias_forward`]: `db += Σ_rows dy`, summed in fixed chunks in a fixed order.
pub fn bias_backward(dy: &[f32], db: &mut [f32]) {
    let d = db.len();
    let partials: Vec<Vec<f32>> = dy
        .par_chunks(d * ROW_CHUNK)
        .map(|c| {
            let mut p = vec![0f32; d];
            for row in c.chunks_exact(d) {
                p.iter_mut().zip(row).for_each(|(a, &v)| *a += v);
            }
            p
        })
        .collect();
    for p in partials {
        db.iter_mut().zip(p).for_each(|(g, v)| *g += v);
    }
}

/// The gated feed-forward's product `h = act(g) * u` (`Features::ffn_act`).
pub fn gated_forward(act: FfnAct, g: &[f32], u: &[f32], h: &mut [f32]) {
    match act {
        FfnAct::Silu => swiglu_forward(g, u, h),
        FfnAct::GeluTanh => geglu_forward(g, u, h),
    }
}

/// Backward of [`gated_forward`]; overwrites `dg` and `du`.
pub fn gated_backward(
    act: FfnAct,
    g: &[f32],
    u: &[f32],
    dh: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
) {
    match act {
        FfnAct::Silu => swiglu_backward(g, u, dh, dg, du),
        FfnAct::GeluTanh => geglu_backward(g, u, dh, dg, du),
    }
}

/// `k = 2 sqrt(2/π)`: GELU's tanh approximation is `g σ(k (g + 0.044715 g³))`, since
/// `(1 + tanh z) / 2 = σ(2z)`; the inference engine computes it in this form.
const GELU_K: f32 = 1.595_769_2;
const GELU_C: f32 = 0.044_715;

/// GeGLU `h = gelu_tanh(g) * u` (Gemma's gate).
pub fn geglu_forward(g: &[f32], u: &[f32], h: &mut [f32]) {
    elementwise_gate(g, u, h, |a| a * sigmoid(GELU_K * (a + GELU_C * a * a * a)));
}

/// Backward of [`geglu_forward`]: with `s = σ(k(g + c g³))`,
/// `gelu'(g) = s + g s (1 - s) k (1 + 3 c g²)`; `dg = dh u gelu'(g)`, `du = dh gelu(g)`.
pub fn geglu_backward(g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
    elementwise_gate_grad(g, u, dh, dg, du, |a, b, d| {
        let s = sigmoid(GELU_K * (a + GELU_C * a * a * a));
        let dgelu = s + a * s * (1.0 - s) * GELU_K * (1.0 + 3.0 * GELU_C * a * a);
        (d * b * dgelu, d * a * s)
    });
}

/// `x *= f`.
pub fn scale(x: &mut [f32], f: f32) {
    x.par_chunks_mut(4096)
        .for_each(|c| c.iter_mut().for_each(|v| *v *= f));
}

/// SwiGLU `h = silu(g) * u`.
pub fn swiglu_forward(g: &[f32], u: &[f32], h: &mut [f32]) {
    elementwise_gate(g, u, h, |a| a * sigmoid(a));
}

/// Backward of [`swiglu_forward`]: `dg = dh u σ(g)(1 + g(1-σ(g)))`, `du = dh silu(g)`.
pub fn swiglu_backward(g: &[f32], u: &[f32], dh: &[f32], dg: &mut [f32], du: &mut [f32]) {
    elementwise_gate_grad(g, u, dh, dg, du, |a, b, d| {
        let s = sigmoid(a);
        (d * b * s * (1.0 + a * (1.0 - s)), d * a * s)
    });
}

/// `h = act(g) * u`, element by element, in parallel chunks.
fn elementwise_gate(g: &[f32], u: &[f32], h: &mut [f32], act: impl Fn(f32) -> f32 + Sync) {
    h.par_chunks_mut(4096)
        .zip(g.par_chunks(4096).zip(u.par_chunks(4096)))
        .for_each(|(hc, (gc, uc))| {
            for ((o, &a), &b) in hc.iter_mut().zip(gc).zip(uc) {
                *o = act(a) * b;
            }
        });
}

/// `(dg, du) = grad(g, u, dh)`, element by element, in parallel chunks.
fn elementwise_gate_grad(
    g: &[f32],
    u: &[f32],
    dh: &[f32],
    dg: &mut [f32],
    du: &mut [f32],
    grad: impl Fn(f32, f32, f32) -> (f32, f32) + Sync,
) {
    dg.par_chunks_mut(4096)
        .zip(du.par_chunks_mut(4096))
        .zip(
            g.par_chunks(4096)
                .zip(u.par_chunks(4096))
                .zip(dh.par_chunks(4096)),
        )
        .for_each(|((dgc, duc), ((gc, uc), dhc))| {
            for i in 0..gc.len() {
                (dgc[i], duc[i]) = grad(gc[i], uc[i], dhc[i]);
            }
        });
}
