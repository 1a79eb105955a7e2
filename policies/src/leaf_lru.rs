//! Leaf-first LRU eviction: within a tier, blocks with no child resident in that tier go first,
//! least recently used first; soft-pinned blocks only after every unpinned one; hard-pinned never.
//!
//! Why leaf-first: a block is useless without its ancestors, so evicting a chain's root strands
//! every descendant; evicting from the tail keeps the longest reusable prefixes.

use crate::hash::{IdMap, IdSet};
use kvpool_policy_sdk::{Event, EventKind, Events, EvictionPolicy, ParamError, Params, Pin, Tier, NO_PARENT};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

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

/// Bring the tier orderings in step with node `id`, whose keys were `before`.
fn resort(order: &mut [BTreeMap<u64, u64>; 3], id: u64, before: [Option<u64>; 3], n: &Node) {
    for (t, old) in before.into_iter().enumerate() {
        let new = key(n, t);
        if old != new {
            if let Some(k) = old {
                order[t].remove(&k);
            }
            if let Some(k) = new {
                order[t].insert(k, id);
            }
        }
    }
}

#[derive(Debug, Default)]
pub struct LeafLru {
    nodes: IdMap<u64, Node>,
    /// Per tier: packed (class, tick) -> id of every evictable copy.
    order: [BTreeMap<u64, u64>; 3],
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
            resort(&mut self.order, id, before, n);
        }
    }

    fn apply(&mut self, e: Event) {
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
                resort(&mut self.order, e.id, before, n);
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
                        let new = key(n, t);
                        if let Some(k) = old {
                            self.order[t].remove(&k);
                        }
                        if let Some(k) = new {
                            self.order[t].insert(k, e.id);
                        }
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
                resort(&mut self.order, e.id, before, n);
                let gone = n.copies.iter().all(Option::is_none);
                if parent != NO_PARENT {
                    self.update(parent, |p| p.children[t] = p.children[t].saturating_sub(1));
                }
                if gone {
                    self.nodes.remove(&e.id);
                }
            }
            EventKind::PinChanged => self.update(e.id, |n| n.pin = e.pin),
        }
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
        let mut out = Vec::new();
        let mut freed = 0u64;
        // Parents that became leaves because all their children in this tier were chosen:
        // they compete as leaves from then on (the cascade SGLang's radix tree does).
        let mut promoted: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
        let mut taken_children: IdMap<u64, u32> = IdMap::default();
        let mut chosen: IdSet<u64> = IdSet::default();
        let mut iter = self.order[t].iter().map(|(&k, &id)| (k, id)).peekable();
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
            let Some(node) = self.nodes.get(&id) else { continue };
            let remaining_children = node.children[t] - taken_children.get(&id).copied().unwrap_or(0);
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
            if let Some(p) = self.nodes.get(&parent) {
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
