//! Stacks that grow down (`MAP_GROWSDOWN`, Linux's `VM_GROWSDOWN`).
//!
//! A private anonymous mapping made with `MAP_GROWSDOWN` is a stack: a
//! fault at an address below it with nothing mapped there extends it down
//! to the faulting page, as Linux's `lock_mm_and_find_vma` and
//! `expand_downwards` do, unless
//! - the address is below `mmap_min_addr`;
//! - the mapping below it, if that one does not grow down itself and
//!   allows some access, ends less than [`STACK_GUARD_GAP`] below the new
//!   start (Linux's `stack_guard_gap`, 256 pages);
//! - the stack would become larger than [`STACK_LIMIT`] (Linux's default
//!   `RLIMIT_STACK`, 8 MiB).
//!
//! Then the fault goes on as any other in the grown mapping (a stack
//! without the access's permission grows, then the access fails with
//! `SEGV_ACCERR`, as in Linux). A forced access (a debugger's) grows one
//! too: Linux's `/proc/PID/mem` expands a stack when its page lookup fails
//! (`__access_remote_vm`), though `get_user_pages` alone no longer does.
//!
//! The guard gap also keeps placement away: a mapping placed without
//! `MAP_FIXED` (and a `brk` that grows) never comes within the gap below a
//! stack (Linux's `vm_start_gap`, used by the gap search in `layout.rs`
//! through `zones::Gaps`). `MAP_FIXED` ignores it, as in Linux.
//!
//! A growth replaces the stack's VMA by a longer one, under the map write
//! lock of the zones from the bottom of the guard gap to the stack (the
//! lockless fault paths see the old one retired and fall back). The new
//! pages' offsets in its object get holes first, as `mremap`'s growth in
//! place does, so nothing an object below holds there shows. The stack
//! does not merge with the mapping below (Linux's growth merges nothing).

use super::vma::{Lookup, Removed, Vma, VmaFlags, VmaIndex};
use super::{Gather, Space, spares};
use crate::machine::Ctx;
use crate::stats::Counter;
use crate::types::{MMAP_MIN_ADDR, PAGE_SHIFT, PAGE_SIZE, TASK_SIZE};

/// Linux's `stack_guard_gap` (its default, 256 pages): the least distance
/// a stack keeps from an accessible mapping below it.
pub const STACK_GUARD_GAP: u64 = 256 * PAGE_SIZE;

/// The most a stack may grow to: Linux's default `RLIMIT_STACK` (8 MiB).
pub const STACK_LIMIT: u64 = 8 << 20;

/// Where `v` begins for placement (Linux's `vm_start_gap`): a stack's
/// guard gap below it is taken.
#[inline]
pub(crate) fn start_gap(v: &Vma) -> u64 {
    if v.flags.contains(VmaFlags::GROWSDOWN) { v.start.saturating_sub(STACK_GUARD_GAP) } else { v.start }
}

/// How far above `end` a stack's guard gap may reach down to `end`.
pub(crate) fn above_gap(end: u64) -> u64 {
    end.saturating_add(STACK_GUARD_GAP).min(TASK_SIZE)
}

impl Space {
    /// Grow the stack above `addr`, if there is one, down to `addr`'s page
    /// (see the module docs); true if `addr` is mapped now (grown here, or
    /// by another vCPU meanwhile), false if the fault is a `SEGV_MAPERR`.
    ///
    /// Must be called with no map lock held.
    pub(crate) fn grow_stack(&self, ctx: &Ctx<'_>, addr: u64) -> bool {
        let addr = addr & !(PAGE_SIZE - 1);
        if !(MMAP_MIN_ADDR..TASK_SIZE).contains(&addr) {
            return false;
        }
        // A few tries: the mapping above may change between the look and
        // the lock (then the lock may not cover it: look again).
        for _ in 0..4 {
            if let Some(grown) = self.try_grow_stack(ctx, addr) {
                return grown;
            }
        }
        false
    }

    /// One try of [`grow_stack`](Space::grow_stack) for the page `addr`:
    /// none if the mapping above changed before the lock was taken.
    fn try_grow_stack(&self, ctx: &Ctx<'_>, addr: u64) -> Option<bool> {
        // The mapping above, as published (or, where nothing is, under the
        // map lock): a stack that may reach `addr` starts below `addr +
        // STACK_LIMIT`.
        let reach = addr.saturating_add(STACK_LIMIT).min(TASK_SIZE);
        let above = if self.publish {
            let section = ctx.rcu_read();
            self.zones.published(&section).first_in(addr, reach)
        } else {
            let map = self.map_read(ctx, addr, reach);
            map.find_from(addr).filter(|v| v.start < reach).map(|v| (v.start, v.flags))
        };
        let Some((top, flags)) = above else { return Some(false) };
        if top <= addr {
            return Some(true);
        }
        if !flags.contains(VmaFlags::GROWSDOWN) {
            return Some(false);
        }
        let _busy = self.zones.busy(ctx.index.min(self.zones.cpus.len() - 1));
        let mut g = Gather::default();
        let mut replaced = Removed::new();
        let grown = {
            let mut map = self.map_write(ctx, addr.saturating_sub(STACK_GUARD_GAP), top);
            let Some(vma) = map.find_from(addr).cloned() else { return Some(false) };
            if vma.start <= addr {
                return Some(true);
            }
            if vma.start != top {
                // Not the mapping the lock was taken for.
                return None;
            }
            if !vma.flags.contains(VmaFlags::GROWSDOWN) || vma.end - addr > STACK_LIMIT {
                return Some(false);
            }
            // `expand_downwards`: the guard gap above an accessible mapping
            // that does not grow down itself.
            if let Some(prev) = map.prev_of(addr)
                && !prev.flags.contains(VmaFlags::GROWSDOWN)
                && !prev.prot.is_empty()
                && addr - prev.end < STACK_GUARD_GAP
            {
                return Some(false);
            }
            let grow = (vma.start - addr) >> PAGE_SHIFT;
            if grow > vma.pgoff {
                return Some(false);
            }
            // Linux's `expand_downwards` gives the stack its anon_vma
            // before it grows (so from a neighbour of the old range only):
            // its object here. Out of memory, it gets one at its first
            // write fault instead.
            let _ = crate::fault::prepare_object_locked(ctx, self, &map, &vma);
            let pgoff = vma.pgoff - grow;
            if let Some(o) = vma.object.get().filter(|_| !vma.is_shared()) {
                if o.reserve_holes(ctx, pgoff, vma.pgoff).is_err() {
                    return Some(false);
                }
                o.punch_locked(&map, ctx, pgoff, vma.pgoff, &mut g.frames);
            }
            let longer = Vma::new(addr, vma.end, vma.prot, vma.flags, pgoff, vma.object.get().cloned());
            replaced.push(map.remove(&vma));
            map.put(spares::vma(longer));
            true
        };
        if grown {
            ctx.count(Counter::stack_growths);
        }
        self.end_removal(ctx, g, Removed::new());
        replaced.into_iter().for_each(spares::release_vma);
        Some(grown)
    }
}
