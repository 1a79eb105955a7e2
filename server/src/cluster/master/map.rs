//! The master's block map: which storage nodes hold a copy of each block, in 16 bytes a block.
//!
//! The nodes are the truth and the master only routes, so a block is known by a digest of
//! (tenant, key) instead of its key: 12 bits of it choose the shard, 64 more are kept in the
//! shard. Two blocks of a tenant whose 76 bits collide (about one chance in 10^9 among 10M
//! blocks) share an entry: a route then names a node that may not hold the block, and removing
//! one drops the other's route. Either is a miss on the node, never wrong data, since the node
//! checks the full key.
//! A block's first two copies are inline as (node, tier bits); further replicas and node ids
//! past 16 bits go to a side map. Routes need no size, so the map keeps none. The map is split into shards, each with its
//! own lock, so that forgetting a node walks one small shard at a time: a route waits for one
//! shard's walk at most, never for the whole forget.
//!
//! Keys (and sizes) are kept only for the KV events the master publishes when it forgets a
//! node's copies, and only as many as its event ring holds (a forget of more copies than that
//! overruns the ring anyway): the copies whose keys were not kept are reported as a gap in the
//! log.

use kvpool_core::{Change, ChangeKind};
use kvpool_policy_sdk::Tier;
use kvpool_proto::KvEventKind;
use parking_lot::Mutex;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Shards of the map: at 10M blocks a shard holds ~2,400, walked in tens of microseconds.
const SHARDS: usize = 4096;

/// The in-shard part of a block's digest. Two u32 words (not a u64), so that an entry packs
/// into 16 bytes with 4-byte alignment.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Digest([u32; 2]);

impl Digest {
    /// The shard of (tenant, key) and its digest there: from independent bits of one xxh3-128.
    pub fn of(tenant: u32, key: &[u8]) -> (usize, Digest) {
        let h = xxhash_rust::xxh3::xxh3_128_with_seed(key, u64::from(tenant));
        ((h >> 96) as usize % SHARDS, Digest([h as u32, (h >> 32) as u32]))
    }
}

impl Hash for Digest {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(u64::from(self.0[0]) | (u64::from(self.0[1]) << 32));
    }
}

/// The digest is already uniform: its bits are the hash.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Map<V> = hashbrown::HashMap<Digest, V, BuildHasherDefault<PassThrough>>;

/// An inline copy: node id (little-endian u16, 0 = empty) and a bit per tier.
#[derive(Clone, Copy, Default)]
struct Slot([u8; 3]);

impl Slot {
    fn get(self) -> Option<(u32, u8)> {
        let node = u16::from_le_bytes([self.0[0], self.0[1]]);
        (node != 0).then_some((u32::from(node), self.0[2]))
    }

    fn of(node: u32, bits: u8) -> Option<Slot> {
        let n = u16::try_from(node).ok().filter(|&n| n != 0)?;
        let [a, b] = n.to_le_bytes();
        Some(Slot([a, b, bits]))
    }
}

#[derive(Clone, Copy, Default)]
struct Entry {
    on: [Slot; 2],
    /// The side map has more copies of this block.
    more: bool,
}

/// A block's copies as its operations see them.
type Copies = smallvec::SmallVec<[(u32, u8); 2]>;

/// A block's key, for the events of a forget.
struct Kept {
    tenant: u32,
    size: u64,
    key: Box<[u8]>,
}

#[derive(Default)]
struct Shard {
    blocks: Map<Entry>,
    /// Copies past the two inline ones, and those of nodes with ids past 16 bits.
    spill: Map<Vec<(u32, u8)>>,
    /// Blocks' keys, for the events of a forget (up to `BlockMap::keep` over all shards).
    keys: Map<Kept>,
}

impl Shard {
    fn load(&self, d: &Digest) -> Option<Copies> {
        let e = self.blocks.get(d)?;
        let mut on: Copies = e.on.iter().filter_map(|s| s.get()).collect();
        if e.more {
            on.extend_from_slice(self.spill.get(d).map_or(&[][..], |s| &s[..]));
        }
        Some(on)
    }

    fn store(&mut self, d: Digest, on: Copies) {
        if on.is_empty() {
            self.blocks.remove(&d);
            self.spill.remove(&d);
            self.keys.remove(&d);
            return;
        }
        let mut e = Entry::default();
        let mut rest = Vec::new();
        let mut free = 0;
        for &(n, bits) in &on {
            match Slot::of(n, bits).filter(|_| free < e.on.len()) {
                Some(s) => {
                    e.on[free] = s;
                    free += 1;
                }
                None => rest.push((n, bits)),
            }
        }
        e.more = !rest.is_empty();
        if e.more {
            self.spill.insert(d, rest);
        } else {
            self.spill.remove(&d);
        }
        self.blocks.insert(d, e);
    }
}

/// What a forget took away.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Forgotten {
    /// Blocks that had a copy on the node.
    pub copies: u64,
    /// Removed events that could not be logged: their keys were not kept.
    pub unknown: u64,
}

pub(super) struct BlockMap {
    shards: Box<[Mutex<Shard>]>,
    /// Keys kept for the events of a forget, over all shards, and the most to keep.
    kept: AtomicUsize,
    keep: usize,
}

impl BlockMap {
    /// `keep_keys`: how many blocks' keys to keep for the events of a forget (the event ring's
    /// capacity; 0 without events).
    pub fn new(keep_keys: usize) -> BlockMap {
        BlockMap {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            kept: AtomicUsize::new(0),
            keep: keep_keys,
        }
    }

    /// Count the keys a shard gained or lost since it had `before`.
    fn count_kept(&self, before: usize, sh: &Shard) {
        let now = sh.keys.len();
        if now > before {
            self.kept.fetch_add(now - before, Ordering::Relaxed);
        } else if now < before {
            self.kept.fetch_sub(before - now, Ordering::Relaxed);
        }
    }

    /// Apply one reported copy of `node`: whether it changed the view, and the change in the
    /// number of blocks with a copy on the node (-1, 0, 1).
    pub fn apply(&self, node: u32, tenant: u32, key: &[u8], kind: KvEventKind, tier: Tier, size: u64) -> (bool, i64) {
        let bit = 1u8 << (tier as u8);
        let (s, d) = Digest::of(tenant, key);
        let mut sh = self.shards[s].lock();
        let before = sh.keys.len();
        let done = match kind {
            KvEventKind::Stored => {
                let mut on = sh.load(&d).unwrap_or_default();
                if on.is_empty() && self.kept.load(Ordering::Relaxed) < self.keep {
                    sh.keys.insert(d, Kept { tenant, size, key: key.into() });
                } else if let Some(k) = sh.keys.get_mut(&d) {
                    k.size = size;
                }
                let (changed, delta) = match on.iter_mut().find(|(n, _)| *n == node) {
                    Some((_, bits)) => (std::mem::replace(bits, *bits | bit) & bit == 0, 0),
                    None => {
                        on.push((node, bit));
                        (true, 1)
                    }
                };
                if changed {
                    sh.store(d, on);
                }
                (changed, delta)
            }
            KvEventKind::Removed | KvEventKind::Evicted => {
                let Some(mut on) = sh.load(&d) else { return (false, 0) };
                let Some(i) = on.iter().position(|&(n, _)| n == node) else { return (false, 0) };
                let had = on[i].1 & bit != 0;
                on[i].1 &= !bit;
                let delta = if on[i].1 == 0 {
                    on.swap_remove(i);
                    -1
                } else {
                    0
                };
                if had || delta != 0 {
                    sh.store(d, on);
                }
                (had, delta)
            }
        };
        self.count_kept(before, &sh);
        done
    }

    /// Nodes holding `key` of `tenant` that pass `live`, DRAM copies first, then by id.
    pub fn holders(&self, tenant: u32, key: &[u8], live: impl Fn(u32) -> bool) -> Vec<u32> {
        let (s, d) = Digest::of(tenant, key);
        let mut out: smallvec::SmallVec<[(bool, u32); 4]> = {
            let sh = self.shards[s].lock();
            let Some(on) = sh.load(&d) else { return Vec::new() };
            on.iter().map(|&(n, bits)| (bits & (1 << Tier::Dram as u8) == 0, n)).collect()
        };
        out.retain(|(_, n)| live(*n));
        out.sort_unstable();
        out.into_iter().map(|(_, n)| n).collect()
    }

    /// [`BlockMap::holders`] of many keys at once. The shards are locked together (in order,
    /// so that no two callers deadlock) and then probed back to back: with no lock operation
    /// between two probes, their cache misses overlap instead of queueing one after another.
    pub fn holders_many(&self, tenant: u32, keys: &[Vec<u8>], live: impl Fn(u32) -> bool) -> Vec<Vec<u32>> {
        let digests: smallvec::SmallVec<[(usize, Digest); 64]> = keys.iter().map(|k| Digest::of(tenant, k)).collect();
        let mut order: smallvec::SmallVec<[usize; 64]> = digests.iter().map(|&(s, _)| s).collect();
        order.sort_unstable();
        order.dedup();
        let guards: smallvec::SmallVec<[parking_lot::MutexGuard<'_, Shard>; 64]> =
            order.iter().map(|&i| self.shards[i].lock()).collect();
        let shard = |s: usize| &*guards[order.binary_search(&s).expect("locked")];
        let found: smallvec::SmallVec<[Option<Entry>; 64]> =
            digests.iter().map(|(s, d)| shard(*s).blocks.get(d).copied()).collect();
        let mut out = Vec::with_capacity(keys.len());
        for ((s, d), e) in digests.iter().zip(found) {
            let Some(e) = e else {
                out.push(Vec::new());
                continue;
            };
            let mut on: smallvec::SmallVec<[(bool, u32); 4]> =
                e.on.iter().filter_map(|s| s.get()).map(|(n, bits)| (bits & (1 << Tier::Dram as u8) == 0, n)).collect();
            if e.more {
                let spilled = shard(*s).spill.get(d).map_or(&[][..], |s| &s[..]);
                on.extend(spilled.iter().map(|&(n, bits)| (bits & (1 << Tier::Dram as u8) == 0, n)));
            }
            on.retain(|(_, n)| live(*n));
            on.sort_unstable();
            out.push(on.into_iter().map(|(_, n)| n).collect());
        }
        drop(guards);
        out
    }

    /// Forget every copy on `node`, one shard at a time (its lock held for that shard's walk
    /// only). `publish` gets each shard's `Removed` changes, one per tier of a copy whose key
    /// was kept, outside the shard's lock.
    pub fn forget(&self, node: u32, mut publish: impl FnMut(Vec<Change>)) -> Forgotten {
        let mut done = Forgotten::default();
        for shard in self.shards.iter() {
            let mut gone = Vec::new();
            {
                let mut sh = shard.lock();
                let sh = &mut *sh;
                let before = sh.keys.len();
                let mut emptied = Vec::new();
                // Entries hold the node inline unless its id is past 16 bits.
                let inline = Slot::of(node, 0).is_some();
                for (d, e) in sh.blocks.iter_mut() {
                    let mut bits = 0u8;
                    if inline {
                        for s in e.on.iter_mut() {
                            if let Some((n, b)) = s.get().filter(|&(n, _)| n == node) {
                                debug_assert_eq!(n, node);
                                bits = b;
                                *s = Slot::default();
                            }
                        }
                    }
                    if bits == 0 && e.more {
                        if let Some(s) = sh.spill.get_mut(d) {
                            if let Some(i) = s.iter().position(|&(n, _)| n == node) {
                                bits = s.swap_remove(i).1;
                            }
                        }
                    }
                    if bits == 0 {
                        continue;
                    }
                    done.copies += 1;
                    match sh.keys.get(d) {
                        Some(k) => {
                            for tier in Tier::ALL.into_iter().filter(|&t| bits & (1 << t as u8) != 0) {
                                gone.push(removed(tier, k.tenant, &k.key, k.size, node));
                            }
                        }
                        None => done.unknown += u64::from(bits.count_ones()),
                    }
                    // Keep the inline slots packed, pulling a spilled copy in if there is one.
                    if e.on[0].get().is_none() {
                        e.on.swap(0, 1);
                    }
                    let s = sh.spill.get_mut(d).filter(|_| e.more);
                    if let Some(s) = s {
                        if e.on[1].get().is_none() {
                            if let Some(i) = s.iter().position(|&(n, b)| Slot::of(n, b).is_some()) {
                                let (n, b) = s.swap_remove(i);
                                e.on[if e.on[0].get().is_none() { 0 } else { 1 }] = Slot::of(n, b).expect("checked");
                            }
                        }
                    }
                    let spilled = e.more && sh.spill.get(d).is_some_and(|s| !s.is_empty());
                    if e.more && !spilled {
                        sh.spill.remove(d);
                        e.more = false;
                    }
                    if e.on[0].get().is_none() && !spilled {
                        emptied.push(*d);
                    }
                }
                for d in emptied {
                    sh.blocks.remove(&d);
                    sh.spill.remove(&d);
                    sh.keys.remove(&d);
                }
                self.count_kept(before, sh);
                // Give the freed buckets back (cheap when the table would not get smaller).
                sh.blocks.shrink_to(0);
                sh.spill.shrink_to(0);
            }
            if !gone.is_empty() {
                publish(gone);
            }
        }
        done
    }

    /// Blocks known (every shard locked in turn).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().blocks.len()).sum()
    }

    /// Forget everything.
    pub fn clear(&self) {
        for s in self.shards.iter() {
            let mut sh = s.lock();
            let before = sh.keys.len();
            *sh = Shard::default();
            self.count_kept(before, &sh);
        }
    }
}

fn removed(tier: Tier, tenant: u32, key: &[u8], size: u64, node: u32) -> Change {
    Change { kind: ChangeKind::Removed, tier, tenant, key: key.into(), parent: None, size, time_ms: 0, node }
}

/// A block's copies, sorted (tests look inside).
#[cfg(test)]
fn copies_of(m: &BlockMap, tenant: u32, key: &[u8]) -> Vec<(u32, u8)> {
    let (s, d) = Digest::of(tenant, key);
    let sh = m.shards[s].lock();
    let mut on = sh.load(&d).map(|on| on.to_vec()).unwrap_or_default();
    on.sort_unstable();
    on
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRAM: Tier = Tier::Dram;
    const SSD: Tier = Tier::Ssd;

    fn stored(m: &BlockMap, node: u32, key: &str, tier: Tier) -> (bool, i64) {
        m.apply(node, 1, key.as_bytes(), KvEventKind::Stored, tier, 10)
    }

    fn dropped(m: &BlockMap, node: u32, key: &str, tier: Tier) -> (bool, i64) {
        m.apply(node, 1, key.as_bytes(), KvEventKind::Evicted, tier, 10)
    }

    fn all(_: u32) -> bool {
        true
    }

    #[test]
    fn an_entry_is_16_bytes() {
        assert_eq!(std::mem::size_of::<(Digest, Entry)>(), 16);
    }

    #[test]
    fn same_key_from_two_nodes_and_drops_tier_by_tier() {
        let m = BlockMap::new(0);
        assert_eq!(stored(&m, 2, "k", SSD), (true, 1));
        assert_eq!(stored(&m, 1, "k", SSD), (true, 1));
        assert_eq!(stored(&m, 1, "k", SSD), (false, 0), "a repeated report changes nothing");
        assert_eq!(stored(&m, 2, "k", DRAM), (true, 0), "another tier of the same copy");
        assert_eq!(m.holders(1, b"k", all), vec![2, 1], "DRAM copies first");
        assert!(m.holders(2, b"k", all).is_empty(), "another tenant's key is another block");
        assert_eq!(dropped(&m, 2, "k", DRAM), (true, 0));
        assert_eq!(m.holders(1, b"k", all), vec![1, 2]);
        assert_eq!(dropped(&m, 2, "k", DRAM), (false, 0), "a tier it no longer has");
        assert_eq!(dropped(&m, 3, "k", SSD), (false, 0), "a node without a copy");
        assert_eq!(dropped(&m, 2, "k", SSD), (true, -1));
        assert_eq!(m.holders(1, b"k", |n| n != 1), Vec::<u32>::new(), "dead nodes are filtered");
        assert_eq!(dropped(&m, 1, "k", SSD), (true, -1));
        assert_eq!(m.len(), 0, "the last copy takes the block");
        assert_eq!(dropped(&m, 1, "k", SSD), (false, 0));
    }

    #[test]
    fn replicas_past_two_and_big_node_ids_spill_and_come_back() {
        let m = BlockMap::new(100);
        let big = 1u32 << 20;
        for n in [1, 2, 3, big] {
            m.apply(n, 1, b"k", KvEventKind::Stored, DRAM, 5 << 30);
        }
        assert_eq!(m.holders(1, b"k", all), vec![1, 2, 3, big]);
        let mut got = Vec::new();
        assert_eq!(m.forget(1, |c| got.extend(c)), Forgotten { copies: 1, unknown: 0 });
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].size, got[0].node, &*got[0].key), (5 << 30, 1, &b"k"[..]));
        // A spilled copy moved inline.
        assert_eq!(copies_of(&m, 1, b"k"), vec![(2, 2), (3, 2), (big, 2)]);
        assert_eq!(m.forget(big, |_| {}).copies, 1);
        assert_eq!(m.forget(3, |_| {}).copies, 1);
        assert_eq!(m.holders(1, b"k", all), vec![2]);
        assert_eq!(m.forget(2, |_| {}).copies, 1);
        assert_eq!(m.len(), 0);
        let sh = &m.shards[Digest::of(1, b"k").0];
        assert!(sh.lock().spill.is_empty() && sh.lock().keys.is_empty());
    }

    #[test]
    fn forget_logs_the_kept_keys_and_counts_the_others() {
        // Keys kept for the first 100 blocks only.
        let m = BlockMap::new(100);
        let keys: Vec<String> = (0..SHARDS * 2).map(|i| format!("k{i}")).collect();
        for k in &keys {
            stored(&m, 1, k, DRAM);
            stored(&m, 1, k, SSD);
            stored(&m, 2, k, SSD);
        }
        let mut logged = Vec::new();
        let f = m.forget(1, |c| logged.extend(c));
        assert_eq!(f.copies, keys.len() as u64);
        assert_eq!(logged.len() as u64 + f.unknown, 2 * keys.len() as u64, "one change per tier");
        assert!(logged.iter().all(|c| c.kind == ChangeKind::Removed && c.node == 1 && c.tenant == 1));
        assert_eq!(logged.len(), 200, "the first 100 blocks' keys, two tiers each");
        assert_eq!(m.kept.load(Ordering::Relaxed), 100, "node 2 still holds the blocks");
        for k in &keys {
            assert_eq!(m.holders(1, k.as_bytes(), all), vec![2]);
        }
        assert_eq!(m.forget(1, |_| panic!("nothing left")), Forgotten::default());
        // A node that comes back re-announces its copies.
        stored(&m, 1, "k0", DRAM);
        assert_eq!(m.holders(1, b"k0", all), vec![1, 2]);
        m.forget(1, |_| {});
        m.forget(2, |_| {});
        assert_eq!(m.kept.load(Ordering::Relaxed), 0, "the kept keys went with their blocks");
    }
}
