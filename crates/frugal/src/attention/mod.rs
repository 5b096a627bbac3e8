//! Causal scaled-dot-product attention with grouped-query heads over the KV cache.
//!
//! Query head `h` reads KV head `h / (n_head / n_head_kv)`: MHA (n_head_kv = n_head), GQA and MQA
//! (n_head_kv = 1) are the same code. Keys and values are read through a [`KvView`], in whatever
//! format and layout the cache stores them, a tile at a time.
//!
//! Two implementations of the same exact function, chosen by [`Attention`]:
//! - [`naive`]: materializes each head's full score matrix (`n x positions`), takes the softmax,
//!   multiplies by V. The reference: obviously right, and its extra memory grows with
//!   `n x positions`.
//! - [`flash`]: FlashAttention-2's loop order. Query blocks x key/value tiles sized for L1/L2,
//!   an online softmax (running max and sum per query row, the partial output rescaled when the
//!   max grows), tiles above the causal diagonal skipped, never more than one tile of scores in
//!   flight; parallel over KV heads x query blocks. A short batch over a long context (decode)
//!   instead splits the key range across threads and merges the partial results by their
//!   log-sum-exp (flash-decoding).
//!
//! Neither approximates: both compute `softmax(q k^T / sqrt(d)) v` for every query and differ
//! only in the order of floating-point additions (tested within 1e-5 relative). Over a Q8_0
//! key cache both score as llama.cpp does, with the queries quantized to Q8_0 too and integer
//! dot products (`q8_keys`): the keys already carry 8 bits, and the integer path is what makes
//! such a cache cheap to read at long context.

mod ahead;
#[cfg(target_arch = "x86_64")]
mod decode_fused;
mod decode_split;
mod flash;
mod kernel;
#[cfg(target_arch = "x86_64")]
mod kernels_avx2;
#[cfg(target_arch = "x86_64")]
mod kernels_avx512;
#[cfg(target_arch = "x86_64")]
mod kernels_columns;
#[cfg(target_arch = "x86_64")]
mod kernels_lanes;
#[cfg(target_arch = "x86_64")]
mod kernels_q8_avx2;
#[cfg(target_arch = "x86_64")]
mod kernels_vnni;
mod naive;
mod q8_keys;
mod tile_loop;

use std::str::FromStr;

pub use flash::{flash, key_tile, query_block};
pub use naive::naive;

use crate::kv::KvView;

/// Shapes of one attention call, and which keys each query sees.
#[derive(Copy, Clone, Debug)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Sliding-window attention: the query at position `p` sees only the keys at
    /// `p + 1 - window ..= p` (llama.cpp's standard window: a key `window` or more positions
    /// back is masked). `None`: every earlier key.
    pub window: Option<usize>,
}

impl AttnShape {
    /// The first key position the query at `pos` sees.
    #[inline]
    pub fn first_visible(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// Keys before a sliding window's first that a kernel may read (and weigh 0): flash starts at
/// the key tile holding the first visible key. A cache that drops keys older than a window
/// must keep this many more.
pub fn window_lookback(head_dim: usize) -> usize {
    key_tile(head_dim) - 1
}

/// Which implementation computes attention.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    /// Full score matrix per head (the reference).
    Naive,
    /// Tiled, online softmax, split-KV decode.
    #[default]
    Flash,
}

/// An unknown attention name (from a flag).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown attention {0:?}: expected naive or flash")]
pub struct UnknownAttention(pub String);

impl FromStr for Attention {
    type Err = UnknownAttention;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "naive" => Ok(Attention::Naive),
            "flash" => Ok(Attention::Flash),
            _ => Err(UnknownAttention(s.to_string())),
        }
    }
}

impl std::fmt::Display for Attention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Attention::Naive => "naive",
            Attention::Flash => "flash",
        })
    }
}

/// Buffers an attention call needs beyond its per-thread tiles, kept between calls so decode
/// does not allocate: the partial results of split-KV decode.
#[derive(Default, Debug)]
pub struct AttnWorkspace {
    partials: Vec<f32>,
    /// Over a Q8_0 key cache: the call's queries, scaled, then quantized once for every block.
    qscaled: Vec<f32>,
    qq: q8_keys::QuantQueries,
    /// Split-KV decode: each KV head's finished chunks, counted so the thread that finishes a
    /// head's last chunk merges it.
    done: Vec<std::sync::atomic::AtomicUsize>,
}

/// `q` holds `n` query rows (`n x n_head*head_dim`) at positions `pos0..pos0+n`; `k` and `v`
/// hold every position `0..pos0+n` (under a window, at least those from the first one the
/// first query sees, rounded down to a key tile). Query `t` sees keys
/// `first_visible(pos0+t)..=pos0+t`. Writes
/// `n x n_head*head_dim` into `out`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    kind: Attention,
    s: AttnShape,
    q: &[f32],
    k: KvView,
    v: KvView,
    pos0: usize,
    out: &mut [f32],
    ws: &mut AttnWorkspace,
) {
    debug_assert_eq!(q.len(), out.len());
    debug_assert!(s.n_head_kv > 0 && s.n_head.is_multiple_of(s.n_head_kv));
    debug_assert!(k.len() >= pos0 + q.len() / (s.n_head * s.head_dim));
    match kind {
        Attention::Naive => naive(s, q, k, v, pos0, out),
        Attention::Flash => flash(s, q, k, v, pos0, out, ws),
    }
}

/// Naive attention over plain f32 rows (`positions x n_head_kv*head_dim`).
pub fn causal_attention(
    s: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    out: &mut [f32],
) {
    let kv_dim = s.n_head_kv * s.head_dim;
    naive(
        s,
        q,
        KvView::from_f32(k, kv_dim),
        KvView::from_f32(v, kv_dim),
        pos0,
        out,
    );
}

/// Lets parallel tasks write disjoint parts of one output slice (each task owns a set of
/// (token, head) rows that no other task touches).
#[derive(Copy, Clone)]
struct OutPtr(*mut f32);
// SAFETY: only used to write disjoint ranges from parallel tasks, see `OutPtr::row`.
unsafe impl Send for OutPtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `at..at+len` must be inside the slice the pointer came from, and no other live reference
    /// may touch that range.
    #[allow(clippy::mut_from_ref)]
    unsafe fn row(&self, at: usize, len: usize) -> &mut [f32] {
        // SAFETY: forwarded to the caller (see above).
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }

    /// # Safety
    /// `at..at+len` must be inside the slice the pointer came from, and nothing may write that
    /// range while the returned slice lives.
    unsafe fn read(&self, at: usize, len: usize) -> &[f32] {
        // SAFETY: forwarded to the caller (see above).
        unsafe { std::slice::from_raw_parts(self.0.add(at), len) }
    }
}

#[cfg(test)]
mod tests;
