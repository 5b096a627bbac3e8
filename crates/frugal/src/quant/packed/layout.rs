//! The grouped layout's bytes per format (described in the parent module): how a stored block's
//! codes and scales are written into a group column, and read back.

use super::GROUP;
use crate::quant::unit::{UNIT, Unit};
use crate::quant::{GgmlType, f16_to_f32};

/// The packed layout of one block column of a group.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Elements per column per row (the format's block size).
    pub span: usize,
    /// Header bytes (the group's scales).
    pub head: usize,
    /// Bytes of one 32-element unit for the eight rows.
    pub unit: usize,
}

impl Layout {
    pub fn units(&self) -> usize {
        self.span / UNIT
    }

    pub fn column_bytes(&self) -> usize {
        self.head + self.units() * self.unit
    }
}

/// Bytes of the 4-bit nibble chunks of one unit for a group.
pub(super) const NIBBLES: usize = 4 * 32;
/// Bytes of the 2-bit chunks of one unit for a group (Q3_K's low bits, Q2_K's codes).
pub(super) const CRUMBS: usize = 2 * 32;

/// How a format's unit codes are laid out: bytes, nibbles or bit pairs, plus extra bit planes.
fn is_crumbs(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q3_K | GgmlType::Q2_K)
}

/// The packed layout of `ty`, for every format with 8-bit-activation kernels.
pub fn layout(ty: GgmlType) -> Option<Layout> {
    let (span, head, unit) = match ty {
        GgmlType::Q8_0 => (32, 2 * GROUP, 8 * 32),
        GgmlType::Q4_0 => (32, 2 * GROUP, NIBBLES),
        GgmlType::Q4_1 => (32, 4 * GROUP, NIBBLES),
        GgmlType::Q5_0 => (32, 2 * GROUP, NIBBLES + 32),
        GgmlType::Q5_1 => (32, 4 * GROUP, NIBBLES + 32),
        GgmlType::MXFP4 => (32, GROUP, NIBBLES),
        GgmlType::IQ4_NL => (32, 2 * GROUP, NIBBLES),
        GgmlType::Q4_K => (256, 4 * GROUP + 2 * 8 * GROUP, NIBBLES),
        GgmlType::Q5_K => (256, 4 * GROUP + 2 * 8 * GROUP, NIBBLES + 32),
        GgmlType::IQ4_XS => (256, 2 * GROUP + 8 * GROUP, NIBBLES),
        GgmlType::Q6_K => (256, 2 * GROUP + 16 * GROUP, NIBBLES + 64),
        GgmlType::Q3_K => (256, 2 * GROUP + 16 * GROUP, CRUMBS + 32),
        GgmlType::Q2_K => (256, 4 * GROUP + 16 * GROUP, CRUMBS),
        _ => return None,
    };
    Some(Layout { span, head, unit })
}

/// Bytes of one block column of a group.
pub fn column_bytes(ty: GgmlType) -> usize {
    layout(ty).map_or(0, |l| l.column_bytes())
}

/// Writes bit `bit` of row `r`'s 32 codes as a bit plane: byte j of the row's word, bit i = the
/// bit of element 4i+j.
fn put_plane(codes: &[u8; UNIT], bit: u32, r: usize, dst: &mut [u8]) {
    for j in 0..4 {
        dst[4 * r + j] = (0..8).fold(0, |b, i| b | (((codes[4 * i + j] >> bit) & 1) << i));
    }
}

/// Writes row `r`'s unit codes into a unit's packed data.
pub(super) fn put_codes(ty: GgmlType, codes: &[u8; UNIT], r: usize, dst: &mut [u8]) {
    if ty == GgmlType::Q8_0 {
        for i in 0..8 {
            dst[32 * i + 4 * r..][..4].copy_from_slice(&codes[4 * i..4 * i + 4]);
        }
        return;
    }
    if is_crumbs(ty) {
        // Chunk c, byte j of row r, bits 2i..2i+2: the low two bits of element 4(4c+i)+j.
        for c in 0..2 {
            for j in 0..4 {
                dst[32 * c + 4 * r + j] =
                    (0..4).fold(0, |b, i| b | ((codes[4 * (4 * c + i) + j] & 3) << (2 * i)));
            }
        }
        if ty == GgmlType::Q3_K {
            put_plane(codes, 2, r, &mut dst[CRUMBS..]);
        }
        return;
    }
    for c in 0..4 {
        for j in 0..4 {
            dst[32 * c + 4 * r + j] =
                (codes[8 * c + j] & 0x0f) | ((codes[8 * c + 4 + j] & 0x0f) << 4);
        }
    }
    match ty {
        GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => {
            put_plane(codes, 4, r, &mut dst[NIBBLES..]);
        }
        GgmlType::Q6_K => {
            for k in 0..2 {
                for j in 0..4 {
                    dst[NIBBLES + 32 * k + 4 * r + j] = (0..4).fold(0, |b, i| {
                        b | (((codes[4 * (4 * k + i) + j] >> 4) & 3) << (2 * i))
                    });
                }
            }
        }
        _ => {}
    }
}

/// Reads row `r`'s unit codes back from a unit's packed data (the inverse of [`put_codes`]).
pub(super) fn get_codes(ty: GgmlType, src: &[u8], r: usize) -> [u8; UNIT] {
    std::array::from_fn(|e| {
        let (i, j) = (e / 4, e % 4);
        if ty == GgmlType::Q8_0 {
            return src[32 * i + 4 * r + j];
        }
        if is_crumbs(ty) {
            let low = (src[32 * (i / 4) + 4 * r + j] >> (2 * (i % 4))) & 3;
            let third = if ty == GgmlType::Q3_K {
                (src[CRUMBS + 4 * r + j] >> i) & 1
            } else {
                0
            };
            return low | (third << 2);
        }
        let byte = src[32 * (i / 2) + 4 * r + j];
        let low = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
        let top = match ty {
            GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q5_K => (src[NIBBLES + 4 * r + j] >> i) & 1,
            GgmlType::Q6_K => (src[NIBBLES + 32 * (i / 4) + 4 * r + j] >> (2 * (i % 4))) & 3,
            _ => 0,
        };
        low | (top << 4)
    })
}

/// Writes row `r`'s scales from its stored block into a column header.
pub(super) fn put_header(ty: GgmlType, block: &[u8], r: usize, head: &mut [u8]) {
    match ty {
        GgmlType::MXFP4 => head[r] = block[0],
        GgmlType::Q4_K | GgmlType::Q5_K => {
            head[2 * r..2 * r + 2].copy_from_slice(&block[0..2]);
            head[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&block[2..4]);
            for j in 0..8 {
                let (sc, m) = crate::quant::k_quants::scale_min(j, &block[4..16]);
                head[32 + 8 * j + r] = sc;
                head[96 + 8 * j + r] = m;
            }
        }
        GgmlType::Q6_K => {
            head[2 * r..2 * r + 2].copy_from_slice(&block[208..210]);
            for i in 0..16 {
                head[16 + 8 * i + r] = block[192 + i];
            }
        }
        GgmlType::Q3_K => {
            head[2 * r..2 * r + 2].copy_from_slice(&block[108..110]);
            for (i, s) in crate::quant::q3_k::scales(&block[96..108])
                .into_iter()
                .enumerate()
            {
                head[16 + 8 * i + r] = s as u8;
            }
        }
        GgmlType::Q2_K => {
            head[2 * r..2 * r + 2].copy_from_slice(&block[80..82]);
            head[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&block[82..84]);
            for i in 0..16 {
                head[32 + 8 * i + r] = block[i];
            }
        }
        GgmlType::IQ4_XS => {
            head[2 * r..2 * r + 2].copy_from_slice(&block[0..2]);
            for j in 0..8 {
                head[16 + 8 * j + r] = crate::quant::iq4::xs_scale(block, j) as u8;
            }
        }
        _ => {
            head[2 * r..2 * r + 2].copy_from_slice(&block[0..2]);
            if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) {
                head[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&block[2..4]);
            }
        }
    }
}

/// Unit `u` of row `r` from a packed column: the same codes and scales as `unit::unit` on the
/// original block (the scalar kernel and the layout test read it).
pub fn packed_unit(ty: GgmlType, column: &[u8], r: usize, u: usize) -> Unit {
    let l = layout(ty).expect("packed type");
    let half = |at: usize| f16_to_f32(u16::from_le_bytes([column[at], column[at + 1]]));
    let codes = get_codes(ty, &column[l.head + u * l.unit..], r);
    let (scale, min) = match ty {
        GgmlType::MXFP4 => {
            let d = crate::quant::mxfp4::e8m0_to_f32(column[r]) * 0.5;
            ([d; 2], [0.0; 2])
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (half(2 * r), half(16 + 2 * r));
            let (sc, m) = (column[32 + 8 * u + r], column[96 + 8 * u + r]);
            ([d * f32::from(sc); 2], [-(dmin * f32::from(m)); 2])
        }
        GgmlType::Q6_K | GgmlType::Q3_K => {
            let d = half(2 * r);
            let sc = |i: usize| d * f32::from(column[16 + 8 * i + r] as i8);
            ([sc(2 * u), sc(2 * u + 1)], [0.0; 2])
        }
        GgmlType::Q2_K => {
            let (d, dmin) = (half(2 * r), half(16 + 2 * r));
            let s = [column[32 + 16 * u + r], column[40 + 16 * u + r]];
            (
                s.map(|s| d * f32::from(s & 0x0f)),
                s.map(|s| -(dmin * f32::from(s >> 4))),
            )
        }
        GgmlType::IQ4_XS => {
            let dl = half(2 * r) * f32::from(column[16 + 8 * u + r] as i8);
            ([dl; 2], [0.0; 2])
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => ([half(2 * r); 2], [half(16 + 2 * r); 2]),
        _ => ([half(2 * r); 2], [0.0; 2]),
    };
    Unit { codes, scale, min }
}
