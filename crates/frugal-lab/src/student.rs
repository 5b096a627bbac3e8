//! Students: smaller models made from a teacher, to be distilled from it ([`crate::heal`]).
//! A layer-dropped student keeps the layers whose removal costs the most; a narrower one also
//! keeps only the leading channels, heads and FFN units of those layers.

use anyhow::Result;
use frugal_train::Params;
use frugal_train::data::Windows;
use frugal_train::gemm::Precision;
use frugal_train::student::{
    Importance, StudentConfig, choose_layers, keep_layers, layer_importance,
};

/// A student cut from a teacher by dropping layers.
pub struct Cut {
    /// Per teacher layer: the loss increase (nats) when that layer alone is skipped.
    pub importance: Vec<f64>,
    /// The teacher layers kept, in order (the first and last always).
    pub keep: Vec<usize>,
    pub params: Params,
}

/// A student of `teacher` with `n_layers` of its layers: those whose skipping raises the loss
/// on `calib` the most.
pub fn layer_dropped(
    teacher: &Params,
    n_layers: usize,
    calib: &Windows,
    prec: Precision,
) -> Result<Cut> {
    let mut scratch = teacher.clone();
    let importance = layer_importance(&mut scratch, calib, Importance::LossIncrease, prec);
    drop(scratch);
    let keep = choose_layers(&importance, n_layers);
    let params = keep_layers(teacher, &keep)?;
    Ok(Cut {
        importance,
        keep,
        params,
    })
}

/// A student of another architecture: `keep`'s layers of `teacher`, two thirds as wide (width
/// and FFN rounded up to 32, two thirds of the query heads, at most as many KV heads), each
/// weight initialized from the teacher's leading channels, heads and FFN units.
pub fn narrower(teacher: &Params, keep: &[usize], seed: u64) -> Result<Params> {
    let c = &teacher.config;
    let heads = (c.n_head * 2 / 3).max(1);
    let sc = StudentConfig {
        n_layers: Some(keep.len()),
        n_embd: Some((c.n_embd * 2 / 3).next_multiple_of(32).min(c.n_embd)),
        n_ff: Some((c.n_ff * 2 / 3).next_multiple_of(32).min(c.n_ff)),
        n_head: Some(heads),
        n_head_kv: Some(c.n_head_kv.min(heads).max(1)),
        head_dim: Some(c.head_dim),
        init: Some("teacher".into()),
    };
    Ok(sc.build(&keep_layers(teacher, keep)?, seed)?)
}
