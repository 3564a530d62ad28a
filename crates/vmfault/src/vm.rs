//! [`Vm`]: one machine. Owns physical memory, the vCPU slots, the RCU and
//! the statistics; address spaces are created from it. Many `Vm`s can live
//! in one process: there are no globals.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::aspace::AddressSpace;
use crate::config::VmConfig;
use crate::error::{Error, Result};
use crate::phys::{Frames, Kind, PhysMem};
use crate::stats::{Counter, CounterSet, CpuCounters, CpuStats, Stats};
use crate::sync::cpu::{Attachment, CpuSet};
use crate::sync::rcu::{Rcu, RcuPin, RcuReadGuard, RcuReader};
use crate::types::PAGE_SIZE;

/// The shared part of a vCPU slot.
#[derive(Debug)]
pub(crate) struct PerCpu {
    /// `[o]` event counters, written by the slot's owner only.
    pub(crate) counters: CounterSet,
}

/// The owner-only part of a vCPU slot.
#[derive(Debug)]
pub(crate) struct PerCpuOwned {
    /// `[o]` this slot's RCU reader.
    pub(crate) rcu: RcuReader,
    /// `[o]` next object serial number handed out by this vCPU.
    next_object: Cell<u64>,
    /// `[o]` this vCPU's last reserve in an object index.
    pub(crate) index_hint: crate::object::IndexHint,
}

/// Everything a `Vm` owns, shared by its handles, spaces and objects.
#[derive(Debug)]
pub(crate) struct Machine {
    /// `[I]` the configuration it was built with.
    pub(crate) config: VmConfig,
    /// `[S]` physical memory (fields carry their own tags).
    pub(crate) phys: PhysMem,
    /// `[S]` the page daemon's statistics (fields carry their tags).
    pub(crate) daemon: crate::stats::DaemonStats,
    /// `[I]` the RCU; reader `i` belongs to vCPU slot `i`.
    pub(crate) rcu: Rcu,
    /// `[S]` the vCPU slots.
    pub(crate) cpus: CpuSet<PerCpu, PerCpuOwned>,
    /// `[S]` the file objects, by device and inode (its own lock inside).
    pub(crate) files: crate::object::Files,
    /// Reverse-map totals of the backing records (`[a]`).
    pub(crate) rmap: crate::object::RmapTotals,
    /// `[S]` the pv lists (`rmap=pv`; empty otherwise), one lock per frame.
    pub(crate) pv: crate::object::PvTable,
    /// `[L]` the live address spaces by id, for pv entries and statistics
    /// (a lock taken when a space is made or dropped, and by readers of both).
    pub(crate) spaces: std::sync::Mutex<std::collections::HashMap<u64, std::sync::Weak<crate::aspace::Space>>>,
    /// `[L]` pages whose last reference was a wiring dropped under a PTE lock
    /// (they had left their object while wired): unmapped, waiting for an
    /// operation's grace period to be freed (a lock of its own, innermost).
    pub(crate) orphans: std::sync::Mutex<Vec<crate::phys::Pfn>>,
    /// `[a]` whether `orphans` may hold any (written under its lock): every
    /// change's `finish` looks, and the lock is shared by all vCPUs.
    pub(crate) orphaned: std::sync::atomic::AtomicBool,
    /// `[S]` the swap file (`VmConfig::swap`; its own lock inside).
    pub(crate) swap: Option<crate::reclaim::Swap>,
    /// `[S]` the anonymous objects, registered only with swap (locks inside).
    pub(crate) reclaimable: crate::object::Reclaimable,
    /// `[a]` set when the user's last handle goes (`Life`): the machine's
    /// threads end.
    pub(crate) stop: std::sync::atomic::AtomicBool,
}

impl Machine {
    /// Queue an unmapped page that nothing references for freeing.
    pub(crate) fn orphan(&self, pfn: crate::phys::Pfn) {
        let mut orphans = crate::sync::rank::lock(&self.orphans, crate::sync::rank::Rank::Leaf);
        orphans.push(pfn);
        self.orphaned.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Take the queued orphans (the caller frees them after a grace period).
    pub(crate) fn take_orphans(&self) -> Vec<crate::phys::Pfn> {
        // A queue filled by another vCPU is seen at a later look (each
        // orphan is also taken by its own vCPU's next change).
        if !self.orphaned.load(std::sync::atomic::Ordering::Relaxed) {
            return Vec::new();
        }
        let mut orphans = crate::sync::rank::lock(&self.orphans, crate::sync::rank::Rank::Leaf);
        self.orphaned.store(false, std::sync::atomic::Ordering::Relaxed);
        std::mem::take(&mut *orphans)
    }
}

impl std::fmt::Debug for CpuSet<PerCpu, PerCpuOwned> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuSet").field("cpus", &self.cpus()).finish_non_exhaustive()
    }
}

/// The vCPU context of one operation: which slot the calling thread holds,
/// and that slot's per-CPU data. Passed by reference through every layer.
pub(crate) struct Ctx<'a> {
    /// The machine.
    pub(crate) m: &'a Machine,
    /// The claimed slot's shared part.
    pub(crate) cpu: &'a PerCpu,
    /// The claimed slot's owner-only part.
    pub(crate) own: &'a PerCpuOwned,
    /// The slot index.
    pub(crate) index: usize,
    /// PTEs of shared mappings this operation cleared: their pages live on,
    /// so even with `free_path=deferred` the operation waits for a grace
    /// period before it returns (`Space::finish`).
    shared_zaps: Cell<u64>,
}

impl Ctx<'_> {
    /// Note `n` cleared PTEs of a shared mapping.
    pub(crate) fn shared_zapped(&self, n: u64) {
        self.shared_zaps.set(self.shared_zaps.get() + n);
    }

    /// Take the count of [`shared_zapped`](Ctx::shared_zapped).
    pub(crate) fn take_shared_zaps(&self) -> u64 {
        self.shared_zaps.replace(0)
    }

    /// Count one event on this vCPU.
    #[inline]
    pub(crate) fn count(&self, c: Counter) {
        self.cpu.counters.inc(c);
    }

    /// Count `n` events on this vCPU.
    #[inline]
    pub(crate) fn count_n(&self, c: Counter, n: u64) {
        self.cpu.counters.add(c, n);
    }

    /// This vCPU's view of the frame allocator (its page cache first).
    #[inline]
    pub(crate) fn frames(&self) -> Frames<'_> {
        Frames::new(&self.m.phys, &self.m.rcu, &self.own.rcu, &self.cpu.counters)
    }

    /// Enter an RCU read-side section as this vCPU.
    #[inline]
    pub(crate) fn rcu_read(&self) -> RcuReadGuard<'_> {
        self.m.rcu.read_lock(&self.own.rcu)
    }

    /// Enter an RCU read-side section as this vCPU, pinning the page of
    /// `addr` (`Rcu::pin`: the per-VMA read lock).
    #[inline]
    pub(crate) fn rcu_pin(&self, addr: u64) -> RcuPin<'_> {
        self.m.rcu.pin(&self.own.rcu, addr)
    }

    /// A new object id, unique in this `Vm`, without a shared counter:
    /// the slot index in the top bits, a per-slot serial below.
    pub(crate) fn new_object_id(&self) -> u64 {
        let n = self.own.next_object.get();
        self.own.next_object.set(n + 1);
        ((self.index as u64 + 1) << 48) | n
    }
}

/// A virtual machine: physical memory, vCPUs and address spaces.
///
/// `Vm` is a cheap handle (`Clone + Send + Sync`); all clones are the same machine.
///
/// ```
/// use vmfault::{Vm, VmConfig, Prot, MapFlags};
/// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 2, ..VmConfig::default() })?;
/// let _cpu = vm.attach()?; // this thread is now vCPU 0
/// let space = vm.new_space()?;
/// let a = space.mmap(0, 8192, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
/// space.write(a + 4090, b"spans two pages")?;
/// assert_eq!(vm.stats().zero_fill, 2);
/// # Ok::<(), vmfault::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Vm {
    /// `[I]` the machine.
    pub(crate) m: Arc<Machine>,
    /// `[I]` dropped with the last handle (address spaces hold one): lets go of
    /// the cached file objects, which hold the machine themselves.
    _life: Arc<Life>,
}

/// The machine as the address spaces hold it: unlike a [`Vm`], it does
/// not keep the user's handle alive, so the page daemon, which holds
/// spaces for a moment, never delays the end of a `Vm` (the user-facing
/// [`AddressSpace`] carries a `Vm`).
#[derive(Debug, Clone)]
pub(crate) struct Handle {
    /// `[I]` the machine.
    pub(crate) m: Arc<Machine>,
}

impl Handle {
    /// Run `f` with this thread's vCPU context for one operation.
    pub(crate) fn with_ctx<R>(&self, f: impl FnOnce(&Ctx<'_>) -> R) -> R {
        with_ctx(&self.m, f)
    }
}

/// Run `f` with this thread's vCPU context on `m` for one operation.
fn with_ctx<R>(m: &Machine, f: impl FnOnce(&Ctx<'_>) -> R) -> R {
    let mut claim = m.cpus.claim();
    let index = claim.index();
    let (cpu, own) = claim.parts();
    let ctx = Ctx { m, cpu, own: &*own, index, shared_zaps: Cell::new(0) };
    let r = f(&ctx);
    // The grace periods this operation waited for on the caller's path.
    let waits = crate::sync::rcu::take_thread_waits();
    if waits > 0 {
        ctx.count_n(Counter::caller_grace_waits, waits);
    }
    r
}

/// See [`Vm::_life`]: the end of the user's last handle. The machine's
/// own threads (page daemon, drain thread) are stopped and joined here,
/// so none of them outlives the `Vm` by a second, and the swap file's
/// path is freed at once (a new `Vm` may take it: `Swap::unlink`).
#[derive(Debug)]
struct Life {
    /// `[I]` the machine.
    m: Arc<Machine>,
    /// `[L]` the machine's threads, joined at its end.
    threads: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl Drop for Life {
    fn drop(&mut self) {
        self.m.stop.store(true, std::sync::atomic::Ordering::Release);
        self.m.phys.doorbell.stop();
        let me = std::thread::current().id();
        let threads = std::mem::take(&mut *crate::sync::rank::lock(&self.threads, crate::sync::rank::Rank::Leaf));
        for t in threads {
            t.thread().unpark();
            // A thread of the machine never drops the last handle itself
            // (the daemon's references go to the reaper); never wait for
            // oneself all the same.
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
        // Retired snapshots still queued to drop (they hold objects, which
        // hold the machine: a cycle else).
        if let Some(d) = &self.m.phys.deferred {
            d.drop_aged(&self.m.rcu, true);
        }
        self.m.files.drop_cached();
        if let Some(swap) = &self.m.swap {
            swap.unlink();
        }
    }
}

/// A thread's attachment to a vCPU slot of a [`Vm`]; detaches when dropped.
///
/// Not `Send`: the slot belongs to the thread that attached.
#[derive(Debug)]
#[must_use = "the thread detaches when the guard is dropped"]
pub struct CpuGuard {
    vm: Vm,
    attachment: Option<Attachment>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Attachment(cpu {})", self.index())
    }
}

impl Vm {
    /// Build a machine: map the frame arena, set up the vCPU slots.
    pub fn new(config: VmConfig) -> Result<Vm> {
        config.validate()?;
        let frames = (config.phys_bytes / PAGE_SIZE) as u32;
        host_can_give(&config, frames)?;
        // One reader per slot (the shared one included), one for the daemon.
        let (rcu, readers) = Rcu::new(config.cpus + 2);
        let mut phys = PhysMem::new(
            frames,
            config.prefault,
            &rcu,
            config.pcp(),
            config.refcount == crate::config::Refcount::PageLock,
            config.swap.is_some(),
        )?;
        if config.free_target > 0 {
            phys.set_free_target(config.free_target);
        }
        phys.set_ordered(config.frame_order == crate::config::FrameOrder::Ordered);
        phys.set_reuse_zeroed(config.reuse_zeroed);
        phys.set_zero_ahead(config.zero_ahead);
        phys.set_stream_after(match config.zero_stores {
            crate::config::ZeroStores::Cached => None,
            crate::config::ZeroStores::Streaming => Some(0),
            crate::config::ZeroStores::Auto => Some(crate::config::STREAM_AFTER_FRAMES),
        });
        if config.free_path == crate::config::FreePath::Deferred {
            // One list per RCU reader (the vCPU slots, the slot of threads
            // not attached, the daemon's), then the unowned one.
            phys.set_deferred(config.cpus + 2);
        }
        let mut readers = readers.into_iter();
        let cpus = CpuSet::new(config.cpus, |_| {
            let reader = readers.next().expect("one reader per slot");
            (
                PerCpu { counters: CounterSet::new() },
                PerCpuOwned { rcu: reader, next_object: Cell::new(1), index_hint: Default::default() },
            )
        });
        let daemon_reader = readers.next().expect("the page daemon's reader");
        let swap = match &config.swap {
            Some(path) => Some(crate::reclaim::Swap::create(path, config.swap_bytes())?),
            None => None,
        };
        let pv = match config.rmap {
            crate::config::Rmap::PvEntry => crate::object::PvTable::new(frames)?,
            crate::config::Rmap::Backing => crate::object::PvTable::default(),
        };
        let m = Arc::new(Machine {
            config,
            phys,
            daemon: Default::default(),
            rcu,
            cpus,
            files: Default::default(),
            rmap: Default::default(),
            pv,
            spaces: Default::default(),
            orphans: Default::default(),
            orphaned: Default::default(),
            reclaimable: crate::object::Reclaimable::new(swap.is_some()),
            swap,
            stop: Default::default(),
        });
        let life = Life { m: m.clone(), threads: Default::default() };
        let mut threads = Vec::new();
        if m.config.pcpu_drain_hz > 0 {
            threads.push(spawn_drainer(&m)?);
        }
        if m.phys.deferred.is_some() {
            threads.push(spawn_grace_thread(&m)?);
        }
        if m.config.page_daemon && (m.config.pcpu_pages > 0 || m.swap.is_some()) {
            threads.push(crate::reclaim::spawn_daemon(&m, daemon_reader)?);
        }
        *crate::sync::rank::lock(&life.threads, crate::sync::rank::Rank::Leaf) = threads;
        Ok(Vm { _life: Arc::new(life), m })
    }

    /// Drain every vCPU's page cache into the global free list, without the
    /// vCPUs' cooperation (they may be idle, blocked or busy): swap in an
    /// empty cache, wait for a grace period, drain the old one. Returns the
    /// frames drained.
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let a = space.mmap(0, 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// space.write(a, b"x")?; // the fault filled this vCPU's cache from the global list
    /// assert!(vm.stats().pcp_pages > 0);
    /// vm.drain_pcpu_caches();
    /// assert_eq!(vm.stats().pcp_pages, 0);
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn drain_pcpu_caches(&self) -> u64 {
        self.m.phys.drain_pcpu(&self.m.rcu) as u64
    }

    /// Let go of the page cache of files that no mapping maps any more
    /// (vmfault keeps the last few files mapped cached, as a kernel keeps
    /// its page cache; `echo 1 > /proc/sys/vm/drop_caches`). Dirty pages
    /// are written back first, those of files unmapped a moment ago too
    /// (with `free_path=deferred`, their objects may still wait for the
    /// grace-period thread: this drops them first). Returns the file
    /// objects let go.
    pub fn drop_caches(&self) -> usize {
        if let Some(d) = &self.m.phys.deferred {
            d.drop_aged(&self.m.rcu, true);
        }
        self.m.files.drop_cached()
    }

    /// The configuration.
    pub fn config(&self) -> &VmConfig {
        &self.m.config
    }

    /// Bind the calling thread to a free vCPU slot until the guard drops.
    ///
    /// Errors: [`Error::NoCpu`] when every slot is taken,
    /// [`Error::AlreadyAttached`] when this thread already holds one.
    pub fn attach(&self) -> Result<CpuGuard> {
        match self.m.cpus.attach() {
            Ok(a) => Ok(CpuGuard { vm: self.clone(), attachment: Some(a), _not_send: PhantomData }),
            Err(Some(cpu)) => Err(Error::AlreadyAttached { cpu }),
            Err(None) => Err(Error::NoCpu { cpus: self.m.config.cpus }),
        }
    }

    /// The vCPU slot the calling thread is attached to, if any.
    pub fn current_cpu(&self) -> Option<usize> {
        self.m.cpus.attached_slot()
    }

    /// A new, empty address space.
    pub fn new_space(&self) -> Result<AddressSpace> {
        AddressSpace::new(self.clone())
    }

    /// Fail the next `n` writes to the swap file with `EIO` (fault
    /// injection, for tests of what a failed pageout keeps). No effect
    /// without swap.
    pub fn fail_swap_writes(&self, n: u32) {
        if let Some(s) = &self.m.swap {
            s.fail_writes(n);
        }
    }

    /// Fail the next `n` reads of the swap file with `EIO` (fault
    /// injection): the access that needed the page gets [`Error::PageIo`]
    /// (SIGBUS, as Linux's `do_swap_page` answers an I/O error) and the
    /// page stays in swap, read again by the next access. No effect
    /// without swap.
    pub fn fail_swap_reads(&self, n: u32) {
        if let Some(s) = &self.m.swap {
            s.fail_reads(n);
        }
    }

    /// Statistics: gauges now, counters summed over all vCPU slots.
    pub fn stats(&self) -> Stats {
        let phys = &self.m.phys;
        let (drains, drained) = phys.pcp_drain_stats();
        let mut s = Stats {
            total_pages: phys.total_frames(),
            free_pages: phys.global_free_frames() + phys.pcp_frames(),
            deferred_pages: phys.deferred_frames(),
            deferred_drops: phys.deferred.as_ref().map_or(0, |d| d.late()),
            global_free_pages: phys.global_free_frames(),
            pcp_pages: phys.pcp_frames(),
            pcp_remote_drains: drains,
            pcp_pages_drained: drained,
            global_lock_acquisitions: phys.lock_acquisitions(),
            global_frames_moved: phys.global_frames_moved(),
            daemon_wakeups: self.m.daemon.wakeups.load(std::sync::atomic::Ordering::Relaxed),
            daemon_pages_drained: self.m.daemon.drained.load(std::sync::atomic::Ordering::Relaxed),
            reclaim_scans: self.m.daemon.scans.load(std::sync::atomic::Ordering::Relaxed),
            pageouts: self.m.daemon.pageouts.load(std::sync::atomic::Ordering::Relaxed),
            pageout_failures: self.m.daemon.failures.load(std::sync::atomic::Ordering::Relaxed),
            swap_write_errors: self.m.daemon.write_errors.load(std::sync::atomic::Ordering::Relaxed),
            file_pageouts: self.m.daemon.file_pageouts.load(std::sync::atomic::Ordering::Relaxed),
            daemon_file_writebacks: self.m.daemon.file_writebacks.load(std::sync::atomic::Ordering::Relaxed),
            swap_used_pages: self.m.swap.as_ref().map_or(0, |s| s.used()),
            swap_total_pages: self.m.swap.as_ref().map_or(0, |s| s.slots()),
            swap_bad_slots: self.m.swap.as_ref().map_or(0, |s| s.bad_slots()),
            active_pages: phys.queues.as_ref().map_or(0, |q| q.lens().0),
            inactive_pages: phys.queues.as_ref().map_or(0, |q| q.lens().1),
            queue_lock_acquisitions: phys.queues.as_ref().map_or(0, |q| q.acquisitions()),
            cpus_attached: (0..self.m.cpus.cpus()).filter(|&i| self.m.cpus.is_attached(i)).count() as u64,
            ..Stats::default()
        };
        for i in 0..phys.total_frames() as u32 {
            match phys.page(crate::phys::Pfn(i)).kind() {
                Kind::Table => s.page_table_pages += 1,
                Kind::Index => s.index_pages += 1,
                Kind::Data => {
                    s.data_pages += 1;
                    if phys.page(crate::phys::Pfn(i)).refs.wirings() > 0 {
                        s.wired_pages += 1;
                    }
                }
                _ => {}
            }
        }
        for cpu in self.m.cpus.shared_parts() {
            s.add_counters(&cpu.counters);
        }
        let (pv, pv_bytes) = self.m.pv.totals();
        s.pv_entries = pv;
        let (rmap_bytes, records) = self.m.rmap.totals();
        s.backing_records = records;
        s.rmap_bytes = pv_bytes + rmap_bytes;
        s.max_chain_depth = self.spaces().iter().map(|sp| sp.max_chain_depth()).max().unwrap_or(0).into();
        s
    }

    /// Handles to the live address spaces.
    fn spaces(&self) -> Vec<AddressSpace> {
        let map = crate::sync::rank::lock(&self.m.spaces, crate::sync::rank::Rank::Leaf);
        map.values().filter_map(|w| w.upgrade()).map(|s| AddressSpace { s, vm: self.clone() }).collect()
    }

    /// Per-vCPU counters: one entry per slot, the shared slot last.
    pub fn cpu_stats(&self) -> Vec<CpuStats> {
        self.m
            .cpus
            .shared_parts()
            .enumerate()
            .map(|(cpu, p)| CpuStats {
                cpu,
                attached: cpu < self.m.cpus.cpus() && self.m.cpus.is_attached(cpu),
                counters: CpuCounters::from_set(&p.counters),
            })
            .collect()
    }

    /// Run `f` with this thread's vCPU context for one operation.
    pub(crate) fn with_ctx<R>(&self, f: impl FnOnce(&Ctx<'_>) -> R) -> R {
        with_ctx(&self.m, f)
    }

    /// An internal handle to the machine, which does not keep the user's
    /// `Vm` alive (see [`Handle`]).
    pub(crate) fn handle(&self) -> Handle {
        Handle { m: self.m.clone() }
    }

    /// Whether two handles are the same machine.
    pub fn same_vm(&self, other: &Vm) -> bool {
        Arc::ptr_eq(&self.m, &other.m)
    }
}

impl CpuGuard {
    /// The vCPU slot index this thread holds.
    pub fn cpu(&self) -> usize {
        self.attachment.as_ref().map_or(usize::MAX, |a| a.index())
    }

    /// The machine.
    pub fn vm(&self) -> &Vm {
        &self.vm
    }
}

impl Drop for CpuGuard {
    fn drop(&mut self) {
        if let Some(a) = self.attachment.take() {
            self.vm.m.cpus.detach(a);
        }
    }
}

/// Refuse a machine the host cannot give what it touches at creation: the
/// page descriptors (and pv lists), and with `prefault` every frame. A
/// failed allocation would abort the process, and a prefault past what
/// the host has would get it killed.
fn host_can_give(config: &VmConfig, frames: u32) -> Result<()> {
    let per_frame = std::mem::size_of::<crate::phys::Page>()
        + match config.rmap {
            crate::config::Rmap::PvEntry => std::mem::size_of::<std::sync::Mutex<Vec<crate::object::Pv>>>(),
            crate::config::Rmap::Backing => 0,
        };
    let descriptors = u64::from(frames) * per_frame as u64;
    let (need, what) = match config.prefault {
        true => (descriptors + config.phys_bytes, "the prefaulted frame arena and the page descriptors"),
        false => (descriptors, "the page descriptors"),
    };
    match crate::phys::host_available() {
        Some(available) if need > available => Err(Error::HostMemory { what, need, available }),
        _ => Ok(()),
    }
}

/// The grace-period thread of `free_path=deferred` (`phys::deferred`):
/// woken by each deferred batch, it runs grace periods until it has served
/// every batch queued, and frees the batches without an owner. Ends when
/// the machine stops (`Life::drop` unparks and joins it).
fn spawn_grace_thread(m: &Arc<Machine>) -> Result<std::thread::JoinHandle<()>> {
    let weak = Arc::downgrade(m);
    let t = std::thread::Builder::new()
        .name("vmfault-rcu".into())
        .spawn(move || {
            let (mut served, mut seen) = (0, 0);
            let mut idle = Vec::new();
            loop {
                {
                    let Some(m) = weak.upgrade() else { return };
                    if m.stop.load(std::sync::atomic::Ordering::Acquire) {
                        return;
                    }
                    let Some(d) = &m.phys.deferred else { return };
                    // Acquire: every batch counted here took its cookie
                    // before the grace period below starts.
                    let wanted = d.requests();
                    // Lists that changed since the last grace period (a
                    // vCPU's few frames, the unowned list) get one too.
                    let held = d.frames();
                    if wanted != served || (held > 0 && held != seen) || d.late() > 0 {
                        m.rcu.synchronize();
                        served = wanted;
                        // (Queued drops age here; their owners drop them.)
                        m.phys.flush_deferred(&m.rcu, false);
                        seen = d.frames();
                    }
                    // Lists whose owner has not touched them since the
                    // last tick: their aged frames and values, here.
                    idle.resize(d.unowned(), crate::phys::IdleMark::default());
                    m.phys.flush_idle_deferred(&m.rcu, &mut idle);
                }
                // A wake after the load above has set the park token: the
                // park returns at once.
                std::thread::park_timeout(crate::phys::deferred::GRACE_POLL);
            }
        })
        .map_err(|e| Error::Host { call: "spawn of the grace-period thread", errno: e.raw_os_error().unwrap_or(0) })?;
    if let Some(d) = &m.phys.deferred {
        d.set_thread(t.thread().clone());
    }
    Ok(t)
}

/// The `pcpu_drain_hz` thread: drains all page caches periodically until
/// the machine stops (`Life::drop` unparks and joins it).
fn spawn_drainer(m: &Arc<Machine>) -> Result<std::thread::JoinHandle<()>> {
    let weak = Arc::downgrade(m);
    let period = std::time::Duration::from_secs_f64(1.0 / f64::from(m.config.pcpu_drain_hz));
    std::thread::Builder::new()
        .name("vmfault-pcp-drain".into())
        .spawn(move || {
            let mut next = std::time::Instant::now() + period;
            loop {
                std::thread::park_timeout(next.saturating_duration_since(std::time::Instant::now()));
                if std::time::Instant::now() < next {
                    // Unparked early: the machine may be stopping.
                    if weak.upgrade().is_none_or(|m| m.stop.load(std::sync::atomic::Ordering::Acquire)) {
                        return;
                    }
                    continue;
                }
                next += period;
                match weak.upgrade() {
                    Some(m) if !m.stop.load(std::sync::atomic::Ordering::Acquire) => {
                        m.phys.drain_pcpu(&m.rcu);
                    }
                    _ => return,
                }
            }
        })
        .map_err(|e| Error::Host { call: "spawn of the page-cache drain thread", errno: e.raw_os_error().unwrap_or(0) })
}

#[allow(dead_code)]
fn _assert_traits() {
    fn send_sync<T: Send + Sync + Clone>() {}
    send_sync::<Vm>();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Vm {
        Vm::new(VmConfig { phys_bytes: 1 << 20, cpus: 2, prefault: false, ..VmConfig::default() }).unwrap()
    }

    #[test]
    fn attach_detach_and_errors() {
        let vm = small();
        assert_eq!(vm.current_cpu(), None);
        let g = vm.attach().unwrap();
        assert_eq!(vm.current_cpu(), Some(g.cpu()));
        assert_eq!(vm.attach().unwrap_err(), Error::AlreadyAttached { cpu: g.cpu() });
        let vm2 = vm.clone();
        let t = std::thread::spawn(move || {
            let _g = vm2.attach().unwrap();
            let vm3 = vm2.clone();
            std::thread::spawn(move || vm3.attach().unwrap_err()).join().unwrap()
        });
        assert_eq!(t.join().unwrap(), Error::NoCpu { cpus: 2 });
        assert_eq!(vm.stats().cpus_attached, 1);
        drop(g);
        assert_eq!(vm.current_cpu(), None);
        assert_eq!(vm.stats().cpus_attached, 0);
    }

    #[test]
    fn stats_start_clean() {
        let vm = small();
        let s = vm.stats();
        assert_eq!(s.total_pages, 256);
        assert_eq!(s.free_pages, 255);
        assert_eq!(s.pcp_pages, 0);
        assert_eq!(s.faults, 0);
        assert_eq!(vm.cpu_stats().len(), 3);
    }

    #[test]
    fn bad_config_is_an_error() {
        let e = Vm::new(VmConfig { cpus: 0, ..VmConfig::default() }).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }
}
