//! Gemma 3 270M (`gemma3`, the second model family) against llama.cpp's figures for the same
//! file: the SentencePiece tokenizer (`tokenizer.ggml.model = llama`, 262,144 pieces) and the
//! forward pass (NeoX RoPE, q/k norms, post-norms, GeGLU, √d embedding scale, sliding windows
//! in five of every six layers), through perplexity.
//!
//! The file is found at `$FRUGAL_GEMMA_MODEL` or in the frugal cache (`frugal fetch
//! gemma3-270m`); absent, the test skips, unless `FRUGAL_REQUIRE_MODEL=1` (CI).

use frugal::attention::Attention;
use frugal::eval::EvalOptions;
use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvOptions, KvType};
use frugal::model::Model;
use frugal::quant::act::Activations;
use frugal::tokenizer::Tokenizer;

fn tokenizer() -> Option<Tokenizer> {
    let path = frugal::fetch::gemma_model_for_tests()?;
    let file = GgufFile::open(path).expect("Gemma GGUF opens");
    Some(Tokenizer::from_gguf(&file).expect("SentencePiece tokenizer builds"))
}

#[test]
fn gemma_tokenization_matches_llama_cpp() {
    let Some(tok) = tokenizer() else { return };
    assert_eq!(
        tok.encode("The capital of France is", false).unwrap(),
        [2, 818, 5279, 529, 7001, 563]
    );
    // Accents, CJK, an emoji, a double space, a tab and newlines: the byte fallback and the
    // whitespace pieces.
    let text = "Héllo wörld! 你好 🙂  tabs\tand\nnewlines";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(
        ids,
        [
            2, 236814, 7869, 844, 515, 4010, 671, 236888, 43758, 237389, 57235, 138, 39218, 255968,
            624, 107, 208697
        ]
    );
    assert_eq!(tok.decode(&ids[1..]), text);
}

/// llama.cpp: PPL 13.9062 +/- 0.648 on GPL-3 at ctx 512 (8-bit activations into every
/// quantized product, f16 KV cache, BOS starting each window). frugal with the same precision
/// choices: 13.872 (-0.24%); with its default f32 KV and f32 head, 13.843 (-0.46%). The bound,
/// 0.5%, is under a tenth of the estimate's standard error: what is left is rounding (ggml's
/// GELU goes through an f16 table), not a missing piece of the block, which moves PPL by far
/// more (no BOS at each window: 20.3).
#[test]
fn gemma_perplexity_matches_llama_cpp() {
    let text_path = std::path::Path::new("/usr/share/common-licenses/GPL-3");
    let Ok(text) = std::fs::read_to_string(text_path) else {
        eprintln!("skipping: {} not present", text_path.display());
        return;
    };
    let Some(path) = frugal::fetch::gemma_model_for_tests() else {
        return;
    };
    let mut model = Model::load(path).expect("Gemma loads");
    assert_eq!(model.config.arch, "gemma3");
    assert_eq!(
        (0..18)
            .filter(|&l| model.config.features.window(l).is_none())
            .collect::<Vec<_>>(),
        [5, 11, 17]
    );
    let tok = Tokenizer::from_gguf(&model.file).unwrap();
    let tokens = tok.encode(&text, false).unwrap();
    model.set_activations(Activations::Q8Full);
    let opts = EvalOptions {
        kv: KvOptions {
            format: KvFormat::both(KvType::F16),
            ..KvOptions::default()
        },
        attention: Attention::Flash,
    };
    let p = frugal::eval::perplexity_with(&model, &tokens, 512, &opts, |_, _| {}).unwrap();
    assert!(
        (p.ppl / 13.9062 - 1.0).abs() < 0.005,
        "PPL {} against llama.cpp's 13.9062",
        p.ppl
    );
}

/// The sliding-window layers' rings (15 of 18 layers keep 512 + 15 + 512 positions) give the
/// same bits as caches that keep every position, for a prompt longer than the ring (prefilled
/// in passes of at most 512) and the decode steps after it, on both layouts; and the contiguous
/// cache holds less: at 1,166 positions the local layers hold 1,039 each.
#[test]
fn gemma_window_rings_change_memory_not_logits() {
    use frugal::kv::{KvLayout, KvSequence, Rings, SeqCache};
    use frugal::model::{Logits, Scratch};
    let Some(path) = frugal::fetch::gemma_model_for_tests() else {
        return;
    };
    let model = Model::load(path).expect("Gemma loads");
    let c = &model.config;
    let rings = model.cache_rings();
    assert_eq!(rings.rows(0), Some(512 + 15 + 512));
    assert_eq!(rings.rows(5), None);
    // A deterministic stream of ordinary token ids.
    let prompt: Vec<u32> = (0..1150u32).map(|i| 1000 + (i * 7919) % 50_000).collect();
    let ctx = 1200;
    for layout in [KvLayout::Contiguous, KvLayout::default()] {
        let opts = KvOptions {
            layout,
            ..KvOptions::default()
        };
        let mut ring = model.new_seq_cache(ctx, &opts).unwrap();
        let mut full =
            SeqCache::new(c.n_layers, c.cache_shape(), ctx, &opts, Rings::none()).unwrap();
        let (mut s1, mut s2) = (
            Scratch::new(Attention::Flash),
            Scratch::new(Attention::Flash),
        );
        let a = model
            .forward(&prompt, &mut ring, &mut s1, Logits::Last)
            .unwrap()
            .to_vec();
        let b = model
            .forward(&prompt, &mut full, &mut s2, Logits::Last)
            .unwrap();
        assert_eq!(a, b, "{layout:?}: prefill logits differ");
        let mut next = 17u32;
        for step in 0..16 {
            let a = model
                .forward(&[next], &mut ring, &mut s1, Logits::Last)
                .unwrap()
                .to_vec();
            let b = model
                .forward(&[next], &mut full, &mut s2, Logits::Last)
                .unwrap();
            assert_eq!(a, b, "{layout:?}: decode step {step} differs");
            next = a
                .iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .unwrap()
                .0 as u32;
        }
        assert_eq!(ring.len(), 1166);
        if layout == KvLayout::Contiguous {
            let row = 2 * 256 * 4; // one f32 key and value row of the one KV head
            assert_eq!(ring.bytes_in_use(), (3 * 1166 + 15 * 1039) * row);
            assert_eq!(full.bytes_in_use(), 18 * 1166 * row);
        }
    }
}
