//! Loom model of FreeBSD's atomic page reference count
//! (`sync::refcount`) as the page daemon's pageout runs it
//! (`reclaim/pageout.rs`), racing a hold through a mapping and a hold
//! through the object's index.
//!
//! The model is a copy of `reclaim::pageout`'s steps on one page (the real
//! function needs a whole machine): `try_isolate`, unmap under the PTE
//! lock, copy the contents out, take the page out of its object
//! (`release_objref`), drop the daemon's wiring and free the frame if that
//! was the last reference. Two vCPUs race it: one holds the page through
//! its PTE (`wire_mapped`, as `mlock` and page holds do), one through the
//! object's index (`try_hold`, as a fault that shares the page does), and
//! each that got the page stores into it and lets it go. The properties: no
//! store lands after the daemon copied the page out (it would be lost), and
//! the frame is freed exactly when nothing holds it. It fails with
//! `refcount_no_blocked_check` (a mapping's hold ignores `BLOCKED`) and
//! with `refcount_hold_ignores_blocked` (an index hold ignores it).
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use loom::thread;
use vmfault::sync::refcount::{OBJREF, RefCount};
use vmfault::sync::spin;

/// One page, its PTE and its object's index entry, for the pageout model.
struct Paged {
    refs: RefCount,
    /// The PTE that maps the page (1: mapped).
    pte: AtomicU64,
    /// Its PTE lock.
    ptl: AtomicU32,
    /// The object's index entry names the page (1) or a swap slot (0).
    entry: AtomicU64,
    /// The page's contents: each store adds one.
    data: AtomicU64,
    /// What the daemon copied out (u64::MAX: nothing yet).
    copied: AtomicU64,
    /// Set when the frame is freed (by whoever dropped the last reference).
    freed: AtomicBool,
}

impl Paged {
    /// Drop a holder's wiring; the last reference frees the frame.
    fn unwire(&self) {
        if self.refs.unwire() {
            assert!(!self.freed.swap(true, Ordering::AcqRel), "the frame was freed twice");
        }
    }

    /// A store through a hold: it must not land after the copy-out.
    fn store(&self) {
        assert_eq!(self.copied.load(Ordering::Acquire), u64::MAX, "a store landed in a page already copied out");
        assert!(!self.freed.load(Ordering::Acquire), "a store into a freed frame");
        self.data.fetch_add(1, Ordering::AcqRel);
    }
}

#[test]
fn pageout_loses_no_store_and_frees_the_frame_exactly_once() {
    vmfault::sync::fails_under(&["refcount_no_blocked_check", "refcount_hold_ignores_blocked"], None, || {
        loom::model(|| {
            let page = Arc::new(Paged {
                refs: RefCount::new(),
                pte: AtomicU64::new(1),
                ptl: AtomicU32::new(0),
                entry: AtomicU64::new(1),
                data: AtomicU64::new(0),
                copied: AtomicU64::new(u64::MAX),
                freed: AtomicBool::new(false),
            });
            page.refs.set_objref();

            // Through the mapping: under the PTE lock, wire the page it maps.
            let mapped = {
                let page = page.clone();
                thread::spawn(move || {
                    let held = {
                        let _ptl = spin::lock(&page.ptl).0;
                        page.pte.load(Ordering::Relaxed) == 1 && page.refs.wire_mapped()
                    };
                    if held {
                        page.store();
                        page.unwire();
                    }
                })
            };
            // Through the object's index (inside an RCU section in the real
            // code, which keeps the frame from reuse: here, nothing frees a
            // frame that was not freed before the look).
            let indexed = {
                let page = page.clone();
                thread::spawn(move || {
                    if page.entry.load(Ordering::Acquire) == 1 && page.refs.try_hold() {
                        page.store();
                        page.unwire();
                    }
                })
            };

            // The daemon.
            if page.refs.try_isolate() {
                {
                    let _ptl = spin::lock(&page.ptl).0;
                    page.pte.store(0, Ordering::Relaxed);
                }
                // (A grace period here in the real code: no store through the
                // old PTE is still in flight.)
                page.copied.store(page.data.load(Ordering::Acquire), Ordering::Release);
                page.entry.store(0, Ordering::Release);
                assert!(!page.refs.release_objref(), "the daemon's wiring holds the page");
                page.unwire();
            }

            mapped.join().unwrap();
            indexed.join().unwrap();
            let copied = page.copied.load(Ordering::Acquire);
            if copied != u64::MAX {
                assert_eq!(copied, page.data.load(Ordering::Acquire), "a store after the copy-out was lost");
                assert!(page.freed.load(Ordering::Acquire), "the paged-out frame was not freed");
            } else {
                assert_eq!(page.refs.get(), OBJREF, "a page that stays keeps exactly its object's reference");
                assert!(!page.freed.load(Ordering::Acquire));
            }
        });
    });
}
