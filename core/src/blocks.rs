//! The index's block table: one slab of block records, found by id or by (tenant, key).
//!
//! A block's key is stored once, in its record; the two lookup tables hold only 4-byte slab
//! slots. The id table hashes server-chosen ids cheaply; the key table hashes client-chosen
//! keys with SipHash (std's randomly keyed hasher), so that nobody can pick colliding keys.

use crate::index::Block;
use hashbrown::HashTable;
use slab::Slab;
use std::hash::{BuildHasher, RandomState};

// Every resident block pays for its record: keep it from growing unnoticed (64-bit targets).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Block<std::sync::Arc<u8>>>() <= 184);

pub(crate) struct Blocks<D> {
    slab: Slab<Block<D>>,
    by_id: HashTable<u32>,
    by_key: HashTable<u32>,
    keyed: RandomState,
}

/// Ids are assigned by the index (a counter), never by clients: a multiplicative hash spreads
/// them over the table's high bits, which hashbrown uses for its control bytes.
fn id_hash(id: u64) -> u64 {
    (id ^ (id >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn key_hash(keyed: &RandomState, tenant: u32, key: &[u8]) -> u64 {
    keyed.hash_one((tenant, key))
}

impl<D> Blocks<D> {
    pub(crate) fn new() -> Blocks<D> {
        Blocks { slab: Slab::new(), by_id: HashTable::new(), by_key: HashTable::new(), keyed: RandomState::new() }
    }

    pub(crate) fn len(&self) -> usize {
        self.slab.len()
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.slab.reserve(n);
        let (slab, keyed) = (&self.slab, &self.keyed);
        self.by_id.reserve(n, |&s| id_hash(slab[s as usize].id));
        self.by_key.reserve(n, |&s| {
            let b = &slab[s as usize];
            key_hash(keyed, b.tenant, &b.key)
        });
    }

    fn slot(&self, id: u64) -> Option<usize> {
        let slab = &self.slab;
        self.by_id.find(id_hash(id), |&s| slab[s as usize].id == id).map(|&s| s as usize)
    }

    pub(crate) fn get(&self, id: u64) -> Option<&Block<D>> {
        self.slot(id).map(|s| &self.slab[s])
    }

    pub(crate) fn get_mut(&mut self, id: u64) -> Option<&mut Block<D>> {
        self.slot(id).map(|s| &mut self.slab[s])
    }

    pub(crate) fn contains(&self, id: u64) -> bool {
        self.slot(id).is_some()
    }

    /// The id of the block stored under (tenant, key).
    pub(crate) fn id_of(&self, tenant: u32, key: &[u8]) -> Option<u64> {
        self.id_of_hashed(self.hash_of(tenant, key), tenant, key)
    }

    /// The key table's hash of a key ([`Blocks::id_of_hashed`] takes it).
    pub(crate) fn hash_of(&self, tenant: u32, key: &[u8]) -> u64 {
        key_hash(&self.keyed, tenant, key)
    }

    /// [`Blocks::id_of`] with the hash computed beforehand. A batch hashes every key first and
    /// then probes: the probes are then short and independent, so the CPU overlaps their cache
    /// misses (two per probe in a large table) instead of taking them one after another.
    pub(crate) fn id_of_hashed(&self, h: u64, tenant: u32, key: &[u8]) -> Option<u64> {
        let slab = &self.slab;
        self.by_key
            .find(h, |&s| {
                let b = &slab[s as usize];
                b.tenant == tenant && *b.key == *key
            })
            .map(|&s| slab[s as usize].id)
    }

    /// Add a block under its id and key; neither may be present (the index removes the old
    /// block of a key before it inserts the new one).
    pub(crate) fn insert(&mut self, block: Block<D>) {
        debug_assert!(self.slot(block.id).is_none() && self.id_of(block.tenant, &block.key).is_none());
        let (id, kh) = (block.id, key_hash(&self.keyed, block.tenant, &block.key));
        // A slab of 2^32 blocks would need terabytes of records first.
        let s = u32::try_from(self.slab.insert(block)).expect("fewer than 2^32 blocks");
        let (slab, keyed) = (&self.slab, &self.keyed);
        self.by_id.insert_unique(id_hash(id), s, |&x| id_hash(slab[x as usize].id));
        self.by_key.insert_unique(kh, s, |&x| {
            let b = &slab[x as usize];
            key_hash(keyed, b.tenant, &b.key)
        });
    }

    pub(crate) fn remove(&mut self, id: u64) -> Option<Block<D>> {
        let slab = &self.slab;
        let entry = self.by_id.find_entry(id_hash(id), |&s| slab[s as usize].id == id).ok()?;
        let (s, _) = entry.remove();
        let b = &self.slab[s as usize];
        let kh = key_hash(&self.keyed, b.tenant, &b.key);
        if let Ok(e) = self.by_key.find_entry(kh, |&x| x == s) {
            e.remove();
        }
        Some(self.slab.remove(s as usize))
    }

    /// The slot of a block: a dense index below [`Blocks::slot_bound`], for per-block scratch
    /// arrays (a walk over every block needs no hash set).
    pub(crate) fn slot_of(&self, id: u64) -> Option<usize> {
        self.slot(id)
    }

    /// Every slot is below this.
    pub(crate) fn slot_bound(&self) -> usize {
        self.slab.capacity()
    }

    pub(crate) fn at_slot(&self, slot: usize) -> Option<&Block<D>> {
        self.slab.get(slot)
    }

    /// (slot, block) pairs.
    pub(crate) fn slots(&self) -> impl Iterator<Item = (usize, &Block<D>)> {
        self.slab.iter()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &Block<D>)> {
        self.slab.iter().map(|(_, b)| (b.id, b))
    }

    pub(crate) fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.slab.iter().map(|(_, b)| b.id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool_policy_sdk::Pin;
    use smallvec::SmallVec;
    use std::collections::HashMap;

    fn block(id: u64, tenant: u32, key: &[u8]) -> Block<u64> {
        Block {
            id,
            tenant,
            key: key.into(),
            size: id,
            tokens: 0,
            seq_tokens: 0,
            parent_key: None,
            parent: 0,
            checksum: 0,
            created_ms: 0,
            pin: Pin::None,
            pin_until_ms: 0,
            lease_until: crate::index::LeaseDeadline::NONE,
            dram: Some(id),
            ssd: crate::index::Locator::NONE,
            moving: false,
            last_access: 0,
            hash: 0,
            depth: 0,
            wanted: 0,
            last_us: 0,
            children: SmallVec::new(),
        }
    }

    /// Random inserts and removes against a map model: ids and keys always find the same
    /// record, slots are reused, and a removed id never finds a newer block in its old slot.
    #[test]
    fn agrees_with_a_map_model() {
        let mut t: Blocks<u64> = Blocks::new();
        let mut model: HashMap<(u32, Vec<u8>), u64> = HashMap::new();
        let mut next = 1u64;
        // A fixed xorshift: the test is deterministic and needs no crate.
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..20_000 {
            let tenant = (rnd() % 3) as u32;
            let key = format!("k{}", rnd() % 2_000).into_bytes();
            match model.get(&(tenant, key.clone())).copied() {
                Some(id) if rnd() % 2 == 0 => {
                    let b = t.remove(id).expect("present");
                    assert_eq!((b.id, b.tenant, &*b.key), (id, tenant, &key[..]));
                    model.remove(&(tenant, key.clone()));
                    assert!(t.get(id).is_none() && t.id_of(tenant, &key).is_none());
                    assert!(t.remove(id).is_none(), "removed twice");
                }
                Some(id) => {
                    assert_eq!(t.id_of(tenant, &key), Some(id));
                    assert_eq!(t.get(id).map(|b| b.size), Some(id));
                    t.get_mut(id).expect("present").wanted += 1;
                }
                None => {
                    assert_eq!(t.id_of(tenant, &key), None);
                    t.insert(block(next, tenant, &key));
                    model.insert((tenant, key), next);
                    next += 1;
                }
            }
            if step % 5_000 == 0 {
                t.reserve(100);
            }
        }
        assert_eq!(t.len(), model.len());
        let mut ids: Vec<u64> = t.ids().collect();
        ids.sort_unstable();
        let mut want: Vec<u64> = model.values().copied().collect();
        want.sort_unstable();
        assert_eq!(ids, want);
        for ((tenant, key), id) in &model {
            assert_eq!(t.id_of(*tenant, key), Some(*id));
            assert!(t.contains(*id));
        }
        assert!(!t.contains(next), "an id never assigned");
    }
}
