//! Dense to mixture-of-experts: MoEfication (split each FFN's neurons into experts and route
//! each token to a few of them: fewer active parameters) and sparse upcycling (copies of the
//! FFN behind a router: more total parameters, the same active ones).
//!
//! **Splitting.** A SwiGLU FFN is a sum over its neurons, `down(h) = Σ_i down[:, i] h_i(x)`, so
//! cutting the neurons into E disjoint sets and summing every set's output gives the dense FFN
//! back; routing keeps only the k sets whose neurons the router expects to fire. Neurons are
//! grouped by balanced k-means (every expert gets exactly `n_ff / E` neurons, so the experts
//! stack into llama.cpp's 3-D tensors), on one of two features:
//! - `weights`: each neuron's gate row (MoEfication's parameter clustering; no data);
//! - `coactivation`: each neuron's row of the correlation of `|h_i|` with every `|h_j|` over a
//!   calibration text (neurons that fire together share an expert, as MoEfication's
//!   co-activation graph).
//!
//! **The router, without training.** `centroid`: expert e's router row is the mean of its
//! neurons' unit gate rows (MoEfication's similarity selection). `fit`: least squares from the
//! FFN input to the expert's activation mass `Σ_{i∈e} |h_i(x)|` over the calibration text (its
//! linear "MLP selection"). Either way the rows are then scaled so the logits are small: the
//! softmax over them is near uniform, the renormalized weights of the k chosen experts near
//! 1/k, and the down projections are stored times k, so the layer computes the sum of the chosen
//! experts, the dense FFN minus the experts left out. A trained router (`frugal train-router`)
//! can then sharpen the weights. This is the routing llama.cpp's `llama` architecture runs
//! (softmax, renormalized, unscaled), so the file runs there too.

use std::borrow::Cow;

use super::SurgeryError;
use super::prune::structured::{matrix, select_rows};
use crate::estimate::gguf_desc::active_fraction;
use crate::gguf::{GgufFile, GgufWriter, TensorData, Value};
use crate::model::{Config, Logits, Model, Observer, Scratch, Site};
use crate::quant::{self, GgmlType};

/// How neurons are grouped into experts.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Split {
    Weights,
    Coactivation,
}

/// How the router is built.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum RouterInit {
    Centroid,
    Fit,
}

#[derive(Clone, Debug)]
pub struct MoefyTarget {
    pub n_expert: usize,
    pub n_used: usize,
    pub split: Split,
    pub router: RouterInit,
    /// Neurons kept always active as a shared expert (CMoE's shared experts): the ones with
    /// the most activation over the calibration text; 0 for none.
    pub shared: usize,
    pub seed: u64,
}

/// What a conversion did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MoeReport {
    pub n_expert: usize,
    pub n_used: usize,
    pub expert_width: usize,
    pub total_params: u64,
    pub active_params: u64,
}

/// Checks E and k against an FFN of `n_ff` neurons stored in blocks of `block`.
fn check_shape(n_ff: usize, e: usize, k: usize, block: usize) -> Result<usize, SurgeryError> {
    if e < 2 || k == 0 || k > e {
        return Err(SurgeryError::Invalid(format!(
            "{k} of {e} experts: need at least 2 experts and 1 <= k <= E"
        )));
    }
    if !n_ff.is_multiple_of(e) || !(n_ff / e).is_multiple_of(block) {
        let ok: Vec<usize> = (2..=n_ff / block)
            .filter(|&x| n_ff.is_multiple_of(x) && (n_ff / x).is_multiple_of(block))
            .collect();
        return Err(SurgeryError::Invalid(format!(
            "{e} experts do not split the {n_ff} neurons into equal widths of whole blocks of \
             {block} (experts are stacked in one tensor, so they must be equal): use one of \
             {ok:?}"
        )));
    }
    Ok(n_ff / e)
}

/// Calibration for co-activation splits and fitted routers: per layer, `Σ_t |h_i||h_j|` over
/// the FFN's hidden neurons, and (once clusters are known) `XᵀX` and `XᵀA` of the FFN input
/// against each expert's activation mass.
struct Collector {
    n_ff: usize,
    /// `[layer]`: `n_ff x n_ff` co-activation sums, when gathered.
    coact: Option<Vec<Vec<f64>>>,
    /// `[layer]`: `Σ_t h_i²` per neuron, when gathered.
    sq: Option<Vec<Vec<f64>>>,
    /// `[layer]`: experts' neuron lists, when fitting routers.
    clusters: Option<Vec<Vec<Vec<usize>>>>,
    xtx: Vec<Vec<f64>>,
    xta: Vec<Vec<f64>>,
    last_x: Vec<f32>,
    d: usize,
}

impl Observer for Collector {
    fn observe(&mut self, layer: usize, site: Site, x: &[f32], width: usize) {
        match site {
            Site::FfnInput if self.clusters.is_some() => {
                self.last_x.clear();
                self.last_x.extend_from_slice(x);
                let g = &mut self.xtx[layer];
                for row in x.chunks_exact(width) {
                    for (i, &a) in row.iter().enumerate() {
                        for (gv, &b) in g[i * width..(i + 1) * width].iter_mut().zip(row) {
                            *gv += f64::from(a) * f64::from(b);
                        }
                    }
                }
            }
            Site::FfnDownInput => {
                if let Some(sq) = &mut self.sq {
                    for row in x.chunks_exact(width) {
                        for (s, &v) in sq[layer].iter_mut().zip(row) {
                            *s += f64::from(v) * f64::from(v);
                        }
                    }
                }
                if let Some(c) = &mut self.coact {
                    let g = &mut c[layer];
                    let n = self.n_ff;
                    for row in x.chunks_exact(width) {
                        for (i, &a) in row.iter().enumerate() {
                            let a = f64::from(a.abs());
                            for (gv, &b) in g[i * n..(i + 1) * n].iter_mut().zip(row) {
                                *gv += a * f64::from(b.abs());
                            }
                        }
                    }
                }
                if let Some(cl) = &self.clusters {
                    let experts = &cl[layer];
                    let e = experts.len();
                    let d = self.d;
                    for (row, xr) in x.chunks_exact(width).zip(self.last_x.chunks_exact(d)) {
                        for (k, members) in experts.iter().enumerate() {
                            let mass: f64 = members.iter().map(|&i| f64::from(row[i].abs())).sum();
                            for (j, &xv) in xr.iter().enumerate() {
                                self.xta[layer][j * e + k] += f64::from(xv) * mass;
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// Runs the calibration windows through `model` with `col` observing.
fn calibrate(
    model: &Model,
    tokens: &[u32],
    ctx: usize,
    col: &mut Collector,
) -> Result<(), SurgeryError> {
    if ctx == 0 || tokens.len() < ctx {
        return Err(SurgeryError::Invalid(format!(
            "the calibration text has {} tokens, shorter than one window of {ctx}",
            tokens.len()
        )));
    }
    let mut kv = model
        .new_seq_cache(ctx, &crate::kv::KvOptions::default())
        .map_err(|e| SurgeryError::Invalid(e.to_string()))?;
    let mut s = Scratch::default();
    for w in tokens.chunks_exact(ctx) {
        kv.clear();
        model
            .forward_observed(w, &mut kv, &mut s, Logits::Last, Some(col))
            .map_err(|e| SurgeryError::Invalid(e.to_string()))?;
    }
    Ok(())
}

/// Splits the `n` rows of `feat` (`dim` wide, unit length) into `k` clusters of exactly `n / k`
/// by balanced k-means: centroids from a seeded spread of points, then rounds of assignment (the
/// most similar (point, centroid) pairs first, a cluster closing when full) and re-centring,
/// until nothing moves or 20 rounds. Clusters come out sorted by their first neuron.
pub fn balanced_kmeans(feat: &[f32], dim: usize, k: usize, seed: u64) -> Vec<Vec<usize>> {
    let n = feat.len() / dim;
    let cap = n / k;
    let row = |i: usize| &feat[i * dim..(i + 1) * dim];
    // A seeded permutation; the centroids start at its first k points.
    let mut order: Vec<usize> = (0..n).collect();
    let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for i in (1..n).rev() {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        order.swap(i, (st % (i as u64 + 1)) as usize);
    }
    let mut cent: Vec<f32> = order[..k].iter().flat_map(|&i| row(i).to_vec()).collect();
    let mut assign = vec![usize::MAX; n];
    for _ in 0..20 {
        let mut pairs: Vec<(f32, u32, u32)> = Vec::with_capacity(n * k);
        for i in 0..n {
            for c in 0..k {
                let s: f32 = row(i)
                    .iter()
                    .zip(&cent[c * dim..(c + 1) * dim])
                    .map(|(a, b)| a * b)
                    .sum();
                pairs.push((s, i as u32, c as u32));
            }
        }
        pairs.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut next = vec![usize::MAX; n];
        let mut fill = vec![0usize; k];
        for (_, i, c) in pairs {
            let (i, c) = (i as usize, c as usize);
            if next[i] == usize::MAX && fill[c] < cap {
                next[i] = c;
                fill[c] += 1;
            }
        }
        let moved = next != assign;
        assign = next;
        cent.iter_mut().for_each(|v| *v = 0.0);
        for (i, &c) in assign.iter().enumerate() {
            for (a, &b) in cent[c * dim..(c + 1) * dim].iter_mut().zip(row(i)) {
                *a += b;
            }
        }
        for c in cent.chunks_exact_mut(dim) {
            let norm = c.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-20);
            c.iter_mut().for_each(|v| *v /= norm);
        }
        if !moved {
            break;
        }
    }
    let mut clusters = vec![Vec::new(); k];
    for (i, &c) in assign.iter().enumerate() {
        clusters[c].push(i);
    }
    clusters.sort_by_key(|c| c.first().copied());
    clusters
}

fn unit_rows(x: &mut [f32], dim: usize) {
    for r in x.chunks_exact_mut(dim) {
        let norm = r.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-20);
        r.iter_mut().for_each(|v| *v /= norm);
    }
}

/// An F32 tensor of `values` (the routers).
fn f32_tensor(name: String, dims: Vec<u64>, values: &[f32]) -> TensorData<'static> {
    TensorData {
        name,
        dims,
        ty: GgmlType::F32,
        data: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
    }
}

fn decode(t: &TensorData) -> Result<Vec<f32>, SurgeryError> {
    let n = t.dims.iter().product::<u64>() as usize;
    quant::dequantize_to_vec(t.ty, &t.data, n).map_err(|e| SurgeryError::Quant(t.name.clone(), e))
}

/// Scales router rows (`e x d`) so the logits of a normalized input (`gamma`, the FFN norm's
/// gains, times unit-RMS values) have a spread of about 0.01: a near-uniform softmax.
fn soften(router: &mut [f32], gamma: &[f32]) {
    let d = gamma.len();
    let spread = router
        .chunks_exact(d)
        .map(|r| {
            r.iter()
                .zip(gamma)
                .map(|(a, g)| (a * g) * (a * g))
                .sum::<f32>()
                .sqrt()
        })
        .fold(0f32, f32::max)
        .max(1e-20);
    router.iter_mut().for_each(|v| *v *= 0.01 / spread);
}

/// Solves `(XᵀX + λI) r = Xᵀa` for each expert's column of `xta` (`d x e`), by Cholesky.
fn ridge(xtx: &[f64], xta: &[f64], d: usize, e: usize) -> Result<Vec<f32>, SurgeryError> {
    let trace: f64 = (0..d).map(|i| xtx[i * d + i]).sum();
    let lambda = 1e-3 * trace / d as f64 + 1e-12;
    let a = nalgebra::DMatrix::from_fn(d, d, |i, j| {
        xtx[i * d + j] + if i == j { lambda } else { 0.0 }
    });
    let chol = a
        .cholesky()
        .ok_or_else(|| SurgeryError::Invalid("router fit: singular input statistics".into()))?;
    let b = nalgebra::DMatrix::from_fn(d, e, |j, k| xta[j * e + k]);
    let r = chol.solve(&b);
    Ok((0..e)
        .flat_map(|k| (0..d).map(move |j| (k, j)))
        .map(|(k, j)| r[(j, k)] as f32)
        .collect())
}

/// Turns the dense model `model` (read from `file`) into a MoE file: every layer's FFN split
/// into `t.n_expert` experts routed `t.n_used` at a time. `calib` (token ids, window) is needed
/// for the co-activation split and the fitted router.
pub fn moefy<'a>(
    file: &'a GgufFile,
    model: &Model,
    calib: Option<(&[u32], usize)>,
    t: &MoefyTarget,
) -> Result<(GgufWriter<'a>, MoeReport), SurgeryError> {
    let c = Config::from_gguf(file)?;
    if c.moe.is_some() || c.mla.is_some() {
        return Err(SurgeryError::Invalid(
            "moefy takes a dense model with per-head attention".into(),
        ));
    }
    let mut w = GgufWriter::from_file(file);
    let down_ty = matrix(&w, "blk.0.ffn_down.weight")?.ty;
    let block = down_ty.block_size().max(1);
    if t.shared >= c.n_ff || !t.shared.is_multiple_of(block) {
        return Err(SurgeryError::Invalid(format!(
            "--shared {}: the shared expert takes whole blocks of {block} neurons and leaves some \
             of the {} to route",
            t.shared, c.n_ff
        )));
    }
    let width = check_shape(c.n_ff - t.shared, t.n_expert, t.n_used, block)?;
    let needs = t.split == Split::Coactivation || t.router == RouterInit::Fit || t.shared > 0;
    let calib = match (needs, calib) {
        (true, None) => {
            return Err(SurgeryError::Invalid(
                "the co-activation split, the fitted router and the shared expert need a \
                 calibration text"
                    .into(),
            ));
        }
        (_, c) => c,
    };
    let (d, ff, e) = (c.n_embd, c.n_ff, t.n_expert);
    let mut col = Collector {
        n_ff: ff,
        coact: None,
        sq: None,
        clusters: None,
        xtx: Vec::new(),
        xta: Vec::new(),
        last_x: Vec::new(),
        d,
    };
    if t.split == Split::Coactivation || t.shared > 0 {
        if t.split == Split::Coactivation {
            col.coact = Some(vec![vec![0.0; ff * ff]; c.n_layers]);
        }
        col.sq = Some(vec![vec![0.0; ff]; c.n_layers]);
        // `n_ff²` products per token and layer: the first windows up to 512 tokens suffice.
        let (tokens, ctx) = calib.expect("checked");
        let used = tokens.len().min(ctx.max(512) / ctx * ctx);
        calibrate(model, &tokens[..used], ctx, &mut col)?;
    }
    let mut clusters = Vec::new();
    let mut shared = Vec::new();
    for l in 0..c.n_layers {
        // The shared neurons: the most active; the rest are routed.
        let mut by_mass: Vec<usize> = (0..ff).collect();
        if let Some(sq) = &col.sq {
            by_mass.sort_by(|&a, &b| sq[l][b].total_cmp(&sq[l][a]).then(a.cmp(&b)));
        }
        let mut always: Vec<usize> = by_mass[..t.shared].to_vec();
        always.sort_unstable();
        let routed: Vec<usize> = (0..ff)
            .filter(|i| always.binary_search(i).is_err())
            .collect();
        let n = routed.len();
        let feat = match &col.coact {
            Some(co) => {
                let g = &co[l];
                let mut f: Vec<f32> = Vec::with_capacity(n * n);
                for &i in &routed {
                    for &j in &routed {
                        let v = g[i * ff + j] / (g[i * ff + i] * g[j * ff + j]).sqrt().max(1e-30);
                        f.push(v as f32);
                    }
                }
                unit_rows(&mut f, n);
                f
            }
            None => {
                let gate = decode(matrix(&w, &format!("blk.{l}.ffn_gate.weight"))?)?;
                let mut f: Vec<f32> = routed
                    .iter()
                    .flat_map(|&i| gate[i * d..(i + 1) * d].iter().copied())
                    .collect();
                unit_rows(&mut f, d);
                f
            }
        };
        let dim = feat.len() / n;
        let groups = balanced_kmeans(&feat, dim, e, t.seed.wrapping_add(l as u64));
        clusters.push(
            groups
                .into_iter()
                .map(|g| g.into_iter().map(|i| routed[i]).collect::<Vec<_>>())
                .collect::<Vec<_>>(),
        );
        shared.push(always);
    }
    col.coact = None;
    col.sq = None;
    if t.router == RouterInit::Fit {
        col.xtx = vec![vec![0.0; d * d]; c.n_layers];
        col.xta = vec![vec![0.0; d * e]; c.n_layers];
        col.clusters = Some(clusters.clone());
        let (tokens, ctx) = calib.expect("checked");
        calibrate(model, tokens, ctx, &mut col)?;
    }

    let arch = c.arch.clone();
    w.set(&format!("{arch}.expert_count"), Value::U32(e as u32));
    w.set(
        &format!("{arch}.expert_used_count"),
        Value::U32(t.n_used as u32),
    );
    if t.shared > 0 {
        w.set(
            &format!("{arch}.expert_shared_feed_forward_length"),
            Value::U32(t.shared as u32),
        );
    }
    w.set(
        &format!("{arch}.feed_forward_length"),
        Value::U32(width as u32),
    );
    let mut new = Vec::new();
    for (l, experts) in clusters.iter().enumerate() {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let gate = matrix(&w, &name("ffn_gate"))?;
        let up = matrix(&w, &name("ffn_up"))?;
        let down = matrix(&w, &name("ffn_down"))?;
        let gamma = decode(matrix(&w, &name("ffn_norm"))?)?;
        let mut router = match t.router {
            RouterInit::Centroid => {
                let mut g = decode(gate)?;
                unit_rows(&mut g, d);
                let mut r = vec![0f32; e * d];
                for (k, members) in experts.iter().enumerate() {
                    for &i in members {
                        for (a, &b) in r[k * d..(k + 1) * d].iter_mut().zip(&g[i * d..(i + 1) * d])
                        {
                            *a += b / members.len() as f32;
                        }
                    }
                }
                r
            }
            RouterInit::Fit => ridge(&col.xtx[l], &col.xta[l], d, e)?,
        };
        soften(&mut router, &gamma);
        let stack = |parts: Vec<TensorData>, tname: &str| -> TensorData<'static> {
            let dims = vec![parts[0].dims[0], parts[0].dims[1], e as u64];
            TensorData {
                name: name(tname),
                dims,
                ty: parts[0].ty,
                data: Cow::Owned(parts.iter().flat_map(|p| p.data.iter().copied()).collect()),
            }
        };
        let rows = |m: &[usize]| m.iter().map(|&i| i..i + 1).collect::<Vec<_>>();
        let gates = experts
            .iter()
            .map(|m| select_rows(gate, &rows(m)))
            .collect();
        let ups = experts.iter().map(|m| select_rows(up, &rows(m))).collect();
        // Down projections (decoded once) by columns: the routed ones times k, so that the
        // near-uniform weights 1/k of the chosen experts add up to their plain sum; the shared
        // expert's as they are (it is always on).
        let dense_down = decode(down)?;
        let columns = |cols: &[usize],
                       scale: f32,
                       tname: &str|
         -> Result<TensorData<'static>, SurgeryError> {
            let vals: Vec<f32> = dense_down
                .chunks_exact(ff)
                .flat_map(|row| cols.iter().map(move |&j| row[j] * scale))
                .collect();
            Ok(TensorData {
                name: name(tname),
                dims: vec![cols.len() as u64, d as u64],
                ty: down_ty,
                data: Cow::Owned(
                    quant::quantize(down_ty, &vals)
                        .map_err(|e| SurgeryError::Quant(down.name.clone(), e))?,
                ),
            })
        };
        let downs = experts
            .iter()
            .map(|m| columns(m, t.n_used as f32, "ffn_down_exps"))
            .collect::<Result<Vec<_>, SurgeryError>>()?;
        let always = &shared[l];
        let shexp = if always.is_empty() {
            Vec::new()
        } else {
            let rename = |t: TensorData<'static>, n: &str| TensorData { name: name(n), ..t };
            vec![
                rename(select_rows(gate, &rows(always)), "ffn_gate_shexp"),
                rename(select_rows(up, &rows(always)), "ffn_up_shexp"),
                columns(always, 1.0, "ffn_down_shexp")?,
            ]
        };
        new.push((
            l,
            [
                f32_tensor(name("ffn_gate_inp"), vec![d as u64, e as u64], &router),
                stack(gates, "ffn_gate_exps"),
                stack(ups, "ffn_up_exps"),
                stack(downs, "ffn_down_exps"),
            ]
            .into_iter()
            .chain(shexp)
            .collect(),
        ));
    }
    replace_ffns(&mut w, new);
    let report = report_of(&w, e, t.n_used, width);
    Ok((w, report))
}

/// Replaces each listed layer's `ffn_gate`/`ffn_up`/`ffn_down` by its MoE tensors, in place.
fn replace_ffns<'a>(w: &mut GgufWriter<'a>, new: Vec<(usize, Vec<TensorData<'static>>)>) {
    for (l, tensors) in new {
        let dense = |s: &str| format!("blk.{l}.{s}.weight");
        let at = w
            .tensors
            .iter()
            .position(|t| t.name == dense("ffn_gate"))
            .unwrap_or(w.tensors.len());
        w.tensors
            .retain(|t| ![dense("ffn_gate"), dense("ffn_up"), dense("ffn_down")].contains(&t.name));
        let at = at.min(w.tensors.len());
        for (i, t) in tensors.into_iter().enumerate() {
            w.tensors.insert(at + i, t);
        }
    }
}

/// Total and active parameters of a written MoE file, counted as `frugal estimate` and
/// `frugal info` count them: active excludes the input embedding table and the experts a token
/// is not routed to.
fn report_of(w: &GgufWriter, e: usize, k: usize, width: usize) -> MoeReport {
    let mut total = 0u64;
    let mut active = 0f64;
    for t in &w.tensors {
        let n = t.dims.iter().product::<u64>();
        total += n;
        active += n as f64 * active_fraction(&t.name, k as f64 / e as f64);
    }
    MoeReport {
        n_expert: e,
        n_used: k,
        expert_width: width,
        total_params: total,
        active_params: active.round() as u64,
    }
}

/// Sparse upcycling: `copies` experts per layer, each the dense FFN (plus noise of `noise`
/// times each matrix's RMS, so they can diverge when trained), routed `n_used` at a time by a
/// small random router. With weights renormalized to one and identical experts, the layer starts
/// as the dense FFN.
pub fn upcycle<'a>(
    file: &'a GgufFile,
    copies: usize,
    n_used: usize,
    noise: f32,
    seed: u64,
) -> Result<(GgufWriter<'a>, MoeReport), SurgeryError> {
    let c = Config::from_gguf(file)?;
    if c.moe.is_some() || c.mla.is_some() {
        return Err(SurgeryError::Invalid(
            "upcycling takes a dense model with per-head attention".into(),
        ));
    }
    check_shape(c.n_ff * copies, copies, n_used, 1)?;
    let mut st = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rnd = move || {
        st ^= st << 13;
        st ^= st >> 7;
        st ^= st << 17;
        (st >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let mut w = GgufWriter::from_file(file);
    let arch = c.arch.clone();
    w.set(&format!("{arch}.expert_count"), Value::U32(copies as u32));
    w.set(
        &format!("{arch}.expert_used_count"),
        Value::U32(n_used as u32),
    );
    let d = c.n_embd;
    let mut new = Vec::new();
    for l in 0..c.n_layers {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let gamma = decode(matrix(&w, &name("ffn_norm"))?)?;
        let mut router: Vec<f32> = (0..copies * d).map(|_| rnd()).collect();
        soften(&mut router, &gamma);
        let mut stacked = Vec::new();
        for (dense, tname) in [
            ("ffn_gate", "ffn_gate_exps"),
            ("ffn_up", "ffn_up_exps"),
            ("ffn_down", "ffn_down_exps"),
        ] {
            let m = matrix(&w, &name(dense))?;
            let x = decode(m)?;
            let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
            let mut data = Vec::new();
            for _ in 0..copies {
                let y: Vec<f32> = x.iter().map(|&v| v + noise * rms * rnd()).collect();
                data.extend(
                    quant::quantize(m.ty, &y)
                        .map_err(|e| SurgeryError::Quant(m.name.clone(), e))?,
                );
            }
            stacked.push(TensorData {
                name: name(tname),
                dims: vec![m.dims[0], m.dims[1], copies as u64],
                ty: m.ty,
                data: Cow::Owned(data),
            });
        }
        let [g, u, dn]: [TensorData<'static>; 3] = stacked
            .try_into()
            .map_err(|_| SurgeryError::Invalid("three FFN matrices".into()))?;
        new.push((
            l,
            [
                f32_tensor(name("ffn_gate_inp"), vec![d as u64, copies as u64], &router),
                g,
                u,
                dn,
            ]
            .into(),
        ));
    }
    replace_ffns(&mut w, new);
    let report = report_of(&w, copies, n_used, c.n_ff);
    Ok((w, report))
}

#[cfg(test)]
mod tests;
