//! File mappings and the reverse map: what a mapping reads, when shared
//! stores reach the file, the end of the file (SIGBUS) and the errors of
//! `mmap` and `msync` compared with the host kernel, `fork`,
//! `unmap_everywhere` and the metadata of both reverse maps; in every fault
//! path and both reverse maps, with every frame back at the end.

mod common;

use std::fs::{File, OpenOptions};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use common::FAULT_PATHS;
use common::files::*;
use vmfault::{Access, AddressSpace, Advice, Error, MapFlags, Prot, Rmap, SegvCode};

#[test]
fn mappings_read_the_files_bytes() {
    let len = 5 * PU + 100;
    let data = pattern(len, 1);
    let tail = vec![0u8; 6 * PU - len];
    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let s = vm.new_space().unwrap();
        let file = f.ro();
        let pr = s.mmap_file(0, len as u64, RW, PRIV, &file, 0).unwrap();
        let sh = s.mmap_file(0, len as u64, Prot::READ, SH, &file, 0).unwrap();
        drop(file); // the objects keep their own handle
        for (base, kind) in [(pr, "private"), (sh, "shared")] {
            assert_eq!(rd(&s, base, len), data, "{what}: {kind}");
            assert_eq!(rd(&s, base + len as u64, tail.len()), tail, "{what}: {kind}: past the end in the last page");
        }
        let lens: Vec<u64> = s.mappings().iter().map(|m| m.end - m.start).collect();
        assert_eq!(lens, [6 * P, 6 * P], "{what}: lengths round up to pages");
        assert_eq!(vm.stats().file_fills, 6, "{what}: both mappings share one page cache");
        // At an offset, with lengths that are not multiples of a page.
        let file = f.rw();
        let off = s.mmap_file(0, 2 * P + 10, Prot::READ, SH, &file, 2 * P).unwrap();
        assert_eq!(rd(&s, off, 3 * PU), data[2 * PU..5 * PU], "{what}: shared at an offset");
        let poff = s.mmap_file(0, P + 1, RW, PRIV, &file, 4 * P).unwrap();
        assert_eq!(rd(&s, poff, PU + 100), data[4 * PU..], "{what}: private at an offset");
        assert_eq!(rd(&s, poff + P + 100, tail.len()), tail);
        assert_eq!(vm.stats().file_fills, 6, "{what}: no page read twice");
        assert_eq!(s.write(off, b"x"), Err(Error::Segv { addr: off, code: SegvCode::AccErr }), "{what}");
        s.write(poff, b"private").unwrap();
        assert_eq!(rd(&s, pr + 4 * P, 7), data[4 * PU..4 * PU + 7], "{what}: one private mapping's copy");
        drop(s);
        assert_eq!(f.contents(), data, "{what}: reading and private writes left the file alone");
    });
}

#[test]
fn shared_writes_reach_the_file_and_private_writes_never_do() {
    let data = pattern(4 * PU, 2);
    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let mut want = data.clone();
        let a = vm.new_space().unwrap();
        let b = vm.new_space().unwrap();
        let sa = a.mmap_file(0, 4 * P, RW, SH, &f.rw(), 0).unwrap();
        let pb = b.mmap_file(0, 4 * P, RW, PRIV, &f.ro(), 0).unwrap();
        // A shared write made before the private copy shows in the private mapping...
        a.write(sa + 8, b"shared-1").unwrap();
        assert_eq!(rd(&b, pb + 8, 8), b"shared-1", "{what}");
        // ... a private write copies the page, which the shared mapping never sees...
        b.write(pb + 100, b"private").unwrap();
        assert_eq!(rd(&a, sa + 100, 7), data[100..107], "{what}: a private write showed in a shared mapping");
        assert_eq!(rd(&b, pb + 8, 8), b"shared-1", "{what}: the copy took the page as it was");
        // ... nor, after the copy, does the private mapping see shared writes.
        a.write(sa + 8, b"shared-2").unwrap();
        assert_eq!(rd(&b, pb + 8, 8), b"shared-1", "{what}: a shared write reached a private copy");
        // A private write to a page the private mapping never read.
        b.write(pb + 3 * P, b"private-3").unwrap();
        assert_eq!(rd(&a, sa + 3 * P, 9), data[3 * PU..3 * PU + 9], "{what}");
        // Private mappings have nothing to write back.
        b.msync(pb, 4 * P).unwrap();
        assert_eq!(vm.stats().file_writebacks, 0, "{what}");
        assert_eq!(f.contents(), data, "{what}: written back without msync");

        a.msync(sa, 4 * P).unwrap();
        want[8..16].copy_from_slice(b"shared-2");
        assert_eq!(f.contents(), want, "{what}: after msync");
        assert_eq!(vm.stats().file_writebacks, 1, "{what}: the one dirty page");

        a.write(sa + P + 5, b"munmap").unwrap();
        a.munmap(sa + P, P).unwrap();
        want[PU + 5..PU + 11].copy_from_slice(b"munmap");
        assert_eq!(f.contents(), want, "{what}: after munmap");

        a.write(sa + 2 * P, b"dropped").unwrap();
        b.write(pb + 2 * P + 1, b"PRIVATE").unwrap();
        assert_eq!(rd(&b, pb + 2 * P, 8), b"dPRIVATE", "{what}");
        // The end of a space writes back, although b still maps the file.
        drop(a);
        want[2 * PU..2 * PU + 7].copy_from_slice(b"dropped");
        assert_eq!(f.contents(), want, "{what}: after dropping the space");
        assert_eq!(rd(&b, pb + 2 * P, 8), b"dPRIVATE", "{what}");
        drop(b);
        assert_eq!(f.contents(), want, "{what}: after dropping every space");
    });
}

#[test]
fn shared_writes_through_two_handles_and_two_spaces_are_seen_at_once() {
    let data = pattern(3 * PU, 3);
    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        // A second name for the same inode: the page cache is keyed by (device, inode).
        let link = f.path.with_extension("link");
        std::fs::hard_link(&f.path, &link).unwrap();
        let h2 = OpenOptions::new().read(true).write(true).open(&link).unwrap();
        std::fs::remove_file(&link).unwrap();
        let a = vm.new_space().unwrap();
        let b = vm.new_space().unwrap();
        let sa = a.mmap_file(0, 3 * P, RW, SH, &f.rw(), 0).unwrap();
        let sb = b.mmap_file(0, 3 * P, RW, SH, &h2, 0).unwrap();
        a.write(sa + 10, b"from a").unwrap();
        assert_eq!(rd(&b, sb + 10, 6), b"from a", "{what}");
        b.write(sb + P + 10, b"from b").unwrap();
        assert_eq!(rd(&a, sa + P + 10, 6), b"from b", "{what}");
        for i in 0..64u64 {
            let ((w, wa), (r, ra)) = if i % 2 == 0 { ((&a, sa), (&b, sb)) } else { ((&b, sb), (&a, sa)) };
            w.write(wa + 2 * P + 64, &i.to_le_bytes()).unwrap();
            assert_eq!(rd(r, ra + 2 * P + 64, 8), i.to_le_bytes(), "{what}: write {i}");
        }
        // A second mapping of the file in one space, at an offset, aliases the same pages.
        let alias = a.mmap_file(0, P, RW, SH, &h2, P).unwrap();
        assert_eq!(rd(&a, alias + 10, 6), b"from b", "{what}");
        a.write(alias + 20, b"alias").unwrap();
        assert_eq!(rd(&b, sb + P + 20, 5), b"alias", "{what}");
        assert_eq!(vm.stats().file_fills, 3, "{what}: one page cache");
        // One msync writes what every mapping of the file wrote.
        b.msync(sb, 3 * P).unwrap();
        let mut want = data.clone();
        want[10..16].copy_from_slice(b"from a");
        want[PU + 10..PU + 16].copy_from_slice(b"from b");
        want[PU + 20..PU + 25].copy_from_slice(b"alias");
        want[2 * PU + 64..2 * PU + 72].copy_from_slice(&63u64.to_le_bytes());
        assert_eq!(f.contents(), want, "{what}");
        drop((a, b));
        assert_eq!(f.contents(), want, "{what}");
    });
}

#[test]
fn end_of_file_matches_the_host() {
    let data = pattern(5000, 4);
    let f = TempFile::new(&data);
    let file = f.rw();
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    for flags in [libc::MAP_SHARED, libc::MAP_PRIVATE] {
        let p = host_mmap(3 * P, rw, flags, &file, 0).unwrap();
        assert_eq!(host_read(p, 5000), data, "host {flags}");
        assert_eq!(host_read(p + 5000, 2 * PU - 5000), vec![0; 2 * PU - 5000], "host {flags}: past the end");
        assert_eq!(host_access_signal(p + 2 * P, false), Some(libc::SIGBUS), "host {flags}: load");
        assert_eq!(host_access_signal(p + 2 * P + 17, true), Some(libc::SIGBUS), "host {flags}: store");
        assert_eq!(host_access_signal(p + P + 4000, false), None, "host {flags}: in the last page");
        host_munmap(p, 3 * P);
    }
    // A mapping wholly beyond the end: mmap succeeds, the access does not.
    let p = host_mmap(P, libc::PROT_READ, libc::MAP_SHARED, &file, 4 * P).unwrap();
    assert_eq!(host_access_signal(p, false), Some(libc::SIGBUS));
    host_munmap(p, P);
    // A store into the last page past the end does not grow the file.
    let p = host_mmap(2 * P, rw, libc::MAP_SHARED, &file, 0).unwrap();
    // SAFETY: within the mapping's last page, which holds the end of the file.
    unsafe { std::ptr::write_volatile((p + 6000) as *mut u8, 0xAA) };
    // SAFETY: our mapping.
    assert_eq!(unsafe { libc::msync(p as *mut libc::c_void, 2 * PU, libc::MS_SYNC) }, 0);
    host_munmap(p, 2 * P);
    assert_eq!(f.contents(), data, "host: the file changed");
    drop(file);

    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let file = f.rw();
        let s = vm.new_space().unwrap();
        let mut buses = 0;
        for flags in [PRIV, SH] {
            let a = s.mmap_file(0, 3 * P, RW, flags, &file, 0).unwrap();
            let what = format!("{what} {flags:?}");
            assert_eq!(rd(&s, a, 5000), data, "{what}");
            assert_eq!(rd(&s, a + 5000, 2 * PU - 5000), vec![0; 2 * PU - 5000], "{what}: past the end");
            let bus = |addr| Error::Bus { addr, pgoff: 2, size: 5000 };
            assert_eq!(s.read(a + 2 * P, &mut [0u8; 1]), Err(bus(a + 2 * P)), "{what}: load");
            assert_eq!(s.write(a + 2 * P + 17, &[0]), Err(bus(a + 2 * P + 17)), "{what}: store");
            assert_eq!(s.touch(a + 2 * P + 5, Access::Read), Err(bus(a + 2 * P + 5)), "{what}: touch");
            // A load that runs into the page stops there, with the bytes before it read.
            let mut buf = [0xffu8; 16];
            assert_eq!(s.read(a + 2 * P - 8, &mut buf), Err(bus(a + 2 * P)), "{what}: crossing load");
            assert_eq!(buf[..8], [0; 8], "{what}: the bytes before the bad page");
            assert_eq!(bus(0).errno(), libc::EFAULT);
            buses += 4;
            // A store in the last page past the end is allowed and never grows the file.
            s.write(a + 6000, &[0xAA]).unwrap();
            assert_eq!(rd(&s, a + 6000, 1), [0xAA], "{what}");
            s.msync(a, 3 * P).unwrap();
            s.munmap(a, 3 * P).unwrap();
        }
        let far = s.mmap_file(0, P, Prot::READ, SH, &file, 4 * P).unwrap();
        assert_eq!(s.read(far, &mut [0u8; 4]), Err(Error::Bus { addr: far, pgoff: 4, size: 5000 }), "{what}");
        buses += 1;
        assert_eq!(vm.stats().sigbus, buses, "{what}");
        drop(s);
        assert_eq!(f.contents(), data, "{what}: the file changed");
    });
}

#[test]
fn mmap_argument_errors_match_the_host() {
    let data = pattern(2 * PU, 5);
    let f = TempFile::new(&data);
    let r = Prot::READ;
    let cases: Vec<(&str, File, Prot, MapFlags, u64)> = vec![
        ("unaligned offset", f.rw(), r, SH, 100),
        ("unaligned offset of a write-only file", f.wo(), RW, SH, 100),
        ("read-only file, shared writable", f.ro(), RW, SH, 0),
        ("read-only file, shared read-only", f.ro(), r, SH, 0),
        ("read-only file, private writable", f.ro(), RW, PRIV, 0),
        ("write-only file, shared", f.wo(), r, SH, 0),
        ("write-only file, shared writable", f.wo(), RW, SH, 0),
        ("write-only file, private", f.wo(), r, PRIV, 0),
        ("read-write file, shared writable", f.rw(), RW, SH, 0),
        ("offset beyond the end", f.ro(), r, PRIV, 64 * P),
    ];
    let host: Vec<i32> =
        cases.iter().map(|(_, file, prot, flags, off)| host_mmap_errno(P, *prot, *flags, file, *off)).collect();
    assert_eq!(host, [libc::EINVAL, libc::EINVAL, libc::EACCES, 0, 0, libc::EACCES, libc::EACCES, libc::EACCES, 0, 0]);
    each_config(4 << 20, |vm, what| {
        let s = vm.new_space().unwrap();
        for ((name, file, prot, flags, off), &h) in cases.iter().zip(&host) {
            let got = errno_of(s.mmap_file(0, P, *prot, *flags, file, *off));
            assert_eq!(got, h, "{what}: {name}: vmfault errno {got}, host {h}");
        }
        let e = s.mmap_file(0, P, r, SH, &f.wo(), 0).unwrap_err();
        assert_eq!(e, Error::Access { op: vmfault::Op::Mmap, need: "reading" });
        let e = s.mmap_file(0, P, RW, SH, &f.ro(), 0).unwrap_err();
        assert_eq!(e, Error::Access { op: vmfault::Op::Mmap, need: "writing" });
        assert_eq!(errno_of(s.mmap_file(0, P, r, SH | MapFlags::ANONYMOUS, &f.rw(), 0)), libc::EINVAL, "{what}");
    });
    assert_eq!(f.contents(), data);
}

/// A private mapping of a file opened read-only may become writable; its
/// stores stay private.
#[test]
fn mprotect_makes_a_private_mapping_of_a_read_only_file_writable() {
    let data = pattern(PU, 6);
    let f = TempFile::new(&data);
    assert_eq!(host_mprotect_rw_errno(PRIV, &f.ro()), 0, "host");
    each_config(4 << 20, |vm, what| {
        let s = vm.new_space().unwrap();
        let a = s.mmap_file(0, P, Prot::READ, PRIV, &f.ro(), 0).unwrap();
        assert_eq!(s.write(a, b"x"), Err(Error::Segv { addr: a, code: SegvCode::AccErr }), "{what}");
        s.mprotect(a, P, RW).unwrap();
        s.write(a, b"private").unwrap();
        assert_eq!(rd(&s, a, 7), b"private", "{what}");
        drop(s);
        assert_eq!(f.contents(), data, "{what}");
    });
}

/// A shared mapping of a file opened read-only may not become writable:
/// Linux clears `VM_MAYWRITE` at `mmap` and `mprotect` fails with `EACCES`.
#[test]
fn mprotect_cannot_make_a_shared_mapping_of_a_read_only_file_writable() {
    let data = pattern(PU, 6);
    let f = TempFile::new(&data);
    assert_eq!(host_mprotect_rw_errno(SH, &f.ro()), libc::EACCES, "host");
    each_config(4 << 20, |vm, what| {
        let s = vm.new_space().unwrap();
        let a = s.mmap_file(0, P, Prot::READ, SH, &f.ro(), 0).unwrap();
        assert_eq!(errno_of(s.mprotect(a, P, RW)), libc::EACCES, "{what}");
        assert_eq!(s.mappings()[0].prot, Prot::READ, "{what}");
    });
}

/// `mmap` of something that has no pages (a directory, a pipe) fails with
/// `ENODEV` on Linux, after the `EACCES` checks: both are open for reading.
#[test]
fn mmap_of_a_directory_or_a_pipe_matches_the_host() {
    let dir = File::open(std::env::temp_dir()).unwrap();
    let (r, _w) = std::io::pipe().unwrap();
    let pipe = File::from(std::os::fd::OwnedFd::from(r));
    let host: Vec<i32> = [&dir, &pipe].iter().map(|f| host_mmap_errno(P, Prot::READ, PRIV, f, 0)).collect();
    assert_eq!(host, [libc::ENODEV, libc::ENODEV], "host");
    each_config(4 << 20, |vm, what| {
        let s = vm.new_space().unwrap();
        for (name, file, &h) in [("directory", &dir, &host[0]), ("pipe", &pipe, &host[1])] {
            let got = errno_of(s.mmap_file(0, P, Prot::READ, PRIV, file, 0));
            assert_eq!(got, h, "{what}: {name}: vmfault errno {got}, host {h}");
        }
    });
}

/// Splitting a file mapping (`mprotect`, `munmap` in the middle) keeps
/// each piece's file offset, for faults, `msync` and the reverse map; the
/// layout matches the host's, merges included.
#[test]
fn split_and_merged_file_mappings_keep_their_offsets() {
    let data = pattern(8 * PU, 14);
    let f = TempFile::new(&data);
    let file = f.rw();
    let (r, rw) = (Prot::READ, RW);
    // (offset in the window, pages, prot, file page), as MAP_SHARED | MAP_FIXED, then mprotect and munmap.
    let maps: [(u64, u64, Prot, u64); 4] = [(0, 2, r, 0), (2, 2, r, 2), (4, 2, r, 6), (6, 2, rw, 4)];
    // Then (offset in the window, pages, new prot or None to unmap).
    let changes: [(u64, u64, Option<Prot>); 2] = [(1, 1, Some(rw)), (5, 1, None)];
    // The host, inside a PROT_NONE reservation of our own.
    // (The descriptor is ignored with MAP_ANONYMOUS.)
    let window = host_mmap(8 * P, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, &file, 0);
    let window = window.unwrap();
    for &(at, pages, prot, pg) in &maps {
        // SAFETY: within our own reservation.
        let p = unsafe {
            libc::mmap(
                (window + at * P) as *mut libc::c_void,
                (pages * P) as usize,
                prot.bits() as i32,
                libc::MAP_SHARED | libc::MAP_FIXED,
                std::os::fd::AsRawFd::as_raw_fd(&file),
                (pg * P) as i64,
            )
        };
        assert_eq!(p as u64, window + at * P);
    }
    let host_merged = host_layout(window, 8);
    assert_eq!(host_merged, [(0, 4), (4, 6), (6, 8)], "host layout: contiguous pieces of the file merge");
    for &(at, n, prot) in &changes {
        let (addr, len) = (window + at * P, n * P);
        match prot {
            // SAFETY: within our own reservation.
            Some(prot) => assert_eq!(unsafe { libc::mprotect(addr as _, len as usize, prot.bits() as i32) }, 0),
            None => host_munmap(addr, len),
        }
    }
    let host = host_layout(window, 8);
    assert_eq!(host, [(0, 1), (1, 2), (2, 4), (4, 5), (6, 8)], "host layout");
    assert_eq!(host_read(window + 4 * P, 4), data[6 * PU..6 * PU + 4]);
    assert_eq!(host_read(window + 7 * P, 4), data[5 * PU..5 * PU + 4]);
    host_munmap(window, 8 * P);
    drop(file);

    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let (s, t) = (vm.new_space().unwrap(), vm.new_space().unwrap());
        let w = s.mmap(0, 8 * P, Prot::empty(), PRIV | MapFlags::ANONYMOUS).unwrap();
        for &(at, pages, prot, pg) in &maps {
            assert_eq!(s.mmap_file(w + at * P, pages * P, prot, SH | MapFlags::FIXED, &f.rw(), pg * P), Ok(w + at * P));
        }
        let layout = |s: &AddressSpace| -> Vec<(u64, u64)> {
            s.mappings().iter().map(|m| ((m.start - w) / P, (m.end - w) / P)).collect()
        };
        assert_eq!(layout(&s), host_merged, "{what}: layout after mmap");
        for &(at, n, prot) in &changes {
            match prot {
                Some(prot) => s.mprotect(w + at * P, n * P, prot).unwrap(),
                None => s.munmap(w + at * P, n * P).unwrap(),
            }
        }
        assert_eq!(layout(&s), host, "{what}: layout after mprotect and munmap");
        // Every window page that is mapped shows its file page.
        for (page, file_page) in [(0, 0), (1, 1), (2, 2), (3, 3), (4, 6), (6, 4), (7, 5)] {
            let at = file_page * PU;
            assert_eq!(rd(&s, w + page * P, 8), data[at..at + 8], "{what}: window page {page}");
        }
        // Another space maps the whole file: the reverse map finds both mappings of each page.
        let all = t.mmap_file(0, 8 * P, RW, SH, &f.rw(), 0).unwrap();
        for (page, file_page) in [(1, 1), (3, 3), (4, 6), (7, 5)] {
            rd(&t, all + file_page * P, 1);
            assert_eq!(s.unmap_everywhere(w + page * P), Ok(2), "{what}: window page {page}");
        }
        // Stores through the pieces reach the right places in the file.
        s.write(w + P, b"page one").unwrap();
        s.write(w + 7 * P, b"page five").unwrap();
        t.write(all + 6 * P, b"page six").unwrap();
        s.msync(w, 8 * P).unwrap_err(); // the hole at window page 5
        let mut want = data.clone();
        want[PU..PU + 8].copy_from_slice(b"page one");
        want[5 * PU..5 * PU + 9].copy_from_slice(b"page five");
        want[6 * PU..6 * PU + 8].copy_from_slice(b"page six");
        assert_eq!(f.contents(), want, "{what}: msync of the pieces");
        assert_eq!(rd(&s, w + 4 * P, 8), b"page six", "{what}");
        drop((s, t));
        assert_eq!(f.contents(), want, "{what}");
    });
}

#[test]
fn msync_errors_match_the_host() {
    let data = pattern(3 * PU, 7);
    let f = TempFile::new(&data);
    let file = f.rw();
    // In a single-threaded child, so that no other thread maps into the hole.
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    let (host, sig) = in_host_child(|out| {
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        // SAFETY: a reservation chosen by the kernel, then our file over it
        // and a hole after it, in this single-threaded child.
        let p = unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                4 * PU,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            let p = libc::mmap(base, 3 * PU, rw, libc::MAP_SHARED | libc::MAP_FIXED, fd, 0);
            if base == libc::MAP_FAILED || p != base || libc::munmap(base.add(3 * PU), PU) != 0 {
                out[63] = -1;
                return;
            }
            p as u64
        };
        let msync = |addr: u64, len: u64| {
            // SAFETY: msync checks its range itself; nothing is changed but the file.
            let r = unsafe { libc::msync(addr as *mut libc::c_void, len as usize, libc::MS_SYNC) };
            if r == 0 { 0 } else { i64::from(host_errno()) }
        };
        out[0] = msync(p, 3 * P);
        out[1] = msync(p + 1, P);
        out[2] = msync(p, 100);
        out[3] = msync(p, 0);
        // SAFETY: the middle page of our mapping.
        out[4] = i64::from(unsafe { libc::munmap((p + P) as *mut libc::c_void, PU) });
        out[5] = msync(p, 3 * P);
        out[6] = msync(p + P, P);
        out[7] = msync(p + 2 * P, P);
        out[8] = msync(p + 2 * P, 2 * P);
    });
    assert_eq!((sig, host[63]), (None, 0), "host child");
    let (einval, enomem) = (i64::from(libc::EINVAL), i64::from(libc::ENOMEM));
    assert_eq!(host[..9], [0, einval, 0, 0, 0, enomem, enomem, 0, enomem], "host");
    drop(file);
    each_config(4 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let s = vm.new_space().unwrap();
        // The same layout: the file, then a hole.
        let base = s.mmap(0, 4 * P, Prot::empty(), PRIV | MapFlags::ANONYMOUS).unwrap();
        let p = s.mmap_file(base, 3 * P, RW, SH | MapFlags::FIXED, &f.rw(), 0).unwrap();
        s.munmap(base + 3 * P, P).unwrap();
        let msync = |addr: u64, len: u64| i64::from(errno_of(s.msync(addr, len)));
        let mut got = [0i64; 9];
        got[0] = msync(p, 3 * P);
        got[1] = msync(p + 1, P);
        got[2] = msync(p, 100);
        got[3] = msync(p, 0);
        s.write(p, b"page zero").unwrap();
        s.write(p + 2 * P, b"page two").unwrap();
        s.write(p + P, b"page one").unwrap();
        got[4] = i64::from(errno_of(s.munmap(p + P, P)));
        let mut want = data.clone();
        want[PU..PU + 8].copy_from_slice(b"page one");
        assert_eq!(f.contents(), want, "{what}: munmap wrote its page back");
        got[5] = msync(p, 3 * P);
        want[..9].copy_from_slice(b"page zero");
        want[2 * PU..2 * PU + 8].copy_from_slice(b"page two");
        assert_eq!(f.contents(), want, "{what}: msync over a hole still syncs the rest");
        got[6] = msync(p + P, P);
        got[7] = msync(p + 2 * P, P);
        got[8] = msync(p + 2 * P, 2 * P);
        assert_eq!(got, host[..9], "{what}: vmfault vs host");
        assert_eq!(
            s.msync(p + 1, P),
            Err(Error::InvalidArgument { op: vmfault::Op::Msync, reason: "address not page-aligned", value: p + 1 })
        );
        assert!(matches!(s.msync(p, 3 * P), Err(Error::NotMapped { .. })), "{what}");
        drop(s);
    });
}

#[test]
fn fork_copies_private_file_pages_and_shares_shared_ones() {
    let data = pattern(4 * PU, 8);
    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let parent = vm.new_space().unwrap();
        let pr = parent.mmap_file(0, 4 * P, RW, PRIV, &f.rw(), 0).unwrap();
        let sh = parent.mmap_file(0, 4 * P, RW, SH, &f.rw(), 0).unwrap();
        parent.write(pr, b"parent-0").unwrap();
        assert_eq!(rd(&parent, pr + P, 8), data[PU..PU + 8]);
        parent.write(sh + 2 * P, b"shared-2").unwrap();
        let child = parent.fork().unwrap();
        assert_eq!(rd(&child, pr, 8), b"parent-0", "{what}: the parent's private copy");
        assert_eq!(rd(&child, pr + P, 8), data[PU..PU + 8], "{what}");
        assert_eq!(rd(&child, pr + 3 * P, 8), data[3 * PU..3 * PU + 8], "{what}");
        assert_eq!(rd(&child, sh + 2 * P, 8), b"shared-2", "{what}");
        child.write(pr, b"child--0").unwrap();
        parent.write(pr + P, b"parent-1").unwrap();
        child.write(pr + 3 * P, b"child--3").unwrap();
        assert_eq!(rd(&parent, pr, 8), b"parent-0", "{what}: the child's write reached the parent");
        assert_eq!(rd(&child, pr + P, 8), data[PU..PU + 8], "{what}: the parent's write reached the child");
        assert_eq!(rd(&parent, pr + 3 * P, 8), data[3 * PU..3 * PU + 8], "{what}");
        // Shared stays shared, both ways, and one msync writes both.
        child.write(sh + 2 * P, b"child-s2").unwrap();
        assert_eq!(rd(&parent, sh + 2 * P, 8), b"child-s2", "{what}");
        parent.write(sh + 3 * P, b"parent-s3").unwrap();
        assert_eq!(rd(&child, sh + 3 * P, 9), b"parent-s3", "{what}");
        // Private pages of the file never show in the shared mapping.
        assert_eq!(rd(&child, sh, 8), data[..8], "{what}");
        child.msync(sh, 4 * P).unwrap();
        let mut want = data.clone();
        want[2 * PU..2 * PU + 8].copy_from_slice(b"child-s2");
        want[3 * PU..3 * PU + 9].copy_from_slice(b"parent-s3");
        assert_eq!(f.contents(), want, "{what}");
        // Both sides' PTEs were write-protected by that msync: new stores are caught.
        child.write(sh + 2 * P, b"again-c2").unwrap();
        parent.write(sh + 3 * P, b"again-p3").unwrap();
        parent.msync(sh, 4 * P).unwrap();
        want[2 * PU..2 * PU + 8].copy_from_slice(b"again-c2");
        want[3 * PU..3 * PU + 8].copy_from_slice(b"again-p3");
        assert_eq!(f.contents(), want, "{what}: a store after the write-back was lost");
        // A grandchild of the private mapping.
        let grandchild = child.fork().unwrap();
        drop(child);
        assert_eq!(rd(&grandchild, pr, 8), b"child--0", "{what}");
        assert_eq!(rd(&grandchild, pr + P, 8), data[PU..PU + 8], "{what}");
        drop((parent, grandchild));
        assert_eq!(f.contents(), want, "{what}");
    });
}

#[test]
fn unmap_everywhere_clears_every_mapping_of_a_file_page() {
    let data = pattern(2 * PU, 9);
    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let (a, b, c) = (vm.new_space().unwrap(), vm.new_space().unwrap(), vm.new_space().unwrap());
        let sa = a.mmap_file(0, 2 * P, RW, SH, &f.rw(), 0).unwrap();
        let sb = b.mmap_file(0, 2 * P, Prot::READ, SH, &f.rw(), 0).unwrap();
        // c maps only file page 1, at another address.
        let sc = c.mmap_file(0, P, RW, SH, &f.rw(), P).unwrap();
        a.write(sa + P, b"one").unwrap();
        assert_eq!(rd(&b, sb + P, 3), b"one");
        assert_eq!(rd(&c, sc, 3), b"one");
        rd(&a, sa, 1);
        rd(&b, sb, 1);
        let walks = vm.stats().rmap_walks;
        assert_eq!(a.unmap_everywhere(sa + P).unwrap(), 3, "{what}: page 1");
        assert!(vm.stats().rmap_walks > walks, "{what}");
        assert_eq!(a.unmap_everywhere(sa + P).unwrap(), 0, "{what}: not mapped here any more");
        assert_eq!(b.unmap_everywhere(sb).unwrap(), 2, "{what}: page 0");
        // The pages stay in the cache, dirty: the data comes back.
        assert_eq!(rd(&c, sc, 3), b"one", "{what}");
        assert_eq!(rd(&b, sb + P, 3), b"one", "{what}");
        assert_eq!(rd(&a, sa + P, 3), b"one", "{what}");
        c.write(sc + 3, b"-c").unwrap();
        assert_eq!(rd(&a, sa + P, 5), b"one-c", "{what}");
        assert_eq!(c.unmap_everywhere(sc).unwrap(), 3, "{what}");
        // A private mapping maps the file's page read-only until it writes.
        let pb = b.mmap_file(0, 2 * P, RW, PRIV, &f.ro(), 0).unwrap();
        assert_eq!(rd(&b, pb + P, 5), b"one-c", "{what}");
        rd(&a, sa + P, 1);
        rd(&b, sb + P, 1);
        rd(&c, sc, 1);
        assert_eq!(a.unmap_everywhere(sa + P).unwrap(), 4, "{what}: with the private mapping's");
        assert_eq!(rd(&b, pb + P, 5), b"one-c", "{what}");
        b.write(pb + P, b"PRIV").unwrap();
        rd(&a, sa + P, 1);
        rd(&b, sb + P, 1);
        rd(&c, sc, 1);
        assert_eq!(a.unmap_everywhere(sa + P).unwrap(), 3, "{what}: not the private copy");
        assert_eq!(b.unmap_everywhere(pb + P).unwrap(), 1, "{what}: the private copy was unmapped");
        assert_eq!(rd(&b, pb + P, 5), b"PRIVc", "{what}");
        assert_eq!(rd(&a, sa + P, 5), b"one-c", "{what}");
        drop((a, b, c));
        let mut want = data.clone();
        want[PU..PU + 5].copy_from_slice(b"one-c");
        assert_eq!(f.contents(), want, "{what}");
    });
}

#[test]
fn reverse_map_metadata_per_mode() {
    const SPACES: u64 = 8;
    const PAGES: u64 = 512;
    let data = pattern((PAGES * P) as usize, 10);
    let seen = Mutex::new(Vec::new());
    each_config(16 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let file = f.rw();
        let spaces: Vec<(AddressSpace, u64)> = (0..SPACES)
            .map(|_| {
                let s = vm.new_space().unwrap();
                let a = s.mmap_file(0, PAGES * P, RW, SH, &file, 0).unwrap();
                (s, a)
            })
            .collect();
        for (i, (s, a)) in spaces.iter().enumerate() {
            for p in 0..PAGES {
                let access = if (p + i as u64).is_multiple_of(4) { Access::Write } else { Access::Read };
                s.touch(a + p * P, access).unwrap();
            }
        }
        let st = vm.stats();
        assert_eq!(st.file_fills, PAGES, "{what}");
        match vm.config().rmap {
            Rmap::PvEntry => {
                assert_eq!(st.pv_entries, SPACES * PAGES, "{what}");
                assert!(st.rmap_bytes >= SPACES * PAGES * 16, "{what}: {} bytes", st.rmap_bytes);
                assert_eq!(st.backing_records, 0, "{what}");
            }
            Rmap::Backing => {
                assert_eq!(st.pv_entries, 0, "{what}");
                assert!(st.backing_records >= SPACES, "{what}: {} records", st.backing_records);
            }
        }
        seen.lock().unwrap().push((vm.config().fault_path, vm.config().rmap, st.rmap_bytes));
        // The walks find them all.
        let (s0, a0) = &spaces[0];
        assert_eq!(s0.unmap_everywhere(*a0 + 7 * P).unwrap(), SPACES, "{what}");
        drop(spaces);
        assert_eq!(f.contents(), data, "{what}: stores of the same bytes");
    });
    let seen = seen.into_inner().unwrap();
    for path in FAULT_PATHS {
        let bytes = |rmap| seen.iter().find(|&&(p, r, _)| p == path && r == rmap).unwrap().2;
        let (backing, pv) = (bytes(Rmap::Backing), bytes(Rmap::PvEntry));
        // 8 records take a hash table of 14 slots of 49 bytes (686 bytes),
        // the pv entries exactly 4096 * 16 bytes: a factor of 95.
        assert!(backing * 50 < pv, "{path:?}: backing records {backing} bytes, pv entries {pv} bytes");
    }
}

#[test]
fn a_store_after_a_write_back_is_written_back_again() {
    let data = pattern(2 * PU, 11);
    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let mut want = data.clone();
        let a = vm.new_space().unwrap();
        let p = a.mmap_file(0, 2 * P, RW, SH, &f.rw(), 0).unwrap();
        a.write(p, b"first").unwrap();
        a.msync(p, 2 * P).unwrap();
        want[..5].copy_from_slice(b"first");
        assert_eq!(f.contents(), want, "{what}");
        a.write(p, b"second").unwrap();
        a.msync(p, 2 * P).unwrap();
        want[..6].copy_from_slice(b"second");
        assert_eq!(f.contents(), want, "{what}: the second store was not written back");
        assert_eq!(vm.stats().file_writebacks, 2, "{what}");
        a.msync(p, 2 * P).unwrap();
        assert_eq!(vm.stats().file_writebacks, 2, "{what}: a clean page was written");
        // The same with the page written through another space's writable PTE.
        let b = vm.new_space().unwrap();
        let q = b.mmap_file(0, 2 * P, RW, SH, &f.rw(), 0).unwrap();
        b.write(q + P, b"b-one").unwrap();
        a.write(p + P + 5, b"a-one").unwrap();
        a.msync(p, 2 * P).unwrap();
        want[PU..PU + 10].copy_from_slice(b"b-onea-one");
        assert_eq!(f.contents(), want, "{what}");
        b.write(q + P, b"B-TWO").unwrap();
        a.msync(p, 2 * P).unwrap();
        want[PU..PU + 5].copy_from_slice(b"B-TWO");
        assert_eq!(f.contents(), want, "{what}: a store through the other space's PTE was lost");
        // A page read first, then written (the PTE upgraded in place).
        assert_eq!(rd(&b, q, 6), b"second");
        b.write(q, b"SECOND").unwrap();
        a.msync(p, P).unwrap();
        want[..6].copy_from_slice(b"SECOND");
        assert_eq!(f.contents(), want, "{what}: a store upgrading a read-only PTE was lost");
        // After mprotect back and forth, after MADV_DONTNEED.
        a.mprotect(p, 2 * P, Prot::READ).unwrap();
        a.mprotect(p, 2 * P, RW).unwrap();
        a.write(p, b"third").unwrap();
        a.madvise(p, 2 * P, Advice::DontNeed).unwrap();
        assert_eq!(rd(&a, p, 6), b"thirdD", "{what}: MADV_DONTNEED lost a shared file page");
        a.msync(p, 2 * P).unwrap();
        want[..5].copy_from_slice(b"third");
        assert_eq!(f.contents(), want, "{what}");
        // MAP_FIXED over a dirty shared mapping writes it back.
        a.write(p + 10, b"fixed").unwrap();
        a.mmap(p, 2 * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS | MapFlags::FIXED).unwrap();
        want[10..15].copy_from_slice(b"fixed");
        assert_eq!(f.contents(), want, "{what}: MAP_FIXED over a dirty page");
        drop((a, b));
        assert_eq!(f.contents(), want, "{what}");
    });
}

/// `MADV_DONTNEED` drops a private mapping's copies (the file shows again)
/// and keeps a shared mapping's stores, on the host and here.
#[test]
fn dontneed_on_file_mappings_matches_the_host() {
    let data = pattern(PU, 12);
    let f = TempFile::new(&data);
    let file = f.rw();
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let mut host = Vec::new();
    for flags in [libc::MAP_PRIVATE, libc::MAP_SHARED] {
        let p = host_mmap(P, rw, flags, &file, 0).unwrap();
        // SAFETY: our mapping, one page long.
        unsafe {
            std::ptr::copy_nonoverlapping(b"written".as_ptr(), p as *mut u8, 7);
            assert_eq!(libc::madvise(p as *mut libc::c_void, PU, libc::MADV_DONTNEED), 0);
        }
        host.push(host_read(p, 7));
        // SAFETY: our mapping.
        assert_eq!(unsafe { libc::msync(p as *mut libc::c_void, PU, libc::MS_SYNC) }, 0);
        host_munmap(p, P);
    }
    assert_eq!(host, [data[..7].to_vec(), b"written".to_vec()], "host");
    let after_host = f.contents();
    assert_eq!(after_host[..7], *b"written");
    drop(file);
    each_config(4 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let s = vm.new_space().unwrap();
        let mut got = Vec::new();
        for flags in [PRIV, SH] {
            let p = s.mmap_file(0, P, RW, flags, &f.rw(), 0).unwrap();
            s.write(p, b"written").unwrap();
            s.madvise(p, P, Advice::DontNeed).unwrap();
            got.push(rd(&s, p, 7));
            s.msync(p, P).unwrap();
            s.munmap(p, P).unwrap();
        }
        assert_eq!(got, host, "{what}");
        assert_eq!(f.contents(), after_host, "{what}");
        drop(s);
    });
}

/// A writer stores an increasing counter into a shared file page while
/// another vCPU calls msync over and over: once the writer stops, one more
/// msync must leave the last value in the file (a store that raced a
/// write-back is never lost).
#[test]
fn stores_racing_msync_are_not_lost() {
    use std::sync::atomic::AtomicBool;
    let data = pattern(2 * PU, 13);
    each_config(8 << 20, |vm, what| {
        let f = TempFile::new(&data);
        let s = vm.new_space().unwrap();
        let p = s.mmap_file(0, 2 * P, RW, SH, &f.rw(), 0).unwrap();
        s.write(p + 8, &0u64.to_le_bytes()).unwrap();
        s.msync(p, 2 * P).unwrap();
        let stop = AtomicBool::new(false);
        let progress = AtomicU64::new(0);
        let last = std::thread::scope(|scope| {
            let writer = scope.spawn(|| {
                let _cpu = vm.attach().unwrap();
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) && n < 1_000_000 {
                    n += 1;
                    s.write(p + 8, &n.to_le_bytes()).unwrap();
                    progress.store(n, Ordering::Relaxed);
                }
                n
            });
            let _cpu = vm.attach().unwrap();
            while progress.load(Ordering::Relaxed) == 0 && !writer.is_finished() {
                std::thread::yield_now();
            }
            let mut before = 0;
            for _ in 0..200 {
                s.msync(p, 2 * P).unwrap();
                let on_file = u64::from_le_bytes(f.contents()[8..16].try_into().unwrap());
                assert!(on_file >= before, "{what}: the file went from {before} back to {on_file}");
                before = on_file;
            }
            stop.store(true, Ordering::Relaxed);
            writer.join().unwrap()
        });
        assert!(last > 0);
        s.msync(p, 2 * P).unwrap();
        assert_eq!(f.contents()[8..16], last.to_le_bytes(), "{what}: the last store was lost");
        drop(s);
    });
}

/// Write-back writes through a handle of its own: a file first mapped
/// through a read-only handle (a binary's text) and then shared writable
/// through a read-write one still gets its stores.
#[test]
fn write_back_does_not_use_the_first_mappers_handle() {
    let data = pattern(2 * PU, 9);
    let f = TempFile::new(&data);
    each_config(4 << 20, |vm, what| {
        let s = vm.new_space().unwrap();
        let text = s.mmap_file(0, 2 * P, Prot::READ, PRIV, &f.ro(), 0).unwrap();
        let rw = f.rw();
        let a = s.mmap_file(0, 2 * P, RW, SH, &rw, 0).unwrap();
        s.write(a + P, b"through a writer").unwrap();
        s.msync(a, 2 * P).unwrap();
        assert_eq!(&f.contents()[PU..PU + 16], b"through a writer", "{what}");
        s.munmap(text, 2 * P).unwrap();
        s.munmap(a, 2 * P).unwrap();
    });
}
