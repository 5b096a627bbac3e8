//! Compressed 2:4 storage: frugal-only tensor types that keep, of every four consecutive weights
//! in a row, the two that pruning kept plus their 2-bit positions.
//!
//! A zero a dense format stores is still a number: read from memory and multiplied. These types
//! store only the kept half, so the bytes per weight really drop:
//!
//! ```text
//! Q8_0_24 (22 bytes / 32 weights, 5.5 bits): d (f16) | pos[4] | qs[16] (i8)
//! Q4_0_24 (14 bytes / 32 weights, 3.5 bits): d (f16) | pos[4] | qs[8]  (nibbles, code + 8)
//! ```
//!
//! Kept value `k` (0..16) belongs to group `k / 2` (elements `4(k/2) .. 4(k/2)+4`); its position
//! within the group is bits `2(k%4)..2(k%4)+2` of `pos[k/4]`, the two of a group ascending. Its
//! value is `d * qs[k]` (Q8_0_24) or `d * (nibble_k - 8)` with nibble `k` in the low half of byte
//! `k/2` for even `k` and the high half for odd (Q4_0_24). Every other element is exactly zero.
//! The scale and codes are those Q8_0 / Q4_0 give the same (2:4-sparse) block, because the
//! zeros change neither the absolute maximum nor any kept value's code: a file of these types
//! holds exactly the weights of the dense Q8_0 / Q4_0 file of the same pruned model, and
//! [`expand_to_dense`] turns it back into that file's bytes.
//!
//! The GGUF type ids (1024, 1025) lie far above ggml's (which end near 40): llama.cpp refuses
//! such a file ("invalid ggml type"); `frugal info` says so.

use super::float::f16_to_f32;
use super::{GgmlType, QuantError};

/// Elements per block.
pub const QK: usize = 32;
/// Kept values per block (2 of every 4).
pub const KEPT: usize = QK / 2;

/// Whether `ty` is one of the compressed 2:4 types.
pub fn is_sparse(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0_24 | GgmlType::Q4_0_24)
}

/// The dense ggml type holding the same values (what [`expand_to_dense`] writes).
pub fn dense_type(ty: GgmlType) -> Option<GgmlType> {
    match ty {
        GgmlType::Q8_0_24 => Some(GgmlType::Q8_0),
        GgmlType::Q4_0_24 => Some(GgmlType::Q4_0),
        _ => None,
    }
}

/// The compressed 2:4 type whose kept values are stored like `dense` (Q8_0 or Q4_0).
pub fn sparse_type(dense: GgmlType) -> Option<GgmlType> {
    match dense {
        GgmlType::Q8_0 => Some(GgmlType::Q8_0_24),
        GgmlType::Q4_0 => Some(GgmlType::Q4_0_24),
        _ => None,
    }
}

/// The positions (within each group of four) of a block's kept values, two per group.
fn positions(pos: &[u8]) -> [u8; KEPT] {
    std::array::from_fn(|k| (pos[k / 4] >> (2 * (k % 4))) & 3)
}

/// The element index within the block of kept value `k`.
#[inline]
fn element(pos: &[u8; KEPT], k: usize) -> usize {
    4 * (k / 2) + pos[k] as usize
}

/// One decoded block: scale, each kept value's element index, and its signed code.
pub(crate) struct Block {
    pub d: f32,
    pub elements: [u8; KEPT],
    pub codes: [i8; KEPT],
}

/// Reads block `b` of `ty` (a compressed type; `b` holds exactly its bytes).
pub(crate) fn read_block(ty: GgmlType, b: &[u8]) -> Block {
    let d = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    let pos = positions(&b[2..6]);
    let elements = std::array::from_fn(|k| element(&pos, k) as u8);
    let codes = match ty {
        GgmlType::Q8_0_24 => std::array::from_fn(|k| b[6 + k] as i8),
        _ => std::array::from_fn(|k| {
            let byte = b[6 + k / 2];
            let nib = if k % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            nib as i8 - 8
        }),
    };
    Block { d, elements, codes }
}

/// Scalar reference decoder.
pub(super) fn decode(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out
        .chunks_exact_mut(QK)
        .zip(bytes.chunks_exact(ty.block_bytes()))
    {
        o.fill(0.0);
        let blk = read_block(ty, b);
        for k in 0..KEPT {
            o[blk.elements[k] as usize] = blk.d * f32::from(blk.codes[k]);
        }
    }
}

/// Encodes `x` (whole blocks, every group of four holding at most two nonzero values) as the
/// compressed 2:4 type `ty`. Groups with fewer than two nonzeros keep zeros to fill their two
/// slots (the lowest free positions).
pub fn quantize(ty: GgmlType, x: &[f32]) -> Result<Vec<u8>, QuantError> {
    let dense = dense_type(ty).ok_or(QuantError::Unsupported(ty))?;
    if !x.len().is_multiple_of(QK) {
        return Err(QuantError::NotWholeBlocks { ty, n: x.len() });
    }
    if let Some(g) = x
        .chunks_exact(4)
        .position(|g| g.iter().filter(|v| **v != 0.0).count() > 2)
    {
        return Err(QuantError::NotSparse { ty, element: 4 * g });
    }
    // The dense format's codes: the same scale and rounding (see the module doc).
    let dense_bytes = super::quantize(dense, x)?;
    let mut out = Vec::with_capacity(x.len() / QK * ty.block_bytes());
    for (xb, db) in x
        .chunks_exact(QK)
        .zip(dense_bytes.chunks_exact(dense.block_bytes()))
    {
        let mut pos = [0u8; 4];
        let mut kept = [0usize; KEPT];
        for g in 0..QK / 4 {
            let group = &xb[4 * g..4 * g + 4];
            // The nonzeros, and the lowest zero positions to fill two slots, ascending.
            let mut fill = 2 - group.iter().filter(|v| **v != 0.0).count();
            let mut k = 2 * g;
            for (p, &v) in group.iter().enumerate() {
                if v == 0.0 {
                    if fill == 0 {
                        continue;
                    }
                    fill -= 1;
                }
                pos[k / 4] |= (p as u8) << (2 * (k % 4));
                kept[k] = 4 * g + p;
                k += 1;
            }
        }
        out.extend_from_slice(&db[0..2]);
        out.extend_from_slice(&pos);
        match ty {
            GgmlType::Q8_0_24 => out.extend(kept.iter().map(|&e| db[2 + e])),
            _ => {
                // Q4_0 nibble order: element j low in byte j, element j + 16 high.
                let code = |e: usize| {
                    let byte = db[2 + e % 16];
                    if e < 16 { byte & 0x0f } else { byte >> 4 }
                };
                for k in (0..KEPT).step_by(2) {
                    out.push(code(kept[k]) | (code(kept[k + 1]) << 4));
                }
            }
        }
    }
    Ok(out)
}

/// The bytes of the dense type (Q8_0 or Q4_0) holding exactly the same values: the "export a
/// dense file" path, and what a CPU without the sparse kernels computes with.
pub fn expand_to_dense(ty: GgmlType, bytes: &[u8]) -> Result<(GgmlType, Vec<u8>), QuantError> {
    let dense = dense_type(ty).ok_or(QuantError::Unsupported(ty))?;
    let bb = ty.block_bytes();
    if !bytes.len().is_multiple_of(bb) {
        return Err(QuantError::BadLength {
            ty,
            n: bytes.len() / bb * QK,
            expected: bytes.len() / bb * bb,
            got: bytes.len(),
        });
    }
    let mut out = Vec::with_capacity(bytes.len() / bb * dense.block_bytes());
    for b in bytes.chunks_exact(bb) {
        let blk = read_block(ty, b);
        out.extend_from_slice(&b[0..2]);
        let mut codes = [0i8; QK];
        for k in 0..KEPT {
            codes[blk.elements[k] as usize] = blk.codes[k];
        }
        match dense {
            GgmlType::Q8_0 => out.extend(codes.iter().map(|&q| q as u8)),
            _ => out.extend((0..16).map(|j| {
                let u = |q: i8| (q + 8) as u8;
                u(codes[j]) | (u(codes[j + 16]) << 4)
            })),
        }
    }
    Ok((dense, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A 2:4-sparse vector: in each group of four, the two largest of `raw` kept, some of
    /// them zero.
    fn two_four(raw: &[f32]) -> Vec<f32> {
        let mut x = raw.to_vec();
        for g in x.chunks_exact_mut(4) {
            let mut idx = [0, 1, 2, 3];
            idx.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
            g[idx[2]] = 0.0;
            g[idx[3]] = 0.0;
        }
        x
    }

    proptest! {
        /// Each compressed type decodes to exactly the values its dense twin decodes to, and
        /// expands to exactly its twin's bytes.
        #[test]
        fn compressed_blocks_hold_the_dense_formats_values(
            raw in proptest::collection::vec(-4f32..4.0, 64..=64),
            drop in proptest::collection::vec(any::<bool>(), 64..=64),
        ) {
            let mut x = two_four(&raw);
            for (v, d) in x.iter_mut().zip(&drop) {
                if *d { *v = 0.0; }
            }
            for ty in [GgmlType::Q8_0_24, GgmlType::Q4_0_24] {
                let dense = dense_type(ty).unwrap();
                let s = quantize(ty, &x).unwrap();
                prop_assert_eq!(s.len() as u64, ty.bytes_for(64).unwrap());
                let want = super::super::quantize(dense, &x).unwrap();
                let (dt, expanded) = expand_to_dense(ty, &s).unwrap();
                prop_assert_eq!(dt, dense);
                prop_assert_eq!(&expanded, &want);
                let a = super::super::dequantize_to_vec(ty, &s, 64).unwrap();
                let b = super::super::dequantize_to_vec(dense, &want, 64).unwrap();
                prop_assert_eq!(a, b);
            }
        }
    }

    #[test]
    fn dense_input_is_refused_with_its_place() {
        let mut x = vec![0f32; 64];
        x[40] = 1.0;
        x[41] = 1.0;
        x[43] = 1.0;
        assert_eq!(
            quantize(GgmlType::Q8_0_24, &x),
            Err(QuantError::NotSparse {
                ty: GgmlType::Q8_0_24,
                element: 40
            })
        );
        assert!(matches!(
            quantize(GgmlType::Q4_0_24, &x[..48]),
            Err(QuantError::NotWholeBlocks { .. })
        ));
        assert!(expand_to_dense(GgmlType::Q8_0_24, &[0; 21]).is_err());
    }

    #[test]
    fn bytes_per_weight_drop() {
        assert_eq!(GgmlType::Q8_0_24.bits_per_weight(), 5.5);
        assert_eq!(GgmlType::Q4_0_24.bits_per_weight(), 3.5);
        assert!(GgmlType::Q8_0_24.bits_per_weight() < GgmlType::Q8_0.bits_per_weight());
    }
}
