//! Qwen 2, Qwen 3 and Llama 3's RoPE on real weights: the reference model (SmolLM2, a `llama`
//! file) rewritten as the other families (`frugal::model::relabel`), where the arithmetic says
//! what the result must be; and the metadata and tensors frugal must refuse, each refusal
//! naming the key or tensor at fault.
//!
//! What llama.cpp computes on the same rewritten files is checked by the CLI crate's
//! `families_llama_cpp` test (it needs a llama.cpp build), and what Hugging Face `transformers`
//! computes on small random files by `families_transformers` here.

use frugal::gguf::{GgufFile, GgufWriter, TensorData, Value};
use frugal::model::relabel::{Target, llama_as, llama3_factors, with_rope};
use frugal::model::synthetic::{SyntheticQwen, SyntheticSpec, build};
use frugal::model::{Logits, Model, Scratch};
use frugal::quant::GgmlType;
use std::borrow::Cow;

fn reference() -> Option<GgufFile> {
    let p = frugal::fetch::reference_model_for_tests()?;
    Some(GgufFile::open(p).expect("reference model opens"))
}

/// Logits of every position of `tokens`, exact f32 activations.
fn logits(bytes: Vec<u8>, tokens: &[u32]) -> Vec<f32> {
    let m = Model::from_file(GgufFile::from_bytes(bytes).unwrap()).unwrap();
    let mut kv = m.new_cache(64).unwrap();
    let mut s = Scratch::default();
    m.forward(tokens, &mut kv, &mut s, Logits::All)
        .unwrap()
        .to_vec()
}

fn file_bytes(f: &GgufFile) -> Vec<u8> {
    GgufWriter::from_file(f).to_bytes().unwrap()
}

const TOKENS: [u32; 10] = [504, 3575, 282, 4649, 314, 7042, 30, 198, 504, 2988];

/// Largest difference between two logit vectors, relative to the largest logit.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// SmolLM2 as a `qwen2` file with zero biases is SmolLM2: each head's Q and K rows in split
/// halves with NeoX RoPE pair the same dimensions as interleaved rows with Llama's RoPE. Only
/// the order of the terms of each score's dot product differs, so the logits agree to f32
/// rounding (1e-4 of the largest logit, for 30 layers of accumulated rounding; a pairing
/// mistake moves them by whole units).
#[test]
fn qwen2_with_zero_biases_is_the_llama_model() {
    let Some(f) = reference() else { return };
    let want = logits(file_bytes(&f), &TOKENS);
    let qwen = llama_as(&f, &Target::Qwen2 { bias: 0.0 }, 1).unwrap();
    let qf = GgufFile::from_bytes(qwen.clone()).unwrap();
    assert_eq!(qf.str("general.architecture").unwrap(), "qwen2");
    let got = logits(qwen, &TOKENS);
    let d = rel_diff(&want, &got);
    assert!(d < 1e-4, "qwen2 relabel differs from llama by {d}");
    // And the biases are applied: small ones move the logits, but not by much.
    let biased = logits(
        llama_as(&f, &Target::Qwen2 { bias: 0.05 }, 1).unwrap(),
        &TOKENS,
    );
    let d = rel_diff(&want, &biased);
    assert!(
        d > 1e-3 && d < 0.5,
        "biases of 0.05 moved the logits by {d}"
    );
}

/// SmolLM2 as a `phi3` file (fused Q/K/V and gate/up, split back at load; NeoX pairs) is
/// SmolLM2, as the Qwen 2 file is; with long and short RoPE factors, the long ones apply only
/// when the context exceeds the original one.
#[test]
fn phi3_is_the_llama_model_and_picks_its_factors_by_context() {
    let Some(f) = reference() else { return };
    let want = logits(file_bytes(&f), &TOKENS);
    let phi = llama_as(&f, &Target::Phi3 { factors: None }, 1).unwrap();
    let d = rel_diff(&want, &logits(phi, &TOKENS));
    assert!(d < 1e-4, "phi3 relabel differs from llama by {d}");

    let phi = llama_as(
        &f,
        &Target::Phi3 {
            factors: Some((4.0, 64)),
        },
        1,
    )
    .unwrap();
    let mut m = Model::from_file(GgufFile::from_bytes(phi).unwrap()).unwrap();
    let lr = m.config.long_rope.clone().unwrap();
    assert_eq!(lr.orig_ctx, 64);
    let run = |m: &Model| {
        let mut kv = m.new_cache(64).unwrap();
        let mut s = Scratch::default();
        m.forward(&TOKENS, &mut kv, &mut s, Logits::All)
            .unwrap()
            .to_vec()
    };
    m.config.set_context(64);
    assert_eq!(m.config.rope_scaling.freq_factors, lr.short);
    let short = run(&m);
    m.config.set_context(65);
    assert_eq!(m.config.rope_scaling.freq_factors, lr.long);
    let long = run(&m);
    assert!(rel_diff(&short, &long) > 1e-4);
    assert!(rel_diff(&want, &short) > 1e-4);
}

/// Qwen 3's per-head norms with weights of one on SmolLM2's rows: RMS-normalizing each head
/// changes the model (so the logits move), and the file runs.
#[test]
fn qwen3_runs_and_its_head_norms_act() {
    let Some(f) = reference() else { return };
    let base = logits(file_bytes(&f), &TOKENS);
    let q3 = logits(
        llama_as(&f, &Target::Qwen3 { spread: 0.0 }, 1).unwrap(),
        &TOKENS,
    );
    assert!(q3.iter().all(|v| v.is_finite()));
    assert!(rel_diff(&base, &q3) > 1e-3);
}

/// Llama 3's `rope_freqs`: factors of one change nothing (the same bits); factors of two all
/// through are linear scaling by two (the same bits again: each angle is divided by 2 either
/// way); and Llama 3's own factors move the logits.
#[test]
fn rope_freqs_divide_the_angles() {
    let Some(f) = reference() else { return };
    let base = logits(file_bytes(&f), &TOKENS);
    let pairs = 32;
    let ones = logits(
        with_rope(&f, Some(vec![1.0; pairs]), None).unwrap(),
        &TOKENS,
    );
    assert_eq!(base, ones);
    let twos = logits(
        with_rope(&f, Some(vec![2.0; pairs]), None).unwrap(),
        &TOKENS,
    );
    let linear = logits(
        with_rope(&f, None, Some(("linear", 2.0, None))).unwrap(),
        &TOKENS,
    );
    assert_eq!(twos, linear);
    assert!(rel_diff(&base, &twos) > 1e-3);
    let l3 = llama3_factors(64, 100_000.0, 8.0, 1.0, 4.0, 8192);
    assert_eq!(l3.len(), pairs);
    assert_eq!(l3[0], 1.0);
    assert_eq!(l3[pairs - 1], 8.0);
    let got = logits(with_rope(&f, Some(l3), None).unwrap(), &TOKENS);
    assert!(rel_diff(&base, &got) > 1e-4);
}

/// YaRN at factor 1 is no scaling at all except ggml's `1 + 0.1 ln(1)` = 1 on cos and sin and
/// a ramp between equal angles: the same logits to rounding; at factor 4 they move.
#[test]
fn yarn_scaling_runs() {
    let Some(f) = reference() else { return };
    let base = logits(file_bytes(&f), &TOKENS);
    let y1 = logits(
        with_rope(&f, None, Some(("yarn", 1.0, Some(2048)))).unwrap(),
        &TOKENS,
    );
    assert!(rel_diff(&base, &y1) < 1e-5);
    let y4 = logits(
        with_rope(&f, None, Some(("yarn", 4.0, Some(2048)))).unwrap(),
        &TOKENS,
    );
    assert!(rel_diff(&base, &y4) > 1e-3);
}

fn load_err(bytes: Vec<u8>) -> String {
    match Model::from_file(GgufFile::from_bytes(bytes).unwrap()) {
        Ok(_) => panic!("the file loaded"),
        Err(e) => e.to_string(),
    }
}

fn synthetic(qwen: Option<SyntheticQwen>) -> SyntheticSpec {
    SyntheticSpec {
        qwen,
        ..Default::default()
    }
}

/// Each bad file is refused with one line naming what is wrong.
#[test]
fn bad_family_files_are_refused_by_name() {
    let llama = build(&synthetic(None));
    let f = GgufFile::from_bytes(llama.clone()).unwrap();

    // RoPE factors of the wrong length, or not positive.
    let e = load_err(with_rope(&f, Some(vec![1.0; 3]), None).unwrap());
    assert!(e.contains("rope_freqs.weight") && e.contains("[8]"), "{e}");
    let e = load_err(with_rope(&f, Some(vec![0.0; 8]), None).unwrap());
    assert!(
        e.contains("rope_freqs.weight") && e.contains("factor 0"),
        "{e}"
    );
    // A scaling type llama.cpp does not know.
    let e = load_err(with_rope(&f, None, Some(("stretchy", 2.0, None))).unwrap());
    assert!(
        e.contains("llama.rope.scaling.type") && e.contains("stretchy"),
        "{e}"
    );

    // A tensor the block has no place for (an FFN bias) is named, not ignored.
    let mut w = GgufWriter::from_file(&f);
    w.tensors.push(TensorData {
        name: "blk.1.ffn_up.bias".into(),
        dims: vec![96],
        ty: GgmlType::F32,
        data: Cow::Owned(vec![0u8; 96 * 4]),
    });
    let e = load_err(w.to_bytes().unwrap());
    assert!(e.contains("blk.1.ffn_up.bias"), "{e}");

    // Frequency factors in a family llama.cpp reads none for.
    let q2 = GgufFile::from_bytes(build(&synthetic(Some(SyntheticQwen::Qwen2)))).unwrap();
    let e = load_err(with_rope(&q2, Some(vec![1.0; 8]), None).unwrap());
    assert!(
        e.contains("rope_freqs.weight") && e.contains("qwen2"),
        "{e}"
    );

    // Qwen 3 without its head norms.
    let q3 = build(&synthetic(Some(SyntheticQwen::Qwen3 { head_dim: 32 })));
    let f3 = GgufFile::from_bytes(q3).unwrap();
    let mut w = GgufWriter::from_file(&f3);
    w.tensors.retain(|t| t.name != "blk.0.attn_k_norm.weight");
    let e = load_err(w.to_bytes().unwrap());
    assert!(e.contains("blk.0.attn_k_norm.weight"), "{e}");

    // A bias of the wrong width.
    let f2 = GgufFile::from_bytes(build(&synthetic(Some(SyntheticQwen::Qwen2)))).unwrap();
    let mut w = GgufWriter::from_file(&f2);
    let t = w
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.attn_k.bias")
        .unwrap();
    t.dims = vec![16];
    t.data = Cow::Owned(vec![0u8; 64]);
    let e = load_err(w.to_bytes().unwrap());
    assert!(e.contains("blk.0.attn_k.bias"), "{e}");

    // Head counts that do not divide the width (no key_length to say otherwise).
    let mut w = GgufWriter::from_file(&f2);
    w.set("qwen2.attention.head_count", Value::U32(5));
    w.set("qwen2.attention.head_count_kv", Value::U32(5));
    let e = load_err(w.to_bytes().unwrap());
    assert!(e.contains("qwen2.embedding_length"), "{e}");

    // An unknown architecture names itself.
    let mut w = GgufWriter::from_file(&f);
    w.set("general.architecture", Value::String("falcon".into()));
    let e = load_err(w.to_bytes().unwrap());
    assert!(
        e.contains("falcon") && e.contains("general.architecture"),
        "{e}"
    );
}

/// Every synthetic family loads and decodes token by token to the logits of one prefill pass
/// (the cache and RoPE positions agree), with 8-bit activations as well as exact ones.
#[test]
fn synthetic_families_decode_as_they_prefill() {
    for qwen in [
        None,
        Some(SyntheticQwen::Qwen2),
        Some(SyntheticQwen::Qwen3 { head_dim: 24 }),
    ] {
        let spec = SyntheticSpec {
            ty: GgmlType::Q8_0,
            untied_output: true,
            ..synthetic(qwen.clone())
        };
        let m = Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap();
        let toks = [1u32, 50, 7, 200, 33, 90];
        let mut kv = m.new_cache(32).unwrap();
        let mut s = Scratch::default();
        let all = m
            .forward(&toks, &mut kv, &mut s, Logits::All)
            .unwrap()
            .to_vec();
        let mut kv = m.new_cache(32).unwrap();
        let nv = m.config.n_vocab;
        for (i, &t) in toks.iter().enumerate() {
            let one = m.forward(&[t], &mut kv, &mut s, Logits::Last).unwrap();
            let want = &all[i * nv..(i + 1) * nv];
            assert!(rel_diff(want, one) < 1e-5, "{qwen:?} position {i}");
        }
    }
}
