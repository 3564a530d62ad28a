//! `mmap` of anonymous memory, private or shared.
//!
//! The checks run in Linux's order (`ksys_mmap_pgoff`, `do_mmap`,
//! `__get_unmapped_area`), because when several arguments are wrong the
//! errno tells which check ran first.

use std::fs::File;

use super::Gather;
use super::layout::{MMAP_BASE, round_hint, unmapped_area};
use super::spares;
use super::vma::{Lookup, VmaIndex};
use super::vma::{Vma, VmaFlags};
use super::zones::MapHeld;
use super::{AddressSpace, MAX_MAP_COUNT, MapWrite, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::object::Object;
use crate::stats::Counter;
use crate::types::{Access, MapFlags, PAGE_SHIFT, Prot, TASK_SIZE, is_page_aligned, page_align_up};

impl AddressSpace {
    /// Map `len` bytes of anonymous memory; returns the address.
    ///
    /// With `addr == 0` the mapping goes top-down below the stack gap, like
    /// Linux; a non-zero `addr` without `FIXED` is a hint that is honoured
    /// when the range is free. `FIXED` replaces whatever is mapped there;
    /// `FIXED_NOREPLACE` fails with `EEXIST` instead. `POPULATE` faults every
    /// page in (failures to populate are ignored, as in Linux), unless with
    /// `NONBLOCK`. Flag bits Linux does not define are ignored, as Linux
    /// ignores them (see [`MapFlags`]).
    ///
    /// Errors (`errno`): a flag Linux defines that vmfault does not model
    /// (see [`MapFlags`]), unknown protection bits, zero length,
    /// neither or both of `PRIVATE`/`SHARED`, an unaligned `FIXED` address
    /// (`EINVAL`); no `ANONYMOUS` (`EBADF`: file mappings take a file);
    /// no room or a range beyond `TASK_SIZE` (`ENOMEM`); a fixed range
    /// below `MMAP_MIN_ADDR` (`EPERM`); `FIXED_NOREPLACE` over a mapping (`EEXIST`).
    ///
    /// `LOCKED` is `mmap` then `mlock` of the range, as in Linux: every
    /// page faulted in and wired (a failure to do so is ignored, and the
    /// mapping stays locked).
    pub fn mmap(&self, addr: u64, len: u64, prot: Prot, flags: MapFlags) -> Result<u64> {
        let s = &self.s;
        let (a, populate) = s.vm.with_ctx(|ctx| {
            ctx.count(Counter::mmap_calls);
            s.mmap(ctx, addr, len, prot, flags, None)
        })?;
        s.populate_mapped(a, len, flags, populate);
        Ok(a)
    }
}

impl Space {
    /// What `mmap` does once the mapping is in place (Linux's
    /// `mm_populate`): with `LOCKED`, fault every page in and wire it, as
    /// `mlock` does; else, for `POPULATE` (`populate`: the access), fault
    /// them in. Failures are ignored, as in Linux: the mapping stays.
    pub(super) fn populate_mapped(&self, a: u64, len: u64, flags: MapFlags, populate: Option<Access>) {
        let len = page_align_up(len).unwrap_or(0);
        if flags.contains(MapFlags::LOCKED) {
            let _ = self.vm.with_ctx(|ctx| self.populate_locked_vmas(ctx, a, a + len));
        } else if let Some(access) = populate {
            self.populate(a, len, access);
        }
    }
}

/// Linux's `LEGACY_MAP_MASK`: the flags `MAP_SHARED_VALIDATE` accepts
/// (of those, vmfault refuses the ones it does not model first).
const LEGACY_MAP_MASK: u32 = (libc::MAP_SHARED
    | libc::MAP_PRIVATE
    | libc::MAP_FIXED
    | libc::MAP_ANONYMOUS
    | libc::MAP_DENYWRITE
    | libc::MAP_EXECUTABLE
    | 0x0400_0000 // MAP_UNINITIALIZED
    | libc::MAP_GROWSDOWN
    | libc::MAP_LOCKED
    | libc::MAP_NORESERVE
    | libc::MAP_POPULATE
    | libc::MAP_NONBLOCK
    | libc::MAP_STACK
    | libc::MAP_HUGETLB) as u32;

/// The flags of `flags` that Linux defines and vmfault does not model, if
/// any: a mapping type other than shared, private or shared-validate (the
/// type is the low four bits: `MAP_DROPPABLE` is 8), `MAP_32BIT`,
/// `MAP_HUGETLB` (and its page-size bits, which count only with it),
/// `MAP_SYNC`. Bits Linux does not define are
/// not among them: `mmap` ignores them as Linux does.
fn unmodelled(flags: MapFlags) -> Option<u32> {
    const TYPE: u32 = 0x0f;
    let bits = flags.bits();
    let odd_type = if bits & TYPE & !0x03 != 0 { bits & TYPE } else { 0 };
    let known = (libc::MAP_32BIT | libc::MAP_HUGETLB | libc::MAP_SYNC) as u32;
    let found = odd_type | (bits & known);
    (found != 0).then_some(found)
}

impl Space {
    /// The mapping itself, of anonymous memory or of `file` from byte
    /// `offset`; returns the address and, for `POPULATE`, the access with
    /// which to fault the pages in.
    pub(super) fn mmap(
        &self,
        ctx: &Ctx<'_>,
        addr: u64,
        len: u64,
        prot: Prot,
        flags: MapFlags,
        file: Option<(&File, u64)>,
    ) -> Result<(u64, Option<Access>)> {
        let op = Op::Mmap;
        if let Some((_, offset)) = file
            && !is_page_aligned(offset)
        {
            return Err(Error::inval(op, "file offset not page-aligned", offset));
        }
        // `fget`: a closed descriptor, or one opened with `O_PATH`.
        if let Some((f, _)) = file
            && !usable(f)
        {
            return Err(Error::BadDescriptor { op });
        }
        if let Some(bits) = unmodelled(flags) {
            return Err(Error::inval(op, "a MAP_* flag vmfault does not model", u64::from(bits)));
        }
        if Prot::from_bits(prot.bits()).is_none() {
            return Err(Error::inval(op, "unknown PROT_* bits", u64::from(prot.bits())));
        }
        match (file.is_some(), flags.contains(MapFlags::ANONYMOUS)) {
            (false, false) => return Err(Error::BadFile { op }),
            (true, true) => return Err(Error::inval(op, "MAP_ANONYMOUS with a file", u64::from(flags.bits()))),
            _ => {}
        }
        if len == 0 {
            return Err(Error::inval(op, "length is zero", 0));
        }
        let fixed = flags.intersects(MapFlags::FIXED | MapFlags::FIXED_NOREPLACE);
        let hint = if fixed { addr } else { round_hint(addr) };
        let len = page_align_up(len).ok_or(Error::NoAddressSpace { op, addr, len })?;
        if len > TASK_SIZE {
            return Err(Error::NoAddressSpace { op, addr, len });
        }
        let shared = flags.contains(MapFlags::SHARED);

        let (mut map, start) = if fixed {
            let map = self.map_write(ctx, hint, hint.saturating_add(len));
            self.check_count(op)?;
            (map, hint)
        } else {
            let Some(placed) = self.placed(ctx, hint, len) else {
                return Err(Error::NoAddressSpace { op, addr, len });
            };
            placed?
        };
        if start > TASK_SIZE - len {
            return Err(Error::NoAddressSpace { op, addr: start, len });
        }
        if !is_page_aligned(start) {
            return Err(Error::inval(op, "fixed address not page-aligned", start));
        }
        if start < crate::types::MMAP_MIN_ADDR {
            return Err(Error::Permission { op, reason: "mapping below mmap_min_addr", value: start });
        }
        let end = start + len;
        if flags.contains(MapFlags::FIXED_NOREPLACE) && map.intersects(start, end) {
            return Err(Error::Exists { addr: start, end });
        }
        // `file_mmap_ok`: the mapping must end below the largest file
        // size (`MAX_LFS_FILESIZE`, 2^63 - 1).
        if let Some((_, offset)) = file
            && offset >> PAGE_SHIFT > ((i64::MAX as u64) - len) >> PAGE_SHIFT
        {
            return Err(Error::Overflow { op, offset, len });
        }
        let type_bits = flags & (MapFlags::SHARED | MapFlags::PRIVATE);
        let validate = type_bits == MapFlags::SHARED | MapFlags::PRIVATE;
        if validate && file.is_some() {
            // `MAP_SHARED_VALIDATE`: `MAP_SHARED` that refuses the flags
            // outside Linux's legacy set (`MAP_SHARED` ignores them):
            // `MAP_FIXED_NOREPLACE`, and the bits Linux does not define.
            let outside = flags.bits() & !LEGACY_MAP_MASK;
            if outside != 0 {
                return Err(Error::NotSupported {
                    op,
                    reason: "MAP_SHARED_VALIDATE with a flag outside the legacy set",
                    value: u64::from(outside),
                });
            }
        } else if type_bits != MapFlags::SHARED && type_bits != MapFlags::PRIVATE {
            return Err(Error::inval(
                op,
                "exactly one of MAP_PRIVATE and MAP_SHARED (or MAP_SHARED_VALIDATE, for a file) is required",
                u64::from(type_bits.bits()),
            ));
        }
        // A shared mapping's object (Linux: the shmem file behind it); a
        // file's, or for a private mapping of a file, a shadow in front of
        // it, which takes the copies. Failing here leaves everything as it was.
        let nomem = |what| Error::NoMemory { op, what };
        let mut no_write = false;
        // `do_mmap`: a stack that grows down is private anonymous memory
        // (`EINVAL` after the file's access checks).
        let grows_down = flags.contains(MapFlags::GROWSDOWN);
        let not_a_stack = || Error::inval(op, "MAP_GROWSDOWN on a shared or file mapping", u64::from(flags.bits()));
        let object = match (file, shared) {
            (Some((f, _)), _) => {
                let writable = file_access(f, op, shared && prot.contains(Prot::WRITE))?;
                if grows_down {
                    return Err(not_a_stack());
                }
                no_write = shared && !writable;
                let o = Object::for_file(ctx, f)?;
                if shared && writable {
                    o.ensure_writer(f)?;
                }
                Some(match shared {
                    true => o,
                    false => {
                        Object::new_shadow(ctx, &o, false).map_err(|_| nomem("a private file mapping's object"))?
                    }
                })
            }
            (None, true) if grows_down => return Err(not_a_stack()),
            (None, true) => Some(
                Object::new_shared_anon(ctx, len >> PAGE_SHIFT).map_err(|_| nomem("a shared object's page index"))?,
            ),
            (None, false) => None,
        };

        let mut vflags = VmaFlags::empty();
        if shared {
            vflags |= VmaFlags::SHARED;
        }
        if file.is_some() {
            vflags |= VmaFlags::FILE;
        }
        if no_write {
            vflags |= VmaFlags::NO_WRITE;
        }
        if flags.contains(MapFlags::STACK) {
            vflags |= VmaFlags::NOHUGEPAGE;
        }
        if grows_down {
            vflags |= VmaFlags::GROWSDOWN;
        }
        // `MAP_LOCKED`: `VM_LOCKED` from the start (its pages are faulted
        // in and wired once the mapping is in place: `populate_mapped`).
        if flags.contains(MapFlags::LOCKED) {
            vflags |= VmaFlags::LOCKED;
        }
        if flags.contains(MapFlags::NORESERVE) {
            vflags |= VmaFlags::NORESERVE;
        } else if !shared && prot.contains(Prot::WRITE) {
            vflags |= VmaFlags::ACCOUNT;
        }
        let pgoff = match file {
            Some((_, offset)) => offset >> PAGE_SHIFT,
            None if shared => 0,
            None => start >> PAGE_SHIFT,
        };

        let mut g = Gather::default();
        self.reserve_holes_locked(ctx, &map, op, start, end)?;
        let carved = map.carve(start, end);
        if !carved.is_empty() {
            self.unmap_locked(ctx, &map, &carved, &mut g, false, None);
        }
        map.insert(spares::vma(Vma::new(start, end, prot, vflags, pgoff, object)));
        let retired = map.merge_range(start, end);
        drop(map);
        self.end_removal(ctx, g, carved);
        // The one just inserted, if it merged, was never published: a spare.
        retired.into_iter().for_each(spares::release_vma);

        let populate = (flags.contains(MapFlags::POPULATE) && !flags.contains(MapFlags::NONBLOCK) && !prot.is_empty())
            .then(|| if prot.contains(Prot::WRITE) && !shared { Access::Write } else { Access::Read });
        Ok((start, populate))
    }
}

impl Space {
    /// `ENOMEM` if the space has more than `MAX_MAP_COUNT` VMAs.
    pub(super) fn check_count(&self, op: Op) -> Result<()> {
        if let Some(count) = self.zones.vmas_above(MAX_MAP_COUNT) {
            return Err(Error::TooManyMappings { op, count, limit: MAX_MAP_COUNT });
        }
        Ok(())
    }

    /// Where a mapping of `len` bytes without `MAP_FIXED` goes (Linux's
    /// `get_unmapped_area`: `hint` if that range is free, else top-down
    /// below `MMAP_BASE`), with the map lock of its zones held for writing;
    /// none if no gap fits; an error if there are too many mappings.
    ///
    /// With one zone: locked first, then searched. With zones
    /// (`zones.rs`, "Placement"): searched in the published snapshots with
    /// no lock, then locked and checked; a range a change took meanwhile
    /// is searched for again. If a zone of the range is held by another
    /// change, the search goes on below that zone instead of waiting (a
    /// hint is waited for), at most `PLACEMENT_DETOURS` times.
    fn placed(&self, ctx: &Ctx<'_>, hint: u64, len: u64) -> Option<Result<(MapWrite<'_>, u64)>> {
        /// Busy zones an mmap avoids before it waits for one.
        const PLACEMENT_DETOURS: u32 = 4;
        if !self.zones.split() {
            let map = self.map_write(ctx, 0, TASK_SIZE);
            if let Err(e) = self.check_count(Op::Mmap) {
                return Some(Err(e));
            }
            return unmapped_area(&map, hint, len, MMAP_BASE).map(|start| Ok((map, start)));
        }
        if let Err(e) = self.check_count(Op::Mmap) {
            return Some(Err(e));
        }
        let (mut high, mut detours) = (MMAP_BASE, 0);
        let slot = ctx.index.min(self.zones.cpus.len() - 1);
        // In flight from here, its search included: two mmaps searching
        // at once each see the other and go to zones of their own.
        let _busy = self.zones.busy(slot);
        let linux = self.zones.zone_of(MMAP_BASE - 1);
        if hint == 0 && self.zones.others_changing(slot) {
            // Another change is in flight: this vCPU's own zone, below
            // Linux's; if that is busy or full, the search below goes on
            // from a page short of its end (a change locks the zone of
            // the byte after its range).
            if let Some(home) = self.zones.home_below(linux, slot) {
                ctx.count(Counter::placement_home);
                if let Some(found) = self.placed_in(ctx, home, len, None) {
                    return Some(Ok(found));
                }
                high = self.zones.end_of(home) - crate::types::PAGE_SIZE;
            }
        } else if hint == 0
            && let Some(found) = self.placed_in(ctx, linux, len, Some(MMAP_BASE))
        {
            // Linux's address, found in Linux's zone under its lock.
            return Some(Ok(found));
        }
        loop {
            let start = {
                let section = ctx.rcu_read();
                unmapped_area(&self.zones.published(&section), hint, len, high)
            };
            let start = match start {
                Some(s) => s,
                // Nothing below the busy zones: wait for Linux's answer.
                None if high < MMAP_BASE => {
                    (high, detours) = (MMAP_BASE, PLACEMENT_DETOURS);
                    continue;
                }
                None => return None,
            };
            let end = start + len;
            let map = if start == hint || detours >= PLACEMENT_DETOURS {
                self.map_write(ctx, start, end)
            } else {
                match self.try_map_write(ctx, start, end) {
                    Ok(map) => map,
                    Err(busy) => {
                        ctx.count(Counter::placement_detours);
                        // Below the busy zone, and a page short of it: a
                        // change locks the zone of the byte after its range.
                        high = high.min(self.zones.geo().start_of(busy).saturating_sub(crate::types::PAGE_SIZE));
                        detours += 1;
                        continue;
                    }
                }
            };
            // Still free. (The search kept a stack's guard gap; a stack
            // mapped meanwhile by another vCPU may come within it, as the
            // order of the two changes allows.)
            if !map.intersects(start, end) {
                return Some(Ok((map, start)));
            }
        }
    }
}

impl Space {
    /// The highest gap of `len` bytes below `high` (`None`: the zone's
    /// top) in zone `z`, searched under that zone's map lock (taken without
    /// waiting), with the lock held; none if the zone is busy, holds a VMA
    /// that crosses its edges, or has no such gap.
    ///
    /// No RCU section: the index searched is the locked one. (A vCPU
    /// preempted inside a section holds back every other vCPU's
    /// reclamation of retired snapshots, and their next changes allocate
    /// the records and nodes those hold: heap allocations in mmap1 at two
    /// vCPUs.)
    ///
    /// The range starts a page above the zone's start (and at
    /// `MMAP_MIN_ADDR` or above) and ends a page and a stack guard gap
    /// below its end: a change locks the zones of the bytes beside its
    /// range, and a stack at the bottom of the zone above (not searched)
    /// keeps its guard gap free. A gap found in Linux's zone below
    /// `MMAP_BASE` is Linux's answer: every gap above it, up to
    /// `MMAP_BASE`, lies in the zone too, whose index holds every VMA that
    /// touches it.
    pub(super) fn placed_in(
        &self,
        ctx: &Ctx<'_>,
        z: usize,
        len: u64,
        high: Option<u64>,
    ) -> Option<(MapWrite<'_>, u64)> {
        let top = self.zones.end_of(z).saturating_sub(crate::types::PAGE_SIZE + super::stack::STACK_GUARD_GAP);
        // A `high` above the top would be a lower answer than the one asked for.
        let high = match high {
            Some(h) if h > top => return None,
            h => h.unwrap_or(top),
        };
        let held = self.zones.try_write(z, z).ok()?;
        let map = self.map_write_held(ctx, held);
        // Every VMA that touches the zone lies inside it: the lock covers
        // the range, its neighbours and whatever they may merge with.
        if map.tree(z).is_none_or(|t| t.crossing != 0) {
            return None;
        }
        let low = (self.zones.start_of(z) + crate::types::PAGE_SIZE).max(crate::types::MMAP_MIN_ADDR);
        let start = super::layout::top_down(&map, len, low, high)?;
        Some((map, start))
    }
}

/// Whether `f` is a descriptor `mmap` can look at (Linux's `fget` fails
/// on a closed one and on one opened with `O_PATH`): neither can be read
/// nor written, even zero bytes, while any open mode allows one of them.
fn usable(f: &File) -> bool {
    use std::os::unix::fs::FileExt;
    let ebadf = |r: std::io::Result<usize>| r.is_err_and(|e| e.raw_os_error() == Some(libc::EBADF));
    !(ebadf(f.read_at(&mut [], 0)) && ebadf(f.write_at(&[], 0)))
}

/// Linux's checks of a file in `do_mmap`: open for reading (`EACCES`), and
/// for writing too if the mapping is shared and writable (`EACCES`); then
/// a kind of file that can be mapped (`ENODEV`: vmfault maps regular files
/// only). Returns whether the file is open for writing. A zero-length read
/// or write tells without changing anything (the kernel checks the file's
/// mode before the length; only `EBADF` means the mode is missing).
fn file_access(f: &File, op: Op, write: bool) -> Result<bool> {
    use std::os::unix::fs::FileExt;
    let denied = |r: std::io::Result<usize>| r.is_err_and(|e| e.raw_os_error() == Some(libc::EBADF));
    let writable = !denied(f.write_at(&[], 0));
    if write && !writable {
        return Err(Error::Access { op, need: "writing" });
    }
    if denied(f.read_at(&mut [], 0)) {
        return Err(Error::Access { op, need: "reading" });
    }
    let meta = f.metadata().map_err(|e| Error::Host { call: "fstat", errno: e.raw_os_error().unwrap_or(libc::EIO) })?;
    if !meta.is_file() {
        return Err(Error::NoDevice { op, what: if meta.is_dir() { "a directory" } else { "not a regular file" } });
    }
    Ok(writable)
}
