//! Reclaim: the page daemon (FreeBSD's `vm_pageout`, Linux's `kswapd`).
//!
//! Each `Vm` has one daemon thread (`VmConfig::page_daemon`). It sleeps
//! until an allocation finds the global free list below the free target
//! (`VmConfig::free_target`), then brings the list back above it. Today
//! that is one step: drain every vCPU's per-CPU page cache remotely
//! (`sync::percpu`: swap in an empty magazine, wait for a grace period,
//! take the old one), without the vCPUs' cooperation, whether they are
//! idle, blocked or busy. Frames cached by vCPUs that stopped allocating
//! are the memory that is free but unusable by the others; the seed's
//! remote drain exists for exactly this caller.
//!
//! Not yet: page queues, aging, pageout to swap and to files (issue 7);
//! the wakeup and the target are where they will plug in.
//!
//! # Wakeup protocol
//!
//! The allocation slow path (a per-CPU cache miss, which takes the global
//! free-list lock anyway) compares the free count with the target; below
//! it, it sets `pending` and, if it was the one to set it, notifies the
//! condition variable. The fast path (a hit in the vCPU's own cache)
//! touches none of this. The daemon clears `pending` before it works, so
//! a shortage that appears while it works wakes it again. It holds the
//! machine only weakly and checks for its end once a second.

#![deny(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::vm::Machine;

/// The daemon's doorbell, kept in `PhysMem` (the allocator rings it).
#[derive(Debug, Default)]
pub(crate) struct Doorbell {
    /// `[a]` a wakeup is pending (set by allocators, cleared by the daemon).
    pending: AtomicBool,
    /// `[I]` whether a daemon listens (no daemon: ringing does nothing).
    enabled: AtomicBool,
    /// The daemon sleeps here; the mutex guards nothing but the wait.
    lock: Mutex<()>,
    cond: Condvar,
    /// `[a]` wakeups the daemon handled (written by the daemon only).
    pub(crate) wakeups: AtomicU64,
    /// `[a]` frames the daemon drained from per-CPU caches (daemon only).
    pub(crate) drained: AtomicU64,
}

impl Doorbell {
    /// Wake the daemon unless a wakeup is already pending.
    pub(crate) fn ring(&self) {
        if self.enabled.load(Ordering::Relaxed) && !self.pending.swap(true, Ordering::AcqRel) {
            let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
            self.cond.notify_one();
        }
    }

    /// Wait for a ring, or `timeout`; whether one came.
    fn wait(&self, timeout: Duration) -> bool {
        let g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        if !self.pending.load(Ordering::Acquire) {
            drop(self.cond.wait_timeout(g, timeout).unwrap_or_else(|p| p.into_inner()));
        }
        self.pending.swap(false, Ordering::AcqRel)
    }
}

/// Start the page daemon of `m`.
pub(crate) fn spawn_daemon(m: &Arc<Machine>) -> Result<()> {
    let weak: Weak<Machine> = Arc::downgrade(m);
    let doorbell = Arc::clone(&m.phys.doorbell);
    doorbell.enabled.store(true, Ordering::Relaxed);
    std::thread::Builder::new()
        .name("vmfault-pagedaemon".into())
        .spawn(move || {
            loop {
                // Sleep holding only the doorbell, so that the machine can go.
                let rung = doorbell.wait(Duration::from_secs(1));
                let Some(m) = weak.upgrade() else { return };
                if rung {
                    doorbell.wakeups.fetch_add(1, Ordering::Relaxed);
                    run_once(&m);
                }
            }
        })
        .map(|_| ())
        .map_err(|e| Error::Host { call: "spawn of the page daemon", errno: e.raw_os_error().unwrap_or(0) })
}

/// One pass: below the target, drain every per-CPU cache.
fn run_once(m: &Machine) {
    if m.phys.global_free_frames() < m.phys.free_target() {
        let n = m.phys.drain_pcpu(&m.rcu) as u64;
        m.phys.doorbell.drained.fetch_add(n, Ordering::Relaxed);
    }
}
