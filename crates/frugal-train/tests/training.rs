//! The training loop end to end on small models the tests build themselves (byte-level
//! vocabulary, so any text tokenizes predictably).

use frugal::gguf::GgufFile;
use frugal::kv::KvSequence;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::model::{Logits, Model, Scratch};
use frugal::tokenizer::Tokenizer;
use frugal_train::data::{Corpus, corpus_from_files, split, windows_of};
use frugal_train::gemm::Precision;
use frugal_train::loss::Divergence;
use frugal_train::model::{Batch, RunOptions};
use frugal_train::optim::{AdamWConfig, Schedule};
use frugal_train::student::{Importance, choose_layers, keep_layers, layer_importance};
use frugal_train::teacher::{OnlineTeachers, TopKCache};
use frugal_train::trainer::{LossConfig, LrProbe, Signal, TrainConfig, Trainer};
use frugal_train::{Params, TrainError, checkpoint};

const TEXT: &str = "The quick brown fox jumps over the lazy dog. A cache saves work; a cache costs memory. \
Every lever has a price, and frugal measures it. The quick brown fox jumps over the lazy dog again. ";

fn model(spec: SyntheticSpec) -> Model {
    Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap()
}

fn tiny() -> SyntheticSpec {
    SyntheticSpec {
        n_layers: 2,
        n_embd: 32,
        n_ff: 64,
        n_head: 4,
        n_head_kv: 2,
        ..Default::default()
    }
}

fn corpus(m: &Model, seq: usize) -> Corpus {
    let tok = Tokenizer::from_gguf(&m.file).unwrap();
    let ids = tok.encode(&TEXT.repeat(2), false).unwrap();
    split(windows_of(&ids, seq), 0.25, "test text").unwrap()
}

fn config(steps: usize, seq: usize) -> TrainConfig {
    TrainConfig {
        seq,
        batch: 2,
        accum: 2,
        steps,
        schedule: Schedule {
            lr: 3e-3,
            warmup: 2,
            total: steps,
            min_ratio: 0.1,
        },
        adamw: AdamWConfig::default(),
        clip: 1.0,
        freeze: Vec::new(),
        seed: 5,
        run: RunOptions {
            precision: Precision::F32,
            recompute: true,
            ..RunOptions::default()
        },
        loss: LossConfig::default(),
        eval_every: 0,
        eval_windows: 0,
        checkpoint: None,
        save_every: 0,
    }
}

#[test]
fn a_tiny_model_overfits_a_short_text() {
    let m = model(tiny());
    let data = corpus(&m, 32);
    let p = Params::from_model(&m).unwrap();
    let mut cfg = config(60, 32);
    cfg.schedule.lr = 1e-2;
    // Evaluate on the training windows themselves: memorization is the point.
    let memorize = Corpus {
        train: data.train.clone(),
        heldout: data.train.clone(),
    };
    let mut t = Trainer::new(p, cfg, &memorize, Signal::None, None).unwrap();
    let mut losses = Vec::new();
    t.run(|e| {
        if let frugal_train::trainer::Event::Step(s) = e {
            losses.push(s.ce);
        }
    })
    .unwrap();
    let first = t.history.first().unwrap().ce;
    let last = t.history.last().unwrap().ce;
    // Uniform over 258 tokens is ln 258 = 5.55 nats; a model that memorized ~200 bytes of text
    // predicts most of them: below 0.5 nats per byte.
    assert!(first > 4.0, "start {first}");
    assert!(
        last < 0.5,
        "the tiny model did not overfit: {first:.3} -> {last:.3} ({losses:?})"
    );
}

#[test]
fn a_resumed_run_equals_an_uninterrupted_one() {
    let m = model(tiny());
    let data = corpus(&m, 16);
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("run.ckpt");
    let mut cfg = config(6, 16);
    cfg.checkpoint = Some(ck.clone());
    cfg.save_every = 3;
    // Uninterrupted.
    let mut a = Trainer::new(
        Params::from_model(&m).unwrap(),
        cfg.clone(),
        &data,
        Signal::None,
        None,
    )
    .unwrap();
    a.run(|_| {}).unwrap();
    // Interrupted after step 3 (the checkpoint of step 3 survives), then resumed.
    let mut b = Trainer::new(
        Params::from_model(&m).unwrap(),
        cfg.clone(),
        &data,
        Signal::None,
        None,
    )
    .unwrap();
    for _ in 0..3 {
        b.train_step().unwrap();
    }
    checkpoint::save(&b, &ck).unwrap();
    drop(b);
    let mut c = Trainer::new(
        Params::from_model(&m).unwrap(),
        cfg.clone(),
        &data,
        Signal::None,
        None,
    )
    .unwrap();
    checkpoint::resume(&mut c, &ck).unwrap();
    assert_eq!(c.step, 3);
    c.run(|_| {}).unwrap();
    assert_eq!(
        c.params, a.params,
        "resumed parameters differ from the uninterrupted run"
    );
    assert_eq!(c.opt, a.opt);
    // A checkpoint of another configuration is refused.
    let mut other = cfg.clone();
    other.seed = 6;
    let mut d = Trainer::new(
        Params::from_model(&m).unwrap(),
        other,
        &data,
        Signal::None,
        None,
    )
    .unwrap();
    let e = checkpoint::resume(&mut d, &ck).unwrap_err().to_string();
    assert!(e.contains("another configuration"), "{e}");
}

#[test]
fn a_non_finite_loss_stops_naming_step_and_tensor_and_keeps_the_checkpoint() {
    let m = model(tiny());
    let data = corpus(&m, 16);
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("run.ckpt");
    let mut cfg = config(10, 16);
    cfg.checkpoint = Some(ck.clone());
    cfg.save_every = 1;
    cfg.clip = 0.0;
    let mut t = Trainer::new(
        Params::from_model(&m).unwrap(),
        cfg,
        &data,
        Signal::None,
        None,
    )
    .unwrap();
    t.run(|_| {}).map_err(|e| panic!("{e}")).ok();
    let good = std::fs::read(&ck).unwrap();
    // Poison one weight: the next step's loss is NaN.
    t.cfg.steps += 1;
    t.params.layers[1].ffn.dense_mut().unwrap().up.data[7] = f32::NAN;
    let e = t.train_step().unwrap_err();
    match &e {
        TrainError::NonFinite { step, tensor, .. } => {
            assert_eq!((*step, tensor.as_str()), (11, "blk.1.ffn_up.weight"));
        }
        other => panic!("unexpected {other}"),
    }
    // A learning rate that overflows the weights stops at the step after the update.
    t.params.layers[1].ffn.dense_mut().unwrap().up.data[7] = 0.0;
    t.cfg.schedule.lr = 1e36;
    t.cfg.schedule.min_ratio = 1.0;
    t.cfg.steps += 2;
    let e = (0..2)
        .find_map(|_| t.train_step().err())
        .expect("training went on with overflowing weights");
    let msg = e.to_string();
    assert!(
        msg.contains("step 12") && msg.contains("not finite"),
        "{msg}"
    );
    assert_eq!(
        std::fs::read(&ck).unwrap(),
        good,
        "the last good checkpoint was touched"
    );
}

#[test]
fn students_of_another_vocabulary_are_refused() {
    let teacher = model(tiny());
    let data = corpus(&teacher, 16);
    let teachers = OnlineTeachers {
        models: vec![(model(tiny()), 1.0)],
    };
    let mut c = teacher.config.clone();
    c.n_vocab = 300;
    let student = Params::random(&c, true, 1);
    let mut cfg = config(1, 16);
    cfg.loss.alpha = 1.0;
    match Trainer::new(student, cfg, &data, Signal::Online(&teachers), None) {
        Err(TrainError::VocabMismatch {
            student: 300,
            teacher: 258,
        }) => {}
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a student of another vocabulary was accepted"),
    }
}

/// Distillation moves the student toward the teacher: held-out KL falls, with the teacher
/// online, from a cached top-k, and with a hidden-state term through a projection.
#[test]
fn distillation_lowers_the_kl_to_the_teacher() {
    let tspec = SyntheticSpec {
        n_layers: 4,
        ..tiny()
    };
    let teacher_model = model(tspec.clone());
    let data = corpus(&teacher_model, 16);
    let teachers = OnlineTeachers {
        models: vec![(model(tspec), 1.0)],
    };
    let tp = Params::from_model(&teacher_model).unwrap();
    let mut tp_mut = tp.clone();
    let calib = data.heldout.clone();
    let imp = layer_importance(
        &mut tp_mut,
        &calib,
        Importance::LossIncrease,
        Precision::F32,
    );
    assert_eq!(imp.len(), 4);
    assert_eq!(tp_mut, tp, "importance measurement changed the teacher");
    let keep = choose_layers(&imp, 2);
    let student = keep_layers(&tp, &keep).unwrap();
    let mut cfg = config(30, 16);
    cfg.loss = LossConfig {
        alpha: 1.0,
        temperature: 2.0,
        divergence: Divergence::Forward,
        hidden: None,
    };
    cfg.eval_every = 0;
    let kl_of = |t: &Trainer| t.history.iter().map(|e| e.kl.unwrap()).collect::<Vec<_>>();

    let mut online = Trainer::new(
        student.clone(),
        cfg.clone(),
        &data,
        Signal::Online(&teachers),
        None,
    )
    .unwrap();
    online.run(|_| {}).unwrap();
    let kl = kl_of(&online);
    eprintln!("online {kl:?}");
    assert!(kl[1] < 0.7 * kl[0], "online distillation: KL {kl:?}");

    let cache = TopKCache::build(&teachers, &data.train, 128, |_, _| {}).unwrap();
    eprintln!(
        "top-128 of 258: missing mass {:.4}, truncation KL {:.4}",
        cache.mean_missing_mass, cache.mean_truncation_kl
    );
    assert!(cache.mean_missing_mass >= 0.0 && cache.mean_truncation_kl >= 0.0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.topk");
    cache.save(&path).unwrap();
    let cache = TopKCache::load(&path).unwrap();
    let mut cached = Trainer::new(
        student.clone(),
        cfg.clone(),
        &data,
        Signal::Cached(&cache),
        Some(&teachers),
    )
    .unwrap();
    cached.run(|_| {}).unwrap();
    let kl = kl_of(&cached);
    eprintln!("cached {kl:?}");
    assert!(kl[1] < 0.7 * kl[0], "cached top-k distillation: KL {kl:?}");

    // A narrower student of another architecture, with a cosine hidden-state term through a
    // learned projection to the teacher's width.
    let sc: frugal_train::student::StudentConfig =
        serde_json::from_str(r#"{"n_layers": 2, "n_embd": 16, "n_ff": 32, "n_head": 2, "n_head_kv": 1, "init": "random"}"#).unwrap();
    let narrow = sc.build(&tp, 3).unwrap();
    let mut hcfg = cfg.clone();
    hcfg.schedule.lr = 1e-2;
    hcfg.loss.hidden = Some(frugal_train::trainer::HiddenConfig {
        weight: 0.5,
        kind: frugal_train::hidden::HiddenKind::Cosine,
        pairs: vec![(1, 3)],
    });
    let mut h = Trainer::new(narrow, hcfg, &data, Signal::Online(&teachers), None).unwrap();
    assert!(h.projectors[0].is_some());
    h.run(|_| {}).unwrap();
    let kl = kl_of(&h);
    eprintln!("hidden {kl:?}");
    assert!(kl[1] < 0.8 * kl[0], "hidden-state distillation: KL {kl:?}");
}

#[test]
fn corpus_files_split_into_train_and_heldout() {
    let m = model(tiny());
    let tok = Tokenizer::from_gguf(&m.file).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("a.txt");
    std::fs::write(&f, TEXT).unwrap();
    let c = corpus_from_files(&tok, &[&f], 16, 0.2).unwrap();
    assert!(c.train.len() >= 8 && !c.heldout.is_empty());
    assert!(
        corpus_from_files(&tok, &[dir.path().join("missing.txt")], 16, 0.2)
            .unwrap_err()
            .to_string()
            .contains("missing.txt")
    );
}

/// The training forward of a latent-attention (deepseek2) file equals the inference engine's,
/// which is checked against a per-head reference in the engine's own tests. Both run in f32 on
/// the same F32 weights; they differ only in the order of sums (the engine's absorbed path
/// multiplies the query by the up-projection first), a few ulps per operation: measured max
/// |Δ| ≈ 2e-6 on logits of magnitude ~10, bound 1e-4; a wrong operation misses by O(0.1).
#[test]
fn latent_attention_training_forward_equals_inference() {
    let spec = SyntheticSpec {
        mla: Some(frugal::model::Mla {
            kv_lora_rank: 12,
            nope_dim: 6,
            rope_dim: 2,
            v_dim: 5,
        }),
        ..tiny()
    };
    let m = model(spec);
    let p = Params::from_model(&m).unwrap();
    let ids: Vec<u32> = b"latent attention, trained"
        .iter()
        .map(|&b| b as u32)
        .collect();
    let mine = p.logits(
        &Batch {
            tokens: &ids,
            batch: 1,
            seq: ids.len(),
        },
        Precision::F32,
    );
    let mut kv = m.new_cache(ids.len()).unwrap();
    let mut s = Scratch::default();
    let theirs = m
        .forward(&ids, &mut kv as &mut dyn KvSequence, &mut s, Logits::All)
        .unwrap();
    let max_diff = mine
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!("max |logit difference| {max_diff:.3e} (logit scale {scale:.2})");
    assert!(scale > 0.1, "a degenerate model proves nothing");
    assert!(
        max_diff < 1e-4,
        "training forward differs from inference by {max_diff}"
    );
}

/// A pruned student keeps its pattern through distillation (masked updates): every zero of the
/// 2:4 pattern is still exactly zero after training, the kept weights moved, and the KL fell.
#[test]
fn a_pruned_student_keeps_its_sparsity_pattern() {
    use frugal::quant::GgmlType;
    use frugal::surgery::prune::{Method, Pattern, PruneTarget, prune_weights};
    let tspec = tiny();
    let teacher_model = model(tspec.clone());
    let data = corpus(&teacher_model, 16);
    let target = PruneTarget {
        method: Method::Magnitude,
        pattern: Pattern::NofM { n: 2, m: 4 },
        format: GgmlType::F32,
    };
    let (w, _) = prune_weights(&teacher_model.file, None, target).unwrap();
    let pruned = Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).unwrap();
    let student = Params::from_model(&pruned).unwrap();
    let teachers = OnlineTeachers {
        models: vec![(model(tspec), 1.0)],
    };
    let mut cfg = config(20, 16);
    cfg.loss = LossConfig {
        alpha: 1.0,
        temperature: 2.0,
        divergence: Divergence::Forward,
        hidden: None,
    };
    let mut t = Trainer::new(student.clone(), cfg, &data, Signal::Online(&teachers), None).unwrap();
    let held = t.keep_sparsity();
    // Half of the seven block matrices of both layers.
    let block: u64 = student
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with("blk.") && !t.vector)
        .map(|t| t.data.len() as u64)
        .sum();
    assert_eq!(held, block / 2);
    t.run(|_| {}).unwrap();
    let (mut zeros_kept, mut moved) = (0u64, 0u64);
    for (a, b) in student.tensors().iter().zip(t.params.tensors()) {
        if !a.name.starts_with("blk.") || a.vector {
            continue;
        }
        for (&x, &y) in a.data.iter().zip(&b.data) {
            if x == 0.0 {
                assert_eq!(y, 0.0, "{}: a pruned weight came back", a.name);
                zeros_kept += 1;
            } else if x != y {
                moved += 1;
            }
        }
    }
    assert_eq!(zeros_kept, held);
    assert!(moved > held / 2, "only {moved} kept weights trained");
    let kl: Vec<f64> = t.history.iter().map(|e| e.kl.unwrap()).collect();
    assert!(kl[1] < kl[0], "KL {kl:?}");
}

#[test]
fn the_learning_rate_probe_refuses_a_diverging_rate_and_leaves_the_run_untouched() {
    let m = model(tiny());
    let data = corpus(&m, 16);
    let cfg = config(4, 16);
    let new = |cfg: TrainConfig| {
        Trainer::new(
            Params::from_model(&m).unwrap(),
            cfg,
            &data,
            Signal::None,
            None,
        )
        .unwrap()
    };
    // From a ceiling of 30, where Adam's first steps move every weight by 30 and the held-out
    // loss explodes, down by √10 a rate: the probe must come down to one that improves.
    let mut probed = new(cfg.clone());
    let mut seen = Vec::new();
    let probe = LrProbe {
        max: 30.0,
        candidates: 8,
        steps: 2,
    };
    let choice = probed
        .probe_learning_rate(probe, |t| seen.push(*t))
        .unwrap();
    assert_eq!(seen, choice.trials);
    eprintln!("probe: start {:.4}, {:?}", choice.start, choice.trials);
    assert!(choice.trials[0].score > choice.start, "{choice:?}");
    assert!(choice.improved(), "{choice:?}");
    assert!(choice.lr < probe.max, "{choice:?}");
    let picked = choice.trials.iter().find(|t| t.lr == choice.lr).unwrap();
    assert!(picked.score < choice.start, "{choice:?}");
    // Every rate was restored from: the state is the starting one, at the chosen rate.
    assert_eq!(probed.step, 0);
    assert_eq!(probed.params, Params::from_model(&m).unwrap());
    assert_eq!(probed.cfg.schedule.lr, choice.lr);
    assert_eq!(probed.cfg.schedule.warmup, cfg.schedule.warmup);
    // The run after the probe is the run configured with that rate from the start.
    let mut direct_cfg = cfg.clone();
    direct_cfg.schedule.lr = choice.lr;
    let mut direct = new(direct_cfg);
    probed.run(|_| {}).unwrap();
    direct.run(|_| {}).unwrap();
    assert_eq!(probed.params, direct.params);
    assert_eq!(probed.opt, direct.opt);
    // Its first evaluation is the probe's, the same as one made at the start.
    assert_eq!(probed.history, direct.history);
    // Only before the first step.
    let e = probed.probe_learning_rate(probe, |_| {}).unwrap_err();
    assert!(e.to_string().contains("before the first step"), "{e}");
}
