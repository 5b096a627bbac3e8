//! The cache-blocked GEMM loop nest, generic over a microkernel.
//!
//! Loop order (BLIS naming):
//! ```text
//! for jc in N by NC            // B block (KC×NC) lives in L3/L2
//!   for pc in K by KC          //   pack B block once, shared by all tasks
//!     parallel for (ic, jr-group) // tasks: A block (MC×KC) packed per task, in L2
//!       for jr in group by NR  //     B micro-panel (KC×NR) stays in L1
//!         for ir in MC by MR   //       microkernel: MR×NR tile of C += Ap·Bp
//! ```
//! Every C element is written by exactly one task per `pc` step and the `pc`
//! steps run in order, so the k summation order is fixed: deterministic,
//! independent of the thread count.

use super::MatRef;
use rayon::prelude::*;
use std::cell::Cell;

/// A microkernel plus the packing layout it reads.
///
/// Packed A for rows `r0..r0+rlen` is `ceil(rlen/MR)` panels, each `MR·kp`
/// elements; packed B likewise `ceil(nlen/NR)` panels of `NR·kp`, where `kp`
/// is the block's k length rounded up to `KU`. Padding is zero-filled, so the
/// microkernel always computes a full MR×NR tile.
pub(crate) trait Kernel: Sync {
    /// Element type of the packed buffers (f32, or bf16 bits as u16).
    type E: Copy + Send + Sync + 'static;
    const MR: usize;
    const NR: usize;
    /// K granularity: packed k lengths are multiples of this (zero padded).
    const KU: usize;
    /// Block sizes; MC is a multiple of MR, KC of KU, NC of NR.
    const MC: usize;
    const KC: usize;
    const NC: usize;

    /// Packs rows `r0..r0+rlen`, k `k0..k0+klen` of `a` (m×k) into `dst`.
    fn pack_a(
        &self,
        a: MatRef,
        r0: usize,
        rlen: usize,
        k0: usize,
        klen: usize,
        dst: &mut [Self::E],
    );
    /// Packs k `k0..k0+klen`, columns `c0..c0+clen` of `b` (k×n) into `dst`.
    fn pack_b(
        &self,
        b: MatRef,
        k0: usize,
        klen: usize,
        c0: usize,
        clen: usize,
        dst: &mut [Self::E],
    );

    /// `C[MR×NR] = (load ? C : 0) + Ap·Bp` over `kp` (padded) k values.
    ///
    /// # Safety
    /// `ap` / `bp` point to one packed panel (`MR·kp` / `NR·kp` elements);
    /// `c` points to MR rows of NR writable f32 with row stride `ldc`;
    /// `task_begin` was called on this thread and `task_end` not yet.
    unsafe fn micro(
        &self,
        kp: usize,
        ap: *const Self::E,
        bp: *const Self::E,
        c: *mut f32,
        ldc: usize,
        load: bool,
    );

    /// Called on the worker thread before its first `micro` (AMX loads its
    /// tile configuration here).
    fn task_begin(&self) {}
    /// Called after the task's last `micro`.
    fn task_end(&self) {}
}

/// A 64-byte aligned, zero-initialised, growable scratch buffer.
#[derive(Default)]
pub(crate) struct Scratch(Vec<Align64>);

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Align64([u8; 64]);

impl Scratch {
    /// A view of the first `len` elements as `T` (f32 or u16: any bit
    /// pattern is valid), growing the buffer if needed.
    pub(crate) fn slice<T: Copy>(&mut self, len: usize) -> &mut [T] {
        assert!(std::mem::align_of::<T>() <= 64);
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .expect("scratch size overflow");
        let blocks = bytes.div_ceil(64);
        if self.0.len() < blocks {
            self.0.resize(blocks, Align64([0; 64]));
        }
        // SAFETY: the buffer holds at least `bytes` initialised bytes, is
        // 64-byte aligned (≥ align_of::<T>()), and T is only instantiated with
        // plain-old-data types (f32, u16) for which every bit pattern is valid.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_mut_ptr().cast::<T>(), len) }
    }
}

thread_local! {
    /// Packed-A buffer of each worker thread.
    static A_BUF: Cell<Scratch> = Cell::new(Scratch::default());
    /// Packed-B buffer of the calling thread (shared read-only by the tasks).
    static B_BUF: Cell<Scratch> = Cell::new(Scratch::default());
    /// Shared packed-A buffer of the calling thread (see [`A_SHARED_MAX_BYTES`]).
    static A_SHARED: Cell<Scratch> = Cell::new(Scratch::default());
}

/// Runs `f` with this thread's buffer taken *out* of the thread-local, and
/// puts it back afterwards. Taking (rather than borrowing) keeps re-entrant
/// use safe: a rayon worker waiting inside one matmul may run a task of
/// another matmul, which then simply finds an empty buffer and grows its own.
fn with_scratch<R>(
    key: &'static std::thread::LocalKey<Cell<Scratch>>,
    f: impl FnOnce(&mut Scratch) -> R,
) -> R {
    let mut s = key.with(Cell::take);
    let r = f(&mut s);
    key.with(|cell| cell.set(s));
    r
}

/// A raw pointer to C that tasks may share; each task writes disjoint tiles.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: tasks write pairwise-disjoint regions of C (distinct row blocks or
// distinct column panels), and the owning `&mut [f32]` outlives the tasks.
unsafe impl Send for CPtr {}
// SAFETY: as for `Send`.
unsafe impl Sync for CPtr {}

/// Packing A once per call (shared by all tasks) instead of once per task and
/// column block pays off whenever A would otherwise be packed repeatedly:
/// several column groups per row block (few row blocks, e.g. the 256-row
/// logits chunks or 576-row weight gradients at 2 threads) or several NC
/// blocks (n > NC, the 49152-wide head). This caps the shared buffer; above
/// it A is packed per K block (if it would still be repacked) or per task.
const A_SHARED_MAX_BYTES: usize = 8 << 20;

/// How the driver packs A (see [`A_SHARED_MAX_BYTES`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum APacking {
    /// Every task packs its own MC×KC block (best L2 locality).
    PerTask,
    /// All rows of the current K block, once per (jc, pc), shared.
    PerBlock,
    /// All of A once per call, shared (K blocks one after another).
    Whole,
}

/// Packs all rows of A for k `pc..pc+klen` into `dst` (`ceil(m/MR)` panels),
/// split into MC row blocks that run in parallel when `threads > 1`.
fn pack_a_all<K: Kernel>(
    k: &K,
    a: MatRef,
    pc: usize,
    klen: usize,
    kp: usize,
    dst: &mut [K::E],
    threads: usize,
) {
    let m = a.rows;
    let pack = |(ib, d): (usize, &mut [K::E])| {
        let i0 = ib * K::MC;
        k.pack_a(a, i0, K::MC.min(m - i0), pc, klen, d);
    };
    if threads > 1 && m > K::MC {
        dst.par_chunks_mut(K::MC * kp).enumerate().for_each(pack);
    } else {
        dst.chunks_mut(K::MC * kp).enumerate().for_each(pack);
    }
}

/// Largest MR·NR of any kernel (AMX: 32×32); edge tiles go through a buffer this big.
const MAX_TILE: usize = 32 * 32;

#[repr(C, align(64))]
struct EdgeTile([f32; MAX_TILE]);

/// `c = (accumulate ? c : 0) + a·b` with kernel `k`. Shapes already checked.
pub(crate) fn gemm<K: Kernel>(
    k: &K,
    a: MatRef,
    b: MatRef,
    c: &mut [f32],
    accumulate: bool,
    parallel: bool,
) {
    let (m, kk, n) = (a.rows, a.cols, b.cols);
    debug_assert_eq!(c.len(), m * n);
    if m == 0 || n == 0 {
        return;
    }
    if kk == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return;
    }
    assert!(K::MR * K::NR <= MAX_TILE);
    let threads = if parallel {
        rayon::current_num_threads().max(1)
    } else {
        1
    };
    let cptr = CPtr(c.as_mut_ptr());
    let ldc = n;

    let mblocks = m.div_ceil(K::MC);
    let mpanels = m.div_ceil(K::MR);
    let ngroups_for = |npanels: usize| {
        if threads > 1 {
            (4 * threads).div_ceil(mblocks).clamp(1, npanels)
        } else {
            1
        }
    };
    let kblocks = kk.div_ceil(K::KC);
    let kp_last = (kk - (kblocks - 1) * K::KC).next_multiple_of(K::KU);
    let esize = std::mem::size_of::<K::E>();
    let whole_len = mpanels * K::MR * ((kblocks - 1) * K::KC + kp_last);
    let block_len = mpanels * K::MR * K::KC.min(kk.next_multiple_of(K::KU));
    let repacked = n > K::NC || ngroups_for(K::NC.min(n).div_ceil(K::NR)) > 1;
    let a_packing = if !repacked {
        APacking::PerTask
    } else if whole_len * esize <= A_SHARED_MAX_BYTES {
        APacking::Whole
    } else if block_len * esize <= A_SHARED_MAX_BYTES && mblocks < 4 * threads {
        APacking::PerBlock
    } else {
        APacking::PerTask
    };

    with_scratch(&A_SHARED, |abuf| {
        let ashared: &mut [K::E] = abuf.slice(match a_packing {
            APacking::PerTask => 0,
            APacking::PerBlock => block_len,
            APacking::Whole => whole_len,
        });
        if a_packing == APacking::Whole {
            for (kb, dst) in ashared.chunks_mut(mpanels * K::MR * K::KC).enumerate() {
                let pc = kb * K::KC;
                let klen = K::KC.min(kk - pc);
                pack_a_all(k, a, pc, klen, klen.next_multiple_of(K::KU), dst, threads);
            }
        }
        with_scratch(&B_BUF, |bbuf| {
            for jc in (0..n).step_by(K::NC) {
                let nlen = K::NC.min(n - jc);
                let npanels = nlen.div_ceil(K::NR);
                for pc in (0..kk).step_by(K::KC) {
                    let klen = K::KC.min(kk - pc);
                    let kp = klen.next_multiple_of(K::KU);
                    let bpanel = K::NR * kp;
                    let bp: &mut [K::E] = bbuf.slice(npanels * bpanel);

                    // Pack B (shared). Split by panel groups when parallel.
                    if threads > 1 && npanels >= 2 * threads {
                        let per = npanels.div_ceil(2 * threads);
                        bp.par_chunks_mut(per * bpanel)
                            .enumerate()
                            .for_each(|(g, dst)| {
                                let c0 = g * per * K::NR;
                                k.pack_b(b, pc, klen, jc + c0, (per * K::NR).min(nlen - c0), dst);
                            });
                    } else {
                        k.pack_b(b, pc, klen, jc, nlen, bp);
                    }
                    let bp: &[K::E] = bp;
                    let load = accumulate || pc > 0;
                    let apre: Option<&[K::E]> = match a_packing {
                        APacking::PerTask => None,
                        APacking::PerBlock => {
                            let dst = &mut ashared[..mpanels * K::MR * kp];
                            pack_a_all(k, a, pc, klen, kp, dst, threads);
                            Some(dst)
                        }
                        APacking::Whole => Some(
                            &ashared[(pc / K::KC) * mpanels * K::MR * K::KC..]
                                [..mpanels * K::MR * kp],
                        ),
                    };

                    // Tasks: MC row blocks × groups of B panels. Enough tasks that
                    // rayon's work stealing balances the threads.
                    let ngroups = ngroups_for(npanels);
                    let per_group = npanels.div_ceil(ngroups);
                    let ngroups = npanels.div_ceil(per_group);
                    let task = |t: usize| {
                        let (ib, g) = (t / ngroups, t % ngroups);
                        let i0 = ib * K::MC;
                        let mlen = K::MC.min(m - i0);
                        let q0 = g * per_group;
                        let q1 = (q0 + per_group).min(npanels);
                        run_task(
                            k,
                            a,
                            apre,
                            i0,
                            mlen,
                            pc,
                            klen,
                            kp,
                            bp,
                            q0..q1,
                            jc,
                            nlen,
                            cptr,
                            ldc,
                            load,
                        );
                    };
                    let ntasks = mblocks * ngroups;
                    if threads > 1 && ntasks > 1 {
                        (0..ntasks).into_par_iter().for_each(task);
                    } else {
                        (0..ntasks).for_each(task);
                    }
                }
            }
        });
    });
}

/// One task: pack the A block (unless `apre` holds all of A's rows for this
/// K block, packed), then run the microkernel over B panels `panels` (jr,
/// outer) × A panels (ir, inner).
#[allow(clippy::too_many_arguments)]
fn run_task<K: Kernel>(
    k: &K,
    a: MatRef,
    apre: Option<&[K::E]>,
    i0: usize,
    mlen: usize,
    pc: usize,
    klen: usize,
    kp: usize,
    bp: &[K::E],
    panels: std::ops::Range<usize>,
    jc: usize,
    nlen: usize,
    cptr: CPtr,
    ldc: usize,
    load: bool,
) {
    with_scratch(&A_BUF, |abuf| {
        let mpanels = mlen.div_ceil(K::MR);
        let apanel = K::MR * kp;
        let ap: &[K::E] = match apre {
            // i0 is a multiple of MC, hence of MR: panel i0/MR onwards.
            Some(all) => &all[(i0 / K::MR) * apanel..][..mpanels * apanel],
            None => {
                let ap: &mut [K::E] = abuf.slice(mpanels * apanel);
                k.pack_a(a, i0, mlen, pc, klen, ap);
                ap
            }
        };
        let bpanel = K::NR * kp;
        let mut edge = EdgeTile([0.0; MAX_TILE]);
        k.task_begin();
        for q in panels {
            let bq = &bp[q * bpanel..(q + 1) * bpanel];
            let cols = K::NR.min(nlen - q * K::NR);
            let col0 = jc + q * K::NR;
            for p in 0..mpanels {
                let aq = &ap[p * apanel..(p + 1) * apanel];
                let rows = K::MR.min(mlen - p * K::MR);
                let row0 = i0 + p * K::MR;
                // SAFETY: C has m·ldc elements; rows row0..row0+rows and
                // columns col0..col0+cols are inside it, and this task is the
                // only writer of that tile (see `CPtr`). Panels have the sizes
                // `micro` requires; `task_begin` has run.
                unsafe {
                    let ctile = cptr.0.add(row0 * ldc + col0);
                    if rows == K::MR && cols == K::NR {
                        k.micro(kp, aq.as_ptr(), bq.as_ptr(), ctile, ldc, load);
                    } else {
                        // Edge: compute a full tile in the buffer, copy back
                        // only the valid part.
                        let e = &mut edge.0[..K::MR * K::NR];
                        e.fill(0.0);
                        if load {
                            for r in 0..rows {
                                let src = std::slice::from_raw_parts(ctile.add(r * ldc), cols);
                                e[r * K::NR..r * K::NR + cols].copy_from_slice(src);
                            }
                        }
                        k.micro(kp, aq.as_ptr(), bq.as_ptr(), e.as_mut_ptr(), K::NR, load);
                        for r in 0..rows {
                            let dst = std::slice::from_raw_parts_mut(ctile.add(r * ldc), cols);
                            dst.copy_from_slice(&e[r * K::NR..r * K::NR + cols]);
                        }
                    }
                }
            }
        }
        k.task_end();
    });
}
