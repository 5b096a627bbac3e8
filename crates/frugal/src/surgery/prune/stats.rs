//! What pruning measures on calibration text: for every layer, the inputs of its four groups of
//! matrices (Q/K/V, the attention output projection, gate/up, down), as per-column sums of
//! squares (Wanda's `||x_j||²`, and the structured importances) or, for SparseGPT, whole Gram
//! matrices `XᵀX`; and the residual stream before and after each block (block influence).

use crate::kv::KvOptions;
use crate::model::{Logits, Model, Observer, Scratch, Site};

use super::super::SurgeryError;

/// The four inputs a block's matrices read.
pub const INPUT_SITES: [Site; 4] = [
    Site::AttnInput,
    Site::AttnOutput,
    Site::FfnInput,
    Site::FfnDownInput,
];

/// Index of `site` in [`INPUT_SITES`] (`None` for the residual stream).
pub fn site_index(site: Site) -> Option<usize> {
    INPUT_SITES.iter().position(|&s| s == site)
}

/// Which matrices read which input: `(GGUF name suffix, input site)`.
pub const MATRICES: [(&str, Site); 7] = [
    ("attn_q", Site::AttnInput),
    ("attn_k", Site::AttnInput),
    ("attn_v", Site::AttnInput),
    ("attn_output", Site::AttnOutput),
    ("ffn_gate", Site::FfnInput),
    ("ffn_up", Site::FfnInput),
    ("ffn_down", Site::FfnDownInput),
];

/// Activation statistics of one input: `n` rows of `width` values.
#[derive(Clone, Debug, Default)]
pub struct InputStats {
    pub width: usize,
    pub rows: usize,
    /// `Σ_rows x_j²` per column (f64: thousands of rows of squares).
    pub sq: Vec<f64>,
    /// `XᵀX`, row-major `width x width`, when Gram matrices were asked for.
    pub gram: Option<Vec<f64>>,
}

impl InputStats {
    fn add(&mut self, x: &[f32], width: usize, gram: bool) {
        if self.width == 0 {
            self.width = width;
            self.sq = vec![0.0; width];
            if gram {
                self.gram = Some(vec![0.0; width * width]);
            }
        }
        for row in x.chunks_exact(width) {
            for (s, &v) in self.sq.iter_mut().zip(row) {
                *s += f64::from(v) * f64::from(v);
            }
            if let Some(g) = &mut self.gram {
                for (i, &a) in row.iter().enumerate() {
                    if a == 0.0 {
                        continue;
                    }
                    let a = f64::from(a);
                    for (gv, &b) in g[i * width..(i + 1) * width].iter_mut().zip(row) {
                        *gv += a * f64::from(b);
                    }
                }
            }
            self.rows += 1;
        }
    }

    /// `||x_j||₂` per column.
    pub fn norms(&self) -> Vec<f64> {
        self.sq.iter().map(|s| s.sqrt()).collect()
    }
}

/// Every layer's statistics, and the block influence `1 - cos(input, output)` of each layer
/// (mean over tokens; ShortGPT's importance).
#[derive(Clone, Debug)]
pub struct PruneStats {
    /// `inputs[layer][site_index]`.
    pub inputs: Vec<[InputStats; 4]>,
    pub block_influence: Vec<f64>,
    pub tokens: usize,
}

struct Collector {
    inputs: Vec<[InputStats; 4]>,
    gram: bool,
    /// The current window's residual stream entering each layer (the previous layer's output).
    prev: Vec<f32>,
    influence: Vec<f64>,
}

impl Observer for Collector {
    fn observe(&mut self, layer: usize, site: Site, x: &[f32], width: usize) {
        if let Some(i) = site_index(site) {
            self.inputs[layer][i].add(x, width, self.gram);
        } else if site == Site::LayerOutput {
            // `prev` is the layer's input: the previous output, or the window's embeddings.
            if self.prev.len() == x.len() {
                for (a, b) in self.prev.chunks_exact(width).zip(x.chunks_exact(width)) {
                    self.influence[layer] += 1.0 - cosine(a, b);
                }
            }
            self.prev.clear();
            self.prev.extend_from_slice(x);
        }
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    ab / (aa * bb).sqrt().max(1e-30)
}

/// Runs `tokens` through `model` in windows of `ctx` and collects [`PruneStats`] (with Gram
/// matrices when `gram`: SparseGPT needs them, at `8 x width²` bytes per input).
pub fn collect(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    gram: bool,
) -> Result<PruneStats, SurgeryError> {
    let c = &model.config;
    if ctx == 0 || tokens.len() < ctx {
        return Err(SurgeryError::Invalid(format!(
            "the calibration text has {} tokens, shorter than one window of {ctx}: give a longer \
             text (or a shorter window)",
            tokens.len()
        )));
    }
    let mut col = Collector {
        inputs: (0..c.n_layers).map(|_| Default::default()).collect(),
        gram,
        prev: Vec::new(),
        influence: vec![0.0; c.n_layers],
    };
    let mut kv = model
        .new_seq_cache(ctx, &KvOptions::default())
        .map_err(|e| SurgeryError::Invalid(e.to_string()))?;
    let mut s = Scratch::default();
    let (info, bytes) = model.file.tensor("token_embd.weight")?;
    let embd = crate::quant::dequantize_to_vec(info.ty, bytes, info.n_elements() as usize)
        .map_err(|e| SurgeryError::Quant("token_embd.weight".into(), e))?;
    let d = c.n_embd;
    let mut used = 0;
    for w in tokens.chunks_exact(ctx) {
        kv.clear();
        // Layer 0's input is the embedding of the window's tokens.
        col.prev.clear();
        for &t in w {
            col.prev
                .extend_from_slice(&embd[t as usize * d..(t as usize + 1) * d]);
        }
        model
            .forward_observed(w, &mut kv, &mut s, Logits::Last, Some(&mut col))
            .map_err(|e| SurgeryError::Invalid(e.to_string()))?;
        used += w.len();
    }
    let block_influence = col.influence.iter().map(|v| v / used as f64).collect();
    Ok(PruneStats {
        inputs: col.inputs,
        block_influence,
        tokens: used,
    })
}
