//! Shared machinery of the prefix-aware eviction policies (leaf-first LRU, chain LHD): the
//! block tree as the host reports it, and per tier an ordering of the *leaves* (copies with no
//! resident child in that tier) split into classes, each ordered by last access.
//!
//! Only leaves are candidates: a block is useless without its ancestors, so evicting from the
//! tails keeps the longest reusable prefixes, and the chain rule never has to cascade. Inner
//! blocks have no ordering at all (they are not candidates until their last child goes), which
//! keeps the hot path to one map lookup and an append: a read or an insert appends the copy to
//! its class's queue; a parent that gets a child leaves its queue lazily (its entry goes stale);
//! a parent whose last child goes re-enters at the place its last access gives it.
//!
//! Queues are lazy: an entry is live while the copy still has that tick, that class and no
//! child; stale entries are dropped when met at the front or when a tier is compacted.

use crate::hash::{IdMap, IdSet};
use crate::nodes::NodeMap;
use kvpool_policy_sdk::{Event, EventKind, Pin, Tier, NO_PARENT};
use std::collections::{BTreeMap, VecDeque};

/// A block as the policies see it.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub parent: u64,
    pub key: u64,
    pub pin: Pin,
    /// The policy's ordering class (below [`Leaves::classes`]).
    pub class: u8,
    /// Per tier: tick of the copy's last insert or read; 0 when there is no copy.
    pub at: [u64; 3],
    /// The block's size (the same in every tier).
    pub size: u64,
    /// Per tier: resident children with a copy in that tier.
    pub children: [u32; 3],
}

impl Node {
    pub fn has(&self, t: usize) -> bool {
        self.at[t] != 0
    }
}

/// One class's lazy ordering by tick: ticks that arrive in order are appended to `fifo`; a
/// copy that re-enters with an older tick goes to `late` (ordered).
#[derive(Debug, Default)]
struct Queue {
    fifo: VecDeque<(u64, u64)>,
    late: BTreeMap<u64, u64>,
}

impl Queue {
    fn push(&mut self, tick: u64, id: u64) {
        if self.fifo.back().is_none_or(|&(last, _)| last < tick) {
            self.fifo.push_back((tick, id));
        } else {
            self.late.insert(tick, id);
        }
    }
    /// Entries in tick order, stale ones included.
    fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let mut a = self.fifo.iter().peekable();
        let mut b = self.late.iter().peekable();
        std::iter::from_fn(move || {
            let take_a = match (a.peek(), b.peek()) {
                (None, None) => return None,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(&&(at, _)), Some(&(&bt, _))) => at <= bt,
            };
            if take_a {
                a.next().copied()
            } else {
                b.next().map(|(&t, &i)| (t, i))
            }
        })
    }
}

/// Pin slots that are ordered: unpinned, then soft-pinned (hard pins are never candidates).
const PIN_SLOTS: usize = 2;

fn pin_slot(p: Pin) -> Option<usize> {
    match p {
        Pin::None => Some(0),
        Pin::Soft => Some(1),
        Pin::Hard => None,
    }
}

#[derive(Debug, Default)]
struct TierQueues {
    /// Index: pin slot * classes + class.
    queues: Vec<Queue>,
    /// Entries in all queues, live or stale.
    entries: usize,
    /// Live entries.
    live: usize,
}

/// The block tree and the per-tier leaf orderings.
#[derive(Debug)]
pub(crate) struct Leaves {
    pub nodes: NodeMap<Node>,
    tiers: [TierQueues; 3],
    classes: usize,
    /// Newest tick handed out (ticks start at 1; 0 means "no copy").
    pub tick: u64,
}

/// What an event did to a node, for the policy's own bookkeeping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Change {
    /// A new copy in the event's tier; `fresh` when the block itself is new.
    Inserted {
        fresh: bool,
    },
    /// A read of a resident copy; `age` in ticks since its last insert or read.
    Read {
        age: u64,
    },
    /// A copy went; `age` in ticks since its last insert or read. `gone` when it was the last.
    Removed {
        age: u64,
        gone: bool,
    },
    Other,
}

impl Leaves {
    pub fn new(classes: usize) -> Leaves {
        let classes = classes.max(1);
        let mk = || TierQueues {
            queues: (0..PIN_SLOTS * classes).map(|_| Queue::default()).collect(),
            ..Default::default()
        };
        Leaves { nodes: NodeMap::default(), tiers: [mk(), mk(), mk()], classes, tick: 0 }
    }

    /// Queue of the copy in tier `t`, when it is an ordered leaf.
    fn queue_of(&self, n: &Node, t: usize) -> Option<usize> {
        if !n.has(t) || n.children[t] > 0 {
            return None;
        }
        Some(pin_slot(n.pin)? * self.classes + n.class as usize)
    }

    fn queues_of(&self, n: &Node) -> [Option<usize>; 3] {
        [self.queue_of(n, 0), self.queue_of(n, 1), self.queue_of(n, 2)]
    }

    /// Enter `id`'s copies whose queue changed (from `before`) into their new queues; the copy
    /// of tier `touched` (if any) took a new tick and re-enters its queue even if unchanged.
    fn requeue(&mut self, id: u64, before: [Option<usize>; 3], touched: Option<usize>) {
        let (after, at) = match self.nodes.get(&id) {
            Some(n) => (self.queues_of(n), n.at),
            None => ([None; 3], [0; 3]),
        };
        for t in 0..3 {
            let tq = &mut self.tiers[t];
            if before[t] == after[t] {
                if let (Some(q), true) = (after[t], touched == Some(t)) {
                    tq.entries += 1;
                    tq.queues[q].push(at[t], id);
                }
                continue;
            }
            if before[t].is_some() {
                tq.live -= 1;
            }
            if let Some(q) = after[t] {
                tq.live += 1;
                tq.entries += 1;
                tq.queues[q].push(at[t], id);
            }
        }
    }

    /// Run `f` on node `id` (if known), keeping the orderings in step.
    pub fn update(&mut self, id: u64, f: impl FnOnce(&mut Node)) {
        let Some(n) = self.nodes.get(&id) else { return };
        let before = self.queues_of(n);
        f(self.nodes.get_mut(&id).expect("present"));
        self.requeue(id, before, None);
    }

    /// Apply one event to the tree. `init` gives a new node its class from the event; the
    /// policy changes classes later through [`Leaves::update`].
    pub fn apply(&mut self, e: &Event, init: impl FnOnce(&Event) -> u8) -> Change {
        let t = e.tier as usize;
        match e.kind {
            EventKind::Inserted => {
                self.tick += 1;
                let tick = self.tick;
                let fresh = !self.nodes.contains_key(&e.id);
                if fresh {
                    let class = init(e).min(self.classes as u8 - 1);
                    let node =
                        Node { parent: e.parent, key: e.key, pin: e.pin, class, at: [0; 3], size: 0, children: [0; 3] };
                    self.nodes.insert(e.id, node);
                }
                let n = self.nodes.get(&e.id).expect("just ensured");
                // A re-insert of a resident copy is a use: it moves to the newest end.
                let had = n.has(t);
                let before = self.queues_of(n);
                let n = self.nodes.get_mut(&e.id).expect("just ensured");
                n.at[t] = tick;
                n.size = e.size;
                n.pin = e.pin;
                let parent = n.parent;
                self.requeue(e.id, before, Some(t));
                if !had && parent != NO_PARENT {
                    self.update(parent, |p| p.children[t] += 1);
                }
                self.maybe_compact(t);
                Change::Inserted { fresh }
            }
            EventKind::Accessed => {
                let Some(n) = self.nodes.get_mut(&e.id) else { return Change::Other };
                if !n.has(t) {
                    return Change::Other;
                }
                self.tick += 1;
                let age = self.tick - n.at[t];
                n.at[t] = self.tick;
                let (tick, classes) = (self.tick, self.classes);
                // The hot path: same queue, newest tick, a plain append.
                let q = if n.children[t] > 0 { None } else { pin_slot(n.pin).map(|p| p * classes + n.class as usize) };
                if let Some(q) = q {
                    let tq = &mut self.tiers[t];
                    tq.entries += 1;
                    tq.queues[q].push(tick, e.id);
                }
                self.maybe_compact(t);
                Change::Read { age }
            }
            EventKind::Removed => {
                let Some(n) = self.nodes.get(&e.id) else { return Change::Other };
                if !n.has(t) {
                    return Change::Other;
                }
                let age = self.tick.saturating_sub(n.at[t]);
                let before = self.queues_of(n);
                let parent = n.parent;
                let n = self.nodes.get_mut(&e.id).expect("present");
                n.at[t] = 0;
                let gone = n.at.iter().all(|&a| a == 0);
                self.requeue(e.id, before, None);
                if parent != NO_PARENT {
                    self.update(parent, |p| p.children[t] = p.children[t].saturating_sub(1));
                }
                if gone {
                    self.nodes.remove(&e.id);
                }
                self.maybe_compact(t);
                Change::Removed { age, gone }
            }
            EventKind::PinChanged => {
                self.update(e.id, |n| n.pin = e.pin);
                for t in 0..3 {
                    self.maybe_compact(t);
                }
                Change::Other
            }
            EventKind::Missed => Change::Other,
        }
    }

    /// Room for `n` more blocks (a bulk load is coming).
    pub fn reserve(&mut self, n: usize) {
        self.nodes.reserve(n);
    }

    fn live(&self, t: usize, q: usize, tick: u64, id: u64) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.at[t] == tick && self.queue_of(n, t) == Some(q))
    }

    /// Drop the stale entries of tier `t` once they outnumber the live ones (amortized O(1)).
    fn maybe_compact(&mut self, t: usize) {
        let tq = &self.tiers[t];
        if tq.entries <= 2 * tq.live + 1024 {
            return;
        }
        let mut fresh: Vec<Queue> = (0..tq.queues.len()).map(|_| Queue::default()).collect();
        let mut entries = 0;
        for (q, queue) in tq.queues.iter().enumerate() {
            let mut last = None;
            for (tick, id) in queue.iter() {
                if last != Some((tick, id)) && self.live(t, q, tick, id) {
                    fresh[q].fifo.push_back((tick, id));
                    entries += 1;
                    last = Some((tick, id));
                }
            }
        }
        let tq = &mut self.tiers[t];
        tq.queues = fresh;
        tq.entries = entries;
    }

    /// Drop stale entries at the fronts of tier `t`'s queues.
    fn prune_fronts(&mut self, t: usize) {
        for q in 0..self.tiers[t].queues.len() {
            while let Some(&(tick, id)) = self.tiers[t].queues[q].fifo.front() {
                if self.live(t, q, tick, id) {
                    break;
                }
                self.tiers[t].queues[q].fifo.pop_front();
                self.tiers[t].entries -= 1;
            }
        }
    }

    pub fn resident(&self, tier: Tier) -> usize {
        self.nodes.values().filter(|n| n.has(tier as usize)).count()
    }

    /// Choose copies of `tier` adding up to `bytes`: leaves only, the class to take from chosen
    /// by `rank` of each class's oldest leaf (lowest first, then oldest; `rank(node, tick)`;
    /// `picked` is told of each choice, so that a rank may depend on them), a parent
    /// joining the candidates once all its children in the tier are chosen. Unpinned first,
    /// then unpinned inner blocks oldest first (only when no leaf is left), then the same for
    /// soft pins; never hard pins or `exclude` (sorted).
    pub fn victims<R: PartialOrd + Copy>(
        &mut self,
        tier: Tier,
        bytes: u64,
        exclude: &[u64],
        mut rank: impl FnMut(&Node, u64) -> R,
        mut picked: impl FnMut(&Node),
    ) -> Vec<u64> {
        let t = tier as usize;
        let mut out = Vec::new();
        if bytes == 0 {
            return out;
        }
        self.prune_fronts(t);
        let classes = self.classes;
        let mut freed = 0u64;
        let mut chosen: IdSet<u64> = IdSet::default();
        let mut taken_children: IdMap<u64, u32> = IdMap::default();
        // Parents all of whose children were chosen, waiting for the pin slot they belong to.
        let mut waiting: Vec<(u64, u64)> = Vec::new();
        for slot in 0..PIN_SLOTS {
            // Cursors over this slot's queues, and parents promoted to leaves in this call.
            let tq = &self.tiers[t];
            let mut iters: Vec<_> = (0..classes).map(|c| tq.queues[slot * classes + c].iter().peekable()).collect();
            let nodes = &self.nodes;
            let mut promoted: Vec<(u64, u64)> = Vec::new();
            waiting.retain(|&(tick, id)| {
                let mine = nodes.get(&id).is_some_and(|n| pin_slot(n.pin) == Some(slot));
                if mine {
                    promoted.push((tick, id));
                }
                !mine
            });
            let live = |q: usize, tick: u64, id: u64| {
                nodes.get(&id).is_some_and(|n| {
                    n.at[t] == tick
                        && n.children[t] == 0
                        && pin_slot(n.pin) == Some(q / classes)
                        && n.class as usize == q % classes
                })
            };
            while freed < bytes {
                // The best head among the classes and the promoted parents.
                let mut best: Option<(R, u64, usize, u64)> = None;
                for (c, it) in iters.iter_mut().enumerate() {
                    let q = slot * classes + c;
                    while let Some(&(tick, id)) = it.peek() {
                        if live(q, tick, id) && !chosen.contains(&id) && exclude.binary_search(&id).is_err() {
                            break;
                        }
                        it.next();
                    }
                    if let Some(&(tick, id)) = it.peek() {
                        let r = rank(&nodes[&id], tick);
                        if best.as_ref().is_none_or(|b| r < b.0 || (r == b.0 && tick < b.1)) {
                            best = Some((r, tick, c, id));
                        }
                    }
                }
                for (i, &(tick, id)) in promoted.iter().enumerate() {
                    let r = rank(&nodes[&id], tick);
                    if best.as_ref().is_none_or(|b| r < b.0 || (r == b.0 && tick < b.1)) {
                        best = Some((r, tick, classes + i, id));
                    }
                }
                let Some((_, _, from, id)) = best else { break };
                if from < classes {
                    iters[from].next();
                } else {
                    promoted.swap_remove(from - classes);
                }
                chosen.insert(id);
                out.push(id);
                let n = &nodes[&id];
                picked(n);
                freed = freed.saturating_add(n.size);
                if let Some(p) = nodes.get(&n.parent) {
                    let taken = taken_children.entry(n.parent).or_insert(0);
                    *taken += 1;
                    if *taken >= p.children[t] && p.has(t) && exclude.binary_search(&n.parent).is_err() {
                        match pin_slot(p.pin) {
                            Some(s) if s == slot => promoted.push((p.at[t], n.parent)),
                            Some(s) if s > slot => waiting.push((p.at[t], n.parent)),
                            _ => {}
                        }
                    }
                }
            }
            if freed >= bytes {
                break;
            }
            // No leaf left in this slot: inner blocks, oldest first (their subtrees go with
            // them under the host's chain rule, or they stay when a descendant cannot).
            let mut inner: Vec<(u64, u64)> = nodes
                .iter()
                .filter(|(id, n)| {
                    n.has(t)
                        && pin_slot(n.pin) == Some(slot)
                        && !chosen.contains(*id)
                        && exclude.binary_search(id).is_err()
                })
                .map(|(&id, n)| (n.at[t], id))
                .collect();
            inner.sort_unstable();
            for (_, id) in inner {
                if freed >= bytes {
                    break;
                }
                chosen.insert(id);
                out.push(id);
                freed = freed.saturating_add(nodes[&id].size);
            }
            if freed >= bytes {
                break;
            }
        }
        out
    }
}
