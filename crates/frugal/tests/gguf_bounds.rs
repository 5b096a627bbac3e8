//! What a file can make the GGUF reader allocate is bounded by the file's own length: crafted
//! files with large metadata arrays of every kind are parsed under a counting allocator, and the
//! memory the parse adds must stay within a small multiple of the bytes the file spends on them.
//! (Before arrays were stored by element type, a `u8` array cost 32 bytes per element.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use frugal::gguf::{Array, GgufFile, GgufWriter, Value};

/// The system allocator, counting the bytes live and the most live at once.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters move.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
        // SAFETY: forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= layout.size() {
            grew(new_size - layout.size());
        } else {
            LIVE.fetch_sub(layout.size() - new_size, Ordering::SeqCst);
        }
        // SAFETY: forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Peak bytes allocated while parsing `bytes`, beyond what was live before.
fn parse_peak(bytes: Vec<u8>) -> usize {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let f = GgufFile::from_bytes(bytes).expect("a valid file");
    let peak = PEAK.load(Ordering::SeqCst) - base;
    drop(f);
    peak
}

fn file_with(array: Array) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("llama".into()));
    w.set("crafted.array", Value::Array(array));
    w.to_bytes().unwrap()
}

/// One test (the counters are process-wide): each array kind, its bound, and what it costs.
#[test]
fn metadata_arrays_cost_a_small_multiple_of_their_bytes_in_the_file() {
    const N: usize = 1 << 20;
    let cases: [(&str, Array, usize); 4] = [
        // The parse itself adds one copy of a numeric array: 1x, plus the map's small change.
        ("u8", Array::U8(vec![7; 4 * N]), 2),
        ("f32", Array::F32(vec![0.5; N]), 2),
        // 24 bytes of String per 8-byte length prefix: 3x.
        ("empty strings", Array::String(vec![String::new(); N]), 4),
        // 32 bytes of Array per 12-byte header: 2.7x.
        (
            "empty arrays",
            Array::Array(vec![Array::U8(vec![]); N / 2]),
            4,
        ),
    ];
    for (what, array, bound) in cases {
        let bytes = file_with(array);
        let len = bytes.len();
        // `from_bytes` takes the bytes it is given; they are not part of the count.
        let peak = parse_peak(bytes);
        assert!(
            peak <= bound * len + (1 << 16),
            "{what}: parsing a {len}-byte file allocated {peak} bytes (bound {bound}x)"
        );
    }
}
