//! The training engine's error type: every failure a caller can cause, named.

use frugal::gguf::GgufError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Engine(#[from] frugal::Error),
    #[error(transparent)]
    Kv(#[from] frugal::kv::KvError),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Shapes that cannot go together (a config that does not fit, a checkpoint of another
    /// model); the message names both shapes.
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error(
        "the student's vocabulary has {student} tokens, the teacher's {teacher}: distillation compares distributions over one vocabulary"
    )]
    VocabMismatch { student: usize, teacher: usize },
    /// A loss or gradient that is NaN or infinite: training stops at once, naming where.
    #[error("step {step}: {what} is not finite (in {tensor}); the last good checkpoint is kept")]
    NonFinite {
        step: usize,
        what: String,
        tensor: String,
    },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, TrainError>;

/// Wraps an I/O error with the path it concerns.
pub fn io_err(path: impl AsRef<std::path::Path>) -> impl FnOnce(std::io::Error) -> TrainError {
    let path = path.as_ref().display().to_string();
    move |source| TrainError::Io { path, source }
}
