//! `vmfault check`: long differential runs against the host kernel.
//!
//! Random operation sequences (the test suite's generator, with forks,
//! shared file mappings, `msync` and a small machine that pages out to
//! swap) run with real system calls in a forked child and on vmfault;
//! every result, every byte read, the window's layout after every
//! operation and the file at the end must agree. The first divergence is
//! shrunk to a minimal sequence and printed; the exit status is then 1.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use clap::Args;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use vmfault_check::ops::{TOp, file_sequence, fork_sequence};

#[derive(Args, Debug)]
pub(crate) struct CheckArgs {
    /// Memory operations to run in all (sequences of about 90; forks, switches and exits not counted).
    #[arg(long, default_value_t = 10_000)]
    ops: u64,
    /// Seed of the random sequences: the same seed runs the same sequences.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Only this fault path (maplock, spf, vmalock), with and without swap (and pv entries for spf);
    /// default: the test suite's configurations (every path, pv, swap).
    #[arg(long, value_name = "PATH")]
    fault_path: Option<String>,
}

pub(crate) fn run(a: CheckArgs) -> Result<(), String> {
    let configs = match &a.fault_path {
        Some(p) => {
            let mut c = vmfault::VmConfig::default();
            c.set("fault_path", p).map_err(|e| format!("--fault-path {p}: {e}"))?;
            vmfault_check::configs_for(c.fault_path)
        }
        None => vmfault_check::all_configs(),
    };
    let names: Vec<String> = configs.iter().map(|c| c.to_string()).collect();
    eprintln!("vmfault check: {} operations, seed {}, in {}", a.ops, a.seed, names.join("; "));
    let mut seed = [0u8; 32];
    for (i, chunk) in seed.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&a.seed.wrapping_add(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    }
    // Half plain sequences, half with processes.
    let strategy = proptest::prop_oneof![file_sequence(89..=89), fork_sequence(80..=80)];
    let cases = a.ops.div_ceil(85).max(1);
    let config = Config {
        cases: u32::try_from(cases).map_err(|_| format!("--ops {}: too many", a.ops))?,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed));
    let (ops, seqs, files) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let start = Instant::now();
    let last = std::sync::Mutex::new(Instant::now());
    let result = runner.run(&strategy.boxed(), |seq: Vec<TOp>| {
        let r = vmfault_check::check_configs(&seq, &configs).map_err(TestCaseError::fail);
        if r.is_ok() {
            ops.fetch_add(seq.iter().filter(|op| !op.is_process_op()).count() as u64, Ordering::Relaxed);
            files.fetch_add(
                seq.iter().filter(|op| matches!(op, TOp::MmapFile { .. } | TOp::Msync { .. })).count() as u64,
                Ordering::Relaxed,
            );
            let n = seqs.fetch_add(1, Ordering::Relaxed) + 1;
            let mut l = last.lock().unwrap_or_else(|p| p.into_inner());
            if l.elapsed().as_secs() >= 10 {
                *l = Instant::now();
                eprintln!(
                    "  {:>6.0} s: {n} sequences, {} operations, no divergence",
                    start.elapsed().as_secs_f64(),
                    ops.load(Ordering::Relaxed)
                );
            }
        }
        r
    });
    let (ops, seqs, files) = (ops.into_inner(), seqs.into_inner(), files.into_inner());
    let pageouts = vmfault_check::PAGEOUTS.load(Ordering::Relaxed);
    match result {
        Ok(()) => {
            println!(
                "vmfault check: {seqs} sequences, {ops} operations ({files} on files), seed {}, {:.0} s: \
                 0 divergences from the host kernel ({pageouts} pageouts on the small machine)",
                a.seed,
                start.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Err(e) => Err(format!("divergence after {seqs} sequences ({ops} operations), seed {}:\n{e}", a.seed)),
    }
}
