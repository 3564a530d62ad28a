//! Every field of the structures that threads share carries a lock tag.
//!
//! `lib.rs` ("Lock tags") says what protects each shared field: a tag such
//! as `[M]`, `[a]` or `[I]` in its doc comment. This test reads the crate's
//! sources and checks every field of the structures listed in [`SHARED`]:
//! its doc comment must hold a tag of the legend. A new field without one,
//! or a structure renamed away from the list, fails it.

use std::collections::BTreeMap;
use std::path::Path;

/// The structures more than one thread reaches, by the file that defines
/// them (relative to `src/`).
const SHARED: &[(&str, &str)] = &[
    ("machine.rs", "Machine"),
    ("machine.rs", "Vm"),
    ("machine.rs", "Handle"),
    ("machine.rs", "Life"),
    ("object/env.rs", "Env"),
    ("stats.rs", "CounterSet"),
    ("sync/rcu.rs", "Rcu"),
    ("sync/rcu.rs", "Slot"),
    ("sync/rcu.rs", "Polled"),
    ("sync/percpu.rs", "PerCpuCache"),
    ("sync/percpu.rs", "CpuSlot"),
    ("sync/percpu.rs", "MagSlot"),
    ("phys/mod.rs", "PhysMem"),
    ("phys/page.rs", "Page"),
    ("phys/deferred.rs", "Deferred"),
    ("phys/deferred.rs", "List"),
    ("phys/doorbell.rs", "Doorbell"),
    ("phys/queues.rs", "PageQueues"),
    ("phys/queues.rs", "List"),
    ("object/mod.rs", "Object"),
    ("object/file.rs", "FileData"),
    ("object/file.rs", "Files"),
    ("object/rmap.rs", "ObjRmap"),
    ("object/swap.rs", "Reclaimable"),
    ("aspace/mod.rs", "Space"),
    ("aspace/zones.rs", "Zones"),
    ("aspace/zones.rs", "Zone"),
    ("aspace/zones.rs", "SpaceCpu"),
    ("aspace/vma.rs", "Vma"),
    ("object/rmap.rs", "PvTable"),
    ("object/rmap.rs", "RmapTotals"),
    ("object/rmap.rs", "Inner"),
    ("object/rmap.rs", "Backings"),
    ("phys/freelist.rs", "FreeList"),
    ("pmap/radix.rs", "Radix"),
    ("pmap/table.rs", "Pmap"),
    ("stats.rs", "DaemonStats"),
    ("sync/cpu.rs", "Slot"),
    ("sync/cpu.rs", "CpuSet"),
    ("sync/rcu.rs", "RcuArc"),
    ("swapdev.rs", "Swap"),
    ("swapdev.rs", "Slots"),
];

/// The tags of `lib.rs`'s legend.
const TAGS: &str = "MVOPFQaoILST";

/// The fields of `name` in `text`, each with its doc comment.
fn fields(text: &str, name: &str) -> Option<Vec<(String, String)>> {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.iter().position(|l| {
        let l = l.trim_start();
        let l = l.strip_prefix("pub(crate) ").or_else(|| l.strip_prefix("pub ")).unwrap_or(l);
        l.strip_prefix("struct ").is_some_and(|rest| {
            rest.strip_prefix(name).is_some_and(|after| after.starts_with(' ') || after.starts_with('<'))
        }) && l.ends_with('{')
    })?;
    let mut out = Vec::new();
    let mut doc = String::new();
    for l in &lines[start + 1..] {
        let l = l.trim();
        if l == "}" {
            break;
        }
        if let Some(d) = l.strip_prefix("///") {
            doc.push_str(d);
            doc.push(' ');
        } else if l.starts_with("#[") || l.starts_with("//") || l.is_empty() {
            continue;
        } else {
            let decl = l.strip_prefix("pub(crate) ").or_else(|| l.strip_prefix("pub ")).unwrap_or(l);
            let field = decl.split(':').next().unwrap_or("").trim().to_owned();
            out.push((field, std::mem::take(&mut doc)));
        }
    }
    Some(out)
}

/// Whether `doc` holds a tag of the legend (`[X]`, in backquotes or not).
fn tagged(doc: &str) -> bool {
    let b = doc.as_bytes();
    (0..b.len().saturating_sub(2)).any(|i| b[i] == b'[' && b[i + 2] == b']' && TAGS.contains(b[i + 1] as char))
}

#[test]
fn every_shared_field_carries_a_lock_tag() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut missing = BTreeMap::new();
    for &(file, name) in SHARED {
        let text = std::fs::read_to_string(src.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let fields = fields(&text, name).unwrap_or_else(|| panic!("no struct {name} in {file}"));
        assert!(!fields.is_empty(), "{file}: struct {name} has no fields the test can read");
        for (field, doc) in fields {
            if !tagged(&doc) {
                missing.insert(format!("{file}: {name}::{field}"), doc);
            }
        }
    }
    assert!(missing.is_empty(), "fields without a lock tag (lib.rs, \"Lock tags\"): {missing:#?}");
}

#[test]
fn the_checker_reads_fields_and_tags() {
    let text = "/// A thing.\npub(crate) struct Thing<'a> {\n    /// `[a]` a count.\n    n: AtomicU64,\n    /// no tag here.\n    #[allow(dead_code)]\n    pub(crate) m: &'a u8,\n}\n";
    let f = fields(text, "Thing").unwrap();
    assert_eq!(f.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), ["n", "m"]);
    assert!(tagged(&f[0].1) && !tagged(&f[1].1));
    assert!(fields(text, "Thin").is_none(), "a prefix of a name is not the name");
}
