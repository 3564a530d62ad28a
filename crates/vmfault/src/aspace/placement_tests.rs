//! Where an unhinted mmap lands while another vCPU is inside an operation
//! on the space (`zones.rs`, "Placement"): in a zone of the mapping vCPU's
//! own below Linux's; with nothing else in flight, at Linux's address.

use super::layout::MMAP_BASE;
use crate::config::{MapLock, VmConfig};
use crate::machine::Vm;
use crate::types::{MapFlags, Prot};

const LEN: u64 = 128 << 20;

fn vm(map_lock: MapLock) -> Vm {
    Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 2, prefault: false, map_lock, ..VmConfig::default() }).unwrap()
}

fn map(space: &crate::AddressSpace) -> u64 {
    space.mmap(0, LEN, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap()
}

/// Run `f` while another vCPU holds the map lock of `at`'s zone for reading.
fn with_another_inside<R>(vm: &Vm, space: &crate::AddressSpace, at: u64, f: impl FnOnce() -> R) -> R {
    let s = &space.s;
    super::another_vcpu::while_another_vcpu_holds(
        vm,
        |ctx, wait| {
            let _held = s.map_read(ctx, at, at + 1);
            wait();
        },
        f,
    )
}

#[test]
fn an_unhinted_mmap_takes_its_own_zone_only_while_another_vcpu_is_in_flight() {
    let vm = vm(MapLock::Zoned);
    let space = vm.new_space().unwrap();
    let cpu = vm.attach().unwrap();
    let first = map(&space);
    assert_eq!(first, MMAP_BASE - LEN, "nothing else in flight: Linux's address");
    let zones = &space.s.zones;
    let linux = zones.zone_of(MMAP_BASE - 1);
    let home = zones.home_below(linux, cpu.cpu()).unwrap();
    // The other vCPU works far away, in a zone of its own: still in flight.
    let busy = with_another_inside(&vm, &space, 1 << 40, || map(&space));
    assert_eq!(zones.zone_of(busy), home, "in flight elsewhere: this vCPU's own zone ({busy:#x})");
    let top = zones.end_of(home) - crate::types::PAGE_SIZE - super::stack::STACK_GUARD_GAP;
    assert_eq!(busy + LEN, top, "at its top, a page and a stack guard gap short");
    // Done: Linux's address again (below the first mapping).
    assert_eq!(map(&space), first - LEN);
    // This vCPU's own operations never count against it.
    assert_eq!(map(&space), first - 2 * LEN);
}

#[test]
fn a_search_under_a_zone_lock_stays_above_mmap_min_addr() {
    use crate::types::{MMAP_MIN_ADDR, PAGE_SIZE};
    let vm = vm(MapLock::Zoned);
    let space = vm.new_space().unwrap();
    let s = &space.s;
    // Zone 0, empty: a mapping as long as the zone's searched span would
    // start a page above address 0, below `MMAP_MIN_ADDR`.
    let top = s.zones.end_of(0) - PAGE_SIZE - super::stack::STACK_GUARD_GAP;
    s.vm.with_ctx(|ctx| {
        assert!(s.placed_in(ctx, 0, top - PAGE_SIZE, None).is_none(), "no room above MMAP_MIN_ADDR");
        let (_map, start) = s.placed_in(ctx, 0, top - MMAP_MIN_ADDR, None).expect("room from MMAP_MIN_ADDR");
        assert_eq!(start, MMAP_MIN_ADDR);
    });
}

#[test]
fn the_homes_of_the_first_vcpus_share_no_line_of_the_root_table() {
    use super::zones::ZONE_SHIFT;
    let vm = vm(MapLock::Zoned);
    let space = vm.new_space().unwrap();
    let zones = &space.s.zones;
    let linux = zones.zone_of(MMAP_BASE - 1);
    // A zone is one 8-byte entry of the root table: its line is `z / 8`.
    assert_eq!(1u64 << ZONE_SHIFT, 512 << 30);
    let lines = linux / 8;
    let mut seen = std::collections::HashSet::new();
    for slot in 0..lines {
        let home = zones.home_below(linux, slot).unwrap();
        assert!(home < linux, "slot {slot}: home {home} below Linux's zone {linux}");
        assert_ne!(home / 8, linux / 8, "slot {slot}: not on the line of Linux's zone");
        assert!(seen.insert(home / 8), "slot {slot}: home {home} on a line another slot's home is on");
    }
    // Past them, homes share lines but not zones, for as long as there are zones.
    let mut zones_seen = std::collections::HashSet::new();
    for slot in 0..lines * 8 {
        let home = zones.home_below(linux, slot).unwrap();
        assert!(home < linux && zones_seen.insert(home), "slot {slot}: home {home}");
    }
}

#[test]
fn the_zone_sets_of_distinct_homes_never_meet() {
    use super::zones::ZoneSet;
    use crate::types::PAGE_SIZE;
    let vm = vm(MapLock::Zoned);
    let space = vm.new_space().unwrap();
    let zones = &space.s.zones;
    let geo = zones.geo();
    let linux = zones.zone_of(MMAP_BASE - 1);
    let page_of = |z: usize| geo.zone_set(geo.start_of(z), geo.start_of(z) + PAGE_SIZE);
    // Every home of 64 slots, Linux's zone, and vmlocal's and brk1's
    // consecutive zones: one set each, meeting none of the others' (with a
    // bit per zone modulo 64, slots 8 apart met).
    let mut all: Vec<usize> = (0..64).map(|slot| zones.home_below(linux, slot).unwrap()).collect();
    all.push(linux);
    all.extend((0..64).map(|t| ((112usize << 40) - t * (512 << 30)) >> 39));
    all.sort_unstable();
    all.dedup();
    for (i, &a) in all.iter().enumerate() {
        assert!(!page_of(a).is_empty());
        assert!(page_of(a).meets(ZoneSet::ALL));
        for &b in &all[i + 1..] {
            assert!(!page_of(a).meets(page_of(b)), "zones {a} and {b} meet");
        }
    }
    // A range across a zone edge is in both zones' sets, and in no third.
    let edge = geo.start_of(linux);
    let across = geo.zone_set(edge - PAGE_SIZE, edge + PAGE_SIZE);
    assert!(across.meets(page_of(linux)) && across.meets(page_of(linux - 1)));
    assert!(!across.meets(page_of(linux - 2)));
    assert_eq!(across, page_of(linux).with(page_of(linux - 1)));
    assert_eq!(geo.zone_set(0, u64::MAX), ZoneSet::ALL);
}
