//! The soak: more vCPUs than cores on a small machine with swap and remote
//! drains at a high rate, each vCPU running a random mix of mmap, munmap,
//! mprotect, madvise, mlock, fork, msync, loads and stores over its own
//! private anonymous, shared anonymous and shared file mappings, and
//! checking every load (and the file after every `msync`) against a shadow
//! copy. A watchdog fails the test when no vCPU makes progress for 60 s,
//! with every thread's backtrace (gdb). At the end every frame is free
//! again and no swap slot is in use.
//!
//! `VMFAULT_SOAK_SECS`: seconds per fault path (default 6; by hand, 60 or
//! more). `VMFAULT_SOAK_SEED` picks the random streams (default: the
//! clock; the seed is printed so that a failure can be run again).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::files::TempFile;
use vmfault::{AddressSpace, Error, FaultPath, MapFlags, Prot, SegvCode, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);
/// vCPU threads (the machine has 2 cores).
const WORKERS: u64 = 4;
/// Pages of each worker's regions.
const PRIV_PAGES: u64 = 48;
const SHARED_PAGES: u64 = 12;
const FILE_PAGES: u64 = 12;
/// Frames: a little less than the workers' pages, so the daemon pages out.
const PHYS: u64 = 256;

/// The contents of a page at `version` (0: zeros); every word differs.
fn page_of(version: u64) -> Vec<u8> {
    if version == 0 {
        return vec![0; P as usize];
    }
    (0..P / 8).flat_map(|w| (version.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ w ^ 1).to_le_bytes()).collect()
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One region of a worker and what each of its pages must hold.
struct Region {
    kind: Kind,
    base: u64,
    versions: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Private,
    Shared,
    File,
}

struct Worker {
    id: u64,
    space: AddressSpace,
    rng: Rng,
    regions: Vec<Region>,
    file: TempFile,
    next_version: u64,
    /// What the worker is doing (for the watchdog's report).
    doing: Arc<AtomicU64>,
}

impl Worker {
    fn flags(kind: Kind) -> MapFlags {
        match kind {
            Kind::Private => MapFlags::PRIVATE | MapFlags::ANONYMOUS,
            Kind::Shared => MapFlags::SHARED | MapFlags::ANONYMOUS,
            Kind::File => MapFlags::SHARED,
        }
    }

    fn map(&self, kind: Kind, pages: u64) -> u64 {
        match kind {
            Kind::File => self.space.mmap_file(0, pages * P, RW, Self::flags(kind), &self.file.rw(), 0).unwrap(),
            _ => self.space.mmap(0, pages * P, RW, Self::flags(kind)).unwrap(),
        }
    }

    fn version(&mut self) -> u64 {
        self.next_version += 1;
        (self.id << 48) | self.next_version
    }

    fn check(&self, space: &AddressSpace, r: &Region, page: u64, what: &str) {
        let mut buf = vec![0u8; P as usize];
        space.read(r.base + page * P, &mut buf).unwrap();
        let want = r.versions[page as usize];
        assert!(
            buf == page_of(want),
            "worker {}: {what}: page {page} of its {:?} region lost its contents (want version {want:#x}, first word {:#x})",
            self.id,
            r.kind,
            u64::from_le_bytes(buf[..8].try_into().unwrap())
        );
    }

    fn step(&mut self) {
        let op = self.rng.below(100);
        let ri = self.rng.below(self.regions.len() as u64) as usize;
        let pages = self.regions[ri].versions.len() as u64;
        let page = self.rng.below(pages);
        let kind = self.regions[ri].kind;
        self.doing.store(op << 8 | ri as u64, Ordering::Relaxed);
        match op {
            0..=34 => {
                let v = self.version();
                let r = &mut self.regions[ri];
                self.space.write(r.base + page * P, &page_of(v)).unwrap();
                r.versions[page as usize] = v;
            }
            35..=69 => self.check(&self.space, &self.regions[ri], page, "load"),
            70..=73 => {
                // MADV_DONTNEED: private anonymous memory reads zeros after.
                let len = self.rng.below(pages - page) + 1;
                let r = &mut self.regions[ri];
                self.space.madvise(r.base + page * P, len * P, vmfault::Advice::DontNeed).unwrap();
                if kind == Kind::Private {
                    r.versions[page as usize..(page + len) as usize].fill(0);
                }
            }
            74..=77 => {
                // Read-only for a moment: a store faults and changes nothing.
                let r = &self.regions[ri];
                let a = r.base + page * P;
                self.space.mprotect(a, P, Prot::READ).unwrap();
                let e = self.space.write(a, b"no").unwrap_err();
                assert_eq!(e, Error::Segv { addr: a, code: SegvCode::AccErr });
                self.check(&self.space, r, page, "after a refused store");
                self.space.mprotect(a, P, RW).unwrap();
            }
            78..=80 => {
                // Unmap and map again: anonymous memory starts over, a
                // file mapping finds what munmap wrote back.
                let r = &mut self.regions[ri];
                self.space.munmap(r.base, pages * P).unwrap();
                if kind != Kind::File {
                    r.versions.fill(0);
                }
                let base = self.map(kind, pages);
                self.regions[ri].base = base;
            }
            81..=84 => {
                let len = (self.rng.below(pages - page) + 1).min(4);
                let a = self.regions[ri].base + page * P;
                match self.space.mlock(a, len * P) {
                    Ok(()) | Err(Error::TryAgain { .. }) => {}
                    Err(e) => panic!("worker {}: mlock: {e}", self.id),
                }
                self.check(&self.space, &self.regions[ri], page, "locked");
                self.space.munlock(a, len * P).unwrap();
            }
            85..=88 => self.fork_and_check(),
            _ => {
                if kind == Kind::File {
                    self.msync_and_compare(ri, page);
                } else {
                    self.check(&self.space, &self.regions[ri], page, "load");
                }
            }
        }
    }

    /// A child sees every page as the parent had it; its private stores
    /// stay its own, its shared stores reach the parent.
    fn fork_and_check(&mut self) {
        let child = match self.space.fork() {
            Ok(c) => c,
            Err(Error::NoMemory { .. }) => return,
            Err(e) => panic!("worker {}: fork: {e}", self.id),
        };
        // The child's own private stores (its view of those pages).
        let mut own = std::collections::HashMap::new();
        for _ in 0..4 {
            let ri = self.rng.below(self.regions.len() as u64) as usize;
            let page = self.rng.below(self.regions[ri].versions.len() as u64);
            let r = &self.regions[ri];
            match own.get(&(ri, page)) {
                Some(&v) => {
                    let mut buf = vec![0u8; P as usize];
                    child.read(r.base + page * P, &mut buf).unwrap();
                    assert!(buf == page_of(v), "worker {}: the child lost its own store", self.id);
                }
                None => self.check(&child, r, page, "in a child"),
            }
            let v = self.version();
            let r = &self.regions[ri];
            child.write(r.base + page * P, &page_of(v)).unwrap();
            if r.kind == Kind::Private {
                self.check(&self.space, r, page, "after the child's private store");
                own.insert((ri, page), v);
            } else {
                self.regions[ri].versions[page as usize] = v;
            }
        }
        drop(child);
    }

    /// `msync`, then the file holds what the shadow says.
    fn msync_and_compare(&mut self, ri: usize, page: u64) {
        use std::os::unix::fs::FileExt;
        let r = &self.regions[ri];
        self.space.msync(r.base, r.versions.len() as u64 * P).unwrap();
        let mut disk = vec![0u8; P as usize];
        self.file.ro().read_exact_at(&mut disk, page * P).unwrap();
        let want = r.versions[page as usize];
        assert!(
            disk == page_of(want),
            "worker {}: after msync page {page} of the file is not version {want:#x}",
            self.id
        );
    }

    fn finish(mut self) {
        for r in std::mem::take(&mut self.regions) {
            for page in 0..r.versions.len() as u64 {
                self.check(&self.space, &r, page, "at the end");
            }
            self.space.munmap(r.base, r.versions.len() as u64 * P).unwrap();
        }
        // munmap wrote the file back.
        let disk = self.file.contents();
        assert_eq!(disk.len() as u64, FILE_PAGES * P);
    }
}

/// Every thread's backtrace, from gdb, if it is installed.
fn backtraces() -> String {
    let pid = std::process::id().to_string();
    std::process::Command::new("gdb")
        .args(["-p", &pid, "-batch", "-ex", "thread apply all bt 30"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_else(|e| format!("(no gdb: {e})"))
}

fn soak(path: FaultPath, secs: f64, seed: u64) {
    let swap = std::env::temp_dir().join(format!("vmfault-soak-{}-{}.swap", std::process::id(), path.name()));
    let cfg = VmConfig {
        phys_bytes: PHYS * P,
        cpus: WORKERS as usize + 1,
        prefault: false,
        fault_path: path,
        swap: Some(swap),
        pcpu_drain_hz: 1000,
        ..VmConfig::default()
    };
    let vm = Vm::new(cfg).unwrap();
    let initial = vm.stats().free_pages;
    let space = vm.new_space().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let progress: Vec<Arc<AtomicU64>> = (0..WORKERS).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let doing: Vec<Arc<AtomicU64>> = (0..WORKERS).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let workers: Vec<_> = (0..WORKERS)
        .map(|id| {
            let (vm, space, stop) = (vm.clone(), space.clone(), stop.clone());
            let (done, doing) = (progress[id as usize].clone(), doing[id as usize].clone());
            std::thread::Builder::new()
                .name(format!("soak-{id}"))
                .spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    let contents: Vec<u8> = (0..FILE_PAGES).flat_map(|p| page_of((id << 48) | (1 << 40) | p)).collect();
                    let file = TempFile::new(&contents);
                    let mut w = Worker {
                        id,
                        space,
                        rng: Rng(seed ^ (id + 1).wrapping_mul(0x2545_f491_4f6c_dd1d) | 1),
                        regions: Vec::new(),
                        file,
                        next_version: 0,
                        doing,
                    };
                    for (kind, pages) in
                        [(Kind::Private, PRIV_PAGES), (Kind::Shared, SHARED_PAGES), (Kind::File, FILE_PAGES)]
                    {
                        let base = w.map(kind, pages);
                        let versions = match kind {
                            Kind::File => (0..pages).map(|p| (id << 48) | (1 << 40) | p).collect(),
                            _ => vec![0; pages as usize],
                        };
                        w.regions.push(Region { kind, base, versions });
                    }
                    while !stop.load(Ordering::Relaxed) {
                        w.step();
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    w.finish();
                })
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut last = (Instant::now(), 0u64);
    while Instant::now() < deadline && !workers.iter().any(|w| w.is_finished()) {
        std::thread::sleep(Duration::from_millis(100));
        let total: u64 = progress.iter().map(|p| p.load(Ordering::Relaxed)).sum();
        if total != last.1 {
            last = (Instant::now(), total);
        } else if last.0.elapsed() > Duration::from_secs(60) {
            let doing: Vec<u64> = doing.iter().map(|d| d.load(Ordering::Relaxed)).collect();
            panic!(
                "{path:?}: no progress for 60 s (ops {total}; each worker's op<<8|region: {doing:x?}); stats {:?}\n{}",
                vm.stats(),
                backtraces()
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut failed = None;
    for w in workers {
        if let Err(e) = w.join() {
            failed.get_or_insert(e);
        }
    }
    if let Some(e) = failed {
        eprintln!("{path:?}: a worker failed; machine: {:#?}", vm.stats());
        std::panic::resume_unwind(e);
    }
    let ops: u64 = progress.iter().map(|p| p.load(Ordering::Relaxed)).sum();
    let s = vm.stats();
    drop(space);
    vm.drop_caches();
    let settle = Instant::now() + Duration::from_secs(10);
    while (vm.stats().free_pages, vm.stats().swap_used_pages) != (initial, 0) && Instant::now() < settle {
        std::thread::sleep(Duration::from_millis(5));
        // Deferred frees (of vCPUs that have left) complete in a drain.
        vm.drain_pcpu_caches();
    }
    let end = vm.stats();
    println!(
        "soak {}: {secs} s, {ops} operations, {} faults, {} pageouts, {} page-ins, {} file pageouts, {} forks, \
         {} remote drains; 0 lost bytes; leaked frames {}, swap slots in use {}",
        path.name(),
        s.faults,
        s.pageouts,
        s.pageins,
        s.file_pageouts,
        s.forks,
        s.pcp_remote_drains,
        initial as i64 - end.free_pages as i64,
        end.swap_used_pages
    );
    assert!(ops > 100, "{path:?}: only {ops} operations ran");
    assert_eq!(end.free_pages, initial, "{path:?}: frames leaked");
    assert_eq!(end.swap_used_pages, 0, "{path:?}: swap slots leaked");
}

#[test]
fn soak_every_fault_path() {
    let secs = std::env::var("VMFAULT_SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(6.0);
    let seed = std::env::var("VMFAULT_SOAK_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    println!("soak seed {seed} (VMFAULT_SOAK_SEED={seed} runs it again)");
    for path in common::FAULT_PATHS {
        soak(path, secs, seed);
    }
}
