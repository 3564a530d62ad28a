//! Which window pages map which page of the sequences' file, in each
//! process, followed from the operations and the host's outcomes: what
//! the harness needs to tell the page that straddles the end of the file
//! (see `tail_written_back` in the crate root).

use crate::ops::{Outcome, P, TOp, WINDOW_PAGES};

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
            _ => {}
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
}
