//! The frame arena: one host mapping that holds every physical frame.
//!
//! Mapped once when the `Vm` is created (private, anonymous, `NORESERVE`;
//! or, with `VmConfig::host_views`, shared, over a memfd, so that a host
//! view can map its frames elsewhere too: `phys::window`),
//! advised `MADV_HUGEPAGE` (a kernel's direct map uses large pages too) and
//! `MADV_DONTFORK` (a process that embeds vmfault and forks must not copy
//! the whole arena into the child, which could not use the `Vm` anyway: its
//! vCPU threads do not exist there), and then, optionally, prefaulted so
//! that host page faults do not pollute what we measure. The advice comes
//! first: populated before it (`MAP_POPULATE`), the arena would be backed
//! by 4 KiB host pages, and every frame access would pay their TLB misses.

// This file holds unsafe code, each block with its `// SAFETY:`
// argument, and each item that holds one allows `unsafe_code` on itself:
// the crate denies it everywhere else.

use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::types::PAGE_SIZE;

/// The memory behind all frames.
#[derive(Debug)]
pub(crate) struct Arena {
    /// `[I]` base address, 4 KiB aligned (mmap returns page-aligned memory).
    base: NonNull<u8>,
    /// `[I]` length in bytes.
    len: usize,
    /// `[I]` frames in it (`len / PAGE_SIZE`), for the bound check.
    frames: u32,
    /// `[I]` the memfd behind it, when host views may map its frames.
    fd: Option<std::os::fd::OwnedFd>,
}

// SAFETY: the arena is plain memory owned by this value; all concurrent access
// to its contents goes through atomics or through exclusively owned frames
// (see the frame protocol in `phys/mod.rs`).
#[allow(unsafe_code)]
unsafe impl Send for Arena {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for Arena {}

impl Arena {
    /// Map `frames` frames; `shared`: over a memfd that host views map
    /// too (shared memory gets no transparent huge pages unless the host's
    /// `shmem_enabled` allows them).
    #[allow(unsafe_code)]
    pub(crate) fn new(frames: u32, prefault: bool, shared: bool) -> Result<Arena> {
        let len = frames as usize * PAGE_SIZE as usize;
        let host_err =
            |call| Error::Host { call, errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(libc::ENOMEM) };
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        if cfg!(miri) {
            // Miri maps private anonymous memory only (and has no madvise).
            flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        }
        let fd = if shared && !cfg!(miri) {
            // SAFETY: a C string literal; the flags are valid.
            let raw = unsafe { libc::memfd_create(c"vmfault-frames".as_ptr(), libc::MFD_CLOEXEC) };
            if raw < 0 {
                return Err(host_err("memfd_create of the frame arena"));
            }
            // SAFETY: `raw` is a new descriptor nobody else owns.
            let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
            // SAFETY: sizing the descriptor just made.
            if unsafe { libc::ftruncate(raw, len as libc::off_t) } != 0 {
                return Err(host_err("ftruncate of the frame arena's memfd"));
            }
            flags = libc::MAP_SHARED | libc::MAP_NORESERVE;
            Some(fd)
        } else {
            None
        };
        let raw_fd = fd.as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
        // SAFETY: a fresh mapping (of anonymous memory, or of the memfd
        // just made); no existing memory is affected.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, raw_fd, 0) };
        if p == libc::MAP_FAILED {
            return Err(host_err("mmap of the frame arena"));
        }
        // SAFETY: `p..p+len` is the mapping just created. Advice is best
        // effort: failure only costs performance (HUGEPAGE) or fork time.
        #[cfg(not(miri))]
        unsafe {
            libc::madvise(p, len, libc::MADV_DONTFORK);
            libc::madvise(p, len, libc::MADV_HUGEPAGE);
        }
        let arena = Arena { base: NonNull::new(p.cast()).expect("mmap returned null"), len, frames, fd };
        if prefault && !cfg!(miri) {
            arena.populate();
        }
        Ok(arena)
    }

    /// Back the whole arena now, after the advice (so in huge pages where
    /// the host has them): `MADV_POPULATE_WRITE` (Linux 5.14), or a store
    /// to every page where the host kernel is older.
    #[allow(unsafe_code)]
    fn populate(&self) {
        // SAFETY: advice on exactly the mapping this value owns.
        let done = unsafe { libc::madvise(self.base.as_ptr().cast(), self.len, libc::MADV_POPULATE_WRITE) } == 0;
        if !done {
            for pfn in 0..self.frames {
                // SAFETY: `frame_ptr` is in bounds; nothing else can use
                // the arena yet (it is being created), and a zero byte is
                // what a fresh anonymous page holds already.
                unsafe { self.frame_ptr(pfn).write_volatile(0) };
            }
        }
    }

    /// Frames in the arena.
    pub(crate) fn frames(&self) -> u32 {
        self.frames
    }

    /// The memfd behind the arena, if host views may map its frames
    /// (frame `pfn` at offset `pfn * PAGE_SIZE`).
    pub(crate) fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.fd.as_ref().map(std::os::fd::AsFd::as_fd)
    }

    /// Address of frame `pfn`'s first byte.
    #[inline]
    #[allow(unsafe_code)]
    pub(crate) fn frame_ptr(&self, pfn: u32) -> *mut u8 {
        // A real check, in every build: this pointer is where safe code's
        // frame numbers become memory (one compare, always predicted).
        assert!(pfn < self.frames, "frame {pfn} out of range (the arena holds {})", self.frames);
        // SAFETY: `pfn < frames` (checked above), so the offset stays
        // inside the mapping.
        unsafe { self.base.as_ptr().add(pfn as usize * PAGE_SIZE as usize) }
    }
}

impl Drop for Arena {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping this value owns; no reference
        // into it can outlive the arena (they borrow `PhysMem`).
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// Bytes of memory the host can still give this process: `MemAvailable`
/// plus free swap (`/proc/meminfo`), capped by the cgroup's limit
/// (`memory.max` less `memory.current`, cgroup v2) if it has one. `None`
/// if neither can be read (then nothing is checked).
pub(crate) fn host_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let field = |name: &str| {
        meminfo.as_deref()?.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok().map(|kb| kb * 1024)
        })
    };
    let system = field("MemAvailable").map(|m| m + field("SwapFree").unwrap_or(0));
    let cgroup = cgroup_room();
    match (system, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What this process's cgroup (v2) still allows, if it has a limit.
fn cgroup_room() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/'));
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).ok();
    let max = read("memory.max")?.trim().parse::<u64>().ok()?;
    let current = read("memory.current").and_then(|c| c.trim().parse::<u64>().ok()).unwrap_or(0);
    Some(max.saturating_sub(current))
}

/// Bytes in a cache line.
const LINE: usize = 64;

/// Whether [`stream_zero`] uses streaming stores here (x86-64, not under
/// miri); elsewhere it writes ordinary ones.
pub(crate) const STREAMS: bool = cfg!(all(target_arch = "x86_64", not(miri)));

/// Zero the frame at `p` with streaming (non-temporal) stores, but for the
/// line holding byte `keep`, which ordinary stores write last so that it
/// stays in the cache; then fence ([`stream_fence`]), so that the
/// streaming stores are ordered before any later store (the ones that
/// publish the frame). Ordinary stores throughout where streaming ones are
/// not available (other architectures than x86-64; miri).
///
/// # Safety
/// As [`stream_zero_unfenced`].
#[inline]
#[allow(unsafe_code)]
pub(crate) unsafe fn stream_zero(p: *mut u8, keep: usize) {
    // SAFETY: the caller's.
    unsafe { stream_zero_unfenced(p, keep) };
    stream_fence();
}

/// [`stream_zero`] without its fence: the streaming stores are not ordered
/// before later stores until a [`stream_fence`] on this thread (the
/// caller's business: nothing may publish the frame, nor hand it to
/// another thread, before one).
///
/// Kept out of line: a profile then tells the zeroing from the fault path
/// around it (one call per 4 KiB).
///
/// # Safety
/// `p` is the first byte of a frame of the arena, and nothing else reads
/// or writes the frame while this runs.
#[inline(never)]
#[allow(unsafe_code)]
pub(crate) unsafe fn stream_zero_unfenced(p: *mut u8, keep: usize) {
    let hot = (keep % PAGE_SIZE as usize) & !(LINE - 1);
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        use std::arch::x86_64::{__m128i, _mm_setzero_si128, _mm_stream_si128};
        // SAFETY: SSE2 is part of x86-64.
        let z = unsafe { _mm_setzero_si128() };
        // The lines before the kept one, then those after it.
        for (from, to) in [(0, hot), (hot + LINE, PAGE_SIZE as usize)] {
            let mut at = from;
            while at < to {
                // SAFETY: `at + 64 <= to <= PAGE_SIZE`: the four 16-byte
                // stores are inside the frame the caller owns alone, and
                // aligned (the frame is page-aligned, `at` a multiple of
                // 64). SSE2 is part of x86-64.
                unsafe {
                    let line = p.add(at);
                    _mm_stream_si128(line.cast::<__m128i>(), z);
                    _mm_stream_si128(line.add(16).cast::<__m128i>(), z);
                    _mm_stream_si128(line.add(32).cast::<__m128i>(), z);
                    _mm_stream_si128(line.add(48).cast::<__m128i>(), z);
                }
                at += LINE;
            }
        }
        // SAFETY: `hot + LINE <= PAGE_SIZE`, inside the caller's frame.
        unsafe { std::ptr::write_bytes(p.add(hot), 0, LINE) };
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    {
        let _ = hot;
        // SAFETY: the frame is PAGE_SIZE bytes the caller owns alone.
        unsafe { std::ptr::write_bytes(p, 0, PAGE_SIZE as usize) };
    }
}

/// Order this thread's streaming stores before its later stores: they are
/// weakly ordered, and without the fence a Release store that publishes a
/// frame could become visible before them. Nothing where streaming stores
/// are not used.
#[inline]
#[allow(unsafe_code)]
pub(crate) fn stream_fence() {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: SSE2 is part of x86-64; a fence has no other effect.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}
