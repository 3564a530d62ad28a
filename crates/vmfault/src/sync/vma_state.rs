//! The state word of a VMA: the sequence count of the speculative fault
//! path and the per-VMA read lock, in one atomic.
//!
//! VMAs in vmfault are immutable: every change (split, merge, protection,
//! advice, unmap, even `MADV_DONTNEED`, which changes the contents) replaces
//! them. So the per-VMA sequence count of Linux's speculative page faults
//! has only two values that matter, *live* and *retired*, and a writer makes
//! it "odd" for good by retiring the VMA before it touches its PTEs.
//!
//! ```text
//! bit 0      DEAD: retired (the SPF sequence is odd, forever)
//! bits 1..   readers holding the per-VMA read lock (VmaLock fault path)
//! ```
//!
//! # Speculative fault (no lock)
//! Check `is_live` at the start; allocate and fill the page; take the PTE
//! lock; check [`VmaState::still_live_under`] again; install; unlock. The
//! writer retires *before* it takes the PTE lock to zap or narrow, so either
//! the re-check sees the retirement, or the install happened first and the
//! writer's zap removes it. `tests/loom_spf.rs` checks this, and fails when
//! the re-check is skipped (`--cfg vmfault_mutation="spf_no_recheck"`).
//!
//! # Per-VMA read lock
//! `try_read_lock` succeeds only on a live VMA; `retire` sets DEAD and then
//! waits for the readers already inside to leave, so a fault that holds the
//! lock sees a stable VMA for its whole duration, without speculation.

use super::atomic::{AtomicU64, Ordering};
use super::spin::WordGuard;

const DEAD: u64 = 1;
const READER: u64 = 2;

/// A VMA's state word. See the module docs.
#[derive(Debug, Default)]
pub struct VmaState(AtomicU64);

impl VmaState {
    /// A live VMA with no readers.
    pub fn new() -> VmaState {
        VmaState(AtomicU64::new(0))
    }

    /// Whether the VMA is live (not retired). Acquire pairs with the
    /// AcqRel `fetch_or` of `retire`.
    #[inline]
    pub fn is_live(&self) -> bool {
        self.0.load(Ordering::Acquire) & DEAD == 0
    }

    /// The speculative path's final check, made while holding the PTE lock
    /// of the entry it is about to install (the guard proves it). A writer
    /// retires the VMA before taking that lock, so if the VMA is still live
    /// here, the writer's zap or narrowing of this PTE comes after us.
    #[inline]
    pub fn still_live_under(&self, _ptl: &WordGuard<'_>) -> bool {
        cfg!(vmfault_mutation = "spf_no_recheck") || self.is_live()
    }

    /// Take the per-VMA read lock; fails if the VMA is retired.
    ///
    /// One read-modify-write, not a load and a compare-exchange: on a VMA
    /// that several vCPUs fault in, the line then moves once per lock. A
    /// reader that finds DEAD after its increment takes it back; `retire`
    /// waits for the count to drain, so such a transient reader only delays
    /// it by that one decrement.
    #[inline]
    pub fn try_read_lock(&self) -> bool {
        // Acquire: the VMA's fields as published happen-before our use.
        let old = self.0.fetch_add(READER, Ordering::Acquire);
        if old & DEAD != 0 {
            self.0.fetch_sub(READER, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Release the per-VMA read lock. Release pairs with the Acquire loads
    /// in `retire`: the reader's work happens-before the writer goes on.
    #[inline]
    pub fn read_unlock(&self) {
        let old = self.0.fetch_sub(READER, Ordering::Release);
        debug_assert!(old >= READER, "VMA read lock underflow");
    }

    /// Retire the VMA: new speculative faults and read-lockers fail, and
    /// this waits until the readers already inside have left. Call before
    /// touching the VMA's PTEs. Idempotent.
    pub fn retire(&self) {
        self.0.fetch_or(DEAD, Ordering::AcqRel);
        let mut spins = 0;
        while !cfg!(vmfault_mutation = "vma_retire_no_wait") && self.0.load(Ordering::Acquire) >= READER {
            super::backoff(&mut spins);
        }
    }

    /// Readers holding the lock now (a snapshot, for tests).
    pub fn readers(&self) -> u64 {
        self.0.load(Ordering::Relaxed) / READER
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::atomic::AtomicU32;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn lock_retire_and_recheck() {
        let s = VmaState::new();
        assert!(s.is_live());
        assert!(s.try_read_lock() && s.try_read_lock());
        assert_eq!(s.readers(), 2);
        s.read_unlock();
        s.read_unlock();
        let word = AtomicU32::new(0);
        let g = crate::sync::spin::lock(&word).0;
        assert!(s.still_live_under(&g));
        s.retire();
        assert!(!s.is_live() && !s.try_read_lock());
        assert!(!s.still_live_under(&g));
        s.retire();
    }

    #[test]
    fn retire_waits_for_readers_inside() {
        let s = Arc::new(VmaState::new());
        assert!(s.try_read_lock());
        let left = Arc::new(AtomicBool::new(false));
        let w = {
            let (s, left) = (s.clone(), left.clone());
            std::thread::spawn(move || {
                s.retire();
                assert!(left.load(std::sync::atomic::Ordering::SeqCst), "retire returned with a reader inside");
            })
        };
        while s.is_live() {
            std::thread::yield_now();
        }
        left.store(true, std::sync::atomic::Ordering::SeqCst);
        s.read_unlock();
        w.join().unwrap();
    }
}
