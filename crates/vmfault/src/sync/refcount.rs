//! A page's reference count (FreeBSD's `vm_page.ref_count`, protocol 5 in
//! `lib.rs`): one atomic word instead of a page lock.
//!
//! | bits | meaning |
//! |---|---|
//! | 31 `OBJREF` | the page belongs to an object (the object's reference) |
//! | 30 `BLOCKED` | a removal of every mapping is in progress: no new wiring through a mapping |
//! | 0..30 | wirings (`mlock`, holds of a mapped page) |
//!
//! | operation | from | to | fails when |
//! |---|---|---|---|
//! | [`RefCount::set_objref`] | 0 (unpublished) | `OBJREF` | never (the page is the caller's alone) |
//! | [`RefCount::wire_mapped`] | not `BLOCKED` | wirings + 1 | `BLOCKED` (the caller found the page through a PTE, under its lock, and falls back to a fault) |
//! | [`RefCount::try_hold`] | `OBJREF`, not `BLOCKED` | wirings + 1 | `BLOCKED`, or the page left its object (the caller found it through the object's index, inside an RCU section, and looks again) |
//! | [`RefCount::unwire`] | wirings >= 1 | wirings - 1 | never; says whether that was the last reference (the caller frees the page) |
//! | [`RefCount::release_objref`] | `OBJREF` | no `OBJREF` | never; says whether no wiring is left (the caller frees the page) |
//! | [`RefCount::unblock`] | `BLOCKED` | - `BLOCKED` | never (the daemon gives a page up) |
//! | [`RefCount::try_isolate`] | exactly `OBJREF` | `OBJREF`, `BLOCKED`, 1 wiring | anything wires the page, or it left its object, or a removal runs |
//!
//! `try_isolate` is the page daemon's first step (`reclaim`): its own
//! wiring keeps the frame from being freed under it by a racing `munmap`,
//! and `BLOCKED` makes faults that find the page refuse to map it (they
//! retry: `fault::resolve::commit_locked`) until the daemon either gives up
//! (`unblock`, `unwire`) or has replaced it by a swap slot and frees it:
//! `BLOCKED` then stays set until the frame is freed after a grace period,
//! so a fault still holding the frame number from before sees it.
//!
//! A vCPU that finds the page through a PTE, under the PTE lock, or
//! through its object's index, inside an RCU section, either wired it
//! before the isolation (whose CAS then fails: the daemon leaves the page)
//! or fails to wire it. `tests/loom_refcount.rs` runs the daemon's steps
//! (`try_isolate`, unmap, copy out, leave the object, unwire) against a
//! hold through a mapping and one through the object's index: without the
//! `BLOCKED` check of `wire_mapped` (`--cfg
//! vmfault_mutation="refcount_no_blocked_check"`) or of `try_hold`
//! (`refcount_hold_ignores_blocked`) a store lands after the copy-out and
//! is lost. (FreeBSD's `vm_page_try_remove_all`, which blocks wirings
//! without taking one, has no user here: the daemon's own wiring is what
//! keeps a racing `munmap` from freeing the frame under it.)
//!
//! There is no separate busy word (FreeBSD's `busy_lock`, which the
//! original design of protocol 5 named): each of its jobs is done by a state the page is in
//! anyway. A page being read in (from swap or its file) is an unpublished
//! frame until the read ends, so nobody can find it (exclusive busy). A
//! page being paged out is `BLOCKED`, with the daemon's wiring, unmapped
//! everywhere and past a grace period before its contents are read, so no
//! store or new mapping can reach it (exclusive busy). A file page being
//! written back by `msync` carries `WRITEBACK` in its index entry, which
//! keeps the daemon off it, while its mappings, write-protected, can still
//! read it (shared busy). A field for the same would cost four of the
//! descriptor's 64 bytes and an atomic on every one of those paths.
//!
//! Debug builds assert the preconditions of each transition.

use super::atomic::{AtomicU32, Ordering};

/// The object's reference.
pub const OBJREF: u32 = 1 << 31;
/// New wirings through mappings are blocked.
pub const BLOCKED: u32 = 1 << 30;
/// The wiring count's bits.
pub const WIRINGS: u32 = BLOCKED - 1;

/// A page's reference count; see the module docs.
#[derive(Debug, Default)]
pub struct RefCount(AtomicU32);

impl RefCount {
    /// A page that nothing references.
    pub fn new() -> RefCount {
        RefCount(AtomicU32::new(0))
    }

    /// The raw word (a snapshot).
    pub fn get(&self) -> u32 {
        self.0.load(Ordering::Acquire)
    }

    /// Wirings now (a snapshot).
    pub fn wirings(&self) -> u32 {
        self.get() & WIRINGS
    }

    /// The frame is free again (or was never published): forget every
    /// reference. Only the frame's owner calls this, when nobody else can
    /// reach the frame (past its grace period, or never published): a load
    /// and a plain store, no locked instruction (one per freed frame).
    #[inline]
    pub fn clear(&self) {
        let old = self.0.load(Ordering::Relaxed);
        self.0.store(0, Ordering::Relaxed);
        // Real checks from here on (on values the atomic already returned):
        // a wrong count frees a page something still uses.
        assert_eq!(old & WIRINGS, 0, "freeing a wired page ({old:#x})");
    }

    /// The page joins an object. Only its owner calls this, before the
    /// page is published.
    ///
    /// A plain store: no other transition starts from 0 (`try_hold` needs
    /// `OBJREF`; `wire_mapped` needs a PTE, which an unpublished page has
    /// not), so nothing can change the word between the check and it.
    #[inline]
    pub fn set_objref(&self) {
        debug_assert_eq!(self.0.load(Ordering::Relaxed), 0, "a page joined an object with references");
        self.0.store(OBJREF, Ordering::Relaxed);
    }

    /// Wire a page found through a PTE, under the PTE lock: fails while a
    /// removal of every mapping is in progress.
    #[cfg(any(test, loom))]
    pub fn wire_mapped(&self) -> bool {
        self.wire_mapped_from().is_some()
    }

    /// [`wire_mapped`](RefCount::wire_mapped), returning the wirings
    /// before this one (`None`: refused).
    pub fn wire_mapped_from(&self) -> Option<u32> {
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            if cur & BLOCKED != 0 && !crate::mutated!("refcount_no_blocked_check") {
                return None;
            }
            // 2^30 wirings of one page (e.g. holds leaked with
            // `mem::forget`) would carry into BLOCKED: refuse loudly.
            assert!(cur & WIRINGS < WIRINGS - 1, "wiring count overflow ({cur:#x})");
            match self.0.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(cur & WIRINGS),
                Err(now) => cur = now,
            }
        }
    }

    /// Wire a page found through its object's index, inside an RCU read
    /// section (the frame cannot be reused before the section ends): fails
    /// while the page is being paged out or removed from every mapping, or
    /// once it has left its object (it may be about to be freed).
    #[cfg(any(test, loom))]
    pub fn try_hold(&self) -> bool {
        self.try_hold_from().is_some()
    }

    /// [`try_hold`](RefCount::try_hold), returning the wirings before this
    /// one (`None`: refused).
    pub fn try_hold_from(&self) -> Option<u32> {
        // The mutation for the loom model: a hold that ignores `BLOCKED`.
        let refuse = if crate::mutated!("refcount_hold_ignores_blocked") { OBJREF } else { OBJREF | BLOCKED };
        let mut cur = self.0.load(Ordering::Relaxed);
        loop {
            if cur & refuse != OBJREF {
                return None;
            }
            assert!(cur & WIRINGS < WIRINGS - 1, "wiring count overflow ({cur:#x})");
            match self.0.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(cur & WIRINGS),
                Err(now) => cur = now,
            }
        }
    }

    /// Drop one wiring; whether it was the last reference of any kind (the
    /// caller then frees the page, after a grace period if it was mapped).
    #[cfg(any(test, loom))]
    #[must_use = "the last reference frees the page"]
    pub fn unwire(&self) -> bool {
        Self::was_last(self.unwire_from())
    }

    /// Drop one wiring, returning the word before (see
    /// [`was_last`](RefCount::was_last)).
    #[must_use = "the last reference frees the page"]
    pub fn unwire_from(&self) -> u32 {
        let old = self.0.fetch_sub(1, Ordering::AcqRel);
        assert!(old & WIRINGS > 0, "unwiring a page that is not wired ({old:#x})");
        old
    }

    /// Whether an unwiring from word `old` dropped the last reference of
    /// any kind.
    pub fn was_last(old: u32) -> bool {
        old & !BLOCKED == 1
    }

    /// The page leaves its object; whether no wiring is left (the caller
    /// then frees it).
    #[must_use = "without wirings the page is freed"]
    pub fn release_objref(&self) -> bool {
        // A subtraction, not `fetch_and`: with its result used, `fetch_and`
        // is a load and a compare-exchange loop, two transactions on a
        // line a teardown finds cold (the load fetches it shared, the CAS
        // then asks for it again); `OBJREF` is set (checked below), so
        // taking it away is clearing it, in one locked `xadd`.
        let old = self.0.fetch_sub(OBJREF, Ordering::AcqRel);
        assert!(old & OBJREF != 0, "releasing the object reference of a page without one ({old:#x})");
        old & WIRINGS == 0
    }

    /// The page daemon takes the page: see the module docs.
    pub fn try_isolate(&self) -> bool {
        self.0.compare_exchange(OBJREF, OBJREF | BLOCKED | 1, Ordering::AcqRel, Ordering::Relaxed).is_ok()
    }

    /// Whether a removal of every mapping (or a pageout) is in progress.
    pub fn is_blocked(&self) -> bool {
        self.get() & BLOCKED != 0
    }

    /// Allow wirings again (the last step).
    pub fn unblock(&self) {
        let old = self.0.fetch_and(!BLOCKED, Ordering::AcqRel);
        // Diagnostic only: clearing a clear bit changes nothing.
        debug_assert!(old & BLOCKED != 0, "unblocking a page that is not blocked");
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn transitions() {
        let r = RefCount::new();
        r.set_objref();
        assert_eq!(r.wire_mapped_from(), Some(0), "the first wiring");
        assert_eq!(r.try_hold_from(), Some(1));
        assert_eq!(r.wirings(), 2);
        assert!(!r.try_isolate(), "a wired page is not taken");
        assert!(!r.unwire());
        assert!(!r.release_objref(), "still wired");
        assert!(r.unwire(), "the last reference");
        assert_eq!(r.get(), 0);
    }

    #[test]
    fn an_isolated_page_refuses_wire_mapped_until_given_up() {
        let r = RefCount::new();
        r.set_objref();
        assert!(r.try_isolate());
        assert!(!r.wire_mapped());
        assert!(!r.try_isolate(), "one pageout at a time");
        r.unblock();
        assert!(r.wire_mapped());
        assert!(!r.unwire());
        assert!(!r.unwire(), "the daemon's wiring given up; the object's reference stays");
        assert!(r.release_objref());
    }

    #[test]
    fn try_hold_needs_the_object_and_no_removal() {
        let r = RefCount::new();
        assert!(!r.try_hold(), "not in an object");
        r.set_objref();
        assert!(r.try_isolate());
        assert!(!r.try_hold(), "being paged out");
        r.unblock();
        assert!(!r.unwire());
        assert!(r.try_hold());
        assert!(!r.try_isolate(), "the daemon leaves a held page");
        assert!(!r.release_objref(), "still held");
        assert!(!r.try_hold(), "it left its object");
        assert!(r.unwire(), "the hold was the last reference");
    }
}
