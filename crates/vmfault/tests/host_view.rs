//! Host views: native loads, stores and atomics on guest memory, the same
//! frames as the API's, kept coherent with every change of the space.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use common::files::{TempFile, pattern};
use vmfault::{AddressSpace, Error, FaultPath, HostFault, HostView, MapFlags, Prot, SegvCode, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);
const PATHS: [FaultPath; 3] = [FaultPath::MapLock, FaultPath::Speculative, FaultPath::VmaLock];

fn vm(path: FaultPath, mib: u64) -> Vm {
    Vm::new(VmConfig { phys_bytes: mib << 20, cpus: 4, host_views: true, fault_path: path, ..VmConfig::default() })
        .unwrap()
}

/// `addr` of `view` as a `u64` cell the host's atomics can use.
fn cell(view: &HostView, addr: u64) -> &AtomicU64 {
    // SAFETY: the address is 8-byte aligned inside the view, whose window
    // lives as long as `view`; every access to it is atomic.
    unsafe { &*view.ptr(addr).unwrap().cast::<AtomicU64>() }
}

fn load(view: &HostView, addr: u64) -> u64 {
    cell(view, addr).load(Ordering::SeqCst)
}

fn store(view: &HostView, addr: u64, v: u64) {
    cell(view, addr).store(v, Ordering::SeqCst)
}

fn api_u64(space: &AddressSpace, addr: u64) -> u64 {
    let mut b = [0u8; 8];
    space.read(addr, &mut b).unwrap();
    u64::from_le_bytes(b)
}

#[test]
fn stores_through_a_view_and_through_the_api_meet_in_one_frame() {
    for path in PATHS {
        let vm = vm(path, 16);
        let _cpu = vm.attach().unwrap();
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, 64 * P, RW, PA).unwrap();
        let view = space.host_view(a, 64 * P).unwrap();
        // View first, API after.
        for i in 0..32 {
            store(&view, a + i * P + 8, i * 3 + 1);
        }
        for i in 0..32 {
            assert_eq!(api_u64(&space, a + i * P + 8), i * 3 + 1, "{path:?}: page {i}");
        }
        // API first, view after; and reads of untouched memory are zero.
        for i in 32..64 {
            space.write(a + i * P + 16, &(i * 7).to_le_bytes()).unwrap();
        }
        for i in 32..64 {
            assert_eq!(load(&view, a + i * P + 16), i * 7, "{path:?}: page {i}");
            assert_eq!(load(&view, a + i * P + 24), 0, "{path:?}: page {i}");
        }
        // Writes through the API to a page the view has mapped are seen
        // at once: the same frame.
        space.write(a + 8, &99u64.to_le_bytes()).unwrap();
        assert_eq!(load(&view, a + 8), 99, "{path:?}");
        assert!(vm.stats().host_view_faults > 0, "{path:?}");
    }
}

#[test]
fn a_fault_maps_the_block_around_it_within_its_mapping() {
    for around in [1u64, 16] {
        let vm = Vm::new(VmConfig {
            phys_bytes: 16 << 20,
            cpus: 2,
            host_views: true,
            view_fault_around: around as usize,
            ..VmConfig::default()
        })
        .unwrap();
        let _cpu = vm.attach().unwrap();
        let space = vm.new_space().unwrap();
        // A 64 KiB-aligned block: 8 pages read-write, then 8 PROT_NONE.
        let base = space.mmap(0, 64 * P, Prot::NONE, PA).unwrap();
        let a = (base + 16 * P - 1) & !(16 * P - 1);
        space.mprotect(a, 8 * P, RW).unwrap();
        let view = space.host_view(a, 16 * P).unwrap();
        let before = vm.stats();
        for i in 0..8 {
            store(&view, a + i * P, i + 1);
        }
        let s = vm.stats();
        let signals = s.host_view_faults - before.host_view_faults;
        assert_eq!(signals, if around == 1 { 8 } else { 1 }, "around {around}");
        assert_eq!(s.zero_fill - before.zero_fill, 8, "around {around}: the read-write pages only");
        assert_eq!(s.segv, before.segv, "around {around}: nothing was tried beyond the mapping");
        for i in 0..8 {
            assert_eq!(api_u64(&space, a + i * P), i + 1);
        }
    }
    let bad = VmConfig { view_fault_around: 3, ..VmConfig::default() };
    assert_eq!(Vm::new(bad).unwrap_err().errno(), libc::EINVAL);
}

#[test]
fn atomics_from_two_vcpus_through_a_view_lose_no_update() {
    const N: u64 = 200_000;
    for path in PATHS {
        let vm = vm(path, 16);
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, P, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
        let view = Arc::new(space.host_view(a, P).unwrap());
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let (vm, view) = (vm.clone(), view.clone());
                std::thread::spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    for _ in 0..N {
                        cell(&view, a).fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert_eq!(api_u64(&space, a), 2 * N, "{path:?}");
        // And against the API's own atomics, at once.
        let api = {
            let (vm, space) = (vm.clone(), space.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                for _ in 0..N {
                    space.fetch_add_u64(a, 1).unwrap();
                }
            })
        };
        for _ in 0..N {
            cell(&view, a).fetch_add(1, Ordering::SeqCst);
        }
        api.join().unwrap();
        assert_eq!(load(&view, a), 4 * N, "{path:?}");
    }
}

#[test]
fn copy_on_write_after_fork_keeps_each_side_its_own_page() {
    for path in PATHS {
        let vm = vm(path, 16);
        let _cpu = vm.attach().unwrap();
        let parent = vm.new_space().unwrap();
        let a = parent.mmap(0, 4 * P, RW, PA).unwrap();
        let pv = parent.host_view(a, 4 * P).unwrap();
        for i in 0..4 {
            store(&pv, a + i * P, 100 + i);
        }
        let child = parent.fork().unwrap();
        let cv = child.host_view(a, 4 * P).unwrap();
        // Both read what was there; then each writes its own.
        for i in 0..4 {
            assert_eq!((load(&pv, a + i * P), load(&cv, a + i * P)), (100 + i, 100 + i), "{path:?}");
        }
        store(&pv, a, 1);
        store(&cv, a + P, 2);
        assert_eq!((load(&pv, a), load(&cv, a)), (1, 100), "{path:?}: the parent's write is its own");
        assert_eq!((load(&pv, a + P), load(&cv, a + P)), (101, 2), "{path:?}: the child's write is its own");
        assert_eq!((api_u64(&parent, a), api_u64(&child, a)), (1, 100), "{path:?}");
        assert_eq!((api_u64(&parent, a + P), api_u64(&child, a + P)), (101, 2), "{path:?}");
    }
}

#[test]
fn shared_memory_between_spaces_is_one_frame_in_both_views() {
    for path in PATHS {
        let vm = vm(path, 16);
        let _cpu = vm.attach().unwrap();
        let parent = vm.new_space().unwrap();
        let a = parent.mmap(0, 2 * P, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
        let child = parent.fork().unwrap();
        let (pv, cv) = (parent.host_view(a, 2 * P).unwrap(), child.host_view(a, 2 * P).unwrap());
        store(&pv, a + P + 8, 5);
        assert_eq!(load(&cv, a + P + 8), 5, "{path:?}");
        cell(&cv, a + P + 8).fetch_add(10, Ordering::SeqCst);
        assert_eq!(load(&pv, a + P + 8), 15, "{path:?}");
    }
}

#[test]
fn munmap_and_mmap_again_read_zeros_through_the_view() {
    for path in PATHS {
        let vm = vm(path, 16);
        let _cpu = vm.attach().unwrap();
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, 8 * P, RW, PA).unwrap();
        let view = space.host_view(a, 8 * P).unwrap();
        for i in 0..8 {
            store(&view, a + i * P, 0xdead_0000 + i);
        }
        space.munmap(a, 8 * P).unwrap();
        let b = space.mmap(a, 8 * P, RW, PA | MapFlags::FIXED).unwrap();
        assert_eq!(a, b);
        for i in 0..8 {
            assert_eq!(load(&view, a + i * P), 0, "{path:?}: page {i} after munmap and mmap");
        }
        // MADV_DONTNEED drops what the view had mapped too.
        store(&view, a, 7);
        space.madvise(a, P, vmfault::Advice::DontNeed).unwrap();
        assert_eq!(load(&view, a), 0, "{path:?}: MADV_DONTNEED");
    }
}

#[test]
fn a_store_the_space_refuses_reaches_the_handler_and_changes_nothing() {
    for path in PATHS {
        let vm = vm(path, 16);
        let _cpu = vm.attach().unwrap();
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, 2 * P, RW, PA).unwrap();
        let seen: Arc<Mutex<Vec<HostFault>>> = Arc::default();
        let handler = {
            let (seen, space) = (seen.clone(), space.clone());
            Box::new(move |f: &HostFault| {
                // What the page held when the store was refused.
                let mut b = [0u8; 8];
                space.read(f.addr & !(P - 1), &mut b).unwrap();
                seen.lock().unwrap().push(f.clone());
                assert_eq!(u64::from_le_bytes(b), 3, "the refused store changed nothing");
                // Let it through: writable again, then run the store again.
                space.mprotect(f.addr & !(P - 1), P, RW).is_ok()
            })
        };
        let view = space.host_view_with_handler(a, 2 * P, handler).unwrap();
        store(&view, a, 3);
        space.mprotect(a, P, Prot::READ).unwrap();
        assert_eq!(load(&view, a), 3, "{path:?}: reads still go through");
        store(&view, a, 4);
        let faults = seen.lock().unwrap().clone();
        assert_eq!(faults.len(), 1, "{path:?}");
        assert_eq!(faults[0].addr, a);
        assert_eq!(faults[0].access, vmfault::Access::Write);
        assert_eq!(faults[0].error, Error::Segv { addr: a, code: SegvCode::AccErr });
        assert_eq!(api_u64(&space, a), 4, "{path:?}: the store ran again after the handler");
    }
}

#[test]
fn libc_routines_run_on_view_memory() {
    let vm = vm(FaultPath::Speculative, 32);
    let _cpu = vm.attach().unwrap();
    let space = vm.new_space().unwrap();
    let n = 100_000usize;
    let len = (2 * n as u64 * 4).div_ceil(P) * P;
    let a = space.mmap(0, len, RW, PA).unwrap();
    let view = space.host_view(a, len).unwrap();
    let mut x = 12345u32;
    let data: Vec<u32> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        })
        .collect();
    let (src, dst) = (view.ptr(a).unwrap(), view.ptr(a + n as u64 * 4).unwrap());
    // SAFETY: both ranges lie inside the view and do not overlap; `libc`'s
    // memcpy and qsort see plain memory.
    unsafe {
        std::ptr::copy_nonoverlapping(data.as_ptr().cast::<u8>(), src, n * 4);
        libc::memcpy(dst.cast(), src.cast(), n * 4);
        extern "C" fn cmp(a: *const libc::c_void, b: *const libc::c_void) -> libc::c_int {
            // SAFETY: qsort passes pointers to two elements of the array.
            let (a, b) = unsafe { (*a.cast::<u32>(), *b.cast::<u32>()) };
            a.cmp(&b) as libc::c_int
        }
        libc::qsort(dst.cast(), n, 4, Some(cmp));
        let sorted = std::slice::from_raw_parts_mut(src.cast::<u32>(), n);
        sorted.sort_unstable();
    }
    let mut want = data.clone();
    want.sort_unstable();
    // SAFETY: inside the view, initialized above.
    let (by_qsort, by_sort) =
        unsafe { (std::slice::from_raw_parts(dst.cast::<u32>(), n), std::slice::from_raw_parts(src.cast::<u32>(), n)) };
    assert!(by_qsort == want.as_slice() && by_sort == want.as_slice());
    // And the API reads the same bytes.
    let mut back = vec![0u8; n * 4];
    space.read(a + n as u64 * 4, &mut back).unwrap();
    assert!(back.chunks(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).eq(want.iter().copied()));
}

#[test]
fn a_host_syscall_into_a_populated_view_works() {
    let vm = vm(FaultPath::Speculative, 16);
    let _cpu = vm.attach().unwrap();
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, 4 * P, RW, PA).unwrap();
    let view = space.host_view(a, 4 * P).unwrap();
    let file = TempFile::new(&pattern(3 * P as usize, 9));
    let f = file.ro();
    // Unpopulated, the host kernel's copy faults and fails with EFAULT.
    // SAFETY: the buffer lies inside the view.
    let r = unsafe { libc::pread(std::os::fd::AsRawFd::as_raw_fd(&f), view.ptr(a).unwrap().cast(), 3 * P as usize, 0) };
    assert_eq!(r, -1);
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFAULT));
    view.populate(a, 3 * P, vmfault::Access::Write).unwrap();
    // SAFETY: as above.
    let r = unsafe { libc::pread(std::os::fd::AsRawFd::as_raw_fd(&f), view.ptr(a).unwrap().cast(), 3 * P as usize, 0) };
    assert_eq!(r, 3 * P as isize);
    let mut back = vec![0u8; 3 * P as usize];
    space.read(a, &mut back).unwrap();
    assert_eq!(back, pattern(3 * P as usize, 9));
}

#[test]
fn stores_through_a_view_reach_a_shared_file_on_msync() {
    for path in PATHS {
        stores_reach_the_file(path);
    }
}

fn stores_reach_the_file(path: FaultPath) {
    let vm = vm(path, 16);
    let _cpu = vm.attach().unwrap();
    let space = vm.new_space().unwrap();
    let file = TempFile::new(&pattern(4 * P as usize, 1));
    let a = space.mmap_file(0, 4 * P, RW, MapFlags::SHARED, &file.rw(), 0).unwrap();
    let view = space.host_view(a, 4 * P).unwrap();
    // A read maps the page read-only (its first store must mark it dirty).
    let before = load(&view, a + P);
    store(&view, a + P, 0x1122_3344_5566_7788);
    space.msync(a, 4 * P).unwrap();
    let on_disk = file.contents();
    let got = u64::from_le_bytes(on_disk[P as usize..P as usize + 8].try_into().unwrap());
    assert_eq!(got, 0x1122_3344_5566_7788, "the store reached the file (it held {before:#x})");
    // Written back, the page is clean and write-protected again: the next
    // store faults, marks it dirty, and reaches the file too.
    store(&view, a + P, 5);
    space.msync(a, 4 * P).unwrap();
    assert_eq!(u64::from_le_bytes(file.contents()[P as usize..P as usize + 8].try_into().unwrap()), 5);
}

#[test]
fn a_working_set_twice_memory_through_a_view_survives_swap() {
    for path in PATHS {
        twice_memory_through_swap(path);
    }
}

fn twice_memory_through_swap(path: FaultPath) {
    let pages = 512u64; // 2 MiB of frames, a 4 MiB working set
    let swap = std::env::temp_dir().join(format!("vmfault-test-hostview-{}-{path:?}.swap", std::process::id()));
    let vm = Vm::new(VmConfig {
        phys_bytes: pages * P,
        cpus: 2,
        prefault: false,
        host_views: true,
        fault_path: path,
        swap: Some(swap),
        ..VmConfig::default()
    })
    .unwrap();
    let _cpu = vm.attach().unwrap();
    let space = vm.new_space().unwrap();
    let n = 2 * pages;
    let a = space.mmap(0, n * P, RW, PA).unwrap();
    let view = space.host_view(a, n * P).unwrap();
    let word = |i: u64| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for i in 0..n {
        store(&view, a + i * P, word(i));
        store(&view, a + i * P + P - 8, !word(i));
    }
    let mut x = 99u64;
    for _ in 0..4 * n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = x % n;
        assert_eq!(load(&view, a + i * P), word(i), "page {i}");
        assert_eq!(load(&view, a + i * P + P - 8), !word(i), "page {i}");
    }
    let s = vm.stats();
    assert!(s.pageouts > 0 && s.pageins > 0, "{path:?}: {} pageouts, {} pageins", s.pageouts, s.pageins);
    drop(view);
    space.munmap(a, n * P).unwrap();
    drop(space);
    drop(_cpu);
    // A daemon pass still running holds the pages it took (and the
    // spaces and objects, dropped by its reaper): wait for it, 10 s at most.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut s = common::settled(&vm);
    while (s.free_pages, s.swap_used_pages) != (pages - 1, 0) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
        s = common::settled(&vm);
    }
    assert_eq!((s.free_pages, s.swap_used_pages), (pages - 1, 0), "{path:?}: frames or swap slots lost");
}

#[test]
fn views_refuse_bad_ranges_and_machines_without_host_views() {
    let plain = Vm::new(VmConfig { phys_bytes: 4 << 20, ..VmConfig::default() }).unwrap();
    let space = plain.new_space().unwrap();
    let e = space.host_view(0x10_0000, P).unwrap_err();
    assert_eq!(e.errno(), libc::EOPNOTSUPP, "{e}");
    let vm = vm(FaultPath::Speculative, 4);
    let space = vm.new_space().unwrap();
    assert_eq!(space.host_view(0x10_0001, P).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(space.host_view(0x10_0000, 0).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(space.host_view(0x10_0000, 100).unwrap_err().errno(), libc::EINVAL);
    assert_eq!(space.host_view(vmfault::TASK_SIZE, P).unwrap_err().errno(), libc::EINVAL);
    let view = space.host_view(0x10_0000, P).unwrap();
    assert!(view.ptr(0x10_0000 + P).is_err() && view.ptr(0xf_f000).is_err());
    assert_eq!(view.range(), (0x10_0000, P));
    // Views come and go; their windows are given back.
    let stop = AtomicBool::new(false);
    for _ in 0..200 {
        drop(space.host_view(0x10_0000, 16 * P).unwrap());
    }
    stop.store(true, Ordering::Relaxed);
}

/// Run this test binary again as a child that runs only `test` with
/// `VMFAULT_VIEW_CHILD=case`; its exit status.
fn child(test: &str, case: &str) -> std::process::ExitStatus {
    std::process::Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("VMFAULT_VIEW_CHILD", case)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
}

/// The child's side of `faults_outside_views_and_refused_ones_end_as_natively`.
#[test]
fn view_child() {
    let Ok(case) = std::env::var("VMFAULT_VIEW_CHILD") else { return };
    extern "C" fn theirs(_: libc::c_int) {
        // SAFETY: async-signal-safe.
        unsafe { libc::_exit(42) };
    }
    if case == "chained" {
        // The embedding program's own handler, installed first.
        // SAFETY: a plain handler function.
        unsafe { libc::signal(libc::SIGSEGV, theirs as *const () as libc::sighandler_t) };
    }
    if case == "map_count" {
        // Every other page mapped: a host mapping each, until the process
        // reaches vm.max_map_count; the error says so.
        let limit: u64 = std::fs::read_to_string("/proc/sys/vm/max_map_count").unwrap().trim().parse().unwrap();
        let pages = limit + 1024;
        let vm =
            Vm::new(VmConfig { phys_bytes: (pages / 2 + 4096) * P, host_views: true, ..VmConfig::default() }).unwrap();
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, pages * P, RW, PA).unwrap();
        let view = space.host_view(a, pages * P).unwrap();
        let e = (0..pages / 2)
            .find_map(|i| view.populate(a + 2 * i * P, P, vmfault::Access::Write).err())
            .expect("the host's limit was reached");
        let named = e.errno() == libc::ENOMEM && e.to_string().contains("max_map_count");
        // SAFETY: async-signal-safe; the verdict is the exit code.
        unsafe { libc::_exit(if named { 0 } else { 1 }) };
    }
    let vm = vm(FaultPath::Speculative, 4);
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, P, Prot::READ, PA).unwrap();
    let view = space.host_view(a, P).unwrap();
    assert_eq!(load(&view, a), 0);
    match case.as_str() {
        // A store the space refuses, no handler: SIGSEGV, as natively.
        "refused" => store(&view, a, 1),
        // A fault outside every view: not vmfault's.
        "outside" | "chained" => {
            let p = std::ptr::null_mut::<u64>().wrapping_add(1);
            // SAFETY: it is not: this faults, on purpose.
            unsafe { p.write_volatile(1) };
        }
        _ => unreachable!(),
    }
    // SAFETY: async-signal-safe, and not reached when the store faults.
    unsafe { libc::_exit(0) };
}

#[test]
fn faults_outside_views_and_refused_ones_end_as_natively() {
    use std::os::unix::process::ExitStatusExt;
    for case in ["refused", "outside"] {
        let status = child("view_child", case);
        assert_eq!(status.signal(), Some(libc::SIGSEGV), "{case}: {status:?}");
    }
    // A handler installed before vmfault's gets the faults that are not in a view.
    let status = child("view_child", "chained");
    assert_eq!(status.code(), Some(42), "chained: {status:?}");
    // Host mappings are limited; reaching the limit is an error that says so.
    let status = child("view_child", "map_count");
    assert_eq!(status.code(), Some(0), "map_count: {status:?}");
}

#[test]
fn a_private_file_mapping_through_a_view_copies_on_write() {
    for path in PATHS {
        let vm = vm(path, 16);
        let _cpu = vm.attach().unwrap();
        let space = vm.new_space().unwrap();
        let contents = pattern(2 * P as usize, 4);
        let file = TempFile::new(&contents);
        let a = space.mmap_file(0, 2 * P, RW, MapFlags::PRIVATE, &file.rw(), 0).unwrap();
        let view = space.host_view(a, 2 * P).unwrap();
        let word = |b: &[u8], at: usize| u64::from_ne_bytes(b[at..at + 8].try_into().unwrap());
        assert_eq!(load(&view, a + P), word(&contents, P as usize), "{path:?}: the file's page");
        store(&view, a + P, 77);
        assert_eq!((load(&view, a + P), api_u64(&space, a + P)), (77, 77), "{path:?}: the private copy");
        drop(view);
        space.munmap(a, 2 * P).unwrap();
        assert_eq!(file.contents(), contents, "{path:?}: the file is untouched");
    }
}
