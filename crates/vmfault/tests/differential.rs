//! Differential test against the host kernel: the same random sequences of
//! mmap/munmap/mprotect/madvise and loads/stores run in vmfault and, with
//! real system calls, in a forked child; every result (addresses relative
//! to the window, errnos, bytes read, SIGSEGV address and code) and the
//! window's `/proc/self/maps` layout after every operation must agree.
//!
//! `VMFAULT_DIFF_CASES` sets the number of sequences (default 100, of up to
//! 100 operations each: about 10,000 operations in all).

mod common;

use common::check_against_host;
use common::ops::sequence;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

#[test]
fn differential_against_host_kernel() {
    let cases = std::env::var("VMFAULT_DIFF_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(100);
    let mut runner = TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let result = runner.run(&sequence(0..=99), |ops| check_against_host(&ops).map_err(TestCaseError::fail));
    if let Err(e) = result {
        panic!("{e}");
    }
}
