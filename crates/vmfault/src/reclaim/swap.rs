//! The swap file: page-sized slots in one host file that vmfault creates,
//! sizes and removes (`VmConfig::swap`, `VmConfig::swap_bytes`).
//!
//! A slot is named in an object's index entry in place of a frame
//! (`object::SWAP`); whoever takes such an entry out of an index (a
//! page-in, `munmap`, an object's end, a collapse that hides it) frees the
//! slot. Allocation is a free stack under a mutex: slots change hands only
//! on the page daemon's pageouts and on page-ins, both slow paths next to
//! the 4 KiB of I/O they do.
//!
//! Tests inject write errors ([`crate::Vm::fail_swap_writes`]): the page
//! daemon must then leave the page resident (`reclaim`).

#![deny(unsafe_code)]

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
    /// Slots never used yet start at `.0`; freed ones wait in `.1`.
    free: Mutex<(u64, Vec<u64>)>,
    /// `[a]` slots in use.
    used: AtomicU64,
    /// `[a]` writes still to fail (tests).
    fail_writes: AtomicU32,
}

fn host(call: &'static str, e: &std::io::Error) -> Error {
    Error::Host { call, errno: e.raw_os_error().unwrap_or(libc::EIO) }
}

impl Swap {
    /// Create (or truncate) the file at `path`, or a new file of a unique
    /// name if `path` is a directory, and size it to `bytes`.
    pub(crate) fn create(path: &Path, bytes: u64) -> Result<Swap> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let path = if path.is_dir() {
            let n = SERIAL.fetch_add(1, Ordering::Relaxed);
            path.join(format!("vmfault-{}-{n}.swap", std::process::id()))
        } else {
            path.to_path_buf()
        };
        let path = path.as_path();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| host("open of the swap file", &e))?;
        let slots = bytes / PAGE_SIZE;
        file.set_len(slots * PAGE_SIZE).map_err(|e| host("ftruncate of the swap file", &e))?;
        Ok(Swap {
            file,
            path: path.to_path_buf(),
            slots,
            free: Mutex::new((0, Vec::new())),
            used: AtomicU64::new(0),
            fail_writes: AtomicU32::new(0),
        })
    }

    /// A free slot, if any.
    pub(crate) fn alloc(&self) -> Option<u64> {
        let mut f = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let slot = match f.1.pop() {
            Some(s) => s,
            None if f.0 < self.slots => {
                f.0 += 1;
                f.0 - 1
            }
            None => return None,
        };
        self.used.fetch_add(1, Ordering::Relaxed);
        Some(slot)
    }

    /// Give `slot` back.
    pub(crate) fn free(&self, slot: u64) {
        debug_assert!(slot < self.slots, "slot {slot} out of range");
        self.free.lock().unwrap_or_else(|p| p.into_inner()).1.push(slot);
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
        self.file.read_exact_at(page, slot * PAGE_SIZE).map_err(|e| host("pread of the swap file", &e))
    }

    /// Fail the next `n` writes with `EIO`.
    pub(crate) fn fail_writes(&self, n: u32) {
        self.fail_writes.store(n, Ordering::Relaxed);
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
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
