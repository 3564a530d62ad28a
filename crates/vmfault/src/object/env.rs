//! What VM objects need of the machine they live in, and of the vCPU that
//! works on them: the narrow environment of the object layer.
//!
//! An object outlives the operation that made it, and its end frees its
//! pages and index nodes, gives back its swap slots and leaves the
//! registries it joined: so it holds its [`Env`], through the [`EnvRef`]
//! of the vCPU slot that made it (an `Arc` of an `Arc`, so that object
//! births and ends count references on that slot's line, not on one all
//! vCPUs share); the machine (`machine::Machine`, one layer up) holds the
//! `Env` too and reaches it through `Deref`. The machine's other parts (vCPU slots, the registry of
//! address spaces, orphaned pages, its threads) are not the objects'
//! business, and this layer cannot name them.
//!
//! An operation on an object runs on a vCPU: [`Cx`] is the part of the
//! vCPU context (`machine::Ctx`, which derefs to it) that objects use: the
//! RCU reader, the counters, the object-index hint, the object serials.

use std::cell::Cell;
use std::sync::Arc;

use super::{Files, IndexHint, PvTable, Reclaimable, RmapTotals};
use crate::config::VmConfig;
use crate::phys::{Frames, PhysMem};
use crate::stats::{Counter, CounterSet, DaemonStats};
use crate::swapdev::Swap;
use crate::sync::rcu::{Rcu, RcuPin, RcuReadGuard, RcuReader};

/// The machine-wide state objects use (and with them every layer above,
/// through the machine).
#[derive(Debug)]
pub(crate) struct Env {
    /// `[I]` the configuration it was built with.
    pub(crate) config: VmConfig,
    /// `[S]` physical memory (fields carry their own tags).
    pub(crate) phys: PhysMem,
    /// `[S]` the page daemon's statistics (fields carry their tags).
    pub(crate) daemon: DaemonStats,
    /// `[I]` the RCU; reader `i` belongs to vCPU slot `i`.
    pub(crate) rcu: Rcu,
    /// `[S]` the file objects, by device and inode (its own lock inside).
    pub(crate) files: Files,
    /// Reverse-map totals of the backing records (`[a]`).
    pub(crate) rmap: RmapTotals,
    /// `[S]` the pv lists (`rmap=pv`; empty otherwise), one lock per frame.
    pub(crate) pv: PvTable,
    /// `[S]` the swap device (`VmConfig::swap`; its own lock inside).
    pub(crate) swap: Option<Swap>,
    /// `[S]` the anonymous objects, registered only with swap (locks inside).
    pub(crate) reclaimable: Reclaimable,
}

/// The environment as an object holds it: one per vCPU slot (made with the
/// machine), which the objects that slot makes clone. Each object counts a
/// reference from its birth to its end; on the `Env` itself those counts
/// were a line that every vCPU's objects wrote, a miss at each birth and
/// each end once another vCPU had written it (vmlocal makes and ends an
/// object per loop: `Arc::drop_slow` and `Object::with_backing` were 7%
/// of it on two core complexes). On lines of its own (the alignment), so
/// that two slots' counts never share one.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct EnvRef(Arc<Env>);

impl EnvRef {
    /// A handle of `env` for one vCPU slot.
    pub(crate) fn new(env: &Arc<Env>) -> Arc<EnvRef> {
        Arc::new(EnvRef(env.clone()))
    }
}

impl std::ops::Deref for EnvRef {
    type Target = Env;
    #[inline]
    fn deref(&self) -> &Env {
        &self.0
    }
}

/// The owner-only part of a vCPU slot: what only the thread that holds
/// the slot touches (the machine's `CpuSet` keeps one per slot).
#[derive(Debug)]
pub(crate) struct SlotOwned {
    /// `[o]` this slot's RCU reader.
    pub(crate) rcu: RcuReader,
    /// `[o]` next object serial number handed out by this vCPU.
    pub(crate) next_object: Cell<u64>,
    /// `[o]` this vCPU's last reserve in an object index.
    pub(crate) index_hint: IndexHint,
    /// `[I]` the environment as the objects this slot makes hold it.
    pub(crate) env_ref: Arc<EnvRef>,
}

/// The part of a vCPU's context that object operations use (the whole
/// context, `machine::Ctx`, derefs to it, so a `&Ctx` is passed where a
/// `&Cx` is asked for). Four words: every operation builds one, and the
/// paths that take it by reference out of line make it live in memory,
/// so what can be reached through the slot is reached, not copied.
pub(crate) struct Cx<'a> {
    /// The machine's environment.
    pub(crate) env: &'a Env,
    /// `[o]` the slot's owner-only part: its RCU reader, object-index
    /// hint, object serials and environment handle.
    pub(crate) own: &'a SlotOwned,
    /// `[o]` the vCPU's counters.
    pub(crate) counters: &'a CounterSet,
    /// The vCPU slot's index.
    pub(crate) index: usize,
}

impl Cx<'_> {
    /// Count one event on this vCPU.
    #[inline]
    pub(crate) fn count(&self, c: Counter) {
        self.counters.inc(c);
    }

    /// Count `n` events on this vCPU.
    #[inline]
    pub(crate) fn count_n(&self, c: Counter, n: u64) {
        self.counters.add(c, n);
    }

    /// This vCPU's view of the frame allocator (its page cache first).
    #[inline]
    pub(crate) fn frames(&self) -> Frames<'_> {
        Frames::new(&self.env.phys, &self.env.rcu, &self.own.rcu, self.counters)
    }

    /// Enter an RCU read-side section as this vCPU.
    #[inline]
    pub(crate) fn rcu_read(&self) -> RcuReadGuard<'_> {
        self.env.rcu.read_lock(&self.own.rcu)
    }

    /// Enter an RCU read-side section as this vCPU, pinning the page of
    /// `addr` (`Rcu::pin`: the per-VMA read lock).
    #[inline]
    pub(crate) fn rcu_pin(&self, addr: u64) -> RcuPin<'_> {
        self.env.rcu.pin(&self.own.rcu, addr)
    }

    /// A new object id, unique in this `Vm`, without a shared counter:
    /// the slot index in the top bits, a per-slot serial below.
    pub(crate) fn new_object_id(&self) -> u64 {
        let n = self.own.next_object.get();
        self.own.next_object.set(n + 1);
        ((self.index as u64 + 1) << 48) | n
    }
}
