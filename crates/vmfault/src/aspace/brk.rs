//! `brk`: the space's heap, as Linux keeps it (`mm->start_brk`,
//! `mm->brk`, and the `brk` system call of `mm/mmap.c`).
//!
//! The heap is a range `start..brk` that grows and shrinks at its top. It
//! grows by an anonymous, private, read-write mapping of the new pages
//! (which merges with the mapping below it only if that one reaches above
//! the heap's start, as Linux's `do_brk_flags` merges only with the heap's
//! own last mapping), and only if one page above the new top stays free:
//! the gap Linux keeps between the heap and the next mapping. It shrinks
//! by unmapping the pages above the new top, and only if something is
//! mapped there. The break itself need not be page-aligned; the mapping
//! covers it rounded up to a page.
//!
//! Calls serialize on the space's heap lock `[H]`, taken before the map
//! lock; a grow checks its gap and maps under one hold of the map lock of
//! the zones around it.

use super::spares;
use super::vma::{Lookup, Vma, VmaFlags, VmaIndex};
use super::zones::Gaps;
use super::{AddressSpace, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::sync::rank::{self, Rank};
use crate::types::{MMAP_MIN_ADDR, PAGE_SHIFT, PAGE_SIZE, Prot, TASK_SIZE, is_page_aligned, page_align_up};

/// Where a new space's heap starts: just above where Linux loads a
/// position-independent executable with address randomization off
/// (`0x5555_5555_4000`), on a 2 MiB boundary. Set it with
/// [`AddressSpace::set_heap_start`], as an ELF loader sets `start_brk`.
pub const HEAP_START: u64 = 0x5555_5560_0000;

/// The heap's bounds (`[H]`: inside the space's heap lock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Heap {
    /// `mm->start_brk`: the break never goes below it.
    pub(crate) start: u64,
    /// `mm->brk`: the current break (any byte address).
    pub(crate) brk: u64,
}

impl Default for Heap {
    fn default() -> Heap {
        Heap { start: HEAP_START, brk: HEAP_START }
    }
}

impl AddressSpace {
    /// Linux's `brk(2)`: move the end of the heap to `addr`; returns the
    /// break after the call, which is `addr` on success and the break
    /// before it on failure (as the system call does: it has no error).
    /// `brk(0)` (or any address below the heap's start) asks for the
    /// current break.
    ///
    /// Growing maps the new pages anonymous, private and read-write (they
    /// read as zeros), and fails if anything is mapped in them or in the
    /// page above them. Shrinking unmaps the pages above the new break,
    /// and fails if nothing is mapped there. Linux's `RLIMIT_DATA` and
    /// `mlockall(MCL_FUTURE)` are not modelled.
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig};
    /// let vm = Vm::new(VmConfig { phys_bytes: 8 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let start = space.brk(0);
    /// assert_eq!(space.brk(start + 10_000), start + 10_000);
    /// space.write(start + 9_999, &[7])?; // the heap's third page
    /// assert_eq!(space.brk(start + 4096), start + 4096);
    /// assert!(space.write(start + 9_999, &[7]).is_err(), "unmapped again");
    /// assert_eq!(space.brk(start - 4096), start + 4096, "below the start: refused");
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn brk(&self, addr: u64) -> u64 {
        let s = &self.s;
        s.vm.with_ctx(|ctx| s.brk(ctx, addr))
    }

    /// Where the heap starts and where its break is now (Linux's
    /// `start_brk` and `brk`, as `/proc/PID/stat` shows them).
    pub fn heap(&self) -> (u64, u64) {
        let h = *rank::lock(&self.s.heap, Rank::Heap);
        (h.start, h.brk)
    }

    /// Start the heap at `addr`, with an empty heap there (the break at
    /// `addr` too), as an ELF loader sets `start_brk` after the program's
    /// data, or `prctl(PR_SET_MM_START_BRK)` and `PR_SET_MM_BRK` do. What
    /// the old heap mapped stays mapped.
    ///
    /// Errors: `addr` not page-aligned, below `MMAP_MIN_ADDR` or above
    /// `TASK_SIZE` (`EINVAL`).
    pub fn set_heap_start(&self, addr: u64) -> Result<()> {
        let op = Op::Brk;
        if !is_page_aligned(addr) {
            return Err(Error::inval(op, "heap start not page-aligned", addr));
        }
        if !(MMAP_MIN_ADDR..=TASK_SIZE).contains(&addr) {
            return Err(Error::inval(op, "heap start outside the user address space", addr));
        }
        *rank::lock(&self.s.heap, Rank::Heap) = Heap { start: addr, brk: addr };
        Ok(())
    }
}

impl Space {
    fn brk(&self, ctx: &Ctx<'_>, want: u64) -> u64 {
        let mut heap = rank::lock(&self.heap, Rank::Heap);
        let Heap { start, brk } = *heap;
        if want < start {
            return brk;
        }
        // `PAGE_ALIGN` of Linux wraps to 0 near the top; both fail there.
        let (Some(new), Some(old)) = (page_align_up(want), page_align_up(brk)) else { return brk };
        let done = if new == old {
            true
        } else if want <= brk {
            self.shrink_heap(ctx, new, old)
        } else {
            new <= TASK_SIZE && self.grow_heap(ctx, start, old, new)
        };
        if done {
            heap.brk = want;
        }
        heap.brk
    }

    /// Unmap `new..old`, the pages above the new break; refused if nothing
    /// is mapped there (Linux: "mapping intersects with an existing
    /// non-brk vma", found by `vma_find` from the new top).
    fn shrink_heap(&self, ctx: &Ctx<'_>, new: u64, old: u64) -> bool {
        if !self.map_read_all().intersects(new, old) {
            return false;
        }
        // A concurrent munmap of the range between the look and this one
        // leaves the same result as if it had come after.
        self.munmap(ctx, new, old - new).is_ok()
    }

    /// Map `old..new` for the heap if nothing is mapped from `old` to a
    /// page above `new` (Linux checks `newbrk + PAGE_SIZE` against the
    /// next mapping's start, less its guard gap if it is a stack: see
    /// `stack.rs`).
    fn grow_heap(&self, ctx: &Ctx<'_>, start: u64, old: u64, new: u64) -> bool {
        let mut map = self.map_write(ctx, old, self.zones.gap_reach(new + PAGE_SIZE));
        if map.lowest_in(old, new + PAGE_SIZE).is_some() || self.check_count(Op::Brk).is_err() {
            return false;
        }
        let flags = VmaFlags::ACCOUNT;
        map.insert(spares::vma(Vma::new(old, new, Prot::READ | Prot::WRITE, flags, old >> PAGE_SHIFT, None)));
        // `do_brk_flags` extends the heap's own last mapping only: one
        // that ends at the old top and reaches above the heap's start.
        let retired = if old > start { map.merge_range(old, old) } else { Default::default() };
        drop(map);
        // The one just inserted, if it merged, was never published: a spare.
        retired.into_iter().for_each(spares::release_vma);
        true
    }
}
