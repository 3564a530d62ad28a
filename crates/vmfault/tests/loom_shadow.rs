//! Loom model of a shadow-chain collapse racing a walker (`object::shadow`).
//!
//! A child space walks a chain `L -> B` that it shares with the parent
//! (say, for a read fault) while the parent's fork collapses it: `L`
//! absorbs `B` by copying `B`'s entry up, switching `L`'s backing pointer
//! past `B`, and, after a grace period, forgetting `B`'s entries. The
//! walker must find the page whichever way the race goes.
//!
//! The walk uses the real `RcuArc::read_then` (the backing pointer is loaded
//! before the entry) and the real grace period; its steps and the
//! collapse's are a copy of `object/shadow.rs` (`find_from`, `absorb`),
//! which points back here. With
//! `--cfg vmfault_mutation="shadow_entry_first"` (the entry first) the walker
//! can read `L` before the page arrives and the new pointer after it, and
//! miss the page: the model then fails.
//!
//! A second model races the move itself (the real `sync::publish_if_empty`)
//! with a speculative fault of the collapsing space that passed its final
//! check just before the retirement and now inserts its own copy into `L`
//! (a CAS from empty, as `Object::insert` does). The fault's page must
//! survive; with `--cfg vmfault_mutation="shadow_move_store"` (the move a
//! plain store) it is overwritten and the model fails.
#![cfg(loom)]

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::thread;
use vmfault::sync::publish_if_empty;
use vmfault::sync::rcu::{Rcu, RcuArc, RcuReadGuard};

/// One level of a chain: a one-page index and the pointer to the level below.
struct Level {
    entry: AtomicU64,
    backing: RcuArc<Level>,
}

/// "Frame 7, present", as an object index entry.
const PAGE: u64 = (7 << 12) | 1;

/// `Object::find` for the one page: pointer, then entry, level by level.
fn find(top: &Level, section: &RcuReadGuard<'_>) -> u64 {
    let mut o = top;
    loop {
        let (below, e) = o.backing.read_then(section, || o.entry.load(Ordering::Acquire));
        if e != 0 {
            return e;
        }
        match below {
            Some(b) => o = b,
            None => return 0,
        }
    }
}

#[test]
fn a_walker_finds_the_page_a_collapse_moves_up() {
    vmfault::sync::fails_under(&["shadow_entry_first"], None, || {
        loom::model(|| {
            let (rcu, mut readers) = Rcu::new(1);
            let rcu = Arc::new(rcu);
            let absorbed = std::sync::Arc::new(Level { entry: AtomicU64::new(PAGE), backing: RcuArc::new(None) });
            let level = Arc::new(Level { entry: AtomicU64::new(0), backing: RcuArc::new(Some(absorbed.clone())) });
            let reader = readers.pop().unwrap();

            let walker = {
                let (rcu, level) = (rcu.clone(), level.clone());
                thread::spawn(move || {
                    let section = rcu.read_lock(&reader);
                    assert_eq!(find(&level, &section), PAGE, "the page vanished during a collapse");
                })
            };

            // The collapse: move the page up (Release), switch the pointer past
            // the absorbed level, wait for a grace period, forget its entry.
            level.entry.store(PAGE, Ordering::Release);
            let mut old = vec![level.backing.replace(&rcu, None)];
            drop(rcu.reclaim(&mut old, true));
            absorbed.entry.store(0, Ordering::Relaxed);
            walker.join().unwrap();
        });
    });
}

/// "Frame 9, present": the fault's own copy.
const OWN: u64 = (9 << 12) | 1;

#[test]
fn a_collapse_never_overwrites_a_page_a_fault_inserts() {
    vmfault::sync::fails_under(&["shadow_move_store"], None, || {
        loom::model(|| {
            let slot = Arc::new(AtomicU64::new(0));
            let fault = {
                let slot = slot.clone();
                thread::spawn(move || slot.compare_exchange(0, OWN, Ordering::AcqRel, Ordering::Acquire).is_ok())
            };
            let moved = publish_if_empty(&*slot, PAGE);
            let inserted = fault.join().unwrap();
            let end = slot.load(Ordering::Acquire);
            if inserted {
                assert_eq!(end, OWN, "the collapse overwrote the fault's page");
                assert!(!moved, "the absorbed page must count as hidden");
            } else {
                assert_eq!(end, PAGE);
            }
        });
    });
}
