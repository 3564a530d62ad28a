//! Support shared by the integration tests.
#![allow(dead_code)]

pub mod host;
pub mod model;
pub mod ops;

use ops::*;
use vmfault::{FaultPath, Vm, VmConfig};

/// Every fault path: the suites run in all of them.
pub const FAULT_PATHS: [FaultPath; 3] = [FaultPath::MapLock, FaultPath::Speculative, FaultPath::VmaLock];

/// A small machine for tests, with the given fault path.
pub fn test_vm(phys_bytes: u64, cpus: usize, path: FaultPath) -> Vm {
    Vm::new(VmConfig { phys_bytes, cpus, prefault: false, fault_path: path, ..VmConfig::default() }).unwrap()
}

/// Run `ops` on the host kernel once and on vmfault with every fault path;
/// the first difference in a result or in the window's layout, as a
/// readable message. Also checks that unmapping everything at the end gives
/// every frame back.
pub fn check_against_host(ops: &[TOp]) -> Result<(), String> {
    let (host, host_maps) = host::run_host(ops)?;
    for path in FAULT_PATHS {
        check_path(ops, &host, &host_maps, path).map_err(|e| format!("fault_path={}: {e}", path.name()))?;
    }
    Ok(())
}

fn check_path(ops: &[TOp], host: &[Outcome], host_maps: &[Vec<MapEntry>], path: FaultPath) -> Result<(), String> {
    let vm = test_vm(8 << 20, 1, path);
    let space = vm.new_space().unwrap();
    let initial_free = vm.stats().free_pages;
    vmfault_guards(&space, VM_BASE);
    for (i, op) in ops.iter().enumerate() {
        let got = run_vmfault(&space, VM_BASE, op);
        let maps = vmfault_maps(&space, VM_BASE);
        let context = || {
            let steps: Vec<String> =
                ops[..=i].iter().enumerate().map(|(k, o)| format!("  {k:3}: {o:?} -> host {:?}", host[k])).collect();
            steps.join("\n")
        };
        if got != host[i] {
            return Err(format!("op {i}: vmfault {got:?}, host {:?}\nsequence:\n{}", host[i], context()));
        }
        if maps != host_maps[i] {
            return Err(format!(
                "layout after op {i}:\n vmfault {maps:x?}\n host    {:x?}\nsequence:\n{}",
                host_maps[i],
                context()
            ));
        }
    }
    for m in space.mappings() {
        space.munmap(m.start, m.end - m.start).unwrap();
    }
    let free = vm.stats().free_pages;
    if free != initial_free {
        return Err(format!("{} frames leaked after unmapping everything", initial_free as i64 - free as i64));
    }
    Ok(())
}
