//! frugal's training engine: trainable f32 parameters loaded from any GGUF the inference engine
//! runs, a forward pass that keeps what the backward needs, a hand-written backward for every
//! operation (llm.c's style: each layer's forward and backward are one function, top to
//! bottom), AdamW, and distillation from one or more teachers.
//!
//! The inference library does not depend on this crate.

pub mod error;
pub mod gemm;
pub mod loss;
pub mod math;
pub mod model;
pub mod ops;
pub mod params;

pub use error::{Result, TrainError};
pub use params::{LayerParams, Params, Tensor};

#[cfg(test)]
mod gradcheck;
