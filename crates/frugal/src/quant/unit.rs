//! Every block-quantized format seen the same way: 32-element units of small integers with scales.
//!
//! For element `e` of a unit, `value[e] = scale[e / 16] * int(code[e]) + min[e / 16]`, where
//! `code` is the stored bit field (2 to 8 bits) and `int` maps it to the signed integer it stands
//! for:
//!
//! | format | code bits | int(code) | scale | min |
//! |---|---|---|---|---|
//! | Q8_0 | 8 | code as i8 | d | 0 |
//! | Q4_0 / Q5_0 | 4 / 5 | code - 8 / code - 16 | d | 0 |
//! | Q4_1 / Q5_1 | 4 / 5 | code | d | m |
//! | MXFP4 | 4 | twice the E2M1 value (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12) | 2^(e-127) / 2 | 0 |
//! | IQ4_NL | 4 | `iq4::KVALUES[code]` (-127..=113) | d | 0 |
//! | Q4_K / Q5_K (unit = sub-block j) | 4 / 5 | code | d * sc_j | -dmin * m_j |
//! | IQ4_XS (unit = sub-block j) | 4 | `iq4::KVALUES[code]` | d * (ls_j - 32) | 0 |
//! | Q6_K | 6 | code - 32 | d * sc (one per half: sub-blocks of 16) | 0 |
//! | Q3_K | 3 | code - 4 | d * (s - 32) (one per half) | 0 |
//! | Q2_K | 2 | code | d * (S & 15) (one per half) | -dmin * (S >> 4) (one per half) |
//!
//! Only Q2_K has a different min per half; every other format's two are equal.
//!
//! With activations quantized per 32 (`act::Q8Acts`: scale `dx`, integers `qx`, `s = dx * sum(qx)`,
//! and `s16` the same per half), a unit's dot product is `sum_h scale[h] * dx * sum_{e in h} int[e] *
//! qx[e] + min * s` (Q2_K: `+ sum_h min[h] * s16[h]`): integer arithmetic inside, two multiplies
//! per half. This is the reference every packed 8-bit-activation
//! kernel is checked against, and the packer (`quant::packed`) reads codes through it, so the two
//! cannot disagree about a format's bit layout.

use super::GgmlType;
use super::act::Q8Row;
use super::float::f16_to_f32;
use super::iq4::KVALUES;
use super::k_quants::scale_min;
use super::mxfp4::e8m0_to_f32;
use super::{q2_k, q3_k, q5_k};

/// Elements per unit (and per activation block).
pub const UNIT: usize = 32;

/// MXFP4's E2M1 values doubled, so every one is an integer (the halving moves into the scale).
pub const MXFP4_INT: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// One 32-element unit: stored codes and the scales that turn them into values.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Unit {
    pub codes: [u8; UNIT],
    /// One per half (elements 0..16, 16..32).
    pub scale: [f32; 2],
    /// One per half; the two differ only for formats where [`min_per_half`] holds.
    pub min: [f32; 2],
}

/// Every format with a unit view: the block-quantized ones (each also has a packed layout and
/// 8-bit-activation kernels).
pub const FORMATS: [GgmlType; 13] = [
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::MXFP4,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q5_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::Q2_K,
];

/// Whether `ty`'s units have a min per half (taken against the activations' per-half sums
/// `s16`) rather than one per unit (against `s`).
pub fn min_per_half(ty: GgmlType) -> bool {
    ty == GgmlType::Q2_K
}

/// Whether `ty` has a scale per 16 elements (two per unit), so the kernels keep a unit's two
/// half sums apart (Q6_K, Q3_K, Q2_K).
pub fn scale_per_half(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q6_K | GgmlType::Q3_K | GgmlType::Q2_K)
}

/// Whether the 8-bit kernels multiply `ty`'s units as signed integers with no offset (Q8_0,
/// MXFP4, Q6_K, Q3_K, IQ4_NL, IQ4_XS), rather than as unsigned codes plus a per-row offset
/// times the activations' block sum (the others).
pub fn signed_codes(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0
            | GgmlType::MXFP4
            | GgmlType::Q6_K
            | GgmlType::Q3_K
            | GgmlType::IQ4_NL
            | GgmlType::IQ4_XS
    )
}

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
        GgmlType::Q3_K => i32::from(code) - 4,
        GgmlType::MXFP4 => i32::from(MXFP4_INT[usize::from(code & 0x0f)]),
        GgmlType::IQ4_NL | GgmlType::IQ4_XS => i32::from(KVALUES[usize::from(code & 0x0f)]),
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
                min: [-(dmin * f32::from(m)); 2],
            };
        }
        GgmlType::Q5_K => {
            for (l, c) in codes.iter_mut().enumerate() {
                *c = q5_k::code(block, j, l);
            }
            let (sc, m) = scale_min(j, &block[4..16]);
            let (d, dmin) = (half(block), half(&block[2..]));
            return Unit {
                codes,
                scale: [d * f32::from(sc); 2],
                min: [-(dmin * f32::from(m)); 2],
            };
        }
        GgmlType::Q3_K => {
            for (l, c) in codes.iter_mut().enumerate() {
                *c = q3_k::code(block, 32 * j + l);
            }
            let d = half(&block[108..]);
            let sc = q3_k::scales(&block[96..108]);
            return Unit {
                codes,
                scale: [d * f32::from(sc[2 * j]), d * f32::from(sc[2 * j + 1])],
                min: [0.0; 2],
            };
        }
        GgmlType::Q2_K => {
            for (l, c) in codes.iter_mut().enumerate() {
                *c = q2_k::code(block, 32 * j + l);
            }
            let (d, dmin) = (half(&block[80..]), half(&block[82..]));
            let s = [block[2 * j], block[2 * j + 1]];
            return Unit {
                codes,
                scale: s.map(|s| d * f32::from(s & 0x0f)),
                min: s.map(|s| -(dmin * f32::from(s >> 4))),
            };
        }
        GgmlType::IQ4_NL => {
            for (e, c) in codes.iter_mut().enumerate() {
                *c = split_nibble(&block[2..18], e);
            }
            (half(block), 0.0)
        }
        GgmlType::IQ4_XS => {
            for (e, c) in codes.iter_mut().enumerate() {
                *c = split_nibble(&block[8 + 16 * j..], e);
            }
            let dl = half(block) * f32::from(super::iq4::xs_scale(block, j));
            return Unit {
                codes,
                scale: [dl; 2],
                min: [0.0; 2],
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
                min: [0.0; 2],
            };
        }
        _ => unreachable!("{ty} has no unit view"),
    };
    Unit {
        codes,
        scale: [scale; 2],
        min: [min; 2],
    }
}

/// Dot product of one unit with activation block `b` of `x` (integers `qx`, scale `dx`,
/// `s = dx * sum(qx)`, `s16` per half): exact integer sums per half, then the scales.
pub fn unit_dot(ty: GgmlType, u: &Unit, x: Q8Row, b: usize) -> f32 {
    let (qx, dx) = (&x.qs[UNIT * b..UNIT * (b + 1)], x.d[b]);
    let mut isum = [0i32; 2];
    for (e, (&c, &q)) in u.codes.iter().zip(qx).enumerate() {
        isum[e / 16] += int_of(ty, c) * i32::from(q);
    }
    let offset = if min_per_half(ty) {
        u.min[0] * x.s16[2 * b] + u.min[1] * x.s16[2 * b + 1]
    } else {
        u.min[0] * x.s[b]
    };
    (isum[0] as f32 * u.scale[0] + isum[1] as f32 * u.scale[1]) * dx + offset
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
                        let v = u.scale[e / 16] * int_of(ty, u.codes[e]) as f32 + u.min[e / 16];
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
