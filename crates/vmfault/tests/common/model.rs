//! A reference model of the window: one entry per page (mapped or not, its
//! protection, where its bytes live). It knows nothing of VMAs, objects or
//! page tables, only what a program can observe: results, errnos, bytes.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::ops::*;

const EINVAL: i32 = libc::EINVAL;
const ENOMEM: i32 = libc::ENOMEM;

/// Where a mapped page's bytes live.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Backing {
    /// Private anonymous memory: its own bytes (absent: zeros).
    Private(Option<Box<[u8]>>),
    /// Shared anonymous memory: page `pindex` of shared object `object`.
    Shared { object: u64, pindex: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Page {
    prot: u32,
    backing: Backing,
    /// `mlock`ed.
    locked: bool,
    /// Private pages: what backs them since they were mapped or dropped
    /// (`mincore`'s residency): nothing, the zero page (a read fault), a
    /// frame of their own (a write fault).
    resident: Res,
}

/// What backs a private page: ordered, a write fault's frame above a
/// read fault's zero page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Res {
    No,
    Zero,
    Frame,
}

/// The model state.
#[derive(Debug, Clone, Default)]
pub struct Model {
    pages: BTreeMap<u64, Page>,
    shared: HashMap<(u64, u64), Box<[u8]>>,
    /// Shared objects' pages that exist (faulted in through any mapping).
    shared_resident: HashSet<(u64, u64)>,
    next_object: u64,
    /// The heap's break, as a window offset (`None`: at `HEAP_OFF`, where
    /// the heap starts).
    brk: Option<u64>,
    /// What the last operation should have produced.
    pub last: Option<Outcome>,
}

fn readable(prot: u32) -> bool {
    prot != 0
}

fn writable(prot: u32) -> bool {
    prot & libc::PROT_WRITE as u32 != 0
}

fn align_up(len: u64) -> u64 {
    len.div_ceil(P) * P
}

impl Model {
    /// Pages currently mapped (window page numbers).
    pub fn mapped_pages(&self) -> Vec<u64> {
        self.pages.keys().copied().collect()
    }

    fn range_free(&self, first: u64, n: u64) -> bool {
        self.pages.range(first..first + n).next().is_none()
    }

    fn bytes(&self, page: u64) -> Vec<u8> {
        match &self.pages[&page].backing {
            Backing::Private(Some(b)) => b.to_vec(),
            Backing::Private(None) => vec![0; P as usize],
            Backing::Shared { object, pindex } => {
                self.shared.get(&(*object, *pindex)).map_or_else(|| vec![0; P as usize], |b| b.to_vec())
            }
        }
    }

    fn store(&mut self, page: u64, at: usize, data: &[u8]) {
        let mut b = self.bytes(page);
        b[at..at + data.len()].copy_from_slice(data);
        match self.pages.get_mut(&page).unwrap().backing.clone() {
            Backing::Private(_) => self.pages.get_mut(&page).unwrap().backing = Backing::Private(Some(b.into())),
            Backing::Shared { object, pindex } => {
                self.shared.insert((object, pindex), b.into());
            }
        }
    }

    /// `locked`: `MAP_LOCKED` (as `mlock` of the new pages; bytes never change).
    fn map(&mut self, first: u64, n: u64, prot: u32, shared: bool, locked: bool) {
        let object = self.next_object;
        self.next_object += 1;
        for i in 0..n {
            let backing = if shared { Backing::Shared { object, pindex: i } } else { Backing::Private(None) };
            self.pages.insert(first + i, Page { prot, backing, locked, resident: Res::No });
        }
    }

    /// Page `page` was faulted in.
    fn fault_in(&mut self, page: u64, write: bool) {
        let p = self.pages.get_mut(&page).expect("a mapped page");
        match p.backing {
            Backing::Private(_) => p.resident = p.resident.max(if write { Res::Frame } else { Res::Zero }),
            Backing::Shared { object, pindex } => {
                self.shared_resident.insert((object, pindex));
            }
        }
    }

    /// Whether page `page` (mapped) is resident.
    fn resident(&self, page: u64) -> bool {
        let p = &self.pages[&page];
        match p.backing {
            Backing::Private(_) => p.resident != Res::No,
            Backing::Shared { object, pindex } => self.shared_resident.contains(&(object, pindex)),
        }
    }

    /// The pages of `off..off+len` a walk that stops at `fault` visited.
    fn visited(off: u64, len: u64, fault: Option<u64>) -> std::ops::Range<u64> {
        let end = fault.unwrap_or(off + len);
        if end <= off { off / P..off / P } else { off / P..(end - 1) / P + 1 }
    }

    /// Apply `op`, recording the expected outcome in `last`.
    pub fn apply(&mut self, op: &TOp) {
        let out = self.step(op);
        self.last = Some(out);
    }

    fn step(&mut self, op: &TOp) -> Outcome {
        match *op {
            TOp::Mmap { place, off, len, prot, flags } => self.mmap(place, off, len, prot, flags),
            TOp::Munmap { off, len } => {
                if !off.is_multiple_of(P) || len == 0 {
                    return Outcome::Err(EINVAL);
                }
                let first = off / P;
                for p in first..first + align_up(len) / P {
                    self.pages.remove(&p);
                }
                Outcome::Ok
            }
            TOp::Mprotect { off, len, prot } => {
                if !off.is_multiple_of(P) {
                    return Outcome::Err(EINVAL);
                }
                if len == 0 {
                    return Outcome::Ok;
                }
                if prot & !7 != 0 {
                    return Outcome::Err(EINVAL);
                }
                let first = off / P;
                for p in first..first + align_up(len) / P {
                    match self.pages.get_mut(&p) {
                        Some(page) => {
                            // PROT_NONE clears PTEs: a private page that
                            // has no frame (the zero page) is no longer
                            // resident (Linux keeps a PROT_NONE PTE; the
                            // differential test allows this difference).
                            if prot == 0 && page.resident == Res::Zero {
                                page.resident = Res::No;
                            }
                            // Linux's mprotect_fixup populates locked
                            // private memory made writable, by writes.
                            let private = matches!(page.backing, Backing::Private(_));
                            if page.locked && private && writable(prot) && !writable(page.prot) {
                                page.resident = Res::Frame;
                            }
                            page.prot = prot;
                        }
                        None => return Outcome::Err(ENOMEM),
                    }
                }
                Outcome::Ok
            }
            TOp::Madvise { off, len, advice } => {
                if !off.is_multiple_of(P) {
                    return Outcome::Err(EINVAL);
                }
                if len == 0 {
                    return Outcome::Ok;
                }
                let first = off / P;
                let mut hole = false;
                for p in first..first + align_up(len) / P {
                    match self.pages.get_mut(&p) {
                        // Not on locked memory (Linux's
                        // `madvise_dontneed_free_valid_vma`, `can_madv_lru_vma`).
                        Some(page)
                            if page.locked
                                && [libc::MADV_DONTNEED, libc::MADV_FREE, libc::MADV_COLD, libc::MADV_PAGEOUT]
                                    .contains(&advice) =>
                        {
                            return Outcome::Err(EINVAL);
                        }
                        // MADV_FREE: private anonymous memory only.
                        Some(page) if advice == libc::MADV_FREE && matches!(page.backing, Backing::Shared { .. }) => {
                            return Outcome::Err(EINVAL);
                        }
                        Some(page) => {
                            if advice == libc::MADV_DONTNEED && matches!(page.backing, Backing::Private(_)) {
                                page.backing = Backing::Private(None);
                                page.resident = Res::No;
                            }
                        }
                        None => hole = true,
                    }
                }
                if hole { Outcome::Err(ENOMEM) } else { Outcome::Ok }
            }
            TOp::Read { off, len } => {
                let mut data = Vec::new();
                let r = self.walk(
                    off,
                    len,
                    |p| readable(p.prot),
                    |m, page, at, n| data.extend_from_slice(&m.bytes(page)[at..at + n]),
                );
                Model::visited(off, len, r.map(|f| f.0)).for_each(|p| self.fault_in(p, false));
                match r {
                    None => Outcome::Data(data),
                    Some((fault, code)) => Outcome::Segv { off: fault as i64, code, data },
                }
            }
            TOp::Write { off, len, seed } => self.write(off, len, seed, |p| writable(p.prot)),
            TOp::Touch { off, write } => {
                let ok = if write { writable } else { readable };
                let r = self.walk(off, 1, |p| ok(p.prot), |_, _, _, _| {});
                Model::visited(off, 1, r.map(|f| f.0)).for_each(|p| self.fault_in(p, write));
                match r {
                    None => Outcome::Ok,
                    Some((fault, code)) => Outcome::Segv { off: fault as i64, code, data: Vec::new() },
                }
            }
            TOp::FetchAdd { off, val } => match self.walk(off, 8, |p| writable(p.prot), |_, _, _, _| {}) {
                None => {
                    let (page, at) = (off / P, (off % P) as usize);
                    self.fault_in(page, true);
                    let old = u64::from_ne_bytes(self.bytes(page)[at..at + 8].try_into().unwrap());
                    self.store(page, at, &old.wrapping_add(val).to_ne_bytes());
                    Outcome::Data(old.to_ne_bytes().to_vec())
                }
                Some((fault, code)) => Outcome::Segv { off: fault as i64, code, data: Vec::new() },
            },
            // A debugger's access: any mapped page may be read, a private
            // one written (copy-on-write); the failure says only where.
            // Forced reads of a `PROT_NONE` page map nothing (it stays
            // not resident unless it has a frame); forced writes give the
            // page a frame of its own, as any write.
            TOp::ForceRead { off, len } => {
                let mut data = Vec::new();
                let r =
                    self.walk(off, len, |_| true, |m, page, at, n| data.extend_from_slice(&m.bytes(page)[at..at + n]));
                for p in Model::visited(off, len, r.map(|f| f.0)) {
                    if self.pages[&p].prot != 0 || matches!(self.pages[&p].backing, Backing::Shared { .. }) {
                        self.fault_in(p, false);
                    }
                }
                match r {
                    None => Outcome::Data(data),
                    Some((fault, _)) => Outcome::Segv { off: fault as i64, code: 0, data },
                }
            }
            TOp::ForceWrite { off, len, seed } => {
                let ok = |p: &Page| writable(p.prot) || matches!(p.backing, Backing::Private(_));
                match self.write(off, len, seed, ok) {
                    Outcome::Segv { off, data, .. } => Outcome::Segv { off, code: 0, data },
                    out => out,
                }
            }
            TOp::Mincore { off, len } => {
                if !off.is_multiple_of(P) {
                    return Outcome::Err(EINVAL);
                }
                let first = off / P;
                let mut v = Vec::new();
                for p in first..first + align_up(len) / P {
                    if !self.pages.contains_key(&p) {
                        return Outcome::Err(ENOMEM);
                    }
                    v.push(u8::from(self.resident(p)));
                }
                Outcome::Data(v)
            }
            TOp::Mlock { off, len } | TOp::Munlock { off, len } => {
                // Linux's rounding: the start down, the length with the
                // start's offset up; flags first, a hole stops them (and
                // population never starts); a PROT_NONE page stops
                // population. Bytes never change.
                let lock = matches!(op, TOp::Mlock { .. });
                let first = off / P;
                let n = align_up(len + off % P) / P;
                for p in first..first + n {
                    match self.pages.get_mut(&p) {
                        Some(page) => page.locked = lock,
                        None => return Outcome::Err(ENOMEM),
                    }
                }
                if lock {
                    // Populated in order up to the first PROT_NONE page.
                    for p in first..first + n {
                        if self.pages[&p].prot == 0 {
                            return Outcome::Err(ENOMEM);
                        }
                        let write = writable(self.pages[&p].prot);
                        self.fault_in(p, write);
                    }
                }
                Outcome::Ok
            }
            TOp::Brk { off } => self.brk(off),
            TOp::Fork | TOp::Switch(_) | TOp::Exit => unreachable!("the model has one process: {op:?}"),
            TOp::MmapFile { .. } | TOp::Msync { .. } => unreachable!("the model has no files: {op:?}"),
            TOp::Mremap { .. } => unreachable!("the model has no mappings: {op:?}"),
            TOp::Abs(a) => Outcome::Err(match a {
                AbsOp::MunmapHugeLen | AbsOp::MunmapAboveTask => EINVAL,
                AbsOp::MprotectAlignOverflow | AbsOp::MprotectWrapEnd => ENOMEM,
                AbsOp::MadviseHugeLen | AbsOp::MadviseWrapEnd => EINVAL,
                AbsOp::MadviseAboveTask => ENOMEM,
                AbsOp::MmapHugeLen | AbsOp::MmapAlignOverflow | AbsOp::MmapFixedTop => ENOMEM,
                AbsOp::MmapNoType => EINVAL,
            }),
        }
    }

    fn mmap(&mut self, place: Place, off: u64, len: u64, prot: u32, flags: u32) -> Outcome {
        if len == 0 {
            return Outcome::Err(EINVAL);
        }
        let ty = flags & (libc::MAP_SHARED | libc::MAP_PRIVATE) as u32;
        let shared = ty == libc::MAP_SHARED as u32;
        let valid_type = shared || ty == libc::MAP_PRIVATE as u32;
        let locked = flags & libc::MAP_LOCKED as u32 != 0;
        // MAP_POPULATE (unless MAP_NONBLOCK) and MAP_LOCKED fault every
        // page in; PROT_NONE populates nothing.
        let populate =
            prot != 0 && (locked || (flags & libc::MAP_POPULATE as u32 != 0 && flags & libc::MAP_NONBLOCK as u32 == 0));
        let n = align_up(len) / P;
        match place {
            Place::Fixed | Place::NoReplace => {
                if !off.is_multiple_of(P) {
                    return Outcome::Err(EINVAL);
                }
                if place == Place::NoReplace && !self.range_free(off / P, n) {
                    return Outcome::Err(libc::EEXIST);
                }
                if !valid_type {
                    return Outcome::Err(EINVAL);
                }
                self.map(off / P, n, prot, shared, locked);
                if populate {
                    (off / P..off / P + n).for_each(|p| self.fault_in(p, writable(prot)));
                }
                Outcome::Addr(off)
            }
            Place::HintShared if off.is_multiple_of(P) && self.range_free(off / P, n) => {
                self.map(off / P, n, prot, true, locked);
                if populate {
                    (off / P..off / P + n).for_each(|p| self.fault_in(p, writable(prot)));
                }
                Outcome::Addr(off)
            }
            Place::HintShared | Place::AnywhereShared => Outcome::Elsewhere,
        }
    }

    /// Walk `off..off+len` page by page while `ok(prot)`; `f(model, page,
    /// offset in page, n)` for each accessible piece; the first fault as
    /// (window offset, si_code).
    /// A store of `pattern(seed, len)` at `off` over the pages `ok` allows.
    /// `brk`: the pages above a lower break go if any is mapped; the pages
    /// up to a higher one come (read-write, private) if they and the page
    /// above them are free (the window's top guard is mapped).
    fn brk(&mut self, want: u64) -> Outcome {
        let brk = self.brk.unwrap_or(HEAP_OFF);
        if want < HEAP_OFF {
            return Outcome::Addr(brk);
        }
        let (new, old) = (align_up(want) / P, align_up(brk) / P);
        let done = if new == old {
            true
        } else if want <= brk {
            let any = self.pages.range(new..old).next().is_some();
            if any {
                (new..old).for_each(|p| drop(self.pages.remove(&p)));
            }
            any
        } else if new < WINDOW_PAGES && self.range_free(old, new + 1 - old) {
            self.map(old, new - old, (libc::PROT_READ | libc::PROT_WRITE) as u32, false, false);
            true
        } else {
            false
        };
        if done {
            self.brk = Some(want);
        }
        Outcome::Addr(self.brk.unwrap_or(HEAP_OFF))
    }

    fn write(&mut self, off: u64, len: u64, seed: u8, ok: impl Fn(&Page) -> bool) -> Outcome {
        let pat = pattern(seed, len as usize);
        let mut done = 0;
        let mut writes = Vec::new();
        let r = self.walk(off, len, ok, |_, page, at, n| {
            writes.push((page, at, done, n));
            done += n;
        });
        for (page, at, from, n) in writes {
            self.store(page, at, &pat[from..from + n]);
        }
        Model::visited(off, len, r.map(|f| f.0)).for_each(|p| self.fault_in(p, true));
        match r {
            None => Outcome::Ok,
            Some((fault, code)) => Outcome::Segv { off: fault as i64, code, data: Vec::new() },
        }
    }

    fn walk(
        &self,
        off: u64,
        len: u64,
        ok: impl Fn(&Page) -> bool,
        mut f: impl FnMut(&Model, u64, usize, usize),
    ) -> Option<(u64, i32)> {
        let mut done = 0;
        while done < len {
            let a = off + done;
            let page = a / P;
            let at = (a % P) as usize;
            let n = ((P as usize) - at).min((len - done) as usize);
            match self.pages.get(&page) {
                None => return Some((a, 1)),
                Some(p) if !ok(p) => return Some((a, 2)),
                Some(_) => f(self, page, at, n),
            }
            done += n as u64;
        }
        None
    }

    /// Every readable and resident page's bytes, for a whole-window
    /// comparison. Reading a page faults it in, which `mincore` would then
    /// see and the model would not: a page that is not resident holds
    /// zeros here, as the reads the sequences make check.
    pub fn readable_pages(&self) -> Vec<(u64, Vec<u8>)> {
        self.pages
            .iter()
            .filter(|&(&k, p)| readable(p.prot) && self.resident(k))
            .map(|(&k, _)| (k, self.bytes(k)))
            .collect()
    }
}
