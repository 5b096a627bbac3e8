//! What the tests against llama.cpp share: finding its build, running a tool, the perplexity
//! each engine reports on the same text.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn llama_bin() -> Option<PathBuf> {
    let dir = std::env::var_os("LLAMA_CPP_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME")
                .map(|h| PathBuf::from(h).join(".cache/frugal-peers/llama.cpp/build/bin"))
        })?;
    if dir.join("llama-perplexity").exists() && dir.join("llama-quantize").exists() {
        Some(dir)
    } else {
        eprintln!("skipping: no llama.cpp build at {}", dir.display());
        None
    }
}

pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().expect("the command starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

pub fn frugal_ppl(model: &Path, text: &Path) -> f64 {
    frugal_ppl_with(model, text, &["--activations", "q8-full"])
}

/// `frugal eval perplexity` over `text` in windows of 128 with `extra` options.
pub fn frugal_ppl_with(model: &Path, text: &Path, extra: &[&str]) -> f64 {
    let out = run(Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args([
            "eval",
            "perplexity",
            "-m",
            model.to_str().unwrap(),
            "--text",
            text.to_str().unwrap(),
            "-c",
            "128",
            "--json",
        ])
        .args(extra));
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    v["ppl"].as_f64().unwrap_or_else(|| panic!("no ppl in {v}"))
}

pub fn llama_ppl(bin: &Path, model: &Path, text: &Path) -> f64 {
    let out = run(Command::new(bin.join("llama-perplexity")).args([
        "-m",
        model.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "-c",
        "128",
        "-b",
        "128",
        "-t",
        "2",
        // The peer build's AMX repacking faults on some VMs; loading is what is tested here.
        "--no-repack",
    ]));
    let at = out
        .find("Final estimate: PPL = ")
        .unwrap_or_else(|| panic!("no final estimate in:\n{out}"));
    out[at + 22..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The first 12,000 characters of the GPL-3 text (about 21 windows of 128 tokens), or a
/// stand-in.
pub fn text(dir: &Path) -> PathBuf {
    let full = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").unwrap_or_else(|_| {
        "The capital of France is Paris. It is known for its museums and its river. ".repeat(80)
    });
    let cut = full
        .char_indices()
        .nth(12_000)
        .map_or(full.len(), |(i, _)| i);
    let p = dir.join("text.txt");
    std::fs::write(&p, &full[..cut]).unwrap();
    p
}

pub fn assert_close(what: &str, frugal: f64, llama: f64) {
    assert_within(what, frugal, llama, 0.02);
}

/// `frugal` within `tol` (relative) of `llama`.
pub fn assert_within(what: &str, frugal: f64, llama: f64, tol: f64) {
    eprintln!("{what}: frugal {frugal:.4}, llama.cpp {llama:.4}");
    assert!(
        (frugal / llama - 1.0).abs() < tol,
        "{what}: frugal PPL {frugal} vs llama.cpp {llama}"
    );
}
