//! Retrieval drafting (REST, He et al. 2023): the draft is what most often followed the
//! context's last tokens in a datastore of text the model has written before.
//!
//! Prompt lookup only finds what the context itself repeats, so open generation, with nothing
//! to copy, gets little from it. But a model's answers repeat each other: the same openings,
//! transitions, list markers and closing phrases, in the same words, since the model (greedy)
//! writes them the same way each time. A datastore of the model's own answers to many requests
//! holds those phrases; a suffix array over it finds every earlier occurrence of the context's
//! last `n` tokens in `O(n log N)`, and the occurrences are sorted by what follows them, so the
//! continuations group by their next token, and the largest group is the most frequent next
//! token. The draft follows the most frequent branch token by token (REST builds a tree of
//! several branches for tree attention; frugal verifies one sequence, so it keeps the heaviest
//! path) while the branch's estimated chance stays above [`MIN_CHANCE`].
//!
//! The draft costs no model compute: a few binary searches over the store.

use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

use super::decode::PassCost;
use super::ngram::LengthByMatch;
use crate::error::{Error, Result};
use crate::gguf::{GgufWriter, TensorData, Value};
use crate::quant::GgmlType;

pub const ARCH: &str = "frugal-store";

/// Marks the end of a document: larger than every token id, never part of a match.
const SEP: u32 = u32::MAX;

/// Suffixes are sorted on at most this many tokens: enough for the longest query a draft makes
/// (the matched suffix, at most [`MAX_MATCH`], plus the draft, at most `MAX_K`).
const SORT_LEN: usize = MAX_MATCH + super::MAX_K;

/// The longest context suffix matched.
pub const MAX_MATCH: usize = 16;

/// The longest context suffix `--speculate store:` looks up.
pub const DEFAULT_MATCH: usize = 8;

/// A draft stops when the chance that the whole path so far is right, estimated as the
/// product of `count / (total + 1)` over its steps, falls below this: one occurrence out of
/// one gives 0.5, nine out of ten 0.82. Low, because the adaptive draft length already cuts
/// drafts that do not pay: on open chat prompts with a 751k-token store, 0.1 gave 1.44 tokens
/// per pass against 1.39 at 0.25 and 1.33 at 0.4, with no loss on input-grounded ones; 0.05
/// and 0 drafted longer for the same 1.44.
pub const MIN_CHANCE: f64 = 0.1;

/// The most distinct next tokens examined at one step (groups are visited in token order; a
/// step after a common one-token suffix may have thousands, and the search stops at this many).
const MAX_GROUPS: usize = 512;

/// Tokens the model wrote, and a suffix array over them.
#[derive(Clone, Debug)]
pub struct Datastore {
    /// Documents one after another, each followed by [`SEP`].
    tokens: Vec<u32>,
    /// Every position that holds a token, sorted by the tokens from it on (up to
    /// [`SORT_LEN`], stopping at the document's end).
    sa: Vec<u32>,
    n_vocab: usize,
}

impl Datastore {
    /// A datastore of `docs` (token ids below `n_vocab`).
    pub fn new<'a>(docs: impl IntoIterator<Item = &'a [u32]>, n_vocab: usize) -> Result<Self> {
        let mut tokens = Vec::new();
        for d in docs {
            if let Some(&bad) = d.iter().find(|&&t| t as usize >= n_vocab) {
                return Err(Error::BadToken { id: bad, n_vocab });
            }
            tokens.extend_from_slice(d);
            tokens.push(SEP);
        }
        if tokens.len() >= SEP as usize {
            return Err(Error::Invalid(format!(
                "a datastore holds fewer than {SEP} tokens, not {}",
                tokens.len()
            )));
        }
        Ok(Self::from_tokens(tokens, n_vocab))
    }

    fn from_tokens(tokens: Vec<u32>, n_vocab: usize) -> Self {
        let mut sa: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&i| tokens[i as usize] != SEP)
            .collect();
        sa.sort_unstable_by(|&a, &b| key(&tokens, a).cmp(key(&tokens, b)));
        Datastore {
            tokens,
            sa,
            n_vocab,
        }
    }

    /// Tokens held (not counting document ends).
    pub fn len(&self) -> usize {
        self.sa.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sa.is_empty()
    }

    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// The token `d` places after suffix `i` of the array ([`SEP`] past a document's end).
    fn at(&self, i: usize, d: usize) -> u32 {
        let p = self.sa[i] as usize + d;
        self.tokens.get(p).copied().unwrap_or(SEP)
    }

    /// The suffixes that start with `q`.
    fn find(&self, q: &[u32]) -> (usize, usize) {
        let (mut lo, mut hi) = (0, self.sa.len());
        for (d, &t) in q.iter().enumerate() {
            (lo, hi) = self.narrow(lo, hi, d, t);
            if lo == hi {
                break;
            }
        }
        (lo, hi)
    }

    /// The suffixes in `lo..hi` (which all agree on their first `d` tokens) whose token at
    /// `d` is `t`: a subrange, since they are sorted.
    fn narrow(&self, lo: usize, hi: usize, d: usize, t: u32) -> (usize, usize) {
        let token = |&p: &u32| self.tokens.get(p as usize + d).copied().unwrap_or(SEP);
        let range = &self.sa[lo..hi];
        let a = range.partition_point(|p| token(p) < t);
        let b = range.partition_point(|p| token(p) <= t);
        (lo + a, lo + b)
    }

    /// Up to `k` tokens that most often followed the longest suffix of `context` (at most
    /// `n_max` tokens) found in the store, while the path's estimated chance stays at least
    /// [`MIN_CHANCE`]. Returns the length of the suffix matched (0: none found).
    pub fn draft(&self, context: &[u32], n_max: usize, k: usize, out: &mut Vec<u32>) -> usize {
        out.clear();
        if k == 0 {
            return 0;
        }
        let n_max = n_max.min(MAX_MATCH).min(context.len());
        for n in (1..=n_max).rev() {
            let q = &context[context.len() - n..];
            let (mut lo, mut hi) = self.find(q);
            if lo == hi {
                continue;
            }
            let mut chance = 1.0;
            let mut d = n;
            while out.len() < k && d < SORT_LEN {
                let Some((t, a, b)) = self.heaviest(lo, hi, d) else {
                    break;
                };
                chance *= (b - a) as f64 / (hi - lo + 1) as f64;
                if chance < MIN_CHANCE {
                    break;
                }
                out.push(t);
                (lo, hi, d) = (a, b, d + 1);
            }
            return n;
        }
        0
    }

    /// The most frequent token at offset `d` among the suffixes `lo..hi`, and the subrange
    /// of the suffixes that have it (`None` when none continues within its document).
    fn heaviest(&self, lo: usize, hi: usize, d: usize) -> Option<(u32, usize, usize)> {
        let mut best: Option<(u32, usize, usize)> = None;
        let mut i = lo;
        for _ in 0..MAX_GROUPS {
            if i >= hi {
                break;
            }
            let t = self.at(i, d);
            if t == SEP {
                break; // document ends sort last
            }
            let (a, b) = self.narrow(i, hi, d, t);
            if best.is_none_or(|(_, x, y)| b - a > y - x) {
                best = Some((t, a, b));
            }
            // No later group can beat the best once fewer suffixes than it holds are left.
            if best.is_some_and(|(_, x, y)| hi - b <= y - x) {
                break;
            }
            i = b;
        }
        best
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String(ARCH.into()));
        w.set("frugal-store.vocab_size", Value::U32(self.n_vocab as u32));
        let data: Vec<u8> = self.tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        w.tensors.push(TensorData {
            name: "store.tokens".into(),
            dims: vec![self.tokens.len() as u64],
            ty: GgmlType::I32,
            data: Cow::Owned(data),
        });
        w.write_file(path)?;
        Ok(())
    }

    /// Reads a datastore written by [`write`](Self::write), checking every token against the
    /// vocabulary it declares.
    pub fn read(path: &Path) -> Result<Self> {
        let f = super::open_kind(path, ARCH, "a datastore", "build-store")?;
        let bad = |m: String| Error::Invalid(format!("{}: {m}", path.display()));
        let n_vocab = f.u32("frugal-store.vocab_size")? as usize;
        let (info, data) = f.tensor("store.tokens")?;
        if info.ty != GgmlType::I32 || data.len() % 4 != 0 {
            return Err(bad("store.tokens is not a list of 32-bit token ids".into()));
        }
        let tokens: Vec<u32> = data
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(&t) = tokens.iter().find(|&&t| t != SEP && t as usize >= n_vocab) {
            return Err(bad(format!(
                "holds token id {t}, outside its vocabulary of {n_vocab}"
            )));
        }
        if tokens.last().is_some_and(|&t| t != SEP) {
            return Err(bad("its last document is not terminated".into()));
        }
        Ok(Self::from_tokens(tokens, n_vocab))
    }
}

/// The sort key of position `i`: its tokens up to [`SORT_LEN`], through the end of its
/// document (the end marker included, so a document's end sorts after every continuation).
fn key(tokens: &[u32], i: u32) -> &[u32] {
    let i = i as usize;
    let end = (i + SORT_LEN).min(tokens.len());
    let stop = tokens[i..end]
        .iter()
        .position(|&t| t == SEP)
        .map_or(end, |p| i + p + 1);
    &tokens[i..stop]
}

/// Retrieval drafting with its draft length chosen per matched suffix length
/// ([`LengthByMatch`]), as prompt lookup chooses it. The datastore is shared: a server gives
/// every sequence its own `Retrieval` over one store.
#[derive(Clone, Debug)]
pub struct Retrieval {
    store: Arc<Datastore>,
    n_max: usize,
    lengths: LengthByMatch,
}

impl Retrieval {
    pub fn new(
        store: Arc<Datastore>,
        n_max: usize,
        k_max: usize,
        adaptive: bool,
        pass: PassCost,
    ) -> Self {
        let n_max = n_max.clamp(1, MAX_MATCH);
        Retrieval {
            store,
            n_max,
            lengths: LengthByMatch::new(n_max, k_max, adaptive, pass),
        }
    }

    /// Fills `out` with at most `cap` tokens for the next pass.
    pub fn propose(&mut self, context: &[u32], cap: usize, out: &mut Vec<u32>) {
        let m = self.store.draft(context, self.n_max, cap, out);
        self.lengths.cut(m, out);
    }

    /// The latest proposal's `drafted` tokens had their first `kept` accepted.
    pub fn record(&mut self, drafted: usize, kept: usize) {
        self.lengths.record(drafted, kept);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What [`Datastore::draft`] must return, by brute force: every occurrence of the longest
    /// suffix found, then the most frequent next token (the smallest id among equals) while
    /// the path's chance holds.
    fn reference(docs: &[Vec<u32>], context: &[u32], n_max: usize, k: usize) -> (usize, Vec<u32>) {
        let n_max = n_max.min(MAX_MATCH).min(context.len());
        for n in (1..=n_max).rev() {
            let q = &context[context.len() - n..];
            // (document, start of the occurrence)
            let mut occ: Vec<(usize, usize)> = Vec::new();
            for (di, d) in docs.iter().enumerate() {
                for s in 0..d.len().saturating_sub(n - 1) {
                    if &d[s..s + n] == q {
                        occ.push((di, s));
                    }
                }
            }
            if occ.is_empty() {
                continue;
            }
            let (mut out, mut chance, mut depth) = (Vec::new(), 1.0, n);
            while out.len() < k {
                let mut counts = std::collections::BTreeMap::new();
                for &(di, s) in &occ {
                    if let Some(&t) = docs[di].get(s + depth) {
                        *counts.entry(t).or_insert(0usize) += 1;
                    }
                }
                let Some((&t, &c)) = counts.iter().rev().max_by_key(|&(_, &c)| c) else {
                    break;
                };
                chance *= c as f64 / (occ.len() + 1) as f64;
                if chance < MIN_CHANCE {
                    break;
                }
                out.push(t);
                occ.retain(|&(di, s)| docs[di].get(s + depth) == Some(&t));
                depth += 1;
            }
            return (n, out);
        }
        (0, Vec::new())
    }

    #[test]
    fn drafts_the_most_frequent_continuation_of_the_longest_match() {
        let docs: Vec<Vec<u32>> = vec![
            vec![1, 2, 3, 4],
            vec![1, 2, 3, 5],
            vec![1, 2, 3, 4],
            vec![9, 1, 2],
        ];
        let s = Datastore::new(docs.iter().map(|d| &d[..]), 10).unwrap();
        assert_eq!(s.len(), 15);
        let mut out = Vec::new();
        // "1 2" occurs 4 times: 3 follows three of them (3/5), then 4 two of those (x 2/4).
        assert_eq!(s.draft(&[7, 1, 2], 2, 8, &mut out), 2);
        assert_eq!(out, [3, 4]);
        // The longer suffix "9 1 2" occurs once, at a document's end: nothing follows it there,
        // and no shorter suffix is tried once a longer one is found.
        assert_eq!(s.draft(&[9, 1, 2], 3, 8, &mut out), 3);
        assert!(out.is_empty());
        // A draft never runs into the next document: "4" ends the first one.
        assert_eq!(s.draft(&[3, 4], 2, 8, &mut out), 2);
        assert!(out.is_empty());
        // No occurrence of any suffix; k = 0.
        assert_eq!(s.draft(&[8, 8], 2, 8, &mut out), 0);
        assert_eq!(s.draft(&[1, 2], 2, 0, &mut out), 0);
        // Equal counts: the smaller id (1/3, then 1/3 x 1/2), and a single occurrence drafts
        // three tokens at most (1/2, 1/4, 1/8; a fourth would be 1/16 < MIN_CHANCE).
        assert_eq!(MIN_CHANCE, 0.1, "the cases below are worked out for 0.1");
        let s = Datastore::new([&[5, 6, 7, 8, 9, 1][..], &[5, 2, 9][..]], 10).unwrap();
        s.draft(&[5], 1, 8, &mut out);
        assert_eq!(out, [2, 9]);
        s.draft(&[6], 1, 8, &mut out);
        assert_eq!(out, [7, 8, 9]);
    }

    /// Over random documents of a small vocabulary (many repeats and ties) the suffix array
    /// drafts exactly what the brute-force count does.
    #[test]
    fn drafts_agree_with_brute_force_counting() {
        let mut x = 12345u64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % m) as u32
        };
        for vocab in [3u32, 5, 12] {
            let docs: Vec<Vec<u32>> = (0..20)
                .map(|_| {
                    let len = 1 + rnd(40) as usize;
                    (0..len).map(|_| rnd(vocab as u64)).collect()
                })
                .collect();
            let s = Datastore::new(docs.iter().map(|d| &d[..]), vocab as usize).unwrap();
            let mut out = Vec::new();
            for _ in 0..300 {
                let len = 1 + rnd(10) as usize;
                let context: Vec<u32> = (0..len).map(|_| rnd(vocab as u64)).collect();
                let (n_max, k) = (1 + rnd(6) as usize, 1 + rnd(8) as usize);
                let m = s.draft(&context, n_max, k, &mut out);
                let (rm, rout) = reference(&docs, &context, n_max, k);
                assert_eq!((m, &out), (rm, &rout), "{context:?} n_max {n_max} k {k}");
            }
        }
    }

    #[test]
    fn a_datastore_round_trips_and_bad_files_are_refused() {
        let dir = std::env::temp_dir().join(format!("frugal-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let docs = [vec![1u32, 2, 3, 1, 2, 4], vec![2, 3]];
        let s = Datastore::new(docs.iter().map(|d| &d[..]), 5).unwrap();
        let p = dir.join("s.gguf");
        s.write(&p).unwrap();
        let r = Datastore::read(&p).unwrap();
        assert_eq!((r.len(), r.n_vocab()), (8, 5));
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for c in [&[1u32, 2][..], &[2], &[3, 1], &[4]] {
            assert_eq!(s.draft(c, 4, 4, &mut a), r.draft(c, 4, 4, &mut b));
            assert_eq!(a, b);
        }
        // A token outside the vocabulary, in memory and in a file.
        assert!(Datastore::new([&[1u32, 7][..]], 5).is_err());
        let forged = Datastore {
            tokens: vec![1, 7, SEP],
            sa: Vec::new(),
            n_vocab: 5,
        };
        forged.write(&p).unwrap();
        let e = Datastore::read(&p).unwrap_err().to_string();
        assert!(e.contains("outside its vocabulary"), "{e}");
        // Another kind of GGUF, and not a GGUF at all.
        let heads = super::super::HeadWeights::identity(1, 4, 5, None, false);
        heads.write(&p).unwrap();
        let e = Datastore::read(&p).unwrap_err().to_string();
        assert!(e.contains("not a datastore"), "{e}");
        std::fs::write(&p, b"not a gguf").unwrap();
        assert!(Datastore::read(&p).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
