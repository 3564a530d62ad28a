//! `vmfault compare OLD.json NEW.json`: two saved `bench` runs side by
//! side, as mmtests' `compare-kernels` does. For each workload, system
//! (with its settings) and thread count that both runs measured: the
//! median ops/s of each, their ratio (new over old), the range that ratio
//! can take over the rounds (the new run's slowest round over the old
//! run's fastest, up to its fastest over the old run's slowest), and `~`
//! where that range holds 1: the rounds overlap, and the difference is
//! within the noise of these runs.
//!
//! The files are read as plain JSON (`results.json` as `bench` writes it),
//! so runs saved by older builds compare too; rows only one run has are
//! counted, not compared.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;
use serde_json::Value;

use crate::table::human;

#[derive(Args, Debug)]
pub(crate) struct CompareArgs {
    /// The earlier run's results.json.
    #[arg(value_name = "OLD.json")]
    old: PathBuf,
    /// The later run's results.json.
    #[arg(value_name = "NEW.json")]
    new: PathBuf,
}

/// One measured point: median ops/s and the slowest and fastest round.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Point {
    median: f64,
    min: f64,
    max: f64,
}

/// Workload, system with its settings, threads.
type Key = (String, String, u64);

/// A run as read from its file: a line saying what it was, its points in
/// the file's order.
#[derive(Debug)]
struct Run {
    about: String,
    machine: String,
    points: Vec<(Key, Point)>,
}

pub(crate) fn run(a: CompareArgs) -> Result<(), String> {
    let old = read(&a.old)?;
    let new = read(&a.new)?;
    print!("{}", render(&old, &new)?);
    Ok(())
}

fn read(path: &Path) -> Result<Run, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{}: {e}", path.display()))
}

fn parse(text: &str) -> Result<Run, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let rows =
        v.get("rows").and_then(Value::as_array).ok_or("no \"rows\" array: not a results.json of vmfault bench")?;
    let m = &v["machine"];
    let machine = format!(
        "{}, {} CPUs, Linux {}",
        m["cpu_model"].as_str().unwrap_or("?"),
        m["cores"].as_u64().map_or("?".into(), |c| c.to_string()),
        m["kernel"].as_str().unwrap_or("?")
    );
    let p = &v["plan"];
    let about = format!(
        "{machine}, {}; {} rounds of {} s",
        m["date"].as_str().unwrap_or("?"),
        p["rounds"].as_u64().map_or("?".into(), |r| r.to_string()),
        p["round_secs"].as_f64().map_or("?".into(), |s| format!("{s:.2}"))
    );
    let mut points = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let field = |k: &str| r.get(k).ok_or(format!("row {i}: no \"{k}\""));
        let mut workload = field("workload")?.as_str().ok_or(format!("row {i}: workload is not a string"))?.to_string();
        // The zero-fill reference is measured at each footprint it serves.
        if let Some(bytes) = r.get("footprint_bytes").and_then(Value::as_u64) {
            let _ = write!(workload, "@{}", crate::table::bytes(bytes).replace(' ', ""));
        }
        let mut system = field("system")?.as_str().ok_or(format!("row {i}: system is not a string"))?.to_string();
        if let Some(settings) = r.get("settings").and_then(Value::as_object) {
            // serde_json's map is ordered by key: one label per setting set.
            for (k, v) in settings {
                let _ = write!(system, " {k}={}", v.as_str().map_or(v.to_string(), str::to_string));
            }
        }
        let threads = field("threads")?.as_u64().ok_or(format!("row {i}: threads is not a count"))?;
        let spread = field("ops_per_sec_spread")?;
        let num = |k: &str| spread.get(k).and_then(Value::as_f64).ok_or(format!("row {i}: no ops_per_sec_spread.{k}"));
        let point = Point { median: num("median")?, min: num("min")?, max: num("max")? };
        points.push(((workload, system, threads), point));
    }
    Ok(Run { about, machine, points })
}

/// The ratio of `new` over `old`, its range over the rounds, and whether
/// that range holds 1.
fn ratio(old: Point, new: Point) -> (f64, f64, f64, bool) {
    let r = new.median / old.median;
    let low = new.min / old.max;
    let high = new.max / old.min;
    (r, low, high, low <= 1.0 && 1.0 <= high)
}

fn render(old: &Run, new: &Run) -> Result<String, String> {
    let olds: BTreeMap<&Key, Point> = old.points.iter().map(|(k, p)| (k, *p)).collect();
    let rows: Vec<_> = new
        .points
        .iter()
        .filter_map(|(k, p)| olds.get(k).map(|o| (k, *o, *p)))
        .filter(|(_, o, _)| o.median > 0.0)
        .collect();
    if rows.is_empty() {
        return Err("the two runs have no workload, system and thread count in common".into());
    }
    let mut out = String::new();
    let _ = writeln!(out, "old: {}", old.about);
    let _ = writeln!(out, "new: {}", new.about);
    if old.machine != new.machine {
        let _ = writeln!(out, "(different machines: the ratios compare the machines too)");
    }
    let _ = writeln!(
        out,
        "ops/s: medians of the rounds; new/old with its range over the rounds; ~ where the range holds 1 (within the noise)"
    );
    let sys_w = rows.iter().map(|(k, _, _)| k.1.len()).max().unwrap_or(6).max(6);
    let wl_w = rows.iter().map(|(k, _, _)| k.0.len()).max().unwrap_or(8).max(8);
    let _ = writeln!(
        out,
        "{:<wl_w$}  {:<sys_w$}  {:>3}  {:>8}  {:>8}  {:>7}  {:>15}",
        "workload", "system", "thr", "old", "new", "new/old", "[min, max]"
    );
    for (k, o, n) in &rows {
        let (r, low, high, noise) = ratio(*o, *n);
        let _ = writeln!(
            out,
            "{:<wl_w$}  {:<sys_w$}  {:>3}  {:>8}  {:>8}  {:>7.3}  {:>15}{}",
            k.0,
            k.1,
            k.2,
            human(o.median),
            human(n.median),
            r,
            format!("[{low:.3}, {high:.3}]"),
            if noise { "  ~" } else { "" }
        );
    }
    let common = rows.len();
    let (only_old, only_new) = (old.points.len() - common, new.points.len() - common);
    if only_old + only_new > 0 {
        let _ = writeln!(out, "not compared: {only_old} row(s) only in the old run, {only_new} only in the new one");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(rows: &[(&str, &str, &str, u64, [f64; 3])]) -> String {
        let rows: Vec<String> = rows
            .iter()
            .map(|(w, sys, settings, t, [min, median, max])| {
                format!(
                    r#"{{"workload":"{w}","system":"{sys}","settings":{settings},"threads":{t},"ops_per_sec":{median},"ops_per_sec_spread":{{"min":{min},"median":{median},"max":{max}}}}}"#
                )
            })
            .collect();
        format!(
            r#"{{"machine":{{"cpu_model":"AMD EPYC","cores":2,"kernel":"6.18","date":"2026-11-25"}},"plan":{{"rounds":3,"round_secs":0.4}},"rows":[{}]}}"#,
            rows.join(",")
        )
    }

    #[test]
    fn common_rows_compare_with_their_spread_and_the_rest_are_counted() {
        let old = parse(&file(&[
            ("page_fault1", "vmfault", "{}", 1, [0.9e6, 1.0e6, 1.1e6]),
            ("page_fault1", "host", "{}", 1, [300e3, 310e3, 320e3]),
            ("mmap1", "vmfault", r#"{"map_lock":"global"}"#, 2, [1.0e6, 1.0e6, 1.0e6]),
        ]))
        .unwrap();
        let new = parse(&file(&[
            ("page_fault1", "vmfault", "{}", 1, [1.9e6, 2.0e6, 2.1e6]),
            ("page_fault1", "host", "{}", 1, [305e3, 312e3, 330e3]),
            ("mmap1", "vmfault", r#"{"map_lock":"zoned"}"#, 2, [2.0e6, 2.0e6, 2.0e6]),
        ]))
        .unwrap();
        let out = render(&old, &new).unwrap();
        let line = |w: &str, s: &str| out.lines().find(|l| l.starts_with(w) && l.contains(s)).unwrap().to_string();
        let pf = line("page_fault1", "vmfault ");
        assert!(pf.contains("2.000") && pf.contains("[1.727, 2.333]") && !pf.ends_with('~'), "{out}");
        let host = line("page_fault1", "host");
        assert!(host.contains("1.006") && host.ends_with('~'), "within the noise: {out}");
        // Settings are part of the system: a different map lock is another row.
        assert!(!out.contains("mmap1"), "{out}");
        assert!(out.contains("1 row(s) only in the old run, 1 only in the new one"), "{out}");
    }

    #[test]
    fn zero_fill_rows_are_told_apart_by_footprint() {
        let with = |fp: u64, v: f64| {
            format!(
                r#"{{"workload":"zero_fill","system":"host","settings":{{}},"threads":1,"footprint_bytes":{fp},"ops_per_sec_spread":{{"min":{v},"median":{v},"max":{v}}}}}"#
            )
        };
        let run = |a: f64, b: f64| {
            let rows = [with(128 << 20, a), with(512 << 10, b)].join(",");
            parse(&format!(r#"{{"rows":[{rows}]}}"#)).unwrap()
        };
        let out = render(&run(1e6, 8e6), &run(2e6, 8e6)).unwrap();
        let line = |fp: &str| out.lines().find(|l| l.starts_with(&format!("zero_fill@{fp} "))).unwrap().to_string();
        assert!(line("128MiB").contains("2.000"), "{out}");
        assert!(line("512KiB").contains("1.000"), "{out}");
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        assert!(parse("{").unwrap_err().starts_with("not JSON"));
        assert!(parse("{}").unwrap_err().contains("no \"rows\""));
        let e = parse(r#"{"rows":[{"workload":"x","system":"vmfault","threads":1}]}"#).unwrap_err();
        assert_eq!(e, "row 0: no \"ops_per_sec_spread\"");
        let a = parse(&file(&[("mmap1", "vmfault", "{}", 1, [1.0, 1.0, 1.0])])).unwrap();
        let b = parse(&file(&[("brk1", "vmfault", "{}", 1, [1.0, 1.0, 1.0])])).unwrap();
        assert!(render(&a, &b).unwrap_err().contains("in common"));
    }
}
