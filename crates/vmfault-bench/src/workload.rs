//! The workloads: what each one does, in what unit it counts, and how big
//! it is.

use serde::{Deserialize, Serialize};

/// How a point's workers share memory (will-it-scale's `-t` and `-p`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every worker in one address space (vmfault: vCPUs of one space; the
    /// host: threads of this process).
    #[default]
    Threads,
    /// Each worker in an address space of its own (vmfault: a space per
    /// worker on the same machine; the host: a forked process per worker).
    Processes,
}

impl Mode {
    /// Its name, as `--mode` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Threads => "threads",
            Mode::Processes => "processes",
        }
    }

    /// The mode called `name`.
    pub fn from_name(name: &str) -> Option<Mode> {
        [Mode::Threads, Mode::Processes].into_iter().find(|m| m.name() == name)
    }
}

/// A benchmark workload. Each has a vmfault version (through the
/// `AddressSpace` API, one vCPU per thread) and, where the host can run it,
/// a host-kernel twin with the same parameters (real `mmap`/`munmap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// will-it-scale `page_fault1`: map 128 MiB private anonymous, write
    /// one byte per page, unmap; one op = one page fault.
    #[serde(rename = "page_fault1")]
    PageFault1,
    /// will-it-scale `page_fault2`: private mapping of a 128 MiB file
    /// (copy-on-write faults).
    #[serde(rename = "page_fault2")]
    PageFault2,
    /// will-it-scale `page_fault3`: shared mapping of a 128 MiB file.
    #[serde(rename = "page_fault3")]
    PageFault3,
    /// will-it-scale `malloc1`: map 128 MiB, touch one byte, unmap.
    #[serde(rename = "malloc1")]
    Malloc1,
    /// will-it-scale `mmap1`: map and unmap 128 MiB, untouched.
    #[serde(rename = "mmap1")]
    Mmap1,
    /// RadixVM's local benchmark: each thread maps one page of its own
    /// range, writes it and unmaps it (op = the three).
    #[serde(rename = "vmlocal")]
    Vmlocal,
    /// `brk1`-like: grow a mapping by one page and shrink it back (two ops).
    #[serde(rename = "brk1")]
    Brk1,
    /// mmtests `pft`: one private region, each thread faults its share once.
    Pft,
    /// `ebizzy -mT`: map 512 KiB, write one byte per page, unmap; one op = one record.
    Ebizzy,
    /// An `mlock` loop: mlock/munlock a 64 KiB range, each worker in an
    /// address space of its own (as processes would be).
    #[serde(rename = "mlock1")]
    Mlock1,
    /// The same on one 64 KiB range of shared memory that every worker's
    /// space maps: the workers wire the same pages.
    #[serde(rename = "mlock1_shared")]
    Mlock1Shared,
    /// fork with copy-on-write: touch 1 MiB private, then loop: fork, the
    /// child writes every page and exits; one op = one fork.
    #[serde(rename = "fork1")]
    Fork1,
    /// 64 address spaces (a parent and 63 children of fork) share 64 MiB
    /// of shared anonymous memory, every page mapped in every space, then
    /// unmap it; one op = one such cycle (vmfault only: it measures the
    /// reverse map: rmap bytes, fork time, unmap time).
    #[serde(rename = "shared64")]
    Shared64,
    /// An exec loop: a new space maps a shared "binary" file (text
    /// private read-execute, data private read-write) and a stack, faults a
    /// working set, exits; one op = one exec.
    #[serde(rename = "exec1")]
    Exec1,
    /// The zero-fill limit: zeroing 4 KiB pages of the same footprint.
    ZeroFill,
}

/// Sizes of the workloads (the defaults are the originals').
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Sizes {
    /// Mapping size of page_fault1/malloc1/mmap1 and the zero-fill buffer, per thread.
    pub region: u64,
    /// pft's region, shared by all threads.
    pub pft_region: u64,
    /// ebizzy's record size.
    pub ebizzy_chunk: u64,
    /// shared64's shared region (mapped by all 64 spaces).
    pub shared_region: u64,
}

impl Sizes {
    /// The originals' sizes: 128 MiB, 256 MiB, 512 KiB.
    pub const FULL: Sizes =
        Sizes { region: 128 << 20, pft_region: 256 << 20, ebizzy_chunk: 512 << 10, shared_region: 64 << 20 };
    /// Smaller sizes for `--quick` runs and tests.
    pub const QUICK: Sizes =
        Sizes { region: 16 << 20, pft_region: 32 << 20, ebizzy_chunk: 512 << 10, shared_region: 16 << 20 };
    /// Tiny sizes, for tests that only check that everything runs.
    pub const TINY: Sizes =
        Sizes { region: 256 << 10, pft_region: 512 << 10, ebizzy_chunk: 64 << 10, shared_region: 256 << 10 };
}

impl Workload {
    /// Every workload, in display order.
    pub const ALL: [Workload; 15] = [
        Workload::PageFault1,
        Workload::PageFault2,
        Workload::PageFault3,
        Workload::Malloc1,
        Workload::Mmap1,
        Workload::Brk1,
        Workload::Vmlocal,
        Workload::Pft,
        Workload::Ebizzy,
        Workload::Mlock1,
        Workload::Mlock1Shared,
        Workload::Fork1,
        Workload::Shared64,
        Workload::Exec1,
        Workload::ZeroFill,
    ];

    /// What `vmfault bench` runs without arguments.
    pub const DEFAULT_SUITE: [Workload; 6] =
        [Workload::PageFault1, Workload::Pft, Workload::Ebizzy, Workload::Malloc1, Workload::Mmap1, Workload::Brk1];

    /// The name used on the command line and in results.
    pub fn name(self) -> &'static str {
        match self {
            Workload::PageFault1 => "page_fault1",
            Workload::PageFault2 => "page_fault2",
            Workload::PageFault3 => "page_fault3",
            Workload::Malloc1 => "malloc1",
            Workload::Mmap1 => "mmap1",
            Workload::Brk1 => "brk1",
            Workload::Vmlocal => "vmlocal",
            Workload::Pft => "pft",
            Workload::Ebizzy => "ebizzy",
            Workload::Mlock1 => "mlock1",
            Workload::Mlock1Shared => "mlock1_shared",
            Workload::Fork1 => "fork1",
            Workload::Shared64 => "shared64",
            Workload::Exec1 => "exec1",
            Workload::ZeroFill => "zero_fill",
        }
    }

    /// The workload with this name.
    pub fn from_name(name: &str) -> Option<Workload> {
        Workload::ALL.into_iter().find(|w| w.name() == name)
    }

    /// One line about what it does.
    pub fn describe(self) -> &'static str {
        match self {
            Workload::PageFault1 => "map 128 MiB private anonymous, write one byte per page, unmap (op = fault)",
            Workload::PageFault2 => "private mapping of a 128 MiB file, write one byte per page (copy-on-write faults)",
            Workload::PageFault3 => "shared mapping of a 128 MiB file, write one byte per page",
            Workload::Malloc1 => "map 128 MiB, touch one byte, unmap (op = loop)",
            Workload::Mmap1 => "map and unmap 128 MiB, untouched (op = loop)",
            Workload::Brk1 => "grow a mapping by one page and shrink it back (op = grow or shrink)",
            Workload::Vmlocal => {
                "RadixVM's local: map one page of the thread's own range, write it, unmap it (op = loop)"
            }
            Workload::Pft => "one private region, each thread faults its share once (op = fault)",
            Workload::Ebizzy => "ebizzy -mT: map 512 KiB, write one byte per page, unmap (op = record)",
            Workload::Mlock1 => {
                "each worker in a space of its own mlocks and munlocks its own 64 KiB in a loop (op = mlock+munlock)"
            }
            Workload::Mlock1Shared => {
                "each worker in a space of its own mlocks and munlocks one 64 KiB of shared memory (op = mlock+munlock)"
            }
            Workload::Fork1 => {
                "touch 1 MiB private, then fork; the child writes every page (copy-on-write) and exits (op = fork)"
            }
            Workload::Shared64 => {
                "64 spaces (fork) share 64 MiB of shared anonymous memory, every page mapped in each, then unmap (op = cycle)"
            }
            Workload::Exec1 => {
                "exec-like: new space maps a shared 1 MiB binary + data + stack, faults 96 pages, exits (op = exec)"
            }
            Workload::ZeroFill => "zero 4 KiB pages of the same footprint (op = page): the zero-fill limit",
        }
    }

    /// Whether it runs in processes mode too (will-it-scale's `-p`): the
    /// will-it-scale-like loops, each worker's on its own memory. pft and
    /// ebizzy are threaded programs, shared64 and the mlock loops arrange
    /// their own spaces, zero-fill is a reference.
    pub fn has_processes_mode(self) -> bool {
        matches!(
            self,
            Workload::PageFault1
                | Workload::PageFault2
                | Workload::PageFault3
                | Workload::Malloc1
                | Workload::Mmap1
                | Workload::Vmlocal
                | Workload::Brk1
                | Workload::Fork1
                | Workload::Exec1
        )
    }

    /// Whether the host kernel runs a twin of it.
    pub fn host_twin(self) -> bool {
        !matches!(self, Workload::Shared64 | Workload::Mlock1 | Workload::Mlock1Shared)
    }

    /// The unit of one op.
    pub fn op_unit(self) -> &'static str {
        match self {
            Workload::PageFault1 | Workload::PageFault2 | Workload::PageFault3 | Workload::Pft => "faults",
            Workload::Ebizzy => "records",
            Workload::Shared64 => "cycles",
            Workload::Exec1 => "execs",
            Workload::ZeroFill => "pages",
            _ => "ops",
        }
    }

    /// Bytes of vmfault physical memory one thread needs at most.
    pub fn footprint_per_thread(self, sizes: &Sizes) -> u64 {
        match self {
            Workload::PageFault1 | Workload::PageFault3 => sizes.region,
            // The file's cached pages and the private copies.
            Workload::PageFault2 => 2 * sizes.region,
            Workload::Malloc1
            | Workload::Mmap1
            | Workload::Brk1
            | Workload::Vmlocal
            | Workload::Mlock1
            | Workload::Mlock1Shared
            | Workload::Fork1
            | Workload::ZeroFill => 1 << 20,
            // The region, and the 64 spaces' page tables (1/512 of it each).
            Workload::Shared64 => sizes.shared_region + sizes.shared_region / 8 + (1 << 20),
            Workload::Exec1 => 1 << 20,
            Workload::Pft => 0,
            Workload::Ebizzy => sizes.ebizzy_chunk,
        }
    }

    /// Bytes one thread cycles through: the footprint of its zero-fill limit
    /// (a 512 KiB ebizzy record stays in cache; a 128 MiB region does not).
    pub fn zero_fill_footprint(self, sizes: &Sizes) -> u64 {
        if self == Workload::Ebizzy { sizes.ebizzy_chunk } else { sizes.region }
    }

    /// Bytes of vmfault physical memory shared by all threads.
    pub fn footprint_shared(self, sizes: &Sizes) -> u64 {
        match self {
            Workload::Pft => sizes.pft_region,
            Workload::Exec1 => crate::loops::EXEC1_IMAGE.text + crate::loops::EXEC1_IMAGE.data,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for w in Workload::ALL {
            assert_eq!(Workload::from_name(w.name()), Some(w));
            let json = serde_json::to_string(&w).unwrap();
            assert_eq!(json, format!("\"{}\"", w.name()));
        }
        assert_eq!(Workload::from_name("nope"), None);
    }
}
