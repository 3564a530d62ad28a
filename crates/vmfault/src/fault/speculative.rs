//! The speculative fault path (Linux's SPF, protocol 3 in `lib.rs`):
//! no lock at all until the PTE lock.
//!
//! Inside one RCU read-side section (which keeps the VMA, its object and
//! the page tables allocated, see `aspace::vma::Snapshot`):
//!
//! 1. find the VMA in the published snapshot; it must be live (its
//!    sequence count "even") and allow the access;
//! 2. it must already have its object (`spf_vma_noanon`: the first fault of
//!    a VMA creates it on the classic path) and its page-table levels
//!    (`spf_pmd_changed`: levels are never allocated speculatively, since a
//!    level added under a table that munmap is pruning would leak);
//! 3. look the page up (a file's page not yet read in needs I/O, which
//!    cannot wait inside a section: `spf_vma_notsup`), or allocate and zero a new one (from the vCPU's
//!    cache; draining other caches needs a grace period, impossible inside
//!    a section: `spf_nomem`);
//! 4. take the PTE lock with a try-lock (counting failures), and re-check
//!    that the VMA is still live *under the lock*: a writer retires a VMA
//!    before it takes the PTE locks to zap or narrow, so either we see the
//!    retirement, or our install precedes its zap;
//! 5. install as every path does (`resolve::commit_locked`).
//!
//! Any check that fails frees what was prepared and aborts with its reason;
//! the caller counts it, emits a trace event and runs the classic path.
//!
//! `tests/loom_spf.rs` checks a copy of these steps against munmap and
//! mprotect: change their order there too.

use super::lockless::{self, Prepared};
use super::resolve::{self, Commit};
use super::{Abort, Fault, Looked, Resolved};
use crate::aspace::Space;
use crate::machine::Ctx;
use crate::phys::Pfn;
use crate::stats::Counter;
use crate::sync::spin;

/// Try to resolve `fault` without the map lock.
/// `looked`: the software MMU's section and walk, to go on from (the
/// section ends on return, so a fallback runs outside it).
#[inline]
pub(super) fn fault(
    ctx: &Ctx<'_>,
    space: &Space,
    fault: Fault,
    looked: Option<Looked<'_>>,
    f: &mut impl FnMut(Pfn),
) -> Result<Resolved, Abort> {
    let phys = &ctx.env.phys;
    let frames = ctx.frames();
    let (section, missed) = match looked {
        Some(l) => (l.section, Some(l.missed)),
        None => (ctx.rcu_read(), None),
    };
    let (vma, object) = lockless::vma(ctx, space, &section, &fault, |v| v.state.is_live(), true)?;
    // After the snapshot: the walk the lookup made is used only if no
    // page-table page was detached since (`pmap::Missed`). Levels are
    // looked at before any page is prepared, which would be wasted.
    let leaf = space.pmap.pte_after(phys, fault.addr, missed).ok_or(Abort::PmdChanged)?;
    // Down the copy-on-write chain too: a collapse, which moves pages up
    // it, retires the VMAs first, so the re-check below catches a walk it
    // raced with.
    let Prepared { pindex, found, fresh } = lockless::page(ctx, &frames, vma, object, &section, &fault)?;
    let ptl = &phys.page(leaf.node()).ptl;
    let mut spins = 0;
    let guard = loop {
        if let Some(g) = spin::try_lock_as(ptl, crate::sync::rank::Rank::Pte) {
            break g;
        }
        ctx.count(Counter::pte_lock_try_failures);
        crate::sync::backoff(&mut spins);
    };
    if !vma.state.still_live_under(&guard) {
        drop(guard);
        resolve::discard(&frames, fresh);
        return Err(Abort::VmaChanged);
    }
    let c = Commit { space, object, pindex, found, fresh };
    Ok(resolve::commit_locked(ctx, &frames, vma, &leaf, &guard, c, fault, f))
}
