//! A 4-level radix tree of atomic 64-bit entries whose nodes are frames.
//!
//! The same structure serves as the page table (index = virtual page number,
//! leaves = PTEs) and as a VM object's page index (index = page offset in the
//! object, leaves = frame numbers). 512 entries per node, 9 bits per level,
//! 36 bits of index: enough for the 2^35 pages of a 47-bit address space.
//!
//! # Concurrency
//! - Lookups are lockless: Acquire loads of each level's entry. The Acquire
//!   pairs with the Release CAS that published the child node, which was
//!   zeroed (plainly, as an `OwnedFrame`) before that CAS.
//! - Missing interior nodes are added with a CAS from 0; the loser frees its
//!   never-published frame.
//! - Interior nodes are removed only by [`Radix::prune`] / [`Radix::teardown`],
//!   which hand the frames back to the caller to be freed after a grace
//!   period, so a lockless walker that still holds a node sees valid memory.
//!   Callers exclude concurrent *allocation* in a pruned range themselves
//!   (page tables: the map lock held for writing).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::phys::{Frames, Kind, OwnedFrame, Pfn, PhysMem, WORDS};

/// Levels of the tree.
pub(crate) const LEVELS: u32 = 4;
/// Index bits per level.
pub(crate) const BITS: u32 = 9;
/// One past the largest index.
pub(crate) const INDEX_LIMIT: u64 = 1 << (LEVELS * BITS);

/// Interior entry: the child's frame number above bit 12, bit 0 = present.
const PRESENT: u64 = 1;

#[inline]
fn child_of(entry: u64) -> Pfn {
    Pfn((entry >> 12) as u32)
}

#[inline]
fn entry_for(child: Pfn) -> u64 {
    (u64::from(child.0) << 12) | PRESENT
}

#[inline]
fn slot_at(index: u64, level: u32) -> usize {
    ((index >> (BITS * level)) & (WORDS as u64 - 1)) as usize
}

/// Indexes covered by one entry of a node at `level`.
#[inline]
fn span(level: u32) -> u64 {
    1 << (BITS * level)
}

/// The tree ran out of frames for an interior node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutOfFrames;

/// A radix tree rooted at one frame.
#[derive(Debug)]
pub(crate) struct Radix {
    /// `[I]` the root node (level 3).
    root: Pfn,
    /// `[I]` the kind of its nodes (`TABLE` or `INDEX`).
    kind: Kind,
}

/// A leaf entry and the node (frame) that holds it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Leaf<'a> {
    /// The entry.
    pub(crate) entry: &'a AtomicU64,
    /// The level-0 node holding it (its descriptor's `ptl` is the PTE lock).
    pub(crate) node: Pfn,
}

impl Radix {
    /// A tree with a fresh root of frame kind `kind`.
    pub(crate) fn new(frames: &Frames<'_>, kind: Kind) -> Result<Radix, OutOfFrames> {
        let root = frames.alloc_zeroed().ok_or(OutOfFrames)?;
        Ok(Radix { root: frames.phys().publish(root, kind), kind })
    }

    /// The leaf entry for `index`, if every level above it exists.
    ///
    /// The caller must be inside an RCU read-side section or otherwise
    /// exclude pruning, for as long as it uses the result.
    #[inline]
    pub(crate) fn leaf<'p>(&self, phys: &'p PhysMem, index: u64) -> Option<Leaf<'p>> {
        debug_assert!(index < INDEX_LIMIT);
        let mut node = self.root;
        for level in (1..LEVELS).rev() {
            // Acquire pairs with the Release CAS in `leaf_alloc` that
            // published the (zeroed) child.
            let e = phys.words(node)[slot_at(index, level)].load(Ordering::Acquire);
            if e == 0 {
                return None;
            }
            node = child_of(e);
        }
        Some(Leaf { entry: &phys.words(node)[slot_at(index, 0)], node })
    }

    /// The leaf entry for `index`, adding missing interior nodes.
    /// Returns how many nodes this call added, for accounting.
    pub(crate) fn leaf_alloc<'p>(&self, frames: &Frames<'p>, index: u64) -> Result<(Leaf<'p>, u32), OutOfFrames> {
        debug_assert!(index < INDEX_LIMIT);
        let phys = frames.phys();
        let mut node = self.root;
        let mut added = 0;
        for level in (1..LEVELS).rev() {
            let slot = &phys.words(node)[slot_at(index, level)];
            let mut e = slot.load(Ordering::Acquire);
            if e == 0 {
                let fresh: OwnedFrame = frames.alloc_zeroed().ok_or(OutOfFrames)?;
                // The kind is set before the frame becomes reachable, so
                // whoever finds it (and may free it) sees its real kind.
                let child = phys.publish(fresh, self.kind);
                // Release publishes the zeroed contents with the pointer.
                match slot.compare_exchange(0, entry_for(child), Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        e = entry_for(child);
                        added += 1;
                    }
                    Err(winner) => {
                        // Never reachable: take it back and free it.
                        frames.free_owned(phys.unpublish(child, self.kind));
                        e = winner;
                    }
                }
            }
            node = child_of(e);
        }
        Ok((Leaf { entry: &phys.words(node)[slot_at(index, 0)], node }, added))
    }

    /// Call `f(base, node)` for every level-0 node that covers part of
    /// `start..end`; `base` is the index of the node's first entry. Absent
    /// subtrees are skipped. Same caller rule as [`Radix::leaf`].
    pub(crate) fn for_each_leaf_node(&self, phys: &PhysMem, start: u64, end: u64, mut f: impl FnMut(u64, Pfn)) {
        let end = end.min(INDEX_LIMIT);
        if start < end {
            walk(phys, self.root, LEVELS - 1, 0, start, end, &mut f);
        }
    }

    /// Call `f(index, leaf)` for every non-zero leaf entry with index in
    /// `start..end`. Same caller rule as [`Radix::leaf`].
    pub(crate) fn for_each_present(&self, phys: &PhysMem, start: u64, end: u64, mut f: impl FnMut(u64, Leaf<'_>)) {
        self.for_each_leaf_node(phys, start, end, |base, node| {
            let words = phys.words(node);
            let lo = start.max(base) - base;
            let hi = end.min(base + WORDS as u64) - base;
            for i in lo..hi {
                let entry = &words[i as usize];
                if entry.load(Ordering::Acquire) != 0 {
                    f(base + i, Leaf { entry, node });
                }
            }
        });
    }

    /// Detach every interior node that intersects `r.start..r.end` and
    /// whose whole index range lies inside `r.floor..r.ceiling`, and push
    /// it (with its subtree) onto `out`, to be freed after a grace period.
    /// Leaf entries in detached nodes must already be zero (debug builds
    /// check). The root stays.
    ///
    /// Only slots over `start..end` are visited (Linux's `free_pgd_range`):
    /// a node that lay wholly in a gap before this change was pruned by the
    /// change that made the gap, so a walk over the whole gap would read
    /// hundreds of empty slots for nothing (it did: a quarter of `brk1`).
    ///
    /// The caller excludes concurrent `leaf_alloc` in `floor..ceiling`.
    pub(crate) fn prune(&self, phys: &PhysMem, r: PruneRange, out: &mut Vec<Pfn>) {
        let r = PruneRange { ceiling: r.ceiling.min(INDEX_LIMIT), start: r.start.max(r.floor), ..r };
        let r = PruneRange { end: r.end.min(r.ceiling), ..r };
        if r.start < r.end {
            prune_node(phys, self.root, LEVELS - 1, 0, &r, out);
        }
    }

    /// Push every node, root included, onto `out`, and the present leaf
    /// entries' values onto `leaves`. The caller owns the tree exclusively
    /// (`&mut self`); frames still go through a grace period when freed.
    pub(crate) fn teardown(&mut self, phys: &PhysMem, out: &mut Vec<Pfn>, leaves: &mut Vec<u64>) {
        collect(phys, self.root, LEVELS - 1, out, Some(leaves));
    }
}

fn walk(phys: &PhysMem, node: Pfn, level: u32, base: u64, start: u64, end: u64, f: &mut impl FnMut(u64, Pfn)) {
    let words = phys.words(node);
    let first = if start > base { ((start - base) / span(level)) as usize } else { 0 };
    for (i, slot) in words.iter().enumerate().skip(first) {
        let lo = base + i as u64 * span(level);
        if lo >= end {
            break;
        }
        let e = slot.load(Ordering::Acquire);
        if e == 0 {
            continue;
        }
        if level == 1 {
            f(lo, child_of(e));
        } else {
            walk(phys, child_of(e), level - 1, lo, start, end, f);
        }
    }
}

/// What a prune may free (see [`Radix::prune`]), in index units.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PruneRange {
    /// First index whose nodes are visited.
    pub(crate) start: u64,
    /// One past the last index whose nodes are visited.
    pub(crate) end: u64,
    /// Nodes may be freed only if their range starts at or after this.
    pub(crate) floor: u64,
    /// ... and ends at or before this.
    pub(crate) ceiling: u64,
}

fn prune_node(phys: &PhysMem, node: Pfn, level: u32, base: u64, r: &PruneRange, out: &mut Vec<Pfn>) {
    if level == 0 {
        return;
    }
    let words = phys.words(node);
    let first = if r.start > base { ((r.start - base) / span(level)) as usize } else { 0 };
    for (i, slot) in words.iter().enumerate().skip(first) {
        let lo = base + i as u64 * span(level);
        if lo >= r.end {
            break;
        }
        let e = slot.load(Ordering::Acquire);
        if e == 0 {
            continue;
        }
        let hi = lo + span(level);
        if r.floor <= lo && hi <= r.ceiling {
            slot.store(0, Ordering::Release);
            collect(phys, child_of(e), level - 1, out, None);
        } else {
            prune_node(phys, child_of(e), level - 1, lo, r, out);
        }
    }
}

fn collect(phys: &PhysMem, node: Pfn, level: u32, out: &mut Vec<Pfn>, mut leaves: Option<&mut Vec<u64>>) {
    for slot in phys.words(node).iter() {
        let e = slot.load(Ordering::Acquire);
        if e == 0 {
            continue;
        }
        if level == 0 {
            match leaves.as_deref_mut() {
                Some(l) => l.push(e),
                None => debug_assert!(false, "pruning a leaf node with live entry {e:#x}"),
            }
        } else {
            collect(phys, child_of(e), level - 1, out, leaves.as_deref_mut());
        }
    }
    out.push(node);
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::phys::PcpConfig;

    const NO_PCP: PcpConfig = PcpConfig { capacity: 0, fill: 0, drain: 0 };

    #[test]
    fn leaves_are_allocated_and_found() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let r = Radix::new(&frames, Kind::Index).unwrap();
        assert!(r.leaf(&phys, 12345).is_none());
        let (leaf, added) = r.leaf_alloc(&frames, 12345).unwrap();
        assert_eq!(added, 3);
        leaf.entry.store(77, Ordering::Relaxed);
        let again = r.leaf(&phys, 12345).unwrap();
        assert_eq!(again.entry.load(Ordering::Relaxed), 77);
        assert_eq!(again.node, leaf.node);
        let (_, added) = r.leaf_alloc(&frames, 12346).unwrap();
        assert_eq!(added, 0);
        let far = INDEX_LIMIT - 1;
        r.leaf_alloc(&frames, far).unwrap().0.entry.store(5, Ordering::Relaxed);
        let mut seen = Vec::new();
        r.for_each_present(&phys, 0, INDEX_LIMIT, |i, l| seen.push((i, l.entry.load(Ordering::Relaxed))));
        assert_eq!(seen, vec![(12345, 77), (far, 5)]);
        let mut seen = Vec::new();
        r.for_each_present(&phys, 12346, far, |i, _| seen.push(i));
        assert!(seen.is_empty());
    }

    #[test]
    fn prune_frees_only_whole_subtrees() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let r = Radix::new(&frames, Kind::Table).unwrap();
        // Two leaves in different level-0 nodes under one level-1 node.
        r.leaf_alloc(&frames, 0).unwrap();
        r.leaf_alloc(&frames, 512).unwrap();
        let mut out = Vec::new();
        let all = |start, end, floor, ceiling| PruneRange { start, end, floor, ceiling };
        // Range covering only the second leaf node: frees exactly that node.
        r.prune(&phys, all(512, 1024, 512, 1024), &mut out);
        assert_eq!(out.len(), 1);
        assert!(r.leaf(&phys, 512).is_none());
        assert!(r.leaf(&phys, 0).is_some());
        // A range that does not cover a whole node frees nothing.
        let mut out2 = Vec::new();
        r.prune(&phys, all(1, 1 << 30, 1, 1 << 30), &mut out2);
        assert!(out2.is_empty());
        // A node inside floor..ceiling but outside start..end is not
        // visited (start..end lies under the root's second slot).
        r.prune(&phys, all(1 << 27, (1 << 27) + 1, 0, INDEX_LIMIT), &mut out2);
        assert!(out2.is_empty());
        assert!(r.leaf(&phys, 0).is_some());
        // Everything: the level-2 node under the root, and below it.
        r.prune(&phys, all(0, 1, 0, INDEX_LIMIT), &mut out2);
        assert_eq!(out2.len(), 3);
        assert!(r.leaf(&phys, 0).is_none());
    }
}
