//! GGUF, llama.cpp's model file format: a validated memory-mapped reader and a writer.
//!
//! Layout (versions 2 and 3, little-endian): magic `GGUF`, version, tensor count, metadata count,
//! the metadata key/values, the tensor infos, padding to `general.alignment` (default 32), then the
//! tensor data. Every count, length and offset is checked against the bytes actually present before
//! it is used, so a truncated or corrupted file yields a [`GgufError`], never a panic or a huge
//! allocation.

mod reader;
mod value;
mod writer;

pub use reader::{GgufFile, SharedBytes, TensorInfo};
pub use value::{Array, Value, ValueType};
pub use writer::{GgufWriter, TensorData};

use crate::quant::GgmlType;

/// The four magic bytes at the start of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of each tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest nesting of arrays accepted; real files use at most 2.
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most dimensions a tensor may have (ggml's GGML_MAX_DIMS).
pub const MAX_DIMS: usize = 4;

/// Everything that can be wrong with a GGUF file. Each variant names what was being read and,
/// where it applies, the byte offset at which the problem was found.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: Vec<u8> },
    #[error("unsupported GGUF version {version} (frugal reads versions 2 and 3)")]
    UnsupportedVersion { version: u32 },
    #[error(
        "file truncated while reading {what} at byte {offset}: need {needed} bytes, {available} left"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("metadata key {key:?}: unknown value type {type_id} at byte {offset}")]
    UnknownValueType {
        key: String,
        type_id: u32,
        offset: u64,
    },
    #[error("tensor {tensor:?}: unknown tensor type id {type_id} at byte {offset}")]
    UnknownTensorType {
        tensor: String,
        type_id: u32,
        offset: u64,
    },
    #[error("{what}: string at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} at byte {offset}")]
    TooDeep { key: String, offset: u64 },
    #[error("metadata key {key:?} appears twice (second at byte {offset})")]
    DuplicateKey { key: String, offset: u64 },
    #[error("tensor {tensor:?} appears twice (second at byte {offset})")]
    DuplicateTensor { tensor: String, offset: u64 },
    #[error("tensor {tensor:?} (info at byte {offset}): {reason}")]
    BadTensor {
        tensor: String,
        offset: u64,
        reason: String,
    },
    #[error("metadata key {key:?}: {reason}")]
    BadValue { key: String, reason: String },
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("tensor {tensor:?} is missing")]
    MissingTensor { tensor: String },
    #[error("tensor {tensor:?} has type {ty}, which frugal cannot {action}")]
    UnsupportedType {
        tensor: String,
        ty: GgmlType,
        action: &'static str,
    },
    #[error("writing GGUF: {0}")]
    Write(String),
}

pub type Result<T> = std::result::Result<T, GgufError>;
