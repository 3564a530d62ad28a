//! Physical memory: the frame arena, the page descriptors and the global
//! allocator.
//!
//! # The frame protocol
//!
//! Frame contents are shared memory that several vCPUs may touch at once,
//! as a real machine's RAM is. To stay within Rust's memory model:
//!
//! 1. A frame that is allocated but not yet published is an [`OwnedFrame`]:
//!    nobody else can reach it, so it may be filled with plain (fast,
//!    vectorized) writes: zeroing a page is `memset`.
//! 2. Once published (its number stored in a PTE, an object index or a
//!    page-table entry, with Release), the frame is only accessed through
//!    atomics: [`PhysMem::words`], [`PhysMem::read_bytes`], [`PhysMem::write_bytes`].
//!    Racing loads and stores of a guest program are then well defined.
//! 3. A published frame is freed only after it has been unlinked from
//!    everywhere it was published *and a grace period has passed*
//!    ([`PhysMem::free_after_grace`]): every vCPU that could have read its
//!    number did so inside an RCU read-side section that has ended. This is
//!    the TLB shootdown of a real kernel. Only then can the frame become
//!    someone's `OwnedFrame` again and see plain writes.
//!
//! Breaking rule 3 would let a plain write race an atomic access, which is
//! undefined behaviour; that is why the only way to free a published frame
//! is through a function that waits for the grace period itself.
//!
//! Frame 0 is the shared zero page: always zero, never writable, never freed.

// This file holds unsafe code, each block with its `// SAFETY:`
// argument, and each item that holds one allows `unsafe_code` on itself:
// the crate denies it everywhere else.

pub(crate) mod arena;
pub(crate) mod deferred;
pub(crate) mod doorbell;
pub(crate) mod freelist;
pub(crate) mod page;
pub(crate) mod pcpu;
pub(crate) mod queues;
pub(crate) mod window;
pub(crate) mod wiring;

use std::sync::atomic::AtomicU64 as StdAtomicU64;
use std::sync::atomic::Ordering;

use arena::Arena;
pub(crate) use arena::host_available;
pub(crate) use doorbell::Doorbell;
use freelist::FreeList;
pub(crate) use page::{Kind, Page};
pub(crate) use pcpu::{Frames, PcpConfig};
pub(crate) use queues::{PageQueues, Queue};

use crate::error::Result;
use crate::stats::{Counter, CounterSet, SharedCounters};
use crate::sync::percpu::{Magazine, PerCpuCache};
use crate::sync::rcu::Rcu;
use crate::sync::scratch::Scratch;
use crate::types::PAGE_SIZE;

/// Words (u64) per frame.
pub(crate) const WORDS: usize = PAGE_SIZE as usize / 8;

/// A frame number. Its field is private to `phys`: the layers above get
/// one from the allocator, from a descriptor walk, or by decoding a word
/// that holds one ([`Pfn::decode`]: a PTE, a radix pointer, an index
/// entry), never by making one up; a number past the arena fails at its
/// first use ([`PhysMem::words`] and every frame pointer check it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Pfn(u32);

impl Pfn {
    /// The frame number, to encode it in a word (a PTE, a radix pointer,
    /// an index entry) or to index a per-frame table.
    #[inline]
    pub(crate) const fn raw(self) -> u32 {
        self.0
    }

    /// The frame a word encoded with [`raw`](Pfn::raw) names: for the
    /// decoders of PTEs and radix pointers (`pmap`) and of object index
    /// entries (`object`) only.
    #[inline]
    pub(crate) const fn decode(raw: u32) -> Pfn {
        Pfn(raw)
    }

    /// Every frame of a machine of `frames` frames, for walks over the
    /// descriptors (statistics).
    #[cfg(test)]
    pub(crate) fn all(frames: u32) -> impl Iterator<Item = Pfn> {
        (0..frames).map(Pfn)
    }
}

/// An allocated frame that nobody else can reach (rule 1 of the protocol).
/// Made only by the allocator (`Frames::alloc`) and by a publication that
/// failed ([`PhysMem::publish_into`]); consumed by publication
/// ([`PhysMem::publish`]) or by a free into the vCPU's cache
/// (`Frames::free_owned`). Dropped, it frees itself onto the global free
/// list: an early return cannot leak it.
#[derive(Debug)]
#[must_use = "an OwnedFrame is published or freed; dropping it frees it to the global list"]
pub(crate) struct OwnedFrame<'p> {
    /// The frame number, widened to a whole word: the struct then has no
    /// padding, and the fault path's copies of it (and of the structs
    /// holding it) move whole words. With a `u32` and four bytes of
    /// padding, a copy loaded eight bytes over a four-byte store and
    /// stalled on store forwarding (~10% of a page_fault1 fault's time).
    pfn: u64,
    /// Where it goes back when dropped.
    phys: &'p PhysMem,
}

impl<'p> OwnedFrame<'p> {
    /// Frame `pfn` of `phys`, owned by the caller.
    fn new(phys: &'p PhysMem, pfn: Pfn) -> OwnedFrame<'p> {
        OwnedFrame { pfn: u64::from(pfn.0), phys }
    }

    /// The frame number.
    #[inline]
    pub(crate) fn pfn(&self) -> Pfn {
        Pfn(self.pfn as u32)
    }

    /// The frame number, consuming the frame without freeing it (the caller
    /// publishes it, or frees it another way).
    #[inline]
    fn into_pfn(self) -> Pfn {
        std::mem::ManuallyDrop::new(self).pfn()
    }
}

impl Drop for OwnedFrame<'_> {
    fn drop(&mut self) {
        self.phys.free.give(&self.phys.pages, std::iter::once(self.pfn().0));
    }
}

/// The physical memory of one `Vm`.
pub(crate) struct PhysMem {
    /// `[I]` the frames' memory.
    arena: Arena,
    /// `[I]` one descriptor per frame (fields carry their own tags).
    pages: Box<[Page]>,
    /// `[F]` the global free list.
    free: FreeList,
    /// `[S]` per-vCPU page caches (`None` with `pcpu_pages = 0`); see `sync::percpu`.
    pcp: Option<PerCpuCache<u32>>,
    /// `[I]` their sizes.
    pcp_config: PcpConfig,
    /// `[I]` the hashed page locks of `refcount=pagelock` (`None`: atomic
    /// reference counts alone); see `wiring`.
    page_locks: Option<wiring::PageLocks>,
    /// `[S]` the page daemon's doorbell, rung by allocations that find the
    /// global list below `free_target` (`reclaim`).
    pub(crate) doorbell: std::sync::Arc<Doorbell>,
    /// `[I]` free frames on the global list below which the daemon runs.
    free_target: u64,
    /// `[S]` the page queues (`None` without swap: nothing to reclaim); see
    /// `queues`.
    pub(crate) queues: Option<PageQueues>,
    /// `[I]` bulk frees sort their frames (`VmConfig::frame_order`).
    ordered: bool,
    /// `[I]` frames known to hold zeros are not zeroed again
    /// (`VmConfig::reuse_zeroed`, `mark_zeroed`).
    reuse_zeroed: bool,
    /// `[I]` frames of its cache a fault that streams its frame's zeros
    /// also zeroes, fenced once with its own (`VmConfig::zero_ahead`;
    /// `Frames::zero_for`); 0: none.
    zero_ahead: usize,
    /// `[I]` faults zero a frame with streaming stores once it has been
    /// in a vCPU's cache this many of the vCPU's allocations, or came from
    /// elsewhere; `None`: never (`VmConfig::zero_stores`; `Frames::zero_for`).
    stream_after: Option<u32>,
    /// `[S]` frees nobody waits for (`VmConfig::free_path = deferred`; locks
    /// inside); see `deferred`.
    pub(crate) deferred: Option<deferred::Deferred>,
    /// `[a]` events counted outside any vCPU slot: frames freed and pages
    /// wired or unwired by the daemon and the grace-period thread.
    shared: SharedCounters,
}

/// The counters that follow the frames published as `kind`: made, freed.
/// They make the gauges of frames by kind in [`Vm::stats`](crate::Vm::stats)
/// without a look at every descriptor.
#[inline]
pub(crate) fn kind_counters(kind: Kind) -> (Counter, Counter) {
    match kind {
        Kind::Data => (Counter::data_pages_made, Counter::data_pages_freed),
        Kind::Table => (Counter::table_pages_made, Counter::table_pages_freed),
        Kind::Index => (Counter::index_pages_made, Counter::index_pages_freed),
        _ => panic!("a {kind:?} frame is not published"),
    }
}

/// Frames retired in one batch, by kind: counted once per batch.
#[derive(Debug, Default)]
pub(crate) struct Retired([u64; 3]);

impl Retired {
    #[inline]
    fn note(&mut self, kind: Kind) {
        let i = match kind {
            Kind::Data => 0,
            Kind::Table => 1,
            Kind::Index => 2,
            _ => panic!("freeing a {kind:?} frame"),
        };
        self.0[i] += 1;
    }

    /// Hand each kind's count to `add` as its `_freed` counter.
    fn count(&self, mut add: impl FnMut(Counter, u64)) {
        for (kind, n) in [Kind::Data, Kind::Table, Kind::Index].into_iter().zip(self.0) {
            if n != 0 {
                add(kind_counters(kind).1, n);
            }
        }
    }
}

impl std::fmt::Debug for PhysMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PhysMem")
            .field("frames", &self.pages.len())
            .field("free", &self.free.free_frames())
            .field("pcp", &self.pcp)
            .finish()
    }
}

impl PhysMem {
    /// Physical memory of `frames` frames; frame 0 becomes the zero page.
    /// With a capacity in `pcp`, each reader of `rcu` gets a page cache.
    /// With `page_locks`, wirings take a hashed page lock (the baseline).
    /// With `queues`, data pages of anonymous objects go on page queues.
    pub(crate) fn new(
        frames: u32,
        prefault: bool,
        rcu: &Rcu,
        pcp: PcpConfig,
        page_locks: bool,
        queues: bool,
    ) -> Result<PhysMem> {
        PhysMem::with_arena(Arena::new(frames, prefault, false)?, rcu, pcp, page_locks, queues)
    }

    /// [`new`](PhysMem::new), over a shared arena that host views can map
    /// (`VmConfig::host_views`; `phys::window`).
    pub(crate) fn new_shared(
        frames: u32,
        prefault: bool,
        rcu: &Rcu,
        pcp: PcpConfig,
        page_locks: bool,
        queues: bool,
    ) -> Result<PhysMem> {
        PhysMem::with_arena(Arena::new(frames, prefault, true)?, rcu, pcp, page_locks, queues)
    }

    fn with_arena(arena: Arena, rcu: &Rcu, pcp: PcpConfig, page_locks: bool, queues: bool) -> Result<PhysMem> {
        let frames = arena.frames();
        let mut pages = Vec::new();
        pages.try_reserve_exact(frames as usize).map_err(|_| crate::Error::HostMemory {
            what: "the page descriptors",
            need: u64::from(frames) * std::mem::size_of::<Page>() as u64,
            available: arena::host_available().unwrap_or(0),
        })?;
        pages.extend((0..frames).map(|_| Page::new()));
        let pages = pages.into_boxed_slice();
        // A fresh anonymous mapping reads as zeros: frame 0 is already the zero page.
        pages[0].set_kind(Kind::Free, Kind::Zero);
        let free = FreeList::new(&pages, 1);
        let cache = (pcp.capacity > 0).then(|| PerCpuCache::new(rcu, pcp.capacity, pcp.max));
        let page_locks = page_locks.then(wiring::PageLocks::new);
        let free_target = u64::from(frames) / 32;
        Ok(PhysMem {
            arena,
            pages,
            free,
            pcp: cache,
            pcp_config: pcp,
            page_locks,
            doorbell: Default::default(),
            free_target,
            queues: queues.then(|| PageQueues::new(rcu)),
            ordered: false,
            reuse_zeroed: false,
            zero_ahead: 0,
            stream_after: None,
            deferred: None,
            shared: SharedCounters::new(),
        })
    }

    /// Drain every per-CPU cache into the global list (remotely: see
    /// `sync::percpu`). Returns the frames drained. Not inside a read-side
    /// section of the calling thread, and holding no PTE lock.
    ///
    /// One drain at a time: a drain takes frames out of the caches, waits
    /// for a grace period, then puts them on the global list, and a second
    /// one meanwhile would find the caches empty and the list too, so an
    /// allocation that drains after the daemon began to would fail with
    /// frames in flight (`tests/api.rs` saw ENOMEM, then two free frames).
    /// The second waits instead (the caches' drain lock is held until the
    /// frames are on the list: `PerCpuCache::drain_all`), and finds the
    /// first one's frames.
    pub(crate) fn drain_pcpu(&self, rcu: &Rcu) -> usize {
        // Frames on the deferred lists are the vCPUs' too.
        let deferred = self.flush_deferred(rcu, true);
        let Some(pcp) = &self.pcp else { return deferred };
        let n = pcp.drain_all(rcu, |drained| self.free.give(&self.pages, drained));
        n + deferred
    }

    /// Whether the global list holds fewer frames than the free target
    /// (the page daemon's cue; per-CPU caches then stop growing).
    pub(crate) fn short_of_frames(&self) -> bool {
        self.free.free_frames() < self.free_target
    }

    /// Frames held in per-CPU caches (a snapshot).
    pub(crate) fn pcp_frames(&self) -> u64 {
        self.pcp.as_ref().map_or(0, |p| p.cached() as u64)
    }

    /// Remote drains that found frames, and frames drained, so far.
    pub(crate) fn pcp_drain_stats(&self) -> (u64, u64) {
        self.pcp.as_ref().map_or((0, 0), |p| p.drain_stats())
    }

    /// The shared zero page.
    pub(crate) fn zero_pfn(&self) -> Pfn {
        Pfn(0)
    }

    /// Frames in total.
    pub(crate) fn total_frames(&self) -> u64 {
        self.pages.len() as u64
    }

    /// Free frames on the global list below which the page daemon runs.
    pub(crate) fn free_target(&self) -> u64 {
        self.free_target
    }

    /// Defer frees past their grace period instead of waiting for it, for
    /// `slots` vCPU slots (`VmConfig::free_path = deferred`).
    pub(crate) fn set_deferred(&mut self, slots: usize) {
        self.deferred = Some(deferred::Deferred::new(slots));
    }

    /// Free published frames unlinked everywhere, without a vCPU: to the
    /// global list at once if a polled grace period completes (no reader
    /// inside a section); else onto the deferred list without an owner
    /// (the grace-period thread frees them), or, without deferred frees,
    /// after waiting for a grace period here.
    pub(crate) fn free_later(&self, rcu: &Rcu, frames: &[Pfn]) {
        if frames.is_empty() {
            return;
        }
        match &self.deferred {
            Some(d) => {
                let cookie = rcu.cookie();
                if rcu.quiescent() || rcu.poll(cookie) {
                    self.give_aged(frames);
                } else {
                    d.push(d.unowned(), cookie, frames);
                }
            }
            None => self.free_after_grace(rcu, frames),
        }
    }

    /// Give the frames of the deferred lists whose grace period has ended
    /// to the global list: the unowned list's (`all = false`, the
    /// grace-period thread), or every list's after waiting for a grace
    /// period (an allocation that found nothing, a drain). Returns how many.
    pub(crate) fn flush_deferred(&self, rcu: &Rcu, all: bool) -> usize {
        let Some(d) = &self.deferred else { return 0 };
        let mut frames = Vec::new();
        let moving = if all {
            if d.frames() == 0 && d.late() == 0 {
                return 0;
            }
            // Polled first: with no reader inside a section the drain
            // waits for nothing (and counts no wait).
            rcu.grace_period();
            // Retired snapshots that aged: their objects' frames join the
            // lists (aged by the next flush; a drop counts as a placement).
            d.drop_aged(rcu, false);
            d.take_all_aged(rcu, &mut frames)
        } else {
            // (The grace-period thread's every tick: no allocation.)
            let moving = d.take_aged(d.unowned(), rcu, &mut frames);
            if moving.is_empty() {
                return 0;
            }
            vec![moving]
        };
        self.give_aged(&frames);
        drop(moving);
        frames.len()
    }

    /// The grace-period thread's tick for the vCPUs' own lists: a list
    /// that holds something and has not changed since the last tick
    /// (`last`: what the list held, the owner's `Rcu::activity`, and for
    /// how many ticks the list has not changed, kept by the caller) has
    /// its aged values dropped here (its owner drops them only at its next
    /// change, which may not come: a vCPU that only faults). Its aged
    /// frames go to the global list if its owner has run no read-side
    /// section since either (idle or gone), or if the list has not
    /// changed for [`BUSY_TICKS`] ticks: a busy owner takes its frames
    /// back into its own cache at its next miss or free (flushing them
    /// would cost a refill from the global list and a return: ebizzy's
    /// threads compute between frees), but one that neither misses nor
    /// frees again would hold them for ever.
    pub(crate) fn flush_idle_deferred(&self, rcu: &Rcu, last: &mut [IdleMark]) {
        let Some(d) = &self.deferred else { return };
        let unchanged: Vec<usize> =
            (0..d.unowned()).filter(|&i| d.held_by(i) != (0, 0) && d.held_by(i) == last[i].held).collect();
        // The values first (a drop may take a while: a file's write-back),
        // so that no frame stays in transit across them (an allocation
        // that finds nothing waits for frames in transit).
        for &i in &unchanged {
            d.drop_aged_of(i, rcu, false);
        }
        let idle = unchanged
            .iter()
            .copied()
            .filter(|&i| rcu.activity(i) == last[i].activity || last[i].ticks + 1 >= BUSY_TICKS);
        let mut frames = Vec::new();
        let moving: Vec<_> = idle.map(|i| d.take_aged(i, rcu, &mut frames)).collect();
        self.give_aged(&frames);
        drop(moving);
        for (i, seen) in last.iter_mut().enumerate().take(d.unowned()) {
            let held = d.held_by(i);
            let ticks = if held == seen.held { seen.ticks.saturating_add(1) } else { 0 };
            *seen = IdleMark { held, activity: rcu.activity(i), ticks };
        }
    }
}

/// Ticks of the grace-period thread (`GRACE_POLL` each) after which a
/// busy vCPU's unchanged deferred list gives its aged frames to the
/// global list ([`PhysMem::flush_idle_deferred`]).
pub(crate) const BUSY_TICKS: u32 = 10;

/// What a vCPU's deferred list held (frames, values to drop), how far its
/// owner had run (`Rcu::activity`) at the grace-period thread's last tick,
/// and for how many ticks the list had not changed
/// ([`PhysMem::flush_idle_deferred`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct IdleMark {
    held: (u64, u64),
    activity: u64,
    ticks: u32,
}

thread_local! {
    /// The thread's buffer for frames sorted into free order
    /// ([`PhysMem::in_free_order`]).
    static ORDERED: std::cell::Cell<Vec<Pfn>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Frames in the order a bulk free gives them back
/// ([`PhysMem::in_free_order`]).
pub(crate) enum InFreeOrder<'f> {
    /// The caller's, already in that order.
    AsGiven(&'f [Pfn]),
    /// A sorted copy, in the thread's buffer.
    Sorted(Scratch<Pfn>),
}

impl std::ops::Deref for InFreeOrder<'_> {
    type Target = [Pfn];
    fn deref(&self) -> &[Pfn] {
        match self {
            InFreeOrder::AsGiven(f) => f,
            InFreeOrder::Sorted(v) => v,
        }
    }
}

impl PhysMem {
    /// Free frames whose grace period has ended, in one batch.
    pub(crate) fn give_aged(&self, frames: &[Pfn]) {
        if frames.is_empty() {
            return;
        }
        self.leave_queues(frames);
        let frames = self.in_free_order(frames);
        let mut freed = Retired::default();
        self.free.give(&self.pages, frames.iter().map(|&pfn| self.retire(pfn, &mut freed)));
        freed.count(|c, n| self.count(None, c, n));
    }

    /// Count `n` events `c` on the vCPU whose counters these are, or, with
    /// none (the daemon, the grace-period thread), on the shared set.
    #[inline]
    pub(crate) fn count(&self, counters: Option<&CounterSet>, c: Counter, n: u64) {
        match counters {
            Some(counters) => counters.add(c, n),
            None => self.shared.add(c, n),
        }
    }

    /// Events counted outside any vCPU slot.
    pub(crate) fn shared_counters(&self) -> &SharedCounters {
        &self.shared
    }

    /// Frames on the deferred lists (a snapshot).
    pub(crate) fn deferred_frames(&self) -> u64 {
        self.deferred.as_ref().map_or(0, |d| d.held())
    }

    /// Hand frames known to hold zeros out again without zeroing them
    /// (`VmConfig::reuse_zeroed`).
    pub(crate) fn set_reuse_zeroed(&mut self, on: bool) {
        self.reuse_zeroed = on;
    }

    /// Whether frames known to hold zeros are marked (`mark_zeroed`).
    #[inline]
    pub(crate) fn reuses_zeroed(&self) -> bool {
        self.reuse_zeroed
    }

    /// Record that published frame `pfn`, detached and on its way to be
    /// freed, holds only zeros, so that its next zeroing can be skipped.
    /// The caller cleared it (or found it clear) and nobody writes it
    /// before it is freed: lockless readers may still read it until their
    /// grace period, and see zeros. Nothing without `reuse_zeroed`.
    pub(crate) fn mark_zeroed(&self, pfn: Pfn) {
        if self.reuse_zeroed {
            // Diagnostic: a frame marked with data in it would hand that
            // data to the next owner, as a page of another space.
            debug_assert!(
                self.words(pfn).iter().all(|w| w.load(Ordering::Relaxed) == 0),
                "{pfn:?} marked zeroed is not"
            );
            self.page(pfn).zeroed.store(1, Ordering::Relaxed);
        }
    }

    /// Sort bulk frees by address (`VmConfig::frame_order = ordered`).
    pub(crate) fn set_ordered(&mut self, ordered: bool) {
        self.ordered = ordered;
    }

    /// `frames` in the order a bulk free gives them back: as they come, or
    /// (ordered) by descending address, so that the free stack and the
    /// magazines hand them out ascending, each allocation next to the
    /// last one. A sorted copy is made in the thread's buffer (no heap
    /// allocation once it has room: every `malloc1` loop sorted one).
    pub(crate) fn in_free_order<'f>(&self, frames: &'f [Pfn]) -> InFreeOrder<'f> {
        if !self.ordered || frames.is_sorted_by(|a, b| a >= b) {
            return InFreeOrder::AsGiven(frames);
        }
        let mut v = Scratch::take(&ORDERED);
        v.extend_from_slice(frames);
        // A stable sort finds natural runs: a munmap frees the frames of
        // its pages in page order, mostly ascending runs (each reversed
        // whole here) and few of them, so this costs a few passes, where
        // an unstable sort partitioned log(n) times (300 instructions per
        // page_fault1 fault, all in munmap).
        v.sort_by(|a, b| b.cmp(a));
        InFreeOrder::Sorted(v)
    }

    /// Override the free target (`VmConfig::free_target`).
    pub(crate) fn set_free_target(&mut self, frames: u64) {
        self.free_target = frames;
    }

    /// Frames on the global free list (a snapshot).
    pub(crate) fn global_free_frames(&self) -> u64 {
        self.free.free_frames()
    }

    /// Global free-list lock acquisitions so far.
    pub(crate) fn lock_acquisitions(&self) -> u64 {
        self.free.acquisitions()
    }

    /// Frames taken from and given to the global free list so far.
    pub(crate) fn global_frames_moved(&self) -> u64 {
        self.free.moved()
    }

    /// A host window of `len` bytes over this arena (`phys::window`;
    /// needs the shared arena of [`new_shared`](PhysMem::new_shared)).
    pub(crate) fn window(&self, len: u64) -> Result<window::Window> {
        window::Window::new(&self.arena, len)
    }

    /// The descriptor of `pfn`.
    #[inline]
    pub(crate) fn page(&self, pfn: Pfn) -> &Page {
        &self.pages[pfn.0 as usize]
    }

    /// Fill an owned frame with zeros (plain writes: rule 1), unless it is
    /// known to hold them already (`mark_zeroed`). Says whether it wrote.
    #[inline]
    pub(crate) fn zero(&self, f: &mut OwnedFrame) -> bool {
        self.zero_with(f, None)
    }

    /// [`zero`](PhysMem::zero), with streaming (non-temporal) stores for
    /// every line but the one at byte `keep` of the frame when `keep` is
    /// given (`VmConfig::zero_stores`): that line is written with ordinary
    /// stores, last, so that the access about to use it finds it cached.
    /// The streaming stores are fenced before this returns: whatever
    /// publishes the frame afterwards (a Release store) orders them too.
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) fn zero_with(&self, f: &mut OwnedFrame, keep: Option<usize>) -> bool {
        let page = self.page(f.pfn());
        if page.zeroed.load(Ordering::Relaxed) != 0 {
            page.zeroed.store(0, Ordering::Relaxed);
            // Diagnostic: see `mark_zeroed`.
            debug_assert!(
                self.words(f.pfn()).iter().all(|w| w.load(Ordering::Relaxed) == 0),
                "{:?} was not zero",
                f.pfn()
            );
            return false;
        }
        let p = self.arena.frame_ptr(f.pfn().0);
        match keep {
            // SAFETY: as below; `keep` is reduced to a line of the frame.
            Some(keep) => unsafe { arena::stream_zero(p, keep % PAGE_SIZE as usize) },
            // SAFETY: the frame lies inside the arena, and an `OwnedFrame` is
            // reachable by nobody else (rule 1), so plain writes race nothing.
            None => unsafe { std::ptr::write_bytes(p, 0, PAGE_SIZE as usize) },
        }
        true
    }

    /// Zero owned frame `f`, which holds no zeros, with streaming stores
    /// but for the line at byte `keep`, and leave them unfenced: the caller
    /// fences ([`arena::stream_fence`]) before the frame can be published
    /// or reach another thread (`Frames::zero_for`, which fences with the
    /// frames it zeroes ahead).
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) fn stream_zero_unfenced(&self, f: &mut OwnedFrame, keep: usize) {
        let p = self.arena.frame_ptr(f.pfn().0);
        // SAFETY: the frame lies inside the arena, and an `OwnedFrame` is
        // reachable by nobody else (rule 1).
        unsafe { arena::stream_zero_unfenced(p, keep % PAGE_SIZE as usize) };
    }

    /// Faults zero a frame with streaming stores once it has been in a
    /// vCPU's cache `after` of the vCPU's allocations (0: always), or came
    /// from elsewhere; `None`: never (`VmConfig::zero_stores`).
    pub(crate) fn set_stream_after(&mut self, after: Option<u32>) {
        self.stream_after = after;
    }

    /// Frames a fault that streams its own frame's zeros zeroes ahead
    /// from its cache (`VmConfig::zero_ahead`; 0: none).
    pub(crate) fn set_zero_ahead(&mut self, frames: usize) {
        self.zero_ahead = frames;
    }

    /// See [`set_zero_ahead`](PhysMem::set_zero_ahead).
    #[inline]
    pub(crate) fn zero_ahead(&self) -> usize {
        self.zero_ahead
    }

    /// Zero up to `n` of the frames magazine `m` hands out next ahead of
    /// their allocation, those `pick` chooses that hold no zeros yet, with
    /// streaming stores but for the line at byte `keep` (the one a fault
    /// like the current one will touch first); mark them as holding zeros,
    /// so that the faults that take them skip their zeroing
    /// ([`zero_with`](PhysMem::zero_with)); then fence, which also orders
    /// this thread's earlier streaming stores ([`stream_zero_unfenced`](
    /// PhysMem::stream_zero_unfenced)). Returns how many it zeroed.
    ///
    /// The frames are free in `m`, which the caller holds mutably: inside
    /// `PerCpuCache::local`, where nobody else reads or writes them until
    /// the caller's read-side section ends (a drain waits for that), and
    /// the fence comes before that end.
    #[allow(unsafe_code)]
    pub(crate) fn zero_ahead_in(
        &self,
        m: &mut Magazine<u32>,
        n: usize,
        keep: usize,
        mut pick: impl FnMut(Pfn) -> bool,
    ) -> u64 {
        let mut zeroed = 0;
        for &p in m.newest(n) {
            let pfn = Pfn(p);
            let page = self.page(pfn);
            if page.zeroed.load(Ordering::Relaxed) != 0 || !pick(pfn) {
                continue;
            }
            let ptr = self.arena.frame_ptr(p);
            // SAFETY: the frame lies inside the arena and, free in the
            // magazine the caller holds mutably, is read and written by
            // nobody else.
            unsafe { arena::stream_zero_unfenced(ptr, keep % PAGE_SIZE as usize) };
            // Read by whoever takes the frame: this thread (program order),
            // or another after a drain's grace period, which follows the
            // fence below and the end of the caller's section.
            page.zeroed.store(1, Ordering::Relaxed);
            zeroed += 1;
        }
        arena::stream_fence();
        zeroed
    }

    /// See [`set_stream_after`](PhysMem::set_stream_after).
    #[inline]
    pub(crate) fn stream_after(&self) -> Option<u32> {
        self.stream_after
    }

    /// Whether frame `pfn` is marked as holding only zeros (`Page::zeroed`).
    #[inline]
    pub(crate) fn holds_zeros(&self, pfn: Pfn) -> bool {
        self.page(pfn).zeroed.load(Ordering::Relaxed) != 0
    }

    /// An owned frame is about to be written other than by
    /// [`zero`](PhysMem::zero): it no longer holds only zeros.
    #[inline]
    fn dirtied(&self, f: &OwnedFrame) {
        let page = self.page(f.pfn());
        if page.zeroed.load(Ordering::Relaxed) != 0 {
            page.zeroed.store(0, Ordering::Relaxed);
        }
    }

    /// The bytes of an owned frame, for plain writes (rule 1): a file's
    /// page is read straight into it.
    #[allow(unsafe_code)]
    pub(crate) fn owned_bytes<'a>(&'a self, f: &'a mut OwnedFrame) -> &'a mut [u8] {
        self.dirtied(f);
        // SAFETY: the frame is PAGE_SIZE bytes inside the arena, which
        // outlives `&self`; an `OwnedFrame` is reachable by nobody else
        // (rule 1), and the `&mut` borrow of it makes this slice the only
        // way to its bytes while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.arena.frame_ptr(f.pfn().0), PAGE_SIZE as usize) }
    }

    /// Fill an owned frame with a copy of a published one (copy-on-write):
    /// atomic loads from `src` (rule 2), plain stores to `f` (rule 1).
    #[allow(unsafe_code)]
    pub(crate) fn copy_into(&self, f: &mut OwnedFrame, src: Pfn) {
        self.dirtied(f);
        let from = self.words(src);
        let to = self.arena.frame_ptr(f.pfn().0).cast::<u64>();
        for (i, w) in from.iter().enumerate() {
            // SAFETY: word `i` of the owned frame lies inside the arena (the
            // frame is page-aligned, `i < WORDS`); nobody else can reach an
            // `OwnedFrame` (rule 1), so the plain store races nothing.
            unsafe { to.add(i).write(w.load(Ordering::Relaxed)) }
        }
    }

    /// Publish an owned frame as `kind`; from now on only atomics touch it.
    /// Through [`Frames::publish`], which counts it.
    #[inline]
    fn publish(&self, f: OwnedFrame, kind: Kind) -> Pfn {
        self.publish_described(self.page(f.pfn()), f, kind)
    }

    /// [`publish`](PhysMem::publish) with the frame's descriptor, `page`,
    /// at hand.
    #[inline(always)]
    fn publish_described(&self, page: &Page, f: OwnedFrame, kind: Kind) -> Pfn {
        debug_assert!(std::ptr::eq(page, self.page(f.pfn())), "another frame's descriptor");
        // Published, the frame is written by atomics nobody tracks
        // (`dirtied`, on the descriptor at hand).
        if page.zeroed.load(Ordering::Relaxed) != 0 {
            page.zeroed.store(0, Ordering::Relaxed);
        }
        page.set_kind(Kind::Owned, kind);
        f.into_pfn()
    }

    /// Publish owned frame `f` as `kind` by a compare-exchange of `slot`
    /// from `current` to `word`, which names the frame (an index entry, a
    /// radix pointer): the way a frame becomes reachable through a word
    /// that others may race to fill. Release on success: the frame's
    /// contents and descriptor are visible to whoever finds `word`. On
    /// failure nobody saw the frame: it comes back owned (its kind and
    /// description cleared, [`unpublish`](PhysMem::unpublish)), with the
    /// value `slot` held.
    /// Through [`Frames::publish_into`], which counts it.
    #[inline(always)]
    fn publish_into(
        &self,
        f: OwnedFrame,
        kind: Kind,
        slot: &StdAtomicU64,
        current: u64,
        word: u64,
        describe: impl FnOnce(&Page),
    ) -> std::result::Result<Pfn, (OwnedFrame<'_>, u64)> {
        let page = self.page(f.pfn());
        describe(page);
        let pfn = self.publish_described(page, f, kind);
        match slot.compare_exchange(current, word, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(pfn),
            // The word was never stored: the frame is still unreachable.
            Err(now) => Err((self.unpublish(pfn, kind), now)),
        }
    }

    /// Take back a frame published as `kind` whose publication never became
    /// visible (the compare-exchange of [`publish_into`](PhysMem::publish_into)
    /// lost): it is still unreachable by anyone else. Private: only
    /// `publish_into` knows that the word naming the frame was never stored.
    #[inline]
    fn unpublish(&self, pfn: Pfn, kind: Kind) -> OwnedFrame<'_> {
        let page = self.page(pfn);
        page.set_kind(kind, Kind::Owned);
        page.object.store(0, Ordering::Relaxed);
        page.children.store(0, Ordering::Relaxed);
        page.refs.clear();
        // Marked for a queue before publication, the frame may have been
        // linked meanwhile by a stale batch entry or the daemon (a former
        // life of the frame): it leaves the queue like a freed frame.
        self.leave_queues(&[pfn]);
        OwnedFrame::new(self, pfn)
    }

    /// Free published frames that have been unlinked from everywhere: after
    /// a grace period of `rcu` (rule 3; polled first, which needs no wait
    /// when no reader is inside a section), free them in one batch.
    pub(crate) fn free_after_grace(&self, rcu: &Rcu, frames: &[Pfn]) {
        if frames.is_empty() {
            return;
        }
        rcu.grace_period();
        self.give_aged(frames);
    }

    /// Frames about to be freed leave the page queues.
    pub(crate) fn leave_queues(&self, frames: &[Pfn]) {
        if let Some(q) = &self.queues {
            q.forget(&self.pages, frames);
        }
    }

    /// Every page descriptor, by frame number.
    pub(crate) fn pages(&self) -> &[Page] {
        &self.pages
    }

    /// A published frame, unlinked everywhere and past its grace period,
    /// becomes owned again (ready for a free list), noted in `freed`.
    fn retire(&self, pfn: Pfn, freed: &mut Retired) -> u32 {
        let page = self.page(pfn);
        let kind = page.kind();
        freed.note(kind);
        page.set_kind(kind, Kind::Owned);
        page.object.store(0, Ordering::Relaxed);
        page.children.store(0, Ordering::Relaxed);
        page.refs.clear();
        pfn.0
    }

    /// The frame as 512 atomic words (rule 2).
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) fn words(&self, pfn: Pfn) -> &[StdAtomicU64; WORDS] {
        let p = self.arena.frame_ptr(pfn.0);
        // SAFETY: the frame is 4096 bytes inside the arena, 8-byte aligned
        // (the arena is page-aligned); `AtomicU64` has the layout of `u64`;
        // the arena outlives `&self`. Published frames are only accessed
        // atomically (rule 2), so no plain access races these atomics.
        unsafe { &*(p as *const [StdAtomicU64; WORDS]) }
    }

    /// Copy bytes out of a published frame, starting at byte `offset`.
    pub(crate) fn read_bytes(&self, pfn: Pfn, offset: usize, buf: &mut [u8]) {
        assert!(offset + buf.len() <= PAGE_SIZE as usize);
        let words = self.words(pfn);
        let mut off = offset;
        let mut done = 0;
        while done < buf.len() {
            let w = words[off / 8].load(Ordering::Relaxed).to_ne_bytes();
            let at = off % 8;
            let n = (8 - at).min(buf.len() - done);
            buf[done..done + n].copy_from_slice(&w[at..at + n]);
            done += n;
            off += n;
        }
    }

    /// Read-modify-write the naturally aligned `size`-byte value (4 or 8)
    /// at byte `offset` of a published frame, atomically and sequentially
    /// consistently: `f` maps the current value to the new one, or to
    /// `None` to leave it (a failed compare-exchange). Returns the value
    /// before, `Ok` if `f` changed it. A 4-byte value is updated with a CAS
    /// of its whole word, so that it is atomic with the word stores and
    /// merges of `write_bytes` on the same word.
    pub(crate) fn update_value(
        &self,
        pfn: Pfn,
        offset: usize,
        size: usize,
        mut f: impl FnMut(u64) -> Option<u64>,
    ) -> std::result::Result<u64, u64> {
        assert!(matches!(size, 4 | 8) && offset.is_multiple_of(size) && offset < PAGE_SIZE as usize);
        let word = &self.words(pfn)[offset / 8];
        if size == 8 {
            return word.fetch_update(Ordering::SeqCst, Ordering::SeqCst, f);
        }
        // The lane of the 4 bytes at `offset` within their word.
        let at = offset % 8;
        let shift = if cfg!(target_endian = "little") { at * 8 } else { (4 - at) * 8 };
        let mask = 0xffff_ffffu64 << shift;
        word.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |w| {
            f((w & mask) >> shift).map(|v| (w & !mask) | ((v & 0xffff_ffff) << shift))
        })
        .map(|w| (w & mask) >> shift)
        .map_err(|w| (w & mask) >> shift)
    }

    /// Copy bytes into a published frame, starting at byte `offset`. Whole
    /// words are stored; partial words are merged with a CAS so that
    /// concurrent stores to the other bytes of the word are not lost.
    #[inline(always)]
    pub(crate) fn write_bytes(&self, pfn: Pfn, offset: usize, data: &[u8]) {
        assert!(offset + data.len() <= PAGE_SIZE as usize);
        let words = self.words(pfn);
        let at = offset % 8;
        if at + data.len() <= 8 && !data.is_empty() {
            // A store inside one word (a guest's byte, half-word, word or
            // aligned double-word store: the common case), with no loop.
            let word = &words[offset / 8];
            return match <[u8; 8]>::try_from(data) {
                Ok(whole) => word.store(u64::from_ne_bytes(whole), Ordering::Relaxed),
                Err(_) => store_in_word(word, at, data),
            };
        }
        write_words(words, offset, data);
    }
}

/// Merge `piece` (less than a word) into `word` at byte `at`, with a CAS
/// so that concurrent stores to the word's other bytes are not lost.
#[inline]
fn store_in_word(word: &StdAtomicU64, at: usize, piece: &[u8]) {
    debug_assert!(!piece.is_empty() && piece.len() < 8 && at + piece.len() <= 8, "{} bytes at {at}", piece.len());
    // The bytes and their mask, shifted into place as in a little-endian
    // word (`from_le` puts them where the host's byte order has them),
    // built once outside the CAS loop.
    let mut value = 0u64;
    for (i, &b) in piece.iter().enumerate() {
        value |= u64::from(b) << (8 * i);
    }
    let fill = (1u64 << (8 * piece.len())) - 1;
    let (bytes, mask) = (u64::from_le(value << (8 * at)), u64::from_le(fill << (8 * at)));
    let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| Some(old & !mask | bytes));
}

/// [`PhysMem::write_bytes`] across words: whole words stored, partial ones
/// merged (`store_in_word`).
#[inline(never)]
fn write_words(words: &[StdAtomicU64; WORDS], offset: usize, data: &[u8]) {
    let (mut off, mut rest) = (offset, data);
    while !rest.is_empty() {
        let at = off % 8;
        let (piece, tail) = rest.split_at((8 - at).min(rest.len()));
        let word = &words[off / 8];
        if let Ok(whole) = <[u8; 8]>::try_from(piece) {
            word.store(u64::from_ne_bytes(whole), Ordering::Relaxed);
        } else {
            store_in_word(word, at, piece);
        }
        off += piece.len();
        rest = tail;
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const NO_PCP: PcpConfig = PcpConfig { capacity: 0, fill: 0, drain: 0, max: 0 };

    #[test]
    fn an_owned_frame_dropped_goes_back_and_a_lost_publication_comes_back_owned() {
        let (rcu, _readers) = Rcu::new(1);
        let phys = PhysMem::new(8, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let free = phys.global_free_frames();
        let f = frames.alloc().unwrap();
        assert_eq!(phys.global_free_frames(), free - 1);
        drop(f);
        assert_eq!(phys.global_free_frames(), free, "a dropped frame frees itself");
        // A publication whose compare-exchange loses leaves the slot alone
        // and hands the frame back, owned and described as nothing.
        let slot = StdAtomicU64::new(7);
        let f = frames.alloc().unwrap();
        let pfn = f.pfn();
        phys.page(pfn).object.store(42, Ordering::Relaxed);
        let (back, now) = phys.publish_into(f, Kind::Data, &slot, 0, u64::from(pfn.0), |_| {}).unwrap_err();
        assert_eq!((back.pfn(), now, slot.load(Ordering::Relaxed)), (pfn, 7, 7));
        assert_eq!(phys.page(pfn).object.load(Ordering::Relaxed), 0, "its description is cleared");
        // A winning one stores the word and publishes.
        let got = phys.publish_into(back, Kind::Data, &slot, 7, u64::from(pfn.0), |_| {}).unwrap();
        assert_eq!((got, slot.load(Ordering::Relaxed)), (pfn, u64::from(pfn.0)));
        assert_eq!(phys.global_free_frames(), free - 1, "published, it is nobody's to free");
    }

    #[test]
    fn ordered_bulk_frees_come_back_in_ascending_order() {
        for ordered in [false, true] {
            let (rcu, _r) = Rcu::new(1);
            let mut phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
            phys.set_ordered(ordered);
            let frames = Frames::global(&phys);
            let mut got: Vec<Pfn> = (0..16).map(|_| phys.publish(frames.alloc().unwrap(), Kind::Data)).collect();
            // Freed in a scrambled order, as munmap collects them.
            got.sort_by_key(|p| (p.0 * 7) % 16);
            phys.free_after_grace(&rcu, &got);
            let held: Vec<OwnedFrame> = (0..16).map(|_| frames.alloc().unwrap()).collect();
            let again: Vec<u32> = held.iter().map(|f| f.pfn().0).collect();
            let ascending = again.windows(2).all(|w| w[1] == w[0] + 1);
            assert_eq!(ascending, ordered, "ordered={ordered}: {again:?}");
        }
    }

    #[test]
    fn byte_stores_keep_the_rest_of_their_words() {
        let (rcu, _r) = Rcu::new(1);
        let phys = PhysMem::new(8, false, &rcu, NO_PCP, false, false).unwrap();
        let pfn = phys.publish(Frames::global(&phys).alloc_zeroed().unwrap(), Kind::Data);
        let mut model = [0u8; 32];
        let mut serial = 0u8;
        for offset in 0..24 {
            for len in 0..=(24 - offset) {
                let data: Vec<u8> = (0..len)
                    .map(|_| {
                        serial = serial.wrapping_add(37);
                        serial
                    })
                    .collect();
                phys.write_bytes(pfn, offset, &data);
                model[offset..offset + len].copy_from_slice(&data);
                let mut got = [0u8; 32];
                phys.read_bytes(pfn, 0, &mut got);
                assert_eq!(got, model, "after {len} bytes at {offset}");
            }
        }
    }

    #[test]
    fn alloc_zero_publish_free() {
        let (rcu, _r) = Rcu::new(1);
        let phys = PhysMem::new(32, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        assert_eq!(phys.total_frames(), 32);
        assert_eq!(phys.global_free_frames(), 31);
        let f = frames.alloc_zeroed().unwrap();
        let pfn = phys.publish(f, Kind::Data);
        phys.write_bytes(pfn, 4093, b"abc");
        phys.write_bytes(pfn, 0, b"0123456789");
        let mut buf = [0u8; 12];
        phys.read_bytes(pfn, 0, &mut buf);
        assert_eq!(&buf, b"0123456789\0\0");
        let mut tail = [0u8; 3];
        phys.read_bytes(pfn, 4093, &mut tail);
        assert_eq!(&tail, b"abc");
        phys.free_after_grace(&rcu, &[pfn]);
        assert_eq!(phys.global_free_frames(), 31);
        // Reallocation zeroes it again.
        let f = frames.alloc_zeroed().unwrap();
        let pfn = phys.publish(f, Kind::Data);
        phys.read_bytes(pfn, 4093, &mut tail);
        assert_eq!(tail, [0; 3]);
        let mut zero = [1u8; 16];
        phys.read_bytes(phys.zero_pfn(), 100, &mut zero);
        assert_eq!(zero, [0; 16]);
        phys.free_after_grace(&rcu, &[pfn]);
    }

    #[test]
    fn streaming_zeroing_clears_every_line_whichever_it_keeps() {
        let (rcu, _r) = Rcu::new(1);
        let phys = PhysMem::new(8, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        // Three frames in a row (the free list hands them out in order):
        // the middle one is zeroed, its neighbours must keep their bytes.
        let mut three: Vec<OwnedFrame> = (0..3).map(|_| frames.alloc().unwrap()).collect();
        three.sort_by_key(|f| f.pfn().0);
        assert!(three[0].pfn().0 + 2 == three[2].pfn().0, "three adjacent frames");
        let [before, mut f, after] = <[OwnedFrame; 3]>::try_from(three).ok().unwrap();
        let (mut before, mut after) = (before, after);
        phys.owned_bytes(&mut before).fill(0x3c);
        phys.owned_bytes(&mut after).fill(0xc3);
        // Every line, its first and last byte, and bytes past the page
        // (reduced to a line of it).
        let keeps = (0..64).map(|l| l * 64).chain([1, 63, 4095, 4096 + 130, usize::MAX]);
        for keep in keeps {
            phys.owned_bytes(&mut f).fill(0xa5);
            assert!(phys.zero_with(&mut f, Some(keep)), "nothing marked it zeroed");
            let bytes = phys.owned_bytes(&mut f);
            let dirty = bytes.iter().position(|&b| b != 0);
            assert_eq!(dirty, None, "keeping the line of byte {keep}: byte {dirty:?} is not zero");
            assert!(
                phys.owned_bytes(&mut before).iter().all(|&b| b == 0x3c),
                "keeping {keep}: the frame below changed"
            );
            assert!(phys.owned_bytes(&mut after).iter().all(|&b| b == 0xc3), "keeping {keep}: the frame above changed");
        }
        for g in [before, f, after] {
            frames.free_owned(g);
        }
    }

    #[test]
    fn frames_that_left_a_vcpus_cache_are_zeroed_streaming() {
        use crate::stats::Counter;
        const AFTER: u32 = 2048;
        let (rcu, readers) = Rcu::new(2);
        let cfg = PcpConfig { capacity: 4, fill: 3, drain: 4, max: 4 };
        let mut phys = PhysMem::new(16, false, &rcu, cfg, false, false).unwrap();
        phys.set_stream_after(Some(AFTER));
        let (ca, cb) = (crate::stats::CounterSet::new(), crate::stats::CounterSet::new());
        let a = Frames::new(&phys, &rcu, &readers[0], &ca);
        let b = Frames::new(&phys, &rcu, &readers[1], &cb);
        // Where streaming stores do not exist (miri), nothing streams.
        let streamed = |c: &crate::stats::CounterSet| c.get(Counter::zeroings_streamed);
        let want = |n: u64| n * u64::from(arena::STREAMS);
        // Straight from the global list: never in a's cache.
        let mut f = a.alloc().unwrap();
        a.zero_for(&mut f, 0);
        assert_eq!(streamed(&ca), want(1), "a frame from the global list has left every cache");
        // Freed into a's cache and taken again at once: warm.
        let pfn = f.pfn();
        a.free_owned(f);
        let mut f = a.alloc().unwrap();
        assert_eq!(f.pfn(), pfn, "the cache hands out its last free first");
        a.zero_for(&mut f, 100);
        assert_eq!(streamed(&ca), want(1), "a frame a moment in a's cache is zeroed with ordinary stores");
        // Freed into a's cache, then a allocates a cache's worth of others.
        a.free_owned(f);
        ca.add(Counter::frame_allocs, u64::from(AFTER) - 1);
        let mut f = a.alloc().unwrap();
        assert_eq!(f.pfn(), pfn);
        a.zero_for(&mut f, 200);
        assert_eq!(streamed(&ca), want(2), "a frame a allocated AFTER frames since is streamed");
        // Published, freed after its grace period (munmap's way: `stash`),
        // taken again at once: warm.
        let published = phys.publish(f, Kind::Data);
        a.free_aged(&[published]);
        let mut f = a.alloc().unwrap();
        assert_eq!(f.pfn(), pfn, "the cache hands out its last free first");
        a.zero_for(&mut f, 250);
        assert_eq!(streamed(&ca), want(2), "a frame munmap's way put in a's cache a moment ago is warm");
        // Taken, then AFTER allocations of other frames before its free (a
        // page_fault1 munmap frees frames it faulted in long ago), and
        // taken again at once: its lines have left a's caches.
        ca.add(Counter::frame_allocs, u64::from(AFTER));
        let published = phys.publish(f, Kind::Data);
        a.free_aged(&[published]);
        let mut f = a.alloc().unwrap();
        assert_eq!(f.pfn(), pfn, "the cache hands out its last free first");
        a.zero_for(&mut f, 260);
        assert_eq!(streamed(&ca), want(3), "a frame taken long before its free is streamed");
        // Freed into a's cache, taken by b (after a drain).
        a.free_owned(f);
        let mut got = Vec::new();
        while let Some(g) = b.alloc() {
            got.push(g);
        }
        let mut f = got.iter().position(|g| g.pfn() == pfn).map(|i| got.swap_remove(i)).expect("b got every frame");
        b.zero_for(&mut f, 300);
        assert_eq!(streamed(&cb), want(1), "a frame from a's cache has left b's");
        assert_eq!(streamed(&ca), want(3));
        got.push(f);
        for g in got {
            b.free_owned(g);
        }
        // The knob's other values: never (`cached`) and always (`streaming`).
        for (after, expect) in [(None, 0), (Some(0), 1)] {
            let mut phys = PhysMem::new(16, false, &rcu, cfg, false, false).unwrap();
            phys.set_stream_after(after);
            let c = crate::stats::CounterSet::new();
            let a = Frames::new(&phys, &rcu, &readers[0], &c);
            let mut f = a.alloc().unwrap();
            a.free_owned(f);
            f = a.alloc().unwrap();
            a.zero_for(&mut f, 0);
            assert_eq!(streamed(&c), want(expect), "stream after {after:?}");
            a.free_owned(f);
        }
    }

    #[test]
    fn frames_zeroed_ahead_hold_zeros_and_their_faults_skip_zeroing() {
        use crate::stats::{Counter, CounterSet};
        const AHEAD: usize = 3;
        let (rcu, readers) = Rcu::new(1);
        let cfg = PcpConfig { capacity: 8, fill: 8, drain: 8, max: 8 };
        // Where streaming stores do not exist (miri), nothing is zeroed ahead.
        let want = |n: u64| n * u64::from(arena::STREAMS);
        for (after, streams) in [(Some(0), true), (Some(2048), false), (None, false)] {
            let mut phys = PhysMem::new(32, false, &rcu, cfg, false, false).unwrap();
            phys.set_stream_after(after);
            phys.set_zero_ahead(AHEAD);
            let c = CounterSet::new();
            let a = Frames::new(&phys, &rcu, &readers[0], &c);
            // Eight frames holding garbage, freed into a's cache (taken
            // zeroed, so stamped as written: `Page::taken_at`).
            let mut got: Vec<OwnedFrame> = (0..8).map(|_| a.alloc_zeroed().unwrap()).collect();
            for f in &mut got {
                phys.owned_bytes(f).fill(0xa5);
            }
            for f in got.into_iter().rev() {
                a.free_owned(f);
            }
            // The first fault's frame: zeroed, and with streaming stores
            // (after 0: always) the next AHEAD frames of the cache too.
            let mut f = a.alloc().unwrap();
            a.zero_for(&mut f, 0x123);
            assert!(phys.owned_bytes(&mut f).iter().all(|&b| b == 0), "after {after:?}");
            let ahead = if streams { want(AHEAD as u64) } else { 0 };
            assert_eq!(c.get(Counter::zeroed_ahead), ahead, "after {after:?}");
            let mut held = vec![f];
            for i in 0..AHEAD as u64 + 1 {
                let mut g = a.alloc().unwrap();
                let pre = phys.holds_zeros(g.pfn());
                assert_eq!(pre, i < ahead, "frame {i} ahead, after {after:?}");
                let skipped = c.get(Counter::zeroings_skipped);
                a.zero_for(&mut g, 0x123);
                assert!(phys.owned_bytes(&mut g).iter().all(|&b| b == 0), "frame {i}, after {after:?}");
                assert_eq!(c.get(Counter::zeroings_skipped) - skipped, u64::from(pre), "frame {i}");
                held.push(g);
            }
            // The frame past the batch was zeroed itself and zeroed the
            // rest of the cache ahead (three frames left there).
            assert_eq!(c.get(Counter::zeroed_ahead), 2 * ahead, "after {after:?}");
            for f in held {
                a.free_owned(f);
            }
        }
    }

    #[test]
    fn an_idle_vcpus_deferred_frames_reach_the_global_list() {
        let (rcu, readers) = Rcu::new(2);
        let mut phys = PhysMem::new(32, false, &rcu, NO_PCP, false, false).unwrap();
        phys.set_deferred(2);
        let frames = Frames::global(&phys);
        let free = phys.global_free_frames();
        let pfns: Vec<Pfn> = (0..3).map(|_| phys.publish(frames.alloc().unwrap(), Kind::Data)).collect();
        // Freed by vCPU 0 while vCPU 1 is inside a section: onto list 0.
        let inside = rcu.read_lock(&readers[1]);
        phys.deferred.as_ref().unwrap().push(0, rcu.cookie(), &pfns);
        let mut last = vec![IdleMark::default(); 3];
        phys.flush_idle_deferred(&rcu, &mut last);
        assert_eq!(phys.deferred_frames(), 3, "first tick: the list just changed");
        phys.flush_idle_deferred(&rcu, &mut last);
        assert_eq!(phys.deferred_frames(), 3, "idle, but its grace period has not ended");
        drop(inside);
        phys.flush_idle_deferred(&rcu, &mut last);
        assert_eq!((phys.deferred_frames(), phys.global_free_frames()), (0, free), "idle and aged: freed");
    }

    #[test]
    fn a_busy_vcpus_deferred_frames_stay_on_its_list_and_its_values_go() {
        let (rcu, readers) = Rcu::new(2);
        let mut phys = PhysMem::new(32, false, &rcu, NO_PCP, false, false).unwrap();
        phys.set_deferred(2);
        let frames = Frames::global(&phys);
        let pfns: Vec<Pfn> = (0..3).map(|_| phys.publish(frames.alloc().unwrap(), Kind::Data)).collect();
        // A value to drop too (a retired snapshot, in production).
        struct Counted(std::sync::Arc<std::sync::atomic::AtomicUsize>);
        impl Drop for Counted {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let dropped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let d = phys.deferred.as_ref().unwrap();
        let inside = rcu.read_lock(&readers[1]);
        d.push(0, rcu.cookie(), &pfns);
        d.push_drops(
            0,
            [rcu.retire(
                std::sync::Arc::new(Counted(dropped.clone())) as std::sync::Arc<dyn std::any::Any + Send + Sync>
            )],
        );
        drop(inside);
        rcu.synchronize();
        let mut last = vec![IdleMark::default(); 3];
        phys.flush_idle_deferred(&rcu, &mut last);
        // Aged now, but vCPU 0 runs sections between the ticks (computing
        // between its frees): it takes its own frames back. Its values
        // are dropped all the same (it drops them only at its next change).
        for _ in 0..3 {
            drop(rcu.read_lock(&readers[0]));
            phys.flush_idle_deferred(&rcu, &mut last);
            assert_eq!(phys.deferred_frames(), 3, "the owner is busy: its list stays");
        }
        assert_eq!(dropped.load(Ordering::Relaxed), 1, "an unchanged list's aged values are dropped");
        phys.flush_idle_deferred(&rcu, &mut last);
        assert_eq!(phys.deferred_frames(), 0, "a tick without its sections: idle, and freed");
    }

    #[test]
    fn a_busy_vcpu_that_never_frees_again_gives_its_frames_up_after_a_while() {
        let (rcu, readers) = Rcu::new(2);
        let mut phys = PhysMem::new(32, false, &rcu, NO_PCP, false, false).unwrap();
        phys.set_deferred(2);
        let frames = Frames::global(&phys);
        let pfns: Vec<Pfn> = (0..3).map(|_| phys.publish(frames.alloc().unwrap(), Kind::Data)).collect();
        phys.deferred.as_ref().unwrap().push(0, rcu.cookie(), &pfns);
        rcu.synchronize();
        let mut last = vec![IdleMark::default(); 3];
        phys.flush_idle_deferred(&rcu, &mut last);
        // Its owner runs sections at every tick, and never misses or frees.
        for tick in 1..BUSY_TICKS {
            drop(rcu.read_lock(&readers[0]));
            phys.flush_idle_deferred(&rcu, &mut last);
            assert_eq!(phys.deferred_frames(), 3, "tick {tick}: still the busy owner's");
        }
        drop(rcu.read_lock(&readers[0]));
        phys.flush_idle_deferred(&rcu, &mut last);
        assert_eq!(phys.deferred_frames(), 0, "unchanged for {BUSY_TICKS} ticks: given up");
    }

    #[test]
    fn runs_out_cleanly() {
        let (rcu, _r) = Rcu::new(1);
        let phys = PhysMem::new(16, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let mut got = Vec::new();
        while let Some(f) = frames.alloc() {
            got.push(f);
        }
        assert_eq!(got.len(), 15);
        assert_eq!(phys.global_free_frames(), 0);
        for f in got {
            frames.free_owned(f);
        }
        assert_eq!(phys.global_free_frames(), 15);
    }

    #[test]
    fn caches_fill_drain_and_give_everything_back() {
        let (rcu, readers) = Rcu::new(2);
        let cfg = PcpConfig { capacity: 4, fill: 3, drain: 4, max: 4 };
        let phys = PhysMem::new(16, false, &rcu, cfg, false, false).unwrap();
        let counters = crate::stats::CounterSet::new();
        let a = Frames::new(&phys, &rcu, &readers[0], &counters);
        let b = Frames::new(&phys, &rcu, &readers[1], &counters);
        let f1 = a.alloc().unwrap();
        assert_eq!((phys.pcp_frames(), phys.global_free_frames(), phys.lock_acquisitions()), (2, 12, 1));
        let f2 = a.alloc().unwrap();
        assert_eq!(phys.lock_acquisitions(), 1, "a hit takes no lock");
        a.free_owned(f1);
        a.free_owned(f2);
        assert_eq!(phys.pcp_frames(), 3);
        // b takes everything left on the global list, then more: a's
        // cache is drained remotely to satisfy it.
        let mut got = Vec::new();
        while let Some(f) = b.alloc() {
            got.push(f);
        }
        assert_eq!(got.len(), 15, "every frame is usable from any vCPU");
        assert_eq!(phys.pcp_drain_stats(), (1, 3), "a's cache drained once, when the global list ran dry");
        for f in got {
            b.free_owned(f);
        }
        phys.drain_pcpu(&rcu);
        assert_eq!((phys.pcp_frames(), phys.global_free_frames()), (0, 15));
        // 17 frames handed out, plus three attempts that found nothing: one
        // before the drain, and the last call's two, before and after its
        // drain (which found nothing, but may have waited for another's).
        let (hit, miss) = (counters.get(crate::stats::Counter::pcp_hit), counters.get(crate::stats::Counter::pcp_miss));
        assert_eq!(hit + miss, 17 + 3);
    }
}
