//! Flash against naive (and both against hand-computed cases).
//!
//! Tolerance: both are exact attention and differ only in the order of f32 additions (online vs
//! two-pass softmax, tiled vs row sums). Each output is a convex combination of value rows, so
//! the rounding error is bounded by a few ulps times log2/sqrt of the number of terms relative
//! to the row's magnitude; over up to 8192 keys that stays below 1e-6 in practice, and the
//! property asserts 1e-5 of each output row's largest magnitude (a per-element relative bound is
//! meaningless for outputs that average to near zero).
//!
//! Inputs are uniform in `[-amp, amp]` with amp up to 2, i.e. scores `q.k/sqrt(d)` with a
//! standard deviation up to ~1.3 and maxima around 5 over thousands of keys (real models are in
//! that range). With much larger scores (amp 4: |s| ~ 40) f32 itself no longer pins the output
//! to 1e-5: one rounding of a score of 40 moves its softmax weight by ~40 x 2^-24 x sqrt(64) ~
//! 2e-5 relative, whichever implementation computes it. Flash's softmax weights come from
//! `exp_approx` (within 2 ulp of `f32::exp`, tested below), which adds at most a few ulps per
//! weight to that budget.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::ahead::Ahead;
use super::flash::flash_with;
use super::*;
use crate::cpu::{self, Avx2, Level};
use crate::kv::{CacheShape, KvFormat, KvPool, KvSequence, KvType};

/// The instruction-set levels attention runs at here, lowest first (AMX adds no attention
/// kernel to AVX-512 VNNI's); the levels left out are printed.
fn levels() -> Vec<Level> {
    let mut v = cpu::levels_for_tests();
    v.retain(|&l| l != Level::Amx);
    v
}

fn random(n: usize, amp: f32, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// Largest `max|a - b| / max|b|` over the (token, head) rows.
pub(crate) fn max_row_rel_err(a: &[f32], b: &[f32], hd: usize) -> f32 {
    a.chunks_exact(hd)
        .zip(b.chunks_exact(hd))
        .map(|(x, y)| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
            let d = x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
            d / scale
        })
        .fold(0f32, f32::max)
}

struct Case {
    s: AttnShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    pos0: usize,
}

fn case(s: AttnShape, len: usize, n: usize, amp: f32, seed: u64) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let kv_dim = s.n_head_kv * s.head_dim;
    Case {
        s,
        q: random(n * s.n_head * s.head_dim, amp, &mut rng),
        k: random(len * kv_dim, amp, &mut rng),
        v: random(len * kv_dim, 1.0, &mut rng),
        pos0: len - n,
    }
}

/// Runs naive, flash (dispatched) and flash (portable); returns the two flash errors.
fn compare(c: &Case) -> (f32, f32) {
    let kv_dim = c.s.n_head_kv * c.s.head_dim;
    let (k, v) = (
        KvView::from_f32(&c.k, kv_dim),
        KvView::from_f32(&c.v, kv_dim),
    );
    let mut want = vec![0f32; c.q.len()];
    naive(c.s, &c.q, k, v, c.pos0, &mut want);
    let mut ws = AttnWorkspace::default();
    let mut got = vec![0f32; c.q.len()];
    flash(c.s, &c.q, k, v, c.pos0, &mut got, &mut ws);
    let mut portable = vec![0f32; c.q.len()];
    flash_with(
        c.s,
        &c.q,
        k,
        v,
        c.pos0,
        &mut portable,
        &mut ws,
        Level::Scalar,
    );
    (
        max_row_rel_err(&got, &want, c.s.head_dim),
        max_row_rel_err(&portable, &want, c.s.head_dim),
    )
}

#[test]
fn single_key_returns_its_value() {
    let s = AttnShape {
        n_head: 2,
        n_head_kv: 1,
        head_dim: 2,
        window: None,
    };
    let q = [1.0, 0.0, 0.0, 1.0];
    let k = [0.3, 0.4];
    let v = [5.0, -1.0];
    let mut out = [0.0; 4];
    causal_attention(s, &q, &k, &v, 0, &mut out);
    assert_eq!(out, [5.0, -1.0, 5.0, -1.0]);
    let mut out = [0.0; 4];
    flash(
        s,
        &q,
        KvView::from_f32(&k, 2),
        KvView::from_f32(&v, 2),
        0,
        &mut out,
        &mut AttnWorkspace::default(),
    );
    assert_eq!(out, [5.0, -1.0, 5.0, -1.0]);
}

#[test]
fn equal_scores_average_the_values_and_mask_the_future() {
    // Two positions, zero queries: query 0 sees only v0, query 1 averages v0 and v1.
    let s = AttnShape {
        n_head: 1,
        n_head_kv: 1,
        head_dim: 1,
        window: None,
    };
    for kind in [Attention::Naive, Attention::Flash] {
        let mut out = [0.0; 2];
        attend(
            kind,
            s,
            &[0.0, 0.0],
            KvView::from_f32(&[1.0, 2.0], 1),
            KvView::from_f32(&[4.0, 8.0], 1),
            0,
            &mut out,
            &mut AttnWorkspace::default(),
        );
        assert_eq!(out, [4.0, 6.0], "{kind}");
    }
}

#[test]
fn names_parse_and_unknown_names_are_typed_errors() {
    assert_eq!("flash".parse::<Attention>(), Ok(Attention::Flash));
    assert_eq!("NAIVE".parse::<Attention>(), Ok(Attention::Naive));
    let e = "fast".parse::<Attention>().unwrap_err();
    assert!(e.to_string().contains("\"fast\""));
}

#[test]
fn full_prefill_and_long_decode_agree() {
    let gqa = AttnShape {
        n_head: 9,
        n_head_kv: 3,
        head_dim: 64,
        window: None,
    };
    // A full causal prefill (several query blocks, partial last tile) and a decode step over a
    // long context (split-KV path), with large scores that force frequent max rescaling.
    for (len, n, amp) in [(1000, 1000, 1.0), (4100, 1, 3.0), (777, 5, 3.0)] {
        let (e, ep) = compare(&case(gqa, len, n, amp, len as u64));
        assert!(e < 1e-5 && ep < 1e-5, "len {len} n {n}: {e} {ep}");
    }
}

#[test]
fn flash_reads_a_paged_quantized_cache_like_naive() {
    // Same stored bytes through a block table: the two differ only in summation order.
    let s = AttnShape {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        window: None,
    };
    let c = case(s, 300, 300, 1.0, 7);
    for ty in [KvType::Q8_0, KvType::F16, KvType::Bf16] {
        let mut pool = KvPool::new(1, CacheShape::new(2, 64), KvFormat::both(ty), 16, 32).unwrap();
        let id = pool.add_sequence(400);
        let mut seq = pool.slot(id);
        seq.reserve(300).unwrap();
        seq.append(0, &c.k, &c.v);
        seq.commit(300);
        let (k, v) = pool.layer(id, 0);
        let mut want = vec![0f32; c.q.len()];
        naive(s, &c.q, k, v, 0, &mut want);
        let mut got = vec![0f32; c.q.len()];
        flash(s, &c.q, k, v, 0, &mut got, &mut AttnWorkspace::default());
        let e = max_row_rel_err(&got, &want, 64);
        assert!(e < 1e-5, "{ty}: {e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any total length 1..=8192, head_dim 64 or 128, MHA/GQA/MQA, any number of new queries
    /// (capped so the naive reference stays quick): flash equals naive within 1e-5.
    #[test]
    fn flash_equals_naive(
        len in 1usize..=8192,
        n_frac in 0.0f64..1.0,
        hd in prop::sample::select(vec![64usize, 128]),
        n_head_kv in 1usize..=2,
        group in 1usize..=3,
        amp in prop::sample::select(vec![0.5f32, 1.0, 2.0]),
        seed in any::<u64>(),
    ) {
        let n = ((len.min(96) as f64 * n_frac) as usize).max(1);
        let s = AttnShape { n_head: n_head_kv * group, n_head_kv, head_dim: hd, window: None };
        let (e, ep) = compare(&case(s, len, n, amp, seed));
        prop_assert!(e < 1e-5, "dispatched: {e}");
        prop_assert!(ep < 1e-5, "portable: {ep}");
    }
}

#[test]
fn exp_approx_is_within_two_ulp_of_exp() {
    // Every 1/4096 over the whole range softmax uses, plus the edges.
    let mut worst = 0f32;
    for i in 0..=(87 * 4096) {
        let x = -(i as f32) / 4096.0;
        let (a, b) = (super::kernel::exp_approx(x), x.exp());
        let ulps = (a - b).abs() / (b * f32::EPSILON);
        worst = worst.max(ulps);
    }
    assert!(worst <= 2.0, "worst error {worst} ulp");
    assert_eq!(super::kernel::exp_approx(0.0), 1.0);
    assert!(super::kernel::exp_approx(f32::NEG_INFINITY) < 2e-38);
}

/// The bytes of `v`, as a cache stores f32 rows.
#[cfg(target_arch = "x86_64")]
fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The AVX2 inner loops of flash against their portable twins on random tiles, including key
/// counts that are not multiples of the vector width, and strided rows read in place.
#[cfg(target_arch = "x86_64")]
#[test]
fn simd_flash_loops_match_the_portable_ones() {
    // Four rows at a time, and three (GQA groups of three).
    simd_loops_match::<4>();
    simd_loops_match::<3>();
}

#[cfg(target_arch = "x86_64")]
fn simd_loops_match<const R: usize>() {
    use super::kernel::{exp_row, scores, weighted_values};
    use super::kernels_avx2;
    let Some(t) = crate::cpu::token_for_test::<Avx2>("simd_loops_match") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    // For three rows, head widths whose value passes are 32, 32 + 16, 32 + 32 and 32 + 32 + 16
    // wide, and tiles whose keys end in a pass of 24, 16 or 8.
    for (hd, bc) in [(64, 64), (128, 32), (16, 24), (32, 40), (48, 24), (80, 32)] {
        let q = random(R * hd, 1.0, &mut rng);
        let kt = random(hd * bc, 1.0, &mut rng);
        let v = random(bc * hd, 1.0, &mut rng);
        for jn in [1, 7, 8, 9, 17, bc - 1, bc] {
            let (mut a, mut b) = (vec![0f32; R * bc], vec![0f32; R * bc]);
            scores::<R>(&q, &kt, bc, jn, &mut a);
            // SAFETY: the token proves the loop's features.
            unsafe { kernels_avx2::scores::<R>(t, &q, &kt, bc, jn, &mut b) };
            for i in 0..R {
                for j in 0..jn {
                    let (x, y) = (a[i * bc + j], b[i * bc + j]);
                    // hd products of magnitude <= 1, summed in another order (and fused).
                    assert!(
                        (x - y).abs() <= hd as f32 * 2.0 * f32::EPSILON,
                        "{x} vs {y}"
                    );
                }
            }
            // Exponentials: the same bits; sums within a few ulps.
            let row: Vec<f32> = a[..jn].to_vec();
            let (mut e1, mut e2) = (row.clone(), row.clone());
            let s1 = exp_row(&mut e1, 1.5);
            // SAFETY: as above.
            let s2 = unsafe { kernels_avx2::exp_row(t, &mut e2, 1.5) };
            assert_eq!(e1, e2);
            assert!((s1 - s2).abs() <= jn as f32 * f32::EPSILON * s1);
            // The rows' exponentials side by side: each row's values and sum are the bits of
            // the row alone, from any first key (a window's) to any last.
            for lo in [0, 1, jn / 2] {
                let maxes: [f32; R] = std::array::from_fn(|i| 0.25 * i as f32 - 0.5);
                let mut together = a.clone();
                // SAFETY: as above.
                let sums =
                    unsafe { kernels_avx2::exp_rows::<R>(t, &mut together, bc, lo, jn, maxes) };
                for (i, &mx) in maxes.iter().enumerate() {
                    let mut alone = a[i * bc..i * bc + bc].to_vec();
                    // SAFETY: as above.
                    let sum = unsafe { kernels_avx2::exp_row(t, &mut alone[lo..jn], mx) };
                    assert_eq!(sums[i].to_bits(), sum.to_bits());
                    assert_eq!(&together[i * bc..i * bc + bc], &alone[..]);
                }
            }
            // The row maximum: the scalar fold's value exactly, NaNs ignored as it ignores
            // them, and -inf for an empty row.
            let fold = |r: &[f32]| r.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x));
            // SAFETY: as above.
            let vmax = |r: &[f32]| unsafe { kernels_avx2::row_max(t, r) };
            assert_eq!(vmax(&row).to_bits(), fold(&row).to_bits());
            let mut holes = row.clone();
            for x in holes.iter_mut().step_by(3) {
                *x = f32::NAN;
            }
            assert_eq!(vmax(&holes).to_bits(), fold(&holes).to_bits());
            assert_eq!(vmax(&[]), f32::NEG_INFINITY);
            let p = random(R * bc, 1.0, &mut rng)
                .iter()
                .map(|x| x.abs())
                .collect::<Vec<_>>();
            let (mut pa, mut pb) = (vec![0f32; R * hd], vec![0f32; R * hd]);
            weighted_values::<R>(&p, bc, &v, hd, jn, &mut pa, false);
            let vb = f32_bytes(&v);
            kernels_avx2::weighted_values::<R>(
                t,
                &p,
                bc,
                &vb,
                4 * hd,
                KvType::F32,
                hd,
                jn,
                &mut pb,
                false,
                &mut Ahead::default(),
            );
            for (x, y) in pa.iter().zip(&pb) {
                assert!(
                    (x - y).abs() <= jn as f32 * 2.0 * f32::EPSILON,
                    "{x} vs {y}"
                );
            }
            // The same keys in two runs of rows spread apart (as a paged cache's blocks hold
            // them, among other heads): the same bits as in one run.
            let stride = 3 * 4 * hd + 4;
            let mut spread = vec![0u8; bc * stride];
            for j in 0..bc {
                spread[j * stride + 4 * hd..][..4 * hd]
                    .copy_from_slice(&vb[4 * hd * j..][..4 * hd]);
            }
            let split = jn / 2;
            let mut pc = vec![0f32; R * hd];
            let at = |j: usize| &spread[j * stride + 4 * hd..];
            if split > 0 {
                kernels_avx2::weighted_values::<R>(
                    t,
                    &p,
                    bc,
                    at(0),
                    stride,
                    KvType::F32,
                    hd,
                    split,
                    &mut pc,
                    false,
                    &mut Ahead::default(),
                );
            }
            kernels_avx2::weighted_values::<R>(
                t,
                &p[split..],
                bc,
                at(split),
                stride,
                KvType::F32,
                hd,
                jn - split,
                &mut pc,
                split > 0,
                &mut Ahead::default(),
            );
            assert_eq!(pb, pc, "values in two strided runs");
            // Keys transposed straight from strided rows, in two runs, against the element loop.
            let mut kt_simd = vec![f32::NAN; hd * bc];
            if split > 0 {
                kernels_avx2::transpose_rows(
                    t,
                    at(0),
                    stride,
                    KvType::F32,
                    split,
                    hd,
                    &mut kt_simd,
                    bc,
                    0,
                    &mut Ahead::default(),
                );
            }
            kernels_avx2::transpose_rows(
                t,
                at(split),
                stride,
                KvType::F32,
                jn - split,
                hd,
                &mut kt_simd,
                bc,
                split,
                &mut Ahead::default(),
            );
            for j in 0..jn {
                for c in 0..hd {
                    assert_eq!(kt_simd[c * bc + j], v[j * hd + c], "key {j} dim {c}");
                }
            }
        }
    }
}

/// A query row's output is the same bits however the rows around it are grouped into calls:
/// all at once (tiled path), in uneven chunks (some short enough for the split path), or one
/// row at a time (decode). This is what makes batched, chunked and cached generation give the
/// same tokens as a lone sequence. Shapes with 1, 2 and 6 key chunks, GQA and MHA, both ISAs.
#[test]
fn rows_are_independent_of_how_calls_group_them() {
    for (s, len) in [
        (
            AttnShape {
                n_head: 9,
                n_head_kv: 3,
                head_dim: 64,
                window: None,
            },
            300,
        ),
        (
            AttnShape {
                n_head: 4,
                n_head_kv: 4,
                head_dim: 32,
                window: None,
            },
            1500,
        ),
        (
            AttnShape {
                n_head: 6,
                n_head_kv: 2,
                head_dim: 48,
                window: None,
            },
            200,
        ),
        // Sliding windows: shorter than a tile, not a multiple of one, longer than a chunk.
        (
            AttnShape {
                n_head: 9,
                n_head_kv: 3,
                head_dim: 64,
                window: Some(37),
            },
            300,
        ),
        (
            AttnShape {
                n_head: 4,
                n_head_kv: 4,
                head_dim: 32,
                window: Some(300),
            },
            1500,
        ),
        (
            AttnShape {
                n_head: 4,
                n_head_kv: 1,
                head_dim: 64,
                window: Some(512),
            },
            1400,
        ),
    ] {
        let c = case(s, len, len, 1.5, len as u64);
        let kv_dim = s.n_head_kv * s.head_dim;
        let q_dim = s.n_head * s.head_dim;
        let (k, v) = (
            KvView::from_f32(&c.k, kv_dim),
            KvView::from_f32(&c.v, kv_dim),
        );
        for simd in levels() {
            let mut ws = AttnWorkspace::default();
            let mut whole = vec![0f32; c.q.len()];
            flash_with(s, &c.q, k, v, 0, &mut whole, &mut ws, simd);
            for sizes in [vec![1usize], vec![37, 1, 64, 130, 5], vec![3, 200]] {
                let mut got = vec![0f32; c.q.len()];
                let (mut t, mut i) = (0, 0);
                while t < len {
                    let n = sizes[i % sizes.len()].min(len - t);
                    let (kt, vt) = (
                        KvView::from_f32(&c.k[..(t + n) * kv_dim], kv_dim),
                        KvView::from_f32(&c.v[..(t + n) * kv_dim], kv_dim),
                    );
                    let q = &c.q[t * q_dim..(t + n) * q_dim];
                    let out = &mut got[t * q_dim..(t + n) * q_dim];
                    flash_with(s, q, kt, vt, t, out, &mut ws, simd);
                    t += n;
                    i += 1;
                }
                let same = got
                    .iter()
                    .zip(&whole)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{s:?} len {len} simd {simd} calls of {sizes:?}");
            }
        }
    }
}

/// Split-KV decode inside a two-thread team, where whichever thread finishes a KV head's last
/// chunk merges that head, gives the bits of the prefill's rows: the merge order is fixed
/// whichever thread runs it. Repeated, so the chunks land on different threads.
#[test]
fn decode_merged_inside_a_team_gives_the_prefills_bits() {
    let s = AttnShape {
        n_head: 9,
        n_head_kv: 3,
        head_dim: 64,
        window: None,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for len in [300, 1100, 4100] {
        let c = case(s, len, len, 1.5, 11 + len as u64);
        let (kv_dim, q_dim) = (s.n_head_kv * s.head_dim, s.n_head * s.head_dim);
        let (k, v) = (
            KvView::from_f32(&c.k, kv_dim),
            KvView::from_f32(&c.v, kv_dim),
        );
        let mut whole = vec![0f32; c.q.len()];
        flash_with(
            s,
            &c.q,
            k,
            v,
            0,
            &mut whole,
            &mut AttnWorkspace::default(),
            cpu::level(),
        );
        pool.install(|| {
            crate::team::with_team(|| {
                let mut ws = AttnWorkspace::default();
                for rep in 0..40 {
                    let t = len - 1 - rep % 3;
                    let (kt, vt) = (
                        KvView::from_f32(&c.k[..(t + 1) * kv_dim], kv_dim),
                        KvView::from_f32(&c.v[..(t + 1) * kv_dim], kv_dim),
                    );
                    let mut got = vec![0f32; q_dim];
                    let q = &c.q[t * q_dim..(t + 1) * q_dim];
                    flash_with(s, q, kt, vt, t, &mut got, &mut ws, cpu::level());
                    let want = &whole[t * q_dim..(t + 1) * q_dim];
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "len {len} position {t} rep {rep}");
                }
            })
        });
    }
}

/// A 16-bit cache read in place (keys widened as they are transposed, values as they are
/// weighed) gives the bits of flash over the same values decoded to f32 first, for a whole
/// prefill and for rows one at a time (decode, where values are read in place), on both ISAs.
/// The widening is exact, so any difference would be a kernel bug.
#[test]
fn sixteen_bit_caches_read_in_place_equal_their_decoded_values() {
    let s = AttnShape {
        n_head: 9,
        n_head_kv: 3,
        head_dim: 64,
        window: None,
    };
    let len = 203;
    let c = case(s, len, len, 1.5, 11);
    let kv_dim = s.n_head_kv * s.head_dim;
    let q_dim = s.n_head * s.head_dim;
    for ty in [KvType::F16, KvType::Bf16] {
        let encode = |x: &[f32]| {
            let mut b = vec![0u8; ty.bytes(x.len())];
            for (src, dst) in x.chunks(kv_dim).zip(b.chunks_mut(ty.bytes(kv_dim))) {
                ty.encode(src, dst);
            }
            b
        };
        let decode = |b: &[u8]| {
            let mut x = vec![0f32; b.len() / ty.bytes(kv_dim) * kv_dim];
            for (src, dst) in b.chunks(ty.bytes(kv_dim)).zip(x.chunks_mut(kv_dim)) {
                ty.decode_scalar(src, dst);
            }
            x
        };
        let (kb, vb) = (encode(&c.k), encode(&c.v));
        let (kd, vd) = (decode(&kb), decode(&vb));
        let rb = ty.bytes(kv_dim);
        for simd in levels() {
            let mut ws = AttnWorkspace::default();
            let mut want = vec![0f32; c.q.len()];
            let (k, v) = (KvView::from_f32(&kd, kv_dim), KvView::from_f32(&vd, kv_dim));
            flash_with(s, &c.q, k, v, 0, &mut want, &mut ws, simd);
            let mut whole = vec![0f32; c.q.len()];
            let (k, v) = (
                KvView::contiguous(ty, rb, len, &kb),
                KvView::contiguous(ty, rb, len, &vb),
            );
            flash_with(s, &c.q, k, v, 0, &mut whole, &mut ws, simd);
            let mut rows = vec![0f32; c.q.len()];
            for t in 0..len {
                let (k, v) = (
                    KvView::contiguous(ty, rb, t + 1, &kb[..(t + 1) * rb]),
                    KvView::contiguous(ty, rb, t + 1, &vb[..(t + 1) * rb]),
                );
                let q = &c.q[t * q_dim..(t + 1) * q_dim];
                flash_with(
                    s,
                    q,
                    k,
                    v,
                    t,
                    &mut rows[t * q_dim..(t + 1) * q_dim],
                    &mut ws,
                    simd,
                );
            }
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&whole), bits(&want), "{ty} prefill, simd {simd}");
            assert_eq!(
                bits(&rows),
                bits(&want),
                "{ty} one row at a time, simd {simd}"
            );
        }
    }
}

/// Over a Q8_0 cache (keys scored in integers against quantized queries, values read in place
/// for a few rows and decoded for many), a row's output has the same bits whichever rows share
/// its call: a whole prefill, one row at a time (split-key decode over two chunks), or uneven
/// groups; on the dispatched path (the VNNI kernel where the CPU has it) and the portable one.
/// Greedy speculation and batching stay exact with a Q8_0 cache because of this.
#[test]
fn q8_0_rows_are_independent_of_how_calls_group_them() {
    let s = AttnShape {
        n_head: 9,
        n_head_kv: 3,
        head_dim: 64,
        window: None,
    };
    let len = 300;
    let ty = KvType::Q8_0;
    let c = case(s, len, len, 1.5, 21);
    let kv_dim = s.n_head_kv * s.head_dim;
    let q_dim = s.n_head * s.head_dim;
    let rb = ty.bytes(kv_dim);
    let encode = |x: &[f32]| {
        let mut b = vec![0u8; len * rb];
        for (src, dst) in x.chunks(kv_dim).zip(b.chunks_mut(rb)) {
            ty.encode(src, dst);
        }
        b
    };
    let (kb, vb) = (encode(&c.k), encode(&c.v));
    fn view(b: &[u8], rb: usize, n: usize) -> KvView<'_> {
        KvView::contiguous(KvType::Q8_0, rb, n, &b[..n * rb])
    }
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for simd in levels() {
        let mut ws = AttnWorkspace::default();
        let mut whole = vec![0f32; c.q.len()];
        flash_with(
            s,
            &c.q,
            view(&kb, rb, len),
            view(&vb, rb, len),
            0,
            &mut whole,
            &mut ws,
            simd,
        );
        let mut want = vec![0f32; c.q.len()];
        naive(
            s,
            &c.q,
            view(&kb, rb, len),
            view(&vb, rb, len),
            0,
            &mut want,
        );
        let e = max_row_rel_err(&whole, &want, s.head_dim);
        assert!(e < 1e-5, "against naive, simd {simd}: {e}");
        for sizes in [vec![1usize], vec![37, 1, 64, 130, 5], vec![3, 200]] {
            let mut got = vec![0f32; c.q.len()];
            let (mut t, mut i) = (0, 0);
            while t < len {
                let n = sizes[i % sizes.len()].min(len - t);
                let q = &c.q[t * q_dim..(t + n) * q_dim];
                let out = &mut got[t * q_dim..(t + n) * q_dim];
                let (k, v) = (view(&kb, rb, t + n), view(&vb, rb, t + n));
                flash_with(s, q, k, v, t, out, &mut ws, simd);
                t += n;
                i += 1;
            }
            assert_eq!(bits(&got), bits(&whole), "simd {simd}, calls of {sizes:?}");
        }
    }
}

/// A window is the same as attending over only the visible keys: each query row of a windowed
/// prefill equals an unwindowed single-query call on the slice `first_visible(p)..=p`. Same
/// kernel, same keys in the same order, so the results agree to rounding of the score matrix
/// layout (1e-6 of the row's magnitude).
#[test]
fn window_equals_attention_over_the_visible_keys() {
    let full = AttnShape {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 16,
        window: None,
    };
    let kv_dim = full.n_head_kv * full.head_dim;
    let q_dim = full.n_head * full.head_dim;
    for (window, len, n) in [(1, 9, 9), (4, 20, 7), (8, 8, 8), (16, 12, 5), (5, 40, 1)] {
        let c = case(full, len, n, 1.0, window as u64 * 31 + len as u64);
        let s = AttnShape {
            window: Some(window),
            ..full
        };
        let mut out = vec![0f32; n * q_dim];
        causal_attention(s, &c.q, &c.k, &c.v, c.pos0, &mut out);
        for t in 0..n {
            let p = c.pos0 + t;
            let lo = s.first_visible(p);
            assert_eq!(lo, (p + 1).saturating_sub(window));
            let mut want = vec![0f32; q_dim];
            causal_attention(
                full,
                &c.q[t * q_dim..(t + 1) * q_dim],
                &c.k[lo * kv_dim..(p + 1) * kv_dim],
                &c.v[lo * kv_dim..(p + 1) * kv_dim],
                p - lo,
                &mut want,
            );
            let got = &out[t * q_dim..(t + 1) * q_dim];
            let err = max_row_rel_err(got, &want, full.head_dim);
            assert!(err < 1e-6, "window {window} len {len} row {t}: {err}");
        }
    }
}

/// Flash under a window against naive under the same window (tolerance as for the causal
/// cases, see the module doc): prefill and decode, windows inside one tile, across tiles and
/// chunks, and longer than the context; the decode split path with chunks wholly before the
/// window skipped.
#[test]
fn flash_window_matches_naive() {
    for (hd, group, window, len, n) in [
        (64, 3, 1, 50, 50),
        (64, 3, 7, 200, 200),
        (64, 1, 100, 700, 700),
        (32, 2, 300, 1500, 64),
        (64, 4, 512, 2000, 1),
        (64, 4, 512, 2000, 3),
        (256, 4, 512, 1300, 1),
        (256, 4, 512, 900, 900),
        (48, 2, 5000, 400, 400),
    ] {
        let s = AttnShape {
            n_head: 2 * group,
            n_head_kv: 2,
            head_dim: hd,
            window: Some(window),
        };
        let c = case(s, len, n, 1.5, (window * 7 + len) as u64);
        let (e_simd, e_port) = compare(&c);
        assert!(
            e_simd < 1e-5 && e_port < 1e-5,
            "hd {hd} group {group} window {window} len {len} n {n}: {e_simd} {e_port}"
        );
    }
}

/// Rows computed three at a time (GQA groups of three) get the same bits as when computed
/// four at a time: each row's sums run in the same order whatever the row count, so the
/// choice in `tile_loop::block` changes speed only. Up to three rows weigh values 32 dimensions a
/// pass where four take 16, so this also holds the wide pass to the narrow one's bits (head
/// dimension 48 takes the narrow pass for both).
#[cfg(target_arch = "x86_64")]
#[test]
fn three_and_four_rows_at_a_time_give_the_same_bits() {
    use super::kernels_avx2;
    let Some(t) =
        crate::cpu::token_for_test::<Avx2>("three_and_four_rows_at_a_time_give_the_same_bits")
    else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for (hd, bc, jn) in [(64, 64, 57), (32, 64, 64), (48, 40, 33), (128, 32, 1)] {
        let q = random(4 * hd, 1.0, &mut rng);
        let kt = random(hd * bc, 1.0, &mut rng);
        let v = f32_bytes(&random(bc * hd, 1.0, &mut rng)).to_vec();
        let p: Vec<f32> = random(4 * bc, 1.0, &mut rng)
            .iter()
            .map(|x| x.abs())
            .collect();
        let (mut s4, mut s3) = (vec![0f32; 4 * bc], vec![0f32; 3 * bc]);
        let (mut o4, mut o3) = (vec![0f32; 4 * hd], vec![0f32; 3 * hd]);
        // SAFETY: the token proves the score loop's features.
        unsafe {
            kernels_avx2::scores::<4>(t, &q, &kt, bc, jn, &mut s4);
            kernels_avx2::scores::<3>(t, &q[..3 * hd], &kt, bc, jn, &mut s3);
            // A second run of keys continues the sums (a paged cache's next block).
            for accumulate in [false, true] {
                let ahead = &mut Ahead::default();
                let f32v = KvType::F32;
                kernels_avx2::weighted_values::<4>(
                    t,
                    &p,
                    bc,
                    &v,
                    4 * hd,
                    f32v,
                    hd,
                    jn,
                    &mut o4,
                    accumulate,
                    ahead,
                );
                kernels_avx2::weighted_values::<3>(
                    t,
                    &p,
                    bc,
                    &v,
                    4 * hd,
                    f32v,
                    hd,
                    jn,
                    &mut o3,
                    accumulate,
                    ahead,
                );
            }
        }
        for i in 0..3 {
            let (a, b) = (&s4[i * bc..i * bc + jn], &s3[i * bc..i * bc + jn]);
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "hd {hd}: scores row {i}"
            );
        }
        assert!(
            o4[..3 * hd]
                .iter()
                .zip(&o3)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "hd {hd}: weighted values"
        );
    }
}

/// The signature both instruction sets' weighted-value loops share (with their tokens).
#[cfg(target_arch = "x86_64")]
type WeightedValues =
    Box<dyn Fn(&[f32], usize, &[u8], usize, KvType, usize, usize, &mut [f32], bool, &mut Ahead)>;

/// Q8_0 values weighed where they lie give the bits of the same loop over the tile decoded to
/// f32 first (how more rows read them), in one run or two, in the AVX2 and AVX-512 loops.
#[cfg(target_arch = "x86_64")]
#[test]
fn q8_0_values_in_place_give_the_decoded_tiles_bits() {
    const R: usize = 3;
    let mut loops: Vec<(&str, WeightedValues)> = Vec::new();
    let test = "q8_0_values_in_place_give_the_decoded_tiles_bits";
    if let Some(t) = crate::cpu::token_for_test::<Avx2>(test) {
        loops.push((
            "avx2",
            Box::new(move |p, bc, v, st, ty, hd, jn, pv, acc, a| {
                super::kernels_avx2::weighted_values::<R>(t, p, bc, v, st, ty, hd, jn, pv, acc, a)
            }),
        ));
    }
    if let Some(t) = crate::cpu::token_for_test::<crate::cpu::Avx512>(test) {
        loops.push((
            "avx512",
            Box::new(move |p, bc, v, st, ty, hd, jn, pv, acc, a| {
                super::kernels_avx512::weighted_values::<R>(t, p, bc, v, st, ty, hd, jn, pv, acc, a)
            }),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for (hd, bc) in [(64, 64), (128, 32), (32, 128), (96, 40)] {
        let hb = KvType::Q8_0.bytes(hd);
        let stride = 3 * hb + 8;
        let vals = random(bc * hd, 40.0, &mut rng);
        let mut v = vec![0u8; bc * stride];
        let mut decoded = vec![0f32; bc * hd];
        for (j, row) in vals.chunks_exact(hd).enumerate() {
            KvType::Q8_0.encode(row, &mut v[j * stride..][..hb]);
            crate::quant::dequantize(
                crate::quant::GgmlType::Q8_0,
                &v[j * stride..][..hb],
                &mut decoded[j * hd..][..hd],
            )
            .unwrap();
        }
        let dbytes: Vec<u8> = decoded.iter().flat_map(|x| x.to_le_bytes()).collect();
        let p: Vec<f32> = random(R * bc, 1.0, &mut rng)
            .iter()
            .map(|x| x.abs())
            .collect();
        for (name, weighted) in &loops {
            for jn in [1, 5, 16, 17, bc - 1, bc] {
                let mut want = vec![0f32; R * hd];
                let mut got = vec![0f32; R * hd];
                let split = jn / 2;
                weighted(
                    &p,
                    bc,
                    &dbytes,
                    4 * hd,
                    KvType::F32,
                    hd,
                    jn,
                    &mut want,
                    false,
                    &mut Ahead::default(),
                );
                if split > 0 {
                    weighted(
                        &p,
                        bc,
                        &v,
                        stride,
                        KvType::Q8_0,
                        hd,
                        split,
                        &mut got,
                        false,
                        &mut Ahead::default(),
                    );
                }
                let rest = &v[split * stride..];
                weighted(
                    &p[split..],
                    bc,
                    rest,
                    stride,
                    KvType::Q8_0,
                    hd,
                    jn - split,
                    &mut got,
                    split > 0,
                    &mut Ahead::default(),
                );
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{name}: hd {hd} jn {jn}");
            }
        }
    }
}

/// Keys kept by column (a paged pool's f32, f16 and bf16 blocks): scored where they lie, and
/// widened into a tile, they give the bits of the same keys transposed from rows and scored on
/// the tile, for whole blocks, runs that start inside a block and runs shorter than a vector.
#[cfg(target_arch = "x86_64")]
#[test]
fn keys_by_column_give_the_bits_of_keys_by_row() {
    use super::{kernels_avx2, kernels_columns};
    let Some(t) = crate::cpu::token_for_test::<Avx2>("keys_by_column_give_the_bits_of_keys_by_row")
    else {
        return;
    };
    const R: usize = 3;
    let (hd, bc) = (64, 64);
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let q = random(R * hd, 1.0, &mut rng);
    for ty in [KvType::F32, KvType::F16, KvType::Bf16] {
        // Tails of fewer than eight keys with the block's next values after them (read in
        // place, their lanes dropped: (16, 0, 5), (16, 0, 13), (24, 2, 11)) and at the end of
        // a column (copied out: the rest).
        for (bs, off, m) in [
            (16, 0, 16),
            (16, 3, 13),
            (16, 9, 5),
            (5, 0, 5),
            (24, 2, 19),
            (16, 0, 5),
            (16, 0, 13),
            (24, 2, 11),
        ] {
            let keys = random(bs * hd, 1.0, &mut rng);
            let es = ty.bytes(1);
            // The block by rows and by column, in the stored format.
            let mut rows = vec![0u8; ty.bytes(bs * hd)];
            for (p, key) in keys.chunks_exact(hd).enumerate() {
                ty.encode(key, &mut rows[ty.bytes(p * hd)..ty.bytes((p + 1) * hd)]);
            }
            let mut cols = vec![0u8; rows.len()];
            for p in 0..bs {
                for c in 0..hd {
                    let (from, to) = ((p * hd + c) * es, (c * bs + p) * es);
                    cols[to..to + es].copy_from_slice(&rows[from..from + es]);
                }
            }
            let mut by_rows = vec![f32::NAN; hd * bc];
            kernels_avx2::transpose_rows(
                t,
                &rows[ty.bytes(off * hd)..],
                ty.bytes(hd),
                ty,
                m,
                hd,
                &mut by_rows,
                bc,
                0,
                &mut Ahead::default(),
            );
            let mut by_cols = vec![f32::NAN; hd * bc];
            kernels_columns::widen_columns(
                t,
                &cols,
                ty,
                bs,
                off,
                m,
                hd,
                &mut by_cols,
                bc,
                0,
                &mut Ahead::default(),
            );
            for c in 0..hd {
                let (a, b) = (&by_rows[c * bc..][..m], &by_cols[c * bc..][..m]);
                assert_eq!(a, b, "{ty} bs {bs} off {off} m {m}: column {c} of the tile");
            }
            let mut want = vec![0f32; R * bc];
            // SAFETY: the token proves the loop's features.
            unsafe { kernels_avx2::scores::<R>(t, &q, &by_rows, bc, m, &mut want) };
            let mut got = vec![f32::NAN; R * bc];
            kernels_columns::scores_columns::<R>(
                t,
                &q,
                &cols,
                ty,
                bs,
                off,
                m,
                &mut got,
                bc,
                &mut Ahead::default(),
                // Asking for lines (here the block's own) changes no bits.
                Some(kernels_avx2::LineHint::spread(
                    cols.as_ptr(),
                    cols.len(),
                    hd,
                )),
            );
            for i in 0..R {
                let bits = |s: &[f32]| {
                    s[i * bc..][..m]
                        .iter()
                        .map(|x| x.to_bits())
                        .collect::<Vec<_>>()
                };
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{ty} bs {bs} off {off} m {m}: row {i}"
                );
            }
        }
    }
}

/// A stream of lines spread over a block's columns asks for every line of its bytes, in order,
/// wherever they start, and at most the line after them besides: values of up to 16 rows at
/// every format and head width (a Q8_0 row of 68 bytes gives shares that are not a whole
/// fraction of a line).
#[cfg(target_arch = "x86_64")]
#[test]
fn line_hints_cover_every_line_of_their_bytes() {
    for hd in [32, 64, 128] {
        for ty in [KvType::F32, KvType::F16, KvType::Bf16, KvType::Q8_0] {
            for rows in [1, 5, 16] {
                for start in [0usize, 4, 60, 64 * 1000 + 17] {
                    let len = rows * ty.bytes(hd);
                    if (start % 64 + len).next_multiple_of(64).div_ceil(hd) > 64 {
                        continue; // shares longer than a line: only their first lines
                    }
                    let at = std::ptr::without_provenance::<u8>(start);
                    let lines = kernels_avx2::LineHint::spread(at, len, hd).requested(hd);
                    let (first, end) = (start / 64, (start + len).div_ceil(64));
                    let mut got = lines.clone();
                    got.dedup();
                    assert!(got.is_sorted(), "{ty} hd {hd} rows {rows} from {start}");
                    if got.last() == Some(&end) {
                        got.pop();
                    }
                    let want: Vec<usize> = (first..end).collect();
                    assert_eq!(got, want, "{ty} hd {hd} rows {rows} from {start}");
                }
            }
        }
    }
}

/// The correction factors' vector exponential gives `exp_approx`'s bits, for the values a
/// running maximum produces (`-inf` on a first tile, 0, large and small gaps) and for NaN.
#[cfg(target_arch = "x86_64")]
#[test]
fn exp_lanes_gives_the_scalar_bits() {
    use super::kernel::exp_approx;
    let Some(_t) = crate::cpu::token_for_test::<Avx2>("exp_lanes_gives_the_scalar_bits") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let special = [
        f32::NEG_INFINITY,
        f32::NAN,
        0.0,
        -0.0,
        -1e-30,
        -90.0,
        -87.5,
        3.0,
    ];
    for round in 0..200 {
        let x: [f32; 3] = std::array::from_fn(|i| {
            if round < 3 {
                special[(3 * round + i) % special.len()]
            } else {
                -rng.random::<f32>() * 40.0
            }
        });
        // SAFETY: the token proves AVX2 and FMA.
        let got = unsafe { kernels_avx2::exp_lanes(x) };
        for (g, &v) in got.iter().zip(&x) {
            assert_eq!(g.to_bits(), exp_approx(v).to_bits(), "exp({v})");
        }
    }
    // SAFETY: as above.
    let eight = unsafe { kernels_avx2::exp_lanes([-0.5f32; 8]) };
    assert!(
        eight
            .iter()
            .all(|e| e.to_bits() == exp_approx(-0.5).to_bits())
    );
}
