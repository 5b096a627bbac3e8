//! Every block-quantized format seen the same way: 32-element units of small integers with scales.
//!
//! For element `e` of a unit, `value[e] = scale[e / 16] * int(code[e]) + min`, where `code` is the
//! stored bit field (4, 5, 6 or 8 bits) and `int` maps it to the signed integer it stands for:
//!
//! | format | code bits | int(code) | scale (both halves) | min |
//! |---|---|---|---|---|
//! | Q8_0 | 8 | code as i8 | d | 0 |
//! | Q4_0 / Q5_0 | 4 / 5 | code - 8 / code - 16 | d | 0 |
//! | Q4_1 / Q5_1 | 4 / 5 | code | d | m |
//! | MXFP4 | 4 | twice the E2M1 value (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12) | 2^(e-127) / 2 | 0 |
//! | Q4_K (unit = sub-block j) | 4 | code | d * sc_j | -dmin * m_j |
//! | Q6_K | 6 | code - 32 | d * sc (one per half: sub-blocks of 16) | 0 |
//!
//! With activations quantized per 32 (`act::Q8Acts`: scale `dx`, integers `qx`, `s = dx * sum(qx)`),
//! a unit's dot product is `sum_h scale[h] * dx * sum_{e in h} int[e] * qx[e] + min * s`: integer
//! arithmetic inside, two multiplies per half. This is the reference every packed 8-bit-activation
//! kernel is checked against, and the packer (`quant::packed`) reads codes through it, so the two
//! cannot disagree about a format's bit layout.

use super::GgmlType;
use super::float::f16_to_f32;
use super::k_quants::scale_min;
use super::mxfp4::e8m0_to_f32;

/// Elements per unit (and per activation block).
pub const UNIT: usize = 32;

/// MXFP4's E2M1 values doubled, so every one is an integer (the halving moves into the scale).
pub const MXFP4_INT: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// One 32-element unit: stored codes and the scales that turn them into values.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Unit {
    pub codes: [u8; UNIT],
    pub scale: [f32; 2],
    pub min: f32,
}

/// Every format with a unit view: the block-quantized ones (each also has a packed layout and
/// 8-bit-activation kernels).
pub const FORMATS: [GgmlType; 8] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::MXFP4,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

/// Whether `ty` has a unit view (the block-quantized formats).
pub fn has_units(ty: GgmlType) -> bool {
    FORMATS.contains(&ty)
}

/// The signed integer a stored code stands for.
#[inline]
pub fn int_of(ty: GgmlType, code: u8) -> i32 {
    match ty {
        GgmlType::Q8_0 => i32::from(code as i8),
        GgmlType::Q4_0 => i32::from(code) - 8,
        GgmlType::Q5_0 => i32::from(code) - 16,
        GgmlType::Q6_K => i32::from(code) - 32,
        GgmlType::MXFP4 => i32::from(MXFP4_INT[usize::from(code & 0x0f)]),
        _ => i32::from(code),
    }
}

fn half(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Nibble `e` of a 32-element block stored Q4-style: element e in the low nibble of `qs[e]`,
/// element e + 16 in the high nibble of `qs[e]`.
fn split_nibble(qs: &[u8], e: usize) -> u8 {
    if e < 16 {
        qs[e] & 0x0f
    } else {
        qs[e - 16] >> 4
    }
}

/// Unit `j` of one stored block of `ty` (`block` is `ty.block_bytes()` long; `j` is 0 for the
/// 32-element formats and 0..8 for the K-quants' 256-element super-blocks).
pub fn unit(ty: GgmlType, block: &[u8], j: usize) -> Unit {
    let mut codes = [0u8; UNIT];
    let (scale, min) = match ty {
        GgmlType::Q8_0 => {
            codes.copy_from_slice(&block[2..34]);
            (half(block), 0.0)
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let (d, m, qs) = if ty == GgmlType::Q4_0 {
                (half(block), 0.0, &block[2..18])
            } else {
                (half(block), half(&block[2..]), &block[4..20])
            };
            for (e, c) in codes.iter_mut().enumerate() {
                *c = split_nibble(qs, e);
            }
            (d, m)
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let (d, m, rest) = if ty == GgmlType::Q5_0 {
                (half(block), 0.0, &block[2..22])
            } else {
                (half(block), half(&block[2..]), &block[4..24])
            };
            let qh = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]);
            for (e, c) in codes.iter_mut().enumerate() {
                *c = split_nibble(&rest[4..], e) | ((((qh >> e) & 1) as u8) << 4);
            }
            (d, m)
        }
        GgmlType::MXFP4 => {
            for (e, c) in codes.iter_mut().enumerate() {
                *c = split_nibble(&block[1..17], e);
            }
            (e8m0_to_f32(block[0]) * 0.5, 0.0)
        }
        GgmlType::Q4_K => {
            // Sub-block j: the low (j even) or high (j odd) nibbles of qs[32 (j/2) ..][..32].
            let qs = &block[16 + 32 * (j / 2)..][..32];
            for (c, &q) in codes.iter_mut().zip(qs) {
                *c = if j.is_multiple_of(2) {
                    q & 0x0f
                } else {
                    q >> 4
                };
            }
            let (sc, m) = scale_min(j, &block[4..16]);
            let (d, dmin) = (half(block), half(&block[2..]));
            return Unit {
                codes,
                scale: [d * f32::from(sc); 2],
                min: -(dmin * f32::from(m)),
            };
        }
        GgmlType::Q6_K => {
            // Elements 32j..32j+32 of the super-block: half h = j / 4, quarter k = j % 4.
            let (h, k) = (j / 4, j % 4);
            let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
            for (l, c) in codes.iter_mut().enumerate() {
                let byte = ql[64 * h + l + 32 * (k % 2)];
                let low = if k < 2 { byte & 0x0f } else { byte >> 4 };
                *c = low | (((qh[32 * h + l] >> (2 * k)) & 3) << 4);
            }
            let d = half(&block[208..]);
            return Unit {
                codes,
                scale: [
                    d * f32::from(sc[2 * j] as i8),
                    d * f32::from(sc[2 * j + 1] as i8),
                ],
                min: 0.0,
            };
        }
        _ => unreachable!("{ty} has no unit view"),
    };
    Unit {
        codes,
        scale: [scale; 2],
        min,
    }
}

/// Dot product of one unit with one block of 8-bit activations (integers `qx`, scale `dx`,
/// `s = dx * sum(qx)`): exact integer sums per half, then the scales.
pub fn unit_dot(ty: GgmlType, u: &Unit, qx: &[i8], dx: f32, s: f32) -> f32 {
    let mut isum = [0i32; 2];
    for (e, (&c, &x)) in u.codes.iter().zip(qx).enumerate() {
        isum[e / 16] += int_of(ty, c) * i32::from(x);
    }
    (isum[0] as f32 * u.scale[0] + isum[1] as f32 * u.scale[1]) * dx + u.min * s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_to_vec, quantize};

    #[test]
    fn units_decode_to_the_reference_values() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0)
            .collect();
        for ty in FORMATS {
            let data = quantize(ty, &x).unwrap();
            let want = dequantize_to_vec(ty, &data, x.len()).unwrap();
            let (bs, bb) = (ty.block_size(), ty.block_bytes());
            for (b, block) in data.chunks_exact(bb).enumerate() {
                for j in 0..bs / UNIT {
                    let u = unit(ty, block, j);
                    for e in 0..UNIT {
                        let v = u.scale[e / 16] * int_of(ty, u.codes[e]) as f32 + u.min;
                        let w = want[b * bs + j * UNIT + e];
                        // The decoders compute d * (q - 8) or d * sc * q - dmin * m in the same
                        // f32 operations up to one rounding of the product.
                        assert!(
                            (v - w).abs() <= 2.0 * f32::EPSILON * w.abs().max(1.0),
                            "{ty} block {b} unit {j} element {e}: {v} vs {w}"
                        );
                    }
                }
            }
        }
    }
}
