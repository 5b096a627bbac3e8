//! f32 microkernels: AVX-512F (12×32), AVX2+FMA (the same tile as four 6×16
//! pieces) and a scalar twin. All three read the same packed layout
//! (`pack::pack_f32`: A panels `[k][12]`, B panels `[k][32]`), so the
//! emulated-bf16 path and tests can swap them freely.
//!
//! Why 12×32: 24 zmm accumulators + 2 B vectors + 1 broadcast fit in the 32
//! zmm registers; per k step it is 24 FMAs against 2 loads and 12 broadcasts,
//! which keeps both FMA ports busy without saturating the load ports.

use super::MatRef;
use super::driver::Kernel;
use super::pack::pack_f32;

pub(crate) const MR: usize = 12;
pub(crate) const NR: usize = 32;
// KC·NR·4 = 32 KiB: the B micro-panel stays in the 48 KiB L1.
// MC·KC·4 = 144 KiB: the A block stays in L2 (2 MiB per core).
const KC: usize = 256;
const MC: usize = 144;
const NC: usize = 4096;

/// Implements `Kernel` for an f32 microkernel type; packing is shared. A SIMD kernel names
/// the field that holds its capability token, which its microkernel takes first.
macro_rules! f32_kernel {
    ($ty:ident, $micro:path $(, $token:ident)?) => {
        impl Kernel for $ty {
            type E = f32;
            const MR: usize = MR;
            const NR: usize = NR;
            const KU: usize = 1;
            const MC: usize = MC;
            const KC: usize = KC;
            const NC: usize = NC;
            fn pack_a(
                &self,
                a: MatRef,
                r0: usize,
                rlen: usize,
                k0: usize,
                klen: usize,
                dst: &mut [f32],
            ) {
                pack_f32(a, r0, rlen, k0, klen, MR, dst, self.round);
            }
            fn pack_b(
                &self,
                b: MatRef,
                k0: usize,
                klen: usize,
                c0: usize,
                clen: usize,
                dst: &mut [f32],
            ) {
                pack_f32(b.t(), c0, clen, k0, klen, NR, dst, self.round);
            }
            unsafe fn micro(
                &self,
                kp: usize,
                ap: *const f32,
                bp: *const f32,
                c: *mut f32,
                ldc: usize,
                load: bool,
            ) {
                // SAFETY: forwarded contract; a SIMD kernel passes the token it holds.
                unsafe { $micro($(self.$token,)? kp, ap, bp, c, ldc, load) }
            }
        }
    };
}

/// Scalar kernel (and the reference twin of the SIMD ones). `round`: inputs
/// are rounded to bf16 while packing (emulated bf16 precision).
pub(crate) struct F32Scalar {
    pub round: bool,
}
f32_kernel!(F32Scalar, micro_scalar);

/// Plain-loop microkernel on the packed layout: the semantics every SIMD
/// kernel in this file implements (they use FMA, so the last bits differ).
///
/// # Safety
/// See [`Kernel::micro`].
pub(crate) unsafe fn micro_scalar(
    kp: usize,
    ap: *const f32,
    bp: *const f32,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    // SAFETY: the caller guarantees the panel sizes and the C tile.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(ap, MR * kp),
            std::slice::from_raw_parts(bp, NR * kp),
        )
    };
    let mut acc = [[0.0f32; NR]; MR];
    for kk in 0..kp {
        let brow = &b[kk * NR..(kk + 1) * NR];
        for (r, accr) in acc.iter_mut().enumerate() {
            let av = a[kk * MR + r];
            for (x, &bv) in accr.iter_mut().zip(brow) {
                *x += av * bv;
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        // SAFETY: row r of the MR×NR tile at row stride ldc is writable.
        let crow = unsafe { std::slice::from_raw_parts_mut(c.add(r * ldc), NR) };
        for (cv, &x) in crow.iter_mut().zip(accr) {
            *cv = if load { *cv + x } else { x };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use frugal::cpu::{Avx2, Avx512};
    use std::arch::x86_64::*;

    /// AVX-512F kernel.
    pub(crate) struct F32Avx512 {
        pub round: bool,
        pub t: Avx512,
    }
    f32_kernel!(F32Avx512, micro_avx512, t);

    /// AVX2+FMA kernel.
    pub(crate) struct F32Avx2 {
        pub round: bool,
        pub t: Avx2,
    }
    f32_kernel!(F32Avx2, micro_avx2, t);

    /// 12×32 tile: 24 zmm accumulators, B row as two zmm, A broadcast.
    ///
    /// # Safety
    /// [`Kernel::micro`]'s contract.
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn micro_avx512(
        _: Avx512,
        kp: usize,
        ap: *const f32,
        bp: *const f32,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for kk in 0..kp {
            // SAFETY: kk < kp, so the reads stay inside the MR·kp / NR·kp panels.
            unsafe {
                let b0 = _mm512_loadu_ps(bp.add(kk * NR));
                let b1 = _mm512_loadu_ps(bp.add(kk * NR + 16));
                let arow = ap.add(kk * MR);
                for (r, accr) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*arow.add(r));
                    accr[0] = _mm512_fmadd_ps(av, b0, accr[0]);
                    accr[1] = _mm512_fmadd_ps(av, b1, accr[1]);
                }
            }
        }
        for (r, accr) in acc.iter().enumerate() {
            // SAFETY: row r of the C tile has NR writable f32.
            unsafe {
                let cp = c.add(r * ldc);
                let (mut x0, mut x1) = (accr[0], accr[1]);
                if load {
                    x0 = _mm512_add_ps(_mm512_loadu_ps(cp), x0);
                    x1 = _mm512_add_ps(_mm512_loadu_ps(cp.add(16)), x1);
                }
                _mm512_storeu_ps(cp, x0);
                _mm512_storeu_ps(cp.add(16), x1);
            }
        }
    }

    /// The 12×32 tile as four 6×16 pieces (12 ymm accumulators each).
    ///
    /// # Safety
    /// [`Kernel::micro`]'s contract.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn micro_avx2(
        _: Avx2,
        kp: usize,
        ap: *const f32,
        bp: *const f32,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        for rh in 0..2 {
            for ch in 0..2 {
                let mut acc = [[_mm256_setzero_ps(); 2]; 6];
                for kk in 0..kp {
                    // SAFETY: rows rh*6..rh*6+6 < MR and columns ch*16..+16 ≤ NR of row kk < kp.
                    unsafe {
                        let b0 = _mm256_loadu_ps(bp.add(kk * NR + ch * 16));
                        let b1 = _mm256_loadu_ps(bp.add(kk * NR + ch * 16 + 8));
                        let arow = ap.add(kk * MR + rh * 6);
                        for (r, accr) in acc.iter_mut().enumerate() {
                            let av = _mm256_broadcast_ss(&*arow.add(r));
                            accr[0] = _mm256_fmadd_ps(av, b0, accr[0]);
                            accr[1] = _mm256_fmadd_ps(av, b1, accr[1]);
                        }
                    }
                }
                for (r, accr) in acc.iter().enumerate() {
                    // SAFETY: inside the MR×NR C tile.
                    unsafe {
                        let cp = c.add((rh * 6 + r) * ldc + ch * 16);
                        let (mut x0, mut x1) = (accr[0], accr[1]);
                        if load {
                            x0 = _mm256_add_ps(_mm256_loadu_ps(cp), x0);
                            x1 = _mm256_add_ps(_mm256_loadu_ps(cp.add(8)), x1);
                        }
                        _mm256_storeu_ps(cp, x0);
                        _mm256_storeu_ps(cp.add(8), x1);
                    }
                }
            }
        }
    }
}
