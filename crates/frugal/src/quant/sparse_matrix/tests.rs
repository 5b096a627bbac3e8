use super::*;
use crate::quant::kernels::{self, Isa};
use crate::quant::packed::{PackedMatrix, matmul_packed};
use crate::quant::quantize;
use proptest::prelude::*;

/// A pseudo-random matrix with, in each group of four, the two largest kept (`two_four`), or
/// each weight dropped with probability `drop` (unstructured).
fn weights(rows: usize, cols: usize, seed: u64, two_four: bool, drop: f64) -> Vec<f32> {
    let mut s = seed | 1;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut w: Vec<f32> = (0..rows * cols)
        .map(|_| (rnd() as f32 - 0.5) * 3.0)
        .collect();
    if two_four {
        for g in w.chunks_exact_mut(4) {
            let mut idx = [0, 1, 2, 3];
            idx.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
            g[idx[2]] = 0.0;
            g[idx[3]] = 0.0;
        }
    } else {
        for v in w.iter_mut() {
            if rnd() < drop {
                *v = 0.0;
            }
        }
    }
    w
}

fn acts(n: usize, cols: usize, seed: u64) -> Q8Acts {
    let x: Vec<f32> = (0..n * cols)
        .map(|i| (((i as u64 * 2654435761 + seed) % 1000) as f32 - 500.0) / 97.0)
        .collect();
    let mut a = Q8Acts::default();
    a.quantize(&x, cols);
    a
}

/// The dense Q8_0 product of the same weights, through the dense packed kernels.
fn dense_product(ty: GgmlType, data: &[u8], rows: usize, cols: usize, a: &Q8Acts) -> Vec<f32> {
    let (dt, dense) = match ty {
        GgmlType::Q8_0 => (ty, data.to_vec()),
        _ => sparse::expand_to_dense(ty, data).unwrap(),
    };
    // Q4_0's nibbles as Q8_0 codes (`nibble - 8`, same scale, same values): the sparse kernels
    // run the signed Q8_0 arithmetic for both value storages.
    let q8 = if dt == GgmlType::Q4_0 {
        let mut out = Vec::new();
        for blk in dense.chunks_exact(18) {
            out.extend_from_slice(&blk[0..2]);
            out.extend((0..32).map(|j| {
                let nib = if j < 16 {
                    blk[2 + j] & 0x0f
                } else {
                    blk[2 + j - 16] >> 4
                };
                (nib as i8 - 8) as u8
            }));
        }
        out
    } else {
        dense
    };
    let w = WeightMatrix::new(GgmlType::Q8_0, rows, cols, &q8).unwrap();
    let p = PackedMatrix::pack(&w).unwrap();
    let mut y = vec![0f32; a.n * rows];
    matmul_packed(&p, a, &mut y);
    y
}

fn levels() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    if kernels::sparse_available(kernels::detect()) {
        v.push(kernels::detect());
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Every level, one and four tokens at a time, gives the same bits as the dense Q8_0
    /// kernels on the same weights, for both compressed 2:4 types and for bitmaps of any
    /// sparsity (including rows not a whole group, all-zero vectors and all-kept ones).
    #[test]
    fn sparse_products_equal_the_dense_kernels_bit_for_bit(
        rows in 1usize..40,
        blocks in 1usize..6,
        n in 1usize..7,
        seed in any::<u64>(),
        kind in 0usize..3,
        drop in 0f64..1.0,
    ) {
        let cols = 32 * blocks;
        let (ty, w) = match kind {
            0 => (GgmlType::Q8_0_24, weights(rows, cols, seed, true, 0.0)),
            1 => (GgmlType::Q4_0_24, weights(rows, cols, seed, true, 0.0)),
            _ => (GgmlType::Q8_0, weights(rows, cols, seed, false, drop)),
        };
        let data = quantize(ty, &w).unwrap();
        let wm = WeightMatrix::new(ty, rows, cols, &data).unwrap();
        let s = SparseMatrix::pack(&wm).unwrap();
        let a = acts(n, cols, seed);
        // The bit-for-bit promise is the SIMD kernels' (the model takes the sparse layout only
        // where they run; elsewhere it multiplies the dense twin): the scalar twins below sum
        // in another order than the dense scalar kernel.
        if kernels::sparse_available(kernels::detect()) {
            let want = dense_product(ty, &data, rows, cols, &a);
            let mut y = vec![0f32; n * rows];
            matmul_sparse(&s, &a, &mut y);
            for (i, (g, w)) in y.iter().zip(&want).enumerate() {
                prop_assert_eq!(g.to_bits(), w.to_bits(), "{} entry {}: {} vs {}", ty, i, g, w);
            }
        }
        // Each level on its own, against the scalar twin.
        for isa in levels() {
            let mut biased = BiasedActs::default();
            biased.fill(&a);
            for g in 0..rows.div_ceil(ROWS) {
                let mut o = [[0f32; ROWS]; 1];
                kernels::dot_sparse(isa, &s, g, &[a.row(0)], &[biased.row(0)], &mut o);
                let mut r = [0f32; ROWS];
                dot_group_scalar(s.values, s.group(g), a.row(0), &mut r);
                prop_assert_eq!(o[0].map(f32::to_bits), r.map(f32::to_bits), "{:?} group {}", isa, g);
            }
        }
    }
}

#[test]
fn compressed_layouts_take_the_bytes_the_format_promises() {
    let (rows, cols) = (64, 576);
    for (ty, dense_ty) in [
        (GgmlType::Q8_0_24, GgmlType::Q8_0),
        (GgmlType::Q4_0_24, GgmlType::Q4_0),
    ] {
        let w = weights(rows, cols, 7, true, 0.0);
        let data = quantize(ty, &w).unwrap();
        let s = SparseMatrix::pack(&WeightMatrix::new(ty, rows, cols, &data).unwrap()).unwrap();
        let dense = quantize(dense_ty, &w).unwrap();
        let p =
            PackedMatrix::pack(&WeightMatrix::new(dense_ty, rows, cols, &dense).unwrap()).unwrap();
        // 176 vs 272 bytes per 8 rows x 32 (Q8), 112 vs 144 (Q4), plus the group offsets.
        let per = |b: usize| b as f64 / (rows * cols / 256) as f64;
        let want = if ty == GgmlType::Q8_0_24 {
            (176.0, 272.0)
        } else {
            (112.0, 144.0)
        };
        assert!(
            (per(s.bytes()) - want.0).abs() < 1.0,
            "{ty}: {}",
            per(s.bytes())
        );
        assert_eq!(per(p.bytes()), want.1, "{dense_ty}");
        assert_eq!(s.kept, rows * cols / 2);
        assert!((s.sparsity() - 0.5).abs() < 1e-12);
    }
    // A bitmap keeps exactly the nonzero codes.
    let w = weights(13, 64, 3, false, 0.7);
    let data = quantize(GgmlType::Q8_0, &w).unwrap();
    let wm = WeightMatrix::new(GgmlType::Q8_0, 13, 64, &data).unwrap();
    let s = SparseMatrix::pack(&wm).unwrap();
    let zeros = zero_fraction(&wm).unwrap();
    assert!(
        (s.sparsity() - zeros).abs() < 1e-12,
        "{} vs {zeros}",
        s.sparsity()
    );
    assert!(zeros > 0.6, "{zeros}");
    assert!(
        SparseMatrix::pack(&WeightMatrix::new(GgmlType::Q4_1, 1, 32, &[0; 20]).unwrap()).is_err()
    );
}
