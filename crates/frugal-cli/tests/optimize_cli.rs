//! `frugal optimize`'s outputs beside `frontier.json`: the chart (`frontier.svg`) and the page
//! (`frontier.html`), from a real search on a small model the test writes and from a
//! hand-made state whose keys need escaping.

use std::path::Path;
use std::process::{Command, Output};

use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::GgmlType;
use frugal_lab::optimize::recipe::{BaseId, Lever, Recipe, Runtime, Stage, VERSION};
use frugal_lab::optimize::target::Objective;
use frugal_lab::optimize::{Config, Funnel, Point, Rung, SpeedPoint, State};
use frugal_lab::quality::Quality;
use frugal_lab::size::Memory;

fn frugal(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_frugal"))
        .args(args)
        .env("FRUGAL_HOME", "/nonexistent-frugal-home")
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "stdout:\n{so}\nstderr:\n{se}");
    if font() {
        assert!(!se.contains("warning: "), "{se}");
    }
    so.into_owned()
}

/// Charts need a system font (as the other chart tests): where there is none, only the page
/// is checked.
fn font() -> bool {
    std::env::var_os("FRUGAL_FONT").is_some()
        || Path::new("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf").exists()
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// `s` as XML text (what the SVG and the page must contain for a key).
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A real search through the command: a fresh run writes the chart and the page beside
/// `frontier.json`, naming the chosen point, and `--resume` writes them again.
#[test]
fn optimize_run_writes_the_frontier_chart_and_page() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("base.gguf");
    std::fs::write(
        &model,
        build(&SyntheticSpec {
            n_layers: 1,
            n_embd: 256,
            n_ff: 256,
            n_head: 4,
            n_head_kv: 2,
            n_ctx: 512,
            ty: GgmlType::F32,
            ..Default::default()
        }),
    )
    .unwrap();
    let text = dir.path().join("text.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over 12345 lazy dogs; ".repeat(80),
    )
    .unwrap();
    let out = dir.path().join("run");
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let args = [
        "optimize",
        "-m",
        &s(&model),
        "--calibration",
        &s(&text),
        "--eval",
        &s(&text),
        "--target",
        "kl <= 10",
        "--objective",
        "memory",
        "--levers",
        "quant",
        "--rungs",
        "256",
        "--out",
        &s(&out),
    ];
    let stdout = ok(&frugal(&args));
    let state = State::read(&out).unwrap();
    let chosen = state.chosen.clone().expect("a point meets kl <= 10");
    let check = |stdout: &str| {
        let html = read(&out.join("frontier.html"));
        assert!(html.contains(&esc(&chosen)), "{html}");
        assert!(html.contains("<td class=\"key\">"), "{html}");
        let rows = html.matches("<tr class=").count();
        assert_eq!(rows, state.points.len(), "one row per point");
        if font() {
            assert!(
                stdout.contains("frontier.svg and ") && stdout.contains("frontier.html"),
                "{stdout}"
            );
            let svg = read(&out.join("frontier.svg"));
            assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
            assert!(svg.contains(&esc(&chosen)), "the chosen key in the SVG");
            assert!(html.contains("<svg"), "the chart inline in the page");
        }
    };
    check(&stdout);
    std::fs::remove_file(out.join("frontier.html")).unwrap();
    let _ = std::fs::remove_file(out.join("frontier.svg"));
    let stdout = ok(&frugal(&["optimize", "--resume", &s(&out)]));
    check(&stdout);
}

fn quality(kl: f64) -> Vec<Rung> {
    vec![Rung {
        tokens: 512,
        quality: Quality {
            ppl: 10.0 * (1.0 + kl),
            ppl_stderr: 0.1,
            base_ppl: 10.0,
            kl_mean: kl,
            kl_stderr: kl * 0.05,
            kl_p99: kl * 6.0,
            top1: 0.97 - kl.min(0.5),
            positions: 256,
        },
    }]
}

/// A point: `kl` None for one never measured, `decode` its ratio to the base when timed.
fn point(
    format: &str,
    keep: &[&str],
    kv: &str,
    bpw: f64,
    kl: Option<f64>,
    decode: Option<f64>,
) -> Point {
    let recipe = Recipe {
        stages: vec![Stage::Quant {
            format: format.to_string(),
            keep: keep.iter().map(|k| k.to_string()).collect(),
            imatrix: false,
        }],
        runtime: Runtime {
            kv: kv.parse().unwrap(),
            ..Runtime::default()
        },
    };
    let weights = (bpw * 1e8 / 8.0) as u64;
    Point {
        key: recipe.key(),
        recipe,
        bpw,
        weight_bytes: weights,
        memory: kl.map(|_| Memory {
            weights,
            kv: if kv == "q8_0" { 10 << 20 } else { 40 << 20 },
        }),
        predicted_kl: None,
        quality: kl.map(quality).unwrap_or_default(),
        speed: decode.map(|r| SpeedPoint {
            decode: 40.0 * r,
            prefill: 0.0,
            decode_ratio: r,
            prefill_ratio: 1.0,
            base_decode: 40.0,
            base_prefill: 0.0,
        }),
        build_seconds: 0.1,
        dropped: None,
        pareto: false,
        feasible: None,
    }
}

fn synthetic_state(model: &Path) -> State {
    let mut f16 = point("f16", &[], "f32", 16.0, Some(0.0), None);
    f16.pareto = true;
    f16.dropped = Some("halved: behind the Pareto layers kept".to_string());
    let mut q8 = point("q8_0", &[], "f32", 8.5, Some(0.002), None);
    q8.dropped = Some("dominated by q4_k | kv f32 | act q8".to_string());
    let mut chosen = point("q4_k", &["a<b&c=q8_0"], "q8_0", 4.9, Some(0.03), Some(5.6));
    chosen.pareto = true;
    let slow = point("q4_k", &[], "f32", 4.6, Some(0.028), Some(4.2));
    let mut q2 = point("q2_k", &[], "f32", 2.6, Some(1.6), None);
    q2.pareto = true;
    q2.dropped = Some("cannot meet kl <= 0.05".to_string());
    let mut never = point("q3_k", &[], "q8_0", 3.4, None, None);
    never.dropped = Some("cannot run: heads <64> & more".to_string());
    State {
        frugal_version: VERSION.to_string(),
        config: Config {
            model: model.to_path_buf(),
            calibration: model.to_path_buf(),
            eval: model.to_path_buf(),
            targets: ["decode >= 5x", "kl <= 0.05", "memory <= 200MiB"]
                .iter()
                .map(|t| t.parse().unwrap())
                .collect(),
            objective: Objective::Decode,
            context: 4096,
            budget_seconds: 60.0,
            levers: vec![Lever::Quant, Lever::Kv],
            funnel: Funnel::default(),
            prompts: None,
        },
        base: BaseId::of(model).unwrap(),
        refused: Vec::new(),
        gates: Vec::new(),
        speculation: Vec::new(),
        sensitivity: Vec::new(),
        chosen: Some(chosen.key.clone()),
        points: vec![f16, q8, chosen, slow, q2, never],
        binding: Vec::new(),
        closest: Vec::new(),
        warnings: vec!["KL of a & b differ by less than the noise".to_string()],
        status: "done".to_string(),
    }
}

/// `--chart DIR` draws from `frontier.json` alone: keys with `<` and `&` are escaped in the
/// page and the SVG, every point has a row, the speed panel is there only when some point was
/// timed, and a state with no chosen point names the binding constraint instead.
#[test]
fn optimize_chart_escapes_keys_and_follows_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("base.gguf");
    std::fs::write(&model, b"not read: only hashed").unwrap();
    let mut state = synthetic_state(&model);
    let key = state.chosen.clone().unwrap();
    assert!(key.contains("a<b&c"), "{key}");
    state.write(dir.path()).unwrap();
    let d = dir.path().to_str().unwrap();
    let stdout = ok(&frugal(&["optimize", "--chart", d]));

    let html = read(&dir.path().join("frontier.html"));
    assert!(!html.contains("a<b&c"), "an unescaped key in the page");
    assert!(!html.contains("<64>"), "an unescaped reason in the page");
    assert!(html.contains(&format!("<code class=\"chosen\">{}</code>", esc(&key))));
    let chosen_row = format!(
        "<tr class=\"chosen frontier\"><td class=\"key\">{}</td>",
        esc(&key)
    );
    assert!(html.contains(&chosen_row), "{html}");
    assert_eq!(html.matches("<tr class=").count(), state.points.len());
    for needle in [
        "decode &gt;= 5x",
        "kl &lt;= 0.05",
        "memory &lt;= 200MiB",
        "a &amp; b differ",
        "cannot run: heads &lt;64&gt; &amp; more",
        "5.60x",
        "--kv-type q8_0",
    ] {
        assert!(html.contains(needle), "{needle:?} not in the page");
    }
    if font() {
        assert!(stdout.contains("frontier.svg and "), "{stdout}");
        let svg = read(&dir.path().join("frontier.svg"));
        assert!(!svg.contains("a<b&c"), "an unescaped key in the SVG");
        for needle in [
            esc(&key).as_str(),
            "decode speed",
            "bits per weight",
            "below 1e-5 drawn at 1e-5",
            "kl &lt;= 0.05",
            "decode &gt;= 5x",
            "\nchosen\n",
            "memory, MiB",
        ] {
            assert!(svg.contains(needle), "{needle:?} not in the SVG");
        }
        assert!(html.contains("<svg"), "the chart inline in the page");
    }

    // Nothing timed, nothing chosen: one panel, and the page says what binds.
    for p in &mut state.points {
        p.speed = None;
    }
    state.chosen = None;
    state.binding = vec!["decode >= 5x binds: not timed <yet>".to_string()];
    state.write(dir.path()).unwrap();
    ok(&frugal(&["optimize", "--chart", d]));
    let html = read(&dir.path().join("frontier.html"));
    assert!(html.contains("No point meets every target"), "{html}");
    assert!(html.contains("not timed &lt;yet&gt;"), "{html}");
    assert!(!html.contains("class=\"chosen"), "{html}");
    if font() {
        let svg = read(&dir.path().join("frontier.svg"));
        assert!(
            !svg.contains("decode speed"),
            "a speed panel with nothing timed"
        );
        assert!(svg.contains("bits per weight"));
        assert!(svg.contains("no point meets every target"));
    }

    // No frontier.json: one clean error.
    let empty = tempfile::tempdir().unwrap();
    let out = frugal(&["optimize", "--chart", empty.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.starts_with("error: ") && err.contains("frontier.json"),
        "{err}"
    );
}
