//! `mlock` and `munlock`: Linux's semantics on FreeBSD's mechanism.
//!
//! What a caller sees is Linux's (`mm/mlock.c`): the start is rounded down
//! to its page and the length up; the range must start inside a mapping,
//! and each VMA gets `VM_LOCKED` in turn (split at the range's edges,
//! merged with neighbours), a hole stopping the walk with `ENOMEM` (the
//! VMAs before it stay locked, nothing is faulted in). Then `mlock`
//! populates: private writable memory with write faults (so copy-on-write
//! is broken now, not later), everything else with read faults; a
//! `PROT_NONE` mapping (or a file page beyond the end of the file) stops
//! it with `ENOMEM`, running out of frames with `EAGAIN`. `MADV_DONTNEED`
//! and `MADV_FREE` refuse locked mappings; a child of `fork` does not
//! inherit the lock.
//!
//! What it does underneath is FreeBSD's (`vm_map_wire`): every page of a
//! locked mapping is *wired*, one wiring per PTE, and the PTE carries a
//! wired mark (`PG_W`) saying so. Whoever clears such a PTE, or replaces
//! its page (copy-on-write), unwires the page (`aspace::pte_cleared`,
//! `fault::resolve::commit_locked`); `munlock` drops the marks and the
//! wirings. A wired page is never reclaimed (`RefCount::try_isolate` fails).
//! The wiring goes through `PhysMem::wire_mapped`, so that
//! `VmConfig::refcount` decides what it costs: one atomic operation, or
//! that under a hashed page lock (the seed's before and after; the
//! `mlock1` benchmark).
//!
//! Population runs under the map read lock, one VMA at a time: the
//! present PTEs are wired in one pass, and the first page that is missing
//! (or does not allow the access) is faulted in without the lock, which
//! wires it too since its VMA is locked. Like Linux's
//! `populate_vma_page_range`, a VMA that is no longer locked when the
//! lock is taken again (a racing `munlock`) is skipped, and so is a hole.

use super::Gather;
use super::vma::Lookup;
use super::vma::VmaFlags;
use super::{AddressSpace, Space};
use crate::error::{Error, Op, Result};
use crate::fault;
use crate::machine::Ctx;
use crate::stats::Counter;
use crate::types::{Access, PAGE_SIZE, Prot};

impl AddressSpace {
    /// Lock `addr..addr+len` in memory (`addr` rounded down to its page,
    /// the end up): mark the mappings locked, fault every page in and
    /// wire it, so that it is never reclaimed.
    ///
    /// Errors as Linux's `mlock`: a range that wraps (`EINVAL`); a range
    /// that does not start in a mapping or has a hole (`ENOMEM`; the
    /// mappings before the hole stay locked); a `PROT_NONE` mapping or a
    /// file page beyond the end of its file (`ENOMEM`, the mappings stay
    /// locked); no frame (`EAGAIN`).
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let a = space.mmap(0, 16 * 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// space.mlock(a + 4096, 2 * 4096)?;
    /// assert_eq!(vm.stats().zero_fill, 2); // faulted in (write faults: private and writable)
    /// let locked: Vec<bool> = space.mappings().iter().map(|m| m.locked).collect();
    /// assert_eq!(locked, [false, true, false]);
    /// space.munlock(a, 16 * 4096)?;
    /// assert_eq!(space.mappings().len(), 1); // merged again
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn mlock(&self, addr: u64, len: u64) -> Result<()> {
        self.s.vm.with_ctx(|ctx| {
            ctx.count(Counter::mlock_calls);
            let Some((start, end)) = lock_range(Op::Mlock, addr, len)? else { return Ok(()) };
            self.s.set_mlocked(ctx, Op::Mlock, start, end, true)?;
            self.s.populate_locked_vmas(ctx, start, end)
        })
    }

    /// Unlock `addr..addr+len` (rounded as [`mlock`](Self::mlock)): the
    /// mappings lose their lock and their pages their wirings (they stay
    /// resident until reclaimed).
    ///
    /// Errors: a range that wraps (`EINVAL`); a range that does not start
    /// in a mapping or has a hole (`ENOMEM`; the mappings before it are
    /// unlocked).
    pub fn munlock(&self, addr: u64, len: u64) -> Result<()> {
        self.s.vm.with_ctx(|ctx| {
            ctx.count(Counter::munlock_calls);
            let Some((start, end)) = lock_range(Op::Munlock, addr, len)? else { return Ok(()) };
            self.s.set_mlocked(ctx, Op::Munlock, start, end, false)
        })
    }
}

/// Linux's rounding in `do_mlock`: the start down to its page, the length
/// plus the start's offset up to whole pages, in wrapping arithmetic (a
/// length that wraps to 0 locks nothing). `None`: nothing to do.
fn lock_range(op: Op, addr: u64, len: u64) -> Result<Option<(u64, u64)>> {
    let offset = addr & (PAGE_SIZE - 1);
    let start = addr - offset;
    let len = len.wrapping_add(offset).wrapping_add(PAGE_SIZE - 1) & !(PAGE_SIZE - 1);
    let end = start.wrapping_add(len);
    if end < start {
        return Err(Error::inval(op, "range wraps around the address space", len));
    }
    Ok((end > start).then_some((start, end)))
}

impl Space {
    /// Set or clear `LOCKED` on the VMAs of `start..end`. Clearing drops
    /// the wirings of the PTEs of every VMA of the range that is unlocked
    /// afterwards, before the map lock is released.
    fn set_mlocked(&self, ctx: &Ctx<'_>, op: Op, start: u64, end: u64, lock: bool) -> Result<()> {
        let mut changes = super::mprotect::Changes::default();
        let result = {
            let mut map = self.map_write(ctx, start, end);
            let f = |v: &super::vma::Vma| {
                (v.prot, if lock { v.flags | VmaFlags::LOCKED } else { v.flags - VmaFlags::LOCKED })
            };
            let result = self.modify_range_locked(ctx, &mut map, op, start..end, f, &mut changes);
            if !lock {
                // The VMAs were replaced and their read-lockers waited for
                // (`MapWrite::carve`): no fault can add a wired PTE to them.
                self.unwire_unlocked_locked(ctx, &map, start, end);
            }
            result
        };
        self.finish(ctx, Gather::default());
        drop(changes);
        result
    }

    /// Drop the wired marks, and the wirings, of the PTEs in `start..end`
    /// of the VMAs there that are not locked.
    ///
    /// # Preconditions
    /// - The map lock is held for writing (`map`, its guard), and those
    ///   VMAs were put in under it, their predecessors' read-lockers waited
    ///   for (`MapWrite::carve`): no fault can add a wired PTE to them.
    pub(super) fn unwire_unlocked_locked(&self, ctx: &Ctx<'_>, map: &super::MapWrite<'_>, start: u64, end: u64) {
        let phys = &ctx.env.phys;
        for v in map.overlapping(start, end).filter(|v| !v.flags.contains(VmaFlags::LOCKED)) {
            self.pmap.update_range(phys, v.start.max(start), v.end.min(end), |_, pte| {
                if !pte.is_wired() {
                    return pte;
                }
                if phys.unwire(pte.pfn(), Some(ctx.counters)) {
                    ctx.m.orphan(pte.pfn());
                }
                pte.unwired()
            });
        }
    }

    /// Fault in and wire every page of the locked VMAs in `start..end`
    /// (see the module docs).
    pub(super) fn populate_locked_vmas(&self, ctx: &Ctx<'_>, start: u64, end: u64) -> Result<()> {
        let op = Op::Mlock;
        let mut addr = start;
        while addr < end {
            let (missing, access, stop) = {
                let map = self.map_read(ctx, addr, end);
                let Some(v) = map.overlapping(addr, end).next() else { return Ok(()) };
                addr = addr.max(v.start);
                let stop = v.end.min(end);
                if !v.flags.contains(VmaFlags::LOCKED) {
                    addr = stop;
                    continue;
                }
                if v.prot.is_empty() {
                    return Err(Error::Unpopulated { op, addr, cause: "the mapping is PROT_NONE" });
                }
                let access = if v.prot.contains(Prot::WRITE) && !v.is_shared() { Access::Write } else { Access::Read };
                (self.wire_present_locked(&map, ctx, addr, stop, access), access, stop)
            };
            let Some(missing) = missing else {
                addr = stop;
                continue;
            };
            addr = missing;
            fault::handle(ctx, self, op, addr, access, |_| {}).map_err(|e| match e {
                Error::Segv { .. } => Error::Unpopulated { op, addr, cause: "the page cannot be accessed" },
                Error::Bus { .. } => Error::Unpopulated { op, addr, cause: "the page lies beyond the end of its file" },
                // Linux: the populate's EFAULT becomes ENOMEM.
                Error::PageIo { .. } => {
                    Error::Unpopulated { op, addr, cause: "reading the page back from swap failed" }
                }
                Error::NoMemory { .. } => Error::TryAgain { op, addr },
                e => e,
            })?;
        }
        Ok(())
    }

    /// Wire the pages whose PTEs in `start..end` allow `access` and are
    /// not wired yet (the zero page needs no wiring); the first page left
    /// to fault in, if any.
    ///
    /// # Preconditions
    /// - The map lock is held (`_map`, its guard); `start..end` lies in one
    ///   locked VMA.
    fn wire_present_locked(
        &self,
        _map: &impl super::MapHeld,
        ctx: &Ctx<'_>,
        start: u64,
        end: u64,
        access: Access,
    ) -> Option<u64> {
        let phys = &ctx.env.phys;
        let pages = ((end - start) / PAGE_SIZE) as usize;
        let mut done = vec![false; pages];
        self.pmap.update_range(phys, start, end, |a, pte| {
            if !pte.allows(access) {
                return pte;
            }
            let i = ((a - start) / PAGE_SIZE) as usize;
            if pte.is_wired() || pte.pfn() == phys.zero_pfn() {
                done[i] = true;
                return pte;
            }
            // Fails only while a removal of every mapping of the page runs:
            // the page will be unmapped, and faulted in again.
            if phys.wire_mapped(pte.pfn(), Some(ctx.counters)) {
                done[i] = true;
                return pte.wired();
            }
            pte
        });
        done.iter().position(|d| !d).map(|i| start + i as u64 * PAGE_SIZE)
    }
}
