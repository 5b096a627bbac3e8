//! The reference: per head, the full `n x positions` score matrix, a softmax per row, then the
//! product with V. Extra memory is that matrix, `n x (pos0+n) x 4` bytes per head in flight
//! (256 MiB for one head of an 8192-token prefill), which is what flash attention removes.

use std::cell::RefCell;

use rayon::prelude::*;

use super::q8_keys::{self, QuantQueries};
use super::{AttnShape, OutPtr};
use crate::kv::{KvType, KvView};
use crate::ops::dot;

#[derive(Default)]
struct Buffers {
    scores: Vec<f32>,
    row: Vec<f32>,
    part: Vec<f32>,
    /// Over a Q8_0 key cache: the head's queries, scaled, then quantized.
    qscaled: Vec<f32>,
    qq: QuantQueries,
}

thread_local! {
    /// Per-thread score matrix, reused across calls (grown to the largest seen).
    static BUF: RefCell<Buffers> = RefCell::new(Buffers::default());
}

/// Naive causal (optionally windowed) attention; see [`super::attend`] for the argument layout.
pub fn naive(s: AttnShape, q: &[f32], k: KvView, v: KvView, pos0: usize, out: &mut [f32]) {
    let hd = s.head_dim;
    let q_dim = s.n_head * hd;
    let n = q.len() / q_dim;
    let len = pos0 + n;
    // Keys before the first query's window are seen by no query (and a ring cache may no
    // longer hold them): the score matrix covers keys `lo..len`.
    let lo = s.first_visible(pos0);
    let width = len - lo;
    let group = s.n_head / s.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    let out_len = out.len();
    let optr = OutPtr(out.as_mut_ptr());
    (0..s.n_head).into_par_iter().for_each(|h| {
        let kvh = h / group;
        BUF.with_borrow_mut(|b| {
            b.scores.resize(n * width, 0.0);
            b.row.resize(hd, 0.0);
            // A Q8_0 key cache is scored as flash scores it: the scaled queries quantized, the
            // dot products in integers (`q8_keys`).
            let k_q8 = k.ty() == KvType::Q8_0;
            if k_q8 {
                b.qscaled.clear();
                for t in 0..n {
                    let qt = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
                    b.qscaled.extend(qt.iter().map(|&x| x * scale));
                }
                b.qq.quantize(&b.qscaled, hd);
            }
            let (sc, row, qq) = (&mut b.scores, &mut b.row, &b.qq);
            let nblk = hd / crate::kv::Q8_0_BLOCK;
            // S = q k^T * scale, with the future (and keys outside the window) masked to -inf.
            for j in lo..len {
                let key = if k_q8 {
                    let (bytes, _, _) = k.head_run(kvh, hd, j, 1);
                    &bytes[..KvType::Q8_0.bytes(hd)]
                } else {
                    k.decode_head(kvh, hd, j, 1, row);
                    &[]
                };
                for t in 0..n {
                    sc[t * width + j - lo] = if j <= pos0 + t && j >= s.first_visible(pos0 + t) {
                        if k_q8 {
                            let (hi, lo) = (&qq.hi[t * hd..][..hd], &qq.lo[t * hd..][..hd]);
                            q8_keys::score(hi, lo, &qq.scales[t * nblk..][..nblk], key)
                        } else {
                            let qt = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
                            dot(qt, row) * scale
                        }
                    } else {
                        f32::NEG_INFINITY
                    };
                }
            }
            // P = softmax(S) row by row.
            // The normalizer is summed in f64: thousands of terms, and this is the reference.
            for srow in sc.chunks_exact_mut(width) {
                let max = srow.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                let mut sum = 0f64;
                for x in srow.iter_mut() {
                    *x = (*x - max).exp();
                    sum += f64::from(*x);
                }
                let inv = (1.0 / sum) as f32;
                srow.iter_mut().for_each(|x| *x *= inv);
            }
            // O = P v.
            for t in 0..n {
                debug_assert!(t * q_dim + (h + 1) * hd <= out_len);
                // SAFETY: head h's slice of row t belongs to this task alone.
                unsafe { optr.row(t * q_dim + h * hd, hd) }.fill(0.0);
            }
            // Summed in blocks of keys, each block's sum then added to the output (two-level
            // summation: the rounding error grows with block + blocks, not with every key).
            b.part.resize(n * hd, 0.0);
            let part = &mut b.part;
            for j0 in (lo..len).step_by(SUM_BLOCK) {
                part.fill(0.0);
                for j in j0..(j0 + SUM_BLOCK).min(len) {
                    v.decode_head(kvh, hd, j, 1, row);
                    for t in j.saturating_sub(pos0)..n {
                        let p = sc[t * width + j - lo];
                        for (a, &b) in part[t * hd..][..hd].iter_mut().zip(row.iter()) {
                            *a += p * b;
                        }
                    }
                }
                for t in j0.saturating_sub(pos0)..n {
                    // SAFETY: as above.
                    let o = unsafe { optr.row(t * q_dim + h * hd, hd) };
                    for (a, &b) in o.iter_mut().zip(&part[t * hd..][..hd]) {
                        *a += b;
                    }
                }
            }
            // Keep small buffers for the next decode step; give back a prefill's big matrix.
            if b.scores.capacity() > KEEP_FLOATS {
                b.scores = Vec::new();
            }
            if b.part.capacity() > KEEP_FLOATS {
                b.part = Vec::new();
            }
        });
    });
}

/// Keys per partial sum of the output.
const SUM_BLOCK: usize = 64;

/// Score buffers up to this many floats (4 MiB) stay allocated between calls.
const KEEP_FLOATS: usize = 1 << 20;
