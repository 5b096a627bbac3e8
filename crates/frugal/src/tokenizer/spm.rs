//! SentencePiece vocabularies (`tokenizer.ggml.model = llama`: Gemma, Llama 2, Mistral): pieces
//! with scores, spaces written as `▁`, and byte fallback (`<0xXX>`) for characters outside the
//! vocabulary.
//!
//! llama.cpp tokenizes these by repeatedly merging the adjacent pair of symbols whose
//! concatenation is the highest-scoring piece. That is BPE whose merge ranks are the pieces'
//! scores, so the `tokenizers` crate's BPE runs it once the merges are derived from the
//! vocabulary: every way to split a piece into two pieces, ranked by the whole piece's score
//! (as Hugging Face's SentencePiece converter does). The text is not pre-split: merges may
//! cross spaces, as in llama.cpp.

use std::collections::HashMap;

use tokenizers::Tokenizer as HfTokenizer;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{NormalizerWrapper, Replace};

use super::{TokenType, tok_err};
use crate::error::Result;

/// SentencePiece's visible space.
const SPACE: char = '\u{2581}';

/// The BPE that reproduces SentencePiece's score-driven merging over `tokens`.
pub(super) fn build(tokens: &[String], scores: &[f32], types: &[TokenType]) -> Result<HfTokenizer> {
    if scores.len() != tokens.len() {
        return Err(tok_err(format!(
            "tokenizer.ggml.scores has {} entries for {} tokens",
            scores.len(),
            tokens.len()
        )));
    }
    if let Some(i) = scores.iter().position(|s| s.is_nan()) {
        return Err(tok_err(format!("tokenizer.ggml.scores[{i}] is NaN")));
    }
    // The first id of each text (a vocabulary may repeat a text; llama.cpp keeps the first).
    let mut first: HashMap<&str, u32> = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate().rev() {
        first.insert(t.as_str(), i as u32);
    }
    // (score, id, split): piece `id` made from its first `split` bytes and the rest. Byte
    // tokens are reached only by fallback, never by merging.
    let mut ways: Vec<(f32, u32, u32)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        if types[i] == TokenType::Byte || first.get(t.as_str()) != Some(&(i as u32)) {
            continue;
        }
        for (k, _) in t.char_indices().skip(1) {
            if first.contains_key(&t[..k]) && first.contains_key(&t[k..]) {
                ways.push((scores[i], i as u32, k as u32));
            }
        }
    }
    // Best score first; among equals, the lower id, then the shorter left part (stable).
    ways.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let merges = ways
        .into_iter()
        .map(|(_, i, k)| {
            let t = &tokens[i as usize];
            (t[..k as usize].to_string(), t[k as usize..].to_string())
        })
        .collect();
    let vocab: tokenizers::models::bpe::Vocab =
        first.iter().map(|(t, i)| (t.to_string(), *i)).collect();
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true);
    if let Some(unk) = tokens
        .iter()
        .zip(types)
        .find(|(_, ty)| **ty == TokenType::Unknown)
    {
        builder = builder.unk_token(unk.0.clone());
    }
    let bpe = builder.build().map_err(tok_err)?;
    let mut hf = HfTokenizer::new(bpe);
    let space = Replace::new(" ", SPACE.to_string()).map_err(tok_err)?;
    hf.with_normalizer(Some(NormalizerWrapper::Replace(space)));
    Ok(hf)
}

/// The bytes a token stands for: `▁` as a space, a byte token `<0xXX>` as its byte.
pub(super) fn piece(text: &str, ty: TokenType) -> Box<[u8]> {
    if ty == TokenType::Byte
        && let Some(hex) = text.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'))
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return Box::new([b]);
    }
    text.replace(SPACE, " ").into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary where score order decides between two segmentations of "abc".
    fn vocab(ab_first: bool) -> (Vec<String>, Vec<f32>, Vec<TokenType>) {
        let texts = ["<unk>", "a", "b", "c", "ab", "bc", "▁", "▁a", "<0x7A>"];
        let mut scores = vec![0.0, -1.0, -1.0, -1.0, -2.0, -3.0, -1.0, -2.5, 0.0];
        if !ab_first {
            scores.swap(4, 5);
        }
        let types = texts
            .iter()
            .map(|t| match *t {
                "<unk>" => TokenType::Unknown,
                "<0x7A>" => TokenType::Byte,
                _ => TokenType::Normal,
            })
            .collect();
        (texts.iter().map(|s| s.to_string()).collect(), scores, types)
    }

    fn ids(ab_first: bool, text: &str) -> Vec<u32> {
        let (t, s, ty) = vocab(ab_first);
        let hf = build(&t, &s, &ty).unwrap();
        hf.encode(text, false).unwrap().get_ids().to_vec()
    }

    #[test]
    fn the_higher_scoring_merge_wins() {
        assert_eq!(ids(true, "abc"), [4, 3]);
        assert_eq!(ids(false, "abc"), [1, 5]);
    }

    #[test]
    fn spaces_become_the_visible_space_and_unknown_bytes_fall_back() {
        // " a" -> "▁a"; "z" is not a piece but its byte token is; "é" has neither -> <unk>.
        assert_eq!(ids(true, " az"), [7, 8]);
        assert_eq!(ids(true, "é"), [0]);
    }

    #[test]
    fn pieces_decode_spaces_and_bytes() {
        assert_eq!(&*piece("▁a▁b", TokenType::Normal), b" a b");
        assert_eq!(&*piece("<0x0A>", TokenType::Byte), b"\n");
        assert_eq!(&*piece("<0x0A>", TokenType::Normal), b"<0x0A>");
    }

    #[test]
    fn mismatched_scores_are_an_error() {
        let (t, mut s, ty) = vocab(true);
        s.pop();
        assert!(build(&t, &s, &ty).is_err());
    }
}
