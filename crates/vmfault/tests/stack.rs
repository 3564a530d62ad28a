//! Stacks that grow down (`MAP_GROWSDOWN`): growth on a fault below them,
//! its guard gap and size limit, placement and `brk` kept out of the gap,
//! `mprotect(PROT_GROWSDOWN)`, fork and concurrent growth. Where the host
//! can show the same safely (a growth through `/proc/self/mem`, which grows
//! stacks as a fault does; `mprotect`; `mmap`'s errors), it is compared
//! with the host kernel. Random sequences against the host are in the
//! differential test (`stack_differential_against_host_kernel`).

mod common;

use std::sync::Arc;

use common::FAULT_PATHS;
use vmfault::{
    AddressSpace, Error, HEAP_START, MapFlags, MapLock, PAGE_SIZE as P, Prot, STACK_GUARD_GAP, STACK_LIMIT, SegvCode,
    Vm, VmConfig,
};

const RW: Prot = Prot::READ.union(Prot::WRITE);
const STACK: MapFlags = MapFlags::PRIVATE.union(MapFlags::ANONYMOUS).union(MapFlags::GROWSDOWN);
const PROT_GROWSDOWN: u32 = 0x0100_0000;

/// Where the host's reservation for these tests lies (far below where
/// the host places other threads' mappings), and its size.
const HOST_BASE: u64 = 0x3000_0000_0000;
const HOST_LEN: u64 = 32 << 20;

fn vm(cpus: usize) -> Vm {
    Vm::new(VmConfig { phys_bytes: 32 << 20, cpus, prefault: false, ..VmConfig::default() }).unwrap()
}

/// The mappings of `space` in `base..base+len`, relative to `base`.
fn layout(space: &AddressSpace, base: u64, len: u64) -> Vec<(u64, u64, Prot)> {
    space
        .mappings()
        .into_iter()
        .filter(|m| m.start < base + len && m.end > base)
        .map(|m| (m.start - base, m.end - base, m.prot))
        .collect()
}

/// The host's mappings in `base..base+len`, relative to `base`.
fn host_layout(base: u64, len: u64) -> Vec<(u64, u64, Prot)> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            let (s, e) = range.split_once('-')?;
            let (s, e) = (u64::from_str_radix(s, 16).ok()?, u64::from_str_radix(e, 16).ok()?);
            let b = perms.as_bytes();
            let mut prot = Prot::empty();
            prot.set(Prot::READ, b[0] == b'r');
            prot.set(Prot::WRITE, b[1] == b'w');
            prot.set(Prot::EXEC, b[2] == b'x');
            (s < base + len && e > base).then(|| (s - base, e - base, prot))
        })
        .collect()
}

/// A host region of its own for one scenario: `HOST_LEN` bytes reserved
/// `PROT_NONE` at a fixed address, unmapped when dropped.
struct HostRegion(u64);

impl HostRegion {
    fn new(slot: u64) -> HostRegion {
        let base = HOST_BASE + slot * HOST_LEN;
        // SAFETY: a fresh reservation at an address nothing else uses
        // (`MAP_FIXED_NOREPLACE` fails otherwise).
        let p = unsafe {
            libc::mmap(
                base as *mut libc::c_void,
                HOST_LEN as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(p as u64, base, "reserving {base:#x} on the host");
        HostRegion(base)
    }

    /// `mmap` with `MAP_FIXED` at `off`; true on success.
    fn map(&self, off: u64, len: u64, prot: i32, flags: i32) -> bool {
        // SAFETY: inside this region, which only this test uses.
        let p = unsafe {
            libc::mmap((self.0 + off) as *mut libc::c_void, len as usize, prot, flags | libc::MAP_FIXED, -1, 0)
        };
        p != libc::MAP_FAILED
    }

    fn unmap(&self, off: u64, len: u64) {
        // SAFETY: inside this region.
        assert_eq!(unsafe { libc::munmap((self.0 + off) as *mut libc::c_void, len as usize) }, 0);
    }

    /// A debugger's load of the byte at `off` (`/proc/self/mem`, which
    /// grows a stack below it as a fault would): whether it could be read.
    fn load(&self, off: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let mem = std::fs::File::open("/proc/self/mem").unwrap();
        mem.read_at(&mut [0u8], self.0 + off).is_ok()
    }

    fn mprotect(&self, off: u64, len: u64, prot: u32) -> i32 {
        // SAFETY: inside this region.
        let r = unsafe { libc::mprotect((self.0 + off) as *mut libc::c_void, len as usize, prot as i32) };
        if r == 0 { 0 } else { std::io::Error::last_os_error().raw_os_error().unwrap() }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: the region is this test's.
        unsafe { libc::munmap(self.0 as *mut libc::c_void, HOST_LEN as usize) };
    }
}

/// The host's `RLIMIT_STACK`, if it is finite.
fn host_stack_limit() -> Option<u64> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: a plain query.
    (unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut r) } == 0 && r.rlim_cur != libc::RLIM_INFINITY)
        .then_some(r.rlim_cur)
}

/// What lies below the stack in a scenario.
#[derive(Debug, Clone, Copy)]
enum Below {
    Nothing,
    /// A mapping of 4 pages ending `gap` bytes below the stack, with this
    /// protection (and `MAP_GROWSDOWN` if `grows`).
    Mapping {
        gap: u64,
        prot: Prot,
        grows: bool,
    },
}

/// A 4-page stack at 16 MiB into a free 32 MiB region, `below` under it,
/// and a load `depth` bytes below the stack's start: whether it grew, and
/// the layout after, in vmfault and on the host (same answers expected).
fn scenario(slot: u64, below: Below, depth: u64) {
    let top = 16 << 20;
    let host = HostRegion::new(slot);
    host.unmap(0, HOST_LEN);
    let vm = vm(1);
    let space = vm.new_space().unwrap();
    let base = space.mmap(0, HOST_LEN, Prot::empty(), MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    space.munmap(base, HOST_LEN).unwrap();
    assert!(host.map(
        top,
        4 * P,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_GROWSDOWN
    ));
    space.mmap(base + top, 4 * P, RW, STACK | MapFlags::FIXED).unwrap();
    if let Below::Mapping { gap, prot, grows } = below {
        let off = top - gap - 4 * P;
        let extra = if grows { MapFlags::GROWSDOWN } else { MapFlags::empty() };
        space.mmap(base + off, 4 * P, prot, MapFlags::PRIVATE | MapFlags::ANONYMOUS | MapFlags::FIXED | extra).unwrap();
        let hf = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if grows { libc::MAP_GROWSDOWN } else { 0 };
        assert!(host.map(off, 4 * P, prot.bits() as i32, hf));
    }
    let at = top - depth;
    let mut b = [1u8];
    let got = space.read(base + at, &mut b);
    let host_grew = host.load(at);
    let what = format!("{below:?}, {depth:#x} below");
    assert_eq!(got.is_ok(), host_grew, "{what}: vmfault {got:?}");
    if let Err(e) = got {
        assert!(matches!(e, Error::Segv { code: SegvCode::MapErr, .. }), "{what}: {e}");
    } else {
        assert_eq!(b, [0], "{what}: a grown page reads as zeros");
        assert_eq!(vm.stats().stack_growths, 1, "{what}");
    }
    assert_eq!(layout(&space, base, HOST_LEN), host_layout(host.0, HOST_LEN), "{what}");
}

#[test]
fn a_stack_grows_to_a_load_below_it_as_on_the_host() {
    scenario(0, Below::Nothing, P);
    scenario(1, Below::Nothing, 100 * P + 123);
}

#[test]
fn a_stack_grows_up_to_the_stack_limit() {
    // The stack has 4 pages: 4 + 2044 pages make 8 MiB.
    let pages = STACK_LIMIT / P - 4;
    if host_stack_limit() == Some(STACK_LIMIT) {
        scenario(2, Below::Nothing, pages * P);
        scenario(3, Below::Nothing, (pages + 1) * P);
    } else {
        // The host's limit is not Linux's default: vmfault's own answers.
        let vm = vm(1);
        let space = vm.new_space().unwrap();
        let top = space.mmap(0, 4 * P, RW, STACK).unwrap();
        assert!(space.read(top - (pages + 1) * P, &mut [0]).is_err());
        space.read(top - pages * P, &mut [0]).unwrap();
        assert_eq!(space.mappings()[0].end - space.mappings()[0].start, STACK_LIMIT);
    }
}

#[test]
fn the_guard_gap_keeps_a_stack_from_growing_near_an_accessible_mapping() {
    let gap = STACK_GUARD_GAP;
    let mapping = |gap, prot, grows| Below::Mapping { gap, prot, grows };
    // 300 pages apart: growing 44 pages leaves exactly the gap, 45 do not.
    scenario(4, mapping(300 * P, RW, false), 44 * P);
    scenario(5, mapping(300 * P, RW, false), 45 * P);
    scenario(6, mapping(300 * P, Prot::READ, false), 45 * P);
    // No gap against an inaccessible mapping, nor against another stack.
    scenario(7, mapping(10 * P, Prot::empty(), false), 10 * P);
    scenario(8, mapping(10 * P, RW, true), 10 * P);
    scenario(9, mapping(gap, RW, false), P);
}

#[test]
fn a_growing_stack_is_private_anonymous_memory() {
    let space = vm(1).new_space().unwrap();
    let f = tempfile();
    for (flags, file) in
        [(MapFlags::SHARED | MapFlags::ANONYMOUS, false), (MapFlags::PRIVATE, true), (MapFlags::SHARED, true)]
    {
        let flags = flags | MapFlags::GROWSDOWN;
        let e = if file { space.mmap_file(0, 4 * P, RW, flags, &f, 0) } else { space.mmap(0, 4 * P, RW, flags) }
            .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{flags:?}: {e}");
        let fd = if file { std::os::fd::AsRawFd::as_raw_fd(&f) } else { -1 };
        // SAFETY: a mapping the host refuses (or unmapped at once).
        let p = unsafe { libc::mmap(std::ptr::null_mut(), 4 * P as usize, 3, flags.bits() as i32, fd, 0) };
        assert_eq!(p, libc::MAP_FAILED, "{flags:?} on the host");
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EINVAL), "{flags:?} on the host");
    }
}

fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!("vmfault-test-stack-{}", std::process::id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f.set_len(4 * P).unwrap();
    f
}

#[test]
fn mprotect_with_prot_growsdown_goes_down_to_the_stack_start_as_on_the_host() {
    let host = HostRegion::new(10);
    host.unmap(0, HOST_LEN);
    let vm = vm(1);
    let space = vm.new_space().unwrap();
    let base = space.mmap(0, HOST_LEN, Prot::empty(), MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    space.munmap(base, HOST_LEN).unwrap();
    let (stack, plain) = (64 * P, 32 * P);
    assert!(host.map(stack, 8 * P, 3, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_GROWSDOWN));
    assert!(host.map(plain, 8 * P, 3, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS));
    space.mmap(base + stack, 8 * P, RW, STACK | MapFlags::FIXED).unwrap();
    space.mmap(base + plain, 8 * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS | MapFlags::FIXED).unwrap();
    let cases = [
        (stack + 4 * P, 2 * P, libc::PROT_READ as u32 | PROT_GROWSDOWN),
        (stack - 4 * P, 6 * P, libc::PROT_READ as u32 | PROT_GROWSDOWN),
        (plain + P, P, libc::PROT_READ as u32 | PROT_GROWSDOWN),
        (plain + 16 * P, P, libc::PROT_READ as u32 | PROT_GROWSDOWN),
        (stack + P, P, (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u32 | PROT_GROWSDOWN),
    ];
    for (off, len, prot) in cases {
        let want = host.mprotect(off, len, prot);
        let got = space.mprotect(base + off, len, Prot::from_bits_retain(prot)).map_or_else(|e| e.errno(), |()| 0);
        assert_eq!(got, want, "mprotect({off:#x}, {len:#x}, {prot:#x})");
        assert_eq!(layout(&space, base, HOST_LEN), host_layout(host.0, HOST_LEN), "after {off:#x}");
    }
}

#[test]
fn placement_keeps_the_guard_gap_below_a_stack() {
    let space = vm(1).new_space().unwrap();
    // Linux's first unhinted address, then a stack there.
    let top = space.mmap(0, 4 * P, RW, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
    space.munmap(top, 4 * P).unwrap();
    space.mmap(top, 4 * P, RW, STACK | MapFlags::FIXED).unwrap();
    let anon = MapFlags::PRIVATE | MapFlags::ANONYMOUS;
    // Unhinted: below the gap, not right below the stack.
    assert_eq!(space.mmap(0, P, RW, anon).unwrap(), top - STACK_GUARD_GAP - P);
    // A hint inside the gap is not taken; one that ends at its bottom is.
    let inside = space.mmap(top - 8 * P, 4 * P, RW, MapFlags::SHARED | MapFlags::ANONYMOUS).unwrap();
    assert_ne!(inside, top - 8 * P);
    space.munmap(inside, 4 * P).unwrap();
    let below = top - STACK_GUARD_GAP - 8 * P;
    space.munmap(top - STACK_GUARD_GAP - P, P).unwrap();
    assert_eq!(space.mmap(below, 8 * P, RW, anon).unwrap(), below);
    // MAP_FIXED ignores the gap.
    assert_eq!(space.mmap(top - P, P, RW, anon | MapFlags::FIXED).unwrap(), top - P);
}

#[test]
fn brk_keeps_the_guard_gap_below_a_stack() {
    let space = vm(1).new_space().unwrap();
    let stack = HEAP_START + 300 * P;
    space.mmap(stack, 4 * P, RW, STACK | MapFlags::FIXED).unwrap();
    // The heap may end a page short of the gap's bottom, not nearer.
    let limit = stack - STACK_GUARD_GAP - P;
    assert_eq!(space.brk(limit + P), HEAP_START, "refused");
    assert_eq!(space.brk(limit), limit);
}

#[test]
fn a_stack_grows_under_every_fault_path_and_from_several_vcpus_at_once() {
    const THREADS: u64 = 4;
    for path in FAULT_PATHS {
        for map_lock in [MapLock::Global, MapLock::Zoned] {
            let vm = Vm::new(VmConfig {
                phys_bytes: 32 << 20,
                cpus: THREADS as usize,
                prefault: false,
                fault_path: path,
                map_lock,
                ..VmConfig::default()
            })
            .unwrap();
            let space = Arc::new(vm.new_space().unwrap());
            for round in 0..20u64 {
                let top = space.mmap(0, P, RW, STACK).unwrap();
                let threads: Vec<_> = (0..THREADS)
                    .map(|t| {
                        let (vm, space) = (vm.clone(), space.clone());
                        std::thread::spawn(move || {
                            let _cpu = vm.attach().unwrap();
                            let at = top - (t + 1) * 8 * P + t;
                            let r = space.write(at, &[t as u8 + 1]);
                            r.unwrap_or_else(|e| panic!("{path:?} {map_lock:?} round {round}, thread {t}: {e}"));
                        })
                    })
                    .collect();
                threads.into_iter().for_each(|t| t.join().unwrap());
                let m = space.mappings().into_iter().find(|m| m.end == top + P).unwrap();
                assert_eq!(m.start, top - THREADS * 8 * P, "{path:?} {map_lock:?} round {round}");
                for t in 0..THREADS {
                    let mut b = [0u8];
                    space.read(top - (t + 1) * 8 * P + t, &mut b).unwrap();
                    assert_eq!(b, [t as u8 + 1], "{path:?} {map_lock:?} round {round}: thread {t}'s store");
                }
                space.munmap(m.start, m.end - m.start).unwrap();
            }
        }
    }
}

#[test]
fn a_forked_stack_grows_on_its_own_side_only() {
    let vm = vm(1);
    let parent = vm.new_space().unwrap();
    let top = parent.mmap(0, 2 * P, RW, STACK).unwrap();
    parent.write(top - P, b"parent").unwrap();
    let child = parent.fork().unwrap();
    child.write(top - 4 * P, b"child").unwrap();
    let start = |s: &AddressSpace| s.mappings().iter().find(|m| m.end == top + 2 * P).unwrap().start;
    assert_eq!((start(&parent), start(&child)), (top - P, top - 4 * P));
    let mut b = [0u8; 6];
    child.read(top - P, &mut b).unwrap();
    assert_eq!(&b, b"parent");
    // The parent grows over the child's page: zeros, not the child's bytes.
    let mut c = [9u8; 5];
    parent.read(top - 4 * P, &mut c).unwrap();
    assert_eq!(c, [0; 5]);
    // A debugger's load grows a stack too, as /proc/PID/mem does; a page
    // hold (get_user_pages) does not.
    parent.read_remote(top - 6 * P, &mut c, true).unwrap();
    assert_eq!(start(&parent), top - 6 * P);
    assert!(parent.hold(top - 7 * P, vmfault::Access::Read).is_err());
    assert_eq!(start(&parent), top - 6 * P);
}
