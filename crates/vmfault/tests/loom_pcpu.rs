//! Loom model of the remote drain of a per-CPU cache (protocol 2 in the
//! crate's `lib.rs`): swap in the empty spare, wait for a grace period,
//! drain the old magazine, while the owner keeps allocating and freeing.
//!
//! Loom checks every access to a magazine (through its `UnsafeCell`) for a
//! race, and the model checks that no item is lost or duplicated.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p vmfault --release --test loom_pcpu`.
//! With `--cfg vmfault_mutation="pcp_no_grace"` the drainer skips the grace
//! period and the model must fail (the tests then expect the panic).
#![cfg(loom)]

use loom::sync::{Arc, Mutex};
use loom::thread;
use vmfault::sync::percpu::PerCpuCache;
use vmfault::sync::rcu::Rcu;

/// The owner frees two frames into its cache and allocates one back, while
/// another thread drains every cache into the global list.
#[test]
fn drain_races_owner_alloc_and_free_without_loss() {
    vmfault::sync::fails_under(&["pcp_no_grace"], None, || {
        loom::model(|| {
            let (rcu, mut readers) = Rcu::new(2);
            let cache = Arc::new(PerCpuCache::<u32>::new(&rcu, 4, 4));
            let rcu = Arc::new(rcu);
            let global = Arc::new(Mutex::new(Vec::<u32>::new()));
            let r0 = readers.remove(0);
            let owner = {
                let (rcu, cache) = (rcu.clone(), cache.clone());
                thread::spawn(move || {
                    cache.local(&rcu, &r0, |m| m.push(10).unwrap());
                    cache.local(&rcu, &r0, |m| m.push(11).unwrap());
                    // Allocate: from the cache if the drain left anything there.
                    let got = cache.local(&rcu, &r0, |m| m.pop());
                    (got, r0)
                })
            };
            {
                let global = global.clone();
                cache.drain_all(&rcu, move |xs| global.lock().unwrap().extend(xs));
            }
            let (got, _r0) = owner.join().unwrap();
            // Whatever is still cached comes out with a final drain.
            {
                let global = global.clone();
                cache.drain_all(&rcu, move |xs| global.lock().unwrap().extend(xs));
            }
            let mut all = global.lock().unwrap().clone();
            all.extend(got);
            all.sort();
            assert_eq!(all, [10, 11], "an item was lost or duplicated");
            assert_eq!(cache.cached(), 0);
        });
    });
}

/// A drain between two of the owner's operations: the owner's next
/// operation must find the (empty) spare, not the magazine being drained.
#[test]
fn owner_moves_to_the_spare_after_a_drain() {
    vmfault::sync::fails_under(&["pcp_no_grace"], None, || {
        loom::model(|| {
            let (rcu, mut readers) = Rcu::new(2);
            let cache = Arc::new(PerCpuCache::<u32>::new(&rcu, 2, 2));
            let rcu = Arc::new(rcu);
            let r0 = readers.remove(0);
            cache.local(&rcu, &r0, |m| m.push(1).unwrap());
            let owner = {
                let (rcu, cache) = (rcu.clone(), cache.clone());
                thread::spawn(move || {
                    let a = cache.local(&rcu, &r0, |m| m.pop());
                    cache.local(&rcu, &r0, |m| m.push(2).unwrap());
                    a
                })
            };
            let drained = Arc::new(Mutex::new(Vec::new()));
            {
                let d = drained.clone();
                cache.drain_all(&rcu, move |xs| d.lock().unwrap().extend(xs));
            }
            let a = owner.join().unwrap();
            {
                let d = drained.clone();
                cache.drain_all(&rcu, move |xs| d.lock().unwrap().extend(xs));
            }
            let mut all = drained.lock().unwrap().clone();
            all.extend(a);
            all.sort();
            assert_eq!(all, [1, 2]);
        });
    });
}
