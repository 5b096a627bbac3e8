//! Prompt lookup: the draft is whatever followed the last time the context ended the same way.
//!
//! Input-grounded generation (summarizing, rewriting or editing a given text or code) copies long
//! runs of its input, so the tokens after an earlier occurrence of the last `n` tokens are a good
//! guess for the next ones, at no cost: no model, no weights. Longer matches are tried first
//! (`n_max` down to 1), and of equal length the most recent one wins, since nearby text is the
//! likeliest to be continued (apoorvumang/prompt-lookup-decoding; vLLM's and llama.cpp's n-gram
//! drafters work the same way).

use super::decode::{DraftLength, PassCost};

/// Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `context` of at most `n_max` tokens; empty when no suffix occurred before. Returns the length
/// of the suffix matched (0: none).
///
/// A continuation that reaches the end of the context goes on copying its own draft: the
/// match then lies `p` tokens back, so the text is repeating with period `p` (a list, a table
/// row, the loops a small model falls into), and the same period is the best guess for the
/// tokens after the end as well. Without it a draft could never be longer than the period,
/// however long the repetition has held.
pub fn lookup(context: &[u32], n_max: usize, k: usize, out: &mut Vec<u32>) -> usize {
    out.clear();
    let len = context.len();
    if k == 0 {
        return 0;
    }
    for n in (1..=n_max.min(len.saturating_sub(1))).rev() {
        let suffix = &context[len - n..];
        // Candidate starts, latest first; the match must end before the suffix itself starts
        // so that at least one token follows it.
        for start in (0..len - n).rev() {
            if &context[start..start + n] == suffix {
                let from = start + n;
                let take = k.min(len - from);
                out.extend_from_slice(&context[from..from + take]);
                // Past the end: the period `len - from`, continued from the draft itself.
                for i in take..k {
                    out.push(out[i - (len - from)]);
                }
                return n;
            }
        }
    }
    0
}

/// A draft length per matched suffix length, for drafters that continue a match (prompt
/// lookup, retrieval from a store). A draft continuing a three-token match is a copy in
/// progress and is mostly kept; one continuing a single-token match is a guess and mostly
/// rejected. One acceptance estimate for both would draft too little during copies and too
/// much elsewhere, so each match length keeps its own [`DraftLength`], and a pass records its
/// outcome under the length that drafted it.
#[derive(Clone, Debug)]
pub struct LengthByMatch {
    /// Index `m - 1`: the draft length for matches of `m` tokens.
    lengths: Vec<DraftLength>,
    /// The match length of the latest draft (0: none).
    last: usize,
}

impl LengthByMatch {
    /// Matches of 1 to `n_max` tokens, drafts of up to `k_max`; `pass` is what verifying the
    /// drafted rows costs relative to a decode step (the drafter itself costs nothing).
    pub fn new(n_max: usize, k_max: usize, adaptive: bool, pass: PassCost) -> Self {
        LengthByMatch {
            lengths: (0..n_max.max(1))
                .map(|_| DraftLength::new(k_max, adaptive, 0.0, pass))
                .collect(),
            last: 0,
        }
    }

    /// Cuts `out`, drafted after a match of `m` tokens (0: none), to as many tokens as the
    /// acceptance seen after matches of that length makes worth verifying.
    pub fn cut(&mut self, m: usize, out: &mut Vec<u32>) {
        self.last = m;
        if m > 0 && !out.is_empty() {
            let k = self.lengths[m - 1].next_k();
            out.truncate(k);
        }
    }

    /// The latest draft's `drafted` tokens had their first `kept` accepted.
    pub fn record(&mut self, drafted: usize, kept: usize) {
        if self.last > 0 {
            self.lengths[self.last - 1].record(drafted, kept);
        }
    }
}

/// Prompt lookup with its draft length chosen per matched suffix length ([`LengthByMatch`]).
#[derive(Clone, Debug)]
pub struct Lookup {
    n_max: usize,
    lengths: LengthByMatch,
}

impl Lookup {
    /// Suffixes of up to `n_max` tokens, drafts of up to `k_max`; `pass` as for
    /// [`LengthByMatch::new`].
    pub fn new(n_max: usize, k_max: usize, adaptive: bool, pass: PassCost) -> Self {
        Lookup {
            n_max,
            lengths: LengthByMatch::new(n_max, k_max, adaptive, pass),
        }
    }

    /// Fills `out` with the draft for the next pass: at most `cap` tokens, as many as the
    /// acceptance seen after matches of this length makes worth verifying.
    pub fn propose(&mut self, context: &[u32], cap: usize, out: &mut Vec<u32>) {
        let m = lookup(context, self.n_max, cap, out);
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

    #[test]
    fn continues_the_longest_latest_match() {
        let mut out = Vec::new();
        // "1 2 3 4 ... 1 2 3" -> "4 5"
        lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 2, &mut out);
        assert_eq!(out, [4, 5]);
        // The latest of two matches of equal length.
        lookup(&[7, 1, 8, 7, 1, 6, 7, 1], 2, 1, &mut out);
        assert_eq!(out, [6]);
        // A longer match beats a later shorter one.
        lookup(&[5, 7, 1, 2, 9, 1, 3, 5, 7, 1], 3, 3, &mut out);
        assert_eq!(out, [2, 9, 1]);
        // A continuation that reaches the end of the context repeats the period it found.
        lookup(&[4, 4, 4], 2, 5, &mut out);
        assert_eq!(out, [4, 4, 4, 4, 4]);
        // "a b c a b": the suffix "a b" matched 3 back, so the draft repeats c a b c ...
        lookup(&[1, 2, 3, 1, 2], 2, 7, &mut out);
        assert_eq!(out, [3, 1, 2, 3, 1, 2, 3]);
        // A match far enough back is copied, not repeated.
        lookup(&[1, 2, 5, 6, 7, 8, 1, 2], 2, 3, &mut out);
        assert_eq!(out, [5, 6, 7]);
        // No earlier occurrence, k = 0, a one-token context.
        lookup(&[1, 2, 3], 3, 4, &mut out);
        assert!(out.is_empty());
        lookup(&[1, 2, 1], 3, 0, &mut out);
        assert!(out.is_empty());
        lookup(&[1], 3, 4, &mut out);
        assert!(out.is_empty());
        // The matched length is returned.
        assert_eq!(lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 3, 2, &mut out), 3);
        assert_eq!(lookup(&[7, 1, 8, 7, 1, 6, 7, 1], 3, 1, &mut out), 2);
        assert_eq!(lookup(&[1, 2, 3], 3, 4, &mut out), 0);
    }

    /// Each match length learns its own draft length: long matches that keep being copied
    /// draft the whole cap, one-token matches that keep being rejected stop drafting.
    #[test]
    fn lookup_drafts_by_match_length() {
        let mut l = Lookup::new(3, 8, true, PassCost::flat(0.1));
        let copy: Vec<u32> = (0..20).chain(0..4).collect(); // ends in a 3-token match
        let guess: Vec<u32> = vec![9, 1, 5, 7, 1]; // ends in a 1-token match
        let mut out = Vec::new();
        for _ in 0..30 {
            l.propose(&copy, 8, &mut out);
            let n = out.len();
            l.record(n, n); // every drafted token kept
            l.propose(&guess, 8, &mut out);
            l.record(out.len(), 0); // the first drafted token rejected
        }
        l.propose(&copy, 8, &mut out);
        assert_eq!(out, (4..12).collect::<Vec<u32>>());
        l.propose(&guess, 8, &mut out);
        assert!(out.is_empty(), "one-token matches still draft {out:?}");
        // A non-adaptive lookup drafts the cap whatever the outcome.
        let mut fixed = Lookup::new(3, 2, false, PassCost::flat(0.2));
        fixed.propose(&guess, 2, &mut out);
        assert_eq!(out, [5, 7]);
    }
}
