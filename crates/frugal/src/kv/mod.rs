//! The KV cache: keys and values of every processed position, per layer, so each new token
//! attends to the prefix without recomputing it.
//!
//! Two storages, one interface ([`KvSequence`], what the forward pass writes to and attention
//! reads from through a [`KvView`]):
//! - [`KvCache`]: contiguous, one array per layer reserved for the whole context. Simple and the
//!   fastest to read; right for one sequence at a time.
//! - [`KvPool`]: paged. Fixed-size blocks (default 16 positions) shared by many sequences; each
//!   sequence maps its positions to blocks through a block table. Memory is allocated per block
//!   as sequences grow, sequences can fork and share their prefix copy-on-write, and the blocks
//!   of a finished sequence go back to the pool. This is the storage a server batching many
//!   requests needs.
//!
//! Keys and values are stored in a [`KvType`] each (f32, f16, bf16, q8_0), chosen separately.
//! Both storages give bit-identical logits for the same format (tested).

mod batch;
mod contiguous;
mod format;
#[cfg(target_arch = "x86_64")]
mod format_x86;
mod head_addr;
mod paged;
mod pool_buffers;
pub mod prefix;
mod ring_blocks;
mod rings;
mod seq;
mod view;

pub use batch::{KvBatch, OneSeq, PoolBatch};
pub use contiguous::KvCache;
pub use format::{KvFormat, KvType, Q8_0_BLOCK, UnknownKvType};
pub use head_addr::HeadAddr;
pub use paged::{KvPool, PagedSeq, SeqId};
pub use rings::{RING_CHUNK, Ring, Rings, bytes_at, ring_rows};
pub use seq::SeqCache;
pub use view::{BlockLayout, KvView};

/// Errors from cache operations.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum KvError {
    #[error(
        "cannot reserve a KV cache of {positions} positions x {kv_dim} values x {n_layers} layers: {reason}"
    )]
    Reserve {
        positions: usize,
        kv_dim: usize,
        n_layers: usize,
        reason: String,
    },
    #[error(
        "context full: {len} cached + {adding} new tokens exceed the context length {capacity}"
    )]
    ContextFull {
        len: usize,
        adding: usize,
        capacity: usize,
    },
    #[error("KV pool exhausted: {needed} more blocks needed, {free} free of {total}")]
    PoolExhausted {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error(
        "KV type {ty} stores blocks of {granule} values; the head dimension {head_dim} is not a multiple"
    )]
    Format {
        ty: KvType,
        granule: usize,
        head_dim: usize,
    },
    #[error("KV block size must be at least 1")]
    BlockSize,
    #[error("no sequence {0} in the KV pool")]
    NoSequence(u32),
    #[error(
        "a pass of {adding} positions exceeds the {max} a sliding-window ring holds room for (split it)"
    )]
    ChunkTooLong { adding: usize, max: usize },
}

/// What one position of one layer holds: `n_head_kv` keys of `head_dim` values each and, unless
/// the values are read from the keys themselves, as many values. Multi-head latent attention
/// caches one row (its compressed latent and the shared RoPE key) that serves as both: the
/// values are the row's leading dims, so a second copy would only double the cache.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct CacheShape {
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// False when attention reads the values from the key rows (no value storage).
    pub separate_values: bool,
}

impl CacheShape {
    /// Keys and values, `n_head_kv` heads of `head_dim` each.
    pub fn new(n_head_kv: usize, head_dim: usize) -> Self {
        CacheShape {
            n_head_kv,
            head_dim,
            separate_values: true,
        }
    }

    /// One row of `dim` values per position that is both the key and the value.
    pub fn keys_only(dim: usize) -> Self {
        CacheShape {
            n_head_kv: 1,
            head_dim: dim,
            separate_values: false,
        }
    }

    /// Values in a key row.
    pub fn k_dim(&self) -> usize {
        self.n_head_kv.saturating_mul(self.head_dim)
    }

    /// Values in a value row (0 when there is no value storage).
    pub fn v_dim(&self) -> usize {
        if self.separate_values {
            self.k_dim()
        } else {
            0
        }
    }

    /// Bytes one cached position takes across `n_layers` layers in `format`.
    pub fn bytes_per_token(&self, n_layers: usize, format: KvFormat) -> usize {
        n_layers * (format.k.bytes(self.k_dim()) + format.v.bytes(self.v_dim()))
    }
}

/// How a cache is laid out in memory.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvLayout {
    Contiguous,
    /// Blocks of `block_size` positions from a pool.
    Paged {
        block_size: usize,
    },
}

impl Default for KvLayout {
    fn default() -> Self {
        KvLayout::Paged {
            block_size: paged::DEFAULT_BLOCK,
        }
    }
}

/// Everything that decides how keys and values are stored.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KvOptions {
    pub format: KvFormat,
    pub layout: KvLayout,
}

/// What the forward pass needs from a cache: append the keys and values of new positions layer
/// by layer, then read every cached position of a layer. Implemented by [`KvCache`],
/// [`PagedSeq`] (one sequence of a [`KvPool`]) and [`SeqCache`].
pub trait KvSequence {
    /// Positions cached (the position of the next token).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Makes room for `n` more positions; fails cleanly when the context or the pool is full.
    /// Must precede the [`KvSequence::append`] calls for those positions.
    fn reserve(&mut self, n: usize) -> Result<(), KvError>;
    /// Stores `k` and `v` (each `n x kv_dim` f32) of the `n` reserved positions for `layer`,
    /// converting them to the cache's formats.
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]);
    /// Marks `n` appended positions as cached in every layer.
    fn commit(&mut self, n: usize);
    /// Keys and values of `layer`: every committed position plus those appended since.
    fn layer(&self, layer: usize) -> (KvView<'_>, KvView<'_>);
    /// Most positions one [`reserve`](Self::reserve) may take (a sliding-window ring's
    /// headroom; unbounded otherwise): the forward pass splits longer inputs.
    fn max_chunk(&self) -> usize {
        usize::MAX
    }
    /// Positions that can still be added (the context left).
    fn room(&self) -> usize;
    /// The shortest length (0 aside) truncation keeps exact: a ring has overwritten the
    /// positions a pass from any earlier point would read. 0 when any length is.
    fn rewind_floor(&self) -> usize {
        0
    }
}

/// The indices (address / 64) of the cache lines `span` touches.
pub fn cache_lines(span: &[u8]) -> std::ops::Range<usize> {
    let at = span.as_ptr() as usize;
    at / 64..(at + span.len()).div_ceil(64)
}
