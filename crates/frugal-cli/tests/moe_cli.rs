//! `frugal moefy` on the real model: the split file runs, its parameter counts agree between
//! `moefy` and `info`, with every expert routed it is the dense model again (up to re-encoding
//! the down projections), and bad expert counts get clear errors.

use std::path::Path;
use std::process::{Command, Output};

fn frugal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = frugal(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.lines().last().unwrap()).unwrap()
}

fn ppl(model: &Path, text: &Path) -> f64 {
    let m = model.to_str().unwrap();
    let t = text.to_str().unwrap();
    json(&ok(&[
        "eval",
        "perplexity",
        "-m",
        m,
        "--text",
        t,
        "-c",
        "128",
        "--json",
    ]))["ppl"]
        .as_f64()
        .unwrap()
}

#[test]
fn moefied_real_model_runs_and_counts_its_parameters() {
    let Some(model) = frugal::fetch::reference_model_for_tests() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let m = model.to_str().unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "A model is trained once and served forever, so inference is the cost that matters. \
         Mixture-of-experts layers route each token to a few experts, so most weights stay idle. "
            .repeat(12),
    )
    .unwrap();
    let all = dir.path().join("all.gguf");
    let a = all.to_str().unwrap();
    let split = [
        "--experts",
        "8",
        "--split",
        "weights",
        "--router",
        "centroid",
    ];
    let r = json(&ok(&[
        &["moefy", m, a, "--top-k", "8", "--json"][..],
        &split,
    ]
    .concat()));
    assert_eq!(r["expert_width"], 192);
    // Every expert routed, with weights within about 1% of 1/8 each: the dense model, but for
    // the down projections re-encoded by columns (a second rounding of 4-bit codes).
    let (dense, moe) = (ppl(&model, &text), ppl(&all, &text));
    assert!(
        (moe / dense - 1.0).abs() < 0.1,
        "all experts: PPL {moe} vs dense {dense}"
    );
    let two = dir.path().join("two.gguf");
    let t = two.to_str().unwrap();
    let r = json(&ok(&[
        &["moefy", m, t, "--top-k", "2", "--json"][..],
        &split,
    ]
    .concat()));
    let info = json(&ok(&["info", t, "--json"]));
    assert_eq!(info["n_params_active"], r["active_params"]);
    assert_eq!(info["n_params"], r["total_params"]);
    let active = r["active_params"].as_f64().unwrap();
    assert!((active / 46.6e6 - 1.0).abs() < 0.01, "active {active}");
    let out = ok(&[
        "generate",
        "The capital of France is",
        "-m",
        t,
        "-n",
        "6",
        "--temp",
        "0",
    ]);
    assert!(!out.trim().is_empty());
    // --moe-stats: every layer's loads are shares of the routed slots, two per token.
    let mut args = vec!["generate", "The capital of France is", "-m", t, "-n", "6"];
    args.extend(["--temp", "0", "--json", "--moe-stats"]);
    let g = json(&ok(&args));
    let layers = g["moe_stats"].as_array().unwrap();
    assert_eq!(layers.len(), 30);
    for l in layers {
        let load: Vec<f64> = l["load"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(load.len(), 8);
        assert!((load.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(l["tokens"].as_u64().unwrap() >= 6);
        assert!(l["max_over_mean"].as_f64().unwrap() >= 1.0);
        assert!(l["entropy"].as_f64().unwrap() <= 8f64.ln() + 1e-9);
    }
    // eval: every scored window's every position is routed.
    let e = json(&ok(&[
        "eval",
        "perplexity",
        "-m",
        t,
        "--text",
        text.to_str().unwrap(),
        "-c",
        "128",
        "--json",
        "--moe-stats",
    ]));
    let windows = e["windows"].as_u64().unwrap();
    let layers = e["moe_stats"].as_array().unwrap();
    assert_eq!(layers.len(), 30);
    assert!(
        layers
            .iter()
            .all(|l| l["tokens"].as_u64() == Some(windows * 128))
    );
    // train-router: four steps of the bias-balanced router; the routers move, the selection
    // bias is written, the file runs; bad flags and wrong models get clear errors.
    let trained = dir.path().join("trained.gguf");
    let tr = trained.to_str().unwrap();
    let txt = text.to_str().unwrap();
    let train = |extra: &[&str], model: &str, out: &str| {
        let mut a = vec!["train-router", "-m", model, "--teacher", m, "--data", txt];
        a.extend([
            "--tokens", "512", "--batch", "128", "--ctx", "128", "--out", out,
        ]);
        a.extend(extra);
        frugal(&a)
    };
    let out = train(
        &["--balance", "bias:0.0001", "--lr", "1e-3", "--json"],
        t,
        tr,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = json(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(
        (s["steps"].as_u64(), s["tokens"].as_u64()),
        (Some(4), Some(512))
    );
    for phase in ["first", "last"] {
        let err = s[phase]["rel_err"].as_f64().unwrap();
        let hit = s[phase]["oracle_hit"].as_f64().unwrap();
        assert!(
            (0.0..1.5).contains(&err) && (0.0..=1.0).contains(&hit),
            "{s}"
        );
        assert!(s[phase]["max_over_mean"].as_f64().unwrap() >= 1.0);
    }
    let (before, after) = (
        frugal::gguf::GgufFile::open(&two).unwrap(),
        frugal::gguf::GgufFile::open(&trained).unwrap(),
    );
    let bytes = |f: &frugal::gguf::GgufFile, name: &str| {
        f.tensor_bytes(f.tensor_info(name).unwrap()).to_vec()
    };
    assert_ne!(
        bytes(&before, "blk.3.ffn_gate_inp.weight"),
        bytes(&after, "blk.3.ffn_gate_inp.weight")
    );
    assert_eq!(bytes(&after, "blk.3.exp_probs_b.bias").len(), 8 * 4);
    // The bias is frugal's: info says llama.cpp's llama architecture does not run it.
    assert_eq!(
        json(&ok(&["info", tr, "--json"]))["moe_routing_llama_cpp"],
        false
    );
    assert_eq!(info["moe_routing_llama_cpp"], true);
    let out = ok(&[
        "generate",
        "The capital of France is",
        "-m",
        tr,
        "-n",
        "4",
        "--temp",
        "0",
    ]);
    assert!(!out.trim().is_empty());
    // distill: one step of whole-model distillation of the MoE file trains its experts and
    // routers (the routed FFN's backward, with the Switch balancing loss), keeps the selection
    // bias, and writes a MoE file.
    let healed = dir.path().join("healed.gguf");
    let out = frugal(&[
        "distill",
        "--teacher",
        m,
        "--student",
        tr,
        "--data",
        txt,
        "--tokens",
        "64",
        "--seq",
        "64",
        "--batch",
        "1",
        "--heldout",
        "0.2",
        "--lr",
        "1e-3",
        "--moe-aux",
        "1",
        "--out",
        healed.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let h = frugal::gguf::GgufFile::open(&healed).unwrap();
    let decoded = |f: &frugal::gguf::GgufFile, name: &str| {
        let (info, raw) = f.tensor(name).unwrap();
        frugal::quant::dequantize_to_vec(info.ty, raw, info.n_elements() as usize).unwrap()
    };
    for name in ["blk.3.ffn_gate_inp.weight", "blk.3.ffn_up_exps.weight"] {
        let (b, a) = (decoded(&after, name), decoded(&h, name));
        assert_eq!(b.len(), a.len(), "{name}");
        assert!(
            b.iter().zip(&a).any(|(x, y)| x != y),
            "{name} did not train"
        );
    }
    assert_eq!(
        decoded(&after, "blk.3.exp_probs_b.bias"),
        decoded(&h, "blk.3.exp_probs_b.bias"),
        "the selection bias is not trained"
    );
    assert_eq!(
        json(&ok(&["info", healed.to_str().unwrap(), "--json"]))["n_params_active"],
        json(&ok(&["info", tr, "--json"]))["n_params_active"]
    );
    let bad = dir.path().join("bad-router.gguf");
    let b = bad.to_str().unwrap();
    for (extra, model, says) in [
        (vec!["--balance", "sideways"], t, "unknown balancing"),
        (vec!["--balance", "aux:-1"], t, "positive number"),
        (vec![], m, "no routed layers"),
    ] {
        let out = train(&extra, model, b);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{extra:?}: {err}"
        );
        assert!(!bad.exists());
    }
    let out = frugal(&[
        "train-router",
        "-m",
        t,
        "--teacher",
        t,
        "--data",
        txt,
        "--out",
        b,
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("dense model"),
        "{err}"
    );
    let dense = frugal(&["generate", "Hi", "-m", m, "-n", "1", "--moe-stats"]);
    assert!(String::from_utf8_lossy(&dense.stderr).contains("no experts"));
    for (flags, says) in [
        (vec!["--experts", "7"], "use one of"),
        (vec!["--experts", "8", "--top-k", "0"], "1 <= k"),
        (vec!["--experts", "8", "--top-k", "9"], "1 <= k"),
        (vec!["--experts", "8"], "calibration"),
    ] {
        let bad = dir.path().join("bad.gguf");
        let out = frugal(&[&["moefy", m, bad.to_str().unwrap()][..], &flags].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{flags:?}: {err}"
        );
        assert!(!bad.exists());
    }
}
