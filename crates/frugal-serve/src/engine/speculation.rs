//! Speculative decoding inside the scheduler: drafts from prompt lookup or the datastore for
//! each decoding sequence while the batch is small, and the verification of a draft against
//! the rows the batched pass computed for it (exact: the accepted tokens are those plain
//! decoding would have produced).

use frugal::speculate::rule;

use super::{Finish, SPECULATE_MAX_BATCH, Scheduler};

impl Scheduler {
    /// Prompt lookup (then retrieval from the datastore, where lookup finds nothing) for every
    /// decoding sequence, while the batch is small enough for drafts to pay; none before `min_tokens` (masked sampling is not what the rule checks).
    pub(super) fn draft(&mut self) {
        if self.cfg.speculate.is_none() {
            return;
        }
        let ctx = self.cfg.ctx;
        let decoding = self
            .running
            .iter()
            .filter(|s| s.tokens.len() - s.computed == 1)
            .count();
        for s in &mut self.running {
            s.draft.clear();
            s.from_store = false;
            let Some(lookup) = &mut s.lookup else {
                continue;
            };
            if decoding > SPECULATE_MAX_BATCH
                || s.tokens.len() - s.computed != 1
                || s.generated < s.shared.min_tokens
                || s.constraint.is_some()
            {
                continue;
            }
            let room = ctx.saturating_sub(s.tokens.len());
            let wanted = s.shared.max_tokens.saturating_sub(s.generated + 1);
            lookup.propose(&s.tokens, room.min(wanted), &mut s.draft);
            if let Some(r) = s.retrieval.as_mut().filter(|_| s.draft.is_empty()) {
                r.propose(&s.tokens, room.min(wanted), &mut s.draft);
                s.from_store = !s.draft.is_empty();
            }
        }
    }

    /// Checks sequence `i`'s draft against its `rows` (one per token fed), keeps the accepted
    /// prefix in the pool and streams it with the target's next token; returns why the sequence
    /// ends, if it does.
    pub(super) fn verify(&mut self, i: usize, rows: &[f32]) -> Option<Finish> {
        let v = self.model.config.n_vocab;
        let s = &mut self.running[i];
        let draft = std::mem::take(&mut s.draft);
        s.tokens.truncate(s.tokens.len() - draft.len());
        let verdict = rule::verify(
            rows,
            v,
            &draft,
            None,
            &s.tokens,
            s.shared.prompt_len,
            &mut s.sampler,
            &mut self.verify_ws,
        );
        match (&mut s.retrieval, &mut s.lookup) {
            (Some(r), _) if s.from_store => r.record(draft.len(), verdict.accepted),
            (_, Some(lookup)) => lookup.record(draft.len(), verdict.accepted),
            _ => {}
        }
        let id = s.kv.expect("running");
        s.computed += 1;
        self.pool.truncate(id, s.computed + verdict.accepted);
        self.metrics.speculated(draft.len(), verdict.accepted);
        for (j, &t) in draft[..verdict.accepted].iter().enumerate() {
            let finish = self.emit(i, t, &rows[j * v..(j + 1) * v]);
            self.running[i].computed += 1;
            if finish.is_some() {
                return finish;
            }
        }
        self.register_blocks(i);
        let m = verdict.accepted;
        self.emit(i, verdict.next, &rows[m * v..(m + 1) * v])
    }
}
