//! Tests: every available kernel against the plain-loop references, on odd
//! shapes, transposed and strided views, with and without accumulation.
//!
//! Tolerances (u = 2⁻²⁴, the f32 unit roundoff; `f32::EPSILON` = 2u):
//! - F32 vs the f64-accumulated reference: a k-term f32 dot product (FMA or
//!   not, any order) is within γ_k·S of the exact value, γ_k ≈ k·u, with
//!   S = Σ|a_i·b_i|; adding the old c and the reference's final rounding cost
//!   two more roundings. We allow (k+2)·EPSILON·(S+|c₀|) = 2× that bound.
//! - Bf16 vs the bf16 reference: after rounding the inputs are identical and
//!   every bf16·bf16 product is exact in f32 (8+8 significant bits ≤ 24), so
//!   both sides are f32 sums of the *same* terms in different orders
//!   (VDPBF16PS pairs, AMX's internal dot-product order, k blocks). Each is
//!   within γ_k·S of the exact sum, so they differ by ≤ 2γ_k·S; we allow
//!   2(k+2)·EPSILON·(S+|c₀|), again a 2× margin.
//! - AMX and VDPBF16PS treat denormal inputs as zero and flush denormal
//!   outputs; the generators below never produce values under 1e-3 in
//!   magnitude (other than 0), so no input, product or partial sum is
//!   denormal and this difference from the reference cannot show.

use super::driver::{Kernel, gemm};
use super::*;
use proptest::prelude::*;

/// A stored matrix and how to view it as rows×cols.
#[derive(Clone, Debug)]
struct Operand {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    /// Stored as its transpose (cols×rows) and viewed through `.t()`.
    transposed: bool,
    /// Leading-dimension padding (so views are genuinely strided).
    pad: usize,
}

impl Operand {
    fn view(&self) -> MatRef<'_> {
        if self.transposed {
            let ld = self.rows + self.pad;
            MatRef {
                data: &self.data,
                rows: self.cols,
                cols: self.rows,
                rs: ld,
                cs: 1,
            }
            .t()
        } else {
            let ld = self.cols + self.pad;
            MatRef {
                data: &self.data,
                rows: self.rows,
                cols: self.cols,
                rs: ld,
                cs: 1,
            }
        }
    }
}

/// Values in ±[1e-3, 2) or exactly 0: no denormals anywhere (see module doc).
fn value() -> impl Strategy<Value = f32> {
    (-2.0f32..2.0).prop_map(|x| if x.abs() < 1e-3 { 0.0 } else { x })
}

fn operand(rows: usize, cols: usize) -> impl Strategy<Value = Operand> {
    (any::<bool>(), 0usize..3).prop_flat_map(move |(transposed, pad)| {
        let outer = if transposed { cols } else { rows };
        let inner = if transposed { rows } else { cols };
        // The last stored row needs no padding beyond its elements.
        let len = outer.saturating_sub(1) * (inner + pad) + inner;
        proptest::collection::vec(value(), len).prop_map(move |data| Operand {
            data,
            rows,
            cols,
            transposed,
            pad,
        })
    })
}

/// (a, b, c0) for random shapes: mostly 1..70 per dimension, sometimes larger.
fn problem() -> impl Strategy<Value = (Operand, Operand, Vec<f32>)> {
    prop_oneof![
        4 => (1usize..70, 1usize..70, 1usize..70),
        1 => Just((130usize, 97usize, 300usize)),
        1 => (250usize..300, 1usize..40, 500usize..600),
    ]
    .prop_flat_map(|(m, n, k)| {
        (
            operand(m, k),
            operand(k, n),
            proptest::collection::vec(value(), m * n),
        )
    })
}

/// Σ|a||b| per output element (inputs optionally rounded to bf16).
fn abs_sums(a: MatRef, b: MatRef, bf16: bool) -> Vec<f32> {
    let r = |x: f32| if bf16 { round_bf16(x) } else { x };
    let mut s = vec![0.0f32; a.rows * b.cols];
    for i in 0..a.rows {
        for j in 0..b.cols {
            s[i * b.cols + j] = (0..a.cols)
                .map(|p| (r(a.at(i, p)) * r(b.at(p, j))).abs())
                .sum();
        }
    }
    s
}

fn check_close(
    got: &[f32],
    want: &[f32],
    sums: &[f32],
    c0: &[f32],
    k: usize,
    factor: f32,
    what: &str,
) {
    for (idx, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = factor * (k + 2) as f32 * f32::EPSILON * (sums[idx] + c0[idx].abs()) + 1e-30;
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {idx}: got {g}, want {w}, tol {tol}"
        );
    }
}

/// Runs `f(c)` on a copy of `c0`, parallel and not, asserting both agree
/// bit for bit (determinism across thread counts); returns the result.
fn run_both(c0: &[f32], f: impl Fn(&mut [f32], bool) + Sync) -> Vec<f32> {
    let mut serial = c0.to_vec();
    f(&mut serial, false);
    let mut par = c0.to_vec();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    pool.install(|| f(&mut par, true));
    assert!(
        serial
            .iter()
            .zip(&par)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "serial and parallel results differ"
    );
    serial
}

/// The f32 kernels of every level this CPU runs (the levels skipped are printed).
fn available_f32() -> Vec<F32Backend> {
    let mut v: Vec<F32Backend> = frugal::cpu::levels_for_tests()
        .into_iter()
        .map(super::f32_backend_at)
        .collect();
    v.dedup();
    v
}

/// The bf16 kernels this CPU runs: each f32 kernel emulating bf16, and the bf16 hardware's.
fn available_bf16() -> Vec<Bf16Backend> {
    let mut v: Vec<Bf16Backend> = available_f32()
        .into_iter()
        .map(Bf16Backend::Emulated)
        .collect();
    if !cfg!(target_arch = "x86_64") {
        return v;
    }
    if let Some(t) = frugal::cpu::token_for_test::<frugal::cpu::Avx512Bf16>("the AVX-512 BF16 GEMM")
    {
        v.push(Bf16Backend::Avx512Bf16(t));
    }
    if let Some(t) = frugal::cpu::token_for_test::<frugal::cpu::Amx>("the AMX GEMM") {
        v.push(Bf16Backend::Amx(t));
    }
    v
}

/// Checks a bf16 kernel type directly through the driver (for scalar twins).
#[allow(clippy::too_many_arguments)]
fn check_bf16_kernel<K: Kernel>(
    kern: &K,
    a: MatRef,
    b: MatRef,
    c0: &[f32],
    acc: bool,
    want: &[f32],
    sums: &[f32],
    name: &str,
) {
    let got = run_both(c0, |c, par| gemm(kern, a, b, c, acc, par));
    check_close(&got, want, sums, c0, a.cols, 2.0, name);
}

proptest! {
    // 48 cases per property: each case runs every available kernel twice (serial and
    // parallel), which keeps an unoptimised `cargo test` near 30 s on 2 cores.
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn f32_matches_reference((a, b, c0) in problem(), acc in any::<bool>()) {
        let (av, bv) = (a.view(), b.view());
        let mut want = c0.clone();
        matmul_f32_reference(av, bv, &mut want, acc);
        let sums = abs_sums(av, bv, false);
        let zero = vec![0.0; c0.len()];
        let c0_used = if acc { &c0 } else { &zero };
        for be in available_f32() {
            let got = run_both(&c0, |c, par| run_f32(be, av, bv, c, acc, par, false));
            check_close(&got, &want, &sums, c0_used, av.cols, 1.0, &format!("{be:?}"));
        }
        let mut got = c0.clone();
        matmul(av, bv, &mut got, acc, Precision::F32);
        check_close(&got, &want, &sums, c0_used, av.cols, 1.0, "matmul");
    }

    #[test]
    fn bf16_matches_reference((a, b, c0) in problem(), acc in any::<bool>()) {
        let (av, bv) = (a.view(), b.view());
        let mut want = c0.clone();
        matmul_bf16_reference(av, bv, &mut want, acc);
        let sums = abs_sums(av, bv, true);
        let zero = vec![0.0; c0.len()];
        let c0_used = if acc { &c0 } else { &zero };
        for be in available_bf16() {
            let got = run_both(&c0, |c, par| run_bf16(be, av, bv, c, acc, par));
            check_close(&got, &want, &sums, c0_used, av.cols, 2.0, &format!("{be:?}"));
        }
        check_bf16_kernel(&amx::AmxScalar, av, bv, &c0, acc, &want, &sums, "AmxScalar");
        check_bf16_kernel(&bf16k::Bf16PairsScalar, av, bv, &c0, acc, &want, &sums, "Bf16PairsScalar");
        let mut got = c0.clone();
        matmul(av, bv, &mut got, acc, Precision::Bf16);
        check_close(&got, &want, &sums, c0_used, av.cols, 2.0, "matmul");
    }
}

#[test]
fn wide_n_crosses_nc_blocks() {
    // n > NC (4096) exercises the jc loop; k > KC the pc loop.
    let (m, n, k) = (5, 4200, 600);
    let mut a = vec![0.0; m * k];
    let mut b = vec![0.0; k * n];
    bench::fill_pseudo_random(&mut a, 7);
    bench::fill_pseudo_random(&mut b, 8);
    let (av, bv) = (MatRef::new(&a, m, k), MatRef::new(&b, k, n));
    let sums_f = abs_sums(av, bv, false);
    let sums_b = abs_sums(av, bv, true);
    let zero = vec![0.0; m * n];
    for (p, sums, factor) in [
        (Precision::F32, &sums_f, 1.0),
        (Precision::Bf16, &sums_b, 2.0),
    ] {
        let mut want = zero.clone();
        match p {
            Precision::F32 => matmul_f32_reference(av, bv, &mut want, false),
            Precision::Bf16 => matmul_bf16_reference(av, bv, &mut want, false),
        }
        let mut got = vec![f32::NAN; m * n]; // overwritten, never read
        matmul(av, bv, &mut got, false, p);
        check_close(&got, &want, sums, &zero, k, factor, &format!("{p:?}"));
    }
}

#[test]
fn deterministic_run_to_run_and_across_threads() {
    let (m, n, k) = (300, 200, 700);
    let mut a = vec![0.0; m * k];
    let mut b = vec![0.0; n * k];
    bench::fill_pseudo_random(&mut a, 3);
    bench::fill_pseudo_random(&mut b, 4);
    let (av, bv) = (MatRef::new(&a, m, k), MatRef::new(&b, n, k).t());
    for p in [Precision::F32, Precision::Bf16] {
        let mut results = Vec::new();
        for threads in [1, 2, 2, 1, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut c = vec![0.0; m * n];
            pool.install(|| matmul(av, bv, &mut c, false, p));
            results.push(c);
        }
        for r in &results[1..] {
            assert!(
                r.iter()
                    .zip(&results[0])
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{p:?} not deterministic"
            );
        }
    }
}

#[test]
fn empty_and_k_zero() {
    let a: Vec<f32> = vec![];
    let mut c = vec![5.0; 6];
    matmul(
        MatRef::new(&a, 2, 0),
        MatRef::new(&a, 0, 3),
        &mut c,
        true,
        Precision::Bf16,
    );
    assert_eq!(c, vec![5.0; 6]);
    matmul(
        MatRef::new(&a, 2, 0),
        MatRef::new(&a, 0, 3),
        &mut c,
        false,
        Precision::F32,
    );
    assert_eq!(c, vec![0.0; 6]);
    let mut none: Vec<f32> = vec![];
    matmul(
        MatRef::new(&a, 0, 4),
        MatRef::new(&[1.0; 8], 4, 2),
        &mut none,
        false,
        Precision::F32,
    );
}

#[test]
#[should_panic(expected = "exceeds its slice")]
fn out_of_bounds_view_panics() {
    let a = vec![1.0; 5];
    let b = vec![1.0; 4];
    let mut c = vec![0.0; 4];
    matmul(
        MatRef::new(&a, 2, 3),
        MatRef::new(&b, 3, 2),
        &mut c,
        false,
        Precision::F32,
    );
}

#[test]
fn bf16_rounding_is_nearest_even() {
    assert_eq!(f32_to_bf16_bits(1.0), 0x3F80);
    // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even (1.0).
    assert_eq!(f32_to_bf16_bits(1.0 + 1.0 / 256.0), 0x3F80);
    // 1 + 3·2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even).
    assert_eq!(f32_to_bf16_bits(1.0 + 3.0 / 256.0), 0x3F82);
    assert_eq!(f32_to_bf16_bits(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 0x3F81);
    assert!(round_bf16(f32::NAN).is_nan());
    assert_eq!(round_bf16(f32::INFINITY), f32::INFINITY);
    assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
}

#[test]
fn backend_name() {
    let name = bf16_backend();
    assert!(["amx-bf16", "avx512-bf16", "f32 (no bf16 hardware)"].contains(&name));
    println!("bf16 backend: {name}");
}

/// `cargo test --release -- --ignored --nocapture bench_training_shapes`
#[test]
#[ignore]
fn bench_training_shapes() {
    // (label, m, n, k, a transposed, b transposed)
    let shapes = [
        ("fwd 2048x576x576 (X·Wᵀ)", 2048, 576, 576, false, true),
        ("fwd 2048x1536x576", 2048, 1536, 576, false, true),
        ("fwd 2048x576x1536", 2048, 576, 1536, false, true),
        ("fwd 2048x49152x576 (logits)", 2048, 49152, 576, false, true),
        ("dX 2048x576x1536 (dY·W)", 2048, 576, 1536, false, false),
        ("dW 576x576 k=2048 (dYᵀ·X)", 576, 576, 2048, true, false),
        ("dW 1536x576 k=2048", 1536, 576, 2048, true, false),
        ("attn 512x512x64", 512, 512, 64, false, true),
        ("attn 64x512x512", 64, 512, 512, false, false),
        ("square 2048^3", 2048, 2048, 2048, false, false),
    ];
    println!("bf16 backend: {}", bf16_backend());
    for threads in [1, 2] {
        println!(
            "threads={threads}: register peak F32 {:.0} GFLOP/s, Bf16 {:.0} GFLOP/s",
            register_peak_gflops(Precision::F32, threads),
            register_peak_gflops(Precision::Bf16, threads)
        );
        for &(label, m, n, k, at, bt) in &shapes {
            let reps = if n > 10000 { 1 } else { 3 };
            let f = bench::time_gflops(m, n, k, at, bt, Precision::F32, threads, reps);
            let b = bench::time_gflops(m, n, k, at, bt, Precision::Bf16, threads, reps);
            println!("  {label:32} F32 {f:7.1}  Bf16 {b:7.1} GFLOP/s");
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// Thread CPU seconds (immune to other processes sharing the cores).
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn bench_kernels_in_cache() {
    fn time_kernel<K: Kernel>(k: &K, kp: usize, name: &str) {
        // Non-zero data: AMX runs measurably faster on all-zero tiles.
        let mut src = vec![0.0f32; (K::MR + K::NR) * kp];
        bench::fill_pseudo_random(&mut src, 5);
        // SAFETY: K::E is f32 or u16, for which all-zero bits are valid.
        let zero: K::E = unsafe { std::mem::zeroed() };
        let mut ap = vec![zero; K::MR * kp];
        let mut bp = vec![zero; K::NR * kp];
        let sv = MatRef::new(&src, K::MR + K::NR, kp);
        k.pack_a(sv, 0, K::MR, 0, kp, &mut ap);
        k.pack_b(sv.t(), 0, kp, K::MR, K::NR, &mut bp);
        let mut c = vec![0.0f32; K::MR * K::NR];
        k.task_begin();
        let reps = 20000;
        let t = thread_cpu_secs();
        for _ in 0..reps {
            // SAFETY: the panels are MR x kp and NR x kp, C is MR x NR at stride NR, and task_begin ran.
            unsafe { k.micro(kp, ap.as_ptr(), bp.as_ptr(), c.as_mut_ptr(), K::NR, true) };
        }
        let s = thread_cpu_secs() - t;
        k.task_end();
        println!(
            "{name}: {:.1} GFLOP/s (cpu time)",
            2.0 * (K::MR * K::NR * kp * reps) as f64 / s / 1e9
        );
    }
    println!(
        "register peak f32 {:.0}, bf16 {:.0} (wall)",
        register_peak_gflops(Precision::F32, 1),
        register_peak_gflops(Precision::Bf16, 1)
    );
    use frugal::cpu;
    if let Some(t) = cpu::token_for_test::<cpu::Avx512>("the AVX-512 kernel timings") {
        time_kernel(
            &f32k::F32Avx512 { round: false, t },
            256,
            "f32 avx512 kp=256",
        );
        time_kernel(&f32k::F32Avx512 { round: false, t }, 64, "f32 avx512 kp=64");
    }
    if let Some(t) = cpu::token_for_test::<cpu::Avx512Bf16>("the AVX-512 BF16 kernel timing") {
        time_kernel(&bf16k::Avx512Bf16::new(t), 512, "avx512bf16 kp=512");
    }
    if let Some(t) = cpu::token_for_test::<cpu::Amx>("the AMX kernel timings") {
        time_kernel(&amx::Amx::new(t), 512, "amx kp=512");
        time_kernel(&amx::Amx::new(t), 128, "amx kp=128");
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn bench_packing() {
    let m: usize = std::env::var("PACK_M")
        .map(|v| v.parse().unwrap())
        .unwrap_or(2048);
    let k = 576;
    let mut a = vec![0.0f32; m * k];
    bench::fill_pseudo_random(&mut a, 1);
    let av = MatRef::new(&a, m, k);
    let mut dst = vec![0.0f32; 144 * 256];
    let mut dst16 = vec![0u16; 256 * 512];
    for (name, w, rows) in [("A f32 w=12", 12usize, 144usize), ("B f32 w=32", 32, 576)] {
        let mut d = vec![0.0f32; rows.next_multiple_of(w) * 256];
        let t = thread_cpu_secs();
        let mut n = 0;
        for _ in 0..5 {
            for r0 in (0..m).step_by(rows) {
                for k0 in (0..k).step_by(256) {
                    let rl = rows.min(m - r0);
                    let kl = 256.min(k - k0);
                    pack::pack_f32(av, r0, rl, k0, kl, w, &mut d, false);
                    n += rl * kl;
                }
            }
        }
        let s = thread_cpu_secs() - t;
        println!("{name}: {:.2} ns/element", s * 1e9 / n as f64);
    }
    let _ = (&mut dst, &mut dst16);
}

/// Training-step shapes for the bf16 path, timed per shape: 1 thread by the
/// worker's thread CPU time (immune to other load), 2 threads by wall time,
/// best of many repetitions. `BENCH_PREC=f32` times the f32 path instead;
/// `BENCH_THREADS=1` / `=2` picks one thread count.
/// `cargo test --release --lib bench_step_shapes -- --ignored --nocapture`
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn bench_step_shapes() {
    // (label, m, n, k, a transposed, b transposed)
    let shapes: &[(&str, usize, usize, usize, bool, bool)] = &[
        ("fwd 2048x576x576", 2048, 576, 576, false, true),
        ("fwd 2048x1536x576", 2048, 1536, 576, false, true),
        ("fwd 2048x576x1536", 2048, 576, 1536, false, true),
        ("fwd head 256x49152x576", 256, 49152, 576, false, true),
        ("dX 2048x576x576", 2048, 576, 576, false, false),
        ("dX 2048x576x1536", 2048, 576, 1536, false, false),
        ("dX 2048x1536x576", 2048, 1536, 576, false, false),
        ("dX head 256x576x49152", 256, 576, 49152, false, false),
        ("dW 576x576x2048 (Aᵀ)", 576, 576, 2048, true, false),
        ("dW 1536x576x2048 (Aᵀ)", 1536, 576, 2048, true, false),
        ("dW 576x1536x2048 (Aᵀ)", 576, 1536, 2048, true, false),
        ("dW head 49152x576x256 (Aᵀ)", 49152, 576, 256, true, false),
        ("attn QKᵀ 512x512x64", 512, 512, 64, false, true),
        ("attn 128x512x64", 128, 512, 64, false, true),
        ("attn PV 512x64x512", 512, 64, 512, false, false),
        ("attn 128x64x512", 128, 64, 512, false, false),
        ("attn dV 512x64x512 (Aᵀ)", 512, 64, 512, true, false),
        ("attn dK 512x64x512 (Aᵀ,Bᵀ)", 512, 64, 512, true, true),
    ];
    let precision = match std::env::var("BENCH_PREC").as_deref() {
        Ok("f32") => Precision::F32,
        _ => Precision::Bf16,
    };
    let threads: Vec<usize> = match std::env::var("BENCH_THREADS").as_deref() {
        Ok("1") => vec![1],
        Ok("2") => vec![2],
        _ => vec![1, 2],
    };
    println!("precision {precision:?}, bf16 backend: {}", bf16_backend());
    for &t in &threads {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build()
            .unwrap();
        println!("threads={t}");
        let mut total_s = 0.0;
        for &(label, m, n, k, at, bt) in shapes {
            let mut a = vec![0.0f32; m * k];
            let mut b = vec![0.0f32; k * n];
            bench::fill_pseudo_random(&mut a, 1);
            bench::fill_pseudo_random(&mut b, 2);
            let mut c = vec![0.0f32; m * n];
            let av = if at {
                MatRef::new(&a, k, m).t()
            } else {
                MatRef::new(&a, m, k)
            };
            let bv = if bt {
                MatRef::new(&b, n, k).t()
            } else {
                MatRef::new(&b, k, n)
            };
            let flops = 2.0 * (m * n * k) as f64;
            let reps = ((2e10 / flops) as usize).clamp(3, 300);
            let best = pool.install(|| {
                matmul(av, bv, &mut c, false, precision);
                let mut best = f64::INFINITY;
                for _ in 0..reps {
                    let (w, cpu) = (std::time::Instant::now(), thread_cpu_secs());
                    matmul(av, bv, &mut c, false, precision);
                    let s = if t == 1 {
                        thread_cpu_secs() - cpu
                    } else {
                        w.elapsed().as_secs_f64()
                    };
                    best = best.min(s);
                }
                best
            });
            total_s += best;
            println!("  {label:30} {:8.1} GFLOP/s", flops / best / 1e9);
        }
        println!("  sum of best times: {:.2} ms", total_s * 1e3);
    }
}

/// The AVX-512 AMX packers against their scalar twins, bit for bit: every
/// stride case, partial panels and k steps, offsets, and special values
/// (NaN with payloads, ±inf, denormals, rounding ties, overflow to inf).
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_simd_packing_matches_scalar() {
    let test = "amx_simd_packing_matches_scalar";
    if frugal::cpu::token_for_test::<frugal::cpu::Avx512>(test).is_none() {
        return;
    }
    let specials = [
        f32::NAN,
        f32::from_bits(0x7F80_0001),
        f32::from_bits(0xFFC1_2345),
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
        f32::from_bits(1),
        f32::from_bits(0x8000_7FFF),
        f32::from_bits(0x0000_8000),
        -0.0,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::from_bits(0x3F80_8000),
        f32::from_bits(0x3F81_8000),
    ];
    let mut seed = 11u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize
    };
    let same = |x: &[u16], y: &[u16]| x == y;
    for case in 0..300 {
        let rows = 1 + next() % 80;
        let cols = 1 + next() % 100;
        let pad = next() % 3;
        let mut data = vec![0.0f32; (rows + pad) * (cols + pad) + 8];
        for (i, d) in data.iter_mut().enumerate() {
            *d = if next() % 7 == 0 {
                specials[i % specials.len()]
            } else {
                f32::from_bits(next() as u32 ^ ((next() as u32) << 17))
            };
        }
        // Row-major, column-major (transposed view), and a generic stride.
        let views = [
            MatRef {
                data: &data,
                rows,
                cols,
                rs: cols + pad,
                cs: 1,
            },
            MatRef {
                data: &data,
                rows,
                cols,
                rs: 1,
                cs: rows + pad,
            },
        ];
        for v in views {
            let r0 = next() % rows;
            let rlen = 1 + next() % (rows - r0);
            let k0 = next() % cols;
            let klen = 1 + next() % (cols - k0);
            let kp = klen.next_multiple_of(32);
            let len = rlen.div_ceil(32) * 32 * kp;
            let (mut x, mut y) = (vec![0xAAAAu16; len], vec![0x5555u16; len]);
            amx::pack_a_tiles_scalar(v, r0, rlen, k0, klen, &mut x);
            amx::AmxScalar.pack_a(v, r0, rlen, k0, klen, &mut y); // dispatches to SIMD
            assert!(
                same(&x, &y),
                "pack_a case {case}: {v:?} {r0} {rlen} {k0} {klen}"
            );
            // The same view as B (k × n = rows × cols).
            let (k0, klen, c0, clen) = (r0, rlen, k0, klen);
            let kp = klen.next_multiple_of(32);
            let len = clen.div_ceil(32) * 32 * kp;
            let (mut x, mut y) = (vec![0xAAAAu16; len], vec![0x5555u16; len]);
            amx::pack_b_tiles_scalar(v, k0, klen, c0, clen, &mut x);
            amx::AmxScalar.pack_b(v, k0, klen, c0, clen, &mut y); // dispatches to SIMD
            assert!(
                same(&x, &y),
                "pack_b case {case}: {v:?} {k0} {klen} {c0} {clen}"
            );
        }
    }
}

/// Long k with few rows: A is too big to pack whole but is shared per K
/// block (`APacking::PerBlock`) when parallel; must match the reference and
/// the serial (per-task packing) result bit for bit.
#[test]
fn shared_a_per_k_block() {
    let (m, n, k) = (40, 100, 110_000);
    let mut a = vec![0.0; m * k];
    let mut b = vec![0.0; k * n];
    bench::fill_pseudo_random(&mut a, 9);
    bench::fill_pseudo_random(&mut b, 10);
    let (av, bv) = (MatRef::new(&a, m, k), MatRef::new(&b, n, k).t());
    let zero = vec![0.0; m * n];
    let sums = abs_sums(av, bv, true);
    let mut want = zero.clone();
    matmul_bf16_reference(av, bv, &mut want, false);
    for be in available_bf16() {
        let got = run_both(&zero, |c, par| run_bf16(be, av, bv, c, false, par));
        check_close(&got, &want, &sums, &zero, k, 2.0, &format!("{be:?}"));
    }
    let sums = abs_sums(av, bv, false);
    let mut want = zero.clone();
    matmul_f32_reference(av, bv, &mut want, false);
    for be in available_f32() {
        let got = run_both(&zero, |c, par| run_f32(be, av, bv, c, false, par, false));
        check_close(&got, &want, &sums, &zero, k, 1.0, &format!("{be:?}"));
    }
}
