//! Trainable parameters: every tensor of a Llama-family model as f32, named as in GGUF.
//!
//! The same structure holds the parameters, their gradients and AdamW's two moments, so the
//! optimizer walks four `Params` in step ([`Params::tensors`] lists them in one fixed order).

use std::borrow::Cow;

use frugal::gguf::{GgufFile, GgufWriter, TensorData, Value};
use frugal::model::{Config, Model};
use frugal::quant::{self, GgmlType};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Result, TrainError};
use crate::moe::{DenseFfn, RoutedFfn, SELECTION_BIAS};

/// One named f32 tensor: a matrix (`rows x cols`, row-major: row `r` is output `r`) or a vector.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// A 1-D tensor (a norm's weights), written to GGUF with one dimension.
    pub vector: bool,
    /// Its layout in GGUF, when that differs from the training layout.
    pub stored: Stored,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn matrix(name: impl Into<String>, rows: usize, cols: usize) -> Self {
        Tensor {
            name: name.into(),
            rows,
            cols,
            vector: false,
            stored: Stored::Plain,
            data: vec![0.0; rows * cols],
        }
    }

    pub fn vector(name: impl Into<String>, n: usize) -> Self {
        Tensor {
            name: name.into(),
            rows: 1,
            cols: n,
            vector: true,
            stored: Stored::Plain,
            data: vec![0.0; n],
        }
    }

    /// A zero tensor of the same name and shape (a gradient, an optimizer moment).
    pub fn zeros_like(&self) -> Self {
        Tensor {
            data: vec![0.0; self.data.len()],
            ..self.clone()
        }
    }

    /// GGUF dimensions: innermost first.
    pub fn dims(&self) -> Vec<u64> {
        let (r, c) = (self.rows as u64, self.cols as u64);
        match self.stored {
            _ if self.vector => vec![c],
            Stored::Plain | Stored::ScaledRows { .. } => vec![c, r],
            Stored::Heads { heads } => vec![c, r / heads as u64, heads as u64],
            Stored::HeadsTransposed { heads } => vec![r / heads as u64, c, heads as u64],
        }
    }

    /// The values in the file's order (a copy only where the layouts differ).
    pub fn stored_data(&self) -> Cow<'_, [f32]> {
        match self.stored {
            Stored::ScaledRows { rows, scale } => {
                let mut out = self.data.clone();
                out[..rows * self.cols].iter_mut().for_each(|v| *v *= scale);
                Cow::Owned(out)
            }
            Stored::HeadsTransposed { heads } => {
                let per = self.rows / heads;
                let mut out = vec![0f32; self.data.len()];
                for h in 0..heads {
                    let (src, dst) = (h * per * self.cols, h * per * self.cols);
                    for i in 0..per {
                        for c in 0..self.cols {
                            out[dst + c * per + i] = self.data[src + i * self.cols + c];
                        }
                    }
                }
                Cow::Owned(out)
            }
            _ => Cow::Borrowed(&self.data),
        }
    }

    /// Sets the values from the file's order (the inverse of [`stored_data`](Self::stored_data)).
    pub fn set_from_stored(&mut self, stored: &[f32]) {
        match self.stored {
            Stored::HeadsTransposed { heads } => {
                let per = self.rows / heads;
                for h in 0..heads {
                    let base = h * per * self.cols;
                    for i in 0..per {
                        for c in 0..self.cols {
                            self.data[base + i * self.cols + c] = stored[base + c * per + i];
                        }
                    }
                }
            }
            Stored::ScaledRows { rows, scale } => {
                self.data.copy_from_slice(stored);
                self.data[..rows * self.cols]
                    .iter_mut()
                    .for_each(|v| *v /= scale);
            }
            _ => self.data.copy_from_slice(stored),
        }
    }

    /// The multiplier the forward applies to rows `0..n` (1 unless [`Stored::ScaledRows`]).
    pub fn row_scale(&self) -> f32 {
        match self.stored {
            Stored::ScaledRows { scale, .. } => scale,
            _ => 1.0,
        }
    }

    pub fn shape_str(&self) -> String {
        if self.vector {
            format!("[{}]", self.cols)
        } else {
            format!("[{} x {}]", self.rows, self.cols)
        }
    }
}

/// How a block's tensor is laid out in GGUF when that is not the training layout.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stored {
    /// As trained: `[cols, rows]` (or `[cols]` for a vector).
    Plain,
    /// `rows = heads x per_head` stacked per head, stored 3-D as `[cols, per_head, heads]`
    /// (llama.cpp's `attn_v_b`: the same bytes, one more dimension).
    Heads { heads: usize },
    /// Each head's `per_head x cols` block stored transposed, 3-D as `[per_head, cols, heads]`
    /// (llama.cpp's `attn_k_b`, which the absorbed path multiplies the other way round).
    HeadsTransposed { heads: usize },
    /// The first `rows` rows are trained divided by `scale` (a power of two, so the division is
    /// exact) and the forward multiplies them back. An optimizer's step and the gradient clip
    /// act on values of the tensor's own scale: a converted MLA file's latent rows are 1e-5 of
    /// the rest (see `frugal::surgery::mla`), and without this AdamW's steps of `lr` would be a
    /// thousand times those weights, and their huge gradients would dominate the clipped norm.
    ScaledRows { rows: usize, scale: f32 },
}

/// How a block makes its keys and values: per KV head, or through multi-head latent attention.
#[derive(Clone, Debug, PartialEq)]
pub enum KvParams {
    /// `attn_k`, `attn_v`: keys and values per KV head (MHA, GQA, MQA).
    Heads { wk: Tensor, wv: Tensor },
    /// deepseek2's MLA: `attn_kv_a_mqa` projects to the latent and the shared RoPE key,
    /// `attn_kv_a_norm` RMS-normalizes the latent, and `attn_k_b` / `attn_v_b` take it up to each
    /// head's position-free key and value. Kept here as ordinary `out x in` matrices
    /// (`n_head*nope_dim x rank`, `n_head*v_dim x rank`), so the up-projections are plain
    /// linear layers of the latent.
    Latent {
        kv_a: Tensor,
        kv_a_norm: Tensor,
        k_b: Tensor,
        v_b: Tensor,
    },
}

/// One transformer block.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerParams {
    pub attn_norm: Tensor,
    pub wq: Tensor,
    pub kv: KvParams,
    pub wo: Tensor,
    pub ffn_norm: Tensor,
    pub ffn: FfnParams,
}

/// A block's feed-forward: one SwiGLU, or routed experts.
// One per layer, holding tensors on the heap: the variants' inline sizes (a few hundred bytes)
// do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum FfnParams {
    Dense(DenseFfn),
    Routed(RoutedFfn),
}

impl FfnParams {
    fn tensors(&self) -> Vec<&Tensor> {
        match self {
            FfnParams::Dense(f) => f.tensors().to_vec(),
            FfnParams::Routed(r) => r.tensors(),
        }
    }

    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        match self {
            FfnParams::Dense(f) => f.tensors_mut().into_iter().collect(),
            FfnParams::Routed(r) => r.tensors_mut(),
        }
    }

    /// The dense block (`None` for a routed one).
    pub fn dense(&self) -> Option<&DenseFfn> {
        match self {
            FfnParams::Dense(f) => Some(f),
            FfnParams::Routed(_) => None,
        }
    }

    pub fn dense_mut(&mut self) -> Option<&mut DenseFfn> {
        match self {
            FfnParams::Dense(f) => Some(f),
            FfnParams::Routed(_) => None,
        }
    }
}

impl LayerParams {
    /// A zero block of `c`'s shapes, its tensors named for block `l`.
    pub fn zeros(c: &Config, l: usize) -> Self {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let (d, q, ff) = (c.n_embd, c.q_dim(), c.n_ff);
        let kv = match c.mla {
            None => KvParams::Heads {
                wk: Tensor::matrix(n("attn_k"), c.kv_dim(), d),
                wv: Tensor::matrix(n("attn_v"), c.kv_dim(), d),
            },
            Some(m) => {
                let h = c.n_head;
                let mut k_b = Tensor::matrix(n("attn_k_b"), h * m.nope_dim, m.kv_lora_rank);
                k_b.stored = Stored::HeadsTransposed { heads: h };
                let mut v_b = Tensor::matrix(n("attn_v_b"), h * m.v_dim, m.kv_lora_rank);
                v_b.stored = Stored::Heads { heads: h };
                KvParams::Latent {
                    kv_a: Tensor::matrix(n("attn_kv_a_mqa"), m.row_dim(), d),
                    kv_a_norm: Tensor::vector(n("attn_kv_a_norm"), m.kv_lora_rank),
                    k_b,
                    v_b,
                }
            }
        };
        LayerParams {
            attn_norm: Tensor::vector(n("attn_norm"), d),
            wq: Tensor::matrix(n("attn_q"), q, d),
            kv,
            wo: Tensor::matrix(n("attn_output"), d, c.attn_dim()),
            ffn_norm: Tensor::vector(n("ffn_norm"), d),
            ffn: match &c.moe {
                None => FfnParams::Dense(DenseFfn::zeros(l, "", d, ff)),
                Some(m) => FfnParams::Routed(RoutedFfn::zeros(m, l, d, ff)),
            },
        }
    }

    /// The block's tensors in one fixed order (the file's: norm, query, keys and values,
    /// output, then the FFN).
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.attn_norm, &self.wq];
        match &self.kv {
            KvParams::Heads { wk, wv } => v.extend([wk, wv]),
            KvParams::Latent {
                kv_a,
                kv_a_norm,
                k_b,
                v_b,
            } => v.extend([kv_a, kv_a_norm, k_b, v_b]),
        }
        v.extend([&self.wo, &self.ffn_norm]);
        v.extend(self.ffn.tensors());
        v
    }

    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.attn_norm, &mut self.wq];
        match &mut self.kv {
            KvParams::Heads { wk, wv } => v.extend([wk, wv]),
            KvParams::Latent {
                kv_a,
                kv_a_norm,
                k_b,
                v_b,
            } => v.extend([kv_a, kv_a_norm, k_b, v_b]),
        }
        v.extend([&mut self.wo, &mut self.ffn_norm]);
        v.extend(self.ffn.tensors_mut());
        v
    }

    /// Renames the block's tensors for position `l` (after layers are dropped or moved).
    pub fn renumber(&mut self, l: usize) {
        for t in self.tensors_mut() {
            let suffix = t.name.splitn(3, '.').nth(2).unwrap_or_default().to_string();
            t.name = format!("blk.{l}.{suffix}");
        }
    }
}

/// All parameters of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    pub config: Config,
    pub token_embd: Tensor,
    pub layers: Vec<LayerParams>,
    pub output_norm: Tensor,
    /// A separate output projection; `None` when it is tied to the token embedding.
    pub output: Option<Tensor>,
}

impl Params {
    /// Zero parameters of `c`'s shapes.
    pub fn zeros(c: &Config, tied: bool) -> Self {
        Params {
            config: c.clone(),
            token_embd: Tensor::matrix("token_embd.weight", c.n_vocab, c.n_embd),
            layers: (0..c.n_layers).map(|l| LayerParams::zeros(c, l)).collect(),
            output_norm: Tensor::vector("output_norm.weight", c.n_embd),
            output: (!tied).then(|| Tensor::matrix("output.weight", c.n_vocab, c.n_embd)),
        }
    }

    /// Zeros of the same tensors (gradients, optimizer moments).
    pub fn zeros_like(&self) -> Self {
        let mut z = Self::zeros(&self.config, self.output.is_none());
        for (l, zl) in self.layers.iter().zip(&mut z.layers) {
            if let (FfnParams::Routed(r), FfnParams::Routed(zr)) = (&l.ffn, &mut zl.ffn) {
                zr.selection_bias = r.selection_bias.as_ref().map(Tensor::zeros_like);
            }
        }
        z
    }

    /// Every tensor, in one fixed order: embedding, blocks, final norm, output.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.token_embd];
        for l in &self.layers {
            v.extend(l.tensors());
        }
        v.push(&self.output_norm);
        v.extend(self.output.as_ref());
        v
    }

    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.token_embd];
        for l in &mut self.layers {
            v.extend(l.tensors_mut());
        }
        v.push(&mut self.output_norm);
        v.extend(self.output.as_mut());
        v
    }

    pub fn n_params(&self) -> usize {
        self.tensors().iter().map(|t| t.data.len()).sum()
    }

    /// The matrix the head multiplies by: `output`, or the embedding when tied.
    pub fn head(&self) -> &Tensor {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Decodes every tensor of a loaded model to f32 (whatever its stored format).
    pub fn from_model(model: &Model) -> Result<Self> {
        let c = &model.config;
        if !c.features.is_llama() {
            return Err(TrainError::Invalid(format!(
                "the training engine has Llama's block only; {}'s (q/k norms, norms after \
                 attention and FFN, GELU gating, scaled embedding, sliding windows) has no \
                 backward pass yet, so it cannot be trained or distilled",
                c.arch
            )));
        }
        // What the forward applies beyond Llama's block without a switch: refused by name
        // rather than trained without it.
        if !c.rope_scaling.is_identity() || c.long_rope.is_some() {
            return Err(TrainError::Invalid(format!(
                "{} scales its RoPE angles (frequency factors or linear/YaRN scaling); the \
                 training engine's RoPE has no scaling yet",
                c.arch
            )));
        }
        if let Some(l) = model.weights.layers.iter().position(|l| {
            let b = &l.biases;
            b.q.is_some() || b.k.is_some() || b.v.is_some() || b.o.is_some()
        }) {
            return Err(TrainError::Invalid(format!(
                "layer {l} has attention biases; the training engine has no bias gradients yet"
            )));
        }
        if let Some(m) = c.mla
            && m.v_dim > m.nope_dim + m.rope_dim
        {
            return Err(TrainError::Invalid(format!(
                "latent attention with values wider than keys ({} > {}) is not trainable yet",
                m.v_dim,
                m.nope_dim + m.rope_dim
            )));
        }
        let mut p = Params::zeros(c, model.weights.tied_output);
        let file = &model.file;
        for (l, lp) in p.layers.iter_mut().enumerate() {
            if let (FfnParams::Routed(r), Some(m)) = (&mut lp.ffn, &c.moe) {
                let name = format!("blk.{l}.{SELECTION_BIAS}");
                if file.tensor_info(&name).is_some() {
                    r.selection_bias = Some(Tensor::vector(name, m.n_expert));
                }
            }
        }
        for t in p.tensors_mut() {
            let (info, bytes) = file.tensor(&t.name)?;
            if info.dims != t.dims() {
                return Err(TrainError::Shape(format!(
                    "{} has shape {:?} in the file, {:?} expected",
                    t.name,
                    info.dims,
                    t.dims()
                )));
            }
            let mut stored = vec![0f32; t.data.len()];
            quant::dequantize(info.ty, bytes, &mut stored).map_err(|e| {
                TrainError::Invalid(format!("{}: cannot decode {}: {e}", t.name, info.ty))
            })?;
            if let Some(m) = c.mla
                && t.name.ends_with("attn_kv_a_mqa.weight")
            {
                t.stored = latent_rows_scale(&stored, m.kv_lora_rank, t.cols);
            }
            t.set_from_stored(&stored);
        }
        Ok(p)
    }

    /// Random initialization as GPT-2 / Llama pre-training does it: matrices ~ N(0, 0.02²), the
    /// projections into the residual stream (attention output, FFN down) scaled by
    /// 1/sqrt(2·layers), norms at one. Seeded, so a run is reproducible.
    pub fn random(c: &Config, tied: bool, seed: u64) -> Self {
        let mut p = Params::zeros(c, tied);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let resid = 0.02 / (2.0 * c.n_layers as f32).sqrt();
        for t in p.tensors_mut() {
            if t.vector {
                t.data.fill(1.0);
                continue;
            }
            let into_residual = [
                "attn_output.weight",
                "ffn_down.weight",
                "ffn_down_exps.weight",
            ]
            .iter()
            .any(|s| t.name.ends_with(s));
            let std = if into_residual { resid } else { 0.02 };
            for v in &mut t.data {
                *v = normal(&mut rng) * std;
            }
        }
        p
    }

    /// A GGUF writer holding these parameters as F32, with `template`'s metadata (tokenizer,
    /// chat template, architecture) and the architecture keys rewritten for this shape.
    pub fn to_gguf<'a>(&'a self, template: &GgufFile) -> GgufWriter<'a> {
        let mut w = GgufWriter::new();
        w.metadata = template.metadata().to_vec();
        let c = &self.config;
        let key = |k: &str| format!("{}.{k}", c.arch);
        let u = |v: usize| Value::U32(v as u32);
        w.set(&key("block_count"), u(c.n_layers));
        w.set(&key("embedding_length"), u(c.n_embd));
        w.set(&key("feed_forward_length"), u(c.n_ff));
        w.set(&key("attention.head_count"), u(c.n_head));
        w.set(&key("attention.head_count_kv"), u(c.n_head_kv));
        match c.mla {
            None => {
                w.set(&key("attention.key_length"), u(c.head_dim));
                w.set(&key("attention.value_length"), u(c.head_dim));
            }
            // llama.cpp's absorbed layout: one KV "head" of the cached row.
            Some(m) => {
                w.set(&key("attention.key_length"), u(m.row_dim()));
                w.set(&key("attention.value_length"), u(m.kv_lora_rank));
                w.set(&key("attention.key_length_mla"), u(m.nope_dim + m.rope_dim));
                w.set(&key("attention.value_length_mla"), u(m.v_dim));
                w.set(&key("attention.kv_lora_rank"), u(m.kv_lora_rank));
            }
        }
        w.set(&key("rope.dimension_count"), u(c.rope_dim));
        w.set("general.file_type", Value::U32(0));
        w.metadata
            .retain(|(k, _)| k != "general.quantization_version");
        for t in self.tensors() {
            w.tensors.push(TensorData {
                name: t.name.clone(),
                dims: t.dims(),
                ty: GgmlType::F32,
                data: match t.stored_data() {
                    Cow::Borrowed(v) => Cow::Borrowed(f32_bytes(v)),
                    Cow::Owned(v) => Cow::Owned(f32_bytes(&v).to_vec()),
                },
            });
        }
        w
    }
}

/// How an MLA down-projection's latent rows (the first `rank` rows of `kv_a`, `cols` wide) are
/// trained: divided by the power of two nearest the ratio of their RMS to that of the RoPE-key
/// rows below them, so that both parts have one scale.
fn latent_rows_scale(kv_a: &[f32], rank: usize, cols: usize) -> Stored {
    let rms = |v: &[f32]| {
        (v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / v.len().max(1) as f64).sqrt()
    };
    let (latent, pe) = kv_a.split_at(rank * cols);
    let ratio = rms(latent) / rms(pe);
    if !ratio.is_finite() || ratio == 0.0 {
        return Stored::Plain;
    }
    let scale = 2f64.powi(ratio.log2().round() as i32) as f32;
    if scale == 1.0 || !scale.is_normal() {
        Stored::Plain
    } else {
        Stored::ScaledRows { rows: rank, scale }
    }
}

/// The bytes of an f32 slice (little-endian machines; GGUF is little-endian).
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no invalid bit patterns and u8 has alignment 1; the length is exact.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// A standard normal sample (Box-Muller).
pub fn normal(rng: &mut impl Rng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(1e-300);
    let u2: f64 = rng.random();
    ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use frugal::model::synthetic::{SyntheticSpec, build};

    #[test]
    fn round_trips_through_gguf() {
        let latent = SyntheticSpec {
            mla: Some(frugal::model::Mla {
                kv_lora_rank: 24,
                nope_dim: 8,
                rope_dim: 8,
                v_dim: 12,
            }),
            ..Default::default()
        };
        for spec in [SyntheticSpec::default(), latent] {
            let file = GgufFile::from_bytes(build(&spec)).unwrap();
            let model = Model::from_file(file).unwrap();
            let p = Params::from_model(&model).unwrap();
            let bytes = p.to_gguf(&model.file).to_bytes().unwrap();
            let back = Model::from_file(GgufFile::from_bytes(bytes).unwrap()).unwrap();
            assert_eq!(Params::from_model(&back).unwrap(), p);
            assert_eq!(back.config, model.config);
            // The per-head up-projections went back in the file's own layout, byte for byte.
            for name in ["blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight"] {
                if let Some(info) = model.file.tensor_info(name) {
                    let (a, b) = (
                        model.file.tensor(name).unwrap(),
                        back.file.tensor(name).unwrap(),
                    );
                    assert_eq!(b.0.dims, info.dims, "{name}");
                    assert_eq!(a.1, b.1, "{name}");
                }
            }
        }
    }

    #[test]
    fn renumbering_keeps_suffixes() {
        let c = frugal::model::Config {
            rope_scaling: Default::default(),
            long_rope: None,
            moe: None,
            arch: "llama".into(),
            n_layers: 1,
            n_embd: 8,
            n_ff: 8,
            n_head: 2,
            n_head_kv: 1,
            head_dim: 4,
            n_vocab: 10,
            n_ctx_train: 16,
            rms_eps: 1e-5,
            rope_base: 1e4,
            rope_dim: 4,
            mla: None,
            features: Default::default(),
        };
        let mut l = LayerParams::zeros(&c, 7);
        l.renumber(2);
        assert_eq!(l.ffn.dense().unwrap().down.name, "blk.2.ffn_down.weight");
        assert_eq!(l.attn_norm.name, "blk.2.attn_norm.weight");
    }
}
