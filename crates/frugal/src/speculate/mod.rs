//! Speculative decoding: a cheap drafter proposes K tokens, the target checks them all in one
//! pass, and the output is exactly the target's.
//!
//! Decoding one token reads every weight once; checking K + 1 tokens in one pass reads them once
//! too, so each accepted draft token is a decode step saved. The pieces:
//! - [`rule`]: which drafted tokens to keep: greedy identity, or the Leviathan/Chen rule that
//!   keeps the target's sampling distribution exact.
//! - drafters: [`ngram`] (prompt lookup, no model), [`store`] (retrieval from a datastore of the
//!   model's earlier answers, no model), [`draft_model`] (a smaller model with the
//!   same vocabulary), the target's own first layers (an early exit that shares its cache with the
//!   target, `target.rs`), and draft heads trained on the model's own outputs.
//! - [`Speculator`] (`decode.rs`): the loop, with an adaptive draft length that falls back to
//!   plain decoding where drafts are rejected, so speculation costs little when it does not pay.

mod decode;
pub mod draft_model;
pub mod heads;
pub mod ngram;
pub mod rule;
pub mod store;
mod target;
#[cfg(test)]
mod tests;

pub use decode::{
    DEFAULT_PASS_COST, DraftLength, Drafter, LOOKUP_PASS_COST, PassCost, SpecStats, Speculator,
};
pub use draft_model::{DraftModel, check_same_vocabulary};
pub use heads::{DraftHeads, HeadWeights};

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::gguf::GgufFile;
use crate::sample::Sampler;
use std::str::FromStr;

/// Opens `path`, a GGUF of one of frugal's own kinds (`arch`: draft heads, a datastore), or
/// says it is not `what` and which `frugal` command makes one.
fn open_kind(path: &Path, arch: &str, what: &str, command: &str) -> crate::error::Result<GgufFile> {
    let f = GgufFile::open(path)?;
    if f.str_opt("general.architecture")? != Some(arch) {
        return Err(Error::Invalid(format!(
            "{}: not {what} (general.architecture is not {arch}; make one with `frugal {command}`)",
            path.display()
        )));
    }
    Ok(f)
}

/// Which drafter proposes tokens: the value of `--speculate`.
#[derive(Clone, Debug, PartialEq)]
pub enum Method {
    /// Prompt lookup over suffixes of up to `n` tokens.
    Ngram { n: usize },
    /// The target's first `layers` layers, then its final norm and head.
    EarlyExit { layers: usize },
    /// Another model with the same vocabulary.
    Draft { path: PathBuf },
    /// Draft heads trained on the target (`frugal train-heads`); with `lookup`, prompt lookup
    /// over suffixes of up to that many tokens drafts first and the heads draft where it finds
    /// no match worth drafting from (`ngram+heads:FILE`).
    Heads {
        path: PathBuf,
        lookup: Option<usize>,
    },
    /// Retrieval from a datastore of the model's own answers (`frugal build-store`), after
    /// prompt lookup: the context is searched first, the store where the context has no match.
    Store { path: PathBuf },
}

/// A drafter and the most tokens it drafts per pass.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecOptions {
    pub method: Method,
    /// Most tokens drafted per target pass (K).
    pub k: usize,
    /// Shrink K (down to plain decoding) when acceptance falls, grow it back when it rises.
    pub adaptive: bool,
    /// A draft model scores only its first this many token ids (FR-Spec); `None`: all.
    pub draft_vocab: Option<usize>,
}

/// The longest draft a pass verifies.
pub const MAX_K: usize = 64;

/// Suffix length tried first by prompt lookup when `ngram` names none.
pub const DEFAULT_NGRAM: usize = 3;

impl FromStr for SpecOptions {
    type Err = String;

    /// `ngram[:N][:K]`, `self:L[:K]`, `draft:FILE[:K]`, `heads:FILE[:K]`,
    /// `ngram+heads:FILE[:K]` or `store:FILE[:K]`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad_k = || "the draft length K must be at least 1".to_string();
        let number = |what: &str, v: &str| {
            v.parse::<usize>().map_err(|_| {
                format!("{what} in --speculate {s:?} must be a whole number, not {v:?}")
            })
        };
        let (kind, rest) = s.split_once(':').unwrap_or((s, ""));
        let parts: Vec<&str> = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split(':').collect()
        };
        let (method, k) = match kind {
            "ngram" => {
                if parts.len() > 2 {
                    return Err(format!("--speculate {s:?}: expected ngram[:N][:K]"));
                }
                let n = match parts.first() {
                    Some(v) => number("N", v)?,
                    None => DEFAULT_NGRAM,
                };
                if n == 0 {
                    return Err("the n-gram length N must be at least 1".into());
                }
                let k = parts.get(1).map(|v| number("K", v)).transpose()?;
                (Method::Ngram { n }, k.unwrap_or(8))
            }
            "self" => {
                if parts.is_empty() || parts.len() > 2 {
                    return Err(format!("--speculate {s:?}: expected self:L[:K]"));
                }
                let layers = number("L", parts[0])?;
                if layers == 0 {
                    return Err("the early exit L must be at least 1 layer".into());
                }
                let k = parts.get(1).map(|v| number("K", v)).transpose()?;
                (Method::EarlyExit { layers }, k.unwrap_or(4))
            }
            "draft" | "heads" | "ngram+heads" | "store" => {
                // A trailing :K is a number; everything before it is the path.
                let (path, k) = match rest.rsplit_once(':') {
                    Some((p, k)) if !p.is_empty() && k.chars().all(|c| c.is_ascii_digit()) => {
                        (p, Some(number("K", k)?))
                    }
                    _ => (rest, None),
                };
                if path.is_empty() {
                    return Err(format!("--speculate {s:?}: expected {kind}:FILE[:K]"));
                }
                let path = PathBuf::from(path);
                match kind {
                    // Without K, every head of the file drafts.
                    "heads" => (Method::Heads { path, lookup: None }, k.unwrap_or(MAX_K)),
                    "ngram+heads" => (
                        Method::Heads {
                            path,
                            lookup: Some(DEFAULT_NGRAM),
                        },
                        // Prompt lookup's default; the heads draft at most their number.
                        k.unwrap_or(8),
                    ),
                    "store" => (Method::Store { path }, k.unwrap_or(8)),
                    _ => (Method::Draft { path }, k.unwrap_or(4)),
                }
            }
            other => {
                return Err(format!(
                    "unknown drafter {other:?} in --speculate: expected ngram[:N][:K], self:L[:K], draft:FILE[:K], heads:FILE[:K], ngram+heads:FILE[:K] or store:FILE[:K]"
                ));
            }
        };
        if k == 0 {
            return Err(bad_k());
        }
        if k > MAX_K {
            return Err(format!("the draft length K is at most {MAX_K}, not {k}"));
        }
        Ok(SpecOptions {
            method,
            k,
            adaptive: true,
            draft_vocab: None,
        })
    }
}

/// The draft token from `logits` after `seq`: the sampler's greedy choice, or a draw whose
/// distribution goes to `q[j]`.
pub(crate) fn draft_token(
    sampler: &mut Sampler,
    logits: &[f32],
    seq: &[u32],
    gen_start: usize,
    j: usize,
    q: &mut Vec<Vec<(u32, f32)>>,
) -> u32 {
    let generated = &seq[gen_start.min(seq.len())..];
    if sampler.params.temperature <= 0.0 {
        return sampler.sample_with(logits, seq, generated);
    }
    if q.len() <= j {
        q.push(Vec::new());
    }
    sampler.distribution(logits, seq, generated, &mut q[j]);
    sampler.draw(&q[j]).unwrap_or(q[j][0].0)
}
