//! Byte-level BPE (`tokenizer.ggml.model = gpt2`): GPT-2's byte-to-character map, the stored
//! merges, and the pre-tokenizer regexes llama.cpp picks by `tokenizer.ggml.pre`.

use std::collections::HashMap;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{SplitDelimiterBehavior, Tokenizer as HfTokenizer};

use super::tok_err;
use crate::error::Result;

const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The BPE over `tokens` with the stored `merges` ("a b" each), behind the pre-tokenizer `pre`.
pub(super) fn build(tokens: &[String], merges: &[&str], pre: &str) -> Result<HfTokenizer> {
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| {
            tok_err(format!(
                "merge {i} ({m:?}) is not two tokens separated by a space"
            ))
        })?;
        pairs.push((a.to_string(), b.to_string()));
    }
    let ignore_merges = matches!(pre, "llama-bpe" | "llama3");
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tok_err)?;
    let mut hf = HfTokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    Ok(hf)
}

/// The bytes of each token's text, through GPT-2's character-to-byte map (a text outside the
/// map is taken as it is).
pub(super) fn pieces(tokens: &[String]) -> impl Fn(usize) -> Box<[u8]> + '_ {
    let byte_decoder: HashMap<char, u8> = bytes_to_unicode()
        .into_iter()
        .map(|(b, c)| (c, b))
        .collect();
    move |i| {
        let text = &tokens[i];
        text.chars()
            .map(|c| byte_decoder.get(&c).copied())
            .collect::<Option<Vec<u8>>>()
            .unwrap_or_else(|| text.as_bytes().to_vec())
            .into()
    }
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let byte_level =
        |regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        Ok(PreTokenizerWrapper::Split(
            Split::new(
                SplitPattern::Regex(re.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tok_err)?,
        ))
    };
    Ok(match pre {
        "default" | "gpt2" | "gpt-2" => byte_level(true),
        // llama.cpp: each digit alone, then the GPT-2 pattern.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]))
        }
        "llama-bpe" | "llama3" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(LLAMA3_REGEX)?,
            byte_level(false),
        ])),
        "qwen2" | "deepseek-r1-qwen" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(QWEN2_REGEX)?,
            byte_level(false),
        ])),
        other => {
            return Err(tok_err(format!(
                "pre-tokenizer {other:?} (tokenizer.ggml.pre) is not supported; supported: default, gpt2, smollm, starcoder, llama-bpe, qwen2"
            )));
        }
    })
}

/// The character that stands for each byte (index = byte value) in byte-level vocabularies.
pub fn byte_level_chars() -> Vec<char> {
    bytes_to_unicode().into_iter().map(|(_, c)| c).collect()
}

/// GPT-2's reversible map from bytes to printable characters used by byte-level vocabularies.
fn bytes_to_unicode() -> Vec<(u8, char)> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
    printable.extend(0xA1..=0xAC);
    printable.extend(0xAE..=0xFF);
    let mut out = Vec::with_capacity(256);
    let mut extra = 0;
    for b in 0..=255u32 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        out.push((b as u8, char::from_u32(c).expect("valid code point")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection() {
        let m = bytes_to_unicode();
        let mut chars: Vec<char> = m.iter().map(|p| p.1).collect();
        chars.sort_unstable();
        chars.dedup();
        assert_eq!(chars.len(), 256);
        assert_eq!(m[b' ' as usize].1, 'Ġ');
        assert_eq!(m[b'\n' as usize].1, 'Ċ');
    }
}
