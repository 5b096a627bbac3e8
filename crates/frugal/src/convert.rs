//! Re-encoding a model's tensors under a mixed-precision policy: `frugal quantize` (to a new
//! GGUF file) and `--quantize-on-load` (to a model in memory) share this.
//!
//! Model surgery reads a file and writes a new one; it never adds a branch to the forward pass.
//! The policy decides per tensor, first match wins:
//! 1. the user's `GLOB=TYPE` rules;
//! 2. 1-D tensors (norm weights, biases) stay F32: they are tiny and every activation is
//!    multiplied by them;
//! 3. the token embedding and output head are kept at 8 bits (Q8_0; wider if the target itself
//!    is a float type): they touch every token's logits, and llama.cpp does the same;
//! 4. everything else gets the target type.
//!
//! A tensor whose rows are not a whole number of the chosen type's blocks falls back, as
//! llama.cpp does: Q4_K to Q5_0, Q6_K to Q8_0, 32-wide formats to F16; the report says so.
//!
//! Targets are either GGUF types (stored bit-compatibly with llama.cpp) or research formats
//! (`quant::research`), which have no GGUF encoding: those are *simulated*: quantized and
//! dequantized back into an F32 tensor, so the model runs on exactly the values the format can
//! represent (only for in-memory use; a file cannot carry them).

use std::borrow::Cow;
use std::str::FromStr;

use rayon::prelude::*;

use crate::gguf::{GgufFile, GgufWriter, TensorInfo, Value};
use crate::quant::research::SimFormat;
use crate::quant::{self, GgmlType, QuantError};
use crate::surgery::importance::Importance;

/// What a tensor is converted to.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A GGUF storage type.
    Stored(GgmlType),
    /// A research format, simulated in f32.
    Simulated(SimFormat),
}

impl Target {
    /// Every accepted type name, for messages.
    pub fn valid_names() -> String {
        let stored: Vec<String> = quant::SUPPORTED
            .iter()
            .map(|t| t.name().to_lowercase())
            .collect();
        format!(
            "GGUF types: {}; research formats (in memory only): {}",
            stored.join(", "),
            SimFormat::NAMES.join(", ")
        )
    }

    pub fn name(&self) -> String {
        match self {
            Target::Stored(t) => t.name().to_string(),
            Target::Simulated(f) => f.name(),
        }
    }
}

impl FromStr for Target {
    type Err = ConvertError;

    fn from_str(s: &str) -> Result<Self, ConvertError> {
        if let Some(t) = GgmlType::from_name(s).filter(|t| quant::is_supported(*t)) {
            return Ok(Target::Stored(t));
        }
        if let Some(f) = SimFormat::parse(s) {
            return Ok(Target::Simulated(f));
        }
        Err(ConvertError::UnknownType {
            name: s.to_string(),
            valid: Target::valid_names(),
        })
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// A `GLOB=TYPE` override (`*` matches any run of characters, `?` one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub pattern: String,
    pub target: Target,
}

impl FromStr for Rule {
    type Err = ConvertError;

    fn from_str(s: &str) -> Result<Self, ConvertError> {
        let (pattern, ty) = s
            .rsplit_once('=')
            .filter(|(p, t)| !p.is_empty() && !t.is_empty())
            .ok_or_else(|| ConvertError::BadRule(s.to_string()))?;
        Ok(Rule {
            pattern: pattern.to_string(),
            target: ty.parse()?,
        })
    }
}

/// Shell-style glob over the whole name.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[u8], n: &[u8]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some((b'*', rest)) => (0..=n.len()).any(|i| go(rest, &n[i..])),
            Some((b'?', rest)) => !n.is_empty() && go(rest, &n[1..]),
            Some((c, rest)) => n.first() == Some(c) && go(rest, &n[1..]),
        }
    }
    go(pattern.as_bytes(), name.as_bytes())
}

/// The mixed-precision policy: a target for the bulk of the weights and overrides.
#[derive(Clone, Debug)]
pub struct Policy {
    pub target: Target,
    pub rules: Vec<Rule>,
    /// Column importance from calibration text: the matrices it covers are encoded by
    /// `quant::weighted` where their format has a weighted encoder (Q4_0, Q5_0, Q4_K).
    pub importance: Option<std::sync::Arc<Importance>>,
}

impl Policy {
    pub fn new(target: Target) -> Self {
        Policy {
            target,
            rules: Vec::new(),
            importance: None,
        }
    }

    /// The same policy with importance-weighted encoding.
    pub fn with_importance(mut self, importance: Importance) -> Self {
        self.importance = Some(std::sync::Arc::new(importance));
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("unknown type {name:?} ({valid})")]
    UnknownType { name: String, valid: String },
    #[error("--keep {0:?} is not of the form TENSOR_GLOB=TYPE")]
    BadRule(String),
    #[error(
        "{target} is a research format with no GGUF encoding; use it with --quantize-on-load or analyze, or pick a GGUF type"
    )]
    NotStorable { target: String },
    #[error("tensor {tensor:?}: {source}")]
    Quant {
        tensor: String,
        #[source]
        source: QuantError,
    },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
}

/// What happens to one tensor.
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Bytes copied unchanged.
    Keep,
    /// Decoded and re-encoded as the new type.
    Encode,
    /// Decoded, passed through a research format and stored as F32.
    Simulate,
}

/// The decision for one tensor and its cost.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TensorPlan {
    pub name: String,
    pub dims: Vec<u64>,
    pub from: GgmlType,
    pub to: GgmlType,
    pub action: Action,
    /// The research format applied (for `Simulate`).
    pub simulated: Option<String>,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Why this tensor did not simply get the target (a rule, a default, a fallback).
    pub note: Option<String>,
    #[serde(skip)]
    sim: Option<SimFormat>,
    /// The column importance its encoding is weighted by (`Policy::importance`).
    #[serde(skip)]
    importance: Option<std::sync::Arc<[f32]>>,
}

impl TensorPlan {
    /// Whether the encoding is importance-weighted.
    pub fn weighted(&self) -> bool {
        self.importance.is_some()
    }
}

/// Totals over a conversion.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ConvertReport {
    pub target: String,
    pub tensors: Vec<TensorPlan>,
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Tensors that were already quantized and were re-encoded (each rounding adds its error on
    /// top of the previous one's).
    pub requantized: usize,
    /// Tensors that could not take their chosen type and fell back (one line each).
    pub fallbacks: Vec<String>,
    /// The llama.cpp `general.file_type` written.
    pub file_type: Option<u32>,
}

impl ConvertReport {
    /// Parameters per stored type after conversion, largest first.
    pub fn types_after(&self) -> Vec<(GgmlType, u64)> {
        let mut v: Vec<(GgmlType, u64)> = Vec::new();
        for t in &self.tensors {
            let n: u64 = t.dims.iter().product();
            match v.iter_mut().find(|(ty, _)| *ty == t.to) {
                Some(e) => e.1 += n,
                None => v.push((t.to, n)),
            }
        }
        v.sort_by_key(|e| std::cmp::Reverse(e.1));
        v
    }
}

fn is_float(t: GgmlType) -> bool {
    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// llama.cpp's `llama_ftype` for a file whose bulk is `t` (what `general.file_type` holds; tools
/// display it, nothing depends on it for loading). Q4_K maps to Q4_K_M as llama.cpp's own
/// guess from a tensor type does.
pub fn llama_file_type(t: GgmlType) -> Option<u32> {
    Some(match t {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q2_K => 10,
        GgmlType::Q3_K => 12,
        GgmlType::Q4_K => 15,
        GgmlType::Q5_K => 17,
        GgmlType::Q6_K => 18,
        GgmlType::IQ4_NL => 25,
        GgmlType::IQ4_XS => 30,
        GgmlType::BF16 => 32,
        GgmlType::MXFP4 => 38,
        _ => return None,
    })
}

/// The next type to try when rows of `cols` elements do not fit `t`'s blocks (llama-quantize's
/// `tensor_type_fallback`).
fn fallback(t: GgmlType) -> GgmlType {
    match t {
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        GgmlType::IQ4_XS => GgmlType::IQ4_NL,
        _ => GgmlType::F16,
    }
}

fn plan_one(info: &TensorInfo, policy: &Policy) -> TensorPlan {
    let name = info.name.as_str();
    let bytes_before = info.n_bytes();
    let mut note = None;
    let target = if let Some(r) = policy.rules.iter().find(|r| glob_match(&r.pattern, name)) {
        note = Some(format!("rule {}={}", r.pattern, r.target));
        r.target
    } else if info.dims.len() <= 1 {
        note = Some("1-D tensor kept in F32".to_string());
        Target::Stored(GgmlType::F32)
    } else if name == "token_embd.weight" || name == "output.weight" {
        match policy.target {
            Target::Stored(t) if is_float(t) || t == GgmlType::Q8_0 => policy.target,
            _ => {
                note = Some("embedding/output kept at 8 bits".to_string());
                Target::Stored(GgmlType::Q8_0)
            }
        }
    } else {
        policy.target
    };
    let mut plan = TensorPlan {
        name: name.to_string(),
        dims: info.dims.clone(),
        from: info.ty,
        to: info.ty,
        action: Action::Keep,
        simulated: None,
        bytes_before,
        bytes_after: bytes_before,
        note,
        sim: None,
        importance: None,
    };
    if !quant::is_supported(info.ty) {
        plan.note = Some(format!("{} cannot be decoded: copied unchanged", info.ty));
        return plan;
    }
    let cols = info.dims.first().copied().unwrap_or(1);
    match target {
        Target::Simulated(f) => {
            plan.action = Action::Simulate;
            plan.to = GgmlType::F32;
            plan.simulated = Some(f.name());
            plan.sim = Some(f);
        }
        Target::Stored(want) => {
            let mut ty = want;
            while !cols.is_multiple_of(ty.block_size() as u64) {
                ty = fallback(ty);
            }
            if ty != want {
                plan.note = Some(format!(
                    "rows of {cols} are not a multiple of {want}'s block of {}: stored as {ty}",
                    want.block_size()
                ));
            }
            if ty != info.ty {
                plan.action = Action::Encode;
                plan.to = ty;
            }
            if quant::weighted::has_weighted_encoder(ty)
                && let Some(imp) = policy.importance.as_ref().and_then(|i| i.get(name))
                && imp.len() as u64 == cols
            {
                plan.action = Action::Encode;
                plan.to = ty;
                plan.importance = Some(imp.to_vec().into());
            }
        }
    }
    plan.bytes_after = plan.to.bytes_for(info.n_elements()).unwrap_or(bytes_before);
    plan
}

/// Decides what happens to every tensor of `file`, without converting anything.
pub fn plan(file: &GgufFile, policy: &Policy) -> Vec<TensorPlan> {
    file.tensors().iter().map(|t| plan_one(t, policy)).collect()
}

/// Rows per parallel encoding task: whole rows keep every block inside one task.
fn encode(plan: &TensorPlan, bytes: &[u8]) -> Result<Vec<u8>, QuantError> {
    // A compressed 2:4 tensor into its dense twin: the exact bytes, not a second rounding.
    if quant::sparse::dense_type(plan.from) == Some(plan.to) && plan.sim.is_none() {
        return quant::sparse::expand_to_dense(plan.from, bytes).map(|(_, b)| b);
    }
    let n: u64 = plan.dims.iter().product();
    let cols = plan.dims.first().copied().unwrap_or(1).max(1) as usize;
    let mut x = quant::dequantize_to_vec(plan.from, bytes, n as usize)?;
    if let Some(f) = plan.sim {
        f.fake_quantize_in_place(&mut x, cols);
        return quant::quantize(GgmlType::F32, &x);
    }
    // Encode in parallel over groups of whole rows.
    let rows_per_task = (65536 / cols).max(1);
    let parts: Vec<Result<Vec<u8>, QuantError>> = x
        .par_chunks(rows_per_task * cols)
        .map(|chunk| match &plan.importance {
            Some(imp) => quant::weighted::quantize_weighted(plan.to, chunk, imp),
            None => quant::quantize(plan.to, chunk),
        })
        .collect();
    let mut out = Vec::with_capacity(plan.bytes_after as usize);
    for p in parts {
        out.extend_from_slice(&p?);
    }
    Ok(out)
}

/// Converts every tensor of `file` under `policy` into a writer (metadata carried over,
/// `general.file_type` updated). `progress(done, total)` is called after each tensor.
pub fn convert<'a>(
    file: &'a GgufFile,
    policy: &Policy,
    mut progress: impl FnMut(usize, usize),
) -> Result<(GgufWriter<'a>, ConvertReport), ConvertError> {
    let plans = plan(file, policy);
    let mut w = GgufWriter::from_file(file);
    let total = plans.len();
    for (i, (p, t)) in plans.iter().zip(w.tensors.iter_mut()).enumerate() {
        debug_assert_eq!(p.name, t.name);
        if p.action != Action::Keep {
            let data = encode(p, &t.data).map_err(|source| ConvertError::Quant {
                tensor: p.name.clone(),
                source,
            })?;
            t.ty = p.to;
            t.data = Cow::Owned(data);
        }
        progress(i + 1, total);
    }
    let bulk = match policy.target {
        Target::Stored(t) => t,
        Target::Simulated(_) => GgmlType::F32,
    };
    let file_type = llama_file_type(bulk);
    if let Some(ft) = file_type {
        w.set("general.file_type", Value::U32(ft));
    }
    if !is_float(bulk) {
        w.set("general.quantization_version", Value::U32(2));
    }
    let report = ConvertReport {
        target: policy.target.name(),
        bytes_before: plans.iter().map(|p| p.bytes_before).sum(),
        bytes_after: plans.iter().map(|p| p.bytes_after).sum(),
        requantized: plans
            .iter()
            .filter(|p| p.action != Action::Keep && !is_float(p.from))
            .count(),
        fallbacks: plans
            .iter()
            .filter(|p| p.note.as_deref().is_some_and(|n| n.contains("stored as")))
            .map(|p| format!("{}: {}", p.name, p.note.as_deref().unwrap_or_default()))
            .collect(),
        file_type,
        tensors: plans,
    };
    Ok((w, report))
}

/// Converts to a GGUF file at `out` (written atomically). Research formats are refused: they
/// have no GGUF type.
pub fn quantize_file(
    file: &GgufFile,
    policy: &Policy,
    out: impl AsRef<std::path::Path>,
    progress: impl FnMut(usize, usize),
) -> Result<ConvertReport, ConvertError> {
    let sim = std::iter::once(&policy.target)
        .chain(policy.rules.iter().map(|r| &r.target))
        .find(|t| matches!(t, Target::Simulated(_)));
    if let Some(t) = sim {
        return Err(ConvertError::NotStorable { target: t.name() });
    }
    let (w, report) = convert(file, policy, progress)?;
    w.write_file(out)?;
    Ok(report)
}

/// Converts into a new in-memory file (in-situ quantization at load time).
pub fn quantize_in_memory(
    file: &GgufFile,
    policy: &Policy,
    progress: impl FnMut(usize, usize),
) -> Result<(GgufFile, ConvertReport), ConvertError> {
    let (w, report) = convert(file, policy, progress)?;
    let bytes = w.to_bytes()?;
    drop(w);
    Ok((GgufFile::from_bytes(bytes)?, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match(
            "blk.*.ffn_down.weight",
            "blk.12.ffn_down.weight"
        ));
        assert!(!glob_match("blk.*.ffn_down.weight", "blk.12.ffn_up.weight"));
        assert!(glob_match("*", ""));
        assert!(glob_match("blk.?.attn_*", "blk.3.attn_q.weight"));
        assert!(!glob_match("blk.?.attn_*", "blk.13.attn_q.weight"));
        assert!(glob_match("output.weight", "output.weight"));
        assert!(!glob_match("output", "output.weight"));
    }

    #[test]
    fn targets_and_rules_parse() {
        assert_eq!(
            "q4_k".parse::<Target>().unwrap(),
            Target::Stored(GgmlType::Q4_K)
        );
        assert!(matches!(
            "int4-b64".parse::<Target>().unwrap(),
            Target::Simulated(_)
        ));
        let e = "iq2_xs".parse::<Target>().unwrap_err().to_string();
        assert!(
            e.contains("unknown type \"iq2_xs\"") && e.contains("q4_k") && e.contains("nf4"),
            "{e}"
        );
        let r: Rule = "blk.*.ffn_down.weight=q8_0".parse().unwrap();
        assert_eq!(r.target, Target::Stored(GgmlType::Q8_0));
        assert!("nonsense".parse::<Rule>().is_err());
        assert!("x=".parse::<Rule>().is_err());
        assert!("x=q9".parse::<Rule>().is_err());
    }
}
