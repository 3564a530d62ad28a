//! The value types of the public API: protections, mapping flags, access
//! kinds, advice, and the `/proc/self/maps`-like description of a mapping.
//!
//! Bit values are Linux x86-64's, so a caller can pass the numbers it would
//! pass to the system call (`Prot::from_bits_retain(libc::PROT_READ as u32)`).

use bitflags::bitflags;

/// The size of a page (and of a frame): 4 KiB.
pub const PAGE_SIZE: u64 = 4096;
/// log2 of [`PAGE_SIZE`].
pub const PAGE_SHIFT: u32 = 12;
/// One past the highest user address (x86-64 with 4-level paging,
/// Linux's `TASK_SIZE`).
pub const TASK_SIZE: u64 = (1 << 47) - PAGE_SIZE;
/// The lowest address a mapping may use (Linux's default `vm.mmap_min_addr`).
pub const MMAP_MIN_ADDR: u64 = 0x10000;

bitflags! {
    /// Page protection, as `PROT_*` (`Prot::empty()` is `PROT_NONE`).
    ///
    /// As on x86, `WRITE` and `EXEC` imply that loads succeed.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
    pub struct Prot: u32 {
        /// `PROT_READ`.
        const READ = libc::PROT_READ as u32;
        /// `PROT_WRITE`.
        const WRITE = libc::PROT_WRITE as u32;
        /// `PROT_EXEC`.
        const EXEC = libc::PROT_EXEC as u32;
    }
}

impl Prot {
    /// `PROT_NONE`.
    pub const NONE: Prot = Prot::empty();

    /// Whether an access of this kind is allowed (x86 rules: any of
    /// READ, WRITE or EXEC allows loads).
    pub fn allows(self, access: Access) -> bool {
        match access {
            Access::Read => !self.is_empty(),
            Access::Write => self.contains(Prot::WRITE),
            Access::Exec => self.contains(Prot::EXEC),
        }
    }
}

bitflags! {
    /// Mapping flags, as `MAP_*`. Exactly one of `PRIVATE` and `SHARED` is
    /// required (both: `MAP_SHARED_VALIDATE`, for a file). Bits Linux does
    /// not define are ignored, as Linux ignores them (refused with
    /// `MAP_SHARED_VALIDATE`: `EOPNOTSUPP`); flags Linux defines that
    /// vmfault does not model (`MAP_32BIT`, `MAP_HUGETLB`, `MAP_SYNC`,
    /// the `MAP_DROPPABLE` type) are `EINVAL`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
    pub struct MapFlags: u32 {
        /// `MAP_SHARED`: stores are visible to every mapping of the object.
        const SHARED = libc::MAP_SHARED as u32;
        /// `MAP_PRIVATE`: copy-on-write.
        const PRIVATE = libc::MAP_PRIVATE as u32;
        /// `MAP_FIXED`: place exactly at `addr`, replacing what is there.
        const FIXED = libc::MAP_FIXED as u32;
        /// `MAP_ANONYMOUS`: zero-filled memory not backed by a file.
        const ANONYMOUS = libc::MAP_ANONYMOUS as u32;
        /// `MAP_NORESERVE`: do not account the mapping against commit limits.
        const NORESERVE = libc::MAP_NORESERVE as u32;
        /// `MAP_POPULATE`: fault every page in before returning.
        const POPULATE = libc::MAP_POPULATE as u32;
        /// `MAP_FIXED_NOREPLACE`: like `FIXED`, but fail with `EEXIST` over an existing mapping.
        const FIXED_NOREPLACE = libc::MAP_FIXED_NOREPLACE as u32;
        /// `MAP_STACK`: a thread stack (glibc and musl pass it on every
        /// `pthread_create`). Linux (6.7 on) keeps huge pages off it
        /// (`VM_NOHUGEPAGE`), which also keeps it from merging with
        /// mappings made without it: so here.
        const STACK = libc::MAP_STACK as u32;
        /// `MAP_LOCKED`: the mapping is `mlock`ed from the start (`VM_LOCKED`),
        /// its pages faulted in and wired, as Linux does.
        const LOCKED = libc::MAP_LOCKED as u32;
        /// `MAP_GROWSDOWN`: a stack that grows down (private anonymous
        /// memory only: `EINVAL` with `SHARED` or a file, as Linux). A
        /// fault in the gap below it extends it down to the faulting page,
        /// unless that leaves less than Linux's stack guard gap (256 pages)
        /// above an accessible mapping below, or makes it larger than the
        /// stack limit (8 MiB, Linux's default `RLIMIT_STACK`); mappings
        /// placed without `FIXED` and `brk` keep that guard gap below it.
        /// A debugger's access (`read_remote` with `force`) grows it too,
        /// as Linux's `/proc/PID/mem` does.
        const GROWSDOWN = libc::MAP_GROWSDOWN as u32;
        /// `MAP_NONBLOCK`: with `POPULATE`, do not fault the pages in (as Linux).
        const NONBLOCK = libc::MAP_NONBLOCK as u32;
        /// `MAP_DENYWRITE`: ignored, as Linux ignores it.
        const DENYWRITE = libc::MAP_DENYWRITE as u32;
        /// `MAP_EXECUTABLE`: ignored, as Linux ignores it.
        const EXECUTABLE = libc::MAP_EXECUTABLE as u32;
        /// `MAP_UNINITIALIZED`: ignored, as Linux ignores it unless built
        /// for no-MMU devices (pages are always zeroed).
        const UNINITIALIZED = 0x0400_0000;
    }
}

bitflags! {
    /// `msync` flags, as `MS_*`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
    pub struct MsyncFlags: u32 {
        /// `MS_ASYNC`: schedule the write-back (Linux checks the range and
        /// writes nothing: dirty pages reach the file later).
        const ASYNC = libc::MS_ASYNC as u32;
        /// `MS_INVALIDATE`: a no-op on Linux's unified page cache (and
        /// here), but `EBUSY` over a locked mapping.
        const INVALIDATE = libc::MS_INVALIDATE as u32;
        /// `MS_SYNC`: write dirty pages back and wait for the writes.
        const SYNC = libc::MS_SYNC as u32;
    }
}

bitflags! {
    /// `mremap` flags, as `MREMAP_*`. Bits outside these are `EINVAL`, as
    /// in Linux.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
    pub struct MremapFlags: u32 {
        /// `MREMAP_MAYMOVE`: the mapping may move to grow.
        const MAYMOVE = libc::MREMAP_MAYMOVE as u32;
        /// `MREMAP_FIXED`: move to exactly `new_addr`, replacing what is
        /// there (needs `MAYMOVE`).
        const FIXED = libc::MREMAP_FIXED as u32;
        /// `MREMAP_DONTUNMAP`: move, and leave the old range mapped and
        /// empty (needs `MAYMOVE` and the same length).
        const DONTUNMAP = libc::MREMAP_DONTUNMAP as u32;
    }
}

/// The kind of a memory access through the software MMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Access {
    /// A load.
    Read,
    /// A store.
    Write,
    /// An instruction fetch (needs `PROT_EXEC`).
    Exec,
}

/// `madvise` advice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Advice {
    /// `MADV_NORMAL`: clear `Random`/`Sequential`.
    Normal,
    /// `MADV_RANDOM`: expect random access (a VMA flag; splits the mapping).
    Random,
    /// `MADV_SEQUENTIAL`: expect sequential access (a VMA flag; splits the mapping).
    Sequential,
    /// `MADV_WILLNEED`: expect access soon (no effect on anonymous memory without swap).
    WillNeed,
    /// `MADV_DONTNEED`: drop the pages; private anonymous memory reads back as
    /// zeros, shared memory keeps its contents.
    DontNeed,
    /// `MADV_FREE`: private anonymous memory may be reclaimed lazily; until it
    /// is, contents stay (`EINVAL` on other mappings).
    Free,
    /// `MADV_COLD`: the pages will not be used soon (Linux moves them to
    /// the inactive list). Contents stay; `EINVAL` on an `mlock`ed mapping.
    /// Here it changes nothing else yet: the page queues' aging decides.
    Cold,
    /// `MADV_PAGEOUT`: reclaim the pages now (Linux pages them out where it
    /// can). Contents stay (paged back in on access); `EINVAL` on an
    /// `mlock`ed mapping. Here it changes nothing else yet: the page daemon
    /// decides what goes to swap.
    PageOut,
}

impl Advice {
    /// The Linux `MADV_*` value.
    pub fn as_raw(self) -> i32 {
        match self {
            Advice::Normal => libc::MADV_NORMAL,
            Advice::Random => libc::MADV_RANDOM,
            Advice::Sequential => libc::MADV_SEQUENTIAL,
            Advice::WillNeed => libc::MADV_WILLNEED,
            Advice::DontNeed => libc::MADV_DONTNEED,
            Advice::Free => libc::MADV_FREE,
            Advice::Cold => libc::MADV_COLD,
            Advice::PageOut => libc::MADV_PAGEOUT,
        }
    }

    /// The advice for a Linux `MADV_*` value, if vmfault supports it.
    pub fn from_raw(raw: i32) -> Option<Advice> {
        [
            Advice::Normal,
            Advice::Random,
            Advice::Sequential,
            Advice::WillNeed,
            Advice::DontNeed,
            Advice::Free,
            Advice::Cold,
            Advice::PageOut,
        ]
        .into_iter()
        .find(|a| a.as_raw() == raw)
    }
}

/// One mapping, as a line of `/proc/self/maps` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct MappingInfo {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// Protection.
    pub prot: Prot,
    /// `MAP_SHARED` (the `s` in `rw-s`).
    pub shared: bool,
    /// `mlock`ed (`VM_LOCKED`, the `lo` of `VmFlags` in `/proc/self/smaps`).
    pub locked: bool,
}

impl std::fmt::Display for MappingInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let bit = |p: Prot, c: char| if self.prot.contains(p) { c } else { '-' };
        write!(
            f,
            "{:x}-{:x} {}{}{}{}",
            self.start,
            self.end,
            bit(Prot::READ, 'r'),
            bit(Prot::WRITE, 'w'),
            bit(Prot::EXEC, 'x'),
            if self.shared { 's' } else { 'p' }
        )
    }
}

/// Round `x` up to a page boundary; `None` on overflow.
pub(crate) fn page_align_up(x: u64) -> Option<u64> {
    x.checked_add(PAGE_SIZE - 1).map(|v| v & !(PAGE_SIZE - 1))
}

/// Whether `x` is page-aligned.
pub(crate) fn is_page_aligned(x: u64) -> bool {
    x & (PAGE_SIZE - 1) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_implies_read_on_x86() {
        assert!(Prot::WRITE.allows(Access::Read));
        assert!(Prot::EXEC.allows(Access::Read));
        assert!(!Prot::NONE.allows(Access::Read));
        assert!(!Prot::READ.allows(Access::Write));
        assert!(!Prot::READ.allows(Access::Exec));
    }

    #[test]
    fn advice_round_trips() {
        for raw in 0..64 {
            if let Some(a) = Advice::from_raw(raw) {
                assert_eq!(a.as_raw(), raw);
            }
        }
        assert_eq!(Advice::from_raw(libc::MADV_DONTNEED), Some(Advice::DontNeed));
        assert_eq!(Advice::from_raw(1000), None);
    }

    #[test]
    fn mapping_line_looks_like_proc_maps() {
        let m =
            MappingInfo { start: 0x1000, end: 0x3000, prot: Prot::READ | Prot::WRITE, shared: false, locked: false };
        assert_eq!(m.to_string(), "1000-3000 rw-p");
    }

    #[test]
    fn align() {
        assert_eq!(page_align_up(1), Some(4096));
        assert_eq!(page_align_up(4096), Some(4096));
        assert_eq!(page_align_up(u64::MAX), None);
        assert!(is_page_aligned(8192));
        assert!(!is_page_aligned(8193));
    }
}
