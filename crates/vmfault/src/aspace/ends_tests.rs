//! Where the frames of objects that end with retired VMA-index snapshots
//! go with `free_path=deferred` (`Space::finish`): into the changing
//! vCPU's own cache, never through the list without a vCPU, which empties
//! into the global list. Another vCPU held inside a read-side section
//! keeps every grace period from completing, as a busy machine does most
//! of the time.

use std::sync::mpsc;

use crate::config::{FaultPath, FreePath, VmConfig};
use crate::machine::Vm;
use crate::types::{MapFlags, PAGE_SIZE, Prot};

const PAGES: u64 = 16;

fn vm(path: FaultPath) -> Vm {
    Vm::new(VmConfig {
        phys_bytes: 16 << 20,
        cpus: 2,
        prefault: false,
        fault_path: path,
        free_path: FreePath::Deferred,
        ..VmConfig::default()
    })
    .unwrap()
}

/// Run `f` while another vCPU sits inside a read-side section.
fn with_a_reader_inside<R>(vm: &Vm, f: impl FnOnce() -> R) -> R {
    let (inside_tx, inside_rx) = mpsc::channel();
    let (leave_tx, leave_rx) = mpsc::channel::<()>();
    let other = vm.clone();
    let t = std::thread::spawn(move || {
        let _cpu = other.attach().unwrap();
        other.with_ctx(|ctx| {
            let _section = ctx.rcu_read();
            inside_tx.send(()).unwrap();
            let _ = leave_rx.recv();
        });
    });
    inside_rx.recv().unwrap();
    let r = f();
    drop(leave_tx);
    t.join().unwrap();
    r
}

/// A mapping written page by page, then unmapped: its object ends.
fn map_write_unmap(space: &crate::AddressSpace) {
    let rw = Prot::READ | Prot::WRITE;
    let a = space.mmap(0, PAGES * PAGE_SIZE, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    for p in 0..PAGES {
        space.write(a + p * PAGE_SIZE, &[1]).unwrap();
    }
    space.munmap(a, PAGES * PAGE_SIZE).unwrap();
}

#[test]
fn an_aged_drop_counts_as_under_way_until_its_frames_are_placed() {
    let vm = vm(FaultPath::Speculative);
    let _cpu = vm.attach().unwrap();
    let d = vm.m.phys.deferred.as_ref().unwrap();
    let seen = vm.with_ctx(|ctx| {
        let mut seen = 0;
        super::aged(ctx, || seen = d.dropping());
        seen
    });
    assert_eq!((seen, d.dropping()), (1, 0), "the frames of the drop are counted nowhere meanwhile");
}

#[test]
fn objects_that_retired_snapshots_kept_alive_free_into_the_vcpus_cache() {
    // The speculative path: a retired snapshot keeps the object alive,
    // queued for its grace period on this vCPU's list; the next change
    // after it has aged drops it, and the object's frames go to this
    // vCPU's cache.
    let vm = vm(FaultPath::Speculative);
    let space = vm.new_space().unwrap();
    let _cpu = vm.attach().unwrap();
    let d = vm.m.phys.deferred.as_ref().unwrap();
    map_write_unmap(&space);
    let before = vm.stats();
    with_a_reader_inside(&vm, || map_write_unmap(&space));
    assert!(d.late() > 0, "no snapshot was queued to drop: the test tests nothing");
    // The next change drops what has aged.
    map_write_unmap(&space);
    let after = vm.stats();
    assert_eq!(
        after.global_frames_moved - before.global_frames_moved,
        0,
        "frames crossed the global list: {before:?}\n{after:?}"
    );
}

/// The last change to a space ends an object while another vCPU is inside
/// a read-side section, with another vCPU's retired snapshot pending:
/// nothing changes the space again, and the object still ends (its index
/// node and record freed) once the section is over. (The other vCPU's
/// mapping is placed away from the unmapped one: next to it, the two merge
/// and the page left keeps the object, as Linux's keeps its anon_vma.)
#[test]
fn an_object_unmapped_while_a_reader_waits_ends_without_another_change() {
    let vm = vm(FaultPath::Speculative);
    let space = vm.new_space().unwrap();
    let (vm2, space2) = (vm.clone(), space.clone());
    std::thread::spawn(move || {
        let _cpu = vm2.attach().unwrap();
        let rw = Prot::READ | Prot::WRITE;
        space2.mmap(1 << 30, PAGE_SIZE, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    })
    .join()
    .unwrap();
    vm.m.rcu.synchronize();
    let _cpu = vm.attach().unwrap();
    with_a_reader_inside(&vm, || map_write_unmap(&space));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let s = vm.stats();
        if s.index_pages == 0 && s.backing_records == 0 && s.data_pages == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the unmapped object is still alive after 10 s: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
