//! A map from block id to a policy's per-block node, sized for millions of blocks.
//!
//! A host names a block by its table slot and the slot's generation (the slot in the id's low
//! 32 bits; kvpool's index does): the slots of resident blocks are dense, so a node is kept in
//! an array at its slot, found with one comparison and no hashing, and costs its own size and
//! no table. Ids that do not fit that shape (a slot far beyond the blocks held, or one another
//! id holds) go to a hashed map ([`Hashed`]): any id works, the common ones cost least.
//!
//! The hashed map: a `HashMap<u64, Node>` keeps every entry in its bucket array, which
//! hashbrown sizes to a power of two at most 7/8 full: right after a resize half the buckets
//! are empty, so each block paid for about two nodes. There the nodes live densely in a slab
//! (freed slots are reused) and the hash table holds 4-byte slab slots, so an empty bucket
//! costs 5 bytes, not a node.

use crate::hash::IdHasher;
use hashbrown::HashTable;
use slab::Slab;
use std::hash::Hasher;

/// Block id -> `V`, with the same methods as the `HashMap` it replaces.
#[derive(Debug)]
pub(crate) struct NodeMap<V> {
    /// By slot (the id's low 32 bits): the id and its node.
    direct: Vec<Option<(u64, V)>>,
    /// Occupied entries of `direct`.
    in_direct: usize,
    /// Blocks announced by [`NodeMap::reserve`]: the array may grow to cover them.
    expected: usize,
    /// Everything else.
    spill: Hashed<V>,
}

impl<V> Default for NodeMap<V> {
    fn default() -> NodeMap<V> {
        NodeMap { direct: Vec::new(), in_direct: 0, expected: 0, spill: Hashed::default() }
    }
}

/// The array grows to take a slot only while it stays about as dense as the blocks it holds
/// (a quarter more slots than blocks, past a small start): a sparse array would cost more than
/// the hashed map it replaces (a node plus about 10 bytes of table per block).
const SLACK_START: usize = 4_096;

fn slot(id: u64) -> usize {
    id as u32 as usize
}

impl<V> NodeMap<V> {
    fn direct_room(&self) -> usize {
        let n = self.in_direct.max(self.expected);
        SLACK_START + n + n / 4
    }

    pub fn get(&self, id: &u64) -> Option<&V> {
        match self.direct.get(slot(*id)) {
            Some(Some((i, v))) if i == id => Some(v),
            _ if self.spill.is_empty() => None,
            _ => self.spill.get(id),
        }
    }

    pub fn get_mut(&mut self, id: &u64) -> Option<&mut V> {
        match self.direct.get_mut(slot(*id)) {
            Some(Some((i, v))) if i == id => Some(v),
            _ if self.spill.is_empty() => None,
            _ => self.spill.get_mut(id),
        }
    }

    pub fn contains_key(&self, id: &u64) -> bool {
        self.get(id).is_some()
    }

    /// Insert or replace the node of `id`.
    pub fn insert(&mut self, id: u64, v: V) {
        let s = slot(id);
        if let Some(Some((i, old))) = self.direct.get_mut(s) {
            if *i == id {
                *old = v;
                return;
            }
        }
        // An id already spilled stays there (an id is in one place only).
        let spilled = !self.spill.is_empty() && self.spill.contains_key(&id);
        if !spilled {
            if s >= self.direct.len() && s < self.direct_room() {
                self.direct.resize_with(s + 1, || None);
            }
            if let Some(e @ None) = self.direct.get_mut(s) {
                *e = Some((id, v));
                self.in_direct += 1;
                return;
            }
        }
        self.spill.insert(id, v);
    }

    pub fn remove(&mut self, id: &u64) -> Option<V> {
        if let Some(e) = self.direct.get_mut(slot(*id)) {
            if e.as_ref().is_some_and(|(i, _)| i == id) {
                self.in_direct -= 1;
                return e.take().map(|(_, v)| v);
            }
        }
        if self.spill.is_empty() {
            return None;
        }
        self.spill.remove(id)
    }

    /// `n` more blocks are coming (a bulk load, whose ids arrive in no particular slot
    /// order): the array may cover as many slots.
    pub fn reserve(&mut self, n: usize) {
        self.expected = self.expected.max(self.len() + n);
    }

    pub fn len(&self) -> usize {
        self.in_direct + self.spill.len()
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.direct.iter_mut().flatten().map(|(_, v)| v).chain(self.spill.values_mut())
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &V)> {
        self.direct.iter().flatten().map(|(i, v)| (i, v)).chain(self.spill.iter())
    }
}

impl<V> std::ops::Index<&u64> for NodeMap<V> {
    type Output = V;
    fn index(&self, id: &u64) -> &V {
        self.get(id).expect("a known block id")
    }
}

/// Block id -> `V` by hashing: any id.
#[derive(Debug)]
pub(crate) struct Hashed<V> {
    slab: Slab<(u64, V)>,
    table: HashTable<u32>,
}

impl<V> Default for Hashed<V> {
    fn default() -> Hashed<V> {
        Hashed { slab: Slab::new(), table: HashTable::new() }
    }
}

fn hash(id: u64) -> u64 {
    let mut h = IdHasher::default();
    h.write_u64(id);
    h.finish()
}

impl<V> Hashed<V> {
    pub fn len(&self) -> usize {
        self.slab.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    fn slot(&self, id: u64) -> Option<usize> {
        let slab = &self.slab;
        self.table.find(hash(id), |&s| slab[s as usize].0 == id).map(|&s| s as usize)
    }

    pub fn get(&self, id: &u64) -> Option<&V> {
        self.slot(*id).map(|s| &self.slab[s].1)
    }

    pub fn get_mut(&mut self, id: &u64) -> Option<&mut V> {
        self.slot(*id).map(|s| &mut self.slab[s].1)
    }

    pub fn contains_key(&self, id: &u64) -> bool {
        self.slot(*id).is_some()
    }

    /// Insert or replace the node of `id`.
    pub fn insert(&mut self, id: u64, v: V) {
        if let Some(s) = self.slot(id) {
            self.slab[s].1 = v;
            return;
        }
        // A policy holding 2^32 nodes would need hundreds of GiB first.
        let s = u32::try_from(self.slab.insert((id, v))).expect("fewer than 2^32 nodes");
        let slab = &self.slab;
        self.table.insert_unique(hash(id), s, |&x| hash(slab[x as usize].0));
    }

    pub fn remove(&mut self, id: &u64) -> Option<V> {
        let slab = &self.slab;
        let entry = self.table.find_entry(hash(*id), |&s| slab[s as usize].0 == *id).ok()?;
        let (s, _) = entry.remove();
        Some(self.slab.remove(s as usize).1)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.slab.iter_mut().map(|(_, (_, v))| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &V)> {
        self.slab.iter().map(|(_, (id, v))| (id, v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, replacements and removes against std's map, with ids drawn by `id`: the
    /// same answers throughout. The map afterwards.
    fn against_a_hash_map(mut id: impl FnMut(u64) -> u64) -> NodeMap<u64> {
        let mut m: NodeMap<u64> = NodeMap::default();
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for step in 0..50_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = id(x);
            match x % 5 {
                0 | 1 => {
                    m.insert(id, step);
                    model.insert(id, step);
                }
                2 => assert_eq!(m.remove(&id), model.remove(&id)),
                3 => {
                    if let Some(v) = m.get_mut(&id) {
                        *v += 1;
                    }
                    if let Some(v) = model.get_mut(&id) {
                        *v += 1;
                    }
                }
                _ => assert_eq!(m.get(&id), model.get(&id)),
            }
            assert_eq!(m.contains_key(&id), model.contains_key(&id));
            if step % 10_000 == 0 {
                m.reserve(500);
            }
        }
        assert_eq!(m.len(), model.len());
        let mut got: Vec<(u64, u64)> = m.iter().map(|(&k, &v)| (k, v)).collect();
        got.sort_unstable();
        let mut want: Vec<(u64, u64)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(got, want);
        assert_eq!(m.values().count(), m.len());
        m
    }

    /// Ids shaped as a host's (slots below the blocks held, a generation above, one live id
    /// per slot): all in the array, none hashed.
    #[test]
    fn slot_shaped_ids_go_to_the_array() {
        let m = against_a_hash_map(|x| ((x % 3_000 % 7 + 1) << 32) | (x % 3_000));
        assert_eq!(m.spill.len(), 0);
        assert!(m.direct.len() <= 3_000);
    }

    /// Any other ids work too: random 64-bit ones (sparse slots), and ids that share a slot.
    #[test]
    fn other_ids_are_hashed() {
        let m = against_a_hash_map(|x| x % 3_000 * 0x1_0000_0007);
        assert!(!m.spill.is_empty() && m.in_direct > 0);
        let m = against_a_hash_map(|x| (x % 3_000) << 32);
        assert!(m.in_direct <= 1, "one id per slot");
        let m = against_a_hash_map(|x| (x % 3_000).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        assert!(m.direct.len() <= SLACK_START + m.len() + m.len() / 4, "the array stays dense");
    }

    /// A bulk load in no slot order (a snapshot, least recently used first) still lands in the
    /// array once announced.
    #[test]
    fn an_announced_bulk_load_lands_in_the_array() {
        let n = 100_000u64;
        let mut m: NodeMap<u64> = NodeMap::default();
        m.reserve(n as usize);
        for k in 0..n {
            let s = (k * 7_919) % n; // every slot once, scattered
            m.insert((3 << 32) | s, k);
        }
        assert_eq!((m.len(), m.spill.len()), (n as usize, 0));
        assert_eq!(m.get(&((3 << 32) | 7_919)), Some(&1));
        assert_eq!(m.get(&((4 << 32) | 7_919)), None, "another generation of the slot");
    }
}
