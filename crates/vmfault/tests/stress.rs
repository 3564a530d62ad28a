//! Multi-threaded stress: several vCPUs in one address space.
//!
//! Each thread runs random operation sequences in a window of its own and
//! checks every result exactly against its own reference model: whatever
//! the other threads do to their windows (mmap, munmap, mprotect, faults),
//! it must not show in this one. All threads also load, store and drop
//! pages of one shared mapping at the same time, to race faults on the same
//! PTEs and object slots; each thread checks the bytes it owns there. At
//! the end every mapping goes and `free_pages` must be back to its initial
//! value, exactly.

mod common;

use std::sync::{Arc, Barrier};

use common::model::Model;
use common::ops::*;
use common::{FAULT_PATHS, test_vm};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use vmfault::{Access, Advice, FaultPath, MapFlags, Prot};

const THREADS: usize = 4;
const SEQUENCES: usize = 30;
/// Shared region: each thread owns `OWN` pages of it and pokes at all of it.
const OWN: u64 = 8;
const SHARED_BASE: u64 = 0x6000_0000_0000;

fn window_base(t: usize) -> u64 {
    VM_BASE + t as u64 * (W + 4 * GUARD)
}

#[test]
fn vcpus_in_one_space_stay_exact_and_leak_nothing() {
    for path in FAULT_PATHS {
        stress(path);
    }
}

fn stress(path: FaultPath) {
    let vm = test_vm(64 << 20, THREADS, path);
    let space = vm.new_space().unwrap();
    let initial_free = vm.stats().free_pages;
    let shared_len = OWN * P * THREADS as u64;
    let fl = MapFlags::SHARED | MapFlags::ANONYMOUS | MapFlags::FIXED;
    space.mmap(SHARED_BASE, shared_len, Prot::READ | Prot::WRITE, fl).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));

    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (vm, space, barrier) = (vm.clone(), space.clone(), barrier.clone());
            std::thread::spawn(move || {
                let _cpu = vm.attach().unwrap();
                let base = window_base(t);
                vmfault_guards(&space, base);
                let seed = [t as u8 + 1; 32];
                let mut runner =
                    TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
                let mine = SHARED_BASE + t as u64 * OWN * P;
                let mut stamp = 0u8;
                barrier.wait();
                for s in 0..SEQUENCES {
                    let ops = sequence(60..=60).new_tree(&mut runner).unwrap().current();
                    // The heap is the space's, one for every thread: `brk`
                    // is tested where one process runs a sequence.
                    let ops: Vec<TOp> = ops.into_iter().filter(|op| !matches!(op, TOp::Brk { .. })).collect();
                    let mut model = Model::default();
                    for (i, op) in ops.iter().enumerate() {
                        model.apply(op);
                        let got = run_vmfault(&space, base, op, None);
                        assert_eq!(Some(&got), model.last.as_ref(), "thread {t} sequence {s} op {i}: {op:?}");
                        // Race on the shared region: store into our pages,
                        // load and fault in everybody's.
                        stamp = stamp.wrapping_add(1);
                        let page = (i as u64 * 7 + t as u64) % OWN;
                        space.write(mine + page * P + 64, &[stamp; 32]).unwrap();
                        let other = SHARED_BASE + ((i as u64 * 13) % (OWN * THREADS as u64)) * P;
                        space.touch(other, if i % 2 == 0 { Access::Read } else { Access::Write }).unwrap();
                        let mut back = [0u8; 32];
                        space.read(mine + page * P + 64, &mut back).unwrap();
                        assert_eq!(back, [stamp; 32], "thread {t}: own bytes in the shared region changed");
                        if i % 17 == 0 {
                            // Shared memory keeps its contents across DONTNEED.
                            space.madvise(mine, OWN * P, Advice::DontNeed).unwrap();
                            space.read(mine + page * P + 64, &mut back).unwrap();
                            assert_eq!(back, [stamp; 32]);
                        }
                    }
                    // Clean the window for the next sequence.
                    space.munmap(base, W).unwrap();
                }
                space.munmap(base - GUARD, W + 2 * GUARD).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = vm.stats();
    assert!(s.faults > 0 && s.zero_fill > 0);
    match path {
        FaultPath::Speculative => assert!(s.spf > 0, "no speculative fault completed: {s:?}"),
        FaultPath::VmaLock => assert!(s.vma_lock > 0, "no per-VMA-lock fault completed: {s:?}"),
        FaultPath::MapLock => assert_eq!(s.spf + s.vma_lock, 0),
    }
    space.munmap(SHARED_BASE, shared_len).unwrap();
    assert!(space.mappings().is_empty());
    assert_eq!(space.page_table_pages(), 1, "page tables left behind");
    assert_eq!(
        common::settled_at(&vm, initial_free).free_pages,
        initial_free,
        "fault_path={}: frames leaked",
        path.name()
    );
}
