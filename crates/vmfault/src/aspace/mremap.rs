//! `mremap`: shrink, grow in place, or move a mapping (Linux's
//! `mm/mremap.c`, its checks in its order).
//!
//! Here a page lives in its object at its page offset (Linux finds an
//! anonymous page through its PTE instead), and every mapping of a private
//! object keeps one distance between address and offset, so offsets never
//! meet. A move keeps that:
//!
//! - A shared mapping, or a private one that moves whole and is its
//!   object's only mapping, keeps its object at the same page offsets (an
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
//! - A private mapping that grows (in place or moving) gets holes over
//!   the new offsets in its object, so that nothing an object below holds
//!   there (a page of a former neighbour, before a `fork`) shows.
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
    /// (then the old mapping stays). `DONTUNMAP` is not modelled (`EINVAL`;
    /// Linux moves the pages and leaves the old range mapped and empty).
    ///
    /// A move of part of a private mapping, or of one whose object other
    /// mappings share, copies its private pages (see the module docs): it
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
        if copy.old_len > 0 {
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
            if flags.contains(MremapFlags::DONTUNMAP) {
                return Err(Error::inval(op, "MREMAP_DONTUNMAP is not modelled", flags.bits().into()));
            }
            if let Some(count) = self.zones.vmas_above(MAX_MAP_COUNT - 6) {
                return Err(Error::TooManyMappings { op, count, limit: MAX_MAP_COUNT });
            }
        }
        // In flight until the frees are done (`zones.rs`).
        let _busy = self.zones.busy(ctx.index.min(self.zones.cpus.len() - 1));
        let mut g = Gather::default();
        let mut removed = Removed::new();
        let mut replaced = Removed::new();
        let result = {
            let mut map = self.map_write_all(ctx);
            let mut change = Change {
                space: self,
                ctx,
                map: &mut map,
                g: &mut g,
                removed: &mut removed,
                replaced: &mut replaced,
                fresh: Vec::new(),
            };
            change.remap(addr, old_len, new_len, flags, new_addr)
        };
        removed.sort_by_key(|v| v.start);
        self.end_removal(ctx, g, removed);
        replaced.into_iter().for_each(spares::release_vma);
        result
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
        if fixed || new_len > old_len {
            if old_len == 0 && !vma.is_shared() {
                return Err(Error::inval(op, "old length 0 (a second mapping) of a private mapping", 0));
            }
            // A shrink may cross mappings: only what stays must lie in one.
            if old_len.min(new_len) > vma.end - addr {
                return Err(Error::OutsideMapping { op, addr, len: old_len });
            }
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
    /// old address takes the object over). It gets a new object (a fresh
    /// anonymous one, or a fresh copy-on-write shadow of the file), so that
    /// it merges as Linux's moved VMA, which keeps its anon_vma, would; the
    /// call copies the private pages into it once the map lock is dropped
    /// (`copy_resident`; a page in swap is read back for it), then unmaps
    /// the old range. What was mapped and is not copied (the zero page, a
    /// file's own page) is faulted in at the new place. Costs a copy, and
    /// the sharing with the other side of a `fork`.
    fn copy_to(
        &mut self,
        vma: &Arc<Vma>,
        addr: u64,
        old_len: u64,
        new_len: u64,
        to: u64,
        pgoff: u64,
    ) -> Result<Remapped> {
        let (ctx, phys) = (self.ctx, &self.ctx.env.phys);
        let o = vma.object.get().expect("copied moves are of mappings with objects");
        let file = {
            let section = ctx.rcu_read();
            o.file_of(&section)
        };
        let env = &self.space.vm.m.env;
        let object = match self.fresh.iter().find(|(old, _)| Arc::ptr_eq(old, o)) {
            Some((_, new)) => new.clone(),
            None => {
                let fresh = match &file {
                    Some(f) => Object::new_shadow(ctx, env, f, false),
                    None => Object::new_anon(ctx, env),
                };
                let new = fresh.map_err(|_| Error::NoMemory { op: Op::Mremap, what: "a moved mapping's object" })?;
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
        let copy = CopyMove { from: addr, old_len, to, new_len, pages };
        Ok(Remapped { addr: to, present, locked, copies: vec![copy] })
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
        self.hide_below(vma, vma.pindex(vma.end), vma.pindex(vma.end) + (delta >> PAGE_SHIFT))?;
        let grown = Vma::new(vma.start, end, vma.prot, vma.flags, vma.pgoff, vma.object.get().cloned());
        self.replaced.push(self.map.remove(vma));
        self.map.put(spares::vma(grown));
        self.replaced.extend(self.map.merge_range(end, end));
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
                return self.copy_to(vma, addr, old_len, new_len, to, pgoff);
            }
            // Offsets past the old end: nothing of what lies below shows.
            let end = vma.pindex(vma.end);
            self.hide_below(vma, end, end + ((new_len.saturating_sub(old_len)) >> PAGE_SHIFT))?;
        }
        let mut present = Vec::new();
        if old_len > 0 {
            let carved = self.map.carve(addr, addr + old_len);
            self.space.unmap_locked(self.ctx, self.map, &carved, self.g, true, Some(&mut present));
            self.removed.extend(carved);
        }
        present.retain(|&a| a - addr < new_len);
        present.iter_mut().for_each(|a| *a = *a - addr + to);
        let moved = Vma::new(to, to + new_len, vma.prot, vma.flags, pgoff, vma.object.get().cloned());
        self.map.insert(spares::vma(moved));
        self.replaced.extend(self.map.merge_range(to, to + new_len));
        let locked = if vma.flags.contains(VmaFlags::LOCKED) { vec![(to, to + new_len)] } else { Vec::new() };
        Ok(Remapped { addr: to, present, locked, copies: Vec::new() })
    }
}
