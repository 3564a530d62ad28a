//! What a workload runs on: vmfault or the host kernel.
//!
//! Workloads are written once, generic over [`Target`], so the vmfault run
//! and its host-kernel twin execute the same loop with the same parameters.
//! Monomorphization keeps the trait out of the measured path.

use vmfault::{AddressSpace, CpuGuard, MapFlags, Prot, Stats, Vm};

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

    /// vmfault's statistics, if this is vmfault.
    fn stats(&self) -> Option<Stats>;
}

/// vmfault: one address space of a `Vm`; workers attach as vCPUs.
#[derive(Debug, Clone)]
pub struct VmTarget {
    vm: Vm,
    space: AddressSpace,
}

impl VmTarget {
    /// A fresh address space in `vm`.
    pub fn new(vm: &Vm) -> Result<VmTarget, OpError> {
        Ok(VmTarget { vm: vm.clone(), space: vm.new_space().map_err(|e| e.to_string())? })
    }

    /// The address space.
    pub fn space(&self) -> &AddressSpace {
        &self.space
    }
}

const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

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
        self.space.write(addr, &[0]).map_err(|e| e.to_string())
    }

    fn fork_touch(&self, addr: u64, len: u64) -> Result<(), OpError> {
        let child = self.space.fork().map_err(|e| e.to_string())?;
        for a in (addr..addr + len).step_by(4096) {
            child.write(a, &[0]).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn stats(&self) -> Option<Stats> {
        Some(self.vm.stats())
    }
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

    fn stats(&self) -> Option<Stats> {
        None
    }
}
