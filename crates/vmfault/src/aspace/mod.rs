//! Address spaces (`vm_map` + `pmap`): a set of VMAs and a page table.
//!
//! One file per operation: [`mmap`](mmap.rs), [`munmap`](munmap.rs),
//! [`mprotect`](mprotect.rs), [`madvise`](madvise.rs), [`mincore`](mincore.rs), [`usage`](usage.rs) (smaps), and the software MMU
//! ([`access`](access.rs): `read`, `write`, `touch`). Placement of mappings
//! is in `layout.rs`, the VMA index in `vma.rs` (over the persistent tree
//! of `ptree.rs`), the map locks and their zones in `zones.rs`.
//!
//! # Locking
//! - The *map lock* (`[M]`, a reader-writer lock around the VMA index; with
//!   `map_lock=zoned`, one per 512 GiB zone, see `zones.rs`) is held for
//!   reading by the classic fault path for the whole fault, and for writing
//!   by every operation that changes VMAs or tears pages down.
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
mod atomic;
mod brk;
mod file;
mod fork;
#[cfg(feature = "vm-memory")]
mod guest_memory;
mod hold;
mod layout;
mod madvise;
mod mincore;
mod mlock;
mod mmap;
mod mprotect;
mod mremap;
mod munmap;
mod ptree;
mod rmap;
mod spares;
mod stack;
mod usage;
pub(crate) use rmap::unmap_everywhere_unlocked;
pub use view::{HostFault, HostFaultHandler, HostView};
mod view;
pub(crate) mod vma;
mod zones;

#[cfg(all(test, not(loom)))]
mod another_vcpu;
#[cfg(all(test, not(loom)))]
mod ends_tests;
#[cfg(all(test, not(loom)))]
mod placement_tests;
#[cfg(all(test, not(loom)))]
mod second_tests;

use std::sync::{Arc, RwLockWriteGuard};

use crate::config::FaultPath;
use crate::error::{Error, Op, Result};
use crate::machine::{Ctx, Vm};
use crate::phys::Pfn;
use crate::pmap::Pmap;
use crate::stats::Counter;
use crate::sync::rank::{self, Rank, Ranked};
use crate::sync::rcu::{Quiet, RcuReadGuard};
use crate::types::MappingInfo;
pub use brk::HEAP_START;
pub use hold::PageHold;
pub use stack::{STACK_GUARD_GAP, STACK_LIMIT};
pub use usage::{FileRange, MappingUsage};
use vma::{Lookup, Snapshot, SnapshotRef, Vma, VmaFlags, VmaIndex, VmaTree};
pub(crate) use zones::{HeldView, MapHeld, MapRead, SpaceCpu, Zones};

/// Retired snapshots that make an operation wait for a grace period.
const SNAPSHOT_BACKLOG: usize = 32;

/// Room for retired snapshots a vCPU's list and a reclaim's buffer keep
/// from the start: past `SNAPSHOT_BACKLOG` they go to the deferred list,
/// so a list grown at a new high in the middle of a run (a heap
/// allocation) is one that twice the backlog did not hold.
const RETIRED_ROOM: usize = 2 * SNAPSHOT_BACKLOG;

/// Retired snapshots below which an operation does not look for any to
/// free (looking costs more than the few versions it would free).
const RECLAIM_BATCH: usize = 8;

/// Snapshots one reclaim gave back, in this thread's buffer for them (no
/// heap allocation in steady state, whatever a reclaim frees at once: a
/// list inline for two batches spilled after a long grace period).
type AgedSnapshots = crate::sync::scratch::Scratch<Snapshot>;

thread_local! {
    /// `[T]` the buffer of [`AgedSnapshots`].
    static AGED: std::cell::Cell<Vec<Snapshot>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Stock the calling thread, which has become a vCPU (`Vm::attach`): its
/// spare VMA records and index nodes ([`spares::stock`]) and the buffers
/// its changes' reclaims take with a known room, so that none of them is
/// first allocated in the middle of an operation.
pub(crate) fn stock_thread() {
    spares::stock();
    AgedSnapshots::reserve(&AGED, RETIRED_ROOM);
    crate::phys::deferred::reserve_thread_buffer();
}

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
    pub(crate) vm: crate::machine::Handle,
    /// `[S]` the map locks, each over the VMAs of its zone, with their
    /// snapshots, and the per-vCPU retired snapshots and VMA counts
    /// (`zones.rs`).
    pub(crate) zones: Zones,
    /// The page table (entries `[P]`, see `pmap`).
    pub(crate) pmap: Pmap,
    /// `[I]` whether changes publish snapshots of their zones' indexes:
    /// for faults that look VMAs up without the map lock, and for the
    /// lockless placement search of `map_lock=zoned`.
    publish: bool,
    /// `[a]` a change that ended objects left another vCPU's retired
    /// snapshots because that list was busy: the next one takes every
    /// pending list, whatever its zones (`take_retired_of_others`), so
    /// that objects such a list keeps alive end at the next change that
    /// ends objects, as before lists were filtered by zone.
    takeover_missed: std::sync::atomic::AtomicBool,
    /// `[L]` (the heap lock `[H]`) the heap's start and break (`brk.rs`).
    pub(crate) heap: std::sync::Mutex<brk::Heap>,
    /// `[L]` (taken inside the map lock of every zone, by `mremap` only)
    /// the families of private anonymous objects whose pieces moved by
    /// copy (`mremap.rs`, "Families"), as weak references.
    pub(super) families: std::sync::Mutex<Vec<Vec<std::sync::Weak<crate::object::Object>>>>,
}

/// The map lock of the zones a change touches, held for writing. Any
/// mutable use of a zone's index marks it changed; dropping the guard then
/// publishes a new snapshot of it for lockless readers (before the lock is
/// released).
///
/// Its `carve` and `renew` wrap the index's `*_no_wait` ones: after retiring the VMAs
/// they replace, they wait for the per-VMA read-lockers still inside them
/// (`sync::vma_state`), because their callers go on to change the PTEs
/// those VMAs mapped. Merges need no wait: they change no PTE.
pub(crate) struct MapWrite<'a> {
    space: &'a Space,
    view: HeldView<'a, Ranked<RwLockWriteGuard<'a, VmaTree>>>,
    /// Zones changed: bit `i % 64` of word `i / 64` is zone `first + i`.
    changed: [u64; 4],
    /// The holder's vCPU slot (where its retired snapshots and its count
    /// of VMAs go).
    slot: usize,
    /// VMAs put in less VMAs taken out.
    added: isize,
}

impl Lookup for MapWrite<'_> {
    #[inline]
    fn find_from(&self, addr: u64) -> Option<&Arc<Vma>> {
        zones::find_from_held(self, addr)
    }

    fn prev_of(&self, addr: u64) -> Option<&Arc<Vma>> {
        zones::prev_of_held(self, addr)
    }
}

impl MapHeld for MapWrite<'_> {
    fn zones(&self) -> &Zones {
        &self.space.zones
    }

    fn held(&self) -> (usize, usize) {
        self.view.held()
    }

    #[inline]
    fn tree(&self, z: usize) -> Option<&VmaTree> {
        self.view.tree(z)
    }
}

/// A VMA goes into the index of every zone it touches (`zones.rs`), and
/// is recorded on its object once, by the index of its first zone.
impl VmaIndex for MapWrite<'_> {
    fn put(&mut self, vma: Arc<Vma>) {
        if vma.flags.contains(VmaFlags::GROWSDOWN) {
            self.space.zones.stack_added();
        }
        let (first, last) = self.space.zones.span(vma.start, vma.end);
        if first == last {
            let tree = self.tree_mut(first);
            tree.record(&vma);
            tree.put_only(vma);
            self.added += 1;
            return;
        }
        self.tree_mut(first).record(&vma);
        for z in first..=last {
            let tree = self.tree_mut(z);
            tree.crossing += usize::from(first != last);
            tree.put_only(vma.clone());
        }
        self.added += 1;
    }

    fn take(&mut self, vma: &Vma) -> Arc<Vma> {
        let (first, last) = self.space.zones.span(vma.start, vma.end);
        let tree = self.tree_mut(first);
        let taken = tree.take_only(vma);
        tree.forget(&taken);
        self.added -= 1;
        if first == last {
            return taken;
        }
        for z in first + 1..=last {
            self.tree_mut(z).take_only(vma);
        }
        for z in first..=last {
            self.tree_mut(z).crossing -= 1;
        }
        taken
    }
}

impl MapWrite<'_> {
    /// The index of zone `z` (held), to change: marks it changed.
    fn tree_mut(&mut self, z: usize) -> &mut VmaTree {
        let (first, last) = self.view.held();
        assert!((first..=last).contains(&z), "a change in zone {z}, outside the zones it locked ({first}..={last})");
        let i = z - first;
        self.changed[i / 64] |= 1 << (i % 64);
        self.view.held.get_mut(z).expect("held")
    }

    /// [`VmaIndex::carve_no_wait`], then wait for the read-lockers of the
    /// VMAs it removed or split.
    pub(crate) fn carve(&mut self, start: u64, end: u64) -> vma::Removed {
        let span = self.span(start, end);
        let carved = self.carve_no_wait(start, end);
        self.wait_readers(span);
        carved
    }

    /// [`VmaIndex::renew_no_wait`], then wait for the read-lockers of the
    /// VMAs it replaced.
    pub(crate) fn renew(&mut self, start: u64, end: u64) -> vma::Removed {
        let span = self.span(start, end);
        let renewed = self.renew_no_wait(start, end);
        self.wait_readers(span);
        renewed
    }

    /// The union of `start..end` and the VMAs overlapping it (what a carve
    /// or renew of the range retires), if there are any.
    fn span(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        // Lookups, not an iteration: this runs on every munmap.
        self.find_from(start).filter(|v| v.start < end)?;
        let lo = self.find(start).map_or(start, |v| v.start);
        let hi = self.find(end - 1).map_or(end, |v| v.end);
        Some((lo, hi))
    }

    /// The addresses the held zones cover, as (start, end).
    pub(crate) fn reach(&self) -> (u64, u64) {
        let (first, last) = self.view.held();
        (self.space.zones.start_of(first), self.space.zones.end_of(last))
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

impl crate::object::MapWriteHeld for MapWrite<'_> {}

/// What a change tore down, gathered under the map lock and finished
/// after it (`Space::finish`): Linux's `mmu_gather`. The lower layers push
/// onto `frames` (an object's pages, a pruned table's pages).
#[derive(Debug)]
pub(crate) struct Gather {
    /// Frames unlinked everywhere, freed after the grace period, in this
    /// thread's buffer for them (a new list per change grew from empty
    /// each time: one heap allocation per vmlocal loop, about 15 per
    /// 128 MiB munmap).
    pub(crate) frames: crate::sync::scratch::Scratch<Pfn>,
    /// PTEs cleared or narrowed: a shootdown is owed.
    pub(crate) ptes: u64,
    /// Of those, PTEs of shared mappings cleared: their pages live on
    /// where others see them, so even with `free_path=deferred` the change
    /// waits for its grace period before it returns.
    pub(crate) shared: u64,
    /// The zones of the removed VMAs that held objects, which the old
    /// snapshots keep alive (empty: none).
    pub(crate) gone: zones::ZoneSet,
}

thread_local! {
    /// `[T]` the buffer of [`Gather::frames`].
    static GATHERED: std::cell::Cell<Vec<Pfn>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Frames a thread's [`Gather`] buffer keeps room for between changes (a
/// 256 MiB munmap's; a larger one's room is given back).
const GATHER_KEEP: usize = 1 << 16;

impl Default for Gather {
    fn default() -> Gather {
        let mut frames = crate::sync::scratch::Scratch::take(&GATHERED);
        if frames.capacity() > GATHER_KEEP {
            frames.shrink_to(GATHER_KEEP);
        }
        Gather { frames, ptes: 0, shared: 0, gone: zones::ZoneSet::default() }
    }
}

impl Gather {
    /// `n` PTEs cleared in a mapping, shared or not.
    pub(crate) fn zapped(&mut self, n: u64, shared: bool) {
        self.ptes += n;
        if shared {
            self.shared += n;
        }
    }
}

impl Drop for MapWrite<'_> {
    fn drop(&mut self) {
        let s = self.space;
        let (first, _) = self.view.held();
        let (changed, publish) = (self.changed, s.publish);
        let mine = &s.zones.cpus[self.slot];
        self.view.held.for_each_mut(|z, tree| {
            // Every PTE this operation cleared or narrowed is done, every new
            // VMA linked: the old records can go.
            tree.flush_unlinks();
            let i = z - first;
            if publish && changed[i / 64] & (1 << (i % 64)) != 0 {
                let old = s.zones.zone(z).snapshot.replace(&s.vm.m.rcu, tree.snapshot());
                let mut retired = rank::lock(&mine.retired, Rank::Leaf);
                if retired.capacity() == 0 {
                    // At this slot's first change in the space (not one
                    // per slot at the space's making: fork1 and exec1 make
                    // a space per loop).
                    retired.reserve(RETIRED_ROOM);
                }
                retired.push(old);
                mine.seen.note_zone_locked(z);
            }
        });
        if self.added != 0 {
            s.zones.count(self.slot, self.added);
        }
    }
}

impl AddressSpace {
    pub(crate) fn new(vm: Vm) -> Result<AddressSpace> {
        let pmap = vm
            .with_ctx(|ctx| Pmap::new(&ctx.frames()))
            .map_err(|_| Error::NoMemory { op: Op::NewSpace, what: "a page-table root" })?;
        let config = &vm.m.config;
        let zoned = config.map_lock == crate::config::MapLock::Zoned;
        let publish = config.fault_path != FaultPath::MapLock || zoned;
        let backing = config.rmap == crate::config::Rmap::Backing;
        let shift = if zoned { zones::ZONE_SHIFT } else { 64 };
        let s = Arc::new_cyclic(|me: &std::sync::Weak<Space>| {
            let owner = backing.then(|| vma::Owner { id: me.as_ptr().addr() as u64 });
            Space {
                vm: vm.handle(),
                zones: Zones::new(shift, owner.as_ref(), config.cpus),
                pmap,
                publish,
                takeover_missed: std::sync::atomic::AtomicBool::new(false),
                heap: Default::default(),
                families: Default::default(),
            }
        });
        s.register();
        Ok(AddressSpace { s, vm })
    }

    /// The machine this space belongs to.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }

    /// The mappings, in address order, as `/proc/self/maps` lists them.
    pub fn mappings(&self) -> Vec<MappingInfo> {
        self.s.vm.with_ctx(|ctx| self.s.infos(ctx))
    }

    /// Page-table pages this space uses (the root included).
    pub fn page_table_pages(&self) -> u64 {
        self.s.pmap.tables()
    }

    /// Whether two handles are the same space.
    pub fn same_space(&self, other: &AddressSpace) -> bool {
        Arc::ptr_eq(&self.s, &other.s)
    }

    /// Page faults taken in this space, by every vCPU (each access that
    /// went to the fault path, as `Stats::faults` counts them for the
    /// machine; Linux's minor and major faults of the process's threads).
    /// Counted per vCPU slot, summed here.
    pub fn faults(&self) -> u64 {
        self.s.zones.cpus.iter().map(|c| c.faults.load(std::sync::atomic::Ordering::Relaxed)).sum()
    }
}

impl Space {
    /// Count a fault in this space on the caller's vCPU slot.
    #[inline]
    pub(crate) fn count_fault(&self, ctx: &Ctx<'_>) {
        self.cpu(ctx).count_fault();
    }

    /// The caller's vCPU slot of this space.
    #[inline]
    pub(crate) fn cpu(&self, ctx: &Ctx<'_>) -> &SpaceCpu {
        &self.zones.cpus[ctx.index.min(self.zones.cpus.len() - 1)]
    }

    /// This space's id: its address (unique while it lives), which names
    /// it in reverse-map records and pv entries.
    #[inline]
    pub(crate) fn id(&self) -> u64 {
        std::ptr::from_ref(self).addr() as u64
    }

    /// Take the map lock of the zones of `start..end` for reading (counted).
    pub(crate) fn map_read(&self, ctx: &Ctx<'_>, start: u64, end: u64) -> MapRead<'_> {
        ctx.count(Counter::map_lock_acquisitions);
        let (first, last) = self.zones.span(start, end);
        let slot = ctx.index.min(self.zones.cpus.len() - 1);
        HeldView::new(&self.zones, self.zones.read(first, last), Some(slot))
    }

    /// Take the map lock of the zones of `start..end` for reading, not
    /// counted (statistics, and callers without a vCPU).
    pub(crate) fn map_read_uncounted(&self, start: u64, end: u64) -> MapRead<'_> {
        let (first, last) = self.zones.span(start, end);
        HeldView::new(&self.zones, self.zones.read(first, last), None)
    }

    /// Take the map lock of every zone for reading, not counted.
    pub(crate) fn map_read_all(&self) -> MapRead<'_> {
        HeldView::new(&self.zones, self.zones.read(0, self.zones.len() - 1), None)
    }

    /// A write guard over `held`, for the vCPU of `ctx` (counted).
    fn map_write_held<'a>(
        &'a self,
        ctx: &Ctx<'_>,
        held: zones::Held<Ranked<RwLockWriteGuard<'a, VmaTree>>>,
    ) -> MapWrite<'a> {
        ctx.count(Counter::map_lock_acquisitions);
        ctx.count(Counter::map_lock_writes);
        let slot = ctx.index.min(self.zones.cpus.len() - 1);
        MapWrite { space: self, view: HeldView::new(&self.zones, held, Some(slot)), changed: [0; 4], slot, added: 0 }
    }

    /// Take the map lock of every zone of a space nobody else can reach
    /// yet (the child of a `fork`, under its parent's), for writing (counted).
    pub(crate) fn map_write_unreachable(&self, ctx: &Ctx<'_>) -> MapWrite<'_> {
        self.map_write_held(ctx, self.zones.write_unreachable(0, self.zones.len() - 1))
    }

    /// Take the map lock for writing of every zone a change of
    /// `start..end` needs (counted): those of the range and of every VMA
    /// that touches it, the neighbours it may merge with included
    /// (`zones.rs`). With one zone, that one.
    pub(crate) fn map_write(&self, ctx: &Ctx<'_>, start: u64, end: u64) -> MapWrite<'_> {
        match self.map_write_needed(ctx, start, end, false) {
            Ok(map) => map,
            Err(_) => unreachable!("a blocking lock is never busy"),
        }
    }

    /// [`map_write`](Self::map_write) if no other thread holds one of
    /// those zones; else the first zone held.
    pub(crate) fn try_map_write(
        &self,
        ctx: &Ctx<'_>,
        start: u64,
        end: u64,
    ) -> std::result::Result<MapWrite<'_>, usize> {
        self.map_write_needed(ctx, start, end, true)
    }

    fn map_write_needed(
        &self,
        ctx: &Ctx<'_>,
        start: u64,
        end: u64,
        try_only: bool,
    ) -> std::result::Result<MapWrite<'_>, usize> {
        let lock = |first, last| {
            if try_only { self.zones.try_write(first, last) } else { Ok(self.zones.write(first, last)) }
        };
        if !self.zones.split() {
            return Ok(self.map_write_held(ctx, lock(0, 0)?));
        }
        // The zones of the range and a byte on each side first (VMAs that
        // cross a zone edge are rare), then the check under their locks: a
        // VMA there that reaches into another zone means more zones.
        let mut want = zones::extent(|_| None, start, end);
        loop {
            let (first, last) = self.zones.span(want.0, want.1);
            let map = self.map_write_held(ctx, lock(first, last)?);
            if (first..=last).all(|z| map.tree(z).is_some_and(|t| t.crossing == 0)) {
                // Every VMA of these zones lies inside them.
                return Ok(map);
            }
            let got = zones::extent(|a| map.find(a).map(|v| (v.start, v.end)), start, end);
            let (f, l) = self.zones.span(got.0, got.1);
            if first <= f && l <= last {
                return Ok(map);
            }
            drop(map);
            want = (want.0.min(got.0), want.1.max(got.1));
        }
    }

    /// Take the map lock of every zone for writing (counted).
    pub(crate) fn map_write_all(&self, ctx: &Ctx<'_>) -> MapWrite<'_> {
        self.map_write_held(ctx, self.zones.write(0, self.zones.len() - 1))
    }

    /// The VMA index of `addr`'s zone as lockless faults see it, for the
    /// section's length.
    #[inline]
    pub(crate) fn snapshot<'a>(&'a self, section: &'a RcuReadGuard<'_>, addr: u64) -> SnapshotRef<'a> {
        self.zones.snapshot(section, addr)
    }

    /// The mappings as `/proc/self/maps` lists them: each zone's VMAs in
    /// turn (each zone read-locked while it is read), a VMA that crosses
    /// zone edges listed with its first zone.
    pub(crate) fn infos(&self, ctx: &Ctx<'_>) -> Vec<MappingInfo> {
        let geo = self.zones.geo();
        let mut out: Vec<MappingInfo> = Vec::new();
        for z in 0..self.zones.len() {
            let (start, end) = (geo.start_of(z), geo.end_of(z));
            let map =
                if z == 0 { self.map_read(ctx, start, start + 1) } else { self.map_read_uncounted(start, start + 1) };
            // From where the last zone's listing ended: a VMA that crosses
            // into this zone was listed there (and one that a change split
            // between the two reads is not listed twice).
            let from = out.last().map_or(start, |l| l.end.max(start));
            out.extend(map.overlapping(from, end).filter(|v| v.start >= from).map(|v| v.info()));
        }
        out
    }

    /// Finish an operation that changed the address space, with no lock
    /// held, with what it tore down (`g`). If it cleared or narrowed
    /// `g.ptes` PTEs or unlinked `g.frames`,
    /// a grace period (the TLB shootdown) must pass before the call
    /// returns, so that no access through an old PTE is still in flight,
    /// and before the frames are freed. One is polled first (`Rcu::poll`),
    /// which completes with no wait when no other vCPU is inside a
    /// section; otherwise the call waits for one, or, with
    /// `free_path=deferred`, queues the frames on this vCPU's deferred
    /// list and waits for nothing. Then it frees the snapshots whose grace
    /// period has passed (polling for one that ages them all); with
    /// `g.gone` (the zones of the VMAs it removed that held objects,
    /// which the old snapshots keep alive; empty for none), or too many
    /// pending, and a poll that does not complete, it waits for one (with `free_path=deferred`, queues them on
    /// this vCPU's deferred list instead, dropped at its next change once
    /// aged: no wait). Returns the proof of a look at the readers, taken
    /// after every unlink of the change, that found none inside a section,
    /// if it looked and found none (for what the caller frees after).
    pub(crate) fn finish(&self, ctx: &Ctx<'_>, g: Gather) -> Option<Quiet> {
        let Gather { mut frames, ptes, shared, gone } = g;
        let objects_gone = !gone.is_empty();
        frames.extend(ctx.m.take_orphans());
        let frames = &frames[..];
        let rcu = &self.vm.m.rcu;
        let slot = ctx.index.min(self.zones.cpus.len() - 1);
        if objects_gone {
            // Another vCPU's retired snapshots may be what keeps the
            // removed objects alive: take them over (their lists are only
            // touched if they may hold snapshots of those zones, and only
            // tried). First: the one look at the readers below must come
            // after every entry it frees was retired.
            self.take_retired_of_others(slot, gone);
        }
        // One look at the readers for the whole change, after all its
        // unlinks (every PTE zapped, every old snapshot retired, the frames
        // and snapshots gathered): each look reads every other vCPU's RCU
        // counter, a line its owner writes at every section.
        let mut quiet: Option<Option<Quiet>> = None;
        let look = |quiet: &mut Option<Option<Quiet>>| *quiet.get_or_insert_with(|| rcu.quiet());
        if self.vm.m.phys.deferred.is_some() {
            // free_path=deferred: the frames are reused only after their
            // grace period, so a store still in flight through a cleared
            // private PTE lands in a page nobody can see or reuse before it
            // ends (narrowed PTEs had their shootdown under the map lock).
            // Pages of shared mappings live on where others see them: for
            // those the operation still waits, as Linux's TLB flush does
            // (unless no reader is inside a section: then none can hold them).
            if shared > 0 {
                ctx.count(Counter::tlb_shootdowns);
                if look(&mut quiet).is_none() {
                    rcu.grace_period();
                }
            }
            if !frames.is_empty() {
                if look(&mut quiet).is_some() {
                    ctx.frames().free_aged(frames);
                } else {
                    ctx.frames().free_after_busy_look(frames);
                }
            }
        } else if ptes > 0 || !frames.is_empty() {
            ctx.count(Counter::tlb_shootdowns);
            if frames.is_empty() {
                self.vm.m.rcu.grace_period();
            } else {
                ctx.frames().free_after_grace(frames);
            }
        }
        if let Some(d) = &self.vm.m.phys.deferred {
            // What this vCPU queued before and has aged since (no wait),
            // as `drop_aged` drops them: the retired snapshots (queued by
            // this function, below) leave their nodes and records to this
            // thread's spares, and the objects that end with them free
            // their frames into this vCPU's cache, a grace period after
            // every way to them was unlinked (else each would queue its
            // own for one more, on the list without a vCPU, which empties
            // into the global list: at 16 vCPUs, 1.3 frames per vmlocal
            // loop through the global lock).
            d.drop_aged_of_with(ctx.index.min(d.unowned()), rcu, false, |mut done| {
                let mut others = Vec::new();
                aged(ctx, || {
                    for v in done.drain(..) {
                        match v.downcast::<vma::SnapshotNode>() {
                            Ok(s) => spares::release_snapshot(Some(s)),
                            Err(other) => others.push(other),
                        }
                    }
                });
                // Anything else (none is queued today) ends outside the
                // sink: what it frees waits for a grace period of its own.
                drop(others);
            });
        }
        let mine = &self.zones.cpus[slot].retired;
        let mut retired = rank::lock(mine, Rank::Leaf);
        if retired.is_empty() || (retired.len() < RECLAIM_BATCH && !objects_gone) {
            return quiet.flatten();
        }
        // No reader inside a section: everything retired so far can go,
        // and nothing shared is written to learn it (a poll writes three
        // lines every vCPU's polls write). A vCPU's own list holds only
        // what this thread pushed or took over before the look; the slot
        // of unattached threads is pushed to by several, so it looks again
        // under the list's lock.
        let mut done = AgedSnapshots::take_with_room(&AGED, RETIRED_ROOM);
        let own = slot < self.zones.cpus.len() - 1;
        let reclaimed = match look(&mut quiet) {
            Some(proof) if own => {
                rcu.reclaim_quiet(&mut retired, proof, |s| done.push(s));
                true
            }
            // The look, after every entry was retired, found a reader
            // inside a section: another now would likely find one too,
            // and each reads every other vCPU's counter line.
            None if own => false,
            _ => rcu.reclaim_quiescent(&mut retired, |s| done.push(s)),
        };
        if reclaimed {
            // (`snap_zones` keeps its bits, a superset: cleared here, it
            // changed at every change, and every other vCPU's next look
            // at it missed.)
            drop(retired);
            self.drop_aged(ctx, done);
            return quiet.flatten();
        }
        // Else a polled grace period (no wait): with no other vCPU inside a
        // section, everything retired so far ages at once, and the objects
        // of removed mappings end with no wait either. For the newest
        // cookie, not the last entry's: snapshots taken over from other
        // vCPUs (older) follow this vCPU's own, and a reclaim reorders
        // what it leaves; polling an older one, aged, left this change's
        // own snapshot (and the objects it keeps alive) here until the
        // space changed again, which a final munmap never sees.
        let newest = retired.iter().map(|r| r.cookie()).max().expect("not empty");
        let all_aged = rcu.poll(newest);
        if all_aged || (!objects_gone && retired.len() <= SNAPSHOT_BACKLOG) {
            // Free what has aged past a grace period, without waiting (and
            // outside the lock: dropping a version frees its unshared nodes).
            // The list is in retirement order but for the rare re-appended
            // tail, so if the oldest has not aged, nothing has.
            if !rcu.elapsed(retired[0].cookie()) {
                return quiet.flatten();
            }
            rcu.reclaim_each(&mut retired, false, |s| done.push(s));
            drop(retired);
            self.drop_aged(ctx, done);
            return quiet.flatten();
        }
        // (`Seen` keeps its values, as above: cleared here, its line was
        // written twice per change, and at 16 vCPUs every other vCPU's
        // munmap that removed objects missed on it: 22% of a vmlocal
        // munmap's `finish` was that read.)
        let mut list = std::mem::take(&mut *retired);
        drop(retired);
        if let Some(d) = &self.vm.m.phys.deferred {
            // free_path=deferred: instead of waiting, queue them (and the
            // objects of removed mappings they keep alive) for a grace
            // period that the grace-period thread runs; this vCPU's next
            // change drops them, or an allocation that finds nothing
            // (`phys::deferred`).
            // (An empty version holds nothing: it is not queued.)
            let drops = list
                .drain(..)
                .filter_map(|r| r.map(|s| s.map(|s| s as Arc<dyn std::any::Any + Send + Sync>)).transpose());
            d.push_drops(ctx.index.min(d.unowned()), drops);
            // The list's room goes back for the next retirements (taking
            // it left none).
            let mut retired = rank::lock(mine, Rank::Leaf);
            if retired.capacity() < list.capacity() {
                std::mem::swap(&mut *retired, &mut list);
                retired.append(&mut list);
            }
            return quiet.flatten();
        }
        // Wait for a grace period, without the lock (writers push to it
        // while holding the map lock). (`done` is the empty buffer taken
        // above.)
        rcu.reclaim_each(&mut list, true, |s| done.push(s));
        if !list.is_empty() {
            let mut retired = rank::lock(mine, Rank::Leaf);
            retired.append(&mut list);
        }
        self.drop_aged(ctx, done);
        quiet.flatten()
    }

    /// Move the retired snapshots of every other vCPU slot that may hold
    /// some of the zones `gone` (`Seen::snap_zones`) onto `slot`'s
    /// list (a slot whose lock is busy is left, and the next call takes
    /// every pending list: `takeover_missed`).
    fn take_retired_of_others(&self, slot: usize, gone: zones::ZoneSet) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut taken = Vec::new();
        let mut zones = zones::ZoneSet::default();
        let gone = if self.takeover_missed.load(Relaxed) && self.takeover_missed.swap(false, Relaxed) {
            zones::ZoneSet::ALL
        } else {
            gone
        };
        for (i, cpu) in self.zones.cpus.iter().enumerate() {
            if i == slot || !cpu.seen.pending.load(Relaxed) || !cpu.seen.snap_zones.load().meets(gone) {
                continue;
            }
            if let Some(mut list) = Ranked::try_take(Rank::Leaf, || cpu.retired.try_lock().ok()) {
                taken.append(&mut list);
                zones = zones.with(cpu.seen.snap_zones.take());
                cpu.seen.pending.store(false, Relaxed);
            } else {
                self.takeover_missed.store(true, Relaxed);
            }
        }
        if !taken.is_empty() {
            let mine = &self.zones.cpus[slot];
            let mut retired = rank::lock(&mine.retired, Rank::Leaf);
            retired.append(&mut taken);
            mine.seen.note_locked(zones);
        }
    }

    /// Drop `done`: snapshots `Rcu::reclaim` gave back. The objects whose
    /// last reference they held end here, and their frames (index nodes,
    /// pages left) were unreachable to readers before that grace period
    /// ended, so they go to this vCPU's cache with no wait of their own
    /// and no global lock (`object::dropping_aged`). Their nodes and
    /// records become this thread's spares (`aspace/spares.rs`).
    fn drop_aged(&self, ctx: &Ctx<'_>, mut done: AgedSnapshots) {
        aged(ctx, || done.drain(..).for_each(spares::release_snapshot));
    }

    /// Drop the VMAs a change removed (their objects may end here), after
    /// its `finish`. `unlinked`: a cookie taken once every unlink of the
    /// change was done (the VMAs retired from the index and the snapshot
    /// that named them, their PTEs zapped). `quiet`: `finish`'s look,
    /// after those unlinks, that found no reader inside a section. If a
    /// grace period has passed since (that look, the change's shootdown, or
    /// its wait for the snapshots; else a look or a poll here, if an object
    /// may end), the objects' frames go to
    /// this vCPU's cache at once, as in `drop_aged`; else each object frees
    /// its own after a grace period (rare: the retired snapshot that named
    /// a removed VMA usually keeps it, and its object, alive until `finish`
    /// drops it aged). Records nobody else holds become this thread's
    /// spares.
    pub(crate) fn drop_removed(
        &self,
        ctx: &Ctx<'_>,
        removed: vma::Removed,
        unlinked: crate::sync::rcu::GpCookie,
        quiet: Option<Quiet>,
    ) {
        // An object can end here only with a record nobody else holds:
        // one a retired snapshot still names keeps its object alive past
        // this call, and then no look or poll is owed (at 16 vCPUs they
        // cost a vmlocal munmap a look at every vCPU's counter and a poll).
        // A record held elsewhere now may be let go meanwhile, and this
        // drop end its object: that object then frees its own frames after
        // a grace period of its own, as when no look found the readers
        // quiet. (A count of one cannot grow: nothing else holds it.)
        let ends = || removed.iter().any(|v| v.object.get().is_some() && Arc::strong_count(v) == 1);
        let rcu = &ctx.env.rcu;
        // Only with published snapshots: a retired snapshot keeps each VMA
        // it names (and its object) alive until a grace period after that
        // VMA's own unlink. Without them (the classic fault path on one
        // zone), another change's VMA of the same object, unlinked after
        // this change's look, may have left these the last references
        // while a reader still holds a page it mapped: each object then
        // frees its own frames after a grace period of its own (from a
        // review: a use after free there, before this check, when the
        // other change came between this one's look or cookie and here).
        let past_grace = self.publish
            && (quiet.is_some() || rcu.elapsed(unlinked) || (ends() && (rcu.quiescent() || rcu.poll(unlinked))));
        if past_grace {
            aged(ctx, || removed.into_iter().for_each(spares::release_vma));
        } else {
            removed.into_iter().for_each(spares::release_vma);
        }
    }
}

/// Run `drop_them`, which may end objects a grace period after every way
/// to them was unlinked, and give their frames to this vCPU's cache
/// (`object::dropping_aged`). Meanwhile the frames are on no list: with
/// `free_path=deferred` the drop counts as one under way on this vCPU's
/// list until they are placed, so an allocation that finds nothing waits
/// for them rather than report `ENOMEM`.
fn aged(ctx: &Ctx<'_>, drop_them: impl FnOnce()) {
    let d = ctx.env.phys.deferred.as_ref();
    let _dropping = d.map(|d| d.dropping_here(ctx.index.min(d.unowned())));
    let freed = crate::object::dropping_aged(drop_them);
    ctx.frames().free_aged(&freed);
    crate::object::recycle_aged(freed);
}

/// A PTE of space `id` at `addr` that mapped `old` was cleared: drop its
/// pv entry (`rmap=pv`) and the wiring it held (an `mlock`ed mapping).
/// Called under the PTE lock, from zap callbacks. A page whose last
/// reference that was (it left its object while wired) goes on the
/// machine's orphan list, freed by the operation's `finish`.
pub(crate) fn pte_cleared(m: &crate::machine::Machine, id: u64, addr: u64, old: crate::pmap::Pte) {
    if m.config.rmap == crate::config::Rmap::PvEntry && old.pfn() != m.phys.zero_pfn() {
        m.pv.remove(old.pfn(), crate::object::Pv { space: id, addr });
    }
    if old.is_wired() && m.phys.unwire(old.pfn(), None) {
        m.orphan(old.pfn());
    }
}

impl Space {
    /// Enter this space in its machine's registry of address spaces
    /// (`Machine::spaces`, type-erased there: the machine is below this
    /// layer), where [`by_id`](Space::by_id) and [`registered`](Space::registered) find it.
    fn register(self: &Arc<Space>) {
        let any: Arc<dyn std::any::Any + Send + Sync> = self.clone();
        rank::lock(&self.vm.m.spaces, Rank::Leaf).insert(self.id(), Arc::downgrade(&any));
    }

    /// The live space with id `id` on `m`, if any (pv entries and backing
    /// records name spaces by id).
    pub(crate) fn by_id(m: &crate::machine::Machine, id: u64) -> Option<Arc<Space>> {
        let any = rank::lock(&m.spaces, Rank::Leaf).get(&id)?.upgrade()?;
        Some(any.downcast::<Space>().expect("the registry holds address spaces only"))
    }

    /// The live spaces of `m`.
    pub(crate) fn registered(m: &crate::machine::Machine) -> Vec<Arc<Space>> {
        let map = rank::lock(&m.spaces, Rank::Leaf);
        map.values()
            .filter_map(|w| w.upgrade())
            .map(|a| a.downcast::<Space>().expect("the registry holds address spaces only"))
            .collect()
    }
}

impl Drop for Space {
    fn drop(&mut self) {
        // No handle is left, so nobody can be faulting or walking: drop the
        // VMAs (their objects free their pages) and the page table.
        let id = self.id();
        rank::lock(&self.vm.m.spaces, Rank::Leaf).remove(&id);
        let geo = self.zones.geo();
        let mut vmas: Vec<Arc<Vma>> = Vec::new();
        for (z, tree) in self.zones.trees_mut().enumerate() {
            // Each VMA once: from the index of its first zone.
            vmas.extend(tree.take_all_only().into_iter().filter(|v| geo.zone_of(v.start) == z));
            if let Some(owner) = tree.owner() {
                vmas.iter().filter(|v| geo.zone_of(v.start) == z).for_each(|v| owner.unlink(v));
            }
        }
        let locked = vmas.iter().any(|v| v.flags.contains(VmaFlags::LOCKED));
        let m = &self.vm.m;
        if m.config.rmap == crate::config::Rmap::PvEntry || locked {
            self.pmap.zap(&m.phys, 0, crate::types::TASK_SIZE, |addr, pte| pte_cleared(m, id, addr, pte));
        }
        file::write_back_at_exit(&self.vm.m, &vmas);
        drop(vmas);
        for cpu in self.zones.cpus.iter_mut() {
            let mut retired = std::mem::take(rank::unpoisoned(cpu.0.retired.get_mut()));
            drop(self.vm.m.rcu.reclaim(&mut retired, true));
        }
        let mut frames = self.vm.m.take_orphans();
        let phys = &self.vm.m.phys;
        self.pmap.teardown(phys, &mut frames);
        phys.free_later(&self.vm.m.rcu, &frames);
    }
}
