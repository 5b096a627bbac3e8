//! How a family's block differs from Llama's, as switches the one forward pass reads.
//!
//! Llama (and Mistral, and DeepSeek's latent-attention block) use the defaults. Qwen 2 and 2.5
//! (`qwen2`) rotate split halves (NeoX) and add biases to Q, K and V (the biases are optional
//! tensors for every family, so they are not a switch). Qwen 3 (`qwen3`) rotates split halves
//! and RMS-normalizes each query and key head before RoPE. Gemma 3 (`gemma3`) turns on the rest:
//! norms after attention and after the FFN (before each residual add), GELU gating, the
//! embedding scaled by √d, sliding-window attention in five of every six layers (with their own
//! RoPE base), and for the 27B its own query scale. A `llama` file that declares
//! `attention.sliding_window` (Mistral 7B v0.1) gets that window in every layer. Everything
//! else — GQA, the quantized products, the caches, the kernels — is shared.

use crate::gguf::{GgufError, GgufFile};

pub use crate::ops::RopeStyle;

/// The gate's nonlinearity in `down(act(gate x) * up x)`.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnAct {
    /// SwiGLU: `silu(g) = g / (1 + e^-g)`.
    #[default]
    Silu,
    /// GeGLU with GELU's tanh approximation (Gemma).
    GeluTanh,
}

/// Sliding-window attention in a periodic pattern of layers: layer `l` is local when
/// `l % period < period - 1`, so the last layer of each period is global (Gemma 3: five local
/// layers of window 512, then one global).
#[derive(Copy, Clone, Debug, PartialEq, serde::Serialize)]
pub struct Sliding {
    /// Keys a query of a local layer sees, itself included.
    pub window: usize,
    pub period: usize,
    /// RoPE base of the local layers, which then rotate without the global layers' scaling;
    /// `None`: the local layers rotate as the global ones.
    pub local_rope_base: Option<f32>,
}

/// The switches, all off for Llama.
#[derive(Copy, Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Features {
    pub rope: RopeStyle,
    /// RMSNorm over each query and key head after the projections, before RoPE.
    pub qk_norm: bool,
    /// RMSNorm of the attention output and of the FFN output before their residual adds.
    pub post_norms: bool,
    pub ffn_act: FfnAct,
    /// Factor on the token embeddings entering the first layer.
    pub embd_scale: Option<f32>,
    pub sliding: Option<Sliding>,
    /// The factor on attention scores in place of `1/sqrt(head_dim)` (Gemma 3 27B's
    /// `1/sqrt(n_embd/n_head)`, Hugging Face's `query_pre_attn_scalar`).
    pub query_scale: Option<f32>,
}

/// Gemma 3's local RoPE base (llama.cpp's `rope_freq_base_train_swa` for the family; the files
/// carry only the global one).
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;
/// Gemma 3's layer pattern when the file does not give one.
const GEMMA3_PERIOD: usize = 6;
/// Gemma 3 27B's layer count, by which llama.cpp recognizes it.
const GEMMA3_27B_LAYERS: usize = 62;

/// The sizes some switches depend on.
#[derive(Copy, Clone, Debug)]
pub struct BlockShape {
    pub n_layers: usize,
    pub n_embd: usize,
    pub n_head: usize,
}

impl Features {
    /// The switches for `arch`, reading what the file gives (`shape` for the embedding and
    /// query scales and a `llama` file's window).
    ///
    /// For `gemma3`, `attention.sliding_window` is required (llama.cpp requires it too) and must
    /// be positive, and `attention.sliding_window_pattern`, when present, must be positive (in
    /// llama.cpp's `set_swa_pattern` a period of 0 means "every layer local", which no Gemma
    /// writes; refused here rather than guessed). Deliberately accepted, as the arithmetic stays
    /// well defined and llama.cpp's window mask and layer rule give the same result:
    /// - a window at least the training context (or any context used): every local layer then
    ///   sees every earlier key, i.e. attends as a global one;
    /// - a period of 1: every layer global;
    /// - a period above the layer count: no layer global, every one local (a sliding window
    ///   throughout, as in Mistral 7B).
    pub fn from_gguf(f: &GgufFile, arch: &str, shape: BlockShape) -> Result<Self, GgufError> {
        let key = |k: &str| format!("{arch}.{k}");
        let bad = |k: &str, reason: String| GgufError::BadValue {
            key: key(k),
            reason,
        };
        match arch {
            "qwen2" => {
                return Ok(Features {
                    rope: RopeStyle::Neox,
                    ..Default::default()
                });
            }
            // Phi-3's `attention.sliding_window` is not read (llama.cpp reads none for it).
            "phi3" => {
                return Ok(Features {
                    rope: RopeStyle::Neox,
                    ..Default::default()
                });
            }
            "qwen3" => {
                return Ok(Features {
                    rope: RopeStyle::Neox,
                    qk_norm: true,
                    ..Default::default()
                });
            }
            "gemma3" => {}
            _ => {
                // llama.cpp ignores a window in a `llama` file (it reads none for the family);
                // Hugging Face's Mistral applies it in every layer, as the model was trained.
                let window = f.u32_opt(&key("attention.sliding_window"))?;
                return Ok(match window {
                    None | Some(0) => Features::default(),
                    Some(w) => Features {
                        sliding: Some(Sliding {
                            window: w as usize,
                            period: shape.n_layers + 1,
                            local_rope_base: None,
                        }),
                        ..Default::default()
                    },
                });
            }
        }
        let window = f.u32(&key("attention.sliding_window"))? as usize;
        if window == 0 {
            return Err(bad("attention.sliding_window", "must be positive".into()));
        }
        let period = f
            .u32_opt(&key("attention.sliding_window_pattern"))?
            .map_or(GEMMA3_PERIOD, |v| v as usize);
        if period == 0 {
            return Err(bad(
                "attention.sliding_window_pattern",
                "must be positive".into(),
            ));
        }
        // llama.cpp keys the 27B's query scale on its layer count (the scale is not in the
        // file): `1/sqrt(n_embd/n_head)` = 1/sqrt(168) there, against 1/sqrt(128) per head.
        let query_scale = (shape.n_layers == GEMMA3_27B_LAYERS)
            .then(|| 1.0 / ((shape.n_embd / shape.n_head) as f32).sqrt());
        Ok(Features {
            rope: RopeStyle::Neox,
            qk_norm: true,
            post_norms: true,
            ffn_act: FfnAct::GeluTanh,
            embd_scale: Some((shape.n_embd as f32).sqrt()),
            sliding: Some(Sliding {
                window,
                period,
                local_rope_base: Some(GEMMA3_LOCAL_ROPE_BASE),
            }),
            query_scale,
        })
    }

    /// Whether these are Llama's block (every switch off).
    pub fn is_llama(&self) -> bool {
        *self == Features::default()
    }

    /// Layer `l`'s window, `None` for full attention.
    pub fn window(&self, l: usize) -> Option<usize> {
        self.sliding
            .filter(|s| l % s.period < s.period - 1)
            .map(|s| s.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma_pattern_makes_every_sixth_layer_global() {
        let f = Features {
            sliding: Some(Sliding {
                window: 512,
                period: 6,
                local_rope_base: Some(10_000.0),
            }),
            ..Default::default()
        };
        let global: Vec<usize> = (0..18).filter(|&l| f.window(l).is_none()).collect();
        assert_eq!(global, [5, 11, 17]);
        assert_eq!(f.window(0), Some(512));
        assert!(Features::default().window(3).is_none());
        assert!(Features::default().is_llama() && !f.is_llama());
    }
}
