//! Matrix products for the CPU training engine.
//!
//! Forward `Y = X·Wᵀ`, backward `dX = dY·W` and `dW += dYᵀ·X` are all one
//! operation here, `c = (accumulate ? c : 0) + a·b`, on strided views
//! ([`MatRef`]) so that transposes cost nothing at the call site: the packing
//! step (which every fast GEMM needs anyway) reads any stride.
//!
//! Layout of the implementation:
//! - `driver`: the cache-blocked loop nest (GotoBLAS/BLIS order), generic over
//!   a [`driver::Kernel`], with rayon parallelism over output blocks and
//!   thread-local packing buffers.
//! - `pack`: f32 → packed panel conversion (with optional bf16 rounding), one
//!   generic routine used by every kernel.
//! - `f32k`: f32 microkernels (AVX-512F, AVX2+FMA, scalar).
//! - `bf16k`: AVX512_BF16 (`VDPBF16PS`) microkernel and its scalar twin.
//! - `amx`: AMX (`TDPBF16PS`) detection, tile configuration and microkernel.
//! - `bench`: [`peak_gflops`] and register-resident peak loops.
//!
//! Determinism: every output element is produced by exactly one task, which
//! adds the K dimension in a fixed order (K blocks in increasing order, a
//! fixed order inside a block). The blocking does not depend on the thread
//! count, so results are bit-identical run to run *and* across thread counts.

mod amx;
mod bench;
mod bf16k;
mod driver;
mod f32k;
mod pack;
#[cfg(test)]
mod tests;

pub use bench::{peak_gflops, register_peak_gflops};

use std::sync::OnceLock;

use frugal::cpu;

/// A strided view of an f32 matrix: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A dense row-major view of `data` (which must hold at least rows·cols elements).
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transposed view: no data moves, rows/cols and strides swap.
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Element (i, j). Bounds are those of the slice (checked).
    #[inline(always)]
    pub(crate) fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.rs + j * self.cs]
    }

    /// Panics unless every element of the view lies inside `data`. Done once
    /// per call so that the packing loops may index without re-checking.
    pub(crate) fn assert_in_bounds(&self, name: &str) {
        if self.rows == 0 || self.cols == 0 {
            return;
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .and_then(|r| (self.cols - 1).checked_mul(self.cs).map(|c| (r, c)))
            .and_then(|(r, c)| r.checked_add(c));
        assert!(
            matches!(last, Some(l) if l < self.data.len()),
            "matmul: view {name} ({}x{}, strides {}/{}) exceeds its slice of {}",
            self.rows,
            self.cols,
            self.rs,
            self.cs,
            self.data.len()
        );
    }
}

/// Which arithmetic the products use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// Plain f32 multiply-add.
    #[default]
    F32,
    /// Inputs rounded to bf16 (round to nearest even), products summed in f32.
    Bf16,
}

/// Round an f32 to the nearest bf16 (ties to even); returns the bf16 bits.
/// NaN stays NaN (quieted); overflow rounds to ±infinity as IEEE requires.
#[inline(always)]
pub(crate) fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    // Branch-free (a select), so packing loops vectorize.
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) as u16) | 0x0040;
    if x.is_nan() { quiet_nan } else { rounded }
}

/// `x` rounded to bf16 precision, as an f32.
#[inline(always)]
pub(crate) fn round_bf16(x: f32) -> f32 {
    f32::from_bits((f32_to_bf16_bits(x) as u32) << 16)
}

/// The f32 kernels this build can choose from.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum F32Backend {
    Avx512(cpu::Avx512),
    Avx2(cpu::Avx2),
    Scalar,
}

/// The bf16 kernels this build can choose from.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Bf16Backend {
    Amx(cpu::Amx),
    Avx512Bf16(cpu::Avx512Bf16),
    /// Inputs rounded to bf16 while packing, then the f32 kernel.
    Emulated(F32Backend),
}

/// The f32 kernels at the level `FRUGAL_ISA` and the CPU allow (see [`frugal::cpu`]).
fn f32_backend() -> F32Backend {
    static B: OnceLock<F32Backend> = OnceLock::new();
    *B.get_or_init(|| f32_backend_at(cpu::level()))
}

/// The f32 kernels of a [`cpu::Level`], where it runs here.
pub(crate) fn f32_backend_at(level: cpu::Level) -> F32Backend {
    if !cfg!(target_arch = "x86_64") {
        F32Backend::Scalar
    } else if let Some(t) = level.avx512() {
        F32Backend::Avx512(t)
    } else if let Some(t) = level.avx2() {
        F32Backend::Avx2(t)
    } else {
        F32Backend::Scalar
    }
}

fn bf16_backend_kind() -> Bf16Backend {
    static B: OnceLock<Bf16Backend> = OnceLock::new();
    *B.get_or_init(|| {
        if !cfg!(target_arch = "x86_64") {
            return Bf16Backend::Emulated(f32_backend());
        }
        if let Some(t) = cpu::Amx::get() {
            return Bf16Backend::Amx(t);
        }
        if let Some(t) = cpu::Avx512Bf16::get() {
            return Bf16Backend::Avx512Bf16(t);
        }
        Bf16Backend::Emulated(f32_backend())
    })
}

/// What `Precision::Bf16` runs on here.
pub fn bf16_backend() -> &'static str {
    match bf16_backend_kind() {
        Bf16Backend::Amx(_) => "amx-bf16",
        Bf16Backend::Avx512Bf16(_) => "avx512-bf16",
        Bf16Backend::Emulated(_) => "f32 (no bf16 hardware)",
    }
}

/// Below this many multiply-adds a product runs on the calling thread: rayon's
/// fork/join costs a few microseconds, comparable to the whole product.
const PARALLEL_MIN_FMAS: usize = 1 << 20;

fn check_shapes(a: &MatRef, b: &MatRef, c: &[f32]) {
    assert_eq!(
        a.cols, b.rows,
        "matmul: inner dimensions differ ({}x{} · {}x{})",
        a.rows, a.cols, b.rows, b.cols
    );
    assert_eq!(
        c.len(),
        a.rows * b.cols,
        "matmul: c has {} elements, expected {}x{}",
        c.len(),
        a.rows,
        b.cols
    );
    a.assert_in_bounds("a");
    b.assert_in_bounds("b");
}

/// `c` (a.rows × b.cols, row-major, dense) = (if accumulate { c } else { 0 }) + a · b.
///
/// Panics (assert) if shapes disagree or a view would index out of its slice.
/// Runs on the current rayon pool (single-threaded for small products).
pub fn matmul(a: MatRef, b: MatRef, c: &mut [f32], accumulate: bool, precision: Precision) {
    check_shapes(&a, &b, c);
    let fmas = a.rows.saturating_mul(a.cols).saturating_mul(b.cols);
    let parallel = fmas >= PARALLEL_MIN_FMAS && rayon::current_num_threads() > 1;
    match precision {
        Precision::F32 => run_f32(f32_backend(), a, b, c, accumulate, parallel, false),
        Precision::Bf16 => run_bf16(bf16_backend_kind(), a, b, c, accumulate, parallel),
    }
}

/// Runs one f32 backend; `round` rounds inputs to bf16 while packing.
pub(crate) fn run_f32(
    backend: F32Backend,
    a: MatRef,
    b: MatRef,
    c: &mut [f32],
    accumulate: bool,
    parallel: bool,
    round: bool,
) {
    match backend {
        #[cfg(target_arch = "x86_64")]
        F32Backend::Avx512(t) => {
            driver::gemm(&f32k::F32Avx512 { round, t }, a, b, c, accumulate, parallel)
        }
        #[cfg(target_arch = "x86_64")]
        F32Backend::Avx2(t) => {
            driver::gemm(&f32k::F32Avx2 { round, t }, a, b, c, accumulate, parallel)
        }
        _ => driver::gemm(&f32k::F32Scalar { round }, a, b, c, accumulate, parallel),
    }
}

/// Runs one bf16 backend (the caller has checked it is available).
pub(crate) fn run_bf16(
    backend: Bf16Backend,
    a: MatRef,
    b: MatRef,
    c: &mut [f32],
    accumulate: bool,
    parallel: bool,
) {
    match backend {
        #[cfg(target_arch = "x86_64")]
        Bf16Backend::Amx(t) => driver::gemm(&amx::Amx::new(t), a, b, c, accumulate, parallel),
        #[cfg(target_arch = "x86_64")]
        Bf16Backend::Avx512Bf16(t) => {
            driver::gemm(&bf16k::Avx512Bf16::new(t), a, b, c, accumulate, parallel)
        }
        Bf16Backend::Emulated(f) => run_f32(f, a, b, c, accumulate, parallel, true),
        #[allow(unreachable_patterns)]
        _ => run_f32(F32Backend::Scalar, a, b, c, accumulate, parallel, true),
    }
}

/// Reference for `Precision::Bf16`: every input element rounded to bf16
/// (round to nearest even), products (exact in f32) summed in f32 in
/// increasing k order, plain loops.
pub fn matmul_bf16_reference(a: MatRef, b: MatRef, c: &mut [f32], accumulate: bool) {
    check_shapes(&a, &b, c);
    let n = b.cols;
    for i in 0..a.rows {
        for j in 0..n {
            let mut s = 0.0f32;
            for p in 0..a.cols {
                s += round_bf16(a.at(i, p)) * round_bf16(b.at(p, j));
            }
            let out = &mut c[i * n + j];
            *out = if accumulate { *out + s } else { s };
        }
    }
}

/// Reference for `Precision::F32`: plain triple loop, products and sums in
/// **f64** (then rounded once to f32), so it is more accurate than any f32
/// kernel and tests can bound the kernel's error against it.
pub fn matmul_f32_reference(a: MatRef, b: MatRef, c: &mut [f32], accumulate: bool) {
    check_shapes(&a, &b, c);
    let n = b.cols;
    for i in 0..a.rows {
        for j in 0..n {
            let mut s = 0.0f64;
            for p in 0..a.cols {
                s += a.at(i, p) as f64 * b.at(p, j) as f64;
            }
            let out = &mut c[i * n + j];
            *out = if accumulate {
                (*out as f64 + s) as f32
            } else {
                s as f32
            };
        }
    }
}
