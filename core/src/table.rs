//! The index's block table: block records in numbered slots, found by id or by (tenant, key).
//!
//! A block's id names its slot: the slot in the low 32 bits, the slot's generation in the high
//! 32. Finding a block by id is then an array access and a comparison, with no id table (10.5
//! bytes a block at half load) and no id in the record (4 bytes of generation instead of 8).
//! A put hands admission the id its block will have before the bytes arrive, so the slot is
//! taken then: [`Blocks::reserve_id`] holds it (no record, nothing found by key or id) until
//! the block is published into it ([`Blocks::insert`]) or the plan is dropped
//! ([`Blocks::release`]). A freed slot comes back under the next generation, so an id is never
//! handed out twice (a slot whose generations run out is retired, not reused).
//!
//! The key table holds 4-byte slots and hashes client-chosen keys with SipHash (std's randomly
//! keyed hasher), so that nobody can pick colliding keys. A block's key is stored once, in the
//! key arena ([`Keys`]).
//!
//! Hand-written rather than `slab` or `slotmap`: `slab` has neither generations nor places
//! held without a value, and `slotmap` keeps its version beside the value, which rounds an
//! 80-byte record up to 88.

use crate::blocks::{Block, CopyHandle, Keys};
use hashbrown::HashTable;
use std::hash::{BuildHasher, RandomState};

/// Slots stay below this, so that a slot is never [`crate::blocks::Kids`]'s two marks.
pub(crate) const MAX_SLOTS: u32 = u32::MAX - 1;

/// The last generation a slot is given: one more would let an id reach `u64::MAX` ("none").
const LAST_GEN: u32 = u32::MAX - 1;

/// A slot of the table.
enum Slot<D: CopyHandle> {
    /// Free; `next` is the next free slot ([`NO_SLOT`] ends the list); `gen` the generation of
    /// its last id.
    Free {
        next: u32,
        gen: u32,
    },
    /// Held for a planned block (whose id, of generation `gen`, is handed out).
    Held {
        gen: u32,
    },
    Live(Block<D>),
}

const NO_SLOT: u32 = u32::MAX;

// A slot costs what a record does: the free and held states live in the record's niches.
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Slot<crate::blocks::ServerLike>>() <= 80);

/// The id of generation `gen` of slot `slot`.
pub(crate) fn id_of(gen: u32, slot: u32) -> u64 {
    (u64::from(gen) << 32) | u64::from(slot)
}

/// The slot an id names (whether or not it is live).
pub(crate) fn slot_of(id: u64) -> u32 {
    id as u32
}

/// (generation, slot) of an id.
fn split(id: u64) -> (u32, u32) {
    ((id >> 32) as u32, id as u32)
}

fn key_hash(keyed: &RandomState, tenant: u32, key: &[u8]) -> u64 {
    keyed.hash_one((tenant, key))
}

pub(crate) struct Blocks<D: CopyHandle> {
    slots: Vec<Slot<D>>,
    /// Head of the free list.
    free: u32,
    live: usize,
    held: usize,
    by_key: HashTable<u32>,
    keyed: RandomState,
    keys: Keys,
}

impl<D: CopyHandle> Blocks<D> {
    pub(crate) fn new() -> Blocks<D> {
        Blocks {
            slots: Vec::new(),
            free: NO_SLOT,
            live: 0,
            held: 0,
            by_key: HashTable::new(),
            keyed: RandomState::new(),
            keys: Keys::default(),
        }
    }

    /// Resident blocks (held slots not counted).
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    /// Slots held for planned blocks.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// Room for `n` more blocks without growing.
    pub(crate) fn reserve(&mut self, n: usize) {
        self.slots.reserve(n);
        let (slots, keyed, keys) = (&self.slots, &self.keyed, &self.keys);
        self.by_key.reserve(n, |&s| {
            let b = live(slots, s).expect("the key table names live slots");
            key_hash(keyed, b.tenant, keys.get(b.key))
        });
    }

    /// Hold a slot for a block to be published under the returned id; `None` when every slot
    /// is taken (2^32 - 2 of them).
    pub(crate) fn reserve_id(&mut self) -> Option<u64> {
        let (slot, gen) = if self.free != NO_SLOT {
            let s = self.free;
            let Slot::Free { next, gen } = self.slots[s as usize] else {
                unreachable!("the free list holds free slots")
            };
            self.free = next;
            (s, gen + 1)
        } else {
            let s = u32::try_from(self.slots.len()).ok().filter(|&s| s < MAX_SLOTS)?;
            self.slots.push(Slot::Free { next: NO_SLOT, gen: 0 });
            (s, 1)
        };
        self.slots[slot as usize] = Slot::Held { gen };
        self.held += 1;
        Some(id_of(gen, slot))
    }

    /// Whether `id` is held for a planned block.
    pub(crate) fn is_held(&self, id: u64) -> bool {
        let (gen, slot) = split(id);
        matches!(self.slots.get(slot as usize), Some(Slot::Held { gen: g }) if *g == gen)
    }

    /// Give back the slot held for `id` (its plan was dropped); false when it was not held.
    pub(crate) fn release(&mut self, id: u64) -> bool {
        if !self.is_held(id) {
            return false;
        }
        let (gen, slot) = split(id);
        self.held -= 1;
        self.free_slot(slot, gen);
        true
    }

    fn free_slot(&mut self, slot: u32, gen: u32) {
        if gen >= LAST_GEN {
            // Retired: its ids are spent. Out of the free list for good.
            self.slots[slot as usize] = Slot::Free { next: NO_SLOT, gen };
            return;
        }
        self.slots[slot as usize] = Slot::Free { next: self.free, gen };
        self.free = slot;
    }

    /// The slot of a block: a dense index below [`Blocks::slot_bound`], for per-block scratch
    /// arrays (a walk over every block needs no hash set).
    pub(crate) fn slot(&self, id: u64) -> Option<usize> {
        let (gen, slot) = split(id);
        match self.slots.get(slot as usize) {
            Some(Slot::Live(b)) if b.gen == gen => Some(slot as usize),
            _ => None,
        }
    }

    pub(crate) fn get(&self, id: u64) -> Option<&Block<D>> {
        let (gen, slot) = split(id);
        live(&self.slots, slot).filter(|b| b.gen == gen)
    }

    pub(crate) fn get_mut(&mut self, id: u64) -> Option<&mut Block<D>> {
        let s = self.slot(id)?;
        match &mut self.slots[s] {
            Slot::Live(b) => Some(b),
            _ => None,
        }
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
        let (slots, keys) = (&self.slots, &self.keys);
        self.by_key
            .find(h, |&s| live(slots, s).is_some_and(|b| b.tenant == tenant && keys.get(b.key) == key))
            .and_then(|&s| live(slots, s).map(|b| id_of(b.gen, s)))
    }

    /// The key bytes of a block of this table.
    pub(crate) fn key(&self, b: &Block<D>) -> &[u8] {
        self.keys.get(b.key)
    }

    /// A block and its key, for changing the one while reading the other.
    pub(crate) fn get_mut_with_key(&mut self, id: u64) -> Option<(&mut Block<D>, &[u8])> {
        let s = self.slot(id)?;
        let Slot::Live(b) = &mut self.slots[s] else { return None };
        let key = self.keys.get(b.key);
        Some((b, key))
    }

    /// Publish a block into the slot held for `id` under `key` (the record's `gen` and `key`
    /// are set here). The key must not be present (the index removes the old block of a key
    /// before it inserts the new one). Gives the block back when `id` is not held.
    pub(crate) fn insert(&mut self, id: u64, mut block: Block<D>, key: &[u8]) -> Result<(), Block<D>> {
        if !self.is_held(id) {
            return Err(block);
        }
        debug_assert!(self.id_of(block.tenant, key).is_none());
        let (gen, slot) = split(id);
        let kh = key_hash(&self.keyed, block.tenant, key);
        block.gen = gen;
        block.key = self.keys.add(key);
        self.slots[slot as usize] = Slot::Live(block);
        self.held -= 1;
        self.live += 1;
        let (slots, keyed, keys) = (&self.slots, &self.keyed, &self.keys);
        self.by_key.insert_unique(kh, slot, |&x| {
            let b = live(slots, x).expect("the key table names live slots");
            key_hash(keyed, b.tenant, keys.get(b.key))
        });
        Ok(())
    }

    /// Hold a slot and publish `block` into it at once (recovery); its id, or `None` when every
    /// slot is taken.
    pub(crate) fn insert_new(&mut self, block: Block<D>, key: &[u8]) -> Option<u64> {
        let id = self.reserve_id()?;
        self.insert(id, block, key).is_ok().then_some(id)
    }

    /// Take a block out, with its key (whose place in the arena is freed); its slot is free
    /// for the next generation.
    pub(crate) fn remove(&mut self, id: u64) -> Option<(Block<D>, Box<[u8]>)> {
        let s = self.slot(id)?;
        let (gen, slot) = split(id);
        let b = live(&self.slots, slot).expect("found live");
        let key: Box<[u8]> = self.keys.get(b.key).into();
        let kh = key_hash(&self.keyed, b.tenant, &key);
        if let Ok(e) = self.by_key.find_entry(kh, |&x| x == slot) {
            e.remove();
        }
        let Slot::Live(b) = std::mem::replace(&mut self.slots[s], Slot::Free { next: NO_SLOT, gen }) else {
            unreachable!("found live")
        };
        self.live -= 1;
        self.free_slot(slot, gen);
        self.keys.free(b.key);
        Some((b, key))
    }

    /// Every slot is below this.
    pub(crate) fn slot_bound(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn at_slot(&self, slot: usize) -> Option<&Block<D>> {
        u32::try_from(slot).ok().and_then(|s| live(&self.slots, s))
    }

    /// The id of the block in `slot`, if one is live there.
    pub(crate) fn id_at(&self, slot: u32) -> Option<u64> {
        live(&self.slots, slot).map(|b| id_of(b.gen, slot))
    }

    /// (slot, block) pairs.
    pub(crate) fn slots(&self) -> impl Iterator<Item = (usize, &Block<D>)> {
        self.slots.iter().enumerate().filter_map(|(s, x)| match x {
            Slot::Live(b) => Some((s, b)),
            _ => None,
        })
    }

    /// (id, block) pairs.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &Block<D>)> {
        self.slots().map(|(s, b)| (id_of(b.gen, s as u32), b))
    }

    pub(crate) fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.iter().map(|(id, _)| id)
    }
}

fn live<D: CopyHandle>(slots: &[Slot<D>], slot: u32) -> Option<&Block<D>> {
    match slots.get(slot as usize) {
        Some(Slot::Live(b)) => Some(b),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
