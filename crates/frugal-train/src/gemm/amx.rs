//! AMX bf16 microkernel (`TDPBF16PS`).
//!
//! Tile registers (palette 1, every tile 16 rows × 64 bytes):
//! - tmm0..tmm3: the 32×32 f32 C block as four 16×16 tiles (C00 C01 / C10 C11),
//! - tmm4, tmm5: A rows 0–15 and 16–31, 32 bf16 of k each (row-major),
//! - tmm6, tmm7: B columns 0–15 and 16–31, in VNNI pair layout: tile row q
//!   holds `B[2q][j], B[2q+1][j]` for j = 0..16.
//!
//! One k step (32 values of k) is 4 tile loads and 4 `TDPBF16PS`
//! (4 × 16·16·32 multiply-adds). Packed panels store each k step's tiles as
//! contiguous 1 KiB blocks, so every load has a 64-byte stride:
//! A panel: `[k/32][half][16 rows][32 k]`, B panel: `[k/32][half][16 k-pairs][16 cols][2]`.
//!
//! `TDPBF16PS` treats bf16 denormal inputs as zero and flushes denormal
//! results (DAZ/FTZ) regardless of MXCSR; rounding is to nearest even.

use super::driver::Kernel;
use super::pack::pack_panels;
use super::{MatRef, f32_to_bf16_bits};

pub(crate) const MR: usize = 32;
pub(crate) const NR: usize = 32;
const KU: usize = 32;
// bf16 elements. KC is large because each microkernel call loads and stores
// its 4 KiB C tile once per KC: at KC = 1024 that is 32 k steps (~2000
// cycles of TDPBF16PS) per 8 KiB of C traffic; smaller KC made C traffic
// the bottleneck. A block 256·1024·2 B = 512 KiB (L2, 2 MiB per core); the
// B micro-panel (64 KiB) streams from L2 along with the A panels.
const KC: usize = 1024;
const MC: usize = 256;
const NC: usize = 4096;

/// Offset of element (r, kk) inside a packed A panel (see the module doc).
#[inline(always)]
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
fn a_index(r: usize, kk: usize) -> usize {
    (kk / 32) * 1024 + (r / 16) * 512 + (r % 16) * 32 + kk % 32
}

/// Offset of element (column r, kk) inside a packed B panel.
#[inline(always)]
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
fn b_index(r: usize, kk: usize) -> usize {
    (kk / 32) * 1024 + (r / 16) * 512 + ((kk % 32) / 2) * 32 + (r % 16) * 2 + (kk & 1)
}

/// Packs A into tile order: the AVX-512 version where the CPU has it (every
/// AMX CPU does) and the view has a unit stride, else the scalar twin.
/// Both produce bit-identical panels (`tests::amx_simd_packing_matches_scalar`).
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
fn pack_a_tiles(a: MatRef, r0: usize, rlen: usize, k0: usize, klen: usize, dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = frugal::cpu::Avx512::get()
        && (a.cs == 1 || a.rs == 1)
        && rlen > 0
        && klen > 0
    {
        // SAFETY: the token proves the packer's features.
        unsafe { simd::pack_a(t, a, r0, rlen, k0, klen, dst) };
        return;
    }
    pack_a_tiles_scalar(a, r0, rlen, k0, klen, dst);
}

/// Packs B into VNNI tile order; dispatch as in [`pack_a_tiles`].
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
fn pack_b_tiles(b: MatRef, k0: usize, klen: usize, c0: usize, clen: usize, dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = frugal::cpu::Avx512::get()
        && (b.rs == 1 || b.cs == 1)
        && clen > 0
        && klen > 0
    {
        // SAFETY: the token proves the packer's features.
        unsafe { simd::pack_b(t, b, k0, klen, c0, clen, dst) };
        return;
    }
    pack_b_tiles_scalar(b, k0, klen, c0, clen, dst);
}

/// Scalar twin of the A packing. Fast path for k-contiguous rows (the common
/// row-major activations): each row's 32 k values are one contiguous 64-byte
/// tile row, so this is a straight conversion; other strides go through
/// the generic `pack_panels`.
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
pub(crate) fn pack_a_tiles_scalar(
    a: MatRef,
    r0: usize,
    rlen: usize,
    k0: usize,
    klen: usize,
    dst: &mut [u16],
) {
    let kp = klen.next_multiple_of(KU);
    if a.rs == 1 && a.cs != 1 && rlen > 0 && klen > 0 {
        // A transposed view (dYᵀ in dW = dYᵀ·X): rows are contiguous in memory. Read each k's
        // run of rows once and scatter it down the tile column; `a_index(r, kk)` is
        // `(kk/32)·1024 + r·32 + kk%32` for r < 32.
        assert!(r0 + rlen <= a.rows && k0 + klen <= a.cols);
        a.assert_in_bounds("packed operand");
        let npanels = rlen.div_ceil(MR);
        for (p, panel) in dst.chunks_exact_mut(MR * kp).take(npanels).enumerate() {
            let rows = MR.min(rlen - p * MR);
            if rows < MR || klen < kp {
                panel.fill(0);
            }
            for kk in 0..klen {
                let src = &a.data[(k0 + kk) * a.cs + r0 + p * MR..][..rows];
                let out = &mut panel[(kk / 32) * 1024 + kk % 32..];
                for (r, &x) in src.iter().enumerate() {
                    out[r * 32] = f32_to_bf16_bits(x);
                }
            }
        }
        return;
    }
    if a.cs != 1 || rlen == 0 || klen == 0 {
        pack_panels(
            a,
            r0,
            rlen,
            k0,
            klen,
            MR,
            kp,
            dst,
            a_index,
            f32_to_bf16_bits,
            0,
        );
        return;
    }
    assert!(r0 + rlen <= a.rows && k0 + klen <= a.cols);
    a.assert_in_bounds("packed operand");
    let npanels = rlen.div_ceil(MR);
    for (p, panel) in dst.chunks_exact_mut(MR * kp).take(npanels).enumerate() {
        let rows = MR.min(rlen - p * MR);
        for i in 0..MR {
            let row = (i < rows).then(|| &a.data[(r0 + p * MR + i) * a.rs + k0..][..klen]);
            for ks in 0..kp / KU {
                let out = &mut panel[a_index(i, ks * KU)..][..KU];
                let src = row
                    .map(|r| &r[(ks * KU).min(klen)..((ks + 1) * KU).min(klen)])
                    .unwrap_or(&[]);
                for (o, &x) in out.iter_mut().zip(src) {
                    *o = f32_to_bf16_bits(x);
                }
                out[src.len()..].fill(0);
            }
        }
    }
}

/// Scalar twin of the B packing. Fast paths: k-contiguous columns (B = Wᵀ)
/// write each (k, k+1) pair as one u32; column-contiguous rows (B = W or X)
/// interleave two source rows into one contiguous tile row.
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
pub(crate) fn pack_b_tiles_scalar(
    b: MatRef,
    k0: usize,
    klen: usize,
    c0: usize,
    clen: usize,
    dst: &mut [u16],
) {
    let kp = klen.next_multiple_of(KU);
    let bt = b.t(); // rows of bt = columns of b
    let dense_k = bt.cs == 1 && bt.rs != 1;
    let dense_c = bt.rs == 1;
    if !(dense_k || dense_c) || clen == 0 || klen == 0 {
        pack_panels(
            bt,
            c0,
            clen,
            k0,
            klen,
            NR,
            kp,
            dst,
            b_index,
            f32_to_bf16_bits,
            0,
        );
        return;
    }
    assert!(c0 + clen <= bt.rows && k0 + klen <= bt.cols);
    bt.assert_in_bounds("packed operand");
    let npanels = clen.div_ceil(NR);
    for (p, panel) in dst.chunks_exact_mut(NR * kp).take(npanels).enumerate() {
        let cols = NR.min(clen - p * NR);
        let j0 = p * NR;
        if dense_k {
            for j in 0..NR {
                let row: &[f32] = if j < cols {
                    &bt.data[(c0 + j0 + j) * bt.rs + k0..][..klen]
                } else {
                    &[]
                };
                for q in 0..kp / 2 {
                    let o = b_index(j, 2 * q);
                    panel[o] = row.get(2 * q).map_or(0, |&x| f32_to_bf16_bits(x));
                    panel[o + 1] = row.get(2 * q + 1).map_or(0, |&x| f32_to_bf16_bits(x));
                }
            }
        } else {
            for q in 0..kp / 2 {
                for h in 0..NR / 16 {
                    let out = &mut panel[b_index(h * 16, 2 * q)..][..32];
                    let n = cols.saturating_sub(h * 16).min(16);
                    let start = c0 + j0 + h * 16;
                    let row = |kk: usize| -> &[f32] {
                        if kk < klen && n > 0 {
                            &bt.data[start + (k0 + kk) * bt.cs..][..n]
                        } else {
                            &[]
                        }
                    };
                    let (r0s, r1s) = (row(2 * q), row(2 * q + 1));
                    for (jj, pair) in out.chunks_exact_mut(2).enumerate() {
                        pair[0] = r0s.get(jj).map_or(0, |&x| f32_to_bf16_bits(x));
                        pair[1] = r1s.get(jj).map_or(0, |&x| f32_to_bf16_bits(x));
                    }
                }
            }
        }
    }
}

/// AVX-512 packing into the AMX tile layouts (see the module doc).
///
/// The f32 → bf16 conversion is done with integer ops, lane for lane the same
/// formula as [`f32_to_bf16_bits`] (NaN quieted the same way, denormals kept),
/// so the panels are bit-identical to the scalar twins'. `VCVTNE2PS2BF16`
/// would be one instruction per 32 values but flushes denormal inputs to zero
/// (invisible to `TDPBF16PS`, which ignores them anyway, yet a difference from
/// the reference rounding); packing is bound by reading the f32 source, so
/// the few extra integer ops cost nothing measurable.
///
/// Transposed sources are handled 16×16 blocks of 32-bit (k, k+1) pairs at a
/// time, transposed in registers: A with rows contiguous (`rs == 1`, dYᵀ) is
/// read as pairs of k rows and transposed into tile rows; B with k
/// contiguous (`B = Wᵀ`) is read as 32 k of a column and transposed into
/// VNNI rows. Partial blocks use masked loads (masked lanes read nothing and
/// give 0.0 → bf16 0), so every position of a panel is written and padding is
/// zero, as the `Kernel` contract requires.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{KU, MR, MatRef, NR};
    use frugal::cpu::Avx512;
    use std::arch::x86_64::*;

    /// bf16 bits of 16 f32 lanes, in the low half of each u32 lane (high half
    /// zero): the lane-wise twin of `f32_to_bf16_bits`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn bf16_lanes(v: __m512) -> __m512i {
        let bits = _mm512_castps_si512(v);
        let hi = _mm512_srli_epi32::<16>(bits);
        let bias = _mm512_add_epi32(
            _mm512_and_si512(hi, _mm512_set1_epi32(1)),
            _mm512_set1_epi32(0x7FFF),
        );
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
        let quiet_nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
        _mm512_mask_blend_epi32(nan, rounded, quiet_nan)
    }

    /// 16 (k, k+1) pairs: lane i = bf16(lo[i]) | bf16(hi[i]) << 16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn pairs(lo: __m512, hi: __m512) -> __m512i {
        _mm512_or_si512(bf16_lanes(lo), _mm512_slli_epi32::<16>(bf16_lanes(hi)))
    }

    /// 32 consecutive values (v0 then v1) as 32 bf16 in order.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn packed32(v0: __m512, v1: __m512) -> __m512i {
        let lo = _mm512_cvtepi32_epi16(bf16_lanes(v0));
        let hi = _mm512_cvtepi32_epi16(bf16_lanes(v1));
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }

    /// Mask of the first `n` (≤ 16) lanes.
    #[inline]
    fn mask16(n: usize) -> __mmask16 {
        debug_assert!(n <= 16);
        ((1u32 << n) - 1) as __mmask16
    }

    /// Up to 16 f32 from `p` (lanes beyond `mask` read nothing and are 0).
    ///
    /// # Safety
    /// The lanes selected by `mask` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load(mask: __mmask16, p: *const f32) -> __m512 {
        // SAFETY: masked-off lanes are not accessed (no fault); the caller
        // vouches for the others.
        unsafe { _mm512_maskz_loadu_ps(mask, p) }
    }

    /// In-register transpose of a 16×16 matrix of u32 (row i = `r[i]`).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn transpose16(r: &mut [__m512i; 16]) {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        // u[4g + c], 128-bit lane l: rows 4g..4g+4 of column 4l + c.
        let mut u = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
            u[4 * g] = _mm512_unpacklo_epi64(a, c);
            u[4 * g + 1] = _mm512_unpackhi_epi64(a, c);
            u[4 * g + 2] = _mm512_unpacklo_epi64(b, d);
            u[4 * g + 3] = _mm512_unpackhi_epi64(b, d);
        }
        for c in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]);
            let v1 = _mm512_shuffle_i32x4::<0xdd>(u[c], u[4 + c]);
            let v2 = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
            let v3 = _mm512_shuffle_i32x4::<0xdd>(u[8 + c], u[12 + c]);
            r[c] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
            r[8 + c] = _mm512_shuffle_i32x4::<0xdd>(v0, v2);
            r[4 + c] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
            r[12 + c] = _mm512_shuffle_i32x4::<0xdd>(v1, v3);
        }
    }

    /// Stores one 64-byte tile row.
    ///
    /// # Safety
    /// `p` must have 32 writable u16.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn store(p: *mut u16, v: __m512i) {
        // SAFETY: per the contract.
        unsafe { _mm512_storeu_si512(p.cast(), v) }
    }

    /// [`super::pack_a_tiles_scalar`] for views with `cs == 1` or `rs == 1`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn pack_a(
        _: Avx512,
        a: MatRef,
        r0: usize,
        rlen: usize,
        k0: usize,
        klen: usize,
        dst: &mut [u16],
    ) {
        let kp = klen.next_multiple_of(KU);
        let npanels = rlen.div_ceil(MR);
        assert!(rlen > 0 && klen > 0 && r0 + rlen <= a.rows && k0 + klen <= a.cols);
        assert!(dst.len() >= npanels * MR * kp);
        a.assert_in_bounds("packed operand");
        let src = a.data.as_ptr();
        let out = dst.as_mut_ptr();
        let zero = _mm512_setzero_si512();
        // SAFETY: (all loads below) a lane is enabled only for row
        // r0 + p·MR + i < r0 + rlen ≤ rows and k k0 + kk < k0 + klen ≤ cols,
        // inside the view, which lies in `a.data` (asserted). Addresses of
        // disabled lanes are formed with `wrapping_add` and never accessed.
        // Stores: offsets < npanels·MR·kp ≤ dst.len() (asserted).
        for p in 0..npanels {
            let rows = MR.min(rlen - p * MR);
            let panel = out.wrapping_add(p * MR * kp);
            if a.cs == 1 {
                // Row-major: each tile row is 32 consecutive k of one row.
                for i in 0..MR {
                    let row = src.wrapping_add((r0 + p * MR + i) * a.rs + k0);
                    for ks in 0..kp / KU {
                        let v = if i < rows {
                            let n = (klen - ks * KU).min(KU);
                            let (m0, m1) = (mask16(n.min(16)), mask16(n.saturating_sub(16)));
                            // SAFETY: as for all loads and stores above.
                            unsafe {
                                let x = row.wrapping_add(ks * KU);
                                packed32(load(m0, x), load(m1, x.wrapping_add(16)))
                            }
                        } else {
                            zero
                        };
                        // SAFETY: as for all loads and stores above.
                        unsafe { store(panel.add(super::a_index(i, ks * KU)), v) };
                    }
                }
            } else {
                // rs == 1 (dYᵀ): source rows are A's k; pair up two of them
                // (k, k+1) for 16 A rows, then transpose into 16 tile rows.
                for h in 0..MR / 16 {
                    let n = rows.saturating_sub(16 * h).min(16);
                    let m = mask16(n);
                    let col = src.wrapping_add(r0 + p * MR + 16 * h);
                    for ks in 0..kp / KU {
                        let mut t = [zero; 16];
                        if n > 0 {
                            for (q, tq) in t.iter_mut().enumerate() {
                                let kk = ks * KU + 2 * q;
                                let ld = |kk: usize| {
                                    if kk < klen {
                                        // SAFETY: as for all loads and stores above.
                                        unsafe { load(m, col.wrapping_add((k0 + kk) * a.cs)) }
                                    } else {
                                        _mm512_setzero_ps()
                                    }
                                };
                                *tq = pairs(ld(kk), ld(kk + 1));
                            }
                            transpose16(&mut t);
                        }
                        let blk = panel.wrapping_add(ks * 1024 + h * 512);
                        for (i, &ti) in t.iter().enumerate() {
                            // SAFETY: as for all loads and stores above.
                            unsafe { store(blk.add(i * 32), ti) };
                        }
                    }
                }
            }
        }
    }

    /// [`super::pack_b_tiles_scalar`] for views with `rs == 1` or `cs == 1`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn pack_b(
        _: Avx512,
        b: MatRef,
        k0: usize,
        klen: usize,
        c0: usize,
        clen: usize,
        dst: &mut [u16],
    ) {
        let kp = klen.next_multiple_of(KU);
        let bt = b.t(); // rows of bt = columns of b
        let dense_k = bt.cs == 1 && bt.rs != 1;
        let npanels = clen.div_ceil(NR);
        assert!(clen > 0 && klen > 0 && c0 + clen <= bt.rows && k0 + klen <= bt.cols);
        assert!(bt.cs == 1 || bt.rs == 1);
        assert!(dst.len() >= npanels * NR * kp);
        bt.assert_in_bounds("packed operand");
        let src = bt.data.as_ptr();
        let out = dst.as_mut_ptr();
        let zero = _mm512_setzero_si512();
        // SAFETY: as in `pack_a`, with B's columns c0 + p·NR + j < c0 + clen
        // and k0 + kk < k0 + klen for every enabled lane.
        for p in 0..npanels {
            let cols = NR.min(clen - p * NR);
            let panel = out.wrapping_add(p * NR * kp);
            for h in 0..NR / 16 {
                let n = cols.saturating_sub(16 * h).min(16);
                let j0 = c0 + p * NR + 16 * h;
                for ks in 0..kp / KU {
                    let blk = panel.wrapping_add(ks * 1024 + h * 512);
                    let mut t = [zero; 16];
                    if dense_k {
                        // B = Wᵀ: 32 consecutive k of column j are 16 pairs;
                        // transpose so that tile row q holds pair q of all columns.
                        if n > 0 {
                            let cnt = (klen - ks * KU).min(KU);
                            let (m0, m1) = (mask16(cnt.min(16)), mask16(cnt.saturating_sub(16)));
                            for (j, tj) in t.iter_mut().enumerate().take(n) {
                                let x = src.wrapping_add((j0 + j) * bt.rs + k0 + ks * KU);
                                *tj =
                                    // SAFETY: as for all loads and stores above.
                                    unsafe { packed32(load(m0, x), load(m1, x.wrapping_add(16))) };
                            }
                            transpose16(&mut t);
                        }
                    } else if n > 0 {
                        // Row-major B: interleave rows k and k+1, 16 columns.
                        let m = mask16(n);
                        for (q, tq) in t.iter_mut().enumerate() {
                            let kk = ks * KU + 2 * q;
                            let ld = |kk: usize| {
                                if kk < klen {
                                    // SAFETY: as for all loads and stores above.
                                    unsafe { load(m, src.wrapping_add(j0 + (k0 + kk) * bt.cs)) }
                                } else {
                                    _mm512_setzero_ps()
                                }
                            };
                            *tq = pairs(ld(kk), ld(kk + 1));
                        }
                    }
                    for (q, &tq) in t.iter().enumerate() {
                        // SAFETY: as for all loads and stores above.
                        unsafe { store(blk.add(q * 32), tq) };
                    }
                }
            }
        }
    }
}

/// Scalar twin of the AMX kernel on the same tile layout (tests use it to
/// check the layout and the driver on machines without AMX).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct AmxScalar;

impl Kernel for AmxScalar {
    type E = u16;
    const MR: usize = MR;
    const NR: usize = NR;
    const KU: usize = KU;
    const MC: usize = MC;
    const KC: usize = KC;
    const NC: usize = NC;
    fn pack_a(&self, a: MatRef, r0: usize, rlen: usize, k0: usize, klen: usize, dst: &mut [u16]) {
        pack_a_tiles(a, r0, rlen, k0, klen, dst);
    }
    fn pack_b(&self, b: MatRef, k0: usize, klen: usize, c0: usize, clen: usize, dst: &mut [u16]) {
        pack_b_tiles(b, k0, klen, c0, clen, dst);
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
        let bf = |x: u16| f32::from_bits((x as u32) << 16);
        // SAFETY: panel sizes per the `Kernel` contract.
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(ap, MR * kp),
                std::slice::from_raw_parts(bp, NR * kp),
            )
        };
        let mut acc = [[0.0f32; NR]; MR];
        for (i, accr) in acc.iter_mut().enumerate() {
            for (j, x) in accr.iter_mut().enumerate() {
                for kk in 0..kp {
                    *x += bf(a[a_index(i, kk)]) * bf(b[b_index(j, kk)]);
                }
            }
        }
        for (i, accr) in acc.iter().enumerate() {
            // SAFETY: row i of the C tile is writable.
            let crow = unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), NR) };
            for (cv, &x) in crow.iter_mut().zip(accr) {
                *cv = if load { *cv + x } else { x };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use frugal::cpu;
    use std::arch::asm;

    /// Palette 1, tiles 0..8 all 16 rows × 64 bytes.
    static CONFIG: cpu::TileConfig = cpu::TileConfig::palette1([64; 8], [16; 8]);

    /// Loads the tile configuration on this thread.
    pub(crate) fn tiles_configure(amx: cpu::Amx) {
        amx.load_tiles(&CONFIG);
    }

    /// Returns the tiles to their initial state (frees the XSAVE area use).
    pub(crate) fn tiles_release(amx: cpu::Amx) {
        amx.release_tiles();
    }

    /// A 64-byte aligned 32×32 f32 tile (see `micro`).
    #[repr(C, align(64))]
    struct CTile([f32; MR * NR]);

    /// The AMX kernel, made with its token.
    ///
    /// Soundness of the tile state across asm blocks: `task_begin` loads the
    /// configuration and `task_end` releases it, with only `micro` calls (each
    /// one self-contained asm block that keeps no tile *data* across blocks)
    /// and ordinary Rust in between, on one thread. The compiler never
    /// allocates or touches tmm registers or the tile configuration, the OS
    /// preserves them across preemption (XSAVE, permission requested with the
    /// `cpu::Amx` token), and no rayon call happens inside a task, so no other
    /// job can run on this thread in between.
    pub(crate) struct Amx(cpu::Amx);
    impl Amx {
        pub(crate) fn new(t: cpu::Amx) -> Self {
            Amx(t)
        }
    }

    impl Kernel for Amx {
        type E = u16;
        const MR: usize = MR;
        const NR: usize = NR;
        const KU: usize = KU;
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
            pack_a_tiles(a, r0, rlen, k0, klen, dst);
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
            pack_b_tiles(b, k0, klen, c0, clen, dst);
        }
        fn task_begin(&self) {
            tiles_configure(self.0)
        }
        fn task_end(&self) {
            tiles_release(self.0)
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
            debug_assert!(kp >= KU && kp.is_multiple_of(KU));
            // Tile loads and stores whose 64-byte rows straddle two cache
            // lines run several times slower (measured: ~3× for loads), and
            // callers' C arrays are usually only 16-byte aligned. Then go
            // through an aligned local tile; plain copies handle the split
            // lines at full speed.
            if !(c as usize | (ldc * 4)).is_multiple_of(64) {
                let mut tile = CTile([0.0; MR * NR]);
                let t = tile.0.as_mut_ptr();
                for r in 0..MR {
                    // SAFETY: row r of the caller's C tile has NR valid f32
                    // (contract); `tile` has MR rows of NR.
                    unsafe {
                        if load {
                            std::ptr::copy_nonoverlapping(c.add(r * ldc), t.add(r * NR), NR);
                        }
                    }
                }
                // SAFETY: same contract, with an aligned C of row stride NR.
                unsafe { self.micro(kp, ap, bp, t, NR, load) };
                for r in 0..MR {
                    // SAFETY: as above.
                    unsafe { std::ptr::copy_nonoverlapping(t.add(r * NR), c.add(r * ldc), NR) };
                }
                return;
            }
            let ksteps = kp / KU;
            let ldc_bytes = ldc * 4;
            // SAFETY: (pointer arithmetic) rows 16..32 of the C tile exist.
            let c_lower = unsafe { c.add(16 * ldc) };
            // SAFETY: the tile configuration is loaded (contract: task_begin
            // ran). Loads read 16 rows × 64 bytes: from C at stride ldc·4
            // (32×32 f32 tile, writable per the contract) and from the packed
            // panels at stride 64, `ksteps` blocks of 2 KiB each for A and B
            // (panel sizes MR·kp and NR·kp u16). Stores write the same C tile.
            unsafe {
                asm!(
                    "test {load}, {load}",
                    "jz 2f",
                    "tileloadd tmm0, [{c0} + {ldc}*1]",
                    "tileloadd tmm1, [{c0} + {ldc}*1 + 64]",
                    "tileloadd tmm2, [{c1} + {ldc}*1]",
                    "tileloadd tmm3, [{c1} + {ldc}*1 + 64]",
                    "jmp 3f",
                    "2:",
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    "3:",
                    "tileloadd tmm4, [{ap} + {s64}*1]",
                    "tileloadd tmm6, [{bp} + {s64}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tileloadd tmm7, [{bp} + {s64}*1 + 1024]",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tileloadd tmm5, [{ap} + {s64}*1 + 1024]",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "add {ap}, 2048",
                    "add {bp}, 2048",
                    "dec {n}",
                    "jnz 3b",
                    "tilestored [{c0} + {ldc}*1], tmm0",
                    "tilestored [{c0} + {ldc}*1 + 64], tmm1",
                    "tilestored [{c1} + {ldc}*1], tmm2",
                    "tilestored [{c1} + {ldc}*1 + 64], tmm3",
                    load = in(reg) load as usize,
                    c0 = in(reg) c,
                    c1 = in(reg) c_lower,
                    ldc = in(reg) ldc_bytes,
                    s64 = in(reg) 64usize,
                    ap = inout(reg) ap => _,
                    bp = inout(reg) bp => _,
                    n = inout(reg) ksteps => _,
                    options(nostack),
                );
            }
        }
    }

    /// Register-resident `TDPBF16PS` loop: the AMX peak (GFLOP/s counted as
    /// 2 per multiply-add) measured over `iters` × 4 instructions.
    ///
    pub(crate) fn amx_register_loop(t: cpu::Amx, iters: usize) {
        let zeros = [0u8; 1024];
        tiles_configure(t);
        // SAFETY: the token proves AMX; the configuration is loaded above; the
        // loads read 1 KiB of `zeros` at stride 64; released below.
        unsafe {
            asm!(
                "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
                "tileloadd tmm4, [{z} + {s64}*1]",
                "tileloadd tmm5, [{z} + {s64}*1]",
                "tileloadd tmm6, [{z} + {s64}*1]",
                "tileloadd tmm7, [{z} + {s64}*1]",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                z = in(reg) zeros.as_ptr(),
                s64 = in(reg) 64usize,
                n = inout(reg) iters.max(1) => _,
                options(nostack, readonly),
            );
        }
        tiles_release(t);
    }
}
