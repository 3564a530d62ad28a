//! The per-VMA lock fault path (protocol 4 in `lib.rs`; Linux's
//! `lock_vma_under_rcu`, merged in 6.4).
//!
//! Inside one RCU read-side section that pins the faulting address
//! (`Rcu::pin`): find the VMA in the published snapshot and check it is
//! live (`VmaState::is_live_pinned`): that is the read lock. Writers retire
//! a VMA and wait for the pins in its range before they change anything it
//! maps, so while the lock is held the VMA is stable and the fault runs as
//! the classic one does, without speculation: it may allocate page-table
//! levels (no munmap can prune them meanwhile) and report SIGSEGV for a
//! denied access itself. The lock is held from the lookup to the install;
//! it costs the fault one store to its own slot (see `sync::vma_state`).
//!
//! It falls back to the map lock when the VMA is missing or retired, when
//! a file's page must be read in (I/O under an RCU section would hold up
//! every grace period), and
//! when it has no object yet (as Linux's first version did when
//! `anon_vma` was still NULL), or when no frame can be had without a grace
//! period (draining other vCPUs' caches).
//!
//! `tests/loom_spf.rs` checks a copy of these steps against munmap and
//! mprotect: change their order there too.

use super::lockless::{self, Prepared};
use super::resolve::{self, Commit};
use super::{Abort, Fault, Resolved};
use crate::aspace::Space;
use crate::error::{Result, SegvCode};
use crate::machine::Ctx;
use crate::phys::Pfn;
use crate::pmap::Pmap;
use crate::stats::Counter;

/// Resolve `fault` under the VMA's read lock; `Err` means fall back.
pub(super) fn fault(
    ctx: &Ctx<'_>,
    space: &Space,
    fault: Fault,
    f: &mut impl FnMut(Pfn),
) -> Result<Result<Resolved>, Abort> {
    let frames = ctx.frames();
    let pin = ctx.rcu_pin(fault.addr);
    let (vma, object) = lockless::vma(ctx, space, &pin, &fault, |v| v.state.is_live_pinned(&pin), false)?;
    // Under the read lock the chain is stable: pages leave an object, or
    // move up a copy-on-write chain, only once its VMAs are retired and
    // their pins waited for.
    let Prepared { pindex, found, fresh } = lockless::page(ctx, &frames, vma, object, &pin, &fault)?;
    locked(ctx, space, vma, &frames, Commit { space, object, pindex, found, fresh }, fault, f)
}

/// The install with `vma` read-locked (stable: its range cannot be pruned,
/// its pages cannot leave the object).
fn locked(
    ctx: &Ctx<'_>,
    space: &Space,
    vma: &crate::aspace::vma::Vma,
    frames: &crate::phys::Frames<'_>,
    mut c: Commit<'_>,
    fault: Fault,
    f: &mut impl FnMut(Pfn),
) -> Result<Result<Resolved>, Abort> {
    if !vma.prot.allows(fault.access) {
        return Ok(Err(fault.segv(ctx, SegvCode::AccErr)));
    }
    let phys = frames.phys();
    let leaf = match space.pmap.pte_alloc(frames, fault.addr) {
        Ok(leaf) => leaf,
        Err(_) => {
            resolve::discard(frames, c.fresh.take());
            return Err(Abort::NoMem);
        }
    };
    let (ptl, contended) = Pmap::lock(phys, &leaf);
    if contended {
        ctx.count(Counter::pte_lock_contended);
    }
    Ok(Ok(resolve::commit_locked(ctx, frames, vma, &leaf, &ptl, c, fault, f)))
}
