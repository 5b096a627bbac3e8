//! End-to-end checks on small random models built by the test itself: the forward pass against
//! an independent dense reference for MHA, GQA and MQA, every storage format, tied and untied
//! output, and KV-cached decoding against full recomputation.

use frugal::gguf::GgufFile;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::model::{Config, Logits, Model, Scratch};
use frugal::quant::{GgmlType, dequantize_to_vec};
use frugal::tokenizer::Tokenizer;

/// A deliberately plain transformer: one position at a time, f64 where it is free, no SIMD.
fn reference_logits(f: &GgufFile, c: &Config, tokens: &[u32]) -> Vec<Vec<f32>> {
    let t = |name: &str| {
        let (info, b) = f.tensor(name).unwrap();
        dequantize_to_vec(info.ty, b, info.n_elements() as usize).unwrap()
    };
    let (d, hd) = (c.n_embd, c.head_dim);
    let mv = |w: &[f32], v: &[f32]| -> Vec<f32> {
        w.chunks_exact(v.len())
            .map(|row| {
                row.iter()
                    .zip(v)
                    .map(|(a, b)| f64::from(a * b))
                    .sum::<f64>() as f32
            })
            .collect()
    };
    let norm = |v: &[f32], w: &[f32]| -> Vec<f32> {
        let ms = v.iter().map(|a| f64::from(a * a)).sum::<f64>() / v.len() as f64;
        let s = (1.0 / (ms + f64::from(c.rms_eps)).sqrt()) as f32;
        v.iter().zip(w).map(|(a, g)| a * s * g).collect()
    };
    let rope = |v: &mut [f32], pos: usize| {
        for head in v.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let theta = pos as f64 * f64::from(c.rope_base).powf(-2.0 * i as f64 / hd as f64);
                let (s, co) = (theta.sin() as f32, theta.cos() as f32);
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * co - b * s;
                head[2 * i + 1] = a * s + b * co;
            }
        }
    };
    let emb = t("token_embd.weight");
    let mut x: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&tok| emb[tok as usize * d..(tok as usize + 1) * d].to_vec())
        .collect();
    for l in 0..c.n_layers {
        let w = |s: &str| t(&format!("blk.{l}.{s}.weight"));
        let (wq, wk, wv, wo) = (w("attn_q"), w("attn_k"), w("attn_v"), w("attn_output"));
        let (an, fnorm) = (w("attn_norm"), w("ffn_norm"));
        let (wg, wu, wd) = (w("ffn_gate"), w("ffn_up"), w("ffn_down"));
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (pos, xt) in x.iter().enumerate() {
            let h = norm(xt, &an);
            let mut q = mv(&wq, &h);
            let mut k = mv(&wk, &h);
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(mv(&wv, &h));
        }
        for (pos, xt) in x.iter_mut().enumerate() {
            let mut att = vec![0f32; c.n_head * hd];
            for h in 0..c.n_head {
                let kvh = h * c.n_head_kv / c.n_head;
                let q = &qs[pos][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|s| {
                        q.iter()
                            .zip(&ks[s][kvh * hd..(kvh + 1) * hd])
                            .map(|(a, b)| f64::from(a * b))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (s, sc) in scores.iter().enumerate() {
                    let p = ((sc - m).exp() / z) as f32;
                    for i in 0..hd {
                        att[h * hd + i] += p * vs[s][kvh * hd + i];
                    }
                }
            }
            for (a, b) in xt.iter_mut().zip(mv(&wo, &att)) {
                *a += b;
            }
            let h = norm(xt, &fnorm);
            let g = mv(&wg, &h);
            let u = mv(&wu, &h);
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            for (a, b) in xt.iter_mut().zip(mv(&wd, &act)) {
                *a += b;
            }
        }
    }
    let out = if f.tensor_info("output.weight").is_some() {
        t("output.weight")
    } else {
        emb
    };
    let on = t("output_norm.weight");
    x.iter().map(|xt| mv(&out, &norm(xt, &on))).collect()
}

/// Largest absolute difference relative to the largest reference magnitude.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn load(spec: &SyntheticSpec) -> Model {
    Model::from_file(GgufFile::from_bytes(build(spec)).unwrap()).unwrap()
}

#[test]
fn forward_matches_dense_reference_for_every_head_layout_and_format() {
    let tokens: Vec<u32> = b"Hello, frugal world! 0123"
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    for (n_head, n_head_kv) in [(4, 4), (4, 2), (4, 1), (6, 3)] {
        for ty in [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
        ] {
            let untied = n_head == 6;
            let spec = SyntheticSpec {
                n_head,
                n_head_kv,
                n_embd: 96,
                ty,
                untied_output: untied,
                ..Default::default()
            };
            let model = load(&spec);
            assert_eq!(model.weights.tied_output, !untied);
            let reference = reference_logits(&model.file, &model.config, &tokens);
            let mut kv = model.new_cache(64).unwrap();
            let mut s = Scratch::default();
            let logits = model
                .forward(&tokens, &mut kv, &mut s, Logits::All)
                .unwrap()
                .to_vec();
            for (t, r) in reference.iter().enumerate() {
                let got = &logits[t * r.len()..(t + 1) * r.len()];
                // f32 sums in a different order than the f64 reference: 1e-4 of the logit scale.
                let e = rel_err(got, r);
                assert!(
                    e < 1e-4,
                    "heads {n_head}/{n_head_kv} {ty} position {t}: relative error {e}"
                );
            }
        }
    }
}

#[test]
fn cached_decode_equals_full_recompute() {
    let model = load(&SyntheticSpec {
        ty: GgmlType::Q4_1,
        ..Default::default()
    });
    let prompt: Vec<u32> = b"The quick brown".iter().map(|&b| u32::from(b)).collect();
    let mut kv = model.new_cache(64).unwrap();
    let mut s = Scratch::default();
    let mut seq = prompt.clone();
    let mut cached = model
        .forward(&prompt, &mut kv, &mut s, Logits::Last)
        .unwrap()
        .to_vec();
    for _ in 0..20 {
        let mut kv2 = model.new_cache(64).unwrap();
        let mut s2 = Scratch::default();
        let full = model
            .forward(&seq, &mut kv2, &mut s2, Logits::Last)
            .unwrap()
            .to_vec();
        assert!(rel_err(&cached, &full) < 1e-4, "position {}", seq.len());
        let next = cached
            .iter()
            .enumerate()
            .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
            .0 as u32;
        seq.push(next);
        cached = model
            .forward(&[next], &mut kv, &mut s, Logits::Last)
            .unwrap()
            .to_vec();
    }
}

#[test]
fn context_overflow_and_bad_tokens_are_errors() {
    let model = load(&SyntheticSpec::default());
    let mut kv = model.new_cache(4).unwrap();
    let mut s = Scratch::default();
    assert!(
        model
            .forward(&[1, 2, 3, 4, 5], &mut kv, &mut s, Logits::Last)
            .is_err()
    );
    assert!(model.forward(&[], &mut kv, &mut s, Logits::Last).is_err());
    assert!(
        model
            .forward(&[9999], &mut kv, &mut s, Logits::Last)
            .is_err()
    );
    assert_eq!(kv.len(), 0, "failed calls leave the cache untouched");
}

#[test]
fn synthetic_tokenizer_is_byte_level() {
    let model = load(&SyntheticSpec::default());
    let tok = Tokenizer::from_gguf(&model.file).unwrap();
    let text = "héllo\n<|im_end|>";
    let plain = tok.encode(text, false).unwrap();
    assert_eq!(plain, text.bytes().map(u32::from).collect::<Vec<_>>());
    let special = tok.encode(text, true).unwrap();
    assert_eq!(special.last(), Some(&257));
    assert_eq!(special.len(), "héllo\n".len() + 1);
    assert_eq!(tok.decode(&plain), text);
    assert!(tok.is_end_of_generation(256) && tok.is_end_of_generation(257));
}

#[test]
fn eight_bit_activations_stay_close_to_exact_for_every_packed_format() {
    use frugal::quant::act::Activations;
    let tokens: Vec<u32> = b"Eight bits per block of thirty-two"
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    for ty in frugal::quant::unit::FORMATS {
        // 20 rows per projection: two full groups of eight and a padded one (K-quants need rows
        // of whole 256-element super-blocks).
        let k_quant = ty.block_size() == 256;
        let spec = SyntheticSpec {
            ty,
            n_embd: if k_quant { 256 } else { 64 },
            n_ff: if k_quant { 512 } else { 160 },
            n_head: 4,
            n_head_kv: 1,
            ..Default::default()
        };
        let mut model = load(&spec);
        let run = |m: &Model| {
            let mut kv = m.new_cache(64).unwrap();
            let mut s = Scratch::default();
            let mut out = m
                .forward(&tokens[..20], &mut kv, &mut s, Logits::All)
                .unwrap()
                .to_vec();
            for &t in &tokens[20..] {
                out.extend_from_slice(m.forward(&[t], &mut kv, &mut s, Logits::Last).unwrap());
            }
            out
        };
        let exact = run(&model);
        model.set_activations(Activations::Q8);
        assert!(model.packed_bytes() > 0);
        let fast = run(&model);
        // Each activation moves by at most half a step of its block (1/254 of the block's
        // absmax). Measured through two layers: 0.20% (Q4_K, Q6_K) to 0.51% (Q8_0) of the logit
        // scale; the bound leaves a factor of about three.
        let e = rel_err(&fast, &exact);
        eprintln!("{ty}: relative error {e}");
        assert!(e < 1.5e-2, "{ty}: relative error {e}");
        assert!(e > 0.0, "{ty}: the 8-bit path must actually run");
    }
}
