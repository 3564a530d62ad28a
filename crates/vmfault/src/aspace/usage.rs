//! What each mapping uses: the fields of Linux's `/proc/PID/smaps` that
//! vmfault has (`Rss`, `Anonymous`, `Swap`, `Locked`, and the file and
//! offset columns of `/proc/PID/maps`).
//!
//! Counted by walking each mapping's pages under the map lock for reading
//! (each page in its own read-side section): the time grows with the size
//! of the mappings, as reading `smaps` does in Linux. A figure is a
//! snapshot; faults and the page daemon go on meanwhile.

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
    /// `Locked`: `rss` of an `mlock`ed mapping, 0 otherwise.
    pub locked: u64,
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
        };
        let mut a = v.start;
        while a < v.end {
            let section = ctx.rcu_read();
            let pte = self.pmap.pte_now(phys, a);
            let pindex = v.pindex(a);
            if pte.is_present() && pte.pfn() != zero {
                u.rss += PAGE_SIZE;
                // Anonymous: a private mapping's page that is not the
                // file's own.
                if !v.is_shared() && !file.as_ref().is_some_and(|f| f.holds(pindex, pte.pfn())) {
                    u.anonymous += PAGE_SIZE;
                }
            } else if object.is_some_and(|o| matches!(o.find(pindex, &section), Found::Swapped { .. })) {
                u.swap += PAGE_SIZE;
            }
            a += PAGE_SIZE;
        }
        if u.info.locked {
            u.locked = u.rss;
        }
        u
    }
}
