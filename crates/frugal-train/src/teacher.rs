//! The teacher's signal, two ways:
//! - online: one or more teachers run beside the student on the inference engine's fast
//!   quantized path, giving full logits (and hidden states) for every training batch;
//! - offline: the teacher's top-k log-probabilities over the training windows, computed once
//!   and stored in a file that later runs reuse. [`TopKCache::build`] measures what the
//!   truncation costs: the probability mass outside the top k, and `KL(p̃ ‖ p) = -ln P_k` of the
//!   renormalized top-k distribution `p̃` from the full one.

use std::io::{Read, Write};
use std::path::Path;

use frugal::kv::KvSequence;
use frugal::model::{Logits, Model, Observer, Scratch, Site};
use rayon::prelude::*;

use crate::data::Windows;
use crate::error::{Result, TrainError, io_err};

/// Teachers that run beside the student.
pub struct OnlineTeachers {
    /// Each teacher with its weight in the ensemble.
    pub models: Vec<(Model, f32)>,
}

/// What the teachers say about one batch.
pub struct TeacherBatch {
    /// Per teacher, `rows x vocabulary` logits.
    pub logits: Vec<Vec<f32>>,
    /// The first teacher's residual stream after each requested layer: `(layer, rows x n_embd)`.
    pub hidden: Vec<(usize, Vec<f32>)>,
}

struct Recorder<'a> {
    layers: &'a [usize],
    out: Vec<(usize, Vec<f32>)>,
}

impl Observer for Recorder<'_> {
    fn observe(&mut self, layer: usize, site: Site, x: &[f32], _width: usize) {
        if site == Site::LayerOutput && self.layers.contains(&layer) {
            match self.out.iter_mut().find(|(l, _)| *l == layer) {
                Some((_, v)) => v.extend_from_slice(x),
                None => self.out.push((layer, x.to_vec())),
            }
        }
    }
}

impl TeacherBatch {
    /// The soft targets these logits give, each teacher with its ensemble weight.
    pub fn rows<'a>(&'a self, teachers: &OnlineTeachers) -> crate::loss::TeacherRows<'a> {
        crate::loss::TeacherRows::Dense(
            self.logits
                .iter()
                .zip(&teachers.models)
                .map(|(l, (_, w))| (&l[..], *w))
                .collect(),
        )
    }
}

impl OnlineTeachers {
    pub fn n_vocab(&self) -> usize {
        self.models
            .first()
            .map(|(m, _)| m.config.n_vocab)
            .unwrap_or(0)
    }

    /// Runs every teacher over each sequence of `seq` tokens in `tokens`, recording the first
    /// teacher's layer outputs at `hidden_layers`.
    pub fn run(&self, tokens: &[u32], seq: usize, hidden_layers: &[usize]) -> Result<TeacherBatch> {
        let mut logits = Vec::with_capacity(self.models.len());
        let mut hidden = Vec::new();
        for (ti, (m, _)) in self.models.iter().enumerate() {
            let nv = m.config.n_vocab;
            let mut all = Vec::with_capacity(tokens.len() * nv);
            let mut kv = m.new_cache(seq)?;
            let mut scratch = Scratch::default();
            let mut rec = Recorder {
                layers: if ti == 0 { hidden_layers } else { &[] },
                out: Vec::new(),
            };
            for s in tokens.chunks(seq) {
                kv.clear();
                let lg = m.forward_observed(
                    s,
                    &mut kv as &mut dyn KvSequence,
                    &mut scratch,
                    Logits::All,
                    Some(&mut rec),
                )?;
                all.extend_from_slice(lg);
            }
            if ti == 0 {
                hidden = rec.out;
            }
            logits.push(all);
        }
        Ok(TeacherBatch { logits, hidden })
    }
}

const MAGIC: &[u8; 8] = b"FRGTOPK1";

/// The teacher's top-k log-probabilities (τ = 1) at every input position of a set of windows.
#[derive(Clone, Debug, PartialEq)]
pub struct TopKCache {
    pub k: usize,
    pub seq: usize,
    pub windows: usize,
    pub n_vocab: usize,
    /// A hash of the windows' tokens, so a cache is never used with other data.
    pub data_hash: u64,
    /// Token ids, `windows x seq x k`, most likely first.
    pub ids: Vec<u32>,
    pub logp: Vec<f32>,
    /// Mean probability mass outside the top k.
    pub mean_missing_mass: f64,
    /// Mean `KL(p̃ ‖ p) = -ln P_k` (nats): what renormalizing over the top k costs.
    pub mean_truncation_kl: f64,
}

/// FNV-1a over the tokens.
pub fn hash_tokens(t: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &v in t {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl TopKCache {
    /// Runs the teachers (their ensemble distribution, if several) over every window and keeps
    /// the top `k` of each position.
    pub fn build(
        teachers: &OnlineTeachers,
        data: &Windows,
        k: usize,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let nv = teachers.n_vocab();
        if k == 0 || k > nv {
            return Err(TrainError::Invalid(format!(
                "top-k must be between 1 and the vocabulary ({nv}), not {k}"
            )));
        }
        let seq = data.seq;
        let n = data.len();
        let mut c = TopKCache {
            k,
            seq,
            windows: n,
            n_vocab: nv,
            data_hash: hash_tokens(&data.tokens),
            ids: Vec::with_capacity(n * seq * k),
            logp: Vec::with_capacity(n * seq * k),
            mean_missing_mass: 0.0,
            mean_truncation_kl: 0.0,
        };
        let total: f32 = teachers.models.iter().map(|(_, w)| w).sum();
        for i in 0..n {
            let w = &data.get(i)[..seq];
            let out = teachers.run(w, seq, &[])?;
            let rows: Vec<(Vec<u32>, Vec<f32>, f64)> = (0..seq)
                .into_par_iter()
                .map(|r| {
                    // The ensemble's log-probabilities over the vocabulary.
                    let mut lp = vec![0f32; nv];
                    for (lg, (_, wt)) in out.logits.iter().zip(&teachers.models) {
                        let z = &lg[r * nv..(r + 1) * nv];
                        let lse = frugal::ops::log_sum_exp(z) as f32;
                        for (o, &v) in lp.iter_mut().zip(z) {
                            *o += wt / total * (v - lse).exp();
                        }
                    }
                    let mut idx: Vec<u32> = (0..nv as u32).collect();
                    idx.select_nth_unstable_by(k - 1, |&a, &b| {
                        lp[b as usize].total_cmp(&lp[a as usize])
                    });
                    let mut top: Vec<u32> = idx[..k].to_vec();
                    top.sort_by(|&a, &b| lp[b as usize].total_cmp(&lp[a as usize]));
                    let mass: f64 = top.iter().map(|&t| f64::from(lp[t as usize])).sum();
                    let logp = top
                        .iter()
                        .map(|&t| lp[t as usize].max(1e-38).ln())
                        .collect();
                    (top, logp, mass.min(1.0))
                })
                .collect();
            for (ids, logp, mass) in rows {
                c.ids.extend(ids);
                c.logp.extend(logp);
                c.mean_missing_mass += 1.0 - mass;
                c.mean_truncation_kl += -mass.max(1e-300).ln();
            }
            progress(i + 1, n);
        }
        let positions = (n * seq).max(1) as f64;
        c.mean_missing_mass /= positions;
        c.mean_truncation_kl /= positions;
        Ok(c)
    }

    /// The rows of window `w`: `(ids, logp)`, each `seq x k`.
    pub fn window(&self, w: usize) -> (&[u32], &[f32]) {
        let span = self.seq * self.k;
        (
            &self.ids[w * span..(w + 1) * span],
            &self.logp[w * span..(w + 1) * span],
        )
    }

    /// Checks the cache was made for these windows and this vocabulary.
    pub fn check(&self, data: &Windows, n_vocab: usize) -> Result<()> {
        if self.seq != data.seq
            || self.windows != data.len()
            || self.data_hash != hash_tokens(&data.tokens)
        {
            return Err(TrainError::Invalid(format!(
                "the teacher cache covers {} windows of {} tokens of other data (hash {:016x}); this run has {} windows of {} (hash {:016x}): rebuild it",
                self.windows,
                self.seq,
                self.data_hash,
                data.len(),
                data.seq,
                hash_tokens(&data.tokens)
            )));
        }
        if self.n_vocab != n_vocab {
            return Err(TrainError::VocabMismatch {
                student: n_vocab,
                teacher: self.n_vocab,
            });
        }
        Ok(())
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("tmp");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).map_err(io_err(&tmp))?);
        let mut head = Vec::with_capacity(64);
        head.extend_from_slice(MAGIC);
        for v in [self.k, self.seq, self.windows, self.n_vocab] {
            head.extend_from_slice(&(v as u64).to_le_bytes());
        }
        head.extend_from_slice(&self.data_hash.to_le_bytes());
        head.extend_from_slice(&self.mean_missing_mass.to_le_bytes());
        head.extend_from_slice(&self.mean_truncation_kl.to_le_bytes());
        f.write_all(&head).map_err(io_err(&tmp))?;
        for &i in &self.ids {
            f.write_all(&i.to_le_bytes()).map_err(io_err(&tmp))?;
        }
        for &l in &self.logp {
            f.write_all(&l.to_le_bytes()).map_err(io_err(&tmp))?;
        }
        f.into_inner()
            .map_err(|e| io_err(&tmp)(e.into_error()))?
            .sync_all()
            .map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io_err(path))
    }

    /// Reads a cache, checking its header against the file's size before allocating.
    pub fn load(path: &Path) -> Result<Self> {
        let mut f = std::fs::File::open(path).map_err(io_err(path))?;
        let len = f.metadata().map_err(io_err(path))?.len();
        let bad = |why: String| {
            TrainError::Invalid(format!("{}: not a teacher cache: {why}", path.display()))
        };
        let mut head = [0u8; 8 + 8 * 7];
        f.read_exact(&mut head)
            .map_err(|_| bad("shorter than its header".into()))?;
        if &head[..8] != MAGIC {
            return Err(bad("wrong magic".into()));
        }
        let u = |i: usize| {
            u64::from_le_bytes(head[8 + 8 * i..16 + 8 * i].try_into().unwrap_or_default())
        };
        let (k, seq, windows, n_vocab, data_hash) = (u(0), u(1), u(2), u(3), u(4));
        let entries = k
            .checked_mul(seq)
            .and_then(|v| v.checked_mul(windows))
            .filter(|&e| {
                e.checked_mul(8)
                    .and_then(|b| b.checked_add(head.len() as u64))
                    == Some(len)
            })
            .ok_or_else(|| {
                bad(format!(
                    "{k} x {seq} x {windows} entries do not match the file's {len} bytes"
                ))
            })?;
        let mut body = vec![0u8; (entries * 8) as usize];
        f.read_exact(&mut body).map_err(io_err(path))?;
        let (ib, lb) = body.split_at(entries as usize * 4);
        let word = |c: &[u8]| <[u8; 4]>::try_from(c).unwrap_or_default();
        let ids: Vec<u32> = ib
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(word(c)))
            .collect();
        if let Some(bad_id) = ids.iter().find(|&&i| u64::from(i) >= n_vocab) {
            return Err(bad(format!(
                "token id {bad_id} outside the vocabulary of {n_vocab}"
            )));
        }
        Ok(TopKCache {
            k: k as usize,
            seq: seq as usize,
            windows: windows as usize,
            n_vocab: n_vocab as usize,
            data_hash,
            ids,
            logp: lb
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(word(c)))
                .collect(),
            mean_missing_mass: f64::from_bits(u(5)),
            mean_truncation_kl: f64::from_bits(u(6)),
        })
    }
}
