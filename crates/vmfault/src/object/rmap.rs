//! The reverse map: from a page back to the PTEs that map it, two ways
//! (`VmConfig::rmap`, protocol 6 in `lib.rs`).
//!
//! # Backing records (`Rmap::Backing`, DragonFly's `vm_map_backing`)
//! Each object keeps, under its own small lock, one record per mapping of
//! one of its ranges (space, first address, end, page offset) and a link to
//! each of its shadow objects. The mappings of page `i` of object `o` are
//! the records of `o` that cover `i`, and those of the objects that shadow
//! `o` (recursively), which may map it read-only: the address is computed
//! from the record, the PTE there is checked to map the page. Metadata
//! grows with mappings and chain links, not with pages: a 64 MiB object
//! mapped by 64 spaces costs 64 records.
//!
//! DragonFly replicates a mapping's record at every level of its chain so
//! that a walk never climbs; we keep one record per mapping, on its top
//! object, plus one link per shadow, and climb the links instead: a fork
//! then adds two links and one record per VMA, where replication would add
//! one record per VMA per level, and a collapse (`shadow.rs`) moves one
//! link instead of rewriting the records of every VMA above. A walk takes
//! one object's lock at a time and copies what it needs, so it never holds
//! two: the order against collapses (top-down) cannot be violated.
//!
//! Records are added when a VMA with an object enters a space's index (or
//! gets its object, `resolve::prepare`) and removed when it leaves it, under
//! the map lock; several identical VMAs may be in flight at once (a
//! renewed VMA and its retired copy), so records are a multiset.
//!
//! # pv entries (`Rmap::PvEntry`, the baseline)
//! One entry (space, address) per present PTE that maps a data page, on a
//! list per frame ([`PvTable`]), added by every fault that installs a PTE
//! and removed by every zap, under the PTE lock: metadata grows with pages
//! times mappings, and every fault pays a list operation.
//!
//! Lock order: the rmap lock here and each frame's pv lock are leaves
//! (`sync::rank`: nothing is taken while either is held); the callers may
//! hold the map lock, an object lock or a PTE lock around them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use super::Env;
use super::Object;
use crate::phys::Pfn;
use crate::sync::rank::{self, Rank, Ranked};

/// A backing record's identity: (space id, first address, end, page offset).
pub(crate) type BackingKey = (u64, u64, u64, u64);

type Record = (BackingKey, u32);

/// The reverse map of one object.
#[derive(Debug, Default)]
pub(crate) struct ObjRmap {
    /// `[L]` the rmap lock, a leaf (taken under the map lock, an object
    /// lock or a PTE lock; nothing inside it).
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// `[L]` (`ObjRmap::inner`) records of the mappings of this object's ranges, counted. A
    /// record names its space by id only (a walk finds the space in the
    /// machine's registry): holding a reference would write the space's
    /// count, a line every vCPU of the space shares, at each new mapping.
    backings: Backings,
    /// `[L]` (`ObjRmap::inner`) the objects whose backing object this is (dead ones pruned lazily).
    shadows: Vec<Weak<Object>>,
}

/// A multiset of backing records: the first in place, the others in a
/// table. Most objects have one mapping all their life (a `malloc1` or
/// `vmlocal` loop's), and a table allocated at its first insert was a
/// heap allocation per loop.
#[derive(Debug, Default)]
struct Backings {
    /// `[L]` (`ObjRmap::inner`) a record and its count, if any (not
    /// necessarily the first added).
    one: Option<Record>,
    /// `[L]` (`ObjRmap::inner`) the other records and their counts.
    more: HashMap<BackingKey, u32>,
}

impl Backings {
    /// Add one of `key`.
    fn add(&mut self, key: BackingKey) {
        match &mut self.one {
            Some((k, n)) if *k == key => *n += 1,
            None if self.more.is_empty() => self.one = Some((key, 1)),
            _ => *self.more.entry(key).or_insert(0) += 1,
        }
    }

    /// Take one of `key` away; false if there was none.
    fn remove(&mut self, key: BackingKey) -> bool {
        if let Some((k, n)) = &mut self.one
            && *k == key
        {
            *n -= 1;
            if *n == 0 {
                self.one = None;
            }
            return true;
        }
        match self.more.get_mut(&key) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                self.more.remove(&key);
                if self.more.len() * 4 < self.more.capacity() {
                    self.more.shrink_to_fit();
                }
            }
            None => return false,
        }
        true
    }

    /// Every record (each once, whatever its count).
    fn keys(&self) -> impl Iterator<Item = &BackingKey> {
        self.one.iter().map(|(k, _)| k).chain(self.more.keys())
    }

    /// How many records, counted with multiplicity.
    fn count(&self) -> u32 {
        self.one.map_or(0, |(_, n)| n) + self.more.values().sum::<u32>()
    }

    /// Bytes they hold: the one in place, and the table's slots with their
    /// control bytes.
    fn footprint(&self) -> usize {
        usize::from(self.one.is_some()) * size_of::<Record>() + self.more.capacity() * (size_of::<Record>() + 1)
    }
}

impl Inner {
    /// Bytes of metadata this list holds (records, hash table slots, control bytes, links).
    fn footprint(&self) -> i64 {
        (self.backings.footprint() + self.shadows.capacity() * size_of::<Weak<Object>>()) as i64
    }
}

/// Machine-wide reverse-map totals (backing records and links; pv entries
/// are counted from their table when statistics are read). Changed on
/// mapping changes and by a fault that gives a VMA its object, so each
/// thread adds to a shard of its own (two vCPUs mapping disjoint ranges
/// write no line in common); statistics sum the shards.
#[derive(Debug)]
pub(crate) struct RmapTotals {
    /// `[S]` per shard (a thread's, by [`shard`]): bytes held by the
    /// objects' lists and backing records (with multiplicity), `[a]` each.
    shards: Box<[crate::sync::CachePadded<[AtomicI64; 2]>]>,
}

/// Shards of [`RmapTotals`]: threads beyond this many share them.
const SHARDS: usize = 64;

/// The calling thread's shard, fixed at its first use.
fn shard() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    std::thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    MINE.with(|s| *s)
}

impl Default for RmapTotals {
    fn default() -> Self {
        RmapTotals {
            shards: (0..SHARDS).map(|_| crate::sync::CachePadded([AtomicI64::new(0), AtomicI64::new(0)])).collect(),
        }
    }
}

impl RmapTotals {
    /// Add `bytes` and `records` (either may be negative) to the calling
    /// thread's shard.
    fn add(&self, bytes: i64, records: i64) {
        let [b, r] = &*self.shards[shard()];
        if bytes != 0 {
            b.fetch_add(bytes, Ordering::Relaxed);
        }
        if records != 0 {
            r.fetch_add(records, Ordering::Relaxed);
        }
    }

    /// (bytes, records) over every shard (a snapshot; never negative).
    pub(crate) fn totals(&self) -> (u64, u64) {
        let sum = |k: usize| self.shards.iter().map(|s| s[k].load(Ordering::Relaxed)).sum::<i64>().max(0) as u64;
        (sum(0), sum(1))
    }
}

impl ObjRmap {
    fn lock(&self) -> Ranked<MutexGuard<'_, Inner>> {
        rank::lock(&self.inner, Rank::Leaf)
    }

    /// Run `f` on the list, accounting for its change in size.
    fn change<R>(&self, m: &Env, f: impl FnOnce(&mut Inner) -> (R, i64)) -> R {
        let mut g = self.lock();
        let before = g.footprint();
        let (r, records) = f(&mut g);
        let delta = g.footprint() - before;
        drop(g);
        m.rmap.add(delta, records);
        r
    }

    /// Record a mapping of this object.
    fn link(&self, m: &Env, key: BackingKey) {
        self.change(m, |g| {
            g.backings.add(key);
            ((), 1)
        })
    }

    /// Forget one record of a mapping (one that `link` added).
    fn unlink(&self, m: &Env, key: BackingKey) {
        self.change(m, |g| {
            if g.backings.remove(key) {
                ((), -1)
            } else {
                // Diagnostic: nothing to remove is the right outcome.
                debug_assert!(false, "unlinking a backing record that was never linked: {key:?}");
                ((), 0)
            }
        })
    }

    /// Link a new shadow object (called as it is built on top of this one).
    pub(crate) fn add_shadow(&self, m: &Env, shadow: Weak<Object>) {
        self.change(m, |g| {
            g.shadows.retain(|w| w.strong_count() > 0);
            g.shadows.push(shadow);
            ((), 0)
        })
    }

    /// Give back what the list holds (the object is going away).
    pub(crate) fn clear(&self, m: &Env) {
        self.change(m, |g| {
            let n = g.backings.count();
            *g = Inner::default();
            ((), -i64::from(n))
        })
    }

    /// The mappings that may map page `pindex` of this object: from its own
    /// records, then from its shadows' (climbing). Each is (space id,
    /// address); a space that has gone (or an id reused since: the caller
    /// checks each PTE) may be among them. Locks one object at a time.
    pub(crate) fn mappings_of(object: &Arc<Object>, pindex: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut todo = vec![object.clone()];
        while let Some(o) = todo.pop() {
            let g = o.rmap.lock();
            for &(space, start, end, pgoff) in g.backings.keys() {
                let pages = (end - start) >> crate::types::PAGE_SHIFT;
                if pindex >= pgoff && pindex - pgoff < pages {
                    out.push((space, start + ((pindex - pgoff) << crate::types::PAGE_SHIFT)));
                }
            }
            todo.extend(g.shadows.iter().filter_map(Weak::upgrade));
        }
        out
    }
}

impl Object {
    /// Record a mapping of `key`'s range of this object (by the space
    /// `key` names).
    pub(crate) fn link(&self, key: BackingKey) {
        self.rmap.link(&self.env, key);
    }

    /// Forget one record of `key` (the mapping left its space's index).
    pub(crate) fn unlink(&self, key: BackingKey) {
        self.rmap.unlink(&self.env, key);
    }
}

/// One pv entry: a PTE of space `space` (its id) at `addr` maps the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pv {
    /// The space's id (`Space::id`).
    pub(crate) space: u64,
    /// The virtual address of the PTE.
    pub(crate) addr: u64,
}

/// The pv lists, one per frame (empty unless `Rmap::PvEntry`).
#[derive(Debug, Default)]
pub(crate) struct PvTable {
    /// `[L]` the pv lock of each frame, a leaf (taken under the PTE lock
    /// of the PTE that changes), around that frame's list.
    lists: Box<[Mutex<Vec<Pv>>]>,
}

impl PvTable {
    /// A table for `frames` frames.
    pub(crate) fn new(frames: u32) -> Result<PvTable, crate::Error> {
        let mut lists = Vec::new();
        lists.try_reserve_exact(frames as usize).map_err(|_| crate::Error::HostMemory {
            what: "the pv lists",
            need: u64::from(frames) * std::mem::size_of::<Mutex<Vec<Pv>>>() as u64,
            available: crate::phys::host_available().unwrap_or(0),
        })?;
        lists.extend((0..frames).map(|_| Mutex::new(Vec::new())));
        Ok(PvTable { lists: lists.into_boxed_slice() })
    }

    fn list(&self, pfn: Pfn) -> Ranked<MutexGuard<'_, Vec<Pv>>> {
        rank::lock(&self.lists[pfn.raw() as usize], Rank::Leaf)
    }

    /// A PTE now maps `pfn`. Called under that PTE's lock.
    pub(crate) fn add(&self, pfn: Pfn, pv: Pv) {
        self.list(pfn).push(pv);
    }

    /// A PTE no longer maps `pfn`. Called under that PTE's lock.
    pub(crate) fn remove(&self, pfn: Pfn, pv: Pv) {
        let mut l = self.list(pfn);
        if let Some(i) = l.iter().position(|&e| e == pv) {
            l.swap_remove(i);
            if l.is_empty() {
                *l = Vec::new();
            }
        } else {
            // Diagnostic: a list that is a superset is safe (walkers check
            // each PTE under its lock).
            debug_assert!(false, "no pv entry for {pv:?} on frame {}", pfn.raw());
        }
    }

    /// The entries of `pfn` now.
    pub(crate) fn entries(&self, pfn: Pfn) -> Vec<Pv> {
        self.list(pfn).clone()
    }

    /// (entries, bytes of entries allocated) over every frame.
    pub(crate) fn totals(&self) -> (u64, u64) {
        self.lists.iter().fold((0, 0), |(n, b), l| {
            let l = rank::lock(l, Rank::Leaf);
            (n + l.len() as u64, b + (l.capacity() * size_of::<Pv>()) as u64)
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn backing_records_are_a_multiset_with_the_first_in_place() {
        let (a, b, c) = ((1, 0x1000, 0x2000, 1), (1, 0x3000, 0x5000, 3), (2, 0x1000, 0x2000, 1));
        let mut r = Backings::default();
        assert_eq!((r.count(), r.footprint()), (0, 0));
        r.add(a);
        assert_eq!((r.count(), r.footprint()), (1, size_of::<Record>()), "one record: no table");
        r.add(a);
        r.add(b);
        r.add(c);
        r.add(b);
        assert_eq!(r.count(), 5);
        let mut keys: Vec<_> = r.keys().copied().collect();
        keys.sort_unstable();
        assert_eq!(keys, vec![a, b, c], "each record once");
        // The one in place goes first; the others stay where they are.
        assert!(r.remove(a) && r.remove(a));
        assert!(!r.remove(a), "no third of it");
        assert_eq!(r.count(), 3);
        assert!(r.remove(b) && r.remove(c));
        assert!(!r.remove(c));
        assert_eq!(r.keys().copied().collect::<Vec<_>>(), vec![b]);
        assert!(r.remove(b));
        assert_eq!((r.count(), r.keys().count()), (0, 0));
        // Empty, the place takes the next first record again.
        r.add(c);
        assert!(r.one.is_some() && r.more.is_empty());
    }
}
