//! frugal's decoders against an independent oracle: blocks of random bytes (with finite f16
//! scales) and the values gguf-py, llama.cpp's Python package, decodes them to
//! (`scripts/gen-quant-fixtures.py` wrote `testdata/gguf-py-blocks.bin`; see it for the layout).
//!
//! gguf-py computes in numpy float32 with the same operations in the same order as llama.cpp's
//! `dequantize_row_*` (`d * sc` first, then `dl * q`, then `- ml`; each rounded once, no fused
//! multiply-add), so the values must match bit for bit, and do.

use super::{GgmlType, check_blocks, dequantize_to_vec};

const FIXTURES: &[u8] = include_bytes!("testdata/gguf-py-blocks.bin");

struct Record<'a> {
    ty: GgmlType,
    bytes: &'a [u8],
    want: Vec<f32>,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn records() -> Vec<Record<'static>> {
    let b = FIXTURES;
    assert_eq!(&b[..4], b"FQFX", "fixture magic");
    let mut at = 8;
    let mut out = Vec::new();
    for _ in 0..u32_at(b, 4) {
        let (id, n, nb) = (u32_at(b, at), u32_at(b, at + 4), u32_at(b, at + 8));
        let (n, nb) = (n as usize, nb as usize);
        at += 12;
        let bytes = &b[at..at + nb];
        at += nb;
        let want = b[at..at + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        at += 4 * n;
        let ty = GgmlType::from_id(id).expect("a known type id");
        out.push(Record { ty, bytes, want });
    }
    assert_eq!(at, b.len(), "fixture length");
    out
}

#[test]
fn decoders_match_gguf_py_bit_for_bit() {
    let recs = records();
    let tys: Vec<GgmlType> = recs.iter().map(|r| r.ty).collect();
    for ty in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q5_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
    ] {
        assert!(tys.contains(&ty), "no fixture for {ty}");
    }
    for r in recs {
        check_blocks(r.ty, r.bytes).unwrap();
        let got = dequantize_to_vec(r.ty, r.bytes, r.want.len()).unwrap();
        for (i, (g, w)) in got.iter().zip(&r.want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{} element {i}: {g} vs {w}", r.ty);
        }
    }
}

/// The unit views (which the packer and the integer kernels read) give the oracle's values too.
#[test]
fn unit_views_match_gguf_py() {
    use super::unit::{UNIT, has_units, int_of, unit};
    for r in records().into_iter().filter(|r| has_units(r.ty)) {
        let (bs, bb) = (r.ty.block_size(), r.ty.block_bytes());
        for (b, block) in r.bytes.chunks_exact(bb).enumerate() {
            for j in 0..bs / UNIT {
                let u = unit(r.ty, block, j);
                for e in 0..UNIT {
                    let h = e / 16;
                    let v = u.scale[h] * int_of(r.ty, u.codes[e]) as f32 + u.min[h];
                    let w = r.want[b * bs + j * UNIT + e];
                    // The same operations (adding a negated min is subtracting it), so the same
                    // value; only a zero's sign may differ (0 * -x + 0 = +0).
                    assert!(
                        v == w,
                        "{} block {b} unit {j} element {e}: {v} vs {w}",
                        r.ty
                    );
                }
            }
        }
    }
}
