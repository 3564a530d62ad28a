//! `mremap`: moves that carry pages, growth in place, and the cases where
//! vmfault's page-offset objects need a copy. Its semantics against the
//! host kernel are in the differential test (`TOp::Mremap`).

use vmfault::{MapFlags, MremapFlags, PAGE_SIZE as P, Prot, Vm, VmConfig};

fn vm() -> Vm {
    Vm::new(VmConfig { phys_bytes: 16 << 20, cpus: 2, prefault: false, ..VmConfig::default() }).unwrap()
}

const RW: Prot = Prot::READ.union(Prot::WRITE);
const ANON: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS);

#[test]
fn a_fixed_move_of_several_mappings_keeps_their_gaps() {
    let space = vm().new_space().unwrap();
    let base = 0x1000_0000;
    space.mmap(base, 2 * P, RW, ANON | MapFlags::FIXED).unwrap();
    space.mmap(base + 3 * P, 2 * P, Prot::READ, ANON | MapFlags::FIXED).unwrap();
    space.write(base, b"first").unwrap();
    let to = 0x2000_0000;
    let got = space.mremap(base, 5 * P, 5 * P, MremapFlags::MAYMOVE | MremapFlags::FIXED, to).unwrap();
    assert_eq!(got, to);
    let maps: Vec<_> = space.mappings().iter().map(|m| (m.start, m.end)).collect();
    assert_eq!(maps, vec![(to, to + 2 * P), (to + 3 * P, to + 5 * P)]);
    let mut b = [0u8; 5];
    space.read(to, &mut b).unwrap();
    assert_eq!(&b, b"first");
}

#[test]
fn growing_in_place_keeps_the_address_and_the_data() {
    let space = vm().new_space().unwrap();
    let a = space.mmap(0, 2 * P, RW, ANON).unwrap();
    space.write(a + P, b"tail").unwrap();
    space.munmap(a + 2 * P, 8 * P).ok();
    assert_eq!(space.mremap(a, 2 * P, 6 * P, MremapFlags::empty(), 0).unwrap(), a);
    let mut b = [0u8; 4];
    space.read(a + P, &mut b).unwrap();
    assert_eq!(&b, b"tail");
    space.read(a + 5 * P, &mut b).unwrap();
    assert_eq!(b, [0; 4], "the new pages read as zeros");
    assert_eq!(space.mappings().len(), 1);
}

#[test]
fn a_move_carries_data_and_residency() {
    let space = vm().new_space().unwrap();
    let a = space.mmap(0, 4 * P, RW, ANON).unwrap();
    space.write(a, b"zero").unwrap();
    space.write(a + 2 * P, b"two").unwrap();
    let mut b = [0u8; 1];
    space.read(a + 3 * P, &mut b).unwrap(); // the zero page
    let to = space.mmap(0, 4 * P, Prot::NONE, ANON).unwrap();
    space.munmap(to, 4 * P).unwrap();
    assert_eq!(space.mremap(a, 4 * P, 4 * P, MremapFlags::MAYMOVE | MremapFlags::FIXED, to).unwrap(), to);
    assert_eq!(space.mincore(to, 4 * P).unwrap(), vec![1, 0, 1, 1]);
    let mut b = [0u8; 4];
    space.read(to, &mut b).unwrap();
    assert_eq!(&b, b"zero");
    assert!(space.read(a, &mut b).is_err());
}

/// Part of a mapping moves and grows: its new pages must read as zeros,
/// not as the pages the rest of the mapping holds at the page offsets that
/// follow the moved part's (pages live in their object by page offset).
#[test]
fn a_part_moved_and_grown_does_not_see_the_rest() {
    let space = vm().new_space().unwrap();
    let a = space.mmap(0, 6 * P, RW, ANON).unwrap();
    for i in 0..6u8 {
        space.write(a + u64::from(i) * P, &[i + 1; 8]).unwrap();
    }
    let b = space.mremap(a, 2 * P, 6 * P, MremapFlags::MAYMOVE, 0).unwrap();
    assert_ne!(a, b, "the rest of the mapping is in the way: it moved");
    let mut got = [0u8; 8];
    for i in 0..6u64 {
        space.read(b + i * P, &mut got).unwrap();
        let want = if i < 2 { [i as u8 + 1; 8] } else { [0; 8] };
        assert_eq!(got, want, "page {i} of the moved part");
    }
    // Gone from the old place; the rest is untouched.
    assert!(space.read(a, &mut got).is_err());
    for i in 2..6u64 {
        space.read(a + i * P, &mut got).unwrap();
        assert_eq!(got, [i as u8 + 1; 8], "page {i} of the rest");
    }
    // And the rest grown back over the old place sees zeros there.
    space.mmap(a, 2 * P, RW, ANON | MapFlags::FIXED).unwrap();
    space.read(a, &mut got).unwrap();
    assert_eq!(got, [0; 8]);
}

#[test]
fn a_grown_shared_anonymous_mapping_is_sigbus_beyond_its_size() {
    let space = vm().new_space().unwrap();
    let a = space.mmap(0, 2 * P, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
    space.munmap(a + 2 * P, 4 * P).ok();
    let b = space.mremap(a, 2 * P, 4 * P, MremapFlags::MAYMOVE, 0).unwrap();
    space.write(b + P, b"in").unwrap();
    let e = space.write(b + 2 * P, b"out").unwrap_err();
    assert!(matches!(e, vmfault::Error::Bus { .. }), "{e}");
}

#[test]
fn a_locked_mapping_moves_locked() {
    let vm = vm();
    let space = vm.new_space().unwrap();
    let a = space.mmap(0, 3 * P, RW, ANON | MapFlags::LOCKED).unwrap();
    assert_eq!(vm.stats().wired_pages, 3);
    let to = 0x3000_0000;
    space.mremap(a, 3 * P, 5 * P, MremapFlags::MAYMOVE | MremapFlags::FIXED, to).unwrap();
    assert!(space.mappings()[0].locked);
    assert_eq!(vm.stats().wired_pages, 5, "moved pages wired again, new ones populated");
}

#[test]
fn bad_arguments_are_linux_errors() {
    let space = vm().new_space().unwrap();
    let a = space.mmap(0, 2 * P, RW, ANON).unwrap();
    let e = |r: vmfault::Result<u64>| r.unwrap_err().errno();
    assert_eq!(e(space.mremap(a, P, 2 * P, MremapFlags::from_bits_retain(8), 0)), libc::EINVAL);
    assert_eq!(e(space.mremap(a + 1, P, 2 * P, MremapFlags::MAYMOVE, 0)), libc::EINVAL);
    assert_eq!(e(space.mremap(a, P, 0, MremapFlags::MAYMOVE, 0)), libc::EINVAL);
    assert_eq!(e(space.mremap(a, P, P, MremapFlags::FIXED, 0x4000_0000)), libc::EINVAL, "FIXED without MAYMOVE");
    assert_eq!(
        e(space.mremap(a, 2 * P, 2 * P, MremapFlags::MAYMOVE | MremapFlags::FIXED, a + P)),
        libc::EINVAL,
        "overlap"
    );
    assert_eq!(e(space.mremap(a, 0, P, MremapFlags::MAYMOVE, 0)), libc::EINVAL, "duplicating a private mapping");
    assert_eq!(e(space.mremap(a + 8 * P, P, 2 * P, MremapFlags::MAYMOVE, 0)), libc::EFAULT, "nothing there");
    assert_eq!(e(space.mremap(a, 3 * P, 4 * P, MremapFlags::MAYMOVE, 0)), libc::EFAULT, "past the mapping's end");
    assert_eq!(
        e(space.mremap(a, P, 2 * P, MremapFlags::MAYMOVE | MremapFlags::DONTUNMAP, 0x4000_0000)),
        libc::EINVAL,
        "DONTUNMAP with a new length"
    );
    assert_eq!(e(space.mremap(a, P, P, MremapFlags::DONTUNMAP, 0x4000_0000)), libc::EINVAL, "without MAYMOVE");
    assert_eq!(
        e(space.mremap(a, 3 * P, 3 * P, MremapFlags::MAYMOVE | MremapFlags::DONTUNMAP, 0x4000_0000)),
        libc::EFAULT,
        "DONTUNMAP past the mapping's end"
    );
}

/// `MREMAP_DONTUNMAP`, whole and in part, on private and shared memory,
/// locked or not: the pages move, the old range stays mapped (private:
/// empty, reading zeros; shared: still the same memory) and unlocked,
/// unsplit. Compared with the host kernel, layouts and bytes.
#[test]
fn dontunmap_moves_the_pages_and_leaves_the_old_range_empty_as_on_the_host() {
    const HOST_BASE: u64 = 0x3100_0000_0000;
    let dontunmap = MremapFlags::MAYMOVE | MremapFlags::FIXED | MremapFlags::DONTUNMAP;
    // (shared, locked, moved page range of the 8 pages)
    let cases =
        [(false, false, 0..8), (false, true, 2..5), (false, false, 3..8), (true, false, 0..8), (true, true, 1..3)];
    for (i, (shared, locked, pages)) in cases.into_iter().enumerate() {
        let host = HOST_BASE + i as u64 * (1 << 24);
        let vm = vm();
        let space = vm.new_space().unwrap();
        let base = space.mmap(0, 1 << 24, Prot::NONE, ANON).unwrap();
        space.munmap(base, 1 << 24).unwrap();
        let kind = if shared { MapFlags::SHARED | MapFlags::ANONYMOUS } else { ANON };
        let lock = if locked { MapFlags::LOCKED } else { MapFlags::empty() };
        space.mmap(base, 8 * P, RW, kind | lock | MapFlags::FIXED).unwrap();
        // SAFETY: a fresh mapping at an address nothing else uses (the
        // kernel refuses it otherwise), unmapped at the end of the case.
        let h = unsafe {
            libc::mmap(
                host as *mut libc::c_void,
                8 * P as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                kind.bits() as i32 | lock.bits() as i32 | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(h as u64, host);
        for p in 0..8u8 {
            space.write(base + u64::from(p) * P, &[p + 1; 8]).unwrap();
            // SAFETY: inside the host mapping just made.
            unsafe { std::ptr::write_bytes((host + u64::from(p) * P) as *mut u8, p + 1, 8) };
        }
        let (from, len) = (pages.start * P, (pages.end - pages.start) * P);
        let to = 1 << 23;
        assert_eq!(space.mremap(base + from, len, len, dontunmap, base + to).unwrap(), base + to);
        // SAFETY: moves part of the host mapping to a free address of the
        // same reservation's range.
        let r = unsafe {
            libc::syscall(libc::SYS_mremap, host + from, len, len, dontunmap.bits() as libc::c_long, host + to)
        };
        assert_eq!(r as u64, host + to, "case {i}: the host's mremap");
        let host_maps: Vec<(u64, u64)> = std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(|l| {
                let (s, e) = l.split_once(' ')?.0.split_once('-')?;
                let (s, e) = (u64::from_str_radix(s, 16).ok()?, u64::from_str_radix(e, 16).ok()?);
                (s >= host && e <= host + (1 << 24)).then_some((s - host, e - host))
            })
            .collect();
        let locked_here: Vec<bool> = vmfault_locked(&space, base);
        let maps: Vec<(u64, u64)> = space.mappings().iter().map(|m| (m.start - base, m.end - base)).collect();
        assert_eq!(maps, host_maps, "case {i}: layouts");
        assert_eq!(locked_here, host_locked(host), "case {i}: which mappings are locked");
        for p in 0..8u64 {
            let mut b = [0u8; 8];
            space.read(base + p * P, &mut b).unwrap();
            // SAFETY: the old range stays mapped on the host too.
            let want = unsafe { std::ptr::read((host + p * P) as *const [u8; 8]) };
            assert_eq!(b, want, "case {i}: old page {p}");
        }
        for p in 0..(pages.end - pages.start) {
            let mut b = [0u8; 8];
            space.read(base + to + p * P, &mut b).unwrap();
            assert_eq!(b, [(pages.start + p) as u8 + 1; 8], "case {i}: moved page {p}");
        }
        if locked {
            assert_eq!(vm.stats().wired_pages, pages.end - pages.start, "case {i}: only the moved pages stay wired");
        }
        // SAFETY: the host mappings this case made.
        unsafe {
            libc::munmap(host as *mut libc::c_void, 8 * P as usize);
            libc::munmap((host + to) as *mut libc::c_void, len as usize);
        }
    }
}

/// Which of the space's mappings from `base` on are locked, in order.
fn vmfault_locked(space: &vmfault::AddressSpace, base: u64) -> Vec<bool> {
    space.mappings().iter().filter(|m| m.start >= base).map(|m| m.locked).collect()
}

/// Which of the host's mappings in the 16 MiB from `host` on are locked
/// (`lo` in smaps' `VmFlags`), in order.
fn host_locked(host: u64) -> Vec<bool> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut out = Vec::new();
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((range, _)) = line.split_once(' ')
            && let Some((s, e)) = range.split_once('-')
            && let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16))
        {
            inside = s >= host && e <= host + (1 << 24);
        } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
            out.push(flags.split_whitespace().any(|f| f == "lo"));
        }
    }
    out
}

/// Part of a private file mapping moves: it keeps its private copy, the
/// rest keeps its own, and unmapping the rest frees nothing the moved part
/// maps.
#[test]
fn a_part_of_a_private_file_mapping_moves_with_its_copies() {
    let dir = std::env::temp_dir().join(format!("vmfault-mremap-{}", std::process::id()));
    std::fs::write(&dir, vec![b'f'; 4 * 4096]).unwrap();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&dir).unwrap();
    let space = vm().new_space().unwrap();
    let v = space.mmap_file(0, 4 * P, RW, MapFlags::PRIVATE, &file, 0).unwrap();
    space.write(v + 2 * P, b"priv").unwrap();
    let to = space.mremap(v, P, 4 * P, MremapFlags::MAYMOVE, 0).unwrap();
    let mut b = [0u8; 4];
    space.read(to + 2 * P, &mut b).unwrap();
    assert_eq!(&b, b"ffff", "the moved part's offset 2 is the file's page, not the rest's copy");
    space.read(v + 2 * P, &mut b).unwrap();
    assert_eq!(&b, b"priv");
    space.munmap(v + P, 3 * P).unwrap();
    space.read(to + 2 * P, &mut b).unwrap();
    assert_eq!(&b, b"ffff");
    std::fs::remove_file(&dir).unwrap();
}

/// In a fork child, a mapping grown over offsets its neighbour had before
/// the fork shows zeros there, not the neighbour's old pages.
#[test]
fn growing_after_fork_does_not_show_a_former_neighbour() {
    let vm = vm();
    let parent = vm.new_space().unwrap();
    let a = parent.mmap(0, 4 * P, RW, ANON).unwrap();
    parent.write(a + 2 * P, b"secret").unwrap();
    parent.mprotect(a + 2 * P, 2 * P, Prot::READ).unwrap();
    let child = parent.fork().unwrap();
    child.munmap(a + 2 * P, 2 * P).unwrap();
    assert_eq!(child.mremap(a, 2 * P, 4 * P, MremapFlags::empty(), 0).unwrap(), a);
    let mut b = [0u8; 6];
    child.read(a + 2 * P, &mut b).unwrap();
    assert_eq!(b, [0; 6]);
    // The same through a move.
    let c2 = parent.fork().unwrap();
    c2.munmap(a + 2 * P, 2 * P).unwrap();
    let to = c2.mremap(a, 2 * P, 4 * P, MremapFlags::MAYMOVE | MremapFlags::FIXED, 0x5000_0000).unwrap();
    c2.read(to + 2 * P, &mut b).unwrap();
    assert_eq!(b, [0; 6]);
}

/// Memory over-committed to swap: a part of a mapping moves (by copy),
/// its pages in swap with it.
#[test]
fn pages_in_swap_move_by_copy_too() {
    let path = std::env::temp_dir().join(format!("vmfault-mremap-swap-{}", std::process::id()));
    let config = VmConfig {
        phys_bytes: 256 * P,
        swap_bytes: 1024 * P,
        cpus: 2,
        prefault: false,
        swap: Some(path),
        ..VmConfig::default()
    };
    let vm = Vm::new(config).unwrap();
    let space = vm.new_space().unwrap();
    let n = 600;
    let a = space.mmap(0, n * P, RW, ANON).unwrap();
    for i in 0..n {
        space.write(a + i * P, &(i as u32).to_le_bytes()).unwrap();
    }
    assert!(vm.stats().pageouts > 0, "paged out");
    let to = 0x6000_0000;
    assert_eq!(space.mremap(a, n / 2 * P, n / 2 * P, MremapFlags::MAYMOVE | MremapFlags::FIXED, to).unwrap(), to);
    let mut b = [0u8; 4];
    for i in 0..n {
        let at = if i < n / 2 { to + i * P } else { a + i * P };
        space.read(at, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), i as u32, "page {i}");
    }
}

#[test]
fn a_shrink_past_the_address_space_is_einval() {
    let space = vm().new_space().unwrap();
    let a = space.mmap(0, 2 * P, RW, ANON).unwrap();
    let e = space.mremap(a, 1 << 46, P, MremapFlags::empty(), 0).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert_eq!(space.mappings().len(), 1, "nothing unmapped");
}

/// A several-mapping move of pieces that share an object (one mapping
/// split by `mprotect`) gives the pieces one new object: once their
/// protections agree again they merge, as Linux's pieces (one anon_vma)
/// do.
#[test]
fn pieces_moved_together_merge_again() {
    let space = vm().new_space().unwrap();
    let a = space.mmap(0, 0x28 * P, RW, ANON).unwrap();
    space.write(a + 0x10 * P, b"x").unwrap();
    space.mprotect(a + 0x14 * P, 7 * P, Prot::READ).unwrap();
    let to = 0x7000_0000;
    space.mremap(a + 0x10 * P, 7 * P, 7 * P, MremapFlags::MAYMOVE | MremapFlags::FIXED, to).unwrap();
    space.mprotect(to + 4 * P, 3 * P, RW).unwrap();
    let moved: Vec<_> = space
        .mappings()
        .into_iter()
        .filter(|m| (to..to + 0x100 * P).contains(&m.start))
        .map(|m| (m.start, m.end))
        .collect();
    assert_eq!(moved, vec![(to, to + 7 * P)]);
    let mut b = [0u8; 1];
    space.read(to, &mut b).unwrap();
    assert_eq!(&b, b"x");
}

/// Pieces of one mapping moved apart by copy in separate calls come back
/// side by side with contiguous offsets: they merge, as Linux's do (its
/// moved VMAs keep their anon_vma; here the pieces go to one object of
/// the mapping's family). The layout is the host kernel's for the same
/// calls (Linux 6.18; the differential test found it).
#[test]
fn pieces_moved_apart_by_separate_calls_merge_when_they_meet_again() {
    let space = vm().new_space().unwrap();
    let base = 0x4000_0000;
    space.mmap(base + 0x22000, 14 * P, RW, ANON | MapFlags::FIXED).unwrap();
    space.write(base + 0x2f550, &[1]).unwrap();
    let fixed = MremapFlags::MAYMOVE | MremapFlags::FIXED;
    // A part grows as it moves below the rest, then the rest follows it.
    assert_eq!(space.mremap(base + 0x27000, 4 * P, 5 * P, fixed, base + 0x1e000).unwrap(), base + 0x1e000);
    assert_eq!(space.mremap(base + 0x20000, 8 * P, 8 * P, fixed, base + 0x17000).unwrap(), base + 0x17000);
    let maps: Vec<_> = space.mappings().iter().map(|m| (m.start - base, m.end - base)).collect();
    assert_eq!(maps, vec![(0x17000, 0x1a000), (0x1a000, 0x20000), (0x2b000, 0x30000)]);
    let mut b = [0u8];
    space.read(base + 0x2f550, &mut b).unwrap();
    assert_eq!(b, [1]);
}

/// `MREMAP_DONTUNMAP` of a whole private file mapping: its private copies
/// move, and the old range maps the file again (Linux 6.18, checked by
/// hand: the old range reads the file, the new one the copy).
#[test]
fn dontunmap_of_a_private_file_mapping_leaves_the_file_mapped() {
    use std::io::Write;
    let path = std::env::temp_dir().join(format!("vmfault-test-dontunmap-{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f.write_all(&[b'A'; P as usize]).unwrap();
    f.write_all(&[b'B'; P as usize]).unwrap();
    let vm = vm();
    let space = vm.new_space().unwrap();
    let a = space.mmap_file(0, 2 * P, RW, MapFlags::PRIVATE, &f, 0).unwrap();
    space.write(a, b"xx").unwrap();
    let to = 0x5000_0000;
    let flags = MremapFlags::MAYMOVE | MremapFlags::FIXED | MremapFlags::DONTUNMAP;
    assert_eq!(space.mremap(a, 2 * P, 2 * P, flags, to).unwrap(), to);
    let read = |at: u64| {
        let mut b = [0u8; 2];
        space.read(at, &mut b).unwrap();
        b
    };
    assert_eq!((read(a), read(a + P), read(to), read(to + P)), (*b"AA", *b"BB", *b"xx", *b"BB"));
    // A part moved too: the rest of the old mapping keeps its copies.
    space.write(to + P, b"yy").unwrap();
    let back = 0x6000_0000;
    assert_eq!(space.mremap(to + P, P, P, flags, back).unwrap(), back);
    assert_eq!((read(to), read(to + P), read(back)), (*b"xx", *b"BB", *b"yy"));
}
