//! One named f32 tensor and how it is laid out in GGUF.

use std::borrow::Cow;

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
