//! Tokenization built from the vocabulary stored in GGUF metadata, for both kinds llama.cpp
//! reads most: byte-level BPE with stored merges (`byte_level`, `tokenizer.ggml.model =
//! gpt2`) and SentencePiece with scores and byte fallback (`spm`, `llama`).
//!
//! The merging itself is the `tokenizers` crate's BPE; this module assembles it the way
//! llama.cpp does for the file, splits out special tokens only where the caller asks, and
//! decodes token ids back to bytes as a stream that never emits half of a UTF-8 character.

mod byte_level;
mod spm;

pub use byte_level::byte_level_chars;
use tokenizers::Tokenizer as HfTokenizer;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// GGUF token types (`tokenizer.ggml.token_type`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_i32(v: i32) -> Self {
        match v {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// Control tokens that end a turn or a document in common chat formats; generation stops on
/// them as llama.cpp does.
const END_OF_GENERATION: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|return|>",
];

pub struct Tokenizer {
    bpe: HfTokenizer,
    tokens: Vec<String>,
    /// Token texts split out of the input even in plain text (user-defined tokens), and with
    /// `parse_special` also the control tokens; longest first.
    user_defined: Vec<(String, u32)>,
    control: Vec<(String, u32)>,
    /// The bytes each token stands for as plain text (empty for control tokens), decoded once
    /// so streaming a token is a slice lookup.
    pieces: Vec<Box<[u8]>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub add_bos: bool,
    eog: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.tokens.len())
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let model = f.str("tokenizer.ggml.model")?;
        if !matches!(model, "gpt2" | "llama") {
            return Err(tok_err(format!(
                "tokenizer.ggml.model = {model:?} is not supported (frugal reads byte-level BPE, \"gpt2\", and SentencePiece, \"llama\")"
            )));
        }
        let tokens: Vec<String> = f
            .str_array("tokenizer.ggml.tokens")?
            .into_iter()
            .map(String::from)
            .collect();
        let types: Vec<TokenType> = match f.get("tokenizer.ggml.token_type") {
            Some(_) => f
                .i32_array("tokenizer.ggml.token_type")?
                .into_iter()
                .map(TokenType::from_i32)
                .collect(),
            None => vec![TokenType::Normal; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(tok_err(format!(
                "{} token types for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let id = |key: &str| -> Result<Option<u32>> {
            match f.u32_opt(key)? {
                Some(i) if (i as usize) < tokens.len() => Ok(Some(i)),
                Some(i) => Err(tok_err(format!(
                    "{key} = {i} is outside the vocabulary of {}",
                    tokens.len()
                ))),
                None => Ok(None),
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let eot = id("tokenizer.ggml.eot_token_id")?;
        let add_bos = f.bool_opt("tokenizer.ggml.add_bos_token")?.unwrap_or(false);
        let (bpe, pieces): (HfTokenizer, Vec<Box<[u8]>>) = if model == "gpt2" {
            let merges = f.str_array("tokenizer.ggml.merges")?;
            let pre = f.str_opt("tokenizer.ggml.pre")?.unwrap_or("default");
            let bpe = byte_level::build(&tokens, &merges, pre)?;
            let piece = byte_level::pieces(&tokens);
            (bpe, (0..tokens.len()).map(piece).collect())
        } else {
            if f.bool_opt("tokenizer.ggml.add_space_prefix")? == Some(true) {
                return Err(tok_err(
                    "tokenizer.ggml.add_space_prefix = true is not supported (SentencePiece vocabularies without the dummy prefix only, as Gemma's)",
                ));
            }
            let scores = f.f32_array("tokenizer.ggml.scores")?;
            let bpe = spm::build(&tokens, &scores, &types)?;
            let pieces = tokens
                .iter()
                .zip(&types)
                .map(|(t, &ty)| spm::piece(t, ty))
                .collect();
            (bpe, pieces)
        };
        Ok(Self::assemble(
            bpe, tokens, types, pieces, bos, eos, eot, add_bos,
        ))
    }

    /// The tokenizer around a built BPE: special tokens sorted out, the pieces each token
    /// decodes to (`pieces[i]` for plain tokens; control tokens decode to nothing).
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        bpe: HfTokenizer,
        tokens: Vec<String>,
        types: Vec<TokenType>,
        mut pieces: Vec<Box<[u8]>>,
        bos: Option<u32>,
        eos: Option<u32>,
        eot: Option<u32>,
        add_bos: bool,
    ) -> Self {
        let mut user_defined = Vec::new();
        let mut control = Vec::new();
        for (i, (t, ty)) in tokens.iter().zip(&types).enumerate() {
            match ty {
                TokenType::UserDefined => user_defined.push((t.clone(), i as u32)),
                TokenType::Control if !t.is_empty() => control.push((t.clone(), i as u32)),
                _ => {}
            }
        }
        user_defined.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        control.sort_by_key(|(t, _)| std::cmp::Reverse(t.len()));
        let mut eog: Vec<u32> = [eos, eot].into_iter().flatten().collect();
        eog.extend(
            control
                .iter()
                .filter(|(t, _)| END_OF_GENERATION.contains(&t.as_str()))
                .map(|&(_, i)| i),
        );
        eog.sort_unstable();
        eog.dedup();
        for ((p, t), ty) in pieces.iter_mut().zip(&tokens).zip(&types) {
            match ty {
                TokenType::Control | TokenType::Unknown | TokenType::Unused => *p = Box::default(),
                TokenType::UserDefined => *p = t.as_bytes().into(),
                _ => {}
            }
        }
        Tokenizer {
            bpe,
            tokens,
            user_defined,
            control,
            pieces,
            bos,
            eos,
            add_bos,
            eog,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The stored text of a token (byte-level encoded).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The tokens that end generation, sorted.
    pub fn end_of_generation_ids(&self) -> &[u32] {
        &self.eog
    }

    /// Whether generation should stop at this token.
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Tokenizes `text`. With `parse_special`, control-token texts such as `<|im_start|>` become
    /// their ids; otherwise they are tokenized as ordinary text. Adds BOS when the model asks.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        let mut rest = text;
        let mut plain_start = 0;
        let mut i = 0;
        // Scan for special-token texts; the plain text between them goes through BPE.
        while i < rest.len() {
            let tail = &rest[i..];
            let hit = self
                .user_defined
                .iter()
                .chain(if parse_special {
                    self.control.iter()
                } else {
                    [].iter()
                })
                .filter(|(t, _)| tail.starts_with(t.as_str()))
                .max_by_key(|(t, _)| t.len());
            match hit {
                Some((t, id)) => {
                    self.encode_plain(&rest[plain_start..i], &mut ids)?;
                    ids.push(*id);
                    rest = &rest[i + t.len()..];
                    plain_start = 0;
                    i = 0;
                }
                None => i += tail.chars().next().map_or(1, char::len_utf8),
            }
        }
        self.encode_plain(&rest[plain_start..], &mut ids)?;
        Ok(ids)
    }

    fn encode_plain(&self, text: &str, ids: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let enc = self.bpe.encode(text, false).map_err(tok_err)?;
        ids.extend_from_slice(enc.get_ids());
        Ok(())
    }

    /// The raw bytes a token stands for. Control tokens render as nothing unless
    /// `render_special` is set (then as their text); unknown ids render as nothing.
    pub fn token_bytes(&self, id: u32, render_special: bool) -> &[u8] {
        let i = id as usize;
        match self.pieces.get(i) {
            Some(p) if p.is_empty() && render_special => self.tokens[i].as_bytes(),
            Some(p) => p,
            None => &[],
        }
    }

    /// Decodes a whole sequence (invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&i| self.token_bytes(i, false).iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Streams token bytes out as text, holding back an incomplete UTF-8 character until the tokens
/// that complete it arrive.
#[derive(Default, Debug)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds one token's bytes and returns the text that is now complete (possibly empty).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(
                        std::str::from_utf8(&self.pending[..valid]).expect("validated prefix"),
                    );
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Flushes whatever is left at the end of generation.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_decoder_waits_for_whole_characters() {
        let mut d = StreamDecoder::default();
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(d.push(&euro[..1]), "");
        assert_eq!(d.push(&euro[1..2]), "");
        assert_eq!(d.push(&[euro[2], b'!']), "€!");
        assert_eq!(d.push(&[0xff, b'a']), "\u{FFFD}a");
        assert_eq!(d.push(&euro[..2]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
    }
}
