//! Resolving a fault in a known VMA: the page it needs, then the PTE
//! (Linux's `do_anonymous_page`, the write-fault half of `do_wp_page`,
//! and the first half of `do_swap_page` and `filemap_fault`: a page of a
//! file or of swap is read in first).
//!
//! `resolve_stable` serves the classic path (the VMA pinned by the map
//! lock); `commit_locked`, the part under the PTE lock, serves every path.
//!
//! 1. Make sure the VMA has an object if this fault may need a new page
//!    (`prepare`, Linux's `anon_vma_prepare`, including its reuse of a
//!    neighbour's object so that the two VMAs can merge later).
//! 2. Allocate missing page-table pages.
//! 3. Outside any RCU section (allocation may drain every vCPU's page
//!    cache, which waits for a grace period): read a page in from its file
//!    or from swap, holding it (`ReadIn`) until the fault is done with it;
//!    if the page is not resident and this fault may allocate, reserve its
//!    object-index slot and allocate and zero a new page, before any lock.
//! 4. Inside an RCU section: pick the page (the object's; the shared zero
//!    page for a read of untouched private memory; or the new one), take
//!    the PTE lock, re-check the PTE, insert a new page into the object,
//!    install the PTE (Release), call back with the frame, unlock.
//!
//! Nothing is half-installed on failure: a new page that could not be
//! inserted is freed, and a PTE is written only once its page is complete.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Fault, Resolved};
use crate::aspace::Space;
use crate::aspace::vma::{Vma, VmaFlags};
use crate::config::Rmap;
use crate::error::{Error, Result};
use crate::machine::Ctx;
use crate::object::{Found, Insert, Object, Pv, Slot};
use crate::phys::{Frames, OwnedFrame, Pfn};
use crate::pmap::{Leaf, Pmap, Pte};
use crate::stats::Counter;
use crate::sync::rcu::RcuReadGuard;
use crate::sync::spin::WordGuard;
use crate::types::{Access, PAGE_SHIFT, PAGE_SIZE, Prot};

/// Whether `fault` in `vma` may need a new page (and so the VMA's object):
/// anything but a read of untouched private memory, which maps the zero page.
pub(super) fn may_allocate(ctx: &Ctx<'_>, vma: &Vma, fault: &Fault) -> bool {
    fault.access == Access::Write || vma.is_shared() || !ctx.env.config.zero_page
}

/// Resolve `fault` in a VMA that cannot change meanwhile; `object` is the
/// VMA's object if this fault may allocate (else whatever it has).
///
/// # Preconditions
/// - `vma` cannot change or be removed for the duration: the classic path
///   holds the map lock for reading.
/// - The caller is outside any RCU read-side section of this vCPU (this
///   may drain every vCPU's page cache, which waits for a grace period).
pub(super) fn resolve_stable(
    ctx: &Ctx<'_>,
    space: &Space,
    vma: &Vma,
    object: Option<&Arc<Object>>,
    fault: Fault,
    f: &mut impl FnMut(Pfn),
) -> Result<Resolved> {
    let phys = &ctx.env.phys;
    let nomem = |what| Error::NoMemory { op: fault.op, what };
    let pindex = vma.pindex(fault.addr);
    let frames = ctx.frames();
    let leaf = space.pmap.pte_alloc(&frames, fault.addr).map_err(|_| nomem("a page-table page"))?;

    // Allocation and zeroing or copying (the bulk of a fault's work) come
    // before any lock, outside any section: allocating may have to drain
    // the caches. Under the map lock no page can leave the object or the
    // objects below it, and those below are frozen, but the page daemon
    // may page one out (it is checked again under the PTE lock). A file's
    // page is read in first (it never leaves the cache while mapped), and
    // so is a page in swap; a page read in is held until the fault is done
    // with it (see `ReadIn`).
    let (mut read, mut held) = (false, None);
    let found = loop {
        let (found, file) = match object {
            Some(o) => {
                let section = ctx.rcu_read();
                let found = o.find(pindex, &section);
                if read && let Found::Own(p) | Found::Below(p) = found {
                    if !phys.try_hold(p, Some(ctx.counters)) {
                        // Being paged out again: let that finish, look again.
                        drop(section);
                        std::thread::yield_now();
                        continue;
                    }
                    held = Some(ReadIn { m: ctx.m, pfn: p });
                }
                let file = if found == Found::Uncached { o.file_of(&section) } else { None };
                (found, file)
            }
            None => (Found::Zero, None),
        };
        match (found, file, object) {
            (_, Some(file), _) => file.fill(ctx, fault.op, fault.addr, pindex)?,
            // Beyond a shared anonymous object's size (`Object::pages`).
            (Found::Uncached, None, Some(o)) => {
                return Err(Error::Bus { addr: fault.addr, pgoff: pindex, size: o.pages << PAGE_SHIFT });
            }
            (Found::Swapped { depth }, _, Some(o)) => o.page_in(ctx, fault.op, pindex, depth).map_err(|e| match e {
                Error::Host { errno, .. } => Error::PageIo { addr: fault.addr, errno },
                e => e,
            })?,
            _ => break found,
        }
        // Held at the next lookup.
        read = true;
    };
    // A copy of the page below is made inside the section below, from the
    // page found there: the daemon may page the one found above out, and
    // its frame be reused, once the lookup's section has ended.
    // (So the frame for it is not filled here: zeroing it too would double
    // the cost of a copy-on-write fault.)
    let copy_below = matches!(found, Found::Below(_)) && fault.access == Access::Write;
    let allowed = may_allocate(ctx, vma, &fault) && fault.allowed_in(vma);
    let fresh = new_page(ctx, &frames, None, vma, object, pindex, found, &fault, None, allowed).map_err(|lack| {
        if lack == Lack::Frame {
            ctx.count(Counter::fault_nomem);
        }
        nomem(lack.what())
    })?;
    let mut fresh = if copy_below { fresh } else { filled(&frames, fresh, found, fault.addr) };

    let section = ctx.rcu_read();
    let now = object.map_or(Found::Zero, |o| o.find(pindex, &section));
    if matches!(now, Found::Swapped { .. } | Found::Uncached) {
        // Paged out (or a file page evicted) since the first lookup: read
        // it in again. Never take it for untouched memory (the zero page).
        discard(&frames, fresh);
        return Ok(Resolved::Retry);
    }
    let (existing, below) = split(now);
    if copy_below
        && existing.is_none()
        && let Some(new) = fresh.as_mut()
    {
        match below {
            Some(src) => frames.copy_into(&mut new.frame, src),
            None => {
                // The page below went meanwhile (paged out): look again.
                discard(&frames, fresh);
                return Ok(Resolved::Retry);
            }
        }
    }
    let (ptl, contended) = Pmap::lock(phys, &leaf);
    if contended {
        ctx.count(Counter::pte_lock_contended);
    }
    let c = Commit { space, object, pindex, found: now, fresh };
    let resolved = commit_locked(ctx, &frames, vma, &leaf, &ptl, c, fault, f);
    drop(held);
    Ok(resolved)
}

/// A page this fault read in (from swap or its file), held with a wiring
/// from the lookup after the read until the fault has mapped it or copied
/// it: else allocating the copy, or the page-table and index pages, can
/// wake the page daemon, which may page it out again, and under enough
/// pressure the fault would read it in and lose it for ever (the page the
/// read's own allocation freed). Linux holds the page the same way
/// (`do_swap_page` and `filemap_fault` return it with a reference).
///
/// The hold is not a `PageHold` (`aspace/hold.rs`): that one waits for a
/// grace period when it frees, and this one is released under the map
/// lock. A page that left its object meanwhile goes to the orphans, freed
/// by the next operation's `finish`.
struct ReadIn<'a> {
    m: &'a crate::machine::Machine,
    pfn: Pfn,
}

impl Drop for ReadIn<'_> {
    fn drop(&mut self) {
        if self.m.phys.unwire(self.pfn, None) {
            self.m.orphan(self.pfn);
        }
    }
}

/// A fault's new page and the slot of its object's index reserved for it.
pub(super) struct Fresh<'p> {
    /// The frame (zeroed, or a copy of the page below, before any lock).
    pub(super) frame: OwnedFrame<'p>,
    /// Where it goes in the object (no second walk to insert it).
    pub(super) slot: Slot<'p>,
}

/// Free a new page that was not used (the reserved slot stays: empty
/// index slots are normal, and teardown frees the nodes).
pub(super) fn discard(frames: &Frames<'_>, fresh: Option<Fresh<'_>>) {
    if let Some(f) = fresh {
        frames.free_owned(f.frame);
    }
}

/// What a fault could not get for its new page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// A whole word: a `Result` of a fault-path struct with this as its error
// keeps the error in a word of its own instead of in a byte inside the
// struct's fields, where moves of the struct split at that byte and
// stalled on store forwarding.
#[repr(u64)]
pub(super) enum Lack {
    /// A node of the object's page index.
    Index,
    /// The data page itself.
    Frame,
    /// A file's page not read in yet (the caller's job).
    Io,
}

impl Lack {
    fn what(self) -> &'static str {
        match self {
            Lack::Index => "an object's page-index node",
            Lack::Frame => "a data page",
            Lack::Io => "a file page not read in",
        }
    }
}

/// The new page a fault needs, allocated (and then filled, [`filled`])
/// before any lock: none if the object has its own page, or if this is a
/// read of a page below (mapped read-only) or of untouched private memory
/// that maps the zero page; else a frame with its index slot reserved, to
/// be zeroed, or for a write over a page below, to be a copy of it
/// (copy-on-write). `found` is where the chain had the page when the
/// caller looked; `slot`, the object's slot for `pindex` if the caller
/// has reserved it already; `allowed`, whether this fault may allocate in
/// `vma` at all ([`may_allocate`] and [`Fault::allowed_in`], which the
/// caller has worked out already); `section`, the caller's open section
/// if it runs in one (the frame then comes from the vCPU's cache only:
/// `Frames::alloc_in`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn new_page<'p>(
    ctx: &Ctx<'_>,
    frames: &Frames<'p>,
    section: Option<&RcuReadGuard<'_>>,
    vma: &Vma,
    object: Option<&Arc<Object>>,
    pindex: u64,
    found: Found,
    fault: &Fault,
    slot: Option<Slot<'p>>,
    allowed: bool,
) -> Result<Option<Fresh<'p>>, Lack> {
    debug_assert_eq!(allowed, may_allocate(ctx, vma, fault) && fault.allowed_in(vma));
    let write = fault.access == Access::Write;
    let needed = match found {
        Found::Own(_) => false,
        Found::Below(_) => write,
        Found::Zero => true,
        // The caller reads the file's (or swap's) page in first (or gives up).
        Found::Uncached | Found::Swapped { .. } => return Err(Lack::Io),
    };
    if !needed || !allowed {
        return Ok(None);
    }
    let o = object.expect("allocating faults have an object");
    let slot = match slot {
        Some(s) => s,
        None => o.reserve(frames, pindex, &ctx.own.index_hint).map_err(|_| Lack::Index)?,
    };
    let frame = match section {
        Some(s) => frames.alloc_in(s),
        None => frames.alloc(),
    };
    Ok(Some(Fresh { frame: frame.ok_or(Lack::Frame)?, slot }))
}

/// Fill the frame of [`new_page`] (the bulk of a fault's work): a copy of
/// the page below that `found` names, else zeros (kept in the cache at
/// `addr`, the faulting address: `Frames::zero_for`).
#[inline(always)]
pub(super) fn filled<'p>(
    frames: &Frames<'_>,
    mut fresh: Option<Fresh<'p>>,
    found: Found,
    addr: u64,
) -> Option<Fresh<'p>> {
    if let Some(new) = fresh.as_mut() {
        match found {
            Found::Below(src) => frames.copy_into(&mut new.frame, src),
            _ => frames.zero_for(&mut new.frame, addr),
        }
    }
    fresh
}

/// A lookup's result as (own page, page below).
pub(super) fn split(found: Found) -> (Option<Pfn>, Option<Pfn>) {
    match found {
        Found::Own(p) => (Some(p), None),
        Found::Below(p) => (None, Some(p)),
        Found::Zero | Found::Uncached | Found::Swapped { .. } => (None, None),
    }
}

/// What a fault has prepared before taking the PTE lock.
pub(super) struct Commit<'a> {
    /// The faulting space (its id names pv entries).
    pub(super) space: &'a Space,
    /// The VMA's object (if any).
    pub(super) object: Option<&'a Arc<Object>>,
    /// The page's index in it.
    pub(super) pindex: u64,
    /// Where the lookup (inside the caller's current section, or under a
    /// lock that keeps it true) found the page at `pindex`: the object's
    /// own, one below (shadow chains), or none, which maps the zero page
    /// only if it is `Found::Zero` (untouched memory).
    pub(super) found: Found,
    /// A new page, if the fault may allocate and found none of its own:
    /// zeroed, or a copy of `below` for a write, with its index slot.
    pub(super) fresh: Option<Fresh<'a>>,
}

/// The part of every fault path that runs under the PTE lock: re-check the
/// PTE, pick the page, insert a new page into its object, install the PTE
/// (Release), call back with the frame.
///
/// # Preconditions
/// - Inside an RCU read-side section; `_ptl` is the PTE lock of `leaf`.
/// - `vma` is stable, or the caller has re-validated it under `_ptl`.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(super) fn commit_locked(
    ctx: &Ctx<'_>,
    frames: &Frames<'_>,
    vma: &Vma,
    leaf: &Leaf<'_>,
    _ptl: &WordGuard<'_>,
    c: Commit<'_>,
    fault: Fault,
    f: &mut impl FnMut(Pfn),
) -> Resolved {
    let phys = frames.phys();
    let write = fault.access == Access::Write;
    let (existing, below) = split(c.found);
    let cur = Pte(leaf.entry.load(Ordering::Relaxed));
    if cur.allows(fault.access) {
        discard(frames, c.fresh);
        f(cur.pfn());
        return Resolved::Raced;
    }
    let (pfn, resolved) = match (existing, c.fresh) {
        (Some(p), fresh) => {
            discard(frames, fresh);
            (p, if cur.is_present() { Resolved::Upgraded } else { Resolved::Mapped })
        }
        (None, Some(new)) => {
            let o = c.object.expect("allocating faults have an object");
            match o.insert(frames, new.slot, new.frame) {
                Insert::Ours(p) if below.is_some() => (p, Resolved::Copied),
                // The first touch of anonymous memory (Linux's
                // `do_anonymous_page`), the fault a page's life starts
                // with: an empty PTE (no wiring to keep or give back), in
                // a mapping that is neither locked (no wiring to take) nor
                // `PROT_NONE` (a forced access maps nothing), of an object
                // that is no file's (no dirty mark, a read maps it
                // writable too) and without pv entries to keep. Each test
                // of the general tail below then knows its answer: the
                // page is new, so not blocked; it is not the zero page nor
                // one below, so it is mapped with the VMA's rights.
                Insert::Ours(p)
                    if cur == Pte::NONE
                        && !vma.prot.is_empty()
                        && !vma.flags.contains(VmaFlags::LOCKED)
                        && !o.is_file()
                        && ctx.env.config.rmap != Rmap::PvEntry =>
                {
                    let pte = Pte::new(p, vma.prot.contains(Prot::WRITE), vma.prot.contains(Prot::EXEC), write);
                    // Release, as below: nothing was mapped, so no second
                    // MMU has anything to hear of.
                    c.space.pmap.install_locked(leaf, _ptl, fault.addr, cur, pte);
                    f(p);
                    return Resolved::ZeroFill;
                }
                Insert::Ours(p) => (p, Resolved::ZeroFill),
                Insert::Theirs(p) => (p, Resolved::Mapped),
                // Paged out since the lookup: read it in again.
                Insert::Swapped => return Resolved::Retry,
                Insert::Changed => unreachable!("insert takes any entry without a page"),
            }
        }
        // A read of a page an object below holds (shared, read-only), or
        // of untouched private memory (a page that was resident cannot
        // vanish from a stable VMA, so only a fault that may not allocate
        // gets here without one).
        (None, None) => match (below, c.found) {
            (Some(p), _) => (p, Resolved::Mapped),
            (None, Found::Zero) => (phys.zero_pfn(), Resolved::ZeroPage),
            // A page to read in (the callers look again before they get
            // here, but a file page is never the zero page's business).
            (None, _) => return Resolved::Retry,
        },
    };
    // A page the daemon is paging out (or a removal of every mapping is
    // unmapping) is not mapped again: it may be gone once the section
    // ends. The daemon set `BLOCKED` before it took this PTE lock to clear
    // the PTEs, so either we see it here or our PTE is cleared after us.
    // A page this fault inserted cannot be: a removal finds it through
    // its object only after our insert, and its walk of this PTE waits
    // for the lock we hold (the insert also set its reference mark).
    let inserted = matches!(resolved, Resolved::ZeroFill | Resolved::Copied);
    if pfn != phys.zero_pfn() && !inserted {
        let page = phys.page(pfn);
        if page.refs.is_blocked() {
            return Resolved::Retry;
        }
        page.touch();
    }
    // A forced access (a debugger's) to a `PROT_NONE` mapping maps
    // nothing: the page stays in its object, where the next access finds
    // it (Linux installs a PTE no user access may use; here `PROT_NONE`
    // has no PTEs).
    if vma.prot.is_empty() {
        debug_assert!(fault.force, "a fault in a PROT_NONE mapping that was not forced");
        f(pfn);
        return resolved;
    }
    let exec = vma.prot.contains(Prot::EXEC);
    // A shared file page is mapped writable only by a write fault, which
    // marks it dirty: the first store after a write-back must fault.
    let file = c.object.is_some_and(|o| o.is_file());
    let read_only = pfn == phys.zero_pfn() || Some(pfn) == below || (file && !write);
    let mut pte = Pte::new(pfn, !read_only && vma.prot.contains(Prot::WRITE), exec, !read_only && write);
    // Wirings of a locked VMA (`aspace/mlock.rs`): the PTE keeps the one it
    // holds if its page stays, gives it back if the page changes
    // (copy-on-write), and a new PTE of a locked VMA wires its page. Only
    // a page that was already in an object can be BLOCKED by a removal of
    // every mapping; then nothing has changed yet and the fault retries.
    let keeps = cur.is_wired() && cur.pfn() == pfn;
    if keeps || (vma.flags.contains(VmaFlags::LOCKED) && pfn != phys.zero_pfn()) {
        if !keeps && !phys.wire_mapped(pfn, Some(ctx.counters)) {
            // Diagnostic: Retry is right whatever the page (a new one is in
            // its object already; the retry finds it blocked and waits).
            debug_assert!(matches!(resolved, Resolved::Mapped | Resolved::Upgraded), "a new page was blocked");
            return Resolved::Retry;
        }
        pte = pte.wired();
    }
    if cur.is_wired() && !keeps && phys.unwire(cur.pfn(), Some(ctx.counters)) {
        ctx.m.orphan(cur.pfn());
    }
    if file && write && pte.allows(Access::Write) {
        c.object.expect("file").mark_dirty(c.pindex);
    }
    if ctx.env.config.rmap == Rmap::PvEntry {
        pv_replace_locked(_ptl, ctx, c.space, fault.addr, cur, pfn);
    }
    // Release pairs with the Acquire of `Pmap::translate`: the page's
    // contents are visible to whoever sees this PTE.
    c.space.pmap.install_locked(leaf, _ptl, fault.addr, cur, pte);
    f(pfn);
    resolved
}

/// Keep the pv lists right as the PTE of `space` at `addr` goes from `old`
/// to mapping `pfn` (the zero page has no entries, as in Linux).
///
/// # Preconditions
/// The PTE lock of `addr` is held (`_ptl`, its guard).
fn pv_replace_locked(_ptl: &WordGuard<'_>, ctx: &Ctx<'_>, space: &Space, addr: u64, old: Pte, pfn: Pfn) {
    let phys = &ctx.env.phys;
    let pv = Pv { space: space.id(), addr: addr & !(PAGE_SIZE - 1) };
    let had = old.is_present().then(|| old.pfn()).filter(|&p| p != phys.zero_pfn());
    if had == Some(pfn) {
        return;
    }
    if let Some(p) = had {
        ctx.env.pv.remove(p, pv);
    }
    if pfn != phys.zero_pfn() {
        ctx.env.pv.add(pfn, pv);
    }
}

/// The object of `vma`, creating it (or adopting a neighbour's) if needed,
/// with the map lock held (`map`, its guard).
///
/// Takes no lock (Linux serializes `anon_vma_prepare` on the mm's
/// `page_table_lock`, a line every vCPU of the space writes): the object
/// is recorded on its reverse map for this VMA *before* it is published in
/// `vma.object`, so whoever maps a page of it through this VMA (this fault,
/// or one that lost the race to publish) finds the record in place for a
/// reverse-map walk. A fault that loses the race forgets its record; a new
/// object of its own then ends unused. Two faults on adjacent VMAs without
/// objects may each make one where a serialized pair would have shared
/// one: both are states Linux reaches too, by the order of the faults.
pub(super) fn prepare<'v>(
    ctx: &Ctx<'_>,
    space: &Space,
    map: &'v impl crate::aspace::MapHeld,
    vma: &'v Arc<Vma>,
) -> Result<&'v Arc<Object>, ()> {
    if let Some(o) = vma.object.get() {
        return Ok(o);
    }
    // Linux's find_mergeable_anon_vma: the next VMA first, then the previous.
    let (prev, next) = space.adjacent(ctx, map, vma);
    let reuse = next
        .filter(|n| compatible(vma, n))
        .and_then(|n| n.object.get().cloned())
        .or_else(|| prev.filter(|p| compatible(p, vma)).and_then(|p| p.object.get().cloned()));
    let object = match reuse {
        Some(o) => o,
        None => Object::new_anon(ctx).map_err(|_| ())?,
    };
    let owner = map.owner();
    if let Some(owner) = owner {
        owner.link_object(vma, &object);
    }
    // Release/Acquire (`OnceLock`): a fault that sees the object sees its record.
    if let Err(lost) = vma.object.set(object) {
        ctx.count(Counter::anon_races);
        if let Some(owner) = owner {
            owner.unlink_object(vma, &lost);
        }
    }
    Ok(vma.object.get().expect("set by this fault or the one it raced"))
}

/// Linux's `anon_vma_compatible(lower, upper)`: adjacent, same flags apart
/// from the access rights, contiguous page offsets.
fn compatible(lower: &Vma, upper: &Vma) -> bool {
    lower.end == upper.start
        && lower.flags == upper.flags
        && !lower.is_shared()
        && ![lower, upper].iter().any(|v| v.object.get().is_some_and(|o| o.inherited))
        && upper.pgoff == lower.pgoff + ((lower.end - lower.start) >> PAGE_SHIFT)
}
