//! What a workload runs on: vmfault or the host kernel.
//!
//! Workloads are written once, generic over [`Target`], so the vmfault run
//! and its host-kernel twin execute the same loop with the same parameters.
//! Monomorphization keeps the trait out of the measured path.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use vmfault::{AddressSpace, CpuGuard, HostView, MapFlags, Prot, Stats, Vm};

/// A failed operation inside a workload, as text for the report.
pub type OpError = String;

/// The memory operations the workloads need.
pub trait Target: Sync {
    /// What a worker thread holds while it runs (a vCPU attachment).
    type ThreadGuard;

    /// Called by each worker thread before it starts.
    fn enter_thread(&self) -> Self::ThreadGuard;

    /// Map `len` bytes of private anonymous read-write memory anywhere.
    fn map(&self, len: u64) -> Result<u64, OpError>;

    /// Map `len` bytes of private anonymous memory, read-write or
    /// `PROT_NONE` (a reservation: no merges with read-write neighbours),
    /// at `hint` if that range is free (a hint, not `MAP_FIXED`).
    fn map_near(&self, hint: u64, len: u64, writable: bool) -> Result<u64, OpError>;

    /// Map `len` bytes of private anonymous read-write memory at `addr`,
    /// replacing what is there (`MAP_FIXED`).
    fn map_fixed(&self, addr: u64, len: u64) -> Result<(), OpError>;

    /// Unmap `addr..addr+len`.
    fn unmap(&self, addr: u64, len: u64) -> Result<(), OpError>;

    /// Store one zero byte at `addr` (`c[i] = 0`).
    fn store(&self, addr: u64) -> Result<(), OpError>;

    /// Fork; in the child, store one byte in each page of `addr..addr+len`
    /// (copy-on-write faults), then end the child and wait for it.
    fn fork_touch(&self, addr: u64, len: u64) -> Result<(), OpError>;

    /// Map `len` bytes of `file` read-write from offset 0, shared or private.
    fn map_file(&self, file: &File, len: u64, shared: bool) -> Result<u64, OpError>;

    /// One exec-like cycle (exec1): map the `binary`'s text (private,
    /// read-execute) and data (private, read-write) and an anonymous stack,
    /// read `image.text_touch` pages of text, write every data and stack
    /// page, and tear it all down (vmfault: in a new address space, dropped
    /// at the end, as exec and exit do).
    fn exec(&self, binary: &File, image: &Image) -> Result<(), OpError>;

    /// One shared64 cycle (vmfault only): a space maps `len` bytes of
    /// shared anonymous memory and writes every page, forks `members - 1`
    /// children that each read every page, then every space unmaps it.
    fn share_cycle(&self, len: u64, members: usize) -> Result<ShareCycle, OpError>;

    /// mlock1 (vmfault only): in an address space of this worker's own
    /// (a process of the seed's test), `mlock` and `munlock` `len` bytes
    /// until `stop`: a range of its own, or with `shared` one range of
    /// shared memory that every worker's space maps. Returns the cycles.
    fn mlock_loop(&self, len: u64, shared: bool, stop: &AtomicBool) -> Result<u64, OpError>;

    /// vmfault's statistics, if this is vmfault.
    fn stats(&self) -> Option<Stats>;

    /// A target for a worker of its own process (processes mode): vmfault
    /// gives a new address space of the same machine; `None` where the
    /// harness forks instead (the host).
    fn new_process(&self) -> Result<Option<Self>, OpError>
    where
        Self: Sized;
}

/// The layout of exec1's "binary" and what one exec touches.
#[derive(Debug, Clone, Copy)]
pub struct Image {
    /// Bytes of text, from offset 0 of the binary.
    pub text: u64,
    /// Pages of text read by one exec (spread over the text).
    pub text_touch: u64,
    /// Bytes of data, right after the text in the binary.
    pub data: u64,
    /// Bytes of stack (anonymous).
    pub stack: u64,
}

/// What one shared64 cycle measured.
#[derive(Debug, Clone, Copy, Default)]
pub struct ShareCycle {
    /// Forks done.
    pub forks: u64,
    /// Nanoseconds spent in `fork` (not in the children's faults).
    pub fork_ns: u64,
    /// Nanoseconds to unmap the shared range in every space.
    pub unmap_ns: u64,
    /// Reverse-map metadata with every space mapping every page.
    pub rmap_bytes: u64,
    /// pv entries then.
    pub pv_entries: u64,
    /// Backing records then.
    pub backing_records: u64,
}

fn touch_image(
    load: impl Fn(u64) -> Result<(), OpError>,
    store: impl Fn(u64) -> Result<(), OpError>,
    text: u64,
    data: u64,
    stack: u64,
    image: &Image,
) -> Result<(), OpError> {
    let pages = image.text / 4096;
    for i in 0..image.text_touch.min(pages) {
        load(text + (i * pages / image.text_touch.max(1)) * 4096)?;
    }
    for a in (data..data + image.data).step_by(4096) {
        store(a)?;
    }
    for a in (stack..stack + image.stack).step_by(4096) {
        store(a)?;
    }
    Ok(())
}

/// vmfault: one address space of a `Vm`; workers attach as vCPUs.
#[derive(Debug, Clone)]
pub struct VmTarget {
    vm: Vm,
    space: AddressSpace,
    /// With `host_views` (the bench's `access=native`): a view of the
    /// range unhinted mappings take (the top `NATIVE_SPAN` below the mmap
    /// base), through which stores there go natively.
    view: Option<Arc<HostView>>,
    /// mlock1_shared's parent: a space holding the shared range its
    /// workers' spaces are forked from (made by the first worker).
    lock_parent: Arc<Mutex<Option<(AddressSpace, u64)>>>,
}

impl VmTarget {
    /// A fresh address space in `vm` (with a host view of where its
    /// mappings go if `vm` has `host_views`).
    pub fn new(vm: &Vm) -> Result<VmTarget, OpError> {
        let space = vm.new_space().map_err(|e| e.to_string())?;
        let view = match vm.config().host_views {
            true => Some(Arc::new(
                space.host_view(NATIVE_TOP - NATIVE_SPAN, NATIVE_SPAN).map_err(|e| format!("access=native: {e}"))?,
            )),
            false => None,
        };
        Ok(VmTarget { vm: vm.clone(), space, view, lock_parent: Arc::default() })
    }

    /// The address space.
    pub fn space(&self) -> &AddressSpace {
        &self.space
    }
}

const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

/// The top of the range unhinted mmaps take (Linux's mmap base in
/// vmfault's layout: 128 MiB below the end of the user address space).
const NATIVE_TOP: u64 = vmfault::TASK_SIZE - (128 << 20);

/// How much below it `access=native` views (address space only: the
/// window costs no memory).
const NATIVE_SPAN: u64 = 64 << 30;

impl Target for VmTarget {
    type ThreadGuard = Option<CpuGuard>;

    fn enter_thread(&self) -> Option<CpuGuard> {
        // More threads than vCPU slots share the unattached slot.
        self.vm.attach().ok()
    }

    #[inline]
    fn map(&self, len: u64) -> Result<u64, OpError> {
        self.space.mmap(0, len, RW, PA).map_err(|e| e.to_string())
    }

    fn map_near(&self, hint: u64, len: u64, writable: bool) -> Result<u64, OpError> {
        self.space.mmap(hint, len, if writable { RW } else { Prot::NONE }, PA).map_err(|e| e.to_string())
    }

    #[inline]
    fn map_fixed(&self, addr: u64, len: u64) -> Result<(), OpError> {
        self.space.mmap(addr, len, RW, PA | MapFlags::FIXED).map(|_| ()).map_err(|e| e.to_string())
    }

    #[inline]
    fn unmap(&self, addr: u64, len: u64) -> Result<(), OpError> {
        self.space.munmap(addr, len).map_err(|e| e.to_string())
    }

    #[inline]
    fn store(&self, addr: u64) -> Result<(), OpError> {
        if let Some(p) = self.view.as_ref().and_then(|v| v.ptr(addr).ok()) {
            // SAFETY: inside the view; a fault there is resolved by vmfault
            // or ends the process as natively (workloads store only into
            // their own read-write mappings).
            unsafe { std::ptr::write_volatile(p, 0) };
            return Ok(());
        }
        self.space.write(addr, &[0]).map_err(|e| e.to_string())
    }

    fn fork_touch(&self, addr: u64, len: u64) -> Result<(), OpError> {
        let child = self.space.fork().map_err(|e| e.to_string())?;
        for a in (addr..addr + len).step_by(4096) {
            child.write(a, &[0]).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn map_file(&self, file: &File, len: u64, shared: bool) -> Result<u64, OpError> {
        let flags = if shared { MapFlags::SHARED } else { MapFlags::PRIVATE };
        self.space.mmap_file(0, len, RW, flags, file, 0).map_err(|e| e.to_string())
    }

    fn exec(&self, binary: &File, image: &Image) -> Result<(), OpError> {
        let e = |e: vmfault::Error| e.to_string();
        let s = self.vm.new_space().map_err(e)?;
        let text = s.mmap_file(0, image.text, Prot::READ | Prot::EXEC, MapFlags::PRIVATE, binary, 0).map_err(e)?;
        let data = s.mmap_file(0, image.data, RW, MapFlags::PRIVATE, binary, image.text).map_err(e)?;
        let stack = s.mmap(0, image.stack, RW, PA).map_err(e)?;
        touch_image(
            |a| s.read(a, &mut [0u8; 1]).map_err(e),
            |a| s.write(a, &[0]).map_err(e),
            text,
            data,
            stack,
            image,
        )?;
        drop(s); // exit: every mapping goes
        Ok(())
    }

    fn share_cycle(&self, len: u64, members: usize) -> Result<ShareCycle, OpError> {
        let e = |e: vmfault::Error| e.to_string();
        let parent = self.vm.new_space().map_err(e)?;
        let a = parent.mmap(0, len, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).map_err(e)?;
        for p in (a..a + len).step_by(4096) {
            parent.write(p, &[1]).map_err(e)?;
        }
        let mut c = ShareCycle::default();
        let mut spaces = vec![parent.clone()];
        let mut buf = [0u8; 1];
        for _ in 1..members {
            let t = Instant::now();
            let child = parent.fork().map_err(e)?;
            c.fork_ns += t.elapsed().as_nanos() as u64;
            c.forks += 1;
            for p in (a..a + len).step_by(4096) {
                child.read(p, &mut buf).map_err(e)?;
            }
            spaces.push(child);
        }
        let st = self.vm.stats();
        (c.rmap_bytes, c.pv_entries, c.backing_records) = (st.rmap_bytes, st.pv_entries, st.backing_records);
        let t = Instant::now();
        for s in &spaces {
            s.munmap(a, len).map_err(e)?;
        }
        c.unmap_ns = t.elapsed().as_nanos() as u64;
        Ok(c)
    }

    fn mlock_loop(&self, len: u64, shared: bool, stop: &AtomicBool) -> Result<u64, OpError> {
        let e = |e: vmfault::Error| e.to_string();
        let (space, a) = if shared {
            let mut parent = self.lock_parent.lock().unwrap_or_else(|p| p.into_inner());
            if parent.is_none() {
                let p = self.vm.new_space().map_err(e)?;
                let a = p.mmap(0, len, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).map_err(e)?;
                p.touch(a, vmfault::Access::Write).map_err(e)?;
                *parent = Some((p, a));
            }
            let (p, a) = parent.as_ref().expect("just made");
            (p.fork().map_err(e)?, *a)
        } else {
            let s = self.vm.new_space().map_err(e)?;
            let a = s.mmap(0, len, RW, PA).map_err(e)?;
            (s, a)
        };
        let mut ops = 0;
        while !stop.load(Ordering::Relaxed) {
            space.mlock(a, len).map_err(e)?;
            space.munlock(a, len).map_err(e)?;
            ops += 1;
        }
        Ok(ops)
    }

    fn stats(&self) -> Option<Stats> {
        Some(self.vm.stats())
    }

    fn new_process(&self) -> Result<Option<VmTarget>, OpError> {
        VmTarget::new(&self.vm).map(Some)
    }
}

/// `mmap` on the host; the address, or the errno as text.
fn host_mmap(len: u64, prot: i32, flags: i32, fd: i32, offset: u64) -> Result<u64, OpError> {
    // SAFETY: a new mapping chosen by the kernel (no MAP_FIXED): nothing
    // existing is touched.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, prot, flags, fd, offset as libc::off_t) };
    if p == libc::MAP_FAILED { Err(errno_text("mmap")) } else { Ok(p as u64) }
}

/// The host kernel: real `mmap`, `munmap` and stores in this process.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostTarget;

fn errno_text(call: &str) -> OpError {
    format!("host {call}: {}", std::io::Error::last_os_error())
}

impl Target for HostTarget {
    type ThreadGuard = ();

    fn enter_thread(&self) {}

    #[inline]
    fn map(&self, len: u64) -> Result<u64, OpError> {
        // SAFETY: a fresh anonymous mapping; nothing existing is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED { Err(errno_text("mmap")) } else { Ok(p as u64) }
    }

    fn map_near(&self, hint: u64, len: u64, writable: bool) -> Result<u64, OpError> {
        // SAFETY: a fresh anonymous mapping, at a hint (no MAP_FIXED):
        // nothing existing is touched.
        let p = unsafe {
            libc::mmap(
                hint as *mut libc::c_void,
                len as usize,
                if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_NONE },
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED { Err(errno_text("mmap")) } else { Ok(p as u64) }
    }

    #[inline]
    fn map_fixed(&self, addr: u64, len: u64) -> Result<(), OpError> {
        // SAFETY: workloads only pass ranges they reserved themselves.
        let p = unsafe {
            libc::mmap(
                addr as *mut libc::c_void,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED { Err(errno_text("mmap")) } else { Ok(()) }
    }

    #[inline]
    fn unmap(&self, addr: u64, len: u64) -> Result<(), OpError> {
        // SAFETY: workloads only unmap what they mapped.
        if unsafe { libc::munmap(addr as *mut libc::c_void, len as usize) } == 0 {
            Ok(())
        } else {
            Err(errno_text("munmap"))
        }
    }

    #[inline]
    fn store(&self, addr: u64) -> Result<(), OpError> {
        // SAFETY: workloads only store into pages of their own read-write mappings.
        unsafe { std::ptr::write_volatile(addr as *mut u8, 0) };
        Ok(())
    }

    fn fork_touch(&self, addr: u64, len: u64) -> Result<(), OpError> {
        // SAFETY: the child only stores into pages of a mapping the caller
        // owns (as in the parent) and leaves with `_exit`: nothing that the
        // fork of a multi-threaded process makes unsafe (no allocation, no
        // locks).
        unsafe {
            let pid = libc::fork();
            if pid == 0 {
                for a in (addr..addr + len).step_by(4096) {
                    std::ptr::write_volatile(a as *mut u8, 0);
                }
                libc::_exit(0);
            }
            if pid < 0 {
                return Err(errno_text("fork"));
            }
            let mut status = 0;
            if libc::waitpid(pid, &mut status, 0) != pid || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
                return Err(format!("host fork child ended with status {status:#x}"));
            }
        }
        Ok(())
    }

    fn map_file(&self, file: &File, len: u64, shared: bool) -> Result<u64, OpError> {
        let flags = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
        host_mmap(len, libc::PROT_READ | libc::PROT_WRITE, flags, file.as_raw_fd(), 0)
    }

    fn exec(&self, binary: &File, image: &Image) -> Result<(), OpError> {
        let fd = binary.as_raw_fd();
        let text = host_mmap(image.text, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_PRIVATE, fd, 0)?;
        let data = host_mmap(image.data, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, fd, image.text)?;
        let stack = self.map(image.stack)?;
        touch_image(
            |a| {
                // SAFETY: a page of the text mapping just made, readable.
                std::hint::black_box(unsafe { std::ptr::read_volatile(a as *const u8) });
                Ok(())
            },
            |a| self.store(a),
            text,
            data,
            stack,
            image,
        )?;
        for (a, len) in [(text, image.text), (data, image.data), (stack, image.stack)] {
            self.unmap(a, len)?;
        }
        Ok(())
    }

    fn share_cycle(&self, _len: u64, _members: usize) -> Result<ShareCycle, OpError> {
        Err("shared64 has no host twin (it measures vmfault's reverse map)".into())
    }

    fn mlock_loop(&self, _len: u64, _shared: bool, _stop: &AtomicBool) -> Result<u64, OpError> {
        Err("mlock1 has no host twin (it runs one process per worker already)".into())
    }

    fn stats(&self) -> Option<Stats> {
        None
    }

    fn new_process(&self) -> Result<Option<HostTarget>, OpError> {
        Ok(None)
    }
}
