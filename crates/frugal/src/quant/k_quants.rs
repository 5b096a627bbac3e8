//! K-quants: super-blocks of 256 weights whose sub-block scales are themselves quantized against
//! one f16 super-scale (ggml's Q4_K and Q6_K, bit-compatible).
//!
//! Two levels of scales let the small sub-blocks (32 or 16 weights) adapt to local magnitude while
//! their scales cost only 6 or 8 bits each instead of 16.
//!
//! - Q4_K (144 bytes, 4.5 bits per weight): f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins
//!   for 8 sub-blocks of 32, then 128 bytes of nibbles. Sub-block j: value = d * sc_j * q - dmin * m_j
//!   with q in 0..16. In each 64-weight chunk c, byte `qs[32c + l]` holds weight 64c + l in its low
//!   nibble (sub-block 2c) and weight 64c + 32 + l in its high nibble (sub-block 2c + 1). Scale
//!   packing: sub-blocks 0..4 keep scale and min in the low 6 bits of bytes j and j + 4; sub-blocks
//!   4..8 keep their low 4 bits in byte j + 4 (scale low nibble, min high nibble) and their top 2
//!   bits in the top bits of bytes j - 4 (scale) and j (min).
//! - Q6_K (210 bytes, 6.5625 bits per weight): 128 bytes `ql` (low 4 bits), 64 bytes `qh` (high 2
//!   bits), 16 signed 8-bit scales for sub-blocks of 16, f16 `d` last. value = d * sc * (q - 32).
//!   In each half h (128 weights), for l in 0..32: weights l, l+32, l+64, l+96 take the low nibbles
//!   of `ql[64h+l]`, `ql[64h+l+32]`, and the high nibbles of the same two bytes; their high bits are
//!   the 2-bit fields 0, 1, 2, 3 of `qh[32h+l]`.

use super::float::{f16_to_f32, f32_to_f16};

pub const QK_K: usize = 256;
pub const Q4_K_BYTES: usize = 144;
pub const Q6_K_BYTES: usize = 210;

pub(super) fn half(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// 6-bit scale and min of sub-block `j` from the 12 packed bytes.
pub(super) fn scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Inverse of [`scale_min`] for eight 6-bit scales and mins.
pub(super) fn pack_scale_min(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
        s[j + 4] = lm[j] | ((lm[j + 4] >> 4) << 6);
        s[j + 8] = (ls[j + 4] & 0x0f) | ((lm[j + 4] & 0x0f) << 4);
    }
    s
}

#[inline]
pub(super) fn decode_q4_k(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(Q4_K_BYTES))
    {
        let (d, dmin) = (half(b), half(&b[2..]));
        let (scales, qs) = (&b[4..16], &b[16..144]);
        for c in 0..4 {
            let (s1, m1) = scale_min(2 * c, scales);
            let (s2, m2) = scale_min(2 * c + 1, scales);
            let (d1, o1) = (d * f32::from(s1), dmin * f32::from(m1));
            let (d2, o2) = (d * f32::from(s2), dmin * f32::from(m2));
            for l in 0..32 {
                let q = qs[32 * c + l];
                y[64 * c + l] = d1 * f32::from(q & 0x0f) - o1;
                y[64 * c + 32 + l] = d2 * f32::from(q >> 4) - o2;
            }
        }
    }
}

#[inline]
pub(super) fn decode_q6_k(bytes: &[u8], out: &mut [f32]) {
    for (y, b) in out
        .chunks_exact_mut(QK_K)
        .zip(bytes.chunks_exact(Q6_K_BYTES))
    {
        let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
        let d = half(&b[208..]);
        for h in 0..2 {
            for l in 0..32 {
                let (lo, hi, bits) = (ql[64 * h + l], ql[64 * h + l + 32], qh[32 * h + l]);
                let q = [
                    (lo & 0x0f) | ((bits & 3) << 4),
                    (hi & 0x0f) | (((bits >> 2) & 3) << 4),
                    (lo >> 4) | (((bits >> 4) & 3) << 4),
                    (hi >> 4) | (((bits >> 6) & 3) << 4),
                ];
                for (k, &qk) in q.iter().enumerate() {
                    let s = f32::from(sc[8 * h + l / 16 + 2 * k] as i8);
                    y[128 * h + 32 * k + l] = d * s * (f32::from(qk) - 32.0);
                }
            }
        }
    }
}

/// Squared error of `x` on the grid `a * q + b`, q in `qmin..=qmax`, with each q rounded to the
/// nearest grid point; with `w`, each element's square is weighted by `w` (importance).
pub(super) fn grid_error(
    x: &[f32],
    w: Option<&[f32]>,
    a: f32,
    b: f32,
    qmin: f32,
    qmax: f32,
) -> f32 {
    let ia = if a != 0.0 { 1.0 / a } else { 0.0 };
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let q = ((v - b) * ia).round().clamp(qmin, qmax);
            let e = (a * q + b - v).powi(2);
            w.map_or(e, |w| w[i] * e)
        })
        .sum()
}

/// Fits `x ~ a * q + b` with q in 0..=nmax and b <= 0 (the grid reaches zero, as Q4_K's mins are
/// stored as non-negative amounts subtracted). Starts from the min-max grid, then tries inverse
/// scales around it, refitting a and b by (with `w`, weighted) least squares for each
/// assignment; keeps the best. Weights of exactly 1 give the unweighted fit's bits.
pub(super) fn fit_asymmetric(x: &[f32], w: Option<&[f32]>, nmax: f32) -> (f32, f32) {
    let lo = x.iter().fold(0f32, |m, &v| m.min(v));
    let hi = x.iter().fold(lo, |m, &v| m.max(v));
    if hi <= lo {
        return (0.0, lo);
    }
    let mut best = ((hi - lo) / nmax, lo);
    let mut best_err = grid_error(x, w, best.0, best.1, 0.0, nmax);
    for k in 0..=20 {
        let iscale = (nmax - 1.0 + 0.1 * k as f32) / (hi - lo);
        let (mut n, mut sq, mut sqq, mut sx, mut sqx) = (0f32, 0f32, 0f32, 0f32, 0f32);
        for (i, &v) in x.iter().enumerate() {
            let q = ((v - lo) * iscale).round().clamp(0.0, nmax);
            let wi = w.map_or(1.0, |w| w[i]);
            n += wi;
            sq += wi * q;
            sqq += wi * q * q;
            sx += wi * v;
            sqx += wi * q * v;
        }
        let det = n * sqq - sq * sq;
        if det <= 0.0 {
            continue;
        }
        let mut a = (n * sqx - sq * sx) / det;
        let mut b = (sqq * sx - sq * sqx) / det;
        if b > 0.0 {
            b = 0.0;
            a = sqx / sqq;
        }
        if a <= 0.0 || !a.is_finite() {
            continue;
        }
        let err = grid_error(x, w, a, b, 0.0, nmax);
        if err < best_err {
            best = (a, b);
            best_err = err;
        }
    }
    best
}

/// Fits `x ~ s * q` with q in -32..=31: the signed absmax maps to -32 (the end of the grid that
/// exists), then nearby scales are tried with a least-squares refit; keeps the best.
fn fit_symmetric6(x: &[f32]) -> f32 {
    let max = super::fit::signed_absmax(x);
    if max == 0.0 {
        return 0.0;
    }
    let mut best = max / -32.0;
    let mut best_err = grid_error(x, None, best, 0.0, -32.0, 31.0);
    for k in 0..=20 {
        let iscale = -(31.0 + 0.1 * k as f32) / max;
        let (mut sqx, mut sqq) = (0f32, 0f32);
        for &v in x {
            let q = (v * iscale).round().clamp(-32.0, 31.0);
            sqx += q * v;
            sqq += q * q;
        }
        if sqq <= 0.0 {
            continue;
        }
        let s = sqx / sqq;
        let err = grid_error(x, None, s, 0.0, -32.0, 31.0);
        if err < best_err {
            best = s;
            best_err = err;
        }
    }
    best
}

/// Encoder for Q4_K: per sub-block of 32 a fitted (scale, min), both quantized to 6 bits against
/// the super-block maxima, then every weight re-rounded on the grid the decoder will really use.
pub fn quantize_q4_k(x: &[f32]) -> Vec<u8> {
    encode_q4_k(x, None)
}

/// [`quantize_q4_k`] minimizing the importance-weighted error `Σ w (x - x̂)²` (`w` per element,
/// `x.len()` values): weighted fits per sub-block, and the 6-bit sub-scales and mins quantized
/// by a fit weighted with each sub-block's total importance.
pub(super) fn quantize_q4_k_weighted(x: &[f32], w: &[f32]) -> Vec<u8> {
    encode_q4_k(x, Some(w))
}

fn encode_q4_k(x: &[f32], weights: Option<&[f32]>) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * Q4_K_BYTES);
    for (bi, blk) in x.chunks(QK_K).enumerate() {
        let wb = weights.map(|w| &w[bi * QK_K..bi * QK_K + blk.len()]);
        let mut scales = [0f32; 8];
        let mut mins = [0f32; 8];
        let mut sub_weight = [1f32; 8];
        for (j, sub) in blk.chunks(32).enumerate() {
            let ws = wb.map(|w| &w[32 * j..32 * j + sub.len()]);
            let (a, b) = fit_asymmetric(sub, ws, 15.0);
            scales[j] = a;
            mins[j] = -b;
            if let Some(ws) = ws {
                sub_weight[j] = ws.iter().sum();
            }
        }
        let (ls, lm, d_bits, dmin_bits) = if weights.is_some() {
            let (ds, ls) = super::weighted::fit_unsigned(&scales, &sub_weight, 63.0);
            let (dm, lm) = super::weighted::fit_unsigned(&mins, &sub_weight, 63.0);
            (ls, lm, f32_to_f16(ds), f32_to_f16(dm))
        } else {
            let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
            let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
            let to6 = |v: f32, max: f32| -> u8 {
                if max > 0.0 {
                    (v * 63.0 / max).round().clamp(0.0, 63.0) as u8
                } else {
                    0
                }
            };
            let ls: [u8; 8] = std::array::from_fn(|j| to6(scales[j], max_scale));
            let lm: [u8; 8] = std::array::from_fn(|j| to6(mins[j], max_min));
            (
                ls,
                lm,
                f32_to_f16(max_scale / 63.0),
                f32_to_f16(max_min / 63.0),
            )
        };
        let (d, dmin) = (f16_to_f32(d_bits), f16_to_f32(dmin_bits));
        let mut q = [0u8; QK_K];
        for (j, sub) in blk.chunks(32).enumerate() {
            let step = d * f32::from(ls[j]);
            let off = dmin * f32::from(lm[j]);
            let inv = if step != 0.0 { 1.0 / step } else { 0.0 };
            for (l, &v) in sub.iter().enumerate() {
                q[32 * j + l] = ((v + off) * inv).round().clamp(0.0, 15.0) as u8;
            }
        }
        out.extend_from_slice(&d_bits.to_le_bytes());
        out.extend_from_slice(&dmin_bits.to_le_bytes());
        out.extend_from_slice(&pack_scale_min(&ls, &lm));
        for c in 0..4 {
            for l in 0..32 {
                out.push(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
            }
        }
    }
    out
}

/// Encoder for Q6_K: per sub-block of 16 a fitted signed scale, quantized to 8 bits against the
/// largest one (which maps to -128), then every weight re-rounded on the decoder's grid.
pub fn quantize_q6_k(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / QK_K * Q6_K_BYTES);
    for blk in x.chunks(QK_K) {
        let mut scales = [0f32; 16];
        for (j, sub) in blk.chunks(16).enumerate() {
            scales[j] = fit_symmetric6(sub);
        }
        let max = super::fit::signed_absmax(&scales);
        let d_bits = f32_to_f16(max / -128.0);
        let d = f16_to_f32(d_bits);
        let inv_d = if d != 0.0 { 1.0 / d } else { 0.0 };
        let sc: [i8; 16] =
            std::array::from_fn(|j| (scales[j] * inv_d).round().clamp(-128.0, 127.0) as i8);
        let mut q = [0u8; QK_K];
        for (j, sub) in blk.chunks(16).enumerate() {
            let step = d * f32::from(sc[j]);
            let inv = if step != 0.0 { 1.0 / step } else { 0.0 };
            for (l, &v) in sub.iter().enumerate() {
                q[16 * j + l] = ((v * inv).round().clamp(-32.0, 31.0) + 32.0) as u8;
            }
        }
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for h in 0..2 {
            for l in 0..32 {
                let v: [u8; 4] = std::array::from_fn(|k| q[128 * h + 32 * k + l]);
                ql[64 * h + l] = (v[0] & 0x0f) | ((v[2] & 0x0f) << 4);
                ql[64 * h + l + 32] = (v[1] & 0x0f) | ((v[3] & 0x0f) << 4);
                qh[32 * h + l] =
                    (v[0] >> 4) | ((v[1] >> 4) << 2) | ((v[2] >> 4) << 4) | ((v[3] >> 4) << 6);
            }
        }
        out.extend_from_slice(&ql);
        out.extend_from_slice(&qh);
        out.extend(sc.iter().map(|&s| s as u8));
        out.extend_from_slice(&d_bits.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{GgmlType, dequantize_to_vec};

    #[test]
    fn hand_built_q4_k_block_decodes() {
        // d = 0.5 (0x3800), dmin = 0.25 (0x3400). Sub-block j has scale j + 1 and min 2j, with
        // sub-blocks 4..8 using values above 15 so the split high bits are exercised:
        // scales 1,2,3,4,21,22,23,24 and mins 0,2,4,6,40,42,44,46.
        let ls = [1u8, 2, 3, 4, 21, 22, 23, 24];
        let lm = [0u8, 2, 4, 6, 40, 42, 44, 46];
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = ls[j] | ((ls[j + 4] >> 4) << 6);
            s[j + 4] = lm[j] | ((lm[j + 4] >> 4) << 6);
            s[j + 8] = (ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4);
        }
        assert_eq!(s, pack_scale_min(&ls, &lm));
        // Weight w (0..256) has q = w % 16: byte 32c + l holds weights 64c + l (low nibble) and
        // 64c + 32 + l (high nibble).
        let mut b = vec![0x00, 0x38, 0x00, 0x34];
        b.extend_from_slice(&s);
        for c in 0..4 {
            for l in 0..32 {
                let lo = ((64 * c + l) % 16) as u8;
                let hi = ((64 * c + 32 + l) % 16) as u8;
                b.push(lo | (hi << 4));
            }
        }
        let v = dequantize_to_vec(GgmlType::Q4_K, &b, 256).unwrap();
        for (w, &x) in v.iter().enumerate() {
            let j = w / 32;
            let want = 0.5 * f32::from(ls[j]) * (w % 16) as f32 - 0.25 * f32::from(lm[j]);
            assert_eq!(x, want, "weight {w}");
        }
    }

    #[test]
    fn hand_built_q6_k_block_decodes() {
        // d = 0.125 (0x3000); sub-block j (16 weights) has scale j - 8 (negative scales too);
        // weight w has q = w % 64 (so all 6 bits vary).
        let q: Vec<u8> = (0..256).map(|w| (w % 64) as u8).collect();
        let mut ql = [0u8; 128];
        let mut qh = [0u8; 64];
        for h in 0..2 {
            for l in 0..32 {
                let v = |k: usize| q[128 * h + 32 * k + l];
                ql[64 * h + l] = (v(0) & 15) | ((v(2) & 15) << 4);
                ql[64 * h + l + 32] = (v(1) & 15) | ((v(3) & 15) << 4);
                qh[32 * h + l] =
                    (v(0) >> 4) | ((v(1) >> 4) << 2) | ((v(2) >> 4) << 4) | ((v(3) >> 4) << 6);
            }
        }
        let mut b = ql.to_vec();
        b.extend_from_slice(&qh);
        b.extend((0..16).map(|j| (j as i8 - 8) as u8));
        b.extend_from_slice(&[0x00, 0x30]);
        let v = dequantize_to_vec(GgmlType::Q6_K, &b, 256).unwrap();
        for (w, &x) in v.iter().enumerate() {
            let want = 0.125 * ((w / 16) as f32 - 8.0) * ((w % 64) as f32 - 32.0);
            assert_eq!(x, want, "weight {w}");
        }
    }

    /// Smooth data with a few spikes, different magnitudes per sub-block.
    use crate::quant::test_signal::sample;

    #[test]
    fn encoders_round_trip_within_bounds() {
        let x = sample(512);
        for (ty, bytes) in [
            (GgmlType::Q4_K, quantize_q4_k(&x)),
            (GgmlType::Q6_K, quantize_q6_k(&x)),
        ] {
            assert_eq!(bytes.len(), ty.bytes_for(512).unwrap() as usize);
            let y = dequantize_to_vec(ty, &bytes, 512).unwrap();
            let sub = if ty == GgmlType::Q4_K { 32 } else { 16 };
            for (bx, by) in x.chunks(sub).zip(y.chunks(sub)) {
                let (lo, hi) = bx
                    .iter()
                    .fold((0f32, 0f32), |(l, h), &v| (l.min(v), h.max(v)));
                // Q4_K: the sub-block range (including 0) over 15 steps; the 6-bit quantization
                // of the scale can stretch or shrink the grid by up to 1/2 of 1/63 of the
                // super-block maximum, and the min moves by as much: allow a full step plus that
                // slack. Q6_K: range over 63 steps, with 8-bit scales (slack 1/256 of the largest).
                let range = hi - lo;
                let tol = if ty == GgmlType::Q4_K {
                    range / 15.0 + 0.1 * range
                } else {
                    range / 63.0 + 0.05 * range
                };
                for (a, b) in bx.iter().zip(by) {
                    assert!((a - b).abs() <= tol, "{ty}: {a} vs {b} (tol {tol})");
                }
            }
        }
        // On the whole: Q4_K's fitted sub-block grids do at least as well as Q4_1's min-max
        // grid at the same 4 bits (within 0.5 dB: its 6-bit scales cost a little), and Q6_K's
        // two extra bits buy at least 10 dB (ideally 12).
        let snr = |ty: GgmlType, b: &[u8]| {
            crate::quant::research::snr_db(&x, &dequantize_to_vec(ty, b, 512).unwrap())
        };
        let q4_1 = snr(GgmlType::Q4_1, &crate::quant::quantize_q4_1(&x));
        let q4_k = snr(GgmlType::Q4_K, &quantize_q4_k(&x));
        let q6_k = snr(GgmlType::Q6_K, &quantize_q6_k(&x));
        assert!(q4_k > q4_1 - 0.5, "Q4_K {q4_k:.2} dB vs Q4_1 {q4_1:.2} dB");
        assert!(q6_k > q4_k + 10.0, "Q6_K {q6_k:.2} dB vs Q4_K {q4_k:.2} dB");
    }

    #[test]
    fn low_bit_k_quants_keep_zero_and_constant_blocks_exact() {
        for x in [vec![0f32; 256], vec![-0.75f32; 256], vec![0.5f32; 256]] {
            for ty in [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q5_K] {
                let bytes = crate::quant::quantize(ty, &x).unwrap();
                let y = dequantize_to_vec(ty, &bytes, 256).unwrap();
                for (a, b) in x.iter().zip(&y) {
                    assert!((a - b).abs() <= 1e-3, "{ty}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn zero_and_constant_blocks_are_exact() {
        for x in [vec![0f32; 256], vec![-0.75f32; 256]] {
            for (ty, bytes) in [
                (GgmlType::Q4_K, quantize_q4_k(&x)),
                (GgmlType::Q6_K, quantize_q6_k(&x)),
            ] {
                let y = dequantize_to_vec(ty, &bytes, 256).unwrap();
                for (a, b) in x.iter().zip(&y) {
                    assert!((a - b).abs() <= 1e-3, "{ty}: {a} vs {b}");
                }
            }
        }
    }
}
