//! The per-token decode pass must not allocate once its buffers are warm: a counting global
//! allocator watches ten decode steps of a synthetic model, in both activation precisions.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use frugal::gguf::GgufFile;
use frugal::model::synthetic::{SyntheticSpec, build};
use frugal::model::{Logits, Model, Scratch};
use frugal::quant::GgmlType;
use frugal::quant::act::Activations;

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
        let before = ALLOCATIONS.load(Ordering::SeqCst);
        for t in 0..10 {
            model
                .forward(&[20 + t], &mut kv, &mut s, Logits::Last)
                .unwrap();
        }
        let n = ALLOCATIONS.load(Ordering::SeqCst) - before;
        assert_eq!(n, 0, "{act:?}: {n} allocations in 10 decode steps");
    }
}
