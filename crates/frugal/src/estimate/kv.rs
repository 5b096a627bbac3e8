//! KV-cache arithmetic: what each token leaves behind in every layer.
//!
//! Standard attention caches a key and a value vector per KV head per layer:
//! `2 x layers x kv_heads x head_dim` elements per token. Grouped-query attention shrinks
//! `kv_heads`; multi-head latent attention (MLA) replaces both with one latent of
//! `kv_lora_rank` elements plus a `qk_rope_head_dim` key shared by all heads. A sliding-window
//! layer keeps only the last `window` positions, so past the window it stops growing.

use serde::Serialize;

use super::desc::{Attention, ModelDesc, standard_label};
use super::{EstimateError, Format, Result, grouped};

/// The same model with its attention converted, for `--compare`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum AttentionVariant {
    /// One KV head per query head.
    Mha,
    /// `groups` KV heads, each shared by `n_heads / groups` query heads.
    Gqa { groups: u64 },
    /// One KV head shared by all query heads.
    Mqa,
    /// A latent of `rank` elements plus a decoupled RoPE key of `rope` elements.
    Mla { rank: u64, rope: u64 },
}

impl AttentionVariant {
    /// Parses `mha`, `gqa:8`, `mqa`, `mla:512` (or `mla:512:64` to set the RoPE key width;
    /// by default the model's own, or half the head dimension as DeepSeek-V2 chose).
    pub fn parse(s: &str, desc: &ModelDesc) -> Result<AttentionVariant> {
        let bad = |reason: String| EstimateError::BadVariant {
            input: s.to_string(),
            reason,
        };
        let l = s.trim().to_ascii_lowercase();
        let mut parts = l.split(':');
        let kind = parts.next().unwrap_or("");
        let nums: Vec<&str> = parts.collect();
        let num = |i: usize, what: &str| -> Result<u64> {
            let t = nums
                .get(i)
                .ok_or_else(|| bad(format!("needs {what}, as in {kind}:N")))?;
            match t.parse::<u64>() {
                Ok(v) if (1..=1 << 24).contains(&v) => Ok(v),
                _ => Err(bad(format!("{what} must be a whole number from 1"))),
            }
        };
        let v = match kind {
            "mha" if nums.is_empty() => AttentionVariant::Mha,
            "mqa" if nums.is_empty() => AttentionVariant::Mqa,
            "gqa" if nums.len() == 1 => {
                let groups = num(0, "a group count")?;
                if !desc.n_heads.is_multiple_of(groups) {
                    return Err(bad(format!(
                        "{groups} groups do not divide the model's {} attention heads",
                        desc.n_heads
                    )));
                }
                AttentionVariant::Gqa { groups }
            }
            "mla" if nums.len() == 1 || nums.len() == 2 => {
                let rank = num(0, "a latent rank")?;
                let rope = if nums.len() == 2 {
                    num(1, "a RoPE key width")?
                } else {
                    match &desc.attention {
                        Attention::Mla(m) => m.qk_rope_head_dim,
                        Attention::Standard => (desc.head_dim / 2).max(1),
                    }
                };
                AttentionVariant::Mla { rank, rope }
            }
            "mha" | "mqa" | "gqa" | "mla" => {
                return Err(bad("wrong number of ':' arguments".into()));
            }
            _ => return Err(bad("unknown kind".into())),
        };
        Ok(v)
    }

    /// The variant's label, in the words of [`KvShape::label`].
    pub fn name(&self) -> String {
        match self {
            AttentionVariant::Mha => "mha".into(),
            AttentionVariant::Gqa { groups } => format!("gqa:{groups}"),
            AttentionVariant::Mqa => "mqa".into(),
            AttentionVariant::Mla { rank, rope } => format!("mla:{rank}:{rope}"),
        }
    }
}

/// What one token caches in one layer, and how that number arises.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KvShape {
    /// MHA/GQA/MQA/MLA in words.
    pub label: String,
    /// Elements one token adds to one layer's cache.
    pub elements_per_layer: u64,
    /// The factors of `elements_per_layer` as printed in the formula (`2 (K and V)`,
    /// `8 KV heads`, `128 head_dim`); the layer count goes after the first.
    pub factors: Vec<String>,
}

impl KvShape {
    /// The shape of the model's own attention.
    pub fn of_model(desc: &ModelDesc) -> KvShape {
        match &desc.attention {
            Attention::Mla(m) => KvShape::mla(m.kv_lora_rank, m.qk_rope_head_dim),
            Attention::Standard => KvShape::standard(desc.n_kv_heads, desc),
        }
    }

    /// The shape of the model converted to `v`. Converting an MLA model to standard attention
    /// uses its per-head dimension (`qk_nope_head_dim`), the comparison DeepSeek-V2 makes.
    pub fn of_variant(desc: &ModelDesc, v: &AttentionVariant) -> KvShape {
        match v {
            AttentionVariant::Mha => KvShape::standard(desc.n_heads, desc),
            AttentionVariant::Gqa { groups } => KvShape::standard(*groups, desc),
            AttentionVariant::Mqa => KvShape::standard(1, desc),
            AttentionVariant::Mla { rank, rope } => KvShape::mla(*rank, *rope),
        }
    }

    fn standard(kv_heads: u64, desc: &ModelDesc) -> KvShape {
        KvShape {
            label: standard_label(desc.n_heads, kv_heads),
            elements_per_layer: 2 * kv_heads * desc.head_dim,
            factors: vec![
                "2 (K and V)".into(),
                format!("{} KV heads", grouped(kv_heads as u128)),
                format!("{} head_dim", grouped(desc.head_dim as u128)),
            ],
        }
    }

    fn mla(rank: u64, rope: u64) -> KvShape {
        KvShape {
            label: format!("MLA (latent rank {rank} + {rope} RoPE key dims)"),
            elements_per_layer: rank + rope,
            factors: vec![format!("({rank} kv_lora_rank + {rope} qk_rope_head_dim)")],
        }
    }

    /// Elements one token adds across all layers (before any window applies).
    pub fn elements_per_token(&self, desc: &ModelDesc) -> u64 {
        self.elements_per_layer * desc.n_layers
    }

    /// Elements cached for one sequence of `context` tokens: full layers hold every position,
    /// windowed layers at most `window`.
    pub fn elements_per_sequence(&self, desc: &ModelDesc, context: u64) -> u128 {
        let (full, windowed, held) = split_layers(desc, context);
        self.elements_per_layer as u128
            * (full as u128 * context as u128 + windowed as u128 * held as u128)
    }

    /// Bytes cached for one sequence of `context` tokens in format `f`.
    pub fn bytes_per_sequence(&self, desc: &ModelDesc, context: u64, f: Format) -> u128 {
        f.bytes_for(self.elements_per_sequence(desc, context))
    }

    /// Bytes one token adds across all layers (below any window).
    pub fn bytes_per_token(&self, desc: &ModelDesc, f: Format) -> u128 {
        f.bytes_for(self.elements_per_token(desc) as u128)
    }

    /// The per-token formula with the model's numbers:
    /// `2 (K and V) x 32 layers x 32 KV heads x 128 head_dim x 2 B (f16)`.
    pub fn formula(&self, desc: &ModelDesc, f: Format) -> String {
        let mut parts: Vec<String> = Vec::new();
        let mut first = true;
        for f in &self.factors {
            parts.push(f.clone());
            if first {
                parts.push(format!("{} layers", desc.n_layers));
                first = false;
            }
        }
        parts.push(format!("{} B ({})", bytes_per_element_text(f), f.name()));
        parts.join(" x ")
    }
}

/// Bytes per element as a short decimal: `2`, `1.0625`, `0.5625`.
pub fn bytes_per_element_text(f: Format) -> String {
    let (n, b) = f.block();
    if b % n == 0 {
        format!("{}", b / n)
    } else {
        let v = b as f64 / n as f64;
        let s = format!("{v:.4}");
        s.trim_end_matches('0').to_string()
    }
}

/// (layers holding every position, windowed layers, positions a windowed layer holds).
pub fn split_layers(desc: &ModelDesc, context: u64) -> (u64, u64, u64) {
    match &desc.sliding_window {
        Some(w) => (desc.n_layers - w.layers, w.layers, context.min(w.cached)),
        None => (desc.n_layers, 0, 0),
    }
}

/// The shortest context at which `batch` sequences' cache exceeds `bytes`, or `None` when it
/// never does (every layer windowed, so the cache stops growing below that size).
pub fn crossover_context(
    shape: &KvShape,
    desc: &ModelDesc,
    f: Format,
    batch: u64,
    bytes: u128,
) -> Option<u64> {
    let (n, b) = f.block();
    // Work in bits-per-block units to stay exact: cache(c) > bytes  <=>
    // elements(c) * b > bytes * n (ignoring the sub-byte rounding of bytes_for).
    let per_layer = shape.elements_per_layer as u128 * batch as u128 * b as u128;
    let target = bytes * n as u128;
    let (full, windowed) = match &desc.sliding_window {
        Some(w) => (desc.n_layers - w.layers, w.layers),
        None => (desc.n_layers, 0),
    };
    let grow_all = per_layer * (full + windowed) as u128;
    if grow_all == 0 {
        return None;
    }
    // While below the window, every layer grows by one position per token.
    let c = target / grow_all + 1;
    let window = desc.sliding_window.as_ref().map(|w| w.cached);
    match window {
        Some(w) if c as u64 > w || c > u64::MAX as u128 => {
            // Past the window only the full layers keep growing.
            let grow_full = per_layer * full as u128;
            if grow_full == 0 {
                return None;
            }
            let capped = per_layer * windowed as u128 * w as u128;
            let rest = target.saturating_sub(capped);
            let c = rest / grow_full + 1;
            u64::try_from(c.max(w as u128 + 1)).ok()
        }
        _ => u64::try_from(c).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::catalog::Catalog;

    fn model(id: &str) -> ModelDesc {
        Catalog::builtin().unwrap().describe(id).unwrap()
    }

    const GIB: u128 = 1 << 30;

    #[test]
    fn estimate_llama2_7b_is_2_gib_per_4096_token_sequence() {
        // Published figure (NVIDIA, "Mastering LLM Techniques: Inference Optimization", 2023:
        // Llama 2 7B, 16 bit, batch 1, 4096 tokens, "~2 GB"): 0.5 MiB per token, 2 GiB for a
        // full 4096-token sequence. Exact.
        let d = model("llama-2-7b");
        let s = KvShape::of_model(&d);
        assert_eq!(s.bytes_per_token(&d, Format::F16), 512 * 1024);
        assert_eq!(s.bytes_per_sequence(&d, 4096, Format::F16), 2 * GIB);
        assert_eq!(s.bytes_per_sequence(&d, 4096, Format::F32), 4 * GIB);
        assert_eq!(
            s.formula(&d, Format::F16),
            "2 (K and V) x 32 layers x 32 KV heads x 128 head_dim x 2 B (f16)"
        );
    }

    #[test]
    fn estimate_13b_mha_shape_is_800_kib_per_token() {
        // vLLM paper (Kwon et al. 2023, sec. 3): for OPT-13B "the KV cache of a single token
        // demands 800 KB of space, calculated as 2 x 5120 (hidden state size) x 40 (number of
        // layers) x 2 (bytes per FP16)". Llama-2-13B has the same shape (40 layers, MHA over a
        // 5120-wide hidden state). Exact: 819,200 B.
        let d = model("llama-2-13b");
        let s = KvShape::of_model(&d);
        assert_eq!(s.bytes_per_token(&d, Format::F16), 2 * 5120 * 40 * 2);
        assert_eq!(s.bytes_per_token(&d, Format::F16), 800 * 1024);
    }

    #[test]
    fn estimate_deepseek_v2_latent_is_576_elements_per_layer() {
        // DeepSeek-V2 paper (arXiv:2405.04434) sec. 3.1: the cache holds d_c + d_h^R =
        // 512 + 64 = 576 elements per layer per token, which it equates to GQA with 2.25 groups
        // (576 = 2.25 x 2 x 128). Exact.
        let d = model("deepseek-v2");
        let s = KvShape::of_model(&d);
        assert_eq!(s.elements_per_layer, 576);
        assert_eq!(
            s.formula(&d, Format::F16),
            "(512 kv_lora_rank + 64 qk_rope_head_dim) x 60 layers x 2 B (f16)"
        );
        let gqa = KvShape::of_variant(&d, &AttentionVariant::Gqa { groups: 1 });
        assert_eq!(
            s.elements_per_layer as f64 / gqa.elements_per_layer as f64,
            2.25
        );
        assert_eq!(d.head_dim, 128);
    }

    #[test]
    fn estimate_smollm2_135m_matches_reference_kv_per_token() {
        // Reference sheet (llama.cpp on the real file): 2 x 30 x 3 x 64 = 11,520 elements,
        // 46,080 B in f32, 23,040 B in f16 per token. Exact.
        let d = model("smollm2-135m");
        let s = KvShape::of_model(&d);
        assert_eq!(s.elements_per_token(&d), 11_520);
        assert_eq!(s.bytes_per_token(&d, Format::F32), 46_080);
        assert_eq!(s.bytes_per_token(&d, Format::F16), 23_040);
    }

    #[test]
    fn estimate_mistral_window_cuts_32k_cache_by_8x() {
        // Mistral 7B paper (arXiv:2310.06825) sec. 2: "On a sequence length of 32k tokens, this
        // reduces the cache memory usage by 8x." Exact for W = 4096.
        let d = model("mistral-7b-v0.1");
        let s = KvShape::of_model(&d);
        let capped = s.bytes_per_sequence(&d, 32 * 1024, Format::F16);
        let full = s.bytes_per_token(&d, Format::F16) * 32 * 1024;
        assert_eq!(full / capped, 8);
        assert_eq!(full % capped, 0);
    }

    #[test]
    fn estimate_kv_formats_scale_by_their_bits() {
        let d = model("llama-2-7b");
        let s = KvShape::of_model(&d);
        let f16 = s.bytes_per_sequence(&d, 4096, Format::F16);
        assert_eq!(s.bytes_per_sequence(&d, 4096, Format::Bf16), f16);
        assert_eq!(s.bytes_per_sequence(&d, 4096, Format::Fp8), f16 / 2);
        assert_eq!(s.bytes_per_sequence(&d, 4096, Format::Q8_0), f16 * 17 / 32);
        assert_eq!(s.bytes_per_sequence(&d, 4096, Format::Q4_0), f16 * 9 / 32);
        assert_eq!(bytes_per_element_text(Format::Q8_0), "1.0625");
        assert_eq!(bytes_per_element_text(Format::Q4_0), "0.5625");
    }

    #[test]
    fn estimate_variants_parse_and_convert() {
        let d = model("llama-2-7b");
        let p = |s| AttentionVariant::parse(s, &d);
        assert_eq!(p("mha").unwrap(), AttentionVariant::Mha);
        assert_eq!(p("GQA:8").unwrap(), AttentionVariant::Gqa { groups: 8 });
        assert_eq!(p("mqa").unwrap(), AttentionVariant::Mqa);
        assert_eq!(
            p("mla:512").unwrap(),
            AttentionVariant::Mla {
                rank: 512,
                rope: 64
            }
        );
        for bad in [
            "gqa",
            "gqa:3",
            "gqa:0",
            "mla",
            "mla:x",
            "foo",
            "mha:2",
            "mla:1:2:3",
        ] {
            assert!(p(bad).is_err(), "{bad}");
        }
        let mqa = KvShape::of_variant(&d, &AttentionVariant::Mqa);
        assert_eq!(
            mqa.elements_per_layer * 32,
            KvShape::of_model(&d).elements_per_layer
        );
    }

    #[test]
    fn estimate_crossover_is_first_context_past_the_weights() {
        let d = model("llama-2-7b");
        let s = KvShape::of_model(&d);
        let w = 13_476_831_232u128; // any size
        let c = crossover_context(&s, &d, Format::F16, 1, w).unwrap();
        assert!(s.bytes_per_sequence(&d, c, Format::F16) > w);
        assert!(s.bytes_per_sequence(&d, c - 1, Format::F16) <= w);
        // Every layer windowed: the cache stops at 4096 positions and may never get there.
        let m = model("mistral-7b-v0.1");
        let ms = KvShape::of_model(&m);
        assert_eq!(crossover_context(&ms, &m, Format::F16, 1, 14 * GIB), None);
        let small = crossover_context(&ms, &m, Format::F16, 1, 100 << 20).unwrap();
        assert!(ms.bytes_per_sequence(&m, small, Format::F16) > 100 << 20);
        assert!(ms.bytes_per_sequence(&m, small - 1, Format::F16) <= 100 << 20);
        // Half the layers windowed: growth continues at half rate past the window.
        let g = model("gemma-2-9b");
        let gs = KvShape::of_model(&g);
        let c = crossover_context(&gs, &g, Format::F16, 1, 18 * GIB).unwrap();
        assert!(c > 4096);
        assert!(gs.bytes_per_sequence(&g, c, Format::F16) > 18 * GIB);
        assert!(gs.bytes_per_sequence(&g, c - 1, Format::F16) <= 18 * GIB);
    }
}
