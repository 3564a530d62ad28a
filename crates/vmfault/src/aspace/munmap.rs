//! `munmap`, and the teardown of a removed range that `mmap(MAP_FIXED)`
//! shares with it.
//!
//! Under the map lock (write): cut the range out of the VMA index
//! (splitting VMAs at its edges), clear its PTEs, take the pages of private
//! objects out of their objects, and detach page-table pages that no VMA
//! needs any more. After the lock is dropped: wait for the grace period
//! (the TLB shootdown) and free the frames; then drop the removed VMAs.

use std::sync::Arc;

use super::Gather;
use super::vma::Lookup;
use super::vma::{Removed, Vma};
use super::{AddressSpace, MapWrite, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::stats::Counter;
use crate::types::{TASK_SIZE, is_page_aligned, page_align_up};

impl AddressSpace {
    /// Remove the mappings in `addr..addr+len` (`len` rounded up to pages).
    ///
    /// As in Linux, holes and unmapped ranges are fine; an unaligned `addr`,
    /// a zero `len` or a range beyond the user address space is `EINVAL`.
    /// Private pages in the range are freed; reading them later is SIGSEGV.
    pub fn munmap(&self, addr: u64, len: u64) -> Result<()> {
        self.s.vm.with_ctx(|ctx| {
            ctx.count(Counter::munmap_calls);
            self.s.munmap(ctx, addr, len)
        })
    }
}

impl Space {
    pub(crate) fn munmap(&self, ctx: &Ctx<'_>, addr: u64, len: u64) -> Result<()> {
        let op = Op::Munmap;
        if !is_page_aligned(addr) {
            return Err(Error::inval(op, "address not page-aligned", addr));
        }
        if addr > TASK_SIZE || len > TASK_SIZE - addr {
            return Err(Error::inval(op, "range extends beyond the user address space", len));
        }
        let end = addr + page_align_up(len).expect("len <= TASK_SIZE");
        if end == addr {
            return Err(Error::inval(op, "length is zero", len));
        }
        // In flight until the frees are done, not only while the lock is
        // held: what other vCPUs' unhinted mmaps look at (`zones.rs`).
        let _busy = self.zones.busy(ctx.index.min(self.zones.cpus.len() - 1));
        let mut g = Gather::default();
        let carved = {
            let mut map = self.map_write(ctx, addr, end);
            self.reserve_holes_locked(ctx, &map, op, addr, end)?;
            let carved = map.carve(addr, end);
            if !carved.is_empty() {
                self.unmap_locked(ctx, &map, &carved, &mut g, true, None);
            }
            carved
        };
        self.end_removal(ctx, g, carved);
        Ok(())
    }

    /// The end of a change that removed `carved` (carved out of the index,
    /// their pages torn down into `g`), with
    /// the map lock released: every unlink is done (VMAs retired, PTEs
    /// zapped, the old snapshot retired when the lock went). `finish`,
    /// then the write-back of removed shared file mappings, then the
    /// removed VMAs dropped (`drop_removed`).
    pub(super) fn end_removal(&self, ctx: &Ctx<'_>, mut g: Gather, carved: Removed) {
        let unlinked = ctx.env.rcu.cookie();
        let geo = self.zones.geo();
        g.gone = carved
            .iter()
            .filter(|v| v.object.get().is_some())
            .fold(super::zones::ZoneSet::default(), |s, v| s.with(geo.zone_set(v.start, v.end)));
        // Removed VMAs were unlinked before `finish`'s look at the readers.
        let quiet = self.finish(ctx, g);
        self.write_back_removed(ctx, &carved);
        self.drop_removed(ctx, carved, unlinked, quiet);
    }

    /// Reserve what removing the private pages of `start..end` will need
    /// (index nodes for the holes of shadow objects, see `object::shadow`),
    /// so that the removal itself cannot fail. Call with the map lock held
    /// for writing (`map`, its guard), before changing anything.
    pub(super) fn reserve_holes_locked(
        &self,
        ctx: &Ctx<'_>,
        map: &MapWrite<'_>,
        op: Op,
        start: u64,
        end: u64,
    ) -> Result<()> {
        // Lookups, not an iteration (no allocation): this runs on every
        // munmap and mmap.
        let mut pos = start;
        while let Some(v) = map.find_from(pos).filter(|v| v.start < end) {
            if let (false, Some(o)) = (v.is_shared(), v.object.get()) {
                let (s, e) = (v.pindex(v.start.max(start)), v.pindex(v.end.min(end)));
                o.reserve_holes(ctx, s, e).map_err(|_| Error::NoMemory { op, what: "an object's page-index node" })?;
            }
            pos = v.end;
        }
        Ok(())
    }

    /// Tear down the pages of VMAs just carved out of the index.
    ///
    /// # Preconditions
    /// - The map lock is held for writing (`map`, its guard) and `carved`
    ///   (non-empty, in address order) was just removed from its index.
    ///
    /// Gathers the frames to free after the grace period and the PTEs
    /// cleared into `g`. With `prune`, page-table pages in
    /// the VMA-free gap around the range are detached too (not when a new
    /// mapping is about to fill the range). With `moved` (`mremap`), the
    /// pages stay in their objects, where a new VMA maps them, and the
    /// addresses whose PTEs were present are pushed there.
    pub(super) fn unmap_locked(
        &self,
        ctx: &Ctx<'_>,
        map: &MapWrite<'_>,
        carved: &[Arc<Vma>],
        g: &mut Gather,
        prune: bool,
        mut moved: Option<&mut Vec<u64>>,
    ) {
        let phys = &ctx.env.phys;
        let id = self.id();
        for v in carved {
            let n = self.pmap.zap(phys, v.start, v.end, |a, pte| {
                if let Some(present) = moved.as_deref_mut() {
                    present.push(a);
                }
                super::pte_cleared(ctx.m, id, a, pte)
            });
            ctx.count_n(Counter::pages_unmapped, n);
            g.zapped(n, v.is_shared());
            // A private object's pages in this range are reachable from this
            // VMA only (page offsets of private anonymous memory are unique
            // per address in a space); a shared object keeps its pages. A
            // shadow object leaves holes where its backing would show.
            if !v.is_shared()
                && moved.is_none()
                && let Some(o) = v.object.get()
            {
                o.punch_locked(map, ctx, v.pgoff, v.pindex(v.end), &mut g.frames);
            }
        }
        if prune {
            let (first, last) = (carved[0].start, carved[carved.len() - 1].end);
            // Inside the zones held: a table of another zone's may be in use
            // by a change there (`zones.rs`).
            let (low, high) = map.reach();
            let floor = map.prev_of(first).map_or(low, |p| p.end.max(low));
            let ceiling = map.find_from(last).map_or(high, |n| n.start.min(high));
            self.pmap.prune(phys, first, last, floor, ceiling, &mut g.frames);
        }
    }
}
