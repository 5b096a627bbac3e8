//! Speculative decoding on the reference model: for every drafter, greedy output is token for
//! token the output of plain decoding, over prompts of different kinds (input-grounded rewrite
//! and code, where prompt lookup drafts well, and open generation, where it rarely does); and a
//! draft with another vocabulary is refused. Skips when the model is absent (see
//! `reference_model.rs`).

use frugal::attention::Attention;
use frugal::chat::{ChatTemplate, Message};
use frugal::convert::{self, Policy, Target};
use frugal::generate::{GenerateOptions, Session};
use frugal::gguf::GgufFile;
use frugal::kv::{KvLayout, KvOptions};
use frugal::model::Model;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::act::Activations;
use frugal::sample::SamplerParams;
use frugal::speculate::store::Datastore;
use frugal::speculate::{HeadWeights, Method, SpecOptions, Speculator};
use frugal::tokenizer::Tokenizer;

const PROMPTS: [&str; 4] = [
    "Rewrite this sentence in the past tense: The cat sits on the mat and watches the birds in the garden.",
    "Add type hints to this function:\n\ndef area(width, height):\n    return width * height",
    "Write a short poem about the sea.",
    "List three facts about the Moon.",
];

fn load() -> Option<(Model, Tokenizer)> {
    let mut model =
        Model::load(frugal::fetch::reference_model_for_tests()?).expect("reference model loads");
    model.set_activations(Activations::Q8);
    let tok = Tokenizer::from_gguf(&model.file).expect("tokenizer builds");
    Some((model, tok))
}

/// The reference model re-quantized to Q4_0 in memory: a different model with the same
/// vocabulary, to draft with.
fn q4_0_draft(model: &Model) -> Model {
    let target: Target = "q4_0".parse().unwrap();
    let (file, _) = convert::quantize_in_memory(&model.file, &Policy::new(target), |_, _| {})
        .expect("re-quantizes");
    let mut m = Model::from_file(file).unwrap();
    m.set_activations(Activations::Q8);
    m
}

#[test]
fn every_drafter_reproduces_greedy_decoding_on_the_real_model() {
    let Some((model, tok)) = load() else { return };
    let template = ChatTemplate::from_gguf(&model.file).unwrap();
    let opts = GenerateOptions {
        max_tokens: 40,
        stop: Vec::new(),
        sampler: SamplerParams::greedy(),
    };
    let a = Attention::default();
    let mut accepted = 0;
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let text = template
            .render(&[Message::new("user", prompt)], true)
            .unwrap();
        let ids = tok.encode(&text, true).unwrap();
        // Both cache layouts, alternating over the prompts.
        let layout = if i % 2 == 0 {
            KvLayout::Contiguous
        } else {
            KvLayout::default()
        };
        let kv = KvOptions {
            layout,
            ..Default::default()
        };
        let ctx = ids.len() + opts.max_tokens + 1;
        let mut plain = Session::with_options(&model, ctx, true, &kv, a).unwrap();
        let want = plain.generate(&tok, &ids, &opts, |_| {}).unwrap();
        let drafters = [
            ("ngram", None),
            ("ngram:2:6", None),
            ("self:8:3", None),
            ("self:24", None),
            ("draft:q4_0", Some(q4_0_draft(&model))),
            ("draft:q4_0-top8k", Some(q4_0_draft(&model))),
        ];
        for (name, draft) in drafters {
            let mut o: SpecOptions = name.trim_end_matches("-top8k").parse().unwrap();
            o.adaptive = i % 2 == 1;
            if name.ends_with("-top8k") {
                // FR-Spec: the draft scores only the first 8192 ids.
                o.draft_vocab = Some(8192);
            }
            let mut s = Speculator::new(&model, ctx, &kv, a, &o, draft).unwrap();
            let (got, st) = s.generate(&tok, &ids, &opts, |_| {}).unwrap();
            assert_eq!(got.tokens, want.tokens, "{name} on prompt {i} ({layout:?})");
            assert_eq!(got.stop_reason, want.stop_reason, "{name} on prompt {i}");
            accepted += st.accepted;
        }
        // Retrieval drafting from a datastore holding this answer with every fifth token
        // changed, beside the other prompts' text: its drafts are partly kept, partly rejected.
        let vocab = model.config.n_vocab;
        let mut answer = want.tokens.clone();
        for (j, t) in answer.iter_mut().enumerate() {
            if j % 5 == 4 {
                *t = (*t + 1) % vocab as u32;
            }
        }
        let others: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|p| tok.encode(p, false).unwrap())
            .collect();
        let docs = std::iter::once(answer.as_slice()).chain(others.iter().map(Vec::as_slice));
        let store = Datastore::new(docs, vocab).unwrap();
        let mut o: SpecOptions = "store:(in memory):5".parse().unwrap();
        o.adaptive = i % 2 == 1;
        let mut s = Speculator::with_store(&model, ctx, &kv, a, &o, store).unwrap();
        let (got, st) = s.generate(&tok, &ids, &opts, |_| {}).unwrap();
        assert_eq!(got.tokens, want.tokens, "store on prompt {i} ({layout:?})");
        assert!(
            st.accepted > 0,
            "no draft (lookup or store) was kept on prompt {i}"
        );
        // Draft heads: untrained (each repeats the model's next token) over the first 4096
        // ids, and perturbed ones; exactness does not depend on what they guess.
        let n = model.config.n_embd;
        for (scale, token_input) in [(0.0f32, false), (0.05, false), (0.05, true)] {
            let vocab = Some((0..4096).collect());
            let mut w = HeadWeights::identity(3, n, model.config.n_vocab, vocab, token_input);
            for (j, (m, _)) in w.heads.iter_mut().enumerate() {
                for (x, v) in m.iter_mut().enumerate() {
                    *v = scale * (((x * 7 + j * 13) % 17) as f32 / 17.0 - 0.5);
                }
            }
            // Alone, and after prompt lookup (`ngram+heads`).
            let lookup = token_input.then_some(3);
            let o = SpecOptions {
                method: Method::Heads {
                    path: "(in memory)".into(),
                    lookup,
                },
                k: 3,
                adaptive: i % 2 == 1,
                draft_vocab: None,
            };
            let mut s = Speculator::with_heads(&model, ctx, &kv, a, &o, w).unwrap();
            let (got, _) = s.generate(&tok, &ids, &opts, |_| {}).unwrap();
            let what = format!("heads x{scale} (token input {token_input}) on prompt {i}");
            assert_eq!(got.tokens, want.tokens, "{what}");
        }
    }
    assert!(accepted > 0, "no drafted token was ever accepted");
}

#[test]
fn a_draft_with_another_vocabulary_is_refused() {
    let Some((model, _)) = load() else { return };
    let other =
        Model::from_file(GgufFile::from_bytes(build(&SyntheticSpec::default())).unwrap()).unwrap();
    let o = SpecOptions {
        method: Method::Draft {
            path: "other.gguf".into(),
        },
        k: 4,
        adaptive: true,
        draft_vocab: None,
    };
    let e = Speculator::new(
        &model,
        64,
        &KvOptions::default(),
        Attention::default(),
        &o,
        Some(other),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(e.contains("vocabulary"), "{e}");
}
