//! Attention-layout surgery on the reference model (SmolLM2-135M: 9 query heads on 3 KV heads):
//! MHA is exact at 3x the cache, MQA shrinks it to 1/3 and costs quality, and the cache each
//! converted model allocates is the size its layout says.
//!
//! Skips without the model unless `FRUGAL_REQUIRE_MODEL=1`.

use frugal::eval;
use frugal::gguf::GgufFile;
use frugal::kv::KvOptions;
use frugal::model::{Logits, Model, Scratch};
use frugal::surgery::{
    AttentionLayout, Factorization, MlaTarget, calibrate, convert_attention, convert_to_mla,
};
use frugal::tokenizer::Tokenizer;

fn converted(src: &GgufFile, layout: AttentionLayout) -> Model {
    let (w, report) = convert_attention(src, layout).expect("converts");
    assert_eq!(report.kv_heads_after, layout.kv_heads(9));
    Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).expect("loads")
}

#[test]
fn converted_layouts_on_the_reference_model() {
    let Some(path) = frugal::fetch::reference_model_for_tests() else {
        return;
    };
    let src = GgufFile::open(&path).unwrap();
    let original = Model::load(&path).unwrap();
    let tok = Tokenizer::from_gguf(&original.file).unwrap();
    let text = "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, \
                France. It is named after the engineer Gustave Eiffel, whose company designed \
                and built the tower from 1887 to 1889. Locally nicknamed the iron lady, it was \
                constructed as the centerpiece of the 1889 World's Fair, and to crown the \
                centennial anniversary of the French Revolution. "
        .repeat(3);
    let tokens = tok.encode(&text, false).unwrap();
    let ctx = 128;
    // What the cache a model allocates holds after the same 64 positions.
    let cache_bytes = |m: &Model| {
        let mut kv = m.new_seq_cache(ctx, &KvOptions::default()).unwrap();
        m.forward(
            &tokens[..64],
            &mut kv,
            &mut Scratch::default(),
            Logits::Last,
        )
        .unwrap();
        kv.bytes_in_use()
    };

    let mha = converted(&src, AttentionLayout::Mha);
    let same = eval::compare(&mha, &original, &tokens, ctx, |_, _| {}).unwrap();
    // The same function: equal logits, so zero divergence (up to the last bit of the sums).
    assert!(same.kl_mean < 1e-9, "MHA KL {}", same.kl_mean);
    assert_eq!(same.model.ppl, same.reference.ppl);
    assert_eq!(cache_bytes(&mha), 3 * cache_bytes(&original));

    let mqa = converted(&src, AttentionLayout::Mqa);
    let lossy = eval::compare(&mqa, &original, &tokens, ctx, |_, _| {}).unwrap();
    eprintln!(
        "original PPL {:.3}; MQA PPL {:.3}, KL {:.4}",
        lossy.reference.ppl, lossy.model.ppl, lossy.kl_mean
    );
    // Mean-pooling three unrelated heads into one is a different function, and without
    // uptraining a broken one (the GQA paper: "MQA requires uptraining to be useful"); here the
    // PPL goes from ~2.4 to ~8,500, which llama.cpp reproduces on the same file (the interop
    // test). Distillation is what recovers it.
    assert!(lossy.kl_mean > 1.0 && lossy.model.ppl > 10.0 * lossy.reference.ppl);
    assert!(lossy.model.ppl.is_finite());
    assert_eq!(3 * cache_bytes(&mqa), cache_bytes(&original));

    // The original grouping is the identity.
    let (w, r) = convert_attention(&src, AttentionLayout::Gqa(3)).unwrap();
    assert!(r.exact());
    for t in src.tensors() {
        let out = w.tensors.iter().find(|o| o.name == t.name).unwrap();
        assert_eq!(&*out.data, src.tensor_bytes(t), "{}", t.name);
    }
    // A grouping that does not divide nine heads is refused.
    assert!(convert_attention(&src, AttentionLayout::Gqa(2)).is_err());
}

/// GQA to MLA on the reference model: the converted file loads, caches one latent row of
/// `rank + rope` values per token and layer, and runs as a worse but working model; the
/// activation-aware factorization keeps more than the weights' SVD at the same rank.
#[test]
fn mla_conversion_on_the_reference_model() {
    let Some(path) = frugal::fetch::reference_model_for_tests() else {
        return;
    };
    let src = GgufFile::open(&path).unwrap();
    let original = Model::load(&path).unwrap();
    let tok = Tokenizer::from_gguf(&original.file).unwrap();
    let text = "Multi-head latent attention stores one compressed vector per token. The keys and \
                values of every head are rebuilt from it, so the cache shrinks while the heads \
                stay. Rotary position embeddings do not commute with that compression, so a \
                few dimensions keep their rotation in a key shared by all heads. "
        .repeat(6);
    let tokens = tok.encode(&text, false).unwrap();
    let calib = calibrate(&original, &tokens[..256], 128).unwrap();
    let mut kls = Vec::new();
    for factorization in [Factorization::Svd, Factorization::Activations] {
        let target = MlaTarget {
            rank: 96,
            rope_dims: 32,
            factorization,
        };
        let (w, report) = convert_to_mla(&src, &calib, target).unwrap();
        assert_eq!(
            (report.cache_values_before, report.cache_values_after),
            (384, 128)
        );
        let mla = Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).unwrap();
        assert_eq!(mla.config.mla.map(|m| m.row_dim()), Some(128));
        let mut kv = mla.new_seq_cache(128, &KvOptions::default()).unwrap();
        mla.forward(
            &tokens[..64],
            &mut kv,
            &mut Scratch::default(),
            Logits::Last,
        )
        .unwrap();
        assert_eq!(kv.bytes_in_use(), 64 * 30 * 128 * 4);
        let cmp = eval::compare(&mla, &original, &tokens, 128, |_, _| {}).unwrap();
        eprintln!(
            "mla:96:32 {factorization}: PPL {:.2} (original {:.2}), KL {:.3}; latent energy {:.3}",
            cmp.model.ppl,
            cmp.reference.ppl,
            cmp.kl_mean,
            report.latent_energy.iter().sum::<f64>() / 30.0
        );
        assert!(cmp.model.ppl.is_finite() && cmp.model.ppl > cmp.reference.ppl);
        kls.push(cmp.kl_mean);
    }
    assert!(
        kls[1] < kls[0],
        "activation-aware KL {} vs SVD {}",
        kls[1],
        kls[0]
    );
}
