//! Replays every committed fuzz input (the seed corpus of each target and every input that
//! ever crashed one, under `fuzz/corpus/TARGET` and `fuzz/crashes/TARGET`) through the target's
//! function: each must return without a panic.

use std::path::PathBuf;

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

fn inputs(kind: &str, target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = fuzz_dir().join(kind).join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != "README.md"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect()
}

#[test]
fn every_committed_input_runs_through_its_target() {
    for (target, run) in frugal_fuzz::TARGETS {
        let seeds = inputs("corpus", target);
        assert!(!seeds.is_empty(), "no seed corpus for {target}");
        for (path, bytes) in seeds.iter().chain(&inputs("crashes", target)) {
            let r = std::panic::catch_unwind(|| run(bytes));
            assert!(r.is_ok(), "{target} panicked on {}", path.display());
        }
    }
}
