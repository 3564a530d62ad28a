//! Frees that nobody waits for (`VmConfig::free_path = deferred`, Linux's
//! `call_rcu` and `mmu_gather` batching): frames that an operation has
//! unlinked everywhere go, with the grace-period cookie taken after the
//! unlink, onto a batch list of the freeing vCPU's, instead of that vCPU
//! waiting for a grace period itself.
//!
//! - A free polls for its grace period first (`Rcu::poll`): when it
//!   completes at once (no other vCPU inside a section) the frames skip
//!   the lists and go to the vCPU's cache; otherwise the poll it started
//!   is completed by a later one, such as the owner's at its next cache
//!   miss (`take_aged` polls).
//! - A grace-period thread (`vmfault-rcu`), woken by a list that holds
//!   `WAKE_FRAMES` frames (and every `GRACE_POLL` while the lists hold
//!   some that changed since its last one), runs a grace period, polled
//!   and sleeping between polls (`Rcu::grace_period_sleeping`: a spinning
//!   thread took the CPU from the sections it waited for); one grace period ages all the batches
//!   queued before it, by every vCPU. Batches queued within one grace
//!   period merge.
//! - The owner takes its aged batches back when its page cache misses (the
//!   frames go into its own cache, where they were freed: nothing crosses
//!   the global list) and at its next deferred free. The objects that end
//!   with the VMAs a change removed, or with retired snapshots the owner
//!   drops aged, free their frames the same way (`aspace::Space::finish`,
//!   `drop_removed`), not each onto the list without a vCPU.
//! - Frees without a vCPU (an object's end, on whatever thread drops it)
//!   go onto one more list, which the grace-period thread itself empties
//!   into the global list. So does it with a vCPU's list that nobody has
//!   touched for one of its ticks, its owner having run no read-side
//!   section meanwhile either (an idle or departed vCPU): its aged
//!   frames go to the global list and its aged values are dropped, as
//!   Linux runs RCU callbacks whatever the CPU that queued them does.
//! - An allocation that finds no frame anywhere waits for a grace period
//!   and takes every list's aged batches (`PhysMem::flush_deferred`)
//!   before it drains the page caches or reports `ENOMEM`; so do
//!   `Vm::drain_pcpu_caches` and the page daemon.
//!
//! - Values whose drop frees frames (an address space's retired VMA-index
//!   snapshots, which keep the objects of removed mappings alive) go onto
//!   the same lists as *drops*; the grace-period thread ages them (it runs
//!   grace periods while any are queued) and their owner drops the aged
//!   ones at its next change, so that a munmap waits for none. An
//!   allocation that finds nothing drops every list's aged ones itself (in
//!   `flush_deferred`, after its grace period) and waits for drops under
//!   way on other threads (`dropping`) before it reports `ENOMEM`. A drop
//!   takes no lock an allocating vCPU may hold: what it drops is
//!   unreachable (its object locks are nobody else's, no mapping maps its
//!   pages), and the registries it leaves (anonymous objects, files, swap
//!   slots) are leaves that nothing allocates frames under.
//!
//! - The aged values an owner takes off its list go into a buffer of its
//!   thread's (`AgedDrops`), sized for two wake-ups' worth when the thread
//!   attaches as a vCPU ([`reserve_thread_buffer`]), not at its first
//!   deferred drop: that came only after a grace period that did not end
//!   at once, at any moment of a run.
//!
//! Frames on these lists are not counted free until they leave them
//! (`deferred_pages` shows how many; their descriptors keep their kind
//! until the grace period has passed).
//!
//! Each list has its own mutex, taken by its owner (uncontended) and by
//! the rare whole-machine flush. So are the counts of what is in transit
//! between a list and a cache. The only line all vCPUs write here is the
//! request counter the thread watches (when a list reaches `WAKE_FRAMES`
//! frames or `WAKE_DROPS` values), besides the grace-period state of
//! `sync::rcu` that their polls write.

use std::any::Any;
use std::sync::{Arc, Mutex};

use super::Pfn;
use crate::sync::CachePadded;
use crate::sync::rcu::{GpCookie, Rcu, Retired};
use std::sync::atomic::{AtomicU64, Ordering};

/// A value whose drop waits for a grace period (see the module docs).
/// (`Any`: its owner takes back what it knows, such as its own retired
/// snapshots, whose nodes it reuses. An `Arc`, which a snapshot is
/// already: it becomes one of these with no allocation.)
pub(crate) type LateDrop = Retired<Arc<dyn Any + Send + Sync>>;

/// Values aged on a list, taken off it at once to be dropped outside its
/// lock, in this thread's buffer for them (queueing and dropping allocate
/// nothing in steady state).
pub(crate) type AgedDrops = crate::sync::scratch::Scratch<Arc<dyn Any + Send + Sync>>;

thread_local! {
    /// `[T]` the buffer of [`AgedDrops`].
    static AGED: std::cell::Cell<Vec<Arc<dyn Any + Send + Sync>>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Give this thread's buffer of [`AgedDrops`] its room now (a thread that
/// becomes a vCPU): its first use is at the thread's first drop of aged
/// values, after a grace period that did not end at once, at any time in
/// a run (in eight runs of `bench mmap1 --threads 2`, 6 of the 8 heap
/// allocations that were not VMA records or index nodes).
pub(crate) fn reserve_thread_buffer() {
    AgedDrops::reserve(&AGED, DROPS_ROOM);
}

/// Frames a list holds before a free wakes the grace-period thread.
pub(crate) const WAKE_FRAMES: u64 = 256;

/// Values a list holds to drop before a queueing wakes the thread.
pub(crate) const WAKE_DROPS: u64 = 64;

/// Room for values to drop a list and a drop's buffer keep from the
/// start (a list grown at a new high in the middle of a run is a heap
/// allocation there).
const DROPS_ROOM: usize = 2 * WAKE_DROPS as usize;

/// How often the grace-period thread looks for batches nobody woke it for.
pub(crate) const GRACE_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// Frames unlinked before `cookie` was taken.
#[derive(Debug)]
struct Batch {
    cookie: GpCookie,
    frames: Vec<Pfn>,
}

/// A list's batches, and the emptied lists of frames of batches taken
/// back, which new batches reuse (queueing allocates nothing in steady
/// state).
#[derive(Default)]
struct Batches {
    list: Vec<Batch>,
    spare: Vec<Vec<Pfn>>,
}

/// Emptied frame lists a deferred list keeps for its next batches.
const SPARE_BATCHES: usize = 4;

#[derive(Default)]
struct List {
    /// `[L]` the batches, oldest first (a leaf lock: nothing is taken inside).
    batches: Mutex<Batches>,
    /// `[a]` frames in them (written under the mutex, read lockless).
    frames: AtomicU64,
    /// `[L]` values to drop after their grace period (a leaf lock).
    drops: Mutex<Vec<LateDrop>>,
    /// `[a]` values queued in `drops` (written under its mutex).
    late: AtomicU64,
    /// `[a]` frames taken off this list and not yet put on the global
    /// list or a page cache: an allocation that finds nothing anywhere
    /// waits for them before it reports `ENOMEM` (their mover may be
    /// preempted). Per list, as the two below: its owner moves them at
    /// every deferred free, and a count all vCPUs wrote would be a line
    /// they all write (three locked instructions per vmlocal loop).
    transit: AtomicU64,
    /// `[a]` values taken off `drops` and not yet dropped: their frames
    /// are on no list yet (see `transit`).
    dropping: AtomicU64,
    /// `[a]` placements of this list's frames in transit so far (and
    /// drops done).
    placements: AtomicU64,
}

/// One batch list per vCPU slot, and one for frees without a vCPU.
pub(crate) struct Deferred {
    /// `[S]` the lists, each on its own cache lines (`List`'s fields carry
    /// their tags).
    lists: Box<[CachePadded<List>]>,
    /// `[a]` batches queued so far: the grace-period thread runs one more
    /// grace period whenever it has not served them all.
    requests: AtomicU64,
    /// `[I]` once set: the grace-period thread, woken by each batch.
    thread: std::sync::OnceLock<std::thread::Thread>,
}

impl Deferred {
    /// Lists for `slots` vCPU slots, plus the one without a vCPU.
    pub(crate) fn new(slots: usize) -> Deferred {
        Deferred {
            lists: (0..=slots)
                .map(|_| {
                    let drops = Mutex::new(Vec::with_capacity(DROPS_ROOM));
                    CachePadded(List { drops, ..List::default() })
                })
                .collect(),
            requests: AtomicU64::new(0),
            thread: std::sync::OnceLock::new(),
        }
    }

    /// The list of frees made without a vCPU.
    pub(crate) fn unowned(&self) -> usize {
        self.lists.len() - 1
    }

    /// Set the thread that [`push`](Deferred::push) wakes.
    pub(crate) fn set_thread(&self, t: std::thread::Thread) {
        let _ = self.thread.set(t);
    }

    /// Queue `frames`, unlinked everywhere before `cookie` was taken
    /// (`Rcu::cookie`, after the unlink), on list `i`, and wake the
    /// grace-period thread.
    pub(crate) fn push(&self, i: usize, cookie: GpCookie, frames: &[Pfn]) {
        if frames.is_empty() {
            return;
        }
        let l = &self.lists[i];
        let held = {
            let mut b = crate::sync::rank::lock(&l.batches, crate::sync::rank::Rank::Leaf);
            let held = l.frames.load(Ordering::Relaxed) + frames.len() as u64;
            l.frames.store(held, Ordering::Relaxed);
            let b = &mut *b;
            match b.list.last_mut() {
                // No grace period has started since the last batch: one
                // batch.
                Some(last) if last.cookie == cookie => last.frames.extend_from_slice(frames),
                _ => {
                    let mut list = b.spare.pop().unwrap_or_default();
                    list.extend_from_slice(frames);
                    b.list.push(Batch { cookie, frames: list });
                }
            }
            held
        };
        // Waking the thread costs a system call: only for a list worth a
        // grace period (the thread also looks every `GRACE_POLL`, and an
        // allocation that finds nothing runs one itself).
        if held >= WAKE_FRAMES {
            // Release: the thread that sees this count (Acquire) starts its
            // grace period after the cookie was taken.
            self.requests.fetch_add(1, Ordering::Release);
            self.wake();
        }
    }

    /// Queue `items` (retired by their owner) on list `i`, to be dropped
    /// once their grace period has passed (which the grace-period thread
    /// runs) by the owner or by an allocation that finds nothing.
    pub(crate) fn push_drops(&self, i: usize, items: impl IntoIterator<Item = LateDrop>) {
        let mut items = items.into_iter().peekable();
        if items.peek().is_none() {
            return;
        }
        let l = &self.lists[i];
        let queued = {
            let mut q = crate::sync::rank::lock(&l.drops, crate::sync::rank::Rank::Leaf);
            q.extend(items);
            l.late.store(q.len() as u64, Ordering::Relaxed);
            q.len() as u64
        };
        // A wake costs a system call: only for a list worth it (the thread
        // also looks every `GRACE_POLL`, and a drain runs one itself).
        if queued >= WAKE_DROPS {
            self.requests.fetch_add(1, Ordering::Release);
            self.wake();
        }
    }

    /// Drop every queued value whose grace period has passed (with `all`,
    /// every value queued before the call, after waiting for a grace
    /// period: the machine's end, `drop_caches`). Returns how many. Never
    /// inside a read-side section with `all`.
    pub(crate) fn drop_aged(&self, rcu: &Rcu, all: bool) -> u64 {
        (0..self.lists.len()).map(|i| self.drop_aged_of(i, rcu, all)).sum()
    }

    /// [`Deferred::drop_aged`] for list `i` only: its owner, at its next
    /// change, drops what it queued on the thread that allocated it (a
    /// free on another thread costs glibc's arena lock). Cheap when the
    /// list has none (one load).
    pub(crate) fn drop_aged_of(&self, i: usize, rcu: &Rcu, all: bool) -> u64 {
        self.drop_aged_of_with(i, rcu, all, drop)
    }

    /// One drop under way on list `i`'s owner, outside the lists (its
    /// frames placed before the guard goes): counted with `dropping`.
    pub(crate) fn dropping_here(&self, i: usize) -> InTransit<'_> {
        let l = &self.lists[i];
        l.dropping.fetch_add(1, Ordering::AcqRel);
        InTransit { placements: &l.placements, count: &l.dropping, n: 1 }
    }

    /// [`Deferred::drop_aged_of`], dropping the aged values with
    /// `drop_them`, which places the frames their drops free (the owner
    /// puts them in its own cache: `aspace::Space::finish`). They count
    /// as being dropped until it returns, so an allocation that finds
    /// nothing waits for them (see `dropping`).
    pub(crate) fn drop_aged_of_with(&self, i: usize, rcu: &Rcu, all: bool, drop_them: impl FnOnce(AgedDrops)) -> u64 {
        let l = &self.lists[i];
        if l.late.load(Ordering::Relaxed) == 0 {
            return 0;
        }
        if all {
            // Not under the list's mutex (a leaf: never held across a
            // grace period). Polled first: no wait when no reader is
            // inside a section.
            rcu.grace_period();
        }
        let (aged, _dropping) = {
            let mut q = crate::sync::rank::lock(&l.drops, crate::sync::rank::Rank::Leaf);
            let mut aged = AgedDrops::take_with_room(&AGED, DROPS_ROOM);
            rcu.reclaim_each(&mut q, false, |v| aged.push(v));
            let k = aged.len() as u64;
            // Being dropped before they leave the queue's count (as frames
            // go in transit): none is ever counted nowhere.
            l.dropping.fetch_add(k, Ordering::AcqRel);
            l.late.store(q.len() as u64, Ordering::Relaxed);
            (aged, InTransit { placements: &l.placements, count: &l.dropping, n: k })
        };
        let n = aged.len() as u64;
        // Outside the lock (a drop frees frames onto these lists), and
        // before `_dropping` reports them placed, also on a panic.
        drop_them(aged);
        n
    }

    /// What list `i` holds: frames and values to drop (a snapshot; its
    /// owner's activity changes it).
    pub(crate) fn held_by(&self, i: usize) -> (u64, u64) {
        let l = &self.lists[i];
        (l.frames.load(Ordering::Relaxed), l.late.load(Ordering::Relaxed))
    }

    /// Values queued to drop or being dropped (a snapshot).
    pub(crate) fn late(&self) -> u64 {
        self.lists.iter().map(|l| l.late.load(Ordering::Relaxed)).sum::<u64>() + self.dropping()
    }

    /// Values being dropped (taken off their queue): an allocation that
    /// finds nothing waits for them as for frames in transit.
    pub(crate) fn dropping(&self) -> u64 {
        self.lists.iter().map(|l| l.dropping.load(Ordering::Acquire)).sum()
    }

    /// Wake the grace-period thread.
    pub(crate) fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }

    /// Batches queued so far (the grace-period thread's cue).
    pub(crate) fn requests(&self) -> u64 {
        self.requests.load(Ordering::Acquire)
    }

    /// Move the frames of list `i`'s batches whose grace period has
    /// elapsed to `out`; they are in transit until the guard returned is
    /// dropped, which the caller does once they are on the global list or
    /// in a page cache whose length a drain can see (after `local`
    /// returns). Cheap when the list is empty (one load).
    pub(crate) fn take_aged(&self, i: usize, rcu: &Rcu, out: &mut Vec<Pfn>) -> InTransit<'_> {
        let l = &self.lists[i];
        if l.frames.load(Ordering::Relaxed) == 0 {
            return InTransit { placements: &l.placements, count: &l.transit, n: 0 };
        }
        let mut b = crate::sync::rank::lock(&l.batches, crate::sync::rank::Rank::Leaf);
        let b = &mut *b;
        // Move the polled grace period on (never waits; a try-lock under
        // this leaf): the one the free that queued the newest batch
        // started usually completes here, long after the sections it saw.
        if let Some(newest) = b.list.last() {
            rcu.poll(newest.cookie);
        }
        // Oldest first: the first batch that has not aged ends the run.
        let aged = b.list.iter().take_while(|x| rcu.elapsed(x.cookie)).count();
        let before = out.len();
        for mut x in b.list.drain(..aged) {
            out.append(&mut x.frames);
            if b.spare.len() < SPARE_BATCHES {
                b.spare.push(x.frames);
            }
        }
        let n = (out.len() - before) as u64;
        if n > 0 {
            // In transit before they leave the list's count: no moment
            // where a whole-machine look sees them nowhere.
            l.transit.fetch_add(n, Ordering::AcqRel);
            l.frames.store(l.frames.load(Ordering::Relaxed) - n, Ordering::Relaxed);
        }
        InTransit { placements: &l.placements, count: &l.transit, n }
    }

    /// Placements of frames in transit so far, over all lists (each
    /// list's count only grows): an allocation that found nothing looks
    /// again if this moved while it looked.
    pub(crate) fn placements(&self) -> u64 {
        self.lists.iter().map(|l| l.placements.load(Ordering::Acquire)).sum()
    }

    /// Frames taken off the lists and not yet placed (a snapshot).
    pub(crate) fn in_transit(&self) -> u64 {
        self.lists.iter().map(|l| l.transit.load(Ordering::Acquire)).sum()
    }

    /// Every list's aged frames, to `out` (in transit until the guards go).
    pub(crate) fn take_all_aged(&self, rcu: &Rcu, out: &mut Vec<Pfn>) -> Vec<InTransit<'_>> {
        (0..self.lists.len()).map(|i| self.take_aged(i, rcu, out)).filter(|t| t.n > 0).collect()
    }

    /// Frames waiting in every list (a snapshot).
    pub(crate) fn frames(&self) -> u64 {
        self.lists.iter().map(|l| l.frames.load(Ordering::Relaxed)).sum()
    }

    /// Frames waiting or in transit (a snapshot, for the statistics).
    pub(crate) fn held(&self) -> u64 {
        self.frames() + self.in_transit()
    }
}

/// Frames taken off a deferred list and not yet placed (or values being
/// dropped, whose frames are on no list yet); dropping it reports them
/// placed (also on a panic: nothing waits for them forever): placements
/// first, so an allocation that sees the count fall sees the placement.
#[must_use = "frames stay in transit until the guard is dropped"]
pub(crate) struct InTransit<'a> {
    /// The list's `placements`.
    placements: &'a AtomicU64,
    /// The list's `transit` or `dropping`.
    count: &'a AtomicU64,
    n: u64,
}

impl InTransit<'_> {
    /// Whether it holds nothing (nothing was taken).
    pub(crate) fn is_empty(&self) -> bool {
        self.n == 0
    }
}

impl Drop for InTransit<'_> {
    fn drop(&mut self) {
        if self.n > 0 {
            self.placements.fetch_add(1, Ordering::AcqRel);
            self.count.fetch_sub(self.n, Ordering::AcqRel);
        }
    }
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deferred").field("frames", &self.frames()).field("requests", &self.requests()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "a Vm reads /proc/meminfo, which Miri's isolation refuses")]
    fn a_thread_that_attaches_as_a_vcpu_has_its_drop_buffer_with_its_room() {
        let vm = crate::Vm::small_for_tests();
        std::thread::spawn(move || {
            let room = || {
                AGED.with(|c| {
                    let v = c.take();
                    let n = v.capacity();
                    c.set(v);
                    n
                })
            };
            assert_eq!(room(), 0, "a new thread's buffer is empty");
            let _cpu = vm.attach().unwrap();
            assert!(room() >= DROPS_ROOM);
            // Its use takes the buffer, and gives it back, with its room.
            let before = room();
            drop(AgedDrops::take_with_room(&AGED, DROPS_ROOM));
            assert_eq!(room(), before);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn batches_age_with_grace_periods_and_come_back_in_order() {
        let (rcu, readers) = Rcu::new(1);
        let d = Deferred::new(1);
        // A reader inside a section keeps the polled grace period of
        // `take_aged` from completing.
        let section = rcu.read_lock(&readers[0]);
        d.push(0, rcu.cookie(), &[Pfn(1), Pfn(2)]);
        let mut out = Vec::new();
        drop(d.take_aged(0, &rcu, &mut out));
        assert!(out.is_empty(), "no grace period yet");
        assert_eq!(d.frames(), 2);
        drop(section);
        let section = rcu.read_lock(&readers[0]);
        d.push(0, rcu.cookie(), &[Pfn(3)]);
        d.push(d.unowned(), rcu.cookie(), &[Pfn(4)]);
        // The poll sees the first section ended: a grace period that ages
        // the first batch; the second waits for the section now running.
        let moving = d.take_aged(0, &rcu, &mut out);
        assert_eq!(out, [Pfn(1), Pfn(2)], "only the batch queued before the grace period");
        assert_eq!((d.in_transit(), d.held(), d.placements()), (2, 4, 0));
        drop(moving);
        assert_eq!((d.in_transit(), d.placements()), (0, 1));
        drop(section);
        out.clear();
        let moving = d.take_all_aged(&rcu, &mut out);
        assert_eq!(out, [Pfn(3), Pfn(4)]);
        assert_eq!(d.in_transit(), 2);
        drop(moving);
        assert_eq!(d.held(), 0);
    }
}
