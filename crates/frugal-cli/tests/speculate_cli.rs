//! `--speculate` and `train-heads` end to end on small models the test writes: every drafter
//! gives plain greedy decoding's tokens, trained heads load and draft, and bad drafter flags
//! end with one clean `error:` line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::GgmlType;

fn frugal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args(args)
        .env("FRUGAL_HOME", "/nonexistent-frugal-home")
        .output()
        .unwrap()
}

fn write(dir: &Path, name: &str, layers: usize, seed: u64) -> PathBuf {
    let p = dir.join(name);
    let bytes = build(&SyntheticSpec {
        n_layers: layers,
        ty: GgmlType::Q8_0,
        n_ctx: 1024,
        untied_output: true,
        seed,
        ..Default::default()
    });
    std::fs::write(&p, bytes).unwrap();
    p
}

fn tokens(out: &Output) -> Vec<u64> {
    assert!(
        out.status.success(),
        "{}",
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

fn assert_clean_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected: {err}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains(needle),
        "{err}"
    );
}

#[test]
fn every_drafter_gives_the_plain_greedy_tokens_and_heads_train() {
    let dir = tempfile::tempdir().unwrap();
    let target = write(dir.path(), "t.gguf", 3, 1);
    let draft = write(dir.path(), "d.gguf", 1, 2);
    let data = dir.path().join("data.txt");
    std::fs::write(
        &data,
        "the quick brown fox jumps over the lazy dog. ".repeat(40),
    )
    .unwrap();
    let heads = dir.path().join("heads.gguf");
    let m = target.to_str().unwrap();
    let out = frugal(&[
        "train-heads",
        "-m",
        m,
        "--data",
        data.to_str().unwrap(),
        "--heads",
        "2",
        "--tokens",
        "300",
        "--gen",
        "24",
        "--vocab",
        "64",
        "--out",
        heads.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("head 2: predicts token t+3"));
    // Heads trained on answers to chat requests, one per line (blank lines skipped; fewer
    // requests than --tokens asks for are each used once).
    let requests = dir.path().join("requests.txt");
    std::fs::write(
        &requests,
        "tell me a story\n\nexplain the fox\nlist three dogs\n",
    )
    .unwrap();
    let chat_heads = dir.path().join("chat-heads.gguf");
    let out = frugal(&[
        "train-heads",
        "-m",
        m,
        "--prompts",
        requests.to_str().unwrap(),
        "--heads",
        "2",
        "--tokens",
        "300",
        "--gen",
        "24",
        "--vocab",
        "64",
        "--holdout",
        "0",
        "--out",
        chat_heads.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("3 requests, fewer than the 13"), "{err}");
    assert!(err.contains("from 3 prompts"), "{err}");

    let prompt = "abcabcabcab";
    let base = [
        "generate", "-m", m, "--temp", "0", "-n", "24", "--json", prompt,
    ];
    let want = tokens(&frugal(&base));
    let drafters = [
        "ngram".to_string(),
        "ngram:2:3".to_string(),
        "self:1".to_string(),
        "self:2:2".to_string(),
        format!("draft:{}", draft.display()),
        format!("draft:{}:2", target.display()),
        format!("heads:{}", heads.display()),
        format!("heads:{}:1", heads.display()),
        format!("heads:{}", chat_heads.display()),
        format!("ngram+heads:{}", heads.display()),
        format!("ngram+heads:{}:3", heads.display()),
    ];
    for d in &drafters {
        for fixed in [false, true] {
            let mut args: Vec<&str> = base.to_vec();
            args.extend(["--speculate", d]);
            if fixed {
                args.push("--speculate-fixed");
            }
            assert_eq!(
                tokens(&frugal(&args)),
                want,
                "--speculate {d} fixed {fixed}"
            );
        }
    }
}

#[test]
fn bad_drafters_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let target = write(dir.path(), "t.gguf", 2, 1);
    let m = target.to_str().unwrap();
    let run = |spec: &str| frugal(&["generate", "-m", m, "-n", "4", "hello", "--speculate", spec]);
    assert_clean_error(&run("ngram:3:0"), "at least 1");
    assert_clean_error(&run("self:2"), "before the last");
    assert_clean_error(&run("self:9"), "before the last");
    assert_clean_error(&run("medusa"), "unknown drafter");
    assert_clean_error(&run("draft:/nonexistent.gguf"), "nonexistent");
    // A model file is not a heads file, nor a datastore.
    assert_clean_error(&run(&format!("heads:{m}")), "not a draft-heads file");
    assert_clean_error(&run(&format!("store:{m}")), "not a datastore");
    // The server drafts by prompt lookup and from a store only, and checks the store's file
    // before it starts.
    let serve = |spec: &str| frugal(&["serve", "-m", m, "--port", "0", "--speculate", spec]);
    assert_clean_error(&serve("self:1"), "prompt lookup and retrieval only");
    assert_clean_error(&serve(&format!("store:{m}")), "not a datastore");
    let out = frugal(&[
        "generate",
        "-m",
        m,
        "-n",
        "4",
        "hello",
        "--speculate",
        "ngram",
        "--no-kv-cache",
    ]);
    assert_clean_error(&out, "KV cache");
    // A requests file with no requests, or both --data and --prompts, is refused.
    let heads = dir.path().join("h.gguf");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n  \n").unwrap();
    let train = |extra: &[&str]| {
        let mut args = vec!["train-heads", "-m", m, "--out", heads.to_str().unwrap()];
        args.extend_from_slice(extra);
        frugal(&args)
    };
    assert_clean_error(
        &train(&["--prompts", empty.to_str().unwrap()]),
        "no requests",
    );
    let both = train(&["--prompts", empty.to_str().unwrap(), "--data", "x.txt"]);
    assert!(!both.status.success());
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
    // Saved generations with an empty prompt, or a token past the vocabulary, are refused.
    for (i, bad) in ["[[[1,2,3],0]]", "[[[1,99999],1]]", "{}"]
        .iter()
        .enumerate()
    {
        let g = dir.path().join(format!("g{i}.json"));
        std::fs::write(&g, bad).unwrap();
        let out = frugal(&[
            "train-heads",
            "-m",
            m,
            "--data",
            "unused.txt",
            "--generations",
            g.to_str().unwrap(),
            "--out",
            heads.to_str().unwrap(),
        ]);
        let want = if i == 2 {
            "not a generations file"
        } else {
            "bad prompt lengths"
        };
        assert_clean_error(&out, want);
    }
}

#[test]
fn bench_speculate_prints_its_table_and_draws_its_chart() {
    let dir = tempfile::tempdir().unwrap();
    let target = write(dir.path(), "t.gguf", 2, 1);
    let out_dir = dir.path().join("charts");
    let out = frugal(&[
        "bench",
        "speculate",
        "-m",
        target.to_str().unwrap(),
        "--drafters",
        "ngram,self:1",
        "--k",
        "1,2",
        "--reps",
        "1",
        "-n",
        "8",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "| R | relative time |",
        "| ngram | input-grounded | adaptive |",
        "| self:1 | open | 2 |",
    ] {
        assert!(stdout.contains(needle), "{needle:?} missing:\n{stdout}");
    }
    assert!(out_dir.join("speculative.svg").exists());
}
