//! `vmfault top [WORKLOAD]`: a live full-screen view of the per-vCPU
//! counters while a workload runs, like OpenBSD's `systat uvm`.
//!
//! The workload runs on its own threads; the view samples the counters
//! twice a second and shows rates. `q`, Esc or Ctrl-C stops it. When the
//! output is not a terminal, one line of totals is printed per second.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ratatui::Terminal;
use ratatui::backend::{Backend, CrosstermBackend};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyModifiers};
use ratatui::crossterm::execute;
use ratatui::crossterm::terminal::{EnterAlternateScreen, LeaveAlternateScreen, disable_raw_mode, enable_raw_mode};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table};
use vmfault::{CpuStats, Stats, Vm};
use vmfault_bench::target::VmTarget;
use vmfault_bench::{Mode, Workload, harness};

use crate::stat::build_vm;
use crate::{RunArgs, runnable_workload, table::human};

/// Counters shown per vCPU, as rates.
const COLUMNS: [(&str, &str); 8] = [
    ("faults", "faults/s"),
    ("zero_fill", "zfod/s"),
    ("zero_page_maps", "zeropg/s"),
    ("map_lock_acquisitions", "maplock/s"),
    ("map_lock_writes", "mapwr/s"),
    ("pte_lock_contended", "ptewait/s"),
    ("tlb_shootdowns", "shootdn/s"),
    ("mmap_calls", "mmap/s"),
];

/// Two samples and what the view shows of them.
pub(crate) struct View {
    title: String,
    elapsed: f64,
    stats: Stats,
    prev_stats: Stats,
    cpus: Vec<CpuStats>,
    prev_cpus: Vec<CpuStats>,
    dt: f64,
    finished: bool,
}

impl View {
    fn rate(&self, now: u64, before: u64) -> String {
        human(now.saturating_sub(before) as f64 / self.dt.max(1e-9))
    }

    fn total(&self, name: &str) -> String {
        self.rate(self.stats.get(name).unwrap_or(0), self.prev_stats.get(name).unwrap_or(0))
    }
}

/// Draw the view (separate from the terminal handling so tests can render it).
pub(crate) fn draw<B: Backend>(term: &mut Terminal<B>, v: &View) -> Result<(), String> {
    term.draw(|f| {
        let [head, body] = Layout::vertical([Constraint::Length(5), Constraint::Min(3)]).areas(f.area());
        let state = if v.finished { "finished" } else { "running (q to quit)" };
        let text = vec![
            Line::from(format!("{}  {:.1} s  {state}", v.title, v.elapsed)),
            Line::from(format!(
                "free {} of {} pages   page tables {}   data pages {}   attached vCPUs {}",
                v.stats.free_pages,
                v.stats.total_pages,
                v.stats.page_table_pages,
                v.stats.data_pages,
                v.stats.cpus_attached
            )),
            Line::from(format!(
                "faults/s {}   zero-fill/s {}   global lock/s {}   map lock/s {}   segv/s {}",
                v.total("faults"),
                v.total("zero_fill"),
                v.total("global_lock_acquisitions"),
                v.total("map_lock_acquisitions"),
                v.total("segv")
            )),
        ];
        f.render_widget(Paragraph::new(text).block(Block::default().borders(Borders::ALL).title("vmfault top")), head);
        let header = Row::new(["vCPU"].into_iter().chain(COLUMNS.iter().map(|c| c.1)))
            .style(Style::default().add_modifier(Modifier::BOLD));
        let rows =
            v.cpus.iter().zip(&v.prev_cpus).filter(|(c, p)| c.attached || c.counters != p.counters).map(|(c, p)| {
                let name = if c.cpu == v.cpus.len() - 1 { "shared".to_string() } else { c.cpu.to_string() };
                Row::new(std::iter::once(name).chain(
                    COLUMNS.iter().map(|(k, _)| v.rate(c.counters.get(k).unwrap_or(0), p.counters.get(k).unwrap_or(0))),
                ))
            });
        let widths = std::iter::once(Constraint::Length(7)).chain(COLUMNS.iter().map(|_| Constraint::Length(10)));
        f.render_widget(
            Table::new(rows, widths).header(header).block(Block::default().borders(Borders::ALL).title("per vCPU")),
            body,
        );
    })
    .map(|_| ())
    .map_err(|e| e.to_string())
}

fn sample(vm: &Vm) -> (Stats, Vec<CpuStats>, Instant) {
    (vm.stats(), vm.cpu_stats(), Instant::now())
}

/// The terminal loop: sample, draw, handle keys, until done or cancelled.
fn ui(vm: &Vm, title: &str, cancel: &AtomicBool, done: &AtomicBool) -> Result<(), String> {
    enable_raw_mode().map_err(|e| e.to_string())?;
    let mut out = std::io::stdout();
    execute!(out, EnterAlternateScreen).map_err(|e| e.to_string())?;
    let mut term = Terminal::new(CrosstermBackend::new(out)).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut prev = sample(vm);
    let result = loop {
        if event::poll(Duration::from_millis(500)).unwrap_or(false)
            && let Ok(Event::Key(k)) = event::read()
            && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
                || (k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL)))
        {
            cancel.store(true, Ordering::Relaxed);
            break Ok(());
        }
        let now = sample(vm);
        let finished = done.load(Ordering::Relaxed);
        let view = View {
            title: title.to_string(),
            elapsed: start.elapsed().as_secs_f64(),
            dt: (now.2 - prev.2).as_secs_f64(),
            stats: now.0.clone(),
            prev_stats: prev.0,
            cpus: now.1.clone(),
            prev_cpus: prev.1,
            finished,
        };
        if let Err(e) = draw(&mut term, &view) {
            break Err(e);
        }
        prev = now;
        if finished {
            break Ok(());
        }
    };
    let _ = disable_raw_mode();
    let _ = execute!(std::io::stdout(), LeaveAlternateScreen);
    result
}

/// Without a terminal: one line of totals per second.
fn lines(vm: &Vm, done: &AtomicBool) {
    let mut prev = sample(vm);
    while !done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_secs(1));
        let now = sample(vm);
        let dt = (now.2 - prev.2).as_secs_f64();
        let r = |n: &str| human((now.0.get(n).unwrap_or(0) - prev.0.get(n).unwrap_or(0)) as f64 / dt);
        println!(
            "faults/s {}  zero-fill/s {}  map-lock/s {}  pte-waits/s {}  free pages {}",
            r("faults"),
            r("zero_fill"),
            r("map_lock_acquisitions"),
            r("pte_lock_contended"),
            now.0.free_pages
        );
        prev = now;
    }
}

pub(crate) fn run(a: RunArgs) -> Result<(), String> {
    let w = runnable_workload(a.workload.as_deref(), Workload::Ebizzy)?;
    let threads = a.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if threads == 0 || threads > vmfault::config::MAX_CPUS {
        return Err(format!("--threads must be in 1..={}", vmfault::config::MAX_CPUS));
    }
    let secs = a.seconds.unwrap_or(60.0);
    let (vm, sizes) = build_vm(&a, w, threads)?;
    let target = VmTarget::new(&vm)?;
    let (cancel, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let title = format!("{} on {threads} vCPU(s)", w.name());
    let (round, shown) = std::thread::scope(|s| {
        let worker = s.spawn(|| {
            let r = harness::round_until(w, &target, threads, secs, &sizes, Mode::Threads, &cancel);
            done.store(true, Ordering::Relaxed);
            r
        });
        let shown = if std::io::stdout().is_terminal() {
            ui(&vm, &title, &cancel, &done)
        } else {
            lines(&vm, &done);
            Ok(())
        };
        cancel.store(true, Ordering::Relaxed);
        (worker.join().expect("workload thread panicked"), shown)
    });
    shown?;
    let r = round?;
    println!("{title}: {} {} in {:.2} s ({}/s)", r.ops, w.op_unit(), r.seconds, human(r.ops_per_sec()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;
    use vmfault::{Access, MapFlags, Prot, VmConfig};

    #[test]
    fn renders_rates_per_vcpu() {
        let vm = Vm::new(VmConfig { phys_bytes: 8 << 20, cpus: 2, prefault: false, ..VmConfig::default() }).unwrap();
        let before = sample(&vm);
        let space = vm.new_space().unwrap();
        let a = space.mmap(0, 64 * 4096, Prot::READ | Prot::WRITE, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        for p in 0..64 {
            space.touch(a + p * 4096, Access::Write).unwrap();
        }
        let after = sample(&vm);
        let view = View {
            title: "test".into(),
            elapsed: 1.0,
            dt: 1.0,
            stats: after.0,
            prev_stats: before.0,
            cpus: after.1,
            prev_cpus: before.1,
            finished: true,
        };
        let mut term = Terminal::new(TestBackend::new(110, 16)).unwrap();
        draw(&mut term, &view).unwrap();
        let screen: String = term.backend().buffer().content().iter().map(|c| c.symbol()).collect();
        assert!(screen.contains("faults/s 64.0"), "{screen}");
        assert!(screen.contains("shared"), "the shared slot did the faults: {screen}");
        assert!(screen.contains("finished"));
    }
}
