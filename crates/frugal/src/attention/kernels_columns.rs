//! Keys kept by column (a paged pool's f32, f16 and bf16 key blocks, see
//! `KvView::with_columns`): scored where they lie for decode's few query rows, or widened into
//! the transposed tile that `kernels_avx2::scores` reads for many rows. Either way the key tile
//! holds the values a transpose of the same keys kept by rows would give, so the bits are the
//! same (`tests::keys_by_column_give_the_bits_of_keys_by_row`).

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::kernels_avx2::{ColumnHint, LineHint, score_keys};
use super::kernels_lanes::{Bf16Lanes, F16Lanes, F32Lanes, Lanes};
use crate::cpu::{Avx2, Avx512};
use crate::kv::{KvType, KvView};

/// The kernels for keys kept by column, at the AVX2 level or, with `wide`, AVX-512's
/// (`TileKernel::columns`).
#[derive(Copy, Clone)]
pub(super) struct Columns {
    pub(super) avx2: Avx2,
    pub(super) wide: Option<Avx512>,
}

impl Columns {
    /// Keys `j0..j0 + n` of head `kvh` of `k` (kept by column) widened into columns `0..n` of
    /// the transposed tile `kt`, block by block ([`widen_columns`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn widen_keys(
        self,
        k: &KvView,
        kvh: usize,
        hd: usize,
        j0: usize,
        n: usize,
        kt: &mut [f32],
        bc: usize,
        ahead: &mut Ahead,
    ) {
        let mut j = 0;
        while j < n {
            let (bytes, bs, off, m) = k.head_block(kvh, hd, j0 + j, n - j);
            widen_columns(self.avx2, bytes, k.ty(), bs, off, m, hd, kt, bc, j, ahead);
            j += m;
        }
    }

    /// `s[i][j] = q_i . k_{j0 + j}` for `R` rows (`q` is `R x hd`) and keys `0..jn` of head
    /// `kvh` of `k` (kept by column, f32, f16 or bf16), scored where they lie; the lines of
    /// the same keys' values in `v` (kept by row) are asked for as the keys are read.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn tile_scores<const R: usize>(
        self,
        q: &[f32],
        k: &KvView,
        v: &KvView,
        kvh: usize,
        hd: usize,
        j0: usize,
        jn: usize,
        s: &mut [f32],
        bc: usize,
        ahead: &mut Ahead,
    ) {
        assert!(
            k.columns()
                && matches!(k.ty(), KvType::F32 | KvType::F16 | KvType::Bf16)
                && !v.columns()
                && q.len() == R * hd
                && s.len() >= R * bc
                && jn <= bc,
            "column scores: f32, f16 or bf16 keys by column, values by row, R x hd queries, \
             R x bc scores"
        );
        if let Some(w) = self.wide {
            // SAFETY: the types and shapes are asserted above.
            return unsafe { tile_scores_wide::<R>(w, q, k, v, kvh, hd, j0, jn, s, bc, ahead) };
        }
        // The run of value rows that holds key j (from `v_at`), for the values' lines the
        // scores ask for.
        let (mut v_run, mut v_at) = (v.head_run(kvh, hd, j0, jn), 0);
        let mut j = 0;
        while j < jn {
            let (bytes, bs, off, m) = k.head_block(kvh, hd, j0 + j, jn - j);
            if j >= v_at + v_run.2 {
                (v_run, v_at) = (v.head_run(kvh, hd, j0 + j, jn - j), j);
            }
            let (v_bytes, v_stride, v_rows) = v_run;
            let rows_here = m.min(v_at + v_rows - j);
            let values = LineHint::spread(
                v_bytes[(j - v_at) * v_stride..].as_ptr(),
                rows_here * v_stride,
                hd,
            );
            let (ty, sj) = (k.ty(), &mut s[j..]);
            scores_columns::<R>(
                self.avx2,
                q,
                bytes,
                ty,
                bs,
                off,
                m,
                sj,
                bc,
                ahead,
                Some(values),
            );
            j += m;
        }
    }
}

/// `kernels_avx2::scores` for keys kept by column: `s[i][j] = q_i . k_{off + j}` for `R` rows and the `m`
/// positions `off..off + m` of one block (`bs` values of type `ty` per column, f32, f16 or
/// bf16), read where they lie and widened as loaded; row `i`'s scores at `s[i * bc + j]`. Each
/// score is the same chain of multiply-adds over the dimensions in order as `scores` computes
/// on a transposed tile, so the bits are the same. `values`: the lines of these keys' values,
/// asked for as the columns are read (see `Ahead::leads`).
#[allow(clippy::too_many_arguments)]
pub(super) fn scores_columns<const R: usize>(
    _: Avx2,
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
    // SAFETY: the token proves `score_columns`'s features; it checks the shapes.
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
    // read as a whole vector where off + j + 8 <= bs, else copied from each column into a
    // local vector's worth of bytes; writes are s[i * bc + j ..]
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
            let mut out = [[0f32; 8]; R];
            let op = out.as_mut_ptr().cast();
            if off + j + 8 <= bs {
                // The column holds eight values from off + j: the last keys and positions of
                // the block after them, whose lanes are computed and dropped (each lane is its
                // own chain, so the kept ones are the same bits). Copying the last keys out
                // would cost a library call and a load stalled on the copy's stores per
                // column, for every decode step whose cache is not a multiple of eight long.
                score_keys::<R, 1>(
                    qp,
                    hd,
                    |c, _| L::load8(column(c), off + j),
                    ColumnHint::NONE,
                    op,
                    8,
                );
            } else {
                let key = |c, _| {
                    let mut tail = [0u8; 32];
                    std::ptr::copy_nonoverlapping(
                        column(c).add((off + j) * es),
                        tail.as_mut_ptr(),
                        n * es,
                    );
                    L::load8(tail.as_ptr(), 0)
                };
                score_keys::<R, 1>(qp, hd, key, ColumnHint::NONE, op, 8);
            }
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
#[allow(clippy::too_many_arguments)]
pub(super) fn widen_columns(
    _: Avx2,
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
    // SAFETY: the token proves `widen`'s features; it checks the shapes.
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

/// Sixteen keys kept by column (a whole vector of AVX-512 lanes), for [`score_segments`]: where
/// their first column lies, and the lines to ask for while they are scored.
#[derive(Copy, Clone)]
pub(super) struct Segment {
    /// Value 0 of the sixteen keys' first column; column `c` is `c * column` bytes on.
    pub(super) keys: *const u8,
    /// The bytes these keys will take in the next tile (a tile on, see `Ahead::leads`), or
    /// null: their lines are asked for over the columns.
    pub(super) ahead: *const u8,
    /// Their sixteen value rows, back to back, asked for the same way (the weighted sum reads
    /// them after the scores and the exponentials).
    pub(super) values: *const u8,
}

/// The most segments [`score_segments`] scores in one pass: a 64-wide head's tile of 64 keys.
pub(super) const MAX_SEGMENTS: usize = 4;

/// [`scores_columns`] with AVX-512 for up to [`MAX_SEGMENTS`] segments of sixteen keys kept by
/// column, side by side: `s[i][16 w + l] = q_i . key l of segment w`, each score the same chain
/// of multiply-adds over the dimensions in order, so the bits are `scores_columns`'s. `column`
/// is the bytes from one column of a block to the next (`block size x value size`), the same
/// for every segment of one view. The gain over the AVX2 loop is the width; a tile is one call.
///
/// Each segment's key and value lines (as many as its keys: a block of sixteen positions) are
/// asked for over the columns, one line per segment and side every `64 / (16 x value size)`
/// columns, into L2 (`prefetcht1`). Into L1 (`prefetcht0`, what the AVX2 loops use) the
/// requests would hold the L1 miss buffers the loads need.
///
/// # Safety
/// Each segment's keys hold `hd` columns of sixteen values of type `ty` (f32, f16 or bf16) at `column` bytes apart; `q` is `R x hd`;
/// `s` holds `(R - 1) * bc + 16 * segs.len()` scores.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn score_segments<const R: usize>(
    _: Avx512,
    q: &[f32],
    ty: KvType,
    segs: &[Segment],
    column: usize,
    s: &mut [f32],
    bc: usize,
) {
    use super::kernels_lanes::{Bf16Lanes, F16Lanes, F32Lanes};
    let n = segs.len();
    assert!(
        (1..=MAX_SEGMENTS).contains(&n) && 16 * n <= bc && s.len() >= (R - 1) * bc + 16 * n,
        "flash key segments: shapes"
    );
    macro_rules! by_count {
        ($l:ty) => {
            match n {
                1 => score_segs::<$l, R, 1>(q, segs, column, s, bc),
                2 => score_segs::<$l, R, 2>(q, segs, column, s, bc),
                3 => score_segs::<$l, R, 3>(q, segs, column, s, bc),
                _ => score_segs::<$l, R, 4>(q, segs, column, s, bc),
            }
        };
    }
    // SAFETY: the token proves `score_segs`'s features; the caller guarantees the shapes.
    unsafe {
        match ty {
            KvType::F32 => by_count!(F32Lanes),
            KvType::F16 => by_count!(F16Lanes),
            KvType::Bf16 => by_count!(Bf16Lanes),
            KvType::Q8_0 => unreachable!("Q8_0 keys are kept by rows"),
        }
    }
}

#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn score_segs<L: super::kernels_lanes::Lanes16, const R: usize, const N: usize>(
    q: &[f32],
    segs: &[Segment],
    column: usize,
    s: &mut [f32],
    bc: usize,
) {
    let hd = q.len() / R;
    let es = L::TY.bytes(1);
    // Columns per line of a segment's keys (and of its values, as many bytes).
    let every = (64 / (16 * es)).max(1);
    let seg: [Segment; N] = std::array::from_fn(|w| segs[w]);
    let ahead = !seg[0].ahead.is_null();
    let (qp, sp) = (q.as_ptr(), s.as_mut_ptr());
    // SAFETY: key loads read 16 values at c * column of each segment's keys with c < hd (the
    // caller's shapes); q[i * hd + c] has i < R; writes are s[i * bc + 16 w ..+16] with
    // 16 N <= bc (asserted by `score_segments`). Prefetches never fault.
    unsafe {
        let mut a = [[_mm512_setzero_ps(); N]; R];
        let mut c = 0;
        while c < hd {
            let at = c * 16 * es;
            for sg in &seg {
                if ahead {
                    _mm_prefetch::<_MM_HINT_T1>(sg.ahead.wrapping_add(at).cast());
                }
                _mm_prefetch::<_MM_HINT_T1>(sg.values.wrapping_add(at).cast());
            }
            for cc in c..(c + every).min(hd) {
                let k: [__m512; N] =
                    std::array::from_fn(|w| L::load16(seg[w].keys.add(cc * column), 0));
                for (i, ai) in a.iter_mut().enumerate() {
                    let qc = _mm512_set1_ps(*qp.add(i * hd + cc));
                    for (aw, &kw) in ai.iter_mut().zip(&k) {
                        *aw = _mm512_fmadd_ps(qc, kw, *aw);
                    }
                }
            }
            c += every;
        }
        for (i, ai) in a.iter().enumerate() {
            for (w, &aw) in ai.iter().enumerate() {
                _mm512_storeu_ps(sp.add(i * bc + 16 * w), aw);
            }
        }
    }
}

/// A decode tile's scores from keys kept by column with AVX-512: keys `j0..j0 + jn` of head
/// `kvh`, whole segments of sixteen keys [`MAX_SEGMENTS`] at a time ([`score_segments`]), a
/// block's last keys short of sixteen by [`scores_columns`]; row `i`'s scores at
/// `s[i * bc + j]`. The keys' lines a tile on (where `Ahead::leads` says the next tile
/// continues this one) and the values of these keys are asked for as the columns are read.
///
/// # Safety
/// `k` keeps its keys by column (f32, f16 or bf16), `v` its values by row; `q` is `R x hd`, `s` holds `R x bc` and `jn <= bc`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile_scores_wide<const R: usize>(
    t: Avx512,
    q: &[f32],
    k: &KvView,
    v: &KvView,
    kvh: usize,
    hd: usize,
    j0: usize,
    jn: usize,
    s: &mut [f32],
    bc: usize,
    ahead: &mut Ahead,
) {
    let ty = k.ty();
    let es = ty.bytes(1);
    let lead = ahead.leads()[0];
    let ahead_at = if lead > 0 {
        k.head_start(kvh, hd, j0) + lead
    } else {
        0
    };
    let none = Segment {
        keys: std::ptr::null(),
        ahead: std::ptr::null(),
        values: std::ptr::null(),
    };
    let (mut segs, mut n, mut first, mut column) = ([none; MAX_SEGMENTS], 0, 0, 0);
    // The run of value rows that holds key `v_at` on.
    let (mut v_run, mut v_at) = (v.head_run(kvh, hd, j0, jn), 0);
    let mut j = 0;
    // SAFETY: forwarded (the segments are whole sixteen-key
    // parts of the blocks `head_block` gives, the values sixteen rows of one value block).
    unsafe {
        // A macro, not a closure: a closure is its own function, which a build in many codegen
        // units may leave uninlined, outside this function's target features.
        macro_rules! flush {
            () => {{
                score_segments::<R>(t, q, ty, &segs[..n], column, &mut s[first..], bc);
                ahead.advance(16 * n);
            }};
        }
        while j < jn {
            let (bytes, bs, off, m) = k.head_block(kvh, hd, j0 + j, jn - j);
            column = bs * es;
            let whole = m / 16 * 16;
            let mut x = 0;
            while x < whole {
                let jj = j + x;
                if jj >= v_at + v_run.2 {
                    (v_run, v_at) = (v.head_run(kvh, hd, j0 + jj, jn - jj), jj);
                }
                if n == 0 {
                    first = jj;
                }
                segs[n] = Segment {
                    keys: bytes.as_ptr().add((off + x) * es),
                    ahead: if lead > 0 {
                        std::ptr::without_provenance(ahead_at + jj * hd * es)
                    } else {
                        std::ptr::null()
                    },
                    values: v_run.0[(jj - v_at) * v_run.1..].as_ptr(),
                };
                n += 1;
                if n == MAX_SEGMENTS {
                    flush!();
                    n = 0;
                }
                x += 16;
            }
            if whole < m {
                if n > 0 {
                    flush!();
                    n = 0;
                }
                let jj = j + whole;
                if jj >= v_at + v_run.2 {
                    (v_run, v_at) = (v.head_run(kvh, hd, j0 + jj, jn - jj), jj);
                }
                let (v_bytes, v_stride, v_rows) = v_run;
                let rows_here = (m - whole).min(v_at + v_rows - jj);
                let values = Some(LineHint::spread(
                    v_bytes[(jj - v_at) * v_stride..].as_ptr(),
                    rows_here * v_stride,
                    hd,
                ));
                scores_columns::<R>(
                    t.avx2(),
                    q,
                    bytes,
                    ty,
                    bs,
                    off + whole,
                    m - whole,
                    &mut s[jj..],
                    bc,
                    ahead,
                    values,
                );
            }
            j += m;
        }
        if n > 0 {
            flush!();
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;
    use crate::kv::{CacheShape, KvFormat, KvPool, KvSequence};

    /// A decode tile scored in AVX-512 segments gives the bits of the AVX2 loop over its
    /// blocks one by one: blocks of 16 positions (a segment each), of 32 (two segments of one
    /// block), of 8 and 24 (keys short of a segment, scored by the AVX2 loop inside the same
    /// tile), blocks scattered through the pool, tiles that start mid-sequence and end short.
    #[test]
    fn segments_give_the_bits_of_block_by_block_scores() {
        let Some(t) =
            crate::cpu::token_for_test::<Avx512>("segments_give_the_bits_of_block_by_block_scores")
        else {
            return;
        };
        const R: usize = 3;
        let (hd, bc) = (64, 64);
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let q: Vec<f32> = (0..R * hd)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        for ty in [KvType::F32, KvType::F16, KvType::Bf16] {
            for bs in [8, 16, 24, 32] {
                let mut pool =
                    KvPool::new(1, CacheShape::new(3, hd), KvFormat::both(ty), bs, 64).unwrap();
                let (a, b) = (pool.add_sequence(1024), pool.add_sequence(1024));
                // Sequence a takes every other block after its first two.
                for (id, n) in [(a, 2 * bs), (b, bs), (a, bs), (b, bs), (a, 3 * bs + 5)] {
                    let rows: Vec<f32> = (0..n * 3 * hd)
                        .map(|_| rng.random_range(-1.0f32..1.0))
                        .collect();
                    let mut seq = pool.slot(id);
                    seq.reserve(n).unwrap();
                    seq.append(0, &rows, &rows);
                    seq.commit(n);
                }
                let (k, v) = pool.layer(a, 0);
                assert!(k.columns());
                for (j0, jn) in [(0, 64), (0, 17), (0, 1), (64, 64), (64, 40)] {
                    if j0 >= k.len() {
                        continue;
                    }
                    let jn = jn.min(k.len() - j0);
                    let mut want = vec![0f32; R * bc];
                    let mut j = 0;
                    while j < jn {
                        let (bytes, bs, off, m) = k.head_block(1, hd, j0 + j, jn - j);
                        scores_columns::<R>(
                            t.avx2(),
                            &q,
                            bytes,
                            ty,
                            bs,
                            off,
                            m,
                            &mut want[j..],
                            bc,
                            &mut Ahead::default(),
                            None,
                        );
                        j += m;
                    }
                    let mut got = vec![f32::NAN; R * bc];
                    // SAFETY: `k` keeps f32, f16 or bf16 keys by column, `v` values by row; `q`
                    // is R x hd, `got` R x bc and jn <= bc.
                    unsafe {
                        tile_scores_wide::<R>(
                            t,
                            &q,
                            &k,
                            &v,
                            1,
                            hd,
                            j0,
                            jn,
                            &mut got,
                            bc,
                            &mut Ahead::default(),
                        )
                    };
                    for i in 0..R {
                        let bits = |s: &[f32]| {
                            s[i * bc..][..jn]
                                .iter()
                                .map(|x| x.to_bits())
                                .collect::<Vec<_>>()
                        };
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "{ty} bs {bs} keys {j0}+{jn} row {i}"
                        );
                    }
                }
            }
        }
    }
}
