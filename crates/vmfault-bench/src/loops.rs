//! The per-thread loops of the workloads, generic over the [`Target`].
//!
//! Each loop checks the stop flag before every op and counts only ops that
//! completed before the flag was seen; cleanup after the flag (the last
//! unmap) is not counted.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::target::{OpError, Target};
use crate::workload::{Sizes, Workload};

const PAGE: u64 = 4096;

#[inline]
fn stopped(stop: &AtomicBool) -> bool {
    stop.load(Ordering::Relaxed)
}

/// Per-thread state made before the round starts (not timed).
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// The zero-fill buffer, touched once so the host has backed it.
    buf: Vec<u8>,
}

/// Make `w`'s per-thread state.
pub(crate) fn prepare(w: Workload, sizes: &Sizes) -> Scratch {
    match w {
        Workload::ZeroFill => Scratch { buf: vec![1u8; sizes.region as usize] },
        _ => Scratch::default(),
    }
}

/// Run `w` on one thread until `stop`; returns the ops done.
pub(crate) fn run<T: Target>(
    w: Workload,
    t: &T,
    sizes: &Sizes,
    scratch: &mut Scratch,
    stop: &AtomicBool,
) -> Result<u64, OpError> {
    match w {
        Workload::PageFault1 => fault_regions(t, sizes.region, stop),
        Workload::Ebizzy => ebizzy(t, sizes.ebizzy_chunk, stop),
        Workload::Malloc1 => malloc1(t, sizes.region, stop),
        Workload::Mmap1 => mmap1(t, sizes.region, stop),
        Workload::Brk1 => brk1(t, stop),
        Workload::Fork1 => fork1(t, FORK1_REGION, stop),
        Workload::ZeroFill => zero_fill(&mut scratch.buf, stop),
        Workload::Pft | Workload::PageFault2 | Workload::PageFault3 | Workload::Mlock1 => {
            Err(format!("{} has no free-running loop", w.name()))
        }
    }
}

/// page_fault1: map, write one byte per page, unmap; op = fault.
fn fault_regions<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        let a = t.map(len)?;
        for p in 0..len / PAGE {
            if stopped(stop) {
                break;
            }
            t.store(a + p * PAGE)?;
            ops += 1;
        }
        t.unmap(a, len)?;
    }
    Ok(ops)
}

/// ebizzy -mT: one record = map a chunk, write one byte per page, unmap.
fn ebizzy<T: Target>(t: &T, chunk: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut records = 0;
    while !stopped(stop) {
        let a = t.map(chunk)?;
        for p in 0..chunk / PAGE {
            t.store(a + p * PAGE)?;
        }
        t.unmap(a, chunk)?;
        records += 1;
    }
    Ok(records)
}

/// malloc1: a 128 MiB malloc is an mmap; glibc writes the chunk header
/// (one fault); free is a munmap.
fn malloc1<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        let a = t.map(len)?;
        t.store(a)?;
        t.unmap(a, len)?;
        ops += 1;
    }
    Ok(ops)
}

/// mmap1: map and unmap, untouched.
fn mmap1<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        let a = t.map(len)?;
        t.unmap(a, len)?;
        ops += 1;
    }
    Ok(ops)
}

/// brk1-like: a one-page "heap" grows by a page (a fixed mapping that
/// merges with it, as brk expands the heap VMA) and shrinks back.
fn brk1<T: Target>(t: &T, stop: &AtomicBool) -> Result<u64, OpError> {
    let heap = t.map(2 * PAGE)?;
    t.unmap(heap + PAGE, PAGE)?;
    let mut ops = 0;
    while !stopped(stop) {
        t.map_fixed(heap + PAGE, PAGE)?;
        t.unmap(heap + PAGE, PAGE)?;
        ops += 2;
    }
    t.unmap(heap, PAGE)?;
    Ok(ops)
}

/// What each fork1 thread maps, touches and has its children copy.
pub const FORK1_REGION: u64 = 1 << 20;

/// fork1: a touched private region; each op forks, the child writes every
/// page of it (copy-on-write faults) and exits.
fn fork1<T: Target>(t: &T, len: u64, stop: &AtomicBool) -> Result<u64, OpError> {
    let a = t.map(len)?;
    for p in 0..len / PAGE {
        t.store(a + p * PAGE)?;
    }
    let mut ops = 0;
    while !stopped(stop) {
        t.fork_touch(a, len)?;
        ops += 1;
    }
    t.unmap(a, len)?;
    Ok(ops)
}

/// The zero-fill limit: zero 4 KiB pages of a buffer as big as one
/// page_fault1 mapping, over and over.
fn zero_fill(buf: &mut [u8], stop: &AtomicBool) -> Result<u64, OpError> {
    let mut ops = 0;
    while !stopped(stop) {
        for page in buf.chunks_mut(PAGE as usize) {
            if stopped(stop) {
                break;
            }
            page.fill(0);
            std::hint::black_box(&page);
            ops += 1;
        }
    }
    Ok(ops)
}
