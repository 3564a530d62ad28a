//! Synchronization primitives, written once for `std` and once for loom.
//!
//! Everything that the concurrency protocols of the crate depend on goes
//! through this module, so the loom models in `tests/loom_*.rs` check the
//! code that runs, not a copy of it:
//!
//! - [`rcu`]: a small RCU with a *blocking* `synchronize()` (no crate offers
//!   one): per-reader counters that are odd inside a read-side section.
//! - `cpu`: vCPU slots. A thread attached to a slot owns its per-CPU data the
//!   way a kernel CPU owns its per-CPU data with preemption disabled.
//! - [`spin`]: the word lock used as the PTE lock (`[P]`), with a try-lock.
//! - [`percpu`]: per-CPU caches another CPU can drain (protocols 1 and 2).
//! - [`vma_state`]: a VMA's sequence count and per-VMA lock (protocols 3 and 4).
//!
//! Under `--cfg loom` the atomics, fences and spin hints are loom's.

pub(crate) mod cpu;
pub mod percpu;
pub mod rcu;
pub mod spin;
pub mod vma_state;

/// Atomics: `std`'s, or loom's under `--cfg loom`.
pub(crate) mod atomic {
    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
    #[cfg(not(loom))]
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence};
}

/// A mutex: `std`'s, or loom's under `--cfg loom` (so that a model never
/// blocks a thread loom does not know about).
#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::Mutex;

/// An `UnsafeCell` whose accesses loom checks for races under `--cfg loom`
/// (through `with`/`with_mut`), and plain `std` otherwise.
pub(crate) mod cell {
    #[cfg(loom)]
    pub(crate) use loom::cell::UnsafeCell;

    /// `std::cell::UnsafeCell` with loom's access API.
    #[cfg(not(loom))]
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

    #[cfg(not(loom))]
    impl<T> UnsafeCell<T> {
        pub(crate) fn new(v: T) -> Self {
            UnsafeCell(std::cell::UnsafeCell::new(v))
        }

        /// Run `f` with a raw pointer for writing (the caller guarantees exclusivity).
        #[inline]
        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }
    }
}

/// One step of a wait loop: a CPU relax hint, and after `spins` steps a
/// yield to the host scheduler, so a waiter never burns a core that the
/// thread it waits for needs (these machines run more vCPUs than cores).
#[inline]
pub(crate) fn backoff(spins: &mut u32) {
    #[cfg(loom)]
    {
        let _ = spins;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if *spins < 64 {
            *spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Pads and aligns a value to its own cache lines (128 bytes: two lines,
/// because adjacent-line prefetch makes neighbours share in practice).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}
