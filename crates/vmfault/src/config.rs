//! [`VmConfig`]: the size of a machine and every run-time switch.
//!
//! Every knob can also be set by name from a string ([`VmConfig::set`]), which
//! is how `vmfault bench --set key=value` and `--compare key=a,b` reach it;
//! [`VmConfig::knobs`] lists them all with their current values.

use crate::error::{Error, Result};

/// How page faults find and pin their VMA.
///
/// - `MapLock`: the classic path, the address space's map lock held for
///   reading over the whole fault (Linux before 6.4).
/// - `Speculative`: no lock: the VMA is found under RCU and validated by its
///   sequence count, the page is prepared speculatively and installed under
///   the PTE lock after a final check; any change aborts to the classic path
///   (the speculative page fault series, SPF v11).
/// - `VmaLock`: the VMA is found under RCU and read-locked for the whole
///   fault; writers lock the VMAs they change (per-VMA locks, Linux 6.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum FaultPath {
    /// The map lock, held for reading over the whole fault.
    MapLock,
    /// Speculative, validated by the VMA's sequence count.
    Speculative,
    /// A per-VMA read lock.
    VmaLock,
}

impl FaultPath {
    /// The knob value: `maplock`, `spf` or `vmalock`.
    pub fn name(self) -> &'static str {
        match self {
            FaultPath::MapLock => "maplock",
            FaultPath::Speculative => "spf",
            FaultPath::VmaLock => "vmalock",
        }
    }

    /// Parse a knob value (also accepts `map_lock`, `speculative`, `vma_lock`).
    fn parse(v: &str) -> std::result::Result<FaultPath, &'static str> {
        match v.trim() {
            "maplock" | "map_lock" => Ok(FaultPath::MapLock),
            "spf" | "speculative" => Ok(FaultPath::Speculative),
            "vmalock" | "vma_lock" => Ok(FaultPath::VmaLock),
            _ => Err("expected maplock, spf or vmalock"),
        }
    }
}

/// How a page is found back from the mappings that map it (the reverse map).
///
/// - `Backing`: one record per mapping of an object range, on the object's
///   list, and one link per shadow object (DragonFly's `vm_map_backing`):
///   metadata grows with mappings, not with pages.
/// - `PvEntry`: one entry per page per PTE that maps it, on the page's list
///   (BSD's pv entries, Linux 2.5's pte chains): the baseline, kept for
///   comparison; every fault and every unmapped PTE pays for an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Rmap {
    /// Backing records per mapping (the default).
    Backing,
    /// A pv entry per page per mapping.
    PvEntry,
}

impl Rmap {
    /// The knob value: `backing` or `pv`.
    pub fn name(self) -> &'static str {
        match self {
            Rmap::Backing => "backing",
            Rmap::PvEntry => "pv",
        }
    }

    fn parse(v: &str) -> std::result::Result<Rmap, &'static str> {
        match v.trim() {
            "backing" => Ok(Rmap::Backing),
            "pv" | "pv_entry" | "pventry" => Ok(Rmap::PvEntry),
            _ => Err("expected backing or pv"),
        }
    }
}

/// How a page's references (wirings, the object's reference) are counted.
///
/// - `Atomic`: one atomic word per page (FreeBSD's `ref_count` since
///   r353535): wiring and unwiring are one atomic operation.
/// - `PageLock`: as FreeBSD before r353535, wiring and unwiring (and the
///   page-queue updates they imply) also take the page's lock, one of 256
///   locks hashed by the 2 MiB region the frame lies in (FreeBSD's
///   `PA_LOCKPTR`): pages that are physically close share a lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum Refcount {
    /// An atomic reference count (the default).
    Atomic,
    /// The hashed page-lock baseline.
    PageLock,
}

impl Refcount {
    /// The knob value: `atomic` or `pagelock`.
    pub fn name(self) -> &'static str {
        match self {
            Refcount::Atomic => "atomic",
            Refcount::PageLock => "pagelock",
        }
    }

    fn parse(v: &str) -> std::result::Result<Refcount, &'static str> {
        match v.trim() {
            "atomic" => Ok(Refcount::Atomic),
            "pagelock" | "page_lock" => Ok(Refcount::PageLock),
            _ => Err("expected atomic or pagelock"),
        }
    }
}

/// The order in which freed frames are handed out again.
///
/// - `Lifo`: a bulk free pushes frames in the order its caller collected
///   them; the global list is a stack, so each cycle scrambles the order a
///   little more and a run of allocations lands on frames scattered over
///   the arena (zeroing a 4 KiB page costs 164 ns in address order and
///   402 ns in random order on the project's 2-core machine).
/// - `Ordered`: a bulk free (after `munmap`'s, a space's or an object's
///   grace period, and the page daemon's) sorts its frames, so the next
///   allocations run through them in ascending address order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum FrameOrder {
    /// The stack order of the frees (last freed, first reused).
    Lifo,
    /// Bulk frees sorted by address.
    Ordered,
}

impl FrameOrder {
    /// The knob value: `lifo` or `ordered`.
    pub fn name(self) -> &'static str {
        match self {
            FrameOrder::Lifo => "lifo",
            FrameOrder::Ordered => "ordered",
        }
    }

    fn parse(v: &str) -> std::result::Result<FrameOrder, &'static str> {
        match v.trim() {
            "lifo" => Ok(FrameOrder::Lifo),
            "ordered" => Ok(FrameOrder::Ordered),
            _ => Err("expected lifo or ordered"),
        }
    }
}

/// How a frame is zeroed for a fault (see `zero_stores`).
///
/// Zeroing with ordinary stores reads each of the frame's 64 lines from
/// memory before it writes it (a read for ownership), and leaves 4 KiB of
/// zeros in the caches that push out what was there; streaming
/// (non-temporal) stores write the lines straight to memory. Which is
/// cheaper depends on where the frame's lines are: a frame freed a moment
/// ago is in the vCPU's caches, and ordinary stores clear it there (a
/// vmlocal or ebizzy loop); a frame last written hundreds of faults ago is
/// not, and ordinary stores pay a memory read per line (page_fault1).
///
/// - `Cached`: ordinary stores for every frame, as before.
/// - `Streaming`: streaming stores for every frame, but for the line the
///   faulting access touches, which ordinary stores write last so that the
///   access finds it in the cache (Linux clears the target subpage of a
///   huge page last for the same reason). It cost ebizzy 0.71x at one vCPU
///   on the project's 2-core machine (README, `zero_stores`): it is there
///   to compare.
/// - `Auto`: ordinary stores for a frame whose lines this vCPU wrote
///   lately: it took the frame less than [`STREAM_AFTER_FRAMES`] of its
///   allocations before it freed it into its cache, and freed it less
///   than that many ago (a vmlocal or ebizzy loop); streaming for the rest
///   (a frame another vCPU had or that has not been in a cache since the
///   `Vm` began, one freed long ago, or one taken long before its free: a
///   page_fault1 munmap frees 32,768 frames it reads no line of). Two
///   stamps in the page descriptor, written as the frame is taken and as
///   it enters a cache; a frame this vCPU's cache overflowed to the global
///   list keeps its stamps. They say when the vCPU last took and freed the
///   frame, not which of its lines are still cached: a guess, which can
///   only choose the slower stores, never change what the frame holds.
///   Without per-CPU caches (`pcpu_pages=0`) nothing is stamped and
///   `auto` is `cached`. Stores are ordered before the frame is published
///   (a fence after streaming ones). Other architectures than x86-64 use
///   ordinary stores whatever the knob says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum ZeroStores {
    /// Ordinary stores.
    Cached,
    /// Streaming stores but for the faulting line.
    Streaming,
    /// Streaming stores for frames that have left the vCPU's caches.
    Auto,
}

/// `zero_stores=auto`: a frame the vCPU put in its cache this many of its
/// frame allocations ago or more (8 MiB of frames since) is zeroed with
/// streaming stores.
pub const STREAM_AFTER_FRAMES: u32 = 2048;

impl ZeroStores {
    /// The knob value: `cached`, `streaming` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            ZeroStores::Cached => "cached",
            ZeroStores::Streaming => "streaming",
            ZeroStores::Auto => "auto",
        }
    }

    fn parse(v: &str) -> std::result::Result<ZeroStores, &'static str> {
        match v.trim() {
            "cached" => Ok(ZeroStores::Cached),
            "streaming" => Ok(ZeroStores::Streaming),
            "auto" => Ok(ZeroStores::Auto),
            _ => Err("expected cached, streaming or auto"),
        }
    }
}

/// How many frames a vCPU's page cache may keep (see `pcpu_pages`).
///
/// - `Fixed`: `pcpu_pages` (16 by default): a munmap of 128 MiB sends all
///   but 16 of its frames to the global list, and the next run of faults
///   takes them back 15 at a time (2,195 global-lock acquisitions and
///   65.8k frames through the list per page_fault1 cycle).
/// - `Auto`: the cache's high mark follows the vCPU's frees (Linux 6.7's
///   auto-tuned per-CPU `high`): a free that finds the cache full raises
///   it, up to the vCPU's share of memory, while the global list holds
///   more than the free target; a drain (the page daemon's, or an
///   allocation that found nothing anywhere) empties the cache and puts
///   the mark back at `pcpu_pages`. Freed frames stay where they were
///   freed and are reused there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum PcpHigh {
    /// At most `pcpu_pages` frames per cache.
    Fixed,
    /// A high mark that follows the vCPU's frees.
    Auto,
}

impl PcpHigh {
    /// The knob value: `fixed` or `auto`.
    pub fn name(self) -> &'static str {
        match self {
            PcpHigh::Fixed => "fixed",
            PcpHigh::Auto => "auto",
        }
    }

    fn parse(v: &str) -> std::result::Result<PcpHigh, &'static str> {
        match v.trim() {
            "fixed" => Ok(PcpHigh::Fixed),
            "auto" => Ok(PcpHigh::Auto),
            _ => Err("expected fixed or auto"),
        }
    }
}

/// Who waits for the grace period before unmapped frames are reused.
///
/// Either way the operation first polls for a grace period (`Rcu::poll`),
/// which completes with no wait when no other vCPU is inside a read-side
/// section (always, with one vCPU); the frames then go straight to its
/// page cache.
///
/// - `Sync`: otherwise the operation that unmapped them (munmap, madvise,
///   MAP_FIXED replacement, a copy-on-write collapse) waits for a grace
///   period before it returns; so does an object's end.
/// - `Deferred`: otherwise they go onto the vCPU's deferred list with the
///   grace period's cookie; the grace period its poll started completes at
///   a later poll (the vCPU's next cache miss or free), or a grace-period
///   thread ages every vCPU's batches with one, and the vCPU takes them
///   back into its page cache when it next needs frames. No operation
///   waits (Linux's `call_rcu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum FreePath {
    /// The freeing operation waits for the grace period.
    Sync,
    /// Nobody waits: a thread ages the batches.
    Deferred,
}

impl FreePath {
    /// The knob value: `sync` or `deferred`.
    pub fn name(self) -> &'static str {
        match self {
            FreePath::Sync => "sync",
            FreePath::Deferred => "deferred",
        }
    }

    fn parse(v: &str) -> std::result::Result<FreePath, &'static str> {
        match v.trim() {
            "sync" => Ok(FreePath::Sync),
            "deferred" => Ok(FreePath::Deferred),
            _ => Err("expected sync or deferred"),
        }
    }
}

/// How the map lock is split (`aspace/zones.rs`).
///
/// - `Global`: one map lock per address space, as in Linux: every change
///   of a space's mappings (mmap, munmap, mprotect, madvise, mlock) takes
///   it for writing, so changes of disjoint ranges wait for each other.
/// - `Zoned`: one map lock per 512 GiB zone of the address space, each
///   over the VMAs that touch its zone, with its own snapshot for lockless
///   faults: a change locks only the zones of its range and of the VMAs it
///   touches, and changes in different zones share no lock and no written
///   cache line. An mmap with no usable hint searches the published
///   snapshots for Linux's address, then locks its zone; if another change
///   holds that zone it takes the next free gap below it instead
///   (CortenMM's contention-aware placement), so the address is Linux's
///   whenever no other change is in flight. VMAs are Linux's whatever the
///   zones (the differential tests run across a zone edge).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub enum MapLock {
    /// One lock per address space.
    Global,
    /// One lock per 512 GiB zone.
    Zoned,
}

impl MapLock {
    /// The knob value: `global` or `zoned`.
    pub fn name(self) -> &'static str {
        match self {
            MapLock::Global => "global",
            MapLock::Zoned => "zoned",
        }
    }

    fn parse(v: &str) -> std::result::Result<MapLock, &'static str> {
        match v.trim() {
            "global" => Ok(MapLock::Global),
            "zoned" => Ok(MapLock::Zoned),
            _ => Err("expected global or zoned"),
        }
    }
}

/// The configuration of a [`Vm`](crate::Vm).
///
/// ```
/// use vmfault::VmConfig;
/// let mut cfg = VmConfig { phys_bytes: 64 << 20, cpus: 4, ..VmConfig::default() };
/// cfg.set("zero_page", "false")?;
/// assert!(!cfg.zero_page);
/// assert!(cfg.set("cpus", "lots").is_err());
/// # Ok::<(), vmfault::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct VmConfig {
    /// Bytes of physical memory (rounded down to whole 4 KiB frames). Page
    /// tables and object indexes are allocated from it too. Default 256 MiB.
    pub phys_bytes: u64,
    /// Number of vCPU slots that threads can [`attach`](crate::Vm::attach) to
    /// (1..=1024). Default 64. Threads that are not attached share one more slot.
    pub cpus: usize,
    /// Touch every frame of the arena at start, so host page faults on the
    /// arena do not pollute measurements. Default false: `Vm::new` returns
    /// at once and the host backs the arena as it is used (prefaulting a 1
    /// GiB `Vm` took 330-360 ms and kept all of it resident); the measuring
    /// commands (`vmfault bench`, `vmfault stat`) turn it on unless told
    /// otherwise.
    pub prefault: bool,
    /// Read faults on untouched private anonymous memory map one shared zero
    /// frame (as Linux does) instead of allocating. Default true.
    pub zero_page: bool,
    /// Frames in each vCPU's page cache in front of the global free list
    /// (OpenBSD's per-CPU caches). 0 turns the caches off. Default 16.
    pub pcpu_pages: usize,
    /// Frames a cache miss takes from the global list in one lock
    /// acquisition; 0 (the default) means `pcpu_pages - 1` (OpenBSD's 15
    /// of 16) with `pcpu_high=fixed`, and with `auto` a run of 256
    /// consecutive frames, or the vCPU's share of memory if less (the
    /// cache's high mark grows to hold it, if the global list keeps its
    /// free target after it; else the fill is `pcpu_pages - 1`).
    ///
    /// Why runs: vCPUs that took 15 frames at a time from the address-ordered
    /// global list ended up with frames interleaved 15 by 15, and kept
    /// reusing them. On two core complexes (a cache-line round trip of
    /// ~350 ns) page_fault1 at 2 vCPUs then ran 6.2M faults/s, 16% of its
    /// time in the teardown, nearly all of it on the locked update of
    /// each page's descriptor (`RefCount::release_objref`), which a
    /// prefetch 16 pages ahead did not shorten: the lines were not slow
    /// to come from memory but held by the other core complex. Most
    /// likely each vCPU's hardware prefetchers, walking its own run of
    /// descriptors (64 bytes each, 15 lines), ran on into the other's.
    /// With runs of 256, 10.2M. `bench
    /// page_fault1 --threads 2 --rounds 24 --seconds 0.3 --no-host
    /// --compare pcpu_pages=16,256,1024`, then `=64,256,...` (the size
    /// sets the fill), rounds at ~65 ns / ~350 ns: 16: 9.06M / 6.17M,
    /// 64: 10.38M / 8.84M, 256: 9.92M / 10.22M, 1024: 10.29M / 9.31M.
    pub pcpu_fill: usize,
    /// Frames a full cache returns to the global list in one acquisition;
    /// 0 means all of them (OpenBSD's choice; a half-and-half split is
    /// `pcpu_fill=8, pcpu_drain=8`).
    pub pcpu_drain: usize,
    /// Who waits for the grace period of a free (see [`FreePath`]).
    /// Default `Deferred` (no operation waits; `Sync` waits when a poll
    /// does not complete).
    pub free_path: FreePath,
    /// How many frames a cache may keep (see [`PcpHigh`]). Default `Auto`:
    /// global-lock acquisitions per page_fault1 cycle fell from 2,195 to
    /// 2-7 and frames through the global list from 65.8k to 25-136.
    pub pcpu_high: PcpHigh,
    /// Drain every vCPU's cache remotely this many times a second from a
    /// background thread (0: only on demand). For measuring drains.
    pub pcpu_drain_hz: u32,
    /// How page faults pin their VMA (see [`FaultPath`]).
    pub fault_path: FaultPath,
    /// How mappings of a page are found (see [`Rmap`]). Default `Backing`.
    pub rmap: Rmap,
    /// How page references are counted (see [`Refcount`]). Default `Atomic`.
    pub refcount: Refcount,
    /// Run a page daemon thread that wakes when the global free list falls
    /// below `free_target` and drains the vCPUs' page caches remotely.
    /// Default true.
    pub page_daemon: bool,
    /// Free frames on the global list below which the page daemon runs;
    /// 0 means 1/32 of physical memory. Default 0.
    pub free_target: u64,
    /// A swap file for anonymous pages, created (or taken over and
    /// emptied) at this path by [`Vm::new`](crate::Vm::new), or created
    /// under a unique name if the path is a directory, its blocks
    /// allocated (`ENOSPC` otherwise), locked against other `Vm`s
    /// (`EBUSY`), and removed when the `Vm` goes; the
    /// page daemon pages out to it when memory runs low. With it the
    /// daemon also keeps page queues (aging by reference marks) and
    /// reclaims file pages, writing dirty ones back to their file. Needs
    /// `page_daemon`. Default none: anonymous memory is not reclaimable,
    /// and the fault path does no queue work.
    pub swap: Option<std::path::PathBuf>,
    /// Bytes of the swap file; 0 means twice `phys_bytes`. Default 0.
    pub swap_bytes: u64,
    /// The order in which freed frames are reused (see [`FrameOrder`]).
    /// Default `Ordered`: it measured 1.19x and 1.55x page_fault1, 1.89x
    /// and 1.80x pft over `Lifo` at 1 and 2 vCPUs on the project's 2-core
    /// machine. (The `fault_races` failure once seen with it was a fork
    /// race of every order and path, fixed since.)
    pub frame_order: FrameOrder,
    /// How the map lock is split (see [`MapLock`]). Default `Zoned`: at 2
    /// vCPUs it measured 1.5x-6.7x vmlocal, mmap1, malloc1 and brk1 over
    /// `Global` on the project's 2-core machine, and 0.90x-0.97x at one
    /// vCPU (README, "Disjoint changes").
    pub map_lock: MapLock,
    /// Page-table pages a prune detaches, and the index nodes of an
    /// anonymous object that ends, are cleared as they are walked and
    /// marked as holding zeros, and their next owner (a new table, an
    /// index node, a data page) takes them without zeroing them again
    /// (FreeBSD frees page-table pages with `vm_page_free_zero` and skips
    /// `pmap_zero_page` for `PG_ZERO` pages). `false` zeroes every frame
    /// at allocation, as before. Default true.
    pub reuse_zeroed: bool,
    /// How a fault zeroes its frame (see [`ZeroStores`]). Default `Auto`.
    pub zero_stores: ZeroStores,
    /// Free frames of its cache that a fault zeroing its own frame with
    /// streaming stores zeroes too, ahead of their faults (0: none; at most
    /// [`MAX_PCPU_PAGES`]). The frames it picks are the next ones its cache
    /// will hand out that have left the vCPU's caches (the `zero_stores`
    /// test) and hold no zeros yet; each keeps the line of the current
    /// fault's offset in the cache, and their faults skip their zeroing.
    /// Why: streaming stores must reach memory before the frame is
    /// published, and the fault waits for them at its next locked
    /// instruction; one wait per batch instead of one per frame. Frames
    /// that another vCPU's drain takes, or that are used for a copy,
    /// were zeroed for nothing. Without streaming stores (`zero_stores=
    /// cached`, other architectures than x86-64, `pcpu_pages=0`) it does
    /// nothing. Default 32 (README, `zero_ahead`).
    pub zero_ahead: usize,
    /// Whether address spaces may have host views
    /// ([`AddressSpace::host_view`](crate::AddressSpace::host_view)):
    /// the frame arena is then a memfd that the views map. Default
    /// `false`: shared memory gets transparent huge pages only where the
    /// host's `shmem_enabled` allows them, which it often does not.
    pub host_views: bool,
    /// Pages a fault through a host view maps at once: the aligned block
    /// of this many pages around the faulting one, as far as its mapping
    /// covers and allows the access, is faulted in (allocated and zeroed
    /// where it is untouched) and mapped into the view with as few host
    /// calls as its frames allow (consecutive frames: one). As Linux's
    /// multi-size THP for anonymous memory and `fault_around_bytes` for
    /// files do: a signal and a host mapping call cost more than a
    /// vmfault fault. A power of two, 1 to 512. Default 16 (64 KiB).
    pub view_fault_around: usize,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            phys_bytes: 256 << 20,
            cpus: 64,
            prefault: false,
            zero_page: true,
            pcpu_pages: 16,
            pcpu_fill: 0,
            pcpu_drain: 0,
            pcpu_high: PcpHigh::Auto,
            free_path: FreePath::Deferred,
            pcpu_drain_hz: 0,
            fault_path: FaultPath::Speculative,
            rmap: Rmap::Backing,
            refcount: Refcount::Atomic,
            page_daemon: true,
            free_target: 0,
            swap: None,
            swap_bytes: 0,
            frame_order: FrameOrder::Ordered,
            map_lock: MapLock::Zoned,
            reuse_zeroed: true,
            zero_stores: ZeroStores::Auto,
            zero_ahead: 32,
            host_views: false,
            view_fault_around: 16,
        }
    }
}

/// Upper bound on [`VmConfig::cpus`].
pub const MAX_CPUS: usize = 1024;
/// Frames a cache miss takes from the global list as one run under
/// `pcpu_high=auto` with the default `pcpu_fill` (1 MiB): see
/// [`VmConfig::pcpu_fill`].
pub(crate) const RUN_FRAMES: usize = 256;

/// Upper bound on [`VmConfig::pcpu_pages`].
pub const MAX_PCPU_PAGES: usize = 4096;

impl VmConfig {
    /// Set a knob by name from its textual value. Sizes accept `K`, `M`, `G`
    /// suffixes (powers of two); booleans accept `true/false/on/off/1/0`.
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        self.set_inner(key, value).map_err(|reason| Error::Knob {
            key: key.to_string(),
            value: value.to_string(),
            reason,
        })
    }

    fn set_inner(&mut self, key: &str, value: &str) -> std::result::Result<(), &'static str> {
        match key {
            "phys_bytes" => self.phys_bytes = parse_size(value)?,
            "cpus" => self.cpus = parse_usize(value)?,
            "prefault" => self.prefault = parse_bool(value)?,
            "zero_page" => self.zero_page = parse_bool(value)?,
            "pcpu_pages" => self.pcpu_pages = parse_usize(value)?,
            "pcpu_fill" => self.pcpu_fill = parse_usize(value)?,
            "pcpu_drain" => self.pcpu_drain = parse_usize(value)?,
            "pcpu_high" => self.pcpu_high = PcpHigh::parse(value)?,
            "free_path" => self.free_path = FreePath::parse(value)?,
            "fault_path" => self.fault_path = FaultPath::parse(value)?,
            "rmap" => self.rmap = Rmap::parse(value)?,
            "refcount" => self.refcount = Refcount::parse(value)?,
            "page_daemon" => self.page_daemon = parse_bool(value)?,
            "free_target" => self.free_target = parse_num(value)?,
            "swap" => self.swap = (!matches!(value.trim(), "" | "none")).then(|| value.trim().into()),
            "swap_bytes" => self.swap_bytes = parse_size(value)?,
            "frame_order" => self.frame_order = FrameOrder::parse(value)?,
            "map_lock" => self.map_lock = MapLock::parse(value)?,
            "reuse_zeroed" => self.reuse_zeroed = parse_bool(value)?,
            "zero_stores" => self.zero_stores = ZeroStores::parse(value)?,
            "zero_ahead" => self.zero_ahead = parse_usize(value)?,
            "host_views" => self.host_views = parse_bool(value)?,
            "view_fault_around" => self.view_fault_around = parse_usize(value)?,
            "lifecycle" => self.set_lifecycle(value)?,
            "pcpu_drain_hz" => {
                self.pcpu_drain_hz = u32::try_from(parse_num(value)?).map_err(|_| "too large for a u32")?
            }
            _ => return Err("unknown knob (VmConfig::knobs lists them)"),
        }
        Ok(())
    }

    /// The `lifecycle` shorthand: the seven knobs of a page's life and of
    /// the changes around it (`frame_order`, `pcpu_high`, `free_path`,
    /// `map_lock`, `reuse_zeroed`, `zero_stores`, `zero_ahead`) at once, so that one
    /// `--compare lifecycle=baseline,sync,default` measures the plain
    /// lifecycle (`baseline`: LIFO reuse, the fixed 16-frame cache, frees
    /// that wait for their grace period, one map lock per space, every
    /// frame zeroed at allocation with ordinary stores, none ahead: the
    /// earlier lifecycle, kept for comparison) beside ordered frames and
    /// adaptive caches with waiting
    /// frees (`sync`) and beside the defaults (`default`, which `deferred`
    /// names too: every mechanism on). `sync` and `deferred` take the
    /// default map lock, zero reuse and zeroing. It is not a knob of
    /// its own: `knobs()` lists the seven it sets.
    fn set_lifecycle(&mut self, value: &str) -> std::result::Result<(), &'static str> {
        let d = VmConfig::default();
        let (order, high, free) = match value.trim() {
            "baseline" => (FrameOrder::Lifo, PcpHigh::Fixed, FreePath::Sync),
            "default" => (d.frame_order, d.pcpu_high, d.free_path),
            "sync" => (FrameOrder::Ordered, PcpHigh::Auto, FreePath::Sync),
            "deferred" => (FrameOrder::Ordered, PcpHigh::Auto, FreePath::Deferred),
            _ => return Err("expected baseline, sync, default or deferred"),
        };
        let (map_lock, zeroed, stores, ahead) = match value.trim() {
            "baseline" => (MapLock::Global, false, ZeroStores::Cached, 0),
            _ => (d.map_lock, d.reuse_zeroed, d.zero_stores, d.zero_ahead),
        };
        (self.frame_order, self.pcpu_high, self.free_path) = (order, high, free);
        (self.map_lock, self.reuse_zeroed, self.zero_stores, self.zero_ahead) = (map_lock, zeroed, stores, ahead);
        Ok(())
    }

    /// Every knob with its current value, in a stable order.
    pub fn knobs(&self) -> Vec<(&'static str, String)> {
        vec![
            ("phys_bytes", self.phys_bytes.to_string()),
            ("cpus", self.cpus.to_string()),
            ("prefault", self.prefault.to_string()),
            ("zero_page", self.zero_page.to_string()),
            ("pcpu_pages", self.pcpu_pages.to_string()),
            ("pcpu_fill", self.pcpu_fill.to_string()),
            ("pcpu_drain", self.pcpu_drain.to_string()),
            ("pcpu_high", self.pcpu_high.name().to_string()),
            ("free_path", self.free_path.name().to_string()),
            ("pcpu_drain_hz", self.pcpu_drain_hz.to_string()),
            ("fault_path", self.fault_path.name().to_string()),
            ("rmap", self.rmap.name().to_string()),
            ("refcount", self.refcount.name().to_string()),
            ("page_daemon", self.page_daemon.to_string()),
            ("free_target", self.free_target.to_string()),
            ("swap", self.swap.as_ref().map_or("none".into(), |p| p.display().to_string())),
            ("swap_bytes", self.swap_bytes.to_string()),
            ("frame_order", self.frame_order.name().to_string()),
            ("map_lock", self.map_lock.name().to_string()),
            ("reuse_zeroed", self.reuse_zeroed.to_string()),
            ("zero_stores", self.zero_stores.name().to_string()),
            ("zero_ahead", self.zero_ahead.to_string()),
            ("host_views", self.host_views.to_string()),
            ("view_fault_around", self.view_fault_around.to_string()),
        ]
    }

    /// Every knob that [`VmConfig::set`] takes (the shorthand `lifecycle`
    /// too) with the values it accepts, in words: each parser's own
    /// description, so the list cannot drift from what `set` does.
    ///
    /// ```
    /// let help = vmfault::VmConfig::knob_values();
    /// assert!(help.iter().any(|(k, v)| *k == "fault_path" && v.contains("spf")));
    /// ```
    pub fn knob_values() -> Vec<(&'static str, String)> {
        let names = VmConfig::default().knobs().into_iter().map(|(k, _)| k).chain(["lifecycle"]);
        names
            .map(|k| {
                // A value no parser takes: the error says what they take.
                let said = match VmConfig::default().set_inner(k, "\u{1}") {
                    Err(e) => e.strip_prefix("expected ").unwrap_or(e).to_string(),
                    Ok(()) => "a path, or none".to_string(),
                };
                (k, said)
            })
            .collect()
    }

    /// The knobs whose values differ from [`VmConfig::default`].
    pub fn non_default_knobs(&self) -> Vec<(&'static str, String)> {
        let base = VmConfig::default().knobs();
        self.knobs().into_iter().filter(|kv| !base.contains(kv)).collect()
    }

    /// Check the configuration; [`Vm::new`](crate::Vm::new) calls this.
    pub fn validate(&self) -> Result<()> {
        let frames = self.phys_bytes / crate::PAGE_SIZE;
        if frames < 16 {
            return Err(Error::Config { reason: "phys_bytes must hold at least 16 frames", value: self.phys_bytes });
        }
        if frames > u32::MAX as u64 - 1 {
            return Err(Error::Config {
                reason: "phys_bytes too large (at most 2^32-2 frames)",
                value: self.phys_bytes,
            });
        }
        if self.cpus == 0 || self.cpus > MAX_CPUS {
            return Err(Error::Config { reason: "cpus must be in 1..=1024", value: self.cpus as u64 });
        }
        if self.pcpu_pages > MAX_PCPU_PAGES {
            return Err(Error::Config { reason: "pcpu_pages must be at most 4096", value: self.pcpu_pages as u64 });
        }
        if !self.view_fault_around.is_power_of_two() || self.view_fault_around > 512 {
            return Err(Error::Config {
                reason: "view_fault_around must be a power of two from 1 to 512",
                value: self.view_fault_around as u64,
            });
        }
        if self.zero_ahead > MAX_PCPU_PAGES {
            return Err(Error::Config { reason: "zero_ahead must be at most 4096", value: self.zero_ahead as u64 });
        }
        if self.pcpu_fill > self.pcpu_pages {
            return Err(Error::Config { reason: "pcpu_fill cannot exceed pcpu_pages", value: self.pcpu_fill as u64 });
        }
        if self.pcpu_drain > self.pcpu_pages {
            return Err(Error::Config { reason: "pcpu_drain cannot exceed pcpu_pages", value: self.pcpu_drain as u64 });
        }
        if self.swap.is_some() && !self.page_daemon {
            return Err(Error::Config { reason: "swap needs the page daemon (page_daemon=true)", value: 0 });
        }
        if self.swap.is_some() && self.rmap == Rmap::PvEntry {
            // The daemon unmaps through backing records; a fault adds its pv
            // entry after its BLOCKED check, which a pv walk would miss.
            return Err(Error::Config { reason: "swap needs rmap=backing (the pv baseline has no pageout)", value: 0 });
        }
        if self.swap.is_some() && self.swap_bytes != 0 && self.swap_bytes < crate::PAGE_SIZE {
            return Err(Error::Config { reason: "swap_bytes must hold at least one page", value: self.swap_bytes });
        }
        if self.free_target >= frames {
            return Err(Error::Config {
                reason: "free_target must be below the number of frames",
                value: self.free_target,
            });
        }
        if self.pcpu_drain_hz > 100_000 {
            return Err(Error::Config {
                reason: "pcpu_drain_hz must be at most 100000",
                value: self.pcpu_drain_hz.into(),
            });
        }
        Ok(())
    }

    /// The per-CPU cache sizes, with the defaults (OpenBSD's) filled in.
    /// Bytes of the swap file (`swap_bytes`, 0: twice `phys_bytes`).
    pub(crate) fn swap_bytes(&self) -> u64 {
        if self.swap_bytes == 0 { self.phys_bytes.saturating_mul(2) } else { self.swap_bytes }
    }

    pub(crate) fn pcp(&self) -> crate::phys::PcpConfig {
        let capacity = self.pcpu_pages;
        let drain = if self.pcpu_drain == 0 { capacity } else { self.pcpu_drain };
        // Auto: up to the vCPU's share of memory (a cap, not a reservation:
        // caches that hold more than the global list can spare are drained).
        let share = (self.phys_bytes / crate::types::PAGE_SIZE) as usize / self.cpus.max(1);
        let max = match self.pcpu_high {
            PcpHigh::Fixed => capacity,
            PcpHigh::Auto if capacity > 0 => share.max(capacity),
            PcpHigh::Auto => 0,
        };
        let fill = match (self.pcpu_fill, self.pcpu_high) {
            // A run of consecutive frames, the cache growing to hold it.
            (0, PcpHigh::Auto) if capacity > 0 => RUN_FRAMES.min(max),
            (0, _) => capacity.saturating_sub(1).max(1).min(capacity),
            (n, _) => n.min(capacity),
        };
        crate::phys::PcpConfig { capacity, fill, drain, max }
    }
}

fn parse_num(v: &str) -> std::result::Result<u64, &'static str> {
    v.trim().parse::<u64>().map_err(|_| "expected a non-negative integer")
}

fn parse_usize(v: &str) -> std::result::Result<usize, &'static str> {
    usize::try_from(parse_num(v)?).map_err(|_| "too large")
}

fn parse_size(v: &str) -> std::result::Result<u64, &'static str> {
    let v = v.trim();
    let (digits, shift) = match v.chars().last() {
        Some('k' | 'K') => (&v[..v.len() - 1], 10),
        Some('m' | 'M') => (&v[..v.len() - 1], 20),
        Some('g' | 'G') => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    let n = parse_num(digits).map_err(|_| "expected a size in bytes, optionally with a K, M or G suffix")?;
    n.checked_mul(1 << shift).ok_or("size overflows 64 bits")
}

fn parse_bool(v: &str) -> std::result::Result<bool, &'static str> {
    match v.trim() {
        "true" | "on" | "1" | "yes" => Ok(true),
        "false" | "off" | "0" | "no" => Ok(false),
        _ => Err("expected true or false"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_and_list() {
        let mut c = VmConfig::default();
        c.set("fault_path", "vmalock").unwrap();
        assert_eq!(c.fault_path, FaultPath::VmaLock);
        let e = c.set("fault_path", "fast").unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert_eq!(e.to_string(), "VmConfig::set(fault_path=\"fast\"): expected maplock, spf or vmalock");
        c.set("fault_path", "spf").unwrap();
        c.set("phys_bytes", "64M").unwrap();
        c.set("cpus", "8").unwrap();
        assert_eq!(c.phys_bytes, 64 << 20);
        assert_eq!(c.cpus, 8);
        let nd = c.non_default_knobs();
        assert_eq!(nd, vec![("phys_bytes", (64u64 << 20).to_string()), ("cpus", "8".to_string())]);
        assert!(c.set("nope", "1").is_err());
        assert!(c.set("prefault", "maybe").is_err());
        assert!(c.set("phys_bytes", "99999999999999999999G").is_err());
    }

    #[test]
    fn lifecycle_sets_the_seven_knobs_of_a_page_life() {
        let mut c = VmConfig::default();
        c.set("lifecycle", "baseline").unwrap();
        let baseline = [
            ("pcpu_high", "fixed".to_string()),
            ("free_path", "sync".to_string()),
            ("frame_order", "lifo".to_string()),
            ("map_lock", "global".to_string()),
            ("reuse_zeroed", "false".to_string()),
            ("zero_stores", "cached".to_string()),
            ("zero_ahead", "0".to_string()),
        ];
        assert_eq!(c.non_default_knobs(), baseline.to_vec());
        c.set("lifecycle", "sync").unwrap();
        assert_eq!((c.frame_order, c.pcpu_high, c.free_path), (FrameOrder::Ordered, PcpHigh::Auto, FreePath::Sync));
        c.set("lifecycle", "deferred").unwrap();
        assert_eq!((c.frame_order, c.pcpu_high, c.free_path), (FrameOrder::Ordered, PcpHigh::Auto, FreePath::Deferred));
        assert!(c.non_default_knobs().is_empty());
        c.set("lifecycle", "baseline").unwrap();
        c.set("lifecycle", "default").unwrap();
        assert!(c.non_default_knobs().is_empty());
        let e = c.set("lifecycle", "fast").unwrap_err();
        assert_eq!(e.to_string(), "VmConfig::set(lifecycle=\"fast\"): expected baseline, sync, default or deferred");
    }

    #[test]
    fn knob_values_name_every_knob_and_each_named_value_is_taken() {
        let help = VmConfig::knob_values();
        let names: Vec<&str> = help.iter().map(|(k, _)| *k).collect();
        for (k, _) in VmConfig::default().knobs() {
            assert!(names.contains(&k), "{k} missing from knob_values");
        }
        for (k, said) in &help {
            assert!(!said.is_empty(), "{k}: no description");
            // An enumeration ("a, b or c"): each value named is taken.
            let words: Vec<&str> = said.split([',', ' ']).filter(|w| !w.is_empty() && *w != "or").collect();
            let listed =
                said.contains(" or ") && words.iter().all(|w| w.chars().all(|c| c.is_ascii_lowercase() || c == '_'));
            for v in words.iter().filter(|_| listed) {
                VmConfig::default().set(k, v).unwrap_or_else(|e| panic!("{k}={v}, which knob_values names: {e}"));
            }
        }
        assert!(help.iter().any(|(k, v)| *k == "fault_path" && v == "maplock, spf or vmalock"), "{help:?}");
    }

    #[test]
    fn validate_rejects_nonsense() {
        assert!(VmConfig { cpus: 0, ..VmConfig::default() }.validate().is_err());
        assert!(VmConfig { phys_bytes: 4096, ..VmConfig::default() }.validate().is_err());
        assert!(VmConfig::default().validate().is_ok());
        assert!(VmConfig { pcpu_pages: 8, pcpu_fill: 9, ..VmConfig::default() }.validate().is_err());
        assert!(VmConfig { pcpu_pages: 8, pcpu_drain: 9, ..VmConfig::default() }.validate().is_err());
        let fixed = VmConfig { pcpu_high: PcpHigh::Fixed, ..VmConfig::default() };
        let seed = fixed.pcp();
        assert_eq!((seed.capacity, seed.fill, seed.drain), (16, 15, 16));
        let even = VmConfig { pcpu_fill: 8, pcpu_drain: 8, ..fixed.clone() }.pcp();
        assert_eq!((even.fill, even.drain), (8, 8));
        let one = VmConfig { pcpu_pages: 1, ..fixed.clone() }.pcp();
        assert_eq!((one.fill, one.drain), (1, 1));
        // Auto: a run, as long as the vCPU's share of memory allows.
        let auto = VmConfig::default().pcp();
        assert_eq!((auto.capacity, auto.fill, auto.drain), (16, RUN_FRAMES, 16));
        let small = VmConfig { phys_bytes: 1 << 20, cpus: 4, ..VmConfig::default() }.pcp();
        assert_eq!(small.fill, 64, "a quarter of 256 frames");
        let today = VmConfig { pcpu_fill: 15, ..VmConfig::default() }.pcp();
        assert_eq!(today.fill, 15);
    }
}
