//! Reclaim: the page daemon (FreeBSD's `vm_pageout`, Linux's `kswapd`).
//!
//! Each `Vm` has one daemon thread (`VmConfig::page_daemon`). It sleeps
//! until an allocation finds the global free list below the free target
//! (`VmConfig::free_target`), then brings the list back above it:
//!
//! 1. drain every vCPU's per-CPU page cache remotely (`sync::percpu`: swap
//!    in an empty magazine, wait for a grace period, take the old one),
//!    without the vCPUs' cooperation, whether they are idle, blocked or
//!    busy. Frames cached by vCPUs that stopped allocating are memory that
//!    is free but unusable by the others; the seed's remote drain exists
//!    for exactly this caller;
//! 2. with a swap file (`VmConfig::swap`), reclaim pages until the list
//!    holds one and a half times the target (`pageout.rs`, the protocol
//!    there), in the order of the page queues (`phys::queues`: active and
//!    inactive lists, aged by reference marks): anonymous pages go to
//!    swap, file pages back to their file (written first if dirty) and are
//!    read again by the next fault.
//!
//! With swap, an allocation that finds no frame at all, on a vCPU outside
//! any read-side section, waits for the daemon (`Doorbell::wait_for`,
//! from `Frames::alloc`) instead of failing, until a frame comes or
//! eight passes of the daemon in a row freed nothing (then `ENOMEM`: only
//! wired pages, page tables and indexes, or no swap slot, are left). So the
//! daemon never blocks on a lock such a vCPU may hold: it takes no map
//! lock (`aspace::rmap`) and only tries object locks (`object::swap`).
//!
//! Without swap there are no queues and nothing is reclaimed but the
//! per-CPU caches (and the recently used files nothing maps, dropped by a
//! file fill that finds no frame). Not yet: direct reclaim by allocating
//! vCPUs (the one daemon thread is the ceiling of swap throughput).
//!
//! The doorbell that wakes the daemon, and its wakeup protocol, are in
//! `phys::doorbell` (the allocator rings it).

mod pageout;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::machine::Machine;
use crate::sync::rcu::RcuReader;

/// References to spaces and objects the daemon took while it worked. It
/// may hold the last one: the end of a space or of a file object writes
/// back and takes map locks, which a vCPU waiting for the daemon may hold.
/// So they are dropped on a thread of their own (the reaper), never on
/// the daemon's, outside any read-side section.
pub(crate) type Grave = Vec<Box<dyn Send>>;

fn spawn_reaper() -> Result<std::sync::mpsc::Sender<Grave>> {
    let (tx, rx) = std::sync::mpsc::channel::<Grave>();
    std::thread::Builder::new()
        .name("vmfault-reaper".into())
        .spawn(move || rx.into_iter().for_each(drop))
        .map(|_| tx)
        .map_err(|e| Error::Host { call: "spawn of the page daemon's reaper", errno: e.raw_os_error().unwrap_or(0) })
}

/// Start the page daemon of `m`, reading as `reader` (its own RCU reader);
/// it returns once `Doorbell::stop` is called (the caller joins it).
pub(crate) fn spawn_daemon(m: &Arc<Machine>, reader: RcuReader) -> Result<std::thread::JoinHandle<()>> {
    let weak: Weak<Machine> = Arc::downgrade(m);
    let doorbell = Arc::clone(&m.phys.doorbell);
    doorbell.enable(m.swap.is_some());
    let reaper = if m.swap.is_some() { Some(spawn_reaper()?) } else { None };
    std::thread::Builder::new()
        .name("vmfault-pagedaemon".into())
        .spawn(move || {
            loop {
                // Sleep holding only the doorbell, so that the machine can go.
                let rung = doorbell.wait(Duration::from_secs(1));
                if doorbell.stopping() {
                    return;
                }
                let Some(m) = weak.upgrade() else { return };
                if rung {
                    m.daemon.wakeups.fetch_add(1, Ordering::Relaxed);
                    run_once(&m, &reader, &mut |grave: &mut Grave| {
                        if let Some(r) = &reaper
                            && !grave.is_empty()
                        {
                            // Fails only once the reaper is gone (at the end).
                            let _ = r.send(std::mem::take(grave));
                        }
                    });
                }
            }
        })
        .map_err(|e| Error::Host { call: "spawn of the page daemon", errno: e.raw_os_error().unwrap_or(0) })
}

/// One pass: below the target, drain every per-CPU cache, then page out.
fn run_once(m: &Machine, reader: &RcuReader, bury: &mut dyn FnMut(&mut Grave)) {
    let mut grave = Grave::new();
    let bell = &m.phys.doorbell;
    let target = m.phys.free_target();
    let mut freed = 0;
    // Only a pass that had work to do can find that nothing is left: one
    // that began above the mark and ended with the list empty (vCPUs took
    // what another pass freed) says nothing about what can be reclaimed.
    let short = m.phys.global_free_frames() < (target + target / 2).max(1);
    if m.phys.global_free_frames() < target {
        let n = m.phys.drain_pcpu(&m.rcu) as u64;
        m.daemon.drained.fetch_add(n, Ordering::Relaxed);
        freed += n;
    }
    if let Some(swap) = &m.swap {
        let high = (target + target / 2).max(1);
        // Give up when the pages that could not be taken since the last
        // progress add up to every queued page twice, or when two rounds
        // in a row found no candidate at all (each round ages the whole
        // active list if it must, so the second finds the marks the first
        // cleared). Referenced pages are progress: their marks are cleared;
        // pages being freed are memory on its way back.
        //
        // A round that found only referenced pages (or none on the
        // inactive list) makes the next one ignore the marks: the working
        // set is larger than memory, and a vCPU waits for a frame (Linux
        // raises its reclaim priority until it takes referenced pages too).
        let (mut stuck, mut empty, mut force) = (0, 0, false);
        while m.phys.global_free_frames() < high && empty < 2 {
            m.daemon.scans.fetch_add(1, Ordering::Relaxed);
            let want = (high - m.phys.global_free_frames()).min(64);
            let r = pageout::run(m, swap, reader, want, force, &mut grave);
            bury(&mut grave);
            freed += r.freed;
            force = r.freed == 0 && (r.looked == 0 || r.referenced == r.looked);
            empty = if r.looked == 0 { empty + 1 } else { 0 };
            stuck = if r.freed > 0 { 0 } else { stuck + r.stuck };
            let (active, inactive) = m.phys.queues.as_ref().map_or((0, 0), |q| q.lens());
            if stuck > 2 * (active + inactive) {
                break;
            }
            if r.freed == 0 && r.in_flight > 0 {
                // Frames on their way back (a munmap's grace period): let
                // their owners run rather than count them as stuck. With
                // free_path=deferred they may wait on a deferred list until
                // their vCPU next misses: take them all now.
                if m.phys.deferred.is_some() {
                    freed += m.phys.drain_pcpu(&m.rcu) as u64;
                }
                if bell.stopping() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
    bell.pass_done(short && freed == 0 && m.phys.global_free_frames() == 0);
}
