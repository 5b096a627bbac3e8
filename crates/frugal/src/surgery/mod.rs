//! Model surgery: read a GGUF, change the architecture's shape, write a GGUF that frugal (and,
//! where GGUF can express it, llama.cpp) runs. Surgery never adds a branch to the forward pass;
//! distillation (`frugal distill --student OUT`) heals what it costs.
//!
//! - [`attention`]: regroup KV heads (MHA, GQA with G groups, MQA).
//! - [`mla`]: GQA to multi-head latent attention (partial RoPE, a shared RoPE key, a joint
//!   low-rank latent), calibrated.
//! - [`prune`]: fewer weights: magnitude, Wanda and SparseGPT, unstructured and N:M, and
//!   structured removal of FFN neurons, KV groups and layers.
//! - [`moe`]: dense FFNs to routed experts (MoEfication) and sparse upcycling.
//! - [`importance`]: the column importance that weighted quantization (`--imatrix`) reads.

pub mod attention;
pub mod importance;
pub mod mla;
pub mod moe;
pub mod prune;

pub use attention::{AttentionLayout, LayoutReport, convert_attention};
pub use mla::{Calibration, Factorization, MlaReport, MlaTarget, calibrate, convert_to_mla};

use crate::gguf::GgufError;
use crate::quant::QuantError;

#[derive(Debug, thiserror::Error)]
pub enum SurgeryError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{0}: {1}")]
    Quant(String, QuantError),
    #[error("{0}")]
    Invalid(String),
}
