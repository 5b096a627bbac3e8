//! The `frugal` command end to end on a small model the test writes itself: normal runs print
//! what scripts rely on, and every kind of bad input ends with one `error:` line and a non-zero
//! exit, never a panic.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use frugal::gguf::{GgufFile, GgufWriter};
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::GgmlType;

fn frugal(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args(args)
        .env("FRUGAL_HOME", "/nonexistent-frugal-home")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or_default()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

fn write_model(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn tiny() -> Vec<u8> {
    build(&SyntheticSpec {
        ty: GgmlType::Q8_0,
        n_ctx: 64,
        ..Default::default()
    })
}

/// Asserts a clean failure: non-zero exit, a single `error:` line naming `needle`, no panic.
fn assert_clean_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {err}"
    );
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    assert!(lines[0].contains(needle), "expected {needle:?} in {err}");
}

#[test]
fn generate_json_info_and_perplexity_on_a_synthetic_model() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "tiny.gguf", &tiny());
    let m = m.to_str().unwrap();
    let out = frugal(
        &[
            "generate", "hello", "-m", m, "-n", "6", "--temp", "0", "--json",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["prompt_token_ids"].as_array().unwrap().len(), 5);
    let stats = &v["stats"];
    assert!(stats["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(stats["kv_cache_bytes"].as_u64().unwrap() > 0);
    // Greedy is deterministic, and the no-cache path produces the same tokens.
    let again = frugal(
        &[
            "generate",
            "hello",
            "-m",
            m,
            "-n",
            "6",
            "--temp",
            "0",
            "--json",
            "--no-kv-cache",
        ],
        None,
    );
    let w: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(v["tokens"], w["tokens"]);
    // Same seed, same sampled text.
    let s1 = frugal(
        &[
            "generate", "hi", "-m", m, "-n", "8", "--seed", "5", "--json",
        ],
        None,
    );
    let s2 = frugal(
        &[
            "generate", "hi", "-m", m, "-n", "8", "--seed", "5", "--json",
        ],
        None,
    );
    let t = |o: &Output| {
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["tokens"].clone()
    };
    assert_eq!(t(&s1), t(&s2));

    let info = frugal(&["info", m, "--json"], None);
    let v: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(v["config"]["n_head_kv"], 2);
    assert_eq!(v["kv_cache"]["elements_per_token"], 2 * 2 * 2 * 16);

    let text = write_model(
        dir.path(),
        "text.txt",
        "The quick brown fox jumps over the lazy dog. "
            .repeat(4)
            .as_bytes(),
    );
    let ppl = frugal(
        &[
            "eval",
            "perplexity",
            "-m",
            m,
            "--text",
            text.to_str().unwrap(),
            "--ctx",
            "32",
            "--json",
        ],
        None,
    );
    assert!(
        ppl.status.success(),
        "{}",
        String::from_utf8_lossy(&ppl.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&ppl.stdout).unwrap();
    assert_eq!(v["windows"], 5);
    assert_eq!(v["tokens"], 5 * 15);
    assert!(v["ppl"].as_f64().unwrap() > 1.0 && v["ppl_stderr"].as_f64().unwrap() > 0.0);
}

#[test]
fn bad_model_files_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let out = frugal(&["generate", "hi", "-m", "/no/such/model.gguf"], None);
    assert_clean_error(&out, "/no/such/model.gguf");

    let good = tiny();
    let truncated = write_model(dir.path(), "trunc.gguf", &good[..good.len() / 2]);
    assert_clean_error(
        &frugal(&["generate", "hi", "-m", truncated.to_str().unwrap()], None),
        "truncated",
    );

    let mut corrupt = good.clone();
    corrupt[..4].copy_from_slice(b"GGML");
    let corrupt = write_model(dir.path(), "corrupt.gguf", &corrupt);
    assert_clean_error(
        &frugal(&["info", corrupt.to_str().unwrap()], None),
        "not a GGUF file",
    );

    let f = GgufFile::from_bytes(good).unwrap();
    let mut w = GgufWriter::from_file(&f);
    let t = w
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.1.ffn_up.weight")
        .unwrap();
    t.ty = GgmlType::Q5_0;
    t.data = vec![0u8; 96 * 64 / 32 * 22].into();
    let unsupported = write_model(dir.path(), "q5.gguf", &w.to_bytes().unwrap());
    let out = frugal(
        &["generate", "hi", "-m", unsupported.to_str().unwrap()],
        None,
    );
    assert_clean_error(&out, "blk.1.ffn_up.weight");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Q5_0"));
}

#[test]
fn bad_prompts_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "tiny.gguf", &tiny());
    let m = m.to_str().unwrap();
    assert_clean_error(&frugal(&["generate", "", "-m", m], None), "empty");
    assert_clean_error(
        &frugal(&["generate", "-", "-m", m], Some(&[b'a', 0xff, 0xfe])),
        "UTF-8",
    );
    let long = "x".repeat(100);
    assert_clean_error(
        &frugal(&["generate", &long, "-m", m, "-c", "16"], None),
        "context",
    );
    assert_clean_error(
        &frugal(&["generate", "hi", "-m", m, "--top-p", "0"], None),
        "top-p",
    );
}

#[test]
fn context_full_stops_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "tiny.gguf", &tiny());
    let out = frugal(
        &[
            "generate",
            "hello",
            "-m",
            m.to_str().unwrap(),
            "-c",
            "12",
            "-n",
            "100",
            "--temp",
            "0",
            "--json",
        ],
        None,
    );
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    if v["stop_reason"] == "context_full" {
        assert!(String::from_utf8_lossy(&out.stderr).contains("context"));
        assert_eq!(v["tokens"].as_array().unwrap().len(), 12 - 5 + 1);
    } else {
        // The random model may emit its end token first; then it stopped for that reason.
        assert_eq!(v["stop_reason"], "end_of_generation");
    }
}

#[test]
fn every_command_has_help() {
    for cmd in [
        &["--help"][..],
        &["generate", "--help"],
        &["chat", "--help"],
        &["eval", "perplexity", "--help"],
        &["info", "--help"],
        &["bench", "--help"],
        &["bench", "kv", "--help"],
        &["bench", "attention", "--help"],
        &["bench", "context", "--help"],
        &["fetch", "--help"],
    ] {
        let out = frugal(cmd, None);
        assert!(out.status.success(), "{cmd:?}");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("Usage"),
            "{cmd:?}"
        );
    }
}

/// The reference model, when present (see `crates/frugal/tests/reference_model.rs`).
fn reference_model() -> Option<PathBuf> {
    let p = std::env::var_os("FRUGAL_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(frugal::fetch::default_model_path);
    if p.exists() {
        return Some(p);
    }
    assert!(
        std::env::var_os("FRUGAL_REQUIRE_MODEL").is_none(),
        "FRUGAL_REQUIRE_MODEL is set but {} is missing",
        p.display()
    );
    eprintln!("skipping: reference model not found at {}", p.display());
    None
}

#[test]
fn resident_memory_stays_under_twice_the_file_plus_the_kv_cache() {
    let Some(m) = reference_model() else { return };
    let m = m.to_str().unwrap();
    for act in ["f32", "q8"] {
        let out = frugal(
            &[
                "generate",
                "The capital of France is",
                "-m",
                m,
                "-n",
                "24",
                "--temp",
                "0",
                "--json",
                "--activations",
                act,
            ],
            None,
        );
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let s = &v["stats"];
        let Some(rss) = s["peak_rss_bytes"].as_u64() else {
            eprintln!("skipping: no peak RSS on this platform");
            return;
        };
        let file = s["model_file_bytes"].as_u64().unwrap();
        let kv = s["kv_cache_bytes"].as_u64().unwrap();
        assert!(
            rss < 2 * file + kv,
            "{act}: peak RSS {rss} >= 2 x {file} + {kv}"
        );
    }
}

fn greedy_tokens(m: &str, extra: &[&str]) -> Vec<u64> {
    let mut args = vec![
        "generate", "hello", "-m", m, "-n", "8", "--temp", "0", "--json",
    ];
    args.extend_from_slice(extra);
    let out = frugal(&args, None);
    assert!(
        out.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect()
}

#[test]
fn attention_and_kv_switches_work_and_bad_values_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "tiny.gguf", &tiny());
    let m = m.to_str().unwrap();
    let base = greedy_tokens(m, &[]);
    for extra in [
        &["--attention", "naive"][..],
        &["--kv-layout", "contiguous"],
        &[
            "--attention",
            "naive",
            "--kv-layout",
            "contiguous",
            "--kv-block",
            "3",
        ],
    ] {
        assert_eq!(greedy_tokens(m, extra), base, "{extra:?}");
    }
    greedy_tokens(m, &["--kv-type", "f16", "--kv-type-v", "bf16"]);
    let generate = |extra: &[&str]| {
        let mut args = vec!["generate", "hi", "-m", m];
        args.extend_from_slice(extra);
        frugal(&args, None)
    };
    assert_clean_error(&generate(&["--kv-type", "q4"]), "\"q4\"");
    assert_clean_error(&generate(&["--kv-type-k", "int8"]), "int8");
    assert_clean_error(&generate(&["--attention", "fast"]), "naive or flash");
    assert_clean_error(&generate(&["--kv-layout", "ring"]), "paged or contiguous");
    assert_clean_error(&generate(&["--kv-block", "0"]), "--kv-block");
    // Q8_0 stores blocks of 32 values per head; this model's heads have 16.
    assert_clean_error(&generate(&["--kv-type", "q8_0"]), "multiple");
    let text = write_model(
        dir.path(),
        "text.txt",
        "hello world, hello frugal. ".repeat(8).as_bytes(),
    );
    assert_clean_error(
        &frugal(
            &[
                "eval",
                "perplexity",
                "--text",
                text.to_str().unwrap(),
                "-m",
                m,
                "--kv-type",
                "f8",
            ],
            None,
        ),
        "f8",
    );
}

#[test]
fn bench_commands_print_tables_and_write_charts() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "tiny.gguf", &tiny());
    let m = m.to_str().unwrap();
    let out_dir = dir.path().join("charts");
    let o = out_dir.to_str().unwrap();
    let run = |args: &[&str]| {
        let out = frugal(args, None);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let t = run(&[
        "bench",
        "attention",
        "--seq",
        "16,40",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--head-dim",
        "32",
        "--budget",
        "0.01",
        "--out",
        o,
    ]);
    assert!(t.contains("speedup") && t.lines().count() >= 4, "{t}");
    let t = run(&["bench", "context", "-m", m, "--out", o]);
    assert!(t.contains("outgrows"), "{t}");
    let t = run(&[
        "bench", "kv", "-m", m, "--points", "4,8,16", "--reps", "1", "--out", o,
    ]);
    assert!(t.contains("fitted exponents"), "{t}");
    let j = run(&[
        "bench",
        "kv",
        "-m",
        m,
        "--points",
        "4,8",
        "--reps",
        "1",
        "--json",
        "--no-plot",
    ]);
    let v: serde_json::Value = serde_json::from_str(&j).unwrap();
    assert_eq!(v["rows"].as_array().unwrap().len(), 2);
    // Charts need a system font; where there is one, all three pairs are written.
    if std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        for stem in [
            "attention-time",
            "attention-memory",
            "kv-context",
            "kv-cache",
        ] {
            for ext in ["svg", "png"] {
                assert!(
                    out_dir.join(format!("{stem}.{ext}")).exists(),
                    "{stem}.{ext}"
                );
            }
        }
    }
    let bad = frugal(&["bench", "attention", "--seq", "0"], None);
    assert_clean_error(&bad, "--seq");
}
