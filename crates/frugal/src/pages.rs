//! Large buffers read over and over (a model's repacked weights, a paged KV pool): zeroed
//! memory straight from the operating system, asked to back itself with huge pages where it is
//! written whole.
//!
//! A decode step reads every weight and, at long context, every cached key and value once:
//! tens of megabytes in runs of a few kilobytes. On 4 KiB pages nearly every run needs a page
//! walk of its own (a costly one in a virtual machine), and the hardware prefetchers, which stop
//! at page boundaries, start over every 4 KiB. On 2 MiB pages a run is one page. Where the
//! kernel grants none (another OS, huge pages off) the buffer is the same memory on small
//! pages and nothing else changes. `FRUGAL_HUGE_PAGES=0` keeps them small, to measure the
//! difference.

use std::ops::{Deref, DerefMut};

/// A huge page on x86-64 and aarch64 Linux: the alignment and granule of large buffers.
const HUGE_PAGE: usize = 2 << 20;

/// `len` zero bytes whose pages are supplied on first write, so a buffer nobody has written
/// to costs address space only.
pub(crate) struct Pages {
    map: Option<memmap2::MmapMut>,
    /// Where the buffer starts in `map`: its first huge-page boundary, for a large buffer.
    off: usize,
    len: usize,
}

impl Pages {
    /// With `huge`, a large buffer asks for huge pages. They are committed whole: the first
    /// write anywhere in one makes all 2 MiB of it resident, so a buffer written sparsely (a
    /// KV pool sized for a long context, holding a short one) would cost far more memory than
    /// it holds. An allocation that fails is an error, not an abort.
    pub(crate) fn zeroed(len: usize, huge: bool) -> Result<Self, String> {
        if len == 0 {
            return Ok(Self {
                map: None,
                off: 0,
                len: 0,
            });
        }
        let err = |e: &dyn std::fmt::Display| format!("cannot allocate {len} bytes: {e}");
        // A mapping is only page-aligned: a large buffer takes a huge page more and starts on
        // its first boundary, and ends on one, so every huge page it touches lies inside the
        // mapping and can be backed by one. The bytes outside it are never touched and cost
        // nothing but address space.
        let large = len >= HUGE_PAGE;
        let size = if large {
            len.checked_next_multiple_of(HUGE_PAGE)
                .and_then(|n| n.checked_add(HUGE_PAGE))
                .ok_or_else(|| err(&"the size overflows"))?
        } else {
            len
        };
        let map = memmap2::MmapMut::map_anon(size).map_err(|e| err(&e))?;
        let base = map.as_ptr() as usize;
        let off = if large {
            base.next_multiple_of(HUGE_PAGE) - base
        } else {
            0
        };
        #[cfg(target_os = "linux")]
        if large && huge && huge_pages_wanted() {
            // A hint: refused (no transparent huge pages), the pages stay small.
            let _ = map.advise_range(
                memmap2::Advice::HugePage,
                off,
                len.next_multiple_of(HUGE_PAGE),
            );
        }
        Ok(Self {
            map: Some(map),
            off,
            len,
        })
    }
}

impl Pages {
    /// Asks the system to put bytes `range` (whole huge pages of a large buffer) on huge pages
    /// from now on: advised (`MADV_HUGEPAGE`), so a page not written yet comes as a huge one at
    /// its first write, and merged now (`MADV_COLLAPSE`, Linux 6.1 on), copying what is
    /// written there, for a page already written on small ones. For a buffer on small pages
    /// once it is known that most of the range will be written. Hints: refused or
    /// unsupported, nothing changes; the contents stay the same either way.
    pub(crate) fn collapse(&self, range: std::ops::Range<usize>) {
        #[cfg(target_os = "linux")]
        if let Some(m) = &self.map
            && huge_pages_wanted()
            && range.start < range.end
            && range.end <= self.len
            && (self.off + range.start).is_multiple_of(HUGE_PAGE)
        {
            /// Not in every libc's bindings yet; the value is the kernel's.
            const MADV_COLLAPSE: libc::c_int = 25;
            for advice in [libc::MADV_HUGEPAGE, MADV_COLLAPSE] {
                // SAFETY: the range lies inside the mapping `m` owns; neither advice changes
                // a byte of it (the kernel copies the pages it merges).
                unsafe {
                    libc::madvise(
                        m.as_ptr().add(self.off + range.start) as *mut libc::c_void,
                        range.len(),
                        advice,
                    )
                };
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = range;
    }

    /// The huge page size: the granule of [`Self::collapse`].
    pub(crate) const HUGE: usize = HUGE_PAGE;
}

/// Whether large buffers ask for huge pages: yes unless `FRUGAL_HUGE_PAGES=0` (to measure what
/// they buy, or to keep a process on small pages).
fn huge_pages_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED.get_or_init(|| std::env::var("FRUGAL_HUGE_PAGES").map_or(true, |v| v.trim() != "0"))
}

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pages({} bytes)", self.len)
    }
}

impl Deref for Pages {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.map
            .as_ref()
            .map_or(&[], |m| &m[self.off..self.off + self.len])
    }
}

impl DerefMut for Pages {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self.map.as_mut() {
            Some(m) => &mut m[self.off..self.off + self.len],
            None => &mut [],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small and large buffers are zeroed, writable to their last byte and exactly as long as
    /// asked; a large one starts on a huge-page boundary.
    #[test]
    fn buffers_are_zeroed_writable_and_aligned() {
        for len in [
            0,
            1,
            4095,
            4097,
            HUGE_PAGE - 1,
            HUGE_PAGE,
            3 * HUGE_PAGE + 5,
        ] {
            let mut p = Pages::zeroed(len, true).unwrap();
            assert_eq!(p.len(), len);
            assert!(p.iter().all(|&b| b == 0));
            if len > 0 {
                p[len - 1] = 7;
                p[0] = 9;
                assert_eq!((p[0], p[len - 1]), (9, if len == 1 { 9 } else { 7 }));
            }
            if len >= HUGE_PAGE {
                assert_eq!(p.as_ptr() as usize % HUGE_PAGE, 0, "{len}");
            }
        }
        assert!(Pages::zeroed(usize::MAX - 5, true).is_err());
    }
}
