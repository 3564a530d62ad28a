//! A debugger's access (`read_remote`/`write_remote` with `force`,
//! Linux's `FOLL_FORCE` through `/proc/PID/mem`), on every fault path:
//! protection ignored for reads and for writes to private mappings, by
//! copy-on-write; never a write to a shared mapping without `PROT_WRITE`;
//! the mapping's protection unchanged for ordinary accesses afterwards.
//! The differential test compares random sequences of them with the host
//! kernel's `/proc/self/mem`; these are the cases spelled out.

mod common;

use common::files::{TempFile, pattern};
use common::{FAULT_PATHS, test_vm};
use vmfault::{Error, MapFlags, Prot, SegvCode};

const P: u64 = 4096;

fn private() -> MapFlags {
    MapFlags::PRIVATE | MapFlags::ANONYMOUS
}

#[test]
fn a_forced_write_breaks_copy_on_write_and_leaves_the_page_read_only() {
    for path in FAULT_PATHS {
        let vm = test_vm(16 << 20, 1, path);
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 2 * P, Prot::READ | Prot::WRITE, private()).unwrap();
        s.write(a, b"parent").unwrap();
        let child = s.fork().unwrap();
        s.mprotect(a, 2 * P, Prot::READ | Prot::EXEC).unwrap();
        // Not by an ordinary store.
        assert!(matches!(s.write(a, b"x"), Err(Error::Segv { code: SegvCode::AccErr, .. })), "{path:?}");
        s.write_remote(a, b"\xcc", true).unwrap();
        // A page untouched so far (the zero page) too.
        s.write_remote(a + P + 10, b"bp", true).unwrap();
        let mut buf = [0u8; 6];
        s.read(a, &mut buf).unwrap();
        assert_eq!(&buf, b"\xccarent", "{path:?}");
        s.fetch(a + P + 10, &mut buf[..2]).unwrap();
        assert_eq!(&buf[..2], b"bp", "{path:?}");
        // The child keeps its copy.
        child.read(a, &mut buf).unwrap();
        assert_eq!(&buf, b"parent", "{path:?}");
        // Still read-only for ordinary stores, and without force a remote
        // write is an ordinary one.
        assert!(matches!(s.write(a, b"y"), Err(Error::Segv { .. })), "{path:?}");
        assert!(matches!(s.write(a + P + 10, b"z"), Err(Error::Segv { .. })), "{path:?}: the zero page's copy");
        assert!(matches!(s.write_remote(a, b"y", false), Err(Error::Segv { .. })), "{path:?}");
    }
}

#[test]
fn prot_none_is_read_and_written_by_force_and_stays_inaccessible() {
    for path in FAULT_PATHS {
        let vm = test_vm(16 << 20, 1, path);
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 2 * P, Prot::READ | Prot::WRITE, private()).unwrap();
        s.write(a, b"kept").unwrap();
        s.mprotect(a, 2 * P, Prot::NONE).unwrap();
        let mut buf = [9u8; 4];
        s.read_remote(a, &mut buf, true).unwrap();
        assert_eq!(&buf, b"kept", "{path:?}");
        s.read_remote(a + P, &mut buf, true).unwrap();
        assert_eq!(buf, [0; 4], "{path:?}: an untouched page reads as zeros");
        // A forced read maps nothing (not the zero page either).
        assert!(matches!(s.read(a + P, &mut buf), Err(Error::Segv { .. })), "{path:?}");
        s.write_remote(a + P, b"new!", true).unwrap();
        // Nothing was mapped: ordinary accesses still fault.
        assert!(matches!(s.read(a, &mut buf), Err(Error::Segv { code: SegvCode::AccErr, .. })), "{path:?}");
        assert!(matches!(s.read(a + P, &mut buf), Err(Error::Segv { .. })), "{path:?}");
        // The page written holds a frame, resident as on Linux.
        assert_eq!(s.mincore(a + P, P).unwrap(), [1], "{path:?}");
        s.mprotect(a, 2 * P, Prot::READ).unwrap();
        s.read(a + P, &mut buf).unwrap();
        assert_eq!(&buf, b"new!", "{path:?}");
    }
}

#[test]
fn a_shared_mapping_without_write_permission_is_not_written_by_force() {
    let file = TempFile::new(&pattern(2 * P as usize, 3));
    for path in FAULT_PATHS {
        let vm = test_vm(16 << 20, 1, path);
        let s = vm.new_space().unwrap();
        let shared = s.mmap(0, P, Prot::READ, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
        let err = s.write_remote(shared, b"x", true).unwrap_err();
        assert!(matches!(err, Error::Segv { addr, code: SegvCode::AccErr } if addr == shared), "{path:?}: {err}");
        assert_eq!(err.errno(), libc::EFAULT);
        // A read of it is fine.
        let mut buf = [1u8; 2];
        s.read_remote(shared, &mut buf, true).unwrap();
        assert_eq!(buf, [0, 0]);
        // A read-only shared file mapping: the file never sees a forced write;
        // a private one takes it as a copy.
        let fs = s.mmap_file(0, P, Prot::READ, MapFlags::SHARED, &file.ro(), 0).unwrap();
        assert!(s.write_remote(fs, b"x", true).is_err(), "{path:?}");
        let fp = s.mmap_file(0, P, Prot::READ, MapFlags::PRIVATE, &file.ro(), 0).unwrap();
        s.write_remote(fp, b"xy", true).unwrap();
        assert_eq!(common::files::rd(&s, fp, 3), [b'x', b'y', pattern(3, 3)[2]], "{path:?}");
        // The page cache (seen through the shared mapping) is untouched.
        assert_eq!(common::files::rd(&s, fs, 2), pattern(2, 3), "{path:?}: the cached file page changed");
        assert_eq!(file.contents(), pattern(2 * P as usize, 3), "{path:?}: the file changed");
    }
}

#[test]
fn a_forced_access_stops_at_a_hole_with_the_bytes_before_it() {
    for path in FAULT_PATHS {
        let vm = test_vm(16 << 20, 1, path);
        let s = vm.new_space().unwrap();
        let a = s.mmap(0, 2 * P, Prot::NONE, private()).unwrap();
        s.munmap(a + P, P).unwrap();
        let mut buf = vec![7u8; 200];
        let err = s.read_remote(a + P - 100, &mut buf, true).unwrap_err();
        assert!(matches!(err, Error::Segv { addr, code: SegvCode::MapErr } if addr == a + P), "{path:?}: {err}");
        assert_eq!(buf[..100], [0; 100], "{path:?}: the bytes before the hole");
        let err = s.write_remote(a + P - 2, b"abcd", true).unwrap_err();
        assert!(matches!(err, Error::Segv { addr, .. } if addr == a + P), "{path:?}: {err}");
        s.read_remote(a + P - 2, &mut buf[..2], true).unwrap();
        assert_eq!(&buf[..2], b"ab", "{path:?}");
    }
}
