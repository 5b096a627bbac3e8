//! Llama-family models: configuration, weights (views into the GGUF map) and the forward pass.

mod config;
mod forward;
pub mod synthetic;
mod weights;

pub use config::{Config, SUPPORTED_ARCHS};
pub use forward::{Logits, Scratch};
pub use weights::{LayerWeights, Linear, Weights};

use std::path::Path;

use crate::gguf::{GgufError, GgufFile};
use crate::kv::{KvCache, KvError};

/// A loaded model: the open file, its configuration and validated views of its weights.
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    pub file: GgufFile,
}

impl Model {
    /// Opens and validates a GGUF model file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        Self::from_file(GgufFile::open(path)?)
    }

    pub fn from_file(file: GgufFile) -> Result<Self, GgufError> {
        let config = Config::from_gguf(&file)?;
        let weights = Weights::load(&file, &config)?;
        Ok(Model {
            config,
            weights,
            file,
        })
    }

    /// An empty KV cache for `ctx` positions.
    pub fn new_cache(&self, ctx: usize) -> Result<KvCache, KvError> {
        KvCache::new(self.config.n_layers, self.config.kv_dim(), ctx)
    }

    /// Total number of weights.
    pub fn n_params(&self) -> u64 {
        self.file.tensors().iter().map(|t| t.n_elements()).sum()
    }
}
