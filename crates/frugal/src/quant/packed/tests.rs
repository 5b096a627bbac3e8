//! The repacked layout and its products: every code and scale kept, products equal to the
//! reference kernels on the original rows, and the multi-token and multi-matrix paths equal to
//! one token and one matrix at a time.

use super::*;
use crate::quant::kernels::scalar;
use crate::quant::quantize;
use crate::quant::unit::FORMATS;

fn weights(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0 + ((i * 13 % 97) as f32 - 48.0) / 90.0)
        .collect()
}

#[test]
fn wide_products_equal_the_reference_and_beat_eight_bits() {
    let (rows, cols, n) = (13, 256, 6);
    let wf = weights(rows * cols);
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 11 % 19) as f32 - 9.0) / 3.0 + (i % 7) as f32 * 0.01)
        .collect();
    let data = quantize(GgmlType::Q8_0, &wf).unwrap();
    let w = WeightMatrix::new(GgmlType::Q8_0, rows, cols, &data).unwrap();
    let p = PackedMatrix::pack(&w).unwrap();
    let mut wide = WideActs::default();
    wide.quantize(&x, cols);
    let mut q8 = Q8Acts::default();
    q8.quantize(&x, cols);
    let mut y = vec![0f32; n * rows];
    matmul_packed(&p, &wide, &mut y);
    let deq = crate::quant::dequantize_to_vec(GgmlType::Q8_0, &data, rows * cols).unwrap();
    let (mut err_wide, mut err_q8) = (0f64, 0f64);
    for t in 0..n {
        let mut o = [0f32; GROUP];
        dot_group_wide_scalar(p.group(0), wide.row(t), &mut o);
        for r in 0..rows {
            let want = scalar::dot_wide_q8_0(w.row(r), wide.row(t));
            let tol = 1e-5 * (1.0 + want.abs()) * cols as f32 / 32.0;
            let got = y[t * rows + r];
            assert!((got - want).abs() <= tol, "t{t} r{r}: {got} vs {want}");
            if r < GROUP {
                assert!((o[r] - want).abs() <= tol, "scalar packed t{t} r{r}");
            }
            let exact: f64 = (0..cols)
                .map(|e| f64::from(deq[r * cols + e]) * f64::from(x[t * cols + e]))
                .sum();
            err_wide += (f64::from(got) - exact).abs();
            err_q8 +=
                (f64::from(scalar::dot_q8(GgmlType::Q8_0, w.row(r), q8.row(t))) - exact).abs();
        }
    }
    // 15-bit activations are 128x finer: the error of the product shrinks accordingly.
    assert!(err_wide * 20.0 < err_q8, "wide {err_wide} vs q8 {err_q8}");
}

#[test]
fn packing_keeps_every_code_and_scale() {
    // 11 rows: one full group and a padded one; two K-quant super-blocks per row.
    let (rows, cols) = (11, 512);
    let wf = weights(rows * cols);
    for ty in FORMATS {
        let data = quantize(ty, &wf).unwrap();
        let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
        let p = PackedMatrix::pack(&w).unwrap();
        let l = layout(ty).unwrap();
        for row in 0..rows {
            let group = p.group(row / GROUP);
            for (c, block) in w.row(row).chunks_exact(ty.block_bytes()).enumerate() {
                let column = &group[c * l.column_bytes()..(c + 1) * l.column_bytes()];
                for u in 0..l.units() {
                    assert_eq!(
                        packed_unit(ty, column, row % GROUP, u),
                        unit(ty, block, u),
                        "{ty} row {row} column {c} unit {u}"
                    );
                }
            }
        }
    }
}

/// Several products of one row in one section give each product's bits alone: matrices
/// of several formats and sizes (tiles cut short, one smaller than a tile), run by a team
/// of two threads so the section's tasks spread over both.
#[test]
fn products_in_one_section_equal_each_alone() {
    let cols = 256;
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 7 % 23) as f32 - 11.0) / 5.0)
        .collect();
    let mut q = Q8Acts::default();
    q.quantize(&x, cols);
    let mats: Vec<PackedMatrix> = [
        (GgmlType::Q4_1, 70),
        (GgmlType::Q8_0, 9),
        (GgmlType::Q4_K, 96),
    ]
    .iter()
    .map(|&(ty, rows)| {
        let data = quantize(ty, &weights(rows * cols)).unwrap();
        PackedMatrix::pack(&WeightMatrix::new(ty, rows, cols, &data).unwrap()).unwrap()
    })
    .collect();
    let alone: Vec<Vec<f32>> = mats
        .iter()
        .map(|p| {
            let mut y = vec![0f32; p.rows];
            matmul_packed(p, &q, &mut y);
            y
        })
        .collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let (mut a, mut b, mut c) = (vec![f32::NAN; 70], vec![f32::NAN; 9], vec![f32::NAN; 96]);
    pool.install(|| {
        crate::team::with_team(|| {
            matvec_packed_many(
                [&mats[0], &mats[1], &mats[2]],
                &q,
                [&mut a[..], &mut b[..], &mut c[..]],
            )
        })
    });
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for (got, want) in [a, b, c].iter().zip(&alone) {
        assert_eq!(bits(got), bits(want));
    }
}

#[test]
fn packed_products_equal_the_reference_on_the_original_rows() {
    let (rows, cols) = (7, 512);
    let wf = weights(rows * cols);
    // 9 tokens: two calls of the four-token kernel and one single-token call.
    let n = 9;
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 11 % 19) as f32 - 9.0) / 3.0)
        .collect();
    let mut acts = Q8Acts::default();
    acts.quantize(&x, cols);
    for ty in FORMATS {
        let data = quantize(ty, &wf).unwrap();
        let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
        let p = PackedMatrix::pack(&w).unwrap();
        let mut y = vec![0f32; n * rows];
        matmul_packed(&p, &acts, &mut y);
        for t in 0..n {
            // One token alone takes the single-token path.
            let mut one = Q8Acts::default();
            one.quantize(&x[t * cols..(t + 1) * cols], cols);
            let mut yv = vec![0f32; rows];
            matmul_packed(&p, &one, &mut yv);
            let mut o = [0f32; GROUP];
            dot_group_scalar(ty, p.group(0), acts.row(t), &mut o);
            for r in 0..rows {
                let want = scalar::dot_q8(ty, w.row(r), acts.row(t));
                // Same integer sums; the f32 sums of the 16 scaled unit sums differ in order
                // (and Q4_0/Q5_0 apply their -8d/-16d through s): a few ulps of the unit
                // magnitudes, which stay below 1e-5 relative here.
                let tol = 1e-5 * (1.0 + want.abs()) * cols as f32 / 32.0;
                for (what, got) in [
                    ("matmul", y[t * rows + r]),
                    ("matvec", yv[r]),
                    ("scalar", o[r]),
                ] {
                    assert!(
                        (got - want).abs() <= tol,
                        "{ty} {what} t{t} r{r}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// However many tokens one product takes (sixteen per call, then one call of one to
/// fifteen), every token gets the bits of its one-token product, for every format and for 15-bit
/// activations: a verification pass must score its rows exactly as decode steps would.
#[test]
fn every_token_count_gives_the_one_token_bits() {
    let (rows, cols) = (13, 512);
    let wf = weights(rows * cols);
    let x: Vec<f32> = (0..33 * cols)
        .map(|i| ((i * 11 % 19) as f32 - 9.0) / 3.0 + (i % 5) as f32 * 0.01)
        .collect();
    let pack = |ty| {
        let data = quantize(ty, &wf).unwrap();
        PackedMatrix::pack(&WeightMatrix::new(ty, rows, cols, &data).unwrap()).unwrap()
    };
    // Every tail length before the first whole call, and either side of one and two.
    for n in (1..=17).chain([31, 32, 33]) {
        let x = &x[..n * cols];
        for ty in FORMATS {
            same_bits_as_one_token(&pack(ty), x, cols, Q8Acts::quantize, &format!("{ty}"));
        }
        same_bits_as_one_token(&pack(GgmlType::Q8_0), x, cols, WideActs::quantize, "wide");
    }
}

/// Asserts that every token of `x` (rows of `cols`), multiplied by `p` together with the
/// others, gets the bits of its product alone; `quantize` makes the activations.
fn same_bits_as_one_token<A: PackedActs + Default>(
    p: &PackedMatrix,
    x: &[f32],
    cols: usize,
    quantize: fn(&mut A, &[f32], usize),
    what: &str,
) {
    let (n, rows) = (x.len() / cols, p.rows);
    let bits = |y: &[f32]| y.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    let mut acts = A::default();
    quantize(&mut acts, x, cols);
    let mut y = vec![0f32; n * rows];
    matmul_packed(p, &acts, &mut y);
    for t in 0..n {
        let mut one = A::default();
        quantize(&mut one, &x[t * cols..(t + 1) * cols], cols);
        let mut yt = vec![0f32; rows];
        matmul_packed(p, &one, &mut yt);
        let got = bits(&y[t * rows..(t + 1) * rows]);
        assert_eq!(got, bits(&yt), "{what} n{n} t{t}");
    }
}

/// The two-token kernels give every token the same bits as the one-token kernel (so a
/// sequence's logits do not depend on the batch), for every format they take, with an odd
/// token count, several calls' worth of pairs and a padded last group.
#[test]
fn pair_products_equal_one_token_products_bit_for_bit() {
    let isa = kernels::detect();
    let (rows, cols) = (21, 512);
    let wf = weights(rows * cols);
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
    ] {
        if !kernels::pairs_available(isa, ty) {
            eprintln!("skipping {ty}: no AVX-512 VNNI here");
            continue;
        }
        let data = crate::quant::quantize(ty, &wf).unwrap();
        let p = PackedMatrix::pack(&WeightMatrix::new(ty, rows, cols, &data).unwrap()).unwrap();
        // Odd n runs a tail token; pair counts cover every call split (1..=4, 4 + 1..=3,
        // 8 + rest).
        for n in [2, 3, 5, 6, 7, 9, 11, 14, 15, 16, 17, 19, 26] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 7 % 23) as f32 - 11.0) / 5.0 + (i % 3) as f32 * 0.1)
                .collect();
            let mut q = Q8Acts::default();
            q.quantize(&x, cols);
            let mut y = vec![0f32; n * rows];
            matmul_packed(&p, &q, &mut y);
            for t in 0..n {
                let mut one = Q8Acts::default();
                one.quantize(&x[t * cols..(t + 1) * cols], cols);
                let mut yt = vec![0f32; rows];
                matmul_packed(&p, &one, &mut yt);
                let got = &y[t * rows..(t + 1) * rows];
                assert!(
                    got.iter().zip(&yt).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{ty} n={n} token {t}: {got:?} vs {yt:?}"
                );
            }
        }
    }
}

/// The same for the two-token 15-bit kernel against Q8_0 rows (the output head).
#[test]
fn wide_pair_products_equal_one_token_products_bit_for_bit() {
    if !matches!(kernels::detect(), kernels::Isa::Avx512Vnni(_)) {
        eprintln!("skipping: no AVX-512 VNNI here");
        return;
    }
    let (rows, cols) = (19, 256);
    let wf = weights(rows * cols);
    let data = crate::quant::quantize(GgmlType::Q8_0, &wf).unwrap();
    let p =
        PackedMatrix::pack(&WeightMatrix::new(GgmlType::Q8_0, rows, cols, &data).unwrap()).unwrap();
    for n in [2, 3, 5, 7, 10, 11, 15, 17] {
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 13 % 29) as f32 - 14.0) / 4.0 + (i % 5) as f32 * 0.03)
            .collect();
        let mut q = WideActs::default();
        q.quantize(&x, cols);
        let mut y = vec![0f32; n * rows];
        matmul_packed(&p, &q, &mut y);
        for t in 0..n {
            let mut one = WideActs::default();
            one.quantize(&x[t * cols..(t + 1) * cols], cols);
            let mut yt = vec![0f32; rows];
            matmul_packed(&p, &one, &mut yt);
            let got = &y[t * rows..(t + 1) * rows];
            assert!(
                got.iter().zip(&yt).all(|(a, b)| a.to_bits() == b.to_bits()),
                "n={n} token {t}"
            );
        }
    }
}

/// Under llama.cpp's Q8_K activations (one scale per 256, negative when the largest value is
/// positive), every format's packed product is the exact sum of the decoded weights times the
/// decoded activations: the integer kernels take the super-block scale like any block scale.
/// Tolerance as above: f32 sums of f32 products, 1e-5 relative per block of 32.
#[test]
fn super_block_products_equal_the_decoded_sum() {
    let (rows, cols, n) = (9, 512, 5);
    let wf = weights(rows * cols);
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 29 % 31) as f32 - 15.0) / 4.0 + (i % 5) as f32 * 0.03)
        .collect();
    let mut acts = Q8Acts::default();
    acts.quantize_super_blocks(&x, cols);
    for ty in FORMATS {
        let data = quantize(ty, &wf).unwrap();
        let w = WeightMatrix::new(ty, rows, cols, &data).unwrap();
        let p = PackedMatrix::pack(&w).unwrap();
        let deq = crate::quant::dequantize_to_vec(ty, &data, rows * cols).unwrap();
        let mut y = vec![0f32; n * rows];
        matmul_packed(&p, &acts, &mut y);
        for t in 0..n {
            let row = acts.row(t);
            let mut yv = vec![0f32; rows];
            let mut one = Q8Acts::default();
            one.quantize_super_blocks(&x[t * cols..(t + 1) * cols], cols);
            matmul_packed(&p, &one, &mut yv);
            for r in 0..rows {
                let (mut exact, mut mag) = (0f64, 0f64);
                for e in 0..cols {
                    let xv = f64::from(row.qs[e]) * f64::from(row.d[e / 32]);
                    exact += f64::from(deq[r * cols + e]) * xv;
                    mag += (f64::from(deq[r * cols + e]) * xv).abs();
                }
                let tol = 1e-5 * (1.0 + mag);
                for (what, got) in [("matmul", y[t * rows + r]), ("matvec", yv[r])] {
                    assert!(
                        (f64::from(got) - exact).abs() <= tol,
                        "{ty} {what} t{t} r{r}: {got} vs {exact}"
                    );
                }
            }
        }
    }
}
