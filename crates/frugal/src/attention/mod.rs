//! Causal scaled-dot-product attention with grouped-query heads over the KV cache.
//!
//! Query head `h` reads KV head `h / (n_head / n_head_kv)`: MHA (n_head_kv = n_head), GQA and MQA
//! (n_head_kv = 1) are the same code. This is the plain ("naive") exact form: for each query, all
//! scores against the visible keys, a softmax, then the weighted sum of values.

use std::cell::RefCell;

use rayon::prelude::*;

/// Shapes of one attention call.
#[derive(Copy, Clone, Debug)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

thread_local! {
    /// Per-thread score row, reused across calls so decode does not allocate.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `q` holds `n` query rows (`n x n_head*head_dim`) at positions `pos0..pos0+n`; `k` and `v`
/// hold every cached position `0..pos0+n` (`positions x n_head_kv*head_dim`). Query `t` sees keys
/// `0..=pos0+t`. Writes `n x n_head*head_dim` into `out`.
pub fn causal_attention(
    s: AttnShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos0: usize,
    out: &mut [f32],
) {
    let hd = s.head_dim;
    let q_dim = s.n_head * hd;
    let kv_dim = s.n_head_kv * hd;
    let group = s.n_head / s.n_head_kv;
    let scale = 1.0 / (hd as f32).sqrt();
    debug_assert_eq!(q.len(), out.len());
    out.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / s.n_head, i % s.n_head);
        let kvh = h / group;
        let qh = &q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd];
        let visible = pos0 + t + 1;
        SCORES.with_borrow_mut(|scores| {
            scores.clear();
            // Grow in large steps so decode allocates at most once per doubling past 4096.
            if scores.capacity() < visible {
                scores.reserve(visible.max(4096).next_power_of_two());
            }
            let mut max = f32::NEG_INFINITY;
            for j in 0..visible {
                let kj = &k[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                let sc = dot(qh, kj) * scale;
                max = max.max(sc);
                scores.push(sc);
            }
            let mut sum = 0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                sum += *sc;
            }
            o.fill(0.0);
            for (j, &p) in scores.iter().enumerate() {
                let vj = &v[j * kv_dim + kvh * hd..j * kv_dim + (kvh + 1) * hd];
                for (a, &b) in o.iter_mut().zip(vj) {
                    *a += p * b;
                }
            }
            let inv = 1.0 / sum;
            o.iter_mut().for_each(|a| *a *= inv);
        });
    });
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value() {
        let s = AttnShape {
            n_head: 2,
            n_head_kv: 1,
            head_dim: 2,
        };
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [0.3, 0.4];
        let v = [5.0, -1.0];
        let mut out = [0.0; 4];
        causal_attention(s, &q, &k, &v, 0, &mut out);
        assert_eq!(out, [5.0, -1.0, 5.0, -1.0]);
    }

    #[test]
    fn equal_scores_average_the_values_and_mask_the_future() {
        // Two positions, zero queries: query 0 sees only v0, query 1 averages v0 and v1.
        let s = AttnShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: 1,
        };
        let mut out = [0.0; 2];
        causal_attention(s, &[0.0, 0.0], &[1.0, 2.0], &[4.0, 8.0], 0, &mut out);
        assert_eq!(out, [4.0, 6.0]);
    }
}
