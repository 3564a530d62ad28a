//! Guest atomics (`AddressSpace::compare_exchange_u64` and its siblings):
//! no update lost between vCPUs, faults as a store, copy-on-write broken,
//! Linux's errors for bad addresses.

mod common;

use std::sync::Arc;

use common::{FAULT_PATHS, test_vm};
use vmfault::{Error, MapFlags, Op, Prot, SegvCode};

const P: u64 = 4096;

fn anon() -> MapFlags {
    MapFlags::PRIVATE | MapFlags::ANONYMOUS
}

#[test]
fn vcpus_adding_to_one_counter_and_to_the_other_half_of_its_word_lose_nothing() {
    for path in FAULT_PATHS {
        let vm = test_vm(8 << 20, 4, path);
        let space = Arc::new(vm.new_space().unwrap());
        let a = space.mmap(0, 2 * P, Prot::READ | Prot::WRITE, anon()).unwrap();
        const N: u64 = 20_000;
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let (vm, space) = (vm.clone(), space.clone());
                std::thread::spawn(move || {
                    let _cpu = vm.attach().unwrap();
                    for i in 0..N {
                        match t {
                            // Two vCPUs on one u64, two on the u32s of the next
                            // word (lanes of one word: a CAS of the whole word).
                            0 | 1 => {
                                space.fetch_add_u64(a, 1).unwrap();
                            }
                            2 => {
                                space.fetch_add_u32(a + 8, 3).unwrap();
                            }
                            _ => {
                                // A compare-exchange loop, as a guest spinlock's.
                                let mut cur = space.fetch_add_u32(a + 12, 0).unwrap();
                                while let Err(now) = space.compare_exchange_u32(a + 12, cur, cur + 2).unwrap() {
                                    cur = now;
                                }
                            }
                        }
                        // Plain stores to the rest of the page meanwhile.
                        if i % 64 == 0 {
                            space.write(a + 64 + t * 8, &i.to_ne_bytes()).unwrap();
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let mut w = [0u8; 16];
        space.read(a, &mut w).unwrap();
        assert_eq!(u64::from_ne_bytes(w[..8].try_into().unwrap()), 2 * N, "{path:?}");
        assert_eq!(u32::from_ne_bytes(w[8..12].try_into().unwrap()), 3 * N as u32, "{path:?}");
        assert_eq!(u32::from_ne_bytes(w[12..].try_into().unwrap()), 2 * N as u32, "{path:?}");
    }
}

#[test]
fn results_are_shaped_like_std_atomics() {
    let vm = test_vm(4 << 20, 2, vmfault::FaultPath::Speculative);
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, P, Prot::READ | Prot::WRITE, anon()).unwrap();
    // An untouched page reads as zero (the first atomic zero-fills it).
    assert_eq!(space.swap_u64(a, u64::MAX).unwrap(), 0);
    assert_eq!(space.fetch_add_u64(a, 2).unwrap(), u64::MAX, "wraps");
    assert_eq!(space.compare_exchange_u64(a, 1, 10).unwrap(), Ok(1));
    assert_eq!(space.compare_exchange_u64(a, 1, 11).unwrap(), Err(10));
    assert_eq!(space.swap_u32(a + 8, 0xdead_beef).unwrap(), 0);
    assert_eq!(space.fetch_add_u32(a + 8, 0x2152_4111).unwrap(), 0xdead_beef);
    assert_eq!(space.compare_exchange_u32(a + 8, 5, 1).unwrap(), Err(0), "it wrapped to 0");
    assert_eq!(space.compare_exchange_u32(a + 12, 0, 7).unwrap(), Ok(0));
    let mut b = [0u8; 16];
    space.read(a, &mut b).unwrap();
    assert_eq!(u64::from_ne_bytes(b[..8].try_into().unwrap()), 10);
    assert_eq!(u32::from_ne_bytes(b[8..12].try_into().unwrap()), 0, "0xdeadbeef + 0x21524111 wraps to 0");
    assert_eq!(u32::from_ne_bytes(b[12..].try_into().unwrap()), 7, "the other lane");
    // Lanes do not disturb each other.
    space.write(a + 16, &u64::MAX.to_ne_bytes()).unwrap();
    assert_eq!(space.swap_u32(a + 16, 0).unwrap(), u32::MAX);
    space.read(a + 16, &mut b[..8]).unwrap();
    let expect: u64 = if cfg!(target_endian = "little") { 0xffff_ffff_0000_0000 } else { 0x0000_0000_ffff_ffff };
    assert_eq!(u64::from_ne_bytes(b[..8].try_into().unwrap()), expect);
}

#[test]
fn bad_addresses_fail_as_a_store_would() {
    let vm = test_vm(4 << 20, 2, vmfault::FaultPath::Speculative);
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, 2 * P, Prot::READ, anon()).unwrap();
    // Unaligned: EINVAL, before any access.
    let e = space.fetch_add_u64(a + 4, 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { op: Op::Atomic, value, .. } if value == a + 4), "{e}");
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(matches!(space.swap_u32(a + 2, 1), Err(Error::InvalidArgument { .. })));
    // Read-only: SIGSEGV (ACCERR), even for a compare-exchange that would
    // fail (x86's `lock cmpxchg` always writes).
    assert_eq!(space.compare_exchange_u64(a, 1, 2), Err(Error::Segv { addr: a, code: SegvCode::AccErr }));
    // Unmapped: SIGSEGV (MAPERR).
    space.munmap(a + P, P).unwrap();
    assert_eq!(space.fetch_add_u32(a + P + 4, 1), Err(Error::Segv { addr: a + P + 4, code: SegvCode::MapErr }));
    // Beyond the address space.
    assert!(matches!(space.swap_u64(vmfault::TASK_SIZE, 0), Err(Error::Segv { .. })));
}

#[test]
fn an_atomic_after_fork_breaks_copy_on_write() {
    let vm = test_vm(4 << 20, 2, vmfault::FaultPath::Speculative);
    let parent = vm.new_space().unwrap();
    let a = parent.mmap(0, P, Prot::READ | Prot::WRITE, anon()).unwrap();
    parent.fetch_add_u64(a, 40).unwrap();
    let child = parent.fork().unwrap();
    assert_eq!(child.fetch_add_u64(a, 2).unwrap(), 40);
    assert_eq!(parent.compare_exchange_u64(a, 40, 1).unwrap(), Ok(40), "the parent's page is its own");
    assert_eq!(child.swap_u64(a, 0).unwrap(), 42);
    assert_eq!(parent.swap_u64(a, 0).unwrap(), 1);
}
