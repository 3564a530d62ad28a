//! The lock-rank checker: in debug builds, every lock of the hierarchy in
//! `lib.rs` is taken through a [`RankGuard`], which asserts that the
//! thread holds no lock of a later rank (nor a leaf, nor one of the same
//! rank where that rank does not nest), as gVisor's lockdep build and
//! FreeBSD's `WITNESS` do. Release builds keep nothing: a `RankGuard` is
//! then zero-sized and its checks compile away.
//!
//! A deadlock needs two threads that take two locks in opposite orders; a
//! test that takes them in the wrong order on one thread, once, is enough
//! for the checker, whatever the timing. The whole test suite runs it in
//! CI's debug step.

/// The lock classes, outermost first (the order of `lib.rs`). A thread
/// may take a lock only if every lock it holds allows it ([`Rank::allows`]):
/// in general a later rank; `Map` nests (zones, in address order); `Object` nests (a collapse takes the absorbing
/// level's, then the absorbed one's, top-down); the tree's branches that
/// hold nothing else (the page-queue and free-list locks, the drain
/// lock but for the free list) allow only what `lib.rs` puts inside
/// them; `Leaf` locks nest under anything and nothing nests under them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    /// The unattached threads' shared vCPU slot (`sync::cpu`).
    SharedSlot,
    /// An address space's heap lock `[H]` (`aspace::brk`): held by `brk`
    /// around its map-lock hold, and by `fork` around its copy.
    Heap,
    /// An address space's map lock `[M]` (one per zone with
    /// `map_lock=zoned`; zones nest in ascending address order only, which
    /// `aspace::zones::Zones::write` is the one place to take).
    Map,
    /// A VMA's read lock `[V]` (`fault_path=vmalock`): a pin in the
    /// vCPU's RCU slot (`Rcu::pin`). A writer that waits for the pins
    /// (`Rcu::wait_unpinned`) takes it as a lock: it must hold nothing a
    /// pinned fault may need, nor a pin of its own.
    VmaPin,
    /// The file-object registry (`object::file`: finding or creating the
    /// object of a file, and a file object's end leaving it).
    Files,
    /// An object's lock `[O]`.
    Object,
    /// A per-CPU cache's drain lock (`sync::percpu`): one drain of every
    /// cache at a time, held until the drained items are placed (on the
    /// global free list, for frames: `PhysMem::drain_pcpu`).
    PcpDrain,
    /// A PTE lock `[P]`.
    Pte,
    /// A hashed page lock (`refcount=pagelock`).
    Page,
    /// The page-queue lock `[Q]`.
    Queue,
    /// The global free-list lock `[F]`.
    FreeList,
    /// A leaf: nothing is taken while one is held.
    Leaf,
}

impl Rank {
    /// Whether a lock of class `inner` may be taken while one of `self`
    /// is held.
    #[cfg(all(debug_assertions, not(loom)))]
    fn allows(self, inner: Rank) -> bool {
        match self {
            Rank::Leaf | Rank::Queue | Rank::FreeList => false,
            Rank::PcpDrain => matches!(inner, Rank::FreeList | Rank::Leaf),
            Rank::VmaPin => inner >= Rank::Pte,
            Rank::Object => inner >= Rank::Object,
            Rank::Map => inner >= Rank::Map,
            _ => inner > self,
        }
    }
}

#[cfg(all(debug_assertions, not(loom)))]
mod held {
    use super::Rank;
    use std::cell::RefCell;

    thread_local! {
        /// The ranks this thread holds, in the order it took them.
        pub(super) static HELD: RefCell<Vec<Rank>> = const { RefCell::new(Vec::new()) };
    }
}

/// One held lock's place in the thread's ranks; released on drop. Make it
/// the last field of a guard, so the lock is released first.
#[derive(Debug)]
#[must_use = "the rank is released when the guard is dropped"]
pub(crate) struct RankGuard {
    #[cfg(all(debug_assertions, not(loom)))]
    rank: Option<Rank>,
}

impl RankGuard {
    /// Check that `rank` may be taken now, and record it as held. Call
    /// before blocking on the lock: a wrong order is reported even when
    /// the run would not deadlock.
    #[inline]
    pub(crate) fn enter(rank: Rank) -> RankGuard {
        Self::push(rank, true)
    }

    /// Record `rank` as held by a try-lock that succeeded: a try-lock never
    /// waits, so it may be taken in any order (as lockdep treats trylock),
    /// but what is taken while it is held is checked against it.
    #[inline]
    pub(crate) fn entered_by_try(rank: Rank) -> RankGuard {
        Self::push(rank, false)
    }

    #[inline]
    fn push(rank: Rank, check: bool) -> RankGuard {
        #[cfg(all(debug_assertions, not(loom)))]
        {
            // `try_with`: a lock may be taken in a thread-local's destructor
            // after this one's; it is then not checked.
            let recorded = held::HELD.try_with(|h| {
                let mut h = h.borrow_mut();
                if check {
                    let ok = h.iter().all(|held| held.allows(rank));
                    assert!(ok, "lock order: taking a {rank:?} lock while holding {:?} (lib.rs, \"Lock order\")", *h);
                }
                h.push(rank);
            });
            RankGuard { rank: recorded.is_ok().then_some(rank) }
        }
        #[cfg(not(all(debug_assertions, not(loom))))]
        {
            let _ = (rank, check);
            RankGuard {}
        }
    }

    /// No rank (a lock outside the hierarchy: a model's or a unit test's).
    #[cfg(any(test, loom))]
    #[inline]
    pub(crate) const fn none() -> RankGuard {
        RankGuard {
            #[cfg(all(debug_assertions, not(loom)))]
            rank: None,
        }
    }
}

impl Drop for RankGuard {
    #[inline]
    fn drop(&mut self) {
        #[cfg(all(debug_assertions, not(loom)))]
        if let Some(rank) = self.rank {
            let _ = held::HELD.try_with(|h| {
                let mut h = h.borrow_mut();
                if let Some(i) = h.iter().rposition(|&r| r == rank) {
                    h.remove(i);
                }
            });
        }
    }
}

/// A lock's guard with its rank, released after it.
#[derive(Debug)]
pub(crate) struct Ranked<G> {
    guard: G,
    _rank: RankGuard,
}

impl<G> Ranked<G> {
    /// `guard` of a lock of `rank`, taken with `rank` entered first.
    #[inline]
    pub(crate) fn take(rank: Rank, lock: impl FnOnce() -> G) -> Ranked<G> {
        let r = RankGuard::enter(rank);
        Ranked { guard: lock(), _rank: r }
    }

    /// A lock that nobody else can reach yet (a space `fork` is filling,
    /// as Linux's `mmap_write_lock_nested`): it cannot be part of a
    /// deadlock, so it is not checked, but what is taken under it is.
    #[inline]
    pub(crate) fn take_unreachable(rank: Rank, lock: impl FnOnce() -> G) -> Ranked<G> {
        Ranked { guard: lock(), _rank: RankGuard::entered_by_try(rank) }
    }

    /// A try-lock: `None` (and no rank held) if `lock` gives nothing.
    #[inline]
    pub(crate) fn try_take(rank: Rank, lock: impl FnOnce() -> Option<G>) -> Option<Ranked<G>> {
        lock().map(|guard| Ranked { guard, _rank: RankGuard::entered_by_try(rank) })
    }
}

impl<G: std::ops::Deref> std::ops::Deref for Ranked<G> {
    type Target = G::Target;
    #[inline]
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

impl<G: std::ops::DerefMut> std::ops::DerefMut for Ranked<G> {
    #[inline]
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

impl<'a, T> Ranked<std::sync::MutexGuard<'a, T>> {
    /// Wait on `cv` (the mutex is released meanwhile and the thread takes
    /// nothing else: its rank stays recorded), recovering from poisoning
    /// as [`lock`] does.
    pub(crate) fn wait(self, cv: &std::sync::Condvar) -> Self {
        let Ranked { guard, _rank } = self;
        Ranked { guard: cv.wait(guard).unwrap_or_else(|p| p.into_inner()), _rank }
    }

    /// [`Ranked::wait`] for at most `timeout`.
    pub(crate) fn wait_timeout(self, cv: &std::sync::Condvar, timeout: std::time::Duration) -> Self {
        let Ranked { guard, _rank } = self;
        Ranked { guard: cv.wait_timeout(guard, timeout).unwrap_or_else(|p| p.into_inner()).0, _rank }
    }
}

/// Lock `m` as a lock of `rank`, recovering from poisoning (a panic while
/// it was held left data that every user of these locks re-validates).
#[inline]
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>, rank: Rank) -> Ranked<std::sync::MutexGuard<'_, T>> {
    Ranked::take(rank, || unpoisoned(m.lock()))
}

/// The guard of a lock call, poisoned or not: the crate's one rule for
/// poisoning (see [`lock`]). For `RwLock`s and `get_mut`, which [`lock`]
/// does not take.
#[inline]
pub(crate) fn unpoisoned<G>(r: std::sync::LockResult<G>) -> G {
    r.unwrap_or_else(|p| p.into_inner())
}

/// The guard of a try-lock call, poisoned or not; `None` if another holds
/// the lock.
#[inline]
pub(crate) fn try_unpoisoned<G>(r: std::sync::TryLockResult<G>) -> Option<G> {
    match r {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

#[cfg(all(test, debug_assertions, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn inner_after_outer_passes() {
        let _m = RankGuard::enter(Rank::Map);
        let _o = RankGuard::enter(Rank::Object);
        let _o2 = RankGuard::enter(Rank::Object);
        let _p = RankGuard::enter(Rank::Pte);
        let _l = RankGuard::enter(Rank::Leaf);
    }

    #[test]
    #[should_panic(expected = "lock order: taking a Map lock while holding [Pte]")]
    fn outer_after_inner_fails() {
        let _p = RankGuard::enter(Rank::Pte);
        let _m = RankGuard::enter(Rank::Map);
    }

    #[test]
    #[should_panic(expected = "taking a Pte lock while holding [Pte]")]
    fn a_rank_that_does_not_nest_fails_twice() {
        let _p = RankGuard::enter(Rank::Pte);
        let _q = RankGuard::enter(Rank::Pte);
    }

    #[test]
    #[should_panic(expected = "taking a FreeList lock while holding [Queue]")]
    fn nothing_under_the_queue_lock() {
        let _q = RankGuard::enter(Rank::Queue);
        let _f = RankGuard::enter(Rank::FreeList);
    }

    #[test]
    #[should_panic(expected = "taking a Pte lock while holding [PcpDrain]")]
    fn the_drain_holds_only_the_free_list() {
        let _d = RankGuard::enter(Rank::PcpDrain);
        let _p = RankGuard::enter(Rank::Pte);
    }

    #[test]
    #[should_panic(expected = "taking a Leaf lock while holding [Leaf]")]
    fn nothing_under_a_leaf() {
        let _a = RankGuard::enter(Rank::Leaf);
        let _b = RankGuard::enter(Rank::Leaf);
    }

    #[test]
    #[should_panic(expected = "taking a Map lock while holding [Files]")]
    fn a_condvar_wait_keeps_the_rank_held() {
        let (m, cv) = (std::sync::Mutex::new(7), std::sync::Condvar::new());
        let g = lock(&m, Rank::Files);
        let g = g.wait_timeout(&cv, std::time::Duration::from_millis(1));
        assert_eq!(*g, 7);
        let _map = RankGuard::enter(Rank::Map);
    }

    #[test]
    #[should_panic(expected = "taking a VmaPin lock while holding [Map, Object]")]
    fn a_writer_waits_for_the_pins_holding_no_object_lock() {
        let (rcu, _readers) = crate::sync::rcu::Rcu::new(1);
        let _map = RankGuard::enter(Rank::Map);
        rcu.wait_unpinned(0, 4096);
        let _o = RankGuard::enter(Rank::Object);
        rcu.wait_unpinned(0, 4096);
    }

    #[test]
    #[should_panic(expected = "taking a Object lock while holding [VmaPin]")]
    fn a_pinned_fault_takes_only_pte_locks_and_below() {
        let (rcu, readers) = crate::sync::rcu::Rcu::new(1);
        let pin = rcu.pin(&readers[0], 4096);
        drop(RankGuard::enter(Rank::Pte));
        let _o = RankGuard::enter(Rank::Object);
        drop(pin);
    }

    #[test]
    fn release_out_of_order_forgets_the_right_one() {
        let m = RankGuard::enter(Rank::Map);
        let p = RankGuard::enter(Rank::Pte);
        drop(m);
        let q = RankGuard::enter(Rank::Queue);
        drop(q);
        drop(p);
        // Nothing is left held: the outermost rank is allowed again.
        let _m = RankGuard::enter(Rank::Map);
    }
}
