//! Structured output: `response_format` (JSON object, JSON Schema) and forced tool calls by
//! constrained decoding. A grammar compiled by llguidance gives, at every step, the set of
//! tokens that keep the output a prefix of some sentence of the grammar; every other token's
//! logit becomes -inf before sampling, so whatever the sampler picks (greedy or not) the
//! output stays valid, and once the grammar is complete the sequence ends.
//!
//! [`Grammars`] holds llguidance's view of the vocabulary (a trie of every token's bytes),
//! built once per model and shared; [`Constraint`] is one sequence's parser state.

use std::sync::Arc;

use frugal::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::api::Common;
use crate::error::ApiError;

/// The tokenizer as llguidance sees it: every token's bytes in a trie (control tokens behind
/// the 0xFF marker, so grammars never produce them by accident), and the model's tokenizer
/// for text the grammar forces.
struct TokBridge {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for TokBridge {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let Ok(text) = std::str::from_utf8(s) else {
            return self.trie.greedy_tokenize(s);
        };
        match self.tok.encode(text, false) {
            Ok(mut ids) => {
                // A forced fragment is mid-sequence: never a BOS in front.
                if self.tok.add_bos && ids.first() == self.tok.bos.as_ref() {
                    ids.remove(0);
                }
                ids
            }
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// The grammar compiler for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    /// Logit rows are this long (the model's vocabulary, which may exceed the tokenizer's).
    n_vocab: usize,
}

impl Grammars {
    /// Builds the token trie of `tok` (tens of milliseconds for a 50k vocabulary).
    pub fn new(tok: Arc<Tokenizer>, n_vocab: usize) -> anyhow::Result<Self> {
        let eog = tok.end_of_generation_ids().to_vec();
        anyhow::ensure!(
            !eog.is_empty(),
            "the tokenizer has no end-of-generation token"
        );
        let words: Vec<Vec<u8>> = (0..tok.vocab_size() as u32)
            .map(|id| {
                let plain = tok.token_bytes(id, false);
                if plain.is_empty() {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tok.token_bytes(id, true));
                    w
                } else {
                    plain.to_vec()
                }
            })
            .collect();
        let info = TokRxInfo::new(words.len() as u32, eog[0]);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eog);
        let env: TokEnv = Arc::new(TokBridge { trie, tok });
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        Ok(Grammars { factory, n_vocab })
    }

    /// A constraint from an llguidance grammar; the error says what is wrong with it.
    pub fn compile(&self, grammar: TopLevelGrammar) -> Result<Constraint, String> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint {
            matcher,
            n_vocab: self.n_vocab,
            masked: Vec::new(),
        })
    }
}

/// What `response_format` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON object.
    JsonObject,
    /// JSON valid against this schema.
    JsonSchema(Value),
}

/// Reads `response_format` (OpenAI's shape); `None` for absent or `{"type": "text"}`.
pub fn parse_format(v: Option<&Value>) -> Result<Option<Format>, ApiError> {
    let bad = |m: String| Err(ApiError::invalid(m, Some("response_format")));
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(kind) = v.get("type").and_then(Value::as_str) else {
        return bad("response_format must be an object with a string \"type\"".into());
    };
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Format::JsonObject)),
        "json_schema" => {
            let Some(js) = v.get("json_schema").filter(|j| j.is_object()) else {
                return bad(
                    "response_format of type json_schema needs a \"json_schema\" object".into(),
                );
            };
            match js.get("schema") {
                Some(s) if s.is_object() || s.is_boolean() => {
                    Ok(Some(Format::JsonSchema(s.clone())))
                }
                Some(_) => {
                    bad("response_format.json_schema.schema must be a JSON Schema object".into())
                }
                // OpenAI allows a missing schema: any JSON value.
                None => Ok(Some(Format::JsonSchema(json!({})))),
            }
        }
        other => bad(format!(
            "response_format type {other:?} is not supported (text, json_object, json_schema)"
        )),
    }
}

/// The llguidance grammar of a format. The JSON is laid out as `{"a": 1, "b": [2, 3]}`: no
/// free whitespace, which a small model could otherwise spin in until `max_tokens`.
pub fn format_grammar(f: &Format) -> TopLevelGrammar {
    let schema = match f {
        Format::JsonObject => json!({"type": "object"}),
        Format::JsonSchema(s) => s.clone(),
    };
    TopLevelGrammar::from_json_schema(with_layout(schema))
}

/// `schema` with llguidance's layout options, unless the client set its own.
pub fn with_layout(schema: Value) -> Value {
    let layout =
        json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "});
    match schema {
        Value::Object(mut m) => {
            m.entry("x-guidance").or_insert(layout);
            Value::Object(m)
        }
        // `true` accepts anything, `false` nothing (which compiling reports).
        Value::Bool(true) => json!({"x-guidance": layout}),
        other => other,
    }
}

/// The constraint a request's `response_format` (or llama-server's `json_schema`) asks for;
/// an invalid one is a 400 naming the field.
pub fn request_constraint(
    g: Option<&Grammars>,
    common: &Common,
) -> Result<Option<Constraint>, ApiError> {
    let (format, param) = match (&common.response_format, &common.json_schema) {
        (Some(v), _) if !v.is_null() => (parse_format(Some(v))?, "response_format"),
        (_, Some(s)) if s.is_object() || s.is_boolean() => {
            (Some(Format::JsonSchema(s.clone())), "json_schema")
        }
        (_, Some(s)) if !s.is_null() => {
            return Err(ApiError::invalid(
                "json_schema must be a JSON Schema object",
                Some("json_schema"),
            ));
        }
        _ => (None, "response_format"),
    };
    let Some(format) = format else {
        return Ok(None);
    };
    let g = g.ok_or_else(|| {
        ApiError::invalid(
            "structured output is unavailable: this model's vocabulary could not be indexed",
            Some(param),
        )
    })?;
    g.compile(format_grammar(&format))
        .map(Some)
        .map_err(|e| ApiError::invalid(format!("invalid {param}: {e}"), Some(param)))
}

/// One sequence's grammar state.
pub struct Constraint {
    matcher: Matcher,
    n_vocab: usize,
    /// The logit row with the disallowed tokens at -inf, reused every step.
    masked: Vec<f32>,
}

impl Constraint {
    /// An independent copy at the same state (for the other choices of `n`).
    pub fn fork(&self) -> Constraint {
        Constraint {
            matcher: self.matcher.deep_clone(),
            n_vocab: self.n_vocab,
            masked: Vec::new(),
        }
    }

    /// `logits` with every token the grammar forbids at -inf; `None` when the grammar allows
    /// nothing (or failed), which ends the sequence.
    pub fn mask(&mut self, logits: &[f32]) -> Option<&[f32]> {
        let mask = match self.matcher.compute_mask() {
            Ok(m) => m,
            Err(e) => {
                eprintln!("frugal serve: grammar: {e}");
                return None;
            }
        };
        if mask.is_zero() {
            return None;
        }
        apply_mask(&mask, logits, &mut self.masked);
        Some(&self.masked)
    }

    /// Advances the grammar past the token the sampler chose; false if it cannot (it always
    /// can for a token the mask allowed).
    pub fn commit(&mut self, token: u32) -> bool {
        match self.matcher.consume_token(token) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("frugal serve: grammar: {e}");
                false
            }
        }
    }

    /// The grammar is complete and nothing may follow: the sequence ends here.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }

    #[cfg(test)]
    fn allowed(&mut self) -> SimpleVob {
        self.matcher.compute_mask().expect("mask")
    }
}

/// Writes `logits` into `out` with the tokens `mask` leaves out at -inf (ids past the mask too).
fn apply_mask(mask: &SimpleVob, logits: &[f32], out: &mut Vec<f32>) {
    out.clear();
    out.resize(logits.len(), f32::NEG_INFINITY);
    for (w, &bits) in mask.as_slice().iter().enumerate() {
        if bits == 0 {
            continue;
        }
        let base = w * 32;
        let end = (base + 32).min(logits.len());
        if base >= end {
            break;
        }
        if bits == u32::MAX && end - base == 32 {
            out[base..end].copy_from_slice(&logits[base..end]);
            continue;
        }
        for i in base..end {
            if bits >> (i - base) & 1 != 0 {
                out[i] = logits[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_format_shapes() {
        assert_eq!(parse_format(None).unwrap(), None);
        assert_eq!(parse_format(Some(&json!({"type": "text"}))).unwrap(), None);
        assert_eq!(
            parse_format(Some(&json!({"type": "json_object"}))).unwrap(),
            Some(Format::JsonObject)
        );
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            parse_format(Some(
                &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": s}})
            ))
            .unwrap(),
            Some(Format::JsonSchema(s))
        );
        for bad in [
            json!({"type": "xml"}),
            json!("json"),
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": {"schema": 3}}),
        ] {
            let e = parse_format(Some(&bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("response_format"), "{bad}");
        }
    }

    #[test]
    fn layout_is_added_unless_given() {
        let s = with_layout(json!({"type": "object"}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], json!(false));
        let own = json!({"x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_layout(own.clone()), own);
    }

    #[test]
    fn the_mask_keeps_allowed_logits_and_forbids_the_rest() {
        let mut m = SimpleVob::alloc(70);
        for t in [0, 31, 32, 33, 69] {
            m.allow_token(t);
        }
        let logits: Vec<f32> = (0..72).map(|i| i as f32).collect();
        let mut out = Vec::new();
        apply_mask(&m, &logits, &mut out);
        assert_eq!(out.len(), 72);
        for (i, &x) in out.iter().enumerate() {
            if [0, 31, 32, 33, 69].contains(&i) {
                assert_eq!(x, i as f32);
            } else {
                assert_eq!(x, f32::NEG_INFINITY, "{i}");
            }
        }
        let all = SimpleVob::alloc_ones(64);
        apply_mask(&all, &logits[..64], &mut out);
        assert_eq!(out, logits[..64]);
    }

    /// A toy byte vocabulary: the grammar allows exactly the JSON that fits the schema.
    #[test]
    fn a_schema_constrains_a_byte_vocabulary() {
        let env = toktrie::ApproximateTokEnv::single_byte_env();
        let mut factory = ParserFactory::new_simple(&env).unwrap();
        factory.quiet();
        let g = Grammars {
            factory,
            n_vocab: env.tok_trie().vocab_size(),
        };
        let schema = json!({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": false});
        let mut c = g
            .compile(format_grammar(&Format::JsonSchema(schema)))
            .unwrap();
        for &b in br#"{"a": "#.iter() {
            let m = c.allowed();
            assert!(m.is_allowed(u32::from(b)), "{}", b as char);
            assert_eq!(m.num_set(), 1, "forced {}", b as char);
            assert!(c.commit(u32::from(b)));
        }
        let m = c.allowed();
        assert!(m.is_allowed(u32::from(b'"')));
        assert!(c.commit(u32::from(b'"')));
        let m = c.allowed();
        assert!(m.is_allowed(u32::from(b'x')) && m.is_allowed(u32::from(b'y')));
        assert!(!m.is_allowed(u32::from(b'z')));
        for &b in br#"y"}"# {
            assert!(c.commit(u32::from(b)));
        }
        assert!(c.is_done());
        let bad = g.compile(format_grammar(&Format::JsonSchema(
            json!({"type": "nonsense"}),
        )));
        assert!(bad.is_err());
    }
}
