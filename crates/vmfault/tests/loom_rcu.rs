//! Loom model of the RCU grace period that frees unmapped frames (the TLB
//! shootdown of `phys::free_after_grace`) and, later, drains per-CPU caches.
//!
//! A reader vCPU loads a PTE inside a read-side section and, if it maps the
//! frame, reads the frame. The writer clears the PTE, waits for a grace
//! period, and reuses the frame (a plain write, as reallocation zeroing
//! does). Loom's `UnsafeCell` flags any reuse that is not ordered after the
//! reader's access.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p vmfault --release --test loom_rcu`.
//! With `--cfg vmfault_mutation="rcu_no_grace"` (grace period skipped) or
//! `--cfg vmfault_mutation="rcu_no_reader_fence"` (the reader's SeqCst fence
//! removed) the model must fail; the tests then expect the panic. `.ci/run`
//! runs all three configurations.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use vmfault::sync::rcu::Rcu;

#[test]
#[cfg_attr(any(vmfault_mutation = "rcu_no_grace", vmfault_mutation = "rcu_no_reader_fence"), should_panic)]
fn unmapped_frame_is_not_reused_under_a_reader() {
    loom::model(|| {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let pte = Arc::new(AtomicU64::new(1));
        let frame = Arc::new(UnsafeCell::new(7u64));
        let r1 = readers.pop().unwrap();
        let reader = {
            let (rcu, pte, frame) = (rcu.clone(), pte.clone(), frame.clone());
            thread::spawn(move || {
                let _section = rcu.read_lock(&r1);
                if pte.load(Ordering::Acquire) == 1 {
                    // SAFETY: (model) the frame is mapped, so the writer must
                    // not reuse it before this section ends.
                    let v = frame.with(|p| unsafe { *p });
                    assert_eq!(v, 7, "read a reused frame");
                }
            })
        };
        pte.store(0, Ordering::Release);
        rcu.synchronize();
        // SAFETY: (model) after the grace period nobody can hold the frame.
        frame.with_mut(|p| unsafe { *p = 99 });
        reader.join().unwrap();
    });
}

#[test]
#[cfg_attr(any(vmfault_mutation = "rcu_no_grace", vmfault_mutation = "rcu_no_reader_fence"), should_panic)]
fn nested_sections_hold_the_grace_period_until_the_outer_one_ends() {
    loom::model(|| {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let pte = Arc::new(AtomicU64::new(1));
        let frame = Arc::new(UnsafeCell::new(7u64));
        let r1 = readers.pop().unwrap();
        let reader = {
            let (rcu, pte, frame) = (rcu.clone(), pte.clone(), frame.clone());
            thread::spawn(move || {
                let outer = rcu.read_lock(&r1);
                let seen = pte.load(Ordering::Acquire);
                drop(rcu.read_lock(&r1));
                if seen == 1 {
                    // SAFETY: (model) still inside the outer section.
                    let v = frame.with(|p| unsafe { *p });
                    assert_eq!(v, 7);
                }
                drop(outer);
            })
        };
        pte.store(0, Ordering::Release);
        rcu.synchronize();
        // SAFETY: (model) after the grace period nobody can hold the frame.
        frame.with_mut(|p| unsafe { *p = 99 });
        reader.join().unwrap();
    });
}

/// The reader runs two sections back to back; the writer may observe the
/// first section's odd counter, miss the even value in between, and stop
/// waiting on the second section's odd value. It must still be ordered
/// after the first section's access (the entry store is Release).
#[test]
#[cfg_attr(
    any(
        vmfault_mutation = "rcu_no_grace",
        vmfault_mutation = "rcu_no_reader_fence",
        vmfault_mutation = "rcu_relaxed_entry"
    ),
    should_panic
)]
fn a_writer_that_meets_the_next_section_is_still_ordered_after_this_one() {
    loom::model(|| {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let pte = Arc::new(AtomicU64::new(1));
        let frame = Arc::new(UnsafeCell::new(7u64));
        let r1 = readers.pop().unwrap();
        let reader = {
            let (rcu, pte, frame) = (rcu.clone(), pte.clone(), frame.clone());
            thread::spawn(move || {
                {
                    let _first = rcu.read_lock(&r1);
                    if pte.load(Ordering::Acquire) == 1 {
                        // SAFETY: (model) mapped, so not reused before this section ends.
                        let v = frame.with(|p| unsafe { *p });
                        assert_eq!(v, 7);
                    }
                }
                let _second = rcu.read_lock(&r1);
            })
        };
        pte.store(0, Ordering::Release);
        rcu.synchronize();
        // SAFETY: (model) after the grace period nobody can hold the frame.
        frame.with_mut(|p| unsafe { *p = 99 });
        reader.join().unwrap();
    });
}
