//! A map from block id to a policy's per-block node, sized for millions of blocks.
//!
//! A `HashMap<u64, Node>` keeps every entry in its bucket array, which hashbrown sizes to a power
//! of two at most 7/8 full: right after a resize half the buckets are empty, so each resident
//! block paid for about two nodes. Here the nodes live densely in a slab (freed slots are reused)
//! and the hash table holds 4-byte slab slots, so an empty bucket costs 5 bytes, not a node.

use crate::hash::IdHasher;
use hashbrown::HashTable;
use slab::Slab;
use std::hash::Hasher;

/// Block id -> `V`, with the same methods as the `HashMap` it replaces.
#[derive(Debug)]
pub(crate) struct NodeMap<V> {
    slab: Slab<(u64, V)>,
    table: HashTable<u32>,
}

impl<V> Default for NodeMap<V> {
    fn default() -> NodeMap<V> {
        NodeMap { slab: Slab::new(), table: HashTable::new() }
    }
}

fn hash(id: u64) -> u64 {
    let mut h = IdHasher::default();
    h.write_u64(id);
    h.finish()
}

impl<V> NodeMap<V> {
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

    pub fn reserve(&mut self, n: usize) {
        self.slab.reserve(n);
        let slab = &self.slab;
        self.table.reserve(n, |&x| hash(slab[x as usize].0));
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.slab.iter().map(|(_, (_, v))| v)
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.slab.iter_mut().map(|(_, (_, v))| v)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&u64, &V)> {
        self.slab.iter().map(|(_, (id, v))| (id, v))
    }
}

impl<V> std::ops::Index<&u64> for NodeMap<V> {
    type Output = V;
    fn index(&self, id: &u64) -> &V {
        self.get(id).expect("a known block id")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, replacements and removes against std's map: the same answers throughout,
    /// and freed slots are reused.
    #[test]
    fn agrees_with_a_hash_map() {
        let mut m: NodeMap<u64> = NodeMap::default();
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for step in 0..50_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let id = x % 3_000;
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
        assert_eq!(m.slab.len(), model.len());
        let mut got: Vec<(u64, u64)> = m.iter().map(|(&k, &v)| (k, v)).collect();
        got.sort_unstable();
        let mut want: Vec<(u64, u64)> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(got, want);
        assert!(m.slab.capacity() <= 3_000, "freed slots are reused");
    }
}
