//! # vmfault-bench: scalability workloads, on vmfault and on the host kernel
//!
//! Workloads from will-it-scale (`page_fault1`, `malloc1`, `mmap1`,
//! `brk1`), mmtests' `pft` and `ebizzy -mT`, plus the zero-fill limit, each
//! with a vmfault version (one vCPU per thread) and a host-kernel twin that
//! runs the same code against real system calls ([`target`]).
//!
//! [`run`] executes a [`Plan`]: for every workload and thread count it warms
//! each system up, then runs rounds interleaved across systems (vmfault
//! with each compared setting, and the host), rotating the order every
//! round (A B H, B H A, H A B, ...), so that the machine's noise and the
//! state one round leaves for the next hit all of them alike, and ratios
//! can be taken round by round. Every point starts from a fresh `Vm` per
//! system, so that no figure depends on what ran before it (a free list
//! another workload scrambled); the rows report the frame adjacency the
//! point ran with. No timing threshold lives here: it measures and reports.
//!
//! ```
//! use vmfault_bench::{Plan, Sizes, Workload, run};
//! let plan = Plan { workloads: vec![Workload::Ebizzy], threads: vec![1], rounds: 1,
//!                   round_secs: 0.01, warmup_secs: 0.0, sizes: Sizes::TINY, ..Plan::default() };
//! let results = run(&plan, &mut |_| {});
//! assert!(results.rows.iter().any(|r| r.system == "vmfault" && r.ops_per_sec > 0.0));
//! ```

pub mod harness;
pub mod heap;
mod loops;
pub mod results;
pub mod target;
pub mod workload;

use std::collections::BTreeMap;

use vmfault::{Vm, VmConfig};

pub use harness::RoundResult;
pub use results::{
    ABORT_COUNTERS, ByPlacement, Comparison, FAR_ROUND_TRIP_NS, LOCKLESS_COUNTERS, Machine, Results, Row, RunInfo,
    Spread,
};
use target::{HostTarget, VmTarget};
pub use workload::{Mode, Sizes, Workload};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Workloads, in order.
    pub workloads: Vec<Workload>,
    /// Thread counts.
    pub threads: Vec<usize>,
    /// Measured rounds per point.
    pub rounds: usize,
    /// Seconds per round.
    pub round_secs: f64,
    /// Seconds of warm-up per system before the rounds.
    pub warmup_secs: f64,
    /// Workload sizes.
    pub sizes: Sizes,
    /// The vmfault configuration (after `--set`); `phys_bytes` and `cpus`
    /// are sized to the plan unless set in `user_settings`.
    pub base: VmConfig,
    /// Knobs the user set (shown in every vmfault row's settings).
    pub user_settings: BTreeMap<String, String>,
    /// `--compare key=a,b,...`: one vmfault system per value.
    pub compare: Option<(String, Vec<String>)>,
    /// Run the host-kernel twins too.
    pub host: bool,
    /// Measure the zero-fill limit at every thread count.
    pub zero_fill: bool,
    /// Modes, in order: threads (one address space, will-it-scale's `-t`),
    /// processes (a space per worker, `-p`), or both. Rows of processes
    /// mode carry `mode=processes` in their settings.
    pub modes: Vec<Mode>,
}

impl Default for Plan {
    fn default() -> Plan {
        Plan {
            workloads: Workload::DEFAULT_SUITE.to_vec(),
            threads: default_threads(),
            rounds: 3,
            round_secs: 0.4,
            warmup_secs: 0.2,
            sizes: Sizes::FULL,
            base: VmConfig::default(),
            user_settings: BTreeMap::new(),
            compare: None,
            host: true,
            zero_fill: true,
            modes: vec![Mode::Threads],
        }
    }
}

/// 1, 2 and twice the host's CPUs: one, a pair, and more vCPUs than cores.
pub fn default_threads() -> Vec<usize> {
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut t = vec![1, 2, 2 * n];
    t.dedup();
    t
}

/// Progress of a run, for progress bars.
#[derive(Debug, Clone)]
pub enum Event {
    /// The run will take this many rounds (warm-ups included).
    Planned {
        /// Rounds in all.
        rounds: usize,
    },
    /// A round is starting.
    Round {
        /// What it measures, e.g. `page_fault1 x2 vmfault`.
        label: String,
    },
    /// Something worth telling the user.
    Note(String),
}

/// Knob names and values, as shown in a row's `settings`.
pub type Settings = BTreeMap<String, String>;

/// One system of a run: vmfault with some settings, or the host.
struct System {
    label: String,
    mode: Mode,
    settings: BTreeMap<String, String>,
    /// vmfault's configuration: every measured point builds a fresh `Vm`
    /// from it, so that no point runs on what another left (a free list
    /// scrambled by the last workload, caches, a grown index).
    vm: Option<VmConfig>,
}

impl Plan {
    fn max_threads(&self) -> usize {
        self.threads.iter().copied().max().unwrap_or(1)
    }

    /// The vmfault configurations: one, or one per compared value.
    fn vm_configs(&self) -> Result<Vec<(VmConfig, Settings)>, String> {
        let mut base = self.base.clone();
        let mut all = self.workloads.clone();
        if self.zero_fill {
            all.push(Workload::ZeroFill);
        }
        size_vm(&mut base, &all, self.max_threads(), &self.sizes, &self.user_settings);
        match &self.compare {
            None => Ok(vec![(base, self.user_settings.clone())]),
            Some((key, values)) => values
                .iter()
                .map(|v| {
                    let mut cfg = base.clone();
                    set_knob(&mut cfg, key, v).map_err(|e| format!("--compare {key}={v}: {e}"))?;
                    let mut settings = self.user_settings.clone();
                    settings.insert(key.clone(), v.clone());
                    Ok((cfg, settings))
                })
                .collect(),
        }
    }
}

/// Set knob `key` of `cfg` to `value` as `--set` and `--compare` do: a
/// `VmConfig` knob, or the bench's own `access`: `api` (loads and stores
/// through `AddressSpace::read`/`write`, the software MMU) or `native`
/// (through a host view: `host_views=true`, and workers store with plain
/// pointers; see `target::VmTarget`).
pub fn set_knob(cfg: &mut VmConfig, key: &str, value: &str) -> Result<(), String> {
    if key == "access" {
        cfg.host_views = match value.trim() {
            "api" => false,
            "native" => true,
            other => return Err(format!("VmConfig::set(access={other:?}): expected api or native")),
        };
        return Ok(());
    }
    cfg.set(key, value).map_err(|e| e.to_string())
}

/// Size `cfg` for `workloads` at up to `threads` vCPUs: `cpus` and
/// `phys_bytes`, and set `prefault` (measurements run on a backed arena),
/// unless `user_set` names them (the user's word wins).
pub fn size_vm(
    cfg: &mut VmConfig,
    workloads: &[Workload],
    threads: usize,
    sizes: &Sizes,
    user_set: &BTreeMap<String, String>,
) {
    if !user_set.contains_key("cpus") {
        cfg.cpus = threads.max(1);
    }
    // Host faults on the arena would be measured as vmfault's: measure on
    // a backed arena (the library's default leaves it to be backed on use).
    if !user_set.contains_key("prefault") {
        cfg.prefault = true;
    }
    if !user_set.contains_key("phys_bytes") {
        let need = workloads
            .iter()
            .map(|w| w.footprint_per_thread(sizes) * threads as u64 + w.footprint_shared(sizes))
            .max()
            .unwrap_or(0);
        // Frees in flight: with `free_path=deferred` a vCPU's last freed
        // cycle awaits its grace period while the vCPU faults the next,
        // and an allocation that finds no frame waits for that grace
        // period (with one cycle's room it does only if another vCPU
        // stays inside one section for a whole cycle: preempted).
        let in_flight = workloads.iter().map(|w| w.footprint_per_thread(sizes)).max().unwrap_or(0);
        // Page tables and index nodes: 2 frames per 512 pages, plus slack.
        cfg.phys_bytes = need + need / 128 + in_flight + (16 << 20);
    }
}

fn label(settings: &BTreeMap<String, String>) -> String {
    let s: Vec<String> = settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if s.is_empty() { "vmfault".into() } else { format!("vmfault {}", s.join(" ")) }
}

/// Execute `plan`, reporting progress to `observe`.
pub fn run(plan: &Plan, observe: &mut dyn FnMut(Event)) -> Results {
    let machine = Machine::detect();
    let mut rows = Vec::new();
    // Per mode, the vmfault systems, then the host.
    let mut by_mode: Vec<Vec<System>> = Vec::new();
    let mut cfgs = plan.vm_configs().map_err(|e| observe(Event::Note(e))).unwrap_or_default();
    // Built once here to report a configuration the host cannot hold up
    // front; each point builds its own.
    cfgs.retain(|(cfg, settings)| {
        Vm::new(cfg.clone())
            .map_err(|e| observe(Event::Note(format!("{}: cannot build the Vm: {e}", label(settings)))))
            .is_ok()
    });
    for &mode in &plan.modes {
        let moded = |mut settings: Settings| {
            if mode != Mode::Threads {
                settings.insert("mode".into(), mode.name().into());
            }
            settings
        };
        let mut systems: Vec<System> = cfgs
            .iter()
            .map(|(cfg, settings)| {
                let settings = moded(settings.clone());
                System { label: label(&settings), mode, settings, vm: Some(cfg.clone()) }
            })
            .collect();
        if plan.host {
            let settings = moded(BTreeMap::new());
            let label = if settings.is_empty() { "host".into() } else { format!("host mode={}", mode.name()) };
            systems.push(System { label, mode, settings, vm: None });
        }
        by_mode.push(systems);
    }
    let runnable: Vec<Workload> = plan.workloads.iter().copied().filter(|w| *w != Workload::ZeroFill).collect();
    let per_point = plan.rounds + usize::from(plan.warmup_secs > 0.0);
    let mut footprints: Vec<u64> = runnable.iter().map(|w| w.zero_fill_footprint(&plan.sizes)).collect();
    footprints.push(plan.sizes.region);
    footprints.sort_unstable_by(|a, b| b.cmp(a));
    footprints.dedup();
    if !plan.zero_fill {
        footprints.clear();
    }
    let zf = footprints.len() * plan.threads.len() * per_point;
    // A mode's systems skip the workloads that cannot run in it.
    let skips = |systems: &[System], w: Workload| {
        systems.first().is_some_and(|s| s.mode == Mode::Processes) && !w.has_processes_mode()
    };
    let runs = |systems: &[System], w: Workload| {
        if skips(systems, w) { 0 } else { systems.len() - usize::from(plan.host && !w.host_twin()) }
    };
    let point_systems: usize =
        by_mode.iter().map(|systems| runnable.iter().map(|&w| runs(systems, w)).sum::<usize>()).sum();
    observe(Event::Planned { rounds: point_systems * plan.threads.len() * per_point + zf });

    let host = [System { label: "host".into(), mode: Mode::Threads, settings: BTreeMap::new(), vm: None }];
    for &bytes in &footprints {
        let sizes = Sizes { region: bytes, ..plan.sizes };
        for &t in &plan.threads {
            for mut row in measure_point(plan, &sizes, Workload::ZeroFill, t, &host, observe) {
                row.footprint_bytes = Some(bytes);
                rows.push(row);
            }
        }
    }
    for systems in &by_mode {
        for &w in &runnable {
            if skips(systems, w) {
                observe(Event::Note(format!("{}: threads mode only (skipped in processes mode)", w.name())));
                continue;
            }
            // Workloads without a host twin run on the Vms only.
            let on = if w.host_twin() { &systems[..] } else { &systems[..systems.len() - usize::from(plan.host)] };
            for &t in &plan.threads {
                rows.extend(measure_point(plan, &plan.sizes, w, t, on, observe));
            }
        }
    }
    results::derive(&mut rows, &plan.sizes);
    let comparisons = compare(plan, &rows);
    let zero_fill_pages_per_sec = rows
        .iter()
        .find(|r| r.workload == Workload::ZeroFill && r.threads == 1 && r.footprint_bytes == Some(plan.sizes.region))
        .map(|r| r.ops_per_sec);
    let mut plan_info = BTreeMap::new();
    plan_info.insert("threads".to_string(), serde_json::json!(plan.threads));
    plan_info.insert("modes".to_string(), serde_json::json!(plan.modes));
    plan_info.insert("rounds".to_string(), serde_json::json!(plan.rounds));
    plan_info.insert("round_secs".to_string(), serde_json::json!(plan.round_secs));
    plan_info.insert("warmup_secs".to_string(), serde_json::json!(plan.warmup_secs));
    plan_info.insert("sizes".to_string(), serde_json::json!(plan.sizes));
    plan_info.insert("fresh_vm_per_point".to_string(), serde_json::json!(true));
    let config = plan.base.knobs().into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    Results { run: RunInfo::default(), machine, config, plan: plan_info, zero_fill_pages_per_sec, rows, comparisons }
}

/// Warm up, then run interleaved rounds of every system at one point.
fn measure_point(
    plan: &Plan,
    sizes: &Sizes,
    w: Workload,
    threads: usize,
    systems: &[System],
    observe: &mut dyn FnMut(Event),
) -> Vec<Row> {
    let mut rounds: Vec<Vec<RoundResult>> = vec![Vec::new(); systems.len()];
    let mut errors: Vec<Option<String>> = vec![None; systems.len()];
    // A fresh Vm per system for this point (warm-up and rounds).
    let vms: Vec<Option<Vm>> = systems
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let cfg = s.vm.as_ref()?;
            Vm::new(cfg.clone()).map_err(|e| errors[i] = Some(format!("cannot build the Vm: {e}"))).ok()
        })
        .collect();
    let passes = (0..usize::from(plan.warmup_secs > 0.0)).map(|_| true).chain((0..plan.rounds).map(|_| false));
    for (pass, warmup) in passes.enumerate() {
        // Rotate the order every pass, so that no system always runs right
        // after the same other one (caches, TLBs and frequency carry over).
        for k in 0..systems.len() {
            let i = (k + pass) % systems.len();
            let s = &systems[i];
            let name = if w == Workload::ZeroFill {
                format!("zero-fill limit {} KiB", sizes.region >> 10)
            } else {
                s.label.clone()
            };
            observe(Event::Round {
                label: format!("{} x{threads} {name}{}", w.name(), if warmup { " (warm-up)" } else { "" }),
            });
            if errors[i].is_some() {
                continue;
            }
            let secs = if warmup { plan.warmup_secs } else { plan.round_secs };
            // Untimed, right before the round: what a shared line costs now.
            let trip = if threads >= 2 && !warmup { harness::line_round_trip_ns() } else { None };
            let r = match &vms[i] {
                Some(vm) => {
                    let r = VmTarget::new(vm).and_then(|t| harness::round(w, &t, threads, secs, sizes, s.mode));
                    // Untimed: the files a round mapped stay cached otherwise.
                    vm.drop_caches();
                    r
                }
                None => harness::round(w, &HostTarget, threads, secs, sizes, s.mode),
            };
            match r {
                Ok(r) if !warmup => rounds[i].push(RoundResult { line_round_trip_ns: trip, ..r }),
                Ok(_) => {}
                Err(e) => {
                    observe(Event::Note(format!("{} x{threads} {}: {e}", w.name(), s.label)));
                    errors[i] = Some(e);
                }
            }
        }
    }
    systems
        .iter()
        .zip(rounds)
        .zip(errors)
        .map(|((s, r), e)| {
            let system = if s.vm.is_some() { "vmfault" } else { "host" };
            results::row(w, system, &s.settings, threads, r, e)
        })
        .collect()
}

/// Each compared value against the first, round by round.
fn compare(plan: &Plan, rows: &[Row]) -> Vec<Comparison> {
    let Some((key, values)) = &plan.compare else {
        return Vec::new();
    };
    let mut out = Vec::new();
    // In the first mode the plan lists (a Comparison names no mode).
    let mode = plan.modes.first().copied().unwrap_or_default();
    let mode = (mode != Mode::Threads).then(|| mode.name());
    let find = |w: Workload, t: usize, v: &str| {
        rows.iter().find(|r| {
            r.workload == w
                && r.threads == t
                && r.system == "vmfault"
                && r.settings.get(key).map(String::as_str) == Some(v)
                && r.settings.get("mode").map(String::as_str) == mode
        })
    };
    for w in plan.workloads.iter().copied().filter(|w| *w != Workload::ZeroFill) {
        for &t in &plan.threads {
            let Some(a) = find(w, t, &values[0]) else {
                continue;
            };
            for b in &values[1..] {
                if let Some(rb) = find(w, t, b)
                    && let Some(ratio) = results::ratio(a, rb)
                {
                    out.push(Comparison {
                        workload: w,
                        threads: t,
                        key: key.clone(),
                        a: values[0].clone(),
                        b: b.clone(),
                        ratio_b_over_a: ratio,
                    });
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny(workloads: Vec<Workload>) -> Plan {
        Plan {
            workloads,
            threads: vec![1, 2],
            rounds: 2,
            round_secs: 0.01,
            warmup_secs: 0.005,
            sizes: Sizes::TINY,
            ..Plan::default()
        }
    }

    #[test]
    fn every_workload_runs_and_the_json_is_complete() {
        let mut events = 0;
        let results = run(&tiny(Workload::ALL.to_vec()), &mut |_| events += 1);
        assert!(events > 10);
        let json = serde_json::to_value(&results).unwrap();
        for key in ["machine", "zero_fill_pages_per_sec", "rows", "comparisons"] {
            assert!(json.get(key).is_some(), "missing {key}");
        }
        for key in ["cpu_model", "cores", "kernel", "date"] {
            assert!(json["machine"].get(key).is_some(), "missing machine.{key}");
        }
        for w in Workload::ALL {
            for t in [1, 2] {
                let systems: Vec<&str> = results
                    .rows
                    .iter()
                    .filter(|r| r.workload == w && r.threads == t)
                    .map(|r| r.system.as_str())
                    .collect();
                let want: &[&str] = match w {
                    Workload::ZeroFill => &["host", "host"],
                    Workload::Shared64 | Workload::Mlock1 | Workload::Mlock1Shared => &["vmfault"],
                    _ => &["vmfault", "host"],
                };
                assert_eq!(systems, want, "{} x{t}", w.name());
            }
        }
        for row in json["rows"].as_array().unwrap() {
            for key in [
                "workload",
                "system",
                "settings",
                "threads",
                "ops_per_sec",
                "faults_per_sec",
                "per_fault",
                "per_op",
                "counters",
                "rounds",
            ] {
                assert!(row.get(key).is_some(), "row lacks {key}: {row}");
            }
            assert_eq!(row["rounds"].as_array().unwrap().len(), 2);
            assert!(row.get("error").is_none(), "{row}");
        }
        let pf1 = results.rows.iter().find(|r| r.workload == Workload::PageFault1 && r.system == "vmfault").unwrap();
        assert!(
            pf1.per_fault["map_lock_acquisitions"] > 0.0
                && pf1.host_ratio.is_some()
                && pf1.zero_fill_fraction.is_some()
        );
        // A fresh Vm per point: page_fault1's first allocations run through
        // an unscrambled free list.
        assert!(pf1.frame_adjacency.is_some_and(|a| a > 0.0), "{:?}", pf1.frame_adjacency);
        assert!(pf1.per_op["frame_allocs"] > 0.0);
    }

    #[test]
    fn both_modes_give_rows_paired_with_their_own_host_twin() {
        let mut plan = tiny(vec![Workload::PageFault1, Workload::Pft]);
        plan.modes = vec![Mode::Threads, Mode::Processes];
        plan.zero_fill = false;
        let results = run(&plan, &mut |_| {});
        let mode = |r: &Row| r.settings.get("mode").cloned();
        for t in [1, 2] {
            let pf1: Vec<(&str, Option<String>)> = results
                .rows
                .iter()
                .filter(|r| r.workload == Workload::PageFault1 && r.threads == t)
                .map(|r| (r.system.as_str(), mode(r)))
                .collect();
            let p = Some("processes".to_string());
            assert_eq!(pf1, [("vmfault", None), ("host", None), ("vmfault", p.clone()), ("host", p)], "x{t}");
        }
        assert!(results.rows.iter().all(|r| r.error.is_none() && r.ops_per_sec > 0.0));
        assert!(!results.rows.iter().any(|r| r.workload == Workload::Pft && mode(r).is_some()), "pft is threads only");
        // Each vmfault row against the host row of its own mode.
        for r in results.rows.iter().filter(|r| r.system == "vmfault") {
            let host = results
                .rows
                .iter()
                .find(|h| {
                    h.system == "host" && h.workload == r.workload && h.threads == r.threads && mode(h) == mode(r)
                })
                .unwrap();
            let want = results::ratio(host, r).unwrap();
            assert_eq!(r.host_ratio.unwrap().median, want.median);
        }
        assert_eq!(results.plan["modes"], serde_json::json!(["threads", "processes"]));
    }

    #[test]
    fn compare_runs_every_value_and_names_the_key() {
        let mut plan = tiny(vec![Workload::Ebizzy]);
        plan.compare = Some(("zero_page".into(), vec!["true".into(), "false".into()]));
        plan.host = false;
        plan.zero_fill = false;
        let results = run(&plan, &mut |_| {});
        assert_eq!(results.rows.len(), 4);
        assert!(results.rows.iter().all(|r| r.settings.contains_key("zero_page")));
        assert_eq!(results.comparisons.len(), 2);
        let c = &results.comparisons[0];
        assert_eq!((c.key.as_str(), c.a.as_str(), c.b.as_str()), ("zero_page", "true", "false"));
        assert!(c.ratio_b_over_a.median > 0.0);
    }

    #[test]
    fn bad_compare_values_are_reported() {
        let mut plan = tiny(vec![Workload::Mmap1]);
        plan.compare = Some(("cpus".into(), vec!["1".into(), "many".into()]));
        let mut notes = Vec::new();
        let results = run(&plan, &mut |e| {
            if let Event::Note(n) = e {
                notes.push(n)
            }
        });
        assert!(notes.iter().any(|n| n.contains("many")), "{notes:?}");
        assert!(results.rows.iter().all(|r| r.system == "host"));
    }
}
