//! Support for `tests/file.rs`: temporary files, every configuration, and
//! the host kernel's side of the comparisons.

use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use super::FAULT_PATHS;
use vmfault::{AddressSpace, MapFlags, Prot, Rmap, Vm, VmConfig};

pub const P: u64 = 4096;
pub const PU: usize = P as usize;
pub const RW: Prot = Prot::READ.union(Prot::WRITE);
pub const SH: MapFlags = MapFlags::SHARED;
pub const PRIV: MapFlags = MapFlags::PRIVATE;
pub const RMAPS: [Rmap; 2] = [Rmap::Backing, Rmap::PvEntry];

/// A file in the temporary directory, removed when dropped (even by a
/// failing test).
pub struct TempFile {
    pub path: PathBuf,
}

impl TempFile {
    pub fn new(contents: &[u8]) -> TempFile {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("vmfault-test-file-{}-{n}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        TempFile { path }
    }

    pub fn rw(&self) -> File {
        OpenOptions::new().read(true).write(true).open(&self.path).unwrap()
    }

    pub fn ro(&self) -> File {
        File::open(&self.path).unwrap()
    }

    pub fn wo(&self) -> File {
        OpenOptions::new().write(true).open(&self.path).unwrap()
    }

    pub fn contents(&self) -> Vec<u8> {
        std::fs::read(&self.path).unwrap()
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `len` bytes that differ from page to page and from `seed` to `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8 ^ seed.wrapping_mul(77)).collect()
}

pub fn rd(s: &AddressSpace, addr: u64, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    s.read(addr, &mut buf).unwrap();
    buf
}

pub fn errno_of<T>(r: vmfault::Result<T>) -> i32 {
    r.err().map_or(0, |e| e.errno())
}

/// Run `test` on a fresh machine of `phys` bytes in every fault path and
/// both reverse maps; once it has dropped every space and the page cache,
/// every frame and every piece of reverse-map metadata must be gone.
pub fn each_config(phys: u64, test: impl Fn(&Vm, &str)) {
    for path in FAULT_PATHS {
        for rmap in RMAPS {
            let cfg =
                VmConfig { phys_bytes: phys, cpus: 4, prefault: false, fault_path: path, rmap, ..VmConfig::default() };
            let vm = Vm::new(cfg).unwrap();
            let free = vm.stats().free_pages;
            let what = format!("fault_path={} rmap={}", path.name(), rmap.name());
            test(&vm, &what);
            // Files stay cached after their last mapping, as in a kernel.
            vm.drop_caches();
            let s = vm.stats();
            assert_eq!(s.free_pages, free, "{what}: frames leaked");
            assert_eq!((s.pv_entries, s.backing_records, s.rmap_bytes), (0, 0, 0), "{what}: reverse map left behind");
        }
    }
}

// ---------------------------------------------------------------- the host

pub fn host_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap()
}

/// `mmap` on the host: the address, or the errno.
pub fn host_mmap(len: u64, prot: i32, flags: i32, fd: &impl std::os::fd::AsRawFd, offset: u64) -> Result<u64, i32> {
    // SAFETY: a new mapping chosen by the kernel (no MAP_FIXED): nothing of ours changes.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, prot, flags, fd.as_raw_fd(), offset as i64) };
    if p == libc::MAP_FAILED { Err(host_errno()) } else { Ok(p as u64) }
}

pub fn host_munmap(addr: u64, len: u64) {
    // SAFETY: only ranges this test mapped with `host_mmap` and no longer uses.
    assert_eq!(unsafe { libc::munmap(addr as *mut libc::c_void, len as usize) }, 0);
}

/// `errno` of `mmap` on the host (0: it succeeded; the mapping is removed).
pub fn host_mmap_errno(len: u64, prot: Prot, flags: MapFlags, file: &File, offset: u64) -> i32 {
    match host_mmap(len, prot.bits() as i32, flags.bits() as i32, file, offset) {
        Ok(a) => {
            host_munmap(a, len);
            0
        }
        Err(e) => e,
    }
}

/// Copy `n` bytes out of host memory at `addr`.
pub fn host_read(addr: u64, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    // SAFETY: the caller maps `addr..addr+n` readable, within the file's last page at most.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), n) };
    out
}

/// Run `f` in a forked child of this (multi-threaded) test process: `f`
/// may only make system calls and plain memory accesses (no allocation,
/// no panic), and leaves its results in the array. Returns the array and
/// the signal that killed the child, if one did.
pub fn in_host_child(f: impl FnOnce(&mut [i64; 64])) -> ([i64; 64], Option<i32>) {
    const N: usize = size_of::<[i64; 64]>();
    // SAFETY: a new shared anonymous mapping (no MAP_FIXED), big enough for the array.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            N,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    // SAFETY: fork; the child runs only `f` (system calls and memory accesses) and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        // SAFETY: in the child: async-signal-safe calls only; the page is
        // ours, mapped, zeroed and aligned for the array.
        unsafe {
            // No core dump for the signals that the tests provoke.
            let none = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            libc::setrlimit(libc::RLIMIT_CORE, &none);
            libc::prctl(libc::PR_SET_DUMPABLE, 0);
            // Rust's runtime handles SIGSEGV and SIGBUS (stack overflows): the default kills.
            libc::signal(libc::SIGBUS, libc::SIG_DFL);
            libc::signal(libc::SIGSEGV, libc::SIG_DFL);
            f(&mut *page.cast::<[i64; 64]>());
            libc::_exit(0);
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    // SAFETY: the child is gone; the page is still mapped; then it is unmapped.
    let results = unsafe {
        let r = std::ptr::read_volatile(page.cast::<[i64; 64]>());
        libc::munmap(page, N);
        r
    };
    if libc::WIFSIGNALED(status) {
        (results, Some(libc::WTERMSIG(status)))
    } else {
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "host child: status {status:#x}");
        (results, None)
    }
}

/// The host mappings inside `window..window + pages * P`, as page ranges
/// relative to `window` (from `/proc/self/maps`).
pub fn host_layout(window: u64, pages: u64) -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let (range, _) = l.split_once(' ')?;
            let (a, b) = range.split_once('-')?;
            let (a, b) = (u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?);
            (a >= window && b <= window + pages * P).then(|| ((a - window) / P, (b - window) / P))
        })
        .collect()
}

/// The signal that kills a host process doing a one-byte access at `addr`
/// (of this process's mappings), if any. A store writes a zero byte.
pub fn host_access_signal(addr: u64, write: bool) -> Option<i32> {
    in_host_child(|_| {
        // SAFETY: in the child: the access may fault, which is what we observe.
        unsafe {
            if write {
                std::ptr::write_volatile(addr as *mut u8, 0);
            } else {
                std::ptr::read_volatile(addr as *const u8);
            }
        }
    })
    .1
}

// ---------------------------------------------------------------- the tests

/// `errno` of `mprotect(PROT_READ | PROT_WRITE)` on the host, of a fresh
/// `PROT_READ` mapping of `file` with `flags`.
pub fn host_mprotect_rw_errno(flags: MapFlags, file: &File) -> i32 {
    let p = host_mmap(P, libc::PROT_READ, flags.bits() as i32, file, 0).unwrap();
    // SAFETY: our mapping.
    let r = unsafe { libc::mprotect(p as *mut libc::c_void, PU, libc::PROT_READ | libc::PROT_WRITE) };
    let e = if r == 0 { 0 } else { host_errno() };
    host_munmap(p, P);
    e
}

/// A tmpfs of `size` at a fresh directory, unmounted when dropped.
pub struct SmallFs(pub std::path::PathBuf);

impl SmallFs {
    pub fn mount(size: &str) -> SmallFs {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vmfault-test-inject-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "vmfault-test"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "mounting a {size} tmpfs at {} needs root (CI runs as root)", dir.display());
        SmallFs(dir)
    }

    pub fn resize(&self, size: &str) {
        let ok = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "remount of {}", self.0.display());
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}
