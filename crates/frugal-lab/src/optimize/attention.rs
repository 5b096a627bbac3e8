//! The attention-layout stage of the ladder: fewer KV bytes per token, for when a memory
//! target at a long context binds.
//!
//! A per-head model converts to fewer KV groups (mean-pooled heads: `gqa:G`, `mqa`) or to
//! latent attention (`mla:RANK`, factorized from the projections' outputs on the calibration
//! text, 32 RoPE dims as `frugal report attention` uses). None of these computes the same
//! function, so each usually wants healing ([`super::distill`]) before it is quantized again.
//! A model that cannot take a layout (MLA outside the Llama family, regrouping a model whose
//! heads do not divide) is skipped with the reason.

use anyhow::{Context, Result};
use frugal::gguf::GgufFile;
use frugal::model::Config;
use frugal::surgery::{self, AttentionLayout, Factorization, MlaTarget};

use super::prune::Calibration;

/// Dims of the shared RoPE key of an MLA conversion.
pub const MLA_ROPE_DIMS: usize = 32;

/// `file` converted to `layout` (`gqa:G`, `mqa`, `mla:RANK`).
pub fn apply(file: &GgufFile, layout: &str, cal: &Calibration) -> Result<GgufFile> {
    let bytes = if let Some(rank) = layout.strip_prefix("mla:") {
        let rank: usize = rank
            .parse()
            .with_context(|| format!("{layout}: the rank is not a number"))?;
        let model =
            crate::build::load_file(GgufFile::from_bytes(file.raw_bytes().to_vec())?, false)?;
        let calib = surgery::calibrate(&model, cal.for_cuts(), cal.ctx)?;
        let target = MlaTarget {
            rank,
            rope_dims: MLA_ROPE_DIMS,
            factorization: Factorization::Activations,
        };
        surgery::convert_to_mla(file, &calib, target)?
            .0
            .to_bytes()?
    } else {
        let l: AttentionLayout = layout.parse().map_err(anyhow::Error::msg)?;
        surgery::convert_attention(file, l)?.0.to_bytes()?
    };
    Ok(GgufFile::from_bytes(bytes)?)
}

/// The layouts that cut this model's KV cache: half the KV groups and one (when it has more
/// than one), and latent attention at a quarter and an eighth of its KV width (Llama family
/// only: refused for others with the reason).
pub fn layouts(c: &Config) -> (Vec<String>, Vec<String>) {
    let (mut take, mut refuse) = (Vec::new(), Vec::new());
    if c.mla.is_some() {
        refuse.push(format!(
            "attention: {} already has latent attention",
            c.arch
        ));
        return (take, refuse);
    }
    let g = c.n_head_kv;
    if g >= 4 && g.is_multiple_of(2) && c.n_head.is_multiple_of(g / 2) {
        take.push(format!("gqa:{}", g / 2));
    }
    if g > 1 {
        take.push("mqa".to_string());
    } else {
        refuse.push("attention: the model has one KV head already (MQA)".to_string());
    }
    if matches!(c.arch.as_str(), "llama" | "mistral") && c.head_dim > MLA_ROPE_DIMS {
        let width = 2 * g * c.head_dim;
        for div in [4, 8] {
            let rank = (width / div).max(16) / 16 * 16;
            take.push(format!("mla:{rank}"));
        }
    } else {
        refuse.push(format!(
            "attention mla: latent conversion takes Llama-family per-head models; {} is not one",
            c.arch
        ));
    }
    (take, refuse)
}
