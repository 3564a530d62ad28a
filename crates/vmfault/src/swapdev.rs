//! The swap device: page-sized slots in one host file that vmfault creates,
//! sizes and removes (`VmConfig::swap`, `VmConfig::swap_bytes`).
//!
//! A slot is named in an object's index entry in place of a frame
//! (`object::SWAP`); whoever takes such an entry out of an index (a
//! page-in, `munmap`, an object's end, a collapse that hides it) frees the
//! slot. Allocation is a free stack under a mutex: slots change hands only
//! on the page daemon's pageouts and on page-ins, both slow paths next to
//! the 4 KiB of I/O they do.
//!
//! As Linux's `swapon` does, creation makes sure the file can hold what it
//! promises: its blocks are allocated (`fallocate`: no holes, so no write
//! can fail for lack of space later; `ENOSPC` at `Vm::new` instead), and
//! a file another `Vm` (of this process or another) uses is refused with
//! `EBUSY` (an exclusive `flock` held for the file's life). A file vmfault
//! created is removed at the end, and when `Vm::new` fails after creating
//! it. A slot whose write failed is taken out of use (`Slots::bad`), as
//! a bad block is: the next pageout takes another one, and a failed slot
//! is tried again only when no other is left.
//!
//! Tests inject write errors ([`crate::Vm::fail_swap_writes`]): the page
//! daemon must then leave the page resident (`reclaim`).
//!
//! A leaf module: it knows files and slots, nothing of frames or objects,
//! so the objects that name its slots (`object::swap`) and the daemon
//! that fills them (`reclaim`) both reach it downward.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::types::PAGE_SIZE;

/// The swap file of one `Vm`.
#[derive(Debug)]
pub(crate) struct Swap {
    /// `[I]` the file, opened for reading and writing.
    file: File,
    /// `[I]` where it is (removed at the end).
    path: PathBuf,
    /// `[I]` slots in the file.
    slots: u64,
    /// `[L]` the slots: never used yet start at `next`, freed ones wait in
    /// `free`, those whose write failed in `bad`.
    free: Mutex<Slots>,
    /// `[a]` slots in use.
    used: AtomicU64,
    /// `[a]` writes still to fail (tests).
    fail_writes: AtomicU32,
    /// `[a]` reads still to fail (tests).
    fail_reads: AtomicU32,
    /// `[a]` the path was removed (`unlink`): never remove it again (a new
    /// `Vm` may have made a new file there).
    unlinked: std::sync::atomic::AtomicBool,
}

/// The slot allocator's state (under `Swap::free`).
#[derive(Debug, Default)]
struct Slots {
    /// `[L]` (`Swap::free`) slots from here on were never used.
    next: u64,
    /// `[L]` (`Swap::free`) freed slots, reused most recent first.
    free: Vec<u64>,
    /// `[L]` (`Swap::free`) slots whose write failed: out of use while any other slot is to be
    /// had, tried again (one by one) only when none is, so that a passing
    /// error does not cost the swap for good.
    bad: Vec<u64>,
}

fn host(call: &'static str, e: &std::io::Error) -> Error {
    Error::Host { call, errno: e.raw_os_error().unwrap_or(libc::EIO) }
}

impl Swap {
    /// Create (or take over and truncate) the file at `path`, or a new
    /// file of a unique name if `path` is a directory; lock it for this
    /// `Vm` alone and allocate `bytes` of it.
    pub(crate) fn create(path: &Path, bytes: u64) -> Result<Swap> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let path = if path.is_dir() {
            let n = SERIAL.fetch_add(1, Ordering::Relaxed);
            path.join(format!("vmfault-{}-{n}.swap", std::process::id()))
        } else {
            path.to_path_buf()
        };
        let mut open = std::fs::OpenOptions::new();
        open.read(true).write(true);
        // Created here (then removed on failure), or an existing file.
        let (file, created) = match open.clone().create_new(true).open(&path) {
            Ok(f) => (f, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                (open.open(&path).map_err(|e| host("open of the swap file", &e))?, false)
            }
            Err(e) => return Err(host("open of the swap file", &e)),
        };
        let slots = bytes / PAGE_SIZE;
        let sized = Self::claim(&file, &path, slots * PAGE_SIZE);
        if let Err(e) = sized {
            if created {
                let _ = std::fs::remove_file(&path);
            }
            return Err(e);
        }
        Ok(Swap {
            file,
            path,
            slots,
            free: Mutex::new(Slots::default()),
            used: AtomicU64::new(0),
            fail_writes: AtomicU32::new(0),
            fail_reads: AtomicU32::new(0),
            unlinked: Default::default(),
        })
    }

    /// Make `file` this `Vm`'s alone (`EBUSY` if another holds it), empty
    /// it and allocate `len` bytes of blocks (`ENOSPC` if the filesystem
    /// cannot hold them).
    fn claim(file: &File, path: &Path, len: u64) -> Result<()> {
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(Error::InUse { what: "swap file", path: path.display().to_string() });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(host("flock of the swap file", &e)),
        }
        file.set_len(0).map_err(|e| host("ftruncate of the swap file", &e))?;
        if len > 0 {
            rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len)
                .map_err(|e| Error::Host { call: "fallocate of the swap file", errno: e.raw_os_error() })?;
        }
        Ok(())
    }

    /// A free slot, if any: a freed one, else one never used, else (the
    /// last resort) one whose write failed.
    pub(crate) fn alloc(&self) -> Option<u64> {
        let mut f = crate::sync::rank::lock(&self.free, crate::sync::rank::Rank::Leaf);
        let slot = match f.free.pop() {
            Some(s) => s,
            None if f.next < self.slots => {
                f.next += 1;
                f.next - 1
            }
            None => f.bad.pop()?,
        };
        self.used.fetch_add(1, Ordering::Relaxed);
        Some(slot)
    }

    /// Take `slot`, whose write failed, out of use (see [`Slots::bad`]).
    pub(crate) fn retire_bad(&self, slot: u64) {
        assert!(slot < self.slots, "swap slot {slot} out of range (of {})", self.slots);
        crate::sync::rank::lock(&self.free, crate::sync::rank::Rank::Leaf).bad.push(slot);
        self.used.fetch_sub(1, Ordering::Relaxed);
        tracing::warn!(
            target: "vmfault::reclaim",
            event = "swap_bad_slots",
            slot,
            "swap slot taken out of use after a failed write"
        );
    }

    /// Slots out of use after failed writes (a snapshot).
    pub(crate) fn bad_slots(&self) -> u64 {
        crate::sync::rank::lock(&self.free, crate::sync::rank::Rank::Leaf).bad.len() as u64
    }

    /// Give `slot` back.
    pub(crate) fn free(&self, slot: u64) {
        assert!(slot < self.slots, "swap slot {slot} out of range (of {})", self.slots);
        crate::sync::rank::lock(&self.free, crate::sync::rank::Rank::Leaf).free.push(slot);
        self.used.fetch_sub(1, Ordering::Relaxed);
    }

    /// Slots in use (a snapshot).
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Slots in all.
    pub(crate) fn slots(&self) -> u64 {
        self.slots
    }

    /// Write one page to `slot`.
    pub(crate) fn write(&self, slot: u64, page: &[u8]) -> Result<()> {
        let injected =
            self.fail_writes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok();
        if injected {
            return Err(Error::Host { call: "pwrite of the swap file (injected)", errno: libc::EIO });
        }
        self.file.write_all_at(page, slot * PAGE_SIZE).map_err(|e| host("pwrite of the swap file", &e))
    }

    /// Read one page from `slot`.
    pub(crate) fn read(&self, slot: u64, page: &mut [u8]) -> Result<()> {
        let injected = self.fail_reads.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok();
        if injected {
            return Err(Error::Host { call: "pread of the swap file (injected)", errno: libc::EIO });
        }
        self.file.read_exact_at(page, slot * PAGE_SIZE).map_err(|e| host("pread of the swap file", &e))
    }

    /// Fail the next `n` writes with `EIO`.
    pub(crate) fn fail_writes(&self, n: u32) {
        self.fail_writes.store(n, Ordering::Relaxed);
    }

    /// Fail the next `n` reads with `EIO`.
    pub(crate) fn fail_reads(&self, n: u32) {
        self.fail_reads.store(n, Ordering::Relaxed);
    }
}

impl Swap {
    /// Remove the file's name (once): the `Vm`'s last handle is gone, and
    /// a new `Vm` may create a swap file there. The open file (and its
    /// lock) stays until the swap itself goes.
    pub(crate) fn unlink(&self) {
        if !self.unlinked.swap(true, Ordering::AcqRel) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        self.unlink();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_round_trip_and_run_out() {
        let dir = std::env::temp_dir().join(format!("vmfault-swap-unit-{}", std::process::id()));
        let s = Swap::create(&dir, 2 * PAGE_SIZE).unwrap();
        let (a, b) = (s.alloc().unwrap(), s.alloc().unwrap());
        assert_eq!(s.alloc(), None, "two slots only");
        s.write(b, &[7; PAGE_SIZE as usize]).unwrap();
        let mut page = [0; PAGE_SIZE as usize];
        s.read(b, &mut page).unwrap();
        assert!(page.iter().all(|&x| x == 7));
        s.fail_writes(1);
        assert_eq!(s.write(a, &page).unwrap_err().errno(), libc::EIO);
        s.write(a, &page).unwrap();
        s.free(a);
        assert_eq!((s.used(), s.alloc()), (1, Some(a)));
        drop(s);
        assert!(!dir.exists(), "the file goes with the swap");
    }
}
