//! Finite-difference checks of every backward, on small random shapes that are not multiples of
//! any SIMD width, and of the whole model.
//!
//! The forward functions compute in f32; each check's scalar loss `L = Σ r ⊙ f(x)` (random `r`)
//! is summed in f64 and differentiated by central differences with step `EPS`. Truncation error
//! is O(EPS²·f''') ≈ 1e-4 relative for these smooth functions and f32 rounding adds about
//! `|L|·6e-8 / EPS` ≈ 1e-5 absolute, so a gradient passes when
//! `|analytic - numeric| <= 2e-2·max(|analytic|, |numeric|) + 2e-4`. A wrong backward (a missing
//! term, a transposed index) misses by O(1) relative.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::attention::{self, AttnDims};
use crate::gemm::Precision;
use crate::loss::{Divergence, Objective, Targets, TeacherRows};
use crate::model::{Batch, RunOptions};
use crate::ops::{self, Rope};
use crate::params::{Params, normal};
use frugal::model::features::{FfnAct, RopeStyle};
use frugal::ops::{RopeScaling, Yarn};

mod families;

pub(crate) use families::{tiny_gemma3_config, tiny_phi3_config, tiny_qwen2_config};

const EPS: f32 = 2e-3;
const RTOL: f64 = 2e-2;
const ATOL: f64 = 2e-4;

fn randn(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| normal(rng) * std).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

/// Compares `analytic` with central differences of `f` around `x`, at every element (or at
/// `sample` evenly spread ones).
fn check(
    name: &str,
    x: &[f32],
    analytic: &[f32],
    sample: Option<usize>,
    f: impl Fn(&[f32]) -> f64,
) {
    assert_eq!(x.len(), analytic.len(), "{name}");
    let idx: Vec<usize> = match sample {
        Some(s) if s < x.len() => (0..s)
            .map(|i| i * x.len() / s + (i % 3))
            .map(|i| i.min(x.len() - 1))
            .collect(),
        _ => (0..x.len()).collect(),
    };
    let mut xp = x.to_vec();
    for i in idx {
        let orig = xp[i];
        xp[i] = orig + EPS;
        let lp = f(&xp);
        xp[i] = orig - EPS;
        let lm = f(&xp);
        xp[i] = orig;
        let num = (lp - lm) / (2.0 * f64::from(EPS));
        let ana = f64::from(analytic[i]);
        let tol = RTOL * num.abs().max(ana.abs()) + ATOL;
        assert!(
            (ana - num).abs() <= tol,
            "{name}[{i}]: analytic {ana:.6e}, numeric {num:.6e}"
        );
    }
}

#[test]
fn linear_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (n, i, o) = (3, 7, 5);
    let (x, w, r) = (
        randn(&mut rng, n * i, 1.0),
        randn(&mut rng, o * i, 1.0),
        randn(&mut rng, n * o, 1.0),
    );
    let f = |x: &[f32], w: &[f32]| {
        let mut y = vec![0f32; n * o];
        ops::linear_forward(x, w, i, &mut y, Precision::F32);
        dot(&y, &r)
    };
    let (mut dx, mut dw) = (vec![0f32; n * i], vec![0f32; o * i]);
    ops::linear_backward(
        &x,
        &w,
        &r,
        Some((&mut dx, false)),
        Some(&mut dw),
        i,
        Precision::F32,
    );
    check("dx", &x, &dx, None, |x| f(x, &w));
    check("dw", &w, &dw, None, |w| f(&x, w));
}

#[test]
fn rmsnorm_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let (n, d) = (3, 13);
    let (x, w, r) = (
        randn(&mut rng, n * d, 1.0),
        randn(&mut rng, d, 1.0),
        randn(&mut rng, n * d, 1.0),
    );
    let f = |x: &[f32], w: &[f32]| {
        let (mut y, mut rs) = (vec![0f32; n * d], vec![0f32; n]);
        ops::rmsnorm_forward(x, w, 1e-5, &mut y, &mut rs);
        dot(&y, &r)
    };
    let (mut y, mut rs) = (vec![0f32; n * d], vec![0f32; n]);
    ops::rmsnorm_forward(&x, &w, 1e-5, &mut y, &mut rs);
    let (mut dx, mut dw) = (vec![0f32; n * d], vec![0f32; d]);
    ops::rmsnorm_backward(&x, &w, &rs, &r, &mut dx, &mut dw);
    check("dx", &x, &dx, None, |x| f(x, &w));
    check("dw", &w, &dw, None, |w| f(&x, w));
}

/// YaRN over an original context of 4 (so the ramp spans the pairs) with Llama 3 style
/// frequency factors: cos and sin scaled by YaRN's `1 + 0.1 ln(factor)` and an attention
/// factor, so the rotation is not orthogonal and its backward must be the transpose.
fn scaled_rope() -> RopeScaling {
    RopeScaling {
        freq_factors: Some(vec![1.0, 4.0, 2.5]),
        freq_scale: 0.25,
        yarn: Some(Yarn {
            orig_ctx: 4,
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        mscale: 1.2 * (1.0 + 0.1 * 4f32.ln()),
    }
}

#[test]
fn rope_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    // Two sequences of 5 positions, 3 heads of 8 dims of which 6 are rotated: the leading 6
    // or the trailing 6 (an MLA query head); adjacent pairs or split halves; plain or scaled.
    let (seq, heads, hd) = (5, 3, 8);
    let n = 2 * seq * heads * hd;
    let (x, r) = (randn(&mut rng, n, 1.0), randn(&mut rng, n, 1.0));
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        for scaling in [RopeScaling::default(), scaled_rope()] {
            let table = Rope::new(seq, 6, 100.0, style, &scaling);
            for offset in [0, 2] {
                let f = |x: &[f32]| {
                    let mut y = x.to_vec();
                    ops::rope(&mut y, (heads, hd, offset), seq, &table, false);
                    dot(&y, &r)
                };
                let mut dx = r.clone();
                ops::rope(&mut dx, (heads, hd, offset), seq, &table, true);
                check("dx", &x, &dx, None, f);
            }
        }
    }
}

/// The training tables are the inference engine's, plain and scaled.
#[test]
fn rope_tables_are_the_inference_engines() {
    let (seq, rd, base) = (7, 6, 500.0);
    for scaling in [RopeScaling::default(), scaled_rope()] {
        let t = Rope::new(seq, rd, base, RopeStyle::Neox, &scaling);
        let mut want = frugal::ops::RopeTable::default();
        want.set_scaling(&scaling);
        want.fill(0, seq, rd, base);
        assert_eq!((t.cos, t.sin), (want.cos, want.sin));
    }
}

#[test]
fn bias_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    let (n, d) = (70, 5);
    let (y, b, r) = (
        randn(&mut rng, n * d, 1.0),
        randn(&mut rng, d, 1.0),
        randn(&mut rng, n * d, 1.0),
    );
    let f = |b: &[f32]| {
        let mut z = y.clone();
        ops::bias_forward(&mut z, b);
        dot(&z, &r)
    };
    let mut db = vec![0f32; d];
    ops::bias_backward(&r, &mut db);
    check("db", &b, &db, None, f);
}

#[test]
fn geglu_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(13);
    let n = 37;
    let (g, u, r) = (
        randn(&mut rng, n, 2.0),
        randn(&mut rng, n, 1.0),
        randn(&mut rng, n, 1.0),
    );
    let f = |g: &[f32], u: &[f32]| {
        let mut h = vec![0f32; n];
        ops::gated_forward(FfnAct::GeluTanh, g, u, &mut h);
        dot(&h, &r)
    };
    let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
    ops::gated_backward(FfnAct::GeluTanh, &g, &u, &r, &mut dg, &mut du);
    check("dg", &g, &dg, None, |g| f(g, &u));
    check("du", &u, &du, None, |u| f(&g, u));
    // The inference engine's GELU (its own exp) gives the same values.
    let mut h = vec![0f32; n];
    ops::geglu_forward(&g, &u, &mut h);
    let mut want = g.clone();
    frugal::ops::geglu_tanh(&mut want, &u);
    for (a, b) in h.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
    }
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let n = 37;
    let (g, u, r) = (
        randn(&mut rng, n, 2.0),
        randn(&mut rng, n, 1.0),
        randn(&mut rng, n, 1.0),
    );
    let f = |g: &[f32], u: &[f32]| {
        let mut h = vec![0f32; n];
        ops::swiglu_forward(g, u, &mut h);
        dot(&h, &r)
    };
    let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
    ops::swiglu_backward(&g, &u, &r, &mut dg, &mut du);
    check("dg", &g, &dg, None, |g| f(g, &u));
    check("du", &u, &du, None, |u| f(&g, u));
}

fn attention_case(n_head: usize, n_head_kv: usize, window: Option<usize>, scale: f32) {
    let mut rng = ChaCha8Rng::seed_from_u64(5 + n_head_kv as u64);
    let dims = AttnDims {
        batch: 2,
        seq: 5,
        n_head,
        n_head_kv,
        head_dim: 6,
        window,
        scale,
    };
    let rows = dims.batch * dims.seq;
    let (qw, kw) = (n_head * 6, n_head_kv * 6);
    let (q, k, v) = (
        randn(&mut rng, rows * qw, 1.0),
        randn(&mut rng, rows * kw, 1.0),
        randn(&mut rng, rows * kw, 1.0),
    );
    let r = randn(&mut rng, rows * qw, 1.0);
    let run = |q: &[f32], k: &[f32], v: &[f32], probs: &mut Vec<f32>| {
        probs.resize(dims.probs_len(), 0.0);
        let mut o = vec![0f32; rows * qw];
        attention::attention_forward(q, k, v, dims, probs, &mut o, Precision::F32);
        o
    };
    let f = |q: &[f32], k: &[f32], v: &[f32]| dot(&run(q, k, v, &mut Vec::new()), &r);
    let mut probs = Vec::new();
    let o = run(&q, &k, &v, &mut probs);
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; rows * qw],
        vec![0f32; rows * kw],
        vec![0f32; rows * kw],
    );
    attention::attention_backward(
        &q,
        &k,
        &v,
        &probs,
        &o,
        &r,
        dims,
        &mut dq,
        &mut dk,
        &mut dv,
        Precision::F32,
    );
    check("dq", &q, &dq, None, |q| f(q, &k, &v));
    check("dk", &k, &dk, None, |k| f(&q, k, &v));
    check("dv", &v, &dv, None, |v| f(&q, &k, v));
}

#[test]
fn attention_backward_matches_finite_differences_mha_gqa_mqa() {
    let plain = 1.0 / 6f32.sqrt();
    attention_case(4, 4, None, plain);
    attention_case(4, 2, None, plain);
    attention_case(3, 1, None, plain);
}

/// A sliding window of 3 over sequences of 5 (queries from position 3 on lose keys) and a
/// query scale of its own.
#[test]
fn windowed_attention_backward_matches_finite_differences() {
    attention_case(4, 2, Some(3), 0.7);
    attention_case(3, 1, Some(1), 0.3);
}

/// Under a window, a query's probabilities are zero before it and sum to one inside it.
#[test]
fn window_masks_keys_before_it() {
    let dims = AttnDims {
        batch: 1,
        seq: 6,
        n_head: 1,
        n_head_kv: 1,
        head_dim: 2,
        window: Some(2),
        scale: 1.0,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(14);
    let (q, k, v) = (
        randn(&mut rng, 12, 1.0),
        randn(&mut rng, 12, 1.0),
        randn(&mut rng, 12, 1.0),
    );
    let mut probs = vec![0f32; dims.probs_len()];
    let mut o = vec![0f32; 12];
    attention::attention_forward(&q, &k, &v, dims, &mut probs, &mut o, Precision::F32);
    for (i, row) in probs.chunks_exact(6).enumerate() {
        for (j, &p) in row.iter().enumerate() {
            let seen = j <= i && j + 2 > i;
            assert_eq!(p > 0.0, seen, "query {i} key {j}: {p}");
        }
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}

#[test]
fn embedding_backward_scatters_rows() {
    let mut d = vec![0f32; 4 * 3];
    ops::embedding_backward(&mut d, &[2, 0, 2], 3, &[1., 2., 3., 4., 5., 6., 7., 8., 9.]);
    assert_eq!(d, [4., 5., 6., 0., 0., 0., 8., 10., 12., 0., 0., 0.]);
}

fn loss_case(teacher: Option<TeacherRows>, alpha: f32, tau: f32, div: Divergence) {
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (rows, nv) = (3, 11);
    let z = randn(&mut rng, rows * nv, 2.0);
    let t = Targets {
        labels: &[4, 0, 10],
        teacher,
        alpha,
        temperature: tau,
        divergence: div,
        step_rows: rows,
    };
    let f = |z: &[f32]| t.rows(0..rows, &mut z.to_vec(), false).objective / rows as f64;
    let mut g = z.clone();
    let sums = t.rows(0..rows, &mut g, true);
    assert!((sums.objective / rows as f64 - f(&z)).abs() < 1e-9);
    check("dz", &z, &g, None, f);
}

#[test]
fn losses_backward_match_finite_differences() {
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let (t1, t2) = (randn(&mut rng, 33, 2.0), randn(&mut rng, 33, 2.0));
    loss_case(None, 0.0, 1.0, Divergence::Forward);
    loss_case(
        Some(TeacherRows::Dense(vec![(&t1, 1.0)])),
        0.3,
        1.0,
        Divergence::Forward,
    );
    loss_case(
        Some(TeacherRows::Dense(vec![(&t1, 1.0)])),
        0.7,
        2.0,
        Divergence::Forward,
    );
    loss_case(
        Some(TeacherRows::Dense(vec![(&t1, 1.0)])),
        1.0,
        4.0,
        Divergence::Reverse,
    );
    loss_case(
        Some(TeacherRows::Dense(vec![(&t1, 2.0), (&t2, 1.0)])),
        0.5,
        2.0,
        Divergence::Forward,
    );
    loss_case(
        Some(TeacherRows::Dense(vec![(&t1, 1.0), (&t2, 1.0)])),
        0.5,
        1.5,
        Divergence::Reverse,
    );
    let ids = [1u32, 5, 7, 0, 3, 9, 10, 2, 4];
    let logp = [-0.5f32, -1.5, -2.0, -0.2, -2.5, -3.0, -1.0, -1.1, -1.2];
    loss_case(
        Some(TeacherRows::TopK {
            k: 3,
            ids: &ids,
            logp: &logp,
        }),
        0.8,
        2.0,
        Divergence::Forward,
    );
}

/// A tiny model with every feature the forward reads: GQA, RoPE on part of each head, tied or
/// untied head.
pub(crate) fn tiny_config() -> frugal::model::Config {
    frugal::model::Config {
        rope_scaling: Default::default(),
        long_rope: None,
        moe: None,
        arch: "llama".into(),
        n_layers: 2,
        n_embd: 12,
        n_ff: 20,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 6,
        n_vocab: 17,
        n_ctx_train: 64,
        rms_eps: 1e-5,
        rope_base: 10_000.0,
        rope_dim: 4,
        mla: None,
        features: Default::default(),
    }
}

/// [`tiny_config`] with multi-head latent attention: a latent of 5, keys of 4 + 2 (RoPE) dims,
/// values of 3 (narrower than the keys, so the padding of values is exercised too).
pub(crate) fn tiny_latent_config() -> frugal::model::Config {
    frugal::model::Config {
        moe: None,
        arch: "deepseek2".into(),
        n_head_kv: 1,
        rope_dim: 2,
        mla: Some(frugal::model::Mla {
            kv_lora_rank: 5,
            nope_dim: 4,
            rope_dim: 2,
            v_dim: 3,
        }),
        ..tiny_config()
    }
}

pub(super) fn whole_model_case(c: frugal::model::Config, tied: bool, recompute: bool) {
    let mut p = Params::random(&c, tied, 3);
    // Under latent attention, train the latent rows at a scale of their own in one case.
    if tied {
        for l in &mut p.layers {
            if let crate::KvParams::Latent { kv_a, .. } = &mut l.kv {
                kv_a.stored = crate::Stored::ScaledRows {
                    rows: 5,
                    scale: 0.25,
                };
            }
        }
    }
    whole_model_check(p, recompute);
}

/// Every parameter's gradient of the whole model's loss against finite differences, at 12
/// elements a tensor, with larger weights than pre-training's so every path carries a visible
/// gradient.
pub(super) fn whole_model_check(mut p: Params, recompute: bool) {
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    for t in p.tensors_mut() {
        for v in &mut t.data {
            *v += normal(&mut rng) * 0.3;
        }
    }
    let tokens = [1u32, 5, 9, 16, 2, 2, 7, 0, 11, 3];
    let labels = [5u32, 9, 16, 2, 4, 7, 0, 11, 3, 8];
    let b = Batch {
        tokens: &tokens,
        batch: 2,
        seq: 5,
    };
    let opts = RunOptions {
        precision: Precision::F32,
        recompute,
        ..RunOptions::default()
    };
    let obj = Targets::hard(&labels);
    let mut grads = p.zeros_like();
    let saved = p.forward(&b, opts);
    p.backward(&b, saved, &obj, Vec::new(), &mut grads, opts);
    let names: Vec<String> = p.tensors().iter().map(|t| t.name.clone()).collect();
    for (ti, name) in names.iter().enumerate() {
        let x = p.tensors()[ti].data.clone();
        let g = grads.tensors()[ti].data.clone();
        let f = |x: &[f32]| {
            let mut q = p.clone();
            q.tensors_mut()[ti].data.copy_from_slice(x);
            q.loss(&b, &obj, Precision::F32).mean_objective()
        };
        check(name, &x, &g, Some(12), f);
    }
}

#[test]
fn whole_model_gradient_matches_finite_differences() {
    whole_model_case(tiny_config(), true, true);
    whole_model_case(tiny_config(), false, false);
}

#[test]
fn latent_attention_gradient_matches_finite_differences() {
    whole_model_case(tiny_latent_config(), true, false);
    whole_model_case(tiny_latent_config(), false, true);
}

/// [`tiny_config`] with routed FFNs: 4 experts of 6 neurons, 2 per token.
fn tiny_moe_config(
    gating: frugal::model::Gating,
    norm_weights: bool,
    weights_scale: f32,
    n_ff_shared: usize,
) -> frugal::model::Config {
    frugal::model::Config {
        moe: Some(frugal::model::MoeConfig {
            n_expert: 4,
            n_used: 2,
            gating,
            norm_weights,
            weights_scale,
            n_ff_shared,
        }),
        n_ff: 6,
        ..tiny_config()
    }
}

/// The routed FFN's backward through experts, weights, renormalization, gating, shared expert
/// and router, inside the whole model. A top-k choice that flips under a step of `EPS` would
/// make the numeric gradient jump; at these seeds no sampled step flips one (a flip shows as an
/// O(1) miss, not as a small one).
#[test]
fn routed_ffn_gradient_matches_finite_differences() {
    use frugal::model::Gating;
    whole_model_case(tiny_moe_config(Gating::Softmax, true, 1.0, 5), true, false);
    whole_model_case(tiny_moe_config(Gating::Sigmoid, false, 2.5, 0), false, true);
    // Experts gated by GELU, as a GELU family's routed FFN runs them.
    let mut gelu = tiny_moe_config(Gating::Sigmoid, false, 2.5, 5);
    gelu.features.ffn_act = FfnAct::GeluTanh;
    whole_model_case(gelu, false, true);
}

/// A selection bias changes which experts run and is never trained: its gradient is zero.
#[test]
fn selection_bias_steers_routing_and_gets_no_gradient() {
    use frugal::model::Gating;
    let c = tiny_moe_config(Gating::Softmax, true, 1.0, 0);
    let mut p = Params::random(&c, true, 3);
    let tokens = [1u32, 5, 9, 16, 2, 2, 7, 0, 11, 3];
    let labels = [5u32, 9, 16, 2, 4, 7, 0, 11, 3, 8];
    let b = Batch {
        tokens: &tokens,
        batch: 2,
        seq: 5,
    };
    let obj = Targets::hard(&labels);
    let before = p.loss(&b, &obj, Precision::F32).mean_objective();
    for (l, lp) in p.layers.iter_mut().enumerate() {
        let crate::FfnParams::Routed(r) = &mut lp.ffn else {
            panic!("routed config gives routed layers")
        };
        let mut bias = crate::Tensor::vector(format!("blk.{l}.exp_probs_b.bias"), 4);
        bias.data = vec![10.0, 0.0, 0.0, 10.0];
        r.selection_bias = Some(bias);
    }
    let opts = RunOptions {
        precision: Precision::F32,
        recompute: false,
        ..RunOptions::default()
    };
    let mut grads = p.zeros_like();
    let saved = p.forward(&b, opts);
    let after = p.backward(&b, saved, &obj, Vec::new(), &mut grads, opts);
    assert_ne!(before, after.mean_objective(), "the bias moved the choice");
    for (t, g) in p.tensors().iter().zip(grads.tensors()) {
        if t.name.ends_with("exp_probs_b.bias") {
            assert!(g.data.iter().all(|&v| v == 0.0), "{}", t.name);
        }
    }
}

/// The routed block alone with the Switch balancing loss: `L = Σ r ⊙ y + aux E Σ f_i P_i`,
/// differentiated through the router and the input (with `f_i` held, as the loss defines it,
/// and constant under steps that flip no choice).
#[test]
fn routed_block_with_balancing_loss_matches_finite_differences() {
    use crate::moe::{MoeActs, RoutedFfn, aux_loss, routed_backward, routed_forward};
    use frugal::model::{Gating, MoeConfig};
    let m = MoeConfig {
        n_expert: 4,
        n_used: 2,
        gating: Gating::Softmax,
        norm_weights: true,
        weights_scale: 1.0,
        n_ff_shared: 0,
    };
    let (n, d, ff, aux) = (6, 5, 3, 0.7);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut p = RoutedFfn::zeros(&m, 0, d, ff);
    for t in p.tensors_mut() {
        t.data = randn(&mut rng, t.data.len(), 0.8);
    }
    let x = randn(&mut rng, n * d, 1.0);
    let r = randn(&mut rng, n * d, 1.0);
    let loss = |p: &RoutedFfn, x: &[f32]| {
        let mut a = MoeActs::default();
        let mut y = vec![0f32; n * d];
        routed_forward(
            &m,
            p,
            x,
            d,
            (ff, FfnAct::Silu),
            &mut a,
            &mut y,
            Precision::F32,
        );
        dot(&y, &r) + aux_loss(&m, &a, aux)
    };
    let mut a = MoeActs::default();
    let mut y = vec![0f32; n * d];
    routed_forward(
        &m,
        &p,
        &x,
        d,
        (ff, FfnAct::Silu),
        &mut a,
        &mut y,
        Precision::F32,
    );
    let mut g = p.clone();
    for t in g.tensors_mut() {
        t.data.fill(0.0);
    }
    let mut dx = vec![0f32; n * d];
    routed_backward(
        &m,
        &p,
        (&x, d, ff, FfnAct::Silu),
        &a,
        &r,
        &mut dx,
        &mut g,
        (Precision::F32, aux),
    );
    check("dx", &x, &dx, None, |x| loss(&p, x));
    check("router", &p.router.data, &g.router.data, None, |w| {
        let mut q = p.clone();
        q.router.data.copy_from_slice(w);
        loss(&q, &x)
    });
    // Without the loss the router's gradient differs: the term is really there.
    let mut g0 = g.clone();
    g0.router.data.fill(0.0);
    let mut dx0 = vec![0f32; n * d];
    routed_backward(
        &m,
        &p,
        (&x, d, ff, FfnAct::Silu),
        &a,
        &r,
        &mut dx0,
        &mut g0,
        (Precision::F32, 0.0),
    );
    assert_ne!(g0.router.data, g.router.data);
}
