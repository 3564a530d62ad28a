//! Pageout of anonymous pages to swap (FreeBSD's `vm_pageout_scan` with
//! `vm_page_try_remove_all`, on protocol 5's reference counts).
//!
//! # Protocol, per page
//! 1. *Isolate*, inside a read-side section: the object still holds the
//!    frame at its index, and [`RefCount::try_isolate`] takes it from
//!    exactly "the object's reference, nothing else" to `BLOCKED` plus the
//!    daemon's own wiring. The section makes the check and the CAS one
//!    step (the frame cannot be freed and reused between them); the
//!    wiring keeps a racing `munmap` from freeing it afterwards; `BLOCKED`
//!    makes `wire_mapped` fail and faults that find the page retry
//!    (`fault::anon::commit_locked`). A wired page is never taken.
//! 2. *Unmap* it from every space through the reverse map
//!    (`aspace::unmap_everywhere_unlocked`: no map lock, see there).
//! 3. *Wait for a grace period* (once per batch): no store through an old
//!    PTE is still in flight, so the contents are final.
//! 4. *Write* it to a free swap slot. An error gives the page up: it stays
//!    in its object, resident and intact, and is mapped again by the next
//!    fault.
//! 5. *Replace* it by the slot in its object ([`Object::swap_out`]: a CAS
//!    under the object lock). Won: drop the object's reference and the
//!    daemon's wiring, which is then the last, and free the frame after a
//!    grace period (`BLOCKED` stays set until then, for faults still
//!    holding the frame number). Lost (`munmap` took the entry, or a
//!    collapse moved it): free the slot and give the page up.
//!
//! Giving up = `unblock` and drop the daemon's wiring, which frees the
//! frame if that was the last reference (`munmap` took it meanwhile).
//!
//! [`RefCount::try_isolate`]: crate::sync::refcount::RefCount::try_isolate

#![deny(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Swap;
use crate::object::Object;
use crate::phys::Pfn;
use crate::sync::rcu::RcuReader;
use crate::types::PAGE_SIZE;
use crate::vm::Machine;

/// Where the next scan starts (a clock hand over the candidates, in the
/// order `object::Swappable` and the indexes give them).
#[derive(Debug, Default)]
pub(super) struct Clock {
    hand: usize,
}

/// Page out up to `want` pages; returns the frames freed.
pub(super) fn run(m: &Machine, swap: &Swap, reader: &RcuReader, clock: &mut Clock, want: u64) -> u64 {
    let objects = m.swappable.objects();
    let mut candidates: Vec<(usize, u64, Pfn)> = Vec::new();
    for (k, o) in objects.iter().enumerate() {
        o.for_each_unwired(|i, pfn| candidates.push((k, i, pfn)));
    }
    if candidates.is_empty() {
        return 0;
    }
    // At most one turn of the clock: a page skipped for its mark has it
    // cleared, and is taken at the next turn unless a fault marks it again.
    let start = clock.hand % candidates.len();
    let bell = &m.phys.doorbell;
    let mut freed = Vec::new();
    let mut isolated: Vec<(&Arc<Object>, u64, Pfn)> = Vec::new();
    let mut visited = 0;
    for &(k, pindex, pfn) in candidates.iter().cycle().skip(start).take(candidates.len()) {
        if isolated.len() as u64 >= want {
            break;
        }
        visited += 1;
        let o = &objects[k];
        // Second chance: a page mapped or read in since the last look stays.
        if m.phys.page(pfn).take_referenced() {
            continue;
        }
        let taken = {
            let _section = m.rcu.read_lock(reader);
            o.holds(pindex, pfn) && m.phys.page(pfn).refs.try_isolate()
        };
        if !taken {
            continue;
        }
        crate::aspace::unmap_everywhere_unlocked(m, reader, o, pindex, pfn);
        isolated.push((o, pindex, pfn));
    }
    clock.hand = start + visited;
    if !isolated.is_empty() {
        m.rcu.synchronize();
    }
    let mut buf = vec![0u8; PAGE_SIZE as usize];
    let mut out = 0;
    for (o, pindex, pfn) in isolated {
        let Some(slot) = swap.alloc() else {
            give_up(m, pfn, &mut freed);
            continue;
        };
        m.phys.read_bytes(pfn, 0, &mut buf);
        if let Err(e) = swap.write(slot, &buf) {
            tracing::warn!(target: "vmfault::reclaim", error = %e, slot, "swap write failed: the page stays resident");
            bell.write_errors.fetch_add(1, Ordering::Relaxed);
            swap.free(slot);
            give_up(m, pfn, &mut freed);
            continue;
        }
        if !o.swap_out(pindex, pfn, slot) {
            swap.free(slot);
            give_up(m, pfn, &mut freed);
            continue;
        }
        let refs = &m.phys.page(pfn).refs;
        let unwired = refs.release_objref();
        debug_assert!(!unwired, "the daemon's wiring holds the page");
        let last = refs.unwire();
        debug_assert!(last, "nothing else references an isolated page");
        freed.push(pfn);
        out += 1;
    }
    bell.pageouts.fetch_add(out, Ordering::Relaxed);
    let n = freed.len() as u64;
    m.phys.free_after_grace(&m.rcu, &freed);
    drop(objects);
    n
}

/// Undo an isolation (see the module docs).
fn give_up(m: &Machine, pfn: Pfn, freed: &mut Vec<Pfn>) {
    m.phys.doorbell.failures.fetch_add(1, Ordering::Relaxed);
    let refs = &m.phys.page(pfn).refs;
    refs.unblock();
    if refs.unwire() {
        freed.push(pfn);
    }
}
