//! Plots of a bench run: thread scaling per workload, and the ratios of a
//! `--compare` run. PNG or SVG, chosen by the file extension.
//!
//! Text is drawn with a TrueType font found on the system (plotters'
//! `ab_glyph` renderer, no C libraries); without one, plotting fails with a
//! message saying so.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use vmfault_bench::{Results, Workload};

const FONT_DIRS: [&str; 3] = ["/usr/share/fonts", "/usr/local/share/fonts", "/usr/share/fonts/truetype"];
const PREFERRED: [&str; 4] = ["DejaVuSans.ttf", "LiberationSans-Regular.ttf", "FreeSans.ttf", "NotoSans-Regular.ttf"];

fn find_ttf(dir: &Path, depth: usize, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() && depth > 0 {
            find_ttf(&p, depth - 1, out);
        } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("ttf")) {
            out.push(p);
        }
    }
}

/// Register a sans-serif font once.
fn font() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let mut found = Vec::new();
        for d in FONT_DIRS {
            find_ttf(Path::new(d), 4, &mut found);
        }
        found.sort_by_key(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            PREFERRED.iter().position(|f| *f == name).unwrap_or(PREFERRED.len())
        });
        for p in found {
            if let Ok(bytes) = std::fs::read(&p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err("no TrueType font found under /usr/share/fonts (install fonts-dejavu-core)".into())
    })
    .clone()
}

/// Draw onto a PNG or SVG file depending on the extension.
fn with_area(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<(), String>,
    draw_png: impl FnOnce(&DrawingArea<BitMapBackend, Shift>) -> Result<(), String>,
) -> Result<(), String> {
    font()?;
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") => {
            let area = SVGBackend::new(path, size).into_drawing_area();
            area.fill(&WHITE).map_err(|e| e.to_string())?;
            draw(&area)?;
            area.present().map_err(|e| e.to_string())
        }
        Some("png") => {
            let area = BitMapBackend::new(path, size).into_drawing_area();
            area.fill(&WHITE).map_err(|e| e.to_string())?;
            draw_png(&area)?;
            area.present().map_err(|e| e.to_string())
        }
        _ => Err("plots are written as .png or .svg".into()),
    }
}

fn series_label(r: &vmfault_bench::Row) -> String {
    if let Some(f) = r.footprint_bytes {
        return format!("memset over {}", crate::table::bytes(f));
    }
    let s: Vec<String> = r.settings.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if s.is_empty() { r.system.clone() } else { format!("{} {}", r.system, s.join(" ")) }
}

/// Ops per second against threads, one panel per workload, one line per system.
pub(crate) fn scaling(results: &Results, path: &Path) -> Result<(), String> {
    let mut workloads: Vec<Workload> = results.rows.iter().map(|r| r.workload).collect();
    workloads.sort();
    workloads.dedup();
    if workloads.is_empty() {
        return Err("nothing was measured".into());
    }
    let cols = workloads.len().min(3);
    let rows = workloads.len().div_ceil(cols);
    let size = (560 * cols as u32, 400 * rows as u32);
    with_area(
        path,
        size,
        |a| scaling_panels(results, &workloads, a, rows, cols),
        |a| scaling_panels(results, &workloads, a, rows, cols),
    )
}

fn scaling_panels<DB: DrawingBackend>(
    results: &Results,
    workloads: &[Workload],
    area: &DrawingArea<DB, Shift>,
    rows: usize,
    cols: usize,
) -> Result<(), String> {
    let panels = area.split_evenly((rows, cols));
    for (w, panel) in workloads.iter().zip(panels.iter()) {
        let pts: Vec<_> = results.rows.iter().filter(|r| r.workload == *w && !r.rounds.is_empty()).collect();
        // Thread counts at evenly spaced positions (1, 2, 4, 8, 16 read best that way).
        let mut counts: Vec<usize> = pts.iter().map(|r| r.threads).collect();
        counts.sort_unstable();
        counts.dedup();
        let x_of = |t: usize| counts.iter().position(|&c| c == t).unwrap_or(0) as f64;
        let max_y = pts.iter().map(|r| r.ops_per_sec_spread.max).fold(0.0, f64::max).max(1.0) * 1.15;
        let title = if *w == Workload::ZeroFill {
            "zero-fill limit (memset of 4 KiB pages)".to_string()
        } else {
            w.name().to_string()
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(10)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(-0.5..counts.len() as f64 - 0.5, 0.0..max_y)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("threads (vCPUs)")
            .y_desc(format!("{}/s (all threads)", w.op_unit()))
            .y_label_formatter(&|v| crate::table::human(*v))
            .x_labels(counts.len())
            .x_label_formatter(&|v| {
                let i = v.round();
                match counts.get(i as usize) {
                    Some(c) if (v - i).abs() < 1e-6 && i >= 0.0 => c.to_string(),
                    _ => String::new(),
                }
            })
            .draw()
            .map_err(|e| e.to_string())?;
        let mut labels: Vec<String> = pts.iter().map(|r| series_label(r)).collect();
        labels.sort();
        labels.dedup();
        for (i, label) in labels.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let mut line: Vec<_> = pts.iter().filter(|r| &series_label(r) == label).collect();
            line.sort_by_key(|r| r.threads);
            chart
                .draw_series(LineSeries::new(
                    line.iter().map(|r| (x_of(r.threads), r.ops_per_sec)),
                    color.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?
                .label(label.clone())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
            chart
                .draw_series(line.iter().map(|r| {
                    let s = r.ops_per_sec_spread;
                    ErrorBar::new_vertical(x_of(r.threads), s.min, s.median, s.max, color.filled(), 8)
                }))
                .map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The ratio of each compared value to the first, with the rounds' min..max.
pub(crate) fn comparisons(results: &Results, path: &Path) -> Result<(), String> {
    if results.comparisons.is_empty() {
        return Err("no comparisons in this run".into());
    }
    let width = (120 + 120 * results.comparisons.len() as u32).max(640);
    with_area(path, (width, 480), |a| comparison_chart(results, a), |a| comparison_chart(results, a))
}

fn comparison_chart<DB: DrawingBackend>(results: &Results, area: &DrawingArea<DB, Shift>) -> Result<(), String> {
    let cs = &results.comparisons;
    let max_y = cs.iter().map(|c| c.ratio_b_over_a.max).fold(1.0, f64::max) * 1.15;
    let min_y = cs.iter().map(|c| c.ratio_b_over_a.min).fold(1.0, f64::min) * 0.85;
    let key = &cs[0].key;
    let names: Vec<String> = cs.iter().map(|c| format!("{} x{}: {}", c.workload.name(), c.threads, c.b)).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(format!("--compare {key}: ops/s of each value over {}={}", key, cs[0].a), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.5..cs.len() as f64 - 0.5, min_y..max_y)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_labels(cs.len())
        .x_label_formatter(&|v| {
            let i = v.round();
            if (v - i).abs() < 1e-6 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .x_label_style(("sans-serif", 13))
        .x_desc("workload x threads: compared value")
        .y_desc("ratio b/a (median, min..max of rounds)")
        .draw()
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(LineSeries::new([(-0.5, 1.0), (cs.len() as f64 - 0.5, 1.0)], BLACK.mix(0.5)))
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(cs.iter().enumerate().map(|(i, c)| {
            let r = c.ratio_b_over_a;
            ErrorBar::new_vertical(i as f64, r.min, r.median, r.max, BLUE.filled(), 14)
        }))
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(
            cs.iter().enumerate().map(|(i, c)| Circle::new((i as f64, c.ratio_b_over_a.median), 5, BLUE.filled())),
        )
        .map_err(|e| e.to_string())?;
    Ok(())
}
