//! `frugal tokenize`: the ids a model's tokenizer gives a text, as `llama-tokenize --ids`
//! prints them. Reads only the file's metadata, so a vocab-only file (no tensors) or the first
//! part of a split download does.

use std::path::PathBuf;

use anyhow::{Context, Result};
use frugal::gguf::GgufFile;
use frugal::tokenizer::Tokenizer;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The GGUF file (a vocab-only file will do)
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// The text to tokenize
    pub text: Option<String>,
    /// Read the text from this file instead
    #[arg(short = 'f', long = "file", conflicts_with = "text")]
    pub file: Option<PathBuf>,
    /// Turn control-token texts (such as `<|im_start|>`) into their ids
    #[arg(long)]
    pub parse_special: bool,
    /// Print each id with the text of its piece, one per line
    #[arg(long)]
    pub pieces: bool,
    /// Write a vocab-only copy of the model (its metadata, no tensors) to this file
    #[arg(long = "write-vocab", value_name = "OUT")]
    pub write_vocab: Option<PathBuf>,
}

pub fn run(a: Args) -> Result<()> {
    let f = GgufFile::open_metadata(&a.model)
        .with_context(|| format!("reading {}", a.model.display()))?;
    if let Some(out) = &a.write_vocab {
        let mut w = frugal::gguf::GgufWriter::from_file(&f);
        w.tensors.clear();
        w.write_file(out)?;
        eprintln!("wrote {} (metadata only)", out.display());
    }
    let text = match (&a.text, &a.file) {
        (Some(t), _) => t.clone(),
        (None, Some(p)) => {
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?
        }
        (None, None) if a.write_vocab.is_some() => return Ok(()),
        (None, None) => anyhow::bail!("give a text, or --file"),
    };
    let tok = Tokenizer::from_gguf(&f)
        .with_context(|| format!("reading the tokenizer of {}", a.model.display()))?;
    let ids = tok.encode(&text, a.parse_special)?;
    if a.pieces {
        for &id in &ids {
            let piece = String::from_utf8_lossy(tok.token_bytes(id, true)).into_owned();
            println!("{id:>7} -> {piece:?}");
        }
    } else {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("[{}]", list.join(", "));
    }
    Ok(())
}
