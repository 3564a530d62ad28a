//! Running one round of one workload on one target with N threads.
//!
//! Worker threads are pinned round-robin to the host's CPUs, attach as
//! vCPUs (vmfault), prepare untimed state, and start together off a
//! barrier. The round lasts a fixed wall time; ops are counted up to the
//! moment the stop flag is raised. Host faults are each thread's minor
//! faults (`getrusage(RUSAGE_THREAD)`), vmfault faults come from its
//! counters; CPU time is each worker's thread CPU clock.

use std::collections::BTreeMap;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use vmfault::{Counter, Stats};

use crate::loops;
use crate::target::{OpError, Target};
use crate::workload::{Sizes, Workload};

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
}

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

/// One round of `w` on `target` with `threads` workers for `secs` seconds.
pub fn round<T: Target>(
    w: Workload,
    target: &T,
    threads: usize,
    secs: f64,
    sizes: &Sizes,
) -> Result<RoundResult, OpError> {
    round_until(w, target, threads, secs, sizes, &AtomicBool::new(false))
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

/// Like [`round`], but ends early when `cancel` is raised (for live views).
pub fn round_until<T: Target>(
    w: Workload,
    target: &T,
    threads: usize,
    secs: f64,
    sizes: &Sizes,
    cancel: &AtomicBool,
) -> Result<RoundResult, OpError> {
    if w == Workload::Pft {
        return pft_round(target, threads, secs, sizes, cancel);
    }
    let stop = AtomicBool::new(false);
    let start = Barrier::new(threads + 1);
    let before = target.stats();
    let (seconds, per_thread) = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|i| {
                let (stop, start) = (&stop, &start);
                s.spawn(move || {
                    pin(i);
                    let _cpu = target.enter_thread();
                    let scratch = loops::prepare(w, sizes, i);
                    let flt = thread_minor_faults();
                    start.wait();
                    let cpu = thread_cpu_seconds();
                    let heap = crate::heap::thread_allocs();
                    let r = scratch.and_then(|mut scratch| loops::run(w, target, sizes, &mut scratch, stop));
                    let heap = crate::heap::thread_allocs() - heap;
                    (r, thread_cpu_seconds() - cpu, thread_minor_faults() - flt, heap)
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        sleep_unless(secs, cancel);
        stop.store(true, Ordering::Relaxed);
        let seconds = t0.elapsed().as_secs_f64();
        (seconds, workers.into_iter().map(|h| h.join().expect("worker panicked")).collect::<Vec<_>>())
    });
    let after = target.stats();
    let mut r = RoundResult { ops: 0, faults: 0, seconds, cpu_seconds: 0.0, counters: counter_delta(&before, &after) };
    for (done, cpu, minflt, heap) in per_thread {
        let done = done?;
        r.ops += done.ops;
        if crate::heap::installed() {
            // The loop's own allocations: vmfault's on its rows, the
            // harness's (none in steady state) on the host's.
            *r.counters.entry("heap_allocs".to_string()).or_default() += heap;
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
    fn every_runnable_workload_runs_on_both_targets() {
        let vm = Vm::new(VmConfig { phys_bytes: 32 << 20, cpus: 2, prefault: false, ..VmConfig::default() }).unwrap();
        for w in Workload::ALL {
            let vmt = VmTarget::new(&vm).unwrap();
            let r = round(w, &vmt, 2, 0.02, &Sizes::TINY).unwrap();
            assert!(r.ops > 0, "{} did nothing on vmfault", w.name());
            if w.host_twin() {
                let h = round(w, &HostTarget, 2, 0.02, &Sizes::TINY).unwrap();
                assert!(h.ops > 0, "{} did nothing on the host", w.name());
                if matches!(w, Workload::PageFault1 | Workload::Pft | Workload::Ebizzy) {
                    assert!(r.faults > 0 && h.faults > 0, "{}: no faults counted", w.name());
                    assert!(r.counters["map_lock_acquisitions"] > 0);
                }
            } else {
                assert!(round(w, &HostTarget, 1, 0.02, &Sizes::TINY).is_err(), "{} has no host twin", w.name());
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
