//! Address spaces (`vm_map` + `pmap`): a set of VMAs and a page table.
//!
//! One file per operation: [`mmap`](mmap.rs), [`munmap`](munmap.rs),
//! [`mprotect`](mprotect.rs), [`madvise`](madvise.rs), and the software MMU
//! ([`access`](access.rs): `read`, `write`, `touch`). Placement of mappings
//! is in `layout.rs`, the VMA index in `vma.rs` (over the persistent tree
//! of `ptree.rs`).
//!
//! # Locking
//! - The *map lock* (`[M]`, a reader-writer lock around the VMA index) is
//!   held for reading by the classic fault path for the whole fault, and
//!   for writing by every operation that changes VMAs or tears pages down.
//! - PTEs change under the PTE lock of their page-table page (`[P]`).
//! - Frames that were mapped are freed only after the map lock is dropped
//!   and a grace period has passed (the TLB shootdown), see `phys`.
//!
//! # Semantics
//! Linux x86-64 is the oracle, down to the order in which arguments are
//! checked; the differential test in `tests/differential.rs` runs random
//! operation sequences here and on the host kernel and compares every
//! result, every byte read and the `/proc/self/maps` layout. The one
//! deliberate difference: unknown `PROT_*`/`MAP_*` bits are `EINVAL` here,
//! where Linux silently ignores them in `mmap`.

mod access;
mod file;
mod fork;
mod hold;
mod layout;
mod madvise;
mod mlock;
mod mmap;
mod mprotect;
mod munmap;
mod ptree;
mod rmap;
pub(crate) use rmap::unmap_everywhere_unlocked;
pub(crate) mod vma;

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::config::FaultPath;
use crate::error::{Error, Op, Result};
use crate::phys::Pfn;
use crate::pmap::Pmap;
use crate::stats::Counter;
use crate::sync::rank::{self, Rank, Ranked};
use crate::sync::rcu::{RcuArc, RcuReadGuard, Retired};
use crate::types::MappingInfo;
use crate::vm::{Ctx, Vm};
pub use hold::PageHold;
use vma::{Snapshot, SnapshotNode, SnapshotRef, Vma, VmaFlags, VmaTree};

/// Retired snapshots that make an operation wait for a grace period.
const SNAPSHOT_BACKLOG: usize = 32;

/// Retired snapshots below which an operation does not look for any to
/// free (looking costs more than the few versions it would free).
const RECLAIM_BATCH: usize = 8;

/// Linux's default `vm.max_map_count`.
pub const MAX_MAP_COUNT: usize = 65530;

/// An address space: a handle (`Clone` shares the space, `Send + Sync`).
///
/// ```
/// use vmfault::{Vm, VmConfig, Prot, MapFlags, Advice, Error, SegvCode};
/// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
/// let space = vm.new_space()?;
/// let rw = Prot::READ | Prot::WRITE;
/// let a = space.mmap(0, 4 << 12, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
/// space.write(a, b"data")?;
/// space.mprotect(a, 4096, Prot::READ)?;
/// assert_eq!(space.write(a, b"x"), Err(Error::Segv { addr: a, code: SegvCode::AccErr }));
/// space.madvise(a, 4 << 12, Advice::DontNeed)?;
/// let mut buf = [9u8; 4];
/// space.read(a, &mut buf)?;
/// assert_eq!(buf, [0; 4]); // private anonymous memory reads back as zeros
/// space.munmap(a, 4 << 12)?;
/// assert!(space.mappings().is_empty());
/// # Ok::<(), vmfault::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct AddressSpace {
    pub(crate) s: Arc<Space>,
    /// The user's handle on the machine (the space itself holds only a
    /// `Handle`, see there).
    pub(crate) vm: Vm,
}

/// The shared state behind [`AddressSpace`] handles.
#[derive(Debug)]
pub(crate) struct Space {
    /// `[I]` the machine.
    pub(crate) vm: crate::vm::Handle,
    /// `[M]` the map lock and the VMA index it protects.
    map: RwLock<VmaTree>,
    /// The page table (entries `[P]`, see `pmap`).
    pub(crate) pmap: Pmap,
    /// `[L]` serializes the creation of private anonymous objects (Linux takes
    /// `page_table_lock` in `anon_vma_prepare`). Inner to the map lock.
    anon_lock: Mutex<()>,
    /// `[a]` the VMA index as lockless faults see it (RCU: read inside a
    /// section; replaced under the map write lock after every change).
    snapshot: RcuArc<SnapshotNode>,
    /// `[L]` replaced snapshots waiting for a grace period (inner to the map lock).
    retired: Mutex<Vec<Retired<Snapshot>>>,
    /// `[I]` whether faults look VMAs up without the map lock (so snapshots
    /// must be published).
    lockless: bool,
}

/// The map lock held for writing. Any mutable use of the index marks it
/// changed; dropping the guard then publishes a new snapshot for lockless
/// faults (before the lock is released).
///
/// Its `carve` and `renew` wrap the index's `*_no_wait` ones: after retiring the VMAs
/// they replace, they wait for the per-VMA read-lockers still inside them
/// (`sync::vma_state`), because their callers go on to change the PTEs
/// those VMAs mapped. Merges need no wait: they change no PTE.
pub(crate) struct MapWrite<'a> {
    space: &'a Space,
    guard: Ranked<RwLockWriteGuard<'a, VmaTree>>,
    changed: bool,
}

impl Deref for MapWrite<'_> {
    type Target = VmaTree;
    fn deref(&self) -> &VmaTree {
        &self.guard
    }
}

impl DerefMut for MapWrite<'_> {
    fn deref_mut(&mut self) -> &mut VmaTree {
        self.changed = true;
        &mut self.guard
    }
}

/// The map lock held, for reading or for writing: a function whose
/// precondition is "the map lock is held" takes the guard (`&impl
/// MapHeld`), so the precondition is a type; one that needs it held for
/// writing takes `&MapWrite`.
pub(crate) trait MapHeld: Deref<Target = VmaTree> {}

impl MapHeld for MapWrite<'_> {}

impl MapHeld for Ranked<RwLockReadGuard<'_, VmaTree>> {}

impl MapWrite<'_> {
    /// [`VmaTree::carve_no_wait`], then wait for the read-lockers of the VMAs it
    /// removed or split.
    pub(crate) fn carve(&mut self, start: u64, end: u64) -> Vec<Arc<Vma>> {
        let span = self.span(start, end);
        let carved = self.deref_mut().carve_no_wait(start, end);
        self.wait_readers(span);
        carved
    }

    /// [`VmaTree::renew_no_wait`], then wait for the read-lockers of the VMAs it
    /// replaced.
    pub(crate) fn renew(&mut self, start: u64, end: u64) -> Vec<Arc<Vma>> {
        let span = self.span(start, end);
        let renewed = self.deref_mut().renew_no_wait(start, end);
        self.wait_readers(span);
        renewed
    }

    /// The union of `start..end` and the VMAs overlapping it (what a carve
    /// or renew of the range retires), if there are any.
    fn span(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        // Lookups, not an iteration: this runs on every munmap.
        let map = &*self.guard;
        map.find_from(start).filter(|v| v.start < end)?;
        let lo = map.find(start).map_or(start, |v| v.start);
        let hi = map.find(end - 1).map_or(end, |v| v.end);
        Some((lo, hi))
    }

    /// The TLB shootdown for `narrowed` PTEs this operation narrowed (write
    /// rights taken away): a grace period, waited for with the lock held,
    /// as Linux flushes the TLB before `mmap_write_unlock`. Until it ends a
    /// vCPU that found a PTE writable may still be storing through it; a
    /// fault that copied the frame meanwhile (copy-on-write after `fork`)
    /// would replace the page and lose the store. Every path's copy waits
    /// for this lock: the classic one reads it, the lockless ones find the
    /// new VMAs only in the snapshot published when it drops (their faults
    /// on the retired VMAs abort).
    pub(crate) fn shootdown(&self, ctx: &Ctx<'_>, narrowed: u64) {
        if narrowed > 0 {
            ctx.count(Counter::tlb_shootdowns);
            self.space.vm.m.rcu.grace_period();
        }
    }

    /// Wait for faults holding the read lock of a VMA retired in `span`.
    fn wait_readers(&self, span: Option<(u64, u64)>) {
        if let Some((start, end)) = span
            && self.space.vm.m.config.fault_path == FaultPath::VmaLock
        {
            self.space.vm.m.rcu.wait_unpinned(start, end);
        }
    }
}

impl Drop for MapWrite<'_> {
    fn drop(&mut self) {
        let s = self.space;
        // Every PTE this operation cleared or narrowed is done, every new
        // VMA linked: the old records can go.
        self.guard.flush_unlinks();
        if self.changed && s.lockless {
            let old = s.snapshot.replace(&s.vm.m.rcu, self.guard.snapshot());
            rank::lock(&s.retired, Rank::Leaf).push(old);
        }
    }
}

impl AddressSpace {
    pub(crate) fn new(vm: Vm) -> Result<AddressSpace> {
        let pmap = vm
            .with_ctx(|ctx| Pmap::new(&ctx.frames()))
            .map_err(|_| Error::NoMemory { op: Op::NewSpace, what: "a page-table root" })?;
        let lockless = vm.m.config.fault_path != FaultPath::MapLock;
        let backing = vm.m.config.rmap == crate::config::Rmap::Backing;
        let s = Arc::new_cyclic(|me: &std::sync::Weak<Space>| {
            let owner = backing.then(|| vma::Owner { space: me.clone(), id: me.as_ptr().addr() as u64 });
            Space {
                vm: vm.handle(),
                map: RwLock::new(VmaTree::recorded(owner)),
                pmap,
                anon_lock: Mutex::new(()),
                snapshot: RcuArc::new(None),
                retired: Mutex::new(Vec::new()),
                lockless,
            }
        });
        rank::lock(&vm.m.spaces, Rank::Leaf).insert(s.id(), Arc::downgrade(&s));
        Ok(AddressSpace { s, vm })
    }

    /// The machine this space belongs to.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The mappings, in address order, as `/proc/self/maps` lists them.
    pub fn mappings(&self) -> Vec<MappingInfo> {
        self.s.vm.with_ctx(|ctx| self.s.map_read(ctx).infos())
    }

    /// Page-table pages this space uses (the root included).
    pub fn page_table_pages(&self) -> u64 {
        self.s.pmap.tables()
    }

    /// Whether two handles are the same space.
    pub fn same_space(&self, other: &AddressSpace) -> bool {
        Arc::ptr_eq(&self.s, &other.s)
    }
}

impl Space {
    /// This space's id: its address (unique while it lives), which names
    /// it in reverse-map records and pv entries.
    #[inline]
    pub(crate) fn id(&self) -> u64 {
        std::ptr::from_ref(self).addr() as u64
    }

    /// Take the map lock for reading (counted).
    pub(crate) fn map_read(&self, ctx: &Ctx<'_>) -> Ranked<RwLockReadGuard<'_, VmaTree>> {
        ctx.count(Counter::map_lock_acquisitions);
        self.map_read_uncounted()
    }

    /// Take the map lock for reading, not counted (statistics, and
    /// callers without a vCPU).
    pub(crate) fn map_read_uncounted(&self) -> Ranked<RwLockReadGuard<'_, VmaTree>> {
        Ranked::take(Rank::Map, || self.map.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// Take the map lock of a space nobody else can reach yet (the child
    /// of a `fork`, under its parent's), for writing (counted).
    pub(crate) fn map_write_unreachable(&self, ctx: &Ctx<'_>) -> MapWrite<'_> {
        ctx.count(Counter::map_lock_acquisitions);
        ctx.count(Counter::map_lock_writes);
        let guard = Ranked::take_unreachable(Rank::Map, || self.map.write().unwrap_or_else(|p| p.into_inner()));
        MapWrite { space: self, guard, changed: false }
    }

    /// Take the map lock for writing (counted).
    pub(crate) fn map_write(&self, ctx: &Ctx<'_>) -> MapWrite<'_> {
        ctx.count(Counter::map_lock_acquisitions);
        ctx.count(Counter::map_lock_writes);
        let guard = Ranked::take(Rank::Map, || self.map.write().unwrap_or_else(|p| p.into_inner()));
        MapWrite { space: self, guard, changed: false }
    }

    /// The VMA index as lockless faults see it, for the section's length.
    #[inline]
    pub(crate) fn snapshot<'a>(&'a self, section: &'a RcuReadGuard<'_>) -> SnapshotRef<'a> {
        SnapshotRef(self.snapshot.read(section))
    }

    /// Take the anon lock (see the field).
    pub(crate) fn anon_lock(&self) -> Ranked<MutexGuard<'_, ()>> {
        rank::lock(&self.anon_lock, Rank::Anon)
    }

    /// Finish an operation that changed the address space, with no lock
    /// held. If it cleared or narrowed `ptes` PTEs or unlinked `frames`,
    /// a grace period (the TLB shootdown) must pass before the call
    /// returns, so that no access through an old PTE is still in flight,
    /// and before the frames are freed. One is polled first (`Rcu::poll`),
    /// which completes with no wait when no other vCPU is inside a
    /// section; otherwise the call waits for one, or, with
    /// `free_path=deferred`, queues the frames on this vCPU's deferred
    /// list and waits for nothing. Then it frees the snapshots whose grace
    /// period has passed (polling for one that ages them all); with
    /// `objects_gone` (it removed VMAs that held objects, which the old
    /// snapshots keep alive), or too many pending, and a poll that does not
    /// complete, it waits for one (with `free_path=deferred`, queues them on
    /// this vCPU's deferred list instead, dropped at its next change once
    /// aged: no wait).
    pub(crate) fn finish(&self, ctx: &Ctx<'_>, ptes: u64, frames: &[Pfn], objects_gone: bool) {
        let orphans = ctx.m.take_orphans();
        let frames = if orphans.is_empty() { frames } else { &[frames, &orphans[..]].concat() };
        let shared = ctx.take_shared_zaps();
        if self.vm.m.phys.deferred.is_some() {
            // free_path=deferred: the frames are reused only after their
            // grace period, so a store still in flight through a cleared
            // private PTE lands in a page nobody can see or reuse before it
            // ends (narrowed PTEs had their shootdown under the map lock).
            // Pages of shared mappings live on where others see them: for
            // those the operation still waits, as Linux's TLB flush does.
            if shared > 0 {
                ctx.count(Counter::tlb_shootdowns);
                self.vm.m.rcu.grace_period();
            }
            ctx.frames().free_after_grace(frames);
        } else if ptes > 0 || !frames.is_empty() {
            ctx.count(Counter::tlb_shootdowns);
            if frames.is_empty() {
                self.vm.m.rcu.grace_period();
            } else {
                ctx.frames().free_after_grace(frames);
            }
        }
        let rcu = &self.vm.m.rcu;
        if let Some(d) = &self.vm.m.phys.deferred {
            // What this vCPU queued before and has aged since (no wait).
            d.drop_aged_of(ctx.index.min(d.unowned()), rcu, false);
        }
        let mut retired = rank::lock(&self.retired, Rank::Leaf);
        if retired.is_empty() || (retired.len() < RECLAIM_BATCH && !objects_gone) {
            return;
        }
        // A polled grace period (no wait): with no other vCPU inside a
        // section, everything retired so far ages at once, and the objects
        // of removed mappings end with no wait either.
        let all_aged = rcu.poll(retired[retired.len() - 1].cookie());
        if all_aged || (!objects_gone && retired.len() <= SNAPSHOT_BACKLOG) {
            // Free what has aged past a grace period, without waiting (and
            // outside the lock: dropping a version frees its unshared nodes).
            // The list is in retirement order but for the rare re-appended
            // tail, so if the oldest has not aged, nothing has.
            if !rcu.elapsed(retired[0].cookie()) {
                return;
            }
            let done = rcu.reclaim(&mut retired, false);
            drop(retired);
            self.drop_aged(ctx, done);
            return;
        }
        let mut list = std::mem::take(&mut *retired);
        drop(retired);
        if let Some(d) = &self.vm.m.phys.deferred {
            // free_path=deferred: instead of waiting, queue them (and the
            // objects of removed mappings they keep alive) for a grace
            // period that the grace-period thread runs; this vCPU's next
            // change drops them, or an allocation that finds nothing
            // (`phys::deferred`).
            let boxed = list.into_iter().map(|r| r.map(|s| Box::new(s) as Box<dyn Send>)).collect();
            d.push_drops(ctx.index.min(d.unowned()), boxed);
            return;
        }
        // Wait for a grace period, without the lock (writers push to it
        // while holding the map lock).
        let done = rcu.reclaim(&mut list, true);
        if !list.is_empty() {
            rank::lock(&self.retired, Rank::Leaf).append(&mut list);
        }
        self.drop_aged(ctx, done);
    }

    /// Drop `done`: snapshots `Rcu::reclaim` gave back, or removed VMAs
    /// past a grace period (`drop_removed`). The objects whose last
    /// reference they held end here, and their frames (index nodes, pages
    /// left) were unreachable to readers before that grace period ended,
    /// so they go to this vCPU's cache with no wait of their own and no
    /// global lock (`object::dropping_aged`).
    fn drop_aged<T>(&self, ctx: &Ctx<'_>, done: T) {
        let freed = crate::object::dropping_aged(|| drop(done));
        ctx.frames().free_aged(&freed);
    }

    /// Drop the VMAs a change removed (their objects may end here), after
    /// its `finish`. `unlinked`: a cookie taken once every unlink of the
    /// change was done (the VMAs retired from the index and the snapshot
    /// that named them, their PTEs zapped). If a grace period has passed
    /// since (the change's shootdown, or its wait for the snapshots; else
    /// one polled here, if an object may end), the objects' frames go to
    /// this vCPU's cache at once, as in `drop_aged`; else each object frees
    /// its own after a grace period.
    pub(crate) fn drop_removed(&self, ctx: &Ctx<'_>, removed: Vec<Arc<Vma>>, unlinked: crate::sync::rcu::GpCookie) {
        let ends = || removed.iter().any(|v| v.object.get().is_some());
        if ctx.m.rcu.elapsed(unlinked) || (ends() && ctx.m.rcu.poll(unlinked)) {
            self.drop_aged(ctx, removed);
        } else {
            drop(removed);
        }
    }
}

/// A PTE of space `id` at `addr` that mapped `old` was cleared: drop its
/// pv entry (`rmap=pv`) and the wiring it held (an `mlock`ed mapping).
/// Called under the PTE lock, from zap callbacks. A page whose last
/// reference that was (it left its object while wired) goes on the
/// machine's orphan list, freed by the operation's `finish`.
pub(crate) fn pte_cleared(m: &crate::vm::Machine, id: u64, addr: u64, old: crate::pmap::Pte) {
    if m.config.rmap == crate::config::Rmap::PvEntry && old.pfn() != m.phys.zero_pfn() {
        m.pv.remove(old.pfn(), crate::object::Pv { space: id, addr });
    }
    if old.is_wired() && m.phys.unwire(old.pfn(), None) {
        m.orphan(old.pfn());
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        // No handle is left, so nobody can be faulting or walking: drop the
        // VMAs (their objects free their pages) and the page table.
        let id = self.id();
        rank::lock(&self.vm.m.spaces, Rank::Leaf).remove(&id);
        let locked =
            self.map.get_mut().unwrap_or_else(|p| p.into_inner()).iter().any(|v| v.flags.contains(VmaFlags::LOCKED));
        let m = &self.vm.m;
        if m.config.rmap == crate::config::Rmap::PvEntry || locked {
            self.pmap.zap(&m.phys, 0, crate::types::TASK_SIZE, |addr, pte| pte_cleared(m, id, addr, pte));
        }
        let vmas = self.map.get_mut().unwrap_or_else(|p| p.into_inner()).take_all();
        file::write_back_at_exit(&self.vm.m, &vmas);
        drop(vmas);
        let mut retired = std::mem::take(self.retired.get_mut().unwrap_or_else(|p| p.into_inner()));
        drop(self.vm.m.rcu.reclaim(&mut retired, true));
        let mut frames = self.vm.m.take_orphans();
        let phys = &self.vm.m.phys;
        self.pmap.teardown(phys, &mut frames);
        phys.free_later(&self.vm.m.rcu, &frames);
    }
}
