//! Loom model of the write-back of a shared file page racing a vCPU that
//! stores to it (`object/file.rs`, `sync::write_back_ordered`).
//!
//! The vCPU stores through its PTE inside an RCU section, as the software
//! MMU does (`aspace/access.rs`; the vCPU's steps are a copy of it and of
//! the fault's install); when the PTE is read-only it faults,
//! which under the PTE lock marks the page dirty and then makes the PTE
//! writable (`fault::resolve::commit_locked`). The write-back takes the dirty
//! bit, write-protects the PTE under the PTE lock and waits for a grace
//! period, then copies the page out, through the real
//! `write_back_ordered`, the real RCU and the real PTE word lock.
//!
//! The property: when both are done, the store is either in the copy or
//! the page is dirty again (a later write-back takes it). With
//! `--cfg vmfault_mutation="writeback_copy_first"` the copy precedes the
//! protection, a store can land between them on a page already clean, and
//! the model fails.
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use loom::thread;
use vmfault::sync::rcu::Rcu;
use vmfault::sync::{spin, write_back_ordered};

/// The object's entry bit the fault sets and the write-back clears.
const DIRTY: u64 = 4;
/// The PTE's write bit.
const WRITABLE: u64 = 2;
/// What the page holds before and after the vCPU's store.
const OLD: u64 = 1;
const NEW: u64 = 2;

struct Page {
    /// The object's index entry (only its dirty bit matters here).
    entry: AtomicU64,
    /// The PTE (only its write bit matters here).
    pte: AtomicU64,
    /// The PTE lock of the page-table page.
    ptl: AtomicU32,
    /// The page's contents.
    data: AtomicU64,
}

#[test]
fn a_store_racing_write_back_is_written_or_stays_dirty() {
    vmfault::sync::fails_under(&["writeback_copy_first"], None, || {
        loom::model(|| {
            let (rcu, mut readers) = Rcu::new(1);
            let rcu = Arc::new(rcu);
            let page = Arc::new(Page {
                entry: AtomicU64::new(0),
                pte: AtomicU64::new(0),
                ptl: AtomicU32::new(0),
                data: AtomicU64::new(OLD),
            });
            let reader = readers.pop().unwrap();

            let vcpu = {
                let (rcu, page) = (rcu.clone(), page.clone());
                thread::spawn(move || {
                    // At most one protection can intervene: three tries suffice.
                    for _ in 0..3 {
                        {
                            let _section = rcu.read_lock(&reader);
                            if page.pte.load(Ordering::Acquire) & WRITABLE != 0 {
                                page.data.store(NEW, Ordering::Relaxed);
                                return;
                            }
                        }
                        // The write fault: dirty first, then writable, under the lock.
                        let _ptl = spin::lock(&page.ptl).0;
                        page.entry.fetch_or(DIRTY, Ordering::Relaxed);
                        page.pte.store(WRITABLE, Ordering::Release);
                    }
                    panic!("the store never got a writable PTE");
                })
            };

            let copied = write_back_ordered(
                || page.entry.fetch_and(!DIRTY, Ordering::AcqRel) & DIRTY != 0,
                |&dirty| {
                    if dirty {
                        let ptl = spin::lock(&page.ptl).0;
                        page.pte.store(0, Ordering::Release);
                        drop(ptl);
                        rcu.synchronize();
                    }
                },
                |&dirty| dirty.then(|| page.data.load(Ordering::Relaxed)),
            );
            vcpu.join().unwrap();
            let dirty = page.entry.load(Ordering::Relaxed) & DIRTY != 0;
            assert!(copied == Some(NEW) || dirty, "the store was lost: written {copied:?}, page clean");
        });
    });
}
