//! The page daemon's doorbell: how an allocation wakes the daemon
//! (`reclaim`) and waits for its passes. It lives here, below the daemon,
//! because the allocator rings it: `phys` imports nothing from the layers
//! above it.
//!
//! # Wakeup protocol
//!
//! The allocation slow path (a per-CPU cache miss, which takes the global
//! free-list lock anyway) compares the free count with the target; below
//! it, it sets `pending` and, if it was the one to set it, notifies the
//! condition variable. The fast path (a hit in the vCPU's own cache)
//! touches none of this. The daemon clears `pending` before it works, so
//! a shortage that appears while it works wakes it again. It holds the
//! machine only weakly and checks for its end once a second. Each pass
//! ends with `passes` incremented and `done` notified, which waiting
//! allocations watch.

use crate::sync::rank::{self, Rank};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The page daemon's doorbell, kept in `PhysMem` (the allocator rings it;
/// the daemon is `reclaim`'s, and its statistics are
/// `stats::DaemonStats`).
#[derive(Debug, Default)]
pub(crate) struct Doorbell {
    /// `[a]` a wakeup is pending (set by allocators, cleared by the daemon).
    pending: AtomicBool,
    /// `[a]` the machine is ending: the daemon returns (`Vm`'s `Life`).
    stopping: AtomicBool,
    /// `[a]` whether a daemon listens (no daemon: ringing does nothing);
    /// set once by `enable` when the daemon starts, read relaxed (a ring
    /// before that finds no daemon to wake either way).
    enabled: AtomicBool,
    /// `[a]` whether it has swap (allocations then wait for it); set with
    /// `enabled`, by `enable`.
    swap: AtomicBool,
    /// `[L]` the daemon sleeps on `cond`, waiting allocations on `done`;
    /// the mutex guards nothing but the waits.
    lock: Mutex<()>,
    /// `[L]` (`lock`) where the daemon waits for a ring.
    cond: Condvar,
    /// `[L]` (`lock`) where allocations wait for a pass to end.
    done: Condvar,
    /// `[a]` passes completed.
    passes: AtomicU64,
    /// `[a]` the number of the last pass that freed nothing (0: none).
    fruitless: AtomicU64,
}

impl Doorbell {
    /// Wake the daemon unless a wakeup is already pending.
    pub(crate) fn ring(&self) {
        if self.enabled.load(Ordering::Relaxed) && !self.pending.swap(true, Ordering::AcqRel) {
            let _g = rank::lock(&self.lock, Rank::Leaf);
            self.cond.notify_one();
        }
    }

    /// The machine ends: wake the daemon for the last time.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        let _g = rank::lock(&self.lock, Rank::Leaf);
        self.cond.notify_all();
    }

    /// The daemon starts listening (`swap`: it can page out, so waiting
    /// allocations wait for it).
    pub(crate) fn enable(&self, swap: bool) {
        self.enabled.store(true, Ordering::Relaxed);
        self.swap.store(swap, Ordering::Relaxed);
    }

    /// Whether the machine is ending (the daemon returns).
    pub(crate) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Wait for a ring, or `timeout`; whether one came.
    pub(crate) fn wait(&self, timeout: Duration) -> bool {
        let g = rank::lock(&self.lock, Rank::Leaf);
        if !self.pending.load(Ordering::Acquire) && !self.stopping.load(Ordering::Acquire) {
            drop(g.wait_timeout(&self.cond, timeout));
        }
        self.pending.swap(false, Ordering::AcqRel)
    }

    /// A pass ended; `fruitless` if it freed nothing.
    pub(crate) fn pass_done(&self, fruitless: bool) {
        let _g = rank::lock(&self.lock, Rank::Leaf);
        let n = self.passes.fetch_add(1, Ordering::AcqRel) + 1;
        if fruitless {
            self.fruitless.store(n, Ordering::Release);
        }
        self.done.notify_all();
    }

    /// Wait until more than `seen` passes have completed, or `timeout`.
    fn wait_pass(&self, seen: u64, timeout: Duration) {
        let g = rank::lock(&self.lock, Rank::Leaf);
        if self.passes.load(Ordering::Acquire) <= seen {
            drop(g.wait_timeout(&self.done, timeout));
        }
    }
}

/// A waiting allocation gives up (`ENOMEM`) once this many passes that
/// began after it freed nothing (Linux retries reclaim up to 16 times,
/// `MAX_RECLAIM_RETRIES`): under heavy load a pass or two can find every
/// candidate busy (being faulted in, written back, referenced) while
/// memory is still there to reclaim.
const FRUITLESS_PASSES: u64 = 8;

/// Waits longer than this give up (a daemon that cannot run: `ENOMEM`).
const MAX_WAIT: Duration = Duration::from_secs(30);

impl Doorbell {
    /// Whether allocations that find no frame wait for the daemon: it runs
    /// and has swap to page out to.
    #[inline]
    pub(crate) fn reclaims(&self) -> bool {
        self.swap.load(Ordering::Relaxed) && self.enabled.load(Ordering::Relaxed)
    }

    /// Run `alloc` again each time the daemon ends a pass, until it gets a
    /// frame, or [`FRUITLESS_PASSES`] passes that began after this wait
    /// freed nothing, or
    /// [`MAX_WAIT`] has passed. The caller is a vCPU outside any read-side
    /// section (the daemon waits for grace periods) that holds no PTE lock
    /// (the daemon takes those) and no object lock it could try.
    pub(crate) fn wait_for<T>(&self, mut alloc: impl FnMut() -> Option<T>) -> Option<T> {
        let start = self.passes.load(Ordering::Acquire);
        let deadline = Instant::now() + MAX_WAIT;
        loop {
            let seen = self.passes.load(Ordering::Acquire);
            self.ring();
            self.wait_pass(seen, Duration::from_millis(50));
            if let Some(t) = alloc() {
                return Some(t);
            }
            if self.fruitless.load(Ordering::Acquire) >= start + FRUITLESS_PASSES || Instant::now() > deadline {
                return None;
            }
        }
    }
}
