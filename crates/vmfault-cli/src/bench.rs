//! `vmfault bench`: build a plan from the arguments, run it with a progress
//! bar, print the table, write `bench-results/` (JSON, CSV, plots).

use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use vmfault::VmConfig;
use vmfault_bench::{Event, Mode, Plan, Results, RunInfo, Sizes, Workload, default_threads, run as run_plan};

use crate::{BenchArgs, apply_sets, plot, table};

/// Turn the arguments into a plan (no side effects).
fn plan(a: &BenchArgs) -> Result<Plan, String> {
    let mut workloads = Vec::new();
    for name in &a.workloads {
        if name == "all" {
            workloads.extend(Workload::ALL.iter().copied().filter(|w| *w != Workload::ZeroFill));
        } else {
            let w = Workload::from_name(name).ok_or_else(|| {
                let names: Vec<&str> = Workload::ALL.iter().map(|w| w.name()).collect();
                format!("unknown workload {name:?}; known: {} (or all)", names.join(", "))
            })?;
            if w != Workload::ZeroFill {
                workloads.push(w);
            }
        }
    }
    if workloads.is_empty() {
        workloads = Workload::DEFAULT_SUITE.to_vec();
    }
    workloads.dedup();
    let threads = a.threads.clone().unwrap_or_else(default_threads);
    if threads.is_empty() || threads.contains(&0) || threads.iter().any(|&t| t > vmfault::config::MAX_CPUS) {
        return Err(format!("--threads: each count must be in 1..={} (got {threads:?})", vmfault::config::MAX_CPUS));
    }
    let round_secs = a.seconds.unwrap_or(if a.quick { 0.15 } else { 0.4 });
    if !(round_secs.is_finite() && round_secs > 0.0 && round_secs <= 3600.0) {
        return Err(format!("--seconds must be in (0, 3600] (got {round_secs})"));
    }
    if a.rounds == 0 {
        return Err("--rounds must be at least 1".into());
    }
    // Refused before the run, not after it.
    if let Some(p) = &a.plot
        && !matches!(p.extension().and_then(|e| e.to_str()), Some("png" | "svg"))
    {
        return Err(format!("--plot {}: plots are written as .png or .svg", p.display()));
    }
    let mut base = VmConfig::default();
    let user_settings = apply_sets(&mut base, &a.vm.set)?.into_iter().collect();
    let compare = match &a.compare {
        None => None,
        Some(spec) => {
            let (key, values) =
                spec.split_once('=').ok_or_else(|| format!("--compare {spec}: expected KEY=A,B[,C...]"))?;
            let values: Vec<String> =
                values.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect();
            if values.len() < 2 {
                return Err(format!("--compare {spec}: give at least two values"));
            }
            for v in &values {
                vmfault_bench::set_knob(&mut base.clone(), key.trim(), v)
                    .map_err(|e| format!("--compare {key}={v}: {e}"))?;
            }
            Some((key.trim().to_string(), values))
        }
    };
    let mut modes = Vec::new();
    for m in &a.mode {
        let mode = Mode::from_name(m.trim())
            .ok_or_else(|| format!("--mode {m}: expected threads or processes (or both, comma-separated)"))?;
        if !modes.contains(&mode) {
            modes.push(mode);
        }
    }
    if modes.is_empty() {
        modes.push(Mode::Threads);
    }
    Ok(Plan {
        modes,
        workloads,
        threads,
        rounds: a.rounds,
        round_secs,
        warmup_secs: (round_secs / 2.0).min(0.2),
        sizes: if a.quick { Sizes::QUICK } else { Sizes::FULL },
        base,
        user_settings,
        compare,
        host: !a.no_host,
        zero_fill: true,
    })
}

/// A new directory for one run's files under `parent`, named by the run's
/// start (`stamp`, with `-2`, `-3` ... if taken: nothing is overwritten),
/// and `parent/latest` pointed at it.
fn run_dir(parent: &Path, stamp: &str) -> Result<PathBuf, String> {
    std::fs::create_dir_all(parent).map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    let (dir, name) = (1..)
        .map(|n| if n == 1 { stamp.to_string() } else { format!("{stamp}-{n}") })
        .map(|name| (parent.join(&name), name))
        .find_map(|(dir, name)| match std::fs::create_dir(&dir) {
            Ok(()) => Some(Ok((dir, name))),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => None,
            Err(e) => Some(Err(format!("cannot create {}: {e}", dir.display()))),
        })
        .expect("some suffix is free")?;
    // A new link renamed over the old one: `latest` is never missing.
    let (latest, tmp) = (parent.join("latest"), parent.join(format!(".latest-{}", std::process::id())));
    let _ = std::fs::remove_file(&tmp);
    let linked = std::os::unix::fs::symlink(&name, &tmp).and_then(|()| std::fs::rename(&tmp, &latest));
    if let Err(e) = linked {
        let _ = std::fs::remove_file(&tmp);
        eprintln!("vmfault: warning: could not point {} at {name}: {e}", latest.display());
    }
    Ok(dir)
}

/// Write JSON, CSV and plots into a new directory under `out` (and the
/// extra paths asked for).
fn write_outputs(a: &BenchArgs, results: &Results) -> Result<Vec<String>, String> {
    let mut written = Vec::new();
    let stamp: String = results.machine.date.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
    let out = run_dir(&a.out, &stamp)?;
    let mut save = |what: &str, path: &Path, r: Result<(), String>| {
        r.map_err(|e| format!("writing {what} to {}: {e}", path.display()))?;
        written.push(path.display().to_string());
        Ok::<(), String>(())
    };
    let json = out.join("results.json");
    save("JSON", &json, results.write_json(&json).map_err(|e| e.to_string()))?;
    let csv = out.join("results.csv");
    save("CSV", &csv, results.write_csv(&csv).map_err(|e| e.to_string()))?;
    // The plots in the output directory are a convenience: a machine
    // without fonts still gets its numbers (a warning, not a failure);
    // a plot asked for with `--plot` must be written.
    let mut optional = |what: &str, path: &Path, r: Result<(), String>| match save(what, path, r) {
        Ok(()) => {}
        Err(e) => eprintln!("vmfault: warning: {e}"),
    };
    let scaling = out.join("scaling.png");
    optional("the scaling plot", &scaling, plot::scaling(results, &scaling));
    if !results.comparisons.is_empty() {
        let cmp = out.join("compare.png");
        optional("the comparison plot", &cmp, plot::comparisons(results, &cmp));
    }
    if let Some(p) = &a.json {
        save("JSON", p, results.write_json(p).map_err(|e| e.to_string()))?;
    }
    if let Some(p) = &a.csv {
        save("CSV", p, results.write_csv(p).map_err(|e| e.to_string()))?;
    }
    if let Some(p) = &a.plot {
        save("the scaling plot", p, plot::scaling(results, p))?;
        if !results.comparisons.is_empty() {
            let stem = p.file_stem().and_then(|s| s.to_str()).unwrap_or("plot");
            let ext = p.extension().and_then(|s| s.to_str()).unwrap_or("png");
            let cp = p.with_file_name(format!("{stem}-compare.{ext}"));
            save("the comparison plot", &cp, plot::comparisons(results, &cp))?;
        }
    }
    Ok(written)
}

pub(crate) fn run(a: BenchArgs) -> Result<(), String> {
    let plan = plan(&a)?;
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{bar:30}] {pos}/{len} rounds, {elapsed} (eta {eta}) {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let hidden = bar.is_hidden();
    let results = run_plan(&plan, &mut |e| match e {
        Event::Planned { rounds } => bar.set_length(rounds as u64),
        Event::Round { label } => {
            bar.set_message(label);
            bar.inc(1);
        }
        Event::Note(n) => {
            if hidden {
                eprintln!("note: {n}");
            } else {
                bar.println(format!("note: {n}"));
            }
        }
    });
    bar.finish_and_clear();
    let mut results = results;
    results.run = RunInfo {
        commit: env!("VMFAULT_COMMIT").to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        command: std::env::args().collect(),
    };
    print!("{}", table::render(&results, &plan));
    let written = write_outputs(&a, &results)?;
    println!("\nwrote {}", written.join(", "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(line: &str) -> BenchArgs {
        match crate::Cli::parse_from(line.split_whitespace()).command {
            crate::Command::Bench(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn plans_from_arguments() {
        let p = plan(&args("vmfault bench")).unwrap();
        assert_eq!(p.workloads, Workload::DEFAULT_SUITE.to_vec());
        assert_eq!(p.sizes, Sizes::FULL);
        let p = plan(&args(
            "vmfault bench pft ebizzy --threads 1,8 --quick --set zero_page=false --compare prefault=true,false",
        ))
        .unwrap();
        assert_eq!(p.workloads, vec![Workload::Pft, Workload::Ebizzy]);
        assert_eq!(p.threads, vec![1, 8]);
        assert_eq!(p.sizes, Sizes::QUICK);
        assert!(!p.base.zero_page);
        assert_eq!(p.user_settings.get("zero_page").map(String::as_str), Some("false"));
        assert_eq!(p.compare, Some(("prefault".into(), vec!["true".into(), "false".into()])));
        assert_eq!(plan(&args("vmfault bench all")).unwrap().workloads.len(), Workload::ALL.len() - 1);
    }

    #[test]
    fn each_run_gets_its_own_directory_and_latest_follows() {
        let parent = std::env::temp_dir().join(format!("vmfault-run-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        let first = run_dir(&parent, "20261125T120000Z").unwrap();
        std::fs::write(first.join("results.json"), "first").unwrap();
        let second = run_dir(&parent, "20261125T120000Z").unwrap();
        assert_eq!(second, parent.join("20261125T120000Z-2"), "a taken name is not reused");
        assert_eq!(std::fs::read_to_string(first.join("results.json")).unwrap(), "first", "nothing overwritten");
        assert_eq!(std::fs::read_link(parent.join("latest")).unwrap(), Path::new("20261125T120000Z-2"));
        let _ = std::fs::remove_dir_all(&parent);
    }

    #[test]
    fn rejects_bad_arguments_with_clear_errors() {
        for (line, needle) in [
            ("vmfault bench nonsense", "unknown workload"),
            ("vmfault bench --threads 0", "--threads"),
            ("vmfault bench --seconds 0", "--seconds"),
            ("vmfault bench --set nope=1", "--set nope=1"),
            ("vmfault bench --set zero_page", "KEY=VALUE"),
            ("vmfault bench --compare zero_page=true", "at least two"),
            ("vmfault bench --compare cpus=1,lots", "cpus=lots"),
            ("vmfault bench --rounds 0", "--rounds"),
            ("vmfault bench --plot out.jpg", ".png or .svg"),
        ] {
            let e = plan(&args(line)).unwrap_err();
            assert!(e.contains(needle), "{line}: {e}");
        }
    }
}
