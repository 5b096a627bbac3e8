//! Sliding-window rings: which layers keep only their most recent positions, how many they
//! hold, and the bytes a cache with them takes.

use super::{CacheShape, KvError, KvFormat};

/// Positions one forward pass may add to a cache with sliding-window rings: the headroom each
/// ring keeps beyond its window. Longer passes are split (the forward does it; the rows come
/// out the same bits, see `attention::key_chunk`). llama.cpp's equivalent is its micro-batch,
/// 512 by default.
pub const RING_CHUNK: usize = 512;

/// Which layers keep only their most recent positions (sliding-window attention) and how many:
/// a layer whose queries see at most `window` keys, read by kernels that may start up to
/// `lookback` keys earlier (a key tile's alignment), needs the `window - 1 + lookback` positions
/// before a pass plus the pass's own, so its ring holds `window + lookback + RING_CHUNK`
/// positions and older ones are overwritten. Full-attention layers keep all.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rings {
    layers: Vec<Option<Ring>>,
}

/// One layer's ring.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Ring {
    /// Positions stored; position `j` in row `j % rows`.
    pub rows: usize,
    /// Positions before a pass's first that it may read (`window - 1 + lookback`).
    pub reach: usize,
}

impl Ring {
    /// The first position a cache may be truncated to (0 aside) once positions up to `high`
    /// were written: the next pass must still find its `reach` earlier positions.
    fn floor(&self, high: usize) -> usize {
        if high <= self.rows {
            0
        } else {
            high - self.rows + self.reach
        }
    }
}

impl Rings {
    /// No ring: every layer keeps every position.
    pub fn none() -> Self {
        Rings::default()
    }

    /// Rings for the layers with a window (`windows[l]`), kernels reading up to `lookback`
    /// positions before a window.
    pub fn for_windows(windows: impl IntoIterator<Item = Option<usize>>, lookback: usize) -> Self {
        Rings {
            layers: windows
                .into_iter()
                .map(|w| {
                    w.map(|w| Ring {
                        rows: ring_rows(w, lookback),
                        reach: (w + lookback).saturating_sub(1),
                    })
                })
                .collect(),
        }
    }

    /// Layer `layer`'s ring, `None` when it keeps every position.
    pub fn ring(&self, layer: usize) -> Option<Ring> {
        self.layers.get(layer).copied().flatten()
    }

    /// Layer `layer`'s ring size in positions, `None` when it keeps every position.
    pub fn rows(&self, layer: usize) -> Option<usize> {
        self.ring(layer).map(|r| r.rows)
    }

    /// Whether any layer has a ring.
    pub fn any(&self) -> bool {
        self.layers.iter().any(Option::is_some)
    }

    /// How many layers have a ring, and the largest ring's positions.
    pub fn summary(&self) -> (usize, Option<usize>) {
        let rows = self.layers.iter().flatten().map(|r| r.rows);
        (rows.clone().count(), rows.max())
    }

    /// The rings of layers `range` (a cache holding only those layers, as an early-exit
    /// draft's).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Self {
        Rings {
            layers: range.map(|l| self.ring(l)).collect(),
        }
    }

    /// Most positions one pass may add.
    pub fn max_chunk(&self) -> usize {
        if self.any() { RING_CHUNK } else { usize::MAX }
    }

    /// Refuses a pass of `n` positions the rings have no room for.
    pub fn check_pass(&self, n: usize) -> Result<(), KvError> {
        let max = self.max_chunk();
        if n > max {
            return Err(KvError::ChunkTooLong { adding: n, max });
        }
        Ok(())
    }

    /// Positions layer `layer` holds when `len` are cached.
    pub fn held(&self, layer: usize, len: usize) -> usize {
        self.rows(layer).map_or(len, |r| len.min(r))
    }

    /// The first length (0 aside) the cache can be truncated to once positions up to `high`
    /// were written, every ring still holding what the next pass reads.
    pub fn floor(&self, high: usize) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|r| r.floor(high))
            .max()
            .unwrap_or(0)
    }
}

/// Bytes a cache of rows shaped `shape` in `format` holds for `len` positions of `n_layers`
/// layers, the windowed ones keeping only their `rings` (the arithmetic
/// [`KvCache`](super::KvCache) allocates by, and `frugal info` and `frugal estimate` quote).
pub fn bytes_at(
    n_layers: usize,
    shape: CacheShape,
    format: KvFormat,
    rings: &Rings,
    len: usize,
) -> u128 {
    let row = (format.k.bytes(shape.k_dim()) + format.v.bytes(shape.v_dim())) as u128;
    (0..n_layers)
        .map(|l| rings.held(l, len) as u128 * row)
        .sum()
}

/// Positions a ring keeps for a window of `window` keys read with up to `lookback` extra.
pub fn ring_rows(window: usize, lookback: usize) -> usize {
    window.saturating_add(lookback).saturating_add(RING_CHUNK)
}
