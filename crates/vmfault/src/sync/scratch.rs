//! A thread's reusable buffer: a `Vec` taken from a thread-local and put
//! back, emptied, when dropped, so that code which gathers a batch outside
//! a lock (aged snapshots, aged deferred drops) allocates nothing once the
//! buffer has grown to its largest batch (or from the start: `reserve`
//! gives the thread's buffer its room ahead of its first use). A nested use
//! while the buffer is out gets a new one; the larger of the two is kept.
//!
//! ```ignore
//! thread_local! { static BUF: Cell<Vec<u64>> = const { Cell::new(Vec::new()) }; }
//! let mut b = Scratch::take(&BUF);
//! b.push(1);
//! ```

use std::cell::Cell;
use std::thread::LocalKey;

/// A buffer out of its thread-local home (see the module docs).
pub(crate) struct Scratch<T: 'static> {
    items: Vec<T>,
    home: &'static LocalKey<Cell<Vec<T>>>,
}

impl<T: 'static> Scratch<T> {
    /// The thread's buffer from `home` (empty; a new one while it is out,
    /// or while the thread ends).
    pub(crate) fn take(home: &'static LocalKey<Cell<Vec<T>>>) -> Scratch<T> {
        Scratch { items: home.try_with(Cell::take).unwrap_or_default(), home }
    }

    /// [`take`](Scratch::take), with room for at least `room` items: a
    /// buffer sized for its usual high mark at its thread's first use, not
    /// grown at each new high (a heap allocation in the middle of a run).
    pub(crate) fn take_with_room(home: &'static LocalKey<Cell<Vec<T>>>, room: usize) -> Scratch<T> {
        let mut s = Scratch::take(home);
        if s.items.capacity() < room {
            s.items.reserve(room);
        }
        s
    }

    /// Give this thread's buffer in `home` room for `room` items now (a
    /// thread that becomes a vCPU, `Vm::attach`), so that
    /// [`take_with_room`](Scratch::take_with_room) finds it there instead
    /// of allocating it at its first use, in the middle of some operation.
    pub(crate) fn reserve(home: &'static LocalKey<Cell<Vec<T>>>, room: usize) {
        drop(Scratch::take_with_room(home, room));
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Scratch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.items.fmt(f)
    }
}

impl<T> std::ops::Deref for Scratch<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.items
    }
}

impl<T> std::ops::DerefMut for Scratch<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.items
    }
}

impl<T> Drop for Scratch<T> {
    fn drop(&mut self) {
        // What is left is dropped here, before the buffer goes home.
        self.items.clear();
        let items = std::mem::take(&mut self.items);
        let _ = self.home.try_with(|c| {
            let other = c.take();
            c.set(if other.capacity() > items.capacity() { other } else { items });
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    thread_local! { static BUF: Cell<Vec<u32>> = const { Cell::new(Vec::new()) }; }

    #[test]
    fn the_buffer_comes_back_with_its_room_and_a_nested_one_is_new() {
        std::thread::spawn(|| {
            let ptr = {
                let mut b = Scratch::take(&BUF);
                b.extend(0..100);
                let nested = Scratch::take(&BUF);
                assert_eq!(nested.capacity(), 0, "the buffer is out: a new one");
                drop(nested);
                b.as_ptr()
            };
            let b = Scratch::take(&BUF);
            assert!(b.is_empty() && b.capacity() >= 100);
            assert_eq!(b.as_ptr(), ptr, "the same allocation again");
        })
        .join()
        .unwrap();
    }
}
