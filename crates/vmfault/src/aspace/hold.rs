//! Holding a page: FreeBSD's `pmap_extract_and_hold` (Linux's
//! `get_user_pages`), the user of `RefCount::wire_mapped`.
//!
//! An emulator that hands a guest page to a device (DMA, a pinned I/O
//! buffer) needs the frame to stay allocated whatever the guest does to
//! its mappings meanwhile. [`AddressSpace::hold`] finds the page through
//! the PTE and, under the PTE lock, wires it with `wire_mapped`, which
//! fails while the page daemon is taking the page out of every mapping
//! (`RefCount::try_isolate`, the BLOCKED bit); then, or when the PTE
//! does not allow the access, it takes the fault and tries again. A held
//! page that leaves its object (`munmap`, `MADV_DONTNEED`, the end of the
//! space) stays allocated until the last [`PageHold`] goes, and is freed
//! then, after a grace period.
//!
//! A write hold of a shared file page dirties the page when it is dropped
//! (Linux's `unpin_user_pages_dirty_lock`): its stores do not fault, so a
//! write-back meanwhile, which write-protects every mapping and cleans the
//! page, would otherwise leave the later ones unwritten. This is also why
//! write-back needs no `try_remove_write` (FreeBSD's, which refuses a page
//! that is wired): a hold taken through a writable PTE before the
//! write-protection dirties the page again at its end, and one taken after
//! it faults first, and so dirties the page through the fault.
//!
//! Not yet: a private page held for writing and then shared by `fork`
//! stays shared (Linux copies pinned pages at fork,
//! `page_maybe_dma_pinned`); the parent's next store copies it, so the
//! hold then writes the child's page.

use super::AddressSpace;
use super::vma::Lookup;
use crate::error::{Error, Op, Result};
use crate::fault;
use crate::machine::Vm;
use crate::object::Object;
use crate::phys::Pfn;
use crate::pmap::{Pmap, Pte};
use crate::types::{Access, PAGE_SIZE};

/// A page held by [`AddressSpace::hold`]: its frame stays allocated (and
/// out of reach of reclaim) until this is dropped.
#[derive(Debug)]
#[must_use = "the page is released when the hold is dropped"]
pub struct PageHold {
    vm: Vm,
    pfn: Pfn,
    /// The shared zero page is not wired (it is never freed).
    wired: bool,
    /// A write hold of a shared file page: its object and index, dirtied
    /// when the hold ends.
    dirties: Option<(std::sync::Arc<Object>, u64)>,
}

impl AddressSpace {
    /// Hold the page that backs `addr` for `access`, faulting it in first
    /// if needed (a write hold breaks copy-on-write, as a store would).
    /// Errors as the access would fail: `Error::Segv`, `Error::Bus`,
    /// `ENOMEM`.
    ///
    /// A write hold and `fork`: unlike Linux, which copies a pinned page
    /// into the child at fork (`page_maybe_dma_pinned`), a private page
    /// held for writing is shared with the child like any other, and the
    /// parent's next store copies it: the hold then reaches the child's
    /// page, not the parent's. Drop write holds of private memory before
    /// forking (or hold shared memory, which fork does not copy).
    ///
    /// ```
    /// use vmfault::{Vm, VmConfig, Prot, MapFlags, Access};
    /// let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, ..VmConfig::default() })?;
    /// let space = vm.new_space()?;
    /// let a = space.mmap(0, 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    /// let hold = space.hold(a, Access::Write)?;
    /// hold.write(0, b"dma");
    /// space.munmap(a, 4096)?; // the frame stays allocated: it is held
    /// let mut buf = [0u8; 3];
    /// hold.read(0, &mut buf);
    /// assert_eq!(&buf, b"dma");
    /// drop(hold); // now it is freed
    /// # Ok::<(), vmfault::Error>(())
    /// ```
    pub fn hold(&self, addr: u64, access: Access) -> Result<PageHold> {
        let s = &self.s;
        let page = addr & !(PAGE_SIZE - 1);
        if addr >= crate::types::TASK_SIZE {
            // As a load or store there: no mapping lies beyond.
            return Err(crate::Error::Segv { addr, code: crate::SegvCode::MapErr });
        }
        s.vm.with_ctx(|ctx| {
            let phys = &ctx.env.phys;
            loop {
                let held = {
                    let _section = ctx.rcu_read();
                    s.pmap.pte(phys, page).and_then(|leaf| {
                        let _ptl = Pmap::lock(phys, &leaf).0;
                        let pte = Pte(leaf.entry.load(std::sync::atomic::Ordering::Relaxed));
                        if !pte.allows(access) {
                            return None;
                        }
                        let pfn = pte.pfn();
                        if pfn == phys.zero_pfn() {
                            return Some((pfn, false));
                        }
                        phys.wire_mapped(pfn, Some(ctx.counters)).then_some((pfn, true))
                    })
                };
                if let Some((pfn, wired)) = held {
                    let dirties = match access {
                        Access::Write => {
                            let map = s.map_read(ctx, page, page + PAGE_SIZE);
                            map.find(page).and_then(|v| super::file::file_range(v, page, page + PAGE_SIZE))
                        }
                        _ => None,
                    };
                    let dirties = dirties.map(|(o, pindex, _)| (o, pindex));
                    return Ok(PageHold { vm: self.vm.clone(), pfn, wired, dirties });
                }
                fault::handle(ctx, s, Op::Touch, page, access, |_| {})?;
            }
        })
    }
}

impl PageHold {
    /// Copy bytes out of the held page, from byte `offset`.
    ///
    /// # Panics
    /// If `offset + buf.len()` exceeds the page.
    pub fn read(&self, offset: usize, buf: &mut [u8]) {
        self.vm.m.phys.read_bytes(self.pfn, offset, buf);
    }

    /// Copy bytes into the held page, from byte `offset` (a hold taken
    /// for reading may share its page: write only through a write hold).
    ///
    /// # Panics
    /// If `offset + data.len()` exceeds the page, or on the shared zero page.
    pub fn write(&self, offset: usize, data: &[u8]) {
        assert!(self.wired, "{}", Error::inval(Op::Write, "writing the shared zero page through a read hold", 0));
        self.vm.m.phys.write_bytes(self.pfn, offset, data);
    }
}

impl Drop for PageHold {
    fn drop(&mut self) {
        let m = &self.vm.m;
        if let Some((o, pindex)) = &self.dirties {
            // Still wired: the page is where the hold found it, unless the
            // mapping changed before the lookup of its object.
            o.mark_dirty_if(*pindex, self.pfn);
        }
        if self.wired && m.phys.unwire(self.pfn, None) {
            // The page left its object while held: it was unmapped
            // everywhere before, but wait out walkers that read a PTE then.
            m.phys.free_after_grace(&m.rcu, &[self.pfn]);
        }
    }
}
