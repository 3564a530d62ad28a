//! `vmfault stat [WORKLOAD]`: run one workload on vmfault, then print every
//! statistic like `vmstat -s`: one value and name per line.

use std::collections::BTreeMap;
use std::fmt::Write;

use vmfault::{Vm, VmConfig};
use vmfault_bench::target::VmTarget;
use vmfault_bench::{Mode, Sizes, Workload, harness, size_vm};

use crate::{RunArgs, apply_sets, runnable_workload, table::human};

/// Build a `Vm` sized for `w` and the arguments.
pub(crate) fn build_vm(a: &RunArgs, w: Workload, threads: usize) -> Result<(Vm, Sizes), String> {
    let sizes = if a.quick { Sizes::QUICK } else { Sizes::FULL };
    let mut cfg = VmConfig::default();
    let set: BTreeMap<String, String> = apply_sets(&mut cfg, &a.vm.set)?.into_iter().collect();
    size_vm(&mut cfg, &[w], threads, &sizes, &set);
    let vm = Vm::new(cfg).map_err(|e| e.to_string())?;
    Ok((vm, sizes))
}

/// The report: what ran, then every statistic.
pub(crate) fn report(vm: &Vm, w: Workload, threads: usize, r: &harness::RoundResult) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} on {} vCPU(s) for {:.2} s: {} {} ({}/s), {} faults ({}/s)\n",
        w.name(),
        threads,
        r.seconds,
        r.ops,
        w.op_unit(),
        human(r.ops_per_sec()),
        r.faults,
        human(r.faults_per_sec())
    );
    let stats = vm.stats();
    for (name, value, description) in stats.entries() {
        let _ = writeln!(out, "{value:>14} {name:<26} {description}");
    }
    let _ = writeln!(out, "\nthe same under /proc/vmstat's names (Stats::vmstat):");
    for (name, value) in stats.vmstat() {
        let _ = writeln!(out, "{value:>14} {name}");
    }
    out
}

pub(crate) fn run(a: RunArgs) -> Result<(), String> {
    let w = runnable_workload(a.workload.as_deref(), Workload::PageFault1)?;
    let threads = a.threads.unwrap_or(1);
    if threads == 0 || threads > vmfault::config::MAX_CPUS {
        return Err(format!("--threads must be in 1..={}", vmfault::config::MAX_CPUS));
    }
    let secs = a.seconds.unwrap_or(1.0);
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("--seconds must be positive (got {secs})"));
    }
    let (vm, sizes) = build_vm(&a, w, threads)?;
    let target = VmTarget::new(&vm)?;
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(format!("running {} on {threads} vCPU(s) for {secs} s", w.name()));
    spinner.enable_steady_tick(std::time::Duration::from_millis(120));
    let r = harness::round(w, &target, threads, secs, &sizes, Mode::Threads);
    spinner.finish_and_clear();
    print!("{}", report(&vm, w, threads, &r?));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_every_counter_one_per_line() {
        let vm = Vm::new(VmConfig { phys_bytes: 8 << 20, cpus: 1, prefault: false, ..VmConfig::default() }).unwrap();
        let t = VmTarget::new(&vm).unwrap();
        let r = harness::round(Workload::Ebizzy, &t, 1, 0.02, &Sizes::TINY, Mode::Threads).unwrap();
        let text = report(&vm, Workload::Ebizzy, 1, &r);
        for (name, _, _) in vm.stats().entries() {
            assert!(text.lines().any(|l| l.split_whitespace().nth(1) == Some(name)), "{name} missing:\n{text}");
        }
        let value = |name: &str| {
            let line = text.lines().find(|l| l.split_whitespace().nth(1) == Some(name)).unwrap();
            line.split_whitespace().next().unwrap().parse::<u64>().unwrap()
        };
        assert!(value("faults") > 0);
        // The /proc/vmstat names follow, with the same values.
        assert_eq!(value("pgfault"), value("faults"));
        assert_eq!(value("pswpout"), value("pageouts"));
    }
}
