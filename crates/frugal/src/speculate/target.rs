//! The model being sped up, as speculation sees it: one cache, or, for the self-speculative
//! (early-exit) draft, its layers split in two at the exit.
//!
//! With an exit at layer L the draft *is* the target's first L layers: the keys and values it
//! writes there, and the residual stream it leaves after layer L, are exactly what the target's
//! own pass would compute for those tokens. So the lower cache is shared: the draft fills it one
//! token at a time, keeping each token's hidden state, and the verification only runs the
//! layers above the exit for the drafted tokens (plus the lower layers for the last draft token,
//! which the draft never ran). Nothing the draft computed is computed twice.

use crate::attention::Attention;
use crate::error::{Error, Result};
use crate::kv::{KvOptions, KvSequence, SeqCache};
use crate::model::{Input, Logits, Model, Scratch};

pub(crate) struct Target<'m> {
    pub model: &'m Model,
    /// Layers `0..split` (all of them without an exit).
    lower: SeqCache,
    /// Layers `split..n_layers`, with an exit.
    upper: Option<SeqCache>,
    split: usize,
    pub scratch: Scratch,
    /// Tokens in `lower` but not yet in `upper`, and their residual streams after layer `split`.
    pending: Vec<u32>,
    hidden: Vec<f32>,
}

impl<'m> Target<'m> {
    /// A target for `ctx` positions; `exit` splits its layers for an early-exit draft.
    pub fn new(
        model: &'m Model,
        ctx: usize,
        kv: &KvOptions,
        attention: Attention,
        exit: Option<usize>,
    ) -> Result<Self> {
        let c = &model.config;
        let split = exit.unwrap_or(c.n_layers);
        if split == 0 || split > c.n_layers {
            return Err(Error::Invalid(format!(
                "the early exit must be after layer 1 to {} of this model, not {split}",
                c.n_layers
            )));
        }
        let rings = model.cache_rings();
        let cache = |layers: std::ops::Range<usize>| {
            SeqCache::new(layers.len(), c.cache_shape(), ctx, kv, rings.slice(layers))
        };
        let upper = match split < c.n_layers {
            true => Some(cache(split..c.n_layers)?),
            false => None,
        };
        Ok(Target {
            model,
            lower: cache(0..split)?,
            upper,
            split,
            scratch: Scratch::new(attention),
            pending: Vec::new(),
            hidden: Vec::new(),
        })
    }

    pub fn ctx(&self) -> usize {
        self.lower.capacity()
    }

    /// Positions every layer holds.
    pub fn len(&self) -> usize {
        self.lower.len() - self.pending.len()
    }

    pub fn kv_bytes(&self) -> usize {
        self.lower.bytes_in_use() + self.upper.as_ref().map_or(0, |u| u.bytes_in_use())
    }

    /// Drops every position from `n` on, in every layer.
    pub fn truncate(&mut self, n: usize) {
        self.lower.truncate(n);
        if let Some(u) = &mut self.upper {
            u.truncate(n);
        }
        self.pending.clear();
        self.hidden.clear();
    }

    /// Runs `tokens` after the cached positions through every layer and returns the logits of
    /// the `want` rows. Tokens the early-exit draft has already run through the lower layers
    /// (a prefix of `tokens`) only go through the upper ones.
    pub fn forward(&mut self, tokens: &[u32], want: Logits) -> Result<&[f32]> {
        let Some(upper) = &mut self.upper else {
            return self
                .model
                .forward(tokens, &mut self.lower, &mut self.scratch, want);
        };
        let done = self.pending.len();
        if tokens.len() < done || tokens[..done] != self.pending[..] {
            // Not the tokens the draft ran (a caller changed course): redo them.
            let n = self.len();
            self.truncate(n);
            return self.forward(tokens, want);
        }
        if tokens.len() > done {
            let rest = Input::Tokens(&tokens[done..]);
            self.model.forward_span(
                rest,
                0..self.split,
                &mut self.lower,
                &mut self.scratch,
                None,
            )?;
            self.hidden.extend_from_slice(self.scratch.hidden());
        }
        let n_layers = self.model.config.n_layers;
        let hidden = std::mem::take(&mut self.hidden);
        let r = self.model.forward_span(
            Input::Hidden(&hidden),
            self.split..n_layers,
            upper,
            &mut self.scratch,
            Some(want),
        );
        self.hidden = hidden;
        self.hidden.clear();
        self.pending.clear();
        if r.is_err() {
            // The upper layers refused the rows (the context is full): keep the caches aligned.
            let n = self.upper.as_ref().map_or(0, |u| u.len());
            self.lower.truncate(n);
        }
        r
    }

    /// The early-exit draft's step: `token` through the layers below the exit, then the final
    /// norm and the head; returns its logits. Its keys, values and hidden state stay for the
    /// verification.
    pub fn exit_step(&mut self, token: u32) -> Result<&[f32]> {
        if self.upper.is_none() {
            return Err(Error::Invalid("this target has no early exit".into()));
        }
        self.model.forward_span(
            Input::Tokens(&[token]),
            0..self.split,
            &mut self.lower,
            &mut self.scratch,
            Some(Logits::Last),
        )?;
        self.pending.push(token);
        self.hidden.extend_from_slice(self.scratch.hidden());
        Ok(self.scratch.logits(self.model.config.n_vocab))
    }
}
