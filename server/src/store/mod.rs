//! The block store of one node: the no-I/O core (`kvpool-core`: index and policy slots) behind
//! two locks, the tiers (the DRAM segment and the SSD segment file, both behind the [`tier`]
//! traits), and sled metadata written off the critical section.
//!
//! Locks: `policies` may be taken before `index`, never the other way round. The index lock is
//! held for index work only (no policy call, no sled write, no file I/O), so a lookup or a get
//! never waits on a Wasm policy. Index events reach the policies in order: whoever holds the
//! policies lock drains them from the index and feeds them.
//!
//! A put is two-phase: `reserve` hands out an exclusively owned DRAM range, the caller streams
//! the bytes into it, `commit` publishes it. Readers clone the block's handle, so memory is
//! never freed under an in-flight read.

pub mod dram;
pub mod meta;
pub mod ssd;
#[cfg(test)]
mod tests;
pub mod tier;

pub use dram::{DramBlock, DramKept, DramRef, PinnedBlock};

use crate::events::EventLog;
use crate::metrics::Metrics;
use dram::DramTier;
use kvpool_core::{
    placed_tiers, placement_batch, CopyHandle, Demoted, Dropped, Granularity, Index, Located, NewSlot, PinRequest,
    Policies, PutSpec, PutStatus, RemoveStatus, TenantCounters,
};
use kvpool_policy_sdk::{Admit, Events, NodeSet, Tier};
use kvpool_proto::{ErrorCode, PinSpec, PutMode};
use meta::Meta;
use parking_lot::Mutex;
use ssd::SsdTier;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tier::{Medium, Space, SsdExtent};
use tokio::sync::Notify;
use tracing::warn;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Meta(#[from] meta::MetaError),
    #[error(transparent)]
    Ssd(#[from] ssd::SsdError),
    #[error(transparent)]
    Segment(#[from] dram::SegmentAllocError),
    #[error("cannot start a thread: {0}")]
    Io(#[source] std::io::Error),
}

/// Settings the store needs (a slice of the server config).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub data_dir: PathBuf,
    pub dram_bytes: u64,
    pub dram_high: f64,
    pub dram_low: f64,
    /// Fault every page of the segment in at start.
    pub dram_populate: bool,
    pub ssd_dir: Option<PathBuf>,
    pub ssd_bytes: u64,
    pub ssd_high: f64,
    pub ssd_low: f64,
    pub ssd_fsync: bool,
    /// sled's cache of the persisted records, bytes.
    pub meta_cache: u64,
    pub lease_ttl: Duration,
    pub soft_pin_ttl: Duration,
    pub put_wait: Duration,
    pub promote_on_hit: bool,
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Wall clock in µs: the time policies see on events.
fn wall_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0)
}

/// A place DRAM victims can go before SSD: another node's free DRAM.
pub trait Offload: Send + Sync {
    /// Store these blocks (each described by its change, with its bytes) elsewhere; per block,
    /// whether it is now stored there. Must answer promptly (it runs on the eviction path).
    fn offload<'a>(&'a self, blocks: Vec<(kvpool_core::Change, &'a [u8])>) -> crate::service::BoxFuture<'a, Vec<bool>>;
}

pub fn checksum(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// A DRAM copy as the index holds it: the range, inline in the record. Reads pin it
/// ([`DramTier::pin`]) under the index's lock; a copy the index lets go is handed back with
/// [`DramTier::release_ref`] (see [`Store::release`]), exactly once.
#[derive(Clone, Copy, Debug)]
pub struct DramCopy(pub DramRef);

/// Whether a read holds a copy is the tier's to say: the store passes
/// [`DramTier::in_use`] to [`Index::valid_victims`].
impl CopyHandle for DramCopy {
    /// The range without its length: the record's size is the length.
    type Kept = DramKept;
    fn keep(&self) -> DramKept {
        self.0.kept()
    }
    fn restore(kept: &DramKept, len: u64) -> DramCopy {
        DramCopy(DramRef::restore(*kept, len))
    }
}

/// What a put item will do, decided before its bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutPlan {
    /// Stream into DRAM under this pre-assigned id.
    Dram(u64),
    /// Stream straight into the SSD tier (admission or placement asked for it).
    Ssd(u64),
    /// Do not store; discard the bytes and answer this status.
    Skip(ErrorCode),
}

/// A located block for a get, resolved under the lock and read outside it.
pub enum GetPlan {
    Dram { block: PinnedBlock, checksum: u64 },
    Ssd { id: u64, file: u64, size: u64, checksum: u64 },
    Missing,
}

/// Bytes of one get item, ready to send.
pub enum Served {
    /// Served from a DRAM range (also after a promotion; the tier says where it came from).
    Dram(PinnedBlock, u64, Tier),
    Owned(Vec<u8>, u64, Tier),
}

/// A DRAM block as bytes that may be sent without copying: it stays allocated while they live.
struct BlockBytes(PinnedBlock);

impl AsRef<[u8]> for BlockBytes {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl Served {
    /// The value as an owned, cheaply cloned buffer (no copy for DRAM blocks).
    pub fn into_bytes(self) -> bytes::Bytes {
        match self {
            Served::Dram(b, _, _) => bytes::Bytes::from_owner(BlockBytes(b)),
            Served::Owned(v, _, _) => bytes::Bytes::from(v),
        }
    }

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

/// Move an SSD tier of the earlier layout (one `<id>.blk` file per block) into the segment file:
/// each record's block is copied into an extent and its record updated; records whose file is
/// missing or short are dropped. Done once; sled remembers the layout.
fn migrate_legacy_ssd(meta: &Meta, ssd: &SsdTier, dir: &std::path::Path) -> Result<(), StoreError> {
    const LAYOUT_KEY: &str = "ssd-layout";
    const LAYOUT: &[u8] = b"segment-v1";
    if meta.kv.get(LAYOUT_KEY).ok().flatten().is_some_and(|v| v.as_ref() == LAYOUT) {
        return Ok(());
    }
    let files: std::collections::HashMap<u64, (u64, PathBuf)> =
        ssd::legacy_files(dir).into_iter().map(|(id, len, p)| (id, (len, p))).collect();
    if !files.is_empty() {
        tracing::info!(files = files.len(), dir = %dir.display(), "migrating the SSD tier to a segment file");
    }
    let (mut moved, mut dropped) = (0u64, 0u64);
    let mut placed = Vec::new();
    for (tenant, key, rec) in meta.all() {
        let Some(mut r) = rec else { continue };
        let Some(file) = r.ssd_file else { continue };
        let copied = files.get(&file).filter(|(len, _)| *len == r.size).and_then(|(_, path)| {
            let data = std::fs::read(path).ok()?;
            let mut extent = ssd.reserve(r.size)?;
            match Medium::write(ssd, &mut extent, 0, &data) {
                Ok(()) => Some(extent),
                Err(_) => {
                    ssd.release(extent);
                    None
                }
            }
        });
        match copied {
            Some(extent) => {
                r.ssd_file = Some(extent.offset);
                meta.put_now(tenant, &key, &r)?;
                placed.push(extent);
                moved += 1;
            }
            None => {
                meta.remove_now(tenant, &key)?;
                dropped += 1;
            }
        }
    }
    // Recovery claims the extents again from the records.
    for extent in placed {
        ssd.release(extent);
    }
    meta.kv.insert(LAYOUT_KEY, LAYOUT).map_err(meta::MetaError::from)?;
    meta.flush()?;
    for (_, (_, path)) in files {
        let _ = std::fs::remove_file(path);
    }
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().ends_with(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if moved + dropped > 0 {
        tracing::info!(moved, dropped, "SSD tier migrated");
    }
    Ok(())
}

/// The wire answer for a put item's outcome.
fn put_code(s: PutStatus) -> ErrorCode {
    match s {
        PutStatus::Ok => ErrorCode::Ok,
        PutStatus::AlreadyExists => ErrorCode::AlreadyExists,
        PutStatus::Leased => ErrorCode::Leased,
        PutStatus::Rejected => ErrorCode::Rejected,
        PutStatus::NoSpace => ErrorCode::NoSpace,
    }
}

fn spec(item: &kvpool_proto::PutItem) -> PutSpec<'_> {
    PutSpec {
        key: &item.key,
        size: item.size,
        parent: item.parent.as_deref(),
        tokens: item.tokens,
        seq_tokens: item.seq_tokens,
        pin: match item.pin {
            PinSpec::None => PinRequest::None,
            PinSpec::Hard => PinRequest::Hard,
            PinSpec::Soft { ttl_ms } => PinRequest::Soft { ttl_ms },
        },
    }
}

pub struct Store {
    pub cfg: StoreConfig,
    dram: Arc<DramTier>,
    ssd: Option<Arc<SsdTier>>,
    meta: Meta,
    index: Mutex<Index<DramCopy>>,
    policies: Mutex<Policies>,
    metrics: Arc<Metrics>,
    /// Wakes the background evictor early (a put pushed usage past the high watermark).
    pub kick: tokio::sync::Notify,
    /// Where the index's KV events go, once attached.
    events: std::sync::OnceLock<Arc<EventLog>>,
    /// Where DRAM victims may go before SSD: another node's free DRAM (a cluster storage node).
    offload: std::sync::OnceLock<Arc<dyn Offload>>,
}

/// The index, locked. Unlocking hands the KV events of what was done under the lock to the
/// event log (still under the lock, so the log's order is the index's order).
struct Ix<'a> {
    guard: parking_lot::MutexGuard<'a, Index<DramCopy>>,
    events: Option<&'a EventLog>,
}

impl std::ops::Deref for Ix<'_> {
    type Target = Index<DramCopy>;
    fn deref(&self) -> &Index<DramCopy> {
        &self.guard
    }
}

impl std::ops::DerefMut for Ix<'_> {
    fn deref_mut(&mut self) -> &mut Index<DramCopy> {
        &mut self.guard
    }
}

impl Drop for Ix<'_> {
    fn drop(&mut self) {
        if let Some(log) = self.events {
            log.publish(self.guard.take_changes());
        }
    }
}

impl Store {
    /// Open the tiers and sled, and rebuild the index from sled (SSD copies survive a restart).
    pub fn open(cfg: StoreConfig, metrics: Arc<Metrics>, policies: Policies) -> Result<Arc<Store>, StoreError> {
        let meta = Meta::open(&cfg.data_dir.join("meta"), cfg.meta_cache)?;
        let dram = DramTier::new(cfg.dram_bytes, cfg.dram_populate)?;
        let ssd = match (&cfg.ssd_dir, cfg.ssd_bytes) {
            (Some(dir), cap) if cap > 0 => {
                let t = SsdTier::open(dir, cap, cfg.ssd_fsync)?;
                migrate_legacy_ssd(&meta, &t, dir)?;
                Some(Arc::new(t))
            }
            _ => None,
        };
        let gran = Granularity { dram: dram::UNIT, ssd: ssd::SSD_UNIT };
        let mut index = Index::new(gran, ssd.is_some());
        // Newest first: an extent two records name (a crash between a reuse and the older
        // record's removal) belongs to the newer one.
        let started = Instant::now();
        let mut records = meta.all();
        let read_ms = started.elapsed().as_millis() as u64;
        records.sort_unstable_by_key(|(_, _, r)| std::cmp::Reverse(r.as_ref().map_or(0, |r| r.created_ms)));
        let t = Instant::now();
        let rec = index.recover(
            records,
            |extents| match &ssd {
                Some(s) => s.adopt_all(extents),
                None => vec![false; extents.len()],
            },
            wall_ms(),
        );
        let index_ms = t.elapsed().as_millis() as u64;
        meta.enqueue(rec.meta);
        if rec.kept + rec.dropped > 0 {
            tracing::info!(
                kept = rec.kept,
                dropped = rec.dropped,
                ms = started.elapsed().as_millis() as u64,
                read_ms,
                index_ms,
                "recovered block index from sled (SSD copies kept and verified on first read, DRAM copies dropped)"
            );
        }
        let store = Arc::new(Store {
            cfg,
            dram,
            ssd,
            meta,
            index: Mutex::new(index),
            policies: Mutex::new(policies),
            metrics,
            kick: tokio::sync::Notify::new(),
            events: std::sync::OnceLock::new(),
            offload: std::sync::OnceLock::new(),
        });
        store.update_gauges();
        if !rec.snapshot.is_empty() {
            store.warm_policies(rec.snapshot)?;
        }
        Ok(store)
    }

    /// Feed the recovered blocks to the policies on a thread of its own, so that lookups and
    /// gets serve at once (they need only the index). The thread holds the policy lock from
    /// before this returns until the feed is done: whatever needs a policy (a put's admission,
    /// an eviction) waits for the policies to know every recovered block, and events of reads
    /// meanwhile reach them after the snapshot, in order.
    fn warm_policies(self: &Arc<Self>, snapshot: Events) -> Result<(), StoreError> {
        let (locked, wait) = std::sync::mpsc::sync_channel(1);
        let store = Arc::clone(self);
        std::thread::Builder::new()
            .name("kvpool-warm".into())
            .spawn(move || {
                let mut pol = store.policies.lock();
                let _ = locked.send(());
                let t = Instant::now();
                // The same parents-first snapshot a policy swap replays.
                pol.feed(&snapshot);
                tracing::info!(
                    events = snapshot.len(),
                    ms = t.elapsed().as_millis() as u64,
                    "policies warmed with the recovered blocks"
                );
            })
            .map_err(StoreError::Io)?;
        // Until the thread holds the lock, nothing may take it first.
        let _ = wait.recv();
        Ok(())
    }

    /// The index, locked (its KV events are published when the lock is let go).
    fn ix(&self) -> Ix<'_> {
        Ix { guard: self.index.lock(), events: self.events.get().map(|e| &**e) }
    }

    /// Log the index's KV events from now on (once; a second log is refused and returned).
    /// Send DRAM victims to `o` before SSD (once; a cluster storage node sets it). Without an
    /// SSD tier, the victims `o` does not take are dropped as before.
    pub fn set_offload(&self, o: Arc<dyn Offload>) {
        if self.offload.set(o).is_ok() {
            self.index.lock().set_offload(true);
        }
    }

    pub fn attach_events(&self, log: Arc<EventLog>) -> Result<(), Arc<EventLog>> {
        let mut ix = self.index.lock();
        self.events.set(log)?;
        ix.set_change_feed(true);
        Ok(())
    }

    /// Address and length of the DRAM segment (registered once with the copy engine).
    pub fn dram_segment(&self) -> (usize, usize) {
        self.dram.segment()
    }

    /// DRAM bytes allocated, reservations of puts in flight included.
    pub fn dram_used(&self) -> u64 {
        self.dram.used()
    }

    pub fn dram_capacity(&self) -> u64 {
        self.dram.capacity()
    }

    /// Every tier of this node, fastest first, with its (high, low) watermarks.
    fn spaces(&self) -> Vec<(&dyn Space, f64, f64)> {
        let mut v: Vec<(&dyn Space, f64, f64)> = vec![(&self.dram, self.cfg.dram_high, self.cfg.dram_low)];
        if let Some(s) = &self.ssd {
            v.push((&**s, self.cfg.ssd_high, self.cfg.ssd_low));
        }
        v
    }

    pub fn update_gauges(&self) {
        let m = &self.metrics;
        for (s, _, _) in self.spaces() {
            m.bytes_used.with_label_values(&[s.tier().name()]).set(s.used() as i64);
            m.capacity.with_label_values(&[s.tier().name()]).set(s.capacity() as i64);
        }
        let (_, dram_blocks, ssd_blocks) = self.counts();
        m.blocks.with_label_values(&["dram"]).set(dram_blocks as i64);
        m.blocks.with_label_values(&["ssd"]).set(ssd_blocks as i64);
    }

    /// (blocks, DRAM copies, SSD copies)
    pub fn counts(&self) -> (u64, u64, u64) {
        self.ix().counts()
    }

    /// One tenant's residency and counters.
    pub fn tenant_counters(&self, tenant: u32) -> TenantCounters {
        self.ix().tenant_counters(tenant)
    }

    /// This node's inventory and the event-log position it is consistent with: every change
    /// logged from that position on came after it (changes are published under the index lock).
    pub fn inventory(&self) -> (u64, Vec<kvpool_core::Change>) {
        let ix = self.ix();
        let cursor = self.events.get().map_or(0, |l| l.next_seq());
        (cursor, ix.inventory())
    }

    /// The answer of this node's placement module (`None` when none is loaded).
    pub fn place(
        &self,
        batch: &kvpool_policy_sdk::PlaceBatch,
        nodes: &NodeSet,
    ) -> Option<kvpool_policy_sdk::Placements> {
        let mut pol = self.policies.lock();
        self.feed(&mut pol);
        pol.placement.as_mut().map(|p| p.place(batch, nodes))
    }

    pub fn tier_usage(&self) -> Vec<(Tier, u64, u64)> {
        self.spaces().into_iter().map(|(s, _, _)| (s.tier(), s.capacity(), s.used())).collect()
    }

    /// Free what the index let go of: DRAM copies drop here; SSD extents go back to the tier once
    /// the removal of their records is durable (a crash before that must not find a record
    /// naming an extent that a newer block overwrote).
    fn release(&self, dropped: impl IntoIterator<Item = Dropped<DramCopy>>) {
        let mut extents = Vec::new();
        for d in dropped {
            if let Some(c) = d.dram {
                self.dram.release_ref(c.0);
            }
            if let Some((offset, len)) = d.ssd {
                extents.push(SsdExtent { offset, len });
            }
        }
        if let (false, Some(s)) = (extents.is_empty(), &self.ssd) {
            let s = s.clone();
            self.meta.after_durable(move || extents.into_iter().for_each(|e| s.release(e)));
        }
    }

    /// Hand the index's pending events to the policies (the caller holds the policies lock).
    fn feed(&self, policies: &mut Policies) {
        let ev = self.ix().take_events();
        policies.feed(&ev);
    }

    /// This node's free space, as a placement policy sees it.
    fn nodes(&self) -> NodeSet {
        let mut free = [0u64; 3];
        for (s, _, _) in self.spaces() {
            free[s.tier() as usize] = s.free();
        }
        let mut nodes = NodeSet::default();
        nodes.push(0, free, 0);
        nodes
    }

    // ---- put -------------------------------------------------------------------------------

    /// Decide every item of a put before any byte is read: existing keys, admission, placement.
    pub fn plan_put(&self, tenant: u32, items: &[kvpool_proto::PutItem], mode: PutMode) -> Vec<PutPlan> {
        let specs: Vec<PutSpec<'_>> = items.iter().map(spec).collect();
        let upsert = mode == PutMode::Upsert;
        let (pending, batch) = self.ix().plan_put(tenant, &specs, upsert, self.dram.capacity());
        let (decisions, placed) = if batch.is_empty() {
            (Vec::new(), None)
        } else {
            let mut pol = self.policies.lock();
            self.feed(&mut pol);
            let decisions = pol.admission.admit(&batch);
            let nodes = self.nodes();
            let placed =
                pol.placement.as_mut().map(|p| placed_tiers(&p.place(&placement_batch(&batch), &nodes), batch.len()));
            (decisions, placed)
        };
        let plans = self.ix().decide_put(tenant, &pending, &batch, &decisions, placed.as_deref());
        plans
            .into_iter()
            .map(|p| match p {
                kvpool_core::PutPlan::Skip(s) => {
                    if s == PutStatus::Rejected {
                        self.metrics.rejected_puts.with_label_values(&["admission"]).inc();
                    }
                    PutPlan::Skip(put_code(s))
                }
                kvpool_core::PutPlan::Store { id, tier: Tier::Ssd } => PutPlan::Ssd(id),
                kvpool_core::PutPlan::Store { id, .. } => PutPlan::Dram(id),
            })
            .collect()
    }

    fn no_space(&self, tenant: u32) -> ErrorCode {
        self.metrics.rejected_puts.with_label_values(&["no_space"]).inc();
        self.ix().count_no_space(tenant, 1);
        ErrorCode::NoSpace
    }

    /// Reserve DRAM for `len` bytes, evicting and then waiting for space until `deadline`.
    pub async fn reserve(&self, tenant: u32, len: u64, deadline: tokio::time::Instant) -> Result<DramBlock, ErrorCode> {
        let b = self.reserve_in(&self.dram, len, Some(deadline)).await.ok_or_else(|| self.no_space(tenant))?;
        if self.dram.used() as f64 > self.cfg.dram_high * self.dram.capacity() as f64 {
            self.kick.notify_one();
        }
        Ok(b)
    }

    /// An extent of `len` bytes in tier `m`, evicting from it to make room. With a `deadline`,
    /// eviction goes on while it frees anything, and then a tier whose space comes back on its
    /// own (DRAM: reads in flight end) is waited on until the deadline. Without one, it gives up
    /// after a few rounds of eviction that freed nothing usable.
    async fn reserve_in<M: Medium>(
        &self,
        m: &M,
        len: u64,
        deadline: Option<tokio::time::Instant>,
    ) -> Option<M::Extent> {
        let mut rounds = 0;
        loop {
            let notified = m.freed().map(Notify::notified);
            tokio::pin!(notified);
            if let Some(n) = notified.as_mut().as_pin_mut() {
                n.enable();
            }
            if let Some(e) = m.reserve(len) {
                return Some(e);
            }
            // Free at least this block's room (more when fragmentation defeats the first round).
            let need = m.footprint(len).max(m.capacity() / 64);
            rounds += 1;
            if (deadline.is_some() || rounds <= 4) && Box::pin(self.evict(m.tier(), need)).await > 0 {
                if m.persistent() {
                    // Evicted space comes back once the removal of its records is durable.
                    self.meta.barrier().await;
                }
                continue;
            }
            match (notified.as_pin_mut(), deadline) {
                (Some(n), Some(d)) => {
                    if tokio::time::timeout_at(d, n).await.is_err() {
                        return None;
                    }
                }
                _ => return None,
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn commit_copy(
        &self,
        tenant: u32,
        id: u64,
        item: &kvpool_proto::PutItem,
        mode: PutMode,
        sum: u64,
        dram: Option<DramCopy>,
        ssd: Option<u64>,
    ) -> ErrorCode {
        // The record keeps a DRAM copy without its length ([`DramKept`]): its size is it.
        if let Some(c) = dram.filter(|c| c.0.len() != item.size) {
            tracing::error!(id, len = c.0.len(), size = item.size, "a DRAM copy's length is not its item's size");
            self.dram.release_ref(c.0);
            return ErrorCode::Internal;
        }
        let s = spec(item);
        let soft_ttl = self.cfg.soft_pin_ttl.as_millis() as u64;
        let mut ix = self.ix();
        let r = ix.commit(tenant, id, &s, mode == PutMode::Upsert, sum, dram, ssd, Instant::now(), wall_ms(), soft_ttl);
        match r {
            Ok((replaced, meta)) => {
                self.meta.enqueue(meta);
                drop(ix);
                self.release(replaced);
                ErrorCode::Ok
            }
            Err(status) => {
                drop(ix);
                // Refused before the index took it: the range is still ours to give back.
                if let Some(c) = dram {
                    self.dram.release_ref(c.0);
                }
                put_code(status)
            }
        }
    }

    /// Publish a filled DRAM block. `AlreadyExists` / `Leased` when the key changed meanwhile.
    /// `sum` is the block's xxh3-64 when the caller hashed the bytes as they were written (the
    /// copy engine does); otherwise it is computed here.
    pub fn commit(
        &self,
        tenant: u32,
        id: u64,
        item: &kvpool_proto::PutItem,
        mode: PutMode,
        block: DramBlock,
        sum: Option<u64>,
    ) -> ErrorCode {
        let sum = sum.unwrap_or_else(|| checksum(block.bytes()));
        self.commit_copy(tenant, id, item, mode, sum, Some(DramCopy(block.commit())), None)
    }

    /// Publish a block whose bytes go straight to the SSD tier.
    pub async fn commit_ssd(
        &self,
        tenant: u32,
        id: u64,
        item: &kvpool_proto::PutItem,
        mode: PutMode,
        data: Vec<u8>,
        sum: Option<u64>,
    ) -> ErrorCode {
        let Some(ssd) = self.ssd.clone() else { return ErrorCode::NoSpace };
        let Some(extent) = self.reserve_in(&*ssd, item.size, None).await else {
            return self.no_space(tenant);
        };
        let sum = sum.unwrap_or_else(|| checksum(&data));
        let s2 = ssd.clone();
        // An SSD extent is an address (Copy): the write gets its own.
        let written = tokio::task::spawn_blocking(move || {
            let mut extent = extent;
            Medium::write(&*s2, &mut extent, 0, &data)
        })
        .await;
        if !matches!(written, Ok(Ok(()))) {
            warn!(?written, "ssd write failed");
            ssd.release(extent);
            return ErrorCode::Internal;
        }
        let code = self.commit_copy(tenant, id, item, mode, sum, None, Some(extent.offset));
        if code != ErrorCode::Ok {
            ssd.release(extent);
        }
        code
    }

    // ---- eviction ------------------------------------------------------------------------

    /// Free at least `bytes` of `tier` (DRAM copies are demoted to SSD when the SSD tier and
    /// the admission policy take them). Returns the number of copies that left the tier.
    pub async fn evict(&self, tier: Tier, bytes: u64) -> usize {
        let now = Instant::now();
        let has_ssd = self.ssd.is_some();
        let (victims, decisions) = {
            let mut pol = self.policies.lock();
            // The index stays locked while the policy chooses: its guard checks the answer
            // against the index, which must hold exactly the blocks the policy was told of (a
            // put committed mid-call would make a truthful policy look like one that hides
            // victims).
            let mut ix = self.ix();
            let ev = ix.take_events();
            pol.feed(&ev);
            let exclude = ix.excluded(now, tier);
            let proposed = pol.eviction.victims(&*ix, tier, bytes, &exclude);
            let victims = ix.valid_victims(&proposed, tier, bytes, &exclude, |c| self.dram.in_use(&c.0));
            if victims.is_empty() && !proposed.is_empty() {
                tracing::debug!(proposed = proposed.len(), "eviction policy proposed only ineligible victims");
            }
            let batch = (tier == Tier::Dram && has_ssd && !victims.is_empty()).then(|| ix.demotion_batch(&victims));
            drop(ix);
            let decisions: Vec<Admit> = batch.map(|b| pol.admission.admit(&b)).unwrap_or_default();
            (victims, decisions)
        };
        if victims.is_empty() {
            return 0;
        }
        let (out, demotions) = {
            let mut ix = self.ix();
            let mut out = ix.evict(&victims, tier, &decisions, now);
            self.meta.enqueue(std::mem::take(&mut out.meta));
            // Pinned while the index still holds them: the demotion reads them unlocked.
            let pins: Vec<(u64, PinnedBlock)> = out.demotions.iter().map(|(id, c)| (*id, self.dram.pin(c.0))).collect();
            (out, pins)
        };
        let evicted = out.gone + out.demotions.len();
        self.metrics.evictions.with_label_values(&[tier.name()]).inc_by(evicted as u64);
        self.metrics.evictions_cascaded.inc_by(out.cascaded as u64);
        self.metrics.evictions_refused.inc_by(out.refused as u64);
        let mut gone = out.gone;
        self.release(out.dropped);
        let demotions = self.offload_first(demotions).await;
        gone += demotions.1;
        for (id, copy) in demotions.0 {
            if self.demote(id, copy).await {
                gone += 1;
            }
        }
        gone
    }

    /// Offer the demotions to another node's free DRAM first (when an offload target is set):
    /// those it took leave this node as evicted; the rest are returned for SSD, with the count
    /// of those that left.
    async fn offload_first(&self, demotions: Vec<(u64, PinnedBlock)>) -> (Vec<(u64, PinnedBlock)>, usize) {
        let Some(o) = self.offload.get().filter(|_| !demotions.is_empty()) else { return (demotions, 0) };
        let described: Vec<Option<kvpool_core::Change>> = {
            let ix = self.ix();
            demotions.iter().map(|(id, _)| ix.describe(*id)).collect()
        };
        // The pinned copies are read in place while the offer runs.
        let offer: Vec<(kvpool_core::Change, &[u8])> =
            demotions.iter().zip(&described).filter_map(|((_, copy), d)| Some((d.clone()?, copy.bytes()))).collect();
        let taken = o.offload(offer).await;
        let mut taken = taken.into_iter();
        let (mut rest, mut moved) = (Vec::new(), 0);
        for ((id, copy), d) in demotions.into_iter().zip(described) {
            let took = d.is_some() && taken.next().unwrap_or(false);
            self.metrics.cluster_offloads.with_label_values(&[if took { "moved" } else { "kept" }]).inc();
            if !took {
                rest.push((id, copy));
                continue;
            }
            drop(copy);
            let mut ix = self.ix();
            match ix.finish_demotion(id, None, wall_ms()) {
                Demoted::Evicted { dropped, meta } => {
                    self.meta.enqueue(meta.into_iter().collect());
                    drop(ix);
                    self.release([dropped]);
                }
                Demoted::Moved { dram, meta } => {
                    // Not reached with no SSD extent written; handled like the SSD path.
                    self.meta.enqueue(vec![meta]);
                    drop(ix);
                    if let Some(c) = dram {
                        self.dram.release_ref(c.0);
                    }
                }
                Demoted::Vanished => {}
            }
            moved += 1;
        }
        (rest, moved)
    }

    /// Copy a DRAM victim to SSD, then drop its DRAM copy. When SSD has no room the block is
    /// simply evicted; without an SSD tier (a victim no other node took) it is evicted under the
    /// usual rules ([`Index::evict_untaken`]). Returns whether the DRAM copy left.
    async fn demote(&self, id: u64, copy: PinnedBlock) -> bool {
        let size = copy.len();
        let Some(ssd) = self.ssd.clone() else {
            // No SSD tier, and no other node took it: evicted under the usual rules, as they
            // stand now (a lease taken while it was offered keeps it).
            drop(copy);
            let out = {
                let mut ix = self.ix();
                let mut out = ix.evict_untaken(id, Instant::now());
                self.meta.enqueue(std::mem::take(&mut out.meta));
                out
            };
            self.metrics.evictions_cascaded.inc_by(out.cascaded as u64);
            self.metrics.evictions_refused.inc_by(out.refused as u64);
            self.release(out.dropped);
            return out.gone > 0;
        };
        let written = match self.reserve_in(&*ssd, size, None).await {
            Some(extent) => {
                let (s2, data) = (ssd.clone(), copy.clone());
                let write = move || {
                    let mut extent = extent;
                    Medium::write(&*s2, &mut extent, 0, data.bytes())
                };
                match tokio::task::spawn_blocking(write).await {
                    Ok(Ok(())) => Some(extent.offset),
                    r => {
                        warn!(?r, "demotion write failed; block evicted instead");
                        ssd.release(extent);
                        None
                    }
                }
            }
            None => None,
        };
        drop(copy);
        let mut ix = self.ix();
        match ix.finish_demotion(id, written, wall_ms()) {
            Demoted::Moved { dram, meta } => {
                self.meta.enqueue(vec![meta]);
                drop(ix);
                if let Some(c) = dram {
                    self.dram.release_ref(c.0);
                }
                self.metrics.demotions.inc();
            }
            Demoted::Evicted { dropped, meta } => {
                self.meta.enqueue(meta.into_iter().collect());
                drop(ix);
                self.release([dropped]);
            }
            Demoted::Vanished => {
                drop(ix);
                if let Some(offset) = written {
                    ssd.release(SsdExtent { offset, len: size });
                }
            }
        }
        true
    }

    /// One round of background work: soft-pin expiry, event flush, watermarks.
    pub async fn maintain(&self) {
        self.ix().expire_soft_pins(wall_ms());
        // Busy (warming after a restart, or a long call): the next round feeds the events, and
        // this task does not tie up a runtime thread waiting.
        if let Some(mut pol) = self.policies.try_lock() {
            self.feed(&mut pol);
        }
        // Above its high watermark, a tier is brought down to its low one, fastest tier first;
        // each is measured when its turn comes (demotions from the one before fill it).
        let tiers = self.spaces().len();
        for i in 0..tiers {
            let (tier, excess) = {
                let (s, high, low) = self.spaces()[i];
                if s.used() as f64 <= high * s.capacity() as f64 {
                    continue;
                }
                (s.tier(), s.used().saturating_sub((low * s.capacity() as f64) as u64))
            };
            self.evict(tier, excess).await;
        }
        self.update_gauges();
    }

    // ---- reads -----------------------------------------------------------------------------

    /// Locate and lease the keys of a get; hits update recency.
    pub fn plan_get(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<GetPlan> {
        let lease = Instant::now() + self.cfg.lease_ttl;
        let mut ix = self.ix();
        let located = ix.plan_get(tenant, keys, lease, wall_us());
        // DRAM hits are pinned while the index still holds them: they are read unlocked.
        let located: Vec<(Located<DramCopy>, Option<PinnedBlock>)> = located
            .into_iter()
            .map(|l| {
                let pin = match &l {
                    Located::Dram { copy, .. } => Some(self.dram.pin(copy.0)),
                    _ => None,
                };
                (l, pin)
            })
            .collect();
        drop(ix);
        let m = &self.metrics;
        located
            .into_iter()
            .map(|(l, pin)| match (l, pin) {
                (Located::Missing, _) => {
                    m.misses.with_label_values(&["dram"]).inc();
                    if self.ssd.is_some() {
                        m.misses.with_label_values(&["ssd"]).inc();
                    }
                    GetPlan::Missing
                }
                (Located::Dram { checksum, .. }, Some(block)) => {
                    m.hits.with_label_values(&["dram"]).inc();
                    GetPlan::Dram { block, checksum }
                }
                (Located::Dram { .. }, None) => unreachable!("every DRAM hit was pinned"),
                (Located::Ssd { id, locator, size, checksum }, _) => {
                    m.misses.with_label_values(&["dram"]).inc();
                    m.hits.with_label_values(&["ssd"]).inc();
                    GetPlan::Ssd { id, file: locator, size, checksum }
                }
            })
            .collect()
    }

    /// Read an SSD copy, verify it, and promote it to DRAM when there is room.
    /// `Err(Corrupt)` when the checksum fails (the copy is dropped, never served).
    pub async fn read_ssd(self: &Arc<Self>, id: u64, file: u64, size: u64, sum: u64) -> Result<Served, ErrorCode> {
        let Some(ssd) = self.ssd.clone() else { return Err(ErrorCode::NotFound) };
        let promote = self.cfg.promote_on_hit
            && (self.dram.used() + DramTier::footprint(size)) as f64
                <= self.cfg.dram_high * self.dram.capacity() as f64;
        let target = if promote { self.dram.allocate(size) } else { None };
        let extent = SsdExtent { offset: file, len: size };
        let read = tokio::task::spawn_blocking(move || match target {
            Some(mut blk) => Medium::read_into(&*ssd, &extent, 0, blk.bytes_mut()).map(|()| (Some(blk), Vec::new())),
            None => Medium::read(&*ssd, &extent, size).map(|v| (None, v)),
        })
        .await;
        let (blk, vec) = match read {
            Ok(Ok(x)) => x,
            other => {
                warn!(id, file, ?other, "ssd read failed; block dropped");
                self.drop_corrupt(id, file);
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
            self.drop_corrupt(id, file);
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
        Ok(Served::Dram(self.install_promoted(id, file, blk), sum, Tier::Ssd))
    }

    async fn promote(&self, id: u64, file: u64, data: Vec<u8>) {
        let len = data.len() as u64;
        // Off the request path: room for this block only, and never a wait for it.
        let mut blk = match self.dram.reserve(len) {
            Some(b) => b,
            None => {
                self.evict(Tier::Dram, self.dram.footprint(len)).await;
                let Some(b) = self.dram.reserve(len) else { return };
                b
            }
        };
        if Medium::write(&self.dram, &mut blk, 0, &data).is_err() {
            return;
        }
        self.install_promoted(id, file, blk);
    }

    /// Give a promoted copy to the index (when the block still wants it), pinned for the read
    /// that promoted it; a copy the index did not take is freed when that pin drops.
    fn install_promoted(&self, id: u64, file: u64, blk: DramBlock) -> PinnedBlock {
        let r = blk.commit();
        let mut ix = self.ix();
        let pin = self.dram.pin(r);
        if ix.install_promoted(id, file, DramCopy(r)).is_ok() {
            self.metrics.promotions.inc();
        } else {
            drop(ix);
            self.dram.release_ref(r);
        }
        pin
    }

    fn drop_corrupt(&self, id: u64, file: u64) {
        let mut ix = self.ix();
        if let Some((dropped, meta)) = ix.drop_corrupt(id, file) {
            self.meta.enqueue(meta.into_iter().collect());
            drop(ix);
            self.release([dropped]);
        }
    }

    /// Number of leading chain blocks resident in any tier. No lease, no recency update.
    pub fn lookup(&self, tenant: u32, chain: &[Vec<u8>]) -> u32 {
        let n = self.ix().lookup(tenant, chain, wall_us());
        self.metrics.lookup_blocks.with_label_values(&["hit"]).inc_by(n as u64);
        self.metrics.lookup_blocks.with_label_values(&["miss"]).inc_by((chain.len() - n) as u64);
        n as u32
    }

    /// [`Store::lookup`], holding the resident leading blocks until [`Store::unhold`] of the
    /// returned ids.
    pub fn lookup_hold(&self, tenant: u32, chain: &[Vec<u8>]) -> (u32, Vec<u64>) {
        let (n, ids) = self.ix().lookup_hold(tenant, chain, wall_us());
        self.metrics.lookup_blocks.with_label_values(&["hit"]).inc_by(n as u64);
        self.metrics.lookup_blocks.with_label_values(&["miss"]).inc_by((chain.len() - n) as u64);
        (n as u32, ids)
    }

    /// Let go of the hold [`Store::lookup_hold`] took on `ids`.
    pub fn unhold(&self, ids: &[u64]) {
        if !ids.is_empty() {
            self.ix().unhold(ids);
        }
    }

    /// Number of blocks held by lookups now.
    pub fn held(&self) -> usize {
        self.ix().held()
    }

    pub fn exists(&self, tenant: u32, keys: &[Vec<u8>]) -> Vec<bool> {
        self.ix().exists(tenant, keys)
    }

    // ---- removal ---------------------------------------------------------------------------

    /// A block whose DRAM bytes failed their checksum on the way out: counted (for the server
    /// and its tenant) and removed, leased or not.
    pub fn drop_corrupt_key(&self, tenant: u32, key: &[u8]) {
        self.metrics.corrupt.inc();
        self.ix().note_corrupt(tenant);
        self.remove(tenant, &[key.to_vec()], true);
    }

    pub fn remove(&self, tenant: u32, keys: &[Vec<u8>], force: bool) -> Vec<ErrorCode> {
        let mut ix = self.ix();
        let (status, dropped, meta) = ix.remove(tenant, keys, force, Instant::now());
        self.meta.enqueue(meta);
        drop(ix);
        self.release(dropped);
        status
            .into_iter()
            .map(|s| match s {
                RemoveStatus::Ok => ErrorCode::Ok,
                RemoveStatus::NotFound => ErrorCode::NotFound,
                RemoveStatus::Leased => ErrorCode::Leased,
            })
            .collect()
    }

    /// Remove every block of the tenant; leased ones stay unless `force`. (removed, skipped)
    pub fn remove_all(&self, tenant: u32, force: bool) -> (u64, u64) {
        self.remove_matching(tenant, force, |_| true)
    }

    /// Remove the tenant's blocks whose key `matches`; leased ones stay unless `force`.
    /// (removed, skipped). One pass over the index under its lock.
    pub fn remove_matching(&self, tenant: u32, force: bool, matches: impl Fn(&[u8]) -> bool) -> (u64, u64) {
        let mut ix = self.ix();
        let (removed, skipped, dropped, meta) = ix.remove_all(tenant, force, Instant::now(), matches);
        self.meta.enqueue(meta);
        drop(ix);
        self.release(dropped);
        (removed, skipped)
    }

    /// Wait for every queued metadata change, then flush sled.
    pub fn flush(&self) {
        if let Err(e) = self.meta.flush() {
            warn!(error = %e, "metadata flush failed");
        }
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }
}

impl crate::policy::PolicySlots for Store {
    fn begin_swap(&self) -> Events {
        let mut pol = self.policies.lock();
        // The snapshot and the start of the tap are one instant: events before it are in the
        // snapshot (and fed to the current policies now), events after it reach the tap.
        let (ev, snapshot) = {
            let mut ix = self.ix();
            (ix.take_events(), ix.snapshot())
        };
        pol.feed(&ev);
        pol.start_tap();
        snapshot
    }

    fn abort_swap(&self) {
        self.policies.lock().abort_tap();
    }

    fn finish_swap(&self, slot: NewSlot) {
        let old = {
            let mut pol = self.policies.lock();
            self.feed(&mut pol);
            pol.swap(slot)
        };
        // The old module (and its wasmtime store) is dropped outside the lock.
        drop(old);
    }

    fn with_policies(&self, f: &mut dyn FnMut(&Policies)) {
        f(&self.policies.lock());
    }
}
