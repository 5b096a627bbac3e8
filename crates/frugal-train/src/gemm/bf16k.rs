//! AVX512_BF16 microkernel (`VDPBF16PS`), used where AMX is absent.
//!
//! `VDPBF16PS zmm_c, zmm_a, zmm_b` adds, per 32-bit lane i, the two products
//! `a[2i]·b[2i] + a[2i+1]·b[2i+1]` (bf16 inputs, f32 accumulate). So B panels
//! are packed in "VNNI pair" layout `[k/2][32 columns][2]` (two zmm per k
//! pair), and A panels `[k/2][12 rows][2]`, whose 32-bit pairs are broadcast.
//! Tile 12×32 as in the f32 kernel, for the same register-budget reason.

use super::MatRef;
use super::driver::Kernel;
use super::pack::pack_bf16_pairs;

pub(crate) const MR: usize = 12;
pub(crate) const NR: usize = 32;
// In bf16 elements: B micro-panel 512·32·2 B = 32 KiB (L1), A block 144·512·2 B = 144 KiB (L2).
const KC: usize = 512;
const MC: usize = 144;
const NC: usize = 4096;

/// bf16 bits → f32 (exact).
#[inline(always)]
#[cfg_attr(not(test), allow(dead_code))]
fn bf16_to_f32(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// Scalar twin of the `VDPBF16PS` kernel, on the same packed layout. Used by
/// tests to check the packing independently of the SIMD code.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct Bf16PairsScalar;

/// Implements `Kernel` for a kernel on the pair layout; packing is shared.
macro_rules! pairs_kernel {
    ($ty:ident, $micro:path $(, $token:ident)?) => {
        impl Kernel for $ty {
            type E = u16;
            const MR: usize = MR;
            const NR: usize = NR;
            const KU: usize = 2;
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
                dst: &mut [u16],
            ) {
                pack_bf16_pairs(a, r0, rlen, k0, klen, MR, klen.next_multiple_of(2), dst);
            }
            fn pack_b(
                &self,
                b: MatRef,
                k0: usize,
                klen: usize,
                c0: usize,
                clen: usize,
                dst: &mut [u16],
            ) {
                pack_bf16_pairs(b.t(), c0, clen, k0, klen, NR, klen.next_multiple_of(2), dst);
            }
            unsafe fn micro(
                &self,
                kp: usize,
                ap: *const u16,
                bp: *const u16,
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
pairs_kernel!(Bf16PairsScalar, micro_pairs_scalar);

/// Plain-loop semantics of the pair kernel.
///
/// # Safety
/// See [`Kernel::micro`].
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) unsafe fn micro_pairs_scalar(
    kp: usize,
    ap: *const u16,
    bp: *const u16,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    // SAFETY: the caller guarantees the panel sizes.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(ap, MR * kp),
            std::slice::from_raw_parts(bp, NR * kp),
        )
    };
    let mut acc = [[0.0f32; NR]; MR];
    for kq in 0..kp / 2 {
        for (r, accr) in acc.iter_mut().enumerate() {
            let a0 = bf16_to_f32(a[kq * 2 * MR + 2 * r]);
            let a1 = bf16_to_f32(a[kq * 2 * MR + 2 * r + 1]);
            for (j, x) in accr.iter_mut().enumerate() {
                let b0 = bf16_to_f32(b[kq * 2 * NR + 2 * j]);
                let b1 = bf16_to_f32(b[kq * 2 * NR + 2 * j + 1]);
                *x += a0 * b0 + a1 * b1;
            }
        }
    }
    for (r, accr) in acc.iter().enumerate() {
        // SAFETY: row r of the C tile is writable.
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
    use frugal::cpu;
    use std::arch::x86_64::*;

    /// The `VDPBF16PS` kernel, made with its token.
    pub(crate) struct Avx512Bf16 {
        t: cpu::Avx512Bf16,
    }
    impl Avx512Bf16 {
        pub(crate) fn new(t: cpu::Avx512Bf16) -> Self {
            Avx512Bf16 { t }
        }
    }
    pairs_kernel!(Avx512Bf16, micro_avx512bf16, t);

    /// 12×32 tile, one `VDPBF16PS` per (row, 16 columns) per k pair.
    ///
    /// # Safety
    /// [`Kernel::micro`]'s contract.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(crate) unsafe fn micro_avx512bf16(
        _: cpu::Avx512Bf16,
        kp: usize,
        ap: *const u16,
        bp: *const u16,
        c: *mut f32,
        ldc: usize,
        load: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        for kq in 0..kp / 2 {
            // SAFETY: kq < kp/2, so the reads stay inside the panels (A pair
            // reads are unaligned u32 loads of two adjacent u16).
            unsafe {
                let b0: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(bp.add(kq * 2 * NR).cast()));
                let b1: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(bp.add(kq * 2 * NR + 32).cast()));
                let arow = ap.add(kq * 2 * MR);
                for (r, accr) in acc.iter_mut().enumerate() {
                    let pair = arow.add(2 * r).cast::<i32>().read_unaligned();
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    accr[0] = _mm512_dpbf16_ps(accr[0], av, b0);
                    accr[1] = _mm512_dpbf16_ps(accr[1], av, b1);
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
}
