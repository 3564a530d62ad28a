//! Wiring and unwiring pages, in either of the two ways `VmConfig::refcount`
//! selects (protocol 5 in `lib.rs`).
//!
//! - `Atomic`: the page's [`RefCount`](crate::sync::refcount::RefCount)
//!   alone; a wiring is one atomic read-modify-write on the page's own
//!   descriptor, so vCPUs wiring different pages share nothing.
//! - `PageLock`: the baseline, FreeBSD before r353535 (the seed): the same
//!   count, changed under the page's lock. The locks are 256 one-word locks
//!   (`sync::spin`, spinning then yielding like an adaptive mutex), each on
//!   its own cache line, picked by the 2 MiB region of the frame as
//!   FreeBSD's `PA_LOCKPTR` does: neighbouring frames share a lock, so
//!   vCPUs wiring nearby pages contend even when the pages differ. Every
//!   acquisition is counted (`page_lock_acquisitions`).
//!
//! Every wiring is counted (`wirings`) on the vCPU that made it. In the
//! baseline a page's queue change (`Frames::enqueue`, with swap) takes its
//! page lock too, as `vm_page_activate` did before the seed.

use super::{Pfn, PhysMem};
use crate::stats::{Counter, CounterSet};
use crate::sync::atomic::AtomicU32;
use crate::sync::refcount::{RefCount, WIRINGS};
use crate::sync::spin::{self, WordGuard};

/// Number of page locks (FreeBSD's `PA_LOCK_COUNT` on amd64).
const PAGE_LOCKS: usize = 256;
/// Frames per lock region: 2 MiB (FreeBSD's `pa_index`, `PDRSHIFT`).
const REGION_SHIFT: u32 = 9;

/// One page lock on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct PageLock(AtomicU32);

/// The hashed page locks of the `PageLock` baseline.
#[derive(Debug)]
pub(crate) struct PageLocks {
    /// `[a]` the lock words (`sync::spin`).
    locks: Box<[PageLock]>,
}

impl PageLocks {
    pub(crate) fn new() -> PageLocks {
        PageLocks { locks: (0..PAGE_LOCKS).map(|_| PageLock::default()).collect() }
    }

    /// Take the lock of `pfn`, counting the acquisition.
    fn lock(&self, pfn: Pfn, counters: Option<&CounterSet>) -> WordGuard<'_> {
        if let Some(c) = counters {
            c.inc(Counter::page_lock_acquisitions);
        }
        let i = (pfn.0 >> REGION_SHIFT) as usize % PAGE_LOCKS;
        spin::lock_as(&self.locks[i].0, crate::sync::rank::Rank::Page).0
    }
}

impl PhysMem {
    /// The page lock of `pfn` in the baseline mode; nothing otherwise.
    #[inline]
    pub(super) fn page_lock(&self, pfn: Pfn, counters: Option<&CounterSet>) -> Option<WordGuard<'_>> {
        self.page_locks.as_ref().map(|l| l.lock(pfn, counters))
    }

    /// `RefCount::wire_mapped` (the caller found the page through a PTE,
    /// under its lock): fails while a removal of every mapping runs.
    pub(crate) fn wire_mapped(&self, pfn: Pfn, counters: Option<&CounterSet>) -> bool {
        self.try_wire(pfn, counters, RefCount::wire_mapped_from)
    }

    /// `RefCount::try_hold` (the caller found the page through its object's
    /// index, inside an RCU section): fails while the page is being paged
    /// out, or once it has left its object.
    pub(crate) fn try_hold(&self, pfn: Pfn, counters: Option<&CounterSet>) -> bool {
        self.try_wire(pfn, counters, RefCount::try_hold_from)
    }

    /// Wire `pfn` with `wire` under its page lock (the baseline), counting
    /// the wiring if it succeeds, and the page as wired if it was not.
    fn try_wire(&self, pfn: Pfn, counters: Option<&CounterSet>, wire: fn(&RefCount) -> Option<u32>) -> bool {
        let _lock = self.page_lock(pfn, counters);
        let Some(before) = wire(&self.page(pfn).refs) else { return false };
        if let Some(c) = counters {
            c.inc(Counter::wirings);
        }
        if before == 0 {
            self.count(counters, Counter::pages_wired, 1);
        }
        true
    }

    /// `RefCount::unwire`: whether that was the last reference (the caller
    /// frees the page, after a grace period if it was ever mapped).
    #[must_use = "the last reference frees the page"]
    pub(crate) fn unwire(&self, pfn: Pfn, counters: Option<&CounterSet>) -> bool {
        let _lock = self.page_lock(pfn, counters);
        self.unwired(pfn, counters)
    }

    /// The page daemon takes `pfn` (`RefCount::try_isolate`: a wiring of
    /// its own on a page that had none).
    pub(crate) fn isolate(&self, pfn: Pfn) -> bool {
        let taken = self.page(pfn).refs.try_isolate();
        if taken {
            self.count(None, Counter::pages_wired, 1);
        }
        taken
    }

    /// The page daemon drops its wiring of an isolated page (no page lock:
    /// `BLOCKED` kept other wirings out until it was cleared); whether that
    /// was the last reference.
    #[must_use = "the last reference frees the page"]
    pub(crate) fn daemon_unwire(&self, pfn: Pfn) -> bool {
        self.unwired(pfn, None)
    }

    /// Drop one wiring of `pfn`, counting the page unwired if it was its
    /// last; whether it was the last reference of any kind.
    fn unwired(&self, pfn: Pfn, counters: Option<&CounterSet>) -> bool {
        let old = self.page(pfn).refs.unwire_from();
        if old & WIRINGS == 1 {
            self.count(counters, Counter::pages_unwired, 1);
        }
        RefCount::was_last(old)
    }
}
