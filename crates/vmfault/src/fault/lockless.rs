//! What the two lockless fault paths (`speculative.rs`, `vma_lock.rs`) do
//! alike inside their read-side section, before any lock: find the VMA in
//! the published snapshot and check it ([`vma`]), then prepare the page
//! the fault needs ([`page`]). Each path keeps what differs: how the VMA
//! is held (a sequence count re-checked under the PTE lock, or a pin),
//! when the page-table levels are looked at, and how it installs.

use std::sync::Arc;

use super::resolve::{self, Fresh};
use super::{Abort, Fault};
use crate::aspace::Space;
use crate::aspace::vma::Vma;
use crate::machine::Ctx;
use crate::object::{Found, Object};
use crate::phys::Frames;
use crate::sync::rcu::RcuReadGuard;

/// The VMA of `fault` in the snapshot published to `section`, if `live`
/// says it holds (the path's own test), and its object: a fault that may
/// need a new page needs one, and only the map lock may create it
/// (`Abort::NoAnon`). With `access`, a VMA that denies the access is left
/// to the classic path (`Abort::Access`), which reports it; without, the
/// caller reports it itself.
#[inline(always)]
pub(super) fn vma<'s>(
    ctx: &Ctx<'_>,
    space: &'s Space,
    section: &'s RcuReadGuard<'_>,
    fault: &Fault,
    live: impl FnOnce(&Vma) -> bool,
    access: bool,
) -> Result<(&'s Arc<Vma>, Option<&'s Arc<Object>>), Abort> {
    let vma = space.snapshot(section, fault.addr).find(fault.addr).ok_or(Abort::NoVma)?;
    if !live(vma) {
        return Err(Abort::VmaChanged);
    }
    if access && !vma.prot.allows(fault.access) {
        return Err(Abort::Access);
    }
    let object = vma.object.get();
    if object.is_none() && resolve::may_allocate(ctx, vma, fault) {
        return Err(Abort::NoAnon);
    }
    Ok((vma, object))
}

/// The page of `fault` as the lockless paths find it before the PTE lock.
pub(super) struct Prepared<'p> {
    /// Its index in the VMA's object.
    pub(super) pindex: u64,
    /// Where the chain had it.
    pub(super) found: Found,
    /// A new page (filled) with its index slot, if the fault needs one.
    pub(super) fresh: Option<Fresh<'p>>,
}

/// Prepare the page `fault` needs in `vma` (whose object is `object`):
/// a fault that may allocate reserves its slot of the object's index
/// first and reads the object's own entry from it (one walk down the
/// index instead of three: look up, reserve, insert), looks down the
/// copy-on-write chain, and allocates and fills a new page if it needs
/// one. A file's or swap's page to read in is I/O, which cannot wait
/// inside a section (`Abort::Io`); a frame that only a drain of other
/// vCPUs' caches would give needs a grace period (`Abort::NoMem`).
#[inline(always)]
pub(super) fn page<'p>(
    ctx: &Ctx<'_>,
    frames: &Frames<'p>,
    vma: &Vma,
    object: Option<&Arc<Object>>,
    section: &RcuReadGuard<'_>,
    fault: &Fault,
) -> Result<Prepared<'p>, Abort> {
    let pindex = vma.pindex(fault.addr);
    // (A denied access allocates nothing: the per-VMA lock reports it
    // after this, the speculative path has left it to the classic one.)
    let slot = match object {
        Some(o) if resolve::may_allocate(ctx, vma, fault) && vma.prot.allows(fault.access) => {
            Some(o.reserve(frames, pindex, &ctx.own.index_hint).map_err(|_| Abort::NoMem)?)
        }
        _ => None,
    };
    let found = match object {
        Some(o) => o.find_from(pindex, slot.as_ref(), section),
        None => Found::Zero,
    };
    if matches!(found, Found::Uncached | Found::Swapped { .. }) {
        return Err(Abort::Io);
    }
    // A slot is reserved exactly when this fault may allocate (no fault
    // here is forced: `allowed_in` is the protection's test above).
    let allowed = slot.is_some();
    let fresh = resolve::new_page(ctx, frames, Some(section), vma, object, pindex, found, fault, slot, allowed)
        .map_err(|_| Abort::NoMem)?;
    Ok(Prepared { pindex, found, fresh: resolve::filled(frames, fresh, found, fault.addr) })
}
