//! `mlock`/`munlock`: pages faulted in and wired, one wiring per PTE,
//! dropped by munlock, munmap, copy-on-write and the end of the space, in
//! every fault path and both reference-count modes. The errno and layout
//! semantics are compared with the host kernel by `tests/differential.rs`
//! (random sequences include mlock and munlock).

mod common;

use common::FAULT_PATHS;
use vmfault::{Advice, MapFlags, Prot, Refcount, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);
const SA: MapFlags = MapFlags::SHARED.union(MapFlags::ANONYMOUS);
const MODES: [Refcount; 2] = [Refcount::Atomic, Refcount::PageLock];

fn vm(path: vmfault::FaultPath, refcount: Refcount) -> Vm {
    Vm::new(VmConfig {
        phys_bytes: 16 << 20,
        cpus: 8,
        prefault: false,
        fault_path: path,
        refcount,
        ..VmConfig::default()
    })
    .unwrap()
}

/// `MAP_LOCKED` is `mmap` and `mlock` in one: the mapping is locked, its
/// pages faulted in and wired (a private writable one's written-to, a
/// read-only one's the zero page, which needs no wiring), and it does not
/// merge with an unlocked neighbour.
#[test]
fn map_locked_maps_faults_in_and_wires() {
    for path in FAULT_PATHS {
        let vm = vm(path, Refcount::Atomic);
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 8 * P, RW, PA | MapFlags::LOCKED).unwrap();
        let st = vm.stats();
        assert_eq!((st.wired_pages, st.zero_fill), (8, 8), "{path:?}: faulted in and wired");
        assert!(s.mappings().iter().all(|m| m.locked), "{path:?}");
        // Below it, unlocked: two mappings, not one.
        s.mmap(a - 8 * P, 8 * P, RW, PA | MapFlags::FIXED).unwrap();
        assert_eq!(s.mappings().len(), 2, "{path:?}: a locked mapping merged with an unlocked one");
        let ro = s.mmap(0, 4 * P, Prot::READ, PA | MapFlags::LOCKED).unwrap();
        assert_eq!(vm.stats().wired_pages, 8, "{path:?}: the zero page is not wired");
        let mut b = [9u8];
        s.read(ro, &mut b).unwrap();
        assert_eq!(b, [0]);
        // PROT_NONE: locked, nothing faulted in, no error (as Linux).
        let none = s.mmap(0, 2 * P, Prot::empty(), PA | MapFlags::LOCKED).unwrap();
        assert!(s.mappings().iter().any(|m| m.start == none && m.locked), "{path:?}");
        s.munmap(a, 8 * P).unwrap();
        assert_eq!(vm.stats().wired_pages, 0, "{path:?}: munmap unwired them");
        s.munmap(a - 8 * P, 8 * P).unwrap();
    }
}

#[test]
fn mlock_wires_each_page_once_and_munlock_unwires() {
    for path in FAULT_PATHS {
        for mode in MODES {
            let vm = vm(path, mode);
            let start = vm.stats().free_pages;
            let s = vm.new_space().unwrap();
            let a = s.mmap(0, 32 * P, RW, PA).unwrap();
            s.write(a, b"resident before the lock").unwrap();
            s.mlock(a + 100, 16 * P - 100).unwrap();
            let st = vm.stats();
            let what = format!("{path:?} {mode:?}");
            assert_eq!((st.wired_pages, st.wirings, st.zero_fill), (16, 16, 16), "{what}: faulted in and wired");
            let locked: Vec<_> = s.mappings().iter().map(|m| (m.end - m.start, m.locked)).collect();
            assert_eq!(locked, [(16 * P, true), (16 * P, false)], "{what}");
            s.mlock(a, 16 * P).unwrap();
            assert_eq!(vm.stats().wirings, 16, "{what}: locking a locked range wires nothing");
            // Faults in a locked mapping that has lost its PTEs wire again.
            s.munlock(a + 4 * P, 4 * P).unwrap();
            assert_eq!(vm.stats().wired_pages, 12, "{what}: munlock unwired 4");
            s.munlock(a, 32 * P).unwrap();
            let st = vm.stats();
            assert_eq!((st.wired_pages, s.mappings().len()), (0, 1), "{what}: all unwired, merged again");
            s.mlock(a, 32 * P).unwrap();
            assert_eq!(vm.stats().wired_pages, 32, "{what}: wired again without new faults for the first 16");
            let mut buf = [0u8; 24];
            s.read(a, &mut buf).unwrap();
            assert_eq!(&buf, b"resident before the lock", "{what}");
            let st = vm.stats();
            match mode {
                Refcount::Atomic => assert_eq!(st.page_lock_acquisitions, 0, "{what}"),
                // Each wiring, and each unwiring by munlock (16 + 32 wirings,
                // 4 + 12 unwirings).
                Refcount::PageLock => assert_eq!(st.page_lock_acquisitions, 64, "{what}"),
            }
            // munmap of a locked range unwires and frees every page.
            s.munmap(a, 32 * P).unwrap();
            assert_eq!(vm.stats().wired_pages, 0, "{what}");
            drop(s);
            assert_eq!(common::settled_at(&vm, start).free_pages, start, "{what}: every frame back");
        }
    }
}

#[test]
fn populate_follows_linux() {
    for path in FAULT_PATHS {
        let vm = vm(path, Refcount::Atomic);
        let s = vm.new_space().unwrap();
        // Read-only private memory maps the zero page: nothing to wire.
        let ro = s.mmap(0, 4 * P, Prot::READ, PA).unwrap();
        s.mlock(ro, 4 * P).unwrap();
        let st = vm.stats();
        assert_eq!((st.zero_page_maps, st.wired_pages), (4, 0), "{path:?}");
        // Shared memory is read-faulted in, and wired.
        let sh = s.mmap(0, 4 * P, RW, SA).unwrap();
        s.mlock(sh, 4 * P).unwrap();
        assert_eq!(vm.stats().wired_pages, 4, "{path:?}");
        // A PROT_NONE piece: ENOMEM, the pages before it resident, the
        // whole range locked.
        let a = s.mmap(0, 8 * P, RW, PA).unwrap();
        s.mprotect(a + 4 * P, P, Prot::NONE).unwrap();
        let e = s.mlock(a + 2 * P, 4 * P).unwrap_err();
        assert_eq!(e.errno(), libc::ENOMEM, "{path:?}: {e}");
        assert_eq!(vm.stats().wired_pages, 6, "{path:?}: the two pages before it");
        assert!(s.mappings().iter().filter(|m| m.start >= a + 2 * P && m.end <= a + 6 * P).all(|m| m.locked));
        // A hole: ENOMEM before anything is faulted in.
        s.munmap(a + 7 * P, P).unwrap();
        let faults = vm.stats().faults;
        assert_eq!(s.mlock(a + 5 * P, 3 * P).unwrap_err().errno(), libc::ENOMEM);
        assert_eq!(vm.stats().faults, faults, "{path:?}: no population after a hole");
        // DONTNEED refuses locked memory (and advises what comes before).
        let e = s.madvise(a, 4 * P, Advice::DontNeed).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{path:?}: {e}");
        assert_eq!(s.mlock(u64::MAX - P + 1, 2 * P).unwrap_err().errno(), libc::EINVAL);
        assert!(s.mlock(a, u64::MAX).is_ok(), "a length that rounds to 0 locks nothing (as Linux)");
    }
}

#[test]
fn copy_on_write_moves_the_wiring_and_fork_does_not_inherit_the_lock() {
    for path in FAULT_PATHS {
        let vm = vm(path, Refcount::Atomic);
        let start = vm.stats().free_pages;
        let parent = vm.new_space().unwrap();
        let a = parent.mmap(0, 8 * P, RW, PA).unwrap();
        parent.write(a, b"parent").unwrap();
        parent.mprotect(a, 8 * P, Prot::READ).unwrap();
        parent.mlock(a, 8 * P).unwrap();
        // One page of our own, seven zero pages: one wiring.
        assert_eq!(vm.stats().wired_pages, 1, "{path:?}");
        // Linux's mprotect_fixup: locked private memory made writable is
        // faulted in for writing at once.
        parent.mprotect(a, 8 * P, RW).unwrap();
        assert_eq!(vm.stats().wired_pages, 8, "{path:?}: every page wired, copy-on-write broken");
        let child = parent.fork().unwrap();
        assert!(child.mappings().iter().all(|m| !m.locked), "{path:?}: the child is not locked");
        assert!(parent.mappings().iter().any(|m| m.locked), "{path:?}");
        // The parent's store copies the shared page: the new page takes the
        // wiring, the old one (now the child's view) loses it.
        parent.write(a, b"PARENT").unwrap();
        let mut buf = [0u8; 6];
        child.read(a, &mut buf).unwrap();
        assert_eq!(&buf, b"parent", "{path:?}");
        assert_eq!(vm.stats().wired_pages, 8, "{path:?}: one wiring per locked PTE");
        drop(child);
        drop(parent);
        vm.drain_pcpu_caches();
        let end = vm.stats();
        assert_eq!((end.wired_pages, end.free_pages), (0, start), "{path:?}: every frame back");
    }
}

#[test]
fn concurrent_mlock_of_one_shared_range() {
    for mode in MODES {
        let vm = vm(vmfault::FaultPath::Speculative, mode);
        let start = vm.stats().free_pages;
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 16 * P, RW, SA).unwrap();
        s.write(a, b"shared").unwrap();
        let spaces: Vec<_> = (0..4).map(|_| s.fork().unwrap()).collect();
        std::thread::scope(|t| {
            for (i, sp) in spaces.iter().enumerate() {
                let vm = vm.clone();
                t.spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    for n in 0..300 {
                        sp.mlock(a, 16 * P).unwrap();
                        if n % 50 == i {
                            sp.write(a + P, &[n as u8]).unwrap();
                        }
                        sp.munlock(a, 16 * P).unwrap();
                    }
                });
            }
        });
        let st = vm.stats();
        assert_eq!(st.wired_pages, 0, "{mode:?}");
        assert_eq!(st.wirings, 4 * 300 * 16, "{mode:?}: every mlock wired every page once");
        drop(spaces);
        drop(s);
        assert_eq!(common::settled_at(&vm, start).free_pages, start, "{mode:?}");
    }
}
