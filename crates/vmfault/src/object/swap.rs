//! Swapped-out pages in an object's index (`SWAP` entries): the object's
//! half of pageout and page-in (the page daemon's half is `reclaim`).
//!
//! # Protocol
//! An entry goes `PRESENT(frame) -> SWAP(slot)` only in
//! [`Object::swap_out`], and `SWAP(slot) -> PRESENT(frame)` only in
//! [`Object::page_in`], both under the object lock, both by a CAS from the
//! value the caller expects; `munmap`, `MADV_DONTNEED` and an object's end
//! take entries out with a swap to zero and no lock (`remove_range`), so
//! the CAS also settles who owns the frame or the slot: the one whose
//! atomic operation took the entry. Under the lock no other `SWAP` value
//! can appear, so a page-in that read the slot under it and then wins its
//! CAS installed exactly what the slot held.
//!
//! The lock also orders both against a collapse (`shadow.rs`), which moves
//! the entries of an absorbed object up under the same lock and marks it
//! `absorbed`: neither touches an absorbed object again. The page daemon
//! only tries the lock: a collapse may hold it while it allocates, and so
//! waits for the daemon.
//!
//! # Finding the pages
//! The page daemon takes its candidates from the page queues
//! (`phys::queues`) and finds each one's object by the owner id in its
//! descriptor: with swap configured, every object (anonymous or file)
//! registers in [`Reclaimable`] for its life, so the daemon needs no
//! space's map lock (a vCPU may hold one while it waits for the daemon to
//! free a frame). The registry is sharded by object id; objects are made
//! and dropped at `mmap`/`fork` rate, not per fault, and without swap
//! nothing registers.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};

use super::Cx;
use super::{Entry, Object};
use crate::error::{Error, Op, Result};
use crate::phys::{Kind, PageQueues, Pfn, Queue};
use crate::stats::Counter;
use crate::sync::rcu::RcuReadGuard;

/// What [`Object::swap_out`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SwapOut {
    /// The slot replaced the page.
    Done,
    /// The page is no longer there (`munmap` took it, or a collapse moved it).
    Lost,
    /// The object lock is held by another (a page-in, a collapse).
    Busy,
}

/// The objects of a `Vm` with swap, anonymous and file (see the module
/// docs).
#[derive(Debug, Default)]
pub(crate) struct Reclaimable {
    /// `[I]` whether objects register (swap is configured).
    enabled: bool,
    /// `[L]` by object id, sharded by its low bits (each shard its own lock,
    /// innermost).
    shards: [Mutex<HashMap<u64, Weak<Object>>>; 16],
}

impl Reclaimable {
    /// A registry; `enabled` when the `Vm` has swap.
    pub(crate) fn new(enabled: bool) -> Reclaimable {
        Reclaimable { enabled, ..Reclaimable::default() }
    }

    fn shard(&self, id: u64) -> &Mutex<HashMap<u64, Weak<Object>>> {
        &self.shards[(id % 16) as usize]
    }

    /// Register `o` (an object being made).
    pub(super) fn add(&self, id: u64, o: Weak<Object>) {
        if self.enabled {
            crate::sync::rank::lock(self.shard(id), crate::sync::rank::Rank::Leaf).insert(id, o);
        }
    }

    /// Forget object `id` (it is being dropped).
    pub(super) fn remove(&self, id: u64) {
        if self.enabled {
            crate::sync::rank::lock(self.shard(id), crate::sync::rank::Rank::Leaf).remove(&id);
        }
    }

    /// Object `id`, if it is alive and its pages may be reclaimed (the
    /// page daemon names it by a page descriptor's owner id). The caller
    /// drops it outside any read-side section.
    pub(crate) fn get(&self, id: u64) -> Option<Arc<Object>> {
        let o =
            crate::sync::rank::lock(self.shard(id), crate::sync::rank::Rank::Leaf).get(&id).and_then(Weak::upgrade)?;
        o.reclaimable().then_some(o)
    }
}

impl Object {
    /// The object `depth` levels down the chain from this one.
    pub(crate) fn level(self: &Arc<Self>, depth: u32, section: &RcuReadGuard<'_>) -> Option<Arc<Object>> {
        let mut o = self.clone();
        for _ in 0..depth {
            o = o.backing.cloned(section)?;
        }
        Some(o)
    }

    /// Whether the daemon may take this object's pages: not absorbed by a
    /// collapse (its pages are moving up). An anonymous object's go to
    /// swap, a file's back to the file ([`Object::evict_file_page`]).
    pub(crate) fn reclaimable(&self) -> bool {
        !self.absorbed.load(Ordering::Relaxed)
    }

    /// Replace page `pfn` at `pindex` by swap slot `slot`. On
    /// [`SwapOut::Done`] the caller drops the object's reference.
    ///
    /// The caller has written the page to the slot, with every mapping of
    /// it removed and new ones refused (the page is `BLOCKED`), after a
    /// grace period (no store through an old PTE in flight).
    /// Only tries the object lock (see the module docs): [`SwapOut::Busy`]
    /// if another holds it (the caller may try again later).
    pub(crate) fn swap_out(&self, pindex: u64, pfn: Pfn, slot: u64) -> SwapOut {
        let locked = crate::sync::rank::Ranked::try_take(crate::sync::rank::Rank::Object, || {
            crate::sync::rank::try_unpoisoned(self.lock.try_lock())
        });
        let Some(_g) = locked else { return SwapOut::Busy };
        if self.absorbed.load(Ordering::Relaxed) {
            return SwapOut::Lost;
        }
        let Some(leaf) = self.index.leaf(&self.env.phys, pindex) else { return SwapOut::Lost };
        match leaf.entry.compare_exchange(
            Entry::page(pfn).bits(),
            Entry::swapped(slot).bits(),
            Ordering::AcqRel,
            Ordering::Relaxed,
        ) {
            Ok(_) => SwapOut::Done,
            Err(_) => SwapOut::Lost,
        }
    }

    /// Read page `pindex` back from swap into the object `depth` levels down
    /// from this one, where [`Object::find`] found its slot (unless
    /// something else took the entry first: the caller looks again).
    ///
    /// Call outside any RCU section (it allocates, and it does I/O).
    pub(crate) fn page_in(self: &Arc<Self>, ctx: &Cx<'_>, op: Op, pindex: u64, depth: u32) -> Result<()> {
        let Some(level) = self.level(depth, &ctx.rcu_read()) else { return Ok(()) };
        let swap = self.env.swap.as_ref().expect("swap entries come from the swap file");
        let frames = ctx.frames();
        let phys = frames.phys();
        let mut frame =
            frames.alloc().ok_or(Error::NoMemory { op, what: "a data page to read a swapped-out page into" })?;
        let _g = crate::sync::rank::lock(&level.lock, crate::sync::rank::Rank::Object);
        let leaf = level.index.leaf(phys, pindex).filter(|_| !level.absorbed.load(Ordering::Relaxed));
        let e = leaf.map_or(Entry::NONE, |l| Entry::load(l.entry, Ordering::Acquire));
        let (Some(leaf), Some(slot)) = (leaf, e.slot()) else {
            frames.free_owned(frame);
            return Ok(());
        };
        if let Err(err) = swap.read(slot, phys.owned_bytes(&mut frame)) {
            frames.free_owned(frame);
            return Err(err);
        }
        let desc = phys.page(frame.pfn());
        desc.object.store(level.id, Ordering::Relaxed);
        desc.pindex.store(pindex, Ordering::Relaxed);
        desc.refs.set_objref();
        // The fault that wants it has yet to map it: not the next victim.
        desc.touch();
        PageQueues::mark(desc, Queue::Active);
        // Release: the contents are visible to whoever finds the page.
        let new = Entry::page(frame.pfn());
        let pfn = match frames.publish_into(frame, Kind::Data, leaf.entry, e.bits(), new.bits(), |_| {}) {
            Ok(pfn) => pfn,
            Err((frame, _)) => {
                // Removed meanwhile (munmap): that took the slot too.
                frames.free_owned(frame);
                return Ok(());
            }
        };
        frames.enqueue(pfn);
        swap.free(slot);
        ctx.count(Counter::pageins);
        Ok(())
    }

    /// Free the swap slot named by entry `e`, if it names one (the caller
    /// took the entry out of an index).
    pub(super) fn forget_slot(&self, e: Entry) {
        if let Some(slot) = e.slot() {
            self.env.swap.as_ref().expect("swap entries come from the swap file").free(slot);
        }
    }
}
