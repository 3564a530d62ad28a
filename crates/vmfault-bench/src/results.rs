//! The results file: machine, rows (one per measured point), comparisons.
//!
//! Field names are an interface: other tools read `results.json`. Every
//! figure is a median over interleaved rounds, with the min and max beside
//! it; ratios are taken round by round (round *i* of B over round *i* of
//! A, which ran back to back) before the median.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::harness::RoundResult;
use crate::workload::Workload;

/// Where the numbers were measured.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPU model (`/proc/cpuinfo`).
    pub cpu_model: String,
    /// CPUs available to this process.
    pub cores: usize,
    /// Kernel release (`uname -r`).
    pub kernel: String,
    /// When, RFC 3339 (UTC).
    pub date: String,
}

impl Machine {
    /// Read the machine description.
    pub fn detect() -> Machine {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        // SAFETY: zeroed utsname is a valid out-parameter for uname.
        let mut u: libc::utsname = unsafe { std::mem::zeroed() };
        // SAFETY: valid pointer.
        let kernel = if unsafe { libc::uname(&mut u) } == 0 {
            // SAFETY: uname NUL-terminates `release`.
            unsafe { std::ffi::CStr::from_ptr(u.release.as_ptr()) }.to_string_lossy().into_owned()
        } else {
            "unknown".into()
        };
        Machine {
            cpu_model,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel,
            date: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
        }
    }
}

/// Minimum, median and maximum.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Spread {
    /// Smallest value.
    pub min: f64,
    /// Median (mean of the two middle values for an even count).
    pub median: f64,
    /// Largest value.
    pub max: f64,
}

impl Spread {
    /// The spread of `values`, or `None` if there are none (or any is not finite).
    pub fn of(values: &[f64]) -> Option<Spread> {
        if values.is_empty() || values.iter().any(|v| !v.is_finite()) {
            return None;
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Some(Spread { min: v[0], median, max: v[n - 1] })
    }
}

/// The cache-line round trip between a round's first two workers' CPUs
/// (`harness::line_round_trip_ns`) below which the round counts as run on
/// one core complex ("near"), and above which on two ("far"): on the
/// 2-core machine the hypervisor's placements measure 55-70 ns and
/// 330-440 ns, and every figure that shares lines follows them.
pub const FAR_ROUND_TRIP_NS: f64 = 200.0;

/// A row's rounds split by where its first two workers' CPUs sat
/// ([`FAR_ROUND_TRIP_NS`]): the medians of ops per second of each kind,
/// so that a run whose rounds the hypervisor placed both ways reads as
/// two figures, not one median of a mixture.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ByPlacement {
    /// Rounds under the threshold.
    pub near_rounds: usize,
    /// Their median ops per second.
    pub near_ops_per_sec: Option<f64>,
    /// Rounds over it.
    pub far_rounds: usize,
    /// Their median ops per second.
    pub far_ops_per_sec: Option<f64>,
}

impl ByPlacement {
    /// The split of `rounds`, if any of them measured a round trip.
    pub fn of(rounds: &[RoundResult]) -> Option<ByPlacement> {
        let placed: Vec<(f64, f64)> =
            rounds.iter().filter_map(|r| r.line_round_trip_ns.map(|t| (t, r.ops_per_sec()))).collect();
        if placed.is_empty() {
            return None;
        }
        let side = |far: bool| -> Vec<f64> {
            placed.iter().filter(|(t, _)| (*t > FAR_ROUND_TRIP_NS) == far).map(|&(_, o)| o).collect()
        };
        let (near, far) = (side(false), side(true));
        Some(ByPlacement {
            near_rounds: near.len(),
            near_ops_per_sec: Spread::of(&near).map(|s| s.median),
            far_rounds: far.len(),
            far_ops_per_sec: Spread::of(&far).map(|s| s.median),
        })
    }
}

/// One measured point: a workload on one system with one setting and thread count.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Workload name.
    pub workload: Workload,
    /// `"vmfault"` or `"host"`.
    pub system: String,
    /// The VmConfig knobs that differ from default (in a `--compare` run,
    /// always including the compared key).
    pub settings: BTreeMap<String, String>,
    /// Worker threads (vCPUs).
    pub threads: usize,
    /// Ops per second, all threads (median of rounds).
    pub ops_per_sec: f64,
    /// Min/median/max of ops per second over rounds.
    pub ops_per_sec_spread: Spread,
    /// Ops per second per thread.
    pub ops_per_thread_per_sec: f64,
    /// Faults per wall second (median of rounds).
    pub faults_per_sec: f64,
    /// Faults per CPU second of the workers (median of rounds; pft's `flt/cpu/s`).
    pub faults_per_cpu_sec: f64,
    /// Ops per second over the same system's at one thread.
    pub scaling: Option<f64>,
    /// Faults per second over the zero-fill limit's pages per second at the same thread count.
    pub zero_fill_fraction: Option<f64>,
    /// vmfault over host, round by round (vmfault rows only).
    pub host_ratio: Option<Spread>,
    /// Counter per fault, e.g. `global_lock_acquisitions`, `map_lock_acquisitions`.
    pub per_fault: BTreeMap<String, f64>,
    /// Counter per op (per cycle, loop or iteration of the workload), e.g.
    /// `caller_grace_waits`, `global_lock_acquisitions`.
    pub per_op: BTreeMap<String, f64>,
    /// The share of frame allocations next to the vCPU's previous one
    /// (vmfault rows; zeroing runs at memory speed over consecutive frames).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frame_adjacency: Option<f64>,
    /// Raw counter totals over all rounds.
    pub counters: BTreeMap<String, u64>,
    /// Min/median/max over the rounds of the cache-line round trip between
    /// the first two workers' CPUs, nanoseconds (rows of two or more
    /// threads: `harness::line_round_trip_ns`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub line_round_trip_ns: Option<Spread>,
    /// The rounds split by that round trip (rows of two or more threads).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub by_placement: Option<ByPlacement>,
    /// Every round.
    pub rounds: Vec<RoundResult>,
    /// Zero-fill rows: the bytes each thread zeroes over and over.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub footprint_bytes: Option<u64>,
    /// Why the row is incomplete, if it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// B against A, for one workload and thread count of a `--compare` run.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    /// Workload name.
    pub workload: Workload,
    /// Threads.
    pub threads: usize,
    /// The compared knob.
    pub key: String,
    /// Its first value (the baseline).
    pub a: String,
    /// The value compared with it.
    pub b: String,
    /// Ops per second of B over A, round by round.
    pub ratio_b_over_a: Spread,
}

/// What ran: the build and the command that made a run's results (filled
/// by the command that runs the plan; empty from the library alone).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunInfo {
    /// The commit the binary was built from (`git describe`-like: a short
    /// hash, `-dirty` if the working tree had uncommitted changes), or
    /// `unknown` when it was built outside a git checkout.
    pub commit: String,
    /// The crate version.
    pub version: String,
    /// The command line, one argument per element.
    pub command: Vec<String>,
}

/// Everything a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Results {
    /// The build and command line.
    pub run: RunInfo,
    /// The machine.
    pub machine: Machine,
    /// The base VmConfig, every knob.
    pub config: BTreeMap<String, String>,
    /// Seconds per round, rounds, threads, sizes.
    pub plan: BTreeMap<String, serde_json::Value>,
    /// Zero-filled 4 KiB pages per second with one thread (the zero-fill limit).
    pub zero_fill_pages_per_sec: Option<f64>,
    /// The measured points.
    pub rows: Vec<Row>,
    /// Pairwise comparisons of a `--compare` run.
    pub comparisons: Vec<Comparison>,
}

/// Build a row from its rounds.
pub(crate) fn row(
    workload: Workload,
    system: &str,
    settings: &BTreeMap<String, String>,
    threads: usize,
    rounds: Vec<RoundResult>,
    error: Option<String>,
) -> Row {
    let ops: Vec<f64> = rounds.iter().map(|r| r.ops_per_sec()).collect();
    let spread = Spread::of(&ops).unwrap_or(Spread { min: 0.0, median: 0.0, max: 0.0 });
    let fps: Vec<f64> = rounds.iter().map(|r| r.faults_per_sec()).collect();
    let fpc: Vec<f64> =
        rounds.iter().filter(|r| r.cpu_seconds > 0.0).map(|r| r.faults as f64 / r.cpu_seconds).collect();
    let mut counters: BTreeMap<String, u64> = BTreeMap::new();
    for r in &rounds {
        for (k, v) in &r.counters {
            *counters.entry(k.clone()).or_default() += v;
        }
    }
    let faults: u64 = rounds.iter().map(|r| r.faults).sum();
    let per_fault = if faults > 0 && !counters.is_empty() {
        counters
            .iter()
            .filter(|(k, _)| k.as_str() != "faults")
            .map(|(k, &v)| (k.clone(), v as f64 / faults as f64))
            .collect()
    } else {
        BTreeMap::new()
    };
    let ops: u64 = rounds.iter().map(|r| r.ops).sum();
    // Heap allocations are counted in the steady part of each round only.
    let heap_ops: u64 = rounds.iter().filter_map(|r| r.heap_ops).sum();
    let per_op = if ops > 0 {
        counters
            .iter()
            .filter_map(|(k, &v)| match k.as_str() {
                "heap_allocs" => (heap_ops > 0).then(|| (k.clone(), v as f64 / heap_ops as f64)),
                _ => Some((k.clone(), v as f64 / ops as f64)),
            })
            .collect()
    } else {
        BTreeMap::new()
    };
    let allocs = counters.get("frame_allocs").copied().unwrap_or(0);
    let frame_adjacency =
        (allocs > 0).then(|| counters.get("frames_adjacent").copied().unwrap_or(0) as f64 / allocs as f64);
    let trips: Vec<f64> = rounds.iter().filter_map(|r| r.line_round_trip_ns).collect();
    let line_round_trip_ns = Spread::of(&trips);
    let by_placement = ByPlacement::of(&rounds);
    Row {
        workload,
        system: system.to_string(),
        settings: settings.clone(),
        threads,
        ops_per_sec: spread.median,
        ops_per_sec_spread: spread,
        ops_per_thread_per_sec: spread.median / threads as f64,
        faults_per_sec: Spread::of(&fps).map_or(0.0, |s| s.median),
        faults_per_cpu_sec: Spread::of(&fpc).map_or(0.0, |s| s.median),
        scaling: None,
        zero_fill_fraction: None,
        host_ratio: None,
        per_fault,
        per_op,
        frame_adjacency,
        counters,
        line_round_trip_ns,
        by_placement,
        rounds,
        footprint_bytes: None,
        error,
    }
}

/// Round-by-round ratio of `b` over `a` (ops per second).
pub(crate) fn ratio(a: &Row, b: &Row) -> Option<Spread> {
    let r: Vec<f64> = a
        .rounds
        .iter()
        .zip(&b.rounds)
        .filter(|(x, _)| x.ops > 0)
        .map(|(x, y)| y.ops_per_sec() / x.ops_per_sec())
        .collect();
    Spread::of(&r)
}

/// Fill in scaling, zero-fill fractions (against the limit measured with
/// the row's own footprint) and host ratios.
pub(crate) fn derive(rows: &mut [Row], sizes: &crate::Sizes) {
    let snapshot = rows.to_vec();
    for row in rows.iter_mut() {
        let same = |r: &&Row| {
            r.workload == row.workload
                && r.system == row.system
                && r.settings == row.settings
                && r.footprint_bytes == row.footprint_bytes
        };
        if let Some(one) = snapshot.iter().filter(same).find(|r| r.threads == 1)
            && one.ops_per_sec > 0.0
        {
            row.scaling = Some(row.ops_per_sec / one.ops_per_sec);
        }
        if row.workload != Workload::ZeroFill
            && row.faults_per_sec > 0.0
            && let Some(z) = snapshot.iter().find(|r| {
                r.workload == Workload::ZeroFill
                    && r.threads == row.threads
                    && r.footprint_bytes == Some(row.workload.zero_fill_footprint(sizes))
                    && r.ops_per_sec > 0.0
            })
        {
            row.zero_fill_fraction = Some(row.faults_per_sec / z.ops_per_sec);
        }
        if row.system == "vmfault"
            && let Some(h) = snapshot.iter().find(|r| {
                r.workload == row.workload
                    && r.threads == row.threads
                    && r.system == "host"
                    && r.settings.get("mode") == row.settings.get("mode")
            })
        {
            row.host_ratio = ratio(h, row);
        }
    }
}

/// Per-fault counters worth a CSV column (and a table column when non-zero).
pub const PER_FAULT_COLUMNS: [&str; 6] =
    ["global_lock_acquisitions", "map_lock_acquisitions", "pte_lock_contended", "tlb_shootdowns", "spf", "vma_lock"];

/// Faults that completed without the map lock, one counter per fault path.
pub const LOCKLESS_COUNTERS: [&str; 2] = ["spf", "vma_lock"];

/// Lockless faults that fell back to the map lock, one counter per reason
/// (the seed's `spf_*` names; the per-VMA-lock path has one reason).
pub const ABORT_COUNTERS: [&str; 7] = [
    "spf_vma_changed",
    "spf_vma_noanon",
    "spf_vma_notsup",
    "spf_vma_access",
    "spf_pmd_changed",
    "spf_nomem",
    "vma_lock_fallbacks",
];

impl Row {
    /// The sum of `keys` per fault; `None` when the row has no counters.
    pub fn per_fault_sum(&self, keys: &[&str]) -> Option<f64> {
        // None where no key was counted (the host's rows): not a sum of
        // nothing, which a float sum makes -0.
        let present: Vec<f64> = keys.iter().filter_map(|k| self.per_fault.get(*k).copied()).collect();
        (!present.is_empty()).then(|| present.iter().sum())
    }
}

impl Results {
    /// Write the JSON file.
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        serde_json::to_writer_pretty(&mut f, self)?;
        writeln!(f)
    }

    /// Write one CSV line per row.
    pub fn write_csv(&self, path: &Path) -> std::io::Result<()> {
        let mut w = csv::Writer::from_path(path)?;
        let mut header: Vec<String> = [
            "workload",
            "system",
            "settings",
            "threads",
            "footprint_bytes",
            "ops_per_sec",
            "ops_per_sec_min",
            "ops_per_sec_max",
            "ops_per_thread_per_sec",
            "faults_per_sec",
            "faults_per_cpu_sec",
            "scaling",
            "zero_fill_fraction",
            "host_ratio",
        ]
        .map(String::from)
        .to_vec();
        header.extend(PER_FAULT_COLUMNS.iter().map(|c| format!("{c}_per_fault")));
        w.write_record(&header)?;
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
        for r in &self.rows {
            let settings: Vec<String> = r.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let mut rec = vec![
                r.workload.name().to_string(),
                r.system.clone(),
                settings.join(";"),
                r.threads.to_string(),
                r.footprint_bytes.map_or(String::new(), |f| f.to_string()),
                format!("{:.1}", r.ops_per_sec),
                format!("{:.1}", r.ops_per_sec_spread.min),
                format!("{:.1}", r.ops_per_sec_spread.max),
                format!("{:.1}", r.ops_per_thread_per_sec),
                format!("{:.1}", r.faults_per_sec),
                format!("{:.1}", r.faults_per_cpu_sec),
                opt(r.scaling),
                opt(r.zero_fill_fraction),
                opt(r.host_ratio.map(|s| s.median)),
            ];
            rec.extend(
                PER_FAULT_COLUMNS.iter().map(|c| r.per_fault.get(*c).map_or(String::new(), |v| format!("{v:.4}"))),
            );
            w.write_record(&rec)?;
        }
        w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rr(ops: u64, secs: f64) -> RoundResult {
        RoundResult {
            ops,
            faults: ops,
            seconds: secs,
            cpu_seconds: secs,
            counters: BTreeMap::new(),
            line_round_trip_ns: None,
            heap_ops: None,
        }
    }

    #[test]
    fn spread_and_ratios() {
        let s = Spread::of(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.min, s.median, s.max), (1.0, 2.5, 10.0));
        assert!(Spread::of(&[]).is_none());
        let a = row(Workload::Pft, "vmfault", &BTreeMap::new(), 1, vec![rr(100, 1.0), rr(200, 1.0)], None);
        let b = row(Workload::Pft, "vmfault", &BTreeMap::new(), 1, vec![rr(150, 1.0), rr(200, 1.0)], None);
        let r = ratio(&a, &b).unwrap();
        assert_eq!((r.min, r.median, r.max), (1.0, 1.25, 1.5));
        assert_eq!(a.ops_per_sec, 150.0);
    }

    #[test]
    fn rounds_split_by_placement() {
        let placed = |ops, trip| RoundResult { line_round_trip_ns: trip, ..rr(ops, 1.0) };
        let rounds =
            vec![placed(10, Some(65.0)), placed(30, Some(350.0)), placed(12, Some(60.0)), placed(20, Some(340.0))];
        let r = row(Workload::Vmlocal, "vmfault", &BTreeMap::new(), 2, rounds, None);
        let p = r.by_placement.unwrap();
        assert_eq!(
            (p.near_rounds, p.near_ops_per_sec, p.far_rounds, p.far_ops_per_sec),
            (2, Some(11.0), 2, Some(25.0))
        );
        assert_eq!(r.ops_per_sec, 16.0, "the mixture's median, for comparison");
        let near_only = row(Workload::Vmlocal, "vmfault", &BTreeMap::new(), 2, vec![placed(5, Some(64.0))], None);
        assert_eq!(near_only.by_placement.unwrap().far_ops_per_sec, None);
        let unplaced = row(Workload::Vmlocal, "vmfault", &BTreeMap::new(), 1, vec![rr(5, 1.0)], None);
        assert!(unplaced.by_placement.is_none(), "one thread: no round trip");
    }

    #[test]
    fn derived_figures() {
        let s = BTreeMap::new();
        let mut rows = vec![
            row(Workload::PageFault1, "vmfault", &s, 1, vec![rr(100, 1.0)], None),
            row(Workload::PageFault1, "vmfault", &s, 2, vec![rr(180, 1.0)], None),
            row(Workload::PageFault1, "host", &s, 2, vec![rr(90, 1.0)], None),
            Row {
                footprint_bytes: Some(crate::Sizes::TINY.region),
                ..row(Workload::ZeroFill, "host", &s, 2, vec![rr(360, 1.0)], None)
            },
            Row { footprint_bytes: Some(1), ..row(Workload::ZeroFill, "host", &s, 2, vec![rr(1000, 1.0)], None) },
        ];
        derive(&mut rows, &crate::Sizes::TINY);
        assert_eq!(rows[1].scaling, Some(1.8));
        assert_eq!(rows[1].zero_fill_fraction, Some(0.5));
        assert_eq!(rows[1].host_ratio.unwrap().median, 2.0);
        assert!(rows[0].host_ratio.is_none());
    }

    #[test]
    fn csv_rows_are_told_apart_by_their_footprint() {
        let s = BTreeMap::new();
        let zf = |f| Row { footprint_bytes: Some(f), ..row(Workload::ZeroFill, "host", &s, 1, vec![rr(9, 1.0)], None) };
        let results = Results {
            run: RunInfo::default(),
            machine: Machine { cpu_model: String::new(), cores: 1, kernel: String::new(), date: String::new() },
            config: BTreeMap::new(),
            plan: BTreeMap::new(),
            zero_fill_pages_per_sec: None,
            rows: vec![zf(1 << 20), zf(128 << 20)],
            comparisons: Vec::new(),
        };
        let path = std::env::temp_dir().join(format!("vmfault-csv-{}.csv", std::process::id()));
        results.write_csv(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].contains("footprint_bytes"), "{}", lines[0]);
        assert_eq!(lines.len(), 3);
        assert_ne!(lines[1], lines[2], "two rows the same");
        assert!(lines[2].contains(&(128u64 << 20).to_string()));
    }
}
