//! Views of a model's tensors inside the memory-mapped GGUF file, checked once at load.
//!
//! Matrices are kept as byte ranges of the map (in their stored, usually quantized, format) so
//! resident memory is the file itself; only the small norm vectors are decoded to f32.

use super::Config;
use super::moe::MoeConfig;
pub use super::moe::{Experts, Mlp};
use crate::gguf::{GgufError, GgufFile, TensorInfo};
use crate::quant::{self, Matrix};

/// How a block turns its input into what the cache stores.
#[derive(Clone, Debug)]
pub enum KvProjection {
    /// Keys and values per KV head (MHA, GQA, MQA).
    Heads { wk: Matrix, wv: Matrix },
    /// Multi-head latent attention (`Config::mla`): `kv_a` projects to the latent and the
    /// shared RoPE key, `kv_a_norm` normalizes the latent, and the per-head up-projections are
    /// kept in f32 (they are small) in the form the absorbed computation uses: `k_b[h]`
    /// (`kv_lora_rank x nope_dim`, row-major) takes a query's position-free part into the
    /// latent space, `v_b[h]` (`v_dim x kv_lora_rank`) takes the attended latent to the head's
    /// value. The layout of llama.cpp's `attn_k_b` / `attn_v_b`.
    Latent {
        kv_a: Matrix,
        kv_a_norm: Vec<f32>,
        k_b: Vec<f32>,
        v_b: Vec<f32>,
    },
}

/// One transformer block's weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub kv: KvProjection,
    pub wo: Matrix,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    /// The norms some families add (`Features::qk_norm`, `Features::post_norms`).
    pub extra_norms: ExtraNorms,
    /// Biases of the attention projections, where the file has them (Qwen 2's Q, K and V).
    pub biases: AttnBiases,
}

/// Optional biases added to the outputs of the attention projections (llama.cpp reads each as
/// a tensor that need not be there, for every family it runs here).
#[derive(Clone, Debug, Default)]
pub struct AttnBiases {
    pub q: Option<Vec<f32>>,
    pub k: Option<Vec<f32>>,
    pub v: Option<Vec<f32>>,
    pub o: Option<Vec<f32>>,
}

/// Gemma's extra RMSNorm weights: per query/key head (`head_dim`), and after attention and the
/// FFN (`n_embd`). `None` where the family has none.
#[derive(Clone, Debug, Default)]
pub struct ExtraNorms {
    pub q: Option<Vec<f32>>,
    pub k: Option<Vec<f32>>,
    pub post_attn: Option<Vec<f32>>,
    pub post_ffn: Option<Vec<f32>>,
}

/// A block's feed-forward part: one SwiGLU block, or routed experts (`Config::moe`).
#[derive(Clone, Debug)]
pub enum Ffn {
    Dense(Mlp),
    Experts(Experts),
}

impl Ffn {
    /// Every matrix of the block (the router first).
    fn matrices(&self) -> Vec<&Matrix> {
        match self {
            Ffn::Dense(m) => vec![&m.gate, &m.up, &m.down],
            Ffn::Experts(x) => std::iter::once(&x.router)
                .chain(
                    x.experts
                        .iter()
                        .chain(&x.shared)
                        .flat_map(|m| [&m.gate, &m.up, &m.down]),
                )
                .collect(),
        }
    }

    /// The matrices the products run through, mutably (the router is not among them: it stays
    /// in its stored form, computed on f32 activations).
    fn products_mut(&mut self) -> Vec<&mut Matrix> {
        match self {
            Ffn::Dense(m) => vec![&mut m.gate, &mut m.up, &mut m.down],
            Ffn::Experts(x) => x
                .experts
                .iter_mut()
                .chain(&mut x.shared)
                .flat_map(|m| [&mut m.gate, &mut m.up, &mut m.down])
                .collect(),
        }
    }

    /// The dense block, if this is one.
    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            Ffn::Dense(m) => Some(m),
            Ffn::Experts(_) => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Weights {
    pub token_embd: Matrix,
    pub layers: Vec<LayerWeights>,
    pub output_norm: Vec<f32>,
    /// The output projection; the token embedding when the file has no `output.weight` (tied).
    pub output: Matrix,
    pub tied_output: bool,
}

impl Weights {
    /// Every matrix the forward pass multiplies by (not the embedding table, which is only
    /// indexed, unless it is also the output).
    pub fn matrices(&self) -> impl Iterator<Item = &Matrix> {
        self.layers
            .iter()
            .flat_map(|l| {
                let (a, b) = match &l.kv {
                    KvProjection::Heads { wk, wv } => (wk, Some(wv)),
                    KvProjection::Latent { kv_a, .. } => (kv_a, None),
                };
                [&l.wq, a, &l.wo]
                    .into_iter()
                    .chain(b)
                    .chain(l.ffn.matrices())
            })
            .chain(std::iter::once(&self.output))
    }

    /// The matrices of the transformer layers, mutably, and the output head apart (it can
    /// take another precision).
    pub fn layer_matrices_and_head_mut(
        &mut self,
    ) -> (impl Iterator<Item = &mut Matrix>, &mut Matrix) {
        (Self::layer_matrices(&mut self.layers), &mut self.output)
    }

    /// Every layer's matrices in the order a decode step reads them (queries, keys, values,
    /// output, then the feed-forward's), so that, packed one after another
    /// ([`crate::quant::packed::PackedMatrix::pack_shared`]), a thread's reads run on from one
    /// product into the next instead of jumping.
    fn layer_matrices(layers: &mut [LayerWeights]) -> impl Iterator<Item = &mut Matrix> {
        layers.iter_mut().flat_map(|l| {
            let (a, b) = match &mut l.kv {
                KvProjection::Heads { wk, wv } => (wk, Some(wv)),
                KvProjection::Latent { kv_a, .. } => (kv_a, None),
            };
            [&mut l.wq, a]
                .into_iter()
                .chain(b)
                .chain([&mut l.wo])
                .chain(l.ffn.products_mut())
        })
    }

    /// Views of every tensor `c` needs in `file`; fails on a tensor the file has that the
    /// pass would not read (an optional bias of another family, Phi-2's output bias, ...):
    /// running without it would silently compute another model.
    pub fn load(file: &GgufFile, c: &Config) -> Result<Self, GgufError> {
        let reader = Reader::new(file);
        let w = Self::read(&reader, c)?;
        // The RoPE factors were read (and checked) with the configuration.
        if c.rope_scaling.freq_factors.is_some() || c.long_rope.is_some() {
            for t in super::config::ROPE_FACTOR_TENSORS {
                reader.mark(t);
            }
        }
        reader.check_all_read(&c.arch)?;
        Ok(w)
    }

    fn read(file: &Reader, c: &Config) -> Result<Self, GgufError> {
        // Not pre-sized from metadata: a corrupted layer count must fail on a missing tensor, not
        // allocate.
        let mut layers = Vec::new();
        for i in 0..c.n_layers {
            let name = |s: &str| format!("blk.{i}.{s}.weight");
            // Q, K and V as row ranges of one fused matrix (Phi-3's `attn_qkv`), or their own.
            let fused = file.tensor_info(&name("attn_qkv")).is_some() && c.mla.is_none();
            let mut qkv = if fused {
                let widths = [c.q_dim(), c.kv_dim(), c.kv_dim()];
                split_rows(file, &name("attn_qkv"), &widths, c.n_embd)?
            } else {
                Vec::new()
            }
            .into_iter();
            let fused_q = qkv.next();
            let kv = match c.mla {
                None if fused => KvProjection::Heads {
                    wk: qkv.next().expect("three parts"),
                    wv: qkv.next().expect("three parts"),
                },
                None => KvProjection::Heads {
                    wk: head_linear(file, c, &name("attn_k"), true, false)?,
                    wv: head_linear(file, c, &name("attn_v"), true, false)?,
                },
                Some(m) => KvProjection::Latent {
                    kv_a: linear(file, &name("attn_kv_a_mqa"), m.row_dim(), c.n_embd)?,
                    kv_a_norm: vector(file, &name("attn_kv_a_norm"), m.kv_lora_rank)?,
                    k_b: tensor_f32(
                        file,
                        &name("attn_k_b"),
                        &[m.nope_dim, m.kv_lora_rank, c.n_head],
                    )?,
                    v_b: tensor_f32(
                        file,
                        &name("attn_v_b"),
                        &[m.kv_lora_rank, m.v_dim, c.n_head],
                    )?,
                },
            };
            layers.push(LayerWeights {
                attn_norm: vector(file, &name("attn_norm"), c.n_embd)?,
                wq: match fused_q {
                    Some(q) => q,
                    None => head_linear(file, c, &name("attn_q"), false, false)?,
                },
                kv,
                wo: match c.mla {
                    None => head_linear(file, c, &name("attn_output"), false, true)?,
                    Some(_) => linear(file, &name("attn_output"), c.n_embd, c.attn_dim())?,
                },
                ffn_norm: vector(file, &name("ffn_norm"), c.n_embd)?,
                ffn: match c.moe {
                    // Phi-3 stores gate and up as one matrix, gate's rows first.
                    None if c.arch == "phi3" => {
                        let widths = [c.n_ff, c.n_ff];
                        let mut gu = split_rows(file, &name("ffn_up"), &widths, c.n_embd)?;
                        let up = gu.pop().expect("two parts");
                        Ffn::Dense(Mlp {
                            gate: gu.pop().expect("two parts"),
                            up,
                            down: linear(file, &name("ffn_down"), c.n_embd, c.n_ff)?,
                        })
                    }
                    None => Ffn::Dense(Mlp {
                        gate: linear(file, &name("ffn_gate"), c.n_ff, c.n_embd)?,
                        up: linear(file, &name("ffn_up"), c.n_ff, c.n_embd)?,
                        down: linear(file, &name("ffn_down"), c.n_embd, c.n_ff)?,
                    }),
                    Some(m) => Ffn::Experts(experts(file, c, &m, i)?),
                },
                biases: {
                    let opt = |s: &str, n: usize| {
                        let t = format!("blk.{i}.{s}.bias");
                        file.tensor_info(&t)
                            .map(|_| vector(file, &t, n))
                            .transpose()
                    };
                    let heads = c.mla.is_none();
                    let fused_bias = format!("blk.{i}.attn_qkv.bias");
                    if fused && file.tensor_info(&fused_bias).is_some() {
                        let all = vector(file, &fused_bias, c.q_dim() + 2 * c.kv_dim())?;
                        let (q, kv) = all.split_at(c.q_dim());
                        let (k, v) = kv.split_at(c.kv_dim());
                        AttnBiases {
                            q: Some(q.to_vec()),
                            k: Some(k.to_vec()),
                            v: Some(v.to_vec()),
                            o: opt("attn_output", c.n_embd)?,
                        }
                    } else {
                        AttnBiases {
                            q: opt("attn_q", c.q_dim())?,
                            k: if heads {
                                opt("attn_k", c.kv_dim())?
                            } else {
                                None
                            },
                            v: if heads {
                                opt("attn_v", c.kv_dim())?
                            } else {
                                None
                            },
                            o: opt("attn_output", c.n_embd)?,
                        }
                    }
                },
                extra_norms: {
                    let f = c.features;
                    let opt = |on: bool, s: &str, n: usize| {
                        on.then(|| vector(file, &name(s), n)).transpose()
                    };
                    ExtraNorms {
                        q: opt(f.qk_norm, "attn_q_norm", c.head_dim)?,
                        k: opt(f.qk_norm, "attn_k_norm", c.head_dim)?,
                        post_attn: opt(f.post_norms, "post_attention_norm", c.n_embd)?,
                        post_ffn: opt(f.post_norms, "post_ffw_norm", c.n_embd)?,
                    }
                },
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

/// The file as the loader sees it: every tensor it reads is recorded, so the tensors it does
/// not read can be named.
struct Reader<'a> {
    file: &'a GgufFile,
    read: std::cell::RefCell<std::collections::HashSet<String>>,
}

impl<'a> Reader<'a> {
    fn new(file: &'a GgufFile) -> Self {
        Reader {
            file,
            read: Default::default(),
        }
    }

    fn mark(&self, name: &str) {
        self.read.borrow_mut().insert(name.to_string());
    }

    fn tensor(&self, name: &str) -> Result<(&'a TensorInfo, &'a [u8]), GgufError> {
        self.mark(name);
        self.file.tensor(name)
    }

    fn check_all_read(&self, arch: &str) -> Result<(), GgufError> {
        let read = self.read.borrow();
        match self.file.tensors().iter().find(|t| !read.contains(&t.name)) {
            None => Ok(()),
            Some(t) => Err(GgufError::BadTensor {
                tensor: t.name.clone(),
                offset: t.info_offset,
                reason: format!(
                    "frugal's {arch} block has no place for this tensor (running without it \
                     would compute another model)"
                ),
            }),
        }
    }
}

impl std::ops::Deref for Reader<'_> {
    type Target = GgufFile;
    fn deref(&self) -> &GgufFile {
        self.file
    }
}

fn shape_error(name: &str, offset: u64, want: &[u64], got: &[u64]) -> GgufError {
    GgufError::BadTensor {
        tensor: name.into(),
        offset,
        reason: format!("shape {got:?}, expected {want:?}"),
    }
}

/// A projection to (`transposed`: from) the query heads, or with `kv` the KV heads, of
/// `c.head_dim` values each: `linear`, with a shape error that names the metadata the expected
/// shape came from, since a head count or `attention.key_length` that disagrees with the
/// tensors is a likelier mistake than a damaged tensor.
fn head_linear(
    file: &Reader,
    c: &Config,
    name: &str,
    kv: bool,
    transposed: bool,
) -> Result<Matrix, GgufError> {
    let (heads, count) = if kv {
        (c.n_head_kv, "attention.head_count_kv")
    } else {
        (c.n_head, "attention.head_count")
    };
    let width = heads * c.head_dim;
    let (rows, cols) = if transposed {
        (c.n_embd, width)
    } else {
        (width, c.n_embd)
    };
    linear(file, name, rows, cols).map_err(|e| match e {
        GgufError::BadTensor {
            tensor,
            offset,
            reason,
        } if reason.starts_with("shape") => {
            let arch = &c.arch;
            // Where the head width came from (under MLA a query head is `key_length_mla` wide).
            let dim = if c.mla.is_some() {
                format!("{arch}.attention.key_length_mla")
            } else if file.get(&format!("{arch}.attention.key_length")).is_some() {
                format!("{arch}.attention.key_length")
            } else {
                format!("{arch}.embedding_length / {arch}.attention.head_count")
            };
            GgufError::BadTensor {
                tensor,
                offset,
                reason: format!(
                    "{reason}, from {arch}.{count} = {heads}, {dim} = {} and \
                     {arch}.embedding_length = {}",
                    c.head_dim, c.n_embd
                ),
            }
        }
        e => e,
    })
}

fn linear(file: &Reader, name: &str, rows: usize, cols: usize) -> Result<Matrix, GgufError> {
    let (info, _) = file.tensor(name)?;
    let want = [cols as u64, rows as u64];
    if info.dims != want {
        return Err(shape_error(name, info.info_offset, &want, &info.dims));
    }
    linear_of(file, name, info, rows, cols)
}

/// A matrix of `rows x cols` over tensor `info`'s bytes, whose shape the caller checked.
fn linear_of(
    file: &Reader,
    name: &str,
    info: &TensorInfo,
    rows: usize,
    cols: usize,
) -> Result<Matrix, GgufError> {
    let bytes = file.tensor(name)?.1;
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
    Ok(Matrix::mapped(
        name.into(),
        info.ty,
        rows,
        cols,
        file.shared_bytes(),
        start..start + info.n_bytes() as usize,
    ))
}

/// The matrix `name` of `widths.iter().sum()` rows of `cols`, as one matrix per width: its
/// first `widths[0]` rows, the next `widths[1]`, ... (a fused projection's parts; rows are
/// stored one after another, so each part is a byte range of its own). The widths must add up
/// to the matrix's rows.
fn split_rows(
    file: &Reader,
    name: &str,
    widths: &[usize],
    cols: usize,
) -> Result<Vec<Matrix>, GgufError> {
    let (info, _) = file.tensor(name)?;
    let rows = info.dims.get(1).copied().unwrap_or(0) as usize;
    if widths.iter().sum::<usize>() != rows || info.dims.len() != 2 {
        return Err(shape_error(
            name,
            info.info_offset,
            &[cols as u64, widths.iter().sum::<usize>() as u64],
            &info.dims,
        ));
    }
    let whole = linear(file, name, rows, cols)?;
    let mut first = 0;
    Ok(widths
        .iter()
        .map(|&w| {
            first += w;
            whole.row_range(name.into(), first - w, w)
        })
        .collect())
}

/// Layer `layer`'s router, experts (views into the 3-D `ffn_*_exps` tensors) and optional
/// shared expert and selection bias.
fn experts(file: &Reader, c: &Config, m: &MoeConfig, layer: usize) -> Result<Experts, GgufError> {
    let name = |s: &str| format!("blk.{layer}.{s}.weight");
    let router = linear(file, &name("ffn_gate_inp"), m.n_expert, c.n_embd)?;
    // A NaN router weight would route every token to expert 0 with NaN weights: refuse it.
    let values = tensor_f32(file, &name("ffn_gate_inp"), &[c.n_embd, m.n_expert])?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(GgufError::BadTensor {
            tensor: name("ffn_gate_inp"),
            offset: file
                .tensor_info(&name("ffn_gate_inp"))
                .map_or(0, |t| t.info_offset),
            reason: format!("router weight {i} is {}", values[i]),
        });
    }
    let gate = stacked(file, &name("ffn_gate_exps"), c.n_ff, c.n_embd, m.n_expert)?;
    let up = stacked(file, &name("ffn_up_exps"), c.n_ff, c.n_embd, m.n_expert)?;
    let down = stacked(file, &name("ffn_down_exps"), c.n_embd, c.n_ff, m.n_expert)?;
    let experts = gate
        .into_iter()
        .zip(up)
        .zip(down)
        .map(|((gate, up), down)| Mlp { gate, up, down })
        .collect();
    let shared = if m.n_ff_shared > 0 {
        let f = m.n_ff_shared;
        Some(Mlp {
            gate: linear(file, &name("ffn_gate_shexp"), f, c.n_embd)?,
            up: linear(file, &name("ffn_up_shexp"), f, c.n_embd)?,
            down: linear(file, &name("ffn_down_shexp"), c.n_embd, f)?,
        })
    } else {
        None
    };
    let bias_name = format!("blk.{layer}.exp_probs_b.bias");
    let selection_bias = match file.tensor_info(&bias_name) {
        Some(_) => Some(tensor_f32(file, &bias_name, &[m.n_expert])?),
        None => None,
    };
    Ok(Experts {
        router,
        experts,
        shared,
        selection_bias,
    })
}

/// The `n` matrices (`rows x cols` each) of a 3-D expert tensor, one after another as llama.cpp
/// stores them, as views of their byte ranges.
fn stacked(
    file: &Reader,
    name: &str,
    rows: usize,
    cols: usize,
    n: usize,
) -> Result<Vec<Matrix>, GgufError> {
    let (info, _) = file.tensor(name)?;
    let want = [cols as u64, rows as u64, n as u64];
    if info.dims != want {
        return Err(shape_error(name, info.info_offset, &want, &info.dims));
    }
    let whole = linear_of(file, name, info, rows * n, cols)?;
    Ok((0..n)
        .map(|e| whole.row_range(format!("{name}#{e}"), e * rows, rows))
        .collect())
}

fn vector(file: &Reader, name: &str, n: usize) -> Result<Vec<f32>, GgufError> {
    tensor_f32(file, name, &[n])
}

/// A tensor of shape `dims` (GGUF order, fastest first) decoded to f32.
fn tensor_f32(file: &Reader, name: &str, dims: &[usize]) -> Result<Vec<f32>, GgufError> {
    let (info, bytes) = file.tensor(name)?;
    let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    if info.dims != want {
        return Err(shape_error(name, info.info_offset, &want, &info.dims));
    }
    // The shape matched the file's own tensor info, whose byte size the reader checked.
    let mut out = vec![0f32; dims.iter().product()];
    quant::dequantize(info.ty, bytes, &mut out).map_err(|_| GgufError::UnsupportedType {
        tensor: name.into(),
        ty: info.ty,
        action: "decode",
    })?;
    Ok(out)
}
