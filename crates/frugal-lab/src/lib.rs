//! The measurement and model-building pipelines that `frugal report ...` and `frugal optimize`
//! share, underneath the command line: the CLI parses flags and renders tables; this crate
//! builds candidate models and measures them against a base.
//!
//! A candidate is a GGUF file in memory (or on disk) made from the base by one or more levers
//! ([`build`]: quantization, pruning, attention-layout conversion; [`moe`]: MoE conversion;
//! [`student`]: layer-dropped and narrower students; [`heal`]: distillation from the base,
//! then re-quantization). It is then measured:
//! - quality against the base on the same text ([`quality`]: mean and p99 KL, perplexity and
//!   its change, top-1 agreement; [`moe::measure`] adds the routing load);
//! - speed, timed back to back with the base so that a shared machine's drift cancels in the
//!   ratio ([`timing`]: prefill and decode medians and ratios);
//! - memory ([`size`]: parameters, weight bytes, zero weights, KV bytes per token measured on a
//!   real cache, weights + KV at a context).
//!
//! [`router`] trains a MoE model's routers against the dense FFN; [`corpus`] generates the
//! model's own answers (what draft heads and retrieval stores learn from).
//!
//! A [`candidate::Candidate`] is one such model measured (name, size, quality, speed). The
//! studies behind the reports put the levers and measurements together into rows:
//! [`prune_study`] (`report prune`), [`moe_study`] (`report moe`), [`distill_study`]
//! (`report distill`); the CLI turns their rows into tables and charts.
//!
//! Nothing here prints: long pipelines report [`progress::Progress`] through callbacks.

pub mod build;
pub mod candidate;
pub mod corpus;
pub mod distill_study;
pub mod heal;
pub mod moe;
pub mod moe_study;
pub mod optimize;
pub mod progress;
pub mod prune_study;
pub mod quality;
pub mod router;
pub mod size;
pub mod student;
pub mod timing;
