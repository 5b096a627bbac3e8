//! Building candidates: each lever applied to a base file in memory, the result a GGUF file
//! the engine runs (and `frugal` could write as it is). MoE conversion is in [`crate::moe`],
//! students in [`crate::student`], distillation in [`crate::heal`].

use std::sync::Arc;

use anyhow::{Context, Result};
use frugal::convert::{Policy, Target, quantize_in_memory};
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;
use frugal::surgery::importance::Importance;
use frugal::surgery::prune::structured::{self, StructuredReport, StructuredTarget};
use frugal::surgery::prune::{self, Method, Pattern, PruneStats, PruneTarget};
use frugal::surgery::{self, AttentionLayout, Calibration, MlaTarget};

/// A model from GGUF bytes as the reports run candidates: 8-bit activations into the
/// quantized matrices (how llama.cpp runs quantized files), and with `bitmap` its zero weights
/// held as bitmaps of the nonzero bytes (the sparse kernels).
pub fn load(bytes: Vec<u8>, bitmap: bool) -> Result<Model> {
    load_file(GgufFile::from_bytes(bytes)?, bitmap)
}

/// [`load`] of a file already parsed.
pub fn load_file(file: GgufFile, bitmap: bool) -> Result<Model> {
    let mut m = Model::from_file(file)?;
    m.set_activations(Activations::Q8);
    if bitmap {
        m.use_bitmap_storage(0.0);
    }
    Ok(m)
}

/// `file` re-encoded in `target` as `frugal quantize` does (norms F32, embedding and head at 8
/// bits), weighted by the calibration's column importance when given.
pub fn quantized(
    file: &GgufFile,
    target: Target,
    importance: Option<Arc<Importance>>,
) -> Result<GgufFile> {
    let mut policy = Policy::new(target);
    policy.importance = importance;
    let (q, _) = quantize_in_memory(file, &policy, |_, _| {})
        .with_context(|| format!("quantizing to {target}"))?;
    Ok(q)
}

/// `file` pruned by `method` to `pattern`, its matrices stored in `format` (the scores read
/// `stats`; magnitude pruning needs none). Sparsity 0 re-encodes the dense model in `format`.
pub fn pruned(
    file: &GgufFile,
    stats: Option<&PruneStats>,
    method: Method,
    pattern: Pattern,
    format: GgmlType,
) -> Result<Vec<u8>> {
    let target = PruneTarget {
        method,
        pattern,
        format,
    };
    Ok(prune::prune_weights(file, stats, target)?.0.to_bytes()?)
}

/// `file` with FFN neurons, KV groups or layers removed as `target` says, then re-encoded in
/// `format` (so that its speed compares with the dense model in the same format).
pub fn structured(
    file: &GgufFile,
    stats: &PruneStats,
    target: &StructuredTarget,
    format: Target,
) -> Result<(GgufFile, StructuredReport)> {
    let (w, r) = structured::prune_structured(file, stats, target, None)?;
    let q = quantized(&GgufFile::from_bytes(w.to_bytes()?)?, format, None)?;
    Ok((q, r))
}

/// An attention layout to convert a per-head model to.
#[derive(Clone, Copy, Debug)]
pub enum Layout {
    /// The model as it is.
    Original,
    /// KV heads regrouped (MHA copies exactly; MQA and fewer groups mean-pool).
    Heads(AttentionLayout),
    /// Latent attention at a rank (needs a calibration).
    Latent(MlaTarget),
}

/// `source` converted to `layout`, and whether the conversion computes the original's function
/// exactly (no recovery needed). `calib` is read by [`Layout::Latent`] only.
pub fn convert_layout(
    source: &GgufFile,
    layout: &Layout,
    calib: &Calibration,
) -> Result<(GgufFile, bool)> {
    Ok(match layout {
        Layout::Original => (GgufFile::from_bytes(source.raw_bytes().to_vec())?, true),
        Layout::Heads(l) => {
            let (w, r) = surgery::convert_attention(source, *l)?;
            (GgufFile::from_bytes(w.to_bytes()?)?, r.exact())
        }
        Layout::Latent(t) => {
            let (w, _) = surgery::convert_to_mla(source, calib, *t)?;
            (GgufFile::from_bytes(w.to_bytes()?)?, false)
        }
    })
}
