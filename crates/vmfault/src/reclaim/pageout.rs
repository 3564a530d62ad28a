//! Pageout (FreeBSD's `vm_pageout_scan` with `vm_page_try_remove_all`, on
//! protocol 5's reference counts): anonymous pages to swap, file pages
//! back to their file.
//!
//! # Choosing pages
//! From the page queues (`phys::queues`): first *age* (keep the inactive
//! list at a third of the queued pages: active pages referenced since the
//! last look go round again, the rest become inactive), then take pages
//! off the inactive head. A taken page referenced since it went inactive
//! is reactivated; a wired one, or one whose object is gone or changing,
//! goes back; the rest are isolated. Pages kept go back to the tails in one
//! queue-lock acquisition.
//!
//! # Protocol, per page
//! 1. *Isolate*, inside a read-side section: the object named by the
//!    page's descriptor still holds the frame at its index, and
//!    [`RefCount::try_isolate`] takes it from exactly "the object's
//!    reference, nothing else" to `BLOCKED` plus the daemon's own wiring.
//!    The section makes the check and the CAS one step (the frame cannot
//!    be freed and reused between them); the wiring keeps a racing
//!    `munmap` from freeing it afterwards; `BLOCKED` makes `wire_mapped`
//!    fail and faults that find the page retry
//!    (`fault::resolve::commit_locked`). A wired page is never taken.
//!
//! `tests/loom_refcount.rs` checks a copy of these steps on one page
//! against holds through a mapping and through the index: change their
//! order there too.
//! 2. *Unmap* it from every space through the reverse map
//!    (`aspace::unmap_everywhere_unlocked`: no map lock, see there).
//! 3. *Wait for a grace period* (once per batch): no store through an old
//!    PTE is still in flight, so the contents are final.
//! 4. *Write* an anonymous page to a free swap slot. An error gives the
//!    page up: it stays in its object, resident and intact, and is mapped
//!    again by the next fault. A file page is written to its file if its
//!    entry is dirty, in step 5 ([`Object::evict_file_page`]), and then
//!    leaves the index by a CAS from the entry it had (a failed write, or
//!    an entry that changed: `msync` took the dirty bit, gives it up).
//! 5. *Replace* it by the slot in its object ([`Object::swap_out`]: a CAS
//!    under the object lock, only tried: a page-in holds it around its
//!    read of a slot, so busy ones are tried again for up to 5 ms). Won: drop the object's reference and the
//!    daemon's wiring, which is then the last, and free the frame after a
//!    grace period (`BLOCKED` stays set until then, for faults still
//!    holding the frame number). Lost (`munmap` took the entry, or a
//!    collapse moved it): free the slot and give the page up.
//!
//! Giving up = `unblock` and drop the daemon's wiring, which frees the
//! frame if that was the last reference (`munmap` took it meanwhile);
//! otherwise the page goes back to the active queue.
//!
//! [`RefCount::try_isolate`]: crate::sync::refcount::RefCount::try_isolate

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::machine::Machine;
use crate::object::{Object, SwapOut};
use crate::phys::{Pfn, Queue};
use crate::swapdev::Swap;
use crate::sync::rcu::RcuReader;
use crate::sync::refcount::OBJREF;
use crate::types::PAGE_SIZE;

/// How long a round keeps trying object locks held by others.
const BUSY_WAIT: Duration = Duration::from_millis(5);

/// What one round did.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Round {
    /// Frames freed.
    pub(super) freed: u64,
    /// Inactive pages looked at.
    pub(super) looked: u64,
    /// Of those, pages that could not be taken though their object still
    /// holds a reference (wired, or changing), or were taken and given up
    /// (a failed write, no free slot). Referenced pages are not stuck:
    /// their mark is cleared, the next look may take them.
    pub(super) stuck: u64,
    /// Of those, pages on their way to a free list (taken out of their
    /// object by `munmap`, waiting for its grace period; or their object is
    /// going away).
    pub(super) in_flight: u64,
    /// Of those, pages referenced since the last look (reactivated).
    pub(super) referenced: u64,
}

/// Page out up to `want` pages; with `force`, reference marks keep no
/// page (the last round found nothing but referenced pages).
pub(super) fn run(
    m: &Machine,
    swap: &Swap,
    reader: &RcuReader,
    want: u64,
    force: bool,
    grave: &mut super::Grave,
) -> Round {
    let phys = &m.phys;
    let q = phys.queues.as_ref().expect("a Vm with swap has page queues");
    let pages = phys.pages();
    let (active, inactive) = q.lens();
    if active + inactive < want {
        // Short lists: the pages may sit in vCPUs' batches.
        q.drain_batches(pages, &m.rcu);
    }
    let (active, inactive) = q.lens();
    let target = ((active + inactive) / 3).max(want);
    if inactive < target {
        q.age(pages, target - inactive, force);
    }
    let mut candidates = Vec::new();
    q.take_inactive(pages, want as usize, &mut candidates);
    let looked = candidates.len() as u64;
    let (mut stuck, mut in_flight, mut referenced) = (0, 0, 0);
    let mut back: Vec<(Pfn, Queue)> = Vec::new();
    let mut isolated: Vec<(Arc<Object>, u64, Pfn)> = Vec::new();
    for pfn in candidates {
        let page = phys.page(pfn);
        if page.take_referenced() && !force {
            back.push((pfn, Queue::Active));
            referenced += 1;
            continue;
        }
        // The owner as the descriptor names it, checked below.
        let pindex = page.pindex.load(Ordering::Relaxed);
        let Some(o) = m.reclaimable.get(page.object.load(Ordering::Relaxed)) else {
            // Its object is going away: the page is on its way to a free
            // list (or moves to the object that absorbs it).
            in_flight += 1;
            back.push((pfn, Queue::Inactive));
            continue;
        };
        let taken = {
            let _section = m.rcu.read_lock(reader);
            o.holds(pindex, pfn) && m.phys.isolate(pfn)
        };
        if !taken {
            grave.push(Box::new(o));
            if page.refs.get() & OBJREF == 0 {
                in_flight += 1; // taken out of its object, freed after a grace period
            } else {
                stuck += 1;
            }
            let wired = page.refs.wirings() > 0;
            back.push((pfn, if wired { Queue::Active } else { Queue::Inactive }));
            continue;
        }
        crate::aspace::unmap_everywhere_unlocked(m, reader, &o, pindex, pfn, grave);
        isolated.push((o, pindex, pfn));
    }
    q.requeue(pages, &back);
    back.clear();
    let taken = isolated.len() as u64;
    if taken > 0 {
        m.rcu.grace_period();
    }
    let stats = &m.daemon;
    let mut freed = Vec::new();
    let mut buf = vec![0u8; PAGE_SIZE as usize];
    let mut out = 0;
    let mut written = Vec::with_capacity(isolated.len());
    for (o, pindex, pfn) in isolated {
        if o.is_file() {
            // A file page goes back to its file (written there if dirty).
            written.push((o, pindex, pfn, None));
            continue;
        }
        let Some(slot) = swap.alloc() else {
            give_up(m, pfn, &mut freed, &mut back);
            grave.push(Box::new(o));
            continue;
        };
        m.phys.read_bytes(pfn, 0, &mut buf);
        if let Err(e) = swap.write(slot, &buf) {
            tracing::warn!(
                target: "vmfault::reclaim",
                event = "swap_write_errors",
                error = %e,
                slot,
                "swap write failed: the page stays resident"
            );
            stats.write_errors.fetch_add(1, Ordering::Relaxed);
            swap.retire_bad(slot);
            give_up(m, pfn, &mut freed, &mut back);
            grave.push(Box::new(o));
            continue;
        }
        written.push((o, pindex, pfn, Some(slot)));
    }
    // Replace the written pages in their objects. A page-in holds its
    // object's lock around one read of a slot: try the busy ones again for
    // a while before giving them up.
    let mut file_out = 0;
    let deadline = Instant::now() + BUSY_WAIT;
    loop {
        let mut busy = Vec::new();
        for (o, pindex, pfn, slot) in written {
            let done = match slot {
                Some(slot) => o.swap_out(pindex, pfn, slot),
                None => o.evict_file_page(pindex, pfn),
            };
            match done {
                SwapOut::Done => {
                    let refs = &m.phys.page(pfn).refs;
                    let unwired = refs.release_objref();
                    assert!(!unwired, "the daemon's wiring holds the page");
                    // An isolated page has no other reference (try_isolate
                    // took it from exactly the object's); should one have
                    // appeared, its holder frees the page, not the daemon.
                    if m.phys.daemon_unwire(pfn) {
                        freed.push(pfn);
                    }
                    if slot.is_some() {
                        out += 1;
                    } else {
                        file_out += 1;
                    }
                }
                SwapOut::Lost => {
                    if let Some(slot) = slot {
                        swap.free(slot);
                    }
                    give_up(m, pfn, &mut freed, &mut back);
                }
                SwapOut::Busy => {
                    busy.push((o, pindex, pfn, slot));
                    continue;
                }
            }
            grave.push(Box::new(o));
        }
        written = busy;
        if written.is_empty() || Instant::now() > deadline {
            break;
        }
        std::thread::yield_now();
    }
    for (o, _, pfn, slot) in written {
        if let Some(slot) = slot {
            swap.free(slot);
        }
        give_up(m, pfn, &mut freed, &mut back);
        grave.push(Box::new(o));
    }
    stats.file_pageouts.fetch_add(file_out, Ordering::Relaxed);
    stats.pageouts.fetch_add(out, Ordering::Relaxed);
    let n = freed.len() as u64;
    m.phys.free_after_grace(&m.rcu, &freed);
    q.requeue(pages, &back);
    // Pages taken but given up (a failed write, no free slot, an entry
    // that changed) are stuck too.
    stuck += taken - out - file_out;
    Round { freed: n, looked, stuck, in_flight, referenced }
}

/// Undo an isolation (see the module docs).
fn give_up(m: &Machine, pfn: Pfn, freed: &mut Vec<Pfn>, back: &mut Vec<(Pfn, Queue)>) {
    m.daemon.failures.fetch_add(1, Ordering::Relaxed);
    let refs = &m.phys.page(pfn).refs;
    refs.unblock();
    if m.phys.daemon_unwire(pfn) {
        freed.push(pfn);
    } else {
        back.push((pfn, Queue::Active));
    }
}
