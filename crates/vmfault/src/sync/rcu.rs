//! A small RCU with a blocking [`Rcu::synchronize`].
//!
//! # Why our own
//! The protocols of this crate need "unlink, wait until nobody can still see
//! it, then reuse": a TLB shootdown before freeing unmapped frames, the
//! remote drain of a per-CPU page cache, freeing page-table pages under a
//! lockless walker. That needs a *blocking* grace-period wait (and, for
//! frees nobody should wait for, one that can be polled); crossbeam-epoch
//! and seize only defer frees to whichever thread next advances the epoch.
//!
//! # How
//! Each reader (one per vCPU slot) owns a counter. The counter is odd while
//! the reader is inside a read-side section and even outside it, so a vCPU
//! that is idle, blocked, or running its own code outside vmfault is
//! *quiescent* without doing anything: the user-space analogue of NOHZ_FULL.
//!
//! ```text
//! reader (owner of counter c)          writer
//!   c.store(c+1, Release) [odd]          unlink X (e.g. clear a PTE)
//!   fence(SeqCst)  ---- pairs with ----  fence(SeqCst)
//!   read pointers, use X                 for each reader r:
//!   c.store(c+1, Release) [even] ---->     v = r.load(Acquire)
//!                         pairs with       if v is odd: wait until r != v
//!                                        reuse X
//! ```
//!
//! Either the writer's fence comes first in the SeqCst order, and the reader
//! cannot see X any more; or the reader's fence comes first, and the writer's
//! load sees the odd counter and waits until that section ends. The Release
//! store at the end of the section pairs with the writer's Acquire load, so
//! everything the reader did inside happens-before the reuse.
//!
//! # Rules
//! - A read-side section never blocks on a lock that anybody holds across
//!   `synchronize()` (in particular not on an address space's map lock):
//!   that would deadlock. Sections are short and explicit.
//! - `synchronize()` is never called inside a read-side section of the
//!   calling thread (debug builds check this).
//! - Sections nest (a nesting count in the [`RcuReader`]); only the
//!   outermost one touches the counter.
//!
//! # Deferred reclamation
//! [`Rcu::retire`] wraps an unlinked object with a cookie (Linux's
//! `get_state_synchronize_rcu`); [`Rcu::reclaim`] hands it back once any
//! grace period that *started* after the cookie has completed
//! (`poll_state_synchronize_rcu`), so every `synchronize()`, whoever calls
//! it, moves reclamation on. [`RcuArc`] is a published pointer built on it.
//!
//! # Polled grace periods: no wait when nobody is reading
//! [`Rcu::poll`] runs the same grace period as `synchronize`, a step at a
//! time: its first call bumps the start counter, fences and notes the
//! readers whose counter is odd; a later call completes it once every
//! noted counter has moved, instead of spinning on them. With no reader
//! inside a section it completes at once, so an operation of a lone vCPU
//! (or one that meets the others between their faults) waits for nothing,
//! and a deferred free completes at the owner's next poll what its own
//! poll started (`phys::deferred`). [`Rcu::grace_period`] polls and waits
//! only if that does not complete. The loom model checks that a poll is
//! ordered after the sections it saw, and fails when it stops looking
//! whether they have ended (`rcu_poll_unseen`).
//!
//! # Pins: per-object read locks without a shared write
//! [`Rcu::pin`] enters a section that also publishes one page address in
//! the reader's own slot, *before* the section's entry fence; the pin is
//! cleared (Release) when the section ends. A writer that has made an
//! object unreachable or marked it dead calls [`Rcu::wait_unpinned`] over
//! the object's address range: a fence, then, for every reader whose pin
//! lies in the range, a wait until that pin changes. The same fence pairing
//! as above decides: either the pinned reader sees the writer's mark after
//! its fence, or the writer sees the pin and waits for the reader to leave.
//! This is how the per-VMA read lock of the `VmaLock` fault path is built
//! (see `sync::vma_state`): it costs a fault one plain store before the
//! fence it already pays, where a reader count in the VMA would cost two
//! atomic read-modify-writes on a line every faulting vCPU shares.
//!
//! The loom model `tests/loom_rcu.rs` checks the reader/writer pairing, and
//! fails when the grace period is skipped (`--cfg vmfault_mutation="rcu_no_grace"`)
//! or when the reader's fence is removed (`--cfg vmfault_mutation="rcu_no_reader_fence"`).
//! A third model covers a writer that meets the *next* section's odd value;
//! it guards the Release on the entry store (`rcu_relaxed_entry`).

// This file holds unsafe code, each block with its `// SAFETY:`
// argument, and each item that holds one allows `unsafe_code` on itself:
// the crate denies it everywhere else.

use std::cell::Cell;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use super::CachePadded;
use super::atomic::{AtomicPtr, AtomicU64, Ordering, fence};

/// What a reader's pin word holds when it pins nothing: its page part lies
/// above every user address.
const NO_PIN: u64 = u64::MAX;
/// The low bits of a pin word: a per-reader generation, so a writer can
/// tell a new pin of the same page from the one it is waiting for.
const PIN_GEN: u64 = 0xfff;

/// One reader's words, on a cache line of their own.
#[derive(Debug)]
struct Slot {
    /// `[a]` odd inside a read-side section. Written only by the reader that
    /// owns it, read by `synchronize`.
    count: AtomicU64,
    /// `[a]` the page the owner pins ([`Rcu::pin`]), its low bits a
    /// generation, or `NO_PIN`. Written only by the owner (Relaxed, before
    /// its entry fence; Release when it ends), read by `wait_unpinned`.
    pin: AtomicU64,
}

/// A set of readers and the grace-period machinery over them.
#[derive(Debug)]
pub struct Rcu {
    /// `[S]` one slot per reader.
    slots: Box<[CachePadded<Slot>]>,
    /// `[I]` unique among the process's `Rcu`s (readers and retired
    /// objects name it).
    id: usize,
    /// `[a]` grace periods started (incremented, SeqCst, when one starts).
    gp_started: CachePadded<AtomicU64>,
    /// `[a]` the highest grace period completed (Release, pairs with the
    /// Acquire in `elapsed`).
    gp_done: CachePadded<AtomicU64>,
    /// `[L]` the grace period [`Rcu::poll`] moves on, under its own mutex: a
    /// leaf that is only ever try-locked (nobody waits for it), on a line
    /// of its own (`slots` and `id` are read by every section).
    polled: CachePadded<super::Mutex<Polled>>,
}

/// A grace period that [`Rcu::poll`] runs a step at a time, never waiting.
#[derive(Debug)]
struct Polled {
    /// `[L]` (`Rcu::polled`) its number (`gp_started` after its increment); 0 when none runs.
    seq: u64,
    /// `[L]` (`Rcu::polled`) per reader: the odd count seen when it started (a section it must
    /// see end), or 0 once that section has ended (or none was running).
    seen: Box<[u64]>,
    /// `[L]` (`Rcu::polled`) readers in `seen` still inside the section seen.
    left: usize,
}

/// A look that found no reader of an [`Rcu`] inside a read-side section
/// ([`Rcu::quiet`]): whatever was unlinked before it can be freed. Made
/// only by that look.
#[derive(Debug, Clone, Copy)]
pub struct Quiet {
    /// The `Rcu` looked at.
    rcu: usize,
}

/// When an object was unlinked, in grace periods (see [`Rcu::retire`]);
/// a later cookie orders after an earlier one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct GpCookie(u64);

/// An unlinked object waiting for a grace period before it may be dropped.
/// Dropping a `Retired` without [`Rcu::reclaim`] leaks the object (safe).
#[derive(Debug)]
pub struct Retired<T> {
    item: ManuallyDrop<T>,
    cookie: GpCookie,
    rcu: usize,
}

impl<T> Retired<Option<T>> {
    /// The item, if there is one, retired at the same time (`None` holds
    /// nothing to wait for).
    pub fn transpose(self) -> Option<Retired<T>> {
        let Retired { item, cookie, rcu } = self;
        ManuallyDrop::into_inner(item).map(|item| Retired { item: ManuallyDrop::new(item), cookie, rcu })
    }
}

impl<T> Retired<T> {
    /// When it was unlinked.
    pub fn cookie(&self) -> GpCookie {
        self.cookie
    }

    /// `f` of the item, retired at the same time (to keep retired values
    /// of several types on one list, e.g. boxed as `dyn Send`).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Retired<U> {
        let Retired { item, cookie, rcu } = self;
        Retired { item: ManuallyDrop::new(f(ManuallyDrop::into_inner(item))), cookie, rcu }
    }
}

/// The right to enter read-side sections as one reader of an [`Rcu`].
///
/// Exactly one exists per reader, created by [`Rcu::new`]; it is `Send` but
/// not `Sync`, so one thread at a time uses it.
#[derive(Debug)]
pub struct RcuReader {
    /// `[I]` which counter this reader owns.
    index: usize,
    /// `[I]` address of the owning `Rcu`'s counter array, to catch mix-ups.
    owner: usize,
    /// `[o]` nesting depth of read-side sections.
    nesting: Cell<u32>,
    /// `[o]` pins taken so far (the generation in the pin word).
    pins: Cell<u64>,
}

/// A read-side section that pins a page ([`Rcu::pin`]); unpins and ends
/// when dropped. Usable wherever a section is.
#[derive(Debug)]
#[must_use = "the pin and the section end when the guard is dropped"]
pub struct RcuPin<'a> {
    section: RcuReadGuard<'a>,
    /// The pin's place in the lock order (`Rank::VmaPin`), released
    /// after the section.
    _rank: super::rank::RankGuard,
}

impl<'a> std::ops::Deref for RcuPin<'a> {
    type Target = RcuReadGuard<'a>;
    fn deref(&self) -> &RcuReadGuard<'a> {
        &self.section
    }
}

impl Drop for RcuPin<'_> {
    #[inline]
    fn drop(&mut self) {
        // Release: what the section did under the pin happens-before a
        // `wait_unpinned` that sees the pin gone. The section ends after.
        let s = &self.section;
        s.rcu.slots[s.reader.index].pin.store(NO_PIN, Ordering::Release);
    }
}

/// A read-side section; ends when dropped.
#[derive(Debug)]
#[must_use = "the read-side section ends when the guard is dropped"]
pub struct RcuReadGuard<'a> {
    rcu: &'a Rcu,
    reader: &'a RcuReader,
    /// The reader's counter (its slot looked up once, at entry).
    count: &'a AtomicU64,
}

#[cfg(all(debug_assertions, not(loom)))]
thread_local! {
    /// Read-side sections the current thread is inside (any `Rcu`).
    static SECTIONS: Cell<u32> = const { Cell::new(0) };
}

#[cfg(not(loom))]
thread_local! {
    /// Grace periods the current thread has waited for (any `Rcu`), taken
    /// by the vCPU context at the end of each operation (`caller_grace_waits`).
    static WAITS: Cell<u64> = const { Cell::new(0) };
}

/// Grace periods the calling thread has waited for since the last call.
#[inline]
pub fn take_thread_waits() -> u64 {
    #[cfg(not(loom))]
    {
        WAITS.with(|w| w.replace(0))
    }
    #[cfg(loom)]
    {
        0
    }
}

impl Rcu {
    /// An RCU with `readers` readers, and the reader handles.
    pub fn new(readers: usize) -> (Rcu, Vec<RcuReader>) {
        let slots: Box<[CachePadded<Slot>]> =
            (0..readers).map(|_| CachePadded(Slot { count: AtomicU64::new(0), pin: AtomicU64::new(NO_PIN) })).collect();
        // A unique id (not the slots' address, which a new Rcu may reuse
        // once this one is dropped).
        static NEXT_ID: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
        let owner = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let handles =
            (0..readers).map(|index| RcuReader { index, owner, nesting: Cell::new(0), pins: Cell::new(0) }).collect();
        let rcu = Rcu {
            slots,
            id: owner,
            gp_started: CachePadded(AtomicU64::new(0)),
            gp_done: CachePadded(AtomicU64::new(0)),
            polled: CachePadded(super::Mutex::new(Polled {
                seq: 0,
                seen: vec![0; readers].into_boxed_slice(),
                left: 0,
            })),
        };
        (rcu, handles)
    }

    /// Enter a read-side section as `reader`.
    ///
    /// Anything unlinked before a concurrent `synchronize()` returns cannot be
    /// reached inside a section that started after it; anything reached
    /// inside a section stays valid until the section ends.
    #[inline]
    pub fn read_lock<'a>(&'a self, reader: &'a RcuReader) -> RcuReadGuard<'a> {
        assert_eq!(reader.owner, self.id(), "RcuReader used with another Rcu");
        let depth = reader.nesting.get();
        let c = &self.slots[reader.index].count;
        if depth == 0 {
            // Only this reader writes its counter, so load + store suffices.
            let v = c.load(Ordering::Relaxed);
            // Real: an odd counter would make this reader look quiescent.
            assert!(v & 1 == 0, "reader counter odd outside a section");
            // Release, not Relaxed: a writer that saw the previous section's
            // odd value and now reads this one (having missed the even value
            // in between) must still synchronize with everything the previous
            // section did. Under C++20 rules a relaxed store does not continue
            // the release sequence of the exit store before it.
            let entry = if crate::mutated!("rcu_relaxed_entry") { Ordering::Relaxed } else { Ordering::Release };
            c.store(v + 1, entry);
            // Pairs with the fence at the start of `synchronize`: either the
            // writer sees this odd counter, or this section sees the unlink.
            if !crate::mutated!("rcu_no_reader_fence") {
                fence(Ordering::SeqCst);
            }
        }
        reader.nesting.set(depth + 1);
        #[cfg(all(debug_assertions, not(loom)))]
        SECTIONS.with(|s| s.set(s.get() + 1));
        RcuReadGuard { rcu: self, reader, count: c }
    }

    /// Wait for a grace period: every read-side section that was running
    /// when this call started has ended when it returns. Readers that are
    /// outside a section are not waited for at all.
    ///
    /// Must not be called inside a read-side section of the calling thread.
    pub fn synchronize(&self) {
        #[cfg(all(debug_assertions, not(loom)))]
        SECTIONS.with(|s| assert_eq!(s.get(), 0, "Rcu::synchronize inside a read-side section"));
        #[cfg(not(loom))]
        WAITS.with(|w| w.set(w.get() + 1));
        if crate::mutated!("rcu_no_grace") {
            // Mutation for the loom model: skip the grace period entirely.
            return;
        }
        let seq = self.gp_started.fetch_add(1, Ordering::SeqCst) + 1;
        // Pairs with the fence in `read_lock`.
        fence(Ordering::SeqCst);
        for slot in self.slots.iter() {
            let c = &slot.count;
            // Acquire pairs with the Release store that ends the section.
            let v = c.load(Ordering::Acquire);
            if v & 1 == 1 {
                let mut spins = 0;
                while c.load(Ordering::Acquire) == v {
                    super::backoff(&mut spins);
                }
            }
        }
        // Release: everything the waited-for sections did happens-before a
        // reclaimer that sees this (Acquire in `elapsed`).
        self.gp_done.fetch_max(seq, Ordering::Release);
    }

    /// The current grace-period state, to compare with later (Linux's
    /// `get_state_synchronize_rcu`). Take it *after* unlinking.
    pub fn cookie(&self) -> GpCookie {
        // Orders the unlink before the load: a grace period counted as
        // started after this cookie started after the unlink too.
        fence(Ordering::SeqCst);
        GpCookie(self.gp_started.load(Ordering::Relaxed))
    }

    /// A grace period, as [`synchronize`](Rcu::synchronize), but polled
    /// first ([`poll`](Rcu::poll)): with no reader inside a section it
    /// completes with no wait (and counts none).
    pub fn grace_period(&self) {
        if !self.poll(self.cookie()) {
            self.synchronize();
        }
    }

    /// A grace period for a background thread, which must not take the
    /// CPU from the readers it waits for: polled ([`poll`](Rcu::poll)),
    /// sleeping between polls (20 µs, doubling up to 1 ms) where
    /// [`synchronize`](Rcu::synchronize) spins and yields. On a machine
    /// with no spare core, a spinning waiter that preempted a reader
    /// inside its section keeps it from ending that section, and every
    /// vCPU that needs the same grace period waits as long (the
    /// grace-period thread's `synchronize` made page_fault1's allocations
    /// wait at two vCPUs on two cores). Counted as no wait.
    pub fn grace_period_sleeping(&self) {
        let cookie = self.cookie();
        let mut nap = std::time::Duration::from_micros(20);
        while !self.poll(cookie) {
            std::thread::sleep(nap);
            nap = (nap * 2).min(std::time::Duration::from_millis(1));
        }
    }

    /// Whether a full grace period has elapsed since `cookie` was taken,
    /// moving one on without ever waiting (Linux's
    /// `start_poll_synchronize_rcu` and `poll_state_synchronize_rcu` in
    /// one): the first call starts a grace period (the increment and
    /// fence of [`synchronize`](Rcu::synchronize)) and notes each reader
    /// inside a section; a later call completes it once every noted
    /// section has ended (its counter moved, loaded Acquire: the
    /// reader's next Release store ends or follows that section), where
    /// `synchronize` would have spun. With no reader inside a section it
    /// completes at once, so a lone vCPU never waits and a busy one
    /// completes at its next call; another thread polling meanwhile makes
    /// this call return `false` (it never blocks). May be called inside a
    /// read-side section: the caller's own section is then one to see end,
    /// at a later call. Counted as no wait (`caller_grace_waits`).
    pub fn poll(&self, cookie: GpCookie) -> bool {
        if self.elapsed(cookie) {
            return true;
        }
        let Ok(mut p) = self.polled.try_lock() else {
            return false;
        };
        // At most two rounds: one to complete a grace period that started
        // before `cookie` (it cannot count), one to start and complete one.
        for _ in 0..2 {
            let p = &mut *p;
            if p.seq == 0 {
                p.seq = self.gp_started.fetch_add(1, Ordering::SeqCst) + 1;
                // Pairs with the fence in `read_lock`, as in `synchronize`.
                fence(Ordering::SeqCst);
                p.left = 0;
                for (seen, slot) in p.seen.iter_mut().zip(self.slots.iter()) {
                    // Acquire pairs with the Release store that ends a section.
                    let v = slot.count.load(Ordering::Acquire);
                    *seen = if v & 1 == 1 { v } else { 0 };
                    p.left += usize::from(v & 1 == 1);
                }
            } else {
                // Only the readers noted inside a section are looked at
                // again (each look is a cache miss on a line its owner
                // writes at every section).
                for (seen, slot) in p.seen.iter_mut().zip(self.slots.iter()) {
                    if *seen != 0 && (crate::mutated!("rcu_poll_unseen") || slot.count.load(Ordering::Acquire) != *seen)
                    {
                        *seen = 0;
                        p.left -= 1;
                    }
                }
            }
            if p.left > 0 {
                return false;
            }
            // Release: the ended sections happen-before a reclaimer that
            // sees this (Acquire in `elapsed`), as in `synchronize`.
            self.gp_done.fetch_max(p.seq, Ordering::Release);
            p.seq = 0;
            if self.elapsed(cookie) {
                return true;
            }
        }
        false
    }

    /// Whether no reader is inside a read-side section now: then whatever
    /// the caller unlinked before this call can be freed (a grace period
    /// of the caller's own, with no reader to wait for). Unlike
    /// [`poll`](Rcu::poll) it writes nothing shared (it only reads the
    /// readers' counters), and records nothing: `elapsed` does not learn
    /// of it. Called inside a section of the caller's own, it answers
    /// false.
    pub fn quiescent(&self) -> bool {
        if crate::mutated!("rcu_quiescent_blind") {
            // Mutation for the loom model: never look at the readers.
            return true;
        }
        // Orders the caller's unlinks before the loads; pairs with the
        // fence in `read_lock` (a reader entering after this sees them).
        if !crate::mutated!("rcu_quiescent_no_fence") {
            fence(Ordering::SeqCst);
        }
        // Acquire pairs with the Release store that ends a section.
        self.slots.iter().all(|slot| slot.count.load(Ordering::Acquire) & 1 == 0)
    }

    /// [`quiescent`](Rcu::quiescent) as a proof: `Some` if no reader was
    /// inside a section at the look, for [`reclaim_quiet`](Rcu::reclaim_quiet).
    pub fn quiet(&self) -> Option<Quiet> {
        self.quiescent().then_some(Quiet { rcu: self.id() })
    }

    /// If no reader is inside a section ([`quiescent`](Rcu::quiescent)),
    /// take back every object of `list` (all were retired before this
    /// call), giving each to `take`, and return true; else leave the list.
    pub fn reclaim_quiescent<T>(&self, list: &mut Vec<Retired<T>>, take: impl FnMut(T)) -> bool {
        match self.quiet() {
            Some(proof) => {
                self.reclaim_quiet(list, proof, take);
                true
            }
            None => false,
        }
    }

    /// Take back every object of `list`, giving each to `take`: a look
    /// that found no reader inside a section (`proof`) came after every
    /// one of them was retired.
    ///
    /// # Preconditions
    /// Every entry of `list` was retired (unlinked) before the look that
    /// made `proof`: the caller took the proof after every push it made,
    /// and nobody else pushes to `list` (else use
    /// [`reclaim_quiescent`](Rcu::reclaim_quiescent), which looks under
    /// whatever keeps the list).
    #[allow(unsafe_code)]
    pub fn reclaim_quiet<T>(&self, list: &mut Vec<Retired<T>>, proof: Quiet, mut take: impl FnMut(T)) {
        assert_eq!(proof.rcu, self.id(), "a proof of another Rcu");
        assert!(list.iter().all(|r| r.rcu == self.id()), "Retired of another Rcu");
        for mut r in list.drain(..) {
            // SAFETY: taken exactly once; `r` is dropped right after
            // without touching `item` (`Retired` has no drop glue for it).
            take(unsafe { ManuallyDrop::take(&mut r.item) });
        }
    }

    /// Whether a full grace period has elapsed since `cookie` was taken
    /// (Linux's `poll_state_synchronize_rcu`).
    pub fn elapsed(&self, cookie: GpCookie) -> bool {
        self.gp_done.load(Ordering::Acquire) > cookie.0
    }

    /// Wrap an object that has just been unlinked (no new reader can reach
    /// it) for reclamation after a grace period.
    pub fn retire<T>(&self, item: T) -> Retired<T> {
        Retired { item: ManuallyDrop::new(item), cookie: self.cookie(), rcu: self.id() }
    }

    /// Take back the objects of `list` whose grace period has elapsed;
    /// with `wait`, first wait for one if any is still pending. Must not be
    /// called inside a read-side section when `wait` is set.
    pub fn reclaim<T>(&self, list: &mut Vec<Retired<T>>, wait: bool) -> Vec<T> {
        let mut out = Vec::new();
        self.reclaim_each(list, wait, |t| out.push(t));
        out
    }

    /// [`reclaim`](Rcu::reclaim), giving each object to `take` (which
    /// keeps it where the caller likes: reclaiming allocates nothing).
    #[allow(unsafe_code)]
    pub fn reclaim_each<T>(&self, list: &mut Vec<Retired<T>>, wait: bool, mut take: impl FnMut(T)) {
        assert!(list.iter().all(|r| r.rcu == self.id()), "Retired of another Rcu");
        if wait && list.iter().any(|r| !self.elapsed(r.cookie)) {
            self.synchronize();
        }
        // One load for the whole list (Acquire, as in `elapsed`).
        let done = self.gp_done.load(Ordering::Acquire);
        let mut i = 0;
        while i < list.len() {
            if done > list[i].cookie.0 {
                let mut r = list.swap_remove(i);
                // SAFETY: taken exactly once; `r` is dropped right after
                // without touching `item` (`Retired` has no drop glue for it).
                take(unsafe { ManuallyDrop::take(&mut r.item) });
            } else {
                i += 1;
            }
        }
    }

    /// Enter a read-side section as `reader` that pins the page of `addr`
    /// until it ends: a [`wait_unpinned`](Rcu::wait_unpinned) over a range
    /// holding that page waits for the section, unless the section saw
    /// what the waiter did before it waited. One pin per reader at a time.
    #[inline]
    pub fn pin<'a>(&'a self, reader: &'a RcuReader, addr: u64) -> RcuPin<'a> {
        let slot = &self.slots[reader.index];
        // Real: a second pin would hide the first from `wait_unpinned`.
        assert_eq!(slot.pin.load(Ordering::Relaxed), NO_PIN, "a reader pins one page at a time");
        let generation = reader.pins.get().wrapping_add(1);
        reader.pins.set(generation);
        let word = (addr & !PIN_GEN) | (generation & PIN_GEN);
        let _rank = super::rank::RankGuard::enter(super::rank::Rank::VmaPin);
        if crate::mutated!("rcu_pin_late") {
            // Mutation for the loom model: the pin published after the
            // entry fence, so nothing orders it before the section's loads.
            let section = self.read_lock(reader);
            slot.pin.store(word, Ordering::Relaxed);
            return RcuPin { section, _rank };
        }
        // Release fence: a `wait_unpinned` that reads this new pin, not
        // the `NO_PIN` before it, still synchronizes with everything the
        // previous pinned section did (a plain store does not continue the
        // release sequence of that `NO_PIN` store).
        fence(Ordering::Release);
        // Relaxed: the entry fence below (or the one of `read_lock`) orders
        // it before every load of the section.
        slot.pin.store(word, Ordering::Relaxed);
        let nested = reader.in_section();
        let section = self.read_lock(reader);
        if nested {
            // `read_lock` fences only the outermost section.
            fence(Ordering::SeqCst);
        }
        RcuPin { section, _rank }
    }

    /// Wait until no section pins a page in `start..end` that it pinned
    /// before this call: call it after marking what those sections must
    /// see (a VMA retired), and before changing what they may still use.
    /// Must not be called while the calling thread holds a pin.
    pub fn wait_unpinned(&self, start: u64, end: u64) {
        // Waiting for the pins is taking them as a lock (debug builds check
        // the order: `sync::rank`).
        drop(super::rank::RankGuard::enter(super::rank::Rank::VmaPin));
        if crate::mutated!("vma_retire_no_wait") {
            // Mutation for the loom model: the writer does not wait.
            return;
        }
        // Pairs with the entry fence of `pin`'s section: either that
        // section sees the caller's mark, or this sees its pin.
        fence(Ordering::SeqCst);
        for slot in self.slots.iter() {
            // Acquire pairs with the Release that clears the pin.
            let p = slot.pin.load(Ordering::Acquire);
            if (start..end).contains(&(p & !PIN_GEN)) {
                let mut spins = 0;
                while slot.pin.load(Ordering::Acquire) == p {
                    super::backoff(&mut spins);
                }
            }
        }
    }

    /// An identity for this `Rcu` (stable for its lifetime).
    pub fn id(&self) -> usize {
        self.id
    }

    /// Sections reader `i` has entered and left so far, times two (a
    /// snapshot; it moves whenever the reader enters or leaves a section,
    /// so a count unmoved over an interval means a reader that ran no
    /// section in it: idle, or stuck inside one).
    pub fn activity(&self, i: usize) -> u64 {
        self.slots[i].count.load(Ordering::Relaxed)
    }

    /// Number of readers.
    pub fn readers(&self) -> usize {
        self.slots.len()
    }

    /// Whether `reader` is outside any read-side section right now (a
    /// snapshot, for tests).
    #[cfg(any(test, loom))]
    pub fn is_quiescent(&self, reader: usize) -> bool {
        self.slots[reader].count.load(Ordering::Relaxed) & 1 == 0
    }
}

impl RcuReader {
    /// The index of this reader in its `Rcu`.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether the owner is inside a read-side section now.
    pub fn in_section(&self) -> bool {
        self.nesting.get() > 0
    }

    /// Whether this reader belongs to `rcu`.
    pub fn belongs_to(&self, rcu: &Rcu) -> bool {
        self.owner == rcu.id()
    }
}

/// An `Arc` (or nothing) published to RCU readers: read inside a
/// read-side section, replaced by writers, the old value reclaimed after
/// a grace period. No allocation of its own: the pointer is the `Arc`'s,
/// so a writer that already holds the value in an `Arc` publishes it for
/// one reference count (the VMA index's root node, `aspace::vma`; an
/// object's backing object, `object::shadow`).
pub struct RcuArc<T> {
    /// `[a]` from `Arc::into_raw`, or null for none; loaded with Acquire
    /// inside sections, swapped by writers.
    ptr: AtomicPtr<T>,
}

// SAFETY: readers on other threads get `&T` (`Sync`); the
// last reference may drop on whichever thread reclaims it (`Send`).
#[allow(unsafe_code)]
unsafe impl<T: Send + Sync> Sync for RcuArc<T> {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl<T: Send + Sync> Send for RcuArc<T> {}

fn into_ptr<T>(value: Option<Arc<T>>) -> *mut T {
    value.map_or(std::ptr::null_mut(), |a| Arc::into_raw(a).cast_mut())
}

/// # Safety
/// `p` is null or came from [`into_ptr`], and its reference is given up
/// here exactly once.
#[allow(unsafe_code)]
unsafe fn from_ptr<T>(p: *mut T) -> Option<Arc<T>> {
    // SAFETY: the caller's promise: a pointer from `Arc::into_raw` whose
    // reference nobody else will take back.
    (!p.is_null()).then(|| unsafe { Arc::from_raw(p.cast_const()) })
}

impl<T> RcuArc<T> {
    /// Publish `value`.
    pub fn new(value: Option<Arc<T>>) -> Self {
        RcuArc { ptr: AtomicPtr::new(into_ptr(value)) }
    }

    /// The current value, for as long as the read-side section lasts.
    #[inline]
    #[allow(unsafe_code)]
    pub fn read<'a>(&'a self, _section: &'a RcuReadGuard<'_>) -> Option<&'a T> {
        // SAFETY: null or from `Arc::into_raw`; the reference it stands for
        // is given back only through `Retired`, after a grace period that
        // started once it was unpublished, so the value outlives every
        // section (like ours) that could have loaded it. Acquire pairs with
        // the swap in `replace`.
        unsafe { self.ptr.load(Ordering::Acquire).as_ref() }
    }

    /// The current value, then `after()`, in that order: the Acquire load
    /// of the pointer orders every load `after` makes after it. Shadow
    /// chains rely on this (`object::shadow`): a level's backing pointer is
    /// read before the level's entry, so a walker that sees a collapse's
    /// new pointer also sees the page the collapse moved up.
    /// `--cfg vmfault_mutation="shadow_entry_first"` reverses the order, and
    /// `tests/loom_shadow.rs` then fails.
    #[inline]
    pub fn read_then<'a, R>(&'a self, section: &'a RcuReadGuard<'_>, after: impl FnOnce() -> R) -> (Option<&'a T>, R) {
        if crate::mutated!("shadow_entry_first") {
            let r = after();
            return (self.read(section), r);
        }
        let v = self.read(section);
        (v, after())
    }

    /// The current value as an `Arc` of the caller's own (a reference
    /// taken inside the section, which outlives it).
    #[inline]
    #[allow(unsafe_code)]
    pub fn cloned(&self, _section: &RcuReadGuard<'_>) -> Option<Arc<T>> {
        let p = self.ptr.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: from `Arc::into_raw`, and the reference it stands for is
        // given back only after a grace period that started once it was
        // unpublished (as in `read`): for as long as our section lasts the
        // count is at least one, so adding one and taking that new
        // reference as an `Arc` of ours is sound.
        unsafe {
            Arc::increment_strong_count(p.cast_const());
            Some(Arc::from_raw(p.cast_const()))
        }
    }

    /// Take the value out, leaving none: no reader can be using it
    /// (`&mut self`).
    #[allow(unsafe_code)]
    pub fn take(&mut self) -> Option<Arc<T>> {
        let p = self.ptr.swap(std::ptr::null_mut(), Ordering::Relaxed);
        // SAFETY: `&mut self` means no reader borrows us (reads are tied to
        // a borrow of `self`); the pointer's reference is taken back once,
        // and null is left in its place.
        unsafe { from_ptr(p) }
    }

    /// Publish `value`; the old one comes back to be dropped after a grace
    /// period.
    #[allow(unsafe_code)]
    pub fn replace(&self, rcu: &Rcu, value: Option<Arc<T>>) -> Retired<Option<Arc<T>>> {
        let old = self.ptr.swap(into_ptr(value), Ordering::AcqRel);
        // SAFETY: `old` was published by `new` or `replace` and is now
        // unpublished: its reference is taken back once, here, and dropped
        // only after a grace period (through `Retired`).
        rcu.retire(unsafe { from_ptr(old) })
    }
}

impl<T> Drop for RcuArc<T> {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: `&mut self` means no reader borrows us (reads are tied to
        // a borrow of `self`); the pointer's reference is taken back once.
        drop(unsafe { from_ptr(self.ptr.load(Ordering::Relaxed)) });
    }
}

impl<T> std::fmt::Debug for RcuArc<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RcuArc")
    }
}

impl<'a> RcuReadGuard<'a> {
    /// The `Rcu` of this section.
    #[inline]
    pub fn rcu(&self) -> &'a Rcu {
        self.rcu
    }

    /// The reader inside this section (the calling thread's).
    #[inline]
    pub fn reader(&self) -> &'a RcuReader {
        self.reader
    }
}

impl Drop for RcuReadGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        let depth = self.reader.nesting.get() - 1;
        self.reader.nesting.set(depth);
        #[cfg(all(debug_assertions, not(loom)))]
        SECTIONS.with(|s| s.set(s.get() - 1));
        if depth == 0 {
            let c = self.count;
            let v = c.load(Ordering::Relaxed);
            // Release: everything done inside the section happens-before a
            // `synchronize` that observes the even value.
            c.store(v + 1, Ordering::Release);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn a_poll_with_no_reader_inside_completes_at_once_and_counts_no_wait() {
        let (rcu, _readers) = Rcu::new(2);
        take_thread_waits();
        let c = rcu.cookie();
        assert!(!rcu.elapsed(c));
        assert!(rcu.poll(c));
        assert!(rcu.elapsed(c));
        assert_eq!(take_thread_waits(), 0);
    }

    #[test]
    fn a_poll_completes_only_once_the_sections_it_saw_have_ended() {
        let (rcu, readers) = Rcu::new(3);
        let inside = rcu.read_lock(&readers[1]);
        let c1 = rcu.cookie();
        assert!(!rcu.poll(c1), "reader 1 is inside a section that started before the cookie");
        assert!(!rcu.poll(c1), "and still is");
        // A section that starts now is not one the poll waits for.
        let later = rcu.read_lock(&readers[2]);
        let c2 = rcu.cookie();
        drop(inside);
        // The first poll's grace period completes (c1), but it started
        // before c2: a second one starts, sees reader 2 inside, and waits.
        assert!(!rcu.poll(c2));
        assert!(rcu.elapsed(c1) && !rcu.elapsed(c2));
        drop(later);
        assert!(rcu.poll(c2));
        // A section that ended and a new one that began in between count
        // as ended (the counter moved).
        let a = rcu.read_lock(&readers[0]);
        let c3 = rcu.cookie();
        assert!(!rcu.poll(c3));
        drop(a);
        let _b = rcu.read_lock(&readers[0]);
        assert!(rcu.poll(c3));
    }

    #[test]
    fn a_blocking_grace_period_also_ages_what_a_poll_is_waiting_for() {
        let (rcu, readers) = Rcu::new(2);
        let inside = rcu.read_lock(&readers[1]);
        let c = rcu.cookie();
        assert!(!rcu.poll(c));
        drop(inside);
        rcu.synchronize();
        assert!(rcu.elapsed(c));
        // The poll's own grace period is still under way; it completes.
        assert!(rcu.poll(c));
    }

    #[test]
    fn a_sleeping_grace_period_returns_only_after_the_sections_it_saw() {
        let (rcu, mut readers) = Rcu::new(2);
        let r1 = readers.pop().unwrap();
        let ended = std::sync::atomic::AtomicBool::new(false);
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (rcu, ended) = (&rcu, &ended);
        std::thread::scope(|s| {
            s.spawn(move || {
                let inside = rcu.read_lock(&r1);
                let started = rcu.gp_started.load(Ordering::SeqCst);
                entered_tx.send(()).unwrap();
                // Ends only once the waiter has started its grace period,
                // which must then see this section end (or after 10 s, so
                // that a waiter that starts none fails instead of hanging).
                let limit = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while rcu.gp_started.load(Ordering::SeqCst) == started && std::time::Instant::now() < limit {
                    std::thread::yield_now();
                }
                ended.store(true, std::sync::atomic::Ordering::SeqCst);
                drop(inside);
            });
            entered_rx.recv().unwrap();
            let c = rcu.cookie();
            rcu.grace_period_sleeping();
            assert!(ended.load(std::sync::atomic::Ordering::SeqCst), "returned inside the section");
            assert!(rcu.elapsed(c));
        });
        // Polled: counted as no wait of a caller.
        assert_eq!(take_thread_waits(), 0);
        // With no reader inside a section, it returns at once.
        rcu.grace_period_sleeping();
    }

    #[test]
    fn nesting_and_quiescence() {
        let (rcu, readers) = Rcu::new(2);
        assert!(rcu.is_quiescent(0));
        {
            let _a = rcu.read_lock(&readers[0]);
            assert!(!rcu.is_quiescent(0));
            {
                let _b = rcu.read_lock(&readers[0]);
            }
            assert!(!rcu.is_quiescent(0));
        }
        assert!(rcu.is_quiescent(0));
        rcu.synchronize();
    }

    #[test]
    fn rcu_arc_publishes_without_a_copy_and_gives_each_reference_back_once() {
        let (rcu, mut readers) = Rcu::new(1);
        let r = readers.pop().unwrap();
        let a = Arc::new(7u64);
        let cell = RcuArc::new(Some(a.clone()));
        assert_eq!(Arc::strong_count(&a), 2, "the cell holds one reference");
        {
            let s = rcu.read_lock(&r);
            assert!(std::ptr::eq(cell.read(&s).unwrap(), &*a), "the Arc's own value, not a copy");
        }
        let mut list = vec![cell.replace(&rcu, None)];
        assert!(cell.read(&rcu.read_lock(&r)).is_none());
        assert_eq!(Arc::strong_count(&a), 2, "retired, not yet given back");
        drop(rcu.reclaim(&mut list, true));
        assert_eq!(Arc::strong_count(&a), 1);
        let b = Arc::new(8u64);
        let mut list = vec![cell.replace(&rcu, Some(b.clone()))];
        drop(rcu.reclaim(&mut list, true));
        {
            let s = rcu.read_lock(&r);
            let mine = cell.cloned(&s).expect("published");
            assert!(Arc::ptr_eq(&mine, &b));
            assert_eq!(Arc::strong_count(&b), 3, "a reference of the caller's own, taken in the section");
        }
        assert_eq!(Arc::strong_count(&b), 2, "and given back by its drop");
        drop(cell);
        assert_eq!(Arc::strong_count(&b), 1, "the cell's drop gives its reference back");
        let mut cell = RcuArc::new(Some(b.clone()));
        let took = cell.take().expect("published");
        assert!(Arc::ptr_eq(&took, &b) && cell.take().is_none(), "taken once");
        drop((took, cell));
        assert_eq!(Arc::strong_count(&b), 1, "take moves the cell's reference out");
    }

    #[test]
    fn synchronize_waits_for_a_running_section() {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let r1 = readers.pop().unwrap();
        let inside = Arc::new(AtomicBool::new(false));
        let release = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let t = {
            let (rcu, inside, release, done) = (rcu.clone(), inside.clone(), release.clone(), done.clone());
            std::thread::spawn(move || {
                let g = rcu.read_lock(&r1);
                inside.store(true, Ordering::SeqCst);
                while !release.load(Ordering::SeqCst) {
                    std::thread::yield_now();
                }
                done.store(true, Ordering::SeqCst);
                drop(g);
            })
        };
        while !inside.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        let s = {
            let (rcu, done) = (rcu.clone(), done.clone());
            std::thread::spawn(move || {
                rcu.synchronize();
                // The section must have finished before synchronize returned.
                assert!(done.load(Ordering::SeqCst));
            })
        };
        release.store(true, Ordering::SeqCst);
        t.join().unwrap();
        s.join().unwrap();
    }

    #[test]
    fn retired_objects_come_back_after_a_grace_period() {
        let (rcu, readers) = Rcu::new(1);
        let b = RcuArc::new(Some(Arc::new(1u32)));
        {
            let g = rcu.read_lock(&readers[0]);
            assert_eq!(b.read(&g), Some(&1));
        }
        let mut list = vec![b.replace(&rcu, Some(Arc::new(2)))];
        assert!(rcu.reclaim(&mut list, false).is_empty(), "no grace period yet");
        let back = rcu.reclaim(&mut list, true);
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].as_deref(), Some(&1));
        assert!(list.is_empty());
        // Any grace period after the retirement counts.
        let mut list = vec![b.replace(&rcu, Some(Arc::new(3)))];
        rcu.synchronize();
        assert_eq!(rcu.reclaim(&mut list, false).len(), 1);
        let g = rcu.read_lock(&readers[0]);
        assert_eq!(b.read(&g), Some(&3));
    }

    #[test]
    #[should_panic(expected = "another Rcu")]
    fn reader_of_other_rcu_is_rejected() {
        let (a, _ra) = Rcu::new(1);
        let (_b, rb) = Rcu::new(1);
        let _g = a.read_lock(&rb[0]);
    }
}
