//! Draft heads (Medusa-1 style): K small heads on the target's last hidden state guess the
//! tokens two, three, ... K + 1 positions ahead, so every verification pass also yields the next
//! draft, with no draft model to run.
//!
//! Head `j` is a residual block on the normalized hidden state `z` (the input of the target's
//! output head): `u_j = z + SiLU(W_j z + b_j)`, then the target's own output matrix, frozen and
//! shared, gives its logits. With `W_j = 0` a head repeats the target's next-token guess, which is
//! the starting point of training (`frugal train-heads`, on the target's own generations).
//!
//! Token-conditioned heads (the default of `train-heads`, after Hydra and EAGLE) also read the
//! token before the one they guess: `u_j = z + SiLU(W_j [z; e_j] + b_j)`, where `e_j` is the
//! RMS-normalized input embedding of the target's own next token (head 0) or of head `j - 1`'s
//! draft. A Medusa head must guess token t+2 without knowing t+1; this one is told it, which is
//! most of what predicts t+2. Drafts after a wrong one are rejected anyway, so training on the
//! true previous tokens is training on exactly the case that counts.
//!
//! The output head over 49,152 tokens would be most of a head's cost, so a heads file may name
//! a vocabulary subset, the tokens most frequent in the training data (FR-Spec): the heads then
//! score only those rows of the output matrix. Verification still uses the full vocabulary, so
//! the output is unchanged; only drafts outside the subset become impossible.
//!
//! File: a GGUF with `general.architecture = frugal-heads`, `frugal-heads.count`,
//! `frugal-heads.embedding_length`, `frugal-heads.vocab_size` (the target's), optionally the
//! subset `frugal-heads.vocab` (token ids), `frugal-heads.token_input` (bool, absent: false),
//! and F32 tensors `heads.{j}.weight` (`d x d`, or `d x 2d` with the token input) and
//! `heads.{j}.bias` (`d`).

use std::borrow::Cow;
use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::{Array, GgufWriter, TensorData, Value};
use crate::model::Model;
use crate::ops::rms_norm;
use crate::quant::act::{Q8Acts, QK};
use crate::quant::packed::{PackedMatrix, matmul_packed};
use crate::quant::{GgmlType, WeightMatrix, dequantize_to_vec, matvec};
use crate::sample::Sampler;

pub const ARCH: &str = "frugal-heads";

/// The trained weights of the heads, as training produces them and the file stores them.
#[derive(Clone, Debug, PartialEq)]
pub struct HeadWeights {
    pub n_embd: usize,
    /// The target's vocabulary size.
    pub n_vocab: usize,
    /// Per head: `W` (`n_embd x input_len()`, row-major) and `b`.
    pub heads: Vec<(Vec<f32>, Vec<f32>)>,
    /// The tokens the heads may propose (all when `None`).
    pub vocab: Option<Vec<u32>>,
    /// Each head also reads the embedding of the token before the one it guesses.
    pub token_input: bool,
}

impl HeadWeights {
    /// Heads that repeat the target's next-token guess (`W = 0`, `b = 0`).
    pub fn identity(
        n_heads: usize,
        n_embd: usize,
        n_vocab: usize,
        vocab: Option<Vec<u32>>,
        token_input: bool,
    ) -> Self {
        let input = if token_input { 2 * n_embd } else { n_embd };
        HeadWeights {
            n_embd,
            n_vocab,
            heads: (0..n_heads)
                .map(|_| (vec![0.0; n_embd * input], vec![0.0; n_embd]))
                .collect(),
            vocab,
            token_input,
        }
    }

    /// The width of a head's input: `z`, or `z` and the previous token's embedding.
    pub fn input_len(&self) -> usize {
        if self.token_input {
            2 * self.n_embd
        } else {
            self.n_embd
        }
    }

    pub fn write(&self, path: &Path) -> Result<()> {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String(ARCH.into()));
        w.set("frugal-heads.count", Value::U32(self.heads.len() as u32));
        w.set(
            "frugal-heads.embedding_length",
            Value::U32(self.n_embd as u32),
        );
        w.set("frugal-heads.vocab_size", Value::U32(self.n_vocab as u32));
        if let Some(v) = &self.vocab {
            w.set("frugal-heads.vocab", Value::Array(Array::U32(v.clone())));
        }
        w.set("frugal-heads.token_input", Value::Bool(self.token_input));
        let bytes = |v: &[f32]| Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect());
        let d = self.n_embd as u64;
        let input = self.input_len() as u64;
        for (j, (wm, b)) in self.heads.iter().enumerate() {
            w.tensors.push(TensorData {
                name: format!("heads.{j}.weight"),
                dims: vec![input, d],
                ty: GgmlType::F32,
                data: bytes(wm),
            });
            w.tensors.push(TensorData {
                name: format!("heads.{j}.bias"),
                dims: vec![d],
                ty: GgmlType::F32,
                data: bytes(b),
            });
        }
        w.write_file(path)?;
        Ok(())
    }

    pub fn read(path: &Path) -> Result<Self> {
        let f = super::open_kind(path, ARCH, "a draft-heads file", "train-heads")?;
        let bad = |m: String| Error::Invalid(format!("{}: {m}", path.display()));
        let n = f.u32("frugal-heads.count")? as usize;
        let d = f.u32("frugal-heads.embedding_length")? as usize;
        let n_vocab = f.u32("frugal-heads.vocab_size")? as usize;
        if n == 0 || n > 64 {
            return Err(bad(format!("{n} heads (expected 1 to 64)")));
        }
        let vocab = match f.get("frugal-heads.vocab") {
            None => None,
            Some(v) => {
                let ids: Option<Vec<u32>> = v
                    .as_array()
                    .ok_or_else(|| bad("frugal-heads.vocab is not an array".into()))?
                    .values()
                    .map(|x| x.as_int().and_then(|i| u32::try_from(i).ok()))
                    .collect();
                let ids = ids.ok_or_else(|| bad("frugal-heads.vocab holds a non-id".into()))?;
                if ids.is_empty() || ids.iter().any(|&t| t as usize >= n_vocab) {
                    return Err(bad(
                        "frugal-heads.vocab holds ids outside the vocabulary".into()
                    ));
                }
                Some(ids)
            }
        };
        let token_input = match f.get("frugal-heads.token_input") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(bad("frugal-heads.token_input is not a bool".into())),
        };
        let input = if token_input { 2 * d } else { d };
        let mut heads = Vec::with_capacity(n);
        for j in 0..n {
            let tensor = |name: String, len: usize| -> Result<Vec<f32>> {
                let (info, data) = f.tensor(&name)?;
                if info.n_elements() != len as u64 {
                    return Err(bad(format!(
                        "{name} has {} values, expected {len}",
                        info.n_elements()
                    )));
                }
                dequantize_to_vec(info.ty, data, len).map_err(|e| bad(format!("{name}: {e}")))
            };
            heads.push((
                tensor(format!("heads.{j}.weight"), d * input)?,
                tensor(format!("heads.{j}.bias"), d)?,
            ));
        }
        Ok(HeadWeights {
            n_embd: d,
            n_vocab,
            heads,
            vocab,
            token_input,
        })
    }
}

/// The token input of a head: the RMS-normalized (unweighted) input embedding of `token`, so it
/// enters at the scale of the normalized hidden state whatever the model's embedding scale.
/// Training and drafting both call this, so they see the same values.
pub fn token_features(model: &Model, token: u32, out: &mut [f32]) {
    let m = model.weights.token_embd.view();
    m.dequantize_row(token as usize, out);
    let ss: f64 = out.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let scale = (1.0 / (ss / out.len() as f64 + 1e-6).sqrt()) as f32;
    out.iter_mut().for_each(|v| *v *= scale);
}

/// The rows of a model's output matrix for a subset of the vocabulary (FR-Spec): logits for
/// those tokens only, at a fraction of the full head's cost, scattered into a full-vocabulary
/// vector (`-inf` elsewhere) so the sampler sees an ordinary distribution.
///
/// Where the rows' format has packed integer kernels (Q8_0, the usual output format) they run
/// on 8-bit activations, as the model's layers do: a draft only has to be a good guess (the
/// verification decides). On SmolLM2's 8,192-token subset that took a drafted token from about
/// 0.75 to 0.73 ms (two same-run pairs): the head's f32 `W` (2.6 MB) is the larger read.
pub struct SubsetHead {
    rows: Vec<u8>,
    ty: GgmlType,
    packed: Option<PackedMatrix>,
    acts: Q8Acts,
    ids: Vec<u32>,
    n_embd: usize,
    sub: Vec<f32>,
    full: Vec<f32>,
}

impl SubsetHead {
    /// The head of `model` restricted to `ids` (each below its vocabulary size).
    pub fn new(model: &Model, ids: Vec<u32>) -> Result<Self> {
        let c = &model.config;
        if ids.is_empty() || ids.iter().any(|&t| t as usize >= c.n_vocab) {
            return Err(Error::Invalid(format!(
                "a draft vocabulary must name 1 to {} token ids of the model",
                c.n_vocab
            )));
        }
        let out = model.weights.output.view();
        let mut rows = Vec::with_capacity(ids.len() * out.row_bytes());
        for &t in &ids {
            rows.extend_from_slice(out.row(t as usize));
        }
        // A format without packed kernels (F16, F32, ...) keeps the f32 path.
        let packed = match c.n_embd.is_multiple_of(QK) {
            true => WeightMatrix::new(out.ty, ids.len(), c.n_embd, &rows)
                .ok()
                .and_then(|m| PackedMatrix::pack(&m).ok()),
            false => None,
        };
        Ok(SubsetHead {
            rows,
            ty: out.ty,
            packed,
            acts: Q8Acts::default(),
            ids,
            n_embd: c.n_embd,
            sub: Vec::new(),
            full: vec![f32::NEG_INFINITY; c.n_vocab],
        })
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Full-vocabulary logits of the normalized input `u` (`n_embd`): the subset's, `-inf`
    /// for every other token.
    pub fn logits(&mut self, u: &[f32]) -> Result<&[f32]> {
        for &t in &self.ids {
            self.full[t as usize] = f32::NEG_INFINITY;
        }
        self.sub.resize(self.ids.len(), 0.0);
        if let Some(p) = &self.packed {
            self.acts.quantize(u, self.n_embd);
            matmul_packed(p, &self.acts, &mut self.sub);
        } else {
            let m = WeightMatrix::new(self.ty, self.ids.len(), self.n_embd, &self.rows)
                .map_err(|e| Error::Invalid(format!("draft head: {e}")))?;
            matvec(&m, u, &mut self.sub);
        }
        for (&t, &l) in self.ids.iter().zip(&self.sub) {
            self.full[t as usize] = l;
        }
        Ok(&self.full)
    }
}

/// Draft heads ready to run against a target.
pub struct DraftHeads {
    w: HeadWeights,
    head: SubsetHead,
    /// Each head's `W` as F32 bytes, for the same threaded kernels as the model's products.
    w_bytes: Vec<Vec<u8>>,
    /// A head's input: `z`, then (token-conditioned heads) the previous token's features.
    x: Vec<f32>,
    a: Vec<f32>,
    /// The context followed by the tokens drafted so far.
    seq: Vec<u32>,
}

impl DraftHeads {
    /// Heads for `target`, which must be the model they were trained on (same width and
    /// vocabulary).
    pub fn new(w: HeadWeights, target: &Model) -> Result<Self> {
        let c = &target.config;
        if w.n_embd != c.n_embd || w.n_vocab != c.n_vocab {
            return Err(Error::Invalid(format!(
                "the draft heads were trained for width {} and {} tokens; this model has width {} and {} tokens",
                w.n_embd, w.n_vocab, c.n_embd, c.n_vocab
            )));
        }
        let ids: Vec<u32> = match &w.vocab {
            Some(v) => v.clone(),
            None => (0..c.n_vocab as u32).collect(),
        };
        let w_bytes = w
            .heads
            .iter()
            .map(|(m, _)| m.iter().flat_map(|x| x.to_le_bytes()).collect())
            .collect();
        Ok(DraftHeads {
            head: SubsetHead::new(target, ids)?,
            w_bytes,
            x: Vec::new(),
            a: Vec::new(),
            seq: Vec::new(),
            w,
        })
    }

    pub fn len(&self) -> usize {
        self.w.heads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.w.heads.is_empty()
    }

    /// Tokens the heads score (the subset size).
    pub fn vocab_len(&self) -> usize {
        self.head.len()
    }

    /// Multiply-adds per head: the residual block and the subset of the output matrix.
    pub fn macs_per_head(&self) -> f64 {
        let d = self.w.n_embd;
        (d * self.w.input_len() + self.head.len() * d) as f64
    }

    /// Drafts up to `k` tokens (one per head) after the token the target chose from `hidden`
    /// (its last hidden state at that position, before the final norm). `context` ends with
    /// that token. Sampled drafts keep their distribution in `q`.
    #[allow(clippy::too_many_arguments)]
    pub fn propose(
        &mut self,
        target: &Model,
        hidden: &[f32],
        context: &[u32],
        gen_start: usize,
        k: usize,
        sampler: &mut Sampler,
        out: &mut Vec<u32>,
        q: &mut Vec<Vec<(u32, f32)>>,
    ) -> Result<()> {
        out.clear();
        let d = self.w.n_embd;
        let input = self.w.input_len();
        let c = &target.config;
        self.x.resize(input, 0.0);
        rms_norm(
            hidden,
            &target.weights.output_norm,
            c.rms_eps,
            &mut self.x[..d],
        );
        let seq = &mut self.seq;
        seq.clear();
        seq.extend_from_slice(context);
        for (j, ((_, b), wb)) in self.w.heads.iter().zip(&self.w_bytes).take(k).enumerate() {
            if self.w.token_input {
                let prev = *seq
                    .last()
                    .expect("the context ends with the target's token");
                token_features(target, prev, &mut self.x[d..]);
            }
            // u = z + SiLU(W x + b)
            let wm = WeightMatrix::new(GgmlType::F32, d, input, wb)
                .map_err(|e| Error::Invalid(format!("draft heads: {e}")))?;
            self.a.resize(d, 0.0);
            matvec(&wm, &self.x, &mut self.a);
            for ((a, z), bi) in self.a.iter_mut().zip(&self.x[..d]).zip(b) {
                let x = *a + bi;
                *a = z + x / (1.0 + (-x).exp());
            }
            let logits = self.head.logits(&self.a)?;
            let t = super::draft_token(sampler, logits, seq, gen_start, j, q);
            out.push(t);
            seq.push(t);
        }
        Ok(())
    }
}
