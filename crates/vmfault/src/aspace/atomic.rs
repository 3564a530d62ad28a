//! Atomic read-modify-writes on guest memory: what an emulator needs for a
//! guest's locked instructions (`lock cmpxchg`, `lock xadd`, `xchg`), its
//! futexes and its spinlocks.
//!
//! Each one is a single access of one naturally aligned 4- or 8-byte value
//! (an unaligned address is `EINVAL`: a split-lock has no single word to
//! update here). It faults as a store does, copy-on-write included (even a
//! compare-exchange that fails, as on x86, where `lock cmpxchg` always
//! writes), or fails with SIGSEGV where a store would. Then, inside the
//! RCU section that keeps the frame mapped, it updates the value with one
//! sequentially consistent compare-and-swap loop on the guest word that
//! holds it (`PhysMem::update_value`), so it is atomic with respect to the
//! same operations from every other vCPU and to the word stores of
//! `write`: two vCPUs adding to one counter lose no update (with `read`
//! and `write` they lost 20-40%).
//!
//! ```
//! use vmfault::{MapFlags, Prot, Vm, VmConfig};
//! let vm = Vm::new(VmConfig { phys_bytes: 4 << 20, prefault: false, ..VmConfig::default() })?;
//! let space = vm.new_space()?;
//! let a = space.mmap(0, 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
//! assert_eq!(space.fetch_add_u64(a, 5)?, 0);
//! assert_eq!(space.compare_exchange_u64(a, 5, 7)?, Ok(5));
//! assert_eq!(space.compare_exchange_u64(a, 5, 9)?, Err(7));
//! assert_eq!(space.swap_u32(a + 4, 1)?, 0);
//! assert!(space.fetch_add_u64(a + 2, 1).is_err()); // not aligned: EINVAL
//! # Ok::<(), vmfault::Error>(())
//! ```

use super::AddressSpace;
use crate::error::{Error, Op, Result};
use crate::types::Access;

impl AddressSpace {
    /// Atomically replace the `u64` at `addr` by `new` if it is `current`
    /// (as [`AtomicU64::compare_exchange`](std::sync::atomic::AtomicU64::compare_exchange),
    /// sequentially consistent): `Ok(Ok(current))` if it was replaced,
    /// `Ok(Err(actual))` if not. `addr` must be 8-byte aligned.
    pub fn compare_exchange_u64(&self, addr: u64, current: u64, new: u64) -> Result<std::result::Result<u64, u64>> {
        self.update_value(addr, 8, |v| (v == current).then_some(new))
    }

    /// [`compare_exchange_u64`](Self::compare_exchange_u64) on a 4-byte
    /// aligned `u32`.
    pub fn compare_exchange_u32(&self, addr: u64, current: u32, new: u32) -> Result<std::result::Result<u32, u32>> {
        let r = self.update_value(addr, 4, |v| (v == u64::from(current)).then_some(u64::from(new)))?;
        Ok(r.map(lane).map_err(lane))
    }

    /// Atomically add `val` (wrapping) to the `u64` at `addr`, returning
    /// the value before. `addr` must be 8-byte aligned.
    pub fn fetch_add_u64(&self, addr: u64, val: u64) -> Result<u64> {
        self.update_value(addr, 8, |v| Some(v.wrapping_add(val))).map(taken)
    }

    /// [`fetch_add_u64`](Self::fetch_add_u64) on a 4-byte aligned `u32`.
    pub fn fetch_add_u32(&self, addr: u64, val: u32) -> Result<u32> {
        self.update_value(addr, 4, |v| Some(u64::from(lane(v).wrapping_add(val)))).map(|r| lane(taken(r)))
    }

    /// Atomically store `val` in the `u64` at `addr`, returning the value
    /// before. `addr` must be 8-byte aligned.
    pub fn swap_u64(&self, addr: u64, val: u64) -> Result<u64> {
        self.update_value(addr, 8, |_| Some(val)).map(taken)
    }

    /// [`swap_u64`](Self::swap_u64) on a 4-byte aligned `u32`.
    pub fn swap_u32(&self, addr: u64, val: u32) -> Result<u32> {
        self.update_value(addr, 4, |_| Some(u64::from(val))).map(|r| lane(taken(r)))
    }

    /// Fault `addr` in for a store and update its `size`-byte value with `f`
    /// (see the module docs).
    fn update_value(
        &self,
        addr: u64,
        size: u64,
        mut f: impl FnMut(u64) -> Option<u64>,
    ) -> Result<std::result::Result<u64, u64>> {
        if !addr.is_multiple_of(size) {
            let reason = if size == 8 {
                "an 8-byte atomic needs an 8-byte aligned address"
            } else {
                "a 4-byte atomic needs a 4-byte aligned address"
            };
            return Err(Error::InvalidArgument { op: Op::Atomic, reason, value: addr });
        }
        let s = &self.s;
        let mut out = Err(0);
        s.vm.with_ctx(|ctx| {
            let phys = &ctx.env.phys;
            s.access(ctx, Op::Atomic, addr, size as usize, Access::Write, |pfn, off, _, _| {
                out = phys.update_value(pfn, off, size as usize, &mut f);
            })
        })?;
        Ok(out)
    }
}

/// The value before, whether or not it was changed.
fn taken(r: std::result::Result<u64, u64>) -> u64 {
    r.unwrap_or_else(|v| v)
}

/// A 4-byte value (the low half: `update_value` keeps it there).
fn lane(v: u64) -> u32 {
    v as u32
}
