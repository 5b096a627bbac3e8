//! A smaller model with the same vocabulary drafts for the target, with its own cache.
//!
//! Between passes the draft's cache is brought in line with the context by keeping the longest
//! common prefix of the tokens it holds, which drops whatever the target rejected, then running
//! what it has not seen (usually the target's correction, one token).

use crate::attention::Attention;
use crate::error::{Error, Result};
use crate::kv::{KvOptions, SeqCache};
use crate::model::{Logits, Model, Scratch};
use crate::sample::Sampler;

pub struct DraftModel {
    pub model: Model,
    cache: SeqCache,
    scratch: Scratch,
    /// Tokens whose keys and values are in `cache`.
    cached: Vec<u32>,
}

impl DraftModel {
    /// A drafter for `target` from `model`, which must share its vocabulary token for token.
    pub fn new(
        model: Model,
        target: &Model,
        ctx: usize,
        kv: &KvOptions,
        attention: Attention,
    ) -> Result<Self> {
        check_same_vocabulary(&model, target)?;
        let cache = model.new_seq_cache(ctx, kv)?;
        Ok(DraftModel {
            model,
            cache,
            scratch: Scratch::new(attention),
            cached: Vec::new(),
        })
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
        let common = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        self.cache.truncate(common);
        self.cached.truncate(common);
        let greedy = sampler.params.temperature <= 0.0;
        let mut seq = context.to_vec();
        let mut feed = context[common..].to_vec();
        for i in 0..k {
            let logits =
                self.model
                    .forward(&feed, &mut self.cache, &mut self.scratch, Logits::Last)?;
            self.cached.extend_from_slice(&feed);
            let (seen, generated) = (&seq[..], &seq[gen_start..]);
            let d = if greedy {
                sampler.sample_with(logits, seen, generated)
            } else {
                if q.len() <= i {
                    q.push(Vec::new());
                }
                sampler.distribution(logits, seen, generated, &mut q[i]);
                sampler.draw(&q[i]).unwrap_or(q[i][0].0)
            };
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
