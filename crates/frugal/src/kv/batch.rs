//! Several sequences in one forward pass: the cache operations of [`KvSequence`], per segment.
//!
//! The forward pass processes the tokens of a batch as one block of rows (every weight matrix
//! is read once for all of them) and only attention is per sequence. A [`KvBatch`] maps the
//! batch's segments to their caches: one [`KvSequence`] ([`OneSeq`]), or sequences of a shared
//! [`KvPool`] ([`PoolBatch`]).

use super::{KvError, KvPool, KvSequence, KvView, SeqId};

/// The cache of each segment of a batch.
pub trait KvBatch {
    fn segments(&self) -> usize;
    /// Positions cached for segment `seg`.
    fn len(&self, seg: usize) -> usize;
    /// As [`KvSequence::reserve`]; a failure changes nothing.
    fn reserve(&mut self, seg: usize, n: usize) -> Result<(), KvError>;
    /// Undoes a successful [`reserve`](Self::reserve) whose positions will not be written (a
    /// later segment's reserve failed, so the pass does not run).
    fn unreserve(&mut self, seg: usize);
    fn append(&mut self, seg: usize, layer: usize, k: &[f32], v: &[f32]);
    fn commit(&mut self, seg: usize, n: usize);
    fn layer(&self, seg: usize, layer: usize) -> (KvView<'_>, KvView<'_>);
    /// Most positions one reserve may take for any segment (see [`KvSequence::max_chunk`]).
    fn max_chunk(&self) -> usize;
}

/// A batch of one sequence.
pub struct OneSeq<'a>(pub &'a mut dyn KvSequence);

impl KvBatch for OneSeq<'_> {
    fn segments(&self) -> usize {
        1
    }
    fn len(&self, _: usize) -> usize {
        self.0.len()
    }
    fn reserve(&mut self, _: usize, n: usize) -> Result<(), KvError> {
        self.0.reserve(n)
    }
    fn unreserve(&mut self, _: usize) {
        // Never needed: with one segment, the only reserve that can fail is this one, and a
        // failed reserve changes nothing.
    }
    fn append(&mut self, _: usize, layer: usize, k: &[f32], v: &[f32]) {
        self.0.append(layer, k, v)
    }
    fn commit(&mut self, _: usize, n: usize) {
        self.0.commit(n)
    }
    fn layer(&self, _: usize, layer: usize) -> (KvView<'_>, KvView<'_>) {
        self.0.layer(layer)
    }
    fn max_chunk(&self) -> usize {
        self.0.max_chunk()
    }
}

/// Sequences of one pool, segment `i` being `seqs[i]` (each at most once).
pub struct PoolBatch<'a> {
    pub pool: &'a mut KvPool,
    pub seqs: &'a [SeqId],
}

impl KvBatch for PoolBatch<'_> {
    fn segments(&self) -> usize {
        self.seqs.len()
    }
    fn len(&self, seg: usize) -> usize {
        self.pool.seq_len(self.seqs[seg])
    }
    fn reserve(&mut self, seg: usize, n: usize) -> Result<(), KvError> {
        self.pool.reserve(self.seqs[seg], n)
    }
    fn unreserve(&mut self, seg: usize) {
        let id = self.seqs[seg];
        let len = self.pool.seq_len(id);
        self.pool.truncate(id, len);
    }
    fn append(&mut self, seg: usize, layer: usize, k: &[f32], v: &[f32]) {
        self.pool.append(self.seqs[seg], layer, k, v)
    }
    fn commit(&mut self, seg: usize, n: usize) {
        self.pool.commit(self.seqs[seg], n)
    }
    fn layer(&self, seg: usize, layer: usize) -> (KvView<'_>, KvView<'_>) {
        self.pool.layer(self.seqs[seg], layer)
    }
    fn max_chunk(&self) -> usize {
        self.pool.max_chunk()
    }
}
