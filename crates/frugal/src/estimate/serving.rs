//! Why long context costs more: the same device serves fewer, slower, dearer requests.
//!
//! The weights take a fixed share of a device; whatever is left holds KV caches. A sequence's
//! cache grows linearly with its length, so the number of sequences that fit falls as 1/length.
//! Each request also holds its cache for as long as it runs, which grows with its length too,
//! so memory x time per request grows as length squared; and prefill attention does work for
//! every pair of positions, again length squared, while the rest of the model is linear. The
//! table puts these side by side so that the "per token" price of a long request is visible.
//!
//! Left out, and said so in the output: activations, framework overhead, fragmentation, and
//! any speed model (bandwidth, FLOP/s): the costs here are relative, not seconds or dollars.

use serde::Serialize;

use super::desc::ModelDesc;
use super::kv::{KvShape, split_layers};
use super::{EstimateError, Format, Result, to_u64};

/// A serving device: a name and its memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Device {
    pub name: String,
    pub memory_bytes: u64,
    /// How the number was arrived at.
    pub note: String,
}

const GIB: u64 = 1 << 30;

/// (name, bytes, note) of the presets. Cards whose memory is a power-of-two multiple of GiB
/// are given in GiB (the driver keeps a few hundred MiB of it); the H200's "141 GB" is taken as
/// decimal gigabytes, the lower reading.
const PRESETS: &[(&str, u64, &str)] = &[
    ("h100-80gb", 80 * GIB, "NVIDIA H100 80GB: 80 GiB HBM3"),
    (
        "h200",
        141_000_000_000,
        "NVIDIA H200: 141 GB HBM3e, taken as 141 x 10^9 B",
    ),
    ("a100-40gb", 40 * GIB, "NVIDIA A100 40GB: 40 GiB HBM2"),
    ("a100-80gb", 80 * GIB, "NVIDIA A100 80GB: 80 GiB HBM2e"),
    ("l4", 24 * GIB, "NVIDIA L4: 24 GiB GDDR6"),
    ("l40s", 48 * GIB, "NVIDIA L40S: 48 GiB GDDR6"),
    ("rtx-4090", 24 * GIB, "GeForce RTX 4090: 24 GiB GDDR6X"),
    ("rtx-3090", 24 * GIB, "GeForce RTX 3090: 24 GiB GDDR6X"),
    ("mi300x", 192 * GIB, "AMD Instinct MI300X: 192 GiB HBM3"),
];

impl Device {
    /// A preset by name (case-insensitive; `h100` alone finds `h100-80gb` when unique).
    pub fn preset(name: &str) -> Result<Device> {
        let q = name.trim().to_ascii_lowercase();
        let exact = PRESETS.iter().find(|p| p.0 == q);
        let found = match exact {
            Some(p) => Some(p),
            None => {
                let m: Vec<_> = PRESETS.iter().filter(|p| p.0.starts_with(&q)).collect();
                if m.len() == 1 && !q.is_empty() {
                    Some(m[0])
                } else {
                    None
                }
            }
        };
        found
            .map(|(n, b, note)| Device {
                name: n.to_string(),
                memory_bytes: *b,
                note: note.to_string(),
            })
            .ok_or_else(|| EstimateError::UnknownDevice {
                input: name.to_string(),
                known: Device::preset_names().join(", "),
            })
    }

    pub fn preset_names() -> Vec<&'static str> {
        PRESETS.iter().map(|p| p.0).collect()
    }

    /// A device of a given memory size (from `--device-memory`).
    pub fn custom(bytes: u64, label: &str) -> Device {
        Device {
            name: label.to_string(),
            memory_bytes: bytes,
            note: "given on the command line".into(),
        }
    }
}

/// One context length of the long-context table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServingRow {
    pub context: u64,
    pub kv_bytes_per_sequence: u64,
    /// Sequences of this length that fit next to the weights, per device (same order as
    /// [`ServingTable::devices`]); 0 when the weights alone do not fit.
    pub sequences: Vec<u64>,
    /// KV bytes x tokens held, relative to the first row: the cache's size times how long the
    /// request keeps it (proportional to its length).
    pub kv_memory_time_rel: f64,
    /// Prefill FLOPs of one request: 2 x active parameters x tokens, plus attention.
    pub prefill_flops: f64,
    /// The part of `prefill_flops` spent on attention scores and their weighted sum.
    pub prefill_attention_flops: f64,
    /// Prefill FLOPs relative to the first row.
    pub prefill_flops_rel: f64,
    /// Prefill FLOPs per token, relative to the first row: above 1 means each token of a
    /// long request costs more than a token of a short one.
    pub prefill_flops_per_token_rel: f64,
    /// KV memory x time per token, relative to the first row.
    pub kv_memory_time_per_token_rel: f64,
}

/// The long-context table for one model, format and set of devices.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServingTable {
    pub devices: Vec<Device>,
    /// Devices pooled per replica (tensor parallel); memory is multiplied, nothing else.
    pub devices_per_replica: u64,
    pub weights_bytes: u64,
    /// Memory left for KV caches on each device group after the weights (0 if they do not fit).
    pub free_bytes: Vec<u64>,
    pub kv_type: Format,
    pub rows: Vec<ServingRow>,
    /// What the table leaves out.
    pub caveat: String,
}

/// Context lengths for the table: powers of two from 4k (or less, for short models) up to
/// the maximum, the maximum itself, and `extra` (the user's context) if not already there.
pub fn contexts(max: u64, extra: Option<u64>) -> Vec<u64> {
    let mut start = 4096u64;
    while start > max && start > 1 {
        start /= 2;
    }
    let mut v = Vec::new();
    let mut c = start;
    while c <= max {
        v.push(c);
        c = match c.checked_mul(2) {
            Some(n) => n,
            None => break,
        };
    }
    if v.last() != Some(&max) {
        v.push(max);
    }
    if let Some(e) = extra
        && !v.contains(&e)
    {
        v.push(e);
        v.sort_unstable();
    }
    v
}

/// Query-key pairs a causal layer scores over `c` tokens, for a window `w` (or none).
fn causal_pairs(c: u64, w: Option<u64>) -> f64 {
    let c = c as f64;
    match w {
        Some(w) if (w as f64) < c => {
            let w = w as f64;
            // The first w queries see 1..w keys, the rest see w each.
            w * (w + 1.0) / 2.0 + (c - w) * w
        }
        _ => c * (c + 1.0) / 2.0,
    }
}

/// Attention FLOPs of a prefill over `c` tokens: per layer and head, 2 FLOPs per multiply-add
/// for the scores (qk dims) and for the weighted values (v dims), over the causal pairs.
pub fn prefill_attention_flops(desc: &ModelDesc, c: u64) -> f64 {
    let (dqk, dv) = desc.attention_dims();
    let per_pair = 2.0 * desc.n_heads as f64 * (dqk + dv) as f64;
    let (full, windowed, _) = split_layers(desc, c);
    let w = desc.sliding_window.as_ref().map(|s| s.window);
    per_pair * (full as f64 * causal_pairs(c, None) + windowed as f64 * causal_pairs(c, w))
}

/// Builds the table. `active_params` excludes the input embedding (a lookup, not a product).
#[allow(clippy::too_many_arguments)]
pub fn table(
    desc: &ModelDesc,
    shape: &KvShape,
    kv_type: Format,
    weights_bytes: u64,
    active_params: u64,
    devices: &[Device],
    devices_per_replica: u64,
    contexts: &[u64],
) -> Result<ServingTable> {
    let free: Vec<u64> = devices
        .iter()
        .map(|d| {
            (d.memory_bytes as u128 * devices_per_replica as u128)
                .saturating_sub(weights_bytes as u128)
                .min(u64::MAX as u128) as u64
        })
        .collect();
    let mut rows = Vec::new();
    let mut base: Option<(f64, f64, u64)> = None;
    for &c in contexts {
        let kv = to_u64(
            shape.bytes_per_sequence(desc, c, kv_type),
            "KV cache per sequence",
        )?;
        let sequences = free
            .iter()
            .map(|&f| f.checked_div(kv).unwrap_or(0))
            .collect();
        let memtime = kv as f64 * c as f64;
        let attn = prefill_attention_flops(desc, c);
        let flops = 2.0 * active_params as f64 * c as f64 + attn;
        let (m0, f0, c0) = *base.get_or_insert((memtime, flops, c));
        let per_tok = |v: f64, v0: f64| (v / c as f64) / (v0 / c0 as f64);
        rows.push(ServingRow {
            context: c,
            kv_bytes_per_sequence: kv,
            sequences,
            kv_memory_time_rel: memtime / m0,
            prefill_flops: flops,
            prefill_attention_flops: attn,
            prefill_flops_rel: flops / f0,
            prefill_flops_per_token_rel: per_tok(flops, f0),
            kv_memory_time_per_token_rel: per_tok(memtime, m0),
        });
    }
    Ok(ServingTable {
        devices: devices.to_vec(),
        devices_per_replica,
        weights_bytes,
        free_bytes: free,
        kv_type,
        rows,
        caveat: "Memory after the weights only: activations, runtime overhead and fragmentation \
                 are not subtracted, so real capacity is lower. Costs are relative to the first \
                 row, not seconds: memory x time assumes a request holds its cache for a time \
                 proportional to its length; FLOPs count prefill only."
            .into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::Catalog;

    #[test]
    fn estimate_contexts_span_4k_to_max() {
        assert_eq!(
            contexts(131072, None),
            [4096, 8192, 16384, 32768, 65536, 131072]
        );
        assert_eq!(contexts(163840, None).last(), Some(&163840));
        assert_eq!(contexts(2048, None), [2048]);
        assert_eq!(contexts(8192, Some(5000)), [4096, 5000, 8192]);
    }

    #[test]
    fn estimate_devices_resolve() {
        assert_eq!(Device::preset("H100-80GB").unwrap().memory_bytes, 80 << 30);
        assert_eq!(Device::preset("rtx-4090").unwrap().memory_bytes, 24 << 30);
        assert_eq!(Device::preset("h1").unwrap().name, "h100-80gb");
        assert!(Device::preset("a100").is_err(), "ambiguous");
        assert!(Device::preset("tpu").is_err());
    }

    #[test]
    fn estimate_long_context_fits_fewer_and_costs_more_per_token() {
        let d = Catalog::builtin().unwrap().describe("llama-3-8b").unwrap();
        let s = KvShape::of_model(&d);
        let dev = Device::preset("h100-80gb").unwrap();
        let weights = 16_060_522_496u64;
        let t = table(
            &d,
            &s,
            Format::F16,
            weights,
            7_000_000_000,
            &[dev],
            1,
            &contexts(8192, None),
        )
        .unwrap();
        // 8 KV heads x 128 x 32 layers x 2 x 2 B = 128 KiB per token; 4k = 512 MiB.
        assert_eq!(t.rows[0].kv_bytes_per_sequence, 512 << 20);
        let free = (80u64 << 30) - weights;
        assert_eq!(t.rows[0].sequences[0], free / (512 << 20));
        assert_eq!(t.rows[1].sequences[0], free / (1 << 30));
        assert_eq!(t.rows[1].kv_memory_time_rel, 4.0);
        assert!(t.rows[1].prefill_flops_per_token_rel > 1.0);
    }

    #[test]
    fn estimate_windowed_attention_flops_grow_linearly_past_window() {
        let d = Catalog::builtin()
            .unwrap()
            .describe("mistral-7b-v0.1")
            .unwrap();
        let a = prefill_attention_flops(&d, 16384);
        let b = prefill_attention_flops(&d, 32768);
        let w = 4096.0;
        let pairs = |c: f64| w * (w + 1.0) / 2.0 + (c - w) * w;
        assert!((b / a - pairs(32768.0) / pairs(16384.0)).abs() < 1e-12);
    }
}
