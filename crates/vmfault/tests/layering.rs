//! The layers import downward only.
//!
//! Reads every `crate::<module>` path in the crate's sources (comments and
//! `#[cfg(test)] mod tests` excluded: tests may reach anywhere) and checks
//! each against the layer order of `lib.rs`:
//!
//! ```text
//! types, error, stats < sync < phys < config, swapdev < pmap < object
//!     < machine < aspace (core: mod, vma, ptree, layout, rmap) < fault
//!     < aspace operations (every other aspace file) < reclaim < vm
//! ```
//!
//! An import of a higher layer is a back edge (two of them, or a longer
//! chain, make a module cycle). None is left: [`KNOWN`] is empty, and the
//! test fails on any back edge (a new one) and would on a listed one that
//! is gone (so the list could only shrink). The machine-wide context
//! every layer reaches (`machine::{Machine, Ctx}`) sits just above the
//! objects, which see only their own part of it (`object::{Env, Cx}`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Back edges still present: (from, to).
const KNOWN: &[(&str, &str)] = &[];

/// The layer order; modules on one level may import each other.
const LEVELS: &[&[&str]] = &[
    &["types", "error", "stats"],
    &["sync"],
    &["phys"],
    &["config", "swapdev"],
    &["pmap"],
    &["object"],
    &["machine"],
    &["aspace"],
    &["fault"],
    &["aspace-ops"],
    &["reclaim"],
    &["vm"],
];

/// The files of `aspace` below the fault path.
const ASPACE_CORE: &[&str] = &["mod", "vma", "ptree", "layout", "rmap"];

fn level(node: &str) -> Option<usize> {
    LEVELS.iter().position(|l| l.contains(&node))
}

/// The layer a source file (relative to `src/`) belongs to.
fn node_of(rel: &Path) -> Option<String> {
    let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let stem = |s: &str| s.trim_end_matches(".rs").to_owned();
    match parts.as_slice() {
        [file] if file == "lib.rs" => None,
        [file] => Some(stem(file)),
        [dir, file, ..] if dir == "aspace" => {
            Some(if ASPACE_CORE.contains(&stem(file).as_str()) { "aspace".into() } else { "aspace-ops".into() })
        }
        [dir, ..] => Some(dir.clone()),
        [] => None,
    }
}

/// The layer a `crate::a::b` path names.
fn target(a: &str, b: Option<&str>, src: &Path) -> String {
    if a != "aspace" {
        return a.to_owned();
    }
    match b {
        Some(sub) if !ASPACE_CORE.contains(&sub) && src.join("aspace").join(format!("{sub}.rs")).exists() => {
            "aspace-ops".into()
        }
        _ => "aspace".into(),
    }
}

fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_lowercase() || c == '_' || c.is_ascii_digit())).unwrap_or(s.len());
    &s[..end]
}

/// Every (from, to, site) import in the sources under `src`.
fn imports(src: &Path) -> Vec<(String, String, String)> {
    let mut files = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("read src") {
            let p = e.expect("dir entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let rel = f.strip_prefix(src).expect("under src");
        let Some(from) = node_of(rel) else { continue };
        let text = std::fs::read_to_string(&f).expect("read source");
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            if t.starts_with("#[cfg(")
                && t.contains("test")
                && lines.get(i + 1).is_some_and(|n| n.trim_start().starts_with("mod tests"))
            {
                break;
            }
            if t.starts_with("//") {
                continue;
            }
            let mut rest = *line;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let a = ident(rest);
                let after = &rest[a.len()..];
                let b = after.strip_prefix("::").map(ident);
                let to = target(a, b, src);
                if to != from && level(&to).is_some() {
                    out.push((from.clone(), to, format!("{}:{}", rel.display(), i + 1)));
                }
            }
        }
    }
    out
}

#[test]
fn every_module_is_in_a_layer() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for (from, to, site) in imports(&src) {
        assert!(level(&from).is_some(), "{site}: module {from} is in no layer of LEVELS");
        assert!(level(&to).is_some(), "{site}: module {to} is in no layer of LEVELS");
    }
}

#[test]
fn layers_import_downward_only() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut back: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    for (from, to, site) in imports(&src) {
        if level(&to) > level(&from) {
            back.entry((from, to)).or_default().push(site);
        }
    }
    let known: BTreeSet<(String, String)> = KNOWN.iter().map(|&(a, b)| (a.to_owned(), b.to_owned())).collect();
    let new: Vec<String> = back
        .iter()
        .filter(|(k, _)| !known.contains(*k))
        .map(|((a, b), sites)| format!("{a} -> {b} at {}", sites.join(", ")))
        .collect();
    assert!(new.is_empty(), "imports of a higher layer (move the item down, or pass it in):\n{}", new.join("\n"));
    let gone: Vec<String> =
        known.iter().filter(|k| !back.contains_key(*k)).map(|(a, b)| format!("{a} -> {b}")).collect();
    assert!(gone.is_empty(), "back edges fixed: delete them from KNOWN:\n{}", gone.join("\n"));
}

#[test]
fn the_checker_sees_a_back_edge() {
    // A scratch tree in which `phys` reaches up into `vm`: found.
    let dir = std::env::temp_dir().join(format!("vmfault-layering-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("phys")).unwrap();
    std::fs::write(dir.join("phys/mod.rs"), "// crate::vm in a comment\nuse crate::vm::Ctx;\n").unwrap();
    std::fs::write(dir.join("vm.rs"), "use crate::phys::Pfn;\n#[cfg(test)]\nmod tests {\n use crate::reclaim::X;\n}\n")
        .unwrap();
    let found = imports(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(
        found,
        vec![
            ("phys".to_owned(), "vm".to_owned(), "phys/mod.rs:2".to_owned()),
            ("vm".into(), "phys".into(), "vm.rs:1".into())
        ]
    );
}
