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

/// One named f32 tensor: a matrix (`rows x cols`, row-major: row `r` is output `r`) or a vector.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    /// A 1-D tensor (a norm's weights), written to GGUF with one dimension.
    pub vector: bool,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn matrix(name: impl Into<String>, rows: usize, cols: usize) -> Self {
        Tensor {
            name: name.into(),
            rows,
            cols,
            vector: false,
            data: vec![0.0; rows * cols],
        }
    }

    pub fn vector(name: impl Into<String>, n: usize) -> Self {
        Tensor {
            name: name.into(),
            rows: 1,
            cols: n,
            vector: true,
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
        if self.vector {
            vec![self.cols as u64]
        } else {
            vec![self.cols as u64, self.rows as u64]
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

/// One transformer block.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerParams {
    pub attn_norm: Tensor,
    pub wq: Tensor,
    pub wk: Tensor,
    pub wv: Tensor,
    pub wo: Tensor,
    pub ffn_norm: Tensor,
    pub w_gate: Tensor,
    pub w_up: Tensor,
    pub w_down: Tensor,
}

impl LayerParams {
    /// A zero block of `c`'s shapes, its tensors named for block `l`.
    pub fn zeros(c: &Config, l: usize) -> Self {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        let (d, q, kv, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
        LayerParams {
            attn_norm: Tensor::vector(n("attn_norm"), d),
            wq: Tensor::matrix(n("attn_q"), q, d),
            wk: Tensor::matrix(n("attn_k"), kv, d),
            wv: Tensor::matrix(n("attn_v"), kv, d),
            wo: Tensor::matrix(n("attn_output"), d, q),
            ffn_norm: Tensor::vector(n("ffn_norm"), d),
            w_gate: Tensor::matrix(n("ffn_gate"), ff, d),
            w_up: Tensor::matrix(n("ffn_up"), ff, d),
            w_down: Tensor::matrix(n("ffn_down"), d, ff),
        }
    }

    pub fn tensors(&self) -> [&Tensor; 9] {
        [
            &self.attn_norm,
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.ffn_norm,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
    }

    pub fn tensors_mut(&mut self) -> [&mut Tensor; 9] {
        [
            &mut self.attn_norm,
            &mut self.wq,
            &mut self.wk,
            &mut self.wv,
            &mut self.wo,
            &mut self.ffn_norm,
            &mut self.w_gate,
            &mut self.w_up,
            &mut self.w_down,
        ]
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

    /// Zeros of the same shapes (gradients, optimizer moments).
    pub fn zeros_like(&self) -> Self {
        Self::zeros(&self.config, self.output.is_none())
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
        if c.mla.is_some() {
            return Err(TrainError::Invalid(
                "the training engine does not train latent attention (deepseek2) yet".into(),
            ));
        }
        let mut p = Params::zeros(c, model.weights.tied_output);
        let file = &model.file;
        for t in p.tensors_mut() {
            let (info, bytes) = file.tensor(&t.name)?;
            if info.n_elements() as usize != t.data.len() {
                return Err(TrainError::Shape(format!(
                    "{} has {} elements in the file, {} expected for {}",
                    t.name,
                    info.n_elements(),
                    t.data.len(),
                    t.shape_str()
                )));
            }
            quant::dequantize(info.ty, bytes, &mut t.data).map_err(|e| {
                TrainError::Invalid(format!("{}: cannot decode {}: {e}", t.name, info.ty))
            })?;
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
            let std =
                if t.name.ends_with("attn_output.weight") || t.name.ends_with("ffn_down.weight") {
                    resid
                } else {
                    0.02
                };
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
        w.set(&key("attention.key_length"), u(c.head_dim));
        w.set(&key("attention.value_length"), u(c.head_dim));
        w.set(&key("rope.dimension_count"), u(c.rope_dim));
        w.set("general.file_type", Value::U32(0));
        w.metadata
            .retain(|(k, _)| k != "general.quantization_version");
        for t in self.tensors() {
            w.tensors.push(TensorData {
                name: t.name.clone(),
                dims: t.dims(),
                ty: GgmlType::F32,
                data: Cow::Borrowed(f32_bytes(&t.data)),
            });
        }
        w
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
        let file = GgufFile::from_bytes(build(&SyntheticSpec::default())).unwrap();
        let model = Model::from_file(file).unwrap();
        let p = Params::from_model(&model).unwrap();
        let bytes = p.to_gguf(&model.file).to_bytes().unwrap();
        let back = Model::from_file(GgufFile::from_bytes(bytes).unwrap()).unwrap();
        assert_eq!(Params::from_model(&back).unwrap(), p);
        assert_eq!(back.config, model.config);
    }

    #[test]
    fn renumbering_keeps_suffixes() {
        let c = frugal::model::Config {
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
        };
        let mut l = LayerParams::zeros(&c, 7);
        l.renumber(2);
        assert_eq!(l.w_down.name, "blk.2.ffn_down.weight");
        assert_eq!(l.attn_norm.name, "blk.2.attn_norm.weight");
    }
}
