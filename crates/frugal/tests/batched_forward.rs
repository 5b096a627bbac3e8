//! The batched forward pass: several sequences of different lengths advanced in one call, with
//! chunked prefill mixed into decode steps, give every sequence the same logits, bit for bit,
//! as when it runs alone in one prefill and then one token at a time.
//!
//! That holds on the integer path (8-bit activations, the default and what the server runs):
//! the packed kernels compute each row on its own, and attention merges fixed key chunks in
//! order whatever the grouping (`attention::key_chunk`). On the f32-activation path nothing
//! guarantees it: a lone decode step runs `matvec`, a batch the tiled GEMM over dequantized
//! tiles. For Q4_1 they happen to agree too (a 4-bit code times an f16 scale is exact in f32,
//! so fused and unfused dequantization round alike, and both kernels add in the same lane
//! order); the test measures the difference and bounds it rather than requiring zero.

use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvOptions};
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::model::{Logits, Model, Scratch, Segment};
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;

fn model(act: Activations) -> Model {
    let spec = SyntheticSpec {
        n_layers: 2,
        n_embd: 64,
        n_ff: 128,
        n_head: 4,
        n_head_kv: 2,
        n_ctx: 1024,
        ty: GgmlType::Q4_1,
        ..Default::default()
    };
    let mut m = Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap();
    m.set_activations(act);
    m
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) % 256)
        .collect()
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

const STEPS: usize = 12;

/// Greedy continuation alone: one prefill, then one token per call. Returns each step's logits.
fn alone(m: &Model, p: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = m.new_seq_cache(1024, &KvOptions::default()).unwrap();
    let mut s = Scratch::default();
    let mut out = vec![
        m.forward(p, &mut kv, &mut s, Logits::Last)
            .unwrap()
            .to_vec(),
    ];
    for _ in 1..STEPS {
        let next = argmax(out.last().unwrap());
        out.push(
            m.forward(&[next], &mut kv, &mut s, Logits::Last)
                .unwrap()
                .to_vec(),
        );
    }
    out
}

/// The same sequences in one pool, advanced together: sequence `i` joins at step `i`, prompts
/// are fed in chunks of `chunk` tokens beside the other sequences' decode steps.
fn batched(m: &Model, prompts: &[Vec<u32>], chunk: usize) -> Vec<Vec<Vec<f32>>> {
    let mut pool = m.new_kv_pool(KvFormat::default(), 16, 256).unwrap();
    let mut s = Scratch::default();
    let ids: Vec<_> = prompts.iter().map(|_| pool.add_sequence(1024)).collect();
    let mut fed = vec![0usize; prompts.len()];
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    let mut step = 0;
    while logits.iter().any(|l| l.len() < STEPS) {
        let mut pending: Vec<(usize, Vec<u32>, bool)> = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            if i > step || logits[i].len() >= STEPS {
                continue;
            }
            if fed[i] < p.len() {
                let n = chunk.min(p.len() - fed[i]);
                let last = fed[i] + n == p.len();
                pending.push((i, p[fed[i]..fed[i] + n].to_vec(), last));
                fed[i] += n;
            } else {
                pending.push((i, vec![argmax(logits[i].last().unwrap())], true));
            }
        }
        let segs: Vec<Segment> = pending
            .iter()
            .map(|(i, t, want)| Segment {
                seq: ids[*i],
                tokens: t,
                logits: *want,
                all_logits: false,
            })
            .collect();
        let out = m.forward_batch(&segs, &mut pool, &mut s).unwrap();
        let v = m.config.n_vocab;
        let mut row = 0;
        for (i, _, want) in &pending {
            if *want {
                logits[*i].push(out[row * v..(row + 1) * v].to_vec());
                row += 1;
            }
        }
        step += 1;
    }
    logits
}

fn prompts() -> Vec<Vec<u32>> {
    // One short prompt, one within the first key chunk, two spanning several chunks.
    [3, 40, 300, 610]
        .iter()
        .enumerate()
        .map(|(i, &n)| prompt(n, i as u32))
        .collect()
}

#[test]
fn batched_sequences_equal_their_lone_runs_bit_for_bit() {
    let m = model(Activations::Q8);
    let prompts = prompts();
    let want: Vec<_> = prompts.iter().map(|p| alone(&m, p)).collect();
    for chunk in [7, 64, 1000] {
        let got = batched(&m, &prompts, chunk);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            for (step, (a, b)) in g.iter().zip(w).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "sequence {i} step {step}, prefill chunks of {chunk}");
            }
        }
    }
}

/// On the f32 path a batch may change the order of additions: any difference is rounding, a
/// few ulps of the logits' scale per product (bound 1e-4 relative; measured 0 for Q4_1).
#[test]
fn f32_activations_differ_from_lone_runs_only_by_rounding() {
    let m = model(Activations::F32);
    let prompts = prompts();
    let got = batched(&m, &prompts, 64);
    let mut worst = 0f32;
    for (g, p) in got.iter().zip(&prompts) {
        for (a, b) in g.iter().zip(alone(&m, p)) {
            let scale = b.iter().fold(0f32, |s, v| s.max(v.abs()));
            let d = a
                .iter()
                .zip(&b)
                .fold(0f32, |s, (x, y)| s.max((x - y).abs()));
            worst = worst.max(d / scale);
        }
    }
    eprintln!("f32 path: largest batched-vs-alone logit difference {worst:.2e} of the scale");
    assert!(worst < 1e-4, "{worst}");
}

#[test]
fn a_batch_that_does_not_fit_changes_nothing() {
    let m = model(Activations::Q8);
    // Room for 4 blocks of 16 positions.
    let mut pool = m.new_kv_pool(KvFormat::default(), 16, 4).unwrap();
    let mut s = Scratch::default();
    let (a, b) = (pool.add_sequence(1024), pool.add_sequence(1024));
    let p = prompt(40, 1);
    let segs = [
        Segment {
            seq: a,
            tokens: &p[..20],
            logits: true,
            all_logits: false,
        },
        Segment {
            seq: b,
            tokens: &p,
            logits: true,
            all_logits: false,
        },
    ];
    assert!(m.forward_batch(&segs, &mut pool, &mut s).is_err());
    assert_eq!(
        (pool.seq_len(a), pool.seq_len(b), pool.blocks_in_use()),
        (0, 0, 0)
    );
    let dup = [segs[0], segs[0]];
    assert!(m.forward_batch(&dup, &mut pool, &mut s).is_err());
    assert_eq!(pool.blocks_in_use(), 0);
    // Alone, each fits.
    m.forward_batch(&segs[..1], &mut pool, &mut s).unwrap();
    assert_eq!(pool.seq_len(a), 20);
}
