//! Loom model of a speculative page fault racing munmap (or mprotect),
//! built from the real pieces: `VmaState` (the VMA's sequence count), the
//! PTE word lock, `RcuArc`/`Rcu::reclaim` (the VMA index snapshot and its
//! reclamation after a grace period). The steps of the fault and of the
//! writers are a copy of `fault/speculative.rs` and `fault/vma_lock.rs`
//! (and of `aspace/munmap.rs`'s retire, zap and free), which point back
//! here: a change of their order must be made in both.
//!
//! The fault finds the VMA under RCU, checks it is live, prepares its page,
//! takes the PTE lock, re-checks the VMA under the lock and installs the
//! PTE. munmap retires the VMA, unpublishes it, zaps the PTE under the PTE
//! lock, and frees the VMA after a grace period (the free writes to it, so
//! loom reports a fault still reading it).
//!
//! Checked, for munmap (the writer clears the PTE) and mprotect (it clears
//! the write bit): nothing the fault installed outlives the change of its
//! VMA, and the VMA is never used after it is freed. With
//! `--cfg vmfault_mutation="spf_no_recheck"` (the final re-check skipped)
//! the first property fails.
//!
//! The per-VMA lock path races the same writers: its fault pins the
//! faulting address in its RCU section (`Rcu::pin`), finds the VMA live
//! (the read lock), takes the PTE lock (blocking) and installs without a
//! re-check; the writer retires the VMA and waits for the pins in its range
//! (`Rcu::wait_unpinned`). With `--cfg vmfault_mutation="vma_retire_no_wait"`
//! (no wait) or `rcu_pin_late` (the pin published after the section's
//! entry fence, so not ordered before the lookup) that model fails.
//!
//! The software MMU walks the page table before the speculative fault
//! reads the VMA snapshot, and the fault goes on from that walk. A walk
//! made before the snapshot read can reach a table that munmap then
//! pruned, while the snapshot shows a new VMA mapped over the range since:
//! the re-check under the PTE lock passes (the new VMA is live), and the
//! PTE would go into a detached table. The page table's prune count
//! (`sync::generation`) makes the fault walk again; with `--cfg
//! vmfault_mutation="generation_unchecked"` that model fails (and with
//! `spf_no_recheck`: a fault that found the old VMA needs the re-check).
//!
//! The walk may also come from an earlier section: the vCPU's leaf hint
//! (`pmap::LeafHint`) keeps its last walk with the count read before it,
//! and a lookup takes it if the count has not moved (`Stamp::holds_at`),
//! then goes on as from a fresh walk. With `--cfg
//! vmfault_mutation="leaf_hint_unchecked"` (the hint taken whatever the
//! count) that model fails.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use loom::thread;
use vmfault::sync::generation::Generation;
use vmfault::sync::rcu::{Rcu, RcuArc};
use vmfault::sync::spin;
use vmfault::sync::vma_state::VmaState;

/// What the fault reads of a VMA besides its state (its range, its
/// protection): freed memory once the VMA is reclaimed.
struct Fields(UnsafeCell<u64>);

// SAFETY: (model) accesses are ordered by the RCU protocol under test;
// loom reports any that are not.
unsafe impl Sync for Fields {}

impl Drop for Fields {
    fn drop(&mut self) {
        // "Freeing" the VMA: a write that races any read still in flight.
        // SAFETY: loom's cell checks this write against every access of
        // the model; one still in flight is the bug the model looks for.
        self.0.with_mut(|p| unsafe { *p = 0xdead });
    }
}

struct Vma {
    state: VmaState,
    fields: Fields,
}

const PRESENT: u64 = 1;
const WRITABLE: u64 = 2;

#[test]
fn speculative_fault_racing_munmap_never_installs_into_a_removed_vma() {
    vmfault::sync::fails_under(&["spf_no_recheck"], None, || {
        model(|_| 0);
    });
}

#[test]
fn speculative_fault_racing_mprotect_never_leaves_a_writable_pte() {
    vmfault::sync::fails_under(&["spf_no_recheck"], None, || {
        // mprotect(PROT_READ): the writer narrows the PTE instead of clearing it.
        model(|old| old & !WRITABLE);
    });
}

#[test]
fn vma_locked_fault_racing_munmap_never_installs_into_a_removed_vma() {
    vmfault::sync::fails_under(&["vma_retire_no_wait", "rcu_pin_late"], None, || {
        model_with(|_| 0, Path::VmaLock);
    });
}

#[test]
fn vma_locked_fault_racing_mprotect_never_leaves_a_writable_pte() {
    vmfault::sync::fails_under(&["vma_retire_no_wait", "rcu_pin_late"], None, || {
        model_with(|old| old & !WRITABLE, Path::VmaLock);
    });
}

/// Which fault path the model runs.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    Speculative,
    VmaLock,
}

/// The faulting address, and the VMA's range.
const ADDR: u64 = 0x5000;
const VMA: (u64, u64) = (0x4000, 0x8000);

/// The speculative fault: checks, prepares, try-locks, re-checks, installs.
fn speculative_fault(vma: &Vma, ptl: &AtomicU32, pte: &AtomicU64) {
    if !vma.state.is_live() {
        return;
    }
    // SAFETY: (model) the VMA cannot be freed inside our section.
    let prot = vma.fields.0.with(|p| unsafe { *p });
    assert_eq!(prot, 7, "read a freed VMA");
    // (the page is allocated and zeroed here, lock-free)
    let Some(guard) = spin::try_lock(ptl) else { return };
    if !vma.state.still_live_under(&guard) {
        return;
    }
    pte.store(PRESENT | WRITABLE, Ordering::Release);
}

/// The per-VMA lock fault, inside a section that pins `ADDR`: the VMA is
/// read-locked if live; it installs under the PTE lock with no re-check
/// (the lock keeps the VMA from changing).
fn vma_locked_fault(vma: &Vma, ptl: &AtomicU32, pte: &AtomicU64) {
    if !vma.state.is_live() {
        return;
    }
    // SAFETY: (model) the VMA cannot be freed inside our section.
    let prot = vma.fields.0.with(|p| unsafe { *p });
    assert_eq!(prot, 7, "read a freed VMA");
    let (_guard, _) = spin::lock(ptl);
    pte.store(PRESENT | WRITABLE, Ordering::Release);
}

/// The race, with `writer_pte` what the writer makes of the PTE under the
/// PTE lock (0: munmap's zap; narrowed: mprotect).
fn model(writer_pte: fn(u64) -> u64) {
    model_with(writer_pte, Path::Speculative);
}

/// The race of a fault on `path` with the writer.
fn model_with(writer_pte: fn(u64) -> u64, path: Path) {
    loom::model(move || {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let index = Arc::new(RcuArc::new(Some(std::sync::Arc::new(Vma {
            state: VmaState::new(),
            fields: Fields(UnsafeCell::new(7)),
        }))));
        let ptl = Arc::new(AtomicU32::new(0));
        let pte = Arc::new(AtomicU64::new(0));
        let r1 = readers.pop().unwrap();

        let faulter = {
            let (rcu, index, ptl, pte) = (rcu.clone(), index.clone(), ptl.clone(), pte.clone());
            thread::spawn(move || match path {
                Path::Speculative => {
                    let section = rcu.read_lock(&r1);
                    if let Some(vma) = index.read(&section) {
                        speculative_fault(vma, &ptl, &pte);
                    }
                }
                Path::VmaLock => {
                    let pin = rcu.pin(&r1, ADDR);
                    if let Some(vma) = index.read(&pin) {
                        vma_locked_fault(vma, &ptl, &pte);
                    }
                }
            })
        };

        // The writer, under the map lock: retire, unpublish, change the PTE
        // under its lock, then reclaim after a grace period.
        let r0 = readers.pop().unwrap();
        let old = {
            let current = {
                let g = rcu.read_lock(&r0);
                index.cloned(&g)
            };
            current.as_ref().expect("mapped").state.retire();
            if path == Path::VmaLock {
                rcu.wait_unpinned(VMA.0, VMA.1);
            }
            index.replace(&rcu, None)
        };
        {
            let (_guard, _) = spin::lock(&ptl);
            let old = pte.load(Ordering::Relaxed);
            pte.store(writer_pte(old), Ordering::Relaxed);
        }
        let mut retired = vec![old];
        drop(rcu.reclaim(&mut retired, true));
        faulter.join().unwrap();
        let left = pte.load(Ordering::Relaxed);
        assert_eq!(left & WRITABLE, 0, "a writable PTE survived the change of its VMA");
        assert_eq!(left, writer_pte(left), "a PTE was installed into a removed or changed VMA");
    });
}

#[test]
fn fault_from_an_earlier_walk_never_installs_into_a_pruned_table() {
    vmfault::sync::fails_under(
        &["generation_unchecked", "spf_no_recheck"],
        Some("installed into a pruned page table"),
        || {
            pruned_table_model(false);
        },
    );
}

#[test]
fn fault_from_a_hinted_walk_of_an_earlier_section_never_installs_into_a_pruned_table() {
    vmfault::sync::fails_under(
        &["generation_unchecked", "spf_no_recheck", "leaf_hint_unchecked"],
        Some("installed into a pruned page table"),
        || {
            pruned_table_model(true);
        },
    );
}

/// A speculative fault that goes on from a walk made before its snapshot
/// read (the software MMU's, in the same section; or, `hinted`, one kept
/// from an earlier section with the count read before it: the vCPU's leaf
/// hint), racing a munmap that prunes the table and an mmap of the range.
fn pruned_table_model(hinted: bool) {
    loom::model(move || {
        let (rcu, mut readers) = Rcu::new(2);
        let rcu = Arc::new(rcu);
        let live = || Some(std::sync::Arc::new(Vma { state: VmaState::new(), fields: Fields(UnsafeCell::new(7)) }));
        let index = Arc::new(RcuArc::new(live()));
        // The upper-level entry that holds the leaf table (1: attached),
        // the leaf's PTE lock and its one PTE, and the prune count.
        let pmd = Arc::new(AtomicU64::new(1));
        let ptl = Arc::new(AtomicU32::new(0));
        let pte = Arc::new(AtomicU64::new(0));
        let prunes = Arc::new(Generation::new());
        let r1 = readers.pop().unwrap();
        // An access of an earlier section walked the table and kept the
        // walk with the count read before it (the hint).
        let hint = hinted.then(|| {
            let _section = rcu.read_lock(&r1);
            (prunes.stamp(), pmd.load(Ordering::Acquire))
        });

        let faulter = {
            let (rcu, index, pmd, ptl, pte, prunes) =
                (rcu.clone(), index.clone(), pmd.clone(), ptl.clone(), pte.clone(), prunes.clone());
            thread::spawn(move || {
                let section = rcu.read_lock(&r1);
                // The software MMU's lookup: a stamp, then the hint if it
                // holds, else a walk (the PTE is empty).
                let stamp = prunes.stamp();
                let walked = match hint {
                    Some((kept, leaf)) if kept.holds_at(stamp) => leaf,
                    _ => pmd.load(Ordering::Acquire),
                };
                // The speculative fault: the snapshot, then the walk again
                // only if a prune was counted since (`Pmap::pte_after`).
                let Some(vma) = index.read(&section) else { return };
                let leaf = if prunes.unchanged(stamp) { walked } else { pmd.load(Ordering::Acquire) };
                if leaf == 0 {
                    return;
                }
                speculative_fault(vma, &ptl, &pte);
            })
        };

        // munmap under the map lock: retire, unpublish, zap, prune (detach,
        // then count); then an mmap of the same range publishes a new VMA.
        let r0 = readers.pop().unwrap();
        let current = {
            let g = rcu.read_lock(&r0);
            index.cloned(&g)
        };
        current.as_ref().expect("mapped").state.retire();
        drop(current);
        let old = index.replace(&rcu, None);
        {
            let (_guard, _) = spin::lock(&ptl);
            pte.store(0, Ordering::Relaxed);
        }
        pmd.store(0, Ordering::Release);
        prunes.bump();
        let gone = index.replace(&rcu, live());
        let mut retired = vec![old, gone];
        drop(rcu.reclaim(&mut retired, true));
        faulter.join().unwrap();
        assert_eq!(pte.load(Ordering::Relaxed), 0, "a PTE was installed into a pruned page table");
    });
}
