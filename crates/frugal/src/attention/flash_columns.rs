//! Keys kept by column (a paged pool's f32, f16 and bf16 key blocks, see
//! `KvView::with_columns`): scored where they lie for decode's few query rows, or widened into
//! the transposed tile that `flash_x86::scores` reads for many rows. Either way the key tile
//! holds the values a transpose of the same keys kept by rows would give, so the bits are the
//! same (`tests::keys_by_column_give_the_bits_of_keys_by_row`).

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::flash_x86::{Bf16Lanes, ColumnHint, F16Lanes, F32Lanes, Lanes, LineHint, score_keys};
use crate::kv::KvType;

/// `flash_x86::scores` for keys kept by column: `s[i][j] = q_i . k_{off + j}` for `R` rows and the `m`
/// positions `off..off + m` of one block (`bs` values of type `ty` per column, f32, f16 or
/// bf16), read where they lie and widened as loaded; row `i`'s scores at `s[i * bc + j]`. Each
/// score is the same chain of multiply-adds over the dimensions in order as `scores` computes
/// on a transposed tile, so the bits are the same. `values`: the lines of these keys' values,
/// asked for as the columns are read (see `Ahead::leads`).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn scores_columns<const R: usize>(
    q: &[f32],
    block: &[u8],
    ty: KvType,
    bs: usize,
    off: usize,
    m: usize,
    s: &mut [f32],
    bc: usize,
    ahead: &mut Ahead,
    values: Option<LineHint>,
) {
    let a = ahead;
    // SAFETY: forwarded (the caller has AVX2, FMA and F16C).
    unsafe {
        match ty {
            KvType::F32 => score_columns::<F32Lanes, R>(q, block, bs, off, m, s, bc, a, values),
            KvType::F16 => score_columns::<F16Lanes, R>(q, block, bs, off, m, s, bc, a, values),
            KvType::Bf16 => score_columns::<Bf16Lanes, R>(q, block, bs, off, m, s, bc, a, values),
            KvType::Q8_0 => unreachable!("Q8_0 keys are kept by rows"),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn score_columns<L: Lanes, const R: usize>(
    q: &[f32],
    block: &[u8],
    bs: usize,
    off: usize,
    m: usize,
    s: &mut [f32],
    bc: usize,
    ahead: &mut Ahead,
    values: Option<LineHint>,
) {
    let hd = q.len() / R;
    let es = L::TY.bytes(1);
    assert!(
        m >= 1
            && off + m <= bs
            && m <= bc
            && block.len() >= L::TY.bytes(hd * bs)
            && s.len() >= (R - 1) * bc + m,
        "flash key columns: block shapes"
    );
    ahead.advance(m);
    let (qp, bp, sp) = (q.as_ptr(), block.as_ptr(), s.as_mut_ptr());
    // SAFETY: column c is values c * bs .. (c + 1) * bs of `block`; whole vectors read values
    // off + j .. off + j + 8 * W <= off + m <= bs of it; the last keys (fewer than eight) are
    // copied from each column into a local vector's worth of bytes; writes are s[i * bc + j ..]
    // for keys below m (a whole vector's only while j + 8 * W <= m): inside the checked lengths.
    unsafe {
        let column = |c: usize| bp.add(c * bs * es);
        let mut j = 0;
        // The next tile's keys, one tile on (see `Ahead::leads`): the lines of the block that
        // far on, spread over its columns. And the values of these keys, which the weighted
        // sum reads after the scores and the exponentials, asked for as the scores begin.
        let lead = ahead.leads()[0];
        let keys_ahead = bp.add(off * es).wrapping_add(lead);
        let hint = ColumnHint {
            keys: (lead > 0).then(|| LineHint::spread(keys_ahead, bs * es * hd, hd)),
            values,
        };
        while j + 16 <= m {
            let key = |c, w| L::load8(column(c), off + j + 8 * w);
            let hint = if j == 0 { hint } else { ColumnHint::NONE };
            score_keys::<R, 2>(qp, hd, key, hint, sp.add(j), bc);
            j += 16;
        }
        if j + 8 <= m {
            score_keys::<R, 1>(
                qp,
                hd,
                |c, _| L::load8(column(c), off + j),
                ColumnHint::NONE,
                sp.add(j),
                bc,
            );
            j += 8;
        }
        if j < m {
            let n = m - j;
            let key = |c, _| {
                let mut tail = [0u8; 32];
                std::ptr::copy_nonoverlapping(
                    column(c).add((off + j) * es),
                    tail.as_mut_ptr(),
                    n * es,
                );
                L::load8(tail.as_ptr(), 0)
            };
            let mut out = [[0f32; 8]; R];
            score_keys::<R, 1>(qp, hd, key, ColumnHint::NONE, out.as_mut_ptr().cast(), 8);
            for (i, oi) in out.iter().enumerate() {
                std::ptr::copy_nonoverlapping(oi.as_ptr(), sp.add(i * bc + j), n);
            }
        }
    }
}

/// `kt[c * bc + j0 + j] = column_c[off + j]` for `j < m`: positions `off..off + m` of a block
/// that keeps one head's `hd` values by column (`bs` values of type `ty` per column, f32, f16
/// or bf16), widened into the transposed key tile `scores` reads. The same values as
/// [`transpose_rows`] gives from rows, for two loads and two stores per sixteen keys and column
/// instead of an 8 x 8 transpose per eight keys and eight columns.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn widen_columns(
    block: &[u8],
    ty: KvType,
    bs: usize,
    off: usize,
    m: usize,
    hd: usize,
    kt: &mut [f32],
    bc: usize,
    j0: usize,
    ahead: &mut Ahead,
) {
    let a = ahead;
    // SAFETY: forwarded (the caller has AVX2, FMA and F16C).
    unsafe {
        match ty {
            KvType::F32 => widen::<F32Lanes>(block, bs, off, m, hd, kt, bc, j0, a),
            KvType::F16 => widen::<F16Lanes>(block, bs, off, m, hd, kt, bc, j0, a),
            KvType::Bf16 => widen::<Bf16Lanes>(block, bs, off, m, hd, kt, bc, j0, a),
            KvType::Q8_0 => unreachable!("Q8_0 keys are kept by rows"),
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen<L: Lanes>(
    block: &[u8],
    bs: usize,
    off: usize,
    m: usize,
    hd: usize,
    kt: &mut [f32],
    bc: usize,
    j0: usize,
    ahead: &mut Ahead,
) {
    assert!(
        m >= 1
            && off + m <= bs
            && j0 + m <= bc
            && kt.len() >= hd * bc
            && block.len() >= L::TY.bytes(hd * bs),
        "flash key columns: tile shapes"
    );
    ahead.advance(m);
    let (sp, kp) = (block.as_ptr(), kt.as_mut_ptr());
    // SAFETY: column c is values c * bs .. (c + 1) * bs of `block`; the loads read values
    // off + j .. off + j + 8 <= off + m <= bs of it, the tail goes through a local copy; writes
    // are kt[c * bc + j0 + j ..] with j0 + j + 8 <= j0 + m <= bc: inside the checked lengths.
    unsafe {
        let es = L::TY.bytes(1);
        for c in 0..hd {
            let col = sp.add(c * bs * es);
            let dst = kp.add(c * bc + j0);
            let mut j = 0;
            while j + 8 <= m {
                _mm256_storeu_ps(dst.add(j), L::load8(col, off + j));
                j += 8;
            }
            if j < m {
                let mut tail = [0u8; 32];
                let n = m - j;
                std::ptr::copy_nonoverlapping(col.add((off + j) * es), tail.as_mut_ptr(), n * es);
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), L::load8(tail.as_ptr(), 0));
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), dst.add(j), n);
            }
        }
    }
}
