//! `frugal estimate` as a user runs it: the built binary, its JSON, its errors and its chart.

use std::process::{Command, Output};

fn frugal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_frugal"))
        .arg("estimate")
        .args(args)
        .output()
        .expect("the frugal binary runs")
}

fn json(args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = frugal(&all);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON value")
}

/// The one-line message of a failing run.
fn error_line(args: &[&str]) -> String {
    let out = frugal(args);
    assert!(!out.status.success(), "expected failure for {args:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err:?}");
    assert!(err.starts_with("error: "), "{err:?}");
    assert!(!err.contains("panick"), "{err:?}");
    err
}

#[test]
fn estimate_json_has_the_documented_keys() {
    let v = json(&["llama-2-7b", "--context", "4096", "--batch", "8"]);
    for k in [
        "kv_bytes_per_token",
        "kv_cache_bytes",
        "weights_bytes",
        "params_total",
        "params_active",
        "context",
        "batch",
        "kv_type",
    ] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
    assert_eq!(v["context"], 4096);
    assert_eq!(v["batch"], 8);
    assert_eq!(v["kv_type"], "f16");
    assert_eq!(v["kv_bytes_per_token"], 524_288);
    // 2 GiB per sequence, 8 sequences.
    assert_eq!(v["kv_cache_bytes_per_sequence"], 2u64 << 30);
    assert_eq!(v["kv_cache_bytes"], 16u64 << 30);
}

#[test]
fn estimate_defaults_prefixes_and_context_suffixes() {
    let v = json(&["Mixtral-8x7B"]);
    assert_eq!(v["model"]["id"], "mixtral-8x7b-v0.1");
    assert_eq!(v["context"], 32768, "default: the model's maximum context");
    assert_eq!(v["batch"], 1);
    let v = json(&["deepseek-v3", "--context", "32k", "--kv-type", "q8_0"]);
    assert_eq!(v["context"], 32768);
    assert_eq!(v["kv_type"], "q8_0");
    // 576 latent elements x 61 layers at 8.5 bits.
    assert_eq!(v["kv_bytes_per_token"], 576 * 61 * 17 / 16);
    assert!(v["params_active"].as_u64().unwrap() < v["params_total"].as_u64().unwrap());
}

#[test]
fn estimate_compare_and_devices() {
    let v = json(&[
        "llama-2-7b",
        "--compare",
        "mha,gqa:8,mqa,mla:512",
        "--context",
        "4096",
        "--device",
        "h100-80gb,l4",
        "--device-memory",
        "40GB",
    ]);
    let ratios: Vec<f64> = v["compare"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["ratio"].as_f64().unwrap())
        .collect();
    assert_eq!(ratios, [1.0, 0.25, 1.0 / 32.0, 576.0 / 8192.0]);
    let devices = v["serving"]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 3);
    assert_eq!(devices[2]["memory_bytes"], 40_000_000_000u64);
    let rows = v["serving"]["rows"].as_array().unwrap();
    assert_eq!(rows[0]["context"], 4096);
    assert!(rows[0]["sequences"][0].as_u64().unwrap() > 0);
}

#[test]
fn estimate_text_shows_formula_and_units() {
    let out = frugal(&["llama-2-7b", "--context", "4k", "--compare", "gqa:8"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("2 (K and V) x 32 layers x 32 KV heads x 128 head_dim x 2 B (f16)"),
        "{text}"
    );
    assert!(
        text.contains("2,147,483,648 B (2.00 GiB, 2.15 GB)"),
        "{text}"
    );
    assert!(text.contains("GiB = 2^10, 2^20, 2^30 B") || text.contains("KiB, MiB, GiB"));
    assert!(text.contains("not estimated"), "{text}");
}

#[test]
fn estimate_reads_a_config_json() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(
        &path,
        r#"{"model_type":"llama","hidden_size":4096,"intermediate_size":11008,
            "num_attention_heads":32,"num_hidden_layers":32,"num_key_value_heads":32,
            "vocab_size":32000,"max_position_embeddings":4096,"tie_word_embeddings":false}"#,
    )
    .unwrap();
    let v = json(&[path.to_str().unwrap()]);
    assert_eq!(v["kv_cache_bytes"], 2u64 << 30);
    assert_eq!(v["model"]["origin"], "hf_config");
}

#[test]
fn estimate_bad_input_is_one_line_errors() {
    let e = error_line(&["lama-3-70b"]);
    assert!(
        e.contains("unknown model") && e.contains("llama-3-70b"),
        "{e}"
    );
    let e = error_line(&["llama-2-7"]);
    assert!(e.contains("ambiguous"), "{e}");
    let e = error_line(&["llama-2-7b", "--context", "12q"]);
    assert!(e.contains("context"), "{e}");
    let e = error_line(&["llama-2-7b", "--kv-type", "q3"]);
    assert!(e.contains("KV type"), "{e}");
    let e = error_line(&["llama-2-7b", "--compare", "gqa:3"]);
    assert!(e.contains("do not divide"), "{e}");
    let e = error_line(&["llama-2-7b", "--device-memory", "80G"]);
    assert!(e.contains("ambiguous unit"), "{e}");
    let e = error_line(&["no/such/config.json"]);
    assert!(e.contains("no such file"), "{e}");

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("config.json");
    std::fs::write(&bad, "{\"hidden_size\": 4096,").unwrap();
    let e = error_line(&[bad.to_str().unwrap()]);
    assert!(e.contains("not a valid config.json"), "{e}");
    std::fs::write(
        &bad,
        r#"{"hidden_size":4096,"num_attention_heads":32,"num_hidden_layers":32,
            "num_key_value_heads":6,"vocab_size":32000,"intermediate_size":11008}"#,
    )
    .unwrap();
    let e = error_line(&[bad.to_str().unwrap()]);
    assert!(e.contains("do not divide"), "{e}");
    std::fs::write(
        &bad,
        r#"{"hidden_size":4096,"num_attention_heads":0,"num_hidden_layers":32,
            "vocab_size":32000,"intermediate_size":11008}"#,
    )
    .unwrap();
    let e = error_line(&[bad.to_str().unwrap()]);
    assert!(e.contains("at least 1"), "{e}");
}

#[test]
fn estimate_list_names_every_catalog_model() {
    let out = frugal(&["--list", "--json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let models = v.as_array().unwrap();
    assert!(models.len() >= 27);
    assert!(
        models
            .iter()
            .all(|m| m["source"].as_str().is_some_and(|s| !s.is_empty()))
    );
}

#[test]
fn estimate_plot_writes_svg_and_png() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["chart.svg", "chart.png"] {
        let path = dir.path().join(name);
        let out = frugal(&[
            "llama-3-8b",
            "--device",
            "h100-80gb,l4",
            "--plot",
            path.to_str().unwrap(),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("needs a TrueType font") {
            eprintln!("no font on this machine; chart not checked");
            return;
        }
        assert!(out.status.success(), "{err}");
        let bytes = std::fs::read(&path).unwrap();
        if name.ends_with(".svg") {
            let s = String::from_utf8(bytes).unwrap();
            assert!(
                s.starts_with("<svg") && s.contains("Concurrent sequences"),
                "{s:.200}"
            );
        } else {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        }
    }
    let e = error_line(&["llama-3-8b", "--plot", "chart.gif"]);
    assert!(e.contains(".svg or .png"), "{e}");
}
