//! File mappings: `mmap_file` and `msync` (the page cache itself is
//! `object/file.rs`).
//!
//! A shared mapping maps the file's object; a private one maps a shadow
//! object in front of it (made at `mmap`, where Linux makes the anon_vma at
//! the first write: two adjacent private mappings of one file therefore do
//! not merge here), so a read maps the file's page read-only and a write
//! copies it, exactly as after `fork`. Dirty pages of shared mappings are
//! written back by `msync`, by `munmap` (and `mmap(MAP_FIXED)` over them)
//! and when the file's last mapping goes.

use std::fs::File;
use std::sync::Arc;

use super::vma::Lookup;
use super::vma::Vma;
use super::{AddressSpace, Space};
use crate::error::{Error, Op, Result};
use crate::machine::{Ctx, Machine};
use crate::object::Object;
use crate::stats::Counter;
use crate::types::{MapFlags, MsyncFlags, PAGE_SIZE, Prot, is_page_aligned};

impl AddressSpace {
    /// Map `len` bytes of `file` from byte `offset` (page-aligned); returns
    /// the address. Placement and flags as for [`mmap`](AddressSpace::mmap),
    /// without `MAP_ANONYMOUS`. Every mapping of one file in the `Vm`
    /// shares its pages; the object keeps its own handle, so `file` may be
    /// closed afterwards.
    ///
    /// `MAP_SHARED`: stores reach the file on [`msync`](AddressSpace::msync),
    /// on `munmap` and when the last mapping of the file goes.
    /// `MAP_PRIVATE`: reads see the file; a store copies the page first and
    /// never reaches the file. In the last page, bytes past the end of the
    /// file read as zeros; a page wholly past it is [`Error::Bus`] (SIGBUS).
    ///
    /// ```
    /// use std::io::Write;
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags, Error};
    /// let path = std::env::temp_dir().join(format!("vmfault-doc-{}", std::process::id()));
    /// let mut f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    /// f.write_all(b"hello, file").unwrap();
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let a = space.mmap_file(0, 8192, Prot::READ | Prot::WRITE, MapFlags::SHARED, &f, 0)?;
    /// let mut buf = [0u8; 11];
    /// space.read(a, &mut buf)?;
    /// assert_eq!(&buf, b"hello, file");
    /// space.write(a, b"HELLO")?;
    /// space.msync(a, 4096)?;
    /// assert_eq!(&std::fs::read(&path).unwrap(), b"HELLO, file");
    /// // The second page lies wholly beyond the end of the file.
    /// assert!(matches!(space.read(a + 4096, &mut buf), Err(Error::Bus { .. })));
    /// # std::fs::remove_file(&path).unwrap();
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    ///
    /// Errors, beyond `mmap`'s: an unaligned `offset` (`EINVAL`, checked
    /// first, as Linux does); `MAP_ANONYMOUS` (`EINVAL`); a file not open
    /// for reading, or not for writing under a shared writable mapping
    /// (`EACCES`); `fstat` or `dup` failing (their errno).
    pub fn mmap_file(&self, addr: u64, len: u64, prot: Prot, flags: MapFlags, file: &File, offset: u64) -> Result<u64> {
        let s = &self.s;
        let (a, populate) = s.vm.with_ctx(|ctx| {
            ctx.count(Counter::mmap_calls);
            s.mmap(ctx, addr, len, prot, flags, Some((file, offset)))
        })?;
        s.populate_mapped(a, len, flags, populate);
        Ok(a)
    }

    /// Write the dirty pages of shared file mappings in `addr..addr+len`
    /// back to their files, and wait for the writes (`msync(MS_SYNC)`):
    /// once it returns, every store made to those pages before the call is
    /// in the file, including pages another thread was writing back.
    ///
    /// As in Linux: an unaligned `addr` is `EINVAL`; every mapped part of
    /// the range is synced, and a range with unmapped parts then fails with
    /// `ENOMEM`. Anonymous and private mappings have nothing to write. A
    /// failed write is the host's errno; the pages it did not write stay
    /// dirty.
    pub fn msync(&self, addr: u64, len: u64) -> Result<()> {
        self.msync_flags(addr, len, MsyncFlags::SYNC)
    }

    /// `msync` with its flags, checked in Linux's order: unknown bits, an
    /// unaligned `addr`, `MS_ASYNC` with `MS_SYNC` (`EINVAL`); a range that
    /// wraps (`ENOMEM`); a zero length succeeds. Then mapping by mapping:
    /// a hole is `ENOMEM` (at once for `MS_ASYNC` alone, else once the
    /// rest is synced), `MS_INVALIDATE` over a locked mapping `EBUSY`.
    /// Only `MS_SYNC` writes (`MS_ASYNC` checks, as on Linux since 2.6.19).
    pub fn msync_flags(&self, addr: u64, len: u64, flags: MsyncFlags) -> Result<()> {
        let s = &self.s;
        s.vm.with_ctx(|ctx| s.msync(ctx, addr, len, flags))
    }
}

impl Space {
    fn msync(&self, ctx: &Ctx<'_>, addr: u64, len: u64, flags: MsyncFlags) -> Result<()> {
        let op = Op::Msync;
        if MsyncFlags::from_bits(flags.bits()).is_none() {
            return Err(Error::inval(op, "unknown MS_* bits", u64::from(flags.bits())));
        }
        if !is_page_aligned(addr) {
            return Err(Error::inval(op, "address not page-aligned", addr));
        }
        if flags.contains(MsyncFlags::ASYNC | MsyncFlags::SYNC) {
            return Err(Error::inval(op, "MS_ASYNC with MS_SYNC", u64::from(flags.bits())));
        }
        let end = addr.wrapping_add(len.wrapping_add(PAGE_SIZE - 1) & !(PAGE_SIZE - 1));
        if end < addr {
            return Err(Error::NotMapped { op, addr, end: u64::MAX });
        }
        if end == addr {
            return Ok(());
        }
        // Linux's walk (`mm/msync.c`), collected under the map lock; the
        // writes follow in order, and the first error stops them.
        let (targets, failed, hole) = {
            let map = self.map_read(ctx, addr, end);
            let mut pos = addr;
            let (mut hole, mut failed) = (false, None);
            let mut targets = Vec::new();
            loop {
                let Some(v) = map.find_from(pos) else {
                    failed = Some(Error::NotMapped { op, addr, end });
                    break;
                };
                if pos < v.start {
                    if flags == MsyncFlags::ASYNC {
                        failed = Some(Error::NotMapped { op, addr, end });
                        break;
                    }
                    pos = v.start;
                    if pos >= end {
                        failed = Some(Error::NotMapped { op, addr, end });
                        break;
                    }
                    hole = true;
                }
                if flags.contains(MsyncFlags::INVALIDATE) && v.flags.contains(super::vma::VmaFlags::LOCKED) {
                    failed = Some(Error::Busy { op, reason: "MS_INVALIDATE over a locked mapping", value: v.start });
                    break;
                }
                if flags.contains(MsyncFlags::SYNC) {
                    targets.extend(file_range(v, pos, end));
                }
                pos = v.end;
                if pos >= end {
                    break;
                }
            }
            (targets, failed, hole)
        };
        for (o, s, e) in targets {
            write_back(ctx.m, Some(ctx), &o, s, e, true)?;
        }
        match failed {
            Some(e) => Err(e),
            None if hole => Err(Error::NotMapped { op, addr, end }),
            None => Ok(()),
        }
    }

    /// Write back what the shared file mappings among `removed` (just
    /// unmapped) left dirty. An error has nobody to go to (`munmap`
    /// succeeded): it is logged and the pages stay dirty, to be written
    /// when the object goes.
    pub(super) fn write_back_removed(&self, ctx: &Ctx<'_>, removed: &[Arc<Vma>]) {
        write_back_vmas(ctx.m, Some(ctx), removed);
    }
}

/// The end of a space: write back what its shared file mappings left dirty
/// (the file's object may stay cached after its last mapping, see
/// `object/file.rs`). No vCPU context: any thread may drop the last handle
/// (so nothing is counted). Errors are logged; the pages stay dirty.
pub(super) fn write_back_at_exit(m: &Machine, vmas: &[Arc<Vma>]) {
    write_back_vmas(m, None, vmas);
}

/// Write back the dirty pages of the shared file mappings among `vmas`,
/// logging errors.
fn write_back_vmas(m: &Machine, ctx: Option<&Ctx<'_>>, vmas: &[Arc<Vma>]) {
    for v in vmas {
        if let Some((o, s, e)) = file_range(v, v.start, v.end)
            && let Err(err) = write_back(m, ctx, &o, s, e, false)
        {
            match ctx {
                Some(ctx) => ctx.count(Counter::file_write_errors),
                None => m.phys.shared_counters().add(Counter::file_write_errors, 1),
            }
            tracing::warn!(
                target: "vmfault::file",
                event = Counter::file_write_errors.name(),
                error = %err,
                start = %format_args!("{:#x}", v.start),
                end = %format_args!("{:#x}", v.end),
                "write-back of an unmapped range failed: its pages stay dirty"
            );
        }
    }
}

/// Write back the dirty pages `start..end` of file object `o`, counting
/// on `ctx`'s vCPU if there is one; with `integrity`, wait for pages
/// another writer has under way too (`Object::write_back`).
fn write_back(
    m: &Machine,
    ctx: Option<&Ctx<'_>>,
    o: &Arc<Object>,
    start: u64,
    end: u64,
    integrity: bool,
) -> Result<()> {
    let n = o.write_back(start, end, integrity, |pages| {
        // It always waits for a grace period: a shootdown.
        super::rmap::write_protect_everywhere(m, o, pages);
        if let Some(ctx) = ctx {
            ctx.count_n(Counter::rmap_walks, pages.len() as u64);
            ctx.count(Counter::tlb_shootdowns);
        }
    })?;
    if let Some(ctx) = ctx {
        ctx.count_n(Counter::file_writebacks, n);
    }
    Ok(())
}

/// The object and page range of `v` within `start..end`, if `v` is a
/// shared file mapping.
pub(super) fn file_range(v: &Vma, start: u64, end: u64) -> Option<(Arc<Object>, u64, u64)> {
    let o = v.object.get().filter(|o| v.is_shared() && o.is_file())?;
    let (s, e) = (v.start.max(start), v.end.min(end));
    (s < e).then(|| (o.clone(), v.pindex(s), v.pindex(e)))
}
