//! The Llama forward pass, top to bottom; the switches of [`super::Features`] (Gemma 3's
//! extra norms, GELU gating, NeoX RoPE, sliding windows) are read in place.
//!
//! One call processes `n` new tokens at positions `kv.len() .. kv.len() + n`: a whole prompt
//! (prefill, matrix-matrix products) or a single token (decode, matrix-vector products). Keys and
//! values of the new tokens are appended to the cache; attention reads the whole cached prefix.
//! A batched call ([`Model::forward_batch`]) does the same for several sequences at once: their
//! tokens are one block of rows for every product, and only attention is per sequence.

use std::ops::Range;

use super::Model;
use super::features::FfnAct;
use super::mla::{self, LatentPath};
use super::moe::MoeScratch;
use super::weights::{Ffn, KvProjection, LayerWeights, Mlp};
use crate::attention::{Attention, AttnShape, AttnWorkspace, attend};
use crate::error::Error;
use crate::kv::{KvBatch, KvPool, KvSequence, OneSeq, PoolBatch, SeqId};
use crate::ops::{
    RopeScaling, RopeTable, add_assign, geglu_tanh, rms_norm, rms_norm_prefix, sized, swiglu,
};
use crate::quant::{ActBuffers, Matrix, ProductInput};
use rayon::prelude::*;

/// Which positions of the batch need logits (the output projection is the costliest matrix).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token: generation.
    Last,
    /// Every token: scoring.
    All,
    /// Tokens `i..n` of the batch: perplexity scores only the second half of each window.
    From(usize),
}

/// What a pass starts from: token ids, embedded first, or the residual stream entering the first
/// layer of the pass (`rows x n_embd`), as an earlier pass over the layers before left it
/// ([`Scratch::hidden`]). Splitting the layers into spans is how an early-exit draft shares its
/// work with the full model (see `speculate`).
#[derive(Copy, Clone, Debug)]
pub enum Input<'a> {
    Tokens(&'a [u32]),
    Hidden(&'a [f32]),
}

/// Reusable activation buffers, grown to the largest batch seen, so steady-state decode does
/// not allocate; and the attention implementation with its workspace.
#[derive(Default, Debug)]
pub struct Scratch {
    /// Which attention kernel the pass uses (both are exact).
    pub attention: Attention,
    /// How latent attention (MLA) is computed (both are exact).
    pub latent: LatentPath,
    spaces: AttnSpaces,
    x: Vec<f32>,
    xb: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    logits: Vec<f32>,
    /// Rows of the batch whose logits are wanted.
    logit_rows: Vec<usize>,
    /// Per segment: first position, first row, rows.
    segs: Vec<(usize, usize, usize)>,
    batch_tokens: Vec<u32>,
    batch_seqs: Vec<SeqId>,
    batch_lens: Vec<usize>,
    rope: RopeTable,
    /// RoPE of the sliding-window layers, when they have their own base.
    rope_local: RopeTable,
    /// The integer forms of the current products' input.
    acts: ActBuffers,
    /// The FFN's hidden rows' forms, for the down projection (`acts` holds its input's).
    hidden_acts: ActBuffers,
    /// The experts' buffers and, when asked for, routing statistics.
    pub moe: MoeScratch,
    lat: mla::LatentBufs,
}

/// Attention's workspaces: one for a lone sequence, one per sequence of a batch (their
/// attention runs in parallel).
#[derive(Default, Debug)]
pub(super) struct AttnSpaces {
    one: AttnWorkspace,
    per_seq: Vec<AttnWorkspace>,
}

impl AttnSpaces {
    /// The lone sequence's workspace.
    pub(super) fn one(&mut self) -> &mut AttnWorkspace {
        &mut self.one
    }
}

impl Scratch {
    /// Buffers for a pass that computes attention with `attention`.
    pub fn new(attention: Attention) -> Self {
        Scratch {
            attention,
            ..Default::default()
        }
    }

    /// The residual stream of every row of the last pass after its last layer, before the
    /// final norm (`rows x n_embd`).
    pub fn hidden(&self) -> &[f32] {
        &self.x
    }

    /// The logits the last pass returned (`rows x n_vocab`).
    pub fn logits(&self, n_vocab: usize) -> &[f32] {
        &self.logits[..self.logit_rows.len() * n_vocab]
    }
}

/// Where in a layer an activation is observed: the inputs of its matrix products.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Site {
    /// The normalized input of Q, K and V.
    AttnInput,
    /// The attention output, input of the output projection.
    AttnOutput,
    /// The normalized input of the gate and up projections.
    FfnInput,
    /// The SwiGLU product, input of the down projection.
    FfnDownInput,
    /// The residual stream after the block (its output, the next block's input): what
    /// hidden-state distillation matches.
    LayerOutput,
}

/// Receives activations as the forward pass produces them, for analysis tools (which activation
/// channels carry outliers, for instance). `x` holds the batch's rows of `width` values.
pub trait Observer {
    fn observe(&mut self, layer: usize, site: Site, x: &[f32], width: usize);
}

fn observe(obs: &mut Option<&mut dyn Observer>, layer: usize, site: Site, x: &[f32], w: usize) {
    if let Some(o) = obs {
        o.observe(layer, site, x, w);
    }
}

/// One sequence's part of a batched forward pass: its new tokens, and whether it needs the
/// logits of its last one (a prompt chunk before the last does not), or of every one (a
/// speculative draft being verified).
#[derive(Copy, Clone, Debug)]
pub struct Segment<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub logits: bool,
    pub all_logits: bool,
}

impl Model {
    /// Runs `tokens` through the model, appending their keys and values to `kv`, and returns the
    /// logits of the requested rows (`rows x n_vocab`, row-major).
    ///
    /// The products and attention split their work over the current rayon pool's threads,
    /// held as one team for the pass (`crate::team`). Call it from inside the pool that runs
    /// them (`pool.install(|| ...)`, as the CLI and the server do): from outside there is no
    /// team, and every parallel section is a cross-thread handoff, which measured ~60% slower
    /// per one-token decode step (7.6 against 4.6 ms for SmolLM2 on 2 threads).
    pub fn forward<'s>(
        &self,
        tokens: &[u32],
        kv: &mut dyn KvSequence,
        s: &'s mut Scratch,
        want: Logits,
    ) -> Result<&'s [f32], Error> {
        self.forward_observed(tokens, kv, s, want, None)
    }

    /// [`forward`](Self::forward), showing the input of every matrix product to `obs`.
    pub fn forward_observed<'s>(
        &self,
        tokens: &[u32],
        kv: &mut dyn KvSequence,
        s: &'s mut Scratch,
        want: Logits,
        obs: Option<&mut dyn Observer>,
    ) -> Result<&'s [f32], Error> {
        let all = 0..self.config.n_layers;
        let rows = self.run_one(Input::Tokens(tokens), all, kv, s, Some(want), obs)?;
        Ok(&s.logits[..rows * self.config.n_vocab])
    }

    /// One sequence's pass, split into passes the cache can take at once (a sliding-window
    /// ring holds one pass beyond its window; the rows come out the same bits however a
    /// sequence is split, see `attention::key_chunk`). Fails before changing anything when the
    /// input does not fit the context or has a bad token.
    fn run_one(
        &self,
        input: Input,
        layers: Range<usize>,
        kv: &mut dyn KvSequence,
        s: &mut Scratch,
        want: Option<Logits>,
        mut obs: Option<&mut dyn Observer>,
    ) -> Result<usize, Error> {
        let (d, nv) = (self.config.n_embd, self.config.n_vocab);
        let n = match input {
            Input::Tokens(t) => t.len(),
            Input::Hidden(h) => h.len() / d,
        };
        let first = want.map(|w| match w {
            Logits::Last => n.saturating_sub(1),
            Logits::All => 0,
            Logits::From(i) => i.min(n.saturating_sub(1)),
        });
        let max = kv.max_chunk().max(1);
        if n <= max {
            s.logit_rows.clear();
            if let Some(first) = first {
                s.logit_rows.extend(first..n);
            }
            return self.run(input, layers, &[n], &mut OneSeq(kv), s, obs);
        }
        if n > kv.room() {
            return Err(crate::kv::KvError::ContextFull {
                len: kv.len(),
                adding: n,
                capacity: kv.len() + kv.room(),
            }
            .into());
        }
        if let Input::Tokens(t) = input
            && let Some(&bad) = t.iter().find(|&&t| t as usize >= nv)
        {
            return Err(Error::BadToken {
                id: bad,
                n_vocab: nv,
            });
        }
        let (mut logits, mut hidden) = (Vec::new(), Vec::with_capacity(n * d));
        for c0 in (0..n).step_by(max) {
            let c1 = (c0 + max).min(n);
            s.logit_rows.clear();
            if let Some(first) = first.filter(|&f| f < c1) {
                s.logit_rows.extend(first.max(c0) - c0..c1 - c0);
            }
            let part = match input {
                Input::Tokens(t) => Input::Tokens(&t[c0..c1]),
                Input::Hidden(h) => Input::Hidden(&h[c0 * d..c1 * d]),
            };
            let one = &mut OneSeq(&mut *kv);
            let o = obs.as_mut().map(|o| &mut **o as &mut dyn Observer);
            let rows = self.run(part, layers.clone(), &[c1 - c0], one, s, o)?;
            logits.extend_from_slice(&s.logits[..rows * nv]);
            hidden.extend_from_slice(&s.x[..(c1 - c0) * d]);
        }
        s.logit_rows.clear();
        if let Some(first) = first {
            s.logit_rows.extend(first..n);
        }
        s.logits = logits;
        s.x = hidden;
        Ok(s.logit_rows.len())
    }

    /// Runs the layers `layers` only, from `input`, over a cache that holds just those layers
    /// (its layer 0 is layer `layers.start`). With `want`, the final norm and the output head
    /// follow the last layer of the span even when it is not the model's last: an early exit.
    /// [`Scratch::hidden`] then holds the residual stream the next span starts from. A pass over
    /// `0..L` then one over `L..n_layers` from its hidden state gives the same bits as one
    /// pass over all layers.
    pub fn forward_span<'s>(
        &self,
        input: Input,
        layers: Range<usize>,
        kv: &mut dyn KvSequence,
        s: &'s mut Scratch,
        want: Option<Logits>,
    ) -> Result<&'s [f32], Error> {
        let rows = self.run_one(input, layers, kv, s, want, None)?;
        Ok(&s.logits[..rows * self.config.n_vocab])
    }

    /// Advances several sequences of `pool` in one pass: every weight matrix is read once for
    /// all their tokens, and each sequence's attention runs over its own blocks. Returns the
    /// logits of the last token of each segment that asks for them (of every token with
    /// `all_logits`), in segment order
    /// (`rows x n_vocab`). A sequence's logits are the same bits as when it runs alone (see
    /// `attention::key_chunk`; the products treat every row on its own). On an error (the pool
    /// is full, a bad token) no sequence changes.
    pub fn forward_batch<'s>(
        &self,
        segs: &[Segment],
        pool: &mut KvPool,
        s: &'s mut Scratch,
    ) -> Result<&'s [f32], Error> {
        let mut tokens = std::mem::take(&mut s.batch_tokens);
        let mut seqs = std::mem::take(&mut s.batch_seqs);
        let mut lens = std::mem::take(&mut s.batch_lens);
        tokens.clear();
        seqs.clear();
        lens.clear();
        s.logit_rows.clear();
        for g in segs {
            if seqs.contains(&g.seq) {
                return Err(Error::Invalid(format!(
                    "sequence {} appears twice in one batch",
                    g.seq.index()
                )));
            }
            let first = tokens.len();
            tokens.extend_from_slice(g.tokens);
            if g.all_logits {
                s.logit_rows.extend(first..tokens.len());
            } else if g.logits && !g.tokens.is_empty() {
                s.logit_rows.push(tokens.len() - 1);
            }
            seqs.push(g.seq);
            lens.push(g.tokens.len());
        }
        let all = 0..self.config.n_layers;
        let r = self.run(
            Input::Tokens(&tokens),
            all,
            &lens,
            &mut PoolBatch { pool, seqs: &seqs },
            s,
            None,
        );
        (s.batch_tokens, s.batch_seqs, s.batch_lens) = (tokens, seqs, lens);
        let rows = r?;
        Ok(&s.logits[..rows * self.config.n_vocab])
    }

    /// The forward pass through `layers` over the rows of every segment (`lens[i]` rows of
    /// segment `i`, one after another in `input`), leaving the logits of the rows in
    /// `s.logit_rows` in `s.logits`; returns how many rows that is. Layer `l` of the model is
    /// layer `l - layers.start` of the cache.
    fn run(
        &self,
        input: Input,
        layers: Range<usize>,
        lens: &[usize],
        kv: &mut dyn KvBatch,
        s: &mut Scratch,
        obs: Option<&mut dyn Observer>,
    ) -> Result<usize, Error> {
        // The pool's threads are held for the whole pass: its ~250 short parallel sections
        // (a decode step) then cost a store and a spin each instead of a rayon fork and join.
        crate::team::with_team(|| self.run_layers(input, layers, lens, kv, s, obs))
    }

    fn run_layers(
        &self,
        input: Input,
        layers: Range<usize>,
        lens: &[usize],
        kv: &mut dyn KvBatch,
        s: &mut Scratch,
        mut obs: Option<&mut dyn Observer>,
    ) -> Result<usize, Error> {
        let n = self.check_pass(input, &layers, lens, kv)?;
        for (i, &len) in lens.iter().enumerate() {
            if let Err(e) = kv.reserve(i, len) {
                (0..i).for_each(|j| kv.unreserve(j));
                return Err(e.into());
            }
        }
        // Each segment's first position and first row in the batch.
        s.segs.clear();
        let mut row = 0;
        for (i, &len) in lens.iter().enumerate() {
            s.segs.push((kv.len(i), row, len));
            row += len;
        }
        self.embed(input, n, s);
        self.fill_rope_tables(s);
        let d = self.config.n_embd;
        for (l, lw) in self.weights.layers[layers.clone()].iter().enumerate() {
            let l_model = l + layers.start;
            self.attention_block(l_model, l, lw, n, kv, s, &mut obs);
            self.ffn_block(l_model, lw, n, s, &mut obs);
            observe(&mut obs, l_model, Site::LayerOutput, &s.x, d);
        }
        for (i, &(_, _, len)) in s.segs.iter().enumerate() {
            kv.commit(i, len);
        }
        Ok(self.head(s))
    }

    /// Checks a pass's input against the model and the cache before anything changes;
    /// returns its rows.
    fn check_pass(
        &self,
        input: Input,
        layers: &Range<usize>,
        lens: &[usize],
        kv: &dyn KvBatch,
    ) -> Result<usize, Error> {
        let c = &self.config;
        let d = c.n_embd;
        let n = match input {
            Input::Tokens(t) => t.len(),
            Input::Hidden(h) => h.len() / d,
        };
        debug_assert_eq!(lens.iter().sum::<usize>(), n);
        debug_assert_eq!(lens.len(), kv.segments());
        if n == 0 || lens.contains(&0) {
            return Err(Error::EmptyInput);
        }
        if layers.start > layers.end || layers.end > c.n_layers {
            return Err(Error::Invalid(format!(
                "layers {}..{} of a model with {}",
                layers.start, layers.end, c.n_layers
            )));
        }
        match input {
            Input::Tokens(_) if layers.start != 0 => Err(Error::Invalid(format!(
                "a pass from token ids starts at layer 0, not {}",
                layers.start
            ))),
            Input::Tokens(tokens) => match tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
                Some(&bad) => Err(Error::BadToken {
                    id: bad,
                    n_vocab: c.n_vocab,
                }),
                None => Ok(n),
            },
            Input::Hidden(h) if h.len() != n * d => Err(Error::Invalid(format!(
                "hidden states of {} values are not rows of {d}",
                h.len()
            ))),
            Input::Hidden(_) => Ok(n),
        }
    }

    /// The residual stream entering the pass: the token embeddings (rows of the usually
    /// quantized table, decoded; scaled where the family scales them), or the given rows.
    fn embed(&self, input: Input, n: usize, s: &mut Scratch) {
        let d = self.config.n_embd;
        let x = sized(&mut s.x, n * d);
        match input {
            Input::Tokens(tokens) => {
                let embd = self.weights.token_embd.view();
                for (row, &t) in x.chunks_exact_mut(d).zip(tokens) {
                    embd.dequantize_row(t as usize, row);
                }
                if let Some(scale) = self.config.features.embd_scale {
                    x.iter_mut().for_each(|v| *v *= scale);
                }
            }
            Input::Hidden(h) => x.copy_from_slice(h),
        }
    }

    /// The RoPE angles of every position of the pass; local layers with a base of their own
    /// rotate without the global scaling (Gemma 3).
    fn fill_rope_tables(&self, s: &mut Scratch) {
        let c = &self.config;
        let local_base = c.features.sliding.and_then(|sw| sw.local_rope_base);
        let unscaled = RopeScaling::default();
        for (table, base, scaling) in [
            (&mut s.rope, Some(c.rope_base), &c.rope_scaling),
            (&mut s.rope_local, local_base, &unscaled),
        ] {
            let Some(base) = base else { continue };
            table.style = c.features.rope;
            table.set_scaling(scaling);
            table.fill(0, 0, c.rope_dim, base);
            for &(pos0, _, len) in &s.segs {
                table.extend(pos0, len, c.rope_dim, base);
            }
        }
    }

    /// The attention block of layer `l_model` (layer `l` of the cache): norm -> Q, K, V ->
    /// RoPE -> cache -> attention -> output -> residual.
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        l_model: usize,
        l: usize,
        lw: &LayerWeights,
        n: usize,
        kv: &mut dyn KvBatch,
        s: &mut Scratch,
        obs: &mut Option<&mut dyn Observer>,
    ) {
        let c = &self.config;
        let (d, attn_dim) = (c.n_embd, c.attn_dim());
        let xb = sized(&mut s.xb, n * d);
        rms_norm(&s.x, &lw.attn_norm, c.rms_eps, xb);
        observe(obs, l_model, Site::AttnInput, xb, d);
        let mut x = ProductInput::new(xb, d, self.activations, &mut s.acts);
        let q = sized(&mut s.q, n * c.q_dim());
        let att = sized(&mut s.att, n * attn_dim);
        match &lw.kv {
            KvProjection::Heads { wk, wv } => {
                let k = sized(&mut s.k, n * c.kv_dim());
                let v = sized(&mut s.v, n * c.kv_dim());
                Matrix::apply_many([&lw.wq, wk, wv], &mut x, [&mut *q, &mut *k, &mut *v]);
                let b = &lw.biases;
                for (y, bias) in [(&mut *q, &b.q), (&mut *k, &b.k), (&mut *v, &b.v)] {
                    add_bias(y, bias.as_deref());
                }
                let window = c.features.window(l_model);
                let rope = match c.features.sliding.and_then(|sw| sw.local_rope_base) {
                    Some(_) if window.is_some() => &s.rope_local,
                    _ => &s.rope,
                };
                self.position_heads(lw, rope, q, k);
                // Only attention is per sequence: its own positions, its own cache.
                let kv_dim = c.kv_dim();
                for (i, &(_, r0, len)) in s.segs.iter().enumerate() {
                    let rows = r0 * kv_dim..(r0 + len) * kv_dim;
                    kv.append(i, l, &k[rows.clone()], &v[rows]);
                }
                let shape = AttnShape {
                    n_head: c.n_head,
                    n_head_kv: c.n_head_kv,
                    head_dim: c.head_dim,
                    window,
                };
                let spaces = &mut s.spaces;
                attend_segments(s.attention, shape, q, &*kv, l, &s.segs, att, spaces);
            }
            KvProjection::Latent { .. } => {
                let at = mla::At {
                    layer: l,
                    rope: &s.rope,
                    segs: &s.segs,
                    kind: s.attention,
                    path: s.latent,
                };
                self.latent_attention(lw, at, &mut x, q, kv, &mut s.lat, &mut s.spaces, att);
            }
        }
        observe(obs, l_model, Site::AttnOutput, att, attn_dim);
        let proj = sized(&mut s.proj, n * d);
        let mut a = ProductInput::new(att, attn_dim, self.activations, &mut s.acts);
        lw.wo.apply(&mut a, proj);
        add_bias(proj, lw.biases.o.as_deref());
        if let Some(w) = &lw.extra_norms.post_attn {
            rms_norm_prefix(proj, d, w, c.rms_eps);
        }
        add_assign(&mut s.x, proj);
    }

    /// Queries and keys of every head as attention compares them: each head normalized where
    /// the family does (q/k norms), rotated to its position, the queries scaled where the
    /// family gives attention its own scale.
    fn position_heads(&self, lw: &LayerWeights, rope: &RopeTable, q: &mut [f32], k: &mut [f32]) {
        let c = &self.config;
        let en = &lw.extra_norms;
        if let (Some(qn), Some(kn)) = (&en.q, &en.k) {
            // Each head on its own (rows of `head_dim`).
            rms_norm_prefix(q, c.head_dim, qn, c.rms_eps);
            rms_norm_prefix(k, c.head_dim, kn, c.rms_eps);
        }
        rope.apply(q, c.n_head, c.head_dim);
        rope.apply(k, c.n_head_kv, c.head_dim);
        if let Some(qs) = c.features.query_scale {
            // Attention divides by sqrt(head_dim); the scores take `qs` instead.
            let f = qs * (c.head_dim as f32).sqrt();
            q.iter_mut().for_each(|v| *v *= f);
        }
    }

    /// The feed-forward block: norm -> SwiGLU(gate, up) -> down (one block, or the experts the
    /// router picks) -> residual.
    fn ffn_block(
        &self,
        l_model: usize,
        lw: &LayerWeights,
        n: usize,
        s: &mut Scratch,
        obs: &mut Option<&mut dyn Observer>,
    ) {
        let c = &self.config;
        let d = c.n_embd;
        let xb = sized(&mut s.xb, n * d);
        rms_norm(&s.x, &lw.ffn_norm, c.rms_eps, xb);
        observe(obs, l_model, Site::FfnInput, xb, d);
        let proj = sized(&mut s.proj, n * d);
        match &lw.ffn {
            Ffn::Dense(mlp) => {
                let mut x = ProductInput::new(xb, d, self.activations, &mut s.acts);
                let (gate, up, ha) = (&mut s.gate, &mut s.up, &mut s.hidden_acts);
                self.mlp(mlp, &mut x, c.n_ff, gate, up, ha, proj);
                // `gate` holds the SwiGLU product, the down projection's input.
                let h = &s.gate[..n * c.n_ff];
                observe(obs, l_model, Site::FfnDownInput, h, c.n_ff);
            }
            Ffn::Experts(ex) => {
                self.experts_ffn(l_model, ex, xb, &mut s.acts, &mut s.moe, proj);
            }
        }
        if let Some(w) = &lw.extra_norms.post_ffn {
            rms_norm_prefix(proj, d, w, c.rms_eps);
        }
        add_assign(&mut s.x, proj);
    }

    /// The final norm and the output projection, only for the rows that need logits; returns
    /// how many rows that is.
    fn head(&self, s: &mut Scratch) -> usize {
        let (c, w) = (&self.config, &self.weights);
        let (rows, d) = (s.logit_rows.len(), c.n_embd);
        if rows == 0 {
            return 0;
        }
        let xb = sized(&mut s.xb, rows * d);
        for (out, &r) in xb.chunks_exact_mut(d).zip(&s.logit_rows) {
            rms_norm(&s.x[r * d..(r + 1) * d], &w.output_norm, c.rms_eps, out);
        }
        let logits = sized(&mut s.logits, rows * c.n_vocab);
        let mut x = ProductInput::new(xb, d, self.activations, &mut s.acts);
        w.output.apply(&mut x, logits);
        rows
    }

    /// One SwiGLU block over the rows of `x`: `y = down(silu(gate x) * up x)`, `ff` neurons
    /// wide; `gate` is left holding the SwiGLU product.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mlp(
        &self,
        w: &Mlp,
        x: &mut ProductInput,
        ff: usize,
        gate: &mut Vec<f32>,
        up: &mut Vec<f32>,
        acts: &mut ActBuffers,
        y: &mut [f32],
    ) {
        let n = x.rows();
        let gate = sized(gate, n * ff);
        let up = sized(up, n * ff);
        Matrix::apply_many([&w.gate, &w.up], x, [&mut *gate, &mut *up]);
        match self.config.features.ffn_act {
            FfnAct::Silu => swiglu(gate, up),
            FfnAct::GeluTanh => geglu_tanh(gate, up),
        }
        let mut h = ProductInput::new(gate, ff, self.activations, acts);
        w.down.apply(&mut h, y);
    }
}

/// Attention of every sequence of the pass over its own cache (layer `layer` of segment `i` of
/// `kv` for `segs[i]`: first position, first row, rows), writing each row's output into `out`.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend_segments(
    kind: Attention,
    shape: AttnShape,
    q: &[f32],
    kv: &dyn KvBatch,
    layer: usize,
    segs: &[(usize, usize, usize)],
    out: &mut [f32],
    spaces: &mut AttnSpaces,
) {
    let (ws, seg_ws) = (&mut spaces.one, &mut spaces.per_seq);
    let q_dim = shape.n_head * shape.head_dim;
    if segs.len() == 1 {
        let (kl, vl) = kv.layer(0, layer);
        return attend(kind, shape, q, kl, vl, segs[0].0, out, ws);
    }
    let views: Vec<_> = (0..segs.len()).map(|i| kv.layer(i, layer)).collect();
    // Sequences in parallel (each call is small in a decode step); a row's result does not
    // depend on how its call was scheduled.
    if seg_ws.len() < segs.len() {
        seg_ws.resize_with(segs.len(), Default::default);
    }
    let mut outs = Vec::with_capacity(segs.len());
    let mut rest = &mut out[..];
    for &(_, _, len) in segs {
        let (head, tail) = rest.split_at_mut(len * q_dim);
        outs.push(head);
        rest = tail;
    }
    segs.par_iter()
        .zip(outs)
        .zip(views)
        .zip(&mut seg_ws[..])
        .for_each(|(((&(pos0, r0, len), out), (kl, vl)), ws)| {
            let q = &q[r0 * q_dim..(r0 + len) * q_dim];
            attend(kind, shape, q, kl, vl, pos0, out, ws);
        });
}

/// Adds `bias` to every row of `y` (rows of `bias.len()`), when there is one.
pub(super) fn add_bias(y: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(v, &x)| *v += x);
        }
    }
}
