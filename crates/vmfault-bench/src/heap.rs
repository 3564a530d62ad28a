//! Heap allocations per thread, for the `heap_allocs` counter of a round:
//! a global allocator that counts, per thread, the allocations it passes
//! on to the system's. A binary opts in (the `vmfault` CLI does):
//!
//! ```ignore
//! #[global_allocator]
//! static HEAP: vmfault_bench::heap::CountingAlloc = vmfault_bench::heap::CountingAlloc;
//! ```
//!
//! Without it, [`installed`] is false and rounds report no such counter.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    /// Allocations (and reallocations) made by this thread so far.
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

/// Whether any allocation went through [`CountingAlloc`].
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The system allocator, counting each thread's allocations.
#[derive(Debug, Clone, Copy)]
pub struct CountingAlloc;

fn count() {
    // `try_with`: a thread's last allocations may come after its locals
    // are gone. The flag is written once (a plain load first).
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
    if !INSTALLED.load(Ordering::Relaxed) {
        INSTALLED.store(true, Ordering::Relaxed);
    }
}

// SAFETY: every call is passed on to `System` unchanged; counting touches
// only a thread-local `Cell` (no allocation) and an atomic flag.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Whether the running binary counts allocations.
pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// Allocations the calling thread has made so far (0 if not installed).
pub fn thread_allocs() -> u64 {
    ALLOCS.try_with(Cell::get).unwrap_or(0)
}
