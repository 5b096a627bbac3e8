//! What the examples share: which model file to run.

use std::path::PathBuf;

/// The first argument (a path, or a known model's name), else the fetched reference model.
pub fn model_path() -> PathBuf {
    let path = match std::env::args_os().nth(1) {
        Some(arg) => frugal::fetch::resolve_model_arg(arg.as_ref()),
        None => frugal::fetch::default_model_path(),
    };
    if !path.exists() {
        eprintln!(
            "{} not found: pass a GGUF path, or run `frugal fetch` first",
            path.display()
        );
        std::process::exit(2);
    }
    path
}
