//! Llama-family models: configuration, weights (views into the GGUF map) and the forward pass.

pub mod compat;
mod config;
pub mod features;
mod forward;
mod mla;
pub mod moe;
pub mod pooling;
pub mod relabel;
pub mod shaped;
pub mod synthetic;
mod weights;

pub use config::{Config, LongRope, Mla, SUPPORTED_ARCHS};
pub use features::Features;
pub use forward::{Input, Logits, Observer, Scratch, Segment, Site};
pub use mla::LatentPath;
pub use moe::{Gating, MoeConfig, RoutingStats};
pub use pooling::{Pooler, Pooling};
pub use weights::{ExtraNorms, Ffn, KvProjection, LayerWeights, Weights};

use std::path::Path;
use std::sync::Arc;

use crate::gguf::{GgufError, GgufFile};
use crate::kv::{KvCache, KvError, KvFormat, KvOptions, KvPool, Rings, SeqCache};
use crate::quant::act::Activations;
use crate::quant::packed::PackedMatrix;
use crate::quant::sparse_matrix::{self, SparseMatrix};
use crate::quant::{QuantError, WeightMatrix, kernels, sparse};

/// The dense grouped layout of a compressed 2:4 matrix's dense twin (Q8_0 or Q4_0).
fn pack_dense_twin(w: &WeightMatrix) -> Result<PackedMatrix, QuantError> {
    let (ty, bytes) = sparse::expand_to_dense(w.ty, w.data)?;
    PackedMatrix::pack(&WeightMatrix::new(ty, w.rows, w.cols, &bytes)?)
}

/// A loaded model: the open file, its configuration and validated views of its weights.
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    pub file: GgufFile,
    /// Precision of the activations in matrix products (exact f32 by default).
    pub activations: Activations,
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
            activations: Activations::default(),
        })
    }

    /// An empty contiguous f32 KV cache for `ctx` positions (sliding-window layers in rings).
    pub fn new_cache(&self, ctx: usize) -> Result<KvCache, KvError> {
        KvCache::with_rings(
            self.config.n_layers,
            self.config.cache_shape(),
            ctx,
            KvFormat::default(),
            self.cache_rings(),
        )
    }

    /// Selects the activation precision. Switching to 8-bit activations repacks the
    /// block-quantized matrices that will take them (the output head included; a Q8_0 head
    /// takes 15-bit activations under `q8`) into
    /// the grouped layout of `quant::packed` (once; about the size of those weights on the
    /// heap), after which their pages of the file map are released. A model with no
    /// block-quantized matrix keeps f32 activations.
    pub fn set_activations(&mut self, a: Activations) {
        self.activations = a;
        if !a.quantized() {
            return;
        }
        let (layers, head) = self.weights.layer_matrices_and_head_mut();
        let sparse_kernels = kernels::sparse_available(kernels::detect());
        let mut dense = Vec::new();
        for (m, is_head) in layers.map(|m| (m, false)).chain([(head, true)]) {
            if m.is_mapped() {
                let view = m.view();
                if sparse::is_sparse(m.ty) {
                    // Compressed 2:4: the sparse layout where its kernel runs, else the dense
                    // twin (the same values at the dense speed).
                    if sparse_kernels {
                        if let Ok(s) = SparseMatrix::pack(&view) {
                            m.store_sparse(Arc::new(s));
                        }
                    } else if let Ok(p) = pack_dense_twin(&view) {
                        m.store_packed(Arc::new(p));
                    }
                } else if PackedMatrix::packed_len(&view).is_some() {
                    dense.push((m, is_head));
                    continue;
                }
            }
            m.choose_act_form(a, is_head);
        }
        // The rest in one buffer on huge pages; each matrix's pages of the file map are
        // released as soon as its copy exists, so the peak stays near one copy of the weights
        // rather than two.
        let views: Vec<_> = dense.iter().map(|(m, _)| m.view()).collect();
        let file = &self.file;
        let packed = PackedMatrix::pack_shared(&views, |i| file.release(dense[i].0.file_range()));
        drop(views);
        for ((m, is_head), p) in dense.into_iter().zip(packed) {
            m.store_packed(Arc::new(p));
            m.choose_act_form(a, is_head);
        }
        // Float weights (F32, F16, BF16) have nothing to run on integers: say so rather than
        // quantize activations no product reads.
        if self.weights.matrices().all(|m| m.is_mapped()) {
            self.activations = Activations::F32;
        }
    }

    /// Stores every layer matrix that is Q8_0 with at least `min_sparsity` of its codes zero
    /// as an unstructured bitmap (`quant::sparse_matrix`): only the nonzero bytes plus one bit
    /// per weight. Takes effect with 8-bit activations (call after [`Self::set_activations`])
    /// and where the sparse kernels run; returns how many matrices it converted. Whether it is
    /// faster depends on the sparsity: `frugal report prune` measures where it starts to pay.
    pub fn use_bitmap_storage(&mut self, min_sparsity: f64) -> usize {
        if !self.activations.quantized() || !kernels::sparse_available(kernels::detect()) {
            return 0;
        }
        let (layers, _) = self.weights.layer_matrices_and_head_mut();
        let mut converted = 0;
        for m in layers {
            let view = m.view();
            if sparse_matrix::zero_fraction(&view).is_some_and(|z| z >= min_sparsity)
                && let Ok(s) = SparseMatrix::pack(&view)
            {
                m.store_sparse(Arc::new(s));
                converted += 1;
            }
        }
        converted
    }

    /// Bytes of repacked weights held on the heap.
    pub fn packed_bytes(&self) -> usize {
        self.weights.matrices().map(|m| m.heap_bytes()).sum()
    }

    /// An empty KV cache for `ctx` positions with the given formats and layout (its
    /// sliding-window layers keeping only their rings).
    pub fn new_seq_cache(&self, ctx: usize, opts: &KvOptions) -> Result<SeqCache, KvError> {
        let c = &self.config;
        SeqCache::new(c.n_layers, c.cache_shape(), ctx, opts, self.cache_rings())
    }

    /// The rings the sliding-window layers' caches keep: each window, plus the keys before it
    /// a flash kernel's tile may start at, plus one pass ([`crate::kv::Rings`]). None for a
    /// model without windows.
    pub fn cache_rings(&self) -> Rings {
        self.config.cache_rings()
    }

    /// A pool of `n_blocks` blocks of `block_size` positions, for many sequences at once (the
    /// sliding-window layers in rings of blocks of their own).
    pub fn new_kv_pool(
        &self,
        format: KvFormat,
        block_size: usize,
        n_blocks: usize,
    ) -> Result<KvPool, KvError> {
        let c = &self.config;
        let rings = self.cache_rings();
        KvPool::with_rings(
            c.n_layers,
            c.cache_shape(),
            format,
            block_size,
            n_blocks,
            rings,
        )
    }

    /// Total number of weights.
    pub fn n_params(&self) -> u64 {
        self.file.tensors().iter().map(|t| t.n_elements()).sum()
    }
}
