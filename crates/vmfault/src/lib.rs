//! # vmfault: a multiprocessor virtual-memory subsystem in user space
//!
//! Physical frames, address spaces, VM objects, 4-level software page
//! tables and a page-fault path, built the way kernels build them for many
//! CPUs, in one process, with Linux's semantics. Embed it as the memory
//! manager of an emulator, a sandbox or a user-space kernel (one thread per
//! vCPU), or use it to prototype and measure fault-path designs.
//!
//! A [`Vm`] is one machine: its frames, the vCPU slots, the page daemon,
//! the statistics. Many can live in one process: there are no globals. A
//! thread that calls [`Vm::attach`] is a vCPU until the guard drops, and
//! its per-CPU data (page cache, counters) is touched by it alone, as a
//! kernel's is with preemption disabled; a thread that is not attached can
//! still call every method, through a shared slot held for one operation.
//!
//! ```
//! use vmfault::{Vm, VmConfig, Prot, MapFlags, Access};
//! let vm = Vm::new(VmConfig { phys_bytes: 64 << 20, cpus: 4, ..VmConfig::default() })?;
//! let _cpu = vm.attach()?; // this thread is a vCPU until `_cpu` drops
//! let space = vm.new_space()?;
//! let a = space.mmap(0, 1 << 20, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
//! space.write(a + 10, b"hello")?;
//! let mut buf = [0u8; 5];
//! space.read(a + 10, &mut buf)?;
//! assert_eq!(&buf, b"hello");
//! assert_eq!(space.fetch_add_u64(a + 16, 1)?, 0); // guest atomics: `lock xadd`, `cmpxchg`, `xchg`
//! space.touch(a + 8192, Access::Write)?; // one fault, like a single store
//! space.munmap(a, 1 << 20)?;
//! assert_eq!(vm.stats().faults, 2);
//! # Ok::<(), vmfault::Error>(())
//! ```
//!
//! ## How to find your way
//!
//! | to read | start at |
//! |---|---|
//! | a fault, from the access to the PTE | `aspace/access.rs` (the software MMU: walk, miss) -> `fault/mod.rs` (`handle_looked` picks the path) -> `fault/speculative.rs`, `fault/vma_lock.rs` (both through `fault/lockless.rs`) or `fault/classic.rs` -> `fault/resolve.rs` (`new_page`, `commit_locked`, shared by all three) -> `object/mod.rs` (`reserve`, `insert`) and `pmap/table.rs` |
//! | the lock order and the lock tags | below, in this file; each field's tag in its doc comment |
//! | the frame protocol (owned, published, freed after a grace period) | `phys/mod.rs` (its three rules), `phys/page.rs` (frame kinds) |
//! | a page's life: allocation, order, freeing | `phys/pcpu.rs` (`Frames::alloc`), `phys/freelist.rs`, `phys/deferred.rs` (`free_path=deferred`) |
//! | address-space changes | one file per call in `aspace/` (`mmap.rs`, `munmap.rs`, ...); the VMA index and its RCU snapshot in `aspace/vma.rs`, `aspace/ptree.rs`, `aspace/mod.rs` (`MapWrite`); per-thread spare VMA records and index nodes (no heap allocation per mmap and munmap) in `aspace/spares.rs`; guest atomics (compare-exchange, fetch-add, swap) in `aspace/atomic.rs` |
//! | per-CPU page caches (OpenBSD) | `phys/pcpu.rs` over `sync/percpu.rs` |
//! | remote drain of per-CPU lists by RCU (Linux) | `sync/percpu.rs` (`drain_all`), `sync/rcu.rs`, the daemon in `reclaim/mod.rs` |
//! | speculative faults and per-VMA locks (Linux) | `fault/speculative.rs`, `fault/vma_lock.rs`, the VMA state word in `sync/vma_state.rs` |
//! | atomic page reference counts (FreeBSD) | `sync/refcount.rs`, `phys/wiring.rs` |
//! | reverse mapping without pv entries (DragonFly) | `object/rmap.rs`, `aspace/rmap.rs` (backing records; `rmap=pv` for comparison) |
//! | swap and the page daemon | `reclaim/`, `phys/queues.rs`, `object/swap.rs` |
//! | the machine and one operation's vCPU context | `machine.rs` (`Machine`, `Ctx`), `object/env.rs` (the objects' part: `Env`, `Cx`), `vm.rs` (`Vm::new`, the machine's threads) |
//! | native loads and stores: host views | `aspace/view.rs` (`HostView`, `Space::resolve_run`), `phys/window.rs` (the windows, the `SIGSEGV` handler), `pmap/table.rs` (`SecondMmu`, `Pmap::install_locked`, `update_range`: every lost frame or right is invalidated there) |
//! | every knob | `config.rs` (`VmConfig`); counters in `stats.rs` |
//! | the layer order | the table below; `tests/layering.rs` fails on any import of a higher layer |
//!
//! ## Architecture
//!
//! | layer | module | what |
//! |---|---|---|
//! | stats | [`stats`] | per-vCPU counters summed on read |
//! | sync | `sync` | our RCU with blocking and polled grace periods, vCPU slots, per-vCPU magazines with remote drain, the VMA state word (SPF sequence and per-VMA lock), the PTE word lock, the page reference count (FreeBSD), the loom shim |
//! | phys | `phys` | frame arena, 64-byte page descriptors, the global free list, per-CPU page caches, deferred frees, page queues, the page daemon's doorbell, the frame protocol |
//! | swapdev | `swapdev` | the swap device: page-sized slots in a host file (a leaf: it knows nothing of frames or objects) |
//! | pmap | `pmap` | frame-backed radix trees: page tables (PTE locks, zap, protect, prune) and object indexes |
//! | object | `object` | VM objects owning pages by index (private and shared anonymous), shadow chains for copy-on-write after `fork`; `object::Env`, what objects need of their machine, and `object::Cx`, their part of a vCPU's context |
//! | machine | `machine` | the `Machine` (the objects' `Env` plus the vCPU slots, the registry of address spaces, orphaned pages), `Ctx` (one operation's vCPU), the handles `Vm` and `Handle` (their methods in `vm`) |
//! | aspace | `aspace` | [`AddressSpace`]: VMA index (and its RCU snapshot), one file per operation, the software MMU |
//! | fault | `fault` | the fault path: classic (map lock), speculative, per-VMA lock; anonymous-page resolution shared by all three |
//! | reclaim | `reclaim` | the page daemon: wakes below the free target, drains per-CPU caches remotely, ages the page queues, pages anonymous memory out to swap |
//! | vm | `vm` | [`Vm`]'s methods: building a machine (its threads: the page daemon, the grace-period thread), attaching vCPUs, statistics |
//!
//! Layers import downward only, with no exception (types, error and stats
//! at the bottom, config and swapdev just above phys, machine just above
//! object, reclaim just below vm): `tests/layering.rs` reads every
//! `crate::` path and fails on an import of a higher layer. The context
//! every layer above the objects reaches (`machine::Ctx`, `Machine`) sits
//! just above them; the objects see only their own part of it.
//!
//! The crate denies `unsafe_code`. Five files of `sync` and `phys` hold
//! unsafe code (`phys/arena.rs`, `phys/mod.rs`, `sync/cpu.rs`,
//! `sync/percpu.rs`, `sync/rcu.rs`), and each item there that holds an
//! unsafe block allows it on itself, the block with its `// SAFETY:`
//! argument: a new unsafe block anywhere else fails to build.
//!
//! ## The protocols
//!
//! Each concurrency protocol is written up where it is implemented (the
//! module essay: how and why), and has a loom model in `tests/loom_*.rs`
//! that passes, and that fails when the fence or check it depends on is
//! removed (`mutated!`: a `vmfault_mutation` cfg, or in loom builds
//! `VMFAULT_LOOM_MUTATION` at run time; each model names the mutations it
//! must fail under with `sync::fails_under`, and `.ci/run` runs every pair). The
//! numbers are the ones other docs use.
//!
//! | # | protocol | essay | model |
//! |---|---|---|---|
//! | 1 | per-CPU page caches (OpenBSD): a vCPU owns a magazine of frames; a miss takes a batch from the global list with one lock acquisition, a full magazine gives one back; fill and drain sizes are knobs | `phys/pcpu.rs` | `loom_pcpu` |
//! | 2 | remote drain (Linux): a drainer swaps in an empty spare, waits for a grace period, then owns and empties the old magazine; the owner's use is an RCU read-side section, so an idle vCPU is quiescent without doing anything | `sync/percpu.rs`, `sync/rcu.rs` | `loom_pcpu`, `loom_rcu` |
//! | 3 | speculative faults (Linux SPF): the VMA looked up under RCU in a published snapshot of the index, validated by its state word, the PTE installed under a try-locked PTE lock after a re-check; any change aborts to the classic path, with the reason counted; the software MMU's walk (fresh, or a vCPU's leaf hint kept from an earlier section) is used only while the page table's prune count has not moved | `fault/speculative.rs`, `sync/vma_state.rs`, `sync/generation.rs`, `pmap/table.rs` (`LeafHint`) | `loom_spf` |
//! | 4 | the per-VMA lock (Linux's successor to SPF): the same lookup, then a per-VMA read lock (a pin in the reader's RCU slot) held for the fault; a writer retires the VMA and waits for the pins | `fault/vma_lock.rs`, `sync/vma_state.rs` | `loom_spf` |
//! | 5 | atomic page reference counts (FreeBSD): wirings, the object's reference and a BLOCKED bit in one word; a wiring of a mapped page fails while BLOCKED, and removal blocks new wirings; a hashed page-lock baseline for comparison | `sync/refcount.rs`, `phys/wiring.rs` | `loom_refcount` |
//! | 6 | reverse mapping without pv entries (DragonFly): one backing record per mapping of an object range; a page's mappings are found through its object's records (pv entries, one per page per mapping, for comparison) | `object/rmap.rs`, `aspace/rmap.rs` | - |
//! | 7 | grace periods: blocking (`synchronize`), polled a step at a time (`poll`), per-page pins; frames freed after one, by the caller or from a deferred list | `sync/rcu.rs`, `phys/mod.rs` (the frame protocol), `phys/deferred.rs` | `loom_rcu` |
//! | 8 | copy-on-write chains and write-back: a shadow object's entries published before its backing's are moved; dirty pages write-protected before they are copied out | `object/shadow.rs`, `object/file.rs` | `loom_shadow`, `loom_writeback` |
//! | 9 | zoned map locks: a VMA is in the index of every 512 GiB zone it touches; a change locks, in address order, the zones of its range and of every VMA it touches (widening and retrying if a VMA reaches further than the zones it locked); an unhinted mmap searches the zones' snapshots, then try-locks and re-checks, and goes below a busy zone | `aspace/zones.rs` | - (`tests/zones.rs`, the differential tests across a zone edge) |
//!
//! ## Lock order (outer to inner)
//!
//! Every lock class, with its letter (the letters of the lock tags below);
//! a lock may be taken while holding only locks above it on its path. The
//! classes are `sync::rank::Rank`, which debug builds check.
//!
//! ```text
//! shared vCPU slot [C]                (an unattached thread's claim of the shared slot, for
//! │                                    one operation; held around everything it does)
//! └── heap lock [H]                   (one per space: brk, and fork around its copy)
//!     └── address-space map lock [M]      (RwLock; classic faults read, changes write; with
//!         │                                map_lock=zoned one per zone, taken in address order)
//!         ├── VMA read lock [V]           (VmaLock faults: a pin in the vCPU's RCU slot; a writer
//!         │   │                            retires the VMA under [M] and waits for the pins)
//!         │   └── PTE lock [P]
//!         └── file registry [R]           (finding or creating a file's object; its end leaves it)
//!             └── object lock [O]         (a shadow-chain collapse: the absorbing level's, then
//!                 │                        the absorbed one's; under the map lock, top-down;
//!                 │                        a page-in, around its read of the swap slot)
//!                 ├── per-CPU drain lock [D] (one drain of every cache at a time, held around
//!                 │   │                    its grace period, until the frames are placed)
//!                 │   └── free-list lock [F]
//!                 └── PTE lock [P]        (one word per page-table page; speculative
//!                     │                    faults only try-lock it, holding nothing else)
//!                     ├── page lock [K]   (refcount=pagelock only: one of 256 hashed words,
//!                     │   │                held around a wiring or queue change)
//!                     │   └── page-queue lock [Q] (swap only: a vCPU applying its full batch of
//!                     │                    new pages, the daemon, a free path; nothing inside)
//!                     └── free-list lock [F] (nothing inside)
//!
//! leaves [L]                          (taken under any of the above, nothing inside: the
//!                                      retired-snapshot and deferred-list mutexes, the space
//!                                      and anonymous-object registries, the orphan list, the
//!                                      swap slot map, an object's reverse-map mutex, the pv
//!                                      lists, a file object's recent-files, writer and
//!                                      write-back mutexes, the daemon's doorbell, the RCU's
//!                                      poll mutex, only ever try-locked; the depots of
//!                                      spare VMA records and index nodes)
//! ```
//!
//! Debug builds check this order as locks are taken (`sync::rank`: each
//! thread keeps the ranks it holds, and taking a lock of an earlier rank,
//! of its own rank where that does not nest, or anything under a leaf,
//! panics with both). Zones of the map lock nest in address order only,
//! kept by the one function that takes several (`Zones::write`); a
//! writer's wait for the VMA pins counts as taking `[V]`; condition-variable
//! waits keep their lock's rank (`Ranked::wait`).
//!
//! The page daemon (`reclaim`) holds none of these across another: it
//! takes no map lock, only tries object locks, and takes PTE locks one at
//! a time inside an RCU section of its own; the references to spaces and
//! objects it took are dropped by a reaper thread, since the end of a
//! space or a file object takes map locks. So a vCPU that finds no frame
//! may wait for it (`Frames::alloc`, with swap) holding a map lock or an
//! object lock, but never a PTE lock or inside a section. The same holds
//! for the per-CPU caches' drain lock (one drain of every cache at a
//! time, `PerCpuCache::drain_all`), held around a grace period and the
//! free-list lock `[F]` (the drained frames' way onto the list). The
//! daemon's doorbell mutex, the swap slot mutex, the
//! shards of the anonymous object registry and a file object's
//! write-back mutex (`ended`: the `WRITEBACK` bits are cleared under it,
//! and `msync` waits on it for pages another writer has under way, holding
//! no other lock) and the deferred-free lists' mutexes (`phys::deferred`:
//! the frame batches', taken inside a section by a cache miss, and the
//! queued snapshot drops', dropped outside it; never held across a grace
//! period) are leaves, as is the RCU's poll mutex (`Rcu::poll`), which is
//! only ever try-locked.
//!
//! RCU read-side sections are not locks but obey one rule: nothing inside a
//! section waits for a lock that anyone holds while calling `synchronize()`
//! or `wait_unpinned()` (in particular, never the map lock). A vCPU's own
//! per-CPU page cache is not a lock either: it is reached inside a section
//! and swapped out from under it only by a remote drain, which then waits
//! for a grace period (`sync::percpu`).
//!
//! ## Lock tags
//!
//! Every shared field says in its doc comment what protects it
//! (`tests/lock_tags.rs` checks the fields of the structures threads
//! share):
//!
//! | tag | meaning |
//! |---|---|
//! | `[M]` | the address space's map lock (of the zone, with `map_lock=zoned`) |
//! | `[V]` | the VMA's own read lock (`sync::vma_state`) |
//! | `[O]` | the object's lock (or the object's insertion protocol, where noted) |
//! | `[P]` | the PTE lock of the page-table page |
//! | `[F]` | the global free-list lock |
//! | `[Q]` | the page-queue lock (`phys::queues`) |
//! | `[a]` | atomic; the field's doc names the operations it pairs with |
//! | `[o]` | owner vCPU only: written by the thread holding the slot |
//! | `[I]` | immutable after construction |
//! | `[L]` | a lock (or a condition variable waited on under one), or a value inside its own lock: its class is in the lock order above; a field of a struct held inside a lock names that lock |
//! | `[S]` | a structure that synchronizes itself: its own fields carry their tags |
//! | `[T]` | thread-local (`thread_local!`): no other thread reaches it |
//!
//! Two tags combine as in FreeBSD's `vm_page.h`: `[F][a]` is written only
//! with the first held (here the free-list lock), and read with either
//! (here without it, by an atomic load); `[L]` followed by a lock's name in
//! parentheses is a value inside that lock.
//!
//! Functions that need a lock held end in `_locked` and list their
//! preconditions.
//!
//! ## Semantics
//!
//! Linux x86-64 is the oracle: errors (and which check comes first),
//! zero-fill, page rounding, splitting and merging of mappings, SIGSEGV
//! codes. `tests/differential.rs` (and `vmfault check`, for long runs)
//! compares random operation sequences with the host kernel; unknown
//! `MAP_*`/`PROT_*` bits are the one deliberate difference (`EINVAL` here,
//! ignored by Linux's `mmap`; the README lists the known ones). File mappings
//! (`tests/file.rs`) read the real file, write shared pages back on
//! `msync`, `munmap` and the end of the mapping, and raise SIGBUS past the
//! end of the file; their page cache is vmfault's own (see `object/file.rs`
//! for what that changes: `write(2)` to a mapped file is not seen).

#![warn(missing_docs)]
#![deny(unsafe_code)]

mod aspace;
pub mod config;
pub mod error;
mod fault;
mod machine;
/// Whether mutation `$name` (a fence or check removed, for the loom model
/// that guards it to fail: `.ci/run`) is on: `--cfg vmfault_mutation` in
/// every build (`build.rs` sets it from `VMFAULT_MUTATION`), and in loom
/// builds also `VMFAULT_LOOM_MUTATION` read at run time, so that one loom
/// build runs every mutation (a build per mutation took most of CI's
/// loom step). Production builds compile to the constant.
macro_rules! mutated {
    ($name:tt) => {
        cfg!(vmfault_mutation = $name) || $crate::sync::loom_mutation($name)
    };
}
pub(crate) use mutated;

mod object;
mod phys;
mod pmap;
mod reclaim;
pub mod stats;
mod swapdev;
// The synchronization primitives are the crate's own; the loom models in
// `tests/loom_*.rs` (built with `--cfg loom`) are the only users outside it.
#[cfg(loom)]
pub mod sync;
#[cfg(not(loom))]
pub(crate) mod sync;
pub mod types;
mod vm;

pub use aspace::{
    AddressSpace, FileRange, HEAP_START, HostFault, HostFaultHandler, HostView, MAX_MAP_COUNT, MappingUsage, PageHold,
    STACK_GUARD_GAP, STACK_LIMIT,
};
pub use config::{
    FaultPath, FrameOrder, FreePath, MapLock, PcpHigh, Refcount, Rmap, STREAM_AFTER_FRAMES, VmConfig, ZeroStores,
};
pub use error::{Error, Op, Result, SegvCode};
pub use stats::{Counter, CpuStats, Stats};
pub use types::{
    Access, Advice, MMAP_MIN_ADDR, MapFlags, MappingInfo, MremapFlags, MsyncFlags, PAGE_SIZE, Prot, TASK_SIZE,
};
pub use vm::{CpuGuard, Vm};
