//! vCPU slots: per-CPU data with a single owner at a time.
//!
//! A [`CpuSet`] has `cpus` attachable slots plus one *shared* slot. A thread
//! that calls [`CpuSet::attach`] owns one attachable slot until the returned
//! [`Attachment`] drops. Every VM operation starts with [`CpuSet::claim`]:
//! an attached thread gets its own slot (no atomic operation at all), any
//! other thread takes the shared slot's mutex for the length of the
//! operation. A [`Claim`] is the analogue of a kernel's `preempt_disable()`:
//! while it lives, the owner-only part `O` of the slot is this thread's alone
//! and may be used through `&mut`; the shared part `S` is readable by all.
//!
//! Claims do not nest: code below a public entry point receives the claim as
//! a parameter. A nested claim of the same set on one thread panics, because
//! it would hand out a second `&mut O`.

// This file holds unsafe code, each block with its `// SAFETY:`
// argument, and each item that holds one allows `unsafe_code` on itself:
// the crate denies it everywhere else.

use std::cell::{Cell, RefCell, UnsafeCell};
use std::marker::PhantomData;
use std::sync::atomic::AtomicU64;
// The slot states go through the loom shim; the owner-only cell and the
// shared slot's mutex stay `std`'s: a claim hands out `&mut O` for the
// length of an operation, which loom's cells (checked inside closures
// only) cannot express, and no model claims slots.
use std::sync::{Mutex, MutexGuard};

use super::atomic::{AtomicU32, Ordering};

use super::CachePadded;

const FREE: u32 = 0;
const ATTACHED: u32 = 1;

/// Identifies a `CpuSet` in the thread-local registry.
static NEXT_SET_ID: AtomicU64 = AtomicU64::new(1);

struct TlsEntry {
    set: u64,
    slot: usize,
    /// A claim on this slot is live on this thread.
    busy: bool,
    /// A transient entry for a claim of the shared slot.
    transient: bool,
}

thread_local! {
    /// The slots this thread is attached to (one per `CpuSet`), and its live claims.
    static REGISTRY: RefCell<Vec<TlsEntry>> = const { RefCell::new(Vec::new()) };
    /// One attachment of this thread, claimed with no scan and no borrow
    /// (a thread usually runs one `Vm`: every operation's claim is here).
    /// While an attachment is here, this is where its claim is marked, not
    /// its `REGISTRY` entry.
    static FAST: Cell<Fast> = const { Cell::new(Fast::NONE) };
}

/// [`FAST`]'s attachment: set id (0: none), slot, a claim live on it.
#[derive(Clone, Copy)]
struct Fast {
    set: u64,
    slot: usize,
    busy: bool,
}

impl Fast {
    const NONE: Fast = Fast { set: 0, slot: 0, busy: false };
}

struct Slot<S, O> {
    /// `[a]` FREE or ATTACHED (shared slot: always FREE; its mutex decides).
    state: AtomicU32,
    /// `[a]`/`[o]` readable by everyone; fields document their own rules.
    shared: S,
    /// `[o]` owner only: the thread that holds a claim on this slot.
    owned: UnsafeCell<O>,
}

/// `cpus` attachable slots and one shared slot of per-CPU data.
pub(crate) struct CpuSet<S, O> {
    /// `[I]` key in the thread-local registry.
    id: u64,
    /// `[I]` number of attachable slots; slot `cpus` is the shared one.
    cpus: usize,
    /// `[I]` the slots (their contents follow the per-field rules above).
    slots: Box<[CachePadded<Slot<S, O>>]>,
    /// `[L]` serializes unattached threads on the shared slot.
    shared_lock: Mutex<()>,
}

// SAFETY: `owned` is only reached through a `Claim`, and a claim is exclusive:
// attachable slots are claimed only by the thread registered as attached to
// them (registered after winning the FREE->ATTACHED CAS, and never twice at
// once thanks to the `busy` flag), and the shared slot only under
// `shared_lock`. So `O` needs to be `Send` (it moves between threads over
// time) but never `Sync`; `S` is shared by reference and must be `Sync`.
#[allow(unsafe_code)]
unsafe impl<S: Sync, O: Send> Sync for CpuSet<S, O> {}
// SAFETY: moving the set moves plain data; the same bounds as above apply.
#[allow(unsafe_code)]
unsafe impl<S: Send, O: Send> Send for CpuSet<S, O> {}

/// Exclusive use of one slot for the length of one operation.
pub(crate) struct Claim<'a, S, O> {
    set: &'a CpuSet<S, O>,
    index: usize,
    /// Marked busy in [`FAST`] (which keeps the mark's attachment while
    /// it is busy: `attach` leaves it, `detach` asserts it is not).
    fast: bool,
    /// The shared slot's mutex guard, released by `drop_slow` (in a
    /// `ManuallyDrop`: a claim in [`FAST`], every operation's, then drops
    /// with no glue beyond its own `drop`).
    _shared: std::mem::ManuallyDrop<Option<super::rank::Ranked<MutexGuard<'a, ()>>>>,
    /// Claims are tied to the thread's registry entry: not `Send`.
    _not_send: PhantomData<*const ()>,
}

/// A thread's attachment to a slot; detaches on drop.
pub(crate) struct Attachment {
    set_id: u64,
    index: usize,
    _not_send: PhantomData<*const ()>,
}

impl<S, O> CpuSet<S, O> {
    /// A set of `cpus` attachable slots plus one shared slot; `make(i)` builds slot `i`.
    pub(crate) fn new(cpus: usize, mut make: impl FnMut(usize) -> (S, O)) -> Self {
        let slots = (0..=cpus)
            .map(|i| {
                let (shared, owned) = make(i);
                CachePadded(Slot { state: AtomicU32::new(FREE), shared, owned: UnsafeCell::new(owned) })
            })
            .collect();
        CpuSet {
            id: NEXT_SET_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            cpus,
            slots,
            shared_lock: Mutex::new(()),
        }
    }

    /// Number of attachable slots.
    pub(crate) fn cpus(&self) -> usize {
        self.cpus
    }

    /// The shared part of every slot (attachable ones first, then the shared slot).
    pub(crate) fn shared_parts(&self) -> impl Iterator<Item = &S> {
        self.slots.iter().map(|s| &s.shared)
    }

    /// Whether slot `i` is attached to a thread (a snapshot).
    pub(crate) fn is_attached(&self, i: usize) -> bool {
        self.slots[i].state.load(Ordering::Relaxed) == ATTACHED
    }

    /// Attach the calling thread to a free slot.
    ///
    /// Errors: `Err(Some(i))` if this thread is already attached (to slot
    /// `i`), `Err(None)` if every slot is taken.
    pub(crate) fn attach(&self) -> Result<Attachment, Option<usize>> {
        if let Some(i) = self.attached_slot() {
            return Err(Some(i));
        }
        for (i, slot) in self.slots[..self.cpus].iter().enumerate() {
            // Acquire pairs with the Release in `Attachment::drop` of the
            // previous owner: its last use of `owned` happens-before ours.
            if slot.state.compare_exchange(FREE, ATTACHED, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                // The newest attachment takes the fast entry unless a claim
                // is live on the one there, or a claim of this set is live
                // on the shared slot (the next claim must find that one
                // busy in the registry, and panic as nested).
                let shared_claim = REGISTRY.with(|r| {
                    let mut r = r.borrow_mut();
                    let live = r.iter().any(|e| e.set == self.id && e.transient && e.busy);
                    r.push(TlsEntry { set: self.id, slot: i, busy: false, transient: false });
                    live
                });
                FAST.with(|f| {
                    if !f.get().busy && !shared_claim {
                        f.set(Fast { set: self.id, slot: i, busy: false });
                    }
                });
                return Ok(Attachment { set_id: self.id, index: i, _not_send: PhantomData });
            }
        }
        Err(None)
    }

    /// Detach: called from the owning thread when its `Attachment` drops.
    pub(crate) fn detach(&self, a: Attachment) {
        assert_eq!(a.set_id, self.id, "Attachment of another CpuSet");
        // `try_with`: a guard kept in another thread-local may drop after the
        // registry is gone, at thread exit; the slot is freed all the same.
        let _ = FAST.try_with(|f| {
            if f.get().set == self.id {
                assert!(!f.get().busy, "detach while an operation holds the slot");
                f.set(Fast::NONE);
            }
        });
        let _ = REGISTRY.try_with(|r| {
            let mut r = r.borrow_mut();
            if let Some(pos) = r.iter().position(|e| e.set == self.id && !e.transient) {
                assert!(!r[pos].busy, "detach while an operation holds the slot");
                r.swap_remove(pos);
            }
        });
        // Release: our uses of `owned` happen-before the next attacher's Acquire CAS.
        self.slots[a.index].state.store(FREE, Ordering::Release);
        std::mem::forget(a);
    }

    /// The slot this thread is attached to, if any.
    pub(crate) fn attached_slot(&self) -> Option<usize> {
        REGISTRY.with(|r| r.borrow().iter().find(|e| e.set == self.id && !e.transient).map(|e| e.slot))
    }

    /// Claim a slot for one operation: the attached slot, or the shared one.
    ///
    /// Panics if this thread already holds a claim on this set (claims do
    /// not nest; pass the claim down instead).
    #[inline]
    pub(crate) fn claim(&self) -> Claim<'_, S, O> {
        let fast = FAST.with(|f| {
            let v = f.get();
            (v.set == self.id).then(|| {
                assert!(!v.busy, "nested vCPU claim on one thread");
                f.set(Fast { busy: true, ..v });
                v.slot
            })
        });
        if let Some(index) = fast {
            return Claim {
                set: self,
                index,
                fast: true,
                _shared: std::mem::ManuallyDrop::new(None),
                _not_send: PhantomData,
            };
        }
        self.claim_slow()
    }

    /// [`claim`](CpuSet::claim) of an attachment not in [`FAST`], or of
    /// the shared slot.
    #[inline(never)]
    fn claim_slow(&self) -> Claim<'_, S, O> {
        let attached = REGISTRY.with(|r| {
            let mut r = r.borrow_mut();
            for e in r.iter_mut().filter(|e| e.set == self.id) {
                assert!(!e.busy, "nested vCPU claim on one thread");
                if !e.transient {
                    e.busy = true;
                    return Some(e.slot);
                }
            }
            None
        });
        if let Some(index) = attached {
            return Claim {
                set: self,
                index,
                fast: false,
                _shared: std::mem::ManuallyDrop::new(None),
                _not_send: PhantomData,
            };
        }
        let guard = super::rank::lock(&self.shared_lock, super::rank::Rank::SharedSlot);
        REGISTRY.with(|r| r.borrow_mut().push(TlsEntry { set: self.id, slot: self.cpus, busy: true, transient: true }));
        Claim {
            set: self,
            index: self.cpus,
            fast: false,
            _shared: std::mem::ManuallyDrop::new(Some(guard)),
            _not_send: PhantomData,
        }
    }
}

impl<S, O> Claim<'_, S, O> {
    /// The slot index (`cpus()` for the shared slot).
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// Both parts at once.
    #[allow(unsafe_code)]
    pub(crate) fn parts(&mut self) -> (&S, &mut O) {
        let slot = &self.set.slots[self.index];
        // SAFETY: as in `owned`; `shared` is a different field.
        (&slot.shared, unsafe { &mut *slot.owned.get() })
    }
}

impl<S, O> Drop for Claim<'_, S, O> {
    #[inline(always)]
    fn drop(&mut self) {
        if !self.fast {
            self.drop_slow();
            return;
        }
        // Only the shared slot's claims hold a guard, and FAST never
        // names the shared slot: nothing is left to release but the mark.
        debug_assert!(self._shared.is_none(), "a claim in FAST with the shared slot's guard");
        // `try_with`: at thread exit the mark may be gone already.
        let _ = FAST.try_with(|f| {
            let v = f.get();
            // Diagnostic: the mark stays on its attachment while busy.
            debug_assert!(v.set == self.set.id && v.slot == self.index && v.busy, "FAST changed under a claim");
            f.set(Fast { busy: false, ..v });
        });
    }
}

impl<S, O> Claim<'_, S, O> {
    /// The end of a claim not in [`FAST`].
    #[inline(never)]
    #[allow(unsafe_code)]
    fn drop_slow(&mut self) {
        // SAFETY: `_shared` is taken once, here: `drop_slow` is private,
        // its one caller is `Drop::drop`, and nothing reads the field
        // after. Held in a local, the guard is still released if the
        // registry update below unwinds.
        let shared = unsafe { std::mem::ManuallyDrop::take(&mut self._shared) };
        let id = self.set.id;
        let index = self.index;
        let _ = REGISTRY.try_with(|r| {
            let mut r = r.borrow_mut();
            if let Some(pos) = r.iter().position(|e| e.set == id && e.slot == index && e.busy) {
                if r[pos].transient {
                    r.swap_remove(pos);
                } else {
                    r[pos].busy = false;
                }
            }
        });
        // The shared slot's mutex guard (if any) is released after that.
        drop(shared);
    }
}

impl Attachment {
    /// The slot index.
    pub(crate) fn index(&self) -> usize {
        self.index
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        // An Attachment must be returned through `CpuSet::detach`; reaching
        // here means its owner forgot to, which would leak the slot forever.
        // Diagnostic: the slot then stays attached (leaked), never shared.
        debug_assert!(std::thread::panicking(), "Attachment dropped without CpuSet::detach");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(cpus: usize) -> CpuSet<AtomicU64, u64> {
        CpuSet::new(cpus, |i| (AtomicU64::new(i as u64), 0))
    }

    #[test]
    fn attach_claims_own_slot_and_detach_frees_it() {
        let s = set(2);
        let a = s.attach().unwrap();
        assert_eq!(s.attach().err(), Some(Some(a.index())));
        {
            let mut c = s.claim();
            assert_eq!(c.index(), a.index());
            *c.parts().1 += 1;
        }
        assert!(s.is_attached(a.index()));
        let idx = a.index();
        s.detach(a);
        assert!(!s.is_attached(idx));
        // Unattached: the shared slot.
        assert_eq!(s.claim().index(), 2);
    }

    #[test]
    fn slots_run_out() {
        let s = std::sync::Arc::new(set(1));
        let a = s.attach().unwrap();
        let s2 = s.clone();
        let other = std::thread::spawn(move || s2.attach().err()).join().unwrap();
        assert_eq!(other, Some(None));
        s.detach(a);
    }

    #[test]
    fn a_thread_attached_to_two_sets_claims_each_and_nests_across_them() {
        let (a, b) = (set(2), set(2));
        let ta = a.attach().unwrap();
        let tb = b.attach().unwrap();
        for _ in 0..2 {
            let ca = a.claim();
            let cb = b.claim();
            assert_eq!((ca.index(), cb.index()), (ta.index(), tb.index()));
            drop(ca);
            // The other set's claim is still live: a second one panics.
            let again = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(b.claim())));
            assert!(again.is_err(), "nested claim of the second set");
            drop(cb);
        }
        let (ia, ib) = (ta.index(), tb.index());
        a.detach(ta);
        // Detached from one: its claims take the shared slot, the other's
        // still its own.
        assert_eq!(a.claim().index(), 2);
        assert_eq!(b.claim().index(), ib);
        b.detach(tb);
        assert_eq!(b.claim().index(), 2);
        assert!(!a.is_attached(ia));
    }

    #[test]
    #[should_panic(expected = "nested vCPU claim")]
    fn attaching_inside_a_shared_slot_claim_still_refuses_a_nested_claim() {
        let s = set(1);
        let outer = s.claim();
        assert_eq!(outer.index(), 1, "the shared slot");
        let a = s.attach().unwrap();
        let _inner = s.claim();
        drop((outer, a));
    }

    #[test]
    #[should_panic(expected = "nested vCPU claim")]
    fn nested_claims_panic() {
        let s = set(1);
        let a = s.attach().unwrap();
        let _c1 = s.claim();
        let _c2 = s.claim();
        drop(a);
    }
}
