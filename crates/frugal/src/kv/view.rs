//! Read access to one layer's cached keys or values, whatever the storage: rows reached
//! through an optional block table, heads laid out as [`BlockLayout`] says.

use super::{HeadAddr, KvType, cache_lines};

/// Where a paged cache's buffer keeps head `h` of a block's positions. Either way the rows
/// one head's attention reads lie back to back, which the hardware prefetcher follows; a head
/// slice at the stride of a whole row (the contiguous cache) it loses at every page.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum BlockLayout {
    /// Each block head-major: the block's positions of head 0, then of head 1, and so on. A
    /// head's run ends with its block (a few KiB at 16 positions).
    HeadMajor,
    /// One region per head, of `blocks` blocks: head `h` of physical block `b` is at row
    /// `h * blocks * block_size + b * block_size` of the buffer. Blocks allocated one after
    /// another (what a single growing sequence gets) then continue one head's run across their
    /// boundaries, so a long context is read as one stream per head.
    HeadRegions { blocks: usize },
}

impl BlockLayout {
    /// Whether a head's rows continue from one physical block into the next.
    fn heads_apart(self) -> bool {
        matches!(self, BlockLayout::HeadRegions { .. })
    }
}

/// Read access to the cached keys (or values) of one layer, whatever the layout: rows are
/// reached through an optional block table. Cheap to copy; attention holds one per side.
///
/// A contiguous cache stores whole rows one after another (all heads of a position together).
/// A paged cache keeps the rows attention reads for one head back to back, instead of one
/// head-slice per row at the stride of a whole row: see [`BlockLayout`].
#[derive(Copy, Clone, Debug)]
pub struct KvView<'a> {
    ty: KvType,
    row_bytes: usize,
    len: usize,
    data: &'a [u8],
    /// Physical block of each logical block, the block size and where a block's heads lie,
    /// for a paged cache.
    table: Option<(&'a [u32], usize, BlockLayout)>,
    /// A ring of this many rows (a sliding-window layer): position `j` lives in row
    /// `j % ring`, so only the last `ring` positions are readable. 0: no ring.
    ring: usize,
    /// Keys of a paged pool stored by column within each block (see [`KvView::columns`]).
    columns: bool,
}

impl<'a> KvView<'a> {
    /// A contiguous view of `len` rows of `row_bytes` each.
    pub fn contiguous(ty: KvType, row_bytes: usize, len: usize, data: &'a [u8]) -> Self {
        Self::contiguous_ring(ty, row_bytes, len, 0, data)
    }

    /// A contiguous view of a ring of `ring` rows (0: none) holding the last of `len`
    /// positions ([`with_ring`](Self::with_ring) checks the rows stored).
    pub fn contiguous_ring(
        ty: KvType,
        row_bytes: usize,
        len: usize,
        ring: usize,
        data: &'a [u8],
    ) -> Self {
        KvView {
            ty,
            row_bytes,
            len,
            data,
            table: None,
            ring: 0,
            columns: false,
        }
        .with_ring(ring)
    }

    /// A paged view: logical row `j` lives in physical block `table[j / block_size]`, laid
    /// out as `layout` says. `len` may pass the table's blocks only for a ring
    /// ([`with_ring`](Self::with_ring) checks the blocks against the ring's rows).
    pub fn paged(
        ty: KvType,
        row_bytes: usize,
        len: usize,
        data: &'a [u8],
        table: &'a [u32],
        block_size: usize,
        layout: BlockLayout,
    ) -> Self {
        KvView {
            ty,
            row_bytes,
            len,
            data,
            table: Some((table, block_size, layout)),
            ring: 0,
            columns: false,
        }
    }

    /// The same view over a ring of `rows` rows: position `j` is stored at row `j % rows` (of
    /// the contiguous data, or of the block table's blocks taken in order).
    pub fn with_ring(mut self, rows: usize) -> Self {
        self.ring = rows;
        let readable = if rows == 0 {
            self.len
        } else {
            self.len.min(rows)
        };
        debug_assert!(match self.table {
            Some((table, bs, _)) => table.len() * bs >= readable,
            None => self.data.len() >= readable * self.row_bytes,
        });
        self
    }

    /// The same paged view over blocks that keep each head's values by column: value `c` of
    /// the block's position `p` at `c * block_size + p` of the head's part of the block
    /// (`HeadRegions` layout, f32, f16 or bf16). Attention scores keys with the keys in vector
    /// lanes, so keys stored this way are widened into its tile column by column instead of
    /// being transposed from rows; read through [`head_block`](Self::head_block).
    pub fn with_columns(mut self) -> Self {
        debug_assert!(
            matches!(self.table, Some((_, _, BlockLayout::HeadRegions { .. })))
                && self.ring == 0
                && matches!(self.ty, KvType::F32 | KvType::F16 | KvType::Bf16),
            "columns are for the f32, f16 and bf16 blocks of a paged pool's regions"
        );
        self.columns = true;
        self
    }

    /// Whether the blocks keep each head's values by column ([`with_columns`](Self::with_columns)):
    /// then [`head_run`](Self::head_run) has no rows to give, and [`head_block`](Self::head_block)
    /// reads them.
    pub fn columns(&self) -> bool {
        self.columns
    }

    /// For a view by columns: head `head` of the block holding position `start`, as the
    /// block's bytes for that head (`block_size x head_dim` values, column after column), the
    /// block size, the position's offset in the block, and how many positions from `start` on
    /// (at most `max`) the block holds.
    pub fn head_block(
        &self,
        head: usize,
        head_dim: usize,
        start: usize,
        max: usize,
    ) -> (&'a [u8], usize, usize, usize) {
        let Some((table, bs, BlockLayout::HeadRegions { blocks })) = self.table else {
            unreachable!("head_block reads a paged view by columns");
        };
        debug_assert!(self.columns && start < self.len);
        let (blk, off) = (start / bs, start % bs);
        let m = max.min(self.len - start).min(bs - off);
        let hb = self.ty.bytes(head_dim);
        let at = (head * blocks + table[blk] as usize) * bs * hb;
        (&self.data[at..at + bs * hb], bs, off, m)
    }

    /// A view of plain f32 rows (`len x kv_dim`), for tests and benchmarks.
    pub fn from_f32(data: &'a [f32], kv_dim: usize) -> Self {
        // SAFETY: any initialized f32 is 4 initialized bytes, u8 has alignment 1, and the
        // length is the same memory measured in bytes. Rows are read back with from_le_bytes,
        // which is the identity on the little-endian targets frugal supports.
        let bytes =
            unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), data.len() * 4) };
        Self::contiguous(KvType::F32, kv_dim * 4, data.len() / kv_dim.max(1), bytes)
    }

    pub fn ty(&self) -> KvType {
        self.ty
    }

    /// Rows visible.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where position `start` is stored: its physical row (for a paged cache, `block *
    /// block_size + offset`), and how many positions from `start` on (at most `max`) follow it
    /// in the same run of rows (a block, or the end of a ring).
    #[inline]
    fn locate(&self, start: usize, max: usize) -> (usize, usize) {
        debug_assert!(start < self.len);
        debug_assert!(
            self.ring == 0 || start + self.ring >= self.len,
            "position {start} is no longer in a ring of {} ending at {}",
            self.ring,
            self.len
        );
        let mut max = max.min(self.len - start);
        let start = if self.ring > 0 {
            let slot = start % self.ring;
            max = max.min(self.ring - slot);
            slot
        } else {
            start
        };
        match self.table {
            None => (start, max),
            Some((table, bs, layout)) => {
                let (blk, off) = (start / bs, start % bs);
                let mut run = max.min(bs - off);
                if layout.heads_apart() && self.ring == 0 {
                    // Physically consecutive blocks continue each head's run.
                    let mut b = blk;
                    while run < max && table.get(b + 1) == Some(&(table[b] + 1)) {
                        b += 1;
                        run = max.min(run + bs);
                    }
                }
                (table[blk] as usize * bs + off, run)
            }
        }
    }

    /// Head `head` (of `head_dim` values) of positions `start..`: the bytes from the first
    /// one's head on, the stride between consecutive positions' heads, and how many positions
    /// (at most `max`) lie at that stride before the next block.
    #[inline]
    pub fn head_run(
        &self,
        head: usize,
        head_dim: usize,
        start: usize,
        max: usize,
    ) -> (&'a [u8], usize, usize) {
        debug_assert!(
            !self.columns,
            "a view by columns has no rows: use head_block"
        );
        let hb = self.ty.bytes(head_dim);
        let (row, m) = self.locate(start, max);
        match self.table {
            None => (
                &self.data[row * self.row_bytes + head * hb..],
                self.row_bytes,
                m,
            ),
            Some((_, bs, layout)) => {
                debug_assert!(self.row_bytes.is_multiple_of(hb), "heads of a paged row");
                let at = match layout {
                    BlockLayout::HeadMajor => {
                        let (blk, off) = (row / bs, row % bs);
                        blk * bs * self.row_bytes + head * bs * hb + off * hb
                    }
                    BlockLayout::HeadRegions { blocks } => (head * blocks * bs + row) * hb,
                };
                (&self.data[at..at + m * hb], hb, m)
            }
        }
    }

    /// Asks the CPU to start loading head `head` of rows `start..start+n` into its caches. A
    /// decode step reads each cached row once, a few hundred bytes at a stride of a whole row
    /// (all heads), in blocks that lie anywhere in the pool: the hardware prefetcher loses
    /// that stream at every page and block boundary, and attention then waits on memory
    /// latency rather than bandwidth. A hint only: nothing is read or changed.
    #[inline]
    pub fn prefetch_head(&self, head: usize, head_dim: usize, start: usize, n: usize) {
        #[cfg(target_arch = "x86_64")]
        self.head_spans(head, head_dim, start, n, |span| {
            for line in cache_lines(span) {
                // SAFETY: prefetching is a hint that never faults; the line is the span's anyway.
                unsafe {
                    use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
                    _mm_prefetch::<_MM_HINT_T1>(std::ptr::without_provenance(line * 64))
                }
            }
        });
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (head, head_dim, start, n);
    }

    /// The address of the first byte [`head_spans`](Self::head_spans) gives for position
    /// `pos` alone: its head's row, or for a view by columns its head's part of the block that
    /// holds it. What the prefetch plan compares to tell whether a tile continues the last
    /// one in memory, without the spans' slices and closures (it asks twice a side a tile).
    /// It repeats `head_run`'s and `head_block`'s layout arithmetic rather than calling them:
    /// through them (slices, bounds checks) decode attention at depth 4,096 ran 3% slower.
    #[inline]
    pub fn head_start(&self, head: usize, head_dim: usize, pos: usize) -> usize {
        let hb = self.ty.bytes(head_dim);
        let (row, _) = self.locate(pos, 1);
        let offset = match self.table {
            Some((_, bs, BlockLayout::HeadRegions { blocks })) if self.columns => {
                (head * blocks * bs + row / bs * bs) * hb
            }
            None => row * self.row_bytes + head * hb,
            Some((_, bs, BlockLayout::HeadMajor)) => {
                let (blk, off) = (row / bs, row % bs);
                blk * bs * self.row_bytes + head * bs * hb + off * hb
            }
            Some((_, bs, BlockLayout::HeadRegions { blocks })) => (head * blocks * bs + row) * hb,
        };
        self.data.as_ptr() as usize + offset
    }

    /// Where head `head` of each position lies ([`HeadAddr::at`]), with the layout's parts
    /// taken out once: for a paged view in per-head regions, no ring, blocks of a power of two
    /// positions. Decode's fused tiles (`attention::decode_fused`) find sixteen keys' keys and
    /// values this way twice a tile each (through `head_start`, a division by the block size
    /// and the layout's match each time, it cost a twentieth of decode attention).
    pub fn head_addr(&self, head_dim: usize) -> Option<HeadAddr<'a>> {
        let Some((table, bs, BlockLayout::HeadRegions { blocks })) = self.table else {
            return None;
        };
        if self.ring != 0 || !bs.is_power_of_two() {
            return None;
        }
        let hb = self.ty.bytes(head_dim);
        Some(HeadAddr {
            base: self.data.as_ptr() as usize,
            table,
            shift: bs.trailing_zeros(),
            head_bytes: blocks * bs * hb,
            block_bytes: bs * hb,
            step: if self.columns { self.ty.bytes(1) } else { hb },
            head_bytes_one: hb,
        })
    }

    /// Whether each block's rows of one head lie back to back (a paged view in per-head
    /// regions, by rows, no ring): then the rows of a block's positions `p..p + n` of a head
    /// are `n` rows of `head_dim` values from [`HeadAddr::at`]`(p)` on.
    pub fn head_rows_back_to_back(&self) -> bool {
        matches!(self.table, Some((_, _, BlockLayout::HeadRegions { .. })))
            && self.ring == 0
            && !self.columns
    }

    /// Positions per block of a paged view (1 for a contiguous one: every row its own run).
    pub fn block_size(&self) -> usize {
        self.table.map_or(1, |(_, bs, _)| bs)
    }

    /// Calls `f` with the bytes of head `head` of rows `start..start+n`, one span per run of
    /// rows whose heads lie back to back (a per-head region: a whole run at once, so a head that
    /// is not a whole number of lines, 68 bytes for a Q8_0 head of 64, shares its lines with
    /// its neighbours rather than asking for them twice), else one per row.
    pub fn head_spans(
        &self,
        head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
        mut f: impl FnMut(&'a [u8]),
    ) {
        let hb = self.ty.bytes(head_dim);
        if self.columns {
            // The whole blocks holding the positions (a block's part of a head is one span of
            // columns); blocks one after another in the pool continue one region.
            let Some((_, bs, BlockLayout::HeadRegions { blocks })) = self.table else {
                unreachable!("only a paged view has columns");
            };
            let mut done = 0;
            while done < n {
                let (row, m) = self.locate(start + done, n - done);
                let (r0, r1) = (row / bs * bs, (row + m).div_ceil(bs) * bs);
                let base = head * blocks * bs;
                f(&self.data[(base + r0) * hb..(base + r1) * hb]);
                done += m;
            }
            return;
        }
        let mut done = 0;
        while done < n {
            let (bytes, stride, m) = self.head_run(head, head_dim, start + done, n - done);
            if stride == hb {
                f(&bytes[..m * hb]);
            } else {
                for r in 0..m {
                    f(&bytes[r * stride..][..hb]);
                }
            }
            done += m;
        }
    }

    /// Decodes head `head` (of `head_dim` values) of rows `start..start+n` into `out`
    /// (`n x head_dim`, row-major): how attention reads a cache in a format it cannot use in
    /// place, a tile at a time, straight from the stored format.
    #[inline]
    pub fn decode_head(
        &self,
        head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
        out: &mut [f32],
    ) {
        self.decode_head_into(head, head_dim, start, n, out, head_dim);
    }

    /// Decodes whole rows `start..start+n` (`heads` heads of `head_dim` values each) into `out`
    /// (`n x heads * head_dim`, row-major), whatever the layout.
    pub fn decode_rows(
        &self,
        heads: usize,
        head_dim: usize,
        start: usize,
        n: usize,
        out: &mut [f32],
    ) {
        for h in 0..heads {
            let width = heads * head_dim;
            self.decode_head_into(h, head_dim, start, n, &mut out[h * head_dim..], width);
        }
    }

    /// [`decode_head`](Self::decode_head) with output row `r` at `out[r * out_stride..]`.
    #[inline]
    fn decode_head_into(
        &self,
        head: usize,
        head_dim: usize,
        start: usize,
        n: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let hb = self.ty.bytes(head_dim);
        let mut done = 0;
        while done < n {
            if self.columns {
                let (bytes, bs, off, m) = self.head_block(head, head_dim, start + done, n - done);
                let es = self.ty.bytes(1);
                for r in 0..m {
                    let o = &mut out[(done + r) * out_stride..][..head_dim];
                    for (c, v) in o.iter_mut().enumerate() {
                        let at = (c * bs + off + r) * es;
                        self.ty.decode(&bytes[at..at + es], std::slice::from_mut(v));
                    }
                }
                done += m;
                continue;
            }
            let (bytes, stride, m) = self.head_run(head, head_dim, start + done, n - done);
            for r in 0..m {
                let o = &mut out[(done + r) * out_stride..][..head_dim];
                self.ty.decode(&bytes[r * stride..r * stride + hb], o);
            }
            done += m;
        }
    }
}
