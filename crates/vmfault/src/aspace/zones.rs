//! The map lock, split by address (`VmConfig::map_lock`).
//!
//! An address space's VMAs live in *zones*: one for the whole space with
//! `map_lock=global` (Linux's single `mmap_lock`), or one per 512 GiB of
//! it with `map_lock=zoned`. Each zone is a map lock over the VMAs that
//! touch its addresses, and the snapshot of them that lockless faults
//! read. A change locks the zones of its range and of the VMAs it touches,
//! in address order, and nothing else of the space: changes in different
//! zones take no common lock and write no common cache line (RadixVM's
//! rule for disjoint ranges, at zone granularity; CortenMM locks
//! page-table nodes the same way).
//!
//! # VMAs across zone edges
//! - A VMA that crosses an edge is in the index of every zone it touches
//!   (the same `Arc<Vma>`), so a lookup in one zone finds every VMA at its
//!   addresses, and VMAs are exactly Linux's: no piece, no join.
//! - A change locks every zone of its range and of the VMAs that touch it
//!   (those it may split, and the neighbours it may merge with): first the
//!   zones of the range and a byte on each side; if one of them holds a VMA
//!   that reaches outside its zone (`VmaTree::crossing`), the extents of the
//!   VMAs at the range's ends are read under the locks, and the change
//!   drops them and retries with more zones if those reach further
//!   (`Space::map_write`).
//! - Page-table pages are pruned only inside the zones held: a munmap never
//!   frees a table another zone's change could be using (a PUD page, 512
//!   GiB, covers exactly one zone).
//! - The space's VMA count (for `MAX_MAP_COUNT`) is kept per vCPU and
//!   moved to the space's in batches, so no change writes a shared counter
//!   each time; retired snapshots go to the changing vCPU's own list.
//!
//! # Placement
//! An mmap without a usable hint first tries Linux's zone (the last one,
//! which holds `MMAP_BASE`): it takes that zone's map lock without
//! waiting and searches the locked index for the highest gap below
//! `MMAP_BASE` (`Space::placed_in`); every gap above one found there lies
//! in the zone too, so it is Linux's answer. Only if the zone is busy,
//! holds a VMA that crosses its edge, or has no room, it looks for Linux's
//! address in the zones' snapshots with no lock, inside an RCU section,
//! then locks that address's zones and checks it is still free. If another
//! change holds one of them, it takes the highest gap below that zone
//! instead (contention-aware placement, as CortenMM's); the address is
//! Linux's whenever no other change is in flight. Searching under the
//! lock keeps the common case out of RCU sections: a vCPU preempted
//! inside one holds back every other vCPU's reclamation of retired
//! snapshots, whose records and nodes its next changes then allocate.
//!
//! While another vCPU has an operation in flight on the space (it holds a
//! zone's map lock, for writing or, as a fault under the map lock that may
//! give a VMA its object, for reading; or it is inside a `munmap`, its
//! frees included, or inside an mmap's search for a place: two searching
//! at once see each other; `Zones::changing`, read for the slots in
//! `Zones::changers` only), an
//! unhinted mmap goes straight to a zone of its vCPU's own below Linux's
//! (`Zones::home_below`; searched under its lock as above, a page and a
//! stack guard gap short of its end), instead of trying Linux's zone first: vCPUs
//! that map and unmap at once (will-it-scale's mmap1 and malloc1) then
//! each work in a zone of their own, and neither the lock, the index, the
//! snapshot nor the page tables of one are written by the other (the homes
//! of the first 31 slots lie on lines of the root table of their own, see
//! `Zones::home_below`). With no
//! other change in flight the address is Linux's, as above.
//!
//! # Lock order
//! Zone map locks nest in ascending address order only: every function
//! that takes more than one (`Zones::write`, `try_write`, `read`,
//! `write_unreachable`) goes through `Held::collect`, which takes them in
//! that order; a change that needs more zones drops all it holds first.
//! The rank checker (`sync::rank`) lets `Map` nest but does not check the
//! address order.

use std::ops::Deref;
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::vma::{Lookup, Owner, Snapshot, SnapshotNode, SnapshotRef, Vma, VmaTree};
use crate::sync::CachePadded;
use crate::sync::rank::{self, Rank, Ranked};
use crate::sync::rcu::{RcuArc, RcuReadGuard, Retired};
use crate::types::TASK_SIZE;

/// log2 of a zone's bytes with `map_lock=zoned`: 512 GiB, one PUD page's
/// reach, so 256 zones cover the 128 TiB user address space (the last one
/// ends at `TASK_SIZE`, a page short).
pub(crate) const ZONE_SHIFT: u32 = 39;

/// Zones whose entries share a cache line of the page table's root (a zone
/// is one entry of it: 8-byte entries in 64-byte lines).
const ZONES_PER_ROOT_LINE: usize = 64 / 8;

/// One zone: its map lock and VMA index, and the snapshot of the index.
#[derive(Debug)]
pub(crate) struct Zone {
    /// `[M]` the zone's map lock and the VMAs that touch the zone, which it protects.
    pub(super) map: RwLock<VmaTree>,
    /// `[a]` the index as lockless faults see it (RCU: read inside a
    /// section; replaced under the zone's map write lock after a change).
    pub(super) snapshot: RcuArc<SnapshotNode>,
}

/// A set of zones, exact for the 256 zones of `map_lock=zoned` (zone `z`
/// is bit `z % 256`): what a vCPU slot's retired snapshots may name, and
/// the zones of the VMAs a change removed. One bit per zone, not per
/// zone modulo 64: with 64 bits the home zones of slots 8 apart
/// (`Zones::home_below` spaces them by a root-table line, 8 zones)
/// shared a bit, so at 16 vCPUs every `malloc1` munmap took over another
/// vCPU's retired list (its lock, its `Seen` line) that held nothing of
/// its zone.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ZoneSet([u64; 4]);

impl ZoneSet {
    /// Every zone.
    pub(crate) const ALL: ZoneSet = ZoneSet([u64::MAX; 4]);

    /// Add zone `z`.
    #[inline]
    fn add(&mut self, z: usize) {
        self.0[z / 64 % 4] |= 1 << (z % 64);
    }

    /// Whether the set holds no zone.
    pub(crate) fn is_empty(self) -> bool {
        self.0 == [0; 4]
    }

    /// Whether the two sets hold a zone in common.
    pub(crate) fn meets(self, other: ZoneSet) -> bool {
        self.0.iter().zip(other.0).any(|(a, b)| a & b != 0)
    }

    /// Both sets' zones.
    #[must_use]
    pub(crate) fn with(mut self, other: ZoneSet) -> ZoneSet {
        self.0.iter_mut().zip(other.0).for_each(|(a, b)| *a |= b);
        self
    }
}

/// A [`ZoneSet`] that other vCPUs read while its owner adds to it.
#[derive(Debug, Default)]
pub(crate) struct AtomicZoneSet([std::sync::atomic::AtomicU64; 4]);

impl AtomicZoneSet {
    /// The zones now (each word Relaxed: a superset is all a reader needs).
    pub(crate) fn load(&self) -> ZoneSet {
        use std::sync::atomic::Ordering::Relaxed;
        ZoneSet(std::array::from_fn(|i| self.0[i].load(Relaxed)))
    }

    /// Add `zones`, writing only the words that change.
    pub(crate) fn add(&self, zones: ZoneSet) {
        for (i, bits) in zones.0.into_iter().enumerate() {
            self.add_bits(i, bits);
        }
    }

    /// Add zone `z` alone (a change's: one word looked at).
    #[inline]
    pub(crate) fn add_one(&self, z: usize) {
        self.add_bits(z / 64 % 4, 1 << (z % 64));
    }

    /// Add `bits` to word `i`, writing it only if that changes it.
    #[inline]
    fn add_bits(&self, i: usize, bits: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if self.0[i].load(Relaxed) & bits != bits {
            self.0[i].fetch_or(bits, Relaxed);
        }
    }

    /// Empty the set, returning what it held.
    pub(crate) fn take(&self) -> ZoneSet {
        use std::sync::atomic::Ordering::Relaxed;
        ZoneSet(std::array::from_fn(|i| if self.0[i].load(Relaxed) == 0 { 0 } else { self.0[i].swap(0, Relaxed) }))
    }
}

/// What a vCPU slot's retired list may hold, as other vCPUs look at it
/// ([`SpaceCpu::seen`]).
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// `[a]` whether `retired` may hold entries (written under its lock;
    /// set when an entry is pushed, cleared only when another vCPU takes
    /// the list, as `snap_zones`): a change that removed objects takes
    /// other vCPUs' entries, which may be what keeps them alive
    /// (`Space::finish`), without touching the lists of vCPUs that have
    /// none.
    pub(super) pending: std::sync::atomic::AtomicBool,
    /// `[a]` the zones whose snapshots `retired` may hold (a superset,
    /// added to only where it lacks them, and emptied only when another
    /// vCPU takes the list; written under its lock): a change that
    /// removed objects of some zones takes over only the lists that may
    /// keep them alive, so vCPUs changing zones of their own never touch
    /// each other's lists (`zone_set`).
    pub(super) snap_zones: AtomicZoneSet,
}

impl Seen {
    /// Note that the list holds a snapshot of the zones `zones` (under the
    /// list's lock), writing only what changes.
    pub(super) fn note_locked(&self, zones: ZoneSet) {
        self.snap_zones.add(zones);
        self.note_pending_locked();
    }

    /// [`note_locked`](Self::note_locked) for one zone, `z` (a change's
    /// retired snapshot).
    #[inline]
    pub(super) fn note_zone_locked(&self, z: usize) {
        self.snap_zones.add_one(z);
        self.note_pending_locked();
    }

    /// Note that the list may hold entries, writing only if it changes.
    #[inline]
    fn note_pending_locked(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.pending.load(Relaxed) {
            self.pending.store(true, Relaxed);
        }
    }
}

/// What each vCPU slot keeps of a space (written by that vCPU; a change
/// that removed objects takes other slots' retired snapshots over).
#[derive(Debug, Default)]
pub(crate) struct SpaceCpu {
    /// `[L]` snapshots this vCPU's changes replaced, waiting for a grace
    /// period (inner to the map locks).
    pub(super) retired: Mutex<Vec<Retired<Snapshot>>>,
    /// `[a]` what other vCPUs read of `retired` at each change of theirs that
    /// removed objects (`Space::take_retired_of_others`), on lines of its
    /// own and written only when a value changes: the rest of the slot is
    /// written at every change and fault of its vCPU, and each such write
    /// made the other vCPUs' next read a miss (on two core complexes,
    /// ~350 ns each, a few per vmlocal loop).
    pub(super) seen: CachePadded<Seen>,
    /// `[a]` VMAs this vCPU's changes added, less those they removed, not
    /// yet moved to `Zones::vmas` (fewer than `COUNT_BATCH` either way).
    pub(super) vmas: AtomicIsize,
    /// `[a]` this vCPU's last page-table walk in the space (its own: see
    /// `pmap::LeafHint`).
    pub(super) leaf_hint: crate::pmap::LeafHint,
    /// `[a]` faults this vCPU slot took in the space (one writer, the
    /// slot's holder: a load and a store, as the vCPU's own counters).
    pub(super) faults: std::sync::atomic::AtomicU64,
}

impl SpaceCpu {
    /// Count a fault in the space on this slot (its holder's).
    #[inline]
    pub(crate) fn count_fault(&self) {
        // One writer per slot (its holder): no locked instruction.
        self.faults.store(self.faults.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }
}

/// Where the zones lie: `n` zones of `2^shift` bytes (one, of everything,
/// when `n` is 1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geometry {
    shift: u32,
    n: usize,
}

impl Geometry {
    /// The zone of `addr` (the last one for addresses at or above `TASK_SIZE`).
    #[inline]
    pub(crate) fn zone_of(self, addr: u64) -> usize {
        if self.n == 1 { 0 } else { ((addr >> self.shift) as usize).min(self.n - 1) }
    }

    /// The zones `start..end` touches (at least the one of `start`).
    #[inline]
    pub(crate) fn span(self, start: u64, end: u64) -> (usize, usize) {
        (self.zone_of(start), self.zone_of(end.max(start.saturating_add(1)) - 1))
    }

    /// The zones `start..end` touches, as a [`ZoneSet`].
    pub(crate) fn zone_set(self, start: u64, end: u64) -> ZoneSet {
        let (first, last) = self.span(start, end);
        if last - first >= 255 {
            return ZoneSet::ALL;
        }
        let mut s = ZoneSet::default();
        (first..=last).for_each(|z| s.add(z));
        s
    }

    /// The first address of zone `z`.
    pub(crate) fn start_of(self, z: usize) -> u64 {
        if self.n == 1 { 0 } else { (z as u64) << self.shift }
    }

    /// The end of zone `z` (`u64::MAX` for the last).
    pub(crate) fn end_of(self, z: usize) -> u64 {
        if z + 1 == self.n { u64::MAX } else { ((z + 1) as u64) << self.shift }
    }
}

/// A space's zones and its per-vCPU parts.
#[derive(Debug)]
pub(crate) struct Zones {
    /// `[I]` where the zones lie.
    geo: Geometry,
    /// `[S]` the zones, in address order.
    zones: Box<[CachePadded<Zone>]>,
    /// `[S]` per vCPU slot (the unattached threads' shared slot last).
    pub(super) cpus: Box<[CachePadded<SpaceCpu>]>,
    /// `[a]` set (once, never cleared) when a stack (`MAP_GROWSDOWN`) is
    /// put in: until then the gap search looks at no zone beyond a
    /// candidate's for a stack's guard gap (`stack.rs`). Read-mostly.
    pub(super) stacks: std::sync::atomic::AtomicBool,
    /// `[a]` the space's VMA count, less what the slots have not moved here
    /// yet (Linux's `percpu_counter`: written once per `COUNT_BATCH`
    /// changes of a slot's count, not by every change).
    vmas: CachePadded<AtomicIsize>,
    /// `[a]` the vCPU slots that have held a map lock of the space (for a
    /// change or a fault under it), bit `i % 64` of word `i / 64` for slot
    /// `i` (Linux's `mm_cpumask`: set once per slot, so read-mostly): whose
    /// `changing` an unhinted mmap looks at.
    changers: CachePadded<Box<[std::sync::atomic::AtomicU64]>>,
    /// `[a]` per vCPU slot, the operations its threads have in flight (map
    /// lock holds, whole munmaps: see "Placement"), each on a line of its
    /// own: read by other vCPUs' unhinted mmaps, which must not take the
    /// line of the slot's other fields away from it.
    changing: Box<[CachePadded<std::sync::atomic::AtomicU32>]>,
}

/// How far a vCPU slot's count may drift before it moves to the space's.
const COUNT_BATCH: isize = 32;

impl Zones {
    /// Zones of `2^shift` bytes (47 or more: one) recording their VMAs for
    /// `owner`, with `slots` vCPU slots.
    pub(super) fn new(shift: u32, owner: Option<&Owner>, slots: usize) -> Zones {
        let n = if shift >= 47 { 1 } else { TASK_SIZE.div_ceil(1 << shift) as usize };
        let zone =
            || CachePadded(Zone { map: RwLock::new(VmaTree::recorded(owner.cloned())), snapshot: RcuArc::new(None) });
        Zones {
            geo: Geometry { shift, n },
            zones: (0..n).map(|_| zone()).collect(),
            cpus: (0..=slots).map(|_| CachePadded(SpaceCpu::default())).collect(),
            stacks: std::sync::atomic::AtomicBool::new(false),
            vmas: CachePadded(AtomicIsize::new(0)),
            changers: CachePadded((0..(slots + 1).div_ceil(64)).map(|_| Default::default()).collect()),
            changing: (0..=slots).map(|_| CachePadded::default()).collect(),
        }
    }

    /// Where a stack's guard gap above `end` may reach down from: `end`
    /// itself while the space has no stack.
    pub(super) fn gap_reach(&self, end: u64) -> u64 {
        if self.stacks.load(Ordering::Relaxed) { super::stack::above_gap(end) } else { end }
    }

    /// Note that a stack was put in (see [`Zones::stacks`]).
    pub(super) fn stack_added(&self) {
        if !self.stacks.load(Ordering::Relaxed) {
            self.stacks.store(true, Ordering::Relaxed);
        }
    }

    /// Note that slot `slot` starts a change (a map write hold).
    #[inline]
    pub(super) fn change_begins(&self, slot: usize) {
        let word = &self.changers[slot / 64];
        let bit = 1u64 << (slot % 64);
        if word.load(Ordering::Relaxed) & bit == 0 {
            word.fetch_or(bit, Ordering::Relaxed);
        }
        self.changing[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// Note that slot `slot` ends a change [`change_begins`](Self::change_begins) noted.
    #[inline]
    pub(super) fn change_ends(&self, slot: usize) {
        self.changing[slot].fetch_sub(1, Ordering::Relaxed);
    }

    /// Count an operation of vCPU slot `slot` as in flight until the guard
    /// drops (a whole `munmap`, its frees after the lock included).
    pub(super) fn busy(&self, slot: usize) -> Busy<'_> {
        self.change_begins(slot);
        Busy { zones: self, slot }
    }

    /// Whether a slot other than `slot` has a change in flight (a hint,
    /// read with no lock: placement's, see "Placement"). Reads the
    /// `changing` word of each slot that ever changed the space.
    pub(super) fn others_changing(&self, slot: usize) -> bool {
        self.changers.iter().enumerate().any(|(w, word)| {
            let mut bits = word.load(Ordering::Relaxed);
            if slot / 64 == w {
                bits &= !(1u64 << (slot % 64));
            }
            while bits != 0 {
                let i = w * 64 + bits.trailing_zeros() as usize;
                if self.changing[i].load(Ordering::Relaxed) != 0 {
                    return true;
                }
                bits &= bits - 1;
            }
            false
        })
    }

    /// The zone an unhinted mmap of slot `slot` takes while another
    /// change is in flight: one of its own below the zone of Linux's
    /// addresses (`linux`), so vCPUs mapping at once work in different
    /// zones (none if `linux` is the first).
    ///
    /// A zone is one entry of the page table's root, and eight entries
    /// share a cache line: the homes of the first slots lie in lines of
    /// their own, below Linux's zone's line, so that two vCPUs' changes,
    /// which attach and detach their zones' entries (every `malloc1` loop
    /// does both), write no line in common. Slots beyond the lines there
    /// are share lines (as beyond the zones, zones).
    pub(super) fn home_below(&self, linux: usize, slot: usize) -> Option<usize> {
        let lines = linux / ZONES_PER_ROOT_LINE;
        if lines == 0 {
            return (linux > 0).then(|| linux - 1 - slot % linux);
        }
        let (line, within) = (slot % lines, slot / lines % ZONES_PER_ROOT_LINE);
        Some((lines - line) * ZONES_PER_ROOT_LINE - 1 - within)
    }

    /// Whether there is more than one zone.
    #[inline]
    pub(crate) fn split(&self) -> bool {
        self.geo.n > 1
    }

    /// Where the zones lie.
    #[inline]
    pub(crate) fn geo(&self) -> Geometry {
        self.geo
    }

    /// The number of zones.
    pub(super) fn len(&self) -> usize {
        self.geo.n
    }

    /// The zone of `addr` (the last one for addresses at or above `TASK_SIZE`).
    #[inline]
    pub(crate) fn zone_of(&self, addr: u64) -> usize {
        self.geo.zone_of(addr)
    }

    /// The zones `start..end` touches (at least the one of `start`).
    #[inline]
    pub(super) fn span(&self, start: u64, end: u64) -> (usize, usize) {
        self.geo.span(start, end)
    }

    /// The first address of zone `z`.
    pub(super) fn start_of(&self, z: usize) -> u64 {
        self.geo.start_of(z)
    }

    /// The end of zone `z` (`u64::MAX` for the last).
    pub(super) fn end_of(&self, z: usize) -> u64 {
        self.geo.end_of(z)
    }

    /// Zone `z`.
    #[inline]
    pub(super) fn zone(&self, z: usize) -> &Zone {
        &self.zones[z]
    }

    /// The VMA index of `addr`'s zone as lockless readers see it.
    #[inline]
    pub(crate) fn snapshot<'a>(&'a self, section: &'a RcuReadGuard<'_>, addr: u64) -> SnapshotRef<'a> {
        SnapshotRef(self.zones[self.zone_of(addr)].snapshot.read(section))
    }

    /// Lock zones `first..=last` for writing, in order (blocking).
    pub(super) fn write(&self, first: usize, last: usize) -> Held<Ranked<RwLockWriteGuard<'_, VmaTree>>> {
        let take = |z: usize| Ranked::take(Rank::Map, || rank::unpoisoned(self.zones[z].map.write()));
        Held::collect(first, last, take)
    }

    /// Lock zones `first..=last` for writing without waiting: the first
    /// zone another thread holds is the error (nothing stays locked).
    pub(super) fn try_write(
        &self,
        first: usize,
        last: usize,
    ) -> Result<Held<Ranked<RwLockWriteGuard<'_, VmaTree>>>, usize> {
        let mut busy = None;
        let held = Held::try_collect(first, last, |z| {
            let zone = &self.zones[z].map;
            let got = Ranked::try_take(Rank::Map, || rank::try_unpoisoned(zone.try_write()));
            if got.is_none() {
                busy = Some(z);
            }
            got
        });
        held.ok_or_else(|| busy.expect("a zone was busy"))
    }

    /// Lock zones `first..=last` for writing, of a space nobody else can
    /// reach yet (a `fork` child, under its parent's locks).
    pub(super) fn write_unreachable(&self, first: usize, last: usize) -> Held<Ranked<RwLockWriteGuard<'_, VmaTree>>> {
        let take = |z: usize| Ranked::take_unreachable(Rank::Map, || rank::unpoisoned(self.zones[z].map.write()));
        Held::collect(first, last, take)
    }

    /// Lock zones `first..=last` for reading, in order.
    pub(super) fn read(&self, first: usize, last: usize) -> Held<Ranked<RwLockReadGuard<'_, VmaTree>>> {
        let take = |z: usize| Ranked::take(Rank::Map, || rank::unpoisoned(self.zones[z].map.read()));
        Held::collect(first, last, take)
    }

    /// Count `added` VMAs (negative: removed) on vCPU slot `slot`.
    pub(super) fn count(&self, slot: usize, added: isize) {
        let mine = &self.cpus[slot].vmas;
        if (mine.fetch_add(added, Ordering::Relaxed) + added).abs() >= COUNT_BATCH {
            self.vmas.fetch_add(mine.swap(0, Ordering::Relaxed), Ordering::Relaxed);
        }
    }

    /// The space's VMA count if it is above `limit` (read without a lock:
    /// exact when no change is in flight). Reads one shared word while the
    /// count is more than the slots' drift below `limit`.
    pub(super) fn vmas_above(&self, limit: usize) -> Option<usize> {
        let slack = COUNT_BATCH * self.cpus.len() as isize;
        if self.vmas.load(Ordering::Relaxed) + slack <= limit as isize {
            return None;
        }
        let n =
            self.vmas.load(Ordering::Relaxed) + self.cpus.iter().map(|c| c.vmas.load(Ordering::Relaxed)).sum::<isize>();
        let n = n.max(0) as usize;
        (n > limit).then_some(n)
    }

    /// Every zone's index, of a space nobody can reach any more.
    pub(super) fn trees_mut(&mut self) -> impl Iterator<Item = &mut VmaTree> {
        self.zones.iter_mut().map(|z| rank::unpoisoned(z.0.map.get_mut()))
    }

    /// The published indexes of every zone, for a search with no lock.
    pub(super) fn published<'a>(&'a self, section: &'a RcuReadGuard<'_>) -> Published<'a> {
        Published { zones: self, section }
    }
}

impl super::Space {
    /// The VMAs right before and right after `vma` (adjacent ones only),
    /// with `map` held: from the held zones, or for a zone not held (a
    /// fault holds only its address's), from that zone's snapshot, which is
    /// exact when no change is in flight there.
    pub(crate) fn adjacent(
        &self,
        ctx: &crate::machine::Ctx<'_>,
        map: &impl MapHeld,
        vma: &Vma,
    ) -> (Option<Arc<Vma>>, Option<Arc<Vma>>) {
        let (first, last) = map.held();
        let look = |addr: u64| {
            if (first..=last).contains(&self.zones.zone_of(addr)) {
                map.find(addr).cloned()
            } else {
                let section = ctx.rcu_read();
                self.zones.snapshot(&section, addr).find(addr).cloned()
            }
        };
        let prev = vma.start.checked_sub(1).and_then(look).filter(|p| p.end == vma.start);
        let next = look(vma.end).filter(|n| n.start == vma.end);
        (prev, next)
    }
}

/// An operation in flight on a vCPU slot ([`Zones::busy`]).
pub(super) struct Busy<'a> {
    zones: &'a Zones,
    slot: usize,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.zones.change_ends(self.slot);
    }
}

/// Guards of consecutive zones, in ascending order; up to three (a
/// change at a zone's edge holds two) need no heap allocation.
#[derive(Debug)]
pub(crate) struct Held<G> {
    /// The first zone held.
    first: usize,
    /// Its guard.
    one: G,
    /// The guards of the zones after it.
    more: smallvec::SmallVec<[G; 2]>,
}

impl<G> Held<G> {
    fn collect(first: usize, last: usize, mut take: impl FnMut(usize) -> G) -> Held<G> {
        let one = take(first);
        let more = (first + 1..=last).map(take).collect();
        Held { first, one, more }
    }

    fn try_collect(first: usize, last: usize, mut take: impl FnMut(usize) -> Option<G>) -> Option<Held<G>> {
        let one = take(first)?;
        let mut more = smallvec::SmallVec::new();
        for z in first + 1..=last {
            more.push(take(z)?);
        }
        Some(Held { first, one, more })
    }

    /// The zones held, as (first, last).
    #[inline]
    pub(crate) fn range(&self) -> (usize, usize) {
        (self.first, self.first + self.more.len())
    }

    /// The guard of zone `z`, if held.
    #[inline]
    pub(crate) fn get(&self, z: usize) -> Option<&G> {
        match z.checked_sub(self.first)? {
            0 => Some(&self.one),
            i => self.more.get(i - 1),
        }
    }

    /// The guard of zone `z`, if held.
    #[inline]
    pub(crate) fn get_mut(&mut self, z: usize) -> Option<&mut G> {
        match z.checked_sub(self.first)? {
            0 => Some(&mut self.one),
            i => self.more.get_mut(i - 1),
        }
    }

    /// Call `f` with every guard and its zone, in order.
    #[inline]
    pub(crate) fn for_each_mut(&mut self, mut f: impl FnMut(usize, &mut G)) {
        f(self.first, &mut self.one);
        for (i, g) in self.more.iter_mut().enumerate() {
            f(self.first + 1 + i, g);
        }
    }
}

/// What the placement search asks of an index (`layout`): the VMAs
/// nearest a range, as (start, end).
///
/// A stack that grows down (`MAP_GROWSDOWN`) counts from the bottom of its
/// guard gap (Linux's `vm_start_gap`, `stack.rs`), and only as the first
/// mapping above a range, as in Linux's gap search: `(start, end)` are
/// that extent.
pub(crate) trait Gaps {
    /// The lowest VMA that intersects `start..end`.
    fn lowest_in(&self, start: u64, end: u64) -> Option<(u64, u64)>;
    /// The highest VMA that intersects `start..end`.
    fn highest_in(&self, start: u64, end: u64) -> Option<(u64, u64)>;
}

impl<T: Lookup> Gaps for T {
    fn lowest_in(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let v = self.find_from(start)?;
        let from = super::stack::start_gap(v);
        (from < end).then_some((from, v.end))
    }

    fn highest_in(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        // The first VMA above `end - 1`, if it or its guard gap reaches
        // below `end`; else the last one below.
        if let Some(v) = self.find_from(end - 1)
            && super::stack::start_gap(v) < end
        {
            return Some((super::stack::start_gap(v), v.end));
        }
        let v = self.prev_of(end - 1)?;
        (v.end > start).then_some((super::stack::start_gap(v), v.end))
    }
}

/// Every zone's published index, read inside one section: the lockless
/// view an mmap searches for a free range before it locks one.
pub(crate) struct Published<'a> {
    zones: &'a Zones,
    section: &'a RcuReadGuard<'a>,
}

impl Published<'_> {
    fn at(&self, z: usize) -> SnapshotRef<'_> {
        SnapshotRef(self.zones.zones[z].snapshot.read(self.section))
    }
}

impl Gaps for Published<'_> {
    // As for one index, over the zones of the range and of a stack guard
    // gap above it (a stack in the next zone may reach down into this one).
    fn lowest_in(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let (first, last) = self.zones.span(start, self.zones.gap_reach(end));
        if first == last {
            return self.at(first).lowest_in(start, end);
        }
        let v = (first..=last).find_map(|z| self.at(z).find_from(start))?;
        let from = super::stack::start_gap(v);
        (from < end).then_some((from, v.end))
    }

    fn highest_in(&self, start: u64, end: u64) -> Option<(u64, u64)> {
        let (first, last) = self.zones.span(start, self.zones.gap_reach(end));
        if first == last {
            return self.at(first).highest_in(start, end);
        }
        let at_end = self.zones.zone_of(end - 1);
        if let Some(v) = (at_end..=last).find_map(|z| self.at(z).find_from(end - 1))
            && super::stack::start_gap(v) < end
        {
            return Some((super::stack::start_gap(v), v.end));
        }
        let v = (first..=at_end).rev().find_map(|z| self.at(z).prev_of(end - 1))?;
        (v.end > start).then_some((super::stack::start_gap(v), v.end))
    }
}

impl Published<'_> {
    /// The start and flags of the first VMA that ends above `addr` and
    /// starts below `end`, in the zones of `addr..end`.
    pub(super) fn first_in(&self, addr: u64, end: u64) -> Option<(u64, super::vma::VmaFlags)> {
        let (first, last) = self.zones.span(addr, end);
        (first..=last).find_map(|z| self.at(z).find_from(addr).filter(|v| v.start < end).map(|v| (v.start, v.flags)))
    }
}

/// The VMA index over the zones an operation holds: a function whose
/// precondition is "the map lock is held" takes the guard (`&impl
/// MapHeld`), so the precondition is a type; one that needs it held for
/// writing takes `&MapWrite`. Lookups see the held zones only: a VMA in a
/// zone not held is none of the holder's business (and may change).
pub(crate) trait MapHeld: Lookup {
    /// The space's zones.
    fn zones(&self) -> &Zones;
    /// The zones held, as (first, last).
    fn held(&self) -> (usize, usize);
    /// The index of zone `z`, if held.
    fn tree(&self, z: usize) -> Option<&VmaTree>;

    /// The space the index records its mappings for, if it does.
    fn owner(&self) -> Option<&super::vma::Owner> {
        self.tree(self.held().0)?.owner()
    }
}

/// [`Lookup::find_from`] over the held zones: every VMA that touches a
/// zone is in its index, so the first zone from `addr`'s on that has one
/// ending above `addr` has the right one.
#[inline]
pub(crate) fn find_from_held(m: &impl MapHeld, addr: u64) -> Option<&Arc<Vma>> {
    let (first, last) = m.held();
    let z = m.zones().zone_of(addr);
    if z == last {
        return m.tree(z)?.find_from(addr);
    }
    (z.max(first)..=last).find_map(|z| m.tree(z)?.find_from(addr))
}

/// [`Lookup::prev_of`] over the held zones, from `addr`'s zone down.
pub(crate) fn prev_of_held(m: &impl MapHeld, addr: u64) -> Option<&Arc<Vma>> {
    let (first, last) = m.held();
    let z = m.zones().zone_of(addr);
    if z == first {
        return m.tree(z)?.prev_of(addr);
    }
    (first..=z.min(last)).rev().find_map(|z| m.tree(z)?.prev_of(addr))
}

/// Zones held through `Deref` guards.
pub(crate) struct HeldView<'a, G> {
    pub(super) zones: &'a Zones,
    pub(super) held: Held<G>,
    /// The vCPU slot whose `Zones::changing` counts this hold (a hold
    /// taken for a vCPU's operation; none for statistics).
    pub(super) busy: Option<usize>,
}

impl<'a, G> HeldView<'a, G> {
    /// A view of `held`, counted as an operation in flight of vCPU slot
    /// `busy` (if any) until it is dropped (see "Placement").
    pub(super) fn new(zones: &'a Zones, held: Held<G>, busy: Option<usize>) -> Self {
        if let Some(slot) = busy {
            zones.change_begins(slot);
        }
        HeldView { zones, held, busy }
    }
}

impl<G> Drop for HeldView<'_, G> {
    fn drop(&mut self) {
        if let Some(slot) = self.busy {
            self.zones.change_ends(slot);
        }
    }
}

impl<G: Deref<Target = VmaTree>> Lookup for HeldView<'_, G> {
    #[inline]
    fn find_from(&self, addr: u64) -> Option<&Arc<Vma>> {
        find_from_held(self, addr)
    }

    fn prev_of(&self, addr: u64) -> Option<&Arc<Vma>> {
        prev_of_held(self, addr)
    }
}

impl<G: Deref<Target = VmaTree>> MapHeld for HeldView<'_, G> {
    fn zones(&self) -> &Zones {
        self.zones
    }

    fn held(&self) -> (usize, usize) {
        self.held.range()
    }

    #[inline]
    fn tree(&self, z: usize) -> Option<&VmaTree> {
        self.held.get(z).map(|g| &**g)
    }
}

/// The map lock of some zones, held for reading.
pub(crate) type MapRead<'a> = HeldView<'a, Ranked<RwLockReadGuard<'a, VmaTree>>>;

/// The addresses a change of `start..end` may touch, as (start, end): the
/// range with a byte on each side (a neighbour it may merge with starts
/// or ends there), grown to the VMAs at those bytes and at the range's
/// ends (`find(addr)`: the one containing `addr`). VMAs inside the range
/// lie inside that.
pub(crate) fn extent(find: impl Fn(u64) -> Option<(u64, u64)>, start: u64, end: u64) -> (u64, u64) {
    let end = end.max(start.saturating_add(1));
    let (mut lo, mut hi) = (start.saturating_sub(1), end.saturating_add(1));
    for a in [start.saturating_sub(1), start, end - 1, end] {
        if let Some((s, e)) = find(a) {
            (lo, hi) = (lo.min(s), hi.max(e));
        }
    }
    (lo, hi)
}
