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
use common::ops::sequence;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

#[test]
fn differential_against_host_kernel() {
    let cases = std::env::var("VMFAULT_DIFF_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let ops = std::sync::atomic::AtomicUsize::new(0);
    let result = runner.run(&sequence(99..=99), |seq| {
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
