//! A global allocator that can measure the heap high-water mark of a piece of work, so
//! benchmarks report the peak extra memory of a call as a measurement rather than a formula.
//!
//! Only threads that joined the current measurement are counted (the fresh thread pool a
//! benchmark runs the call on): threads of earlier pools freeing their buffers while they wind
//! down, or anything else in the process, cannot skew the figure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, AtomicU32, Ordering};

/// The system allocator plus counters for the threads being measured.
pub struct Counting;

static GEN: AtomicU32 = AtomicU32::new(0);
static CURRENT: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    // Const-initialized and without a destructor: safe to touch from inside the allocator.
    static MY_GEN: Cell<u32> = const { Cell::new(0) };
}

fn counted() -> bool {
    let g = GEN.load(Ordering::Relaxed);
    g != 0 && MY_GEN.try_with(|c| c.get() == g).unwrap_or(false)
}

fn add(n: isize) {
    if counted() {
        let now = CURRENT.fetch_add(n, Ordering::Relaxed) + n;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded: the caller keeps `GlobalAlloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            add(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded: the caller keeps `GlobalAlloc`'s contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            add(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded: the caller keeps `GlobalAlloc`'s contract.
        unsafe { System.dealloc(ptr, layout) };
        add(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded: the caller keeps `GlobalAlloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            add(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// A new measurement id: threads call [`join`] with it (as a pool's start handler), then
/// [`begin`] starts counting them. Beginning after the threads are up leaves out their start-up,
/// which frees memory the spawning thread allocated and would read as negative.
pub fn new_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed) + 1
}

/// Counts the calling thread's allocations in measurement `id`.
pub fn join(id: u32) {
    MY_GEN.with(|c| c.set(id));
}

/// Starts counting the threads that joined `id`, from zero.
pub fn begin(id: u32) {
    CURRENT.store(0, Ordering::Relaxed);
    PEAK.store(0, Ordering::Relaxed);
    GEN.store(id, Ordering::Relaxed);
}

/// Ends the measurement; returns the peak bytes live on the joined threads since [`begin`].
pub fn finish() -> usize {
    GEN.store(0, Ordering::Relaxed);
    PEAK.load(Ordering::Relaxed).max(0) as usize
}
