//! `AddressSpace::hold`: a page wired through its mapping stays allocated
//! while held, whatever happens to the mapping, and is freed with the last
//! hold; writes through a write hold land in the space's own page.

mod common;

use common::{FAULT_PATHS, test_vm};
use vmfault::{Access, Advice, Error, MapFlags, Prot, SegvCode};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);
const PA: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

#[test]
fn a_held_page_outlives_its_mapping_and_is_freed_with_the_hold() {
    for path in FAULT_PATHS {
        let vm = test_vm(8 << 20, 2, path);
        let start = vm.stats().free_pages;
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 4 * P, RW, PA).unwrap();
        s.write(a + P, b"before").unwrap();
        let h1 = s.hold(a + P + 100, Access::Write).unwrap();
        let h2 = s.hold(a + P, Access::Read).unwrap();
        h1.write(6, b", held");
        let mut buf = [0u8; 12];
        s.read(a + P, &mut buf).unwrap();
        assert_eq!(&buf, b"before, held", "{path:?}: the hold writes the mapped page");
        // DONTNEED and munmap take the page out of its object: it stays allocated.
        s.madvise(a, 4 * P, Advice::DontNeed).unwrap();
        s.read(a + P, &mut buf).unwrap();
        assert_eq!(buf, [0; 12], "{path:?}: the mapping reads zeros again");
        s.munmap(a, 4 * P).unwrap();
        h2.read(0, &mut buf);
        assert_eq!(&buf, b"before, held", "{path:?}: the held frame kept its data");
        drop(s);
        let held = vm.stats();
        assert_eq!(held.data_pages, 1, "{path:?}: only the held page is left");
        drop(h1);
        assert_eq!(vm.stats().data_pages, 1, "{path:?}: one hold is left");
        drop(h2);
        let end = vm.stats();
        assert_eq!((end.data_pages, end.free_pages), (0, start), "{path:?}: the last hold freed it");
    }
}

#[test]
fn holds_fault_like_accesses() {
    for path in FAULT_PATHS {
        let vm = test_vm(8 << 20, 2, path);
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 2 * P, Prot::READ, PA).unwrap();
        assert_eq!(s.hold(a, Access::Write).unwrap_err(), Error::Segv { addr: a, code: SegvCode::AccErr });
        assert_eq!(
            s.hold(a + 2 * P, Access::Read).unwrap_err(),
            Error::Segv { addr: a + 2 * P, code: SegvCode::MapErr }
        );
        // A read hold of untouched private memory is the zero page, unwired.
        let z = s.hold(a, Access::Read).unwrap();
        let mut b = [1u8; 4];
        z.read(0, &mut b);
        assert_eq!(b, [0; 4]);
        drop(z);
        // A write hold breaks copy-on-write, as a store does.
        let w = s.mmap(0, P, RW, PA).unwrap();
        s.write(w, b"parent").unwrap();
        let child = s.fork().unwrap();
        let h = child.hold(w, Access::Write).unwrap();
        h.write(0, b"child!");
        let mut buf = [0u8; 6];
        s.read(w, &mut buf).unwrap();
        assert_eq!(&buf, b"parent", "{path:?}");
        child.read(w, &mut buf).unwrap();
        assert_eq!(&buf, b"child!", "{path:?}");
        assert_eq!(vm.stats().cow_faults, 1, "{path:?}");
    }
}

#[test]
fn holds_racing_munmap_never_lose_a_frame() {
    for path in FAULT_PATHS {
        let vm = test_vm(16 << 20, 3, path);
        let start = vm.stats().free_pages;
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 64 * P, RW, PA).unwrap();
        std::thread::scope(|t| {
            let holder = t.spawn(|| {
                let _cpu = vm.attach().unwrap();
                let mut n = 0;
                for i in 0..20_000u64 {
                    let addr = a + (i % 64) * P;
                    if let Ok(h) = s.hold(addr, Access::Write) {
                        h.write(0, &i.to_ne_bytes());
                        let mut b = [0u8; 8];
                        h.read(0, &mut b);
                        assert_eq!(u64::from_ne_bytes(b), i, "{path:?}: a held page changed under the hold");
                        n += 1;
                    }
                }
                n
            });
            let _cpu = vm.attach().unwrap();
            for i in 0..3000u64 {
                let at = a + (i % 8) * 8 * P;
                s.munmap(at, 8 * P).unwrap();
                s.mmap(at, 8 * P, RW, PA | MapFlags::FIXED).unwrap();
            }
            assert!(holder.join().unwrap() > 0);
        });
        drop(s);
        assert_eq!(common::settled_at(&vm, start).free_pages, start, "{path:?}: frames leaked or freed twice");
    }
}

/// Stores through a write hold of a shared file page reach the file, even
/// those made after a write-back (which write-protected the mappings, but
/// a hold stores without faulting) or after the mapping went: a write hold
/// dirties its page when it is dropped, as Linux's
/// `unpin_user_pages_dirty_lock` does.
#[test]
fn stores_through_a_write_hold_reach_the_file() {
    use common::files::{PU, SH, TempFile};
    for path in FAULT_PATHS {
        let f = TempFile::new(&vec![0u8; 2 * PU]);
        let vm = test_vm(8 << 20, 2, path);
        let s = vm.new_space().unwrap();
        let a = s.mmap_file(0, 2 * P, RW, SH, &f.rw(), 0).unwrap();
        let h = s.hold(a + P, Access::Write).unwrap();
        h.write(0, b"first");
        s.msync(a, 2 * P).unwrap();
        assert_eq!(&f.contents()[PU..PU + 5], b"first", "{path:?}: msync wrote the held page");
        h.write(5, b", second");
        drop(h);
        s.msync(a, 2 * P).unwrap();
        assert_eq!(&f.contents()[PU..PU + 13], b"first, second", "{path:?}: a store after the write-back");
        // Held past its mapping: the file's page cache writes it back at its end.
        let h = s.hold(a, Access::Write).unwrap();
        s.munmap(a, 2 * P).unwrap();
        h.write(0, b"third");
        drop(h);
        drop(s);
        drop(vm);
        assert_eq!(&f.contents()[..5], b"third", "{path:?}: a store after munmap");
    }
}
