//! Support shared by the integration tests.
#![allow(dead_code)]

pub mod files;
pub mod model;

use vmfault::{FaultPath, Vm, VmConfig};
#[allow(unused_imports)] // each test file uses some of them
pub use vmfault_check::{CUT_SHORT, PAGEOUTS, check_against_host, ops};

pub use vmfault_check::FAULT_PATHS;

/// The machine's statistics once every deferred free has completed: with
/// `free_path=deferred` (the default) frames that an operation freed while
/// another vCPU was inside a read-side section wait on a deferred list for
/// their grace period, and snapshots that keep removed objects alive wait
/// to be dropped; a drain runs a grace period and takes them all, so
/// `free_pages` then counts every frame not in use. Call it once no vCPU
/// runs. It always drains at least once: a drain under way on another
/// thread (the `pcpu_drain_hz` thread's, the page daemon's) holds the
/// frames it took out of the caches in its hands until they are on the
/// global list, and ours waits for it; after ours the caches stay empty,
/// so later drains move nothing. Gives up after 10 s (the caller's
/// assertion then shows what is left).
pub fn settled(vm: &Vm) -> vmfault::Stats {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut last = None;
    loop {
        vm.drain_pcpu_caches();
        let s = vm.stats();
        // Two reads in a row that agree: a drain by another thread (the
        // `pcpu_drain_hz` thread, the page daemon) preempted while it held
        // frames would show them as missing in one read only.
        let steady = last == Some(s.free_pages);
        last = Some(s.free_pages);
        if (steady && s.deferred_pages == 0 && s.deferred_drops == 0) || std::time::Instant::now() > deadline {
            return s;
        }
    }
}

/// [`settled`], then again until `free_pages` is `want` or 10 s have
/// passed: a frame in the hands of a thread preempted between two steps
/// (a drain, the grace-period thread) is missing from a read or two and
/// then back; a frame lost stays missing, and the caller's assertion
/// fails on it.
/// A retry is reported on stderr (the frame's holder is not known yet:
/// the test logs say how often and how long).
pub fn settled_at(vm: &Vm, want: u64) -> vmfault::Stats {
    let start = std::time::Instant::now();
    let mut first = None;
    loop {
        let s = settled(vm);
        let seen = *first.get_or_insert(s.free_pages);
        if s.free_pages == want || start.elapsed() > std::time::Duration::from_secs(10) {
            if seen != want {
                eprintln!(
                    "settled_at: {seen} free frames at first, {} after {:?} (want {want})",
                    s.free_pages,
                    start.elapsed()
                );
            }
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A small machine for tests, with the given fault path.
pub fn test_vm(phys_bytes: u64, cpus: usize, path: FaultPath) -> Vm {
    Vm::new(VmConfig { phys_bytes, cpus, prefault: false, fault_path: path, ..VmConfig::default() }).unwrap()
}
