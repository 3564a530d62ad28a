//! `mprotect`, and the attribute change over a range of VMAs that
//! `madvise(MADV_RANDOM | MADV_SEQUENTIAL | MADV_NORMAL)` shares with it.
//!
//! Linux semantics, including the non-atomic ones: the range must start
//! inside a mapping; VMAs are changed one after the other and a hole stops
//! the walk with `ENOMEM`, leaving the VMAs before it changed. VMAs are split
//! at the range edges and merged with compatible neighbours one VMA after
//! the other (locked memory made writable gets its object in between).
//!
//! PTEs are narrowed at once (write or execute rights taken away, or
//! cleared for `PROT_NONE`: the pages stay in their objects), and their
//! shootdown (a grace period) ends before the map lock is released
//! (`MapWrite::shootdown`). Widening is lazy: the next fault upgrades the
//! PTE.

use std::ops::Range;
use std::sync::Arc;

use super::Gather;
use super::spares;
use super::vma::{Lookup, VmaIndex};
use super::vma::{Vma, VmaFlags};
use super::{AddressSpace, MapWrite, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::stats::Counter;
use crate::types::{Prot, is_page_aligned, page_align_up};

impl AddressSpace {
    /// Change the protection of `addr..addr+len` (`len` rounded up).
    ///
    /// A zero `len` succeeds without looking at anything (as Linux). Errors,
    /// in Linux's order: `PROT_GROWSDOWN` with `PROT_GROWSUP`, an unaligned
    /// `addr` (`EINVAL`); a range that wraps (`ENOMEM`); unknown `PROT_*`
    /// bits (`EINVAL`; `PROT_SEM` is accepted and ignored); a range that
    /// is not fully mapped (`ENOMEM`; mappings before the first hole have
    /// been changed). `PROT_GROWSDOWN` extends the change down to the
    /// start of the stack (`MapFlags::GROWSDOWN`) that `addr..addr+len`
    /// begins in or below: `EINVAL` if the first mapping there is not a
    /// stack, `ENOMEM` if there is none; `PROT_GROWSUP` is `EINVAL` on a
    /// mapped range (x86 has no stack that grows up), `ENOMEM` on a hole.
    pub fn mprotect(&self, addr: u64, len: u64, prot: Prot) -> Result<()> {
        self.s.vm.with_ctx(|ctx| {
            ctx.count(Counter::mprotect_calls);
            self.s.mprotect(ctx, addr, len, prot)
        })
    }
}

/// `PROT_SEM` (accepted by x86's `arch_validate_prot`, without effect).
const PROT_SEM: u32 = 0x8;
/// `PROT_GROWSDOWN`: extend the change down to the start of a growing
/// stack mapping.
const PROT_GROWSDOWN: u32 = 0x0100_0000;
/// `PROT_GROWSUP` (no x86 mapping grows up).
const PROT_GROWSUP: u32 = 0x0200_0000;

/// What a VMA attribute change did (see `modify_range_locked`).
#[derive(Debug, Default)]
pub(super) struct Changes {
    /// VMAs replaced; drop them after the map lock.
    pub(super) retired: Vec<Arc<Vma>>,
    /// PTEs narrowed or cleared.
    pub(super) narrowed: u64,
}

/// Linux's `VM_ACCOUNT` rule for a protection change of `vma`: making
/// private memory writable charges it; making untouched private anonymous
/// memory read-only uncharges it.
fn accounted_flags(vma: &Vma, prot: Prot) -> VmaFlags {
    let mut flags = vma.flags;
    if prot.contains(Prot::WRITE) {
        if !vma.prot.contains(Prot::WRITE)
            && !vma.flags.intersects(VmaFlags::ACCOUNT | VmaFlags::SHARED | VmaFlags::NORESERVE)
        {
            flags |= VmaFlags::ACCOUNT;
        }
    } else if vma.flags.contains(VmaFlags::ACCOUNT) && !vma.is_shared() && vma.object.get().is_none() {
        flags -= VmaFlags::ACCOUNT;
    }
    flags
}

impl Space {
    fn mprotect(&self, ctx: &Ctx<'_>, addr: u64, len: u64, prot: Prot) -> Result<()> {
        let op = Op::Mprotect;
        // Linux's `do_mprotect_pkey`, in its order.
        let grows = prot.bits() & (PROT_GROWSDOWN | PROT_GROWSUP);
        if grows == PROT_GROWSDOWN | PROT_GROWSUP {
            return Err(Error::inval(op, "PROT_GROWSDOWN and PROT_GROWSUP together", u64::from(prot.bits())));
        }
        if !is_page_aligned(addr) {
            return Err(Error::inval(op, "address not page-aligned", addr));
        }
        if len == 0 {
            return Ok(());
        }
        let end = match page_align_up(len).and_then(|l| addr.checked_add(l)) {
            Some(e) if e > addr => e,
            _ => return Err(Error::NoAddressSpace { op, addr, len }),
        };
        // `arch_validate_prot`: PROT_SEM is accepted (and means nothing).
        let bits = prot.bits() & !(PROT_GROWSDOWN | PROT_GROWSUP | PROT_SEM);
        let Some(prot) = Prot::from_bits(bits) else {
            return Err(Error::inval(op, "unknown PROT_* bits", u64::from(prot.bits())));
        };
        let (asked, mut addr) = (addr, addr);
        if grows != 0 {
            // The VMA lookup comes first (`ENOMEM` on a hole); then
            // `PROT_GROWSDOWN` needs a stack, whose start the change goes
            // down to, and x86 has no `VM_GROWSUP` (`EINVAL`).
            let map = self.map_read(ctx, addr, end);
            let vma = map.find_from(addr).filter(|v| v.start < end);
            let Some(vma) = vma else { return Err(Error::NotMapped { op, addr, end }) };
            if grows == PROT_GROWSUP && vma.start > addr {
                return Err(Error::NotMapped { op, addr, end });
            }
            if grows == PROT_GROWSUP || !vma.flags.contains(VmaFlags::GROWSDOWN) {
                return Err(Error::inval(op, "the mapping does not grow (PROT_GROWSDOWN/PROT_GROWSUP)", vma.start));
            }
            addr = vma.start;
        }
        let mut changes = Changes::default();
        let mut populate = Vec::new();
        let result = {
            let mut map = self.map_write(ctx, addr, end);
            // The stack looked at may have grown or gone since: look again.
            if grows != 0
                && !map.find_from(asked).is_some_and(|v| v.start == addr && v.flags.contains(VmaFlags::GROWSDOWN))
            {
                drop(map);
                return self.mprotect(ctx, asked, len, Prot::from_bits_retain(bits | grows));
            }
            let f = |v: &Vma| {
                if v.flags.contains(VmaFlags::LOCKED)
                    && !v.is_shared()
                    && !v.prot.contains(Prot::WRITE)
                    && prot.contains(Prot::WRITE)
                {
                    populate.push((v.start.max(addr), v.end.min(end)));
                }
                (prot, accounted_flags(v, prot))
            };
            let r = self.modify_range_locked(ctx, &mut map, op, addr..end, f, &mut changes);
            // Like Linux's TLB flush, under the lock: no store through a
            // PTE that was writable is still in flight once mprotect
            // returns, nor once another change (a fork) can share the frame.
            map.shootdown(ctx, changes.narrowed);
            r
        };
        // The shootdown is done.
        self.finish(ctx, Gather::default());
        drop(changes);
        // Linux's mprotect_fixup: locked private memory that becomes
        // writable is faulted in for writing now (copy-on-write broken, the
        // new pages wired); failures are not reported.
        for (s, e) in populate {
            let _ = self.populate_locked_vmas(ctx, s, e);
        }
        result
    }

    /// Give every VMA in `range` the protection and flags `f` returns,
    /// splitting and merging as needed; narrow the PTEs of changed ranges.
    ///
    /// # Preconditions
    /// - The map lock is held for writing and `map` is the index it guards.
    ///
    /// Replaced VMAs and the number of PTEs narrowed or cleared go into
    /// `changes`: the caller drops the VMAs after the lock and owes a
    /// shootdown if any PTE was narrowed.
    /// Errors with `NotMapped` if `start` is not mapped or a hole follows;
    /// VMAs before the hole keep their change.
    pub(super) fn modify_range_locked(
        &self,
        ctx: &Ctx<'_>,
        map: &mut MapWrite<'_>,
        op: Op,
        range: Range<u64>,
        mut f: impl FnMut(&Vma) -> (Prot, VmaFlags),
        changes: &mut Changes,
    ) -> Result<()> {
        let Range { start, end } = range;
        let mut pos = start;
        let mut result = Ok(());
        // Only changed VMAs merge with their neighbours (Linux's
        // `vma_modify`): an unchanged one keeps a boundary `fork` left.
        loop {
            let vma = match map.find(pos) {
                Some(v) => v.clone(),
                None => {
                    result = Err(Error::NotMapped { op, addr: start, end });
                    break;
                }
            };
            let stop = vma.end.min(end);
            let (prot, flags) = f(&vma);
            // Linux's VM_MAYWRITE: a shared mapping of a file not open for
            // writing can never become writable.
            if prot.contains(Prot::WRITE) && vma.flags.contains(VmaFlags::NO_WRITE) {
                result = Err(Error::Access { op, need: "writing" });
                break;
            }
            if (prot, flags) != (vma.prot, vma.flags) {
                let old = map.carve(pos, stop);
                // Holds: pos..stop lies in the one VMA found at pos, and VMAs
                // never overlap (a real check in `VmaIndex::insert`).
                debug_assert_eq!(old.len(), 1);
                map.insert(spares::vma(old[0].slice(pos, stop, prot, flags)));
                if prot != vma.prot {
                    let changed = self
                        .pmap
                        .protect(&ctx.env.phys, pos, stop, prot, |a, pte| super::pte_cleared(ctx.m, self.id(), a, pte));
                    if prot.is_empty() {
                        ctx.count_n(Counter::pages_unmapped, changed);
                    }
                    changes.narrowed += changed;
                }
                changes.retired.extend(old);
                // Merged at once, as Linux's `vma_modify` does VMA by VMA:
                // the object given below must be seen by the next merge.
                changes.retired.extend(map.merge_range(pos, stop));
                // Linux's mprotect_fixup faults locked private memory that
                // becomes writable in at once, before it changes the next
                // VMA: the first write fault gives the VMA its object
                // (anon_vma), which then keeps it apart from a neighbour
                // with another one. The object is given here, under the map
                // lock; the populate after it (by the caller) finds it.
                if flags.contains(VmaFlags::LOCKED)
                    && !vma.is_shared()
                    && prot.contains(Prot::WRITE)
                    && !vma.prot.contains(Prot::WRITE)
                {
                    let now = map.find(pos).expect("the VMA just changed").clone();
                    // Out of memory: the populate fails too, unreported.
                    let _ = crate::fault::prepare_object_locked(ctx, self, map, &now);
                }
            }
            changes.retired.push(vma);
            pos = stop;
            if pos >= end {
                break;
            }
        }
        result
    }
}
