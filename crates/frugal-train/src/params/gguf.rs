//! Parameters from and to GGUF: every tensor decoded to f32 from any file the inference engine
//! runs, and written back as F32 in the layout the family's readers expect.
//!
//! Training keeps one matrix per product. Where a file fuses them (Phi-3's `attn_qkv`, Q's rows
//! then K's then V's, and its `ffn_up`, gate's rows then up's), they are read as row ranges of
//! the fused tensor and a `phi3` model is written fused again: llama.cpp's `phi3` requires the
//! fused `ffn_up`. The RoPE factors a family reads (Llama 3's `rope_freqs`, Phi-3's long and
//! short factors) are not trained; they are written from the configuration the model ran with.

use std::borrow::Cow;

use frugal::gguf::{GgufFile, GgufWriter, TensorData, Value};
use frugal::model::{Config, Model};
use frugal::quant::{self, GgmlType};

use super::f32_bytes;
use super::{AttnBiases, ExtraNorms, FfnParams, KvParams, LayerParams, Params, Stored, Tensor};
use crate::error::{Result, TrainError};
use crate::moe::SELECTION_BIAS;

/// Where a training tensor's values are in a file: from row (a vector's element) `start` of
/// the tensor `name`, which has `total` of them (more than the training tensor when fused).
struct Source {
    name: String,
    start: usize,
    total: usize,
}

/// Whether a model of `c`'s family is written with fused Q/K/V and gate/up matrices.
fn writes_fused(c: &Config) -> bool {
    c.arch == "phi3" && c.mla.is_none()
}

/// The fused tensor `name` (of layer `l`) is read from, if any: what the inference loader
/// splits (a file's `attn_qkv` in any family without latent attention, `phi3`'s `ffn_up`).
fn fused_source(c: &Config, file: &GgufFile, name: &str) -> Option<Source> {
    let (l, suffix) = name.strip_prefix("blk.")?.split_once('.')?;
    let (q, kv, ff) = (c.q_dim(), c.kv_dim(), c.n_ff);
    // A fused matrix's biases may be fused too, or be their own tensors.
    let has = |name: &str| file.tensor_info(name).is_some();
    let qkv = |kind: &str, start: usize| {
        let fused = format!("blk.{l}.attn_qkv.{kind}");
        let split = c.mla.is_none() && has(&format!("blk.{l}.attn_qkv.weight")) && has(&fused);
        split.then_some(Source {
            name: fused,
            start,
            total: q + 2 * kv,
        })
    };
    let gate_up = |start: usize| {
        (c.arch == "phi3" && c.moe.is_none()).then(|| Source {
            name: format!("blk.{l}.ffn_up.weight"),
            start,
            total: 2 * ff,
        })
    };
    match suffix {
        "attn_q.weight" => qkv("weight", 0),
        "attn_k.weight" => qkv("weight", q),
        "attn_v.weight" => qkv("weight", q + kv),
        "attn_q.bias" => qkv("bias", 0),
        "attn_k.bias" => qkv("bias", q),
        "attn_v.bias" => qkv("bias", q + kv),
        "ffn_gate.weight" => gate_up(0),
        "ffn_up.weight" => gate_up(ff),
        _ => None,
    }
}

/// Decodes `t`'s values from `file`: its own tensor, or its rows of a fused one.
fn read_tensor(c: &Config, file: &GgufFile, t: &mut Tensor) -> Result<()> {
    // Rows of a matrix, elements of a vector: what a fused tensor stacks.
    let own = if t.vector { t.cols } else { t.rows };
    let (src, want) = match fused_source(c, file, &t.name) {
        Some(s) => {
            let want = if t.vector {
                vec![s.total as u64]
            } else {
                vec![t.cols as u64, s.total as u64]
            };
            (s, want)
        }
        None => {
            let whole = Source {
                name: t.name.clone(),
                start: 0,
                total: own,
            };
            (whole, t.dims())
        }
    };
    let (info, bytes) = file.tensor(&src.name)?;
    if info.dims != want {
        return Err(TrainError::Shape(format!(
            "{} has shape {:?} in the file, {:?} expected",
            src.name, info.dims, want
        )));
    }
    // Each row of a stored matrix is whole quantization blocks, so a range of rows is a range
    // of bytes (and a vector's elements are F32 or F16, each on its own).
    let unit = bytes.len() / src.total;
    let part = &bytes[src.start * unit..(src.start + own) * unit];
    let mut stored = vec![0f32; t.data.len()];
    quant::dequantize(info.ty, part, &mut stored).map_err(|e| {
        TrainError::Invalid(format!("{}: cannot decode {}: {e}", src.name, info.ty))
    })?;
    if let Some(m) = c.mla
        && t.name.ends_with("attn_kv_a_mqa.weight")
    {
        t.stored = latent_rows_scale(&stored, m.kv_lora_rank, t.cols);
    }
    t.set_from_stored(&stored);
    Ok(())
}

impl Params {
    /// Decodes every tensor of a loaded model to f32 (whatever its stored format), with the
    /// optional tensors (biases, a selection bias) the model has.
    pub fn from_model(model: &Model) -> Result<Self> {
        let c = &model.config;
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
        for ((l, lp), w) in p.layers.iter_mut().enumerate().zip(&model.weights.layers) {
            if let (FfnParams::Routed(r), Some(m)) = (&mut lp.ffn, &c.moe) {
                let name = format!("blk.{l}.{SELECTION_BIAS}");
                if file.tensor_info(&name).is_some() {
                    r.selection_bias = Some(Tensor::vector(name, m.n_expert));
                }
            }
            // The optional tensors are those the inference engine loaded.
            let bias = |s: &str, v: &Option<Vec<f32>>| {
                v.as_ref()
                    .map(|v| Tensor::vector(format!("blk.{l}.{s}.bias"), v.len()))
            };
            let b = &w.biases;
            lp.biases = AttnBiases {
                q: bias("attn_q", &b.q),
                k: bias("attn_k", &b.k),
                v: bias("attn_v", &b.v),
                o: bias("attn_output", &b.o),
            };
            let norm = |s: &str, v: &Option<Vec<f32>>| {
                v.as_ref()
                    .map(|v| Tensor::vector(format!("blk.{l}.{s}.weight"), v.len()))
            };
            let en = &w.extra_norms;
            lp.norms = ExtraNorms {
                q: norm("attn_q_norm", &en.q),
                k: norm("attn_k_norm", &en.k),
                post_attn: norm("post_attention_norm", &en.post_attn),
                post_ffn: norm("post_ffw_norm", &en.post_ffn),
            };
        }
        for t in p.tensors_mut() {
            read_tensor(c, file, t)?;
        }
        Ok(p)
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
        w.tensors.extend(rope_factor_tensors(c));
        w.tensors.push(plain(&self.token_embd));
        for lp in &self.layers {
            if writes_fused(c) {
                w.tensors.extend(fused_layer(lp));
            } else {
                w.tensors.extend(lp.tensors().into_iter().map(plain));
            }
        }
        w.tensors.push(plain(&self.output_norm));
        w.tensors.extend(self.output.as_ref().map(plain));
        w
    }
}

/// `t` as an F32 tensor of its own name, in the file's layout.
fn plain(t: &Tensor) -> TensorData<'_> {
    TensorData {
        name: t.name.clone(),
        dims: t.dims(),
        ty: GgmlType::F32,
        data: match t.stored_data() {
            Cow::Borrowed(v) => Cow::Borrowed(f32_bytes(v)),
            Cow::Owned(v) => Cow::Owned(f32_bytes(&v).to_vec()),
        },
    }
}

/// The rows of `parts` one after another, as one F32 tensor `name` (a matrix of the parts'
/// width, or a vector).
fn concat<'a>(name: String, parts: &[&Tensor], vector: bool) -> TensorData<'a> {
    let mut bytes = Vec::new();
    for p in parts {
        bytes.extend_from_slice(f32_bytes(&p.data));
    }
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    let cols = parts[0].cols;
    TensorData {
        name,
        dims: if vector {
            vec![parts.iter().map(|p| p.cols).sum::<usize>() as u64]
        } else {
            vec![cols as u64, rows as u64]
        },
        ty: GgmlType::F32,
        data: Cow::Owned(bytes),
    }
}

/// A block's tensors with Q, K and V fused into `attn_qkv` (and their biases into
/// `attn_qkv.bias` when it has any: a missing one is zeros, the same model) and gate and up
/// into `ffn_up`, as Phi-3's files store them.
fn fused_layer(lp: &LayerParams) -> Vec<TensorData<'_>> {
    let KvParams::Heads { wk, wv } = &lp.kv else {
        unreachable!("a fused layout is written only without latent attention")
    };
    let b = &lp.biases;
    let fused_name = |t: &Tensor, from: &str, to: &str| t.name.replace(from, to);
    let zeros: Vec<Tensor> = [(&b.q, &lp.wq), (&b.k, wk), (&b.v, wv)]
        .iter()
        .map(|(bias, m)| match bias {
            Some(t) => t.clone(),
            None => Tensor::vector("", m.rows),
        })
        .collect();
    let mut skip: Vec<&Tensor> = vec![wk, wv];
    skip.extend(b.q.iter().chain(&b.k).chain(&b.v));
    let dense = lp.ffn.dense();
    skip.extend(dense.map(|f| &f.up));
    let mut out = Vec::new();
    for t in lp.tensors() {
        if std::ptr::eq(t, &lp.wq) {
            let name = fused_name(t, "attn_q.weight", "attn_qkv.weight");
            out.push(concat(name, &[&lp.wq, wk, wv], false));
            if b.q.is_some() || b.k.is_some() || b.v.is_some() {
                let name = fused_name(t, "attn_q.weight", "attn_qkv.bias");
                out.push(concat(name, &[&zeros[0], &zeros[1], &zeros[2]], true));
            }
        } else if let Some(f) = dense.filter(|f| std::ptr::eq(t, &f.gate)) {
            let name = fused_name(t, "ffn_gate.weight", "ffn_up.weight");
            out.push(concat(name, &[&f.gate, &f.up], false));
        } else if !skip.iter().any(|s| std::ptr::eq(*s, t)) {
            out.push(plain(t));
        }
    }
    out
}

/// The RoPE factors the configuration rotates with, as the tensors the family reads: Phi-3's
/// long and short factors, or Llama 3's `rope_freqs`.
fn rope_factor_tensors(c: &Config) -> Vec<TensorData<'_>> {
    let vector = |name: &str, f: &[f32]| TensorData {
        name: name.into(),
        dims: vec![f.len() as u64],
        ty: GgmlType::F32,
        data: Cow::Owned(f32_bytes(f).to_vec()),
    };
    match (&c.long_rope, &c.rope_scaling.freq_factors) {
        (Some(l), _) => [
            ("rope_factors_long.weight", &l.long),
            ("rope_factors_short.weight", &l.short),
        ]
        .into_iter()
        .filter_map(|(n, f)| f.as_deref().map(|f| vector(n, f)))
        .collect(),
        (None, Some(f)) => vec![vector("rope_freqs.weight", f)],
        (None, None) => Vec::new(),
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
