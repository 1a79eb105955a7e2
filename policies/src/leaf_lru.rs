//! Leaf-first LRU eviction: within a tier, blocks with no child resident in that tier go first,
//! least recently used first; soft-pinned blocks only after every unpinned one; hard-pinned never.
//!
//! Why leaf-first: a block is useless without its ancestors, so evicting a chain's root strands
//! every descendant; evicting from the tail keeps the longest reusable prefixes.

use crate::hash::{IdMap, IdSet};
use kvpool_policy_sdk::{Event, EventKind, Events, EvictionPolicy, ParamError, Params, Pin, Tier, NO_PARENT};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

#[derive(Debug, Clone)]
struct Node {
    parent: u64,
    pin: Pin,
    /// Per tier: (last access tick, size) when a copy is resident there.
    copies: [Option<(u64, u64)>; 3],
    /// Per tier: how many children have a copy in that tier.
    children: [u32; 3],
}

/// Ordering class inside a tier: lower goes first.
fn class(pin: Pin, children: u32) -> u8 {
    let inner = u8::from(children > 0);
    match pin {
        Pin::None => inner,
        Pin::Soft => 2 + inner,
        Pin::Hard => u8::MAX,
    }
}

/// Bits of an ordering key below the class.
const CLASS_SHIFT: u32 = 56;

/// The ordering key of a copy: (class, tick) packed in one integer, class in the top byte.
/// Every event takes a new tick and sets at most one copy's tick in its tier, so ticks are
/// unique within a tier and (class, tick) orders exactly as (class, tick, id) would.
fn pack(class: u8, tick: u64) -> u64 {
    (u64::from(class) << CLASS_SHIFT) | (tick & ((1 << CLASS_SHIFT) - 1))
}

fn key(n: &Node, t: usize) -> Option<u64> {
    let (tick, _) = n.copies[t]?;
    let c = class(n.pin, n.children[t]);
    (c != u8::MAX).then(|| pack(c, tick))
}

fn keys(n: &Node) -> [Option<u64>; 3] {
    [key(n, 0), key(n, 1), key(n, 2)]
}

/// Classes that have an ordering (hard pins have none).
const CLASSES: usize = 4;

/// One tier's ordering of evictable copies by (class, tick), kept lazily: an entry is live while
/// its node still has that copy with that tick and that class; stale entries stay until they are
/// met at the front or the tier is compacted. Copies that take a new tick (insert, access) get
/// the newest tick of all, so they are appended to their class's `fifo`, which therefore stays
/// sorted; only class changes (a first child, a last child gone, a pin change) enter a copy with
/// an older tick, into `late`. The hot path is an append, with no search and no removal.
#[derive(Debug, Default)]
struct Order {
    fifo: [VecDeque<(u64, u64)>; CLASSES],
    late: [BTreeMap<u64, u64>; CLASSES],
    /// Entries in `fifo` and `late`, live or stale.
    entries: usize,
    /// Live entries: copies in this tier with an ordering.
    live: usize,
}

impl Order {
    fn add(&mut self, k: u64, id: u64, newest: bool) {
        let c = (k >> CLASS_SHIFT) as usize;
        let tick = k & ((1 << CLASS_SHIFT) - 1);
        // An older tick that is still behind every entry of the class keeps `fifo` sorted too
        // (a chain loaded root first makes each parent inner in tick order).
        if newest || self.fifo[c].back().is_none_or(|&(last, _)| last < tick) {
            self.fifo[c].push_back((tick, id));
        } else {
            self.late[c].insert(tick, id);
        }
        self.entries += 1;
    }
}

/// Whether the entry (`k`, `id`) of tier `t` is live.
fn live(nodes: &IdMap<u64, Node>, t: usize, k: u64, id: u64) -> bool {
    nodes.get(&id).is_some_and(|n| key(n, t) == Some(k))
}

/// Bring the tier orderings in step with node `id`, whose keys were `before`; `tick` is the
/// newest tick.
fn resort(order: &mut [Order; 3], id: u64, before: [Option<u64>; 3], n: &Node, tick: u64) {
    for (t, old) in before.into_iter().enumerate() {
        let new = key(n, t);
        if old != new {
            let o = &mut order[t];
            if old.is_some() {
                o.live -= 1;
            }
            if let Some(k) = new {
                o.live += 1;
                o.add(k, id, n.copies[t].is_some_and(|(at, _)| at == tick));
            }
        }
    }
}

/// Entries of one tier in (class, tick) order, as (packed key, id), stale ones included.
fn entries(o: &Order) -> impl Iterator<Item = (u64, u64)> + '_ {
    (0..CLASSES).flat_map(move |c| {
        let base = (c as u64) << CLASS_SHIFT;
        let mut a = o.fifo[c].iter().peekable();
        let mut b = o.late[c].iter().peekable();
        std::iter::from_fn(move || {
            let take_a = match (a.peek(), b.peek()) {
                (None, None) => return None,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(&&x), Some(&(&bt, &bid))) => x <= (bt, bid),
            };
            let (tick, id) = if take_a { *a.next()? } else { b.next().map(|(&t, &i)| (t, i))? };
            Some((base | tick, id))
        })
    })
}

#[derive(Debug, Default)]
pub struct LeafLru {
    nodes: IdMap<u64, Node>,
    /// Per tier: every evictable copy by (class, tick).
    order: [Order; 3],
    tick: u64,
}

impl LeafLru {
    pub fn new() -> LeafLru {
        LeafLru::default()
    }

    /// Leaf-first LRU takes no parameters; unknown ones are ignored.
    pub fn with_params(_params: &Params) -> Result<LeafLru, ParamError> {
        Ok(LeafLru::new())
    }

    pub fn resident(&self, tier: Tier) -> usize {
        self.nodes.values().filter(|n| n.copies[tier as usize].is_some()).count()
    }

    /// Run `f` on node `id` (if known), keeping the tier orderings in step with its changes.
    fn update(&mut self, id: u64, f: impl FnOnce(&mut Node)) {
        if let Some(n) = self.nodes.get_mut(&id) {
            let before = keys(n);
            f(n);
            resort(&mut self.order, id, before, n, self.tick);
        }
    }

    /// Drop the stale entries of tier `t` once they outnumber the live ones (amortized O(1)).
    fn maybe_compact(&mut self, t: usize) {
        let o = &mut self.order[t];
        if o.entries <= 2 * o.live + 1024 {
            return;
        }
        let nodes = &self.nodes;
        let mut fresh: [VecDeque<(u64, u64)>; CLASSES] = Default::default();
        let mut last = None;
        for (k, id) in entries(o) {
            if last != Some((k, id)) && live(nodes, t, k, id) {
                fresh[(k >> CLASS_SHIFT) as usize].push_back((k & ((1 << CLASS_SHIFT) - 1), id));
                last = Some((k, id));
            }
        }
        o.entries = fresh.iter().map(VecDeque::len).sum();
        o.fifo = fresh;
        o.late = Default::default();
    }

    fn apply(&mut self, e: Event) {
        // Misses name no resident block: nothing to order.
        if e.kind == EventKind::Missed {
            return;
        }
        self.tick += 1;
        let t = e.tier as usize;
        let tick = self.tick;
        match e.kind {
            EventKind::Inserted => {
                let n = self.nodes.entry(e.id).or_insert(Node {
                    parent: e.parent,
                    pin: e.pin,
                    copies: [None; 3],
                    children: [0; 3],
                });
                let had_copy = n.copies[t].is_some();
                let before = keys(n);
                n.copies[t] = Some((tick, e.size));
                n.pin = e.pin;
                resort(&mut self.order, e.id, before, n, tick);
                let parent = n.parent;
                if !had_copy && parent != NO_PARENT {
                    self.update(parent, |p| p.children[t] += 1);
                }
            }
            EventKind::Accessed => {
                if let Some(n) = self.nodes.get_mut(&e.id) {
                    if let Some((_, size)) = n.copies[t] {
                        let old = key(n, t);
                        n.copies[t] = Some((tick, size));
                        if let Some(k) = key(n, t) {
                            self.order[t].add(k, e.id, true);
                        }
                        debug_assert_eq!(old.is_some(), key(n, t).is_some());
                    }
                }
            }
            EventKind::Removed => {
                let Some(n) = self.nodes.get_mut(&e.id) else { return };
                if n.copies[t].is_none() {
                    return;
                }
                let parent = n.parent;
                let before = keys(n);
                n.copies[t] = None;
                resort(&mut self.order, e.id, before, n, tick);
                let gone = n.copies.iter().all(Option::is_none);
                if parent != NO_PARENT {
                    self.update(parent, |p| p.children[t] = p.children[t].saturating_sub(1));
                }
                if gone {
                    self.nodes.remove(&e.id);
                }
            }
            EventKind::PinChanged => {
                self.update(e.id, |n| n.pin = e.pin);
                for t in 0..3 {
                    self.maybe_compact(t);
                }
                return;
            }
            EventKind::Missed => return,
        }
        self.maybe_compact(t);
    }
}

impl EvictionPolicy for LeafLru {
    fn on_events(&mut self, events: &Events) {
        // Bulk loads (a replayed snapshot) grow the map once instead of rehashing as they go.
        if events.len() >= 4096 {
            self.nodes.reserve(events.len());
        }
        for e in events.iter() {
            self.apply(e);
        }
    }

    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        let t = tier as usize;
        // Stale entries at the fronts are dropped for good.
        {
            let (nodes, o) = (&self.nodes, &mut self.order[t]);
            for c in 0..CLASSES {
                while let Some(&(tick, id)) = o.fifo[c].front() {
                    if live(nodes, t, ((c as u64) << CLASS_SHIFT) | tick, id) {
                        break;
                    }
                    o.fifo[c].pop_front();
                    o.entries -= 1;
                }
            }
        }
        let nodes = &self.nodes;
        let mut out = Vec::new();
        let mut freed = 0u64;
        // Parents that became leaves because all their children in this tier were chosen:
        // they compete as leaves from then on (the cascade SGLang's radix tree does).
        let mut promoted: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let mut taken_children: IdMap<u64, u32> = IdMap::default();
        let mut chosen: IdSet<u64> = IdSet::default();
        let mut iter = entries(&self.order[t]).filter(|&(k, id)| live(nodes, t, k, id)).peekable();
        while freed < bytes {
            let from_set = iter.peek().copied();
            let from_heap = promoted.peek().map(|r| r.0);
            let next = match (from_set, from_heap) {
                (None, None) => break,
                (Some(s), None) => {
                    iter.next();
                    s
                }
                (None, Some(h)) => {
                    promoted.pop();
                    h
                }
                (Some(s), Some(h)) => {
                    if h < s {
                        promoted.pop();
                        h
                    } else {
                        iter.next();
                        s
                    }
                }
            };
            let (k, id) = next;
            if chosen.contains(&id) || exclude.binary_search(&id).is_ok() {
                continue;
            }
            let Some(node) = nodes.get(&id) else { continue };
            let remaining_children = node.children[t].saturating_sub(taken_children.get(&id).copied().unwrap_or(0));
            if remaining_children > 0 {
                // Still an inner node: it is reached again through `promoted` once its last
                // child goes, or taken as an inner node when only inner nodes are left.
                if k & (1 << CLASS_SHIFT) == 0 {
                    continue;
                }
            }
            chosen.insert(id);
            out.push(id);
            freed += node.copies[t].map_or(0, |(_, s)| s);
            let parent = node.parent;
            if let Some(p) = nodes.get(&parent) {
                let taken = taken_children.entry(parent).or_insert(0);
                *taken += 1;
                if *taken >= p.children[t] {
                    if let Some(pk) = key(p, t) {
                        // Re-rank as a leaf of the same pin class.
                        promoted.push(Reverse((pk & !(1 << CLASS_SHIFT), parent)));
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(list: &[Event]) -> Events {
        list.iter().copied().collect()
    }

    #[test]
    fn leaves_go_before_older_ancestors() {
        let mut p = LeafLru::new();
        // chain 1 <- 2 <- 3 inserted in order, so 1 is the oldest
        p.on_events(&ev(&[
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, 1),
            Event::inserted(3, 10, Tier::Dram, 2),
            Event::inserted(4, 10, Tier::Dram, NO_PARENT),
        ]));
        // Oldest leaf is 3 (4 is newer): evict 3, then its parent 2 becomes a leaf older than 4.
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![3]);
        assert_eq!(p.victims(Tier::Dram, 30, &[]), vec![3, 2, 1]);
        assert_eq!(p.victims(Tier::Dram, 40, &[]), vec![3, 2, 1, 4]);
    }

    #[test]
    fn access_refreshes_and_exclude_and_pins_are_respected() {
        let mut p = LeafLru::new();
        p.on_events(&ev(&[
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, NO_PARENT).with_pin(Pin::Soft),
            Event::inserted(3, 10, Tier::Dram, NO_PARENT).with_pin(Pin::Hard),
            Event::inserted(4, 10, Tier::Dram, NO_PARENT),
            Event::accessed(1, Tier::Dram),
        ]));
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![4]);
        assert_eq!(p.victims(Tier::Dram, 10, &[4]), vec![1]);
        // soft pin last, hard pin never
        assert_eq!(p.victims(Tier::Dram, 100, &[]), vec![4, 1, 2]);
        p.on_events(&ev(&[Event::pin_changed(2, Pin::None)]));
        assert_eq!(p.victims(Tier::Dram, 100, &[]), vec![2, 4, 1]);
    }

    #[test]
    fn tiers_are_independent() {
        let mut p = LeafLru::new();
        p.on_events(&ev(&[
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, 1),
            Event::inserted(1, 10, Tier::Ssd, NO_PARENT),
            Event::removed(2, Tier::Dram),
        ]));
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![1]);
        assert_eq!(p.victims(Tier::Ssd, 10, &[]), vec![1]);
        p.on_events(&ev(&[Event::removed(1, Tier::Dram)]));
        assert!(p.victims(Tier::Dram, 10, &[]).is_empty());
        assert_eq!(p.resident(Tier::Ssd), 1);
    }
}
