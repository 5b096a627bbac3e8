//! One file per command; `common` holds the flags they share.

pub mod bench;
pub mod chat;
pub mod common;
pub mod eval;
pub mod fetch;
pub mod generate;
pub mod info;
