//! rust-vmm's `vm_memory::Bytes<GuestAddress>` on an `AddressSpace` (cargo
//! feature `vm-memory`): objects, partial accesses at a mapping's end,
//! atomic loads and stores, faults as `InvalidGuestAddress`, copy-on-write
//! after fork, and the `Read`/`Write` helpers.
#![cfg(feature = "vm-memory")]

use std::sync::atomic::Ordering;

use vm_memory::{Bytes, GuestAddress, GuestMemoryError};
use vmfault::{AddressSpace, MapFlags, PAGE_SIZE as P, Prot, Vm, VmConfig};

const RW: Prot = Prot::READ.union(Prot::WRITE);
const ANON: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

fn space() -> (Vm, AddressSpace) {
    let vm = Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 2, prefault: false, ..VmConfig::default() }).unwrap();
    let space = vm.new_space().unwrap();
    (vm, space)
}

/// Generic over `Bytes`, as a rust-vmm device takes its memory.
fn device_writes_a_descriptor<M: Bytes<GuestAddress, E = GuestMemoryError>>(mem: &M, at: GuestAddress) {
    mem.write_obj(0xdead_beef_u32, at).unwrap();
    mem.write_obj(0x0102_0304_0506_0708_u64, GuestAddress(at.0 + 8)).unwrap();
}

#[test]
fn objects_go_through_the_guest_page_table() {
    let (vm, space) = space();
    let a = space.mmap(0, 2 * P, RW, ANON).unwrap();
    device_writes_a_descriptor(&space, GuestAddress(a + P - 4));
    assert_eq!(space.read_obj::<u32>(GuestAddress(a + P - 4)).unwrap(), 0xdead_beef);
    let mut b = [0u8; 8];
    space.read(a + P + 4, &mut b).unwrap();
    assert_eq!(u64::from_ne_bytes(b), 0x0102_0304_0506_0708, "the vmfault API sees the device's stores");
    assert_eq!(vm.stats().faults, 2, "one fault per page");
}

#[test]
fn an_access_past_the_mapping_moves_what_it_can() {
    let (_vm, space) = space();
    let a = space.mmap(0, P, RW, ANON).unwrap();
    let end = a + P;
    assert_eq!(Bytes::write(&space, &[7u8; 16], GuestAddress(end - 10)).unwrap(), 10);
    let mut buf = [0u8; 16];
    assert_eq!(Bytes::read(&space, &mut buf, GuestAddress(end - 10)).unwrap(), 10);
    assert_eq!(&buf[..10], &[7u8; 10]);
    match space.write_slice(&[1u8; 16], GuestAddress(end - 10)) {
        Err(GuestMemoryError::PartialBuffer { expected: 16, completed: 10 }) => {}
        r => panic!("{r:?}"),
    }
    match Bytes::read(&space, &mut buf, GuestAddress(end)) {
        Err(GuestMemoryError::InvalidGuestAddress(GuestAddress(at))) => assert_eq!(at, end),
        r => panic!("{r:?}"),
    }
    // Read-only memory refuses a store where it begins.
    space.mprotect(a, P, Prot::READ).unwrap();
    assert!(matches!(space.write_obj(1u8, GuestAddress(a)), Err(GuestMemoryError::InvalidGuestAddress(_))));
}

#[test]
fn atomic_loads_and_stores_need_natural_alignment() {
    let (_vm, space) = space();
    let a = space.mmap(0, P, RW, ANON).unwrap();
    space.store(0xabu8, GuestAddress(a + 1), Ordering::SeqCst).unwrap();
    space.store(0x1234u16, GuestAddress(a + 2), Ordering::Release).unwrap();
    space.store(0x5566_7788u32, GuestAddress(a + 4), Ordering::Relaxed).unwrap();
    space.store(u64::MAX - 1, GuestAddress(a + 8), Ordering::SeqCst).unwrap();
    assert_eq!(space.load::<u8>(GuestAddress(a + 1), Ordering::Acquire).unwrap(), 0xab);
    assert_eq!(space.load::<u16>(GuestAddress(a + 2), Ordering::Acquire).unwrap(), 0x1234);
    assert_eq!(space.load::<u32>(GuestAddress(a + 4), Ordering::Relaxed).unwrap(), 0x5566_7788);
    assert_eq!(space.load::<u64>(GuestAddress(a + 8), Ordering::SeqCst).unwrap(), u64::MAX - 1);
    for bad in [a + 3, a + 6] {
        assert!(matches!(
            space.store(1u32, GuestAddress(bad), Ordering::SeqCst),
            Err(GuestMemoryError::InvalidBackendAddress)
        ));
        assert!(matches!(
            space.load::<u64>(GuestAddress(bad), Ordering::SeqCst),
            Err(GuestMemoryError::InvalidBackendAddress)
        ));
    }
    // Two threads storing whole words and bytes beside them lose nothing.
    let threads: Vec<_> = (0..2u64)
        .map(|t| {
            let space = space.clone();
            std::thread::spawn(move || {
                let _cpu = space.vm().attach().unwrap();
                for i in 0..2000u32 {
                    space.store(i as u8, GuestAddress(a + 64 + t * 4), Ordering::SeqCst).unwrap();
                    space.store(i, GuestAddress(a + 128 + t * 8), Ordering::SeqCst).unwrap();
                }
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    for t in 0..2u64 {
        assert_eq!(space.load::<u8>(GuestAddress(a + 64 + t * 4), Ordering::SeqCst).unwrap(), (1999 % 256) as u8);
        assert_eq!(space.load::<u32>(GuestAddress(a + 128 + t * 8), Ordering::SeqCst).unwrap(), 1999);
    }
}

#[test]
fn a_forked_child_writes_its_own_copy() {
    let (_vm, parent) = space();
    let a = parent.mmap(0, P, RW, ANON).unwrap();
    parent.write_obj(1u64, GuestAddress(a)).unwrap();
    let child = parent.fork().unwrap();
    child.write_obj(2u64, GuestAddress(a)).unwrap();
    assert_eq!(parent.read_obj::<u64>(GuestAddress(a)).unwrap(), 1);
    assert_eq!(child.read_obj::<u64>(GuestAddress(a)).unwrap(), 2);
}

#[test]
#[allow(deprecated)] // the `Read`/`Write` helpers are deprecated in vm-memory, still required
fn read_and_write_helpers_move_bytes_to_and_from_streams() {
    let (_vm, space) = space();
    let a = space.mmap(0, P, RW, ANON).unwrap();
    let mut src = std::io::Cursor::new(b"from a stream".to_vec());
    assert_eq!(space.read_from(GuestAddress(a), &mut src, 13).unwrap(), 13);
    let mut out = Vec::new();
    space.write_all_to(GuestAddress(a), &mut out, 13).unwrap();
    assert_eq!(out, b"from a stream");
    let mut short = std::io::Cursor::new(b"abc".to_vec());
    assert!(space.read_exact_from(GuestAddress(a), &mut short, 4).is_err());
    let mut sink = Vec::new();
    assert_eq!(space.write_to(GuestAddress(a + P - 4), &mut sink, 8).unwrap(), 4, "stops at the mapping's end");
}
