//! Nothing lost: regressions for data-loss bugs found by an outside test
//! (each failed on the commit before its fix), and their siblings.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::FAULT_PATHS;
use common::files::{SmallFs, TempFile};
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

/// A vCPU that forks `space` and drops the child until `stop`, counting
/// its forks.
fn fork_until(
    vm: &Vm,
    space: &vmfault::AddressSpace,
    stop: &Arc<AtomicBool>,
) -> (std::thread::JoinHandle<()>, Arc<AtomicU64>) {
    let (vm, space, stop) = (vm.clone(), space.clone(), stop.clone());
    let forks = Arc::new(AtomicU64::new(0));
    let n = forks.clone();
    let t = std::thread::spawn(move || {
        let _cpu = vm.attach().unwrap();
        while !stop.load(Ordering::Relaxed) {
            drop(space.fork().unwrap());
            n.fetch_add(1, Ordering::Relaxed);
        }
    });
    (t, forks)
}

/// Wait until `count` reaches `n` or `gave_up` says its counter stopped
/// (a thread ended): a race test runs until it has raced enough, however
/// slow the machine, instead of asserting a rate.
fn wait_for(count: &AtomicU64, n: u64, gave_up: impl Fn() -> bool) {
    while count.load(Ordering::Relaxed) < n && !gave_up() {
        std::thread::sleep(Duration::from_millis(1));
    }
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
///
/// It also caught a second loss: a fill that read the file, then inserted
/// its copy after another vCPU's copy of the page had been written to,
/// written back and evicted, brought the page back as it was before that
/// store (a read found the vCPU's next-to-last value; about one run in
/// three of 5 s before evictions left tombstones, `object/file.rs`).
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
                        let (base, own) =
                            if next(&mut x).is_multiple_of(2) { (shared, true) } else { (private, false) };
                        // Private copies stay few: they go to swap, which
                        // holds twice physical memory.
                        if page % 2 == t && (own || page < 64) && next(&mut x).is_multiple_of(4) {
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
                            "{path:?}: page {page} of the {} mapping lost its bytes (bytes 8..16: {:x?}, want {:x?})",
                            if own { "shared" } else { "private" },
                            &buf[8..16],
                            &want[8..16]
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
        // Half of memory: with a child's copy of each below the parent's
        // (copy-on-write), swap (twice memory) holds them all.
        let anon = space.mmap(0, PHYS / 2 * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        // The child's end writes back what its shared file mapping holds dirty.
        let (forker, forks) = fork_until(&vm, &space, &stop);
        let presser = {
            let (vm, space, stop) = (vm.clone(), space.clone(), stop.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                let mut x = 77u64;
                while !stop.load(Ordering::Relaxed) {
                    let page = next(&mut x) % (PHYS / 2);
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
            if let Err(e) = space.write(shared + p * P, &i.to_le_bytes()) {
                panic!("{path:?}: {e}\n{:#?}", vm.stats());
            }
            last[p as usize] = i;
            if i.is_multiple_of(8) {
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
        wait_for(&forks, 11, || forker.is_finished());
        stop.store(true, Ordering::Relaxed);
        forker.join().unwrap();
        let forks = forks.load(Ordering::Relaxed);
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
        drop(_cpu);
        vm.drop_caches();
        let deadline = Instant::now() + Duration::from_secs(10);
        while (vm.stats().free_pages, vm.stats().swap_used_pages) != (PHYS - 1, 0) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let s = vm.stats();
        assert_eq!((s.free_pages, s.swap_used_pages), (PHYS - 1, 0), "{path:?}: frames or swap slots leaked");
    }
}

/// A store racing `fork`: a vCPU that found the page's PTE writable
/// before the fork narrowed it may still be copying its bytes in when
/// another vCPU's copy-on-write fault copies the frame; the copy replaces
/// the page, and the store is lost unless the fork's shootdown (a grace
/// period) ends before any fault can copy. Fork released the map lock
/// first and waited after; the store read back as an older value.
///
/// More storing vCPUs than cores (so that some are preempted between
/// their translation and their store), each with its own slot in each of
/// a few private pages, read back every store while another vCPU forks
/// and drops the child in a loop.
#[test]
fn stores_racing_a_fork_are_not_lost() {
    const PAGES: u64 = 4;
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let storers = 2 * cores + 1;
    for path in FAULT_PATHS {
        let vm = Vm::new(VmConfig {
            phys_bytes: 8 << 20,
            cpus: storers + 2,
            prefault: false,
            fault_path: path,
            ..VmConfig::default()
        })
        .unwrap();
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, PAGES * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (forker, forks) = fork_until(&vm, &space, &stop);
        let stored = Arc::new(AtomicU64::new(0));
        let workers: Vec<_> = (0..storers as u64)
            .map(|t| {
                let (vm, space, stop, stored) = (vm.clone(), space.clone(), stop.clone(), stored.clone());
                std::thread::spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    let mut x = t + 3;
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let slot = a + (next(&mut x) % PAGES) * P + 8 * t;
                        space.write(slot, &i.to_le_bytes()).unwrap();
                        let mut back = [0u8; 8];
                        space.read(slot, &mut back).unwrap();
                        let back = u64::from_le_bytes(back);
                        assert_eq!(back, i, "{path:?}: vCPU {t} stored {i} and read back {back}: a store was lost");
                        stored.fetch_add(1, Ordering::Relaxed);
                    }
                    i
                })
            })
            .collect();
        std::thread::sleep(stress_time());
        let ended = || forker.is_finished() || workers.iter().any(|w| w.is_finished());
        wait_for(&forks, 11, ended);
        wait_for(&stored, 1001, ended);
        stop.store(true, Ordering::Relaxed);
        let stores: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        forker.join().unwrap();
        let forks = forks.load(Ordering::Relaxed);
        assert!(forks > 10 && stores > 1000, "{path:?}: {forks} forks, {stores} stores");
    }
}

/// A sparse file of `size` bytes on a filesystem that holds files that
/// large (tmpfs: `/dev/shm`), or `None` where there is none.
fn huge_file(size: u64) -> Option<(std::path::PathBuf, std::fs::File)> {
    let path = std::path::Path::new("/dev/shm").join(format!("vmfault-test-huge-{}", std::process::id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).ok()?;
    if f.set_len(size).is_err() {
        let _ = std::fs::remove_file(&path);
        return None;
    }
    Some((path, f))
}

/// Problem 2: the object index had 36 bits: file page 2^36 + k was page k
/// of the cache, so a mapping at offset 2^48 read the bytes at offset 0
/// and wrote its dirty pages back over them. Offsets up to 2^63 - 1 work
/// now, as on Linux (tmpfs, xfs and btrfs hold sparse files that large).
#[test]
fn file_offsets_past_two_to_the_48_do_not_alias() {
    use std::os::unix::fs::FileExt;
    let far = [1u64 << 48, (1 << 48) + (1 << 36) * P, 1 << 62, (1 << 63) - 2 * P];
    let Some((path, f)) = huge_file((1 << 63) - P) else {
        panic!("no filesystem for a sparse file of 2^63 bytes at /dev/shm (tmpfs)");
    };
    f.write_all_at(b"page zero", 0).unwrap();
    for (k, &off) in far.iter().enumerate() {
        f.write_all_at(format!("far page {k}").as_bytes(), off).unwrap();
    }
    for path in FAULT_PATHS {
        let vm = common::test_vm(4 << 20, 2, path);
        let space = vm.new_space().unwrap();
        let low = space.mmap_file(0, P, RW, MapFlags::SHARED, &f, 0).unwrap();
        let highs: Vec<u64> =
            far.iter().map(|&off| space.mmap_file(0, P, RW, MapFlags::SHARED, &f, off).unwrap()).collect();
        let mut buf = [0u8; 10];
        space.read(low, &mut buf).unwrap();
        assert_eq!(&buf, b"page zero\0", "{path:?}");
        for (k, &a) in highs.iter().enumerate() {
            space.read(a, &mut buf).unwrap();
            assert_eq!(&buf, format!("far page {k}").as_bytes(), "{path:?}: offset {:#x}", far[k]);
            space.write(a + 100, format!("written {k}").as_bytes()).unwrap();
        }
        space.msync(low, P).unwrap();
        for &a in &highs {
            space.msync(a, P).unwrap();
        }
        let mut disk = [0u8; 120];
        f.read_exact_at(&mut disk, 0).unwrap();
        assert_eq!(&disk[..9], b"page zero", "{path:?}");
        assert!(disk[9..].iter().all(|&b| b == 0), "{path:?}: a far page was written over page 0");
        for (k, &off) in far.iter().enumerate() {
            f.read_exact_at(&mut disk, off).unwrap();
            assert_eq!(&disk[100..109], format!("written {k}").as_bytes(), "{path:?}");
        }
        // An index this tall costs a few frames, not a page table's worth.
        assert!(vm.stats().index_pages < 40, "{path:?}: {} index pages", vm.stats().index_pages);
        drop(space);
    }
    // Past the largest file size: EOVERFLOW, as Linux's file_mmap_ok.
    let vm = common::test_vm(4 << 20, 2, FaultPath::Speculative);
    let space = vm.new_space().unwrap();
    let e = space.mmap_file(0, 2 * P, Prot::READ, MapFlags::SHARED, &f, (1 << 63) - P).unwrap_err();
    assert_eq!(e.errno(), libc::EOVERFLOW, "{e}");
    drop(f);
    std::fs::remove_file(path).unwrap();
}

/// Problem 6: `hold` looked the PTE up without the `TASK_SIZE` check of
/// loads and stores, and the page-table radix masked the page number to
/// 36 bits, so `hold(a + 2^48)` wired and returned the page mapped at `a`.
#[test]
fn hold_beyond_the_address_space_is_a_segv() {
    for path in FAULT_PATHS {
        let vm = common::test_vm(4 << 20, 2, path);
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        space.write(a, b"mine").unwrap();
        for access in [vmfault::Access::Read, vmfault::Access::Write] {
            for far in [a + (1 << 48), a + (1 << 60), vmfault::TASK_SIZE] {
                let e = space.hold(far, access).unwrap_err();
                assert_eq!(e, vmfault::Error::Segv { addr: far, code: vmfault::SegvCode::MapErr }, "{path:?}");
                assert_eq!(space.read(far, &mut [0u8; 1]).unwrap_err(), e, "{path:?}: as a load says");
            }
        }
        assert_eq!(vm.stats().wired_pages, 0, "{path:?}");
    }
}

/// Problem 7: a swap file that cannot hold what it promises. Its size was
/// set with `set_len` (a sparse file): 16 MiB of swap on a 1 MiB
/// filesystem was accepted and every pageout past the first MiB failed.
/// Now its blocks are allocated at `Vm::new` (`ENOSPC` there, and the file
/// is not left behind); a swap file another `Vm` uses is `EBUSY` (the
/// second truncated the first one's live file, whose pages then read back
/// as zeros), as `swapon` answers.
#[test]
fn swap_files_hold_what_they_promise_and_are_never_shared() {
    let fs = SmallFs::mount("1m");
    let cfg = |bytes: u64, path: std::path::PathBuf| VmConfig {
        phys_bytes: 64 * P,
        cpus: 2,
        prefault: false,
        swap: Some(path),
        swap_bytes: bytes,
        ..VmConfig::default()
    };
    let e = Vm::new(cfg(16 << 20, fs.0.clone())).unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    assert_eq!(std::fs::read_dir(&fs.0).unwrap().count(), 0, "the failed Vm left its swap file behind");
    let named = fs.0.join("swap");
    let e = Vm::new(cfg(16 << 20, named.clone())).unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    assert!(!named.exists(), "the failed Vm left its swap file behind");

    // Two Vms, one swap file: the second is refused and the first keeps
    // its pages (written, paged out, read back).
    let first = Vm::new(cfg(512 << 10, named.clone())).unwrap();
    let e = Vm::new(cfg(512 << 10, named.clone())).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY, "{e}");
    assert!(e.to_string().contains("in use"), "{e}");
    let space = first.new_space().unwrap();
    let _cpu = first.attach().unwrap();
    let a = space.mmap(0, 96 * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    for p in 0..96 {
        space.write(a + p * P, &pattern(3, p)).unwrap();
    }
    let mut buf = vec![0u8; P as usize];
    for p in 0..96 {
        space.read(a + p * P, &mut buf).unwrap();
        assert!(buf == pattern(3, p), "page {p} lost its contents");
    }
    assert!(first.stats().pageouts > 0);
    drop((space, _cpu, first));
    assert!(!named.exists(), "the swap file goes with its Vm");
    // Free again: a new Vm may take the path.
    drop(Vm::new(cfg(512 << 10, named.clone())).unwrap());
}

/// A failed swap write takes its slot out of use (it was pushed back on
/// top of the free stack, and the next pageout took it again: hundreds of
/// thousands of failed writes a second on a full filesystem).
#[test]
fn a_failed_swap_write_retires_its_slot() {
    let vm = swap_vm("badslot", 64, 2, FaultPath::Speculative);
    vm.fail_swap_writes(5);
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    let a = space.mmap(0, 128 * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    for p in 0..128 {
        space.write(a + p * P, &pattern(4, p)).unwrap();
    }
    let mut buf = vec![0u8; P as usize];
    for p in 0..128 {
        space.read(a + p * P, &mut buf).unwrap();
        assert!(buf == pattern(4, p), "page {p} lost its contents");
    }
    let s = vm.stats();
    assert_eq!((s.swap_write_errors, s.swap_bad_slots), (5, 5), "{s:?}");
    assert!(s.pageouts > 0);
}

/// Problem 8: a `phys_bytes` that `validate` allows but the host cannot
/// give aborted the process ("memory allocation failed" for the page
/// descriptors), or with `prefault` got it killed by the OOM killer.
#[test]
fn a_machine_larger_than_the_host_is_an_error() {
    // 2^32 - 2 frames: 256 GiB of page descriptors.
    let huge = (u64::from(u32::MAX) - 2) * P;
    let e = Vm::new(VmConfig { phys_bytes: huge, prefault: false, ..VmConfig::default() }).unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    assert!(e.to_string().contains("page descriptors"), "{e}");
    // Prefaulted, twice what the host has.
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb = |name: &str| -> u64 {
        let l = meminfo.lines().find(|l| l.starts_with(name)).unwrap();
        l.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    let twice = ((kb("MemTotal:") + kb("SwapTotal:")) * 1024 * 2).min(huge) & !(P - 1);
    let e = Vm::new(VmConfig { phys_bytes: twice, prefault: true, ..VmConfig::default() }).unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    assert!(e.to_string().contains("prefault"), "{e}");
}
