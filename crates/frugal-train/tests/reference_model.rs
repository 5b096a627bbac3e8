//! The training engine on the real model (skips when it is absent; CI requires it).

use frugal::kv::KvSequence;
use frugal::model::{Logits, Model, Scratch};
use frugal_train::Params;
use frugal_train::gemm::Precision;
use frugal_train::model::Batch;

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
    let tok = frugal::tokenizer::Tokenizer::from_gguf(&model.file).unwrap();
    let ids = tok
        .encode(
            "The capital of France is Paris, and the capital of Italy is",
            false,
        )
        .unwrap();
    let p = Params::from_model(&model).unwrap();
    let mine = p.logits(
        &Batch {
            tokens: &ids,
            batch: 1,
            seq: ids.len(),
        },
        Precision::F32,
    );
    let mut kv = model.new_cache(ids.len()).unwrap();
    let mut s = Scratch::default();
    let theirs = model
        .forward(&ids, &mut kv as &mut dyn KvSequence, &mut s, Logits::All)
        .unwrap();
    assert_eq!(mine.len(), theirs.len());
    let max_diff = mine
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
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
