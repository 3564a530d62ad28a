//! Statistics: per-vCPU event counters summed on read, plus gauges computed
//! when [`Vm::stats`](crate::Vm::stats) is called.
//!
//! A counter lives in its vCPU's slot and is written only by the thread that
//! holds that slot (`[o]`), with a plain load and store of a relaxed atomic:
//! no locked instruction, no cache line shared between vCPUs. Readers sum
//! the slots; a sum taken while vCPUs run is a snapshot, exact once they stop.
//!
//! Names follow the mechanisms' own where they name something (`spf_*` from the
//! speculative page fault series, `pcp_*` from OpenBSD's per-CPU caches).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! stats {
    (
        gauges { $($g:ident : $gdesc:literal,)* }
        counters { $($c:ident : $cdesc:literal,)* }
    ) => {
        /// A per-vCPU event counter.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        pub enum Counter {
            $(#[doc = $cdesc] $c,)*
        }

        impl Counter {
            /// Every counter, in display order.
            pub const ALL: &'static [Counter] = &[$(Counter::$c,)*];
            /// How many counters there are.
            pub const COUNT: usize = [$(Counter::$c,)*].len();

            /// The counter's name (also its field in [`Stats`]).
            pub fn name(self) -> &'static str {
                match self { $(Counter::$c => stringify!($c),)* }
            }

            /// What the counter counts.
            pub fn description(self) -> &'static str {
                match self { $(Counter::$c => $cdesc,)* }
            }
        }

        /// A snapshot of a `Vm`'s statistics.
        ///
        /// Gauges describe the state now; counters count events since the
        /// `Vm` was created, summed over all vCPU slots.
        #[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
        pub struct Stats {
            $(#[doc = $gdesc] pub $g: u64,)*
            $(#[doc = $cdesc] pub $c: u64,)*
        }

        impl Stats {
            /// Every value as `(name, value, description)`, gauges first.
            pub fn entries(&self) -> Vec<(&'static str, u64, &'static str)> {
                vec![
                    $((stringify!($g), self.$g, $gdesc),)*
                    $((stringify!($c), self.$c, $cdesc),)*
                ]
            }

            /// A value by name.
            pub fn get(&self, name: &str) -> Option<u64> {
                match name {
                    $(stringify!($g) => Some(self.$g),)*
                    $(stringify!($c) => Some(self.$c),)*
                    _ => None,
                }
            }

            pub(crate) fn add_counters(&mut self, c: &CounterSet) {
                $(self.$c += c.get(Counter::$c);)*
            }

            pub(crate) fn add_shared(&mut self, c: &SharedCounters) {
                $(self.$c += c.get(Counter::$c);)*
            }
        }

        /// One vCPU's counter values.
        #[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
        pub struct CpuCounters {
            $(#[doc = $cdesc] pub $c: u64,)*
        }

        impl CpuCounters {
            pub(crate) fn from_set(c: &CounterSet) -> CpuCounters {
                CpuCounters { $($c: c.get(Counter::$c),)* }
            }

            /// A value by name.
            pub fn get(&self, name: &str) -> Option<u64> {
                match name {
                    $(stringify!($c) => Some(self.$c),)*
                    _ => None,
                }
            }
        }
    };
}

stats! {
    gauges {
        total_pages: "frames of physical memory",
        free_pages: "frames free (global free list and per-CPU caches)",
        global_free_pages: "frames on the global free list",
        pcp_pages: "frames held in per-CPU caches",
        deferred_pages: "frames freed and waiting for their grace period on deferred lists (free_path=deferred; not yet counted free, still counted by kind)",
        deferred_drops: "retired VMA-index snapshots the grace-period thread has still to drop (free_path=deferred; they keep removed mappings' objects alive)",
        pcp_remote_drains: "remote drains of the per-CPU caches that found frames",
        pcp_pages_drained: "frames drained remotely from per-CPU caches",
        daemon_wakeups: "page daemon wakeups (the global free list fell below the free target)",
        daemon_pages_drained: "frames the page daemon drained remotely from per-CPU caches",
        reclaim_scans: "page-daemon passes over the spaces' anonymous pages (swap configured)",
        pageouts: "pages the page daemon wrote to swap and freed",
        pageout_failures: "pageouts abandoned after the page was taken (write error, mapping busy, page gone)",
        swap_write_errors: "writes to the swap file that failed (the page stayed resident)",
        file_pageouts: "file pages the page daemon freed (written back first if dirty; read again on the next fault)",
        daemon_file_writebacks: "dirty file pages the page daemon wrote back before freeing them",
        swap_used_pages: "swap slots holding a page now",
        swap_total_pages: "swap slots in all (0: no swap)",
        swap_bad_slots: "swap slots taken out of use after a failed write",
        active_pages: "pages on the active queue (swap configured; pages in vCPUs' batches not yet)",
        inactive_pages: "pages on the inactive queue: the page daemon's next candidates",
        queue_lock_acquisitions: "acquisitions of the page-queue lock (batches of vCPUs, the daemon)",
        page_table_pages: "frames used as page-table pages",
        index_pages: "frames used as object page-index nodes",
        data_pages: "frames holding data pages of VM objects",
        wired_pages: "data pages wired now, once or more (mlock, page holds, a pageout in progress): never reclaimed",
        global_lock_acquisitions: "acquisitions of the global free-list lock",
        global_frames_moved: "frames taken from or given to the global free list (monotonic)",
        cpus_attached: "vCPU slots attached to a thread now",
        rmap_bytes: "bytes of reverse-map metadata (backing records and links, or pv entries)",
        backing_records: "backing records: mappings of object ranges (rmap=backing)",
        pv_entries: "pv entries: PTEs that map a data page (rmap=pv)",
        max_chain_depth: "longest object chain under any mapping (1: no shadow objects)",
    }
    counters {
        faults: "page faults handled (every outcome)",
        spf: "faults completed speculatively, without the map lock",
        spf_vma_changed: "speculative faults aborted: the VMA changed or went away",
        spf_vma_noanon: "speculative faults aborted: the VMA had no object yet",
        spf_vma_notsup: "speculative faults aborted: a case the speculative path does not handle",
        spf_vma_access: "speculative faults aborted: the VMA does not allow the access",
        spf_pmd_changed: "speculative faults aborted: page-table levels missing",
        spf_nomem: "speculative faults aborted: no frame without draining other vCPUs' caches",
        vma_lock: "faults completed under a per-VMA read lock",
        vma_lock_fallbacks: "per-VMA-lock faults that fell back to the map lock",
        pcp_hit: "frame allocations served by the vCPU's own cache",
        pcp_miss: "frame allocations that refilled the vCPU's cache from the global list",
        frame_allocs: "frames allocated by the vCPU (data, page-table and index frames)",
        frames_adjacent: "frame allocations next to the vCPU's previous one (zeroing runs at memory speed over consecutive frames)",
        zeroings_skipped: "frames handed out zeroed without zeroing them: they were known to hold zeros (reuse_zeroed, zero_ahead)",
        zeroings_streamed: "faults' frames zeroed with streaming stores, but for the faulting line (zero_stores)",
        zeroed_ahead: "free frames of a vCPU's cache zeroed ahead of their faults, fenced with a fault's own (zero_ahead)",
        zero_fill: "faults that allocated and zeroed a new page",
        host_view_faults: "accesses through a host view that came to vmfault (a signal, or a populate) to map a page there",
        host_view_ns: "nanoseconds host-view faults spent in vmfault once the signal was taken (fault path and host mapping)",
        host_view_map_ns: "of those, nanoseconds in the host call that maps the frame into the view",
        zero_page_maps: "read faults satisfied by mapping the shared zero page",
        page_maps: "faults that mapped a page already resident in its object",
        write_upgrades: "write faults that only made an existing PTE writable",
        cow_faults: "write faults that copied a page shared with the other side of a fork",
        fault_races: "faults that found the PTE already installed by another vCPU",
        anon_races: "faults that made an object for a VMA another fault gave one first (the loser's is dropped)",
        segv: "faults that ended in SIGSEGV",
        sigbus: "faults that ended in SIGBUS (a file page wholly beyond the end of the file)",
        file_fills: "file pages read into the page cache",
        pageins: "pages read back from swap by faults",
        alloc_stalls: "allocations that found no free frame and waited for the page daemon",
        file_writebacks: "dirty file pages written back to their file",
        file_write_errors: "write-backs of dirty file pages that failed, by the page daemon or at munmap and a space's end (the pages stay dirty; msync reports its own)",
        rmap_walks: "reverse-map walks (finding every PTE that maps a page)",
        wirings: "pages wired (mlock, page holds)",
        page_lock_acquisitions: "page-lock acquisitions (refcount=pagelock only)",
        mlock_calls: "mlock calls",
        munlock_calls: "munlock calls",
        fault_nomem: "faults that failed for lack of frames",
        map_lock_acquisitions: "address-space map lock acquisitions (read or write)",
        map_lock_writes: "address-space map lock acquisitions for writing",
        placement_detours: "mmaps that found a zone of Linux's address held by another change and looked below it (map_lock=zoned)",
        placement_home: "unhinted mmaps placed in their vCPU's own zone below Linux's, another change being in flight (map_lock=zoned)",
        pte_lock_contended: "PTE lock acquisitions that had to wait",
        pte_lock_try_failures: "PTE lock try-locks that failed",
        tlb_shootdowns: "grace periods (polled, or waited for) after clearing or narrowing PTEs, before the call returns or its frames are reused",
        caller_grace_waits: "grace periods a vCPU waited for inside an operation (shootdowns, drains, reclaim of old snapshots)",
        mmap_calls: "mmap calls",
        munmap_calls: "munmap calls",
        mremap_calls: "mremap calls",
        stack_growths: "faults that grew a stack (MAP_GROWSDOWN) down to their address",
        mprotect_calls: "mprotect calls",
        madvise_calls: "madvise calls",
        pages_unmapped: "PTEs cleared by munmap, madvise and mprotect(PROT_NONE)",
        forks: "address spaces forked",
        shadow_collapses: "backing objects absorbed by their one remaining shadow object",
        data_pages_made: "frames that became data pages of VM objects (published in an object's index)",
        data_pages_freed: "data pages freed, past their grace period",
        table_pages_made: "frames that became page-table pages",
        table_pages_freed: "page-table pages freed, past their grace period",
        index_pages_made: "frames that became object page-index nodes",
        index_pages_freed: "object page-index nodes freed, past their grace period",
        pages_wired: "pages that went from no wiring to one (mlock, page holds, the daemon's own)",
        pages_unwired: "pages whose last wiring went",
    }
}

impl Stats {
    /// The values that have an equivalent in Linux's `/proc/vmstat`, under
    /// its names, for tools and readers used to them (vmfault's own names,
    /// in [`entries`](Stats::entries), stay the reference):
    ///
    /// | `/proc/vmstat` | here |
    /// |---|---|
    /// | `nr_free_pages` | `free_pages` |
    /// | `nr_page_table_pages` | `page_table_pages` |
    /// | `pgfault` | `faults` |
    /// | `pgmajfault` | `file_fills` + `pageins` (faults that read a page in) |
    /// | `pswpin` | `pageins` |
    /// | `pswpout` | `pageouts` |
    /// | `pgalloc_normal` | `frame_allocs` (data, page-table and index frames) |
    /// | `allocstall_normal` | `alloc_stalls` |
    /// | `pgsteal_kswapd` | `pageouts` + `file_pageouts` (pages the daemon reclaimed) |
    /// | `nr_vmscan_write` | `pageouts` + `daemon_file_writebacks` |
    /// | `pgfree` | `data_pages_freed` + `table_pages_freed` + `index_pages_freed` |
    ///
    /// `pgfree` here counts the frees of frames that were published (data
    /// pages, page-table pages, index nodes), not those of frames taken
    /// back before anyone saw them (a fault that lost a race for its slot).
    ///
    /// ```
    /// use vmfault::{MapFlags, Prot, Vm, VmConfig};
    /// let vm = Vm::new(VmConfig { phys_bytes: 8 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let a = space.mmap(0, 4 << 12, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// space.write(a, &[1; 4 << 12])?;
    /// let vmstat = vm.stats().vmstat();
    /// let pgfault = vmstat.iter().find(|(name, _)| *name == "pgfault").unwrap().1;
    /// assert_eq!(pgfault, 4);
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn vmstat(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("nr_free_pages", self.free_pages),
            ("nr_page_table_pages", self.page_table_pages),
            ("pgfault", self.faults),
            ("pgmajfault", self.file_fills + self.pageins),
            ("pswpin", self.pageins),
            ("pswpout", self.pageouts),
            ("pgalloc_normal", self.frame_allocs),
            ("allocstall_normal", self.alloc_stalls),
            ("pgsteal_kswapd", self.pageouts + self.file_pageouts),
            ("nr_vmscan_write", self.pageouts + self.daemon_file_writebacks),
            ("pgfree", self.data_pages_freed + self.table_pages_freed + self.index_pages_freed),
        ]
    }
}

/// The page daemon's statistics (`reclaim`), in the machine; each `[a]`,
/// written by the daemon (and by a file's write-back on its behalf), read
/// by `Vm::stats`.
#[derive(Debug, Default)]
pub(crate) struct DaemonStats {
    /// `[a]` wakeups the daemon handled.
    pub(crate) wakeups: AtomicU64,
    /// `[a]` frames the daemon drained from per-CPU caches.
    pub(crate) drained: AtomicU64,
    /// `[a]` passes over the spaces' anonymous pages.
    pub(crate) scans: AtomicU64,
    /// `[a]` pages written to swap and freed.
    pub(crate) pageouts: AtomicU64,
    /// `[a]` pageouts abandoned once the page was taken.
    pub(crate) failures: AtomicU64,
    /// `[a]` failed writes to the swap file.
    pub(crate) write_errors: AtomicU64,
    /// `[a]` file pages the daemon freed (written back first if dirty).
    pub(crate) file_pageouts: AtomicU64,
    /// `[a]` of those, dirty ones it wrote back.
    pub(crate) file_writebacks: AtomicU64,
}

/// The counters of one vCPU slot (`[o]`: written by the slot's owner only).
#[derive(Debug)]
pub(crate) struct CounterSet {
    /// `[o]` inline, not on the heap: the set lives in its vCPU's padded slot, so
    /// no other vCPU's counters share its cache lines.
    values: [AtomicU64; Counter::COUNT],
    /// `[o]` the frame the vCPU allocated last (for `frames_adjacent`).
    last_frame: AtomicU64,
}

impl CounterSet {
    pub(crate) fn new() -> CounterSet {
        CounterSet { values: std::array::from_fn(|_| AtomicU64::new(0)), last_frame: AtomicU64::new(0) }
    }

    /// Count an allocation of frame `pfn`, and whether it is next to the
    /// previous one. Only the slot's owner calls this.
    #[inline]
    pub(crate) fn note_frame(&self, pfn: u64) {
        let last = self.last_frame.load(Ordering::Relaxed);
        self.last_frame.store(pfn, Ordering::Relaxed);
        self.inc(Counter::frame_allocs);
        if pfn.abs_diff(last) == 1 {
            self.inc(Counter::frames_adjacent);
        }
    }

    /// Add `n` to counter `c`. Only the slot's owner calls this.
    #[inline]
    pub(crate) fn add(&self, c: Counter, n: u64) {
        let v = &self.values[c as usize];
        // Single writer: load + store, no locked instruction.
        v.store(v.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    }

    /// Add one to counter `c`.
    #[inline]
    pub(crate) fn inc(&self, c: Counter) {
        self.add(c, 1);
    }

    /// Read counter `c` (a snapshot).
    pub(crate) fn get(&self, c: Counter) -> u64 {
        self.values[c as usize].load(Ordering::Relaxed)
    }
}

/// Counters of work done outside any vCPU slot (the page daemon, the
/// grace-period thread, set-up), which several threads add to (`[a]`: a
/// locked add, on paths that run once per batch, not per page).
#[derive(Debug)]
#[repr(align(128))] // on lines of its own, apart from the structure around it
pub(crate) struct SharedCounters {
    /// `[a]` relaxed adds and loads: counts, which order nothing.
    values: [AtomicU64; Counter::COUNT],
}

impl SharedCounters {
    pub(crate) fn new() -> SharedCounters {
        SharedCounters { values: std::array::from_fn(|_| AtomicU64::new(0)) }
    }

    /// Add `n` to counter `c`.
    pub(crate) fn add(&self, c: Counter, n: u64) {
        if n != 0 {
            self.values[c as usize].fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Read counter `c` (a snapshot).
    pub(crate) fn get(&self, c: Counter) -> u64 {
        self.values[c as usize].load(Ordering::Relaxed)
    }
}

/// The counters of one vCPU slot, for per-vCPU views like `vmfault top`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CpuStats {
    /// Slot index (`cpus` is the shared slot of unattached threads).
    pub cpu: usize,
    /// Whether a thread is attached to the slot now.
    pub attached: bool,
    /// The slot's counters.
    pub counters: CpuCounters,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_lookup() {
        let set = CounterSet::new();
        set.inc(Counter::faults);
        set.add(Counter::zero_fill, 3);
        let mut s = Stats::default();
        s.add_counters(&set);
        s.add_counters(&set);
        assert_eq!(s.faults, 2);
        assert_eq!(s.get("zero_fill"), Some(6));
        assert_eq!(s.get("nonsense"), None);
        assert_eq!(Counter::faults.name(), "faults");
        let names: Vec<_> = s.entries().iter().map(|e| e.0).collect();
        assert!(names.contains(&"free_pages") && names.contains(&"pte_lock_contended"));
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["faults"], 2);
    }
}
