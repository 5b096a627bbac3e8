//! The SentencePiece (`tokenizer.ggml.model = llama`) path on Gemma 3 270M's 262,144-piece
//! vocabulary, against the ids llama.cpp's tokenizer gives for the same texts.
//!
//! The file is found at `$FRUGAL_GEMMA_MODEL` or in the frugal cache (`frugal fetch
//! gemma3-270m`); absent, the test skips, unless `FRUGAL_REQUIRE_MODEL=1` (CI).

use frugal::gguf::GgufFile;
use frugal::tokenizer::Tokenizer;

fn tokenizer() -> Option<Tokenizer> {
    let path = frugal::fetch::gemma_model_for_tests()?;
    let file = GgufFile::open(path).expect("Gemma GGUF opens");
    Some(Tokenizer::from_gguf(&file).expect("SentencePiece tokenizer builds"))
}

#[test]
fn gemma_tokenization_matches_llama_cpp() {
    let Some(tok) = tokenizer() else { return };
    assert_eq!(
        tok.encode("The capital of France is", false).unwrap(),
        [2, 818, 5279, 529, 7001, 563]
    );
    // Accents, CJK, an emoji, a double space, a tab and newlines: the byte fallback and the
    // whitespace pieces.
    let text = "Héllo wörld! 你好 🙂  tabs\tand\nnewlines";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(
        ids,
        [
            2, 236814, 7869, 844, 515, 4010, 671, 236888, 43758, 237389, 57235, 138, 39218, 255968,
            624, 107, 208697
        ]
    );
    assert_eq!(tok.decode(&ids[1..]), text);
}
