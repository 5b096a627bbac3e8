//! `frugal tokenize` gives llama.cpp's ids with a real Qwen 2 tokenizer (151k pieces,
//! DeepSeek-R1-Distill-Qwen's pre-tokenizer) on multilingual text, code, emoji, whitespace runs
//! and special tokens: the ids in `fixtures/qwen2_tokenize.json` are what llama.cpp's
//! `llama-tokenize` printed for each text. The tokenizer comes from the first part of a split
//! download (`frugal fetch deepseek-r1-qwen-vocab`), whose tensors are cut off, and from the
//! vocab-only copy `frugal tokenize --write-vocab` makes of it (which llama-tokenize loads too).
//!
//! Skips without the file unless `FRUGAL_REQUIRE_MODEL` is set (CI fetches it). With a
//! llama.cpp build (see `common::llama_bin`) the fixture itself is checked against
//! llama-tokenize on the vocab-only copy.

mod common;

use std::path::Path;
use std::process::Command;

use common::{llama_bin, run};

struct Case {
    text: String,
    ids: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let v: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/qwen2_tokenize.json")).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            ids: serde_json::from_value(c["ids"].clone()).unwrap(),
        })
        .collect()
}

fn parse_ids(out: &str) -> Vec<u32> {
    serde_json::from_str(out.trim().lines().last().unwrap()).unwrap()
}

fn frugal_ids(model: &Path, text: &str) -> Vec<u32> {
    parse_ids(&run(Command::new(env!("CARGO_BIN_EXE_frugal")).args([
        "tokenize",
        "-m",
        model.to_str().unwrap(),
        "--parse-special",
        text,
    ])))
}

#[test]
fn qwen2_tokenizer_gives_llama_cpp_ids() {
    let Some(part) = frugal::fetch::qwen2_vocab_for_tests() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let vocab = dir.path().join("vocab.gguf");
    run(Command::new(env!("CARGO_BIN_EXE_frugal")).args([
        "tokenize",
        "-m",
        part.to_str().unwrap(),
        "--write-vocab",
        vocab.to_str().unwrap(),
    ]));
    let cases = cases();
    assert!(cases.len() >= 20);
    for c in &cases {
        assert_eq!(frugal_ids(&part, &c.text), c.ids, "text {:?}", c.text);
        assert_eq!(
            frugal_ids(&vocab, &c.text),
            c.ids,
            "vocab-only, text {:?}",
            c.text
        );
    }
    if let Some(bin) = llama_bin() {
        for c in &cases {
            let out = run(Command::new(bin.join("llama-tokenize")).args([
                "-m",
                vocab.to_str().unwrap(),
                "-p",
                &c.text,
                "--ids",
                "--no-escape",
                "--log-disable",
            ]));
            assert_eq!(
                parse_ids(&out),
                c.ids,
                "llama.cpp now says, for {:?}",
                c.text
            );
        }
    }
}
