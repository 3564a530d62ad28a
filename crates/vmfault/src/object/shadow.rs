//! Shadow objects: copy-on-write after `fork` (BSD's shadow chains).
//!
//! `fork` puts a new, empty *shadow* object in front of each private
//! object the parent maps, one for the parent and one for the child; the
//! old object becomes their *backing* object and is frozen: nothing
//! inserts into it again. A fault looks a page up from the front object
//! down ([`Object::find`]): found in front, it is the space's own page;
//! found below, it is shared with the other side and mapped read-only,
//! and a write fault copies it into the front object (copy-on-write).
//!
//! # Holes
//! Pages removed from a shadow object (`munmap`, `MADV_DONTNEED`) must not
//! let the backing object's copy show through again: in Linux the range
//! reads zeros afterwards, and a new mapping there (which may merge with,
//! and so adopt, this object) must see zeros too. So removal leaves a
//! `HOLE` entry wherever an object below still has the page
//! ([`Object::punch_locked`]); the index nodes it needs are reserved first
//! ([`Object::reserve_holes`]), so that the removal itself cannot fail.
//!
//! # Collapse
//! When a backing object is left with a single shadow (the other side
//! exited or unmapped), the shadow absorbs it ([`Object::collapse_locked`],
//! at the next `fork` of the space that maps the shadow): the pages the
//! shadow lacks move up (same frames: PTEs that map them stay valid), the
//! rest are freed, and the shadow's backing becomes the absorbed object's.
//! Repeated fork/exit therefore keeps chains short. This needs the map
//! lock of that space for writing (classic faults walk the chain under it)
//! and the VMAs that map the shadow retired, their per-VMA read-lockers
//! waited for: lockless faults walk chains too, and one that raced the move
//! (and may have missed a page between two levels) then fails its final
//! check. A speculative fault that passed that check just before the
//! retirement may still insert its page into the top level while the
//! collapse runs, so pages move up with a CAS from empty, and a page that
//! lost the race counts as hidden.
//!
//! DragonFly limits chains the same way (its `vm_map_backing` records hang
//! off the map entry); Linux has no chains: its anonymous pages are shared
//! per page, counted by `mapcount`, and found back through `anon_vma`.
//!
//! `tests/loom_shadow.rs` checks a copy of the walk (`find_from`) and of
//! the move up (`absorb`) against each other: change their order there too.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Cx;
use super::{Entry, MapWriteHeld, Object, Slot};
use crate::phys::Pfn;
use crate::pmap::OutOfFrames;
use crate::sync::rcu::{RcuReadGuard, Retired};

/// Where [`Object::find`] found a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// In the object itself: the space's own page.
    Own(Pfn),
    /// In an object below: shared, to be copied on write.
    Below(Pfn),
    /// Nowhere (or behind a hole): the page reads as zero.
    Zero,
    /// Not in the file object at the bottom of the chain: the file's page
    /// must be read in first (`file.rs`).
    Uncached,
    /// Paged out to swap by the object `depth` levels down the chain (0:
    /// this one): it must be read in first (`swap.rs`).
    Swapped {
        /// Levels below the object looked in.
        depth: u32,
    },
}

/// A replaced backing pointer, to reclaim after a grace period.
pub(crate) type OldBacking = Retired<Option<Arc<Object>>>;

impl Object {
    /// A new shadow object in front of `below`; `child` for the child
    /// side of a fork (see [`Object::inherited`]).
    pub(crate) fn new_shadow(ctx: &Cx<'_>, below: &Arc<Object>, child: bool) -> Result<Arc<Object>, OutOfFrames> {
        Self::with_backing(ctx, Some(below.clone()), child || below.inherited, None, u64::MAX)
    }

    /// Objects in the chain, this one included.
    pub(crate) fn depth(&self, section: &RcuReadGuard<'_>) -> u32 {
        let mut n = 1;
        let mut o = self;
        while let Some(b) = o.backing.read(section) {
            n += 1;
            o = b;
        }
        n
    }

    /// Find the page at `pindex` from this object down.
    ///
    /// Each level's backing pointer is loaded (Acquire) *before* its entry:
    /// a collapse publishes the page it moves up into this level before it
    /// switches the pointer past the level it came from, so a walker that
    /// sees the new pointer also sees the page, and one that sees the old
    /// pointer finds the page where it was (the absorbed level keeps its
    /// entries until a grace period has passed).
    pub(crate) fn find<'a>(&'a self, pindex: u64, section: &'a RcuReadGuard<'_>) -> Found {
        self.find_from(pindex, None, section)
    }

    /// [`Object::find`], reading this object's own entry from `slot` (its
    /// slot for `pindex`, reserved by the caller) instead of walking down
    /// the index again.
    #[inline(always)]
    pub(crate) fn find_from<'a>(
        &'a self,
        pindex: u64,
        slot: Option<&Slot<'_>>,
        section: &'a RcuReadGuard<'_>,
    ) -> Found {
        debug_assert!(slot.is_none_or(|s| s.pindex == pindex), "a slot for another index");
        if pindex >= self.pages {
            // Beyond a shared anonymous object's size: SIGBUS (`Space`'s
            // fault path, as for a file page beyond the end of its file).
            return Found::Uncached;
        }
        let mut o = self;
        let mut depth = 0;
        let mut behind_hole = false;
        loop {
            let (below, e) = o.backing.read_then(section, || match slot {
                Some(s) if depth == 0 => o.entry_in(s),
                _ => o.entry(pindex),
            });
            // Behind a hole only a file's page shows (Linux re-reads the file).
            if !behind_hole || o.is_file() {
                if let Some(pfn) = e.pfn() {
                    return if depth == 0 { Found::Own(pfn) } else { Found::Below(pfn) };
                }
                if e.slot().is_some() {
                    return Found::Swapped { depth };
                }
                if o.is_file() {
                    return Found::Uncached;
                }
                behind_hole |= e.is_hole();
            }
            match below {
                Some(b) => {
                    o = b;
                    depth += 1;
                }
                None => return Found::Zero,
            }
        }
    }

    /// Whether this object itself holds `pfn` at `pindex`.
    pub(crate) fn holds(&self, pindex: u64, pfn: Pfn) -> bool {
        self.entry(pindex).maps(pfn)
    }

    /// Whether this object itself holds `pfn` at `pindex`, marked dirty (a
    /// file page a shared mapping wrote and write-back has not cleaned).
    pub(crate) fn holds_dirty(&self, pindex: u64, pfn: Pfn) -> bool {
        let e = self.entry(pindex);
        e.maps(pfn) && e.is_dirty()
    }

    /// Whether this object is private anonymous memory that stands alone:
    /// no object below it, none above it (no `fork` shares it), not made
    /// for a `fork`'s child, not a file's or a shared mapping's.
    pub(crate) fn stands_alone(&self, section: &RcuReadGuard<'_>) -> bool {
        self.file.is_none()
            && !self.inherited
            && self.pages == u64::MAX
            && self.shadows.load(std::sync::atomic::Ordering::Acquire) == 0
            && self.backing.read(section).is_none()
    }

    /// The object below this one, if any.
    pub(crate) fn below(&self, section: &RcuReadGuard<'_>) -> Option<Arc<Object>> {
        self.backing.cloned(section)
    }

    /// The file object at the bottom of this chain (this one included), if any.
    pub(crate) fn file_of(self: &Arc<Self>, section: &RcuReadGuard<'_>) -> Option<Arc<Object>> {
        let mut o = self.clone();
        loop {
            if o.is_file() {
                return Some(o);
            }
            let below = o.backing.cloned(section)?;
            o = below;
        }
    }

    /// Indexes in `start..end` where an object below this one has a page
    /// that no object above it hides, in increasing order.
    fn shown_below(&self, start: u64, end: u64, section: &RcuReadGuard<'_>) -> Vec<u64> {
        let Some(below) = self.backing.read(section) else { return Vec::new() };
        let mut out = Vec::new();
        let mut o: &Object = below;
        loop {
            // Pointer first, then entries, as in `find`: another space may
            // be collapsing these levels, and a page it moves up must be
            // seen either where it was or where it went.
            // A file's pages show through holes: they need none.
            let (next, ()) = o.backing.read_then(section, || {
                if !o.is_file() {
                    o.index.for_each_present(&self.env.phys, start, end, |i, _| out.push(i));
                }
            });
            match next {
                Some(b) => o = b,
                None => break,
            }
        }
        out.sort_unstable();
        out.dedup();
        out.retain(|&i| matches!(below.find(i, section), Found::Own(_) | Found::Below(_) | Found::Swapped { .. }));
        out
    }

    /// Allocate the index nodes that [`punch_locked`](Object::punch_locked)
    /// of `start..end` will need for its holes.
    /// Allocates outside any read-side section (it may drain the caches).
    pub(crate) fn reserve_holes(&self, ctx: &Cx<'_>, start: u64, end: u64) -> Result<(), OutOfFrames> {
        let wanted = {
            let section = ctx.rcu_read();
            self.shown_below(start, end, &section)
        };
        let frames = ctx.frames();
        for i in wanted {
            self.index.leaf_alloc(&frames, i)?;
        }
        Ok(())
    }

    /// Remove this object's pages in `start..end` (onto `out`, to free
    /// after a grace period) and leave a hole wherever an object below
    /// would show through. Returns the number of pages removed.
    ///
    /// # Preconditions
    /// - The map lock of the space mapping this object is held for writing
    ///   (`_map`, its guard) and its PTEs in the range are cleared.
    /// - [`reserve_holes`](Object::reserve_holes) ran for the range under
    ///   the same lock hold (holes then never allocate).
    pub(crate) fn punch_locked(
        &self,
        _map: &impl MapWriteHeld,
        ctx: &Cx<'_>,
        start: u64,
        end: u64,
        out: &mut Vec<Pfn>,
    ) -> u64 {
        let n = self.remove_range(start, end, out);
        let holes = {
            let section = ctx.rcu_read();
            self.shown_below(start, end, &section)
        };
        for i in holes {
            let leaf = self.index.leaf(&self.env.phys, i).expect("reserve_holes allocated the node");
            // Empty after remove_range: no fault inserts under the write lock.
            leaf.entry.store(Entry::HOLE.bits(), Ordering::Release);
        }
        n
    }

    /// Down the chain from this object, let every level absorb the object
    /// below it when that object has no other shadow: the pages the level
    /// lacks move up (same frames, so PTEs that map them stay valid), the
    /// hidden ones go onto `out` (to free after a grace period), and the
    /// level's backing becomes the absorbed object's. The absorbed objects
    /// come back with their old pointers: pass them to
    /// [`Absorbed::release`] once a grace period has passed.
    ///
    /// Other spaces may be walking the levels below this object (children
    /// whose chains pass through them); `find`'s load order keeps them
    /// right. This object's own faults are another matter: its VMAs must be
    /// retired and waited for, and a fault already past its final check
    /// may still insert a page here, which the move's CAS respects.
    ///
    /// # Preconditions
    /// The map lock of the one space whose VMAs map this object is held
    /// for writing (`_map`, its guard) and those VMAs are retired (their lockless faults fail
    /// their final check, their read-lockers were waited for).
    pub(crate) fn collapse_locked(
        self: &Arc<Self>,
        _map: &impl MapWriteHeld,
        ctx: &Cx<'_>,
        out: &mut Vec<Pfn>,
        absorbed: &mut Vec<Absorbed>,
    ) -> Result<u32, OutOfFrames> {
        let mut collapsed = 0;
        let mut level = self.clone();
        loop {
            let below = {
                let section = ctx.rcu_read();
                match level.backing.cloned(&section) {
                    Some(b) => b,
                    None => return Ok(collapsed),
                }
            };
            if below.shadows.load(Ordering::Relaxed) != 1 || below.is_file() {
                level = below;
                continue;
            }
            let Some(old) = absorb(ctx, &level, &below, out)? else { continue };
            absorbed.push(Absorbed { object: below, old });
            collapsed += 1;
        }
    }
}

/// `level` absorbs `below` (see [`Object::collapse_locked`]); `None` if the
/// chain changed meanwhile.
fn absorb(
    ctx: &Cx<'_>,
    level: &Arc<Object>,
    below: &Arc<Object>,
    out: &mut Vec<Pfn>,
) -> Result<Option<OldBacking>, OutOfFrames> {
    let frames = ctx.frames();
    let phys = frames.phys();
    // Another space that shares this level may be collapsing it
    // (or the one below) too: lock both, top-down, and look again.
    let _mine = crate::sync::rank::lock(&level.lock, crate::sync::rank::Rank::Object);
    let _theirs = crate::sync::rank::lock(&below.lock, crate::sync::rank::Rank::Object);
    let still = {
        let section = ctx.rcu_read();
        level.backing.read(&section).is_some_and(|b| std::ptr::eq(b, Arc::as_ptr(below)))
    };
    if !still || below.shadows.load(Ordering::Relaxed) != 1 {
        return Ok(None);
    }
    // Reserve every slot first, so that a lack of frames leaves
    // both objects as they were.
    let mut entries = Vec::new();
    below.index.for_each_present(phys, 0, u64::MAX, |i, leaf| {
        entries.push((i, Entry::load(leaf.entry, Ordering::Relaxed)));
    });
    for &(i, _) in &entries {
        level.index.leaf_alloc(&frames, i)?;
    }
    for (i, e) in entries {
        let mine = level.index.leaf(phys, i).expect("reserved above");
        // A CAS from empty, not a store: a speculative fault that passed its
        // final check just before the VMAs were retired may still be
        // inserting its own page here (Release: the move is published
        // before the pointer switch below).
        let moved = crate::sync::publish_if_empty(mine.entry, e.bits());
        if let Some(pfn) = e.pfn() {
            if moved {
                phys.page(pfn).object.store(level.id, Ordering::Relaxed);
            } else {
                // Hidden by this level's page or hole: nobody maps it (a
                // PTE that mapped it read-only was replaced when the page
                // above was installed).
                below.release(pfn, out);
            }
        } else if !moved {
            // A hidden swapped-out page: its slot goes (a moved one went
            // up with its entry).
            below.forget_slot(e);
        }
    }
    // Page-ins and swap-outs (under this lock) leave it alone from now on.
    below.absorbed.store(true, Ordering::Relaxed);
    let deeper = {
        let section = ctx.rcu_read();
        below.backing.cloned(&section)
    };
    if let Some(d) = &deeper {
        d.shadows.fetch_add(1, Ordering::Relaxed);
        d.rmap.add_shadow(&level.env, Arc::downgrade(level));
    }
    Ok(Some(level.backing.replace(&level.env.rcu, deeper)))
}

/// An object absorbed by a collapse, waiting for a grace period: walkers
/// that loaded the pointer to it may still read its entries, which still
/// name the frames it gave away.
#[derive(Debug)]
pub(crate) struct Absorbed {
    object: Arc<Object>,
    old: OldBacking,
}

impl Absorbed {
    /// After a grace period: forget the frames (now owned by the level
    /// above, or freed as hidden) and let the object go.
    pub(crate) fn release(list: Vec<Absorbed>, rcu: &crate::sync::rcu::Rcu) {
        let (objects, mut olds): (Vec<_>, Vec<_>) = list.into_iter().map(|a| (a.object, a.old)).unzip();
        drop(rcu.reclaim(&mut olds, true));
        // Holds by construction: after the wait every item of this Rcu
        // has elapsed (leftovers would only leak).
        debug_assert!(olds.is_empty(), "a grace period has passed");
        for o in objects {
            o.index.for_each_present(&o.env.phys, 0, u64::MAX, |_, leaf| leaf.entry.store(0, Ordering::Relaxed));
        }
    }
}
