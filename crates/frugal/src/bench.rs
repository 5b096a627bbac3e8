//! Throughput measurements in llama-bench's terms, so figures compare directly:
//! `pp N` = prefill of N tokens in one batch from an empty cache; `tg N` = N single-token decode
//! steps from an empty cache; either after a prefix of `depth` tokens (`-d`). Plus the machine's
//! read bandwidth and the decode roofline it implies: every weight byte and every cached byte
//! attention reads, once per generated token, over the bandwidth of a working set that size.

use std::time::Instant;

use rayon::prelude::*;

use crate::error::Result;
use crate::eval::EvalOptions;
use crate::kv::{KvSequence, SeqCache};
use crate::model::{Logits, Model, Scratch};
use crate::pages::Pages;

/// Repeated timings of one test, in tokens per second.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Throughput {
    pub tokens: usize,
    /// Every timed run, in the order they ran.
    pub runs: Vec<f64>,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// The median of `values` (0 when empty; the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl Throughput {
    fn from_runs(tokens: usize, runs: Vec<f64>) -> Self {
        Throughput {
            tokens,
            min: runs.iter().copied().reduce(f64::min).unwrap_or(0.0),
            max: runs.iter().copied().reduce(f64::max).unwrap_or(0.0),
            median: median(&runs),
            runs,
        }
    }
}

/// Deterministic pseudo-random token ids (what is fed does not change the cost).
fn tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % n_vocab as u64) as u32
        })
        .collect()
}

/// Prefill: `n` tokens in one batch from an empty cache (run as `opts` says), `reps` times
/// after one warm-up.
pub fn prefill(model: &Model, n: usize, reps: usize, opts: &EvalOptions) -> Result<Throughput> {
    prefill_at(model, n, 0, reps, opts)
}

/// Decode: `n` single-token steps from an empty cache (run as `opts` says), `reps` times after
/// one warm-up.
pub fn decode(model: &Model, n: usize, reps: usize, opts: &EvalOptions) -> Result<Throughput> {
    decode_at(model, n, 0, reps, opts)
}

/// Times `step` (which processes `toks` into the cache) `reps` times after one warm-up, each
/// from a cache holding the same `depth` positions (computed once, untimed). `between` runs,
/// untimed, before the first timed run, between runs and after the last.
fn timed_at(
    model: &Model,
    toks: &[u32],
    depth: usize,
    reps: usize,
    opts: &EvalOptions,
    step: impl Fn(&[u32], &mut SeqCache, &mut Scratch) -> Result<()>,
    mut between: impl FnMut(),
) -> Result<Throughput> {
    let n = toks.len();
    let mut s = Scratch::new(opts.attention);
    let mut kv = cache_at(model, depth, n, opts, &mut s)?;
    let mut runs = Vec::with_capacity(reps);
    for rep in 0..=reps {
        kv.truncate(depth);
        if rep > 0 {
            between();
        }
        let t = Instant::now();
        step(toks, &mut kv, &mut s)?;
        if rep > 0 {
            runs.push(n as f64 / t.elapsed().as_secs_f64());
        }
    }
    between();
    Ok(Throughput::from_runs(n, runs))
}

/// A cache for `depth + n` positions holding a prefix of `depth` tokens.
fn cache_at(
    model: &Model,
    depth: usize,
    n: usize,
    opts: &EvalOptions,
    s: &mut Scratch,
) -> Result<SeqCache> {
    let mut kv = model.new_seq_cache(depth + n, &opts.kv)?;
    // The prefix in chunks, as a server would prefill it: one call's score matrix stays bounded.
    for chunk in tokens(depth, model.config.n_vocab, 3).chunks(512) {
        model.forward(chunk, &mut kv as &mut dyn KvSequence, s, Logits::Last)?;
    }
    Ok(kv)
}

/// [`prefill`] after a prefix of `depth` tokens in the cache (llama-bench's `pp N @ dD`).
pub fn prefill_at(
    model: &Model,
    n: usize,
    depth: usize,
    reps: usize,
    opts: &EvalOptions,
) -> Result<Throughput> {
    let toks = tokens(n, model.config.n_vocab, 1);
    timed_at(
        model,
        &toks,
        depth,
        reps,
        opts,
        |toks, kv, s| {
            model.forward(toks, kv as &mut dyn KvSequence, s, Logits::Last)?;
            Ok(())
        },
        || (),
    )
}

/// [`decode`] after a prefix of `depth` tokens in the cache (llama-bench's `tg N @ dD`): where
/// long context costs, since every step reads the whole cache.
pub fn decode_at(
    model: &Model,
    n: usize,
    depth: usize,
    reps: usize,
    opts: &EvalOptions,
) -> Result<Throughput> {
    decode_probed(model, n, depth, reps, opts, || ()).map(|(t, _)| t)
}

/// [`decode_at`] that also calls `probe` (untimed) before the first timed run, between runs
/// and after the last, and returns what it measured: `reps + 1` values, run `i` between
/// probes `i` and `i + 1`.
/// On a shared machine the bandwidth moves between runs (on the Zen 4 VM this was measured
/// on, between about 35 and 62 GB/s over seconds), so each run is compared with a bound
/// measured beside it.
pub fn decode_probed<T>(
    model: &Model,
    n: usize,
    depth: usize,
    reps: usize,
    opts: &EvalOptions,
    mut probe: impl FnMut() -> T,
) -> Result<(Throughput, Vec<T>)> {
    let toks = tokens(n, model.config.n_vocab, 2);
    let mut probes = Vec::with_capacity(reps + 1);
    let t = timed_at(
        model,
        &toks,
        depth,
        reps,
        opts,
        |toks, kv, s| {
            for &tok in toks {
                model.forward(&[tok], kv as &mut dyn KvSequence, s, Logits::Last)?;
            }
            Ok(())
        },
        || probes.push(probe()),
    )?;
    Ok((t, probes))
}

/// Read bandwidth in bytes per second over a working set of `bytes`, read again and again as
/// decode reads its weights and cache every step: each thread streams its own contiguous share
/// with 256-bit loads (AVX2 where the CPU has it; the portable loop otherwise), one warm-up pass
/// and then the fastest of `passes` timed passes, as STREAM reports: other work on a shared
/// machine only ever slows a pass, so the fastest is the closest to what the memory delivers,
/// and the bound it gives is the highest one (a median taken while a neighbour ran once gave
/// this VM 23 GB/s against its usual 31-33, and decode "80%" of that bound). A working set
/// that fits the last-level cache (see [`last_level_cache_bytes`]) is served from it, as the
/// weights of a small model are, so the bound this gives is the one that actually holds for
/// them; [`DRAM_WORKING_SET`] measures memory itself.
pub fn read_bandwidth(bytes: usize, passes: usize) -> f64 {
    ReadProbe::new(bytes).fastest(passes)
}

/// The working set [`read_bandwidth`] streams, kept to be read again (a caller that measures
/// the same working set many times allocates and writes it once); [`decode_paired`] times one
/// pass of it before every decode step.
pub struct ReadProbe {
    words: ProbeWords,
    bytes: usize,
}

/// A probe's words: on (huge) pages where the system grants them, else on the heap.
enum ProbeWords {
    Pages(Pages),
    Heap(Vec<u64>),
}

impl ReadProbe {
    const CHUNK: usize = 1 << 20;

    /// At least `bytes` (rounded up to whole MiB) of u64 words written with distinct values, so
    /// every page is really backed; on huge pages where the system grants them, as the weights
    /// and the cache are (`crate::pages`), since a stream over small pages reads slower and
    /// would give a bound decode can pass.
    pub fn new(bytes: usize) -> Self {
        let bytes = bytes.max(Self::CHUNK).next_multiple_of(Self::CHUNK);
        let words = match Pages::zeroed(bytes, true) {
            Ok(mut p) => {
                for (i, w) in p.chunks_exact_mut(8).enumerate() {
                    w.copy_from_slice(&(i as u64).to_le_bytes());
                }
                ProbeWords::Pages(p)
            }
            Err(_) => ProbeWords::Heap((0..bytes as u64 / 8).collect()),
        };
        Self { words, bytes }
    }

    fn words(&self) -> &[u64] {
        match &self.words {
            // SAFETY: a mapping starts on a page boundary (8-byte aligned); `bytes` is a
            // multiple of 8 and every bit pattern is a u64.
            ProbeWords::Pages(p) => unsafe {
                std::slice::from_raw_parts(p.as_ptr().cast(), self.bytes / 8)
            },
            ProbeWords::Heap(h) => h,
        }
    }

    /// One warm-up pass, then the fastest of `passes` timed passes (see [`read_bandwidth`]).
    pub fn fastest(&self, passes: usize) -> f64 {
        self.pass();
        (0..passes.max(1)).map(|_| self.pass()).fold(0.0, f64::max)
    }

    /// One timed pass, in bytes per second: each of the pool's threads streams its own
    /// contiguous share.
    pub fn pass(&self) -> f64 {
        let buf = self.words();
        let threads = rayon::current_num_threads().max(1);
        let share = (buf.len() / threads).next_multiple_of(Self::CHUNK / 8);
        let t = Instant::now();
        let sum: u64 = buf
            .par_chunks(share)
            .map(sum_words)
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        self.bytes as f64 / t.elapsed().as_secs_f64()
    }
}

/// `n` decode steps after a prefix of `depth` tokens, each timed on its own right after one
/// pass of `probe` (which should read what a step reads): (seconds of the step, bytes per
/// second of the pass before it) for every step.
///
/// On a shared machine the bandwidth moves within seconds (the Zen 4 VM this was written on:
/// single passes over 184 MB between 25 and 68 GB/s in one three-second stretch, the median
/// anywhere from 32 to 61 GB/s from one minute to the next), and a `tg 128` run at depth
/// 4,096 lasts most of a second. A bound from the fastest pass of a few taken around a run
/// is one the run only met where it lasted the whole run. A pass and the step after it are a
/// few milliseconds apart and read the same bytes, so each step meets the bandwidth of the
/// moment it ran.
pub fn decode_paired(
    model: &Model,
    n: usize,
    depth: usize,
    opts: &EvalOptions,
    probe: &ReadProbe,
) -> Result<Vec<(f64, f64)>> {
    let toks = tokens(n, model.config.n_vocab, 2);
    let mut s = Scratch::new(opts.attention);
    let mut kv = cache_at(model, depth, n, opts, &mut s)?;
    // One untimed step first, so the first pair does not pay for the scratch buffers.
    if let Some(&t) = toks.first() {
        model.forward(&[t], &mut kv as &mut dyn KvSequence, &mut s, Logits::Last)?;
        kv.truncate(depth);
    }
    let mut pairs = Vec::with_capacity(n);
    for &tok in &toks {
        let bandwidth = probe.pass();
        let t = Instant::now();
        model.forward(&[tok], &mut kv as &mut dyn KvSequence, &mut s, Logits::Last)?;
        pairs.push((t.elapsed().as_secs_f64(), bandwidth));
    }
    Ok(pairs)
}

/// A working set well past any last-level cache this engine runs on, for the memory bandwidth.
pub const DRAM_WORKING_SET: usize = 1 << 30;

/// The wrapping sum of `words`, with vector loads where the CPU has them.
fn sum_words(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if let Some(t) = crate::cpu::Avx2::get() {
        // SAFETY: the token proves the loop's features.
        return unsafe { sum_words_avx2(t, words) };
    }
    sum_words_portable(words)
}

/// The scalar twin of [`sum_words_avx2`]: eight independent lanes.
fn sum_words_portable(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut chunks = words.chunks_exact(8);
    for ch in &mut chunks {
        for (a, &v) in acc.iter_mut().zip(ch) {
            *a = a.wrapping_add(v);
        }
    }
    chunks
        .remainder()
        .iter()
        .chain(&acc)
        .fold(0u64, |x, &y| x.wrapping_add(y))
}

/// Four 256-bit accumulators, 128 bytes per iteration: the loads, not the adds, set the pace.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_words_avx2(_: crate::cpu::Avx2, words: &[u64]) -> u64 {
    use std::arch::x86_64::*;
    let whole = words.len() / 16 * 16;
    let p = words.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 4];
    // SAFETY: reads words[i..i + 16] with i + 16 <= whole <= words.len() (unaligned loads).
    unsafe {
        for i in (0..whole).step_by(16) {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_epi64(*a, _mm256_loadu_si256(p.add(i + 4 * k).cast()));
            }
        }
    }
    let mut lanes = [0u64; 16];
    for (k, a) in acc.iter().enumerate() {
        // SAFETY: lanes has room for four u64 at 4k.
        unsafe { _mm256_storeu_si256(lanes.as_mut_ptr().add(4 * k).cast(), *a) };
    }
    words[whole..]
        .iter()
        .chain(&lanes)
        .fold(0u64, |x, &y| x.wrapping_add(y))
}

/// Size of the last-level cache (Linux sysfs: the highest-level data or unified cache of CPU 0),
/// or `None` where unknown.
pub fn last_level_cache_bytes() -> Option<u64> {
    let dir = std::path::Path::new("/sys/devices/system/cpu/cpu0/cache");
    let mut best: Option<(u32, u64)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let read = |f: &str| std::fs::read_to_string(entry.path().join(f)).ok();
        let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size"))
        else {
            continue;
        };
        if kind.trim() == "Instruction" {
            continue;
        }
        let Ok(level) = level.trim().parse::<u32>() else {
            continue;
        };
        let size = size.trim();
        let (num, mult) = match size.strip_suffix('K') {
            Some(n) => (n, 1u64 << 10),
            None => match size.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (size, 1),
            },
        };
        let Ok(n) = num.parse::<u64>() else { continue };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, n * mult));
        }
    }
    best.map(|(_, b)| b)
}

/// Cache bytes one decode step reads, averaged over the steps of a `tg n` test after `depth`
/// cached positions: attention reads every held position of every layer (a windowed layer only
/// its ring), keys and values in the cache's format.
pub fn kv_bytes_per_token(model: &Model, opts: &EvalOptions, depth: usize, n: usize) -> u64 {
    let c = &model.config;
    let rings = c.cache_rings();
    let steps = n.max(1);
    let total: u128 = (0..steps)
        .map(|i| {
            crate::kv::bytes_at(
                c.n_layers,
                c.cache_shape(),
                opts.kv.format,
                &rings,
                depth + i + 1,
            )
        })
        .sum();
    (total / steps as u128) as u64
}

/// Weight bytes one decode step reads: every matrix once (in the layout the kernels use) plus
/// one embedding row and the norms.
pub fn weight_bytes_per_token(model: &Model) -> u64 {
    let w = &model.weights;
    let matrices: u64 = w.matrices().map(|m| m.bytes_read() as u64).sum();
    let norms: usize = w
        .layers
        .iter()
        .map(|l| l.attn_norm.len() + l.ffn_norm.len())
        .sum::<usize>()
        + w.output_norm.len();
    let embd_row = w.token_embd.view().row_bytes() as u64;
    matrices + embd_row + 4 * norms as u64
}

/// Peak resident memory of this process so far (Linux `VmHWM`), or `None` where unavailable.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;
    use crate::model::synthetic::{SyntheticSpec, build};

    /// Every step gets its own timing and the bandwidth of the pass just before it; a probe
    /// covers at least the bytes asked for, in whole MiB.
    #[test]
    fn paired_decode_times_each_step_after_a_pass() {
        let model =
            Model::from_file(GgufFile::from_bytes(build(&SyntheticSpec::default())).unwrap())
                .unwrap();
        let probe = ReadProbe::new(3 << 20 | 5);
        assert_eq!(probe.bytes, 4 << 20);
        assert_eq!(probe.words().len(), (4 << 20) / 8);
        let opts = EvalOptions::default();
        let pairs = decode_paired(&model, 5, 7, &opts, &probe).unwrap();
        assert_eq!(pairs.len(), 5);
        for &(step, bw) in &pairs {
            assert!(step.is_finite() && step > 0.0, "step {step}");
            assert!(bw.is_finite() && bw > 0.0, "bandwidth {bw}");
        }
        assert!(
            decode_paired(&model, 0, 7, &opts, &probe)
                .unwrap()
                .is_empty()
        );
    }

    /// The vector sum is the portable one (wrapping adds commute), remainders included.
    #[test]
    fn vector_word_sums_equal_the_portable_ones() {
        let words: Vec<u64> = (0..1000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        for n in [0, 1, 7, 15, 16, 17, 31, 64, 999, 1000] {
            assert_eq!(
                sum_words(&words[..n]),
                sum_words_portable(&words[..n]),
                "{n}"
            );
        }
    }
}
