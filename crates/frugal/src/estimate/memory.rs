//! Parameter counts and weight bytes, computed from the architecture.
//!
//! The count is rebuilt matrix by matrix from the configuration rather than taken from a
//! model's name, because names round ("7B" is 6.74B) and because a mixture of experts needs
//! two numbers: every expert must sit in memory (total), but a token runs through only a few
//! (active), which is what sets the compute per token.
//!
//! Active parameters here exclude the input embedding table: a token reads one row of it, not
//! the table. Publishers differ on this (Mixtral and DeepSeek quote figures close to either
//! convention, Qwen3 counts the table, gpt-oss does not), so both figures are reported.

use serde::Serialize;

use super::desc::{Attention, Ffn, ModelDesc, Norm};
use super::{Format, Result, to_u64};

/// Parameters by part, and the totals.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ParamCount {
    /// Every weight.
    pub total: u64,
    /// Weights a token passes through: total less the input embedding (and learned position)
    /// tables and the experts it is not routed to.
    pub active: u64,
    /// `active` plus the input embedding and position tables.
    pub active_with_embedding: u64,
    /// Input embedding table (plus a learned position table, if any).
    pub embedding: u64,
    /// Output projection; 0 when tied to the input embedding.
    pub output_head: u64,
    /// Attention projections (and their biases, norms and sinks), all layers.
    pub attention: u64,
    /// Dense FFNs, all layers that have one.
    pub dense_ffn: u64,
    /// Routed experts, all layers.
    pub routed_experts: u64,
    /// Routed experts a token actually uses, all layers.
    pub routed_experts_active: u64,
    /// Shared (always-on) experts, all layers.
    pub shared_experts: u64,
    /// Expert routers, all layers.
    pub routers: u64,
    /// Normalization weights, all layers plus the final norm.
    pub norms: u64,
}

impl ParamCount {
    /// Counts the parameters a description implies.
    pub fn of(d: &ModelDesc) -> Result<ParamCount> {
        let h = d.hidden as u128;
        let l = &d.layout;
        let norm_w: u128 = match l.norm {
            Norm::Rms => 1,
            Norm::LayerNorm => 2,
        };
        let attn: u128 = match &d.attention {
            Attention::Mla(m) => {
                let nh = d.n_heads as u128;
                let qk = (m.qk_nope_head_dim + m.qk_rope_head_dim) as u128;
                let q = match m.q_lora_rank {
                    // Down-projection, its norm, up-projection to every head's query.
                    Some(r) => h * r as u128 + r as u128 + r as u128 * nh * qk,
                    None => h * nh * qk,
                };
                let r = m.kv_lora_rank as u128;
                let rope = m.qk_rope_head_dim as u128;
                // Latent + shared RoPE key down-projection, latent norm, up-projection to every
                // head's key (no-RoPE part) and value, output projection.
                q + h * (r + rope)
                    + r
                    + r * nh * (m.qk_nope_head_dim as u128 + m.v_head_dim as u128)
                    + nh * m.v_head_dim as u128 * h
            }
            Attention::Standard => {
                let q = (d.n_heads * d.head_dim) as u128;
                let kv = (d.n_kv_heads * d.head_dim) as u128;
                let mut p = h * q + 2 * h * kv + q * h;
                if l.qkv_bias {
                    p += q + 2 * kv;
                }
                if l.out_bias {
                    p += h;
                }
                if l.qk_norm {
                    p += 2 * d.head_dim as u128;
                }
                if l.attention_sinks {
                    p += d.n_heads as u128;
                }
                p
            }
        };
        let mlp = |ff: u128| -> u128 {
            match l.ffn {
                Ffn::Gated => 3 * h * ff + if l.mlp_bias { 2 * ff + h } else { 0 },
                Ffn::Plain => 2 * h * ff + if l.mlp_bias { ff + h } else { 0 },
            }
        };
        let layers = d.n_layers as u128;
        let norms = layers * l.norms_per_layer as u128 * h * norm_w + h * norm_w;
        let (moe_layers, routed, routed_active, shared, routers) = match &d.moe {
            None => (0u128, 0u128, 0u128, 0u128, 0u128),
            Some(m) => {
                let ml = m.moe_layers as u128;
                let e = m.experts as u128;
                let one = mlp(m.expert_ff as u128);
                let shared = if m.shared_ff > 0 {
                    mlp(m.shared_ff as u128)
                } else {
                    0
                };
                let router = h * e + if l.mlp_bias { e } else { 0 };
                (
                    ml,
                    ml * e * one,
                    ml * m.experts_per_token as u128 * one,
                    ml * shared,
                    ml * router,
                )
            }
        };
        let dense_ffn = (layers - moe_layers) * mlp(d.ff as u128);
        let attention = layers * attn;
        let vocab = d.vocab as u128;
        let mut embedding = vocab * h;
        if l.learned_positions {
            embedding += d.max_context.unwrap_or(0) as u128 * h;
        }
        let output_head = if d.tie_embeddings { 0 } else { vocab * h };
        let total =
            attention + dense_ffn + routed + shared + routers + norms + embedding + output_head;
        let active = attention + dense_ffn + routed_active + shared + routers + norms + output_head;
        let c = |v: u128| to_u64(v, "parameter count");
        Ok(ParamCount {
            total: c(total)?,
            active: c(active)?,
            active_with_embedding: c(active + embedding)?,
            embedding: c(embedding)?,
            output_head: c(output_head)?,
            attention: c(attention)?,
            dense_ffn: c(dense_ffn)?,
            routed_experts: c(routed)?,
            routed_experts_active: c(routed_active)?,
            shared_experts: c(shared)?,
            routers: c(routers)?,
            norms: c(norms)?,
        })
    }
}

/// Bytes of `params` weights stored in `f`, every tensor in that one format.
pub fn weight_bytes(params: u64, f: Format) -> u128 {
    f.bytes_for(params as u128)
}

/// Relative difference `computed / published - 1`.
pub fn rel_diff(computed: f64, published: f64) -> f64 {
    computed / published - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::catalog::Catalog;

    fn count(id: &str) -> (ParamCount, ModelDesc) {
        let d = Catalog::builtin().unwrap().describe(id).unwrap();
        (ParamCount::of(&d).unwrap(), d)
    }

    /// Published total and active counts must be matched within 2%.
    const TOL: f64 = 0.02;

    fn within(computed: u64, published: f64, what: &str) {
        let r = rel_diff(computed as f64, published);
        assert!(
            r.abs() <= TOL,
            "{what}: computed {computed}, published {published}, off by {:.2}%",
            r * 100.0
        );
    }

    #[test]
    fn estimate_mixtral_8x7b_total_and_active_match_published() {
        // Mistral AI's announcement: 46.7B total, 12.9B used per token.
        let (p, _) = count("mixtral-8x7b-v0.1");
        within(p.total, 46.7e9, "total");
        within(p.active, 12.9e9, "active");
        within(p.active_with_embedding, 12.9e9, "active incl. embedding");
    }

    #[test]
    fn estimate_deepseek_v3_total_and_active_match_published() {
        // DeepSeek-V3 report (arXiv:2412.19437) abstract: 671B total, 37B activated per token
        // (the multi-token-prediction module is not part of the 671B).
        let (p, _) = count("deepseek-v3");
        within(p.total, 671e9, "total");
        within(p.active, 37e9, "active");
        within(p.active_with_embedding, 37e9, "active incl. embedding");
    }

    #[test]
    fn estimate_moe_counts_shared_experts_and_dense_layers() {
        let (p, d) = count("deepseek-v3");
        let m = d.moe.as_ref().unwrap();
        assert_eq!(m.moe_layers, 58, "3 leading dense layers of 61");
        assert!(p.dense_ffn > 0 && p.shared_experts > 0);
        // Removing the shared experts or the dense layers changes the count.
        let mut no_shared = d.clone();
        no_shared.moe.as_mut().unwrap().shared_ff = 0;
        assert!(ParamCount::of(&no_shared).unwrap().active < p.active);
        // Dense FFN on 3 layers of width 18432: 3 x 3 x 7168 x 18432.
        assert_eq!(p.dense_ffn, 3 * 3 * 7168 * 18432);
        // Shared: 58 layers x 1 expert x 3 x 7168 x 2048.
        assert_eq!(p.shared_experts, 58 * 3 * 7168 * 2048);
    }

    #[test]
    fn estimate_every_catalog_total_is_near_its_published_count() {
        // Published counts are rounded labels ("7B" for 6.74B), so this checks the layout
        // arithmetic for gross errors: within 4% for every model, 2% for most.
        let c = Catalog::builtin().unwrap();
        for e in &c.models {
            let d = c.to_desc(e).unwrap();
            let p = ParamCount::of(&d).unwrap();
            let r = rel_diff(p.total as f64, e.params_total_published.unwrap());
            assert!(r.abs() < 0.04, "{}: {:.2}%", e.id, r * 100.0);
        }
    }

    #[test]
    fn estimate_exact_counts_from_independent_sources() {
        // The reference sheet's SmolLM2-135M GGUF holds 134,515,008 parameters.
        assert_eq!(count("smollm2-135m").0.total, 134_515_008);
        // Gemma 2 report Table 2: 8,324,201,984 non-embedding parameters for 9B.
        let (g, _) = count("gemma-2-9b");
        assert_eq!(g.total - g.embedding, 8_324_201_984);
    }

    #[test]
    fn estimate_weight_bytes_per_format() {
        assert_eq!(weight_bytes(1000, Format::Bf16), 2000);
        assert_eq!(weight_bytes(32, Format::Q4_0), 18);
        assert_eq!(weight_bytes(32, Format::Mxfp4), 17);
        assert_eq!(weight_bytes(256, Format::Q4K), 144);
    }
}
