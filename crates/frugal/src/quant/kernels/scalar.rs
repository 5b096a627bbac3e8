//! Reference kernels: dequantize, then multiply. Slow, obviously right.

use crate::quant::act::Q8Row;
use crate::quant::{GgmlType, dequantize, f16_to_f32};

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

/// Reference for products with 8-bit activations: exact integer sums per block, then the
/// block scales, `dw*dx*sum(qw*qx) + m*s`.
pub fn dot_q8(ty: GgmlType, row: &[u8], x: Q8Row) -> f32 {
    let half = |b: &[u8]| f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    let mut sum = 0f32;
    for (b, xq) in x.qs.chunks_exact(32).enumerate() {
        let (block_sum, dw, offset) = match ty {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let (bb, data) = if ty == GgmlType::Q4_0 {
                    (18, 2)
                } else {
                    (20, 4)
                };
                let blk = &row[b * bb..(b + 1) * bb];
                let dw = half(blk);
                let m = if ty == GgmlType::Q4_0 {
                    -8.0 * dw
                } else {
                    half(&blk[2..])
                };
                let mut isum = 0i32;
                for j in 0..16 {
                    let byte = blk[data + j];
                    isum += i32::from(byte & 0x0f) * i32::from(xq[j]);
                    isum += i32::from(byte >> 4) * i32::from(xq[j + 16]);
                }
                (isum, dw, m * x.s[b])
            }
            GgmlType::Q8_0 => {
                let blk = &row[b * 34..(b + 1) * 34];
                let isum: i32 = blk[2..]
                    .iter()
                    .zip(xq)
                    .map(|(&w, &q)| i32::from(w as i8) * i32::from(q))
                    .sum();
                (isum, half(blk), 0.0)
            }
            _ => unreachable!("only formats with q8 activation kernels reach here"),
        };
        sum += block_sum as f32 * (dw * x.d[b]) + offset;
    }
    sum
}
