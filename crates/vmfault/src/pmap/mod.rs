//! The pmap layer: software page tables.
//!
//! - `radix`: a 4-level radix tree of atomic entries whose nodes are frames;
//!   it is the page table and also a VM object's page index.
//! - `pte`: the PTE format.
//! - `table`: [`Pmap`](table::Pmap), one address space's page table with the
//!   range operations (zap, protect, prune) under PTE locks.
//!
//! Page-table pages are frames of the `Vm`'s physical memory, so page-table
//! memory is counted like everything else (`page_table_pages` in the stats).

pub(crate) mod pte;
pub(crate) mod radix;
pub(crate) mod table;

pub(crate) use pte::Pte;
pub(crate) use radix::{Leaf, OutOfFrames, Radix};
pub(crate) use table::{LeafHint, Missed, Pmap, SecondMmu};
