//! The library's error type: every failure a caller can cause, with a message that names it.

use crate::gguf::GgufError;
use crate::kv::KvError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("the input is empty: nothing to process")]
    EmptyInput,
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
    #[error("the prompt has {prompt} tokens, but the context holds only {ctx}")]
    PromptTooLong { prompt: usize, ctx: usize },
    #[error("{0}")]
    Invalid(String),
    #[error("fetching the model: {0}")]
    Fetch(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T> = std::result::Result<T, Error>;
