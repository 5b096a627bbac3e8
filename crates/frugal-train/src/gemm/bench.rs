//! Throughput measurements: [`peak_gflops`] times a large product; the
//! register-resident loops give the machine's arithmetic ceiling to compare.

use super::{MatRef, Precision, matmul};
use std::time::Instant;

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .expect("building a rayon pool")
}

/// Deterministic pseudo-random values in [-1, 1).
pub(crate) fn fill_pseudo_random(v: &mut [f32], seed: u64) {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    for x in v {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *x = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
    }
}

/// GFLOP/s (2 per multiply-add) of `c(m×n) = a·b` with k inner, best of
/// `reps` after one warm-up, on a pool of `threads`. `a_t` / `b_t`: the
/// operand is given as a transposed view (stored k×m / n×k).
#[allow(clippy::too_many_arguments)]
pub(crate) fn time_gflops(
    m: usize,
    n: usize,
    k: usize,
    a_t: bool,
    b_t: bool,
    precision: Precision,
    threads: usize,
    reps: usize,
) -> f64 {
    let mut a = vec![0.0f32; m * k];
    let mut b = vec![0.0f32; k * n];
    fill_pseudo_random(&mut a, 1);
    fill_pseudo_random(&mut b, 2);
    let mut c = vec![0.0f32; m * n];
    let av = if a_t {
        MatRef::new(&a, k, m).t()
    } else {
        MatRef::new(&a, m, k)
    };
    let bv = if b_t {
        MatRef::new(&b, n, k).t()
    } else {
        MatRef::new(&b, k, n)
    };
    let pool = pool(threads);
    pool.install(|| {
        matmul(av, bv, &mut c, false, precision);
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            matmul(av, bv, &mut c, false, precision);
            best = best.min(t.elapsed().as_secs_f64());
        }
        2.0 * (m * n * k) as f64 / best / 1e9
    })
}

/// GFLOP/s of a 2048×2048×2048 product (best of 3) at `precision` on
/// `threads` threads: the project's "matrix-multiply peak".
pub fn peak_gflops(precision: Precision, threads: usize) -> f64 {
    time_gflops(2048, 2048, 2048, false, false, precision, threads, 3)
}

/// GFLOP/s of a register-resident loop of the instruction the kernels are
/// built on (`VFMADD231PS zmm` for F32, `TDPBF16PS` for Bf16 where AMX is
/// available, else `VDPBF16PS`/FMA), on `threads` threads: the ceiling that
/// [`peak_gflops`] can be compared with. Returns 0.0 where no SIMD loop exists.
pub fn register_peak_gflops(precision: Precision, threads: usize) -> f64 {
    let pool = pool(threads);
    let run = |iters: usize| -> (f64, f64) {
        let t = Instant::now();
        let flops: Vec<f64> = pool.broadcast(|_| one_thread_loop(precision, iters));
        (flops.iter().sum::<f64>(), t.elapsed().as_secs_f64())
    };
    run(1000);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let (flops, secs) = run(2_000_000);
        best = best.max(flops / secs / 1e9);
    }
    best
}

/// Runs one thread's loop; returns the FLOPs it did.
fn one_thread_loop(precision: Precision, iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        use frugal::cpu;
        if precision == Precision::Bf16
            && let Some(t) = cpu::Amx::get()
        {
            // 4 × TDPBF16PS of 16×16×32 multiply-adds per iteration; fewer
            // iterations since each is ~16× longer than an FMA block.
            let it = iters / 8;
            super::amx::amx_register_loop(t, it);
            return it as f64 * 4.0 * 16.0 * 16.0 * 32.0 * 2.0;
        }
        if let Some(t) = cpu::Avx512::get() {
            let bf16 = cpu::Avx512Bf16::get().filter(|_| precision == Precision::Bf16);
            // SAFETY: the tokens prove the loop's features.
            unsafe { zmm_register_loop(t, iters, bf16) };
            // 24 instructions × 16 lanes × (1 FMA or 2 bf16 multiply-adds).
            return iters as f64 * 24.0 * 16.0 * 2.0 * if bf16.is_some() { 2.0 } else { 1.0 };
        }
    }
    let _ = (precision, iters);
    0.0
}

/// 24 independent accumulator chains of `VFMADD231PS` (or `VDPBF16PS`) on
/// zeroed registers, `iters` times (`VDPBF16PS` where `bf16` holds its token).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn zmm_register_loop(_: frugal::cpu::Avx512, iters: usize, bf16: Option<frugal::cpu::Avx512Bf16>) {
    macro_rules! body {
        ($op:literal) => {
            // SAFETY: register-only arithmetic (the tokens prove the instructions); every zmm
            // written is declared clobbered.
            unsafe {
                std::arch::asm!(
                    "vpxord zmm30, zmm30, zmm30",
                    "vpxord zmm31, zmm31, zmm31",
                    "vpxord zmm0, zmm0, zmm0",
                    "vpxord zmm1, zmm1, zmm1",
                    "vpxord zmm2, zmm2, zmm2",
                    "vpxord zmm3, zmm3, zmm3",
                    "vpxord zmm4, zmm4, zmm4",
                    "vpxord zmm5, zmm5, zmm5",
                    "vpxord zmm6, zmm6, zmm6",
                    "vpxord zmm7, zmm7, zmm7",
                    "vpxord zmm8, zmm8, zmm8",
                    "vpxord zmm9, zmm9, zmm9",
                    "vpxord zmm10, zmm10, zmm10",
                    "vpxord zmm11, zmm11, zmm11",
                    "vpxord zmm12, zmm12, zmm12",
                    "vpxord zmm13, zmm13, zmm13",
                    "vpxord zmm14, zmm14, zmm14",
                    "vpxord zmm15, zmm15, zmm15",
                    "vpxord zmm16, zmm16, zmm16",
                    "vpxord zmm17, zmm17, zmm17",
                    "vpxord zmm18, zmm18, zmm18",
                    "vpxord zmm19, zmm19, zmm19",
                    "vpxord zmm20, zmm20, zmm20",
                    "vpxord zmm21, zmm21, zmm21",
                    "vpxord zmm22, zmm22, zmm22",
                    "vpxord zmm23, zmm23, zmm23",
                    "2:",
                    concat!($op, " zmm0, zmm30, zmm31"), concat!($op, " zmm1, zmm30, zmm31"),
                    concat!($op, " zmm2, zmm30, zmm31"), concat!($op, " zmm3, zmm30, zmm31"),
                    concat!($op, " zmm4, zmm30, zmm31"), concat!($op, " zmm5, zmm30, zmm31"),
                    concat!($op, " zmm6, zmm30, zmm31"), concat!($op, " zmm7, zmm30, zmm31"),
                    concat!($op, " zmm8, zmm30, zmm31"), concat!($op, " zmm9, zmm30, zmm31"),
                    concat!($op, " zmm10, zmm30, zmm31"), concat!($op, " zmm11, zmm30, zmm31"),
                    concat!($op, " zmm12, zmm30, zmm31"), concat!($op, " zmm13, zmm30, zmm31"),
                    concat!($op, " zmm14, zmm30, zmm31"), concat!($op, " zmm15, zmm30, zmm31"),
                    concat!($op, " zmm16, zmm30, zmm31"), concat!($op, " zmm17, zmm30, zmm31"),
                    concat!($op, " zmm18, zmm30, zmm31"), concat!($op, " zmm19, zmm30, zmm31"),
                    concat!($op, " zmm20, zmm30, zmm31"), concat!($op, " zmm21, zmm30, zmm31"),
                    concat!($op, " zmm22, zmm30, zmm31"), concat!($op, " zmm23, zmm30, zmm31"),
                    "dec {n}",
                    "jnz 2b",
                    n = inout(reg) iters.max(1) => _,
                    out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                    out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                    out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                    out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                    out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                    out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                    out("zmm30") _, out("zmm31") _,
                    options(nostack, nomem),
                )
            }
        };
    }
    if bf16.is_some() {
        body!("vdpbf16ps");
    } else {
        body!("vfmadd231ps");
    }
}
