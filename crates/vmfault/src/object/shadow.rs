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
//! lock of that space for writing: classic faults walk the chain under it,
//! and lockless faults do not walk chains at all (they fall back when the
//! front object has a backing object).
//!
//! DragonFly limits chains the same way (its `vm_map_backing` records hang
//! off the map entry); Linux has no chains: its anonymous pages are shared
//! per page, counted by `mapcount`, and found back through `anon_vma`.

#![deny(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{HOLE, Object, PRESENT};
use crate::phys::Pfn;
use crate::pmap::OutOfFrames;
use crate::sync::rcu::{RcuReadGuard, Retired};
use crate::vm::{Ctx, Machine};

/// Where [`Object::find`] found a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// In the object itself: the space's own page.
    Own(Pfn),
    /// In an object below: shared, to be copied on write.
    Below(Pfn),
    /// Nowhere (or behind a hole): the page reads as zero.
    Zero,
}

/// A replaced backing pointer, to reclaim after a grace period.
pub(crate) type OldBacking = Retired<Box<Option<Arc<Object>>>>;

impl Object {
    /// A new shadow object in front of `below`; `child` for the child
    /// side of a fork (see [`Object::inherited`]).
    pub(crate) fn new_shadow(
        ctx: &Ctx<'_>,
        m: &Arc<Machine>,
        below: &Arc<Object>,
        child: bool,
    ) -> Result<Arc<Object>, OutOfFrames> {
        Self::with_backing(ctx, m, Some(below.clone()), child || below.inherited)
    }

    /// Whether this object has an object below it.
    #[inline]
    pub(crate) fn has_backing(&self, section: &RcuReadGuard<'_>) -> bool {
        self.backing.read(section).is_some()
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
    pub(crate) fn find<'a>(&'a self, pindex: u64, section: &'a RcuReadGuard<'_>) -> Found {
        let mut o = self;
        let mut own = true;
        loop {
            let e = o.entry(pindex);
            if e & PRESENT != 0 {
                let pfn = Pfn((e >> 12) as u32);
                return if own { Found::Own(pfn) } else { Found::Below(pfn) };
            }
            if e & HOLE != 0 {
                return Found::Zero;
            }
            match o.backing.read(section) {
                Some(b) => {
                    o = b;
                    own = false;
                }
                None => return Found::Zero,
            }
        }
    }

    /// Indexes in `start..end` where an object below this one has a page
    /// that no object above it hides, in increasing order.
    fn shown_below(&self, start: u64, end: u64, section: &RcuReadGuard<'_>) -> Vec<u64> {
        let Some(below) = self.backing.read(section) else { return Vec::new() };
        let mut out = Vec::new();
        let mut o: &Object = below;
        loop {
            o.index.for_each_present(&self.m.phys, start, end, |i, _| out.push(i));
            match o.backing.read(section) {
                Some(b) => o = b,
                None => break,
            }
        }
        out.sort_unstable();
        out.dedup();
        out.retain(|&i| matches!(below.find(i, section), Found::Own(_) | Found::Below(_)));
        out
    }

    /// Allocate the index nodes that [`punch_locked`](Object::punch_locked)
    /// of `start..end` will need for its holes.
    /// Allocates outside any read-side section (it may drain the caches).
    pub(crate) fn reserve_holes(&self, ctx: &Ctx<'_>, start: u64, end: u64) -> Result<(), OutOfFrames> {
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
    ///   and its PTEs in the range are cleared.
    /// - [`reserve_holes`](Object::reserve_holes) ran for the range under
    ///   the same lock hold (holes then never allocate).
    pub(crate) fn punch_locked(&self, ctx: &Ctx<'_>, start: u64, end: u64, out: &mut Vec<Pfn>) -> u64 {
        let n = self.remove_range(start, end, out);
        let holes = {
            let section = ctx.rcu_read();
            self.shown_below(start, end, &section)
        };
        for i in holes {
            let leaf = self.index.leaf(&self.m.phys, i).expect("reserve_holes allocated the node");
            // Empty after remove_range: no fault inserts under the write lock.
            leaf.entry.store(HOLE, Ordering::Release);
        }
        n
    }

    /// If the object below has no other shadow, absorb it: move up the
    /// pages this object lacks, free the rest onto `out` (after a grace
    /// period), take its backing as ours. Repeats down the chain. The old
    /// backing pointers go onto `retired`.
    ///
    /// # Preconditions
    /// The map lock of the one space whose VMAs map this object is held
    /// for writing (no fault walks the chain meanwhile).
    pub(crate) fn collapse_locked(
        &self,
        ctx: &Ctx<'_>,
        out: &mut Vec<Pfn>,
        retired: &mut Vec<OldBacking>,
    ) -> Result<u32, OutOfFrames> {
        let frames = ctx.frames();
        let phys = frames.phys();
        let mut collapsed = 0;
        loop {
            let below = {
                let section = ctx.rcu_read();
                match self.backing.read(&section) {
                    Some(b) if b.shadows.load(Ordering::Relaxed) == 1 => b.clone(),
                    _ => return Ok(collapsed),
                }
            };
            // Reserve every slot first, so that a lack of frames leaves
            // both objects as they were.
            let mut moving = Vec::new();
            below.index.for_each_present(phys, 0, u64::MAX, |i, leaf| {
                moving.push((i, leaf.entry.load(Ordering::Relaxed)));
            });
            for &(i, _) in &moving {
                self.index.leaf_alloc(&frames, i)?;
            }
            for (i, e) in moving {
                let mine = self.index.leaf(phys, i).expect("reserved above");
                let below_leaf = below.index.leaf(phys, i).expect("present above");
                below_leaf.entry.store(0, Ordering::Relaxed);
                if mine.entry.load(Ordering::Relaxed) != 0 {
                    // Hidden by our page or hole: nobody maps it.
                    if e & PRESENT != 0 {
                        out.push(Pfn((e >> 12) as u32));
                    }
                    continue;
                }
                if e & PRESENT != 0 {
                    phys.page(Pfn((e >> 12) as u32)).object.store(self.id, Ordering::Relaxed);
                }
                mine.entry.store(e, Ordering::Release);
            }
            let deeper = {
                let section = ctx.rcu_read();
                below.backing.read(&section).clone()
            };
            if let Some(d) = &deeper {
                d.shadows.fetch_add(1, Ordering::Relaxed);
            }
            retired.push(self.backing.replace(&self.m.rcu, deeper));
            collapsed += 1;
        }
    }
}
