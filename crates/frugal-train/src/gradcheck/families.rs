//! Finite-difference checks of the whole model for each family's switches: tiny
//! configurations of Qwen 2, Qwen 3, Phi-3, Gemma 3 and Llama with scaled RoPE and a window.

use frugal::model::features::{FfnAct, RopeStyle, Sliding};
use frugal::model::{Features, LongRope};
use frugal::ops::{RopeScaling, Yarn};

use super::{tiny_config, whole_model_case, whole_model_check};
use crate::params::Params;

/// Qwen 2's block on [`tiny_config`]: NeoX RoPE over 4 of each head's 6 dims, Q, K and V biases
/// (the family's) and an output bias (optional in every family).
pub(crate) fn tiny_qwen2_config() -> frugal::model::Config {
    frugal::model::Config {
        arch: "qwen2".into(),
        features: Features {
            rope: RopeStyle::Neox,
            ..Default::default()
        },
        ..tiny_config()
    }
}

/// Qwen 3's block: NeoX RoPE, per-head query and key norms, heads of 8 (not 12 / 4).
fn tiny_qwen3_config() -> frugal::model::Config {
    frugal::model::Config {
        arch: "qwen3".into(),
        head_dim: 8,
        rope_dim: 8,
        features: Features {
            rope: RopeStyle::Neox,
            qk_norm: true,
            ..Default::default()
        },
        ..tiny_config()
    }
}

/// Phi-3's block as trained (fused tensors are a file layout): NeoX RoPE over 4 of 6 dims, the
/// short factors chosen for the context, and an attention factor scaling cos and sin.
pub(crate) fn tiny_phi3_config() -> frugal::model::Config {
    let mut c = frugal::model::Config {
        arch: "phi3".into(),
        rope_scaling: RopeScaling {
            mscale: 1.15,
            ..Default::default()
        },
        long_rope: Some(LongRope {
            orig_ctx: 32,
            long: Some(vec![3.0, 5.0]),
            short: Some(vec![1.5, 2.5]),
        }),
        features: Features {
            rope: RopeStyle::Neox,
            ..Default::default()
        },
        ..tiny_config()
    };
    c.set_context(16);
    c
}

/// Gemma 3's block with every switch on: NeoX RoPE, query/key norms, post-norms, GELU gating,
/// the scaled embedding, heads of 8, a window of 3 in layer 0 (local, RoPE base 100, unscaled)
/// and linear scaling in layer 1 (global), and a query scale of its own.
pub(crate) fn tiny_gemma3_config() -> frugal::model::Config {
    frugal::model::Config {
        arch: "gemma3".into(),
        head_dim: 8,
        rope_dim: 8,
        rope_base: 1e6,
        rope_scaling: RopeScaling {
            freq_scale: 0.5,
            ..Default::default()
        },
        features: Features {
            rope: RopeStyle::Neox,
            qk_norm: true,
            post_norms: true,
            ffn_act: FfnAct::GeluTanh,
            embd_scale: Some(12f32.sqrt()),
            sliding: Some(Sliding {
                window: 3,
                period: 2,
                local_rope_base: Some(100.0),
            }),
            query_scale: Some(0.3),
        },
        ..tiny_config()
    }
}

/// Llama with Llama 3's frequency factors and YaRN (a ramp across the pairs, cos and sin scaled)
/// and a window of 3 in every layer (a `llama` file's `attention.sliding_window`).
fn tiny_llama_scaled_config() -> frugal::model::Config {
    frugal::model::Config {
        rope_scaling: RopeScaling {
            freq_factors: Some(vec![1.0, 4.0]),
            freq_scale: 0.25,
            yarn: Some(Yarn {
                orig_ctx: 4,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
            mscale: 1.0 + 0.1 * 4f32.ln(),
        },
        features: Features {
            sliding: Some(Sliding {
                window: 3,
                period: 3,
                local_rope_base: None,
            }),
            ..Default::default()
        },
        ..tiny_config()
    }
}

#[test]
fn qwen2_gradient_matches_finite_differences() {
    let mut p = Params::random(&tiny_qwen2_config(), false, 3);
    assert!(
        p.layers
            .iter()
            .all(|l| l.biases.q.is_some() && l.biases.v.is_some())
    );
    for (l, lp) in p.layers.iter_mut().enumerate() {
        lp.biases.o = Some(crate::Tensor::vector(
            format!("blk.{l}.attn_output.bias"),
            12,
        ));
    }
    whole_model_check(p, true);
}

#[test]
fn qwen3_gradient_matches_finite_differences() {
    whole_model_case(tiny_qwen3_config(), true, false);
}

#[test]
fn phi3_gradient_matches_finite_differences() {
    whole_model_case(tiny_phi3_config(), false, true);
}

#[test]
fn gemma3_gradient_matches_finite_differences() {
    whole_model_case(tiny_gemma3_config(), true, false);
    whole_model_case(tiny_gemma3_config(), false, true);
    // Gemma 3 270M's layout: one key/value head shared by every query head, the heads together
    // wider than the model (4 x 256 over 640 there, 4 x 8 over 12 here).
    whole_model_case(
        frugal::model::Config {
            n_head_kv: 1,
            ..tiny_gemma3_config()
        },
        true,
        false,
    );
}

#[test]
fn scaled_rope_and_llama_window_gradient_matches_finite_differences() {
    whole_model_case(tiny_llama_scaled_config(), true, true);
}
