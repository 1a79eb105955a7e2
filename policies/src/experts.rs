//! Chain experts: prefix-aware eviction that picks, per tier and as the traffic changes, the
//! best of four orderings of the leaves, judged by what each would have hit.
//!
//! Blocks are in two classes by the reuse of the chains that run through them: *fresh* (no
//! request but the one that put it wanted its key) and *reused* (its key was wanted again: a
//! read, which a hit on any descendant implies, or a miss of the key after it was evicted,
//! remembered by key hash in ghost lists). The four experts, all over leaves only:
//!
//! - `lru`: the least recently used leaf, whatever its class (the server's default, leaf-lru);
//! - `arc`: ARC's rule (FAST'03): fresh leaves go while there are more fresh blocks than a
//!   target `p`, which grows when an evicted fresh key comes back and shrinks when an evicted
//!   reused one does (ghosts B1 and B2, by key hash, each as long as the tier);
//! - `s3fifo`: S3-FIFO's quick demotion (SOSP'23): fresh leaves go while they are more than 10%
//!   of the tier, and a key that comes back from the ghost is reused from then on;
//! - `filter`: every fresh leaf goes before any reused one: the eviction-side twin of a
//!   doorkeeper (TinyLFU) admitting only keys wanted twice, a miss after eviction counting as
//!   the second time (the key comes back reused).
//!
//! Each expert also runs in a shadow: its own simulation of the tier at the tier's current
//! size, keyed by key hash, fed the same reads and misses (a prefix hit in a shadow needs the
//! key and its parent's key there). Hits in each shadow are counted with an exponential decay
//! (half-life about eight tier-fulls of reads and misses), and the real tier evicts in the order
//! of the expert whose shadow leads. That is LeCaR's and Cacheus' idea of adaptive experts,
//! with regret measured by full shadow simulations instead of ghost hits, because a mix of
//! orderings is worth less than the best of them here: on chat traffic leaf-first LRU wins at
//! large sizes and ARC at small ones, on system prompts ARC and S3-FIFO win everywhere, and the
//! winner moves with the capacity.
//!
//! Costs: four shadows of the whole tier (keys only) about quadruple the memory of a leaf
//! ordering (about 1.1 KB per resident block in Wasm, against 340 for leaf-lru) and add their
//! work to every read and miss. `sample=N` simulates one chain in N instead (chains sampled by
//! the key of their first block below the root, roots always; each shadow sized to the share of
//! the traffic it sees, as SHARDS adjusts its sample), for a fraction of the memory, at a cost
//! in hit rate measured in `bench/RESULTS.md`: small on chat, large where every chain shares a
//! long prefix (one tag for all, sampled or not as a whole); `shadows=false` runs `expert`
//! alone. Parameters: `expert` (the one to start with, or the only one without shadows;
//! default `lru`), `shadows` (default true), `sample` (default 1), `small_pct` (S3-FIFO's
//! small share, default 10).

use crate::filters::Sketch;
use crate::ghosts::Ghosts;
use crate::hash::IdMap;
use crate::leaves::{Change, Key, Leaves, Node};
use kvpool_policy_sdk::{
    Event, EventKind, Events, EvictionPolicy, FromParams, ParamError, Params, Tier, NO_DEPTH, NO_PARENT,
};
use std::cell::Cell;

/// An ordering of the leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Lru,
    Arc,
    S3Fifo,
    Filter,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Lru, Mode::Arc, Mode::S3Fifo, Mode::Filter];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Lru => "lru",
            Mode::Arc => "arc",
            Mode::S3Fifo => "s3fifo",
            Mode::Filter => "filter",
        }
    }

    fn parse(s: &str) -> Option<Mode> {
        Mode::ALL.into_iter().find(|m| m.name() == s)
    }
}

const FRESH: u8 = 0;
const REUSED: u8 = 1;

/// One prefix-aware cache ordering with the state all the experts need (classes, ghosts,
/// ARC's target): used for the real tier and for every shadow.
#[derive(Debug)]
struct Orderings {
    leaves: Leaves<Key>,
    /// B1 (evicted fresh) and B2 (evicted reused).
    ghosts: [Ghosts; 2],
    /// ARC's target number of fresh copies, per tier.
    p: [f64; 3],
    /// Resident copies per tier and class.
    count: [[usize; 2]; 3],
    small_pct: u64,
}

impl Orderings {
    fn new(small_pct: u64) -> Orderings {
        Orderings { leaves: Leaves::new(2), ghosts: Default::default(), p: [0.0; 3], count: [[0; 2]; 3], small_pct }
    }

    fn resident(&self, t: usize) -> usize {
        self.count[t][0] + self.count[t][1]
    }

    fn total(&self) -> usize {
        (0..3).map(|t| self.resident(t)).sum()
    }

    /// Apply an event; `wanted` is how many requests wanted the key lately (the shared
    /// sketch's estimate), which makes a new block fresh (1) or reused (2 or more).
    fn apply(&mut self, e: &Event, wanted: u8) {
        let t = e.tier as usize;
        if e.kind == EventKind::Missed {
            return;
        }
        let before = self.leaves.nodes.get(&e.id).map(|n| (n.class, n.extra.0, n.at));
        if e.kind == EventKind::Inserted && before.is_none() {
            // ARC adapts when a ghost comes back: a fresh one says fresh blocks went too soon.
            let back = if self.ghosts[0].take(e.key) {
                Some(0)
            } else if self.ghosts[1].take(e.key) {
                Some(1)
            } else {
                None
            };
            if let Some(i) = back {
                let (b1, b2) = (self.ghosts[0].len().max(1) as f64, self.ghosts[1].len().max(1) as f64);
                let c = self.resident(t).max(1) as f64;
                self.p[t] = if i == 0 {
                    (self.p[t] + (b2 / b1).max(1.0)).min(c)
                } else {
                    (self.p[t] - (b1 / b2).max(1.0)).max(0.0)
                };
            }
        }
        // The host's count (requests that wanted the key, in a warm snapshot too) or the
        // sketch's, whichever knows more.
        let change = self.leaves.apply(e, |e| if wanted.max(e.count.min(255) as u8) >= 2 { REUSED } else { FRESH });
        match change {
            Change::Inserted { .. } => {
                let class = self.leaves.nodes.get(&e.id).map_or(FRESH, |n| n.class);
                self.count[t][class as usize] += 1;
            }
            Change::Read { .. } => {
                if let Some((FRESH, _, at)) = before {
                    // First reuse: every copy of the block moves to the reused class.
                    for (tt, &a) in at.iter().enumerate() {
                        if a != 0 {
                            self.count[tt][0] -= 1;
                            self.count[tt][1] += 1;
                        }
                    }
                    self.leaves.update(e.id, |n| n.class = REUSED);
                }
            }
            Change::Removed { gone, .. } => {
                if let Some((class, key, _)) = before {
                    self.count[t][class as usize] -= 1;
                    if gone {
                        let cap = self.total().max(1024);
                        self.ghosts[class as usize].put(key, cap);
                    }
                }
            }
            Change::Other => {}
        }
    }

    fn victims(&mut self, mode: Mode, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        let t = tier as usize;
        match mode {
            Mode::Lru => self.leaves.victims(tier, bytes, exclude, |_, tick| (0u8, tick), |_| {}),
            Mode::Arc | Mode::S3Fifo | Mode::Filter => {
                let target = match mode {
                    Mode::Arc => self.p[t],
                    Mode::S3Fifo => (self.resident(t) as u64 * self.small_pct / 100) as f64,
                    _ => 0.0,
                };
                // Fresh leaves go while the fresh copies not yet chosen exceed the target.
                let fresh_left = Cell::new(self.count[t][0]);
                self.leaves.victims(
                    tier,
                    bytes,
                    exclude,
                    |n: &Node<Key>, _| {
                        let over = fresh_left.get() as f64 > target;
                        (u8::from((n.class == FRESH) != over), 0u64)
                    },
                    |n: &Node<Key>| {
                        if n.class == FRESH {
                            fresh_left.set(fresh_left.get().saturating_sub(1));
                        }
                    },
                )
            }
        }
    }
}

/// The experts simulating one tier.
#[derive(Debug)]
struct Shadows {
    experts: Vec<Orderings>,
    /// Decayed hits of each expert.
    score: [f64; 4],
}

#[derive(Debug)]
pub struct ChainExperts {
    real: Orderings,
    /// Requests per key (reads and misses), TinyLFU's sketch with its periodic halving: it
    /// remembers keys for about ten pool-fulls of requests, far longer than a ghost list.
    wanted: Sketch,
    shadows: [Option<Box<Shadows>>; 3],
    mode: [Mode; 3],
    use_shadows: bool,
    small_pct: u64,
    /// One chain in `sample` is simulated in the shadows (SHARDS-style spatial sampling, by
    /// chain so that prefixes stay whole), at 1/`sample` of the tier's size.
    sample: u64,
    /// Chain tag of every resident block: its own key below a root, its parent's tag deeper,
    /// [`ROOT`] for a root (roots are shared by many chains: always simulated).
    tags: IdMap<u64, u64>,
    /// Resident roots (simulated in full).
    roots: usize,
    /// Per tier: reads and misses below the roots seen, and those simulated (decayed): the shadows' size is
    /// the tier's times the share of traffic they see, as SHARDS adjusts for the sample it
    /// actually got (chains are not equally busy, and few chains may share a tag).
    traffic: [(f64, f64); 3],
    /// Per tier: the depth, key and tag of the last miss (the parent of a deeper miss in a
    /// lookup).
    last_miss: [(u32, u64, u64); 3],
}

/// Tag of a root block.
const ROOT: u64 = u64::MAX;

impl Default for ChainExperts {
    fn default() -> ChainExperts {
        ChainExperts::with(Mode::Lru, true, 10, 1)
    }
}

impl ChainExperts {
    pub fn new() -> ChainExperts {
        ChainExperts::default()
    }

    fn with(mode: Mode, use_shadows: bool, small_pct: u64, sample: u64) -> ChainExperts {
        ChainExperts {
            real: Orderings::new(small_pct),
            wanted: Sketch::for_blocks(1024),
            shadows: [None, None, None],
            mode: [mode; 3],
            use_shadows,
            small_pct,
            sample: sample.max(1),
            tags: IdMap::default(),
            roots: 0,
            traffic: [(0.0, 0.0); 3],
            last_miss: [(NO_DEPTH, 0, ROOT); 3],
        }
    }

    /// The expert evicting in `tier` now.
    pub fn mode(&self, tier: Tier) -> Mode {
        self.mode[tier as usize]
    }

    /// Tag of a block whose parent has tag `parent` (`None`: no known parent).
    fn tag_under(parent: Option<u64>, key: u64, depth: u32) -> u64 {
        match parent {
            _ if depth == 0 => ROOT,
            Some(ROOT) | None => key,
            Some(tag) => tag,
        }
    }

    fn sampled(&self, tag: u64) -> bool {
        // Mixed first: tags are key hashes from a host, but any u64 from a test.
        tag == ROOT || (tag.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32).is_multiple_of(self.sample)
    }

    /// Feed a read or a miss of `key` (of chain `tag`) to the shadows of tier `t`.
    fn shadow(&mut self, t: usize, key: u64, parent_key: Option<u64>, tag: u64) {
        let sampled = self.sampled(tag);
        let resident = self.real.resident(t).max(1) as f64;
        let roots = self.roots.min(self.real.resident(t)) as f64;
        let (all, some) = &mut self.traffic[t];
        if tag != ROOT {
            let keep = 1.0 - 1.0 / (8.0 * resident).max(1024.0);
            *all = *all * keep + 1.0;
            *some = *some * keep + f64::from(u8::from(sampled));
        }
        if !sampled {
            return;
        }
        let wanted = self.wanted.estimate(key);
        let share = if *all > 0.0 { *some / *all } else { 1.0 };
        let cap = ((roots + (resident - roots) * share).round() as usize).max(1);
        let small_pct = self.small_pct;
        let sh = self.shadows[t].get_or_insert_with(|| {
            Box::new(Shadows {
                experts: Mode::ALL.iter().map(|_| Orderings::new(small_pct)).collect(),
                score: [0.0; 4],
            })
        });
        // Half-life of about eight tier-fulls of reads and misses (chosen on the synthetic
        // traces: shorter memories flap between near-equal experts).
        let decay = 1.0 - 1.0 / (8.0 * cap as f64 * std::f64::consts::LN_2).max(64.0);
        let d = Tier::Dram as usize;
        for (i, mode) in Mode::ALL.into_iter().enumerate() {
            let ex = &mut sh.experts[i];
            sh.score[i] *= decay;
            let has = |ex: &Orderings, k: u64| ex.leaves.nodes.get(&k).is_some_and(|n| n.has(d));
            let parent_ok = parent_key.is_none_or(|p| has(ex, p));
            if !parent_ok {
                continue;
            }
            if has(ex, key) {
                sh.score[i] += 1.0;
                ex.apply(&Event::accessed(key, Tier::Dram).with_key(key), wanted);
                continue;
            }
            while ex.resident(d) >= cap {
                let exclude: Vec<u64> = parent_key.into_iter().collect();
                let v = ex.victims(mode, Tier::Dram, 1, &exclude);
                if v.is_empty() {
                    break;
                }
                for id in v {
                    ex.apply(&Event::removed(id, Tier::Dram), wanted);
                }
            }
            let parent = parent_key.unwrap_or(NO_PARENT);
            ex.apply(&Event::inserted(key, 1, Tier::Dram, parent).with_key(key), wanted);
        }
        // Follow the leader, with a little hysteresis against flapping between near ties.
        let cur = Mode::ALL.iter().position(|m| *m == self.mode[t]).unwrap_or(0);
        let (best, &top) = sh.score.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).expect("four experts");
        if top > sh.score[cur] * 1.002 + 1.0 {
            self.mode[t] = Mode::ALL[best];
        }
    }

    fn apply(&mut self, e: &Event) {
        let t = e.tier as usize;
        // Every request that wants a key counts, hit or miss (a snapshot's reads too).
        match e.kind {
            EventKind::Accessed | EventKind::Missed => self.wanted.add(e.key),
            EventKind::Inserted => {
                // The host's count is a running total: top the sketch up to it (a warm snapshot).
                // Most inserts carry none, and a sketch lookup is four cache misses in a large
                // pool: ask only when there is something to top up.
                if e.count > 0 {
                    for _ in self.wanted.estimate(e.key)..e.count.min(16) as u8 {
                        self.wanted.add(e.key);
                    }
                }
                // Grow the sketch with the pool (counts restart, each time the pool doubles).
                let total = self.real.total() as u64;
                if total * 10 > 2 * self.wanted.sample() {
                    self.wanted = Sketch::for_blocks(2 * total as usize);
                }
            }
            _ => {}
        }
        if self.use_shadows {
            match e.kind {
                EventKind::Accessed => {
                    let node = self.real.leaves.nodes.get(&e.id);
                    let parent_key = node.and_then(|n| self.real.leaves.nodes.get(&n.parent)).map(|p| p.extra.0);
                    let key = node.map_or(e.key, |n| n.extra.0);
                    let tag = self.tags.get(&e.id).copied().unwrap_or(key);
                    self.shadow(t, key, parent_key, tag);
                }
                EventKind::Missed => {
                    let (parent_key, parent_tag) = match self.real.leaves.nodes.get(&e.parent) {
                        Some(p) => (Some(p.extra.0), self.tags.get(&e.parent).copied()),
                        None if e.depth != NO_DEPTH && e.depth > 0 && self.last_miss[t].0 == e.depth - 1 => {
                            (Some(self.last_miss[t].1), Some(self.last_miss[t].2))
                        }
                        None => (None, None),
                    };
                    let tag = ChainExperts::tag_under(parent_tag, e.key, e.depth);
                    self.last_miss[t] = (e.depth, e.key, tag);
                    self.shadow(t, e.key, parent_key, tag);
                }
                EventKind::Inserted if !self.tags.contains_key(&e.id) => {
                    let parent_tag = self.tags.get(&e.parent).copied();
                    let depth = if e.parent == NO_PARENT { 0 } else { e.depth.max(1) };
                    let tag = ChainExperts::tag_under(parent_tag, e.key, depth);
                    self.roots += usize::from(tag == ROOT);
                    self.tags.insert(e.id, tag);
                }
                EventKind::Removed => {
                    // The real tree forgets a block with its last copy: so do the tags.
                    let last = self
                        .real
                        .leaves
                        .nodes
                        .get(&e.id)
                        .is_some_and(|n| n.at.iter().enumerate().all(|(tt, &a)| a == 0 || tt == t));
                    if last && self.tags.remove(&e.id) == Some(ROOT) {
                        self.roots -= 1;
                    }
                }
                _ => {}
            }
        }
        // Only a new block's class depends on how wanted its key is.
        let wanted = if e.kind == EventKind::Inserted { self.wanted.estimate(e.key) } else { 0 };
        self.real.apply(e, wanted);
    }
}

impl FromParams for ChainExperts {
    fn from_params(p: &Params) -> Result<ChainExperts, ParamError> {
        let mode = match p.get("expert").map(str::trim) {
            None => Mode::Lru,
            Some(m) => Mode::parse(m)
                .ok_or_else(|| ParamError(format!("expert {m:?} is not one of lru, arc, s3fifo, filter")))?,
        };
        let small_pct = p.get_u64("small_pct", 10)?.clamp(1, 90);
        let sample = p.get_u64("sample", 1)?.clamp(1, 1 << 16);
        Ok(ChainExperts::with(mode, p.get_bool("shadows", true)?, small_pct, sample))
    }
}

impl EvictionPolicy for ChainExperts {
    fn on_events(&mut self, events: &Events) {
        // Bulk loads (a replayed snapshot) grow the maps once instead of rehashing as they go.
        if events.len() >= 4096 {
            self.real.leaves.reserve(events.len());
            if self.use_shadows {
                self.tags.reserve(events.len());
            }
        }
        for e in events.iter() {
            self.apply(&e);
        }
    }

    fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
        self.real.victims(self.mode[tier as usize], tier, bytes, exclude)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{Pin, NO_PARENT};
    use std::collections::HashMap;

    fn ev(list: &[Event]) -> Events {
        list.iter().copied().collect()
    }

    fn params(kv: &[(&str, &str)]) -> Params {
        Params::from_pairs(kv.iter().copied())
    }

    #[test]
    fn lru_expert_alone_is_leaf_lru() {
        let mut a = ChainExperts::from_params(&params(&[("shadows", "false")])).unwrap();
        let mut b = crate::LeafLru::new();
        let batch = ev(&[
            Event::inserted(1, 10, Tier::Dram, NO_PARENT),
            Event::inserted(2, 10, Tier::Dram, 1),
            Event::inserted(3, 10, Tier::Dram, 2),
            Event::inserted(4, 10, Tier::Dram, NO_PARENT).with_pin(Pin::Soft),
            Event::inserted(5, 10, Tier::Dram, NO_PARENT),
            Event::inserted(6, 10, Tier::Dram, 1),
            Event::accessed(1, Tier::Dram),
            Event::accessed(2, Tier::Dram),
            Event::inserted(7, 10, Tier::Ssd, NO_PARENT).with_pin(Pin::Hard),
        ]);
        a.on_events(&batch);
        b.on_events(&batch);
        for bytes in [10, 20, 30, 50, 70] {
            for ex in [&[][..], &[3][..], &[2, 5][..]] {
                assert_eq!(a.victims(Tier::Dram, bytes, ex), b.victims(Tier::Dram, bytes, ex), "{bytes} {ex:?}");
            }
        }
        assert_eq!(a.victims(Tier::Dram, 70, &[]), vec![3, 5, 6, 2, 1, 4]);
        assert!(a.victims(Tier::Ssd, 10, &[]).is_empty());
    }

    #[test]
    fn class_follows_the_key_across_evict_and_reput() {
        let mut p = ChainExperts::from_params(&params(&[("shadows", "false"), ("expert", "filter")])).unwrap();
        // Key 100 under id 1 and key 200 under id 2, both new (fresh); 1 is older.
        p.on_events(&ev(&[
            Event::missed(100, 0, NO_PARENT),
            Event::inserted(1, 1, Tier::Dram, NO_PARENT).with_key(100),
            Event::missed(200, 0, NO_PARENT),
            Event::inserted(2, 1, Tier::Dram, NO_PARENT).with_key(200),
        ]));
        assert_eq!(p.victims(Tier::Dram, 1, &[]), vec![1]);
        // Key 100 is evicted, wanted again, put back under a fresh id: it is reused now, so the
        // filter expert keeps it over the fresh block 2 although it is newer.
        p.on_events(&ev(&[
            Event::removed(1, Tier::Dram),
            Event::missed(100, 0, NO_PARENT),
            Event::inserted(3, 1, Tier::Dram, NO_PARENT).with_key(100),
        ]));
        assert_eq!(p.victims(Tier::Dram, 1, &[]), vec![2]);
        // A warm snapshot row with reads starts reused as well.
        let mut q = ChainExperts::from_params(&params(&[("shadows", "false"), ("expert", "filter")])).unwrap();
        q.on_events(&ev(&[
            Event::inserted(1, 1, Tier::Dram, NO_PARENT).with_key(100).with_count(2),
            Event::inserted(2, 1, Tier::Dram, NO_PARENT).with_key(200),
        ]));
        assert_eq!(q.victims(Tier::Dram, 1, &[]), vec![2]);
    }

    /// A pool of 500 blocks; each round puts a block that is never read again and reads one of
    /// 300 hot keys at random (a missing one is put back under a fresh id). Returns the share of
    /// hot reads that hit after a warm-up.
    fn hot_hit_rate(p: &mut dyn EvictionPolicy) -> f64 {
        let (mut next_id, mut x) = (1u64, 12345u64);
        let mut by_key: HashMap<u64, u64> = HashMap::new();
        let (mut reads, mut hits) = (0u32, 0u32);
        let mut put = |p: &mut dyn EvictionPolicy, key: u64, by_key: &mut HashMap<u64, u64>| {
            p.on_events(&ev(&[Event::missed(key, 0, NO_PARENT)]));
            if by_key.len() >= 500 {
                let v = p.victims(Tier::Dram, 1, &[]);
                by_key.retain(|_, id| !v.contains(id));
                p.on_events(&v.iter().map(|&id| Event::removed(id, Tier::Dram)).collect());
            }
            p.on_events(&ev(&[Event::inserted(next_id, 1, Tier::Dram, NO_PARENT).with_key(key)]));
            by_key.insert(key, next_id);
            next_id += 1;
        };
        for round in 0..30_000u64 {
            put(p, 1_000_000 + round, &mut by_key);
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let hot = (x >> 33) % 300;
            reads += u32::from(round > 10_000);
            match by_key.get(&hot) {
                Some(&id) => {
                    hits += u32::from(round > 10_000);
                    p.on_events(&ev(&[Event::accessed(id, Tier::Dram).with_key(hot)]));
                }
                None => put(p, hot, &mut by_key),
            }
        }
        f64::from(hits) / f64::from(reads)
    }

    #[test]
    fn follows_the_expert_whose_shadow_hits_most() {
        let lru = hot_hit_rate(&mut crate::LeafLru::new());
        let mut p = ChainExperts::new();
        let experts = hot_hit_rate(&mut p);
        assert_ne!(p.mode(Tier::Dram), Mode::Lru);
        assert!(experts > 0.9 && experts > lru + 0.15, "chain-experts {experts:.3} vs leaf-lru {lru:.3}");
    }

    /// Sampled shadows see a share of the chains, sized to the share of traffic they get:
    /// with chains of two blocks under one root and one chain in eight simulated, the same hot
    /// set is still found.
    #[test]
    fn sampled_shadows_follow_the_same_expert() {
        let mut p = ChainExperts::from_params(&params(&[("sample", "8")])).unwrap();
        let (mut next_id, mut x) = (10u64, 99u64);
        let mut by_key: HashMap<u64, u64> = HashMap::new();
        p.on_events(&ev(&[Event::inserted(1, 1, Tier::Dram, NO_PARENT).with_key(1).with_depth(0)]));
        for round in 0..60_000u64 {
            // A one-off chain below the root, or one of 400 hot ones.
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let key = if round % 2 == 0 { 1_000_000 + round } else { 2 + (x >> 33) % 400 };
            // Every request reads the root first, as a prefix lookup does.
            p.on_events(&ev(&[Event::accessed(1, Tier::Dram).with_key(1)]));
            match by_key.get(&key) {
                Some(&id) => p.on_events(&ev(&[Event::accessed(id, Tier::Dram).with_key(key)])),
                None => {
                    p.on_events(&ev(&[Event::missed(key, 1, 1)]));
                    if by_key.len() >= 600 {
                        let v = p.victims(Tier::Dram, 1, &[]);
                        by_key.retain(|_, id| !v.contains(id));
                        p.on_events(&v.iter().map(|&id| Event::removed(id, Tier::Dram)).collect());
                    }
                    p.on_events(&ev(&[Event::inserted(next_id, 1, Tier::Dram, 1).with_key(key).with_depth(1)]));
                    by_key.insert(key, next_id);
                    next_id += 1;
                }
            }
        }
        assert_ne!(p.mode(Tier::Dram), Mode::Lru);
        let sh = p.shadows[1].as_ref().unwrap();
        let simulated = sh.experts[0].resident(1);
        assert!((40..=160).contains(&simulated), "a shadow holds about 1/8 of 600 blocks: {simulated}");
    }

    #[test]
    fn params_are_checked() {
        assert!(ChainExperts::from_params(&params(&[("expert", "belady")])).is_err());
        assert!(ChainExperts::from_params(&params(&[("shadows", "maybe")])).is_err());
        let p = ChainExperts::from_params(&params(&[("expert", "arc"), ("shadows", "false")])).unwrap();
        assert_eq!(p.mode(Tier::Ssd), Mode::Arc);
    }
}
