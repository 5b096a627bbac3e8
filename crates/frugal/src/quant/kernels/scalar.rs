//! Reference kernels: dequantize, then multiply. Slow, obviously right.

use crate::quant::act::{Q8Row, WideRow};
use crate::quant::unit::{UNIT, int_of, unit, unit_dot};
use crate::quant::{GgmlType, dequantize};

/// Reference `dot_row`: decodes one block (32 elements, or a 256-element K-quant super-block)
/// at a time into a stack buffer.
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    let bs = ty.block_size().max(32);
    let bytes_per = ty.bytes_for(bs as u64).unwrap_or(0) as usize;
    let mut buf = [0f32; 256];
    let buf = &mut buf[..bs];
    let mut sum = 0f32;
    let full = x.len() / bs * bs;
    for (xc, rc) in x[..full].chunks_exact(bs).zip(row.chunks_exact(bytes_per)) {
        dequantize(ty, rc, buf).expect("caller validated the row");
        sum += buf.iter().zip(xc).map(|(a, b)| a * b).sum::<f32>();
    }
    if full < x.len() {
        // Only plain float rows can have a tail (block formats are whole blocks).
        let tail = &x[full..];
        let eb = ty.block_bytes();
        dequantize(ty, &row[full * eb..], &mut buf[..tail.len()])
            .expect("caller validated the row");
        sum += buf.iter().zip(tail).map(|(a, b)| a * b).sum::<f32>();
    }
    sum
}

/// Reference `gemm_f32`.
pub fn gemm_f32(w: &[f32], x: &[f32], k: usize, out: &mut [f32]) {
    let rows = w.len() / k;
    for (r, wr) in w.chunks_exact(k).enumerate() {
        for (t, xt) in x.chunks_exact(k).enumerate() {
            out[t * rows + r] = wr.iter().zip(xt).map(|(a, b)| a * b).sum();
        }
    }
}

/// Reference for products with 8-bit activations: each 32-element unit of the row (see
/// `quant::unit`) as exact integer sums, then its scales, against the activation block's `dx`
/// and `s` (or `s16`).
pub fn dot_q8(ty: GgmlType, row: &[u8], x: Q8Row) -> f32 {
    let (bs, bb) = (ty.block_size(), ty.block_bytes());
    let units = bs / UNIT;
    let mut sum = 0f32;
    for b in 0..x.d.len() {
        let u = unit(ty, &row[b / units * bb..][..bb], b % units);
        sum += unit_dot(ty, &u, x, b);
    }
    sum
}

/// Reference for Q8_0 rows with 15-bit activations (`act::WideActs`): exact integer block sums,
/// then `d_w * d_x`.
pub fn dot_wide_q8_0(row: &[u8], x: WideRow) -> f32 {
    let mut sum = 0f32;
    for (b, &dx) in x.d.iter().enumerate() {
        let u = unit(GgmlType::Q8_0, &row[34 * b..34 * (b + 1)], 0);
        let isum: i32 = (0..UNIT)
            .map(|e| int_of(GgmlType::Q8_0, u.codes[e]) * x.q(32 * b + e))
            .sum();
        sum += isum as f32 * (u.scale[0] * dx);
    }
    sum
}
