use super::structured::{StructuredTarget, drop_layers, prune_structured};
use super::*;
use crate::model::synthetic::{SyntheticSpec, build};
use crate::model::{Logits, Model, Scratch};

fn spec(ty: GgmlType) -> SyntheticSpec {
    SyntheticSpec {
        n_layers: 3,
        n_embd: 64,
        n_ff: 96,
        n_head: 4,
        n_head_kv: 2,
        ty,
        ..Default::default()
    }
}

fn tokens() -> Vec<u32> {
    b"Pruning removes weights; structured pruning removes whole neurons, heads and layers. "
        .repeat(3)
        .iter()
        .map(|&b| u32::from(b))
        .collect()
}

fn load(bytes: Vec<u8>) -> Model {
    Model::from_file(GgufFile::from_bytes(bytes).unwrap()).unwrap()
}

fn logits(m: &Model, t: &[u32]) -> Vec<f32> {
    let mut kv = m.new_cache(t.len()).unwrap();
    let mut s = Scratch::default();
    m.forward(t, &mut kv, &mut s, Logits::All).unwrap().to_vec()
}

fn matrix(m: &Model, name: &str) -> Vec<f32> {
    let (info, b) = m.file.tensor(name).unwrap();
    quant::dequantize_to_vec(info.ty, b, info.n_elements() as usize).unwrap()
}

fn stats(m: &Model, gram: bool) -> PruneStats {
    collect(m, &tokens(), 64, gram).unwrap()
}

#[test]
fn every_method_and_pattern_leaves_exact_zeros_where_it_says() {
    let src = build(&spec(GgmlType::F32));
    let f = GgufFile::from_bytes(src.clone()).unwrap();
    let m = load(src);
    let st = stats(&m, true);
    for method in [Method::Magnitude, Method::Wanda, Method::SparseGpt] {
        for pattern in [
            Pattern::Unstructured(0.5),
            Pattern::NofM { n: 2, m: 4 },
            Pattern::NofM { n: 4, m: 8 },
        ] {
            let target = PruneTarget {
                method,
                pattern,
                format: GgmlType::Q8_0,
            };
            let (w, r) = prune_weights(&f, Some(&st), target).unwrap();
            assert_eq!(r.matrices, 3 * 7);
            assert!(
                (r.sparsity() - 0.5).abs() < 0.01,
                "{method} {pattern}: {}",
                r.sparsity()
            );
            let p = load(w.to_bytes().unwrap());
            let wq = matrix(&p, "blk.1.attn_q.weight");
            for row in wq.chunks_exact(64) {
                match pattern {
                    Pattern::Unstructured(_) if method != Method::SparseGpt => {
                        assert_eq!(row.iter().filter(|&&v| v == 0.0).count(), 32)
                    }
                    Pattern::NofM { n, m } => {
                        for g in row.chunks_exact(m) {
                            assert!(g.iter().filter(|&&v| v == 0.0).count() >= m - n);
                        }
                    }
                    _ => {}
                }
            }
            let out = logits(&p, &tokens()[..16]);
            assert!(out.iter().all(|v| v.is_finite()));
        }
    }
}

/// Wanda weighs each weight by its input's norm: where one input channel is loud, its weights
/// survive although they are small, which magnitude pruning would drop.
#[test]
fn wanda_keeps_small_weights_on_loud_inputs() {
    let src = build(&spec(GgmlType::F32));
    let f = GgufFile::from_bytes(src.clone()).unwrap();
    let m = load(src);
    let mut st = stats(&m, false);
    let site = stats::site_index(crate::model::Site::FfnDownInput).unwrap();
    // The input whose weights are smallest: magnitude pruning drops most of them.
    let down = matrix(&m, "blk.2.ffn_down.weight");
    let l1 = |j: usize| down.chunks_exact(96).map(|r| r[j].abs()).sum::<f32>();
    let quiet = (0..96).min_by(|&a, &b| l1(a).total_cmp(&l1(b))).unwrap();
    for l in 0..3 {
        st.inputs[l][site].sq[quiet] *= 1e8;
    }
    let run = |method| {
        let t = PruneTarget {
            method,
            pattern: Pattern::Unstructured(0.7),
            format: GgmlType::F32,
        };
        load(
            prune_weights(&f, Some(&st), t)
                .unwrap()
                .0
                .to_bytes()
                .unwrap(),
        )
    };
    let (mag, wanda) = (run(Method::Magnitude), run(Method::Wanda));
    let kept = |m: &Model| {
        matrix(m, "blk.2.ffn_down.weight")
            .chunks_exact(96)
            .filter(|r| r[quiet] != 0.0)
            .count()
    };
    assert_eq!(
        kept(&wanda),
        64,
        "Wanda keeps every weight of the loud input"
    );
    assert!(kept(&mag) < 40, "magnitude keeps {} of 64", kept(&mag));
}

#[test]
fn formats_that_cannot_store_zero_are_refused() {
    let f = GgufFile::from_bytes(build(&spec(GgmlType::F32))).unwrap();
    let t = PruneTarget {
        method: Method::Magnitude,
        pattern: Pattern::NofM { n: 2, m: 4 },
        format: GgmlType::Q4_1,
    };
    let e = prune_weights(&f, None, t).err().unwrap().to_string();
    assert!(e.contains("exact zero") && e.contains("q8_0"), "{e}");
    let t = PruneTarget {
        method: Method::Wanda,
        ..t
    };
    let e = prune_weights(&f, None, t).err().unwrap().to_string();
    assert!(e.contains("calibration"), "{e}");
}

/// Removing FFN neurons and KV groups is the same function as the original with those units
/// silenced (their up rows, and their heads' output columns, zeroed), because nothing else
/// reads them; removing a layer is the original without that layer.
#[test]
fn structured_pruning_removes_exactly_the_units_it_names() {
    let src = build(&spec(GgmlType::F32));
    let f = GgufFile::from_bytes(src.clone()).unwrap();
    let m = load(src.clone());
    let st = stats(&m, false);
    let target: StructuredTarget = "ffn:0.25,heads:1".parse().unwrap();
    let (w, r) = prune_structured(&f, &st, &target, None).unwrap();
    assert_eq!((r.n_ff, r.n_head, r.n_head_kv), ((96, 72), (4, 2), (2, 1)));
    assert!(r.params.1 < r.params.0 && r.bytes.1 < r.bytes.0);
    let p = load(w.to_bytes().unwrap());
    assert_eq!(
        (p.config.n_ff, p.config.n_head, p.config.n_head_kv),
        (72, 2, 1)
    );
    assert_eq!(p.config.head_dim, 16);
    assert!(p.config.kv_elements_per_token() < m.config.kv_elements_per_token());

    // The original with the removed units silenced.
    let mut silenced = crate::gguf::GgufWriter::from_file(&f);
    for l in 0..3 {
        for t in silenced.tensors.iter_mut() {
            let mut x: Vec<f32> =
                quant::dequantize_to_vec(t.ty, &t.data, t.dims.iter().product::<u64>() as usize)
                    .unwrap();
            if t.name == format!("blk.{l}.ffn_up.weight") {
                for (j, row) in x.chunks_exact_mut(64).enumerate() {
                    if !r.kept_neurons[l].contains(&j) {
                        row.fill(0.0);
                    }
                }
            } else if t.name == format!("blk.{l}.attn_output.weight") {
                for row in x.chunks_exact_mut(64) {
                    for (c, v) in row.iter_mut().enumerate() {
                        if !r.kept_groups[l].contains(&(c / 32)) {
                            *v = 0.0;
                        }
                    }
                }
            } else {
                continue;
            }
            t.data = std::borrow::Cow::Owned(quant::quantize(t.ty, &x).unwrap());
        }
    }
    let reference = load(silenced.to_bytes().unwrap());
    let t = &tokens()[..20];
    let (a, b) = (logits(&p, t), logits(&reference, t));
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        diff < 1e-4,
        "pruned model differs from the silenced original by {diff}"
    );

    // Layers: dropping layer 1 is the original without it.
    let target: StructuredTarget = "layers:1".parse().unwrap();
    let imp = vec![5.0, 0.1, 5.0];
    let (w, r) = prune_structured(&f, &st, &target, Some(imp)).unwrap();
    assert_eq!(r.kept_layers, vec![0, 2]);
    let p = load(w.to_bytes().unwrap());
    let direct = load(drop_layers(&f, &[0, 2]).unwrap().to_bytes().unwrap());
    assert_eq!(logits(&p, t), logits(&direct, t));
    assert_eq!(p.config.n_layers, 2);
}

#[test]
fn structured_bad_input_is_refused() {
    let f = GgufFile::from_bytes(build(&spec(GgmlType::F32))).unwrap();
    let m = load(build(&spec(GgmlType::F32)));
    let st = stats(&m, false);
    for (s, want) in [("heads:2", "no attention"), ("layers:3", "at least one")] {
        let t: StructuredTarget = s.parse().unwrap();
        let e = prune_structured(&f, &st, &t, None)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want), "{s}: {e}");
    }
    for bad in ["ffn:1.0", "ffn:-0.1", "heads:x", "depth:2", "", "ffn:0"] {
        assert!(bad.parse::<StructuredTarget>().is_err(), "{bad}");
    }
    let e = collect(&m, &tokens()[..10], 64, false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("shorter than one window"), "{e}");
}

/// The compressed 2:4 storage holds exactly the weights of the dense file: with 8-bit
/// activations the sparse kernels give the same logits, bit for bit, as the dense Q8_0 kernels
/// on the densely stored model (and so does a bitmap of that dense model); 4-bit values agree
/// with Q4_0 to its kernels' rounding; `convert` expands the file back to the dense bytes; and
/// a pattern the format cannot hold is refused before any work.
#[test]
fn compressed_two_four_runs_the_same_model_as_dense_storage() {
    use crate::quant::act::Activations;
    let f = GgufFile::from_bytes(build(&spec(GgmlType::F32))).unwrap();
    let prune = |format| {
        let t = PruneTarget {
            method: Method::Magnitude,
            pattern: Pattern::NofM { n: 2, m: 4 },
            format,
        };
        let (w, r) = prune_weights(&f, None, t).unwrap();
        (w.to_bytes().unwrap(), r)
    };
    let run = |bytes: &[u8], bitmap: bool| {
        let mut m = load(bytes.to_vec());
        m.set_activations(Activations::Q8);
        if bitmap {
            assert!(m.use_bitmap_storage(0.4) > 0 || !sparse_kernels());
        }
        logits(&m, &tokens()[..40])
    };
    let (dense, rd) = prune(GgmlType::Q8_0);
    let (compressed, rc) = prune(GgmlType::Q8_0_24);
    assert_eq!(rd.zeros, rc.zeros);
    assert!(
        rc.bytes_after * 100 < rd.bytes_after * 66,
        "{rc:?} vs {rd:?}"
    );
    let want = run(&dense, false);
    for (what, got) in [
        ("compressed", run(&compressed, false)),
        ("bitmap", run(&dense, true)),
    ] {
        assert!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{what}: logits differ from the dense model's"
        );
    }
    let (q4, _) = prune(GgmlType::Q4_0);
    let (q4c, _) = prune(GgmlType::Q4_0_24);
    let (a, b) = (run(&q4c, false), run(&q4, false));
    let err = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let scale = b.iter().map(|v| v.abs()).fold(0f32, f32::max);
    // Same integer sums; the dense Q4_0 kernel applies its -8 offset through the activation
    // sums in f32, a few ulps per block.
    assert!(
        err <= 1e-4 * scale,
        "Q4_0_24 vs Q4_0: {err} (logits up to {scale})"
    );
    // Export: the compressed file converted to Q8_0 is the dense file's matrices, byte for byte.
    let cf = GgufFile::from_bytes(compressed).unwrap();
    let policy = crate::convert::Policy::new(crate::convert::Target::Stored(GgmlType::Q8_0));
    let (back, _) = crate::convert::quantize_in_memory(&cf, &policy, |_, _| {}).unwrap();
    let df = GgufFile::from_bytes(dense).unwrap();
    for t in df.tensors().iter().filter(|t| t.name.starts_with("blk.")) {
        if t.dims.len() == 2 {
            assert_eq!(
                back.tensor(&t.name).unwrap().1,
                df.tensor(&t.name).unwrap().1,
                "{}",
                t.name
            );
        }
    }
    // 4:8 keeps up to 4 of a group of four: the compressed storage cannot hold it.
    let t = PruneTarget {
        method: Method::Magnitude,
        pattern: Pattern::NofM { n: 4, m: 8 },
        format: GgmlType::Q8_0_24,
    };
    let e = prune_weights(&f, None, t).err().unwrap().to_string();
    assert!(e.contains("2:4"), "{e}");
}

fn sparse_kernels() -> bool {
    crate::quant::kernels::sparse_available(crate::quant::kernels::detect())
}
