//! Deterministic scenarios, each compared with the host kernel like the
//! differential test: one per splitting, merging, accounting or error rule
//! that random sequences rarely reach on their own.

mod common;

use common::check_against_host;
use common::ops::{AbsOp, P, Place, TOp};

const R: u32 = libc::PROT_READ as u32;
const RW: u32 = (libc::PROT_READ | libc::PROT_WRITE) as u32;
const RX: u32 = (libc::PROT_READ | libc::PROT_EXEC) as u32;
const RWX: u32 = RW | libc::PROT_EXEC as u32;
const NONE: u32 = 0;

fn anon(private: bool) -> u32 {
    (if private { libc::MAP_PRIVATE } else { libc::MAP_SHARED } | libc::MAP_ANONYMOUS) as u32
}

fn map(page: u64, pages: u64, prot: u32, private: bool) -> TOp {
    TOp::Mmap { place: Place::Fixed, off: page * P, len: pages * P, prot, flags: anon(private) }
}

fn map_flags(page: u64, pages: u64, prot: u32, flags: u32) -> TOp {
    TOp::Mmap { place: Place::Fixed, off: page * P, len: pages * P, prot, flags }
}

fn protect(page: u64, pages: u64, prot: u32) -> TOp {
    TOp::Mprotect { off: page * P, len: pages * P, prot }
}

fn advise(page: u64, pages: u64, advice: i32) -> TOp {
    TOp::Madvise { off: page * P, len: pages * P, advice }
}

/// `mremap` of `pages` at `page` to `new_pages`, with raw `MREMAP_*`
/// flags, to `new_page` (with `MREMAP_FIXED`).
fn remap(page: u64, pages: u64, new_pages: u64, flags: i32, new_page: u64) -> TOp {
    TOp::Mremap {
        off: page * P,
        old_len: pages * P,
        new_len: new_pages * P,
        flags: flags as u32,
        new_off: new_page * P,
    }
}

fn store(page: u64) -> TOp {
    TOp::Write { off: page * P + 7, len: 3, seed: page as u8 }
}

fn load(page: u64, pages: u64) -> TOp {
    TOp::Read { off: page * P, len: pages * P }
}

fn check(ops: &[TOp]) {
    if let Err(e) = check_against_host(ops) {
        panic!("{e}");
    }
}

#[test]
fn mprotect_changes_mappings_before_a_hole_then_fails() {
    check(&[map(0, 4, RW, true), map(6, 4, RW, true), protect(0, 10, R), store(0), load(0, 10)]);
}

#[test]
fn untouched_private_memory_made_read_only_loses_its_charge_and_merges() {
    check(&[map(0, 4, RW, true), protect(0, 4, R), map(4, 4, R, true)]);
}

#[test]
fn touched_private_memory_keeps_its_charge_and_does_not_merge() {
    check(&[map(0, 4, RW, true), store(0), protect(0, 4, R), map(4, 4, R, true)]);
}

#[test]
fn a_neighbour_without_object_merges_once_compatible() {
    check(&[map(0, 4, RW, true), map(4, 4, R, true), store(0), protect(4, 4, RW), store(4)]);
}

#[test]
fn first_write_fault_adopts_the_neighbours_object() {
    check(&[map(0, 4, RW, true), map(4, 4, RX, true), store(0), protect(4, 4, RWX), store(4), protect(4, 4, RW)]);
}

#[test]
fn filling_the_gap_between_two_objects_merges_left_only() {
    check(&[map(0, 4, RW, true), map(5, 4, RW, true), store(0), store(5), map(4, 1, RW, true)]);
}

#[test]
fn fixed_over_the_middle_of_a_mapping_merges_back() {
    check(&[map(0, 8, RW, true), store(0), store(3), map(2, 2, RW, true), load(0, 8)]);
    check(&[map(0, 8, RW, true), map(2, 2, RW, true)]);
}

#[test]
fn zero_lengths_and_overflows() {
    check(&AbsOp::ALL.map(TOp::Abs));
    check(&[
        TOp::Munmap { off: 0, len: 0 },
        TOp::Mprotect { off: 0, len: 0, prot: R },
        TOp::Madvise { off: 0, len: 0, advice: libc::MADV_DONTNEED },
        TOp::Mmap { place: Place::Fixed, off: 0, len: 0, prot: R, flags: anon(true) },
        TOp::Mprotect { off: 0, len: P, prot: 0x100 },
        TOp::Mmap { place: Place::Fixed, off: 5, len: P, prot: R, flags: anon(true) },
        TOp::Munmap { off: 5, len: P },
    ]);
}

#[test]
fn madvise_skips_holes_and_reports_them() {
    check(&[
        map(0, 2, RW, true),
        store(0),
        map(4, 2, RW, true),
        store(4),
        advise(0, 6, libc::MADV_DONTNEED),
        load(0, 2),
        load(4, 2),
        advise(8, 2, libc::MADV_DONTNEED),
        advise(40, 2, libc::MADV_WILLNEED),
    ]);
}

#[test]
fn madvise_random_and_sequential_split_and_normal_merges() {
    check(&[
        map(0, 2, RW, true),
        map(4, 4, RW, true),
        advise(0, 2, libc::MADV_RANDOM),
        advise(4, 1, libc::MADV_RANDOM),
        advise(6, 1, libc::MADV_SEQUENTIAL),
        advise(4, 4, libc::MADV_NORMAL),
    ]);
}

#[test]
fn noreserve_does_not_merge_with_reserved() {
    let nr = libc::MAP_NORESERVE as u32;
    check(&[map(0, 2, RW, true), map_flags(2, 2, RW, anon(true) | nr), map_flags(4, 2, R, anon(true) | nr)]);
}

#[test]
fn shared_mappings_split_merge_back_and_keep_data() {
    check(&[
        map(0, 6, RW, false),
        store(0),
        store(3),
        protect(2, 2, R),
        protect(2, 2, RW),
        map(6, 2, RW, false),
        advise(0, 8, libc::MADV_DONTNEED),
        load(0, 6),
        protect(0, 6, NONE),
        protect(0, 6, RW),
        load(0, 4),
    ]);
}

#[test]
fn private_data_survives_prot_none_and_dies_with_dontneed() {
    check(&[
        map(0, 4, RW, true),
        store(1),
        protect(0, 4, NONE),
        load(1, 1),
        TOp::Touch { off: P, write: true },
        protect(0, 4, R),
        load(1, 1),
        TOp::Touch { off: P, write: true },
        protect(0, 4, RW),
        advise(1, 1, libc::MADV_DONTNEED),
        load(0, 4),
    ]);
}

#[test]
fn write_only_and_exec_mappings() {
    check(&[map(0, 2, libc::PROT_WRITE as u32, true), store(0), load(0, 1), map(2, 2, RX, true), load(2, 1), store(2)]);
}

#[test]
fn accesses_cross_into_holes_and_protected_pages() {
    check(&[
        map(0, 2, RW, true),
        map(3, 1, R, true),
        TOp::Write { off: P + 100, len: 2 * P, seed: 9 },
        load(0, 2),
        TOp::Write { off: 3 * P - 10, len: 20, seed: 1 },
        TOp::Read { off: P + 4000, len: 3 * P },
        map(2, 1, NONE, true),
        TOp::Read { off: P + 4000, len: 3 * P },
        TOp::Touch { off: 2 * P, write: false },
    ]);
}

#[test]
fn fixed_noreplace_and_hints() {
    check(&[
        map(4, 4, RW, true),
        TOp::Mmap { place: Place::NoReplace, off: 6 * P, len: 4 * P, prot: RW, flags: anon(true) },
        TOp::Mmap { place: Place::NoReplace, off: 8 * P, len: 4 * P, prot: RW, flags: anon(true) },
        TOp::Mmap { place: Place::NoReplace, off: 20 * P + 1, len: P, prot: RW, flags: anon(true) },
        TOp::Mmap { place: Place::HintShared, off: 30 * P, len: 2 * P, prot: RW, flags: anon(false) },
        TOp::Mmap { place: Place::HintShared, off: 5 * P, len: 2 * P, prot: RW, flags: anon(false) },
        TOp::Mmap { place: Place::AnywhereShared, off: 0, len: 2 * P, prot: RW, flags: anon(false) },
    ]);
}

#[test]
fn populate_faults_everything_in() {
    let pop = libc::MAP_POPULATE as u32;
    check(&[
        map_flags(0, 4, RW, anon(true) | pop),
        map_flags(8, 4, R, anon(true) | pop),
        map_flags(16, 2, RW, anon(false) | pop),
        load(0, 18),
    ]);
}

/// mprotect faults locked private memory that becomes writable in VMA by
/// VMA: the first VMA gets its object before the second changes, and the
/// second then merges with it but not with a neighbour that has another.
#[test]
fn mprotect_populates_locked_memory_vma_by_vma() {
    check(&[
        map(0, 6, R, true),
        TOp::Mlock { off: 0, len: 4 * P },
        protect(0, 2, RX),
        protect(3, 3, RW),
        protect(1, 3, RW),
        load(0, 6),
        store(2),
        load(0, 6),
    ]);
}

const MOVE_TO: i32 = libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED;

/// A part of a private mapping moved away (by copy here, into a new
/// object) comes back whole to its first address: Linux's moved VMA kept
/// the mapping's anon_vma, so the three merge again; here the piece goes
/// back into the rest's object.
#[test]
fn a_piece_moved_away_and_back_merges_with_the_rest() {
    check(&[map(0, 32, RW, true), store(16), remap(16, 4, 4, MOVE_TO, 40), remap(40, 4, 4, MOVE_TO, 16), load(0, 32)]);
    // The same with the old range left mapped (MREMAP_DONTUNMAP), then
    // unmapped before the piece comes back.
    check(&[
        map(0, 32, RW, true),
        store(16),
        remap(16, 4, 4, MOVE_TO | libc::MREMAP_DONTUNMAP, 40),
        TOp::Munmap { off: 16 * P, len: 4 * P },
        remap(40, 4, 4, MOVE_TO, 16),
        load(0, 32),
    ]);
}

/// Back at its first distance between address and page offset but not
/// next to the rest, the piece merges once the rest grows up to it.
#[test]
fn a_piece_moved_back_apart_merges_when_the_rest_grows_to_it() {
    check(&[
        map(0, 16, RW, true),
        store(12),
        store(15),
        remap(12, 4, 4, MOVE_TO, 40),
        TOp::Munmap { off: 40 * P, len: 2 * P },
        remap(42, 2, 2, MOVE_TO, 14),
        remap(0, 12, 14, 0, 0),
        load(0, 16),
    ]);
}

/// The stack differential test's case (shrunk): a stack grown down to
/// the window's start, a part moved with MREMAP_DONTUNMAP, and a page of
/// that part moved back into a hole of the stack, a move that also
/// unmaps the rest of the part (`mremap_to` shrinking it).
#[test]
fn a_stack_piece_moved_back_merges_with_the_stack() {
    let stack = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_GROWSDOWN) as u32;
    check(&[
        map_flags(36, 12, RW, stack),
        TOp::FetchAdd { off: 0, val: 0 },
        remap(17, 7, 7, MOVE_TO | libc::MREMAP_DONTUNMAP, 5),
        remap(5, 9, 1, MOVE_TO, 17),
    ]);
}

/// A move of several mappings with MREMAP_DONTUNMAP (Linux 6.17 on)
/// empties each old range as its piece moves: the first piece is a part
/// of its mapping then, so the old mapping keeps its anon_vma, even once
/// the next piece's destination, unmapped first, cuts the rest away and
/// leaves the old range a mapping of its own. It keeps its page offsets
/// when it moves on, so it stays apart from untouched memory whose
/// offsets only its address would continue.
#[test]
fn a_part_emptied_by_a_move_of_several_mappings_keeps_its_offsets() {
    let dontunmap = MOVE_TO | libc::MREMAP_DONTUNMAP;
    check(&[
        map(0, 10, RW, true),
        map(10, 6, R, true),
        store(4),
        remap(9, 2, 2, dontunmap, 7),
        map(30, 4, RW, true),
        remap(9, 1, 1, MOVE_TO, 29),
        load(29, 5),
    ]);
}

/// The stack differential test's case (shrunk): a locked part of a grown
/// stack and a page of the stack moved with MREMAP_DONTUNMAP to just
/// below them, which cuts the locked part's old range off; that range,
/// moved again with the rest, keeps its offsets and stays apart from the
/// stack's top.
#[test]
fn a_stack_part_emptied_by_a_move_of_several_mappings_stays_apart() {
    let stack = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_GROWSDOWN) as u32;
    let dontunmap = MOVE_TO | libc::MREMAP_DONTUNMAP;
    check(&[
        map_flags(36, 12, RW, stack),
        load(0, 1),
        TOp::Mlock { off: 15 * P, len: 13 * P },
        remap(27, 2, 2, dontunmap, 25),
        remap(16, 12, 12, dontunmap, 33),
    ]);
}

/// In a fork child, a mapping whose object came through the fork grows in
/// place up to a neighbour without an object: Linux (6.16 on) merges them,
/// since the grown range is new and carries the mapping's own anon_vma
/// (`vma_merge_extend`: no existing VMA lends its anon_vma, so fork
/// ancestry is not asked). Found by the fork differential test.
#[test]
fn a_fork_child_mapping_grown_up_to_a_neighbour_without_object_merges() {
    check(&[
        map(0, 40, RW, true),
        remap(26, 11, 10, 0, 0),
        store(34),
        TOp::Fork,
        TOp::Exit,
        TOp::Switch(1),
        remap(26, 10, 11, libc::MREMAP_MAYMOVE, 0),
        store(36),
        load(24, 16),
    ]);
    // The neighbour over offsets whose pages the parent's object still
    // holds: they read as zeros after the merge.
    let mut ops = vec![map(0, 8, RW, true)];
    ops.extend((0..8).map(store));
    ops.extend([
        TOp::Fork,
        TOp::Switch(1),
        TOp::Munmap { off: 4 * P, len: 4 * P },
        map(5, 3, RW, true),
        remap(0, 4, 5, libc::MREMAP_MAYMOVE, 0),
        load(0, 8),
        store(6),
        TOp::Switch(0),
        load(0, 8),
    ]);
    check(&ops);
}

/// The same kind of neighbour met by a move: a fork child's mapping moved
/// away, a mapping without object put after its old place, and the
/// mapping moved back (with and without `MREMAP_DONTUNMAP`).
#[test]
fn a_fork_child_mapping_moved_back_next_to_a_neighbour_without_object() {
    for flags in [MOVE_TO, MOVE_TO | libc::MREMAP_DONTUNMAP] {
        check(&[
            map(0, 4, RW, true),
            store(0),
            TOp::Fork,
            TOp::Switch(1),
            remap(0, 4, 4, MOVE_TO, 20),
            map(4, 3, RW, true),
            remap(20, 4, 4, flags, 0),
            store(5),
            load(0, 8),
        ]);
    }
}
