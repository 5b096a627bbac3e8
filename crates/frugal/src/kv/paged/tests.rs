use super::*;
use crate::kv::{KvCache, KvType};

fn rows(n: usize, kv_dim: usize, seed: f32) -> Vec<f32> {
    (0..n * kv_dim)
        .map(|i| ((i as f32 + seed) * 0.618).sin())
        .collect()
}

fn push(c: &mut dyn KvSequence, layers: usize, n: usize, kv_dim: usize, seed: f32) {
    c.reserve(n).unwrap();
    let k = rows(n, kv_dim, seed);
    let v = rows(n, kv_dim, seed + 0.5);
    for l in 0..layers {
        c.append(l, &k, &v);
    }
    c.commit(n);
}

fn read_all(view: KvView, heads: usize, kv_dim: usize) -> Vec<f32> {
    let mut out = vec![0f32; view.len() * kv_dim];
    view.decode_rows(heads, kv_dim / heads, 0, view.len(), &mut out);
    out
}

/// The paged layout stores keys-only rows the same way: blocks without value bytes.
#[test]
fn keys_only_blocks_hold_no_values() {
    let mut pool = KvPool::new(2, CacheShape::keys_only(8), KvFormat::default(), 4, 4).unwrap();
    let id = pool.add_sequence(16);
    pool.reserve(id, 5).unwrap();
    for l in 0..2 {
        pool.append(id, l, &rows(5, 8, l as f32), &[]);
    }
    pool.commit(id, 5);
    assert_eq!(pool.block_bytes(), 4 * 2 * 8 * 4);
    let (k, v) = pool.layer(id, 1);
    assert_eq!(read_all(k, 1, 8), rows(5, 8, 1.0));
    assert_eq!(read_all(v, 1, 8), rows(5, 8, 1.0));
}

#[test]
fn paged_reads_what_contiguous_reads_for_every_format() {
    for t in KvType::ALL {
        let f = KvFormat::both(t);
        // Two heads: the pool keeps a region per head, the contiguous cache whole rows.
        let mut pool = KvPool::new(2, CacheShape::new(2, 32), f, 4, 16).unwrap();
        let id = pool.add_sequence(50);
        let mut flat = KvCache::with_format(2, CacheShape::new(2, 32), 50, f).unwrap();
        for (n, seed) in [(3, 0.0), (1, 7.0), (9, 3.0), (5, 1.0)] {
            push(&mut pool.slot(id), 2, n, 64, seed);
            push(&mut flat, 2, n, 64, seed);
        }
        for l in 0..2 {
            let (pk, pv) = pool.layer(id, l);
            let (ck, cv) = KvSequence::layer(&flat, l);
            assert_eq!(read_all(pk, 2, 64), read_all(ck, 2, 64), "{t}");
            assert_eq!(read_all(pv, 2, 64), read_all(cv, 2, 64), "{t}");
        }
        assert_eq!(pool.blocks_in_use(), 18usize.div_ceil(4));
    }
}

/// Blocks taken one after another continue each head's run across their boundaries (one
/// stream per head for a growing sequence); a copied block breaks the run, not the values.
#[test]
fn consecutive_blocks_continue_a_heads_run() {
    let f = KvFormat::both(KvType::F16);
    let mut pool = KvPool::new(1, CacheShape::new(2, 8), f, 4, 8).unwrap();
    let a = pool.add_sequence(32);
    push(&mut pool.slot(a), 1, 10, 16, 0.0);
    let (k, v) = pool.layer(a, 0);
    for view in [k, v] {
        let (bytes, stride, m) = view.head_run(1, 8, 1, 100);
        assert_eq!((stride, m, bytes.len()), (16, 9, 9 * 16));
    }
    let b = pool.fork(a).unwrap();
    push(&mut pool.slot(b), 1, 1, 16, 3.0); // copies the shared partial block 2
    assert_eq!(pool.block_table(b), &[0, 1, 3]);
    let (kb, _) = pool.layer(b, 0);
    assert_eq!(kb.head_run(1, 8, 1, 100).1, 16);
    assert_eq!(
        kb.head_run(1, 8, 1, 100).2,
        7,
        "the run stops before the copied block"
    );
    let mut flat = KvCache::with_format(1, CacheShape::new(2, 8), 32, f).unwrap();
    push(&mut flat, 1, 10, 16, 0.0);
    assert_eq!(
        read_all(pool.layer(a, 0).0, 2, 16),
        read_all(KvSequence::layer(&flat, 0).0, 2, 16)
    );
    push(&mut flat, 1, 1, 16, 3.0);
    assert_eq!(
        read_all(kb, 2, 16),
        read_all(KvSequence::layer(&flat, 0).0, 2, 16)
    );
}

#[test]
fn fork_shares_prefix_copy_on_write_and_blocks_return() {
    let f = KvFormat::default();
    let mut pool = KvPool::new(1, CacheShape::new(1, 8), f, 4, 8).unwrap();
    let a = pool.add_sequence(32);
    push(&mut pool.slot(a), 1, 6, 8, 0.0); // blocks: [full, half]
    assert_eq!(pool.blocks_in_use(), 2);
    let b = pool.fork(a).unwrap();
    assert_eq!(pool.blocks_in_use(), 2, "a fork copies nothing");
    let before = read_all(pool.layer(a, 0).0, 1, 8);
    push(&mut pool.slot(b), 1, 1, 8, 9.0); // b writes into the shared half block: copied
    assert_eq!(pool.blocks_in_use(), 3);
    assert_eq!(
        pool.block_table(a)[0],
        pool.block_table(b)[0],
        "full block still shared"
    );
    assert_ne!(pool.block_table(a)[1], pool.block_table(b)[1]);
    assert_eq!(read_all(pool.layer(a, 0).0, 1, 8), before, "a is unchanged");
    assert_eq!(&read_all(pool.layer(b, 0).0, 1, 8)[..6 * 8], &before[..]);
    push(&mut pool.slot(a), 1, 1, 8, 5.0); // a now owns its half block alone: no copy
    assert_eq!(pool.blocks_in_use(), 3);
    pool.remove(a).unwrap();
    assert_eq!(
        pool.blocks_in_use(),
        2,
        "a's own block returned, shared one kept"
    );
    assert_eq!(pool.remove(a), Err(KvError::NoSequence(a.index())));
    pool.truncate(b, 2);
    assert_eq!(pool.blocks_in_use(), 1);
    pool.remove(b).unwrap();
    assert_eq!((pool.blocks_in_use(), pool.sequences()), (0, 0));
}

#[test]
fn exhaustion_and_context_limits_are_errors_that_change_nothing() {
    let mut pool = KvPool::new(1, CacheShape::new(1, 8), KvFormat::default(), 4, 2).unwrap();
    let a = pool.add_sequence(100);
    let b = pool.add_sequence(4);
    push(&mut pool.slot(a), 1, 5, 8, 0.0);
    assert!(matches!(
        pool.reserve(b, 1),
        Err(KvError::PoolExhausted {
            needed: 1,
            free: 0,
            total: 2
        })
    ));
    pool.remove(a).unwrap();
    assert!(matches!(
        pool.reserve(b, 5),
        Err(KvError::ContextFull { .. })
    ));
    assert_eq!(pool.blocks_in_use(), 0);
    assert!(KvPool::new(1, CacheShape::new(1, 8), KvFormat::default(), 0, 2).is_err());
}

/// A pool larger than any address space is an error, not an abort: 2^31 blocks of 2^26
/// positions of 32 bytes is 4 EiB of keys, a size that does not overflow but that no
/// allocation can give.
#[test]
fn a_pool_too_large_for_memory_is_an_error() {
    let f = KvFormat::default();
    let e = KvPool::new(1, CacheShape::new(1, 8), f, 1 << 26, 1 << 31).unwrap_err();
    assert!(matches!(e, KvError::Reserve { .. }), "{e}");
    // Beyond what a block table can number.
    let e = KvPool::new(1, CacheShape::new(1, 8), f, 1, 1 << 33).unwrap_err();
    assert!(matches!(e, KvError::Reserve { .. }), "{e}");
}

#[test]
fn cached_blocks_survive_their_sequence_and_are_evicted_lru() {
    use crate::kv::prefix::block_hashes;
    let mut pool = KvPool::new(1, CacheShape::new(1, 8), KvFormat::default(), 4, 6).unwrap();
    let toks: Vec<u32> = (0..10).collect();
    let hashes = block_hashes(&toks, 4); // two full blocks
    let a = pool.add_sequence(32);
    push(&mut pool.slot(a), 1, 10, 8, 0.0);
    for (i, &h) in hashes.iter().enumerate() {
        pool.register_block(a, i, h);
    }
    let rows_a = read_all(pool.layer(a, 0).0, 1, 8);
    pool.remove(a).unwrap();
    assert_eq!((pool.blocks_in_use(), pool.evictable_blocks()), (0, 2));
    assert_eq!(pool.free_blocks(), 6, "cached blocks count as free");

    // A new sequence with the same first 8 tokens attaches both blocks and shares them.
    let b = pool.add_sequence(32);
    assert_eq!(pool.cached_prefix(&hashes), 2);
    assert_eq!(pool.attach_prefix(b, &hashes, usize::MAX), 2);
    assert_eq!((pool.seq_len(b), pool.evictable_blocks()), (8, 0));
    assert_eq!(read_all(pool.layer(b, 0).0, 1, 8), rows_a[..8 * 8]);
    let c = pool.add_sequence(32);
    assert_eq!(pool.attach_prefix(c, &hashes, 1), 1, "capped");
    assert_eq!(pool.blocks_in_use(), 2);

    // Writing into a registered block copies it first: the cached contents stay intact.
    pool.truncate(b, 6);
    push(&mut pool.slot(b), 1, 1, 8, 42.0);
    assert_eq!(
        (pool.blocks_in_use(), pool.evictable_blocks()),
        (2, 1),
        "b holds a copy; the cached original waits in the LRU list"
    );
    let d = pool.add_sequence(32);
    pool.remove(b).unwrap();
    pool.remove(c).unwrap();
    assert_eq!(pool.attach_prefix(d, &hashes, usize::MAX), 2);
    assert_eq!(read_all(pool.layer(d, 0).0, 1, 8), rows_a[..8 * 8]);
    pool.remove(d).unwrap();

    // Filling the pool evicts cached blocks, the least recently released first.
    let e = pool.add_sequence(64);
    push(&mut pool.slot(e), 1, 4 * 5, 8, 1.0);
    assert_eq!(
        pool.cached_blocks(),
        1,
        "one of the two cached blocks evicted"
    );
    push(&mut pool.slot(e), 1, 4, 8, 1.0);
    assert_eq!(pool.cached_blocks(), 0);
    assert!(pool.reserve(e, 1).is_err());
    let f = pool.add_sequence(8);
    assert_eq!(pool.attach_prefix(f, &hashes, 9), 0);
}
