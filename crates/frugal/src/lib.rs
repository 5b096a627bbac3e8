//! frugal: an LLM inference engine in which every efficiency lever is a real, composable switch
//! whose cost and benefit the tool measures.
//!
//! Data flows one way: text → [`tokenizer`] → token ids → [`model::Model::forward`] (per layer:
//! norm → [`attention`] over the [`kv`] cache → norm → FFN; every matrix product goes through
//! [`quant`] on the stored format) → logits → [`sample`] → token → detokenizer → text.
//! [`generate`] drives that loop; [`eval`] scores text; [`gguf`] reads and writes model files.

pub mod analyze;
pub mod attention;
pub mod bench;
pub mod chat;
pub mod convert;
pub mod cpu;
pub mod error;
pub mod estimate;
pub mod eval;
pub mod fetch;
pub mod generate;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod ops;
mod pages;
pub mod quant;
pub mod sample;
pub mod speculate;
pub mod surgery;
pub mod team;
pub mod tokenizer;

pub use error::{Error, Result};
