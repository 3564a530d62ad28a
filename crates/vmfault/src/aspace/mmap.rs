//! `mmap` of anonymous memory, private or shared.
//!
//! The checks run in Linux's order (`ksys_mmap_pgoff`, `do_mmap`,
//! `__get_unmapped_area`), because when several arguments are wrong the
//! errno tells which check ran first.

#![deny(unsafe_code)]

use std::sync::Arc;

use super::layout::{round_hint, unmapped_area};
use super::vma::{Vma, VmaFlags};
use super::{AddressSpace, MAX_MAP_COUNT, Space};
use crate::error::{Error, Op, Result};
use crate::object::Object;
use crate::stats::Counter;
use crate::types::{Access, MapFlags, PAGE_SHIFT, Prot, TASK_SIZE, is_page_aligned, page_align_up};
use crate::vm::Ctx;

impl AddressSpace {
    /// Map `len` bytes of anonymous memory; returns the address.
    ///
    /// With `addr == 0` the mapping goes top-down below the stack gap, like
    /// Linux; a non-zero `addr` without `FIXED` is a hint that is honoured
    /// when the range is free. `FIXED` replaces whatever is mapped there;
    /// `FIXED_NOREPLACE` fails with `EEXIST` instead. `POPULATE` faults every
    /// page in (failures to populate are ignored, as in Linux).
    ///
    /// Errors (`errno`): unknown flag or protection bits, zero length,
    /// neither or both of `PRIVATE`/`SHARED`, an unaligned `FIXED` address
    /// (`EINVAL`); no `ANONYMOUS` (`EBADF`: file mappings take a file);
    /// no room or a range beyond `TASK_SIZE` (`ENOMEM`); a fixed range
    /// below `MMAP_MIN_ADDR` (`EPERM`); `FIXED_NOREPLACE` over a mapping (`EEXIST`).
    pub fn mmap(&self, addr: u64, len: u64, prot: Prot, flags: MapFlags) -> Result<u64> {
        let s = &self.s;
        let (a, populate) = s.vm.with_ctx(|ctx| {
            ctx.count(Counter::mmap_calls);
            s.mmap(ctx, addr, len, prot, flags)
        })?;
        if let Some(access) = populate {
            s.populate(a, page_align_up(len).unwrap_or(0), access);
        }
        Ok(a)
    }
}

impl Space {
    /// The mapping itself; returns the address and, for `POPULATE`, the
    /// access with which to fault the pages in.
    fn mmap(&self, ctx: &Ctx<'_>, addr: u64, len: u64, prot: Prot, flags: MapFlags) -> Result<(u64, Option<Access>)> {
        let op = Op::Mmap;
        if MapFlags::from_bits(flags.bits()).is_none() {
            return Err(Error::inval(op, "unknown MAP_* flag bits", u64::from(flags.bits() & !MapFlags::all().bits())));
        }
        if Prot::from_bits(prot.bits()).is_none() {
            return Err(Error::inval(op, "unknown PROT_* bits", u64::from(prot.bits())));
        }
        if !flags.contains(MapFlags::ANONYMOUS) {
            return Err(Error::BadFile { op });
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

        let mut map = self.map_write(ctx);
        if map.len() > MAX_MAP_COUNT {
            return Err(Error::TooManyMappings { op, count: map.len(), limit: MAX_MAP_COUNT });
        }
        let start =
            if fixed { hint } else { unmapped_area(&map, hint, len).ok_or(Error::NoAddressSpace { op, addr, len })? };
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
        let type_bits = flags & (MapFlags::SHARED | MapFlags::PRIVATE);
        if type_bits != MapFlags::SHARED && type_bits != MapFlags::PRIVATE {
            return Err(Error::inval(
                op,
                "exactly one of MAP_PRIVATE and MAP_SHARED is required",
                u64::from(type_bits.bits()),
            ));
        }
        // A shared mapping's object (Linux: the shmem file behind it).
        // Failing here leaves everything as it was.
        let object = match shared {
            true => Some(
                Object::new_anon(ctx, &self.vm.m)
                    .map_err(|_| Error::NoMemory { op, what: "a shared object's page index" })?,
            ),
            false => None,
        };

        let mut vflags = VmaFlags::empty();
        if shared {
            vflags |= VmaFlags::SHARED;
        }
        if flags.contains(MapFlags::NORESERVE) {
            vflags |= VmaFlags::NORESERVE;
        } else if !shared && prot.contains(Prot::WRITE) {
            vflags |= VmaFlags::ACCOUNT;
        }
        let pgoff = if shared { 0 } else { start >> PAGE_SHIFT };

        let mut frames = Vec::new();
        self.reserve_holes_locked(ctx, &map, op, start, end)?;
        let carved = map.carve(start, end);
        let ptes = if carved.is_empty() { 0 } else { self.unmap_locked(ctx, &map, &carved, &mut frames, false) };
        map.insert(Arc::new(Vma::new(start, end, prot, vflags, pgoff, object)));
        let retired = map.merge_range(start, end);
        drop(map);
        let objects_gone = carved.iter().any(|v| v.object.get().is_some());
        self.finish(ctx, ptes, &frames, objects_gone);
        drop((carved, retired));

        let populate = (flags.contains(MapFlags::POPULATE) && !prot.is_empty())
            .then(|| if prot.contains(Prot::WRITE) && !shared { Access::Write } else { Access::Read });
        Ok((start, populate))
    }
}
