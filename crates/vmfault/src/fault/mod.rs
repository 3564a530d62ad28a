//! The page-fault path.
//!
//! A fault starts when the software MMU finds no PTE that allows an access
//! (`aspace/access.rs`). It ends by calling back with the frame that now
//! backs the address, *while that frame is still guaranteed to be mapped
//! and alive*, so the access completes even if another vCPU unmaps the page
//! right after: exactly what a CPU does when a store races `munmap`.
//!
//! Three ways to pin the VMA, chosen by `VmConfig::fault_path`:
//!
//! - `classic`: the map lock held for reading over the whole fault (Linux
//!   before 6.4, FreeBSD's `vm_fault` with the map read-locked).
//! - `speculative`: no lock; validated by the VMA's sequence count under
//!   the PTE lock (Linux's SPF series).
//! - `vma_lock`: a per-VMA read lock (Linux 6.4's per-VMA locks).
//!
//! The lockless two fall back to the classic path when they cannot finish,
//! counting why (the `spf_*` counters, the SPF series' names) and emitting a `tracing`
//! event at debug level (target `vmfault::fault`).
//!
//! `resolve`: what happens once the VMA is known: choose a page (the
//! object's, one below it in a copy-on-write chain, the zero page, a new
//! zeroed one, or a file's or swap's page read in), then install the PTE
//! under the PTE lock. Shared by every path.
//!
//! # Default
//! `Speculative`, because it was the fastest on our benchmarks. On this
//! project's 2-CPU machine (`vmfault bench page_fault1 pft ebizzy
//! --threads 1,2,8 --compare fault_path=maplock,spf,vmalock --rounds 9`),
//! over MapLock, speculative / per-VMA lock: page_fault1 1.10/1.05x at
//! 1 vCPU, 1.10/1.06x at 2, 1.03/0.98x at 8; pft 1.03/1.01x, 1.06/1.05x,
//! 1.06/1.04x; ebizzy -mT 1.01/0.95x, 1.11/1.05x, 1.13/1.14x. The per-VMA
//! lock costs a fault one store to its own RCU slot (see `sync::vma_state`),
//! but it waits for the PTE lock where the speculative path only tries it,
//! and munmap pays a scan of the pins; at one vCPU it is the slowest of the
//! three on ebizzy. Both lockless paths make mmap and munmap dearer (a new
//! VMA snapshot is published per change: mmap1 and brk1 run at 0.68-0.82x
//! of MapLock), which the fault-heavy workloads more than repay.

mod classic;
mod lockless;
mod resolve;
mod speculative;
mod vma_lock;

use crate::aspace::{Space, SpaceCpu};
use crate::config::FaultPath;
use crate::error::{Error, Op, Result, SegvCode};
use crate::machine::Ctx;
use crate::phys::Pfn;
use crate::pmap::Missed;
use crate::stats::Counter;
use crate::sync::rcu::RcuReadGuard;
use crate::types::Access;

/// What the fault path resolved: the frame now mapped, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// A new page was zero-filled and mapped.
    ZeroFill,
    /// The shared zero page was mapped read-only.
    ZeroPage,
    /// A page already in the object was mapped.
    Mapped,
    /// An existing PTE was made writable.
    Upgraded,
    /// A page shared with the other side of a fork was copied (COW).
    Copied,
    /// Another vCPU had already installed a PTE that allows the access.
    Raced,
    /// Nothing was done: the page is being paged out (`BLOCKED`, set by
    /// `RefCount::try_isolate`); try again.
    Retry,
}

// `Retry` is the last outcome, and counts nothing: the table below ends with it.
const _: () = assert!(Resolved::Retry as usize + 1 == Resolved::COUNTERS.len());

impl Resolved {
    /// The counter of a fault that ended so, by the variant's position.
    const COUNTERS: [Option<Counter>; 7] = [
        Some(Counter::zero_fill),
        Some(Counter::zero_page_maps),
        Some(Counter::page_maps),
        Some(Counter::write_upgrades),
        Some(Counter::cow_faults),
        Some(Counter::fault_races),
        None,
    ];

    /// The counter of a fault that ended so (a table, not a jump: every
    /// fault counts one). A new variant goes before `Retry`, with its
    /// counter in `COUNTERS` (checked above and by the unit test).
    #[inline]
    fn counter(self) -> Counter {
        Self::COUNTERS[self as usize].expect("the classic path retries")
    }
}

/// What faulted: the address, the access and the operation (the inputs
/// of FreeBSD's `struct faultstate`; the state a fault builds lives in
/// its path's locals).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fault {
    /// The faulting address.
    pub(crate) addr: u64,
    /// The access that faulted.
    pub(crate) access: Access,
    /// The public operation that faulted (for error messages).
    pub(crate) op: Op,
    /// An access that ignores the mapping's protection, as a debugger's
    /// through `/proc/PID/mem` (Linux's `FOLL_FORCE`): see
    /// [`Fault::allowed_in`]. Only the classic path takes these.
    pub(crate) force: bool,
    /// Whether a fault below a stack (`MAP_GROWSDOWN`) grows it: an
    /// access's does (a debugger's too, as `/proc/PID/mem`'s), a page
    /// hold's or `mlock`'s population does not (Linux's
    /// `get_user_pages` no longer grows stacks).
    pub(crate) grows: bool,
}

impl Fault {
    /// Whether `vma` allows this fault's access: its protection does, or
    /// the access is forced and Linux's `check_vma_flags` lets a forced
    /// one through: a read of any mapping (every mapping here may be
    /// read: `VM_MAYREAD`), a write of a private one (copy-on-write: the
    /// page becomes the space's own, its PTE stays read-only), never a
    /// write of a shared mapping without `PROT_WRITE`.
    pub(crate) fn allowed_in(&self, vma: &crate::aspace::vma::Vma) -> bool {
        vma.prot.allows(self.access) || (self.force && (self.access != Access::Write || !vma.is_shared()))
    }

    /// The SIGSEGV this fault ends in.
    pub(crate) fn segv(&self, ctx: &Ctx<'_>, code: SegvCode) -> Error {
        ctx.count(Counter::segv);
        Error::Segv { addr: self.addr, code }
    }
}

/// Why a lockless fault gave up and handed over to the classic path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// A whole word: a `Result` of a fault-path struct with this as its error
// keeps the error in a word of its own instead of in a byte inside the
// struct's fields, where moves of the struct split at that byte and
// stalled on store forwarding.
#[repr(u64)]
pub(crate) enum Abort {
    /// No VMA at the address in the snapshot (the classic path decides).
    NoVma,
    /// The VMA was retired (changed or removed) before or during the fault.
    VmaChanged,
    /// The VMA has no object yet.
    NoAnon,
    /// The VMA does not allow the access (the classic path reports it).
    Access,
    /// Page-table levels are missing.
    PmdChanged,
    /// No frame without draining other vCPUs' caches (needs a grace period).
    NoMem,
    /// A file's page, or a page in swap, must be read in (I/O, not inside
    /// a section).
    Io,
}

impl Abort {
    fn counter(self) -> Option<Counter> {
        match self {
            Abort::NoVma => None,
            Abort::VmaChanged => Some(Counter::spf_vma_changed),
            Abort::NoAnon => Some(Counter::spf_vma_noanon),
            Abort::Access => Some(Counter::spf_vma_access),
            Abort::PmdChanged => Some(Counter::spf_pmd_changed),
            Abort::NoMem => Some(Counter::spf_nomem),
            Abort::Io => Some(Counter::spf_vma_notsup),
        }
    }

    /// The name its trace event carries: the counter's it counts under
    /// (the `spf_*` names of the speculative page fault series), so that
    /// a trace and `vmfault stat` speak alike; `spf_no_vma` for the one
    /// that counts nothing (the classic path decides).
    fn name(self) -> &'static str {
        self.counter().map_or("spf_no_vma", Counter::name)
    }
}

fn count_bus(ctx: &Ctx<'_>, e: &Error) {
    if matches!(e, Error::Bus { .. } | Error::PageIo { .. }) {
        ctx.count(Counter::sigbus);
    }
}

/// Give `vma` its object now (creating it, or adopting a neighbour's as a
/// first write fault would), for a change that Linux follows at once with
/// write faults: see `Space::modify_range_locked`. Fails only out of memory.
///
/// # Preconditions
/// - The map lock is held (`map`, its guard); `vma` is in its index.
pub(crate) fn prepare_object_locked(
    ctx: &Ctx<'_>,
    space: &Space,
    map: &impl crate::aspace::MapHeld,
    vma: &std::sync::Arc<crate::aspace::vma::Vma>,
) -> Result<(), ()> {
    resolve::prepare(ctx, space, map, vma).map(|_| ())
}

/// A fault as the software MMU found it: the RCU section its lookup ran
/// in, still open, and what the lookup walked to. The speculative path
/// goes on inside that section, from there; the others end it first.
pub(crate) struct Looked<'c> {
    /// The lookup's section.
    pub(crate) section: RcuReadGuard<'c>,
    /// Its walk.
    pub(crate) missed: Missed<'c>,
}

/// Handle a fault at `addr` for `access` as `get_user_pages` does (a page
/// hold, `mlock`'s population: a stack below is not grown); on success
/// call `f` with the frame backing `addr`, inside an RCU read-side section
/// (see module docs).
///
/// Must be called outside any RCU read-side section of this vCPU.
pub(crate) fn handle(
    ctx: &Ctx<'_>,
    space: &Space,
    op: Op,
    addr: u64,
    access: Access,
    f: impl FnMut(Pfn),
) -> Result<()> {
    space.count_fault(ctx);
    handle_fault(ctx, space, Fault { addr, access, op, force: false, grows: false }, None, f)
}

/// [`handle`], for an access's fault that the software MMU found
/// (`looked`: inside its section, which is this vCPU's only one); it grows
/// a stack below. `cpu`: the caller's slot of `space`, where the fault
/// counts.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn handle_looked(
    ctx: &Ctx<'_>,
    space: &Space,
    cpu: &SpaceCpu,
    op: Op,
    addr: u64,
    access: Access,
    looked: Option<Looked<'_>>,
    f: impl FnMut(Pfn),
) -> Result<()> {
    cpu.count_fault();
    handle_fault(ctx, space, Fault { addr, access, op, force: false, grows: true }, looked, f)
}

#[inline(always)]
fn handle_fault(
    ctx: &Ctx<'_>,
    space: &Space,
    fault: Fault,
    looked: Option<Looked<'_>>,
    mut f: impl FnMut(Pfn),
) -> Result<()> {
    ctx.count(Counter::faults);
    let path = ctx.env.config.fault_path;
    let resolved = match path {
        FaultPath::Speculative => match speculative::fault(ctx, space, fault, looked, &mut f) {
            Ok(r) => {
                ctx.count(Counter::spf);
                if r == Resolved::Retry { classic(ctx, space, fault, &mut f)? } else { r }
            }
            Err(why) => fell_back(ctx, space, fault, why, &mut f)?,
        },
        FaultPath::VmaLock => {
            drop(looked);
            match vma_lock::fault(ctx, space, fault, &mut f) {
                Ok(r) => {
                    ctx.count(Counter::vma_lock);
                    match r {
                        Ok(Resolved::Retry) => classic(ctx, space, fault, &mut f)?,
                        r => r.inspect_err(|e| count_bus(ctx, e))?,
                    }
                }
                Err(why) => fell_back(ctx, space, fault, why, &mut f)?,
            }
        }
        FaultPath::MapLock => {
            drop(looked);
            classic(ctx, space, fault, &mut f)?
        }
    };
    ctx.count(resolved.counter());
    Ok(())
}

/// A forced fault at `addr` (see [`Fault::force`]): the classic path, on
/// success calling `f` with the frame backing `addr` as [`handle`] does.
///
/// Must be called outside any RCU read-side section of this vCPU.
pub(crate) fn handle_forced(
    ctx: &Ctx<'_>,
    space: &Space,
    op: Op,
    addr: u64,
    access: Access,
    mut f: impl FnMut(Pfn),
) -> Result<()> {
    ctx.count(Counter::faults);
    space.count_fault(ctx);
    let resolved = classic(ctx, space, Fault { addr, access, op, force: true, grows: true }, &mut f)?;
    ctx.count(resolved.counter());
    Ok(())
}

/// A lockless fault that gave up (`why`): count it, trace it, and run the
/// classic path.
#[cold]
#[inline(never)]
fn fell_back(ctx: &Ctx<'_>, space: &Space, fault: Fault, why: Abort, f: &mut impl FnMut(Pfn)) -> Result<Resolved> {
    let path = ctx.env.config.fault_path;
    if path == FaultPath::VmaLock {
        ctx.count(Counter::vma_lock_fallbacks);
    } else if let Some(c) = why.counter() {
        ctx.count(c);
    }
    tracing::debug!(
        target: "vmfault::fault",
        reason = why.name(),
        addr = %format_args!("{:#x}", fault.addr),
        path = path.name(),
        "lockless fault fell back to the map lock"
    );
    classic(ctx, space, fault, f)
}

/// The classic path, again while the page it finds is being removed from
/// every mapping (the removal holds no lock the fault needs: wait it out).
fn classic(ctx: &Ctx<'_>, space: &Space, fault: Fault, f: &mut impl FnMut(Pfn)) -> Result<Resolved> {
    loop {
        match classic::fault(ctx, space, fault, f).inspect_err(|e| count_bus(ctx, e))? {
            Resolved::Retry => std::thread::yield_now(),
            r => return Ok(r),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn each_outcome_counts_under_its_own_counter() {
        let pairs = [
            (Resolved::ZeroFill, Counter::zero_fill),
            (Resolved::ZeroPage, Counter::zero_page_maps),
            (Resolved::Mapped, Counter::page_maps),
            (Resolved::Upgraded, Counter::write_upgrades),
            (Resolved::Copied, Counter::cow_faults),
            (Resolved::Raced, Counter::fault_races),
        ];
        for (r, c) in pairs {
            assert_eq!(r.counter(), c, "{r:?}");
        }
        assert!(std::panic::catch_unwind(|| Resolved::Retry.counter()).is_err(), "a retry counts nothing");
    }
}
