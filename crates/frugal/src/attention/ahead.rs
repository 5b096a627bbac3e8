//! The next key tile's cache lines, requested a few at a time while this tile is computed.
//!
//! A decode step reads every cached key and value once, so attention overlaps the loads of
//! tile `t + 1` with the arithmetic of tile `t`. Asked for all at once, a tile's lines (136 for
//! 64 keys of a 64-wide Q8_0 head, keys and values) are more than a core keeps in flight (a Zen
//! 2 core tracks about two dozen misses): the prefetch instructions past that wait for a free
//! miss buffer and nothing is computed meanwhile. Here the kernels report the keys they finish and each report
//! requests its share of the lines: the next keys' lines while this tile's scores are computed,
//! the next values' while its values are weighed. Only the first tile of a chunk is asked for at
//! once, before there is work to hide it behind. Same bits: prefetches change no value.
//!
//! Lines that continue the run the previous plan ended on are left to the hardware: a
//! sequence's blocks taken one after another sit back to back in each head's region, and on
//! huge pages the core's own stream prefetchers follow them; requests for them would hold the
//! miss buffers the streams use. A run that starts anywhere else (the next block of a sequence whose blocks are
//! scattered through a server's pool, which only the block table knows) is requested.

use std::ops::Range;

use crate::kv::{KvView, cache_lines};

/// The lines planned for the next tile and how far requesting them has gone.
#[derive(Default)]
pub(super) struct Ahead {
    /// The next tile's key lines, then its value lines, as runs of line indices (address / 64):
    /// one run per run of rows a cache keeps back to back.
    runs: Vec<Range<usize>>,
    /// Lines in all of `runs`.
    total: usize,
    /// Lines requested so far, and where the next one is: `runs[run].start + at`.
    issued: usize,
    run: usize,
    at: usize,
    /// Key reports so far in the current tile, of twice its keys: each key is reported once
    /// scored and once weighed.
    done: usize,
    /// Lines due per report, in 1/65,536ths: one division per tile, where reports come once
    /// per key.
    rate: usize,
    /// For the keys and the values: the line after the last run the previous plan saw.
    ends: [Option<usize>; 2],
    /// For the keys and the values: how far ahead of the bytes they read the kernels ask for
    /// lines (0: not at all), see [`Ahead::leads`].
    leads: [usize; 2],
}

impl Ahead {
    /// Plans rows `from..from + n` of head `kvh` of `k` and `v` (as many as the cache holds)
    /// to be requested over the current tile of `keys` keys.
    #[allow(clippy::too_many_arguments)]
    pub fn plan(
        &mut self,
        k: &KvView,
        v: &KvView,
        kvh: usize,
        hd: usize,
        from: usize,
        n: usize,
        keys: usize,
    ) {
        self.runs.clear();
        self.total = 0;
        (self.issued, self.run, self.at, self.done) = (0, 0, 0, 0);
        for (side, kv) in [k, v].into_iter().enumerate() {
            self.leads[side] = 0;
            if from >= keys && from < kv.len() {
                // The first bytes of each tile's first position (its row, or its block by
                // columns).
                let tile = keys * kv.ty().bytes(hd);
                let (here, next) = (
                    kv.head_start(kvh, hd, from - keys),
                    kv.head_start(kvh, hd, from),
                );
                if next.wrapping_sub(here) == tile {
                    // Keys a whole tile ahead, values half a tile (see `leads`).
                    self.leads[side] = if side == 0 { tile } else { tile / 2 };
                }
            }
            if from < kv.len() {
                let n = (kv.len() - from).min(n);
                kv.head_spans(kvh, hd, from, n, |span| {
                    let lines = cache_lines(span);
                    // A run that starts on the line the last one ended on, or the one after,
                    // continues a stream the hardware already follows.
                    let end = self.ends[side].replace(lines.end);
                    if end.is_some_and(|e| lines.start == e || lines.start + 1 == e) {
                        return;
                    }
                    self.total += lines.len();
                    self.runs.push(lines);
                });
            }
        }
        self.rate = (self.total << 16) / (2 * keys).max(1);
    }

    /// For the keys and the values: how many bytes ahead of each line they read the kernels
    /// ask for the line that far on, or 0. Where the next tile of a side lies one tile on from
    /// this one in memory (a sequence whose blocks were handed out one after another, kept
    /// back to back in each head's region), its runs continue the previous plan's and the plan
    /// leaves them out; the kernels ask for them instead, each a line ahead for each line it
    /// reads, so the requests keep pace with the reading and none waits in a burst for a miss
    /// buffer. The core's own stream prefetchers run only a few lines ahead while the tile's
    /// arithmetic slows the loads, so without this a Zen 2 core kept about half the misses in
    /// flight that a plain read keeps. Keys a whole tile ahead, values half a tile: with both
    /// a whole tile ahead the two tiles in use and the two requested fill the 32 KiB L1.
    /// Where the next tile lies elsewhere,
    /// the plan requests its lines from the block table.
    ///
    /// The values a half tile ahead reach only the next tile's first half in time: the
    /// weighted sum reads a tile's rows in a fraction of the tile's time, so the lines for its
    /// second half were asked for just before they were read. Keys kept by column therefore
    /// also ask for the values of the keys they score, spread over the scores' columns
    /// (`kernels_columns`): the lines arrive during the scores and the exponentials. (With the
    /// cache in L3 instead, a case decode never meets, the early lines crowd L1.)
    pub fn leads(&self) -> [usize; 2] {
        self.leads
    }

    /// `n` more keys of the current tile were scored or weighed: requests the lines due by now.
    #[inline(always)]
    pub fn advance(&mut self, n: usize) {
        self.done += n;
        if self.issued < self.total {
            self.request((self.done * self.rate) >> 16);
        }
    }

    /// Requests every line not requested yet: the end of the tile, whatever was reported.
    pub fn finish(&mut self) {
        self.request(self.total);
    }

    #[inline(always)]
    fn request(&mut self, due: usize) {
        let due = due.min(self.total);
        while self.issued < due {
            let run = &self.runs[self.run];
            let n = (due - self.issued).min(run.len() - self.at);
            let first = run.start + self.at;
            for line in first..first + n {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: prefetching is a hint that never faults, whatever the address.
                unsafe {
                    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
                    _mm_prefetch::<_MM_HINT_T0>(std::ptr::without_provenance(line * 64))
                };
                #[cfg(not(target_arch = "x86_64"))]
                let _ = line;
            }
            self.issued += n;
            self.at += n;
            if self.at == run.len() {
                (self.run, self.at) = (self.run + 1, 0);
            }
        }
    }

    /// The lines requested so far, in order (for tests).
    #[cfg(test)]
    fn requested(&self) -> Vec<usize> {
        self.runs
            .iter()
            .flat_map(|r| r.clone())
            .take(self.issued)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{CacheShape, KvFormat, KvPool, KvSequence, KvType};

    /// A one-layer pool of three 64-wide heads in blocks of 16 positions.
    fn pool(ty: KvType, blocks: usize) -> KvPool {
        KvPool::new(1, CacheShape::new(3, 64), KvFormat::both(ty), 16, blocks).unwrap()
    }

    /// Every line of the next tile is requested once over the tile's reports, keys' lines
    /// first, none before its share is due, all of them by `finish`.
    #[test]
    fn requests_its_share_of_the_lines_as_keys_are_reported() {
        let mut pool = pool(KvType::Q8_0, 32);
        let id = pool.add_sequence(256);
        let mut seq = pool.slot(id);
        seq.reserve(200).unwrap();
        let rows = vec![0.5f32; 200 * 3 * 64];
        seq.append(0, &rows, &rows);
        seq.commit(200);
        let (k, v) = pool.layer(id, 0);
        let mut ahead = Ahead::default();
        ahead.plan(&k, &v, 1, 64, 64, 64, 64);
        let mut want = Vec::new();
        k.head_spans(1, 64, 64, 64, |span| want.extend(cache_lines(span)));
        let key_lines = want.len();
        v.head_spans(1, 64, 64, 64, |span| want.extend(cache_lines(span)));
        // 64 keys of 68 bytes, one run per head: 68 or 69 lines a side.
        assert!((68..=69).contains(&key_lines), "{key_lines}");
        assert_eq!(ahead.total, want.len());
        ahead.advance(32);
        assert!(ahead.issued.abs_diff(want.len() / 4) <= 1);
        ahead.advance(32);
        assert!(ahead.issued.abs_diff(key_lines) <= 1);
        ahead.advance(60);
        assert!(ahead.issued < want.len());
        ahead.finish();
        assert_eq!(ahead.requested(), want);
        // A plan past the end of the cache has nothing to request.
        ahead.plan(&k, &v, 0, 64, 200, 64, 64);
        assert_eq!(ahead.total, 0);
        ahead.advance(128);
        ahead.finish();
    }

    /// The next tile of a sequence whose blocks lie back to back continues the streams the
    /// previous plan saw: nothing to request. After a jump (another head, or blocks elsewhere
    /// in the pool) the lines are requested again.
    #[test]
    fn runs_that_continue_the_last_plan_are_left_to_the_hardware() {
        let mut pool = pool(KvType::F16, 64);
        let (a, b) = (pool.add_sequence(512), pool.add_sequence(512));
        let rows = vec![0.25f32; 16 * 3 * 64];
        // Sequence a takes blocks 0..5 in order; then b and a take blocks in turn, so a's
        // blocks from position 80 on are every other block.
        for (id, blocks) in [
            (a, 4),
            (a, 1),
            (b, 1),
            (a, 1),
            (b, 1),
            (a, 1),
            (b, 1),
            (a, 1),
        ] {
            let mut seq = pool.slot(id);
            for _ in 0..blocks {
                seq.reserve(16).unwrap();
                seq.append(0, &rows, &rows);
                seq.commit(16);
            }
        }
        let (k, v) = pool.layer(a, 0);
        let mut ahead = Ahead::default();
        ahead.plan(&k, &v, 0, 64, 0, 32, 32);
        let first = ahead.total;
        assert!(first > 0);
        // Keys 32..64 follow keys 0..32 in both regions: the kernels ask for them, a tile
        // ahead for keys and half a tile for values.
        ahead.plan(&k, &v, 0, 64, 32, 32, 32);
        assert_eq!(ahead.total, 0);
        let tile = 32 * KvType::F16.bytes(64);
        assert_eq!(ahead.leads(), [tile, tile / 2]);
        // Another head starts elsewhere.
        ahead.plan(&k, &v, 1, 64, 64, 16, 16);
        assert_eq!(ahead.total, first / 2);
        // Head 1's next block of sequence a is two blocks on: requested as well, and the
        // kernels ask for nothing ahead of a tile whose next one lies elsewhere.
        ahead.plan(&k, &v, 1, 64, 80, 16, 16);
        assert_eq!(ahead.total, first / 2);
        assert_eq!(ahead.leads(), [0, 0]);
    }

    /// `head_start` is where `head_spans` starts for one position, whatever the layout: keys
    /// by column (the block's start), values and Q8_0 keys by row, blocks in order or
    /// scattered, and a contiguous view.
    #[test]
    fn head_start_is_where_the_spans_begin() {
        let first = |kv: &KvView, h: usize, p: usize| {
            let mut a = None;
            kv.head_spans(h, 64, p, 1, |span| {
                a.get_or_insert(span.as_ptr() as usize);
            });
            a.unwrap()
        };
        for ty in [KvType::F16, KvType::Q8_0, KvType::F32] {
            let mut pool = pool(ty, 64);
            let (a, b) = (pool.add_sequence(512), pool.add_sequence(512));
            let rows = vec![0.25f32; 16 * 3 * 64];
            for id in [a, a, b, a, b, b, a] {
                let mut seq = pool.slot(id);
                seq.reserve(16).unwrap();
                seq.append(0, &rows, &rows);
                seq.commit(16);
            }
            let (k, v) = pool.layer(a, 0);
            for kv in [&k, &v] {
                for h in 0..3 {
                    for p in 0..kv.len() {
                        assert_eq!(
                            kv.head_start(h, 64, p),
                            first(kv, h, p),
                            "{ty} head {h} at {p}"
                        );
                    }
                }
            }
        }
        let data = vec![0.5f32; 40 * 3 * 64];
        let view = KvView::from_f32(&data, 3 * 64);
        for h in 0..3 {
            for p in 0..40 {
                assert_eq!(view.head_start(h, 64, p), first(&view, h, p));
            }
        }
    }
}
