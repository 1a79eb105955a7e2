//! A block and its parts (its copy handle, SSD locator, access stamp, children, persistent
//! record) and the key arena its key lives in. The table that holds blocks and finds them by
//! id or key is [`crate::table`].

use crate::changes::{Change, ChangeKind};
use kvpool_policy_sdk::{Event, EventKind, Pin, Tier};
use serde::{Deserialize, Serialize};
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
    /// The generation of the block's slot when it was planned: its id is the generation and
    /// the slot ([`crate::table::Blocks`]), so the record keeps 4 bytes of it, not 8.
    pub(crate) gen: u32,
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

/// A block's resident children in 4 bytes: most blocks of a chain have none or one, kept
/// inline as the child's slot (a resident child's id is its slot and that slot's generation);
/// a block with more (a shared prefix) has their ids in the index's `many_kids` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kids(pub(crate) u32);

impl Kids {
    /// Slots stop below both ([`crate::table::MAX_SLOTS`]).
    pub(crate) const NONE: Kids = Kids(u32::MAX);
    pub(crate) const MANY: Kids = Kids(u32::MAX - 1);
}

// Every resident block pays for its record: keep it from growing unnoticed (64-bit targets),
// with what the server keeps of a DRAM copy (8 bytes with a niche: an allocator offset and node
// index; the length is the block's size).
#[cfg(target_pointer_width = "64")]
const _: () = assert!(std::mem::size_of::<Block<ServerLike>>() <= 80);

/// A handle shaped like the server's, for the size checks (here and in [`crate::table`]).
#[derive(Clone)]
pub(crate) struct ServerLike;

impl CopyHandle for ServerLike {
    type Kept = (u32, std::num::NonZeroU32);
    fn keep(&self) -> Self::Kept {
        (0, std::num::NonZeroU32::MIN)
    }
    fn restore(_: &Self::Kept, _: u64) -> ServerLike {
        ServerLike
    }
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

    pub(crate) fn add(&mut self, key: &[u8]) -> KeyAt {
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

    /// Places ever taken by keys of `len` bytes (freed ones included).
    #[cfg(test)]
    pub(crate) fn places(&self, len: usize) -> usize {
        self.classes.get(len).map_or(0, |c| c.bytes.len() / len.max(1))
    }

    pub(crate) fn free(&mut self, k: KeyAt) {
        if k.len > 0 {
            self.classes[usize::from(k.len)].free.push(k.at());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
