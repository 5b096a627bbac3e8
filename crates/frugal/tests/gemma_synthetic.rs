//! Gemma 3 (`gemma3`) on small random models built by the test: frugal's forward pass against a
//! plain f64 reference written here from llama.cpp's `build_gemma3`, straight from the GGUF
//! tensors and metadata (not from frugal's `Config`), through both attention kernels, both KV
//! layouts, one-pass prefill, chunked prefill and token-by-token decode; and the metadata frugal
//! must refuse, each refusal naming the key at fault.
//!
//! The models have local and global layers, sequences several windows long, a head width that is
//! not `n_embd / n_head` (as Gemma 3 270M's 256 with `n_embd` 640 and four heads) and one KV head
//! (MQA, also as 270M). Weights, activations and the cache are f32, so the only differences from
//! the reference are f32 rounding.

use frugal::attention::Attention;
use frugal::gguf::{GgufFile, GgufWriter, Value};
use frugal::kv::{KvFormat, KvLayout, KvOptions};
use frugal::model::synthetic::{SyntheticGemma, SyntheticSpec, build};
use frugal::model::{Config, Logits, Model, Scratch};
use frugal::quant::act::Activations;
use frugal::quant::{GgmlType, dequantize_to_vec};
use frugal::tokenizer::Tokenizer;

/// Gemma 3's local RoPE base: llama.cpp sets it for the family (`rope_freq_base_train_swa`);
/// the files carry only the global one.
const LOCAL_ROPE_BASE: f64 = 10_000.0;
/// llama.cpp's Gemma 3 layer period when the file does not give one.
const DEFAULT_PERIOD: usize = 6;

/// Which parts of the block the reference computes as Gemma does; each `false` is a plausible
/// mistake the comparison must be able to see.
#[derive(Copy, Clone, Debug)]
struct Variant {
    /// Local layers attend over the window only.
    window: bool,
    /// Local layers rotate with base 10000, global ones with `rope.freq_base`.
    local_base: bool,
    /// RoPE pairs `(i, i + d/2)`; `false`: adjacent pairs `(2i, 2i+1)` (Llama's GGUF layout).
    neox: bool,
}

const GEMMA: Variant = Variant {
    window: true,
    local_base: true,
    neox: true,
};

/// The hyperparameters, read from the metadata as llama.cpp reads them.
struct Hp {
    n_layers: usize,
    d: usize,
    n_head: usize,
    n_head_kv: usize,
    hd: usize,
    eps: f64,
    rope_base: f64,
    window: usize,
    period: usize,
    /// `rope.scaling.factor` of linear scaling (1 without): global layers' positions divided.
    linear: f64,
}

fn hparams(f: &GgufFile) -> Hp {
    let u = |k: &str| f.u32(&format!("gemma3.{k}")).unwrap() as usize;
    let fl = |k: &str| f64::from(f.f32(&format!("gemma3.{k}")).unwrap());
    Hp {
        n_layers: u("block_count"),
        d: u("embedding_length"),
        n_head: u("attention.head_count"),
        n_head_kv: u("attention.head_count_kv"),
        hd: u("attention.key_length"),
        eps: fl("attention.layer_norm_rms_epsilon"),
        rope_base: fl("rope.freq_base"),
        window: u("attention.sliding_window"),
        period: f
            .u32_opt("gemma3.attention.sliding_window_pattern")
            .unwrap()
            .map_or(DEFAULT_PERIOD, |p| p as usize),
        linear: f
            .f32_opt("gemma3.rope.scaling.factor")
            .unwrap()
            .map_or(1.0, f64::from),
    }
}

/// Gemma 3's forward over `tokens` in f64, one position at a time, every logit of every position.
fn reference(f: &GgufFile, tokens: &[u32], v: Variant) -> Vec<Vec<f64>> {
    let hp = hparams(f);
    let t = |name: &str| -> Vec<f64> {
        let (info, b) = f.tensor(name).unwrap();
        let w = dequantize_to_vec(info.ty, b, info.n_elements() as usize).unwrap();
        w.into_iter().map(f64::from).collect()
    };
    let (d, hd) = (hp.d, hp.hd);
    // GGUF matrices are `rows x cols` row-major with `cols` (the input width) first in `dims`.
    let mv = |w: &[f64], x: &[f64]| -> Vec<f64> {
        w.chunks_exact(x.len())
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    // Weights used as stored: llama.cpp's converter already turned Gemma's `1 + w` into `w`.
    let norm = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|a| a * a).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + hp.eps).sqrt();
        x.iter().zip(w).map(|(a, g)| a * s * g).collect()
    };
    let rope = |head: &mut [f64], pos: f64, base: f64| {
        let half = hd / 2;
        for i in 0..half {
            let theta = pos * base.powf(-2.0 * i as f64 / hd as f64);
            let (s, c) = theta.sin_cos();
            let (ia, ib) = if v.neox {
                (i, i + half)
            } else {
                (2 * i, 2 * i + 1)
            };
            let (a, b) = (head[ia], head[ib]);
            head[ia] = a * c - b * s;
            head[ib] = a * s + b * c;
        }
    };
    let gelu_tanh = |g: f64| {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * g * (1.0 + (c * (g + 0.044_715 * g * g * g)).tanh())
    };

    let emb = t("token_embd.weight");
    let scale = (d as f64).sqrt();
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&tok| {
            let row = &emb[tok as usize * d..(tok as usize + 1) * d];
            row.iter().map(|e| e * scale).collect()
        })
        .collect();
    for l in 0..hp.n_layers {
        let w = |s: &str| t(&format!("blk.{l}.{s}.weight"));
        let local = l % hp.period < hp.period - 1;
        let base = if local && v.local_base {
            LOCAL_ROPE_BASE
        } else {
            hp.rope_base
        };
        let window = (local && v.window).then_some(hp.window);
        // Linear scaling applies to the global layers only (the local ones keep their base).
        let stretch = if local { 1.0 } else { hp.linear };
        let (an, qn, kn) = (w("attn_norm"), w("attn_q_norm"), w("attn_k_norm"));
        let (wq, wk, wv, wo) = (w("attn_q"), w("attn_k"), w("attn_v"), w("attn_output"));
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, xt) in x.iter().enumerate() {
            let h = norm(xt, &an);
            let mut q = mv(&wq, &h);
            let mut k = mv(&wk, &h);
            for (heads, nw) in [(&mut q, &qn), (&mut k, &kn)] {
                for head in heads.chunks_exact_mut(hd) {
                    let normed = norm(head, nw);
                    head.copy_from_slice(&normed);
                    rope(head, pos as f64 / stretch, base);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(mv(&wv, &h));
        }
        let group = hp.n_head / hp.n_head_kv;
        // llama.cpp's 27B rule (keyed on its 62 layers): 1/sqrt(n_embd/n_head), not per head.
        let q_scale = if hp.n_layers == 62 {
            1.0 / ((d / hp.n_head) as f64).sqrt()
        } else {
            1.0 / (hd as f64).sqrt()
        };
        for (i, xt) in x.iter_mut().enumerate() {
            // Key j is visible to query i iff j <= i and, in a local layer, i - j < window.
            let first = window.map_or(0, |w| (i + 1).saturating_sub(w));
            let mut att = vec![0f64; hp.n_head * hd];
            for h in 0..hp.n_head {
                let kvh = h / group;
                let q = &qs[i][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (first..=i)
                    .map(|j| {
                        let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * q_scale
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, sc) in (first..=i).zip(&scores) {
                    let p = (sc - m).exp() / z;
                    for e in 0..hd {
                        att[h * hd + e] += p * vs[j][kvh * hd + e];
                    }
                }
            }
            let o = norm(&mv(&wo, &att), &w("post_attention_norm"));
            xt.iter_mut().zip(o).for_each(|(a, b)| *a += b);
            let h = norm(xt, &w("ffn_norm"));
            let act: Vec<f64> = mv(&w("ffn_gate"), &h)
                .into_iter()
                .zip(mv(&w("ffn_up"), &h))
                .map(|(g, u)| gelu_tanh(g) * u)
                .collect();
            let y = norm(&mv(&w("ffn_down"), &act), &w("post_ffw_norm"));
            xt.iter_mut().zip(y).for_each(|(a, b)| *a += b);
        }
    }
    let on = t("output_norm.weight");
    // Tied: the head is the (unscaled) embedding table.
    x.iter().map(|xt| mv(&emb, &norm(xt, &on))).collect()
}

/// Largest absolute difference over every logit, relative to the largest reference magnitude.
fn rel_err(got: &[f32], want: &[Vec<f64>]) -> f64 {
    let got: Vec<f64> = got.iter().copied().map(f64::from).collect();
    rel_err_f64(&got, want)
}

fn rel_err_f64(got: &[f64], want: &[Vec<f64>]) -> f64 {
    let want: Vec<f64> = want.iter().flatten().copied().collect();
    assert_eq!(got.len(), want.len(), "logit count");
    let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-9);
    got.iter()
        .zip(&want)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// [`rel_err`] between two references.
fn ref_diff(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    let a: Vec<f64> = a.iter().flatten().copied().collect();
    rel_err_f64(&a, b)
}

fn spec(gemma: SyntheticGemma, n_layers: usize, seed: u64) -> SyntheticSpec {
    SyntheticSpec {
        n_layers,
        // Four heads of 32 over a residual of 48: q/k/v are 128 and 32 wide, not 48.
        n_embd: 48,
        n_ff: 96,
        n_head: 4,
        n_head_kv: 1,
        n_ctx: 2048,
        ty: GgmlType::F32,
        seed,
        gemma: Some(gemma),
        ..Default::default()
    }
}

fn load(bytes: Vec<u8>) -> Result<Model, frugal::gguf::GgufError> {
    Model::from_file(GgufFile::from_bytes(bytes)?)
}

/// How the tokens go through the model.
#[derive(Copy, Clone, Debug)]
enum Feed {
    /// One call for the whole sequence.
    Prefill,
    /// Calls of these many tokens, in turn, until the sequence is done.
    Chunks(&'static [usize]),
    /// One token per call.
    Decode,
}

/// Every position's logits from frugal, fed as `feed` says.
fn frugal_logits(
    model: &Model,
    tokens: &[u32],
    attention: Attention,
    layout: KvLayout,
    feed: Feed,
) -> Vec<f32> {
    let opts = KvOptions {
        format: KvFormat::default(),
        layout,
    };
    let mut kv = model.new_seq_cache(tokens.len(), &opts).unwrap();
    let mut s = Scratch::new(attention);
    let sizes: Vec<usize> = match feed {
        Feed::Prefill => vec![tokens.len()],
        Feed::Decode => vec![1; tokens.len()],
        Feed::Chunks(c) => c.iter().copied().cycle().take(tokens.len()).collect(),
    };
    let mut out = Vec::new();
    let mut at = 0;
    for n in sizes {
        let end = (at + n).min(tokens.len());
        if at == end {
            break;
        }
        let chunk = &tokens[at..end];
        out.extend_from_slice(model.forward(chunk, &mut kv, &mut s, Logits::All).unwrap());
        at = end;
    }
    assert_eq!(at, tokens.len());
    out
}

fn text_tokens(n: usize) -> Vec<u32> {
    b"Gemma slides a window over the keys; every sixth layer sees them all. "
        .iter()
        .cycle()
        .take(n)
        .map(|&b| u32::from(b))
        .collect()
}

/// f32 against f64 over seven layers: the products sum 32 to 128 terms in another order
/// (relative rounding ~6e-8 each), the RoPE tables are f32, and the flash kernel's exponential
/// is a polynomial good to a few ulps. Measured: 2e-7 to 3e-7 of the largest logit on every
/// path. The bound leaves a factor of about 400 for other machines' kernels, and stays about
/// 800 times under what the subtlest mistake checked below (one RoPE base for every layer)
/// moves the logits (8e-2).
const TOL: f64 = 1e-4;

fn check_all_paths(model: &Model, tokens: &[u32], want: &[Vec<f64>], feeds: &[Feed], what: &str) {
    for attention in [Attention::Naive, Attention::Flash] {
        for layout in [KvLayout::Contiguous, KvLayout::Paged { block_size: 4 }] {
            for &feed in feeds {
                let got = frugal_logits(model, tokens, attention, layout, feed);
                let e = rel_err(&got, want);
                eprintln!("{what} {attention} {layout:?} {feed:?}: relative error {e:.2e}");
                assert!(
                    e < TOL,
                    "{what} {attention} {layout:?} {feed:?}: relative error {e}"
                );
            }
        }
    }
}

#[test]
fn forward_matches_reference_across_windows_kernels_and_layouts() {
    // Seven layers of period 3: layers 2 and 5 global, the other five local with a window of 5;
    // 24 tokens, nearly five windows.
    let gemma = SyntheticGemma {
        head_dim: 32,
        window: 5,
        period: Some(3),
        rope_base: 1_000_000.0,
    };
    let bytes = build(&spec(gemma, 7, 11));
    let model = load(bytes).unwrap();
    let c: &Config = &model.config;
    assert_eq!(
        (c.arch.as_str(), c.head_dim, c.n_head_kv),
        ("gemma3", 32, 1)
    );
    assert_ne!(c.head_dim, c.n_embd / c.n_head);
    let global: Vec<usize> = (0..7).filter(|&l| c.features.window(l).is_none()).collect();
    assert_eq!(global, [2, 5]);
    assert!(model.weights.tied_output);

    let tokens = text_tokens(24);
    let want = reference(&model.file, &tokens, GEMMA);
    let feeds = [Feed::Prefill, Feed::Chunks(&[7, 1, 10]), Feed::Decode];
    check_all_paths(&model, &tokens, &want, &feeds, "period 3");

    // The comparison can fail: each part of Gemma's block that is easy to get wrong moves the
    // logits by far more than the tolerance.
    for (wrong, name) in [
        (
            Variant {
                window: false,
                ..GEMMA
            },
            "no window",
        ),
        (
            Variant {
                local_base: false,
                ..GEMMA
            },
            "one RoPE base",
        ),
        (
            Variant {
                neox: false,
                ..GEMMA
            },
            "interleaved RoPE",
        ),
    ] {
        let e = ref_diff(&reference(&model.file, &tokens, wrong), &want);
        eprintln!("reference with {name}: differs by {e:.2e}");
        assert!(e > 100.0 * TOL, "{name}: only {e} from Gemma's block");
    }
    // Within the first window the window changes nothing (it only masks keys 5 or more back):
    // the reference's window is the only thing the variant changes.
    let unwindowed = reference(
        &model.file,
        &tokens[..5],
        Variant {
            window: false,
            ..GEMMA
        },
    );
    assert!(ref_diff(&unwindowed, &want[..5]) < 1e-12);
}

#[test]
fn default_period_and_long_sequences_over_many_key_tiles() {
    // No `sliding_window_pattern` key (llama.cpp's converter writes none): period 6, so layer 5
    // of 7 is global. Heads of 64 make the flash kernel's key tiles 64 positions and its
    // decode chunks 256: 1400 tokens with a window of 70 cross tile and chunk boundaries, skip
    // whole tiles before the window, and split decode across chunks. 1400 is also more than
    // twice what a cache that keeps only the window's recent positions needs for the local
    // layers (window + a key tile + a pass of up to 512), so such rings wrap, and the passes of
    // 600 and 1400 tokens are longer than one such pass.
    let gemma = SyntheticGemma {
        head_dim: 64,
        window: 70,
        period: None,
        rope_base: 1_000_000.0,
    };
    let model = load(build(&SyntheticSpec {
        n_embd: 64,
        n_head: 2,
        ..spec(gemma, 7, 5)
    }))
    .unwrap();
    assert_eq!(frugal::attention::key_tile(64), 64);
    let global: Vec<usize> = (0..7)
        .filter(|&l| model.config.features.window(l).is_none())
        .collect();
    assert_eq!(global, [5]);
    let tokens = text_tokens(1400);
    let want = reference(&model.file, &tokens, GEMMA);
    let feeds = [
        Feed::Prefill,
        Feed::Chunks(&[600, 1, 300, 37]),
        Feed::Decode,
    ];
    check_all_paths(&model, &tokens, &want, &feeds, "period 6, 1400 tokens");
    let e = ref_diff(
        &reference(
            &model.file,
            &tokens,
            Variant {
                window: false,
                ..GEMMA
            },
        ),
        &want,
    );
    assert!(
        e > 100.0 * TOL,
        "the window of 70 moves the logits by only {e}"
    );
}

#[test]
fn eight_bit_activations_stay_close_on_gemma() {
    // Q8_0 weights through the packed 8-bit path: the q/k norms and post-norms sit between the
    // quantized products, so this checks they are applied to the right buffers on that path too.
    let gemma = SyntheticGemma::default();
    let mut model = load(build(&SyntheticSpec {
        n_embd: 64,
        ty: GgmlType::Q8_0,
        ..spec(gemma, 2, 3)
    }))
    .unwrap();
    let tokens = text_tokens(20);
    let want = reference(&model.file, &tokens, GEMMA);
    let layout = KvLayout::Contiguous;
    let exact = frugal_logits(&model, &tokens, Attention::Flash, layout, Feed::Prefill);
    assert!(rel_err(&exact, &want) < TOL);
    model.set_activations(Activations::Q8);
    assert!(model.packed_bytes() > 0);
    let fast = frugal_logits(&model, &tokens, Attention::Flash, layout, Feed::Prefill);
    let e = rel_err(&fast, &want);
    eprintln!("8-bit activations: relative error {e:.2e}");
    // As in `synthetic_model.rs`: each activation moves by at most half a step (1/254 of its
    // block's absmax). Measured through two layers: 4.0e-3 (over seeds, 4e-3 to 5e-3 against
    // 3.5e-3 to 4e-3 for a Llama block of the same size); the bound leaves a factor of three.
    assert!(e > 0.0 && e < 1.5e-2, "relative error {e}");
}

/// The valid small file, rewritten by `edit`.
fn edited(edit: impl FnOnce(&mut GgufWriter)) -> Vec<u8> {
    let good = GgufFile::from_bytes(build(&spec(SyntheticGemma::default(), 3, 1))).unwrap();
    let mut w = GgufWriter::from_file(&good);
    edit(&mut w);
    w.to_bytes().unwrap()
}

fn remove(w: &mut GgufWriter, key: &str) {
    w.metadata.retain(|(k, _)| k != key);
}

/// `Model` has no `Debug`: the error of a load that must fail.
fn load_err(bytes: Vec<u8>) -> String {
    match load(bytes) {
        Ok(_) => panic!("loaded a file that should be refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_gemma_metadata_is_refused_naming_the_key() {
    assert!(load(edited(|_| {})).is_ok());
    let u = |v: u32| Value::U32(v);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "gemma3.attention.sliding_window",
            edited(|w| remove(w, "gemma3.attention.sliding_window")),
        ),
        (
            "gemma3.attention.sliding_window",
            edited(|w| w.set("gemma3.attention.sliding_window", u(0))),
        ),
        (
            "gemma3.attention.sliding_window",
            edited(|w| w.set("gemma3.attention.sliding_window", Value::String("5".into()))),
        ),
        (
            "gemma3.attention.sliding_window_pattern",
            edited(|w| w.set("gemma3.attention.sliding_window_pattern", u(0))),
        ),
        // Heads of 16 where the tensors have heads of 32: the shapes disagree.
        (
            "gemma3.attention.key_length",
            edited(|w| {
                w.set("gemma3.attention.key_length", u(16));
                w.set("gemma3.attention.value_length", u(16));
            }),
        ),
        (
            "gemma3.attention.value_length",
            edited(|w| w.set("gemma3.attention.value_length", u(16))),
        ),
        (
            "gemma3.attention.key_length",
            edited(|w| w.set("gemma3.attention.key_length", u(0))),
        ),
        (
            "gemma3.attention.head_count_kv",
            edited(|w| w.set("gemma3.attention.head_count_kv", u(3))),
        ),
        // Two KV heads divide four query heads, but the tensors hold one.
        (
            "gemma3.attention.head_count_kv",
            edited(|w| w.set("gemma3.attention.head_count_kv", u(2))),
        ),
        (
            "gemma3.attention.head_count",
            edited(|w| w.set("gemma3.attention.head_count", u(8))),
        ),
        (
            "gemma3.rope.scaling.type",
            edited(|w| w.set("gemma3.rope.scaling.type", Value::String("longrope".into()))),
        ),
    ];
    for (key, bytes) in cases {
        let e = load_err(bytes);
        eprintln!("{e}");
        assert!(e.contains(key), "error should name {key}: {e}");
    }
    // Also refused when only the configuration is read.
    let f = GgufFile::from_bytes(edited(|w| w.set("gemma3.attention.sliding_window", u(0))));
    let e = Config::from_gguf(&f.unwrap()).unwrap_err().to_string();
    assert!(e.contains("gemma3.attention.sliding_window"), "{e}");
}

/// Gemma 3 4B-27B: linear RoPE scaling (factor 8) in the global layers only, and the 27B's
/// query scale of `1/sqrt(n_embd/n_head)` (llama.cpp recognizes the 27B by its 62 layers; here
/// 48/4 = 12 against heads of 32), each against the reference.
#[test]
fn linear_scaling_and_the_27b_query_scale_match_the_reference() {
    let tokens = text_tokens(20);
    let scaled = edited(|w| {
        w.set("gemma3.rope.scaling.type", Value::String("linear".into()));
        w.set("gemma3.rope.scaling.factor", Value::F32(8.0));
    });
    let model = load(scaled).unwrap();
    let want = reference(&model.file, &tokens, GEMMA);
    let plain = load(edited(|_| {})).unwrap();
    let unscaled = reference(&plain.file, &tokens, GEMMA);
    assert!(
        ref_diff(&want, &unscaled) > 1e-3,
        "scaling must change the model"
    );
    check_all_paths(
        &model,
        &tokens,
        &want,
        &[Feed::Prefill, Feed::Decode],
        "linear x8",
    );

    let g = SyntheticGemma {
        period: Some(6),
        ..SyntheticGemma::default()
    };
    let big = load(build(&spec(g, 62, 5))).unwrap();
    assert!(big.config.features.query_scale.is_some());
    let tokens = text_tokens(8);
    let want = reference(&big.file, &tokens, GEMMA);
    check_all_paths(&big, &tokens, &want, &[Feed::Prefill], "62 layers");
}

#[test]
fn edge_cases_of_the_window_metadata_are_accepted() {
    // A window past the training context: every local layer sees every key, as a global one
    // does (with its own RoPE base). A period above the layer count: every layer local.
    let wide = load(edited(|w| {
        w.set("gemma3.attention.sliding_window", Value::U32(100_000));
        w.set("gemma3.attention.sliding_window_pattern", Value::U32(10));
    }))
    .unwrap();
    assert!((0..3).all(|l| wide.config.features.window(l) == Some(100_000)));
    let tokens = text_tokens(12);
    let want = reference(&wide.file, &tokens, GEMMA);
    let got = frugal_logits(
        &wide,
        &tokens,
        Attention::Flash,
        KvLayout::Contiguous,
        Feed::Prefill,
    );
    assert!(rel_err(&got, &want) < TOL);
    // A period of 1: no local layer.
    let dense = load(edited(|w| {
        w.set("gemma3.attention.sliding_window_pattern", Value::U32(1));
    }))
    .unwrap();
    assert!((0..3).all(|l| dense.config.features.window(l).is_none()));
}

#[test]
fn unsupported_tokenizer_model_is_refused_naming_the_key() {
    let ok = GgufFile::from_bytes(edited(|_| {})).unwrap();
    assert!(Tokenizer::from_gguf(&ok).is_ok());
    let bert = edited(|w| w.set("tokenizer.ggml.model", Value::String("bert".into())));
    let f = GgufFile::from_bytes(bert).unwrap();
    // The model itself still loads: the tokenizer is read on its own.
    assert!(Model::from_file(GgufFile::from_bytes(edited(|_| {})).unwrap()).is_ok());
    let e = match Tokenizer::from_gguf(&f) {
        Ok(_) => panic!("built a tokenizer for tokenizer.ggml.model = \"bert\""),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("tokenizer.ggml.model") && e.contains("bert"),
        "{e}"
    );
    let missing = edited(|w| remove(w, "tokenizer.ggml.model"));
    let e = match Tokenizer::from_gguf(&GgufFile::from_bytes(missing).unwrap()) {
        Ok(_) => panic!("built a tokenizer without tokenizer.ggml.model"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("tokenizer.ggml.model"), "{e}");
}
