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
use crate::kv::{KvCache, KvError, KvFormat, KvOptions, KvPool, SeqCache};

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

    /// An empty contiguous f32 KV cache for `ctx` positions.
    pub fn new_cache(&self, ctx: usize) -> Result<KvCache, KvError> {
        KvCache::new(self.config.n_layers, self.config.kv_dim(), ctx)
    }

    /// An empty KV cache for `ctx` positions with the given formats and layout.
    pub fn new_seq_cache(&self, ctx: usize, opts: &KvOptions) -> Result<SeqCache, KvError> {
        let c = &self.config;
        SeqCache::new(c.n_layers, c.n_head_kv, c.head_dim, ctx, opts)
    }

    /// A pool of `n_blocks` blocks of `block_size` positions, for many sequences at once.
    pub fn new_kv_pool(
        &self,
        format: KvFormat,
        block_size: usize,
        n_blocks: usize,
    ) -> Result<KvPool, KvError> {
        let c = &self.config;
        KvPool::new(
            c.n_layers,
            c.n_head_kv,
            c.head_dim,
            format,
            block_size,
            n_blocks,
        )
    }

    /// Total number of weights.
    pub fn n_params(&self) -> u64 {
        self.file.tensors().iter().map(|t| t.n_elements()).sum()
    }
}
