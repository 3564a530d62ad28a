//! `map_lock=zoned`: VMAs that cross a zone edge are Linux's VMAs (the
//! differential tests run across an edge too), changes lock the zones of
//! every VMA they touch, and an mmap that finds its zone busy goes below it.

use std::sync::{Arc, Barrier};

use vmfault::{AddressSpace, MapFlags, MapLock, MappingInfo, Prot, Vm, VmConfig};

const P: u64 = 4096;
/// A zone edge (512 GiB zones).
const EDGE: u64 = 0x5000_0000_0000;
const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

fn zoned(cpus: usize) -> Vm {
    Vm::new(VmConfig { phys_bytes: 16 << 20, cpus, prefault: false, map_lock: MapLock::Zoned, ..VmConfig::default() })
        .unwrap()
}

fn ranges(s: &AddressSpace) -> Vec<(u64, u64, Prot)> {
    s.mappings().iter().map(|m: &MappingInfo| (m.start, m.end, m.prot)).collect()
}

#[test]
fn a_vma_across_an_edge_is_one_vma() {
    let vm = zoned(2);
    let s = vm.new_space().unwrap();
    let a = s.mmap(EDGE - 4 * P, 8 * P, RW, PA | MapFlags::FIXED).unwrap();
    assert_eq!(ranges(&s), vec![(a, a + 8 * P, RW)]);
    // Faults on both sides share one object: writes on one side of the
    // edge and reads on the other see one mapping.
    s.write(EDGE - P, b"below").unwrap();
    s.write(EDGE, b"above").unwrap();
    // Split at the edge and merged back, as Linux would.
    s.mprotect(EDGE, 4 * P, Prot::READ).unwrap();
    assert_eq!(ranges(&s), vec![(a, EDGE, RW), (EDGE, a + 8 * P, Prot::READ)]);
    s.mprotect(EDGE, 4 * P, RW).unwrap();
    assert_eq!(ranges(&s), vec![(a, a + 8 * P, RW)]);
    // A munmap of one side leaves the other, whose pages stay.
    s.munmap(a, 4 * P).unwrap();
    assert_eq!(ranges(&s), vec![(EDGE, a + 8 * P, RW)]);
    let mut buf = [0u8; 5];
    s.read(EDGE, &mut buf).unwrap();
    assert_eq!(&buf, b"above");
    // The child of a fork sees the same, and its copies are its own.
    let child = s.fork().unwrap();
    child.write(EDGE, b"child").unwrap();
    s.read(EDGE, &mut buf).unwrap();
    assert_eq!(&buf, b"above");
    assert_eq!(ranges(&child), ranges(&s));
}

#[test]
fn a_change_inside_one_zone_locks_the_zones_of_a_vma_it_splits() {
    let vm = zoned(2);
    let s = vm.new_space().unwrap();
    // A VMA over three zones; a munmap of a page in the middle zone splits
    // it, and both parts must leave every zone's index (else a lookup in
    // the first or last zone would find the old VMA).
    let a = s.mmap(EDGE - P, (1 << 40) + 2 * P, RW, PA | MapFlags::FIXED).unwrap();
    let mid = EDGE + (1 << 39) - P;
    s.munmap(mid, 2 * P).unwrap();
    assert_eq!(ranges(&s), vec![(a, mid, RW), (mid + 2 * P, a + (1 << 40) + 2 * P, RW)]);
    s.write(a, b"x").unwrap();
    s.write(a + (1 << 40) + P, b"y").unwrap();
    assert!(s.write(mid, b"z").is_err());
    s.munmap(a, (1 << 40) + 2 * P).unwrap();
    assert!(s.mappings().is_empty());
    assert!(s.write(a, b"x").is_err());
}

#[test]
fn unhinted_mmaps_take_linux_addresses_one_at_a_time() {
    let (zoned, global) =
        (zoned(1), Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 1, ..VmConfig::default() }).unwrap());
    let (z, g) = (zoned.new_space().unwrap(), global.new_space().unwrap());
    for len in [P, 1 << 20, 3 * P, 1 << 30, P] {
        assert_eq!(z.mmap(0, len, RW, PA).unwrap(), g.mmap(0, len, RW, PA).unwrap());
    }
    assert_eq!(ranges(&z), ranges(&g));
}

#[test]
fn mmaps_in_flight_at_once_never_overlap() {
    // Two vCPUs map and unmap 128 MiB with no hint as fast as they can:
    // contention-aware placement moves one below the other's zone at
    // times, and no two mappings ever overlap (each thread writes its
    // mapping's first and last page and reads them back).
    let vm = Arc::new(zoned(2));
    let s = vm.new_space().unwrap();
    let go = Arc::new(Barrier::new(2));
    let workers: Vec<_> = (0..2u8)
        .map(|t| {
            let (vm, s, go) = (vm.clone(), s.clone(), go.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                go.wait();
                for _ in 0..2000 {
                    let len = 128 << 20;
                    let a = s.mmap(0, len, RW, PA).unwrap();
                    s.write(a, &[t]).unwrap();
                    s.write(a + len - 1, &[t]).unwrap();
                    let (mut x, mut y) = ([0], [0]);
                    s.read(a, &mut x).unwrap();
                    s.read(a + len - 1, &mut y).unwrap();
                    assert_eq!((x, y), ([t], [t]));
                    s.munmap(a, len).unwrap();
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert!(s.mappings().is_empty());
}

#[test]
fn the_map_count_limit_holds_with_either_map_lock() {
    // Linux's check (`mm->map_count > sysctl_max_map_count`) before each
    // mmap: the 65,532nd separate mapping fails, whatever the map lock
    // (zoned: a count kept per vCPU and moved to the space's in batches).
    for map_lock in [MapLock::Global, MapLock::Zoned] {
        let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 2, prefault: false, map_lock, ..VmConfig::default() })
            .unwrap();
        let s = vm.new_space().unwrap();
        let base = EDGE - (1 << 30);
        let mut n = 0u64;
        let err = loop {
            // Every other page, so that nothing merges.
            match s.mmap(base + 2 * n * P, P, RW, PA | MapFlags::FIXED) {
                Ok(_) => n += 1,
                Err(e) => break e,
            }
        };
        assert_eq!(n, vmfault::MAX_MAP_COUNT as u64 + 1, "{map_lock:?}");
        assert_eq!(err.errno(), libc::ENOMEM, "{map_lock:?}: {err}");
        // Below the limit again, mappings succeed.
        s.munmap(base, 2 * P).unwrap();
        s.mmap(base, P, RW, PA | MapFlags::FIXED).unwrap();
    }
}

#[test]
fn an_unmapped_objects_pages_are_freed_though_another_vcpu_retired_the_snapshot_that_names_it() {
    // vCPU B maps shared memory X, fills it, then maps Y (its change
    // retires a snapshot that still names X, onto B's own list) and goes
    // idle. vCPU A unmaps X: A's change takes B's retired snapshots over,
    // so X's object and pages end now, not at B's next change.
    for map_lock in [MapLock::Global, MapLock::Zoned] {
        let vm = Arc::new(
            Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 2, prefault: false, map_lock, ..VmConfig::default() })
                .unwrap(),
        );
        let s = vm.new_space().unwrap();
        let shared = MapFlags::SHARED | MapFlags::ANONYMOUS;
        let (mapped, idle, done) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
        let b = {
            let (vm, s, mapped, idle, done) = (vm.clone(), s.clone(), mapped.clone(), idle.clone(), done.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                let x = s.mmap(0, 64 * P, RW, shared).unwrap();
                for p in 0..64 {
                    s.write(x + p * P, &[1]).unwrap();
                }
                s.mmap(0, P, RW, shared).unwrap();
                mapped.wait();
                idle.wait();
                done.wait();
                x
            })
        };
        mapped.wait();
        let before = vm.stats().data_pages;
        let _cpu = vm.attach().unwrap();
        // X is the mapping above Y (top-down): the second one listed.
        let x = s.mappings()[1].start;
        s.munmap(x, 64 * P).unwrap();
        let after = vm.stats().data_pages;
        idle.wait();
        done.wait();
        assert_eq!(b.join().unwrap(), x);
        assert!(
            before >= 64 && after + 64 <= before,
            "{map_lock:?}: data pages {before} before the munmap, {after} after"
        );
    }
}
