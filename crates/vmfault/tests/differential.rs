//! Differential test against the host kernel: the same random sequences of
//! mmap/munmap/mprotect/madvise and loads/stores run in vmfault and, with
//! real system calls, in a forked child; every result (addresses relative
//! to the window, errnos, bytes read, SIGSEGV address and code) and the
//! window's `/proc/self/maps` layout after every operation must agree.
//!
//! `VMFAULT_DIFF_CASES` sets the number of sequences (default 100, of 100
//! operations each: 10,000 operations in all, not counting shrinking).

mod common;

use common::check_against_host;
use common::ops::{file_sequence, fork_sequence, stack_sequence};
use proptest::test_runner::{Config, TestCaseError, TestRunner};

#[test]
fn differential_against_host_kernel() {
    let cases = std::env::var("VMFAULT_DIFF_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let ops = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&file_sequence(99..=99), |seq| {
        ops.fetch_add(seq.len(), std::sync::atomic::Ordering::Relaxed);
        check_against_host(&seq).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let ops = ops.into_inner();
    println!("{cases} sequences, {ops} operations: no divergence from the host kernel");
    assert!(ops >= 100 * cases as usize, "only {ops} operations ran");
}

/// Sequences that begin with a stack (`MAP_GROWSDOWN`) alone in the window,
/// so that accesses below it grow it, until mappings come within its guard
/// gap (`VMFAULT_STACK_DIFF_CASES`, default 60 sequences of 60 operations).
#[test]
fn stack_differential_against_host_kernel() {
    let cases = std::env::var("VMFAULT_STACK_DIFF_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let result = runner.run(&stack_sequence(59..=59), |seq| check_against_host(&seq).map_err(TestCaseError::fail));
    if let Err(e) = result {
        panic!("{e}");
    }
    println!("{cases} stack sequences: no divergence from the host kernel");
}

/// The same with processes: random forks, switches between the processes
/// and exits among the operations (`VMFAULT_FORK_DIFF_CASES`, default 60
/// sequences of 80 memory operations). Every process's results, bytes and
/// layout must agree with the host's, and dropping every space must give
/// every frame back.
#[test]
fn fork_differential_against_host_kernel() {
    let cases = std::env::var("VMFAULT_FORK_DIFF_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(60);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let forks = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&fork_sequence(80..=80), |seq| {
        let n = seq.iter().filter(|op| **op == common::ops::TOp::Fork).count();
        forks.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        check_against_host(&seq).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let forks = forks.into_inner();
    let pageouts = common::PAGEOUTS.load(std::sync::atomic::Ordering::Relaxed);
    let cut = common::CUT_SHORT.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "{cases} sequences with {forks} forks: no divergence from the host kernel \
         (with swap: {pageouts} pageouts, {cut} sequences cut short out of memory)"
    );
    assert!(forks >= cases as usize, "only {forks} forks ran");
    assert!(pageouts > 0, "the small machine with swap never paged out");
}
