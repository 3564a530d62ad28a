//! Resolving a fault in a known, stable VMA of anonymous memory (Linux's
//! `do_anonymous_page` and the write-fault half of `do_wp_page`).
//!
//! 1. Make sure the VMA has an object if this fault may need a new page
//!    (`prepare`, Linux's `anon_vma_prepare`, including its reuse of a
//!    neighbour's object so that the two VMAs can merge later).
//! 2. Allocate missing page-table pages.
//! 3. Outside any RCU section (allocation may drain every vCPU's page
//!    cache, which waits for a grace period): if the page is not resident
//!    and this fault may allocate, reserve its object-index slot and
//!    allocate and zero a new page, before any lock.
//! 4. Inside an RCU section: pick the page (the object's; the shared zero
//!    page for a read of untouched private memory; or the new one), take
//!    the PTE lock, re-check the PTE, insert a new page into the object,
//!    install the PTE (Release), call back with the frame, unlock.
//!
//! Nothing is half-installed on failure: a new page that could not be
//! inserted is freed, and a PTE is written only once its page is complete.

#![deny(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Fault, Resolved};
use crate::aspace::Space;
use crate::aspace::vma::{Vma, VmaTree};
use crate::error::{Error, Result};
use crate::object::{Insert, Object};
use crate::phys::Pfn;
use crate::pmap::{Pmap, Pte};
use crate::stats::Counter;
use crate::types::{Access, PAGE_SHIFT, Prot};
use crate::vm::Ctx;

/// Resolve `fault` in `vma`.
///
/// # Preconditions
/// - `vma` cannot change or be removed for the duration (the classic path
///   holds the map lock for reading; `map` is the index it guards).
/// - The caller is outside any RCU read-side section of this vCPU.
pub(super) fn resolve(
    ctx: &Ctx<'_>,
    space: &Space,
    map: &VmaTree,
    vma: &Arc<Vma>,
    fault: Fault,
    f: impl FnOnce(Pfn),
) -> Result<Resolved> {
    let phys = &ctx.m.phys;
    let nomem = |what| Error::NoMemory { op: fault.op, what };
    let write = fault.access == Access::Write;
    let pindex = vma.pindex(fault.addr);
    // A read of untouched private memory can use the zero page; anything
    // else may need a page of the VMA's object.
    let may_allocate = write || vma.is_shared() || !ctx.m.config.zero_page;
    let object = if may_allocate {
        Some(prepare(ctx, space, map, vma).map_err(|_| nomem("an object's page index"))?)
    } else {
        vma.object.get()
    };
    let frames = ctx.frames();
    let leaf = space.pmap.pte_alloc(&frames, fault.addr).map_err(|_| nomem("a page-table page"))?;

    // Outside any read-side section: allocating may have to drain every
    // vCPU's page cache, which waits for a grace period. Zeroing is the bulk
    // of a fault's work; it is done here too, before any lock.
    let mut fresh = None;
    if may_allocate {
        let o = object.expect("allocating faults have an object");
        let resident = {
            let _rcu = ctx.rcu_read();
            o.lookup(pindex).is_some()
        };
        if !resident {
            o.reserve(&frames, pindex).map_err(|_| nomem("an object's page-index node"))?;
            let mut frame = frames.alloc().ok_or_else(|| {
                ctx.count(Counter::fault_nomem);
                nomem("a data page")
            })?;
            phys.zero(&mut frame);
            fresh = Some(frame);
        }
    }

    let _rcu = ctx.rcu_read();
    let existing = object.and_then(|o| o.lookup(pindex));
    let (_ptl, contended) = Pmap::lock(phys, &leaf);
    if contended {
        ctx.count(Counter::pte_lock_contended);
    }
    let cur = Pte(leaf.entry.load(Ordering::Relaxed));
    if cur.allows(fault.access) {
        if let Some(frame) = fresh {
            frames.free_owned(frame);
        }
        f(cur.pfn());
        return Ok(Resolved::Raced);
    }
    let (pfn, resolved) = match (existing, fresh) {
        (Some(p), fresh) => {
            if let Some(frame) = fresh {
                frames.free_owned(frame);
            }
            (p, if cur.is_present() { Resolved::Upgraded } else { Resolved::Mapped })
        }
        (None, Some(frame)) => match object.expect("allocating faults have an object").insert(&frames, pindex, frame) {
            Ok(Insert::Ours(p)) => (p, Resolved::ZeroFill),
            Ok(Insert::Theirs(p)) => (p, Resolved::Mapped),
            Err((_, frame)) => {
                frames.free_owned(frame);
                ctx.count(Counter::fault_nomem);
                return Err(nomem("an object's page-index node"));
            }
        },
        // Under the map lock a resident page cannot vanish, so only a fault
        // that may not allocate gets here: a read of untouched private memory.
        (None, None) => (phys.zero_pfn(), Resolved::ZeroPage),
    };
    let exec = vma.prot.contains(Prot::EXEC);
    let pte = if pfn == phys.zero_pfn() {
        Pte::new(pfn, false, exec, false)
    } else {
        Pte::new(pfn, vma.prot.contains(Prot::WRITE), exec, write)
    };
    // Release pairs with the Acquire of `Pmap::translate`: the page's
    // contents are visible to whoever sees this PTE.
    leaf.entry.store(pte.0, Ordering::Release);
    f(pfn);
    Ok(resolved)
}

/// The object of `vma`, creating it (or adopting a neighbour's) if needed.
/// Serialized by the space's anon lock.
fn prepare<'v>(ctx: &Ctx<'_>, space: &Space, map: &'v VmaTree, vma: &'v Arc<Vma>) -> Result<&'v Arc<Object>, ()> {
    if let Some(o) = vma.object.get() {
        return Ok(o);
    }
    let _anon = space.anon_lock();
    if let Some(o) = vma.object.get() {
        return Ok(o);
    }
    // Linux's find_mergeable_anon_vma: the next VMA first, then the previous.
    let next = map.find_from(vma.end).filter(|n| n.start == vma.end);
    let prev = map.prev_of(vma.start).filter(|p| p.end == vma.start);
    let reuse = next
        .filter(|n| compatible(vma, n))
        .and_then(|n| n.object.get())
        .or_else(|| prev.filter(|p| compatible(p, vma)).and_then(|p| p.object.get()))
        .cloned();
    let object = match reuse {
        Some(o) => o,
        None => Object::new_anon(ctx, &space.vm.m).map_err(|_| ())?,
    };
    let _ = vma.object.set(object);
    Ok(vma.object.get().expect("just set"))
}

/// Linux's `anon_vma_compatible(lower, upper)`: adjacent, same flags apart
/// from the access rights, contiguous page offsets.
fn compatible(lower: &Vma, upper: &Vma) -> bool {
    lower.end == upper.start
        && lower.flags == upper.flags
        && !lower.is_shared()
        && upper.pgoff == lower.pgoff + ((lower.end - lower.start) >> PAGE_SHIFT)
}
