//! Attention kernels and KV-cache storages through the whole forward pass, on small synthetic
//! models (head_dim 32 so every KV type, Q8_0 included, applies).

use frugal::attention::Attention;
use frugal::gguf::GgufFile;
use frugal::kv::{KvFormat, KvLayout, KvOptions, KvSequence, KvType};
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::model::{Logits, Model, Scratch};
use frugal::quant::GgmlType;

fn model(n_head: usize, n_head_kv: usize) -> Model {
    let spec = SyntheticSpec {
        n_embd: 128,
        n_head,
        n_head_kv,
        n_ctx: 512,
        ty: GgmlType::Q8_0,
        ..Default::default()
    };
    Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 256).collect()
}

/// Runs `seq` through the model in pieces of `chunk` tokens; returns every position's logits.
fn run(
    model: &Model,
    kv: &mut dyn KvSequence,
    attention: Attention,
    seq: &[u32],
    chunk: usize,
) -> Vec<f32> {
    let mut s = Scratch::new(attention);
    let mut out = Vec::new();
    for c in seq.chunks(chunk) {
        out.extend_from_slice(model.forward(c, kv, &mut s, Logits::All).unwrap());
    }
    out
}

fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn paged_and_contiguous_give_identical_logits_for_every_format_and_kernel() {
    let m = model(4, 2);
    let seq = tokens(100);
    // Blocks of 16, and of 5: keys kept by column (f32, f16, bf16) then come in runs shorter
    // than a vector.
    for (ty, block_size) in KvType::ALL.into_iter().flat_map(|t| [(t, 16), (t, 5)]) {
        for attention in [Attention::Naive, Attention::Flash] {
            let opts = |layout| KvOptions {
                format: KvFormat::both(ty),
                layout,
            };
            let mut flat = m.new_seq_cache(128, &opts(KvLayout::Contiguous)).unwrap();
            let mut paged = m
                .new_seq_cache(128, &opts(KvLayout::Paged { block_size }))
                .unwrap();
            // Chunks that straddle block boundaries, then single-token decode steps.
            let a = [
                run(&m, &mut flat, attention, &seq[..90], 23),
                run(&m, &mut flat, attention, &seq[90..], 1),
            ]
            .concat();
            let b = [
                run(&m, &mut paged, attention, &seq[..90], 23),
                run(&m, &mut paged, attention, &seq[90..], 1),
            ]
            .concat();
            assert_eq!(
                a, b,
                "{ty} {attention} blocks of {block_size}: the same values read through a block table"
            );
        }
    }
}

#[test]
fn naive_and_flash_agree_through_the_model() {
    for (h, kvh) in [(4, 4), (4, 2), (4, 1)] {
        let m = model(h, kvh);
        let seq = tokens(300);
        let mut a = m.new_seq_cache(300, &KvOptions::default()).unwrap();
        let mut b = m.new_seq_cache(300, &KvOptions::default()).unwrap();
        let naive = run(&m, &mut a, Attention::Naive, &seq, 128);
        let flash = run(&m, &mut b, Attention::Flash, &seq, 128);
        // Attention agrees to ~1e-6; the rest of the pass only propagates that.
        let e = rel_err(&flash, &naive);
        // Not bitwise equal: the kernels sum in different orders (so both really ran).
        assert!(e < 1e-5 && e > 0.0, "heads {h}/{kvh}: {e}");
    }
}

#[test]
fn lower_precision_caches_stay_close_to_f32() {
    let m = model(4, 2);
    let seq = tokens(200);
    let mut base = m.new_seq_cache(200, &KvOptions::default()).unwrap();
    let want = run(&m, &mut base, Attention::Flash, &seq, 64);
    // Bounds from each format's precision (relative rounding 2^-11, 2^-8, 1/254 of the block
    // maximum) carried through two layers, with margin; mixed K/V sit between their parts.
    for (k, v, tol) in [
        (KvType::F16, KvType::F16, 2e-3),
        (KvType::Bf16, KvType::Bf16, 2e-2),
        (KvType::Q8_0, KvType::Q8_0, 2e-2),
        (KvType::Q8_0, KvType::F16, 2e-2),
    ] {
        let opts = KvOptions {
            format: KvFormat { k, v },
            ..Default::default()
        };
        let mut kv = m.new_seq_cache(200, &opts).unwrap();
        let got = run(&m, &mut kv, Attention::Flash, &seq, 64);
        let e = rel_err(&got, &want);
        assert!(e < tol && e > 0.0, "K {k} / V {v}: {e}");
    }
}

#[test]
fn forked_sequences_share_their_prefix_and_match_fresh_runs() {
    let m = model(4, 2);
    let prompt = tokens(40);
    let mut pool = m.new_kv_pool(KvFormat::both(KvType::F16), 16, 16).unwrap();
    let root = pool.add_sequence(128);
    let mut s = Scratch::default();
    m.forward(&prompt, &mut pool.slot(root), &mut s, Logits::Last)
        .unwrap();
    let used = pool.blocks_in_use();
    let kids: Vec<_> = (0..3).map(|_| pool.fork(root).unwrap()).collect();
    assert_eq!(pool.blocks_in_use(), used, "forks copy nothing up front");
    for (i, &kid) in kids.iter().enumerate() {
        let cont: Vec<u32> = (0..20).map(|j| (j * 13 + i as u32 * 50) % 256).collect();
        let mut got = Vec::new();
        for &t in &cont {
            got = m
                .forward(&[t], &mut pool.slot(kid), &mut s, Logits::Last)
                .unwrap()
                .to_vec();
        }
        // A fresh contiguous cache over the whole sequence.
        let full = [prompt.clone(), cont].concat();
        let opts = KvOptions {
            format: KvFormat::both(KvType::F16),
            layout: KvLayout::Contiguous,
        };
        let mut flat = m.new_seq_cache(128, &opts).unwrap();
        // Same chunking as the fork's history: the prompt at once, then token by token.
        run(&m, &mut flat, Attention::Flash, &full[..40], 40);
        let want = run(&m, &mut flat, Attention::Flash, &full[40..], 1);
        assert_eq!(got, want[want.len() - got.len()..], "fork {i}");
    }
    // Two full prefix blocks stay shared; each fork copied the partial one and grew.
    assert_eq!(pool.block_table(kids[0])[..2], pool.block_table(root)[..2]);
    for kid in kids {
        pool.remove(kid).unwrap();
    }
    assert_eq!(
        pool.blocks_in_use(),
        used,
        "the forks' own blocks returned to the pool"
    );
    pool.remove(root).unwrap();
    assert_eq!(pool.blocks_in_use(), 0);
}

#[test]
fn a_full_pool_is_an_error_not_a_panic() {
    let m = model(4, 2);
    let mut pool = m.new_kv_pool(KvFormat::default(), 16, 2).unwrap();
    let a = pool.add_sequence(512);
    let mut s = Scratch::default();
    let err = m
        .forward(&tokens(40), &mut pool.slot(a), &mut s, Logits::Last)
        .unwrap_err();
    assert!(err.to_string().contains("pool exhausted"), "{err}");
    assert_eq!(pool.seq_len(a), 0);
}
