//! Scores against a Q8_0 key cache, computed in integers as llama.cpp computes them.
//!
//! A Q8_0 key is 32-value blocks of signed bytes, each block with an f16 scale. Decoding it to
//! f32 and taking a float dot product (what attention did before) spends more multiply-adds
//! and conversions per key than a 16-bit cache and reads only half the bytes: at depth 4,096
//! the step was compute-bound at 32% of its memory roofline. Instead each query row is
//! quantized once to Q8_0 blocks too (scale = block absmax / 127, rounded to nearest, as the
//! cache's own keys are), and a score is
//!
//! `s = sum over blocks b of  (integer dot of the block's bytes) * (query scale_b * key scale_b)`
//!
//! with the blocks added in order from zero. The integer dot is exact, so only the query's
//! rounding (the same 8 bits per value the key already has) separates it from the float score;
//! llama.cpp's CPU attention does the same with a Q8_0 cache (its queries are converted to the
//! cache's `vec_dot_type`). The f32 arithmetic after the integer dot is the same operations in
//! the same order on every path (this portable twin, the VNNI kernel in `flash_vnni`, and naive
//! attention), so a row's scores have the same bits whichever computes them.

use half::f16;

use crate::kv::Q8_0_BLOCK;

/// Bytes of one stored Q8_0 block: the f16 scale, then 32 signed bytes.
pub(super) const BLOCK_BYTES: usize = 34;

/// Query rows quantized to Q8_0 blocks: `ints` (`rows x hd`), and per row and block its scale
/// and `128 x` the sum of its integers (the VNNI kernel multiplies unsigned bytes, so it
/// offsets the keys by 128 and subtracts this afterwards).
#[derive(Default)]
pub(super) struct QuantQueries {
    pub ints: Vec<i8>,
    pub scales: Vec<f32>,
    pub offsets: Vec<i32>,
}

impl QuantQueries {
    /// Quantizes `q` (rows of `hd` values, `hd` a multiple of 32), reusing the buffers.
    pub fn quantize(&mut self, q: &[f32], hd: usize) {
        debug_assert!(hd.is_multiple_of(Q8_0_BLOCK) && q.len().is_multiple_of(hd));
        let blocks = q.len() / Q8_0_BLOCK;
        self.ints.clear();
        self.ints.resize(q.len(), 0);
        self.scales.clear();
        self.offsets.clear();
        for (x, out) in q
            .chunks_exact(Q8_0_BLOCK)
            .zip(self.ints.chunks_exact_mut(Q8_0_BLOCK))
        {
            let scale = quantize_block(x, out);
            self.scales.push(scale);
            self.offsets
                .push(128 * out.iter().map(|&v| i32::from(v)).sum::<i32>());
        }
        debug_assert_eq!(self.scales.len(), blocks);
    }
}

/// Quantizes 32 values to signed bytes with ggml's Q8_0 rule (the scale maps the absolute
/// maximum to 127; values round half away from zero), returning the scale. The scale stays
/// f32: a query is quantized once per step, and rounding it to f16 would only add error.
pub(super) fn quantize_block(x: &[f32], out: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    for (q, &v) in out.iter_mut().zip(x) {
        // `as` saturates (and sends NaN to 0): a hostile activation cannot wrap around.
        *q = (v * inv).round() as i8;
    }
    scale
}

/// The score of one quantized query row (`ints` of `hd` values, one scale per block) against
/// one stored key (`hd / 32` Q8_0 blocks).
#[inline]
pub(super) fn score(ints: &[i8], scales: &[f32], key: &[u8]) -> f32 {
    let mut s = 0f32;
    for ((q, &qs), k) in ints
        .chunks_exact(Q8_0_BLOCK)
        .zip(scales)
        .zip(key.chunks_exact(BLOCK_BYTES))
    {
        let ks = f16::from_bits(u16::from_le_bytes([k[0], k[1]])).to_f32();
        let dot: i32 = q
            .iter()
            .zip(&k[2..])
            .map(|(&a, &b)| i32::from(a) * i32::from(b as i8))
            .sum();
        s += dot as f32 * (qs * ks);
    }
    s
}

/// `s[i][j] = score(query i, key j)` for `R` quantized rows (from row `row0` of `qq`) and keys
/// `keys[0..jn]` (each key's stored bytes), into `s` (`R x bc`): the portable twin of
/// `flash_vnni::scores_q8`.
pub(super) fn scores<const R: usize>(
    qq: &QuantQueries,
    row0: usize,
    hd: usize,
    keys: &[&[u8]],
    jn: usize,
    bc: usize,
    s: &mut [f32],
) {
    let nb = hd / Q8_0_BLOCK;
    for i in 0..R {
        let r = row0 + i;
        let (ints, scales) = (&qq.ints[r * hd..][..hd], &qq.scales[r * nb..][..nb]);
        for (j, key) in keys[..jn].iter().enumerate() {
            s[i * bc + j] = score(ints, scales, key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvType;

    /// The integer score is the float dot product of the two dequantized rows, up to f32
    /// rounding (the integer part is exact), and each query value is within half a step of
    /// its quantized value.
    #[test]
    fn integer_scores_are_the_dot_of_the_dequantized_rows() {
        let hd = 64;
        let q: Vec<f32> = (0..hd)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        let k: Vec<f32> = (0..hd)
            .map(|i| ((i * 11 % 17) as f32 - 8.0) * 0.7)
            .collect();
        let mut key = vec![0u8; KvType::Q8_0.bytes(hd)];
        KvType::Q8_0.encode(&k, &mut key);
        let mut qq = QuantQueries::default();
        qq.quantize(&q, hd);
        let mut kd = vec![0f32; hd];
        crate::quant::dequantize(crate::quant::GgmlType::Q8_0, &key, &mut kd).unwrap();
        let qd: Vec<f32> = (0..hd)
            .map(|c| f32::from(qq.ints[c]) * qq.scales[c / 32])
            .collect();
        for (c, (&a, &b)) in q.iter().zip(&qd).enumerate() {
            assert!((a - b).abs() <= 0.5 * qq.scales[c / 32] * 1.0001, "dim {c}");
        }
        let want: f64 = qd.iter().zip(&kd).map(|(&a, &b)| f64::from(a * b)).sum();
        let got = score(&qq.ints, &qq.scales, &key);
        assert!(
            ((got as f64) - want).abs() < 1e-5 * want.abs().max(1.0),
            "{got} {want}"
        );
        // 128 x the block sums, for the VNNI kernel's offset.
        for b in 0..2 {
            let sum: i32 = qq.ints[b * 32..][..32].iter().map(|&v| i32::from(v)).sum();
            assert_eq!(qq.offsets[b], 128 * sum);
        }
    }

    #[test]
    fn a_zero_or_hostile_query_block_quantizes_without_panicking() {
        let mut out = [0i8; 32];
        assert_eq!(quantize_block(&[0.0; 32], &mut out), 0.0);
        assert!(out.iter().all(|&v| v == 0));
        let mut x = [1.0f32; 32];
        x[3] = f32::NAN;
        x[5] = f32::INFINITY;
        quantize_block(&x, &mut out); // saturating casts: no panic, no wrap
    }
}
