//! The software MMU: loads and stores through the page table.
//!
//! Each page of an access is first looked up lockless, inside an RCU
//! read-side section, as a TLB would: a PTE that allows the access means the
//! bytes are copied at once, with no lock and no shared write. Otherwise the
//! fault path runs and hands back the frame to copy to or from, while it is
//! still guaranteed alive. An access that crosses into a bad page copies
//! the bytes before it and fails with the first faulting address, as a
//! `rep movsb` would.
//!
//! Memory ordering of guest accesses: bytes move with relaxed atomic word
//! loads and stores, and every page piece runs in its own RCU section,
//! whose SeqCst fence orders it after everything before it on this vCPU.
//! So separate accesses are ordered as on x86 (each sees the earlier ones),
//! but the words inside one multi-word access are not ordered among
//! themselves on a weakly ordered host: like `rep movs`, a large copy is
//! not one atomic event.

use super::{AddressSpace, Space};
use crate::error::{Error, Op, Result, SegvCode};
use crate::fault;
use crate::machine::Ctx;
use crate::phys::Pfn;
use crate::stats::Counter;
use crate::types::{Access, PAGE_SIZE, TASK_SIZE};

impl AddressSpace {
    /// Load `buf.len()` bytes from `addr`, faulting pages in as needed.
    ///
    /// On SIGSEGV (`Error::Segv` with the first faulting address),
    /// `buf[..fault_addr - addr]` holds the bytes read before it.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        self.load(Op::Read, Access::Read, addr, buf)
    }

    /// Store `data` at `addr`, faulting pages in as needed.
    ///
    /// On SIGSEGV (`Error::Segv` with the first faulting address), the bytes
    /// before that address have been stored.
    pub fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let s = &self.s;
        s.vm.with_ctx(|ctx| {
            let phys = &ctx.env.phys;
            s.access(ctx, Op::Write, addr, data.len(), Access::Write, |pfn, off, at, n| {
                phys.write_bytes(pfn, off, &data[at..at + n])
            })
        })
    }

    /// Fetch `buf.len()` bytes of instructions from `addr`: a load that
    /// needs execute permission (an emulator's instruction fetch), in one
    /// walk per page, faulting pages in as needed. A page mapped without
    /// `PROT_EXEC` fails with `Error::Segv` (`SEGV_ACCERR`) at its first
    /// byte, as a jump there would; `buf[..fault_addr - addr]` holds the
    /// bytes fetched before it.
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags, Error};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let text = space.mmap(0, 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// space.write(text, &[0x90, 0xc3])?; // nop; ret
    /// let mut insn = [0u8; 2];
    /// assert!(matches!(space.fetch(text, &mut insn), Err(Error::Segv { .. }))); // not executable yet
    /// space.mprotect(text, 4096, Prot::READ | Prot::EXEC)?;
    /// space.fetch(text, &mut insn)?;
    /// assert_eq!(insn, [0x90, 0xc3]);
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn fetch(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        self.load(Op::Fetch, Access::Exec, addr, buf)
    }

    /// Bytes from `addr` into `buf`, each page needing `access` (a data
    /// load or an instruction fetch).
    fn load(&self, op: Op, access: Access, addr: u64, buf: &mut [u8]) -> Result<()> {
        let s = &self.s;
        s.vm.with_ctx(|ctx| {
            let phys = &ctx.env.phys;
            s.access(ctx, op, addr, buf.len(), access, |pfn, off, at, n| {
                phys.read_bytes(pfn, off, &mut buf[at..at + n])
            })
        })
    }

    /// Load `buf.len()` bytes from `addr` as a debugger does, through
    /// `/proc/PID/mem` or `PTRACE_PEEKDATA`: with `force` (Linux's
    /// `FOLL_FORCE`), whatever the mapping's protection, `PROT_NONE`
    /// included (the pages are faulted in, as Linux does, but a
    /// `PROT_NONE` page is not mapped: the next ordinary access still
    /// faults); without, exactly [`read`](AddressSpace::read). Fails where
    /// nothing is mapped (`Error::Segv`, `SEGV_MAPERR`, at the first such
    /// address; the bytes before it are in `buf`), where Linux's
    /// `/proc/PID/mem` reads as many bytes and then fails.
    pub fn read_remote(&self, addr: u64, buf: &mut [u8], force: bool) -> Result<()> {
        if !force {
            return self.read(addr, buf);
        }
        let len = buf.len();
        self.forced(Op::Read, Access::Read, addr, len, |phys, pfn, off, at, n| {
            phys.read_bytes(pfn, off, &mut buf[at..at + n])
        })
    }

    /// Store `data` at `addr` as a debugger does (a breakpoint into a
    /// program's text): with `force` (Linux's `FOLL_FORCE`), a private
    /// mapping is written whatever its protection, by copy-on-write (the
    /// page becomes this space's own, as any write to a private mapping
    /// makes it, and its PTE keeps the mapping's protection: an ordinary
    /// store there still fails); a shared mapping without `PROT_WRITE` is
    /// not (`Error::Segv`, `SEGV_ACCERR`: the file or the other processes
    /// would see it; Linux's `/proc/PID/mem` says `EIO`). Without `force`,
    /// exactly [`write`](AddressSpace::write). The bytes before the first
    /// failing address are stored.
    ///
    /// ```
    /// use vmfault::{Error, MapFlags, Prot, Vm, VmConfig};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let text = space.mmap(0, 4096, Prot::READ | Prot::EXEC, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// assert!(matches!(space.write(text, &[0xcc]), Err(Error::Segv { .. })));
    /// space.write_remote(text, &[0xcc], true)?; // int3, as a debugger sets it
    /// let mut insn = [0u8; 1];
    /// space.fetch(text, &mut insn)?;
    /// assert_eq!(insn, [0xcc]);
    /// assert!(matches!(space.write(text, &[0x90]), Err(Error::Segv { .. }))); // still read-only
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn write_remote(&self, addr: u64, data: &[u8], force: bool) -> Result<()> {
        if !force {
            return self.write(addr, data);
        }
        self.forced(Op::Write, Access::Write, addr, data.len(), |phys, pfn, off, at, n| {
            phys.write_bytes(pfn, off, &data[at..at + n])
        })
    }

    /// `len` bytes at `addr` with forced faults, `copy` moving each piece.
    fn forced(
        &self,
        op: Op,
        access: Access,
        addr: u64,
        len: usize,
        mut copy: impl FnMut(&crate::phys::PhysMem, Pfn, usize, usize, usize),
    ) -> Result<()> {
        let s = &self.s;
        s.vm.with_ctx(|ctx| {
            let phys = &ctx.env.phys;
            s.access_with(ctx, op, addr, len, access, true, |pfn, off, at, n| copy(phys, pfn, off, at, n))
        })
    }

    /// One access of the given kind at `addr`, like a single load, store or
    /// instruction fetch: faults the page in (or fails with SIGSEGV) but
    /// transfers no data.
    pub fn touch(&self, addr: u64, access: Access) -> Result<()> {
        let s = &self.s;
        s.vm.with_ctx(|ctx| s.access(ctx, Op::Touch, addr, 1, access, |_, _, _, _| {}))
    }
}

impl Space {
    /// Run `copy(frame, offset_in_page, offset_in_buffer, n)` for each page
    /// piece of `addr..addr+len`, faulting where the page table says no.
    #[inline]
    pub(crate) fn access(
        &self,
        ctx: &Ctx<'_>,
        op: Op,
        addr: u64,
        len: usize,
        access: Access,
        copy: impl FnMut(Pfn, usize, usize, usize),
    ) -> Result<()> {
        self.access_with(ctx, op, addr, len, access, false, copy)
    }

    /// [`access`](Space::access); with `force`, its faults are forced
    /// (`fault::handle_forced`: a debugger's access).
    #[allow(clippy::too_many_arguments)]
    fn access_with(
        &self,
        ctx: &Ctx<'_>,
        op: Op,
        addr: u64,
        len: usize,
        access: Access,
        force: bool,
        mut copy: impl FnMut(Pfn, usize, usize, usize),
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        // The first page piece inline, the others (if any) out of line: a
        // loop around the inline piece had the compiler hoist two dozen
        // addresses out of it and keep them on the stack, for a loop that
        // runs once in most accesses.
        let off = (addr % PAGE_SIZE) as usize;
        let n = (PAGE_SIZE as usize - off).min(len);
        self.piece(ctx, op, addr, access, force, |pfn| copy(pfn, off, 0, n))?;
        if n < len { self.pieces_after(ctx, op, addr, n, len, access, force, copy) } else { Ok(()) }
    }

    /// The page pieces of [`access_with`](Space::access_with) from byte
    /// `done` on.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn pieces_after(
        &self,
        ctx: &Ctx<'_>,
        op: Op,
        addr: u64,
        mut done: usize,
        len: usize,
        access: Access,
        force: bool,
        mut copy: impl FnMut(Pfn, usize, usize, usize),
    ) -> Result<()> {
        while done < len {
            let a = addr.saturating_add(done as u64);
            let off = (a % PAGE_SIZE) as usize;
            let n = (PAGE_SIZE as usize - off).min(len - done);
            self.piece(ctx, op, a, access, force, |pfn| copy(pfn, off, done, n))?;
            done += n;
        }
        Ok(())
    }

    /// One page piece of an access: `copy(frame)` once the page at `a`
    /// allows `access`, faulting if it does not.
    #[inline(always)]
    fn piece(&self, ctx: &Ctx<'_>, op: Op, a: u64, access: Access, force: bool, copy: impl FnMut(Pfn)) -> Result<()> {
        let phys = &ctx.env.phys;
        let cpu = self.cpu(ctx);
        if a >= TASK_SIZE {
            // Beyond the user address space: no page table to walk.
            ctx.count(Counter::faults);
            cpu.count_fault();
            ctx.count(Counter::segv);
            return Err(Error::Segv { addr: a, code: SegvCode::MapErr });
        }
        let section = ctx.rcu_read();
        match self.pmap.lookup(phys, a, access, &cpu.leaf_hint) {
            Ok(pfn) => {
                if phys.queues.is_some() {
                    // The accessed bit a real MMU would set: the page
                    // daemon's reference mark (`phys::queues`).
                    phys.page(pfn).touch();
                }
                let mut copy = copy;
                copy(pfn);
            }
            Err(_) if force => {
                drop(section);
                fault::handle_forced(ctx, self, op, a, access, copy)?;
            }
            Err(missed) => {
                // The fault goes on in this section (or ends it first).
                let looked = Some(fault::Looked { section, missed });
                fault::handle_looked(ctx, self, cpu, op, a, access, looked, copy)?;
            }
        }
        Ok(())
    }

    /// Fault `start..start+len` in with `access` (`MAP_POPULATE`); stops at
    /// the first failure, which is not reported (as in Linux).
    pub(crate) fn populate(&self, start: u64, len: u64, access: Access) {
        self.vm.with_ctx(|ctx| {
            let mut a = start;
            while a < start + len {
                if self.access(ctx, Op::Mmap, a, 1, access, |_, _, _, _| {}).is_err() {
                    break;
                }
                a += PAGE_SIZE;
            }
        });
    }
}
