use frugal::quant::act::Q8Acts;
use frugal::quant::packed::{PackedMatrix, matmul_packed};
use frugal::quant::sparse_matrix::{SparseMatrix, matmul_sparse};
use frugal::quant::{GgmlType, WeightMatrix, quantize};
use std::time::Instant;

fn main() {
    let (rows, cols) = (1536usize, 576usize);
    let mut w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 300.0).collect();
    for g in w.chunks_exact_mut(4) { g[1] = 0.0; g[3] = 0.0; }
    for n in [1usize, 64] {
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31 % 97) as f32 - 48.0) / 20.0).collect();
        let mut a = Q8Acts::default();
        a.quantize(&x, cols);
        let mut y = vec![0f32; n * rows];
        let variants = [(GgmlType::Q8_0, false), (GgmlType::Q8_0_24, true), (GgmlType::Q8_0, true), (GgmlType::Q4_0, false), (GgmlType::Q4_0_24, true)];
        let mats: Vec<(Option<PackedMatrix>, Option<SparseMatrix>)> = variants.iter().map(|&(ty, sparse)| {
            let data = quantize(ty, &w).unwrap();
            let wm = WeightMatrix::new(ty, rows, cols, &data).unwrap();
            if sparse { (None, Some(SparseMatrix::pack(&wm).unwrap())) } else { (Some(PackedMatrix::pack(&wm).unwrap()), None) }
        }).collect();
        let mut best = vec![f64::MAX; variants.len()];
        let reps = if n == 1 { 200 } else { 5 };
        for _round in 0..40 {
            for (i, m) in mats.iter().enumerate() {
                let t0 = Instant::now();
                for _ in 0..reps {
                    match m { (Some(p), _) => matmul_packed(p, &a, &mut y), (_, Some(s)) => matmul_sparse(s, &a, &mut y), _ => {} }
                }
                best[i] = best[i].min(t0.elapsed().as_secs_f64() / reps as f64);
            }
        }
        for (i, &(ty, sparse)) in variants.iter().enumerate() {
            println!("n={n} {ty} sparse={sparse}: {:.1} us (min)", best[i] * 1e6);
        }
    }
}
