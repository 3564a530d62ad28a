//! The classic fault path: the map lock held for reading for the whole
//! fault, so the VMA cannot change or go away underneath.
//!
//! Below a stack (`MAP_GROWSDOWN`) with nothing mapped at the address,
//! the stack grows first (`Space::grow_stack`, with no map lock held),
//! then the fault looks again.
//!
//! Lock order here: map lock (read), then (inside an RCU section) the PTE
//! lock, then the free-list lock inside allocations; a VMA that needs an
//! object gets one with no lock (`resolve::prepare`).

use super::{Fault, Resolved, resolve};
use crate::aspace::Space;
use crate::aspace::vma::Lookup;
use crate::error::{Error, Result, SegvCode};
use crate::machine::Ctx;
use crate::phys::Pfn;
use crate::types::TASK_SIZE;

/// Find the VMA, check the access, and resolve the fault under the map lock.
pub(super) fn fault(ctx: &Ctx<'_>, space: &Space, fault: Fault, f: &mut impl FnMut(Pfn)) -> Result<Resolved> {
    if fault.addr >= TASK_SIZE {
        return Err(fault.segv(ctx, SegvCode::MapErr));
    }
    let mut map = space.map_read(ctx, fault.addr, fault.addr + 1);
    let mut grown = false;
    let vma = loop {
        if let Some(vma) = map.find(fault.addr) {
            break vma;
        }
        // Linux's `lock_mm_and_find_vma` (and for a debugger's access,
        // `__access_remote_vm`): below a stack, it grows, once per fault
        // (see `aspace/stack.rs`).
        drop(map);
        if grown || !fault.grows || !space.grow_stack(ctx, fault.addr) {
            return Err(fault.segv(ctx, SegvCode::MapErr));
        }
        grown = true;
        map = space.map_read(ctx, fault.addr, fault.addr + 1);
    };
    if !fault.allowed_in(vma) {
        return Err(fault.segv(ctx, SegvCode::AccErr));
    }
    let object = if resolve::may_allocate(ctx, vma, &fault) {
        Some(
            resolve::prepare(ctx, space, &map, vma)
                .map_err(|_| Error::NoMemory { op: fault.op, what: "an object's page index" })?,
        )
    } else {
        vma.object.get()
    };
    resolve::resolve_stable(ctx, space, vma, object, fault, f)
}
