//! The `frugal` command on Gemma 3 270M (the second model family), by its short name: the
//! levers a user reaches from the command line work on it. Skips without the fetched model
//! (`frugal fetch gemma3-270m`), unless `FRUGAL_REQUIRE_MODEL=1` (CI).

use std::process::{Command, Output};

fn frugal(args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "frugal {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = frugal(args, "");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "frugal {args:?}: not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn have_gemma() -> bool {
    frugal::fetch::gemma_model_for_tests().is_some_and(|p| p == frugal::fetch::GEMMA3.path())
}

/// `info` and `estimate` give the same KV bytes at a context (the local layers' rings
/// included), and both are far below what 18 full layers would hold.
#[test]
fn gemma_info_and_estimate_agree_on_the_windowed_cache() {
    if !have_gemma() {
        return;
    }
    for (ctx, est) in [(4096, "4k"), (32768, "32k"), (700, "700")] {
        let info = json(&[
            "info",
            "-m",
            "gemma3-270m",
            "--json",
            "-c",
            &ctx.to_string(),
        ]);
        let est = json(&["estimate", "gemma3-270m", "--json", "-c", est]);
        let a = info["kv_cache"]["bytes_at_context_f16"].as_u64().unwrap();
        let b = est["kv_cache_bytes_per_sequence"].as_u64().unwrap();
        assert_eq!(a, b, "context {ctx}");
        let held = (ctx as u64).min(1039);
        assert_eq!(
            a,
            (3 * ctx as u64 + 15 * held) * 2 * 256 * 2,
            "context {ctx}"
        );
    }
}

/// Generation by short name, greedy, is the same on both KV layouts (flash, f32 KV); the
/// naive kernel and a q8_0 cache run; chat renders Gemma's turn format (the file has no
/// template).
#[test]
fn gemma_generates_and_chats_on_every_cache() {
    if !have_gemma() {
        return;
    }
    let run = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "-m",
            "gemma3-270m",
            "The capital of France is",
            "--temp",
            "0",
            "-n",
            "8",
        ];
        args.extend_from_slice(extra);
        String::from_utf8(frugal(&args, "").stdout).unwrap()
    };
    let paged = run(&[]);
    assert!(paged.contains("France"), "{paged}");
    assert_eq!(run(&["--kv-layout", "contiguous"]), paged);
    assert!(!run(&["--attention", "naive", "--kv-type", "q8_0"]).is_empty());
    let chat = frugal(
        &["chat", "-m", "gemma3-270m", "--temp", "0", "-n", "12"],
        "What is the capital of France?\n/exit\n",
    );
    // The file is the pretrained model, which does not follow turns; what is checked is the
    // prompt: `<bos><start_of_turn>user\n` + 7 tokens of text + `<end_of_turn>\n
    // <start_of_turn>model\n` is 16 tokens only if the turn markers are read as Gemma's
    // control tokens (ChatML's markers would be split into many pieces).
    let text = String::from_utf8_lossy(&chat.stdout) + String::from_utf8_lossy(&chat.stderr);
    assert!(text.contains("[16 prompt tok"), "{text}");
}

/// Quantizing the file and scoring it against the original (`eval --reference`): a Q8_0
/// copy stays close (KL under 0.1 nats on a GPL-3 excerpt).
#[test]
fn gemma_quantized_copy_is_scored_against_the_original() {
    if !have_gemma() {
        return;
    }
    let Ok(text) = std::fs::read_to_string("/usr/share/common-licenses/GPL-3") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("frugal-gemma-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (q8, txt) = (dir.join("g8.gguf"), dir.join("t.txt"));
    std::fs::write(&txt, &text[..3000]).unwrap();
    frugal(
        &[
            "quantize",
            "gemma3-270m",
            q8.to_str().unwrap(),
            "--type",
            "q8_0",
        ],
        "",
    );
    let e = json(&[
        "eval",
        "perplexity",
        "-m",
        q8.to_str().unwrap(),
        "--reference",
        "gemma3-270m",
        "--text",
        txt.to_str().unwrap(),
        "--ctx",
        "128",
        "--json",
    ]);
    let kl = e["kl_mean"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 0.1, "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The measuring commands read the file: the outlier analysis of its weights (every matrix,
/// the 262k-row embedding included) and the KV-cache benchmark's decode steps.
#[test]
fn gemma_analysis_and_kv_bench_run_on_the_file() {
    if !have_gemma() {
        return;
    }
    let a = json(&["analyze", "quant", "gemma3-270m", "--json"]);
    // 18 layers x 7 matrices + the embedding.
    assert_eq!(
        a["tensors"].as_array().map(Vec::len),
        Some(127),
        "{}",
        a["model"]
    );
    let b = json(&[
        "bench",
        "kv",
        "-m",
        "gemma3-270m",
        "--points",
        "16,32",
        "--reps",
        "1",
        "--depths",
        "0,16",
        "--depth-tokens",
        "2",
        "--no-plot",
        "--json",
    ]);
    assert!(b.is_object(), "{b}");
}
