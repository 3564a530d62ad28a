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

impl Stamp {
    /// The count, to keep in an atomic word ([`Stamp::from_bits`]).
    pub fn to_bits(self) -> u64 {
        self.0
    }

    /// A stamp kept with [`Stamp::to_bits`].
    pub fn from_bits(bits: u64) -> Stamp {
        Stamp(bits)
    }

    /// Whether what was read after this stamp, in an earlier read-side
    /// section, still holds at `now` (a stamp of the current section): no
    /// change was counted in between, so it is what a read now would give
    /// (or, a change in flight whose count `now` does not show yet, what
    /// a read now could give too: the caller re-checks after its next
    /// Acquire as for a fresh read, [`Generation::unchanged`]). The page
    /// table's leaf hint keeps a walk across sections with it
    /// (`pmap::LeafHint`); `tests/loom_spf.rs` fails when it does not look
    /// (`--cfg vmfault_mutation="leaf_hint_unchecked"`).
    #[inline]
    pub fn holds_at(self, now: Stamp) -> bool {
        if crate::mutated!("leaf_hint_unchecked") {
            return true;
        }
        self.0 == now.0
    }
}

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
        if crate::mutated!("generation_unchecked") {
            return true;
        }
        self.0.load(Ordering::Relaxed) == stamp.0
    }
}
