//! A smaller model with the same vocabulary drafts for the target, with its own cache.
//!
//! Between passes the draft's cache is brought in line with the context by keeping the longest
//! common prefix of the tokens it holds, which drops whatever the target rejected, then running
//! what it has not seen (usually the target's correction, one token).

use crate::attention::Attention;
use crate::error::{Error, Result};
use crate::kv::{KvOptions, SeqCache};
use crate::model::{Input, Logits, Model, Scratch};
use crate::ops::rms_norm;
use crate::sample::Sampler;

use super::draft_token;
use super::heads::SubsetHead;

pub struct DraftModel {
    pub model: Model,
    cache: SeqCache,
    scratch: Scratch,
    /// Tokens whose keys and values are in `cache`.
    cached: Vec<u32>,
    /// The draft's output head restricted to its first token ids (FR-Spec), if asked.
    subset: Option<SubsetHead>,
    z: Vec<f32>,
    /// The context followed by the tokens drafted so far, and the tokens the next pass feeds.
    seq: Vec<u32>,
    feed: Vec<u32>,
}

impl DraftModel {
    /// A drafter for `target` from `model`, which must share its vocabulary token for token.
    /// With `vocab`, the draft scores only the first `vocab` token ids: a BPE vocabulary is
    /// numbered in merge order, so those are (roughly) the most frequent tokens.
    pub fn new(
        model: Model,
        target: &Model,
        ctx: usize,
        kv: &KvOptions,
        attention: Attention,
        vocab: Option<usize>,
    ) -> Result<Self> {
        check_same_vocabulary(&model, target)?;
        let cache = model.new_seq_cache(ctx, kv)?;
        let subset = match vocab {
            Some(n) if n < model.config.n_vocab => {
                Some(SubsetHead::new(&model, (0..n as u32).collect())?)
            }
            _ => None,
        };
        Ok(DraftModel {
            model,
            cache,
            scratch: Scratch::new(attention),
            cached: Vec::new(),
            subset,
            z: Vec::new(),
            seq: Vec::new(),
            feed: Vec::new(),
        })
    }

    /// Multiply-adds of the draft's matrix products per token.
    pub fn macs_per_token(&self) -> f64 {
        let c = &self.model.config;
        let head = self.subset.as_ref().map_or(c.n_vocab, |s| s.len());
        super::decode::macs_per_token(c, c.n_layers, head)
    }

    pub fn kv_bytes(&self) -> usize {
        self.cache.bytes_in_use()
    }

    /// Drafts up to `k` tokens after `context` (whose `gen_start..` part was generated), each
    /// drawn with `sampler` (greedy when it is); keeps the distribution of each in `q` when
    /// sampling. Stops early where the draft's context would be full.
    pub fn propose(
        &mut self,
        context: &[u32],
        gen_start: usize,
        k: usize,
        sampler: &mut Sampler,
        out: &mut Vec<u32>,
        q: &mut Vec<Vec<(u32, f32)>>,
    ) -> Result<()> {
        out.clear();
        let k = k.min(self.cache.capacity().saturating_sub(context.len()));
        if k == 0 || context.is_empty() {
            return Ok(());
        }
        let common = crate::generate::reusable_prefix(&self.cached, context);
        self.cache.truncate(common);
        self.cached.truncate(common);
        let (seq, feed) = (&mut self.seq, &mut self.feed);
        seq.clear();
        seq.extend_from_slice(context);
        feed.clear();
        feed.extend_from_slice(&context[common..]);
        let c = &self.model.config;
        for i in 0..k {
            let logits = match &mut self.subset {
                None => {
                    self.model
                        .forward(feed, &mut self.cache, &mut self.scratch, Logits::Last)?
                }
                Some(head) => {
                    let all = 0..c.n_layers;
                    let input = Input::Tokens(feed);
                    self.model.forward_span(
                        input,
                        all,
                        &mut self.cache,
                        &mut self.scratch,
                        None,
                    )?;
                    let h = self.scratch.hidden();
                    let last = &h[h.len() - c.n_embd..];
                    self.z.resize(c.n_embd, 0.0);
                    rms_norm(
                        last,
                        &self.model.weights.output_norm,
                        c.rms_eps,
                        &mut self.z,
                    );
                    head.logits(&self.z)?
                }
            };
            self.cached.extend_from_slice(feed);
            let d = draft_token(sampler, logits, seq, gen_start, i, q);
            out.push(d);
            seq.push(d);
            feed.clear();
            feed.push(d);
        }
        Ok(())
    }
}

/// The same vocabulary means the same token strings at the same ids: a draft that numbers tokens
/// differently would propose nonsense that the rule would reject, slowly.
pub fn check_same_vocabulary(draft: &Model, target: &Model) -> Result<()> {
    let (a, b) = (draft.config.n_vocab, target.config.n_vocab);
    if a != b {
        return Err(Error::Invalid(format!(
            "the draft model's vocabulary has {a} tokens, the target's {b}: a draft must share the target's vocabulary"
        )));
    }
    fn tokens(m: &Model) -> Option<Vec<&str>> {
        m.file.str_array("tokenizer.ggml.tokens").ok()
    }
    match (tokens(draft), tokens(target)) {
        (Some(x), Some(y)) => {
            if let Some(i) = (0..x.len().min(y.len())).find(|&i| x[i] != y[i]) {
                return Err(Error::Invalid(format!(
                    "the draft model's token {i} is {:?}, the target's {:?}: a draft must share the target's vocabulary",
                    x[i], y[i]
                )));
            }
            Ok(())
        }
        _ => Ok(()),
    }
}
