//! Column importance for weighted quantization (what llama.cpp's `llama-imatrix` measures): for
//! every weight matrix, the mean square of each input column over calibration text, `E[x_j²]`.
//! `quant::weighted` turns it into the weights of each block's least-squares fit, so rounding
//! spends its precision where activations are large.
//!
//! The statistics are the ones pruning already gathers (`prune::stats`: Wanda's `||x_j||²` is
//! the same sum), taken from the model's own forward pass over windows of the text.

use std::collections::HashMap;

use crate::model::Model;

use super::SurgeryError;
use super::prune::stats::{self, MATRICES, site_index};

/// Per weight matrix (by GGUF tensor name), the mean square of each input column.
#[derive(Clone, Debug, Default)]
pub struct Importance {
    /// Calibration tokens the means are over.
    pub tokens: usize,
    columns: HashMap<String, Vec<f32>>,
}

impl Importance {
    /// Runs `tokens` through `model` in windows of `ctx` (whole windows only) and keeps, for
    /// each layer's attention and FFN matrices, `E[x_j²]` of their input columns.
    pub fn collect(model: &Model, tokens: &[u32], ctx: usize) -> Result<Self, SurgeryError> {
        let s = stats::collect(model, tokens, ctx, false)?;
        let mut columns = HashMap::new();
        for (layer, inputs) in s.inputs.iter().enumerate() {
            for (suffix, site) in MATRICES {
                let i = site_index(site).expect("matrix inputs are input sites");
                let st = &inputs[i];
                if st.rows == 0 {
                    continue;
                }
                let mean: Vec<f32> = st.sq.iter().map(|&v| (v / st.rows as f64) as f32).collect();
                columns.insert(format!("blk.{layer}.{suffix}.weight"), mean);
            }
        }
        Ok(Importance {
            tokens: s.tokens,
            columns,
        })
    }

    /// Reads llama.cpp's imatrix file (the GGUF that `llama-imatrix` writes): per matrix
    /// `NAME.in_sum2` (sums of squared inputs, one row per expert) and `NAME.counts` (rows
    /// summed per expert). Experts are pooled: the importance is `Σ in_sum2 / Σ counts`.
    pub fn read_llama_imatrix(path: &std::path::Path) -> Result<Self, SurgeryError> {
        let f = crate::gguf::GgufFile::open(path)?;
        let bad = |m: String| SurgeryError::Invalid(format!("{}: {m}", path.display()));
        let mut out = Importance::default();
        for info in f.tensors() {
            let Some(name) = info.name.strip_suffix(".in_sum2") else {
                continue;
            };
            let read = |n: &str| -> Result<Vec<f32>, SurgeryError> {
                let (i, bytes) = f.tensor(n)?;
                crate::quant::dequantize_to_vec(i.ty, bytes, i.n_elements() as usize)
                    .map_err(|e| SurgeryError::Quant(n.to_string(), e))
            };
            let sums = read(&info.name)?;
            let counts = read(&format!("{name}.counts"))?;
            let cols = info.dims.first().copied().unwrap_or(0) as usize;
            if cols == 0 || counts.is_empty() || sums.len() != cols * counts.len() {
                return Err(bad(format!(
                    "{}: {} sums for {} experts of {cols} columns",
                    info.name,
                    sums.len(),
                    counts.len()
                )));
            }
            let total: f64 = counts.iter().map(|&c| f64::from(c)).sum();
            // Never reached by the calibration text (or a count that is not a number).
            if total.is_nan() || total <= 0.0 {
                continue;
            }
            let mut mean = vec![0f64; cols];
            for e in sums.chunks_exact(cols) {
                for (m, &v) in mean.iter_mut().zip(e) {
                    *m += f64::from(v);
                }
            }
            out.tokens = out.tokens.max(total as usize);
            out.insert(name, mean.iter().map(|&v| (v / total) as f32).collect());
        }
        if out.is_empty() {
            return Err(bad(
                "no NAME.in_sum2 tensors: not a llama.cpp imatrix GGUF".into()
            ));
        }
        Ok(out)
    }

    /// The importance of `tensor`'s input columns, if measured.
    pub fn get(&self, tensor: &str) -> Option<&[f32]> {
        self.columns.get(tensor).map(|v| v.as_slice())
    }

    /// Sets the importance of `tensor`'s input columns (from another measurement, or made up
    /// for a comparison).
    pub fn insert(&mut self, tensor: &str, columns: Vec<f32>) {
        self.columns.insert(tensor.to_string(), columns);
    }

    /// The same matrices with every column equally important: weighted encoding then differs
    /// from plain only by its search over scales, which isolates what the statistics buy.
    pub fn uniform(&self) -> Self {
        Importance {
            tokens: self.tokens,
            columns: self
                .columns
                .iter()
                .map(|(k, v)| (k.clone(), vec![1.0; v.len()]))
                .collect(),
        }
    }

    /// Matrices measured.
    pub fn len(&self) -> usize {
        self.columns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufWriter, TensorData, Value};
    use crate::quant::GgmlType;
    use std::borrow::Cow;

    fn f32_tensor(name: &str, dims: Vec<u64>, v: &[f32]) -> TensorData<'static> {
        TensorData {
            name: name.into(),
            dims,
            ty: GgmlType::F32,
            data: Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        }
    }

    /// A file laid out as `llama-imatrix` writes it (a dense matrix, and an MoE matrix whose
    /// two experts saw different numbers of rows) reads back as pooled means; a file without
    /// the tensors is refused.
    #[test]
    fn llama_cpp_imatrix_files_read_as_pooled_means() {
        let dir = std::env::temp_dir().join(format!("frugal-imatrix-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("imatrix.gguf");
        let mut w = GgufWriter::new();
        w.set("general.type", Value::String("imatrix".into()));
        w.tensors.push(f32_tensor(
            "blk.0.ffn_up.weight.in_sum2",
            vec![4, 1],
            &[4.0, 8.0, 0.0, 2.0],
        ));
        w.tensors
            .push(f32_tensor("blk.0.ffn_up.weight.counts", vec![1, 1], &[2.0]));
        w.tensors.push(f32_tensor(
            "blk.0.ffn_up_exps.weight.in_sum2",
            vec![2, 2],
            &[1.0, 3.0, 5.0, 7.0],
        ));
        w.tensors.push(f32_tensor(
            "blk.0.ffn_up_exps.weight.counts",
            vec![1, 2],
            &[1.0, 3.0],
        ));
        w.write_file(&path).unwrap();
        let imp = Importance::read_llama_imatrix(&path).unwrap();
        assert_eq!(imp.len(), 2);
        assert_eq!(
            imp.get("blk.0.ffn_up.weight").unwrap(),
            &[2.0, 4.0, 0.0, 1.0]
        );
        assert_eq!(imp.get("blk.0.ffn_up_exps.weight").unwrap(), &[1.5, 2.5]);

        let mut w = GgufWriter::new();
        w.tensors
            .push(f32_tensor("blk.0.ffn_up.weight", vec![4], &[0.0; 4]));
        w.write_file(&path).unwrap();
        let e = Importance::read_llama_imatrix(&path)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a llama.cpp imatrix"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
