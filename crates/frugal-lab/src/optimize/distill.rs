//! The distillation stage of the ladder: a cut candidate trained to match the base's
//! next-token distributions on the calibration text ([`crate::heal`]: forward KL at τ = 2,
//! AdamW, cosine schedule), its zeros kept at zero, then stored again by the quantization stage
//! that follows it in the recipe.
//!
//! It is the most expensive lever (minutes of training where every other stage takes
//! seconds), so the search pulls it last and only when no cheaper point meets the targets.
//! Its learning rate is probed for each candidate (`frugal_train::trainer::LrProbe`): the
//! rate a model tolerates differs 30-fold between SmolLM2 and Gemma 3. Probe and training
//! are seeded and run in a fixed order, so a recipe rebuilds the same bytes on the same
//! machine and thread count.

use anyhow::Result;
use frugal::gguf::GgufFile;
use frugal::model::Model;
use frugal_train::Params;
use frugal_train::data::{split, window_start, windows_of};
use frugal_train::teacher::OnlineTeachers;

use super::prune::Calibration;
use frugal_train::trainer::LrProbe;

use crate::heal::{self, Recovery};

/// Training window and batch: as `frugal report prune` heals (256 tokens, batch 4), halved in
/// length so that the calibration text gives twice the windows.
pub const SEQ: usize = 128;
pub const BATCH: usize = 4;
/// The learning-rate probe's ceiling: the rate is measured per candidate
/// ([`LrProbe`]; SmolLM2's cuts take about 1e-4, Gemma 3's about 1e-5).
pub const LR: f32 = 3e-4;

/// `file` distilled from `base` for `tokens` training tokens of the calibration text (its
/// last tenth held out), in f32, at the probed learning rate (recorded as `frugal.train.lr`).
pub fn apply(
    file: &GgufFile,
    base: &GgufFile,
    cal: &Calibration,
    tokens: usize,
    seed: u64,
) -> Result<GgufFile> {
    let start = window_start(&frugal::tokenizer::Tokenizer::from_gguf(base)?);
    let data = split(
        windows_of(&cal.tokens, SEQ).starting_with(start),
        0.1,
        "the calibration text",
    )?;
    let teacher = crate::build::load_file(GgufFile::from_bytes(base.raw_bytes().to_vec())?, false)?;
    let teachers = OnlineTeachers {
        models: vec![(teacher, 1.0)],
    };
    let candidate = Model::from_file(GgufFile::from_bytes(file.raw_bytes().to_vec())?)?;
    let keep_sparsity = crate::size::zero_fraction(file)? > 0.1;
    let recovery = Recovery {
        seq: SEQ,
        batch: BATCH,
        lr: LR,
        probe: Some(LrProbe::default()),
        points: 1,
        eval_windows: 4,
        seed,
        run: heal::run_options(),
    };
    let run = recovery.distil(
        Params::from_model(&candidate)?,
        recovery.steps(tokens),
        &data,
        &teachers,
        keep_sparsity,
        |_| {},
    )?;
    let mut w = run.params.to_gguf(&candidate.file);
    w.set("frugal.train.lr", frugal::gguf::Value::F32(run.lr));
    Ok(GgufFile::from_bytes(w.to_bytes()?)?)
}
