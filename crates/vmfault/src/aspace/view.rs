//! Host views: native loads, stores and atomics on guest memory.
//!
//! [`AddressSpace::host_view`] reserves a window of this process's address
//! space that mirrors a range of the space: byte `addr` of the space is at
//! `view.ptr(addr)` in the process. A first access to a page there faults
//! (`SIGSEGV`, taken on the faulting thread by `phys::window`'s handler),
//! runs vmfault's own fault path on the thread's vCPU (the shared slot for
//! a thread that is not attached), and maps the very frame the space's PTE
//! names, with the PTE's rights, into the window; from then on the thread
//! reaches the page at native speed. The frames stay vmfault's: `read`,
//! `write`, holds, fork, the page daemon and swap see the same frame, and
//! two views of two spaces that share a page show one frame.
//!
//! The window is a second MMU behind the space's page table
//! (`pmap::SecondMmu`): every PTE that loses its frame or a right
//! (munmap, mprotect, `MADV_DONTNEED`, fork's write protection,
//! copy-on-write, the page daemon's unmap before pageout, write-back's
//! write protection) takes the host mappings of its range away before the
//! change returns, in one host call per range, so the next access faults
//! again and finds what the space holds now. The host's
//! `munmap`/`mprotect` is the TLB shootdown.
//!
//! # Why this design
//! Measured on the project's 2-CPU machine (`../notes`' userfaultfd study,
//! Linux 6.18): the kernel's own anonymous fault costs 1.4-1.9 us;
//! userfaultfd in `SIGBUS` mode costs 3.6-5.5 us with `UFFDIO_CONTINUE`
//! and 5.6-7 us with `UFFDIO_COPY`, and `COPY` gives the view a copy of the
//! page, not vmfault's frame. A `SIGSEGV` on the faulting thread plus one
//! `mmap` of the arena's memfd at the frame's offset keeps the frame
//! vmfault's (one copy of every page, coherent with the API by
//! construction) and needs no handler thread (a single handler thread is
//! what caps Umap at 18-65k faults/s).
//!
//! # What it asks of the embedding program
//! - `VmConfig::host_views` (the frame arena is then a memfd; the host
//!   gives shared memory transparent huge pages only if its
//!   `shmem_enabled` allows them).
//! - A system call that reads or writes a page of the view that is not
//!   mapped yet fails with `EFAULT` in the host kernel instead of
//!   faulting: [`HostView::populate`] the buffer first.
//! - The handler runs on the faulting thread, on its own stack, and takes
//!   vmfault's locks: a thread must not touch view memory from inside a
//!   vmfault call, from inside `malloc`, or from a signal handler of its
//!   own. The first fault of a new mapping may allocate (its object).
//! - A fault the space cannot satisfy (no mapping, no right: vmfault's
//!   `Error::Segv`, `Error::Bus`) goes to the view's handler if it has one
//!   ([`AddressSpace::host_view_with_handler`]); otherwise the process gets
//!   the signal as it would natively (its default action). Faults outside
//!   every view go to the handler installed before vmfault's.
//! - The page daemon does not see native accesses (no accessed bit): a
//!   page used only through a view looks idle to it.
//! - x86-64 Linux only.

use std::sync::{Arc, Weak};

use super::{AddressSpace, Space};
use crate::error::{Error, Op, Result};
use crate::phys::Pfn;
use crate::phys::window::{Window, WindowFault};
use crate::pmap::{Pmap, Pte, SecondMmu};
use crate::stats::Counter;
use crate::types::{Access, PAGE_SIZE, TASK_SIZE, is_page_aligned};

/// A fault through a host view that the space could not satisfy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFault {
    /// The faulting address, in the space.
    pub addr: u64,
    /// What the access was.
    pub access: Access,
    /// Why the space refused it (`Error::Segv`, `Error::Bus`, ...).
    pub error: Error,
}

/// What a view's handler is given, in the signal handler: return `true`
/// to run the access again (after making it possible, e.g. with
/// `mprotect`), `false` to end it with its signal.
pub type HostFaultHandler = Box<dyn Fn(&HostFault) -> bool + Send + Sync>;

/// A window of this process's address space that mirrors a range of an
/// [`AddressSpace`] (see the module docs). Dropping it gives the window
/// back.
///
/// ```
/// use vmfault::{Vm, VmConfig, Prot, MapFlags};
/// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, host_views: true, ..VmConfig::default() })?;
/// let space = vm.new_space()?;
/// let a = space.mmap(0, 1 << 20, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
/// let view = space.host_view(a, 1 << 20)?;
/// let p = view.ptr(a + 8)?.cast::<u64>();
/// unsafe { p.write(42) }; // faults into vmfault once, then runs natively
/// let mut b = [0u8; 8];
/// space.read(a + 8, &mut b)?; // the same frame
/// assert_eq!(u64::from_le_bytes(b), 42);
/// # Ok::<(), vmfault::Error>(())
/// ```
pub struct HostView {
    /// The view's state, which the window's faults reach (weakly).
    core: Arc<ViewCore>,
}

impl std::fmt::Debug for HostView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostView").field("lo", &self.core.lo).field("len", &self.core.len).finish_non_exhaustive()
    }
}

/// The host mappings of a view: what the page table tells of lost frames
/// and rights. Holds no reference to the space (the space's page table
/// holds it).
#[derive(Debug)]
struct Mirror {
    /// `[I]` the window.
    window: Window,
    /// `[I]` the first address of the space it mirrors.
    lo: u64,
    /// `[I]` its length in bytes.
    len: u64,
}

impl SecondMmu for Mirror {
    fn invalidate(&self, start: u64, end: u64) {
        let (s, e) = (start.max(self.lo), end.min(self.lo + self.len));
        if s < e {
            self.window.unmap(s - self.lo, e - s);
        }
    }
}

/// What a view's faults reach.
struct ViewCore {
    /// `[I]` the space (a handle: the view keeps it alive).
    space: AddressSpace,
    /// `[I]` the window and its coherence.
    mirror: Arc<Mirror>,
    /// `[I]` the first address it mirrors.
    lo: u64,
    /// `[I]` its length in bytes.
    len: u64,
    /// `[I]` where faults the space refuses go.
    handler: Option<HostFaultHandler>,
    /// `[I]` pages a fault maps around the faulting one
    /// (`VmConfig::view_fault_around`, a power of two up to 512).
    around: u64,
}

impl WindowFault for ViewCore {
    fn fault(&self, offset: u64, access: Access) -> std::result::Result<(), libc::c_int> {
        let addr = self.lo + offset;
        let page = addr & !(PAGE_SIZE - 1);
        // Fault around: the aligned block of `view_fault_around` pages that
        // holds the page, inside the view (one page-table page at most).
        let block = self.around * PAGE_SIZE;
        let lo = (page & !(block - 1)).max(self.lo);
        let hi = ((page & !(block - 1)) + block).min(self.lo + self.len);
        let r = self.space.s.resolve_run(Op::HostView, page, lo, hi, access, |a, pfn, pages, pte| {
            self.mirror.window.map_run(a - self.lo, pfn, pages, pte.allows(Access::Write), pte.allows(Access::Exec))
        });
        let error = match r {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        let signal = match error {
            Error::Segv { .. } => libc::SIGSEGV,
            _ => libc::SIGBUS,
        };
        if let Error::Host { call, .. } = &error
            && self.handler.is_none()
        {
            // The process is about to end with SIGBUS: say why.
            crate::phys::window::say(&["vmfault: ", call, "\n"]);
        }
        match &self.handler {
            Some(h) if h(&HostFault { addr, access, error }) => Ok(()),
            _ => Err(signal),
        }
    }
}

impl Drop for ViewCore {
    fn drop(&mut self) {
        let second: Arc<dyn SecondMmu> = self.mirror.clone();
        self.space.s.pmap.detach_second(&second);
    }
}

impl AddressSpace {
    /// Reserve a window of this process's address space that mirrors
    /// `lo..lo + len` of this space (page-aligned, inside the user address
    /// space): see [`HostView`]. Needs `VmConfig::host_views`.
    ///
    /// Errors: `EINVAL` for a bad range; `EOPNOTSUPP` without
    /// `host_views`, off x86-64 Linux, or with more views at once than a
    /// process may hold (64); the host's errno if it refuses the window.
    pub fn host_view(&self, lo: u64, len: u64) -> Result<HostView> {
        self.make_view(lo, len, None)
    }

    /// [`host_view`](AddressSpace::host_view), with a handler for the
    /// faults the space refuses (it runs in the signal handler: see the
    /// module docs of [`HostView`] for what it may do).
    pub fn host_view_with_handler(&self, lo: u64, len: u64, handler: HostFaultHandler) -> Result<HostView> {
        self.make_view(lo, len, Some(handler))
    }

    fn make_view(&self, lo: u64, len: u64, handler: Option<HostFaultHandler>) -> Result<HostView> {
        let op = Op::HostView;
        if !is_page_aligned(lo) {
            return Err(Error::inval(op, "view start not page-aligned", lo));
        }
        if len == 0 || !is_page_aligned(len) {
            return Err(Error::inval(op, "view length zero or not page-aligned", len));
        }
        if lo > TASK_SIZE || len > TASK_SIZE - lo {
            return Err(Error::inval(op, "view extends beyond the user address space", len));
        }
        let window = self.s.vm.m.phys.window(len)?;
        let mirror = Arc::new(Mirror { window, lo, len });
        let around = self.s.vm.m.config.view_fault_around as u64;
        let core = Arc::new(ViewCore { space: self.clone(), mirror: mirror.clone(), lo, len, handler, around });
        let owner: Weak<dyn WindowFault> = Arc::downgrade(&core) as Weak<ViewCore>;
        mirror.window.set_owner(owner);
        self.s.pmap.attach_second(mirror);
        Ok(HostView { core })
    }
}

impl HostView {
    /// Where byte `addr` of the space is in this process.
    ///
    /// Errors: `EINVAL` if `addr` is outside the view.
    pub fn ptr(&self, addr: u64) -> Result<*mut u8> {
        let c = &self.core;
        if addr < c.lo || addr - c.lo >= c.len {
            return Err(Error::inval(Op::HostView, "address outside the view", addr));
        }
        // In bounds: `addr - lo < len`, the window's length.
        Ok(c.mirror.window.base().wrapping_add((addr - c.lo) as usize))
    }

    /// The first address of the space the view mirrors, and its length.
    pub fn range(&self) -> (u64, u64) {
        (self.core.lo, self.core.len)
    }

    /// Fault `addr..addr + len` in for `access` and map it into the view
    /// now, so that a host system call on it (`read(2)` into it, say)
    /// finds it mapped instead of failing with `EFAULT`. The pages stay
    /// mapped until the space takes them away (munmap, mprotect, fork,
    /// the page daemon...).
    ///
    /// Errors: `EINVAL` outside the view; `Error::Segv` (`EFAULT`) where
    /// the space refuses the access, as a load or store would.
    pub fn populate(&self, addr: u64, len: u64, access: Access) -> Result<()> {
        let c = &self.core;
        let end = addr.checked_add(len).ok_or(Error::inval(Op::HostView, "range overflows", len))?;
        if addr < c.lo || end > c.lo + c.len {
            return Err(Error::inval(Op::HostView, "range outside the view", addr));
        }
        let mut page = addr & !(PAGE_SIZE - 1);
        while page < end {
            c.space.s.resolve_run(Op::HostView, page, page, page + PAGE_SIZE, access, |a, pfn, pages, pte| {
                c.mirror.window.map_run(a - c.lo, pfn, pages, pte.allows(Access::Write), pte.allows(Access::Exec))
            })?;
            page += PAGE_SIZE;
        }
        Ok(())
    }
}

impl Space {
    /// Resolve page `page` for `access` as a load or store would (faulting
    /// it in), and with it the pages of `lo..hi` (page-aligned, holding
    /// `page`, inside one page-table page) that its mapping covers and
    /// allows the access to (fault-around: faulted in too, their errors
    /// ignored); then, under the PTE lock of that page-table page, call
    /// `map(addr, frame, pages, pte)` for each run of present pages whose
    /// frames are consecutive, with the rights of their PTEs (the zero
    /// page only for `page` itself). Whatever `map` builds from the PTEs
    /// cannot outlive them unseen: taking one away takes that lock first
    /// and then tells the second MMUs (`pmap::SecondMmu`).
    pub(crate) fn resolve_run(
        &self,
        op: Op,
        page: u64,
        lo: u64,
        hi: u64,
        access: Access,
        mut map: impl FnMut(u64, Pfn, u64, Pte) -> Result<()>,
    ) -> Result<()> {
        debug_assert!(lo <= page && page < hi && (hi - 1) >> 21 == lo >> 21, "{lo:#x}..{hi:#x} around {page:#x}");
        self.vm.with_ctx(|ctx| {
            ctx.count(Counter::host_view_faults);
            let t0 = std::time::Instant::now();
            let phys = &ctx.env.phys;
            let slot = |a: u64| ((a >> 12) & 511) as usize;
            let r = loop {
                self.access(ctx, op, page, 1, access, |_, _, _, _| {})?;
                if hi - lo > PAGE_SIZE {
                    let span = {
                        let section = ctx.rcu_read();
                        let vma = self.snapshot(&section, page).find(page);
                        vma.filter(|v| v.prot.allows(access)).map(|v| (v.start.max(lo), v.end.min(hi)))
                    };
                    let (s, e) = span.unwrap_or((page, page));
                    for q in (s..e).step_by(PAGE_SIZE as usize).filter(|&q| q != page) {
                        let _ = self.access(ctx, op, q, 1, access, |_, _, _, _| {});
                    }
                }
                let _section = ctx.rcu_read();
                let Some(leaf) = self.pmap.pte(phys, page) else { continue };
                let (_ptl, _) = Pmap::lock(phys, &leaf);
                let words = phys.words(leaf.node());
                let pte_at = |a: u64| Pte(words[slot(a)].load(std::sync::atomic::Ordering::Relaxed));
                if !pte_at(page).allows(access) {
                    // Taken away between the fault and the lock: again.
                    continue;
                }
                let zero = phys.zero_pfn();
                let mut q = lo;
                let mut mapped = Ok(());
                while q < hi && mapped.is_ok() {
                    let p = pte_at(q);
                    if !p.is_present() || (q != page && p.pfn() == zero) {
                        q += PAGE_SIZE;
                        continue;
                    }
                    let rights = (p.allows(Access::Write), p.allows(Access::Exec));
                    let mut n = 1;
                    while p.pfn() != zero && q + n * PAGE_SIZE < hi {
                        let r = pte_at(q + n * PAGE_SIZE);
                        let next = r.is_present()
                            && r.pfn().raw() == p.pfn().raw() + n as u32
                            && (r.allows(Access::Write), r.allows(Access::Exec)) == rights;
                        if !next {
                            break;
                        }
                        n += 1;
                    }
                    if phys.queues.is_some() && p.pfn() != zero {
                        (0..n).for_each(|k| phys.page(Pfn::decode(p.pfn().raw() + k as u32)).touch());
                    }
                    let t1 = std::time::Instant::now();
                    mapped = map(q, p.pfn(), n, p);
                    ctx.count_n(Counter::host_view_map_ns, t1.elapsed().as_nanos() as u64);
                    q += n * PAGE_SIZE;
                }
                break mapped;
            };
            ctx.count_n(Counter::host_view_ns, t0.elapsed().as_nanos() as u64);
            r
        })
    }
}
