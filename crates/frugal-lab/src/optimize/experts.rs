//! The mixture-of-experts stage of the ladder, pulled only when asked for (`--levers moe`):
//! activate less of the FFN per token.
//!
//! The dense FFN is split into a shared expert (the neurons most often active on the
//! calibration text) and routed experts grouped by co-activation, with routers fitted on the
//! same text, as `frugal moefy --shared` makes them (`crate::moe::Variant`). The split does
//! not compute the same function, so its quality usually wants healing
//! ([`super::distill`]), and whether fewer active neurons decode faster is a property of this
//! CPU's kernels, so each variant passes the same gate as a cut: timed against its dense twin
//! in the same format, taken at [`super::prune::REWARD`] or more. Experts are split from float
//! FFN weights, so the stage precedes quantization and has no "after" order.

use anyhow::{Result, ensure};
use frugal::gguf::GgufFile;
use frugal::model::Config;
use frugal::quant::GgmlType;

use super::prune::{Calibration, Trial};
use super::quant::type_name;
use super::recipe::Stage;
use crate::moe::Variant;

/// Routed experts, and how many a token runs.
const EXPERTS: usize = 8;
const ACTIVE: usize = 2;

/// The seed of the split's k-means and router fits.
pub const SEED: u64 = 1;

/// The variants worth timing on this shape, each with its gate: a shared expert of a third and
/// of a sixth of the FFN beside 8 routed experts, 2 per token (half and three eighths of the
/// neurons active). A split without a shared expert is not tried: on SmolLM2 it multiplied
/// perplexity by thousands (`docs/moefy.md`). Also the reasons the stage takes none.
pub fn trials(c: &Config, float_base: bool) -> (Vec<Trial>, Vec<String>) {
    if c.moe.is_some() {
        return (
            Vec::new(),
            vec!["moe: the model already routes its FFN".into()],
        );
    }
    if !float_base {
        return (
            Vec::new(),
            vec!["moe: experts are split from float FFN weights; this base is quantized".into()],
        );
    }
    let q8 = type_name(GgmlType::Q8_0);
    let mut out = Vec::new();
    let mut refused = Vec::new();
    for part in [3, 6] {
        let shared = c.n_ff / part / 32 * 32;
        let routed = c.n_ff - shared;
        let spec = format!("s{shared}+{EXPERTS}x{ACTIVE}");
        if shared == 0 || !routed.is_multiple_of(EXPERTS * 32) {
            refused.push(format!(
                "moe {spec}: {routed} routed neurons do not split into {EXPERTS} experts of whole 32-blocks"
            ));
            continue;
        }
        out.push(Trial {
            cut: Stage::Moe {
                variant: spec,
                seed: SEED,
            },
            format: q8.clone(),
            dense: q8.clone(),
        });
    }
    (out, refused)
}

/// `file` with its FFN split as `variant` says, from the activations of `cal`'s first tokens.
pub fn apply(file: &GgufFile, variant: &str, cal: &Calibration, seed: u64) -> Result<GgufFile> {
    let v: Variant = variant.parse().map_err(anyhow::Error::msg)?;
    let tokens = cal.for_cuts();
    ensure!(
        cal.ctx > 0 && tokens.len() >= cal.ctx,
        "moe {variant}: needs calibration text (at least one window of {} tokens)",
        cal.ctx
    );
    let dense = crate::build::load_file(GgufFile::from_bytes(file.raw_bytes().to_vec())?, false)?;
    let built = v.build(&dense, tokens, cal.ctx, seed)?;
    Ok(GgufFile::from_bytes(built.bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(n_ff: usize) -> Config {
        use frugal::model::synthetic::{SyntheticSpec, build};
        let bytes = build(&SyntheticSpec {
            n_ff,
            ..Default::default()
        });
        crate::build::load(bytes, false).unwrap().config
    }

    #[test]
    fn variants_follow_the_ffn_width_and_refuse_what_cannot_split() {
        let (t, r) = trials(&config(1536), true);
        let names: Vec<String> = t.iter().map(|t| t.cut.to_string()).collect();
        assert_eq!(names, ["moe s512+8x2 seed 1", "moe s256+8x2 seed 1"]);
        assert!(r.is_empty());
        let (t, r) = trials(&config(512), true);
        // 512 - 160 = 352 is not 8 experts of whole 32-blocks; 512 - 64 = 448 is not either.
        assert!(t.is_empty(), "{t:?}");
        assert_eq!(r.len(), 2);
        let (t, r) = trials(&config(1536), false);
        assert!(t.is_empty() && r[0].contains("quantized"));
    }
}
