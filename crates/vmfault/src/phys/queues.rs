//! Page queues (FreeBSD's `vm_pagequeue` with its per-CPU batch queues,
//! r351628 onwards): the page daemon's order of reclaim.
//!
//! Two lists of data pages, *active* and *inactive*, threaded through the
//! page descriptors (`qnext`, `qprev`) behind one queue lock (`[Q]`). New
//! anonymous pages enter the active list; the daemon ages the active list
//! by reference marks (a page referenced since the last look goes to the
//! tail again, an unreferenced one to the inactive list) and pages out from
//! the inactive head (`reclaim::pageout`). Queues exist only when the `Vm`
//! has swap: without it nothing here is reclaimable.
//!
//! # The queue-state word (`Page::queue`)
//!
//! | bits | meaning | written |
//! |---|---|---|
//! | 0..2 `ACTIVE`/`INACTIVE` (0: none) | the queue the page *belongs* to | before publication by the inserting vCPU; by the daemon under `[Q]`; set to 0 when the frame is freed |
//! | 2 `ENQUEUED` | the page is linked in that queue's list | only under `[Q]`, together with the links |
//!
//! Invariant: `ENQUEUED` is set exactly while the page is on a list, and
//! the word is nonzero only for a data page that wants a queue (published,
//! or marked and about to be). Every change of `ENQUEUED` is a CAS under
//! the queue lock; freeing a frame ([`PageQueues::forget`]) CASes a word
//! without `ENQUEUED` to 0 outside the lock, so a batch entry applied later
//! finds 0 and skips the frame (also once the frame has been reused), and a
//! word with `ENQUEUED` is cleared and unlinked under the lock.
//!
//! A frame marked but not yet published can be linked by a stale entry (a
//! batch entry or a page the daemon holds, from the frame's former life):
//! harmless while it is a page (the daemon finds it in no object and puts
//! it back), and a frame whose publication loses its race leaves its queue
//! as a freed frame does (`PhysMem::unpublish`).
//!
//! # Batches
//!
//! A vCPU that inserts a page does not take the queue lock: it pushes the
//! frame number onto its own batch (a magazine of [`BATCH`] entries,
//! `sync::percpu`), and a full batch is applied in one acquisition. So the
//! lock, shared by all vCPUs, is taken once per [`BATCH`] faults. The page
//! daemon drains every batch remotely (the per-CPU page caches' protocol)
//! when its lists run short, so pages of idle vCPUs are not lost to it.
//!
//! Differences from FreeBSD: the daemon takes pages off the list while it
//! works on them (FreeBSD leaves them with a marker and a busy bit) and
//! puts back those it keeps; wired pages stay on the lists and are skipped
//! (FreeBSD dequeues them lazily); reference marks are the page's
//! `referenced` word, set by faults that map and by accesses through the
//! software MMU (the hardware accessed bit of a real machine).

use std::sync::Mutex;

use super::{Page, Pfn};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::percpu::PerCpuCache;
use crate::sync::rcu::{Rcu, RcuReader};

/// Entries per vCPU batch.
pub(crate) const BATCH: usize = 32;

/// Active pages the daemon ages per acquisition of the queue lock.
const AGE_CHUNK: u64 = 256;

/// The queue-state word's queue bits.
const QMASK: u32 = 3;
/// The page is linked in its queue's list.
const ENQUEUED: u32 = 4;

/// A page queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum Queue {
    /// Recently used pages, aged into the inactive queue.
    Active = 1,
    /// Pageout candidates, oldest first.
    Inactive = 2,
}

impl Queue {
    fn list(self) -> usize {
        self as usize - 1
    }
}

/// One list: frame numbers, 0 for none (frame 0, the zero page, is never
/// queued).
#[derive(Debug, Default, Clone, Copy)]
struct List {
    /// `[Q]` the oldest frame (taken first).
    head: u32,
    /// `[Q]` the newest frame.
    tail: u32,
    /// `[Q]` frames on the list.
    len: u64,
}

/// The active and inactive queues of one `Vm`. See the module docs.
#[derive(Debug)]
pub(crate) struct PageQueues {
    /// `[Q]` the two lists (links in the page descriptors, also `[Q]`).
    lists: Mutex<[List; 2]>,
    /// `[S]` per-vCPU batches of frames to link (see the module docs).
    batches: PerCpuCache<u32>,
    /// `[Q]` queue-lock acquisitions (written under the lock, read lockless).
    acquisitions: AtomicU64,
    /// `[Q]` pages on each list (mirrors for statistics).
    lens: [AtomicU64; 2],
}

impl PageQueues {
    /// Empty queues, with a batch for each reader of `rcu`.
    pub(crate) fn new(rcu: &Rcu) -> PageQueues {
        PageQueues {
            lists: Mutex::new([List::default(); 2]),
            batches: PerCpuCache::new(rcu, BATCH, BATCH),
            acquisitions: AtomicU64::new(0),
            lens: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }

    fn lock(&self) -> Locked<'_> {
        let g = crate::sync::rank::lock(&self.lists, crate::sync::rank::Rank::Queue);
        self.acquisitions.store(self.acquisitions.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        Locked { q: self, lists: g }
    }

    /// Queue-lock acquisitions so far.
    pub(crate) fn acquisitions(&self) -> u64 {
        self.acquisitions.load(Ordering::Relaxed)
    }

    /// Pages on the active and the inactive list (a snapshot).
    pub(crate) fn lens(&self) -> (u64, u64) {
        (self.lens[0].load(Ordering::Relaxed), self.lens[1].load(Ordering::Relaxed))
    }

    /// Mark an owned frame, about to be published as a data page, as
    /// belonging to `queue` (before publication: see the module docs).
    pub(crate) fn mark(page: &Page, queue: Queue) {
        // Diagnostic: a stale mark only mis-queues (see `unlink`).
        if cfg!(debug_assertions) {
            let old = page.queue.swap(queue as u32, Ordering::Relaxed);
            assert_eq!(old, 0, "a frame being published is on no queue");
        } else {
            page.queue.store(queue as u32, Ordering::Relaxed);
        }
    }

    /// Have published page `pfn`, marked by [`PageQueues::mark`], linked
    /// into its queue: through the vCPU's batch, applied when full.
    pub(crate) fn enqueue(&self, pages: &[Page], rcu: &Rcu, reader: &RcuReader, pfn: Pfn) {
        self.batches.local(rcu, reader, |m| {
            if let Err(p) = m.push(pfn.0) {
                let mut g = self.lock();
                for f in m.take_oldest(BATCH).chain(std::iter::once(p)) {
                    g.link_if_wanted(pages, f);
                }
            }
        });
    }

    /// Apply every vCPU's batch, without their help (a grace period; not
    /// inside a read-side section). Returns the entries applied.
    pub(crate) fn drain_batches(&self, pages: &[Page], rcu: &Rcu) -> usize {
        let mut all = Vec::new();
        // Applied after the drain lock: the queue lock is not taken under it.
        let n = self.batches.drain_all(rcu, |v| all = v);
        if n > 0 {
            let mut g = self.lock();
            for f in all {
                g.link_if_wanted(pages, f);
            }
        }
        n
    }

    /// Frames being freed leave their queues (before they go back to a
    /// free list): a word without `ENQUEUED` is cleared by a CAS, the
    /// others under the lock, in one acquisition.
    pub(crate) fn forget(&self, pages: &[Page], frames: &[Pfn]) {
        let mut linked = Vec::new();
        for &f in frames {
            let w = &pages[f.0 as usize].queue;
            let mut s = w.load(Ordering::Relaxed);
            while s != 0 && s & ENQUEUED == 0 {
                match w.compare_exchange_weak(s, 0, Ordering::Relaxed, Ordering::Relaxed) {
                    Ok(_) => s = 0,
                    Err(now) => s = now,
                }
            }
            if s != 0 {
                linked.push(f);
            }
        }
        if linked.is_empty() {
            return;
        }
        let mut g = self.lock();
        for f in linked {
            let s = pages[f.0 as usize].queue.swap(0, Ordering::Relaxed);
            if s & ENQUEUED != 0 {
                g.unlink(pages, f.0, s & QMASK);
            }
        }
    }

    /// The daemon's aging step: from the head of the active list, a page
    /// referenced since the last look goes to the tail again (its mark
    /// cleared), the others to the inactive tail, until `deactivate` pages
    /// have moved or every page was looked at once (so a second call finds
    /// the marks it cleared). With `force` (every page looked at last time
    /// was referenced: the working set is larger than memory), marks are
    /// cleared but do not keep a page active. The lock is dropped every
    /// [`AGE_CHUNK`] pages. Returns the pages deactivated.
    pub(crate) fn age(&self, pages: &[Page], deactivate: u64, force: bool) -> u64 {
        let mut left = self.lens().0;
        let mut moved = 0;
        while moved < deactivate && left > 0 {
            let mut g = self.lock();
            for _ in 0..AGE_CHUNK.min(left) {
                if moved == deactivate || g.lists[0].len == 0 {
                    break;
                }
                left -= 1;
                let f = g.lists[0].head;
                g.unlink(pages, f, Queue::Active as u32);
                let to = if pages[f as usize].take_referenced() && !force { Queue::Active } else { Queue::Inactive };
                moved += u64::from(to == Queue::Inactive);
                pages[f as usize].queue.store(to as u32 | ENQUEUED, Ordering::Relaxed);
                g.link_tail(pages, f, to);
            }
            if g.lists[0].len == 0 {
                break;
            }
        }
        moved
    }

    /// Take up to `max` pages off the head of the inactive list, for the
    /// daemon to look at: they stay marked `Inactive` but are on no list
    /// until [`PageQueues::requeue`] (unless freed meanwhile).
    pub(crate) fn take_inactive(&self, pages: &[Page], max: usize, out: &mut Vec<Pfn>) {
        let mut g = self.lock();
        for _ in 0..max.min(g.lists[1].len as usize) {
            let f = g.lists[1].head;
            g.unlink(pages, f, Queue::Inactive as u32);
            pages[f as usize].queue.store(Queue::Inactive as u32, Ordering::Relaxed);
            out.push(Pfn(f));
        }
    }

    /// Put pages the daemon took and kept back, each at the tail of the
    /// given queue, in one acquisition; frames freed since are skipped.
    pub(crate) fn requeue(&self, pages: &[Page], back: &[(Pfn, Queue)]) {
        if back.is_empty() {
            return;
        }
        let mut g = self.lock();
        for &(f, to) in back {
            let w = &pages[f.0 as usize].queue;
            let s = w.load(Ordering::Relaxed);
            if s == 0 || s & ENQUEUED != 0 {
                continue; // freed, or linked again by a batch after a reuse
            }
            if w.compare_exchange(s, to as u32 | ENQUEUED, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
                g.link_tail(pages, f.0, to);
            }
        }
    }
}

/// The lists, locked.
struct Locked<'a> {
    q: &'a PageQueues,
    lists: crate::sync::rank::Ranked<std::sync::MutexGuard<'a, [List; 2]>>,
}

impl Locked<'_> {
    /// Link `f` at the tail of the queue its word names, if it wants one
    /// and is on none (a batch entry; see the module docs).
    fn link_if_wanted(&mut self, pages: &[Page], f: u32) {
        let w = &pages[f as usize].queue;
        let mut s = w.load(Ordering::Relaxed);
        while s & QMASK != 0 && s & ENQUEUED == 0 {
            match w.compare_exchange_weak(s, s | ENQUEUED, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    let to = if s & QMASK == Queue::Active as u32 { Queue::Active } else { Queue::Inactive };
                    self.link_tail(pages, f, to);
                    return;
                }
                Err(now) => s = now,
            }
        }
    }

    fn link_tail(&mut self, pages: &[Page], f: u32, to: Queue) {
        let l = &mut self.lists[to.list()];
        let p = &pages[f as usize];
        p.qprev.store(l.tail, Ordering::Relaxed);
        p.qnext.store(0, Ordering::Relaxed);
        if l.tail == 0 {
            l.head = f;
        } else {
            pages[l.tail as usize].qnext.store(f, Ordering::Relaxed);
        }
        l.tail = f;
        l.len += 1;
        self.q.lens[to.list()].store(l.len, Ordering::Relaxed);
    }

    /// Unlink `f` from the list of queue bits `q`.
    fn unlink(&mut self, pages: &[Page], f: u32, q: u32) {
        let i = (q & QMASK) as usize - 1;
        let l = &mut self.lists[i];
        let p = &pages[f as usize];
        let (prev, next) = (p.qprev.load(Ordering::Relaxed), p.qnext.load(Ordering::Relaxed));
        if prev == 0 {
            // Diagnostic: a wrong link only mis-queues (indexes are
            // bounds-checked, the daemon re-checks every page it takes).
            debug_assert_eq!(l.head, f, "frame {f} claims to head its queue");
            l.head = next;
        } else {
            pages[prev as usize].qnext.store(next, Ordering::Relaxed);
        }
        if next == 0 {
            debug_assert_eq!(l.tail, f, "frame {f} claims to end its queue");
            l.tail = prev;
        } else {
            pages[next as usize].qprev.store(prev, Ordering::Relaxed);
        }
        l.len -= 1;
        self.q.lens[i].store(l.len, Ordering::Relaxed);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn setup(n: usize) -> (Vec<Page>, PageQueues, Rcu, Vec<RcuReader>) {
        let (rcu, readers) = Rcu::new(2);
        let q = PageQueues::new(&rcu);
        ((0..n).map(|_| Page::new()).collect(), q, rcu, readers)
    }

    fn active(pages: &[Page], q: &PageQueues, rcu: &Rcu, r: &RcuReader, f: u32) {
        PageQueues::mark(&pages[f as usize], Queue::Active);
        q.enqueue(pages, rcu, r, Pfn(f));
    }

    #[test]
    fn batches_link_pages_once_and_freed_frames_are_skipped() {
        let (pages, q, rcu, r) = setup(200);
        for f in 1..=BATCH as u32 {
            active(&pages, &q, &rcu, &r[0], f);
        }
        assert_eq!(q.lens(), (0, 0), "a batch is applied only when full");
        // Frame 5 is freed while in the batch, frame 6 freed and reused.
        q.forget(&pages, &[Pfn(5), Pfn(6)]);
        PageQueues::mark(&pages[6], Queue::Active);
        active(&pages, &q, &rcu, &r[0], 100);
        assert_eq!(q.lens(), (BATCH as u64, 0), "all but the freed frame, and the one that filled the batch");
        assert_eq!(pages[5].queue.load(Ordering::Relaxed), 0);
        // A stale entry for frame 6 (in another vCPU's batch from before
        // the reuse) adds nothing.
        q.enqueue(&pages, &rcu, &r[1], Pfn(6));
        assert_eq!(q.drain_batches(&pages, &rcu), 1);
        assert_eq!(q.lens(), (BATCH as u64, 0));
    }

    #[test]
    fn a_frame_linked_before_its_publication_leaves_when_the_publication_loses() {
        let (pages, q, rcu, r) = setup(16);
        active(&pages, &q, &rcu, &r[0], 3);
        q.drain_batches(&pages, &rcu);
        let mut got = Vec::new();
        q.age(&pages, 1, false);
        q.take_inactive(&pages, 1, &mut got);
        assert_eq!(got, [Pfn(3)]);
        // Freed while the daemon holds it, allocated again and marked.
        q.forget(&pages, &[Pfn(3)]);
        PageQueues::mark(&pages[3], Queue::Active);
        // The daemon puts its old candidate back: it is linked.
        q.requeue(&pages, &[(Pfn(3), Queue::Inactive)]);
        assert_eq!(q.lens(), (0, 1));
        // The publication loses its race: the frame leaves (`unpublish`).
        q.forget(&pages, &[Pfn(3)]);
        assert_eq!(q.lens(), (0, 0));
        assert_eq!(pages[3].queue.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn aging_moves_unreferenced_pages_and_the_daemon_puts_back_what_it_keeps() {
        let (pages, q, rcu, r) = setup(64);
        for f in 1..=8 {
            active(&pages, &q, &rcu, &r[0], f);
        }
        q.drain_batches(&pages, &rcu);
        pages[2].touch();
        pages[4].touch();
        assert_eq!(q.age(&pages, 8, false), 6);
        assert_eq!(q.lens(), (2, 6));
        let mut got = Vec::new();
        q.take_inactive(&pages, 4, &mut got);
        assert_eq!(got, [1, 3, 5, 6].map(Pfn));
        assert_eq!(q.lens(), (2, 2));
        // Frame 3 is freed while the daemon holds it: not put back.
        q.forget(&pages, &[Pfn(3)]);
        q.requeue(&pages, &[(Pfn(1), Queue::Active), (Pfn(3), Queue::Inactive), (Pfn(5), Queue::Inactive)]);
        assert_eq!(q.lens(), (3, 3));
        // Freeing linked pages unlinks them (head, middle, tail).
        q.forget(&pages, &[Pfn(7), Pfn(1), Pfn(2), Pfn(4)]);
        assert_eq!(q.lens(), (0, 2));
        got.clear();
        q.take_inactive(&pages, 10, &mut got);
        assert_eq!(got, [8, 5].map(Pfn));
    }
}
