//! The paged cache: a pool of fixed-size blocks shared by many sequences.
//!
//! Each layer's keys (and values) live in one buffer of `n_blocks x block_size` rows; a sequence
//! owns a block table mapping its logical block `i` (positions `i*block_size ..`) to a physical
//! block. Blocks are handed out as a sequence grows and return to the pool when it ends, so memory
//! follows the tokens actually cached and no sequence needs its maximum length reserved.
//!
//! Forking shares every block of the parent (reference counted). A block is copied only when a
//! sequence is about to write into a block somebody else still holds (copy-on-write): after a
//! fork, both sequences share the full prefix blocks forever and each copies the partial last
//! block on its first append. Beam search, parallel sampling and a server's prompt cache all
//! reduce to `fork`.
//!
//! Physical buffers are allocated for the whole pool up front as zeroed memory, whose pages the
//! operating system supplies on first write: memory follows the blocks written, and appending
//! never reallocates (the decode loop does not allocate). Every layer's keys and values share
//! one allocation (`pool_buffers`), whose pages move onto huge pages as the blocks handed out
//! fill them. Each layer's buffer keeps one region
//! per KV head ([`BlockLayout::HeadRegions`]), so the blocks a growing sequence takes one after
//! another hold each head's positions as one stream. Keys stored as f32, f16 or bf16 are kept
//! by column within each block's part of a head (value `c` of the block's position `p` at
//! `c * block_size + p`, [`KvView::with_columns`]): attention scores keys with the keys in
//! vector lanes, and reads them that way straight from the block instead of transposing rows
//! (+8% decode at depth 4,096 with an f16 cache, +14% with f32, on Zen 2). Values, Q8_0 keys
//! (scored in integers along the head) and the rings keep rows.
//!
//! Automatic prefix caching: a full block can be registered under the hash of its tokens and of
//! every block before it ([`super::prefix`]). When the last sequence holding a registered block
//! lets go, the block keeps its contents and joins an LRU list instead of the free list; a new
//! sequence whose prompt starts with the same blocks attaches them ([`KvPool::attach_prefix`])
//! and computes only the rest. Allocation takes never-cached blocks first, then evicts the least
//! recently used cached one, so cached blocks count as free. A registered block is never written
//! again: a sequence that must write into one (after truncating into it) copies it first.
//!
//! Sliding-window layers ([`Rings`]) keep their positions in a separate space of blocks
//! ([`super::ring_blocks`]), a ring of them per sequence, so they stop growing past their
//! window; the main blocks then hold only the global layers. Such a pool caches no prefixes
//! (a ring no longer holds a prompt's early positions).

use std::collections::{BTreeMap, HashMap};

use super::contiguous::check_format;
use super::pool_buffers::PoolBuffers;
use super::prefix::BlockHash;
use super::ring_blocks::RingBlocks;
use super::{BlockLayout, CacheShape, KvError, KvFormat, KvSequence, KvType, KvView, Rings};

/// Positions per block unless asked otherwise (as vLLM): small enough that the unused tail of
/// the last block wastes little, large enough that a table lookup covers many rows.
pub const DEFAULT_BLOCK: usize = 16;

/// A sequence in a [`KvPool`]. Valid until [`KvPool::remove`]; using it after that is a bug and
/// panics.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct SeqId(u32);

impl SeqId {
    pub fn index(self) -> u32 {
        self.0
    }
}

#[derive(Debug, Clone)]
struct Seq {
    table: Vec<u32>,
    len: usize,
    pending: usize,
    max_len: usize,
    /// The ring blocks of the windowed layers (empty without rings).
    ring: Vec<u32>,
    /// Most positions ever committed (what the ring has overwritten follows from it).
    high: usize,
}

#[derive(Debug)]
pub struct KvPool {
    n_layers: usize,
    kv_dim: usize,
    /// Heads per row (keys-only rows: one), each in a region of its own.
    heads: usize,
    format: KvFormat,
    block_size: usize,
    total_blocks: usize,
    k_row: usize,
    v_row: usize,
    /// Per layer, every block of the pool laid out as [`Self::layout`] (empty for a layer in
    /// rings); only the blocks written so far occupy memory.
    buffers: PoolBuffers,
    /// Reference count of every materialized block (0 = in `free` or `evictable`).
    refs: Vec<u32>,
    free: Vec<u32>,
    /// Prefix cache: the hash a materialized block is registered under, and the reverse map.
    hash_of: Vec<Option<BlockHash>>,
    by_hash: HashMap<BlockHash, u32>,
    /// Registered blocks no sequence holds, least recently released first (key: release tick).
    evictable: BTreeMap<u64, u32>,
    /// Release tick of each block in `evictable`.
    tick_of: Vec<u64>,
    clock: u64,
    /// Blocks handed out at least once; the rest of the pool has never been written.
    fresh: usize,
    seqs: Vec<Option<Seq>>,
    /// The windowed layers' rings, and the blocks that hold them.
    rings: Rings,
    ring: Option<RingBlocks>,
    /// Whether the main buffers keep each block's keys by column ([`KvView::with_columns`]):
    /// f32, f16 and bf16 keys of a cache with separate values.
    k_columns: bool,
    /// One head's key, encoded, on its way into its columns.
    column_buf: Vec<u8>,
}

impl KvPool {
    /// A pool of `n_blocks` blocks of `block_size` positions for a model with these dimensions.
    pub fn new(
        n_layers: usize,
        shape: CacheShape,
        format: KvFormat,
        block_size: usize,
        n_blocks: usize,
    ) -> Result<Self, KvError> {
        Self::with_rings(n_layers, shape, format, block_size, n_blocks, Rings::none())
    }

    /// As [`new`](Self::new), the windowed layers of `rings` in rings of blocks of their own
    /// (as many as the main blocks: a sequence's ring never needs more than its main blocks).
    pub fn with_rings(
        n_layers: usize,
        shape: CacheShape,
        format: KvFormat,
        block_size: usize,
        n_blocks: usize,
        rings: Rings,
    ) -> Result<Self, KvError> {
        if block_size == 0 {
            return Err(KvError::BlockSize);
        }
        check_format(format.k, shape.head_dim)?;
        if shape.separate_values {
            check_format(format.v, shape.head_dim)?;
        }
        let kv_dim = shape.k_dim();
        let positions = n_blocks.saturating_mul(block_size);
        let err = |reason: String| KvError::Reserve {
            positions,
            kv_dim,
            n_layers,
            reason,
        };
        let rows = n_blocks
            .checked_mul(block_size)
            .ok_or_else(|| err("the size overflows".into()))?;
        kv_dim
            .checked_mul(4)
            .and_then(|r| r.checked_mul(rows))
            .and_then(|n| n.checked_mul(2 * n_layers))
            .filter(|_| n_blocks <= u32::MAX as usize)
            .ok_or_else(|| err("the size overflows".into()))?;
        // No value rows when attention reads the values from the keys (`v_row` 0).
        let (k_row, v_row) = (format.k.bytes(kv_dim), format.v.bytes(shape.v_dim()));
        let ring = RingBlocks::new(&rings, n_layers, block_size, n_blocks, (k_row, v_row), &err)?;
        let sizes: Vec<(usize, usize)> = (0..n_layers)
            .map(|l| match ring.as_ref().is_some_and(|r| r.windowed[l]) {
                true => (0, 0),
                false => (rows * k_row, rows * v_row),
            })
            .collect();
        let buffers = PoolBuffers::zeroed(&sizes, shape.n_head_kv.max(1), n_blocks).map_err(err)?;
        Ok(KvPool {
            n_layers,
            kv_dim,
            heads: shape.n_head_kv.max(1),
            format,
            block_size,
            total_blocks: n_blocks,
            k_row,
            v_row,
            buffers,
            refs: bookkeeping(n_blocks).map_err(err)?,
            free: bookkeeping(n_blocks).map_err(err)?,
            hash_of: bookkeeping(n_blocks).map_err(err)?,
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            tick_of: bookkeeping(n_blocks).map_err(err)?,
            clock: 0,
            fresh: 0,
            seqs: Vec::new(),
            rings,
            ring,
            k_columns: shape.separate_values
                && matches!(format.k, KvType::F32 | KvType::F16 | KvType::Bf16),
            column_buf: Vec::new(),
        })
    }

    /// How the main buffers hold their blocks.
    fn layout(&self) -> BlockLayout {
        BlockLayout::HeadRegions {
            blocks: self.total_blocks,
        }
    }

    /// Byte offset, in a main buffer of rows of `row` bytes, of head `h` of position `off` of
    /// physical block `blk`.
    fn head_at(&self, row: usize, blk: usize, off: usize, h: usize) -> usize {
        let bs = self.block_size;
        head_in_regions(row / self.heads, self.total_blocks, bs, blk, off, h)
    }

    /// Whether layer `l` keeps its positions in a ring.
    fn windowed(&self, l: usize) -> bool {
        self.ring.as_ref().is_some_and(|r| r.windowed[l])
    }

    pub fn format(&self) -> KvFormat {
        self.format
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total_blocks(&self) -> usize {
        self.total_blocks
    }

    /// Blocks not held by any sequence (cached ones included: they are evicted on demand).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + (self.total_blocks - self.fresh) + self.evictable.len()
    }

    /// Blocks registered in the prefix cache, held by a sequence or not.
    pub fn cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// Registered blocks no sequence holds (kept for reuse, evicted when space is needed).
    pub fn evictable_blocks(&self) -> usize {
        self.evictable.len()
    }

    pub fn blocks_in_use(&self) -> usize {
        self.total_blocks - self.free_blocks()
    }

    /// Bytes of one block across all layers, keys and values (what a position costs at
    /// most: with rings, the windowed layers' part stops growing at the ring).
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.n_layers * (self.k_row + self.v_row)
    }

    /// Bytes of the blocks held by sequences (shared blocks counted once), ring blocks
    /// included.
    pub fn bytes_in_use(&self) -> usize {
        match &self.ring {
            None => self.blocks_in_use() * self.block_bytes(),
            Some(r) => {
                let global = self.n_layers - r.windowed.iter().filter(|&&w| w).count();
                let main = self.block_size * global * (self.k_row + self.v_row);
                self.blocks_in_use() * main + r.in_use() * r.block_bytes()
            }
        }
    }

    /// Starts an empty sequence that may grow to `max_len` positions.
    pub fn add_sequence(&mut self, max_len: usize) -> SeqId {
        let seq = Seq {
            table: Vec::with_capacity(max_len.div_ceil(self.block_size)),
            len: 0,
            pending: 0,
            max_len,
            ring: Vec::with_capacity(self.ring.as_ref().map_or(0, |r| r.per_seq)),
            high: 0,
        };
        self.insert(seq)
    }

    fn insert(&mut self, seq: Seq) -> SeqId {
        if let Some(i) = self.seqs.iter().position(Option::is_none) {
            self.seqs[i] = Some(seq);
            SeqId(i as u32)
        } else {
            self.seqs.push(Some(seq));
            SeqId(self.seqs.len() as u32 - 1)
        }
    }

    fn get(&self, id: SeqId) -> Result<&Seq, KvError> {
        self.seqs
            .get(id.0 as usize)
            .and_then(Option::as_ref)
            .ok_or(KvError::NoSequence(id.0))
    }

    fn seq(&self, id: SeqId) -> &Seq {
        match self.get(id) {
            Ok(s) => s,
            Err(e) => panic!("{e}: sequence ids must not be used after `remove`"),
        }
    }

    fn seq_mut(&mut self, id: SeqId) -> &mut Seq {
        match self.seqs.get_mut(id.0 as usize).and_then(Option::as_mut) {
            Some(s) => s,
            None => panic!("no sequence {} in the KV pool", id.0),
        }
    }

    /// A new sequence sharing every cached position of `id` (no copy until one of them writes
    /// into a shared block).
    pub fn fork(&mut self, id: SeqId) -> Result<SeqId, KvError> {
        let mut s = self.get(id)?.clone();
        s.pending = 0;
        // Room for the whole table now, so the fork's decode loop never reallocates it.
        let want = s.max_len.div_ceil(self.block_size);
        s.table.reserve_exact(want.saturating_sub(s.table.len()));
        if let Some(r) = &mut self.ring {
            // Rings are not shared: the fork gets its own copy.
            if s.ring.len() > r.free_blocks() {
                return Err(KvError::PoolExhausted {
                    needed: s.ring.len(),
                    free: r.free_blocks(),
                    total: self.total_blocks,
                });
            }
            for b in &mut s.ring {
                let new = r.alloc();
                r.copy(*b, new);
                *b = new;
            }
        }
        for &b in &s.table {
            self.refs[b as usize] += 1;
        }
        Ok(self.insert(s))
    }

    /// Ends a sequence: its blocks go back to the pool unless another sequence shares them.
    pub fn remove(&mut self, id: SeqId) -> Result<(), KvError> {
        self.get(id)?;
        let s = self.seqs[id.0 as usize].take().expect("checked above");
        for b in s.table {
            self.release(b);
        }
        if let Some(r) = &mut self.ring {
            r.release(s.ring);
        }
        Ok(())
    }

    /// Sequences alive.
    pub fn sequences(&self) -> usize {
        self.seqs.iter().flatten().count()
    }

    pub fn seq_len(&self, id: SeqId) -> usize {
        self.seq(id).len
    }

    pub fn max_len(&self, id: SeqId) -> usize {
        self.seq(id).max_len
    }

    /// Most positions one reserve may take (see [`KvSequence::max_chunk`]).
    pub fn max_chunk(&self) -> usize {
        self.rings.max_chunk()
    }

    /// See [`KvSequence::rewind_floor`].
    pub fn rewind_floor(&self, id: SeqId) -> usize {
        self.rings.floor(self.seq(id).high)
    }

    /// Physical block of each logical block of the sequence.
    pub fn block_table(&self, id: SeqId) -> &[u32] {
        &self.seq(id).table
    }

    /// Drops positions from `n` on; blocks no longer needed return to the pool. Under rings,
    /// `n` must be 0 or at least [`rewind_floor`](Self::rewind_floor) (below it the whole
    /// sequence is dropped: a ring no longer holds what the next pass would read).
    pub fn truncate(&mut self, id: SeqId, n: usize) {
        let bs = self.block_size;
        let floor = self.rewind_floor(id);
        let s = self.seq_mut(id);
        let mut n = n.min(s.len);
        if n > 0 && n < floor {
            debug_assert!(false, "truncating to {n}, below the rings' floor {floor}");
            n = 0;
        }
        s.len = n;
        s.pending = 0;
        let keep = n.div_ceil(bs);
        let dropped: Vec<u32> = s.table.drain(keep..).collect();
        // A ring keeps its blocks (stale rows are overwritten before they are read) unless
        // the sequence empties.
        let ring: Vec<u32> = if n == 0 {
            s.high = 0;
            std::mem::take(&mut s.ring)
        } else {
            Vec::new()
        };
        for b in dropped {
            self.release(b);
        }
        if let Some(r) = &mut self.ring {
            r.release(ring);
        }
    }

    fn release(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r -= 1;
        if *r == 0 {
            if self.hash_of[b as usize].is_some() {
                self.tick_of[b as usize] = self.clock;
                self.evictable.insert(self.clock, b);
                self.clock += 1;
            } else {
                self.free.push(b);
            }
        }
    }

    /// Takes a block from the pool (the caller has checked one is free): a free block, else a
    /// fresh one, else the least recently used cached block, which leaves the cache.
    fn alloc(&mut self) -> u32 {
        let fresh_left = self.fresh < self.total_blocks;
        let b = match self.free.pop() {
            Some(b) => b,
            None if !fresh_left => {
                let (_, b) = self
                    .evictable
                    .pop_first()
                    .expect("the caller checked a block is free");
                if let Some(h) = self.hash_of[b as usize].take() {
                    self.by_hash.remove(&h);
                }
                b
            }
            None => {
                let b = self.fresh;
                self.fresh += 1;
                self.buffers.settle(self.fresh);
                self.refs.push(0);
                self.hash_of.push(None);
                self.tick_of.push(0);
                b as u32
            }
        };
        self.refs[b as usize] = 1;
        b
    }

    /// Makes room for `n` more positions of `id`: copies a shared partial last block
    /// (copy-on-write) and takes new blocks. Checks everything first, so a failure changes
    /// nothing.
    pub fn reserve(&mut self, id: SeqId, n: usize) -> Result<(), KvError> {
        let bs = self.block_size;
        let s = self.seq(id);
        if s.len + n > s.max_len {
            return Err(KvError::ContextFull {
                len: s.len,
                adding: n,
                capacity: s.max_len,
            });
        }
        self.rings.check_pass(n)?;
        let ring_needed = match &self.ring {
            None => 0,
            Some(r) => {
                let needed = r.needed(s.len + n).saturating_sub(s.ring.len());
                if needed > r.free_blocks() {
                    return Err(KvError::PoolExhausted {
                        needed,
                        free: r.free_blocks(),
                        total: self.total_blocks,
                    });
                }
                needed
            }
        };
        let partial = !s.len.is_multiple_of(bs) && n > 0;
        let cow = partial && {
            let b = s.table[s.len / bs] as usize;
            self.refs[b] > 1 || self.hash_of[b].is_some()
        };
        let needed = (s.len + n).div_ceil(bs).saturating_sub(s.table.len()) + usize::from(cow);
        if needed > self.free_blocks() {
            return Err(KvError::PoolExhausted {
                needed,
                free: self.free_blocks(),
                total: self.total_blocks,
            });
        }
        if cow {
            let i = s.len / bs;
            let old = s.table[i] as usize;
            let new = self.alloc();
            for l in 0..self.n_layers {
                if self.windowed(l) {
                    continue;
                }
                // Each head's run of the block lies in its own region.
                for h in 0..self.heads {
                    let at = |row, b| self.head_at(row, b, 0, h);
                    let (kf, kt) = (at(self.k_row, old), at(self.k_row, new as usize));
                    let (vf, vt) = (at(self.v_row, old), at(self.v_row, new as usize));
                    let (kn, vn) = (bs * self.k_row / self.heads, bs * self.v_row / self.heads);
                    let (kd, vd) = self.buffers.layer_mut(l);
                    kd.copy_within(kf..kf + kn, kt);
                    vd.copy_within(vf..vf + vn, vt);
                }
            }
            self.release(old as u32);
            self.seq_mut(id).table[i] = new;
        }
        while self.seq(id).table.len() * bs < self.seq(id).len + n {
            let b = self.alloc();
            self.seq_mut(id).table.push(b);
        }
        if let Some(r) = &mut self.ring {
            let s = self.seqs[id.0 as usize].as_mut().expect("checked above");
            for _ in 0..ring_needed {
                s.ring.push(r.alloc());
            }
        }
        self.seq_mut(id).pending = n;
        Ok(())
    }

    /// Registers logical block `block` of `id`, which must be full and committed, under `hash`
    /// (see [`super::prefix::block_hashes`]). A hash already registered keeps its block.
    pub fn register_block(&mut self, id: SeqId, block: usize, hash: BlockHash) {
        if self.ring.is_some() {
            return; // no prefix caching under rings
        }
        let s = self.seq(id);
        assert!(
            (block + 1) * self.block_size <= s.len,
            "only full, committed blocks are cached"
        );
        let b = s.table[block];
        if self.by_hash.contains_key(&hash) || self.hash_of[b as usize].is_some() {
            return;
        }
        self.hash_of[b as usize] = Some(hash);
        self.by_hash.insert(hash, b);
    }

    /// How many of `hashes` (a prompt's chained block hashes, in order) are cached, from the
    /// first on.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        if self.ring.is_some() {
            return 0;
        }
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Gives the empty sequence `id` the cached blocks of the longest prefix of `hashes`
    /// (shared, not copied) and returns how many blocks it took; their positions count as
    /// cached. At most `max_blocks` are taken.
    pub fn attach_prefix(&mut self, id: SeqId, hashes: &[BlockHash], max_blocks: usize) -> usize {
        let bs = self.block_size;
        let s = self.seq(id);
        assert!(
            s.len == 0 && s.table.is_empty(),
            "attach to an empty sequence"
        );
        let cap = max_blocks.min(s.max_len / bs);
        let mut taken = Vec::new();
        for h in hashes.iter().take(cap) {
            let Some(&b) = self.by_hash.get(h) else { break };
            if self.refs[b as usize] == 0 {
                self.evictable.remove(&self.tick_of[b as usize]);
            }
            self.refs[b as usize] += 1;
            taken.push(b);
        }
        let n = taken.len();
        let s = self.seq_mut(id);
        s.table.extend(taken);
        s.len = n * bs;
        n
    }

    /// Stores the keys and values of the reserved positions of `id` for `layer`.
    pub fn append(&mut self, id: SeqId, layer: usize, k: &[f32], v: &[f32]) {
        let (bs, kv_dim) = (self.block_size, self.kv_dim);
        let s = self.seqs[id.0 as usize]
            .as_ref()
            .expect("sequence ids must not be used after `remove`");
        debug_assert_eq!(k.len(), s.pending * kv_dim);
        let with_values = self.v_row > 0;
        debug_assert_eq!(v.len(), if with_values { k.len() } else { 0 });
        // A windowed layer writes into its ring: logical block `pos / bs` cycles through the
        // sequence's `per_seq` ring blocks, which are head-major ([`BlockLayout::HeadMajor`]).
        let heads = self.heads;
        let (k_row, v_row, blocks) = (self.k_row, self.v_row, self.total_blocks);
        let (kd, vd, table, per_seq, regions) =
            match self.ring.as_mut().filter(|r| r.windowed[layer]) {
                Some(r) => (
                    &mut r.k[layer][..],
                    &mut r.v[layer][..],
                    &s.ring,
                    r.per_seq,
                    false,
                ),
                None => {
                    let (kd, vd) = self.buffers.layer_mut(layer);
                    (kd, vd, &s.table, usize::MAX, true)
                }
            };
        let at = |row: usize, blk: usize, off: usize, h: usize| {
            let hb = row / heads;
            if regions {
                head_in_regions(hb, blocks, bs, blk, off, h)
            } else {
                blk * bs * row + h * bs * hb + off * hb
            }
        };
        let hd = kv_dim / heads;
        let (kh, vh) = (k_row / heads, v_row / heads);
        let columns = regions && self.k_columns;
        let (buf, es) = (&mut self.column_buf, self.format.k.bytes(1));
        for (i, kr) in k.chunks_exact(kv_dim).enumerate() {
            let pos = s.len + i;
            let (blk, off) = (table[(pos / bs) % per_seq] as usize, pos % bs);
            for h in 0..heads {
                let kr = &kr[h * hd..(h + 1) * hd];
                if columns {
                    // Value c of this position at c * bs + off of the head's part of the block.
                    buf.resize(kh, 0);
                    self.format.k.encode(kr, buf);
                    let base = at(k_row, blk, 0, h);
                    let column = &mut kd[base..base + bs * kh];
                    // Whole values of a known width: a copy of a width known only at run time
                    // is a call per value.
                    match es {
                        2 => scatter::<2>(buf, column, bs, off),
                        4 => scatter::<4>(buf, column, bs, off),
                        _ => unreachable!("keys by column are f32, f16 or bf16"),
                    }
                } else {
                    let at_k = at(k_row, blk, off, h);
                    self.format.k.encode(kr, &mut kd[at_k..at_k + kh]);
                }
                if with_values {
                    let at = at(v_row, blk, off, h);
                    let vr = &v[i * kv_dim + h * hd..i * kv_dim + (h + 1) * hd];
                    self.format.v.encode(vr, &mut vd[at..at + vh]);
                }
            }
        }
    }

    /// Marks `n` appended positions of `id` as cached.
    pub fn commit(&mut self, id: SeqId, n: usize) {
        let s = self.seq_mut(id);
        s.len += n;
        s.pending = 0;
        s.high = s.high.max(s.len);
    }

    /// Keys and values of `layer` for `id`, read through its block table.
    pub fn layer(&self, id: SeqId, layer: usize) -> (KvView<'_>, KvView<'_>) {
        let s = self.seq(id);
        let n = s.len + s.pending;
        let (kd, vd, table, ring) = match self.ring.as_ref().filter(|r| r.windowed[layer]) {
            Some(r) => (&r.k[layer][..], &r.v[layer][..], &s.ring, r.rows()),
            None => {
                let (kd, vd) = self.buffers.layer(layer);
                (kd, vd, &s.table, 0)
            }
        };
        let bs = self.block_size;
        let layout = if ring > 0 {
            BlockLayout::HeadMajor
        } else {
            self.layout()
        };
        let mut keys =
            KvView::paged(self.format.k, self.k_row, n, kd, table, bs, layout).with_ring(ring);
        if self.k_columns && ring == 0 {
            keys = keys.with_columns();
        }
        if self.v_row == 0 {
            return (keys, keys);
        }
        let values =
            KvView::paged(self.format.v, self.v_row, n, vd, table, bs, layout).with_ring(ring);
        (keys, values)
    }

    /// The sequence `id` as something the forward pass can run on.
    pub fn slot(&mut self, id: SeqId) -> PagedSeq<'_> {
        self.seq(id);
        PagedSeq { pool: self, id }
    }
}

/// Byte offset of head `h` of position `off` of block `blk` under [`BlockLayout::HeadRegions`]:
/// heads of `head_bytes` each, regions of `blocks` blocks of `bs` positions.
fn head_in_regions(
    head_bytes: usize,
    blocks: usize,
    bs: usize,
    blk: usize,
    off: usize,
    h: usize,
) -> usize {
    ((h * blocks + blk) * bs + off) * head_bytes
}

/// An empty vector with room for one entry per block, or an error (not an abort) when that
/// much cannot be reserved.
fn bookkeeping<T>(n_blocks: usize) -> Result<Vec<T>, String> {
    let mut v = Vec::new();
    v.try_reserve_exact(n_blocks).map_err(|e| e.to_string())?;
    Ok(v)
}

/// One sequence of a pool, borrowed for a forward pass.
pub struct PagedSeq<'p> {
    pool: &'p mut KvPool,
    id: SeqId,
}

impl KvSequence for PagedSeq<'_> {
    fn len(&self) -> usize {
        self.pool.seq_len(self.id)
    }
    fn reserve(&mut self, n: usize) -> Result<(), KvError> {
        self.pool.reserve(self.id, n)
    }
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) {
        self.pool.append(self.id, layer, k, v)
    }
    fn commit(&mut self, n: usize) {
        self.pool.commit(self.id, n)
    }
    fn layer(&self, layer: usize) -> (KvView<'_>, KvView<'_>) {
        self.pool.layer(self.id, layer)
    }
    fn room(&self) -> usize {
        self.pool.max_len(self.id) - self.pool.seq_len(self.id)
    }
    fn max_chunk(&self) -> usize {
        self.pool.max_chunk()
    }
    fn rewind_floor(&self) -> usize {
        self.pool.rewind_floor(self.id)
    }
}

#[cfg(test)]
mod tests;

/// Value `c` of one encoded key (`W` bytes each) to `c * bs + off` of its head's part of a
/// block kept by column.
fn scatter<const W: usize>(key: &[u8], block: &mut [u8], bs: usize, off: usize) {
    for (c, v) in key.chunks_exact(W).enumerate() {
        let at = (c * bs + off) * W;
        block[at..at + W].copy_from_slice(v);
    }
}
