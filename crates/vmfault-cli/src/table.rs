//! The text table `vmfault bench` prints.

use std::fmt::Write;

use vmfault_bench::{ABORT_COUNTERS, LOCKLESS_COUNTERS, Plan, Results, Row, Workload};

/// A size in KiB, MiB or GiB.
pub(crate) fn bytes(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b => format!("{} KiB", b >> 10),
    }
}

/// 3 significant digits with a k/M/G suffix.
pub(crate) fn human(v: f64) -> String {
    let (v, s) = if v >= 1e9 {
        (v / 1e9, "G")
    } else if v >= 1e6 {
        (v / 1e6, "M")
    } else if v >= 1e3 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    if v >= 100.0 {
        format!("{v:.0}{s}")
    } else if v >= 10.0 {
        format!("{v:.1}{s}")
    } else {
        format!("{v:.2}{s}")
    }
}

fn system(r: &Row) -> String {
    let s: Vec<String> = r.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if s.is_empty() { r.system.clone() } else { format!("{} {}", r.system, s.join(" ")) }
}

/// Three significant digits, however small (per-op counts of rare events).
pub(crate) fn significant(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    if v >= 1000.0 {
        return human(v);
    }
    let digits = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.digits$}")
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".into(), f)
}

/// The whole report: the table, the comparisons, the notes.
pub(crate) fn render(results: &Results, plan: &Plan) -> String {
    let mut out = String::new();
    let m = &results.machine;
    let built = if results.run.commit.is_empty() { String::new() } else { format!(", commit {}", results.run.commit) };
    let _ = writeln!(out, "vmfault bench on {} ({} CPUs, Linux {}), {}{built}", m.cpu_model, m.cores, m.kernel, m.date);
    let _ = writeln!(
        out,
        "{} rounds of {:.2} s per point, interleaved across systems; medians, with the min..max of the rounds{}",
        plan.rounds,
        plan.round_secs,
        if plan.user_settings.contains_key("prefault") || plan.compare.as_ref().is_some_and(|(k, _)| k == "prefault") {
            ""
        } else {
            "; vmfault's arena prefaulted (prefault=true)"
        }
    );
    if let Some(z) = results.zero_fill_pages_per_sec {
        let _ = writeln!(
            out,
            "zero-fill limit: {} pages/s on one thread over {} ({} MB/s); \"of zero-fill\" compares faults/s with it",
            human(z),
            bytes(plan.sizes.region),
            human(z * 4096.0 / 1e6)
        );
    }
    let trips: Vec<f64> = results.rows.iter().flat_map(|r| &r.rounds).filter_map(|r| r.line_round_trip_ns).collect();
    if let Some(t) = vmfault_bench::Spread::of(&trips) {
        let _ = writeln!(
            out,
            "cache-line round trip between the first two workers' CPUs, before each round of 2+ threads: {:.0} ns ({:.0}..{:.0}); every line vCPUs share costs that",
            t.median, t.min, t.max
        );
    }
    out.push('\n');
    let header = [
        "workload",
        "system",
        "thr",
        "ops/s",
        "min..max",
        "ops/s/thr",
        "faults/s",
        "scaling",
        "vs host",
        "of zero-fill",
        "glock/flt",
        "maplock/flt",
        "pte-wait/flt",
        "lockless",
        "aborts/flt",
    ];
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for r in results.rows.iter().filter(|r| r.workload != Workload::ZeroFill) {
        let pf = |k: &str| r.per_fault.get(k).map_or("-".to_string(), |v| format!("{v:.3}"));
        lines.push(vec![
            r.workload.name().into(),
            system(r),
            r.threads.to_string(),
            human(r.ops_per_sec),
            format!("{}..{}", human(r.ops_per_sec_spread.min), human(r.ops_per_sec_spread.max)),
            human(r.ops_per_thread_per_sec),
            if r.faults_per_sec > 0.0 { human(r.faults_per_sec) } else { "-".into() },
            opt(r.scaling, |v| format!("{v:.2}x")),
            opt(r.host_ratio.map(|s| s.median), |v| format!("{v:.2}x")),
            opt(r.zero_fill_fraction, |v| format!("{:.0}%", v * 100.0)),
            pf("global_lock_acquisitions"),
            pf("map_lock_acquisitions"),
            pf("pte_lock_contended"),
            opt(r.per_fault_sum(&LOCKLESS_COUNTERS), |v| format!("{:.1}%", v * 100.0)),
            opt(r.per_fault_sum(&ABORT_COUNTERS), |v| format!("{v:.3}")),
        ]);
        if let Some(e) = &r.error {
            lines.push(vec![String::new(), format!("  error: {e}")]);
        }
    }
    out.push_str(&columns(&lines));
    let mut footprints: Vec<u64> = results.rows.iter().filter_map(|r| r.footprint_bytes).collect();
    footprints.sort_unstable_by(|a, b| b.cmp(a));
    footprints.dedup();
    for f in footprints {
        let zf: Vec<String> = results
            .rows
            .iter()
            .filter(|r| r.footprint_bytes == Some(f))
            .map(|r| format!("x{} {}", r.threads, human(r.ops_per_sec)))
            .collect();
        let _ = writeln!(out, "\nzero-fill limit over {} per thread, pages/s: {}", bytes(f), zf.join(", "));
    }
    out.push_str(&per_op(results));
    out.push_str(&placement(results));
    out.push_str(&aborts(results));
    out.push_str(&shared64(results));
    out.push_str(&swap(results));
    out.push_str(&host_views(results));
    if !results.comparisons.is_empty() {
        let _ = writeln!(out, "\ncomparisons (ops/s of b over a, round by round: median [min, max]):");
        let mut lines = vec![["workload", "thr", "knob", "a", "b", "ratio", "[min, max]"].map(String::from).to_vec()];
        for c in &results.comparisons {
            let r = c.ratio_b_over_a;
            lines.push(vec![
                c.workload.name().into(),
                c.threads.to_string(),
                c.key.clone(),
                c.a.clone(),
                c.b.clone(),
                format!("{:.3}", r.median),
                format!("[{:.3}, {:.3}]", r.min, r.max),
            ]);
        }
        out.push_str(&columns(&lines));
    }
    out
}

/// Per op (a page_fault1 cycle, an mmap1 loop...): what each vmfault row
/// cost in grace periods and shared structures, and the frame adjacency
/// it ran with.
fn per_op(results: &Results) -> String {
    let rows: Vec<&Row> = results.rows.iter().filter(|r| r.system == "vmfault" && !r.per_op.is_empty()).collect();
    if rows.is_empty() {
        return String::new();
    }
    let keys = [
        "caller_grace_waits",
        "global_lock_acquisitions",
        "global_frames_moved",
        "map_lock_acquisitions",
        "heap_allocs",
    ];
    let mut lines = vec![["workload", "system", "thr", "adjacent"].map(String::from).to_vec()];
    lines[0].extend(keys.iter().map(|k| k.to_string()));
    for r in rows {
        let mut l = vec![
            r.workload.name().to_string(),
            system(r),
            r.threads.to_string(),
            opt(r.frame_adjacency, |v| format!("{:.0}%", v * 100.0)),
        ];
        l.extend(keys.iter().map(|k| r.per_op.get(*k).map_or("-".into(), |v| significant(*v))));
        lines.push(l);
    }
    format!(
        "
per op (all vCPUs; \"adjacent\": frame allocations next to the vCPU's previous one):\n{}",
        columns(&lines)
    )
}

/// The rows of two or more threads split by where the hypervisor put the
/// first two workers' CPUs (`ByPlacement`), when some row ran both ways:
/// each kind's median, and its scaling over the row's own one-thread
/// median.
fn placement(results: &Results) -> String {
    let placed: Vec<&Row> = results.rows.iter().filter(|r| r.by_placement.is_some()).collect();
    if !placed.iter().any(|r| r.by_placement.is_some_and(|p| p.near_rounds > 0 && p.far_rounds > 0)) {
        return String::new();
    }
    let mut lines = vec![
        ["workload", "system", "thr", "near", "rounds", "far", "rounds", "far/near", "scaling near", "scaling far"]
            .map(String::from)
            .to_vec(),
    ];
    for r in placed {
        let p = r.by_placement.expect("filtered");
        let one = results
            .rows
            .iter()
            .find(|o| {
                o.threads == 1
                    && o.workload == r.workload
                    && o.system == r.system
                    && o.settings == r.settings
                    && o.footprint_bytes == r.footprint_bytes
            })
            .map(|o| o.ops_per_sec)
            .filter(|&v| v > 0.0);
        let scaling = |v: Option<f64>| opt(v.zip(one).map(|(v, o)| v / o), |x| format!("{x:.2}x"));
        let name = match r.footprint_bytes {
            Some(f) => format!("zero-fill {}", bytes(f)),
            None => r.workload.name().into(),
        };
        lines.push(vec![
            name,
            system(r),
            r.threads.to_string(),
            opt(p.near_ops_per_sec, human),
            p.near_rounds.to_string(),
            opt(p.far_ops_per_sec, human),
            p.far_rounds.to_string(),
            opt(p.far_ops_per_sec.zip(p.near_ops_per_sec).map(|(f, n)| f / n), |x| format!("{x:.2}")),
            scaling(p.near_ops_per_sec),
            scaling(p.far_ops_per_sec),
        ]);
    }
    format!(
        "\nrounds by placement (ops/s medians; near: the first two workers' CPUs' cache-line round trip under {:.0} ns, one core complex; far: over it, two):\n{}",
        vmfault_bench::FAR_ROUND_TRIP_NS,
        columns(&lines)
    )
}

/// Lockless faults that fell back to the map lock, per reason and per 1000
/// faults, for the rows that had any.
fn aborts(results: &Results) -> String {
    let rows: Vec<&Row> =
        results.rows.iter().filter(|r| r.per_fault_sum(&ABORT_COUNTERS).is_some_and(|v| v > 0.0)).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut lines = vec![["workload", "system", "thr"].map(String::from).to_vec()];
    lines[0].extend(ABORT_COUNTERS.iter().map(|c| c.to_string()));
    for r in rows {
        let mut l = vec![r.workload.name().to_string(), system(r), r.threads.to_string()];
        l.extend(ABORT_COUNTERS.iter().map(|c| format!("{:.2}", r.per_fault.get(*c).copied().unwrap_or(0.0) * 1e3)));
        lines.push(l);
    }
    format!("\nlockless faults that fell back to the map lock, per 1000 faults, by reason:\n{}", columns(&lines))
}

/// Swap traffic of the rows that paged out (a working set over physical
/// memory with `--set swap=DIR`): medians over the rounds.
fn swap(results: &Results) -> String {
    let c = |rr: &vmfault_bench::RoundResult, k: &str| rr.counters.get(k).copied().unwrap_or(0) as f64;
    let rows: Vec<&Row> = results.rows.iter().filter(|r| r.rounds.iter().any(|rr| c(rr, "pageouts") > 0.0)).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut lines = vec![
        ["workload", "system", "thr", "pageouts/s", "pageins/s", "swap MB/s", "stalls/1000 flt"]
            .map(String::from)
            .to_vec(),
    ];
    for r in rows {
        let per_sec = |k: &str| median(r.rounds.iter().map(|rr| c(rr, k) / rr.seconds).collect());
        let io = per_sec("pageouts") + per_sec("pageins");
        let stalls = median(r.rounds.iter().map(|rr| c(rr, "alloc_stalls") * 1e3 / rr.faults.max(1) as f64).collect());
        lines.push(vec![
            r.workload.name().into(),
            system(r),
            r.threads.to_string(),
            format!("{:.0}", per_sec("pageouts")),
            format!("{:.0}", per_sec("pageins")),
            format!("{:.0}", io * 4096.0 / 1e6),
            format!("{stalls:.2}"),
        ]);
    }
    format!(
        "\nswap traffic (medians of the rounds; stalls: allocations that waited for the page daemon):\n{}",
        columns(&lines)
    )
}

/// Where a fault through a host view (`access=native`) spends its time:
/// per signal (one maps a block of `view_fault_around` pages), the
/// nanoseconds in vmfault's fault path, in the host call that maps the
/// frames, and the rest of the worker's CPU time per signal (the signal's
/// delivery and return, the workload's own stores and unmaps); medians
/// over the rounds.
fn host_views(results: &Results) -> String {
    let c = |rr: &vmfault_bench::RoundResult, k: &str| rr.counters.get(k).copied().unwrap_or(0) as f64;
    let rows: Vec<&Row> =
        results.rows.iter().filter(|r| r.rounds.iter().any(|rr| c(rr, "host_view_faults") > 0.0)).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut lines = vec![
        ["workload", "system", "thr", "faults/signal", "cpu ns/signal", "vmfault ns", "host map ns", "rest ns"]
            .map(String::from)
            .to_vec(),
    ];
    for r in rows {
        let per = |f: &dyn Fn(&vmfault_bench::RoundResult) -> f64| median(r.rounds.iter().map(f).collect());
        let signals = |rr: &vmfault_bench::RoundResult| c(rr, "host_view_faults").max(1.0);
        let total = per(&|rr| rr.cpu_seconds * 1e9 / signals(rr));
        let map = per(&|rr| c(rr, "host_view_map_ns") / signals(rr));
        let inside = per(&|rr| c(rr, "host_view_ns") / signals(rr));
        lines.push(vec![
            r.workload.name().into(),
            system(r),
            r.threads.to_string(),
            format!("{:.1}", per(&|rr| rr.faults as f64 / signals(rr))),
            format!("{total:.0}"),
            format!("{:.0}", inside - map),
            format!("{map:.0}"),
            format!("{:.0}", total - inside),
        ]);
    }
    format!(
        "
host views (per signal, medians of the rounds; rest: the signal's delivery and return, and the \
         workload's own work):\n{}",
        columns(&lines)
    )
}

/// The median of a non-empty list (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// shared64's reverse-map figures: medians over the rounds of what one
/// cycle (64 spaces mapping every page) held and took.
fn shared64(results: &Results) -> String {
    let rows: Vec<&Row> =
        results.rows.iter().filter(|r| r.workload == Workload::Shared64 && !r.rounds.is_empty()).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut lines = vec![
        ["workload", "system", "thr", "rmap bytes", "pv entries", "backing records", "forks/s", "unmap all (ms)"]
            .map(String::from)
            .to_vec(),
    ];
    for r in rows {
        let per_round = |f: &dyn Fn(&vmfault_bench::RoundResult) -> f64| median(r.rounds.iter().map(f).collect());
        let c = |rr: &vmfault_bench::RoundResult, k: &str| rr.counters.get(k).copied().unwrap_or(0) as f64;
        let threads = r.threads as f64;
        lines.push(vec![
            r.workload.name().into(),
            system(r),
            r.threads.to_string(),
            bytes(per_round(&|rr| c(rr, "shared64_rmap_bytes") / threads) as u64),
            human(per_round(&|rr| c(rr, "shared64_pv_entries") / threads)),
            human(per_round(&|rr| c(rr, "shared64_backing_records") / threads)),
            human(per_round(&|rr| c(rr, "shared64_forks") / (c(rr, "shared64_fork_ns") * 1e-9).max(1e-12))),
            format!("{:.2}", per_round(&|rr| c(rr, "shared64_unmap_ns") * 1e-6 / (rr.ops as f64).max(1.0))),
        ]);
    }
    format!(
        "
shared64, per cycle of 64 spaces (medians over rounds; bytes and entries at the peak):
{}",
        columns(&lines)
    )
}

/// Whether a cell holds a figure (`1.37M`, `96%`, `-`, `[0.95, 1.20]`,
/// `1.19M..1.34M`): its column is right-aligned if all its cells below
/// the header do.
fn is_figure(cell: &str) -> bool {
    let mut c = cell.chars();
    match (c.next(), c.next()) {
        (Some(d), _) if d.is_ascii_digit() => true,
        (Some('-'), None) => true,
        (Some('-' | '+' | '['), Some(d)) => d.is_ascii_digit() || d == '-',
        _ => false,
    }
}

/// Columns separated by two spaces: figures right-aligned, words left;
/// the first line is the header. Lines shorter than the widest are
/// printed as they are (notes).
fn columns(lines: &[Vec<String>]) -> String {
    let n = lines.iter().map(Vec::len).max().unwrap_or(0);
    let full = || lines.iter().filter(|l| l.len() == n);
    let widths: Vec<usize> =
        (0..n).map(|i| full().filter_map(|l| l.get(i)).map(|s| s.chars().count()).max().unwrap_or(0)).collect();
    let right: Vec<bool> = (0..n)
        .map(|i| {
            let mut body = full().skip(1).filter_map(|l| l.get(i)).peekable();
            body.peek().is_some() && body.all(|c| is_figure(c))
        })
        .collect();
    let mut out = String::new();
    for l in lines {
        let cells: Vec<String> = if l.len() == n {
            l.iter()
                .zip(widths.iter().zip(&right))
                .map(|(c, (w, &r))| if r { format!("{c:>w$}") } else { format!("{c:<w$}") })
                .collect()
        } else {
            l.clone()
        };
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn significant_digits() {
        assert_eq!(significant(0.0), "0");
        assert_eq!(significant(0.000_123_4), "0.000123");
        assert_eq!(significant(2.014), "2.01");
        assert_eq!(significant(65_800.0), "65.8k");
    }

    #[test]
    fn human_numbers() {
        assert_eq!(human(2_310_000.0), "2.31M");
        assert_eq!(human(470_755.0), "471k");
        assert_eq!(human(12.5), "12.5");
        assert_eq!(human(0.5), "0.50");
    }

    #[test]
    fn columns_align() {
        let t = columns(&[vec!["a".into(), "bb".into()], vec!["ccc".into(), "d".into()]]);
        assert_eq!(t, "a    bb\nccc  d\n");
        let cells = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let t = columns(&[
            cells(&["workload", "thr", "ops/s", "ratio"]),
            cells(&["page_fault1", "1", "1.65M", "[0.95, 1.20]"]),
            cells(&["pft", "16", "10.5M", "-"]),
        ]);
        assert_eq!(
            t,
            "workload     thr  ops/s         ratio\n\
             page_fault1    1  1.65M  [0.95, 1.20]\n\
             pft           16  10.5M             -\n"
        );
    }
}
