//! The page descriptor (`vm_page`): 64 bytes per frame, in one array indexed
//! by frame number, so that a frame number is all any layer needs to keep.
//!
//! Every field another CPU may read without a lock is an atomic; the tag on
//! each field says who may write it.
//!
//! # Frame kinds (`kind`)
//!
//! | kind     | meaning                                        | reached through            |
//! |----------|------------------------------------------------|----------------------------|
//! | `FREE`   | on the global free list (tracked in debug builds only) | the free list (`[F]`) |
//! | `OWNED`  | allocated, not yet published anywhere          | its `OwnedFrame` only      |
//! | `DATA`   | a page of a VM object                          | object index, PTEs         |
//! | `TABLE`  | a page-table page (512 PTEs)                   | the page table above it    |
//! | `INDEX`  | a node of an object's page index               | the index node above it    |
//! | `ZERO`   | the shared zero page, never freed              | PTEs (read-only)           |
//!
//! Transitions: `FREE -> OWNED` (alloc), `OWNED -> DATA|TABLE|INDEX|ZERO`
//! (publish), `OWNED|DATA|TABLE|INDEX -> FREE` (free, after a grace period
//! for anything that was published). Debug builds assert each one.

use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Frame kinds; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Kind {
    Free = 0,
    Owned = 1,
    Data = 2,
    Table = 3,
    Index = 4,
    Zero = 5,
}

impl Kind {
    fn from_u32(v: u32) -> Kind {
        match v {
            0 => Kind::Free,
            1 => Kind::Owned,
            2 => Kind::Data,
            3 => Kind::Table,
            4 => Kind::Index,
            5 => Kind::Zero,
            _ => unreachable!("corrupt page kind {v}"),
        }
    }
}

/// One frame's descriptor.
#[derive(Debug)]
#[repr(C, align(64))]
pub(crate) struct Page {
    /// `[a]` the frame's [`Kind`]; changed only by the frame's owner at the
    /// transitions in the module table (Relaxed: publication of the frame
    /// itself orders it).
    kind: AtomicU32,
    /// `[P]` the PTE lock word, used while `kind == TABLE`.
    pub(crate) ptl: AtomicU32,
    /// `[O]` id of the object that owns this `DATA` page (0: none).
    pub(crate) object: AtomicU64,
    /// `[O]` index of this page in its object. For an `INDEX` node that is
    /// (or was) the root of an object's index: the first index it covers,
    /// set before the root is published, never changed (`pmap::radix`).
    pub(crate) pindex: AtomicU64,
    /// `[a]` the reference count of a `DATA` page: the object's reference
    /// and wirings (`sync::refcount`, its state table there).
    pub(crate) refs: crate::sync::refcount::RefCount,
    /// `[a]` the page was mapped, read in or accessed since the page daemon
    /// last looked (its reference mark: `phys::queues`); set by faults and,
    /// with queues, by the software MMU; cleared by the daemon (a stale
    /// mark on a reused frame only delays its turn).
    referenced: AtomicU32,
    /// `[a]` the queue-state word (`phys::queues`: the queue the page
    /// belongs to, and `ENQUEUED`, which changes only under `[Q]`).
    pub(crate) queue: AtomicU32,
    /// `[Q]` the next and the previous frame on its queue (0: none).
    pub(crate) qnext: AtomicU32,
    /// `[Q]` see `qnext`.
    pub(crate) qprev: AtomicU32,
    /// `[a]` for a `TABLE` or `INDEX` node above the leaves: how many of
    /// its entries are non-zero (children). Added to by the CAS that
    /// attaches a child (`pmap::radix`), taken from by the prune that
    /// detaches one; read by the teardown of a subtree nobody else can
    /// reach, which stops scanning when it has found them all (a page
    /// table's root keeps `u32::MAX`, `pmap::radix::UNCOUNTED`). For an
    /// `INDEX` leaf node: the span of the slots ever handed out for
    /// writing (`pmap::radix`, `widen_span`), where every entry that owns
    /// a frame or a swap slot lies, so that the teardown of an object scans
    /// only that span. Zero while the frame is free, and for
    /// every other kind.
    pub(crate) children: AtomicU32,
    /// `[o]` the frame holds only zeros (`PhysMem::mark_zeroed`): set by
    /// whoever frees a frame it cleared itself (a page-table page a prune
    /// detached, an index node of an anonymous object that ended,
    /// `pmap::radix`), or by the vCPU whose cache holds it, which zeroed it
    /// there ahead of its allocation (`zero_ahead`), kept across the free, cleared by the next
    /// write to the frame (its zeroing, which this lets it skip; a copy, a
    /// read-in; its publication). FreeBSD's `PG_ZERO`.
    pub(crate) zeroed: AtomicU32,
    /// `[o]` when the frame last went into a vCPU's cache, for
    /// `zero_stores=auto` (`Frames::zero_for`): that vCPU's slot plus one
    /// (bits 21 and up) and its frame allocations then (the low 21 bits);
    /// 0: never, or the vCPU had taken it long before (`taken_at`): its
    /// lines had left the caches already. Written by whoever frees the
    /// frame into its cache (`pcpu::restamp`).
    pub(crate) cached_at: AtomicU32,
    /// `[o]` when a vCPU last took the frame and wrote it whole, as
    /// `cached_at`: written by a fault that zeroes or copies into it, and
    /// by a zeroed allocation (a page-table page), where
    /// `zero_stores=auto` reads it (`Frames::note_taken`). A frame read
    /// into from a file or swap is not stamped: its free finds it cold.
    pub(crate) taken_at: AtomicU32,
}

/// The budget: at most 64 bytes per frame (60 used), one cache line, so
/// that metadata stays a sixty-fourth of memory.
/// Not under loom, whose model atomics are larger than the real ones.
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Page>() <= 64);

impl Page {
    pub(crate) fn new() -> Page {
        Page {
            kind: AtomicU32::new(Kind::Free as u32),
            ptl: AtomicU32::new(0),
            object: AtomicU64::new(0),
            pindex: AtomicU64::new(0),
            refs: crate::sync::refcount::RefCount::new(),
            referenced: AtomicU32::new(0),
            queue: AtomicU32::new(0),
            qnext: AtomicU32::new(0),
            qprev: AtomicU32::new(0),
            children: AtomicU32::new(0),
            zeroed: AtomicU32::new(0),
            cached_at: AtomicU32::new(0),
            taken_at: AtomicU32::new(0),
        }
    }

    /// Mark the page referenced (a load first: no store when it is).
    #[inline]
    pub(crate) fn touch(&self) {
        if self.referenced.load(Ordering::Relaxed) == 0 {
            self.referenced.store(1, Ordering::Relaxed);
        }
    }

    /// Whether the page was referenced since the last call (clears it).
    /// `--cfg vmfault_mutation="queues_no_aging"` ignores the marks (the
    /// daemon then pages out in FIFO order: `tests/swap.rs`,
    /// `hot_pages_stay_resident_while_a_cold_stream_pages_out`, fails).
    pub(crate) fn take_referenced(&self) -> bool {
        !crate::mutated!("queues_no_aging")
            && self.referenced.load(Ordering::Relaxed) != 0
            && self.referenced.swap(0, Ordering::Relaxed) != 0
    }

    /// The frame's kind (a snapshot).
    #[inline]
    pub(crate) fn kind(&self) -> Kind {
        Kind::from_u32(self.kind.load(Ordering::Relaxed))
    }

    /// Move from `from` to `to`, checking `from` in every build: a frame
    /// published twice, or taken back while still published, would have
    /// two owners (plain writes racing atomic ones).
    #[inline]
    pub(crate) fn set_kind(&self, from: Kind, to: Kind) {
        // Only the frame's owner changes its kind: load, check, store.
        let old = self.kind.load(Ordering::Relaxed);
        // Release builds do not track Free on the free lists (`freelist`):
        // a frame taken from one still says Free or Owned.
        let ok = old == from as u32 || (from == Kind::Owned && old == Kind::Free as u32 && !cfg!(debug_assertions));
        assert!(ok, "bad page kind transition {from:?} -> {to:?} (the frame is {:?})", Kind::from_u32(old));
        self.kind.store(to as u32, Ordering::Relaxed);
    }
}
