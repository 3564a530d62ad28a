//! The public API as the README shows it, vCPU handling, SIGSEGV codes,
//! running out of frames, and statistics.

mod common;

use common::{FAULT_PATHS, test_vm};
use vmfault::{Access, AddressSpace, Advice, Error, FaultPath, MapFlags, Prot, SegvCode, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

fn small(phys_bytes: u64, cpus: usize) -> Vm {
    Vm::new(VmConfig { phys_bytes, cpus, prefault: false, ..VmConfig::default() }).unwrap()
}

#[test]
fn the_api_as_documented() -> Result<(), Error> {
    let vm = Vm::new(VmConfig { phys_bytes: 256 << 20, cpus: 4, ..VmConfig::default() })?;
    let _cpu = vm.attach()?;
    let space = vm.new_space()?;
    let a: u64 = space.mmap(0, 1 << 20, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS)?;
    space.write(a + 10, b"hello")?;
    let mut buf = [0u8; 5];
    space.read(a + 10, &mut buf)?;
    assert_eq!(&buf, b"hello");
    space.touch(a, Access::Write)?;
    space.mprotect(a, 4096, Prot::READ)?;
    let err = space.write(a, b"x").unwrap_err();
    assert_eq!(err, Error::Segv { addr: a, code: SegvCode::AccErr });
    assert_eq!(err.errno(), libc::EFAULT);
    space.madvise(a, 1 << 20, Advice::DontNeed)?;
    space.read(a + 10, &mut buf)?;
    assert_eq!(buf, [0; 5]);
    space.munmap(a, 1 << 20)?;
    let s = vm.stats();
    assert!(s.faults >= 2 && s.total_pages == 65536 && s.free_pages > 0);
    let json = serde_json::to_value(&s).unwrap();
    assert!(json["faults"].as_u64().unwrap() >= 2);
    Ok(())
}

#[test]
fn handles_are_clone_send_sync() {
    fn check<T: Clone + Send + Sync + 'static>() {}
    check::<Vm>();
    check::<AddressSpace>();
}

#[test]
fn mmap_places_top_down_and_honours_free_hints() {
    let vm = small(4 << 20, 1);
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, 4 * P, RW, PA).unwrap();
    let b = space.mmap(0, 4 * P, Prot::READ, PA).unwrap();
    assert!(b + 4 * P <= a, "second mapping below the first");
    let hint = 0x1234_5000;
    assert_eq!(space.mmap(hint, P, RW, PA).unwrap(), hint);
    // An occupied hint goes elsewhere; an unaligned one is rounded down.
    assert_ne!(space.mmap(hint, P, RW, PA).unwrap(), hint);
    assert_eq!(space.mmap(0x5555_5123, P, RW, PA).unwrap(), 0x5555_5000);
    // A hint below mmap_min_addr moves up to it.
    assert_eq!(space.mmap(0x1000, P, RW, PA).unwrap(), vmfault::MMAP_MIN_ADDR);
    let err = space.mmap(0x1000, P, RW, PA | MapFlags::FIXED).unwrap_err();
    assert_eq!(err.errno(), libc::EPERM);
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let vm = small(4 << 20, 1);
    let space = vm.new_space().unwrap();
    fn einval<T: std::fmt::Debug>(r: Result<T, Error>) -> i32 {
        r.unwrap_err().errno()
    }
    assert_eq!(einval(space.mmap(0, P, Prot::from_bits_retain(0x100), PA)), libc::EINVAL);
    // Bits Linux does not define are ignored, as Linux ignores them, and
    // so are its legacy no-ops; flags Linux defines that are not modelled
    // here are EINVAL (MAP_32BIT, MAP_HUGETLB, the MAP_DROPPABLE type).
    for ignored in [0x0080_0000, libc::MAP_STACK, libc::MAP_DENYWRITE | libc::MAP_EXECUTABLE, 0x0400_0000] {
        let a = space.mmap(0, P, RW, PA | MapFlags::from_bits_retain(ignored as u32)).unwrap();
        space.munmap(a, P).unwrap();
    }
    for refused in [libc::MAP_32BIT, libc::MAP_HUGETLB, 0x08] {
        assert_eq!(einval(space.mmap(0, P, RW, PA | MapFlags::from_bits_retain(refused as u32))), libc::EINVAL);
    }
    // MAP_NONBLOCK: MAP_POPULATE faults nothing in.
    let faults = vm.stats().faults;
    let a = space.mmap(0, 4 * P, RW, PA | MapFlags::POPULATE | MapFlags::NONBLOCK).unwrap();
    assert_eq!(vm.stats().faults, faults);
    space.munmap(a, 4 * P).unwrap();
    assert_eq!(einval(space.mmap(0, P, RW, MapFlags::PRIVATE)), libc::EBADF);
    assert_eq!(einval(space.mmap(0, u64::MAX, RW, PA)), libc::ENOMEM);
    assert_eq!(einval(space.munmap(u64::MAX - 4095, P)), libc::EINVAL);
    assert_eq!(einval(space.mprotect(0, u64::MAX, RW)), libc::ENOMEM);
    assert_eq!(einval(space.madvise(P, u64::MAX, Advice::DontNeed)), libc::EINVAL);
    assert!(space.read(u64::MAX - 2, &mut [0u8; 8]).is_err());
    assert!(space.write(u64::MAX, &[1]).is_err());
    assert_eq!(
        space.touch(vmfault::TASK_SIZE, Access::Read),
        Err(Error::Segv { addr: vmfault::TASK_SIZE, code: SegvCode::MapErr })
    );
    // A zero-length access touches nothing, even at a bad address.
    assert_eq!(space.read(0, &mut []), Ok(()));
    let e = space.mprotect(P + 1, P, RW).unwrap_err();
    assert_eq!(e.to_string(), "mprotect: address not page-aligned (0x1001)");
}

#[test]
fn segv_codes_and_first_bad_address() {
    for path in FAULT_PATHS {
        segv_codes(path);
    }
}

fn segv_codes(path: FaultPath) {
    let vm = test_vm(4 << 20, 1, path);
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, 3 * P, RW, PA).unwrap();
    space.munmap(a + 2 * P, P).unwrap();
    space.mprotect(a + P, P, Prot::NONE).unwrap();
    assert_eq!(space.touch(a + P + 5, Access::Read), Err(Error::Segv { addr: a + P + 5, code: SegvCode::AccErr }));
    assert_eq!(space.touch(a + 2 * P, Access::Read), Err(Error::Segv { addr: a + 2 * P, code: SegvCode::MapErr }));
    assert_eq!(space.touch(a, Access::Exec), Err(Error::Segv { addr: a, code: SegvCode::AccErr }));
    // A write that crosses into the PROT_NONE page stores the bytes before it.
    let data = [7u8; 100];
    let err = space.write(a + P - 50, &data).unwrap_err();
    assert_eq!(err, Error::Segv { addr: a + P, code: SegvCode::AccErr });
    let mut back = [0u8; 50];
    space.read(a + P - 50, &mut back).unwrap();
    assert_eq!(back, [7u8; 50]);
    let mut buf = [1u8; 100];
    let err = space.read(a + P - 50, &mut buf).unwrap_err();
    assert_eq!(err, Error::Segv { addr: a + P, code: SegvCode::AccErr });
    assert_eq!(&buf[..50], &[7u8; 50]);
    assert_eq!(vm.stats().segv, 5);
}

#[test]
fn vcpu_slots_attach_run_out_and_unattached_threads_share_one() {
    let vm = small(16 << 20, 2);
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, 64 * P, RW, PA).unwrap();
    let g = vm.attach().unwrap();
    assert_eq!(vm.attach().unwrap_err(), Error::AlreadyAttached { cpu: g.cpu() });
    let vm2 = vm.clone();
    let t = std::thread::spawn(move || {
        let _g = vm2.attach().unwrap();
        let vm3 = vm2.clone();
        std::thread::spawn(move || vm3.attach().map(|_| ())).join().unwrap()
    });
    assert_eq!(t.join().unwrap(), Err(Error::NoCpu { cpus: 2 }));
    // Eight unattached threads fault concurrently through the shared slot.
    let threads: Vec<_> = (0..8u64)
        .map(|i| {
            let space = space.clone();
            std::thread::spawn(move || {
                for p in 0..8 {
                    space.write(a + (i * 8 + p) * P, &[i as u8 + 1; 16]).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for i in 0..64u64 {
        let mut b = [0u8; 16];
        space.read(a + i * P, &mut b).unwrap();
        assert_eq!(b, [(i / 8) as u8 + 1; 16]);
    }
    let shared_slot = vm.cpu_stats().pop().unwrap();
    assert_eq!(shared_slot.counters.zero_fill, 64);
    drop(g);
    assert_eq!(vm.stats().cpus_attached, 0);
}

#[test]
fn out_of_frames_is_enomem_and_leaks_nothing() {
    for path in FAULT_PATHS {
        out_of_frames(path);
    }
}

fn out_of_frames(path: FaultPath) {
    let vm = test_vm(64 * P, 1, path);
    let space = vm.new_space().unwrap();
    let initial = vm.stats().free_pages;
    let a = space.mmap(0, 256 * P, RW, PA).unwrap();
    let mut written = 0;
    let err = loop {
        match space.write(a + written * P, &[0xAB; 8]) {
            Ok(()) => written += 1,
            Err(e) => break e,
        }
    };
    assert!(matches!(err, Error::NoMemory { .. }), "{err}");
    assert_eq!(err.errno(), libc::ENOMEM);
    assert!(written > 40, "only {written} pages before ENOMEM");
    assert_eq!(vm.stats().free_pages, 0);
    assert!(vm.stats().fault_nomem >= 1);
    // Nothing half-installed: the failed page reads as zeros (zero page, no
    // allocation), every written page kept its bytes.
    let mut b = [1u8; 8];
    space.read(a + written * P, &mut b).unwrap();
    assert_eq!(b, [0; 8]);
    for p in 0..written {
        space.read(a + p * P, &mut b).unwrap();
        assert_eq!(b, [0xAB; 8]);
    }
    // A shared mapping's object costs no frame until its first page (its
    // index grows from nothing, as Linux's xarray): mmap succeeds, as on
    // Linux; the store needs a page and an index node: ENOMEM.
    let sh = space.mmap(0, P, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
    assert_eq!(space.write(sh, b"x").unwrap_err().errno(), libc::ENOMEM);
    space.munmap(sh, P).unwrap();
    space.munmap(a, 256 * P).unwrap();
    assert_eq!(vm.stats().free_pages, initial);
    // And memory is usable again.
    let b2 = space.mmap(0, 8 * P, RW, PA | MapFlags::POPULATE).unwrap();
    space.write(b2, b"again").unwrap();
    drop(space);
    assert_eq!(vm.stats().free_pages, initial + 1, "the page-table root is freed with the space");
}

#[test]
fn populate_and_zero_page_statistics() {
    let vm = small(8 << 20, 1);
    let space = vm.new_space().unwrap();
    let before = vm.stats();
    let a = space.mmap(0, 16 * P, RW, PA | MapFlags::POPULATE).unwrap();
    let s = vm.stats();
    assert_eq!(s.zero_fill - before.zero_fill, 16);
    space.touch(a, Access::Write).unwrap();
    assert_eq!(vm.stats().faults, s.faults, "populated pages do not fault again");
    let r = space.mmap(0, 16 * P, Prot::READ, PA | MapFlags::POPULATE).unwrap();
    assert_eq!(vm.stats().zero_page_maps - s.zero_page_maps, 16);
    let mut b = [9u8; 3];
    space.read(r + 5 * P, &mut b).unwrap();
    assert_eq!(b, [0; 3]);
    // Without the zero page, reads allocate.
    let mut cfg = small(8 << 20, 1).config().clone();
    cfg.zero_page = false;
    let vm = Vm::new(cfg).unwrap();
    let space = vm.new_space().unwrap();
    let r = space.mmap(0, 4 * P, Prot::READ, PA).unwrap();
    space.read(r, &mut [0u8; 4 * 4096]).unwrap();
    assert_eq!((vm.stats().zero_fill, vm.stats().zero_page_maps), (4, 0));
}

#[test]
fn many_vms_coexist() {
    let vms: Vec<Vm> = (0..4).map(|_| small(2 << 20, 1)).collect();
    let spaces: Vec<AddressSpace> = vms.iter().map(|v| v.new_space().unwrap()).collect();
    for (i, s) in spaces.iter().enumerate() {
        let a = s.mmap(0x10_0000, P, RW, PA | MapFlags::FIXED).unwrap();
        s.write(a, &[i as u8; 4]).unwrap();
    }
    for (i, s) in spaces.iter().enumerate() {
        let mut b = [0u8; 4];
        s.read(0x10_0000, &mut b).unwrap();
        assert_eq!(b, [i as u8; 4]);
    }
    let _g0 = vms[0].attach().unwrap();
    let _g1 = vms[1].attach().unwrap();
    assert!(!vms[0].same_vm(&vms[1]));
}

#[test]
fn page_tables_are_freed_with_their_last_mapping() {
    let vm = small(8 << 20, 1);
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, 2048 * P, RW, PA).unwrap();
    for p in (0..2048).step_by(64) {
        space.touch(a + p * P, Access::Write).unwrap();
    }
    assert!(space.page_table_pages() >= 5);
    assert_eq!(vm.stats().page_table_pages, space.page_table_pages());
    space.munmap(a, 1024 * P).unwrap();
    space.munmap(a + 1024 * P, 1024 * P).unwrap();
    assert_eq!(space.page_table_pages(), 1);
    assert_eq!(vm.stats().data_pages, 0);
    assert_eq!(vm.stats().index_pages, 0);
}

#[test]
fn a_space_kept_in_a_thread_local_ends_with_its_thread() {
    // The space's objects end in this thread-local's destructor, after the
    // destructors of the thread-locals vmfault used during the munmap below
    // (they were initialized later, so they go first): nothing may panic
    // there (a panic in a thread-local destructor aborts the process).
    thread_local! {
        static KEPT: std::cell::RefCell<Option<(AddressSpace, u64)>> = const { std::cell::RefCell::new(None) };
    }
    let vm = small(16 << 20, 1);
    let t = std::thread::spawn({
        let vm = vm.clone();
        move || {
            let space = vm.new_space().unwrap();
            let rw = Prot::READ | Prot::WRITE;
            let a = space.mmap(0, 8 << 12, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
            space.write(a, b"kept").unwrap();
            space.write(a + (4 << 12), b"gone").unwrap();
            KEPT.with(|k| *k.borrow_mut() = Some((space.clone(), a)));
            // Ends the second mapping's object in this call (the sink).
            let b = space.mmap(0, 4 << 12, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
            space.write(b, b"x").unwrap();
            space.munmap(b, 4 << 12).unwrap();
        }
    });
    t.join().expect("the thread ends cleanly");
    assert_eq!(vm.stats().data_pages, 0, "the kept space's pages were freed at the thread's end");
}

#[test]
fn fetch_needs_execute_permission_and_reads_as_a_load() {
    for path in FAULT_PATHS {
        let vm = test_vm(8 << 20, 1, path);
        let s = vm.new_space().unwrap();
        let rw = Prot::READ | Prot::WRITE;
        let a = s.mmap(0, 3 * 4096, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        let code: Vec<u8> = (0..2 * 4096u32).map(|i| (i * 7 + 1) as u8).collect();
        s.write(a, &code).unwrap();
        let mut buf = vec![0u8; code.len()];
        // Readable and writable is not executable.
        assert!(matches!(s.fetch(a, &mut buf), Err(Error::Segv { addr, code: SegvCode::AccErr }) if addr == a));
        s.mprotect(a, 4096, Prot::READ | Prot::EXEC).unwrap();
        // Across into the page without PROT_EXEC: the first page's bytes,
        // then SEGV_ACCERR at the boundary.
        let e = s.fetch(a + 100, &mut buf).unwrap_err();
        assert!(matches!(e, Error::Segv { addr, code: SegvCode::AccErr } if addr == a + 4096), "{path:?}: {e:?}");
        assert_eq!(buf[..4096 - 100], code[100..4096]);
        s.mprotect(a + 4096, 4096, Prot::READ | Prot::EXEC).unwrap();
        s.fetch(a, &mut buf).unwrap();
        assert_eq!(buf, code);
        // Execute-only still fetches (x86 reads what it may execute);
        // PROT_NONE does not; a fresh executable page fetches zeros.
        s.mprotect(a, 4096, Prot::EXEC).unwrap();
        s.fetch(a, &mut buf[..16]).unwrap();
        s.mprotect(a, 4096, Prot::NONE).unwrap();
        assert!(matches!(s.fetch(a, &mut buf[..1]), Err(Error::Segv { code: SegvCode::AccErr, .. })));
        s.mprotect(a + 2 * 4096, 4096, Prot::READ | Prot::EXEC).unwrap();
        let mut z = [1u8; 8];
        s.fetch(a + 2 * 4096, &mut z).unwrap();
        assert_eq!(z, [0; 8]);
        // Beyond every mapping: SEGV_MAPERR.
        s.munmap(a, 3 * 4096).unwrap();
        assert!(matches!(s.fetch(a, &mut z), Err(Error::Segv { code: SegvCode::MapErr, .. })));
    }
}

#[test]
fn each_space_counts_its_own_faults() {
    for path in FAULT_PATHS {
        let vm = test_vm(8 << 20, 2, path);
        let (a, b) = (vm.new_space().unwrap(), vm.new_space().unwrap());
        let rw = Prot::READ | Prot::WRITE;
        let pa = MapFlags::PRIVATE | MapFlags::ANONYMOUS;
        let (x, y) = (a.mmap(0, 16 * 4096, rw, pa).unwrap(), b.mmap(0, 16 * 4096, rw, pa).unwrap());
        let before = vm.stats().faults;
        // Five pages in a from this thread, three in b from an attached
        // vCPU, a refused access in b, and loads of mapped pages (no fault).
        for p in 0..5 {
            a.write(x + p * 4096, &[1]).unwrap();
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                let _cpu = vm.attach().unwrap();
                for p in 0..3 {
                    b.write(y + p * 4096, &[1]).unwrap();
                }
                assert!(b.touch(u64::MAX - 4095, Access::Read).is_err());
            });
        });
        a.read(x, &mut [0; 4096]).unwrap();
        assert_eq!((a.faults(), b.faults()), (5, 4), "{path:?}");
        assert_eq!(vm.stats().faults - before, 9, "{path:?}");
        // A child starts at zero.
        let child = a.fork().unwrap();
        assert_eq!(child.faults(), 0);
        child.write(x, &[2]).unwrap();
        assert_eq!((child.faults(), a.faults()), (1, 5), "{path:?}");
    }
}
