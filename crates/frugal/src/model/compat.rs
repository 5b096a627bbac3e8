//! Which engines can run a file: whether frugal loads it (or the one line saying why not,
//! naming the key or tensor), and what llama.cpp (the build frugal is compared with) refuses in
//! it or computes differently. Files frugal writes itself (surgery, compressed types) can hold
//! things only frugal runs; `frugal info` says so before a user finds out from another engine.

use super::{Config, Weights};
use crate::gguf::GgufFile;

/// What runs the file.
#[derive(Clone, Debug, PartialEq)]
pub struct Compatibility {
    /// `Err` holds frugal's refusal.
    pub frugal: Result<(), String>,
    /// Why llama.cpp refuses to load the file (empty: it loads).
    pub llama_cpp_refuses: Vec<String>,
    /// Where llama.cpp loads the file but computes another model.
    pub llama_cpp_differs: Vec<String>,
}

/// Checks `f` against frugal's loader and llama.cpp's known limits.
pub fn check(f: &GgufFile) -> Compatibility {
    let config = Config::from_gguf(f);
    let frugal = match &config {
        Ok(c) => Weights::load(f, c).map(|_| ()).map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    let mut refuses = Vec::new();
    let mut differs = Vec::new();
    let arch = f.str("general.architecture").unwrap_or("");
    let mut types: Vec<_> = Vec::new();
    for t in f.tensors() {
        if t.ty.frugal_only() && !types.contains(&t.ty) {
            types.push(t.ty);
            refuses.push(format!(
                "tensor type {} (first in {}) is frugal's own",
                t.ty, t.name
            ));
        }
    }
    if arch == "llama" {
        // llama.cpp's `llama` graph has routed experts only: a shared expert or a selection
        // bias is a tensor it does not expect, and it refuses the file.
        for (suffix, what) in [
            ("ffn_gate_shexp.weight", "shared experts"),
            ("exp_probs_b.bias", "an expert selection bias"),
        ] {
            if let Some(t) = f.tensors().iter().find(|t| t.name.ends_with(suffix)) {
                refuses.push(format!(
                    "{what} ({}): llama.cpp's llama architecture has none",
                    t.name
                ));
            }
        }
        if let Ok(Some(w)) = f.u32_opt("llama.attention.sliding_window")
            && w > 0
        {
            differs.push(format!(
                "llama.attention.sliding_window = {w}: llama.cpp ignores a window in a llama \
                 file and attends to every earlier position (frugal applies it, as the model \
                 was trained)"
            ));
        }
    }
    if let Ok(c) = &config
        && let Some(m) = c.moe
        && !m.llama_cpp_compatible()
        && arch == "llama"
    {
        differs.push(format!(
            "expert routing ({:?} gating, renormalized {}, scale {}): llama.cpp's llama \
             architecture routes by softmax, renormalized, unscaled",
            m.gating, m.norm_weights, m.weights_scale
        ));
    }
    Compatibility {
        frugal,
        llama_cpp_refuses: refuses,
        llama_cpp_differs: differs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, Value};
    use crate::model::moe::Gating;
    use crate::model::synthetic::{SyntheticMoe, SyntheticSpec, build};

    fn check_bytes(bytes: Vec<u8>) -> Compatibility {
        check(&GgufFile::from_bytes(bytes).unwrap())
    }

    #[test]
    fn what_llama_cpp_cannot_run_is_named() {
        let plain = check_bytes(build(&SyntheticSpec::default()));
        assert_eq!(plain.frugal, Ok(()));
        assert!(plain.llama_cpp_refuses.is_empty() && plain.llama_cpp_differs.is_empty());

        // Shared experts in a `llama` file (what `moefy --shared` writes): frugal runs it,
        // llama.cpp refuses it, naming the tensor.
        let moe = SyntheticMoe {
            n_expert: 4,
            n_used: 2,
            gating: Gating::Softmax,
            n_ff_shared: 32,
            selection_bias: false,
        };
        let spec = SyntheticSpec {
            moe: Some(moe),
            ..Default::default()
        };
        let shared = check_bytes(build(&spec));
        assert_eq!(shared.frugal, Ok(()));
        assert_eq!(shared.llama_cpp_refuses.len(), 1);
        assert!(shared.llama_cpp_refuses[0].contains("blk.0.ffn_gate_shexp.weight"));

        // A window in a `llama` file: llama.cpp loads it and attends past the window.
        let f = GgufFile::from_bytes(build(&SyntheticSpec::default())).unwrap();
        let mut w = GgufWriter::from_file(&f);
        w.set("llama.attention.sliding_window", Value::U32(8));
        let windowed = check_bytes(w.to_bytes().unwrap());
        assert!(windowed.llama_cpp_refuses.is_empty());
        assert!(windowed.llama_cpp_differs[0].contains("sliding_window = 8"));

        // A file frugal refuses says why, naming the key.
        let mut w = GgufWriter::from_file(&f);
        w.set("general.architecture", Value::String("falcon".into()));
        let bad = check_bytes(w.to_bytes().unwrap());
        assert!(bad.frugal.unwrap_err().contains("falcon"));
    }
}
