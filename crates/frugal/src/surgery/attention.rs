//! Converting a trained model's attention layout by regrouping its KV heads: MHA, GQA with G
//! groups, MQA. The cache holds `2 x n_kv x head_dim` values per token per layer, so the number
//! of KV heads is the cache's size; this is the surgery that trades it against quality.
//!
//! Every query head `h` of a GQA model reads KV head `h / (n_head / n_kv)`. The conversion first
//! gives each query head its own copy of that head (MHA, which computes exactly the same
//! function), then, for `G` new groups of consecutive query heads, mean-pools their copies into
//! one head per group, as the GQA paper (Ainslie et al., 2023, section 2.1) builds GQA and MQA
//! from an MHA checkpoint. A new head whose query heads all read the same original head is that
//! head, so its rows are copied byte for byte: `mha` and the original grouping are lossless, and
//! only pooled heads are decoded, averaged and re-encoded in the tensor's own type.
//!
//! The file keeps its architecture; only `head_count_kv` and the K and V projections change.

use std::borrow::Cow;

use crate::gguf::{GgufFile, GgufWriter, Value};
use crate::model::Config;
use crate::quant;

use super::SurgeryError;

/// A target attention layout for [`convert_attention`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionLayout {
    /// One KV head per query head.
    Mha,
    /// This many KV heads, each shared by `n_head / G` consecutive query heads.
    Gqa(usize),
    /// One KV head shared by every query head.
    Mqa,
}

impl AttentionLayout {
    /// The number of KV heads this layout gives a model with `n_head` query heads.
    pub fn kv_heads(self, n_head: usize) -> usize {
        match self {
            AttentionLayout::Mha => n_head,
            AttentionLayout::Gqa(g) => g,
            AttentionLayout::Mqa => 1,
        }
    }
}

impl std::fmt::Display for AttentionLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AttentionLayout::Mha => f.write_str("mha"),
            AttentionLayout::Gqa(g) => write!(f, "gqa:{g}"),
            AttentionLayout::Mqa => f.write_str("mqa"),
        }
    }
}

impl std::str::FromStr for AttentionLayout {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        match lower.as_str() {
            "mha" => return Ok(AttentionLayout::Mha),
            "mqa" => return Ok(AttentionLayout::Mqa),
            _ => {}
        }
        if let Some(g) = lower.strip_prefix("gqa:") {
            return match g.parse::<usize>() {
                Ok(g) if g > 0 => Ok(AttentionLayout::Gqa(g)),
                _ => Err(format!(
                    "gqa:{g}: the group count must be a positive integer"
                )),
            };
        }
        Err(format!(
            "unknown attention layout {s:?} (expected mha, mqa or gqa:G)"
        ))
    }
}

/// What a conversion did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LayoutReport {
    pub layout: AttentionLayout,
    pub n_head: usize,
    pub kv_heads_before: usize,
    pub kv_heads_after: usize,
    /// KV heads of the new file that are an original head copied byte for byte.
    pub heads_copied: usize,
    /// KV heads that are the mean of several original heads (re-encoded).
    pub heads_pooled: usize,
    /// Bytes of the K and V projections, before and after, over all layers.
    pub kv_weight_bytes_before: u64,
    pub kv_weight_bytes_after: u64,
    /// Cache elements per token (K and V, every layer), before and after.
    pub kv_elements_before: usize,
    pub kv_elements_after: usize,
}

impl LayoutReport {
    /// True when the new file computes exactly what the old one did.
    pub fn exact(&self) -> bool {
        self.heads_pooled == 0
    }
}

/// For each new KV head, the original KV heads its query heads read (one entry per query head,
/// so a head read by two query heads of the group counts twice in the mean).
fn sources(n_head: usize, n_kv: usize, n_kv_new: usize) -> Vec<Vec<usize>> {
    let (per_old, per_new) = (n_head / n_kv, n_head / n_kv_new);
    (0..n_kv_new)
        .map(|j| {
            (j * per_new..(j + 1) * per_new)
                .map(|h| h / per_old)
                .collect()
        })
        .collect()
}

/// Converts `file`'s attention to `layout`, into a writer that borrows every unchanged tensor.
pub fn convert_attention(
    file: &GgufFile,
    layout: AttentionLayout,
) -> Result<(GgufWriter<'_>, LayoutReport), SurgeryError> {
    let c = Config::from_gguf(file)?;
    if c.mla.is_some() {
        return Err(SurgeryError::Invalid(format!(
            "{layout}: the model has latent attention ({}); regrouping needs per-head keys and \
             values (an MHA or GQA model)",
            c.arch
        )));
    }
    let n_kv_new = layout.kv_heads(c.n_head);
    if n_kv_new == 0 || !c.n_head.is_multiple_of(n_kv_new) {
        return Err(SurgeryError::Invalid(format!(
            "{layout}: {n_kv_new} KV groups do not divide the model's {} query heads \
             (divisors: {})",
            c.n_head,
            (1..=c.n_head)
                .filter(|g| c.n_head.is_multiple_of(*g))
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    let src = sources(c.n_head, c.n_head_kv, n_kv_new);
    let copied = src.iter().filter(|s| s.iter().all(|&o| o == s[0])).count();
    let hd = c.head_dim;
    let mut w = GgufWriter::from_file(file);
    let (mut before, mut after) = (0u64, 0u64);
    for t in w.tensors.iter_mut() {
        let is_kv = t.name.starts_with("blk.")
            && (t.name.ends_with(".attn_k.weight") || t.name.ends_with(".attn_v.weight"));
        if !is_kv {
            continue;
        }
        if t.dims.len() != 2 || t.dims[1] as usize != c.kv_dim() {
            return Err(SurgeryError::Invalid(format!(
                "{}: shape {:?}, expected [{}, {}]",
                t.name,
                t.dims,
                c.n_embd,
                c.kv_dim()
            )));
        }
        let cols = t.dims[0] as usize;
        let row_bytes = t.data.len() / c.kv_dim();
        let head_bytes = row_bytes * hd;
        before += t.data.len() as u64;
        let mut out = Vec::with_capacity(head_bytes * n_kv_new);
        for heads in &src {
            if heads.iter().all(|&o| o == heads[0]) {
                out.extend_from_slice(&t.data[heads[0] * head_bytes..][..head_bytes]);
                continue;
            }
            let mut mean = vec![0f32; hd * cols];
            let mut x = vec![0f32; hd * cols];
            for &o in heads {
                quant::dequantize(t.ty, &t.data[o * head_bytes..][..head_bytes], &mut x)
                    .map_err(|e| SurgeryError::Quant(t.name.clone(), e))?;
                mean.iter_mut().zip(&x).for_each(|(m, &v)| *m += v);
            }
            let inv = 1.0 / heads.len() as f32;
            mean.iter_mut().for_each(|m| *m *= inv);
            out.extend(
                quant::quantize(t.ty, &mean).map_err(|e| SurgeryError::Quant(t.name.clone(), e))?,
            );
        }
        after += out.len() as u64;
        t.dims[1] = (n_kv_new * hd) as u64;
        t.data = Cow::Owned(out);
    }
    w.set(
        &format!("{}.attention.head_count_kv", c.arch),
        Value::U32(n_kv_new as u32),
    );
    let per_token = |kv: usize| 2 * c.n_layers * kv * hd;
    let report = LayoutReport {
        layout,
        n_head: c.n_head,
        kv_heads_before: c.n_head_kv,
        kv_heads_after: n_kv_new,
        heads_copied: copied,
        heads_pooled: n_kv_new - copied,
        kv_weight_bytes_before: before,
        kv_weight_bytes_after: after,
        kv_elements_before: per_token(c.n_head_kv),
        kv_elements_after: per_token(n_kv_new),
    };
    Ok((w, report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synthetic::{SyntheticSpec, build};
    use crate::model::{Logits, Model, Scratch};
    use crate::quant::{GgmlType, dequantize_to_vec};

    fn convert(bytes: &[u8], layout: AttentionLayout) -> (Vec<u8>, LayoutReport) {
        let f = GgufFile::from_bytes(bytes.to_vec()).unwrap();
        let (w, r) = convert_attention(&f, layout).unwrap();
        (w.to_bytes().unwrap(), r)
    }

    fn logits(bytes: &[u8], tokens: &[u32]) -> Vec<f32> {
        let m = Model::from_file(GgufFile::from_bytes(bytes.to_vec()).unwrap()).unwrap();
        let mut kv = m.new_cache(64).unwrap();
        let mut s = Scratch::default();
        m.forward(tokens, &mut kv, &mut s, Logits::All)
            .unwrap()
            .to_vec()
    }

    fn tensor(bytes: &[u8], name: &str) -> Vec<f32> {
        let f = GgufFile::from_bytes(bytes.to_vec()).unwrap();
        let (info, b) = f.tensor(name).unwrap();
        dequantize_to_vec(info.ty, b, info.n_elements() as usize).unwrap()
    }

    const TOKENS: [u32; 12] = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33];

    /// MHA computes exactly what GQA did: each query head reads a byte-for-byte copy of its KV
    /// head, and attention treats each query row alone, so the logits are the same bits.
    #[test]
    fn mha_is_exact_in_every_format() {
        for ty in [GgmlType::F32, GgmlType::Q4_1, GgmlType::Q8_0] {
            let spec = SyntheticSpec {
                n_head: 6,
                n_head_kv: 2,
                n_embd: 96,
                ty,
                ..Default::default()
            };
            let src = build(&spec);
            let (mha, r) = convert(&src, AttentionLayout::Mha);
            assert!(r.exact() && r.kv_heads_after == 6 && r.heads_copied == 6);
            assert_eq!(r.kv_elements_after, 3 * r.kv_elements_before);
            assert_eq!(logits(&src, &TOKENS), logits(&mha, &TOKENS), "{ty}");
        }
    }

    /// Pooling averages the copies of the heads a group's query heads read; pooling MHA back
    /// to the original grouping averages identical copies, which gives back the original rows.
    #[test]
    fn pooled_heads_are_the_mean_of_what_their_queries_read() {
        let spec = SyntheticSpec {
            n_head: 4,
            n_head_kv: 2,
            ..Default::default()
        };
        let src = build(&spec);
        let hd = 64 / 4;
        let (mqa, r) = convert(&src, AttentionLayout::Mqa);
        assert_eq!((r.kv_heads_after, r.heads_pooled), (1, 1));
        assert!(!r.exact());
        for name in ["blk.0.attn_k.weight", "blk.1.attn_v.weight"] {
            let (before, after) = (tensor(&src, name), tensor(&mqa, name));
            let head = hd * 64;
            assert_eq!(after.len(), head);
            for i in 0..head {
                let want = (before[i] + before[head + i]) * 0.5;
                assert!((after[i] - want).abs() <= 1e-6, "{name}[{i}]");
            }
        }
        // MQA runs, and it is a different function.
        let (a, b) = (logits(&src, &TOKENS), logits(&mqa, &TOKENS));
        assert!(b.iter().all(|x| x.is_finite()) && a != b);
        // GQA -> MHA -> GQA gives back the original tensors.
        let (mha, _) = convert(&src, AttentionLayout::Mha);
        let (back, r) = convert(&mha, AttentionLayout::Gqa(2));
        assert_eq!((r.heads_pooled, r.kv_heads_after), (2, 2));
        for l in 0..2 {
            for p in ["attn_k", "attn_v"] {
                let name = format!("blk.{l}.{p}.weight");
                assert_eq!(tensor(&src, &name), tensor(&back, &name), "{name}");
            }
        }
    }

    #[test]
    fn groups_that_do_not_divide_the_query_heads_are_refused() {
        let src = build(&SyntheticSpec {
            n_head: 6,
            n_head_kv: 2,
            n_embd: 96,
            ..Default::default()
        });
        let f = GgufFile::from_bytes(src).unwrap();
        let e = convert_attention(&f, AttentionLayout::Gqa(4))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("do not divide") && e.contains("1, 2, 3, 6"),
            "{e}"
        );
    }

    #[test]
    fn layouts_parse_and_print() {
        for s in ["mha", "mqa", "gqa:3", "GQA:9"] {
            let l: AttentionLayout = s.parse().unwrap();
            assert_eq!(l.to_string(), s.to_ascii_lowercase());
        }
        for bad in ["gqa", "gqa:0", "gqa:x", "mla", ""] {
            assert!(bad.parse::<AttentionLayout>().is_err(), "{bad}");
        }
    }

    #[test]
    fn sources_follow_the_query_heads() {
        // SmolLM2: 9 query heads on 3 KV heads.
        assert_eq!(
            sources(9, 3, 9),
            (0..9).map(|h| vec![h / 3]).collect::<Vec<_>>()
        );
        assert_eq!(sources(9, 3, 3), vec![vec![0; 3], vec![1; 3], vec![2; 3]]);
        assert_eq!(sources(9, 3, 1), vec![vec![0, 0, 0, 1, 1, 1, 2, 2, 2]]);
        // MHA to GQA-2 pools pairs.
        assert_eq!(sources(4, 4, 2), vec![vec![0, 1], vec![2, 3]]);
    }
}
