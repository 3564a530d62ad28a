//! The global frame allocator: one LIFO list of free frames behind one lock
//! (`[F]`, the innermost lock of the lock order).
//!
//! All our allocations are single frames (data pages, page-table pages,
//! index nodes), so a buddy allocator would only add splitting and
//! coalescing work; a LIFO list also hands back the most recently freed,
//! cache-warm frame first. Batches move many frames per acquisition, which
//! is what the per-CPU caches of the next layer build on.
//!
//! The number of acquisitions is counted *under* the lock it counts: that
//! adds no shared cache line that the lock itself does not already bounce.

use std::sync::Mutex;

use super::page::{Kind, Page};
use crate::sync::atomic::{AtomicU64, Ordering};

/// End of the list.
const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct Inner {
    /// `[F]` first free frame, or `NIL`.
    head: u32,
}

/// The global free list.
#[derive(Debug)]
pub(crate) struct FreeList {
    inner: Mutex<Inner>,
    /// `[F]` number of free frames (written under the lock, read lockless).
    count: AtomicU64,
    /// `[F]` lock acquisitions so far (written under the lock, read lockless).
    acquisitions: AtomicU64,
}

impl FreeList {
    /// A list holding frames `first..frames` (in ascending order from the head).
    pub(crate) fn new(pages: &[Page], first: u32) -> FreeList {
        let frames = pages.len() as u32;
        for pfn in first..frames {
            let next = if pfn + 1 < frames { pfn + 1 } else { NIL };
            pages[pfn as usize].next.store(next, Ordering::Relaxed);
        }
        let head = if first < frames { first } else { NIL };
        FreeList {
            inner: Mutex::new(Inner { head }),
            count: AtomicU64::new(u64::from(frames - first)),
            acquisitions: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let n = self.acquisitions.load(Ordering::Relaxed);
        self.acquisitions.store(n + 1, Ordering::Relaxed);
        g
    }

    /// Take up to `want` frames in one acquisition, appending them to `out`
    /// (each now `OWNED`). Returns how many were taken.
    pub(crate) fn take(&self, pages: &[Page], want: usize, out: &mut impl Extend<u32>) -> usize {
        let mut g = self.lock();
        let mut taken = 0;
        while taken < want && g.head != NIL {
            let pfn = g.head;
            let page = &pages[pfn as usize];
            page.set_kind(Kind::Free, Kind::Owned);
            g.head = page.next.load(Ordering::Relaxed);
            out.extend(std::iter::once(pfn));
            taken += 1;
        }
        let c = self.count.load(Ordering::Relaxed);
        self.count.store(c - taken as u64, Ordering::Relaxed);
        taken
    }

    /// Take one frame (one acquisition).
    pub(crate) fn take_one(&self, pages: &[Page]) -> Option<u32> {
        let mut slot = None;
        struct One<'a>(&'a mut Option<u32>);
        impl Extend<u32> for One<'_> {
            fn extend<I: IntoIterator<Item = u32>>(&mut self, it: I) {
                for v in it {
                    *self.0 = Some(v);
                }
            }
        }
        self.take(pages, 1, &mut One(&mut slot));
        slot
    }

    /// Return frames (each `OWNED`, i.e. unreachable by anyone else) in one acquisition.
    pub(crate) fn give(&self, pages: &[Page], frames: impl IntoIterator<Item = u32>) {
        let mut g = self.lock();
        let mut n = 0u64;
        for pfn in frames {
            let page = &pages[pfn as usize];
            page.set_kind(Kind::Owned, Kind::Free);
            page.next.store(g.head, Ordering::Relaxed);
            g.head = pfn;
            n += 1;
        }
        let c = self.count.load(Ordering::Relaxed);
        self.count.store(c + n, Ordering::Relaxed);
    }

    /// Free frames now (a snapshot).
    pub(crate) fn free_frames(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Lock acquisitions so far (a snapshot).
    pub(crate) fn acquisitions(&self) -> u64 {
        self.acquisitions.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn take_and_give_in_batches() {
        let pages: Vec<Page> = (0..200).map(|_| Page::new()).collect();
        let fl = FreeList::new(&pages, 1);
        assert_eq!(fl.free_frames(), 199);
        let mut got = Vec::new();
        assert_eq!(fl.take(&pages, 150, &mut got), 150);
        assert_eq!(got.len(), 150);
        assert_eq!(got[0], 1);
        let mut more = Vec::new();
        assert_eq!(fl.take(&pages, 100, &mut more), 49);
        assert_eq!(fl.free_frames(), 0);
        assert_eq!(fl.take(&pages, 1, &mut more), 0);
        fl.give(&pages, got.iter().copied());
        assert_eq!(fl.free_frames(), 150);
        assert_eq!(fl.acquisitions(), 4);
        let mut all: Vec<u32> = Vec::new();
        fl.take(&pages, 1000, &mut all);
        all.extend(more);
        all.sort();
        assert_eq!(all, (1..200).collect::<Vec<u32>>());
    }
}
