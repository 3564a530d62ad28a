//! [`Vm`]'s methods: one machine. It owns physical memory, the vCPU slots,
//! the RCU and the statistics (the types are in `machine`, below the
//! address spaces that hold them); address spaces are created from it, and
//! its threads (the page daemon, the grace-period thread) are started
//! here. Many `Vm`s can live in one process: there are no globals.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

pub use crate::machine::Vm;
pub(crate) use crate::machine::{Ctx, Handle, Machine, with_ctx};

use crate::aspace::AddressSpace;
use crate::config::VmConfig;
use crate::error::{Error, Result};
use crate::machine::{Life, PerCpu, PerCpuOwned};
use crate::object::{Env, EnvRef};
use crate::phys::PhysMem;
use crate::stats::{CounterSet, CpuCounters, CpuStats, Stats};
use crate::sync::cpu::{Attachment, CpuSet};
use crate::sync::rcu::Rcu;
use crate::types::PAGE_SIZE;

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
    /// A machine of 4 MiB and one vCPU slot, not prefaulted: what a unit
    /// test of a vCPU thread's set-up needs.
    #[cfg(test)]
    pub(crate) fn small_for_tests() -> Vm {
        Vm::new(crate::VmConfig { phys_bytes: 4 << 20, cpus: 1, prefault: false, ..crate::VmConfig::default() })
            .expect("a 4 MiB machine")
    }

    /// Build a machine: map the frame arena, set up the vCPU slots.
    pub fn new(config: VmConfig) -> Result<Vm> {
        config.validate()?;
        let frames = (config.phys_bytes / PAGE_SIZE) as u32;
        host_can_give(&config, frames)?;
        // One reader per slot (the shared one included), one for the daemon.
        let (rcu, readers) = Rcu::new(config.cpus + 2);
        let make = if config.host_views { PhysMem::new_shared } else { PhysMem::new };
        let mut phys = make(
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
        // One reader per slot (the vCPUs', and the slot of threads not
        // attached), then the page daemon's.
        let mut readers = readers.into_iter();
        let mut slot_readers = readers.by_ref().take(config.cpus + 1).collect::<Vec<_>>().into_iter();
        let daemon_reader = readers.next().expect("the page daemon's reader");
        let swap = match &config.swap {
            Some(path) => Some(crate::swapdev::Swap::create(path, config.swap_bytes())?),
            None => None,
        };
        let pv = match config.rmap {
            crate::config::Rmap::PvEntry => crate::object::PvTable::new(frames)?,
            crate::config::Rmap::Backing => crate::object::PvTable::default(),
        };
        let env = Arc::new(Env {
            config,
            phys,
            daemon: Default::default(),
            rcu,
            files: Default::default(),
            rmap: Default::default(),
            pv,
            reclaimable: crate::object::Reclaimable::new(swap.is_some()),
            swap,
        });
        let cpus = CpuSet::new(env.config.cpus, |_| {
            let reader = slot_readers.next().expect("one reader per slot");
            (
                PerCpu { counters: CounterSet::new() },
                PerCpuOwned {
                    rcu: reader,
                    next_object: Cell::new(1),
                    index_hint: Default::default(),
                    env_ref: EnvRef::new(&env),
                },
            )
        });
        let m = Arc::new(Machine {
            env,
            cpus,
            spaces: Default::default(),
            orphans: Default::default(),
            orphaned: Default::default(),
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
    /// The thread's spare VMA records and index nodes are stocked here (a
    /// full list of each, from what departed threads left or else new), and
    /// its reclaim buffers given their room, so that its `mmap`s and
    /// `munmap`s allocate nothing from the heap from the first: about 40
    /// KiB per vCPU thread (README, "Disjoint changes").
    ///
    /// Errors: [`Error::NoCpu`] when every slot is taken,
    /// [`Error::AlreadyAttached`] when this thread already holds one.
    pub fn attach(&self) -> Result<CpuGuard> {
        match self.m.cpus.attach() {
            Ok(a) => {
                crate::aspace::stock_thread();
                Ok(CpuGuard { vm: self.clone(), attachment: Some(a), _not_send: PhantomData })
            }
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
    ///
    /// Its time grows with the vCPU slots and the spaces, not with memory:
    /// the frames by kind and the wired pages are counted as they change
    /// (`data_pages_made` less `data_pages_freed`, and so on), by the vCPU
    /// that changed them, so no descriptor is looked at (1.5 us at 64 MiB
    /// and at 4 GiB on the 2-core machine; a look at every descriptor took
    /// 313 us at 1 GiB).
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
        for cpu in self.m.cpus.shared_parts() {
            s.add_counters(&cpu.counters);
        }
        s.add_shared(phys.shared_counters());
        // Gauges from counters: each vCPU counts what it made and freed.
        // Read while vCPUs run, one vCPU's free may be seen before
        // another's making of the same frame: a snapshot, exact once
        // they stop.
        s.data_pages = s.data_pages_made.saturating_sub(s.data_pages_freed);
        s.page_table_pages = s.table_pages_made.saturating_sub(s.table_pages_freed);
        s.index_pages = s.index_pages_made.saturating_sub(s.index_pages_freed);
        s.wired_pages = s.pages_wired.saturating_sub(s.pages_unwired);
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
        crate::aspace::Space::registered(&self.m).into_iter().map(|s| AddressSpace { s, vm: self.clone() }).collect()
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
                        // Sleeping between polls: spinning here took the
                        // CPU from the very sections it waited for.
                        m.rcu.grace_period_sleeping();
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

    use crate::Stats;
    use crate::phys::Kind;

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

    /// Frames by kind and wired data pages as a look at every descriptor
    /// counts them (what `stats` did before its counters).
    fn by_scan(vm: &Vm) -> [u64; 4] {
        let phys = &vm.m.phys;
        let mut n = [0; 4];
        for pfn in crate::phys::Pfn::all(phys.total_frames() as u32) {
            let page = phys.page(pfn);
            match page.kind() {
                Kind::Table => n[0] += 1,
                Kind::Index => n[1] += 1,
                Kind::Data => {
                    n[2] += 1;
                    n[3] += u64::from(page.refs.wirings() > 0);
                }
                _ => {}
            }
        }
        n
    }

    /// The gauges `stats` makes from counters agree with a scan once the
    /// vCPUs and the daemon are still (it may run a pass between two looks:
    /// look until two stats agree around a scan).
    fn assert_gauges_match(vm: &Vm, when: &str) {
        let gauges = |s: &Stats| [s.page_table_pages, s.index_pages, s.data_pages, s.wired_pages];
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let before = gauges(&vm.stats());
            let scan = by_scan(vm);
            if before == scan && gauges(&vm.stats()) == scan {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{when}: stats say {before:?} (tables, index nodes, data, wired), a scan {scan:?}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[test]
    fn gauges_by_kind_follow_every_way_a_frame_is_made_and_freed() {
        use crate::{Access, MapFlags, Prot};
        const P: u64 = 4096;
        let path = std::env::temp_dir().join(format!("vmfault-gauges-{}.swap", std::process::id()));
        let vm = Vm::new(VmConfig {
            phys_bytes: 384 * P,
            cpus: 3,
            prefault: false,
            swap: Some(path),
            ..VmConfig::default()
        })
        .unwrap();
        let (rw, anon) = (Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS);
        let space = vm.new_space().unwrap();
        assert_gauges_match(&vm, "a new space");
        // Two vCPUs fill more than memory holds: the daemon pages out.
        let bases: Vec<u64> = std::thread::scope(|t| {
            let workers: Vec<_> = (0..2u8)
                .map(|i| {
                    let (vm, space) = (&vm, &space);
                    t.spawn(move || {
                        let _cpu = vm.attach().unwrap();
                        let a = space.mmap(0, 300 * P, rw, anon).unwrap();
                        for p in 0..300 {
                            space.write(a + p * P, &[i + 1; 64]).unwrap();
                        }
                        a
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        assert!(vm.stats().pageouts > 0, "the workload pages out");
        assert_gauges_match(&vm, "after paging out");
        // Wirings: mlock, a hold, and copies on write after a fork.
        space.mlock(bases[0], 16 * P).unwrap();
        let hold = space.hold(bases[1], Access::Write).unwrap();
        let child = space.fork().unwrap();
        child.write(bases[0] + 32 * P, &[9; 8]).unwrap();
        space.write(bases[1] + 40 * P, &[7; 8]).unwrap();
        assert_gauges_match(&vm, "after mlock, a hold and a fork");
        drop(hold);
        space.munlock(bases[0], 16 * P).unwrap();
        space.munmap(bases[0], 150 * P).unwrap();
        drop(child);
        assert_gauges_match(&vm, "after munlock and munmap");
        drop(space);
        // The last references may be the page daemon's (a pageout in
        // flight, its reaper's): the frames go once it lets them go.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while by_scan(&vm) != [0; 4] && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(by_scan(&vm), [0; 4], "every frame freed");
        assert_gauges_match(&vm, "with no space left");
    }

    #[test]
    fn bad_config_is_an_error() {
        let e = Vm::new(VmConfig { cpus: 0, ..VmConfig::default() }).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }
}
