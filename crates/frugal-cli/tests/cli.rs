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
    frugal_env(args, stdin, &[])
}

/// [`frugal`] with extra environment variables.
fn frugal_env(args: &[&str], stdin: Option<&[u8]>, env: &[(&str, &str)]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args(args)
        .envs(env.iter().copied())
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
    t.ty = GgmlType::Q8_1;
    t.data = vec![0u8; 96 * 64 / 32 * 36].into();
    let unsupported = write_model(dir.path(), "q8_1.gguf", &w.to_bytes().unwrap());
    let out = frugal(
        &["generate", "hi", "-m", unsupported.to_str().unwrap()],
        None,
    );
    assert_clean_error(&out, "blk.1.ffn_up.weight");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Q8_1"));

    // Declared sizes far past what the file holds: a context of 2^62 positions, a token
    // embedding of 2^40 rows, 2^40 tensors. Each is a clean error naming what is wrong, never
    // an allocation attempt that aborts.
    let f = GgufFile::from_bytes(tiny()).unwrap();
    let mut w = GgufWriter::from_file(&f);
    w.set("llama.context_length", frugal::gguf::Value::U64(1 << 62));
    let huge_ctx = write_model(dir.path(), "ctx.gguf", &w.to_bytes().unwrap());
    assert_clean_error(
        &frugal(
            &[
                "generate",
                "hi",
                "-n",
                "2",
                "-m",
                huge_ctx.to_str().unwrap(),
            ],
            None,
        ),
        "context",
    );
    // The writer checks shapes against the data, so the row count is patched in the bytes.
    let mut bytes = GgufWriter::from_file(&f).to_bytes().unwrap();
    let rows = f.tensor_info("token_embd.weight").unwrap().dims[1].to_le_bytes();
    let name = b"token_embd.weight";
    let at = bytes
        .windows(name.len())
        .position(|x| x == name)
        .expect("tensor name in the header")
        + name.len();
    // After the name: u32 n_dims, then u64 dims; the second dim is the row count.
    assert_eq!(bytes[at + 12..at + 20], rows);
    bytes[at + 12..at + 20].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let huge_vocab = write_model(dir.path(), "vocab.gguf", &bytes);
    assert_clean_error(
        &frugal(&["info", huge_vocab.to_str().unwrap()], None),
        "token_embd.weight",
    );
    let mut bytes = GgufWriter::from_file(&f).to_bytes().unwrap();
    bytes[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let huge_count = write_model(dir.path(), "count.gguf", &bytes);
    assert_clean_error(
        &frugal(&["info", huge_count.to_str().unwrap()], None),
        "tensor",
    );

    // A NaN block scale (f16 0x7e00) in the first Q8_0 block of a tensor.
    let f = GgufFile::from_bytes(tiny()).unwrap();
    let info = f.tensor_info("blk.0.attn_v.weight").unwrap();
    let at = (f.data_offset + info.offset) as usize;
    let mut raw = f.raw_bytes().to_vec();
    raw[at..at + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    let nan = write_model(dir.path(), "nan.gguf", &raw);
    assert_clean_error(
        &frugal(&["generate", "hi", "-m", nan.to_str().unwrap()], None),
        "blk.0.attn_v.weight",
    );
    let out = frugal(
        &[
            "eval",
            "perplexity",
            "--text",
            "/dev/null",
            "-m",
            nan.to_str().unwrap(),
        ],
        None,
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("NaN"));
}

#[test]
fn quantize_writes_files_that_load_and_run() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_model(
        dir.path(),
        "f32.gguf",
        &build(&SyntheticSpec {
            n_ctx: 64,
            ..Default::default()
        }),
    );
    let src = src.to_str().unwrap();
    let text = write_model(
        dir.path(),
        "text.txt",
        "The quick brown fox jumps over the lazy dog. "
            .repeat(4)
            .as_bytes(),
    );
    let text = text.to_str().unwrap();
    // Importance-weighted encoding from calibration text; a file that is not an imatrix and a
    // text shorter than one window are clean errors.
    let weighted = dir.path().join("q4_0-imatrix.gguf");
    let w = weighted.to_str().unwrap();
    let calibrated = |ctx: &str| {
        let args = [
            "quantize",
            src,
            w,
            "--type",
            "q4_0",
            "--calibration",
            text,
            "--calibration-ctx",
            ctx,
        ];
        frugal(&args, None)
    };
    let q = calibrated("16");
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    assert!(String::from_utf8_lossy(&q.stdout).contains("(14 importance-weighted)"));
    assert!(GgufFile::open(&weighted).is_ok());
    assert_clean_error(
        &frugal(
            &["quantize", src, w, "--type", "q4_0", "--imatrix", src],
            None,
        ),
        "not a llama.cpp imatrix",
    );
    assert_clean_error(&calibrated("4096"), "shorter than one window");
    for ty in ["q4_0", "q5_1", "q4_k", "q6_k", "mxfp4", "bf16"] {
        let out_path = dir.path().join(format!("{ty}.gguf"));
        let out_s = out_path.to_str().unwrap();
        let q = frugal(&["quantize", src, out_s, "--type", ty, "--json"], None);
        assert!(
            q.status.success(),
            "{ty}: {}",
            String::from_utf8_lossy(&q.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&q.stdout).unwrap();
        assert!(v["bytes_after"].as_u64().unwrap() < v["bytes_before"].as_u64().unwrap());
        // K-quants cannot tile these rows of 64 (and 96): every matrix falls back, and says so.
        if ty.ends_with("_k") {
            assert!(String::from_utf8_lossy(&q.stderr).contains("not a multiple"));
        }
        let f = GgufFile::open(&out_path).unwrap();
        assert_eq!(
            f.tensor_info("blk.0.attn_norm.weight").unwrap().ty,
            GgmlType::F32
        );
        let g = frugal(
            &[
                "generate", "hello", "-m", out_s, "-n", "4", "--temp", "0", "--json",
            ],
            None,
        );
        assert!(
            g.status.success(),
            "{ty}: {}",
            String::from_utf8_lossy(&g.stderr)
        );
        // Scored against the source in one pass: KL and top-1 agreement in the JSON.
        let p = frugal(
            &[
                "eval",
                "perplexity",
                "-m",
                out_s,
                "--reference",
                src,
                "--text",
                text,
                "--ctx",
                "32",
                "--json",
            ],
            None,
        );
        assert!(
            p.status.success(),
            "{ty}: {}",
            String::from_utf8_lossy(&p.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&p.stdout).unwrap();
        for key in [
            "ppl",
            "reference_ppl",
            "kl_mean",
            "kl_p99",
            "top1_agreement",
        ] {
            assert!(v[key].as_f64().is_some(), "{ty}: {key} missing in {v}");
        }
        assert!(v["kl_mean"].as_f64().unwrap() >= 0.0);
    }
    // Re-quantizing a quantized file warns but works.
    let q4 = dir.path().join("q4_0.gguf");
    let again = dir.path().join("again.gguf");
    let out = frugal(
        &[
            "quantize",
            q4.to_str().unwrap(),
            again.to_str().unwrap(),
            "--type",
            "q8_0",
            "--keep",
            "blk.1.*=f16",
        ],
        None,
    );
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("warning: re-quantizing"));
    let f = GgufFile::open(&again).unwrap();
    assert_eq!(
        f.tensor_info("blk.1.ffn_up.weight").unwrap().ty,
        GgmlType::F16
    );
    assert_eq!(
        f.tensor_info("blk.0.ffn_up.weight").unwrap().ty,
        GgmlType::Q8_0
    );
    assert_eq!(f.u32("general.file_type").unwrap(), 7);

    // In-situ quantization, simulated research format.
    let g = frugal(
        &[
            "generate",
            "hello",
            "-m",
            src,
            "-n",
            "4",
            "--temp",
            "0",
            "--quantize-on-load",
            "int4-b32",
        ],
        None,
    );
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));
    assert!(String::from_utf8_lossy(&g.stderr).contains("simulated"));

    // The outlier analysis, with activations.
    let a = frugal(&["analyze", "quant", src, "--text", text, "--json"], None);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let v: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    assert_eq!(v["tensors"].as_array().unwrap().len(), 2 * 7 + 1);
    assert!(v["tensors"][0]["snr"][0]["snr_db"].as_f64().unwrap() > 10.0);
    assert_eq!(v["activations"].as_array().unwrap().len(), 2 * 4);
    let a = frugal(&["analyze", "quant", src], None);
    assert!(String::from_utf8_lossy(&a.stdout).contains("median SNR"));
}

#[test]
fn bad_quantize_requests_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "tiny.gguf", &tiny());
    let m = m.to_str().unwrap();
    let out = dir.path().join("out.gguf");
    let o = out.to_str().unwrap();
    let unknown = frugal(&["quantize", m, o, "--type", "iq2_xs"], None);
    assert_clean_error(&unknown, "unknown type \"iq2_xs\"");
    // The message lists the valid types.
    let err = String::from_utf8_lossy(&unknown.stderr);
    assert!(
        err.contains("q4_k") && err.contains("mxfp4") && err.contains("nf4"),
        "{err}"
    );
    assert_clean_error(
        &frugal(&["quantize", m, o, "--type", "nf4"], None),
        "no GGUF encoding",
    );
    assert_clean_error(
        &frugal(
            &["quantize", m, o, "--type", "q8_0", "--keep", "nonsense"],
            None,
        ),
        "TENSOR_GLOB=TYPE",
    );
    assert_clean_error(
        &frugal(&["quantize", m, m, "--type", "q8_0"], None),
        "overwrite",
    );
    assert_clean_error(
        &frugal(
            &["generate", "hi", "-m", m, "--quantize-on-load", "int3"],
            None,
        ),
        "unknown type",
    );
    assert!(!out.exists());
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
        &["quantize", "--help"],
        &["analyze", "quant", "--help"],
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

#[test]
fn resident_memory_stays_under_twice_the_file_plus_the_kv_cache() {
    let Some(m) = frugal::fetch::reference_model_for_tests() else {
        return;
    };
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
        "bench",
        "kv",
        "-m",
        m,
        "--points",
        "4,8,16",
        "--reps",
        "1",
        "--depths",
        "0,8",
        "--depth-tokens",
        "2",
        "--out",
        o,
    ]);
    assert!(
        t.contains("fitted exponents") && t.contains("of bound"),
        "{t}"
    );
    let j = run(&[
        "bench",
        "kv",
        "-m",
        m,
        "--points",
        "4,8",
        "--reps",
        "1",
        "--depths",
        "0,8",
        "--depth-tokens",
        "2",
        "--json",
        "--no-plot",
    ]);
    let v: serde_json::Value = serde_json::from_str(&j).unwrap();
    assert_eq!(v["rows"].as_array().unwrap().len(), 2);
    let curve = v["depth_curve"].as_array().unwrap();
    assert_eq!(curve.len(), 2);
    for r in curve {
        let f = r["fraction_of_roofline"].as_f64().unwrap();
        assert!(f > 0.0 && f.is_finite(), "{r}");
    }
    // The cache read per token grows with the depth.
    assert!(curve[1]["kv_bytes_per_token"].as_u64() > curve[0]["kv_bytes_per_token"].as_u64());
    // Charts need a system font; where there is one, all three pairs are written.
    if std::path::Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists() {
        for stem in [
            "attention-time",
            "attention-memory",
            "kv-context",
            "kv-cache",
            "kv-depth",
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

#[test]
fn report_quant_measures_every_requested_format() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "tiny.gguf", &tiny());
    let text = write_model(
        dir.path(),
        "text.txt",
        "A small text to score, repeated. ".repeat(8).as_bytes(),
    );
    let out = frugal(
        &[
            "report",
            "quant",
            "-m",
            m.to_str().unwrap(),
            "--text",
            text.to_str().unwrap(),
            "--ctx",
            "32",
            "--types",
            "source,q4_0,int8-tensor,f16",
            "--modes",
            "q8,f32",
            "-p",
            "8",
            "-n",
            "2",
            "--json",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    // Each format under both modes (the simulated INT8 one still has its Q8_0 embedding/head);
    // F16 has nothing to run on integers: one f32 row.
    let modes: Vec<&str> = rows
        .iter()
        .map(|r| r["activations"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["q8", "f32", "q8", "f32", "q8", "f32", "f32"]);
    // The source against itself: exact under f32, close under q8; every row is measured.
    assert!(rows[1]["kl_mean"].as_f64().unwrap() < 1e-9);
    assert!(rows[0]["kl_mean"].as_f64().unwrap() < rows[2]["kl_mean"].as_f64().unwrap());
    for r in rows {
        assert!(
            r["ppl"].as_f64().unwrap() > 1.0 && r["tg_tokens_per_s"].as_f64().unwrap() > 0.0,
            "{r}"
        );
    }
    // Q4_0 (row 2) stores fewer bits than the simulated INT8 one (F32 weights, row 4).
    assert!(
        rows[2]["bits_per_weight"].as_f64().unwrap() < rows[4]["bits_per_weight"].as_f64().unwrap()
    );
}

/// `frugal convert` on a synthetic GQA model: every layout writes a file the other commands
/// run (MLA after calibration), and bad layouts, missing calibration and overwrites fail with
/// one clean error.
#[test]
fn convert_writes_attention_layouts_and_refuses_bad_ones() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_model(dir.path(), "src.gguf", &tiny());
    let text = dir.path().join("calib.txt");
    std::fs::write(
        &text,
        "Latent attention keeps one vector per token. ".repeat(20),
    )
    .unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    for (layout, heads) in [("mha", "4"), ("mqa", "1"), ("gqa:2", "2"), ("mla:16:8", "")] {
        let out = dir
            .path()
            .join(format!("{}.gguf", layout.replace(':', "-")));
        let mut args = vec![
            "convert".to_string(),
            s(&src),
            s(&out),
            "--attention".into(),
        ];
        args.push(layout.into());
        if layout.starts_with("mla") {
            args.extend(["--calibration".into(), s(&text), "--json".into()]);
        }
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let r = frugal(&argv, None);
        assert!(
            r.status.success(),
            "{layout}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        let info = frugal(&["info", &s(&out)], None);
        let shown = String::from_utf8_lossy(&info.stdout);
        if layout.starts_with("mla") {
            let report: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
            assert_eq!(report["cache_values_after"], 24);
            assert!(shown.contains("16 latent + 8 RoPE key"), "{shown}");
        } else {
            assert!(shown.contains(&format!("x {heads} KV heads")), "{shown}");
        }
        let run = frugal(
            &["generate", "-m", &s(&out), "Hi", "-n", "3", "--temp", "0"],
            None,
        );
        assert!(
            run.status.success(),
            "{layout}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    let out = s(&dir.path().join("x.gguf"));
    let bad = |layout: &str, needle: &str| {
        let r = frugal(&["convert", &s(&src), &out, "--attention", layout], None);
        assert_clean_error(&r, needle);
    };
    bad("gqa:3", "do not divide");
    bad("mqa2", "unknown attention layout");
    bad("mla:16", "--calibration");
    bad("mla:x", "whole number");
    let r = frugal(&["convert", &s(&src), &s(&src), "--attention", "mha"], None);
    assert_clean_error(&r, "overwrite");
}

#[test]
fn prune_writes_sparse_and_structured_models_and_refuses_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_model(dir.path(), "src.gguf", &tiny());
    let text = dir.path().join("calib.txt");
    std::fs::write(&text, "Pruning keeps what matters most. ".repeat(40)).unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (src_s, calib) = (s(&src), s(&text));
    let cases: [&[&str]; 5] = [
        &["--method", "magnitude", "--sparsity", "0.5"],
        &["--method", "wanda", "--pattern", "2:4"],
        &[
            "--method",
            "sparsegpt",
            "--pattern",
            "4:8",
            "--format",
            "q4_0",
        ],
        &["--structured", "ffn:0.25,heads:1"],
        &["--structured", "layers:1", "--layer-importance", "loss"],
    ];
    for (i, flags) in cases.iter().enumerate() {
        let out = s(&dir.path().join(format!("p{i}.gguf")));
        let mut args = vec!["prune", &src_s, &out, "--calibration", &calib];
        args.extend(["--calibration-ctx", "64", "--json"]);
        args.extend(flags.iter().copied());
        let r = frugal(&args, None);
        assert!(
            r.status.success(),
            "{flags:?}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        let report: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
        if flags[0] == "--structured" {
            assert!(
                report["params"][1].as_u64() < report["params"][0].as_u64(),
                "{report}"
            );
        } else {
            assert!(
                (report["zeros"].as_f64().unwrap() / report["weights"].as_f64().unwrap() - 0.5)
                    .abs()
                    < 0.02
            );
        }
        let run = frugal(
            &["generate", "-m", &out, "Hi", "-n", "3", "--temp", "0"],
            None,
        );
        assert!(
            run.status.success(),
            "{flags:?}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    let narrow = frugal(&["info", &s(&dir.path().join("p3.gguf"))], None);
    let shown = String::from_utf8_lossy(&narrow.stdout);
    assert!(shown.contains("x 1 KV heads"), "{shown}");

    let out = s(&dir.path().join("x.gguf"));
    let bad = |flags: &[&str], needle: &str| {
        let mut args = vec![
            "prune",
            &src_s,
            &out,
            "--calibration",
            &calib,
            "--calibration-ctx",
            "64",
        ];
        args.extend(flags.iter().copied());
        assert_clean_error(&frugal(&args, None), needle);
    };
    bad(&["--sparsity", "1.2"], "outside [0, 1)");
    bad(&["--pattern", "3:3"], "0 < 3 < 3");
    bad(&["--pattern", "2:5"], "do not divide");
    bad(&["--structured", "heads:2"], "no attention");
    bad(&["--structured", "ffn:1"], "[0, 1)");
    bad(&["--sparsity", "0.5", "--format", "q4_1"], "exact zero");
    bad(
        &["--sparsity", "0.5", "--format", "q8_0_24"],
        "--pattern 2:4",
    );
    bad(
        &["--sparsity", "0.5", "--calibration-tokens", "8"],
        "shorter than one window",
    );
    bad(&[], "--sparsity");
}

/// The compressed 2:4 storage end to end: written by `prune`, flagged by `info` as frugal-only,
/// generating the same text as the densely stored model with the sparse kernels, with the dense
/// fallback (no AVX-512: `FRUGAL_ISA=avx2`) and from a bitmap of the dense model, and exported
/// back to a standard file by `quantize`.
#[test]
fn compressed_two_four_files_run_like_their_dense_twin() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_model(dir.path(), "src.gguf", &tiny());
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let src_s = s(&src);
    let [dense, comp, back] =
        ["dense", "comp", "back"].map(|n| s(&dir.path().join(format!("{n}.gguf"))));
    for (out, format) in [(&dense, "q8_0"), (&comp, "q8_0_24")] {
        let r = frugal(
            &[
                "prune",
                &src_s,
                out,
                "--method",
                "magnitude",
                "--pattern",
                "2:4",
                "--format",
                format,
            ],
            None,
        );
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    }
    let info = frugal(&["info", &comp], None);
    let shown = String::from_utf8_lossy(&info.stdout);
    assert!(
        shown.contains("Q8_0_24") && shown.contains("llama.cpp"),
        "{shown}"
    );
    let json = frugal(&["info", &comp, "--json"], None);
    let j: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(j["llama_cpp_readable"], false);
    let gen_with = |m: &str, extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec!["generate", "-m", m, "Once upon", "-n", "12", "--temp", "0"];
        args.extend_from_slice(extra);
        let r = frugal_env(&args, None, env);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        String::from_utf8_lossy(&r.stdout).into_owned()
    };
    let want = gen_with(&dense, &[], &[]);
    assert_eq!(gen_with(&comp, &[], &[]), want, "sparse kernels");
    assert_eq!(
        gen_with(&comp, &[], &[("FRUGAL_ISA", "avx2")]),
        want,
        "dense fallback"
    );
    assert_eq!(
        gen_with(&dense, &["--sparse-bitmap", "0.4"], &[]),
        want,
        "bitmap"
    );
    let r = frugal(&["quantize", &comp, &back, "--type", "q8_0"], None);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let (a, b) = (
        GgufFile::open(&back).unwrap(),
        GgufFile::open(&dense).unwrap(),
    );
    for t in b
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with("blk.") && t.dims.len() == 2)
    {
        assert_eq!(
            a.tensor(&t.name).unwrap().1,
            b.tensor(&t.name).unwrap().1,
            "{}",
            t.name
        );
    }
    assert_clean_error(
        &frugal(
            &["generate", "-m", &dense, "Hi", "--sparse-bitmap", "2"],
            None,
        ),
        "[0, 1]",
    );
}

/// `report attention` end to end on a tiny model: every layout row, the estimate agreeing with
/// the measured cache, recovery curves and charts.
#[test]
fn report_attention_writes_the_layout_table() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_model(dir.path(), "src.gguf", &tiny());
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "Every layout has a price in bytes and in quality. ".repeat(60),
    )
    .unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = dir.path().join("docs");
    let r = frugal(
        &[
            "report",
            "attention",
            "-m",
            &s(&src),
            "--calibration",
            &s(&text),
            "--data",
            &s(&text),
            "--ranks",
            "8,16",
            "--rope-dims",
            "8",
            "--tokens",
            "256",
            "--seq",
            "32",
            "--batch",
            "2",
            "--eval-windows",
            "2",
            "--depths",
            "8,16",
            "--gen",
            "4",
            "--reps",
            "1",
            "--out",
            &s(&out),
        ],
        None,
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let md = std::fs::read_to_string(out.join("attention-layouts.md")).unwrap();
    for row in [
        "MHA (4 KV heads)",
        "GQA-2 (original)",
        "MQA (1 KV head)",
        "MLA rank 8 + 8 RoPE",
        "MLA rank 16 + 8 RoPE",
    ] {
        assert!(md.contains(row), "{row} missing:\n{md}");
    }
    assert!(!md.contains('✗'), "estimate and cache disagree:\n{md}");
    assert!(out.join("attention-layouts/recovery.svg").exists());
}

/// `report prune` end to end on a tiny model: every method and pattern row, the structured rows,
/// a recovered row, the speed columns.
#[test]
fn report_prune_writes_the_pruning_table() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_model(dir.path(), "src.gguf", &tiny());
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "Fewer weights cost quality; some patterns buy speed. ".repeat(60),
    )
    .unwrap();
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = dir.path().join("docs");
    let r = frugal(
        &[
            "report",
            "prune",
            "-m",
            &s(&src),
            "--calibration",
            &s(&text),
            "--text",
            &s(&text),
            "--ctx",
            "32",
            "--eval-tokens",
            "256",
            "--sparsities",
            "0.5",
            "--patterns",
            "2:4",
            "--structured",
            "ffn:0.25;heads:1",
            "--data",
            &s(&text),
            "--recover",
            "wanda@0.5,structured",
            "--tokens",
            "128",
            "--seq",
            "32",
            "--batch",
            "2",
            "-p",
            "16",
            "-n",
            "4",
            "--reps",
            "1",
            "--out",
            &s(&out),
        ],
        None,
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let md = std::fs::read_to_string(out.join("pruning.md")).unwrap();
    for row in [
        "dense (as stored)",
        "dense, Q8_0",
        "magnitude, 50% unstructured",
        "wanda, 2:4",
        "sparsegpt, 50% unstructured",
        "structured ffn:0.25",
        "structured heads:1",
        "wanda, 2:4, compressed Q8_0_24",
        "magnitude, 2:4, compressed Q4_0_24",
        "dense, Q4_0",
    ] {
        assert!(md.contains(row), "{row} missing:\n{md}");
    }
    if frugal::quant::kernels::sparse_available(frugal::quant::kernels::detect()) {
        assert!(md.contains("wanda, 50% unstructured, bitmap"), "{md}");
        assert!(md.contains("- Bitmap storage against dense"), "{md}");
    }
    // A compressed row computes its dense twin's logits: the same PPL and KL.
    let quality = |prefix: &str| {
        let line = md.lines().find(|l| l.starts_with(prefix)).unwrap();
        line.split('|')
            .skip(6)
            .take(2)
            .collect::<Vec<_>>()
            .join("|")
    };
    assert_eq!(
        quality("| wanda, 2:4, compressed"),
        quality("| wanda, 2:4 |"),
        "{md}"
    );
    let wanda = md
        .lines()
        .find(|l| l.starts_with("| wanda, 50% unstructured |"))
        .unwrap();
    assert!(
        !wanda.contains("| - |"),
        "the recovered row has no after figures: {wanda}"
    );
}

/// `frugal fetch` takes only the models it knows, and says which those are.
#[test]
fn fetch_an_unknown_model_is_a_clean_error() {
    let out = frugal(&["fetch", "llama-70b"], None);
    assert_clean_error(&out, "smollm2-135m, gemma3-270m");
}

/// `frugal optimize`: unknown levers are refused by name, bad targets name the bad piece, a
/// missing prompts file is named, and a recipe needs --out; each a one-line error, never a
/// panic.
#[test]
fn optimize_refuses_unknown_levers_and_bad_targets() {
    let dir = tempfile::tempdir().unwrap();
    let m = write_model(dir.path(), "m.gguf", &tiny());
    let text = dir.path().join("t.txt");
    std::fs::write(&text, "some text ".repeat(100)).unwrap();
    let (m, text) = (m.to_str().unwrap(), text.to_str().unwrap());
    let out = dir.path().join("out");
    let base = [
        "optimize",
        "-m",
        m,
        "--calibration",
        text,
        "--eval",
        text,
        "--out",
        out.to_str().unwrap(),
    ];
    let run = |extra: &[&str]| frugal(&[&base[..], extra].concat(), None);
    let o = run(&["--target", "kl <= 0.05", "--levers", "quant,sparsify"]);
    assert_clean_error(&o, "unknown lever \"sparsify\"");
    let o = run(&[
        "--target",
        "kl <= 0.05",
        "--prompts",
        "/nonexistent/prompts.txt",
    ]);
    assert_clean_error(&o, "/nonexistent/prompts.txt");
    let o = run(&["--target", "decode >= fastx"]);
    assert_clean_error(&o, "\"fast\" is not a number");
    let o = run(&["--target", "kl <= 0.05", "--budget", "soon"]);
    assert_clean_error(&o, "budget \"soon\"");
    let o = run(&[]);
    assert_clean_error(&o, "at least one --target");
    let o = frugal(&["optimize", "--recipe", text], None);
    assert_clean_error(&o, "--recipe needs --out");
}
