//! Which window pages map which page of the sequences' file, in each
//! process, followed from the operations and the host's outcomes: what
//! the harness needs to tell the page that straddles the end of the file
//! (see `tail_written_back` in the crate root).

use crate::ops::{Outcome, P, TOp, WINDOW_PAGES};

/// A window page that may map a file page, or not.
pub(crate) const UNKNOWN: u64 = u64::MAX;

/// Per process (`None` once exited), per window page: the file page it
/// maps, if any.
#[derive(Debug, Clone)]
pub(crate) struct FilePages {
    procs: Vec<Option<Vec<Option<u64>>>>,
    cur: usize,
}

impl FilePages {
    /// One process, no file mapped.
    pub(crate) fn new() -> FilePages {
        FilePages { procs: vec![Some(vec![None; WINDOW_PAGES as usize])], cur: 0 }
    }

    /// The file page that window offset `off` maps in the current process.
    pub(crate) fn fpage(&self, off: u64) -> Option<u64> {
        let pages = self.procs.get(self.cur)?.as_ref()?;
        *pages.get(usize::try_from(off / P).ok()?)?
    }

    /// Follow `op`, which had `outcome` on the host.
    pub(crate) fn apply(&mut self, op: &TOp, outcome: &Outcome) {
        match (op, outcome) {
            (TOp::Fork, Outcome::Ok) => {
                let child = self.procs[self.cur].clone();
                self.procs.push(child);
            }
            (TOp::Switch(n), _) => self.cur = usize::from(*n),
            (TOp::Exit, _) => self.procs[self.cur] = None,
            (TOp::MmapFile { len, fpage, .. }, Outcome::Addr(at)) => {
                self.set(*at, *len, |i| Some(fpage + i));
            }
            (TOp::Mmap { len, .. }, Outcome::Addr(at)) => self.set(*at, *len, |_| None),
            (TOp::Munmap { off, len }, Outcome::Ok) => self.set(*off, *len, |_| None),
            (&TOp::Mremap { off, old_len, new_len, flags, .. }, Outcome::Addr(at)) => {
                self.remapped(off, old_len, new_len, Some(*at), flags & libc::MREMAP_DONTUNMAP as u32 != 0)
            }
            (&TOp::Mremap { off, old_len, new_len, flags, .. }, Outcome::Elsewhere) => {
                self.remapped(off, old_len, new_len, None, flags & libc::MREMAP_DONTUNMAP as u32 != 0)
            }
            _ => {}
        }
    }

    /// An `mremap` of `off..+old_len` to `new_len` bytes that left the
    /// mapping at `at` (`None`: out of the window). A page it carries keeps
    /// its file page; a page it adds continues the file from its last
    /// page; a page of a move that was not a file page becomes
    /// `UNKNOWN` (a several-mapping move keeps what lies in the gaps at
    /// the destination, and this table does not know the gaps). With
    /// `keep` (`MREMAP_DONTUNMAP`) the old range stays mapped: a shared
    /// file mapping there still maps its pages.
    fn remapped(&mut self, off: u64, old_len: u64, new_len: u64, at: Option<u64>, keep: bool) {
        let (old, new) = (old_len.div_ceil(P), new_len.div_ceil(P));
        let source: Vec<Option<u64>> = (0..old).map(|i| self.fpage(off + i * P)).collect();
        // With `old_len` 0 (a second mapping of a shared one), the file
        // continues from the page at `off`.
        let first = self.fpage(off);
        // A file page of unknown index goes on with pages of unknown index.
        let next = |i: u64| match (source.last().copied(), first) {
            (Some(Some(UNKNOWN)), _) if i >= old => Some(UNKNOWN),
            (Some(Some(last)), _) if i >= old => Some(last + 1 + (i - old)),
            (None, Some(UNKNOWN)) => Some(UNKNOWN),
            (None, Some(f)) => Some(f + i),
            _ => None,
        };
        match at {
            Some(at) if at == off => {
                if new < old {
                    self.set(off + new * P, (old - new) * P, |_| None);
                } else {
                    self.set(off + old * P, (new - old) * P, |i| next(old + i));
                }
            }
            _ => {
                if !keep {
                    self.set(off, old * P, |_| None);
                }
                if let Some(at) = at {
                    self.set(at, new * P, |i| match source.get(i as usize) {
                        Some(Some(f)) => Some(*f),
                        Some(None) => Some(UNKNOWN),
                        None => next(i),
                    });
                }
            }
        }
    }

    /// Set the pages of `off..off+len` (clipped to the window) to what `f`
    /// gives for their index in the range.
    fn set(&mut self, off: u64, len: u64, f: impl Fn(u64) -> Option<u64>) {
        let Some(Some(pages)) = self.procs.get_mut(self.cur) else { return };
        let first = off / P;
        for i in 0..len.div_ceil(P) {
            if let Some(p) = pages.get_mut((first + i) as usize) {
                *p = f(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Place;

    #[test]
    fn follows_maps_unmaps_and_forks() {
        let mut fp = FilePages::new();
        let map = TOp::MmapFile { place: Place::Fixed, off: 2 * P, len: 3 * P, prot: 3, shared: true, fpage: 39 };
        fp.apply(&map, &Outcome::Addr(2 * P));
        assert_eq!((fp.fpage(2 * P), fp.fpage(4 * P + 5), fp.fpage(5 * P)), (Some(39), Some(41), None));
        fp.apply(&TOp::Fork, &Outcome::Ok);
        fp.apply(&TOp::Munmap { off: 3 * P, len: P }, &Outcome::Ok);
        assert_eq!(fp.fpage(3 * P), None);
        fp.apply(&TOp::Switch(1), &Outcome::Ok);
        assert_eq!(fp.fpage(3 * P), Some(40), "the child kept its mapping");
        fp.apply(&TOp::Mmap { place: Place::Fixed, off: 0, len: 3 * P, prot: 3, flags: 0x32 }, &Outcome::Addr(0));
        assert_eq!((fp.fpage(2 * P), fp.fpage(3 * P)), (None, Some(40)));
    }

    #[test]
    fn follows_mremap() {
        let mut fp = FilePages::new();
        let map = TOp::MmapFile { place: Place::Fixed, off: 2 * P, len: 2 * P, prot: 3, shared: true, fpage: 10 };
        fp.apply(&map, &Outcome::Addr(2 * P));
        // Grown in place: the file goes on.
        let grow = TOp::Mremap { off: 2 * P, old_len: 2 * P, new_len: 3 * P, flags: 0, new_off: 0 };
        fp.apply(&grow, &Outcome::Addr(2 * P));
        assert_eq!(fp.fpage(4 * P), Some(12));
        // A second mapping of it (old_len 0) elsewhere in the window.
        let dup = TOp::Mremap { off: 3 * P, old_len: 0, new_len: 2 * P, flags: 3, new_off: 8 * P };
        fp.apply(&dup, &Outcome::Addr(8 * P));
        assert_eq!((fp.fpage(8 * P), fp.fpage(9 * P), fp.fpage(3 * P)), (Some(11), Some(12), Some(11)));
        // Moved with MREMAP_DONTUNMAP: the old range still maps the file.
        let keep = TOp::Mremap { off: 8 * P, old_len: 2 * P, new_len: 2 * P, flags: 7, new_off: 20 * P };
        fp.apply(&keep, &Outcome::Addr(20 * P));
        assert_eq!((fp.fpage(8 * P), fp.fpage(20 * P), fp.fpage(21 * P)), (Some(11), Some(11), Some(12)));
        // A mapping whose last page is of unknown index grows: unknown too
        // (a debug build once overflowed here).
        fp.set(30 * P, P, |_| Some(UNKNOWN));
        let grow_unknown = TOp::Mremap { off: 30 * P, old_len: P, new_len: 2 * P, flags: 0, new_off: 0 };
        fp.apply(&grow_unknown, &Outcome::Addr(30 * P));
        assert_eq!(fp.fpage(31 * P), Some(UNKNOWN));
        // Moved out of the window: gone here.
        let away = TOp::Mremap { off: 2 * P, old_len: 3 * P, new_len: 3 * P, flags: 1, new_off: 0 };
        fp.apply(&away, &Outcome::Elsewhere);
        assert_eq!(fp.fpage(2 * P), None);
    }
}
