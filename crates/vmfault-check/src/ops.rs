//! The operations that the differential and model tests generate, and how
//! vmfault runs them. Addresses are offsets into a window of
//! `WINDOW_PAGES` pages, fenced on both sides by shared `PROT_NONE`
//! guards (they never merge with anything), so that the same sequence can
//! run at different absolute addresses here and in the host kernel.

use proptest::prelude::*;
use vmfault::{Access, AddressSpace, Advice, Error, MapFlags, MremapFlags, MsyncFlags, Prot};

/// A page.
pub const P: u64 = 4096;
/// Pages of the window the operations work in.
pub const WINDOW_PAGES: u64 = 48;
/// Bytes of the window.
pub const W: u64 = WINDOW_PAGES * P;
/// Bytes of the `PROT_NONE` guard on each side of the window.
pub const GUARD: u64 = 16 * P;
/// Whole pages of the sequences' file; then `FILE_TAIL` bytes of a last,
/// partial page (bytes past it read as zeros; pages past it are SIGBUS).
pub const FILE_PAGES: u64 = 40;
/// Bytes of the file's last, partial page.
pub const FILE_TAIL: u64 = 100;

/// What the sequences' file holds at the start (a fresh copy per run).
pub fn file_contents() -> Vec<u8> {
    (0..FILE_PAGES * P + FILE_TAIL).map(|i| ((i * 7 + (i >> 12) * 13) as u8) | 0x80).collect()
}
/// Where the heap starts in the window (`brk`): near its top, where the
/// sequences' first mapping (`W - 8 * P` from one of the first four
/// pages) leaves it free in half of them and covers its start in the
/// other half; the top guard bounds its growth.
pub const HEAP_OFF: u64 = 41 * P;
/// Where the window starts in vmfault (any free, aligned range will do):
/// half of it below 80 TiB, half above, so that its mappings cross the
/// edge of two `map_lock=zoned` zones (and of every smaller power of two).
pub const VM_BASE: u64 = 0x5000_0000_0000 - W / 2;
/// The top of the user address space (x86-64, 4-level paging).
pub const TASK_SIZE: u64 = (1 << 47) - P;

/// How an mmap chooses its address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// `MAP_FIXED` at the offset.
    Fixed,
    /// `MAP_FIXED_NOREPLACE` at the offset.
    NoReplace,
    /// A hint at the offset (shared mappings only: when the kernel puts it
    /// elsewhere it is unmapped at once, and shared mappings never merge,
    /// so where "elsewhere" was leaves no trace).
    HintShared,
    /// Address 0, shared; unmapped at once.
    AnywhereShared,
}

/// Operations with absolute arguments that fail before changing anything,
/// in the host as in vmfault (overflows, ranges beyond `TASK_SIZE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)] // each names the call and what is out of range
pub enum AbsOp {
    MunmapHugeLen,
    MunmapAboveTask,
    MprotectAlignOverflow,
    MprotectWrapEnd,
    MadviseHugeLen,
    MadviseWrapEnd,
    MadviseAboveTask,
    MmapHugeLen,
    MmapAlignOverflow,
    MmapFixedTop,
    MmapNoType,
}

/// One operation of a sequence; offsets are relative to the window, the
/// other fields are the system call's arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(missing_docs)] // fields named as the system call's arguments
pub enum TOp {
    Mmap {
        place: Place,
        off: u64,
        len: u64,
        prot: u32,
        flags: u32,
    },
    Munmap {
        off: u64,
        len: u64,
    },
    Mprotect {
        off: u64,
        len: u64,
        prot: u32,
    },
    Madvise {
        off: u64,
        len: u64,
        advice: i32,
    },
    Read {
        off: u64,
        len: u64,
    },
    Write {
        off: u64,
        len: u64,
        seed: u8,
    },
    Touch {
        off: u64,
        write: bool,
    },
    /// An atomic add of `val` to the 8-byte aligned `u64` at `off`
    /// (`lock xadd`; vmfault's `fetch_add_u64`): the value before, as data.
    FetchAdd {
        off: u64,
        val: u64,
    },
    /// A debugger's read of `len` bytes at `off` (`pread` of
    /// `/proc/self/mem` on the host, `read_remote` with `force` here):
    /// protection ignored; the bytes read before the first page that
    /// cannot be, as data, and there a failure (`Segv` with code 0).
    ForceRead {
        off: u64,
        len: u64,
    },
    /// A debugger's write (`pwrite` of `/proc/self/mem`, `write_remote`
    /// with `force`): a private mapping is written whatever its
    /// protection, a shared one only with `PROT_WRITE`.
    ForceWrite {
        off: u64,
        len: u64,
        seed: u8,
    },
    /// `mincore` of `len` bytes at `off` (any offset: EINVAL unless page
    /// aligned): one byte per page, as data. Pages of a file, and on the
    /// small machine with swap every page, are compared by length only
    /// (the host's page cache and its readahead, and pageouts here, decide
    /// them).
    Mincore {
        off: u64,
        len: u64,
    },
    /// `mlock` (any offset: it rounds down).
    Mlock {
        off: u64,
        len: u64,
    },
    Munlock {
        off: u64,
        len: u64,
    },
    /// `mremap` of `old_len` bytes at `off` to `new_len` bytes, with raw
    /// `MREMAP_*` flags and (for `MREMAP_FIXED`) the window offset
    /// `new_off`: the address after, as `Addr` when it stayed or moved
    /// where `MREMAP_FIXED` said; `Elsewhere` when it moved where the
    /// kernel chose (then it is unmapped: the host's choice may be in the
    /// window, vmfault's never is).
    Mremap {
        off: u64,
        old_len: u64,
        new_len: u64,
        flags: u32,
        new_off: u64,
    },
    /// `brk` to the window offset `off` (any byte; the heap starts at
    /// `HEAP_OFF`): the break after the call, as an offset (`Addr`).
    Brk {
        off: u64,
    },
    /// Map the sequences' file from page `fpage` (shared or private),
    /// `MAP_FIXED` (or `MAP_FIXED_NOREPLACE`) at the window offset.
    MmapFile {
        place: Place,
        off: u64,
        len: u64,
        prot: u32,
        shared: bool,
        fpage: u64,
    },
    /// `msync` with raw `MS_*` flags.
    Msync {
        off: u64,
        len: u64,
        flags: u32,
    },
    Abs(AbsOp),
    /// The current process forks; the child gets the next process number
    /// (the first process is 0) and the parent stays current.
    Fork,
    /// Make process `n` current.
    Switch(u8),
    /// The current process exits (the host unmaps its window and idles;
    /// nothing else can observe the difference). A `Switch` follows.
    Exit,
}

impl TOp {
    /// Whether this op drives processes rather than memory.
    pub fn is_process_op(&self) -> bool {
        matches!(self, TOp::Fork | TOp::Switch(_) | TOp::Exit)
    }
}

/// The process that runs each op of `ops` (`Switch(n)` runs in `n`).
pub fn owners(ops: &[TOp]) -> Vec<u8> {
    let mut cur = 0u8;
    ops.iter()
        .map(|op| {
            if let TOp::Switch(n) = op {
                cur = *n;
            }
            cur
        })
        .collect()
}

/// What an operation produced, relative to the window.
#[derive(Clone, PartialEq, Eq)]
#[allow(missing_docs)] // offsets, codes and bytes as observed
pub enum Outcome {
    Ok,
    /// mmap placed the mapping at this window offset.
    Addr(u64),
    /// mmap placed it somewhere else (then it was unmapped).
    Elsewhere,
    Err(i32),
    Data(Vec<u8>),
    /// SIGSEGV at a window offset, with the bytes read before it.
    Segv {
        off: i64,
        code: i32,
        data: Vec<u8>,
    },
    /// SIGBUS (a file page past the end of the file) at a window offset,
    /// with the bytes read before it.
    Bus {
        off: i64,
        data: Vec<u8>,
    },
}

impl Outcome {
    /// The bytes an access produced (read, or read before a signal).
    pub fn data(&self) -> Option<&[u8]> {
        match self {
            Outcome::Data(d) | Outcome::Segv { data: d, .. } | Outcome::Bus { data: d, .. } => Some(d),
            _ => None,
        }
    }

    /// Where two outcomes' bytes first differ, and the run of differing
    /// bytes from there (for a divergence report).
    pub fn first_difference(&self, other: &Outcome) -> Option<(usize, usize)> {
        let (a, b) = (self.data()?, other.data()?);
        let at = a.iter().zip(b).position(|(x, y)| x != y)?;
        let run = a[at..].iter().zip(&b[at..]).take_while(|(x, y)| x != y).count();
        Some((at, run))
    }
}

/// Bytes shown as length, a checksum and the non-zero runs, not in full.
struct Bytes<'a>(&'a [u8]);

impl std::fmt::Debug for Bytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sum = self.0.iter().fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        let nonzero = self.0.iter().filter(|&&b| b != 0).count();
        let first = self.0.iter().position(|&b| b != 0);
        write!(f, "[{} bytes, {} non-zero, first non-zero at {:?}, hash {:#x}]", self.0.len(), nonzero, first, sum)
    }
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Ok => write!(f, "Ok"),
            Outcome::Addr(a) => write!(f, "Addr({a:#x})"),
            Outcome::Elsewhere => write!(f, "Elsewhere"),
            Outcome::Err(e) => write!(f, "Err({e})"),
            Outcome::Data(d) => write!(f, "Data({:?})", Bytes(d)),
            Outcome::Segv { off, code, data } => {
                write!(f, "Segv {{ off: {off:#x}, code: {code}, data: {:?} }}", Bytes(data))
            }
            Outcome::Bus { off, data } => write!(f, "Bus {{ off: {off:#x}, data: {:?} }}", Bytes(data)),
        }
    }
}

/// One mapping clipped to the window: offsets and `rwxs` bits.
pub type MapEntry = (u64, u64, u8);

/// `maps` with neighbouring entries of equal permissions merged: the
/// pages mapped and their permissions, whatever the VMA boundaries.
pub fn merged(maps: &[MapEntry]) -> Vec<MapEntry> {
    let mut out: Vec<MapEntry> = Vec::with_capacity(maps.len());
    for &(start, end, perms) in maps {
        match out.last_mut() {
            Some(last) if last.1 == start && last.2 == perms => last.1 = end,
            _ => out.push((start, end, perms)),
        }
    }
    out
}

/// The `rwxs` bits of a mapping, as one byte.
pub fn perm_bits(r: bool, w: bool, x: bool, s: bool) -> u8 {
    u8::from(r) | u8::from(w) << 1 | u8::from(x) << 2 | u8::from(s) << 3
}

/// The bytes a `Write` op stores.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i as u8).wrapping_mul(31)) | 1).collect()
}

impl AbsOp {
    /// Every one of them.
    pub const ALL: [AbsOp; 11] = [
        AbsOp::MunmapHugeLen,
        AbsOp::MunmapAboveTask,
        AbsOp::MprotectAlignOverflow,
        AbsOp::MprotectWrapEnd,
        AbsOp::MadviseHugeLen,
        AbsOp::MadviseWrapEnd,
        AbsOp::MadviseAboveTask,
        AbsOp::MmapHugeLen,
        AbsOp::MmapAlignOverflow,
        AbsOp::MmapFixedTop,
        AbsOp::MmapNoType,
    ];

    /// `(call, addr, len, prot, flags)` for the host and vmfault alike.
    pub fn args(self, base: u64) -> (&'static str, u64, u64, u32, u32) {
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u32;
        let pa = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32;
        match self {
            AbsOp::MunmapHugeLen => ("munmap", base, u64::MAX, 0, 0),
            AbsOp::MunmapAboveTask => ("munmap", TASK_SIZE + P, P, 0, 0),
            AbsOp::MprotectAlignOverflow => ("mprotect", base, u64::MAX - 10, libc::PROT_READ as u32, 0),
            AbsOp::MprotectWrapEnd => ("mprotect", u64::MAX - 2 * P + 1, 3 * P, libc::PROT_READ as u32, 0),
            AbsOp::MadviseHugeLen => ("madvise", base, u64::MAX, libc::MADV_DONTNEED as u32, 0),
            AbsOp::MadviseWrapEnd => ("madvise", u64::MAX - 2 * P + 1, 3 * P, libc::MADV_DONTNEED as u32, 0),
            AbsOp::MadviseAboveTask => ("madvise", TASK_SIZE + P, P, libc::MADV_DONTNEED as u32, 0),
            AbsOp::MmapHugeLen => ("mmap", 0, 1 << 48, rw, pa),
            AbsOp::MmapAlignOverflow => ("mmap", 0, u64::MAX - 10, rw, pa),
            AbsOp::MmapFixedTop => ("mmap", TASK_SIZE - P, 2 * P, rw, pa | libc::MAP_FIXED as u32),
            AbsOp::MmapNoType => ("mmap", base, P, rw, (libc::MAP_ANONYMOUS | libc::MAP_FIXED) as u32),
        }
    }
}

fn errno(e: Error) -> Outcome {
    Outcome::Err(e.errno())
}

fn unit(r: Result<(), Error>) -> Outcome {
    r.map_or_else(errno, |_| Outcome::Ok)
}

fn segv_or(e: Error, base: u64, data: Vec<u8>) -> Outcome {
    match e {
        Error::Segv { addr, code } => Outcome::Segv { off: addr as i64 - base as i64, code: code.si_code(), data },
        Error::Bus { addr, .. } | Error::PageIo { addr, .. } => Outcome::Bus { off: addr as i64 - base as i64, data },
        other => errno(other),
    }
}

/// A forced access that stopped at a page it could not reach: `Segv`
/// there with code 0 (the host's `/proc/self/mem` says only how far it
/// got), and the bytes read before it (`data`, cut there).
fn forced_failure(e: Error, base: u64, off: u64, mut data: Vec<u8>) -> Outcome {
    match e {
        Error::Segv { addr, .. } | Error::Bus { addr, .. } | Error::PageIo { addr, .. } => {
            data.truncate((addr - (base + off)) as usize);
            Outcome::Segv { off: addr as i64 - base as i64, code: 0, data }
        }
        other => errno(other),
    }
}

/// Run `op` on vmfault with the window at `base`; `file` is the
/// sequences' file (file operations need it).
pub fn run_vmfault(space: &AddressSpace, base: u64, op: &TOp, file: Option<&std::fs::File>) -> Outcome {
    run_vmfault_in(space, None, base, op, file)
}

/// [`run_vmfault`], with the loads and stores of `Read`, `Write`, `Touch`
/// and aligned `FetchAdd` done natively through `view` (a host view of
/// the window) if given: each page piece is first touched through the API
/// with the op's access (the fault, or the SIGSEGV outcome, as the API's
/// own would be), then copied with plain loads and stores (or the host's
/// atomics) through the view, which must show what the space holds: a
/// host mapping the space forgot to take away shows up as a difference.
pub fn run_vmfault_in(
    space: &AddressSpace,
    view: Option<&vmfault::HostView>,
    base: u64,
    op: &TOp,
    file: Option<&std::fs::File>,
) -> Outcome {
    if let Some(view) = view
        && let Some(got) = native(space, view, base, op)
    {
        return got;
    }
    match *op {
        TOp::MmapFile { place, off, len, prot, shared, fpage } => {
            let file = file.expect("file operations need the sequences' file");
            let mut fl = if shared { MapFlags::SHARED } else { MapFlags::PRIVATE };
            fl |= if place == Place::NoReplace { MapFlags::FIXED_NOREPLACE } else { MapFlags::FIXED };
            match space.mmap_file(base + off, len, Prot::from_bits_retain(prot), fl, file, fpage * P) {
                Err(e) => errno(e),
                Ok(a) if a == base + off => Outcome::Addr(off),
                Ok(a) => {
                    space.munmap(a, len).expect("unmapping a fresh mapping");
                    Outcome::Elsewhere
                }
            }
        }
        TOp::Msync { off, len, flags } => unit(space.msync_flags(base + off, len, MsyncFlags::from_bits_retain(flags))),
        TOp::Mmap { place, off, len, prot, flags } => {
            let prot = Prot::from_bits_retain(prot);
            let mut fl = MapFlags::from_bits_retain(flags);
            let addr = match place {
                Place::Fixed => {
                    fl |= MapFlags::FIXED;
                    base + off
                }
                Place::NoReplace => {
                    fl |= MapFlags::FIXED_NOREPLACE;
                    base + off
                }
                Place::HintShared => base + off,
                Place::AnywhereShared => 0,
            };
            match space.mmap(addr, len, prot, fl) {
                Err(e) => errno(e),
                Ok(a) if a == base + off && place != Place::AnywhereShared => Outcome::Addr(off),
                Ok(a) => {
                    space.munmap(a, len).expect("unmapping a fresh mapping");
                    Outcome::Elsewhere
                }
            }
        }
        TOp::Munmap { off, len } => unit(space.munmap(base + off, len)),
        TOp::Mprotect { off, len, prot } => unit(space.mprotect(base + off, len, Prot::from_bits_retain(prot))),
        TOp::Madvise { off, len, advice } => {
            unit(space.madvise(base + off, len, Advice::from_raw(advice).expect("generated advice is known")))
        }
        TOp::Read { off, len } => {
            let mut buf = vec![0u8; len as usize];
            match space.read(base + off, &mut buf) {
                Ok(()) => Outcome::Data(buf),
                Err(e) => {
                    let keep = match e {
                        Error::Segv { addr, .. } | Error::Bus { addr, .. } => (addr - (base + off)) as usize,
                        _ => 0,
                    };
                    buf.truncate(keep);
                    segv_or(e, base, buf)
                }
            }
        }
        TOp::Write { off, len, seed } => match space.write(base + off, &pattern(seed, len as usize)) {
            Ok(()) => Outcome::Ok,
            Err(e) => segv_or(e, base, Vec::new()),
        },
        TOp::Touch { off, write } => match space.touch(base + off, if write { Access::Write } else { Access::Read }) {
            Ok(()) => Outcome::Ok,
            Err(e) => segv_or(e, base, Vec::new()),
        },
        TOp::FetchAdd { off, val } => match space.fetch_add_u64(base + off, val) {
            Ok(old) => Outcome::Data(old.to_ne_bytes().to_vec()),
            Err(e) => segv_or(e, base, Vec::new()),
        },
        TOp::ForceRead { off, len } => {
            let mut buf = vec![0u8; len as usize];
            match space.read_remote(base + off, &mut buf, true) {
                Ok(()) => Outcome::Data(buf),
                Err(e) => forced_failure(e, base, off, buf),
            }
        }
        TOp::ForceWrite { off, len, seed } => {
            match space.write_remote(base + off, &pattern(seed, len as usize), true) {
                Ok(()) => Outcome::Ok,
                Err(e) => forced_failure(e, base, off, Vec::new()),
            }
        }
        TOp::Mlock { off, len } => unit(space.mlock(base + off, len)),
        TOp::Mincore { off, len } => match space.mincore(base + off, len) {
            Ok(v) => Outcome::Data(v),
            Err(e) => errno(e),
        },
        TOp::Munlock { off, len } => unit(space.munlock(base + off, len)),
        TOp::Brk { off } => Outcome::Addr(space.brk(base + off).wrapping_sub(base)),
        TOp::Mremap { off, old_len, new_len, flags, new_off } => {
            match space.mremap(base + off, old_len, new_len, MremapFlags::from_bits_retain(flags), base + new_off) {
                Err(e) => errno(e),
                Ok(a) if a == base + off || (flags & libc::MREMAP_FIXED as u32 != 0 && a == base + new_off) => {
                    Outcome::Addr(a - base)
                }
                Ok(a) => {
                    space.munmap(a, new_len).expect("unmapping a moved mapping");
                    Outcome::Elsewhere
                }
            }
        }
        TOp::Fork | TOp::Switch(_) | TOp::Exit => unreachable!("process ops are run by the caller: {op:?}"),
        TOp::Abs(a) => {
            let (call, addr, len, prot, flags) = a.args(base);
            match call {
                "munmap" => unit(space.munmap(addr, len)),
                "mprotect" => unit(space.mprotect(addr, len, Prot::from_bits_retain(prot))),
                "madvise" => unit(space.madvise(addr, len, Advice::from_raw(prot as i32).unwrap())),
                _ => space
                    .mmap(addr, len, Prot::from_bits_retain(prot), MapFlags::from_bits_retain(flags))
                    .map_or_else(errno, |a| {
                        space.munmap(a, len).unwrap();
                        Outcome::Elsewhere
                    }),
            }
        }
    }
}

/// `op` through `view` (see [`run_vmfault_in`]); `None` for the ops that
/// have no native form.
fn native(space: &AddressSpace, view: &vmfault::HostView, base: u64, op: &TOp) -> Option<Outcome> {
    // Each piece of `start..start+len` within one page, touched first.
    let pieces = |start: u64, len: u64, access: Access, mut each: Box<dyn FnMut(u64, usize, usize) + '_>| {
        let mut done = 0u64;
        while done < len {
            let a = start + done;
            let n = (P - a % P).min(len - done);
            space.touch(a, access).map_err(|e| (e, done))?;
            each(a, done as usize, n as usize);
            done += n;
        }
        Ok::<(), (Error, u64)>(())
    };
    let ptr = |a: u64| view.ptr(a).expect("the view covers the window");
    Some(match *op {
        TOp::Read { off, len } => {
            let mut buf = vec![0u8; len as usize];
            let out = buf.as_mut_ptr();
            // SAFETY: the page is touched, so mapped in the view or faults
            // into it; `out` holds `len` bytes.
            let r = pieces(
                base + off,
                len,
                Access::Read,
                Box::new(|a, at, n| unsafe { std::ptr::copy_nonoverlapping(ptr(a), out.add(at), n) }),
            );
            match r {
                Ok(()) => Outcome::Data(buf),
                Err((e, done)) => {
                    buf.truncate(done as usize);
                    segv_or(e, base, buf)
                }
            }
        }
        TOp::Write { off, len, seed } => {
            let data = pattern(seed, len as usize);
            // SAFETY: as for reads; `data` holds `len` bytes.
            let r = pieces(
                base + off,
                len,
                Access::Write,
                Box::new(|a, at, n| unsafe { std::ptr::copy_nonoverlapping(data.as_ptr().add(at), ptr(a), n) }),
            );
            match r {
                Ok(()) => Outcome::Ok,
                Err((e, _)) => segv_or(e, base, Vec::new()),
            }
        }
        TOp::Touch { off, write } => {
            let access = if write { Access::Write } else { Access::Read };
            // SAFETY: touched first; a one-byte atomic of the view's memory.
            let r = pieces(
                base + off,
                1,
                access,
                Box::new(|a, _, _| unsafe {
                    let b = &*ptr(a).cast::<std::sync::atomic::AtomicU8>();
                    if write {
                        b.fetch_or(0, std::sync::atomic::Ordering::SeqCst);
                    } else {
                        b.load(std::sync::atomic::Ordering::SeqCst);
                    }
                }),
            );
            match r {
                Ok(()) => Outcome::Ok,
                Err((e, _)) => segv_or(e, base, Vec::new()),
            }
        }
        TOp::FetchAdd { off, val } if off % 8 == 0 => {
            let mut old = 0;
            // SAFETY: touched for writing first; an aligned word of the view.
            let r = pieces(
                base + off,
                8,
                Access::Write,
                Box::new(|a, _, _| unsafe {
                    old = (*ptr(a).cast::<std::sync::atomic::AtomicU64>())
                        .fetch_add(val, std::sync::atomic::Ordering::SeqCst);
                }),
            );
            match r {
                Ok(()) => Outcome::Data(old.to_ne_bytes().to_vec()),
                Err((e, _)) => segv_or(e, base, Vec::new()),
            }
        }
        _ => return None,
    })
}

/// vmfault's mappings clipped to the window at `base`.
pub fn vmfault_maps(space: &AddressSpace, base: u64) -> Vec<MapEntry> {
    clip(
        space.mappings().iter().map(|m| {
            let (r, w, x) = (m.prot.contains(Prot::READ), m.prot.contains(Prot::WRITE), m.prot.contains(Prot::EXEC));
            (m.start, m.end, perm_bits(r, w, x, m.shared))
        }),
        base,
    )
}

/// Clip absolute mappings to the window and make them relative.
pub fn clip(maps: impl Iterator<Item = (u64, u64, u8)>, base: u64) -> Vec<MapEntry> {
    maps.filter(|&(s, e, _)| e > base && s < base + W)
        .map(|(s, e, p)| (s.max(base) - base, e.min(base + W) - base, p))
        .collect()
}

/// Set up the guards around the window in a vmfault space.
pub fn vmfault_guards(space: &AddressSpace, base: u64) {
    let fl = MapFlags::SHARED | MapFlags::ANONYMOUS | MapFlags::FIXED;
    space.mmap(base - GUARD, GUARD, Prot::NONE, fl).unwrap();
    space.mmap(base + W, GUARD, Prot::NONE, fl).unwrap();
    // The heap starts inside the window (the host's child moves its own
    // there with `prctl(PR_SET_MM_MAP)`).
    space.set_heap_start(base + HEAP_OFF).unwrap();
}

// ---------------------------------------------------------------- generation

fn page_off() -> impl Strategy<Value = u64> {
    prop_oneof![
        19 => (0..WINDOW_PAGES).prop_map(|p| p * P),
        1 => (0..WINDOW_PAGES, 1..P).prop_map(|(p, b)| p * P + b),
    ]
}

/// A length that keeps `off + len` inside the window.
fn len_from(off: u64, max_pages: u64) -> impl Strategy<Value = u64> {
    let room = W - off;
    let max = (max_pages * P).min(room);
    prop_oneof![
        2 => Just(0u64),
        30 => (1..=max_pages).prop_map(move |p| (p * P).min(max)),
        3 => (1..=max.max(1)).prop_map(move |l| l.min(max)),
    ]
}

fn prot() -> impl Strategy<Value = u32> {
    let (r, w, x) = (libc::PROT_READ as u32, libc::PROT_WRITE as u32, libc::PROT_EXEC as u32);
    prop_oneof![
        2 => Just(0),
        4 => Just(r),
        12 => Just(r | w),
        1 => Just(w),
        1 => Just(r | x),
        1 => Just(r | w | x),
    ]
}

fn map_flags(place: Place) -> impl Strategy<Value = u32> {
    let (s, p, a) = (libc::MAP_SHARED as u32, libc::MAP_PRIVATE as u32, libc::MAP_ANONYMOUS as u32);
    let (nr, pop) = (libc::MAP_NORESERVE as u32, libc::MAP_POPULATE as u32);
    let ty = match place {
        Place::HintShared | Place::AnywhereShared => Just(s).boxed(),
        _ => prop_oneof![24 => Just(p), 8 => Just(s), 1 => Just(0u32), 1 => Just(s | p)].boxed(),
    };
    // Flags Linux accepts and ignores here: thread stacks', the legacy
    // no-ops, MAP_NONBLOCK (no populate), and a bit Linux does not define.
    let ignored = prop_oneof![
        20 => Just(0u32),
        2 => Just(libc::MAP_STACK as u32),
        1 => Just(libc::MAP_NONBLOCK as u32),
        1 => Just((libc::MAP_DENYWRITE | libc::MAP_EXECUTABLE) as u32),
        1 => Just(0x0080_0000u32),
    ];
    // MAP_LOCKED: mmap and mlock in one.
    let locked = prop_oneof![15 => Just(0u32), 1 => Just(libc::MAP_LOCKED as u32)];
    (ty, prop::bool::weighted(0.12), prop::bool::weighted(0.12), ignored, locked)
        .prop_map(move |(t, n, o, i, l)| t | a | if n { nr } else { 0 } | if o { pop } else { 0 } | i | l)
}

fn advice() -> impl Strategy<Value = i32> {
    prop_oneof![
        6 => Just(libc::MADV_DONTNEED),
        1 => Just(libc::MADV_WILLNEED),
        2 => Just(libc::MADV_RANDOM),
        1 => Just(libc::MADV_SEQUENTIAL),
        2 => Just(libc::MADV_NORMAL),
        1 => Just(libc::MADV_FREE),
        1 => Just(libc::MADV_COLD),
        1 => Just(libc::MADV_PAGEOUT),
    ]
}

fn abs_op() -> impl Strategy<Value = AbsOp> {
    prop::sample::select(AbsOp::ALL.to_vec())
}

/// One random operation inside the window.
pub fn op() -> impl Strategy<Value = TOp> {
    let place = prop_oneof![6 => Just(Place::Fixed), 8 => Just(Place::NoReplace), 2 => Just(Place::HintShared), 1 => Just(Place::AnywhereShared)];
    let mmap = (place, page_off()).prop_flat_map(|(place, off)| {
        (Just(place), Just(off), len_from(off, 24), prot(), map_flags(place))
            .prop_map(|(place, off, len, prot, flags)| TOp::Mmap { place, off, len, prot, flags })
    });
    let munmap = page_off().prop_flat_map(|off| len_from(off, 16).prop_map(move |len| TOp::Munmap { off, len }));
    let mprotect =
        page_off().prop_flat_map(|off| {
            (len_from(off, 16), prop_oneof![20 => prot(), 1 => Just(0x100u32)])
                .prop_map(move |(len, prot)| TOp::Mprotect { off, len, prot })
        });
    let madvise = page_off().prop_flat_map(|off| {
        (len_from(off, 16), advice()).prop_map(move |(len, advice)| TOp::Madvise { off, len, advice })
    });
    let read = (0..W).prop_flat_map(|off| (1..=(6 * P).min(W - off)).prop_map(move |len| TOp::Read { off, len }));
    let write = (0..W).prop_flat_map(|off| {
        (1..=(6 * P).min(W - off), any::<u8>()).prop_map(move |(len, seed)| TOp::Write { off, len, seed })
    });
    let touch = (0..W, any::<bool>()).prop_map(|(off, write)| TOp::Touch { off, write });
    let fetch_add = (0..W / 8, any::<u64>()).prop_map(|(word, val)| TOp::FetchAdd { off: word * 8, val });
    let force_read =
        (0..W).prop_flat_map(|off| (1..=(3 * P).min(W - off)).prop_map(move |len| TOp::ForceRead { off, len }));
    let force_write = (0..W).prop_flat_map(|off| {
        (1..=(3 * P).min(W - off), any::<u8>()).prop_map(move |(len, seed)| TOp::ForceWrite { off, len, seed })
    });
    let mincore = (0..W, any::<bool>()).prop_flat_map(|(off, aligned)| {
        let off = if aligned { off & !(P - 1) } else { off };
        (Just(off), 0..=(8 * P).min(W - off)).prop_map(|(off, len)| TOp::Mincore { off, len })
    });
    // `brk` from just below the heap's start to the window's top (a few
    // far below it: a query), mostly to page boundaries.
    let brk = prop_oneof![
        6 => (HEAP_OFF / P - 1..=WINDOW_PAGES).prop_map(|p| TOp::Brk { off: p * P }),
        2 => (HEAP_OFF - P..W).prop_map(|off| TOp::Brk { off }),
        1 => (0..HEAP_OFF).prop_map(|off| TOp::Brk { off }),
    ];
    let lock = (0..W, any::<bool>())
        .prop_flat_map(|(off, lock)| (Just(off), 0..=(12 * P).min(W - off), Just(lock)))
        .prop_map(|(off, len, lock)| if lock { TOp::Mlock { off, len } } else { TOp::Munlock { off, len } });
    prop_oneof![
        14 => mmap,
        3 => munmap,
        7 => mprotect,
        5 => madvise,
        8 => read,
        9 => write,
        5 => touch,
        3 => fetch_add,
        4 => lock,
        2 => mincore,
        4 => brk,
        1 => force_read,
        1 => force_write,
        1 => abs_op().prop_map(TOp::Abs),
    ]
}

/// A file operation: a shared mapping of the sequences' file (its pages,
/// some past its end), or an `msync` with any flags.
///
/// One file mapping in four is private. vmfault gives one its shadow
/// object at `mmap` where Linux gives it an anon_vma at the first write,
/// so pieces of one that Linux keeps apart (written while their flags
/// differed, e.g. one `mlock`ed) merge here again (a documented
/// difference): sequences with a private file mapping compare layouts
/// with neighbouring entries of equal permissions merged ([`merged`]).
pub fn file_op() -> impl Strategy<Value = TOp> {
    let place = prop_oneof![4 => Just(Place::Fixed), 1 => Just(Place::NoReplace)];
    let map = (place, page_off()).prop_flat_map(|(place, off)| {
        (Just(place), Just(off), len_from(off, 12), prot(), proptest::bool::weighted(0.75), 0..FILE_PAGES + 6)
            .prop_map(|(place, off, len, prot, shared, fpage)| TOp::MmapFile { place, off, len, prot, shared, fpage })
    });
    let (a, i, y) = (libc::MS_ASYNC as u32, libc::MS_INVALIDATE as u32, libc::MS_SYNC as u32);
    let flags = prop_oneof![8 => Just(y), 2 => Just(a), 1 => Just(y | i), 1 => Just(a | i), 1 => Just(a | y), 1 => Just(0), 1 => Just(8)];
    let msync = page_off().prop_flat_map(move |off| {
        (len_from(off, 16), flags.clone()).prop_map(move |(len, flags)| TOp::Msync { off, len, flags })
    });
    prop_oneof![3 => map, 2 => msync]
}

/// An operation the reference model does not know (it has no VMAs): an
/// `mremap`, whose results depend on where mappings begin and end, or a
/// stack ([`stack_op`]).
pub fn host_op() -> impl Strategy<Value = TOp> {
    prop_oneof![3 => mremap_op(), 1 => stack_op()]
}

/// `PROT_GROWSDOWN`.
pub const PROT_GROWSDOWN: u32 = 0x0100_0000;

/// A stack: an anonymous `MAP_GROWSDOWN` mapping (one in six shared:
/// `EINVAL`), or an `mprotect` with `PROT_GROWSDOWN` (`EINVAL` unless the
/// range begins in or below a stack, whose start it goes down to).
pub fn stack_op() -> impl Strategy<Value = TOp> {
    let (s, p, a, g) =
        (libc::MAP_SHARED as u32, libc::MAP_PRIVATE as u32, libc::MAP_ANONYMOUS as u32, libc::MAP_GROWSDOWN as u32);
    let place = prop_oneof![2 => Just(Place::Fixed), 1 => Just(Place::NoReplace), 1 => Just(Place::HintShared)];
    let stack =
        (place, page_off()).prop_flat_map(move |(place, off)| {
            let ty = match place {
                // A hint only with `MAP_SHARED` (see `Place`): always `EINVAL`.
                Place::HintShared => Just(s).boxed(),
                _ => prop_oneof![5 => Just(p), 1 => Just(s), 1 => Just(p | libc::MAP_STACK as u32)].boxed(),
            };
            (Just(place), Just(off), len_from(off, 8), prot(), ty)
                .prop_map(move |(place, off, len, prot, ty)| TOp::Mmap { place, off, len, prot, flags: ty | a | g })
        });
    let grows = page_off().prop_flat_map(|off| {
        (len_from(off, 8), prot()).prop_map(move |(len, prot)| TOp::Mprotect { off, len, prot: prot | PROT_GROWSDOWN })
    });
    prop_oneof![3 => stack, 1 => grows]
}

/// An `mremap` of a range of the window.
fn mremap_op() -> impl Strategy<Value = TOp> {
    let (m, f, d) = (libc::MREMAP_MAYMOVE as u32, libc::MREMAP_FIXED as u32, libc::MREMAP_DONTUNMAP as u32);
    let flags = prop_oneof![
        3 => Just(0u32),
        4 => Just(m),
        4 => Just(m | f),
        1 => Just(f),
        1 => Just(m | 8),
        2 => Just(m | d),
        2 => Just(m | f | d),
        1 => Just(d),
    ];
    let len = |max: u64| {
        prop_oneof![
            1 => Just(0u64),
            12 => (1..=(max / P).max(1)).prop_map(|p| p * P),
            2 => 1..=max.max(1),
        ]
    };
    (page_off(), page_off(), flags).prop_flat_map(move |(off, new_off, flags)| {
        let (old_max, new_max) = ((12 * P).min(W - off), (12 * P).min(W - new_off));
        // `MREMAP_DONTUNMAP` needs the same length: mostly given.
        let same = prop::bool::weighted(if flags & d != 0 { 0.85 } else { 0.0 });
        (Just(off), len(old_max), len(new_max), Just(flags), Just(new_off & !(P - 1)), same).prop_map(
            |(off, old_len, new_len, flags, new_off, same)| {
                let new_len = if same { old_len } else { new_len };
                TOp::Mremap { off, old_len, new_len, flags, new_off }
            },
        )
    })
}

/// Give every file mapping its own distance between file page and window
/// page, so that no two separately made private mappings of the file are
/// adjacent with contiguous offsets: Linux merges those (no anon_vma
/// yet), vmfault does not (each has its shadow object from `mmap` on; a
/// documented difference).
fn distinct_file_shifts(ops: &mut [TOp]) {
    let mut seen = std::collections::HashSet::new();
    for op in ops {
        if let TOp::MmapFile { off, fpage, .. } = op {
            while !seen.insert(*fpage as i64 - (*off / P) as i64) {
                *fpage += 1;
            }
        }
    }
}

/// A sequence: a mapping over most of the window first (so that loads and
/// stores find memory), then `n` random operations, some of them on the
/// sequences' file.
pub fn file_sequence(n: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Vec<TOp>> {
    with_files(n, true)
}

/// The same without file operations (the reference model has no files).
pub fn sequence(n: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Vec<TOp>> {
    with_files(n, false)
}

fn with_files(n: std::ops::RangeInclusive<usize>, files: bool) -> impl Strategy<Value = Vec<TOp>> {
    let first = (0..4u64, prop_oneof![3 => Just(libc::MAP_PRIVATE as u32), 1 => Just(libc::MAP_SHARED as u32)])
        .prop_map(|(o, ty)| TOp::Mmap {
            place: Place::Fixed,
            off: o * P,
            len: W - 8 * P,
            prot: (libc::PROT_READ | libc::PROT_WRITE) as u32,
            flags: ty | libc::MAP_ANONYMOUS as u32,
        });
    let any = if files { prop_oneof![10 => op(), 2 => file_op(), 2 => host_op()].boxed() } else { op().boxed() };
    (first, prop::collection::vec(any, n)).prop_map(|(f, mut rest)| {
        rest.insert(0, f);
        distinct_file_shifts(&mut rest);
        // Where a private file mapping is, the layouts are compared merged
        // (a documented difference in where its VMAs split: see
        // `file_op`), and `mremap` sees those splits (`EFAULT` past a
        // VMA's end): a load at its address there instead.
        if rest.iter().any(|op| matches!(op, TOp::MmapFile { shared: false, .. })) {
            for op in rest.iter_mut() {
                if let TOp::Mremap { off, .. } = *op {
                    *op = TOp::Touch { off, write: false };
                }
            }
        }
        rest
    })
}

/// Sequences that start from a stack alone in the window: a `MAP_GROWSDOWN`
/// mapping over its top pages, read-write, with nothing below it, so that
/// loads and stores below it grow it (until a mapping comes within the
/// guard gap below), then any operation, stacks and `mremap` included.
pub fn stack_sequence(n: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Vec<TOp>> {
    let first = (36..WINDOW_PAGES - 2).prop_map(|p| TOp::Mmap {
        place: Place::Fixed,
        off: p * P,
        len: W - p * P,
        prot: (libc::PROT_READ | libc::PROT_WRITE) as u32,
        flags: (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_GROWSDOWN) as u32,
    });
    // Accesses below the stack, most of them in the pages right below.
    let below = (0..W).prop_flat_map(|off| {
        prop_oneof![
            2 => any::<bool>().prop_map(move |write| TOp::Touch { off, write }),
            1 => (1..=(2 * P).min(W - off), any::<u8>()).prop_map(move |(len, seed)| TOp::Write { off, len, seed }),
        ]
    });
    let any = prop_oneof![10 => op(), 3 => host_op(), 6 => below];
    (first, prop::collection::vec(any, n)).prop_map(|(f, mut rest)| {
        rest.insert(0, f);
        rest
    })
}

/// What a fork sequence does between memory operations.
#[derive(Debug, Clone, Copy)]
enum Step {
    Op,
    Fork,
    Switch(u8),
    Exit,
}

/// Most processes alive at once, and forks in all, in a fork sequence.
const MAX_LIVE: usize = 4;
const MAX_FORKS: usize = 6;

/// A sequence with processes: like [`sequence`], with forks, switches
/// between the processes and exits in between. Always valid: a switch goes
/// to a live process, an exit leaves one alive and is followed by a switch.
pub fn fork_sequence(n: std::ops::RangeInclusive<usize>) -> impl Strategy<Value = Vec<TOp>> {
    let step = prop_oneof![
        20 => Just(Step::Op),
        2 => Just(Step::Fork),
        3 => any::<u8>().prop_map(Step::Switch),
        1 => Just(Step::Exit),
    ];
    (file_sequence(n.clone()), prop::collection::vec(step, n)).prop_map(|(ops, steps)| {
        let mut out = Vec::with_capacity(ops.len() * 2);
        let mut live = vec![0u8];
        let mut cur = 0u8;
        let mut forks = 0;
        let mut ops = ops.into_iter();
        out.push(ops.next().expect("a first mapping"));
        for (step, op) in steps.into_iter().zip(ops) {
            match step {
                Step::Fork if forks < MAX_FORKS && live.len() < MAX_LIVE => {
                    forks += 1;
                    live.push(forks as u8);
                    out.push(TOp::Fork);
                }
                Step::Switch(k) => {
                    cur = live[k as usize % live.len()];
                    out.push(TOp::Switch(cur));
                }
                Step::Exit if live.len() > 1 => {
                    live.retain(|&p| p != cur);
                    out.push(TOp::Exit);
                    cur = live[0];
                    out.push(TOp::Switch(cur));
                }
                _ => {}
            }
            out.push(op);
        }
        out
    })
}
