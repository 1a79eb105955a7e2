//! The block index of one pool node: which blocks exist, their chains, leases, pins and copies.
//!
//! No I/O and no clock: the caller passes `now` (monotonic, for leases) and `wall_ms` (wall
//! clock, for pins and records). Copies are opaque handles: `D` for a DRAM copy (the server's
//! reference-counted segment range), a `u64` locator for an SSD copy. Whatever must happen
//! outside (free a copy, delete a file, write sled) is returned to the caller as data.

use crate::blocks::{Blocks, KeyAt};
use crate::changes::{Change, ChangeKind};
use crate::{Dropped, MetaOp, PinRequest, PutSpec};
use kvpool_policy_sdk::{
    key_hash, Admit, AdmitBatch, AdmitRequest, Event, EventKind, Events, Pin, Tier, NO_DEPTH, NO_PARENT,
};
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

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

/// Allocation granularity of each tier, for byte accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Granularity {
    pub dram: u64,
    pub ssd: u64,
}

impl Granularity {
    pub fn footprint(&self, tier: Tier, len: u64) -> u64 {
        let unit = if tier == Tier::Ssd { self.ssd } else { self.dram };
        len.max(1).div_ceil(unit) * unit
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

/// What one tenant holds and what happened to its blocks: the `stats` a non-admin key sees.
/// Tier arrays are indexed `[dram, ssd]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantCounters {
    /// Blocks in the index (a block may have a copy in both tiers).
    pub resident: u64,
    pub blocks: [u64; 2],
    /// Bytes held, at each tier's allocation granularity.
    pub bytes: [u64; 2],
    pub hits: [u64; 2],
    pub misses: [u64; 2],
    pub evictions: [u64; 2],
    pub demotions: u64,
    pub promotions: u64,
    pub rejected: u64,
    pub corrupt: u64,
}

fn saturate(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn slot(tier: Tier) -> usize {
    usize::from(tier == Tier::Ssd)
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
pub(crate) struct Stamp(u64);

impl Stamp {
    const SEQ_BITS: u32 = 12;

    /// The first stamp of wall-clock µs `us` (times past 2^52 µs, in the year 2112, saturate).
    fn at_us(us: u64) -> Stamp {
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
    fn record(&self, parent: Option<&[u8]>, pin_until_ms: u64, created_ms: u64) -> BlockRecord {
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
    fn change(&self, key: &[u8], kind: ChangeKind, tier: Tier, parent: Option<Arc<[u8]>>) -> Change {
        Change { kind, tier, tenant: self.tenant, key: key.into(), parent, size: self.size(), time_ms: 0, node: 0 }
    }

    /// An event about this block, whose key is `key`; `time` is stamped by [`Index::emit`] (or
    /// the snapshot).
    fn event(&self, key: &[u8], id: u64, kind: EventKind, tier: Tier) -> Event {
        Event {
            kind,
            id,
            // Computed, not stored: 8 bytes less per block for a hash of the key per event.
            key: key_hash(self.tenant, key),
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

    fn size(&self) -> u64 {
        u64::from(self.size)
    }

    fn has(&self, tier: Tier) -> bool {
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
pub(crate) struct Kids(u64);

impl Kids {
    /// Ids start at 1, so 0 is never a child.
    pub(crate) const NONE: Kids = Kids(0);
    const MANY: Kids = Kids(u64::MAX);
}

/// How a put item will be handled, decided before its bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutPlan {
    /// Store the bytes as a copy in this tier, under this pre-assigned id.
    Store { id: u64, tier: Tier },
    /// Do not store: discard the bytes and answer this.
    Skip(PutStatus),
}

/// Outcome of one put item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutStatus {
    Ok,
    AlreadyExists,
    /// Upsert of a block that is leased to readers.
    Leased,
    /// Refused by the admission policy.
    Rejected,
    NoSpace,
}

/// Outcome of one remove item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoveStatus {
    Ok,
    NotFound,
    Leased,
}

/// Where a block of a get is, resolved under the lock and read outside it.
#[derive(Debug, Clone)]
pub enum Located<D> {
    Missing,
    Dram { id: u64, copy: D, checksum: u64 },
    Ssd { id: u64, locator: u64, size: u64, checksum: u64 },
}

/// A put item whose admission is still to be asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pending {
    Skip(PutStatus),
    /// Row `row` of the admission batch, for block `id`.
    Ask {
        id: u64,
        row: usize,
    },
}

/// The result of an eviction pass over the index.
#[derive(Debug)]
pub struct Evicted<D> {
    /// DRAM copies to write to the SSD tier; finish each with [`Index::finish_demotion`].
    pub demotions: Vec<(u64, D)>,
    /// Copies to free and files to delete, outside the lock.
    pub dropped: Vec<Dropped<D>>,
    pub meta: Vec<MetaOp>,
    /// Copies that left the tier now (demotions not counted), cascaded ones included.
    pub gone: usize,
    /// Blocks removed by the chain rule: resident descendants of a victim that lost its last
    /// copy, which the policy did not name.
    pub cascaded: usize,
    /// Victims kept by the chain rule: a resident descendant was leased, in flight or
    /// hard-pinned, so removing the victim would have stranded it.
    pub refused: usize,
}

/// How a demotion ended.
#[derive(Debug)]
pub enum Demoted<D> {
    /// The block now lives on SSD; its DRAM copy is to be freed.
    Moved { dram: Option<D>, meta: MetaOp },
    /// No SSD copy could be written: the block was evicted instead.
    Evicted { dropped: Dropped<D>, meta: Option<MetaOp> },
    /// The block was removed or replaced meanwhile: the written copy is garbage.
    Vanished,
}

/// Recovery of the index from persisted records.
#[derive(Debug, Default)]
pub struct Recovered {
    pub kept: u64,
    pub dropped: u64,
    pub meta: Vec<MetaOp>,
    /// The recovered block set, parents first, for the policies.
    pub snapshot: Events,
}

/// The block index.
pub struct Index<D: CopyHandle> {
    /// Keyed with SipHash (std's randomly keyed hasher): keys are chosen by clients.
    blocks: Blocks<D>,
    next_id: u64,
    /// When each lease ends, by id, for leases that may still be running (expired ones are
    /// pruned lazily). Aside, not in the record: only blocks being read have one.
    leases: BTreeMap<u64, Instant>,
    /// Holds by id (a lookup that leases what it counted), each released by its holder: a held
    /// block is leased until its last hold goes, whatever the clock says.
    holds: HashMap<u64, u32>,
    /// Ids with a demotion in flight.
    moving: BTreeSet<u64>,
    soft_pins: BTreeSet<(u64, u64)>,
    events: Events,
    /// The latest access stamp handed out.
    stamp: Stamp,
    /// Wall clock (µs): the latest time passed in, stamped on events.
    clock_us: u64,
    /// The time of the newest persistent record written or recovered (ms). Records take it,
    /// so their times never go backwards, even when the wall clock does: recovery gives a
    /// contested SSD extent to the newest record. One clock for the index, not a time per block.
    record_ms: u64,
    /// Recent misses, for `count` and the warm snapshot.
    misses: MissLog,
    /// Resident blocks whose parent key is not resident (or was replaced), by that key: they are
    /// linked to the parent when it is put again, so the chain rule sees them.
    orphans: hashbrown::HashMap<ScopedKey, Vec<u64>, std::hash::RandomState>,
    /// The parent key of each such waiting block (the others find it in their parent).
    orphan_keys: HashMap<u64, Arc<[u8]>>,
    /// The children of blocks with more than one ([`Kids`]).
    many_kids: HashMap<u64, Vec<u64>>,
    /// When each soft pin ends (wall ms), by block: few blocks are pinned, so not in the record.
    pin_until: HashMap<u64, u64>,
    copies: [u64; 2],
    tenants: HashMap<u32, TenantCounters>,
    gran: Granularity,
    has_ssd: bool,
    /// DRAM victims may be offered to another node first ([`Index::set_offload`]).
    offload: bool,
    /// KV events waiting to be taken, while the feed is on ([`Index::set_change_feed`]).
    changes: Option<Vec<Change>>,
}

/// A tenant-scoped key as stored in the index.
type ScopedKey = (u32, Arc<[u8]>);

/// Misses the index remembers by default (the warm snapshot's "recent misses").
pub const DEFAULT_MISS_MEMORY: usize = 65_536;

/// Recent misses, bounded: (key hash, depth, parent, time µs), oldest first, and how many of
/// each key hash the log holds.
#[derive(Debug, Default)]
struct MissLog {
    cap: usize,
    log: VecDeque<(u64, u32, u64, u64)>,
    counts: HashMap<u64, u32>,
}

impl MissLog {
    /// Record a miss of `hash`; returns how many misses of it the log now holds (at least 1).
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

    fn count(&self, hash: u64) -> u32 {
        self.counts.get(&hash).copied().unwrap_or(0)
    }
}

/// A borrowed scoped key: looks up a [`ScopedKey`] without allocating one. It hashes exactly as
/// the tuple does (the tenant, then the key with its length).
#[derive(Clone, Copy)]
struct KeyRef<'a>(u32, &'a [u8]);

impl std::hash::Hash for KeyRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.hash(h);
        self.1.hash(h);
    }
}

impl hashbrown::Equivalent<ScopedKey> for KeyRef<'_> {
    fn equivalent(&self, k: &ScopedKey) -> bool {
        self.0 == k.0 && *self.1 == *k.1
    }
}

fn probe(tenant: u32, key: &[u8]) -> KeyRef<'_> {
    KeyRef(tenant, key)
}

impl<D: CopyHandle> Index<D> {
    pub fn new(gran: Granularity, has_ssd: bool) -> Index<D> {
        Index {
            blocks: Blocks::new(),
            next_id: 1,
            leases: BTreeMap::new(),
            holds: HashMap::new(),
            moving: BTreeSet::new(),
            soft_pins: BTreeSet::new(),
            events: Events::new(),
            stamp: Stamp(0),
            clock_us: 0,
            record_ms: 0,
            misses: MissLog { cap: DEFAULT_MISS_MEMORY, ..MissLog::default() },
            orphans: hashbrown::HashMap::with_hasher(std::hash::RandomState::new()),
            orphan_keys: HashMap::new(),
            many_kids: HashMap::new(),
            pin_until: HashMap::new(),
            copies: [0; 2],
            tenants: HashMap::new(),
            gran,
            has_ssd,
            offload: false,
            changes: None,
        }
    }

    /// Record a KV event for every copy that comes or goes from now on (or stop, dropping those
    /// not yet taken). Off by default: it costs a key reference per change.
    pub fn set_change_feed(&mut self, on: bool) {
        self.changes = on.then(Vec::new);
    }

    /// KV events since the last call, in the order the index made the changes.
    pub fn take_changes(&mut self) -> Vec<Change> {
        self.changes.as_mut().map(std::mem::take).unwrap_or_default()
    }

    // ---- bookkeeping --------------------------------------------------------------------

    fn tenant_mut(&mut self, tenant: u32) -> &mut TenantCounters {
        self.tenants.entry(tenant).or_default()
    }

    fn copy_added(&mut self, tenant: u32, tier: Tier, size: u64) {
        let fp = self.gran.footprint(tier, size);
        self.copies[slot(tier)] += 1;
        let t = self.tenant_mut(tenant);
        t.blocks[slot(tier)] += 1;
        t.bytes[slot(tier)] += fp;
    }

    fn copy_removed(&mut self, tenant: u32, tier: Tier, size: u64) {
        let fp = self.gran.footprint(tier, size);
        self.copies[slot(tier)] -= 1;
        let t = self.tenant_mut(tenant);
        t.blocks[slot(tier)] -= 1;
        t.bytes[slot(tier)] -= fp;
    }

    /// Queue an event for the policies, stamped with the index's clock.
    fn emit(&mut self, e: Event) {
        self.events.push(e.with_time(self.clock_us));
    }

    /// Advance the clock events are stamped with (wall clock, µs; it never goes back).
    fn clock(&mut self, wall_us: u64) {
        self.clock_us = self.clock_us.max(wall_us);
    }

    /// A lease on block `id` runs past `now`.
    fn is_leased(&self, id: u64, now: Instant) -> bool {
        self.leases.get(&id).is_some_and(|until| *until > now) || self.holds.contains_key(&id)
    }

    /// The resident children of `b`.
    fn kids_of<'a>(&'a self, b: &'a Block<D>) -> &'a [u64] {
        match b.kids {
            Kids::NONE => &[],
            Kids::MANY => self.many_kids.get(&b.id).map_or(&[], Vec::as_slice),
            _ => std::slice::from_ref(&b.kids.0),
        }
    }

    fn add_kid(&mut self, parent: u64, child: u64) {
        let p = self.blocks.get_mut(parent).expect("an indexed parent");
        match p.kids {
            Kids::NONE => p.kids = Kids(child),
            Kids::MANY => self.many_kids.entry(parent).or_default().push(child),
            Kids(one) => {
                p.kids = Kids::MANY;
                self.many_kids.insert(parent, vec![one, child]);
            }
        }
    }

    fn remove_kid(&mut self, parent: u64, child: u64) {
        let Some(p) = self.blocks.get_mut(parent) else { return };
        match p.kids {
            Kids::MANY => {
                let Some(v) = self.many_kids.get_mut(&parent) else { return };
                v.retain(|&c| c != child);
                if let [one] = v[..] {
                    p.kids = Kids(one);
                    self.many_kids.remove(&parent);
                }
            }
            Kids(one) if one == child => p.kids = Kids::NONE,
            _ => {}
        }
    }

    /// The children of block `id` (no longer indexed), whose list was `kids`.
    fn take_kids(&mut self, id: u64, kids: Kids) -> Vec<u64> {
        match kids {
            Kids::NONE => Vec::new(),
            Kids::MANY => self.many_kids.remove(&id).unwrap_or_default(),
            Kids(one) => vec![one],
        }
    }

    /// The parent key `b` was put under, if any.
    fn parent_key(&self, b: &Block<D>) -> Option<Arc<[u8]>> {
        match self.blocks.get(b.parent) {
            Some(p) => Some(self.blocks.key(p).into()),
            None => self.orphan_keys.get(&b.id).cloned(),
        }
    }

    /// A KV event about block `id`'s copy in `tier` (the block is indexed).
    fn change_of(&self, id: u64, kind: ChangeKind, tier: Tier) -> Change {
        let b = self.blocks.get(id).expect("an indexed block");
        b.change(self.blocks.key(b), kind, tier, self.parent_key(b))
    }

    /// Record a KV event about block `id` (indexed), when the feed is on.
    fn note_change(&mut self, id: u64, kind: ChangeKind, tier: Tier) {
        if self.changes.is_some() {
            let change = self.change_of(id, kind, tier);
            if let Some(c) = &mut self.changes {
                c.push(change);
            }
        }
    }

    /// The persistent record of block `id` (indexed), written at wall-clock `wall_ms`.
    fn record_of(&mut self, id: u64, wall_ms: u64) -> BlockRecord {
        let created_ms = self.record_time(wall_ms);
        let b = self.blocks.get(id).expect("an indexed block");
        let until = if b.pin == Pin::Soft { self.pin_until.get(&id).copied().unwrap_or(0) } else { 0 };
        b.record(self.parent_key(b).as_deref(), until, created_ms)
    }

    /// The time of a record written at `wall_ms`: never earlier than an earlier record's.
    fn record_time(&mut self, wall_ms: u64) -> u64 {
        self.record_ms = self.record_ms.max(wall_ms);
        self.record_ms
    }

    /// A fresh access stamp at the current clock.
    fn next_stamp(&mut self) -> Stamp {
        self.stamp = self.stamp.next(self.clock_us);
        self.stamp
    }

    /// How many recent misses to remember (for `count` and the warm snapshot; 0 turns it off).
    pub fn set_miss_memory(&mut self, n: usize) {
        self.misses.cap = n;
        while self.misses.log.len() > n {
            let Some((h, ..)) = self.misses.log.pop_front() else { break };
            if let Some(c) = self.misses.counts.get_mut(&h) {
                *c -= 1;
                if *c == 0 {
                    self.misses.counts.remove(&h);
                }
            }
        }
    }

    /// Report a miss of `key` to the policies: chain position `depth`, `parent` the resident
    /// block before it (or none).
    fn missed(&mut self, tenant: u32, key: &[u8], depth: u32, parent: u64) {
        let hash = key_hash(tenant, key);
        let count = self.misses.push(hash, depth, parent, self.clock_us);
        self.emit(Event::missed(hash, depth, parent).with_count(count));
    }

    /// Depth of a block whose parent is `parent` (a resident id or none) and whose parent key
    /// is `parent_key`.
    fn depth_under(&self, parent: u64, parent_key: Option<&[u8]>) -> u32 {
        match (parent_key, self.blocks.get(parent)) {
            (None, _) => 0,
            (Some(_), Some(p)) if p.depth != NO_DEPTH => p.depth + 1,
            _ => NO_DEPTH,
        }
    }

    /// Events since the last call, for the policies (in order).
    pub fn take_events(&mut self) -> Events {
        std::mem::take(&mut self.events)
    }

    /// Events waiting for the policies.
    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    /// (blocks, DRAM copies, SSD copies)
    pub fn counts(&self) -> (u64, u64, u64) {
        (self.blocks.len() as u64, self.copies[0], self.copies[1])
    }

    /// One tenant's residency and counters (zero for a tenant that never stored anything).
    pub fn tenant_counters(&self, tenant: u32) -> TenantCounters {
        self.tenants.get(&tenant).cloned().unwrap_or_default()
    }

    /// Count put items refused for lack of space, for the tenant's stats.
    pub fn count_no_space(&mut self, tenant: u32, n: u64) {
        self.tenant_mut(tenant).rejected += n;
    }

    // ---- recovery -----------------------------------------------------------------------

    /// Rebuild from persisted records. Only SSD copies survive a restart, and only those whose
    /// extent the SSD tier lets `adopt` claim: it gets every candidate's (locator, size) in one
    /// slice, in record order, and answers which it claimed. Pass records newest first, so that
    /// when a crash left two records naming one extent, the newer keeps it. Their bytes are
    /// verified when first read, as every SSD read is.
    pub fn recover(
        &mut self,
        records: Vec<(u32, Vec<u8>, Option<BlockRecord>)>,
        adopt: impl FnOnce(&[(u64, u64)]) -> Vec<bool>,
        wall_ms: u64,
    ) -> Recovered {
        let mut out = Recovered::default();
        // One allocation for the whole set instead of a rehash at every doubling.
        self.blocks.reserve(records.len());
        let has_ssd = self.has_ssd;
        // A record whose key the arena cannot hold (longer than any configurable key limit) is
        // dropped like one without an SSD copy, and its extent is not claimed.
        let candidate = move |key: &[u8], rec: &Option<BlockRecord>| {
            rec.as_ref()
                .filter(|_| key.len() <= crate::MAX_KEY_LEN)
                .and_then(|r| r.ssd_file.filter(|_| has_ssd).map(|f| (f, r.size)))
        };
        let extents: Vec<(u64, u64)> = records.iter().filter_map(|(_, k, r)| candidate(k, r)).collect();
        let claimed = adopt(&extents);
        let mut claimed = claimed.into_iter();
        // (child, tenant, parent key) of every recovered block put under a parent: linked below,
        // and only those whose parent is gone keep their key (in `orphan_keys`).
        let mut parents: Vec<(u64, u32, Vec<u8>)> = Vec::new();
        for (tenant, key, rec) in records {
            let usable = candidate(&key, &rec).is_some() && claimed.next().unwrap_or(false);
            let Some(r) = rec.filter(|_| usable) else {
                out.meta.push(MetaOp::Remove { tenant, key: key.into() });
                out.dropped += 1;
                continue;
            };
            let id = self.next_id;
            self.next_id += 1;
            self.record_ms = self.record_ms.max(r.created_ms);
            let file = r.ssd_file.expect("checked usable");
            let pin = match Pin::from_u8(r.pin).unwrap_or(Pin::None) {
                Pin::Soft if r.pin_until_ms <= wall_ms => Pin::None,
                p => p,
            };
            if pin == Pin::Soft {
                self.soft_pins.insert((r.pin_until_ms, id));
                self.pin_until.insert(id, r.pin_until_ms);
            }
            if let Some(pk) = r.parent {
                parents.push((id, tenant, pk));
            }
            let b = Block {
                id,
                tenant,
                key: KeyAt::UNSET,
                // Records are written from blocks, whose sizes fit.
                size: u32::try_from(r.size).unwrap_or(u32::MAX),
                tokens: r.tokens,
                seq_tokens: saturate(r.seq_tokens),
                parent: NO_PARENT,
                checksum: r.checksum,
                pin,
                dram: None,
                ssd: Locator::some(file),
                moving: false,
                depth: NO_DEPTH,
                wanted: 0,
                // Before every access of this run (recovered blocks were idle since then).
                stamp: Stamp::at_us(r.created_ms.min(wall_ms).saturating_mul(1000)),
                kids: Kids::NONE,
            };
            self.copy_added(tenant, Tier::Ssd, b.size());
            self.tenant_mut(tenant).resident += 1;
            self.blocks.insert(b, &key);
            out.kept += 1;
        }
        // In id order (ids were given in record order), so that children lists are stable.
        for (id, tenant, pk) in parents {
            match self.blocks.id_of(tenant, &pk) {
                Some(pid) => {
                    self.add_kid(pid, id);
                    self.blocks.get_mut(id).expect("listed").parent = pid;
                }
                None => {
                    let pk: Arc<[u8]> = pk.into();
                    self.orphan_keys.insert(id, pk.clone());
                    self.orphans.entry((tenant, pk)).or_default().push(id);
                }
            }
        }
        // Depths: roots are 0, a block under a known parent one more; orphans stay unknown.
        let ids: Vec<u64> = self.blocks.ids().collect();
        let mut path = Vec::new();
        for id in ids {
            let mut cur = id;
            let mut d = loop {
                let b = self.blocks.get(cur).expect("walked");
                if b.depth != NO_DEPTH {
                    break b.depth;
                }
                if b.parent == NO_PARENT && !self.orphan_keys.contains_key(&cur) {
                    break 0;
                }
                if b.parent == NO_PARENT || path.len() > self.blocks.len() {
                    break NO_DEPTH;
                }
                path.push(cur);
                cur = b.parent;
            };
            self.blocks.get_mut(cur).expect("walked").depth = d;
            while let Some(x) = path.pop() {
                d = if d == NO_DEPTH { NO_DEPTH } else { d + 1 };
                self.blocks.get_mut(x).expect("walked").depth = d;
            }
        }
        // Accesses of this run come after every recovered block, even if the wall clock steps
        // back later.
        self.clock(wall_ms.saturating_mul(1000));
        self.stamp = self.stamp.max(Stamp::at_us(self.clock_us));
        out.snapshot = self.snapshot();
        out
    }

    // ---- put ----------------------------------------------------------------------------

    /// First half of planning a put: existing keys and blocks that can never fit are decided
    /// here; the others get an id and a row in the returned admission batch.
    pub fn plan_put(
        &mut self,
        tenant: u32,
        items: &[PutSpec<'_>],
        upsert: bool,
        max_copy: u64,
    ) -> (Vec<Pending>, AdmitBatch) {
        let mut pending = Vec::with_capacity(items.len());
        let mut batch = AdmitBatch::default();
        // Rows of this put by key: a parent may be an earlier row (a chain put in one call).
        let mut rows: Vec<(&[u8], u64, u32)> = Vec::new();
        for it in items {
            if !upsert && self.blocks.id_of(tenant, it.key).is_some() {
                pending.push(Pending::Skip(PutStatus::AlreadyExists));
                continue;
            }
            // Keys beyond the arena's two-byte lengths are refused like values beyond the
            // record's four-byte sizes (the server's configured key limit is below both).
            if self.gran.footprint(Tier::Dram, it.size) > max_copy
                || it.size > u64::from(u32::MAX)
                || it.key.len() > crate::MAX_KEY_LEN
            {
                pending.push(Pending::Skip(PutStatus::NoSpace));
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            let resident = it.parent.and_then(|p| self.blocks.id_of(tenant, p));
            let in_batch = || it.parent.and_then(|p| rows.iter().rev().find(|r| r.0 == p).map(|r| (r.1, r.2)));
            let (parent, depth) = match (resident, in_batch()) {
                (Some(pid), _) => (pid, self.depth_under(pid, it.parent)),
                (None, Some((rid, d))) => (rid, if d == NO_DEPTH { NO_DEPTH } else { d + 1 }),
                (None, None) => (NO_PARENT, self.depth_under(NO_PARENT, it.parent)),
            };
            rows.push((it.key, id, depth));
            pending.push(Pending::Ask { id, row: batch.len() });
            batch.push(AdmitRequest {
                id,
                key: key_hash(tenant, it.key),
                size: it.size,
                tokens: it.tokens,
                seq_tokens: it.seq_tokens,
                tier: Tier::Dram,
                parent,
                depth,
            });
        }
        (pending, batch)
    }

    /// Second half: combine admission decisions (and placement tiers, when a placement policy
    /// answered) into plans. The chain rule for admission applies first: a row whose parent row
    /// in `batch` is rejected is rejected too ([`AdmitBatch::enforce_chain`]). Rejections count
    /// against the tenant.
    pub fn decide_put(
        &mut self,
        tenant: u32,
        pending: &[Pending],
        batch: &AdmitBatch,
        decisions: &[Admit],
        placed: Option<&[Tier]>,
    ) -> Vec<PutPlan> {
        let mut decisions = decisions.to_vec();
        if decisions.len() < batch.len() {
            decisions.resize(batch.len(), Admit::Into(Tier::Dram));
        }
        batch.enforce_chain(&mut decisions);
        let has_ssd = self.has_ssd;
        let mut rejected = 0;
        let plans = pending
            .iter()
            .map(|p| match *p {
                Pending::Skip(s) => PutPlan::Skip(s),
                Pending::Ask { id, row } => match decisions.get(row).copied().unwrap_or(Admit::Into(Tier::Dram)) {
                    Admit::Reject => {
                        rejected += 1;
                        PutPlan::Skip(PutStatus::Rejected)
                    }
                    Admit::Into(t) => {
                        let t = placed.and_then(|p| p.get(row).copied()).unwrap_or(t);
                        let tier = if t == Tier::Ssd && has_ssd { Tier::Ssd } else { Tier::Dram };
                        PutPlan::Store { id, tier }
                    }
                },
            })
            .collect();
        if rejected > 0 {
            self.tenant_mut(tenant).rejected += rejected;
        }
        plans
    }

    /// Publish a block whose bytes are complete. `Err` when the key changed meanwhile (an insert
    /// found it present, an upsert found the old value leased): the caller frees the copy.
    #[allow(clippy::too_many_arguments)]
    pub fn commit(
        &mut self,
        tenant: u32,
        id: u64,
        spec: &PutSpec<'_>,
        upsert: bool,
        checksum: u64,
        dram: Option<D>,
        ssd: Option<u64>,
        now: Instant,
        wall_ms: u64,
        soft_pin_ttl_ms: u64,
    ) -> Result<(Option<Dropped<D>>, Vec<MetaOp>), PutStatus> {
        if spec.key.len() > crate::MAX_KEY_LEN || spec.size > u64::from(u32::MAX) {
            return Err(PutStatus::NoSpace);
        }
        let mut meta = Vec::with_capacity(2);
        let mut replaced = None;
        if let Some(old) = self.blocks.id_of(tenant, spec.key) {
            if !upsert {
                return Err(PutStatus::AlreadyExists);
            }
            if self.is_leased(old, now) {
                return Err(PutStatus::Leased);
            }
            let (d, m) = self.drop_block(old, ChangeKind::Removed).expect("indexed block exists");
            replaced = Some(d);
            meta.extend(m);
        }
        let parent = spec.parent.and_then(|p| self.blocks.id_of(tenant, p)).unwrap_or(NO_PARENT);
        let (pin, pin_until_ms) = match spec.pin {
            PinRequest::None => (Pin::None, 0),
            PinRequest::Hard => (Pin::Hard, 0),
            PinRequest::Soft { ttl_ms } => {
                (Pin::Soft, wall_ms.saturating_add(if ttl_ms == 0 { soft_pin_ttl_ms } else { ttl_ms }))
            }
        };
        self.clock(wall_ms.saturating_mul(1000));
        let stamp = self.next_stamp();
        let hash = key_hash(tenant, spec.key);
        // Resident blocks that were waiting for this key as their parent.
        let children: Vec<u64> = self
            .orphans
            .remove(&probe(tenant, spec.key))
            .unwrap_or_default()
            .into_iter()
            .filter(|&c| self.blocks.contains(c))
            .collect();
        for c in &children {
            self.blocks.get_mut(*c).expect("filtered").parent = id;
            self.orphan_keys.remove(c);
        }
        match (parent, spec.parent) {
            (NO_PARENT, Some(pk)) => {
                let pk: Arc<[u8]> = pk.into();
                self.orphans.entry((tenant, pk.clone())).or_default().push(id);
                self.orphan_keys.insert(id, pk);
            }
            (NO_PARENT, None) => {}
            (pid, _) => self.add_kid(pid, id),
        }
        let kids = match children[..] {
            [] => Kids::NONE,
            [c] => Kids(c),
            _ => {
                self.many_kids.insert(id, children);
                Kids::MANY
            }
        };
        let block = Block {
            id,
            tenant,
            key: KeyAt::UNSET,
            // plan_put refused sizes beyond 4 bytes.
            size: u32::try_from(spec.size).unwrap_or(u32::MAX),
            tokens: spec.tokens,
            seq_tokens: saturate(spec.seq_tokens),
            parent,
            checksum,
            pin,
            dram: dram.as_ref().map(D::keep),
            ssd: Locator::from(ssd),
            moving: false,
            depth: self.depth_under(parent, spec.parent),
            wanted: self.misses.count(hash),
            stamp,
            kids,
        };
        if pin == Pin::Soft {
            self.soft_pins.insert((pin_until_ms, id));
            self.pin_until.insert(id, pin_until_ms);
        }
        self.blocks.insert(block, spec.key);
        // Only blocks with an SSD copy are persisted: a DRAM copy does not survive a restart.
        if self.blocks.get(id).expect("just inserted").ssd.is_some() {
            let key = Box::from(spec.key);
            meta.push(MetaOp::Put { tenant, key, record: self.record_of(id, wall_ms) });
        }
        for tier in [Tier::Dram, Tier::Ssd] {
            let b = self.blocks.get(id).expect("just inserted");
            if b.has(tier) {
                let ev = b.event(spec.key, id, EventKind::Inserted, tier);
                self.copy_added(tenant, tier, spec.size);
                self.emit(ev);
                self.note_change(id, ChangeKind::Stored, tier);
            }
        }
        self.tenant_mut(tenant).resident += 1;
        Ok((replaced, meta))
    }

    /// Take a block out of the index: its copies for the caller to free, and the removal of its
    /// record when it had one (only blocks with an SSD copy have one).
    fn drop_block(&mut self, id: u64, why: ChangeKind) -> Option<(Dropped<D>, Option<MetaOp>)> {
        let parent_key = self.changes.is_some().then(|| self.blocks.get(id).and_then(|b| self.parent_key(b))).flatten();
        let (b, key) = self.blocks.remove(id)?;
        // Chain links: out of the parent's children (or the orphans waiting for it); the
        // children wait for this key to come back.
        if self.blocks.contains(b.parent) {
            self.remove_kid(b.parent, id);
        } else if let Some(pk) = self.orphan_keys.remove(&id) {
            if let Some(w) = self.orphans.get_mut(&probe(b.tenant, &pk)) {
                w.retain(|&c| c != id);
                if w.is_empty() {
                    self.orphans.remove(&probe(b.tenant, &pk));
                }
            }
        }
        let children = self.take_kids(id, b.kids);
        if !children.is_empty() {
            let key: Arc<[u8]> = Arc::from(&*key);
            for c in &children {
                if let Some(cb) = self.blocks.get_mut(*c) {
                    cb.parent = NO_PARENT;
                    self.orphan_keys.insert(*c, key.clone());
                }
            }
            self.orphans.entry((b.tenant, key)).or_default().extend(children);
        }
        self.tenant_mut(b.tenant).resident -= 1;
        self.leases.remove(&id);
        self.holds.remove(&id);
        self.moving.remove(&id);
        if let Some(until) = self.pin_until.remove(&id) {
            self.soft_pins.remove(&(until, id));
        }
        for tier in [Tier::Dram, Tier::Ssd] {
            if b.has(tier) {
                self.copy_removed(b.tenant, tier, b.size());
                self.emit(b.event(&key, id, EventKind::Removed, tier));
                if let Some(c) = &mut self.changes {
                    c.push(b.change(&key, why, tier, parent_key.clone()));
                }
            }
        }
        let meta = b.ssd.is_some().then_some(MetaOp::Remove { tenant: b.tenant, key });
        let size = b.size();
        Some((Dropped { dram: b.dram(), ssd: b.ssd.get().map(|f| (f, size)) }, meta))
    }

    // ---- reads --------------------------------------------------------------------------

    /// Locate and lease the keys of a get; hits update recency and count as reads of the key,
    /// misses are reported to the policies (`wall_us`: wall clock, µs). A missing key's chain
    /// position is one more than the previous key's of the same get, or its index in the get
    /// when nothing before says otherwise (gets name chains from their root).
    pub fn plan_get(&mut self, tenant: u32, keys: &[Vec<u8>], lease_until: Instant, wall_us: u64) -> Vec<Located<D>> {
        self.clock(wall_us);
        let mut out = Vec::with_capacity(keys.len());
        // (id, depth) of the previous key of the get, when known.
        let mut prev: Option<(u64, u32)> = None;
        for (i, k) in keys.iter().enumerate() {
            let Some(id) = self.blocks.id_of(tenant, k) else {
                let depth = match prev {
                    Some((_, d)) if d != NO_DEPTH => d + 1,
                    _ => i as u32,
                };
                let parent = prev.map_or(NO_PARENT, |p| p.0);
                self.missed(tenant, k, depth, parent);
                prev = Some((NO_PARENT, depth));
                let has_ssd = self.has_ssd;
                let t = self.tenant_mut(tenant);
                t.misses[0] += 1;
                if has_ssd {
                    t.misses[1] += 1;
                }
                out.push(Located::Missing);
                continue;
            };
            let stamp = self.next_stamp();
            let b = self.blocks.get_mut(id).expect("index and blocks agree");
            b.stamp = stamp;
            let k: &[u8] = k;
            b.wanted = b.wanted.saturating_add(1);
            prev = Some((id, b.depth));
            let (loc, ev) = match b.dram() {
                Some(copy) => {
                    (Located::Dram { id, copy, checksum: b.checksum }, b.event(k, id, EventKind::Accessed, Tier::Dram))
                }
                None => {
                    let locator = b.ssd.get().expect("a block has at least one copy");
                    (
                        Located::Ssd { id, locator, size: b.size(), checksum: b.checksum },
                        b.event(k, id, EventKind::Accessed, Tier::Ssd),
                    )
                }
            };
            let t = self.tenant_mut(tenant);
            if matches!(loc, Located::Dram { .. }) {
                t.hits[0] += 1;
            } else {
                t.misses[0] += 1;
                t.hits[1] += 1;
            }
            self.leases.insert(id, lease_until);
            self.emit(ev);
            out.push(loc);
        }
        out
    }

    /// Number of leading chain blocks resident in any tier. No lease, no recency update; every
    /// absent key of the chain is reported to the policies as a miss at its chain position
    /// (`wall_us`: wall clock, µs).
    pub fn lookup(&mut self, tenant: u32, chain: &[Vec<u8>], wall_us: u64) -> usize {
        let hashes: SmallVec<[u64; 64]> = chain.iter().map(|k| self.blocks.hash_of(tenant, k)).collect();
        let hit =
            chain.iter().zip(&hashes).take_while(|(k, &h)| self.blocks.id_of_hashed(h, tenant, k).is_some()).count();
        if hit == chain.len() {
            return hit;
        }
        self.clock(wall_us);
        let mut prev = if hit == 0 { NO_PARENT } else { self.blocks.id_of(tenant, &chain[hit - 1]).expect("counted") };
        for (i, k) in chain.iter().enumerate().skip(hit) {
            if let Some(id) = self.blocks.id_of(tenant, k) {
                prev = id;
                continue;
            }
            self.missed(tenant, k, i as u32, prev);
            prev = NO_PARENT;
        }
        hit
    }

    /// [`Index::lookup`], and a hold on the resident leading blocks it counted: they stay
    /// leased until [`Index::unhold`] of the returned ids (whose holder must call it exactly once).
    pub fn lookup_hold(&mut self, tenant: u32, chain: &[Vec<u8>], wall_us: u64) -> (usize, Vec<u64>) {
        let hit = self.lookup(tenant, chain, wall_us);
        let ids: Vec<u64> =
            chain[..hit].iter().map(|k| self.blocks.id_of(tenant, k).expect("counted as resident")).collect();
        for &id in &ids {
            *self.holds.entry(id).or_insert(0) += 1;
        }
        (hit, ids)
    }

    /// Let go of one hold on each of `ids` (blocks removed since are skipped).
    pub fn unhold(&mut self, ids: &[u64]) {
        for id in ids {
            if let std::collections::hash_map::Entry::Occupied(mut e) = self.holds.entry(*id) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    /// Number of blocks held now.
    pub fn held(&self) -> usize {
        self.holds.len()
    }

    /// The block id of a resident key (no lease, no event).
    pub fn id_of(&self, tenant: u32, key: &[u8]) -> Option<u64> {
        self.blocks.id_of(tenant, key)
    }

    pub fn exists(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<bool> {
        let hashes: SmallVec<[u64; 64]> = keys.iter().map(|k| self.blocks.hash_of(tenant, k)).collect();
        keys.iter().zip(hashes).map(|(k, h)| self.blocks.id_of_hashed(h, tenant, k).is_some()).collect()
    }

    // ---- removal ------------------------------------------------------------------------

    pub fn remove(
        &mut self,
        tenant: u32,
        keys: &[Vec<u8>],
        force: bool,
        now: Instant,
    ) -> (Vec<RemoveStatus>, Vec<Dropped<D>>, Vec<MetaOp>) {
        let (mut dropped, mut meta) = (Vec::new(), Vec::new());
        let st = keys
            .iter()
            .map(|k| {
                let Some(id) = self.blocks.id_of(tenant, k) else { return RemoveStatus::NotFound };
                if !force && self.is_leased(id, now) {
                    return RemoveStatus::Leased;
                }
                let (d, m) = self.drop_block(id, ChangeKind::Removed).expect("indexed block exists");
                dropped.push(d);
                meta.extend(m);
                RemoveStatus::Ok
            })
            .collect();
        (st, dropped, meta)
    }

    /// Remove every block of the tenant whose key `matches`; leased ones stay unless `force`.
    /// Returns (removed, skipped, copies to free, sled removals).
    pub fn remove_all(
        &mut self,
        tenant: u32,
        force: bool,
        now: Instant,
        matches: impl Fn(&[u8]) -> bool,
    ) -> (u64, u64, Vec<Dropped<D>>, Vec<MetaOp>) {
        let ids: Vec<(u64, bool)> = self
            .blocks
            .iter()
            .filter(|(_, b)| b.tenant == tenant && matches(self.blocks.key(b)))
            .map(|(id, _)| (id, self.is_leased(id, now)))
            .collect();
        let (mut removed, mut skipped, mut dropped, mut meta) = (0, 0, Vec::new(), Vec::new());
        for (id, leased) in ids {
            if leased && !force {
                skipped += 1;
                continue;
            }
            let (d, m) = self.drop_block(id, ChangeKind::Removed).expect("listed block exists");
            dropped.push(d);
            meta.extend(m);
            removed += 1;
        }
        (removed, skipped, dropped, meta)
    }

    // ---- eviction -----------------------------------------------------------------------

    /// Blocks an eviction of `tier` must not touch. A lease promises that the block stays
    /// readable, not where: with an SSD tier, a leased DRAM copy may still leave DRAM (demoted,
    /// or dropped when an SSD copy exists); the in-flight bytes are protected by the handle.
    pub fn excluded(&mut self, now: Instant, tier: Tier) -> Vec<u64> {
        self.leases.retain(|_, until| *until > now);
        let mut ex: Vec<u64> = if tier == Tier::Dram && self.has_ssd {
            Vec::new()
        } else {
            self.leases.keys().chain(self.holds.keys()).copied().collect()
        };
        ex.extend(self.moving.iter().copied());
        ex.sort_unstable();
        ex.dedup();
        ex
    }

    /// Keep the proposed victims that may really go, in order, until `bytes` are covered.
    /// `in_use` says whether a DRAM copy is held by a read (its memory would not come free).
    pub fn valid_victims(
        &self,
        proposed: &[u64],
        tier: Tier,
        bytes: u64,
        exclude: &[u64],
        in_use: impl Fn(&D) -> bool,
    ) -> Vec<u64> {
        let mut freed = 0u64;
        let mut valid = Vec::new();
        for &id in proposed {
            if freed >= bytes {
                break;
            }
            let Some(b) = self.blocks.get(id) else { continue };
            let eligible = match tier {
                Tier::Dram => b.dram().is_some_and(|d| !in_use(&d)),
                Tier::Ssd => b.ssd.is_some(),
                Tier::Device => false,
            };
            if !eligible || b.pin == Pin::Hard || b.moving || exclude.binary_search(&id).is_ok() || valid.contains(&id)
            {
                continue;
            }
            freed += b.size();
            valid.push(id);
        }
        valid
    }

    /// The admission question for DRAM victims: which may go to the SSD tier.
    pub fn demotion_batch(&self, victims: &[u64]) -> AdmitBatch {
        victims
            .iter()
            .filter_map(|&id| self.blocks.get(id).map(|b| (id, b)))
            .map(|(id, b)| AdmitRequest {
                id,
                key: key_hash(b.tenant, self.blocks.key(b)),
                size: b.size(),
                tokens: b.tokens,
                seq_tokens: u64::from(b.seq_tokens),
                tier: Tier::Ssd,
                parent: b.parent,
                depth: b.depth,
            })
            .collect()
    }

    /// Resident descendants of `id` in pre-order (`id` first), or `None` when one of them is
    /// leased, in flight or hard-pinned (the chain rule then keeps `id`).
    fn free_subtree(&self, id: u64, now: Instant) -> Option<Vec<u64>> {
        let mut sub = vec![id];
        let mut i = 0;
        while i < sub.len() {
            let b = self.blocks.get(sub[i]).expect("resident");
            for &c in self.kids_of(b) {
                let cb = self.blocks.get(c)?;
                if self.is_leased(c, now) || cb.moving || cb.pin == Pin::Hard {
                    return None;
                }
                sub.push(c);
            }
            i += 1;
        }
        Some(sub)
    }

    /// Hand DRAM victims out as demotions on a node without an SSD tier too: a cluster
    /// storage node offers them to another node's free DRAM, and evicts those no node takes
    /// with [`Index::evict_untaken`].
    pub fn set_offload(&mut self, on: bool) {
        self.offload = on;
    }

    /// A DRAM victim of a node without SSD that no other node took: its demotion ends, and it
    /// is evicted under the rules of [`Index::evict`] as they stand now (a lease taken while it
    /// was offered keeps it; the chain rule takes its descendants along or keeps it).
    pub fn evict_untaken(&mut self, id: u64, now: Instant) -> Evicted<D> {
        self.moving.remove(&id);
        if let Some(b) = self.blocks.get_mut(id).filter(|b| b.moving) {
            b.moving = false;
            // Counted when its demotion started; the eviction below counts it again.
            let t = b.tenant;
            let c = &mut self.tenant_mut(t).evictions[slot(Tier::Dram)];
            *c = c.saturating_sub(1);
        }
        self.evict_with(&[id], Tier::Dram, &[], now, false)
    }

    /// Evict `victims` from `tier`: DRAM victims admitted to SSD (`decisions`, one per row of
    /// [`Index::demotion_batch`]) start a demotion, as do all DRAM victims of a node without
    /// SSD that offers them to other nodes ([`Index::set_offload`]); the others lose their copy
    /// in `tier`, and blocks left with no copy leave the index. Leased blocks are never dropped
    /// from the pool.
    ///
    /// Chain rule: a victim that loses its last copy takes its resident descendants along (every
    /// copy, deepest first, counted in `cascaded`, `Removed` events for each), since a lookup
    /// stops at the first absent block and they could never be hit; when one of them is leased,
    /// in flight or hard-pinned, the victim stays (counted in `refused`).
    pub fn evict(&mut self, victims: &[u64], tier: Tier, decisions: &[Admit], now: Instant) -> Evicted<D> {
        self.evict_with(victims, tier, decisions, now, true)
    }

    fn evict_with(
        &mut self,
        victims: &[u64],
        tier: Tier,
        decisions: &[Admit],
        now: Instant,
        may_demote: bool,
    ) -> Evicted<D> {
        let mut out =
            Evicted { demotions: Vec::new(), dropped: Vec::new(), meta: Vec::new(), gone: 0, cascaded: 0, refused: 0 };
        let named: HashSet<u64> = victims.iter().copied().collect();
        for (row, &id) in victims.iter().enumerate() {
            let Some(b) = self.blocks.get_mut(id) else { continue };
            if !b.has(tier) || b.moving {
                continue;
            }
            let (tenant, size) = (b.tenant, b.size());
            let demote = may_demote
                && tier == Tier::Dram
                && b.ssd.is_none()
                && if self.has_ssd {
                    decisions.get(row).copied() == Some(Admit::Into(Tier::Ssd))
                } else {
                    self.offload
                };
            if demote {
                b.moving = true;
                out.demotions.push((id, b.dram().expect("has a DRAM copy")));
                self.moving.insert(id);
                self.tenant_mut(tenant).evictions[slot(tier)] += 1;
                continue;
            }
            let other_copy = match tier {
                Tier::Dram => b.ssd.is_some(),
                _ => b.dram.is_some(),
            };
            if !other_copy && self.is_leased(id, now) {
                continue;
            }
            if !other_copy {
                let Some(sub) = self.free_subtree(id, now) else {
                    out.refused += 1;
                    continue;
                };
                for &x in sub.iter().rev() {
                    let b = self.blocks.get(x).expect("in the subtree");
                    let (t, in_tier) = (b.tenant, b.has(tier));
                    let copies = [Tier::Dram, Tier::Ssd].map(|k| b.has(k));
                    for (k, has) in copies.into_iter().enumerate() {
                        if has {
                            self.tenant_mut(t).evictions[k] += 1;
                        }
                    }
                    if in_tier {
                        out.gone += 1;
                    }
                    if !named.contains(&x) {
                        out.cascaded += 1;
                    }
                    let (d, m) = self.drop_block(x, ChangeKind::Evicted).expect("exists");
                    out.dropped.push(d);
                    out.meta.extend(m);
                }
                continue;
            }
            out.gone += 1;
            self.tenant_mut(tenant).evictions[slot(tier)] += 1;
            let (b, key) = self.blocks.get_mut_with_key(id).expect("exists");
            let dropped = match tier {
                Tier::Dram => Dropped { dram: b.dram().inspect(|_| b.dram = None), ssd: None },
                _ => {
                    // The SSD copy was the persisted one.
                    out.meta.push(MetaOp::Remove { tenant, key: key.into() });
                    Dropped { dram: None, ssd: b.ssd.take().map(|f| (f, size)) }
                }
            };
            let ev = b.event(key, id, EventKind::Removed, tier);
            self.note_change(id, ChangeKind::Evicted, tier);
            out.dropped.push(dropped);
            self.copy_removed(tenant, tier, size);
            self.emit(ev);
        }
        out
    }

    /// A demotion finished: `written` is the SSD locator of the copy, or `None` when there was
    /// no room or the write failed (the block is then simply evicted).
    /// The record's time becomes the write's (`wall_ms`): recovery gives a contested extent to
    /// the newest record.
    pub fn finish_demotion(&mut self, id: u64, written: Option<u64>, wall_ms: u64) -> Demoted<D> {
        self.moving.remove(&id);
        let Some(b) = self.blocks.get_mut(id).filter(|b| b.moving) else {
            return Demoted::Vanished;
        };
        b.moving = false;
        let (b, key) = self.blocks.get_mut_with_key(id).expect("present");
        let Some(file) = written else {
            return match self.drop_block(id, ChangeKind::Evicted) {
                Some((dropped, meta)) => Demoted::Evicted { dropped, meta },
                None => Demoted::Vanished,
            };
        };
        let (tenant, size) = (b.tenant, b.size());
        let dram = b.dram();
        b.dram = None;
        b.ssd = Locator::some(file);
        let removed = b.event(key, id, EventKind::Removed, Tier::Dram);
        let inserted = b.event(key, id, EventKind::Inserted, Tier::Ssd);
        let key = Box::from(key);
        // The new copy first: a router never sees the block absent while it moves.
        self.note_change(id, ChangeKind::Stored, Tier::Ssd);
        self.note_change(id, ChangeKind::Evicted, Tier::Dram);
        let meta = MetaOp::Put { tenant, key, record: self.record_of(id, wall_ms) };
        self.copy_removed(tenant, Tier::Dram, size);
        self.copy_added(tenant, Tier::Ssd, size);
        self.tenant_mut(tenant).demotions += 1;
        // The policies too hear of the SSD copy first: told of the DRAM copy's removal first,
        // a block with no other copy would leave their trees and come back without its
        // children (a demoted parent would then pass for a leaf of the SSD tier).
        self.emit(inserted);
        self.emit(removed);
        Demoted::Moved { dram, meta }
    }

    /// An SSD copy was read back into DRAM: keep the DRAM copy when the block still has that
    /// SSD copy and no DRAM copy. `Err` gives the copy back (nothing changed).
    pub fn install_promoted(&mut self, id: u64, locator: u64, copy: D) -> Result<(), D> {
        let Some((b, key)) =
            self.blocks.get_mut_with_key(id).filter(|(b, _)| b.dram.is_none() && b.ssd.get() == Some(locator))
        else {
            return Err(copy);
        };
        b.dram = Some(copy.keep());
        let (tenant, size) = (b.tenant, b.size());
        let ev = b.event(key, id, EventKind::Inserted, Tier::Dram);
        self.note_change(id, ChangeKind::Stored, Tier::Dram);
        self.copy_added(tenant, Tier::Dram, size);
        self.tenant_mut(tenant).promotions += 1;
        self.emit(ev);
        Ok(())
    }

    /// Drop an SSD copy whose bytes cannot be trusted (read error or checksum mismatch); the
    /// block goes with it unless it still has a DRAM copy. Never served again.
    /// Count a block of `tenant` found corrupt outside the index's sight (its DRAM bytes
    /// failed their checksum on the way out); the caller removes it.
    pub fn note_corrupt(&mut self, tenant: u32) {
        self.tenant_mut(tenant).corrupt += 1;
    }

    pub fn drop_corrupt(&mut self, id: u64, locator: u64) -> Option<(Dropped<D>, Option<MetaOp>)> {
        let b = self.blocks.get_mut(id).filter(|b| b.ssd.get() == Some(locator))?;
        let (tenant, size) = (b.tenant, b.size());
        self.tenant_mut(tenant).corrupt += 1;
        let (b, key) = self.blocks.get_mut_with_key(id).expect("exists");
        if b.dram.is_none() {
            return self.drop_block(id, ChangeKind::Removed);
        }
        b.ssd = Locator::NONE;
        let ev = b.event(key, id, EventKind::Removed, Tier::Ssd);
        let meta = MetaOp::Remove { tenant, key: key.into() };
        self.note_change(id, ChangeKind::Removed, Tier::Ssd);
        self.copy_removed(tenant, Tier::Ssd, size);
        self.emit(ev);
        Some((Dropped { dram: None, ssd: Some((locator, size)) }, Some(meta)))
    }

    /// Soft pins whose time is up become no pin.
    pub fn expire_soft_pins(&mut self, wall_ms: u64) {
        while let Some(&(until, id)) = self.soft_pins.first() {
            if until > wall_ms {
                break;
            }
            self.soft_pins.pop_first();
            self.pin_until.remove(&id);
            if let Some(b) = self.blocks.get_mut(id) {
                b.pin = Pin::None;
                self.emit(Event::pin_changed(id, Pin::None));
            }
        }
    }

    // ---- policy snapshot ----------------------------------------------------------------

    /// Block `id` described as a change of its DRAM copy (tenant, key, parent key, size), for a
    /// host that moves the block elsewhere.
    pub fn describe(&self, id: u64) -> Option<Change> {
        self.blocks.get(id).map(|_| self.change_of(id, ChangeKind::Stored, Tier::Dram))
    }

    /// Every copy the index holds, as `Stored` changes (tenant, key, parent key, tier, size):
    /// what a storage node announces to a master that does not know it yet.
    pub fn inventory(&self) -> Vec<Change> {
        let mut out = Vec::with_capacity(self.blocks.len());
        for (_, b) in self.blocks.slots() {
            for tier in [Tier::Dram, Tier::Ssd] {
                if b.has(tier) {
                    out.push(self.change_of(b.id, ChangeKind::Stored, tier));
                }
            }
        }
        out
    }

    /// The warm snapshot a new policy starts from: the recent misses the index remembers as
    /// `Missed` events, oldest first (with the count of each key's remembered misses), then the
    /// block set as `Inserted` events, one per copy, least recently used first, every parent
    /// before its children (so a policy that tracks chains sees consistent links), each with
    /// its key hash, depth, count of requests and last access.
    pub fn snapshot(&self) -> Events {
        let blocks = &self.blocks;
        let mut ev = Events::new();
        ev.reserve(blocks.len() + self.misses.log.len());
        for &(hash, depth, parent, time) in &self.misses.log {
            // The parent a miss named may have gone since: name only resident ones.
            let parent = if blocks.contains(parent) { parent } else { NO_PARENT };
            let count = self.misses.count(hash).max(1);
            ev.push(Event::missed(hash, depth, parent).with_count(count).with_time(time));
        }
        // Walk by slot: a scratch array marks the blocks already sent.
        // Recovered blocks are stamped with their records' times: they come first, in that
        // order, then ids.
        let mut order: Vec<(Stamp, u64, usize)> = blocks.slots().map(|(s, b)| (b.stamp, b.id, s)).collect();
        order.sort_unstable();
        let mut done = vec![false; blocks.slot_bound()];
        let mut stack = Vec::new();
        for (.., s) in order {
            let mut cur = s;
            while !done[cur] {
                stack.push(cur);
                let p = blocks.at_slot(cur).expect("a block's slot").parent;
                if p == NO_PARENT || stack.len() > blocks.len() {
                    break;
                }
                match blocks.slot_of(p) {
                    Some(ps) => cur = ps,
                    None => break,
                }
            }
            while let Some(x) = stack.pop() {
                if std::mem::replace(&mut done[x], true) {
                    continue;
                }
                let b = blocks.at_slot(x).expect("stacked");
                if b.ssd.is_some() {
                    ev.push(b.event(blocks.key(b), b.id, EventKind::Inserted, Tier::Ssd).with_time(b.stamp.us()));
                }
                if b.dram.is_some() {
                    ev.push(b.event(blocks.key(b), b.id, EventKind::Inserted, Tier::Dram).with_time(b.stamp.us()));
                }
            }
        }
        ev
    }
}

impl<D: CopyHandle> crate::IndexView for Index<D> {
    fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64> {
        let b = self.blocks.get(id)?;
        b.has(tier).then_some(b.size())
    }

    fn pin(&self, id: u64) -> Pin {
        self.blocks.get(id).map_or(Pin::None, |b| b.pin)
    }

    fn evictable_bytes(&self, tier: Tier, exclude: &[u64]) -> u64 {
        self.blocks
            .iter()
            .filter(|(id, b)| b.pin != Pin::Hard && exclude.binary_search(id).is_err() && b.has(tier))
            .map(|(_, b)| b.size())
            .sum()
    }

    fn resident_children(&self, id: u64) -> Vec<u64> {
        self.blocks.get(id).map(|b| self.kids_of(b).to_vec()).unwrap_or_default()
    }

    fn snapshot(&self) -> Events {
        Index::snapshot(self)
    }
}
