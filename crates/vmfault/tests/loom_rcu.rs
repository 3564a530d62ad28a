//! Loom model of the RCU grace period that frees unmapped frames (the TLB
//! shootdown of `phys::free_after_grace`) and, later, drains per-CPU caches.
//!
//! A reader vCPU loads a PTE inside a read-side section and, if it maps the
//! frame, reads the frame (a copy of the software MMU's steps,
//! `aspace/access.rs`; the RCU is the real one). The writer clears the PTE, waits for a grace
//! period, and reuses the frame (a plain write, as reallocation zeroing
//! does). Loom's `UnsafeCell` flags any reuse that is not ordered after the
//! reader's access.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p vmfault --release --test loom_rcu`.
//! With `--cfg vmfault_mutation="rcu_no_grace"` (grace period skipped),
//! `"rcu_no_reader_fence"` (the reader's SeqCst fence removed),
//! `"rcu_relaxed_entry"` (the section's entry store made Relaxed) or
//! `"rcu_poll_unseen"` (a polled grace period that does not look whether
//! the sections it saw have ended), `"rcu_quiescent_blind"` (a quiescence
//! check that does not look at the readers) or `"rcu_quiescent_no_fence"`
//! (its SeqCst fence removed) the
//! models that depend on that piece must fail; they then expect the panic.
//! `.ci/run` runs every configuration.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use vmfault::sync::rcu::{Rcu, RcuReader};

/// What the reader vCPU sees: the RCU, its reader handle, the PTE, the frame.
struct World {
    rcu: Rcu,
    pte: AtomicU64,
    frame: UnsafeCell<u64>,
}

impl World {
    /// If the PTE still maps the frame, read it: it must not have been reused.
    fn use_frame_if_mapped(&self) {
        if self.pte.load(Ordering::Acquire) == 1 {
            // SAFETY: (model) the frame is mapped, so the writer must not
            // reuse it before the caller's section ends.
            let v = self.frame.with(|p| unsafe { *p });
            assert_eq!(v, 7, "read a reused frame");
        }
    }
}

/// The writer's wait: a blocking grace period.
fn synchronize(rcu: &Rcu) {
    rcu.synchronize();
}

/// The writer's wait: a polled grace period (`Rcu::poll`), called until it
/// reports one complete; the writer does other work in between.
fn poll(rcu: &Rcu) {
    let cookie = rcu.cookie();
    while !rcu.poll(cookie) {
        thread::yield_now();
    }
}

/// The writer's wait: `Rcu::quiescent`, asked until no reader is inside a
/// section (a munmap that finds none frees at once; one that finds one
/// polls instead, which the model of `poll` covers).
fn quiescent(rcu: &Rcu) {
    while !rcu.quiescent() {
        thread::yield_now();
    }
}

/// One reader thread running `reader`, against a writer that unmaps the
/// frame, waits for a grace period with `synchronize` and reuses it.
fn model(reader: fn(&World, &RcuReader)) {
    model_with(reader, synchronize)
}

/// [`model`] with the writer's wait `grace`.
fn model_with(reader: fn(&World, &RcuReader), grace: fn(&Rcu)) {
    loom::model(move || {
        let (rcu, mut readers) = Rcu::new(2);
        let world = Arc::new(World { rcu, pte: AtomicU64::new(1), frame: UnsafeCell::new(7) });
        let r1 = readers.pop().unwrap();
        let t = {
            let world = world.clone();
            thread::spawn(move || reader(&world, &r1))
        };
        world.pte.store(0, Ordering::Release);
        grace(&world.rcu);
        // SAFETY: (model) after the grace period nobody can hold the frame.
        world.frame.with_mut(|p| unsafe { *p = 99 });
        t.join().unwrap();
    });
}

#[test]
fn unmapped_frame_is_not_reused_under_a_reader() {
    vmfault::sync::fails_under(&["rcu_no_grace", "rcu_no_reader_fence"], None, || {
        model(|w, r| {
            let _section = w.rcu.read_lock(r);
            w.use_frame_if_mapped();
        });
    });
}

#[test]
fn nested_sections_hold_the_grace_period_until_the_outer_one_ends() {
    vmfault::sync::fails_under(&["rcu_no_grace", "rcu_no_reader_fence"], None, || {
        model(|w, r| {
            let outer = w.rcu.read_lock(r);
            drop(w.rcu.read_lock(r));
            w.use_frame_if_mapped();
            drop(outer);
        });
    });
}

/// The polled grace period (`Rcu::poll`, which frees without waiting)
/// must order the reuse after the reader's section just as `synchronize`
/// does; it fails when a poll counts a section it saw as ended without its
/// counter having moved (`rcu_poll_unseen`).
#[test]
fn a_polled_grace_period_orders_the_reuse_after_the_section() {
    vmfault::sync::fails_under(&["rcu_poll_unseen", "rcu_no_reader_fence"], None, || {
        model_with(
            |w, r| {
                let _section = w.rcu.read_lock(r);
                w.use_frame_if_mapped();
            },
            poll,
        );
    });
}

/// A writer that frees once it finds no reader inside a section
/// (`Rcu::quiescent`, which writes nothing shared) is ordered after the
/// reader's access: it fails when the check does not look at the readers
/// (`rcu_quiescent_blind`) or when its fence is gone
/// (`rcu_quiescent_no_fence`: the reader may enter, miss the unmap, and
/// the writer miss its entry), as with the reader's fence gone.
#[test]
fn a_quiescent_check_orders_the_reuse_after_the_section() {
    let race = Some("Causality violation");
    vmfault::sync::fails_under(&["rcu_quiescent_blind", "rcu_quiescent_no_fence", "rcu_no_reader_fence"], race, || {
        model_with(
            |w, r| {
                let _section = w.rcu.read_lock(r);
                w.use_frame_if_mapped();
            },
            quiescent,
        );
    });
}

/// A poll that saw the reader's first section and then meets its second
/// one is still ordered after the first (the entry store is Release).
#[test]
fn a_poll_that_meets_the_next_section_is_still_ordered_after_this_one() {
    vmfault::sync::fails_under(&["rcu_poll_unseen", "rcu_no_reader_fence", "rcu_relaxed_entry"], None, || {
        model_with(
            |w, r| {
                {
                    let _first = w.rcu.read_lock(r);
                    w.use_frame_if_mapped();
                }
                let _second = w.rcu.read_lock(r);
            },
            poll,
        );
    });
}

/// The reader runs two sections back to back; the writer may observe the
/// first section's odd counter, miss the even value in between, and stop
/// waiting on the second section's odd value. It must still be ordered
/// after the first section's access (the entry store is Release).
#[test]
fn a_writer_that_meets_the_next_section_is_still_ordered_after_this_one() {
    vmfault::sync::fails_under(&["rcu_no_grace", "rcu_no_reader_fence", "rcu_relaxed_entry"], None, || {
        model(|w, r| {
            {
                let _first = w.rcu.read_lock(r);
                w.use_frame_if_mapped();
            }
            let _second = w.rcu.read_lock(r);
        });
    });
}
