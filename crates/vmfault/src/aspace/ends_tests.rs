//! Where the frames of objects that end with retired VMA-index snapshots
//! go with `free_path=deferred` (`Space::finish`): into the changing
//! vCPU's own cache, never through the list without a vCPU, which empties
//! into the global list. Another vCPU held inside a read-side section
//! keeps every grace period from completing, as a busy machine does most
//! of the time.

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
    super::another_vcpu::while_another_vcpu_holds(
        vm,
        |ctx, wait| {
            let _section = ctx.rcu_read();
            wait();
        },
        f,
    )
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

/// Without published snapshots (`fault_path=maplock`, one zone), a change
/// that ends an object on the strength of its own look at the readers must
/// not free the object's frames at once: another change may have unlinked
/// a VMA of the same object after that look, while a reader that entered
/// after it still holds a page of it. Here a fork child's mapping is split
/// in two VMAs over one shadow object whose backing holds the pages; the
/// change that removes the first (freeing the child's own copy of a page)
/// looks (no reader), a reader enters and
/// holds the second one's page, another vCPU removes the second VMA, and
/// only then does the first change drop its VMA, the last reference to the
/// shadow, and with it the backing object's pages: they must wait for the
/// reader (a deferred list), not go to the vCPU's cache.
#[test]
fn an_object_ended_after_anothers_unlink_waits_for_its_readers() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let vm = Vm::new(VmConfig {
        phys_bytes: 16 << 20,
        cpus: 3,
        prefault: false,
        fault_path: FaultPath::MapLock,
        map_lock: crate::config::MapLock::Global,
        free_path: FreePath::Deferred,
        page_daemon: false,
        ..VmConfig::default()
    })
    .unwrap();
    let _cpu = vm.attach().unwrap();
    let rw = Prot::READ | Prot::WRITE;
    let parent = vm.new_space().unwrap();
    let a = parent.mmap(0, 2 * PAGE_SIZE, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    parent.write(a, &[1]).unwrap();
    parent.write(a + PAGE_SIZE, &[2]).unwrap();
    let child = parent.fork().unwrap();
    // The parent's side goes: the backing object is the child's shadow's alone.
    parent.munmap(a, 2 * PAGE_SIZE).unwrap();
    child.mprotect(a + PAGE_SIZE, PAGE_SIZE, Prot::READ).unwrap();
    // A page of the child's own in the first VMA (a copy on write): its
    // removal frees a frame, so the first change looks at the readers.
    child.write(a, &[9]).unwrap();
    let mut b = [0u8; 1];
    child.read(a + PAGE_SIZE, &mut b).unwrap();
    assert_eq!(b, [2], "the child maps the backing object's page read-only");
    let s = &child.s;
    vm.with_ctx(|ctx| {
        // The first change, up to its look: munmap of the first VMA.
        let (start, end) = (a, a + PAGE_SIZE);
        let mut g = super::Gather::default();
        let carved = {
            let mut map = s.map_write(ctx, start, end);
            s.reserve_holes_locked(ctx, &map, crate::error::Op::Munmap, start, end).unwrap();
            let carved = map.carve(start, end);
            s.unmap_locked(ctx, &map, &carved, &mut g, true, None);
            carved
        };
        let unlinked = ctx.env.rcu.cookie();
        let quiet = s.finish(ctx, g);
        assert!(quiet.is_some(), "no reader was inside a section at the look");
        // A reader enters after the look and holds the second VMA's page.
        let held = AtomicBool::new(false);
        let hold = |rctx: &crate::machine::Ctx<'_>, wait: &dyn Fn()| {
            let _section = rctx.rcu_read();
            let hint = crate::pmap::LeafHint::default();
            let pfn = child.s.pmap.lookup(&rctx.env.phys, a + PAGE_SIZE, crate::types::Access::Read, &hint);
            held.store(pfn.is_ok(), Ordering::Relaxed);
            wait();
        };
        super::another_vcpu::while_another_vcpu_holds(&vm, hold, || {
            assert!(held.load(Ordering::Relaxed), "the reader holds the backing page");
            // Another vCPU removes the second VMA (its own look finds the reader).
            std::thread::scope(|scope| {
                scope.spawn(|| {
                    let _cpu = vm.attach().unwrap();
                    child.munmap(a + PAGE_SIZE, PAGE_SIZE).unwrap();
                });
            });
            // (Counted here without `Vm::stats`, which would claim this
            // thread's vCPU again.)
            let phys = &vm.m.phys;
            let counts = || (phys.global_free_frames() + phys.pcp_frames(), phys.deferred_frames());
            let (free, deferred) = counts();
            // The first change drops its VMA: the shadow and its backing end.
            s.drop_removed(ctx, carved, unlinked, quiet);
            let (free_after, deferred_after) = counts();
            assert_eq!(
                free_after, free,
                "the ended objects' frames went free while a reader held one (deferred {deferred} -> {deferred_after})"
            );
            assert!(deferred_after > deferred, "they wait on a deferred list");
        });
    });
}
