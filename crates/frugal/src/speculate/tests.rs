//! Exactness of speculative decoding on small models the tests build: greedy output equal to
//! plain decoding token for token, and sampled output distributed as plain sampling's (a
//! chi-square test that also checks it notices a broken acceptance rule).

use std::collections::HashMap;

use super::rule::tests::{BROKEN, chi_square, chi_square_critical_0001};
use super::{HeadWeights, Method, SpecOptions, Speculator};
use crate::attention::Attention;
use crate::generate::{GenerateOptions, Session};
use crate::gguf::GgufFile;
use crate::kv::{KvLayout, KvOptions};
use crate::model::synthetic::{SyntheticSpec, build};
use crate::model::{Logits, Model, Scratch};
use crate::quant::GgmlType;
use crate::quant::act::Activations;
use crate::sample::{Sampler, SamplerParams};
use crate::tokenizer::Tokenizer;

fn model(n_layers: usize, seed: u64) -> Model {
    let spec = SyntheticSpec {
        n_layers,
        n_embd: 64,
        n_ff: 128,
        n_head: 4,
        n_head_kv: 2,
        n_ctx: 512,
        ty: GgmlType::Q4_1,
        // A separate output matrix: with a tied one, every random model mostly predicts its
        // last input token, and a draft would agree with the target by construction.
        untied_output: true,
        seed,
        ..Default::default()
    };
    let mut m = Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap();
    m.set_activations(Activations::Q8);
    m
}

fn spec(method: Method, k: usize, adaptive: bool) -> SpecOptions {
    SpecOptions {
        method,
        k,
        adaptive,
        draft_vocab: None,
    }
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        stop: Vec::new(),
        sampler: SamplerParams::greedy(),
    }
}

/// A prompt with repeats, so prompt lookup finds matches.
fn prompt(seed: u32) -> Vec<u32> {
    let motif: Vec<u32> = (0..12u32).map(|i| (i * 37 + seed * 11) % 256).collect();
    let mut p = motif.clone();
    p.extend((0..20u32).map(|i| (i * 101 + seed) % 256));
    p.extend_from_slice(&motif);
    p.extend_from_slice(&motif[..6]);
    p
}

#[test]
fn greedy_speculation_reproduces_plain_decoding_for_every_drafter() {
    let target = model(3, 1);
    let tok = Tokenizer::from_gguf(&target.file).unwrap();
    let opts = greedy(40);
    for layout in [KvLayout::Contiguous, KvLayout::default()] {
        let kv = KvOptions {
            layout,
            ..Default::default()
        };
        for seed in 0..3 {
            let p = prompt(seed);
            let mut plain =
                Session::with_options(&target, 512, true, &kv, Attention::default()).unwrap();
            let want = plain.generate(&tok, &p, &opts, |_| {}).unwrap();
            // (drafter, draft model as (layers, seed)); the target as its own draft is always
            // right.
            let drafters = [
                (Method::Ngram { n: 3 }, None),
                (Method::EarlyExit { layers: 1 }, None),
                (Method::EarlyExit { layers: 2 }, None),
                (Method::Draft { path: "d".into() }, Some((1, 7))),
                (Method::Draft { path: "t".into() }, Some((3, 1))),
            ];
            for (method, draft) in &drafters {
                for (k, adaptive) in [(1, false), (4, false), (6, true)] {
                    let o = spec(method.clone(), k, adaptive);
                    let d = draft.map(|(layers, seed)| model(layers, seed));
                    let mut s =
                        Speculator::new(&target, 512, &kv, Attention::default(), &o, d).unwrap();
                    let (got, st) = s.generate(&tok, &p, &opts, |_| {}).unwrap();
                    let what =
                        format!("{method:?} k {k} adaptive {adaptive} seed {seed} {layout:?}");
                    assert_eq!(got.tokens, want.tokens, "{what}");
                    assert_eq!(got.text, want.text, "{what}");
                    assert_eq!(got.stop_reason, want.stop_reason, "{what}");
                    if *draft == Some((3, 1)) && !adaptive {
                        assert_eq!(
                            st.accepted, st.drafted,
                            "{what}: a self-draft is always right"
                        );
                        assert!(st.passes < got.tokens.len(), "{what}");
                    }
                }
            }
        }
    }
}

/// Retrieval drafting keeps plain decoding's tokens whether the store is right or wrong: the
/// store holds the target's own answer to each prompt with every third token changed (so its
/// drafts are partly kept, partly rejected) and the other prompts' answers.
#[test]
fn greedy_retrieval_drafting_reproduces_plain_decoding() {
    let target = model(3, 1);
    let tok = Tokenizer::from_gguf(&target.file).unwrap();
    let opts = greedy(40);
    let kv = KvOptions::default();
    let plain: Vec<(Vec<u32>, Vec<u32>)> = (0..3)
        .map(|seed| {
            let p = prompt(seed);
            let mut s =
                Session::with_options(&target, 512, true, &kv, Attention::default()).unwrap();
            let g = s.generate(&tok, &p, &opts, |_| {}).unwrap();
            (p, g.tokens)
        })
        .collect();
    let n_vocab = target.config.n_vocab;
    let docs: Vec<Vec<u32>> = plain
        .iter()
        .map(|(_, answer)| {
            let mut d = answer.clone();
            for (i, t) in d.iter_mut().enumerate() {
                if i % 3 == 2 {
                    *t = (*t + 1) % n_vocab as u32;
                }
            }
            d
        })
        .collect();
    let store = super::store::Datastore::new(docs.iter().map(|d| &d[..]), n_vocab).unwrap();
    let mut accepted = 0;
    for (p, want) in &plain {
        for (k, adaptive) in [(1, false), (4, false), (6, true)] {
            let store = store.clone();
            let o = spec(
                Method::Store {
                    path: "(in memory)".into(),
                },
                k,
                adaptive,
            );
            let mut s =
                Speculator::with_store(&target, 512, &kv, Attention::default(), &o, store).unwrap();
            let (got, st) = s.generate(&tok, p, &opts, |_| {}).unwrap();
            assert_eq!(&got.tokens, want, "k {k} adaptive {adaptive}");
            accepted += st.accepted;
        }
    }
    assert!(accepted > 0, "no retrieved token was ever kept");
    // A store of another vocabulary is refused.
    let other = super::store::Datastore::new([&[1u32, 2][..]], n_vocab + 1).unwrap();
    let o = spec(
        Method::Store {
            path: "(in memory)".into(),
        },
        4,
        true,
    );
    let e = Speculator::with_store(&target, 512, &kv, Attention::default(), &o, other)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("vocabulary"), "{e}");
}

/// Heads with random weights (they draft badly, which exercises rejection) over a vocabulary
/// subset, or the identity heads (which repeat the target's next token); reading the previous
/// token's embedding or not.
fn heads(random: bool, n: usize, token_input: bool) -> HeadWeights {
    let vocab = Some((0..200u32).collect());
    let mut w = HeadWeights::identity(
        n,
        64,
        crate::model::synthetic::SYNTHETIC_VOCAB,
        vocab,
        token_input,
    );
    if random {
        let mut state = 99u64;
        for (m, b) in &mut w.heads {
            for x in m.iter_mut().chain(b.iter_mut()) {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                *x = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5;
            }
        }
    }
    w
}

/// Options for draft heads kept in memory, with prompt lookup first when `lookup` is given.
fn heads_options(k: usize, adaptive: bool, lookup: Option<usize>) -> SpecOptions {
    SpecOptions {
        method: Method::Heads {
            path: "(in memory)".into(),
            lookup,
        },
        k,
        adaptive,
        draft_vocab: None,
    }
}

#[test]
fn greedy_speculation_with_draft_heads_reproduces_plain_decoding() {
    let target = model(3, 1);
    let tok = Tokenizer::from_gguf(&target.file).unwrap();
    let opts = greedy(40);
    let kv = KvOptions::default();
    let p = prompt(1);
    let mut plain = Session::with_options(&target, 512, true, &kv, Attention::default()).unwrap();
    let want = plain.generate(&tok, &p, &opts, |_| {}).unwrap();
    for token_input in [false, true] {
        for random in [false, true] {
            for (k, adaptive, lookup) in [
                (1, false, None),
                (3, false, None),
                (3, true, None),
                (4, true, Some(3)),
                (2, false, Some(2)),
            ] {
                let o = heads_options(k, adaptive, lookup);
                let w = heads(random, 3, token_input);
                let mut s =
                    Speculator::with_heads(&target, 512, &kv, Attention::default(), &o, w).unwrap();
                let (got, st) = s.generate(&tok, &p, &opts, |_| {}).unwrap();
                let what =
                    format!("random {random} k {k} lookup {lookup:?} token input {token_input}");
                assert_eq!(got.tokens, want.tokens, "{what}");
                assert!(st.drafted > 0, "{what}");
            }
        }
    }
    // A heads file round-trips, with and without the token input.
    let dir = std::env::temp_dir().join(format!("frugal-heads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("h.gguf");
    for token_input in [false, true] {
        let w = heads(true, 2, token_input);
        w.write(&path).unwrap();
        assert_eq!(HeadWeights::read(&path).unwrap(), w);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn speculation_stops_where_plain_decoding_does() {
    // A context that fills up mid-draft, and max_tokens smaller than K.
    let target = model(2, 3);
    let tok = Tokenizer::from_gguf(&target.file).unwrap();
    let p = prompt(5);
    for (ctx, max_tokens) in [(p.len() + 5, 100), (512, 3), (512, 1)] {
        let opts = greedy(max_tokens);
        let kv = KvOptions::default();
        let mut plain =
            Session::with_options(&target, ctx, true, &kv, Attention::default()).unwrap();
        let want = plain.generate(&tok, &p, &opts, |_| {}).unwrap();
        let o = spec(Method::Draft { path: "t".into() }, 8, false);
        let mut s = Speculator::new(
            &target,
            ctx,
            &kv,
            Attention::default(),
            &o,
            Some(model(2, 3)),
        )
        .unwrap();
        let (got, _) = s.generate(&tok, &p, &opts, |_| {}).unwrap();
        assert_eq!(got.tokens, want.tokens, "ctx {ctx} max {max_tokens}");
        assert_eq!(got.stop_reason, want.stop_reason);
    }
}

#[test]
fn bad_drafters_are_refused_with_a_reason() {
    let target = model(3, 1);
    let kv = KvOptions::default();
    let a = Attention::default();
    let e = |o: SpecOptions, d: Option<Model>| {
        Speculator::new(&target, 64, &kv, a, &o, d)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    assert!(e(spec(Method::EarlyExit { layers: 3 }, 2, true), None).contains("before the last"));
    assert!(
        e(
            spec(
                Method::Draft {
                    path: "/nonexistent/x".into()
                },
                2,
                true
            ),
            None
        )
        .contains("/nonexistent/x")
    );
    assert!(e(spec(Method::Ngram { n: 2 }, 2, true), Some(model(1, 2))).contains("takes none"));
}

/// The exact distribution of the first `n` generated tokens under `params`, from plain passes
/// of the target. Keys: the generated tokens, with `EOG` appended when generation ended.
fn exact_distribution(
    target: &Model,
    tok: &Tokenizer,
    p: &[u32],
    params: &SamplerParams,
    n: usize,
) -> HashMap<Vec<u32>, f64> {
    const EOG: u32 = u32::MAX;
    let mut s = Sampler::new(params.clone());
    let mut out = HashMap::new();
    // (generated so far, its probability), expanded one token at a time.
    let mut frontier = vec![(Vec::<u32>::new(), 1.0f64)];
    let mut dist = Vec::new();
    while let Some((done, prob)) = frontier.pop() {
        if done.len() == n {
            *out.entry(done).or_insert(0.0) += prob;
            continue;
        }
        let mut seq = p.to_vec();
        seq.extend_from_slice(&done);
        let mut kv = target.new_seq_cache(512, &KvOptions::default()).unwrap();
        let mut sc = Scratch::default();
        let logits = target
            .forward(&seq, &mut kv, &mut sc, Logits::Last)
            .unwrap();
        s.distribution(logits, &seq, &done, &mut dist);
        for &(t, pt) in &dist {
            let mut next = done.clone();
            let pr = prob * f64::from(pt);
            if tok.is_end_of_generation(t) {
                next.push(EOG);
                *out.entry(next).or_insert(0.0) += pr;
            } else {
                next.push(t);
                frontier.push((next, pr));
            }
        }
    }
    out
}

/// Tokens per sampled generation: the first comes from the prompt's pass, the others from
/// verification passes, so two drafted positions are checked.
const TOKENS: usize = 3;

fn sampled_counts(
    target: &Model,
    tok: &Tokenizer,
    p: &[u32],
    params: &SamplerParams,
    o: Option<&SpecOptions>,
    draft_seed: Option<u64>,
    runs: u64,
) -> HashMap<Vec<u32>, u64> {
    const EOG: u32 = u32::MAX;
    let kv = KvOptions::default();
    let draft = draft_seed.map(|s| model(1, s));
    // Without options: random draft heads.
    let mut sp = match o {
        Some(o) => Speculator::new(target, 512, &kv, Attention::default(), o, draft).unwrap(),
        None => Speculator::with_heads(
            target,
            512,
            &kv,
            Attention::default(),
            &heads_options(2, false, None),
            heads(true, 2, true),
        )
        .unwrap(),
    };
    let mut counts = HashMap::new();
    for seed in 0..runs {
        let opts = GenerateOptions {
            max_tokens: TOKENS,
            stop: Vec::new(),
            sampler: SamplerParams {
                seed,
                ..params.clone()
            },
        };
        let (g, _) = sp.generate(tok, p, &opts, |_| {}).unwrap();
        let mut key = g.tokens.clone();
        if g.stop_reason == crate::generate::StopReason::EndOfGeneration {
            key.push(EOG);
        }
        *counts.entry(key).or_insert(0) += 1;
    }
    counts
}

fn chi_square_against(
    counts: &HashMap<Vec<u32>, u64>,
    exact: &HashMap<Vec<u32>, f64>,
) -> (f64, usize) {
    let keys: Vec<&Vec<u32>> = exact.keys().collect();
    let observed: Vec<u64> = keys
        .iter()
        .map(|k| counts.get(*k).copied().unwrap_or(0))
        .collect();
    let strays: u64 = counts
        .iter()
        .filter(|(k, _)| !exact.contains_key(*k))
        .map(|(_, &c)| c)
        .sum();
    assert_eq!(strays, 0, "tokens outside the target's support: {counts:?}");
    let expected: Vec<f64> = keys.iter().map(|k| exact[*k]).collect();
    chi_square(&observed, &expected)
}

#[test]
fn speculative_sampling_keeps_the_targets_distribution() {
    // The joint distribution of three tokens (about 125 cells); top-k and temperature narrow the
    // support to a few tokens per step, and both the draft and
    // the target apply them; the draft model is another random model, so its guesses are
    // often rejected and the residual draw matters.
    let target = model(2, 21);
    let tok = Tokenizer::from_gguf(&target.file).unwrap();
    let p = prompt(9);
    let params = SamplerParams {
        temperature: 3.0,
        top_k: 5,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.1,
        ..Default::default()
    };
    let exact = exact_distribution(&target, &tok, &p, &params, TOKENS);
    let runs = 6000;
    for (o, draft) in [
        (spec(Method::Draft { path: "d".into() }, 3, false), Some(22)),
        (spec(Method::EarlyExit { layers: 1 }, 3, false), None),
        (spec(Method::Ngram { n: 3 }, 3, false), None),
    ] {
        let counts = sampled_counts(&target, &tok, &p, &params, Some(&o), draft, runs);
        let (stat, df) = chi_square_against(&counts, &exact);
        assert!(
            stat < chi_square_critical_0001(df),
            "{:?}: chi-square {stat:.1} with {df} degrees of freedom",
            o.method
        );
    }
    // Random draft heads: sampled drafts from a vocabulary subset.
    let counts = sampled_counts(&target, &tok, &p, &params, None, None, runs);
    let (stat, df) = chi_square_against(&counts, &exact);
    assert!(
        stat < chi_square_critical_0001(df),
        "heads: chi-square {stat:.1} with {df} degrees of freedom"
    );
    // Accepting every draft gives the draft's distribution: the test must see it.
    BROKEN.with(|b| b.set(true));
    let o = spec(Method::Draft { path: "d".into() }, 3, false);
    let counts = sampled_counts(&target, &tok, &p, &params, Some(&o), Some(22), runs);
    BROKEN.with(|b| b.set(false));
    let (stat, df) = chi_square_against_lenient(&counts, &exact);
    assert!(
        stat > chi_square_critical_0001(df),
        "the broken rule passed: chi-square {stat:.1} with {df} degrees of freedom"
    );
}

/// As [`chi_square_against`], counting tokens outside the target's support as a cell expected
/// to be (nearly) empty, which the broken rule produces.
fn chi_square_against_lenient(
    counts: &HashMap<Vec<u32>, u64>,
    exact: &HashMap<Vec<u32>, f64>,
) -> (f64, usize) {
    let mut keys: Vec<Vec<u32>> = exact.keys().cloned().collect();
    keys.extend(counts.keys().filter(|k| !exact.contains_key(*k)).cloned());
    let observed: Vec<u64> = keys
        .iter()
        .map(|k| counts.get(k).copied().unwrap_or(0))
        .collect();
    let expected: Vec<f64> = keys
        .iter()
        .map(|k| exact.get(k).copied().unwrap_or(1e-9))
        .collect();
    chi_square(&observed, &expected)
}

#[test]
fn parses_every_drafter_and_rejects_bad_values() {
    let p = |s: &str| s.parse::<SpecOptions>();
    assert_eq!(p("ngram").unwrap().method, Method::Ngram { n: 3 });
    assert_eq!(p("ngram:2:6").unwrap().k, 6);
    assert_eq!(p("self:8").unwrap().method, Method::EarlyExit { layers: 8 });
    assert_eq!(p("self:8:3").unwrap().k, 3);
    let d = p("draft:/tmp/a:b.gguf:5").unwrap();
    assert_eq!(
        (d.method, d.k),
        (
            Method::Draft {
                path: "/tmp/a:b.gguf".into()
            },
            5
        )
    );
    assert_eq!(p("draft:small.gguf").unwrap().k, 4);
    for bad in [
        "ngram:0",
        "ngram:2:0",
        "self",
        "self:0",
        "self:x",
        "draft:",
        "medusa:3",
    ] {
        assert!(p(bad).is_err(), "{bad} was accepted");
    }
}

/// The draft heads' vocabulary subset scores its tokens through the packed integer kernels on
/// 8-bit activations: each logit within the activations' rounding of the f32 product of the same
/// row (at most half a quantization step per element, `max|u_block| / 254`, times the row's
/// absolute weights in that block, summed over blocks; 1% and 1e-4 on top for the f32 sums),
/// and `-inf` for every token outside the subset.
#[test]
fn subset_head_scores_its_tokens_within_the_activation_rounding() {
    use super::heads::SubsetHead;
    let m = model(1, 3);
    let n_vocab = m.config.n_vocab;
    let ids: Vec<u32> = (0..40).map(|i| i * 5 + 2).collect();
    let mut head = SubsetHead::new(&m, ids.clone()).unwrap();
    let mut state = 12345u64;
    let u: Vec<f32> = (0..m.config.n_embd)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
        })
        .collect();
    let logits = head.logits(&u).unwrap().to_vec();
    let out = m.weights.output.view();
    let mut row = vec![0f32; m.config.n_embd];
    assert_eq!(logits.len(), n_vocab);
    for (t, &logit) in logits.iter().enumerate() {
        if !ids.contains(&(t as u32)) {
            assert_eq!(logit, f32::NEG_INFINITY, "token {t} is outside the subset");
            continue;
        }
        out.dequantize_row(t, &mut row);
        let exact: f64 = row.iter().zip(&u).map(|(&w, &x)| w as f64 * x as f64).sum();
        let bound: f64 = row
            .chunks(32)
            .zip(u.chunks(32))
            .map(|(w, x)| {
                let step = x.iter().fold(0f32, |a, v| a.max(v.abs())) as f64 / 127.0;
                step / 2.0 * w.iter().map(|v| v.abs() as f64).sum::<f64>()
            })
            .sum();
        let err = (logit as f64 - exact).abs();
        assert!(
            err <= bound * 1.01 + 1e-4,
            "token {t}: {logit} vs {exact} (bound {bound})"
        );
    }
}
