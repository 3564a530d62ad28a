//! The per-thread loops of the workloads, generic over the [`Target`].
//!
//! Each loop checks the stop flag before every op and counts only ops that
//! completed before the flag was seen; cleanup after the flag (the last
//! unmap) is not counted.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::target::{Image, OpError, Target};
use crate::workload::{Sizes, Workload};

const PAGE: u64 = 4096;

#[inline]
fn stopped(stop: &AtomicBool) -> bool {
    stop.load(Ordering::Relaxed)
}

/// Per-thread state made before the round starts (not timed).
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// The zero-fill buffer, touched once so the host has backed it.
    buf: Vec<u8>,
    /// page_fault2/3's file (one per thread, as will-it-scale's), or
    /// exec1's binary (one for all threads: a shared dynamic binary).
    file: Option<Arc<TempFile>>,
    /// The thread's number in its round (0, 1, ...).
    thread: usize,
}

/// A file in the temporary directory, removed when dropped.
#[derive(Debug)]
pub(crate) struct TempFile {
    path: PathBuf,
    file: File,
}

impl TempFile {
    /// A new file of `len` bytes: sparse (reads as zeros), or filled with a
    /// pattern when `fill`.
    fn new(tag: &str, len: u64, fill: bool) -> Result<TempFile, OpError> {
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let n = SERIAL.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("vmfault-bench-{tag}-{}-{n}", std::process::id()));
        let err = |e: std::io::Error| format!("temporary file {}: {e}", path.display());
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(err)?;
        if fill {
            let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            std::io::Write::write_all(&mut &file, &bytes).map_err(err)?;
        } else {
            file.set_len(len).map_err(err)?;
        }
        Ok(TempFile { path, file })
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// mlock1's range: 64 KiB, as in the seed.
const MLOCK1_LEN: u64 = 64 << 10;

/// exec1's binary and what one exec touches.
pub const EXEC1_IMAGE: Image = Image { text: 1 << 20, text_touch: 64, data: 64 << 10, stack: 64 << 10 };

/// exec1's binary, shared by the threads of a round.
fn exec1_binary() -> Result<Arc<TempFile>, OpError> {
    static SHARED: Mutex<Weak<TempFile>> = Mutex::new(Weak::new());
    let mut g = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(f) = g.upgrade() {
        return Ok(f);
    }
    let f = Arc::new(TempFile::new("exec1", EXEC1_IMAGE.text + EXEC1_IMAGE.data, true)?);
    *g = Arc::downgrade(&f);
    Ok(f)
}

/// Make `w`'s per-thread state.
pub(crate) fn prepare(w: Workload, sizes: &Sizes, thread: usize) -> Result<Scratch, OpError> {
    let scratch = match w {
        Workload::ZeroFill => Scratch { buf: vec![1u8; sizes.region as usize], ..Scratch::default() },
        Workload::PageFault2 | Workload::PageFault3 => {
            Scratch { file: Some(Arc::new(TempFile::new(w.name(), sizes.region, false)?)), ..Scratch::default() }
        }
        Workload::Exec1 => Scratch { file: Some(exec1_binary()?), ..Scratch::default() },
        _ => Scratch::default(),
    };
    Ok(Scratch { thread, ..scratch })
}

/// Where thread `thread` of vmlocal and brk1 puts its own range: its own
/// 512 GiB below 112 TiB (RadixVM's benchmarks give each core its own
/// region the same way). A hint, honoured by the host kernel and by
/// vmfault alike; with `map_lock=zoned` it is also the thread's own zone.
fn own_region(thread: usize) -> u64 {
    (112 << 40) - ((thread % 192) as u64) * (512 << 30)
}

/// What a thread's loop did: ops, and workload-specific totals.
#[derive(Debug, Default)]
pub(crate) struct Done {
    /// Ops completed before the stop flag.
    pub(crate) ops: u64,
    /// Extra totals (name, value), summed over threads into the round's counters.
    pub(crate) extra: Vec<(&'static str, u64)>,
}

impl Done {
    /// This and `more`, done after it: ops and extras added up.
    pub(crate) fn and(mut self, more: Done) -> Done {
        self.ops += more.ops;
        for (k, v) in more.extra {
            match self.extra.iter_mut().find(|(name, _)| *name == k) {
                Some((_, total)) => *total += v,
                None => self.extra.push((k, v)),
            }
        }
        self
    }
}

impl From<u64> for Done {
    fn from(ops: u64) -> Done {
        Done { ops, extra: Vec::new() }
    }
}

/// Run `w` on one thread until `stop`; returns the ops done.
pub(crate) fn run<T: Target>(
    w: Workload,
    t: &T,
    sizes: &Sizes,
    scratch: &mut Scratch,
    stop: &AtomicBool,
) -> Result<Done, OpError> {
    let file = scratch.file.clone();
    let file = || file.as_deref().map(|f| &f.file).ok_or_else(|| format!("{}: no file prepared", w.name()));
    let ops = match w {
        Workload::PageFault1 => fault_regions(t, sizes.region, stop, || t.map(sizes.region)),
        Workload::PageFault2 => fault_regions(t, sizes.region, stop, || t.map_file(file()?, sizes.region, false)),
        Workload::PageFault3 => fault_regions(t, sizes.region, stop, || t.map_file(file()?, sizes.region, true)),
        Workload::Ebizzy => ebizzy(t, sizes.ebizzy_chunk, stop),
        Workload::Malloc1 => malloc1(t, sizes.region, stop),
        Workload::Mmap1 => mmap1(t, sizes.region, stop),
        Workload::Brk1 => brk1(t, own_region(scratch.thread), stop),
        Workload::Vmlocal => vmlocal(t, own_region(scratch.thread), stop),
        Workload::Fork1 => fork1(t, FORK1_REGION, stop),
        Workload::Exec1 => exec1(t, file()?, stop),
        Workload::Shared64 => return shared64(t, sizes.shared_region, stop),
        Workload::ZeroFill => zero_fill(&mut scratch.buf, stop),
        Workload::Mlock1 => t.mlock_loop(MLOCK1_LEN, false, stop),
        Workload::Mlock1Shared => t.mlock_loop(MLOCK1_LEN, true, stop),
        Workload::Pft => Err(format!("{} has no free-running loop", w.name())),
    };
    ops.map(Done::from)
}

/// page_fault1 (and 2 and 3, over a file): map, write one byte per page,
/// unmap; op = fault.
fn fault_regions<T: Target>(
    t: &T,
    len: u64,
    stop: &AtomicBool,
    map: impl Fn() -> Result<u64, OpError>,
) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        let a = map()?;
        for p in 0..len / PAGE {
            if stopped(stop) {
                break;
            }
            t.store(a + p * PAGE)?;
            ops += 1;
        }
        t.unmap(a, len)?;
    }
    Ok(ops)
}

/// ebizzy -mT: one record = map a chunk, write one byte per page, unmap.
fn ebizzy<T: Target>(t: &T, chunk: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut records = 0;
    while !stopped(stop) {
        let a = t.map(chunk)?;
        for p in 0..chunk / PAGE {
            t.store(a + p * PAGE)?;
        }
        t.unmap(a, chunk)?;
        records += 1;
    }
    Ok(records)
}

/// malloc1: a 128 MiB malloc is an mmap; glibc writes the chunk header
/// (one fault); free is a munmap.
fn malloc1<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        let a = t.map(len)?;
        t.store(a)?;
        t.unmap(a, len)?;
        ops += 1;
    }
    Ok(ops)
}

/// mmap1: map and unmap, untouched.
fn mmap1<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        let a = t.map(len)?;
        t.unmap(a, len)?;
        ops += 1;
    }
    Ok(ops)
}

/// brk1-like: a one-page "heap" (the thread's own, at `hint`) grows by a
/// page (a fixed mapping that merges with it, as brk expands the heap VMA)
/// and shrinks back.
fn brk1<T: Target>(t: &T, hint: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let heap = t.map_near(hint, 2 * PAGE, true)?;
    t.unmap(heap + PAGE, PAGE)?;
    let mut ops = 0;
    while !stopped(stop) {
        t.map_fixed(heap + PAGE, PAGE)?;
        t.unmap(heap + PAGE, PAGE)?;
        ops += 2;
    }
    t.unmap(heap, PAGE)?;
    Ok(ops)
}

/// vmlocal (RadixVM's "local"): the thread's own page, between two
/// `PROT_NONE` guard pages of its reservation at `hint` (nothing merges
/// with it, and no other mapping lands there), mapped, written and unmapped.
fn vmlocal<T: Target>(t: &T, hint: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let r = t.map_near(hint, 3 * PAGE, false)?;
    let page = r + PAGE;
    let mut ops = 0;
    while !stopped(stop) {
        t.map_fixed(page, PAGE)?;
        t.store(page)?;
        t.unmap(page, PAGE)?;
        ops += 1;
    }
    t.unmap(r, 3 * PAGE)?;
    Ok(ops)
}

/// What each fork1 thread maps, touches and has its children copy.
pub const FORK1_REGION: u64 = 1 << 20;

/// fork1: a touched private region; each op forks, the child writes every
/// page of it (copy-on-write faults) and exits.
fn fork1<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let a = t.map(len)?;
    for p in 0..len / PAGE {
        t.store(a + p * PAGE)?;
    }
    let mut ops = 0;
    while !stopped(stop) {
        t.fork_touch(a, len)?;
        ops += 1;
    }
    t.unmap(a, len)?;
    Ok(ops)
}

/// exec1: one exec-like cycle per op.
fn exec1<T: Target>(t: &T, binary: &File, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        t.exec(binary, &EXEC1_IMAGE)?;
        ops += 1;
    }
    Ok(ops)
}

/// Spaces in a shared64 cycle.
pub const SHARED64_SPACES: usize = 64;

/// shared64: one cycle per op; the totals of its measurements go to the
/// round's counters (`shared64_*`), the reverse-map figures as the peak.
fn shared64<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<Done, OpError> {
    let mut d = Done::default();
    let (mut forks, mut fork_ns, mut unmap_ns, mut peak) = (0, 0, 0, (0, 0, 0));
    while !stopped(stop) {
        let c = t.share_cycle(len, SHARED64_SPACES)?;
        (forks, fork_ns, unmap_ns) = (forks + c.forks, fork_ns + c.fork_ns, unmap_ns + c.unmap_ns);
        peak = peak.max((c.rmap_bytes, c.pv_entries, c.backing_records));
        d.ops += 1;
    }
    d.extra = vec![
        ("shared64_forks", forks),
        ("shared64_fork_ns", fork_ns),
        ("shared64_unmap_ns", unmap_ns),
        ("shared64_rmap_bytes", peak.0),
        ("shared64_pv_entries", peak.1),
        ("shared64_backing_records", peak.2),
    ];
    Ok(d)
}

/// The zero-fill limit: zero 4 KiB pages of a buffer as big as one
/// page_fault1 mapping, over and over.
fn zero_fill(buf: &mut [u8], stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        for page in buf.chunks_mut(PAGE as usize) {
            if stopped(stop) {
                break;
            }
            page.fill(0);
            std::hint::black_box(&page);
            ops += 1;
        }
    }
    Ok(ops)
}
