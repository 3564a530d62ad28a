//! Reverse-map walks: every PTE, in every space, that maps a page
//! (`object::rmap` keeps the metadata). Users: the write-back of shared
//! file pages (write-protect before writing, `object/file.rs`),
//! `unmap_everywhere` (removal of a page from every mapping, which
//! truncation needs) and the page daemon (`reclaim`), which also finds
//! its candidate pages through the spaces' mappings here.
//!
//! The page daemon takes no map lock at all: a vCPU may hold one while it
//! waits for the daemon to free a frame (`reclaim`). It walks the page
//! tables inside a read-side section of its own instead, which keeps them
//! allocated as it does for speculative faults (page-table pages are freed
//! after a grace period); a table that `munmap` is pruning meanwhile has
//! no PTE left that maps the page. Linux's rmap walks likewise take the
//! page-table locks and no `mmap_lock`.
//!
//! With backing records the candidates come from the object's records and
//! its shadows'; with pv entries, from the page's list. Either way each
//! candidate PTE is checked, under its PTE lock, to map the page before it
//! is changed: a record covers a range, not a page, and a list may name a
//! PTE that a racing fault is replacing.

use std::sync::Arc;

use super::vma::Lookup;
use super::{AddressSpace, Space};
use crate::config::Rmap;
use crate::machine::Machine;
use crate::object::{ObjRmap, Object};
use crate::phys::Pfn;
use crate::pmap::Pte;
use crate::stats::Counter;
use crate::types::{PAGE_SIZE, Prot};

/// The (space, address) pairs that may map `pfn`, page `pindex` of `o`.
fn candidates(m: &Machine, o: &Arc<Object>, pindex: u64, pfn: Pfn) -> Vec<(Arc<Space>, u64)> {
    let found: Vec<(u64, u64)> = match m.config.rmap {
        Rmap::Backing => ObjRmap::mappings_of(o, pindex),
        Rmap::PvEntry => m.pv.entries(pfn).iter().map(|pv| (pv.space, pv.addr)).collect(),
    };
    // Both name spaces by id (no reference: a count every vCPU of the space
    // would write per mapping), found here in the machine's registry.
    found.into_iter().filter_map(|(id, addr)| Some((Space::by_id(m, id)?, addr))).collect()
}

/// Apply `f` to every PTE that maps one of `pages` (index in `o`, frame),
/// under its PTE lock; returns the PTEs changed.
fn for_each_pte(m: &Machine, o: &Arc<Object>, pages: &[(u64, Pfn)], mut f: impl FnMut(u64, u64, Pte) -> Pte) -> u64 {
    let phys = &m.phys;
    let mut changed = 0;
    for &(pindex, pfn) in pages {
        for (space, addr) in candidates(m, o, pindex, pfn) {
            let id = space.id();
            // The space's map lock keeps its page tables from being pruned
            // and freed under the walk (no RCU section here: callers may
            // have no vCPU). Callers hold no map lock.
            let _map = space.map_read_uncounted(addr, addr + PAGE_SIZE);
            changed += space.pmap.update_range(phys, addr, addr + PAGE_SIZE, |a, old| {
                if old.pfn() == pfn { f(id, a, old) } else { old }
            });
        }
    }
    changed
}

/// The page daemon's unmap of page `pindex` (frame `pfn`) of `o` from
/// every space, reading as `reader` and taking no map lock (see the module
/// docs); returns the PTEs cleared. The caller has isolated the page (no
/// new mapping of it can appear) and waits for a grace period afterwards.
/// The references to the spaces it found are pushed onto `found`: the
/// daemon may hold the last one, whose end takes map locks, so the caller
/// chooses where they are dropped (the daemon's reaper thread).
pub(crate) fn unmap_everywhere_unlocked(
    m: &Machine,
    reader: &crate::sync::rcu::RcuReader,
    o: &Arc<Object>,
    pindex: u64,
    pfn: Pfn,
    found: &mut Vec<Box<dyn Send>>,
) -> u64 {
    let spaces = candidates(m, o, pindex, pfn);
    let section = m.rcu.read_lock(reader);
    let mut cleared = 0;
    for (space, addr) in &spaces {
        let id = space.id();
        cleared += space.pmap.update_range(&m.phys, *addr, addr + PAGE_SIZE, |a, old| {
            if old.pfn() == pfn {
                super::pte_cleared(m, id, a, old);
                Pte::NONE
            } else {
                old
            }
        });
    }
    drop(section);
    found.extend(spaces.into_iter().map(|(s, _)| Box::new(s) as Box<dyn Send>));
    cleared
}

/// Make every PTE that maps one of `pages` read-only, then wait for a grace
/// period: no store through one is in flight afterwards. The wait is
/// needed even when no PTE was writable here: a PTE that `munmap`,
/// `mprotect` or `MADV_DONTNEED` cleared or narrowed a moment ago may still
/// have a store in flight. Returns the PTEs narrowed. Needs no vCPU context
/// (a space being dropped calls it); the caller holds no map lock.
pub(super) fn write_protect_everywhere(m: &Machine, o: &Arc<Object>, pages: &[(u64, Pfn)]) -> u64 {
    let narrowed = for_each_pte(m, o, pages, |_, _, old| old.restricted(Prot::READ | Prot::EXEC));
    if !pages.is_empty() {
        m.rcu.grace_period();
    }
    narrowed
}

impl AddressSpace {
    /// Unmap the page that backs `addr` in this space from *every* space
    /// that maps it (clear each PTE found through the reverse map), as the
    /// page daemon does before it reclaims a page. The page stays in its
    /// object, so the next access faults it back in. Returns the PTEs
    /// cleared, 0 if nothing is mapped at `addr`.
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let a = vm.new_space()?;
    /// let b = vm.new_space()?;
    /// let rw = Prot::READ | Prot::WRITE;
    /// let p = a.mmap(0, 4096, rw, MapFlags::SHARED | MapFlags::ANONYMOUS)?;
    /// a.write(p, b"shared")?;
    /// let child = a.fork()?; // shares the page
    /// child.read(p, &mut [0u8; 6])?;
    /// assert_eq!(a.unmap_everywhere(p)?, 2);
    /// let mut buf = [0u8; 6];
    /// child.read(p, &mut buf)?; // faults it back in
    /// assert_eq!(&buf, b"shared");
    /// # drop(b);
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn unmap_everywhere(&self, addr: u64) -> crate::Result<u64> {
        let s = &self.s;
        s.vm.with_ctx(|ctx| {
            let found = {
                let map = s.map_read(ctx, addr, addr + PAGE_SIZE);
                let section = ctx.rcu_read();
                let v = map.find(addr);
                let pte = s.pmap.translate(&ctx.env.phys, addr, crate::Access::Read);
                v.and_then(|v| Some((v.object.get()?.clone(), v.pindex(addr), pte?)))
                    .map(|(o, i, pfn)| (owner_of(&o, i, pfn, &section), i, pfn))
            };
            let Some((o, pindex, pfn)) = found else { return Ok(0) };
            ctx.count(Counter::rmap_walks);
            let cleared = for_each_pte(ctx.m, &o, &[(pindex, pfn)], |id, a, old| {
                super::pte_cleared(ctx.m, id, a, old);
                Pte::NONE
            });
            ctx.count_n(Counter::pages_unmapped, cleared);
            if cleared > 0 {
                ctx.count(Counter::tlb_shootdowns);
                ctx.env.rcu.grace_period();
            }
            Ok(cleared)
        })
    }
}

/// How many PTEs, in every space, map `pfn`, page `pindex` of `owner`
/// (the object that holds it): Linux's `page_mapcount`, which smaps'
/// `Pss` and its shared and private figures divide by. Each candidate is
/// counted once, and only if its PTE maps the page now. Call with no RCU
/// section open (the candidates hold spaces, whose last reference may go
/// here).
pub(super) fn mapcount(ctx: &crate::machine::Ctx<'_>, owner: &Arc<Object>, pindex: u64, pfn: Pfn) -> u64 {
    let m = ctx.m;
    let mut found = candidates(m, owner, pindex, pfn);
    found.sort_by_key(|(s, a)| (s.id(), *a));
    found.dedup_by_key(|(s, a)| (s.id(), *a));
    let n = {
        // Page-table pages are freed after a grace period: this section
        // keeps every candidate's tables readable.
        let _section = ctx.rcu_read();
        found
            .iter()
            .filter(|(s, a)| {
                let pte = s.pmap.pte_now(&m.phys, *a);
                pte.is_present() && pte.pfn() == pfn
            })
            .count()
    };
    drop(found);
    n as u64
}

/// The object in `top`'s chain that holds `pfn` at `pindex` (the walk
/// starts there: its records and everything above it).
pub(super) fn owner_of(
    top: &Arc<Object>,
    pindex: u64,
    pfn: Pfn,
    section: &crate::sync::rcu::RcuReadGuard<'_>,
) -> Arc<Object> {
    let mut o = top.clone();
    loop {
        if o.holds(pindex, pfn) {
            return o;
        }
        match o.below(section) {
            Some(b) => o = b,
            None => return top.clone(),
        }
    }
}
