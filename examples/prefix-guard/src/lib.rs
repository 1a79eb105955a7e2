//! Prefix guard: eviction that keeps shared prefixes.
//!
//! Users of KV pools ask for guaranteed retention of hot prefixes such as system prompts
//! (Mooncake #2703, SGLang #21045). Pinning them needs the client to know which they are; this
//! policy finds them itself. A key is *shared* when at least `min_fanout` different child keys
//! were seen under it (a system prompt has many continuations, a conversation's own blocks one
//! each); a shared block at depth below `max_depth` is guarded: it goes only after every
//! unguarded block. Among the rest, leaves go first (a block is useless without its
//! ancestors), the one idle longest first, by the host's `time` column (deterministic in a
//! replay, unlike a clock read). Soft pins go after everything unpinned, hard pins never.
//!
//! What it shows of the SDK: key hashes (fan-out is counted per key, so it survives eviction
//! and re-put under fresh ids), the `depth` and `time` columns, misses (a miss names the resident
//! parent, which counts as a continuation too), and the chain rule (only leaves are named while
//! any is left).
//!
//! Parameters: `min_fanout` (default 4), `max_depth` (default 64), `remember` (keys whose
//! fan-out is kept, default 1,000,000; the oldest are forgotten first).

use kvpool_policy_sdk::{
    export_eviction, Event, EventKind, Events, EvictionPolicy, FromParams, ParamError, Params, Pin, Tier, NO_DEPTH,
    NO_PARENT,
};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

#[derive(Debug, Clone)]
struct Block {
    key: u64,
    parent: u64,
    depth: u32,
    pin: Pin,
    /// Per tier: (size, last access time) while a copy is resident there.
    copies: [Option<(u64, u64)>; 3],
    /// Per tier: resident children.
    children: [u32; 3],
}

/// Child keys seen under each key (bounded: `remember` keys, oldest forgotten).
#[derive(Debug, Default)]
struct Fanout {
    children: HashMap<u64, HashSet<u64>>,
    order: VecDeque<u64>,
    remember: usize,
}

impl Fanout {
    fn add(&mut self, parent_key: u64, child_key: u64) {
        if !self.children.contains_key(&parent_key) {
            while self.children.len() >= self.remember {
                match self.order.pop_front() {
                    Some(old) => {
                        self.children.remove(&old);
                    }
                    None => break,
                }
            }
            self.order.push_back(parent_key);
        }
        let set = self.children.entry(parent_key).or_default();
        // A few more than needed is enough to know a key is shared.
        if set.len() < 64 {
            set.insert(child_key);
        }
    }
    fn of(&self, key: u64) -> usize {
        self.children.get(&key).map_or(0, HashSet::len)
    }
}

#[derive(Debug)]
pub struct PrefixGuard {
    min_fanout: usize,
    max_depth: u32,
    blocks: HashMap<u64, Block>,
    fanout: Fanout,
    /// Per tier: ordering (class, time, id) of every copy that may be evicted.
    order: [BTreeSet<(u8, u64, u64)>; 3],
}

impl PrefixGuard {
    fn guarded(&self, b: &Block) -> bool {
        b.depth != NO_DEPTH && b.depth < self.max_depth && self.fanout.of(b.key) >= self.min_fanout
    }

    /// Ordering class of the copy in tier `t`: pins, then guard, then leaf or inner.
    fn class(&self, b: &Block, t: usize) -> Option<u8> {
        let pin = match b.pin {
            Pin::None => 0,
            Pin::Soft => 4,
            Pin::Hard => return None,
        };
        Some(pin + 2 * u8::from(self.guarded(b)) + u8::from(b.children[t] > 0))
    }

    fn entries(&self, id: u64) -> Vec<(usize, (u8, u64, u64))> {
        let Some(b) = self.blocks.get(&id) else { return Vec::new() };
        (0..3)
            .filter_map(|t| {
                let (_, time) = b.copies[t]?;
                Some((t, (self.class(b, t)?, time, id)))
            })
            .collect()
    }

    /// Apply `f` to block `id`, keeping its entries (and its parent's) in the orderings.
    fn update(&mut self, id: u64, f: impl FnOnce(&mut Block)) {
        for (t, e) in self.entries(id) {
            self.order[t].remove(&e);
        }
        if let Some(b) = self.blocks.get_mut(&id) {
            f(b);
        }
        for (t, e) in self.entries(id) {
            self.order[t].insert(e);
        }
    }

    /// Count `child_key` under the parent block `parent` (a continuation of its prefix); the
    /// parent may become shared, which moves its entries to another class.
    fn continued(&mut self, parent: u64, child_key: u64) {
        let Some(pk) = self.blocks.get(&parent).map(|p| p.key) else { return };
        for (t, e) in self.entries(parent) {
            self.order[t].remove(&e);
        }
        self.fanout.add(pk, child_key);
        for (t, e) in self.entries(parent) {
            self.order[t].insert(e);
        }
    }

    fn apply(&mut self, e: Event) {
        let t = e.tier as usize;
        match e.kind {
            EventKind::Inserted => {
                if let std::collections::hash_map::Entry::Vacant(v) = self.blocks.entry(e.id) {
                    v.insert(Block {
                        key: e.key,
                        parent: e.parent,
                        depth: e.depth,
                        pin: e.pin,
                        copies: [None; 3],
                        children: [0; 3],
                    });
                    self.continued(e.parent, e.key);
                }
                let had = self.blocks[&e.id].copies[t].is_some();
                self.update(e.id, |b| {
                    b.copies[t] = Some((e.size, e.time));
                    b.pin = e.pin;
                });
                if !had && e.parent != NO_PARENT {
                    self.update(e.parent, |p| p.children[t] += 1);
                }
            }
            EventKind::Accessed => self.update(e.id, |b| {
                if let Some((size, _)) = b.copies[t] {
                    b.copies[t] = Some((size, e.time));
                }
            }),
            EventKind::Removed => {
                let Some(b) = self.blocks.get(&e.id) else { return };
                if b.copies[t].is_none() {
                    return;
                }
                let parent = b.parent;
                self.update(e.id, |b| b.copies[t] = None);
                if self.blocks[&e.id].copies.iter().all(Option::is_none) {
                    self.blocks.remove(&e.id);
                }
                self.update(parent, |p| p.children[t] = p.children[t].saturating_sub(1));
            }
            EventKind::PinChanged => self.update(e.id, |b| b.pin = e.pin),
            // A request went through the parent and on to a key it does not have: that is a
            // continuation of the parent's prefix as much as a stored child is.
            EventKind::Missed => self.continued(e.parent, e.key),
        }
    }
}

impl FromParams for PrefixGuard {
    fn from_params(p: &Params) -> Result<PrefixGuard, ParamError> {
        Ok(PrefixGuard {
            min_fanout: p.get_u64("min_fanout", 4)?.clamp(1, 64) as usize,
            max_depth: p.get_u64("max_depth", 64)?.min(u64::from(u32::MAX)) as u32,
            blocks: HashMap::new(),
            fanout: Fanout { remember: p.get_u64("remember", 1_000_000)?.max(1) as usize, ..Fanout::default() },
            order: Default::default(),
        })
    }
}

impl EvictionPolicy for PrefixGuard {
    fn on_events(&mut self, events: &Events) {
        for e in events.iter() {
            self.apply(e);
        }
    }

    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        let t = tier as usize;
        let mut out = Vec::new();
        let mut freed = 0;
        let mut chosen: HashSet<u64> = HashSet::new();
        // Children of each block chosen in this call; a parent whose children all went joins
        // the leaves (`promoted`) with its own class and idle time.
        let mut taken: HashMap<u64, u32> = HashMap::new();
        let mut promoted: BTreeSet<(u8, u64, u64)> = BTreeSet::new();
        let usable = |id: &u64, chosen: &HashSet<u64>| !chosen.contains(id) && exclude.binary_search(id).is_err();
        let mut leaves = self.order[t].iter().filter(|e| e.0 % 2 == 0).peekable();
        while freed < bytes {
            while leaves.peek().is_some_and(|e| !usable(&e.2, &chosen)) {
                leaves.next();
            }
            let next = match (leaves.peek().copied(), promoted.first().copied()) {
                (None, None) => break,
                (Some(a), Some(b)) if b < *a => promoted.pop_first(),
                (Some(_), _) => leaves.next().copied(),
                (None, Some(_)) => promoted.pop_first(),
            };
            let Some((_, _, id)) = next else { break };
            let b = &self.blocks[&id];
            chosen.insert(id);
            out.push(id);
            freed += b.copies[t].map_or(0, |c| c.0);
            if let Some(p) = self.blocks.get(&b.parent) {
                let n = taken.entry(b.parent).or_insert(0);
                *n += 1;
                if *n >= p.children[t] && usable(&b.parent, &chosen) {
                    if let (Some(class), Some((_, time))) = (self.class(p, t), p.copies[t]) {
                        promoted.insert((class & !1, time, b.parent));
                    }
                }
            }
        }
        // No leaf left: inner blocks, in their order (the host's chain rule takes their
        // descendants along, or keeps them when a descendant cannot go).
        for &(_, _, id) in self.order[t].iter().filter(|e| e.0 % 2 == 1) {
            if freed >= bytes {
                break;
            }
            if usable(&id, &chosen) {
                chosen.insert(id);
                out.push(id);
                freed += self.blocks[&id].copies[t].map_or(0, |c| c.0);
            }
        }
        out
    }
}

export_eviction!(PrefixGuard);

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> PrefixGuard {
        PrefixGuard::from_params(&Params::from_pairs([("min_fanout", "2")])).unwrap()
    }

    #[test]
    fn shared_prefixes_stay_and_leaves_go_first() {
        let mut p = guard();
        // A system prompt (key 100, id 1) with two conversations under it (2 <- 3, and 4);
        // an unrelated old chain 5 <- 6. Times increase with ids.
        let ev: Events = [
            Event::inserted(5, 10, Tier::Dram, NO_PARENT).with_key(500).with_depth(0).with_time(1),
            Event::inserted(6, 10, Tier::Dram, 5).with_key(600).with_depth(1).with_time(2),
            Event::inserted(1, 10, Tier::Dram, NO_PARENT).with_key(100).with_depth(0).with_time(3),
            Event::inserted(2, 10, Tier::Dram, 1).with_key(200).with_depth(1).with_time(4),
            Event::inserted(3, 10, Tier::Dram, 2).with_key(300).with_depth(2).with_time(5),
            Event::inserted(4, 10, Tier::Dram, 1).with_key(400).with_depth(1).with_time(6),
        ]
        .into_iter()
        .collect();
        p.on_events(&ev);
        // 1 is shared (two children): it goes last though it is older than 2, 3 and 4.
        assert_eq!(p.victims(Tier::Dram, 60, &[]), vec![6, 5, 3, 2, 4, 1]);
        assert_eq!(p.victims(Tier::Dram, 10, &[6]), vec![3]);
    }

    #[test]
    fn fanout_follows_keys_across_reputs() {
        let mut p = guard();
        p.on_events(
            &[
                Event::inserted(1, 10, Tier::Dram, NO_PARENT).with_key(100).with_depth(0).with_time(1),
                // A lookup continued past the prompt to a key it does not have.
                Event::missed(700, 1, 1).with_time(2),
                Event::inserted(2, 10, Tier::Dram, 1).with_key(200).with_depth(1).with_time(3),
                Event::inserted(9, 10, Tier::Dram, NO_PARENT).with_key(900).with_depth(0).with_time(4),
            ]
            .into_iter()
            .collect(),
        );
        assert!(p.guarded(&p.blocks[&1]));
        // Evicted and put back under a fresh id, the prompt is still known to be shared.
        p.on_events(
            &[
                Event::removed(2, Tier::Dram),
                Event::removed(1, Tier::Dram),
                Event::inserted(7, 10, Tier::Dram, NO_PARENT).with_key(100).with_depth(0).with_time(5),
            ]
            .into_iter()
            .collect(),
        );
        assert_eq!(p.victims(Tier::Dram, 10, &[]), vec![9]);
    }
}
