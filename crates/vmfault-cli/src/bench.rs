//! `vmfault bench`: build a plan from the arguments, run it with a progress
//! bar, print the table, write `bench-results/` (JSON, CSV, plots).

use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use vmfault::VmConfig;
use vmfault_bench::{Event, Plan, Results, Sizes, Workload, default_threads, run as run_plan};

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
                base.clone().set(key.trim(), v).map_err(|e| format!("--compare {key}={v}: {e}"))?;
            }
            Some((key.trim().to_string(), values))
        }
    };
    Ok(Plan {
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

/// Write JSON, CSV and plots into `out` (and the extra paths asked for).
fn write_outputs(a: &BenchArgs, results: &Results) -> Result<Vec<String>, String> {
    let mut written = Vec::new();
    std::fs::create_dir_all(&a.out).map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    let mut save = |what: &str, path: &Path, r: Result<(), String>| {
        r.map_err(|e| format!("writing {what} to {}: {e}", path.display()))?;
        written.push(path.display().to_string());
        Ok::<(), String>(())
    };
    let json = a.out.join("results.json");
    save("JSON", &json, results.write_json(&json).map_err(|e| e.to_string()))?;
    let csv = a.out.join("results.csv");
    save("CSV", &csv, results.write_csv(&csv).map_err(|e| e.to_string()))?;
    // The plots in the output directory are a convenience: a machine
    // without fonts still gets its numbers (a warning, not a failure);
    // a plot asked for with `--plot` must be written.
    let mut optional = |what: &str, path: &Path, r: Result<(), String>| match save(what, path, r) {
        Ok(()) => {}
        Err(e) => eprintln!("vmfault: warning: {e}"),
    };
    let scaling = a.out.join("scaling.png");
    optional("the scaling plot", &scaling, plot::scaling(results, &scaling));
    if !results.comparisons.is_empty() {
        let cmp = a.out.join("compare.png");
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
        ] {
            let e = plan(&args(line)).unwrap_err();
            assert!(e.contains(needle), "{line}: {e}");
        }
    }
}
