//! A radix tree of atomic 64-bit entries whose nodes are frames.
//!
//! The same structure serves as the page table (index = virtual page number,
//! leaves = PTEs) and as a VM object's page index (index = page offset in the
//! object, leaves = frame numbers). 512 entries per node, 9 bits per level.
//!
//! - A page table has a fixed height of 4 levels (36 bits of index: the
//!   2^35 pages of a 47-bit address space), its root allocated up front.
//! - An object index grows as Linux's xarray does: empty, it has no node
//!   at all; its first entry gets a one-level root, and an index beyond
//!   the root's reach adds a level on top (the old root becomes one slot
//!   of the new one). Up to [`MAX_HEIGHT`] levels: file offsets up to 2^63
//!   (pages below 2^51), as Linux allows. A small file's index is one
//!   frame; an object nobody wrote costs none.
//! - The root of an object index covers an aligned block of indexes that
//!   need not start at 0: its *base* (the first index it covers, a
//!   multiple of its span) is kept in the root node's descriptor, set
//!   before the root is published and never changed. An anonymous
//!   object's indexes are its mapping's page numbers (`addr >> 12`, as
//!   Linux's `vm_pgoff`), around 2^35: rooted at 0, one touched page cost
//!   five nodes, and `malloc1` zeroed and scanned them all on every loop.
//!   Within the root's block the slot digits of an index are those of its
//!   offset from the base, so only the bounds checks see the base. A page
//!   table's base is 0.
//!
//! Every index bound is a real check: a lookup beyond the tree finds
//! nothing, an insertion beyond the limit fails (callers' own checks
//! exclude it: `mmap` refuses offsets past 2^63 with `EOVERFLOW`, and no
//! address reaches past `TASK_SIZE`). Nothing aliases.
//!
//! # Concurrency
//! - The root word holds the root node's frame and the height together,
//!   so a lockless walker reads both in one Acquire load, and the base in
//!   the node's descriptor, written before the Release that published the
//!   word; the node it names stays valid (a root replaced by growth is a
//!   slot of the new one, with the same base and height; nodes are freed
//!   only by prune and teardown, after a grace period).
//! - Lookups are lockless: Acquire loads of each level's entry. The Acquire
//!   pairs with the Release CAS that published the child node (or the new
//!   root), which was zeroed (plainly, as an `OwnedFrame`) before it.
//! - Missing interior nodes are added with a CAS from 0, a new root with a
//!   CAS of the root word; the loser frees its never-published frame.
//! - Interior nodes are removed only by [`Radix::prune`] / [`Radix::teardown`],
//!   which hand the frames back to the caller to be freed after a grace
//!   period, so a lockless walker that still holds a node sees valid memory.
//!   Callers exclude concurrent *allocation* in a pruned range themselves
//!   (page tables: the map lock held for writing).

use std::sync::atomic::{AtomicU64, Ordering};

use crate::phys::{Frames, Kind, OwnedFrame, Pfn, PhysMem, WORDS};

/// Levels of a page table.
pub(crate) const TABLE_LEVELS: u32 = 4;
/// Index bits per level.
pub(crate) const BITS: u32 = 9;
/// One past the largest page-table index (virtual page number).
pub(crate) const TABLE_LIMIT: u64 = 1 << (TABLE_LEVELS * BITS);
/// Most levels of an object index.
pub(crate) const MAX_HEIGHT: u32 = 6;
/// One past the largest object page index: byte offsets below 2^63
/// (Linux's `MAX_LFS_FILESIZE`).
pub(crate) const OBJECT_LIMIT: u64 = 1 << (63 - crate::types::PAGE_SHIFT);

/// Interior entry: the child's frame number above bit 12, bit 0 = present.
const PRESENT: u64 = 1;
/// The root word: the height in its low bits (the frame above bit 12).
const HEIGHT_MASK: u64 = 0xff;
/// The child count of a page table's root: it is never pruned, and every
/// change anywhere in the space attaches and detaches its children, so a
/// count there would be one line that changes in disjoint zones all write
/// (two per `malloc1` loop on each vCPU). It keeps this value instead, and
/// its teardown scans all of its slots.
const UNCOUNTED: u32 = u32::MAX;

#[inline]
fn child_of(entry: u64) -> Pfn {
    Pfn::decode((entry >> 12) as u32)
}

#[inline]
fn entry_for(child: Pfn) -> u64 {
    (u64::from(child.raw()) << 12) | PRESENT
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

/// Whether a root of `height` levels with first index `base` covers `index`.
#[inline]
fn covers(base: u64, height: u32, index: u64) -> bool {
    index.wrapping_sub(base) < span(height)
}

/// A tree's root as a walker reads it (see [`Radix::top`]).
#[derive(Debug, Clone, Copy)]
struct Top {
    node: Pfn,
    height: u32,
    base: u64,
}

/// The tree ran out of frames for a node (or, which callers exclude, the
/// index lies beyond its limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OutOfFrames;

/// A radix tree of frames.
#[derive(Debug)]
pub(crate) struct Radix {
    /// `[a]` the root word: 0 for an empty tree, else the root node's
    /// frame above bit 12 and the height (levels) below. Changed only from
    /// 0 to a first root and by growth, each by CAS; a page table's is set
    /// once at creation.
    root: AtomicU64,
    /// `[I]` the kind of its nodes (`TABLE` or `INDEX`).
    kind: Kind,
    /// `[I]` the most levels it may have (fixed trees have exactly these).
    max_height: u32,
}

/// A leaf entry and the node (frame) that holds it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Leaf<'a> {
    /// The entry.
    pub(crate) entry: &'a AtomicU64,
    /// The level-0 node holding it, as a whole word (no padding: see
    /// `OwnedFrame`'s frame number).
    node: u64,
}

impl<'a> Leaf<'a> {
    /// Entry `entry` of node `node`.
    #[inline]
    pub(crate) fn new(entry: &'a AtomicU64, node: Pfn) -> Leaf<'a> {
        Leaf { entry, node: u64::from(node.raw()) }
    }

    /// The level-0 node holding the entry (its descriptor's `ptl` is the
    /// PTE lock).
    #[inline]
    pub(crate) fn node(&self) -> Pfn {
        Pfn::decode(self.node as u32)
    }
}

impl Radix {
    /// A page table: `TABLE_LEVELS` levels, with its root allocated now.
    pub(crate) fn table(frames: &Frames<'_>) -> Result<Radix, OutOfFrames> {
        let root = frames.alloc_zeroed().ok_or(OutOfFrames)?;
        let root = frames.publish(root, Kind::Table);
        frames.phys().page(root).children.store(UNCOUNTED, Ordering::Relaxed);
        let word = (u64::from(root.raw()) << 12) | u64::from(TABLE_LEVELS);
        Ok(Radix { root: AtomicU64::new(word), kind: Kind::Table, max_height: TABLE_LEVELS })
    }

    /// An empty object index (no frame until its first entry).
    pub(crate) fn index() -> Radix {
        Radix { root: AtomicU64::new(0), kind: Kind::Index, max_height: MAX_HEIGHT }
    }

    /// Whether its nodes at `level` count their children (all but a page
    /// table's root: see [`UNCOUNTED`]).
    #[inline]
    fn counts(&self, level: u32) -> bool {
        !(self.kind == Kind::Table && level == TABLE_LEVELS - 1)
    }

    /// One past the largest index this tree may ever hold.
    #[inline]
    pub(crate) fn limit(&self) -> u64 {
        if self.max_height == TABLE_LEVELS { TABLE_LIMIT } else { OBJECT_LIMIT }
    }

    /// The root node, the height and the base (the first index the root
    /// covers), if the tree has a node.
    #[inline]
    fn top(&self, phys: &PhysMem) -> Option<Top> {
        // Acquire pairs with the Release CAS that published the root (and
        // the old root in its slot, for a growth) and its base.
        let w = self.root.load(Ordering::Acquire);
        if w == 0 {
            return None;
        }
        let (node, height) = (Pfn::decode((w >> 12) as u32), (w & HEIGHT_MASK) as u32);
        let base = if self.kind == Kind::Table { 0 } else { phys.page(node).pindex.load(Ordering::Relaxed) };
        Some(Top { node, height, base })
    }

    /// The leaf entry for `index`, if every level above it exists (none
    /// for an index beyond the tree).
    ///
    /// The caller must be inside an RCU read-side section or otherwise
    /// exclude pruning, for as long as it uses the result.
    #[inline]
    pub(crate) fn leaf<'p>(&self, phys: &'p PhysMem, index: u64) -> Option<Leaf<'p>> {
        let Top { mut node, height: mut level, base } = self.top(phys)?;
        if !covers(base, level, index) {
            return None;
        }
        // (A countdown, not a reversed range: this runs on every access.)
        while level > 1 {
            level -= 1;
            // Acquire pairs with the Release CAS in `leaf_alloc` that
            // published the (zeroed) child.
            let e = phys.words(node)[slot_at(index, level)].load(Ordering::Acquire);
            if e == 0 {
                return None;
            }
            node = child_of(e);
        }
        Some(Leaf::new(&phys.words(node)[slot_at(index, 0)], node))
    }

    /// The leaf entry for `index`, adding missing nodes (levels on top
    /// too). Returns how many nodes this call added, for accounting.
    #[inline]
    pub(crate) fn leaf_alloc<'p>(&self, frames: &Frames<'p>, index: u64) -> Result<(Leaf<'p>, u32), OutOfFrames> {
        if index >= self.limit() {
            return Err(OutOfFrames);
        }
        let phys = frames.phys();
        // The fast path: the root covers `index` already.
        let (mut added, Top { mut node, height, .. }) = match self.top(phys) {
            Some(t) if covers(t.base, t.height, index) => (0, t),
            _ => (self.grow(frames, index)?, self.top(phys).expect("grown")),
        };
        for level in (1..height).rev() {
            let slot = &phys.words(node)[slot_at(index, level)];
            let mut e = slot.load(Ordering::Acquire);
            if e == 0 {
                let fresh: OwnedFrame = frames.alloc_zeroed().ok_or(OutOfFrames)?;
                // The kind is set before the frame becomes reachable, so
                // whoever finds it (and may free it) sees its real kind;
                // Release publishes the zeroed contents with the pointer.
                let word = entry_for(fresh.pfn());
                match frames.publish_into(fresh, self.kind, slot, 0, word, |_| {}) {
                    Ok(_) => {
                        if self.counts(level) {
                            phys.page(node).children.fetch_add(1, Ordering::Relaxed);
                        }
                        e = word;
                        added += 1;
                    }
                    Err((lost, winner)) => {
                        // Never reachable: free it.
                        frames.free_owned(lost);
                        e = winner;
                    }
                }
            }
            node = child_of(e);
        }
        Ok((self.leaf_in(phys, node, index), added))
    }

    /// The slot of `index` in `node`, the level-0 node that holds it
    /// (returned by an earlier [`leaf_alloc`](Radix::leaf_alloc) of this
    /// tree, and not freed since: the caller knows the tree is alive, and
    /// an object index frees nodes only in its teardown).
    #[inline]
    pub(crate) fn leaf_in<'p>(&self, phys: &'p PhysMem, node: Pfn, index: u64) -> Leaf<'p> {
        self.leaf_in_spanned(phys, node, index, None)
    }

    /// [`leaf_in`](Radix::leaf_in), for a caller that remembers in
    /// `spanned` the last span step it widened `node`'s span to hold
    /// (`SPAN_STEP` slots; 0: none, else the step's number plus one): a
    /// span only grows while its tree lives, so the same step is not
    /// looked at again. Whoever passes `spanned` resets it to 0 when it
    /// starts remembering another node.
    #[inline(always)]
    pub(crate) fn leaf_in_spanned<'p>(
        &self,
        phys: &'p PhysMem,
        node: Pfn,
        index: u64,
        spanned: Option<&std::cell::Cell<u32>>,
    ) -> Leaf<'p> {
        let at = slot_at(index, 0);
        let step = (at / SPAN_STEP) as u32 + 1;
        let remembered = spanned.is_some_and(|s| s.replace(step) == step);
        if !remembered && self.kind == Kind::Index {
            // An object index's entries that own a frame or a swap slot
            // appear only at slots handed out here (a fault's, a fill's, a
            // collapse's reserve; swap and write-back change entries that
            // own one already), so the teardown need not look outside the
            // span of those (a hole or a lone dirty bit found there owns
            // nothing).
            widen_span(&phys.page(node).children, at);
        }
        Leaf::new(&phys.words(node)[at], node)
    }

    /// Make the root cover `index` (an object index: tables have their
    /// root from the start): a first one-level root, or new roots on top
    /// of the old one. Returns the nodes added.
    fn grow(&self, frames: &Frames<'_>, index: u64) -> Result<u32, OutOfFrames> {
        let phys = frames.phys();
        let mut added = 0;
        loop {
            let cur = self.root.load(Ordering::Acquire);
            let top = self.top(phys);
            if top.is_some_and(|t| covers(t.base, t.height, index)) {
                return Ok(added);
            }
            let fresh: OwnedFrame = frames.alloc_zeroed().ok_or(OutOfFrames)?;
            let node = fresh.pfn();
            debug_assert!(top.is_none_or(|t| t.height < MAX_HEIGHT), "a full-height root covers every index");
            // Unreachable until the compare-exchange below (Release)
            // publishes it.
            let (height, base, slot) = match top {
                None => (1, index & !(span(1) - 1), None),
                Some(t) => {
                    let base = t.base & !(span(t.height + 1) - 1);
                    let slot = ((t.base - base) / span(t.height)) as usize;
                    phys.words(node)[slot].store(entry_for(t.node), Ordering::Relaxed);
                    phys.page(node).children.store(1, Ordering::Relaxed);
                    (t.height + 1, base, Some(slot))
                }
            };
            phys.page(node).pindex.store(base, Ordering::Relaxed);
            let word = (u64::from(node.raw()) << 12) | u64::from(height);
            match frames.publish_into(fresh, self.kind, &self.root, cur, word, |_| {}) {
                Ok(_) => added += 1,
                Err((lost, _)) => {
                    if let Some(slot) = slot {
                        phys.words(node)[slot].store(0, Ordering::Relaxed);
                    }
                    frames.free_owned(lost);
                }
            }
        }
    }

    /// Call `f(base, node)` for every level-0 node that covers part of
    /// `start..end`; `base` is the index of the node's first entry. Absent
    /// subtrees are skipped. Same caller rule as [`Radix::leaf`].
    pub(crate) fn for_each_leaf_node(&self, phys: &PhysMem, start: u64, end: u64, mut f: impl FnMut(u64, Pfn)) {
        let Some(Top { node, height, base }) = self.top(phys) else { return };
        let (start, end) = (start.max(base), end.min(base + span(height)));
        if start >= end {
            return;
        }
        if height == 1 {
            f(base, node);
        } else {
            walk(phys, node, height - 1, base, start, end, &mut f);
        }
    }

    /// Call `f(index, leaf)` for every non-zero leaf entry with index in
    /// `start..end`. Same caller rule as [`Radix::leaf`].
    pub(crate) fn for_each_present(&self, phys: &PhysMem, start: u64, end: u64, f: impl FnMut(u64, Leaf<'_>)) {
        self.each_present(phys, start, end, false, f);
    }

    /// [`for_each_present`](Radix::for_each_present) of an object index,
    /// over each leaf's span only: every entry that owns a frame or a swap
    /// slot lies there (see [`leaf_in_spanned`](Radix::leaf_in_spanned)),
    /// so a caller that wants only those reads a 64-slot step of a leaf
    /// per step handed out, not all 512 slots (a one-page `malloc1`
    /// mapping's munmap read all of them, 64 lines from beyond the L1
    /// cache once two vCPUs' frees cycled their nodes through more frames).
    ///
    /// Same caller rule as [`Radix::leaf`]; besides, every reserve that
    /// handed out a slot whose entry the caller must find happens-before
    /// the call (its entry then lies in the span the call reads).
    pub(crate) fn for_each_spanned(&self, phys: &PhysMem, start: u64, end: u64, f: impl FnMut(u64, Leaf<'_>)) {
        debug_assert_eq!(self.kind, Kind::Index, "a page table's leaves keep no span");
        self.each_present(phys, start, end, true, f);
    }

    /// The walk of both: every non-zero leaf entry in `start..end`, in
    /// each leaf's span only if `spanned`.
    fn each_present(&self, phys: &PhysMem, start: u64, end: u64, spanned: bool, mut f: impl FnMut(u64, Leaf<'_>)) {
        self.for_each_leaf_node(phys, start, end, |base, node| {
            let words = phys.words(node);
            let (lo, hi) = if spanned { leaf_span(phys, node) } else { (0, WORDS) };
            let lo = (start.max(base) - base).max(lo as u64);
            let hi = (end.min(base + WORDS as u64) - base).min(hi as u64);
            for i in lo..hi {
                let entry = &words[i as usize];
                if entry.load(Ordering::Acquire) != 0 {
                    f(base + i, Leaf::new(entry, node));
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
        let Some(Top { node, height, base }) = self.top(phys) else { return };
        let r = PruneRange { ceiling: r.ceiling.min(base + span(height)), start: r.start.max(r.floor).max(base), ..r };
        let r = PruneRange { end: r.end.min(r.ceiling), ..r };
        if r.start < r.end {
            prune_node(phys, node, height - 1, base, &r, out, self.counts(height - 1));
        }
    }

    /// Push every node, root included, onto `out`, and the present leaf
    /// entries' values onto `leaves` (`None`: they are not wanted, and not
    /// read). The caller owns the tree exclusively (`&mut self`); frames
    /// still go through a grace period when freed.
    pub(crate) fn teardown(&mut self, phys: &PhysMem, out: &mut Vec<Pfn>, leaves: Option<&mut Vec<u64>>) {
        if let Some(t) = self.top(phys) {
            let leaves = match leaves {
                Some(l) => Leaves::Keep(l),
                None => Leaves::Ignore,
            };
            collect(phys, t.node, t.height - 1, out, leaves);
        }
        *self.root.get_mut() = 0;
    }

    /// [`teardown`](Radix::teardown) of an object index whose every
    /// non-zero entry lies in its leaves' spans (an anonymous object's:
    /// only a file's carries bits elsewhere), taking the entries out as it
    /// reads them, so that every node it frees holds only zeros and is
    /// marked so (`PhysMem::mark_zeroed`; nothing without `reuse_zeroed`).
    pub(crate) fn teardown_cleared(&mut self, phys: &PhysMem, out: &mut Vec<Pfn>, leaves: &mut Vec<u64>) {
        if !phys.reuses_zeroed() {
            return self.teardown(phys, out, Some(leaves));
        }
        if let Some(t) = self.top(phys) {
            collect(phys, t.node, t.height - 1, out, Leaves::Take(leaves));
        }
        *self.root.get_mut() = 0;
    }
}

fn walk(phys: &PhysMem, node: Pfn, level: u32, base: u64, start: u64, end: u64, f: &mut impl FnMut(u64, Pfn)) {
    let words = phys.words(node);
    let (first, last) = slots_over(base, level, start, end);
    let mut i = first;
    while let Some((at, e)) = next_nonzero(words, i, last) {
        i = at + 1;
        let lo = base + at as u64 * span(level);
        if level == 1 {
            f(lo, child_of(e));
        } else {
            walk(phys, child_of(e), level - 1, lo, start, end, f);
        }
    }
}

/// The slots of a node at `level` whose first index is `base` that cover
/// part of `start..end`: `first..last` (empty if none). A walk over them
/// tests eight empty slots at a time (`next_nonzero`): a munmap's walks
/// over a 128 MiB mapping read 64 slots of a 1 GiB table for its one
/// child.
#[inline]
fn slots_over(base: u64, level: u32, start: u64, end: u64) -> (usize, usize) {
    let first = (start.saturating_sub(base) / span(level)).min(WORDS as u64) as usize;
    let last = end.saturating_sub(base).div_ceil(span(level)).min(WORDS as u64) as usize;
    (first, last)
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

/// Prune under `node` (see [`Radix::prune`]); `counted`: whether `node`
/// keeps a child count (see [`UNCOUNTED`]).
fn prune_node(phys: &PhysMem, node: Pfn, level: u32, base: u64, r: &PruneRange, out: &mut Vec<Pfn>, counted: bool) {
    if level == 0 {
        return;
    }
    let words = phys.words(node);
    let (first, last) = slots_over(base, level, r.start, r.end);
    let mut i = first;
    while let Some((at, e)) = next_nonzero(words, i, last) {
        i = at + 1;
        let slot = &words[at];
        let lo = base + at as u64 * span(level);
        let hi = lo + span(level);
        if r.floor <= lo && hi <= r.ceiling {
            slot.store(0, Ordering::Release);
            if counted {
                phys.page(node).children.fetch_sub(1, Ordering::Relaxed);
            }
            collect_pruned(phys, child_of(e), level - 1, lo, r, out);
        } else {
            prune_node(phys, child_of(e), level - 1, lo, r, out, true);
        }
    }
}

/// Push `node` (first index `base`, at `level`) and its subtree, which a
/// prune detached, onto `out`. Its children lie over `r.start..r.end`:
/// any node wholly outside lay wholly in a gap before this change, and
/// was pruned by the change that made the gap (see [`Radix::prune`]). So
/// only those slots are read, not the whole node up to its last child (a
/// one-page `malloc1` mapping at the top of a 1 GiB table read 450 empty
/// slots of it on every loop). A child found nowhere there (counts left
/// over) is looked for in the rest of the node, so nothing leaks whatever
/// the changes before did.
fn collect_pruned(phys: &PhysMem, node: Pfn, level: u32, base: u64, r: &PruneRange, out: &mut Vec<Pfn>) {
    if level == 0 {
        collect(phys, node, 0, out, Leaves::Empty);
        // Every PTE of a pruned leaf is clear (checked in debug builds).
        phys.mark_zeroed(node);
        return;
    }
    let words = phys.words(node);
    let mut left = phys.page(node).children.load(Ordering::Relaxed);
    // Diagnostic: a child past the count would leak its subtree.
    debug_assert_eq!(
        words.iter().filter(|w| w.load(Ordering::Relaxed) != 0).count(),
        left as usize,
        "node {node:?} at level {level} has another number of children than it counts"
    );
    let first = (r.start.saturating_sub(base) / span(level)).min(WORDS as u64) as usize;
    let end = (r.end.saturating_sub(base).div_ceil(span(level))).min(WORDS as u64) as usize;
    // With `reuse_zeroed`, each child's slot is cleared as it is found, so
    // that the node freed holds only zeros and is not zeroed again by its
    // next owner. A reader still walking the detached subtree then finds
    // the level missing instead of an empty table: the same answer (no
    // PTE) by another road, which it already takes for a table not yet
    // allocated.
    let clear = phys.reuses_zeroed();
    for (from, to) in [(first, end), (0, first), (end, WORDS)] {
        let mut i = from;
        while left > 0 {
            let Some((at, e)) = next_nonzero(words, i, to) else { break };
            i = at + 1;
            left -= 1;
            if clear {
                words[at].store(0, Ordering::Relaxed);
            }
            collect_pruned(phys, child_of(e), level - 1, base + at as u64 * span(level), r, out);
        }
    }
    if clear {
        phys.page(node).children.store(0, Ordering::Relaxed);
        phys.mark_zeroed(node);
    }
    out.push(node);
}

/// Push `node` and its subtree onto `out` (and, with `leaves`, the present
/// leaf entries' values). The subtree is the caller's alone: detached by a
/// prune that excludes `leaf_alloc` over its range, or a whole tree torn
/// down, so the nodes' child counts are exact and the scan of a node
/// stops at its last child (a node of one child among 512 slots was most
/// of `malloc1`'s teardown). A leaf node's entries are read only when they
/// are wanted (`leaves`) or checked (debug builds).
/// What [`collect`] does with the leaf entries it passes.
enum Leaves<'a> {
    /// Push the present ones here.
    Keep(&'a mut Vec<u64>),
    /// Push them here and clear every word read, interior ones too, and
    /// mark each node freed as holding zeros (`Radix::teardown_cleared`).
    Take(&'a mut Vec<u64>),
    /// They must all be zero (a pruned subtree): checked in debug builds.
    Empty,
    /// Not wanted (a dying page table: its pages belong to objects).
    Ignore,
}

/// An object-index leaf node's span word (its descriptor's `children`):
/// the slots handed out for writing lie in `start..end`, with `end` in the
/// low 16 bits and `WORDS - start` in the high ones, so that a fresh
/// frame's 0 is the empty span and both halves only grow.
fn span_of(word: u32) -> (usize, usize) {
    (WORDS - (word >> 16) as usize, (word & 0xffff) as usize)
}

/// The span (see [`span_of`]) of object-index leaf node `node`.
#[inline]
fn leaf_span(phys: &PhysMem, node: Pfn) -> (usize, usize) {
    let (start, end) = span_of(phys.page(node).children.load(Ordering::Relaxed));
    (start.min(end), end.min(WORDS))
}

/// Slots a span grows by at a time: a sequential fill (page_fault1) then
/// writes the span once per 64 faults, not at each, and a teardown still
/// reads a 64th of the node per slot in use, not all 512.
const SPAN_STEP: usize = 64;

/// Widen the span of `word` (see [`span_of`]) to hold slot `at` (and the
/// rest of its `SPAN_STEP`-aligned block). A load first: most slots a leaf
/// hands out lie inside its span already.
fn widen_span(word: &crate::sync::atomic::AtomicU32, at: usize) {
    let (lo, hi) = (at / SPAN_STEP * SPAN_STEP, (at / SPAN_STEP + 1) * SPAN_STEP);
    let mut cur = word.load(Ordering::Relaxed);
    loop {
        let (start, end) = span_of(cur);
        let (start, end) = (start.min(lo), end.max(hi));
        let new = (((WORDS - start) as u32) << 16) | end as u32;
        if new == cur {
            return;
        }
        match word.compare_exchange_weak(cur, new, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return,
            Err(now) => cur = now,
        }
    }
}

fn collect(phys: &PhysMem, node: Pfn, level: u32, out: &mut Vec<Pfn>, mut leaves: Leaves<'_>) {
    let kind = phys.page(node).kind();
    // Where a leaf node can hold entries: an index leaf's span (see
    // `leaf_alloc`), a table leaf's every slot.
    let (start, end) = if level == 0 && kind == Kind::Index { leaf_span(phys, node) } else { (0, WORDS) };
    let mut left = match (level, &leaves) {
        (0, Leaves::Keep(_) | Leaves::Take(_)) => u32::MAX,
        (0, Leaves::Empty) if cfg!(debug_assertions) => u32::MAX,
        (0, _) => 0,
        _ => phys.page(node).children.load(Ordering::Relaxed),
    };
    let words = phys.words(node);
    let mut i = start;
    while left > 0 || (level > 0 && cfg!(debug_assertions)) {
        let Some((at, e)) = next_nonzero(words, i, end) else { break };
        i = at + 1;
        // Diagnostic: a child past the count would leak its subtree.
        debug_assert!(level == 0 || left > 0, "node {node:?} at level {level} has more children than it counts");
        left = left.saturating_sub(1);
        if matches!(leaves, Leaves::Take(_)) {
            words[at].store(0, Ordering::Relaxed);
        }
        if level == 0 {
            match &mut leaves {
                Leaves::Keep(l) | Leaves::Take(l) => l.push(e),
                // Diagnostic: a live entry here would leak its page (no
                // use after free: the node is freed after a grace period).
                Leaves::Empty => debug_assert!(false, "pruning a leaf node with live entry {e:#x}"),
                Leaves::Ignore => {}
            }
        } else {
            let inner = match &mut leaves {
                Leaves::Keep(l) => Leaves::Keep(l),
                Leaves::Take(l) => Leaves::Take(l),
                Leaves::Empty => Leaves::Empty,
                Leaves::Ignore => Leaves::Ignore,
            };
            collect(phys, child_of(e), level - 1, out, inner);
        }
    }
    if matches!(leaves, Leaves::Take(_)) {
        phys.mark_zeroed(node);
    }
    out.push(node);
}

/// The first non-zero entry of `words` at or after `from` and before
/// `end`, with its position. Eight words are tested at a time (one branch
/// per 64 bytes: the nodes a teardown reads are mostly empty); the entry
/// found is read again with Acquire, pairing with the Release that
/// published it.
pub(crate) fn next_nonzero(words: &[AtomicU64; WORDS], from: usize, end: usize) -> Option<(usize, u64)> {
    let mut i = from;
    while i < end {
        if i.is_multiple_of(8) && i + 8 <= end {
            let any = words[i..i + 8].iter().fold(0, |acc, w| acc | w.load(Ordering::Relaxed));
            if any == 0 {
                i += 8;
                continue;
            }
        }
        let e = words[i].load(Ordering::Acquire);
        if e != 0 {
            return Some((i, e));
        }
        i += 1;
    }
    None
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::phys::PcpConfig;

    const NO_PCP: PcpConfig = PcpConfig { capacity: 0, fill: 0, drain: 0, max: 0 };

    #[test]
    fn leaves_are_allocated_and_found() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let r = Radix::table(&frames).unwrap();
        assert!(r.leaf(&phys, 12345).is_none());
        let (leaf, added) = r.leaf_alloc(&frames, 12345).unwrap();
        assert_eq!(added, 3);
        leaf.entry.store(77, Ordering::Relaxed);
        let again = r.leaf(&phys, 12345).unwrap();
        assert_eq!(again.entry.load(Ordering::Relaxed), 77);
        assert_eq!(again.node(), leaf.node());
        let (_, added) = r.leaf_alloc(&frames, 12346).unwrap();
        assert_eq!(added, 0);
        let far = TABLE_LIMIT - 1;
        r.leaf_alloc(&frames, far).unwrap().0.entry.store(5, Ordering::Relaxed);
        let mut seen = Vec::new();
        r.for_each_present(&phys, 0, TABLE_LIMIT, |i, l| seen.push((i, l.entry.load(Ordering::Relaxed))));
        assert_eq!(seen, vec![(12345, 77), (far, 5)]);
        let mut seen = Vec::new();
        r.for_each_present(&phys, 12346, far, |i, _| seen.push(i));
        assert!(seen.is_empty());
        // Past the limit nothing is found and nothing aliases: index
        // 2^36 + 12345 is not 12345.
        assert!(r.leaf(&phys, TABLE_LIMIT + 12345).is_none());
        assert_eq!(r.leaf_alloc(&frames, TABLE_LIMIT + 12345).unwrap_err(), OutOfFrames);
    }

    #[test]
    fn an_object_index_grows_from_nothing_and_keeps_its_entries() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let free = phys.global_free_frames();
        let mut r = Radix::index();
        assert!(r.leaf(&phys, 0).is_none());
        assert_eq!(phys.global_free_frames(), free, "an empty index costs no frame");
        // A small file: one node.
        let (leaf, added) = r.leaf_alloc(&frames, 7).unwrap();
        assert_eq!(added, 1);
        leaf.entry.store(70, Ordering::Relaxed);
        // Growing to 2^36 + 7 (where a 4-level tree wrapped to 7) keeps 7.
        let far = (1u64 << 36) + 7;
        let (leaf, added) = r.leaf_alloc(&frames, far).unwrap();
        assert_eq!(added, 4 + 4, "four levels on top (height 5), four below the new root");
        leaf.entry.store(71, Ordering::Relaxed);
        assert_eq!(r.leaf(&phys, 7).unwrap().entry.load(Ordering::Relaxed), 70);
        assert_eq!(r.leaf(&phys, far).unwrap().entry.load(Ordering::Relaxed), 71);
        // The largest page of a file offset below 2^63.
        let top = OBJECT_LIMIT - 1;
        r.leaf_alloc(&frames, top).unwrap().0.entry.store(72, Ordering::Relaxed);
        let mut seen = Vec::new();
        r.for_each_present(&phys, 0, u64::MAX, |i, l| seen.push((i, l.entry.load(Ordering::Relaxed))));
        assert_eq!(seen, vec![(7, 70), (far, 71), (top, 72)]);
        assert_eq!(r.leaf_alloc(&frames, OBJECT_LIMIT).unwrap_err(), OutOfFrames);
        assert!(r.leaf(&phys, OBJECT_LIMIT).is_none());
        let (mut out, mut leaves) = (Vec::new(), Vec::new());
        r.teardown(&phys, &mut out, Some(&mut leaves));
        assert_eq!(leaves, vec![70, 71, 72]);
        assert_eq!(out.len() as u64, free - phys.global_free_frames(), "teardown finds every node");
    }

    #[test]
    fn an_index_teardown_scans_a_leaf_over_the_slots_handed_out_only() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let mut r = Radix::index();
        // Out of order, all in one leaf node (block 512..1024).
        for (k, v) in [(512 + 10, 1), (512 + 3, 2), (512 + 200, 3), (512 + 7, 4)] {
            r.leaf_alloc(&frames, k).unwrap().0.entry.store(v, Ordering::Relaxed);
        }
        let node = r.leaf(&phys, 512).unwrap().node();
        assert_eq!(
            span_of(phys.page(node).children.load(Ordering::Relaxed)),
            (0, 256),
            "the 64-slot blocks of the slots handed out"
        );
        // The contract: entries become non-zero only at slots `leaf_alloc`
        // handed out. Ones written outside the span behind its back are
        // not read (the scan covers the span only).
        r.leaf(&phys, 512 + 300).unwrap().entry.store(9, Ordering::Relaxed);
        assert_eq!(span_of(0), (WORDS, 0), "a fresh node's span is empty");
        // A leaf whose one slot is high: its span starts at that block.
        r.leaf_alloc(&frames, 1024 + 450).unwrap().0.entry.store(5, Ordering::Relaxed);
        let high = r.leaf(&phys, 1024).unwrap().node();
        assert_eq!(span_of(phys.page(high).children.load(Ordering::Relaxed)), (448, 512));
        r.leaf(&phys, 1024 + 3).unwrap().entry.store(6, Ordering::Relaxed);
        let (mut out, mut leaves) = (Vec::new(), Vec::new());
        r.teardown(&phys, &mut out, Some(&mut leaves));
        assert_eq!(leaves, vec![2, 4, 1, 3, 5]);
        assert!(out.contains(&node) && out.contains(&high));
    }

    #[test]
    fn a_remembered_span_step_is_skipped_and_every_other_step_widens() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let r = Radix::index();
        let node = r.leaf_alloc(&frames, 512 + 10).unwrap().0.node();
        let span = || span_of(phys.page(node).children.load(Ordering::Relaxed));
        assert_eq!(span(), (0, 64));
        let spanned = std::cell::Cell::new(0);
        // A step not remembered widens, and is remembered.
        r.leaf_in_spanned(&phys, node, 512 + 70, Some(&spanned));
        assert_eq!((span(), spanned.get()), ((0, 128), 2));
        // A remembered step is not looked at: a span narrowed behind the
        // memo's back (nothing else narrows one) stays as it is.
        phys.page(node).children.store(0, Ordering::Relaxed);
        let leaf = r.leaf_in_spanned(&phys, node, 512 + 100, Some(&spanned));
        assert_eq!(span(), (WORDS, 0));
        assert!(std::ptr::eq(leaf.entry, &phys.words(node)[100]));
        // Another step (one before it too) widens again.
        r.leaf_in_spanned(&phys, node, 512 + 300, Some(&spanned));
        assert_eq!((span(), spanned.get()), ((256, 320), 5));
        r.leaf_in_spanned(&phys, node, 512 + 70, Some(&spanned));
        assert_eq!(span(), (64, 320));
    }

    #[test]
    fn a_cleared_index_teardown_frees_zeroed_marked_nodes_and_keeps_the_entries() {
        for reuse in [false, true] {
            let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
            let mut phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
            phys.set_reuse_zeroed(reuse);
            let frames = Frames::global(&phys);
            let mut r = Radix::index();
            // Leaves under two interior levels, entries in their spans.
            let keys = [5u64, 512 + 70, (1 << 18) + 9, (1 << 27) + 300];
            for (v, &k) in keys.iter().enumerate() {
                r.leaf_alloc(&frames, k).unwrap().0.entry.store(v as u64 + 1, Ordering::Relaxed);
            }
            let (mut out, mut leaves) = (Vec::new(), Vec::new());
            r.teardown_cleared(&phys, &mut out, &mut leaves);
            leaves.sort_unstable();
            assert_eq!(leaves, vec![1, 2, 3, 4], "reuse={reuse}");
            for &p in &out {
                let zero = phys.words(p).iter().all(|w| w.load(Ordering::Relaxed) == 0);
                let marked = phys.page(p).zeroed.load(Ordering::Relaxed) != 0;
                // Without reuse it is the plain teardown: nodes keep their words.
                assert_eq!(marked, reuse, "{p:?}");
                assert!(zero || !reuse, "{p:?} marked with words in it");
            }
            if !reuse {
                assert!(out.iter().any(|&p| phys.words(p).iter().any(|w| w.load(Ordering::Relaxed) != 0)));
            }
        }
    }

    #[test]
    fn an_index_rooted_far_from_zero_costs_nodes_for_its_span_only() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let free = phys.global_free_frames();
        let mut r = Radix::index();
        // An anonymous mapping's page numbers: around 2^35.
        let at = (1u64 << 35) + 3;
        assert_eq!(r.leaf_alloc(&frames, at).unwrap().1, 1, "one node, not five");
        r.leaf(&phys, at).unwrap().entry.store(1, Ordering::Relaxed);
        assert!(r.leaf(&phys, at - 4).is_none() && r.leaf(&phys, at + 509).is_none() && r.leaf(&phys, 3).is_none());
        // A neighbour block: a root on top, the old root in its slot.
        assert_eq!(r.leaf_alloc(&frames, at + 600).unwrap().1, 2);
        r.leaf(&phys, at + 600).unwrap().entry.store(2, Ordering::Relaxed);
        // Below the base, then far below: roots on top until one covers it.
        for (i, &k) in [at - 4, 5, OBJECT_LIMIT - 1].iter().enumerate() {
            r.leaf_alloc(&frames, k).unwrap().0.entry.store(3 + i as u64, Ordering::Relaxed);
        }
        let mut seen = Vec::new();
        r.for_each_present(&phys, 0, u64::MAX, |i, l| seen.push((i, l.entry.load(Ordering::Relaxed))));
        assert_eq!(seen, vec![(5, 4), (at - 4, 3), (at, 1), (at + 600, 2), (OBJECT_LIMIT - 1, 5)]);
        let mut part = Vec::new();
        r.for_each_present(&phys, at - 3, at + 601, |i, _| part.push(i));
        assert_eq!(part, vec![at, at + 600]);
        for &(k, v) in &seen {
            assert_eq!(r.leaf(&phys, k).unwrap().entry.load(Ordering::Relaxed), v);
        }
        let (mut out, mut leaves) = (Vec::new(), Vec::new());
        r.teardown(&phys, &mut out, Some(&mut leaves));
        assert_eq!(leaves, vec![4, 3, 1, 2, 5]);
        assert_eq!(out.len() as u64, free - phys.global_free_frames(), "teardown finds every node");
    }

    #[test]
    fn prune_frees_only_whole_subtrees() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let r = Radix::table(&frames).unwrap();
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
        r.prune(&phys, all(1 << 27, (1 << 27) + 1, 0, TABLE_LIMIT), &mut out2);
        assert!(out2.is_empty());
        assert!(r.leaf(&phys, 0).is_some());
        // Everything: the level-2 node under the root, and below it.
        r.prune(&phys, all(0, 1, 0, TABLE_LIMIT), &mut out2);
        assert_eq!(out2.len(), 3);
        assert!(r.leaf(&phys, 0).is_none());
    }

    #[test]
    fn a_pruned_subtree_is_read_over_the_range_and_nothing_outside_it_leaks() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let r = Radix::table(&frames).unwrap();
        let free = phys.global_free_frames();
        // Under one level-2 node: leaf nodes at the start and the end of
        // its first level-1 node, and one under its last level-1 node.
        for at in [0u64, 511 << 9, (511 << 18) + 7] {
            r.leaf_alloc(&frames, at).unwrap();
        }
        let mut out = Vec::new();
        // The whole level-2 node lies in the gap; the change unmapped
        // only around the second leaf node. The leaves elsewhere (which a
        // change that made the gap would have pruned) are found too.
        let range = PruneRange { start: 511 << 9, end: 512 << 9, floor: 0, ceiling: 1 << 27 };
        r.prune(&phys, range, &mut out);
        out.sort();
        out.dedup();
        assert_eq!(out.len(), 6, "the level-2 node, two level-1 nodes, three leaf nodes");
        assert_eq!(out.len() as u64, free - phys.global_free_frames(), "every node the tree had");
        assert!(r.leaf(&phys, 0).is_none() && r.leaf(&phys, (511 << 18) + 7).is_none());
    }

    #[test]
    fn pruned_nodes_are_cleared_marked_and_reused_without_zeroing() {
        for reuse in [false, true] {
            let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
            let mut phys = PhysMem::new(64, false, &rcu, NO_PCP, false, false).unwrap();
            phys.set_reuse_zeroed(reuse);
            let frames = Frames::global(&phys);
            let r = Radix::table(&frames).unwrap();
            for at in [0u64, 511 << 9, (511 << 18) + 7] {
                r.leaf_alloc(&frames, at).unwrap();
            }
            let mut out = Vec::new();
            r.prune(&phys, PruneRange { start: 0, end: 1 << 27, floor: 0, ceiling: 1 << 27 }, &mut out);
            assert_eq!(out.len(), 6);
            for &p in &out {
                let zero = phys.words(p).iter().all(|w| w.load(Ordering::Relaxed) == 0);
                let marked = phys.page(p).zeroed.load(Ordering::Relaxed) != 0;
                // Without reuse the interior nodes keep their pointers.
                assert_eq!((zero || !reuse, marked), (true, reuse), "reuse={reuse}: {p:?}");
            }
            phys.free_after_grace(&rcu, &out);
            // A marked frame comes back zero with no zeroing, and unmarked.
            let mut got: Vec<_> = (0..out.len()).map(|_| frames.alloc().unwrap()).collect();
            let mut skipped = 0;
            for f in &mut got {
                let p = f.pfn();
                let had = phys.page(p).zeroed.load(Ordering::Relaxed) != 0;
                assert_eq!(phys.zero(f), !had);
                skipped += usize::from(had);
                assert_eq!(phys.page(p).zeroed.load(Ordering::Relaxed), 0);
                assert!(phys.owned_bytes(f).iter().all(|&b| b == 0));
            }
            assert_eq!(skipped, if reuse { out.len() } else { 0 });
            for f in got {
                frames.free_owned(f);
            }
        }
    }

    /// Every interior node's child count equals its non-zero entries, but
    /// the root's (a page table's), which stays `UNCOUNTED`.
    fn check_children(phys: &PhysMem, node: Pfn, level: u32) -> usize {
        if level == 0 {
            return 1;
        }
        let mut nodes = 1;
        let kids: Vec<u64> = phys.words(node).iter().map(|w| w.load(Ordering::Relaxed)).filter(|&e| e != 0).collect();
        let count = phys.page(node).children.load(Ordering::Relaxed);
        if level == TABLE_LEVELS - 1 {
            assert_eq!(count, UNCOUNTED, "a page table's root is written by no attach or prune");
        } else {
            assert_eq!(count as usize, kids.len(), "node {node:?} level {level}");
        }
        for e in kids {
            nodes += check_children(phys, child_of(e), level - 1);
        }
        nodes
    }

    #[test]
    fn child_counts_stay_exact_through_attach_prune_and_teardown() {
        let (rcu, _r) = crate::sync::rcu::Rcu::new(1);
        let phys = PhysMem::new(256, false, &rcu, NO_PCP, false, false).unwrap();
        let frames = Frames::global(&phys);
        let free = phys.global_free_frames();
        let mut r = Radix::table(&frames).unwrap();
        let all = |start, end, floor, ceiling| PruneRange { start, end, floor, ceiling };
        let spots = [0u64, 511, 512, 5 << 18, (5 << 18) + 700, 1 << 27, (1 << 27) + (3 << 9), TABLE_LIMIT - 1];
        let mut pruned = Vec::new();
        for round in 0..3 {
            for &i in &spots {
                r.leaf_alloc(&frames, i).unwrap();
            }
            let Top { node: root, height, .. } = r.top(&phys).unwrap();
            let nodes = check_children(&phys, root, height - 1);
            assert_eq!(nodes as u64 + pruned.len() as u64, free - phys.global_free_frames(), "round {round}");
            // Prune a whole level-1 subtree and a lone leaf node.
            r.prune(&phys, all(5 << 18, 6 << 18, 5 << 18, 6 << 18), &mut pruned);
            r.prune(&phys, all(512, 1024, 512, 1024), &mut pruned);
            check_children(&phys, root, height - 1);
        }
        let (mut out, mut leaves) = (Vec::new(), Vec::new());
        r.teardown(&phys, &mut out, Some(&mut leaves));
        assert!(leaves.is_empty());
        assert_eq!((out.len() + pruned.len()) as u64, free - phys.global_free_frames(), "every node found once");
        out.extend(&pruned);
        out.sort_unstable();
        out.dedup();
        assert_eq!((out.len()) as u64, free - phys.global_free_frames(), "no node twice");
    }
}
