//! A second MMU behind the page table (`pmap::SecondMmu`) hears of every
//! PTE that loses its frame or a right, whichever operation did it, and of
//! nothing else: the interface a host view sits behind.

use std::sync::{Arc, Mutex};

use crate::config::{FaultPath, VmConfig};
use crate::machine::Vm;
use crate::pmap::SecondMmu;
use crate::types::{Access, Advice, MapFlags, PAGE_SIZE, Prot};

/// Records the ranges it is told of.
#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<(u64, u64)>>);

impl SecondMmu for Recorder {
    fn invalidate(&self, start: u64, end: u64) {
        self.0.lock().unwrap().push((start, end));
    }
}

impl Recorder {
    /// Whether page `addr` was invalidated since the last call; forgets.
    fn saw(&self, addr: u64) -> bool {
        let mut v = self.0.lock().unwrap();
        let seen = v.iter().any(|&(s, e)| s <= addr && addr + PAGE_SIZE <= e);
        v.clear();
        seen
    }

    fn quiet(&self) -> bool {
        let mut v = self.0.lock().unwrap();
        let q = v.is_empty();
        v.clear();
        q
    }
}

#[test]
fn a_second_mmu_hears_of_every_lost_frame_or_right_and_nothing_else() {
    for path in [FaultPath::MapLock, FaultPath::Speculative, FaultPath::VmaLock] {
        let vm = Vm::new(VmConfig {
            phys_bytes: 16 << 20,
            cpus: 2,
            prefault: false,
            fault_path: path,
            ..VmConfig::default()
        })
        .unwrap();
        let _cpu = vm.attach().unwrap();
        let space = vm.new_space().unwrap();
        let rec = Arc::new(Recorder::default());
        let second: Arc<dyn SecondMmu> = rec.clone();
        space.s.pmap.attach_second(second.clone());
        let rw = Prot::READ | Prot::WRITE;
        let a = space.mmap(0, 6 * PAGE_SIZE, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        let page = |i: u64| a + i * PAGE_SIZE;
        for i in 0..6 {
            space.write(page(i), b"x").unwrap();
        }
        assert!(rec.quiet(), "{path:?}: installing where nothing was takes nothing away");
        // A read of untouched memory maps the zero page; the write after
        // it replaces that frame.
        let b = space.mmap(0, PAGE_SIZE, rw, MapFlags::PRIVATE | MapFlags::ANONYMOUS).unwrap();
        space.touch(b, Access::Read).unwrap();
        assert!(rec.quiet(), "{path:?}");
        space.write(b, b"y").unwrap();
        assert!(rec.saw(b), "{path:?}: the zero page's PTE gave way to a new frame");
        // Narrowed: write taken away.
        space.mprotect(page(1), PAGE_SIZE, Prot::READ).unwrap();
        assert!(rec.saw(page(1)), "{path:?}: mprotect to read-only");
        // Widened again, then written: the same frame, more rights.
        space.mprotect(page(1), PAGE_SIZE, rw).unwrap();
        space.write(page(1), b"z").unwrap();
        assert!(rec.quiet(), "{path:?}: widening takes nothing away");
        // Dropped.
        space.madvise(page(2), PAGE_SIZE, Advice::DontNeed).unwrap();
        assert!(rec.saw(page(2)), "{path:?}: MADV_DONTNEED");
        // Fork narrows the parent's private pages to read-only, and the
        // parent's next write copies its page: another frame.
        let child = space.fork().unwrap();
        assert!(rec.saw(page(0)), "{path:?}: fork write-protects");
        space.write(page(0), b"w").unwrap();
        assert!(rec.saw(page(0)), "{path:?}: copy-on-write replaces the frame");
        drop(child);
        // Unmapped.
        space.munmap(page(3), 2 * PAGE_SIZE).unwrap();
        assert!(rec.saw(page(3)), "{path:?}: munmap");
        space.munmap(page(5), PAGE_SIZE).unwrap();
        assert!(rec.saw(page(5)), "{path:?}: munmap");
        // Detached: hears nothing more.
        space.s.pmap.detach_second(&second);
        space.munmap(a, 6 * PAGE_SIZE).unwrap();
        assert!(rec.quiet(), "{path:?}: detached");
    }
}
