//! One span of flash attention: the rows of one KV head (a query block's tokens times the
//! query heads that share the head) against the keys of one chunk, tile by tile, with the online
//! softmax that `flash` (the driver: which spans run where, and how their results merge)
//! describes. `block` picks how many rows share each key and value load; `block_body` is the
//! tile loop, written once and compiled both portably (the scalar twin) and for AVX2, with
//! explicit AVX2 / AVX-512 inner loops (`kernels_avx2`, `kernels_columns`, `kernels_avx512`,
//! `q8_keys`) where the shapes allow and the portable loops below where they do not.

use std::cell::RefCell;

use super::ahead::Ahead;
use super::flash::{Job, Span};
use super::kernel::{Portable, TileKernel};
use super::q8_keys::{self, KeyRows, QuantQueries};
use crate::cpu::Avx2;
use crate::kv::KvType;

/// Per-thread tiles, reused across calls (bounded by the tile sizes, not the sequence).
#[derive(Default)]
pub(super) struct Tiles {
    pub(super) q: Vec<f32>,
    pub(super) acc: Vec<f32>,
    pub(super) m: Vec<f32>,
    pub(super) l: Vec<f32>,
    pub(super) kraw: Vec<f32>,
    pub(super) kt: Vec<f32>,
    pub(super) vt: Vec<f32>,
    pub(super) s: Vec<f32>,
    pub(super) pv: Vec<f32>,
    /// The block's queries quantized, over a Q8_0 key cache.
    pub(super) qq: QuantQueries,
    /// The next tile's cache lines, requested as this tile's keys are computed.
    pub(super) ahead: Ahead,
}

thread_local! {
    pub(super) static TILES: RefCell<Tiles> = RefCell::new(Tiles::default());
}

/// The bytes of `v` (what the strided SIMD kernels read, from a decoded tile or the cache).
#[cfg(target_arch = "x86_64")]
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: any initialized f32 is 4 initialized bytes, u8 has alignment 1, and the length is
    // the same memory measured in bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

pub(super) fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

pub(super) fn block(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    let rows = (span.t1 - span.t0) * (job.s.n_head / job.s.n_head_kv);
    // Three rows at a time when four would pad the block by more than a tenth: a decode step
    // (or a short verification) of a GQA model whose KV heads serve three query heads each
    // (SmolLM2) would otherwise compute a fourth, empty row beside every three. Long
    // blocks keep four, which shares each key and value load more widely.
    if rows.is_multiple_of(3) && 10 * (rows.next_multiple_of(R) - rows) > rows {
        block_rows::<3>(job, span, acc, m, l, t)
    } else {
        block_rows::<R>(job, span, acc, m, l, t)
    }
}

fn block_rows<const RR: usize>(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(a) = job.simd {
        // SAFETY: the token proves the loop's features.
        return unsafe { block_avx2::<RR>(a, job, span, acc, m, l, t) };
    }
    block_body::<RR>(job, span, acc, m, l, t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_avx2<const R: usize>(
    _: Avx2,
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    block_body::<R>(job, span, acc, m, l, t)
}

/// Query rows computed together by default: their scores and outputs share every load of a key
/// or value (three for GQA groups of three; see `block`). Every row's sums run in the same
/// order whatever the count, so the bits do not depend on it.
pub(super) const R: usize = 4;

/// Leaves, for each row of `span`, the unnormalized output in `acc` (`rows x head_dim`), the
/// running max in `m` and the running sum in `l` over the visible keys of `span.lo..span.hi`,
/// `R` query rows at a time.
#[inline(always)]
fn block_body<const R: usize>(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    let s = job.s;
    let hd = s.head_dim;
    let group = s.n_head / s.n_head_kv;
    let q_dim = s.n_head * hd;
    let bc = job.bc;
    let rows = (span.t1 - span.t0) * group;
    // The explicit AVX2 inner loops need whole vectors of keys and head dimensions.
    let fast = job
        .simd
        .filter(|_| cfg!(target_arch = "x86_64") && bc.is_multiple_of(8) && hd.is_multiple_of(16));
    // Rows are taken R at a time; the last block is padded with zero queries (never stored).
    let padded = rows.next_multiple_of(R);
    grow(&mut t.q, padded * hd);
    grow(&mut t.kraw, bc * hd);
    grow(&mut t.kt, bc * hd);
    grow(&mut t.vt, bc * hd);
    grow(&mut t.s, R * bc);
    grow(&mut t.pv, R * hd);
    // Queries of the block, pre-scaled by 1/sqrt(d): row r = token (r / group), head (r % group);
    // over a Q8_0 key cache, the same rows of the call's quantized queries.
    if let Some(qq) = job.qq {
        t.qq.clear();
        for tok in span.t0..span.t1 {
            let first = tok * s.n_head + span.kvh * group;
            t.qq.extend_from(qq, first..first + group, hd);
        }
        t.qq.pad(padded - rows, hd);
    }
    let k_q8 = job.qq.is_some();
    for tok in (span.t0..span.t1).filter(|_| !k_q8) {
        for g in 0..group {
            let r = (tok - span.t0) * group + g;
            let h = span.kvh * group + g;
            let src = &job.q[tok * q_dim + h * hd..][..hd];
            for (d, &x) in t.q[r * hd..][..hd].iter_mut().zip(src) {
                *d = x * job.scale;
            }
        }
    }
    t.q[rows * hd..padded * hd].fill(0.0);
    // Where each key of a tile lies, for the integer scores (its keys may lie in several runs).
    let mut key_rows = KeyRows::new(KvType::Q8_0.bytes(hd));
    acc[..rows * hd].fill(0.0);
    m[..rows].fill(f32::NEG_INFINITY);
    l[..rows].fill(0.0);
    // Keys past the last query of the block are above the diagonal for every row: never read.
    let hi = span.hi.min(job.pos0 + span.t1);
    // Under a window, tiles wholly before the first row's window are never read either (tiles
    // stay at the same absolute offsets from the chunk start).
    let first = s.first_visible(job.pos0 + span.t0);
    let mut j0 = span.lo + first.saturating_sub(span.lo) / bc * bc;
    // Decode's whole tiles over keys by column in one pass (`decode_fused`): the block's rows
    // are one query block of exactly `R` rows.
    #[cfg(target_arch = "x86_64")]
    let fused = if fast.is_some()
        && let Some(w) = job.fused
        && rows == R
    {
        super::decode_fused::fused_views(&job.k, &job.v, hd, bc).map(|views| (w, views))
    } else {
        None
    };
    #[cfg(target_arch = "x86_64")]
    let skip_first = fused.is_some();
    #[cfg(not(target_arch = "x86_64"))]
    let skip_first = false;
    // The cache rows of the first tile at once, then each next tile's spread over this one's
    // work (`ahead`). The last tile's plan reaches into the keys after the span: a thread takes
    // a run of consecutive chunks of one KV head (the team claims runs, `crate::team`), so
    // that is most often the first tile of its next chunk, which would otherwise start cold.
    // A fused run asks for each next tile's lines from the one before, past the end of its
    // chunk into the next one, so the first tile's were asked for then.
    for kv in [&job.k, &job.v].into_iter().filter(|_| !skip_first) {
        if j0 < kv.len() {
            kv.prefetch_head(span.kvh, hd, j0, (kv.len() - j0).min(bc));
        }
    }
    while j0 < hi {
        let nb = (hi - j0).min(bc);
        // Tiles every row sees whole (none past its position or before its window) take the
        // fused pass, as one run; so does the last tile when the cache ends inside it (decode's
        // last keys), as a run of one tile of the sixteen-key segments that hold them.
        #[cfg(target_arch = "x86_64")]
        if let Some((w, (ka, va))) = &fused
            && (nb == bc || j0 + nb == job.k.len())
            && job.pos0 + span.t0 + 1 >= j0 + nb
            && s.first_visible(job.pos0 + span.t1 - 1) <= j0
        {
            let (tiles, tile, valid) = if nb == bc {
                ((hi.min(job.pos0 + span.t0 + 1) - j0) / bc, bc, bc)
            } else {
                (1, nb.next_multiple_of(16), nb)
            };
            let run = super::decode_fused::Run::new(
                job,
                ka,
                va,
                span.kvh,
                j0,
                (tiles, tile, valid),
                None,
            );
            // SAFETY: the views are those `fused_views` took; the run's tiles are whole and in the cache
            // (`j0 + tiles * bc <= hi <= len`; `j0` a multiple of the tile, itself of sixteen),
            // or it is one tile whose `valid` keys end the cache, in segments of blocks the
            // cache holds (blocks are whole segments, `fused_views`).
            unsafe { super::decode_fused::tiles_in::<R>(*w, job, &run, t, acc, m, l) };
            j0 += (run.tiles - 1) * bc + run.valid;
            continue;
        }
        t.ahead.plan(&job.k, &job.v, span.kvh, hd, j0 + nb, bc, nb);
        // The cache is read in place on the SIMD path: f32, f16 or bf16 keys transposed
        // straight from it, Q8_0 keys scored in integers where they lie, values of every
        // format weighted where they lie, widened as they are loaded.
        #[cfg(target_arch = "x86_64")]
        let (k_in_place, v_fmt_in_place) = (
            fast.filter(|_| super::kernels_avx2::reads_in_place(job.k.ty())),
            fast,
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (k_in_place, v_fmt_in_place) = (None::<Avx2>, None::<Avx2>);
        // A few rows over keys kept by column: scored straight from the cache, no tile.
        let direct = k_in_place.filter(|_| job.k.columns() && rows <= R);
        if k_q8 {
            key_rows.clear();
            while key_rows.len() < nb {
                let j = key_rows.len();
                let (bytes, stride, m) = job.k.head_run(span.kvh, hd, j0 + j, nb - j);
                key_rows.push_run(bytes, stride, m);
            }
        } else if direct.is_some() {
            // Keys kept by column are scored where they lie (below), one block at a time.
        } else if let Some(a) = k_in_place
            && job.k.columns()
        {
            // Keys kept by column: each block's columns widened into the tile's.
            let mut j = 0;
            while j < nb {
                let (bytes, bs, off, m) = job.k.head_block(span.kvh, hd, j0 + j, nb - j);
                #[cfg(target_arch = "x86_64")]
                super::kernels_columns::widen_columns(
                    a,
                    bytes,
                    job.k.ty(),
                    bs,
                    off,
                    m,
                    hd,
                    &mut t.kt,
                    bc,
                    j,
                    &mut t.ahead,
                );
                j += m;
            }
        } else if let Some(a) = k_in_place {
            let mut j = 0;
            while j < nb {
                let (bytes, stride, m) = job.k.head_run(span.kvh, hd, j0 + j, nb - j);
                #[cfg(target_arch = "x86_64")]
                super::kernels_avx2::transpose_rows(
                    a,
                    bytes,
                    stride,
                    job.k.ty(),
                    m,
                    hd,
                    &mut t.kt,
                    bc,
                    j,
                    &mut t.ahead,
                );
                j += m;
            }
        } else {
            job.k
                .decode_head(span.kvh, hd, j0, nb, &mut t.kraw[..nb * hd]);
            if let Some(a) = fast {
                #[cfg(target_arch = "x86_64")]
                super::kernels_avx2::transpose_rows(
                    a,
                    f32_bytes(&t.kraw[..nb * hd]),
                    4 * hd,
                    KvType::F32,
                    nb,
                    hd,
                    &mut t.kt,
                    bc,
                    0,
                    &mut t.ahead,
                );
            } else {
                Portable.transpose_keys(&t.kraw[..nb * hd], nb, hd, &mut t.kt, bc);
            }
        }
        // Values in place only for a few rows (decode): more rows re-read the tile once per
        // R of them, which a decoded tile serves from L1. The bits are the same either way.
        let v_in_place = v_fmt_in_place.filter(|_| rows <= 2 * R);
        if v_in_place.is_none() {
            job.v
                .decode_head(span.kvh, hd, j0, nb, &mut t.vt[..nb * hd]);
        }
        for rb in (0..rows).step_by(R) {
            // Visible keys of this tile per row: `js..jn` (causal: up to the row's own
            // position; under a window, from its first visible key). A row that sees none of
            // the tile has `jn == 0`.
            let (mut js, mut jn) = ([0usize; R], [0usize; R]);
            for (i, (s_i, n_i)) in js.iter_mut().zip(&mut jn).enumerate() {
                let pos = job.pos0 + span.t0 + (rb + i) / group;
                *s_i = s.first_visible(pos).saturating_sub(j0).min(nb);
                let end = (pos + 1).saturating_sub(j0).min(nb);
                *n_i = if rb + i < rows && *s_i < end { end } else { 0 };
            }
            let jmax = jn.iter().copied().max().unwrap_or(0);
            if jmax == 0 {
                continue; // every row's part of the tile is in the future
            }
            let sb = &mut t.s[..R * bc];
            let qb = &t.q[rb * hd..(rb + R) * hd];
            if k_q8 {
                let keys = &key_rows;
                #[cfg(target_arch = "x86_64")]
                if let Some(v) = job.vnni {
                    // SAFETY: the token proves the kernel's features.
                    unsafe {
                        super::kernels_vnni::scores_q8::<R>(
                            v,
                            &t.qq,
                            rb,
                            hd,
                            keys,
                            jmax,
                            bc,
                            sb,
                            &mut t.ahead,
                        )
                    }
                } else if let Some(a) = fast
                    && hd <= super::kernels_q8_avx2::MAX_BLOCKS * crate::kv::Q8_0_BLOCK
                {
                    // SAFETY: the token proves the kernel's features.
                    unsafe {
                        super::kernels_q8_avx2::scores_q8::<R>(
                            a,
                            &t.qq,
                            rb,
                            hd,
                            keys,
                            jmax,
                            bc,
                            sb,
                            &mut t.ahead,
                        )
                    }
                } else {
                    q8_keys::scores::<R>(&t.qq, rb, hd, keys, jmax, bc, sb);
                }
                #[cfg(not(target_arch = "x86_64"))]
                q8_keys::scores::<R>(&t.qq, rb, hd, keys, jmax, bc, sb);
            } else if direct.is_some()
                && let Some(w) = job.wide
            {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: keys kept by column are f32, f16 or bf16 (`direct`), values by row;
                // `qb` is R x hd, `sb` R x bc, and jmax <= bc.
                unsafe {
                    super::kernels_columns::tile_scores_wide::<R>(
                        w,
                        qb,
                        &job.k,
                        &job.v,
                        span.kvh,
                        hd,
                        j0,
                        jmax,
                        sb,
                        bc,
                        &mut t.ahead,
                    )
                };
            } else if let Some(a) = direct {
                // The run of value rows that holds key j (from `v_at`), for the values' lines
                // the scores ask for.
                let (mut v_run, mut v_at) = (job.v.head_run(span.kvh, hd, j0, jmax), 0);
                let mut j = 0;
                while j < jmax {
                    let (bytes, bs, off, m) = job.k.head_block(span.kvh, hd, j0 + j, jmax - j);
                    if j >= v_at + v_run.2 {
                        (v_run, v_at) = (job.v.head_run(span.kvh, hd, j0 + j, jmax - j), j);
                    }
                    let (v_bytes, v_stride, v_rows) = v_run;
                    let rows_here = m.min(v_at + v_rows - j);
                    #[cfg(target_arch = "x86_64")]
                    let values = Some(super::kernels_avx2::LineHint::spread(
                        v_bytes[(j - v_at) * v_stride..].as_ptr(),
                        rows_here * v_stride,
                        hd,
                    ));
                    #[cfg(target_arch = "x86_64")]
                    super::kernels_columns::scores_columns::<R>(
                        a,
                        qb,
                        bytes,
                        job.k.ty(),
                        bs,
                        off,
                        m,
                        &mut sb[j..],
                        bc,
                        &mut t.ahead,
                        values,
                    );
                    j += m;
                }
            } else if let Some(a) = fast {
                #[cfg(target_arch = "x86_64")]
                if let Some(w) = job.wide {
                    // SAFETY: the token proves the loop's features.
                    unsafe { super::kernels_avx512::scores::<R>(w, qb, &t.kt, bc, jmax, sb) }
                } else {
                    // SAFETY: the token proves the loop's features.
                    unsafe { super::kernels_avx2::scores::<R>(a, qb, &t.kt, bc, jmax, sb) }
                }
            } else {
                Portable.scores::<R>(qb, &t.kt, bc, jmax, sb);
            }
            let mut corr = [0f32; R];
            // Every row seeing the same keys of the tile (a decode step's rows: one token's
            // query heads): their exponentials side by side, the same bits as row by row.
            #[cfg(target_arch = "x86_64")]
            let together = fast.filter(|_| (0..R).all(|i| jn[i] == jmax && js[i] == js[0]));
            #[cfg(not(target_arch = "x86_64"))]
            let together = None::<Avx2>;
            #[cfg(target_arch = "x86_64")]
            if let Some(a) = together {
                let (j_s, mut m_new) = (js[0], [0f32; R]);
                for (i, mi) in m_new.iter_mut().enumerate() {
                    // SAFETY: the token proves the loop's features.
                    let tile_max = unsafe {
                        super::kernels_avx2::row_max(a, &sb[i * bc + j_s..][..jmax - j_s])
                    };
                    *mi = m[rb + i].max(tile_max);
                }
                // SAFETY: as above.
                corr = unsafe {
                    super::kernels_avx2::exp_lanes(std::array::from_fn(|i| m[rb + i] - m_new[i]))
                };
                // SAFETY: as above.
                let sums =
                    unsafe { super::kernels_avx2::exp_rows::<R>(a, sb, bc, j_s, jmax, m_new) };
                for i in 0..R {
                    sb[i * bc..i * bc + j_s].fill(0.0);
                    let r = rb + i;
                    l[r] = l[r] * corr[i] + sums[i];
                    m[r] = m_new[i];
                }
            }
            for (i, &n_i) in jn.iter().enumerate().filter(|_| together.is_none()) {
                let sr = &mut sb[i * bc..i * bc + jmax];
                if n_i == 0 {
                    sr.fill(0.0);
                    continue;
                }
                let r = rb + i;
                let j_s = js[i];
                let tile_max = if let Some(a) = fast {
                    #[cfg(target_arch = "x86_64")]
                    if let Some(w) = job.wide {
                        // SAFETY: the token proves the loop's features.
                        unsafe { super::kernels_avx512::row_max(w, &sr[j_s..n_i]) }
                    } else {
                        // SAFETY: the token proves the loop's features.
                        unsafe { super::kernels_avx2::row_max(a, &sr[j_s..n_i]) }
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("{a:?}")
                } else {
                    Portable.row_max(&sr[j_s..n_i])
                };
                let m_new = m[r].max(tile_max);
                // exp(-inf) ~ 0 on the first tile: nothing accumulated yet to rescale.
                corr[i] = exp_approx(m[r] - m_new);
                let sum = if let Some(a) = fast {
                    #[cfg(target_arch = "x86_64")]
                    if let Some(w) = job.wide {
                        // SAFETY: the token proves the loop's features.
                        unsafe { super::kernels_avx512::exp_row(w, &mut sr[j_s..n_i], m_new) }
                    } else {
                        // SAFETY: the token proves the loop's features.
                        unsafe { super::kernels_avx2::exp_row(a, &mut sr[j_s..n_i], m_new) }
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    unreachable!("{a:?}")
                } else {
                    Portable.exp_row(&mut sr[j_s..n_i], m_new)
                };
                // Keys outside the row's view weigh 0: adding 0 x v changes no bits.
                sr[..j_s].fill(0.0);
                sr[n_i..].fill(0.0);
                l[r] = l[r] * corr[i] + sum;
                m[r] = m_new;
            }
            // The tile's p.v is summed on its own, then added: two-level summation keeps the
            // rounding error growing with (tile + tiles) rather than with every key.
            let pv = &mut t.pv[..R * hd];
            // The SIMD weighted values at the widest level the job has (a macro, not a
            // closure: see `kernels_columns::tile_scores_wide`).
            #[cfg(target_arch = "x86_64")]
            macro_rules! weighted {
                ($a:expr, $p:expr, $v:expr, $stride:expr, $ty:expr, $jn:expr, $acc:expr) => {
                    if let Some(w) = job.wide {
                        super::kernels_avx512::weighted_values::<R>(
                            w,
                            $p,
                            bc,
                            $v,
                            $stride,
                            $ty,
                            hd,
                            $jn,
                            pv,
                            $acc,
                            &mut t.ahead,
                        )
                    } else {
                        super::kernels_avx2::weighted_values::<R>(
                            $a,
                            $p,
                            bc,
                            $v,
                            $stride,
                            $ty,
                            hd,
                            $jn,
                            pv,
                            $acc,
                            &mut t.ahead,
                        )
                    }
                };
            }
            if let Some(a) = v_in_place {
                // The tile's runs (a paged cache's blocks) in order, each continuing the sums.
                let mut j = 0;
                while j < jmax {
                    let (bytes, stride, m) = job.v.head_run(span.kvh, hd, j0 + j, jmax - j);
                    #[cfg(target_arch = "x86_64")]
                    weighted!(a, &sb[j..], bytes, stride, job.v.ty(), m, j > 0);
                    j += m;
                }
            } else if let Some(a) = fast {
                #[cfg(target_arch = "x86_64")]
                weighted!(
                    a,
                    sb,
                    f32_bytes(&t.vt[..nb * hd]),
                    4 * hd,
                    KvType::F32,
                    jmax,
                    false
                );
            } else {
                Portable.weighted_values::<R>(sb, bc, &t.vt, hd, jmax, pv);
            }
            for (i, &n_i) in jn.iter().enumerate() {
                if n_i == 0 {
                    continue;
                }
                let ar = &mut acc[(rb + i) * hd..][..hd];
                for (a, &b) in ar.iter_mut().zip(&pv[i * hd..(i + 1) * hd]) {
                    *a = *a * corr[i] + b;
                }
            }
        }
        t.ahead.finish();
        j0 += nb;
    }
}

/// `s[j] = exp(s[j] - max)`; returns their sum (the scalar twin of `kernels_avx2::exp_row`).
#[inline(always)]
pub(super) fn exp_row(s: &mut [f32], max: f32) -> f32 {
    let mut sum = 0f32;
    for x in s.iter_mut() {
        *x = exp_approx(*x - max);
        sum += *x;
    }
    sum
}

/// `e^x` for `x <= 0` ([`crate::ops::exp_poly`]; inputs below -87 give e^-87, as a softmax
/// weight next to the row maximum's 1 indistinguishable from 0).
#[inline(always)]
pub(super) fn exp_approx(x: f32) -> f32 {
    crate::ops::exp_poly(x.min(0.0))
}

/// Constants of [`exp_approx`] (shared with its AVX2 twin, which must compute the same bits).
pub(super) use crate::ops::{EXP_LN2_HI, EXP_LN2_LO, EXP_LOG2E, EXP_MIN, EXP_POLY, EXP_ROUND};

/// `s[i][j] = q_i . k_j` for `R` query rows (`q` is `R x hd`) and keys `0..jn` of a tile stored
/// transposed (`kt[c * bc + j]`), into `s` (`R x bc`). Eight keys by `R` rows at a time, their
/// sums in registers across the head dimension: each loaded key vector serves `R` rows. Each sum
/// still runs over `c` in order, as the plain loop does. Key columns past `jn` up to the next
/// multiple of 8 are computed on whatever the tile holds there and must be ignored.
#[inline(always)]
pub(super) fn scores<const R: usize>(q: &[f32], kt: &[f32], bc: usize, jn: usize, s: &mut [f32]) {
    const W: usize = 8;
    let hd = q.len() / R;
    let mut j = 0;
    while j < jn {
        if j + W > bc {
            // A tile width that is not a multiple of 8: finish column by column.
            for jj in j..jn {
                for i in 0..R {
                    s[i * bc + jj] = (0..hd)
                        .map(|c| q[i * hd + c] * kt[c * bc + jj])
                        .fold(0.0, |a, b| a + b);
                }
            }
            break;
        }
        let mut a = [[0f32; W]; R];
        for c in 0..hd {
            let k = &kt[c * bc + j..c * bc + j + W];
            for (i, ai) in a.iter_mut().enumerate() {
                let qc = q[i * hd + c];
                for (x, &kv) in ai.iter_mut().zip(k) {
                    *x += qc * kv;
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            s[i * bc + j..i * bc + j + W].copy_from_slice(ai);
        }
        j += W;
    }
}

/// `pv[i] = sum_j p[i][j] * v_j` for `R` rows (`p` is `R x bc`, `v` row-major with `hd` per key,
/// keys `0..jn`). Sixteen output values by `R` rows stay in registers across the keys: each
/// loaded value vector serves `R` rows. Each sum still runs over `j` in order.
#[inline(always)]
pub(super) fn weighted_values<const R: usize>(
    p: &[f32],
    bc: usize,
    v: &[f32],
    hd: usize,
    jn: usize,
    pv: &mut [f32],
) {
    const W: usize = 16;
    let mut d0 = 0;
    while d0 + W <= hd {
        let mut a = [[0f32; W]; R];
        for j in 0..jn {
            let vj = &v[j * hd + d0..j * hd + d0 + W];
            for (i, ai) in a.iter_mut().enumerate() {
                let pj = p[i * bc + j];
                for (x, &vv) in ai.iter_mut().zip(vj) {
                    *x += pj * vv;
                }
            }
        }
        for (i, ai) in a.iter().enumerate() {
            pv[i * hd + d0..i * hd + d0 + W].copy_from_slice(ai);
        }
        d0 += W;
    }
    if d0 < hd {
        for i in 0..R {
            let out = &mut pv[i * hd + d0..(i + 1) * hd];
            out.fill(0.0);
            for j in 0..jn {
                let pj = p[i * bc + j];
                for (a, &b) in out.iter_mut().zip(&v[j * hd + d0..(j + 1) * hd]) {
                    *a += pj * b;
                }
            }
        }
    }
}
