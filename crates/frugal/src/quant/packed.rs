//! Block-quantized weights re-laid out at load time for the 8-bit-activation kernels.
//!
//! GGUF stores each row's blocks one after another. Here rows are taken in groups of eight and,
//! for each block column (32 elements, or a 256-element K-quant super-block), the group's scales
//! are stored together in a header, followed by the data of each 32-element unit (see
//! `quant::unit`) interleaved four elements at a time across the eight rows. Per unit:
//!
//! ```text
//! Q8_0:              8 vectors of 32 bytes: vector i = elements 4i..4i+4 of rows 0..8
//! 4-bit (Q4_0, Q4_1, MXFP4, Q4_K, IQ4_NL, IQ4_XS): 4 chunks of 32 bytes; byte j of row r in
//!                    chunk c holds element 8c+j in its low nibble and 8c+4+j in its high nibble
//! Q5_0, Q5_1, Q5_K:  the 4 nibble chunks, then 32 bytes of fifth bits: row r's word at 4r has,
//!                    in byte j, bit i = the fifth bit of element 4i+j
//! Q6_K:              the 4 nibble chunks, then 2 x 32 bytes of top bit pairs: in word k of row
//!                    r, byte j bits 2i..2i+2 = the top bits of element 4(4k+i)+j
//! Q2_K:              2 chunks of 32 bytes of bit pairs: in chunk c, byte j of row r, bits
//!                    2i..2i+2 = the code of element 4(4c+i)+j
//! Q3_K:              Q2_K's chunks holding the low two bits, then 32 bytes of third bits
//!                    arranged as Q5's fifth bits
//! ```
//!
//! Headers (r = row within the group): Q8_0/Q4_0/Q5_0/IQ4_NL `d[8]` (f16); Q4_1/Q5_1 `d[8]
//! m[8]`; MXFP4 `e[8]` (E8M0 bytes); Q4_K/Q5_K `d[8] dmin[8]` then the 6-bit scales and mins
//! widened to bytes, `sc[unit][8]`, `m[unit][8]` (32 bytes per super-block column more than the
//! file, so the kernel never unpacks 6-bit fields); Q6_K `d[8]` and `sc[16][8]` (i8); Q3_K the
//! same with its 6-bit scales widened to `s - 32`; IQ4_XS `d[8]` and `ls[unit][8]` (i8, `ls -
//! 32`); Q2_K `d[8] dmin[8]` and its scale bytes as stored, `S[16][8]` (scale low nibble, min
//! high nibble: unpacked in the kernel).
//!
//! So one 32-byte load, masked (or shifted), is eight rows' next four weights, and one
//! `vpdpbusd` against four activation bytes broadcast to all lanes adds them into eight per-row
//! sums: the lanes are the rows, one conversion and one scale multiply finish a unit for eight
//! rows at once, and no horizontal sums are needed. Apart from the widened 6-bit scales (Q4_K,
//! Q5_K, Q3_K, IQ4_XS) these are the same bytes as the file, rearranged into one sequential
//! stream per group. (llama.cpp's load-time repacking
//! follows the same idea.) The last group is padded with zero rows.

use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use crate::pages::Pages;

use super::act::{PairActs, PairRow, Q8Acts, Q8Row, WideActs, WidePairActs, WidePairRow, WideRow};
use super::kernels;
use super::matmul::{RowsOut, par_row_groups, par_row_groups_many};
use super::unit::{UNIT, has_units, int_of, unit, unit_dot};
use super::{GgmlType, QuantError, WeightMatrix};

mod amx;
mod layout;

pub use layout::{Layout, column_bytes, layout, packed_unit};
use layout::{put_codes, put_header};

/// Rows per packed group.
pub const GROUP: usize = 8;

/// A weight matrix in the grouped layout; its products take 8-bit activations.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    data: Bytes,
}

/// Where a packed matrix's bytes live: a buffer of its own, or its range of one buffer that a
/// model's matrices share, on huge pages where the system grants them ([`crate::pages`]): a
/// decode step reads every matrix once, and a layer's matrices (0.1-0.6 MB each for SmolLM2)
/// are each smaller than a huge page.
#[derive(Clone, Debug)]
enum Bytes {
    Own(Vec<u8>),
    Shared(Arc<Pages>, Range<usize>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Own(v) => v,
            Bytes::Shared(p, r) => &p[r.clone()],
        }
    }
}

impl PackedMatrix {
    /// Repacks `w` (any format with a [`layout`]).
    pub fn pack(w: &WeightMatrix) -> Result<Self, QuantError> {
        let n = Self::packed_len(w).ok_or(QuantError::Unsupported(w.ty))?;
        let mut data = vec![0u8; n];
        Self::pack_into(w, &mut data);
        Ok(PackedMatrix {
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            data: Bytes::Own(data),
        })
    }

    /// The bytes [`Self::pack`] gives `w`, or `None` for a format with no packed layout.
    pub fn packed_len(w: &WeightMatrix) -> Option<usize> {
        let l = layout(w.ty)?;
        Some(w.rows.div_ceil(GROUP) * (w.cols / l.span) * l.column_bytes())
    }

    /// [`Self::pack`] for each of `ws`, into one buffer (`Bytes::Shared`); `done(i)` is
    /// called once matrix `i` is written, to release its source. Where that buffer cannot be
    /// had, each gets its own. Formats with no packed layout are the caller's to leave out.
    pub fn pack_shared(ws: &[WeightMatrix], mut done: impl FnMut(usize)) -> Vec<Self> {
        let lens: Vec<usize> = ws
            .iter()
            .map(|w| Self::packed_len(w).expect("a packed type"))
            .collect();
        // Each matrix from a cache line on.
        let starts: Vec<usize> = lens
            .iter()
            .scan(0usize, |end, &n| {
                let start = end.next_multiple_of(64);
                *end = start + n;
                Some(start)
            })
            .collect();
        let total = starts.last().zip(lens.last()).map_or(0, |(s, n)| s + n);
        let Ok(mut pages) = Pages::zeroed(total, true) else {
            return ws
                .iter()
                .enumerate()
                .map(|(i, w)| {
                    let p = Self::pack(w).expect("a packed type");
                    done(i);
                    p
                })
                .collect();
        };
        for (i, w) in ws.iter().enumerate() {
            Self::pack_into(w, &mut pages[starts[i]..starts[i] + lens[i]]);
            done(i);
        }
        let pages = Arc::new(pages);
        ws.iter()
            .enumerate()
            .map(|(i, w)| Self::shared(w, pages.clone(), starts[i]..starts[i] + lens[i]))
            .collect()
    }

    /// A matrix whose packed bytes ([`Self::pack_into`]) are `range` of `pages`.
    fn shared(w: &WeightMatrix, pages: Arc<Pages>, range: Range<usize>) -> Self {
        debug_assert_eq!(Some(range.len()), Self::packed_len(w));
        PackedMatrix {
            ty: w.ty,
            rows: w.rows,
            cols: w.cols,
            data: Bytes::Shared(pages, range),
        }
    }

    /// Writes the packed layout of `w` into `data` ([`Self::packed_len`] zeroed bytes).
    fn pack_into(w: &WeightMatrix, data: &mut [u8]) {
        let l = layout(w.ty).expect("a packed type");
        debug_assert!(has_units(w.ty));
        let nb = w.cols / l.span;
        let col = l.column_bytes();
        assert_eq!(Some(data.len()), Self::packed_len(w), "packed matrix size");
        let src_block = w.ty.block_bytes();
        data.par_chunks_mut(nb * col)
            .enumerate()
            .for_each(|(g, out)| {
                for r in 0..GROUP {
                    let row = g * GROUP + r;
                    if row >= w.rows {
                        break; // zero rows: zero scales contribute nothing
                    }
                    let src = w.row(row);
                    for b in 0..nb {
                        let blk = &src[b * src_block..(b + 1) * src_block];
                        let dst = &mut out[b * col..(b + 1) * col];
                        put_header(w.ty, blk, r, &mut dst[..l.head]);
                        for u in 0..l.units() {
                            let codes = unit(w.ty, blk, u).codes;
                            put_codes(w.ty, &codes, r, &mut dst[l.head + u * l.unit..]);
                        }
                    }
                }
            });
    }

    fn group_bytes(&self) -> usize {
        let l = layout(self.ty).expect("packed type");
        self.cols / l.span * l.column_bytes()
    }

    /// Bytes of group `g` (rows `8g..8g+8`).
    pub fn group(&self, g: usize) -> &[u8] {
        let gb = self.group_bytes();
        &self.data[g * gb..(g + 1) * gb]
    }

    /// Heap bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// Scalar kernel on the packed layout: each unit read back, then the reference arithmetic of
/// `unit::unit_dot`.
pub fn dot_group_scalar(ty: GgmlType, group: &[u8], x: Q8Row, out: &mut [f32; GROUP]) {
    let l = layout(ty).expect("packed type");
    let col = l.column_bytes();
    *out = [0.0; GROUP];
    for (c, column) in group
        .chunks_exact(col)
        .take(x.qs.len() / l.span)
        .enumerate()
    {
        for (r, o) in out.iter_mut().enumerate() {
            for u in 0..l.units() {
                let b = c * l.units() + u;
                let pu = packed_unit(ty, column, r, u);
                *o += unit_dot(ty, &pu, x, b);
            }
        }
    }
}

/// Scalar kernel for Q8_0 groups with 15-bit activations (`act::WideActs`).
pub fn dot_group_wide_scalar(group: &[u8], x: WideRow, out: &mut [f32; GROUP]) {
    let ty = GgmlType::Q8_0;
    let col = column_bytes(ty);
    *out = [0.0; GROUP];
    for (c, column) in group.chunks_exact(col).take(x.d.len()).enumerate() {
        for (r, o) in out.iter_mut().enumerate() {
            let u = packed_unit(ty, column, r, 0);
            let isum: i32 = (0..UNIT)
                .map(|e| int_of(ty, u.codes[e]) * x.q(UNIT * c + e))
                .sum();
            *o += isum as f32 * (u.scale[0] * x.d[c]);
        }
    }
}

/// Output rows per parallel task for one token (8 groups).
const MATVEC_ROWS: usize = 32;
/// Rows per parallel task for many tokens.
const MATMUL_ROWS: usize = 16;

/// Tokens per kernel call for many tokens: each unit's unpacked weights serve up to sixteen.
/// A verification pass of up to sixteen rows then unpacks each weight unit once; with calls of
/// four, rows five to eight unpacked everything again and cost half as much more each (Zen 2,
/// AVX2: passes of 5 to 17 rows 6-15% cheaper, pp512 +5%, speculative decoding on
/// input-grounded prompts 1.66-1.69x -> 1.78x in the same session). The kernels' per-token
/// sums spill to L1 past four tokens, which costs less than the unpacking saved.
const TOKENS_PER_CALL: usize = 16;

/// Rows of quantized activations that packed groups multiply: 8-bit ([`Q8Acts`]) or 15-bit
/// ([`WideActs`], Q8_0 weights only).
pub trait PackedActs: Sync {
    type Row<'a>: Copy
    where
        Self: 'a;
    /// Rows and row length.
    fn shape(&self) -> (usize, usize);
    /// The rows as 8-bit activations, when they are (the two-token kernels take those).
    fn as_q8(&self) -> Option<&Q8Acts> {
        None
    }
    /// The rows as 15-bit activations, when they are.
    fn as_wide(&self) -> Option<&WideActs> {
        None
    }
    fn row(&self, t: usize) -> Self::Row<'_>;
    /// `out[t][r] = dot(row r of the group, xs[t])`.
    fn dot<const T: usize>(
        isa: kernels::Isa,
        ty: GgmlType,
        group: &[u8],
        xs: &[Self::Row<'_>; T],
        out: &mut [[f32; GROUP]; T],
    );
}

impl PackedActs for Q8Acts {
    type Row<'a> = Q8Row<'a>;
    fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }
    fn as_q8(&self) -> Option<&Q8Acts> {
        Some(self)
    }
    fn row(&self, t: usize) -> Q8Row<'_> {
        Q8Acts::row(self, t)
    }
    fn dot<const T: usize>(
        isa: kernels::Isa,
        ty: GgmlType,
        group: &[u8],
        xs: &[Q8Row<'_>; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        kernels::dot_packed(isa, ty, group, xs, out);
    }
}

impl PackedActs for WideActs {
    type Row<'a> = WideRow<'a>;
    fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }
    fn as_wide(&self) -> Option<&WideActs> {
        Some(self)
    }
    fn row(&self, t: usize) -> WideRow<'_> {
        WideActs::row(self, t)
    }
    fn dot<const T: usize>(
        isa: kernels::Isa,
        ty: GgmlType,
        group: &[u8],
        xs: &[WideRow<'_>; T],
        out: &mut [[f32; GROUP]; T],
    ) {
        assert_eq!(
            ty,
            GgmlType::Q8_0,
            "15-bit activations meet Q8_0 weights only"
        );
        kernels::dot_packed_wide(isa, group, xs, out);
    }
}

/// `y[t] = W x[t]` for every activation row (`y` is `n x rows`, token-major). Each task takes a
/// tile of rows (in L1/L2) and sweeps every token over it, four tokens per kernel call, writing
/// its rows of each token straight into `y`. At least 16 rows of 8-bit activations go through
/// AMX's tiles where the CPU has them (`amx`, every packed format), with the same bits.
pub fn matmul_packed<A: PackedActs>(w: &PackedMatrix, x: &A, y: &mut [f32]) {
    let (n, k) = x.shape();
    assert_eq!(k, w.cols, "matmul input length");
    assert_eq!(y.len(), n * w.rows, "matmul output length");
    let isa = kernels::detect();
    if let Some(q) = x.as_q8()
        && let Some(t) = amx::amx_for(w, n)
    {
        return amx::matmul_tiles(amx::TileKernel::Amx(t), w, q, y);
    }
    if n >= 2
        && kernels::pairs_available(isa, w.ty)
        && let Some(q) = x.as_q8()
    {
        return PAIRS.with_borrow_mut(|pairs| {
            pairs.fill(q);
            let tail = (n % 2 == 1).then(|| q.row(n - 1));
            matmul_pairs(isa, w, n, &*pairs, tail, y)
        });
    }
    if n >= 2
        && matches!(isa, kernels::Isa::Avx512Vnni(_))
        && w.ty == GgmlType::Q8_0
        && let Some(q) = x.as_wide()
    {
        return WIDE_PAIRS.with_borrow_mut(|pairs| {
            pairs.fill(q);
            let tail = (n % 2 == 1).then(|| q.row(n - 1));
            matmul_pairs(isa, w, n, &*pairs, tail, y)
        });
    }
    matmul_by_groups(isa, w, x, y);
}

/// [`matmul_packed`] through the one-token kernels on `isa` ([`kernels::dot_packed`] and
/// [`kernels::dot_packed_wide`]), sixteen tokens per call.
fn matmul_by_groups<A: PackedActs>(isa: kernels::Isa, w: &PackedMatrix, x: &A, y: &mut [f32]) {
    let n = x.shape().0;
    let tile = if n == 1 { MATVEC_ROWS } else { MATMUL_ROWS };
    par_row_groups(w.rows, n, tile, y, |r0, rows, out| {
        rows_times_tokens(isa, w, x, n, r0, rows, out)
    });
}

/// `y_m = W_m x` for `M` matrices of the same input row (decode: a layer's queries, keys and
/// values), as [`matmul_packed`] computes each, in one parallel section: three sections of
/// which two are a third of the third's size each waited for their own last tiles (keys and
/// values took as long as the queries). The same tasks, so the same bits.
pub fn matvec_packed_many<A: PackedActs, const M: usize>(
    ws: [&PackedMatrix; M],
    x: &A,
    ys: [&mut [f32]; M],
) {
    let (n, k) = x.shape();
    assert_eq!(n, 1, "one activation row");
    for (w, y) in ws.iter().zip(&ys) {
        assert_eq!(k, w.cols, "matmul input length");
        assert_eq!(y.len(), w.rows, "matmul output length");
    }
    let isa = kernels::detect();
    par_row_groups_many(
        ws.map(|w| w.rows),
        1,
        MATVEC_ROWS,
        ys,
        |m, r0, rows, out| rows_times_tokens(isa, ws[m], x, 1, r0, rows, out),
    );
}

/// Rows `r0..r0 + rows` of `w` (whole groups) times the `n` tokens of `x`: one task of
/// [`matmul_packed`].
fn rows_times_tokens<A: PackedActs>(
    isa: kernels::Isa,
    w: &PackedMatrix,
    x: &A,
    n: usize,
    r0: usize,
    rows: usize,
    out: &mut RowsOut,
) {
    for gi in 0..rows.div_ceil(GROUP) {
        let group = w.group(r0 / GROUP + gi);
        let mut t = 0;
        while t + TOKENS_PER_CALL <= n {
            dot_tokens::<A, TOKENS_PER_CALL>(isa, w.ty, group, x, t, gi, out);
            t += TOKENS_PER_CALL;
        }
        // The last one to fifteen tokens in one call too, so their unpacked weights are
        // shared as well (a verification pass is usually that short).
        macro_rules! tail {
            ($($k:literal)*) => {
                match n - t {
                    0 => {}
                    $($k => dot_tokens::<A, $k>(isa, w.ty, group, x, t, gi, out),)*
                    _ => unreachable!("fewer than TOKENS_PER_CALL tokens remain"),
                }
            };
        }
        tail!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }
}

/// Tokens `t..t + T` of `x` times packed group `gi` of the task, written to `out`.
fn dot_tokens<A: PackedActs, const T: usize>(
    isa: kernels::Isa,
    ty: GgmlType,
    group: &[u8],
    x: &A,
    t: usize,
    gi: usize,
    out: &mut RowsOut,
) {
    let xs: [A::Row<'_>; T] = std::array::from_fn(|i| x.row(t + i));
    let mut o = [[0f32; GROUP]; T];
    A::dot(isa, ty, group, &xs, &mut o);
    for (dt, ot) in o.iter().enumerate() {
        out.put(t + dt, gi * GROUP, ot);
    }
}

thread_local! {
    /// The caller's interleaved activations for [`matmul_pairs`] (reused across products).
    static PAIRS: std::cell::RefCell<PairActs> = std::cell::RefCell::new(PairActs::default());
    /// The same for 15-bit activations.
    static WIDE_PAIRS: std::cell::RefCell<WidePairActs> =
        std::cell::RefCell::new(WidePairActs::default());
}

/// Activation rows interleaved two by two for the two-token kernels: 8-bit ([`PairActs`]) or
/// 15-bit ([`WidePairActs`], Q8_0 weights only).
pub trait Interleaved: Sync {
    type Row<'a>: Copy + Sync
    where
        Self: 'a;
    /// One token's row of the same precision (an odd last token).
    type Single<'a>: Copy + Sync;
    fn pairs(&self) -> usize;
    fn row(&self, p: usize) -> Self::Row<'_>;
    /// `out[p][j][r] = dot(row r of the group, token j of pair p)`, and the tail token's
    /// products into its output.
    fn dot<const P: usize>(
        isa: kernels::Isa,
        ty: GgmlType,
        group: &[u8],
        xs: &[Self::Row<'_>; P],
        out: &mut [[[f32; GROUP]; 2]; P],
        tail: Option<(Self::Single<'_>, &mut [f32; GROUP])>,
    );
}

impl Interleaved for PairActs {
    type Row<'a> = PairRow<'a>;
    type Single<'a> = Q8Row<'a>;
    fn pairs(&self) -> usize {
        self.pairs
    }
    fn row(&self, p: usize) -> PairRow<'_> {
        PairActs::row(self, p)
    }
    fn dot<const P: usize>(
        isa: kernels::Isa,
        ty: GgmlType,
        group: &[u8],
        xs: &[PairRow<'_>; P],
        out: &mut [[[f32; GROUP]; 2]; P],
        tail: Option<(Q8Row<'_>, &mut [f32; GROUP])>,
    ) {
        kernels::dot_pairs(isa, ty, group, xs, out, tail);
    }
}

impl Interleaved for WidePairActs {
    type Row<'a> = WidePairRow<'a>;
    type Single<'a> = WideRow<'a>;
    fn pairs(&self) -> usize {
        self.pairs
    }
    fn row(&self, p: usize) -> WidePairRow<'_> {
        WidePairActs::row(self, p)
    }
    fn dot<const P: usize>(
        isa: kernels::Isa,
        ty: GgmlType,
        group: &[u8],
        xs: &[WidePairRow<'_>; P],
        out: &mut [[[f32; GROUP]; 2]; P],
        tail: Option<(WideRow<'_>, &mut [f32; GROUP])>,
    ) {
        assert_eq!(
            ty,
            GgmlType::Q8_0,
            "15-bit activations meet Q8_0 weights only"
        );
        kernels::dot_wide_pairs(isa, group, xs, out, tail);
    }
}

/// [`matmul_packed`] two tokens per instruction: the first `n / 2` pairs of `pairs` (rows of
/// `x` interleaved two by two) and, for odd `n`, the last row as `tail`, computed by the same
/// call as the last pairs on the same unpacked weights (no padding lane). Pairs go in calls of
/// 8, then one call for the rest (up to 4 at once, so a verification pass of up to nine rows
/// unpacks each unit once; more pairs per call share each unit's unpacked weights more
/// widely: 8 measured 10-15% faster than 4 at 16 tokens). Every output is the same bits as
/// the one-token kernel gives.
fn matmul_pairs<I: Interleaved>(
    isa: kernels::Isa,
    w: &PackedMatrix,
    n: usize,
    pairs: &I,
    tail: Option<I::Single<'_>>,
    y: &mut [f32],
) {
    let np = n / 2;
    debug_assert!(np >= 1 && pairs.pairs() == np && tail.is_some() == (n % 2 == 1));
    // The pairs' views, made once (not per group and call).
    let rows: Vec<_> = (0..np).map(|p| pairs.row(p)).collect();
    // Call sizes: eights, then the remainder in one call of up to four (or two).
    let mut calls = vec![8; np / 8];
    match np % 8 {
        0 => {}
        r @ 1..=4 => calls.push(r),
        r => calls.extend([4, r - 4]),
    }
    par_row_groups(w.rows, n, MATMUL_ROWS, y, |r0, nrows, out| {
        for gi in 0..nrows.div_ceil(GROUP) {
            let group = w.group(r0 / GROUP + gi);
            let mut p = 0;
            for (c, &size) in calls.iter().enumerate() {
                let t = if c + 1 == calls.len() { tail } else { None };
                let call = PairCall {
                    isa,
                    ty: w.ty,
                    group,
                    rows: &rows,
                    p,
                    gi,
                    n,
                };
                match size {
                    8 => call.run::<I, 8>(t, out),
                    4 => call.run::<I, 4>(t, out),
                    3 => call.run::<I, 3>(t, out),
                    2 => call.run::<I, 2>(t, out),
                    _ => call.run::<I, 1>(t, out),
                }
                p += size;
            }
        }
    });
}

/// One two-token kernel call: pairs `p..p + P` of group `gi` (and the tail token, if given).
struct PairCall<'r, 'a, R> {
    isa: kernels::Isa,
    ty: GgmlType,
    group: &'a [u8],
    rows: &'r [R],
    p: usize,
    gi: usize,
    n: usize,
}

impl<R: Copy> PairCall<'_, '_, R> {
    /// Runs the call and writes its outputs into `out` (the tail token is row `n - 1`).
    fn run<'x, I, const P: usize>(&self, tail: Option<I::Single<'_>>, out: &mut RowsOut)
    where
        I: Interleaved<Row<'x> = R> + 'x,
    {
        let xs: &[R; P] = self.rows[self.p..self.p + P].try_into().expect("P pairs");
        let mut o = [[[0f32; GROUP]; 2]; P];
        let mut o1 = [0f32; GROUP];
        I::dot(
            self.isa,
            self.ty,
            self.group,
            xs,
            &mut o,
            tail.map(|t| (t, &mut o1)),
        );
        for (i, op) in o.iter().enumerate() {
            for (j, oj) in op.iter().enumerate() {
                out.put(2 * (self.p + i) + j, self.gi * GROUP, oj);
            }
        }
        if tail.is_some() {
            out.put(self.n - 1, self.gi * GROUP, &o1);
        }
    }
}

#[cfg(test)]
mod tests;
