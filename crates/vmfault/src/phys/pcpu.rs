//! Per-CPU page caches in front of the global free list (OpenBSD's
//! `uvm_pcpu_getpage`/`putpage`), drained remotely by RCU (Linux's remote
//! pcp drain RFC). The protocol is `sync::percpu`; this file decides what
//! goes in and out.
//!
//! - Allocation pops from the vCPU's magazine. On a miss, one global-lock
//!   acquisition takes `fill` frames (the seed's 15 of 16 by default,
//!   leaving room for one free).
//! - Freeing pushes onto the magazine. When it is full, one acquisition
//!   returns the `drain` oldest frames (all of them by default, as the
//!   seed does). Bulk frees after a TLB shootdown refill the magazine
//!   first and return the rest in one batch.
//! - When the global list runs dry, every magazine is drained (the
//!   allocating vCPU's too) and the allocation retried, so an allocation
//!   fails only when no frame is free anywhere. That needs a grace period,
//!   so it happens only outside read-side sections; inside one, running
//!   dry is ENOMEM.
//! - With `pcpu_high = auto` a free that finds the magazine full raises its
//!   high mark instead (a bulk free: to hold all of it), up to the vCPU's
//!   share of memory, unless the global list is below the free target;
//!   a drain puts the mark back. Freed frames are reused where they were
//!   freed, and cross the global list only when memory runs short.
//! - With `pcpu_pages = 0` there is no cache: allocation and freeing go
//!   straight to the global list, behind one predictable branch.
//!
//! Frames sitting in a magazine are `OWNED` (taken off the free list) and
//! count as free in the statistics.

use super::{Kind, OwnedFrame, Pfn, PhysMem, Retired, kind_counters};
use crate::stats::{Counter, CounterSet};
use crate::sync::atomic::Ordering;
use crate::sync::percpu::Magazine;
use crate::sync::rcu::{Rcu, RcuReadGuard, RcuReader};
use crate::types::PAGE_SIZE;

/// Sizes of the per-CPU caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PcpConfig {
    /// Frames per magazine (0: no caches).
    pub(crate) capacity: usize,
    /// Frames taken from the global list on a miss.
    pub(crate) fill: usize,
    /// Frames returned to the global list when a magazine is full.
    pub(crate) drain: usize,
    /// The most a magazine's high mark may grow to (`pcpu_high=auto`);
    /// `capacity` keeps it fixed.
    pub(crate) max: usize,
}

/// The calling vCPU's view of the allocator, for one operation.
pub(crate) struct Frames<'a> {
    phys: &'a PhysMem,
    cpu: Option<CpuFrames<'a>>,
}

struct CpuFrames<'a> {
    rcu: &'a Rcu,
    reader: &'a RcuReader,
    counters: &'a CounterSet,
}

impl<'a> Frames<'a> {
    /// Frames for the vCPU that owns `reader`.
    pub(crate) fn new(phys: &'a PhysMem, rcu: &'a Rcu, reader: &'a RcuReader, counters: &'a CounterSet) -> Self {
        Frames { phys, cpu: Some(CpuFrames { rcu, reader, counters }) }
    }

    /// Frames straight from the global list (no vCPU: set-up and tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn global(phys: &'a PhysMem) -> Self {
        Frames { phys, cpu: None }
    }

    /// The physical memory.
    pub(crate) fn phys(&self) -> &'a PhysMem {
        self.phys
    }

    /// One allocation attempt: the magazine, refilled on a miss; inside
    /// `section` if given (the calling vCPU's open section, which then
    /// covers the magazine's use: `PerCpuCache::local_in`).
    #[inline(always)]
    fn alloc_once(&self, section: Option<&RcuReadGuard<'_>>) -> Option<u32> {
        let phys = self.phys;
        let (Some(cpu), Some(pcp)) = (&self.cpu, &phys.pcp) else {
            return phys.free.take_one(&phys.pages);
        };
        // Frames taken off this vCPU's deferred list stay in transit until
        // `local` has published the magazine's new length (a drain reads it).
        let mut moving = None;
        let got = pcp.local_or_in(
            section,
            cpu.rcu,
            cpu.reader,
            // Inline where many callers share it (the fault path among
            // them): out of line, a call on every allocation.
            #[inline(always)]
            |m: &mut Magazine<u32>| match m.pop() {
                Some(p) => {
                    cpu.counters.inc(Counter::pcp_hit);
                    Some(p)
                }
                None => self.refill(cpu, m, &mut moving),
            },
        );
        drop(moving);
        got
    }

    /// A miss in this vCPU's magazine `m`: fill it and take a frame.
    /// `moving`: where frames taken back from the deferred list stay in
    /// transit until the caller has left `local`.
    #[cold]
    #[inline(never)]
    fn refill<'d>(
        &'d self,
        cpu: &CpuFrames<'_>,
        m: &mut Magazine<u32>,
        moving: &mut Option<super::deferred::InTransit<'d>>,
    ) -> Option<u32> {
        let phys = self.phys;
        cpu.counters.inc(Counter::pcp_miss);
        // free_path=deferred: this vCPU's own frees whose grace period
        // has ended come back here first (nothing crosses the global list).
        if let Some(d) = &phys.deferred {
            *moving = Some(self.take_back(m, d));
            if let Some(p) = m.pop() {
                return Some(p);
            }
        }
        // The stack's top (the most recently freed, warmest frame) must
        // come out first, as it would without the cache (handing the
        // batch out reversed cost page_fault1 13%): `take` yields the
        // warmest last, so it lands on top of the magazine.
        // A run larger than the cache (`pcpu_high=auto`): the high mark
        // grows to hold it if the global list keeps its free target after
        // it (else the usual fill: a run must not wake the daemon).
        let fill = match phys.pcp_config.fill {
            fill if fill <= m.capacity() => fill,
            fill if m.can_grow() && phys.free.free_frames() >= phys.free_target + fill as u64 => {
                m.grow(fill);
                fill.min(m.capacity())
            }
            _ => m.capacity().saturating_sub(1).max(1),
        };
        phys.free.take(&phys.pages, fill, m);
        // Frames on the deferred lists are free memory on its way back to
        // its vCPUs' caches (at their next miss, once their grace period
        // has ended): a list short only of those needs no drain of every
        // cache (a munmap's frames, waiting for the other vCPU's section
        // to end, rang it at every other page_fault1 cycle at 2 vCPUs).
        if phys.free.free_frames() < phys.free_target
            && phys.free.free_frames() + phys.deferred_frames() < phys.free_target
        {
            phys.doorbell.ring();
        }
        m.pop()
    }

    /// Allocate a frame; when no frame is free on the global list, drain
    /// every per-CPU cache and try again, then, with swap, wait for the
    /// page daemon (`reclaim`); neither inside a read-side section.
    #[inline(always)]
    pub(crate) fn alloc(&self) -> Option<OwnedFrame<'a>> {
        self.alloc_maybe_in(None)
    }

    /// [`alloc`](Frames::alloc) inside `section`, the calling vCPU's open
    /// read-side section (a fault's): its magazine is used under that
    /// section, with none of its own. The magazine and its refill only:
    /// what needs a grace period (a drain of other caches, a wait for the
    /// daemon) cannot run inside a section, so none is found then.
    #[inline(always)]
    pub(crate) fn alloc_in(&self, section: &RcuReadGuard<'_>) -> Option<OwnedFrame<'a>> {
        self.alloc_maybe_in(Some(section))
    }

    /// [`alloc`](Frames::alloc), inside `section` if given.
    #[inline(always)]
    fn alloc_maybe_in(&self, section: Option<&RcuReadGuard<'_>>) -> Option<OwnedFrame<'a>> {
        let f = match self.alloc_once(section) {
            Some(p) => OwnedFrame::new(self.phys, Pfn(p)),
            None => self.find_frame()?,
        };
        if let Some(cpu) = &self.cpu {
            cpu.counters.note_frame(u64::from(f.pfn().0));
        }
        Some(f)
    }

    /// [`alloc`](Frames::alloc) after a first attempt found nothing.
    #[cold]
    #[inline(never)]
    fn find_frame(&self) -> Option<OwnedFrame<'a>> {
        let cpu = self.cpu.as_ref().filter(|c| !c.reader.in_section())?;
        let mut placements = self.phys.deferred.as_ref().map_or(0, |d| d.placements());
        // Even a drain that found nothing may find frames a concurrent
        // drain (the daemon's) had taken out of the caches: it waited for it.
        self.phys.drain_pcpu(cpu.rcu);
        if let Some(p) = self.alloc_once(None) {
            return Some(OwnedFrame::new(self.phys, Pfn(p)));
        }
        // free_path=deferred: frames another thread has taken off a
        // deferred list and not yet placed (it may be preempted), or placed
        // while this drain looked elsewhere, are not gone: look again until
        // a whole drain saw none in flight.
        if let Some(d) = &self.phys.deferred {
            // So are retired snapshots another thread is dropping (each
            // drain drops the aged ones itself: `flush_deferred`).
            while d.dropping() > 0 || d.in_transit() > 0 || d.placements() != placements {
                placements = d.placements();
                std::thread::yield_now();
                self.phys.drain_pcpu(cpu.rcu);
                if let Some(p) = self.alloc_once(None) {
                    return Some(OwnedFrame::new(self.phys, Pfn(p)));
                }
            }
        }
        if !self.phys.doorbell.reclaims() {
            return None;
        }
        cpu.counters.inc(crate::stats::Counter::alloc_stalls);
        // What a pass frees may land in another vCPU's cache first (its
        // miss takes a batch): look there too before waiting again.
        let retry = || {
            self.alloc_once(None).or_else(|| {
                self.phys.drain_pcpu(cpu.rcu);
                self.alloc_once(None)
            })
        };
        self.phys.doorbell.wait_for(retry).map(|p| OwnedFrame::new(self.phys, Pfn(p)))
    }

    /// Put published data page `pfn`, marked for a queue before it was
    /// published (`PageQueues::mark`), on its queue: through this vCPU's
    /// batch (`phys::queues`). Nothing without queues.
    #[inline]
    pub(crate) fn enqueue(&self, pfn: Pfn) {
        if let (Some(q), Some(cpu)) = (&self.phys.queues, &self.cpu) {
            // The baseline (`refcount=pagelock`) changes queues under the
            // page's lock; nothing otherwise.
            let _lock = self.phys.page_lock(pfn, Some(cpu.counters));
            q.enqueue(&self.phys.pages, cpu.rcu, cpu.reader, pfn);
        }
    }

    /// Allocate a zeroed frame.
    pub(crate) fn alloc_zeroed(&self) -> Option<OwnedFrame<'a>> {
        let mut f = self.alloc()?;
        self.zero(&mut f);
        Some(f)
    }

    /// Zero an owned frame (`PhysMem::zero`), counting the zeroings a
    /// frame known to hold zeros spared.
    #[inline]
    pub(crate) fn zero(&self, f: &mut OwnedFrame) {
        self.note_taken(f);
        if !self.phys.zero(f)
            && let Some(cpu) = &self.cpu
        {
            cpu.counters.inc(Counter::zeroings_skipped);
        }
    }

    /// Copy published frame `src` into owned frame `f` (a copy on write),
    /// noting that this vCPU wrote it whole (`Page::taken_at`).
    #[inline]
    pub(crate) fn copy_into(&self, f: &mut OwnedFrame, src: Pfn) {
        self.note_taken(f);
        self.phys.copy_into(f, src);
    }

    /// Stamp `f`, which this vCPU has just taken and writes whole, with
    /// when it took it (`Page::taken_at`), where `zero_stores=auto` reads
    /// the stamps (`restamp`). Faults that zero their frame stamp it in
    /// [`zero_for`](Frames::zero_for).
    #[inline]
    fn note_taken(&self, f: &OwnedFrame) {
        if let (Some(_), Some(cpu), Some(_)) = (self.phys.stream_after(), &self.cpu, &self.phys.pcp) {
            self.phys.page(f.pfn()).taken_at.store(cache_stamp(cpu), Ordering::Relaxed);
        }
    }

    /// Zero the new frame of a fault at `addr` (`VmConfig::zero_stores`):
    /// with streaming stores but for the faulting line where the frame has
    /// left this vCPU's caches: it came from elsewhere, or this vCPU has
    /// allocated `stream_after` frames since it put it in its cache. A
    /// frame zeroed that way first zeroes up to `zero_ahead` of the frames
    /// its cache will hand out next ([`zero_ahead`](Frames::zero_ahead)).
    /// Counts what it skipped or streamed.
    #[inline(always)]
    pub(crate) fn zero_for(&self, f: &mut OwnedFrame, addr: u64) {
        let keep = match (self.phys.stream_after(), &self.cpu, &self.phys.pcp) {
            (Some(after), Some(cpu), Some(_)) if super::arena::STREAMS => {
                // Whether the frame left the caches, and the stamp of its
                // taking (`restamp`), from one stamp.
                let page = self.phys.page(f.pfn());
                let now = cache_stamp(cpu);
                page.taken_at.store(now, Ordering::Relaxed);
                stamp_left(page.cached_at.load(Ordering::Relaxed), now, after).then_some((addr % PAGE_SIZE) as usize)
            }
            _ => None,
        };
        let wrote = match keep {
            // Its own frame first, unfenced (it is this fault's alone), then
            // the frames ahead and one fence for them all, inside the
            // magazine's section (`zero_ahead`).
            Some(keep) if self.phys.zero_ahead() > 0 && !self.phys.holds_zeros(f.pfn()) => {
                self.phys.stream_zero_unfenced(f, keep);
                self.zero_ahead(keep);
                true
            }
            // Fenced before it returns where it streams.
            _ => self.phys.zero_with(f, keep),
        };
        if let Some(cpu) = &self.cpu {
            match (wrote, keep) {
                (false, _) => cpu.counters.inc(Counter::zeroings_skipped),
                (true, Some(_)) => cpu.counters.inc(Counter::zeroings_streamed),
                (true, None) => {}
            }
        }
    }

    /// Zero, with streaming stores but for the line at byte `keep`, the
    /// next `zero_ahead` frames this vCPU's cache will hand out that have
    /// left its caches and hold no zeros yet, and mark them as holding
    /// zeros: their faults skip their zeroing. Then fence, inside the
    /// magazine's section: that fence also orders the streaming stores the
    /// caller made before (its own frame's, `zero_for`).
    ///
    /// Why: a fault that streams a frame's zeros then waits, at its next
    /// locked instruction (the PTE lock), until those stores have reached
    /// memory. Per frame that wait was about a third of a page_fault1
    /// fault's time on the project's machine; one wait per batch of frames
    /// spreads it over the batch (README, `zero_ahead`).
    ///
    /// Why it is safe: the frames are zeroed where they lie, free in this
    /// vCPU's own magazine inside its read-side section, so nobody else
    /// reads or writes them: a drain swaps the magazine out and waits for a
    /// grace period before it takes them, and that grace period waits for
    /// this section. The fence comes before the section ends: the end is a
    /// Release store, which streaming stores do not respect, so without the
    /// fence a drain could hand a frame to another vCPU whose own writes
    /// the zeros still on their way to memory would then overwrite. A frame
    /// zeroed ahead and then taken by another vCPU, or for a copy or a page
    /// table, was zeroed for nothing or skips its zeroing there: never
    /// wrong (its flag is cleared by any other write).
    #[inline(never)]
    fn zero_ahead(&self, keep: usize) {
        let (Some(cpu), Some(pcp), Some(after)) = (&self.cpu, &self.phys.pcp, self.phys.stream_after()) else {
            return super::arena::stream_fence();
        };
        let (phys, n) = (self.phys, self.phys.zero_ahead());
        let zeroed = pcp.local(cpu.rcu, cpu.reader, |m| phys.zero_ahead_in(m, n, keep, |p| self.left_caches(p, after)));
        cpu.counters.add(Counter::zeroed_ahead, zeroed);
    }

    /// Whether frame `pfn` has left this vCPU's caches, as far as its
    /// `cached_at` stamp tells: it was put in another vCPU's cache (or
    /// none), or this vCPU has allocated `after` frames since it put it in
    /// its own. Without a vCPU, or without caches (nothing is stamped): no.
    #[inline(always)]
    fn left_caches(&self, pfn: Pfn, after: u32) -> bool {
        let (Some(cpu), Some(_)) = (&self.cpu, &self.phys.pcp) else { return false };
        stamp_left(self.phys.page(pfn).cached_at.load(Ordering::Relaxed), cache_stamp(cpu), after)
    }

    /// Count `n` events `c` on this vCPU (on the shared set without one).
    #[inline]
    fn count(&self, c: Counter, n: u64) {
        self.phys.count(self.cpu.as_ref().map(|cpu| cpu.counters), c, n);
    }

    /// Publish owned frame `f` as `kind` (`PhysMem::publish`), counted.
    #[inline]
    pub(crate) fn publish(&self, f: OwnedFrame<'a>, kind: Kind) -> Pfn {
        let pfn = self.phys.publish(f, kind);
        self.count(kind_counters(kind).0, 1);
        pfn
    }

    /// Publish owned frame `f` as `kind` by a compare-exchange of `slot`
    /// (`PhysMem::publish_into`), counted if it became visible; `describe`
    /// fills its descriptor first (a failed publication clears it again).
    #[inline(always)]
    pub(crate) fn publish_into(
        &self,
        f: OwnedFrame<'a>,
        kind: Kind,
        slot: &std::sync::atomic::AtomicU64,
        current: u64,
        word: u64,
        describe: impl FnOnce(&super::Page),
    ) -> std::result::Result<Pfn, (OwnedFrame<'a>, u64)> {
        let r = self.phys.publish_into(f, kind, slot, current, word, describe);
        if r.is_ok() {
            self.count(kind_counters(kind).0, 1);
        }
        r
    }

    /// Free a frame nobody else can reach (never published, or taken back).
    pub(crate) fn free_owned(&self, f: OwnedFrame) {
        let phys = self.phys;
        let (Some(cpu), Some(pcp)) = (&self.cpu, &phys.pcp) else {
            // Dropped, it goes to the global list.
            return drop(f);
        };
        let pfn = f.into_pfn();
        restamp(phys.page(pfn), cache_stamp(cpu), phys.stream_after());
        pcp.local(cpu.rcu, cpu.reader, |m| {
            if let Err(p) = m.push(pfn.0) {
                if m.can_grow() && !phys.short_of_frames() {
                    // pcpu_high=auto: the vCPU frees more than it keeps.
                    m.grow(2 * m.capacity());
                    let _ = m.push(p);
                    return;
                }
                let n = phys.pcp_config.drain.min(m.len());
                phys.free.give(&phys.pages, m.take_oldest(n));
                let _ = m.push(p);
            }
        });
    }

    /// Free published frames that have been unlinked everywhere: after a
    /// grace period (rule 3 of the frame protocol), refill this vCPU's
    /// magazine with the first ones and return the rest to the global list
    /// in one batch. A polled grace period (`Rcu::poll`) that completes at
    /// once (no other vCPU inside a section) frees them with no wait;
    /// otherwise `free_path=sync` waits for one, and `free_path=deferred`
    /// queues them on this vCPU's deferred list, where the grace period
    /// this poll started ages them (a later poll, at this vCPU's next
    /// cache miss or free, completes it).
    pub(crate) fn free_after_grace(&self, frames: &[Pfn]) {
        self.free_after(frames, true);
    }

    /// [`Frames::free_after_grace`] for a caller whose own look at the
    /// readers (`Rcu::quiet`, after every unlink of these frames) has just
    /// found one inside a section: no second look, and no poll of its own
    /// with `free_path=deferred` (the one `take_back` makes, at this call
    /// or this vCPU's next, starts the grace period that ages them). Each
    /// look reads every other vCPU's RCU counter, a line its owner writes
    /// at every section, and each poll writes lines every vCPU's polls
    /// write: at 16 vCPUs, a munmap's second look and its extra polls
    /// were the largest part of vmlocal's cost beyond one vCPU's.
    pub(crate) fn free_after_busy_look(&self, frames: &[Pfn]) {
        self.free_after(frames, false);
    }

    /// Free published frames after a grace period; `look`: whether to look
    /// at the readers and poll first (else the caller found one inside a
    /// section).
    fn free_after(&self, frames: &[Pfn], look: bool) {
        let phys = self.phys;
        let cpu = self.cpu.as_ref().expect("freeing published frames needs a vCPU's RCU reader");
        let Some(pcp) = &phys.pcp else {
            return phys.free_after_grace(cpu.rcu, frames);
        };
        if frames.is_empty() {
            return;
        }
        let cookie = cpu.rcu.cookie();
        // No reader inside a section: aged now, learnt with no shared
        // write; else a polled grace period (with `free_path=deferred`,
        // only if the caller did not just look).
        let deferred = phys.deferred.as_ref();
        let aged = (look || deferred.is_none()) && (cpu.rcu.quiescent() || cpu.rcu.poll(cookie));
        if let Some(d) = deferred {
            // free_path=deferred: no wait here. What this vCPU queued
            // before and has aged since comes back first.
            let moving = pcp.local(cpu.rcu, cpu.reader, |m| self.take_back(m, d));
            drop(moving);
            // (`take_back` polled too, and may have completed it.)
            if !aged && !cpu.rcu.elapsed(cookie) {
                d.push(cpu.reader.index(), cookie, frames);
                return;
            }
        } else if !aged {
            cpu.rcu.synchronize();
        }
        self.free_aged(frames);
    }

    /// Free published frames whose grace period has already ended (the
    /// caller knows: every way a reader could reach them was unlinked
    /// before a grace period it saw end), through this vCPU's cache like
    /// [`Frames::free_after_grace`], but with no wait.
    pub(crate) fn free_aged(&self, frames: &[Pfn]) {
        let phys = self.phys;
        if frames.is_empty() {
            return;
        }
        match (&self.cpu, &phys.pcp) {
            // One section for the split and the fill: a remote drain between
            // them would swap in a magazine with less room.
            (Some(cpu), Some(pcp)) => pcp.local(cpu.rcu, cpu.reader, |m| self.stash(m, frames)),
            _ => phys.give_aged(frames),
        }
    }

    /// Take this vCPU's aged deferred batches back into its magazine `m`
    /// (inside its `local` call). The frames stay in transit until the
    /// guard returned is dropped, after `local` has published the
    /// magazine's length (a drain reads it).
    fn take_back<'d>(&self, m: &mut Magazine<u32>, d: &'d super::deferred::Deferred) -> super::deferred::InTransit<'d> {
        let cpu = self.cpu.as_ref().expect("a vCPU's own deferred list");
        let mut aged = crate::sync::scratch::Scratch::take(&TAKEN_BACK);
        let moving = d.take_aged(cpu.reader.index(), cpu.rcu, &mut aged);
        if !aged.is_empty() {
            self.stash(m, &aged);
        }
        moving
    }

    /// Put `frames`, past their grace period, into magazine `m` (the
    /// calling vCPU's, inside its `local` call), raising its high mark if
    /// `pcpu_high=auto` and memory allows; the rest to the global list.
    /// The frames freed last were used last and are the warmest: they go
    /// into the magazine (the very last on top); the colder rest goes to
    /// the global list first, so its head is the next warmest.
    fn stash(&self, m: &mut Magazine<u32>, frames: &[Pfn]) {
        let phys = self.phys;
        phys.leave_queues(frames);
        let frames = phys.in_free_order(frames);
        let frames = &frames[..];
        if m.can_grow() && !phys.short_of_frames() {
            m.grow(m.len() + frames.len());
        }
        let room = m.room().min(frames.len());
        let (cold, warm) = frames.split_at(frames.len() - room);
        // Only when something overflows: the global lock is shared by
        // every vCPU (an empty give took it twice per vmlocal loop).
        let mut freed = Retired::default();
        if !cold.is_empty() {
            phys.free.give(&phys.pages, cold.iter().map(|&p| phys.retire(p, &mut freed)));
        }
        let stamp = self.cpu.as_ref().map_or(0, cache_stamp);
        let after = phys.stream_after();
        m.extend(warm.iter().map(|&p| {
            restamp(phys.page(p), stamp, after);
            phys.retire(p, &mut freed)
        }));
        freed.count(|c, n| self.count(c, n));
    }
}

thread_local! {
    /// `[T]` the buffer of the aged deferred frames a vCPU takes back.
    static TAKEN_BACK: std::cell::Cell<Vec<Pfn>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Bits of a `cached_at` stamp that count the vCPU's frame allocations;
/// the bits above name the vCPU's slot plus one (`VmConfig::cpus` is at
/// most 1,024, so the slot fits; were it larger, two slots sharing a name
/// would only make a frame look warm to the wrong vCPU: a zeroing with
/// ordinary stores, never a wrong result).
const STAMP_BITS: u32 = 21;
const STAMP_MASK: u32 = (1 << STAMP_BITS) - 1;

/// The `cached_at` stamp of a frame this vCPU puts in its cache now
/// (`Page::cached_at`). The count wraps every 2^21 allocations (8 GiB): a
/// frame cached exactly that long ago is taken for a warm one, and zeroed
/// with ordinary stores, as without the stamp.
#[inline]
fn cache_stamp(cpu: &CpuFrames<'_>) -> u32 {
    let slot = (cpu.reader.index() as u32).wrapping_add(1);
    (slot << STAMP_BITS) | (cpu.counters.get(Counter::frame_allocs) as u32 & STAMP_MASK)
}

/// Whether a frame stamped `then` has left the caches of the vCPU whose
/// stamp is `now`: another vCPU stamped it (or none), or this one has
/// allocated `after` frames since.
#[inline(always)]
fn stamp_left(then: u32, now: u32, after: u32) -> bool {
    then >> STAMP_BITS != now >> STAMP_BITS || now.wrapping_sub(then) & STAMP_MASK >= after
}

/// Stamp `page`, which this vCPU (stamp `now`) puts in its cache, as
/// cached now if its lines may still be in the vCPU's caches: this vCPU
/// took it and wrote it whole less than `after` of its allocations ago
/// (`Page::taken_at`); else as never cached. A frame taken and written
/// long ago and freed now (a page_fault1 munmap frees 32,768 frames and
/// reads no line of them) has left the caches, and its next fault
/// streams its zeros.
#[inline(always)]
fn restamp(page: &super::Page, now: u32, after: Option<u32>) {
    let lately = after.is_none_or(|a| !stamp_left(page.taken_at.load(Ordering::Relaxed), now, a));
    page.cached_at.store(if lately { now } else { 0 }, Ordering::Relaxed);
}
