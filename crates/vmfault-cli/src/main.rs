//! `vmfault`: measure vmfault's fault path against the host kernel and
//! against its own baselines (`bench`), compare two saved runs
//! (`compare`), print every counter (`stat`), or watch the per-vCPU
//! counters live (`top`).
//!
//! With `RUST_LOG` set (e.g. `RUST_LOG=vmfault::fault=debug`), vmfault's
//! `tracing` events go to stderr: one per lockless fault that fell back to
//! the map lock, with its reason.

#![deny(unsafe_code)]

mod bench;
mod check;
mod compare;
mod plot;
mod stat;
mod table;
mod top;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use vmfault::VmConfig;
use vmfault_bench::Workload;

#[derive(Parser, Debug)]
#[command(
    name = "vmfault",
    version,
    about = "A user-space multiprocessor VM subsystem: benchmarks, counters, live view, differential check"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run workloads on vmfault and on the host kernel; print a table, write JSON, CSV and plots.
    Bench(BenchArgs),
    /// Run one workload on vmfault and print every counter, like `vmstat -s`.
    Stat(RunArgs),
    /// Run one workload on vmfault and watch the per-vCPU counters live, like `systat uvm`.
    Top(RunArgs),
    /// Run random operation sequences on vmfault and on the host kernel; print the first divergence.
    Check(check::CheckArgs),
    /// Compare two saved bench runs (their results.json), row by row, with the spread of the rounds.
    Compare(compare::CompareArgs),
}

/// `--help` for `--set`: every knob and the values it takes.
fn knobs_help() -> String {
    let d: std::collections::BTreeMap<_, _> = vmfault::VmConfig::default().knobs().into_iter().collect();
    let lines: Vec<String> = vmfault::VmConfig::knob_values()
        .into_iter()
        .map(|(k, v)| match d.get(k) {
            Some(now) => format!("  {k}: {v} (default {now})"),
            None => format!("  {k}: {v} (sets several knobs at once)"),
        })
        .collect();
    format!(
        "Set a VmConfig knob (repeatable), e.g. `--set zero_page=false`. Knobs:\n{}\n  access: api or native \
         (default api): loads and stores through the API or through a host view (sets host_views)",
        lines.join("\n")
    )
}

/// `--help` for the workloads: every one, the default suite marked.
fn workloads_help() -> String {
    let lines: Vec<String> = vmfault_bench::Workload::ALL
        .iter()
        .filter(|w| **w != vmfault_bench::Workload::ZeroFill)
        .map(|w| {
            let default = if vmfault_bench::Workload::DEFAULT_SUITE.contains(w) { " (default suite)" } else { "" };
            format!("  {}{default}", w.name())
        })
        .collect();
    format!("Workloads to run (none: the default suite; `all`: every one):\n{}", lines.join("\n"))
}

/// Options shared by every subcommand that builds a `Vm`.
#[derive(Args, Debug, Clone)]
struct VmArgs {
    /// Set a VmConfig knob (repeatable), e.g. `--set zero_page=false`.
    #[arg(long = "set", value_name = "KEY=VALUE", long_help = knobs_help())]
    set: Vec<String>,
}

#[derive(Args, Debug)]
struct BenchArgs {
    /// Workloads to run (default: page_fault1 pft ebizzy malloc1 mmap1 brk1; `all` for every one).
    #[arg(value_name = "WORKLOAD", long_help = workloads_help())]
    workloads: Vec<String>,
    /// Thread (vCPU) counts, comma-separated (default: 1, 2 and twice the host's CPUs).
    #[arg(long, value_delimiter = ',')]
    threads: Option<Vec<usize>>,
    /// Seconds per measured round.
    #[arg(long)]
    seconds: Option<f64>,
    /// Measured rounds per point (interleaved across systems).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Smaller sizes and shorter rounds: a fast look, noisier numbers.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    vm: VmArgs,
    /// Run every value of one knob in the same run, interleaved, and compare each with the first.
    #[arg(long, value_name = "KEY=A,B[,C...]")]
    compare: Option<String>,
    /// Skip the host-kernel twins.
    #[arg(long)]
    no_host: bool,
    /// How workers share memory, comma-separated: threads (all in one
    /// address space, will-it-scale's -t) and/or processes (each in its
    /// own: a space per worker on vmfault, a forked process per worker on
    /// the host; -p). pft and ebizzy run in threads mode only.
    #[arg(long, value_delimiter = ',', default_value = "threads", value_name = "MODE[,MODE]")]
    mode: Vec<String>,
    /// Also write the JSON results here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Also write the CSV results here.
    #[arg(long, value_name = "FILE")]
    csv: Option<PathBuf>,
    /// Also write the thread-scaling plot here (.png or .svg).
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    /// Directory under which each run writes a new directory (named by its
    /// start, UTC) with results.json, results.csv and the plots;
    /// `latest` there points at the newest.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

#[derive(Args, Debug)]
struct RunArgs {
    /// The workload (page_fault1, pft, ebizzy, malloc1, mmap1, brk1).
    #[arg(value_name = "WORKLOAD")]
    workload: Option<String>,
    /// Threads (vCPUs).
    #[arg(long)]
    threads: Option<usize>,
    /// How long to run, seconds.
    #[arg(long)]
    seconds: Option<f64>,
    /// Smaller sizes.
    #[arg(long)]
    quick: bool,
    #[command(flatten)]
    vm: VmArgs,
}

/// Parse `--set` pairs onto a config; returns the pairs too.
fn apply_sets(cfg: &mut VmConfig, sets: &[String]) -> Result<Vec<(String, String)>, String> {
    sets.iter()
        .map(|s| {
            let (k, v) = s.split_once('=').ok_or_else(|| format!("--set {s}: expected KEY=VALUE"))?;
            vmfault_bench::set_knob(cfg, k.trim(), v.trim()).map_err(|e| format!("--set {s}: {e}"))?;
            Ok((k.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

/// The workload named `name`, runnable on vmfault.
fn runnable_workload(name: Option<&str>, default: Workload) -> Result<Workload, String> {
    let w = match name {
        None => default,
        Some(n) => {
            Workload::from_name(n).ok_or_else(|| format!("unknown workload {n:?} (try `vmfault bench --help`)"))?
        }
    };
    match w {
        Workload::ZeroFill => Err("zero_fill does not run on vmfault (it is the host's limit)".into()),
        w => Ok(w),
    }
}

/// Counts each thread's heap allocations, for the bench's `heap_allocs`.
#[global_allocator]
static HEAP: vmfault_bench::heap::CountingAlloc = vmfault_bench::heap::CountingAlloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .init();
    }
    let result = match cli.command {
        Command::Bench(a) => bench::run(a),
        Command::Stat(a) => stat::run(a),
        Command::Top(a) => top::run(a),
        Command::Check(a) => check::run(a),
        Command::Compare(a) => compare::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vmfault: {e}");
            ExitCode::FAILURE
        }
    }
}
