//! Where a paged view keeps each head of each position, with the layout's arithmetic taken
//! out of the view once ([`KvView::head_addr`](super::KvView::head_addr)): what decode's fused
//! tiles read through.

/// Where a paged view keeps each head of each position
/// ([`KvView::head_addr`](super::KvView::head_addr)).
#[derive(Copy, Clone, Debug)]
pub struct HeadAddr<'a> {
    pub(super) base: usize,
    pub(super) table: &'a [u32],
    pub(super) shift: u32,
    pub(super) head_bytes: usize,
    pub(super) block_bytes: usize,
    pub(super) step: usize,
    pub(super) head_bytes_one: usize,
}

impl HeadAddr<'_> {
    /// The address of head `head` of position `pos` (one the view holds): its row, or, for a
    /// view by columns, its value in the first column of its block (column `c` lies `c x block
    /// size` values on).
    #[inline(always)]
    pub fn at(&self, head: usize, pos: usize) -> usize {
        self.in_block(head, pos, self.step)
    }

    /// The `pos % block size`-th of the equal shares its block's bytes of head `head` make,
    /// one per position: the position's row when the view is by rows. By columns, the
    /// block's shares of all its positions together cover its bytes, in another order than
    /// position by position: what a prefetch of a whole block's positions asks for.
    #[inline(always)]
    pub fn share_at(&self, head: usize, pos: usize) -> usize {
        self.in_block(head, pos, self.head_bytes_one)
    }

    /// Head `head`'s start in the block of position `pos`, plus `per_position` bytes for each
    /// position before it in the block.
    #[inline(always)]
    fn in_block(&self, head: usize, pos: usize, per_position: usize) -> usize {
        let (blk, off) = (pos >> self.shift, pos & ((1 << self.shift) - 1));
        self.base
            + head * self.head_bytes
            + self.table[blk] as usize * self.block_bytes
            + off * per_position
    }
}
