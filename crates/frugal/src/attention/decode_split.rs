//! Decode across key chunks (flash-decoding, [`super::flash::Plan::SplitKv`] and
//! [`super::flash::Plan::Fused`]): a few query rows over a long context have too few (KV head,
//! query block) tasks to keep the threads busy, so the key chunks run in parallel, each
//! leaving its rows' `(acc, m, l)`, and each KV head's chunks are merged in order by the
//! thread that finishes the last of them (`flash::merge_chunks`), the same arithmetic in the
//! same order as the query-block path. A thread's run of consecutive chunks of one head goes
//! through the fused AVX-512 pass (`decode_fused`) where the plan is `Fused`, otherwise chunk
//! by chunk through the tile loop (`tile_loop::block`).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::OutPtr;
use super::flash::{Fused, Job, MERGE_LANES, Span, key_chunk, merge_chunks};
use super::tile_loop::{TILES, Tiles, block};

/// Flash-decoding: a few query rows over key chunks `c0..c0 + nchunks` compute the chunks in
/// parallel and merge them in order (the result is the same as `flash::blocks`', see
/// [`key_chunk`]). Each KV head's rows are merged by the thread that finishes the head's last
/// chunk, inside the parallel section, so the first heads merge while the other thread still
/// computes (merged after the section, one thread would merge every row while the others
/// wait).
#[allow(clippy::too_many_arguments)]
pub(super) fn split_kv(
    job: &Job,
    n: usize,
    c0: usize,
    nchunks: usize,
    fused: Option<&Fused>,
    partials: &mut Vec<f32>,
    done: &mut Vec<AtomicUsize>,
    optr: OutPtr,
) {
    let s = job.s;
    let (hd, group) = (s.head_dim, s.n_head / s.n_head_kv);
    let q_dim = s.n_head * hd;
    let chunk = key_chunk(hd);
    let simd = job.simd;
    let rows = n * group;
    let stride = rows * (hd + 2);
    let per_head = nchunks * stride;
    let total = s.n_head_kv * per_head;
    if partials.len() < total {
        partials.resize(total, 0.0);
    }
    if done.len() < s.n_head_kv {
        done.resize_with(s.n_head_kv, Default::default);
    }
    let done = &done[..s.n_head_kv];
    for d in done {
        d.store(0, Ordering::Relaxed);
    }
    let parts = OutPtr(partials[..total].as_mut_ptr());
    // Each thread takes runs of consecutive chunks (`for_each_run`), and a run's chunks of
    // one KV head are read in one pass (`chunk_run`).
    crate::team::for_each_run(s.n_head_kv * nchunks, |run| {
        let mut i = run.start;
        while i < run.end {
            let kvh = i / nchunks;
            let end = run.end.min((kvh + 1) * nchunks);
            let count = end - i;
            {
                // SAFETY: chunks i..end's parts are partials[i * stride..end * stride],
                // inside `total`, and this run is their only user until their count below
                // is released.
                let parts = unsafe { parts.row(i * stride, count * stride) };
                let cs = c0 + i % nchunks..c0 + i % nchunks + count;
                TILES.with_borrow_mut(|t| {
                    chunk_run(job, fused, kvh, n, cs, chunk, parts, stride, t)
                });
            }
            i = end;
            // Every chunk's writes come before its count (release); the last count
            // (acquire) sees them all.
            if done[kvh].fetch_add(count, Ordering::AcqRel) + count < nchunks {
                continue;
            }
            // SAFETY: every chunk of head kvh is done and none is written any more; the
            // head's parts are inside `total`.
            let head = unsafe { parts.read(kvh * per_head, per_head) };
            // Merge each row's chunks in order, then normalize.
            for first in (0..rows).step_by(MERGE_LANES) {
                let width = (rows - first).min(MERGE_LANES);
                merge_chunks(
                    head,
                    nchunks,
                    stride,
                    rows,
                    hd,
                    first..first + width,
                    simd,
                    |r| {
                        let (tok, h) = (r / group, kvh * group + r % group);
                        // SAFETY: row (tok, h) is inside `out`, and each row of the call is
                        // merged once, by the run that finished its head's last chunk.
                        unsafe { optr.row(tok * q_dim + h * hd, hd) }
                    },
                );
            }
        }
    });
}

/// Key chunks `cs` (of `chunk` keys) of KV head `kvh` for the call's `n` query tokens, chunk
/// `i` of them leaving its result in `parts[i * stride..]` (outputs, maxima, sums of its rows,
/// as [`block`] leaves them). Under [`super::flash::Plan::Fused`] (`fused`), a run whose every
/// key the rows see is taken in one fused pass (`decode_fused`): each chunk's result is the one it has alone, but the loads run on
/// from one chunk into the next without the stop of a call apiece (a call's setup, its first
/// tile's keys and last tile's values each read alone, the exit). Otherwise chunk by chunk through
/// [`block`].
#[allow(clippy::too_many_arguments)]
pub(super) fn chunk_run(
    job: &Job,
    fused: Option<&Fused>,
    kvh: usize,
    n: usize,
    cs: std::ops::Range<usize>,
    chunk: usize,
    parts: &mut [f32],
    stride: usize,
    t: &mut Tiles,
) {
    let s = job.s;
    let (hd, group) = (s.head_dim, s.n_head / s.n_head_kv);
    let rows = n * group;
    let (lo, hi) = (cs.start * chunk, (cs.end * chunk).min(job.k.len()));
    // A run whose first chunk starts before the window's first key goes chunk by chunk.
    if let Some(f) = fused
        && s.first_visible(job.pos0) <= lo
        && job.pos0 + 1 >= hi
        && lo < hi
    {
        return f.run(job, kvh, lo..hi, chunk, parts, stride, t);
    }
    for (i, c) in cs.enumerate() {
        let (acc, ml) = parts[i * stride..][..stride].split_at_mut(rows * hd);
        let (m, l) = ml.split_at_mut(rows);
        let span = Span {
            kvh,
            t0: 0,
            t1: n,
            lo: c * chunk,
            hi: ((c + 1) * chunk).min(job.k.len()),
        };
        block(job, span, acc, m, l, t);
    }
}
