use super::*;
use crate::kv::KvOptions;
use crate::model::synthetic::{SyntheticSpec, build};

/// A dense synthetic model: its file, and the model loaded from a copy.
fn dense(ty: GgmlType) -> (GgufFile, Model) {
    let spec = SyntheticSpec {
        n_embd: 64,
        n_ff: 128,
        ty,
        ..Default::default()
    };
    let bytes = build(&spec);
    let m = Model::from_file(GgufFile::from_bytes(bytes.clone()).unwrap()).unwrap();
    (GgufFile::from_bytes(bytes).unwrap(), m)
}

fn logits(m: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut kv = m.new_seq_cache(64, &KvOptions::default()).unwrap();
    let mut s = Scratch::default();
    m.forward(tokens, &mut kv, &mut s, Logits::All)
        .unwrap()
        .to_vec()
}

const TOKENS: [u32; 10] = [72, 101, 108, 108, 111, 32, 119, 111, 114, 100];

fn target(e: usize, k: usize, split: Split, router: RouterInit) -> MoefyTarget {
    MoefyTarget {
        n_expert: e,
        n_used: k,
        split,
        router,
        shared: 0,
        seed: 7,
    }
}

/// With every expert active and exactly uniform weights (the router zeroed), a MoEfied layer
/// computes the dense FFN: each neuron lands in exactly one expert and the down projections
/// carry the factor k back. F32 throughout, so only the summation order differs (tolerance
/// 1e-4 of the logits' scale).
#[test]
fn all_experts_with_uniform_weights_give_the_dense_model() {
    let (f, m) = dense(GgmlType::F32);
    let calib: Vec<u32> = (0..256).map(|i| (i * 7 % 250) as u32).collect();
    for (split, router, shared) in [
        (Split::Weights, RouterInit::Centroid, 0),
        (Split::Coactivation, RouterInit::Fit, 0),
        (Split::Weights, RouterInit::Fit, 32),
    ] {
        let t = MoefyTarget {
            shared,
            ..target(4, 4, split, router)
        };
        let (mut w, r) = moefy(&f, &m, Some((&calib, 64)), &t).unwrap();
        assert_eq!((r.n_expert, r.expert_width), (4, (128 - shared) / 4));
        assert_eq!(
            r.total_params - r.active_params,
            258 * 64,
            "k = E: all but the embedding"
        );
        for t in w
            .tensors
            .iter_mut()
            .filter(|t| t.name.ends_with("ffn_gate_inp.weight"))
        {
            t.data = Cow::Owned(vec![0u8; t.data.len()]);
        }
        let moe = Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).unwrap();
        assert_eq!(moe.config.moe.unwrap().n_expert, 4);
        assert_eq!(moe.config.moe.unwrap().n_ff_shared, shared);
        let (a, b) = (logits(&m, &TOKENS), logits(&moe, &TOKENS));
        let scale = a.iter().fold(0f32, |s, v| s.max(v.abs()));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * scale,
                "{split:?} logit {i}: {x} vs {y}"
            );
        }
    }
}

/// Routing a quarter of the experts keeps the model close to the dense one, and the router as
/// built beats a router that routes at random (the same file with a shuffled router).
#[test]
fn routed_experts_stay_close_and_the_router_matters() {
    let (f, m) = dense(GgmlType::Q8_0);
    let calib: Vec<u32> = (0..512).map(|i| (i * 13 % 250) as u32).collect();
    let (w, r) = moefy(
        &f,
        &m,
        Some((&calib, 64)),
        &target(4, 1, Split::Coactivation, RouterInit::Fit),
    )
    .unwrap();
    // Active: attention, norms, the head, routers and 1 of 4 experts.
    assert!(r.active_params < r.total_params);
    let bytes = w.to_bytes().unwrap();
    let moe = Model::from_file(GgufFile::from_bytes(bytes.clone()).unwrap()).unwrap();
    let dist = |x: &Model| {
        let (a, b) = (logits(&m, &TOKENS), logits(x, &TOKENS));
        a.iter()
            .zip(&b)
            .map(|(p, q)| (p - q).powi(2))
            .sum::<f32>()
            .sqrt()
    };
    let built = dist(&moe);
    // The same experts behind a router that ignores the input's direction.
    let mut w2 = crate::gguf::GgufWriter::from_file(&moe.file);
    for t in w2
        .tensors
        .iter_mut()
        .filter(|t| t.name.ends_with("ffn_gate_inp.weight"))
    {
        let mut v: Vec<f32> = t
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        v.reverse();
        t.data = Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    let shuffled = Model::from_file(GgufFile::from_bytes(w2.to_bytes().unwrap()).unwrap()).unwrap();
    let random = dist(&shuffled);
    assert!(built < random, "built router {built} vs reversed {random}");
}

/// Upcycled copies without noise start as the dense model (F32: exactly the same experts).
#[test]
fn upcycled_copies_start_as_the_dense_model() {
    let (f, m) = dense(GgmlType::F32);
    let (w, r) = upcycle(&f, 4, 1, 0.0, 3).unwrap();
    assert_eq!(r.n_expert, 4);
    assert!(r.total_params > r.active_params);
    let up = Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()).unwrap();
    let (a, b) = (logits(&m, &TOKENS), logits(&up, &TOKENS));
    let scale = a.iter().fold(0f32, |s, v| s.max(v.abs()));
    assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-5 * scale));
}

#[test]
fn bad_expert_counts_are_refused() {
    let (f, m) = dense(GgmlType::F32);
    let err = |t: MoefyTarget| moefy(&f, &m, None, &t).err().unwrap().to_string();
    assert!(err(target(4, 0, Split::Weights, RouterInit::Centroid)).contains("1 <= k"));
    assert!(err(target(4, 5, Split::Weights, RouterInit::Centroid)).contains("1 <= k"));
    // 128 neurons do not split into 3 equal experts (nor 8 experts of 16, under 32-blocks: F32
    // has blocks of 1, so 8 is fine there).
    assert!(err(target(3, 1, Split::Weights, RouterInit::Centroid)).contains("use one of"));
    assert!(err(target(4, 1, Split::Coactivation, RouterInit::Centroid)).contains("calibration"));
}

/// Balanced k-means fills every cluster exactly and keeps points that belong together.
#[test]
fn balanced_kmeans_fills_clusters_exactly() {
    // Two directions, 6 points each, slightly perturbed.
    let mut feat = Vec::new();
    for i in 0..12 {
        let (a, b) = if i % 2 == 0 {
            (1.0, 0.01 * i as f32)
        } else {
            (0.01 * i as f32, 1.0)
        };
        feat.extend([a, b]);
    }
    unit_rows(&mut feat, 2);
    let c = balanced_kmeans(&feat, 2, 2, 1);
    assert_eq!(c.len(), 2);
    assert!(c.iter().all(|m| m.len() == 6));
    assert!(
        c[0].iter().all(|i| i % 2 == 0) && c[1].iter().all(|i| i % 2 == 1),
        "{c:?}"
    );
}
