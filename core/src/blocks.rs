//! A block and its parts (its copy handle, SSD locator, access stamp, children, persistent
//! record), and the index's block table: one slab of block records, found by id or by
//! (tenant, key).
//!
//! A block's key is stored once, in the key arena ([`Keys`]); the two lookup tables hold only
//! 4-byte slab slots. The id table hashes server-chosen ids cheaply; the key table hashes
//! client-chosen keys with SipHash (std's randomly keyed hasher), so that nobody can pick
//! colliding keys.

use crate::changes::{Change, ChangeKind};
use hashbrown::HashTable;
use kvpool_policy_sdk::{Event, EventKind, Pin, Tier};
use serde::{Deserialize, Serialize};
use slab::Slab;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

/// A DRAM copy as the index hands it out.
pub trait CopyHandle: Clone + Send + 'static {
    /// What a block's record keeps of the copy: the handle less what the record knows already.
    /// The copy's length is the block's size, so a handle that carries its length need not
    /// keep it twice (4 bytes of every resident block).
    type Kept: Clone + Send + 'static;

    fn keep(&self) -> Self::Kept;

    /// The handle again, from what was kept and the block's size.
    fn restore(kept: &Self::Kept, len: u64) -> Self;

    /// True while someone besides the index holds the copy (an in-flight read): eviction must not
    /// pick it, since its memory would not come free.
    fn in_use(&self) -> bool {
        false
    }
}

impl CopyHandle for u64 {
    type Kept = u64;
    fn keep(&self) -> u64 {
        *self
    }
    fn restore(kept: &u64, _: u64) -> u64 {
        *kept
    }
}

/// A block's persistent record (sled), as the index last wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    pub size: u64,
    pub tokens: u32,
    pub seq_tokens: u64,
    pub parent: Option<Vec<u8>>,
    pub checksum: u64,
    pub created_ms: u64,
    /// 0 none, 1 soft, 2 hard.
    pub pin: u8,
    /// Wall-clock ms when a soft pin ends.
    pub pin_until_ms: u64,
    /// Locator of the SSD copy.
    pub ssd_file: Option<u64>,
    pub in_dram: bool,
}

/// Where a block's SSD copy is, in 8 bytes instead of an `Option<u64>`'s 16: SSD offsets are
/// aligned and below the tier's capacity, so `u64::MAX` never is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Locator(u64);

impl Locator {
    pub(crate) const NONE: Locator = Locator(u64::MAX);

    pub(crate) fn some(offset: u64) -> Locator {
        debug_assert_ne!(offset, u64::MAX, "not an SSD offset");
        Locator(offset)
    }
    pub(crate) fn get(self) -> Option<u64> {
        (self.0 != u64::MAX).then_some(self.0)
    }
    pub(crate) fn is_some(self) -> bool {
        self.0 != u64::MAX
    }
    pub(crate) fn is_none(self) -> bool {
        self.0 == u64::MAX
    }
    pub(crate) fn take(&mut self) -> Option<u64> {
        std::mem::replace(self, Locator::NONE).get()
    }
}

impl From<Option<u64>> for Locator {
    fn from(o: Option<u64>) -> Locator {
        o.map_or(Locator::NONE, Locator::some)
    }
}

pub(crate) struct Block<D: CopyHandle> {
    pub(crate) id: u64,
    pub(crate) tenant: u32,
    /// The key's place in the table's arena ([`Blocks::key`] gives the bytes).
    pub(crate) key: KeyAt,
    /// Bytes; 4 bytes in the record ([`Block::size`] widens it). Larger items are refused by
    /// [`Index::plan_put`].
    pub(crate) size: u32,
    pub(crate) tokens: u32,
    /// Saturates at `u32::MAX` tokens.
    pub(crate) seq_tokens: u32,
    /// The resident parent, or [`NO_PARENT`]. A block put under a parent key that is not
    /// resident has that key in the index's `orphan_keys`; otherwise its parent key is the
    /// parent's own key (not stored twice), and a block with neither is a root.
    pub(crate) parent: u64,
    pub(crate) checksum: u64,
    pub(crate) pin: Pin,
    /// The DRAM copy, as [`CopyHandle::keep`] keeps it ([`Block::dram`] gives the handle).
    pub(crate) dram: Option<D::Kept>,
    pub(crate) ssd: Locator,
    /// A demotion of this block is in flight.
    pub(crate) moving: bool,
    /// Position in the prefix chain (0 for a root), [`NO_DEPTH`] when the parent was unknown.
    pub(crate) depth: u32,
    /// Requests that wanted the key: its remembered misses before the put, then one per read.
    pub(crate) wanted: u32,
    /// When the block was last put or read, as a [`Stamp`]: its wall-clock time, and its
    /// place in the order of accesses (the order the snapshot a new policy is fed keeps).
    pub(crate) stamp: Stamp,
    /// Resident blocks whose parent is this block (the chain rule's input).
    pub(crate) kids: Kids,
}

/// An access stamp: wall-clock µs in the high bits, a sequence among the accesses of the same
/// µs in the low [`Stamp::SEQ_BITS`]. One 8-byte field gives both a block's last access time and
/// the order of accesses, which took two before. Stamps only grow; more than 4,096 accesses in
/// one µs (a frozen test clock) borrow the next µs, so the clock never runs backwards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Stamp(pub(crate) u64);

impl Stamp {
    const SEQ_BITS: u32 = 12;

    /// The first stamp of wall-clock µs `us` (times past 2^52 µs, in the year 2112, saturate).
    pub(crate) fn at_us(us: u64) -> Stamp {
        Stamp(us.min(u64::MAX >> Self::SEQ_BITS) << Self::SEQ_BITS)
    }

    /// The next stamp after `self` no earlier than wall-clock µs `us`.
    pub(crate) fn next(self, us: u64) -> Stamp {
        Stamp(self.0.saturating_add(1).max(Stamp::at_us(us).0))
    }

    pub(crate) fn us(self) -> u64 {
        self.0 >> Self::SEQ_BITS
    }
}

impl<D: CopyHandle> Block<D> {
    /// The DRAM copy's handle.
    pub(crate) fn dram(&self) -> Option<D> {
        self.dram.as_ref().map(|k| D::restore(k, self.size()))
    }

    /// The persistent record; `parent` and `pin_until_ms` come from the index's side tables,
    /// `created_ms` from its record clock ([`Index::record_time`]).
    pub(crate) fn record(&self, parent: Option<&[u8]>, pin_until_ms: u64, created_ms: u64) -> BlockRecord {
        BlockRecord {
            size: self.size(),
            tokens: self.tokens,
            seq_tokens: u64::from(self.seq_tokens),
            parent: parent.map(<[u8]>::to_vec),
            checksum: self.checksum,
            created_ms,
            pin: self.pin as u8,
            pin_until_ms,
            ssd_file: self.ssd.get(),
            in_dram: self.dram.is_some(),
        }
    }

    /// A KV event about this block's copy in `tier`.
    pub(crate) fn change(&self, key: &[u8], kind: ChangeKind, tier: Tier, parent: Option<Arc<[u8]>>) -> Change {
        Change { kind, tier, tenant: self.tenant, key: key.into(), parent, size: self.size(), time_ms: 0, node: 0 }
    }

    /// An event about this block, whose key is `key`; `time` is stamped by [`Index::emit`] (or
    /// the snapshot).
    pub(crate) fn event(&self, key: &[u8], id: u64, kind: EventKind, tier: Tier) -> Event {
        Event {
            kind,
            id,
            // Computed, not stored: 8 bytes less per block for a hash of the key per event.
            key: kvpool_policy_sdk::key_hash(self.tenant, key),
            size: self.size(),
            tokens: self.tokens,
            tier,
            parent: self.parent,
            pin: self.pin,
            depth: self.depth,
            count: self.wanted,
            time: 0,
        }
    }

    pub(crate) fn size(&self) -> u64 {
        u64::from(self.size)
    }

    pub(crate) fn has(&self, tier: Tier) -> bool {
        match tier {
            Tier::Dram => self.dram.is_some(),
            Tier::Ssd => self.ssd.is_some(),
            Tier::Device => false,
        }
    }
}

/// A block's resident children in 8 bytes: most blocks of a chain have none or one, kept
/// inline; a block with more (a shared prefix) has them in the index's `many_kids` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kids(pub(crate) u64);

impl Kids {
    /// Ids start at 1, so 0 is never a child.
    pub(crate) const NONE: Kids = Kids(0);
    pub(crate) const MANY: Kids = Kids(u64::MAX);
}

// Every resident block pays for its record: keep it from growing unnoticed (64-bit targets),
// with what the server keeps of a DRAM copy (8 bytes with a niche: an allocator offset and node
// index; the length is the block's size).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Block<ServerLike>>() <= 88);

/// A handle shaped like the server's, for the size check above.
#[derive(Clone)]
struct ServerLike;

impl CopyHandle for ServerLike {
    type Kept = (u32, std::num::NonZeroU32);
    fn keep(&self) -> Self::Kept {
        (0, std::num::NonZeroU32::MIN)
    }
    fn restore(_: &Self::Kept, _: u64) -> ServerLike {
        ServerLike
    }
}

pub(crate) struct Blocks<D: CopyHandle> {
    slab: Slab<Block<D>>,
    by_id: HashTable<u32>,
    by_key: HashTable<u32>,
    keyed: RandomState,
    keys: Keys,
}

/// Where a key's bytes are in the arena: 6 bytes in the record, where an `Arc<[u8]>` took 16
/// and its allocation another 64 (a 16-byte header and a 40-byte key, rounded to a size class).
/// Two-byte halves keep its alignment at 2, so that it packs beside the record's flags; key
/// lengths fit 2 bytes ([`MAX_KEY_LEN`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyAt {
    len: u16,
    at: [u16; 2],
}

/// The longest key the index stores (the protocol's limit is configured below it).
pub const MAX_KEY_LEN: usize = u16::MAX as usize;

impl KeyAt {
    /// A record's key before [`Blocks::insert`] places it.
    pub(crate) const UNSET: KeyAt = KeyAt { len: 0, at: [0, 0] };

    fn new(len: u16, at: u32) -> KeyAt {
        KeyAt { len, at: [(at >> 16) as u16, at as u16] }
    }

    fn at(self) -> u32 {
        (u32::from(self.at[0]) << 16) | u32::from(self.at[1])
    }
}

/// The key arena: keys of one length are packed in one buffer, and a freed place is reused by
/// the next key of that length. A pool's keys are mostly of a few lengths (hashes in a fixed
/// format), so there are few buffers and no per-key allocation or header.
#[derive(Debug, Default)]
pub(crate) struct Keys {
    /// By key length.
    classes: Vec<KeyClass>,
}

#[derive(Debug, Default)]
struct KeyClass {
    bytes: Vec<u8>,
    free: Vec<u32>,
}

impl Keys {
    pub(crate) fn get(&self, k: KeyAt) -> &[u8] {
        let len = usize::from(k.len);
        let start = k.at() as usize * len;
        &self.classes[len].bytes[start..start + len]
    }

    fn add(&mut self, key: &[u8]) -> KeyAt {
        let len = key.len();
        if self.classes.len() <= len {
            self.classes.resize_with(len + 1, KeyClass::default);
        }
        let c = &mut self.classes[len];
        let at = match c.free.pop() {
            Some(at) => {
                let start = at as usize * len;
                c.bytes[start..start + len].copy_from_slice(key);
                at
            }
            None => {
                // Empty keys take no bytes and share place 0.
                let at = c.bytes.len().checked_div(len).unwrap_or(0);
                c.bytes.extend_from_slice(key);
                u32::try_from(at).expect("fewer than 2^32 keys of one length")
            }
        };
        // A length that fits the protocol's key limit; places fit u32 (4 billion keys).
        // The index refuses longer keys before they get here (`Index::plan_put`, recovery).
        KeyAt::new(u16::try_from(len).expect("a key of at most MAX_KEY_LEN bytes"), at)
    }

    fn free(&mut self, k: KeyAt) {
        if k.len > 0 {
            self.classes[usize::from(k.len)].free.push(k.at());
        }
    }
}

/// Ids are assigned by the index (a counter), never by clients: a multiplicative hash spreads
/// them over the table's high bits, which hashbrown uses for its control bytes.
fn id_hash(id: u64) -> u64 {
    (id ^ (id >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn key_hash(keyed: &RandomState, tenant: u32, key: &[u8]) -> u64 {
    keyed.hash_one((tenant, key))
}

impl<D: CopyHandle> Blocks<D> {
    pub(crate) fn new() -> Blocks<D> {
        Blocks {
            slab: Slab::new(),
            by_id: HashTable::new(),
            by_key: HashTable::new(),
            keyed: RandomState::new(),
            keys: Keys::default(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.slab.len()
    }

    pub(crate) fn reserve(&mut self, n: usize) {
        self.slab.reserve(n);
        let (slab, keyed, keys) = (&self.slab, &self.keyed, &self.keys);
        self.by_id.reserve(n, |&s| id_hash(slab[s as usize].id));
        self.by_key.reserve(n, |&s| {
            let b = &slab[s as usize];
            key_hash(keyed, b.tenant, keys.get(b.key))
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
        let (slab, keys) = (&self.slab, &self.keys);
        self.by_key
            .find(h, |&s| {
                let b = &slab[s as usize];
                b.tenant == tenant && keys.get(b.key) == key
            })
            .map(|&s| slab[s as usize].id)
    }

    /// The key bytes of a block of this table.
    pub(crate) fn key(&self, b: &Block<D>) -> &[u8] {
        self.keys.get(b.key)
    }

    /// A block and its key, for changing the one while reading the other.
    pub(crate) fn get_mut_with_key(&mut self, id: u64) -> Option<(&mut Block<D>, &[u8])> {
        let s = self.slot(id)?;
        let b = &mut self.slab[s];
        let key = self.keys.get(b.key);
        Some((b, key))
    }

    /// Add a block under its id and `key` (the record's own `key` field is set here); neither
    /// may be present (the index removes the old block of a key before it inserts the new one).
    pub(crate) fn insert(&mut self, mut block: Block<D>, key: &[u8]) {
        debug_assert!(self.slot(block.id).is_none() && self.id_of(block.tenant, key).is_none());
        let (id, kh) = (block.id, key_hash(&self.keyed, block.tenant, key));
        block.key = self.keys.add(key);
        // A slab of 2^32 blocks would need terabytes of records first.
        let s = u32::try_from(self.slab.insert(block)).expect("fewer than 2^32 blocks");
        let (slab, keyed, keys) = (&self.slab, &self.keyed, &self.keys);
        self.by_id.insert_unique(id_hash(id), s, |&x| id_hash(slab[x as usize].id));
        self.by_key.insert_unique(kh, s, |&x| {
            let b = &slab[x as usize];
            key_hash(keyed, b.tenant, keys.get(b.key))
        });
    }

    /// Take a block out, with its key (whose place in the arena is freed).
    pub(crate) fn remove(&mut self, id: u64) -> Option<(Block<D>, Box<[u8]>)> {
        let slab = &self.slab;
        let entry = self.by_id.find_entry(id_hash(id), |&s| slab[s as usize].id == id).ok()?;
        let (s, _) = entry.remove();
        let b = &self.slab[s as usize];
        let key: Box<[u8]> = self.keys.get(b.key).into();
        let kh = key_hash(&self.keyed, b.tenant, &key);
        if let Ok(e) = self.by_key.find_entry(kh, |&x| x == s) {
            e.remove();
        }
        let b = self.slab.remove(s as usize);
        self.keys.free(b.key);
        Some((b, key))
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
    use std::collections::HashMap;

    fn block(id: u64, tenant: u32) -> Block<u64> {
        Block {
            id,
            tenant,
            key: KeyAt::UNSET,
            size: id as u32,
            tokens: 0,
            seq_tokens: 0,
            parent: 0,
            checksum: 0,
            pin: Pin::None,
            dram: Some(id),
            ssd: Locator::NONE,
            moving: false,
            depth: 0,
            wanted: 0,
            stamp: Stamp::default(),
            kids: Kids::NONE,
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
                    let (b, k) = t.remove(id).expect("present");
                    assert_eq!((b.id, b.tenant, &*k), (id, tenant, &key[..]));
                    model.remove(&(tenant, key.clone()));
                    assert!(t.get(id).is_none() && t.id_of(tenant, &key).is_none());
                    assert!(t.remove(id).is_none(), "removed twice");
                }
                Some(id) => {
                    assert_eq!(t.id_of(tenant, &key), Some(id));
                    assert_eq!(t.get(id).map(|b| u64::from(b.size)), Some(id));
                    t.get_mut(id).expect("present").wanted += 1;
                }
                None => {
                    assert_eq!(t.id_of(tenant, &key), None);
                    t.insert(block(next, tenant), &key);
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
        // Every record's key reads back from the arena, and freed places were reused: each
        // length's buffer holds no more keys than were ever resident at once (2,000 per tenant).
        for ((tenant, key), id) in &model {
            let b = t.get(*id).expect("present");
            assert_eq!((b.tenant, t.key(b)), (*tenant, &key[..]));
        }
        for (len, c) in t.keys.classes.iter().enumerate().skip(1) {
            assert!(c.bytes.len() / len <= 3 * 2_000, "length {len}: {} places", c.bytes.len() / len);
        }
    }

    #[test]
    fn the_key_arena_reuses_places_and_keeps_empty_keys() {
        let mut k = Keys::default();
        let a = k.add(b"abc");
        let b = k.add(b"xyz");
        let e = k.add(b"");
        assert_eq!((k.get(a), k.get(b), k.get(e)), (&b"abc"[..], &b"xyz"[..], &b""[..]));
        k.free(a);
        let c = k.add(b"def");
        assert_eq!(c, a, "the freed place is reused");
        assert_eq!((k.get(b), k.get(c)), (&b"xyz"[..], &b"def"[..]));
        assert_eq!(k.classes[3].bytes.len(), 6);
    }
}
