//! frugal against llama.cpp on the reference model (SmolLM2-135M-Instruct, Q4_1), with the
//! figures llama.cpp produced for it (see docs/families.md, "The reference model against
//! llama.cpp"). With exact f32 arithmetic on the dequantized weights frugal computes what
//! llama.cpp's F32 file computes.
//!
//! The model is found at `$FRUGAL_MODEL` or in the frugal cache. When it is absent these tests
//! skip, unless `FRUGAL_REQUIRE_MODEL=1` (set by CI) makes that a failure.

use frugal::attention::Attention;
use frugal::eval::EvalOptions;
use frugal::generate::{GenerateOptions, Session, StopReason};
use frugal::kv::{KvFormat, KvLayout, KvOptions};
use frugal::model::{Logits, Model, Scratch};
use frugal::ops::log_sum_exp;
use frugal::sample::SamplerParams;
use frugal::tokenizer::Tokenizer;

const PROMPT: &str = "The capital of France is";

fn load() -> Option<(Model, Tokenizer)> {
    let model =
        Model::load(frugal::fetch::reference_model_for_tests()?).expect("reference model loads");
    let tok = Tokenizer::from_gguf(&model.file).expect("tokenizer builds");
    Some((model, tok))
}

#[test]
fn tokenization_matches_llama_cpp() {
    let Some((_, tok)) = load() else { return };
    assert_eq!(
        tok.encode(PROMPT, false).unwrap(),
        [504, 3575, 282, 4649, 314]
    );
    // Special tokens are parsed only when asked for.
    let chat = "<|im_start|>user\nHi<|im_end|>\n";
    let special = tok.encode(chat, true).unwrap();
    assert_eq!(special[0], 1);
    assert!(special.contains(&2));
    let plain = tok.encode(chat, false).unwrap();
    assert!(!plain.contains(&1) && !plain.contains(&2), "{plain:?}");
    assert_eq!(tok.decode(&plain), chat);
    // Digits are split one by one (the smollm pre-tokenizer).
    let digits = tok.encode("2018", false).unwrap();
    assert_eq!(digits.len(), 4);
    assert_eq!(tok.decode(&digits), "2018");
}

#[test]
fn greedy_continuation_matches_llama_cpp_f32() {
    let Some((model, tok)) = load() else { return };
    let prompt = tok.encode(PROMPT, false).unwrap();
    let mut session = Session::new(&model, 256, true).unwrap();
    let opts = GenerateOptions {
        max_tokens: 64,
        stop: vec![],
        sampler: SamplerParams::greedy(),
    };
    let g = session.generate(&tok, &prompt, &opts, |_| {}).unwrap();
    // llama.cpp F32 / F16 / Q8_0: these 29 tokens, then EOS (id 2).
    let expected = [
        7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33, 29, 34, 34, 216,
        33, 34, 42, 33, 34, 42, 37, 35, 30,
    ];
    assert_eq!(g.tokens, expected);
    assert_eq!(g.stop_reason, StopReason::EndOfGeneration);
    assert_eq!(g.text, " Paris.\n\nThe answer is: 2018-01-22 12:12:53.");
}

#[test]
fn first_token_top10_logprobs_match_llama_cpp() {
    let Some((model, tok)) = load() else { return };
    let prompt = tok.encode(PROMPT, false).unwrap();
    let mut kv = model.new_cache(64).unwrap();
    let mut s = Scratch::default();
    let logits = model
        .forward(&prompt, &mut kv, &mut s, Logits::Last)
        .unwrap();
    let lse = log_sum_exp(logits);
    let expected = [
        (7042, -0.2578),
        (260, -2.7412),
        (4528, -4.3846),
        (2250, -4.6187),
        (1315, -4.6788),
        (5145, -4.7238),
        (216, -4.9160),
        (441, -4.9305),
        (3692, -5.0459),
        (3575, -5.5101),
    ];
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    for (rank, &(id, lp)) in expected.iter().enumerate() {
        assert_eq!(order[rank], id, "rank {rank}");
        let got = f64::from(logits[id]) - lse;
        assert!(
            (got - lp).abs() < 0.01,
            "token {id}: {got:.4} vs llama.cpp {lp}"
        );
    }
}

#[test]
fn kv_cache_and_recompute_agree_on_the_real_model() {
    let Some((model, tok)) = load() else { return };
    let mut seq = tok.encode(PROMPT, false).unwrap();
    let mut kv = model.new_cache(64).unwrap();
    let mut s = Scratch::default();
    let mut cached = model
        .forward(&seq, &mut kv, &mut s, Logits::Last)
        .unwrap()
        .to_vec();
    for step in 0..12 {
        let mut kv2 = model.new_cache(64).unwrap();
        let mut s2 = Scratch::default();
        let full = model
            .forward(&seq, &mut kv2, &mut s2, Logits::Last)
            .unwrap();
        // Same math in a different order (matrix-matrix vs matrix-vector): 1e-4 relative.
        let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = cached
            .iter()
            .zip(full)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            diff <= 1e-4 * scale,
            "step {step}: max diff {diff} vs scale {scale}"
        );
        let next = (0..full.len())
            .max_by(|&a, &b| full[a].total_cmp(&full[b]))
            .unwrap() as u32;
        let next_cached = (0..cached.len())
            .max_by(|&a, &b| cached[a].total_cmp(&cached[b]))
            .unwrap() as u32;
        assert_eq!(next, next_cached, "step {step}");
        seq.push(next);
        cached = model
            .forward(&[next], &mut kv, &mut s, Logits::Last)
            .unwrap()
            .to_vec();
    }
}

#[test]
fn perplexity_on_gpl3_matches_llama_cpp_f32() {
    let text_path = std::path::Path::new("/usr/share/common-licenses/GPL-3");
    let Ok(text) = std::fs::read_to_string(text_path) else {
        eprintln!("skipping: {} not present", text_path.display());
        return;
    };
    let Some((model, tok)) = load() else { return };
    let tokens = tok.encode(&text, false).unwrap();
    assert_eq!(
        tokens.len(),
        7639,
        "llama.cpp tokenizes this text to 7,639 tokens"
    );
    // The default path: flash attention over a paged f32 cache.
    let r = frugal::eval::perplexity(&model, &tokens, 512, |_, _| {}).unwrap();
    assert_eq!((r.windows, r.tokens), (14, 3570));
    // The reference path (naive attention, contiguous cache) on the first three windows (the
    // whole text would double this test's time; `frugal eval perplexity --attention naive`
    // gives the full figure): the same PPL to 1e-4.
    let first3 = &tokens[..3 * 512];
    let flash3 = frugal::eval::perplexity(&model, first3, 512, |_, _| {}).unwrap();
    let naive_opts = EvalOptions {
        kv: KvOptions {
            layout: KvLayout::Contiguous,
            ..KvOptions::default()
        },
        attention: Attention::Naive,
    };
    let naive3 =
        frugal::eval::perplexity_with(&model, first3, 512, &naive_opts, |_, _| {}).unwrap();
    assert!(
        (flash3.ppl - naive3.ppl).abs() < 1e-4,
        "flash {} vs naive {}",
        flash3.ppl,
        naive3.ppl
    );
    // llama.cpp F32: 18.2994; the issue allows 0.3%, overall and per window.
    assert!((r.ppl / 18.2994 - 1.0).abs() < 0.003, "PPL {}", r.ppl);
    assert!(
        (r.ppl_stderr - 0.859).abs() < 0.01,
        "stderr {}",
        r.ppl_stderr
    );
    let per_window = [
        16.263, 19.233, 13.821, 25.370, 18.357, 17.274, 18.092, 20.351, 17.655, 20.975, 17.129,
        19.181, 10.211, 29.681,
    ];
    for (i, (got, want)) in r.window_ppl.iter().zip(per_window).enumerate() {
        assert!(
            (got / want - 1.0).abs() < 0.003,
            "window {i}: {got} vs {want}"
        );
    }
}

/// The fast paths (8-bit activations, integer kernels) against the exact one on the same file,
/// each scored in one pass with it. llama.cpp runs this Q4_1 file with 8-bit activations at PPL
/// 18.3914 (flash attention on; 18.3541 off), mean KL 0.003118 from its F16 file, 99% KL
/// 0.015877, same top token 96.25%.
///
/// `q8-full` computes what llama.cpp computes (8-bit activations into every quantized matrix);
/// its PPL moves by about 0.2% with summation order (frugal measured 18.352 to 18.408 across
/// kernel revisions; llama.cpp's own moves 0.2% between its attention paths), so it is held to
/// llama.cpp's PPL within 0.2% and to its mean KL, the steadier measure (stderr about 0.00005),
/// within 5%. `q8`, the default, keeps the output head in f32 and must beat llama.cpp outright.
#[test]
fn eight_bit_activations_cost_no_more_quality_than_llama_cpp() {
    use frugal::quant::act::Activations;
    let text_path = std::path::Path::new("/usr/share/common-licenses/GPL-3");
    let Ok(text) = std::fs::read_to_string(text_path) else {
        eprintln!("skipping: {} not present", text_path.display());
        return;
    };
    let Some((exact, tok)) = load() else { return };
    let tokens = tok.encode(&text, false).unwrap();
    for act in [Activations::Q8Full, Activations::Q8] {
        let Some((mut fast, _)) = load() else { return };
        fast.set_activations(act);
        let c = frugal::eval::compare(&fast, &exact, &tokens, 512, |_, _| {}).unwrap();
        assert!(
            (c.reference.ppl / 18.2994 - 1.0).abs() < 0.003,
            "exact PPL {}",
            c.reference.ppl
        );
        assert!(
            c.kl_mean > 1e-4,
            "{act}: the 8-bit path must actually differ from the exact one"
        );
        let slack = if act == Activations::Q8Full { 1.0 } else { 0.0 };
        assert!(
            c.model.ppl <= 18.3914 * (1.0 + 0.002 * slack),
            "{act}: PPL {}",
            c.model.ppl
        );
        assert!(
            c.kl_mean <= 0.003118 * (1.0 + 0.05 * slack),
            "{act}: mean KL {}",
            c.kl_mean
        );
        assert!(
            c.kl_p99 <= 0.015877 * (1.0 + 0.05 * slack),
            "{act}: 99% KL {}",
            c.kl_p99
        );
        eprintln!(
            "{act}: PPL {:.4}, mean KL {:.6}, 99% KL {:.6}, top-1 {:.2}%",
            c.model.ppl,
            c.kl_mean,
            c.kl_p99,
            100.0 * c.top1_agreement
        );
    }
}

/// The paged cache over more than half the model's 8192-token context: a long real text is
/// prefilled in chunks with flash attention, and at a few positions (one past 4096) the next
/// token (split-KV decode) and the next 15 (tiled prefill) are computed both by flash and by
/// the naive kernel on a fork of the same cache.
#[test]
fn paged_flash_past_4096_tokens_matches_naive() {
    let Some((model, tok)) = load() else { return };
    let text = std::fs::read_to_string("/usr/share/common-licenses/GPL-3")
        .unwrap_or_else(|_| format!("{PROMPT} Paris. ").repeat(800));
    let base = tok.encode(&text, false).unwrap();
    let total = 4096 + 64;
    let seq: Vec<u32> = base.iter().cycle().take(total + 16).copied().collect();
    let ctx = model.config.n_ctx_train;
    let mut pool = model
        .new_kv_pool(KvFormat::default(), 16, ctx / 16)
        .unwrap();
    let id = pool.add_sequence(ctx);
    let mut flash = Scratch::new(Attention::Flash);
    let mut naive = Scratch::new(Attention::Naive);
    let mut pos = 0;
    for checkpoint in [1000, 4097, total] {
        while pos < checkpoint {
            let end = (pos + 512).min(checkpoint);
            model
                .forward(&seq[pos..end], &mut pool.slot(id), &mut flash, Logits::Last)
                .unwrap();
            pos = end;
        }
        for (n, want) in [(1, Logits::Last), (15, Logits::All)] {
            let fork = pool.fork(id).unwrap();
            let chunk = &seq[pos..pos + n];
            let a = model
                .forward(chunk, &mut pool.slot(id), &mut flash, want)
                .unwrap()
                .to_vec();
            let b = model
                .forward(chunk, &mut pool.slot(fork), &mut naive, want)
                .unwrap()
                .to_vec();
            pool.remove(fork).unwrap();
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = a
                .iter()
                .zip(&b)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                diff <= 1e-4 * scale,
                "position {pos} (+{n}): max diff {diff} vs scale {scale}"
            );
            let nv = model.config.n_vocab;
            for (ra, rb) in a.chunks_exact(nv).zip(b.chunks_exact(nv)) {
                let top = |r: &[f32]| (0..nv).max_by(|&i, &j| r[i].total_cmp(&r[j])).unwrap();
                assert_eq!(top(ra), top(rb), "position {pos}");
            }
            pos += n;
        }
    }
    assert!(pool.seq_len(id) > 4096);
}

/// The new storage formats on the real model: re-encoded in memory from the Q4_1 file (as
/// `--quantize-on-load` does), both still put " Paris" first by a wide margin (F32 log-prob
/// -0.26 against -2.74 for the runner-up), and both stay close to the exact next-token
/// distribution. Q4_K exercises real 256-wide super-blocks (ffn_down, rows of 1536) and the
/// Q5_0 fallback (rows of 576); MXFP4 the power-of-two-scaled FP4 blocks.
#[test]
fn requantized_formats_keep_the_first_token() {
    use frugal::convert::{self, Policy, Target};
    use frugal::quant::GgmlType;
    let Some((model, tok)) = load() else { return };
    let prompt = tok.encode(PROMPT, false).unwrap();
    let last_logprobs = |m: &Model| {
        let mut kv = m.new_cache(16).unwrap();
        let mut s = Scratch::default();
        let l = m
            .forward(&prompt, &mut kv, &mut s, Logits::Last)
            .unwrap()
            .to_vec();
        let lse = log_sum_exp(&l);
        l.iter().map(|&x| f64::from(x) - lse).collect::<Vec<f64>>()
    };
    let exact = last_logprobs(&model);
    for ty in [GgmlType::Q4_K, GgmlType::MXFP4] {
        let (f, _) =
            convert::quantize_in_memory(&model.file, &Policy::new(Target::Stored(ty)), |_, _| {})
                .unwrap();
        let q = Model::from_file(f).unwrap();
        let lp = last_logprobs(&q);
        let top = (0..lp.len())
            .max_by(|&a, &b| lp[a].total_cmp(&lp[b]))
            .unwrap();
        assert_eq!(top, 7042, "{ty}: first token");
        // KL(exact || quantized) at this position. 4-bit weights on a 135M model cost a few
        // hundredths of a nat on average over a text (measured on GPL-3: see docs/quantization.md); a
        // broken layout would cost nats.
        let kl: f64 = exact.iter().zip(&lp).map(|(a, b)| a.exp() * (a - b)).sum();
        assert!(kl < 0.2, "{ty}: KL {kl}");
    }
}
