//! `frugal fetch`: download and verify the default model.

use anyhow::Result;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Download again even if the model is already in the cache
    #[arg(long)]
    pub force: bool,
}

pub fn run(a: Args) -> Result<()> {
    let path = if a.force {
        frugal::fetch::fetch_default_model(&mut |m| eprintln!("{m}"))?
    } else {
        frugal::fetch::ensure_default_model(|m| eprintln!("{m}"))?
    };
    println!("{}", path.display());
    Ok(())
}
