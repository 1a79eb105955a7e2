//! What a replay drives: the client-facing operations of a kvpool store (`lookup`, `get`,
//! `put`) behind the [`Pool`] trait, and [`SimPool`], an in-process model of the server's store
//! that runs an admission and an eviction policy together exactly as the store does:
//!
//! - every put attempt gets a fresh dense block id; a block keeps its key hash
//!   ([`kvpool_policy_sdk::key_hash`] of the key bytes, tenant 0) across evictions and re-puts;
//! - a `lookup` reports every absent key of the chain as a `Missed` event (key hash, chain
//!   position, the resident block before it); a `get` reads (and leases) blocks, `Accessed`;
//! - a `put` asks admission once for all its new blocks (parents named by id, also within the
//!   batch), applies the chain rule for admission, makes room with one `victims` call whose
//!   `exclude` is the leased blocks, applies the chain rule for eviction (cascade, with
//!   [`kvpool_policy_host::cascade`]), then stores the admitted blocks parents first;
//! - both policies see every event, flushed before each decision;
//! - a snapshot for a swapped-in policy is warm: read counts, last access, recent misses.
//!
//! The store core without I/O (and a live server through the client) will implement [`Pool`]
//! too; the replay driver ([`crate::sim::CacheSim`]) only knows the trait.

use kvpool_policy_host::{cascade, BlockOracle};
use kvpool_policy_sdk::{
    key_hash, AdmissionPolicy, Admit, AdmitBatch, AdmitRequest, Event, Events, EvictionPolicy, Pin, Tier, NO_PARENT,
};
use std::collections::{HashMap, HashSet, VecDeque};

/// A block of a put, in chain order (parents first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PutItem {
    /// The block's key (a trace hash id; its key bytes are the decimal string).
    pub key: u64,
    /// The previous block of the chain, if any.
    pub parent: Option<u64>,
    /// Position in the chain (0 for a root).
    pub depth: u32,
    pub tokens: u32,
    /// Tokens of the prefix this block completes.
    pub seq_tokens: u64,
}

/// Counters of a pool, beyond hits (which the driver counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStats {
    /// Blocks stored.
    pub stored: u64,
    /// Put blocks the admission policy rejected.
    pub rejected: u64,
    /// Of those, rejected by the chain rule (a parent row rejected) rather than by the policy.
    pub chain_rejected: u64,
    /// Blocks removed because a victim named by the policy was their ancestor.
    pub cascaded: u64,
    /// Victims kept because removing them would strand a leased or hard-pinned descendant.
    pub refused: u64,
    /// Victim ids that were not resident, excluded, or repeated (ignored).
    pub invalid_victims: u64,
    /// Admission answers of the wrong length (all rows admitted instead).
    pub invalid_admissions: u64,
    /// Puts whose admitted blocks did not all fit after eviction (the tail was not stored).
    pub shortfalls: u64,
    /// Admitted blocks not stored for lack of room.
    pub dropped: u64,
    /// Misses reported to the policies.
    pub misses: u64,
}

/// The client-facing operations a replay needs, with kvpool's semantics.
pub trait Pool {
    /// Leading blocks of `chain` (keys, root first) that are resident. Every absent key of the
    /// chain is reported to the policies as a miss.
    fn lookup(&mut self, chain: &[u64], now_us: u64) -> usize;
    /// Read `keys` (resident ones count as reads and are leased until the next `release`).
    fn get(&mut self, keys: &[u64], now_us: u64);
    /// Store the blocks of a chain that are not resident (insert mode: resident keys are left
    /// alone). Admission and eviction decide what is kept.
    fn put(&mut self, items: &[PutItem], now_us: u64);
    /// End of a request: its leases lapse.
    fn release(&mut self);
    fn stats(&self) -> PoolStats;
}

/// Hash of a trace key as the server computes it: key bytes = decimal string, tenant 0.
pub fn trace_key_hash(key: u64) -> u64 {
    key_hash(0, key.to_string().as_bytes())
}

#[derive(Debug, Clone)]
struct Block {
    key: u64,
    hash: u64,
    parent: u64,
    depth: u32,
    tokens: u32,
    /// Requests that wanted the key: its misses before the put, then one per read.
    wanted: u32,
    last_us: u64,
    /// Order of the last insert or read (the snapshot's order).
    last_tick: u64,
    children: Vec<u64>,
}

/// Recent misses, bounded (the warm snapshot's "misses the host remembers").
#[derive(Debug, Default)]
struct MissLog {
    cap: usize,
    log: VecDeque<(u64, u32, u64, u64)>,
    counts: HashMap<u64, u32>,
}

impl MissLog {
    /// Record a miss of `hash`; returns how many misses of it the log now holds.
    fn push(&mut self, hash: u64, depth: u32, parent: u64, time: u64) -> u32 {
        if self.cap == 0 {
            return 1;
        }
        while self.log.len() >= self.cap {
            let Some((h, ..)) = self.log.pop_front() else { break };
            if let Some(c) = self.counts.get_mut(&h) {
                *c -= 1;
                if *c == 0 {
                    self.counts.remove(&h);
                }
            }
        }
        self.log.push_back((hash, depth, parent, time));
        let c = self.counts.entry(hash).or_insert(0);
        *c += 1;
        *c
    }
}

/// The store model: capacity in blocks (every block has size 1, as in libCacheSim).
pub struct SimPool {
    eviction: Box<dyn EvictionPolicy>,
    admission: Box<dyn AdmissionPolicy>,
    capacity: usize,
    by_key: HashMap<u64, u64>,
    blocks: HashMap<u64, Block>,
    next_id: u64,
    tick: u64,
    leased: Vec<u64>,
    events: Events,
    misses: MissLog,
    stats: PoolStats,
}

/// Events buffered before they are flushed to the policies (the server's batch size).
const FLUSH_AT: usize = 4096;

impl SimPool {
    pub fn new(admission: Box<dyn AdmissionPolicy>, eviction: Box<dyn EvictionPolicy>, capacity: usize) -> SimPool {
        SimPool {
            eviction,
            admission,
            capacity,
            by_key: HashMap::new(),
            blocks: HashMap::new(),
            next_id: 1,
            tick: 0,
            leased: Vec::new(),
            events: Events::new(),
            // As many recent misses as the pool holds blocks: enough history to start a
            // ghost list or a sketch, bounded by the pool's own size.
            misses: MissLog { cap: capacity.max(1024), ..MissLog::default() },
            stats: PoolStats::default(),
        }
    }

    fn emit(&mut self, e: Event) {
        self.events.push(e);
        if self.events.len() >= FLUSH_AT {
            self.flush();
        }
    }

    fn flush(&mut self) {
        if self.events.is_empty() {
            return;
        }
        self.admission.on_events(&self.events);
        self.eviction.on_events(&self.events);
        self.events.clear();
    }

    fn id_of(&self, key: u64) -> Option<u64> {
        self.by_key.get(&key).copied()
    }

    /// Remove a block (all its copies: there is only DRAM here) and tell the policies.
    fn remove(&mut self, id: u64, now_us: u64) {
        let Some(b) = self.blocks.remove(&id) else { return };
        debug_assert!(b.children.is_empty(), "chain rule: a block goes after its children");
        self.by_key.remove(&b.key);
        if let Some(p) = self.blocks.get_mut(&b.parent) {
            p.children.retain(|&c| c != id);
        }
        self.emit(
            Event::removed(id, Tier::Dram).with_key(b.hash).with_depth(b.depth).with_count(b.wanted).with_time(now_us),
        );
    }

    /// Free `need` blocks with one `victims` call and the chain rule; returns the room freed.
    fn make_room(&mut self, need: usize, now_us: u64) -> usize {
        self.flush();
        let mut exclude = self.leased.clone();
        exclude.sort_unstable();
        exclude.dedup();
        let victims = self.eviction.victims(Tier::Dram, need as u64, &exclude);
        let mut seen = HashSet::with_capacity(victims.len());
        let mut valid = Vec::with_capacity(victims.len());
        for v in victims {
            if !seen.insert(v) || exclude.binary_search(&v).is_ok() || !self.blocks.contains_key(&v) {
                self.stats.invalid_victims += 1;
                continue;
            }
            valid.push(v);
        }
        let plan = cascade(&valid, &*self, &exclude);
        self.stats.cascaded += plan.cascaded as u64;
        self.stats.refused += plan.refused.len() as u64;
        for &id in &plan.remove {
            self.remove(id, now_us);
        }
        plan.remove.len()
    }

    /// The warm snapshot a swapped-in policy is started from (see [`BlockOracle::snapshot`]):
    /// the recent misses first, oldest first (so that a policy seeding classes from key history
    /// has it before the blocks come), then every block, least recently used first and parents
    /// before children, with its reads and last access.
    pub fn warm_snapshot(&self) -> Events {
        let mut ev = Events::new();
        ev.reserve(self.blocks.len() + self.misses.log.len());
        for &(hash, depth, parent, time) in &self.misses.log {
            // The parent a miss named may have gone since: name only resident ones.
            let parent = if self.blocks.contains_key(&parent) { parent } else { NO_PARENT };
            let count = self.misses.counts.get(&hash).copied().unwrap_or(1);
            ev.push(Event::missed(hash, depth, parent).with_count(count).with_time(time));
        }
        let mut order: Vec<(u64, u64)> = self.blocks.iter().map(|(&id, b)| (b.last_tick, id)).collect();
        order.sort_unstable();
        let mut done: HashSet<u64> = HashSet::with_capacity(self.blocks.len());
        let mut stack = Vec::new();
        for (_, id) in order {
            let mut cur = id;
            // Parents before children: climb to the first ancestor already sent.
            while !done.contains(&cur) {
                let Some(b) = self.blocks.get(&cur) else { break };
                stack.push(cur);
                cur = b.parent;
            }
            while let Some(x) = stack.pop() {
                if done.insert(x) {
                    let b = &self.blocks[&x];
                    ev.push(
                        Event::inserted(x, 1, Tier::Dram, b.parent)
                            .with_key(b.hash)
                            .with_tokens(b.tokens)
                            .with_depth(b.depth)
                            .with_count(b.wanted)
                            .with_time(b.last_us),
                    );
                }
            }
        }
        ev
    }

    /// The eviction policy (to ask it directly in tests).
    #[cfg(test)]
    pub fn eviction_mut(&mut self) -> &mut dyn EvictionPolicy {
        self.flush();
        &mut *self.eviction
    }

    /// The block id of a resident key.
    #[cfg(test)]
    pub fn resident_id(&self, key: u64) -> Option<u64> {
        self.id_of(key)
    }

    /// Resident blocks.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }
}

impl BlockOracle for SimPool {
    fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64> {
        (tier == Tier::Dram && self.blocks.contains_key(&id)).then_some(1)
    }
    fn pin(&self, _id: u64) -> Pin {
        Pin::None
    }
    fn evictable_bytes(&self, _tier: Tier, exclude: &[u64]) -> u64 {
        self.blocks.keys().filter(|id| exclude.binary_search(id).is_err()).count() as u64
    }
    fn resident_children(&self, id: u64) -> Vec<u64> {
        self.blocks.get(&id).map(|b| b.children.clone()).unwrap_or_default()
    }
    fn snapshot(&self) -> Events {
        self.warm_snapshot()
    }
}

impl Pool for SimPool {
    fn lookup(&mut self, chain: &[u64], now_us: u64) -> usize {
        let hit = chain.iter().take_while(|k| self.by_key.contains_key(k)).count();
        for (i, &k) in chain.iter().enumerate().skip(hit) {
            if self.by_key.contains_key(&k) {
                continue;
            }
            let parent = if i == 0 { NO_PARENT } else { self.id_of(chain[i - 1]).unwrap_or(NO_PARENT) };
            let hash = trace_key_hash(k);
            let count = self.misses.push(hash, i as u32, parent, now_us);
            self.stats.misses += 1;
            self.emit(Event::missed(hash, i as u32, parent).with_count(count).with_time(now_us));
        }
        hit
    }

    fn get(&mut self, keys: &[u64], now_us: u64) {
        for &k in keys {
            let Some(id) = self.id_of(k) else { continue };
            self.tick += 1;
            let tick = self.tick;
            let b = self.blocks.get_mut(&id).expect("index and blocks agree");
            b.wanted = b.wanted.saturating_add(1);
            b.last_us = now_us;
            b.last_tick = tick;
            let e = Event::accessed(id, Tier::Dram).with_key(b.hash).with_depth(b.depth).with_count(b.wanted);
            self.leased.push(id);
            self.emit(e.with_time(now_us));
        }
    }

    fn put(&mut self, items: &[PutItem], now_us: u64) {
        // Admission: every new block of the put in one batch, parents named by id (a resident
        // block or an earlier row), as the store does.
        let mut batch = AdmitBatch::default();
        let mut rows: Vec<(PutItem, u64)> = Vec::new();
        let mut in_batch: HashMap<u64, u64> = HashMap::new();
        for it in items {
            if self.by_key.contains_key(&it.key) {
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            let parent =
                it.parent.and_then(|p| self.id_of(p).or_else(|| in_batch.get(&p).copied())).unwrap_or(NO_PARENT);
            in_batch.insert(it.key, id);
            batch.push(
                AdmitRequest::new(id, 1, it.tokens, it.seq_tokens, Tier::Dram, parent)
                    .with_key(trace_key_hash(it.key))
                    .with_depth(it.depth),
            );
            rows.push((*it, id));
        }
        if rows.is_empty() {
            return;
        }
        self.flush();
        let mut decisions = self.admission.admit(&batch);
        if decisions.len() != rows.len() {
            self.stats.invalid_admissions += 1;
            decisions = vec![Admit::Into(Tier::Dram); rows.len()];
        }
        let policy_rejected = decisions.iter().filter(|d| **d == Admit::Reject).count() as u64;
        let chain = batch.enforce_chain(&mut decisions) as u64;
        self.stats.rejected += policy_rejected + chain;
        self.stats.chain_rejected += chain;
        let admitted: Vec<usize> = (0..rows.len()).filter(|&i| decisions[i] != Admit::Reject).collect();
        if admitted.is_empty() {
            return;
        }
        let free = self.capacity.saturating_sub(self.blocks.len());
        let mut room = free;
        if admitted.len() > free {
            room += self.make_room(admitted.len() - free, now_us);
            if room < admitted.len() {
                self.stats.shortfalls += 1;
            }
        }
        for (n, &i) in admitted.iter().enumerate() {
            let (it, id) = rows[i];
            let parent = batch.parent[i];
            // A parent that is neither resident nor stored by this put (not enough room, or
            // gone since the lookup) leaves the rest of the chain unreachable: stop.
            if n >= room || (parent != NO_PARENT && !self.blocks.contains_key(&parent)) {
                self.stats.dropped += (admitted.len() - n) as u64;
                break;
            }
            self.tick += 1;
            let hash = batch.key[i];
            let wanted = self.misses.counts.get(&hash).copied().unwrap_or(0);
            self.blocks.insert(
                id,
                Block {
                    key: it.key,
                    hash,
                    parent,
                    depth: it.depth,
                    tokens: it.tokens,
                    wanted,
                    last_us: now_us,
                    last_tick: self.tick,
                    children: Vec::new(),
                },
            );
            if let Some(p) = self.blocks.get_mut(&parent) {
                p.children.push(id);
            }
            self.by_key.insert(it.key, id);
            self.stats.stored += 1;
            self.emit(
                Event::inserted(id, 1, Tier::Dram, parent)
                    .with_key(hash)
                    .with_tokens(it.tokens)
                    .with_depth(it.depth)
                    .with_count(wanted)
                    .with_time(now_us),
            );
        }
    }

    fn release(&mut self) {
        self.leased.clear();
    }

    fn stats(&self) -> PoolStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::{EventKind, Params, NO_ID};
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Records every event it is given; victims from the wrapped policy.
    struct Rec<P>(Rc<RefCell<Vec<Event>>>, P);

    impl<P: EvictionPolicy> EvictionPolicy for Rec<P> {
        fn on_events(&mut self, events: &Events) {
            self.0.borrow_mut().extend(events.iter());
            self.1.on_events(events);
        }
        fn victims(&mut self, tier: Tier, bytes: u64, exclude: &[u64]) -> Vec<u64> {
            self.1.victims(tier, bytes, exclude)
        }
    }

    fn pool<P: EvictionPolicy + 'static>(p: P, cap: usize) -> (SimPool, Rc<RefCell<Vec<Event>>>) {
        let log = Rc::new(RefCell::new(Vec::new()));
        let admit_all = Box::new(kvpool_policies::ThresholdAdmission::new(0));
        (SimPool::new(admit_all, Box::new(Rec(log.clone(), p)), cap), log)
    }

    fn chain(keys: &[u64]) -> Vec<PutItem> {
        keys.iter()
            .enumerate()
            .map(|(i, &key)| PutItem {
                key,
                parent: (i > 0).then(|| keys[i - 1]),
                depth: i as u32,
                tokens: 512,
                seq_tokens: 512 * (i as u64 + 1),
            })
            .collect()
    }

    /// One request as the replay makes it: lookup, get of the hit prefix, put of the rest.
    fn request(p: &mut SimPool, keys: &[u64], now: u64) -> usize {
        let n = p.lookup(keys, now);
        p.get(&keys[..n], now);
        p.put(&chain(keys)[n..], now);
        p.release();
        n
    }

    #[test]
    fn key_hash_identity_across_evict_and_reput() {
        let (mut p, log) = pool(kvpool_policies::LeafLru::new(), 1);
        request(&mut p, &[7], 1);
        request(&mut p, &[8], 2); // evicts 7
        request(&mut p, &[7], 3); // 7 again, under a fresh id
        p.flush();
        let log = log.borrow();
        let ins: Vec<&Event> = log.iter().filter(|e| e.kind == EventKind::Inserted).collect();
        assert_eq!(ins.len(), 3);
        assert_ne!(ins[0].id, ins[2].id, "every put gets a fresh id");
        assert_eq!(ins[0].key, ins[2].key, "the key hash stays");
        assert_eq!(ins[0].key, key_hash(0, b"7"));
        assert_ne!(ins[0].key, ins[1].key);
        let removed: Vec<&Event> = log.iter().filter(|e| e.kind == EventKind::Removed).collect();
        assert_eq!((removed[0].id, removed[0].key), (ins[0].id, ins[0].key));
    }

    #[test]
    fn lookups_report_misses_with_key_depth_and_parent() {
        let (mut p, rec) = pool(kvpool_policies::LeafLru::new(), 10);
        request(&mut p, &[1], 1);
        let id1 = p.resident_id(1).unwrap();
        rec.borrow_mut().clear();
        assert_eq!(p.lookup(&[1, 2, 3], 5), 1);
        p.flush();
        let log = rec.borrow();
        let m: Vec<(u64, u64, u32, u64, u32, u64)> = log
            .iter()
            .filter(|e| e.kind == EventKind::Missed)
            .map(|e| (e.id, e.key, e.depth, e.parent, e.count, e.time))
            .collect();
        assert_eq!(
            m,
            vec![
                (NO_ID, trace_key_hash(2), 1, id1, 1, 5),
                // The block before it is absent too: no resident parent to name.
                (NO_ID, trace_key_hash(3), 2, NO_PARENT, 1, 5),
            ]
        );
        drop(log);
        // Asked again: the host counts the misses of each key it remembers.
        p.lookup(&[1, 2], 6);
        p.flush();
        let last = rec.borrow().iter().rev().find(|e| e.kind == EventKind::Missed).copied().unwrap();
        assert_eq!((last.key, last.count), (trace_key_hash(2), 2));
        assert_eq!(p.stats().misses, 4);
    }

    #[test]
    fn evicting_a_parent_cascades_to_its_descendants() {
        // Plain LRU knows no chains: it names the root of the oldest chain.
        let (mut p, log) = pool(kvpool_policies::Lru::new(), 4);
        request(&mut p, &[1, 2, 3], 1);
        request(&mut p, &[10], 2);
        request(&mut p, &[20], 3); // needs one block: LRU names 1, which takes 2 and 3 along
        p.flush();
        assert_eq!(p.stats().cascaded, 2);
        assert_eq!(p.len(), 2);
        let log = log.borrow();
        let removed: Vec<u64> = log.iter().filter(|e| e.kind == EventKind::Removed).map(|e| e.key).collect();
        assert_eq!(removed, vec![trace_key_hash(3), trace_key_hash(2), trace_key_hash(1)], "deepest first");
        // No resident block is left without its parent.
        for b in p.blocks.values() {
            assert!(b.parent == NO_PARENT || p.blocks.contains_key(&b.parent));
        }
    }

    #[test]
    fn admission_rejects_the_rest_of_a_chain_after_a_rejected_block() {
        /// Rejects the block at depth 1 of every put.
        struct RejectDepth1;
        impl AdmissionPolicy for RejectDepth1 {
            fn on_events(&mut self, _: &Events) {}
            fn admit(&mut self, b: &AdmitBatch) -> Vec<Admit> {
                b.iter().map(|r| if r.depth == 1 { Admit::Reject } else { Admit::Into(r.tier) }).collect()
            }
        }
        let mut p = SimPool::new(Box::new(RejectDepth1), Box::new(kvpool_policies::LeafLru::new()), 10);
        request(&mut p, &[1, 2, 3, 4], 1);
        assert_eq!(p.len(), 1);
        assert_eq!((p.stats().rejected, p.stats().chain_rejected), (3, 2));
    }

    #[test]
    fn warm_snapshot_carries_reads_last_access_and_misses() {
        let (mut p, _) = pool(kvpool_policies::LeafLru::new(), 10);
        request(&mut p, &[1, 2], 100);
        request(&mut p, &[1, 2], 200);
        request(&mut p, &[1, 3], 300);
        let snap = p.warm_snapshot();
        let rows: Vec<(EventKind, u64, u32, u64)> = snap.iter().map(|e| (e.kind, e.key, e.count, e.time)).collect();
        let k = trace_key_hash;
        assert_eq!(
            rows,
            vec![
                (EventKind::Missed, k(1), 1, 100),
                (EventKind::Missed, k(2), 1, 100),
                (EventKind::Missed, k(3), 1, 300),
                // Wanted: the put's own miss, then the reads.
                (EventKind::Inserted, k(1), 3, 300),
                (EventKind::Inserted, k(2), 2, 200),
                (EventKind::Inserted, k(3), 1, 300),
            ]
        );
        // Parents before children: 2's parent (1) came first though 1 was used last.
        let ins: Vec<Event> = snap.iter().filter(|e| e.kind == EventKind::Inserted).collect();
        assert_eq!(ins[1].parent, ins[0].id);
    }

    /// A policy swapped in with the warm snapshot decides like one that saw all the history:
    /// exactly, for orderings by recency; for classes from key history (a decayed sketch the
    /// snapshot can only rebuild from the host's counts and recent misses) far more often than
    /// after a cold snapshot (blocks only).
    #[test]
    fn warm_swap_decides_like_the_history() {
        let trace = crate::gen::generate("mix", 2_000, 5).unwrap();
        let make = |kv: &[(&str, &str)]| {
            let params = Params::from_pairs(kv.iter().copied());
            let name = if kv.is_empty() { "leaf-lru" } else { "chain-experts" };
            crate::sim::native_eviction(name, &params).unwrap()
        };
        for kv in [&[][..], &[("shadows", "false"), ("expert", "lru")], &[("shadows", "false"), ("expert", "filter")]] {
            let mut p = SimPool::new(Box::new(kvpool_policies::ThresholdAdmission::new(0)), make(kv), 5_000);
            for r in &trace {
                request(&mut p, &r.hash_ids, r.timestamp * 1000);
            }
            let history = p.eviction_mut().victims(Tier::Dram, 1_000, &[]);
            let warm_snap = p.warm_snapshot();
            let cold_snap: Events =
                warm_snap.iter().filter(|e| e.kind == EventKind::Inserted).map(|e| e.with_count(0)).collect();
            let victims = |snap: &Events| {
                let mut e = make(kv);
                e.on_events(snap);
                e.victims(Tier::Dram, 1_000, &[])
            };
            let (warm, cold) = (victims(&warm_snap), victims(&cold_snap));
            assert_eq!(history.len(), 1_000);
            let same = |v: &[u64]| v.iter().filter(|id| history.contains(id)).count();
            if kv.len() < 2 || kv[1].1 == "lru" {
                assert_eq!(warm, history, "{kv:?}: recency is rebuilt exactly");
            } else {
                let (w, c) = (same(&warm), same(&cold));
                assert!(w >= 300 && w >= 3 * c, "{kv:?}: {w} (warm) and {c} (cold) of 1000 victims as in the history");
            }
        }
    }
}
