//! Faults racing mmap, munmap, mprotect and madvise on neighbouring and
//! overlapping ranges, in every fault path.
//!
//! One vCPU mutates a region; its operations are numbered (a counter that
//! is odd while one is in progress) and the model's state after each is
//! kept. Faulting vCPUs load, store and touch pages of the region and log,
//! with every access, the counter before and after it. Afterwards every
//! logged result must be one that *some* state in that window allows:
//!
//! - success, SEGV_MAPERR or SEGV_ACCERR as the page's state says;
//! - a value written and read back intact, or zero only if the page was
//!   replaced (mmap over it, munmap, DONTNEED) in between;
//!
//! and once everyone has stopped, every page must behave as the final
//! state says (a stale PTE would let an access through that should fault),
//! and unmapping everything must give every frame back.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use common::{FAULT_PATHS, test_vm};
use vmfault::{Access, AddressSpace, Advice, Error, FaultPath, MapFlags, Prot, SegvCode};

const P: u64 = 4096;
const PAGES: u64 = 32;
const BASE: u64 = 0x4000_0000_0000;
const FAULTERS: usize = 3;
const MUTATIONS: usize = 1500;

/// A small deterministic generator (xorshift64*), seeded per thread.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PageState {
    mapped: bool,
    prot: Prot,
    /// Bumped whenever the page's contents are replaced.
    generation: u32,
}

type State = [PageState; PAGES as usize];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Got {
    Ok,
    MapErr,
    AccErr,
}

#[derive(Debug)]
enum Record {
    /// An access (`write`: a store) with its outcome.
    Access { page: u64, write: bool, got: Got, window: (u64, u64) },
    /// A value stored and read back: what came back.
    ReadBack { page: u64, stored: u64, back: Option<u64>, window: (u64, u64) },
}

fn got(r: Result<(), Error>) -> Got {
    match r {
        Ok(()) => Got::Ok,
        Err(Error::Segv { code: SegvCode::MapErr, .. }) => Got::MapErr,
        Err(Error::Segv { code: SegvCode::AccErr, .. }) => Got::AccErr,
        Err(e) => panic!("unexpected error {e}"),
    }
}

fn allowed(s: &PageState, write: bool) -> Got {
    if !s.mapped {
        Got::MapErr
    } else if (write && !s.prot.contains(Prot::WRITE)) || (!write && s.prot.is_empty()) {
        Got::AccErr
    } else {
        Got::Ok
    }
}

/// The states an access that saw the counter go from `a` to `b` may have met.
fn window(states: &[State], (a, b): (u64, u64)) -> &[State] {
    let lo = (a / 2) as usize;
    let hi = (b.div_ceil(2) as usize).min(states.len() - 1);
    &states[lo..=hi]
}

fn addr(page: u64) -> u64 {
    BASE + page * P
}

/// One mutation chosen from the current state; applied to `space` and `state`.
fn mutate(space: &AddressSpace, state: &mut State, rng: &mut Rng) {
    let first = rng.range(0, PAGES);
    let n = rng.range(1, 9).min(PAGES - first);
    let range = first as usize..(first + n) as usize;
    let all_mapped = state[range.clone()].iter().all(|p| p.mapped);
    let pa = MapFlags::PRIVATE | MapFlags::ANONYMOUS | MapFlags::FIXED;
    let prots = [Prot::NONE, Prot::READ, Prot::READ | Prot::WRITE];
    match rng.range(0, 11) {
        // A fork changes nothing the parent can see, but it write-protects
        // every private PTE, moves pages up collapsed chains and makes the
        // next store a copy-on-write fault.
        10 => drop(space.fork().unwrap()),
        0..=3 => {
            let prot = if rng.chance(0.75) { Prot::READ | Prot::WRITE } else { Prot::READ };
            space.mmap(addr(first), n * P, prot, pa).unwrap();
            for p in &mut state[range] {
                *p = PageState { mapped: true, prot, generation: p.generation + 1 };
            }
        }
        4..=5 => {
            space.munmap(addr(first), n * P).unwrap();
            for p in &mut state[range] {
                *p = PageState { mapped: false, prot: Prot::NONE, generation: p.generation + 1 };
            }
        }
        6..=8 if all_mapped => {
            let prot = prots[rng.range(0, 3) as usize];
            space.mprotect(addr(first), n * P, prot).unwrap();
            for p in &mut state[range] {
                p.prot = prot;
            }
        }
        _ if all_mapped => {
            space.madvise(addr(first), n * P, Advice::DontNeed).unwrap();
            for p in &mut state[range] {
                p.generation += 1;
            }
        }
        _ => {}
    }
}

fn faulter(
    space: &AddressSpace,
    t: usize,
    seq: &AtomicU64,
    done: &AtomicBool,
    progress: &AtomicU64,
    seed: u8,
) -> Vec<Record> {
    let mut rng = Rng::new(seed.into());
    let mut log = Vec::new();
    let mut counter = 0u64;
    let slot = |page: u64| addr(page) + 64 * t as u64 + 8;
    while !done.load(Ordering::Relaxed) {
        let page = rng.range(0, PAGES);
        if rng.chance(0.5) {
            counter += 1;
            let stored = ((t as u64 + 1) << 56) | counter;
            let a = seq.load(Ordering::SeqCst);
            let w = space.write(slot(page), &stored.to_le_bytes());
            let b = seq.load(Ordering::SeqCst);
            let g = got(w);
            log.push(Record::Access { page, write: true, got: g, window: (a, b) });
            if g == Got::Ok {
                let mut buf = [0u8; 8];
                let back = space.read(slot(page), &mut buf).ok().map(|_| u64::from_le_bytes(buf));
                let c = seq.load(Ordering::SeqCst);
                log.push(Record::ReadBack { page, stored, back, window: (a, c) });
            }
        } else {
            let write = rng.chance(0.3);
            let a = seq.load(Ordering::SeqCst);
            let r = space.touch(addr(page) + rng.range(0, P), if write { Access::Write } else { Access::Read });
            let b = seq.load(Ordering::SeqCst);
            log.push(Record::Access { page, write, got: got(r), window: (a, b) });
        }
        progress.fetch_add(1, Ordering::Relaxed);
    }
    log
}

fn check(states: &[State], log: &[Record], path: FaultPath) {
    for r in log {
        match *r {
            Record::Access { page, write, got, window: w } => {
                let ok = window(states, w).iter().any(|s| allowed(&s[page as usize], write) == got);
                assert!(ok, "fault_path={}: {r:?} is not allowed by any state in its window", path.name());
            }
            Record::ReadBack { page, stored, back, window: w } => {
                let states = window(states, w);
                let replaced =
                    states.windows(2).any(|s| s[0][page as usize].generation != s[1][page as usize].generation);
                let ok = match back {
                    Some(v) if v == stored => true,
                    Some(0) => replaced,
                    Some(_) => false,
                    None => states.iter().any(|s| allowed(&s[page as usize], false) != Got::Ok),
                };
                assert!(
                    ok,
                    "fault_path={}: {r:?}: value lost or corrupted (replaced in window: {replaced})",
                    path.name()
                );
            }
        }
    }
}

fn race(path: FaultPath) {
    let vm = test_vm(32 << 20, FAULTERS + 1, path);
    let space = vm.new_space().unwrap();
    let initial = vm.stats().free_pages;
    let seq = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicBool::new(false));
    // The faulters' accesses so far: the mutator waits for at least one
    // after each mutation, so the race happens however the threads are
    // scheduled (no timing assumption).
    let progress = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(FAULTERS + 1));
    let fresh = PageState { mapped: false, prot: Prot::NONE, generation: 0 };
    let faulters: Vec<_> = (0..FAULTERS)
        .map(|t| {
            let (vm, space, seq, done, start) = (vm.clone(), space.clone(), seq.clone(), done.clone(), start.clone());
            let progress = progress.clone();
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                start.wait();
                faulter(&space, t, &seq, &done, &progress, t as u8 + 10)
            })
        })
        .collect();
    let _cpu = vm.attach().unwrap();
    let mut rng = Rng::new(7);
    let mut state: State = [fresh; PAGES as usize];
    let mut states = vec![state];
    start.wait();
    for _ in 0..MUTATIONS {
        seq.fetch_add(1, Ordering::SeqCst);
        mutate(&space, &mut state, &mut rng);
        states.push(state);
        seq.fetch_add(1, Ordering::SeqCst);
        let seen = progress.load(Ordering::Relaxed);
        let mut spins = 0u32;
        while progress.load(Ordering::Relaxed) == seen {
            // Spin while the faulters run beside us; yield only if they
            // are not running (a yield costs a whole time slice).
            spins += 1;
            if spins < 100_000 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
    done.store(true, Ordering::Relaxed);
    let logs: Vec<Vec<Record>> = faulters.into_iter().map(|f| f.join().unwrap()).collect();
    let accesses: usize = logs.iter().map(Vec::len).sum();
    assert!(accesses >= MUTATIONS, "fault_path={}: only {accesses} accesses raced", path.name());
    for log in &logs {
        check(&states, log, path);
    }
    // No stale translation anywhere: every page behaves as the final state says.
    for page in 0..PAGES {
        for write in [false, true] {
            let access = if write { Access::Write } else { Access::Read };
            let g = got(space.touch(addr(page), access));
            assert_eq!(
                g,
                allowed(&state[page as usize], write),
                "fault_path={}: page {page} after the race",
                path.name()
            );
        }
    }
    space.munmap(BASE, PAGES * P).unwrap();
    assert_eq!(common::settled_at(&vm, initial).free_pages, initial, "fault_path={}: frames leaked", path.name());
    let s = vm.stats();
    println!(
        "fault_path={}: {accesses} accesses against {MUTATIONS} mutations; spf {} (changed {}, noanon {}, pmd {}), vma_lock {} (fallbacks {})",
        path.name(),
        s.spf,
        s.spf_vma_changed,
        s.spf_vma_noanon,
        s.spf_pmd_changed,
        s.vma_lock,
        s.vma_lock_fallbacks
    );
}

#[test]
fn faults_racing_mmap_munmap_mprotect_madvise() {
    for path in FAULT_PATHS {
        race(path);
    }
}

/// First faults of several vCPUs on one VMA that has no object yet race
/// to give it one with no lock (`fault::resolve::prepare`): exactly one
/// object wins, every vCPU's store lands in it, and the reverse map holds
/// exactly one record for the VMA (a loser forgets the record it made
/// before publishing; a winner's record is there before any page of its
/// object is mapped). The VMA's lower neighbour has an object it may
/// share (same flags but for the access rights, as Linux's
/// `anon_vma_compatible`), so every racer adopts that one, and a loser's
/// record would stay on it. The faulting vCPUs stay attached and start
/// each round together on a spinning flag, so their first faults overlap.
#[test]
fn first_faults_on_one_vma_race_for_its_object() {
    use std::sync::atomic::AtomicUsize;
    const THREADS: usize = 2;
    const ROUNDS: u64 = 2000;
    let wait_for = |cond: &dyn Fn() -> bool| {
        let mut spins = 0u32;
        while !cond() {
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    };
    for path in FAULT_PATHS {
        let vm = test_vm(32 << 20, THREADS + 1, path);
        let space = vm.new_space().unwrap();
        let _cpu = vm.attach().unwrap();
        let (round, addr, done) = (AtomicU64::new(0), AtomicU64::new(0), AtomicUsize::new(0));
        // A failed check stops the workers (round `u64::MAX`) before the
        // scope joins them, so that a failure is reported, not a hang.
        let failed = std::thread::scope(|s| {
            for t in 0..THREADS as u64 {
                let (vm, space, round, addr, done) = (&vm, &space, &round, &addr, &done);
                s.spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    for r in 1..=ROUNDS {
                        wait_for(&|| round.load(Ordering::Acquire) >= r);
                        if round.load(Ordering::Acquire) == u64::MAX {
                            return;
                        }
                        let a = addr.load(Ordering::Relaxed);
                        space.write(a + t * P, &(r << 8 | t).to_le_bytes()).unwrap();
                        done.fetch_add(1, Ordering::Release);
                    }
                });
            }
            let (rw, fixed) = (Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS | MapFlags::FIXED);
            let len = THREADS as u64 * P;
            let check = |r: u64| -> Result<(), String> {
                space.mmap(BASE, P, rw, fixed).unwrap();
                space.write(BASE, &[1]).unwrap();
                let a = space.mmap(BASE + P, len, rw | Prot::EXEC, fixed).unwrap();
                addr.store(a, Ordering::Relaxed);
                round.store(r, Ordering::Release);
                wait_for(&|| done.load(Ordering::Acquire) == THREADS * r as usize);
                let records = vm.stats().backing_records;
                if records != 2 {
                    return Err(format!("{path:?}, round {r}: two VMAs, {records} records"));
                }
                for t in 0..THREADS as u64 {
                    let mut buf = [0; 8];
                    space.read(a + t * P, &mut buf).unwrap();
                    if u64::from_le_bytes(buf) != r << 8 | t {
                        return Err(format!("{path:?}, round {r}, page {t}: {buf:?}"));
                    }
                }
                space.munmap(BASE, P + len).unwrap();
                match vm.stats().backing_records {
                    0 => Ok(()),
                    n => Err(format!("{path:?}, round {r}: unmapped, {n} records")),
                }
            };
            let failed = (1..=ROUNDS).find_map(|r| check(r).err());
            if failed.is_some() {
                round.store(u64::MAX, Ordering::Release);
            }
            failed
        });
        if let Some(f) = failed {
            panic!("{f}");
        }
        eprintln!("{path:?}: {} of {ROUNDS} rounds raced for the object", vm.stats().anon_races);
    }
}
