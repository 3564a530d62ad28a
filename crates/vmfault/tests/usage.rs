//! `AddressSpace::usage` (`/proc/PID/smaps`): `Rss`, `Anonymous` and
//! `Locked` per mapping compared with the host kernel's for the same
//! operations on anonymous memory; file mappings' file, offset and
//! anonymous copies; swap.

mod common;

use common::files::{P, PU, TempFile, in_host_child, pattern};
use common::{FAULT_PATHS, test_vm};
use std::os::unix::fs::MetadataExt;
use vmfault::{MapFlags, Prot};

const PA: i32 = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
const SA: i32 = libc::MAP_SHARED | libc::MAP_ANONYMOUS;

/// `Rss`, `Anonymous` and `Locked` of the host mapping at `start`, in bytes.
fn host_smaps(start: u64) -> [i64; 3] {
    let text = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut out = [-1i64; 3];
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if !first.ends_with(':') {
            // A mapping's header: `start-end perms offset dev inode path`.
            inside = first.split_once('-').and_then(|(a, _)| u64::from_str_radix(a, 16).ok()) == Some(start);
            continue;
        }
        if !inside {
            continue;
        }
        let field = |name: &str| {
            line.strip_prefix(name)
                .and_then(|r| r.trim().strip_suffix("kB"))
                .map(|v| v.trim().parse::<i64>().unwrap() * 1024)
        };
        if let Some(v) = field("Rss:") {
            out[0] = v;
        } else if let Some(v) = field("Anonymous:") {
            out[1] = v;
        } else if let Some(v) = field("Locked:") {
            out[2] = v;
        }
    }
    out
}

#[test]
fn anonymous_usage_matches_the_host_kernel() {
    // Four mappings, apart: private written (3 of 8 pages) and read (1:
    // the zero page), shared written (2 of 4), private locked (2), private
    // read-only read (2).
    let (host, sig) = in_host_child(|out| {
        // SAFETY: in the child: new mappings (no MAP_FIXED) and accesses
        // inside them.
        unsafe {
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
            let rw = libc::PROT_READ | libc::PROT_WRITE;
            let map = |pages: usize, prot: i32, flags: i32| {
                libc::mmap(std::ptr::null_mut(), pages * PU, prot, flags, -1, 0).cast::<u8>()
            };
            let (a, b, c, d) = (map(8, rw, PA), map(4, rw, SA), map(2, rw, PA), map(2, libc::PROT_READ, PA));
            for p in 0..3 {
                a.add(p * PU).write_volatile(1);
            }
            let _ = a.add(3 * PU).read_volatile();
            b.write_volatile(1);
            b.add(PU).write_volatile(1);
            libc::mlock(c.cast(), 2 * PU);
            let _ = d.read_volatile() + d.add(PU).read_volatile();
            for (i, m) in [a, b, c, d].into_iter().enumerate() {
                out[i * 3..i * 3 + 3].copy_from_slice(&host_smaps(m as u64));
            }
        }
    });
    assert_eq!(sig, None);
    let k = 4096;
    assert_eq!(host[..12], [3 * k, 3 * k, 0, 2 * k, 0, 0, 2 * k, 2 * k, 2 * k, 0, 0, 0], "the host kernel");
    for path in FAULT_PATHS {
        let vm = test_vm(8 << 20, 1, path);
        let s = vm.new_space().unwrap();
        let rw = Prot::READ | Prot::WRITE;
        let pa = MapFlags::PRIVATE | MapFlags::ANONYMOUS;
        let a = s.mmap(0, 8 * P, rw, pa).unwrap();
        let b = s.mmap(0, 4 * P, rw, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
        let c = s.mmap(0, 2 * P, rw, pa).unwrap();
        let d = s.mmap(0, 2 * P, Prot::READ, pa).unwrap();
        for p in 0..3 {
            s.write(a + p * P, &[1]).unwrap();
        }
        s.read(a + 3 * P, &mut [0]).unwrap();
        s.write(b, &[1]).unwrap();
        s.write(b + P, &[1]).unwrap();
        s.mlock(c, 2 * P).unwrap();
        s.read(d, &mut [0; 2]).unwrap();
        s.read(d + P, &mut [0]).unwrap();
        let usage = s.usage();
        for (i, m) in [a, b, c, d].into_iter().enumerate() {
            let u = usage.iter().find(|u| u.info.start == m).expect("a mapping per mmap");
            let got = [u.rss as i64, u.anonymous as i64, u.locked as i64];
            assert_eq!(got, host[i * 3..i * 3 + 3], "{path:?}: mapping {i}: {u:?}");
            assert_eq!((u.swap, u.file), (0, None));
        }
        assert_eq!(s.rss(), 7 * P, "{path:?}");
    }
}

#[test]
fn file_mappings_name_their_file_and_count_private_copies() {
    let f = TempFile::new(&pattern(8 * PU, 5));
    let meta = std::fs::metadata(&f.path).unwrap();
    let vm = test_vm(8 << 20, 1, vmfault::FaultPath::Speculative);
    let s = vm.new_space().unwrap();
    let rw = Prot::READ | Prot::WRITE;
    let private = s.mmap_file(0, 4 * P, rw, MapFlags::PRIVATE, &f.rw(), 2 * P).unwrap();
    let shared = s.mmap_file(0, 2 * P, rw, MapFlags::SHARED, &f.rw(), 0).unwrap();
    s.read(private, &mut [0]).unwrap(); // the file's page
    s.write(private + P, &[9]).unwrap(); // a private copy
    s.write(shared, &[9]).unwrap(); // the file's page, shared
    let usage = s.usage();
    let u = usage.iter().find(|u| u.info.start == private).unwrap();
    let want = vmfault::FileRange { dev: meta.dev(), ino: meta.ino(), offset: 2 * P };
    assert_eq!((u.file, u.rss, u.anonymous), (Some(want), 2 * P, P), "{u:?}");
    let u = usage.iter().find(|u| u.info.start == shared).unwrap();
    assert_eq!((u.file.map(|f| f.offset), u.rss, u.anonymous), (Some(0), P, 0), "{u:?}");
}
