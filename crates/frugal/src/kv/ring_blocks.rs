//! The paged pool's storage for sliding-window layers: a second space of blocks, separate from
//! the one the full-attention layers share, in which each sequence cycles through a ring of at
//! most `per_seq` blocks. Position `p` of a windowed layer lives in the sequence's ring block
//! `(p / block_size) % per_seq`, so once a sequence is longer than its ring, new positions
//! overwrite ones no query can see any more and the windowed layers stop growing: Gemma 3's 15
//! local layers hold about 1,040 positions each at any context, while its 3 global layers hold
//! every position in the main blocks.
//!
//! Ring blocks belong to one sequence (a fork copies them; they are never in the prefix cache,
//! since a ring no longer holds a prompt's early positions).

use super::{KvError, Rings};

#[derive(Debug)]
pub(super) struct RingBlocks {
    /// Blocks in one sequence's full ring.
    pub per_seq: usize,
    /// Whether each layer is windowed (stored here) or global (in the main blocks).
    pub windowed: Vec<bool>,
    total: usize,
    /// Blocks materialized so far; the rest is reserved address space.
    fresh: usize,
    free: Vec<u32>,
    block_size: usize,
    k_row: usize,
    v_row: usize,
    /// Per layer (empty for global layers).
    pub k: Vec<Vec<u8>>,
    pub v: Vec<Vec<u8>>,
}

impl RingBlocks {
    /// A space of `total` blocks for the windowed layers of `rings` (`None` when no layer has
    /// a ring), each ring rounded up to whole blocks.
    pub fn new(
        rings: &Rings,
        n_layers: usize,
        block_size: usize,
        total: usize,
        (k_row, v_row): (usize, usize),
        err: &dyn Fn(String) -> KvError,
    ) -> Result<Option<Self>, KvError> {
        let windowed: Vec<bool> = (0..n_layers).map(|l| rings.rows(l).is_some()).collect();
        let Some(rows) = (0..n_layers).filter_map(|l| rings.rows(l)).max() else {
            return Ok(None);
        };
        let mut k = Vec::with_capacity(n_layers);
        let mut v = Vec::with_capacity(n_layers);
        for &w in &windowed {
            for (side, rb) in [(&mut k, k_row), (&mut v, v_row)] {
                let mut buf: Vec<u8> = Vec::new();
                if w {
                    buf.try_reserve_exact(total * block_size * rb)
                        .map_err(|e| err(e.to_string()))?;
                }
                side.push(buf);
            }
        }
        Ok(Some(RingBlocks {
            per_seq: rows.div_ceil(block_size),
            windowed,
            total,
            fresh: 0,
            free: Vec::new(),
            block_size,
            k_row,
            v_row,
            k,
            v,
        }))
    }

    /// Positions a full ring holds.
    pub fn rows(&self) -> usize {
        self.per_seq * self.block_size
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.total - self.fresh
    }

    pub fn in_use(&self) -> usize {
        self.total - self.free_blocks()
    }

    /// Blocks a sequence's ring needs to hold positions `0..len`.
    pub fn needed(&self, len: usize) -> usize {
        len.div_ceil(self.block_size).min(self.per_seq)
    }

    /// Bytes of one block across the windowed layers.
    pub fn block_bytes(&self) -> usize {
        let layers = self.windowed.iter().filter(|&&w| w).count();
        self.block_size * layers * (self.k_row + self.v_row)
    }

    /// Takes a block (the caller has checked one is free).
    pub fn alloc(&mut self) -> u32 {
        if let Some(b) = self.free.pop() {
            return b;
        }
        debug_assert!(
            self.fresh < self.total,
            "the caller checked a block is free"
        );
        let b = self.fresh;
        self.fresh += 1;
        let rows = self.fresh * self.block_size;
        for l in 0..self.windowed.len() {
            if self.windowed[l] {
                // Within the reserved capacity: no reallocation.
                self.k[l].resize(rows * self.k_row, 0);
                self.v[l].resize(rows * self.v_row, 0);
            }
        }
        b as u32
    }

    pub fn release(&mut self, blocks: impl IntoIterator<Item = u32>) {
        self.free.extend(blocks);
    }

    /// Copies block `from` into block `to` in every windowed layer (a fork's own ring).
    pub fn copy(&mut self, from: u32, to: u32) {
        let (kr, vr) = (self.block_size * self.k_row, self.block_size * self.v_row);
        let (from, to) = (from as usize, to as usize);
        for l in 0..self.windowed.len() {
            if self.windowed[l] {
                self.k[l].copy_within(from * kr..(from + 1) * kr, to * kr);
                self.v[l].copy_within(from * vr..(from + 1) * vr, to * vr);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::kv::{CacheShape, KvCache, KvFormat, KvPool, KvSequence, KvView, RING_CHUNK, Rings};

    const KV_DIM: usize = 8;

    /// Row `p` of layer `l` holds `p + 10000 l` in every value: what a read must find.
    fn push(c: &mut dyn KvSequence, layers: usize, pos0: usize, n: usize) {
        c.reserve(n).unwrap();
        for l in 0..layers {
            let k: Vec<f32> = (pos0..pos0 + n)
                .flat_map(|p| [(p + 10_000 * l) as f32; KV_DIM])
                .collect();
            c.append(l, &k, &k);
        }
        c.commit(n);
    }

    /// The positions `from..view.len()` as stored (first value of each row).
    fn read(view: KvView, from: usize) -> Vec<f32> {
        let n = view.len() - from;
        let mut out = vec![0f32; n * KV_DIM];
        view.decode_head(0, KV_DIM, from, n, &mut out);
        out.chunks(KV_DIM).map(|r| r[0]).collect()
    }

    /// Layer 0 windowed (window 10), layer 1 global: past the ring, the windowed layer still
    /// reads its last `ring` positions right (in both layouts), the global one every position,
    /// and the windowed layer's memory stops growing.
    #[test]
    fn rings_keep_the_last_positions_in_both_layouts() {
        let rings = Rings::for_windows([Some(10), None], 0);
        let ring = rings.rows(0).unwrap();
        assert_eq!(ring, 10 + RING_CHUNK);
        let shape = CacheShape::new(1, KV_DIM);
        let f = KvFormat::default();
        let total = 1500;
        let mut flat = KvCache::with_rings(2, shape, total, f, rings.clone()).unwrap();
        let mut pool = KvPool::with_rings(2, shape, f, 16, total.div_ceil(16), rings).unwrap();
        let id = pool.add_sequence(total);
        let mut pos = 0;
        for n in [300, 512, 1, 512, 175] {
            push(&mut flat, 2, pos, n);
            push(&mut pool.slot(id), 2, pos, n);
            pos += n;
            for (k, _) in [flat.layer(0), pool.layer(id, 0)] {
                let from = pos.saturating_sub(ring);
                let want: Vec<f32> = (from..pos).map(|p| p as f32).collect();
                assert_eq!(read(k, from), want, "windowed layer at {pos}");
            }
            for (k, _) in [flat.layer(1), pool.layer(id, 1)] {
                let want: Vec<f32> = (0..pos).map(|p| (p + 10_000) as f32).collect();
                assert_eq!(read(k, 0), want, "global layer at {pos}");
            }
        }
        let row = 2 * 4 * KV_DIM; // f32 key and value
        assert_eq!(flat.bytes_in_use(), (total + ring) * row);
        // The pool: whole blocks (the ring rounded up to 33 blocks of 16).
        assert_eq!(
            pool.bytes_in_use(),
            (total.div_ceil(16) + ring.div_ceil(16)) * 16 * row
        );
        // One pass takes at most a chunk; rewinding stops at the floor.
        assert!(pool.slot(id).reserve(RING_CHUNK + 1).is_err());
        let floor = flat.rewind_floor();
        assert_eq!(floor, pos - ring + 9);
        assert_eq!(pool.rewind_floor(id), floor);
    }

    /// A fork copies the ring (its appends do not reach the parent); removing both returns
    /// every block, ring blocks included.
    #[test]
    fn forks_own_their_rings_and_removal_frees_them() {
        let rings = Rings::for_windows([Some(4)], 0);
        let shape = CacheShape::new(1, KV_DIM);
        let mut pool = KvPool::with_rings(1, shape, KvFormat::default(), 16, 100, rings).unwrap();
        let a = pool.add_sequence(1000);
        push(&mut pool.slot(a), 1, 0, 500);
        push(&mut pool.slot(a), 1, 500, 200);
        let b = pool.fork(a).unwrap();
        push(&mut pool.slot(b), 1, 700, 3);
        let from = 700 - 500;
        let want: Vec<f32> = (from..700).map(|p| p as f32).collect();
        assert_eq!(read(pool.layer(a, 0).0, from), want);
        let mut want_b = want.clone();
        want_b.extend([700.0, 701.0, 702.0]);
        assert_eq!(read(pool.layer(b, 0).0, from), want_b);
        pool.remove(a).unwrap();
        pool.remove(b).unwrap();
        assert_eq!(pool.bytes_in_use(), 0);
        assert_eq!(pool.blocks_in_use(), 0);
    }
}
