//! The composition matrix: each lever alone, pairs of levers, and the full ladder on one base,
//! every row measured the same way in one run (KL to the base on held-out text, decode timed
//! back to back with the base, memory at a context), so that what composes better than any
//! single lever, and what does not, is read off one table.
//!
//! The rows are recipes ([`Recipe`]): the same stages `frugal optimize` searches over, built
//! the way `--recipe` rebuilds them. The search's chosen point (its `recipe.toml`) can be
//! added as the full ladder's row. [`Analysis`] reads the table: the frontier each stage of
//! the ladder leaves, the points a stage adds, the levers that buy nothing on this CPU, and
//! whether a composed point dominates every single-lever one.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use frugal::eval::EvalOptions;
use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvOptions, KvType};
use frugal::model::Model;
use frugal::quant::GgmlType;
use frugal::tokenizer::Tokenizer;
use serde::Serialize;

use super::prune::{Calibration, Prune, trials};
use super::quant::type_name;
use super::recipe::{Lever, Recipe, Runtime, Stage};
use crate::quality::{self, Quality};
use crate::size::Memory;
use crate::timing::{self, SpeedTest};

/// What a matrix is measured on and how.
#[derive(Clone, Debug)]
pub struct Setup {
    pub model: PathBuf,
    pub calibration: PathBuf,
    pub eval: PathBuf,
    /// Evaluation tokens (in windows of `ctx`, the second half of each scored).
    pub eval_tokens: usize,
    pub ctx: usize,
    /// Calibration tokens the cuts are scored on.
    pub prune_tokens: usize,
    /// The context memory counts the KV cache at (batch 1).
    pub context: usize,
    /// Back-to-back rounds against the base, and decode tokens per run.
    pub rounds: usize,
    pub gen_tokens: usize,
    /// The search's chosen point, measured as a row of its own.
    pub chosen: Option<Recipe>,
}

/// What the plan includes beyond the single levers.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// Training tokens of the distilled ladder rows (0: none).
    pub distill_tokens: usize,
}

/// Where a row sits in the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Alone,
    Pair,
    Ladder,
}

/// A row before it is measured.
#[derive(Clone, Debug)]
pub struct Planned {
    pub name: String,
    pub kind: Kind,
    pub recipe: Recipe,
}

/// One measured row.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub name: String,
    pub kind: Kind,
    pub levers: Vec<Lever>,
    pub recipe: String,
    pub bpw: f64,
    pub weight_bytes: u64,
    pub memory: u64,
    pub quality: Quality,
    /// Decode over the base's, timed back to back (median of the rounds).
    pub decode_ratio: f64,
    pub decode: f64,
    pub build_seconds: f64,
}

/// The levers a recipe pulls (quantization counts when a stage stores below f32 or the
/// activations change; KV when the cache is not f32).
pub fn levers_of(r: &Recipe) -> Vec<Lever> {
    let mut out = Vec::new();
    if r.stages.iter().any(|s| matches!(s, Stage::Prune(_))) {
        out.push(Lever::Prune);
    }
    if r.stages
        .iter()
        .any(|s| matches!(s, Stage::Attention { .. }))
    {
        out.push(Lever::Attention);
    }
    if r.stages.iter().any(|s| matches!(s, Stage::Moe { .. })) {
        out.push(Lever::Moe);
    }
    if r.stages.iter().any(|s| matches!(s, Stage::Distill { .. })) {
        out.push(Lever::Distill);
    }
    let quant = r.stages.iter().any(|s| match s {
        Stage::Quant { format, .. } => format != "f32",
        Stage::Prune(Prune::Sparse { store, .. }) => store != "f32",
        _ => false,
    });
    if quant {
        out.push(Lever::Quant);
    }
    if r.runtime.kv != KvType::F32 {
        out.push(Lever::Kv);
    }
    out
}

fn quant(format: &str) -> Stage {
    Stage::Quant {
        format: format.to_string(),
        keep: Vec::new(),
        imatrix: false,
    }
}

/// The rows for a base of config `c`: formats alone, the KV cache alone, each structured cut
/// alone (float weights), pairs (formats with the cache, cuts before and after a format, the
/// sparse cuts in their compressed type), and the full ladder (a cut, a format and the cache;
/// the search's chosen point when given).
pub fn plan(
    c: &frugal::model::Config,
    chosen: Option<&Recipe>,
    opts: &PlanOptions,
) -> Vec<Planned> {
    let kv8 = Runtime {
        kv: KvType::Q8_0,
        ..Runtime::default()
    };
    let mut out = Vec::new();
    let mut add = |name: String, kind, stages: Vec<Stage>, runtime: Runtime| {
        out.push(Planned {
            name,
            kind,
            recipe: Recipe { stages, runtime },
        });
    };
    let (q8, q4) = (type_name(GgmlType::Q8_0), type_name(GgmlType::Q4_K));
    for f in [&q8, &type_name(GgmlType::Q6_K), &q4] {
        add(f.clone(), Kind::Alone, vec![quant(f)], Runtime::default());
    }
    add("kv q8_0".into(), Kind::Alone, Vec::new(), kv8);
    let ts = trials(c, true);
    let structured: Vec<Prune> = ts
        .iter()
        .filter(|t| t.takes_any_format())
        .filter_map(|t| t.prune().cloned())
        .collect();
    // The lightest FFN cut and the lightest layer cut.
    let mut cuts: Vec<Prune> = Vec::new();
    for unit in ["ffn:", "layers:"] {
        if let Some(p) = structured
            .iter()
            .find(|p| matches!(p, Prune::Structured { remove } if remove.starts_with(unit)))
        {
            cuts.push(p.clone());
        }
    }
    for p in &cuts {
        add(
            p.to_string(),
            Kind::Alone,
            vec![Stage::Prune(p.clone())],
            Runtime::default(),
        );
    }
    // One regrouped and one latent layout, when the model takes them.
    let (layouts, _) = super::attention::layouts(c);
    let layouts: Vec<String> = ["mqa", "gqa:", "mla:"]
        .iter()
        .filter_map(|p| layouts.iter().find(|l| l.starts_with(p)).cloned())
        .take(2)
        .collect();
    let layout = |l: &String| Stage::Attention { layout: l.clone() };
    for l in &layouts {
        add(
            format!("attention {l}"),
            Kind::Alone,
            vec![layout(l)],
            Runtime::default(),
        );
    }
    for f in [&q8, &q4] {
        add(format!("{f} + kv q8_0"), Kind::Pair, vec![quant(f)], kv8);
    }
    for l in &layouts {
        add(
            format!("attention {l}, then {q4}"),
            Kind::Pair,
            vec![layout(l), quant(&q4)],
            Runtime::default(),
        );
    }
    for p in &cuts {
        for f in [&q8, &q4] {
            add(
                format!("{p}, then {f}"),
                Kind::Pair,
                vec![Stage::Prune(p.clone()), quant(f)],
                Runtime::default(),
            );
            add(
                format!("{f}, then {p}"),
                Kind::Pair,
                vec![quant(f), Stage::Prune(p.clone())],
                Runtime::default(),
            );
        }
    }
    for t in ts.iter().filter(|t| !t.takes_any_format()) {
        add(
            format!("{}, then {}", t.cut, t.format),
            Kind::Pair,
            t.pruned(),
            Runtime::default(),
        );
        if let Some(cut) = t.after() {
            add(
                format!("{}, then {cut}", t.dense),
                Kind::Pair,
                [t.dense(), vec![cut.clone()]].concat(),
                Runtime::default(),
            );
        }
    }
    if let Some(p) = cuts.first() {
        add(
            format!("{p}, then {q4} + kv q8_0"),
            Kind::Ladder,
            vec![Stage::Prune(p.clone()), quant(&q4)],
            kv8,
        );
        add(
            format!("{q4}, then {p} + kv q8_0"),
            Kind::Ladder,
            vec![quant(&q4), Stage::Prune(p.clone())],
            kv8,
        );
    }
    // One split into experts (a shared third of the FFN and 8 routed experts, top-2).
    let experts = super::experts::trials(c, true)
        .0
        .first()
        .map(|t| t.cut.clone());
    if let Some(e) = &experts {
        add(
            e.to_string(),
            Kind::Alone,
            vec![e.clone()],
            Runtime::default(),
        );
        add(
            format!("{e}, then {q4}"),
            Kind::Pair,
            vec![e.clone(), quant(&q4)],
            Runtime::default(),
        );
    }
    let distill = Stage::Distill {
        tokens: opts.distill_tokens,
        seed: 0,
    };
    if opts.distill_tokens > 0 {
        let firsts = cuts
            .first()
            .map(|p| Stage::Prune(p.clone()))
            .into_iter()
            .chain(layouts.first().map(layout))
            .chain(experts.clone());
        for first in firsts {
            add(
                format!("{first}, distilled, then {q4} + kv q8_0"),
                Kind::Ladder,
                vec![first, distill.clone(), quant(&q4)],
                kv8,
            );
        }
    }
    if let Some(r) = chosen {
        add(
            "the search's chosen point".into(),
            Kind::Ladder,
            r.stages.clone(),
            r.runtime,
        );
    }
    out
}

/// Measures every planned row against the base; `progress` hears each row as it is done. A
/// row that cannot be built or run on this model is skipped with the reason (returned).
pub fn measure(
    s: &Setup,
    rows: &[Planned],
    progress: &mut dyn FnMut(&str),
) -> Result<(Vec<Row>, Vec<String>)> {
    let base_file = GgufFile::open(&s.model)?;
    let base = crate::build::load_file(GgufFile::open(&s.model)?, false)?;
    let tok = Tokenizer::from_gguf(&base_file)?;
    let read = |p: &Path| -> Result<Vec<u32>> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        Ok(tok.encode(&text, false)?)
    };
    let mut calib = read(&s.calibration)?;
    calib.truncate(1 << 16);
    let cal = Calibration {
        tokens: calib,
        ctx: s.ctx,
        cut_tokens: s.prune_tokens,
    };
    let mut eval = read(&s.eval)?;
    eval.truncate(s.eval_tokens.min(eval.len()) / s.ctx * s.ctx);
    anyhow::ensure!(
        !eval.is_empty(),
        "{} is shorter than one window of {} tokens",
        s.eval.display(),
        s.ctx
    );
    let test = SpeedTest {
        prompt: 0,
        gen_tokens: s.gen_tokens,
        depth: 0,
        reps: 1,
    };
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for p in rows {
        match measure_one(s, p, &base_file, &base, &cal, &eval, &test) {
            Ok(r) => {
                progress(&format!(
                    "{:<44} KL {:.4}  decode {:.2}x  {:.1} MiB",
                    r.name,
                    r.quality.kl_mean,
                    r.decode_ratio,
                    r.memory as f64 / 1048576.0
                ));
                out.push(r);
            }
            Err(e) => {
                let why = format!("{}: {e:#}", p.name);
                progress(&format!("skipped {why}"));
                skipped.push(why);
            }
        }
    }
    Ok((out, skipped))
}

fn measure_one(
    s: &Setup,
    p: &Planned,
    base_file: &GgufFile,
    base: &Model,
    cal: &Calibration,
    eval: &[u32],
    test: &SpeedTest,
) -> Result<Row> {
    let t0 = Instant::now();
    let file = p.recipe.build(base_file, cal)?;
    let build_seconds = t0.elapsed().as_secs_f64();
    let (bytes, params) = file.tensors().iter().fold((0u64, 0u64), |(b, n), t| {
        (b + t.n_bytes(), n + t.n_elements())
    });
    let mut m = crate::build::load_file(file, false)?;
    m.set_activations(p.recipe.runtime.activations);
    let opts = EvalOptions {
        kv: KvOptions {
            format: KvFormat::both(p.recipe.runtime.kv),
            ..Default::default()
        },
        ..Default::default()
    };
    let q = quality::against_with((&m, &opts), (base, &EvalOptions::default()), eval, s.ctx)?;
    let memory = Memory::at(&m, s.context, KvFormat::both(p.recipe.runtime.kv))?;
    let r = timing::back_to_back(
        1,
        s.rounds,
        |_| Some(1),
        |i| {
            if i == 0 {
                test.measure_with(&m, &opts)
            } else {
                test.measure(base)
            }
        },
        |_| {},
    )?;
    Ok(Row {
        name: p.name.clone(),
        kind: p.kind,
        levers: levers_of(&p.recipe),
        recipe: p.recipe.key(),
        bpw: bytes as f64 * 8.0 / params.max(1) as f64,
        weight_bytes: bytes,
        memory: memory.total(),
        quality: q,
        decode_ratio: r.candidates[0].vs_base.decode,
        decode: r.candidates[0].speed.decode,
        build_seconds,
    })
}

/// `a` at least as good as `b` in KL, decode and memory, and better in one.
pub fn dominates(a: &Row, b: &Row) -> bool {
    let (ka, kb) = (a.quality.kl_mean, b.quality.kl_mean);
    let le = ka <= kb && a.decode_ratio >= b.decode_ratio && a.memory <= b.memory;
    let lt = ka < kb || a.decode_ratio > b.decode_ratio || a.memory < b.memory;
    le && lt
}

/// The indices of `rows` no other of them dominates.
pub fn frontier(rows: &[&Row]) -> Vec<usize> {
    (0..rows.len())
        .filter(|&i| !rows.iter().any(|o| dominates(o, rows[i])))
        .collect()
}

/// What the table says.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    /// Per stage of the ladder (its levers cumulative): the rows on its frontier, and those
    /// that were not on the previous stage's.
    pub stages: Vec<StageFrontier>,
    /// Rows of one lever whose decode is within `noise` of the base's: the lever buys no
    /// speed on this CPU (it may still buy memory).
    pub no_speed: Vec<String>,
    /// Composed rows that dominate every single-lever row.
    pub dominating: Vec<String>,
    /// For the composed frontier rows that do not: the single-lever rows they fail to
    /// dominate, by name.
    pub not_dominated: Vec<(String, Vec<String>)>,
    /// The fastest row meeting the KL bound, per set of levers (by name).
    pub best_within: Vec<(String, Option<String>)>,
    pub kl_bound: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct StageFrontier {
    pub levers: Vec<Lever>,
    pub frontier: Vec<String>,
    pub added: Vec<String>,
}

/// Reads `rows`: the ladder's stages are quantization with the cache, then pruning, attention
/// layout, experts and distillation (the order the search pulls them); `noise` is the decode
/// ratio within which a lever buys nothing; `kl_bound` the quality the best rows are picked
/// under.
pub fn analyse(rows: &[Row], noise: f64, kl_bound: f64) -> Analysis {
    use Lever::*;
    let ladder = [
        vec![Quant, Kv],
        vec![Quant, Kv, Prune],
        vec![Quant, Kv, Prune, Attention],
        vec![Quant, Kv, Prune, Attention, Moe],
        vec![Quant, Kv, Prune, Attention, Moe, Distill],
    ];
    let mut stages = Vec::new();
    let mut prev: Vec<String> = Vec::new();
    for levers in ladder {
        let sub: Vec<&Row> = rows
            .iter()
            .filter(|r| r.levers.iter().all(|l| levers.contains(l)))
            .collect();
        let front: Vec<String> = frontier(&sub)
            .into_iter()
            .map(|i| sub[i].name.clone())
            .collect();
        let added = front
            .iter()
            .filter(|n| !prev.contains(n))
            .cloned()
            .collect();
        prev = front.clone();
        stages.push(StageFrontier {
            levers,
            frontier: front,
            added,
        });
    }
    let single: Vec<&Row> = rows.iter().filter(|r| r.levers.len() == 1).collect();
    let composed: Vec<&Row> = rows.iter().filter(|r| r.levers.len() >= 2).collect();
    let no_speed = single
        .iter()
        .filter(|r| r.decode_ratio < 1.0 + noise)
        .map(|r| r.name.clone())
        .collect();
    let all: Vec<&Row> = rows.iter().collect();
    let front_all = frontier(&all);
    let mut dominating = Vec::new();
    let mut not_dominated = Vec::new();
    for r in composed {
        let missed: Vec<String> = single
            .iter()
            .filter(|s| !dominates(r, s))
            .map(|s| s.name.clone())
            .collect();
        if missed.is_empty() {
            dominating.push(r.name.clone());
        } else if front_all.iter().any(|&i| std::ptr::eq(all[i], r)) {
            not_dominated.push((r.name.clone(), missed));
        }
    }
    let mut sets: Vec<Vec<Lever>> = Vec::new();
    for r in rows {
        if !sets.contains(&r.levers) {
            sets.push(r.levers.clone());
        }
    }
    let best_within = sets
        .into_iter()
        .map(|set| {
            let best = rows
                .iter()
                .filter(|r| r.levers == set && r.quality.kl_mean <= kl_bound)
                .max_by(|a, b| a.decode_ratio.total_cmp(&b.decode_ratio))
                .map(|r| r.name.clone());
            let names: Vec<&str> = set.iter().map(|l| l.name()).collect();
            let label = if names.is_empty() {
                "none".to_string()
            } else {
                names.join(" + ")
            };
            (label, best)
        })
        .collect();
    Analysis {
        stages,
        no_speed,
        dominating,
        not_dominated,
        best_within,
        kl_bound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(name: &str, levers: &[Lever], kl: f64, decode: f64, memory: u64) -> Row {
        Row {
            name: name.into(),
            kind: if levers.len() == 1 {
                Kind::Alone
            } else {
                Kind::Pair
            },
            levers: levers.to_vec(),
            recipe: name.into(),
            bpw: 8.0,
            weight_bytes: memory,
            memory,
            quality: Quality {
                ppl: 1.0,
                ppl_stderr: 0.0,
                base_ppl: 1.0,
                kl_mean: kl,
                kl_stderr: 0.0,
                kl_p99: kl,
                top1: 1.0,
                positions: 1,
            },
            decode_ratio: decode,
            decode: decode * 10.0,
            build_seconds: 0.0,
        }
    }

    /// The stages' frontiers, the points pruning adds, the lever that buys no speed, and a
    /// composed row that dominates every single-lever row, on rows whose answers are known.
    #[test]
    fn analysis_reads_the_table() {
        use Lever::*;
        let rows = vec![
            row("q8_0", &[Quant], 0.004, 4.0, 200),
            row("q4_k", &[Quant], 0.08, 5.5, 120),
            row("kv q8_0", &[Kv], 0.001, 1.01, 500),
            row("prune ffn", &[Prune], 0.3, 1.1, 450),
            row("q8_0 + kv", &[Quant, Kv], 0.004, 4.0, 150),
            row("prune, then q4_k", &[Prune, Quant], 0.35, 6.5, 100),
            row("mix + kv", &[Quant, Kv], 0.0009, 5.6, 110),
        ];
        let an = analyse(&rows, 0.03, 0.05);
        assert_eq!(an.no_speed, vec!["kv q8_0".to_string()]);
        // Stage 1 (quant + kv) leaves "mix + kv" alone on its frontier (it dominates the
        // rest); stage 2 adds the pruned row (fastest, smallest).
        assert_eq!(an.stages[0].frontier, vec!["mix + kv".to_string()]);
        assert_eq!(an.stages[1].added, vec!["prune, then q4_k".to_string()]);
        assert_eq!(an.dominating, vec!["mix + kv".to_string()]);
        let best: Vec<(String, Option<String>)> = an.best_within;
        assert!(
            best.contains(&("quant".into(), Some("q8_0".into()))),
            "{best:?}"
        );
        assert!(best.contains(&("prune".into(), None)), "{best:?}");
        assert!(!dominates(&rows[0], &rows[0]));
    }

    /// Every row of the plan for a small model is buildable text: the kinds are all there,
    /// each recipe names the levers its row claims (experts too), and pruning comes in both
    /// orders.
    #[test]
    fn plan_has_each_lever_alone_pairs_and_the_ladder() {
        let c = frugal::model::Config::from_gguf(
            &GgufFile::from_bytes(frugal::model::synthetic::build(
                &frugal::model::synthetic::SyntheticSpec {
                    n_layers: 8,
                    n_embd: 64,
                    n_ff: 768,
                    ..Default::default()
                },
            ))
            .unwrap(),
        )
        .unwrap();
        let p = plan(
            &c,
            None,
            &PlanOptions {
                distill_tokens: 1024,
            },
        );
        for k in [Kind::Alone, Kind::Pair, Kind::Ladder] {
            assert!(p.iter().any(|r| r.kind == k), "{k:?}");
        }
        for l in [
            Lever::Quant,
            Lever::Kv,
            Lever::Prune,
            Lever::Attention,
            Lever::Moe,
        ] {
            assert!(
                p.iter()
                    .any(|r| r.kind == Kind::Alone && levers_of(&r.recipe) == vec![l]),
                "{l:?} alone"
            );
        }
        let before = p.iter().filter(|r| {
            matches!(r.recipe.stages.first(), Some(Stage::Prune(_))) && r.recipe.stages.len() > 1
        });
        let after = p.iter().filter(|r| {
            matches!(r.recipe.stages.last(), Some(Stage::Prune(_))) && r.recipe.stages.len() > 1
        });
        assert!(before.count() >= 2 && after.count() >= 2);
    }
}
