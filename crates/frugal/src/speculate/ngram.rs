//! Prompt lookup: the draft is whatever followed the last time the context ended the same way.
//!
//! Input-grounded generation (summarizing, rewriting or editing a given text or code) copies long
//! runs of its input, so the tokens after an earlier occurrence of the last `n` tokens are a good
//! guess for the next ones, at no cost: no model, no weights. Longer matches are tried first
//! (`n_max` down to 1), and of equal length the most recent one wins, since nearby text is the
//! likeliest to be continued (apoorvumang/prompt-lookup-decoding; vLLM's and llama.cpp's n-gram
//! drafters work the same way).

/// Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `context` of at most `n_max` tokens; empty when no suffix occurred before.
pub fn lookup(context: &[u32], n_max: usize, k: usize, out: &mut Vec<u32>) {
    out.clear();
    let len = context.len();
    if k == 0 {
        return;
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
                return;
            }
        }
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
        // The continuation may run up to the end of the context (a repeating pattern).
        lookup(&[4, 4, 4], 2, 5, &mut out);
        assert_eq!(out, [4]);
        // No earlier occurrence, k = 0, a one-token context.
        lookup(&[1, 2, 3], 3, 4, &mut out);
        assert!(out.is_empty());
        lookup(&[1, 2, 1], 3, 0, &mut out);
        assert!(out.is_empty());
        lookup(&[1], 3, 4, &mut out);
        assert!(out.is_empty());
    }
}
