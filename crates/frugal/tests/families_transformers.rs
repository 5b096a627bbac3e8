//! Every family frugal runs, against Hugging Face `transformers` (an implementation written
//! independently of llama.cpp and of frugal): small random-weight GGUF files built by
//! `frugal::model::synthetic::build` from the specs of [`cases`], their logits computed by
//! `scripts/transformers-reference.py` with `transformers` in f32 and committed as JSON fixtures
//! under `tests/fixtures/transformers/`. This test rebuilds each file (deterministically),
//! checks it is the file the fixture was computed from (SHA-256 of its bytes), runs frugal's
//! forward pass with exact f32 activations over the fixture's tokens and compares all logits.
//! It needs no Python, torch or network.
//!
//! Regenerating the fixtures (after a deliberate change to a spec or to the synthetic writer):
//! ```text
//! FRUGAL_WRITE_TRANSFORMERS_MODELS=/tmp/hf-models \
//!   cargo test --release -p frugal --test families_transformers write_models
//! ~/.cache/frugal-peers/torch-venv/bin/python scripts/transformers-reference.py \
//!   /tmp/hf-models crates/frugal/tests/fixtures/transformers
//! ```
//!
//! **Checked against `transformers` here** (the script says how each HF model is built: through
//! its GGUF loader where that loader keeps everything the file says, otherwise from an explicit
//! config carrying the feature, with the loader's weights):
//! - `llama`: GQA, interleaved-pair Q/K rows with Llama's RoPE (transformers un-permutes them
//!   and rotates halves), separate and tied output;
//! - `llama` + `rope_freqs.weight` generated with Llama 3's formula = HF's `llama3` rope type;
//! - `llama` + linear RoPE scaling;
//! - `qwen2`: Q/K/V biases, NeoX pairs;
//! - `qwen2` + YaRN (ggml's ramp with beta_fast 32 / beta_slow 1 = HF's defaults, the
//!   `1 + 0.1 ln(factor)` on cos and sin);
//! - `qwen3`: per-head Q/K RMSNorm before RoPE (head width 128, the width transformers' loader
//!   assumes);
//! - `phi3`: fused `attn_qkv` and `ffn_up` (gate rows first), partial rotary (12 of 16 dims),
//!   long/short RoPE factors and `rope.scaling.attn_factor`: once with a context at most the
//!   original one (short factors; HF picks them because the sequence is shorter than the
//!   original context), once with a context past it (long factors; HF picks them because the
//!   sequence is longer than the original context);
//! - `gemma3`: local and global layers (period 3), a window (5) shorter than the sequence, local
//!   RoPE base 10000 against the global 1e6, linear scaling ×8 on the global layers only, a head
//!   width (32) that is not `n_embd / n_head`, the query scale (`query_pre_attn_scalar` =
//!   head width), MQA, GELU gating, post-norms, the √d embedding scale, tied output.
//!
//! **Checked only against llama.cpp** (`crates/frugal-cli/tests/families_llama_cpp.rs`, real
//! weights relabelled, and its quantized kernels): everything quantized (transformers
//! dequantizes to f32 and has no 8-bit activations, F16 KV cache or fp16 GELU table); Phi-3's
//! choice of factors by *configured context* rather than sequence length (HF picks by sequence
//! length, so the two agree only in the two cases above); Phi-3's ignored sliding window; Gemma
//! 3 27B's `1/sqrt(n_embd/n_head)` query scale keyed on 62 layers (a 62-layer model is too
//! large for a fixture; the scale itself is the `query_pre_attn_scalar` path checked here);
//! the `sliding_window_pattern` key's default of 6 (the gemma3 case writes the key); MoE and
//! latent attention (`deepseek2`); Mistral's window in a `llama` file.

use frugal::gguf::GgufFile;
use frugal::model::features::RopeStyle;
use frugal::model::synthetic::{
    Llama3Rope, SyntheticGemma, SyntheticPhi3, SyntheticQwen, SyntheticRope, SyntheticSpec, build,
};
use frugal::model::{Logits, Model, Scratch};
use frugal::quant::act::Activations;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The tokens every fixture is computed over: 12 positions, longer than Gemma's window (5),
/// than the long Phi-3 case's original context (8), and within the short one's (32).
const TOKENS: [u32; 12] = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100];

/// Largest |frugal - transformers| over all logits, relative to the largest |logit| of the
/// fixture. Both sides compute in f32 from the same f32 weights; they differ in summation
/// order (frugal's blocked SIMD dot products and attention, torch's BLAS), in frugal's RoPE
/// tables (angles in f64 then rounded, against torch's f32 `inv_freq * position`), in GELU
/// (frugal's `x·sigmoid(2u)` with a polynomial exp, against torch's tanh) and in the f32
/// rounding of `1 + w` of Gemma's norms. Measured on an AVX-512 x86 host: 2.1e-7 to 4.4e-7
/// per model (each case's line in the test output), i.e. a few f32 ulps of the largest logit
/// after 2-3 layers; 5e-6 leaves an order of magnitude for other CPUs' kernel paths, while
/// every mistake of [`Case::wrong`] moves the logits by more than 100x the tolerance.
const TOLERANCE: f32 = 5e-6;

/// How far a deliberately wrong model must be from the fixture: the proof that the
/// comparison can fail.
const WRONG_BY: f32 = 100.0 * TOLERANCE;

/// A change to a loaded model that makes it compute something else.
type Mistake = fn(&mut Model);

/// One model of the fixture set.
struct Case {
    name: &'static str,
    spec: SyntheticSpec,
    /// The context frugal is configured for ([`frugal::model::Config::set_context`]; Phi-3's
    /// long or short factors). `None`: the training context, as loaded.
    context: Option<usize>,
    /// What the script needs that the file does not say (Llama 3's RoPE parameters).
    hf_hints: Value,
    /// Plausible mistakes, each applied to the loaded model, that the comparison must see.
    wrong: Vec<(&'static str, Mistake)>,
}

fn base(seed: u64) -> SyntheticSpec {
    SyntheticSpec {
        seed,
        untied_output: true,
        ..Default::default()
    }
}

fn pairs_swapped(m: &mut Model) {
    let f = &mut m.config.features;
    f.rope = match f.rope {
        RopeStyle::Interleaved => RopeStyle::Neox,
        RopeStyle::Neox => RopeStyle::Interleaved,
    };
}

const LLAMA3: Llama3Rope = Llama3Rope {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    // Pairs 0-1 of a 16-wide head at base 10000 keep their frequency (wavelength under
    // 128/4), pair 2 is blended and pairs 3-7 are divided by 8 (wavelength over 128).
    original_context: 128,
};

/// The models, in one place: the test, the dump for the script and the fixtures' names.
fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "llama_gqa",
            spec: base(101),
            context: None,
            hf_hints: json!({}),
            wrong: vec![("NeoX pairs on llama's interleaved rows", pairs_swapped)],
        },
        Case {
            name: "llama_rope_freqs_llama3",
            spec: SyntheticSpec {
                untied_output: false,
                rope: SyntheticRope {
                    llama3: Some(LLAMA3),
                    ..Default::default()
                },
                ..base(102)
            },
            context: None,
            hf_hints: json!({"llama3": {
                "factor": LLAMA3.factor,
                "low_freq_factor": LLAMA3.low_freq_factor,
                "high_freq_factor": LLAMA3.high_freq_factor,
                "original_max_position_embeddings": LLAMA3.original_context,
            }}),
            wrong: vec![("rope_freqs ignored", |m| {
                m.config.rope_scaling.freq_factors = None
            })],
        },
        Case {
            name: "llama_linear",
            spec: SyntheticSpec {
                rope: SyntheticRope {
                    scaling: Some(("linear".into(), 4.0, None)),
                    ..Default::default()
                },
                ..base(103)
            },
            context: None,
            hf_hints: json!({}),
            wrong: vec![("linear scaling ignored", |m| {
                m.config.rope_scaling.freq_scale = 1.0
            })],
        },
        Case {
            name: "qwen2",
            spec: SyntheticSpec {
                qwen: Some(SyntheticQwen::Qwen2),
                ..base(104)
            },
            context: None,
            hf_hints: json!({}),
            wrong: vec![
                ("Q/K/V biases dropped", |m| {
                    for l in &mut m.weights.layers {
                        l.biases = Default::default();
                    }
                }),
                ("interleaved pairs", pairs_swapped),
            ],
        },
        Case {
            name: "qwen2_yarn",
            spec: SyntheticSpec {
                qwen: Some(SyntheticQwen::Qwen2),
                rope: SyntheticRope {
                    scaling: Some(("yarn".into(), 4.0, Some(64))),
                    ..Default::default()
                },
                ..base(105)
            },
            context: None,
            hf_hints: json!({}),
            wrong: vec![
                ("YaRN as plain linear scaling", |m| {
                    let s = &mut m.config.rope_scaling;
                    s.yarn = None;
                    s.mscale = 1.0;
                }),
                ("YaRN without its cos/sin factor", |m| {
                    m.config.rope_scaling.mscale = 1.0
                }),
            ],
        },
        Case {
            name: "qwen3",
            spec: SyntheticSpec {
                qwen: Some(SyntheticQwen::Qwen3 { head_dim: 128 }),
                ..base(106)
            },
            context: None,
            hf_hints: json!({}),
            wrong: vec![("interleaved pairs on qwen3's split halves", pairs_swapped)],
        },
        Case {
            name: "phi3_partial_short",
            spec: SyntheticSpec {
                phi3: Some(SyntheticPhi3 {
                    rope_dim: 12,
                    long_rope: Some(32),
                }),
                ..base(107)
            },
            context: Some(32),
            hf_hints: json!({}),
            wrong: vec![
                ("the long factors", |m| m.config.set_context(33)),
                ("no attn_factor", |m| m.config.rope_scaling.mscale = 1.0),
            ],
        },
        Case {
            name: "phi3_long",
            spec: SyntheticSpec {
                n_head_kv: 4,
                phi3: Some(SyntheticPhi3 {
                    rope_dim: 16,
                    long_rope: Some(8),
                }),
                ..base(108)
            },
            context: None,
            hf_hints: json!({}),
            wrong: vec![
                ("the short factors", |m| m.config.set_context(8)),
                ("partial rotary (12 of 16 dims)", |m| m.config.rope_dim = 12),
            ],
        },
        Case {
            name: "gemma3",
            spec: SyntheticSpec {
                n_layers: 3,
                n_head_kv: 1,
                untied_output: false,
                gemma: Some(SyntheticGemma {
                    head_dim: 32,
                    window: 5,
                    period: Some(3),
                    rope_base: 1_000_000.0,
                }),
                rope: SyntheticRope {
                    scaling: Some(("linear".into(), 8.0, None)),
                    ..Default::default()
                },
                ..base(109)
            },
            context: None,
            hf_hints: json!({}),
            wrong: vec![
                ("local layers without their window", |m| {
                    if let Some(s) = &mut m.config.features.sliding {
                        s.window = 1000;
                    }
                }),
                ("local layers with the global base and scaling", |m| {
                    if let Some(s) = &mut m.config.features.sliding {
                        s.local_rope_base = None;
                    }
                }),
                ("global layers without linear scaling", |m| {
                    m.config.rope_scaling.freq_scale = 1.0
                }),
                ("HF's default query_pre_attn_scalar 256", |m| {
                    m.config.features.query_scale = Some(1.0 / 16.0)
                }),
            ],
        },
    ]
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers")
}

const REGENERATE: &str = "regenerate: FRUGAL_WRITE_TRANSFORMERS_MODELS=/tmp/hf-models cargo test \
     --release -p frugal --test families_transformers write_models, then \
     ~/.cache/frugal-peers/torch-venv/bin/python scripts/transformers-reference.py /tmp/hf-models \
     crates/frugal/tests/fixtures/transformers (see this test's module doc)";

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes each case's GGUF file and a `manifest.json` (tokens, contexts, hints) into
/// `$FRUGAL_WRITE_TRANSFORMERS_MODELS`, for `scripts/transformers-reference.py`; does nothing
/// without it.
#[test]
fn write_models() {
    let Some(dir) = std::env::var_os("FRUGAL_WRITE_TRANSFORMERS_MODELS") else {
        return;
    };
    let dir = PathBuf::from(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut models = Vec::new();
    for c in cases() {
        let bytes = build(&c.spec);
        let file = format!("{}.gguf", c.name);
        std::fs::write(dir.join(&file), &bytes).unwrap();
        models.push(json!({
            "name": c.name,
            "file": file,
            "sha256": sha256_hex(&bytes),
            "frugal_context": c.context,
            "hf": c.hf_hints,
        }));
    }
    let manifest = json!({"tokens": TOKENS, "models": models});
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest).unwrap(),
    )
    .unwrap();
    eprintln!("wrote {} models to {}", cases().len(), dir.display());
}

/// The fixture's tokens and logits (one row per position), after checking it was computed
/// from `bytes`.
fn fixture(name: &str, bytes: &[u8]) -> (Vec<u32>, Vec<f32>, usize) {
    let path = fixture_dir().join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; {REGENERATE}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    let want_sha = v["gguf_sha256"].as_str().unwrap();
    let sha = sha256_hex(bytes);
    assert_eq!(
        sha, want_sha,
        "{name}: the synthetic GGUF (SHA-256 {sha}) is not the one the fixture was computed \
         from ({want_sha}): the spec or the writer changed; {REGENERATE}"
    );
    let tokens: Vec<u32> = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let n_vocab = v["n_vocab"].as_u64().unwrap() as usize;
    let logits: Vec<f32> = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| {
            let row = row.as_array().unwrap();
            assert_eq!(
                row.len(),
                n_vocab,
                "{name}: a logits row of the wrong width"
            );
            row.iter().map(|x| x.as_f64().unwrap() as f32)
        })
        .collect();
    assert_eq!(logits.len(), tokens.len() * n_vocab);
    (tokens, logits, n_vocab)
}

/// The case's model as frugal loads it, configured for its context, exact f32 activations.
fn load(c: &Case, bytes: Vec<u8>) -> Model {
    let mut m = Model::from_file(GgufFile::from_bytes(bytes).unwrap()).unwrap();
    if let Some(ctx) = c.context {
        m.config.set_context(ctx);
    }
    m.set_activations(Activations::F32);
    m
}

fn run(m: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut kv = m.new_cache(64).unwrap();
    let mut s = Scratch::default();
    m.forward(tokens, &mut kv, &mut s, Logits::All)
        .unwrap()
        .to_vec()
}

/// Largest |got - want|, relative to the largest |want|.
fn rel_diff(want: &[f32], got: &[f32]) -> f32 {
    assert_eq!(want.len(), got.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    want.iter()
        .zip(got)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

#[test]
fn logits_match_transformers() {
    let mut failures = Vec::new();
    for c in cases() {
        let bytes = build(&c.spec);
        let (tokens, want, n_vocab) = fixture(c.name, &bytes);
        let m = load(&c, bytes);
        assert_eq!(m.config.n_vocab, n_vocab, "{}", c.name);
        let got = run(&m, &tokens);
        let d = rel_diff(&want, &got);
        eprintln!(
            "{:<26} max |frugal - transformers| / max |logit| = {d:.2e}",
            c.name
        );
        // (NaN fails too.)
        if d.is_nan() || d > TOLERANCE {
            failures.push(format!("{}: {d:e} > {TOLERANCE:e}", c.name));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Each case's plausible mistake moves the logits far past the tolerance: the comparison
/// above would catch it.
#[test]
fn a_wrong_model_fails_the_comparison() {
    for c in cases() {
        let bytes = build(&c.spec);
        let (tokens, want, _) = fixture(c.name, &bytes);
        for (what, wrong) in &c.wrong {
            let mut m = load(&c, bytes.clone());
            wrong(&mut m);
            let d = rel_diff(&want, &run(&m, &tokens));
            eprintln!("{:<26} with {what}: {d:.2e}", c.name);
            assert!(
                d > WRONG_BY,
                "{} with {what}: only {d:e} from the fixture (tolerance {TOLERANCE:e})",
                c.name
            );
        }
    }
}
