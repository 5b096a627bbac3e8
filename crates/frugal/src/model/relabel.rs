//! A real Llama file rewritten as another family's file, so that each family's switches can be
//! checked on real weights (a model that stays sane) against other engines: test material, as
//! [`super::synthetic`] is for random weights.
//!
//! - **Qwen 2** (`qwen2`): each head's Q and K rows are taken back from llama.cpp's
//!   interleaved-pair order to split halves (the inverse of its converter's `permute`), which
//!   with NeoX RoPE computes the same scores; then Q, K and V biases are added. With biases of
//!   zero the file is the same model as the Llama one.
//! - **Qwen 3** (`qwen3`): the same rows, no biases, and a per-head RMSNorm weight for Q and K
//!   (which changes the model: its scores are normalized).
//! - **Phi-3** (`phi3`): the same rows, Q, K and V fused into `attn_qkv` and gate and up into
//!   `ffn_up` (gate's rows first), the tied output written out (llama.cpp's phi3 requires
//!   `output.weight`); optionally long and short RoPE factors. Without factors the file is the
//!   same model as the Llama one.
//! - **Llama 3 RoPE** (`llama` still): `rope_freqs.weight` and/or `rope.scaling.*` keys added.

use std::borrow::Cow;

use crate::gguf::{GgufError, GgufFile, GgufWriter, TensorData, Value};
use crate::quant::{GgmlType, quantize_f32};

/// The family to rewrite a `llama` file as.
#[derive(Clone, Debug)]
pub enum Target {
    /// Q, K and V biases drawn uniformly from `±bias`.
    Qwen2 { bias: f32 },
    /// Q and K norm weights drawn uniformly from `1 ± spread`.
    Qwen3 { spread: f32 },
    /// With `factors = Some((max, orig))`: long and short RoPE factors drawn from `1..max`,
    /// the long ones applying past `orig` positions of context.
    Phi3 { factors: Option<(f32, u32)> },
}

/// Rewrites the `llama` file `f` as `target` (deterministic in `seed`).
pub fn llama_as(f: &GgufFile, target: &Target, seed: u64) -> Result<Vec<u8>, GgufError> {
    let arch = f.str("general.architecture")?;
    if arch != "llama" {
        return Err(GgufError::BadValue {
            key: "general.architecture".into(),
            reason: format!("{arch:?}: only a llama file is rewritten"),
        });
    }
    let to = match target {
        Target::Qwen2 { .. } => "qwen2",
        Target::Qwen3 { .. } => "qwen3",
        Target::Phi3 { .. } => "phi3",
    };
    let n_head = f.u32("llama.attention.head_count")? as usize;
    let n_head_kv = f
        .u32_opt("llama.attention.head_count_kv")?
        .map_or(n_head, |v| v as usize);
    let mut w = GgufWriter::from_file(f);
    for (k, v) in &mut w.metadata {
        if let Some(rest) = k.strip_prefix("llama.") {
            *k = format!("{to}.{rest}");
        }
        if k == "general.architecture" {
            *v = Value::String(to.into());
        }
    }
    let mut rnd = uniform(seed);
    let mut extra = Vec::new();
    for t in &mut w.tensors {
        let heads = if t.name.ends_with(".attn_q.weight") {
            n_head
        } else if t.name.ends_with(".attn_k.weight") {
            n_head_kv
        } else {
            continue;
        };
        let info = f
            .tensor_info(&t.name)
            .expect("the writer's tensors are the file's");
        t.data = Cow::Owned(halves_from_pairs(&t.data, info.n_rows(), heads));
        let rows = info.n_rows();
        let layer = t.name.trim_end_matches(".weight");
        let head_dim = rows / heads;
        match target {
            Target::Qwen2 { bias } => {
                let b: Vec<f32> = (0..rows).map(|_| rnd() * bias).collect();
                extra.push((format!("{layer}.bias"), b));
                if t.name.ends_with(".attn_k.weight") {
                    let v: Vec<f32> = (0..rows).map(|_| rnd() * bias).collect();
                    let v_name = layer.replace(".attn_k", ".attn_v");
                    extra.push((format!("{v_name}.bias"), v));
                }
            }
            Target::Qwen3 { spread } => {
                let n: Vec<f32> = (0..head_dim).map(|_| 1.0 + rnd() * spread).collect();
                extra.push((format!("{layer}_norm.weight"), n));
            }
            Target::Phi3 { .. } => {}
        }
    }
    if let Target::Phi3 { factors } = target {
        fuse_phi3(&mut w, f)?;
        if let Some((max, orig)) = factors {
            let pairs = f.u32_opt("llama.rope.dimension_count")?.map_or_else(
                || -> Result<usize, GgufError> {
                    let d = f.u32("llama.embedding_length")? as usize;
                    Ok(d / n_head / 2)
                },
                |r| Ok(r as usize / 2),
            )?;
            for kind in ["long", "short"] {
                let v: Vec<f32> = (0..pairs)
                    .map(|_| 1.0 + (rnd() + 1.0) / 2.0 * (max - 1.0))
                    .collect();
                extra.push((format!("rope_factors_{kind}.weight"), v));
            }
            w.set(
                "phi3.rope.scaling.original_context_length",
                Value::U32(*orig),
            );
        }
    }
    push_f32(&mut w, extra);
    w.to_bytes()
}

/// Phi-3's fused matrices: each layer's Q, K and V rows one after another as `attn_qkv`, gate
/// and up as `ffn_up`; and the output matrix (the embedding's bytes when tied).
fn fuse_phi3(w: &mut GgufWriter, f: &GgufFile) -> Result<(), GgufError> {
    let mut layer = 0;
    loop {
        let name = |s: &str| format!("blk.{layer}.{s}.weight");
        if f.tensor_info(&name("attn_q")).is_none() {
            break;
        }
        for (parts, fused) in [
            (["attn_q", "attn_k", "attn_v"].as_slice(), "attn_qkv"),
            (["ffn_gate", "ffn_up"].as_slice(), "ffn_up"),
        ] {
            let mut data = Vec::new();
            let (mut rows, mut cols, mut ty) = (0, 0, GgmlType::F32);
            for p in parts {
                let t = w
                    .tensors
                    .iter()
                    .position(|t| t.name == name(p))
                    .ok_or_else(|| GgufError::MissingTensor { tensor: name(p) })?;
                let t = w.tensors.remove(t);
                if data.is_empty() {
                    ty = t.ty;
                    cols = t.dims[0];
                } else if t.ty != ty || t.dims[0] != cols {
                    return Err(GgufError::BadTensor {
                        tensor: t.name.clone(),
                        offset: 0,
                        reason: "the parts of a fused matrix differ in type or width".into(),
                    });
                }
                rows += t.dims[1];
                data.extend_from_slice(&t.data);
            }
            w.tensors.push(TensorData {
                name: name(fused),
                dims: vec![cols, rows],
                ty,
                data: Cow::Owned(data),
            });
        }
        layer += 1;
    }
    if f.tensor_info("output.weight").is_none() {
        let (info, bytes) = f.tensor("token_embd.weight")?;
        w.tensors.push(TensorData {
            name: "output.weight".into(),
            dims: info.dims.clone(),
            ty: info.ty,
            data: Cow::Owned(bytes.to_vec()),
        });
    }
    Ok(())
}

/// Adds Llama 3 RoPE material to a file: `rope_freqs.weight` (when `factors` is given) and the
/// `rope.scaling.*` keys of `scaling` (type, factor, original context).
pub fn with_rope(
    f: &GgufFile,
    factors: Option<Vec<f32>>,
    scaling: Option<(&str, f32, Option<u32>)>,
) -> Result<Vec<u8>, GgufError> {
    let arch = f.str("general.architecture")?.to_string();
    let mut w = GgufWriter::from_file(f);
    if let Some(v) = factors {
        push_f32(&mut w, vec![("rope_freqs.weight".into(), v)]);
    }
    if let Some((kind, factor, orig)) = scaling {
        w.set(
            &format!("{arch}.rope.scaling.type"),
            Value::String(kind.into()),
        );
        w.set(&format!("{arch}.rope.scaling.factor"), Value::F32(factor));
        if let Some(o) = orig {
            let k = format!("{arch}.rope.scaling.original_context_length");
            w.set(&k, Value::U32(o));
        }
    }
    w.to_bytes()
}

/// Llama 3's frequency factors (Hugging Face's `llama3` rope type, which llama.cpp's converter
/// stores as `rope_freqs`): pairs whose wavelength is under `orig / high` keep their frequency,
/// those over `orig / low` are divided by `factor`, with a smooth blend between.
pub fn llama3_factors(
    rope_dim: usize,
    base: f32,
    factor: f32,
    low: f32,
    high: f32,
    orig: usize,
) -> Vec<f32> {
    (0..rope_dim / 2)
        .map(|i| {
            let freq = f64::from(base).powf(-2.0 * i as f64 / rope_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let (lo_wl, hi_wl) = (orig as f64 / f64::from(low), orig as f64 / f64::from(high));
            if wavelen < hi_wl {
                1.0
            } else if wavelen > lo_wl {
                factor
            } else {
                let smooth = (orig as f64 / wavelen - f64::from(low)) / f64::from(high - low);
                (1.0 / ((1.0 - smooth) / f64::from(factor) + smooth)) as f32
            }
        })
        .collect()
}

/// Each head's rows from interleaved pairs to split halves: row `h d + j d/2 + i` of the
/// result is row `h d + 2i + j` of `data` (rows of equal byte length, any storage type).
fn halves_from_pairs(data: &[u8], rows: usize, heads: usize) -> Vec<u8> {
    let row_bytes = data.len() / rows;
    let d = rows / heads;
    let mut out = vec![0u8; data.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let (dst, src) = (h * d + j * d / 2 + i, h * d + 2 * i + j);
                out[dst * row_bytes..][..row_bytes]
                    .copy_from_slice(&data[src * row_bytes..][..row_bytes]);
            }
        }
    }
    out
}

fn push_f32(w: &mut GgufWriter, tensors: Vec<(String, Vec<f32>)>) {
    for (name, v) in tensors {
        w.tensors.push(TensorData {
            name,
            dims: vec![v.len() as u64],
            ty: GgmlType::F32,
            data: Cow::Owned(quantize_f32(&v)),
        });
    }
}

/// Uniform draws in [-1, 1) from a xorshift state.
fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}
