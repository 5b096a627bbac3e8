//! The contiguous cache: per layer, one `[position][kv_head][head_dim]` array for K and one for
//! V, in their stored formats. Storage is reserved for the whole context up front but only pages
//! that hold tokens are touched, so resident memory grows with the tokens actually cached.
//!
//! A sliding-window layer ([`Rings`]) reserves only its ring: position `j` goes to row
//! `j % rows`, overwriting a position no query can see any more, so its memory stops growing
//! at the ring's size whatever the context.

use super::{CacheShape, KvError, KvFormat, KvSequence, KvType, KvView, Rings};

#[derive(Debug)]
pub struct KvCache {
    n_layers: usize,
    kv_dim: usize,
    /// Values per value row: `kv_dim`, or 0 when the keys are read as the values.
    v_dim: usize,
    format: KvFormat,
    capacity: usize,
    len: usize,
    /// Positions reserved (and possibly appended) beyond `len`.
    pending: usize,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
    /// Sliding-window layers' rings.
    rings: Rings,
    /// Positions appended to each layer (committed or pending): its view's length.
    appended: Vec<usize>,
    /// Most positions ever written (a ring's slots hold the last `rows` of them).
    high: usize,
}

/// Checks that a head of `head_dim` values can be stored (and decoded on its own) as `ty`.
pub(super) fn check_format(ty: KvType, head_dim: usize) -> Result<(), KvError> {
    if !head_dim.is_multiple_of(ty.granule()) {
        return Err(KvError::Format {
            ty,
            granule: ty.granule(),
            head_dim,
        });
    }
    Ok(())
}

impl KvCache {
    /// An f32 cache for `capacity` positions of `n_layers` layers with `kv_dim` = KV heads x
    /// head_dim. Fails cleanly (instead of aborting) when the sizes overflow or memory cannot be
    /// reserved.
    pub fn new(n_layers: usize, kv_dim: usize, capacity: usize) -> Result<Self, KvError> {
        Self::with_format(
            n_layers,
            CacheShape::new(1, kv_dim),
            capacity,
            KvFormat::default(),
        )
    }

    /// A cache of rows shaped `shape`, storing keys and values in `format`.
    pub fn with_format(
        n_layers: usize,
        shape: CacheShape,
        capacity: usize,
        format: KvFormat,
    ) -> Result<Self, KvError> {
        Self::with_rings(n_layers, shape, capacity, format, Rings::none())
    }

    /// As [`with_format`](Self::with_format), the layers with a ring in `rings` keeping only
    /// their last positions.
    pub fn with_rings(
        n_layers: usize,
        shape: CacheShape,
        capacity: usize,
        format: KvFormat,
        rings: Rings,
    ) -> Result<Self, KvError> {
        let head_dim = shape.head_dim;
        let (kv_dim, v_dim) = (shape.k_dim(), shape.v_dim());
        let err = |reason: String| KvError::Reserve {
            positions: capacity,
            kv_dim,
            n_layers,
            reason,
        };
        check_format(format.k, head_dim)?;
        if shape.separate_values {
            check_format(format.v, head_dim)?;
        }
        // f32 (4 bytes a value) is the widest format: if its total fits, every size does.
        kv_dim
            .checked_mul(4)
            .and_then(|row| row.checked_mul(capacity))
            .and_then(|n| n.checked_mul(2 * n_layers))
            .ok_or_else(|| err("the size overflows".into()))?;
        let (kb, vb) = (format.k.bytes(kv_dim), format.v.bytes(v_dim));
        let mut k = Vec::new();
        let mut v = Vec::new();
        for l in 0..n_layers {
            let rows = rings.held(l, capacity);
            for (side, rb) in [(&mut k, kb), (&mut v, vb)] {
                let mut buf: Vec<u8> = Vec::new();
                buf.try_reserve_exact(rows * rb)
                    .map_err(|e| err(e.to_string()))?;
                side.push(buf);
            }
        }
        Ok(KvCache {
            n_layers,
            kv_dim,
            v_dim,
            format,
            capacity,
            len: 0,
            pending: 0,
            k,
            v,
            rings,
            appended: vec![0; n_layers],
            high: 0,
        })
    }

    /// A ring layer's storage when it holds fewer rows than the context (else a plain array).
    fn ring_rows(&self, layer: usize) -> Option<usize> {
        self.rings.rows(layer).filter(|&r| r < self.capacity)
    }

    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// Positions cached so far (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most positions the cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Checks that `n` more positions fit.
    pub fn check_room(&self, n: usize) -> Result<(), KvError> {
        if self.len + n > self.capacity {
            return Err(KvError::ContextFull {
                len: self.len,
                adding: n,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Keys of `layer` for every position appended so far, in the stored format.
    pub fn keys(&self, layer: usize) -> KvView<'_> {
        self.layer(layer).0
    }

    pub fn values(&self, layer: usize) -> KvView<'_> {
        self.layer(layer).1
    }

    /// Drops every position from `n` on (used to rewind or reuse a cache). Under rings, `n`
    /// must be 0 or at least [`KvSequence::rewind_floor`]: below it a ring no longer holds the
    /// positions the next pass reads, and the whole cache is dropped instead.
    pub fn truncate(&mut self, n: usize) {
        let mut n = n.min(self.len);
        if n > 0 && n < self.rings.floor(self.high) {
            debug_assert!(false, "truncating to {n}, below the rings' floor");
            n = 0;
        }
        let (kb, vb) = (
            self.format.k.bytes(self.kv_dim),
            self.format.v.bytes(self.v_dim),
        );
        for l in 0..self.n_layers {
            // A full ring keeps its rows (the stale ones are overwritten before they are read;
            // `high` stays, so the floor stays conservative); else exactly the positions.
            let rows = self.ring_rows(l).map_or(n, |r| n.min(r));
            self.k[l].truncate(rows * kb);
            self.v[l].truncate(rows * vb);
            self.appended[l] = n;
        }
        if n == 0 {
            self.high = 0;
        }
        self.len = n;
        self.pending = 0;
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Bytes holding cached keys and values right now (a ring layer's at most its ring's).
    pub fn bytes_in_use(&self) -> usize {
        self.bytes_at(self.len)
    }

    /// Bytes the cache holds when `len` positions are cached.
    fn bytes_at(&self, len: usize) -> usize {
        let shape = CacheShape {
            n_head_kv: 1,
            head_dim: self.kv_dim,
            separate_values: self.v_dim > 0,
        };
        let len = len.min(self.capacity);
        super::bytes_at(self.n_layers, shape, self.format, &self.rings, len) as usize
    }

    /// Bytes actually written into the cache's buffers: the allocation's measure of what
    /// [`bytes_in_use`](Self::bytes_in_use) computes from the shape.
    pub fn bytes_stored(&self) -> usize {
        self.k.iter().chain(&self.v).map(Vec::len).sum()
    }

    /// Bytes one token takes in a real cache of this shape and format: a one-token cache is
    /// allocated, a row is stored in every layer, and its buffers are measured (what `frugal
    /// info` and the attention report quote, next to the arithmetic of `frugal estimate`).
    pub fn measured_bytes_per_token(
        n_layers: usize,
        shape: CacheShape,
        format: KvFormat,
    ) -> Result<usize, KvError> {
        Self::measured_bytes_at(n_layers, shape, format, Rings::none(), 1)
    }

    /// Bytes a cache of this shape, format and rings holds at `len` positions, measured: a
    /// cache is allocated, `len` rows are stored in every layer, and its buffers are counted
    /// (what `frugal info` quotes per context, next to `frugal estimate`'s arithmetic).
    pub fn measured_bytes_at(
        n_layers: usize,
        shape: CacheShape,
        format: KvFormat,
        rings: Rings,
        len: usize,
    ) -> Result<usize, KvError> {
        let mut kv = KvCache::with_rings(n_layers, shape, len, format, rings)?;
        let max = kv.max_chunk();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(max);
            kv.reserve(n)?;
            let (k, v) = (vec![0f32; n * shape.k_dim()], vec![0f32; n * shape.v_dim()]);
            for layer in 0..n_layers {
                kv.append(layer, &k, &v);
            }
            kv.commit(n);
            done += n;
        }
        Ok(kv.bytes_stored())
    }

    /// Bytes the cache would hold at full context.
    pub fn bytes_at_capacity(&self) -> usize {
        self.bytes_at(self.capacity)
    }
}

fn push_encoded(buf: &mut Vec<u8>, ty: KvType, kv_dim: usize, src: &[f32]) {
    let rb = ty.bytes(kv_dim);
    let start = buf.len();
    // Within the capacity reserved at construction: never reallocates.
    buf.resize(start + src.len() / kv_dim * rb, 0);
    for (dst, row) in buf[start..]
        .chunks_exact_mut(rb)
        .zip(src.chunks_exact(kv_dim))
    {
        ty.encode(row, dst);
    }
}

/// Stores the rows of positions `pos0..` into a ring of `rows` rows (row `j % rows`), growing
/// the buffer until it holds the whole ring (within the capacity reserved: never reallocates).
fn ring_encoded(
    buf: &mut Vec<u8>,
    rows: usize,
    pos0: usize,
    ty: KvType,
    kv_dim: usize,
    src: &[f32],
) {
    let rb = ty.bytes(kv_dim);
    for (i, row) in src.chunks_exact(kv_dim).enumerate() {
        let at = (pos0 + i) % rows * rb;
        if at == buf.len() {
            buf.resize(at + rb, 0);
        }
        ty.encode(row, &mut buf[at..at + rb]);
    }
}

impl KvSequence for KvCache {
    fn len(&self) -> usize {
        self.len
    }

    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        self.check_room(n)?;
        self.rings.check_pass(n)?;
        self.pending = n;
        Ok(())
    }

    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        debug_assert_eq!(k.len(), self.pending * self.kv_dim);
        debug_assert_eq!(v.len(), self.pending * self.v_dim);
        match self.ring_rows(layer) {
            None => {
                push_encoded(&mut self.k[layer], self.format.k, self.kv_dim, k);
                if self.v_dim > 0 {
                    push_encoded(&mut self.v[layer], self.format.v, self.v_dim, v);
                }
            }
            Some(rows) => {
                let (pos0, f) = (self.len, self.format);
                ring_encoded(&mut self.k[layer], rows, pos0, f.k, self.kv_dim, k);
                if self.v_dim > 0 {
                    ring_encoded(&mut self.v[layer], rows, pos0, f.v, self.v_dim, v);
                }
            }
        }
        self.appended[layer] = self.len + self.pending;
    }

    fn commit(&mut self, n: usize) {
        self.len += n;
        self.pending = 0;
        self.high = self.high.max(self.len);
        debug_assert!(self.appended.iter().all(|&a| a == self.len));
    }

    fn layer(&self, layer: usize) -> (KvView<'_>, KvView<'_>) {
        let ring = self.ring_rows(layer).unwrap_or(0);
        let len = self.appended[layer];
        let kb = self.format.k.bytes(self.kv_dim);
        let keys = KvView::contiguous_ring(self.format.k, kb, len, ring, &self.k[layer]);
        if self.v_dim == 0 {
            return (keys, keys);
        }
        let vb = self.format.v.bytes(self.v_dim);
        let values = KvView::contiguous_ring(self.format.v, vb, len, ring, &self.v[layer]);
        (keys, values)
    }

    fn max_chunk(&self) -> usize {
        self.rings.max_chunk()
    }

    fn room(&self) -> usize {
        self.capacity - self.len
    }

    fn rewind_floor(&self) -> usize {
        self.rings.floor(self.high)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_commit_truncate() {
        let mut c = KvCache::new(2, 4, 3).unwrap();
        assert!(KvCache::new(2, usize::MAX / 2, 3).is_err());
        c.reserve(2).unwrap();
        for l in 0..2 {
            c.append(l, &[1.0; 8], &[2.0; 8]);
        }
        c.commit(2);
        assert_eq!(c.len(), 2);
        assert_eq!(c.bytes_in_use(), 2 * 2 * 2 * 4 * 4);
        assert_eq!(
            c.check_room(2),
            Err(KvError::ContextFull {
                len: 2,
                adding: 2,
                capacity: 3
            })
        );
        c.truncate(1);
        assert_eq!(c.keys(1).len(), 1);
        assert!(c.check_room(2).is_ok());
    }

    /// A keys-only cache (MLA's latent rows) stores no values, and attention reads the keys'
    /// view in their place.
    #[test]
    fn keys_only_rows_serve_as_values() {
        let mut c =
            KvCache::with_format(1, CacheShape::keys_only(8), 4, KvFormat::default()).unwrap();
        c.reserve(2).unwrap();
        c.append(0, &[0.5; 16], &[]);
        c.commit(2);
        assert_eq!(c.bytes_in_use(), 2 * 8 * 4);
        let (k, v) = c.layer(0);
        let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
        k.decode_head(0, 8, 0, 2, &mut a);
        v.decode_head(0, 8, 0, 2, &mut b);
        assert_eq!((a, b), ([0.5; 16], [0.5; 16]));
    }

    /// What a cache with rings stores, measured, is the arithmetic `info` and `estimate` use.
    #[test]
    fn ring_bytes_measured_match_the_arithmetic() {
        let rings = Rings::for_windows([Some(20), None, Some(20)], 3);
        let shape = CacheShape::new(1, 32);
        for len in [1, 100, 535, 536, 1500] {
            for f in [KvFormat::default(), KvFormat::both(KvType::Q8_0)] {
                let m = KvCache::measured_bytes_at(3, shape, f, rings.clone(), len).unwrap();
                assert_eq!(
                    m as u128,
                    super::super::bytes_at(3, shape, f, &rings, len),
                    "{len}"
                );
            }
        }
        // Past the ring (20 + 3 + 512 rows) the windowed layers stop growing.
        let at = |len| super::super::bytes_at(3, shape, KvFormat::default(), &rings, len);
        assert_eq!(at(2000) - at(1000), 1000 * 2 * 32 * 4);
    }

    #[test]
    fn q8_0_needs_whole_blocks_per_head() {
        let q8 = KvFormat::both(KvType::Q8_0);
        let e = KvCache::with_format(1, CacheShape::new(2, 16), 8, q8).unwrap_err();
        assert!(matches!(e, KvError::Format { head_dim: 16, .. }));
        assert!(KvCache::with_format(1, CacheShape::new(2, 64), 8, q8).is_ok());
    }
}
