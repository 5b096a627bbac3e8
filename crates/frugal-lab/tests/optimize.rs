//! `frugal optimize` on small random F32 models the tests build themselves: the allocation, the
//! funnel, resuming, recipes and unreachable targets. Funnels are tiny (tens of tokens) so the
//! whole file runs in seconds.

use std::path::{Path, PathBuf};

use frugal::gguf::{GgufFile, GgufWriter};
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::quant::GgmlType;
use frugal::tokenizer::Tokenizer;
use frugal_lab::optimize::quant::{self, Bank, Costs, Mix};
use frugal_lab::optimize::recipe::{Lever, Recipe, Runtime};
use frugal_lab::optimize::search::{self, Progress};
use frugal_lab::optimize::target::Objective;
use frugal_lab::optimize::{Config, Funnel, State, rebuild};
use frugal_lab::{build as lab_build, quality};

const TEXT: &str = "Every lever has a price, and frugal measures it. A cache saves work; a cache \
costs memory. Fewer weights cost quality, and training buys some of it back. ";
const HELD: &str = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun; \
numbers like 12345 and 67890 and words in other orders keep the evaluation honest. ";

/// Matrices 256 wide, so that every K-quant tiles its rows (no fallbacks); the final norm
/// scaled down so that the random model's next-token distributions are soft (as a trained
/// model's are) and rounding moves them measurably.
fn model(seed: u64) -> Vec<u8> {
    model_with_ffn(seed, 512)
}

fn model_with_ffn(seed: u64, n_ff: usize) -> Vec<u8> {
    let bytes = build(&SyntheticSpec {
        n_layers: 2,
        n_embd: 256,
        n_ff,
        n_head: 4,
        n_head_kv: 2,
        n_ctx: 128,
        ty: GgmlType::F32,
        seed,
        ..Default::default()
    });
    let file = GgufFile::from_bytes(bytes).unwrap();
    let mut w = GgufWriter::from_file(&file);
    let norm = w
        .tensors
        .iter_mut()
        .find(|t| t.name == "output_norm.weight")
        .unwrap();
    let scaled: Vec<u8> = norm
        .data
        .chunks_exact(4)
        .flat_map(|b| (f32::from_le_bytes(b.try_into().unwrap()) * 0.05).to_le_bytes())
        .collect();
    norm.data = scaled.into();
    w.to_bytes().unwrap()
}

struct Files {
    _dir: tempfile::TempDir,
    root: PathBuf,
    model: PathBuf,
}

fn files() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let model = root.join("base.gguf");
    std::fs::write(&model, model_bytes()).unwrap();
    std::fs::write(root.join("cal.txt"), TEXT.repeat(6)).unwrap();
    std::fs::write(root.join("held.txt"), HELD.repeat(6)).unwrap();
    Files {
        _dir: dir,
        root,
        model,
    }
}

fn model_bytes() -> Vec<u8> {
    model(1)
}

fn config(f: &Files, targets: &[&str]) -> Config {
    Config {
        model: f.model.clone(),
        calibration: f.root.join("cal.txt"),
        eval: f.root.join("held.txt"),
        targets: targets.iter().map(|t| t.parse().unwrap()).collect(),
        objective: Objective::Decode,
        context: 128,
        budget_seconds: 600.0,
        levers: vec![Lever::Quant, Lever::Kv],
        funnel: Funnel {
            ctx: 32,
            calibration_tokens: 128,
            rungs: vec![64, 128],
            bands: 1,
            bpw_step: 1.0,
            runtime_variants: 2,
            prompt: 0,
            gen_tokens: 4,
            rounds: 1,
            max_evaluations: None,
            prune_tokens: 128,
            structural_variants: 2,
            prune_reward: frugal_lab::optimize::prune::REWARD,
            distill_tokens: 4096,
            distill_candidates: 1,
            speculate_reward: frugal_lab::optimize::speculate::REWARD,
        },
        prompts: None,
    }
}

fn run(c: Config, dir: &Path, resume: Option<State>) -> search::Outcome {
    search::run(c, dir, resume, &mut |_: Progress| {}).unwrap()
}

/// Sensitivity-allocated mixes against the uniform formats: the mix meets its bit budget, is
/// the exact file its recipe rebuilds, and (measured) has a lower KL than the uniform format
/// of the same or larger size.
#[test]
fn allocation_meets_the_budget_and_beats_the_uniform_format_of_its_size() {
    let base_file = GgufFile::from_bytes(model_bytes()).unwrap();
    let base = lab_build::load(model_bytes(), false).unwrap();
    let tok = Tokenizer::from_gguf(&base.file).unwrap();
    let calib = tok.encode(&TEXT.repeat(6), false).unwrap();
    let held = tok.encode(&HELD.repeat(6), false).unwrap();
    let palette = [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q2_K];
    let mut bank = Bank::new();
    for t in palette {
        bank.add(&base_file, t).unwrap();
    }
    let groups = quant::groups(&base_file, 2);
    assert!(groups.len() >= 8, "{groups:?}");
    let kl_of = |mix: &Mix, tokens: &[u32]| {
        let m = lab_build::load(bank.assemble(mix).unwrap(), false).unwrap();
        quality::against(&m, &base, &tokens[..tokens.len() / 32 * 32], 32)
            .unwrap()
            .kl_mean
    };
    // Sensitivity: each group alone at Q4_K, the rest at Q8_0.
    let reference = kl_of(&Mix::uniform(GgmlType::Q8_0), &calib);
    let sens: Vec<f64> = groups
        .iter()
        .map(|g| {
            let mut mix = Mix::uniform(GgmlType::Q8_0);
            for t in &g.tensors {
                mix.per_tensor.insert(t.clone(), GgmlType::Q4_K);
            }
            (kl_of(&mix, &calib) - reference).max(0.0)
        })
        .collect();
    let noise: Vec<Vec<f64>> = palette
        .iter()
        .map(|&t| quant::group_noise(&base_file, &bank, &groups, t).unwrap())
        .collect();
    let bits = quant::group_bits(&bank, &groups, &palette);
    let costs = Costs::new(palette.to_vec(), bits, &sens, &noise, 1);
    // The budget of uniform Q4_K (its embedding at Q8_0, as `frugal quantize` writes it).
    let uniform = Mix::uniform(GgmlType::Q4_K);
    let uniform_choice: Vec<usize> = groups
        .iter()
        .map(|g| {
            let t = uniform.format_of(&g.tensors[0]);
            palette.iter().position(|&p| p == t).unwrap()
        })
        .collect();
    let budget = costs.bits_of(&uniform_choice);
    let choice = quant::allocate(&costs, budget).unwrap();
    assert!(costs.bits_of(&choice) <= budget);
    assert!(costs.kl_of(&choice) <= costs.kl_of(&uniform_choice) + 1e-12);
    assert!(
        quant::allocate(&costs, 1.0).is_none(),
        "nothing fits one bit"
    );
    let formats: Vec<GgmlType> = choice.iter().map(|&i| palette[i]).collect();
    let mix = Mix::from_groups(&groups, &formats);

    // The assembled mix is the file its recipe stage writes.
    let assembled = bank.assemble(&mix).unwrap();
    let recipe = Recipe {
        stages: vec![mix.stage(&base_file)],
        runtime: Runtime::default(),
    };
    let rebuilt = recipe.build(&base_file, &Default::default()).unwrap();
    assert_eq!(assembled, rebuilt.raw_bytes(), "{}", recipe.key());
    let size = |b: &[u8]| {
        GgufFile::from_bytes(b.to_vec())
            .unwrap()
            .tensors()
            .iter()
            .map(|t| t.n_bytes())
            .sum::<u64>()
    };
    let uniform_bytes = bank.assemble(&uniform).unwrap();
    assert!(size(&assembled) <= size(&uniform_bytes));

    // Measured on held-out text, the mix has the lower KL.
    let (kl_mix, kl_uniform) = (kl_of(&mix, &held), kl_of(&uniform, &held));
    assert!(
        kl_mix < kl_uniform,
        "mix {kl_mix} ({}) vs uniform q4_k {kl_uniform}",
        recipe.key()
    );
}

/// One search: the funnel drops dominated points before timing them and times only
/// contenders; the recipe rebuilds the model byte for byte and is refused for another base;
/// resuming a finished search evaluates nothing.
#[test]
fn search_funnel_recipe_and_resume() {
    let f = files();
    let dir = f.root.join("opt");
    let out = run(config(&f, &["kl <= 0.5"]), &dir, None);
    let s = State::read(&dir).unwrap();
    assert_eq!(s.chosen, out.state.chosen);
    assert_eq!(s.points.len(), out.state.points.len());
    assert_eq!(s.status, "done");
    assert!(out.evaluations > 10, "{}", out.evaluations);
    let dominated: Vec<_> = s
        .points
        .iter()
        .filter(|p| {
            p.dropped
                .as_deref()
                .is_some_and(|d| d.starts_with("dominated"))
        })
        .collect();
    assert!(!dominated.is_empty(), "no point dropped as dominated");
    for p in &s.points {
        if p.dropped.is_some() {
            assert!(p.speed.is_none(), "a dropped point was timed: {}", p.key);
        }
    }
    // Every dominated point's dominator is cheaper or equal on every cost.
    for p in &dominated {
        let by = p
            .dropped
            .as_deref()
            .unwrap()
            .trim_start_matches("dominated by ");
        let a = s.point(by).unwrap();
        assert!(a.weight_bytes <= p.weight_bytes, "{} vs {}", a.key, p.key);
    }
    let timed = s.points.iter().filter(|p| p.speed.is_some()).count();
    assert!(timed >= 1 && timed < s.points.len() / 3, "{timed} timed");
    let chosen = s.chosen.clone().expect("a point meets kl <= 0.5");
    assert!(s.point(&chosen).unwrap().feasible == Some(true));
    assert!(s.points.iter().any(|p| p.pareto));

    // The recipe rebuilds the same bytes.
    let built = std::fs::read(dir.join("model.gguf")).unwrap();
    let again = f.root.join("again");
    rebuild(&dir.join("recipe.toml"), None, None, &again).unwrap();
    assert_eq!(std::fs::read(again.join("model.gguf")).unwrap(), built);

    // ... and is refused by a build whose encoders round differently.
    let mut other_build =
        frugal_lab::optimize::recipe::RecipeFile::read(&dir.join("recipe.toml")).unwrap();
    assert_eq!(
        other_build.encoders.as_deref(),
        Some(frugal_lab::optimize::recipe::encoder_fingerprint())
    );
    other_build.encoders = Some("0123456789abcdef".into());
    other_build.write(&f.root.join("other-build.toml")).unwrap();
    let e = rebuild(
        &f.root.join("other-build.toml"),
        None,
        None,
        &f.root.join("y"),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("round differently"), "{e:#}");

    // ... and is refused for another base.
    let other = f.root.join("other.gguf");
    std::fs::write(&other, model(2)).unwrap();
    let e = rebuild(
        &dir.join("recipe.toml"),
        Some(&other),
        None,
        &f.root.join("x"),
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("another base model"), "{e:#}");

    // Resuming a finished search redoes nothing.
    let s2 = run(s.config.clone(), &dir, Some(s.clone()));
    assert_eq!(s2.evaluations, 0);
    assert_eq!(s2.state.chosen, s.chosen);
}

/// A run killed after a few evaluations resumes without redoing them: the two runs together
/// make exactly the evaluations of one uninterrupted run.
#[test]
fn a_stopped_search_resumes_without_redoing_finished_candidates() {
    let f = files();
    // Memory as the objective: no timing, so every evaluation is deterministic.
    let mut c = config(&f, &["kl <= 0.5"]);
    c.objective = Objective::Memory;
    let full = run(c.clone(), &f.root.join("full"), None);
    let mut stopped = c.clone();
    stopped.funnel.max_evaluations = Some(12);
    let dir = f.root.join("part");
    let first = run(stopped, &dir, None);
    assert_eq!(first.evaluations, 12);
    assert_eq!(first.state.status, "evaluation limit");
    let second = run(c, &dir, Some(State::read(&dir).unwrap()));
    assert_eq!(first.evaluations + second.evaluations, full.evaluations);
    assert_eq!(second.state.chosen, full.state.chosen);
}

/// Targets no point meets: the binding constraint is named, the closest points returned, the
/// frontier still written.
#[test]
fn unreachable_targets_name_the_binding_constraint() {
    let f = files();
    let dir = f.root.join("opt");
    let mut c = config(&f, &["kl <= 10", "memory <= 1KiB"]);
    c.objective = Objective::Memory;
    let out = run(c, &dir, None);
    let s = out.state;
    assert_eq!(s.chosen, None);
    assert!(
        s.binding.iter().any(|b| b.starts_with("memory <= ")),
        "{:?}",
        s.binding
    );
    assert!(!s.closest.is_empty());
    assert!(dir.join("frontier.json").exists());
    assert!(!dir.join("model.gguf").exists());
}

/// The pruning stage with every cut taken (reward 0, so the decisions do not depend on
/// timing): each cut is timed against its dense twin, built before and after quantization,
/// and measured; structured cuts shrink the weights, a 2:4 cut in a compressed type is smaller
/// than its dense twin; the chosen pruned model is the file `--recipe` rebuilds from the
/// recorded calibration, and another calibration text is refused.
#[test]
fn prune_stage_builds_both_orders_and_rebuilds_byte_for_byte() {
    let f = files();
    let dir = f.root.join("opt");
    let mut c = config(&f, &["kl <= 10"]);
    c.levers = vec![Lever::Prune, Lever::Quant, Lever::Kv];
    c.objective = Objective::Memory;
    c.funnel.prune_reward = 0.0;
    let out = run(c.clone(), &dir, None);
    let s = out.state;
    // ffn:0.5 (two K-quant blocks of 512 neurons leave one), 2:4 in both compressed types,
    // half the weights unstructured; two layers are too few to drop any.
    assert_eq!(s.gates.len(), 4, "{:?}", s.gates);
    assert!(
        s.gates.iter().all(|g| g.taken && g.speedup > 0.0),
        "{:?}",
        s.gates
    );
    let point = |key: &str| {
        s.point(key)
            .unwrap_or_else(|| panic!("no point {key}: {:?}", keys(&s)))
    };
    let before = point("prune ffn:0.500000 | q8_0 | kv f32 | act q8");
    let after = point("q8_0 | prune ffn:0.500000 | kv f32 | act q8");
    let dense = point("q8_0 | kv f32 | act q8");
    assert!(before.weight_bytes < dense.weight_bytes * 4 / 5);
    assert_eq!(before.weight_bytes, after.weight_bytes);
    let sparse = point("prune wanda 2:4 | q8_0_24 | kv f32 | act q8");
    let sparse_after = point("q8_0 | prune wanda 2:4 as q8_0_24 | kv f32 | act q8");
    assert!(sparse.weight_bytes < dense.weight_bytes);
    assert_eq!(sparse.weight_bytes, sparse_after.weight_bytes);
    for p in [before, after, sparse, sparse_after] {
        assert!(
            p.latest().is_some_and(|q| q.kl_mean.is_finite()),
            "{}",
            p.key
        );
    }
    // The two orders score the cut on different activations: different weights.
    assert_ne!(
        before.latest().unwrap().kl_mean,
        after.latest().unwrap().kl_mean
    );
    // Cuts combined with the best weight recipes, in both orders.
    let combined = s
        .points
        .iter()
        .filter(|p| {
            p.key.starts_with("prune ffn") && !p.key.starts_with("prune ffn:0.500000 | q8_0 |")
        })
        .count();
    assert!(combined >= 1, "{:?}", keys(&s));

    // Memory as the objective: a pruned point is chosen, and `--recipe` rebuilds its bytes.
    let chosen = s.chosen.clone().expect("kl <= 10 is met");
    assert!(chosen.contains("prune"), "{chosen}");
    let built = std::fs::read(dir.join("model.gguf")).unwrap();
    let again = f.root.join("again");
    let r = rebuild(&dir.join("recipe.toml"), None, None, &again).unwrap();
    assert!(r.calibration.is_some());
    assert_eq!(std::fs::read(again.join("model.gguf")).unwrap(), built);
    let other = f.root.join("other.txt");
    std::fs::write(&other, HELD.repeat(6)).unwrap();
    let e = rebuild(
        &dir.join("recipe.toml"),
        None,
        Some(&other),
        &f.root.join("x"),
    )
    .unwrap_err();
    assert!(
        format!("{e:#}").contains("not the calibration text"),
        "{e:#}"
    );

    // Resuming replays the gates rather than timing again.
    let s2 = run(c, &dir, Some(State::read(&dir).unwrap()));
    assert_eq!(s2.evaluations, 0);
    assert_eq!(s2.state.chosen, s.chosen);
}

/// A cut this CPU does not reward (here: a reward no cut can show) is recorded with its
/// measured speed-up and builds no candidate.
#[test]
fn unrewarded_cuts_are_timed_and_not_taken() {
    let f = files();
    let mut c = config(&f, &["kl <= 10"]);
    c.levers = vec![Lever::Prune, Lever::Quant];
    c.objective = Objective::Memory;
    c.funnel.prune_reward = 1e6;
    let s = run(c, &f.root.join("opt"), None).state;
    assert_eq!(s.gates.len(), 4);
    for g in &s.gates {
        assert!(!g.taken && g.speedup > 0.0, "{g:?}");
        assert!(g.reason.contains("not taken"), "{}", g.reason);
    }
    assert!(s.points.iter().all(|p| !p.key.contains("prune")));
}

fn keys(s: &State) -> Vec<&str> {
    s.points.iter().map(|p| p.key.as_str()).collect()
}

/// The composition matrix measured on a small model: every planned row is built and measured
/// (or skipped with a reason), the KV-only row keeps the base's weights, and a cut shrinks
/// them.
#[test]
fn composition_matrix_measures_its_rows() {
    use frugal_lab::optimize::composition::{self, Setup};
    let f = files();
    let file = GgufFile::open(&f.model).unwrap();
    let c = frugal::model::Config::from_gguf(&file).unwrap();
    let plan = composition::plan(&c, None, &composition::PlanOptions { distill_tokens: 0 });
    let setup = Setup {
        model: f.model.clone(),
        calibration: f.root.join("cal.txt"),
        eval: f.root.join("held.txt"),
        eval_tokens: 64,
        ctx: 32,
        prune_tokens: 64,
        context: 128,
        rounds: 1,
        gen_tokens: 2,
        chosen: None,
    };
    let (rows, skipped) = composition::measure(&setup, &plan, &mut |_| {}).unwrap();
    assert_eq!(rows.len() + skipped.len(), plan.len(), "{skipped:?}");
    assert!(rows.len() >= plan.len() - 1, "{skipped:?}");
    let base_bytes: u64 = file.tensors().iter().map(|t| t.n_bytes()).sum();
    let kv = rows.iter().find(|r| r.name == "kv q8_0").unwrap();
    assert_eq!(kv.weight_bytes, base_bytes);
    let q8 = rows.iter().find(|r| r.name == "q8_0").unwrap();
    let cut = rows
        .iter()
        .find(|r| r.name.starts_with("prune ffn") && r.name.ends_with("then q8_0"))
        .unwrap();
    assert!(cut.weight_bytes < q8.weight_bytes);
    for r in &rows {
        assert!(
            r.quality.kl_mean.is_finite() && r.decode_ratio > 0.0,
            "{}",
            r.name
        );
    }
    let an = composition::analyse(&rows, 0.03, 10.0);
    // quant + kv, then prune, attention, experts and distillation in turn.
    assert_eq!(an.stages.len(), 5);
}

/// Distillation is pulled only when nothing cheaper meets every target: here no point can
/// (memory <= 1 KiB), so the cut candidates closest to the targets are distilled from the
/// base, quantized again, and measured through every rung; healing lowers their KL, and the
/// recipe rebuilds the same bytes twice (training is seeded and ordered).
#[test]
fn distillation_heals_cut_candidates_only_when_nothing_cheaper_meets_the_targets() {
    let f = files();
    std::fs::write(f.root.join("cal.txt"), TEXT.repeat(60)).unwrap();
    let mut c = config(&f, &["kl <= 10", "memory <= 1KiB"]);
    c.levers = vec![Lever::Prune, Lever::Distill, Lever::Quant];
    c.objective = Objective::Memory;
    c.funnel.prune_reward = 0.0;
    c.funnel.distill_tokens = 4096;
    c.funnel.distill_candidates = 1;
    let s = run(c.clone(), &f.root.join("opt"), None).state;
    let healed: Vec<&frugal_lab::optimize::Point> = s
        .points
        .iter()
        .filter(|p| p.key.contains("distill"))
        .collect();
    assert_eq!(healed.len(), 1, "{:?}", keys(&s));
    let h = healed[0];
    assert_eq!(h.quality.len(), c.funnel.rungs.len(), "{}", h.key);
    let twin_key = h.key.replace(" | distill 4096 tokens seed 0", "");
    let twin = s.point(&twin_key).unwrap();
    let at = |p: &frugal_lab::optimize::Point| {
        p.quality
            .iter()
            .find(|r| r.tokens == c.funnel.rungs[0])
            .unwrap()
            .quality
            .kl_mean
    };
    assert!(at(h) < at(twin), "healed {} vs cut {}", at(h), at(twin));
    let base = GgufFile::open(&f.model).unwrap();
    let tok = Tokenizer::from_gguf(&base).unwrap();
    let cal = frugal_lab::optimize::prune::Calibration {
        tokens: tok.encode(&TEXT.repeat(60), false).unwrap(),
        ctx: 32,
        cut_tokens: 128,
    };
    let a = h.recipe.build(&base, &cal).unwrap();
    let b = h.recipe.build(&base, &cal).unwrap();
    assert_eq!(a.raw_bytes(), b.raw_bytes());

    // When a cheaper point meets every target, distillation is not pulled.
    let mut easy = config(&f, &["kl <= 10"]);
    easy.levers = vec![Lever::Prune, Lever::Distill, Lever::Quant];
    easy.objective = Objective::Memory;
    easy.funnel.prune_reward = 0.0;
    let s = run(easy, &f.root.join("easy"), None).state;
    assert!(s.points.iter().all(|p| !p.key.contains("distill")));
    assert!(
        s.refused
            .iter()
            .any(|r| r.starts_with("distill: not pulled")),
        "{:?}",
        s.refused
    );
}

/// The attention stage is pulled when a memory target binds: MQA and latent layouts, each
/// with the best weight recipes, hold less KV than the same weights in the original layout;
/// without a memory target it is not pulled, and says why.
#[test]
fn attention_layouts_are_tried_when_a_memory_target_binds() {
    let f = files();
    let mut c = config(&f, &["kl <= 10", "memory <= 1KiB"]);
    c.levers = vec![Lever::Attention, Lever::Quant, Lever::Kv];
    c.objective = Objective::Memory;
    let s = run(c.clone(), &f.root.join("opt"), None).state;
    let kv = |p: &frugal_lab::optimize::Point| p.memory.unwrap().kv;
    for layout in ["mqa", "mla:64"] {
        let p = s
            .points
            .iter()
            .find(|p| p.key.starts_with(&format!("attention {layout} | ")))
            .unwrap_or_else(|| panic!("no {layout} point: {:?}", keys(&s)));
        let twin = s
            .point(p.key.trim_start_matches(&format!("attention {layout} | ")))
            .unwrap();
        assert!(kv(p) < kv(twin), "{}: {} vs {}", p.key, kv(p), kv(twin));
        assert!(p.latest().is_some_and(|q| q.kl_mean.is_finite()));
    }
    let mut easy = c;
    easy.targets = vec!["kl <= 10".parse().unwrap()];
    let s = run(easy, &f.root.join("easy"), None).state;
    assert!(s.points.iter().all(|p| !p.key.contains("attention")));
    assert!(
        s.refused
            .iter()
            .any(|r| r.contains("attention: not pulled: no memory target")),
        "{:?}",
        s.refused
    );
}

/// The speculation stage times every drafter with the chosen point on the user's prompts
/// (each trial checks that speculation kept every token), pairs the fastest over the bar (0
/// here, so one is always paired), and `recipe.toml` carries the pairing; resuming redoes no
/// trial, and a pairing with a draft model rebuilds the draft beside the model.
#[test]
fn speculation_is_timed_on_the_chosen_point_and_paired_in_the_recipe() {
    use frugal_lab::optimize::recipe::RecipeFile;
    use frugal_lab::optimize::speculate::{DRAFT_FILE, Pairing};
    let f = files();
    let dir = f.root.join("spec");
    let mut c = config(&f, &["kl <= 0.5"]);
    c.levers = vec![Lever::Quant, Lever::Kv, Lever::Speculate];
    c.funnel.speculate_reward = 0.0;
    let prompts = f.root.join("prompts.txt");
    std::fs::write(
        &prompts,
        format!("{}\n---\n{}\n---\n", &TEXT[..60], &HELD[..50]),
    )
    .unwrap();
    c.prompts = Some(prompts);
    let s = run(c, &dir, None).state;
    let chosen = s.chosen.clone().expect("a point meets kl <= 0.5");
    let names: Vec<&str> = s.speculation.iter().map(|t| t.drafter.as_str()).collect();
    assert!(
        names.starts_with(&["ngram", "self:1"]),
        "{names:?} (refused: {:?})",
        s.refused
    );
    assert!(s.speculation.iter().all(|t| t.target == chosen));
    assert!(
        s.speculation
            .iter()
            .all(|t| t.speedup > 0.0 && t.plain_tok_s > 0.0 && t.base_tok_s > 0.0)
    );
    let taken: Vec<_> = s.speculation.iter().filter(|t| t.taken).collect();
    assert_eq!(taken.len(), 1);
    let best = s.speculation.iter().map(|t| t.speedup).fold(0.0, f64::max);
    assert_eq!(taken[0].speedup, best);
    let r = RecipeFile::read(&dir.join("recipe.toml")).unwrap();
    let pairing = r.speculate.clone().expect("a pairing in the recipe");
    assert_eq!(pairing.drafter, taken[0].drafter);
    assert_eq!(pairing.draft.is_some(), dir.join(DRAFT_FILE).exists());

    // Resuming keeps the trials.
    let again = run(s.config.clone(), &dir, Some(s.clone()));
    assert_eq!(again.evaluations, 0);
    assert_eq!(again.state.speculation, s.speculation);

    // A draft pairing rebuilds the draft (the smallest point's weights) beside the model.
    let small = s
        .points
        .iter()
        .filter(|p| !p.recipe.stages.is_empty())
        .min_by_key(|p| p.weight_bytes)
        .unwrap();
    let mut with_draft = r.clone();
    with_draft.speculate = Some(Pairing {
        drafter: format!("draft:{DRAFT_FILE}"),
        draft: Some(small.recipe.clone()),
        speedup: 1.0,
    });
    let recipe = f.root.join("with-draft.toml");
    with_draft.write(&recipe).unwrap();
    let out = f.root.join("rebuilt");
    rebuild(&recipe, None, None, &out).unwrap();
    let base = GgufFile::open(&f.model).unwrap();
    let want = small
        .recipe
        .build(&base, &Default::default())
        .unwrap()
        .raw_bytes()
        .to_vec();
    assert_eq!(std::fs::read(out.join(DRAFT_FILE)).unwrap(), want);
    assert_eq!(
        std::fs::read(out.join("model.gguf")).unwrap(),
        std::fs::read(dir.join("model.gguf")).unwrap()
    );
}

/// With `moe` asked for, the FFN split into experts passes the same gate as a cut (timed
/// against its dense twin), is built before quantization only (experts split float weights),
/// is combined with the best weight recipes and measured; the recipe of an expert point
/// rebuilds its bytes through `--recipe`.
#[test]
fn experts_are_gated_built_before_quantization_and_rebuilt() {
    let f = files();
    // 768 neurons: a shared expert of 256 and 8 routed experts of 64 (a sixth leaves 640,
    // which 8 experts of whole 32-blocks do not divide: refused with the reason).
    std::fs::write(&f.model, model_with_ffn(1, 768)).unwrap();
    let dir = f.root.join("opt");
    let mut c = config(&f, &["kl <= 100"]);
    c.levers = vec![Lever::Moe, Lever::Quant];
    c.objective = Objective::Memory;
    c.funnel.prune_reward = 0.0;
    let s = run(c, &dir, None).state;
    let gates: Vec<String> = s.gates.iter().map(|g| g.cut.to_string()).collect();
    assert_eq!(gates, ["moe s256+8x2 seed 1"], "{:?}", s.gates);
    assert!(s.gates[0].taken && s.gates[0].speedup > 0.0);
    assert!(
        s.refused.iter().any(|r| r.contains("s128+8x2")),
        "{:?}",
        s.refused
    );
    let moe: Vec<&str> = keys(&s).into_iter().filter(|k| k.contains("moe")).collect();
    assert!(
        moe.contains(&"moe s256+8x2 seed 1 | q8_0 | kv f32 | act q8"),
        "{moe:?}"
    );
    assert!(
        moe.len() >= 2,
        "not combined with other weight recipes: {moe:?}"
    );
    assert!(moe.iter().all(|k| k.starts_with("moe")), "{moe:?}");
    for k in &moe {
        let p = s.point(k).unwrap();
        assert!(p.latest().is_some_and(|q| q.kl_mean.is_finite()), "{k}");
    }
    // Rebuilt through the recipe file (what `--recipe` runs), as the search measured it.
    rebuilds_as_measured(&f, &s, "moe s256+8x2 seed 1 | q8_0 | kv f32 | act q8");
}

/// Writes the recipe of point `key` of `s` as `recipe.toml` would hold it (with the
/// calibration text it read), rebuilds it twice through `--recipe`, and checks the same bytes
/// both times and, on the rebuilt model, the KL the search measured at its first rung, to the
/// last bit (the same weights).
fn rebuilds_as_measured(f: &Files, s: &State, key: &str) -> GgufFile {
    use frugal_lab::optimize::recipe::{BaseId, CalibrationId, RecipeFile, VERSION};
    let p = s
        .point(key)
        .unwrap_or_else(|| panic!("no point {key}: {:?}", keys(s)));
    let base_model = lab_build::load(std::fs::read(&f.model).unwrap(), false).unwrap();
    let tok = Tokenizer::from_gguf(&base_model.file).unwrap();
    let cal_path = f.root.join("cal.txt");
    let cal_tokens = tok
        .encode(&std::fs::read_to_string(&cal_path).unwrap(), false)
        .unwrap();
    let r = RecipeFile {
        frugal_version: VERSION.to_string(),
        encoders: None,
        base: BaseId::of(&f.model).unwrap(),
        recipe: p.recipe.clone(),
        calibration: Some(CalibrationId {
            file: BaseId::of(&cal_path).unwrap(),
            tokens: cal_tokens.len(),
            cut_tokens: s.config.funnel.prune_tokens,
            ctx: s.config.funnel.ctx,
        }),
        measured: None,
        speculate: None,
    };
    let path = f.root.join("point.toml");
    r.write(&path).unwrap();
    let (a, b) = (f.root.join("rebuilt-a"), f.root.join("rebuilt-b"));
    rebuild(&path, None, None, &a).unwrap();
    rebuild(&path, None, None, &b).unwrap();
    let bytes = std::fs::read(a.join("model.gguf")).unwrap();
    assert_eq!(bytes, std::fs::read(b.join("model.gguf")).unwrap());
    let rebuilt = lab_build::load(bytes.clone(), false).unwrap();
    let eval = tok
        .encode(
            &std::fs::read_to_string(f.root.join("held.txt")).unwrap(),
            false,
        )
        .unwrap();
    let rung = &p.quality[0];
    let q = quality::against(
        &rebuilt,
        &base_model,
        &eval[..rung.tokens],
        s.config.funnel.ctx,
    )
    .unwrap();
    assert_eq!(q.kl_mean, rung.quality.kl_mean, "{key}");
    GgufFile::from_bytes(bytes).unwrap()
}

/// The best weight recipes holding a format with a weighted encoder are tried again encoded
/// by importance on the calibration text: the same bytes as their twin, other roundings (a
/// different KL), and the recipe rebuilds them.
#[test]
fn imatrix_variants_reround_the_best_mixes_and_rebuild() {
    let f = files();
    let mut c = config(&f, &["kl <= 10"]);
    c.levers = vec![Lever::Quant];
    let s = run(c, &f.root.join("opt"), None).state;
    let imatrix: Vec<&str> = keys(&s)
        .into_iter()
        .filter(|k| k.contains(" imatrix"))
        .collect();
    assert!(!imatrix.is_empty(), "{:?}", keys(&s));
    for k in &imatrix {
        let p = s.point(k).unwrap();
        let twin = s.point(&k.replace(" imatrix", "")).unwrap();
        assert_eq!(p.weight_bytes, twin.weight_bytes, "{k}");
        let (a, b) = (
            p.quality[0].quality.kl_mean,
            twin.quality[0].quality.kl_mean,
        );
        assert!(a.is_finite() && a != b, "{k}: {a} vs {b}");
    }
    rebuilds_as_measured(&f, &s, imatrix[0]);
}
