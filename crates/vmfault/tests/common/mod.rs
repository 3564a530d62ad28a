//! Support shared by the integration tests.
#![allow(dead_code)]

pub mod files;
pub mod host;
pub mod model;
pub mod ops;

use ops::*;
use vmfault::{AddressSpace, FaultPath, Rmap, Vm, VmConfig};

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
    // Every fault path with backing records, and the pv-entry reverse map
    // on the speculative one (its bookkeeping runs on every fault and zap).
    // Last, a machine so small that the page daemon pages out to swap.
    let configs = FAULT_PATHS
        .map(|p| (p, Rmap::Backing, false))
        .into_iter()
        .chain([(FaultPath::Speculative, Rmap::PvEntry, false), (FaultPath::Speculative, Rmap::Backing, true)]);
    for (path, rmap, swap) in configs {
        check_path(ops, &host, &host_maps, path, rmap, swap)
            .map_err(|e| format!("fault_path={} rmap={} swap={swap}: {e}", path.name(), rmap.name()))?;
    }
    Ok(())
}

/// Pages the small machines of [`check_against_host`] paged out, in all.
pub static PAGEOUTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Sequences the small machine cut short when it ran out of page tables
/// or index nodes (which are not reclaimable).
pub static CUT_SHORT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn check_path(
    ops: &[TOp],
    host: &[Outcome],
    host_maps: &[Vec<MapEntry>],
    path: FaultPath,
    rmap: Rmap,
    swap: bool,
) -> Result<(), String> {
    let config =
        VmConfig { phys_bytes: 8 << 20, cpus: 1, prefault: false, fault_path: path, rmap, ..VmConfig::default() };
    // 112 frames: the window's 48 pages in a few processes overflow it.
    let config = match swap {
        true => VmConfig {
            phys_bytes: 112 * ops::P,
            pcpu_pages: 4,
            free_target: 24,
            swap: Some(std::env::temp_dir()),
            ..config
        },
        false => config,
    };
    let vm = Vm::new(config).unwrap();
    let before_space = vm.stats().free_pages;
    let first = vm.new_space().unwrap();
    let initial_free = vm.stats().free_pages;
    vmfault_guards(&first, VM_BASE);
    // Processes: the spaces of `Fork`, `None` once exited.
    let mut spaces = vec![Some(first)];
    let mut cur = 0usize;
    for (i, op) in ops.iter().enumerate() {
        let live = |spaces: &[Option<AddressSpace>], cur: usize| {
            spaces[cur].clone().expect("sequences never run ops in an exited process")
        };
        let got = match op {
            TOp::Fork => match live(&spaces, cur).fork() {
                Ok(child) => {
                    spaces.push(Some(child));
                    Outcome::Ok
                }
                Err(e) => Outcome::Err(e.errno()),
            },
            TOp::Switch(n) => {
                cur = usize::from(*n);
                Outcome::Ok
            }
            TOp::Exit => {
                spaces[cur] = None;
                Outcome::Ok
            }
            op => run_vmfault(&live(&spaces, cur), VM_BASE, op),
        };
        let maps = spaces[cur].as_ref().map_or_else(Vec::new, |s| vmfault_maps(s, VM_BASE));
        let context = || {
            let steps: Vec<String> =
                ops[..=i].iter().enumerate().map(|(k, o)| format!("  {k:3}: {o:?} -> host {:?}", host[k])).collect();
            steps.join("\n")
        };
        // Page tables and object indexes are never reclaimed: the small
        // machine may run out of them where the host does not (an index
        // takes four frames, and they take most of the 112), and `mlock`
        // then fails with EAGAIN as Linux's does when it cannot fault the
        // range in. The rest of the sequence is skipped (the clean-up is
        // still checked).
        let short =
            got == Outcome::Err(libc::ENOMEM) || (got == Outcome::Err(libc::EAGAIN) && matches!(op, TOp::Mlock { .. }));
        if swap && short && host[i] != got {
            CUT_SHORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            break;
        }
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
    // The small machine may lack an index node for a hole even here; the
    // end of the spaces frees everything regardless (checked below).
    let mut unmapped_all = true;
    for space in spaces.iter().flatten() {
        for m in space.mappings() {
            match space.munmap(m.start, m.end - m.start) {
                Err(e) if swap && e.errno() == libc::ENOMEM => unmapped_all = false,
                r => r.unwrap(),
            }
        }
    }
    // A page daemon pass still running holds what it took: let it end.
    let settle = |want: u64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while swap && vm.stats().free_pages != want && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    };
    if spaces.len() == 1 && unmapped_all {
        settle(initial_free);
    }
    let free = vm.stats().free_pages;
    if spaces.len() == 1 && unmapped_all && free != initial_free {
        return Err(format!("{} frames leaked after unmapping everything", initial_free as i64 - free as i64));
    }
    drop(spaces);
    settle(before_space);
    let st = vm.stats();
    PAGEOUTS.fetch_add(st.pageouts, std::sync::atomic::Ordering::Relaxed);
    if st.swap_used_pages != 0 {
        return Err(format!("{} swap slots leaked after dropping every space", st.swap_used_pages));
    }
    if st.free_pages != before_space {
        return Err(format!("{} frames leaked after dropping every space", before_space as i64 - st.free_pages as i64));
    }
    if (st.pv_entries, st.backing_records, st.rmap_bytes) != (0, 0, 0) {
        return Err(format!(
            "reverse map not empty after dropping every space: {} pv entries, {} backing records, {} bytes",
            st.pv_entries, st.backing_records, st.rmap_bytes
        ));
    }
    Ok(())
}
