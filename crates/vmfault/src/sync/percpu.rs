//! Per-CPU caches that another CPU can drain without the owner's help
//! (OpenBSD's per-CPU page caches, drained the way Linux's remote
//! per-CPU-list drain RFC proposes).
//!
//! # The owner's side
//! Each vCPU slot owns a *magazine*: a small stack of items (page frames,
//! for the physical allocator). The owner reaches it through an index in
//! `current`, inside an RCU read-side section of its own reader. The
//! reader handle proves ownership: there is exactly one per slot and it is
//! not `Sync`. A `busy` flag catches re-entry from the same thread. The
//! owner's work is plain loads and stores on its own magazine: no lock, no
//! shared atomic read-modify-write.
//!
//! # The drainer's side
//! Any thread may drain every slot, without interrupting the owners:
//!
//! ```text
//! drainer (under drain_lock)                 owner of slot i
//!   swap current[i] <- spare[i]  (Release)     section { m = current[i] (Acquire)
//!   spare[i] <- old                                     use magazine m }
//!   synchronize()  -- every section that may have loaded `old` ends
//!   empty `old` into the global list
//! ```
//!
//! After the grace period no owner can still hold the old magazine; its
//! next section loads the spare, which the drainer emptied before the
//! swap published it. Magazines are never freed, only recycled as spares,
//! so a stale index can never point at freed memory.
//!
//! `tests/loom_pcpu.rs` models an owner popping and pushing against a
//! concurrent drain; skipping the grace period
//! (`--cfg vmfault_mutation="pcp_no_grace"`) makes loom report the race on
//! the magazine.

// This file holds unsafe code, each block with its `// SAFETY:`
// argument, and each item that holds one allows `unsafe_code` on itself:
// the crate denies it everywhere else.

use super::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use super::cell::UnsafeCell;
use super::rcu::{Rcu, RcuReadGuard, RcuReader};
use super::{CachePadded, Mutex};

/// A vCPU's stack of cached items, newest on top.
///
/// It holds up to its high mark (`capacity`), which its owner may raise up
/// to `max` ([`grow`](Magazine::grow)); a drain puts it back at the
/// cache's base. The storage for `max` items is reserved up front, so
/// neither ever allocates.
#[derive(Debug)]
pub struct Magazine<T> {
    items: Vec<T>,
    cap: usize,
    max: usize,
}

impl<T> Magazine<T> {
    fn new(cap: usize, max: usize) -> Self {
        let max = max.max(cap);
        // 128 bytes of slack after the items: two vCPUs' magazines, which the
        // allocator may place back to back, never share a cache line.
        let slack = 128usize.div_ceil(std::mem::size_of::<T>().max(1));
        Magazine { items: Vec::with_capacity(max + slack), cap, max }
    }

    /// Raise the high mark to `want` (at most `max`); never lowers it.
    /// Returns the new mark.
    pub fn grow(&mut self, want: usize) -> usize {
        self.cap = self.cap.max(want.min(self.max));
        self.cap
    }

    /// Whether the high mark can grow.
    pub fn can_grow(&self) -> bool {
        self.cap < self.max
    }

    /// Items held.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether it holds nothing (for the loom model).
    #[cfg(loom)]
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// How many items it can hold.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Room left.
    pub fn room(&self) -> usize {
        self.cap - self.items.len()
    }

    /// The `n` newest items (fewer if it holds fewer), the next `n` that
    /// [`pop`](Magazine::pop) hands out, last first.
    pub fn newest(&self, n: usize) -> &[T] {
        &self.items[self.items.len().saturating_sub(n)..]
    }

    /// Take the newest item.
    #[inline]
    pub fn pop(&mut self) -> Option<T> {
        self.items.pop()
    }

    /// Add an item; gives it back when full.
    #[inline]
    pub fn push(&mut self, x: T) -> Result<(), T> {
        if self.items.len() < self.cap {
            self.items.push(x);
            Ok(())
        } else {
            Err(x)
        }
    }

    /// Remove the `n` oldest items (the coldest), for returning them.
    pub fn take_oldest(&mut self, n: usize) -> std::vec::Drain<'_, T> {
        let n = n.min(self.items.len());
        self.items.drain(..n)
    }
}

impl<T> Extend<T> for Magazine<T> {
    /// Add items. Panics if they do not fit: callers offer at most
    /// `room()`, taken in the same `local` call (a drain between two calls
    /// may swap in a magazine with less room), and an item dropped here
    /// would be a frame lost.
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        for x in iter {
            assert!(self.push(x).is_ok(), "magazine overfilled");
        }
    }
}

/// One magazine, on cache lines of its own (its owner writes `len` and
/// the magazine's header on every operation).
#[repr(align(128))]
struct MagSlot<T> {
    /// `[o]` the magazine: owned by the slot's owner while it is `current`, by
    /// the drainer once swapped out and a grace period has passed.
    cell: UnsafeCell<Magazine<T>>,
    /// `[a]` its length, mirrored for statistics (written by whoever owns it).
    len: AtomicU32,
}

struct CpuSlot {
    /// `[a]` the owner's magazine (an index into `mags`); swapped by drainers
    /// (Release), loaded by the owner inside a section (Acquire).
    current: AtomicUsize,
    /// `[L]` (`drain_lock`) the empty magazine the next drain swaps in (an
    /// atomic only so that the type is `Sync`).
    spare: AtomicUsize,
    /// `[o]` the owner is inside `local` (catches re-entry).
    busy: AtomicBool,
}

/// One magazine (plus a spare) per vCPU slot. See the module docs.
pub struct PerCpuCache<T> {
    /// `[I]` the magazines' high mark after a drain.
    base: usize,
    /// `[I]` identity of the `Rcu` whose readers own the slots.
    rcu_id: usize,
    /// `[I]` per-slot state (fields carry their own tags).
    cpus: Box<[CachePadded<CpuSlot>]>,
    /// `[I]` every magazine, two per slot; never freed.
    mags: Box<[MagSlot<T>]>,
    /// `[L]` serializes drainers.
    drain_lock: Mutex<()>,
    /// `[a]` drains that swapped at least one magazine (written under drain_lock).
    drains: AtomicU64,
    /// `[a]` items drained so far (written under drain_lock).
    drained: AtomicU64,
}

// SAFETY: the magazines are reached only under the ownership protocol of
// the module docs (one owner per current magazine, proven by its unique
// `RcuReader`; drainers only after a grace period, serialized by
// `drain_lock`); items move between threads, so `T: Send` suffices.
#[allow(unsafe_code)]
unsafe impl<T: Send> Sync for PerCpuCache<T> {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl<T: Send> Send for PerCpuCache<T> {}

impl<T> std::fmt::Debug for PerCpuCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerCpuCache").field("slots", &self.cpus.len()).field("cached", &self.cached()).finish()
    }
}

impl<T> PerCpuCache<T> {
    /// One magazine of `capacity` items for each reader of `rcu`, whose
    /// owners may raise it up to `max` (a drain lowers it again).
    pub fn new(rcu: &Rcu, capacity: usize, max: usize) -> Self {
        let n = rcu.readers();
        let cpus = (0..n)
            .map(|i| {
                CachePadded(CpuSlot {
                    current: AtomicUsize::new(2 * i),
                    spare: AtomicUsize::new(2 * i + 1),
                    busy: AtomicBool::new(false),
                })
            })
            .collect();
        let mags = (0..2 * n)
            .map(|_| MagSlot { cell: UnsafeCell::new(Magazine::new(capacity, max)), len: AtomicU32::new(0) })
            .collect();
        PerCpuCache {
            base: capacity,
            rcu_id: rcu.id(),
            cpus,
            mags,
            drain_lock: Mutex::new(()),
            drains: AtomicU64::new(0),
            drained: AtomicU64::new(0),
        }
    }

    /// Run `f` on the magazine of `reader`'s slot, inside a read-side
    /// section. Panics if `reader` is not one of this cache's `Rcu`, or on
    /// re-entry from `f`.
    #[inline(always)]
    pub fn local<R>(&self, rcu: &Rcu, reader: &RcuReader, f: impl FnOnce(&mut Magazine<T>) -> R) -> R {
        assert!(rcu.id() == self.rcu_id && reader.belongs_to(rcu), "reader of another Rcu");
        let _section = rcu.read_lock(reader);
        self.local_held(reader, f)
    }

    /// [`local`](PerCpuCache::local) inside `section`, the calling
    /// thread's open section (of this cache's `Rcu`), which then covers
    /// the magazine's use too: no section of its own.
    #[inline(always)]
    pub fn local_in<R>(&self, section: &RcuReadGuard<'_>, f: impl FnOnce(&mut Magazine<T>) -> R) -> R {
        assert!(section.rcu().id() == self.rcu_id, "a section of another Rcu");
        self.local_held(section.reader(), f)
    }

    /// [`local_in`](PerCpuCache::local_in) `section` if there is one, else
    /// [`local`](PerCpuCache::local) as `reader`: for a caller that may or
    /// may not be inside a section, with one closure for both.
    #[inline(always)]
    pub fn local_or_in<R>(
        &self,
        section: Option<&RcuReadGuard<'_>>,
        rcu: &Rcu,
        reader: &RcuReader,
        f: impl FnOnce(&mut Magazine<T>) -> R,
    ) -> R {
        match section {
            Some(s) => self.local_in(s, f),
            None => self.local(rcu, reader, f),
        }
    }

    /// The body of [`local`](PerCpuCache::local).
    ///
    /// # Preconditions
    /// - `reader`, of this cache's `Rcu`, is inside a read-side section.
    #[inline(always)]
    #[allow(unsafe_code)]
    fn local_held<R>(&self, reader: &RcuReader, f: impl FnOnce(&mut Magazine<T>) -> R) -> R {
        let slot = &self.cpus[reader.index()];
        assert!(!slot.busy.load(Ordering::Relaxed), "PerCpuCache::local re-entered");
        slot.busy.store(true, Ordering::Relaxed);
        // Acquire pairs with the Release swap in `drain_all`: the spare it
        // installed was emptied before.
        let m = &self.mags[slot.current.load(Ordering::Acquire)];
        // Inline even where many callers share this body (the fault path's
        // allocation among them): out of line it cost a call on every one.
        let r = m.cell.with_mut(
            #[inline(always)]
            |p| {
                // SAFETY: this magazine is `current` of our slot, and we hold the
                // slot's unique reader inside a section, so no drainer touches it
                // until the section ends (grace period); `busy` rules out a
                // second borrow on this thread.
                let mag = unsafe { &mut *p };
                let r = f(mag);
                m.len.store(mag.len() as u32, Ordering::Relaxed);
                r
            },
        );
        slot.busy.store(false, Ordering::Relaxed);
        r
    }

    /// Empty every slot's magazine into `sink`, without the owners' help:
    /// swap in the empty spares, wait for a grace period, drain the old
    /// magazines. Returns the number of items drained.
    ///
    /// `sink` gets them all, once, with the drain lock still held (if there
    /// are any): one drain at a time, and a second one waits until the
    /// first one's items are where `sink` puts them, rather than find the
    /// magazines empty while those items are in nobody's hands (an
    /// allocation that drains would fail with frames in flight).
    ///
    /// Must not be called inside a read-side section of the calling thread.
    #[allow(unsafe_code)]
    pub fn drain_all(&self, rcu: &Rcu, sink: impl FnOnce(Vec<T>)) -> usize {
        assert!(rcu.id() == self.rcu_id, "drain with another Rcu");
        // (The loom shim's mutex under models: the rank is entered apart.)
        let _rank = super::rank::RankGuard::enter(super::rank::Rank::PcpDrain);
        let _g = super::rank::unpoisoned(self.drain_lock.lock());
        let mut old = Vec::new();
        for slot in self.cpus.iter() {
            let cur = slot.current.load(Ordering::Relaxed);
            if self.mags[cur].len.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let spare = slot.spare.load(Ordering::Relaxed);
            // Release: the spare's emptiness (our earlier drain) is visible
            // to the owner's Acquire load of `current`.
            let prev = slot.current.swap(spare, Ordering::AcqRel);
            slot.spare.store(prev, Ordering::Relaxed);
            old.push(prev);
        }
        if old.is_empty() {
            return 0;
        }
        if !crate::mutated!("pcp_no_grace") {
            rcu.synchronize();
        }
        let mut items = Vec::new();
        for i in old {
            let m = &self.mags[i];
            m.cell.with_mut(|p| {
                // SAFETY: swapped out of `current`, and a grace period has
                // ended every section that could have loaded it; drainers are
                // serialized by `drain_lock`.
                let mag = unsafe { &mut *p };
                items.append(&mut mag.items);
                // A drain means memory is wanted elsewhere: the high mark
                // starts over.
                mag.cap = self.base;
            });
            m.len.store(0, Ordering::Relaxed);
        }
        let n = items.len();
        sink(items);
        self.drains.store(self.drains.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        self.drained.store(self.drained.load(Ordering::Relaxed) + n as u64, Ordering::Relaxed);
        n
    }

    /// Items cached in all magazines (a snapshot; exact when owners are idle).
    pub fn cached(&self) -> usize {
        self.mags.iter().map(|m| m.len.load(Ordering::Relaxed) as usize).sum()
    }

    /// Drains that found something to drain, and items drained, so far.
    pub fn drain_stats(&self) -> (u64, u64) {
        (self.drains.load(Ordering::Relaxed), self.drained.load(Ordering::Relaxed))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn owner_pushes_and_pops_drainer_empties() {
        let (rcu, readers) = Rcu::new(2);
        let c = PerCpuCache::<u32>::new(&rcu, 4, 4);
        c.local(&rcu, &readers[0], |m| {
            m.push(1).unwrap();
            m.push(2).unwrap();
            assert_eq!(m.room(), 2);
        });
        c.local(&rcu, &readers[1], |m| m.extend([7, 8, 9, 10]));
        assert_eq!(c.local(&rcu, &readers[0], |m| m.pop()), Some(2), "newest on top");
        c.local(&rcu, &readers[0], |m| m.push(2).unwrap());
        assert_eq!(c.local(&rcu, &readers[1], |m| m.push(11)), Err(11));
        assert_eq!(c.cached(), 6);
        let oldest: Vec<u32> = c.local(&rcu, &readers[1], |m| m.take_oldest(2).collect());
        assert_eq!(oldest, [7, 8]);
        let mut got = Vec::new();
        assert_eq!(c.drain_all(&rcu, |xs| got.extend(xs)), 4);
        got.sort();
        assert_eq!(got, [1, 2, 9, 10]);
        assert_eq!(c.cached(), 0);
        assert_eq!(c.drain_stats(), (1, 4));
        // The spare is in place and works.
        assert_eq!(c.local(&rcu, &readers[0], |m| (m.pop(), m.capacity())), (None, 4));
        assert_eq!(c.drain_all(&rcu, |_| {}), 0);
    }

    #[test]
    fn high_marks_grow_to_max_and_a_drain_resets_them() {
        let (rcu, readers) = Rcu::new(1);
        let c = PerCpuCache::<u32>::new(&rcu, 2, 5);
        let kept = c.local(&rcu, &readers[0], |m| {
            assert_eq!((m.push(1), m.push(2), m.push(3)), (Ok(()), Ok(()), Err(3)));
            assert_eq!(m.grow(4), 4);
            assert_eq!(m.grow(3), 4, "grow never lowers the mark");
            assert_eq!(m.grow(100), 5);
            assert!(!m.can_grow());
            m.extend([3, 4, 5]);
            m.len()
        });
        assert_eq!(kept, 5);
        assert_eq!(c.drain_all(&rcu, |_| {}), 5);
        // The slot now runs on its spare; drain that one too, and both
        // marks are back at the base.
        c.local(&rcu, &readers[0], |m| {
            m.grow(5);
            m.extend([1, 2, 3]);
        });
        assert_eq!(c.drain_all(&rcu, |_| {}), 3);
        c.local(&rcu, &readers[0], |m| assert_eq!((m.capacity(), m.can_grow()), (2, true)));
    }

    #[test]
    #[should_panic(expected = "re-entered")]
    fn reentry_panics() {
        let (rcu, readers) = Rcu::new(1);
        let c = PerCpuCache::<u32>::new(&rcu, 4, 4);
        c.local(&rcu, &readers[0], |_| c.local(&rcu, &readers[0], |_| ()));
    }

    #[test]
    #[should_panic(expected = "another Rcu")]
    fn foreign_readers_are_refused() {
        let (rcu, _) = Rcu::new(1);
        let (other, readers) = Rcu::new(1);
        let c = PerCpuCache::<u32>::new(&rcu, 4, 4);
        c.local(&other, &readers[0], |_| ());
    }

    #[test]
    fn drains_a_parked_owner_and_nothing_is_lost() {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let c = Arc::new(PerCpuCache::<u32>::new(&rcu, 8, 8));
        let r = readers.pop().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
        let owner = {
            let (rcu, c) = (rcu.clone(), c.clone());
            std::thread::spawn(move || {
                for next in 0..2000u32 {
                    c.local(&rcu, &r, |m| {
                        if m.push(next).is_err() {
                            m.take_oldest(4).for_each(drop);
                        }
                    });
                }
                c.local(&rcu, &r, |m| {
                    m.take_oldest(2).for_each(drop);
                    m.extend([100_000, 100_001]);
                });
                ready_tx.send(()).unwrap();
                rx.recv().unwrap(); // parked: never runs while the drainer works
            })
        };
        ready.recv().unwrap();
        let mut drained = Vec::new();
        c.drain_all(&rcu, |xs| drained.extend(xs));
        assert!(drained.contains(&100_000) && drained.contains(&100_001));
        assert_eq!(c.cached(), 0);
        tx.send(()).unwrap();
        owner.join().unwrap();
    }
}
