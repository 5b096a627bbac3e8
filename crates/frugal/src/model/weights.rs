//! Views of a model's tensors inside the memory-mapped GGUF file, checked once at load.
//!
//! Matrices are kept as byte ranges of the map (in their stored, usually quantized, format) so
//! resident memory is the file itself; only the small norm vectors are decoded to f32.

use std::ops::Range;
use std::sync::Arc;

use super::Config;
use crate::gguf::{GgufError, GgufFile};
use crate::quant::packed::PackedMatrix;
use crate::quant::{self, GgmlType, WeightMatrix};

/// A weight matrix: its stored type, shape, and where its bytes are in the file.
#[derive(Clone, Debug)]
pub struct Linear {
    pub name: String,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    range: Range<usize>,
    /// The grouped layout for 8-bit-activation kernels, built on demand (shared by the tied
    /// embedding and output).
    pub packed: Option<Arc<PackedMatrix>>,
}

impl Linear {
    /// The byte range of the matrix in the file.
    pub fn file_range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Borrows the matrix from the file it was loaded from.
    pub fn view<'a>(&self, file: &'a GgufFile) -> WeightMatrix<'a> {
        WeightMatrix {
            ty: self.ty,
            rows: self.rows,
            cols: self.cols,
            data: &file.raw_bytes()[self.range.clone()],
        }
    }
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Linear,
    pub w_up: Linear,
    pub w_down: Linear,
}

#[derive(Clone, Debug)]
pub struct Weights {
    pub token_embd: Linear,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The output projection; the token embedding when the file has no `output.weight` (tied).
    pub output: Linear,
    pub tied_output: bool,
}

impl Weights {
    /// Every matrix the forward pass multiplies by (not the embedding table, which is only
    /// indexed, unless it is also the output).
    pub fn matrices(&self) -> impl Iterator<Item = &Linear> {
        self.layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain(std::iter::once(&self.output))
    }

    /// The matrices of the transformer layers, mutably, and the output head apart (it can
    /// take another precision).
    pub fn layer_matrices_and_head_mut(
        &mut self,
    ) -> (impl Iterator<Item = &mut Linear>, &mut Linear) {
        (Self::layer_matrices(&mut self.layers), &mut self.output)
    }

    fn layer_matrices(layers: &mut [LayerWeights]) -> impl Iterator<Item = &mut Linear> {
        layers.iter_mut().flat_map(|l| {
            [
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ]
        })
    }

    pub fn load(file: &GgufFile, c: &Config) -> Result<Self, GgufError> {
        // Not pre-sized from metadata: a corrupted layer count must fail on a missing tensor, not
        // allocate.
        let mut layers = Vec::new();
        for i in 0..c.n_layers {
            let name = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(LayerWeights {
                attn_norm: vector(file, &name("attn_norm"), c.n_embd)?,
                wq: linear(file, &name("attn_q"), c.q_dim(), c.n_embd)?,
                wk: linear(file, &name("attn_k"), c.kv_dim(), c.n_embd)?,
                wv: linear(file, &name("attn_v"), c.kv_dim(), c.n_embd)?,
                wo: linear(file, &name("attn_output"), c.n_embd, c.q_dim())?,
                ffn_norm: vector(file, &name("ffn_norm"), c.n_embd)?,
                w_gate: linear(file, &name("ffn_gate"), c.n_ff, c.n_embd)?,
                w_up: linear(file, &name("ffn_up"), c.n_ff, c.n_embd)?,
                w_down: linear(file, &name("ffn_down"), c.n_embd, c.n_ff)?,
            });
        }
        let token_embd = linear(file, "token_embd.weight", c.n_vocab, c.n_embd)?;
        let (output, tied_output) = if file.tensor_info("output.weight").is_some() {
            (linear(file, "output.weight", c.n_vocab, c.n_embd)?, false)
        } else {
            (token_embd.clone(), true)
        };
        Ok(Weights {
            token_embd,
            layers,
            output_norm: vector(file, "output_norm.weight", c.n_embd)?,
            output,
            tied_output,
        })
    }
}

fn shape_error(name: &str, offset: u64, want: &[u64], got: &[u64]) -> GgufError {
    GgufError::BadTensor {
        tensor: name.into(),
        offset,
        reason: format!("shape {got:?}, expected {want:?}"),
    }
}

fn linear(file: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Linear, GgufError> {
    let (info, bytes) = file.tensor(name)?;
    let want = [cols as u64, rows as u64];
    if info.dims != want {
        return Err(shape_error(name, info.info_offset, &want, &info.dims));
    }
    if !quant::is_supported(info.ty) {
        return Err(GgufError::UnsupportedType {
            tensor: name.into(),
            ty: info.ty,
            action: "compute with",
        });
    }
    // A NaN or infinite block scale would turn the model's output into NaN with no hint of why;
    // refuse it here, naming the tensor and the block.
    quant::check_blocks(info.ty, bytes).map_err(|e| GgufError::BadTensor {
        tensor: name.into(),
        offset: info.info_offset,
        reason: format!("corrupted data: {e}"),
    })?;
    let start = (file.data_offset + info.offset) as usize;
    Ok(Linear {
        name: name.into(),
        ty: info.ty,
        rows,
        cols,
        range: start..start + info.n_bytes() as usize,
        packed: None,
    })
}

fn vector(file: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, GgufError> {
    let (info, bytes) = file.tensor(name)?;
    if info.dims != [n as u64] {
        return Err(shape_error(name, info.info_offset, &[n as u64], &info.dims));
    }
    let mut out = vec![0f32; n];
    quant::dequantize(info.ty, bytes, &mut out).map_err(|_| GgufError::UnsupportedType {
        tensor: name.into(),
        ty: info.ty,
        action: "decode",
    })?;
    Ok(out)
}
