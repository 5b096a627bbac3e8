//! The paged pool's physical storage: every layer's key and value buffers in one allocation.
//!
//! One allocation rather than one per layer and side: one mapping instead of sixty, and a
//! layer's buffer is often smaller than a huge page (SmolLM2's at 4,096 positions: 1.5 MiB), so
//! only a shared one could sit on huge pages (`crate::pages`; the pool asks for none, see
//! `PoolBuffers::zeroed`).

use std::ops::Range;

use crate::pages::Pages;

/// Keys and values of every layer, each a byte range of one buffer (empty for a layer whose
/// cache lives elsewhere, as a sliding-window layer's ring).
#[derive(Debug)]
pub(super) struct PoolBuffers {
    buf: Pages,
    /// Layer `l`'s keys and values: `at[l].0` and `at[l].1`, the keys first.
    at: Vec<(Range<usize>, Range<usize>)>,
}

impl PoolBuffers {
    /// Zeroed buffers of `sizes[l] = (key bytes, value bytes)` for each layer; each starts on
    /// a 64-byte line. An allocation that fails (or a total that overflows) is an error.
    pub(super) fn zeroed(sizes: &[(usize, usize)]) -> Result<Self, String> {
        let mut at = Vec::new();
        at.try_reserve_exact(sizes.len())
            .map_err(|e| e.to_string())?;
        let mut end = 0usize;
        let overflow = || "the size overflows".to_string();
        let mut take = |n: usize| -> Result<Range<usize>, String> {
            let start = end.checked_next_multiple_of(64).ok_or_else(overflow)?;
            end = start.checked_add(n).ok_or_else(overflow)?;
            Ok(start..end)
        };
        for &(k, v) in sizes {
            let k = take(k)?;
            let v = take(v)?;
            at.push((k, v));
        }
        Ok(Self {
            // Small pages: a pool is sized for the longest context and written only as far as
            // its sequences reach, and every head's region of every layer begins in its own
            // huge page, so a short sequence in a long pool would make ~2 MiB resident per
            // region (measured: 360 MiB for a 24-token generation in an 8,192-position f32
            // pool). Huge pages made attention at depth 4,096 8-11% faster.
            buf: Pages::zeroed(end, false)?,
            at,
        })
    }

    /// Layer `l`'s keys and values.
    pub(super) fn layer(&self, l: usize) -> (&[u8], &[u8]) {
        let (k, v) = &self.at[l];
        (&self.buf[k.clone()], &self.buf[v.clone()])
    }

    /// Layer `l`'s keys and values, to write.
    pub(super) fn layer_mut(&mut self, l: usize) -> (&mut [u8], &mut [u8]) {
        let (k, v) = &self.at[l];
        // The keys end where (or before) the values start.
        let (kb, vb) = self.buf.split_at_mut(v.start);
        (&mut kb[k.clone()], &mut vb[..v.len()])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every layer's buffers are as long as asked, zeroed, and written apart from each other.
    #[test]
    fn layers_are_disjoint_zeroed_and_sized() {
        let sizes = [(100, 50), (0, 0), (3 << 20, 3 << 20), (7, 0)];
        let mut p = PoolBuffers::zeroed(&sizes).unwrap();
        for (l, &(kn, vn)) in sizes.iter().enumerate() {
            let (k, v) = p.layer_mut(l);
            assert_eq!((k.len(), v.len()), (kn, vn));
            assert!(k.iter().chain(v.iter()).all(|&b| b == 0));
            k.fill(2 * l as u8 + 1);
            v.fill(2 * l as u8 + 2);
        }
        for (l, _) in sizes.iter().enumerate() {
            let (k, v) = p.layer(l);
            assert!(k.iter().all(|&b| b == 2 * l as u8 + 1));
            assert!(v.iter().all(|&b| b == 2 * l as u8 + 2));
        }
        assert!(PoolBuffers::zeroed(&[(usize::MAX, 1)]).is_err());
    }
}
