//! Loom model of FreeBSD's atomic page reference count
//! (`sync::refcount`): `wire_mapped` racing `try_remove_all`.
//!
//! A vCPU holds a page it finds through a PTE (`pmap_extract_and_hold`):
//! under the PTE lock, if the PTE maps the page, `wire_mapped`. A page
//! daemon reclaims the page: `try_remove_all` (block wirings if there are
//! none, clear the PTE under its lock, unblock), and if that ran, the page
//! is unmapped and unwired, so it frees it.
//!
//! The properties: a page is never freed while wired, and `BLOCKED` is
//! never left set. With `--cfg vmfault_mutation="refcount_no_blocked_check"`
//! (`wire_mapped` ignores `BLOCKED`) the vCPU can wire the page between the
//! daemon's check and its removal, and the model fails.
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use loom::thread;
use vmfault::sync::refcount::{BLOCKED, RefCount};
use vmfault::sync::spin;

struct Page {
    refs: RefCount,
    /// The PTE that maps the page (1: mapped).
    pte: AtomicU64,
    /// Its PTE lock.
    ptl: AtomicU32,
    /// Set by the daemon when it frees the page.
    freed: AtomicBool,
}

#[test]
#[cfg_attr(vmfault_mutation = "refcount_no_blocked_check", should_panic)]
fn a_page_wired_through_a_mapping_is_never_freed() {
    loom::model(|| {
        let page = Arc::new(Page {
            refs: RefCount::new(),
            pte: AtomicU64::new(1),
            ptl: AtomicU32::new(0),
            freed: AtomicBool::new(false),
        });
        page.refs.set_objref();

        let vcpu = {
            let page = page.clone();
            thread::spawn(move || {
                let _ptl = spin::lock(&page.ptl).0;
                page.pte.load(Ordering::Relaxed) == 1 && page.refs.wire_mapped()
            })
        };

        let removed = page.refs.try_remove_all(|| {
            let _ptl = spin::lock(&page.ptl).0;
            page.pte.store(0, Ordering::Relaxed);
        });
        if removed {
            // Unmapped and (as the block guaranteed) unwired: reclaim it.
            page.freed.store(true, Ordering::Release);
        }

        let held = vcpu.join().unwrap();
        assert_eq!(page.refs.get() & BLOCKED, 0, "BLOCKED left set");
        assert!(!(held && page.freed.load(Ordering::Acquire)), "a wired page was freed");
        assert_eq!(page.refs.wirings(), u32::from(held));
    });
}
