//! Packing: copy a block of a strided matrix into the panel order a
//! microkernel streams through, converting the element type on the way.
//!
//! Both operands use the same routine. Packing A (m×k) packs its rows;
//! packing B (k×n) packs the rows of Bᵀ, i.e. B's columns. So `src` below is
//! always a "rows × k" view, and `idx(r, kk)` says where, inside a panel of
//! `w` rows, element (r, kk) goes. Positions for rows ≥ the valid count or
//! kk ≥ klen are written with zero, so kernels never see stale data.

use super::{MatRef, f32_to_bf16_bits, round_bf16};

/// Packs rows `r0..r0+rlen`, k `k0..k0+klen` of `src` into panels of `w` rows
/// and `kp ≥ klen` k values; panel `p` starts at `p·w·kp` in `dst`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn pack_panels<T: Copy>(
    src: MatRef,
    r0: usize,
    rlen: usize,
    k0: usize,
    klen: usize,
    w: usize,
    kp: usize,
    dst: &mut [T],
    idx: impl Fn(usize, usize) -> usize,
    conv: impl Fn(f32) -> T,
    zero: T,
) {
    let panel_len = w * kp;
    let npanels = rlen.div_ceil(w);
    assert!(dst.len() >= npanels * panel_len && klen <= kp);
    assert!(r0 + rlen <= src.rows && k0 + klen <= src.cols);
    if rlen == 0 || klen == 0 {
        dst[..npanels * panel_len]
            .iter_mut()
            .for_each(|d| *d = zero);
        return;
    }
    src.assert_in_bounds("packed operand");
    let data = src.data.as_ptr();
    // SAFETY: (for every `data.add(..)` read below) the indices are
    // (r0 + i)·rs + (k0 + kk)·cs with i < rlen, kk < klen; the view is in
    // bounds (just asserted) and r0+rlen ≤ rows, k0+klen ≤ cols, so each
    // index is at most the view's last element.
    let at = |i: usize, kk: usize| unsafe { *data.add((r0 + i) * src.rs + (k0 + kk) * src.cs) };
    for (p, panel) in dst.chunks_exact_mut(panel_len).take(npanels).enumerate() {
        let rows = w.min(rlen - p * w);
        let i0 = p * w;
        if src.cs <= src.rs {
            // k is the faster-moving direction in memory: read along k.
            for r in 0..w {
                if r < rows {
                    for kk in 0..klen {
                        panel[idx(r, kk)] = conv(at(i0 + r, kk));
                    }
                    for kk in klen..kp {
                        panel[idx(r, kk)] = zero;
                    }
                } else {
                    for kk in 0..kp {
                        panel[idx(r, kk)] = zero;
                    }
                }
            }
        } else {
            // Rows are the faster-moving direction: read along rows.
            for kk in 0..kp {
                if kk < klen {
                    for r in 0..rows {
                        panel[idx(r, kk)] = conv(at(i0 + r, kk));
                    }
                    for r in rows..w {
                        panel[idx(r, kk)] = zero;
                    }
                } else {
                    for r in 0..w {
                        panel[idx(r, kk)] = zero;
                    }
                }
            }
        }
    }
}

/// f32 layout `[k][w]` per panel (what the f32 kernels read), optionally
/// rounding every element to bf16 precision (the emulated bf16 path).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_f32(
    src: MatRef,
    r0: usize,
    rlen: usize,
    k0: usize,
    klen: usize,
    w: usize,
    dst: &mut [f32],
    round: bool,
) {
    if round {
        pack_f32_impl::<true>(src, r0, rlen, k0, klen, w, dst);
    } else {
        pack_f32_impl::<false>(src, r0, rlen, k0, klen, w, dst);
    }
}

/// Fast paths for the two dense layouts, generic `pack_panels` otherwise.
#[inline(always)]
fn pack_f32_impl<const ROUND: bool>(
    src: MatRef,
    r0: usize,
    rlen: usize,
    k0: usize,
    klen: usize,
    w: usize,
    dst: &mut [f32],
) {
    let conv = |x: f32| if ROUND { round_bf16(x) } else { x };
    let dense_k = src.cs == 1 && src.rs != 1;
    let dense_r = src.rs == 1;
    if !(dense_k || dense_r) || rlen == 0 || klen == 0 {
        pack_panels(
            src,
            r0,
            rlen,
            k0,
            klen,
            w,
            klen,
            dst,
            |r, kk| kk * w + r,
            conv,
            0.0,
        );
        return;
    }
    assert!(r0 + rlen <= src.rows && k0 + klen <= src.cols);
    src.assert_in_bounds("packed operand");
    let npanels = rlen.div_ceil(w);
    for (p, panel) in dst.chunks_exact_mut(w * klen).take(npanels).enumerate() {
        let rows = w.min(rlen - p * w);
        // First element of this panel; all reads below are at offsets
        // i·rs + kk·cs from it with i < rows, kk < klen: inside the view.
        let base = (r0 + p * w) * src.rs + k0 * src.cs;
        if dense_r {
            for (kk, out) in panel.chunks_exact_mut(w).enumerate() {
                let s = &src.data[base + kk * src.cs..][..rows];
                for (o, &x) in out.iter_mut().zip(s) {
                    *o = conv(x);
                }
                out[rows..].fill(0.0);
            }
        } else {
            // Read each row sequentially (prefetch friendly); the strided
            // writes land in the panel, which is small enough for L1.
            for i in 0..w {
                if i < rows {
                    let s = &src.data[base + i * src.rs..][..klen];
                    for (kk, &x) in s.iter().enumerate() {
                        // SAFETY: kk < klen and i < w: inside the w·klen panel.
                        unsafe { *panel.get_unchecked_mut(kk * w + i) = conv(x) };
                    }
                } else {
                    for kk in 0..klen {
                        panel[kk * w + i] = 0.0;
                    }
                }
            }
        }
    }
}

/// bf16 "VNNI pair" layout `[k/2][w][2]` per panel: the two consecutive k
/// values of one row sit in one 32-bit lane, as `VDPBF16PS` and the AMX B
/// operand want. `kp` is klen rounded up to a multiple of 2 (or of 32 for AMX).
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
pub(crate) fn pack_bf16_pairs(
    src: MatRef,
    r0: usize,
    rlen: usize,
    k0: usize,
    klen: usize,
    w: usize,
    kp: usize,
    dst: &mut [u16],
) {
    let idx = |r: usize, kk: usize| (kk / 2) * (2 * w) + 2 * r + (kk & 1);
    pack_panels(
        src,
        r0,
        rlen,
        k0,
        klen,
        w,
        kp,
        dst,
        idx,
        f32_to_bf16_bits,
        0,
    );
}
