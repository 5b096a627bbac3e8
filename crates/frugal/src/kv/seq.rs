//! The cache one sequence holds: contiguous or paged behind one type.

use super::{
    CacheShape, KvCache, KvError, KvLayout, KvOptions, KvPool, KvSequence, KvView, Rings, SeqId,
};

/// The cache a single-sequence user (a generation session, perplexity) holds: either layout
/// behind one type, chosen by [`KvOptions`].
#[derive(Debug)]
pub enum SeqCache {
    Contiguous(KvCache),
    /// A pool sized for this one sequence (a server would share one pool among many).
    Paged {
        pool: Box<KvPool>,
        seq: SeqId,
    },
}

impl SeqCache {
    /// A cache for up to `capacity` positions of a model with these dimensions, its
    /// sliding-window layers keeping only their `rings`.
    pub fn new(
        n_layers: usize,
        shape: CacheShape,
        capacity: usize,
        opts: &KvOptions,
        rings: Rings,
    ) -> Result<Self, KvError> {
        match opts.layout {
            KvLayout::Contiguous => Ok(SeqCache::Contiguous(KvCache::with_rings(
                n_layers,
                shape,
                capacity,
                opts.format,
                rings,
            )?)),
            KvLayout::Paged { block_size } => {
                let blocks = capacity.div_ceil(block_size.max(1));
                let mut pool =
                    KvPool::with_rings(n_layers, shape, opts.format, block_size, blocks, rings)?;
                let seq = pool.add_sequence(capacity);
                Ok(SeqCache::Paged {
                    pool: Box::new(pool),
                    seq,
                })
            }
        }
    }

    /// Most positions the cache can hold.
    pub fn capacity(&self) -> usize {
        match self {
            SeqCache::Contiguous(c) => c.capacity(),
            SeqCache::Paged { pool, seq } => pool.max_len(*seq),
        }
    }

    /// Drops every position from `n` on.
    pub fn truncate(&mut self, n: usize) {
        match self {
            SeqCache::Contiguous(c) => c.truncate(n),
            SeqCache::Paged { pool, seq } => pool.truncate(*seq, n),
        }
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Bytes holding this sequence's keys and values (whole blocks for a paged cache).
    pub fn bytes_in_use(&self) -> usize {
        match self {
            SeqCache::Contiguous(c) => c.bytes_in_use(),
            SeqCache::Paged { pool, .. } => pool.bytes_in_use(),
        }
    }
}

impl KvSequence for SeqCache {
    fn len(&self) -> usize {
        match self {
            SeqCache::Contiguous(c) => c.len(),
            SeqCache::Paged { pool, seq } => pool.seq_len(*seq),
        }
    }
    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        match self {
            SeqCache::Contiguous(c) => c.reserve(n),
            SeqCache::Paged { pool, seq } => pool.reserve(*seq, n),
        }
    }
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        match self {
            SeqCache::Contiguous(c) => c.append(layer, k, v),
            SeqCache::Paged { pool, seq } => pool.append(*seq, layer, k, v),
        }
    }
    fn commit(&mut self, n: usize) {
        match self {
            SeqCache::Contiguous(c) => c.commit(n),
            SeqCache::Paged { pool, seq } => pool.commit(*seq, n),
        }
    }
    fn layer(&self, layer: usize) -> (KvView<'_>, KvView<'_>) {
        match self {
            SeqCache::Contiguous(c) => c.layer(layer),
            SeqCache::Paged { pool, seq } => pool.layer(*seq, layer),
        }
    }
    fn room(&self) -> usize {
        self.capacity() - self.len()
    }
    fn max_chunk(&self) -> usize {
        match self {
            SeqCache::Contiguous(c) => c.max_chunk(),
            SeqCache::Paged { pool, .. } => pool.max_chunk(),
        }
    }
    fn rewind_floor(&self) -> usize {
        match self {
            SeqCache::Contiguous(c) => c.rewind_floor(),
            SeqCache::Paged { pool, seq } => pool.rewind_floor(*seq),
        }
    }
}
