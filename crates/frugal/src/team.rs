//! The threads of one forward pass, held for the whole pass and handed each parallel section
//! through one atomic word.
//!
//! A one-token decode step of SmolLM2 runs about 250 parallel sections (every product, every
//! layer's attention), most of them 5 to 50 µs long. Through rayon each section is split,
//! stolen and joined, and a worker that finds nothing yields and then sleeps until the next
//! one wakes it: 2-4 µs a section on this project's 2-vCPU machine, a tenth of a step. A
//! `Team` instead keeps the pool's other threads spinning on its state word for the length
//! of the pass (llama.cpp's thread pool does the same): a section costs the owner one store
//! and the wait for the last chunk, and each helper one compare-and-swap.
//!
//! Every section is a loop over chunk indices `0..n` that the owner and the helpers claim in
//! runs from a shared counter (`Team::chunks`), so how many helpers took part, and which chunk
//! ran where, never changes what a chunk computes: results are the same bits as through rayon.
//!
//! Outside a team (one thread, `FRUGAL_TEAM=0`, or code that is not inside a forward pass)
//! [`for_each`] is rayon's `for_each`. While a team holds the pool, helpers still run rayon
//! jobs the owner posts (`rayon::yield_now` between polls), so sections not written for the
//! team stay parallel.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use rayon::prelude::*;

/// The state word: the section's generation above [`GEN_SHIFT`], then [`OPEN`] while helpers
/// may join it, then how many helpers are inside it.
const GEN_SHIFT: u32 = 16;
const OPEN: u64 = 1 << 15;
const ACTIVE: u64 = OPEN - 1;

/// Polls of the state word between two looks at rayon's queues, for a helper with nothing to do.
const POLLS_PER_RAYON_LOOK: u32 = 64;

/// A section: chunks `0..n`, a claimed run `a..b` of them run as `f(a..b)`.
#[derive(Clone, Copy)]
struct Section {
    f: *const (dyn Fn(Range<usize>) + Sync),
    n: usize,
}

/// See the module documentation.
struct Team {
    state: AtomicU64,
    next: AtomicUsize,
    /// Written by the owner only while no helper is inside a section (closed, none active);
    /// read by a helper only after joining one.
    section: UnsafeCell<Option<Section>>,
    /// Set when the pass ends: helpers return.
    done: AtomicBool,
    /// A chunk run by a helper panicked; the owner panics when the section ends.
    panicked: AtomicBool,
    threads: usize,
}

// SAFETY: `section` follows the protocol above (the owner writes it before opening a section
// with a release store and after every helper has left the previous one; helpers read it after
// joining with an acquire compare-and-swap); its closure is `Sync`.
unsafe impl Sync for Team {}

thread_local! {
    /// The team this thread owns, while its pass runs.
    static OWNED: Cell<*const Team> = const { Cell::new(std::ptr::null()) };
    /// The owner is inside a section (a nested section runs on the owner alone).
    static IN_SECTION: Cell<bool> = const { Cell::new(false) };
}

/// Whether teams are used: `FRUGAL_TEAM=0` keeps every section on rayon, to measure the lever.
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("FRUGAL_TEAM").map_or(true, |v| v != "0"))
}

/// Runs `f` with the current rayon pool's other threads held as a team, so that the
/// [`for_each`] sections `f` runs on this thread go through it. With one thread, outside a
/// pool's thread, inside another team, or with teams disabled, `f` just runs.
pub fn with_team<R>(f: impl FnOnce() -> R) -> R {
    let threads = rayon::current_num_threads();
    if threads < 2
        || !enabled()
        || !OWNED.get().is_null()
        || rayon::current_thread_index().is_none()
    {
        return f();
    }
    let team = Team {
        state: AtomicU64::new(0),
        next: AtomicUsize::new(0),
        section: UnsafeCell::new(None),
        done: AtomicBool::new(false),
        panicked: AtomicBool::new(false),
        threads,
    };
    let t = &team;
    let owner = Here(move || {
        OWNED.set(t);
        let r = catch_unwind(AssertUnwindSafe(f));
        OWNED.set(std::ptr::null());
        t.done.store(true, Ordering::Release);
        Here(r)
    });
    // `join`, not a scope's `spawn`: its jobs live on this stack, so a pass allocates nothing.
    let (r, ()) = rayon::join(move || owner.call(), || t.helpers(threads - 1));
    r.0.unwrap_or_else(|p| resume_unwind(p))
}

/// A value that stays on the thread that made it although its type does not say it may move:
/// the first closure of `rayon::join` runs on the calling thread when that is one of the
/// pool's (checked by `with_team`), and its result comes back to that thread.
struct Here<T>(T);
// SAFETY: see above: never used on another thread.
unsafe impl<T> Send for Here<T> {}
impl<R, F: FnOnce() -> R> Here<F> {
    fn call(self) -> R {
        (self.0)()
    }
}

/// `f(i)` for every `i` in `0..n`, in parallel: through the team this thread owns, else rayon.
/// Which thread runs a chunk never changes what it computes.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    let team = OWNED.get();
    if team.is_null() {
        let f = &f;
        (0..n).into_par_iter().for_each(f);
    } else {
        for_each_run(n, |run| run.for_each(&f));
    }
}

/// [`for_each`] for work that runs better over consecutive chunks together: `f(a..b)` for
/// runs `a..b` that cover `0..n` once, in parallel, each run on one thread. Through the team
/// the runs are its claims (`Team::chunks`); through rayon, one run per thread of the pool, of
/// equal lengths. What a chunk computes must not depend on the run it is in.
pub fn for_each_run(n: usize, f: impl Fn(Range<usize>) + Sync) {
    let team = OWNED.get();
    if n == 0 {
        return;
    }
    if team.is_null() {
        let parts = rayon::current_num_threads().clamp(1, n);
        (0..parts)
            .into_par_iter()
            .for_each(|p| f(p * n / parts..(p + 1) * n / parts));
    } else if IN_SECTION.get() {
        f(0..n);
    } else {
        // SAFETY: `OWNED` points at the team `with_team` keeps alive while this thread runs
        // its closure; it is cleared before the team is dropped.
        unsafe { &*team }.run(n, &f);
    }
}

impl Team {
    /// One section, on the owner: open it, run chunks, close it, wait for the helpers in it.
    fn run(&self, n: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        if n == 0 {
            return;
        }
        // SAFETY: the lifetime is erased for the helpers; they only call it inside this
        // section, which does not end before every helper has left it (below).
        let f: *const (dyn Fn(Range<usize>) + Sync) = unsafe { std::mem::transmute(f) };
        // SAFETY: no helper is inside a section (the previous one waited for them all).
        unsafe { *self.section.get() = Some(Section { f, n }) };
        self.next.store(0, Ordering::Relaxed);
        let generation = (self.state.load(Ordering::Relaxed) >> GEN_SHIFT) + 1;
        self.state
            .store(generation << GEN_SHIFT | OPEN, Ordering::Release);
        IN_SECTION.set(true);
        // SAFETY: `f` is the caller's closure, alive for this call.
        let mine = catch_unwind(AssertUnwindSafe(|| self.chunks(unsafe { &*f }, n)));
        IN_SECTION.set(false);
        self.state.fetch_and(!OPEN, Ordering::AcqRel);
        while self.state.load(Ordering::Acquire) & ACTIVE != 0 {
            std::hint::spin_loop();
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if self.panicked.swap(false, Ordering::Relaxed) {
            panic!("a team thread panicked in a parallel section");
        }
    }

    /// Claims and runs chunks until none is left. Each claim takes `1/threads` of what is
    /// left (guided self-scheduling): the first claims are long runs of consecutive chunks, so
    /// each thread streams its weights in order as the prefetchers expect (claims of an eighth
    /// each made decode 5% slower than rayon's halves, 8% slower than this), and the last are
    /// single chunks, so a thread the machine slowed hands the end of its share to the others.
    fn chunks(&self, f: &(dyn Fn(Range<usize>) + Sync), n: usize) {
        let mut cur = self.next.load(Ordering::Relaxed);
        while cur < n {
            let take = (n - cur).div_ceil(self.threads);
            match self.next.compare_exchange_weak(
                cur,
                cur + take,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    f(cur..cur + take);
                    cur = self.next.load(Ordering::Relaxed);
                }
                Err(now) => cur = now,
            }
        }
    }

    /// `k` helpers: this thread, and the rest for whichever threads take them.
    fn helpers(&self, k: usize) {
        if k <= 1 {
            self.help();
        } else {
            rayon::join(|| self.help(), || self.helpers(k - 1));
        }
    }

    /// A helper's loop: join every section it sees open, run rayon's jobs in between, return
    /// when the pass is done.
    fn help(&self) {
        // A helper job the owner takes back (waiting inside a rayon section of its own, or at
        // the end of the pass) must not keep it here: the pass would never end.
        if std::ptr::eq(OWNED.get(), self) {
            return;
        }
        let mut seen = 0;
        let mut polls = 0u32;
        while !self.done.load(Ordering::Acquire) {
            let s = self.state.load(Ordering::Acquire);
            let generation = s >> GEN_SHIFT;
            if s & OPEN != 0 && generation != seen {
                if self
                    .state
                    .compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    seen = generation;
                    // SAFETY: joined an open section: the owner wrote it before opening it and
                    // does not change it before this helper leaves.
                    let Section { f, n } = unsafe { (*self.section.get()).expect("open") };
                    // SAFETY: the owner keeps the closure alive until every helper has left.
                    let r: Result<(), Box<dyn Any + Send>> =
                        catch_unwind(AssertUnwindSafe(|| self.chunks(unsafe { &*f }, n)));
                    if r.is_err() {
                        self.panicked.store(true, Ordering::Relaxed);
                    }
                    self.state.fetch_sub(1, Ordering::Release);
                    polls = 0;
                }
                continue;
            }
            polls += 1;
            if polls.is_multiple_of(POLLS_PER_RAYON_LOOK) {
                rayon::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn every_chunk_runs_once_in_every_section() {
        for threads in [1, 2, 3] {
            pool(threads).install(|| {
                with_team(|| {
                    for n in [0, 1, 2, 7, 18, 1536] {
                        let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                        for_each(n, |i| {
                            hits[i].fetch_add(1, Ordering::Relaxed);
                        });
                        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n {n}");
                    }
                })
            });
        }
    }

    #[test]
    fn runs_cover_every_chunk_once_in_order() {
        for threads in [1, 2, 3] {
            for team in [true, false] {
                pool(threads).install(|| {
                    let body = || {
                        for n in [0, 1, 2, 7, 48, 1536] {
                            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                            for_each_run(n, |run| {
                                assert!(run.start < run.end && run.end <= n, "run {run:?}");
                                for i in run {
                                    hits[i].fetch_add(1, Ordering::Relaxed);
                                }
                            });
                            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "n {n}");
                        }
                    };
                    if team { with_team(body) } else { body() }
                });
            }
        }
        // Through rayon, one run per thread: a single thread gets every chunk in one run.
        pool(1).install(|| {
            let runs = AtomicU32::new(0);
            for_each_run(48, |run| {
                assert_eq!(run, 0..48);
                runs.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(runs.load(Ordering::Relaxed), 1);
        });
    }

    #[test]
    fn nested_sections_and_rayon_sections_run_inside_a_team() {
        pool(2).install(|| {
            with_team(|| {
                let inner: Vec<AtomicU32> = (0..16).map(|_| AtomicU32::new(0)).collect();
                for_each(16, |i| {
                    // A nested section runs on the thread that reaches it.
                    for_each(i + 1, |_| {
                        inner[i].fetch_add(1, Ordering::Relaxed);
                    });
                });
                for (i, x) in inner.iter().enumerate() {
                    assert_eq!(x.load(Ordering::Relaxed), i as u32 + 1);
                }
                // A rayon section inside the team still completes.
                let s: u64 = (0..10_000u64).into_par_iter().sum();
                assert_eq!(s, 10_000 * 9_999 / 2);
            })
        });
    }

    #[test]
    fn a_panicking_chunk_reaches_the_owner_and_the_team_ends() {
        let r = catch_unwind(|| {
            pool(2).install(|| {
                with_team(|| {
                    for _ in 0..100 {
                        for_each(64, |i| assert!(i != 63, "chunk 63"));
                    }
                })
            })
        });
        assert!(r.is_err());
        // The pool is usable after it.
        pool(2).install(|| with_team(|| for_each(8, |_| {})));
    }
}
