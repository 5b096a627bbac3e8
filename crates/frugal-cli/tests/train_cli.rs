//! `frugal train`, `frugal distill` and `frugal report distill` end to end on small models the
//! test writes itself: outputs load back, metadata records provenance, and bad input ends with
//! one `error:` line.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use frugal::gguf::GgufFile;
use frugal::model::synthetic::{SyntheticSpec, build};

fn frugal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args(args)
        .env("FRUGAL_HOME", "/nonexistent-frugal-home")
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "failed: {err}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn clean_error(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure; stderr {err}");
    assert!(!err.contains("panicked"), "{err}");
    let last = err
        .lines()
        .rfind(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains(needle),
        "expected {needle:?} in {err}"
    );
}

fn model(dir: &Path, name: &str, spec: SyntheticSpec) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, build(&spec)).unwrap();
    p
}

fn spec(layers: usize) -> SyntheticSpec {
    SyntheticSpec {
        n_layers: layers,
        n_embd: 32,
        n_ff: 64,
        n_head: 4,
        n_head_kv: 2,
        n_ctx: 128,
        ..Default::default()
    }
}

fn text(dir: &Path) -> PathBuf {
    let p = dir.join("text.txt");
    let t = "Distillation trains a small model to imitate a large one. Soft targets carry what hard labels do not. ";
    std::fs::write(&p, t.repeat(12)).unwrap();
    p
}

#[test]
fn train_and_distill_write_models_that_load_with_provenance() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let teacher = model(d, "teacher.gguf", spec(4));
    let data = text(d);
    let s = |p: &Path| p.display().to_string();
    // Plain training, quantized output.
    let tuned = d.join("tuned.gguf");
    let out = frugal(&[
        "train",
        "-m",
        &s(&teacher),
        "--data",
        &s(&data),
        "--tokens",
        "512",
        "--seq",
        "32",
        "--batch",
        "2",
        "--out",
        &s(&tuned),
        "--type",
        "q8_0",
        "--json",
    ]);
    let summary: serde_json::Value = serde_json::from_str(ok(&out).trim()).unwrap();
    assert!(
        summary["heldout_end"]["ppl"].as_f64().unwrap()
            < summary["heldout_start"]["ppl"].as_f64().unwrap()
    );
    let f = GgufFile::open(&tuned).unwrap();
    assert_eq!(f.str("frugal.train.mode").unwrap(), "train");
    // The default rate is probed from 3e-4 down, and the choice is recorded.
    let lr = f.get("frugal.train.lr").and_then(|v| v.as_f64()).unwrap();
    assert!(lr > 0.0 && lr <= f64::from(3e-4f32), "{lr}");
    assert!(
        f.tensors()
            .iter()
            .any(|t| t.ty == frugal::quant::GgmlType::Q8_0)
    );

    // Distillation into two kept layers, with the teacher online, then from a cached top-k.
    let student = d.join("student.gguf");
    let out = frugal(&[
        "distill",
        "--teacher",
        &s(&teacher),
        "--student",
        "keep-layers:2",
        "--data",
        &s(&data),
        "--tokens",
        "1024",
        "--seq",
        "32",
        "--batch",
        "2",
        "--temperature",
        "2",
        "--out",
        &s(&student),
        "--json",
    ]);
    let summary: serde_json::Value = serde_json::from_str(ok(&out).trim()).unwrap();
    let (k0, k1) = (
        summary["heldout_start"]["kl"].as_f64().unwrap(),
        summary["heldout_end"]["kl"].as_f64().unwrap(),
    );
    assert!(k1 < k0, "KL {k0} -> {k1}");
    let f = GgufFile::open(&student).unwrap();
    assert_eq!(f.u32("llama.block_count").unwrap(), 2);
    assert_eq!(f.u64_or_u32("frugal.train.tokens"), 1024);
    assert!(f.str("frugal.train.loss").unwrap().contains("tau=2"));
    assert_eq!(
        f.str_array("frugal.train.teachers").unwrap()[0],
        frugal::fetch::sha256_file(&teacher).unwrap()
    );
    let cache = d.join("t.topk");
    let out = frugal(&[
        "distill",
        "--teacher",
        &s(&teacher),
        "--student",
        &s(&student),
        "--data",
        &s(&data),
        "--tokens",
        "256",
        "--seq",
        "32",
        "--batch",
        "2",
        "--topk",
        "16",
        "--teacher-cache",
        &s(&cache),
        "--out",
        &s(&d.join("s2.gguf")),
        "--json",
    ]);
    ok(&out);
    assert!(cache.exists());
    // Ensemble of two teachers into a student of another architecture, with a hidden-state term.
    let cfg = d.join("student.json");
    std::fs::write(
        &cfg,
        r#"{"n_layers": 2, "n_embd": 16, "n_ff": 32, "n_head": 2, "n_head_kv": 1}"#,
    )
    .unwrap();
    let other = model(d, "teacher2.gguf", SyntheticSpec { seed: 9, ..spec(3) });
    let out = frugal(&[
        "distill",
        "--teacher",
        &s(&teacher),
        "--teacher",
        &s(&other),
        "--student",
        &format!("config:{}", s(&cfg)),
        "--hidden-loss",
        "0.5",
        "--data",
        &s(&data),
        "--tokens",
        "256",
        "--seq",
        "32",
        "--batch",
        "2",
        "--out",
        &s(&d.join("s3.gguf")),
        "--json",
    ]);
    ok(&out);
    assert_eq!(
        GgufFile::open(d.join("s3.gguf"))
            .unwrap()
            .u32("llama.embedding_length")
            .unwrap(),
        16
    );
    // Self-distillation with no corpus: the teacher's own samples.
    let out = frugal(&[
        "distill",
        "--teacher",
        &s(&teacher),
        "--student",
        "self",
        "--samples",
        "4",
        "--tokens",
        "128",
        "--seq",
        "32",
        "--batch",
        "2",
        "--out",
        &s(&d.join("s4.gguf")),
        "--json",
    ]);
    ok(&out);
}

trait U64OrU32 {
    fn u64_or_u32(&self, k: &str) -> u64;
}

impl U64OrU32 for GgufFile {
    fn u64_or_u32(&self, k: &str) -> u64 {
        self.get(k).and_then(|v| v.as_int()).unwrap_or(-1) as u64
    }
}

#[test]
fn bad_distillation_input_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let teacher = model(d, "teacher.gguf", spec(2));
    let data = text(d);
    let s = |p: &Path| p.display().to_string();
    let out = d.join("o.gguf");
    // A student of another vocabulary.
    let alien = {
        let f = GgufFile::open(&teacher).unwrap();
        let mut wr = frugal::gguf::GgufWriter::from_file(&f);
        let toks: Vec<String> = (0..300).map(|i| format!("t{i}")).collect();
        wr.set(
            "tokenizer.ggml.tokens",
            frugal::gguf::Value::Array(frugal::gguf::Array::String(toks)),
        );
        wr.metadata
            .retain(|(k, _)| k != "tokenizer.ggml.token_type");
        for t in &mut wr.tensors {
            if t.name == "token_embd.weight" {
                t.dims = vec![32, 300];
                t.data = std::borrow::Cow::Owned(vec![0u8; 32 * 300 * 4]);
            }
        }
        let p = d.join("alien.gguf");
        wr.write_file(&p).unwrap();
        p
    };
    let base = [
        "--data",
        &s(&data),
        "--tokens",
        "64",
        "--seq",
        "16",
        "--batch",
        "1",
        "--out",
        &s(&out),
    ];
    let teacher_s = s(&teacher);
    let run = |extra: &[&str]| {
        let mut a: Vec<&str> = vec!["distill", "--teacher", &teacher_s];
        a.extend_from_slice(extra);
        a.extend_from_slice(&base);
        frugal(&a)
    };
    clean_error(&run(&["--student", &s(&alien)]), "vocabulary");
    // A config that does not fit names the shapes.
    let cfg = d.join("bad.json");
    std::fs::write(&cfg, r#"{"n_head": 5, "n_head_kv": 2}"#).unwrap();
    clean_error(
        &run(&["--student", &format!("config:{}", s(&cfg))]),
        "5 query heads",
    );
    std::fs::write(&cfg, r#"{"n_layers": 2, "depth": 3}"#).unwrap();
    clean_error(
        &run(&["--student", &format!("config:{}", s(&cfg))]),
        "unknown field",
    );
    clean_error(
        &run(&["--student", "keep-layers:9"]),
        "the teacher has 2 layers",
    );
    clean_error(&run(&["--student", "nonsense"]), "not keep-layers:N");
    clean_error(
        &run(&[
            "--student",
            "self",
            "--reverse-kl",
            "--topk",
            "4",
            "--teacher-cache",
            &s(&d.join("c.topk")),
        ]),
        "reverse KL",
    );
    clean_error(&run(&["--student", "self", "--alpha", "1.5"]), "--alpha");
    for bad in ["auto:0", "auto3e-4", "fast", "0", "NaN"] {
        clean_error(&run(&["--student", "self", "--lr", bad]), "--lr");
    }
    // Resuming a checkpoint of another run is refused.
    let ck = d.join("run.ckpt");
    let args = |seed: &str| {
        vec![
            "train".to_string(),
            "-m".into(),
            s(&teacher),
            "--data".into(),
            s(&data),
            "--tokens".into(),
            "64".into(),
            "--seq".into(),
            "16".into(),
            "--batch".into(),
            "1".into(),
            "--out".into(),
            s(&out),
            "--checkpoint".into(),
            s(&ck),
            "--resume".into(),
            "--seed".into(),
            seed.into(),
        ]
    };
    let a0 = args("0");
    ok(&frugal(&a0.iter().map(String::as_str).collect::<Vec<_>>()));
    // Resumed, a probed run takes the rate its checkpoint holds instead of probing again.
    let again = frugal(&a0.iter().map(String::as_str).collect::<Vec<_>>());
    ok(&again);
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        err.contains("resumed from") && !err.contains("probing"),
        "{err}"
    );
    let a1 = args("1");
    clean_error(
        &frugal(&a1.iter().map(String::as_str).collect::<Vec<_>>()),
        "another configuration",
    );
    // No data for plain training.
    clean_error(
        &frugal(&["train", "-m", &s(&teacher), "--out", &s(&out)]),
        "--data",
    );
}

#[test]
fn report_distill_writes_the_document() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let teacher = model(d, "teacher.gguf", spec(6));
    let data = text(d);
    let s = |p: &Path| p.display().to_string();
    let docs = d.join("docs");
    let out = frugal(&[
        "report",
        "distill",
        "-m",
        &s(&teacher),
        "--data",
        &s(&data),
        "--tokens",
        "512",
        "--seq",
        "16",
        "--batch",
        "2",
        "--points",
        "2",
        "--eval-windows",
        "2",
        "--topk",
        "8",
        "--ensemble-tokens",
        "128",
        "--out",
        &s(&docs),
    ]);
    ok(&out);
    let md = std::fs::read_to_string(docs.join("distillation.md")).unwrap();
    for needle in [
        "| student, as cut |",
        "hard labels",
        "τ = 1",
        "τ = 4",
        "cached top-8",
        "ensemble",
        "other architecture",
        "decode speed-up",
        "Kept: `[",
    ] {
        assert!(md.contains(needle), "{needle:?} missing from:\n{md}");
    }
}
