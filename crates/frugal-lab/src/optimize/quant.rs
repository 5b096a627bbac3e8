//! The quantization stage of the ladder: uniform formats, and per-tensor mixes allocated by
//! measured sensitivity under a sweep of bit budgets (as llama.cpp's `--target-bpw`, PR
//! #15550, and ModelOpt's AutoQuantize allocate them).
//!
//! - [`formats_for`]: the formats a base can take: every one for an F32/F16/BF16 base, only
//!   those at or below its own bits per weight for a quantized base (re-quantizing upward adds
//!   rounding without recovering what the base lost; refused with that reason).
//! - [`Bank`]: every tensor of the base encoded once in each format, so that any mix is
//!   assembled by copying bytes; the result is byte-identical to what `frugal quantize --type
//!   BULK --keep NAME=TYPE ...` ([`Stage::Quant`]) writes, which rebuilds it from its recipe.
//! - [`groups`]: the matrices grouped by role and layer band (`ffn_down.weight` in layers
//!   0–9, ...); a group is the unit of allocation.
//! - Sensitivity (measured by the search): the KL to the base when one group alone goes from
//!   the widest format to a probe format. [`Costs`] extends it to every format by the group's
//!   squared rounding error in that format relative to the probe's (KL is second order in
//!   the weight error), and [`allocate`] picks a format per group minimizing the predicted KL
//!   under a bit budget (Lagrangian relaxation, then a greedy fill of what is left).

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use frugal::gguf::{GgufFile, GgufWriter};
use frugal::quant::{self, GgmlType};

use super::recipe::Stage;

/// Weight formats the stage tries, widest first: every type `frugal quantize --type` writes
/// that llama.cpp also reads, except F32 and BF16 (F16 holds the same range of a float base).
pub fn uniform() -> Vec<GgmlType> {
    quant::SUPPORTED
        .iter()
        .copied()
        .filter(|t| !t.frugal_only() && !matches!(t, GgmlType::F32 | GgmlType::BF16))
        .collect()
}

/// The `--type` / `--keep` name of a format.
pub fn type_name(t: GgmlType) -> String {
    t.name().to_ascii_lowercase()
}

fn is_float(t: GgmlType) -> bool {
    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Whether a tensor is one the stage quantizes: a matrix (the embedding and head included).
pub fn quantizable(name: &str, dims: &[u64]) -> bool {
    dims.len() == 2 && name.ends_with(".weight")
}

/// The formats a base can take, and those refused with the reason.
#[derive(Clone, Debug, Default)]
pub struct Formats {
    pub allowed: Vec<GgmlType>,
    pub refused: Vec<String>,
    /// The type holding most of the base's matrices.
    pub base: Option<GgmlType>,
}

/// [`Formats`] of `base`.
pub fn formats_for(base: &GgufFile) -> Formats {
    let mut by: BTreeMap<&'static str, (GgmlType, u64)> = BTreeMap::new();
    for t in base
        .tensors()
        .iter()
        .filter(|t| quantizable(&t.name, &t.dims))
    {
        by.entry(t.ty.name()).or_insert((t.ty, 0)).1 += t.n_elements();
    }
    let Some((own, _)) = by.values().copied().max_by_key(|&(_, n)| n) else {
        return Formats::default();
    };
    let mut f = Formats {
        base: Some(own),
        ..Default::default()
    };
    for t in uniform() {
        if t == own {
            f.refused.push(format!(
                "{}: the base's own format (the base itself)",
                type_name(t)
            ));
        } else if is_float(own) {
            if is_float(t) && t.bits_per_weight() > own.bits_per_weight() {
                f.refused
                    .push(format!("{}: wider than the base", type_name(t)));
            } else {
                f.allowed.push(t);
            }
        } else if is_float(t) || t.bits_per_weight() > own.bits_per_weight() {
            f.refused.push(format!(
                "{}: {:.2} bits per weight, above the base's {} ({:.2}): re-quantizing upward adds rounding and recovers nothing",
                type_name(t),
                t.bits_per_weight(),
                own,
                own.bits_per_weight()
            ));
        } else {
            f.allowed.push(t);
        }
    }
    f
}

/// A set of matrices allocated one format together.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Group {
    /// `ffn_down.weight[0-9]`, `token_embd.weight`.
    pub name: String,
    pub tensors: Vec<String>,
    pub params: u64,
}

fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (n, role) = rest.split_once('.')?;
    Some((n.parse().ok()?, role))
}

/// The quantizable matrices of `file` grouped by role and by `bands` bands of layers; the
/// others (embedding, head) one group each.
pub fn groups(file: &GgufFile, bands: usize) -> Vec<Group> {
    let n_layers = file
        .tensors()
        .iter()
        .filter_map(|t| layer_of(&t.name).map(|(l, _)| l + 1))
        .max()
        .unwrap_or(1);
    let bands = bands.clamp(1, n_layers);
    let band_of = |l: usize| l * bands / n_layers;
    let mut out: Vec<Group> = Vec::new();
    for t in file
        .tensors()
        .iter()
        .filter(|t| quantizable(&t.name, &t.dims))
    {
        let name = match layer_of(&t.name) {
            Some((l, role)) => {
                let b = band_of(l);
                let first = (0..n_layers).find(|&x| band_of(x) == b).unwrap_or(0);
                let last = (0..n_layers).rfind(|&x| band_of(x) == b).unwrap_or(0);
                format!("{role}[{first}-{last}]")
            }
            None => t.name.clone(),
        };
        match out.iter_mut().find(|g| g.name == name) {
            Some(g) => {
                g.tensors.push(t.name.clone());
                g.params += t.n_elements();
            }
            None => out.push(Group {
                name,
                tensors: vec![t.name.clone()],
                params: t.n_elements(),
            }),
        }
    }
    out
}

/// Every quantizable tensor of a base encoded in each format (as `frugal quantize` encodes it,
/// fallbacks included), with the seconds each format took.
pub struct Bank {
    files: Vec<(GgmlType, GgufFile, f64)>,
}

impl Default for Bank {
    fn default() -> Self {
        Self::new()
    }
}

impl Bank {
    pub fn new() -> Bank {
        Bank { files: Vec::new() }
    }

    /// Encodes `base` in `t` (every matrix, the embedding and head included) unless done.
    pub fn add(&mut self, base: &GgufFile, t: GgmlType) -> Result<()> {
        if self.get(t).is_some() {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let name = type_name(t);
        let keep = ["token_embd.weight", "output.weight"]
            .iter()
            .map(|n| format!("{n}={name}"))
            .collect();
        let file = Stage::Quant {
            format: name,
            keep,
            imatrix: false,
        }
        .apply(base, base, &Default::default())?;
        self.files.push((t, file, t0.elapsed().as_secs_f64()));
        Ok(())
    }

    pub fn get(&self, t: GgmlType) -> Option<&GgufFile> {
        self.files.iter().find(|f| f.0 == t).map(|f| &f.1)
    }

    /// Seconds encoding the whole base in `t` took.
    pub fn seconds(&self, t: GgmlType) -> f64 {
        self.files.iter().find(|f| f.0 == t).map_or(0.0, |f| f.2)
    }

    /// The model `bulk` with each tensor of `per_tensor` in its format: the bytes of
    /// `mix(bulk, per_tensor).stage()` applied to the base.
    pub fn assemble(&self, mix: &Mix) -> Result<Vec<u8>> {
        let bulk = self
            .get(mix.bulk)
            .with_context(|| format!("{} is not in the bank", mix.bulk))?;
        let mut w = GgufWriter::from_file(bulk);
        for t in w.tensors.iter_mut() {
            let ty = mix.format_of(&t.name);
            if ty == mix.bulk {
                continue;
            }
            let src = self
                .get(ty)
                .with_context(|| format!("{ty} is not in the bank"))?;
            let (info, bytes) = src.tensor(&t.name)?;
            t.ty = info.ty;
            t.data = std::borrow::Cow::Borrowed(bytes);
        }
        Ok(w.to_bytes()?)
    }

    /// Bytes of tensor `name` in format `t` (after its fallback).
    pub fn tensor_bytes(&self, name: &str, t: GgmlType) -> u64 {
        self.get(t)
            .and_then(|f| f.tensor(name).ok())
            .map_or(0, |(i, _)| i.n_bytes())
    }
}

/// A weight format per quantizable tensor: `bulk` unless `per_tensor` says otherwise. The
/// embedding and head take Q8_0 (or a float bulk format) unless named, as `frugal quantize`
/// keeps them.
#[derive(Clone, Debug, PartialEq)]
pub struct Mix {
    pub bulk: GgmlType,
    pub per_tensor: BTreeMap<String, GgmlType>,
}

impl Mix {
    pub fn uniform(t: GgmlType) -> Mix {
        Mix {
            bulk: t,
            per_tensor: BTreeMap::new(),
        }
    }

    pub fn format_of(&self, tensor: &str) -> GgmlType {
        if let Some(&t) = self.per_tensor.get(tensor) {
            return t;
        }
        let head = tensor == "token_embd.weight" || tensor == "output.weight";
        if head && !is_float(self.bulk) {
            GgmlType::Q8_0
        } else {
            self.bulk
        }
    }

    /// The mix from one format per group: the bulk is the format holding most parameters of
    /// the layer matrices; the embedding and head are always named.
    pub fn from_groups(groups: &[Group], formats: &[GgmlType]) -> Mix {
        let mut by: Vec<(GgmlType, u64)> = Vec::new();
        for (g, &f) in groups.iter().zip(formats) {
            if g.tensors.iter().all(|t| t.starts_with("blk.")) {
                match by.iter_mut().find(|e| e.0 == f) {
                    Some(e) => e.1 += g.params,
                    None => by.push((f, g.params)),
                }
            }
        }
        let bulk = by.iter().max_by_key(|e| e.1).map_or(formats[0], |e| e.0);
        let mut per_tensor = BTreeMap::new();
        for (g, &f) in groups.iter().zip(formats) {
            for t in &g.tensors {
                if f != bulk || !t.starts_with("blk.") {
                    per_tensor.insert(t.clone(), f);
                }
            }
        }
        Mix { bulk, per_tensor }
    }

    /// The recipe stage that writes this mix on `base`: `--type BULK` and a `--keep` rule per
    /// tensor not in the bulk format (one `blk.*.ROLE` glob where every layer of a role agrees).
    pub fn stage(&self, base: &GgufFile) -> Stage {
        let mut by_role: BTreeMap<String, Vec<(&str, GgmlType)>> = BTreeMap::new();
        let mut keep = Vec::new();
        for (t, &f) in &self.per_tensor {
            match layer_of(t) {
                Some((_, role)) => by_role.entry(role.to_string()).or_default().push((t, f)),
                None => keep.push(format!("{t}={}", type_name(f))),
            }
        }
        for (role, ts) in by_role {
            let layers: Vec<usize> = base
                .tensors()
                .iter()
                .filter_map(|t| {
                    layer_of(&t.name)
                        .filter(|(_, r)| *r == role)
                        .map(|(l, _)| l)
                })
                .collect();
            let mut formats: Vec<GgmlType> = ts.iter().map(|&(_, f)| f).collect();
            formats.dedup();
            formats.sort_by_key(|f| f.id());
            formats.dedup();
            for f in formats {
                let mine: Vec<usize> = ts
                    .iter()
                    .filter(|&&(_, g)| g == f)
                    .filter_map(|(t, _)| layer_of(t).map(|(l, _)| l))
                    .collect();
                if mine.len() == layers.len() {
                    keep.push(format!("blk.*.{role}={}", type_name(f)));
                    continue;
                }
                // Whole decades of layers as one glob (`blk.1?.` is layers 10-19).
                let mut rest = mine.clone();
                for d in 0..=layers.iter().max().copied().unwrap_or(0) / 10 {
                    let decade: Vec<usize> =
                        layers.iter().copied().filter(|l| l / 10 == d).collect();
                    if decade.len() == 10 && decade.iter().all(|l| mine.contains(l)) {
                        let prefix = if d == 0 { String::new() } else { d.to_string() };
                        keep.push(format!("blk.{prefix}?.{role}={}", type_name(f)));
                        rest.retain(|l| l / 10 != d);
                    }
                }
                keep.extend(
                    rest.iter()
                        .map(|l| format!("blk.{l}.{role}={}", type_name(f))),
                );
            }
        }
        Stage::Quant {
            format: type_name(self.bulk),
            keep,
            imatrix: false,
        }
    }
}

/// The squared rounding error of every quantizable tensor of `base` in format `t`, summed per
/// group (dequantized from the bank's bytes, against the base's values).
pub fn group_noise(
    base: &GgufFile,
    bank: &Bank,
    groups: &[Group],
    t: GgmlType,
) -> Result<Vec<f64>> {
    let file = bank
        .get(t)
        .with_context(|| format!("{t} is not in the bank"))?;
    groups
        .iter()
        .map(|g| {
            let mut e = 0.0;
            for name in &g.tensors {
                let (bi, bb) = base.tensor(name)?;
                let (qi, qb) = file.tensor(name)?;
                let n = bi.n_elements() as usize;
                let w = quant::dequantize_to_vec(bi.ty, bb, n)?;
                let q = quant::dequantize_to_vec(qi.ty, qb, n)?;
                e += w
                    .iter()
                    .zip(&q)
                    .map(|(a, b)| f64::from(a - b).powi(2))
                    .sum::<f64>();
            }
            Ok(e)
        })
        .collect()
}

/// `bits[g][f]`: the storage of group `g` in `palette[f]`, from the bank's bytes.
pub fn group_bits(bank: &Bank, groups: &[Group], palette: &[GgmlType]) -> Vec<Vec<f64>> {
    groups
        .iter()
        .map(|g| {
            palette
                .iter()
                .map(|&t| {
                    g.tensors
                        .iter()
                        .map(|n| bank.tensor_bytes(n, t) as f64 * 8.0)
                        .sum()
                })
                .collect()
        })
        .collect()
}

/// What each group costs in each format: bits, and the KL it is predicted to add.
#[derive(Clone, Debug)]
pub struct Costs {
    pub formats: Vec<GgmlType>,
    /// `bits[g][f]`: group `g`'s storage in format `f`.
    pub bits: Vec<Vec<f64>>,
    /// `kl[g][f]`: the KL group `g` adds in format `f` (predicted).
    pub kl: Vec<Vec<f64>>,
}

impl Costs {
    /// From each group's measured sensitivity (`sens[g]`: the KL it added at `probe`) and its
    /// rounding error per format (`noise[f][g]`), the KL scaled by the error's ratio to the
    /// probe's.
    pub fn new(
        formats: Vec<GgmlType>,
        bits: Vec<Vec<f64>>,
        sens: &[f64],
        noise: &[Vec<f64>],
        probe: usize,
    ) -> Costs {
        let kl = sens
            .iter()
            .enumerate()
            .map(|(g, &s)| {
                let at_probe = noise[probe][g].max(1e-30);
                (0..formats.len())
                    .map(|f| s.max(1e-9) * noise[f][g] / at_probe)
                    .collect()
            })
            .collect();
        Costs { formats, bits, kl }
    }

    /// The predicted KL added by a choice of format index per group.
    pub fn kl_of(&self, choice: &[usize]) -> f64 {
        choice.iter().enumerate().map(|(g, &f)| self.kl[g][f]).sum()
    }

    pub fn bits_of(&self, choice: &[usize]) -> f64 {
        choice
            .iter()
            .enumerate()
            .map(|(g, &f)| self.bits[g][f])
            .sum()
    }
}

/// A format index per group minimizing the predicted KL with at most `budget` bits: the
/// Lagrangian relaxation (each group picks `argmin kl + λ·bits`, λ bisected to the smallest
/// that fits), then greedy upgrades by KL saved per extra bit while the budget allows. `None`
/// when even the smallest choice does not fit.
pub fn allocate(c: &Costs, budget: f64) -> Option<Vec<usize>> {
    let pick = |lambda: f64| -> Vec<usize> {
        c.kl.iter()
            .zip(&c.bits)
            .map(|(kl, bits)| {
                (0..kl.len())
                    .min_by(|&a, &b| {
                        let (x, y) = (kl[a] + lambda * bits[a], kl[b] + lambda * bits[b]);
                        x.total_cmp(&y).then(bits[a].total_cmp(&bits[b]))
                    })
                    .unwrap_or(0)
            })
            .collect()
    };
    let smallest: Vec<usize> = c
        .bits
        .iter()
        .map(|b| {
            (0..b.len())
                .min_by(|&x, &y| b[x].total_cmp(&b[y]))
                .unwrap_or(0)
        })
        .collect();
    if c.bits_of(&smallest) > budget {
        return None;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while c.bits_of(&pick(hi)) > budget && hi < 1e30 {
        hi *= 4.0;
    }
    let mut best = if c.bits_of(&pick(hi)) <= budget {
        pick(hi)
    } else {
        smallest
    };
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        let p = pick(mid);
        if c.bits_of(&p) <= budget {
            hi = mid;
            best = p;
        } else {
            lo = mid;
        }
    }
    // Spend what is left where it saves the most KL per bit.
    loop {
        let room = budget - c.bits_of(&best);
        let mut step: Option<(usize, usize, f64)> = None;
        for (g, &f) in best.iter().enumerate() {
            for h in 0..c.formats.len() {
                let extra = c.bits[g][h] - c.bits[g][f];
                let saved = c.kl[g][f] - c.kl[g][h];
                if extra > 0.0 && extra <= room && saved > 0.0 {
                    let rate = saved / extra;
                    if step.is_none_or(|s| rate > s.2) {
                        step = Some((g, h, rate));
                    }
                }
            }
        }
        match step {
            Some((g, h, _)) => best[g] = h,
            None => break,
        }
    }
    Some(best)
}

#[cfg(test)]
mod tests {
    use super::*;
    use frugal::convert::{Rule, glob_match};
    use frugal::model::synthetic::{SyntheticSpec, build};

    /// The rules a mix writes give every tensor the mix's format (decade globs included).
    #[test]
    fn a_mix_stage_names_every_tensor_format() {
        let file = GgufFile::from_bytes(build(&SyntheticSpec {
            n_layers: 30,
            n_embd: 32,
            n_ff: 32,
            ..Default::default()
        }))
        .unwrap();
        let groups = groups(&file, 3);
        let palette = [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];
        let formats: Vec<GgmlType> = (0..groups.len()).map(|i| palette[i % 3]).collect();
        let mut mix = Mix::from_groups(&groups, &formats);
        mix.per_tensor
            .insert("blk.13.ffn_up.weight".into(), GgmlType::Q2_K);
        let Stage::Quant { format, keep, .. } = mix.stage(&file) else {
            panic!("a mix is a quantization stage")
        };
        assert_eq!(format, type_name(mix.bulk));
        assert!(keep.iter().any(|r| r.contains("blk.1?.")), "{keep:?}");
        let rules: Vec<Rule> = keep.iter().map(|r| r.parse().unwrap()).collect();
        for t in file
            .tensors()
            .iter()
            .filter(|t| quantizable(&t.name, &t.dims))
        {
            let want = mix.format_of(&t.name);
            let got = rules
                .iter()
                .find(|r| glob_match(&r.pattern, &t.name))
                .map(|r| r.target.to_string().to_ascii_lowercase());
            let head = !t.name.starts_with("blk.");
            if head || want != mix.bulk {
                assert_eq!(got, Some(type_name(want)), "{}: {keep:?}", t.name);
            } else {
                assert_eq!(got, None, "{}", t.name);
            }
        }
    }
}
