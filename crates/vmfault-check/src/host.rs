//! Running an operation sequence on the host kernel.
//!
//! A forked child sets up the same guarded window with real system calls
//! and runs the sequence. Loads and stores are first tried in a forked
//! grandchild (a copy of the child) whose SIGSEGV handler records `si_addr`
//! and `si_code` and exits; the child then repeats the part that succeeded,
//! so that its own memory (and its anon_vmas) evolve exactly as a program's
//! would. Results travel back through a shared anonymous mapping; the child
//! allocates nothing and prints nothing (another thread of the test process
//! may have held a lock at fork time).

use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering, compiler_fence};
use std::time::{Duration, Instant};

use super::ops::*;

/// Most operations in one sequence.
pub const MAX_OPS: usize = 400;
/// Longest load or store an op may do (the probe's buffer).
pub const CHUNK: usize = 32 * 4096;
const DATA_BYTES: usize = MAX_OPS * CHUNK;
const MAX_MAPS: usize = MAX_OPS * 48;
const SCRATCH: usize = 1 << 20;

#[repr(C)]
#[derive(Clone, Copy)]
struct RawResult {
    kind: u32,
    errno: i32,
    off: u64,
    segv_off: i64,
    segv_code: i64,
    data_at: u64,
    data_len: u64,
    maps_at: u64,
    maps_len: u64,
}

const K_OK: u32 = 0;
const K_ADDR: u32 = 1;
const K_ELSEWHERE: u32 = 2;
const K_ERR: u32 = 3;
const K_DATA: u32 = 4;
const K_SEGV: u32 = 5;

#[repr(C)]
struct Probe {
    done: u64,
    faulted: u64,
    addr: u64,
    code: i64,
    buf: [u8; CHUNK],
}

#[repr(C)]
struct Shared {
    base: u64,
    ops_done: u64,
    status: u64,
    data_used: u64,
    maps_used: u64,
    probe: Probe,
    results: [RawResult; MAX_OPS],
    data: [u8; DATA_BYTES],
    maps: [[u64; 3]; MAX_MAPS],
    scratch: [u8; SCRATCH],
}

/// The probe area of the grandchild, for its signal handler.
static PROBE: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, _uctx: *mut libc::c_void) {
    // SAFETY: set before any access that can fault; the kernel passes a valid siginfo.
    unsafe {
        let p = PROBE.load(Ordering::Relaxed) as *mut Probe;
        ptr::write_volatile(&mut (*p).faulted, 1);
        ptr::write_volatile(&mut (*p).addr, (*info).si_addr() as u64);
        // The signal above the code: SIGBUS's BUS_ADRERR and SIGSEGV's
        // SEGV_ACCERR are both 2.
        ptr::write_volatile(&mut (*p).code, i64::from((*info).si_code) | (i64::from(sig) << 16));
        libc::_exit(0);
    }
}

/// One store to `a` that changes nothing, as vmfault's `touch(Write)`:
/// a locked `or` of zero is a single write access (a read followed by a
/// write would fault as a read first: SIGBUS past the end of a file
/// where the store itself is SIGSEGV on a read-only mapping).
///
/// # Safety
/// `a` is an address of this process whose fault, if any, ends it.
unsafe fn store_nothing(a: u64) {
    // (Not `AtomicU8::fetch_or(0)`: the compiler turns an idempotent
    // read-modify-write into a fenced load.)
    // SAFETY: the caller's contract; a locked `or` of zero into one byte
    // changes nothing, and a fault ends the process.
    unsafe { std::arch::asm!("lock or byte ptr [{0}], 0", in(reg) a, options(nostack)) };
}

/// Read one byte of each page of `addr..addr+len`, known readable.
///
/// # Safety
/// The range is readable in this process.
unsafe fn fault_in_read(addr: u64, len: usize) {
    let mut a = addr;
    while a < addr + len as u64 {
        // SAFETY: the caller's contract.
        let _ = unsafe { ptr::read_volatile(a as *const u8) };
        a = (a & !4095) + 4096;
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Read,
    Write,
    TouchRead,
    TouchWrite,
}

fn errno() -> i32 {
    // SAFETY: reading the thread's errno.
    unsafe { *libc::__errno_location() }
}

/// Try an access in a grandchild; returns (bytes done, Some((addr, code)) on SIGSEGV).
///
/// # Safety
/// `sh` is the shared region.
unsafe fn probe(sh: *mut Shared, kind: Kind, addr: u64, len: usize) -> (usize, Option<(u64, i64)>) {
    // SAFETY: the caller's contract; the accesses to `addr` happen in a forked
    // copy whose faults end it through `on_fault`.
    unsafe {
        let pr = &raw mut (*sh).probe;
        ptr::write_volatile(&raw mut (*pr).done, 0);
        ptr::write_volatile(&raw mut (*pr).faulted, 0);
        let pid = libc::fork();
        if pid == 0 {
            PROBE.store(pr as usize, Ordering::SeqCst);
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_fault as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigaction(libc::SIGSEGV, &sa, ptr::null_mut());
            libc::sigaction(libc::SIGBUS, &sa, ptr::null_mut());
            let mut done = 0usize;
            while done < len {
                let a = addr + done as u64;
                let n = (4096 - (a % 4096) as usize).min(len - done);
                match kind {
                    Kind::Read => {
                        let _ = ptr::read_volatile(a as *const u8);
                        compiler_fence(Ordering::SeqCst);
                        ptr::copy_nonoverlapping(a as *const u8, (&raw mut (*pr).buf).cast::<u8>().add(done), n);
                    }
                    // A store that changes nothing proves the page
                    // writable: the caller stores the bytes. (Storing them
                    // here reached the caller's shared pages first, so a
                    // copy-on-write of a private mapping of the same file
                    // page, earlier in the range, took them in.)
                    Kind::Write => store_nothing(a),
                    Kind::TouchRead => {
                        let _ = ptr::read_volatile(a as *const u8);
                    }
                    Kind::TouchWrite => store_nothing(a),
                }
                compiler_fence(Ordering::SeqCst);
                done += n;
                ptr::write_volatile(&raw mut (*pr).done, done as u64);
            }
            libc::_exit(0);
        }
        let mut st = 0;
        libc::waitpid(pid, &mut st, 0);
        let done = ptr::read_volatile(&raw const (*pr).done) as usize;
        if ptr::read_volatile(&raw const (*pr).faulted) == 1 {
            let (a, code) = (ptr::read_volatile(&raw const (*pr).addr), ptr::read_volatile(&raw const (*pr).code));
            if code == 2 | (i64::from(libc::SIGSEGV) << 16) {
                // SIGSEGV's SEGV_ACCERR (see `on_fault`)
                grow_as_faulted(a);
            }
            (done, Some((a, code)))
        } else {
            (done, None)
        }
    }
}

/// After the probe's access to `a` failed with `SEGV_ACCERR`: if nothing
/// is mapped at `a` here, the probe's fault grew a stack (`MAP_GROWSDOWN`)
/// down to `a` before it checked the access, as the same fault here would
/// have. Grow it here too, with a debugger's load of `a` through
/// `/proc/self/mem` (Linux's `__access_remote_vm` grows stacks as a fault
/// does), and drop the page that load mapped, as the failed access maps
/// none.
///
/// # Safety
/// Nothing but this process's own memory map changes.
unsafe fn grow_as_faulted(a: u64) {
    let page = (a & !4095) as *mut libc::c_void;
    let mut v = 0u8;
    // SAFETY: `mincore` of one page into one byte; the load goes into `b`;
    // the page `madvise` drops is one the load mapped, in no use.
    unsafe {
        if libc::mincore(page, 4096, &raw mut v) == 0 || errno() != libc::ENOMEM {
            return;
        }
        let mut b = 0u8;
        if proc_mem(false, a, &raw mut b, 1) == 1 {
            libc::madvise(page, 4096, libc::MADV_DONTNEED);
        }
    }
}

fn res(kind: u32) -> RawResult {
    RawResult { kind, errno: 0, off: 0, segv_off: 0, segv_code: 0, data_at: 0, data_len: 0, maps_at: 0, maps_len: 0 }
}

fn unit(r: libc::c_int) -> RawResult {
    if r == 0 { res(K_OK) } else { RawResult { errno: errno(), ..res(K_ERR) } }
}

/// A debugger's access (ptrace's `FOLL_FORCE`) of `len` bytes at `addr`
/// of this process, through `/proc/self/mem`: the bytes done before the
/// first page it could not reach (the file's `EIO` when that is the
/// first).
///
/// # Safety
/// `buf` holds `len` bytes (written to for a read).
unsafe fn proc_mem(write: bool, addr: u64, buf: *mut u8, len: usize) -> usize {
    // SAFETY: a NUL-terminated path; the caller's contract for `buf`.
    unsafe {
        let fd = libc::open(c"/proc/self/mem".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC);
        assert!(fd >= 0, "open /proc/self/mem: errno {}", errno());
        let mut done = 0usize;
        while done < len {
            let (p, n, at) = (buf.add(done), len - done, (addr + done as u64) as libc::off_t);
            let r = if write { libc::pwrite(fd, p.cast(), n, at) } else { libc::pread(fd, p.cast(), n, at) };
            if r <= 0 {
                break;
            }
            done += r as usize;
        }
        libc::close(fd);
        done
    }
}

/// Whether this kernel lets a process write its own read-only private
/// memory through `/proc/self/mem` (ptrace's `FOLL_FORCE`; a kernel may
/// refuse it: `proc_mem.force_override`). Tried once, on a page of its own.
pub(crate) fn forces_writes() -> bool {
    static YES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *YES.get_or_init(|| {
        // SAFETY: a fresh private mapping of one page, written only
        // through /proc/self/mem and unmapped before return.
        unsafe {
            let p = libc::mmap(ptr::null_mut(), 4096, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0);
            if p == libc::MAP_FAILED {
                return false;
            }
            let mut b = 1u8;
            let ok = proc_mem(true, p as u64, &raw mut b, 1) == 1 && ptr::read_volatile(p.cast::<u8>()) == 1;
            libc::munmap(p, 4096);
            ok
        }
    })
}

/// # Safety
/// `sh` is the shared region; `src` holds `n` readable bytes.
unsafe fn push_data(sh: *mut Shared, src: *const u8, n: usize) -> (u64, u64) {
    // SAFETY: the caller's contract; the copy is clamped to the data area.
    unsafe {
        let at = (*sh).data_used as usize;
        let n = n.min(DATA_BYTES - at);
        ptr::copy_nonoverlapping(src, (&raw mut (*sh).data).cast::<u8>().add(at), n);
        (*sh).data_used += n as u64;
        (at as u64, n as u64)
    }
}

/// # Safety
/// `sh` is the shared region; runs in the forked child only (it changes the
/// child's own mappings).
unsafe fn exec(sh: *mut Shared, base: u64, op: &TOp, fd: i32) -> RawResult {
    // SAFETY: system calls on the child's window; loads and stores only
    // after a grandchild proved them safe.
    unsafe {
        match *op {
            TOp::MmapFile { place, off, len, prot, shared, fpage } => {
                let mut flags = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
                flags |= if place == Place::NoReplace { libc::MAP_FIXED_NOREPLACE } else { libc::MAP_FIXED };
                let want = base + off;
                let p = libc::mmap(want as *mut libc::c_void, len as usize, prot as i32, flags, fd, (fpage * P) as i64);
                if p == libc::MAP_FAILED {
                    RawResult { errno: errno(), ..res(K_ERR) }
                } else if p as u64 == want {
                    RawResult { off, ..res(K_ADDR) }
                } else {
                    libc::munmap(p, len as usize);
                    res(K_ELSEWHERE)
                }
            }
            TOp::Msync { off, len, flags } => {
                unit(libc::msync((base + off) as *mut libc::c_void, len as usize, flags as i32))
            }
            TOp::Mmap { place, off, len, prot, flags } => {
                let (addr, flags) = match place {
                    Place::Fixed => (base + off, flags | libc::MAP_FIXED as u32),
                    Place::NoReplace => (base + off, flags | libc::MAP_FIXED_NOREPLACE as u32),
                    Place::HintShared => (base + off, flags),
                    Place::AnywhereShared => (0, flags),
                };
                let p = libc::mmap(addr as *mut libc::c_void, len as usize, prot as i32, flags as i32, -1, 0);
                if p == libc::MAP_FAILED {
                    RawResult { errno: errno(), ..res(K_ERR) }
                } else if p as u64 == base + off && place != Place::AnywhereShared {
                    RawResult { off, ..res(K_ADDR) }
                } else {
                    libc::munmap(p, len as usize);
                    res(K_ELSEWHERE)
                }
            }
            TOp::Munmap { off, len } => unit(libc::munmap((base + off) as *mut libc::c_void, len as usize)),
            TOp::Mprotect { off, len, prot } => {
                unit(libc::mprotect((base + off) as *mut libc::c_void, len as usize, prot as i32))
            }
            TOp::Madvise { off, len, advice } => {
                unit(libc::madvise((base + off) as *mut libc::c_void, len as usize, advice))
            }
            TOp::Mlock { off, len } => unit(libc::mlock((base + off) as *const libc::c_void, len as usize)),
            TOp::Mincore { off, len } => {
                let mut v = [0u8; 16];
                let r = libc::mincore((base + off) as *mut libc::c_void, len as usize, v.as_mut_ptr());
                if r == 0 {
                    let n = (len as usize).div_ceil(4096);
                    // Bit 0 only: the other bits are reserved.
                    v.iter_mut().for_each(|b| *b &= 1);
                    let (at, n) = push_data(sh, v.as_ptr(), n);
                    RawResult { data_at: at, data_len: n, ..res(K_DATA) }
                } else {
                    unit(r)
                }
            }
            TOp::Munlock { off, len } => unit(libc::munlock((base + off) as *const libc::c_void, len as usize)),
            TOp::Mremap { off, old_len, new_len, flags, new_off } => {
                let p = libc::syscall(libc::SYS_mremap, base + off, old_len, new_len, flags, base + new_off);
                if p == -1 {
                    RawResult { errno: errno(), ..res(K_ERR) }
                } else if p as u64 == base + off
                    || (flags & libc::MREMAP_FIXED as u32 != 0 && p as u64 == base + new_off)
                {
                    RawResult { off: p as u64 - base, ..res(K_ADDR) }
                } else {
                    libc::munmap(p as *mut libc::c_void, new_len as usize);
                    res(K_ELSEWHERE)
                }
            }
            TOp::Brk { off } => {
                let r = libc::syscall(libc::SYS_brk, base + off) as u64;
                RawResult { off: r.wrapping_sub(base), ..res(K_ADDR) }
            }
            TOp::Read { off, len } => {
                let (done, fault) = probe(sh, Kind::Read, base + off, len as usize);
                // The grandchild proved these bytes readable: read them here
                // too, so that this process faults its pages in as the
                // access would have (`mincore` sees them).
                fault_in_read(base + off, done);
                let (at, n) = push_data(sh, (&raw const (*sh).probe.buf).cast::<u8>(), done);
                match fault {
                    None => RawResult { data_at: at, data_len: n, ..res(K_DATA) },
                    Some((a, code)) => RawResult {
                        segv_off: a as i64 - base as i64,
                        segv_code: code,
                        data_at: at,
                        data_len: n,
                        ..res(K_SEGV)
                    },
                }
            }
            TOp::Write { off, len, seed } => {
                let mut pat = [0u8; CHUNK];
                for (i, b) in pat.iter_mut().enumerate().take(len as usize) {
                    *b = seed.wrapping_add((i as u8).wrapping_mul(31)) | 1;
                }
                let (done, fault) = probe(sh, Kind::Write, base + off, len as usize);
                // The grandchild proved these bytes writable: store them here
                // too, a page at a time in ascending order, as vmfault's
                // `write` (and `rep movsb`) does. One `memcpy` may store its
                // tail first, and where the range maps one file page twice
                // (a private and a shared mapping of it), a copy-on-write
                // of the first would then take the second's new bytes.
                let mut at = 0usize;
                while at < done {
                    let n = (4096 - (base + off + at as u64) as usize % 4096).min(done - at);
                    ptr::copy_nonoverlapping(pat.as_ptr().add(at), (base + off + at as u64) as *mut u8, n);
                    at += n;
                }
                match fault {
                    None => res(K_OK),
                    Some((a, code)) => RawResult { segv_off: a as i64 - base as i64, segv_code: code, ..res(K_SEGV) },
                }
            }
            TOp::ForceRead { off, len } => {
                let mut buf = [0u8; CHUNK];
                let done = proc_mem(false, base + off, buf.as_mut_ptr(), len as usize);
                let (at, n) = push_data(sh, buf.as_ptr(), done);
                if done == len as usize {
                    RawResult { data_at: at, data_len: n, ..res(K_DATA) }
                } else {
                    RawResult { segv_off: (off + done as u64) as i64, data_at: at, data_len: n, ..res(K_SEGV) }
                }
            }
            TOp::ForceWrite { off, len, seed } => {
                let mut pat = [0u8; CHUNK];
                for (i, b) in pat.iter_mut().enumerate().take(len as usize) {
                    *b = seed.wrapping_add((i as u8).wrapping_mul(31)) | 1;
                }
                let done = proc_mem(true, base + off, pat.as_mut_ptr(), len as usize);
                if done == len as usize {
                    res(K_OK)
                } else {
                    RawResult { segv_off: (off + done as u64) as i64, ..res(K_SEGV) }
                }
            }
            TOp::Touch { off, write } => {
                let kind = if write { Kind::TouchWrite } else { Kind::TouchRead };
                let a = base + off;
                match probe(sh, kind, a, 1) {
                    (_, None) => {
                        if write {
                            store_nothing(a);
                        } else {
                            fault_in_read(a, 1);
                        }
                        res(K_OK)
                    }
                    (_, Some((fa, code))) => {
                        RawResult { segv_off: fa as i64 - base as i64, segv_code: code, ..res(K_SEGV) }
                    }
                }
            }
            TOp::FetchAdd { off, val } => {
                let a = base + off;
                match probe(sh, Kind::TouchWrite, a, 1) {
                    (_, None) => {
                        // The grandchild proved it writable: the add itself.
                        let old = (*(a as *const std::sync::atomic::AtomicU64)).fetch_add(val, Ordering::SeqCst);
                        let (at, n) = push_data(sh, old.to_ne_bytes().as_ptr(), 8);
                        RawResult { data_at: at, data_len: n, ..res(K_DATA) }
                    }
                    (_, Some((fa, code))) => {
                        RawResult { segv_off: fa as i64 - base as i64, segv_code: code, ..res(K_SEGV) }
                    }
                }
            }
            // Run by `child` itself; never passed here.
            TOp::Fork | TOp::Switch(_) | TOp::Exit => res(K_ERR),
            TOp::Abs(a) => {
                let (call, addr, len, prot, flags) = a.args(base);
                let p = addr as *mut libc::c_void;
                match call {
                    "munmap" => unit(libc::munmap(p, len as usize)),
                    "mprotect" => unit(libc::mprotect(p, len as usize, prot as i32)),
                    "madvise" => unit(libc::madvise(p, len as usize, prot as i32)),
                    _ => {
                        let m = libc::mmap(p, len as usize, prot as i32, flags as i32, -1, 0);
                        if m == libc::MAP_FAILED {
                            RawResult { errno: errno(), ..res(K_ERR) }
                        } else {
                            libc::munmap(m, len as usize);
                            res(K_ELSEWHERE)
                        }
                    }
                }
            }
        }
    }
}

fn hex(s: &[u8]) -> (u64, usize) {
    let mut v = 0u64;
    let mut i = 0;
    while i < s.len() {
        let d = match s[i] {
            c @ b'0'..=b'9' => c - b'0',
            c @ b'a'..=b'f' => c - b'a' + 10,
            _ => break,
        };
        v = v * 16 + u64::from(d);
        i += 1;
    }
    (v, i)
}

/// Record the window's part of /proc/self/maps; returns (at, count).
///
/// # Safety
/// `sh` is the shared region.
unsafe fn record_maps(sh: *mut Shared, base: u64) -> (u64, u64) {
    // SAFETY: reads into the shared scratch area, bounded by its size.
    unsafe {
        let fd = libc::open(c"/proc/self/maps".as_ptr(), libc::O_RDONLY);
        let buf = (&raw mut (*sh).scratch).cast::<u8>();
        let mut len = 0usize;
        loop {
            let n = libc::read(fd, buf.add(len).cast(), SCRATCH - len);
            if n <= 0 {
                break;
            }
            len += n as usize;
        }
        libc::close(fd);
        let text = std::slice::from_raw_parts(buf, len);
        let at = (*sh).maps_used;
        for line in text.split(|&c| c == b'\n') {
            let (s, i) = hex(line);
            if i == 0 || line.get(i) != Some(&b'-') {
                continue;
            }
            let (e, j) = hex(&line[i + 1..]);
            let perm = &line[i + 1 + j + 1..];
            if e <= base || s >= base + W || perm.len() < 4 {
                continue;
            }
            let bits = perm_bits(perm[0] == b'r', perm[1] == b'w', perm[2] == b'x', perm[3] == b's');
            let k = (*sh).maps_used as usize;
            if k < MAX_MAPS {
                (*sh).maps[k] = [s.max(base) - base, e.min(base + W) - base, u64::from(bits)];
                (*sh).maps_used += 1;
            }
        }
        (at, (*sh).maps_used - at)
    }
}

/// Linux's `struct prctl_mm_map` (`include/uapi/linux/prctl.h`).
#[repr(C)]
struct PrctlMmMap {
    start_code: u64,
    end_code: u64,
    start_data: u64,
    end_data: u64,
    start_brk: u64,
    brk: u64,
    start_stack: u64,
    arg_start: u64,
    arg_end: u64,
    env_start: u64,
    env_end: u64,
    auxv: *mut u64,
    auxv_size: u32,
    exe_fd: u32,
}

/// Move this process's heap to `heap` (start and break), keeping the
/// other bounds `/proc/self/stat` shows: `prctl(PR_SET_MM_MAP)`, which
/// needs no `CAP_SYS_RESOURCE` (`PR_SET_MM_BRK` does, and containers
/// often drop it). Allocates nothing.
///
/// # Safety
/// `sh` is the shared region (its scratch area is used).
unsafe fn move_heap(sh: *mut Shared, heap: u64) -> bool {
    // SAFETY: reads into the shared scratch area, bounded by its size;
    // the prctl reads the struct on this stack.
    unsafe {
        let fd = libc::open(c"/proc/self/stat".as_ptr(), libc::O_RDONLY);
        let buf = (&raw mut (*sh).scratch).cast::<u8>();
        let n = libc::read(fd, buf.cast(), SCRATCH);
        libc::close(fd);
        if n <= 0 {
            return false;
        }
        let text = std::slice::from_raw_parts(buf, n as usize);
        // Fields after the command's closing parenthesis, from field 3.
        let Some(close) = text.iter().rposition(|&c| c == b')') else { return false };
        let mut field = [0u64; 53];
        for (i, word) in text[close + 2..].split(|&c| c == b' ').enumerate().take(50) {
            field[i + 3] = word.iter().take_while(|c| c.is_ascii_digit()).fold(0, |v, &d| v * 10 + u64::from(d - b'0'));
        }
        let map = PrctlMmMap {
            start_code: field[26],
            end_code: field[27],
            start_data: field[45],
            end_data: field[46],
            start_brk: heap,
            brk: heap,
            start_stack: field[28],
            arg_start: field[48],
            arg_end: field[49],
            env_start: field[50],
            env_end: field[51],
            auxv: ptr::null_mut(),
            auxv_size: 0,
            exe_fd: u32::MAX,
        };
        let size = std::mem::size_of::<PrctlMmMap>() as libc::c_ulong;
        libc::prctl(libc::PR_SET_MM, libc::PR_SET_MM_MAP as libc::c_ulong, &raw const map as libc::c_ulong, size, 0)
            == 0
    }
}

/// # Safety
/// Runs in the forked child only; `sh` is the shared region. `owner[i]` is
/// the process that runs op `i`, `fork_id[i]` the number a `Fork` at `i`
/// gives its child (both computed before the fork: the child allocates
/// nothing).
unsafe fn child(sh: *mut Shared, ops: &[TOp], owner: &[u8], fork_id: &[u8], fd: i32) -> ! {
    // SAFETY: the child owns its address space; see `exec`.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        let total = (W + 2 * GUARD) as usize;
        // At vmfault's address if it is free: far below the kernel's
        // top-down area, so that a mapping the kernel places (an
        // `mremap` that moves where it likes) never lands in a hole of the
        // window, as vmfault's never does.
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        let want = (VM_BASE - GUARD) as *mut libc::c_void;
        let mut r = libc::mmap(want, total, libc::PROT_NONE, flags | libc::MAP_FIXED_NOREPLACE, -1, 0);
        if r != want {
            if r != libc::MAP_FAILED {
                libc::munmap(r, total);
            }
            r = libc::mmap(ptr::null_mut(), total, libc::PROT_NONE, flags, -1, 0);
        }
        if r == libc::MAP_FAILED {
            libc::_exit(3);
        }
        libc::munmap(r, total);
        let g0 = r as u64;
        let gfl = libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
        libc::mmap(g0 as *mut libc::c_void, GUARD as usize, libc::PROT_NONE, gfl, -1, 0);
        libc::mmap((g0 + GUARD + W) as *mut libc::c_void, GUARD as usize, libc::PROT_NONE, gfl, -1, 0);
        let base = g0 + GUARD;
        (*sh).base = base;
        // The heap moves into the window (as `vmfault_guards` puts it).
        if !move_heap(sh, base + HEAP_OFF) {
            libc::_exit(5);
        }
        // Processes take turns: each runs the ops it owns, in order, and
        // waits for the others' (`ops_done` is the turn).
        let mut me = 0u8;
        let mut kids = [0 as libc::pid_t; 16];
        let mut nkids = 0;
        let mut i = 0;
        while i < ops.len() {
            if owner[i] != me {
                let mut waited = 0u64;
                while ptr::read_volatile(&raw const (*sh).ops_done) <= i as u64 {
                    libc::usleep(20);
                    waited += 1;
                    if waited > 5_000_000 {
                        libc::_exit(4);
                    }
                }
                std::sync::atomic::fence(Ordering::SeqCst);
                i += 1;
                continue;
            }
            let mut r = match ops[i] {
                TOp::Fork => {
                    let pid = libc::fork();
                    if pid == 0 {
                        // The child: its parent reports the op, and the
                        // child waits for that report (the turn check
                        // above: op `i` is its parent's) before it runs
                        // anything, since both append to the shared maps.
                        me = fork_id[i];
                        nkids = 0;
                        continue;
                    }
                    if pid < 0 {
                        RawResult { errno: errno(), ..res(K_ERR) }
                    } else {
                        kids[nkids] = pid;
                        nkids += 1;
                        res(K_OK)
                    }
                }
                TOp::Switch(_) => res(K_OK),
                TOp::Exit => unit(libc::munmap(base as *mut libc::c_void, W as usize)),
                ref op => exec(sh, base, op, fd),
            };
            let (at, n) = record_maps(sh, base);
            r.maps_at = at;
            r.maps_len = n;
            (*sh).results[i] = r;
            std::sync::atomic::fence(Ordering::SeqCst);
            ptr::write_volatile(&raw mut (*sh).ops_done, i as u64 + 1);
            i += 1;
        }
        for &k in &kids[..nkids] {
            let mut st = 0;
            libc::waitpid(k, &mut st, 0);
        }
        if me == 0 {
            ptr::write_volatile(&raw mut (*sh).status, 1);
        }
        libc::_exit(0);
    }
}

/// Run `ops` on the host kernel: each outcome, and the window's mappings
/// after each op. File operations map `file` (open for reading and
/// writing), which holds what they wrote once this returns.
pub fn run_host(ops: &[TOp], file: Option<&std::fs::File>) -> Result<(Vec<Outcome>, Vec<Vec<MapEntry>>), String> {
    let fd = file.map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
    assert!(ops.len() <= MAX_OPS, "at most {MAX_OPS} ops per sequence");
    for op in ops {
        if let TOp::Read { len, .. }
        | TOp::Write { len, .. }
        | TOp::ForceRead { len, .. }
        | TOp::ForceWrite { len, .. } = op
        {
            assert!(*len as usize <= CHUNK, "loads and stores are limited to {CHUNK} bytes: {op:?}");
        }
    }
    let owner = owners(ops);
    let mut forks = 0u8;
    let fork_id: Vec<u8> = ops
        .iter()
        .map(|op| {
            if *op == TOp::Fork {
                forks += 1;
            }
            forks
        })
        .collect();
    let size = std::mem::size_of::<Shared>();
    // SAFETY: a fresh shared anonymous mapping, zero-filled, big enough for `Shared`.
    let sh = unsafe {
        let p = libc::mmap(
            ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        p as *mut Shared
    };
    // SAFETY: fork; the child only runs `child`, which never returns.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: `sh` is the shared mapping; `ops` was copied into the child by fork.
        unsafe { child(sh, ops, &owner, &fork_id, fd) }
    }
    assert!(pid > 0, "fork failed");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut st = 0;
    loop {
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if Instant::now() > deadline {
            // SAFETY: our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut st, 0);
            }
            return Err("host child timed out".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // SAFETY: the child has exited; the mapping is ours to read, then unmap.
    unsafe {
        let shr: &Shared = &*sh;
        let done = shr.ops_done as usize;
        if shr.status != 1 || done != ops.len() || !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 0 {
            libc::munmap(sh.cast(), size);
            return Err(format!("host child failed after {done} of {} ops (status {st:#x})", ops.len()));
        }
        let mut outcomes = Vec::with_capacity(done);
        let mut maps = Vec::with_capacity(done);
        for r in &shr.results[..done] {
            let data = || shr.data[r.data_at as usize..(r.data_at + r.data_len) as usize].to_vec();
            outcomes.push(match r.kind {
                K_OK => Outcome::Ok,
                K_ADDR => Outcome::Addr(r.off),
                K_ELSEWHERE => Outcome::Elsewhere,
                K_ERR => Outcome::Err(r.errno),
                K_DATA => Outcome::Data(data()),
                K_SEGV if r.segv_code >> 16 == i64::from(libc::SIGBUS) => {
                    Outcome::Bus { off: r.segv_off, data: data() }
                }
                K_SEGV => Outcome::Segv { off: r.segv_off, code: (r.segv_code & 0xffff) as i32, data: data() },
                k => return Err(format!("host child wrote a result of unknown kind {k}")),
            });
            maps.push(
                shr.maps[r.maps_at as usize..(r.maps_at + r.maps_len) as usize]
                    .iter()
                    .map(|m| (m[0], m[1], m[2] as u8))
                    .collect(),
            );
        }
        libc::munmap(sh.cast(), size);
        Ok((outcomes, maps))
    }
}
