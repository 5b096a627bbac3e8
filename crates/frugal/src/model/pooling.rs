//! Sentence embeddings from a decoder model: the hidden state after the final norm (what the
//! output head reads, as llama.cpp's embeddings of a decoder model), pooled over a sequence's
//! tokens and L2-normalized.
//!
//! A [`Pooler`] takes the rows of a sequence in order, in as many pieces as its passes had
//! (chunked prefill, a batch shared with other sequences); the result does not depend on the
//! split, since every row is normalized on its own and the sum runs over rows in order.

use std::str::FromStr;

use super::{Input, Model, Scratch};
use crate::error::Error;
use crate::ops::rms_norm;

/// How a sequence's per-token hidden states become one vector.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over every token (llama-server's default for models without their own).
    #[default]
    Mean,
    /// The last token's state: under causal attention the only one that has seen the whole
    /// input.
    Last,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Last => "last",
        }
    }

    /// Whether every token's state is needed (a prefix cache cannot stand in for any of them).
    pub fn needs_every_row(self) -> bool {
        self == Pooling::Mean
    }
}

impl FromStr for Pooling {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mean" => Ok(Pooling::Mean),
            "last" => Ok(Pooling::Last),
            _ => Err(format!("unknown pooling {s:?} (mean or last)")),
        }
    }
}

/// Pools one sequence's hidden states as they come out of the passes that compute it.
#[derive(Clone, Debug)]
pub struct Pooler {
    pooling: Pooling,
    /// Mean: the sum of the normalized rows so far (f64: a long input adds thousands of rows).
    /// Last: the last normalized row.
    acc: Vec<f64>,
    rows: usize,
    normed: Vec<f32>,
}

impl Pooler {
    pub fn new(pooling: Pooling, n_embd: usize) -> Self {
        Pooler {
            pooling,
            acc: vec![0.0; n_embd],
            rows: 0,
            normed: vec![0.0; n_embd],
        }
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Takes the next rows of the sequence (`rows x n_embd`): the residual stream after the
    /// last layer, before the final norm, as [`Scratch::hidden`] holds it.
    pub fn push(&mut self, model: &Model, hidden: &[f32]) {
        let d = self.acc.len();
        let rows = hidden.chunks_exact(d);
        let rows = match self.pooling {
            Pooling::Mean => rows.collect::<Vec<_>>(),
            Pooling::Last => rows.last().into_iter().collect(),
        };
        for row in rows {
            model.final_norm(row, &mut self.normed);
            match self.pooling {
                Pooling::Mean => {
                    for (a, &v) in self.acc.iter_mut().zip(&self.normed) {
                        *a += f64::from(v);
                    }
                }
                Pooling::Last => {
                    for (a, &v) in self.acc.iter_mut().zip(&self.normed) {
                        *a = f64::from(v);
                    }
                }
            }
        }
        self.rows += hidden.len() / d;
    }

    /// Forgets every row (the sequence will be computed again from its start).
    pub fn reset(&mut self) {
        self.acc.fill(0.0);
        self.rows = 0;
    }

    /// Rows taken so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The pooled vector with unit L2 norm (all zeros stay zeros; no rows: zeros).
    pub fn finish(&self) -> Vec<f32> {
        let n = match self.pooling {
            Pooling::Mean => self.rows.max(1) as f64,
            Pooling::Last => 1.0,
        };
        let pooled: Vec<f64> = self.acc.iter().map(|&a| a / n).collect();
        normalize(&pooled)
    }
}

/// `v` scaled to unit L2 norm, as f32 (a zero vector stays zero).
pub fn normalize(v: &[f64]) -> Vec<f32> {
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let inv = if norm > 0.0 { 1.0 / norm } else { 0.0 };
    v.iter().map(|&x| (x * inv) as f32).collect()
}

impl Model {
    /// The final norm of one row of the residual stream (`n_embd` values): the hidden state the
    /// output head reads.
    pub fn final_norm(&self, x: &[f32], out: &mut [f32]) {
        let w = &self.weights.output_norm;
        rms_norm(x, w, self.config.rms_eps, out);
    }

    /// The embedding of `tokens` alone: one pass over a cache of their own (no output head),
    /// pooled and L2-normalized. The server computes the same vector in its batches.
    pub fn sentence_embedding(
        &self,
        tokens: &[u32],
        pooling: Pooling,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, Error> {
        if tokens.is_empty() {
            return Err(Error::EmptyInput);
        }
        let mut kv = self.new_cache(tokens.len())?;
        let all = 0..self.config.n_layers;
        self.forward_span(Input::Tokens(tokens), all, &mut kv, s, None)?;
        let mut p = Pooler::new(pooling, self.config.n_embd);
        p.push(self, &s.hidden()[..tokens.len() * self.config.n_embd]);
        Ok(p.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::kv::KvOptions;
    use crate::model::Logits;
    use crate::model::synthetic::{SyntheticSpec, build};
    use crate::quant::GgmlType;

    fn model() -> Model {
        let spec = SyntheticSpec {
            n_layers: 2,
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            n_ctx: 256,
            ty: GgmlType::Q8_0,
            untied_output: true,
            seed: 3,
            ..Default::default()
        };
        Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap()
    }

    fn tokens(len: usize, seed: u32) -> Vec<u32> {
        (0..len as u32)
            .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) % 256)
            .collect()
    }

    /// The final norm written out in f64: `x / sqrt(mean(x^2) + eps) * w`.
    fn scalar_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
        let ms = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        x.iter()
            .zip(w)
            .map(|(&v, &g)| f64::from(v) * inv * f64::from(g))
            .collect()
    }

    /// The rows of a full forward pass (with the logits of every token) and those logits.
    fn reference_rows(m: &Model, t: &[u32]) -> (Vec<Vec<f64>>, Vec<f32>) {
        let mut kv = m.new_seq_cache(256, &KvOptions::default()).unwrap();
        let mut s = Scratch::default();
        let logits = m.forward(t, &mut kv, &mut s, Logits::All).unwrap().to_vec();
        let d = m.config.n_embd;
        let rows = s.hidden()[..t.len() * d]
            .chunks_exact(d)
            .map(|r| scalar_norm(r, &m.weights.output_norm, m.config.rms_eps))
            .collect();
        (rows, logits)
    }

    fn unit(v: Vec<f64>) -> Vec<f64> {
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.into_iter().map(|x| x / n).collect()
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len());
        let err = got
            .iter()
            .zip(want)
            .map(|(&g, &w)| (f64::from(g) - w).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-5, "{what}: largest difference {err}");
    }

    #[test]
    fn the_normed_hidden_state_is_what_the_head_reads() {
        // Checks that the rows pooled are the head's input: W_out times them is the logits.
        let m = model();
        let t = tokens(9, 1);
        let (rows, logits) = reference_rows(&m, &t);
        let (d, nv) = (m.config.n_embd, m.config.n_vocab);
        let out = m.weights.output.view();
        let mut w = vec![0.0; d];
        for (r, row) in rows.iter().enumerate() {
            for v in (0..nv).step_by(17) {
                out.dequantize_row(v, &mut w);
                let dot: f64 = w.iter().zip(row).map(|(&a, &b)| f64::from(a) * b).sum();
                let got = f64::from(logits[r * nv + v]);
                assert!(
                    (dot - got).abs() < 1e-3 * (1.0 + got.abs()),
                    "row {r} vocab {v}: {dot} vs {got}"
                );
            }
        }
    }

    #[test]
    fn pooling_matches_a_scalar_reference() {
        let m = model();
        let t = tokens(23, 2);
        let (rows, _) = reference_rows(&m, &t);
        let d = m.config.n_embd;
        let mut mean = vec![0.0; d];
        for r in &rows {
            mean.iter_mut()
                .zip(r)
                .for_each(|(a, &v)| *a += v / rows.len() as f64);
        }
        let mut s = Scratch::default();
        let got = m.sentence_embedding(&t, Pooling::Mean, &mut s).unwrap();
        assert_close(&got, &unit(mean), "mean");
        let got = m.sentence_embedding(&t, Pooling::Last, &mut s).unwrap();
        assert_close(&got, &unit(rows[rows.len() - 1].clone()), "last");
        let norm: f32 = got.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
    }

    #[test]
    fn the_split_into_pieces_does_not_change_the_vector() {
        let m = model();
        let t = tokens(40, 3);
        let (d, mut s) = (m.config.n_embd, Scratch::default());
        for pooling in [Pooling::Mean, Pooling::Last] {
            let whole = m.sentence_embedding(&t, pooling, &mut s).unwrap();
            let mut kv = m.new_cache(t.len()).unwrap();
            let mut p = Pooler::new(pooling, d);
            for chunk in t.chunks(7) {
                let all = 0..m.config.n_layers;
                m.forward_span(Input::Tokens(chunk), all, &mut kv, &mut s, None)
                    .unwrap();
                p.push(&m, &s.hidden()[..chunk.len() * d]);
            }
            assert_eq!(p.rows(), t.len());
            let pieces = p.finish();
            let diff = whole
                .iter()
                .zip(&pieces)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(diff < 1e-6, "{pooling:?}: {diff}");
            // A different input gives a different vector.
            let other = m
                .sentence_embedding(&tokens(40, 4), pooling, &mut s)
                .unwrap();
            assert_ne!(whole, other);
        }
    }

    #[test]
    fn pooling_names_parse_and_nothing_else_does() {
        assert_eq!("mean".parse(), Ok(Pooling::Mean));
        assert_eq!("last".parse(), Ok(Pooling::Last));
        assert!("cls".parse::<Pooling>().is_err());
        assert!(Pooling::Mean.needs_every_row() && !Pooling::Last.needs_every_row());
        let empty = model().sentence_embedding(&[], Pooling::Mean, &mut Scratch::default());
        assert!(matches!(empty, Err(Error::EmptyInput)));
        assert_eq!(normalize(&[0.0, 0.0]), vec![0.0, 0.0]);
        assert_eq!(normalize(&[3.0, 4.0]), vec![0.6, 0.8]);
    }
}
