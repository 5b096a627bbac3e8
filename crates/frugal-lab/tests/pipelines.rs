//! The lab's pipelines on small random models the tests build themselves (byte-level
//! vocabulary: any text tokenizes predictably), each check one that a broken pipeline fails.

use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvType};
use frugal::model::Model;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::GgmlType;
use frugal::surgery::prune::{Method, Pattern};
use frugal::tokenizer::Tokenizer;
use frugal_lab::heal::Recovery;
use frugal_lab::size::{self, Footprint, Memory};
use frugal_lab::timing::{self, Speed, SpeedTest};
use frugal_lab::{build as lab_build, quality, student};
use frugal_train::Params;
use frugal_train::data::{split, windows_of};
use frugal_train::gemm::Precision;
use frugal_train::model::RunOptions;
use frugal_train::teacher::OnlineTeachers;

const TEXT: &str = "Every lever has a price, and frugal measures it. A cache saves work; a cache \
costs memory. Fewer weights cost quality, and training buys some of it back. ";

fn tiny() -> Vec<u8> {
    build(&SyntheticSpec {
        ty: GgmlType::Q8_0,
        n_ctx: 64,
        ..Default::default()
    })
}

fn tokens(m: &Model) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(&m.file).unwrap();
    tok.encode(&TEXT.repeat(4), false).unwrap()
}

#[test]
fn a_model_against_itself_is_exact_and_a_quantized_copy_is_not() {
    let base = lab_build::load(tiny(), false).unwrap();
    let ids = tokens(&base);
    let same = quality::against(&base, &base, &ids, 32).unwrap();
    assert!(same.kl_mean < 1e-9 && same.kl_p99 < 1e-9, "{same:?}");
    assert_eq!(same.top1, 1.0);
    assert!(
        same.ppl_change().abs() < 1e-12 && same.positions > 0,
        "{same:?}"
    );

    let q4: frugal::convert::Target = "q4_0".parse().unwrap();
    let f = lab_build::quantized(&base.file, q4, None).unwrap();
    let worse = lab_build::load_file(f, false).unwrap();
    let q = quality::against(&worse, &base, &ids, 32).unwrap();
    assert!(q.kl_mean > 1e-6 && q.kl_p99 >= q.kl_mean, "{q:?}");
    assert!(q.top1 <= 1.0 && q.ppl_change() != 0.0, "{q:?}");
    assert_eq!(q.base_ppl, same.ppl);
}

/// Scripted timings: what each candidate and baseline "measures" is known, so the medians,
/// the ratios and the order of the turns can be checked exactly.
#[test]
fn back_to_back_times_each_candidate_right_after_its_baseline() {
    // Candidate 0 has no baseline, 1 is compared with 0, 2 with subject 3 (outside them).
    let baseline = |i: usize| [None, Some(0), Some(3)][i];
    let mut calls = Vec::new();
    let mut n = 0.0;
    let r = timing::back_to_back(
        3,
        3,
        baseline,
        |s| {
            calls.push(s);
            n += 1.0;
            // Each subject's speed is 10 × (subject + 1), drifting by the call count: a ratio of
            // neighbours is close to exact, the drift mostly cancels.
            let v = 10.0 * (s as f64 + 1.0) + n * 0.01;
            Ok(Speed {
                prefill: v,
                decode: v / 2.0,
            })
        },
        |_| {},
    )
    .unwrap();
    // 3 rounds, 3 candidates, 2 of them with a baseline timed first: 15 calls.
    assert_eq!(calls.len(), 15);
    // Rounds start at candidates 0, 1 and 2.
    assert_eq!(calls[0], 0);
    assert_eq!(&calls[..5], &[0, 0, 1, 3, 2]);
    assert_eq!(&calls[5..10], &[0, 1, 3, 2, 0]);
    for w in calls.windows(2) {
        if w[1] == 1 {
            assert_eq!(
                w[0], 0,
                "candidate 1 not right after its baseline: {calls:?}"
            );
        }
        if w[1] == 2 {
            assert_eq!(
                w[0], 3,
                "candidate 2 not right after its baseline: {calls:?}"
            );
        }
    }
    let c = &r.candidates;
    assert_eq!(
        c[0].vs_base,
        Speed {
            prefill: 1.0,
            decode: 1.0
        }
    );
    assert!((c[1].vs_base.decode - 2.0).abs() < 0.01, "{:?}", c[1]);
    assert!((c[2].vs_base.prefill - 0.75).abs() < 0.01, "{:?}", c[2]);
    assert!((c[2].speed.prefill - 30.0).abs() < 0.2, "{:?}", c[2]);
    assert_eq!(r.baseline_runs.iter().filter(|(s, _)| *s == 3).count(), 3);
    assert!((r.baseline(3).decode - 20.0).abs() < 0.1);
    assert_eq!(r.baseline(7), Speed::default());
}

#[test]
fn a_speed_test_measures_what_it_is_asked_and_skips_the_rest() {
    let m = lab_build::load(tiny(), false).unwrap();
    let s = SpeedTest::once(8, 0).measure(&m).unwrap();
    assert!(s.prefill > 0.0 && s.decode == 0.0, "{s:?}");
    let (paired, base) = timing::against(&m, &m, &SpeedTest::once(0, 2), 3).unwrap();
    assert!(paired.speed.decode > 0.0 && base.decode > 0.0);
    assert_eq!(paired.vs_base.prefill, 1.0);
    // The same model against itself: the ratio is 1 up to timing noise.
    assert!(
        paired.vs_base.decode > 0.2 && paired.vs_base.decode < 5.0,
        "{paired:?}"
    );
}

#[test]
fn sizes_count_what_pruning_removes_and_the_cache_a_context_takes() {
    let dense = lab_build::load(tiny(), false).unwrap();
    let d = Footprint::of(&dense.file);
    assert!(
        d.params > 0 && (d.bits_per_weight() - 8.5).abs() < 0.5,
        "{d:?}"
    );
    // Random weights: a few round to zero in Q8_0.
    assert!(size::zero_fraction(&dense.file).unwrap() < 0.01);
    assert_eq!(size::dominant_type(&dense.file), Some("Q8_0"));
    let half = Pattern::Unstructured(0.5);
    let pruned =
        lab_build::pruned(&dense.file, None, Method::Magnitude, half, GgmlType::Q8_0).unwrap();
    let z = size::zero_fraction(&GgufFile::from_bytes(pruned).unwrap()).unwrap();
    assert!((z - 0.5).abs() < 0.02, "{z}");

    let kv = size::kv_per_token_f16(&dense.file, &dense, "tiny").unwrap();
    // 2 layers × (K + V) × 2 KV heads × 16 dims × 2 bytes.
    assert_eq!(kv.measured, 2 * 2 * 2 * 16 * 2);
    assert_eq!(kv.estimated, kv.measured as u128);
    let mem = Memory::at(&dense, 100, KvFormat::both(KvType::F16)).unwrap();
    assert_eq!(mem.kv, 100 * kv.measured as u64);
    assert_eq!(mem.total(), d.bytes + mem.kv);
}

/// A magnitude-pruned student distilled from its dense base moves closer to it, and keeps its
/// zeros through training and re-quantization.
#[test]
fn healing_lowers_the_kl_of_a_pruned_model() {
    let base = lab_build::load(tiny(), false).unwrap();
    let ids = tokens(&base);
    let half = Pattern::Unstructured(0.5);
    let bytes =
        lab_build::pruned(&base.file, None, Method::Magnitude, half, GgmlType::Q8_0).unwrap();
    let pruned = lab_build::load(bytes, false).unwrap();
    let before = quality::against(&pruned, &base, &ids, 32).unwrap();

    let data = split(windows_of(&ids, 32), 0.2, "test text").unwrap();
    let teachers = OnlineTeachers {
        models: vec![(lab_build::load(tiny(), false).unwrap(), 1.0)],
    };
    let recovery = Recovery {
        seq: 32,
        batch: 2,
        lr: 3e-3,
        probe: None,
        points: 2,
        eval_windows: 2,
        seed: 0,
        run: RunOptions {
            precision: Precision::F32,
            recompute: false,
            ..RunOptions::default()
        },
    };
    let q8: frugal::convert::Target = "q8_0".parse().unwrap();
    let (history, healed) = recovery
        .heal(&pruned, 30, &data, &teachers, (true, q8), |_| {})
        .unwrap();
    assert_eq!(history.first().map(|p| p.tokens), Some(0));
    let after = quality::against(&healed, &base, &ids, 32).unwrap();
    assert!(
        after.kl_mean < 0.8 * before.kl_mean,
        "KL {} -> {}",
        before.kl_mean,
        after.kl_mean
    );
    let z = size::zero_fraction(&healed.file).unwrap();
    assert!(z >= 0.49, "zeros {z} after healing");
}

#[test]
fn a_layer_dropped_student_keeps_the_first_and_last_layers() {
    let spec = SyntheticSpec {
        n_layers: 4,
        n_ctx: 64,
        ..Default::default()
    };
    let teacher = Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap();
    let p = Params::from_model(&teacher).unwrap();
    let ids = tokens(&teacher);
    let cut =
        student::layer_dropped(&p, 2, &windows_of(&ids, 32).first(2), Precision::F32).unwrap();
    assert_eq!(cut.importance.len(), 4);
    assert_eq!(cut.keep, [0, 3]);
    assert_eq!(cut.params.config.n_layers, 2);
    let narrow = student::narrower(&p, &cut.keep, 0).unwrap();
    assert!(narrow.config.n_head < p.config.n_head && narrow.n_params() < cut.params.n_params());
}
