//! The per-VMA lock fault path (protocol 4 of shared/DESIGN.md; Linux's
//! `lock_vma_under_rcu`, merged in 6.4).
//!
//! Inside one RCU read-side section: find the VMA in the published
//! snapshot and take its read lock (`VmaState::try_read_lock`, which fails
//! once the VMA is retired). Writers retire a VMA and wait for its readers
//! before they change anything it maps, so while the lock is held the VMA
//! is stable and the fault runs as the classic one does, without
//! speculation: it may allocate page-table levels (no munmap can prune them
//! meanwhile) and report SIGSEGV for a denied access itself.
//!
//! It falls back to the map lock when the VMA is missing or retired, and
//! when it has no object yet (as Linux's first version did when
//! `anon_vma` was still NULL), or when no frame can be had without a grace
//! period (draining other vCPUs' caches).

#![deny(unsafe_code)]

use super::anon::{self, Commit};
use super::{Abort, Fault, Resolved};
use crate::aspace::Space;
use crate::error::{Result, SegvCode};
use crate::phys::Pfn;
use crate::pmap::Pmap;
use crate::stats::Counter;
use crate::vm::Ctx;

/// Resolve `fault` under the VMA's read lock; `Err` means fall back.
pub(super) fn fault(
    ctx: &Ctx<'_>,
    space: &Space,
    fault: Fault,
    f: &mut impl FnMut(Pfn),
) -> Result<Result<Resolved>, Abort> {
    let phys = &ctx.m.phys;
    let frames = ctx.frames();
    let section = ctx.rcu_read();
    let vma = space.snapshot(&section).find(fault.addr).ok_or(Abort::NoVma)?;
    // Protection and object are fixed for a VMA's life (a change replaces
    // it), so they can be read before locking it.
    let allocate = anon::may_allocate(ctx, vma, &fault);
    let object = vma.object.get();
    if allocate && object.is_none() {
        return Err(Abort::NoAnon);
    }
    // Prepare a page before taking the lock: writers that retire this VMA
    // wait for its readers, so the lock is held only for the install, not
    // for the zeroing. (The object index is never pruned: safe unlocked.)
    let pindex = vma.pindex(fault.addr);
    let mut fresh = None;
    if allocate && vma.prot.allows(fault.access) {
        let o = object.expect("checked above");
        if o.lookup(pindex).is_none() {
            o.reserve(&frames, pindex).map_err(|_| Abort::NoMem)?;
            let mut frame = frames.alloc().ok_or(Abort::NoMem)?;
            phys.zero(&mut frame);
            fresh = Some(frame);
        }
    }
    if !vma.state.try_read_lock() {
        if let Some(frame) = fresh {
            frames.free_owned(frame);
        }
        return Err(Abort::VmaChanged);
    }
    let r = locked(ctx, space, vma, &frames, Commit { object, pindex, existing: None, fresh }, fault, f);
    vma.state.read_unlock();
    r
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
            if let Some(frame) = c.fresh.take() {
                frames.free_owned(frame);
            }
            return Err(Abort::NoMem);
        }
    };
    c.existing = c.object.and_then(|o| o.lookup(c.pindex));
    if c.existing.is_none() && c.fresh.is_none() && anon::may_allocate(ctx, vma, &fault) {
        // The page was resident when we looked and is gone now: only a
        // retired VMA loses pages, and ours is locked; take the slow path.
        return Err(Abort::VmaChanged);
    }
    let (ptl, contended) = Pmap::lock(phys, &leaf);
    if contended {
        ctx.count(Counter::pte_lock_contended);
    }
    Ok(anon::commit_locked(ctx, frames, vma, &leaf, &ptl, c, fault, f))
}
