//! The per-token decode loop must not allocate once its buffers are warm: a counting global
//! allocator watches ten decode steps of a synthetic model (forward pass and a sampler with
//! every cut-off on), in both activation precisions.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use frugal::gguf::GgufFile;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::model::{Logits, Model, Scratch};
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;
use frugal::sample::{Sampler, SamplerParams};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn decode_steps_do_not_allocate() {
    // As the CLI does, run on a pool thread: calls from outside the pool go through rayon's
    // global injector queue, which allocates a block every few dozen jobs. One worker makes the
    // check deterministic: per-thread scratch (attention tiles, weight tiles) is allocated once
    // per thread on its first use, and with several workers which thread first runs which job
    // depends on scheduling.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(check_decode_allocations);
}

fn check_decode_allocations() {
    for act in [Activations::F32, Activations::Q8] {
        let spec = SyntheticSpec {
            ty: GgmlType::Q4_1,
            n_embd: 128,
            n_ff: 256,
            ..Default::default()
        };
        let mut model = Model::from_file(GgufFile::from_bytes(build(&spec)).unwrap()).unwrap();
        model.set_activations(act);
        let mut kv = model.new_cache(64).unwrap();
        let mut s = Scratch::default();
        model
            .forward(&[1, 2, 3, 4], &mut kv, &mut s, Logits::Last)
            .unwrap();
        // Warm-up steps grow the per-thread buffers to their working size.
        for t in 0..4 {
            model
                .forward(&[10 + t], &mut kv, &mut s, Logits::Last)
                .unwrap();
        }
        // A sampler with every cut-off on, warmed up by one draw.
        let mut sampler = Sampler::new(SamplerParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.05,
            repeat_penalty: 1.1,
            seed: 3,
            ..SamplerParams::default()
        });
        let mut history: Vec<u32> = Vec::with_capacity(64);
        history.extend([1, 2, 3, 4]);
        let logits = model.forward(&[14], &mut kv, &mut s, Logits::Last).unwrap();
        history.push(sampler.sample(logits, &history));
        let before = ALLOCATIONS.load(Ordering::SeqCst);
        for _ in 0..10 {
            let last = *history.last().unwrap();
            let logits = model
                .forward(&[last], &mut kv, &mut s, Logits::Last)
                .unwrap();
            let next = sampler.sample(logits, &history);
            history.push(next);
        }
        let n = ALLOCATIONS.load(Ordering::SeqCst) - before;
        assert_eq!(
            n, 0,
            "{act:?}: {n} allocations in 10 decode steps with sampling"
        );
    }
}
