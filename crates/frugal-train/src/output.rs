//! Writing a trained model: a GGUF that frugal and llama.cpp load, in F32 or any format
//! `frugal quantize` writes, whose metadata records how it was made.

use std::path::Path;

use frugal::convert::{Policy, Target, quantize_file};
use frugal::gguf::{Array, GgufFile, Value};

use crate::error::{Result, TrainError, io_err};
use crate::params::Params;

/// How a model was made, written under `frugal.train.*`.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Provenance {
    /// `train` or `distill`.
    pub mode: String,
    /// SHA-256 of each teacher file.
    pub teachers: Vec<String>,
    /// SHA-256 of the starting model (the student before training).
    pub base: Option<String>,
    /// The student as given (`keep-layers:10`, `config:s.json`, a path, `self`).
    pub student: String,
    /// The loss, as words: `0.1*ce + 0.9*kl(t=2)·τ² + 0.5*cosine(hidden)`.
    pub loss: String,
    pub temperature: f32,
    pub tokens: u64,
    /// The peak learning rate (the probe's choice when it was probed).
    pub lr: f32,
    pub seed: u64,
    /// Kept teacher layers (layer-dropped students).
    pub kept_layers: Vec<usize>,
}

/// Writes `params` to `out` with `template`'s tokenizer and chat metadata, quantized to
/// `ty` (`None` or `f32`: F32). Written atomically.
pub fn write_model(
    params: &Params,
    template: &GgufFile,
    prov: &Provenance,
    ty: Option<&str>,
    out: &Path,
) -> Result<()> {
    let mut w = params.to_gguf(template);
    let s = |v: &str| Value::String(v.into());
    w.set("frugal.train.mode", s(&prov.mode));
    w.set(
        "frugal.train.teachers",
        Value::Array(Array::String(prov.teachers.clone())),
    );
    if let Some(b) = &prov.base {
        w.set("frugal.train.base_sha256", s(b));
    }
    w.set("frugal.train.student", s(&prov.student));
    w.set("frugal.train.loss", s(&prov.loss));
    w.set("frugal.train.temperature", Value::F32(prov.temperature));
    w.set("frugal.train.tokens", Value::U64(prov.tokens));
    w.set("frugal.train.lr", Value::F32(prov.lr));
    w.set("frugal.train.seed", Value::U64(prov.seed));
    if !prov.kept_layers.is_empty() {
        w.set(
            "frugal.train.kept_layers",
            Value::Array(Array::U32(
                prov.kept_layers.iter().map(|&l| l as u32).collect(),
            )),
        );
    }
    let tmp = out.with_extension("tmp.gguf");
    match ty.map(str::to_ascii_lowercase).as_deref() {
        None | Some("f32") => {
            w.write_file(&tmp)?;
        }
        Some(t) => {
            let target: Target = t
                .parse()
                .map_err(|e| TrainError::Invalid(format!("--type: {e}")))?;
            let bytes = w.to_bytes()?;
            drop(w);
            let f32_file = GgufFile::from_bytes(bytes)?;
            quantize_file(&f32_file, &Policy::new(target), &tmp, |_, _| {})
                .map_err(|e| TrainError::Invalid(format!("quantizing the output to {t}: {e}")))?;
        }
    }
    std::fs::rename(&tmp, out).map_err(io_err(out))
}
