//! `madvise`.
//!
//! The walk follows Linux's `madvise_walk_vmas`: mapped parts of the range
//! get the advice, holes make the call return `ENOMEM` at the end (or at
//! once when nothing is mapped from `addr` on), an advice that does not
//! apply to a VMA fails at that VMA.
//!
//! `MADV_DONTNEED` takes the map lock for writing here (Linux takes it for
//! reading and relies on the page-table lock): it keeps faults out while
//! pages leave their objects. The cost is concurrency for madvise-heavy
//! programs, none of the seeds' workloads.

use super::Gather;
use super::vma::VmaFlags;
use super::{AddressSpace, MapHeld, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::stats::Counter;
use crate::types::{Advice, is_page_aligned, page_align_up};

impl AddressSpace {
    /// Give advice about `addr..addr+len` (`len` rounded up).
    ///
    /// `DontNeed` drops pages: private anonymous memory reads back as zeros,
    /// shared memory keeps its contents. `Random`, `Sequential` and `Normal`
    /// set VMA flags (splitting and merging VMAs as Linux does). `WillNeed`
    /// and `Free` change nothing without swap or memory pressure; `Cold`
    /// and `PageOut` change nothing here yet (the page queues and the page
    /// daemon decide what is reclaimed), but are checked as Linux checks
    /// them.
    ///
    /// Errors: unaligned `addr`, a range that wraps, `Free` on shared memory
    /// or a file mapping (`EINVAL`); `DontNeed`, `Free`, `Cold` or
    /// `PageOut` on an `mlock`ed mapping (`EINVAL`, once the mappings
    /// before it are advised); holes in the range (`ENOMEM`, after
    /// advising the rest).
    pub fn madvise(&self, addr: u64, len: u64, advice: Advice) -> Result<()> {
        self.s.vm.with_ctx(|ctx| {
            ctx.count(Counter::madvise_calls);
            self.s.madvise(ctx, addr, len, advice)
        })
    }
}

impl Space {
    fn madvise(&self, ctx: &Ctx<'_>, addr: u64, len: u64, advice: Advice) -> Result<()> {
        let op = Op::Madvise;
        if !is_page_aligned(addr) {
            return Err(Error::inval(op, "address not page-aligned", addr));
        }
        let end = match page_align_up(len).and_then(|l| addr.checked_add(l)) {
            Some(e) => e,
            None => {
                return Err(Error::inval(op, "range wraps around the address space", len));
            }
        };
        if end == addr {
            return Ok(());
        }
        match advice {
            Advice::Normal | Advice::Random | Advice::Sequential => self.madvise_flags(ctx, addr, end, advice),
            Advice::DontNeed => self.dontneed(ctx, addr, end),
            Advice::WillNeed | Advice::Free | Advice::Cold | Advice::PageOut => {
                let map = self.map_read(ctx, addr, end);
                walk(op, &map, addr, end, |v, _, _| {
                    // Linux's `madvise_dontneed_free_valid_vma` and
                    // `can_madv_lru_vma`: not on locked memory.
                    if v.flags.contains(VmaFlags::LOCKED) {
                        let what = match advice {
                            Advice::Free => Some("MADV_FREE on an mlocked mapping"),
                            Advice::Cold => Some("MADV_COLD on an mlocked mapping"),
                            Advice::PageOut => Some("MADV_PAGEOUT on an mlocked mapping"),
                            _ => None,
                        };
                        if let Some(what) = what {
                            return Err(Error::inval(op, what, v.start));
                        }
                    }
                    // Linux's `vma_is_anonymous`: shared memory (shmem)
                    // and private file mappings are not.
                    if advice == Advice::Free && (v.is_shared() || v.flags.contains(VmaFlags::FILE)) {
                        return Err(Error::inval(op, "MADV_FREE applies to private anonymous memory only", v.start));
                    }
                    Ok(())
                })
            }
        }
    }

    fn madvise_flags(&self, ctx: &Ctx<'_>, start: u64, end: u64, advice: Advice) -> Result<()> {
        let op = Op::Madvise;
        let mut map = self.map_write(ctx, start, end);
        // Collect the mapped pieces first (the walk's hole semantics), then
        // change each run of VMAs without holes.
        let mut pieces = Vec::new();
        let result = walk(op, &map, start, end, |_, s, e| {
            pieces.push((s, e));
            Ok(())
        });
        let mut changes = super::mprotect::Changes::default();
        for (s, e) in pieces {
            let change = |v: &super::vma::Vma| {
                let mut f = v.flags - (VmaFlags::RAND_READ | VmaFlags::SEQ_READ);
                match advice {
                    Advice::Random => f |= VmaFlags::RAND_READ,
                    Advice::Sequential => f |= VmaFlags::SEQ_READ,
                    _ => {}
                }
                (v.prot, f)
            };
            self.modify_range_locked(ctx, &mut map, op, s..e, change, &mut changes)?;
        }
        drop(map);
        // Advice flags never change protection, so nothing was narrowed.
        self.finish(ctx, Gather { ptes: changes.narrowed, ..Gather::default() });
        drop(changes);
        result
    }

    fn dontneed(&self, ctx: &Ctx<'_>, start: u64, end: u64) -> Result<()> {
        let phys = &ctx.env.phys;
        let id = self.id();
        let mut g = Gather::default();
        let (result, renewed) = {
            let mut map = self.map_write(ctx, start, end);
            // The pages change under the VMAs: replace them, so that a
            // speculative fault that found a page before we took it out of
            // its object aborts instead of mapping it.
            self.reserve_holes_locked(ctx, &map, Op::Madvise, start, end)?;
            let renewed = map.renew(start, end);
            let r = walk(Op::Madvise, &map, start, end, |v, s, e| {
                // Linux's can_madv_lru_vma: mlocked pages stay.
                if v.flags.contains(VmaFlags::LOCKED) {
                    return Err(Error::inval(Op::Madvise, "MADV_DONTNEED on an mlocked mapping", s));
                }
                let n = self.pmap.zap(phys, s, e, |a, pte| super::pte_cleared(ctx.m, id, a, pte));
                ctx.count_n(Counter::pages_unmapped, n);
                g.zapped(n, v.is_shared());
                if !v.is_shared()
                    && let Some(o) = v.object.get()
                {
                    o.punch_locked(&map, ctx, v.pindex(s), v.pindex(e), &mut g.frames);
                }
                Ok(())
            });
            (r, renewed)
        };
        self.finish(ctx, g);
        drop(renewed);
        result
    }
}

/// Linux's `madvise_walk_vmas`: call `f(vma, from, to)` for each mapped
/// piece of `start..end`; `ENOMEM` if there were holes (or nothing mapped
/// from `start` on), unless `f` failed first.
fn walk(
    op: Op,
    map: &impl MapHeld,
    start: u64,
    end: u64,
    mut f: impl FnMut(&super::vma::Vma, u64, u64) -> Result<()>,
) -> Result<()> {
    let hole = Error::NotMapped { op, addr: start, end };
    let mut unmapped = false;
    let mut pos = start;
    let mut any = false;
    for v in map.overlapping(start, end) {
        any = true;
        if v.start > pos {
            unmapped = true;
        }
        let s = pos.max(v.start);
        let e = v.end.min(end);
        f(v, s, e)?;
        pos = e;
    }
    if !any {
        // Nothing from `start` on inside the range: Linux returns ENOMEM at once.
        return Err(hole);
    }
    if unmapped || pos < end { Err(hole) } else { Ok(()) }
}
