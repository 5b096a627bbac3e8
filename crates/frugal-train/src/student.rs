//! Students: the teacher with layers dropped (chosen by measured importance), a different
//! architecture given as a config, any GGUF frugal runs, or the teacher itself.

use std::path::Path;

use frugal::model::Config;

use crate::data::Windows;
use crate::error::{Result, TrainError, io_err};
use crate::gemm::Precision;
use crate::loss::Targets;
use crate::model::{Batch, RunOptions};
use crate::params::{AttnBiases, LayerParams, Params};

/// How a layer's importance is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Importance {
    /// The increase of the loss on calibration text when the layer is skipped.
    LossIncrease,
    /// Block influence (ShortGPT): `1 - cos(input, output)` of the layer, averaged over tokens.
    BlockInfluence,
}

impl std::str::FromStr for Importance {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "loss" => Ok(Importance::LossIncrease),
            "bi" | "block-influence" => Ok(Importance::BlockInfluence),
            _ => Err(format!("unknown importance {s:?}: use loss or bi")),
        }
    }
}

/// Each layer's importance on `calib` (a few windows).
pub fn layer_importance(
    p: &mut Params,
    calib: &Windows,
    how: Importance,
    prec: Precision,
) -> Vec<f64> {
    let seq = calib.seq;
    let inputs: Vec<u32> = (0..calib.len())
        .flat_map(|i| calib.get(i)[..seq].to_vec())
        .collect();
    let labels: Vec<u32> = (0..calib.len())
        .flat_map(|i| calib.get(i)[1..].to_vec())
        .collect();
    let b = Batch {
        tokens: &inputs,
        batch: calib.len(),
        seq,
    };
    let obj = Targets::hard(&labels);
    match how {
        Importance::LossIncrease => {
            let base = p.loss(&b, &obj, prec).mean_ce();
            (0..p.layers.len())
                .map(|l| {
                    // Skip layer l by taking it out (a move, not a copy) and putting it back.
                    let layer = p.layers.remove(l);
                    p.config.n_layers -= 1;
                    let loss = p.loss(&b, &obj, prec).mean_ce();
                    p.layers.insert(l, layer);
                    p.config.n_layers += 1;
                    loss - base
                })
                .collect()
        }
        Importance::BlockInfluence => {
            let s = p.forward(
                &b,
                RunOptions {
                    precision: prec,
                    recompute: true,
                    ..RunOptions::default()
                },
            );
            let d = p.config.n_embd;
            (0..p.layers.len())
                .map(|l| {
                    let (x, y) = (&s.residual[l], &s.residual[l + 1]);
                    let rows = x.len() / d;
                    let total: f64 = x
                        .chunks_exact(d)
                        .zip(y.chunks_exact(d))
                        .map(|(a, b)| {
                            let dot: f64 = a
                                .iter()
                                .zip(b)
                                .map(|(&u, &v)| f64::from(u) * f64::from(v))
                                .sum();
                            let na: f64 =
                                a.iter().map(|&u| f64::from(u).powi(2)).sum::<f64>().sqrt();
                            let nb: f64 =
                                b.iter().map(|&u| f64::from(u).powi(2)).sum::<f64>().sqrt();
                            1.0 - dot / (na * nb).max(1e-30)
                        })
                        .sum();
                    total / rows as f64
                })
                .collect()
        }
    }
}

/// The `n` most important layers, in their original order. The first and last layers are
/// always kept (they map embeddings into and out of the residual stream), as DistilBERT's and
/// most depth-pruning recipes do.
pub fn choose_layers(importance: &[f64], n: usize) -> Vec<usize> {
    let l = importance.len();
    if n >= l {
        return (0..l).collect();
    }
    let mut keep: Vec<usize> = vec![0];
    if n > 1 {
        keep.push(l - 1);
    }
    let mut rest: Vec<usize> = (1..l.saturating_sub(1)).collect();
    rest.sort_by(|&a, &b| importance[b].total_cmp(&importance[a]).then(a.cmp(&b)));
    keep.extend(rest.into_iter().take(n.saturating_sub(keep.len())));
    keep.sort();
    keep
}

/// The teacher with only `keep` layers (renumbered), the rest of its tensors copied.
pub fn keep_layers(teacher: &Params, keep: &[usize]) -> Result<Params> {
    if keep.is_empty() {
        return Err(TrainError::Invalid(
            "a student needs at least one layer".into(),
        ));
    }
    if let Some(&bad) = keep.iter().find(|&&l| l >= teacher.layers.len()) {
        return Err(TrainError::Invalid(format!(
            "layer {bad} does not exist: the teacher has {}",
            teacher.layers.len()
        )));
    }
    let mut p = teacher.clone();
    p.layers = keep
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            let mut layer = teacher.layers[l].clone();
            layer.renumber(i);
            layer
        })
        .collect();
    p.config.n_layers = keep.len();
    refuse_unkept_query_scale(&teacher.config, &p.config)?;
    Ok(p)
}

/// A query scale of a family's own is not in the file: llama.cpp (and frugal) give Gemma 3 27B
/// its scale by its layer count, so a student of another shape would train with the scale and
/// load without it. Refused by name rather than saved as another model.
fn refuse_unkept_query_scale(teacher: &Config, student: &Config) -> Result<()> {
    let shape = |c: &Config| (c.n_layers, c.n_embd, c.n_head);
    if teacher.features.query_scale.is_some() && shape(teacher) != shape(student) {
        return Err(TrainError::Shape(format!(
            "{}'s query scale comes from its shape ({} layers, width {}, {} heads), not from \
             the file; a student of another shape would not keep it",
            teacher.arch, teacher.n_layers, teacher.n_embd, teacher.n_head
        )));
    }
    Ok(())
}

/// The suffix of a block tensor's name after `blk.N.` (the whole name elsewhere).
fn block_suffix(name: &str) -> &str {
    match name.strip_prefix("blk.") {
        Some(rest) => rest.split_once('.').map_or(name, |(_, s)| s),
        None => name,
    }
}

/// Gives block `l` of a student of configuration `c` the attention biases `t` (a teacher's
/// block) has, at zero: the same optional tensors, so the student's file is of the teacher's
/// kind and the teacher's values can be copied.
fn same_biases(lp: &mut LayerParams, t: &LayerParams, c: &Config, l: usize) {
    let b = |s: &str, has: bool, n: usize| {
        has.then(|| crate::Tensor::vector(format!("blk.{l}.{s}.bias"), n))
    };
    let tb = &t.biases;
    lp.biases = AttnBiases {
        q: b("attn_q", tb.q.is_some(), c.q_dim()),
        k: b("attn_k", tb.k.is_some(), c.kv_dim()),
        v: b("attn_v", tb.v.is_some(), c.kv_dim()),
        o: b("attn_output", tb.o.is_some(), c.n_embd),
    };
}

/// A student architecture: the fields it sets replace the teacher's.
#[derive(Clone, Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StudentConfig {
    pub n_layers: Option<usize>,
    pub n_embd: Option<usize>,
    pub n_ff: Option<usize>,
    pub n_head: Option<usize>,
    pub n_head_kv: Option<usize>,
    pub head_dim: Option<usize>,
    /// `random`, or `teacher` (the default): every tensor from the teacher's (layers mapped
    /// evenly over its depth), whole where shapes match, its leading rows and columns where the
    /// student is narrower; random where the student is wider.
    #[serde(default)]
    pub init: Option<String>,
}

impl StudentConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(io_err(path))?;
        serde_json::from_str(&text)
            .map_err(|e| TrainError::Invalid(format!("{}: {e}", path.display())))
    }

    /// The student's full configuration, checked for consistency; errors name the shapes.
    pub fn resolve(&self, teacher: &Config) -> Result<Config> {
        if teacher.mla.is_some()
            && (self.n_embd.is_some()
                || self.n_head.is_some()
                || self.n_head_kv.is_some()
                || self.head_dim.is_some())
        {
            return Err(TrainError::Shape(
                "a latent-attention teacher's students keep its width and heads (only n_layers \
                 and n_ff may change); convert the student's attention with frugal convert"
                    .into(),
            ));
        }
        let mut c = teacher.clone();
        c.n_layers = self.n_layers.unwrap_or(c.n_layers);
        c.n_embd = self.n_embd.unwrap_or(c.n_embd);
        c.n_ff = self.n_ff.unwrap_or(c.n_ff);
        c.n_head = self.n_head.unwrap_or(c.n_head);
        c.n_head_kv = self.n_head_kv.unwrap_or(c.n_head_kv.min(c.n_head));
        c.head_dim = match (self.head_dim, self.n_embd, self.n_head) {
            (Some(h), _, _) => h,
            (None, None, None) => teacher.head_dim,
            _ => c.n_embd / c.n_head.max(1),
        };
        let err = |m: String| Err(TrainError::Shape(m));
        if c.n_layers == 0 || c.n_embd == 0 || c.n_ff == 0 || c.n_head == 0 || c.n_head_kv == 0 {
            return err(format!(
                "layers {}, width {}, FFN {}, heads {}/{} must all be positive",
                c.n_layers, c.n_embd, c.n_ff, c.n_head, c.n_head_kv
            ));
        }
        if !c.n_head.is_multiple_of(c.n_head_kv) {
            return err(format!(
                "{} query heads cannot share {} KV heads evenly",
                c.n_head, c.n_head_kv
            ));
        }
        if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
            return err(format!(
                "head dimension {} (width {} / {} heads) must be even and positive for RoPE",
                c.head_dim, c.n_embd, c.n_head
            ));
        }
        // Rotate whole heads when the teacher does; else as many dimensions as it rotates.
        c.rope_dim = if teacher.rope_dim == teacher.head_dim {
            c.head_dim
        } else {
            teacher.rope_dim.min(c.head_dim)
        };
        let factors = teacher.rope_scaling.freq_factors.is_some() || teacher.long_rope.is_some();
        if factors && c.rope_dim != teacher.rope_dim {
            return err(format!(
                "the teacher's RoPE factors are one per rotated pair of {} dims; a student \
                 rotating {} would need others",
                teacher.rope_dim, c.rope_dim
            ));
        }
        refuse_unkept_query_scale(teacher, &c)?;
        // Gemma's embedding scale is √width: the student's file says its own.
        if let Some(s) = &mut c.features.embd_scale {
            *s = (c.n_embd as f32).sqrt();
        }
        Ok(c)
    }

    /// Builds the student, from the teacher where shapes allow and `init` asks for it.
    pub fn build(&self, teacher: &Params, seed: u64) -> Result<Params> {
        let c = self.resolve(&teacher.config)?;
        let mut p = Params::random(&c, teacher.output.is_none(), seed);
        match self.init.as_deref().unwrap_or("teacher") {
            "random" => {}
            "teacher" => {
                let lt = teacher.layers.len();
                let map = |i: usize| {
                    if c.n_layers == 1 {
                        lt - 1
                    } else {
                        i * (lt - 1) / (c.n_layers - 1)
                    }
                };
                // Equal shapes are copied; a smaller student tensor takes the teacher's leading
                // rows and columns (its first heads, channels and FFN units: truncation, the
                // importance-free form of width pruning); a larger one stays random.
                let copy = |dst: &mut crate::Tensor, src: &crate::Tensor| {
                    if (dst.rows, dst.cols) == (src.rows, src.cols) {
                        // The values are in the teacher's training scale: keep its meaning.
                        dst.stored = src.stored;
                    }
                    if dst.rows <= src.rows && dst.cols <= src.cols {
                        for (r, row) in dst.data.chunks_exact_mut(dst.cols).enumerate() {
                            row.copy_from_slice(&src.data[r * src.cols..r * src.cols + row.len()]);
                        }
                    }
                };
                copy(&mut p.token_embd, &teacher.token_embd);
                copy(&mut p.output_norm, &teacher.output_norm);
                if let (Some(a), Some(b)) = (p.output.as_mut(), teacher.output.as_ref()) {
                    copy(a, b);
                }
                for (i, l) in p.layers.iter_mut().enumerate() {
                    let t = &teacher.layers[map(i)];
                    same_biases(l, t, &c, i);
                    let sources = t.tensors();
                    for d in l.tensors_mut() {
                        let suffix = block_suffix(&d.name);
                        if let Some(s) = sources.iter().find(|s| block_suffix(&s.name) == suffix) {
                            copy(d, s);
                        }
                    }
                }
            }
            other => {
                return Err(TrainError::Invalid(format!(
                    "unknown init {other:?}: use random or teacher"
                )));
            }
        }
        Ok(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choose_keeps_ends_and_the_most_important() {
        let imp = [9.0, 0.1, 5.0, 0.2, 3.0, 0.0, 1.0];
        assert_eq!(choose_layers(&imp, 4), vec![0, 2, 4, 6]);
        assert_eq!(choose_layers(&imp, 1), vec![0]);
        assert_eq!(choose_layers(&imp, 9), (0..7).collect::<Vec<_>>());
    }

    #[test]
    fn configs_that_do_not_fit_name_their_shapes() {
        let t = crate::gradcheck::tiny_config();
        let bad = StudentConfig {
            n_head: Some(5),
            n_head_kv: Some(2),
            ..Default::default()
        };
        let e = bad.resolve(&t).unwrap_err().to_string();
        assert!(
            e.contains("5 query heads") && e.contains("2 KV heads"),
            "{e}"
        );
        let odd = StudentConfig {
            n_embd: Some(96),
            n_head: Some(32),
            n_head_kv: Some(1),
            ..Default::default()
        };
        let e = odd.resolve(&t).unwrap_err().to_string();
        assert!(e.contains("head dimension 3"), "{e}");
    }

    /// A student of a family with optional tensors and shape-dependent switches: it has the
    /// teacher's biases (copied by name, whatever their order), Gemma's embedding scale for its
    /// own width, and no RoPE factors or query scale it could not keep.
    #[test]
    fn students_keep_what_their_family_needs() {
        use crate::gradcheck::{tiny_gemma3_config, tiny_phi3_config, tiny_qwen2_config};
        let mut t = Params::random(&tiny_qwen2_config(), true, 1);
        for (l, lp) in t.layers.iter_mut().enumerate() {
            let mut o = crate::Tensor::vector(format!("blk.{l}.attn_output.bias"), 12);
            o.data.fill(0.5 + l as f32);
            lp.biases.o = Some(o);
            lp.biases.v.as_mut().unwrap().data.fill(-2.0);
        }
        let one = StudentConfig {
            n_layers: Some(1),
            ..Default::default()
        };
        let s = one.build(&t, 2).unwrap();
        let b = &s.layers[0].biases;
        assert_eq!(
            b.o.as_ref().unwrap().data,
            t.layers[1].biases.o.as_ref().unwrap().data
        );
        assert_eq!(b.o.as_ref().unwrap().name, "blk.0.attn_output.bias");
        assert!(b.v.as_ref().unwrap().data.iter().all(|&v| v == -2.0));

        let narrow = StudentConfig {
            n_embd: Some(16),
            n_head: Some(2),
            ..Default::default()
        };
        let g = tiny_gemma3_config();
        let c = narrow.resolve(&frugal::model::Config {
            features: frugal::model::Features {
                query_scale: None,
                ..g.features
            },
            ..g.clone()
        });
        assert_eq!(c.unwrap().features.embd_scale, Some(4.0));
        let e = one.resolve(&g).unwrap_err().to_string();
        assert!(e.contains("query scale"), "{e}");
        assert!(keep_layers(&Params::random(&g, true, 1), &[1]).is_err());

        let heads = StudentConfig {
            head_dim: Some(2),
            ..Default::default()
        };
        let e = heads.resolve(&tiny_phi3_config()).unwrap_err().to_string();
        assert!(e.contains("RoPE factors"), "{e}");
    }
}
