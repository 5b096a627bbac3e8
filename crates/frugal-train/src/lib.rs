//! frugal's training engine: trainable f32 parameters loaded from any GGUF the inference engine
//! runs, a forward pass that keeps what the backward needs, a hand-written backward for every
//! operation (llm.c's style: each layer's forward and backward are one function, top to
//! bottom), AdamW, and distillation from one or more teachers.
//!
//! Data flows: [`data`] windows → [`model`] forward (saving activations) → [`loss`] on the
//! logits (labels, and the [`teacher`]'s distribution) and [`hidden`] states → backward →
//! [`optim`] AdamW. [`trainer`] drives that loop, [`checkpoint`] saves and resumes it,
//! [`student`] builds the model to train and [`output`] writes it as GGUF.
//!
//! The inference library does not depend on this crate.

pub mod attention;
pub mod checkpoint;
pub mod data;
pub mod error;
pub mod gemm;
pub mod hidden;
pub mod loss;
pub mod math;
pub mod model;
pub mod ops;
pub mod optim;
pub mod output;
pub mod params;
pub mod student;
pub mod teacher;
pub mod trainer;

pub use error::{Result, TrainError};
pub use params::{LayerParams, Params, Tensor};

#[cfg(test)]
mod gradcheck;
