//! A change count: how a lockless reader learns that something it read
//! before another read may be stale.
//!
//! The page table's count of prunes (`pmap::table::Missed`) is one: the
//! software MMU walks the page table before the speculative fault reads
//! the VMA snapshot, and the fault uses the walked PTE slot only if no
//! page-table page was detached in between.
//!
//! # Protocol
//! A writer makes its change (detaches a table page), then [`bump`]s
//! (Release), before it publishes anything (Release) that a reader may
//! see after the walk. A reader takes a [`stamp`] (Acquire) before its
//! first read, reads, then reads the published thing (Acquire), then asks
//! [`unchanged`]:
//!
//! - a stamp that shows the bump synchronizes with it: the first read
//!   sees the change;
//! - a stamp from before the bump, with a later publication seen, is not
//!   unchanged: the publication's Acquire orders the bump before the
//!   second load of the count.
//!
//! `tests/loom_spf.rs` checks this with the page table's use of it, and
//! fails when `unchanged` does not look (`--cfg
//! vmfault_mutation="generation_unchecked"`).
//!
//! [`bump`]: Generation::bump
//! [`stamp`]: Generation::stamp
//! [`unchanged`]: Generation::unchanged

use super::atomic::{AtomicU64, Ordering};

/// A count of changes. See the module docs.
#[derive(Debug, Default)]
pub struct Generation(AtomicU64);

/// The count a reader saw before its first read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp(u64);

impl Generation {
    /// No change yet.
    pub fn new() -> Generation {
        Generation(AtomicU64::new(0))
    }

    /// Count a change, made before this call and published after it.
    /// Release pairs with the Acquire of `stamp`.
    #[inline]
    pub fn bump(&self) {
        self.0.fetch_add(1, Ordering::Release);
    }

    /// The count now, before the reads it guards (Acquire).
    #[inline]
    pub fn stamp(&self) -> Stamp {
        Stamp(self.0.load(Ordering::Acquire))
    }

    /// Whether no change was counted since `stamp`. Relaxed: the caller's
    /// Acquire read of what the writer published orders this load after it.
    #[inline]
    pub fn unchanged(&self, stamp: Stamp) -> bool {
        if cfg!(vmfault_mutation = "generation_unchecked") {
            return true;
        }
        self.0.load(Ordering::Relaxed) == stamp.0
    }
}
