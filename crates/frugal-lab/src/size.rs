//! What a candidate costs in memory: parameters and weight bytes as the file stores them, the
//! share of its layer weights that are zero, and the KV cache it needs per token and at a
//! context, measured on a real cache and as `frugal estimate` computes it.

use anyhow::Result;
use frugal::gguf::GgufFile;
use frugal::kv::{KvCache, KvFormat, KvType};
use frugal::model::Model;

/// Parameters and bytes of every tensor of a file.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Footprint {
    pub params: u64,
    pub bytes: u64,
}

impl Footprint {
    pub fn of(file: &GgufFile) -> Footprint {
        file.tensors()
            .iter()
            .fold(Footprint::default(), |f, t| Footprint {
                params: f.params + t.n_elements(),
                bytes: f.bytes + t.n_bytes(),
            })
    }

    pub fn bits_per_weight(&self) -> f64 {
        self.bytes as f64 * 8.0 / self.params as f64
    }
}

/// The fraction of the layer matrices' weights (`blk.*`, two dimensions) that are zero, after
/// dequantization: what pruning left. The embedding and head are not counted.
pub fn zero_fraction(file: &GgufFile) -> Result<f64> {
    let (mut all, mut zeros) = (0u64, 0u64);
    for t in file.tensors() {
        if t.name.starts_with("blk.") && t.dims.len() == 2 {
            let (info, bytes) = file.tensor(&t.name)?;
            let x = frugal::quant::dequantize_to_vec(info.ty, bytes, info.n_elements() as usize)?;
            all += x.len() as u64;
            zeros += x.iter().filter(|&&v| v == 0.0).count() as u64;
        }
    }
    Ok(zeros as f64 / all.max(1) as f64)
}

/// The storage type holding most of a file's weights (by element count), by its GGUF name.
pub fn dominant_type(file: &GgufFile) -> Option<&'static str> {
    let mut by: std::collections::HashMap<&'static str, u64> = std::collections::HashMap::new();
    for t in file.tensors() {
        *by.entry(t.ty.name()).or_default() += t.n_elements();
    }
    by.into_iter().max_by_key(|&(_, n)| n).map(|(t, _)| t)
}

/// KV-cache bytes one token takes in an f16 cache, over all layers.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct KvPerToken {
    /// Stored by a real cache of the model's shape (its buffers measured).
    pub measured: usize,
    /// `frugal estimate`'s arithmetic on the file.
    pub estimated: u128,
}

/// [`KvPerToken`] of `model`, whose file is `file` (`label` names it in errors).
pub fn kv_per_token_f16(file: &GgufFile, model: &Model, label: &str) -> Result<KvPerToken> {
    let desc = frugal::estimate::gguf_desc::from_gguf(file, label)?;
    let shape = frugal::estimate::KvShape::of_model(&desc);
    Ok(KvPerToken {
        measured: kv_bytes_per_token(model, KvFormat::both(KvType::F16))?,
        estimated: shape.bytes_per_token(&desc, frugal::estimate::Format::F16),
    })
}

/// Bytes one token takes in a real cache of `model`'s shape in `format`, over all layers.
pub fn kv_bytes_per_token(model: &Model, format: KvFormat) -> Result<usize> {
    Ok(KvCache::measured_bytes_per_token(
        model.config.n_layers,
        model.config.cache_shape(),
        format,
    )?)
}

/// A model's memory at a context: its weights and a full cache of `ctx` tokens (every layer
/// holding every token: sliding windows are not discounted).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Memory {
    pub weights: u64,
    pub kv: u64,
}

impl Memory {
    pub fn at(model: &Model, ctx: usize, format: KvFormat) -> Result<Memory> {
        Ok(Memory {
            weights: Footprint::of(&model.file).bytes,
            kv: (kv_bytes_per_token(model, format)? * ctx) as u64,
        })
    }

    pub fn total(&self) -> u64 {
        self.weights + self.kv
    }
}
