//! Support shared by the integration tests.
#![allow(dead_code)]

pub mod files;
pub mod model;

use vmfault::{FaultPath, Vm, VmConfig};
#[allow(unused_imports)] // each test file uses some of them
pub use vmfault_check::{CUT_SHORT, PAGEOUTS, check_against_host, ops};

pub use vmfault_check::FAULT_PATHS;

/// A small machine for tests, with the given fault path.
pub fn test_vm(phys_bytes: u64, cpus: usize, path: FaultPath) -> Vm {
    Vm::new(VmConfig { phys_bytes, cpus, prefault: false, fault_path: path, ..VmConfig::default() }).unwrap()
}
