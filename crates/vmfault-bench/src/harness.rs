//! Running one round of one workload on one target with N threads.
//!
//! Worker threads are pinned round-robin to the host's CPUs, attach as
//! vCPUs (vmfault), prepare untimed state, and start together off a
//! barrier. The round lasts a fixed wall time; ops are counted up to the
//! moment the stop flag is raised. Host faults are each thread's minor
//! faults (`getrusage(RUSAGE_THREAD)`), vmfault faults come from its
//! counters; CPU time is each worker's thread CPU clock.
//!
//! In processes mode (will-it-scale's `-p`) each worker has an address
//! space of its own: on vmfault a new space of the same machine, on the
//! host a forked process.

use std::collections::BTreeMap;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use vmfault::{Counter, Stats};

use crate::loops;
use crate::target::{OpError, Target};
use crate::workload::{Mode, Sizes, Workload};

/// What one round measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RoundResult {
    /// Ops completed.
    pub ops: u64,
    /// Page faults taken (vmfault: its counter; host: minor faults).
    pub faults: u64,
    /// Wall time of the round, seconds.
    pub seconds: f64,
    /// CPU time of the workers, seconds.
    pub cpu_seconds: f64,
    /// vmfault counters accumulated during the round (empty for the host).
    pub counters: BTreeMap<String, u64>,
    /// The cache-line round trip between the first two workers' CPUs just
    /// before the round, nanoseconds ([`line_round_trip_ns`]; rounds of two
    /// or more threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line_round_trip_ns: Option<f64>,
    /// Ops done in the part of the round whose heap allocations the
    /// `heap_allocs` counter holds: after its first [`WARM_FRACTION`],
    /// the steady state (a round's workers are new threads: their spare
    /// VMA records and index nodes are stocked when they attach, but
    /// other thread-local buffers grow at their first uses). `None`: none
    /// counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap_ops: Option<u64>,
}

/// The share of a round after which its heap allocations are counted.
pub const WARM_FRACTION: f64 = 0.25;

impl RoundResult {
    /// Ops per wall second.
    pub fn ops_per_sec(&self) -> f64 {
        self.ops as f64 / self.seconds
    }

    /// Faults per wall second.
    pub fn faults_per_sec(&self) -> f64 {
        self.faults as f64 / self.seconds
    }
}

fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn thread_minor_faults() -> u64 {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer; RUSAGE_THREAD reports the calling thread.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    ru.ru_minflt as u64
}

/// Pin the calling thread to host CPU `i % ncpus` (best effort).
fn pin(i: usize) {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    // SAFETY: a zeroed cpu_set_t is empty; CPU_SET stays in bounds for i % n < 1024.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(i % n, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

/// The time a cache line takes to go from the first worker's CPU to the
/// second's and back (two threads pinned as workers 0 and 1 pass a counter
/// back and forth), nanoseconds: what every line two vCPUs both write costs
/// them. On a virtual machine it moves when the hypervisor moves the vCPUs
/// (on the 2-core machine, 55-70 ns on one core complex and 340-390 ns
/// across two, for seconds at a time), and every figure that depends on
/// shared lines moves with it. None with fewer than two CPUs.
pub fn line_round_trip_ns() -> Option<f64> {
    const TRIPS: u64 = 20_000;
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        return None;
    }
    #[repr(align(128))]
    struct Line(AtomicU64);
    let line = Line(AtomicU64::new(0));
    let seconds = std::thread::scope(|s| {
        let line = &line;
        s.spawn(move || {
            pin(1);
            for i in 0..TRIPS {
                while line.0.load(Ordering::Acquire) != 2 * i + 1 {
                    std::hint::spin_loop();
                }
                line.0.store(2 * i + 2, Ordering::Release);
            }
        });
        s.spawn(move || {
            pin(0);
            let t0 = Instant::now();
            for i in 0..TRIPS {
                line.0.store(2 * i + 1, Ordering::Release);
                while line.0.load(Ordering::Acquire) != 2 * i + 2 {
                    std::hint::spin_loop();
                }
            }
            t0.elapsed().as_secs_f64()
        })
        .join()
        .expect("the timing thread does not panic")
    });
    Some(seconds * 1e9 / TRIPS as f64)
}

/// Counter deltas between two snapshots of vmfault's statistics.
fn counter_delta(before: &Option<Stats>, after: &Option<Stats>) -> BTreeMap<String, u64> {
    let (Some(b), Some(a)) = (before, after) else {
        return BTreeMap::new();
    };
    // Per-vCPU counters, plus the machine-wide monotonic ones.
    let names = Counter::ALL.iter().map(|c| c.name()).chain([
        "global_lock_acquisitions",
        "global_frames_moved",
        "pcp_remote_drains",
        "pcp_pages_drained",
        "pageouts",
        "reclaim_scans",
    ]);
    names.map(|n| (n.to_string(), a.get(n).unwrap_or(0) - b.get(n).unwrap_or(0))).collect()
}

/// One round of `w` on `target` with `threads` workers for `secs` seconds,
/// the workers sharing one address space or each in its own (`mode`).
pub fn round<T: Target>(
    w: Workload,
    target: &T,
    threads: usize,
    secs: f64,
    sizes: &Sizes,
    mode: Mode,
) -> Result<RoundResult, OpError> {
    round_until(w, target, threads, secs, sizes, mode, &AtomicBool::new(false))
}

/// Sleep up to `secs`, returning early once `cancel` is raised.
fn sleep_unless(secs: f64, cancel: &AtomicBool) {
    let end = Instant::now() + Duration::from_secs_f64(secs);
    while !cancel.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= end {
            break;
        }
        std::thread::sleep((end - now).min(Duration::from_millis(20)));
    }
}

/// What one worker did: its ops, CPU seconds, host minor faults, and its
/// heap allocations after the round's warm part with the ops it did
/// meanwhile.
type WorkerResult = (Result<loops::Done, OpError>, f64, u64, (u64, u64));

/// Like [`round`], but ends early when `cancel` is raised (for live views).
pub fn round_until<T: Target>(
    w: Workload,
    target: &T,
    threads: usize,
    secs: f64,
    sizes: &Sizes,
    mode: Mode,
    cancel: &AtomicBool,
) -> Result<RoundResult, OpError> {
    if mode == Mode::Processes && !w.has_processes_mode() {
        return Err(format!("{} runs in threads mode only", w.name()));
    }
    if w == Workload::Pft {
        return pft_round(target, threads, secs, sizes, cancel);
    }
    let before = target.stats();
    // Processes: vmfault gives each worker a space of its own on the same
    // machine; the host forks a process per worker.
    let own: Option<Vec<T>> = match mode {
        Mode::Threads => None,
        Mode::Processes => match target.new_process()? {
            None => {
                let (seconds, per_worker) = forked_round(w, target, threads, secs, sizes, cancel)?;
                return finish(w, before, target.stats(), seconds, per_worker);
            }
            Some(first) => {
                let mut v = vec![first];
                for _ in 1..threads {
                    v.push(target.new_process()?.expect("a target that made one space makes more"));
                }
                Some(v)
            }
        },
    };
    let (warm, stop) = (AtomicBool::new(false), AtomicBool::new(false));
    let start = Barrier::new(threads + 1);
    let (seconds, per_thread) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|i| {
                let (warm, stop, start) = (&warm, &stop, &start);
                let target = own.as_ref().map_or(target, |v| &v[i]);
                s.spawn(move || {
                    pin(i);
                    let _cpu = target.enter_thread();
                    let scratch = loops::prepare(w, sizes, i);
                    let flt = thread_minor_faults();
                    start.wait();
                    let cpu = thread_cpu_seconds();
                    // The loop runs twice: until the round is warm, then
                    // to its end, counting the heap allocations.
                    let r = scratch.and_then(|mut scratch| {
                        let first = loops::run(w, target, sizes, &mut scratch, warm)?;
                        let heap = crate::heap::thread_allocs();
                        let rest = loops::run(w, target, sizes, &mut scratch, stop)?;
                        let heap = (crate::heap::thread_allocs() - heap, rest.ops);
                        Ok((first.and(rest), heap))
                    });
                    let (r, heap) = match r {
                        Ok((done, heap)) => (Ok(done), heap),
                        Err(e) => (Err(e), (0, 0)),
                    };
                    (r, thread_cpu_seconds() - cpu, thread_minor_faults() - flt, heap)
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        sleep_unless(secs * WARM_FRACTION, cancel);
        warm.store(true, Ordering::Relaxed);
        sleep_unless(secs * (1.0 - WARM_FRACTION), cancel);
        stop.store(true, Ordering::Relaxed);
        let seconds = t0.elapsed().as_secs_f64();
        (seconds, workers.into_iter().map(|h| h.join().expect("worker panicked")).collect::<Vec<_>>())
    });
    drop(own);
    finish(w, before, target.stats(), seconds, per_thread)
}

/// The round's totals from its workers' results.
fn finish(
    w: Workload,
    before: Option<Stats>,
    after: Option<Stats>,
    seconds: f64,
    per_worker: Vec<WorkerResult>,
) -> Result<RoundResult, OpError> {
    let mut r = RoundResult {
        ops: 0,
        faults: 0,
        seconds,
        cpu_seconds: 0.0,
        counters: counter_delta(&before, &after),
        line_round_trip_ns: None,
        heap_ops: None,
    };
    for (done, cpu, minflt, (heap, heap_ops)) in per_worker {
        let done = done?;
        r.ops += done.ops;
        if crate::heap::installed() && heap_ops > 0 {
            // The loop's own allocations: vmfault's on its rows, the
            // harness's (none in steady state) on the host's.
            *r.counters.entry("heap_allocs".to_string()).or_default() += heap;
            *r.heap_ops.get_or_insert(0) += heap_ops;
        }
        for (k, v) in done.extra {
            *r.counters.entry(k.to_string()).or_default() += v;
        }
        r.cpu_seconds += cpu;
        r.faults += minflt;
    }
    if let Some(&f) = r.counters.get("faults") {
        r.faults = f;
    }
    if w == Workload::ZeroFill {
        r.faults = 0;
    }
    Ok(r)
}

/// One worker's slot in a forked round's shared memory.
#[repr(C)]
struct Slot {
    /// 1 once it ended well (0: running, failed or died).
    state: AtomicU64,
    ops: AtomicU64,
    cpu_ns: AtomicU64,
    minflt: AtomicU64,
}

/// A forked round's shared memory: the start and stop flags, then a slot
/// per worker.
#[repr(C)]
struct Board {
    ready: AtomicU64,
    go: AtomicBool,
    stop: AtomicBool,
}

/// The host's processes mode (will-it-scale's `-p`): a process per
/// worker, forked from this one, started and stopped through flags in a
/// shared anonymous mapping, reporting through it. glibc's `fork` takes
/// its allocator's locks around the fork, so the children may allocate;
/// they print nothing and end with `_exit`. A failed worker's error is
/// its op's text lost to the child: the round reports which worker failed.
fn forked_round<T: Target>(
    w: Workload,
    target: &T,
    threads: usize,
    secs: f64,
    sizes: &Sizes,
    cancel: &AtomicBool,
) -> Result<(f64, Vec<WorkerResult>), OpError> {
    let len = size_of::<Board>() + threads * size_of::<Slot>();
    // SAFETY: a fresh shared anonymous mapping, zeroed by the kernel (all
    // flags false, all counts 0: valid atomics).
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if mem == libc::MAP_FAILED {
        return Err(format!("processes mode: mmap of {len} shared bytes failed: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the mapping holds a Board then `threads` Slots, aligned (page
    // start, 8-byte fields), alive until the munmap at the end, after every
    // child has been reaped.
    let board = unsafe { &*mem.cast::<Board>() };
    // SAFETY: as above.
    let slots = unsafe { std::slice::from_raw_parts(mem.cast::<u8>().add(size_of::<Board>()).cast::<Slot>(), threads) };
    let mut pids = Vec::with_capacity(threads);
    for (i, slot) in slots.iter().enumerate() {
        // SAFETY: the child runs only the worker below and ends in _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // The child never returns into the parent's code: a panic ends
            // it (a failed worker) instead of unwinding into a copy of the
            // parent's stack.
            let worker = std::panic::AssertUnwindSafe(|| {
                pin(i);
                let scratch = loops::prepare(w, sizes, i);
                board.ready.fetch_add(1, Ordering::AcqRel);
                while !board.go.load(Ordering::Acquire) {
                    std::thread::yield_now();
                }
                let cpu = thread_cpu_seconds();
                let flt = thread_minor_faults();
                let r = scratch.and_then(|mut scratch| loops::run(w, target, sizes, &mut scratch, &board.stop));
                slot.cpu_ns.store(((thread_cpu_seconds() - cpu) * 1e9) as u64, Ordering::Relaxed);
                slot.minflt.store(thread_minor_faults() - flt, Ordering::Relaxed);
                if let Ok(done) = r {
                    slot.ops.store(done.ops, Ordering::Relaxed);
                    slot.state.store(1, Ordering::Release);
                }
            });
            let code = i32::from(std::panic::catch_unwind(worker).is_err());
            // SAFETY: ends the child without running the parent's exit
            // handlers or destructors.
            unsafe { libc::_exit(code) };
        }
        if pid < 0 {
            break;
        }
        pids.push(pid);
    }
    let mut seconds = 0.0;
    if pids.len() == threads {
        // Every worker prepared (or one died: then its exit is reaped below).
        let deadline = Instant::now() + Duration::from_secs(60);
        while board.ready.load(Ordering::Acquire) < threads as u64 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(200));
        }
        board.go.store(true, Ordering::Release);
        let t0 = Instant::now();
        sleep_unless(secs, cancel);
        board.stop.store(true, Ordering::Release);
        seconds = t0.elapsed().as_secs_f64();
    } else {
        board.go.store(true, Ordering::Release);
        board.stop.store(true, Ordering::Release);
    }
    for &pid in &pids {
        let mut st = 0;
        // SAFETY: our own child.
        unsafe { libc::waitpid(pid, &mut st, 0) };
    }
    let forked = pids.len();
    let per_worker = slots
        .iter()
        .enumerate()
        .map(|(i, slot)| {
            let ok = i < forked && slot.state.load(Ordering::Acquire) == 1;
            let done = if ok {
                Ok(loops::Done::from(slot.ops.load(Ordering::Relaxed)))
            } else if i >= forked {
                Err(format!("processes mode: fork of worker {i} failed"))
            } else {
                Err(format!("processes mode: worker {i} ({}) failed or died", w.name()))
            };
            (done, slot.cpu_ns.load(Ordering::Relaxed) as f64 * 1e-9, slot.minflt.load(Ordering::Relaxed), (0, 0))
        })
        .collect();
    // SAFETY: every child has been reaped; nothing refers to the mapping.
    unsafe { libc::munmap(mem, len) };
    Ok((seconds, per_worker))
}

/// pft: the coordinator maps one region; all workers fault their share of
/// it once; the coordinator unmaps it; repeat until the round's time is up.
/// Wall time counts only the faulting phases (first worker start to last
/// worker end), CPU time only the workers' faulting.
fn pft_round<T: Target>(
    target: &T,
    threads: usize,
    secs: f64,
    sizes: &Sizes,
    cancel: &AtomicBool,
) -> Result<RoundResult, OpError> {
    let len = sizes.pft_region;
    let pages = len / 4096;
    let go = Barrier::new(threads + 1);
    let done = Barrier::new(threads + 1);
    let stop = AtomicBool::new(false);
    let region = AtomicU64::new(0);
    let before = target.stats();
    let mut wall = 0.0;
    let mut iterations = 0u64;
    let mut failure = None;
    let per_thread = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|i| {
                let (go, done, stop, region) = (&go, &done, &stop, &region);
                s.spawn(move || {
                    pin(i);
                    let _cpu = target.enter_thread();
                    let (mut cpu, mut minflt, mut err) = (0.0, 0, None);
                    let (first, last) = (pages * i as u64 / threads as u64, pages * (i as u64 + 1) / threads as u64);
                    loop {
                        go.wait();
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let a = region.load(Ordering::Relaxed);
                        let (c0, f0) = (thread_cpu_seconds(), thread_minor_faults());
                        for p in first..last {
                            if let Err(e) = target.store(a + p * 4096) {
                                err.get_or_insert(e);
                                break;
                            }
                        }
                        cpu += thread_cpu_seconds() - c0;
                        minflt += thread_minor_faults() - f0;
                        done.wait();
                    }
                    (cpu, minflt, err)
                })
            })
            .collect();
        while wall < secs && failure.is_none() && !cancel.load(Ordering::Relaxed) {
            match target.map(len) {
                Ok(a) => region.store(a, Ordering::Relaxed),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
            let t0 = Instant::now();
            go.wait();
            done.wait();
            wall += t0.elapsed().as_secs_f64();
            iterations += 1;
            if let Err(e) = target.unmap(region.load(Ordering::Relaxed), len) {
                failure = Some(e);
            }
        }
        stop.store(true, Ordering::Relaxed);
        go.wait();
        workers.into_iter().map(|h| h.join().expect("worker panicked")).collect::<Vec<_>>()
    });
    if let Some(e) = failure {
        return Err(e);
    }
    let after = target.stats();
    let mut r = RoundResult {
        ops: pages * iterations,
        faults: 0,
        seconds: wall,
        cpu_seconds: 0.0,
        counters: counter_delta(&before, &after),
        line_round_trip_ns: None,
        heap_ops: None,
    };
    for (cpu, minflt, err) in per_thread {
        if let Some(e) = err {
            return Err(e);
        }
        r.cpu_seconds += cpu;
        r.faults += minflt;
    }
    if let Some(&f) = r.counters.get("faults") {
        r.faults = f;
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::target::{HostTarget, VmTarget};
    use vmfault::{Vm, VmConfig};

    #[test]
    fn processes_mode_gives_each_worker_a_space_of_its_own() {
        let vm = Vm::new(VmConfig { phys_bytes: 32 << 20, cpus: 2, prefault: false, ..VmConfig::default() }).unwrap();
        // A worker's target in processes mode: another space of the machine.
        let t = VmTarget::new(&vm).unwrap();
        let own = t.new_process().unwrap().expect("vmfault makes a space per worker");
        assert!(!own.space().same_space(t.space()));
        let r = round(Workload::PageFault1, &t, 2, 0.02, &Sizes::TINY, Mode::Processes).unwrap();
        assert!(r.ops > 0 && r.faults > 0, "{r:?}");
        // The host forks a process per worker: their ops and faults are
        // counted through the shared board.
        for w in [Workload::PageFault1, Workload::Mmap1, Workload::Malloc1] {
            let h = round(w, &HostTarget, 2, 0.02, &Sizes::TINY, Mode::Processes).unwrap();
            assert!(h.ops > 0 && h.cpu_seconds > 0.0, "{}: {h:?}", w.name());
            if w == Workload::PageFault1 {
                assert!(h.faults > 0, "{h:?}");
            }
        }
        // Threaded programs say so.
        for w in [Workload::Pft, Workload::Ebizzy] {
            let e = round(w, &HostTarget, 1, 0.02, &Sizes::TINY, Mode::Processes).unwrap_err();
            assert!(e.contains("threads mode only"), "{e}");
        }
    }

    /// A round of `w` on `target` that did something: rounds of 0.02 s,
    /// then longer ones (a loaded machine may not run the workers in the
    /// first 20 ms: "brk1 did nothing on the host" at load 3), the last
    /// one returned whatever it did.
    fn round_that_ran<T: Target>(w: Workload, target: &T) -> RoundResult {
        let mut secs = 0.02;
        loop {
            let r = round(w, target, 2, secs, &Sizes::TINY, Mode::Threads).unwrap();
            if r.ops > 0 || secs >= 1.0 {
                return r;
            }
            secs *= 5.0;
        }
    }

    #[test]
    fn every_runnable_workload_runs_on_both_targets() {
        let vm = Vm::new(VmConfig { phys_bytes: 32 << 20, cpus: 2, prefault: false, ..VmConfig::default() }).unwrap();
        for w in Workload::ALL {
            let vmt = VmTarget::new(&vm).unwrap();
            let r = round_that_ran(w, &vmt);
            assert!(r.ops > 0, "{} did nothing on vmfault", w.name());
            if w.host_twin() {
                let h = round_that_ran(w, &HostTarget);
                assert!(h.ops > 0, "{} did nothing on the host", w.name());
                if matches!(w, Workload::PageFault1 | Workload::Pft | Workload::Ebizzy) {
                    assert!(r.faults > 0 && h.faults > 0, "{}: no faults counted", w.name());
                    assert!(r.counters["map_lock_acquisitions"] > 0);
                }
            } else {
                assert!(
                    round(w, &HostTarget, 1, 0.02, &Sizes::TINY, Mode::Threads).is_err(),
                    "{} has no host twin",
                    w.name()
                );
            }
            if w == Workload::Shared64 {
                assert!(r.counters["shared64_forks"] > 0 && r.counters["shared64_rmap_bytes"] > 0);
            }
            vm.drop_caches();
            // Everything unmapped after the round.
            assert!(vmt.space().mappings().is_empty(), "{} left mappings", w.name());
        }
    }
}
