//! A persistent ordered map from `u64` keys: the storage of the VMA index.
//!
//! Lockless faults read the VMA index inside an RCU section while a writer
//! (under the map lock) changes it, so the writer must never change a node
//! a reader can reach. Here a version of the map is an immutable tree: the
//! writer copies the nodes on the path it changes (`Arc::make_mut`) and
//! shares the rest with the versions readers hold; publishing a version is
//! one pointer, and an old version is dropped after a grace period, which
//! frees exactly the nodes no newer version shares. A change costs
//! O(log n) node copies, not a copy of the index, as the first design (a
//! sorted array rebuilt after each change) did: that would copy 65,530
//! pointers per `mmap` at `MAX_MAP_COUNT`. Linux's maple tree is RCU-safe
//! for the same reason. Publishing still has a price: with a handful of
//! VMAs, `mmap1` and `brk1` run at 0.66x and 0.72x of the map-lock path,
//! which publishes nothing (README, "Fault paths").
//!
//! The tree is a treap: a binary search tree on the keys that is a heap on
//! pseudo-random priorities (a hash of the key with a per-tree seed), so its
//! expected depth is O(log n) whatever order the keys come in; insertion
//! and removal are splits and joins, which copy only along one path.
//! Nodes a writer created since the last publication are its own
//! (reference count 1) and are changed in place, so a burst of changes
//! under one map-lock hold copies each shared node once.
//!
//! Node allocations are reused: a new node (or the copy of a shared one)
//! takes a spare of its value type's [`Recycle::spare_node`] (the VMA
//! index's come from the thread's spares, `aspace/spares.rs`), and
//! [`recycle`] takes a dropped version apart into its values and the
//! nodes nobody else holds, for the caller to keep. So an `mmap` and its
//! `munmap` allocate nothing from the heap in steady state.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

type Link<V> = Option<Arc<Node<V>>>;

/// A node; its subtree is one version of the map (immutable once shared).
#[derive(Debug, Clone)]
pub(crate) struct Node<V> {
    key: u64,
    prio: u64,
    /// Always present in a node of a tree; `None` only in a spare node
    /// (see [`recycle`]).
    val: Option<V>,
    left: Link<V>,
    right: Link<V>,
}

impl<V> Node<V> {
    /// An empty node, for a stock of spares (`aspace/spares.rs`).
    pub(crate) fn spare() -> Node<V> {
        Node { key: 0, prio: 0, val: None, left: None, right: None }
    }
}

/// Where the nodes of a tree of `Self` come from: a spare node to reuse
/// (held by nobody else, empty: taken apart by [`recycle`]), or none, and
/// the tree allocates one.
pub(crate) trait Recycle: Clone {
    /// A spare node, if there is one.
    fn spare_node() -> Option<Arc<Node<Self>>> {
        None
    }

    /// Keep `node` (empty, held by nobody else) as a spare, or drop it.
    fn keep_node(node: Arc<Node<Self>>) {
        drop(node);
    }
}

/// A node holding `n`'s fields: a spare's allocation if there is one.
fn new_node<V: Recycle>(n: Node<V>) -> Arc<Node<V>> {
    match V::spare_node() {
        Some(mut spare) => {
            match Arc::get_mut(&mut spare) {
                Some(slot) => *slot = n,
                None => return Arc::new(n),
            }
            spare
        }
        None => Arc::new(n),
    }
}

/// `Arc::make_mut` with the copy of a shared node in a spare.
fn own<V: Recycle>(a: &mut Arc<Node<V>>) -> &mut Node<V> {
    if Arc::get_mut(a).is_none() {
        *a = new_node(Node::clone(a));
    }
    Arc::get_mut(a).expect("just made unique")
}

/// Take apart a version being dropped: each node that nobody else holds
/// gives its value to `val` and itself, empty, to `node`; the nodes still
/// shared with other versions are only released.
pub(crate) fn recycle<V>(link: Link<V>, val: &mut impl FnMut(V), node: &mut impl FnMut(Arc<Node<V>>)) {
    let Some(mut arc) = link else { return };
    let Some(n) = Arc::get_mut(&mut arc) else { return };
    let (left, right, v) = (n.left.take(), n.right.take(), n.val.take());
    recycle(left, val, node);
    recycle(right, val, node);
    if let Some(v) = v {
        val(v);
    }
    node(arc);
}

/// A version of the map. `clone` is O(1) and shares every node.
#[derive(Debug)]
pub(crate) struct PTree<V> {
    root: Link<V>,
    len: usize,
    seed: u64,
}

impl<V> Clone for PTree<V> {
    fn clone(&self) -> Self {
        PTree { root: self.root.clone(), len: self.len, seed: self.seed }
    }
}

impl<V> Default for PTree<V> {
    fn default() -> Self {
        static SEEDS: AtomicU64 = AtomicU64::new(0x2545_f491_4f6c_dd1d);
        PTree { root: None, len: 0, seed: mix(SEEDS.fetch_add(1, Ordering::Relaxed)) }
    }
}

/// The entry with the smallest key above `key` in the version rooted at
/// `root` (a published root, read inside an RCU section).
#[inline]
pub(crate) fn first_above<V>(root: Option<&Node<V>>, key: u64) -> Option<(u64, &V)> {
    let mut best = None;
    let mut cur = root;
    while let Some(n) = cur {
        if n.key > key {
            best = Some(n);
            cur = n.left.as_deref();
        } else {
            cur = n.right.as_deref();
        }
    }
    best.map(|n| (n.key, n.val.as_ref().expect("a node of a tree has its value")))
}

/// The entry with the largest key at or below `key` in the version rooted
/// at `root`.
pub(crate) fn last_at_or_below<V>(root: Option<&Node<V>>, key: u64) -> Option<(u64, &V)> {
    let mut best = None;
    let mut cur = root;
    while let Some(n) = cur {
        if n.key <= key {
            best = Some(n);
            cur = n.right.as_deref();
        } else {
            cur = n.left.as_deref();
        }
    }
    best.map(|n| (n.key, n.val.as_ref().expect("a node of a tree has its value")))
}

/// SplitMix64's finalizer: a bijective mix of 64 bits.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl<V: Recycle> PTree<V> {
    /// Number of entries.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The value at `key`.
    pub(crate) fn get(&self, key: u64) -> Option<&V> {
        let mut cur = self.root.as_deref();
        while let Some(n) = cur {
            if key == n.key {
                return Some(n.val.as_ref().expect("a node of a tree has its value"));
            }
            cur = if key < n.key { n.left.as_deref() } else { n.right.as_deref() };
        }
        None
    }

    /// The entry with the smallest key above `key`.
    #[inline]
    pub(crate) fn first_above(&self, key: u64) -> Option<(u64, &V)> {
        first_above(self.root.as_deref(), key)
    }

    /// This version's root, to publish (`sync::rcu::RcuArc`): a reader
    /// that holds it sees exactly this version ([`first_above`]).
    pub(crate) fn root(&self) -> Option<Arc<Node<V>>> {
        self.root.clone()
    }

    /// The entry with the largest key at or below `key`.
    pub(crate) fn last_at_or_below(&self, key: u64) -> Option<(u64, &V)> {
        last_at_or_below(self.root.as_deref(), key)
    }

    /// Entries with keys above `key`, ascending.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn iter_above(&self, key: u64) -> Iter<'_, V> {
        let mut stack = Vec::new();
        let mut cur = self.root.as_deref();
        while let Some(n) = cur {
            if n.key > key {
                stack.push(n);
                cur = n.left.as_deref();
            } else {
                cur = n.right.as_deref();
            }
        }
        Iter { stack, ascending: true }
    }

    /// Every entry, ascending.
    pub(crate) fn iter(&self) -> Iter<'_, V> {
        Iter::edge(self.root.as_deref(), true)
    }

    /// Every entry, descending.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn iter_rev(&self) -> Iter<'_, V> {
        Iter::edge(self.root.as_deref(), false)
    }

    /// Insert `val` at `key`, returning the value it replaces.
    pub(crate) fn insert(&mut self, key: u64, val: V) -> Option<V> {
        let old = self.remove(key);
        let prio = mix(key ^ self.seed);
        insert_at(&mut self.root, key, prio, val);
        self.len += 1;
        old
    }

    /// Remove the entry at `key`, returning its value.
    pub(crate) fn remove(&mut self, key: u64) -> Option<V> {
        // Look first: a removal that finds nothing must copy nothing.
        self.get(key)?;
        self.len -= 1;
        let (val, spare) = remove_at(&mut self.root, key);
        if let Some(n) = spare {
            V::keep_node(n);
        }
        Some(val)
    }

    /// Remove every entry, returning the values in key order.
    pub(crate) fn take_all(&mut self) -> Vec<V> {
        let all = self.iter().map(|(_, v)| v.clone()).collect();
        self.root = None;
        self.len = 0;
        all
    }
}

/// Insert a key known to be absent.
fn insert_at<V: Recycle>(t: &mut Link<V>, key: u64, prio: u64, val: V) {
    match t {
        Some(n) if n.prio >= prio => {
            let n = own(n);
            insert_at(if key < n.key { &mut n.left } else { &mut n.right }, key, prio, val);
        }
        _ => {
            let (left, right) = split(t.take(), key);
            *t = Some(new_node(Node { key, prio, val: Some(val), left, right }));
        }
    }
}

/// Remove a key known to be present; returns its value, and the node, if
/// nobody else held it (a node made since the last publication), to reuse.
fn remove_at<V: Recycle>(t: &mut Link<V>, key: u64) -> (V, Option<Arc<Node<V>>>) {
    let n = t.as_mut().expect("key present");
    if n.key != key {
        let n = own(n);
        return remove_at(if key < n.key { &mut n.left } else { &mut n.right }, key);
    }
    let mut arc = t.take().expect("checked");
    let (left, right, val, spare) = match Arc::get_mut(&mut arc) {
        Some(n) => (n.left.take(), n.right.take(), n.val.take(), Some(arc)),
        None => (arc.left.clone(), arc.right.clone(), arc.val.clone(), None),
    };
    *t = join(left, right);
    (val.expect("a node of a tree has its value"), spare)
}

/// Split into the keys below `key` and the keys above it (`key` absent).
fn split<V: Recycle>(t: Link<V>, key: u64) -> (Link<V>, Link<V>) {
    let Some(mut arc) = t else { return (None, None) };
    let n = own(&mut arc);
    if n.key < key {
        let (l, r) = split(n.right.take(), key);
        n.right = l;
        (Some(arc), r)
    } else {
        let (l, r) = split(n.left.take(), key);
        n.left = r;
        (l, Some(arc))
    }
}

/// Join two trees, every key of `l` below every key of `r`.
fn join<V: Recycle>(l: Link<V>, r: Link<V>) -> Link<V> {
    match (l, r) {
        (None, r) => r,
        (l, None) => l,
        (Some(mut a), Some(mut b)) => {
            if a.prio >= b.prio {
                let n = own(&mut a);
                n.right = join(n.right.take(), Some(b));
                Some(a)
            } else {
                let n = own(&mut b);
                n.left = join(Some(a), n.left.take());
                Some(b)
            }
        }
    }
}

/// An in-order walk (ascending or descending) with an explicit stack: the
/// next entries' ancestors, nearest on top.
pub(crate) struct Iter<'a, V> {
    stack: Vec<&'a Node<V>>,
    ascending: bool,
}

impl<'a, V> Iter<'a, V> {
    fn edge(root: Option<&'a Node<V>>, ascending: bool) -> Self {
        let mut it = Iter { stack: Vec::new(), ascending };
        it.descend(root);
        it
    }

    /// Push `n` and its chain of children towards the start of the walk.
    fn descend(&mut self, mut cur: Option<&'a Node<V>>) {
        while let Some(n) = cur {
            self.stack.push(n);
            cur = if self.ascending { n.left.as_deref() } else { n.right.as_deref() };
        }
    }
}

impl<'a, V> Iterator for Iter<'a, V> {
    type Item = (u64, &'a V);

    fn next(&mut self) -> Option<Self::Item> {
        let n = self.stack.pop()?;
        self.descend(if self.ascending { n.right.as_deref() } else { n.left.as_deref() });
        Some((n.key, n.val.as_ref().expect("a node of a tree has its value")))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    impl Recycle for u64 {}
    impl Recycle for () {}

    /// A value whose trees reuse nodes from a per-thread list.
    #[derive(Debug, Clone, PartialEq)]
    struct Rec(u64);

    thread_local! {
        static NODES: std::cell::RefCell<Vec<Arc<Node<Rec>>>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    impl Recycle for Rec {
        fn spare_node() -> Option<Arc<Node<Rec>>> {
            NODES.with_borrow_mut(|n| n.pop())
        }

        fn keep_node(node: Arc<Node<Rec>>) {
            assert!(node.val.is_none() && node.left.is_none() && node.right.is_none(), "a spare is empty");
            assert_eq!(Arc::strong_count(&node), 1, "a spare is nobody else's");
            NODES.with_borrow_mut(|n| n.push(node));
        }
    }
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn depth<V>(t: &Link<V>) -> usize {
        t.as_ref().map_or(0, |n| 1 + depth(&n.left).max(depth(&n.right)))
    }

    #[test]
    fn old_versions_never_change() {
        let mut t = PTree::default();
        for k in 0..100u64 {
            t.insert(k * 10, k);
        }
        let v1 = t.clone();
        for k in 0..50u64 {
            t.remove(k * 20);
        }
        t.insert(5, 500);
        assert_eq!(v1.len(), 100);
        assert_eq!(v1.iter().map(|(k, _)| k).collect::<Vec<_>>(), (0..100).map(|k| k * 10).collect::<Vec<_>>());
        assert_eq!(t.get(5), Some(&500));
        assert_eq!(v1.get(5), None);
        assert_eq!(t.len(), 51);
    }

    #[test]
    fn balanced_for_sorted_keys() {
        let mut t = PTree::default();
        for k in 0..65_536u64 {
            t.insert(k << 12, ());
        }
        // A treap's expected depth is about 3 ln n (33 here); a list would be 65,536.
        assert!(depth(&t.root) < 64, "depth {}", depth(&t.root));
    }

    #[test]
    fn unchanged_nodes_are_shared() {
        let mut t = PTree::default();
        for k in 0..1024u64 {
            t.insert(k, k);
        }
        let published = t.clone();
        t.insert(5000, 0);
        // Only the path to the new key was copied: the old root's children
        // are mostly still the new root's.
        let count = |t: &PTree<u64>| {
            let mut all = Vec::new();
            let mut stack: Vec<&Arc<Node<u64>>> = t.root.iter().collect();
            while let Some(n) = stack.pop() {
                all.push(Arc::as_ptr(n));
                stack.extend(n.left.iter().chain(n.right.iter()));
            }
            all
        };
        let (a, b) = (count(&published), count(&t));
        let shared = b.iter().filter(|p| a.contains(p)).count();
        assert!(shared >= 1024 - 64, "only {shared} of 1025 nodes shared");
    }

    proptest! {
        /// Versions dropped through `recycle` hand their unshared nodes to
        /// later changes, and no version still held changes.
        #[test]
        fn recycled_nodes_never_change_a_version_still_held(
            ops in prop::collection::vec((0u8..4, 0u64..48), 0..300),
        ) {
            let mut t: PTree<Rec> = PTree::default();
            let mut m = BTreeMap::new();
            let mut versions: Vec<(PTree<Rec>, BTreeMap<u64, Rec>)> = Vec::new();
            let mut recycled = 0usize;
            for (op, k) in ops {
                match op {
                    0 => prop_assert_eq!(t.insert(k, Rec(k * 3)), m.insert(k, Rec(k * 3))),
                    1 => prop_assert_eq!(t.remove(k), m.remove(&k)),
                    2 => versions.push((t.clone(), m.clone())),
                    _ if !versions.is_empty() => {
                        let (v, _) = versions.swap_remove(k as usize % versions.len());
                        recycle(v.root, &mut |_| recycled += 1, &mut Rec::keep_node);
                    }
                    _ => {}
                }
                prop_assert!(t.iter().eq(m.iter().map(|(&k, v)| (k, v))));
                for (v, vm) in &versions {
                    prop_assert!(v.iter().eq(vm.iter().map(|(&k, v)| (k, v))));
                }
            }
            // Dropping every version and the tree gives no value back
            // twice: at most one per entry still held somewhere.
            let live: usize = m.len() + versions.iter().map(|(_, vm)| vm.len()).sum::<usize>();
            let before = recycled;
            for (v, _) in versions {
                recycle(v.root, &mut |_| recycled += 1, &mut Rec::keep_node);
            }
            recycle(t.root, &mut |_| recycled += 1, &mut Rec::keep_node);
            prop_assert!(recycled - before <= live, "a value given back twice");
        }

        #[test]
        fn behaves_like_a_btreemap(ops in prop::collection::vec((0u8..3, 0u64..64), 0..200)) {
            let mut t = PTree::default();
            let mut m = BTreeMap::new();
            let mut versions = Vec::new();
            for (op, k) in ops {
                match op {
                    0 => prop_assert_eq!(t.insert(k, k * 3), m.insert(k, k * 3)),
                    1 => prop_assert_eq!(t.remove(k), m.remove(&k)),
                    _ => versions.push((t.clone(), m.clone())),
                }
                prop_assert_eq!(t.len(), m.len());
                prop_assert_eq!(t.first_above(k), m.range(k + 1..).next().map(|(&k, v)| (k, v)));
                prop_assert_eq!(t.last_at_or_below(k), m.range(..=k).next_back().map(|(&k, v)| (k, v)));
                prop_assert!(t.iter_above(k).eq(m.range(k + 1..).map(|(&k, v)| (k, v))));
            }
            prop_assert!(t.iter_rev().eq(m.iter().rev().map(|(&k, v)| (k, v))));
            for (t, m) in versions {
                prop_assert!(t.iter().eq(m.iter().map(|(&k, v)| (k, v))));
            }
        }
    }
}
