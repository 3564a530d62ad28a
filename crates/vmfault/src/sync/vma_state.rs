//! The state word of a VMA: the sequence count of the speculative fault
//! path, and with an RCU pin the per-VMA read lock.
//!
//! VMAs in vmfault are immutable: every change (split, merge, protection,
//! advice, unmap, even `MADV_DONTNEED`, which changes the contents) replaces
//! them. So the per-VMA sequence count of Linux's speculative page faults
//! has only two values that matter, *live* and *retired*, and a writer makes
//! it "odd" for good by retiring the VMA before it touches its PTEs.
//!
//! ```text
//! bit 0      DEAD: retired (the SPF sequence is odd, forever)
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
//! A reader holds the lock of VMA `v` while it is inside an RCU section
//! that pins an address of `v` ([`Rcu::pin`](super::rcu::Rcu::pin)) and
//! found `v` live after the pin ([`VmaState::is_live_pinned`]). A writer
//! retires `v`, then calls [`Rcu::wait_unpinned`](super::rcu::Rcu::wait_unpinned)
//! over `v`'s range before it changes anything `v` maps: the pin and the
//! retirement pair through the section's entry fence, so either the reader
//! sees DEAD and falls back, or the writer sees the pin and waits for the
//! reader to leave. While the lock is held the VMA is stable, and the fault
//! runs without speculation.
//!
//! Linux (and this module, before) counts readers in the VMA: two atomic
//! read-modify-writes per fault on a line that every vCPU faulting in that
//! VMA writes, so on one merged VMA (ebizzy's) the lock bounced as the map
//! lock does and VmaLock ran at 0.93-1.01x of MapLock. A pin is one plain
//! store to the reader's own line, ordered by the fence the section pays
//! anyway; the writer pays a scan of the readers instead, and only when it
//! removes or splits a VMA (merges wait for nobody: they change no PTE).

use super::atomic::{AtomicU64, Ordering};
use super::rcu::RcuPin;
use super::spin::WordGuard;

const DEAD: u64 = 1;

/// A VMA's state word. See the module docs.
#[derive(Debug, Default)]
pub struct VmaState(AtomicU64);

impl VmaState {
    /// A live VMA.
    pub fn new() -> VmaState {
        VmaState(AtomicU64::new(0))
    }

    /// Whether the VMA is live (not retired). Acquire pairs with the
    /// Release of `retire`.
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
        crate::mutated!("spf_no_recheck") || self.is_live()
    }

    /// Take the per-VMA read lock: `pin` must pin an address inside this
    /// VMA, and have been taken before the VMA was looked up. True if the
    /// VMA is live: it then stays stable until `pin` is dropped.
    #[inline]
    pub fn is_live_pinned(&self, _pin: &RcuPin<'_>) -> bool {
        self.is_live()
    }

    /// Retire the VMA: speculative faults and read-lockers that look at it
    /// from now on fail. Before changing what it maps, wait for the
    /// read-lockers already inside with `Rcu::wait_unpinned` over its
    /// range. Idempotent.
    pub fn retire(&self) {
        // Release pairs with the Acquire of `is_live`; the SeqCst fence of
        // `wait_unpinned` orders it before the scan of the pins.
        self.0.fetch_or(DEAD, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::atomic::AtomicU32;
    use crate::sync::rcu::Rcu;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn retire_and_recheck() {
        let s = VmaState::new();
        assert!(s.is_live());
        let word = AtomicU32::new(0);
        let g = crate::sync::spin::lock(&word).0;
        assert!(s.still_live_under(&g));
        s.retire();
        assert!(!s.is_live());
        assert!(!s.still_live_under(&g));
        s.retire();
        assert!(!s.is_live());
    }

    #[test]
    fn writer_waits_for_a_reader_that_pinned_the_vma() {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let s = Arc::new(VmaState::new());
        let r1 = readers.pop().unwrap();
        let pin = rcu.pin(&r1, 0x5000);
        assert!(s.is_live_pinned(&pin));
        let left = Arc::new(AtomicBool::new(false));
        let w = {
            let (rcu, s, left) = (rcu.clone(), s.clone(), left.clone());
            std::thread::spawn(move || {
                s.retire();
                // A pin outside the range does not hold the writer back.
                rcu.wait_unpinned(0x1000, 0x5000);
                rcu.wait_unpinned(0x4000, 0x6000);
                assert!(left.load(std::sync::atomic::Ordering::SeqCst), "the writer went on with a reader inside");
            })
        };
        while s.is_live() {
            std::thread::yield_now();
        }
        left.store(true, std::sync::atomic::Ordering::SeqCst);
        drop(pin);
        w.join().unwrap();
        // After the retirement, a new pin finds the VMA dead.
        let pin = rcu.pin(&r1, 0x5000);
        assert!(!s.is_live_pinned(&pin));
    }
}
