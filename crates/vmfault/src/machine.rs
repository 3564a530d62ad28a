//! The machine and the vCPU context of an operation: what every layer
//! above the objects reaches.
//!
//! [`Machine`] is everything a `Vm` owns: the object layer's environment
//! ([`Env`](crate::object::Env): configuration, physical memory, the RCU,
//! the swap device, the registries objects join), which it reaches through
//! `Deref`, and what only the layers above objects use: the vCPU slots, the
//! registry of address spaces, orphaned pages, the stop flag of its
//! threads. [`Ctx`] is one operation's vCPU: the slot the calling thread
//! holds, with the object layer's part of it ([`Cx`](crate::object::Cx))
//! reached through `Deref`. The public handles ([`Vm`], and `Handle`, which
//! address spaces hold) are defined here, their methods in `vm`.
//!
//! The address spaces are registered by id (pv entries and backing records
//! name them so, and statistics list them), type-erased: this layer sits
//! below `aspace`, which stores and reads its `Space`s here
//! (`aspace::Space::registered`, `Space::by_id`).

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::object::{Cx, Env};
use crate::phys::Pfn;
use crate::stats::{Counter, CounterSet};
use crate::sync::cpu::CpuSet;
use crate::sync::rank::{self, Rank};

/// The shared part of a vCPU slot.
#[derive(Debug)]
pub(crate) struct PerCpu {
    /// `[o]` event counters, written by the slot's owner only.
    pub(crate) counters: CounterSet,
}

/// The owner-only part of a vCPU slot (the objects' layer names it, so
/// that their part of the context reaches it through one reference).
pub(crate) use crate::object::SlotOwned as PerCpuOwned;

/// Everything a `Vm` owns, shared by its handles, spaces and threads (the
/// objects hold its [`Env`] only).
#[derive(Debug)]
pub(crate) struct Machine {
    /// `[S]` what objects need, and every layer above through `Deref`
    /// (fields carry their own tags).
    pub(crate) env: Arc<Env>,
    /// `[S]` the vCPU slots.
    pub(crate) cpus: CpuSet<PerCpu, PerCpuOwned>,
    /// `[L]` the live address spaces by id, for pv entries and statistics
    /// (a lock taken when a space is made or dropped, and by readers of
    /// both); each value is an `aspace::Space` (see the module docs).
    pub(crate) spaces: Mutex<HashMap<u64, Weak<dyn Any + Send + Sync>>>,
    /// `[L]` pages whose last reference was a wiring dropped under a PTE lock
    /// (they had left their object while wired): unmapped, waiting for an
    /// operation's grace period to be freed (a lock of its own, innermost).
    pub(crate) orphans: Mutex<Vec<Pfn>>,
    /// `[a]` whether `orphans` may hold any (written under its lock): every
    /// change's `finish` looks, and the lock is shared by all vCPUs.
    pub(crate) orphaned: AtomicBool,
    /// `[a]` set when the user's last handle goes (`Life`): the machine's
    /// threads end.
    pub(crate) stop: AtomicBool,
}

impl std::ops::Deref for Machine {
    type Target = Env;

    #[inline]
    fn deref(&self) -> &Env {
        &self.env
    }
}

impl Machine {
    /// Queue an unmapped page that nothing references for freeing.
    pub(crate) fn orphan(&self, pfn: Pfn) {
        let mut orphans = rank::lock(&self.orphans, Rank::Leaf);
        orphans.push(pfn);
        self.orphaned.store(true, Ordering::Relaxed);
    }

    /// Take the queued orphans (the caller frees them after a grace period).
    pub(crate) fn take_orphans(&self) -> Vec<Pfn> {
        // A queue filled by another vCPU is seen at a later look (each
        // orphan is also taken by its own vCPU's next change).
        if !self.orphaned.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let mut orphans = rank::lock(&self.orphans, Rank::Leaf);
        self.orphaned.store(false, Ordering::Relaxed);
        std::mem::take(&mut *orphans)
    }
}

impl std::fmt::Debug for CpuSet<PerCpu, PerCpuOwned> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuSet").field("cpus", &self.cpus()).finish_non_exhaustive()
    }
}

/// The vCPU context of one operation: which slot the calling thread holds,
/// and that slot's per-CPU data. Passed by reference through every layer
/// above the objects; it derefs to the objects' part of it ([`Cx`]).
pub(crate) struct Ctx<'a> {
    /// The objects' part: the environment, the slot's owner-only part,
    /// its counters and index.
    cx: Cx<'a>,
    /// The machine.
    pub(crate) m: &'a Machine,
}

impl<'a> std::ops::Deref for Ctx<'a> {
    type Target = Cx<'a>;

    #[inline]
    fn deref(&self) -> &Cx<'a> {
        &self.cx
    }
}

impl<'a> Ctx<'a> {
    /// The context of slot `index` of `m`, whose parts `cpu` and `own` the
    /// calling thread holds.
    #[inline]
    pub(crate) fn new(m: &'a Machine, cpu: &'a PerCpu, own: &'a PerCpuOwned, index: usize) -> Ctx<'a> {
        Ctx { cx: Cx { env: &m.env, own, counters: &cpu.counters, index }, m }
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
    pub(crate) _life: Arc<Life>,
}

/// The machine as the address spaces hold it: unlike a [`Vm`], it does
/// not keep the user's handle alive, so the page daemon, which holds
/// spaces for a moment, never delays the end of a `Vm` (the user-facing
/// `AddressSpace` carries a `Vm`).
#[derive(Debug, Clone)]
pub(crate) struct Handle {
    /// `[I]` the machine.
    pub(crate) m: Arc<Machine>,
}

impl Handle {
    /// Run `f` with this thread's vCPU context for one operation.
    #[inline(always)]
    pub(crate) fn with_ctx<R>(&self, f: impl FnOnce(&Ctx<'_>) -> R) -> R {
        with_ctx(&self.m, f)
    }
}

/// Run `f` with this thread's vCPU context on `m` for one operation.
#[inline(always)]
pub(crate) fn with_ctx<R>(m: &Machine, f: impl FnOnce(&Ctx<'_>) -> R) -> R {
    let mut claim = m.cpus.claim();
    let index = claim.index();
    let (cpu, own) = claim.parts();
    let ctx = Ctx::new(m, cpu, own, index);
    let _waits = CountWaits(&ctx);
    // The tail, with nothing after it but drops: the result is made where
    // the caller wants it, not copied there.
    f(&ctx)
}

/// Counts, when dropped at the end of an operation, the grace periods it
/// waited for on the caller's path (`caller_grace_waits`).
struct CountWaits<'a, 'b>(&'a Ctx<'b>);

impl Drop for CountWaits<'_, '_> {
    #[inline]
    fn drop(&mut self) {
        let waits = crate::sync::rcu::take_thread_waits();
        if waits > 0 {
            self.0.count_n(Counter::caller_grace_waits, waits);
        }
    }
}

/// See [`Vm::_life`]: the end of the user's last handle. The machine's
/// own threads (page daemon, drain thread) are stopped and joined here,
/// so none of them outlives the `Vm` by a second, and the swap file's
/// path is freed at once (a new `Vm` may take it: `Swap::unlink`).
#[derive(Debug)]
pub(crate) struct Life {
    /// `[I]` the machine.
    pub(crate) m: Arc<Machine>,
    /// `[L]` the machine's threads, joined at its end.
    pub(crate) threads: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
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

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{Vm, VmConfig};

    /// The grace periods an operation waited for are counted once it ends
    /// (`CountWaits`), on its vCPU: two here, by the calling thread.
    #[test]
    fn an_operations_grace_period_waits_are_counted_when_it_ends() {
        let vm = Vm::new(VmConfig { phys_bytes: 4 << 20, cpus: 1, prefault: false, ..VmConfig::default() }).unwrap();
        let _cpu = vm.attach().unwrap();
        let before = vm.stats().caller_grace_waits;
        vm.with_ctx(|ctx| {
            ctx.env.rcu.synchronize();
            ctx.env.rcu.synchronize();
        });
        assert_eq!(vm.stats().caller_grace_waits - before, 2);
        // Nothing is left over for the next operation to count.
        vm.with_ctx(|_| ());
        assert_eq!(vm.stats().caller_grace_waits - before, 2);
    }
}
