//! The outlier problem, measured: how heavy-tailed each weight tensor is, what that does to the
//! quantization error of each scaling scheme, and which activation channels dominate on a text.
//!
//! Quantization error is reported as SNR (dB): 10 log10 of signal energy over error energy, so
//! +6 dB is one more bit of effective precision. A per-tensor scale is set by the single largest
//! value; when that value is hundreds of RMS units out, every ordinary value is rounded on a grid
//! far too coarse for it, and the SNR collapses. Per-channel and per-block scales confine the
//! damage; FP8 trades precision (E4M3) against range (E5M2) instead.

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model::{Logits, Model, Observer, Scratch, Site};
use crate::quant::research::{Moments, SimFormat, moments, snr_db};
use crate::quant::{self, GgmlType};

/// The schemes every tensor is measured under.
pub const SCHEMES: &[&str] = &[
    "int8-tensor",
    "int8-channel",
    "int8-b32",
    "int4-tensor",
    "int4-channel",
    "int4-b32",
    "fp8-e4m3-tensor",
    "fp8-e5m2-tensor",
    "fp8-e4m3-b32",
    "fp8-e5m2-b32",
];

#[derive(Clone, Debug, serde::Serialize)]
pub struct SchemeSnr {
    pub scheme: String,
    /// Storage cost with f16 group scales.
    pub bits_per_weight: f64,
    /// Quantization SNR in dB (null in JSON when the reconstruction is exact).
    pub snr_db: f64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct TensorAnalysis {
    pub name: String,
    pub stored_type: String,
    pub rows: usize,
    pub cols: usize,
    #[serde(flatten)]
    pub moments: Moments,
    pub snr: Vec<SchemeSnr>,
}

impl TensorAnalysis {
    pub fn snr(&self, scheme: &str) -> Option<f64> {
        self.snr
            .iter()
            .find(|s| s.scheme == scheme)
            .map(|s| s.snr_db)
    }
}

/// Measures one matrix (row-major, rows of `cols`) under every scheme of [`SCHEMES`].
pub fn analyze_tensor(
    name: &str,
    ty: GgmlType,
    x: &[f32],
    rows: usize,
    cols: usize,
) -> TensorAnalysis {
    let snr = SCHEMES
        .iter()
        .map(|s| {
            let f = SimFormat::parse(s).expect("SCHEMES are valid names");
            SchemeSnr {
                scheme: s.to_string(),
                bits_per_weight: f.bits_per_weight(cols),
                snr_db: snr_db(x, &f.fake_quantize(x, cols)),
            }
        })
        .collect();
    TensorAnalysis {
        name: name.to_string(),
        stored_type: ty.name().to_string(),
        rows,
        cols,
        moments: moments(x),
        snr,
    }
}

/// Measures every matrix (2-D tensor) of a model file whose type frugal can decode.
/// `progress(done, total)` is called after each.
pub fn analyze_weights(
    file: &GgufFile,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<TensorAnalysis>> {
    let mats: Vec<_> = file
        .tensors()
        .iter()
        .filter(|t| t.dims.len() == 2 && quant::is_supported(t.ty))
        .collect();
    let mut out = Vec::with_capacity(mats.len());
    for (i, t) in mats.iter().enumerate() {
        let x = quant::dequantize_to_vec(t.ty, file.tensor_bytes(t), t.n_elements() as usize)
            .map_err(|e| Error::Invalid(format!("tensor {:?}: {e}", t.name)))?;
        out.push(analyze_tensor(&t.name, t.ty, &x, t.n_rows(), t.row_len()));
        progress(i + 1, mats.len());
    }
    Ok(out)
}

/// Per-channel magnitudes of one activation site, accumulated over tokens.
#[derive(Clone, Debug, Default)]
struct SiteAcc {
    width: usize,
    rows: usize,
    absmax: Vec<f32>,
    sumsq: Vec<f64>,
    signal: f64,
    /// Error energy of 8-bit quantization with one scale per token (row).
    err_token: f64,
    /// Error energy of 8-bit quantization with one scale per block of 32 (`--activations q8`).
    err_block: f64,
}

/// Error energy of symmetric INT8 with one absmax scale over `g`.
fn int8_err(g: &[f32]) -> f64 {
    let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return 0.0;
    }
    let s = amax / 127.0;
    g.iter()
        .map(|&v| f64::from(v - (v / s).round() * s).powi(2))
        .sum()
}

/// Records activation statistics through [`Model::forward_observed`].
#[derive(Default)]
pub struct ActivationRecorder {
    sites: BTreeMap<(usize, SiteKey), SiteAcc>,
}

/// `Site` in a fixed order for sorting.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct SiteKey(u8);

fn key(s: Site) -> SiteKey {
    SiteKey(match s {
        Site::AttnInput => 0,
        Site::AttnOutput => 1,
        Site::FfnInput => 2,
        Site::FfnDownInput => 3,
        Site::LayerOutput => 4,
    })
}

fn site_of(k: SiteKey) -> Site {
    [
        Site::AttnInput,
        Site::AttnOutput,
        Site::FfnInput,
        Site::FfnDownInput,
        Site::LayerOutput,
    ][k.0 as usize]
}

impl Observer for ActivationRecorder {
    fn observe(&mut self, layer: usize, site: Site, x: &[f32], width: usize) {
        // Only the inputs of matrix products are quantized; the residual stream is not.
        if site == Site::LayerOutput {
            return;
        }
        let acc = self.sites.entry((layer, key(site))).or_default();
        if acc.width == 0 {
            acc.width = width;
            acc.absmax = vec![0.0; width];
            acc.sumsq = vec![0.0; width];
        }
        for row in x.chunks_exact(width) {
            acc.rows += 1;
            for (c, &v) in row.iter().enumerate() {
                acc.absmax[c] = acc.absmax[c].max(v.abs());
                acc.sumsq[c] += f64::from(v) * f64::from(v);
            }
            acc.signal += row
                .iter()
                .map(|&v| f64::from(v) * f64::from(v))
                .sum::<f64>();
            acc.err_token += int8_err(row);
            acc.err_block += row.chunks(32).map(int8_err).sum::<f64>();
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ChannelMagnitude {
    pub channel: usize,
    pub absmax: f32,
    pub rms: f64,
    /// This channel's absmax over the median channel's absmax.
    pub over_median: f64,
}

/// One activation site of one layer.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SiteReport {
    pub layer: usize,
    pub site: Site,
    pub width: usize,
    pub tokens: usize,
    pub rms: f64,
    pub absmax: f32,
    pub absmax_over_rms: f64,
    /// Channels whose absmax is at least [`DOMINANT_FACTOR`] times the median channel's, largest
    /// first (at most 8 listed).
    pub dominant: Vec<ChannelMagnitude>,
    /// How many channels pass that threshold in all.
    pub n_dominant: usize,
    /// SNR of INT8 activations with one scale per token.
    pub int8_per_token_snr_db: f64,
    /// SNR of INT8 activations with one scale per block of 32 (what `--activations q8` does).
    pub int8_per_block32_snr_db: f64,
}

/// A channel "dominates" when its largest magnitude is this many times the median channel's
/// (LLM.int8() used an absolute 6.0 on models whose typical activations are near 1; a ratio is
/// independent of the model's scale).
pub const DOMINANT_FACTOR: f64 = 6.0;

fn db(signal: f64, err: f64) -> f64 {
    if err == 0.0 {
        f64::INFINITY
    } else {
        10.0 * (signal / err).log10()
    }
}

impl ActivationRecorder {
    /// The per-site reports, in layer order.
    pub fn reports(&self) -> Vec<SiteReport> {
        self.sites
            .iter()
            .map(|(&(layer, k), a)| {
                let n = a.rows.max(1) as f64;
                let mut sorted: Vec<f32> = a.absmax.clone();
                sorted.sort_by(f32::total_cmp);
                let median = f64::from(sorted[sorted.len() / 2]).max(f64::MIN_POSITIVE);
                let mut dominant: Vec<ChannelMagnitude> = a
                    .absmax
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| f64::from(**m) >= DOMINANT_FACTOR * median)
                    .map(|(c, &m)| ChannelMagnitude {
                        channel: c,
                        absmax: m,
                        rms: (a.sumsq[c] / n).sqrt(),
                        over_median: f64::from(m) / median,
                    })
                    .collect();
                dominant.sort_by(|x, y| y.absmax.total_cmp(&x.absmax));
                let n_dominant = dominant.len();
                dominant.truncate(8);
                let rms = (a.signal / (n * a.width as f64)).sqrt();
                let absmax = sorted.last().copied().unwrap_or(0.0);
                SiteReport {
                    layer,
                    site: site_of(k),
                    width: a.width,
                    tokens: a.rows,
                    rms,
                    absmax,
                    absmax_over_rms: if rms > 0.0 {
                        f64::from(absmax) / rms
                    } else {
                        0.0
                    },
                    dominant,
                    n_dominant,
                    int8_per_token_snr_db: db(a.signal, a.err_token),
                    int8_per_block32_snr_db: db(a.signal, a.err_block),
                }
            })
            .collect()
    }
}

/// Runs `tokens` (at most `n_ctx` at a time, from an empty cache each time) through the model
/// and records the inputs of every matrix product.
pub fn record_activations(model: &Model, tokens: &[u32], n_ctx: usize) -> Result<Vec<SiteReport>> {
    if tokens.is_empty() {
        return Err(Error::EmptyInput);
    }
    let n_ctx = n_ctx.max(1);
    let mut rec = ActivationRecorder::default();
    let mut kv = model.new_cache(n_ctx)?;
    let mut scratch = Scratch::default();
    for chunk in tokens.chunks(n_ctx) {
        kv.clear();
        model.forward_observed(chunk, &mut kv, &mut scratch, Logits::Last, Some(&mut rec))?;
    }
    Ok(rec.reports())
}

/// Channels that dominate at the same site in many layers: (site, channel, layers), most
/// frequent first. Persistent outlier channels are what make per-tensor activation scales fail.
pub fn recurring_channels(reports: &[SiteReport]) -> Vec<(Site, usize, usize)> {
    let mut counts: BTreeMap<(SiteKey, usize), usize> = BTreeMap::new();
    for r in reports {
        for c in &r.dominant {
            *counts.entry((key(r.site), c.channel)).or_default() += 1;
        }
    }
    let mut v: Vec<(Site, usize, usize)> = counts
        .into_iter()
        .map(|((k, c), n)| (site_of(k), c, n))
        .collect();
    v.sort_by(|a, b| b.2.cmp(&a.2).then(a.1.cmp(&b.1)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planted_outlier_shows_in_every_figure() {
        let (rows, cols) = (256, 256);
        let mut x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32 * 0.754_877_7).fract() - 0.5) * 0.1)
            .collect();
        let clean = analyze_tensor("w", GgmlType::F32, &x, rows, cols);
        x[777] = 10.0;
        let spiked = analyze_tensor("w", GgmlType::F32, &x, rows, cols);
        let (ct, st) = (
            clean.snr("int8-tensor").unwrap(),
            spiked.snr("int8-tensor").unwrap(),
        );
        let sb = spiked.snr("int8-b32").unwrap();
        // Uniform values of absmax 0.05 (energy 54.6 in all) and one of 10.0 (energy 100): the
        // per-tensor step becomes 10/127 ~ 0.08, every other value rounds to zero, and the SNR
        // falls from ~48 dB to 10 log10(154.6 / 54.6) ~ 4.5 dB. Per block, only the outlier's
        // 31 neighbours are lost: 10 log10(154.6 / 0.026) ~ 38 dB.
        assert!(
            ct > 40.0 && st < 10.0,
            "clean {ct:.1} dB, spiked {st:.1} dB"
        );
        assert!(sb > 25.0, "per-block {sb:.1} dB");
        assert!(spiked.moments.absmax_over_rms > 50.0);
    }

    #[test]
    fn recorder_finds_a_dominant_channel() {
        let mut rec = ActivationRecorder::default();
        let width = 256;
        for layer in 0..3 {
            let x: Vec<f32> = (0..4 * width)
                .map(|i| {
                    let c = i % width;
                    if c == 17 {
                        40.0
                    } else {
                        ((i * 13 % 7) as f32 - 3.0) * 0.3
                    }
                })
                .collect();
            rec.observe(layer, Site::FfnInput, &x, width);
        }
        let reports = rec.reports();
        assert_eq!(reports.len(), 3);
        for r in &reports {
            assert_eq!(r.tokens, 4);
            assert_eq!(r.n_dominant, 1, "{r:?}");
            assert_eq!(r.dominant[0].channel, 17);
            // Per-token scales are set by the outlier channel, so all 255 other channels round on
            // a step of 40/127; per-block scales only do that to the outlier's 31 block mates:
            // about 8x less error energy, 9 dB.
            assert!(
                r.int8_per_block32_snr_db > r.int8_per_token_snr_db + 6.0,
                "{r:?}"
            );
        }
        assert_eq!(recurring_channels(&reports)[0], (Site::FfnInput, 17, 3));
    }
}
