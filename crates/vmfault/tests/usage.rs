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

/// The fields of the host mapping at `start` that [`FIELDS`] names, in
/// bytes.
fn host_smaps(start: u64) -> [i64; 8] {
    let text = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut inside = false;
    let mut out = [-1i64; 8];
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
        for (i, name) in FIELDS.iter().enumerate() {
            if let Some(v) = field(name) {
                out[i] = v;
            }
        }
    }
    out
}

/// The smaps fields compared, in this order.
const FIELDS: [&str; 8] =
    ["Rss:", "Anonymous:", "Locked:", "Pss:", "Shared_Clean:", "Shared_Dirty:", "Private_Clean:", "Private_Dirty:"];

/// The same fields of a mapping here (`Pss` and `Locked` rounded down to
/// kB, as smaps shows them).
fn ours(u: &vmfault::MappingUsage) -> [i64; 8] {
    let kb = |b: u64| (b / 1024 * 1024) as i64;
    [
        u.rss as i64,
        u.anonymous as i64,
        kb(u.locked),
        kb(u.pss),
        u.shared_clean as i64,
        u.shared_dirty as i64,
        u.private_clean as i64,
        u.private_dirty as i64,
    ]
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
                out[i * 8..i * 8 + 8].copy_from_slice(&host_smaps(m as u64));
            }
        }
    });
    assert_eq!(sig, None);
    let k = 4096;
    #[rustfmt::skip]
    let want = [
        3 * k, 3 * k, 0, 3 * k, 0, 0, 0, 3 * k, // private, 3 pages written (dirty)
        2 * k, 0, 0, 2 * k, 0, 0, 0, 2 * k,     // shared, 2 written
        2 * k, 2 * k, 2 * k, 2 * k, 0, 0, 0, 2 * k, // locked: populated by write faults
        0, 0, 0, 0, 0, 0, 0, 0,                 // the zero page only
    ];
    assert_eq!(host[..32], want, "the host kernel");
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
            assert_eq!(ours(u), host[i * 8..i * 8 + 8], "{path:?}: mapping {i}: {u:?}");
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

/// Two shared mappings of one file in one process: each page they both
/// map counts half in each `Pss` and as shared. Every page is touched in
/// both, so Linux's fault-around maps nothing more. Clean and dirty are
/// compared summed: the host's page cache may hold the file in one large
/// folio, dirty as a whole once one page is written; here the page one
/// mapping wrote is dirty in both (the page is), the others clean.
#[test]
fn a_file_mapped_twice_shares_its_pages() {
    use std::os::fd::AsRawFd;
    let f = TempFile::new(&pattern(4 * PU, 3));
    f.rw().sync_all().unwrap();
    let (host, sig) = in_host_child(|out| {
        let file = f.rw();
        // SAFETY: in the child: two new mappings of the file (no
        // MAP_FIXED), accesses inside them.
        unsafe {
            let map = |prot: i32| {
                libc::mmap(std::ptr::null_mut(), 4 * PU, prot, libc::MAP_SHARED, file.as_raw_fd(), 0).cast::<u8>()
            };
            let (m1, m2) = (map(libc::PROT_READ | libc::PROT_WRITE), map(libc::PROT_READ));
            m1.write_volatile(7);
            for p in 0..4 {
                let _ = m1.add(p * PU).read_volatile() + m2.add(p * PU).read_volatile();
            }
            out[..8].copy_from_slice(&host_smaps(m1 as u64));
            out[8..16].copy_from_slice(&host_smaps(m2 as u64));
        }
    });
    assert_eq!(sig, None);
    let k = 4096;
    // Shared_Clean + Shared_Dirty, Private_Clean + Private_Dirty.
    let summed = |f: &[i64]| [f[0], f[1], f[2], f[3], f[4] + f[5], f[6] + f[7]];
    for i in 0..2 {
        assert_eq!(summed(&host[i * 8..i * 8 + 8]), [4 * k, 0, 0, 2 * k, 4 * k, 0], "the host kernel, mapping {i}");
    }
    for path in FAULT_PATHS {
        let vm = test_vm(8 << 20, 1, path);
        let s = vm.new_space().unwrap();
        let m1 = s.mmap_file(0, 4 * P, Prot::READ | Prot::WRITE, MapFlags::SHARED, &f.rw(), 0).unwrap();
        let m2 = s.mmap_file(0, 4 * P, Prot::READ, MapFlags::SHARED, &f.rw(), 0).unwrap();
        s.write(m1, &[7]).unwrap();
        for p in 0..4 {
            s.read(m1 + p * P, &mut [0]).unwrap();
            s.read(m2 + p * P, &mut [0]).unwrap();
        }
        let usage = s.usage();
        for (i, m) in [m1, m2].into_iter().enumerate() {
            let u = usage.iter().find(|u| u.info.start == m).unwrap();
            assert_eq!(summed(&ours(u)), summed(&host[i * 8..i * 8 + 8]), "{path:?}: mapping {i}: {u:?}");
            assert_eq!((u.shared_dirty, u.shared_clean), (P, 3 * P), "{path:?}: mapping {i}: {u:?}");
        }
    }
}

/// After `fork`, the pages both sides map count half in each side's
/// `Pss`, and as shared (Linux's numbers once the child has touched them:
/// its page table starts with the parent's PTEs there, empty here).
#[test]
fn pages_shared_by_fork_count_half() {
    for rmap in [vmfault::Rmap::Backing, vmfault::Rmap::PvEntry] {
        shared_by_fork(rmap);
    }
}

fn shared_by_fork(rmap: vmfault::Rmap) {
    let config = vmfault::VmConfig { phys_bytes: 8 << 20, cpus: 1, prefault: false, rmap, ..Default::default() };
    let vm = vmfault::Vm::new(config).unwrap();
    let parent = vm.new_space().unwrap();
    let a = parent.mmap(0, 3 * P, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    parent.write(a, &[1; 3 * 4096]).unwrap();
    let child = parent.fork().unwrap();
    child.read(a, &mut [0; 2 * 4096]).unwrap(); // two of the three pages
    let u = &parent.usage()[0];
    assert_eq!((u.rss, u.pss, u.shared_dirty, u.private_dirty), (3 * P, 2 * P, 2 * P, P), "{rmap:?}: {u:?}");
    child.write(a, &[2]).unwrap(); // its own copy now
    let u = &parent.usage()[0];
    assert_eq!((u.pss, u.shared_dirty, u.private_dirty), (P + P + P / 2, P, 2 * P), "{rmap:?}: {u:?}");
    let c = &child.usage()[0];
    assert_eq!((c.rss, c.pss, c.shared_dirty, c.private_dirty), (2 * P, P + P / 2, P, P), "{rmap:?}: {c:?}");
}
