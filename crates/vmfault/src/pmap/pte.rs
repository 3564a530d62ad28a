//! The PTE format: x86-64's bit positions, so a dump reads like a real one.
//!
//! | bit   | meaning                                                        |
//! |-------|----------------------------------------------------------------|
//! | 0     | present                                                        |
//! | 1     | writable                                                       |
//! | 5     | accessed                                                       |
//! | 6     | dirty                                                          |
//! | 9     | wired: the PTE holds a wiring of its page (FreeBSD's `PG_W`)   |
//! | 12..44| frame number                                                   |
//! | 63    | no-execute                                                     |
//!
//! A PTE is either 0 (nothing mapped) or present. Protection in a PTE is
//! never wider than its VMA's; it may be narrower (a write-protected PTE in
//! a writable VMA is upgraded by the next write fault).

use crate::phys::Pfn;
use crate::types::{Access, Prot};

const PRESENT: u64 = 1 << 0;
const WRITE: u64 = 1 << 1;
const ACCESSED: u64 = 1 << 5;
const DIRTY: u64 = 1 << 6;
const WIRED: u64 = 1 << 9;
const NX: u64 = 1 << 63;
const PFN_MASK: u64 = ((1 << 32) - 1) << 12;

/// A page-table entry value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Pte(pub(crate) u64);

impl Pte {
    /// No mapping.
    pub(crate) const NONE: Pte = Pte(0);

    /// A present PTE mapping `pfn`, writable and executable as asked.
    #[inline]
    pub(crate) fn new(pfn: Pfn, writable: bool, exec: bool, dirty: bool) -> Pte {
        let mut v = PRESENT | ACCESSED | (u64::from(pfn.raw()) << 12);
        if writable {
            v |= WRITE;
        }
        if !exec {
            v |= NX;
        }
        if dirty {
            v |= DIRTY;
        }
        Pte(v)
    }

    /// This PTE marked as holding a wiring of its page (an `mlock`ed
    /// mapping): whoever clears the PTE or drops the mark unwires the page.
    #[inline]
    pub(crate) fn wired(self) -> Pte {
        Pte(self.0 | WIRED)
    }

    /// Whether this PTE holds a wiring of its page.
    #[inline]
    pub(crate) fn is_wired(self) -> bool {
        self.0 & (PRESENT | WIRED) == PRESENT | WIRED
    }

    /// This PTE without its wiring mark.
    #[inline]
    pub(crate) fn unwired(self) -> Pte {
        Pte(self.0 & !WIRED)
    }

    /// Whether a store went through this PTE (it was made by a write
    /// fault).
    #[inline]
    pub(crate) fn is_dirty(self) -> bool {
        self.0 & DIRTY != 0
    }

    /// Whether anything is mapped.
    #[inline]
    pub(crate) fn is_present(self) -> bool {
        self.0 & PRESENT != 0
    }

    /// The mapped frame.
    #[inline]
    pub(crate) fn pfn(self) -> Pfn {
        Pfn::decode(((self.0 & PFN_MASK) >> 12) as u32)
    }

    /// Whether this PTE lets `access` through without a fault.
    #[inline]
    pub(crate) fn allows(self, access: Access) -> bool {
        self.is_present()
            && match access {
                Access::Read => true,
                Access::Write => self.0 & WRITE != 0,
                Access::Exec => self.0 & NX == 0,
            }
    }

    /// This PTE narrowed to `prot` (write and execute rights removed as
    /// needed; never widened). `PROT_NONE` is handled by the caller (it
    /// unmaps).
    #[inline]
    pub(crate) fn restricted(self, prot: Prot) -> Pte {
        let mut v = self.0;
        if !prot.contains(Prot::WRITE) {
            v &= !WRITE;
        }
        if !prot.contains(Prot::EXEC) {
            v |= NX;
        }
        Pte(v)
    }

    /// Whether going from this PTE to `new` takes something away from
    /// whoever translates through it: the frame (cleared or another one),
    /// or a right (write, or execute). A second MMU must hear of it.
    #[inline]
    pub(crate) fn loses_to(self, new: Pte) -> bool {
        self.is_present()
            && (!new.is_present()
                || self.pfn() != new.pfn()
                || self.0 & !new.0 & WRITE != 0
                || new.0 & !self.0 & NX != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode() {
        let p = Pte::new(Pfn::decode(0xabcde), true, false, true);
        assert!(p.is_present() && p.allows(Access::Write));
        assert_eq!(p.pfn(), Pfn::decode(0xabcde));
        assert!(p.allows(Access::Read) && p.allows(Access::Write) && !p.allows(Access::Exec));
        let r = p.restricted(Prot::READ);
        assert!(!r.allows(Access::Write) && r.allows(Access::Read));
        assert_eq!(r.pfn(), p.pfn());
        assert!(!Pte::NONE.allows(Access::Read));
        let x = Pte::new(Pfn::decode(1), false, true, false);
        assert!(x.allows(Access::Exec) && !x.restricted(Prot::READ).allows(Access::Exec));
    }
}
