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
    /// The buffer's huge pages that blocks will fill (most of), as (blocks the pool must have
    /// handed out for it, its first byte), in the order they fill: see [`Self::settle`].
    fill: Vec<(usize, usize)>,
    /// How many of `fill` are on huge pages already.
    settled: usize,
}

impl PoolBuffers {
    /// Zeroed buffers of `sizes[l] = (key bytes, value bytes)` for each layer; each starts on
    /// a 64-byte line. An allocation that fails (or a total that overflows) is an error.
    ///
    /// Each buffer holds `heads` regions of `blocks` equal blocks (the pool's
    /// [`super::BlockLayout::HeadRegions`]), which the pool hands out in order.
    pub(super) fn zeroed(
        sizes: &[(usize, usize)],
        heads: usize,
        blocks: usize,
    ) -> Result<Self, String> {
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
        // Small pages at first: a pool is sized for the longest context and written only as
        // far as its sequences reach, and every head's region of every layer begins in a huge
        // page of its own, so huge pages from the start would make ~2 MiB resident per region
        // for a short sequence in a long pool (measured: 509 MB for a 24-token generation in
        // an 8,192-position f32 pool). `settle` moves each page onto a huge one once the
        // blocks handed out fill most of it. Allocated first: a size no system could give
        // fails here, before any work in proportion to it.
        let buf = Pages::zeroed(end, false)?;
        // The regions' streams of blocks, and for each huge page of the buffer the fewest
        // blocks handed out by which blocks fill seven eighths of it: then committing the
        // whole page wastes at most an eighth of it (a region's unused last blocks).
        let mut regions = Vec::new();
        regions
            .try_reserve_exact(2 * heads * at.len())
            .map_err(|e| e.to_string())?;
        for (k, v) in &at {
            for r in [k, v].into_iter().filter(|r| !r.is_empty()) {
                let len = r.len() / heads.max(1);
                let block = len / blocks.max(1);
                for h in 0..heads {
                    regions.push((r.start + h * len, block));
                }
            }
        }
        let huge = Pages::HUGE;
        let filled = |page: usize, f: usize| -> usize {
            regions
                .iter()
                .map(|&(start, block)| {
                    let (lo, hi) = (start.max(page), (start + f * block).min(page + huge));
                    hi.saturating_sub(lo)
                })
                .sum()
        };
        let mut fill = Vec::new();
        fill.try_reserve_exact(end / huge)
            .map_err(|e| e.to_string())?;
        for page in (0..end / huge).map(|i| i * huge) {
            if 8 * filled(page, blocks) < 7 * huge {
                continue; // never filled enough (alignment gaps, or beyond the regions)
            }
            let (mut lo, mut hi) = (0, blocks);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if 8 * filled(page, mid) >= 7 * huge {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            fill.push((lo, page));
        }
        fill.sort_unstable();
        Ok(Self {
            buf,
            at,
            fill,
            settled: 0,
        })
    }

    /// The pool has handed out `blocks` blocks (each head's region filled that far): the
    /// buffer's pages those blocks fill (seven eighths or more) move onto huge pages (`Pages::collapse`), since
    /// they will all be written and are read at every decode step. Measured on Zen 2 at depth
    /// 4,096: attention 8-11% faster than on small pages.
    pub(super) fn settle(&mut self, blocks: usize) {
        while let Some(&(need, page)) = self.fill.get(self.settled)
            && need <= blocks
        {
            self.buf.collapse(page..page + Pages::HUGE);
            self.settled += 1;
        }
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
        let mut p = PoolBuffers::zeroed(&sizes, 1, 1).unwrap();
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
        assert!(PoolBuffers::zeroed(&[(usize::MAX, 1)], 1, 1).is_err());
    }
}
