//! Trainable parameters: every tensor of a model of any family the inference engine runs, as
//! f32, named as in GGUF (the file's fused matrices are split; see [`gguf`]).
//!
//! The same structure holds the parameters, their gradients and AdamW's two moments, so the
//! optimizer walks four `Params` in step ([`Params::tensors`] lists them in one fixed order).

use frugal::model::Config;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::moe::{DenseFfn, RoutedFfn};

mod gguf;
mod tensor;

pub use tensor::{Stored, Tensor};

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
    pub biases: AttnBiases,
    pub norms: ExtraNorms,
}

/// Biases added to the attention projections' outputs (`attn_q.bias`, `attn_k.bias`,
/// `attn_v.bias`, `attn_output.bias`), where the model has them: optional per tensor, as the
/// inference engine reads them (Qwen 2's Q, K and V; keys and values have none under MLA).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttnBiases {
    pub q: Option<Tensor>,
    pub k: Option<Tensor>,
    pub v: Option<Tensor>,
    pub o: Option<Tensor>,
}

/// The norms some families add to the block (`Features::qk_norm`, `Features::post_norms`):
/// RMSNorm over each query and key head before RoPE (`attn_q_norm`, `attn_k_norm`, `head_dim`
/// weights), and over the attention and FFN outputs before their residual adds
/// (`post_attention_norm`, `post_ffw_norm`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExtraNorms {
    pub q: Option<Tensor>,
    pub k: Option<Tensor>,
    pub post_attn: Option<Tensor>,
    pub post_ffn: Option<Tensor>,
}

/// Whether a new model of `c`'s family has Q, K and V biases: llama.cpp's `qwen2` requires
/// them; every other family's are optional, and a loaded model has those of its file.
fn family_has_qkv_biases(c: &Config) -> bool {
    c.arch == "qwen2"
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
        let bias = |s: &str, len: usize| Tensor::vector(format!("blk.{l}.{s}.bias"), len);
        let qkv_biases = family_has_qkv_biases(c);
        let heads = c.mla.is_none();
        let f = c.features;
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
            biases: AttnBiases {
                q: qkv_biases.then(|| bias("attn_q", q)),
                k: (qkv_biases && heads).then(|| bias("attn_k", c.kv_dim())),
                v: (qkv_biases && heads).then(|| bias("attn_v", c.kv_dim())),
                o: None,
            },
            norms: ExtraNorms {
                q: f.qk_norm
                    .then(|| Tensor::vector(n("attn_q_norm"), c.head_dim)),
                k: f.qk_norm
                    .then(|| Tensor::vector(n("attn_k_norm"), c.head_dim)),
                post_attn: f
                    .post_norms
                    .then(|| Tensor::vector(n("post_attention_norm"), d)),
                post_ffn: f.post_norms.then(|| Tensor::vector(n("post_ffw_norm"), d)),
            },
        }
    }

    /// The block's tensors in one fixed order (the file's: norm, query, keys and values, their
    /// norms, output, then the FFN), each bias after its matrix.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let (b, nm) = (&self.biases, &self.norms);
        let mut v = vec![&self.attn_norm, &self.wq];
        v.extend(&b.q);
        match &self.kv {
            KvParams::Heads { wk, wv } => {
                v.push(wk);
                v.extend(&b.k);
                v.push(wv);
                v.extend(&b.v);
            }
            KvParams::Latent {
                kv_a,
                kv_a_norm,
                k_b,
                v_b,
            } => v.extend([kv_a, kv_a_norm, k_b, v_b]),
        }
        v.extend(nm.q.iter().chain(&nm.k));
        v.push(&self.wo);
        v.extend(b.o.iter().chain(&nm.post_attn));
        v.push(&self.ffn_norm);
        v.extend(self.ffn.tensors());
        v.extend(&nm.post_ffn);
        v
    }

    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let (b, nm) = (&mut self.biases, &mut self.norms);
        let mut v = vec![&mut self.attn_norm, &mut self.wq];
        v.extend(&mut b.q);
        match &mut self.kv {
            KvParams::Heads { wk, wv } => {
                v.push(wk);
                v.extend(&mut b.k);
                v.push(wv);
                v.extend(&mut b.v);
            }
            KvParams::Latent {
                kv_a,
                kv_a_norm,
                k_b,
                v_b,
            } => v.extend([kv_a, kv_a_norm, k_b, v_b]),
        }
        v.extend(nm.q.iter_mut().chain(&mut nm.k));
        v.push(&mut self.wo);
        v.extend(b.o.iter_mut().chain(&mut nm.post_attn));
        v.push(&mut self.ffn_norm);
        v.extend(self.ffn.tensors_mut());
        v.extend(&mut nm.post_ffn);
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

    /// Zeros of the same tensors (gradients, optimizer moments), the optional ones (biases,
    /// a selection bias) included exactly where these have them.
    pub fn zeros_like(&self) -> Self {
        let mut z = self.clone();
        for t in z.tensors_mut() {
            t.data.fill(0.0);
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

    /// Random initialization as GPT-2 / Llama pre-training does it: matrices ~ N(0, 0.02²), the
    /// projections into the residual stream (attention output, FFN down) scaled by
    /// 1/sqrt(2·layers), norms at one, biases at zero. Seeded, so a run is reproducible.
    pub fn random(c: &Config, tied: bool, seed: u64) -> Self {
        let mut p = Params::zeros(c, tied);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let resid = 0.02 / (2.0 * c.n_layers as f32).sqrt();
        for t in p.tensors_mut() {
            if t.vector {
                // Norms start at one, biases at zero.
                let bias = t.name.ends_with(".bias");
                t.data.fill(if bias { 0.0 } else { 1.0 });
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
    use frugal::gguf::GgufFile;
    use frugal::model::Model;
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

    #[test]
    fn biases_are_renumbered_and_start_at_zero() {
        let c = crate::gradcheck::tiny_qwen2_config();
        let p = Params::random(&c, true, 1);
        let mut l = p.layers[1].clone();
        l.renumber(0);
        let q = l.biases.q.as_ref().unwrap();
        assert_eq!(q.name, "blk.0.attn_q.bias");
        assert!(q.data.iter().all(|&v| v == 0.0));
        assert!(l.attn_norm.data.iter().all(|&v| v == 1.0));
    }
}
