//! `free_path=deferred` (`phys::deferred`): frees that no operation waits
//! for. Frames come back (free once their grace period has passed), a
//! vCPU that runs dry still finds them, and a stress of map/check/unmap
//! on every path loses and doubles nothing.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::FAULT_PATHS;
use vmfault::{FaultPath, FreePath, MapFlags, Prot, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

fn deferred_vm(phys_bytes: u64, cpus: usize, path: FaultPath) -> Vm {
    Vm::new(VmConfig {
        phys_bytes,
        cpus,
        prefault: false,
        fault_path: path,
        free_path: FreePath::Deferred,
        ..VmConfig::default()
    })
    .unwrap()
}

/// Map `pages` pages, write each, unmap them: the statistics just before
/// and just after the munmap.
fn touch_and_unmap(vm: &Vm, space: &vmfault::AddressSpace, pages: u64) -> (vmfault::Stats, vmfault::Stats) {
    let a = space.mmap(0, pages * P, RW, PA).unwrap();
    for p in 0..pages {
        space.write(a + p * P, &[1]).unwrap();
    }
    let before = vm.stats();
    space.munmap(a, pages * P).unwrap();
    (before, vm.stats())
}

#[test]
fn munmap_waits_for_no_grace_period_and_the_frames_come_back() {
    for path in FAULT_PATHS {
        let vm = deferred_vm(16 << 20, 2, path);
        let space = vm.new_space().unwrap();
        let _cpu = vm.attach().unwrap();
        let initial = vm.stats().free_pages;
        // Neither the frames nor the VMA-index snapshots that kept the
        // unmapped object alive (the lockless paths': the grace-period
        // thread drops them) make it wait.
        let (before, after) = touch_and_unmap(&vm, &space, 64);
        assert_eq!(
            after.caller_grace_waits - before.caller_grace_waits,
            0,
            "{path:?}: grace periods munmap waited for"
        );
        let s = common::settled_at(&vm, initial);
        assert_eq!((s.deferred_pages, s.free_pages), (0, initial), "{path:?}");
    }
}

/// With `free_path=sync` too, a munmap that no other vCPU's read-side
/// section overlaps (here: the only vCPU) waits for no grace period: the
/// one it polls for completes at once, and its frames are free again when
/// it returns, with no deferred list in between.
#[test]
fn a_lone_vcpus_sync_munmap_polls_its_grace_period_and_frees_at_once() {
    for path in FAULT_PATHS {
        let vm = Vm::new(VmConfig {
            phys_bytes: 16 << 20,
            cpus: 2,
            prefault: false,
            fault_path: path,
            free_path: FreePath::Sync,
            ..VmConfig::default()
        })
        .unwrap();
        let initial = vm.stats().free_pages;
        let space = vm.new_space().unwrap();
        let _cpu = vm.attach().unwrap();
        let (before, after) = touch_and_unmap(&vm, &space, 64);
        assert_eq!(
            after.caller_grace_waits - before.caller_grace_waits,
            0,
            "{path:?}: grace periods munmap waited for"
        );
        assert!(after.tlb_shootdowns > before.tlb_shootdowns, "{path:?}: no shootdown");
        assert_eq!(after.deferred_pages, 0);
        drop(space);
        vm.drain_pcpu_caches();
        assert_eq!(vm.stats().free_pages, initial, "{path:?}");
    }
}

/// Pages of a shared mapping live on after munmap (another space maps
/// them): the operation still has its shootdown (a grace period: polled,
/// or waited for), so no store through the cleared PTE lands after it
/// returns.
#[test]
fn munmap_of_shared_memory_still_waits_for_its_shootdown() {
    // The classic path: no VMA-index snapshot to wait for besides.
    let vm = deferred_vm(16 << 20, 2, FaultPath::MapLock);
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    let a = space.mmap(0, 8 * P, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
    let child = space.fork().unwrap();
    space.write(a, &[1]).unwrap();
    let before = vm.stats().tlb_shootdowns;
    space.munmap(a, 8 * P).unwrap();
    assert!(vm.stats().tlb_shootdowns > before, "munmap of a shared page returned without a shootdown");
    let mut b = [0u8];
    child.read(a, &mut b).unwrap();
    assert_eq!(b, [1]);
}

/// A vCPU whose frames all sit on its own deferred list, with nothing on
/// the global list, still allocates: its cache miss takes its aged
/// batches back, or the allocation waits for a grace period and takes
/// everyone's before it would report ENOMEM.
#[test]
fn a_vcpu_that_runs_dry_gets_its_deferred_frames_back() {
    for path in FAULT_PATHS {
        let vm = deferred_vm(4 << 20, 1, path);
        let space = vm.new_space().unwrap();
        let _cpu = vm.attach().unwrap();
        // Most of memory, mapped, written and unmapped over and over: each
        // round needs the frames the round before freed.
        let pages = vm.stats().free_pages * 3 / 4;
        for round in 0..20u8 {
            let a = space.mmap(0, pages * P, RW, PA).unwrap();
            for p in 0..pages {
                space
                    .write(a + p * P, &[round])
                    .unwrap_or_else(|e| panic!("{path:?}: round {round} page {p}: {e}\n{:#?}", vm.stats()));
            }
            space.munmap(a, pages * P).unwrap();
        }
        assert_eq!(vm.stats().fault_nomem, 0, "{path:?}");
    }
}

/// Every vCPU maps, writes, checks and unmaps regions of its own while
/// the page caches are drained remotely; afterwards the frames are exact.
#[test]
fn deferred_frees_lose_and_double_nothing_under_drains() {
    for path in FAULT_PATHS {
        const THREADS: usize = 4;
        let vm = Vm::new(VmConfig {
            phys_bytes: 32 << 20,
            cpus: THREADS,
            prefault: false,
            fault_path: path,
            free_path: FreePath::Deferred,
            pcpu_drain_hz: 200,
            ..VmConfig::default()
        })
        .unwrap();
        let space = vm.new_space().unwrap();
        let initial = vm.stats().free_pages;
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (vm, space, stop, done) = (vm.clone(), space.clone(), stop.clone(), done.clone());
                std::thread::spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    let mut rounds = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let pages = 8 + rounds % 56;
                        let a = space.mmap(0, pages * P, RW, PA).unwrap();
                        for p in 0..pages {
                            if let Err(e) = space.write(a + p * P + 8 * t as u64, &[t as u8, rounds as u8, p as u8]) {
                                panic!("{path:?}: vCPU {t} page {p}: {e}\n{:#?}", vm.stats());
                            }
                        }
                        for p in 0..pages {
                            let mut got = [0u8; 3];
                            space.read(a + p * P + 8 * t as u64, &mut got).unwrap();
                            assert_eq!(got, [t as u8, rounds as u8, p as u8], "{path:?}: vCPU {t} page {p}");
                            let mut zero = [1u8; 8];
                            space.read(a + p * P + 2048, &mut zero).unwrap();
                            assert_eq!(zero, [0; 8], "{path:?}: a reused frame was not zeroed");
                        }
                        space.munmap(a, pages * P).unwrap();
                        rounds += 1;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    rounds
                })
            })
            .collect();
        std::thread::sleep(Duration::from_secs(2));
        // However slow the machine: enough rounds to have raced the drains.
        while done.load(Ordering::Relaxed) <= 100 && !workers.iter().any(|w| w.is_finished()) {
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
        let rounds: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
        let s = common::settled_at(&vm, initial);
        assert!(rounds > 100, "{path:?}: {rounds} rounds");
        assert_eq!(s.free_pages, initial, "{path:?}: frames lost or doubled");
    }
}

/// The objects of removed mappings stay alive in retired VMA-index
/// snapshots until the grace-period thread drops them, holding their
/// index nodes: an allocation that finds nothing waits for those drops
/// rather than failing. Each round maps a sparse object whose index and
/// page tables take most of memory, then unmaps it.
#[test]
fn allocations_wait_for_the_objects_removed_mappings_left_behind() {
    const TOUCHES: u64 = 300;
    const STRIDE: u64 = 512 * P; // one index leaf and one page table each
    for path in FAULT_PATHS {
        let vm = deferred_vm(4 << 20, 2, path);
        let space = vm.new_space().unwrap();
        let _cpu = vm.attach().unwrap();
        for round in 0..12 {
            let a = space.mmap(0, TOUCHES * STRIDE, RW, PA | MapFlags::NORESERVE).unwrap();
            for i in 0..TOUCHES {
                space.write(a + i * STRIDE, &[1]).unwrap_or_else(|e| panic!("{path:?} round {round} page {i}: {e}"));
            }
            space.munmap(a, TOUCHES * STRIDE).unwrap();
        }
        let s = common::settled(&vm);
        assert_eq!((s.deferred_pages, s.deferred_drops), (0, 0), "{path:?}");
    }
}
