//! Synchronization primitives, written once for `std` and once for loom.
//!
//! The primitives the concurrency protocols of the crate are built from
//! live here, written once for `std` and loom, so the loom models in
//! `tests/loom_*.rs` run the very primitives production runs. The
//! sequences of steps that use them in the layers above (a fault, a
//! pageout, a collapse) need a whole machine; a model writes such a
//! sequence out as a copy, says whose copy it is, and the production code
//! names the model that checks it (`tests/loom_spf.rs` for the fault
//! paths, `loom_refcount.rs` for pageout, `loom_shadow.rs` for the
//! collapse and the chain walk, `loom_writeback.rs` for write-back,
//! `loom_rcu.rs` for the frees after a grace period). The primitives:
//!
//! - [`rcu`]: a small RCU with a *blocking* `synchronize()` (no crate offers
//!   one): per-reader counters that are odd inside a read-side section.
//! - `cpu`: vCPU slots. A thread attached to a slot owns its per-CPU data the
//!   way a kernel CPU owns its per-CPU data with preemption disabled.
//! - [`spin`]: the word lock used as the PTE lock (`[P]`), with a try-lock.
//! - [`generation`]: a change count (the page table's prunes, which tell a
//!   fault whether the PTE slot it walked to is still attached).
//! - [`percpu`]: per-CPU caches another CPU can drain (protocols 1 and 2).
//! - [`vma_state`]: a VMA's sequence count and per-VMA lock (protocols 3 and 4).
//! - [`refcount`]: a page's atomic reference count (wirings, object
//!   reference, the BLOCKED bit; protocol 5).
//! - [`publish_if_empty`]: how a collapse moves a page up a shadow chain.
//! - [`write_back_ordered`]: the order of the steps of a shared file
//!   page's write-back.
//! - `scratch`: a thread's reusable buffer, for batches gathered under a
//!   lock and dropped outside it.
//!
//! Under `--cfg loom` the atomics, fences and spin hints are loom's: every
//! protocol word of these primitives goes through [`atomic`]. What stays
//! `std`'s, and why: the words inside frames (PTEs, radix pointers, index
//! entries, page contents), which overlay the arena's memory (a model puts
//! loom's atomics in their place through [`Slot`]); counters, statistics
//! and the serials of statics, which no protocol orders anything by; and
//! the vCPU slots' owner cell and shared-slot mutex (`cpu`), whose claims
//! hand out references for an operation's length, which loom's cells
//! cannot express (no model claims slots).

pub(crate) mod cpu;
pub mod generation;
pub mod percpu;
pub(crate) mod rank;
pub mod rcu;
pub mod refcount;
pub(crate) mod scratch;
pub mod spin;
pub mod vma_state;

/// A word a page can be published into: an object index entry (a `std`
/// atomic in the frame arena, or loom's in a model).
pub trait Slot {
    /// Compare-and-exchange (AcqRel on success).
    fn cas(&self, current: u64, new: u64) -> Result<u64, u64>;
    /// Store (Release).
    fn put(&self, value: u64);
}

impl Slot for std::sync::atomic::AtomicU64 {
    fn cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        self.compare_exchange(current, new, std::sync::atomic::Ordering::AcqRel, std::sync::atomic::Ordering::Relaxed)
    }
    fn put(&self, value: u64) {
        self.store(value, std::sync::atomic::Ordering::Release);
    }
}

#[cfg(loom)]
impl Slot for loom::sync::atomic::AtomicU64 {
    fn cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        self.compare_exchange(current, new, loom::sync::atomic::Ordering::AcqRel, loom::sync::atomic::Ordering::Relaxed)
    }
    fn put(&self, value: u64) {
        self.store(value, loom::sync::atomic::Ordering::Release);
    }
}

/// Publish `value` into `slot` if the slot is still empty (0); whether it
/// went in. A collapse moves pages up a shadow chain this way
/// (`object::shadow`): a speculative fault that passed its final check just
/// before the collapse's VMAs were retired may be filling the same slot
/// with its own page, which must win. `tests/loom_shadow.rs` races the two;
/// with `--cfg vmfault_mutation="shadow_move_store"` (a plain store) the
/// fault's page is overwritten and the model fails.
pub fn publish_if_empty(slot: &impl Slot, value: u64) -> bool {
    if crate::mutated!("shadow_move_store") {
        slot.put(value);
        return true;
    }
    slot.cas(0, value).is_ok()
}

/// The write-back of dirty shared file pages (`object/file.rs`), in the
/// order that loses no store: `take_dirty` (clear the pages' dirty bits),
/// then `protect` (make every PTE that maps them read-only, under the PTE
/// locks, and wait for a grace period, so that no store through an old
/// writable PTE is in flight), then `copy` (read the pages and write them
/// out). A store that comes after the protection faults, which marks the
/// page dirty again under the PTE lock before making it writable; one that
/// came before it is complete when the grace period ends, so `copy` sees it.
///
/// `tests/loom_writeback.rs` races a vCPU's fault and store with it; with
/// `--cfg vmfault_mutation="writeback_copy_first"` (copy, then protect) a
/// store lands between the copy and the protection, its page is clean,
/// and the model fails.
pub fn write_back_ordered<T, R>(
    take_dirty: impl FnOnce() -> T,
    protect: impl FnOnce(&T),
    copy: impl FnOnce(&T) -> R,
) -> R {
    let pages = take_dirty();
    if crate::mutated!("writeback_copy_first") {
        let r = copy(&pages);
        protect(&pages);
        return r;
    }
    protect(&pages);
    copy(&pages)
}

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

/// Whether `name` is the mutation this crate was built with
/// (`VMFAULT_MUTATION`) or the one `VMFAULT_LOOM_MUTATION` names (loom
/// builds; read once): see `mutated!`.
#[cfg(loom)]
pub fn loom_mutation(name: &str) -> bool {
    static ON: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    option_env!("VMFAULT_MUTATION_BUILT") == Some(name)
        || ON.get_or_init(|| std::env::var("VMFAULT_LOOM_MUTATION").ok()).as_deref() == Some(name)
}

/// Run `model` (a loom model's body): it must pass, unless one of
/// `mutations` is on (`VMFAULT_LOOM_MUTATION`), when it must fail, with a
/// message holding `expected` if one is given. The loom tests' way of
/// saying which mutations each model guards against (`.ci/run` runs every
/// pair from one build).
#[cfg(loom)]
pub fn fails_under(mutations: &[&str], expected: Option<&str>, model: impl FnOnce() + std::panic::UnwindSafe) {
    let Some(on) = mutations.iter().copied().find(|m| loom_mutation(m)) else {
        model();
        return;
    };
    let Err(e) = std::panic::catch_unwind(model) else {
        panic!("the model passed with mutation {on} on: it no longer guards against it");
    };
    let msg =
        e.downcast_ref::<String>().map(String::as_str).or_else(|| e.downcast_ref::<&str>().copied()).unwrap_or("");
    if let Some(want) = expected {
        assert!(msg.contains(want), "with mutation {on} the model failed, but not with {want:?}: {msg}");
    }
    eprintln!("failed under mutation {on}, as it must: {msg}");
}

/// No mutation at run time outside loom builds: see `mutated!`.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) const fn loom_mutation(_name: &str) -> bool {
    false
}
