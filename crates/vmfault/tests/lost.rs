//! Nothing lost: regressions for data-loss bugs found by an outside test
//! (each failed on the commit before its fix), and their siblings.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::FAULT_PATHS;
use common::files::TempFile;
use vmfault::{FaultPath, MapFlags, Prot, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);

fn swap_vm(name: &str, phys_pages: u64, cpus: usize, path: FaultPath) -> Vm {
    let swap = std::env::temp_dir().join(format!("vmfault-test-lost-{name}-{}.swap", std::process::id()));
    let c = VmConfig {
        phys_bytes: phys_pages * P,
        cpus,
        prefault: false,
        fault_path: path,
        swap: Some(swap),
        ..VmConfig::default()
    };
    Vm::new(c).unwrap()
}

/// Page `page` of file `tag`: every 8-byte word differs, none is zero.
fn pattern(tag: u64, page: u64) -> Vec<u8> {
    (0..P / 8).flat_map(|w| ((tag << 56) ^ (page << 20) ^ w ^ 0x0101_0101_0101_0101).to_le_bytes()).collect()
}

/// A tiny xorshift.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// How long the stress tests run, per fault path
/// (`VMFAULT_LOST_SECS`, default 2 s).
fn stress_time() -> Duration {
    let secs = std::env::var("VMFAULT_LOST_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(2.0);
    Duration::from_secs_f64(secs)
}

/// Problem 1: a fault on a shared (or private) file page that the page
/// daemon evicts between the classic path's two lookups took the page for
/// untouched private memory: a read mapped the shared zero page (the file
/// page read as zeros), a write stored into the zero frame itself, which
/// every untouched private page of the machine then showed.
///
/// Two vCPUs read and write a file mapping four times physical memory
/// (private and shared views of one file) while the daemon evicts its
/// pages; every load must see the file's bytes or the vCPU's own stores,
/// and an untouched private anonymous page must read zeros throughout.
#[test]
fn file_pages_evicted_under_a_fault_are_read_again() {
    for path in FAULT_PATHS {
        const PHYS: u64 = 128;
        let pages = 4 * PHYS;
        let contents: Vec<u8> = (0..pages).flat_map(|p| pattern(1, p)).collect();
        let file = TempFile::new(&contents);
        let vm = swap_vm("evict", PHYS, 3, path);
        let space = vm.new_space().unwrap();
        let shared = space.mmap_file(0, pages * P, RW, MapFlags::SHARED, &file.rw(), 0).unwrap();
        let private = space.mmap_file(0, pages * P, RW, MapFlags::PRIVATE, &file.ro(), 0).unwrap();
        let anon = space.mmap(0, 4 * P, Prot::READ, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let deadline = Instant::now() + stress_time();
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let (vm, space, stop) = (vm.clone(), space.clone(), stop.clone());
                std::thread::spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    let mut x = 0x9e37_79b9 + t;
                    let mut buf = vec![0u8; P as usize];
                    let mut n = 0u64;
                    // Each vCPU writes only its own pages (even or odd), so
                    // it knows what every page it reads must hold.
                    let mut mine = std::collections::HashMap::new();
                    while !stop.load(Ordering::Relaxed) {
                        let page = next(&mut x) % pages;
                        let (base, own) = if next(&mut x) % 2 == 0 { (shared, true) } else { (private, false) };
                        // Private copies stay few: they go to swap, which
                        // holds twice physical memory.
                        if page % 2 == t && (own || page < 64) && next(&mut x) % 4 == 0 {
                            let v = next(&mut x) | 1;
                            space.write(base + page * P + 8, &v.to_le_bytes()).unwrap();
                            mine.insert((own, page), v);
                        }
                        if let Err(e) = space.read(base + page * P, &mut buf) {
                            panic!("{path:?}: {e:?}\n{:#?}", vm.stats());
                        }
                        let mut want = pattern(1, page);
                        if let Some(v) = mine.get(&(own, page)) {
                            want[8..16].copy_from_slice(&v.to_le_bytes());
                        } else if page % 2 != t {
                            // The other vCPU may have stored into it.
                            want[8..16].copy_from_slice(&buf[8..16]);
                        }
                        assert!(
                            buf == want,
                            "{path:?}: page {page} of the {} mapping lost its bytes",
                            if own { "shared" } else { "private" }
                        );
                        let mut z = [0u8; 64];
                        space.read(anon + (n % 4) * P, &mut z).unwrap();
                        assert_eq!(z, [0u8; 64], "{path:?}: the zero page took a store");
                        n += 1;
                    }
                    n
                })
            })
            .collect();
        while Instant::now() < deadline && !workers.iter().any(|w| w.is_finished()) {
            std::thread::sleep(Duration::from_millis(10));
        }
        stop.store(true, Ordering::Relaxed);
        let done: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        let s = vm.stats();
        assert!(s.file_pageouts > 0, "{path:?}: the daemon never evicted a file page ({done} accesses)");
        drop(space);
    }
}

/// Problem 3: `msync` skipped a dirty page whose write-back another
/// writer (here a second vCPU's `msync`) had just begun, and returned
/// before that writer had written it: Linux's `msync(MS_SYNC)` waits for
/// pages under write-back in its range.
#[test]
fn msync_waits_for_a_write_back_already_under_way() {
    use std::os::unix::fs::FileExt;
    for path in FAULT_PATHS {
        let file = TempFile::new(&[0u8; P as usize]);
        let vm = common::test_vm(4 << 20, 3, path);
        let space = vm.new_space().unwrap();
        let a = space.mmap_file(0, P, RW, MapFlags::SHARED, &file.rw(), 0).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let other = {
            let (vm, space, stop) = (vm.clone(), space.clone(), stop.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    space.msync(a, P).unwrap();
                    n += 1;
                }
                n
            })
        };
        let _cpu = vm.attach().unwrap();
        let reader = file.ro();
        let deadline = Instant::now() + stress_time() / 2;
        let mut i = 0u64;
        while Instant::now() < deadline {
            i += 1;
            space.write(a, &i.to_le_bytes()).unwrap();
            space.msync(a, P).unwrap();
            let mut got = [0u8; 8];
            reader.read_exact_at(&mut got, 0).unwrap();
            assert_eq!(u64::from_le_bytes(got), i, "{path:?}: msync returned before store {i} was in the file");
        }
        stop.store(true, Ordering::Relaxed);
        let theirs = other.join().unwrap();
        assert!(i > 100 && theirs > 100, "{path:?}: {i} stores, {theirs} msyncs of the other vCPU");
    }
}

/// Problem 5: with swap and memory pressure, while one vCPU forks the
/// space and drops the child in a loop (the child's end writes the shared
/// file pages back), another vCPU's stores to shared file pages were lost:
/// two write-backs of one page were in flight, the first to end cleared
/// the one `WRITEBACK` bit, the daemon evicted and freed the page, and
/// the second copied the reused frame into the file. A third vCPU keeps
/// memory short with private pages.
#[test]
fn shared_file_pages_survive_forks_and_pageout() {
    use std::os::unix::fs::FileExt;
    for path in FAULT_PATHS {
        const PHYS: u64 = 160;
        const PAGES: u64 = 64;
        let contents: Vec<u8> = (0..PAGES).flat_map(|p| pattern(2, p)).collect();
        let file = TempFile::new(&contents);
        let vm = swap_vm("forkwb", PHYS, 4, path);
        let space = vm.new_space().unwrap();
        let shared = space.mmap_file(0, PAGES * P, RW, MapFlags::SHARED, &file.rw(), 0).unwrap();
        let anon = space.mmap(0, PHYS * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let forker = {
            let (vm, space, stop) = (vm.clone(), space.clone(), stop.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    // The child's end writes back what its shared file
                    // mapping holds dirty.
                    drop(space.fork().unwrap());
                    n += 1;
                }
                n
            })
        };
        let presser = {
            let (vm, space, stop) = (vm.clone(), space.clone(), stop.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                let mut x = 77u64;
                while !stop.load(Ordering::Relaxed) {
                    let page = next(&mut x) % PHYS;
                    space.write(anon + page * P, &page.to_le_bytes()).unwrap();
                }
            })
        };
        let _cpu = vm.attach().unwrap();
        let reader = file.ro();
        let mut last = vec![0u64; PAGES as usize];
        let mut x = 5u64;
        let deadline = Instant::now() + stress_time();
        let mut i = 0u64;
        let mut page = vec![0u8; P as usize];
        while Instant::now() < deadline {
            i += 1;
            let p = next(&mut x) % PAGES;
            space.write(shared + p * P, &i.to_le_bytes()).unwrap();
            last[p as usize] = i;
            if i % 8 == 0 {
                space.msync(shared, PAGES * P).unwrap();
                let q = next(&mut x) % PAGES;
                reader.read_exact_at(&mut page, q * P).unwrap();
                let mut want = pattern(2, q);
                if last[q as usize] != 0 {
                    want[..8].copy_from_slice(&last[q as usize].to_le_bytes());
                }
                assert!(page == want, "{path:?}: page {q} of the file lost its contents after {i} stores");
            }
        }
        stop.store(true, Ordering::Relaxed);
        let forks = forker.join().unwrap();
        presser.join().unwrap();
        space.msync(shared, PAGES * P).unwrap();
        for q in 0..PAGES {
            reader.read_exact_at(&mut page, q * P).unwrap();
            let mut want = pattern(2, q);
            if last[q as usize] != 0 {
                want[..8].copy_from_slice(&last[q as usize].to_le_bytes());
            }
            assert!(page == want, "{path:?}: page {q} of the file lost its contents at the end");
        }
        let s = vm.stats();
        assert!(forks > 10 && s.pageouts > 0, "{path:?}: {forks} forks, {} pageouts", s.pageouts);
        drop(space);
    }
}
