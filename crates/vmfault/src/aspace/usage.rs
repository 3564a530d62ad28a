//! What each mapping uses: the fields of Linux's `/proc/PID/smaps` that
//! vmfault has (`Rss`, `Pss`, `Shared_Clean`, `Shared_Dirty`,
//! `Private_Clean`, `Private_Dirty`, `Anonymous`, `Swap`, `Locked`, and the
//! file and offset columns of `/proc/PID/maps`).
//!
//! Counted by walking each mapping's pages under the map lock for reading
//! (each page in its own read-side section), then, for each resident page,
//! the PTEs that map it in every space (a reverse-map walk: Linux's
//! `page_mapcount`): the time grows with the size of the mappings and the
//! sharing, as reading `smaps` does in Linux. A figure is a snapshot;
//! faults and the page daemon go on meanwhile.
//!
//! A page is shared when more than one PTE maps it, dirty when a store
//! went through its PTE, when it is a file page not yet written back, or
//! when it is anonymous memory of a private mapping (Linux keeps such a
//! page dirty but for two cases vmfault does not track: a page read back
//! from swap and not written since, and one `MADV_FREE` gave back).

use super::vma::{Lookup, Vma};
use super::{AddressSpace, Space};
use crate::machine::Ctx;
use crate::object::Found;
use crate::types::{MappingInfo, PAGE_SIZE};

/// A file mapping's file and where in it the mapping starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileRange {
    /// The file's device, as `stat` gives it (`st_dev`).
    pub dev: u64,
    /// The file's inode number (`st_ino`).
    pub ino: u64,
    /// The byte offset in the file of the mapping's first page.
    pub offset: u64,
}

/// What one mapping uses, as Linux's `/proc/PID/smaps` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MappingUsage {
    /// The mapping.
    pub info: MappingInfo,
    /// A file mapping's file; `None` for anonymous memory.
    pub file: Option<FileRange>,
    /// `Rss`: bytes of pages mapped by present PTEs (the shared zero page
    /// not counted, as Linux does not).
    pub rss: u64,
    /// `Anonymous`: of those, bytes of a private mapping's anonymous pages
    /// (written private pages, private copies of file pages; not the
    /// file's own pages, not shared memory).
    pub anonymous: u64,
    /// `Swap`: bytes paged out to swap that a fault in this mapping would
    /// read back.
    pub swap: u64,
    /// `Locked`: `pss` of an `mlock`ed mapping, 0 otherwise.
    pub locked: u64,
    /// `Pss`: each resident page's size divided by the number of PTEs
    /// that map it, in every space (bytes, rounded down as Linux's kB
    /// figure is).
    pub pss: u64,
    /// `Shared_Clean`: bytes of resident pages more than one PTE maps, clean.
    pub shared_clean: u64,
    /// `Shared_Dirty`: the same, dirty.
    pub shared_dirty: u64,
    /// `Private_Clean`: bytes of resident pages only this PTE maps, clean.
    pub private_clean: u64,
    /// `Private_Dirty`: the same, dirty.
    pub private_dirty: u64,
}

impl AddressSpace {
    /// Every mapping with what it uses (`/proc/PID/smaps`), in address
    /// order. Walks every page of every mapping.
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let a = space.mmap(0, 4 * 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// space.write(a, &[1; 8192])?;      // two pages of its own
    /// space.read(a + 8192, &mut [0; 1])?; // the zero page: not counted
    /// let u = &space.usage()[0];
    /// assert_eq!((u.rss, u.anonymous, u.swap, u.locked), (8192, 8192, 0, 0));
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn usage(&self) -> Vec<MappingUsage> {
        self.s.vm.with_ctx(|ctx| self.s.usage(ctx))
    }

    /// Bytes resident in this space: the sum of its mappings' `rss`
    /// (Linux's `VmRSS`). Walks every page of every mapping.
    pub fn rss(&self) -> u64 {
        self.usage().iter().map(|u| u.rss).sum()
    }
}

impl Space {
    fn usage(&self, ctx: &Ctx<'_>) -> Vec<MappingUsage> {
        let mut out: Vec<MappingUsage> = Vec::new();
        for info in self.infos(ctx) {
            // The VMAs there now (the listing may be stale), each once.
            let map = self.map_read(ctx, info.start, info.end);
            for v in map.overlapping(info.start, info.end) {
                if out.last().is_none_or(|l| l.info.end <= v.start) {
                    out.push(self.usage_of(ctx, v));
                }
            }
        }
        out
    }

    /// One VMA's usage; the map lock is held (for reading) by the caller.
    fn usage_of(&self, ctx: &Ctx<'_>, v: &Vma) -> MappingUsage {
        let phys = &ctx.env.phys;
        let zero = phys.zero_pfn();
        let object = v.object.get();
        let file = {
            let section = ctx.rcu_read();
            object.and_then(|o| o.file_of(&section))
        };
        let mut u = MappingUsage {
            info: v.info(),
            file: file.as_ref().and_then(|f| f.file_key()).map(|(dev, ino)| FileRange {
                dev,
                ino,
                offset: v.pgoff * PAGE_SIZE,
            }),
            rss: 0,
            anonymous: 0,
            swap: 0,
            locked: 0,
            pss: 0,
            shared_clean: 0,
            shared_dirty: 0,
            private_clean: 0,
            private_dirty: 0,
        };
        // The resident pages: (page index, frame, its object, dirty).
        let mut resident = Vec::new();
        let mut a = v.start;
        while a < v.end {
            let section = ctx.rcu_read();
            let pte = self.pmap.pte_now(phys, a);
            let pindex = v.pindex(a);
            if pte.is_present() && pte.pfn() != zero {
                let pfn = pte.pfn();
                u.rss += PAGE_SIZE;
                let files = file.as_ref().is_some_and(|f| f.holds(pindex, pfn));
                // Anonymous: a private mapping's page that is not the
                // file's own.
                let anonymous = !v.is_shared() && !files;
                if anonymous {
                    u.anonymous += PAGE_SIZE;
                }
                let dirty =
                    pte.is_dirty() || anonymous || (files && file.as_ref().is_some_and(|f| f.holds_dirty(pindex, pfn)));
                let owner = object.map(|o| super::rmap::owner_of(o, pindex, pfn, &section));
                resident.push((pindex, pfn, owner, dirty));
            } else if object.is_some_and(|o| matches!(o.find(pindex, &section), Found::Swapped { .. })) {
                u.swap += PAGE_SIZE;
            }
            a += PAGE_SIZE;
        }
        // Linux's fixed point for `Pss` (`PSS_SHIFT`).
        const SHIFT: u32 = 12;
        let mut pss = 0u64;
        for (pindex, pfn, owner, dirty) in resident {
            let n = owner.map_or(1, |o| super::rmap::mapcount(ctx, &o, pindex, pfn)).max(1);
            pss += (PAGE_SIZE << SHIFT) / n;
            let figure = match (n > 1, dirty) {
                (true, false) => &mut u.shared_clean,
                (true, true) => &mut u.shared_dirty,
                (false, false) => &mut u.private_clean,
                (false, true) => &mut u.private_dirty,
            };
            *figure += PAGE_SIZE;
        }
        u.pss = pss >> SHIFT;
        if u.info.locked {
            u.locked = u.pss;
        }
        u
    }
}
