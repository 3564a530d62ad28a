//! `fork`: a new address space with a copy of this one's mappings.
//!
//! Shared mappings share their object with the child. Private memory is
//! copied lazily (copy-on-write, `object::shadow`): each private object of
//! the parent gets a new, empty shadow object in front of it for the parent
//! (one per object, so that the parent's VMAs that shared it still can
//! merge), and one per child VMA for the child (Linux's `anon_vma_fork`
//! gives each child VMA its own anon_vma); the old object becomes their
//! common backing object. The parent's private PTEs become read-only, so
//! its next write copies; the child starts with an empty page table and
//! faults its pages in from the chain, as a real child does after its
//! first access.
//!
//! Once the parent's old VMAs are retired, chains that the other side of an
//! earlier fork has left are collapsed (`Object::collapse_locked`), so
//! fork/exit cycles do not grow them. Faults of every path walk the chains:
//! the classic one under the map lock, the lockless ones validated by the
//! VMA's state, which a collapse (under retired VMAs) or a removal changes
//! first.
//!
//! Everything happens under the parent's map lock held for writing: the
//! parent's VMAs are replaced (retired: speculative faults on them abort,
//! per-VMA-lock faults are waited for) before their PTEs are narrowed, and
//! a grace period passes before the lock is released (the TLB shootdown),
//! so that no store through an old writable PTE lands after a fault of
//! another vCPU has copied the page it went to.

use crate::sync::rank::{self, Rank};
use std::sync::Arc;

use super::Gather;
use super::spares;
use super::vma::{Lookup, VmaIndex};
use super::vma::{Vma, VmaFlags};
use super::{AddressSpace, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::object::{Absorbed, Object};
use crate::stats::Counter;
use crate::types::Prot;

impl AddressSpace {
    /// Fork this address space, as `fork(2)` does a process's memory: the
    /// child gets every mapping; shared mappings stay shared, private
    /// memory is copied on the first write of either side.
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let parent = vm.new_space()?;
    /// let rw = Prot::READ | Prot::WRITE;
    /// let a = parent.mmap(0, 8192, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// parent.write(a, b"before")?;
    /// let child = parent.fork()?;
    /// child.write(a, b"child!")?;
    /// let mut buf = [0u8; 6];
    /// parent.read(a, &mut buf)?;
    /// assert_eq!(&buf, b"before");
    /// child.read(a, &mut buf)?;
    /// assert_eq!(&buf, b"child!");
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    ///
    /// Errors: `ENOMEM` when frames for the new objects' indexes run out
    /// (the parent is then unchanged).
    pub fn fork(&self) -> Result<AddressSpace> {
        let s = &self.s;
        let child = AddressSpace::new(self.vm.clone())
            .map_err(|_| Error::NoMemory { op: Op::Fork, what: "the child's page-table root" })?;
        s.vm.with_ctx(|ctx| {
            s.fork_into(ctx, &child)?;
            ctx.count(Counter::forks);
            Ok(child)
        })
    }
}

impl AddressSpace {
    /// The longest copy-on-write chain under this space's private
    /// mappings: 1 for memory that was never shared by `fork`, one more per
    /// level of shadow objects (bounded by the collapses, see `fork`).
    pub fn max_chain_depth(&self) -> u32 {
        let s = &self.s;
        // Not counted as a map-lock acquisition: statistics call this.
        s.vm.with_ctx(|ctx| {
            let map = s.map_read_all();
            let section = ctx.rcu_read();
            map.iter().filter_map(|v| v.object.get()).map(|o| o.depth(&section)).max().unwrap_or(0)
        })
    }
}

impl Space {
    /// Copy the mappings into `child`, a new, empty space of the same machine.
    fn fork_into(&self, ctx: &Ctx<'_>, child: &AddressSpace) -> Result<()> {
        let nomem = |what| Error::NoMemory { op: Op::Fork, what };
        let m = &self.vm.m;
        let mut frames = Vec::new();
        let mut absorbed = Vec::new();
        let mut narrowed = 0;
        // The heap's bounds go with the mappings, as one copy (Linux: both
        // under the mmap lock).
        let heap_held = rank::lock(&self.heap, Rank::Heap);
        let replaced = {
            let mut map = self.map_write_all(ctx);
            let vmas: Vec<Arc<Vma>> = map.iter().cloned().collect();
            // Everything that can fail comes first.
            let mut fronts: Vec<(Arc<Object>, Arc<Object>)> = Vec::new();
            let mut child_vmas = Vec::with_capacity(vmas.len());
            for v in &vmas {
                let object = match v.object.get() {
                    Some(o) if !v.is_shared() => {
                        if !fronts.iter().any(|(old, _)| Arc::ptr_eq(old, o)) {
                            let front = Object::new_shadow(ctx, o, false).map_err(|_| nomem("a shadow object"))?;
                            fronts.push((o.clone(), front));
                        }
                        Some(Object::new_shadow(ctx, o, true).map_err(|_| nomem("a shadow object"))?)
                    }
                    other => other.cloned(),
                };
                // Linux's dup_mmap: the child does not inherit VM_LOCKED.
                child_vmas.push(spares::vma(Vma::new(
                    v.start,
                    v.end,
                    v.prot,
                    v.flags - VmaFlags::LOCKED,
                    v.pgoff,
                    object,
                )));
            }
            // The parent's private VMAs move onto their new front objects;
            // the old ones are retired and their read-lockers waited for
            // before anything under them changes.
            let mut replaced = Vec::new();
            let (mut lo, mut hi) = (u64::MAX, 0);
            for v in &vmas {
                let Some((_, front)) = v.object.get().and_then(|o| fronts.iter().find(|(old, _)| Arc::ptr_eq(old, o)))
                else {
                    continue;
                };
                let new = spares::vma(Vma::new(v.start, v.end, v.prot, v.flags, v.pgoff, Some(front.clone())));
                replaced.push(map.replace_no_wait(v, new));
                (lo, hi) = (lo.min(v.start), hi.max(v.end));
            }
            map.wait_readers((lo < hi).then_some((lo, hi)));
            // Chains that the other side of an earlier fork has left collapse
            // now, before the new level goes on top. Lacking frames, a chain
            // just stays longer.
            for (old, _) in &fronts {
                if let Ok(n) = old.collapse_locked(&map, ctx, &mut frames, &mut absorbed) {
                    ctx.count_n(Counter::shadow_collapses, u64::from(n));
                }
            }
            // Their pages are now shared with the child: read-only (and
            // still readable: on x86 a writable mapping is a readable one,
            // so a write-only mapping keeps its PTEs, as Linux's do).
            for v in &replaced {
                if v.prot.contains(Prot::WRITE) {
                    let ro = (v.prot - Prot::WRITE) | Prot::READ;
                    narrowed += self
                        .pmap
                        .protect(&m.phys, v.start, v.end, ro, |a, pte| super::pte_cleared(m, self.id(), a, pte));
                }
            }
            // Before any fault can copy a page narrowed here.
            map.shootdown(ctx, narrowed);
            let mut cmap = child.s.map_write_unreachable(ctx);
            for v in child_vmas {
                cmap.insert(v);
            }
            replaced
        };
        let heap = *heap_held;
        drop(heap_held);
        // Nobody else reaches the child yet.
        *rank::lock(&child.s.heap, Rank::Heap) = heap;
        let mut g = Gather::default();
        g.frames.append(&mut frames);
        self.finish(ctx, g);
        Absorbed::release(absorbed, &m.rcu);
        drop(replaced);
        Ok(())
    }
}
