//! Decode's gated feed-forward input in one parallel section: the gate and up products, the
//! gated activation and the 8-bit quantization of its result, tile by tile.
//!
//! Run apart, the two products were one section, and the gated activation (`act(gate) * up`,
//! 1,536 values for SmolLM2) and the quantization of its result for the down projection a
//! serial pass after it on one thread, which first had to read the half of the rows the other
//! core had computed: about 1.7 us a layer while the other thread waited. Here each 32-row tile
//! of the gate is also one 8-bit block of the down projection's input, so the task that
//! computes a tile finishes it (after computing its whole run's rows: see
//! [`matvec_packed_gated`]). The same kernels on the same values: the same bits as
//! [`matvec_packed_many`](super::matvec_packed_many), the activation, then
//! [`Q8Acts::quantize`].

use super::{MATVEC_ROWS, PackedActs, PackedMatrix, rows_times_tokens};
use crate::quant::act::{Q8Acts, QK, quantize_block_at};
use crate::quant::kernels;
use crate::quant::matmul::RowsOut;

/// `h = act(gate x, up x)` for one activation row `x`, with `h` also quantized into `hq` (one
/// 8-bit block per 32 values, as [`Q8Acts::quantize`] makes them); `up` is scratch of `h`'s
/// length. `act` computes a slice of the gated activation in place into its first argument
/// (`ops::swiglu_serial`, for example); each value must depend only on its own gate and up
/// value.
///
/// Each run of tiles a thread claims is computed as the separate products would be: the
/// gate's rows of the whole run, then up's, each one stream in order (a task that read a gate
/// tile, then an up tile, jumped between the two matrices every 11.5 KB and made decode 2%
/// slower than the section it replaced). Then each tile of the run is activated and quantized.
pub fn matvec_packed_gated(
    gate: &PackedMatrix,
    up: &PackedMatrix,
    x: &Q8Acts,
    act: impl Fn(&mut [f32], &[f32]) + Sync,
    h: &mut [f32],
    up_out: &mut [f32],
    hq: &mut Q8Acts,
) {
    let (n, k) = x.shape();
    assert_eq!(n, 1, "one activation row");
    assert!(
        k == gate.cols
            && k == up.cols
            && gate.rows == up.rows
            && h.len() == gate.rows
            && up_out.len() == gate.rows,
        "gated product: {k} inputs, gate {}x{}, up {}x{}, {} and {} outputs",
        gate.rows,
        gate.cols,
        up.rows,
        up.cols,
        h.len(),
        up_out.len()
    );
    let rows = gate.rows;
    assert!(
        rows.is_multiple_of(QK),
        "gated product: {rows} rows are not whole 8-bit blocks"
    );
    // A tile is one block of the result: its task quantizes what it computed.
    const _: () = assert!(MATVEC_ROWS == QK);
    hq.prepare(rows, 1);
    let isa = kernels::detect();
    let out = Outs {
        h: h.as_mut_ptr(),
        up: up_out.as_mut_ptr(),
        qs: hq.qs.as_mut_ptr(),
        d: hq.d.as_mut_ptr(),
        s: hq.s.as_mut_ptr(),
    };
    crate::team::for_each_run(rows / QK, |run| {
        let r0 = run.start * QK;
        // SAFETY: the run's blocks are inside the buffers sized above (`rows / QK` of them),
        // and every run is claimed by one task alone.
        let (hr, ur, qs, d, s) = unsafe { out.blocks(run) };
        rows_times_tokens(isa, gate, x, 1, r0, hr.len(), &mut RowsOut::local(hr));
        rows_times_tokens(isa, up, x, 1, r0, ur.len(), &mut RowsOut::local(ur));
        let blocks = hr
            .chunks_exact_mut(QK)
            .zip(ur.chunks_exact(QK))
            .zip(qs.chunks_exact_mut(QK))
            .zip(d.iter_mut().zip(s));
        for (((hb, ub), qb), (d, s)) in blocks {
            act(hb, ub);
            (*d, *s) = quantize_block_at(isa, hb, qb);
        }
    });
}

/// The section's outputs: each run of tiles writes its own blocks of each.
#[derive(Clone, Copy)]
struct Outs {
    h: *mut f32,
    up: *mut f32,
    qs: *mut i8,
    d: *mut f32,
    s: *mut f32,
}
// SAFETY: runs write disjoint blocks (see `blocks`).
unsafe impl Sync for Outs {}
unsafe impl Send for Outs {}

/// One run's blocks of `h`, `up`, the quantized values, and their scales and sums.
type RunBlocks<'a> = (
    &'a mut [f32],
    &'a mut [f32],
    &'a mut [i8],
    &'a mut [f32],
    &'a mut [f32],
);

impl Outs {
    /// Blocks `run` of every output.
    ///
    /// # Safety
    /// The blocks lie inside every buffer, and no other reference touches them while the
    /// returned ones live.
    #[allow(clippy::mut_from_ref)]
    unsafe fn blocks(&self, run: std::ops::Range<usize>) -> RunBlocks<'_> {
        let (b, nb) = (run.start, run.len());
        // SAFETY: forwarded to the caller.
        unsafe {
            (
                std::slice::from_raw_parts_mut(self.h.add(b * QK), nb * QK),
                std::slice::from_raw_parts_mut(self.up.add(b * QK), nb * QK),
                std::slice::from_raw_parts_mut(self.qs.add(b * QK), nb * QK),
                std::slice::from_raw_parts_mut(self.d.add(b), nb),
                std::slice::from_raw_parts_mut(self.s.add(b), nb),
            )
        }
    }
}
