//! Multi-head latent attention on small random `deepseek2` files built by the test: the forward
//! pass (absorbed and decompressed, both cache layouts and several cache formats) against a
//! plain per-head reference that never absorbs anything, and the cache it allocates.

use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvLayout, KvOptions, KvSequence, KvType};
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::model::{Config, LatentPath, Logits, Mla, Model, Scratch};
use frugal::quant::{GgmlType, dequantize_to_vec};

const MLA: Mla = Mla {
    kv_lora_rank: 32,
    nope_dim: 12,
    rope_dim: 4,
    v_dim: 16,
};

fn spec(ty: GgmlType) -> SyntheticSpec {
    SyntheticSpec {
        n_head: 4,
        n_embd: 64,
        ty,
        mla: Some(MLA),
        ..Default::default()
    }
}

/// DeepSeek-V2's attention as its paper writes it: per head, the key `[W_uk_h c | k_pe]` and
/// the value `W_uv_h c` of every position, built explicitly; f64 sums; no absorption.
fn reference_logits(f: &GgufFile, c: &Config, tokens: &[u32]) -> Vec<Vec<f32>> {
    let m = c.mla.unwrap();
    let t = |name: &str| {
        let (info, b) = f.tensor(name).unwrap();
        dequantize_to_vec(info.ty, b, info.n_elements() as usize).unwrap()
    };
    let d = c.n_embd;
    let (rank, nope, rope, vd) = (m.kv_lora_rank, m.nope_dim, m.rope_dim, m.v_dim);
    let hd = nope + rope;
    let mv = |w: &[f32], v: &[f32]| -> Vec<f32> {
        w.chunks_exact(v.len())
            .map(|row| {
                row.iter()
                    .zip(v)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum::<f64>() as f32
            })
            .collect()
    };
    let norm = |v: &[f32], w: &[f32]| -> Vec<f32> {
        let ms = v.iter().map(|a| f64::from(a * a)).sum::<f64>() / v.len() as f64;
        let s = (1.0 / (ms + f64::from(c.rms_eps)).sqrt()) as f32;
        v.iter().zip(w).map(|(a, g)| a * s * g).collect()
    };
    // Adjacent pairs, frequencies over the RoPE part alone (llama.cpp's rope type NORM).
    let rotate = |v: &mut [f32], pos: usize| {
        for i in 0..rope / 2 {
            let th = pos as f64 * f64::from(c.rope_base).powf(-2.0 * i as f64 / rope as f64);
            let (s, co) = (th.sin() as f32, th.cos() as f32);
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            v[2 * i] = a * co - b * s;
            v[2 * i + 1] = a * s + b * co;
        }
    };
    let emb = t("token_embd.weight");
    let mut x: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&tok| emb[tok as usize * d..(tok as usize + 1) * d].to_vec())
        .collect();
    for l in 0..c.n_layers {
        let w = |s: &str| t(&format!("blk.{l}.{s}.weight"));
        let (wq, wa, wo) = (w("attn_q"), w("attn_kv_a_mqa"), w("attn_output"));
        let (an, kan, fnorm) = (w("attn_norm"), w("attn_kv_a_norm"), w("ffn_norm"));
        let (kb, vb) = (w("attn_k_b"), w("attn_v_b"));
        let (wg, wu, wd) = (w("ffn_gate"), w("ffn_up"), w("ffn_down"));
        // W_uk_h[n][r] = k_b[h][r][n]; W_uv_h[j][r] = v_b[h][j][r].
        let k_of = |h: usize, cl: &[f32]| -> Vec<f32> {
            (0..nope)
                .map(|n| {
                    (0..rank)
                        .map(|r| f64::from(kb[(h * rank + r) * nope + n]) * f64::from(cl[r]))
                        .sum::<f64>() as f32
                })
                .collect()
        };
        let v_of = |h: usize, cl: &[f32]| mv(&vb[h * vd * rank..(h + 1) * vd * rank], cl);
        let (mut qs, mut keys, mut vals) = (Vec::new(), Vec::new(), Vec::new());
        for (pos, xt) in x.iter().enumerate() {
            let h_in = norm(xt, &an);
            let mut q = mv(&wq, &h_in);
            let a = mv(&wa, &h_in);
            let cl = norm(&a[..rank], &kan);
            let mut pe = a[rank..].to_vec();
            rotate(&mut pe, pos);
            for h in 0..c.n_head {
                rotate(&mut q[h * hd + nope..(h + 1) * hd], pos);
            }
            let kh: Vec<Vec<f32>> = (0..c.n_head)
                .map(|h| [k_of(h, &cl), pe.clone()].concat())
                .collect();
            let vh: Vec<Vec<f32>> = (0..c.n_head).map(|h| v_of(h, &cl)).collect();
            qs.push(q);
            keys.push(kh);
            vals.push(vh);
        }
        for (pos, xt) in x.iter_mut().enumerate() {
            let mut att = vec![0f32; c.n_head * vd];
            for h in 0..c.n_head {
                let q = &qs[pos][h * hd..(h + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|s| {
                        q.iter()
                            .zip(&keys[s][h])
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
                for (s, sc) in scores.iter().enumerate() {
                    let p = ((sc - mx).exp() / z) as f32;
                    for j in 0..vd {
                        att[h * vd + j] += p * vals[s][h][j];
                    }
                }
            }
            for (a, b) in xt.iter_mut().zip(mv(&wo, &att)) {
                *a += b;
            }
            let h = norm(xt, &fnorm);
            let (g, u) = (mv(&wg, &h), mv(&wu, &h));
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
    let on = t("output_norm.weight");
    x.iter().map(|xt| mv(&emb, &norm(xt, &on))).collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn run(model: &Model, tokens: &[u32], path: LatentPath, kv: &KvOptions) -> Vec<f32> {
    let mut cache = model.new_seq_cache(64, kv).unwrap();
    let mut s = Scratch::default();
    s.latent = path;
    // A prompt, then one token at a time: prefill and decode both go through the latent path.
    let split = tokens.len() - 3;
    let mut out = model
        .forward(&tokens[..split], &mut cache, &mut s, Logits::All)
        .unwrap()
        .to_vec();
    for &t in &tokens[split..] {
        out.extend_from_slice(
            model
                .forward(&[t], &mut cache, &mut s, Logits::All)
                .unwrap(),
        );
    }
    assert_eq!(cache.len(), tokens.len());
    out
}

#[test]
fn latent_attention_matches_the_per_head_reference() {
    let tokens: Vec<u32> = b"Latent attention, frugal."
        .iter()
        .map(|&b| u32::from(b))
        .collect();
    for ty in [GgmlType::F32, GgmlType::Q8_0] {
        let model = Model::from_file(GgufFile::from_bytes(build(&spec(ty))).unwrap()).unwrap();
        assert_eq!(model.config.mla, Some(MLA));
        let reference = reference_logits(&model.file, &model.config, &tokens);
        let nv = model.config.n_vocab;
        for path in [LatentPath::Absorbed, LatentPath::Decompressed] {
            for layout in [KvLayout::Contiguous, KvLayout::Paged { block_size: 4 }] {
                let kv = KvOptions {
                    layout,
                    ..Default::default()
                };
                let got = run(&model, &tokens, path, &kv);
                for (t, r) in reference.iter().enumerate() {
                    // f32 sums in other orders than the f64 reference (and, absorbed, through
                    // k_b before the dot product): 1e-4 of the logit scale.
                    let e = rel_err(&got[t * nv..(t + 1) * nv], r);
                    assert!(e < 1e-4, "{ty} {path} {layout:?} token {t}: {e}");
                }
            }
        }
    }
}

/// The cache holds one row of `kv_lora_rank + rope_dim` per token and layer, no values, and the
/// KV formats apply to it (q8_0 here needs rows of whole 32-value blocks: 32 + 4 is not, so it is
/// refused with the format error; f16 and bf16 work).
#[test]
fn the_latent_cache_holds_one_row_per_token_in_any_format() {
    let model =
        Model::from_file(GgufFile::from_bytes(build(&spec(GgmlType::F32))).unwrap()).unwrap();
    let tokens: Vec<u32> = (0..10).collect();
    let row = MLA.kv_lora_rank + MLA.rope_dim;
    let exact = run(&model, &tokens, LatentPath::Absorbed, &KvOptions::default());
    for (ty, bytes) in [(KvType::F32, 4), (KvType::F16, 2), (KvType::Bf16, 2)] {
        let kv = KvOptions {
            format: KvFormat::both(ty),
            layout: KvLayout::Contiguous,
        };
        let mut cache = model.new_seq_cache(16, &kv).unwrap();
        model
            .forward(&tokens, &mut cache, &mut Scratch::default(), Logits::Last)
            .unwrap();
        assert_eq!(cache.bytes_in_use(), tokens.len() * 2 * row * bytes, "{ty}");
        let got = run(&model, &tokens, LatentPath::Absorbed, &kv);
        // bf16 keeps 8 mantissa bits (relative step 2^-8 = 0.4%) in every cached value, and two
        // layers compound it: 2% of the logit scale bounds that, a wrong row would not be close.
        assert!(
            rel_err(&got, &exact) < 2e-2,
            "{ty}: {}",
            rel_err(&got, &exact)
        );
    }
    let q8 = KvOptions {
        format: KvFormat::both(KvType::Q8_0),
        ..Default::default()
    };
    assert!(model.new_seq_cache(16, &q8).is_err());
}
