//! The reports' studies end to end on small random models the tests build themselves
//! (byte-level vocabulary), with tiny budgets: every row the plan asks for comes back, measured,
//! with the figures a broken pipeline would get wrong (sparsity, sizes, which rows healed, which
//! quality a row reuses, the steps each run took).

use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::{GgmlType, kernels};
use frugal::surgery::prune::{Method, Pattern};
use frugal::tokenizer::Tokenizer;
use frugal_lab::build as lab_build;
use frugal_lab::heal::Recovery;
use frugal_lab::moe::Variant;
use frugal_lab::progress::Progress;
use frugal_lab::timing::SpeedTest;
use frugal_lab::{distill_study, moe_study, prune_study};
use frugal_train::data::{Corpus, split, windows_of};
use frugal_train::gemm::Precision;
use frugal_train::model::RunOptions;
use frugal_train::router::Balance;
use frugal_train::teacher::OnlineTeachers;

const TEXT: &str = "Every lever has a price, and frugal measures it. A cache saves work; a cache \
costs memory. Fewer weights cost quality, and training buys some of it back. ";

fn q8_model() -> Vec<u8> {
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

fn corpus(ids: &[u32], seq: usize) -> Corpus {
    split(windows_of(ids, seq), 0.2, "test text").unwrap()
}

fn recovery(seq: usize) -> Recovery {
    Recovery {
        seq,
        batch: 2,
        lr: 1e-3,
        probe: None,
        points: 2,
        eval_windows: 2,
        seed: 0,
        run: RunOptions {
            precision: Precision::F32,
            recompute: false,
            ..RunOptions::default()
        },
    }
}

/// Progress as the tests keep it: the lines, and how many training events came.
#[derive(Default)]
struct Log {
    lines: Vec<String>,
    train_events: usize,
}

impl Log {
    fn on(&mut self) -> impl FnMut(Progress<'_>) + '_ {
        |p| match p {
            Progress::Line(s) | Progress::Status(s) => self.lines.push(s),
            Progress::Train { .. } => self.train_events += 1,
        }
    }

    fn has(&self, line: &str) -> bool {
        self.lines.iter().any(|l| l == line)
    }
}

#[test]
fn the_prune_study_builds_measures_heals_and_times_every_row() {
    let base = lab_build::load(q8_model(), false).unwrap();
    let ids = tokens(&base);
    let data = corpus(&ids, 32);
    let teachers = OnlineTeachers {
        models: vec![(lab_build::load(q8_model(), false).unwrap(), 1.0)],
    };
    let two_four = Pattern::NofM { n: 2, m: 4 };
    let plan = prune_study::Plan {
        methods: vec![Method::Magnitude, Method::Wanda],
        sparsities: vec![0.5],
        patterns: vec![two_four],
        structured: vec![("ffn:0.25".into(), "ffn:0.25".parse().unwrap())],
        format: GgmlType::Q8_0,
        four_bit: true,
        recover: vec!["wanda@0.5".into(), "structured".into()],
        heal_steps: 3,
        speed: SpeedTest::once(8, 2),
        reps: 1,
    };
    let scratch = tempfile::tempdir().unwrap();
    let work = scratch.path().join("rows");
    let inputs = prune_study::Inputs {
        base: &base,
        stored: q8_model(),
        calib: &ids,
        eval: &ids,
        ctx: 32,
        data: &data,
        teachers: &teachers,
        recovery: recovery(32),
        work: &work,
    };
    let mut log = Log::default();
    let study = prune_study::run(&plan, inputs, &mut log.on()).unwrap();
    let rows = &study.rows;

    let bitmaps = kernels::sparse_available(kernels::detect());
    let mut expected = vec!["dense", "dense-format"];
    for m in ["magnitude", "wanda"] {
        if bitmaps {
            expected.push(if m == "wanda" {
                "wanda@0.5+bitmap"
            } else {
                "magnitude@0.5+bitmap"
            });
        }
        expected.extend(match m {
            "wanda" => ["wanda@0.5", "wanda@2:4", "wanda@2:4+compressed"],
            _ => ["magnitude@0.5", "magnitude@2:4", "magnitude@2:4+compressed"],
        });
    }
    expected.extend([
        "dense-q4",
        "magnitude@2:4/q4",
        "magnitude@2:4/q4+compressed",
        "structured",
    ]);
    let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, expected);
    assert!(study.calibration_tokens > 0);

    let row = |k: &str| rows.iter().find(|r| r.key == k).unwrap();
    let dense = row("dense-format");
    for r in rows {
        let (c, q) = (&r.candidate, &r.candidate.quality);
        assert!(
            q.ppl.is_finite() && q.kl_mean.is_finite() && q.kl_mean >= 0.0,
            "{c:?}"
        );
        assert!(
            c.speed.speed.decode > 0.0 && c.speed.vs_base.decode > 0.0,
            "{c:?}"
        );
        let b = prune_study::base_of(rows, r).expect("every row has its baseline");
        assert!(
            b.kind == prune_study::Kind::Dense,
            "{} against {}",
            r.key,
            b.key
        );
        if r.kind == prune_study::Kind::Dense {
            // Its own baseline: no ratio, so 1.
            assert_eq!(c.speed.vs_base.decode, 1.0, "{}", r.key);
            assert!(r.zeros < 0.1, "{}: {}", r.key, r.zeros);
        } else if r.kind != prune_study::Kind::Structured {
            assert!((r.zeros - 0.5).abs() < 0.02, "{}: {}", r.key, r.zeros);
            assert!(q.kl_mean > dense.candidate.quality.kl_mean, "{}", r.key);
        }
    }
    // A compressed row and a bitmap row compute their twin's logits in fewer (or as many) bytes.
    for (twin, of) in [
        ("magnitude@2:4+compressed", "magnitude@2:4"),
        ("magnitude@2:4/q4+compressed", "magnitude@2:4/q4"),
        ("wanda@0.5+bitmap", "wanda@0.5"),
    ] {
        let Some(t) = rows.iter().find(|r| r.key == twin) else {
            continue;
        };
        let o = row(of);
        let (tq, oq) = (&t.candidate.quality, &o.candidate.quality);
        assert!(
            (tq.kl_mean - oq.kl_mean).abs() <= 1e-6 * oq.kl_mean.max(1.0),
            "{twin}"
        );
        assert!(t.candidate.size.bytes <= o.candidate.size.bytes, "{twin}");
    }
    assert!(
        row("magnitude@2:4+compressed").candidate.size.bytes
            < row("magnitude@2:4").candidate.size.bytes
    );
    let structured = row("structured");
    assert!(structured.candidate.size.params < dense.candidate.size.params);
    assert!(
        structured
            .candidate
            .name
            .starts_with("structured ffn:0.25 (FFN 64,")
    );

    // Healed: the rows asked, and only those.
    for r in rows {
        let asked = r.key == "wanda@0.5" || r.key == "structured";
        assert_eq!(r.after.is_some(), asked, "{}", r.key);
        if let Some(a) = r.after {
            assert!(a.kl_mean.is_finite() && a.ppl.is_finite(), "{a:?}");
        }
    }
    assert!(log.has("recovering: wanda, 50% unstructured"));
    assert!(
        log.train_events >= 2 * 3,
        "{} training events",
        log.train_events
    );
    assert!(!work.exists(), "the scratch directory is left behind");
}

#[test]
fn the_moe_study_returns_a_row_per_variant_per_balancing_mode_and_per_distillation() {
    // FFN 96: three experts of one 32-wide block each.
    let dense = lab_build::load(q8_model(), false).unwrap();
    let ids = tokens(&dense);
    let data = corpus(&ids, 32);
    let variant = |s: &str| -> Variant { s.parse().unwrap() };
    let plan = moe_study::Plan {
        variants: vec![variant("3x1"), variant("up2x1")],
        speed: SpeedTest::once(4, 2),
        reps: 1,
        balancing: Some(moe_study::Balancing {
            on: variant("3x2"),
            modes: vec![Balance::None, Balance::Aux(1.0)],
            text: &ids,
            tokens: 64,
            batch: 32,
            lr: 1e-4,
        }),
        distilling: Some(moe_study::Distilling {
            variants: vec![variant("3x1")],
            aux: vec![0.0, 1.0],
            tokens: 64,
            data: &data,
            recovery: recovery(32),
        }),
    };
    let inputs = moe_study::Inputs {
        dense: &dense,
        calib: &ids,
        eval: &ids,
        ctx: 32,
        seed: 0,
    };
    let mut log = Log::default();
    let study = moe_study::run(&plan, &inputs, &mut log.on()).unwrap();

    assert!(study.dense.kl.abs() < 1e-9 && study.dense.busiest == 0.0);
    assert!(study.dense_speed.decode > 0.0);
    let specs: Vec<&str> = study
        .variants
        .iter()
        .map(|r| r.variant.spec.as_str())
        .collect();
    assert_eq!(specs, ["3x1", "up2x1"]);
    let (split, up) = (&study.variants[0], &study.variants[1]);
    assert!((split.active_ffn - 1.0 / 3.0).abs() < 1e-9 && split.active < split.total);
    assert_eq!(up.active_ffn, 1.0);
    for r in &study.variants {
        assert!(
            r.q.kl.is_finite() && r.q.kl >= 0.0 && r.q.busiest >= 1.0,
            "{r:?}"
        );
        assert!(
            r.speed.speed.decode > 0.0 && r.speed.vs_base.decode > 0.0,
            "{r:?}"
        );
    }

    let modes: Vec<Balance> = study.balance.iter().map(|b| b.balance).collect();
    assert_eq!(modes, [Balance::None, Balance::Aux(1.0)]);
    for b in &study.balance {
        // 64 tokens in steps of one 32-token window.
        assert_eq!(b.steps.len(), 2);
        assert!(b.q.kl.is_finite() && b.first.max_over_mean >= 1.0, "{b:?}");
    }
    assert!(log.has("router training on 3x2"));

    assert_eq!(study.distill.len(), 2);
    for (d, aux) in study.distill.iter().zip([0.0, 1.0]) {
        assert_eq!((d.variant.spec.as_str(), d.aux), ("3x1", aux));
        // Measured in part 1, not again.
        assert_eq!(d.before, split.q);
        assert_eq!(d.tokens, 64);
        assert!(d.after.kl.is_finite() && d.after.kl != d.before.kl, "{d:?}");
    }
    assert!(log.train_events > 0);
}

#[test]
fn the_distill_study_trains_every_run_and_times_the_students_it_keeps() {
    let spec = SyntheticSpec {
        n_layers: 4,
        n_embd: 32,
        n_ff: 64,
        n_head: 4,
        n_head_kv: 2,
        n_ctx: 128,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let teacher = dir.path().join("teacher.gguf");
    std::fs::write(&teacher, build(&spec)).unwrap();
    let work = dir.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let m = Model::from_file(GgufFile::open(&teacher).unwrap()).unwrap();
    let data = corpus(&tokens(&m), 16);
    let plan = distill_study::Plan {
        student_layers: None,
        tokens: 64,
        temperatures: vec![2.0],
        recovery: recovery(16),
        topk: 8,
        ensemble_tokens: 32,
        arch: true,
        speed: SpeedTest::once(8, 2),
    };
    let inputs = distill_study::Inputs {
        teacher: &teacher,
        data: &data,
        work: &work,
    };
    let mut log = Log::default();
    let study = distill_study::run(&plan, &inputs, &mut log.on()).unwrap();

    let names: Vec<&str> = study.results.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "hard labels",
            "distilled, τ = 2",
            "distilled, τ = 2, cached top-8",
            "distilled from the ensemble, τ = 2",
            "other architecture, τ = 2 + hidden cosine",
        ]
    );
    // A third of 4 layers, rounded up: the first and the last.
    assert_eq!(study.keep, [0, 3]);
    assert_eq!(study.importance.len(), 4);
    assert_eq!((study.steps, study.per_step), (2, 32));
    for r in &study.results {
        assert_eq!(r.history.first().map(|p| p.tokens), Some(0), "{}", r.name);
        assert_eq!(r.last().tokens, 64, "{}", r.name);
        assert!(r.last().ppl.is_finite(), "{}", r.name);
    }
    let topk = study.topk.unwrap();
    assert!(
        topk.k == 8 && (0.0..1.0).contains(&topk.missing_mass),
        "{topk:?}"
    );
    assert_eq!(study.ensemble.unwrap().tokens, 32);
    let arch = study.arch.as_ref().unwrap();
    assert!(arch.config.n_head < 4 && arch.config.n_layers == 2);

    assert_eq!(study.format, "f32");
    assert_eq!(study.teacher.layers, 4);
    assert!(study.teacher.speed.decode > 0.0);
    let timed: Vec<&str> = study.students.iter().map(|s| s.name.as_str()).collect();
    let best = &study.results[distill_study::best_index(&study.results)].name;
    assert_eq!(timed.first(), Some(&"hard labels"));
    assert!(timed.contains(&best.as_str()) && timed.last().unwrap().starts_with("other"));
    for s in &study.students {
        assert!(s.layers == 2 && s.params < study.teacher.params && s.speed.decode > 0.0);
    }
    assert!(log.has("measuring speed...") && log.train_events > 0);
    // The second teacher and the students are not left in the work directory.
    assert_eq!(std::fs::read_dir(&work).unwrap().count(), 0);
}
