//! The training engine on the real models, SmolLM2 and Gemma 3 270M (each test skips when its
//! model is absent; CI requires them).

use frugal::kv::KvSequence;
use frugal::model::{Logits, Model, Scratch};
use frugal_train::Params;
use frugal_train::gemm::Precision;
use frugal_train::model::Batch;

/// The training forward's and the inference engine's f32 logits of every position of the
/// prompt, on `model`'s weights decoded to f32; `bos` says whether the prompt starts with BOS.
fn both_logits(model: &Model, bos: bool) -> (Vec<f32>, Vec<f32>) {
    let tok = frugal::tokenizer::Tokenizer::from_gguf(&model.file).unwrap();
    let ids = tok
        .encode(
            "The capital of France is Paris, and the capital of Italy is",
            bos,
        )
        .unwrap();
    let p = Params::from_model(model).unwrap();
    let mine = p.logits(
        &Batch {
            tokens: &ids,
            batch: 1,
            seq: ids.len(),
        },
        Precision::F32,
    );
    drop(p);
    let mut kv = model.new_cache(ids.len()).unwrap();
    let mut s = Scratch::default();
    let theirs = model
        .forward(&ids, &mut kv as &mut dyn KvSequence, &mut s, Logits::All)
        .unwrap()
        .to_vec();
    assert_eq!(mine.len(), theirs.len());
    (mine, theirs)
}

/// The largest |difference| between two logit sets, and the largest |logit| of the second.
fn max_diff_and_scale(mine: &[f32], theirs: &[f32]) -> (f32, f32) {
    let max_diff = mine
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    (max_diff, theirs.iter().fold(0f32, |m, v| m.max(v.abs())))
}

/// The training forward's logits equal the inference engine's exact f32 logits (both on the
/// Q4_1 file's dequantized weights). Both compute in f32 with f64 norm statistics; they differ
/// only in the order of the f32 sums inside products and softmaxes, which moves logits by a few
/// f32 ulps per operation over 30 layers. Measured: max |Δ| ≈ 1e-4 on logits of magnitude ~20;
/// the bound 2e-3 leaves room for other kernels' orders, and a wrong operation misses by O(1).
#[test]
fn training_forward_equals_inference_logits() {
    let Some(path) = frugal::fetch::reference_model_for_tests() else {
        return;
    };
    let model = Model::load(&path).unwrap();
    let (mine, theirs) = both_logits(&model, false);
    let (max_diff, scale) = max_diff_and_scale(&mine, &theirs);
    eprintln!("max |logit difference| {max_diff:.3e} (logit scale {scale:.1})");
    assert!(
        max_diff < 2e-3,
        "training forward differs from inference by {max_diff}"
    );
    // Same argmax at every position.
    let nv = model.config.n_vocab;
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i)
    };
    for (a, b) in mine.chunks(nv).zip(theirs.chunks(nv)) {
        assert_eq!(argmax(a), argmax(b));
    }
}

/// The real model converted to latent attention (`frugal convert --attention mla:64:32`) trains:
/// its training forward equals the inference engine's absorbed MLA pass (same bound and reason
/// as above), and a few steps of distillation from the original lower the held-out KL. The
/// converted latent rows are 1e-5 of the other weights; without their own training scale
/// (`Stored::ScaledRows`) the first AdamW steps blow the model up (measured: PPL 93 -> 1e9).
#[test]
fn a_converted_latent_model_trains_toward_the_original() {
    use frugal::gguf::GgufFile;
    use frugal::surgery::{Factorization, MlaTarget, calibrate, convert_to_mla};
    use frugal_train::data::{split, windows_of};
    use frugal_train::loss::Divergence;
    use frugal_train::model::RunOptions;
    use frugal_train::optim::{AdamWConfig, Schedule};
    use frugal_train::teacher::OnlineTeachers;
    use frugal_train::trainer::{LossConfig, Signal, TrainConfig, Trainer};

    let Some(path) = frugal::fetch::reference_model_for_tests() else {
        return;
    };
    let original = Model::load(&path).unwrap();
    let tok = frugal::tokenizer::Tokenizer::from_gguf(&original.file).unwrap();
    let text = "A cache keeps what was computed so that it need not be computed again. Keys and \
                values of every past token are kept for attention; a latent cache keeps one small \
                vector per token instead, and rebuilds each head's keys and values from it. ";
    let ids = tok.encode(&text.repeat(12), false).unwrap();
    let calib = calibrate(&original, &ids[..256], 128).unwrap();
    let target = MlaTarget {
        rank: 64,
        rope_dims: 32,
        factorization: Factorization::Activations,
    };
    let (w, _) = convert_to_mla(&original.file, &calib, target).unwrap();
    let mla = Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).unwrap();
    let p = Params::from_model(&mla).unwrap();

    let probe = &ids[..24];
    let mine = p.logits(
        &Batch {
            tokens: probe,
            batch: 1,
            seq: probe.len(),
        },
        Precision::F32,
    );
    let mut kv = mla.new_cache(probe.len()).unwrap();
    let mut s = Scratch::default();
    let theirs = mla
        .forward(probe, &mut kv as &mut dyn KvSequence, &mut s, Logits::All)
        .unwrap();
    let max_diff = mine
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("latent model: max |logit difference| {max_diff:.3e}");
    assert!(max_diff < 2e-3, "training forward differs by {max_diff}");

    let data = split(windows_of(&ids, 32), 0.25, "test text").unwrap();
    let steps = 6;
    let cfg = TrainConfig {
        seq: 32,
        batch: 2,
        accum: 1,
        steps,
        schedule: Schedule {
            lr: 3e-4,
            warmup: 1,
            total: steps,
            min_ratio: 0.1,
        },
        adamw: AdamWConfig::default(),
        clip: 1.0,
        freeze: Vec::new(),
        seed: 1,
        run: RunOptions {
            precision: Precision::F32,
            recompute: true,
            ..RunOptions::default()
        },
        loss: LossConfig {
            alpha: 1.0,
            temperature: 2.0,
            divergence: Divergence::Forward,
            hidden: None,
        },
        eval_every: 0,
        eval_windows: 0,
        checkpoint: None,
        save_every: 0,
    };
    let teachers = OnlineTeachers {
        models: vec![(original, 1.0)],
    };
    let mut t = Trainer::new(p, cfg, &data, Signal::Online(&teachers), None).unwrap();
    t.run(|_| {}).unwrap();
    let kl: Vec<f64> = t.history.iter().map(|e| e.kl.unwrap()).collect();
    eprintln!("latent model distillation: held-out KL {kl:?}");
    assert!(kl[1] < 0.8 * kl[0], "distillation did not heal: KL {kl:?}");
    // The trained model goes back to a file the inference engine runs.
    let back = t.params.to_gguf(&mla.file).to_bytes().unwrap();
    let healed = Model::from_file(GgufFile::from_bytes(back).unwrap()).unwrap();
    assert_eq!(healed.config, mla.config);
}

/// Gemma 3 270M (its Q4_K_M file, decoded to f32): the training forward equals the inference
/// engine's exact f32 logits through every Gemma switch on real weights (q/k norms,
/// post-norms, GELU gating, the √640 embedding scale, local layers with their own RoPE base;
/// the prompt is inside the 512-token window, which the synthetic tests of `families.rs`
/// cross). The difference is the order of f32 sums, as for SmolLM2, over 18 layers; the bound
/// is relative to the largest logit, 1e-4 (measured: 3.1e-5 on logits up to 26, 1.2e-6), where
/// a missing norm or the other RoPE pairing misses by O(1).
#[test]
fn gemma3_training_forward_equals_inference_logits() {
    let Some(path) = frugal::fetch::gemma_model_for_tests() else {
        return;
    };
    let model = Model::load(&path).unwrap();
    let (mine, theirs) = both_logits(&model, true);
    let (max_diff, scale) = max_diff_and_scale(&mine, &theirs);
    eprintln!("gemma3: max |logit difference| {max_diff:.3e} (logit scale {scale:.1})");
    assert!(
        max_diff < 1e-4 * scale,
        "training forward differs from inference by {max_diff}"
    );
}
