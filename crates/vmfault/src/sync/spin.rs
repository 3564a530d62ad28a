//! A one-word lock: the PTE lock (`[P]`), kept in the page descriptor of a
//! page-table page like Linux's split PTE lock.
//!
//! Test-and-test-and-set with a bounded spin, then yields: a holder that the
//! host preempted must get the core back. `try_lock` is what the speculative
//! fault path uses (it must never wait while it cannot be sure the table is
//! still live).

use super::atomic::{AtomicU32, Ordering};
use super::rank::{Rank, RankGuard};

/// A held word lock; unlocks on drop.
#[must_use = "the lock is released when the guard is dropped"]
#[derive(Debug)]
pub struct WordGuard<'a> {
    word: &'a AtomicU32,
    // Released after the word (fields drop in order).
    _rank: RankGuard,
}

/// Try once to take the lock (a lock outside the rank hierarchy: the
/// loom models' and unit tests'; the crate takes its locks ranked).
#[cfg(any(test, loom))]
#[inline]
pub fn try_lock(word: &AtomicU32) -> Option<WordGuard<'_>> {
    // Acquire: as in `try_lock_as`.
    word.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
        .ok()
        .map(|_| WordGuard { word, _rank: RankGuard::none() })
}

/// Take the lock, waiting if needed; also says whether it had to wait
/// (unranked, as [`try_lock`]).
#[cfg(any(test, loom))]
#[inline]
pub fn lock(word: &AtomicU32) -> (WordGuard<'_>, bool) {
    lock_ranked(word, RankGuard::none())
}

/// Try once to take a lock of the hierarchy's class `rank` (checked in
/// debug builds: `sync::rank`).
#[inline]
pub(crate) fn try_lock_as(word: &AtomicU32, rank: Rank) -> Option<WordGuard<'_>> {
    // Acquire pairs with the Release in `WordGuard::drop` of the previous
    // holder. The rank is recorded only once the lock is ours (a try never
    // waits, so it is not checked itself).
    word.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
        .ok()
        .map(|_| WordGuard { word, _rank: RankGuard::entered_by_try(rank) })
}

/// Take a lock of the hierarchy's class `rank`, waiting if needed; also
/// says whether it had to wait.
#[inline]
pub(crate) fn lock_as(word: &AtomicU32, rank: Rank) -> (WordGuard<'_>, bool) {
    lock_ranked(word, RankGuard::enter(rank))
}

#[inline]
fn lock_ranked(word: &AtomicU32, rank: RankGuard) -> (WordGuard<'_>, bool) {
    if word.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok() {
        return (WordGuard { word, _rank: rank }, false);
    }
    let mut spins = 0;
    loop {
        super::backoff(&mut spins);
        // Acquire: as in `try_lock_as`.
        if word.load(Ordering::Relaxed) == 0
            && word.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_ok()
        {
            return (WordGuard { word, _rank: rank }, true);
        }
    }
}

impl Drop for WordGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        // Release: the critical section happens-before the next Acquire CAS.
        self.word.store(0, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes() {
        let w = AtomicU32::new(0);
        let g = try_lock(&w).unwrap();
        assert!(try_lock(&w).is_none());
        drop(g);
        assert!(try_lock(&w).is_some());
    }

    #[test]
    fn counts_under_contention() {
        let w = Arc::new((AtomicU32::new(0), std::sync::atomic::AtomicU64::new(0)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        let (_g, _) = lock(&w.0);
                        // Non-atomic-style read-modify-write under the lock.
                        let v = w.1.load(Ordering::Relaxed);
                        w.1.store(v + 1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(w.1.load(Ordering::Relaxed), 40_000);
    }
}
