//! Spare VMA records and VMA-index nodes, kept per thread, so that an
//! `mmap` and its `munmap` allocate nothing from the heap in steady state.
//!
//! Before, each mmap1 loop made 3.5 heap allocations (the VMA record, its
//! node in the index, the list of what the munmap removed, the list of
//! snapshots a reclaim gave back), about 250 of its 3,700 instructions,
//! and with two vCPUs the glibc arena locks were most of the loop's futex
//! calls (a record or node is often freed by another thread than the one
//! that made it).
//!
//! A record (`Arc<Vma>`) or a node of the persistent index (`ptree::Node`)
//! is freed when the last version of the index that holds it is dropped,
//! a grace period after the version was replaced (`Space::finish`), or
//! when a change's list of removed VMAs is dropped (`Space::drop_removed`),
//! whichever is last. Those two places hand them here instead of dropping
//! them: a record that nobody else holds gives up its object at once (so
//! objects end exactly where they ended before) and waits, empty, for the
//! next `mmap`, split or merge on this thread ([`vma`]); a node that
//! nobody else holds waits for the next insertion or copy of a shared node
//! ([`Recycle`]). At most [`KEEP`] of each are kept per thread; the rest
//! are freed.
//!
//! A thread is the unit, as it is of glibc's tcache: a vCPU is a thread
//! (`Vm::attach`), and no thread touches another's spares, so they take
//! no lock and write no line another vCPU writes. A record is reused only
//! once nobody holds it (`Arc::get_mut`): no reader can still see it in
//! a published version, since every version that named it has been
//! dropped, and nothing compares VMA records by address.

use std::cell::RefCell;
use std::sync::Arc;

use super::ptree::{self, Recycle};
use super::vma::{Snapshot, SnapshotNode, Vma};

/// Spares of each kind kept per thread.
pub(crate) const KEEP: usize = 256;

/// One thread's spares (`[T]`: a thread-local, this thread only).
struct Spares {
    /// Records that nobody else holds, with no object.
    vmas: Vec<Arc<Vma>>,
    /// Nodes that nobody else holds, empty.
    nodes: Vec<Arc<SnapshotNode>>,
}

thread_local! {
    static SPARES: RefCell<Spares> =
        RefCell::new(Spares { vmas: Vec::with_capacity(KEEP), nodes: Vec::with_capacity(KEEP) });
}

/// `f` on this thread's spares; `None` while the thread is ending.
fn with<R>(f: impl FnOnce(&mut Spares) -> R) -> Option<R> {
    SPARES.try_with(|s| f(&mut s.borrow_mut())).ok()
}

/// A record holding `v`: a spare's allocation if this thread has one.
pub(crate) fn vma(v: Vma) -> Arc<Vma> {
    match with(|s| s.vmas.pop()).flatten() {
        Some(mut spare) => match Arc::get_mut(&mut spare) {
            Some(slot) => {
                *slot = v;
                spare
            }
            // Holds: only records nobody else held were kept.
            None => Arc::new(v),
        },
        None => Arc::new(v),
    }
}

/// Let go of a record: if nobody else holds it, its object (if any) is
/// released here and the record kept as a spare; else it is only released.
pub(crate) fn release_vma(mut v: Arc<Vma>) {
    let Some(record) = Arc::get_mut(&mut v) else { return };
    // Released outside the borrow of the spares: an object's end may
    // release other things.
    let object = record.object.take();
    keep(v, |s| &mut s.vmas);
    drop(object);
}

/// Keep `item` in the list of this thread's spares that `list` picks, if
/// it has room; else (or while the thread is ending) drop it, outside the
/// borrow.
fn keep<T>(item: T, list: impl FnOnce(&mut Spares) -> &mut Vec<T>) {
    let extra = with(|s| {
        let l = list(s);
        if l.len() < KEEP {
            l.push(item);
            None
        } else {
            Some(item)
        }
    });
    drop(extra);
}

/// Let go of a dropped version of the index: its records and the nodes
/// that nobody else holds become spares ([`release_vma`]).
pub(crate) fn release_snapshot(s: Snapshot) {
    ptree::recycle(s, &mut release_vma, &mut <Arc<Vma> as Recycle>::keep_node);
}

impl Recycle for Arc<Vma> {
    fn spare_node() -> Option<Arc<SnapshotNode>> {
        with(|s| s.nodes.pop()).flatten()
    }

    fn keep_node(node: Arc<SnapshotNode>) {
        keep(node, |s| &mut s.nodes);
    }
}

/// This thread's spares: (records, nodes).
#[cfg(all(test, not(loom)))]
pub(crate) fn counts() -> (usize, usize) {
    with(|s| (s.vmas.len(), s.nodes.len())).unwrap_or_default()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::aspace::vma::{Lookup, VmaFlags, VmaIndex, VmaTree};
    use crate::types::Prot;

    const P: u64 = crate::types::PAGE_SIZE;

    fn record(s: u64, e: u64) -> Arc<Vma> {
        vma(Vma::new(s * P, e * P, Prot::READ, VmaFlags::empty(), s, None))
    }

    #[test]
    fn a_released_record_is_reused_and_a_held_one_is_not() {
        // A fresh thread: no spares yet.
        std::thread::spawn(|| {
            let a = record(1, 2);
            let held = a.clone();
            release_vma(a);
            assert_eq!(counts().0, 0, "a record someone holds is not kept");
            let ptr = Arc::as_ptr(&held);
            release_vma(held);
            assert_eq!(counts().0, 1);
            let b = record(5, 9);
            assert_eq!(Arc::as_ptr(&b), ptr, "the spare's allocation is reused");
            assert_eq!((b.start, b.end, b.pgoff), (5 * P, 9 * P, 5));
            assert_eq!(counts().0, 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_dropped_version_gives_its_unshared_nodes_and_records_back() {
        std::thread::spawn(|| {
            let mut t = VmaTree::recorded(None);
            for i in 0..8 {
                t.insert(record(i * 2, i * 2 + 1));
            }
            let old = t.snapshot();
            // Removing from the live tree copies the path (the old version
            // shares every node); dropping the old version then frees the
            // nodes only it held, but not the records the tree still holds.
            let six = t.find(6 * P).unwrap().clone();
            let gone = t.remove(&six);
            drop(six);
            release_vma(gone);
            release_snapshot(old);
            let (records, nodes) = counts();
            assert_eq!(records, 1, "only the removed record is unshared");
            assert!(nodes >= 1, "the removed record's node and the copied path come back");
            // The live version is intact.
            let starts: Vec<u64> = t.iter().map(|v| v.start / P).collect();
            assert_eq!(starts, vec![0, 2, 4, 8, 10, 12, 14]);
            // New insertions take the spares.
            t.insert(record(6, 7));
            assert_eq!(counts().0, 0);
            assert!(counts().1 < nodes);
            let now = release_and_count(t);
            assert_eq!(now, 8);
        })
        .join()
        .unwrap();
    }

    /// Drop every version of `t`, returning how many records came back.
    fn release_and_count(mut t: VmaTree) -> usize {
        let before = counts().0;
        let all = t.take_all_only();
        let snap = t.snapshot();
        release_snapshot(snap);
        for v in all {
            release_vma(v);
        }
        counts().0 - before
    }
}
