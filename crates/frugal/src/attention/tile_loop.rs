//! One span of flash attention: the rows of one KV head (a query block's tokens times the
//! query heads that share the head) against the keys of one chunk, tile by tile, with the online
//! softmax that `flash` (the driver: which spans run where, and how their results merge)
//! describes. [`block`] picks how many rows share each key and value load and the
//! instruction-set level, once per span; [`tiles`] is the tile loop, written once over the
//! level's [`TileKernel`] (`kernel`: the portable loops, the scalar twin; `kernels_*`: the
//! AVX2, AVX-512 and VNNI leaves).

use std::cell::RefCell;

use super::ahead::Ahead;
use super::flash::{Job, Span};
use super::kernel::{Columns, Portable, Rows, TileKernel};
use super::q8_keys::{KeyRows, QuantQueries};
#[cfg(target_arch = "x86_64")]
use crate::cpu::Avx2;
use crate::kv::KvType;

pub(super) use super::kernel::exp_approx;
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

pub(super) fn grow(v: &mut Vec<f32>, n: usize) {
    if v.len() < n {
        v.resize(n, 0.0);
    }
}

/// Query rows computed together by default: their scores and outputs share every load of a key
/// or value (three for GQA groups of three; see `block`). Every row's sums run in the same
/// order whatever the count, so the bits do not depend on it.
pub(super) const R: usize = 4;

/// Leaves, for each row of `span`, the unnormalized output in `acc` (`rows x head_dim`), the
/// running max in `m` and the running sum in `l` over the visible keys of `span.lo..span.hi`.
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
        block_at::<3>(job, span, acc, m, l, t)
    } else {
        block_at::<R>(job, span, acc, m, l, t)
    }
}

/// The span's level, chosen once: the SIMD leaves need whole vectors of keys and head
/// dimensions; other shapes take the portable loops (compiled for AVX2 where the CPU has it).
fn block_at<const R: usize>(
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(a) = job.simd {
        let whole = job.bc.is_multiple_of(8) && job.s.head_dim.is_multiple_of(16);
        // SAFETY: the token proves the loop's features.
        return unsafe {
            match (job.vnni, job.wide) {
                (Some(v), _) if whole => tiles_avx2::<_, R>(a, v, job, span, acc, m, l, t),
                (None, Some(w)) if whole => tiles_avx2::<_, R>(a, w, job, span, acc, m, l, t),
                _ if whole => tiles_avx2::<_, R>(a, a, job, span, acc, m, l, t),
                _ => tiles_avx2::<_, R>(a, Portable, job, span, acc, m, l, t),
            }
        };
    }
    tiles::<_, R>(Portable, job, span, acc, m, l, t)
}

/// [`tiles`] compiled for AVX2: the level's leaves inline into it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn tiles_avx2<K: TileKernel, const R: usize>(
    _: Avx2,
    isa: K,
    job: &Job,
    span: Span,
    acc: &mut [f32],
    m: &mut [f32],
    l: &mut [f32],
    t: &mut Tiles,
) {
    tiles::<K, R>(isa, job, span, acc, m, l, t)
}

/// Where a tile's keys are for its scores.
#[derive(Copy, Clone)]
enum Keys {
    /// Transposed into `Tiles::kt`.
    Tile,
    /// Q8_0 rows where they lie (`KeyRows`), scored in integers.
    Q8,
    /// Kept by column, scored where they lie.
    Columns(Columns),
}

/// The tile loop of [`block`], `R` query rows at a time, at level `isa`.
#[inline(always)]
fn tiles<K: TileKernel, const R: usize>(
    isa: K,
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
    let bc = job.bc;
    let rows = (span.t1 - span.t0) * group;
    // Rows are taken R at a time; the last block is padded with zero queries (never stored).
    let padded = rows.next_multiple_of(R);
    grow(&mut t.q, padded * hd);
    grow(&mut t.kraw, bc * hd);
    grow(&mut t.kt, bc * hd);
    grow(&mut t.vt, bc * hd);
    grow(&mut t.s, R * bc);
    grow(&mut t.pv, R * hd);
    load_queries(job, span, padded, t);
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
    let fused = job
        .fused
        .and(isa.wide())
        .filter(|_| rows == R)
        .and_then(|w| super::decode_fused::fused_views(&job.k, &job.v, hd, bc).map(|a| (w, a)));
    #[cfg(not(target_arch = "x86_64"))]
    let fused: Option<()> = None;
    // The cache rows of the first tile at once, then each next tile's spread over this one's
    // work (`ahead`). The last tile's plan reaches into the keys after the span: a thread takes
    // a run of consecutive chunks of one KV head (the team claims runs, `crate::team`), so
    // that is most often the first tile of its next chunk, which would otherwise start cold.
    // A fused run asks for each next tile's lines from the one before, past the end of its
    // chunk into the next one, so the first tile's were asked for then.
    for kv in [&job.k, &job.v].into_iter().filter(|_| fused.is_none()) {
        if j0 < kv.len() {
            kv.prefetch_head(span.kvh, hd, j0, (kv.len() - j0).min(bc));
        }
    }
    while j0 < hi {
        let nb = (hi - j0).min(bc);
        #[cfg(target_arch = "x86_64")]
        if let Some((w, (ka, va))) = &fused {
            let taken = super::decode_fused::span_tiles::<R>(
                *w,
                job,
                span,
                (ka, va),
                j0,
                nb,
                hi,
                t,
                acc,
                m,
                l,
            );
            if taken > 0 {
                j0 += taken;
                continue;
            }
        }
        t.ahead.plan(&job.k, &job.v, span.kvh, hd, j0 + nb, bc, nb);
        let keys = load_keys(isa, job, span.kvh, j0, nb, rows <= R, &mut key_rows, t);
        // Values in place only for a few rows (decode): more rows re-read the tile once per
        // R of them, which a decoded tile serves from L1. The bits are the same either way.
        let v_in_place = isa.values_in_place() && rows <= 2 * R;
        if !v_in_place {
            job.v
                .decode_head(span.kvh, hd, j0, nb, &mut t.vt[..nb * hd]);
        }
        for rb in (0..rows).step_by(R) {
            let (js, jn) = visible::<R>(job, span, rb, rows, j0, nb);
            let jmax = jn.iter().copied().max().unwrap_or(0);
            if jmax == 0 {
                continue; // every row's part of the tile is in the future
            }
            let sb = &mut t.s[..R * bc];
            let qb = &t.q[rb * hd..(rb + R) * hd];
            match keys {
                Keys::Q8 => {
                    isa.scores_q8::<R>(&t.qq, rb, hd, &key_rows, jmax, bc, sb, &mut t.ahead)
                }
                Keys::Columns(c) => c.tile_scores::<R>(
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
                ),
                Keys::Tile => isa.scores::<R>(qb, &t.kt, bc, jmax, sb),
            }
            let corr = softmax::<K, R>(isa, sb, bc, js, jn, &mut m[rb..], &mut l[rb..]);
            // The tile's p.v is summed on its own, then added: two-level summation keeps the
            // rounding error growing with (tile + tiles) rather than with every key.
            let pv = &mut t.pv[..R * hd];
            if v_in_place {
                // The tile's runs (a paged cache's blocks) in order, each continuing the sums.
                let mut j = 0;
                while j < jmax {
                    let (bytes, stride, n) = job.v.head_run(span.kvh, hd, j0 + j, jmax - j);
                    let v = Rows {
                        bytes,
                        stride,
                        ty: job.v.ty(),
                    };
                    isa.weighted_values::<R>(&sb[j..], bc, v, hd, n, pv, j > 0, &mut t.ahead);
                    j += n;
                }
            } else {
                let v = Rows::f32(&t.vt[..nb * hd], hd);
                isa.weighted_values::<R>(sb, bc, v, hd, jmax, pv, false, &mut t.ahead);
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

/// The block's queries into `t.q`, pre-scaled by 1/sqrt(d): row r = token (r / group), head
/// (r % group), zero rows up to `padded`; over a Q8_0 key cache, the same rows of the call's
/// quantized queries into `t.qq` instead (inlined: compiled with the loop's features).
#[inline(always)]
fn load_queries(job: &Job, span: Span, padded: usize, t: &mut Tiles) {
    let s = job.s;
    let (hd, group) = (s.head_dim, s.n_head / s.n_head_kv);
    let q_dim = s.n_head * hd;
    let rows = (span.t1 - span.t0) * group;
    if let Some(qq) = job.qq {
        t.qq.clear();
        for tok in span.t0..span.t1 {
            let first = tok * s.n_head + span.kvh * group;
            t.qq.extend_from(qq, first..first + group, hd);
        }
        t.qq.pad(padded - rows, hd);
    } else {
        for tok in span.t0..span.t1 {
            for g in 0..group {
                let r = (tok - span.t0) * group + g;
                let h = span.kvh * group + g;
                let src = &job.q[tok * q_dim + h * hd..][..hd];
                for (d, &x) in t.q[r * hd..][..hd].iter_mut().zip(src) {
                    *d = x * job.scale;
                }
            }
        }
    }
    t.q[rows * hd..padded * hd].fill(0.0);
}

/// Keys `j0..j0 + nb` of head `kvh` made ready for their scores: Q8_0 keys located for the
/// integer scores; keys kept by column left where they lie for a few rows (`few`) or widened
/// into the tile; other keys transposed into the tile, from the cache where the level reads
/// their type in place, else from their decoded rows.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn load_keys<'a, K: TileKernel>(
    isa: K,
    job: &Job<'a>,
    kvh: usize,
    j0: usize,
    nb: usize,
    few: bool,
    key_rows: &mut KeyRows<'a>,
    t: &mut Tiles,
) -> Keys {
    let (hd, bc, k) = (job.s.head_dim, job.bc, &job.k);
    if job.qq.is_some() {
        key_rows.clear();
        while key_rows.len() < nb {
            let j = key_rows.len();
            let (bytes, stride, m) = k.head_run(kvh, hd, j0 + j, nb - j);
            key_rows.push_run(bytes, stride, m);
        }
        return Keys::Q8;
    }
    let in_place = isa.keys_in_place(k.ty());
    if in_place
        && k.columns()
        && let Some(c) = isa.columns()
    {
        if few {
            return Keys::Columns(c);
        }
        c.widen_keys(k, kvh, hd, j0, nb, &mut t.kt, bc, &mut t.ahead);
    } else if in_place {
        let mut j = 0;
        while j < nb {
            let (bytes, stride, m) = k.head_run(kvh, hd, j0 + j, nb - j);
            let rows = Rows {
                bytes,
                stride,
                ty: k.ty(),
            };
            isa.transpose_keys(rows, m, hd, &mut t.kt, bc, j, &mut t.ahead);
            j += m;
        }
    } else {
        k.decode_head(kvh, hd, j0, nb, &mut t.kraw[..nb * hd]);
        let rows = Rows::f32(&t.kraw[..nb * hd], hd);
        isa.transpose_keys(rows, nb, hd, &mut t.kt, bc, 0, &mut t.ahead);
    }
    Keys::Tile
}

/// The keys of the tile at `j0` (`nb` of them) that rows `rb..rb + R` see: `js[i]..jn[i]`
/// (causal: up to the row's own position; under a window, from its first visible key). A row
/// that sees none of the tile, or lies past the block's `rows`, has `jn == 0`.
#[inline(always)]
fn visible<const R: usize>(
    job: &Job,
    span: Span,
    rb: usize,
    rows: usize,
    j0: usize,
    nb: usize,
) -> ([usize; R], [usize; R]) {
    let group = job.s.n_head / job.s.n_head_kv;
    let (mut js, mut jn) = ([0usize; R], [0usize; R]);
    for (i, (s_i, n_i)) in js.iter_mut().zip(&mut jn).enumerate() {
        let pos = job.pos0 + span.t0 + (rb + i) / group;
        *s_i = job.s.first_visible(pos).saturating_sub(j0).min(nb);
        let end = (pos + 1).saturating_sub(j0).min(nb);
        *n_i = if rb + i < rows && *s_i < end { end } else { 0 };
    }
    (js, jn)
}

/// The online softmax's step over one tile for `R` rows: the scores `sb` (`R x bc`) become
/// their weights `exp(s - m')` (0 outside each row's `js..jn`), each row's running maximum
/// `m` and sum `l` move to the tile's, and the factor that rescales what the row had is
/// returned.
#[inline(always)]
fn softmax<K: TileKernel, const R: usize>(
    isa: K,
    sb: &mut [f32],
    bc: usize,
    js: [usize; R],
    jn: [usize; R],
    m: &mut [f32],
    l: &mut [f32],
) -> [f32; R] {
    let jmax = jn.iter().copied().max().unwrap_or(0);
    // Every row seeing the same keys of the tile (a decode step's rows: one token's query
    // heads): their exponentials side by side, the same bits as row by row.
    if (0..R).all(|i| jn[i] == jmax && js[i] == js[0]) {
        let j_s = js[0];
        let m_new: [f32; R] =
            std::array::from_fn(|i| m[i].max(isa.row_max(&sb[i * bc + j_s..][..jmax - j_s])));
        let corr = isa.exp_lanes(std::array::from_fn(|i| m[i] - m_new[i]));
        let sums = isa.exp_rows::<R>(sb, bc, j_s, jmax, m_new);
        for i in 0..R {
            sb[i * bc..i * bc + j_s].fill(0.0);
            l[i] = l[i] * corr[i] + sums[i];
            m[i] = m_new[i];
        }
        return corr;
    }
    let mut corr = [0f32; R];
    for (i, &n_i) in jn.iter().enumerate() {
        let sr = &mut sb[i * bc..i * bc + jmax];
        if n_i == 0 {
            sr.fill(0.0);
            continue;
        }
        let j_s = js[i];
        let m_new = m[i].max(isa.row_max(&sr[j_s..n_i]));
        // exp(-inf) ~ 0 on the first tile: nothing accumulated yet to rescale.
        corr[i] = exp_approx(m[i] - m_new);
        let sum = isa.exp_row(&mut sr[j_s..n_i], m_new);
        // Keys outside the row's view weigh 0: adding 0 x v changes no bits.
        sr[..j_s].fill(0.0);
        sr[n_i..].fill(0.0);
        l[i] = l[i] * corr[i] + sum;
        m[i] = m_new;
    }
    corr
}
