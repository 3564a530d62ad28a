//! Records the commit the `vmfault` binary is built from, for the
//! `run.commit` field of `bench`'s results: a short hash, with `-dirty`
//! when tracked files had uncommitted changes, or `unknown` outside a git
//! checkout (a packaged crate). Never fails the build.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = match git(&["rev-parse", "--short=12", "HEAD"]) {
        Some(hash) if !hash.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
            if dirty { format!("{hash}-dirty") } else { hash }
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=VMFAULT_COMMIT={commit}");
    // Build again when the commit, the staged state or the sources move
    // (a commit rewrites the first two; an edit is `-dirty`); only for
    // paths that exist, since a missing one would make every build run
    // this again.
    println!("cargo:rerun-if-changed=build.rs");
    for dir in ["src", "../vmfault/src", "../vmfault-bench/src", "../vmfault-check/src"] {
        if std::path::Path::new(dir).exists() {
            println!("cargo:rerun-if-changed={dir}");
        }
    }
    if let Some(dir) = git(&["rev-parse", "--git-dir"]) {
        for f in ["HEAD", "index"] {
            let p = std::path::Path::new(&dir).join(f);
            if p.exists() {
                println!("cargo:rerun-if-changed={}", p.display());
            }
        }
    }
}
