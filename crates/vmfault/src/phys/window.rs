//! Host windows: ranges of this process's address space whose host
//! mappings show frames of the arena, so that code loads, stores and runs
//! atomics on guest memory natively, and whose faults come to vmfault.
//!
//! A window is reserved `PROT_NONE` (anonymous, `NORESERVE`: it costs no
//! memory). A fault in it is a `SIGSEGV` that this module's handler, one
//! per process, takes on the faulting thread: it finds the window by
//! address in a fixed table of slots (no lock, no allocation) and asks the
//! window's owner ([`WindowFault`], the address space's host view) to make
//! the page translate; the owner maps the frame with [`Window::map_frame`]
//! (`mmap(MAP_SHARED | MAP_FIXED)` of the arena's memfd at the frame's
//! offset, as User-Mode Linux maps its physical-memory file and gVisor its
//! memory file) and the instruction runs again. Taking a page away is
//! [`Window::unmap`]: the range goes back to `PROT_NONE` (never a hole,
//! which another mapping of the process could take). Host mappings of
//! neighbouring pages whose frames are neighbours too merge into one
//! host VMA.
//!
//! Faults outside every window go to the handler installed before this
//! one (Rust's own stack-overflow handler, or the embedding program's);
//! a fault the owner cannot satisfy is delivered as it would be natively
//! (the default action: the process ends with the signal), unless the
//! owner's own handler asked for the access to be tried again.
//!
//! What this asks of the embedding program: the handler runs on the
//! faulting thread's own stack (not `SA_ONSTACK`), uses no heap in the
//! steady state but may allocate when a fault is the first one of a new
//! mapping (its object) or grows a stack (`MAP_GROWSDOWN`), and takes vmfault's locks: a thread must not
//! touch window memory from inside a vmfault call, from inside `malloc`,
//! or from a signal handler of its own. x86-64 Linux only (the fault's
//! kind is read from the page-fault error code in the signal context).

use std::ptr::NonNull;
use std::sync::Weak;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::error::{Error, Result};
use crate::types::{Access, PAGE_SIZE};

use super::Pfn;
use super::arena::Arena;

/// Host windows that can exist at once in a process.
pub(crate) const MAX_WINDOWS: usize = 64;

/// What a window's faults go to.
pub(crate) trait WindowFault: Send + Sync {
    /// A fault at byte `offset` of the window for `access`: make the page
    /// translate (`Ok`), or say which signal the access ends in.
    fn fault(&self, offset: u64, access: Access) -> std::result::Result<(), libc::c_int>;
}

/// A window's entry in the process's table. Never freed (at most one per
/// window ever made): the handler may still read one whose window has
/// gone, and its `active` count is what the window's end waits on.
struct Entry {
    /// `[I]` first address.
    base: usize,
    /// `[I]` length in bytes.
    len: usize,
    /// `[a]` the owner (gone when the owner is), set once, just after the
    /// window is made (nobody can fault in it before).
    owner: std::sync::OnceLock<Weak<dyn WindowFault>>,
    /// `[a]` handlers inside this entry's window now (SeqCst with the slot
    /// store of `Drop for Window`).
    active: AtomicUsize,
}

/// `[a]` the windows, by slot (null: free); Acquire/Release with their
/// entries' contents.
static SLOTS: [AtomicPtr<Entry>; MAX_WINDOWS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_WINDOWS];

/// `[I]` (set once, before the handler is installed) the `SIGSEGV`
/// action this module's handler replaced.
static PREVIOUS: std::sync::OnceLock<libc::sigaction> = std::sync::OnceLock::new();

/// The handler is installed once per process.
static INSTALL: std::sync::Once = std::sync::Once::new();

/// A reserved range of the host address space whose pages show arena
/// frames (see the module docs).
#[derive(Debug)]
pub(crate) struct Window {
    /// `[I]` first byte.
    base: NonNull<u8>,
    /// `[I]` length in bytes (whole pages).
    len: usize,
    /// `[I]` its slot in the process's table.
    slot: usize,
    /// `[I]` the memfd of the arena it shows (borrowed from its `Vm`).
    fd: libc::c_int,
}

// SAFETY: the window is an address range; its host mappings are changed
// by system calls, which the kernel serializes.
#[allow(unsafe_code)]
unsafe impl Send for Window {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Window {}

impl Window {
    /// Reserve a window of `len` bytes (whole pages) over `arena`; its
    /// faults go to the owner [`set_owner`](Window::set_owner) names.
    #[allow(unsafe_code)]
    pub(crate) fn new(arena: &Arena, len: u64) -> Result<Window> {
        let unsupported = |reason| Error::NotSupported { op: crate::error::Op::HostView, reason, value: len };
        if !cfg!(all(target_arch = "x86_64", target_os = "linux")) || cfg!(miri) {
            return Err(unsupported("host views need x86-64 Linux"));
        }
        let Some(fd) = arena.fd() else {
            return Err(unsupported("host views need VmConfig::host_views (the arena must be shared memory)"));
        };
        install_handler();
        let len = usize::try_from(len).map_err(|_| unsupported("a window that large"))?;
        // SAFETY: a fresh reservation; no existing memory is affected.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_NONE, reserve_flags(), -1, 0) };
        if p == libc::MAP_FAILED {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::ENOMEM);
            return Err(Error::Host { call: "mmap reserving a host view", errno });
        }
        let entry = Box::into_raw(Box::new(Entry {
            base: p as usize,
            len,
            owner: std::sync::OnceLock::new(),
            active: AtomicUsize::new(0),
        }));
        let slot = SLOTS
            .iter()
            .position(|s| s.compare_exchange(std::ptr::null_mut(), entry, Ordering::AcqRel, Ordering::Relaxed).is_ok());
        let Some(slot) = slot else {
            // SAFETY: the entry was never published; the reservation is ours.
            unsafe {
                drop(Box::from_raw(entry));
                libc::munmap(p, len);
            }
            return Err(Error::NotSupported {
                op: crate::error::Op::HostView,
                reason: "more host views at once than a process may hold (MAX_WINDOWS)",
                value: MAX_WINDOWS as u64,
            });
        };
        let fd = std::os::fd::AsRawFd::as_raw_fd(&fd);
        Ok(Window { base: NonNull::new(p.cast()).expect("mmap returned null"), len, slot, fd })
    }

    /// Where the window's faults go from now on (once).
    #[allow(unsafe_code)]
    pub(crate) fn set_owner(&self, owner: Weak<dyn WindowFault>) {
        // SAFETY: the slot holds this window's entry until it drops, and
        // entries are never freed.
        let e = unsafe { &*SLOTS[self.slot].load(Ordering::Acquire) };
        assert!(e.owner.set(owner).is_ok(), "a window's owner is set once");
    }

    /// The window's first byte.
    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Map `pages` frames from `pfn` on (consecutive in the arena) at byte
    /// `offset` (page-aligned) of the window on, with `write` and `exec`
    /// rights beside read; populated at once (no second host fault).
    #[allow(unsafe_code)]
    pub(crate) fn map_run(&self, offset: u64, pfn: Pfn, pages: u64, write: bool, exec: bool) -> Result<()> {
        let off = self.page(offset);
        let len = usize::try_from(pages * PAGE_SIZE).unwrap_or(usize::MAX);
        assert!(pages > 0 && len <= self.len - off, "a run of {pages} pages past the end of a host view");
        let mut prot = libc::PROT_READ;
        if write {
            prot |= libc::PROT_WRITE;
        }
        if exec {
            prot |= libc::PROT_EXEC;
        }
        let flags = libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE;
        let file_off = libc::off_t::from(pfn.0) * PAGE_SIZE as libc::off_t;
        // SAFETY: the pages lie inside this window, which this value owns
        // and nothing else maps; `fd` is the arena's memfd, which outlives
        // the window (the view holds its space, which holds the `Vm`).
        let p = unsafe { libc::mmap(self.base().add(off).cast(), len, prot, flags, self.fd, file_off) };
        if p == libc::MAP_FAILED {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::ENOMEM);
            let call = match errno {
                // Each run of frames is a host mapping unless it merges
                // with its neighbours (consecutive frames, the same rights).
                libc::ENOMEM => {
                    "mmap of frames into a host view: the process has as many mappings as vm.max_map_count allows"
                }
                _ => "mmap of frames into a host view",
            };
            return Err(Error::Host { call, errno });
        }
        Ok(())
    }

    /// Take bytes `offset..offset + len` of the window (clipped to it,
    /// widened to pages) away: back to `PROT_NONE`, so the next access
    /// faults. One system call for the whole range.
    #[allow(unsafe_code)]
    pub(crate) fn unmap(&self, offset: u64, len: u64) {
        let start = self.page(offset);
        let end = usize::try_from(offset.saturating_add(len).div_ceil(PAGE_SIZE) * PAGE_SIZE)
            .unwrap_or(usize::MAX)
            .min(self.len);
        if start >= end {
            return;
        }
        // SAFETY: the range lies inside this window; replacing it with a
        // fresh reservation affects nothing else.
        let p = unsafe {
            libc::mmap(
                self.base().add(start).cast(),
                end - start,
                libc::PROT_NONE,
                reserve_flags() | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        // A failure (ENOMEM: the process is out of mappings) would leave a
        // stale translation: nothing can go on safely.
        assert!(
            p != libc::MAP_FAILED,
            "a host view could not unmap {:#x} bytes: {}",
            end - start,
            std::io::Error::last_os_error()
        );
    }

    /// Byte `offset` rounded down to its page, checked to lie inside.
    fn page(&self, offset: u64) -> usize {
        let off = usize::try_from(offset).unwrap_or(usize::MAX);
        assert!(off < self.len, "offset {offset:#x} outside a host view of {:#x} bytes", self.len);
        off & !(PAGE_SIZE as usize - 1)
    }
}

impl Drop for Window {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        let entry = SLOTS[self.slot].swap(std::ptr::null_mut(), Ordering::SeqCst);
        // SAFETY: entries are never freed.
        let e = unsafe { &*entry };
        // A handler that found the entry before the slot was cleared may
        // still be mapping into the window: it must be done before the
        // range is given back (else its MAP_FIXED could land in whatever
        // the process maps there next).
        while e.active.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        // SAFETY: unmapping exactly the reservation this value owns.
        unsafe { libc::munmap(self.base().cast(), self.len) };
    }
}

/// Write `parts` to standard error with `write(2)`, which a signal
/// handler may call (no allocation, no lock).
#[allow(unsafe_code)]
pub(crate) fn say(parts: &[&str]) {
    for p in parts {
        // SAFETY: writing a buffer we borrow to standard error.
        let _ = unsafe { libc::write(2, p.as_ptr().cast(), p.len()) };
    }
}

fn reserve_flags() -> libc::c_int {
    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE
}

/// Install the `SIGSEGV` handler, once per process.
#[allow(unsafe_code)]
fn install_handler() {
    INSTALL.call_once(|| {
        // SAFETY: a zeroed `sigaction` is valid; the handler is an `extern
        // "C"` function of the right signature; the action it replaces is
        // read first and kept before it is installed.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            let rc = libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut old);
            assert_eq!(rc, 0, "sigaction(SIGSEGV): {}", std::io::Error::last_os_error());
            let _ = PREVIOUS.set(old);
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_segv as *const () as usize;
            act.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut act.sa_mask);
            let rc = libc::sigaction(libc::SIGSEGV, &act, std::ptr::null_mut());
            assert_eq!(rc, 0, "sigaction(SIGSEGV): {}", std::io::Error::last_os_error());
        }
    });
}

/// The `SIGSEGV` handler (see the module docs).
#[allow(unsafe_code)]
extern "C" fn on_segv(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid `siginfo_t` and `ucontext_t`; errno
    // is this thread's; entries are never freed; the rest is in the
    // comments below.
    unsafe {
        let errno = *libc::__errno_location();
        let addr = (*info).si_addr() as usize;
        for slot in &SLOTS {
            let e = slot.load(Ordering::Acquire);
            if e.is_null() || addr < (*e).base || addr - (*e).base >= (*e).len {
                continue;
            }
            let e = &*e;
            e.active.fetch_add(1, Ordering::SeqCst);
            // Still there after the count went up: the window's end waits
            // for us (SeqCst: its slot store and our count are ordered).
            let answer = if slot.load(Ordering::SeqCst).cast_const() == std::ptr::from_ref(e) {
                let owner = e.owner.get().and_then(Weak::upgrade);
                let answer = owner.as_ref().map(|o| o.fault((addr - e.base) as u64, access_of(ctx)));
                // Let go of the count before the owner: dropping the last
                // reference ends the window, which waits for the count.
                e.active.fetch_sub(1, Ordering::SeqCst);
                drop(owner);
                answer
            } else {
                e.active.fetch_sub(1, Ordering::SeqCst);
                None
            };
            match answer {
                Some(Ok(())) => {
                    *libc::__errno_location() = errno;
                    return;
                }
                Some(Err(signal)) => return deliver(signal, errno),
                // The window went meanwhile: the address is no longer
                // ours; whoever mapped it next decides.
                None => break,
            }
        }
        *libc::__errno_location() = errno;
        chain(sig, info, ctx);
    }
}

/// The kind of access that faulted, from the x86 page-fault error code.
#[allow(unsafe_code)]
unsafe fn access_of(ctx: *mut libc::c_void) -> Access {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        // SAFETY: the caller's `ctx` is the handler's `ucontext_t`.
        let err = unsafe { (*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_ERR as usize] };
        if err & 0x10 != 0 {
            Access::Exec
        } else if err & 0x2 != 0 {
            Access::Write
        } else {
            Access::Read
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    {
        let _ = ctx;
        Access::Write
    }
}

/// End the access with `signal`, as natively: its default action.
#[allow(unsafe_code)]
unsafe fn deliver(signal: libc::c_int, errno: libc::c_int) {
    // SAFETY: resetting a disposition and raising a signal are
    // async-signal-safe; the faulting instruction runs again on return and
    // takes `SIGSEGV` with its default action, or `SIGBUS` is raised.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        if signal != libc::SIGSEGV {
            libc::raise(signal);
        }
        *libc::__errno_location() = errno;
    }
}

/// Hand a fault outside every window to the handler installed before.
#[allow(unsafe_code)]
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: calling the previous handler with the kernel's arguments is
    // what it expects.
    unsafe {
        let h = PREVIOUS.get().map_or(libc::SIG_DFL, |p| p.sa_sigaction);
        let siginfo = PREVIOUS.get().is_some_and(|p| p.sa_flags & libc::SA_SIGINFO != 0);
        if h == libc::SIG_DFL || h == libc::SIG_IGN {
            // Run again, the fault kills the process as it would have.
            libc::signal(sig, libc::SIG_DFL);
        } else if siginfo {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) = std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}
