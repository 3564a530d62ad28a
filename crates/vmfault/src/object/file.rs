//! File objects: the page cache of one file.
//!
//! `mmap_file` finds the file's object in the machine's registry
//! ([`Files`], keyed by device and inode), so every mapping of a file in a
//! `Vm`, through any handle and from any space, shares one set of pages,
//! as Linux's page cache does. The object keeps its own handle (a `dup`).
//!
//! - *Fill*: a fault that finds no page reads it with `pread` into a new
//!   frame, outside every lock but the map lock (the classic path: the
//!   lockless ones give up on a page that needs I/O, counted in
//!   `spf_vma_notsup`), and inserts it with the usual CAS. Bytes past the
//!   end of the file in the last page read as zeros; a page wholly past
//!   the end is SIGBUS ([`Error::Bus`]), as on Linux.
//! - *Dirty*: a shared mapping maps a file page read-only on a read fault,
//!   so the first store faults and marks the entry `DIRTY` (Linux's write
//!   notification, `vma_wants_writenotify`).
//! - *Write-back* ([`Object::write_back`]): for each dirty page, trade the
//!   bit for `WRITEBACK` (which keeps the page daemon off the page until
//!   the write ends), write-protect every PTE that maps it, wherever it
//!   is (the reverse map: `aspace::rmap`), wait for a grace period so that
//!   no store through an old writable PTE is still in flight, then
//!   `pwrite` it, never past the end of the file. A store after the
//!   write-protection faults and dirties the page again; a failed write
//!   marks it dirty again, so nothing is lost. `msync` and `munmap` write
//!   back their range, the object's end everything.
//! - *One write-back of a page at a time* (Linux's `PG_writeback`): a
//!   writer takes only pages without `WRITEBACK`, and the page daemon's
//!   write of a dirty page it evicts takes the bit too. Two writers of one
//!   page would share one bit: the first to end would clear it while the
//!   second still copied the frame, which the daemon could then evict and
//!   free (a reused frame written into the file). `msync` then waits for
//!   the pages others have under way in its range and writes them again
//!   if they were dirtied meanwhile: when it returns, every store made
//!   before it is in the file.
//!
//! The page cache is vmfault's own: writes to the file through `write(2)`
//! while pages are cached are not seen by the mappings (and are overwritten
//! by a later write-back of a dirty page), unlike Linux's unified cache.
//! Truncation while mapped is not followed either: the size is read when a
//! page is filled and when one is written back.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, Weak};

use super::Cx;
use super::{Entry, Insert, Object, SwapOut};
use crate::error::{Error, Op, Result};
use crate::phys::{Frames, OwnedFrame, Pfn};
use crate::pmap::OutOfFrames;
use crate::stats::Counter;
use crate::sync::rank::{self, Rank};
use crate::types::{PAGE_SHIFT, PAGE_SIZE};

/// What a file object knows of its file.
#[derive(Debug)]
pub(crate) struct FileData {
    /// `[I]` the object's own handle.
    file: File,
    /// `[I]` (device, inode): the registry key.
    key: (u64, u64),
    /// `[L]` the handle write-back writes through, opened by the first shared
    /// mapping of a handle open for writing: a fresh read-write open of
    /// the file (never `O_APPEND`, whose `pwrite` ignores the offset), not
    /// the handle of whoever mapped the file first, which may be read-only.
    writer: Mutex<Option<File>>,
    /// `[L]` write-backs that end clear their pages' `WRITEBACK` bits under this
    /// lock and notify `written`; a data-integrity write-back (`msync`)
    /// waits there for pages another writer has under way (Linux's
    /// `folio_wait_writeback`). A leaf: nothing is taken inside it.
    ended: Mutex<()>,
    /// `[L]` see `ended`.
    written: Condvar,
    /// `[a]` pages the page daemon evicted: the serials of their
    /// tombstones (`object::Entry::gone`).
    evictions: AtomicU64,
}

/// The registry of file objects of a machine.
#[derive(Debug, Default)]
pub(crate) struct Files {
    /// `[L]` objects by (device, inode). An entry whose object is dead belongs to
    /// an object still writing back in its `Drop`: wait for `gone`.
    map: Mutex<HashMap<(u64, u64), Weak<Object>>>,
    /// `[L]` signalled when a dying object has written back and left the map.
    gone: Condvar,
    /// `[L]` the most recently mapped file objects, kept alive after their last
    /// mapping goes (most recent first), so that a file mapped again (a
    /// binary at every exec) finds its pages cached, as Linux's page cache
    /// outlives mappings. Dropped by `Vm::drop_caches` and when a fill finds
    /// no frame. Inner to `map`'s lock, never held while an object drops.
    recent: Mutex<std::collections::VecDeque<Arc<Object>>>,
}

/// File objects kept cached after their last mapping.
const RECENT_FILES: usize = 8;

impl Files {
    /// Keep `o` among the recent ones.
    fn touch(&self, o: &Arc<Object>) {
        let mut recent = rank::lock(&self.recent, Rank::Leaf);
        if recent.front().is_some_and(|f| Arc::ptr_eq(f, o)) {
            return;
        }
        recent.retain(|f| !Arc::ptr_eq(f, o));
        recent.push_front(o.clone());
        let evicted = (recent.len() > RECENT_FILES).then(|| recent.pop_back());
        drop(recent);
        drop(evicted); // may write back and take `map`'s lock
    }

    /// Let go of the cached objects that nothing maps (their dirty pages
    /// are written back as they drop). Returns how many were let go.
    pub(crate) fn drop_cached(&self) -> usize {
        let all = std::mem::take(&mut *rank::lock(&self.recent, Rank::Leaf));
        let n = all.len();
        drop(all);
        n
    }
}

fn host(call: &'static str, e: &std::io::Error) -> Error {
    Error::Host { call, errno: e.raw_os_error().unwrap_or(libc::EIO) }
}

impl Object {
    /// A file object's (device, inode); `None` for anonymous memory.
    pub(crate) fn file_key(&self) -> Option<(u64, u64)> {
        self.file.as_ref().map(|f| f.key)
    }

    /// The object of `file` (the one every mapping of it shares), made on
    /// first use.
    pub(crate) fn for_file(ctx: &Cx<'_>, file: &File) -> Result<Arc<Object>> {
        let m = ctx.env;
        let meta = file.metadata().map_err(|e| host("fstat", &e))?;
        let key = (meta.dev(), meta.ino());
        let mut map = rank::lock(&m.files.map, Rank::Files);
        while let Some(w) = map.get(&key) {
            match w.upgrade() {
                Some(o) => {
                    drop(map);
                    m.files.touch(&o);
                    return Ok(o);
                }
                // Dying: its write-back must land before we read the file.
                None => map = map.wait(&m.files.gone),
            }
        }
        let own = file.try_clone().map_err(|e| host("dup", &e))?;
        let o = Self::with_backing(
            ctx,
            None,
            false,
            Some(FileData {
                file: own,
                key,
                writer: Mutex::new(None),
                ended: Mutex::new(()),
                written: Condvar::new(),
                evictions: AtomicU64::new(0),
            }),
            u64::MAX,
        )
        .map_err(|_| Error::NoMemory { op: Op::Mmap, what: "a file object's page index" })?;
        map.insert(key, Arc::downgrade(&o));
        drop(map);
        m.files.touch(&o);
        Ok(o)
    }

    /// Read page `pindex` of the file into the cache (unless another vCPU
    /// did first). `addr` is the faulting address, for SIGBUS.
    ///
    /// The entry is read before the file and the page inserted only over
    /// that entry: a copy of the page that another vCPU read in, wrote and
    /// the page daemon wrote back and evicted while this read ran leaves
    /// a tombstone there, and this read, which may predate that write-back,
    /// starts again (Linux inserts a locked folio before it reads, so that
    /// no second copy can exist meanwhile).
    ///
    /// Call outside any RCU section (it allocates, and it does I/O).
    pub(crate) fn fill(&self, ctx: &Cx<'_>, op: Op, addr: u64, pindex: u64) -> Result<()> {
        let frames = ctx.frames();
        let nomem = |what| Error::NoMemory { op, what };
        let slot = self
            .reserve(&frames, pindex, &ctx.own.index_hint)
            .map_err(|_: OutOfFrames| nomem("an object's page-index node"))?;
        loop {
            // Acquire: a write-back before the eviction that left this
            // entry is complete in the file before the read below.
            let before = self.entry_in(&slot);
            if before.pfn().is_some() {
                return Ok(());
            }
            let frame = self.read_page(&frames, op, addr, pindex)?;
            match self.insert_over(&frames, slot, frame, Some(before)) {
                Insert::Ours(_) => ctx.count(crate::stats::Counter::file_fills),
                Insert::Changed => continue,
                // A file object's pages never go to swap.
                Insert::Theirs(_) | Insert::Swapped => {}
            }
            return Ok(());
        }
    }

    /// A new frame holding page `pindex` of the file, read now.
    fn read_page<'p>(&self, frames: &Frames<'p>, op: Op, addr: u64, pindex: u64) -> Result<OwnedFrame<'p>> {
        let fd = self.file.as_ref().expect("fill of a file object");
        let nomem = |what| Error::NoMemory { op, what };
        let mut frame = match frames.alloc() {
            Some(f) => f,
            // The cached files hold frames nobody maps: let them go first.
            None if self.env.files.drop_cached() > 0 => frames.alloc().ok_or(nomem("a data page"))?,
            None => return Err(nomem("a data page")),
        };
        let buf = frames.phys().owned_bytes(&mut frame);
        let offset = pindex << PAGE_SHIFT;
        let mut got = 0;
        let res = loop {
            match fd.file.read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break Ok(()),
                Ok(n) => {
                    got += n;
                    if got == buf.len() {
                        break Ok(());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(host("pread", &e)),
            }
        };
        buf[got..].fill(0);
        let res = res.and_then(|()| {
            if got > 0 {
                return Ok(());
            }
            // Nothing there: beyond the end (or exactly at it).
            let size = fd.file.metadata().map_err(|e| host("fstat", &e))?.len();
            if offset >= size { Err(Error::Bus { addr, pgoff: pindex, size }) } else { Ok(()) }
        });
        if let Err(e) = res {
            frames.free_owned(frame);
            return Err(e);
        }
        Ok(frame)
    }

    /// Make sure write-back has a handle to write through; `file` (the
    /// caller's) is open for writing and about to be mapped shared.
    pub(crate) fn ensure_writer(&self, file: &File) -> Result<()> {
        use std::os::fd::AsRawFd;
        let fd = self.file.as_ref().expect("a file object");
        let mut w = rank::lock(&fd.writer, Rank::Leaf);
        if w.is_none() {
            let path = format!("/proc/self/fd/{}", file.as_raw_fd());
            let f = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(|e| host("open", &e))?;
            *w = Some(f);
        }
        Ok(())
    }

    /// A shared mapping may write page `pindex` from now on.
    pub(crate) fn mark_dirty(&self, pindex: u64) {
        if let Some(leaf) = self.index.leaf(&self.env.phys, pindex) {
            Entry::set_dirty(leaf.entry);
        }
    }

    /// Page `pindex` was written through a hold of frame `pfn`, if that is
    /// still the page there (the caller's wiring keeps it from leaving).
    pub(crate) fn mark_dirty_if(&self, pindex: u64, pfn: Pfn) {
        if self.entry(pindex).maps(pfn) {
            self.mark_dirty(pindex);
        }
    }

    /// Take the dirty pages of `start..end` (or only the indexes in
    /// `only`): trade each one's `DIRTY` for `WRITEBACK` (one CAS, so a
    /// page the daemon took meanwhile is skipped) and return them, with
    /// the indexes of the pages another writer has under way (`WRITEBACK`
    /// already set: one write-back of a page at a time, else the first to
    /// end would clear the bit while the second still reads the frame,
    /// which the daemon could then evict and free). [`Object::end_writeback`]
    /// clears the bits taken.
    fn take_dirty(&self, start: u64, end: u64, only: Option<&[u64]>) -> (Vec<(u64, Pfn)>, Vec<u64>) {
        use std::sync::atomic::Ordering::{AcqRel, Relaxed};
        let (mut out, mut busy) = (Vec::new(), Vec::new());
        let mut take = |i: u64, entry: &std::sync::atomic::AtomicU64| {
            let mut e = Entry::load(entry, Relaxed);
            while let Some(pfn) = e.pfn() {
                if e.under_writeback() {
                    busy.push(i);
                    break;
                }
                if !e.is_dirty() {
                    break;
                }
                match entry.compare_exchange_weak(e.bits(), e.taken_for_writeback().bits(), AcqRel, Relaxed) {
                    Ok(_) => {
                        out.push((i, pfn));
                        break;
                    }
                    Err(now) => e = Entry(now),
                }
            }
        };
        match only {
            None => self.index.for_each_present(&self.env.phys, start, end, |i, leaf| take(i, leaf.entry)),
            Some(list) => {
                for &i in list {
                    if let Some(leaf) = self.index.leaf(&self.env.phys, i) {
                        take(i, leaf.entry);
                    }
                }
            }
        }
        (out, busy)
    }

    /// The write-back of `pages` ended (those it failed to write are dirty
    /// again, `copy_out`): clear `WRITEBACK` and wake whoever waits for
    /// them. While it is set the entry keeps its page: only the daemon
    /// takes a file page out, and it leaves this one alone.
    fn end_writeback(&self, pages: &[(u64, Pfn)]) {
        let Some(fd) = &self.file else { return };
        let _g = rank::lock(&fd.ended, Rank::Leaf);
        for &(i, _) in pages {
            if let Some(leaf) = self.index.leaf(&self.env.phys, i) {
                Entry::end_writeback(leaf.entry);
            }
        }
        fd.written.notify_all();
    }

    /// Wait until none of the pages at `indexes` is under write-back.
    fn wait_writeback(&self, fd: &FileData, indexes: &[u64]) {
        let under_way = || {
            indexes.iter().any(|&i| {
                self.index
                    .leaf(&self.env.phys, i)
                    .is_some_and(|l| Entry::load(l.entry, std::sync::atomic::Ordering::Acquire).under_writeback())
            })
        };
        let mut g = rank::lock(&fd.ended, Rank::Leaf);
        while under_way() {
            g = g.wait(&fd.written);
        }
    }

    /// Write the dirty pages of `start..end` (page indexes) back to the
    /// file; `protect` write-protects every PTE that maps a page (the
    /// reverse map) and returns once no store through one can be in flight.
    /// With `integrity` (`msync`, Linux's `WB_SYNC_ALL`), pages another
    /// writer has under way are waited for, and written again if they
    /// were dirtied meanwhile; without (`munmap`, the end of a space),
    /// they are left to that writer and to whoever writes them next.
    /// Returns the pages written. On an I/O error the pages not written
    /// stay dirty.
    pub(crate) fn write_back(
        &self,
        start: u64,
        end: u64,
        integrity: bool,
        mut protect: impl FnMut(&[(u64, Pfn)]),
    ) -> Result<u64> {
        let Some(fd) = &self.file else { return Ok(0) };
        let mut written = 0;
        let mut only: Option<Vec<u64>> = None;
        loop {
            let mut busy = Vec::new();
            written += crate::sync::write_back_ordered(
                || {
                    let (pages, b) = self.take_dirty(start, end, only.as_deref());
                    busy = b;
                    pages
                },
                |pages| {
                    if !pages.is_empty() {
                        protect(pages)
                    }
                },
                |pages| {
                    let r = self.copy_out(fd, pages, integrity);
                    self.end_writeback(pages);
                    r
                },
            )?;
            if !integrity || busy.is_empty() {
                return Ok(written);
            }
            self.wait_writeback(fd, &busy);
            only = Some(busy);
        }
    }

    /// Write `pages` to the file, never past its end; on an error, those
    /// not written are dirty again. The page that straddles the end of the
    /// file is written with its tail zeroed in memory (`zero_tail`: msync,
    /// eviction; Linux's `writepage`), or left dirty and unwritten
    /// (`munmap` and the end of a space, which Linux does not write back
    /// at all: a later msync must still find it dirty, write it and zero
    /// its tail). Returns the pages written.
    fn copy_out(&self, fd: &FileData, pages: &[(u64, Pfn)], zero_tail: bool) -> Result<u64> {
        if pages.is_empty() {
            return Ok(0);
        }
        let size = match fd.file.metadata() {
            Ok(m) => m.len(),
            Err(e) => {
                self.redirty(pages);
                return Err(host("fstat", &e));
            }
        };
        // Runs of consecutive pages go out in one write of up to 1 MiB.
        const RUN: usize = 256;
        let mut buf = Vec::with_capacity(RUN * PAGE_SIZE as usize);
        let mut n = 0;
        let mut written_pages = pages.len() as u64;
        while n < pages.len() {
            let first = pages[n].0;
            let offset = first << PAGE_SHIFT;
            if offset >= size {
                n += 1;
                continue;
            }
            let mut run = pages[n..].iter().take(RUN).enumerate().take_while(|&(k, p)| p.0 == first + k as u64).count();
            // The run's page that straddles the end of the file, if any.
            let k = ((size - offset) >> PAGE_SHIFT) as usize;
            let mut skipped = 0;
            if !zero_tail && k < run && !size.is_multiple_of(PAGE_SIZE) {
                // Left dirty for a later msync (see above); the pages
                // after it lie wholly past the end.
                self.redirty(&pages[n + k..n + k + 1]);
                written_pages -= 1;
                if k == 0 {
                    n += 1;
                    continue;
                }
                run = k;
                skipped = 1;
            }
            buf.clear();
            for &(_, pfn) in &pages[n..n + run] {
                let at = buf.len();
                buf.resize(at + PAGE_SIZE as usize, 0);
                self.env.phys.read_bytes(pfn, 0, &mut buf[at..]);
            }
            let len = (size - offset).min(buf.len() as u64) as usize;
            if len < buf.len() && !len.is_multiple_of(PAGE_SIZE as usize) {
                // The page that straddles the end of the file: its bytes
                // past the end are zeroed in memory too, as Linux's
                // `writepage` does on every write of such a page ("it may
                // be mmapped"): stores there never reach the file, and a
                // load after an msync reads zeros.
                let (k, at) = (len / PAGE_SIZE as usize, len % PAGE_SIZE as usize);
                let zeros = vec![0u8; PAGE_SIZE as usize - at];
                self.env.phys.write_bytes(pages[n + k].1, at, &zeros);
            }
            let written = match &*rank::lock(&fd.writer, Rank::Leaf) {
                Some(w) => w.write_all_at(&buf[..len], offset),
                None => Err(std::io::Error::from_raw_os_error(libc::EBADF)),
            };
            if let Err(e) = written {
                self.redirty(&pages[n..]);
                return Err(host("pwrite", &e));
            }
            n += run + skipped;
        }
        Ok(written_pages)
    }

    /// The page daemon's half of reclaiming file page `pfn` at `pindex`
    /// (`reclaim::pageout`): the caller has isolated it (unmapped,
    /// `BLOCKED`, after a grace period), so no store can reach it. Write it
    /// back if it is dirty, then take it out of the index by a CAS from the
    /// value it had: the next fault reads it from the file again. `Busy`
    /// while `msync` writes it back (`WRITEBACK`); `Lost` if the entry
    /// changed meanwhile (`msync` took the dirty bit) or the write failed
    /// (the page stays dirty).
    pub(crate) fn evict_file_page(&self, pindex: u64, pfn: Pfn) -> SwapOut {
        use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
        let Some(fd) = &self.file else { return SwapOut::Lost };
        let Some(leaf) = self.index.leaf(&self.env.phys, pindex) else { return SwapOut::Lost };
        let mut e = Entry::load(leaf.entry, Acquire);
        if !e.maps(pfn) {
            return SwapOut::Lost;
        }
        if e.under_writeback() {
            // Another writer (`msync`) is writing it: its copy reads this frame.
            return SwapOut::Busy;
        }
        if e.is_dirty() {
            // One write-back at a time, as any other writer: an `msync`
            // meanwhile waits for this one instead of skipping the page.
            let taken = e.taken_for_writeback();
            if leaf.entry.compare_exchange(e.bits(), taken.bits(), AcqRel, Relaxed).is_err() {
                return SwapOut::Lost;
            }
            if let Err(err) = self.copy_out(fd, &[(pindex, pfn)], true) {
                self.env.phys.shared_counters().add(Counter::file_write_errors, 1);
                tracing::warn!(
                    target: "vmfault::reclaim",
                    event = Counter::file_write_errors.name(),
                    error = %err,
                    offset = %format_args!("{:#x}", pindex * PAGE_SIZE),
                    "write-back of a file page failed: it stays"
                );
                self.end_writeback(&[(pindex, pfn)]);
                return SwapOut::Lost;
            }
            self.env.daemon.file_writebacks.fetch_add(1, Relaxed);
            e = taken;
        }
        // Isolated: no fault can dirty it again, so the entry is still `e`
        // unless a collapse or an `msync` took it.
        // A tombstone, not an empty entry: a fill that read the file before
        // the write-back above cannot insert its stale copy (`fill`).
        let gone = Entry::gone(fd.evictions.fetch_add(1, Relaxed) + 1);
        let done = leaf.entry.compare_exchange(e.bits(), gone.bits(), AcqRel, Relaxed).is_ok();
        if e.under_writeback() {
            // Wakes an `msync` waiting for this page (its entry is gone,
            // or `WRITEBACK` cleared if it stayed).
            self.end_writeback(&[(pindex, pfn)]);
        }
        if done { SwapOut::Done } else { SwapOut::Lost }
    }

    fn redirty(&self, pages: &[(u64, Pfn)]) {
        for &(i, _) in pages {
            self.mark_dirty(i);
        }
    }

    /// The end of a file object: write back what is dirty (nothing maps
    /// it any more), leave the registry, wake whoever waits to map the file
    /// again. An I/O error here has nobody to report to: it is logged.
    pub(super) fn drop_file(&mut self) {
        if let Err(e) = self.write_back(0, u64::MAX, true, |_| {}) {
            tracing::error!(target: "vmfault::file", error = %e, "write-back of a file object lost data at its end");
        }
        let key = self.file.as_ref().expect("a file object").key;
        let files = &self.env.files;
        let mut map = rank::lock(&files.map, Rank::Files);
        if map.get(&key).is_some_and(|w| w.strong_count() == 0) {
            map.remove(&key);
        }
        drop(map);
        files.gone.notify_all();
    }
}
