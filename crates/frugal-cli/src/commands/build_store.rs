//! `frugal build-store`: a datastore of the model's own answers for retrieval drafting
//! (`--speculate store:FILE`, REST): the answers only, without their prompts, since the store
//! is matched against what the model writes.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use frugal::speculate::store::Datastore;

use super::common::{self, ModelArgs};
use super::corpus::CorpusArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Output datastore file (GGUF)
    #[arg(long = "out", required = true)]
    pub out: PathBuf,
    #[command(flatten)]
    pub corpus: CorpusArgs,
    #[command(flatten)]
    pub model: ModelArgs,
}

pub fn run(a: Args) -> Result<()> {
    let (model, tok) = common::load(&a.model)?;
    let seqs = a.corpus.sequences(&model, &tok)?;
    let t0 = Instant::now();
    let answers = seqs.iter().map(|(s, p)| &s[*p..]).filter(|s| !s.is_empty());
    let store = Datastore::new(answers, model.config.n_vocab)?;
    anyhow::ensure!(!store.is_empty(), "the model wrote no answer to store");
    store
        .write(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "stored {} tokens of {} answers (indexed in {:.1} s); wrote {}",
        store.len(),
        seqs.len(),
        t0.elapsed().as_secs_f64(),
        a.out.display()
    );
    Ok(())
}
