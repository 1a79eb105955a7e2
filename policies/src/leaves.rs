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

/// A policy's logical clock: one tick per insert or read. Four bytes, not eight, because every
/// node keeps one per tier; when the clock runs out, [`Leaves`] renumbers the ticks in use
/// (order kept), which happens once per 4 billion events.
pub(crate) type Tick = u32;

/// What a policy keeps per node beyond the tree and the orderings, taken from the node's first
/// insert: nothing for leaf-first LRU, the key hash for the policies that look keys up.
pub(crate) trait Extra: Copy + std::fmt::Debug {
    fn of(e: &Event) -> Self;
}

impl Extra for () {
    fn of(_: &Event) {}
}

/// The block's key hash ([`Event::key`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Key(pub u64);

impl Extra for Key {
    fn of(e: &Event) -> Key {
        Key(e.key)
    }
}

/// A block as the policies see it.
#[derive(Debug, Clone)]
pub(crate) struct Node<X = ()> {
    pub parent: u64,
    pub extra: X,
    pub pin: Pin,
    /// The policy's ordering class (below [`Leaves::classes`]).
    pub class: u8,
    /// Per tier: tick of the copy's last insert or read; 0 when there is no copy.
    pub at: [Tick; 3],
    /// The block's size (the same in every tier), saturating at 4 GiB.
    pub size: u32,
    /// Per tier: resident children with a copy in that tier. Two bytes, since nearly every
    /// block has at most a few; a count that reaches [`Leaves`]'s spill mark is kept exactly in
    /// its `many_children` instead (a system prompt shared by 100,000 requests).
    pub children: [u16; 3],
}

impl<X> Node<X> {
    pub fn has(&self, t: usize) -> bool {
        self.at[t] != 0
    }
}

/// One class's lazy ordering by tick: ticks that arrive in order are appended to `fifo`; a
/// copy that re-enters with an older tick goes to `late` (ordered).
#[derive(Debug, Default)]
struct Queue {
    fifo: VecDeque<(Tick, u64)>,
    late: BTreeMap<Tick, u64>,
}

impl Queue {
    fn push(&mut self, tick: Tick, id: u64) {
        if self.fifo.back().is_none_or(|&(last, _)| last < tick) {
            self.fifo.push_back((tick, id));
        } else {
            self.late.insert(tick, id);
        }
    }
    /// Entries in tick order, stale ones included.
    fn iter(&self) -> impl Iterator<Item = (Tick, u64)> + '_ {
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
pub(crate) struct Leaves<X = ()> {
    pub nodes: NodeMap<Node<X>>,
    tiers: [TierQueues; 3],
    classes: usize,
    /// Newest tick handed out (ticks start at 1; 0 means "no copy").
    tick: Tick,
    /// The clock is renumbered when it reaches this ([`Tick::MAX`]; lower in tests).
    tick_limit: Tick,
    /// Exact child counts of the tiers whose `children` stand at `spill`.
    many_children: IdMap<u64, [u32; 3]>,
    /// The mark at which a child count moves to `many_children` ([`u16::MAX`]; lower in tests).
    spill: u16,
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

impl<X: Extra> Leaves<X> {
    pub fn new(classes: usize) -> Leaves<X> {
        let classes = classes.max(1);
        let mk = || TierQueues {
            queues: (0..PIN_SLOTS * classes).map(|_| Queue::default()).collect(),
            ..Default::default()
        };
        Leaves {
            nodes: NodeMap::default(),
            tiers: [mk(), mk(), mk()],
            classes,
            tick: 0,
            tick_limit: Tick::MAX,
            many_children: IdMap::default(),
            spill: u16::MAX,
        }
    }

    /// Queue of the copy in tier `t`, when it is an ordered leaf.
    fn queue_of(&self, n: &Node<X>, t: usize) -> Option<usize> {
        if !n.has(t) || n.children[t] > 0 {
            return None;
        }
        Some(pin_slot(n.pin)? * self.classes + n.class as usize)
    }

    fn queues_of(&self, n: &Node<X>) -> [Option<usize>; 3] {
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

    /// Resident children of `n` (node `id`) with a copy in tier `t`.
    pub fn children(&self, id: u64, n: &Node<X>, t: usize) -> u32 {
        if n.children[t] < self.spill {
            u32::from(n.children[t])
        } else {
            self.many_children.get(&id).map_or(u32::from(self.spill), |m| m[t])
        }
    }

    /// One more (`up`) or one fewer child of `id` in tier `t`.
    fn count_child(&mut self, id: u64, t: usize, up: bool) {
        let Some(n) = self.nodes.get(&id) else { return };
        let before = self.queues_of(n);
        let n = self.nodes.get_mut(&id).expect("present");
        let c = &mut n.children[t];
        if *c < self.spill {
            *c = if up { *c + 1 } else { c.saturating_sub(1) };
            if *c == self.spill {
                self.many_children.entry(id).or_default()[t] = u32::from(self.spill);
            }
        } else {
            let m = self.many_children.entry(id).or_default();
            m[t] = if up { m[t].saturating_add(1) } else { m[t].saturating_sub(1) };
            if m[t] < u32::from(self.spill) {
                // Back below the mark: the node holds it again.
                *c = u16::try_from(m[t]).unwrap_or(self.spill);
                m[t] = 0;
                if m.iter().all(|&x| x == 0) {
                    self.many_children.remove(&id);
                }
            }
        }
        self.requeue(id, before, None);
    }

    /// Run `f` on node `id` (if known), keeping the orderings in step.
    pub fn update(&mut self, id: u64, f: impl FnOnce(&mut Node<X>)) {
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
                let tick = self.next_tick();
                let fresh = !self.nodes.contains_key(&e.id);
                if fresh {
                    let class = init(e).min(self.classes as u8 - 1);
                    let node = Node {
                        parent: e.parent,
                        extra: X::of(e),
                        pin: e.pin,
                        class,
                        at: [0; 3],
                        size: 0,
                        children: [0; 3],
                    };
                    self.nodes.insert(e.id, node);
                }
                let n = self.nodes.get(&e.id).expect("just ensured");
                // A re-insert of a resident copy is a use: it moves to the newest end.
                let had = n.has(t);
                let before = self.queues_of(n);
                let n = self.nodes.get_mut(&e.id).expect("just ensured");
                n.at[t] = tick;
                n.size = u32::try_from(e.size).unwrap_or(u32::MAX);
                n.pin = e.pin;
                let parent = n.parent;
                self.requeue(e.id, before, Some(t));
                if !had && parent != NO_PARENT {
                    self.count_child(parent, t, true);
                }
                self.maybe_compact(t);
                Change::Inserted { fresh }
            }
            EventKind::Accessed => {
                if !self.nodes.get(&e.id).is_some_and(|n| n.has(t)) {
                    return Change::Other;
                }
                let tick = self.next_tick();
                let n = self.nodes.get_mut(&e.id).expect("checked");
                let age = u64::from(tick - n.at[t]);
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
                let age = u64::from(self.tick.saturating_sub(n.at[t]));
                let before = self.queues_of(n);
                let parent = n.parent;
                let n = self.nodes.get_mut(&e.id).expect("present");
                n.at[t] = 0;
                let gone = n.at.iter().all(|&a| a == 0);
                self.requeue(e.id, before, None);
                if parent != NO_PARENT {
                    self.count_child(parent, t, false);
                }
                if gone {
                    self.nodes.remove(&e.id);
                    self.many_children.remove(&e.id);
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

    /// The next tick, renumbering the ticks in use first when the clock has run out.
    fn next_tick(&mut self) -> Tick {
        if self.tick >= self.tick_limit {
            self.renumber();
        }
        self.tick += 1;
        self.tick
    }

    /// Give the ticks in use the numbers 1, 2, ... in their order, and restart the clock after
    /// them. Orderings are unchanged; ages measured across a renumbering come out shorter.
    fn renumber(&mut self) {
        for t in 0..3 {
            self.compact(t);
        }
        let mut used: Vec<Tick> = self.nodes.values().flat_map(|n| n.at).filter(|&a| a != 0).collect();
        used.sort_unstable();
        used.dedup();
        let new = |old: Tick| -> Tick {
            // Every live tick is in `used`; 0 (no copy) stays 0.
            used.binary_search(&old).map_or(0, |i| i as Tick + 1)
        };
        for n in self.nodes.values_mut() {
            for a in &mut n.at {
                *a = new(*a);
            }
        }
        for tq in &mut self.tiers {
            for q in &mut tq.queues {
                for e in &mut q.fifo {
                    e.0 = new(e.0);
                }
                q.late = std::mem::take(&mut q.late).into_iter().map(|(tick, id)| (new(tick), id)).collect();
            }
        }
        self.tick = used.len() as Tick;
    }

    /// Room for `n` more blocks (a bulk load is coming).
    pub fn reserve(&mut self, n: usize) {
        self.nodes.reserve(n);
    }

    fn live(&self, t: usize, q: usize, tick: Tick, id: u64) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.at[t] == tick && self.queue_of(n, t) == Some(q))
    }

    /// Drop the stale entries of tier `t` once they outnumber the live ones (amortized O(1)).
    fn maybe_compact(&mut self, t: usize) {
        let tq = &self.tiers[t];
        if tq.entries <= 2 * tq.live + 1024 {
            return;
        }
        self.compact(t);
    }

    /// Drop every stale entry of tier `t`.
    fn compact(&mut self, t: usize) {
        let tq = &self.tiers[t];
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
        mut rank: impl FnMut(&Node<X>, u64) -> R,
        mut picked: impl FnMut(&Node<X>),
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
        let mut waiting: Vec<(Tick, u64)> = Vec::new();
        for slot in 0..PIN_SLOTS {
            // Cursors over this slot's queues, and parents promoted to leaves in this call.
            let tq = &self.tiers[t];
            let mut iters: Vec<_> = (0..classes).map(|c| tq.queues[slot * classes + c].iter().peekable()).collect();
            let nodes = &self.nodes;
            let mut promoted: Vec<(Tick, u64)> = Vec::new();
            waiting.retain(|&(tick, id)| {
                let mine = nodes.get(&id).is_some_and(|n| pin_slot(n.pin) == Some(slot));
                if mine {
                    promoted.push((tick, id));
                }
                !mine
            });
            let live = |q: usize, tick: Tick, id: u64| {
                nodes.get(&id).is_some_and(|n| {
                    n.at[t] == tick
                        && n.children[t] == 0
                        && pin_slot(n.pin) == Some(q / classes)
                        && n.class as usize == q % classes
                })
            };
            while freed < bytes {
                // The best head among the classes and the promoted parents.
                let mut best: Option<(R, Tick, usize, u64)> = None;
                for (c, it) in iters.iter_mut().enumerate() {
                    let q = slot * classes + c;
                    while let Some(&(tick, id)) = it.peek() {
                        if live(q, tick, id) && !chosen.contains(&id) && exclude.binary_search(&id).is_err() {
                            break;
                        }
                        it.next();
                    }
                    if let Some(&(tick, id)) = it.peek() {
                        let r = rank(&nodes[&id], u64::from(tick));
                        if best.as_ref().is_none_or(|b| r < b.0 || (r == b.0 && tick < b.1)) {
                            best = Some((r, tick, c, id));
                        }
                    }
                }
                for (i, &(tick, id)) in promoted.iter().enumerate() {
                    let r = rank(&nodes[&id], u64::from(tick));
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
                freed = freed.saturating_add(u64::from(n.size));
                if let Some(p) = nodes.get(&n.parent) {
                    let taken = taken_children.entry(n.parent).or_insert(0);
                    *taken += 1;
                    if *taken >= self.children(n.parent, p, t) && p.has(t) && exclude.binary_search(&n.parent).is_err()
                    {
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
            let mut inner: Vec<(Tick, u64)> = nodes
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
                freed = freed.saturating_add(u64::from(nodes[&id].size));
            }
            if freed >= bytes {
                break;
            }
        }
        out
    }
}

// Every node keeps a tick per tier: keep the node from growing unnoticed.
const _: () = assert!(std::mem::size_of::<Node>() <= 32);

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::Tier;

    /// A clock renumbered every few dozen events chooses exactly the victims of one that never
    /// is, over a random stream of chained inserts, reads, removals and pin changes in two tiers.
    #[test]
    fn renumbering_the_clock_keeps_every_choice() {
        let mut plain: Leaves = Leaves::new(2);
        let mut small: Leaves = Leaves::new(2);
        // Above the ticks 300 blocks in two tiers can hold, so each renumbering frees room.
        small.tick_limit = 1_000;
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let class = |e: &Event| (e.id % 2) as u8;
        let mut renumbered = 0;
        for step in 0..20_000 {
            let id = 1 + rnd() % 300;
            let tier = if rnd() % 3 == 0 { Tier::Ssd } else { Tier::Dram };
            let e = match rnd() % 10 {
                0..=3 => Event::inserted(
                    id,
                    1 + rnd() % 100,
                    tier,
                    if id > 1 && rnd() % 2 == 0 { id - 1 } else { NO_PARENT },
                ),
                4..=6 => Event::accessed(id, tier),
                7 | 8 => Event::removed(id, tier),
                _ => Event::pin_changed(id, [Pin::None, Pin::Soft][(rnd() % 2) as usize]),
            };
            let before = small.tick;
            assert_eq!(plain.apply(&e, class) == Change::Other, small.apply(&e, class) == Change::Other);
            renumbered += usize::from(small.tick < before);
            if step % 97 == 0 {
                let bytes = rnd() % 2_000;
                let ex: Vec<u64> =
                    (0..5).map(|_| 1 + rnd() % 300).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
                let a = plain.victims(tier, bytes, &ex, |n, tick| (n.class, tick), |_| {});
                let b = small.victims(tier, bytes, &ex, |n, tick| (n.class, tick), |_| {});
                assert_eq!(a, b, "step {step}");
            }
        }
        assert!(renumbered > 10, "the small clock was renumbered {renumbered} times");
        assert!(small.tick <= 1_000);
    }

    /// Child counts past the spill mark are kept exactly aside: with a mark of 3, wide fan-outs
    /// (a few parents under hundreds of children, in two tiers) give the same counts and the
    /// same victims as the two-byte counts that never spill, and the side table empties.
    #[test]
    fn spilled_child_counts_keep_every_choice() {
        let mut plain: Leaves = Leaves::new(1);
        let mut small: Leaves = Leaves::new(1);
        small.spill = 3;
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut spilled = 0;
        for step in 0..30_000 {
            let id = 1 + rnd() % 400;
            let tier = if rnd() % 3 == 0 { Tier::Ssd } else { Tier::Dram };
            let e = match rnd() % 10 {
                // Blocks above 8 hang under one of the first 8: wide fan-outs.
                0..=4 => Event::inserted(id, 1 + rnd() % 100, tier, if id > 8 { 1 + rnd() % 8 } else { NO_PARENT }),
                5 | 6 => Event::accessed(id, tier),
                _ => Event::removed(id, tier),
            };
            plain.apply(&e, |_| 0);
            small.apply(&e, |_| 0);
            spilled = spilled.max(small.many_children.len());
            for p in 1..=8 {
                if let (Some(a), Some(b)) = (plain.nodes.get(&p), small.nodes.get(&p)) {
                    for t in 0..3 {
                        assert_eq!(plain.children(p, a, t), small.children(p, b, t), "step {step}, block {p}");
                    }
                }
            }
            if step % 89 == 0 {
                let bytes = rnd() % 3_000;
                let a = plain.victims(tier, bytes, &[], |_, tick| tick, |_| {});
                let b = small.victims(tier, bytes, &[], |_, tick| tick, |_| {});
                assert_eq!(a, b, "step {step}");
            }
        }
        assert!(spilled > 0, "no count spilled");
        for id in 1..=400 {
            for t in Tier::ALL {
                plain.apply(&Event::removed(id, t), |_| 0);
                small.apply(&Event::removed(id, t), |_| 0);
            }
        }
        assert!(small.many_children.is_empty() && small.nodes.iter().next().is_none());
    }
}
