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
pub mod heads;
pub mod hidden;
pub mod latent;
pub mod layer;
pub mod loss;
pub mod math;
pub mod model;
pub mod moe;
pub mod ops;
pub mod optim;
pub mod output;
pub mod params;
pub mod router;
pub mod student;
pub mod teacher;
pub mod trainer;

pub use error::{Result, TrainError};

/// Asks the C allocator to keep freed memory for reuse instead of returning large blocks to the
/// system: a training step allocates and frees the same few hundred megabytes of activations
/// every step, and with glibc's defaults each block above 32 MB is a fresh `mmap` whose pages
/// the kernel faults in and zeroes again (10% of a step, measured). Call it once from a
/// program that trains; it changes allocation policy for the whole process.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; the values are in range.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}
pub use params::{
    AttnBiases, ExtraNorms, FfnParams, KvParams, LayerParams, Params, Stored, Tensor,
};

#[cfg(test)]
mod gradcheck;
