//! The block index of one pool node: which blocks exist, their chains, leases, pins and copies.
//!
//! No I/O and no clock: the caller passes `now` (monotonic, for leases) and `wall_ms` (wall
//! clock, for pins and records). Copies are opaque handles: `D` for a DRAM copy (the server's
//! reference-counted segment range), a `u64` locator for an SSD copy. Whatever must happen
//! outside (free a copy, delete a file, write sled) is returned to the caller as data.
//!
//! By concern: this file holds the table, its bookkeeping and removal; [`put`] plans and
//! publishes blocks, [`reads`] serves gets and lookups, [`leases`] keeps blocks from leaving,
//! [`evict`] makes room, [`chains`] links blocks to their parents, [`recover`] rebuilds from
//! persisted records, [`view`] is what policies and routers are shown.

mod chains;
// Their types are named by these paths (lib.rs re-exports them): the index's own file imports
// nothing from the files that implement it, so the imports run one way.
pub(crate) mod evict;
mod leases;
pub(crate) mod put;
mod reads;
pub(crate) mod recover;
mod view;

use crate::blocks::{BlockRecord, CopyHandle, Stamp};
use crate::changes::{Change, ChangeKind};
use crate::effects::{Dropped, MetaOp};
use crate::table::Blocks;
use kvpool_policy_sdk::{key_hash, Event, EventKind, Events, Pin, Tier, NO_PARENT};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

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

/// The block index.
pub struct Index<D: CopyHandle> {
    /// Keyed with SipHash (std's randomly keyed hasher): keys are chosen by clients.
    blocks: Blocks<D>,
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

    /// A KV event about block `id`'s copy in `tier` (the block is indexed).
    fn change_of(&self, id: u64, kind: ChangeKind, tier: Tier) -> Change {
        let b = self.blocks.get(id).expect("an indexed block");
        b.change(self.blocks.key(b), kind, tier, self.parent_key(id, b))
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
        b.record(self.parent_key(id, b).as_deref(), until, created_ms)
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

    /// Take a block out of the index: its copies for the caller to free, and the removal of its
    /// record when it had one (only blocks with an SSD copy have one).
    fn drop_block(&mut self, id: u64, why: ChangeKind) -> Option<(Dropped<D>, Option<MetaOp>)> {
        let parent_key =
            self.changes.is_some().then(|| self.blocks.get(id).and_then(|b| self.parent_key(id, b))).flatten();
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
}
