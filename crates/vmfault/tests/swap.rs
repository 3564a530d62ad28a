//! Swap: the page daemon pages anonymous memory out to a swap
//! file when physical memory runs low, faults read it back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use vmfault::{AddressSpace, Error, FaultPath, MapFlags, Prot, Stats, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

fn swap_vm(name: &str, phys_pages: u64, cpus: usize, f: impl FnOnce(&mut VmConfig)) -> Vm {
    let path = std::env::temp_dir().join(format!("vmfault-test-{name}-{}.swap", std::process::id()));
    let mut c = VmConfig { phys_bytes: phys_pages * P, cpus, prefault: false, swap: Some(path), ..VmConfig::default() };
    f(&mut c);
    Vm::new(c).unwrap()
}

/// The pattern of page `page` (of tag `tag`): every 8-byte word differs.
fn pattern(tag: u64, page: u64) -> Vec<u8> {
    (0..P / 8).flat_map(|w| (tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (page << 20) ^ w).to_le_bytes()).collect()
}

fn check(space: &AddressSpace, base: u64, tag: u64, page: u64) {
    check_page(space, base, page, &pattern(tag, page));
}

fn check_page(space: &AddressSpace, base: u64, page: u64, want: &[u8]) {
    let mut buf = vec![0u8; P as usize];
    space.read(base + page * P, &mut buf).unwrap();
    assert!(buf == want, "page {page} lost its contents");
}

/// The statistics once `done` holds of them, or after 10 s: a daemon pass
/// still running holds the pages it took (and a slot while it writes).
fn settled(vm: &Vm, done: impl Fn(&Stats) -> bool) -> Stats {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = vm.stats();
        if done(&s) || Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(Duration::from_millis(5));
        // Deferred frees (of vCPUs that have left) complete in a drain.
        vm.drain_pcpu_caches();
    }
}

/// A tiny xorshift for a reproducible random order.
fn shuffled(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// The over-commit test: a working set twice physical memory,
/// written with a pattern by several vCPUs and read back in random order.
fn over_commit(path: FaultPath) {
    const PHYS: u64 = 1024;
    const THREADS: u64 = 3;
    const WIRED: u64 = 16;
    let vm = swap_vm(path.name(), PHYS, THREADS as usize + 1, |c| c.fault_path = path);
    let free_at_start = vm.stats().free_pages;
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    // A wired range first: it must stay resident throughout.
    let wired = space.mmap(0, WIRED * P, RW, PA).unwrap();
    for p in 0..WIRED {
        space.write(wired + p * P, &pattern(1, p)).unwrap();
    }
    space.mlock(wired, WIRED * P).unwrap();
    let pages = 2 * PHYS;
    let base = space.mmap(0, pages * P, RW, PA).unwrap();
    // Write, then read back, on several vCPUs (joined in between, so that
    // a failure in one shows instead of leaving the others waiting).
    let on_workers = |read: bool| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (vm, space) = (vm.clone(), space.clone());
                std::thread::spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    if read {
                        for p in shuffled(pages, t + 7) {
                            check(&space, base, 2, p);
                        }
                    } else {
                        for p in (t..pages).step_by(THREADS as usize) {
                            space.write(base + p * P, &pattern(2, p)).unwrap();
                        }
                    }
                })
            })
            .collect::<Vec<_>>();
        for w in workers {
            w.join().unwrap();
        }
    };
    on_workers(false);
    on_workers(true);
    let s = vm.stats();
    assert!(s.pageouts >= PHYS / 2, "{path:?}: memory was over-committed twice: {s:?}");
    assert!(s.pageins > 0, "{path:?}: {s:?}");
    assert!(s.swap_used_pages > 0, "{path:?}: {s:?}");
    // The wired pages never left: reading them pages nothing in.
    for p in 0..WIRED {
        check(&space, wired, 1, p);
    }
    let after = vm.stats();
    assert_eq!(after.pageins, s.pageins, "{path:?}: a wired page had been paged out");
    assert!(after.wired_pages >= WIRED, "{path:?}: {after:?}");
    // Every page once more, in order, from one vCPU.
    for p in 0..pages {
        check(&space, base, 2, p);
    }
    space.munmap(base, pages * P).unwrap();
    space.munmap(wired, WIRED * P).unwrap();
    drop(space);
    // A daemon pass still running holds the pages it took: let it end.
    let end = settled(&vm, |s| s.free_pages == free_at_start);
    assert_eq!(end.swap_used_pages, 0, "{path:?}: every slot freed: {end:?}");
    assert_eq!(end.free_pages, free_at_start, "{path:?}: every frame back: {end:?}");
    assert_eq!(end.data_pages, 0, "{path:?}: {end:?}");
}

#[test]
fn over_commit_twice_physical_memory_loses_nothing() {
    over_commit(FaultPath::Speculative);
}

#[test]
fn over_commit_on_the_classic_and_per_vma_lock_paths() {
    over_commit(FaultPath::MapLock);
    over_commit(FaultPath::VmaLock);
}

/// An I/O error on the swap file leaves the page resident and intact:
/// with every write failing, memory fills up and allocation fails with
/// ENOMEM; nothing written is lost; once writes work, pageout resumes.
#[test]
fn a_failing_swap_write_loses_nothing() {
    const PHYS: u64 = 512;
    let vm = swap_vm("fail", PHYS, 2, |_| {});
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    vm.fail_swap_writes(u32::MAX);
    let pages = 2 * PHYS;
    let base = space.mmap(0, pages * P, RW, PA).unwrap();
    let mut written = 0;
    while written < pages {
        match space.write(base + written * P, &pattern(3, written)) {
            Ok(()) => written += 1,
            Err(Error::NoMemory { .. }) => break,
            Err(e) => panic!("unexpected {e}"),
        }
    }
    let s = vm.stats();
    assert!(written < PHYS, "no page could go to swap, yet {written} fit: {s:?}");
    assert!(s.swap_write_errors > 0 && s.pageouts == 0, "{s:?}");
    // The daemon may still be in a pass (each waiting allocation rang it):
    // a slot is in use while its write is under way, and freed when it
    // fails. Give the daemon time to end; a leaked slot stays counted.
    let s = settled(&vm, |s| s.swap_used_pages == 0);
    assert_eq!(s.swap_used_pages, 0, "failed slots are free again: {s:?}");
    for p in 0..written {
        check(&space, base, 3, p);
    }
    // The swap works again: the rest fits.
    vm.fail_swap_writes(0);
    for p in written..pages {
        if let Err(e) = space.write(base + p * P, &pattern(3, p)) {
            panic!("page {p} of {pages}: {e}: {:?}", vm.stats());
        }
    }
    for p in shuffled(pages, 11) {
        check(&space, base, 3, p);
    }
    assert!(vm.stats().pageouts > 0);
}

/// Copy-on-write across swap: pages paged out of a fork's backing object
/// are read back into it; both sides keep their own contents.
#[test]
fn fork_chains_survive_pageout() {
    for path in [FaultPath::Speculative, FaultPath::MapLock, FaultPath::VmaLock] {
        fork_chains(path);
    }
}

/// Copy-on-write across swap on one fault path (the classic one copies the
/// page below inside its section: the daemon may page it out before).
fn fork_chains(path: FaultPath) {
    const PHYS: u64 = 1024;
    let vm = swap_vm(&format!("fork-{}", path.name()), PHYS, 2, |c| c.fault_path = path);
    let parent = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    let pages = PHYS;
    let base = parent.mmap(0, pages * P, RW, PA).unwrap();
    for p in 0..pages {
        parent.write(base + p * P, &pattern(4, p)).unwrap();
    }
    let child = Arc::new(parent.fork().unwrap());
    // Each side rewrites half of the pages; both read everything.
    for p in (0..pages).step_by(2) {
        child.write(base + p * P, &pattern(5, p)).unwrap();
    }
    for p in (1..pages).step_by(2) {
        parent.write(base + p * P, &pattern(6, p)).unwrap();
    }
    for p in shuffled(pages, 3) {
        check(&child, base, if p % 2 == 0 { 5 } else { 4 }, p);
        check(&parent, base, if p % 2 == 0 { 4 } else { 6 }, p);
    }
    let s = vm.stats();
    assert!(s.pageouts > 0 && s.pageins > 0, "{s:?}");
    drop(child);
    // The next fork collapses the parent's chain (pages in swap move up).
    let again = parent.fork().unwrap();
    drop(again);
    for p in shuffled(pages, 5) {
        check(&parent, base, if p % 2 == 0 { 4 } else { 6 }, p);
    }
}

/// Copy-on-write of pages in swap with ever less memory left unwired
/// (from all of it down to none): each fault ends, with the copy (the
/// child sees the parent's data with its own store) or with ENOMEM, never
/// with a wrong page. A fault that reads the page below in holds it until
/// the copy is made (`fault::resolve::ReadIn`); without that hold the
/// differential test's small machine hung about one run in twenty (the
/// daemon paged the page out again to free the copy's frame, and the fault
/// looked again for ever), a sequence this sweep has not reproduced on its
/// own.
#[test]
fn cow_of_a_swapped_page_completes_when_all_else_is_wired() {
    const PHYS: u64 = 48;
    for wired in (0..PHYS).rev() {
        let (done, wait) = std::sync::mpsc::channel();
        let run = std::thread::spawn(move || {
            cow_with_wired(PHYS, wired);
            done.send(()).unwrap();
        });
        if wait.recv_timeout(Duration::from_secs(60)).is_err() && !run.is_finished() {
            panic!("with {wired} of {PHYS} pages wired, a copy-on-write fault never ended");
        }
        run.join().unwrap();
    }
}

fn cow_with_wired(phys: u64, wired: u64) {
    const PAGES: u64 = 8;
    let vm = swap_vm(&format!("cow-wired-{wired}"), phys, 1, |c| {
        c.pcpu_pages = 4;
        c.free_target = 8;
    });
    let parent = vm.new_space().unwrap();
    let base = parent.mmap(0, PAGES * P, RW, PA).unwrap();
    for p in 0..PAGES {
        parent.write(base + p * P, &pattern(7, p)).unwrap();
    }
    // A stream over all of memory pushes them out to swap.
    let stream = parent.mmap(0, phys * P, RW, PA).unwrap();
    for p in 0..phys {
        parent.write(stream + p * P, &[1]).unwrap();
    }
    parent.munmap(stream, phys * P).unwrap();
    let child = parent.fork().unwrap();
    let locked = parent.mmap(0, wired.max(1) * P, RW, PA).unwrap();
    match parent.mlock(locked, wired * P) {
        Err(e) if e.errno() == libc::EAGAIN => {}
        r => r.unwrap(),
    }
    let mut copied = Vec::new();
    for p in 0..PAGES {
        let mut buf = pattern(7, p);
        buf[0] ^= 0xff;
        match child.write(base + p * P, &buf[..1]) {
            Ok(()) => copied.push(p),
            Err(e) => assert_eq!(e.errno(), libc::ENOMEM, "page {p}: {e}"),
        }
    }
    // With memory back, nothing was lost on either side.
    parent.munmap(locked, wired.max(1) * P).unwrap();
    for p in 0..PAGES {
        check(&parent, base, 7, p);
        let mut want = pattern(7, p);
        if copied.contains(&p) {
            want[0] ^= 0xff;
        }
        check_page(&child, base, p, &want);
    }
}

/// Aging by reference marks: a small hot set, read between writes of a
/// cold stream six times the size of memory, stays resident (the page
/// queues keep referenced pages active). The first time memory runs out,
/// every page carries the mark of its fault, so the daemon's first sweep
/// clears them all and the oldest, the hot set among them, may go out
/// once: up to `HOT` page-ins. FIFO order would page each hot page out once
/// per pass of the stream over memory, 6 to 7 times.
#[test]
#[cfg_attr(vmfault_mutation = "queues_no_aging", should_panic(expected = "hot pages were paged out"))]
fn hot_pages_stay_resident_while_a_cold_stream_pages_out() {
    const PHYS: u64 = 512;
    const HOT: u64 = 64;
    let vm = swap_vm("hot", PHYS, 2, |c| c.swap_bytes = 8 * PHYS * P);
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    let hot = space.mmap(0, HOT * P, RW, PA).unwrap();
    for p in 0..HOT {
        space.write(hot + p * P, &pattern(7, p)).unwrap();
    }
    let cold_pages = 6 * PHYS;
    let cold = space.mmap(0, cold_pages * P, RW, PA).unwrap();
    for c in 0..cold_pages {
        space.write(cold + c * P, &pattern(8, c)).unwrap();
        if c % 16 == 15 {
            for p in 0..HOT {
                check(&space, hot, 7, p);
            }
        }
    }
    let s = vm.stats();
    assert!(s.pageouts >= cold_pages - PHYS, "the stream went out: {s:?}");
    assert!(s.pageins <= 2 * HOT, "hot pages were paged out and back {} times: {s:?}", s.pageins);
    for c in shuffled(cold_pages, 9).into_iter().take(64) {
        check(&space, cold, 8, c);
    }
}

/// munmap racing pageout: vCPUs map, write, check and unmap ranges that
/// together exceed physical memory, so the daemon pages out pages that
/// munmap frees under it, and frames it held come back in new lives (the
/// page queues' stale entries, `phys::queues`). Nothing is lost, and at
/// the end every frame, slot and queue entry is back.
#[test]
fn munmap_racing_pageout_loses_nothing_and_leaks_nothing() {
    const PHYS: u64 = 256;
    const THREADS: u64 = 3;
    const PAGES: u64 = 128;
    let vm = swap_vm("churn", PHYS, THREADS as usize + 1, |_| {});
    let free_at_start = vm.stats().free_pages;
    let space = Arc::new(vm.new_space().unwrap());
    let rounds = if cfg!(debug_assertions) { 6 } else { 20 };
    std::thread::scope(|sc| {
        for t in 0..THREADS {
            let (vm, space) = (&vm, &space);
            sc.spawn(move || {
                let _cpu = vm.attach().unwrap();
                for r in 0..rounds {
                    let tag = 100 + t * 1000 + r;
                    let base = space.mmap(0, PAGES * P, RW, PA).unwrap();
                    for p in 0..PAGES {
                        if let Err(e) = space.write(base + p * P, &pattern(tag, p)) {
                            panic!("vCPU {t} round {r} page {p}: {e}: {:?}", vm.stats());
                        }
                    }
                    for p in shuffled(PAGES, tag) {
                        check(space, base, tag, p);
                    }
                    space.munmap(base, PAGES * P).unwrap();
                }
            });
        }
    });
    let s = vm.stats();
    assert!(s.pageouts > 0 && s.pageins > 0, "{s:?}");
    drop(space);
    let end = settled(&vm, |s| s.free_pages == free_at_start);
    assert_eq!(end.free_pages, free_at_start, "every frame back: {end:?}");
    assert_eq!((end.swap_used_pages, end.data_pages), (0, 0), "{end:?}");
    assert_eq!((end.active_pages, end.inactive_pages), (0, 0), "queues empty: {end:?}");
}

/// File pages are reclaimed too (with swap configured, the queues hold
/// them): a shared mapping of a file twice physical memory, written
/// through and read back in random order, goes back to its file page by
/// page (dirty ones written first); the file holds every byte; a private
/// mapping reads it all again through the cache.
#[test]
fn file_pages_over_memory_go_back_to_their_file() {
    const PHYS: u64 = 256;
    let pages = 2 * PHYS;
    let path = std::env::temp_dir().join(format!("vmfault-test-filereclaim-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; (pages * P) as usize]).unwrap();
    let vm = swap_vm("file", PHYS, 2, |_| {});
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let base = space.mmap_file(0, pages * P, RW, MapFlags::SHARED, &f, 0).unwrap();
    for p in 0..pages {
        space.write(base + p * P, &pattern(10, p)).unwrap();
    }
    for p in shuffled(pages, 13) {
        check(&space, base, 10, p);
    }
    let s = vm.stats();
    assert!(s.file_pageouts > 0 && s.daemon_file_writebacks > 0, "{s:?}");
    space.munmap(base, pages * P).unwrap();
    let disk = std::fs::read(&path).unwrap();
    for p in 0..pages {
        let at = (p * P) as usize;
        assert!(disk[at..at + P as usize] == pattern(10, p), "page {p} of the file");
    }
    let ro = std::fs::File::open(&path).unwrap();
    let private = space.mmap_file(0, pages * P, Prot::READ, MapFlags::PRIVATE, &ro, 0).unwrap();
    for p in shuffled(pages, 17) {
        check(&space, private, 10, p);
    }
    assert!(vm.stats().file_pageouts > s.file_pageouts, "clean pages were dropped too");
    drop(space);
    std::fs::remove_file(&path).unwrap();
}

/// The `refcount=pagelock` baseline puts new pages on their queue under
/// the page lock (one acquisition per page); atomic mode takes none.
#[test]
fn queue_changes_take_page_locks_only_in_the_baseline() {
    for (mode, want) in [(vmfault::Refcount::PageLock, 64), (vmfault::Refcount::Atomic, 0)] {
        let vm = swap_vm("qlock", 1024, 2, |c| c.refcount = mode);
        let space = vm.new_space().unwrap();
        let _cpu = vm.attach().unwrap();
        let base = space.mmap(0, 64 * P, RW, PA).unwrap();
        for p in 0..64 {
            space.write(base + p * P, &pattern(12, p)).unwrap();
        }
        assert_eq!(vm.stats().page_lock_acquisitions, want, "{mode:?}");
    }
}

#[test]
fn swap_needs_the_page_daemon() {
    let path = std::env::temp_dir().join(format!("vmfault-test-nodaemon-{}.swap", std::process::id()));
    let e = Vm::new(VmConfig { swap: Some(path), page_daemon: false, ..VmConfig::default() }).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("page daemon"), "{e}");
    let path = std::env::temp_dir().join(format!("vmfault-test-pv-{}.swap", std::process::id()));
    let e = Vm::new(VmConfig { swap: Some(path), rmap: vmfault::Rmap::PvEntry, ..VmConfig::default() }).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("rmap=backing"), "{e}");
}

/// `usage()` counts what went to swap: twice physical memory written, the
/// mapping's `swap` holds the pages not resident, and none is counted twice.
#[test]
fn usage_counts_swapped_pages() {
    const PHYS: u64 = 512;
    let vm = swap_vm("usage", PHYS, 1, |_| {});
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    let pages = 2 * PHYS;
    let base = space.mmap(0, pages * P, RW, PA).unwrap();
    for p in 0..pages {
        space.write(base + p * P, &pattern(5, p)).unwrap();
    }
    let s = settled(&vm, |s| s.pageouts >= PHYS);
    let u = space.usage().into_iter().find(|u| u.info.start == base).unwrap();
    assert!(u.swap >= PHYS / 2 * P && u.rss > 0, "{u:?} {s:?}");
    assert!(u.rss + u.swap <= pages * P, "a page counted twice: {u:?}");
    assert!(u.swap / P <= vm.stats().swap_used_pages, "{u:?}");
    assert_eq!(u.anonymous, u.rss);
    for p in shuffled(pages, 5) {
        check(&space, base, 5, p);
    }
}
