//! Argument checks in Linux's order, compared with the host kernel: the
//! errno of `mprotect`, `madvise`, `msync`, `mincore` and `mmap` of a file where an
//! outside test found vmfault answering differently, and their
//! neighbours.

mod common;

use std::mem::ManuallyDrop;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::OpenOptionsExt;

use common::files::{P, PU, TempFile, each_config, errno_of, host_errno, in_host_child, pattern};
use vmfault::{Advice, MapFlags, MsyncFlags, Prot};

const PROT_SEM: u32 = 0x8;
const GROWSDOWN: u32 = 0x0100_0000;
const GROWSUP: u32 = 0x0200_0000;
/// `MAP_SHARED_VALIDATE`.
const VALIDATE: u32 = 0x3;
/// A descriptor number above the hard limit of open files here (20,000):
/// never open, so "a closed descriptor" without racing other threads.
const CLOSED_FD: i32 = i32::MAX - 7;
/// The largest file offset a two-page mapping may have, and one page more.
const LAST_OK: u64 = (1 << 63) - 3 * P;
const TOO_FAR: u64 = (1 << 63) - P;

/// The operations, on a window of four pages: 0 private anonymous, 1 a
/// hole, 2 a private mapping of the file, 3 locked private anonymous.
/// `o` runs one and gives its errno (0 for success), the same calls on
/// the host and on vmfault.
fn script(o: &mut dyn FnMut(Call) -> i64, out: &mut [i64]) {
    use Call::*;
    let calls = [
        Mprotect(0, P, (libc::PROT_READ as u32) | PROT_SEM),
        Mprotect(0, 0, GROWSDOWN | GROWSUP),
        Mprotect(1, P, libc::PROT_READ as u32 | GROWSDOWN),
        Mprotect(0, P, libc::PROT_READ as u32 | GROWSDOWN),
        Mprotect(0, P, libc::PROT_READ as u32 | GROWSUP),
        Mprotect(1, 2 * P, libc::PROT_READ as u32 | GROWSUP),
        Mprotect(0, 0, libc::PROT_READ as u32 | GROWSDOWN),
        Mprotect(1, 2 * P, libc::PROT_READ as u32 | GROWSDOWN),
        Mprotect(0, P, 0x10),
        Madvise(2, P, libc::MADV_FREE),
        Madvise(0, P, libc::MADV_FREE),
        Madvise(3, P, libc::MADV_FREE),
        Madvise(3, P, libc::MADV_COLD),
        Madvise(3, P, libc::MADV_PAGEOUT),
        Madvise(0, 2 * P, libc::MADV_COLD),
        Madvise(0, 4 * P, libc::MADV_PAGEOUT),
        Madvise(2, P, libc::MADV_PAGEOUT),
        Msync(0, P, libc::MS_ASYNC | libc::MS_SYNC),
        Msync(0, P, 8),
        Msync(3, P, libc::MS_INVALIDATE),
        Msync(0, 2 * P, libc::MS_ASYNC),
        Msync(0, 3 * P, libc::MS_SYNC),
        Msync(0, u64::MAX - 2 * P, libc::MS_SYNC),
        Msync(1, P, libc::MS_SYNC),
        Msync(0, P, 0),
        Msync(1, P, libc::MS_ASYNC),
        Msync(2, 0, libc::MS_SYNC | libc::MS_INVALIDATE),
        MmapFile(VALIDATE, 0, Fd::Rw),
        MmapFileAt(1, VALIDATE | libc::MAP_FIXED_NOREPLACE as u32, 0),
        MmapFile(libc::MAP_PRIVATE as u32, TOO_FAR, Fd::Rw),
        MmapFile(libc::MAP_PRIVATE as u32, LAST_OK, Fd::Rw),
        MmapFile(libc::MAP_SHARED as u32, TOO_FAR, Fd::Ro),
        MmapFile(libc::MAP_PRIVATE as u32, 0, Fd::Closed),
        MmapFile(libc::MAP_PRIVATE as u32, 0, Fd::Path),
        MmapFileLen0(Fd::Closed),
        MmapAnon(VALIDATE),
        Mincore(0, 0, P),
        Mincore(0, 1, P),
        Mincore(0, 0, 3 * P),
        Mincore(2, 0, 2 * P),
        Mincore(0, 0, u64::MAX - 2 * P),
    ];
    for (i, c) in calls.into_iter().enumerate() {
        out[i] = o(c);
    }
}

const CALLS: usize = 41;

#[derive(Clone, Copy, Debug)]
enum Fd {
    Rw,
    Ro,
    Closed,
    Path,
}

#[derive(Clone, Copy, Debug)]
enum Call {
    /// (page of the window, length, prot)
    Mprotect(u64, u64, u32),
    Madvise(u64, u64, i32),
    Msync(u64, u64, i32),
    /// Two pages of the file anywhere: (flags, offset, descriptor).
    MmapFile(u32, u64, Fd),
    /// One page of the file (read-write) at a window page: (page, flags, offset).
    MmapFileAt(u64, u32, u64),
    MmapFileLen0(Fd),
    /// One anonymous page anywhere, read-write, with `flags | MAP_ANONYMOUS`.
    MmapAnon(u32),
    /// (page of the window, bytes past its start, length)
    Mincore(u64, u64, u64),
}

#[test]
fn argument_checks_match_the_host_kernel() {
    let f = TempFile::new(&pattern(2 * PU, 3));
    let (rw, ro) = (f.rw(), f.ro());
    let path = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_PATH).open(&f.path).unwrap();
    let fds = (rw.as_raw_fd(), ro.as_raw_fd(), path.as_raw_fd());
    let (host, sig) = in_host_child(|out| {
        let fd = |d: Fd| match d {
            Fd::Rw => fds.0,
            Fd::Ro => fds.1,
            Fd::Closed => CLOSED_FD,
            Fd::Path => fds.2,
        };
        let rwp = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: in the single-threaded child: a window the kernel chose,
        // then our mappings over it; every call below checks its range.
        unsafe {
            let w = libc::mmap(
                std::ptr::null_mut(),
                4 * PU,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            let fixed = libc::MAP_PRIVATE | libc::MAP_FIXED;
            let ok = w != libc::MAP_FAILED
                && libc::mmap(w, PU, rwp, fixed | libc::MAP_ANONYMOUS, -1, 0) == w
                && libc::munmap(w.add(PU), PU) == 0
                && libc::mmap(w.add(2 * PU), PU, libc::PROT_READ, fixed, fds.0, 0) == w.add(2 * PU)
                && libc::mmap(w.add(3 * PU), PU, rwp, fixed | libc::MAP_ANONYMOUS, -1, 0) == w.add(3 * PU)
                && libc::mlock(w.add(3 * PU), PU) == 0;
            if !ok {
                out[63] = -1;
                return;
            }
            let w = w as u64;
            let at = |page: u64| (w + page * P) as *mut libc::c_void;
            let r = |x: libc::c_int| if x == 0 { 0 } else { i64::from(host_errno()) };
            let mm = |addr: *mut libc::c_void, len: u64, prot: i32, flags: u32, fd: i32, off: u64| {
                let p = libc::mmap(addr, len as usize, prot, flags as i32, fd, off as i64);
                if p == libc::MAP_FAILED {
                    i64::from(host_errno())
                } else {
                    libc::munmap(p, len as usize);
                    0
                }
            };
            let mut call = |c: Call| match c {
                Call::Mprotect(page, len, prot) => r(libc::mprotect(at(page), len as usize, prot as i32)),
                Call::Madvise(page, len, adv) => r(libc::madvise(at(page), len as usize, adv)),
                Call::Msync(page, len, flags) => r(libc::msync(at(page), len as usize, flags)),
                Call::MmapFile(flags, off, d) => mm(std::ptr::null_mut(), 2 * P, libc::PROT_READ, flags, fd(d), off),
                Call::MmapFileAt(page, flags, off) => mm(at(page), P, rwp, flags, fds.0, off),
                Call::MmapFileLen0(d) => {
                    mm(std::ptr::null_mut(), 0, libc::PROT_READ, libc::MAP_PRIVATE as u32, fd(d), 0)
                }
                Call::MmapAnon(flags) => mm(std::ptr::null_mut(), P, rwp, flags | libc::MAP_ANONYMOUS as u32, -1, 0),
                Call::Mincore(page, off, len) => {
                    let mut vec = [0u8; 8];
                    r(libc::mincore(at(page).byte_add(off as usize), len as usize, vec.as_mut_ptr()))
                }
            };
            script(&mut call, &mut out[..CALLS]);
        }
    });
    assert_eq!((sig, host[63]), (None, 0), "host child");
    // What Linux answers (so a change of the host's kernel shows here).
    let (inval, nomem, busy) = (libc::EINVAL as i64, libc::ENOMEM as i64, libc::EBUSY as i64);
    let (ovf, badf, notsup) = (libc::EOVERFLOW as i64, libc::EBADF as i64, libc::EOPNOTSUPP as i64);
    let want = [
        0, inval, nomem, inval, inval, nomem, 0, inval, inval, inval, 0, inval, inval, inval, nomem, inval, 0, inval,
        inval, busy, nomem, nomem, nomem, nomem, 0, nomem, 0, 0, notsup, ovf, 0, ovf, badf, badf, badf, inval, 0,
        inval, nomem, 0, nomem,
    ];
    assert_eq!(host[..CALLS], want, "the host kernel");

    let closed = ManuallyDrop::new(
        // SAFETY: a descriptor number that is never open (above the hard
        // limit); the File is never dropped, so nothing is ever closed.
        unsafe { std::fs::File::from_raw_fd(CLOSED_FD) },
    );
    each_config(4 << 20, |vm, what| {
        let s = vm.new_space().unwrap();
        let w = s.mmap(0, 4 * P, Prot::NONE, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        let rwp = Prot::READ | Prot::WRITE;
        s.mmap(w, P, rwp, MapFlags::PRIVATE | MapFlags::ANONYMOUS | MapFlags::FIXED).unwrap();
        s.munmap(w + P, P).unwrap();
        s.mmap_file(w + 2 * P, P, Prot::READ, MapFlags::PRIVATE | MapFlags::FIXED, &rw, 0).unwrap();
        s.mmap(w + 3 * P, P, rwp, MapFlags::PRIVATE | MapFlags::ANONYMOUS | MapFlags::FIXED).unwrap();
        s.mlock(w + 3 * P, P).unwrap();
        let at = |page: u64| w + page * P;
        let file = |d: Fd| match d {
            Fd::Rw => &rw,
            Fd::Ro => &ro,
            Fd::Closed => &*closed,
            Fd::Path => &path,
        };
        let e = |r: vmfault::Result<()>| i64::from(errno_of(r));
        let mm = |r: vmfault::Result<u64>, len: u64| match r {
            Ok(a) => {
                s.munmap(a, len).unwrap();
                0
            }
            Err(err) => i64::from(err.errno()),
        };
        let mut call = |c: Call| match c {
            Call::Mprotect(page, len, prot) => e(s.mprotect(at(page), len, Prot::from_bits_retain(prot))),
            Call::Madvise(page, len, adv) => e(s.madvise(at(page), len, Advice::from_raw(adv).unwrap())),
            Call::Msync(page, len, flags) => {
                e(s.msync_flags(at(page), len, MsyncFlags::from_bits_retain(flags as u32)))
            }
            Call::MmapFile(flags, off, d) => {
                mm(s.mmap_file(0, 2 * P, Prot::READ, MapFlags::from_bits_retain(flags), file(d), off), 2 * P)
            }
            Call::MmapFileAt(page, flags, off) => {
                mm(s.mmap_file(at(page), P, rwp, MapFlags::from_bits_retain(flags), &rw, off), P)
            }
            Call::MmapFileLen0(d) => mm(s.mmap_file(0, 0, Prot::READ, MapFlags::PRIVATE, file(d), 0), 0),
            Call::MmapAnon(flags) => mm(s.mmap(0, P, rwp, MapFlags::from_bits_retain(flags) | MapFlags::ANONYMOUS), P),
            Call::Mincore(page, off, len) => e(s.mincore(at(page) + off, len).map(drop)),
        };
        let mut got = [0i64; CALLS];
        script(&mut call, &mut got);
        for (i, (g, h)) in got.iter().zip(&host[..CALLS]).enumerate() {
            assert_eq!(g, h, "{what}: call {i} gave errno {g}, the host {h}");
        }
    });
}
