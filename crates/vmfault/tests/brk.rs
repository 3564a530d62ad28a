//! `brk`: the heap across `fork`, its start, and concurrent calls. Its
//! semantics against the host kernel are in the differential test
//! (`TOp::Brk`), and against the reference model in `model.rs`.

mod common;

use vmfault::{Error, HEAP_START, PAGE_SIZE as P, Prot, Vm, VmConfig};

fn vm() -> Vm {
    Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 4, prefault: false, ..VmConfig::default() }).unwrap()
}

#[test]
fn a_new_space_has_an_empty_heap_at_heap_start() {
    let space = vm().new_space().unwrap();
    assert_eq!(space.heap(), (HEAP_START, HEAP_START));
    assert_eq!(space.brk(0), HEAP_START);
    assert!(space.mappings().is_empty());
}

#[test]
fn the_heap_is_private_read_write_memory_that_reads_as_zeros() {
    let space = vm().new_space().unwrap();
    let top = HEAP_START + 3 * P + 5;
    assert_eq!(space.brk(top), top);
    let maps = space.mappings();
    assert_eq!(maps.len(), 1);
    assert_eq!((maps[0].start, maps[0].end), (HEAP_START, HEAP_START + 4 * P), "rounded up to a page");
    assert_eq!(maps[0].prot, Prot::READ | Prot::WRITE);
    assert!(!maps[0].shared);
    let mut b = [1u8; 16];
    space.read(HEAP_START + 4 * P - 16, &mut b).unwrap();
    assert_eq!(b, [0; 16]);
}

#[test]
fn a_fork_copies_the_heap_and_each_side_moves_its_own() {
    let vm = vm();
    let parent = vm.new_space().unwrap();
    assert_eq!(parent.brk(HEAP_START + 4 * P), HEAP_START + 4 * P);
    parent.write(HEAP_START + P, b"parent").unwrap();
    let child = parent.fork().unwrap();
    assert_eq!(child.heap(), (HEAP_START, HEAP_START + 4 * P));
    let mut b = [0u8; 6];
    child.read(HEAP_START + P, &mut b).unwrap();
    assert_eq!(&b, b"parent");
    assert_eq!(child.brk(HEAP_START + P), HEAP_START + P, "the child shrinks its heap");
    assert!(child.read(HEAP_START + P, &mut b).is_err());
    assert_eq!(parent.heap().1, HEAP_START + 4 * P, "the parent's heap is its own");
    parent.read(HEAP_START + P, &mut b).unwrap();
    assert_eq!(&b, b"parent");
}

#[test]
fn the_heap_start_is_checked_and_moves_the_break_with_it() {
    let space = vm().new_space().unwrap();
    for bad in [HEAP_START + 1, 0x1000, vmfault::TASK_SIZE + P] {
        let e = space.set_heap_start(bad).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{bad:#x}: {e}");
        assert!(matches!(e, Error::InvalidArgument { .. }));
    }
    let start = 0x4000_0000;
    space.set_heap_start(start).unwrap();
    assert_eq!(space.heap(), (start, start));
    assert_eq!(space.brk(start + P), start + P);
    assert_eq!(space.brk(start - P), start + P, "below the new start: refused");
}

/// vCPUs that move the break at once: each call sees the one before it,
/// and the heap's mapping ends where the last break says.
#[test]
fn concurrent_calls_serialize() {
    let vm = vm();
    let space = vm.new_space().unwrap();
    std::thread::scope(|s| {
        for t in 0..3u64 {
            let (vm, space) = (&vm, &space);
            s.spawn(move || {
                let _cpu = vm.attach().unwrap();
                for i in 0..200 {
                    let (start, brk) = space.heap();
                    // Up by a page, or down to a page above the start.
                    let want = if (i + t) % 3 == 2 { start + P } else { brk + P };
                    let got = space.brk(want);
                    assert!(got >= start);
                    space.write(got - 1, &[t as u8]).ok();
                }
            });
        }
    });
    let (start, brk) = space.heap();
    let maps = space.mappings();
    assert_eq!(maps.len(), 1, "{maps:?}");
    assert_eq!((maps[0].start, maps[0].end), (start, brk.div_ceil(P) * P));
    drop(space);
    let s = common::settled(&vm);
    assert_eq!(s.free_pages, s.total_pages - 1, "every frame back (the zero page aside)");
}
