//! `mremap`: shrink, grow in place, or move a mapping (Linux's
//! `mm/mremap.c`, its checks in its order).
//!
//! Here a page lives in its object at its page offset (Linux finds an
//! anonymous page through its PTE instead), and every mapping of a private
//! object keeps one distance between address and offset, so offsets never
//! meet. A move keeps that:
//!
//! - A shared mapping, or a private one that moves whole and is its
//!   object's only mapping (unless a relative maps at its new place, see
//!   "Families"), keeps its object at the same page offsets (an
//!   anonymous private VMA with no object yet takes the new address's
//!   offsets instead, as Linux's `copy_vma` does for a VMA without an
//!   `anon_vma`); the old range is cut out of the index without taking its
//!   pages out of their objects. Linux moves the page tables; here the old
//!   PTEs are cleared and, once the map lock is dropped, the pages whose
//!   PTEs were present are faulted in at their new addresses (a locked
//!   mapping's, wired again), so that what was resident stays resident.
//! - Any other private mapping moves by copy (`Change::copy_to`): a new
//!   object, the private pages copied after the lock (those in swap read
//!   back for it), then the old range unmapped.
//! - `MREMAP_DONTUNMAP` leaves the old range mapped (`Change::empty`):
//!   its PTEs cleared, the old mapping whole again and without
//!   `VM_LOCKED`, without its object if a private one moved whole (Linux
//!   unlinks its anon_vma) and, after a move by copy, with holes where the
//!   copied pages were, so that private memory there reads as zeros.
//!   Whole means whole when it moved: Linux empties each old mapping of a
//!   move of several mappings as its piece moves, so a part keeps its
//!   anon_vma (and its page offsets, should it move on) even when the
//!   next piece's destination, unmapped first, cuts the rest of its
//!   mapping away; here a move by copy empties it only once every piece
//!   has moved and the map lock is dropped, so it records which it was
//!   (`CopyMove::whole`).
//! - A private mapping that grows (in place or moving) gets holes over
//!   the new offsets in its object, so that nothing an object below holds
//!   there (a page of a former neighbour, before a `fork`) shows.
//!
//! # Families
//! Linux's moved VMA keeps its anon_vma (`copy_vma`, `mm/vma.c`), and
//! VMAs with one anon_vma merge when they meet with contiguous offsets
//! (`is_mergeable_anon_vma`), so pieces of one mapping moved apart by
//! separate calls merge again when they come back side by side, or when
//! one grows up to the other. Here the objects that pieces of a private
//! anonymous object were copied to form a *family* with it (all of them
//! Linux's one anon_vma), and VMAs merge only with the same object: the
//! members of a family that map at one distance between address and page
//! offset must be one object. So a piece moved by copy goes to a member
//! of its family rather than to a new object when one qualifies: it still
//! stands alone (no `fork` shares it, no object lies below it), and every
//! mapping of it keeps the distance between address and page offset the
//! piece will have (one that maps something, the pieces it will merge
//! with, before one that maps nothing). And a mapping that moves whole
//! and alone, which would keep its object, moves by copy into such a
//! member instead when one maps something at its new distance (a piece
//! moved away and then back to where it came from). Offsets then still
//! never meet (the piece's addresses are free, so are its offsets in that
//! object), and the pieces merge as Linux's do. The space keeps the
//! families as weak references (`Space::families`).
//!
//! A grown shared anonymous mapping keeps its object's size: its pages
//! beyond are SIGBUS, as on Linux (`Object::pages`).
//!
//! The whole call holds the map lock of every zone: it is rare, and a move
//! can go anywhere.

use std::sync::Arc;

use super::Gather;
use super::layout::{MMAP_BASE, round_hint, unmapped_area};
use super::spares;
use super::vma::{Lookup, Removed, Vma, VmaFlags, VmaIndex};
use super::{AddressSpace, MAX_MAP_COUNT, MapWrite, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::object::{Found, Object};
use crate::stats::Counter;
use crate::sync::rank::{self, Rank};
use crate::types::{Access, MremapFlags, PAGE_SHIFT, PAGE_SIZE, TASK_SIZE, is_page_aligned, page_align_up};

/// Where a remapped range ended up, and what to fault in there.
#[derive(Default)]
struct Remapped {
    /// The mapping's address after the call.
    addr: u64,
    /// For a move, the new addresses whose old PTEs were present.
    present: Vec<u64>,
    /// Locked mappings that moved or grew: fault in and wire them all.
    locked: Vec<(u64, u64)>,
    /// Moves done by copying.
    copies: Vec<CopyMove>,
}

/// A move done by copying (`Change::copy_to`).
struct CopyMove {
    /// The old range, unmapped once the pages are copied.
    from: u64,
    old_len: u64,
    /// The new range, unmapped again if a copy fails.
    to: u64,
    new_len: u64,
    /// The offsets of the pages to copy.
    pages: Vec<u64>,
    /// `MREMAP_DONTUNMAP`: the old range stays mapped, emptied, instead.
    dontunmap: bool,
    /// The old range was its whole mapping when it moved: emptied, it
    /// starts over without its object (see `Space::emptied`).
    whole: bool,
    /// The old range's object and the page offset of its start.
    source: (Arc<Object>, u64),
}

impl Remapped {
    fn stays(addr: u64) -> Remapped {
        Remapped { addr, ..Remapped::default() }
    }

    /// What a move to `addr..addr+len` carried, with its own.
    fn with(mut self, moved: Remapped) -> Remapped {
        self.present.extend(moved.present);
        self.locked.extend(moved.locked);
        self.copies.extend(moved.copies);
        self
    }
}

impl AddressSpace {
    /// Linux's `mremap(2)`: resize the mapping at `addr` from `old_len` to
    /// `new_len` bytes (both rounded up to pages), moving it if `flags`
    /// allow; returns its address after the call.
    ///
    /// - Shrinking unmaps the tail; the address stays.
    /// - Growing extends the mapping in place if it ends at `addr +
    ///   old_len` and nothing is mapped after it for the difference; else,
    ///   with `MAYMOVE`, it moves where an `mmap` of `new_len` bytes would
    ///   go; else it fails (`ENOMEM`).
    /// - `FIXED` (with `MAYMOVE`) moves it to `new_addr`, unmapping what is
    ///   there first.
    /// - A move carries the pages: the data, what is resident, what is
    ///   locked. An `old_len` of 0 maps a shared mapping a second time.
    ///
    /// Errors (`errno`): unknown flags, an unaligned `addr` or `new_addr`,
    /// a zero or too large `new_len`, `FIXED` without `MAYMOVE`, ranges
    /// that overlap, `old_len` 0 on a private mapping (`EINVAL`); nothing
    /// mapped at `addr`, or `addr + old_len` past its mapping's end
    /// (`EFAULT`); no room (`ENOMEM`), or no memory for a move by copy
    /// (then the old mapping stays); `DONTUNMAP` with a new length
    /// (`EINVAL`).
    ///
    /// `DONTUNMAP` (with `MAYMOVE`, the same length) moves the pages as any
    /// move does, to `new_addr` with `FIXED`, else where an `mmap` with
    /// `new_addr` as its hint would go, and leaves the old range mapped:
    /// private memory there reads as zeros again (a page fault makes it
    /// anew), shared memory is still the same memory. The old mapping
    /// stays whole and loses `VM_LOCKED` (its other pages are unlocked),
    /// as in Linux; a private file mapping there maps its file again. If a
    /// move by copy fails, the old mapping stays as it was but unlocked.
    ///
    /// A move of part of a private mapping, or of one whose object other
    /// mappings share, or of a whole one back to where another piece of
    /// the mapping it was moved out of keeps its page offsets, copies its
    /// private pages (see the module docs): it
    /// needs memory for both copies until the old range goes, breaks the
    /// sharing with the other side of a `fork`, and runs after the map lock
    /// is dropped, so another vCPU's change of either range meanwhile is
    /// not ordered with it.
    ///
    /// ```
    /// use vmfault::{MapFlags, MremapFlags, Prot, Vm, VmConfig};
    /// let vm = Vm::new(VmConfig { phys_bytes: 8 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let (rw, anon) = (Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS);
    /// let a = space.mmap(0, 2 * 4096, rw, anon)?;
    /// space.write(a, b"kept")?;
    /// // Something right after it: growing in place is impossible.
    /// space.mmap(a + 2 * 4096, 4096, rw, anon | MapFlags::FIXED)?;
    /// let b = space.mremap(a, 2 * 4096, 8 * 4096, MremapFlags::MAYMOVE, 0)?;
    /// assert_ne!(a, b);
    /// let mut buf = [0; 4];
    /// space.read(b, &mut buf)?;
    /// assert_eq!(&buf, b"kept");
    /// assert!(space.read(a, &mut buf).is_err(), "the old range is unmapped");
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn mremap(&self, addr: u64, old_len: u64, new_len: u64, flags: MremapFlags, new_addr: u64) -> Result<u64> {
        let s = &self.s;
        let done = s.vm.with_ctx(|ctx| {
            ctx.count(Counter::mremap_calls);
            s.mremap(ctx, addr, old_len, new_len, flags, new_addr)
        })?;
        for copy in &done.copies {
            self.copy_pages(copy)?;
        }
        s.refill(&done);
        Ok(done.addr)
    }

    /// A move by copy (see `Change::copy_to`): the pages are copied with a
    /// debugger's accesses (whatever the protection), then the old range
    /// goes. If a page cannot be copied (its swap read fails, memory runs
    /// out), the new range goes instead and the error is the call's: the
    /// old mapping stays as it was.
    fn copy_pages(&self, copy: &CopyMove) -> Result<()> {
        let s = &self.s;
        let mut page = vec![0u8; PAGE_SIZE as usize];
        for &off in &copy.pages {
            let copied = self
                .read_remote(copy.from + off, &mut page, true)
                .and_then(|()| self.write_remote(copy.to + off, &page, true));
            if let Err(e) = copied {
                let _ = s.vm.with_ctx(|ctx| s.munmap(ctx, copy.to, copy.new_len));
                return Err(e);
            }
        }
        if copy.dontunmap {
            s.vm.with_ctx(|ctx| s.emptied(ctx, copy))?;
        } else if copy.old_len > 0 {
            s.vm.with_ctx(|ctx| s.munmap(ctx, copy.from, copy.old_len))?;
        }
        Ok(())
    }
}

impl Space {
    fn mremap(
        &self,
        ctx: &Ctx<'_>,
        addr: u64,
        old_len: u64,
        new_len: u64,
        flags: MremapFlags,
        new_addr: u64,
    ) -> Result<Remapped> {
        let op = Op::Mremap;
        // `check_mremap_params`, after `PAGE_ALIGN` (which wraps to 0).
        let (old_len, new_len) = (page_align_up(old_len).unwrap_or(0), page_align_up(new_len).unwrap_or(0));
        let unknown = flags.bits() & !MremapFlags::all().bits();
        if unknown != 0 {
            return Err(Error::inval(op, "unknown MREMAP_* bits", u64::from(unknown)));
        }
        if !is_page_aligned(addr) {
            return Err(Error::inval(op, "address not page-aligned", addr));
        }
        if new_len == 0 {
            return Err(Error::inval(op, "new length is zero", 0));
        }
        if new_len > TASK_SIZE {
            return Err(Error::inval(op, "new length beyond the user address space", new_len));
        }
        let to_new = flags.intersects(MremapFlags::FIXED | MremapFlags::DONTUNMAP);
        if to_new {
            if new_addr > TASK_SIZE - new_len {
                return Err(Error::inval(op, "new range beyond the user address space", new_addr));
            }
            if !is_page_aligned(new_addr) {
                return Err(Error::inval(op, "new address not page-aligned", new_addr));
            }
            if !flags.contains(MremapFlags::MAYMOVE) {
                return Err(Error::inval(
                    op,
                    "MREMAP_FIXED or MREMAP_DONTUNMAP without MREMAP_MAYMOVE",
                    flags.bits().into(),
                ));
            }
            if flags.contains(MremapFlags::DONTUNMAP) && old_len != new_len {
                return Err(Error::inval(op, "MREMAP_DONTUNMAP with a new length", new_len));
            }
            if u128::from(addr) + u128::from(old_len) > u128::from(new_addr) && new_addr + new_len > addr {
                return Err(Error::inval(op, "the new range overlaps the old one", new_addr));
            }
            if let Some(count) = self.zones.vmas_above(MAX_MAP_COUNT - 6) {
                return Err(Error::TooManyMappings { op, count, limit: MAX_MAP_COUNT });
            }
        }
        self.change(ctx, flags.contains(MremapFlags::DONTUNMAP), |change| {
            change.remap(addr, old_len, new_len, flags, new_addr)
        })
    }

    /// Run `f` on a [`Change`] under the map lock of every zone, then tear
    /// down what it removed and release what it replaced.
    fn change<R>(&self, ctx: &Ctx<'_>, dontunmap: bool, f: impl FnOnce(&mut Change<'_, '_>) -> R) -> R {
        // In flight until the frees are done (`zones.rs`).
        let _busy = self.zones.busy(ctx.index.min(self.zones.cpus.len() - 1));
        let mut g = Gather::default();
        let mut removed = Removed::new();
        let mut replaced = Removed::new();
        let result = {
            let mut map = self.map_write_all(ctx);
            f(&mut Change {
                space: self,
                ctx,
                map: &mut map,
                g: &mut g,
                removed: &mut removed,
                replaced: &mut replaced,
                fresh: Vec::new(),
                dontunmap,
            })
        };
        removed.sort_by_key(|v| v.start);
        self.end_removal(ctx, g, removed);
        replaced.into_iter().for_each(spares::release_vma);
        result
    }

    /// Put `new`, made for pieces of `o` moved by copy, in `o`'s family
    /// (see "Families"), forgetting objects that have ended.
    fn join_family(&self, o: &Arc<Object>, new: &Arc<Object>) {
        let mut families = rank::lock(&self.families, Rank::Leaf);
        for f in families.iter_mut() {
            f.retain(|w| w.strong_count() > 0);
        }
        families.retain(|f| !f.is_empty());
        match families.iter_mut().find(|f| f.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(o)))) {
            Some(f) => f.push(Arc::downgrade(new)),
            None => families.push(vec![Arc::downgrade(o), Arc::downgrade(new)]),
        }
    }

    /// `MREMAP_DONTUNMAP` after a move by copy: empty the old range
    /// `addr..addr+len` (its pages copied), if its mapping is still there
    /// (another vCPU's change meanwhile is not ordered with the move).
    fn emptied(&self, ctx: &Ctx<'_>, copy: &CopyMove) -> Result<()> {
        let (addr, len) = (copy.from, copy.old_len);
        self.change(ctx, true, |change| {
            // The mapping the pages were copied from, still there: its
            // object, at the same offset (else another change came first).
            let (source, pindex) = &copy.source;
            let same = |v: &&Arc<Vma>| {
                v.end >= addr + len
                    && v.object.get().is_some_and(|o| Arc::ptr_eq(o, source))
                    && v.pindex(addr) == *pindex
            };
            let Some(vma) = change.map.find(addr).filter(same).cloned() else { return Ok(()) };
            self.reserve_holes_locked(ctx, change.map, Op::Mremap, addr, addr + len)?;
            // A whole private anonymous mapping starts over without its
            // object, as Linux unlinks its anon_vma; a part keeps it, and
            // so does a private file mapping's (its holes show the file).
            // Whole when it moved, as Linux empties each old mapping as
            // its piece moves: a later piece of a several-mapping move
            // may have cut the rest away since (its destination unmapped
            // first), and one may have merged with it (it keeps its
            // object then, the moved piece's too).
            let whole = copy.whole && vma.start == addr && vma.end == addr + len;
            let goes = whole && !vma.flags.intersects(VmaFlags::SHARED | VmaFlags::FILE);
            change.empty(&vma, addr, len, true, if goes { None } else { vma.object.get().cloned() });
            Ok(())
        })
    }

    /// After the lock: fault in what a move carried (a locked mapping's
    /// pages all, wired), as Linux's moved page tables and `mm_populate`
    /// leave them. Failures are ignored, as Linux's populate ignores them.
    fn refill(&self, done: &Remapped) {
        if done.present.is_empty() && done.locked.is_empty() {
            return;
        }
        self.vm.with_ctx(|ctx| {
            for &(start, end) in &done.locked {
                let _ = self.populate_locked_vmas(ctx, start, end);
            }
            for &a in &done.present {
                let _ = self.access(ctx, Op::Mremap, a, 1, Access::Read, |_, _, _, _| {});
            }
        });
    }
}

/// One `mremap` under the map lock of every zone.
struct Change<'a, 'm> {
    space: &'a Space,
    ctx: &'a Ctx<'a>,
    map: &'a mut MapWrite<'m>,
    /// What the removals tear down.
    g: &'a mut Gather,
    /// VMAs cut out (their PTEs cleared): `end_removal`'s.
    removed: &'a mut Removed,
    /// VMAs replaced by a larger copy or merged away (no PTE changed).
    replaced: &'a mut Removed,
    /// The objects made for moves by copy, by the object they replace:
    /// the pieces of one several-mapping move that shared an object share
    /// its replacement (they moved by the same distance), as Linux's keep
    /// their one anon_vma.
    fresh: Vec<(Arc<Object>, Arc<Object>)>,
    /// `MREMAP_DONTUNMAP`: moves leave the old range mapped and empty.
    dontunmap: bool,
}

impl Change<'_, '_> {
    fn remap(&mut self, addr: u64, old_len: u64, new_len: u64, flags: MremapFlags, new_addr: u64) -> Result<Remapped> {
        let op = Op::Mremap;
        let fixed = flags.contains(MremapFlags::FIXED);
        if fixed && old_len == new_len {
            return self.move_all(addr, old_len, new_addr);
        }
        let vma = self.map.find(addr).cloned().ok_or(Error::OutsideMapping { op, addr, len: old_len })?;
        // `check_prep_vma`, for a call that maps something new.
        if fixed || self.dontunmap || new_len > old_len {
            if old_len == 0 && !vma.is_shared() {
                return Err(Error::inval(op, "old length 0 (a second mapping) of a private mapping", 0));
            }
            // A shrink may cross mappings: only what stays must lie in one.
            if old_len.min(new_len) > vma.end - addr {
                return Err(Error::OutsideMapping { op, addr, len: old_len });
            }
        }
        if self.dontunmap && !fixed {
            // `vrm_set_new_addr`: where an mmap with `new_addr` as its hint
            // would go (the same length: nothing to shrink).
            let Some(to) = unmapped_area(&*self.map, round_hint(new_addr), new_len, MMAP_BASE) else {
                return Err(Error::NoAddressSpace { op, addr, len: new_len });
            };
            return self.move_to(&vma, addr, old_len, new_len, to);
        }
        if fixed {
            // `mremap_to`: what is at the destination goes first, then a
            // shrink's tail.
            self.unmap(new_addr, new_addr + new_len, false)?;
            let mut old_len = old_len;
            if old_len > new_len {
                self.unmap(addr + new_len, addr.saturating_add(old_len), true)?;
                old_len = new_len;
            }
            // Looked up again: with `old_len` 0 the destination may have
            // covered it.
            let vma = self.map.find(addr).cloned().ok_or(Error::OutsideMapping { op, addr, len: old_len })?;
            return self.move_to(&vma, addr, old_len, new_len, new_addr);
        }
        if old_len >= new_len {
            // Always allowed: unmap the tail (across mappings too).
            if old_len > new_len {
                self.unmap(addr + new_len, addr.saturating_add(old_len), true)?;
            }
            return Ok(Remapped::stays(addr));
        }
        let delta = new_len - old_len;
        if old_len == vma.end - addr && vma.end <= TASK_SIZE - delta && !self.map.intersects(vma.end, vma.end + delta) {
            return self.grow(&vma, addr, delta);
        }
        if !flags.contains(MremapFlags::MAYMOVE) {
            return Err(Error::NoAddressSpace { op, addr, len: new_len });
        }
        let Some(to) = unmapped_area(&*self.map, round_hint(0), new_len, MMAP_BASE) else {
            return Err(Error::NoAddressSpace { op, addr, len: new_len });
        };
        self.move_to(&vma, addr, old_len, new_len, to)
    }

    /// Linux's `remap_move` (6.17 on): a move that keeps the length may
    /// span several mappings, each moved to the same distance from the
    /// one before as at the source (the gaps between them are carried,
    /// and what lies in them at the destination stays). A gap at the start
    /// is `EFAULT`; a failure half way leaves the mappings before it moved.
    fn move_all(&mut self, addr: u64, len: u64, to: u64) -> Result<Remapped> {
        let end = addr.saturating_add(len);
        let mut done: Option<Remapped> = None;
        let (mut last_end, mut target, mut pos) = (0, to, addr);
        while let Some(v) = self.map.find_from(pos).filter(|v| pos < end && v.start < end).cloned() {
            if done.is_none() && addr < v.start {
                return Err(Error::OutsideMapping { op: Op::Mremap, addr, len });
            }
            let start = v.start.max(pos);
            let piece = v.end.min(end) - start;
            let dest = target + if done.is_some() { v.start - last_end } else { 0 };
            last_end = v.end;
            self.unmap(dest, dest + piece, false)?;
            // Looked up again, as Linux's `mremap_to` does: the destination
            // may have covered part of it (outside the range moved).
            let v = self.map.find(start).cloned().ok_or(Error::OutsideMapping { op: Op::Mremap, addr, len })?;
            let moved = self.move_to(&v, start, piece, piece, dest)?;
            done = Some(match done {
                None => moved,
                Some(d) => d.with(moved),
            });
            (target, pos) = (dest + piece, start + piece);
        }
        done.ok_or(Error::OutsideMapping { op: Op::Mremap, addr, len })
    }

    /// A move of part of a private mapping, or of one whose object other
    /// mappings share: here pages live in their object at their page
    /// offset, so the moved part cannot keep the object (its offsets would
    /// meet its siblings' when either grows, or when a new mapping at the
    /// old address takes the object over). It gets another object: `kin`
    /// if given (a relative the whole mapping goes to, see "Families"),
    /// else a relative or a new object (a fresh anonymous one, or a fresh
    /// copy-on-write shadow of the file), so that it merges as Linux's
    /// moved VMA, which keeps its anon_vma, would; the call copies the
    /// private pages into it once the map lock is dropped
    /// (`AddressSpace::copy_pages`; a page in swap is read back for it),
    /// then unmaps the old range. What was mapped and is not copied (the
    /// zero page, a file's own page) is faulted in at the new place. Costs
    /// a copy, and the sharing with the other side of a `fork`.
    fn copy_to(
        &mut self,
        vma: &Arc<Vma>,
        addr: u64,
        old_len: u64,
        new_len: u64,
        to: u64,
        kin: Option<Arc<Object>>,
    ) -> Result<Remapped> {
        let (ctx, phys) = (self.ctx, &self.ctx.env.phys);
        let o = vma.object.get().expect("copied moves are of mappings with objects");
        let pgoff = vma.pindex(addr);
        let file = {
            let section = ctx.rcu_read();
            o.file_of(&section)
        };
        let object = match self.fresh.iter().find(|(old, _)| Arc::ptr_eq(old, o)) {
            Some((_, new)) => new.clone(),
            None => {
                let distance = to.wrapping_sub(pgoff << PAGE_SHIFT);
                let new = match kin.or_else(|| self.relative(o, distance, false)) {
                    Some(r) => r,
                    None => {
                        let fresh = match &file {
                            Some(f) => Object::new_shadow(ctx, f, false),
                            None => Object::new_anon(ctx),
                        };
                        let new =
                            fresh.map_err(|_| Error::NoMemory { op: Op::Mremap, what: "a moved mapping's object" })?;
                        if file.is_none() {
                            self.space.join_family(o, &new);
                        }
                        new
                    }
                };
                self.fresh.push((o.clone(), new.clone()));
                new
            }
        };
        let (mut pages, mut present) = (Vec::new(), Vec::new());
        for off in (0..old_len.min(new_len)).step_by(PAGE_SIZE as usize) {
            let pindex = vma.pindex(addr + off);
            let section = ctx.rcu_read();
            let private = match o.find(pindex, &section) {
                Found::Own(pfn) | Found::Below(pfn) => !file.as_ref().is_some_and(|f| f.holds(pindex, pfn)),
                Found::Swapped { .. } => true,
                Found::Zero | Found::Uncached => false,
            };
            if private {
                pages.push(off);
            } else if self.space.pmap.pte_now(phys, addr + off).is_present() {
                present.push(to + off);
            }
        }
        let moved = Vma::new(to, to + new_len, vma.prot, vma.flags, pgoff, Some(object));
        self.map.insert(spares::vma(moved));
        self.replaced.extend(self.map.merge_range(to, to + new_len));
        let locked = if vma.flags.contains(VmaFlags::LOCKED) { vec![(to, to + new_len)] } else { Vec::new() };
        if self.dontunmap {
            // The old mapping is emptied once the pages are copied; it
            // loses `VM_LOCKED` now, as in Linux (a later piece of a
            // several-mapping move may merge with it).
            self.unlock_old(addr);
        }
        let source = (o.clone(), vma.pindex(addr));
        let whole = vma.start == addr && vma.end == addr + old_len;
        let copy = CopyMove { from: addr, old_len, to, new_len, pages, dontunmap: self.dontunmap, whole, source };
        Ok(Remapped { addr: to, present, locked, copies: vec![copy] })
    }

    /// `MREMAP_DONTUNMAP`'s old range `addr..addr+len` of `vma`: its PTEs
    /// cleared (their addresses returned), its private pages dropped if
    /// `punch` (a move by copy has copied them), and `vma` back whole,
    /// unsplit, without `VM_LOCKED` (Linux clears it on the whole old
    /// mapping: its other pages are unwired), with `object` as its object
    /// (its own, or what replaces it when the moved range took it). Linux
    /// keeps the old mapping as it is, its page tables moved away.
    fn empty(&mut self, vma: &Arc<Vma>, addr: u64, len: u64, punch: bool, object: Option<Arc<Object>>) -> Vec<u64> {
        let mut present = Vec::new();
        let carved = self.map.carve(addr, addr + len);
        let moved = if punch { None } else { Some(&mut present) };
        self.space.unmap_locked(self.ctx, self.map, &carved, self.g, false, moved);
        self.removed.extend(carved);
        // The rest of `vma`, cut off by the carve (never published).
        for at in [vma.start, addr + len] {
            if let Some(rest) = self.map.find(at).filter(|r| r.start >= vma.start && r.end <= vma.end).cloned() {
                self.replaced.push(self.map.remove(&rest));
            }
        }
        let flags = vma.flags - VmaFlags::LOCKED;
        self.map.insert(spares::vma(Vma::new(vma.start, vma.end, vma.prot, flags, vma.pgoff, object)));
        if vma.flags.contains(VmaFlags::LOCKED) {
            self.space.unwire_unlocked_locked(self.ctx, self.map, vma.start, vma.end);
        }
        present
    }

    /// An object of `o`'s family (see "Families") that a piece of `o`
    /// moved now to `distance` between address and page offset may go to:
    /// one that still stands alone, every mapping of which keeps that
    /// distance. One that maps something (at that distance, then: the
    /// pieces the moved one may merge with) comes before one that maps
    /// nothing, which only `mapped` false accepts.
    fn relative(&self, o: &Arc<Object>, distance: u64, mapped: bool) -> Option<Arc<Object>> {
        let mut family: Vec<Arc<Object>> = {
            let families = rank::lock(&self.space.families, Rank::Leaf);
            let mine = families.iter().find(|f| f.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(o))));
            mine.map(|f| f.iter().filter_map(std::sync::Weak::upgrade).collect()).unwrap_or_default()
        };
        let chosen = {
            let section = self.ctx.rcu_read();
            // Whether `r` may take the piece: if so, whether it maps
            // something.
            let fits = |r: &Arc<Object>| {
                if Arc::ptr_eq(r, o) || !r.stands_alone(&section) {
                    return None;
                }
                let mut its = self.map.iter().filter(|v| v.object.get().is_some_and(|w| Arc::ptr_eq(w, r))).peekable();
                let maps = its.peek().is_some();
                its.all(|v| v.start.wrapping_sub(v.pgoff << PAGE_SHIFT) == distance).then_some(maps)
            };
            let mut unmapped = None;
            let mut found = None;
            for (i, r) in family.iter().enumerate() {
                match fits(r) {
                    Some(true) => {
                        found = Some(i);
                        break;
                    }
                    Some(false) if !mapped && unmapped.is_none() => unmapped = Some(i),
                    _ => {}
                }
            }
            found.or(unmapped)
        };
        // The others are dropped here, after the section: one may be the
        // last reference to its object, whose end may wait for a grace
        // period.
        chosen.map(|i| family.swap_remove(i))
    }

    /// Take `VM_LOCKED` off the whole mapping at `addr`, if it has it
    /// (`MREMAP_DONTUNMAP`'s old mapping, Linux's `dontunmap_complete`):
    /// replaced by a copy without it, its PTEs unwired.
    fn unlock_old(&mut self, addr: u64) {
        let Some(old) = self.map.find(addr).filter(|v| v.flags.contains(VmaFlags::LOCKED)).cloned() else { return };
        // Its read-lockers waited for: no fault adds a wired PTE after this.
        self.replaced.extend(self.map.renew(old.start, old.end));
        let copy = self.map.find(addr).cloned().expect("renewed in place");
        let flags = copy.flags - VmaFlags::LOCKED;
        let unlocked = Vma::new(copy.start, copy.end, copy.prot, flags, copy.pgoff, copy.object.get().cloned());
        self.replaced.push(self.map.replace_no_wait(&copy, spares::vma(unlocked)));
        self.space.unwire_unlocked_locked(self.ctx, self.map, old.start, old.end);
    }

    /// A private mapping's object takes page offsets `start..end` it did
    /// not map (it grows over them): whatever an object below it holds
    /// there (a page another mapping had before a `fork`) must not show, so
    /// the object gets holes there, as a removal leaves (only a file's own
    /// page shows behind one). Nothing this object maps is there: every
    /// mapping of an object keeps one distance between address and offset,
    /// and the addresses are free.
    fn hide_below(&mut self, vma: &Vma, start: u64, end: u64) -> Result<()> {
        let (false, Some(o)) = (vma.is_shared(), vma.object.get()) else { return Ok(()) };
        let nomem = |_| Error::NoMemory { op: Op::Mremap, what: "an object's page-index node" };
        o.reserve_holes(self.ctx, start, end).map_err(nomem)?;
        o.punch_locked(self.map, self.ctx, start, end, &mut self.g.frames);
        Ok(())
    }

    /// Unmap `start..end` as `munmap` does (with its `EINVAL` for a range
    /// past the user address space: Linux's `do_vmi_munmap`).
    fn unmap(&mut self, start: u64, end: u64, prune: bool) -> Result<()> {
        if start > TASK_SIZE || end > TASK_SIZE || end < start {
            return Err(Error::inval(Op::Mremap, "range to unmap extends beyond the user address space", end));
        }
        self.space.reserve_holes_locked(self.ctx, self.map, Op::Mremap, start, end)?;
        let carved = self.map.carve(start, end);
        if !carved.is_empty() {
            self.space.unmap_locked(self.ctx, self.map, &carved, self.g, prune, None);
        }
        self.removed.extend(carved);
        Ok(())
    }

    /// Extend `vma` by `delta` bytes in place (then merge it with the
    /// mapping after it, as Linux's `vma_merge_extend` may).
    fn grow(&mut self, vma: &Arc<Vma>, addr: u64, delta: u64) -> Result<Remapped> {
        let end = vma.end + delta;
        let grown = Vma::new(vma.start, end, vma.prot, vma.flags, vma.pgoff, vma.object.get().cloned());
        // A next mapping without an object that the grown one takes in
        // (`Vma::can_extend_over`) maps through its object from then on:
        // its offsets get holes too.
        let over = match self.map.find_from(end) {
            Some(n) if n.object.get().is_none() && grown.can_extend_over(n) => n.end,
            _ => end,
        };
        self.hide_below(vma, vma.pindex(vma.end), vma.pindex(over))?;
        self.replaced.push(self.map.remove(vma));
        self.map.put(spares::vma(grown));
        self.replaced.extend(self.map.merge_range_by(end, end, Vma::can_extend_over));
        let locked = if vma.flags.contains(VmaFlags::LOCKED) { vec![(addr, end)] } else { Vec::new() };
        Ok(Remapped { addr, present: Vec::new(), locked, copies: Vec::new() })
    }

    /// Move `addr..addr+old_len` of `vma` to `to`, `new_len` bytes long.
    fn move_to(&mut self, vma: &Arc<Vma>, addr: u64, old_len: u64, new_len: u64, to: u64) -> Result<Remapped> {
        let op = Op::Mremap;
        if let Some(count) = self.space.zones.vmas_above(MAX_MAP_COUNT - 4) {
            return Err(Error::TooManyMappings { op, count, limit: MAX_MAP_COUNT });
        }
        let private_anon = !vma.is_shared() && !vma.flags.contains(VmaFlags::FILE);
        let pgoff = match vma.object.get() {
            None if private_anon => to >> PAGE_SHIFT,
            _ => vma.pgoff + ((addr - vma.start) >> PAGE_SHIFT),
        };
        if !vma.is_shared()
            && let Some(o) = vma.object.get()
        {
            let whole = addr == vma.start && addr + old_len == vma.end;
            let alone =
                self.map.iter().all(|v| Arc::ptr_eq(v, vma) || !v.object.get().is_some_and(|w| Arc::ptr_eq(w, o)));
            if !(whole && alone) {
                return self.copy_to(vma, addr, old_len, new_len, to, None);
            }
            // Linux's moved VMA keeps its anon_vma, so it merges with the
            // other pieces of its mapping that keep the page offsets the
            // move gives it: if a relative maps at the new distance, the
            // mapping goes to it (see "Families").
            if let Some(kin) = self.relative(o, to.wrapping_sub(pgoff << PAGE_SHIFT), true) {
                return self.copy_to(vma, addr, old_len, new_len, to, Some(kin));
            }
            // Offsets past the old end: nothing of what lies below shows.
            let end = vma.pindex(vma.end);
            self.hide_below(vma, end, end + ((new_len.saturating_sub(old_len)) >> PAGE_SHIFT))?;
        }
        // `MREMAP_DONTUNMAP`: what the old mapping maps after the move. A
        // private mapping's object moves with it (Linux unlinks the old
        // one's anon_vma): private anonymous memory starts over without
        // one, a private file mapping with a new shadow of its file.
        let stays = match (self.dontunmap, vma.object.get()) {
            (false, _) | (_, None) => None,
            (true, Some(o)) if vma.is_shared() => Some(o.clone()),
            (true, Some(o)) if vma.flags.contains(VmaFlags::FILE) => {
                let file = {
                    let section = self.ctx.rcu_read();
                    o.file_of(&section).expect("a private file mapping's object shadows its file")
                };
                let shadow = Object::new_shadow(self.ctx, &file, false);
                Some(shadow.map_err(|_| Error::NoMemory { op, what: "a file mapping's new shadow object" })?)
            }
            (true, Some(_)) => None,
        };
        let mut present = Vec::new();
        if old_len > 0 && !self.dontunmap {
            let carved = self.map.carve(addr, addr + old_len);
            self.space.unmap_locked(self.ctx, self.map, &carved, self.g, true, Some(&mut present));
            self.removed.extend(carved);
        }
        let moved = Vma::new(to, to + new_len, vma.prot, vma.flags, pgoff, vma.object.get().cloned());
        self.map.insert(spares::vma(moved));
        self.replaced.extend(self.map.merge_range(to, to + new_len));
        if old_len > 0 && self.dontunmap {
            // Once the new mapping is in, as in Linux's `copy_vma`: one
            // without an object may have merged with the old one, which
            // is then what stays mapped (and loses `VM_LOCKED`).
            let old = self.map.find(addr).cloned().expect("the old range is still mapped");
            let object = if vma.object.get().is_some() { stays } else { old.object.get().cloned() };
            present = self.empty(&old, addr, old_len, false, object);
        }
        present.retain(|&a| a - addr < new_len);
        present.iter_mut().for_each(|a| *a = *a - addr + to);
        let locked = if vma.flags.contains(VmaFlags::LOCKED) { vec![(to, to + new_len)] } else { Vec::new() };
        Ok(Remapped { addr: to, present, locked, copies: Vec::new() })
    }
}
