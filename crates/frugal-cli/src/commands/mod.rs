//! One file per command; `common` holds the flags they share.

pub mod analyze;
pub mod bench;
pub mod build_store;
pub mod chat;
pub mod common;
pub mod convert;
pub mod corpus;
pub mod estimate;
pub mod eval;
pub mod fetch;
pub mod font;
pub mod generate;
pub mod info;
pub mod moefy;
pub mod prune;
pub mod quantize;
pub mod report;
pub mod report_attention;
pub mod report_distill;
pub mod report_moe;
pub mod report_prune;
pub mod serve;
pub mod tokenize;
pub mod train;
pub mod train_heads;
pub mod train_router;
