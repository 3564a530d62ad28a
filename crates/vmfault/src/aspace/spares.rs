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
//! ([`Recycle`]). At most [`KEEP`] of each are kept per thread.
//!
//! # The depot
//! A record is often freed on another vCPU than the one that made it (a
//! vCPU drops the retired snapshots it took over from another, with the
//! records only they held), so one thread's spares fill while another's
//! run dry, and the first freed what the second then allocated (1.4 in
//! 10,000 mmap1 loops at two vCPUs). As in Bonwick's magazine allocator,
//! a thread whose spares of a kind are full hands the whole list (a
//! *magazine*) to a process-wide depot and goes on with an empty one from
//! it, and a thread with none takes a full one, giving its empty one
//! back. The depot's lock (a leaf) is taken once per [`KEEP`] records
//! moved between vCPUs; it keeps at most [`DEPOT_MAGAZINES`] full ones of
//! each kind (beyond, the records are freed), and magazines once made
//! circulate, so nothing is allocated in steady state.
//!
//! A thread that finds the depot empty marks it hungry
//! ([`Shelf::hungry`]), and the next thread to keep a spare while it holds
//! a multiple of [`HAND_OVER`] hands its list over then, not once it holds
//! [`KEEP`]:
//! otherwise the thread that frees what another allocates sat on up to a
//! magazine while the other allocated as many from the heap (at each
//! bench round's new threads, and whenever the flow turned: mmap1 at two
//! vCPUs made 282 to 2,504 heap allocations in 9 rounds, 17 to 88 with
//! the hand-over).
//!
//! # The stock
//! A thread that becomes a vCPU (`Vm::attach`) starts with a full list of
//! each kind ([`stock`]): the depot's magazines first (what departed
//! threads left), new records and nodes for the rest. Before, a process's
//! spares grew one heap allocation at a time, and only when a vCPU ran
//! dry. When one vCPU frees what the other makes (mmap1 at two vCPUs, a
//! record retired by one vCPU's change and dropped with the other's
//! snapshot), the maker runs dry, finds the depot empty and allocates one
//! record; the freer, finding the depot hungry, hands over what it holds
//! at its next keep. The two then hold what they held before plus that
//! one, and when the maker runs dry again the freer again holds fewer than
//! [`KEEP`]: it never fills a magazine for the depot. So the shortage came
//! back once per cycle, one allocation each, until the two held more than
//! a magazine between them (some [`KEEP`] records and as many nodes in
//! all, reached only over seconds of mmap1: 51 to 215 heap allocations in
//! the first measured round of `bench mmap1 --threads 2 --rounds 9` in 12
//! of 13 runs, and fewer in each round after it, as the process's spares
//! grew). With a
//! full list each, two vCPUs hold two magazines from the start, so the
//! freer fills one for the depot before the maker runs dry. It costs
//! memory, not time: a list of each kind per vCPU thread (256 records and
//! 256 nodes, about 40 KiB), allocated at the attach, off every
//! operation's path; a thread that ends leaves them to the depot, for the
//! next.
//!
//! A thread is the unit, as it is of glibc's tcache: a vCPU is a thread
//! (`Vm::attach`), and no thread touches another's spares, so they take
//! no lock and write no line another vCPU writes (but the depot's, once
//! per magazine: below). A record is reused only
//! once nobody holds it (`Arc::get_mut`): no reader can still see it in
//! a published version, since every version that named it has been
//! dropped, and nothing compares VMA records by address.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::ptree::{self, Recycle};
use super::vma::{Snapshot, SnapshotNode, Vma, VmaFlags};
use crate::sync::rank::{self, Rank};
use crate::types::{PAGE_SIZE, Prot};

/// Spares of each kind kept per thread (a magazine's size).
pub(crate) const KEEP: usize = 256;

/// Full magazines of each kind the depot keeps.
const DEPOT_MAGAZINES: usize = 16;

/// Spares of each kind a thread has once it is a vCPU ([`stock`]): a full
/// list, so that two vCPUs, one freeing what the other makes, hold two
/// magazines between them from the start (see "The stock" above).
const STOCK: usize = KEEP;

/// Spares a thread hands over at once, as a magazine, when another has
/// found the depot empty (see [`Shelf::hungry`]).
const HAND_OVER: usize = KEEP / 8;
// `keep` relies on it: a length that is not a multiple of HAND_OVER is
// below KEEP.
const _: () = assert!(KEEP.is_multiple_of(HAND_OVER));

/// Magazines that threads handed over (`[L]`: a leaf lock).
struct Depot<T> {
    /// Full ones, for threads that have none.
    full: Vec<Vec<T>>,
    /// Empty ones (with their room), for threads whose own are full.
    empty: Vec<Vec<T>>,
}

/// A depot, and whether a thread has found it empty.
struct Shelf<T> {
    /// `[L]` the magazines (a leaf lock).
    depot: Mutex<Depot<T>>,
    /// `[a]` set by a thread that found no full magazine (and allocated);
    /// the next thread whose list a keep finds at a multiple of
    /// [`HAND_OVER`] hands it over and clears it. Without it, a thread that
    /// frees what another allocates (a record made on one vCPU, dropped
    /// with a snapshot on the other) kept up to [`KEEP`] of them while the
    /// other allocated as many from the heap: after each bench round's new
    /// threads, and whenever the flow turned. Loaded at each keep; written
    /// only when the depot runs dry and at the hand-over.
    hungry: AtomicBool,
}

impl<T> Shelf<T> {
    const fn new() -> Shelf<T> {
        Shelf { depot: Mutex::new(Depot { full: Vec::new(), empty: Vec::new() }), hungry: AtomicBool::new(false) }
    }
}

/// The depot of records.
static VMAS: Shelf<Arc<Vma>> = Shelf::new();
/// The depot of nodes.
static NODES: Shelf<Arc<SnapshotNode>> = Shelf::new();

/// One thread's spares (`[T]`: a thread-local, this thread only).
struct Spares {
    /// Records that nobody else holds, with no object.
    vmas: Vec<Arc<Vma>>,
    /// Nodes that nobody else holds, empty.
    nodes: Vec<Arc<SnapshotNode>>,
}

impl Drop for Spares {
    /// A thread that ends leaves its spares to the depot (a vCPU thread
    /// that detaches, a bench round's workers): the next threads take them
    /// instead of allocating their own again.
    fn drop(&mut self) {
        fn leave<T>(list: &mut Vec<T>, shelf: &Shelf<T>) {
            let list = std::mem::take(list);
            if !uses_depot() {
                return;
            }
            let mut d = rank::lock(&shelf.depot, Rank::Leaf);
            if !list.is_empty() {
                // A magazine for whoever found none.
                shelf.hungry.store(false, Ordering::Relaxed);
            }
            let to = if list.is_empty() { &mut d.empty } else { &mut d.full };
            if to.len() < DEPOT_MAGAZINES {
                to.push(list);
                return;
            }
            drop(d);
            drop(list);
        }
        leave(&mut self.vmas, &VMAS);
        leave(&mut self.nodes, &NODES);
    }
}

thread_local! {
    static SPARES: RefCell<Spares> =
        RefCell::new(Spares { vmas: Vec::with_capacity(KEEP), nodes: Vec::with_capacity(KEEP) });
}

/// `f` on this thread's spares; `None` while the thread is ending.
fn with<R>(f: impl FnOnce(&mut Spares) -> R) -> Option<R> {
    SPARES.try_with(|s| f(&mut s.borrow_mut())).ok()
}

#[cfg(all(test, not(loom)))]
thread_local! {
    /// Tests that count a thread's spares keep it off the depots, which
    /// the threads of other tests fill and empty meanwhile.
    static NO_DEPOT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread uses the depots.
fn uses_depot() -> bool {
    #[cfg(all(test, not(loom)))]
    if NO_DEPOT.with(|n| n.get()) {
        return false;
    }
    true
}

/// A spare from the list of this thread's that `list` picks, refilled
/// from `depot` if it is empty.
#[inline]
fn take<T>(list: impl Fn(&mut Spares) -> &mut Vec<T>, shelf: &Shelf<T>) -> Option<T> {
    match with(|s| list(s).pop()) {
        Some(None) => refill(list, shelf),
        got => got.flatten(),
    }
}

/// [`take`] from an empty list: a full magazine from the depot for it.
#[cold]
#[inline(never)]
fn refill<T>(list: impl Fn(&mut Spares) -> &mut Vec<T>, shelf: &Shelf<T>) -> Option<T> {
    if !uses_depot() {
        return None;
    }
    with(|s| {
        let l = list(s);
        let mut d = rank::lock(&shelf.depot, Rank::Leaf);
        let Some(full) = d.full.pop() else {
            // Under the depot's lock, as the hand-over that clears it.
            shelf.hungry.store(true, Ordering::Relaxed);
            return None;
        };
        let empty = std::mem::replace(l, full);
        if d.empty.len() < DEPOT_MAGAZINES {
            d.empty.push(empty);
        }
        drop(d);
        l.pop()
    })
    .flatten()
}

/// Stock this thread's spares of each kind to [`STOCK`] (a thread that
/// becomes a vCPU, `Vm::attach`): from the depot's magazines first, then
/// new ones.
pub(crate) fn stock() {
    let record = || Arc::new(Vma::new(0, PAGE_SIZE, Prot::NONE, VmaFlags::empty(), 0, None));
    stock_from(|s| &mut s.vmas, &VMAS, record);
    stock_from(|s| &mut s.nodes, &NODES, || Arc::new(SnapshotNode::spare()));
}

/// [`stock`] the list that `list` picks from `shelf`, making the rest with
/// `make`.
fn stock_from<T>(list: impl Fn(&mut Spares) -> &mut Vec<T>, shelf: &Shelf<T>, make: impl Fn() -> T) {
    with(|s| {
        let l = list(s);
        if l.len() >= STOCK {
            return;
        }
        if uses_depot() {
            let mut d = rank::lock(&shelf.depot, Rank::Leaf);
            while l.len() < STOCK {
                let Some(mut full) = d.full.pop() else { break };
                let n = full.len().min(STOCK - l.len());
                l.extend(full.drain(full.len() - n..));
                let to = if full.is_empty() { &mut d.empty } else { &mut d.full };
                if to.len() < DEPOT_MAGAZINES {
                    to.push(full);
                }
            }
        }
        // New ones outside the depot's lock. (A list has room for KEEP.)
        let missing = STOCK - l.len();
        l.extend((0..missing).map(|_| make()));
    });
}

/// A record holding `v`: a spare's allocation if this thread has one.
pub(crate) fn vma(v: Vma) -> Arc<Vma> {
    match take(|s| &mut s.vmas, &VMAS) {
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
    keep(v, |s| &mut s.vmas, &VMAS);
    drop(object);
}

/// Keep `item` in the list of this thread's spares that `list` picks; a
/// full list goes to `depot` for an empty one first. If the depot is full
/// too (or while the thread is ending), drop it, outside the borrow.
#[inline]
fn keep<T>(item: T, list: impl Fn(&mut Spares) -> &mut Vec<T>, shelf: &Shelf<T>) {
    let extra = with(|s| {
        let l = list(s);
        // Room up to KEEP; while a thread is hungry, a list that holds a
        // multiple of HAND_OVER goes to it. So a length that is not a
        // multiple needs no other test (KEEP is one, and a list never
        // holds more), and the others go to `spill`: one test inline.
        // (With the tests of the length against both and of the flag
        // inline, a list past HAND_OVER, as a stocked one always is, cost
        // mmap1 31 instructions per loop and brk1 48, at one vCPU.)
        if !l.len().is_multiple_of(HAND_OVER) {
            l.push(item);
            None
        } else {
            Some(item)
        }
    });
    if let Some(Some(item)) = extra {
        spill(item, list, shelf);
    }
}

/// [`keep`] at a multiple of [`HAND_OVER`]: kept if there is room and no
/// thread is hungry, else the list to the depot, an empty one back.
#[cold]
#[inline(never)]
fn spill<T>(item: T, list: impl Fn(&mut Spares) -> &mut Vec<T>, shelf: &Shelf<T>) {
    let extra = with(|s| {
        let l = list(s);
        let n = l.len();
        if n < KEEP && (n == 0 || !shelf.hungry.load(Ordering::Relaxed)) {
            l.push(item);
            None
        } else {
            Some(item)
        }
    });
    let Some(Some(item)) = extra else { return };
    if !uses_depot() {
        return drop(item);
    }
    let extra = with(|s| {
        let l = list(s);
        let mut d = rank::lock(&shelf.depot, Rank::Leaf);
        // Cleared under the lock either way: a full depot feeds whoever
        // found none.
        let hungry = shelf.hungry.swap(false, Ordering::Relaxed);
        let full = d.full.len() >= DEPOT_MAGAZINES;
        if l.len() < KEEP && (!hungry || full) {
            // Nobody to hand over to (any more), and room here.
            l.push(item);
            return None;
        }
        if full {
            return Some(item);
        }
        // Once per magazine ever made (they circulate after).
        let empty = d.empty.pop().unwrap_or_else(|| Vec::with_capacity(KEEP));
        // A list handed over goes with the item (it has room for it), a
        // full one without. (Handing over half and keeping half made mmap1
        // at two vCPUs allocate 3 to 15 times as often.)
        let mut item = Some(item);
        if l.len() < KEEP {
            l.extend(item.take());
        }
        d.full.push(std::mem::replace(l, empty));
        drop(d);
        l.extend(item);
        None
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
        take(|s| &mut s.nodes, &NODES)
    }

    fn keep_node(node: Arc<SnapshotNode>) {
        keep(node, |s| &mut s.nodes, &NODES);
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
    use crate::aspace::vma::{Lookup, VmaIndex, VmaTree};

    const P: u64 = crate::types::PAGE_SIZE;

    fn record(s: u64, e: u64) -> Arc<Vma> {
        vma(Vma::new(s * P, e * P, Prot::READ, VmaFlags::empty(), s, None))
    }

    #[test]
    fn a_released_record_is_reused_and_a_held_one_is_not() {
        // A fresh thread: no spares yet.
        std::thread::spawn(|| {
            NO_DEPOT.with(|n| n.set(true));
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
            NO_DEPOT.with(|n| n.set(true));
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

    #[test]
    fn a_full_list_goes_to_the_depot_and_a_thread_with_none_takes_it() {
        static DEPOT: Shelf<Arc<Vma>> = Shelf::new();
        let made: Vec<usize> = std::thread::spawn(|| {
            // Not `record`, which takes spares from the shared depot (where
            // the threads of other tests leave theirs): this thread's list
            // stays empty until the keeps below.
            let new = |i: u64| Arc::new(Vma::new(i * P, (i + 1) * P, Prot::READ, VmaFlags::empty(), i, None));
            let records: Vec<Arc<Vma>> = (0..KEEP as u64 + 1).map(new).collect();
            let ptrs = records.iter().map(|r| Arc::as_ptr(r) as usize).collect();
            for r in records {
                keep(r, |s| &mut s.vmas, &DEPOT);
            }
            assert_eq!(counts().0, 1, "the full list went to the depot, the last record stays");
            ptrs
        })
        .join()
        .unwrap();
        {
            let d = DEPOT.depot.lock().unwrap();
            assert_eq!(d.full.len(), 1);
            assert_eq!(d.full[0].len(), KEEP);
        }
        std::thread::spawn(move || {
            let r = take(|s| &mut s.vmas, &DEPOT).expect("a record from the depot");
            assert!(made.contains(&(Arc::as_ptr(&r) as usize)), "one of the first thread's");
            assert_eq!(counts().0, KEEP - 1);
            let d = DEPOT.depot.lock().unwrap();
            assert!(d.full.is_empty());
            assert_eq!(d.empty.len(), 1, "the thread's own empty list went back");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_that_found_the_depot_empty_gets_the_next_keepers_spares() {
        static DEPOT: Shelf<Arc<Vma>> = Shelf::new();
        // A thread finds nothing: the depot is marked hungry.
        std::thread::spawn(|| assert!(take(|s| &mut s.vmas, &DEPOT).is_none())).join().unwrap();
        assert!(DEPOT.hungry.load(Ordering::Relaxed));
        // A thread that keeps spares hands them over once it holds
        // HAND_OVER, long before its list is full.
        std::thread::spawn(|| {
            // (Not `record`, which would take spares from the shared depot.)
            let new = |i: u64| Arc::new(Vma::new(i * P, (i + 1) * P, Prot::READ, VmaFlags::empty(), i, None));
            let mut records: Vec<Arc<Vma>> = (0..=HAND_OVER as u64).map(new).collect();
            let last = records.pop().unwrap();
            for r in records {
                keep(r, |s| &mut s.vmas, &DEPOT);
            }
            assert_eq!(counts().0, HAND_OVER, "fewer than HAND_OVER: kept");
            keep(last, |s| &mut s.vmas, &DEPOT);
            assert_eq!(counts().0, 0, "handed over with the one kept last");
        })
        .join()
        .unwrap();
        assert!(!DEPOT.hungry.load(Ordering::Relaxed));
        let d = DEPOT.depot.lock().unwrap();
        assert_eq!(d.full.len(), 1);
        assert_eq!(d.full[0].len(), HAND_OVER + 1);
    }

    #[test]
    fn a_thread_that_attaches_as_a_vcpu_has_a_full_list_of_each() {
        let vm = crate::Vm::small_for_tests();
        std::thread::spawn(move || {
            // Off the shared depot: all of it new.
            NO_DEPOT.with(|n| n.set(true));
            assert_eq!(counts(), (0, 0));
            let _cpu = vm.attach().unwrap();
            assert_eq!(counts(), (KEEP, KEEP), "a full list of each");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_stock_takes_the_depots_spares_first() {
        static DEPOT: Shelf<Arc<Vma>> = Shelf::new();
        let new = |i: u64| Arc::new(Vma::new(i * P, (i + 1) * P, Prot::READ, VmaFlags::empty(), i, None));
        let left: Vec<Arc<Vma>> = (1..=10).map(new).collect();
        let ptrs: Vec<usize> = left.iter().map(|r| Arc::as_ptr(r) as usize).collect();
        DEPOT.depot.lock().unwrap().full.push(left);
        std::thread::spawn(move || {
            stock_from(|s| &mut s.vmas, &DEPOT, || new(0));
            assert_eq!(counts().0, STOCK);
            let mine: Vec<usize> = with(|s| s.vmas.iter().map(|r| Arc::as_ptr(r) as usize).collect()).unwrap();
            assert!(ptrs.iter().all(|p| mine.contains(p)), "the depot's records are in the stock");
            let d = DEPOT.depot.lock().unwrap();
            assert!(d.full.is_empty());
            assert_eq!(d.empty.len(), 1, "the emptied magazine stays in the depot");
        })
        .join()
        .unwrap();
    }

    /// Records one thread makes and another frees, one at a time: how
    /// many the maker allocated (found no spare for), with both threads'
    /// spares stocked first or not.
    fn made_by_maker(stocked: bool, depot: &'static Shelf<Arc<Vma>>) -> u64 {
        let new = |i: u64| Arc::new(Vma::new(i * P, (i + 1) * P, Prot::READ, VmaFlags::empty(), i, None));
        let (tx, rx) = std::sync::mpsc::sync_channel::<Arc<Vma>>(0);
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            s.spawn(move || {
                if stocked {
                    stock_from(|s| &mut s.vmas, depot, || new(0));
                }
                go_tx.send(()).unwrap();
                for r in rx {
                    keep(r, |s| &mut s.vmas, depot);
                }
            });
            s.spawn(move || {
                if stocked {
                    stock_from(|s| &mut s.vmas, depot, || new(0));
                }
                go_rx.recv().unwrap();
                let mut made = 0;
                for i in 0..8 * KEEP as u64 {
                    let r = take(|s| &mut s.vmas, depot).unwrap_or_else(|| {
                        made += 1;
                        new(i)
                    });
                    tx.send(r).unwrap();
                }
                made
            })
            .join()
            .unwrap()
        })
    }

    #[test]
    fn a_vcpu_that_frees_what_another_makes_leaves_it_nothing_to_allocate_once_stocked() {
        static UNSTOCKED: Shelf<Arc<Vma>> = Shelf::new();
        static STOCKED: Shelf<Arc<Vma>> = Shelf::new();
        // The premise: unstocked, the maker runs dry again and again, the
        // freer never holding a full magazine to give the depot.
        let unstocked = made_by_maker(false, &UNSTOCKED);
        assert!(unstocked > HAND_OVER as u64, "the maker found no spare {unstocked} times");
        // Stocked, the depot has a full magazine whenever the maker runs dry.
        assert_eq!(made_by_maker(true, &STOCKED), 0);
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
