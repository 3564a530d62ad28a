//! Where new mappings go: Linux's top-down layout without randomization.
//!
//! A hint is used as is when the range is free (`mmap_address_hint_valid`);
//! otherwise the highest gap below `MMAP_BASE` that fits is taken, and if
//! there is none, the lowest gap above `TASK_UNMAPPED_BASE` (Linux's
//! fallback to the bottom-up allocator).
//!
//! The search asks the index for the VMAs nearest a candidate range
//! (`zones::Gaps`): O(number of VMAs above the gap) lookups. Linux keeps
//! the largest gap of each subtree in its maple tree to make this
//! O(log n); with the handful of VMAs of our workloads the walk wins. The
//! index is the locked one, or with `map_lock=zoned` the zones' published
//! snapshots, read with no lock (`zones.rs`, "Placement").

use super::zones::Gaps;
use crate::types::{MMAP_MIN_ADDR, PAGE_SIZE, TASK_SIZE};

/// The top of the top-down area: `TASK_SIZE` minus Linux's minimum stack
/// gap of 128 MiB (no randomization).
pub(crate) const MMAP_BASE: u64 = TASK_SIZE - (128 << 20);
/// The start of the bottom-up fallback area (`TASK_SIZE / 3`, page-aligned).
pub(crate) const TASK_UNMAPPED_BASE: u64 = (TASK_SIZE / 3) & !(PAGE_SIZE - 1);

/// Linux's `round_hint_to_min`: a non-zero hint below `mmap_min_addr`
/// moves up to it; hints are page-aligned downwards.
pub(crate) fn round_hint(hint: u64) -> u64 {
    let hint = hint & !(PAGE_SIZE - 1);
    if hint != 0 && hint < MMAP_MIN_ADDR { MMAP_MIN_ADDR } else { hint }
}

/// A free range of `len` bytes (page-aligned, `len <= TASK_SIZE`), at
/// `hint` when possible, else the highest below `high` (`MMAP_BASE` for
/// Linux's answer), else the lowest above `TASK_UNMAPPED_BASE`.
pub(crate) fn unmapped_area(index: &impl Gaps, hint: u64, len: u64, high: u64) -> Option<u64> {
    if hint != 0 && hint <= TASK_SIZE - len && index.lowest_in(hint, hint + len).is_none() {
        return Some(hint);
    }
    top_down(index, len, MMAP_MIN_ADDR, high).or_else(|| bottom_up(index, len, TASK_UNMAPPED_BASE, TASK_SIZE))
}

/// The highest `len`-byte gap inside `low..high`.
pub(crate) fn top_down(index: &impl Gaps, len: u64, low: u64, high: u64) -> Option<u64> {
    let mut gap_end = high;
    loop {
        if gap_end < low.checked_add(len)? {
            return None;
        }
        // The highest VMA in the way of the highest candidate: the gap
        // above it is too small, so look below it.
        match index.highest_in(gap_end - len, gap_end) {
            None => return Some(gap_end - len),
            Some((start, _)) => gap_end = start,
        }
    }
}

/// The lowest `len`-byte gap inside `low..high`.
fn bottom_up(index: &impl Gaps, len: u64, low: u64, high: u64) -> Option<u64> {
    let mut gap_start = low;
    loop {
        if gap_start.checked_add(len)? > high {
            return None;
        }
        match index.lowest_in(gap_start, gap_start + len) {
            None => return Some(gap_start),
            Some((_, end)) => gap_start = end,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::aspace::vma::{Vma, VmaFlags, VmaIndex, VmaTree};
    use crate::types::Prot;
    use std::sync::Arc;

    const P: u64 = PAGE_SIZE;

    fn tree(ranges: &[(u64, u64)]) -> VmaTree {
        let mut t = VmaTree::default();
        for &(s, e) in ranges {
            t.insert(Arc::new(Vma::new(s, e, Prot::READ, VmaFlags::empty(), s >> 12, None)));
        }
        t
    }

    #[test]
    fn top_down_below_base_and_hints() {
        let t = tree(&[]);
        assert_eq!(unmapped_area(&t, 0, 2 * P, MMAP_BASE), Some(MMAP_BASE - 2 * P));
        let t = tree(&[(MMAP_BASE - 2 * P, MMAP_BASE)]);
        assert_eq!(unmapped_area(&t, 0, P, MMAP_BASE), Some(MMAP_BASE - 3 * P));
        // A free hint is honoured, an occupied one is not.
        assert_eq!(unmapped_area(&t, 0x10_0000, P, MMAP_BASE), Some(0x10_0000));
        assert_eq!(unmapped_area(&t, MMAP_BASE - P, P, MMAP_BASE), Some(MMAP_BASE - 3 * P));
        // A hole between mappings that fits is used, one that does not is skipped.
        let t = tree(&[(MMAP_BASE - 10 * P, MMAP_BASE - 8 * P), (MMAP_BASE - 7 * P, MMAP_BASE)]);
        assert_eq!(unmapped_area(&t, 0, P, MMAP_BASE), Some(MMAP_BASE - 8 * P));
        assert_eq!(unmapped_area(&t, 0, 2 * P, MMAP_BASE), Some(MMAP_BASE - 12 * P));
    }

    #[test]
    fn falls_back_to_bottom_up() {
        // Everything from MMAP_MIN_ADDR up to MMAP_BASE taken.
        let t = tree(&[(MMAP_MIN_ADDR, MMAP_BASE)]);
        assert_eq!(unmapped_area(&t, 0, P, MMAP_BASE), Some(MMAP_BASE));
        let t = tree(&[(MMAP_MIN_ADDR, TASK_SIZE)]);
        assert_eq!(unmapped_area(&t, 0, P, MMAP_BASE), None);
        assert_eq!(round_hint(5), 0);
        assert_eq!(round_hint(0x1000), MMAP_MIN_ADDR);
        assert_eq!(round_hint(0x12345678), 0x12345000);
    }
}
