//! VM objects: the owners of pages, indexed by page offset.
//!
//! A mapping maps a range of an object; its pages live in the object, not
//! in the page table. PTEs are a cache of translations that can be dropped
//! and rebuilt from the object at any time (that is how `mprotect(PROT_NONE)`
//! keeps the data, and how shared anonymous memory keeps it across
//! `MADV_DONTNEED`).
//!
//! Kinds so far:
//! - *private anonymous*: created at the first write fault of a VMA (Linux's
//!   `anon_vma_prepare`), possibly shared with a neighbouring VMA so the two
//!   can merge later; indexed by `address >> 12`.
//! - *shared anonymous*: created at `mmap(MAP_SHARED | MAP_ANONYMOUS)`, like
//!   Linux's shmem file behind it; indexed from 0. Shared across `fork`.
//! - *shadow*: a private anonymous object created by `fork` in front of the
//!   object the parent's VMA had, one for each side (`shadow.rs`): pages it
//!   lacks are read from the objects below, and a write copies them up.
//!   A private file mapping is a shadow in front of the file's object.
//! - *file*: the page cache of one file (`file.rs`), shared by every
//!   mapping of the file in the `Vm`; pages are read in at the first fault
//!   and written back when dirty (`msync`, `munmap`, the object's end).
//!
//! Every object also carries its reverse map (`rmap.rs`): the mappings of
//! its ranges and its shadow objects, or nothing under `Rmap::PvEntry`.
//!
//! # The page index
//! A [`Radix`] whose leaves hold `frame << 12 | 1`. Lookups are lockless
//! (inside an RCU section or under the map lock); an insert is a CAS from
//! empty, so two vCPUs faulting the same page of a shared object agree on
//! one page and the loser frees its copy; removal swaps entries to zero and
//! hands the frames to the caller, who frees them after a grace period.
//! No object lock is needed on the fault path.
//!
//! An entry may also be a *hole* (`HOLE`, no frame): the page reads as zero
//! here whatever the anonymous objects below hold (see `shadow.rs`); a
//! file's page still shows through it, as Linux re-reads the file.
//! A file object's entries carry `DIRTY` once a shared mapping may have
//! written the page (`file.rs`).
//!
//! An anonymous object's entry may instead name a *swap slot* (`SWAP`,
//! `slot << 12`): the page daemon wrote the page there and freed its frame
//! (`reclaim`); a fault reads it back in (`swap.rs`). Whoever takes such an
//! entry out of the index frees the slot.
//!
//! A file page the page daemon evicted leaves a *tombstone* (`GONE`, a
//! serial of the object's above bit 12, no frame): a page not in the
//! cache, like an empty entry, but never equal to the entry before it, so
//! that a read from the file that began before the eviction cannot be
//! inserted after it (`file.rs`, `fill`).

mod env;
mod file;
mod rmap;
mod shadow;
mod swap;

pub(crate) use env::{Cx, Env, EnvRef, SlotOwned};
pub(crate) use file::{FileData, Files};
pub(crate) use rmap::{BackingKey, ObjRmap, Pv, PvTable, RmapTotals};
pub(crate) use shadow::{Absorbed, Found};
pub(crate) use swap::{Reclaimable, SwapOut};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use crate::phys::{Frames, Kind, OwnedFrame, PageQueues, Pfn, Queue};
use crate::pmap::{OutOfFrames, Radix};
use crate::sync::rcu::RcuArc;
use crate::sync::scratch::Scratch;

/// Proof that the caller holds the map lock of the space that maps an
/// object, for writing: object operations whose precondition is that lock
/// (`punch_locked`, `collapse_locked`) take one, so the precondition is a
/// type as far as this layer can name one. The one implementation is the
/// guard of the layer above (`aspace::MapWrite`).
pub(crate) trait MapWriteHeld {}

/// A VM object.
#[derive(Debug)]
pub(crate) struct Object {
    /// `[I]` unique in its `Vm` (recorded in page descriptors).
    id: u64,
    /// `[I]` root; entries `[a]` (see the module docs).
    index: Radix,
    /// `[I]` the machine, to free pages when the object dies (through the
    /// handle of the vCPU slot that made it: `EnvRef`).
    env: Arc<EnvRef>,
    /// `[a]` (RCU) the object below, for shadow objects: read inside a
    /// section; replaced only by a collapse (`shadow.rs`), under the map
    /// lock of the one space whose VMAs map this object.
    backing: RcuArc<Object>,
    /// `[a]` objects whose `backing` is this one (BSD's `shadow_count`).
    shadows: AtomicU32,
    /// `[O]` the object lock: serializes collapses into this object (and
    /// out of it), which spaces sharing the level may attempt at once.
    /// Taken top-down along a chain, inside the map lock. Page-ins and the
    /// page daemon's swap-out of a page take it too (`swap.rs`).
    lock: std::sync::Mutex<()>,
    /// `[O]` absorbed by the object above it (`shadow.rs`): its entries
    /// are stale copies; no page may come in or go out of it any more.
    absorbed: AtomicBool,
    /// `[I]` made for the child side of a `fork` (or in front of such an
    /// object): Linux's anon_vma chain of such a VMA is not singular, so it
    /// neither merges with a VMA that has no object nor lends its object to
    /// one (`is_mergeable_anon_vma`, `reusable_anon_vma`), except when its
    /// VMA grows in place up to one (`Vma::can_extend_over`).
    pub(crate) inherited: bool,
    /// `[I]` the file, for a file object (`file.rs`).
    pub(crate) file: Option<FileData>,
    /// `[I]` for a shared anonymous object, its size in pages (Linux's
    /// shmem file behind the mapping keeps the size the `mmap` gave it: a
    /// page at or beyond it, reached through a mapping `mremap` grew, is
    /// SIGBUS); `u64::MAX` for every other object.
    pub(crate) pages: u64,
    /// `[S]` the reverse map (its own lock inside, see `rmap.rs`).
    pub(crate) rmap: ObjRmap,
}

const PRESENT: u64 = 1;
const HOLE: u64 = 2;
const DIRTY: u64 = 4;
const SWAP: u64 = 8;
/// A file page being written back (`file.rs`, Linux's `PG_writeback`):
/// the page daemon leaves it alone until the write ends.
const WRITEBACK: u64 = 16;
/// A file page evicted by the page daemon (a tombstone: `serial << 12`).
const GONE: u64 = 32;

/// One entry of an object's page index, as its word holds it (see the
/// module docs): nothing, a resident page (its frame above bit 12,
/// `PRESENT`), a hole, or a swap slot (`slot << 12 | SWAP`), with a file
/// page's `DIRTY` and `WRITEBACK` bits. The index's words are decoded
/// only here, as PTEs are only by [`Pte`](crate::pmap::Pte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry(u64);

impl Entry {
    /// No page (and nothing to show through, or the objects below decide).
    pub(crate) const NONE: Entry = Entry(0);
    /// A hole: the page reads as zero here whatever the objects below hold.
    const HOLE: Entry = Entry(HOLE);

    /// The entry of the resident page in frame `pfn`.
    #[inline]
    fn page(pfn: Pfn) -> Entry {
        Entry((u64::from(pfn.raw()) << 12) | PRESENT)
    }

    /// The entry of a page paged out to swap slot `slot`.
    #[inline]
    fn swapped(slot: u64) -> Entry {
        Entry((slot << 12) | SWAP)
    }

    /// The tombstone of a file page evicted as the object's `serial`th.
    #[inline]
    fn gone(serial: u64) -> Entry {
        Entry((serial << 12) | GONE)
    }

    /// Read an index word.
    #[inline]
    fn load(word: &std::sync::atomic::AtomicU64, order: Ordering) -> Entry {
        Entry(word.load(order))
    }

    /// The word.
    #[inline]
    fn bits(self) -> u64 {
        self.0
    }

    /// The frame of a resident page.
    #[inline]
    pub(crate) fn pfn(self) -> Option<Pfn> {
        (self.0 & PRESENT != 0).then_some(Pfn::decode((self.0 >> 12) as u32))
    }

    /// The swap slot of a paged-out page.
    #[inline]
    fn slot(self) -> Option<u64> {
        (self.0 & SWAP != 0).then_some(self.0 >> 12)
    }

    /// Whether this is the resident page in frame `pfn`.
    #[inline]
    fn maps(self, pfn: Pfn) -> bool {
        self.pfn() == Some(pfn)
    }

    /// Whether it owns something its remover must free (a frame or a slot).
    #[inline]
    fn owns(self) -> bool {
        self.0 & (PRESENT | SWAP) != 0
    }

    /// Whether it is a hole.
    #[inline]
    fn is_hole(self) -> bool {
        self.0 & HOLE != 0
    }

    /// A file page a shared mapping may have written.
    #[inline]
    fn is_dirty(self) -> bool {
        self.0 & DIRTY != 0
    }

    /// A file page being written back.
    #[inline]
    fn under_writeback(self) -> bool {
        self.0 & WRITEBACK != 0
    }

    /// The entry with its `DIRTY` traded for `WRITEBACK`.
    #[inline]
    fn taken_for_writeback(self) -> Entry {
        Entry((self.0 & !DIRTY) | WRITEBACK)
    }

    /// Mark the entry in `word` `DIRTY` (a shared mapping may write its
    /// page from now on); relaxed: the PTE that lets the store through is
    /// installed after, under the PTE lock.
    #[inline]
    fn set_dirty(word: &std::sync::atomic::AtomicU64) {
        word.fetch_or(DIRTY, Ordering::Relaxed);
    }

    /// Clear the `WRITEBACK` bit of the entry in `word` (a write-back
    /// ended); AcqRel: the page daemon that sees it clear sees the copy
    /// done.
    #[inline]
    fn end_writeback(word: &std::sync::atomic::AtomicU64) {
        word.fetch_and(!WRITEBACK, Ordering::AcqRel);
    }
}

impl Object {
    /// A new anonymous object.
    pub(crate) fn new_anon(ctx: &Cx<'_>) -> Result<Arc<Object>, OutOfFrames> {
        Self::with_backing(ctx, None, false, None, u64::MAX)
    }

    /// A new object for a shared anonymous mapping of `pages` pages.
    pub(crate) fn new_shared_anon(ctx: &Cx<'_>, pages: u64) -> Result<Arc<Object>, OutOfFrames> {
        Self::with_backing(ctx, None, false, None, pages)
    }

    /// A new object in the environment of `ctx`'s vCPU slot.
    fn with_backing(
        ctx: &Cx<'_>,
        below: Option<Arc<Object>>,
        inherited: bool,
        file: Option<FileData>,
        pages: u64,
    ) -> Result<Arc<Object>, OutOfFrames> {
        let index = Radix::index();
        let m = ctx.env;
        if let Some(b) = &below {
            b.shadows.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Arc::new_cyclic(|me| {
            if let Some(b) = &below {
                b.rmap.add_shadow(m, me.clone());
            }
            let id = ctx.new_object_id();
            m.reclaimable.add(id, me.clone());
            Object {
                id,
                index,
                env: ctx.own.env_ref.clone(),
                backing: RcuArc::new(below),
                shadows: AtomicU32::new(0),
                lock: std::sync::Mutex::new(()),
                absorbed: AtomicBool::new(false),
                inherited,
                file,
                pages,
                rmap: ObjRmap::default(),
            }
        }))
    }

    /// Whether this is a file object.
    #[inline]
    pub(crate) fn is_file(&self) -> bool {
        self.file.is_some()
    }

    /// The entry at `pindex` (`Entry::NONE` if no node holds it).
    #[inline]
    fn entry(&self, pindex: u64) -> Entry {
        // Acquire pairs with the Release CAS in `insert`: the page's
        // contents were complete before it was published.
        self.index.leaf(&self.env.phys, pindex).map_or(Entry::NONE, |leaf| Entry::load(leaf.entry, Ordering::Acquire))
    }

    /// Make sure the index has a slot for `pindex`, allocating index nodes
    /// now (before any lock, so that `insert` need not), and return it.
    /// `hint`: the calling vCPU's last reserve, which spares the walk when
    /// it was in the same leaf of this object (see [`IndexHint`]).
    #[inline(always)]
    pub(crate) fn reserve<'p>(
        &self,
        frames: &Frames<'p>,
        pindex: u64,
        hint: &IndexHint,
    ) -> Result<Slot<'p>, OutOfFrames> {
        let block = pindex >> LEAF_SHIFT;
        if hint.object.get() == self.id && hint.block.get() == block {
            let leaf =
                self.index.leaf_in_spanned(frames.phys(), Pfn::decode(hint.node.get()), pindex, Some(&hint.spanned));
            return Ok(Slot::new(leaf, self.id, pindex));
        }
        self.reserve_walk(frames, pindex, hint)
    }

    /// [`reserve`](Object::reserve) down the index, remembered in `hint`.
    #[cold]
    #[inline(never)]
    fn reserve_walk<'p>(&self, frames: &Frames<'p>, pindex: u64, hint: &IndexHint) -> Result<Slot<'p>, OutOfFrames> {
        let (leaf, _) = self.index.leaf_alloc(frames, pindex)?;
        hint.object.set(self.id);
        hint.block.set(pindex >> LEAF_SHIFT);
        hint.node.set(leaf.node().raw());
        hint.spanned.set(0);
        Ok(Slot::new(leaf, self.id, pindex))
    }

    /// The page in `slot` (reserved in this object): its entry, read as
    /// `find` reads the object's own level (Acquire).
    #[inline]
    pub(crate) fn entry_in(&self, slot: &Slot<'_>) -> Entry {
        #[cfg(debug_assertions)]
        assert_eq!(slot.object, self.id, "a slot of another object");
        Entry::load(slot.entry, Ordering::Acquire)
    }

    /// Insert a filled page at the index of `slot` (reserved in this
    /// object). Returns the page now there: ours, or the one another vCPU
    /// inserted first (ours is then freed). Never fails: the slot exists.
    ///
    /// Inline, the usual case: no page queues, and nothing in the slot but
    /// a hole at most (one publication); the rest, out of line.
    #[inline(always)]
    pub(crate) fn insert(&self, frames: &Frames<'_>, slot: Slot<'_>, page: OwnedFrame) -> Insert {
        #[cfg(debug_assertions)]
        assert_eq!(slot.object, self.id, "a slot of object {} used for object {}", slot.object, self.id);
        let cur = Entry::load(slot.entry, Ordering::Acquire);
        if frames.phys().queues.is_some() || cur.pfn().is_some() || cur.slot().is_some() {
            return self.insert_over(frames, slot, page, None);
        }
        let entry = Entry::page(page.pfn());
        let describe = |desc: &crate::phys::Page| self.describe(desc, slot.pindex, false);
        match frames.publish_into(page, Kind::Data, slot.entry, cur.bits(), entry.bits(), describe) {
            Ok(pfn) => Insert::Ours(pfn),
            Err((back, _)) => self.insert_over(frames, slot, back, None),
        }
    }

    /// Describe `desc`, a frame about to be published as this object's
    /// page at `pindex` (`queued`: onto the page queues, active).
    #[inline(always)]
    fn describe(&self, desc: &crate::phys::Page, pindex: u64, queued: bool) {
        desc.object.store(self.id, Ordering::Relaxed);
        desc.pindex.store(pindex, Ordering::Relaxed);
        desc.refs.set_objref();
        // Its first access is the fault that inserts it: the reference
        // mark a real MMU would set (`commit_locked` does not look the
        // new page up again to set it).
        desc.touch();
        if queued {
            PageQueues::mark(desc, Queue::Active);
        }
    }

    /// [`insert`](Object::insert), but with `over`, only over that entry
    /// (one CAS): if the entry changed to anything but a resident page,
    /// the page is freed and `Insert::Changed` says so.
    #[inline(never)]
    fn insert_over(&self, frames: &Frames<'_>, slot: Slot<'_>, page: OwnedFrame, over: Option<Entry>) -> Insert {
        #[cfg(debug_assertions)]
        assert_eq!(slot.object, self.id, "a slot of object {} used for object {}", slot.object, self.id);
        let (phys, slot_entry, pindex) = (frames.phys(), slot.entry, slot.pindex);
        let queued = phys.queues.is_some();
        let entry = Entry::page(page.pfn());
        // A hole is replaced like an empty slot.
        let mut cur = over.unwrap_or_else(|| Entry::load(slot_entry, Ordering::Acquire));
        let mut page = page;
        loop {
            if let Some(theirs) = cur.pfn() {
                frames.free_owned(page);
                return Insert::Theirs(theirs);
            }
            if cur.slot().is_some() {
                // Paged out since the caller looked: never lose it.
                frames.free_owned(page);
                return Insert::Swapped;
            }
            // Described before it becomes reachable (a failed publication
            // clears the description again). Release: the page's contents
            // (zeroed or copied while it was an OwnedFrame) and its
            // descriptor are visible to whoever finds it through the index.
            let describe = |desc: &crate::phys::Page| self.describe(desc, pindex, queued);
            match frames.publish_into(page, Kind::Data, slot_entry, cur.bits(), entry.bits(), describe) {
                Ok(pfn) => {
                    if queued {
                        frames.enqueue(pfn);
                    }
                    return Insert::Ours(pfn);
                }
                Err((back, now)) if over.is_some() && Entry(now).pfn().is_none() => {
                    frames.free_owned(back);
                    return Insert::Changed;
                }
                Err((back, now)) => (page, cur) = (back, Entry(now)),
            }
        }
    }

    /// Remove every page with index in `start..end`, pushing the frames
    /// that nothing wires onto `out` (a wired page is freed by its last
    /// unwiring, `aspace/hold.rs`) and freeing the swap slots of pages
    /// paged out. The caller has unmapped them and frees them after a
    /// grace period. Returns the number of frames removed. Holes stay (a
    /// shadow object's holes are made by `punch_locked`, which calls this).
    ///
    /// Only the leaves' spans are read (`Radix::for_each_spanned`): every
    /// reserve of a page the caller removes happened before its call (the
    /// caller cleared the PTEs that mapped them: `Pmap::update_range`
    /// reads them with Acquire).
    pub(crate) fn remove_range(&self, start: u64, end: u64, out: &mut Vec<Pfn>) -> u64 {
        let mut n = 0;
        self.index.for_each_spanned(&self.env.phys, start, end, |_, leaf| {
            if !Entry::load(leaf.entry, Ordering::Relaxed).owns() {
                return;
            }
            let e = Entry(leaf.entry.swap(0, Ordering::AcqRel));
            if let Some(pfn) = e.pfn() {
                self.release(pfn, out);
                n += 1;
            }
            self.forget_slot(e);
        });
        n
    }
}

impl Object {
    /// Page `pfn` has left this object: drop the object's reference and
    /// push the frame onto `out` (to free after a grace period) unless a
    /// wiring keeps it.
    pub(crate) fn release(&self, pfn: Pfn, out: &mut Vec<Pfn>) {
        if self.env.phys.page(pfn).refs.release_objref() {
            out.push(pfn);
        }
    }
}

/// Page indexes per level-0 node of an object's index.
const LEAF_SHIFT: u32 = 9;

/// A vCPU's last [`Object::reserve`] (its owner-only part, `vm::PerCpuOwned`):
/// the level-0 node of one object's index that holds the slots of one
/// block of 512 page indexes, so that a fault next to the last one (the
/// usual case: memory is touched in order) takes its slot with no walk.
///
/// Sound because an object's index nodes are freed only by its teardown
/// (`Drop`, the last reference gone) and never move (a taller index puts
/// new roots above the old ones), and object ids are never reused in a
/// `Vm`: whoever reserves in object `id` holds a reference to it, so a
/// node recorded for `id` is still that object's node for the block.
#[derive(Debug, Default)]
pub(crate) struct IndexHint {
    /// The object's id (0: none; ids start above 2^48).
    object: std::cell::Cell<u64>,
    /// The block (`pindex >> 9`).
    block: std::cell::Cell<u64>,
    /// Its level-0 node.
    node: std::cell::Cell<u32>,
    /// The last step of the node's span this vCPU widened it to hold
    /// (`Radix::leaf_in_spanned`): a fill in order widens once per step.
    spanned: std::cell::Cell<u32>,
}

/// A slot of an object's page index made by [`Object::reserve`]: where
/// [`Object::insert`] puts the page, with no second walk down the index.
///
/// Valid for as long as its object lives: index nodes are freed only by
/// the object's teardown (`Drop`), never while anyone holds the object.
///
/// Two words, so that the fault path moves it (and `Option`s of it) in
/// registers: a bigger one went through the stack, where a copy loaded
/// sixteen bytes over two eight-byte stores and stalled on store
/// forwarding. The object it belongs to is kept, and checked by
/// `insert`, in debug builds (every caller inserts through the object it
/// reserved from: `o.reserve` .. `o.insert`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slot<'p> {
    /// The index entry.
    entry: &'p std::sync::atomic::AtomicU64,
    /// Its page index.
    pindex: u64,
    /// The object it belongs to (debug builds).
    #[cfg(debug_assertions)]
    object: u64,
}

impl<'p> Slot<'p> {
    fn new(leaf: crate::pmap::Leaf<'p>, _object: u64, pindex: u64) -> Slot<'p> {
        Slot {
            entry: leaf.entry,
            pindex,
            #[cfg(debug_assertions)]
            object: _object,
        }
    }
}

/// The outcome of [`Object::insert`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Insert {
    /// Our page is now the object's.
    Ours(Pfn),
    /// Another vCPU inserted first; this is its page.
    Theirs(Pfn),
    /// The page was paged out meanwhile (nothing inserted): look again.
    Swapped,
    /// The entry was no longer the one given (`insert_over`; nothing
    /// inserted).
    Changed,
}

impl Drop for Object {
    fn drop(&mut self) {
        self.env.reclaimable.remove(self.id);
        if self.file.is_some() {
            self.drop_file();
        }
        self.rmap.clear(&self.env);
        if let Some(b) = self.backing.take() {
            b.shadows.fetch_sub(1, Ordering::Relaxed);
        }
        // In this thread's buffers: an object's end allocates nothing.
        let mut frames = Scratch::take(&END_FRAMES);
        let mut leaves = Scratch::take(&END_LEAVES);
        if self.file.is_some() {
            self.index.teardown(&self.env.phys, &mut frames, Some(&mut leaves));
        } else {
            // An anonymous object's entries all lie in its leaves' spans:
            // its nodes are freed cleared, and not zeroed again.
            self.index.teardown_cleared(&self.env.phys, &mut frames, &mut leaves);
        }
        for e in leaves.drain(..).map(Entry) {
            if let Some(pfn) = e.pfn() {
                self.release(pfn, &mut frames);
            }
            self.forget_slot(e);
        }
        // Pages may still be mapped in PTEs that a walker read before they
        // were zapped: freed after a grace period (waited for here, or by
        // the grace-period thread with free_path=deferred), unless the
        // drop runs inside `dropping_aged`, whose caller knows one has
        // passed.
        // (`try_with`: an object may end in a thread-local's destructor,
        // after this one's.)
        let sunk = AGED_SINK
            .try_with(|s| {
                s.borrow_mut()
                    .as_mut()
                    .map(|v| {
                        if v.capacity() == 0 {
                            // The first end in this sink: the thread's
                            // buffer (`recycle_aged` gives it back).
                            *v = AGED_FRAMES.try_with(std::cell::Cell::take).unwrap_or_default();
                        }
                        v.extend_from_slice(&frames)
                    })
                    .is_some()
            })
            .unwrap_or(false);
        if !sunk {
            self.env.phys.free_later(&self.env.rcu, &frames);
        }
    }
}

thread_local! {
    /// Where the objects dropped inside [`dropping_aged`] leave their
    /// frames (`None` outside it).
    static AGED_SINK: std::cell::RefCell<Option<Vec<Pfn>>> = const { std::cell::RefCell::new(None) };
    /// `[T]` the buffer a sink takes at its first object's end, back from
    /// [`recycle_aged`] (a sink nothing ends in touches neither).
    static AGED_FRAMES: std::cell::Cell<Vec<Pfn>> = const { std::cell::Cell::new(Vec::new()) };
    /// `[T]` the buffers of an object's end: its frames and index entries.
    static END_FRAMES: std::cell::Cell<Vec<Pfn>> = const { std::cell::Cell::new(Vec::new()) };
    static END_LEAVES: std::cell::Cell<Vec<u64>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Run `drop_them` (which drops values that may hold the last references
/// to objects), collecting the frames of the objects it ends instead of
/// freeing each object's after a grace period of its own; returns them.
///
/// # Precondition
/// Every way a lockless reader could reach those objects, their index
/// nodes or their pages was unlinked before a grace period that has
/// ended: the values are VMA-index snapshots that `Rcu::reclaim` gave
/// back, and the PTEs of the mappings they name were zapped before the
/// snapshots were retired; or the VMAs a change removed, once a grace
/// period has ended since the cookie taken after all its unlinks
/// (`Space::drop_removed`). So the frames may be freed at once (the
/// caller frees them through its vCPU's cache: no global lock, and no
/// second wait after the snapshots' own).
pub(crate) fn dropping_aged(drop_them: impl FnOnce()) -> Vec<Pfn> {
    struct Restore(Option<Vec<Pfn>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            // A nested call (an object's end dropping snapshots) keeps the
            // outer collection going.
            let _ = AGED_SINK.try_with(|s| *s.borrow_mut() = self.0.take());
        }
    }
    let Ok(outer) = AGED_SINK.try_with(|s| s.borrow_mut().replace(Vec::new())) else {
        // The thread is ending: each object frees its own, as elsewhere.
        drop_them();
        return Vec::new();
    };
    let restore = Restore(outer);
    drop_them();
    let mine = AGED_SINK.try_with(|s| s.borrow_mut().take()).ok().flatten().unwrap_or_default();
    drop(restore);
    mine
}

/// Give back the frames [`dropping_aged`] returned, freed: their room is
/// the next sink's.
pub(crate) fn recycle_aged(mut frames: Vec<Pfn>) {
    if frames.capacity() > 0 {
        frames.clear();
        let _ = AGED_FRAMES.try_with(|b| b.set(frames));
    }
}
