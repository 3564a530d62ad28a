//! `mincore`: which pages of a range are resident.
//!
//! As Linux's `do_mincore`: a page is resident if its PTE is present (the
//! zero page included), or, with no PTE, if the memory object behind the
//! mapping holds it in a frame (a page shared with the other side of a
//! fork that this side has not touched since, a shared mapping's page
//! another space faulted in, a file's page in the page cache). A page in
//! swap, or never touched, is not. The checks and their order are Linux's:
//! an unaligned address is `EINVAL`; a range past the user address space,
//! or one that meets a hole, is `ENOMEM`.

use super::vma::Lookup;
use super::{AddressSpace, Space};
use crate::error::{Error, Op, Result};
use crate::machine::Ctx;
use crate::object::Found;
use crate::types::{PAGE_SIZE, TASK_SIZE, is_page_aligned};

impl AddressSpace {
    /// One byte per page of `addr..addr+len` (`len` rounded up to pages),
    /// bit 0 set where the page is resident (Linux's `mincore(2)`).
    ///
    /// Errors: an unaligned `addr` (`EINVAL`); a range beyond the user
    /// address space, or one that is not fully mapped (`ENOMEM`).
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let a = space.mmap(0, 3 * 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// space.write(a + 4096, b"x")?;
    /// assert_eq!(space.mincore(a, 3 * 4096)?, vec![0, 1, 0]);
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn mincore(&self, addr: u64, len: u64) -> Result<Vec<u8>> {
        self.s.vm.with_ctx(|ctx| self.s.mincore(ctx, addr, len))
    }
}

impl Space {
    fn mincore(&self, ctx: &Ctx<'_>, addr: u64, len: u64) -> Result<Vec<u8>> {
        let op = Op::Mincore;
        if !is_page_aligned(addr) {
            return Err(Error::inval(op, "address not page-aligned", addr));
        }
        if addr > TASK_SIZE || len > TASK_SIZE - addr {
            return Err(Error::NotMapped { op, addr, end: addr.saturating_add(len) });
        }
        let pages = len.div_ceil(PAGE_SIZE);
        let end = addr + pages * PAGE_SIZE;
        let mut out = Vec::with_capacity(pages as usize);
        if pages == 0 {
            return Ok(out);
        }
        let map = self.map_read(ctx, addr, end);
        let phys = &ctx.env.phys;
        let mut a = addr;
        while a < end {
            let Some(v) = map.find_from(a).filter(|v| v.start <= a) else {
                return Err(Error::NotMapped { op, addr: a, end });
            };
            while a < end.min(v.end) {
                // A section per page: a long range never holds grace periods up.
                let section = ctx.rcu_read();
                let resident = self.pmap.pte_now(phys, a).is_present()
                    || v.object
                        .get()
                        .is_some_and(|o| matches!(o.find(v.pindex(a), &section), Found::Own(_) | Found::Below(_)));
                out.push(u8::from(resident));
                a += PAGE_SIZE;
            }
        }
        Ok(out)
    }
}
