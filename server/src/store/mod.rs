//! The block store of one node: index, tiers, leases, pins and the policies that decide
//! admission and eviction.
//!
//! Concurrency: one mutex guards the index and the policies; block bytes are copied outside it.
//! A put is two-phase: `reserve` hands out an exclusively owned DRAM range, the caller streams
//! the bytes into it, `commit` publishes it (index, then sled). Readers clone the block's
//! `Arc<DramBlock>`, so memory is never freed under an in-flight read.

pub mod dram;
pub mod meta;
pub mod ssd;

pub use dram::DramBlock;

use crate::metrics::Metrics;
use crate::policy::{AdmissionSlot, BlockOracle, EvictionSlot, NewSlot, PlacementSlot};
use dram::DramTier;
use kvpool_policy_sdk::{
    Admit, AdmitBatch, AdmitRequest, Event, EventKind, Events, NodeSet, Pin, PlaceBatch, Tier, NO_PARENT,
};
use kvpool_proto::{ErrorCode, PinSpec, PutMode};
use meta::{BlockRecord, Meta};
use parking_lot::Mutex;
use ssd::SsdTier;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tracing::{debug, warn};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Meta(#[from] meta::MetaError),
    #[error(transparent)]
    Ssd(#[from] ssd::SsdError),
    #[error(transparent)]
    Segment(#[from] dram::SegmentAllocError),
}

/// Settings the store needs (a slice of the server config).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub data_dir: PathBuf,
    pub dram_bytes: u64,
    pub dram_high: f64,
    pub dram_low: f64,
    pub ssd_dir: Option<PathBuf>,
    pub ssd_bytes: u64,
    pub ssd_high: f64,
    pub ssd_low: f64,
    pub ssd_fsync: bool,
    pub lease_ttl: Duration,
    pub soft_pin_ttl: Duration,
    pub put_wait: Duration,
    pub promote_on_hit: bool,
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

struct Block {
    tenant: u32,
    key: Box<[u8]>,
    size: u64,
    tokens: u32,
    seq_tokens: u64,
    parent_key: Option<Box<[u8]>>,
    parent: u64,
    checksum: u64,
    created_ms: u64,
    pin: Pin,
    pin_until_ms: u64,
    lease_until: Option<Instant>,
    dram: Option<Arc<DramBlock>>,
    ssd: Option<u64>,
    /// A demotion of this block is in flight.
    moving: bool,
    /// Recency tick of the last insert or read (orders the snapshot a new policy is fed).
    last_access: u64,
}

impl Block {
    fn record(&self) -> BlockRecord {
        BlockRecord {
            size: self.size,
            tokens: self.tokens,
            seq_tokens: self.seq_tokens,
            parent: self.parent_key.as_ref().map(|p| p.to_vec()),
            checksum: self.checksum,
            created_ms: self.created_ms,
            pin: self.pin as u8,
            pin_until_ms: self.pin_until_ms,
            ssd_file: self.ssd,
            in_dram: self.dram.is_some(),
        }
    }

    fn leased(&self, now: Instant) -> bool {
        self.lease_until.is_some_and(|t| t > now)
    }

    fn event(&self, id: u64, kind: EventKind, tier: Tier) -> Event {
        Event { kind, id, size: self.size, tokens: self.tokens, tier, parent: self.parent, pin: self.pin }
    }
}

type ScopedKey = (u32, Box<[u8]>);

struct State {
    by_key: HashMap<ScopedKey, u64>,
    blocks: HashMap<u64, Block>,
    next_id: u64,
    /// Ids with a lease that may still be running (expired ones are pruned lazily).
    leased: BTreeSet<u64>,
    /// Ids with a demotion in flight (kept apart so eviction need not scan every block).
    moving: BTreeSet<u64>,
    soft_pins: BTreeSet<(u64, u64)>,
    events: Events,
    eviction: EvictionSlot,
    admission: AdmissionSlot,
    placement: PlacementSlot,
    /// While a policy swap is warming up: copies of every event since its snapshot.
    tap: Option<Events>,
    tick: u64,
    dram_blocks: u64,
    ssd_blocks: u64,
    /// Per-tenant residency and counters, for tenant-scoped `stats`.
    tenants: HashMap<u32, TenantCounters>,
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

fn tier_slot(tier: Tier) -> usize {
    usize::from(tier == Tier::Ssd)
}

fn footprint(tier: Tier, size: u64) -> u64 {
    match tier {
        Tier::Ssd => ssd::SsdTier::footprint(size),
        _ => DramTier::footprint(size),
    }
}

impl State {
    fn tenant_mut(&mut self, tenant: u32) -> &mut TenantCounters {
        self.tenants.entry(tenant).or_default()
    }

    /// A copy of a block entered `tier`.
    fn copy_added(&mut self, tenant: u32, tier: Tier, size: u64) {
        match tier {
            Tier::Ssd => self.ssd_blocks += 1,
            _ => self.dram_blocks += 1,
        }
        let t = self.tenant_mut(tenant);
        t.blocks[tier_slot(tier)] += 1;
        t.bytes[tier_slot(tier)] += footprint(tier, size);
    }

    /// A copy of a block left `tier`.
    fn copy_removed(&mut self, tenant: u32, tier: Tier, size: u64) {
        match tier {
            Tier::Ssd => self.ssd_blocks -= 1,
            _ => self.dram_blocks -= 1,
        }
        let t = self.tenant_mut(tenant);
        t.blocks[tier_slot(tier)] -= 1;
        t.bytes[tier_slot(tier)] -= footprint(tier, size);
    }

    fn emit(&mut self, e: Event) {
        if let Some(t) = &mut self.tap {
            t.push(e);
        }
        self.events.push(e);
        if self.events.len() >= 4096 {
            self.flush_events();
        }
    }

    fn flush_events(&mut self) {
        if !self.events.is_empty() {
            let ev = std::mem::take(&mut self.events);
            self.eviction.on_events(&ev);
            self.admission.on_events(&ev);
            self.placement.on_events(&ev);
            self.events = ev;
            self.events.clear();
        }
    }

    /// Blocks an eviction of `tier` must not touch. A lease promises that the block stays
    /// readable, not where: when an SSD tier exists, a leased DRAM copy may still leave DRAM
    /// (demoted, or dropped when it already has an SSD copy); the in-flight bytes themselves are
    /// protected by reference counting.
    fn excluded(&mut self, now: Instant, tier: Tier, has_ssd: bool) -> Vec<u64> {
        let blocks = &self.blocks;
        self.leased.retain(|id| blocks.get(id).is_some_and(|b| b.leased(now)));
        let mut ex: Vec<u64> =
            if tier == Tier::Dram && has_ssd { Vec::new() } else { self.leased.iter().copied().collect() };
        ex.extend(self.moving.iter().copied());
        ex.sort_unstable();
        ex.dedup();
        ex
    }
}

/// What a put item will do, decided before its bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutPlan {
    /// Stream into DRAM under this pre-assigned id.
    Dram(u64),
    /// Stream straight into the SSD tier (admission asked for it).
    Ssd(u64),
    /// Do not store; discard the bytes and answer this status.
    Skip(ErrorCode),
}

/// A located block for a get, resolved under the lock and read outside it.
pub enum GetPlan {
    Dram { block: Arc<DramBlock>, checksum: u64 },
    Ssd { id: u64, file: u64, size: u64, checksum: u64 },
    Missing,
}

/// Bytes of one get item, ready to send.
pub enum Served {
    /// Served from a DRAM range (also after a promotion; the tier says where it came from).
    Dram(Arc<DramBlock>, u64, Tier),
    Owned(Vec<u8>, u64, Tier),
}

impl Served {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Served::Dram(b, _, _) => b.bytes(),
            Served::Owned(v, _, _) => v,
        }
    }
    pub fn checksum(&self) -> u64 {
        match self {
            Served::Dram(_, c, _) | Served::Owned(_, c, _) => *c,
        }
    }
    pub fn tier(&self) -> Tier {
        match self {
            Served::Dram(_, _, t) | Served::Owned(_, _, t) => *t,
        }
    }
}

pub struct Store {
    pub cfg: StoreConfig,
    dram: Arc<DramTier>,
    ssd: Option<Arc<SsdTier>>,
    meta: Meta,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
    /// Wakes the background evictor early (a put pushed usage past the high watermark).
    pub kick: tokio::sync::Notify,
}

/// A DRAM copy leaving for the SSD tier.
struct Demotion {
    id: u64,
    block: Arc<DramBlock>,
}

pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

impl Store {
    pub fn open(
        cfg: StoreConfig,
        metrics: Arc<Metrics>,
        eviction: EvictionSlot,
        admission: AdmissionSlot,
    ) -> Result<Arc<Store>, StoreError> {
        let meta = Meta::open(&cfg.data_dir.join("meta"))?;
        let dram = DramTier::new(cfg.dram_bytes)?;
        let (ssd, files) = match (&cfg.ssd_dir, cfg.ssd_bytes) {
            (Some(dir), cap) if cap > 0 => {
                let (t, files) = SsdTier::open(dir, cap, cfg.ssd_fsync)?;
                (Some(Arc::new(t)), files)
            }
            _ => (None, Vec::new()),
        };
        let mut state = State {
            by_key: HashMap::new(),
            blocks: HashMap::new(),
            next_id: 1,
            leased: BTreeSet::new(),
            moving: BTreeSet::new(),
            soft_pins: BTreeSet::new(),
            events: Events::new(),
            eviction,
            admission,
            placement: PlacementSlot::Default,
            tap: None,
            tick: 0,
            dram_blocks: 0,
            ssd_blocks: 0,
            tenants: HashMap::new(),
        };
        // Recovery: only SSD copies survive a restart, and only when their file is complete.
        let files: HashMap<u64, u64> = files.into_iter().collect();
        let mut kept_files = std::collections::HashSet::new();
        let (mut kept, mut dropped) = (0u64, 0u64);
        for (tenant, key, rec) in meta.all() {
            let usable = match (&rec, &ssd) {
                (Some(r), Some(_)) => r.ssd_file.is_some_and(|f| files.get(&f) == Some(&r.size)),
                _ => false,
            };
            let Some(r) = rec.filter(|_| usable) else {
                meta.remove(tenant, &key)?;
                dropped += 1;
                continue;
            };
            let id = state.next_id;
            state.next_id += 1;
            let file = r.ssd_file.unwrap_or_default();
            kept_files.insert(file);
            if let Some(s) = &ssd {
                s.adopt(r.size);
            }
            let pin = match Pin::from_u8(r.pin).unwrap_or(Pin::None) {
                Pin::Soft if r.pin_until_ms <= wall_ms() => Pin::None,
                p => p,
            };
            if pin == Pin::Soft {
                state.soft_pins.insert((r.pin_until_ms, id));
            }
            let key: Box<[u8]> = key.into();
            state.by_key.insert((tenant, key.clone()), id);
            state.blocks.insert(
                id,
                Block {
                    tenant,
                    key,
                    size: r.size,
                    tokens: r.tokens,
                    seq_tokens: r.seq_tokens,
                    parent_key: r.parent.map(Into::into),
                    parent: NO_PARENT,
                    checksum: r.checksum,
                    created_ms: r.created_ms,
                    pin,
                    pin_until_ms: r.pin_until_ms,
                    lease_until: None,
                    dram: None,
                    ssd: Some(file),
                    moving: false,
                    last_access: 0,
                },
            );
            if r.in_dram {
                // The DRAM copy is gone with the old process.
                let b = &state.blocks[&id];
                meta.put(tenant, &b.key, &b.record())?;
            }
            state.copy_added(tenant, Tier::Ssd, r.size);
            state.tenant_mut(tenant).resident += 1;
            kept += 1;
        }
        if let Some(s) = &ssd {
            for f in files.keys().filter(|f| !kept_files.contains(f)) {
                s.delete(*f);
            }
        }
        // Parent links, then feed the policies the recovered block set (parents first).
        let links: Vec<(u64, u64)> = state
            .blocks
            .iter()
            .filter_map(|(&id, b)| {
                let pk = b.parent_key.as_ref()?;
                let pid = *state.by_key.get(&(b.tenant, pk.clone()))?;
                Some((id, pid))
            })
            .collect();
        for (id, pid) in links {
            if let Some(b) = state.blocks.get_mut(&id) {
                b.parent = pid;
            }
        }
        // The same parents-first ordering a policy swap replays.
        let recovered = snapshot(&state.blocks);
        state.eviction.on_events(&recovered);
        state.admission.on_events(&recovered);
        if kept + dropped > 0 {
            tracing::info!(kept, dropped, "recovered block index from sled (SSD copies kept, DRAM copies dropped)");
        }
        let store = Arc::new(Store {
            cfg,
            dram,
            ssd,
            meta,
            state: Mutex::new(state),
            metrics,
            kick: tokio::sync::Notify::new(),
        });
        store.update_gauges();
        Ok(store)
    }

    /// DRAM bytes allocated, reservations of puts in flight included.
    pub fn dram_used(&self) -> u64 {
        self.dram.used()
    }

    pub fn dram_capacity(&self) -> u64 {
        self.dram.capacity()
    }

    pub fn update_gauges(&self) {
        let m = &self.metrics;
        m.bytes_used.with_label_values(&["dram"]).set(self.dram.used() as i64);
        m.capacity.with_label_values(&["dram"]).set(self.dram.capacity() as i64);
        if let Some(s) = &self.ssd {
            m.bytes_used.with_label_values(&["ssd"]).set(s.used() as i64);
            m.capacity.with_label_values(&["ssd"]).set(s.capacity() as i64);
        }
        let st = self.state.lock();
        m.blocks.with_label_values(&["dram"]).set(st.dram_blocks as i64);
        m.blocks.with_label_values(&["ssd"]).set(st.ssd_blocks as i64);
    }

    /// One tenant's residency and counters (zero for a tenant that never stored anything).
    pub fn tenant_counters(&self, tenant: u32) -> TenantCounters {
        self.state.lock().tenants.get(&tenant).cloned().unwrap_or_default()
    }

    /// (blocks, dram blocks, ssd blocks)
    pub fn counts(&self) -> (u64, u64, u64) {
        let st = self.state.lock();
        (st.blocks.len() as u64, st.dram_blocks, st.ssd_blocks)
    }

    pub fn tier_usage(&self) -> Vec<(Tier, u64, u64)> {
        let mut v = vec![(Tier::Dram, self.dram.capacity(), self.dram.used())];
        if let Some(s) = &self.ssd {
            v.push((Tier::Ssd, s.capacity(), s.used()));
        }
        v
    }

    // ---- put -------------------------------------------------------------------------------

    /// Decide every item of a put before any byte is read: existing keys, admission.
    pub fn plan_put(&self, tenant: u32, items: &[kvpool_proto::PutItem], mode: PutMode) -> Vec<PutPlan> {
        let mut st = self.state.lock();
        st.flush_events();
        let mut plans = vec![PutPlan::Skip(ErrorCode::Internal); items.len()];
        let mut batch = AdmitBatch::default();
        let mut asked = Vec::new();
        for (i, it) in items.iter().enumerate() {
            if mode == PutMode::Insert && st.by_key.contains_key(&(tenant, it.key.clone().into_boxed_slice())) {
                plans[i] = PutPlan::Skip(ErrorCode::AlreadyExists);
                continue;
            }
            if DramTier::footprint(it.size) > self.dram.capacity() {
                plans[i] = PutPlan::Skip(ErrorCode::NoSpace);
                continue;
            }
            let id = st.next_id;
            st.next_id += 1;
            let parent =
                it.parent.as_ref().and_then(|p| st.by_key.get(&(tenant, p.clone().into_boxed_slice())).copied());
            batch.push(AdmitRequest {
                id,
                size: it.size,
                tokens: it.tokens,
                seq_tokens: it.seq_tokens,
                tier: Tier::Dram,
                parent: parent.unwrap_or(NO_PARENT),
            });
            asked.push((i, id));
        }
        if asked.is_empty() {
            return plans;
        }
        let decisions = st.admission.admit(&batch);
        let placed = self.place(&mut st, &batch);
        drop(st);
        for (n, (i, id)) in asked.into_iter().enumerate() {
            let decision = match decisions.get(n).copied().unwrap_or(Admit::Into(Tier::Dram)) {
                Admit::Into(_) if placed.get(n).is_some() => Admit::Into(placed[n]),
                d => d,
            };
            plans[i] = match decision {
                Admit::Reject => {
                    self.metrics.rejected_puts.with_label_values(&["admission"]).inc();
                    self.state.lock().tenant_mut(tenant).rejected += 1;
                    PutPlan::Skip(ErrorCode::Rejected)
                }
                Admit::Into(Tier::Ssd) if self.ssd.is_some() => PutPlan::Ssd(id),
                Admit::Into(_) => PutPlan::Dram(id),
            };
        }
        plans
    }

    /// Tier per new block from a placement module (this node is the only node), if one is loaded.
    fn place(&self, st: &mut State, batch: &AdmitBatch) -> Vec<Tier> {
        if matches!(st.placement, PlacementSlot::Default) {
            return Vec::new();
        }
        let mut pb = PlaceBatch::default();
        for r in batch.iter() {
            pb.id.push(r.id);
            pb.size.push(r.size);
            pb.tokens.push(r.tokens);
            pb.parent.push(r.parent);
            pb.parent_node.push(if r.parent == NO_PARENT { kvpool_policy_sdk::NO_NODE } else { 0 });
            pb.tier.push(Tier::Dram as u8);
        }
        let mut nodes = NodeSet::default();
        let ssd_free = self.ssd.as_ref().map_or(0, |s| s.capacity().saturating_sub(s.used()));
        nodes.push(0, [0, self.dram.capacity().saturating_sub(self.dram.used()), ssd_free], 0);
        let Some(p) = st.placement.place(&pb, &nodes) else { return Vec::new() };
        p.tier
            .iter()
            .take(batch.len())
            .map(|&t| match Tier::from_u8(t) {
                Some(Tier::Ssd) if self.ssd.is_some() => Tier::Ssd,
                _ => Tier::Dram,
            })
            .collect()
    }

    /// Reserve DRAM for `len` bytes, evicting and then waiting for space until `deadline`.
    pub async fn reserve(&self, tenant: u32, len: u64, deadline: tokio::time::Instant) -> Result<DramBlock, ErrorCode> {
        loop {
            let notified = self.dram.freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(b) = self.dram.allocate(len) {
                if self.dram.used() as f64 > self.cfg.dram_high * self.dram.capacity() as f64 {
                    self.kick.notify_one();
                }
                return Ok(b);
            }
            // Free at least this block's room (more when fragmentation defeats the first round).
            let need = DramTier::footprint(len).max(self.dram.capacity() / 64);
            if self.evict(Tier::Dram, need).await > 0 {
                continue;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                self.metrics.rejected_puts.with_label_values(&["no_space"]).inc();
                self.state.lock().tenant_mut(tenant).rejected += 1;
                return Err(ErrorCode::NoSpace);
            }
        }
    }

    /// Publish a filled DRAM block. `AlreadyExists` / `Leased` when the key changed meanwhile.
    pub fn commit(
        &self,
        tenant: u32,
        id: u64,
        item: &kvpool_proto::PutItem,
        mode: PutMode,
        block: DramBlock,
    ) -> ErrorCode {
        let sum = checksum(block.bytes());
        self.commit_copy(tenant, id, item, mode, sum, Some(Arc::new(block)), None)
    }

    /// Publish a block whose bytes went straight to the SSD tier.
    pub async fn commit_ssd(
        &self,
        tenant: u32,
        id: u64,
        item: &kvpool_proto::PutItem,
        mode: PutMode,
        data: Vec<u8>,
    ) -> ErrorCode {
        let Some(ssd) = self.ssd.clone() else { return ErrorCode::NoSpace };
        if !self.reserve_ssd(item.size).await {
            self.metrics.rejected_puts.with_label_values(&["no_space"]).inc();
            self.state.lock().tenant_mut(tenant).rejected += 1;
            return ErrorCode::NoSpace;
        }
        let file = ssd.new_file_id();
        let sum = checksum(&data);
        let s2 = ssd.clone();
        let written = tokio::task::spawn_blocking(move || s2.write(file, &data)).await;
        if !matches!(written, Ok(Ok(()))) {
            warn!(?written, "ssd write failed");
            ssd.release(item.size);
            ssd.delete(file);
            return ErrorCode::Internal;
        }
        let code = self.commit_copy(tenant, id, item, mode, sum, None, Some(file));
        if code != ErrorCode::Ok {
            ssd.release(item.size);
            ssd.delete(file);
        }
        code
    }

    #[allow(clippy::too_many_arguments)]
    fn commit_copy(
        &self,
        tenant: u32,
        id: u64,
        item: &kvpool_proto::PutItem,
        mode: PutMode,
        sum: u64,
        dram: Option<Arc<DramBlock>>,
        ssd: Option<u64>,
    ) -> ErrorCode {
        let now = Instant::now();
        let mut st = self.state.lock();
        let skey: ScopedKey = (tenant, item.key.clone().into_boxed_slice());
        let mut old_file = None;
        if let Some(&old) = st.by_key.get(&skey) {
            match mode {
                PutMode::Insert => return ErrorCode::AlreadyExists,
                PutMode::Upsert => {
                    if st.blocks.get(&old).is_some_and(|b| b.leased(now)) {
                        return ErrorCode::Leased;
                    }
                    old_file = self.drop_block(&mut st, old);
                }
            }
        }
        let parent = item.parent.as_ref().and_then(|p| st.by_key.get(&(tenant, p.clone().into_boxed_slice())).copied());
        let (pin, pin_until_ms) = match item.pin {
            PinSpec::None => (Pin::None, 0),
            PinSpec::Hard => (Pin::Hard, 0),
            PinSpec::Soft { ttl_ms } => {
                let ttl = if ttl_ms == 0 { self.cfg.soft_pin_ttl.as_millis() as u64 } else { ttl_ms };
                (Pin::Soft, wall_ms().saturating_add(ttl))
            }
        };
        let block = Block {
            tenant,
            key: skey.1.clone(),
            size: item.size,
            tokens: item.tokens,
            seq_tokens: item.seq_tokens,
            parent_key: item.parent.clone().map(Into::into),
            parent: parent.unwrap_or(NO_PARENT),
            checksum: sum,
            created_ms: wall_ms(),
            pin,
            pin_until_ms,
            lease_until: None,
            dram,
            ssd,
            moving: false,
            last_access: st.tick + 1,
        };
        st.tick += 1;
        if let Err(e) = self.meta.put(tenant, &block.key, &block.record()) {
            warn!(error = %e, "metadata write failed; put refused");
            return ErrorCode::Internal;
        }
        let tier = if block.dram.is_some() { Tier::Dram } else { Tier::Ssd };
        let ev = block.event(id, EventKind::Inserted, tier);
        st.copy_added(tenant, tier, item.size);
        st.tenant_mut(tenant).resident += 1;
        if pin == Pin::Soft {
            st.soft_pins.insert((pin_until_ms, id));
        }
        st.by_key.insert(skey, id);
        st.blocks.insert(id, block);
        st.emit(ev);
        drop(st);
        if let (Some((f, _)), Some(s)) = (old_file, &self.ssd) {
            s.delete(f);
        }
        ErrorCode::Ok
    }

    /// Remove a block from the index and sled; returns its SSD file to delete (after unlock).
    fn drop_block(&self, st: &mut State, id: u64) -> Option<(u64, u64)> {
        let b = st.blocks.remove(&id)?;
        st.by_key.remove(&(b.tenant, b.key.clone()));
        st.tenant_mut(b.tenant).resident -= 1;
        st.leased.remove(&id);
        st.moving.remove(&id);
        if b.pin == Pin::Soft {
            st.soft_pins.remove(&(b.pin_until_ms, id));
        }
        if let Err(e) = self.meta.remove(b.tenant, &b.key) {
            warn!(error = %e, "metadata remove failed");
        }
        if b.dram.is_some() {
            st.copy_removed(b.tenant, Tier::Dram, b.size);
            st.emit(b.event(id, EventKind::Removed, Tier::Dram));
        }
        if let Some(f) = b.ssd {
            st.copy_removed(b.tenant, Tier::Ssd, b.size);
            st.emit(b.event(id, EventKind::Removed, Tier::Ssd));
            if let Some(s) = &self.ssd {
                s.release(b.size);
            }
            return Some((f, b.size));
        }
        None
    }

    // ---- eviction ------------------------------------------------------------------------

    /// Free at least `bytes` of `tier` (DRAM copies are demoted to SSD when the SSD tier and
    /// the admission policy take them). Returns the number of copies that left the tier.
    pub async fn evict(&self, tier: Tier, bytes: u64) -> usize {
        let now = Instant::now();
        let mut demotions = Vec::new();
        let mut files = Vec::new();
        let mut gone = 0;
        {
            let mut st = self.state.lock();
            st.flush_events();
            let exclude = st.excluded(now, tier, self.ssd.is_some());
            let State { eviction, blocks, .. } = &mut *st;
            let chosen = eviction.victims(&Oracle { blocks }, tier, bytes, &exclude);
            let mut freed = 0u64;
            let mut valid = Vec::new();
            for id in chosen {
                if freed >= bytes {
                    break;
                }
                let Some(b) = st.blocks.get(&id) else { continue };
                let in_tier = match tier {
                    Tier::Dram => b.dram.as_ref().is_some_and(|d| Arc::strong_count(d) == 1),
                    Tier::Ssd => b.ssd.is_some(),
                    Tier::Device => false,
                };
                if !in_tier || b.pin == Pin::Hard || b.moving || exclude.binary_search(&id).is_ok() {
                    debug!(id, "eviction policy proposed an ineligible victim; skipped");
                    continue;
                }
                freed += b.size;
                valid.push(id);
            }
            // Which DRAM victims go to SSD: asked of admission in one batch.
            let to_ssd: Vec<bool> = if tier == Tier::Dram && self.ssd.is_some() {
                let batch: AdmitBatch = valid
                    .iter()
                    .map(|id| {
                        let b = &st.blocks[id];
                        AdmitRequest {
                            id: *id,
                            size: b.size,
                            tokens: b.tokens,
                            seq_tokens: b.seq_tokens,
                            tier: Tier::Ssd,
                            parent: b.parent,
                        }
                    })
                    .collect();
                let d = st.admission.admit(&batch);
                valid
                    .iter()
                    .enumerate()
                    .map(|(i, id)| st.blocks[id].ssd.is_none() && d.get(i).copied() == Some(Admit::Into(Tier::Ssd)))
                    .collect()
            } else {
                vec![false; valid.len()]
            };
            for (id, demote) in valid.into_iter().zip(to_ssd) {
                if demote {
                    self.metrics.evictions.with_label_values(&[tier.name()]).inc();
                    let b = st.blocks.get_mut(&id).expect("validated above");
                    b.moving = true;
                    let tenant = b.tenant;
                    demotions.push(Demotion { id, block: b.dram.clone().expect("validated above") });
                    st.moving.insert(id);
                    st.tenant_mut(tenant).evictions[tier_slot(tier)] += 1;
                    continue;
                }
                let b = st.blocks.get_mut(&id).expect("validated above");
                let (tenant, size) = (b.tenant, b.size);
                let other_copy = match tier {
                    Tier::Dram => b.ssd.is_some(),
                    _ => b.dram.is_some(),
                };
                if !other_copy && b.leased(now) {
                    // Would drop a leased block from the pool: keep it.
                    continue;
                }
                gone += 1;
                self.metrics.evictions.with_label_values(&[tier.name()]).inc();
                if !other_copy {
                    st.tenant_mut(tenant).evictions[tier_slot(tier)] += 1;
                    if let Some(f) = self.drop_block(&mut st, id) {
                        files.push(f.0);
                    }
                    continue;
                }
                let ev = match tier {
                    Tier::Dram => {
                        b.dram = None;
                        b.event(id, EventKind::Removed, Tier::Dram)
                    }
                    _ => {
                        files.push(b.ssd.take().expect("checked"));
                        if let Some(s) = &self.ssd {
                            s.release(b.size);
                        }
                        b.event(id, EventKind::Removed, Tier::Ssd)
                    }
                };
                let (tenant, key, rec) = (b.tenant, b.key.clone(), b.record());
                let _ = self.meta.put(tenant, &key, &rec);
                st.copy_removed(tenant, tier, size);
                st.tenant_mut(tenant).evictions[tier_slot(tier)] += 1;
                st.emit(ev);
            }
        }
        if let Some(s) = &self.ssd {
            for f in files {
                s.delete(f);
            }
        }
        for d in demotions {
            if self.demote(d).await {
                gone += 1;
            }
        }
        gone
    }

    async fn reserve_ssd(&self, len: u64) -> bool {
        let Some(ssd) = &self.ssd else { return false };
        for _ in 0..4 {
            if ssd.try_reserve(len) {
                return true;
            }
            let need = ssd::SsdTier::footprint(len).max(ssd.capacity() / 64);
            if Box::pin(self.evict(Tier::Ssd, need)).await == 0 {
                break;
            }
        }
        false
    }

    /// Copy a DRAM victim to SSD, then drop its DRAM copy. When SSD has no room the block is
    /// simply evicted. Returns whether the DRAM copy left.
    async fn demote(&self, d: Demotion) -> bool {
        let Some(ssd) = self.ssd.clone() else { return false };
        let size = d.block.len();
        let file = ssd.new_file_id();
        let ok = if self.reserve_ssd(size).await {
            let (s2, data) = (ssd.clone(), d.block.clone());
            let r = tokio::task::spawn_blocking(move || s2.write(file, data.bytes())).await;
            if !matches!(r, Ok(Ok(()))) {
                warn!(?r, "demotion write failed; block evicted instead");
                ssd.release(size);
                ssd.delete(file);
                false
            } else {
                true
            }
        } else {
            false
        };
        drop(d.block);
        let mut st = self.state.lock();
        st.moving.remove(&d.id);
        let Some(b) = st.blocks.get_mut(&d.id).filter(|b| b.moving) else {
            // Removed or replaced while moving.
            if ok {
                ssd.release(size);
                ssd.delete(file);
            }
            return true;
        };
        b.moving = false;
        if !ok {
            // Nowhere to demote to: plain eviction (the block never had an SSD copy).
            self.drop_block(&mut st, d.id);
            return true;
        }
        b.dram = None;
        b.ssd = Some(file);
        let (tenant, key, rec) = (b.tenant, b.key.clone(), b.record());
        let removed = b.event(d.id, EventKind::Removed, Tier::Dram);
        let inserted = b.event(d.id, EventKind::Inserted, Tier::Ssd);
        if let Err(e) = self.meta.put(tenant, &key, &rec) {
            warn!(error = %e, "metadata write failed during demotion");
        }
        st.copy_removed(tenant, Tier::Dram, size);
        st.copy_added(tenant, Tier::Ssd, size);
        st.tenant_mut(tenant).demotions += 1;
        st.emit(removed);
        st.emit(inserted);
        self.metrics.demotions.inc();
        true
    }

    /// One round of background work: watermarks, soft-pin expiry, event flush.
    pub async fn maintain(&self) {
        {
            let mut st = self.state.lock();
            let now = wall_ms();
            while let Some(&(until, id)) = st.soft_pins.first() {
                if until > now {
                    break;
                }
                st.soft_pins.pop_first();
                if let Some(b) = st.blocks.get_mut(&id) {
                    b.pin = Pin::None;
                    let ev = Event::pin_changed(id, Pin::None);
                    st.emit(ev);
                }
            }
            st.flush_events();
        }
        let cap = self.dram.capacity() as f64;
        if self.dram.used() as f64 > self.cfg.dram_high * cap {
            let target = (self.cfg.dram_low * cap) as u64;
            let excess = self.dram.used().saturating_sub(target);
            self.evict(Tier::Dram, excess).await;
        }
        if let Some(s) = &self.ssd {
            let cap = s.capacity() as f64;
            if s.used() as f64 > self.cfg.ssd_high * cap {
                let excess = s.used().saturating_sub((self.cfg.ssd_low * cap) as u64);
                self.evict(Tier::Ssd, excess).await;
            }
        }
        self.update_gauges();
    }

    // ---- reads -----------------------------------------------------------------------------

    /// Locate and lease the keys of a get; hits update recency.
    pub fn plan_get(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<GetPlan> {
        let now = Instant::now();
        let lease = now + self.cfg.lease_ttl;
        let mut st = self.state.lock();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            let Some(&id) = st.by_key.get(&(tenant, k.clone().into_boxed_slice())) else {
                self.metrics.misses.with_label_values(&["dram"]).inc();
                let has_ssd = self.ssd.is_some();
                let t = st.tenant_mut(tenant);
                t.misses[0] += 1;
                if has_ssd {
                    self.metrics.misses.with_label_values(&["ssd"]).inc();
                    t.misses[1] += 1;
                }
                out.push(GetPlan::Missing);
                continue;
            };
            st.tick += 1;
            let tick = st.tick;
            let b = st.blocks.get_mut(&id).expect("index and blocks agree");
            b.lease_until = Some(lease);
            b.last_access = tick;
            let (plan, ev) = if let Some(d) = &b.dram {
                self.metrics.hits.with_label_values(&["dram"]).inc();
                (GetPlan::Dram { block: d.clone(), checksum: b.checksum }, b.event(id, EventKind::Accessed, Tier::Dram))
            } else {
                self.metrics.misses.with_label_values(&["dram"]).inc();
                self.metrics.hits.with_label_values(&["ssd"]).inc();
                let file = b.ssd.expect("a block has at least one copy");
                (
                    GetPlan::Ssd { id, file, size: b.size, checksum: b.checksum },
                    b.event(id, EventKind::Accessed, Tier::Ssd),
                )
            };
            let t = st.tenant_mut(tenant);
            if matches!(plan, GetPlan::Dram { .. }) {
                t.hits[0] += 1;
            } else {
                t.misses[0] += 1;
                t.hits[1] += 1;
            }
            st.leased.insert(id);
            st.emit(ev);
            out.push(plan);
        }
        out
    }

    /// Read an SSD copy, verify it, and promote it to DRAM when there is room.
    /// `Err(Corrupt)` when the checksum fails (the copy is dropped, never served).
    pub async fn read_ssd(self: &Arc<Self>, id: u64, file: u64, size: u64, sum: u64) -> Result<Served, ErrorCode> {
        let Some(ssd) = self.ssd.clone() else { return Err(ErrorCode::NotFound) };
        let promote = self.cfg.promote_on_hit
            && (self.dram.used() + DramTier::footprint(size)) as f64
                <= self.cfg.dram_high * self.dram.capacity() as f64;
        let target = if promote { self.dram.allocate(size) } else { None };
        let read = tokio::task::spawn_blocking(move || match target {
            Some(mut blk) => ssd.read_into(file, blk.bytes_mut()).map(|()| (Some(blk), Vec::new())),
            None => ssd.read(file, size).map(|v| (None, v)),
        })
        .await;
        let (blk, vec) = match read {
            Ok(Ok(x)) => x,
            other => {
                warn!(id, file, ?other, "ssd read failed; block dropped");
                self.drop_ssd_copy(id, file);
                return Err(ErrorCode::Corrupt);
            }
        };
        let actual = match &blk {
            Some(b) => checksum(b.bytes()),
            None => checksum(&vec),
        };
        if actual != sum {
            warn!(id, file, "checksum mismatch on ssd read; block dropped, never served");
            self.metrics.corrupt.inc();
            self.drop_ssd_copy(id, file);
            return Err(ErrorCode::Corrupt);
        }
        let Some(blk) = blk else {
            if self.cfg.promote_on_hit {
                // DRAM is full: promote off the request path, making room by eviction.
                let (store, data) = (self.clone(), vec.clone());
                tokio::spawn(async move { store.promote(id, file, data).await });
            }
            return Ok(Served::Owned(vec, sum, Tier::Ssd));
        };
        self.install_promoted(id, file, blk, sum)
    }

    async fn promote(&self, id: u64, file: u64, data: Vec<u8>) {
        let len = data.len() as u64;
        let mut blk = match self.dram.allocate(len) {
            Some(b) => b,
            None => {
                self.evict(Tier::Dram, DramTier::footprint(len)).await;
                match self.dram.allocate(len) {
                    Some(b) => b,
                    None => return,
                }
            }
        };
        blk.bytes_mut().copy_from_slice(&data);
        let sum = checksum(blk.bytes());
        let _ = self.install_promoted(id, file, blk, sum);
    }

    fn install_promoted(&self, id: u64, file: u64, blk: DramBlock, sum: u64) -> Result<Served, ErrorCode> {
        let blk = Arc::new(blk);
        let mut st = self.state.lock();
        if let Some(b) = st.blocks.get_mut(&id).filter(|b| b.dram.is_none() && b.ssd == Some(file)) {
            b.dram = Some(blk.clone());
            let ev = b.event(id, EventKind::Inserted, Tier::Dram);
            let (tenant, key, rec, size) = (b.tenant, b.key.clone(), b.record(), b.size);
            let _ = self.meta.put(tenant, &key, &rec);
            st.copy_added(tenant, Tier::Dram, size);
            st.tenant_mut(tenant).promotions += 1;
            st.emit(ev);
            self.metrics.promotions.inc();
        }
        drop(st);
        Ok(Served::Dram(blk, sum, Tier::Ssd))
    }

    /// Drop an SSD copy whose bytes cannot be trusted (read error or checksum mismatch).
    fn drop_ssd_copy(&self, id: u64, file: u64) {
        let mut st = self.state.lock();
        let Some(b) = st.blocks.get_mut(&id).filter(|b| b.ssd == Some(file)) else { return };
        let tenant = b.tenant;
        st.tenant_mut(tenant).corrupt += 1;
        let Some(b) = st.blocks.get_mut(&id) else { return };
        if b.dram.is_none() {
            if let Some((f, _)) = self.drop_block(&mut st, id) {
                drop(st);
                if let Some(s) = &self.ssd {
                    s.delete(f);
                }
            }
            return;
        }
        b.ssd = None;
        let ev = b.event(id, EventKind::Removed, Tier::Ssd);
        let (tenant, key, rec, size) = (b.tenant, b.key.clone(), b.record(), b.size);
        let _ = self.meta.put(tenant, &key, &rec);
        st.copy_removed(tenant, Tier::Ssd, size);
        st.emit(ev);
        drop(st);
        if let Some(s) = &self.ssd {
            s.release(size);
            s.delete(file);
        }
    }

    /// Number of leading chain blocks resident in any tier. No lease, no recency update.
    pub fn lookup(&self, tenant: u32, chain: &[Vec<u8>]) -> u32 {
        let st = self.state.lock();
        let n = chain.iter().take_while(|k| st.by_key.contains_key(&(tenant, (*k).clone().into_boxed_slice()))).count();
        drop(st);
        self.metrics.lookup_blocks.with_label_values(&["hit"]).inc_by(n as u64);
        self.metrics.lookup_blocks.with_label_values(&["miss"]).inc_by((chain.len() - n) as u64);
        n as u32
    }

    pub fn exists(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<bool> {
        let st = self.state.lock();
        keys.iter().map(|k| st.by_key.contains_key(&(tenant, k.clone().into_boxed_slice()))).collect()
    }

    // ---- removal ---------------------------------------------------------------------------

    pub fn remove(&self, tenant: u32, keys: &[Vec<u8>], force: bool) -> Vec<ErrorCode> {
        let now = Instant::now();
        let mut files = Vec::new();
        let mut st = self.state.lock();
        let out = keys
            .iter()
            .map(|k| {
                let Some(&id) = st.by_key.get(&(tenant, k.clone().into_boxed_slice())) else {
                    return ErrorCode::NotFound;
                };
                if !force && st.blocks[&id].leased(now) {
                    return ErrorCode::Leased;
                }
                files.extend(self.drop_block(&mut st, id));
                ErrorCode::Ok
            })
            .collect();
        drop(st);
        self.delete_files(files);
        out
    }

    /// Remove every block of the tenant; leased ones stay unless `force`. (removed, skipped)
    pub fn remove_all(&self, tenant: u32, force: bool) -> (u64, u64) {
        let now = Instant::now();
        let mut st = self.state.lock();
        let ids: Vec<(u64, bool)> =
            st.blocks.iter().filter(|(_, b)| b.tenant == tenant).map(|(&id, b)| (id, b.leased(now))).collect();
        let (mut removed, mut skipped, mut files) = (0, 0, Vec::new());
        for (id, leased) in ids {
            if leased && !force {
                skipped += 1;
                continue;
            }
            files.extend(self.drop_block(&mut st, id));
            removed += 1;
        }
        drop(st);
        self.delete_files(files);
        (removed, skipped)
    }

    fn delete_files(&self, files: Vec<(u64, u64)>) {
        if let Some(s) = &self.ssd {
            for (f, _) in files {
                s.delete(f);
            }
        }
    }

    pub fn flush(&self) {
        if let Err(e) = self.meta.flush() {
            warn!(error = %e, "metadata flush failed");
        }
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    // ---- policy swap -----------------------------------------------------------------------

    /// Snapshot of the block set for a new policy, and start recording later events for it.
    pub fn begin_swap(&self) -> Events {
        let mut st = self.state.lock();
        st.flush_events();
        st.tap = Some(Events::new());
        snapshot(&st.blocks)
    }

    pub fn abort_swap(&self) {
        self.state.lock().tap = None;
    }

    /// Feed the new policy what happened since its snapshot, then switch atomically: no
    /// decision is ever taken by a policy that missed an event.
    pub fn finish_swap(&self, slot: NewSlot) {
        let mut st = self.state.lock();
        st.flush_events();
        let tap = st.tap.take().unwrap_or_default();
        let old = match slot {
            NewSlot::Eviction(mut e) => {
                e.on_events(&tap);
                NewSlot::Eviction(std::mem::replace(&mut st.eviction, e))
            }
            NewSlot::Admission(mut a) => {
                a.on_events(&tap);
                NewSlot::Admission(std::mem::replace(&mut st.admission, a))
            }
            NewSlot::Placement(mut p) => {
                p.on_events(&tap);
                NewSlot::Placement(std::mem::replace(&mut st.placement, p))
            }
        };
        drop(st);
        // The old module (and its wasmtime store) is dropped outside the lock.
        drop(old);
    }

    /// Back to the native built-in for a kind, rebuilt from the current block set.
    pub fn install_builtin(&self, kind: kvpool_proto::PolicyKind, store_threshold: u64) {
        let snap = self.begin_swap();
        let slot = match kind {
            kvpool_proto::PolicyKind::Eviction => {
                let mut p = kvpool_policies::LeafLru::new();
                kvpool_policy_sdk::EvictionPolicy::on_events(&mut p, &snap);
                NewSlot::Eviction(EvictionSlot::Native(Box::new(p)))
            }
            kvpool_proto::PolicyKind::Admission => NewSlot::Admission(AdmissionSlot::Native(Box::new(
                kvpool_policies::ThresholdAdmission::new(store_threshold),
            ))),
            kvpool_proto::PolicyKind::Placement => NewSlot::Placement(PlacementSlot::Default),
        };
        self.finish_swap(slot);
    }

    pub fn policy_info(&self, kind: kvpool_proto::PolicyKind) -> Option<kvpool_policy_host::ModuleInfo> {
        let st = self.state.lock();
        match kind {
            kvpool_proto::PolicyKind::Eviction => st.eviction.info(),
            kvpool_proto::PolicyKind::Admission => st.admission.info(),
            kvpool_proto::PolicyKind::Placement => st.placement.info(),
        }
    }
}

/// Host truth for validating a policy's answers.
struct Oracle<'a> {
    blocks: &'a HashMap<u64, Block>,
}

impl BlockOracle for Oracle<'_> {
    fn size_in_tier(&self, id: u64, tier: Tier) -> Option<u64> {
        let b = self.blocks.get(&id)?;
        let present = match tier {
            Tier::Dram => b.dram.is_some(),
            Tier::Ssd => b.ssd.is_some(),
            Tier::Device => false,
        };
        present.then_some(b.size)
    }

    fn pin(&self, id: u64) -> Pin {
        self.blocks.get(&id).map_or(Pin::None, |b| b.pin)
    }

    fn evictable_bytes(&self, tier: Tier, exclude: &[u64]) -> u64 {
        self.blocks
            .iter()
            .filter(|(id, b)| b.pin != Pin::Hard && exclude.binary_search(id).is_err())
            .filter_map(|(id, _)| self.size_in_tier(*id, tier))
            .sum()
    }

    fn snapshot(&self) -> Events {
        snapshot(self.blocks)
    }
}

/// The block set as `Inserted` events, least recently used first, every parent before its
/// children (so a policy that tracks chains sees consistent links).
fn snapshot(blocks: &HashMap<u64, Block>) -> Events {
    let mut order: Vec<(u64, u64)> = blocks.iter().map(|(&id, b)| (b.last_access, id)).collect();
    order.sort_unstable();
    let mut done = std::collections::HashSet::with_capacity(blocks.len());
    let mut ev = Events::new();
    let mut stack = Vec::new();
    for (_, id) in order {
        let mut cur = id;
        while !done.contains(&cur) && blocks.contains_key(&cur) {
            stack.push(cur);
            let p = blocks[&cur].parent;
            if p == NO_PARENT || stack.len() > blocks.len() {
                break;
            }
            cur = p;
        }
        while let Some(x) = stack.pop() {
            if !done.insert(x) {
                continue;
            }
            let b = &blocks[&x];
            if b.ssd.is_some() {
                ev.push(b.event(x, EventKind::Inserted, Tier::Ssd));
            }
            if b.dram.is_some() {
                ev.push(b.event(x, EventKind::Inserted, Tier::Dram));
            }
        }
    }
    ev
}
