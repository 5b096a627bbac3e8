use super::*;
use crate::gguf::GgufFile;
use crate::model::Ffn;
use crate::model::synthetic::{SyntheticMoe, SyntheticSpec, build};
use crate::quant::{self, GgmlType};

fn spec(ty: GgmlType, moe: SyntheticMoe) -> SyntheticSpec {
    SyntheticSpec {
        n_embd: 64,
        n_ff: 32,
        ty,
        moe: Some(moe),
        ..Default::default()
    }
}

fn moe(n_expert: usize, n_used: usize) -> SyntheticMoe {
    SyntheticMoe {
        n_expert,
        n_used,
        gating: Gating::Softmax,
        n_ff_shared: 0,
        selection_bias: false,
    }
}

fn load(s: &SyntheticSpec) -> Result<Model, GgufError> {
    Model::from_file(GgufFile::from_bytes(build(s))?)
}

fn rows(n: usize, d: usize) -> Vec<f32> {
    (0..n * d)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0 + ((i / d) as f32 * 0.3).sin())
        .collect()
}

/// The tensor `name` of layer 0, dequantized.
fn tensor(m: &Model, name: &str) -> Vec<f64> {
    let (info, bytes) = m.file.tensor(&format!("blk.0.{name}")).unwrap();
    let mut out = vec![0f32; info.dims.iter().product::<u64>() as usize];
    quant::dequantize(info.ty, bytes, &mut out).unwrap();
    out.into_iter().map(f64::from).collect()
}

/// `y = W x` for a row-major `rows x cols` block of `w` starting at `at`.
fn product(w: &[f64], at: usize, rows: usize, x: &[f64]) -> Vec<f64> {
    let cols = x.len();
    (0..rows)
        .map(|r| (0..cols).map(|j| w[at + r * cols + j] * x[j]).sum())
        .collect()
}

/// The routed FFN of one row, written out plainly in f64 from the file's tensors: router,
/// gating, top-k, renormalized weights, each chosen expert's SwiGLU, the shared expert.
fn reference(m: &Model, x: &[f32]) -> Vec<f64> {
    let c = m.config.moe.unwrap();
    let (d, ff) = (m.config.n_embd, m.config.n_ff);
    let x: Vec<f64> = x.iter().map(|&v| v.into()).collect();
    let logits = product(&tensor(m, "ffn_gate_inp.weight"), 0, c.n_expert, &x);
    let probs: Vec<f64> = match c.gating {
        Gating::Softmax => {
            let z: f64 = logits.iter().map(|l| l.exp()).sum();
            logits.iter().map(|l| l.exp() / z).collect()
        }
        Gating::Sigmoid => logits.iter().map(|l| 1.0 / (1.0 + (-l).exp())).collect(),
    };
    let bias = m
        .file
        .tensor_info("blk.0.exp_probs_b.bias")
        .map(|_| tensor(m, "exp_probs_b.bias"));
    let mut order: Vec<usize> = (0..c.n_expert).collect();
    order.sort_by(|&a, &b| {
        let s = |e: usize| probs[e] + bias.as_ref().map_or(0.0, |b| b[e]);
        s(b).total_cmp(&s(a))
    });
    let chosen = &order[..c.n_used];
    let total: f64 = chosen.iter().map(|&e| probs[e]).sum();
    let swiglu = |prefix: &str, at_up: usize, at_down: usize, width: usize| {
        let g = product(
            &tensor(m, &format!("ffn_gate_{prefix}.weight")),
            at_up,
            width,
            &x,
        );
        let u = product(
            &tensor(m, &format!("ffn_up_{prefix}.weight")),
            at_up,
            width,
            &x,
        );
        let h: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        product(
            &tensor(m, &format!("ffn_down_{prefix}.weight")),
            at_down,
            d,
            &h,
        )
    };
    let mut y = vec![0f64; d];
    for &e in chosen {
        let w = probs[e] / total;
        let out = swiglu("exps", e * ff * d, e * d * ff, ff);
        y.iter_mut().zip(out).for_each(|(y, o)| *y += w * o);
    }
    if c.n_ff_shared > 0 {
        let out = swiglu("shexp", 0, 0, c.n_ff_shared);
        y.iter_mut().zip(out).for_each(|(y, o)| *y += o);
    }
    y
}

/// The routed FFN of layer 0 over `x`, at the model's activation precision.
fn run(m: &Model, x: &[f32]) -> Vec<f32> {
    let Ffn::Experts(w) = &m.weights.layers[0].ffn else {
        panic!("a MoE layer")
    };
    let mut s = MoeScratch::default();
    let mut forms = crate::quant::ActBuffers::default();
    let mut out = vec![0f32; x.len()];
    m.experts_ffn(0, w, x, &mut forms, &mut s, &mut out);
    out
}

/// The grouped-by-expert products equal the plain per-token reference, for softmax and sigmoid
/// gating, with a shared expert and a selection bias. Tolerance: f32 products of 64 and 32
/// terms against f64, relative 1e-4 of the output's scale.
#[test]
fn routed_ffn_equals_the_per_token_reference() {
    let variants = [
        moe(4, 2),
        moe(8, 1),
        moe(3, 3),
        SyntheticMoe {
            gating: Gating::Sigmoid,
            n_ff_shared: 16,
            selection_bias: true,
            ..moe(6, 2)
        },
    ];
    for v in variants {
        let m = load(&spec(GgmlType::F32, v.clone())).unwrap();
        let d = m.config.n_embd;
        let n = 9;
        let x = rows(n, d);
        let got = run(&m, &x);
        let mut used = std::collections::BTreeSet::new();
        for t in 0..n {
            let want = reference(&m, &x[t * d..(t + 1) * d]);
            let scale = want.iter().fold(1e-3f64, |a, w| a.max(w.abs()));
            for (j, (&g, w)) in got[t * d..(t + 1) * d].iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() <= 1e-4 * scale,
                    "{v:?} token {t} dim {j}: {g} vs {w}"
                );
            }
            let mut r = Route::default();
            let logits: Vec<f32> = product(
                &tensor(&m, "ffn_gate_inp.weight"),
                0,
                v.n_expert,
                &x[t * d..(t + 1) * d]
                    .iter()
                    .map(|&a| a.into())
                    .collect::<Vec<_>>(),
            )
            .into_iter()
            .map(|l| l as f32)
            .collect();
            route(
                &m.config.moe.unwrap(),
                &logits,
                None,
                &mut Vec::new(),
                &mut r,
            );
            used.extend(r.experts);
        }
        // The synthetic router spreads the tokens: more than the k experts of one token.
        assert!(used.len() > v.n_used.min(v.n_expert - 1), "{v:?}: {used:?}");
    }
}

/// On the integer kernels a row's output is the same bits alone as in a batch, where it is
/// gathered with other rows per expert.
#[test]
fn a_rows_output_does_not_depend_on_the_batch() {
    for ty in [GgmlType::Q8_0, GgmlType::Q4_1] {
        let mut m = load(&spec(ty, moe(4, 2))).unwrap();
        m.set_activations(crate::quant::act::Activations::Q8);
        let d = m.config.n_embd;
        let n = 11;
        let x = rows(n, d);
        let batch = run(&m, &x);
        for t in 0..n {
            let alone = run(&m, &x[t * d..(t + 1) * d]);
            let same = alone
                .iter()
                .zip(&batch[t * d..(t + 1) * d])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ty} row {t}");
        }
    }
}

/// Routing: top-k by probability in selection order, ties to the lower index, weights
/// renormalized; the bias moves the choice but not the weights.
#[test]
fn routing_picks_the_top_k_and_renormalizes() {
    let m = MoeConfig {
        n_expert: 4,
        n_used: 2,
        gating: Gating::Softmax,
        norm_weights: true,
        weights_scale: 1.0,
        n_ff_shared: 0,
    };
    let (mut probs, mut r) = (Vec::new(), Route::default());
    route(&m, &[0.0, 2.0, 1.0, 2.0], None, &mut probs, &mut r);
    assert_eq!(r.experts, [1, 3]);
    assert!((r.weights[0] - 0.5).abs() < 1e-6 && (r.weights[1] - 0.5).abs() < 1e-6);
    route(
        &m,
        &[0.0, 2.0, 1.0, 2.0],
        Some(&[0.0, 0.0, 1.0, 0.0]),
        &mut probs,
        &mut r,
    );
    assert_eq!(r.experts, [2, 1]);
    let (p1, p2) = (probs[1], probs[2]);
    assert!((r.weights[0] - p2 / (p1 + p2)).abs() < 1e-6);
    let sig = MoeConfig {
        gating: Gating::Sigmoid,
        norm_weights: false,
        weights_scale: 2.0,
        ..m
    };
    route(&sig, &[0.0, 0.0, 3.0, -1.0], None, &mut probs, &mut r);
    assert_eq!(r.experts, [2, 0]);
    assert!((r.weights[1] - 1.0).abs() < 1e-6, "2 * sigmoid(0)");
}

/// Bad MoE files get errors that name the problem.
#[test]
fn bad_moe_files_are_refused_clearly() {
    let err = |s: &SyntheticSpec| load(s).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(&spec(GgmlType::F32, moe(4, 0))).contains("between 1 and"));
    assert!(err(&spec(GgmlType::F32, moe(4, 5))).contains("between 1 and"));
    // A NaN router weight.
    let mut bytes = build(&spec(GgmlType::F32, moe(4, 2)));
    let f = GgufFile::from_bytes(bytes.clone()).unwrap();
    let at = (f.data_offset + f.tensor_info("blk.1.ffn_gate_inp.weight").unwrap().offset) as usize;
    bytes[at + 8..at + 12].copy_from_slice(&f32::NAN.to_le_bytes());
    let e = Model::from_file(GgufFile::from_bytes(bytes).unwrap())
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("ffn_gate_inp") && e.to_string().contains("NaN"),
        "{e}"
    );
    // Expert tensors that disagree with the expert count.
    let mut w = crate::gguf::GgufWriter::from_file(&f);
    w.set("llama.expert_count", crate::gguf::Value::U32(5));
    let e = Model::from_file(GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap())
        .err()
        .unwrap();
    assert!(
        e.to_string().contains("ffn_gate_inp") || e.to_string().contains("exps"),
        "{e}"
    );
}
