//! Memory arithmetic for serving a model: KV cache, weights, and why long context costs more.
//!
//! Nothing here loads weights or runs a model: every figure follows from the architecture alone,
//! so the same arithmetic answers for a 135M model on a laptop and a 671B model on a cluster.
//! The description comes from one of three places ([`desc`]): the built-in catalog
//! ([`catalog`], a data file with a source for every model), a GGUF file's metadata, or a
//! Hugging Face `config.json`. From it:
//!
//! - [`kv`]: the cache each token adds, `2 x layers x kv_heads x head_dim x bytes` (or the
//!   latent of multi-head latent attention), capped at the window on sliding-window layers, and
//!   the same model with its attention converted (MHA, GQA, MQA, MLA) for comparison;
//! - [`memory`]: the parameter count (total and, for mixtures of experts, active per token) and
//!   the weight bytes in each storage format;
//! - [`serving`]: how many sequences of each length fit next to the weights on a device, and the
//!   relative cost of a long request;
//! - [`report`]: all of it for one model, context and batch, as one serializable value.
//!
//! Units are stated, never implied: `KiB`/`MiB`/`GiB` are powers of 1024, `KB`/`MB`/`GB` powers
//! of 1000, because the two differ by 7% at the gigabyte scale, about the size of a KV cache
//! error people actually make.

pub mod catalog;
pub mod desc;
pub mod gguf_desc;
mod hf_config;
pub mod kv;
pub mod memory;
pub mod report;
pub mod serving;

pub use catalog::{Catalog, CatalogEntry};
pub use desc::{Attention, Ffn, Layout, Mla, ModelDesc, Moe, Norm, Origin, SlidingWindow};
pub use kv::{AttentionVariant, KvShape};
pub use memory::ParamCount;
pub use report::{Estimate, Options, estimate};
pub use serving::{Device, ServingRow, ServingTable};

use std::fmt;

/// Everything that can go wrong describing a model or reading an option. Each message names
/// the input at fault and what would be accepted, because the user has to fix it by hand.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    #[error("unknown model {name:?}{}", suggestion_text(suggestions))]
    UnknownModel {
        name: String,
        suggestions: Vec<String>,
    },
    #[error("model name {name:?} is ambiguous: it matches {}", matches.join(", "))]
    AmbiguousModel { name: String, matches: Vec<String> },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid config.json: {reason}")]
    BadJson { path: String, reason: String },
    #[error("{origin}: field `{field}`: {reason}")]
    BadField {
        origin: String,
        field: String,
        reason: String,
    },
    #[error("{origin}: missing field `{field}` ({why})")]
    MissingField {
        origin: String,
        field: String,
        why: String,
    },
    #[error("{origin}: contradictory fields: {reason}")]
    Contradiction { origin: String, reason: String },
    #[error("{origin}: {reason}")]
    Invalid { origin: String, reason: String },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error("bad context length {input:?}: {reason} (examples: 4096, 32k, 128k, 1m; k = 1024)")]
    BadContext { input: String, reason: String },
    #[error(
        "bad size {input:?}: {reason} (examples: 80GiB, 80GB, 24GiB; GiB = 2^30 B, GB = 10^9 B)"
    )]
    BadSize { input: String, reason: String },
    #[error("unknown {what} {input:?} (known: {known})")]
    UnknownFormat {
        what: &'static str,
        input: String,
        known: String,
    },
    #[error("bad attention variant {input:?}: {reason} (known: mha, gqa:G, mqa, mla:R)")]
    BadVariant { input: String, reason: String },
    #[error("unknown device {input:?} (presets: {known}; or give --device-memory SIZE)")]
    UnknownDevice { input: String, known: String },
    #[error("{0}: the number is too large to compute")]
    Overflow(String),
    #[error(
        "the model's maximum context is unknown ({origin} does not say): give a context length"
    )]
    NoContext { origin: String },
    #[error("the built-in model catalog is invalid: {0}")]
    Catalog(String),
}

fn suggestion_text(s: &[String]) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!("; did you mean {}?", s.join(", "))
    }
}

pub type Result<T> = std::result::Result<T, EstimateError>;

/// A storage format for weights or cache elements, with its real size including block scales:
/// a "4-bit" q4_0 block of 32 weights stores a 16-bit scale too, so it costs 4.5 bits, not 4.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    F32,
    F16,
    Bf16,
    /// 8-bit float (E4M3 or E5M2): one byte, no block scale counted.
    Fp8,
    Q8_0,
    Q4K,
    Q4_0,
    Mxfp4,
}

impl Format {
    /// Formats a KV cache can be stored in.
    pub const KV: &[Format] = &[
        Format::F32,
        Format::F16,
        Format::Bf16,
        Format::Fp8,
        Format::Q8_0,
        Format::Q4_0,
    ];
    /// Formats weights are commonly shipped in.
    pub const WEIGHTS: &[Format] = &[
        Format::F32,
        Format::Bf16,
        Format::Fp8,
        Format::Q8_0,
        Format::Q4K,
        Format::Q4_0,
        Format::Mxfp4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
            Format::Fp8 => "fp8",
            Format::Q8_0 => "q8_0",
            Format::Q4K => "q4_k",
            Format::Q4_0 => "q4_0",
            Format::Mxfp4 => "mxfp4",
        }
    }

    /// (elements per block, bytes per block): q8_0 is 32 int8 + an f16 scale = 34 bytes,
    /// q4_0 is 32 nibbles + an f16 scale = 18, q4_k 256 weights in 144 bytes, mxfp4 32 fp4
    /// values + one shared 8-bit exponent = 17.
    pub fn block(self) -> (u64, u64) {
        match self {
            Format::F32 => (1, 4),
            Format::F16 | Format::Bf16 => (1, 2),
            Format::Fp8 => (1, 1),
            Format::Q8_0 => (32, 34),
            Format::Q4K => (256, 144),
            Format::Q4_0 => (32, 18),
            Format::Mxfp4 => (32, 17),
        }
    }

    /// Bits per element, block scales included.
    pub fn bits(self) -> f64 {
        let (n, b) = self.block();
        b as f64 * 8.0 / n as f64
    }

    /// Bytes for `n` elements, rounded up to whole bytes (a partial block is not charged as a
    /// whole one: the figure is the format's density, not a particular tensor's padding).
    pub fn bytes_for(self, n: u128) -> u128 {
        let (per, bytes) = self.block();
        (n * bytes as u128).div_ceil(per as u128)
    }

    /// Parses a format name case-insensitively; `what` says which list applies (KV or weights).
    pub fn parse(s: &str, allowed: &[Format], what: &'static str) -> Result<Format> {
        let l = s.trim().to_ascii_lowercase();
        let f = match l.as_str() {
            "f32" | "fp32" | "float32" => Some(Format::F32),
            "f16" | "fp16" | "float16" | "half" => Some(Format::F16),
            "bf16" | "bfloat16" => Some(Format::Bf16),
            "fp8" | "f8" | "e4m3" | "e5m2" | "float8" => Some(Format::Fp8),
            "q8_0" | "q8" => Some(Format::Q8_0),
            "q4_k" | "q4_k_m" | "q4k" => Some(Format::Q4K),
            "q4_0" => Some(Format::Q4_0),
            "mxfp4" => Some(Format::Mxfp4),
            _ => None,
        };
        match f {
            Some(f) if allowed.contains(&f) => Ok(f),
            _ => Err(EstimateError::UnknownFormat {
                what,
                input: s.to_string(),
                known: allowed
                    .iter()
                    .map(|f| f.name())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Longest context accepted: 2^30 tokens, far past any model, small enough that every product
/// below fits comfortably in 128-bit arithmetic.
pub const MAX_CONTEXT: u64 = 1 << 30;

/// Parses a context length: `4096`, `32k`, `128K`, `1m` (k = 1024, m = 1024^2, as context
/// lengths are quoted: "128k" means 131,072 tokens).
pub fn parse_context(s: &str) -> Result<u64> {
    let t = s.trim().to_ascii_lowercase();
    let bad = |reason: &str| EstimateError::BadContext {
        input: s.to_string(),
        reason: reason.to_string(),
    };
    let (num, mult) = if let Some(n) = t.strip_suffix('k') {
        (n, 1024u64)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 1024 * 1024)
    } else {
        (t.as_str(), 1)
    };
    if num.is_empty() {
        return Err(bad("no number"));
    }
    let v: u64 = if let Ok(v) = num.parse::<u64>() {
        v.checked_mul(mult).ok_or_else(|| bad("too large"))?
    } else {
        // "1.5k" is accepted when it comes to a whole number of tokens.
        let f: f64 = num
            .parse()
            .map_err(|_| bad("not a number with an optional k or m suffix"))?;
        let tokens = f * mult as f64;
        if !(tokens.is_finite() && tokens >= 0.0 && tokens.fract() == 0.0) {
            return Err(bad("not a whole number of tokens"));
        }
        if tokens > MAX_CONTEXT as f64 {
            return Err(bad("too large"));
        }
        tokens as u64
    };
    if v == 0 {
        return Err(bad("must be at least 1 token"));
    }
    if v > MAX_CONTEXT {
        return Err(bad("longer than 2^30 tokens"));
    }
    Ok(v)
}

/// Parses a memory size with an explicit unit: `80GiB` (binary) or `80GB` (decimal). A bare
/// `80G` is refused because it is exactly the ambiguity that makes such estimates 7% wrong.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let bad = |reason: &str| EstimateError::BadSize {
        input: s.to_string(),
        reason: reason.to_string(),
    };
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let unit = unit.trim();
    let mult: f64 = match unit.to_ascii_lowercase().as_str() {
        "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "" => return Err(bad("no unit")),
        "k" | "m" | "g" | "t" => return Err(bad("ambiguous unit: write GiB or GB")),
        _ => return Err(bad("unknown unit")),
    };
    let v: f64 = num.parse().map_err(|_| bad("not a number"))?;
    let bytes = v * mult;
    if !(bytes.is_finite() && bytes >= 1.0) {
        return Err(bad("must be at least one byte"));
    }
    if bytes > 1e18 {
        return Err(bad("too large"));
    }
    Ok(bytes.round() as u64)
}

/// Human units, both conventions: `2.00 GiB (2.15 GB)`.
pub fn human_bytes(b: u128) -> String {
    if b < 1000 {
        return format!("{b} B");
    }
    format!("{}, {}", binary_units(b), decimal_units(b))
}

/// Binary prefixes only: `2.00 GiB`.
pub fn binary_units(b: u128) -> String {
    const U: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    scaled(b, 1024.0, &U)
}

/// Decimal prefixes only: `2.15 GB`.
pub fn decimal_units(b: u128) -> String {
    const U: [&str; 6] = ["B", "KB", "MB", "GB", "TB", "PB"];
    scaled(b, 1000.0, &U)
}

fn scaled(b: u128, base: f64, units: &[&str]) -> String {
    let mut v = b as f64;
    let mut u = 0;
    while v >= base && u + 1 < units.len() {
        v /= base;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// An integer with thousands separators: `2,147,483,648`.
pub fn grouped(n: u128) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A context length as people quote it: `4k`, `128k`, `1m`, or the plain number when it is
/// not a whole multiple.
pub fn short_context(n: u64) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}m", n >> 20)
    } else if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}k", n >> 10)
    } else {
        grouped(n as u128)
    }
}

/// A parameter count in the units papers use, to two decimals without trailing zeros:
/// `6.74B`, `7B`, `134.52M`.
pub fn short_count(n: f64) -> String {
    let (v, unit) = if n >= 1e12 {
        (n / 1e12, "T")
    } else if n >= 1e9 {
        (n / 1e9, "B")
    } else if n >= 1e6 {
        (n / 1e6, "M")
    } else if n >= 1e3 {
        (n / 1e3, "K")
    } else {
        (n, "")
    };
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    format!("{s}{unit}")
}

/// Converts to u64 for output, naming the quantity when it does not fit.
pub(crate) fn to_u64(v: u128, what: &str) -> Result<u64> {
    u64::try_from(v).map_err(|_| EstimateError::Overflow(what.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    #[test]
    fn estimate_format_bits_match_ggml_table() {
        // The ggml type table is the independent source for the block formats' real density.
        for (f, g) in [
            (Format::F32, GgmlType::F32),
            (Format::F16, GgmlType::F16),
            (Format::Bf16, GgmlType::BF16),
            (Format::Q8_0, GgmlType::Q8_0),
            (Format::Q4K, GgmlType::Q4_K),
            (Format::Q4_0, GgmlType::Q4_0),
            (Format::Mxfp4, GgmlType::MXFP4),
        ] {
            assert_eq!(f.bits(), g.bits_per_weight(), "{f}");
        }
        let want = [32.0, 16.0, 8.0, 8.5, 4.5, 4.5, 4.25];
        let got: Vec<f64> = Format::WEIGHTS.iter().map(|f| f.bits()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn estimate_format_names_round_trip() {
        for &f in Format::KV.iter().chain(Format::WEIGHTS) {
            assert_eq!(serde_json::to_value(f).unwrap(), f.name());
            assert_eq!(Format::parse(f.name(), &[f], "format").unwrap(), f);
        }
        assert!(Format::parse("q4_k", Format::KV, "KV type").is_err());
        assert!(Format::parse("int3", Format::WEIGHTS, "weight format").is_err());
    }

    #[test]
    fn estimate_parse_context_suffixes() {
        assert_eq!(parse_context("4096").unwrap(), 4096);
        assert_eq!(parse_context("32k").unwrap(), 32768);
        assert_eq!(parse_context("128K").unwrap(), 131072);
        assert_eq!(parse_context("1m").unwrap(), 1 << 20);
        assert_eq!(parse_context("1.5k").unwrap(), 1536);
        for bad in ["", "0", "k", "-5", "12q", "1e99", "0.3k", "2000m"] {
            assert!(parse_context(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn estimate_parse_size_units() {
        assert_eq!(parse_size("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_size("80 GB").unwrap(), 80_000_000_000);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        for bad in ["80", "80G", "GiB", "-1GB", "80XB", "0GB"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn estimate_unit_formatting() {
        assert_eq!(grouped(2147483648), "2,147,483,648");
        assert_eq!(grouped(999), "999");
        assert_eq!(human_bytes(2147483648), "2.00 GiB, 2.15 GB");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(short_context(131072), "128k");
        assert_eq!(short_context(1 << 20), "1m");
        assert_eq!(short_context(2047), "2,047");
        assert_eq!(short_count(7e9), "7B");
        assert_eq!(short_count(6_738_415_616.0), "6.74B");
        assert_eq!(short_count(134_515_008.0), "134.52M");
        assert_eq!(short_count(46.7e9), "46.7B");
    }
}
