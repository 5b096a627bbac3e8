//! The KV cache: keys and values of every processed position, per layer, so each new token
//! attends to the prefix without recomputing it.
//!
//! This is the contiguous f32 cache: per layer, a `[position][kv_head][head_dim]` array for K and
//! one for V. Storage is reserved for the whole context up front but only pages that hold tokens
//! are touched, so resident memory grows with the tokens actually cached.

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
}

#[derive(Debug)]
pub struct KvCache {
    n_layers: usize,
    kv_dim: usize,
    capacity: usize,
    len: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// A cache for `capacity` positions of `n_layers` layers with `kv_dim` = KV heads x head_dim.
    /// Fails cleanly (instead of aborting) when the sizes overflow or memory cannot be reserved.
    pub fn new(n_layers: usize, kv_dim: usize, capacity: usize) -> Result<Self, KvError> {
        let err = |reason: String| KvError::Reserve {
            positions: capacity,
            kv_dim,
            n_layers,
            reason,
        };
        let per_layer = capacity
            .checked_mul(kv_dim)
            .filter(|n| {
                n.checked_mul(2 * n_layers * std::mem::size_of::<f32>())
                    .is_some()
            })
            .ok_or_else(|| err("the size overflows".into()))?;
        let mut k = Vec::new();
        let mut v = Vec::new();
        for _ in 0..n_layers {
            for side in [&mut k, &mut v] {
                let mut buf: Vec<f32> = Vec::new();
                buf.try_reserve_exact(per_layer)
                    .map_err(|e| err(e.to_string()))?;
                side.push(buf);
            }
        }
        Ok(KvCache {
            n_layers,
            kv_dim,
            capacity,
            len: 0,
            k,
            v,
        })
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

    /// Appends `k` and `v` (each `n x kv_dim`) for `layer`. All layers must be appended before
    /// [`KvCache::commit`] advances the length by `n`.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        debug_assert_eq!(k.len(), v.len());
        debug_assert_eq!(self.k[layer].len(), self.len * self.kv_dim);
        self.k[layer].extend_from_slice(k);
        self.v[layer].extend_from_slice(v);
    }

    /// Marks `n` appended positions as cached in every layer.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
        debug_assert!(self.k.iter().all(|l| l.len() == self.len * self.kv_dim));
    }

    /// Keys of `layer` for every position appended so far (`positions x kv_dim`).
    pub fn keys(&self, layer: usize) -> &[f32] {
        &self.k[layer]
    }

    pub fn values(&self, layer: usize) -> &[f32] {
        &self.v[layer]
    }

    /// Drops every position from `n` on (used to rewind or reuse a cache).
    pub fn truncate(&mut self, n: usize) {
        let n = n.min(self.len);
        for l in 0..self.n_layers {
            self.k[l].truncate(n * self.kv_dim);
            self.v[l].truncate(n * self.kv_dim);
        }
        self.len = n;
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Bytes holding cached keys and values right now.
    pub fn bytes_in_use(&self) -> usize {
        2 * self.n_layers * self.len * self.kv_dim * std::mem::size_of::<f32>()
    }

    /// Bytes the cache would hold at full context.
    pub fn bytes_at_capacity(&self) -> usize {
        2 * self.n_layers * self.capacity * self.kv_dim * std::mem::size_of::<f32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_commit_truncate() {
        let mut c = KvCache::new(2, 4, 3).unwrap();
        assert!(KvCache::new(2, usize::MAX / 2, 3).is_err());
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
        assert_eq!(c.keys(1).len(), 4);
        assert!(c.check_room(2).is_ok());
    }
}
