//! Differential testing against the host kernel, shared by the test
//! suite (`crates/vmfault/tests/differential.rs`) and `vmfault check`:
//! random sequences of memory operations (`ops`) run with real system
//! calls in a forked child of the host kernel (`host`) and on vmfault in
//! each configuration; every result (addresses relative to a window,
//! errnos, bytes read, SIGSEGV address and code), the window's layout
//! after every operation, and the files' contents at the end must agree.

mod filepages;
pub mod host;
pub mod ops;

use filepages::FilePages;
use ops::*;
use vmfault::{AddressSpace, FaultPath, MapLock, Rmap, Vm, VmConfig};

/// Every fault path: the suites run in all of them.
pub const FAULT_PATHS: [FaultPath; 3] = [FaultPath::MapLock, FaultPath::Speculative, FaultPath::VmaLock];

/// One configuration a sequence runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// The fault path.
    pub path: FaultPath,
    /// The reverse map.
    pub rmap: Rmap,
    /// A machine so small (80 frames) that the page daemon pages out to
    /// swap (anonymous pages) and evicts file pages.
    pub swap: bool,
    /// How the map lock is split.
    pub map_lock: MapLock,
    /// Loads and stores natively through a host view of the window
    /// (`ops::run_vmfault_in`), not through the API.
    pub view: bool,
}

impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fault_path={} rmap={} swap={} map_lock={}{}",
            self.path.name(),
            self.rmap.name(),
            self.swap,
            self.map_lock.name(),
            if self.view { " access=native" } else { "" }
        )
    }
}

/// The default map lock, and the other one.
fn map_locks() -> (MapLock, MapLock) {
    let d = VmConfig::default().map_lock;
    (d, if d == MapLock::Zoned { MapLock::Global } else { MapLock::Zoned })
}

/// The configurations of the test suite: every fault path with backing
/// records, the pv-entry reverse map on the speculative one (its
/// bookkeeping runs on every fault and zap), the small machine with swap
/// on the speculative one, all with the default map lock; the other
/// map lock on the speculative one; and loads and stores through a host
/// view on the speculative one.
pub fn all_configs() -> Vec<Config> {
    let (map_lock, other) = map_locks();
    let mut v: Vec<Config> = FAULT_PATHS
        .iter()
        .map(|&path| Config { path, rmap: Rmap::Backing, swap: false, map_lock, view: false })
        .collect();
    v.push(Config { path: FaultPath::Speculative, rmap: Rmap::PvEntry, swap: false, map_lock, view: false });
    v.push(Config { path: FaultPath::Speculative, rmap: Rmap::Backing, swap: true, map_lock, view: false });
    v.push(Config { path: FaultPath::Speculative, rmap: Rmap::Backing, swap: false, map_lock: other, view: false });
    v.push(Config { path: FaultPath::Speculative, rmap: Rmap::Backing, swap: false, map_lock, view: true });
    v
}

/// The configurations for one fault path: with backing records, with
/// swap, and (speculative only) with pv entries and with the other map lock.
pub fn configs_for(path: FaultPath) -> Vec<Config> {
    let (map_lock, other) = map_locks();
    let mut v = vec![
        Config { path, rmap: Rmap::Backing, swap: false, map_lock, view: false },
        Config { path, rmap: Rmap::Backing, swap: true, map_lock, view: false },
    ];
    if path == FaultPath::Speculative {
        v.push(Config { path, rmap: Rmap::PvEntry, swap: false, map_lock, view: false });
        v.push(Config { path, rmap: Rmap::Backing, swap: false, map_lock: other, view: false });
    }
    v
}

/// Run `ops` on the host kernel once and on vmfault in every configuration
/// of [`all_configs`]; the first difference, as a readable message.
pub fn check_against_host(ops: &[TOp]) -> Result<(), String> {
    check_configs(ops, &all_configs())
}

/// Run `ops` on the host kernel once and on vmfault in each of `configs`;
/// the first difference in a result, in the window's layout or in the
/// file at the end (unless the small machine cut the sequence short), as
/// a readable message. Also checks that unmapping
/// everything gives every frame back, and dropping every space every swap
/// slot and every piece of reverse-map metadata.
pub fn check_configs(ops: &[TOp], configs: &[Config]) -> Result<(), String> {
    if ops.iter().any(|op| matches!(op, TOp::ForceWrite { .. })) && !host::forces_writes() {
        return Err("this host kernel refuses forced writes through /proc/self/mem (its \
                    proc_mem.force_override or CONFIG_PROC_MEM_*): the forced ops cannot be compared"
            .into());
    }
    let files = ops.iter().any(|op| matches!(op, TOp::MmapFile { .. }));
    let host_file = files.then(|| ScratchFile::new("host"));
    let (host, host_maps) = host::run_host(ops, host_file.as_ref().map(|f| &f.file))?;
    let host_bytes = host_file.as_ref().map(|f| std::fs::read(&f.path).unwrap());
    for &c in configs {
        let file = files.then(|| ScratchFile::new("vmfault"));
        let complete =
            check_path(ops, &host, &host_maps, &c, file.as_ref().map(|f| &f.file)).map_err(|e| format!("{c}: {e}"))?;
        // A sequence the small machine cut short (out of page tables or
        // index nodes) skipped stores the host made: its file cannot match.
        if let (true, Some(f), Some(want)) = (complete, &file, &host_bytes) {
            let got = std::fs::read(&f.path).unwrap();
            if &got != want {
                let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
                let show = |b: &[u8]| b.iter().skip(at).take(16).map(|x| format!("{x:02x}")).collect::<String>();
                return Err(format!(
                    "{c}: the file differs from the host's at the end, first at byte {at:#x} (page {}): vmfault {}, host {}; sizes {} and {}\nsequence:\n{}",
                    at / 4096,
                    show(&got),
                    show(want),
                    got.len(),
                    want.len(),
                    listing(ops, &host, ops.len())
                ));
            }
        }
    }
    Ok(())
}

/// Whether `got` differs from `want` only in bytes past the end of the
/// file in the page that straddles it (which read as zeros here once the
/// page daemon of the small machine wrote that page back, which zeroes
/// its tail as Linux's `writepage` does, and read it again), where the
/// host kept it cached with the stores it took past the end (POSIX leaves
/// them unspecified: they never reach the file). From then on the two
/// tails may differ either way (an atomic add there adds to zeros here,
/// to the stores there). Reads and atomic adds are judged (their bytes
/// start at the op's offset); `files` says which window pages map which
/// file page.
fn tail_written_back(op: &TOp, got: &Outcome, want: &Outcome, files: &FilePages) -> bool {
    let (TOp::Read { off, .. } | TOp::ForceRead { off, .. } | TOp::FetchAdd { off, .. }) = *op else { return false };
    let same_end = match (got, want) {
        (Outcome::Data(_), Outcome::Data(_)) => true,
        (Outcome::Bus { off: x, .. }, Outcome::Bus { off: y, .. }) => x == y,
        (Outcome::Segv { off: x, code: c, .. }, Outcome::Segv { off: y, code: d, .. }) => (x, c) == (y, d),
        _ => false,
    };
    let (Some(a), Some(b)) = (got.data(), want.data()) else { return false };
    same_end
        && a.len() == b.len()
        && a.iter().zip(b).enumerate().filter(|(_, (x, y))| x != y).all(|(k, _)| {
            let at = off + k as u64;
            matches!(files.fpage(at), Some(p) if p == ops::FILE_PAGES || p == filepages::UNKNOWN)
                && at % ops::P >= ops::FILE_TAIL
        })
}

/// Whether `got` differs from `want`, two `mincore` answers of the same
/// length, only where residency is not the same question on both sides:
/// - a page of the file (the host's page cache holds what the host read or
///   wrote, and its readahead and fault-around more);
/// - on the small machine with swap, any page (pageouts here, none there);
/// - a private page resident on the host only, in a process made by `fork`
///   or under `PROT_NONE` now or before: the zero page's PTE, which Linux
///   copies at fork (when the mapping has an anon_vma) and keeps under
///   `PROT_NONE` (and after it, once access is given back), while a child
///   here starts with an empty page table and `PROT_NONE` clears PTEs (a
///   page with a frame is found through the objects either way, so only a
///   page that reads as zeros can differ like this);
/// - a shared anonymous page resident here only, where an earlier
///   `MADV_PAGEOUT` reached: Linux's reclaim drops a shmem page that was
///   never written (it reads as zeros again), even with no swap, where
///   vmfault keeps it until it has swap to write it to.
fn residency_unknowable(
    op: &TOp,
    (got, want): (&Outcome, &Outcome),
    files: &FilePages,
    swap: bool,
    forked: bool,
    maps: &[ops::MapEntry],
    before: &[TOp],
) -> bool {
    let (TOp::Mincore { off, .. }, Outcome::Data(a), Outcome::Data(b)) = (op, got, want) else { return false };
    let mapping = |at: u64| maps.iter().find(|m| m.0 <= at && at < m.1).map(|m| m.2);
    let covered = |o: &TOp, at: u64| match *o {
        TOp::Madvise { off, len, advice: libc::MADV_PAGEOUT }
        | TOp::Mprotect { off, len, prot: 0 }
        | TOp::Mmap { off, len, prot: 0, .. }
        | TOp::MmapFile { off, len, prot: 0, .. } => off <= at && at < (off + len).next_multiple_of(ops::P),
        _ => false,
    };
    // (A mapping made PROT_NONE counts: a forced read maps the zero page
    // there on the host.)
    let was_prot_none = |at: u64| before.iter().any(|o| !matches!(o, TOp::Madvise { .. }) && covered(o, at));
    let zero_pte_dropped =
        |at: u64| mapping(at).is_some_and(|perms| perms & 8 == 0 && (forked || perms == 0 || was_prot_none(at)));
    let clean_shmem_dropped = |at: u64| {
        mapping(at).is_some_and(|perms| perms & 8 != 0)
            && before.iter().any(|o| matches!(o, TOp::Madvise { .. }) && covered(o, at))
    };
    a.len() == b.len()
        && a.iter().zip(b).enumerate().all(|(k, (&x, &y))| {
            let at = off + k as u64 * ops::P;
            x == y
                || swap
                || files.fpage(at).is_some()
                || (x == 0 && y == 1 && zero_pte_dropped(at))
                || (x == 1 && y == 0 && clean_shmem_dropped(at))
        })
}

/// A copy of the sequences' file in the temporary directory, removed when
/// dropped.
struct ScratchFile {
    path: std::path::PathBuf,
    file: std::fs::File,
}

impl ScratchFile {
    fn new(who: &str) -> ScratchFile {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("vmfault-check-{who}-{}-{n}", std::process::id()));
        std::fs::write(&path, file_contents()).unwrap();
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
        ScratchFile { path, file }
    }
}

impl Drop for ScratchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The first `n` ops with the host's outcomes, one a line.
fn listing(ops: &[TOp], host: &[Outcome], n: usize) -> String {
    let steps: Vec<String> = ops[..n.min(ops.len())]
        .iter()
        .enumerate()
        .map(|(k, o)| format!("  {k:3}: {o:?} -> host {:?}", host.get(k)))
        .collect();
    steps.join("\n")
}

/// Pages the small machines of [`check_against_host`] paged out, in all.
pub static PAGEOUTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Sequences the small machine cut short when it ran out of page tables
/// or index nodes (which are not reclaimable).
pub static CUT_SHORT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

#[allow(clippy::too_many_arguments)]
fn check_path(
    ops: &[TOp],
    host: &[Outcome],
    host_maps: &[Vec<MapEntry>],
    c: &Config,
    file: Option<&std::fs::File>,
) -> Result<bool, String> {
    let Config { path, rmap, swap, map_lock, view } = *c;
    let config = VmConfig {
        phys_bytes: 8 << 20,
        cpus: 1,
        prefault: false,
        fault_path: path,
        rmap,
        map_lock,
        host_views: view,
        // Pages a view faults around become resident, as Linux's
        // multi-size THP would make them, not as its 4 KiB faults do:
        // one page at a time keeps `mincore` comparable.
        view_fault_around: 1,
        ..VmConfig::default()
    };
    // 80 frames: the window's 48 pages in two processes overflow it (object indexes cost a frame or two now, not four: 112 frames paged out too rarely).
    let config = match swap {
        true => VmConfig {
            phys_bytes: 80 * ops::P,
            pcpu_pages: 4,
            free_target: 24,
            swap: Some(std::env::temp_dir()),
            ..config
        },
        false => config,
    };
    let vm = Vm::new(config).unwrap();
    let before_space = vm.stats().free_pages;
    let first = vm.new_space().unwrap();
    let initial_free = vm.stats().free_pages;
    vmfault_guards(&first, VM_BASE);
    // A host view of the window, per process (with `view`).
    let view_of = |s: &AddressSpace| view.then(|| s.host_view(VM_BASE, ops::W).expect("a host view of the window"));
    let mut views = vec![view_of(&first)];
    // Processes: the spaces of `Fork`, `None` once exited.
    let mut spaces = vec![Some(first)];
    let mut cur = 0usize;
    let mut complete = true;
    let mut files = FilePages::new();
    let private_files = ops.iter().any(|op| matches!(op, TOp::MmapFile { shared: false, .. }));
    for (i, op) in ops.iter().enumerate() {
        // Not modelled: Linux's reclaim discards a clean page that
        // MADV_FREE gave back (MADV_PAGEOUT reclaims at once), where
        // vmfault keeps every page and its contents. From a PAGEOUT after
        // a FREE on, the host's memory may hold zeros where vmfault's
        // holds data: the comparison stops there (the clean-up is still
        // checked).
        if matches!(op, TOp::Madvise { advice: libc::MADV_PAGEOUT, .. })
            && ops[..i].iter().any(|o| matches!(o, TOp::Madvise { advice: libc::MADV_FREE, .. }))
        {
            complete = false;
            break;
        }
        let live = |spaces: &[Option<AddressSpace>], cur: usize| {
            spaces[cur].clone().expect("sequences never run ops in an exited process")
        };
        let got = match op {
            TOp::Fork => match live(&spaces, cur).fork() {
                Ok(child) => {
                    views.push(view_of(&child));
                    spaces.push(Some(child));
                    Outcome::Ok
                }
                Err(e) => Outcome::Err(e.errno()),
            },
            TOp::Switch(n) => {
                cur = usize::from(*n);
                Outcome::Ok
            }
            TOp::Exit => {
                views[cur] = None;
                spaces[cur] = None;
                Outcome::Ok
            }
            op => run_vmfault_in(&live(&spaces, cur), views[cur].as_ref(), VM_BASE, op, file),
        };
        let maps = spaces[cur].as_ref().map_or_else(Vec::new, |s| vmfault_maps(s, VM_BASE));
        let context = || listing(ops, host, i + 1);
        // Page tables and object indexes are never reclaimed: the small
        // machine may run out of them where the host does not (an index
        // takes four frames, and they take most of the 112), and `mlock`
        // then fails with EAGAIN as Linux's does when it cannot fault the
        // range in. The rest of the sequence is skipped (the clean-up is
        // still checked).
        let short =
            got == Outcome::Err(libc::ENOMEM) || (got == Outcome::Err(libc::EAGAIN) && matches!(op, TOp::Mlock { .. }));
        if swap && short && host[i] != got {
            CUT_SHORT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            complete = false;
            break;
        }
        let tail = (swap && got != host[i] && tail_written_back(op, &got, &host[i], &files))
            || residency_unknowable(op, (&got, &host[i]), &files, swap, cur != 0, &host_maps[i], &ops[..i]);
        files.apply(op, &host[i]);
        if got != host[i] && !tail {
            let diff = got
                .first_difference(&host[i])
                .map_or(String::new(), |(at, run)| format!(" (bytes first differ at {at:#x}, for {run} bytes)"));
            return Err(format!("op {i}: vmfault {got:?}, host {:?}{diff}\nsequence:\n{}", host[i], context()));
        }
        let same_layout = if private_files { merged(&maps) == merged(&host_maps[i]) } else { maps == host_maps[i] };
        if !same_layout {
            return Err(format!(
                "layout after op {i}:\n vmfault {maps:x?}\n host    {:x?}\nsequence:\n{}",
                host_maps[i],
                context()
            ));
        }
    }
    // The small machine may lack an index node for a hole even here; the
    // end of the spaces frees everything regardless (checked below).
    let mut unmapped_all = true;
    for space in spaces.iter().flatten() {
        for m in space.mappings() {
            match space.munmap(m.start, m.end - m.start) {
                Err(e) if swap && e.errno() == libc::ENOMEM => unmapped_all = false,
                r => r.unwrap(),
            }
        }
    }
    // A page daemon pass still running holds what it took: let it end.
    let settle = |want: u64| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while swap && vm.stats().free_pages != want && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    };
    // The page cache keeps a file's pages after its last mapping.
    vm.drop_caches();
    if spaces.len() == 1 && unmapped_all {
        settle(initial_free);
    }
    let free = vm.stats().free_pages;
    if spaces.len() == 1 && unmapped_all && free != initial_free {
        return Err(format!("{} frames leaked after unmapping everything", initial_free as i64 - free as i64));
    }
    drop(views);
    drop(spaces);
    vm.drop_caches();
    settle(before_space);
    let st = vm.stats();
    PAGEOUTS.fetch_add(st.pageouts, std::sync::atomic::Ordering::Relaxed);
    if st.swap_used_pages != 0 {
        return Err(format!("{} swap slots leaked after dropping every space", st.swap_used_pages));
    }
    if st.free_pages != before_space {
        return Err(format!("{} frames leaked after dropping every space", before_space as i64 - st.free_pages as i64));
    }
    if (st.pv_entries, st.backing_records, st.rmap_bytes) != (0, 0, 0) {
        return Err(format!(
            "reverse map not empty after dropping every space: {} pv entries, {} backing records, {} bytes",
            st.pv_entries, st.backing_records, st.rmap_bytes
        ));
    }
    Ok(complete)
}

#[cfg(test)]
mod tail_tests {
    use super::*;

    #[test]
    fn merged_layouts_join_only_touching_entries_of_equal_permissions() {
        let maps = [(0, P, 3), (P, 2 * P, 3), (2 * P, 3 * P, 1), (4 * P, 5 * P, 1), (5 * P, 6 * P, 1)];
        assert_eq!(merged(&maps), [(0, 2 * P, 3), (2 * P, 3 * P, 1), (4 * P, 6 * P, 1)]);
    }

    #[test]
    fn only_bytes_past_the_end_of_the_file_in_its_last_page_may_differ() {
        let mut files = FilePages::new();
        let map = TOp::MmapFile { place: Place::Fixed, off: 4 * P, len: 2 * P, prot: 3, shared: true, fpage: 39 };
        files.apply(&map, &Outcome::Addr(4 * P));
        // Window page 5 maps file page 40, whose first FILE_TAIL bytes are the file's.
        let read = TOp::Read { off: 5 * P, len: 300 };
        let want = Outcome::Data(vec![7; 300]);
        let mut tail = vec![7u8; 300];
        tail[FILE_TAIL as usize..].fill(0);
        assert!(tail_written_back(&read, &Outcome::Data(tail.clone()), &want, &files));
        let mut early = tail.clone();
        early[FILE_TAIL as usize - 1] = 0;
        assert!(!tail_written_back(&read, &Outcome::Data(early), &want, &files), "a byte of the file");
        // Once written back, the tails go their own ways (an add there).
        let mut added = tail.clone();
        added[200] = 9;
        assert!(tail_written_back(&read, &Outcome::Data(added), &want, &files), "a tail added to");
        let add = TOp::FetchAdd { off: 5 * P + 2 * FILE_TAIL, val: 1 };
        assert!(tail_written_back(&add, &Outcome::Data(vec![0; 8]), &Outcome::Data(vec![7; 8]), &files), "an add");
        let add_early = TOp::FetchAdd { off: 5 * P + FILE_TAIL - 8, val: 1 };
        let early_add = tail_written_back(&add_early, &Outcome::Data(vec![0; 8]), &Outcome::Data(vec![7; 8]), &files);
        assert!(!early_add, "an add to the file's bytes");
        let other = TOp::Read { off: 4 * P, len: 300 };
        assert!(!tail_written_back(&other, &Outcome::Data(tail.clone()), &want, &files), "file page 39");
        let bus = Outcome::Bus { off: 6 * P as i64, data: tail.clone() };
        assert!(!tail_written_back(&read, &bus, &want, &files), "a different end");
    }
}
