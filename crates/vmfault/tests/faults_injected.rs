//! Fault injection: the host failing under vmfault. Swap reads that fail,
//! file write-back onto a full filesystem, a mapped file truncated or
//! grown underneath. Each gives a clear error (or SIGBUS where Linux gives
//! one), and nothing that was acknowledged (a returned store, a completed
//! `msync`) is lost.

mod common;

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use common::FAULT_PATHS;
use common::files::SmallFs;
use vmfault::{Error, FaultPath, MapFlags, Prot, Vm, VmConfig};

const P: u64 = 4096;
const RW: Prot = Prot::READ.union(Prot::WRITE);

fn pattern(tag: u64, page: u64) -> Vec<u8> {
    (0..P / 8).flat_map(|w| ((tag << 48) ^ (page << 20) ^ w ^ 0x0101_0101_0101_0101).to_le_bytes()).collect()
}

/// A swap read that fails is SIGBUS for the access that needed the page
/// (Linux's `do_swap_page` on an I/O error), with the page still in swap:
/// the next access reads it back intact. Nothing leaks.
#[test]
fn a_failed_swap_read_is_sigbus_and_the_page_stays() {
    for path in FAULT_PATHS {
        let swap =
            std::env::temp_dir().join(format!("vmfault-test-inject-{}-{}.swap", std::process::id(), path.name()));
        let vm = Vm::new(VmConfig {
            phys_bytes: 64 * P,
            cpus: 2,
            prefault: false,
            fault_path: path,
            swap: Some(swap),
            ..VmConfig::default()
        })
        .unwrap();
        let free = vm.stats().free_pages;
        let space = vm.new_space().unwrap();
        let _cpu = vm.attach().unwrap();
        let a = space.mmap(0, 128 * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        for p in 0..128 {
            space.write(a + p * P, &pattern(1, p)).unwrap();
        }
        assert!(vm.stats().pageouts > 0);
        // Page 0 was written first: paged out by now.
        vm.fail_swap_reads(1);
        let mut buf = vec![0u8; P as usize];
        let e = space.read(a, &mut buf).unwrap_err();
        assert!(matches!(e, Error::PageIo { addr, errno: libc::EIO } if addr == a), "{path:?}: {e}");
        assert_eq!(e.errno(), libc::EFAULT);
        assert!(vm.stats().sigbus >= 1);
        for p in 0..128 {
            space.read(a + p * P, &mut buf).unwrap();
            assert!(buf == pattern(1, p), "{path:?}: page {p} lost its contents after a failed read");
        }
        space.munmap(a, 128 * P).unwrap();
        drop(space);
        let deadline = Instant::now() + Duration::from_secs(10);
        while (vm.stats().free_pages, vm.stats().swap_used_pages) != (free, 0) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((vm.stats().free_pages, vm.stats().swap_used_pages), (free, 0), "{path:?}: leaked");
    }
}

/// Write-back onto a full filesystem: `msync` fails with `ENOSPC`, the
/// pages it could not write stay dirty in the cache, and once there is
/// room again an `msync` writes every byte. `munmap` of the mapping
/// succeeds (as on Linux) and loses nothing either: the page cache keeps
/// the dirty pages until they can be written.
#[test]
fn write_back_onto_a_full_filesystem_loses_nothing() {
    for path in [FaultPath::Speculative, FaultPath::MapLock] {
        let fs = SmallFs::mount("256k");
        let name = fs.0.join("data");
        // A sparse file of 128 pages (512 KiB) on a 256 KiB filesystem.
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&name).unwrap();
        f.set_len(128 * P).unwrap();
        let vm = common::test_vm(4 << 20, 2, path);
        let space = vm.new_space().unwrap();
        let a = space.mmap_file(0, 128 * P, RW, MapFlags::SHARED, &f, 0).unwrap();
        for p in 0..128 {
            space.write(a + p * P, &pattern(2, p)).unwrap();
        }
        let e = space.msync(a, 128 * P).unwrap_err();
        assert_eq!(e.errno(), libc::ENOSPC, "{path:?}: {e}");
        // The stores are still there, and still dirty.
        let mut buf = vec![0u8; P as usize];
        for p in 0..128 {
            space.read(a + p * P, &mut buf).unwrap();
            assert!(buf == pattern(2, p), "{path:?}: page {p} changed after a failed msync");
        }
        let errors = vm.stats().file_write_errors;
        space.munmap(a, 128 * P).unwrap();
        // munmap's write-back failed too: counted (and traced), not returned.
        assert_eq!(vm.stats().file_write_errors, errors + 1, "{path:?}");
        fs.resize("1m");
        // Mapped again, the page cache still has the dirty pages.
        let a = space.mmap_file(0, 128 * P, RW, MapFlags::SHARED, &f, 0).unwrap();
        space.msync(a, 128 * P).unwrap();
        for p in 0..128 {
            f.read_exact_at(&mut buf, p * P).unwrap();
            assert!(buf == pattern(2, p), "{path:?}: page {p} of the file after msync");
        }
        drop(space);
        vm.drop_caches();
        drop(vm);
    }
}

/// A mapped file truncated underneath: pages past the new end that are
/// not cached are SIGBUS (as on Linux), cached ones keep what was stored
/// (vmfault does not follow the truncation; a documented difference),
/// and write-back never writes past the new end. Grown underneath: the
/// new pages read what the file holds.
#[test]
fn a_mapped_file_truncated_or_grown_underneath() {
    for path in FAULT_PATHS {
        let dir = std::env::temp_dir();
        let name = dir.join(format!("vmfault-test-trunc-{}-{}", std::process::id(), path.name()));
        let contents: Vec<u8> = (0..8).flat_map(|p| pattern(3, p)).collect();
        std::fs::write(&name, &contents).unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&name).unwrap();
        let vm = common::test_vm(4 << 20, 2, path);
        let space = vm.new_space().unwrap();
        let a = space.mmap_file(0, 16 * P, RW, MapFlags::SHARED, &f, 0).unwrap();
        let mut buf = vec![0u8; P as usize];
        // Pages 0..2 cached, then the file shrinks to 4 pages.
        for p in 0..2 {
            space.write(a + p * P, &pattern(4, p)).unwrap();
        }
        f.set_len(4 * P).unwrap();
        for p in 4..8 {
            let e = space.read(a + p * P, &mut buf).unwrap_err();
            assert!(matches!(e, Error::Bus { .. }), "{path:?}: page {p} past the new end: {e}");
        }
        space.read(a + 3 * P, &mut buf).unwrap();
        assert!(buf == pattern(3, 3), "{path:?}");
        space.msync(a, 16 * P).unwrap();
        assert_eq!(std::fs::metadata(&name).unwrap().len(), 4 * P, "{path:?}: write-back grew the file");
        // Grown again: the new pages read the file.
        f.write_all_at(&pattern(5, 9), 9 * P).unwrap();
        space.read(a + 9 * P, &mut buf).unwrap();
        assert!(buf == pattern(5, 9), "{path:?}: a page the file grew into");
        space.read(a + 8 * P, &mut buf).unwrap();
        assert!(buf.iter().all(|&b| b == 0), "{path:?}: the hole the file grew over reads zeros");
        drop(space);
        vm.drop_caches();
        let disk = std::fs::read(&name).unwrap();
        for p in 0..2 {
            assert!(disk[(p * P) as usize..((p + 1) * P) as usize] == pattern(4, p), "{path:?}: page {p}");
        }
        std::fs::remove_file(&name).unwrap();
    }
}
