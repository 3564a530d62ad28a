//! [`Pmap`]: one address space's page table, and the operations on ranges
//! of PTEs that munmap, mprotect and madvise need.
//!
//! Lockless walkers (the software MMU, the speculative fault path) read PTEs
//! inside RCU read-side sections. Writers change a PTE only while holding
//! the PTE lock of the page-table page that contains it (`[P]`), taken once
//! per page-table page for range operations. Page-table pages themselves are
//! freed only after a grace period, by [`Pmap::prune`] when no VMA covers
//! their range any more (Linux's `free_pgtables`), or when the space dies.
//!
//! # A second MMU
//!
//! Something else may translate this space's addresses too: a host view
//! (a window of the host's address space whose host mappings mirror these
//! PTEs, so that code loads and stores natively). It sits behind
//! [`SecondMmu`], attached with [`Pmap::attach_second`], as a BSD kernel's
//! machine-dependent pmap sits under its machine-independent VM: the fault
//! path and the operations above do not know it is there. It fills itself
//! lazily (its own faults come to vmfault's fault path), and this table
//! tells it of every PTE that loses its frame or a right, by range, before
//! the change that did it returns (and so before a freed frame can be
//! reused, and before a narrowing is relied on): every clear and narrowing
//! goes through [`Pmap::update_range`], and every install that replaces a
//! present PTE through [`Pmap::install_locked`]. With none attached, the
//! cost is one relaxed load per change.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::pte::Pte;
use super::radix::{Leaf, OutOfFrames, PruneRange, Radix, TABLE_LIMIT, next_nonzero};
use crate::phys::{Frames, Pfn, PhysMem, WORDS};
use crate::sync::CachePadded;
use crate::sync::generation::{Generation, Stamp};
use crate::sync::rank::{self, Rank};
use crate::sync::spin::{self, WordGuard};
use crate::types::{Access, PAGE_SHIFT, Prot};

/// An address space's page table.
#[derive(Debug)]
pub(crate) struct Pmap {
    /// `[I]` root; entries `[a]`, changed under the PTE lock (leaves) or by
    /// CAS from empty (interior levels).
    radix: Radix,
    /// `[S]` the table's counts, per region slot (see [`Region`]).
    regions: [CachePadded<Region>; REGION_SLOTS],
    /// `[a]` whether any second MMU is attached (written under `seconds`;
    /// read by every change, which looks at `seconds` only if set).
    has_second: AtomicBool,
    /// `[L]` the second MMUs that mirror this table (a leaf lock).
    seconds: Mutex<Vec<Arc<dyn SecondMmu>>>,
}

/// log2 of the bytes of a region: what one entry of the root covers (512
/// GiB; a zone of `map_lock=zoned`). Nothing below the root spans two.
const REGION_SHIFT: u32 = PAGE_SHIFT + 3 * super::radix::BITS;
/// Region slots: regions `r` and `r + REGION_SLOTS` share one.
const REGION_SLOTS: usize = 16;

/// A page table's counts for the regions of one slot, on a line of its
/// own: changes and faults in different regions (vCPUs mapping and
/// unmapping in zones of their own) write none in common. A count shared
/// by the space, bumped by every prune and read by every fault, made
/// `malloc1` at two vCPUs slower than at one.
#[derive(Debug)]
struct Region {
    /// `[a]` page-table pages below the root in these regions (written
    /// when one is added or pruned).
    tables: AtomicU64,
    /// `[M][a]` prunes that detached page-table pages of these regions
    /// (bumped under the map write lock, after the detach; read
    /// lockless): how a walk made before the VMA snapshot was read knows
    /// its leaf is still attached (see [`Missed`]).
    prunes: Generation,
}

/// A second MMU that mirrors a page table (see the module docs): told of
/// every PTE in `start..end` (addresses) that lost its frame or a right.
/// It must stop translating them through what it had before it returns (a
/// host view unmaps them from the host); it may drop more than it is told
/// and fill itself again by faulting. Called with no lock of this crate
/// held but possibly a PTE lock (a leaf of the lock order may be taken).
pub(crate) trait SecondMmu: Send + Sync + std::fmt::Debug {
    /// Stop translating `start..end` as before.
    fn invalidate(&self, start: u64, end: u64);
}

/// What the software MMU's lookup found when the PTE did not allow the
/// access: the PTE slot (if every level above it exists) and the prune
/// count read before the walk. The speculative fault, in the same RCU
/// section, takes the slot from here instead of walking again, once it has
/// read the VMA snapshot (`Pmap::pte_after`).
///
/// Why the count: the fault validates its VMA under the PTE lock, which
/// proves the slot attached only if the VMA was found *before* the walk
/// (a prune follows the retirement of the VMAs above it). Found after it,
/// the VMA may be a new one, mapped once the walked table was pruned. A
/// prune bumps the count (Release) after its detach and before the map
/// lock is released, so before any later snapshot is published: a fault
/// whose snapshot read (Acquire) shows such a VMA sees the count changed
/// and walks again; one whose first read of the count already showed the
/// bump sees the detach in its walk (`sync::generation`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Missed<'p> {
    leaf: Option<Leaf<'p>>,
    prunes: Stamp,
    /// The region slot whose count `prunes` is.
    region: usize,
}

/// A vCPU's last walk in one page table: the level-0 node that holds the
/// PTEs of one 2 MiB block, and the prune count read before the walk (a
/// one-entry TLB of page-table pages, kept per vCPU per space). A lookup
/// in the same block with the count unchanged takes the node from here
/// instead of walking four levels: as the walk itself would, it reads
/// PTEs of a node that no prune has detached since the count it holds,
/// or (a prune in flight, its bump not yet seen) of a detached one that
/// is still allocated for the reader's section, whose PTEs the prune
/// zeroed first; a fault then re-checks the count after the VMA snapshot
/// exactly as for a walk ([`Missed`]). Written and read by its vCPU only
/// (Relaxed).
#[derive(Debug, Default)]
pub(crate) struct LeafHint {
    /// The block (`vpn >> 9`) above bit 32, the node below; 0: none.
    block_node: AtomicU64,
    /// The prune count the walk read.
    prunes: AtomicU64,
}

impl LeafHint {
    /// The node this hint holds for `block`, if its count is `now`.
    #[inline]
    fn get(&self, block: u64, now: Stamp) -> Option<Pfn> {
        let w = self.block_node.load(Ordering::Relaxed);
        (w != 0 && w >> 32 == block + 1 && Stamp::from_bits(self.prunes.load(Ordering::Relaxed)).holds_at(now))
            .then_some(Pfn::decode(w as u32))
    }

    /// Remember a walk of `block` to `node` made after the count `stamp`.
    #[inline]
    fn set(&self, block: u64, node: Pfn, stamp: Stamp) {
        self.block_node.store(((block + 1) << 32) | u64::from(node.raw()), Ordering::Relaxed);
        self.prunes.store(stamp.to_bits(), Ordering::Relaxed);
    }
}

/// The region slot of `addr`.
#[inline]
fn region_slot(addr: u64) -> usize {
    (addr >> REGION_SHIFT) as usize % REGION_SLOTS
}

#[inline]
fn vpn(addr: u64) -> u64 {
    addr >> PAGE_SHIFT
}

impl Pmap {
    /// An empty page table (one root page).
    pub(crate) fn new(frames: &Frames<'_>) -> Result<Pmap, OutOfFrames> {
        Ok(Pmap {
            radix: Radix::table(frames)?,
            regions: std::array::from_fn(|_| {
                CachePadded(Region { tables: AtomicU64::new(0), prunes: Generation::new() })
            }),
            has_second: AtomicBool::new(false),
            seconds: Mutex::new(Vec::new()),
        })
    }

    /// Attach a second MMU (see the module docs); it hears of every change
    /// from now on.
    pub(crate) fn attach_second(&self, second: Arc<dyn SecondMmu>) {
        let mut s = rank::lock(&self.seconds, Rank::Leaf);
        s.push(second);
        self.has_second.store(true, Ordering::Relaxed);
    }

    /// Detach a second MMU attached with [`attach_second`](Pmap::attach_second).
    pub(crate) fn detach_second(&self, second: &Arc<dyn SecondMmu>) {
        let mut s = rank::lock(&self.seconds, Rank::Leaf);
        s.retain(|x| !Arc::ptr_eq(x, second));
        self.has_second.store(!s.is_empty(), Ordering::Relaxed);
    }

    /// Tell the second MMUs that `start..end` lost frames or rights.
    #[inline]
    fn invalidate(&self, start: u64, end: u64) {
        if self.has_second.load(Ordering::Relaxed) {
            self.invalidate_slow(start, end);
        }
    }

    #[cold]
    #[inline(never)]
    fn invalidate_slow(&self, start: u64, end: u64) {
        let seconds = rank::lock(&self.seconds, Rank::Leaf).clone();
        for s in seconds {
            s.invalidate(start, end);
        }
    }

    /// Install `new` in the PTE `leaf`, whose value is `old`, under its PTE
    /// lock (`_ptl`): Release, so that a walker that sees it sees the
    /// page's contents. If `old` mapped another frame, or allowed more,
    /// the second MMUs hear of it first.
    #[inline]
    pub(crate) fn install_locked(&self, leaf: &Leaf<'_>, _ptl: &WordGuard<'_>, addr: u64, old: Pte, new: Pte) {
        if old.loses_to(new) {
            let page = addr & !((1 << PAGE_SHIFT) - 1);
            self.invalidate(page, page + (1 << PAGE_SHIFT));
        }
        leaf.entry.store(new.0, Ordering::Release);
    }

    /// Page-table pages in use, the root included.
    pub(crate) fn tables(&self) -> u64 {
        1 + self.regions.iter().map(|r| r.tables.load(Ordering::Relaxed)).sum::<u64>()
    }

    /// The counts of the region of `addr`.
    #[inline]
    fn region(&self, addr: u64) -> &Region {
        &self.regions[region_slot(addr)]
    }

    /// The frame behind `addr` if its PTE lets `access` through: the TLB
    /// hit of the software MMU. Call inside an RCU read-side section and
    /// use the frame only inside it.
    #[inline]
    pub(crate) fn translate(&self, phys: &PhysMem, addr: u64, access: Access) -> Option<Pfn> {
        let leaf = self.radix.leaf(phys, vpn(addr))?;
        // Acquire pairs with the Release store that installed the PTE after
        // the page was filled.
        let pte = Pte(leaf.entry.load(Ordering::Acquire));
        pte.allows(access).then(|| pte.pfn())
    }

    /// `translate`, keeping what a fault needs when it misses (see
    /// [`Missed`]), through this vCPU's [`LeafHint`] of this table: no
    /// walk for an address in the block of its last one (a fault's
    /// sequential neighbours, a copy's next page) while no prune
    /// happened. Same caller rule.
    #[inline]
    pub(crate) fn lookup<'p>(
        &self,
        phys: &'p PhysMem,
        addr: u64,
        access: Access,
        hint: &LeafHint,
    ) -> Result<Pfn, Missed<'p>> {
        let region = region_slot(addr);
        let prunes = self.regions[region].prunes.stamp();
        let (v, block) = (vpn(addr), vpn(addr) >> 9);
        let leaf = match hint.get(block, prunes) {
            Some(node) => Some(Leaf::new(&phys.words(node)[(v % WORDS as u64) as usize], node)),
            None => {
                let leaf = self.radix.leaf(phys, v);
                if let Some(l) = &leaf {
                    hint.set(block, l.node(), prunes);
                }
                leaf
            }
        };
        if let Some(l) = &leaf {
            // Acquire: as in `translate`.
            let pte = Pte(l.entry.load(Ordering::Acquire));
            if pte.allows(access) {
                return Ok(pte.pfn());
            }
        }
        Err(Missed { leaf, prunes, region })
    }

    /// The PTE slot for `addr`, if its page-table levels exist (same caller
    /// rule as `translate`).
    #[inline]
    pub(crate) fn pte<'p>(&self, phys: &'p PhysMem, addr: u64) -> Option<Leaf<'p>> {
        self.radix.leaf(phys, vpn(addr))
    }

    /// The PTE of `addr` now (`Pte::NONE` where no table level exists), for
    /// inspection (`mincore`, `usage`); same caller rule as `translate`.
    #[inline]
    pub(crate) fn pte_now(&self, phys: &PhysMem, addr: u64) -> Pte {
        self.pte(phys, addr).map_or(Pte::NONE, |l| Pte(l.entry.load(Ordering::Acquire)))
    }

    /// The PTE slot for `addr` as [`Pmap::pte`] finds it, taken from
    /// `missed` (a lookup of `addr` earlier in the caller's section) when
    /// no prune has happened since. Call after reading the VMA snapshot.
    #[inline]
    pub(crate) fn pte_after<'p>(&self, phys: &'p PhysMem, addr: u64, missed: Option<Missed<'p>>) -> Option<Leaf<'p>> {
        match missed {
            Some(m) if self.regions[m.region].prunes.unchanged(m.prunes) => m.leaf,
            _ => self.pte(phys, addr),
        }
    }

    /// The PTE slot for `addr`, allocating page-table pages as needed.
    pub(crate) fn pte_alloc<'p>(&self, frames: &Frames<'p>, addr: u64) -> Result<Leaf<'p>, OutOfFrames> {
        let (leaf, added) = self.radix.leaf_alloc(frames, vpn(addr))?;
        if added > 0 {
            self.region(addr).tables.fetch_add(u64::from(added), Ordering::Relaxed);
        }
        Ok(leaf)
    }

    /// Take the PTE lock of the page-table page holding `leaf`; also says
    /// whether the lock was contended.
    #[inline]
    pub(crate) fn lock<'p>(phys: &'p PhysMem, leaf: &Leaf<'_>) -> (WordGuard<'p>, bool) {
        spin::lock_as(&phys.page(leaf.node()).ptl, Rank::Pte)
    }

    /// Apply `f` to every present PTE in `start..end` (addresses), each
    /// page-table page under its PTE lock; `f` returns the new value.
    /// Returns the number of PTEs changed.
    pub(crate) fn update_range(&self, phys: &PhysMem, start: u64, end: u64, mut f: impl FnMut(u64, Pte) -> Pte) -> u64 {
        let (s, e) = (vpn(start), vpn(end));
        let (mut changed, mut lost) = (0, false);
        self.radix.for_each_leaf_node(phys, s, e, |base, node| {
            let words = phys.words(node);
            let _g = spin::lock_as(&phys.page(node).ptl, Rank::Pte).0;
            let lo = (s.max(base) - base) as usize;
            let hi = (e.min(base + WORDS as u64) - base) as usize;
            // Eight empty PTEs skipped per test (most of a table a
            // one-page mapping's munmap reads is empty).
            let mut i = lo;
            while let Some((at, v)) = next_nonzero(words, i, hi) {
                i = at + 1;
                let slot = &words[at];
                // (`v` was read with Acquire, pairing with the install's
                // Release: what the fault did before, its reserve in the
                // object's index, happens-before what the caller does
                // after, a removal that reads the index's spans,
                // `Object::remove_range`.)
                let old = Pte(v);
                if !old.is_present() {
                    continue;
                }
                let new = f((base + at as u64) << PAGE_SHIFT, old);
                if new != old {
                    // Release: a walker that sees the new value also sees
                    // whatever the caller prepared for it.
                    slot.store(new.0, Ordering::Release);
                    changed += 1;
                    lost |= old.loses_to(new);
                }
            }
        });
        // `--cfg vmfault_mutation="second_mmu_not_told"`: a host view keeps
        // stale translations (tests/host_view.rs must fail, `.ci/run`).
        if lost && !crate::mutated!("second_mmu_not_told") {
            self.invalidate(start, end);
        }
        changed
    }

    /// Clear every PTE in `start..end`, calling `f(addr, old)` for each one
    /// that was present. The frames they mapped may still be in use by
    /// walkers until a grace period passes.
    pub(crate) fn zap(&self, phys: &PhysMem, start: u64, end: u64, mut f: impl FnMut(u64, Pte)) -> u64 {
        self.update_range(phys, start, end, |addr, old| {
            f(addr, old);
            Pte::NONE
        })
    }

    /// Narrow every present PTE in `start..end` to `prot` (`PROT_NONE`
    /// unmaps, calling `unmapped` as `zap` does; the pages stay in their objects).
    pub(crate) fn protect(
        &self,
        phys: &PhysMem,
        start: u64,
        end: u64,
        prot: Prot,
        unmapped: impl FnMut(u64, Pte),
    ) -> u64 {
        if prot.is_empty() {
            return self.zap(phys, start, end, unmapped);
        }
        self.update_range(phys, start, end, |_, old| old.restricted(prot))
    }

    /// Detach the page-table pages that intersect `start..end` (the range
    /// just unmapped) and lie wholly inside `floor..ceiling` (addresses; the
    /// gap between the neighbouring VMAs), and push them onto `out`, to be
    /// freed after a grace period. Their PTEs must already be clear.
    ///
    /// The caller holds the map lock for writing, which excludes faults
    /// that could add a table in the range.
    pub(crate) fn prune(&self, phys: &PhysMem, start: u64, end: u64, floor: u64, ceiling: u64, out: &mut Vec<Pfn>) {
        let index = |a: u64| if a >= TABLE_LIMIT << PAGE_SHIFT { TABLE_LIMIT } else { vpn(a) };
        // Region by region, each counting its own (no table below the
        // root spans two).
        let (mut at, end) = (start, end.min(TABLE_LIMIT << PAGE_SHIFT));
        while at < end {
            let next = ((at >> REGION_SHIFT) + 1) << REGION_SHIFT;
            let before = out.len();
            let range = PruneRange {
                start: index(at),
                end: index(end.min(next)),
                floor: index(floor),
                ceiling: index(ceiling),
            };
            self.radix.prune(phys, range, out);
            let freed = (out.len() - before) as u64;
            if freed > 0 {
                let region = self.region(at);
                region.tables.fetch_sub(freed, Ordering::Relaxed);
                // After the detach, before the map lock is released (see `Missed`).
                region.prunes.bump();
            }
            at = next;
        }
    }

    /// Push every page-table page onto `out`, to be freed after a grace
    /// period (the space is dying: `&mut self` proves no walker holds the
    /// table). PTEs still present are dropped with it: the pages they map
    /// belong to objects, which free them.
    pub(crate) fn teardown(&mut self, phys: &PhysMem, out: &mut Vec<Pfn>) {
        self.radix.teardown(phys, out, None);
        for r in self.regions.iter() {
            r.tables.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::phys::Kind;
    use crate::sync::rcu::Rcu;

    /// 64 frames, no per-CPU caches.
    fn small_phys(rcu: &Rcu) -> PhysMem {
        let no_pcp = crate::phys::PcpConfig { capacity: 0, fill: 0, drain: 0, max: 0 };
        PhysMem::new(64, false, rcu, no_pcp, false, false).unwrap()
    }

    #[test]
    fn a_prune_counts_and_bumps_only_the_regions_it_detached_from() {
        let (rcu, _r) = Rcu::new(1);
        let phys = small_phys(&rcu);
        let frames = Frames::global(&phys);
        let mut pmap = Pmap::new(&frames).unwrap();
        let region = 1u64 << REGION_SHIFT;
        // A page at the end of region 2 and one at the start of region 3
        // (slots 2 and 3), and one in region 18, which shares slot 2.
        let (a, b, far) = (3 * region - 4096, 3 * region, 18 * region);
        for addr in [a, b, far] {
            pmap.pte_alloc(&frames, addr).unwrap();
        }
        assert_eq!(pmap.tables(), 1 + 3 * 3, "the root and three levels under it for each");
        let stamp = |addr| pmap.regions[region_slot(addr)].prunes.stamp();
        let (sa, sb, s0) = (stamp(a), stamp(b), stamp(0));
        // One prune across the edge of regions 2 and 3: each region's own
        // tables, counted and bumped in its own slot.
        let mut out = Vec::new();
        pmap.prune(&phys, a, b + 4096, 2 * region, 4 * region, &mut out);
        assert_eq!(out.len(), 6);
        assert_eq!(pmap.tables(), 1 + 3, "region 18's stay");
        assert!(!pmap.regions[region_slot(a)].prunes.unchanged(sa));
        assert!(!pmap.regions[region_slot(b)].prunes.unchanged(sb));
        assert!(pmap.regions[region_slot(0)].prunes.unchanged(s0), "a region the prune did not touch");
        assert!(pmap.pte(&phys, far).is_some() && pmap.pte(&phys, a).is_none() && pmap.pte(&phys, b).is_none());
        // A range beyond the table's reach prunes nothing and ends.
        pmap.prune(&phys, 1 << 48, u64::MAX, 0, u64::MAX, &mut out);
        assert_eq!(out.len(), 6);
        phys.free_after_grace(&rcu, &out);
        let mut rest = Vec::new();
        pmap.teardown(&phys, &mut rest);
        assert_eq!(rest.len(), 4);
        phys.free_after_grace(&rcu, &rest);
    }

    #[test]
    fn install_translate_protect_zap_prune() {
        let (rcu, _r) = Rcu::new(1);
        let phys = small_phys(&rcu);
        let frames = Frames::global(&phys);
        let mut pmap = Pmap::new(&frames).unwrap();
        let addr = 0x7f00_0000_3000;
        assert_eq!(pmap.translate(&phys, addr, Access::Read), None);
        let leaf = pmap.pte_alloc(&frames, addr).unwrap();
        assert_eq!(pmap.tables(), 4);
        let frame = frames.publish(frames.alloc_zeroed().unwrap(), Kind::Data);
        {
            let (_g, contended) = Pmap::lock(&phys, &leaf);
            assert!(!contended);
            assert!(spin::try_lock(&phys.page(leaf.node()).ptl).is_none());
            leaf.entry.store(Pte::new(frame, true, false, true).0, Ordering::Release);
        }
        assert_eq!(pmap.translate(&phys, addr + 5, Access::Write), Some(frame));
        assert_eq!(pmap.translate(&phys, addr, Access::Exec), None);
        assert_eq!(pmap.protect(&phys, addr, addr + 4096, Prot::READ, |_, _| {}), 1);
        assert_eq!(pmap.translate(&phys, addr, Access::Write), None);
        assert_eq!(pmap.translate(&phys, addr, Access::Read), Some(frame));
        let mut seen = Vec::new();
        assert_eq!(pmap.zap(&phys, 0, 1 << 47, |a, p| seen.push((a, p.pfn()))), 1);
        assert_eq!(seen, vec![(addr, frame)]);
        let mut out = Vec::new();
        pmap.prune(&phys, addr, addr + 4096, 0, 1 << 47, &mut out);
        assert_eq!(out.len(), 3);
        assert_eq!(pmap.tables(), 1);
        out.push(frame);
        phys.free_after_grace(&rcu, &out);
        let mut rest = Vec::new();
        pmap.teardown(&phys, &mut rest);
        assert_eq!(rest.len(), 1);
        phys.free_after_grace(&rcu, &rest);
        assert_eq!(phys.global_free_frames(), 63);
    }
}
