//! `frugal fetch [NAME]`: download and verify a model frugal knows by name.

use anyhow::{Result, bail};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The model: smollm2-135m (the default and reference) or gemma3-270m
    #[arg(default_value = "smollm2-135m")]
    pub name: String,
    /// Download again even if the model is already in the cache
    #[arg(long)]
    pub force: bool,
}

pub fn run(a: Args) -> Result<()> {
    let Some(model) = frugal::fetch::known_model(&a.name) else {
        let names: Vec<&str> = frugal::fetch::KNOWN_MODELS.iter().map(|m| m.name).collect();
        bail!(
            "unknown model {:?}: frugal fetches {}",
            a.name,
            names.join(", ")
        );
    };
    let mut log = |m: &str| eprintln!("{m}");
    let path = if a.force {
        model.fetch(&mut log)?
    } else {
        model.ensure(&mut log)?
    };
    println!("{}", path.display());
    Ok(())
}
