//! VMAs and the ordered VMA index of an address space.
//!
//! A [`Vma`] is immutable once it is in the index: splitting, merging or
//! changing protection replaces it with new `Vma`s. That makes every VMA a
//! consistent snapshot for whoever holds it, which is what a lockless reader
//! (the speculative fault path) needs; the one field set later is the
//! backing object of private anonymous memory, which is set once
//! (Linux's `anon_vma_prepare`).
//!
//! # Merging
//! Linux merges adjacent VMAs when nothing observable distinguishes them,
//! and so do we, with the same rule (checked against the host kernel by the
//! differential test): same protection and flags, contiguous page offsets,
//! and the same object, where a private VMA that has no object yet is
//! compatible with any (Linux: `is_mergeable_anon_vma`). Linux's pieces
//! of one mapping moved apart by `mremap` keep its one anon_vma; here
//! those that keep one distance between address and page offset share
//! one object (`mremap.rs`, "Families"), so the same rule holds.
//!
//! The index is keyed by each VMA's end, so the first entry above `addr`
//! is the first VMA ending above `addr`, Linux's `find_vma`. It is a
//! persistent tree (`ptree`): every version stays intact for the lockless
//! readers that hold it, and publishing one is a pointer copy.

use std::sync::{Arc, OnceLock};

use bitflags::bitflags;

use super::ptree::{Iter, PTree};
use crate::object::Object;
use crate::sync::vma_state::VmaState;
use crate::types::{MappingInfo, PAGE_SHIFT, Prot};

bitflags! {
    /// VMA flags that are not protections (Linux's `VM_*` that matter to merging).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub(crate) struct VmaFlags: u32 {
        /// `VM_SHARED`: a shared mapping.
        const SHARED = 1 << 0;
        /// `VM_ACCOUNT`: private writable memory charged to the commit limit.
        const ACCOUNT = 1 << 1;
        /// `VM_NORESERVE`: mapped with `MAP_NORESERVE`.
        const NORESERVE = 1 << 2;
        /// `VM_RAND_READ`: `MADV_RANDOM`.
        const RAND_READ = 1 << 3;
        /// `VM_SEQ_READ`: `MADV_SEQUENTIAL`.
        const SEQ_READ = 1 << 4;
        /// A file mapping (Linux: `vm_file` set): never merges with, nor
        /// lends its object to, anonymous memory.
        const FILE = 1 << 5;
        /// Linux's `VM_MAYWRITE` cleared: a shared mapping of a file that is
        /// not open for writing (`mprotect(PROT_WRITE)` is `EACCES`).
        const NO_WRITE = 1 << 6;
        /// `VM_LOCKED`: `mlock`ed. Its pages are faulted in and wired, each
        /// through a PTE marked wired; faults in it wire what they map.
        const LOCKED = 1 << 7;
        /// `VM_NOHUGEPAGE`: mapped with `MAP_STACK` (Linux 6.7 on keeps
        /// huge pages off thread stacks; here it only keeps such a mapping
        /// from merging with others, as in Linux).
        const NOHUGEPAGE = 1 << 8;
        /// `VM_GROWSDOWN`: a stack mapped with `MAP_GROWSDOWN` (private
        /// anonymous memory only): a fault in the gap below it extends it
        /// down, and placement keeps a guard gap below it (`stack.rs`).
        const GROWSDOWN = 1 << 9;
    }
}

/// One mapping: a range of addresses with one protection onto one object.
#[derive(Debug)]
pub(crate) struct Vma {
    /// `[I]` first address.
    pub(crate) start: u64,
    /// `[I]` one past the last address.
    pub(crate) end: u64,
    /// `[I]` protection.
    pub(crate) prot: Prot,
    /// `[I]` flags.
    pub(crate) flags: VmaFlags,
    /// `[I]` page offset of `start` in the object. For private anonymous
    /// memory it is `start >> 12` at mmap time (as in Linux), which keeps
    /// offsets contiguous across neighbours that may merge.
    pub(crate) pgoff: u64,
    /// `[a]` set once: the object. Shared mappings get it at mmap; private
    /// anonymous memory at its first write fault (`fault::resolve::prepare`:
    /// recorded on the object's reverse map before it is set here).
    pub(crate) object: OnceLock<Arc<Object>>,
    /// `[a]` live or retired (see `sync::vma_state`): retired, under the
    /// map lock, when the VMA leaves the index. Faults only read it (the
    /// per-VMA read lock is a pin in the reader's own RCU slot), so it needs
    /// no line of its own; when every VmaLock fault wrote a reader count
    /// here, the line had to be padded away from the fields above.
    pub(crate) state: VmaState,
}

impl Vma {
    /// A new VMA over `start..end`.
    pub(crate) fn new(
        start: u64,
        end: u64,
        prot: Prot,
        flags: VmaFlags,
        pgoff: u64,
        object: Option<Arc<Object>>,
    ) -> Vma {
        assert!(start < end, "an empty or inverted VMA {start:#x}..{end:#x}");
        let cell = OnceLock::new();
        if let Some(o) = object {
            let _ = cell.set(o);
        }
        Vma { start, end, prot, flags, pgoff, object: cell, state: VmaState::new() }
    }

    /// A copy of this VMA restricted to `start..end`, with `prot`/`flags`.
    pub(crate) fn slice(&self, start: u64, end: u64, prot: Prot, flags: VmaFlags) -> Vma {
        assert!(
            self.start <= start && end <= self.end && start < end,
            "slice {start:#x}..{end:#x} of the VMA {:#x}..{:#x}",
            self.start,
            self.end
        );
        let pgoff = self.pgoff + ((start - self.start) >> PAGE_SHIFT);
        Vma::new(start, end, prot, flags, pgoff, self.object.get().cloned())
    }

    /// A copy restricted to `start..end`, same protection and flags.
    pub(crate) fn clip(&self, start: u64, end: u64) -> Vma {
        self.slice(start, end, self.prot, self.flags)
    }

    /// The object page index of `addr`.
    #[inline]
    pub(crate) fn pindex(&self, addr: u64) -> u64 {
        self.pgoff + ((addr - self.start) >> PAGE_SHIFT)
    }

    /// Whether this is a shared mapping.
    pub(crate) fn is_shared(&self) -> bool {
        self.flags.contains(VmaFlags::SHARED)
    }

    /// Whether `next` (starting where this ends) may merge with this VMA.
    pub(crate) fn can_merge_with(&self, next: &Vma) -> bool {
        self.continued_by(next)
            && match (self.object.get(), next.object.get()) {
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                // Shared mappings always have an object; a private one
                // without an object yet is compatible with any that was
                // not inherited through fork.
                (Some(o), None) | (None, Some(o)) => !self.is_shared() && !o.inherited,
                (None, None) => !self.is_shared(),
            }
    }

    /// Whether `next` may merge with this VMA once it has grown in place
    /// up to it (`mremap`; Linux's `vma_merge_extend`): as
    /// [`can_merge_with`](Vma::can_merge_with), except that an object
    /// inherited through fork may extend over a `next` that has none. The
    /// grown range is a new one carrying this VMA's anon_vma, and Linux
    /// (6.16 on, `is_mergeable_anon_vma`) asks about fork ancestry only of
    /// an existing VMA whose anon_vma a merge takes in, or of one a move
    /// copies from; here there is neither.
    pub(crate) fn can_extend_over(&self, next: &Vma) -> bool {
        self.can_merge_with(next)
            || (self.object.get().is_some()
                && next.object.get().is_none()
                && !self.is_shared()
                && self.continued_by(next))
    }

    /// Whether `next` starts where this ends, with the same protection
    /// and flags and the page offsets that continue this VMA's: what every
    /// merge asks before it looks at the objects.
    fn continued_by(&self, next: &Vma) -> bool {
        self.end == next.start
            && self.prot == next.prot
            && self.flags == next.flags
            && next.pgoff == self.pgoff + ((self.end - self.start) >> PAGE_SHIFT)
    }

    /// The `/proc/self/maps` view.
    pub(crate) fn info(&self) -> MappingInfo {
        MappingInfo {
            start: self.start,
            end: self.end,
            prot: self.prot,
            shared: self.is_shared(),
            locked: self.flags.contains(VmaFlags::LOCKED),
        }
    }
}

/// The VMAs of one address space, ordered by address (`[M]`).
#[derive(Debug, Default)]
pub(crate) struct VmaTree {
    by_end: PTree<Arc<Vma>>,
    /// `[I]` the space, when VMAs are to be recorded on their objects'
    /// reverse maps (`Rmap::Backing`, see `object::rmap`).
    owner: Option<Owner>,
    /// Records of VMAs taken out, forgotten only by [`VmaTree::flush_unlinks`]
    /// (from `MapWrite::drop`): until the operation has cleared or narrowed
    /// their PTEs and linked the replacements, a reverse-map walk must
    /// still find them (duplicates are harmless: walks check each PTE).
    pending: Vec<(Arc<Object>, crate::object::BackingKey)>,
    /// `[M]` VMAs here that reach beyond this index's zone (`map_lock=zoned`;
    /// kept by `MapWrite`): while there are none, a change needs no
    /// lookup to know which zones it must lock (`Space::map_write`).
    pub(crate) crossing: usize,
}

/// The space a [`VmaTree`] records its mappings for.
#[derive(Debug, Clone)]
pub(crate) struct Owner {
    /// Its id (`Space::id`; records name it, a walk finds it in the
    /// machine's registry).
    pub(crate) id: u64,
}

impl Owner {
    /// Record `v` (now mapped in this space) on its object, if it has one.
    pub(crate) fn link(&self, v: &Vma) {
        if let Some(o) = v.object.get() {
            self.link_object(v, o);
        }
    }

    /// Record `v`'s range on `o`, the object `v` is about to get.
    pub(crate) fn link_object(&self, v: &Vma, o: &crate::object::Object) {
        o.link(self.key(v));
    }

    /// Forget a record [`Owner::link_object`] made for an object `v` did
    /// not get after all.
    pub(crate) fn unlink_object(&self, v: &Vma, o: &crate::object::Object) {
        o.unlink(self.key(v));
    }

    /// Forget the record of `v` (no longer mapped in this space).
    pub(crate) fn unlink(&self, v: &Vma) {
        if let Some(o) = v.object.get() {
            o.unlink(self.key(v));
        }
    }

    fn key(&self, v: &Vma) -> crate::object::BackingKey {
        (self.id, v.start, v.end, v.pgoff)
    }
}

/// The VMAs a change took out, in address order: inline up to four (no
/// heap allocation on a munmap of a few VMAs).
pub(crate) type Removed = smallvec::SmallVec<[Arc<Vma>; 4]>;

/// Looking VMAs up, in one index or in the zones a change holds.
pub(crate) trait Lookup {
    /// The first VMA that ends above `addr` (it may start above it too).
    fn find_from(&self, addr: u64) -> Option<&Arc<Vma>>;

    /// The last VMA that ends at or below `addr`.
    fn prev_of(&self, addr: u64) -> Option<&Arc<Vma>>;

    /// The VMA containing `addr`.
    #[inline]
    fn find(&self, addr: u64) -> Option<&Arc<Vma>> {
        self.find_from(addr).filter(|v| v.start <= addr)
    }

    /// Whether any VMA intersects `start..end`.
    fn intersects(&self, start: u64, end: u64) -> bool {
        self.find_from(start).is_some_and(|v| v.start < end)
    }

    /// The VMAs intersecting `start..end`, in order: one lookup per VMA
    /// (no allocation).
    fn overlapping(&self, start: u64, end: u64) -> impl Iterator<Item = &Arc<Vma>> {
        let mut pos = start;
        std::iter::from_fn(move || {
            let v = self.find_from(pos).filter(|v| v.start < end)?;
            pos = v.end;
            Some(v)
        })
    }

    /// Every VMA, in address order.
    fn iter(&self) -> impl Iterator<Item = &Arc<Vma>> {
        self.overlapping(0, u64::MAX)
    }
}

/// Changing an index: the two primitives, and the changes every operation
/// is made of, built on them (the same for one tree and for the zones a
/// change holds, `aspace/zones.rs`).
pub(crate) trait VmaIndex: Lookup {
    /// Put a VMA in (recording it on its object's reverse map); it must
    /// not overlap any other.
    fn put(&mut self, vma: Arc<Vma>);

    /// Take `vma` out (forgetting its record once the change is done).
    fn take(&mut self, vma: &Vma) -> Arc<Vma>;

    /// Insert a VMA; it must not overlap any other.
    fn insert(&mut self, vma: Arc<Vma>) {
        assert!(!self.intersects(vma.start, vma.end), "overlapping VMA insert {:#x}..{:#x}", vma.start, vma.end);
        self.put(vma);
    }

    /// Take a VMA out of the index and retire it: speculative faults and
    /// read-lockers that look at it from now on fail. Those already holding
    /// its read lock are waited for by `MapWrite::carve`/`renew`, before
    /// anything it mapped changes.
    fn remove(&mut self, vma: &Vma) -> Arc<Vma> {
        let v = self.take(vma);
        v.state.retire();
        v
    }

    /// Replace `old` by `new` (same range), retiring `old`. Does not wait
    /// for its read-lockers: the caller does, before changing its PTEs.
    fn replace_no_wait(&mut self, old: &Vma, new: Arc<Vma>) -> Arc<Vma> {
        // Holds: the one caller (fork) builds `new` from `old`'s range.
        debug_assert_eq!((old.start, old.end), (new.start, new.end));
        let old = self.remove(old);
        self.put(new);
        old
    }

    /// Replace every VMA intersecting `start..end` by an identical copy,
    /// retiring the old ones: for operations that change what a VMA maps
    /// without changing the VMA (`MADV_DONTNEED`). Returns the old ones.
    /// Does not wait for their read-lockers: `MapWrite::renew` does.
    fn renew_no_wait(&mut self, start: u64, end: u64) -> Removed {
        let mut hit = Removed::new();
        let mut pos = start;
        while let Some(v) = self.find_from(pos).filter(|v| v.start < end).cloned() {
            pos = v.end;
            self.remove(&v);
            self.put(super::spares::vma(v.clip(v.start, v.end)));
            hit.push(v);
        }
        hit
    }

    /// Remove everything in `start..end`, splitting VMAs that straddle an
    /// edge (their outside parts stay, as new VMAs). Returns the removed
    /// parts, clipped to the range, in address order. Does not wait for
    /// the read-lockers of the retired VMAs: `MapWrite::carve` does.
    fn carve_no_wait(&mut self, start: u64, end: u64) -> Removed {
        let mut removed = Removed::new();
        // One lookup per VMA, not an iterator (whose stack, and the list of
        // what it found, were two heap allocations on every munmap): the
        // parts put back lie outside the range, so the next lookup finds
        // the next VMA that overlaps it.
        while let Some(v) = self.find_from(start).filter(|v| v.start < end).cloned() {
            self.remove(&v);
            if v.start < start {
                self.put(super::spares::vma(v.clip(v.start, start)));
            }
            if end < v.end {
                self.put(super::spares::vma(v.clip(end, v.end)));
            }
            let (s, e) = (v.start.max(start), v.end.min(end));
            removed.push(if (s, e) == (v.start, v.end) { v } else { super::spares::vma(v.clip(s, e)) });
        }
        removed
    }

    /// Merge compatible neighbours whose shared boundary lies in
    /// `start..=end`, left to right (Linux prefers merging with the
    /// previous VMA when a three-way merge is impossible). Returns the
    /// replaced VMAs, which the caller retires.
    fn merge_range(&mut self, start: u64, end: u64) -> Removed {
        self.merge_range_by(start, end, Vma::can_merge_with)
    }

    /// [`merge_range`](VmaIndex::merge_range) with `may` deciding whether
    /// a VMA merges with the one after it.
    fn merge_range_by(&mut self, start: u64, end: u64, may: fn(&Vma, &Vma) -> bool) -> Removed {
        let mut retired = Removed::new();
        let mut cur = match self.prev_of(start).cloned().or_else(|| self.find_from(start).cloned()) {
            Some(v) => v,
            None => return retired,
        };
        loop {
            let next = match self.find_from(cur.end) {
                Some(n) if n.start == cur.end && start <= cur.end && cur.end <= end => n.clone(),
                Some(n) if n.start <= end => {
                    cur = n.clone();
                    continue;
                }
                _ => break,
            };
            if may(&cur, &next) {
                let object = cur.object.get().or(next.object.get()).cloned();
                let merged = super::spares::vma(Vma::new(cur.start, next.end, cur.prot, cur.flags, cur.pgoff, object));
                retired.push(self.remove(&cur));
                retired.push(self.remove(&next));
                self.put(merged.clone());
                cur = merged;
            } else {
                cur = next;
            }
        }
        retired
    }
}

impl Lookup for VmaTree {
    fn find_from(&self, addr: u64) -> Option<&Arc<Vma>> {
        self.by_end.first_above(addr).map(|(_, v)| v)
    }

    fn prev_of(&self, addr: u64) -> Option<&Arc<Vma>> {
        self.by_end.last_at_or_below(addr).map(|(_, v)| v)
    }

    fn iter(&self) -> impl Iterator<Item = &Arc<Vma>> {
        values(self.by_end.iter())
    }
}

impl VmaIndex for VmaTree {
    fn put(&mut self, vma: Arc<Vma>) {
        self.record(&vma);
        self.put_only(vma);
    }

    fn take(&mut self, vma: &Vma) -> Arc<Vma> {
        let v = self.take_only(vma);
        self.forget(&v);
        v
    }
}

impl VmaTree {
    /// An empty index whose VMAs are recorded on their objects' reverse maps.
    pub(crate) fn recorded(owner: Option<Owner>) -> VmaTree {
        VmaTree { by_end: PTree::default(), owner, pending: Vec::new(), crossing: 0 }
    }

    /// The space this index records its mappings for, if it does.
    pub(crate) fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }

    /// Record `vma` on its object's reverse map.
    pub(crate) fn record(&self, vma: &Vma) {
        if let Some(w) = &self.owner {
            w.link(vma);
        }
    }

    /// Forget the record of `vma` once the change is done (see `pending`).
    pub(crate) fn forget(&mut self, vma: &Vma) {
        if let (Some(w), Some(o)) = (&self.owner, vma.object.get()) {
            self.pending.push((o.clone(), w.key(vma)));
        }
    }

    /// Put a VMA in the tree, not recording it.
    pub(crate) fn put_only(&mut self, vma: Arc<Vma>) {
        // A VMA displaced here would never be retired nor zapped, and its
        // object could free pages its PTEs still map: a real check.
        let (start, end) = (vma.start, vma.end);
        let displaced = self.by_end.insert(vma.end, vma);
        assert!(displaced.is_none(), "a VMA ending at {end:#x} was displaced by {start:#x}..{end:#x}");
    }

    /// Take `vma` out of the tree, not forgetting its record.
    pub(crate) fn take_only(&mut self, vma: &Vma) -> Arc<Vma> {
        self.by_end.remove(vma.end).expect("VMA not in the index")
    }

    /// Forget the records of the VMAs taken out so far (see `pending`).
    pub(crate) fn flush_unlinks(&mut self) {
        for (o, key) in self.pending.drain(..) {
            o.unlink(key);
        }
    }

    /// This version of the index, for lockless readers: O(1), it shares
    /// every node with the index (see `ptree`).
    pub(crate) fn snapshot(&self) -> Snapshot {
        self.by_end.root()
    }

    /// Remove and return every VMA, not forgetting their records.
    pub(crate) fn take_all_only(&mut self) -> Vec<Arc<Vma>> {
        self.flush_unlinks();
        self.by_end.take_all()
    }
}

fn values<'a>(it: Iter<'a, Arc<Vma>>) -> impl Iterator<Item = &'a Arc<Vma>> {
    it.map(|(_, v)| v)
}

/// A version of the VMA index, published for lockless readers (the
/// speculative and per-VMA-lock fault paths) and dropped after a grace
/// period once replaced: the root of the persistent tree (none when the
/// space has no VMA), published as it is, with no allocation of its own
/// (`sync::rcu::RcuArc`). Its VMAs stay allocated while it exists.
pub(crate) type Snapshot = Option<Arc<SnapshotNode>>;

/// A node of a published version of the VMA index.
pub(crate) type SnapshotNode = super::ptree::Node<Arc<Vma>>;

/// A published version as a reader sees it, for one read-side section.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SnapshotRef<'a>(pub(crate) Option<&'a SnapshotNode>);

impl Lookup for SnapshotRef<'_> {
    fn find_from(&self, addr: u64) -> Option<&Arc<Vma>> {
        SnapshotRef::find_from(*self, addr)
    }

    fn prev_of(&self, addr: u64) -> Option<&Arc<Vma>> {
        SnapshotRef::prev_of(*self, addr)
    }
}

impl<'a> SnapshotRef<'a> {
    /// The VMA containing `addr`, if any.
    #[inline]
    pub(crate) fn find(self, addr: u64) -> Option<&'a Arc<Vma>> {
        self.find_from(addr).filter(|v| v.start <= addr)
    }

    /// The first VMA that ends above `addr`.
    #[inline]
    pub(crate) fn find_from(self, addr: u64) -> Option<&'a Arc<Vma>> {
        super::ptree::first_above(self.0, addr).map(|(_, v)| v)
    }

    /// The last VMA that ends at or below `addr`.
    pub(crate) fn prev_of(self, addr: u64) -> Option<&'a Arc<Vma>> {
        super::ptree::last_at_or_below(self.0, addr).map(|(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    fn vma(s: u64, e: u64, prot: Prot) -> Arc<Vma> {
        Arc::new(Vma::new(s * P, e * P, prot, VmaFlags::empty(), s, None))
    }

    fn ranges(t: &VmaTree) -> Vec<(u64, u64)> {
        t.iter().map(|v| (v.start / P, v.end / P)).collect()
    }

    #[test]
    fn find_and_carve() {
        let mut t = VmaTree::default();
        t.insert(vma(10, 20, Prot::READ));
        t.insert(vma(30, 40, Prot::READ));
        assert_eq!(t.find(15 * P).map(|v| v.start), Some(10 * P));
        assert!(t.find(25 * P).is_none());
        assert_eq!(t.find_from(25 * P).map(|v| v.start), Some(30 * P));
        assert!(t.intersects(19 * P, 31 * P));
        assert!(!t.intersects(20 * P, 30 * P));
        let removed = t.carve_no_wait(15 * P, 35 * P);
        assert_eq!(removed.iter().map(|v| (v.start / P, v.end / P)).collect::<Vec<_>>(), vec![(15, 20), (30, 35)]);
        assert_eq!(ranges(&t), vec![(10, 15), (35, 40)]);
        // The right part keeps a contiguous page offset.
        assert_eq!(t.find(35 * P).unwrap().pgoff, 35);
        // Carving from the middle splits in three.
        let removed = t.carve_no_wait(11 * P, 12 * P);
        assert_eq!(removed.len(), 1);
        assert_eq!(ranges(&t), vec![(10, 11), (12, 15), (35, 40)]);
    }

    #[test]
    fn removal_retires_and_snapshots_find() {
        let mut t = VmaTree::default();
        t.insert(vma(10, 20, Prot::READ));
        t.insert(vma(30, 40, Prot::READ));
        let root = t.snapshot();
        let snap = SnapshotRef(root.as_deref());
        assert_eq!(snap.find(15 * P).map(|v| v.start), Some(10 * P));
        assert!(snap.find(25 * P).is_none() && snap.find(40 * P).is_none());
        let old = snap.find(35 * P).unwrap().clone();
        t.carve_no_wait(30 * P, 35 * P);
        assert!(!old.state.is_live(), "a VMA leaving the index is retired");
        let renewed = t.renew_no_wait(0, 100 * P);
        assert_eq!(renewed.len(), 2);
        assert!(renewed.iter().all(|v| !v.state.is_live()));
        assert!(t.iter().all(|v| v.state.is_live()));
        assert_eq!(ranges(&t), vec![(10, 20), (35, 40)]);
    }

    #[test]
    fn merge_rules() {
        let mut t = VmaTree::default();
        t.insert(vma(0, 2, Prot::READ));
        t.insert(vma(2, 4, Prot::READ));
        t.insert(vma(4, 6, Prot::WRITE));
        t.insert(vma(7, 8, Prot::WRITE));
        let retired = t.merge_range(0, 8 * P);
        assert_eq!(retired.len(), 2);
        assert_eq!(ranges(&t), vec![(0, 4), (4, 6), (7, 8)]);
        // Boundaries outside the range are left alone.
        t.insert(vma(6, 7, Prot::WRITE));
        assert!(t.merge_range(0, 3 * P).is_empty());
        t.merge_range(6 * P, 7 * P);
        assert_eq!(ranges(&t), vec![(0, 4), (4, 8)]);
    }

    #[test]
    fn shared_and_flags_block_merging() {
        let mut t = VmaTree::default();
        t.insert(Arc::new(Vma::new(0, P, Prot::READ, VmaFlags::SHARED, 0, None)));
        t.insert(Arc::new(Vma::new(P, 2 * P, Prot::READ, VmaFlags::SHARED, 1, None)));
        t.insert(Arc::new(Vma::new(2 * P, 3 * P, Prot::READ, VmaFlags::NORESERVE, 2, None)));
        t.insert(Arc::new(Vma::new(3 * P, 4 * P, Prot::READ, VmaFlags::empty(), 3, None)));
        assert!(t.merge_range(0, 4 * P).is_empty());
        // Non-contiguous page offsets do not merge either.
        let mut u = VmaTree::default();
        u.insert(Arc::new(Vma::new(0, P, Prot::READ, VmaFlags::empty(), 0, None)));
        u.insert(Arc::new(Vma::new(P, 2 * P, Prot::READ, VmaFlags::empty(), 5, None)));
        assert!(u.merge_range(0, 2 * P).is_empty());
    }
}
