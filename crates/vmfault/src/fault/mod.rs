//! The page-fault path.
//!
//! A fault starts when the software MMU finds no PTE that allows an access
//! (`aspace/access.rs`). It ends by calling back with the frame that now
//! backs the address, *while that frame is still guaranteed to be mapped
//! and alive*, so the access completes even if another vCPU unmaps the page
//! right after: exactly what a CPU does when a store races `munmap`.
//!
//! - `classic`: the map lock held for reading over the whole fault (Linux
//!   before 6.4, FreeBSD's `vm_fault` with the map read-locked).
//! - `anon`: what happens once the VMA is known and stable: choose a page
//!   (the object's, the zero page, or a new zeroed one), then install the
//!   PTE under the PTE lock. Shared by every fault path.

#![deny(unsafe_code)]

mod anon;
mod classic;

use crate::aspace::Space;
use crate::error::{Error, Op, Result, SegvCode};
use crate::phys::Pfn;
use crate::stats::Counter;
use crate::types::Access;
use crate::vm::Ctx;

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
    /// Another vCPU had already installed a PTE that allows the access.
    Raced,
}

/// The state of one fault (FreeBSD's `struct faultstate`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fault {
    /// The faulting address.
    pub(crate) addr: u64,
    /// The access that faulted.
    pub(crate) access: Access,
    /// The public operation that faulted (for error messages).
    pub(crate) op: Op,
}

impl Fault {
    /// The SIGSEGV this fault ends in.
    pub(crate) fn segv(&self, ctx: &Ctx<'_>, code: SegvCode) -> Error {
        ctx.count(Counter::segv);
        Error::Segv { addr: self.addr, code }
    }
}

/// Handle a fault at `addr` for `access`; on success call `f` with the
/// frame backing `addr`, inside an RCU read-side section (see module docs).
///
/// Must be called outside any RCU read-side section of this vCPU.
pub(crate) fn handle(
    ctx: &Ctx<'_>,
    space: &Space,
    op: Op,
    addr: u64,
    access: Access,
    f: impl FnOnce(Pfn),
) -> Result<()> {
    ctx.count(Counter::faults);
    let fault = Fault { addr, access, op };
    let resolved = classic::fault(ctx, space, fault, f)?;
    ctx.count(match resolved {
        Resolved::ZeroFill => Counter::zero_fill,
        Resolved::ZeroPage => Counter::zero_page_maps,
        Resolved::Mapped => Counter::page_maps,
        Resolved::Upgraded => Counter::write_upgrades,
        Resolved::Raced => Counter::fault_races,
    });
    Ok(())
}
